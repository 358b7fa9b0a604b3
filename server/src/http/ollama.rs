//! Ollama's API on the same server (many desktop clients speak only Ollama): `GET /api/version`,
//! `GET /api/tags`, `GET /api/ps`, `POST /api/show`, `POST /api/chat` and `POST /api/generate`
//! (streamed as NDJSON unless `"stream": false`), in Ollama's shapes; errors are `{"error": "..."}`.
//!
//! A model is named by its id or alias; Ollama's default tag `:latest` is accepted and dropped. The
//! management API's `/api/models*` routes are the admin page's, not Ollama's, and stay as they are.

use super::body::{channel_response, json_response, RespBody};
use super::errors::{ApiError, Flavor, Kind};
use super::llama::build_info;
use super::openai::{next_or_gone, next_or_left, CANCEL_WAIT};
use super::prepare::{chat_prompt, encode_error, leased_with};
use super::sampling::sampling;
use super::unsupported::refuse_ollama_format;
use super::AppState;
use crate::defaults::Defaults;
use crate::engine::supervisor::KeepAlive;
use crate::generate::{Finish, FinishReason, Generation, Output, Step};
use crate::model_text::{ChatInput, Piece, Resume};
use crate::registry::ModelEntry;
use bytes::Bytes;
use hyper::{Response, StatusCode};
use serde_json::{json, Map, Value};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, oneshot};

/// A time as RFC 3339 in UTC (`2026-12-02T04:35:00.123Z`), as Ollama writes its times.
fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Days to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_millis()
    )
}

fn now() -> String {
    rfc3339(SystemTime::now())
}

/// A model name as Ollama clients send it, without the default tag.
fn model_name(body: &Value) -> Result<Option<String>, ApiError> {
    let name = match body.get("model").or_else(|| body.get("name")) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => s.as_str(),
        Some(_) => return Err(ApiError::bad_request("`model` must be a string")),
    };
    Ok(Some(
        name.strip_suffix(":latest").unwrap_or(name).to_string(),
    ))
}

fn file_facts(entry: &ModelEntry) -> (u64, String) {
    let meta = entry.path.as_ref().and_then(|p| std::fs::metadata(p).ok());
    let size = meta.as_ref().map_or(0, |m| m.len());
    let modified = meta.and_then(|m| m.modified().ok()).unwrap_or(UNIX_EPOCH);
    (size, rfc3339(modified))
}

