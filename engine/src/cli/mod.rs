//! The command line of `poly-engine`: serving a model (`--model FILE`, the engine process) or one of the
//! model-file tools, one module per subcommand.

mod dump;
mod inspect;
mod run;
mod synth;

use clap::{Args, Parser, Subcommand};
use poly_engine::serve::{serve, ServeOptions};
use std::path::PathBuf;
use std::process::ExitCode;

/// Errors of the command-line tools: a message for people.
pub type CliResult = Result<(), Box<dyn std::error::Error>>;

#[derive(Parser)]
#[command(
    name = "poly-engine",
    version,
    about = "PolyStrata engine: serves a model over the line protocol on stdin/stdout \
             (poly-engine --model FILE), or runs a model-file tool",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

/// The engine process's flags.
#[derive(Args)]
struct ServeArgs {
    /// The GGUF model file to serve.
    #[arg(long, required = true)]
    model: Option<PathBuf>,
    /// Most tokens a conversation holds (default: the model's training context).
    #[arg(long, default_value_t = 0)]
    max_context: usize,
    /// Worker threads (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Run on the CPU (the only backend so far).
    #[arg(long)]
    cpu: bool,
    /// MiB of RAM that parked conversations may hold (least recently used dropped first).
    #[arg(long, default_value_t = 1024)]
    park_mib: usize,
    /// Keep a checkpoint of recurrent layers every N prompt tokens read (0: only where asked).
    #[arg(long, default_value_t = 2048)]
    checkpoint_every: usize,
}

#[derive(Subcommand)]
enum Command {
    /// Print what a GGUF model file holds: architecture, metadata, tensor types, expert bytes.
    Inspect(inspect::InspectArgs),
    /// Write one tensor dequantized to little-endian f32, row-major in GGUF order (ne0 fastest).
    Dump(dump::DumpArgs),
    /// Write a synthetic model of a real layout (random weights in their target types).
    Synth(synth::SynthArgs),
    /// Run a model on prompt token ids: greedy (or sampled) tokens with their top-N probabilities.
    Run(run::RunArgs),
}

/// Runs the chosen subcommand, or serves the model.
pub fn run(cli: Cli) -> ExitCode {
    let result = match cli.command {
        Some(Command::Inspect(args)) => inspect::run(args),
        Some(Command::Dump(args)) => dump::run(args),
        Some(Command::Synth(args)) => synth::run(args),
        Some(Command::Run(args)) => run::run(args),
        None => {
            let a = cli.serve;
            let Some(model) = a.model else {
                eprintln!("poly-engine: give --model FILE, or a subcommand (see --help)");
                return ExitCode::FAILURE;
            };
            // The CPU is the only backend so far: --cpu asks for what happens anyway.
            let _ = a.cpu;
            return serve(ServeOptions {
                model,
                max_context: a.max_context,
                threads: a.threads,
                park_bytes: a.park_mib.saturating_mul(1 << 20),
                checkpoint_every: a.checkpoint_every,
            });
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("poly-engine: {e}");
            ExitCode::FAILURE
        }
    }
}
