//! Issue 17, item 5: an engine that is alive but stuck (SIGSTOP, a hang) is detected by its silence while
//! it owes an answer (`--stall-timeout`), killed and started again; its requests are answered with an
//! error that names the cause, `/health` does not say ok for it, unload does not wait forever, and a long
//! read that reports `PROGRESS` is not taken for a stall. Also: a dead engine's error says how it died.
//!
//! Cost: the tiny qwen3moe fixture on the real engine, a few fake engines (shell scripts), and the
//! 2-second stall bound waited out a few times: about 30 s.

mod common;

use common::{process_alive, Home, Server, Stream};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn signal(pid: i32, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill {sig} {pid}");
}

fn completion(server: &Server, max_tokens: u32) -> common::Response {
    server.post(
        "/v1/completions",
        &json!({"prompt": [1, 2, 3], "max_tokens": max_tokens}),
    )
}

fn log_of(home: &Home) -> String {
    std::fs::read_to_string(home.dir.join("server.log")).unwrap_or_default()
}

#[test]
fn a_stopped_engine_is_killed_and_replaced_and_its_requests_say_why() {
    let home = Home::new("stall");
    home.add_model("qwen3", "qwen3moe-tiny-q4km.gguf", json!({}));
    let server = Server::start_logged(
        &home,
        &[
            "--load",
            "qwen3",
            "--stall-timeout",
            "2",
            "--quit-timeout",
            "1",
        ],
        &[],
    );
    assert!(
        log_of(&home).contains("stall timeout 2 s"),
        "the bound is in the startup log: {}",
        log_of(&home)
    );
    assert_eq!(server.get("/health").status, 200);
    let pid = server.engine_pid().expect("pid");

    let mut stream = Stream::open(
        &server.addr,
        "/v1/completions",
        &json!({"prompt": [1, 2, 3], "max_tokens": 3000, "stream": true, "temperature": 0}),
    );
    assert_eq!(stream.status, 200);
    stream.next_data().expect("a first token");
    signal(pid, "-STOP");
    let stopped = Instant::now();
    // A request queued behind the stuck one is served by the engine started after it.
    let addr = server.addr.clone();
    let queued = std::thread::spawn(move || {
        common::request(
            &addr,
            "POST",
            "/v1/completions",
            Some(
                json!({"prompt": [1, 2, 3], "max_tokens": 2})
                    .to_string()
                    .as_bytes(),
            ),
            &[],
        )
    });
    let rest = stream.rest();
    let last = rest.last().expect("an event after the stall");
    let error: Value = serde_json::from_str(last).expect("JSON error event");
    let message = error["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("made no progress for 2 s"), "{last}");
    assert!(message.contains("SIGKILL"), "how it ended: {last}");
    assert!(
        stopped.elapsed() < Duration::from_secs(30),
        "{:?}",
        stopped.elapsed()
    );
    assert!(!process_alive(pid), "the stuck engine was killed");

    let queued = queued.join().expect("queued request");
    assert_eq!(queued.status, 200, "{}", queued.text());
    let new_pid = server.engine_pid().expect("restarted");
    assert_ne!(new_pid, pid);
    assert_eq!(server.get("/health").status, 200);
    assert!(log_of(&home).contains("made no progress for 2 s"));

    // An idle engine that is stopped: /health says so (an unanswered STATS), the watchdog replaces it
    // at the bound, and the next request is served.
    signal(new_pid, "-STOP");
    let h = server.get("/health");
    assert_eq!(h.status, 503, "{}", h.text());
    assert_eq!(h.json()["status"], "stalled", "{}", h.text());
    // (A request sent before the watchdog fires would meet the stuck engine and fail with the cause.)
    let waited = Instant::now();
    // Gone, and the server has seen it go: a request sent between the kill and the engine's stdout
    // ending would still meet the dying engine and get its cause (a test race, at load 7 on 2 cores).
    while process_alive(new_pid) || server.get("/api/models/current").json()["loaded"] != false {
        assert!(waited.elapsed() < Duration::from_secs(30), "never killed");
        std::thread::sleep(Duration::from_millis(100));
    }
    let r = completion(&server, 2);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(server.get("/health").status, 200);

    // Unload while a request is stuck: it waits for the watchdog, not forever.
    let pid = server.engine_pid().expect("pid");
    let mut stream = Stream::open(
        &server.addr,
        "/v1/completions",
        &json!({"prompt": [1, 2, 3], "max_tokens": 3000, "stream": true, "temperature": 0}),
    );
    stream.next_data().expect("a first token");
    signal(pid, "-STOP");
    let asked = Instant::now();
    let r = server.post("/api/models/unload", &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        asked.elapsed() < Duration::from_secs(30),
        "{:?}",
        asked.elapsed()
    );
    assert!(stream
        .rest()
        .last()
        .is_some_and(|l| l.contains("made no progress")));
    assert!(!process_alive(pid));
}

const READY: &str = r#"READY {"protocol":1,"model":"x","arch":"qwen3moe","n_vocab":2048,"n_ctx":4096,"bos":null,"eos":[0],"device":"cpu","experts_total":0,"experts_vram":0}"#;

/// A fake engine that answers each GEN after `before_answer` (a shell snippet; `$id` is the request's
/// id), with one token and DONE.
fn fake_engine(home: &Home, name: &str, before_answer: &str) {
    let body = format!(
        r#"echo '{READY}'
while IFS= read -r line; do
  case "$line" in
    GEN*)
      id=$(printf '%s' "$line" | sed 's/.*"id":"\([^"]*\)".*/\1/')
      {before_answer}
      echo "T {{\"id\":\"$id\",\"tokens\":[5],\"logprobs\":[-0.5]}}"
      echo "DONE {{\"id\":\"$id\",\"reason\":\"length\",\"prompt_tokens\":3,\"cached_tokens\":0,\"generated\":1,\"prefill_ms\":1.0,\"decode_ms\":1.0,\"experts_vram_share\":null}}";;
    STATS*) echo 'STATS {{"rss_bytes":1,"vram_bytes":null,"conversations":[],"parked_bytes":0,"park_limit_bytes":0}}';;
    QUIT*) exit 0;;
  esac
