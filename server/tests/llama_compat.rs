//! What a user of llama-server and Ollama reaches for (issue 20), through `polystrata serve` with a real
//! engine child on the tiny qwen3moe fixture: `/props`, `/tokenize`, `/detokenize`, `/apply-template`,
//! `/v1/health`, `/metrics`; `timings` in OpenAI answers (streamed and not) and the log line per
//! request; `response_format`, grammars and image parts refused with a 400 that says so; the sampling
//! defaults and the default chat answer length; Ollama's routes in raw HTTP (the official client is in
//! `ollama_client.rs`).
//!
//! Cost: a few seconds (about 10 short generations).

mod common;

use common::{Home, Server, Stream};
use serde_json::{json, Value};

fn server() -> (Home, Server) {
    let home = Home::new("compat");
    home.add_model("tiny", "qwen3moe-tiny-q4km.gguf", json!({}));
    let server = Server::start_logged(&home, &["--load", "tiny"], &[]);
    (home, server)
}

fn chat_body(extra: Value) -> Value {
    let mut b = json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 6,
        "temperature": 0,
    });
    if let (Some(o), Some(e)) = (b.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            o.insert(k.clone(), v.clone());
        }
    }
    b
}

fn assert_timings(t: &Value, usage_prompt: u64, usage_completion: u64) {
    for key in [
        "prompt_n",
        "prompt_ms",
        "prompt_per_second",
        "predicted_n",
        "predicted_ms",
        "predicted_per_second",
        "cache_n",
    ] {
        assert!(t[key].is_number(), "timings.{key} missing: {t}");
    }
    assert_eq!(
        t["prompt_n"].as_u64().unwrap_or(0) + t["cache_n"].as_u64().unwrap_or(0),
        usage_prompt,
        "{t}"
    );
    assert_eq!(t["predicted_n"].as_u64(), Some(usage_completion), "{t}");
    assert!(t["prompt_ms"].as_f64().unwrap_or(0.0) > 0.0, "{t}");
    assert!(
        t["predicted_per_second"].as_f64().unwrap_or(0.0) > 0.0,
        "{t}"
    );
    assert!(t.get("draft_n").is_none(), "no draft model: {t}");
}

