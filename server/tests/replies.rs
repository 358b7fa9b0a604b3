//! Replies with reasoning and tool calls through the whole server: the real tokenizer, template, parser
//! and HTTP layers, with `tests/server/replay_engine.py` standing in for the engine so that the model
//! "writes" a chosen reply (the synthetic fixtures write noise). Checks OpenAI `reasoning_content` and
//! `tool_calls` (streaming and not, finish_reason `tool_calls`) and Anthropic `thinking` and `tool_use`
//! blocks (streaming and not, stop_reason `tool_use`), a malformed call kept as text, and stop strings.
//!
//! Cost: no model runs; about a second.

mod common;

use common::{Home, Server, Stream};
use polystrata::text::tokenizer_dir::TextTokenizer;
use serde_json::{json, Value};

const REASONING: &str = "I should check the weather.";
const TOOL_REPLY: &str = "<think>I should check the weather.</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
const ANSWER_REPLY: &str =
    "<think>The tool says sunny.</think>\n\nIt is sunny in Paris. END and more";
const BROKEN_REPLY: &str =
    "<think>Let me see.</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"argum";

/// Reply `i` is chosen by `max_tokens` = 100 + i.
const TOOL: u32 = 100;
const ANSWER: u32 = 101;
const BROKEN: u32 = 102;

fn setup() -> (Home, Server) {
    let home = Home::new("replies");
    let gguf = common::fixture("qwen3moe-tiny-q4km.gguf");
    let tok_dir = home.tokenizer_for("scripted", &gguf);
    let tok = TextTokenizer::load(&tok_dir).expect("tokenizer");
    let replies: Vec<Vec<u32>> = [TOOL_REPLY, ANSWER_REPLY, BROKEN_REPLY]
        .iter()
        .map(|t| tok.encode(t, false, true).expect("encode"))
        .collect();
    let replies_file = home.dir.join("replies.json");
    std::fs::write(
        &replies_file,
        serde_json::to_string(&replies).expect("json"),
    )
    .expect("write");
    home.write_config(
        "scripted",
        &json!({
            "exe": common::workspace_root().join("tests/server/replay_engine.py"),
            "args": ["--model", gguf, "--replies", replies_file, "--n-vocab", tok.n_vocab().to_string()],
            "tokenizer": "packs/scripted/tokenizer",
        }),
    );
    let server = Server::start(&home, &["--load", "scripted"]);
    (home, server)
}

fn tools() -> Value {
    json!([{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }}])
}

fn chat(max_tokens: u32, stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": tools(),
        "max_tokens": max_tokens,
        "stream": stream,
    })
}

#[test]
fn reasoning_and_tool_calls_reach_both_apis() {
    let (_home, server) = setup();

    // OpenAI, whole.
    let r = server.post("/v1/chat/completions", &chat(TOOL, false));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let msg = &choice["message"];
    assert!(
        msg["reasoning_content"]
            .as_str()
            .is_some_and(|t| t.contains(REASONING)),
        "{v}"
    );
    let call = &msg["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().expect("arguments"))
            .expect("JSON");
    assert_eq!(args, json!({"city": "Paris"}));
    assert!(msg["content"].is_null() || msg["content"] == "", "{v}");

    let r = server.post("/v1/chat/completions", &chat(ANSWER, false));
    let v = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(
        v["choices"][0]["message"]["content"],
        "It is sunny in Paris. END and more"
    );
    assert!(v["choices"][0]["message"]["tool_calls"].is_null());

    // A stop string cuts the content and is not returned.
    let mut body = chat(ANSWER, false);
    body["stop"] = json!(["END"]);
    let v = server.post("/v1/chat/completions", &body).json();
    assert_eq!(
        v["choices"][0]["message"]["content"], "It is sunny in Paris. ",
        "{v}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    // A call the reply ends inside stays visible as text.
    let v = server
        .post("/v1/chat/completions", &chat(BROKEN, false))
        .json();
    let content = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default();
    assert!(
        content.contains("<tool_call>") && content.contains("\"argum"),
        "{v}"
    );
    assert!(v["choices"][0]["message"]["tool_calls"].is_null(), "{v}");

    // OpenAI, streamed: the deltas add up to the same message.
    let mut stream = Stream::open(&server.addr, "/v1/chat/completions", &chat(TOOL, true));
    let events = stream.rest();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let (mut reasoning, mut calls, mut finish) = (String::new(), Vec::new(), Value::Null);
    for e in &events[..events.len() - 1] {
        let c: Value = serde_json::from_str(e).expect("chunk");
        let d = &c["choices"][0]["delta"];
        reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
        calls.extend(d["tool_calls"].as_array().cloned().unwrap_or_default());
        if !c["choices"][0]["finish_reason"].is_null() {
            finish = c["choices"][0]["finish_reason"].clone();
        }
    }
    assert!(reasoning.contains(REASONING), "{reasoning:?}");
    assert_eq!(calls.len(), 1, "{events:?}");
    assert_eq!(calls[0]["index"], 0);
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert!(calls[0]["id"].as_str().is_some_and(|id| !id.is_empty()));
    assert_eq!(finish, "tool_calls");

    // Anthropic, whole.
    let body = json!({
        "max_tokens": TOOL,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
    });
    let v = server.post("/v1/messages", &body).json();
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    let blocks = v["content"].as_array().expect("content");
    assert_eq!(blocks[0]["type"], "thinking", "{v}");
    assert!(blocks[0]["thinking"]
        .as_str()
        .is_some_and(|t| t.contains(REASONING)));
    let tool_use = blocks
        .iter()
        .find(|b| b["type"] == "tool_use")
        .expect("tool_use block");
    assert_eq!(tool_use["name"], "get_weather");
    assert_eq!(tool_use["input"], json!({"city": "Paris"}));

    // Anthropic, streamed: the event sequence of a thinking block then a tool_use block.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let mut stream = Stream::open(&server.addr, "/v1/messages", &sbody);
    let events: Vec<Value> = stream
        .rest()
        .iter()
        .map(|e| serde_json::from_str(e).expect("event"))
        .collect();
    let types: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
    assert_eq!(types.first(), Some(&"message_start"));
    assert_eq!(types.last(), Some(&"message_stop"));
    let starts: Vec<&Value> = events
        .iter()
        .filter(|e| e["type"] == "content_block_start")
        .collect();
    assert_eq!(starts[0]["content_block"]["type"], "thinking");
    let tool_start = starts
        .iter()
        .find(|e| e["content_block"]["type"] == "tool_use")
        .expect("tool_use start");
    let index = tool_start["index"].clone();
    let partial: String = events
        .iter()
        .filter(|e| e["type"] == "content_block_delta" && e["index"] == index)
        .filter_map(|e| e["delta"]["partial_json"].as_str())
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&partial).expect("input JSON"),
        json!({"city": "Paris"})
    );
    let delta = events
        .iter()
        .find(|e| e["type"] == "message_delta")
        .expect("message_delta");
    assert_eq!(delta["delta"]["stop_reason"], "tool_use");
    // Every started block is stopped, in order.
    let stops: Vec<&Value> = events
        .iter()
        .filter(|e| e["type"] == "content_block_stop")
        .map(|e| &e["index"])
        .collect();
    let start_idx: Vec<&Value> = starts.iter().map(|e| &e["index"]).collect();
    assert_eq!(stops, start_idx);
}

