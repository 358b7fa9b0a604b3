//! The OpenAI Responses API: `POST /v1/responses`, streamed (`response.*` events) or not.
//!
//! A request is turned into the chat request it amounts to (`input` items into messages, flat function
//! tools into chat tools, `instructions` into a system message, `max_output_tokens`, `text.format`,
//! `reasoning.effort`) and read by the chat route's own parser, so both refuse and default alike. The
//! server keeps no responses: `previous_response_id` and `conversation` are refused (400), send the
//! whole conversation instead.

use super::body::{channel_response, json_response, sse_event, RespBody};
use super::errors::{ApiError, Flavor, Kind};
use super::openai::{next_or_gone, next_or_left, parse_chat, unix_now, CANCEL_WAIT};
use super::prepare::{chat_prompt, leased_with};
use super::AppState;
use crate::generate::{Finish, FinishReason, Generation, Output, Step};
use crate::model_text::Piece;
use bytes::Bytes;
use hyper::{Response, StatusCode};
use serde_json::{json, Map, Value};
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

/// The text of a content given as a string or as parts (`input_text`, `output_text`, `text`); image
/// parts outside a user's message ([`picture_parts`] reads those), audio and file parts are refused as
/// the chat route refuses them.
fn content_text(content: &Value, at: usize) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut out = String::new();
            for p in parts {
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => {
                        out.push_str(p.get("text").and_then(Value::as_str).unwrap_or(""))
                    }
                    Some(kind @ ("input_image" | "input_file" | "input_audio")) => {
                        return Err(super::unsupported::text_only(
                            None,
                            &format!("a content part of type {kind:?} (input[{at}])"),
                        ))
                    }
                    other => {
                        return Err(ApiError::bad_request(format!(
                            "input[{at}]: content parts of type {other:?} are not supported"
                        )))
                    }
                }
            }
            Ok(out)
        }
        _ => Err(ApiError::bad_request(format!(
            "input[{at}].content must be text or an array of parts"
        ))),
    }
}

/// A user message's parts with pictures (`input_image` with an `image_url`) as the chat route's parts:
/// `input_text` as `text`, `input_image` as `image_url`, whose pictures the chat route takes
/// ([`super::pictures::take_openai_pictures`]); `None` when the content holds no picture.
fn picture_parts(content: &Value, at: usize) -> Result<Option<Value>, ApiError> {
    let Value::Array(parts) = content else {
        return Ok(None);
    };
    if !parts.iter().any(|p| p["type"] == "input_image") {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(parts.len());
    for p in parts {
        out.push(match p.get("type").and_then(Value::as_str) {
            Some("input_image") => match p.get("image_url").and_then(Value::as_str) {
                Some(url) => json!({"type": "image_url", "image_url": {"url": url}}),
                None => {
                    return Err(ApiError::bad_request(format!(
                        "input[{at}]: an input_image needs an `image_url` (a data URL; this server \
                         keeps no files)"
                    )))
                }
            },
            _ => json!({"type": "text", "text": content_text(&json!([p]), at)?}),
        });
    }
    Ok(Some(Value::Array(out)))
}

/// `input` (a string or items) and `instructions` as chat messages.
fn messages(body: &Value) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    if let Some(i) = body.get("instructions").and_then(Value::as_str) {
        if !i.is_empty() {
            out.push(json!({"role": "system", "content": i}));
        }
    }
    let items = match body.get("input") {
        Some(Value::String(s)) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(out);
        }
        Some(Value::Array(items)) => items,
        _ => {
            return Err(ApiError::bad_request(
                "`input` (text or an array of items) is required",
            ))
        }
    };
    for (at, item) in items.iter().enumerate() {
        let kind = item
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("message");
        match kind {
            "message" => {
                let role = item.get("role").and_then(Value::as_str).unwrap_or("");
                if !matches!(role, "user" | "system" | "developer" | "assistant") {
                    return Err(ApiError::bad_request(format!(
                        "input[{at}].role must be user, system, developer or assistant"
                    )));
                }
                let content = item.get("content").unwrap_or(&Value::Null);
                let content = match picture_parts(content, at)? {
                    Some(parts) if role == "user" => parts,
                    _ => Value::String(content_text(content, at)?),
                };
                out.push(json!({"role": role, "content": content}));
            }
            "function_call" => {
                let call = json!({
                    "id": item.get("call_id").cloned().unwrap_or(Value::Null),
                    "type": "function",
                    "function": {
                        "name": item.get("name").cloned().unwrap_or(Value::Null),
                        "arguments": item.get("arguments").cloned().unwrap_or(json!("{}")),
                    },
                });
                // Calls of one turn go into one assistant message, as a chat writes them.
                match out.last_mut() {
                    Some(last)
                        if last["role"] == "assistant" && last.get("tool_calls").is_some() =>
                    {
                        if let Some(calls) = last["tool_calls"].as_array_mut() {
                            calls.push(call);
                        }
                    }
                    _ => out
                        .push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                // A tool's output as text, or as parts with pictures (`input_image`), which the chat
                // route reads where the tool's answer stands.
                let output = match item.get("output") {
                    Some(Value::String(s)) => Value::String(s.clone()),
                    Some(other) => match picture_parts(other, at)? {
                        Some(parts) => parts,
                        None => Value::String(content_text(other, at)?),
                    },
                    None => Value::String(String::new()),
                };
                out.push(json!({"role": "tool",
                    "tool_call_id": item.get("call_id").cloned().unwrap_or(Value::Null),
                    "content": output}));
            }
            // An earlier answer's reasoning: templates drop it from later turns anyway.
            "reasoning" => {}
            other => {
                return Err(ApiError::bad_request(format!(
                    "input[{at}]: items of type {other:?} are not supported"
                )))
            }
        }
    }
    Ok(out)
}