#[test]
fn llama_server_routes_timings_and_refusals() {
    let (home, server) = server();

    // /v1/health answers as /health does, without a key too.
    let h = server.get("/v1/health");
    assert_eq!(h.status, 200);
    assert_eq!(h.json()["status"], "ok");

    // /props: the model, its context, template, sampling defaults and build.
    let p = server.get("/props");
    assert_eq!(p.status, 200, "{}", p.text());
    let props = p.json();
    assert_eq!(props["model"], "tiny");
    assert_eq!(props["default_generation_settings"]["n_ctx"], 4096);
    assert_eq!(props["total_slots"], 1);
    assert!(props["build_info"]
        .as_str()
        .is_some_and(|b| b.starts_with("polystrata")));
    assert!(props["chat_template"]
        .as_str()
        .is_some_and(|t| t.contains("im_start")));
    let params = &props["default_generation_settings"]["params"];
    // The qwen3moe fixture has no run-config sampling: Qwen3's recommended settings, and the default
    // chat answer length.
    assert_eq!(params["temperature"], 0.6, "{params}");
    assert_eq!(params["top_k"], 20, "{params}");
    assert_eq!(params["chat_n_predict"], 4096, "{params}");
    assert_eq!(
        props["sampling_defaults"]["sources"]["temperature"],
        "family table (Qwen3)"
    );
    assert_eq!(props["modalities"]["vision"], false);

    // /tokenize and /detokenize round-trip; pieces; a bad id is refused.
    let t = server.post(
        "/tokenize",
        &json!({"content": "Hello world", "with_pieces": true}),
    );
    assert_eq!(t.status, 200, "{}", t.text());
    let tokens = t.json()["tokens"].as_array().cloned().unwrap_or_default();
    assert!(!tokens.is_empty());
    let joined: String = tokens.iter().filter_map(|p| p["piece"].as_str()).collect();
    assert_eq!(joined, "Hello world");
    let ids: Vec<Value> = tokens.iter().map(|p| p["id"].clone()).collect();
    let plain = server.post("/tokenize", &json!({"content": "Hello world"}));
    assert_eq!(plain.json()["tokens"], json!(ids));
    let d = server.post("/detokenize", &json!({"tokens": ids}));
    assert_eq!(d.status, 200);
    assert_eq!(d.json()["content"], "Hello world");
    let bad = server.post("/detokenize", &json!({"tokens": [99999999]}));
    assert_eq!(bad.status, 400);
    assert!(
        bad.text().contains("outside the vocabulary"),
        "{}",
        bad.text()
    );
    assert_eq!(server.post("/tokenize", &json!({})).status, 400);

    // /apply-template: the prompt the model would read.
    let a = server.post(
        "/apply-template",
        &json!({"messages": [{"role": "user", "content": "Hi there"}]}),
    );
    assert_eq!(a.status, 200, "{}", a.text());
    let prompt = a.json()["prompt"].as_str().unwrap_or("").to_string();
    assert!(
        prompt.contains("Hi there") && prompt.contains("<|im_start|>assistant"),
        "{prompt}"
    );

    // timings, not streamed.
    let r = server.post("/v1/chat/completions", &chat_body(json!({})));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_timings(
        &v["timings"],
        v["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
        v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
    );
    // timings, streamed: on the chunk with the finish reason.
    let mut s = Stream::open(
        &server.addr,
        "/v1/chat/completions",
        &chat_body(json!({"stream": true, "stream_options": {"include_usage": true}})),
    );
    assert_eq!(s.status, 200);
    let events: Vec<Value> = s
        .rest()
        .iter()
        .filter(|d| d.as_str() != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("json chunk"))
        .collect();
    let last = events
        .iter()
        .find(|e| !e["choices"][0]["finish_reason"].is_null())
        .expect("a finish chunk");
    let usage = &events.last().expect("usage chunk")["usage"];
    assert_timings(
        &last["timings"],
        usage["prompt_tokens"].as_u64().unwrap_or(0),
        usage["completion_tokens"].as_u64().unwrap_or(0),
    );
    // Completions carry them too.
    let c = server.post(
        "/v1/completions",
        &json!({"prompt": "Once upon", "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(c.status, 200);
    assert!(c.json()["timings"]["predicted_n"].is_number());

    // A chat with no length and no temperature: the defaults apply and it ends (the length a run config
    // gives is checked in a_run_configs_sampling_is_every_apis_default).
    let d = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "seed": 1}),
    );
    assert_eq!(d.status, 200, "{}", d.text());
    assert!(d.json()["usage"]["completion_tokens"].as_u64().unwrap_or(0) <= 4096);

    // Refused, never ignored: constrained output and image parts.
    for (extra, needle) in [
        (
            json!({"response_format": {"type": "json_object"}}),
            "json_object",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}),
            "json_schema",
        ),
        (json!({"grammar": "root ::= \"yes\""}), "grammar"),
    ] {
        let r = server.post("/v1/chat/completions", &chat_body(extra));
        assert_eq!(r.status, 400, "{}", r.text());
        let msg = r.json()["error"]["message"]
            .as_str()
            .unwrap_or("")
            .to_string();
        assert!(
            msg.contains(needle) && msg.contains("not supported"),
            "{msg}"
        );
    }
    let image = server.post(
        "/v1/chat/completions",
        &chat_body(json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        ]}]})),
    );
    assert_eq!(image.status, 400, "{}", image.text());
    assert!(image.text().contains("text only"), "{}", image.text());
    // Nothing was lost: the next request is served.
    assert_eq!(
        server
            .post("/v1/chat/completions", &chat_body(json!({})))
            .status,
        200
    );

    // /metrics: Prometheus text with the figures of the requests above.
    let m = server.get("/metrics");
    assert_eq!(m.status, 200);
    assert!(m
        .header("content-type")
        .is_some_and(|c| c.starts_with("text/plain")));
    let text = m.text();
    let value = |name: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(name) && !l.starts_with('#'))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing:\n{text}"))
    };
    assert!(value("llamacpp:prompt_tokens_total ") > 0.0);
    assert!(value("llamacpp:tokens_predicted_total ") >= 10.0);
    assert!(value("llamacpp:predicted_tokens_seconds ") > 0.0);
    assert!(value("llamacpp:prompt_tokens_seconds ") > 0.0);
    assert_eq!(value("llamacpp:requests_processing "), 0.0);
    assert_eq!(value("llamacpp:requests_deferred "), 0.0);
    assert!(value("polystrata_requests_total{outcome=\"completed\"}") >= 5.0);
    assert_eq!(value("polystrata_model_loaded{model=\"tiny\"}"), 1.0);
    assert!(value("polystrata_engine_rss_bytes ") > 0.0);
    assert!(text.contains("# TYPE llamacpp:prompt_tokens_total counter"));

    // One log line per request with its figures.
    server.stop();
    let log = std::fs::read_to_string(home.dir.join("server.log")).expect("server.log");
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.starts_with("polystrata: request r"))
        .collect();
    assert!(lines.len() >= 5, "{log}");
    assert!(
        lines
            .iter()
            .all(|l| l.contains("model tiny") && l.contains("t/s") && l.contains("answer")),
        "{lines:?}"
    );
}

