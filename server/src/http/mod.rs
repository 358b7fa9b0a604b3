//! The HTTP server: hyper 1 on tokio, one task per connection, routes to the OpenAI, Anthropic,
//! llama-server (`/props`, `/tokenize`, `/detokenize`, `/apply-template`, `/metrics`), Ollama
//! (`/api/chat`, `/api/generate`, `/api/tags`, ...) and management APIs, the API key check, and request bodies read with a size bound.

pub mod access;
pub mod admin;
pub mod anthropic;
pub mod body;
pub mod errors;
pub mod llama;
pub mod metrics;
pub mod ollama;
pub mod openai;
pub mod pictures;
pub mod prepare;
pub mod responses;
mod sampling;
pub mod unsupported;

use crate::engine::supervisor::Supervisor;
use body::RespBody;
use bytes::Bytes;
use errors::{ApiError, Flavor, Kind};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// Connection and body limits (`serve`'s `--max-connections`, `--header-timeout`, `--body-timeout`,
/// `--max-body-mib`).
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    /// Connections served at once; more wait in the kernel's backlog until one closes.
    pub max_connections: usize,
    /// How long a connection may take to send a request's head, also while idle between requests (an
    /// idle keep-alive connection is closed after it).
    pub header_timeout: Duration,
    /// How long a request's body may take to arrive whole.
    pub body_timeout: Duration,
    /// The largest request body.
    pub max_body_bytes: usize,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            max_connections: 1024,
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(60),
            max_body_bytes: 8 << 20,
        }
    }
}

/// What every handler shares.
pub struct AppState {
    pub supervisor: Arc<Supervisor>,
    /// Host, origin, content-type and key rules.
    pub access: access::Access,
    pub limits: ConnLimits,
    /// Rendering and tokenizing off the runtime, a bounded number at once.
    pub text_work: prepare::TextWork,
}

/// A connection's place under the cap; its drop wakes an accept loop waiting for a descriptor.
struct ConnSlot {
    _permit: OwnedSemaphorePermit,
    released: Arc<Notify>,
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.released.notify_one();
    }
}

/// How often a run of failing `accept`s is logged (the first at once, then a count per period).
const ACCEPT_LOG_EVERY: Duration = Duration::from_secs(10);
/// The longest wait after a failed `accept` when no connection closes meanwhile.
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Serves on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let slots = Arc::new(Semaphore::new(state.limits.max_connections.max(1)));
    let released = Arc::new(Notify::new());
    let mut backoff = Duration::from_millis(10);
    let mut failures: u64 = 0;
    let mut last_log: Option<Instant> = None;
    loop {
        // A slot before the accept: past the cap, new connections wait in the backlog instead of taking
        // descriptors the server needs (engine pipes, model files).
        let permit = tokio::select! {
            _ = &mut shutdown => return,
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => return,
            },
        };
        let stream = tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
                Err(e) => {
                    // Out of descriptors (or another passing failure): retrying at once would spin a core
                    // and flood the log. Wait for a connection to close or for the backoff, and log a
                    // run of failures once per period.
                    failures += 1;
                    if last_log.is_none_or(|t| t.elapsed() >= ACCEPT_LOG_EVERY) {
                        eprintln!(
                            "polystrata: accept failed: {e} ({failures} failure(s) since the last report; retrying with backoff)"
                        );
                        last_log = Some(Instant::now());
                        failures = 0;
                    }
                    drop(permit);
                    tokio::select! {
                        _ = &mut shutdown => return,
                        _ = released.notified() => {}
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                    continue;
                }
            },
        };
        backoff = Duration::from_millis(10);
        let slot = ConnSlot {
            _permit: permit,
            released: released.clone(),
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let header_timeout = state.limits.header_timeout;
            let service = service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, std::convert::Infallible>(route(state, req).await) }
            });
            let _ = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn flavor_of(path: &str) -> Flavor {
    // `/api/models*` is the management API; every other `/api/` route is Ollama's.
    if path.starts_with("/api/") && !path.starts_with("/api/models") {
        Flavor::Ollama
    } else if path.starts_with("/v1/messages") {
        Flavor::Anthropic
    } else if path.starts_with("/v1/") {
        Flavor::OpenAi
    } else {
        Flavor::Plain
    }
}

/// The routes that exist, for 405 (a known path, another method) against 404.
const ROUTES: &[&str] = &[
    "/health",
    "/v1/health",
    "/props",
    "/metrics",
    "/tokenize",
    "/detokenize",
    "/apply-template",
    "/v1/models",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/api/models",
    "/api/models/current",
    "/api/models/load",
    "/api/models/unload",
    "/api/version",
    "/api/tags",
    "/api/ps",
    "/api/show",
    "/api/chat",
    "/api/generate",
];

async fn route(state: Arc<AppState>, req: Request<Incoming>) -> Response<RespBody> {
    let path = req.uri().path().trim_end_matches('/').to_string();
    let flavor = flavor_of(&path);
    let headers = req.headers();
    // Content-Length with Transfer-Encoding never reaches here: hyper lets the chunked framing win, drops
    // Content-Length and closes the connection after the answer (RFC 9112 §6.1), so nothing can be
    // smuggled behind it.
    if let Err(e) = state.access.check_host(headers) {
        return e.response(flavor);
    }
    let origin = state.access.origin(headers);
    let mut resp = route_checked(&state, req, &path, &origin)
        .await
        .unwrap_or_else(|e| e.response(flavor));
    if let access::Origin::Allowed(o) = &origin {
        access::add_cors(resp.headers_mut(), o);
    }
    resp
}

