//! The OpenAI API: `POST /v1/chat/completions` (streaming or not, tools, reasoning as
//! `reasoning_content`, logprobs, usage), `POST /v1/completions` (text or token-id prompts) and
//! `GET /v1/models`; answers carry llama-server's `timings` (on the last chunk of a stream).

use super::body::{channel_response, json_response, sse_event, RespBody};
use super::errors::{ApiError, Kind};
use super::prepare::{chat_prompt, encode_error, leased_with};
use super::sampling::{integer, sampling};
use super::unsupported::refuse_constrained_output;
use super::AppState;
use crate::generate::{Finish, FinishReason, Generation, Output, Sampling, Step, TokenLogprob};
use crate::model_text::{ChatInput, ModelText, Piece};
use crate::telemetry::timings;
use bytes::Bytes;
use hyper::{Response, StatusCode};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, oneshot};

/// How long a cancelled request may take to give its DONE before the lease is released anyway.
pub const CANCEL_WAIT: Duration = Duration::from_secs(10);

pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn model_object(m: &crate::registry::ModelEntry) -> Value {
    json!({
        "id": m.id,
        "object": "model",
        "created": 0,
        "owned_by": "polystrata",
        "display_name": m.display_name,
        "status": m.status,
    })
}

pub async fn models(state: &AppState) -> Response<RespBody> {
    let data: Vec<Value> = state
        .supervisor
        .models()
        .await
        .iter()
        .filter(|m| m.is_runnable())
        .map(model_object)
        .collect();
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

/// `GET /v1/models/{id}`: one runnable model, by id or alias.
pub async fn model(state: &AppState, id: &str) -> Result<Response<RespBody>, ApiError> {
    let models = state.supervisor.models().await;
    models
        .iter()
        .find(|m| m.is_runnable() && m.answers_to(id))
        .map(|m| json_response(StatusCode::OK, &model_object(m)))
        .ok_or_else(|| ApiError::new(Kind::ModelNotFound, format!("model {id:?} not found")))
}

fn model_field(body: &Value) -> Result<Option<String>, ApiError> {
    match body.get("model") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::bad_request("`model` must be a string")),
    }
}

fn bool_field(body: &Value, key: &str) -> Result<bool, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad_request(format!(
            "`{key}` must be true or false"
        ))),
    }
}

/// The chat-related fields of an OpenAI chat request.
pub(super) struct ChatRequest {
    pub(super) model: Option<String>,
    pub(super) input: ChatInput,
    pub(super) sampling: Sampling,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    pub(super) logprobs: bool,
}

pub(super) fn parse_chat(body: &Value) -> Result<ChatRequest, ApiError> {
    let mut messages = match body.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m.clone(),
        Some(Value::Array(_)) => return Err(ApiError::bad_request("`messages` is empty")),
        _ => return Err(ApiError::bad_request("`messages` (an array) is required")),
    };
    refuse_constrained_output(body)?;
    let pictures = super::pictures::take_openai_pictures(
        &mut messages,
        body.get("model").and_then(Value::as_str),
    )?;
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        if !matches!(
            role,
            Some("system" | "developer" | "user" | "assistant" | "tool")
        ) {
            return Err(ApiError::bad_request(format!(
                "messages[{i}].role must be system, developer, user, assistant or tool"
            )));
        }
    }
    if let Some(n) = integer(body, "n", 1, 128)? {
        if n != 1 {
            return Err(ApiError::bad_request("only `n` = 1 is supported"));
        }
    }
    let tool_choice = body.get("tool_choice");
    // A named function narrows the tools to it (no grammar forces a call; the model sees only that tool).
    let forced = tool_choice
        .and_then(|c| c.get("function"))
        .and_then(|f| f.get("name"))
        .and_then(Value::as_str);
    let tools = match body.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(t))
            if tool_choice.and_then(Value::as_str) == Some("none") || t.is_empty() =>
        {
            None
        }
        Some(Value::Array(t)) => match forced {
            None => Some(t.clone()),
            Some(name) => {
                let named: Vec<Value> = t
                    .iter()
                    .filter(|tool| tool["function"]["name"].as_str() == Some(name))
                    .cloned()
                    .collect();
                if named.is_empty() {
                    return Err(ApiError::bad_request(format!(
                        "`tool_choice` names {name:?}, which is not among `tools`"
                    )));
                }
                Some(named)
            }
        },
        Some(_) => return Err(ApiError::bad_request("`tools` must be an array")),
    };
    let mut extra = match body.get("chat_template_kwargs") {
        None | Some(Value::Null) => serde_json::Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(_) => {
            return Err(ApiError::bad_request(
                "`chat_template_kwargs` must be an object",
            ))
        }
    };
    let enable_thinking = extra
        .remove("enable_thinking")
        .and_then(|v| v.as_bool())
        .or_else(|| {
            body.get("reasoning_effort")
                .and_then(Value::as_str)
                .map(|e| e != "none")
        });
    let logprobs = bool_field(body, "logprobs")?;
    let mut sampling = sampling(body, &["max_completion_tokens", "max_tokens"], "stop")?;
    let top = integer(body, "top_logprobs", 0, 20)?;
    if logprobs {
        sampling.top_logprobs = top.map(|n| n as u32);
    }
    Ok(ChatRequest {
        model: model_field(body)?,
        input: ChatInput {
            messages,
            tools,
            enable_thinking,
            extra,
            parse_special: bool_field(body, "parse_special")?,
            pictures,
        },
        sampling,
        stream: bool_field(body, "stream")?,
        include_usage: body
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false),
        logprobs,
    })
}