fn ndjson(body: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(body)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("an NDJSON line"))
        .collect()
}

#[test]
fn ollama_routes_in_raw_http() {
    let (_home, server) = server();
    let v = server.get("/api/version");
    assert_eq!(v.status, 200);
    assert!(v.json()["version"].is_string());
    let tags = server.get("/api/tags").json();
    assert_eq!(tags["models"][0]["name"], "tiny");
    assert_eq!(tags["models"][0]["details"]["format"], "gguf");
    // The admin page's routes are still the management API's.
    assert!(server.get("/api/models").json()["models"].is_array());

    // /api/chat streams NDJSON by default; the last line is done with Ollama's figures.
    let r = server.post(
        "/api/chat",
        &json!({"model": "tiny:latest", "messages": [{"role": "user", "content": "Hi"}],
                "options": {"num_predict": 5, "temperature": 0}}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r
        .header("content-type")
        .is_some_and(|c| c.contains("ndjson")));
    let lines = ndjson(&r.body);
    let last = lines.last().expect("a line");
    assert_eq!(last["done"], true, "{last}");
    assert_eq!(last["done_reason"], "length");
    assert_eq!(last["eval_count"], 5);
    assert!(last["prompt_eval_count"].as_u64().unwrap_or(0) > 0);
    assert!(last["total_duration"].as_u64().unwrap_or(0) > 0);
    assert!(lines[..lines.len() - 1]
        .iter()
        .all(|l| l["done"] == false && l["message"]["role"] == "assistant"));

    // stream: false gives one object; /api/generate the same in its shape.
    let whole = server.post(
        "/api/generate",
        &json!({"model": "tiny", "prompt": "Once upon", "stream": false, "raw": true,
                "options": {"num_predict": 4, "temperature": 0}}),
    );
    assert_eq!(whole.status, 200, "{}", whole.text());
    let g = whole.json();
    assert!(g["response"].is_string() && g["done"] == true, "{g}");
    assert_eq!(g["eval_count"], 4);

    // An empty prompt only loads the model.
    let load = server
        .post("/api/generate", &json!({"model": "tiny"}))
        .json();
    assert_eq!(load["done_reason"], "load");

    let ps = server.get("/api/ps").json();
    assert_eq!(ps["models"][0]["name"], "tiny", "{ps}");
    let show = server.post("/api/show", &json!({"model": "tiny"}));
    assert_eq!(show.status, 200, "{}", show.text());
    let show = show.json();
    assert!(show["parameters"]
        .as_str()
        .is_some_and(|p| p.contains("temperature 0.6")));
    assert!(show["template"]
        .as_str()
        .is_some_and(|t| t.contains("im_start")));

    // Errors in Ollama's shape; refusals say why.
    let missing = server.post("/api/chat", &json!({"model": "nope", "messages": []}));
    assert_eq!(missing.status, 404);
    assert!(missing.json()["error"].is_string(), "{}", missing.text());
    let format = server.post(
        "/api/chat",
        &json!({"model": "tiny", "format": "json", "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(format.status, 400);
    assert!(format.text().contains("not supported"));
    let image = server.post(
        "/api/chat",
        &json!({"model": "tiny", "messages": [{"role": "user", "content": "x", "images": ["iVBORw0KGgo="]}]}),
    );
    assert_eq!(image.status, 400);
    assert!(image.text().contains("text only"), "{}", image.text());
    server.stop();
}

#[test]
fn anthropic_image_blocks_are_refused_as_text_only() {
    let (_home, server) = server();
    let r = server.post(
        "/v1/messages",
        &json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
            {"type": "text", "text": "What is this?"},
        ]}]}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["type"], "error");
    assert!(r.text().contains("text only"), "{}", r.text());
    // Structured outputs (the beta's `output_format`, GA's `output_config.format`): refused, not ignored.
    let schema = json!({"type": "json_schema", "schema": {"type": "object"}});
    for (field, value) in [
        ("output_format", schema.clone()),
        ("output_config", json!({"format": schema})),
    ] {
        let mut body = json!({"model": "tiny", "max_tokens": 4,
                              "messages": [{"role": "user", "content": "Hi"}]});
        body[field] = value;
        let r = server.post("/v1/messages", &body);
        assert_eq!(r.status, 400, "{field}: {}", r.text());
        assert_eq!(r.json()["type"], "error");
        assert!(r.text().contains("not supported"), "{}", r.text());
    }
    server.stop();
}

