//! The `polystrata` server as a library: the binary (`src/main.rs`) and the integration tests call it.
//!
//! - [`text`]: everything about text: tokenizer directories from GGUF files, chat templates, and the
//!   reasoning / tool-call parsers of each model family.
//! - [`by_path`]: a GGUF served by its path, registered without a hand-written run config.
//! - [`home`] and [`registry`]: the installation home's run configs and the models they describe.
//! - [`engine`]: one `poly-engine` child process and the supervisor that switches models.
//! - [`defaults`]: a model's sampling defaults and default chat answer length.
//! - [`model_text`]: a loaded model's text side as the HTTP layer uses it; [`generate`]: one generation.
//! - [`http`]: the OpenAI, Anthropic and management APIs; [`client`]: a blocking client of them (the
//!   terminal chat builds on it); [`web`]: the chat page served at `/`.
//! - [`telemetry`]: token and time totals (`/metrics`), llama-server's `timings`, the log line per
//!   request.
//! - [`chat`]: the terminal chat (`polystrata --model NAME`); [`bench`]: `polystrata benchmark`.

pub mod bench;
pub mod by_path;
pub mod chat;
pub mod client;
pub mod defaults;
pub mod engine;
pub mod generate;
pub mod home;
pub mod http;
pub mod model_text;
pub mod registry;
pub mod telemetry;
pub mod text;
pub mod verify;
pub mod web;

/// The multi-threaded tokio runtime of a command (the server, the benchmarks), or `None` with the reason
/// on stderr.
pub fn runtime() -> Option<tokio::runtime::Runtime> {
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => Some(r),
        Err(e) => {
            eprintln!("polystrata: cannot start the runtime: {e}");
            None
        }
    }
}