fn finish_reason(finish: &Finish, tool_calls: bool) -> &'static str {
    if tool_calls {
        return "tool_calls";
    }
    match finish.reason {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

fn usage(finish: &Finish) -> Value {
    json!({
        "prompt_tokens": finish.prompt_tokens,
        "completion_tokens": finish.completion_tokens,
        "total_tokens": finish.prompt_tokens + finish.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": finish.cached_tokens},
    })
}

/// One token's entry of `logprobs.content`.
fn chat_logprob(text: &ModelText, lp: &TokenLogprob) -> Value {
    let piece = text.token_piece(lp.id);
    json!({
        "token": piece,
        "logprob": lp.logprob,
        "bytes": piece.as_bytes(),
        "top_logprobs": lp.top.iter().map(|&(id, logprob)| {
            let p = text.token_piece(id);
            json!({"token": p, "logprob": logprob, "bytes": p.as_bytes()})
        }).collect::<Vec<_>>(),
    })
}

fn tool_call_id(gen_id: &str, index: usize) -> String {
    format!("call_{gen_id}_{index}")
}

pub async fn chat_completions(
    state: Arc<AppState>,
    body: Value,
) -> Result<Response<RespBody>, ApiError> {
    let req = parse_chat(&body)?;
    super::prepare::refuse_pictures_early(&state, req.model.as_deref(), &req.input).await?;
    let input = Arc::new(req.input);
    let chat = input.clone();
    let (lease, (rendered, prompt, resume)) =
        leased_with(&state, req.model.as_deref(), move |text, n_ctx| {
            chat_prompt(text, &chat, n_ctx)
        })
        .await?;
    let text = lease.text();
    let id = state.supervisor.next_request_id();
    let model = lease.model().id.clone();
    let gen = Generation::start_in(
        lease,
        id.clone(),
        prompt,
        &req.sampling,
        Output::Chat(rendered.parser),
        resume,
        rendered.pictures,
    )
    .map_err(ApiError::from)?;
    let meta = Meta {
        id: format!("chatcmpl-{id}"),
        gen_id: id,
        model,
        created: unix_now(),
        text,
        logprobs: req.logprobs,
    };
    if req.stream {
        let (resp, tx) = channel_response("text/event-stream");
        tokio::spawn(stream_chat(gen, meta, tx, req.include_usage));
        Ok(resp)
    } else {
        let (done_tx, done_rx) = oneshot::channel();
        tokio::spawn(collect_chat(gen, meta, done_tx));
        match done_rx.await {
            Ok(result) => result.map(|v| json_response(StatusCode::OK, &v)),
            Err(_) => Err(ApiError::new(Kind::Internal, "the generation task ended")),
        }
    }
}

struct Meta {
    id: String,
    gen_id: String,
    model: String,
    created: u64,
    text: Arc<ModelText>,
    logprobs: bool,
}

async fn collect_chat(
    mut gen: Generation,
    meta: Meta,
    done: oneshot::Sender<Result<Value, ApiError>>,
) {
    let (mut content, mut reasoning) = (String::new(), String::new());
    let mut calls: Vec<Value> = Vec::new();
    let mut logprobs: Vec<Value> = Vec::new();
    let mut done = done;
    let finish = loop {
        let Some(step) = next_or_left(&mut gen, &mut done).await else {
            gen.cancel(CANCEL_WAIT).await;
            return;
        };
        match step {
            Step::Pieces {
                pieces,
                logprobs: lps,
            } => {
                if meta.logprobs {
                    logprobs.extend(lps.iter().map(|lp| chat_logprob(&meta.text, lp)));
                }
                for piece in pieces {
                    match piece {
                        Piece::Content(t) => content.push_str(&t),
                        Piece::Reasoning(t) => reasoning.push_str(&t),
                        Piece::ToolCall { name, arguments } => calls.push(json!({
                            "id": tool_call_id(&meta.gen_id, calls.len()),
                            "type": "function",
                            "function": {"name": name, "arguments": arguments},
                        })),
                    }
                }
            }
            Step::Finished(f) => break f,
            Step::Failed(e) => {
                let _ = done.send(Err(ApiError::from(e)));
                return;
            }
        }
    };
    drop(gen);
    let mut message = json!({"role": "assistant", "content": content});
    if !reasoning.is_empty() {
        message["reasoning_content"] = json!(reasoning);
    }
    if !calls.is_empty() {
        if content.is_empty() {
            message["content"] = Value::Null;
        }
        message["tool_calls"] = json!(calls);
    }
    let value = json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": if meta.logprobs { json!({"content": logprobs}) } else { Value::Null },
            "finish_reason": finish_reason(&finish, !calls.is_empty()),
        }],
        "usage": usage(&finish),
        "timings": timings(&finish),
    });
    let _ = done.send(Ok(value));
}