/// Ollama's `digest`: here not the file's SHA-256 (reading a large file for it would take minutes)
/// but a stable name of the id, path and size, in the same 64 hex digits.
fn digest(entry: &ModelEntry, size: u64) -> String {
    let key = format!(
        "{}\u{0}{}\u{0}{size}",
        entry.id,
        entry
            .path
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    );
    (0u64..4)
        .map(|seed| {
            let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            for b in key.bytes() {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
            format!("{h:016x}")
        })
        .collect()
}

fn details(entry: &ModelEntry) -> Value {
    let family = entry.backend.clone().unwrap_or_default();
    json!({
        "parent_model": "",
        "format": "gguf",
        "family": family,
        "families": [family],
        "parameter_size": entry.params_total.clone().unwrap_or_default(),
        "quantization_level": entry.quantization.clone().unwrap_or_default(),
    })
}

/// `GET /api/version`.
pub fn version() -> Response<RespBody> {
    json_response(
        StatusCode::OK,
        &json!({"version": env!("CARGO_PKG_VERSION"), "build": build_info()}),
    )
}

/// `GET /api/tags`: the runnable models.
pub async fn tags(state: &AppState) -> Response<RespBody> {
    let models: Vec<Value> = state
        .supervisor
        .models()
        .await
        .iter()
        .filter(|m| m.is_runnable())
        .map(|m| {
            let (size, modified) = file_facts(m);
            json!({
                "name": m.id, "model": m.id, "modified_at": modified, "size": size,
                "digest": digest(m, size), "details": details(m),
            })
        })
        .collect();
    json_response(StatusCode::OK, &json!({"models": models}))
}

/// `GET /api/ps`: the model whose engine is up, with its VRAM where the engine reports it and when it
/// will be unloaded for idleness (`--idle-unload`, `keep_alive`; far away when it stays).
pub async fn ps(state: &AppState) -> Response<RespBody> {
    let current = state.supervisor.current();
    let mut models = Vec::new();
    if let (true, Some(id)) = (current.loaded, &current.model) {
        let entry = state
            .supervisor
            .models()
            .await
            .into_iter()
            .find(|m| &m.id == id);
        if let Some(m) = entry {
            let (size, _) = file_facts(&m);
            let vram = state
                .supervisor
                .idle_engine_stats(std::time::Duration::from_millis(500))
                .await
                .and_then(|s| s.vram_bytes)
                .unwrap_or(0);
            let n_ctx = state.supervisor.ready().map(|r| r.n_ctx);
            // No idle bound: it stays until a switch or an unload, so the expiry is far away.
            let expires = match current.unload_in_s {
                Some(s) => rfc3339(SystemTime::now() + std::time::Duration::from_secs(s)),
                None => "9999-12-31T23:59:59.000Z".to_string(),
            };
            models.push(json!({
                "name": m.id, "model": m.id, "size": size, "digest": digest(&m, size),
                "details": details(&m), "expires_at": expires,
                "size_vram": vram, "context_length": n_ctx,
            }));
        }
    }
    json_response(StatusCode::OK, &json!({"models": models}))
}

/// `POST /api/show` `{"model"}`: details, parameters (the sampling defaults as Modelfile lines), the
/// template, model info and capabilities, the same whether the model is in use or not.
pub async fn show(state: &AppState, body: Value) -> Result<Response<RespBody>, ApiError> {
    let Some(name) = model_name(&body)? else {
        return Err(ApiError::bad_request("`model` (a model name) is required"));
    };
    let entries = state.supervisor.models().await;
    let entry = crate::registry::find_in(&entries, &name)
        .map_err(|e| ApiError::new(Kind::ModelNotFound, e))?
        .clone();
    let current = state
        .supervisor
        .current_text()
        .filter(|(id, _)| id == &entry.id);
    let arch = entry.backend.clone().unwrap_or_default();
    let (defaults, template) = match &current {
        Some((_, text)) => (
            text.defaults().clone(),
            text.template_source().map(str::to_string),
        ),
        None => {
            let config = entry.config.clone();
            let arch = arch.clone();
            // Reads the GGUF's header and the tokenizer directory's template (not its vocabulary):
            // off the runtime. A model not in use shows the same details as one in use.
            tokio::task::spawn_blocking(move || {
                let path = config.as_ref().and_then(|c| c.model_path());
                let template = config.as_ref().and_then(|c| {
                    let gguf = c.tokenizer.as_deref().and_then(|dir| {
                        crate::text::tokenizer_dir::read_chat_template(dir)
                            .ok()
                            .flatten()
                    });
                    crate::text::template::resolve_template(
                        gguf.as_deref(),
                        c.chat_template.as_deref(),
                    )
                });
                let sampling = config.map(|c| c.sampling).unwrap_or_default();
                (
                    Defaults::for_model(&sampling, path.as_deref(), &arch),
                    template,
                )
            })
            .await
            .map_err(|e| ApiError::new(Kind::Internal, format!("reading the model failed: {e}")))?
        }
    };
    let parameters: String = defaults
        .values
        .iter()
        .map(|(k, v)| format!("{k} {v}\n"))
        .collect();
    let template = template.unwrap_or_default();
    let mut capabilities = vec!["completion"];
    if template.contains("tools") {
        capabilities.push("tools");
    }
    if template.contains("think") {
        capabilities.push("thinking");
    }
    // Ollama's name for reading pictures: a run config that names a projector that is there.
    if entry.multimodal {
        capabilities.push("vision");
    }
    let (_, modified) = file_facts(&entry);
    let mut info = Map::new();
    info.insert("general.architecture".into(), json!(arch));
    if let Some(n) = entry.context {
        info.insert(format!("{arch}.context_length"), json!(n));
    }
    Ok(json_response(
        StatusCode::OK,
        &json!({
            "modelfile": "", "parameters": parameters, "template": template,
            "details": details(&entry), "model_info": info, "capabilities": capabilities,
            "modified_at": modified,
        }),
    ))
}

/// Ollama's `options` (and `think`) as the OpenAI fields the shared readers take.
fn options(body: &Value) -> Result<crate::generate::Sampling, ApiError> {
    let mut fields = Map::new();
    if let Some(opts) = body.get("options").filter(|o| !o.is_null()) {
        let Some(o) = opts.as_object() else {
            return Err(ApiError::bad_request("`options` must be an object"));
        };
        for key in [
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "stop",
            "repeat_penalty",
            "presence_penalty",
            "frequency_penalty",
        ] {
            if let Some(v) = o.get(key) {
                fields.insert(key.into(), v.clone());
            }
        }
        // -1 (no limit) and -2 (fill the context) both leave the length to the room left.
        match o.get("num_predict").and_then(Value::as_i64) {
            Some(n) if n > 0 => {
                fields.insert("max_tokens".into(), json!(n));
            }
            Some(0) => return Err(ApiError::bad_request("`options.num_predict` must not be 0")),
            _ => {}
        }
    }
    let mut s = sampling(&Value::Object(fields), &["max_tokens"], "stop")?;
    if body
        .get("options")
        .and_then(|o| o.get("num_predict"))
        .and_then(Value::as_i64)
        .is_some_and(|n| n < 0)
    {
        // Ollama's "no limit": the context's room, not the chat default.
        s.max_tokens = Some(u32::MAX);
    }
    Ok(s)
}

fn stream_flag(body: &Value) -> Result<bool, ApiError> {
    match body.get("stream") {
        None | Some(Value::Null) => Ok(true),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad_request("`stream` must be true or false")),
    }
}