#[test]
fn a_context_over_the_training_context_is_clamped() {
    let home = Home::new("clamp");
    home.add_model("tiny", "qwen3moe-tiny-q4km.gguf", json!({}));
    // The same run config asking for far more context than the model was trained for.
    let path = home.dir.join("strata-tiny.json");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("config")).expect("json");
    config["args"][3] = json!("999999");
    home.write_config("tiny", &config);
    let server = Server::start_logged(&home, &["--load", "tiny"], &[]);
    let listed = server.get("/api/models").json()["models"][0]["context"]
        .as_u64()
        .expect("a context");
    assert!(listed < 999_999, "{listed}");
    let props = server.get("/props").json();
    let n_ctx = props["default_generation_settings"]["n_ctx"]
        .as_u64()
        .expect("n_ctx");
    let note = props["context_note"].as_str().unwrap_or_default();
    assert!(
        note.contains("999999") && note.contains(&format!("clamped to {listed}")),
        "/props says why the context is less than asked: {props}"
    );
    assert_eq!(
        n_ctx, listed,
        "the engine and the registry say the same context"
    );
    // --list-models says it too, where a user looks first.
    let out = common::polystrata()
        .arg("--list-models")
        .arg("--home")
        .arg(&home.dir)
        .output()
        .expect("--list-models");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("context {listed}"))
            && text.contains("    context: ")
            && text.contains("999999"),
        "{text}"
    );
    server.stop();
    let log = std::fs::read_to_string(home.dir.join("server.log")).expect("server.log");
    assert!(
        log.contains("--max-context 999999 is over the model's training context; clamped to"),
        "{log}"
    );
}