fn chunk(meta: &Meta, delta: Value, logprobs: Value, finish: Value) -> Value {
    json!({
        "id": meta.id,
        "object": "chat.completion.chunk",
        "created": meta.created,
        "model": meta.model,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
    })
}

/// Sends `bytes`, or tells that the client is gone.
async fn send(tx: &mpsc::Sender<Bytes>, bytes: Bytes) -> bool {
    tx.send(bytes).await.is_ok()
}

/// Waits for the next step, or cancels the generation when the client goes away (`None`).
pub async fn next_or_gone(gen: &mut Generation, tx: &mpsc::Sender<Bytes>) -> Option<Step> {
    tokio::select! {
        _ = tx.closed() => None,
        step = gen.next() => Some(step),
    }
}

/// Waits for the next step of an answer sent whole, or `None` when its request went away (the caller
/// cancels the generation).
pub async fn next_or_left<T>(gen: &mut Generation, done: &mut oneshot::Sender<T>) -> Option<Step> {
    tokio::select! {
        _ = done.closed() => None,
        step = gen.next() => Some(step),
    }
}

async fn stream_chat(
    mut gen: Generation,
    meta: Meta,
    tx: mpsc::Sender<Bytes>,
    include_usage: bool,
) {
    let first = chunk(
        &meta,
        json!({"role": "assistant", "content": ""}),
        Value::Null,
        Value::Null,
    );
    if !send(&tx, sse_event(None, &first)).await {
        gen.cancel(CANCEL_WAIT).await;
        return;
    }
    let mut n_calls = 0usize;
    let finish = loop {
        let Some(step) = next_or_gone(&mut gen, &tx).await else {
            gen.cancel(CANCEL_WAIT).await;
            return;
        };
        match step {
            Step::Pieces { pieces, logprobs } => {
                let mut lp = if meta.logprobs && !logprobs.is_empty() {
                    json!({"content": logprobs.iter().map(|l| chat_logprob(&meta.text, l)).collect::<Vec<_>>()})
                } else {
                    Value::Null
                };
                let mut out = Vec::new();
                for piece in pieces {
                    let delta = match piece {
                        Piece::Content(t) => json!({"content": t}),
                        Piece::Reasoning(t) => json!({"reasoning_content": t}),
                        Piece::ToolCall { name, arguments } => {
                            let d = json!({"tool_calls": [{
                                "index": n_calls,
                                "id": tool_call_id(&meta.gen_id, n_calls),
                                "type": "function",
                                "function": {"name": name, "arguments": arguments},
                            }]});
                            n_calls += 1;
                            d
                        }
                    };
                    out.push(chunk(&meta, delta, std::mem::take(&mut lp), Value::Null));
                }
                if out.is_empty() && !lp.is_null() {
                    // Tokens whose text is still held back (a stop-string prefix, a partial character).
                    out.push(chunk(&meta, json!({}), lp, Value::Null));
                }
                for c in out {
                    if !send(&tx, sse_event(None, &c)).await {
                        gen.cancel(CANCEL_WAIT).await;
                        return;
                    }
                }
            }
            Step::Finished(f) => break f,
            Step::Failed(e) => {
                let err = ApiError::from(e).body(super::errors::Flavor::OpenAi);
                let _ = send(&tx, sse_event(None, &err)).await;
                return;
            }
        }
    };
    drop(gen);
    let mut last = chunk(
        &meta,
        json!({}),
        Value::Null,
        json!(finish_reason(&finish, n_calls > 0)),
    );
    // llama-server puts its timings on the chunk that carries the finish reason.
    last["timings"] = timings(&finish);
    let _ = send(&tx, sse_event(None, &last)).await;
    if include_usage {
        let u = json!({
            "id": meta.id, "object": "chat.completion.chunk", "created": meta.created,
            "model": meta.model, "choices": [], "usage": usage(&finish),
        });
        let _ = send(&tx, sse_event(None, &u)).await;
    }
    let _ = send(&tx, Bytes::from_static(b"data: [DONE]\n\n")).await;
}

