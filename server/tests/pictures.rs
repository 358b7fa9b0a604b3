//! Pictures through the HTTP APIs (`polystrata serve` with real engine children): the tiny qwen35moe
//! fixture with the tiny projector `poly-engine synth --arch qwen3vl-mmproj` writes, named by its run
//! config's `mmproj`. An OpenAI `image_url` data URL is answered with the log-probabilities the engine
//! gives for the same tokens and picture over the protocol; the same picture as an Anthropic base64
//! `image` block gets the same answer; an Ollama chat's `images` are answered, and `/api/generate`'s
//! the same; a JPEG is answered as the engine answers it; pictures in tool results (OpenAI `tool`
//! messages, Anthropic `tool_result` blocks, Responses `function_call_output`s) are read, the same
//! conversation each way; another picture gets
//! another answer; a bad picture a 400 and the next request its answer. Refused with a 400 that says why:
//! remote URLs (OpenAI and Anthropic), and pictures for a model whose run config names no projector
//! (without switching to it). The tiny gemma4 fixture with the tiny `gemma4v` projector: an OpenAI
//! `image_url` is written between Gemma 4's `<|image>` and `<image|>` and answered as the engine answers
//! those tokens and picture over the protocol.

mod common;

use common::{Home, Server};
use poly_protocol::{encode_base64, FromEngine, Gen, Picture, ToEngine};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};

const FIXTURE: &str = "qwen35moe-tiny-q4km.gguf";
const STEPS: u32 = 4;

fn picture(name: &str) -> Vec<u8> {
    std::fs::read(
        common::workspace_root()
            .join("tests/fixtures/vision")
            .join(name),
    )
    .expect("picture fixture")
}

/// The engine's flags in the tests: on the CPU (pictures are read there), one thread.
fn engine_args(gguf: &Path) -> Vec<String> {
    vec![
        "--model".into(),
        gguf.display().to_string(),
        "--max-context".into(),
        "4096".into(),
        "--threads".into(),
        "1".into(),
        "--cpu".into(),
    ]
}

/// The greedy log-probabilities of `gen` from an engine started directly (the protocol, no server).
fn engine_logprobs(mmproj: &Path, gen: Gen) -> Vec<f32> {
    engine_logprobs_on(FIXTURE, mmproj, gen)
}

/// [`engine_logprobs`] on the fixture `fixture`.
fn engine_logprobs_on(fixture: &str, mmproj: &Path, gen: Gen) -> Vec<f32> {
    let mut child = Command::new(common::engine_bin())
        .args(engine_args(&common::fixture(fixture)))
        .arg("--mmproj")
        .arg(mmproj)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start poly-engine");
    let mut stdin = child.stdin.take().expect("stdin");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    writeln!(stdin, "{}", ToEngine::Gen(gen).to_line()).expect("write GEN");
    let mut logprobs = Vec::new();
    loop {
        let line = lines.next().expect("a line").expect("read");
        match FromEngine::parse(&line).expect("a protocol line") {
            FromEngine::Ready(_) | FromEngine::Progress(_) => {}
            FromEngine::Tokens(t) => logprobs.extend(t.logprobs),
            FromEngine::Done(_) => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    drop(stdin);
    let _ = child.wait();
    logprobs
}

fn data_url(bytes: &[u8]) -> String {
    format!("data:image/png;base64,{}", encode_base64(bytes))
}

fn openai_picture(model: &str, url: &str) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
        "max_tokens": STEPS,
        "temperature": 0,
        "logprobs": true,
    })
}

