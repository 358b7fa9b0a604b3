#!/bin/bash
# Builds the engine's GPU checks here (no GPU or toolkit needed) and puts them, stripped, with
# gpu_run.sh into .carry/ (git-ignored) for the GPU machine, which has no Rust. There, from the repository
# root: `bash .carry/run.sh` runs tests/gpu_forward.rs (GPU vs CPU on every fixture), examples/gpu_diag.rs
# (CPU sensitivity to q8_1 activations, the op-by-op lockstep), the same on dense F16 synth models, and a
# `poly-engine run` smoke; everything goes to $OUT/summary.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .carry
{
    cargo test --release -p poly-engine --test gpu_forward --no-run --message-format=json 2>/dev/null
    cargo test --release -p poly-kernels --test cuda_elementwise --no-run --message-format=json 2>/dev/null
} | python3 -c '
import json, shutil, subprocess, sys
want = {"gpu_forward": "gpu_forward", "cuda_elementwise": "cuda_elementwise"}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in want:
        dst = ".carry/" + want[m["target"]["name"]]
        shutil.copy(m["executable"], dst)
        subprocess.run(["strip", "--strip-debug", dst], check=True)
        print("carried", dst)
'
cargo build --release -p poly-engine --bin poly-engine --example gpu_diag
cp target/release/examples/gpu_diag .carry/gpu_diag
strip --strip-debug .carry/gpu_diag
cp target/release/poly-engine .carry/poly-engine
strip --strip-debug .carry/poly-engine
cp engine/tools/gpu_run.sh .carry/run.sh
ls -la .carry
du -sh .carry
