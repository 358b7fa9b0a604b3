//! llama-server's own routes, in its shapes: `GET /props` (the model, its context, chat template and
//! sampling defaults, the build), `POST /tokenize`, `POST /detokenize` and `POST /apply-template`.
//!
//! They use the model in use (or the one a request's `model` names, loading it as any request would):
//! llama-server serves one model, and these answer for the one that would serve a chat now.

use super::body::{json_response, RespBody};
use super::errors::{ApiError, Kind};
use super::openai::parse_chat;
use super::prepare::off_runtime;
use super::AppState;
use crate::model_text::ModelText;
use hyper::{Response, StatusCode};
use serde_json::{json, Value};
use std::sync::Arc;

/// The build, as `/props`' `build_info` and Ollama's `/api/version` say it.
pub fn build_info() -> String {
    format!("polystrata {}", env!("CARGO_PKG_VERSION"))
}

/// The longest text `/tokenize` takes: its tokens take memory (hundreds of bytes each), and a text
/// this long is far over any context.
const TOKENIZE_MAX_BYTES: usize = 4 << 20;

/// The text side of the model that serves a request naming `model` (none: the model in use), and its
/// id. A model not loaded yet is loaded, as a chat naming it would.
async fn text_of(
    state: &AppState,
    model: Option<&str>,
) -> Result<(String, Arc<ModelText>), ApiError> {
    if let Some((text, _)) = state.supervisor.text_for(model) {
        if let Some(id) = state.supervisor.current_id() {
            return Ok((id, text));
        }
    }
    let lease = state.supervisor.lease(model).await?;
    Ok((lease.model().id.clone(), lease.text()))
}

fn model_field(body: &Value) -> Result<Option<&str>, ApiError> {
    match body.get("model") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(ApiError::bad_request("`model` must be a string")),
    }
}

fn flag(body: &Value, key: &str, default: bool) -> Result<bool, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad_request(format!(
            "`{key}` must be true or false"
        ))),
    }
}

/// `GET /props`: llama-server's `default_generation_settings` (`n_ctx`, `params` with the sampling
/// defaults and `n_predict`), `total_slots` (`--parallel`), `model_path`, `modalities`, `chat_template`, `bos_token`,
/// `eos_token`, `build_info`; and ours: `model`, `family`, `device`, `loaded`, `sampling_defaults`
/// (each value with where it came from).
pub async fn props(state: &AppState) -> Result<Response<RespBody>, ApiError> {
    let Some((id, text)) = state.supervisor.current_text() else {
        return Err(ApiError::new(
            Kind::Unavailable,
            "no model is loaded; send a request or POST /api/models/load first",
        ));
    };
    let entry = state
        .supervisor
        .models()
        .await
        .into_iter()
        .find(|m| m.id == id);
    let ready = state.supervisor.ready();
    let n_ctx = ready
        .as_ref()
        .map(|r| r.n_ctx)
        .or(entry.as_ref().and_then(|e| e.context));
    let d = text.defaults();
    let mut params = json!({
        "n_predict": d.max_tokens.map_or(-1, i64::from),
        "chat_n_predict": d.chat_max_tokens,
        "seed": -1,
        "stop": [],
    });
    for (k, v) in &d.values {
        params[k] = v.clone();
    }
    let (bos, eos) = text.bos_eos();
    let path = entry
        .as_ref()
        .and_then(|e| e.config.as_ref().and_then(|c| c.model_path()))
        .map(|p| p.display().to_string());
    let body = json!({
        "default_generation_settings": {
            "id": 0,
            "n_ctx": n_ctx,
            "params": params,
            "speculative": entry.as_ref().is_some_and(|e| e.mtp),
            "is_processing": state.supervisor.queue().0 > 0,
        },
        // llama-server's `-np`: the requests that run at once (`--parallel`).
        "total_slots": state.supervisor.parallel(),
        "model_path": path,
        // Pictures are read where the engine said so in READY (a projector, on the CPU).
        "modalities": {
            "vision": ready.as_ref().is_some_and(|r| r.vision.is_some()),
            "audio": false,
        },
        "chat_template": text.template_source(),
        "bos_token": bos,
        "eos_token": eos,
        "build_info": build_info(),
        "model": id,
        "family": text.family_name(),
        "device": ready.as_ref().map(|r| r.device.clone()),
        "loaded": ready.is_some(),
        "sampling_defaults": d.to_json(),
        "context_note": entry.as_ref().and_then(|e| e.context_note.clone()),
    });
    Ok(json_response(StatusCode::OK, &body))
}

