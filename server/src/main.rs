//! `polystrata`: the long-lived server users talk to.
//!
//! It supervises one `poly-engine` child at a time over the `poly-protocol` crate and owns everything about
//! text (tokenizers, chat templates, reasoning and tool-call formats) and the HTTP APIs. It never links the
//! kernels or the engine's internals: the engine is a separate process so that switching models returns
//! every byte of VRAM, pinned memory and mapping to the OS.
//!
//! The server is the subject of its own issue; until then this binary only says so, and exits non-zero so
//! that no script mistakes it for a running server.

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "polystrata",
    version,
    about = "PolyStrata server (not yet built: see README)"
)]
struct Args {}

fn main() -> std::process::ExitCode {
    let _ = Args::parse();
    eprintln!(
        "polystrata: the server is not built yet; use `poly-engine` directly (see README.md)"
    );
    std::process::ExitCode::from(2)
}