/// Ollama's `keep_alive`: seconds as a number, or a duration (`"5m"`, `"1h"`, `"30s"`, `"500ms"`, a
/// bare number of seconds); negative keeps the model loaded, 0 unloads it after the request.
fn keep_alive(body: &Value) -> Result<KeepAlive, ApiError> {
    let bad = || {
        ApiError::bad_request(
            "`keep_alive` must be seconds or a duration such as \"5m\", \"1h\", \"0\" or \"-1\"",
        )
    };
    let seconds = match body.get("keep_alive") {
        None | Some(Value::Null) => return Ok(KeepAlive::Default),
        Some(Value::Number(n)) => n.as_f64().ok_or_else(bad)?,
        Some(Value::String(s)) if s.trim().is_empty() => return Ok(KeepAlive::Default),
        Some(Value::String(s)) => {
            let s = s.trim();
            let split = s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len());
            let (num, unit) = s.split_at(split);
            let n: f64 = num.parse().map_err(|_| bad())?;
            n * match unit {
                "" | "s" => 1.0,
                "ms" => 0.001,
                "m" => 60.0,
                "h" => 3600.0,
                _ => return Err(bad()),
            }
        }
        Some(_) => return Err(bad()),
    };
    if !seconds.is_finite() {
        return Err(bad());
    }
    Ok(if seconds < 0.0 {
        KeepAlive::Forever
    } else {
        KeepAlive::For(std::time::Duration::from_secs_f64(seconds.min(1e9)))
    })
}

/// `think`: a boolean, or a level (any level turns thinking on).
fn think(body: &Value) -> Option<bool> {
    match body.get("think") {
        Some(Value::Bool(b)) => Some(*b),
        Some(Value::String(s)) => Some(!s.is_empty() && s != "none"),
        _ => None,
    }
}