/// The chat request a Responses request amounts to.
fn as_chat(body: &Value) -> Result<Value, ApiError> {
    for key in ["previous_response_id", "conversation"] {
        if body.get(key).is_some_and(|v| !v.is_null()) {
            return Err(ApiError::bad_request(format!(
                "`{key}`: this server keeps no responses; send the whole conversation in `input`"
            )));
        }
    }
    let mut chat = Map::new();
    chat.insert("messages".into(), json!(messages(body)?));
    for key in [
        "model",
        "temperature",
        "top_p",
        "stream",
        "tool_choice",
        "seed",
    ] {
        if let Some(v) = body.get(key) {
            chat.insert(key.into(), v.clone());
        }
    }
    if let Some(v) = body.get("max_output_tokens") {
        chat.insert("max_tokens".into(), v.clone());
    }
    // Flat function tools (`{"type": "function", "name", "parameters"}`) as chat tools; other kinds
    // (web search, files) cannot run here.
    if let Some(Value::Array(tools)) = body.get("tools") {
        let mut converted = Vec::new();
        for t in tools {
            match t.get("type").and_then(Value::as_str) {
                Some("function") => converted.push(json!({"type": "function", "function": {
                    "name": t.get("name").cloned().unwrap_or(Value::Null),
                    "description": t.get("description").cloned().unwrap_or(json!("")),
                    "parameters": t.get("parameters").cloned().unwrap_or(json!({"type": "object"})),
                }})),
                other => {
                    return Err(ApiError::bad_request(format!(
                        "tools of type {other:?} are not supported (function tools only)"
                    )))
                }
            }
        }
        chat.insert("tools".into(), json!(converted));
    }
    // A named tool choice is flat here (`{"type": "function", "name"}`).
    if let Some(name) = body
        .get("tool_choice")
        .and_then(|c| c.get("name"))
        .and_then(Value::as_str)
    {
        chat.insert(
            "tool_choice".into(),
            json!({"type": "function", "function": {"name": name}}),
        );
    }
    if let Some(format) = body.get("text").and_then(|t| t.get("format")) {
        chat.insert("response_format".into(), format.clone());
    }
    if let Some(effort) = body
        .get("reasoning")
        .and_then(|r| r.get("effort"))
        .and_then(Value::as_str)
    {
        chat.insert("reasoning_effort".into(), json!(effort));
    }
    Ok(Value::Object(chat))
}

struct Meta {
    id: String,
    gen_id: String,
    model: String,
    created: u64,
}

/// What the answer holds so far, in output-item order.
#[derive(Default)]
struct Answer {
    reasoning: String,
    text: String,
    calls: Vec<(String, String)>,
}

fn usage(f: &Finish) -> Value {
    json!({
        "input_tokens": f.prompt_tokens,
        "input_tokens_details": {"cached_tokens": f.cached_tokens},
        "output_tokens": f.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": f.prompt_tokens + f.completion_tokens,
    })
}

impl Meta {
    fn msg_id(&self) -> String {
        format!("msg_{}", self.gen_id)
    }

    fn reasoning_item(&self, text: &str, status: &str) -> Value {
        json!({"type": "reasoning", "id": format!("rs_{}", self.gen_id), "status": status,
               "summary": [], "content": [{"type": "reasoning_text", "text": text}]})
    }

