//! The server against real `poly-engine` children on the tiny CPU fixtures: switching frees the first
//! engine, a failing switch rolls back, an engine killed mid-answer gives the client an error and the next
//! request works, a client that disconnects cancels its generation, bad requests get clear errors in each
//! API's shape, and 100 concurrent requests are all answered or refused cleanly.
//!
//! Cost: two tiny models loaded a few times (each load well under a second in release) and a few hundred
//! generated tokens; about 10-20 s in release on 2 cores.

mod common;

use common::{process_alive, Home, Server, Stream};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn home_with_two_models(tag: &str) -> Home {
    let home = Home::new(tag);
    home.add_model(
        "qwen3",
        "qwen3moe-tiny-q4km.gguf",
        json!({"display_name": "Qwen3 tiny"}),
    );
    home.add_model("gemma3", "gemma3-tiny-q4km.gguf", json!({}));
    home
}

fn completion(server: &Server, model: &str, max_tokens: u32) -> common::Response {
    server.post(
        "/v1/completions",
        &json!({"model": model, "prompt": [1, 2, 3, 4], "max_tokens": max_tokens}),
    )
}

fn counters(server: &Server) -> Value {
    server.get("/health").json()["requests"].clone()
}

#[test]
fn registry_lists_models_with_fields_and_reasons() {
    let home = home_with_two_models("registry");
    // Unavailable models, each with its reason: a missing GGUF, a missing engine, a broken config.
    home.write_config(
        "nofile",
        &json!({"exe": common::engine_bin(), "args": ["--model", "/nonexistent.gguf"], "tokenizer": "packs/qwen3/tokenizer"}),
    );
    home.write_config(
        "noengine",
        &json!({"exe": "/nonexistent/poly-engine", "args": ["--model", common::fixture("qwen3moe-tiny-q4km.gguf")], "tokenizer": "packs/qwen3/tokenizer"}),
    );
    std::fs::write(home.dir.join("strata-broken.json"), "{").expect("write");
    let server = Server::start(&home, &[]);
    let models = server.get("/api/models").json();
    let list = models["models"].as_array().expect("models");
    let by_id = |id: &str| list.iter().find(|m| m["id"] == id).cloned().expect(id);
    let qwen = by_id("qwen3");
    assert_eq!(qwen["status"], "available");
    assert_eq!(qwen["display_name"], "Qwen3 tiny");
    assert_eq!(qwen["backend"], "qwen3moe");
    assert_eq!(qwen["context"], 4096);
    assert!(qwen["ram_gb"].as_f64().expect("ram_gb") > 0.0);
    assert!(qwen["vram_gb"]["all"].as_f64() >= qwen["vram_gb"]["least"].as_f64());
    assert_eq!(qwen["current"], false);
    let gemma = by_id("gemma3");
    assert_eq!(gemma["backend"], "gemma3");
    assert!(gemma["display_name"]
        .as_str()
        .is_some_and(|n| !n.is_empty()));
    for (id, needle) in [
        ("nofile", "nonexistent.gguf"),
        ("noengine", "not found"),
        ("broken", "invalid JSON"),
    ] {
        let m = by_id(id);
        assert_eq!(m["status"], "unavailable", "{id}");
        assert!(
            m["problem"].as_str().is_some_and(|p| p.contains(needle)),
            "{id}: {m}"
        );
    }
    // Loading an unavailable model is refused with the reason; an unknown one is not found.
    let r = server.post("/api/models/load", &json!({"model": "nofile"}));
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.json()["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("unavailable")));
    let r = server.post("/api/models/load", &json!({"model": "llama-9000"}));
    assert_eq!(r.status, 404);
    // OpenAI's list shows only models that can run.
    let openai = server.get("/v1/models").json();
    let ids: Vec<&str> = openai["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, vec!["gemma3", "qwen3"]);

    let out = common::polystrata()
        .arg("--list-models")
        .arg("--home")
        .arg(&home.dir)
        .output()
        .expect("--list-models");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(text.contains("qwen3  [available]  Qwen3 tiny"), "{text}");
    assert!(text.contains("backend qwen3moe"), "{text}");
    assert!(text.contains("nofile  [unavailable]"), "{text}");
}

#[test]
fn switching_frees_the_first_engine_and_a_failing_switch_rolls_back() {
    let home = home_with_two_models("switch");
    let bad_engine = home.script("bad-engine", "echo 'poly-engine: cannot load' >&2; exit 3");
    home.write_config(
        "bad",
        &json!({"exe": bad_engine, "args": ["--model", common::fixture("qwen3moe-tiny-q4km.gguf")], "tokenizer": "packs/qwen3/tokenizer"}),
    );
    let server = Server::start(&home, &[]);

    let r = server.post("/api/models/load", &json!({"model": "qwen3"}));
    assert_eq!(r.status, 200, "{}", r.text());
    let first = server.engine_pid().expect("qwen3 engine pid");
    assert!(process_alive(first));
    assert_eq!(completion(&server, "qwen3", 4).status, 200);

    let r = server.post("/api/models/load", &json!({"model": "gemma3"}));
    assert_eq!(r.status, 200, "{}", r.text());
    let second = server.engine_pid().expect("gemma3 engine pid");
    assert_ne!(first, second);
    // The old engine ended before the new one started: its process is gone.
    assert!(!process_alive(first), "the qwen3 engine {first} still runs");
    let current = server.get("/api/models/current").json();
    assert_eq!(current["model"], "gemma3");
    assert_eq!(current["ready"]["arch"], "gemma3");
    // The engine's resident memory is reported (the model's weights are mapped in).
    assert!(
        current["rss_bytes"].as_u64().is_some_and(|b| b > 1 << 20),
        "{current}"
    );
    let models = server.get("/api/models").json();
    let status = |id: &str| {
        models["models"]
            .as_array()
            .expect("models")
            .iter()
            .find(|m| m["id"] == id)
            .map(|m| (m["status"].clone(), m["current"].clone()))
    };
    assert_eq!(status("gemma3"), Some((json!("loaded"), json!(true))));
    assert_eq!(status("qwen3"), Some((json!("available"), json!(false))));

    // A request naming the other model switches through the same path.
    let r = completion(&server, "qwen3", 3);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["model"], "qwen3");
    assert!(!process_alive(second));
    let third = server.engine_pid().expect("pid");

    // A switch to an engine that exits at once fails, says so, and qwen3 is loaded again.
    let r = server.post("/api/models/load", &json!({"model": "bad"}));
    assert_eq!(r.status, 500, "{}", r.text());
    let message = r.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(message.contains("switch to bad failed"), "{message}");
    assert!(message.contains("qwen3 is loaded again"), "{message}");
    assert!(
        message.contains("cannot load"),
        "the engine's log is quoted: {message}"
    );
    assert!(!process_alive(third));
    let current = server.get("/api/models/current").json();
    assert_eq!(
        (current["model"].as_str(), current["loaded"].as_bool()),
        (Some("qwen3"), Some(true))
    );
    assert_eq!(completion(&server, "", 3).status, 200);

    // Unload stops the engine; the next request starts it again.
    let pid = server.engine_pid().expect("pid");
    let r = server.post("/api/models/unload", &json!({}));
    assert_eq!(r.status, 200);
    assert!(!process_alive(pid));
    assert_eq!(server.get("/api/models/current").json()["loaded"], false);
    assert_eq!(completion(&server, "", 2).status, 200);
    assert!(server
        .engine_pid()
        .is_some_and(|p| p != pid && process_alive(p)));

    // The server's shutdown takes its engine with it.
    let last = server.engine_pid().expect("pid");
    assert!(server.stop().success());
    assert!(!process_alive(last));
}

#[test]
fn killed_engine_gives_an_error_and_the_next_request_works() {
    let home = home_with_two_models("kill");
    let server = Server::start(&home, &["--load", "qwen3"]);
    let pid = server.engine_pid().expect("pid");
    let mut stream = Stream::open(
        &server.addr,
        "/v1/completions",
        &json!({"prompt": [1, 2, 3], "max_tokens": 3000, "stream": true, "temperature": 0}),
    );
    assert_eq!(stream.status, 200);
    let first = stream.next_data().expect("a first token");
    assert!(first.contains("text_completion"), "{first}");
    std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .expect("kill");
    let rest = stream.rest();
    let last = rest.last().expect("an event after the kill");
    let error: Value = serde_json::from_str(last).expect("JSON error event");
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("ended")),
        "{last}"
    );
    assert!(
        !rest.iter().any(|d| d == "[DONE]"),
        "a failed stream does not end with [DONE]"
    );
    assert_eq!(
        server.get("/health").json()["loaded"],
        false,
        "the death is noticed at once"
    );

    let r = completion(&server, "", 3);
    assert_eq!(r.status, 200, "{}", r.text());
    let new_pid = server.engine_pid().expect("restarted");
    assert_ne!(new_pid, pid);
    assert_eq!(counters(&server)["failed"], 1);
}

