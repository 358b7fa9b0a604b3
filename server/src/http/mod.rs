//! The HTTP server: hyper 1 on tokio, one task per connection, routes to the OpenAI, Anthropic and
//! management APIs, the API key check, and request bodies read with a size bound.

pub mod admin;
pub mod anthropic;
pub mod body;
pub mod errors;
pub mod openai;
mod sampling;

use crate::engine::supervisor::Supervisor;
use body::RespBody;
use bytes::Bytes;
use errors::{ApiError, Flavor, Kind};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response};
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;

/// The largest request body accepted (long conversations with tools fit easily).
const MAX_BODY_BYTES: usize = 32 << 20;

/// What every handler shares.
pub struct AppState {
    pub supervisor: Arc<Supervisor>,
    pub api_key: Option<String>,
}

/// Serves on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        let (stream, _peer): (tokio::net::TcpStream, SocketAddr) = tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    eprintln!("polystrata: accept failed: {e}");
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, std::convert::Infallible>(route(state, req).await) }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn flavor_of(path: &str) -> Flavor {
    if path.starts_with("/v1/messages") {
        Flavor::Anthropic
    } else if path.starts_with("/v1/") {
        Flavor::OpenAi
    } else {
        Flavor::Plain
    }
}

fn authorized(state: &AppState, req: &Request<Incoming>) -> bool {
    let Some(key) = &state.api_key else {
        return true;
    };
    let headers = req.headers();
    let bearer = headers
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
    bearer == Some(key.as_str()) || x_api_key == Some(key.as_str())
}

async fn route(state: Arc<AppState>, req: Request<Incoming>) -> Response<RespBody> {
    let path = req.uri().path().trim_end_matches('/').to_string();
    let flavor = flavor_of(&path);
    let method = req.method().clone();
    // The web page's files are public (the page asks for the API key itself).
    if method == Method::GET {
        if let Some(page) = crate::web::asset(&path) {
            return page;
        }
    }
    if path != "/health" && !authorized(&state, &req) {
        return ApiError::new(Kind::Unauthorized, "invalid or missing API key").response(flavor);
    }
    let result = match (method.clone(), path.as_str()) {
        (Method::GET, "/health") => Ok(admin::health(&state)),
        (Method::GET, "/v1/models") => Ok(openai::models(&state)),
        (Method::GET, p) if p.starts_with("/v1/models/") => {
            openai::model(&state, &p["/v1/models/".len()..])
        }
        (Method::POST, "/v1/chat/completions") => match read_json(req).await {
            Ok(body) => openai::chat_completions(state.clone(), body).await,
            Err(e) => Err(e),
        },
        (Method::POST, "/v1/completions") => match read_json(req).await {
            Ok(body) => openai::completions(state.clone(), body).await,
            Err(e) => Err(e),
        },
        (Method::POST, "/v1/messages/count_tokens") => match read_json(req).await {
            Ok(body) => anthropic::count_tokens(&state, body),
            Err(e) => Err(e),
        },
        (Method::POST, "/v1/messages") => match read_json(req).await {
            Ok(body) => anthropic::messages(state.clone(), body).await,
            Err(e) => Err(e),
        },
        (Method::GET, "/api/models") => Ok(admin::models(&state)),
        (Method::GET, "/api/models/current") => Ok(admin::current(&state)),
        (Method::POST, "/api/models/load") => match read_json(req).await {
            Ok(body) => admin::load(&state, body).await,
            Err(e) => Err(e),
        },
        (Method::POST, "/api/models/unload") => admin::unload(&state).await,
        (
            _,
            "/health"
            | "/v1/models"
            | "/v1/chat/completions"
            | "/v1/completions"
            | "/v1/messages"
            | "/api/models"
            | "/api/models/current"
            | "/api/models/load"
            | "/api/models/unload",
        ) => Err(ApiError::new(
            Kind::MethodNotAllowed,
            format!("{method} is not allowed on {path}"),
        )),
        _ => Err(ApiError::new(
            Kind::NotFound,
            format!("no route {method} {path}"),
        )),
    };
    result.unwrap_or_else(|e| e.response(flavor))
}

/// Reads a JSON object body (at most [`MAX_BODY_BYTES`]).
async fn read_json(req: Request<Incoming>) -> Result<serde_json::Value, ApiError> {
    let limited = http_body_util::Limited::new(req.into_body(), MAX_BODY_BYTES);
    let bytes: Bytes = match limited.collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) => {
            return Err(if e.is::<http_body_util::LengthLimitError>() {
                ApiError::new(
                    Kind::PayloadTooLarge,
                    format!("the request body is over {MAX_BODY_BYTES} bytes"),
                )
            } else {
                ApiError::bad_request(format!("cannot read the request body: {e}"))
            })
        }
    };
    if bytes.is_empty() {
        return Ok(serde_json::Value::Object(Default::default()));
    }
    match serde_json::from_slice::<serde_json::Value>(&bytes) {
        Ok(v @ serde_json::Value::Object(_)) => Ok(v),
        Ok(_) => Err(ApiError::bad_request(
            "the request body must be a JSON object",
        )),
        Err(e) => Err(ApiError::bad_request(format!(
            "invalid JSON in the request body: {e}"
        ))),
    }
}