    fn message_item(&self, text: &str, status: &str) -> Value {
        let content = if status == "in_progress" {
            json!([])
        } else {
            json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}])
        };
        json!({"type": "message", "id": self.msg_id(), "status": status, "role": "assistant",
               "content": content})
    }

    fn call_item(&self, n: usize, name: &str, arguments: &str) -> Value {
        json!({"type": "function_call", "id": format!("fc_{}_{n}", self.gen_id),
               "call_id": format!("call_{}_{n}", self.gen_id), "name": name,
               "arguments": arguments, "status": "completed"})
    }

    /// The response object; `finish` absent while in progress.
    fn response(&self, answer: &Answer, finish: Option<&Finish>) -> Value {
        let mut output = Vec::new();
        if let Some(f) = finish {
            // The item the length cut is `incomplete`, as OpenAI's: the reasoning when nothing
            // followed it, else the message.
            let cut = last_item_status(f);
            if !answer.reasoning.is_empty() {
                let last = answer.text.is_empty() && answer.calls.is_empty();
                let status = if last { cut } else { "completed" };
                output.push(self.reasoning_item(&answer.reasoning, status));
            }
            if !answer.text.is_empty() || answer.calls.is_empty() {
                output.push(self.message_item(&answer.text, cut));
            }
            for (n, (name, args)) in answer.calls.iter().enumerate() {
                output.push(self.call_item(n, name, args));
            }
        }
        let (status, incomplete) = match finish.map(|f| &f.reason) {
            None => ("in_progress", Value::Null),
            Some(FinishReason::Length) => ("incomplete", json!({"reason": "max_output_tokens"})),
            Some(_) => ("completed", Value::Null),
        };
        json!({
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "incomplete_details": incomplete,
            "error": null, "parallel_tool_calls": true, "tool_choice": "auto", "tools": [],
            "usage": finish.map(usage),
            "timings": finish.map(crate::telemetry::timings),
        })
    }
}

pub async fn responses(state: Arc<AppState>, body: Value) -> Result<Response<RespBody>, ApiError> {
    let chat = as_chat(&body)?;
    let req = parse_chat(&chat)?;
    super::prepare::refuse_pictures_early(&state, req.model.as_deref(), &req.input).await?;
    let input = Arc::new(req.input);
    let for_prompt = input.clone();
    let (lease, (rendered, prompt, resume)) =
        leased_with(&state, req.model.as_deref(), move |text, n_ctx| {
            chat_prompt(text, &for_prompt, n_ctx)
        })
        .await?;
    let gen_id = state.supervisor.next_request_id();
    let meta = Meta {
        id: format!("resp_{gen_id}"),
        gen_id: gen_id.clone(),
        model: lease.model().id.clone(),
        created: unix_now(),
    };
    let gen = Generation::start_in(
        lease,
        gen_id,
        prompt,
        &req.sampling,
        Output::Chat(rendered.parser),
        resume,
        rendered.pictures,
    )
    .map_err(ApiError::from)?;
    if req.stream {
        let (resp, tx) = channel_response("text/event-stream");
        tokio::spawn(stream(gen, meta, tx));
        return Ok(resp);
    }
    let (done_tx, done_rx) = oneshot::channel();
    tokio::spawn(collect(gen, meta, done_tx));
    match done_rx.await {
        Ok(result) => result.map(|v| json_response(StatusCode::OK, &v)),
        Err(_) => Err(ApiError::new(Kind::Internal, "the generation task ended")),
    }
}

fn add(answer: &mut Answer, pieces: Vec<Piece>) {
    for p in pieces {
        match p {
            Piece::Content(t) => answer.text.push_str(&t),
            Piece::Reasoning(t) => answer.reasoning.push_str(&t),
            Piece::ToolCall { name, arguments } => answer.calls.push((name, arguments)),
        }
    }
}

async fn collect(
    mut gen: Generation,
    meta: Meta,
    mut done: oneshot::Sender<Result<Value, ApiError>>,
) {
    let mut answer = Answer::default();
    let finish = loop {
        let Some(step) = next_or_left(&mut gen, &mut done).await else {
            gen.cancel(CANCEL_WAIT).await;
            return;
        };
        match step {
            Step::Pieces { pieces, .. } => add(&mut answer, pieces),
            Step::Finished(f) => break f,
            Step::Failed(e) => {
                let _ = done.send(Err(ApiError::from(e)));
                return;
            }
        }
    };
    drop(gen);
    let _ = done.send(Ok(meta.response(&answer, Some(&finish))));
}

/// The stream's events, numbered.
struct Events {
    tx: mpsc::Sender<Bytes>,
    seq: u64,
}