/// A completions prompt: text, or token ids (a one-element batch of either is accepted).
fn completion_prompt(body: &Value, text: &ModelText, n_ctx: u32) -> Result<Vec<u32>, ApiError> {
    fn ids(a: &[Value]) -> Option<Vec<u32>> {
        a.iter()
            .map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect()
    }
    let encode = |s: &str| text.encode_within(s, n_ctx).map_err(encode_error);
    match body.get("prompt") {
        Some(Value::String(s)) => encode(s),
        Some(Value::Array(a)) if a.is_empty() => Err(ApiError::bad_request("`prompt` is empty")),
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => {
            ids(a).ok_or_else(|| ApiError::bad_request("`prompt` token ids must be integers ≥ 0"))
        }
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(s) => encode(s),
            Value::Array(inner) => ids(inner)
                .ok_or_else(|| ApiError::bad_request("`prompt` token ids must be integers ≥ 0")),
            _ => Err(ApiError::bad_request("`prompt` must be text or token ids")),
        },
        Some(Value::Array(_)) => Err(ApiError::bad_request(
            "only one prompt per request is supported",
        )),
        _ => Err(ApiError::bad_request(
            "`prompt` (text or an array of token ids) is required",
        )),
    }
}

/// The legacy completion fields that change the answer and are not supported: refused, as chat refuses
/// `n`, rather than silently ignored.
fn refuse_unsupported_completion_fields(body: &Value) -> Result<(), ApiError> {
    refuse_constrained_output(body)?;
    for key in ["n", "best_of"] {
        if integer(body, key, 1, 128)?.is_some_and(|n| n != 1) {
            return Err(ApiError::bad_request(format!(
                "only `{key}` = 1 is supported"
            )));
        }
    }
    if bool_field(body, "echo")? {
        return Err(ApiError::bad_request("`echo` is not supported"));
    }
    match body.get("suffix") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(s)) if s.is_empty() => Ok(()),
        Some(_) => Err(ApiError::bad_request("`suffix` is not supported")),
    }
}