/// A run config's `sampling` is the default of every API's chat: a chat that gives no length gets its
/// `max_tokens` (OpenAI chat, the Responses API, Ollama's chat), a request's own length wins, raw
/// completions keep OpenAI's 16, and `/props` says each value came from the run config.
#[test]
fn a_run_configs_sampling_is_every_apis_default() {
    const LEN: u64 = 5;
    let home = Home::new("compat-sampling");
    home.add_model(
        "tiny",
        "qwen3moe-tiny-q4km.gguf",
        json!({"sampling": {"max_tokens": LEN, "temperature": 0.0, "top_k": 7}}),
    );
    let server = Server::start(&home, &["--load", "tiny"]);
    let props = server.get("/props").json();
    let params = &props["default_generation_settings"]["params"];
    assert_eq!(params["chat_n_predict"], LEN, "{params}");
    assert_eq!(params["top_k"], 7, "{params}");
    assert_eq!(
        props["sampling_defaults"]["sources"]["top_k"], "run config",
        "{props}"
    );
    // The fixture writes noise and does not stop within a few greedy tokens: the default length ends it.
    let messages = json!([{"role": "user", "content": "Tell me a long story."}]);
    let chat = server.post("/v1/chat/completions", &json!({"messages": messages}));
    assert_eq!(chat.status, 200, "{}", chat.text());
    let chat = chat.json();
    assert_eq!(chat["usage"]["completion_tokens"], LEN, "{chat}");
    assert_eq!(chat["choices"][0]["finish_reason"], "length", "{chat}");
    let own = server.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": LEN + 3}),
    );
    assert_eq!(own.json()["usage"]["completion_tokens"], LEN + 3);
    let responses = server.post("/v1/responses", &json!({"input": "Tell me a long story."}));
    assert_eq!(responses.status, 200, "{}", responses.text());
    let responses = responses.json();
    assert_eq!(responses["usage"]["output_tokens"], LEN, "{responses}");
    assert_eq!(responses["status"], "incomplete", "{responses}");
    // The item the length cut is incomplete too, as OpenAI's, streamed and not.
    assert_eq!(responses["output"][0]["type"], "message", "{responses}");
    assert_eq!(
        responses["output"][0]["status"], "incomplete",
        "{responses}"
    );
    let mut stream = Stream::open(
        &server.addr,
        "/v1/responses",
        &json!({"input": "Tell me a long story.", "stream": true}),
    );
    assert_eq!(stream.status, 200);
    let events: Vec<Value> = stream
        .rest()
        .iter()
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect();
    let done: Vec<&Value> = events
        .iter()
        .filter(|e| e["type"] == "response.output_item.done")
        .collect();
    assert_eq!(done.len(), 1, "{events:?}");
    assert_eq!(done[0]["item"]["status"], "incomplete", "{events:?}");
    let last = events.last().expect("events");
    assert_eq!(last["type"], "response.incomplete", "{last}");
    assert_eq!(last["response"]["output"][0]["status"], "incomplete");
    let ollama = server.post(
        "/api/chat",
        &json!({"model": "tiny", "messages": messages, "stream": false}),
    );
    assert_eq!(ollama.status, 200, "{}", ollama.text());
    let ollama = ollama.json();
    assert_eq!(ollama["eval_count"], LEN, "{ollama}");
    assert_eq!(ollama["done_reason"], "length", "{ollama}");
    // A raw completion is not a chat: OpenAI's 16.
    let raw = server.post("/v1/completions", &json!({"prompt": "Once upon a time"}));
    assert_eq!(raw.status, 200, "{}", raw.text());
    assert_eq!(raw.json()["usage"]["completion_tokens"], 16);
    server.stop();
}

/// Ollama's `/api/show` says the same of a model whether it is in use or not: its template (the
/// tokenizer directory's, or the run config's family template) and the capabilities read from it.
/// Desktop clients ask it of every model in their list, most of them not loaded.
#[test]
fn ollama_show_is_the_same_for_a_model_not_in_use() {
    let home = Home::new("compat-show");
    home.add_model("tiny", "qwen3moe-tiny-q4km.gguf", json!({}));
    home.add_model(
        "other",
        "qwen3moe-tiny-q4km.gguf",
        json!({"chat_template": "gemma3"}),
    );
    let server = Server::start(&home, &["--load", "tiny"]);
    let show = |model: &str| {
        let r = server.post("/api/show", &json!({"model": model}));
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    };
    let in_use = show("tiny");
    let template = in_use["template"].as_str().unwrap_or_default().to_string();
    assert!(template.contains("im_start"), "{in_use}");
    let other = show("other");
    assert!(
        other["template"]
            .as_str()
            .is_some_and(|t| t.contains("start_of_turn")),
        "the run config's family template of a model not in use: {other}"
    );
    let r = server.post("/api/models/load", &json!({"model": "other"}));
    assert_eq!(r.status, 200, "{}", r.text());
    let not_in_use = show("tiny");
    assert_eq!(not_in_use["template"], in_use["template"], "{not_in_use}");
    assert_eq!(not_in_use["capabilities"], in_use["capabilities"]);
    assert_eq!(not_in_use["parameters"], in_use["parameters"]);
    assert_eq!(show("other")["template"], other["template"]);
    server.stop();
}