fn logprobs_of(answer: &Value) -> Vec<f32> {
    answer["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("logprobs")
        .iter()
        .map(|l| l["logprob"].as_f64().expect("a logprob") as f32)
        .collect()
}

/// The tiny ChatML template's prompt of a user message holding one picture alone, written as `open`, the
/// placeholder 0 and `close`; and the placeholder's index.
fn picture_prompt(server: &Server, open: &str, close: &str) -> (Vec<u32>, u32) {
    let mut tokens = tokenize(server, "<|im_start|>user\n");
    tokens.extend(tokenize(server, open));
    let at = tokens.len() as u32;
    tokens.push(0);
    tokens.extend(tokenize(server, close));
    tokens.extend(tokenize(server, "<|im_end|>\n<|im_start|>assistant\n"));
    (tokens, at)
}

fn tokenize(server: &Server, text: &str) -> Vec<u32> {
    let r = server.post(
        "/tokenize",
        &json!({"model": "vision", "content": text, "parse_special": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("an id") as u32)
        .collect()
}

#[test]
fn pictures_through_openai_and_anthropic() {
    let home = Home::new("pictures");
    let mmproj = home.synth_projector();
    let gguf = common::fixture(FIXTURE);
    for (name, extra) in [("vision", json!({"mmproj": mmproj})), ("text", json!({}))] {
        let tok = home.tokenizer_for(name, &gguf);
        let mut config = json!({
            "exe": common::engine_bin(),
            "args": engine_args(&gguf),
            "tokenizer": tok,
            "model_name": name,
        });
        if let (Some(c), Some(e)) = (config.as_object_mut(), extra.as_object()) {
            c.extend(e.clone());
        }
        home.write_config(name, &config);
    }
    let server = Server::start(&home, &[]);
    let models = server.get("/v1/models").json();
    let multimodal: Vec<(String, bool)> = server.get("/api/models").json()["models"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|m| {
                    (
                        m["id"].as_str().unwrap_or("").to_string(),
                        m["multimodal"].as_bool().unwrap_or(false),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    eprintln!("{models}");
    assert!(
        multimodal.contains(&("vision".into(), true))
            && multimodal.contains(&("text".into(), false)),
        "{multimodal:?}"
    );

    // OpenAI: a picture alone in the user's message.
    let a = picture("picture-64x48.png");
    let r = server.post(
        "/v1/chat/completions",
        &openai_picture("vision", &data_url(&a)),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let openai = r.json();
    let got = logprobs_of(&openai);
    assert!(!got.is_empty(), "{openai}");
    // 4×3 rows where one placeholder stood.
    let prompt_tokens = openai["usage"]["prompt_tokens"].as_u64().expect("usage");

    // The same tokens and picture over the protocol, to an engine of our own: the same numbers. The
    // tiny template is ChatML; the picture is written as its begin text, the placeholder (0: the tiny
    // vocabulary has no `<|image_pad|>`) and its end text.
    let (tokens, at) = picture_prompt(&server, "<|vision_start|>", "<|vision_end|>");
    assert_eq!(prompt_tokens, tokens.len() as u64 + 11, "{openai}");
    let direct = |picture: &[u8], n: usize| {
        let gen = Gen {
            max_tokens: Some(n as u32),
            stop_tokens: Some(Vec::new()),
            pictures: vec![Picture {
                at,
                data: encode_base64(picture),
            }],
            ..Gen::new("direct", tokens.clone())
        };
        engine_logprobs(&mmproj, gen)
    };
    assert_eq!(direct(&a, got.len()), got, "the protocol's answer");

    // Anthropic: the same picture as a base64 image block, the same prompt, the same answer.
    let r = server.post(
        "/v1/messages",
        &json!({
            "model": "vision",
            "max_tokens": STEPS,
            "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": encode_base64(&a)}}]}],
        }),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let anthropic = r.json();
    assert_eq!(
        anthropic["content"][0]["text"], openai["choices"][0]["message"]["content"],
        "{anthropic}"
    );
    let usage = &anthropic["usage"];
    let input = usage["input_tokens"].as_u64().unwrap_or(0)
        + usage["cache_read_input_tokens"].as_u64().unwrap_or(0);
    assert_eq!(input, prompt_tokens, "{anthropic}");

    // count_tokens counts the picture as its picture tokens (the rows are the engine's to decide).
    let r = server.post(
        "/v1/messages/count_tokens",
        &json!({"model": "vision", "messages": [{"role": "user", "content": [{"type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": encode_base64(&a)}}]}]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["input_tokens"].as_u64(), Some(prompt_tokens - 11));

    // Text with the picture is answered; another picture gives other numbers.
    let mut with_text = openai_picture("vision", &data_url(&a));
    with_text["messages"][0]["content"]
        .as_array_mut()
        .expect("parts")
        .insert(
            0,
            json!({"type": "text", "text": "What is in this picture?"}),
        );
    let r = server.post("/v1/chat/completions", &with_text);
    assert_eq!(r.status, 200, "{}", r.text());
    let b = picture("picture-64x48-gradient.png");
    let r = server.post(
        "/v1/chat/completions",
        &openai_picture("vision", &data_url(&b)),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let got_b = logprobs_of(&r.json());
    assert_ne!(got_b, got, "another picture, other logits");
    // Its own answer (the same tokens as picture a's requests, whose kept state is not taken for it).
    assert_eq!(direct(&b, got_b.len()), got_b, "picture b's own answer");

    // The Responses API: a user's input_image with a data URL.
    let r = server.post(
        "/v1/responses",
        &json!({"model": "vision", "max_output_tokens": STEPS, "temperature": 0,
                "input": [{"role": "user", "content": [
                    {"type": "input_image", "image_url": data_url(&a)}]}]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json()["usage"]["input_tokens"].as_u64(),
        Some(prompt_tokens),
        "{}",
        r.text()
    );

    // llama-server's /props says the loaded model reads pictures.
    let props = server.get("/props").json();
    assert_eq!(props["modalities"]["vision"], true, "{props}");

    // Ollama's /api/show says `vision` for it, not for the text model.
    for (model, vision) in [("vision", true), ("text", false)] {
        let show = server.post("/api/show", &json!({"model": model})).json();
        let says = show["capabilities"]
            .as_array()
            .is_some_and(|c| c.iter().any(|v| v == "vision"));
        assert_eq!(says, vision, "{model}: {show}");
    }

    // Ollama's chat: `images` before the message's text.
    let r = server.post(
        "/api/chat",
        &json!({"model": "vision", "stream": false, "options": {"temperature": 0, "num_predict": 4},
                "messages": [{"role": "user", "content": "What is this?", "images": [encode_base64(&a)]}]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let ollama = r.json();
    assert!(
        ollama["prompt_eval_count"].as_u64().unwrap_or(0) > prompt_tokens,
        "{ollama}"
    );

    // Ollama's generate: `images` before the prompt, the same conversation as the chat above, so the
    // same (greedy) answer.
    let r = server.post(
        "/api/generate",
        &json!({"model": "vision", "stream": false, "options": {"temperature": 0, "num_predict": 4},
                "prompt": "What is this?", "images": [encode_base64(&a)]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let generated = r.json();
    assert_eq!(
        generated["response"], ollama["message"]["content"],
        "{generated} against {ollama}"
    );
    // A JPEG (decoded as mtmd's stb_image decodes it) is read too, and is another picture.
    let jpeg = picture("jpeg/big-420.jpg");
    let r = server.post(
        "/v1/chat/completions",
        &openai_picture(
            "vision",
            &format!("data:image/jpeg;base64,{}", encode_base64(&jpeg)),
        ),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let got_jpeg = logprobs_of(&r.json());
    assert_eq!(
        direct(&jpeg, got_jpeg.len()),
        got_jpeg,
        "the JPEG's own answer"
    );
    assert_ne!(got_jpeg, got, "another picture, other logits");

    // A picture a tool returned: an OpenAI `tool` message's image part and an Anthropic `tool_result`'s
    // image block, read where the tool's answer stands, and the same conversation either way.
    let openai_tool = |picture: &[u8]| {
        json!({"model": "vision", "max_tokens": STEPS, "temperature": 0, "logprobs": true,
               "tools": [{"type": "function", "function": {"name": "screenshot", "description": "d",
                          "parameters": {"type": "object", "properties": {}}}}],
               "messages": [
                   {"role": "user", "content": "What is on the screen?"},
                   {"role": "assistant", "content": "", "tool_calls": [{"id": "t1", "type": "function",
                       "function": {"name": "screenshot", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "t1", "content": [
                       {"type": "image_url", "image_url": {"url": data_url(picture)}}]}]})
    };
    let r = server.post("/v1/chat/completions", &openai_tool(&a));
    assert_eq!(r.status, 200, "{}", r.text());
    let tool_a = r.json();
    let r = server.post("/v1/chat/completions", &openai_tool(&b));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_ne!(
        logprobs_of(&r.json()),
        logprobs_of(&tool_a),
        "another picture in the tool result, other logits"
    );
    let r = server.post(
        "/v1/messages",
        &json!({"model": "vision", "max_tokens": STEPS, "temperature": 0,
                "tools": [{"name": "screenshot", "description": "d",
                           "input_schema": {"type": "object", "properties": {}}}],
                "messages": [
                    {"role": "user", "content": "What is on the screen?"},
                    {"role": "assistant", "content": [
                        {"type": "tool_use", "id": "t1", "name": "screenshot", "input": {}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                     "data": encode_base64(&a)}}]}]}]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let anthropic_tool = r.json();
    let usage = &anthropic_tool["usage"];
    let input = usage["input_tokens"].as_u64().unwrap_or(0)
        + usage["cache_read_input_tokens"].as_u64().unwrap_or(0);
    assert_eq!(
        input,
        tool_a["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
        "{anthropic_tool} against {tool_a}"
    );
    assert_eq!(
        anthropic_tool["content"][0]["text"], tool_a["choices"][0]["message"]["content"],
        "{anthropic_tool} against {tool_a}"
    );

    // The Responses API: a function_call_output with an input_image, the same conversation again.
    let r = server.post(
        "/v1/responses",
        &json!({"model": "vision", "max_output_tokens": STEPS, "temperature": 0,
                "tools": [{"type": "function", "name": "screenshot", "description": "d",
                           "parameters": {"type": "object", "properties": {}}}],
                "input": [
                    {"role": "user", "content": "What is on the screen?"},
                    {"type": "function_call", "call_id": "t1", "name": "screenshot", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "t1", "output": [
                        {"type": "input_image", "image_url": data_url(&a)}]}]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let responses_tool = r.json();
    assert_eq!(
        responses_tool["usage"]["input_tokens"], tool_a["usage"]["prompt_tokens"],
        "{responses_tool} against {tool_a}"
    );

    // Refusals, each a 400 that says why, and the next request answered.
    let refused = |path: &str, body: &Value, needle: &str| {
        let r = server.post(path, body);
        assert_eq!(r.status, 400, "{path}: {}", r.text());
        assert!(r.text().contains(needle), "{path}: {}", r.text());
    };
    refused(
        "/api/generate",
        &json!({"model": "vision", "stream": false, "prompt": "x", "raw": true,
                "images": [encode_base64(&a)]}),
        "raw",
    );
    refused(
        "/api/generate",
        &json!({"model": "vision", "stream": false, "prompt": "x", "images": ["@@"]}),
        "images[0]",
    );
    refused(
        "/api/generate",
        &json!({"model": "text", "stream": false, "prompt": "x", "images": [encode_base64(&a)]}),
        "text only",
    );
    refused(
        "/v1/chat/completions",
        &openai_picture("vision", "https://example.com/cat.png"),
        "not fetched",
    );
    refused(
        "/v1/messages",
        &json!({"model": "vision", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}]}),
        "not fetched",
    );
    refused(
        "/v1/chat/completions",
        &openai_picture("vision", "data:image/png;base64,bm90IGEgcGljdHVyZQ=="),
        "picture",
    );
    let r = server.post(
        "/v1/chat/completions",
        &openai_picture("vision", &data_url(&a)),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        logprobs_of(&r.json()),
        got,
        "the same answer after a bad picture"
    );
    refused(
        "/v1/chat/completions",
        &openai_picture("text", &data_url(&a)),
        "text only",
    );
    refused(
        "/v1/messages",
        &json!({"model": "text", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
             "data": encode_base64(&a)}}]}]}),
        "text only",
    );
    // Refused from the registry, before the text model's engine was started for them.
    let current = server.get("/api/models/current").json();
    assert_eq!(current["model"], "vision", "{current}");
}

#[test]
fn a_gemma4_picture_is_written_in_gemma4s_words_and_answered_as_the_engine_answers() {
    const GEMMA4: &str = "gemma4-tiny-q4km.gguf";
    let home = Home::new("pictures-gemma4");
    let mmproj = home.synth_projector_of("gemma4v-mmproj");
    let gguf = common::fixture(GEMMA4);
    let tok = home.tokenizer_for("vision", &gguf);
    home.write_config(
        "vision",
        &json!({
            "exe": common::engine_bin(),
            "args": engine_args(&gguf),
            "tokenizer": tok,
            "model_name": "vision",
            "mmproj": mmproj,
        }),
    );
    let server = Server::start(&home, &[]);
    let a = picture("picture-64x48.png");
    let r = server.post(
        "/v1/chat/completions",
        &openai_picture("vision", &data_url(&a)),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let openai = r.json();
    let got = logprobs_of(&openai);
    assert_eq!(got.len(), STEPS as usize, "{openai}");
    let prompt_tokens = openai["usage"]["prompt_tokens"].as_u64().expect("usage");

    // The tiny gemma4 carries the synthetic ChatML vocabulary (no `<|image>` tokens: the words are
    // written as text) and no `<|image|>` (the placeholder is 0).
    let (tokens, at) = picture_prompt(&server, "<|image>", "<image|>");
    // 10×8 rows where one placeholder stood.
    assert_eq!(prompt_tokens, tokens.len() as u64 + 79, "{openai}");
    let gen = Gen {
        max_tokens: Some(STEPS),
        stop_tokens: Some(Vec::new()),
        pictures: vec![Picture {
            at,
            data: encode_base64(&a),
        }],
        ..Gen::new("direct", tokens.clone())
    };
    assert_eq!(
        engine_logprobs_on(GEMMA4, &mmproj, gen),
        got,
        "the protocol's answer"
    );
    // Qwen-VL's words would be another prompt: the server chose Gemma 4's.
    let qwen_words = tokenize(&server, "<|vision_start|>");
    assert!(!tokens.windows(qwen_words.len()).any(|w| w == qwen_words));
}