/// The request past the framing and `Host` checks: the preflight, the origin and key checks, the route.
async fn route_checked(
    state: &Arc<AppState>,
    req: Request<Incoming>,
    path: &str,
    origin: &access::Origin,
) -> Result<Response<RespBody>, ApiError> {
    let method = req.method().clone();
    if let access::Origin::Foreign(o) = origin {
        // Reading is left to the browser's same-origin policy (no CORS header goes to a foreign origin);
        // anything else from another site is refused before it can act.
        if !matches!(method, Method::GET | Method::HEAD) {
            return Err(access::foreign_origin(o, &method, path));
        }
    }
    if method == Method::OPTIONS {
        // A preflight carries no credentials, so it comes before the key check.
        let mut resp = body::bytes_response(StatusCode::NO_CONTENT, "text/plain", Bytes::new());
        resp.headers_mut().insert(
            hyper::header::ALLOW,
            hyper::header::HeaderValue::from_static("GET, HEAD, POST, OPTIONS"),
        );
        if matches!(origin, access::Origin::Allowed(_)) {
            access::add_preflight(
                resp.headers_mut(),
                req.headers()
                    .get(hyper::header::ACCESS_CONTROL_REQUEST_HEADERS),
            );
        }
        return Ok(resp);
    }
    // HEAD is GET without the body (hyper sends the head only).
    let get = matches!(method, Method::GET | Method::HEAD);
    // The web page's files are public (the page asks for the API key itself).
    if get {
        if let Some(page) = crate::web::asset(path) {
            return Ok(page);
        }
    }
    // The health checks are public, as llama-server's are (a load balancer probes them without a key).
    if !matches!(path, "/health" | "/v1/health") && !state.access.authorized(req.headers()) {
        return Err(ApiError::new(
            Kind::Unauthorized,
            "invalid or missing API key",
        ));
    }
    if method == Method::POST && ROUTES.contains(&path) {
        access::require_json(req.headers())?;
    }
    let state = state.clone();
    match (get, method == Method::POST, path) {
        (true, _, "/health" | "/v1/health") => Ok(admin::health(&state).await),
        (true, _, "/props") => llama::props(&state).await,
        (true, _, "/metrics") => Ok(metrics::metrics(&state).await),
        (_, true, "/tokenize") => llama::tokenize(&state, read_json(&state, req).await?).await,
        (_, true, "/detokenize") => llama::detokenize(&state, read_json(&state, req).await?).await,
        (_, true, "/apply-template") => {
            llama::apply_template(&state, read_json(&state, req).await?).await
        }
        (true, _, "/v1/models") => Ok(openai::models(&state).await),
        (true, _, p) if p.starts_with("/v1/models/") => {
            openai::model(&state, &p["/v1/models/".len()..]).await
        }
        (_, true, "/v1/chat/completions") => {
            openai::chat_completions(state.clone(), read_json(&state, req).await?).await
        }
        (_, true, "/v1/completions") => {
            openai::completions(state.clone(), read_json(&state, req).await?).await
        }
        (_, true, "/v1/responses") => {
            responses::responses(state.clone(), read_json(&state, req).await?).await
        }
        (_, true, "/v1/messages/count_tokens") => {
            anthropic::count_tokens(&state, read_json(&state, req).await?).await
        }
        (_, true, "/v1/messages") => {
            anthropic::messages(state.clone(), read_json(&state, req).await?).await
        }
        (true, _, "/api/models") => Ok(admin::models(&state).await),
        (true, _, "/api/models/current") => Ok(admin::current(&state).await),
        (_, true, "/api/models/load") => admin::load(&state, read_json(&state, req).await?).await,
        (_, true, "/api/models/unload") => admin::unload(&state).await,
        (true, _, "/api/version") => Ok(ollama::version()),
        (true, _, "/api/tags") => Ok(ollama::tags(&state).await),
        (true, _, "/api/ps") => Ok(ollama::ps(&state).await),
        (_, true, "/api/show") => ollama::show(&state, read_json(&state, req).await?).await,
        (_, true, "/api/chat") => ollama::chat(state.clone(), read_json(&state, req).await?).await,
        (_, true, "/api/generate") => {
            ollama::generate(state.clone(), read_json(&state, req).await?).await
        }
        (_, _, p) if ROUTES.contains(&p) => Err(ApiError::new(
            Kind::MethodNotAllowed,
            format!("{method} is not allowed on {p}"),
        )),
        _ => Err(ApiError::new(
            Kind::NotFound,
            format!("no route {method} {}", access::truncate(path, 200)),
        )),
    }
}

fn too_large(max: usize) -> ApiError {
    ApiError::new(
        Kind::PayloadTooLarge,
        format!("the request body is over {max} bytes (--max-body-mib)"),
    )
}

/// Reads a JSON object body: at most `max_body_bytes`, whole within `body_timeout` (a body shorter than
/// its Content-Length would otherwise hold the connection and its buffer forever).
async fn read_json(
    state: &AppState,
    req: Request<Incoming>,
) -> Result<serde_json::Value, ApiError> {
    let max = state.limits.max_body_bytes;
    // A declared length over the limit is refused before a byte of it is read.
    if hyper::body::Body::size_hint(req.body()).lower() > max as u64 {
        return Err(too_large(max));
    }
    let limited = http_body_util::Limited::new(req.into_body(), max);
    let collected = tokio::time::timeout(state.limits.body_timeout, limited.collect())
        .await
        .map_err(|_| {
            ApiError::new(
                Kind::Timeout,
                format!(
                    "the request body did not arrive within {} s",
                    state.limits.body_timeout.as_secs()
                ),
            )
        })?;
    let bytes: Bytes = match collected {
        Ok(c) => c.to_bytes(),
        Err(e) => {
            return Err(if e.is::<http_body_util::LengthLimitError>() {
                too_large(max)
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
