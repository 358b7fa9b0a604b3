#!/usr/bin/env bash
# Set up and run PolyStrata on this machine (the README's first command).
#
# Today: builds the release binaries, writes a tiny synthetic qwen3moe model with `poly-engine synth` into
# the installation home, shows what `poly-engine inspect` finds in it, and runs it on the CPU with
# `poly-engine run` (greedy tokens with their probabilities). The model installer (`setup`) and the server
# (`polystrata`) replace these steps when their issues land.
set -euo pipefail
cd "$(dirname "$0")"
home="${POLYSTRATA_HOME:-$HOME/.polystrata}"

if ! command -v cargo >/dev/null; then
  echo "setup.sh: cargo is missing; install the Rust toolchain (https://rustup.rs) and run again" >&2
  exit 1
fi
echo "== building release binaries"
cargo build --release --workspace
mkdir -p "$home/models"
model="$home/models/synthetic-qwen3moe-tiny.gguf"
echo "== writing a tiny synthetic qwen3moe model: $model"
target/release/poly-engine synth --arch qwen3moe --shape tiny --seed 1 --out "$model"
echo "== poly-engine inspect"
target/release/poly-engine inspect "$model"
echo "== poly-engine run (greedy, 16 tokens, on the CPU)"
target/release/poly-engine run --model "$model" --prompt-tokens 1,2,3,4,5,6,7,8 --max-tokens 16 --top 3