#[test]
fn client_disconnect_cancels_the_generation() {
    let home = home_with_two_models("cancel");
    let server = Server::start(&home, &["--load", "qwen3"]);
    for path in ["/v1/completions", "/v1/chat/completions", "/v1/messages"] {
        let body = match path {
            "/v1/completions" => {
                json!({"prompt": [1, 2, 3], "max_tokens": 4000, "stream": true, "temperature": 0})
            }
            "/v1/chat/completions" => {
                json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000, "stream": true, "temperature": 0})
            }
            _ => {
                json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000, "stream": true, "temperature": 0})
            }
        };
        let before = counters(&server)["cancelled"].as_u64().unwrap_or(0);
        let mut stream = Stream::open(&server.addr, path, &body);
        assert_eq!(stream.status, 200, "{path}");
        stream.next_data().expect("first event");
        stream.next_data().expect("second event");
        let dropped = Instant::now();
        drop(stream);
        // The next request is served right away: the engine stopped the abandoned one.
        let r = completion(&server, "", 2);
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(
            dropped.elapsed() < Duration::from_secs(20),
            "{path}: {:?}",
            dropped.elapsed()
        );
        assert_eq!(
            counters(&server)["cancelled"].as_u64(),
            Some(before + 1),
            "{path}"
        );
    }
}