/// `POST /tokenize` `{"content", "add_special": false, "parse_special": true, "with_pieces": false}`:
/// `{"tokens": [ids]}`, or with pieces `{"tokens": [{"id", "piece"}]}` (a piece that is not whole
/// UTF-8 is given as its bytes, as llama-server does).
pub async fn tokenize(state: &AppState, body: Value) -> Result<Response<RespBody>, ApiError> {
    let content = match body.get("content") {
        Some(Value::String(s)) => s.clone(),
        _ => return Err(ApiError::bad_request("`content` (a string) is required")),
    };
    if content.len() > TOKENIZE_MAX_BYTES {
        return Err(ApiError::bad_request(format!(
            "`content` is {} bytes; /tokenize takes at most {TOKENIZE_MAX_BYTES}",
            content.len()
        )));
    }
    let add_special = flag(&body, "add_special", false)?;
    let parse_special = flag(&body, "parse_special", true)?;
    let with_pieces = flag(&body, "with_pieces", false)?;
    let (_, text) = text_of(state, model_field(&body)?).await?;
    let tokens = off_runtime(state, move || {
        let ids = text
            .tokenize(&content, add_special, parse_special)
            .map_err(|e| ApiError::new(Kind::Internal, format!("cannot tokenize: {e}")))?;
        Ok(if with_pieces {
            ids.iter()
                .map(|&id| {
                    let bytes = text.token_bytes(id);
                    let piece = match std::str::from_utf8(&bytes) {
                        Ok(s) => json!(s),
                        Err(_) => json!(bytes),
                    };
                    json!({"id": id, "piece": piece})
                })
                .collect::<Vec<_>>()
        } else {
            ids.iter().map(|&id| json!(id)).collect()
        })
    })
    .await?;
    Ok(json_response(StatusCode::OK, &json!({"tokens": tokens})))
}

/// `POST /detokenize` `{"tokens": [ids]}`: `{"content"}`; an id outside the vocabulary is refused.
pub async fn detokenize(state: &AppState, body: Value) -> Result<Response<RespBody>, ApiError> {
    let Some(Value::Array(raw)) = body.get("tokens") else {
        return Err(ApiError::bad_request(
            "`tokens` (an array of token ids) is required",
        ));
    };
    let ids: Vec<u32> = raw
        .iter()
        .map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
        .collect::<Option<_>>()
        .ok_or_else(|| ApiError::bad_request("`tokens` must hold integers ≥ 0"))?;
    let (_, text) = text_of(state, model_field(&body)?).await?;
    let n_vocab = text.n_vocab();
    if let Some(bad) = ids.iter().find(|&&t| t as usize >= n_vocab) {
        return Err(ApiError::bad_request(format!(
            "token id {bad} is outside the vocabulary ({n_vocab})"
        )));
    }
    let content = off_runtime(state, move || Ok(text.detokenize(&ids))).await?;
    Ok(json_response(StatusCode::OK, &json!({"content": content})))
}

/// `POST /apply-template` with a chat request's `messages` (and `tools`, `chat_template_kwargs`):
/// `{"prompt"}`, the text the model would read, its turn opened.
pub async fn apply_template(state: &AppState, body: Value) -> Result<Response<RespBody>, ApiError> {
    let req = parse_chat(&body)?;
    let (_, text) = text_of(state, req.model.as_deref()).await?;
    let input = req.input;
    let prompt = off_runtime(state, move || {
        text.render_chat(&input)
            .map(|r| r.prompt)
            .map_err(|e| ApiError::bad_request(format!("cannot build the prompt: {e}")))
    })
    .await?;
    Ok(json_response(StatusCode::OK, &json!({"prompt": prompt})))
}