done"#
    );
    let exe = home.script(&format!("{name}-engine"), &body);
    home.write_config(
        name,
        &json!({"exe": exe, "args": ["--model", common::fixture("qwen3moe-tiny-q4km.gguf")], "tokenizer": "packs/qwen3/tokenizer", "model_name": name}),
    );
}

#[test]
fn a_long_read_that_reports_progress_is_not_a_stall_and_deaths_say_how() {
    let home = Home::new("progress");
    home.add_model("qwen3", "qwen3moe-tiny-q4km.gguf", json!({}));
    // Four seconds of reading, a PROGRESS line each second: within a 2-second bound throughout.
    fake_engine(
        &home,
        "reads",
        r#"for i in 1 2 3 4; do sleep 1; echo "PROGRESS {\"id\":\"$id\",\"prompt_read\":$i,\"prompt_tokens\":5}"; done"#,
    );
    // The same four seconds in silence: a stall.
    fake_engine(&home, "silent", "sleep 4");
    // One that dies on its first request.
    fake_engine(&home, "dies", "exit 3");
    let server = Server::start_logged(&home, &["--stall-timeout", "2"], &[]);

    let r = server.post(
        "/v1/completions",
        &json!({"model": "reads", "prompt": [1, 2, 3], "max_tokens": 1}),
    );
    assert_eq!(r.status, 200, "{}", r.text());

    let r = server.post(
        "/v1/completions",
        &json!({"model": "silent", "prompt": [1, 2, 3], "max_tokens": 1}),
    );
    assert!(r.status >= 500, "{}", r.text());
    assert!(
        r.text().contains("made no progress for 2 s"),
        "{}",
        r.text()
    );

    let r = server.post(
        "/v1/completions",
        &json!({"model": "dies", "prompt": [1, 2, 3], "max_tokens": 1}),
    );
    assert!(r.status >= 500, "{}", r.text());
    assert!(r.text().contains("exit status: 3"), "{}", r.text());
}

#[test]
fn a_run_config_sets_its_own_stall_bound() {
    let home = Home::new("stall-config");
    home.add_model("qwen3", "qwen3moe-tiny-q4km.gguf", json!({}));
    fake_engine(&home, "silent", "sleep 3");
    // The config turns the watchdog off for this model: the server's 1-second bound does not apply.
    let mut config: Value = serde_json::from_str(
        &std::fs::read_to_string(home.dir.join("strata-silent.json")).expect("config"),
    )
    .expect("json");
    config["stall_timeout_s"] = json!(0);
    home.write_config("silent", &config);
    let server = Server::start_logged(&home, &["--stall-timeout", "1"], &[]);
    let r = server.post(
        "/v1/completions",
        &json!({"model": "silent", "prompt": [1, 2, 3], "max_tokens": 1}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}

/// A GGUF whose `context_length` is 0: the engine refuses it with an ERR naming the key unless
/// `--max-context` gives one (as llama.cpp refuses "n_ctx and n_ctx_train cannot both be zero"),
/// instead of announcing `n_ctx` 0 and refusing every request.
#[test]
fn a_model_file_with_context_length_0_needs_max_context() {
    let home = Home::new("ctx0");
    let mut bytes = std::fs::read(common::fixture("qwen3moe-tiny-q4km.gguf")).expect("fixture");
    let key = b"qwen3moe.context_length";
    let at = bytes
        .windows(key.len())
        .position(|w| w == key)
        .expect("context_length key")
        + key.len();
    assert_eq!(bytes[at..at + 4], 4u32.to_le_bytes(), "a u32 value");
    bytes[at + 4..at + 8].copy_from_slice(&0u32.to_le_bytes());
    let file = home.dir.join("ctx0.gguf");
    std::fs::write(&file, &bytes).expect("write");
    let run = |args: &[&str]| {
        std::process::Command::new(common::engine_bin())
            .arg("--model")
            .arg(&file)
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run the engine")
    };
    let out = run(&[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(
        stdout.starts_with("ERR ") && stdout.contains("context_length is 0"),
        "{stdout}"
    );
    let out = run(&["--max-context", "64"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.starts_with("READY ") && stdout.contains("\"n_ctx\":64"),
        "{stdout}"
    );
}
