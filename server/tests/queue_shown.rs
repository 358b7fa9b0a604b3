//! `/health` and `/metrics` show the queue (issue 20): while a request holds the engine's only place
//! (the engine stopped with SIGSTOP mid-answer, so it cannot end meanwhile) and another waits,
//! `/health`'s `slots` says one running and one waiting, and `/metrics` llama-server's
//! `requests_processing` and `requests_deferred` the same; then both are let go.
//!
//! A file of its own so that it never runs beside parallel.rs' timing-sensitive cases. Real engine on
//! the tiny qwen3moe fixture; about a second.

mod common;

use common::{Home, Server, Stream};
use serde_json::json;
use std::process::Command;
use std::time::{Duration, Instant};

/// While a request holds the only place (its engine stopped with SIGSTOP mid-answer, so it cannot end
/// meanwhile) and another waits, `/health`'s `slots` and `/metrics`' llama-server gauges say so; both
/// are answered once the engine goes on.
#[test]
fn health_and_metrics_show_the_running_and_waiting_requests() {
    let home = Home::new("queue-shown");
    home.add_model("qwen3", "qwen3moe-tiny-q4km.gguf", json!({}));
    let server = Server::start(&home, &["--load", "qwen3"]);
    let pid = server.engine_pid().expect("the engine's pid");
    let signal = |sig: &str| {
        let ok = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {sig} {pid}");
    };
    let mut long = Stream::open(
        &server.addr,
        "/v1/completions",
        &json!({"prompt": [1, 2, 3], "max_tokens": 3000, "stream": true, "temperature": 0}),
    );
    assert_eq!(long.status, 200);
    long.next_data().expect("a first token");
    signal("-STOP");
    let addr = server.addr.clone();
    let queued = std::thread::spawn(move || {
        let body = json!({"prompt": [1, 2, 3], "max_tokens": 2}).to_string();
        common::request(&addr, "POST", "/v1/completions", Some(body.as_bytes()), &[])
    });
    let start = Instant::now();
    loop {
        let health = server.get("/health").json();
        if health["slots"] == json!({"parallel": 1, "running": 1, "waiting": 1}) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "/health never showed one running and one waiting: {health}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let metrics = server.get("/metrics").text();
    assert!(
        metrics.contains("\nllamacpp:requests_processing 1\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("\nllamacpp:requests_deferred 1\n"),
        "{metrics}"
    );
    signal("-CONT");
    // The long answer is let go (a disconnect cancels it); the one behind it is then served.
    drop(long);
    let queued = queued.join().expect("the queued request");
    assert_eq!(queued.status, 200, "{}", queued.text());
    assert_eq!(
        server.get("/health").json()["slots"],
        json!({"parallel": 1, "running": 0, "waiting": 0})
    );
    server.stop();
}