#[test]
fn bad_requests_get_clear_errors_in_each_api_shape() {
    let home = home_with_two_models("errors");
    let server = Server::start(&home, &["--load", "qwen3"]);
    let r = server.post_raw("/v1/chat/completions", b"{not json", &[]);
    assert_eq!(r.status, 400);
    let e = r.json();
    assert_eq!(e["error"]["type"], "invalid_request_error");
    assert!(e["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("invalid JSON")));

    let r = server.post_raw("/v1/messages", b"[1,2]", &[]);
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["type"], "error");
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");

    let r = server.post(
        "/v1/chat/completions",
        &json!({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    let r = server.post(
        "/v1/messages",
        &json!({"model": "no-such-model", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["type"], "not_found_error");

    let r = server.post(
        "/v1/messages",
        &json!({"messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("max_tokens")));
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": [1, 999999], "max_tokens": 2}),
    );
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("outside the vocabulary")));
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": [1], "temperature": -1}),
    );
    assert_eq!(r.status, 400);
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": vec![1; 4096], "max_tokens": 2}),
    );
    assert_eq!(r.status, 400, "a prompt filling the context: {}", r.text());
    let r = server.get("/v1/nothing");
    assert_eq!(r.status, 404);
    let r = server.get("/v1/chat/completions");
    assert_eq!(r.status, 405);
    let r = server.post("/api/models/load", &json!({}));
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("model")));
    // After all that the engine still serves.
    assert_eq!(completion(&server, "", 2).status, 200);
}

#[test]
fn api_key_is_required_when_set() {
    let home = home_with_two_models("key");
    let server = Server::start(&home, &["--api-key", "sekrit"]);
    assert_eq!(server.get("/health").status, 200, "health needs no key");
    let r = server.get("/v1/models");
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["type"], "authentication_error");
    let ok = common::request(
        &server.addr,
        "GET",
        "/v1/models",
        None,
        &[("Authorization", "Bearer sekrit")],
    );
    assert_eq!(ok.status, 200);
    let ok = common::request(
        &server.addr,
        "GET",
        "/api/models",
        None,
        &[("x-api-key", "sekrit")],
    );
    assert_eq!(ok.status, 200);
}

#[test]
fn hundred_concurrent_requests_are_answered_or_refused_cleanly() {
    let home = home_with_two_models("concurrent");
    let server = Server::start(&home, &["--load", "qwen3", "--queue", "40"]);
    let addr = server.addr.clone();
    let handles: Vec<_> = (0..100)
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let body = json!({"prompt": [1, 2, 3, (i % 50) + 5], "max_tokens": 4});
                common::request(
                    &addr,
                    "POST",
                    "/v1/completions",
                    Some(body.to_string().as_bytes()),
                    &[],
                )
            })
        })
        .collect();
    let (mut answered, mut refused) = (0, 0);
    for h in handles {
        let r = h.join().expect("client thread");
        match r.status {
            200 => {
                let v = r.json();
                assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
                answered += 1;
            }
            503 => {
                assert_eq!(r.header("retry-after"), Some("2"));
                assert_eq!(r.json()["error"]["code"], "busy");
                refused += 1;
            }
            other => panic!("status {other}: {}", r.text()),
        }
    }
    assert_eq!(answered + refused, 100);
    assert!(
        answered >= 41,
        "at least the running one and the queue are served: {answered}"
    );
    let c = counters(&server);
    assert_eq!(c["completed"], answered);
    assert_eq!(c["refused_busy"], refused);
    eprintln!("100 concurrent: {answered} answered, {refused} refused with 503");
}