impl Events {
    /// Sends one event; false when the client is gone.
    async fn send(&mut self, kind: &str, mut data: Value) -> bool {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        self.tx.send(sse_event(Some(kind), &data)).await.is_ok()
    }
}

/// Which output item is open in the stream.
#[derive(PartialEq)]
enum Open {
    None,
    Reasoning,
    Text,
}

async fn stream(mut gen: Generation, meta: Meta, tx: mpsc::Sender<Bytes>) {
    let mut ev = Events { tx, seq: 0 };
    let mut answer = Answer::default();
    let mut open = Open::None;
    let mut index = 0usize;
    let start = meta.response(&answer, None);
    if !ev
        .send("response.created", json!({"response": start.clone()}))
        .await
        || !ev
            .send("response.in_progress", json!({"response": start}))
            .await
    {
        gen.cancel(CANCEL_WAIT).await;
        return;
    }
    let finish = loop {
        let Some(step) = next_or_gone(&mut gen, &ev.tx).await else {
            gen.cancel(CANCEL_WAIT).await;
            return;
        };
        let pieces = match step {
            Step::Pieces { pieces, .. } => pieces,
            Step::Finished(f) => break f,
            Step::Failed(e) => {
                let err = ApiError::from(e).body(Flavor::OpenAi);
                let _ = ev
                    .send(
                        "error",
                        json!({"code": null, "message": err["error"]["message"], "param": null}),
                    )
                    .await;
                return;
            }
        };
        for piece in pieces {
            let ok = match piece {
                Piece::Reasoning(t) => {
                    let mut ok = true;
                    if open != Open::Reasoning {
                        ok &= close(&mut ev, &meta, &answer, &mut open, &mut index, "completed")
                            .await;
                        ok &= ev
                            .send(
                                "response.output_item.added",
                                json!({"output_index": index,
                            "item": meta.reasoning_item("", "in_progress")}),
                            )
                            .await;
                        open = Open::Reasoning;
                    }
                    answer.reasoning.push_str(&t);
                    ok && ev
                        .send(
                            "response.reasoning_text.delta",
                            json!({"output_index": index,
                        "item_id": format!("rs_{}", meta.gen_id), "content_index": 0, "delta": t}),
                        )
                        .await
                }
                Piece::Content(t) => {
                    let mut ok = true;
                    if open != Open::Text {
                        ok &= close(&mut ev, &meta, &answer, &mut open, &mut index, "completed")
                            .await;
                        ok &= ev
                            .send(
                                "response.output_item.added",
                                json!({"output_index": index,
                            "item": meta.message_item("", "in_progress")}),
                            )
                            .await;
                        ok &= ev
                            .send(
                                "response.content_part.added",
                                json!({"output_index": index,
                            "item_id": meta.msg_id(), "content_index": 0,
                            "part": {"type": "output_text", "text": "", "annotations": []}}),
                            )
                            .await;
                        open = Open::Text;
                    }
                    answer.text.push_str(&t);
                    ok && ev
                        .send(
                            "response.output_text.delta",
                            json!({"output_index": index,
                        "item_id": meta.msg_id(), "content_index": 0, "delta": t, "logprobs": []}),
                        )
                        .await
                }
                Piece::ToolCall { name, arguments } => {
                    let mut ok =
                        close(&mut ev, &meta, &answer, &mut open, &mut index, "completed").await;
                    let n = answer.calls.len();
                    let item = meta.call_item(n, &name, &arguments);
                    let mut added = item.clone();
                    added["arguments"] = json!("");
                    added["status"] = json!("in_progress");
                    ok &= ev
                        .send(
                            "response.output_item.added",
                            json!({"output_index": index, "item": added}),
                        )
                        .await;
                    ok &= ev
                        .send(
                            "response.function_call_arguments.delta",
                            json!({"output_index": index,
                        "item_id": item["id"], "delta": arguments}),
                        )
                        .await;
                    ok &= ev
                        .send(
                            "response.function_call_arguments.done",
                            json!({"output_index": index,
                        "item_id": item["id"], "arguments": arguments, "name": name}),
                        )
                        .await;
                    ok &= ev
                        .send(
                            "response.output_item.done",
                            json!({"output_index": index, "item": item}),
                        )
                        .await;
                    answer.calls.push((name, arguments));
                    index += 1;
                    ok
                }
            };
            if !ok {
                gen.cancel(CANCEL_WAIT).await;
                return;
            }
        }
    };
    drop(gen);
    if answer.text.is_empty() && answer.calls.is_empty() && open != Open::Text {
        // An empty answer still has its message item, as the whole response shows it.
        let _ = close(
            &mut ev,
            &meta,
            &answer,
            &mut open,
            &mut index,
            last_item_status(&finish),
        )
        .await;
        let _ = ev
            .send(
                "response.output_item.added",
                json!({"output_index": index,
            "item": meta.message_item("", "in_progress")}),
            )
            .await;
        open = Open::Text;
    }
    let _ = close(
        &mut ev,
        &meta,
        &answer,
        &mut open,
        &mut index,
        last_item_status(&finish),
    )
    .await;
    let done = meta.response(&answer, Some(&finish));
    let kind = if done["status"] == "incomplete" {
        "response.incomplete"
    } else {
        "response.completed"
    };
    let _ = ev.send(kind, json!({"response": done})).await;
}

