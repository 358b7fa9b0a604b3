//! The management API (`/api/models`, `/api/models/current`, `/api/models/load`, `/api/models/unload`)
//! and `/health`.

use super::body::{json_response, RespBody};
use super::errors::ApiError;
use super::AppState;
use crate::engine::supervisor::EngineHealth;
use hyper::{Response, StatusCode};
use serde_json::{json, Value};

/// `/health`: 200 `ok`, or 503 `stalled` with the reason while the engine is stuck (its watchdog
/// replaces it at the stall bound).
pub async fn health(state: &AppState) -> Response<RespBody> {
    let engine = state.supervisor.engine_health().await;
    let current = state.supervisor.current();
    let (running, waiting) = state.supervisor.queue();
    let (code, status, problem) = match engine {
        EngineHealth::Stalled(why) => (StatusCode::SERVICE_UNAVAILABLE, "stalled", Some(why)),
        EngineHealth::Ok | EngineHealth::NotRunning => (StatusCode::OK, "ok", None),
    };
    let mut body = json!({
        "status": status,
        "model": current.model,
        "loaded": current.loaded,
        "requests": state.supervisor.counters(),
        // The places for requests running at once (`--parallel`) and the queue behind them.
        "slots": {"parallel": state.supervisor.parallel(), "running": running, "waiting": waiting},
    });
    if let (Some(p), Some(o)) = (problem, body.as_object_mut()) {
        o.insert("problem".into(), json!(p));
    }
    json_response(code, &body)
}

pub async fn models(state: &AppState) -> Response<RespBody> {
    let current = state.supervisor.current_id();
    let models: Vec<Value> = state
        .supervisor
        .models()
        .await
        .into_iter()
        .map(|m| {
            let mut v = serde_json::to_value(&m).unwrap_or(Value::Null);
            if let Value::Object(o) = &mut v {
                o.insert(
                    "current".into(),
                    json!(current.as_deref() == Some(m.id.as_str())),
                );
            }
            v
        })
        .collect();
    json_response(
        StatusCode::OK,
        // The home read, so a model not found can be looked for in the right place.
        &json!({"models": models, "current": current, "home": state.supervisor.home()}),
    )
}

pub async fn current(state: &AppState) -> Response<RespBody> {
    let current = state.supervisor.current();
    let entry = match &current.model {
        Some(id) => state
            .supervisor
            .models()
            .await
            .into_iter()
            .find(|m| &m.id == id),
        None => None,
    };
    // The engine's VRAM where it reports it (asked only while idle, as /api/ps does; null on the CPU).
    let vram = match current.loaded {
        true => state
            .supervisor
            .idle_engine_stats(std::time::Duration::from_millis(500))
            .await
            .and_then(|s| s.vram_bytes),
        false => None,
    };
    let mut v = serde_json::to_value(&current).unwrap_or(Value::Null);
    if let Value::Object(o) = &mut v {
        o.insert("vram_bytes".into(), json!(vram));
        if let Some(e) = entry {
            o.insert(
                "entry".into(),
                serde_json::to_value(e).unwrap_or(Value::Null),
            );
        }
    }
    json_response(StatusCode::OK, &v)
}

pub async fn load(state: &AppState, body: Value) -> Result<Response<RespBody>, ApiError> {
    let Some(name) = body.get("model").and_then(Value::as_str) else {
        return Err(ApiError::bad_request("`model` (a model name) is required"));
    };
    let current = state.supervisor.switch(name).await?;
    Ok(json_response(
        StatusCode::OK,
        &json!({"status": "loaded", "current": current}),
    ))
}

pub async fn unload(state: &AppState) -> Result<Response<RespBody>, ApiError> {
    let current = state.supervisor.unload().await?;
    Ok(json_response(
        StatusCode::OK,
        &json!({"status": "unloaded", "current": current}),
    ))
}