#[test]
fn a_switch_waits_for_the_running_request_and_is_refused_after_its_limit() {
    let home = home_with_two_models("switchwait");
    let server = Server::start(&home, &["--load", "qwen3", "--switch-wait", "1"]);
    let pid = server.engine_pid().expect("pid");
    let mut stream = Stream::open(
        &server.addr,
        "/v1/completions",
        &json!({"prompt": [1, 2, 3], "max_tokens": 3000, "stream": true, "temperature": 0}),
    );
    stream.next_data().expect("generating");
    let asked = Instant::now();
    let r = server.post("/api/models/load", &json!({"model": "gemma3"}));
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.json()["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("refused")));
    assert!(
        asked.elapsed() >= Duration::from_millis(900),
        "it waited for the request"
    );
    assert_eq!(
        server.engine_pid(),
        Some(pid),
        "the running model is untouched"
    );
    drop(stream);
    // With the request gone (cancelled), the switch goes through.
    let r = server.post("/api/models/load", &json!({"model": "gemma3"}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(!process_alive(pid));
}

#[test]
fn memory_debug_reports_free_memory_around_a_switch() {
    let home = Home::new("memdebug");
    home.add_model("qwen3", "qwen3moe-tiny-q4km.gguf", json!({}));
    home.add_model(
        "gemma3",
        "gemma3-tiny-q4km.gguf",
        json!({"memory_debug": true}),
    );
    let server = Server::start_logged(&home, &["--load", "qwen3"], &[]);
    let r = server.post("/api/models/load", &json!({"model": "gemma3"}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(server.stop().success());
    let log = std::fs::read_to_string(home.dir.join("server.log")).expect("log");
    let at = |needle: &str| {
        log.find(needle)
            .unwrap_or_else(|| panic!("{needle:?} missing from {log}"))
    };
    let before = at("memory before the switch: RAM available");
    let after_old = at("memory after the old engine ended: RAM available");
    let with_new = at("memory with the new engine: RAM available");
    assert!(
        before < after_old && after_old < with_new,
        "in order: {log}"
    );
    // The first load (qwen3, no memory_debug) printed nothing.
    assert_eq!(log.matches("memory before the switch").count(), 1, "{log}");
}

#[test]
fn the_blocking_client_lists_switches_chats_and_unloads() {
    use polystrata::client::{ChatDelta, Client, ClientError};
    let home = home_with_two_models("client");
    let server = Server::start(&home, &[]);
    let client = Client::new(server.addr.clone(), None);
    assert!(client.is_running());
    assert!(!Client::new("127.0.0.1:1", None).is_running());
    let models = client.models().expect("models");
    assert_eq!(models["models"].as_array().map(Vec::len), Some(2));
    assert_eq!(
        client.load("gem").expect("a unique part of a name")["current"]["model"],
        "gemma3"
    );
    match client.load("nothing") {
        Err(ClientError::Api {
            status: 404,
            message,
        }) => assert!(message.contains("not found")),
        other => panic!("{other:?}"),
    }
    let mut deltas = Vec::new();
    client
        .chat_stream(
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}),
            |d| deltas.push(d),
        )
        .expect("chat");
    let text: String = deltas
        .iter()
        .filter_map(|d| match d {
            ChatDelta::Content(t) | ChatDelta::Reasoning(t) => Some(t.as_str()),
            _ => None,
        })
        .collect();
    assert!(!text.is_empty());
    match deltas.last() {
        Some(ChatDelta::Finished { reason, usage }) => {
            assert_eq!(reason, "length");
            assert_eq!(usage["completion_tokens"], 6);
        }
        other => panic!("no finish: {other:?}"),
    }
    assert_eq!(client.unload().expect("unload")["current"]["loaded"], false);
    assert_eq!(client.current().expect("current")["model"], "gemma3");
}

#[test]
fn anthropic_count_tokens_and_wildcard_aliases() {
    let home = Home::new("count");
    home.add_model(
        "qwen3",
        "qwen3moe-tiny-q4km.gguf",
        json!({"aliases": ["claude-*"]}),
    );
    let server = Server::start(&home, &[]);
    let body = json!({"model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": "Hello there"}]});
    let r = server.post("/v1/messages/count_tokens", &body);
    assert_eq!(r.status, 503, "no model loaded yet: {}", r.text());
    // An agent's own model name reaches the model through the alias.
    let mut message = body.clone();
    message["max_tokens"] = json!(3);
    let m = server.post("/v1/messages", &message);
    assert_eq!(m.status, 200, "{}", m.text());
    let counted = server.post("/v1/messages/count_tokens", &body).json()["input_tokens"]
        .as_u64()
        .expect("input_tokens");
    let usage = &m.json()["usage"];
    let prompt = usage["input_tokens"].as_u64().unwrap_or(0)
        + usage["cache_read_input_tokens"].as_u64().unwrap_or(0);
    assert_eq!(
        counted, prompt,
        "count_tokens equals the prompt the engine read"
    );
}

#[test]
fn shutdown_during_a_generation_ends_the_engine() {
    let home = Home::new("shutdown");
    home.add_model("qwen3", "qwen3moe-tiny-q4km.gguf", json!({}));
    let server = Server::start(&home, &["--load", "qwen3"]);
    let pid = server.engine_pid().expect("pid");
    let mut stream = Stream::open(
        &server.addr,
        "/v1/completions",
        &json!({"prompt": [1, 2, 3], "max_tokens": 4000, "stream": true, "temperature": 0}),
    );
    stream.next_data().expect("generating");
    let asked = Instant::now();
    assert!(server.stop().success());
    assert!(
        asked.elapsed() < Duration::from_secs(20),
        "{:?}",
        asked.elapsed()
    );
    assert!(!process_alive(pid), "the engine outlived the server");
}

#[test]
fn an_engine_that_ignores_quit_gets_sigterm_then_sigkill() {
    let home = Home::new("stubborn");
    home.add_model("qwen3", "qwen3moe-tiny-q4km.gguf", json!({}));
    let ready = r#"READY {"protocol":1,"model":"x","arch":"qwen3moe","n_vocab":2048,"n_ctx":4096,"bos":null,"eos":[0],"device":"cpu","experts_total":0,"experts_vram":0}"#;
    // One ignores QUIT (it never reads stdin) but not SIGTERM; the other ignores both.
    let deaf = home.script("deaf-engine", &format!("echo '{ready}'\nexec sleep 1000"));
    let stubborn = home.script(
        "stubborn-engine",
        &format!("trap '' TERM\necho '{ready}'\nexec sleep 1000"),
    );
    for (name, exe) in [("deaf", &deaf), ("stubborn", &stubborn)] {
        home.write_config(
            name,
            &json!({"exe": exe, "args": ["--model", common::fixture("qwen3moe-tiny-q4km.gguf")], "tokenizer": "packs/qwen3/tokenizer"}),
        );
    }
    let server = Server::start_logged(&home, &["--quit-timeout", "1", "--term-timeout", "1"], &[]);
    for name in ["deaf", "stubborn"] {
        let r = server.post("/api/models/load", &json!({"model": name}));
        assert_eq!(r.status, 200, "{}", r.text());
        let pid = server.engine_pid().expect("pid");
        let r = server.post("/api/models/load", &json!({"model": "qwen3"}));
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(
            !process_alive(pid),
            "{name} engine {pid} survived the switch"
        );
    }
    assert!(server.stop().success());
    let log = std::fs::read_to_string(home.dir.join("server.log")).expect("log");
    assert!(
        log.contains("stopped deaf (signal: 15 (SIGTERM) after SIGTERM)"),
        "{log}"
    );
    assert!(
        log.contains("engine stubborn ignored SIGTERM; SIGKILL"),
        "{log}"
    );
    assert!(
        log.contains("stopped stubborn (signal: 9 (SIGKILL) after SIGKILL)"),
        "{log}"
    );
}

#[test]
fn a_model_without_chat_template_refuses_chat_and_still_completes() {
    let home = Home::new("notemplate");
    home.add_model("plain", "qwen3moe-tiny-q4km.gguf", json!({}));
    // The tokenizer directory of a GGUF without a template: no template file, none named in the config.
    let tok = home.dir.join("packs/plain/tokenizer");
    std::fs::remove_file(tok.join("chat_template.jinja")).expect("template file");
    let config_path = tok.join("tokenizer_config.json");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).expect("config"))
            .expect("json");
    config["chat_template"] = Value::Null;
    std::fs::write(&config_path, config.to_string()).expect("write config");
    let server = Server::start(&home, &["--load", "plain"]);
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    let message = r.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        message.contains("no chat template") && message.contains("/v1/completions"),
        "{message}"
    );
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": "Once upon", "max_tokens": 3}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 3);
}