/// The status of the answer's last item: `incomplete` when the length ended it.
fn last_item_status(finish: &Finish) -> &'static str {
    match finish.reason {
        FinishReason::Length => "incomplete",
        _ => "completed",
    }
}

/// Closes the open output item (its `done` events); false when the client is gone.
async fn close(
    ev: &mut Events,
    meta: &Meta,
    answer: &Answer,
    open: &mut Open,
    index: &mut usize,
    status: &str,
) -> bool {
    let ok = match open {
        Open::None => return true,
        Open::Reasoning => {
            ev.send("response.reasoning_text.done", json!({"output_index": *index,
                "item_id": format!("rs_{}", meta.gen_id), "content_index": 0, "text": answer.reasoning}))
                .await
                && ev.send("response.output_item.done", json!({"output_index": *index,
                    "item": meta.reasoning_item(&answer.reasoning, status)})).await
        }
        Open::Text => {
            let part = json!({"type": "output_text", "text": answer.text, "annotations": []});
            ev.send("response.output_text.done", json!({"output_index": *index,
                "item_id": meta.msg_id(), "content_index": 0, "text": answer.text, "logprobs": []}))
                .await
                && ev.send("response.content_part.done", json!({"output_index": *index,
                    "item_id": meta.msg_id(), "content_index": 0, "part": part})).await
                && ev.send("response.output_item.done", json!({"output_index": *index,
                    "item": meta.message_item(&answer.text, status)})).await
        }
    };
    *open = Open::None;
    *index += 1;
    ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_become_chat_requests() {
        let chat = as_chat(&json!({
            "model": "m", "instructions": "Be brief.", "max_output_tokens": 9,
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
            "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}],
        }))
        .expect("valid");
        let m = chat["messages"].as_array().cloned().unwrap_or_default();
        assert_eq!(m[0]["role"], "system");
        assert_eq!(m[1]["content"], "Weather?");
        assert_eq!(m[2]["tool_calls"][0]["function"]["name"], "w");
        assert_eq!(m[3]["tool_call_id"], "c1");
        assert_eq!(chat["max_tokens"], 9);
        assert_eq!(chat["tools"][0]["function"]["name"], "w");
        assert!(parse_chat(&chat).is_ok());
        assert!(as_chat(&json!({"input": "x", "previous_response_id": "resp_1"})).is_err());
        // A tool output's input_image becomes an image_url part of the tool message.
        let m = messages(&json!({"input": [
            {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [
                {"type": "input_text", "text": "the screen:"},
                {"type": "input_image", "image_url": "data:image/png;base64,Zm9v"}]}]}))
        .expect("messages");
        assert_eq!(m[1]["role"], "tool");
        assert_eq!(
            m[1]["content"],
            json!([{"type": "text", "text": "the screen:"},
                   {"type": "image_url", "image_url": {"url": "data:image/png;base64,Zm9v"}}])
        );
        // A user's input_image becomes the chat route's image_url part; a system message's is refused.
        let pictured = as_chat(&json!({"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What is it?"},
            {"type": "input_image", "image_url": "data:image/png;base64,Zm9v"}]}]}))
        .expect("converted");
        assert_eq!(
            pictured["messages"][0]["content"][1]["image_url"]["url"],
            "data:image/png;base64,Zm9v"
        );
        assert_eq!(
            parse_chat(&pictured).expect("parsed").input.pictures,
            ["Zm9v"]
        );
        assert!(as_chat(&json!({"input": [{"role": "system", "content": [
            {"type": "input_image", "image_url": "data:"}]}]}))
        .is_err());
        assert!(as_chat(&json!({"input": [{"role": "user", "content": [
            {"type": "input_image", "file_id": "f1"}]}]}))
        .is_err());
        let fmt = as_chat(&json!({"input": "x", "text": {"format": {"type": "json_object"}}}))
            .expect("converted");
        assert!(parse_chat(&fmt).is_err(), "constrained output is refused");
    }
}
