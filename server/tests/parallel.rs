//! `polystrata serve --parallel N` with the real engine, through the official `openai` Python client
//! (tests/server/parallel.py): with two places a short request sent while a long answer streams is
//! answered while the long one still streams; with one (the default) it waits until the long one ends.
//! `/health`, `/metrics` and `/props`' `total_slots` show the places (queue_shown.rs: the requests
//! running and waiting).
//!
//! Python: `POLYSTRATA_PYTHON`, else `python3`; it needs `pip install -r tests/server/requirements.txt`.
//! Cost: two servers, a few hundred tokens of the tiny qwen3moe fixture each.

mod common;

use common::{Home, Server};
use serde_json::{json, Value};
use std::process::Command;

fn python() -> String {
    std::env::var("POLYSTRATA_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Most tokens of the long answer. The fixture's greedy answer to parallel.py's prompt ends by itself
/// after about 125 tokens; the test asks for at least [`LONG_CHUNKS`] chunks, long enough that a short
/// request fits in its time many times over.
const LONG_TOKENS: u32 = 600;
const LONG_CHUNKS: u64 = 100;

/// The client stamps each chunk when its thread gets to it (Python's threads take turns), so on a busy
/// machine a few of the long answer's chunks, already received, are stamped after the short answer's end
/// even with one place (CI saw 5 of 127); with two places CI saw 32 and more.
const LAG_CHUNKS: u64 = 8;

/// Runs parallel.py against a server started with `args`, returning its JSON report.
/// Returns parallel.py's report, `/health`, `/metrics` and `/props` after it.
fn long_and_short(tag: &str, args: &[&str]) -> (Value, Value, String, Value) {
    let home = Home::new(tag);
    home.add_model("qwen3", "qwen3moe-tiny-q4km.gguf", json!({}));
    let server = Server::start(&home, args);
    let script = common::workspace_root().join("tests/server/parallel.py");
    let out = Command::new(python())
        .arg(&script)
        .env("POLYSTRATA_URL", format!("http://{}", server.addr))
        .env("POLYSTRATA_MODEL", "qwen3")
        .env("LONG_TOKENS", LONG_TOKENS.to_string())
        .output()
        .expect("run parallel.py");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "parallel.py failed (pip install -r tests/server/requirements.txt, or set POLYSTRATA_PYTHON):\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_str(stdout.trim()).expect("parallel.py's JSON");
    assert!(
        report["long_chunks"].as_u64().unwrap_or(0) >= LONG_CHUNKS,
        "the long answer was short: {report}"
    );
    assert_eq!(report["short_tokens"], 4, "{report}");
    let health = server.get("/health").json();
    let metrics = server.get("/metrics").text();
    let props = server.get("/props").json();
    (report, health, metrics, props)
}

fn seconds(v: &Value) -> f64 {
    v.as_f64().expect("a time")
}

#[test]
fn a_short_request_is_answered_while_a_long_one_streams_with_two_places() {
    let (report, health, metrics, props) = long_and_short("parallel-2", &["--parallel", "2"]);
    assert!(
        seconds(&report["short_done"]) < seconds(&report["long_done"]),
        "{report}"
    );
    // Part of the long answer came after the short one was complete: more than the client's lag.
    let after = report["long_chunks_after_short"].as_u64().unwrap_or(0);
    assert!(after >= LAG_CHUNKS * 2, "{report}");
    assert_eq!(
        health["slots"],
        json!({"parallel": 2, "running": 0, "waiting": 0}),
        "{health}"
    );
    assert!(metrics.contains("polystrata_parallel_slots 2"), "{metrics}");
    // llama-server's `/props` says its `-np` as `total_slots`.
    assert_eq!(props["total_slots"], 2, "{props}");
}

#[test]
fn a_short_request_waits_for_the_long_one_with_one_place() {
    let (report, health, metrics, props) = long_and_short("parallel-1", &[]);
    // The short answer ended after the long one (up to the client's lag in stamping its chunks).
    let after = report["long_chunks_after_short"]
        .as_u64()
        .unwrap_or(u64::MAX);
    assert!(after <= LAG_CHUNKS, "{report}");
    assert_eq!(health["slots"]["parallel"], 1, "{health}");
    assert!(metrics.contains("polystrata_parallel_slots 1"), "{metrics}");
    assert_eq!(props["total_slots"], 1, "{props}");
}
