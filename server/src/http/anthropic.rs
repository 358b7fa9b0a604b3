//! The Anthropic Messages API: `POST /v1/messages`, streaming (message_start, content blocks with text,
//! thinking and tool_use deltas, message_delta, message_stop) and not; tool_use / tool_result blocks are
//! carried to the chat template as the OpenAI-shaped messages the text side reads.

use super::body::{channel_response, json_response, sse_event, RespBody};
use super::errors::{ApiError, Flavor, Kind};
use super::openai::{next_or_gone, next_or_left, CANCEL_WAIT};
use super::prepare::{chat_prompt, encode_error, leased_with, off_runtime};
use super::sampling::sampling;
use super::AppState;
use crate::generate::{Finish, FinishReason, Generation, Output, Step};
use crate::model_text::{ChatInput, Piece};
use bytes::Bytes;
use hyper::{Response, StatusCode};
use serde_json::{json, Value};
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

fn text_of(content: &Value) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut out = String::new();
            for b in blocks {
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        out.push_str(b.get("text").and_then(Value::as_str).unwrap_or(""))
                    }
                    Some(kind @ ("image" | "document")) => {
                        return Err(super::unsupported::text_only(
                            None,
                            &format!("a content block of type {kind:?}"),
                        ))
                    }
                    Some(other) => {
                        return Err(ApiError::bad_request(format!(
                            "content blocks of type {other:?} are not supported here"
                        )))
                    }
                    None => return Err(ApiError::bad_request("a content block has no `type`")),
                }
            }
            Ok(out)
        }
        Value::Null => Ok(String::new()),
        _ => Err(ApiError::bad_request(
            "content must be a string or an array of blocks",
        )),
    }
}

/// A `tool_result`'s content as the tool message's text: its text blocks, and a picture mark where each
/// `image` block stood (the picture appended to `pictures`), as a user message's pictures are read.
fn tool_result_text(
    content: &Value,
    what: &str,
    pictures: &mut Vec<String>,
) -> Result<String, ApiError> {
    let Value::Array(blocks) = content else {
        return text_of(content);
    };
    let mut out = String::new();
    for (k, b) in blocks.iter().enumerate() {
        match b.get("type").and_then(Value::as_str) {
            Some("image") => {
                pictures.push(super::pictures::anthropic_picture(
                    b,
                    &format!("{what}.content[{k}]"),
                )?);
                out.push(crate::model_text::PICTURE_MARK);
            }
            _ => out.push_str(&text_of(&Value::Array(vec![b.clone()]))?),
        }
    }
    Ok(out)
}