#[test]
fn official_clients_read_tool_calls() {
    let python = std::env::var("POLYSTRATA_PYTHON").unwrap_or_else(|_| "python3".into());
    let (_home, server) = setup();
    let out = std::process::Command::new(&python)
        .arg(common::workspace_root().join("tests/server/clients.py"))
        .arg("--scripted")
        .env("POLYSTRATA_URL", format!("http://{}", server.addr))
        .env("POLYSTRATA_MODELS", "scripted")
        .output()
        .expect("run clients.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "clients.py --scripted failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("client checks passed"), "{stdout}");
}

/// llama-server's `timings` with a draft: `draft_n` and `draft_n_accepted` beside the prompt and answer
/// figures, streamed (on the last chunk) and not, and the request's log line with the same figures. The
/// replay engine reports 6 guessed tokens proposed and 3 accepted, 10 ms of prompt and 20 ms of answer.
#[test]
fn timings_carry_the_draft_and_the_log_line_says_it() {
    let home = Home::new("replies-draft");
    let gguf = common::fixture("qwen3moe-tiny-q4km.gguf");
    let tok_dir = home.tokenizer_for("scripted", &gguf);
    let tok = TextTokenizer::load(&tok_dir).expect("tokenizer");
    let reply = tok.encode("It is sunny.", false, true).expect("encode");
    let replies_file = home.dir.join("replies.json");
    std::fs::write(&replies_file, json!([reply]).to_string()).expect("write");
    home.write_config(
        "scripted",
        &json!({
            "exe": common::workspace_root().join("tests/server/replay_engine.py"),
            "args": ["--model", gguf, "--replies", replies_file, "--n-vocab",
                     tok.n_vocab().to_string(), "--draft", "6/3"],
            "tokenizer": "packs/scripted/tokenizer",
        }),
    );
    let server = Server::start_logged(&home, &["--load", "scripted"], &[]);
    let body = |stream: bool| {
        json!({"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 100,
               "stream": stream})
    };
    let check = |t: &Value| {
        assert_eq!(t["draft_n"], 6, "{t}");
        assert_eq!(t["draft_n_accepted"], 3, "{t}");
        assert_eq!(t["predicted_n"].as_u64(), Some(reply.len() as u64), "{t}");
        assert_eq!(t["prompt_ms"], 10.0, "{t}");
        assert_eq!(t["predicted_ms"], 20.0, "{t}");
        for key in ["prompt_n", "prompt_per_second", "predicted_per_second"] {
            assert!(t[key].as_f64().is_some_and(|v| v > 0.0), "{key}: {t}");
        }
    };
    let r = server.post("/v1/chat/completions", &body(false));
    assert_eq!(r.status, 200, "{}", r.text());
    check(&r.json()["timings"]);
    let events: Vec<Value> = Stream::open(&server.addr, "/v1/chat/completions", &body(true))
        .rest()
        .iter()
        .filter_map(|e| serde_json::from_str(e).ok())
        .collect();
    let last = events
        .iter()
        .rev()
        .find(|e| e.get("timings").is_some())
        .expect("a chunk with timings");
    check(&last["timings"]);
    server.stop();
    let log = std::fs::read_to_string(home.dir.join("server.log")).expect("server.log");
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.starts_with("polystrata: request ") && l.contains(" model scripted: "))
        .collect();
    assert_eq!(lines.len(), 2, "one line per request: {log}");
    for l in lines {
        assert!(
            l.contains("in 10.0 ms")
                && l.contains("in 20.0 ms")
                && l.contains("draft 3/6 accepted"),
            "{l}"
        );
    }
}
