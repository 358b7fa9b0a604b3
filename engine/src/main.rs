//! `poly-engine`: one child process per loaded model.
//!
//! Today it carries the model-file tools (`inspect`, `dump`, `synth`); serving a model over the line
//! protocol comes with the issue that defines it. Output meant for programs goes to stdout, messages for
//! people to stderr.

mod cli;

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("poly-engine: {e}");
            ExitCode::FAILURE
        }
    }
}
