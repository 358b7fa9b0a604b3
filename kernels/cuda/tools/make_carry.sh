#!/bin/bash
# Builds the CUDA test and benchmark binaries here (no GPU or toolkit needed) and puts them, stripped, with
# run.sh into .carry/ (git-ignored) for the GPU machine, which has no Rust. There, from the repository root:
#     bash .carry/run.sh
# runs the lib's CUDA unit tests, every cuda_ops and cuda_layer_ops test in its own process (a kernel fault cannot hide the
# tests after it), both benchmarks, and cuda_ops under compute-sanitizer when the toolkit has it; results
# go to $OUT (or /tmp/poly-cuda-out).
set -euo pipefail
cd "$(dirname "$0")/../../.."
mkdir -p .carry
cargo test --release -p poly-kernels --no-run --message-format=json 2>/dev/null | python3 -c '
import json, shutil, subprocess, sys
want = {"poly_kernels": "poly_kernels_lib", "cuda_ops": "cuda_ops", "cuda_fused": "cuda_fused", "cuda_bench": "cuda_bench",
        "cuda_layer_ops": "cuda_layer_ops", "cuda_layer_bench": "cuda_layer_bench"}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in want:
        dst = ".carry/" + want[m["target"]["name"]]
        shutil.copy(m["executable"], dst)
        subprocess.run(["strip", "--strip-debug", dst], check=True)
        print("carried", dst)
'
cp kernels/cuda/tools/run.sh .carry/run.sh
ls -la .carry
