//! `poly-engine`: one child process per loaded model.
//!
//! `poly-engine --model FILE` serves the model over the line protocol (requests on stdin, protocol
//! lines on stdout, logs on stderr); the subcommands are model-file tools (`inspect`, `dump`, `synth`,
//! `run`). Output meant for programs goes to stdout, messages for people to stderr.

mod cli;

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    cli::run(cli::Cli::parse())
}
