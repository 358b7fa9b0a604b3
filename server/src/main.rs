//! `polystrata`: the long-lived server users talk to.
//!
//! It supervises one `poly-engine` child at a time over the `poly-protocol` crate and owns everything about
//! text (tokenizers, chat templates, reasoning and tool-call formats) and the HTTP APIs. It never links the
//! kernels or the engine's internals: the engine is a separate process so that switching models returns
//! every byte of VRAM, pinned memory and mapping to the OS.
//!
//! Built so far: `polystrata tokenizer --gguf FILE --out DIR` (the tokenizer directory of a model). The
//! server itself is the subject of its own issue; without a subcommand this binary says so and exits
//! non-zero so that no script mistakes it for a running server.

use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "polystrata", version, about = "PolyStrata server")]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Write a model's tokenizer directory (tokenizer.json, chat template, tokenizer_config.json) from
    /// its GGUF.
    Tokenizer {
        /// The model's GGUF file (the first part of a split model).
        #[arg(long)]
        gguf: PathBuf,
        /// The directory to write (created if missing).
        #[arg(long)]
        out: PathBuf,
    },
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match args.command {
        Some(Command::Tokenizer { gguf, out }) => {
            match polystrata::text::tokenizer_dir::tokenizer_command(&gguf, &out) {
                Ok(cfg) => {
                    eprintln!(
                        "polystrata: wrote {} ({} tokens, {} model, pre '{}', family {})",
                        out.display(),
                        cfg.n_vocab,
                        cfg.model,
                        cfg.pre,
                        cfg.family.name()
                    );
                    std::process::ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("polystrata: {e}");
                    std::process::ExitCode::from(1)
                }
            }
        }
        None => {
            eprintln!(
                "polystrata: the server is not built yet; use `poly-engine` directly (see README.md)"
            );
            std::process::ExitCode::from(2)
        }
    }
}
