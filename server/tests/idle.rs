//! Idle unload (`--idle-unload SECS`, Ollama's `keep_alive`) and `polystrata ps`: an engine unused for
//! the bound is unloaded and the next request loads it again; `keep_alive: 0` unloads after the request,
//! `-1` keeps it past the bound; `ps` says what is loaded, its memory, for how long and when it goes.
//!
//! Real engine on the tiny qwen3moe fixture. Cost: about 8 s (waiting for the bounds).

mod common;

use common::{process_alive, Home, Server};
use serde_json::json;
use std::time::{Duration, Instant};

fn wait_until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < limit,
            "{what} did not happen within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn port_of(server: &Server) -> String {
    server.addr.rsplit(':').next().unwrap_or("0").to_string()
}

#[test]
fn an_unused_engine_is_unloaded_and_keep_alive_overrides() {
    let home = Home::new("idle");
    home.add_model("tiny", "qwen3moe-tiny-q4km.gguf", json!({}));
    let server = Server::start(&home, &["--load", "tiny", "--idle-unload", "2"]);
    let pid = server.engine_pid().expect("an engine");
    let current = server.get("/api/models/current").json();
    assert!(
        current["unload_in_s"].as_u64().is_some_and(|s| s <= 2),
        "{current}"
    );

    // `polystrata ps` against this server.
    let out = common::polystrata()
        .args(["ps", "--port", &port_of(&server)])
        .output()
        .expect("run polystrata ps");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("tiny") && text.contains("MiB") && text.contains(&pid.to_string()),
        "{text}"
    );
    // The VRAM column, empty on the CPU: the engine reports none (`vram_bytes` null).
    assert!(text.starts_with("MODEL") && text.contains("VRAM"), "{text}");
    let current = server.get("/api/models/current").json();
    assert!(
        current.get("vram_bytes").is_some_and(|v| v.is_null()),
        "{current}"
    );

    wait_until("the idle unload", Duration::from_secs(10), || {
        !process_alive(pid)
    });
    assert_eq!(server.get("/api/models/current").json()["loaded"], false);
    // The next request loads it again.
    let r = server.post(
        "/api/generate",
        &json!({"model": "tiny", "prompt": "Hi", "raw": true, "stream": false,
                "keep_alive": -1, "options": {"num_predict": 2}}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let again = server.engine_pid().expect("loaded again");
    // keep_alive -1: it stays past the bound.
    std::thread::sleep(Duration::from_secs(3));
    assert!(process_alive(again), "keep_alive -1 keeps the engine");
    assert!(server.get("/api/models/current").json()["unload_in_s"].is_null());
    // keep_alive 0: unloaded right after the request (Ollama's way to unload).
    let r = server.post("/api/generate", &json!({"model": "tiny", "keep_alive": 0}));
    assert_eq!(r.status, 200, "{}", r.text());
    wait_until("the keep_alive 0 unload", Duration::from_secs(5), || {
        !process_alive(again)
    });
    let bad = server.post(
        "/api/chat",
        &json!({"model": "tiny", "keep_alive": "soon", "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(bad.status, 400);
    server.stop();
}
