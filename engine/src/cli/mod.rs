//! The command line of `poly-engine`: one module per subcommand.

mod bench;
mod dump;
mod inspect;
mod run;
mod synth;

use clap::{Parser, Subcommand};

/// Errors of the command-line tools: a message for people.
pub type CliResult = Result<(), Box<dyn std::error::Error>>;

#[derive(Parser)]
#[command(
    name = "poly-engine",
    version,
    about = "PolyStrata engine: model-file tools"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
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
    /// Time reading a prompt and writing tokens, as llama-bench does (JSON on stdout).
    Bench(bench::BenchArgs),
}

/// Runs the chosen subcommand.
pub fn run(cli: Cli) -> CliResult {
    match cli.command {
        Command::Inspect(args) => inspect::run(args),
        Command::Dump(args) => dump::run(args),
        Command::Synth(args) => synth::run(args),
        Command::Run(args) => run::run(args),
        Command::Bench(args) => bench::run(args),
    }
}