/// Turns an Anthropic conversation into OpenAI-shaped messages (what the chat templates read).
pub fn to_chat_input(body: &Value) -> Result<ChatInput, ApiError> {
    let mut messages = Vec::new();
    if let Some(system) = body.get("system") {
        let s = text_of(system)?;
        if !s.is_empty() {
            messages.push(json!({"role": "system", "content": s}));
        }
    }
    let Some(Value::Array(input)) = body.get("messages") else {
        return Err(ApiError::bad_request("`messages` (an array) is required"));
    };
    // A user message's `image` blocks, in order; a mark stands in its text where each was.
    let mut pictures = Vec::new();
    if input.is_empty() {
        return Err(ApiError::bad_request("`messages` is empty"));
    }
    for (i, m) in input.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        let content = m.get("content").unwrap_or(&Value::Null);
        match role {
            Some("user") => {
                let blocks = match content {
                    Value::Array(b) => b.clone(),
                    other => vec![json!({"type": "text", "text": text_of(other)?})],
                };
                let mut text = String::new();
                // The user text's pictures: after the tool results' (the tool messages come first).
                let mut own_pictures = Vec::new();
                for (j, b) in blocks.iter().enumerate() {
                    match b.get("type").and_then(Value::as_str) {
                        Some("text") => {
                            text.push_str(b.get("text").and_then(Value::as_str).unwrap_or(""))
                        }
                        Some("tool_result") => {
                            let id = b.get("tool_use_id").and_then(Value::as_str).unwrap_or("");
                            let result = tool_result_text(
                                b.get("content").unwrap_or(&Value::Null),
                                &format!("messages[{i}].content[{j}]"),
                                &mut pictures,
                            )?;
                            messages.push(
                                json!({"role": "tool", "tool_call_id": id, "content": result}),
                            );
                        }
                        Some("image") => {
                            own_pictures.push(super::pictures::anthropic_picture(
                                b,
                                &format!("messages[{i}] image"),
                            )?);
                            text.push(crate::model_text::PICTURE_MARK);
                        }
                        Some(kind @ "document") => {
                            return Err(super::unsupported::text_only(
                                body.get("model").and_then(Value::as_str),
                                &format!("a content block of type {kind:?} (messages[{i}])"),
                            ))
                        }
                        Some(other) => {
                            return Err(ApiError::bad_request(format!(
                                "messages[{i}]: content blocks of type {other:?} are not supported"
                            )))
                        }
                        None => {
                            return Err(ApiError::bad_request(format!(
                                "messages[{i}]: a content block has no `type`"
                            )))
                        }
                    }
                }
                if !text.is_empty() {
                    messages.push(json!({"role": "user", "content": text}));
                }
                pictures.extend(own_pictures);
            }
            Some("assistant") => {
                let blocks = match content {
                    Value::Array(b) => b.clone(),
                    other => vec![json!({"type": "text", "text": text_of(other)?})],
                };
                let (mut text, mut thinking) = (String::new(), String::new());
                let mut calls = Vec::new();
                for b in &blocks {
                    match b.get("type").and_then(Value::as_str) {
                        Some("text") => {
                            text.push_str(b.get("text").and_then(Value::as_str).unwrap_or(""))
                        }
                        Some("thinking") => thinking
                            .push_str(b.get("thinking").and_then(Value::as_str).unwrap_or("")),
                        Some("redacted_thinking") => {}
                        Some("tool_use") => calls.push(json!({
                            "id": b.get("id").cloned().unwrap_or(Value::Null),
                            "type": "function",
                            "function": {
                                "name": b.get("name").cloned().unwrap_or(Value::Null),
                                "arguments": b.get("input").cloned().unwrap_or(json!({})).to_string(),
                            },
                        })),
                        other => {
                            return Err(ApiError::bad_request(format!(
                                "messages[{i}]: assistant content blocks of type {other:?} are not supported"
                            )))
                        }
                    }
                }
                let mut msg = json!({"role": "assistant", "content": text});
                if !thinking.is_empty() {
                    msg["reasoning_content"] = json!(thinking);
                }
                if !calls.is_empty() {
                    msg["tool_calls"] = json!(calls);
                }
                messages.push(msg);
            }
            _ => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].role must be user or assistant"
                )))
            }
        }
    }
    let choice = body.get("tool_choice");
    let choice_none = choice.and_then(|c| c.get("type")).and_then(Value::as_str) == Some("none");
    // `{"type": "tool", "name": N}` narrows the tools to N (no grammar forces the call).
    let forced = choice
        .filter(|c| c.get("type").and_then(Value::as_str) == Some("tool"))
        .and_then(|c| c.get("name"))
        .and_then(Value::as_str);
    let tools: Option<Vec<Value>> = match body.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(t)) if t.is_empty() || choice_none => None,
        Some(Value::Array(t)) => Some(
            t.iter()
                .filter(|tool| forced.is_none_or(|n| tool.get("name").and_then(Value::as_str) == Some(n)))
                .map(|tool| {
                    json!({"type": "function", "function": {
                        "name": tool.get("name").cloned().unwrap_or(Value::Null),
                        "description": tool.get("description").cloned().unwrap_or(json!("")),
                        "parameters": tool.get("input_schema").cloned().unwrap_or(json!({"type": "object"})),
                    }})
                })
                .collect(),
        ),
        Some(_) => return Err(ApiError::bad_request("`tools` must be an array")),
    };
    if let (Some(name), Some(t)) = (forced, &tools) {
        if t.is_empty() {
            return Err(ApiError::bad_request(format!(
                "`tool_choice` names {name:?}, which is not among `tools`"
            )));
        }
    }
    let enable_thinking = body
        .get("thinking")
        .and_then(|t| t.get("type"))
        .and_then(Value::as_str)
        .map(|t| t == "enabled");
    Ok(ChatInput {
        messages,
        tools,
        enable_thinking,
        extra: Default::default(),
        parse_special: body.get("parse_special").and_then(Value::as_bool) == Some(true),
        pictures,
    })
}

struct Meta {
    id: String,
    gen_id: String,
    model: String,
}

fn stop_reason(finish: &Finish, tool_use: bool) -> (&'static str, Value) {
    if tool_use {
        return ("tool_use", Value::Null);
    }
    match &finish.reason {
        FinishReason::Length => ("max_tokens", Value::Null),
        FinishReason::StopString(s) => ("stop_sequence", json!(s)),
        _ => ("end_turn", Value::Null),
    }
}

