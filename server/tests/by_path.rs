//! A GGUF served by its path: `polystrata serve --gguf FILE` on an empty home registers the file (a
//! tokenizer directory in the home's cache, a run config beside the others), loads it and answers a
//! chat; a second start reuses both; a file that is not a GGUF is refused at start with the reason.
//!
//! Real engine on the tiny qwen3moe fixture. Cost: a second or two.

mod common;

use common::{fixture, Home, Server};
use serde_json::json;

#[test]
fn serve_gguf_registers_the_file_and_serves_it() {
    let home = Home::new("by-path");
    let gguf = fixture("qwen3moe-tiny-q4km.gguf");
    let gguf_arg = gguf.display().to_string();
    let server = Server::start(&home, &["--gguf", &gguf_arg]);
    let current = server.get("/api/models/current").json();
    assert_eq!(current["model"], "qwen3moe-tiny-q4km", "{current}");
    assert_eq!(current["loaded"], true, "loaded at start: {current}");
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    server.stop();
    assert!(home
        .dir
        .join("cache/tokenizers/qwen3moe-tiny-q4km/tokenizer_config.json")
        .is_file());
    let config = home.dir.join("strata-qwen3moe-tiny-q4km.json");
    assert!(config.is_file());

    // Again, the cache cleared: the same id, no second config, the tokenizer directory written again.
    std::fs::remove_dir_all(home.dir.join("cache")).expect("clear the cache");
    let server = Server::start(&home, &["--gguf", &gguf_arg]);
    let models = server.get("/api/models").json();
    assert_eq!(
        models["models"].as_array().map(Vec::len),
        Some(1),
        "{models}"
    );
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    server.stop();

    // Not a GGUF: refused at start, saying why.
    let bad = home.dir.join("notes.gguf");
    std::fs::write(&bad, b"not a model").expect("write");
    let out = common::polystrata()
        .args(["serve", "--home"])
        .arg(&home.dir)
        .arg("--gguf")
        .arg(&bad)
        .args(["--port", "0"])
        .output()
        .expect("run polystrata");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot serve"), "{stderr}");
}

#[test]
fn the_terminal_chat_takes_a_file_by_path() {
    use std::io::Write;
    let home = Home::new("by-path-chat");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let mut child = common::polystrata()
        .arg("--home")
        .arg(&home.dir)
        .args(["--port", &port.to_string(), "--model"])
        .arg(fixture("qwen3moe-tiny-q4km.gguf"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the chat");
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(b"/set max_tokens 3\nHello\n/quit\n");
    }
    let out = child.wait_with_output().expect("the chat ends");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("qwen3moe-tiny-q4km"), "{stdout}");
    assert!(home.dir.join("strata-qwen3moe-tiny-q4km.json").is_file());

    // A path that names no file: said so, no server started.
    let out = common::polystrata()
        .arg("--home")
        .arg(&home.dir)
        .args([
            "--port",
            &port.to_string(),
            "--model",
            "./no-such-model.gguf",
        ])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run the chat");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("./no-such-model.gguf: no such file"),
        "{stderr}"
    );
    assert!(!stderr.contains("listening"), "{stderr}");
}

/// Only the command line registers a file: a model name from a request that is a GGUF's path is looked
/// up in the registry like any other name, not opened.
#[test]
fn a_path_in_a_request_is_only_a_name() {
    let home = Home::new("by-path-request");
    let gguf = fixture("qwen3moe-tiny-q4km.gguf").display().to_string();
    let server = Server::start(&home, &[]);
    let load = server.post("/api/models/load", &json!({"model": gguf}));
    assert_eq!(load.status, 404, "{}", load.text());
    let chat = server.post(
        "/v1/chat/completions",
        &json!({"model": gguf, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    );
    assert_eq!(chat.status, 404, "{}", chat.text());
    let ollama = server.post(
        "/api/chat",
        &json!({"model": gguf, "messages": [{"role": "user", "content": "Hi"}], "stream": false}),
    );
    assert_eq!(ollama.status, 404, "{}", ollama.text());
    server.stop();
    let written: Vec<_> = std::fs::read_dir(&home.dir)
        .expect("the home")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("strata-") || n == "cache")
        .collect();
    assert!(written.is_empty(), "nothing registered: {written:?}");
}

/// A relative `--home`: the run config's tokenizer directory is written relative to the home, so it
/// is found where it was written (not under the home twice).
#[test]
fn a_relative_home_finds_its_tokenizer_directory() {
    use std::io::BufRead;
    let home = Home::new("by-path-relative");
    let mut child = common::polystrata()
        .current_dir(&home.dir)
        .args(["serve", "--home", "h", "--port", "0", "--gguf"])
        .arg(fixture("qwen3moe-tiny-q4km.gguf"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start polystrata serve");
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        let _ = std::io::BufReader::new(out).read_line(&mut line);
    }
    let _ = std::process::Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status();
    let _ = child.wait();
    assert!(line.contains("listening"), "{line}");
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(home.dir.join("h/strata-qwen3moe-tiny-q4km.json"))
            .expect("config"),
    )
    .expect("json");
    let tokenizer = config["tokenizer"].as_str().expect("a tokenizer path");
    assert!(
        home.dir
            .join("h")
            .join(tokenizer)
            .join("tokenizer_config.json")
            .is_file(),
        "{config}"
    );
}

/// `polystrata benchmark --model FILE.gguf` takes the file as the chat and `serve --gguf` do: it is
/// registered in the home and measured under its id; a path naming no file stops before any engine.
#[test]
fn the_benchmark_takes_a_file_by_path() {
    let home = Home::new("by-path-bench");
    let gguf = fixture("qwen3moe-tiny-q4km.gguf");
    let out = common::polystrata()
        .arg("benchmark")
        .arg("--home")
        .arg(&home.dir)
        .arg("--model")
        .arg(&gguf)
        .args(["--json", "--prompt-tokens", "20", "--answer-tokens", "2"])
        .output()
        .expect("run polystrata benchmark");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "benchmark by path failed: {stderr}");
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("the benchmark's JSON");
    assert_eq!(report["model"], "qwen3moe-tiny-q4km", "{report}");
    assert!(home.dir.join("strata-qwen3moe-tiny-q4km.json").is_file());

    let out = common::polystrata()
        .arg("benchmark")
        .arg("--home")
        .arg(&home.dir)
        .args(["--model", "./missing.gguf", "--answer-tokens", "2"])
        .output()
        .expect("run polystrata benchmark");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no such file"), "{stderr}");
}
