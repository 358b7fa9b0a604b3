//! `setup`: installs model families (pinned, checksummed downloads), writes tokenizer directories, run
//! configs and start scripts, and says what this PC can run.
//!
//! The installer is the subject of its own issue; until then this binary only says so and exits non-zero.

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "setup",
    version,
    about = "PolyStrata installer (not yet built: see README)"
)]
struct Args {}

fn main() -> std::process::ExitCode {
    let _ = Args::parse();
    eprintln!("setup: the installer is not built yet (see README.md)");
    std::process::ExitCode::from(2)
}