pub async fn completions(
    state: Arc<AppState>,
    body: Value,
) -> Result<Response<RespBody>, ApiError> {
    refuse_unsupported_completion_fields(&body)?;
    let model = model_field(&body)?;
    let mut sampling = sampling(&body, &["max_tokens"], "stop")?;
    let logprobs = integer(&body, "logprobs", 0, 20)?;
    sampling.top_logprobs = logprobs.map(|n| n as u32);
    let stream = bool_field(&body, "stream")?;
    let include_usage = body
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if sampling.max_tokens.is_none() {
        sampling.max_tokens = Some(16); // OpenAI's default for completions
    }
    if body.get("prompt").is_none() {
        return Err(ApiError::bad_request(
            "`prompt` (text or an array of token ids) is required",
        ));
    }
    let body = Arc::new(body);
    let request = body.clone();
    let (lease, prompt) = leased_with(&state, model.as_deref(), move |text, n_ctx| {
        completion_prompt(&request, text, n_ctx)
    })
    .await?;
    let text = lease.text();
    let n_vocab = lease.engine().ready().n_vocab;
    if let Some(bad) = prompt.iter().find(|&&t| t >= n_vocab) {
        return Err(ApiError::bad_request(format!(
            "token id {bad} is outside the vocabulary ({n_vocab})"
        )));
    }
    let id = state.supervisor.next_request_id();
    let model = lease.model().id.clone();
    let gen = Generation::start(lease, id.clone(), prompt, &sampling, Output::Raw)
        .map_err(ApiError::from)?;
    let meta = Meta {
        id: format!("cmpl-{id}"),
        gen_id: id,
        model,
        created: unix_now(),
        text,
        logprobs: logprobs.is_some(),
    };
    if stream {
        let (resp, tx) = channel_response("text/event-stream");
        tokio::spawn(stream_completion(gen, meta, tx, include_usage));
        Ok(resp)
    } else {
        let (done_tx, done_rx) = oneshot::channel();
        tokio::spawn(collect_completion(gen, meta, done_tx));
        match done_rx.await {
            Ok(result) => result.map(|v| json_response(StatusCode::OK, &v)),
            Err(_) => Err(ApiError::new(Kind::Internal, "the generation task ended")),
        }
    }
}

/// Legacy completions logprobs: tokens, their logprobs, the top alternatives and text offsets.
#[derive(Default)]
struct LegacyLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<f32>,
    top: Vec<Value>,
    offsets: Vec<usize>,
}

impl LegacyLogprobs {
    fn add(&mut self, text: &ModelText, lps: &[TokenLogprob], offset: &mut usize) {
        for lp in lps {
            let piece = text.token_piece(lp.id);
            self.offsets.push(*offset);
            *offset += piece.len();
            self.tokens.push(piece);
            self.token_logprobs.push(lp.logprob);
            let top: serde_json::Map<String, Value> = lp
                .top
                .iter()
                .map(|&(id, p)| (text.token_piece(id), json!(p)))
                .collect();
            self.top.push(Value::Object(top));
        }
    }

    fn json(&self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top,
            "text_offset": self.offsets,
        })
    }
}

fn completion_value(meta: &Meta, text: &str, logprobs: Value, finish: Value) -> Value {
    json!({
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}],
    })
}

async fn collect_completion(
    mut gen: Generation,
    meta: Meta,
    mut done: oneshot::Sender<Result<Value, ApiError>>,
) {
    let mut out = String::new();
    let mut lps = LegacyLogprobs::default();
    let mut offset = 0;
    let finish = loop {
        let Some(step) = next_or_left(&mut gen, &mut done).await else {
            gen.cancel(CANCEL_WAIT).await;
            return;
        };
        match step {
            Step::Pieces { pieces, logprobs } => {
                if meta.logprobs {
                    lps.add(&meta.text, &logprobs, &mut offset);
                }
                for p in pieces {
                    if let Piece::Content(t) | Piece::Reasoning(t) = p {
                        out.push_str(&t);
                    }
                }
            }
            Step::Finished(f) => break f,
            Step::Failed(e) => {
                let _ = done.send(Err(ApiError::from(e)));
                return;
            }
        }
    };
    drop(gen);
    let mut value = completion_value(
        &meta,
        &out,
        if meta.logprobs {
            lps.json()
        } else {
            Value::Null
        },
        json!(finish_reason(&finish, false)),
    );
    value["usage"] = usage(&finish);
    value["timings"] = timings(&finish);
    let _ = done.send(Ok(value));
}