/// Ollama messages as the OpenAI-shaped messages the templates read, and their pictures (`images`, base64)
/// in order: each message's pictures go before its text, as Ollama puts them, a picture mark each.
fn chat_messages(body: &Value) -> Result<(Vec<Value>, Vec<String>), ApiError> {
    let Some(Value::Array(input)) = body.get("messages") else {
        return Err(ApiError::bad_request("`messages` (an array) is required"));
    };
    let mut out = Vec::with_capacity(input.len());
    let mut pictures = Vec::new();
    for (i, m) in input.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        if !matches!(role, "system" | "user" | "assistant" | "tool") {
            return Err(ApiError::bad_request(format!(
                "messages[{i}].role must be system, user, assistant or tool"
            )));
        }
        let images = super::pictures::ollama_pictures(
            m.get("images").unwrap_or(&Value::Null),
            &format!("messages[{i}]"),
        )?;
        let marks: String = images
            .iter()
            .map(|_| crate::model_text::PICTURE_MARK)
            .collect();
        pictures.extend(images);
        let content = match m.get("content") {
            None | Some(Value::Null) => marks,
            Some(Value::String(s)) => marks + s,
            Some(_) => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].content must be a string"
                )))
            }
        };
        let mut msg = json!({"role": role, "content": content});
        if let Some(Value::String(t)) = m.get("thinking") {
            msg["reasoning_content"] = json!(t);
        }
        if let Some(Value::String(t)) = m.get("tool_name") {
            msg["name"] = json!(t);
        }
        if let Some(Value::Array(calls)) = m.get("tool_calls") {
            let calls: Vec<Value> = calls
                .iter()
                .enumerate()
                .map(|(n, c)| {
                    json!({"id": format!("call_{i}_{n}"), "type": "function",
                           "function": c.get("function").cloned().unwrap_or(Value::Null)})
                })
                .collect();
            msg["tool_calls"] = json!(calls);
        }
        out.push(msg);
    }
    Ok((out, pictures))
}

/// Ollama's figures of a finished answer, durations in nanoseconds.
fn done_fields(finish: &Finish, started: Instant, load_ns: u128) -> Map<String, Value> {
    let ns = |ms: f64| (ms * 1e6).max(0.0) as u64;
    let mut m = Map::new();
    m.insert("done".into(), json!(true));
    let reason = match finish.reason {
        FinishReason::Length => "length",
        _ => "stop",
    };
    m.insert("done_reason".into(), json!(reason));
    m.insert(
        "total_duration".into(),
        json!(started.elapsed().as_nanos() as u64),
    );
    m.insert("load_duration".into(), json!(load_ns as u64));
    m.insert(
        "prompt_eval_count".into(),
        json!(finish.prompt_tokens.saturating_sub(finish.cached_tokens)),
    );
    m.insert("prompt_eval_duration".into(), json!(ns(finish.prefill_ms)));
    m.insert("eval_count".into(), json!(finish.completion_tokens));
    m.insert("eval_duration".into(), json!(ns(finish.decode_ms)));
    m
}

/// Text, thinking and tool calls of some pieces, as Ollama's fields.
#[derive(Default)]
struct Parts {
    content: String,
    thinking: String,
    calls: Vec<Value>,
}