fn usage(finish: &Finish) -> Value {
    json!({
        "input_tokens": finish.prompt_tokens.saturating_sub(finish.cached_tokens),
        "cache_read_input_tokens": finish.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": finish.completion_tokens,
    })
}

fn tool_use_id(gen_id: &str, n: usize) -> String {
    format!("toolu_{gen_id}_{n}")
}

fn parse_input(arguments: &str) -> Value {
    serde_json::from_str(arguments).unwrap_or_else(|_| json!({"_raw": arguments}))
}

pub async fn messages(state: Arc<AppState>, body: Value) -> Result<Response<RespBody>, ApiError> {
    super::unsupported::refuse_anthropic_output_format(&body)?;
    let input = to_chat_input(&body)?;
    if body.get("max_tokens").and_then(Value::as_u64).is_none() {
        return Err(ApiError::bad_request(
            "`max_tokens` (a positive integer) is required",
        ));
    }
    let sampling = sampling(&body, &["max_tokens"], "stop_sequences")?;
    let model = match body.get("model") {
        Some(Value::String(s)) => Some(s.clone()),
        None | Some(Value::Null) => None,
        Some(_) => return Err(ApiError::bad_request("`model` must be a string")),
    };
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    super::prepare::refuse_pictures_early(&state, model.as_deref(), &input).await?;
    let chat = Arc::new(input);
    let (lease, (rendered, prompt, resume)) =
        leased_with(&state, model.as_deref(), move |text, n_ctx| {
            chat_prompt(text, &chat, n_ctx)
        })
        .await?;
    let id = state.supervisor.next_request_id();
    let meta = Meta {
        id: format!("msg_{id}"),
        gen_id: id.clone(),
        model: lease.model().id.clone(),
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
    if stream {
        let (resp, tx) = channel_response("text/event-stream");
        tokio::spawn(stream_message(gen, meta, tx));
        Ok(resp)
    } else {
        let (done_tx, done_rx) = oneshot::channel();
        tokio::spawn(collect_message(gen, meta, done_tx));
        match done_rx.await {
            Ok(result) => result.map(|v| json_response(StatusCode::OK, &v)),
            Err(_) => Err(ApiError::new(Kind::Internal, "the generation task ended")),
        }
    }
}

/// `POST /v1/messages/count_tokens`: the prompt's length under the model in use (agents size their
/// context with it). Needs no engine, only the model's tokenizer and template.
pub async fn count_tokens(state: &AppState, body: Value) -> Result<Response<RespBody>, ApiError> {
    let input = to_chat_input(&body)?;
    let Some((current, text)) = state.supervisor.current_text() else {
        return Err(ApiError::new(
            Kind::Unavailable,
            "no model is loaded; POST /api/models/load first",
        ));
    };
    if let Some(name) = body.get("model").and_then(Value::as_str) {
        let entries = state.supervisor.models().await;
        let named = crate::registry::find_in(&entries, name)
            .map_err(|e| ApiError::new(Kind::ModelNotFound, e))?;
        if named.id != current {
            return Err(ApiError::new(
                Kind::Unavailable,
                format!("{} is not the model in use ({current}); tokens are counted with the loaded model", named.id),
            ));
        }
    }
    // Counted as a prompt is (off the runtime, bounded by the context when one is known).
    let n_ctx = state.supervisor.text_for(None).map(|(_, n)| n);
    let n_tokens = off_runtime(state, move || {
        let rendered = text
            .render_chat(&input)
            .map_err(|e| ApiError::bad_request(format!("cannot build the prompt: {e}")))?;
        // Without a context (no engine yet) the count is bounded by the body only, as before.
        let n_ctx = n_ctx.unwrap_or(u32::MAX);
        // A picture counts as its picture tokens: its rows are the projector's to decide, in the engine.
        match input.pictures.is_empty() {
            true => text.encode_chat(&rendered, n_ctx).map(|t| t.len()),
            false => text
                .encode_chat_pictures(&rendered, n_ctx)
                .map(|(t, _)| t.len()),
        }
        .map_err(encode_error)
    })
    .await?;
    Ok(json_response(
        StatusCode::OK,
        &json!({"input_tokens": n_tokens}),
    ))
}

async fn collect_message(
    mut gen: Generation,
    meta: Meta,
    mut done: oneshot::Sender<Result<Value, ApiError>>,
) {
    let mut blocks: Vec<Value> = Vec::new();
    let mut n_tools = 0;
    let finish = loop {
        let Some(step) = next_or_left(&mut gen, &mut done).await else {
            gen.cancel(CANCEL_WAIT).await;
            return;
        };
        match step {
            Step::Pieces { pieces, .. } => {
                for piece in pieces {
                    match piece {
                        Piece::Content(t) => match blocks.last_mut() {
                            Some(b) if b["type"] == "text" => {
                                let joined = format!("{}{t}", b["text"].as_str().unwrap_or(""));
                                b["text"] = json!(joined);
                            }
                            _ => blocks.push(json!({"type": "text", "text": t})),
                        },
                        Piece::Reasoning(t) => match blocks.last_mut() {
                            Some(b) if b["type"] == "thinking" => {
                                let joined = format!("{}{t}", b["thinking"].as_str().unwrap_or(""));
                                b["thinking"] = json!(joined);
                            }
                            _ => blocks
                                .push(json!({"type": "thinking", "thinking": t, "signature": ""})),
                        },
                        Piece::ToolCall { name, arguments } => {
                            blocks.push(json!({
                                "type": "tool_use",
                                "id": tool_use_id(&meta.gen_id, n_tools),
                                "name": name,
                                "input": parse_input(&arguments),
                            }));
                            n_tools += 1;
                        }
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
    let (reason, sequence) = stop_reason(&finish, n_tools > 0);
    let value = json!({
        "id": meta.id,
        "type": "message",
        "role": "assistant",
        "model": meta.model,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(&finish),
    });
    let _ = done.send(Ok(value));
}

/// The content block being streamed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    None,
    Text,
    Thinking,
}

async fn stream_message(mut gen: Generation, meta: Meta, tx: mpsc::Sender<Bytes>) {
    let start = json!({"type": "message_start", "message": {
        "id": meta.id, "type": "message", "role": "assistant", "model": meta.model,
        "content": [], "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }});
    let mut events = vec![
        sse_event(Some("message_start"), &start),
        sse_event(Some("ping"), &json!({"type": "ping"})),
    ];
    let mut open = Open::None;
    let mut index = 0usize;
    let mut n_tools = 0usize;
    let finish = loop {
        for e in events.drain(..) {
            if tx.send(e).await.is_err() {
                gen.cancel(CANCEL_WAIT).await;
                return;
            }
        }
        let Some(step) = next_or_gone(&mut gen, &tx).await else {
            gen.cancel(CANCEL_WAIT).await;
            return;
        };
        match step {
            Step::Pieces { pieces, .. } => {
                for piece in pieces {
                    let (want, delta) = match &piece {
                        Piece::Content(t) => (Open::Text, json!({"type": "text_delta", "text": t})),
                        Piece::Reasoning(t) => (
                            Open::Thinking,
                            json!({"type": "thinking_delta", "thinking": t}),
                        ),
                        Piece::ToolCall { .. } => (Open::None, Value::Null),
                    };
                    if open != Open::None && open != want {
                        events.push(block_stop(index, open));
                        index += 1;
                        open = Open::None;
                    }
                    match piece {
                        Piece::ToolCall { name, arguments } => {
                            let block = json!({"type": "tool_use", "id": tool_use_id(&meta.gen_id, n_tools), "name": name, "input": {}});
                            n_tools += 1;
                            events.push(sse_event(
                                Some("content_block_start"),
                                &json!({"type": "content_block_start", "index": index, "content_block": block}),
                            ));
                            let input = parse_input(&arguments).to_string();
                            events.push(sse_event(
                                Some("content_block_delta"),
                                &json!({"type": "content_block_delta", "index": index,
                                        "delta": {"type": "input_json_delta", "partial_json": input}}),
                            ));
                            events.push(sse_event(
                                Some("content_block_stop"),
                                &json!({"type": "content_block_stop", "index": index}),
                            ));
                            index += 1;
                        }
                        _ => {
                            if open == Open::None {
                                let block = if want == Open::Text {
                                    json!({"type": "text", "text": ""})
                                } else {
                                    json!({"type": "thinking", "thinking": ""})
                                };
                                events.push(sse_event(
                                    Some("content_block_start"),
                                    &json!({"type": "content_block_start", "index": index, "content_block": block}),
                                ));
                                open = want;
                            }
                            events.push(sse_event(
                                Some("content_block_delta"),
                                &json!({"type": "content_block_delta", "index": index, "delta": delta}),
                            ));
                        }
                    }
                }
            }
            Step::Finished(f) => break f,
            Step::Failed(e) => {
                for ev in events.drain(..) {
                    let _ = tx.send(ev).await;
                }
                let err = ApiError::from(e).body(Flavor::Anthropic);
                let _ = tx.send(sse_event(Some("error"), &err)).await;
                return;
            }
        }
    };
    drop(gen);
    if open != Open::None {
        events.push(block_stop(index, open));
    }
    let (reason, sequence) = stop_reason(&finish, n_tools > 0);
    events.push(sse_event(
        Some("message_delta"),
        &json!({"type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage(&finish)}),
    ));
    events.push(sse_event(
        Some("message_stop"),
        &json!({"type": "message_stop"}),
    ));
    for e in events {
        if tx.send(e).await.is_err() {
            return;
        }
    }
}

fn block_stop(index: usize, open: Open) -> Bytes {
    let mut events = Vec::new();
    if open == Open::Thinking {
        // Clients that replay thinking blocks expect a signature; ours is empty (nothing to verify).
        events.push(format!(
            "event: content_block_delta\ndata: {}\n\n",
            json!({"type": "content_block_delta", "index": index, "delta": {"type": "signature_delta", "signature": ""}})
        ));
    }
    events.push(format!(
        "event: content_block_stop\ndata: {}\n\n",
        json!({"type": "content_block_stop", "index": index})
    ));
    Bytes::from(events.concat())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pictures_in_tool_results_take_their_places_in_the_order_rendered() {
        let image = |data: &str| json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}});
        let input = to_chat_input(&json!({
            "messages": [
                {"role": "user", "content": "look"},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
                // The user's own picture comes first in the blocks, but its message is rendered after
                // the tool message: the pictures follow the rendered order.
                {"role": "user", "content": [
                    image("QUFB"),
                    {"type": "tool_result", "tool_use_id": "t1",
                     "content": [{"type": "text", "text": "the screen:"}, image("QkJC")]},
                    {"type": "text", "text": "and mine"},
                ]},
            ],
        }))
        .expect("converted");
        let mark = crate::model_text::PICTURE_MARK;
        assert_eq!(input.pictures, ["QkJC", "QUFB"]);
        assert_eq!(input.messages[2]["role"], "tool");
        assert_eq!(input.messages[2]["content"], format!("the screen:{mark}"));
        assert_eq!(input.messages[3]["content"], format!("{mark}and mine"));
        let bad = to_chat_input(&json!({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]}]}));
        assert!(bad.expect_err("a URL").message.contains("not fetched"));
    }

    #[test]
    fn conversation_with_tool_use_and_result_becomes_chat_messages() {
        let input = to_chat_input(&json!({
            "system": [{"type": "text", "text": "be brief"}],
            "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
            "thinking": {"type": "enabled", "budget_tokens": 100},
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "call it", "signature": ""},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {"city": "Rome"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                    {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "rain"}]},
                ]},
            ],
        }))
        .expect("valid");
        let m = &input.messages;
        assert_eq!(m.len(), 5);
        assert_eq!(m[0]["role"], "system");
        assert_eq!(m[2]["reasoning_content"], "call it");
        assert_eq!(
            m[2]["tool_calls"][1]["function"]["arguments"],
            r#"{"city":"Rome"}"#
        );
        assert_eq!(
            (m[3]["tool_call_id"].as_str(), m[3]["content"].as_str()),
            (Some("t1"), Some("sunny"))
        );
        assert_eq!(
            (m[4]["tool_call_id"].as_str(), m[4]["content"].as_str()),
            (Some("t2"), Some("rain"))
        );
        assert_eq!(
            input
                .tools
                .as_ref()
                .map(|t| t[0]["function"]["name"].clone()),
            Some(json!("get_weather"))
        );
        assert_eq!(input.enable_thinking, Some(true));
    }

    #[test]
    fn bad_conversations_are_refused() {
        assert!(to_chat_input(&json!({})).is_err());
        assert!(to_chat_input(&json!({
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "a", "input_schema": {}}],
            "tool_choice": {"type": "tool", "name": "b"},
        }))
        .is_err());
        assert!(to_chat_input(&json!({"messages": [{"role": "system", "content": "x"}]})).is_err());
        assert!(to_chat_input(
            &json!({"messages": [{"role": "user", "content": [{"type": "video"}]}]})
        )
        .is_err());
    }
}