async fn stream_completion(
    mut gen: Generation,
    meta: Meta,
    tx: mpsc::Sender<Bytes>,
    include_usage: bool,
) {
    let mut offset = 0;
    let finish = loop {
        let Some(step) = next_or_gone(&mut gen, &tx).await else {
            gen.cancel(CANCEL_WAIT).await;
            return;
        };
        match step {
            Step::Pieces { pieces, logprobs } => {
                let mut text = String::new();
                for p in pieces {
                    if let Piece::Content(t) | Piece::Reasoning(t) = p {
                        text.push_str(&t);
                    }
                }
                let lp = if meta.logprobs {
                    let mut l = LegacyLogprobs::default();
                    l.add(&meta.text, &logprobs, &mut offset);
                    l.json()
                } else {
                    Value::Null
                };
                let c = completion_value(&meta, &text, lp, Value::Null);
                if !send(&tx, sse_event(None, &c)).await {
                    gen.cancel(CANCEL_WAIT).await;
                    return;
                }
            }
            Step::Finished(f) => break f,
            Step::Failed(e) => {
                let err = ApiError::from(e).body(super::errors::Flavor::OpenAi);
                let _ = send(&tx, sse_event(None, &err)).await;
                return;
            }
        }
    };
    drop(gen);
    let mut last = completion_value(&meta, "", Value::Null, json!(finish_reason(&finish, false)));
    last["timings"] = timings(&finish);
    let _ = send(&tx, sse_event(None, &last)).await;
    if include_usage {
        let u = json!({
            "id": meta.id, "object": "text_completion", "created": meta.created,
            "model": meta.model, "choices": [], "usage": usage(&finish),
        });
        let _ = send(&tx, sse_event(None, &u)).await;
    }
    let _ = send(&tx, Bytes::from_static(b"data: [DONE]\n\n")).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_completion_fields_are_refused() {
        let ok = json!({"prompt": "x", "n": 1, "best_of": 1, "echo": false, "suffix": ""});
        assert!(refuse_unsupported_completion_fields(&ok).is_ok());
        for bad in [
            json!({"prompt": "x", "n": 2}),
            json!({"prompt": "x", "best_of": 3}),
            json!({"prompt": "x", "echo": true}),
            json!({"prompt": "x", "suffix": "tail"}),
        ] {
            let e = refuse_unsupported_completion_fields(&bad).expect_err("refused");
            assert_eq!(e.kind, Kind::BadRequest, "{bad}");
        }
    }

    #[test]
    fn chat_requests_are_checked() {
        assert!(parse_chat(&json!({})).is_err());
        assert!(parse_chat(&json!({"messages": []})).is_err());
        assert!(parse_chat(&json!({"messages": [{"role": "robot", "content": "x"}]})).is_err());
        assert!(
            parse_chat(&json!({"messages": [{"role": "user", "content": "x"}], "n": 2})).is_err()
        );
        let ok = parse_chat(&json!({
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "logprobs": true, "top_logprobs": 3, "stream": true,
            "stream_options": {"include_usage": true},
        }))
        .expect("valid");
        assert!(ok.stream && ok.include_usage && ok.logprobs);
        assert_eq!(ok.sampling.top_logprobs, Some(3));
        assert_eq!(ok.input.tools.as_ref().map(Vec::len), Some(1));
        let none = parse_chat(&json!({
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "none",
        }))
        .expect("valid");
        assert!(none.input.tools.is_none());
        let two = json!([
            {"type": "function", "function": {"name": "f"}},
            {"type": "function", "function": {"name": "g"}},
        ]);
        let named = parse_chat(&json!({
            "messages": [{"role": "user", "content": "x"}],
            "tools": two,
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        }))
        .expect("valid");
        assert_eq!(
            named.input.tools.map(|t| t.len()),
            Some(1),
            "only the named tool"
        );
        assert!(parse_chat(&json!({
            "messages": [{"role": "user", "content": "x"}],
            "tools": two,
            "tool_choice": {"type": "function", "function": {"name": "h"}},
        }))
        .is_err());
    }
}
