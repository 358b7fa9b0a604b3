#!/usr/bin/env bash
# The test command (README.md): formatting, lints, and every test of the workspace.
# Runs on a machine without a GPU; needs only the Rust toolchain (cargo, rustfmt, clippy).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo test --workspace --release"
cargo test --workspace --release