impl Parts {
    fn add(&mut self, pieces: Vec<Piece>) {
        for p in pieces {
            match p {
                Piece::Content(t) => self.content.push_str(&t),
                Piece::Reasoning(t) => self.thinking.push_str(&t),
                Piece::ToolCall { name, arguments } => {
                    // Ollama gives arguments as an object; text that is not one is kept under a key
                    // rather than dropped.
                    let args = serde_json::from_str::<Value>(&arguments)
                        .ok()
                        .filter(Value::is_object)
                        .unwrap_or_else(|| json!({"arguments": arguments}));
                    self.calls
                        .push(json!({"function": {"name": name, "arguments": args}}));
                }
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.content.is_empty() && self.thinking.is_empty() && self.calls.is_empty()
    }

    /// `/api/chat`'s `message`.
    fn message(&self) -> Value {
        let mut m = json!({"role": "assistant", "content": self.content});
        if !self.thinking.is_empty() {
            m["thinking"] = json!(self.thinking);
        }
        if !self.calls.is_empty() {
            m["tool_calls"] = json!(self.calls);
        }
        m
    }

    /// `/api/generate`'s `response` (and `thinking`).
    fn generated(&self, into: &mut Map<String, Value>) {
        into.insert("response".into(), json!(self.content));
        if !self.thinking.is_empty() {
            into.insert("thinking".into(), json!(self.thinking));
        }
    }
}

/// Which of Ollama's two answer shapes.
#[derive(Clone, Copy, PartialEq)]
enum Api {
    Chat,
    Generate,
}

struct Meta {
    api: Api,
    model: String,
    started: Instant,
    load_ns: u128,
}

impl Meta {
    fn object(&self, parts: &Parts) -> Map<String, Value> {
        let mut o = Map::new();
        o.insert("model".into(), json!(self.model));
        o.insert("created_at".into(), json!(now()));
        match self.api {
            Api::Chat => {
                o.insert("message".into(), parts.message());
            }
            Api::Generate => parts.generated(&mut o),
        }
        o
    }
}

fn ndjson(v: &Map<String, Value>) -> Bytes {
    let mut line = serde_json::to_vec(v).unwrap_or_else(|_| b"{}".to_vec());
    line.push(b'\n');
    Bytes::from(line)
}

/// Runs a started generation to its end, streamed as NDJSON or answered whole.
async fn answer(gen: Generation, meta: Meta, stream: bool) -> Result<Response<RespBody>, ApiError> {
    if stream {
        let (resp, tx) = channel_response("application/x-ndjson");
        tokio::spawn(stream_answer(gen, meta, tx));
        return Ok(resp);
    }
    // Collected in a task of its own, as the OpenAI routes do: a client that goes away cancels the
    // generation and the lease is kept until the engine's DONE.
    let (done_tx, done_rx) = oneshot::channel();
    tokio::spawn(collect_answer(gen, meta, done_tx));
    match done_rx.await {
        Ok(result) => result.map(|v| json_response(StatusCode::OK, &v)),
        Err(_) => Err(ApiError::new(Kind::Internal, "the generation task ended")),
    }
}

async fn collect_answer(
    mut gen: Generation,
    meta: Meta,
    mut done: oneshot::Sender<Result<Value, ApiError>>,
) {
    let mut parts = Parts::default();
    let finish = loop {
        let Some(step) = next_or_left(&mut gen, &mut done).await else {
            gen.cancel(CANCEL_WAIT).await;
            return;
        };
        match step {
            Step::Pieces { pieces, .. } => parts.add(pieces),
            Step::Finished(f) => break f,
            Step::Failed(e) => {
                let _ = done.send(Err(ApiError::from(e)));
                return;
            }
        }
    };
    drop(gen);
    let mut o = meta.object(&parts);
    o.extend(done_fields(&finish, meta.started, meta.load_ns));
    let _ = done.send(Ok(Value::Object(o)));
}

async fn stream_answer(mut gen: Generation, meta: Meta, tx: mpsc::Sender<Bytes>) {
    let finish = loop {
        let Some(step) = next_or_gone(&mut gen, &tx).await else {
            gen.cancel(CANCEL_WAIT).await;
            return;
        };
        match step {
            Step::Pieces { pieces, .. } => {
                let mut parts = Parts::default();
                parts.add(pieces);
                if parts.is_empty() {
                    continue;
                }
                let mut o = meta.object(&parts);
                o.insert("done".into(), json!(false));
                if tx.send(ndjson(&o)).await.is_err() {
                    gen.cancel(CANCEL_WAIT).await;
                    return;
                }
            }
            Step::Finished(f) => break f,
            Step::Failed(e) => {
                // Ollama's clients read a line with `error` as the stream's failure.
                let err = ApiError::from(e).body(Flavor::Ollama);
                let mut line = serde_json::to_vec(&err).unwrap_or_default();
                line.push(b'\n');
                let _ = tx.send(Bytes::from(line)).await;
                return;
            }
        }
    };
    drop(gen);
    let mut o = meta.object(&Parts::default());
    o.extend(done_fields(&finish, meta.started, meta.load_ns));
    let _ = tx.send(ndjson(&o)).await;
}

/// `POST /api/chat`.
pub async fn chat(state: Arc<AppState>, body: Value) -> Result<Response<RespBody>, ApiError> {
    let started = Instant::now();
    let model = model_name(&body)?;
    refuse_ollama_format(&body)?;
    state.supervisor.set_keep_alive(keep_alive(&body)?);
    let (messages, pictures) = chat_messages(&body)?;
    let sampling = options(&body)?;
    let stream = stream_flag(&body)?;
    let tools = match body.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(t)) if t.is_empty() => None,
        Some(Value::Array(t)) => Some(t.clone()),
        Some(_) => return Err(ApiError::bad_request("`tools` must be an array")),
    };
    let empty = messages.is_empty();
    let input = Arc::new(ChatInput {
        messages,
        tools,
        enable_thinking: think(&body),
        pictures,
        ..ChatInput::default()
    });
    super::prepare::refuse_pictures_early(&state, model.as_deref(), &input).await?;
    if empty {
        // Ollama loads the model for a chat without messages and answers at once.
        return load_only(&state, model.as_deref(), Api::Chat, started).await;
    }
    let chat = input.clone();
    let (lease, (rendered, prompt, resume)) =
        leased_with(&state, model.as_deref(), move |text, n_ctx| {
            chat_prompt(text, &chat, n_ctx)
        })
        .await?;
    let load_ns = started.elapsed().as_nanos();
    let id = state.supervisor.next_request_id();
    let meta = Meta {
        api: Api::Chat,
        model: lease.model().id.clone(),
        started,
        load_ns,
    };
    let gen = Generation::start_in(
        lease,
        id,
        prompt,
        &sampling,
        Output::Chat(rendered.parser),
        resume,
        rendered.pictures,
    )
    .map_err(ApiError::from)?;
    answer(gen, meta, stream).await
}