#[test]
fn the_engine_child_sees_only_the_allowed_environment() {
    // The qwen3 model brings the tokenizer pack the fake engine's config names.
    let home = home_with_two_models("env");
    // An engine that writes down what it was given, then fails to load.
    let seen = home.dir.join("engine-env.txt");
    let exe = home.script(
        "env-engine",
        &format!(
            "env > '{}'\necho 'poly-engine: cannot load' >&2\nexit 3",
            seen.display()
        ),
    );
    home.write_config(
        "envcheck",
        &json!({"exe": exe, "args": ["--model", common::fixture("qwen3moe-tiny-q4km.gguf")], "tokenizer": "packs/qwen3/tokenizer"}),
    );
    let server = Server::start_logged(
        &home,
        &[],
        &[
            ("POLY_FUSE", "off"),
            ("POLY_TEST_LEAK", "1"),
            ("POLY_GPU_PROFILE", "1"),
        ],
    );
    let r = server.post("/api/models/load", &json!({"model": "envcheck"}));
    assert_ne!(r.status, 200, "{}", r.text());
    let env = std::fs::read_to_string(&seen)
        .unwrap_or_else(|e| panic!("the engine did not run ({e}): {}", r.text()));
    let names: Vec<&str> = env.lines().filter_map(|l| l.split('=').next()).collect();
    assert!(!names.contains(&"POLY_TEST_LEAK"), "{env}");
    assert!(!names.contains(&"POLY_FUSE"), "{env}");
    // Diagnosis passes through, and PATH (the engine finds its tools).
    assert!(names.contains(&"POLY_GPU_PROFILE"), "{env}");
    assert!(names.contains(&"PATH"), "{env}");
}
