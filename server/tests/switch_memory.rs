//! The server's own memory over many model switches (issue 20: 298 MB after the first load, 1.05 GB after
//! 14 switches and still after unload): 30 switches between two fixture models, each answering a chat,
//! must leave the server's resident memory within a bound of what it was after the first two, and an
//! unload must not add to it. With SmolLM2 as one of the two, the server grew from 46 to 118 MiB before
//! the switch gave freed heap pages back (`engine::memory::give_back_freed`); it stays at 27 MiB now.
//!
//! Real engines on the tiny qwen3moe and gemma3 fixtures. Cost: about 30 engine starts, some seconds.
//! Environment: `POLY_SMOLLM2_GGUF` locates the SmolLM2 file (tests/run.sh sets it).

mod common;

use common::{rss_bytes, Home, Server};
use serde_json::json;

const MIB: u64 = 1 << 20;

fn switch_and_chat(server: &Server, model: &str) {
    let r = server.post("/api/models/load", &json!({"model": model}));
    assert_eq!(r.status, 200, "{}", r.text());
    let c = server.post(
        "/v1/chat/completions",
        &json!({"model": model, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(c.status, 200, "{}", c.text());
}

#[test]
fn thirty_switches_keep_the_servers_memory_bounded() {
    let home = Home::new("switch-memory");
    home.add_model("a", "qwen3moe-tiny-q4km.gguf", json!({}));
    // A real vocabulary (49k tokens) makes a text side worth leaking: SmolLM2 when it is here
    // (`POLY_SMOLLM2_GGUF`, which tests/run.sh sets, or target/smollm2/ where demo.rs fetches it).
    let smollm2 = std::env::var_os("POLY_SMOLLM2_GGUF")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            common::workspace_root().join("target/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    if smollm2.is_file() {
        let tok = home.tokenizer_for("b", &smollm2);
        home.write_config(
            "b",
            &json!({
                "exe": common::engine_bin(),
                "args": ["--model", smollm2, "--max-context", "512", "--threads", "1"],
                "tokenizer": tok,
            }),
        );
    } else {
        eprintln!("SmolLM2 not present: switching between the tiny fixtures only");
        home.add_model("b", "gemma3-tiny-q4km.gguf", json!({}));
    }
    let server = Server::start(&home, &[]);
    let pid = server.pid();
    switch_and_chat(&server, "a");
    switch_and_chat(&server, "b");
    let after_two = rss_bytes(pid).expect("the server's RSS");
    let mut readings = Vec::new();
    for i in 0..30 {
        switch_and_chat(&server, if i % 2 == 0 { "a" } else { "b" });
        readings.push(rss_bytes(pid).expect("the server's RSS") / MIB);
    }
    let after_thirty = rss_bytes(pid).expect("the server's RSS");
    let r = server.post("/api/models/unload", &json!({}));
    assert_eq!(r.status, 200);
    let after_unload = rss_bytes(pid).expect("the server's RSS");
    eprintln!(
        "server RSS: {} MiB after 2 switches, {} MiB after 30 more, {} MiB after unload; per switch: {readings:?}",
        after_two / MIB,
        after_thirty / MIB,
        after_unload / MIB
    );
    // Each model's text side (tokenizer, template) is a few MiB for these fixtures; a leak of one per
    // switch would add 30 of them.
    assert!(
        after_thirty <= after_two + 16 * MIB,
        "the server grew from {} MiB to {} MiB over 30 switches: {readings:?}",
        after_two / MIB,
        after_thirty / MIB
    );
    assert!(after_unload <= after_thirty + 4 * MIB);
    server.stop();
}