/// The answer to a request that only loads the model (an empty prompt or no messages).
async fn load_only(
    state: &AppState,
    model: Option<&str>,
    api: Api,
    started: Instant,
) -> Result<Response<RespBody>, ApiError> {
    let lease = state.supervisor.lease(model).await?;
    let meta = Meta {
        api,
        model: lease.model().id.clone(),
        started,
        load_ns: started.elapsed().as_nanos(),
    };
    drop(lease);
    let mut o = meta.object(&Parts::default());
    o.insert("done".into(), json!(true));
    o.insert("done_reason".into(), json!("load"));
    Ok(json_response(StatusCode::OK, &Value::Object(o)))
}

/// `POST /api/generate`: `prompt` (with `system`, and `images` before the prompt's text) through the
/// chat template, or as is with `"raw": true` (no `images` then). `suffix`, `template` and `context` are
/// refused (400).
pub async fn generate(state: Arc<AppState>, body: Value) -> Result<Response<RespBody>, ApiError> {
    let started = Instant::now();
    let model = model_name(&body)?;
    refuse_ollama_format(&body)?;
    state.supervisor.set_keep_alive(keep_alive(&body)?);
    // Pictures go before the prompt's text, as `/api/chat` puts a message's `images`.
    let pictures =
        super::pictures::ollama_pictures(body.get("images").unwrap_or(&Value::Null), "")?;
    for key in ["suffix", "template"] {
        if body
            .get(key)
            .and_then(Value::as_str)
            .is_some_and(|s| !s.is_empty())
        {
            return Err(ApiError::bad_request(format!(
                "`{key}` is not supported (no fill-in-the-middle or per-request template); the model's own template is used"
            )));
        }
    }
    if body
        .get("context")
        .and_then(Value::as_array)
        .is_some_and(|a| !a.is_empty())
    {
        return Err(ApiError::bad_request(
            "`context` (the deprecated token history) is not supported; use /api/chat with the messages",
        ));
    }
    let prompt_text = match body.get("prompt") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(ApiError::bad_request("`prompt` must be a string")),
    };
    let system = body
        .get("system")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let raw = body.get("raw").and_then(Value::as_bool).unwrap_or(false);
    if raw && !pictures.is_empty() {
        return Err(ApiError::bad_request(
            "`images` with `\"raw\": true`: a raw prompt has no template to place the pictures in; send \
             them without `raw` (the model's template puts them before the prompt)",
        ));
    }
    let sampling = options(&body)?;
    let stream = stream_flag(&body)?;
    if prompt_text.is_empty() && pictures.is_empty() {
        return load_only(&state, model.as_deref(), Api::Generate, started).await;
    }
    let mut messages = Vec::new();
    if !system.is_empty() {
        messages.push(json!({"role": "system", "content": system}));
    }
    let marks: String = pictures
        .iter()
        .map(|_| crate::model_text::PICTURE_MARK)
        .collect();
    messages.push(json!({"role": "user", "content": marks + &prompt_text}));
    let input = Arc::new(ChatInput {
        messages,
        enable_thinking: think(&body),
        pictures,
        ..ChatInput::default()
    });
    super::prepare::refuse_pictures_early(&state, model.as_deref(), &input).await?;
    let (lease, (output, prompt, resume, pictures)) =
        leased_with(&state, model.as_deref(), move |text, n_ctx| {
            if raw {
                let ids = text
                    .encode_within(&prompt_text, n_ctx)
                    .map_err(encode_error)?;
                Ok((Output::Raw, ids, Resume::default(), Vec::new()))
            } else {
                let (rendered, ids, resume) = chat_prompt(text, &input, n_ctx)?;
                Ok((
                    Output::Chat(rendered.parser),
                    ids,
                    resume,
                    rendered.pictures,
                ))
            }
        })
        .await?;
    let meta = Meta {
        api: Api::Generate,
        model: lease.model().id.clone(),
        started,
        load_ns: started.elapsed().as_nanos(),
    };
    let id = state.supervisor.next_request_id();
    let gen = Generation::start_in(lease, id, prompt, &sampling, output, resume, pictures)
        .map_err(ApiError::from)?;
    answer(gen, meta, stream).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + std::time::Duration::from_millis(1_796_185_296_789);
        assert_eq!(rfc3339(t), "2026-12-02T04:21:36.789Z");
        let leap = UNIX_EPOCH + std::time::Duration::from_secs(951_782_400);
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn options_and_names() {
        let s = options(&json!({"options": {"temperature": 0.1, "num_predict": 5, "stop": ["x"]}}))
            .expect("valid");
        assert_eq!(s.temperature, Some(0.1));
        assert_eq!(s.max_tokens, Some(5));
        assert_eq!(s.stop, vec!["x".to_string()]);
        let unlimited = options(&json!({"options": {"num_predict": -1}})).expect("valid");
        assert_eq!(unlimited.max_tokens, Some(u32::MAX));
        assert!(options(&json!({"options": {"temperature": "hot"}})).is_err());
        assert_eq!(
            model_name(&json!({"model": "qwen3:latest"})).ok().flatten(),
            Some("qwen3".to_string())
        );
        assert!(stream_flag(&json!({})).unwrap_or(false));
    }

    #[test]
    fn keep_alive_values() {
        let k = |v: Value| keep_alive(&json!({ "keep_alive": v }));
        assert_eq!(keep_alive(&json!({})).ok(), Some(KeepAlive::Default));
        assert_eq!(
            k(json!("5m")).ok(),
            Some(KeepAlive::For(std::time::Duration::from_secs(300)))
        );
        assert_eq!(
            k(json!(0)).ok(),
            Some(KeepAlive::For(std::time::Duration::ZERO))
        );
        assert_eq!(k(json!(-1)).ok(), Some(KeepAlive::Forever));
        assert_eq!(k(json!("-1m")).ok(), Some(KeepAlive::Forever));
        assert_eq!(
            k(json!("30")).ok(),
            Some(KeepAlive::For(std::time::Duration::from_secs(30)))
        );
        assert!(k(json!("5 fortnights")).is_err());
        assert!(k(json!(true)).is_err());
    }

    #[test]
    fn messages_are_converted_and_images_marked() {
        let (m, pictures) = chat_messages(&json!({"messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "thinking": "hm",
             "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
            {"role": "tool", "content": "42", "tool_name": "f"},
        ]}))
        .expect("valid");
        assert!(pictures.is_empty());
        assert_eq!(m[1]["reasoning_content"], "hm");
        assert_eq!(m[1]["tool_calls"][0]["function"]["arguments"]["a"], 1);
        assert_eq!(m[2]["name"], "f");
        let (m, pictures) = chat_messages(
            &json!({"messages": [{"role": "user", "content": "x", "images": ["AAAA", "Zm9v"]}]}),
        )
        .expect("pictures");
        assert_eq!(pictures, ["AAAA", "Zm9v"]);
        assert_eq!(m[0]["content"], "\u{E002}\u{E002}x");
        let bad = chat_messages(
            &json!({"messages": [{"role": "user", "content": "x", "images": ["@@"]}]}),
        );
        assert!(bad.is_err());
    }
}
