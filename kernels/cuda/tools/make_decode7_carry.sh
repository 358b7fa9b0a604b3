#!/bin/bash
# Builds the decode checks (the CUDA kernel tests and the attention microbenchmark, the engine's GPU forward
# test, poly-engine for `bench` and serve mode), stripped, into .carry/decode7/ (git-ignored) with
# decode7_run.sh as run.sh and the serve driver; on the GPU machine, from the repository root:
# `bash .carry/decode7/run.sh` (summary.txt and logs in $OUT).
set -euo pipefail
cd "$(dirname "$0")/../../.."
# Built beside the carried folder and moved in at the end, so a copy taken meanwhile is whole.
D=.carry/decode7.new
rm -rf "$D" && mkdir -p "$D/bin"
cargo build --release -p poly-engine --bin poly-engine
cp target/release/poly-engine "$D/bin/"
{
    cargo test --release -p poly-kernels --test cuda_ops --test cuda_layer_ops --test cuda_layer_bench --test cuda_bench --no-run --message-format=json
    cargo test --release -p poly-engine --test gpu_forward --test gpu_expert_cache --no-run --message-format=json
} 2>/dev/null | python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        shutil.copy(m["executable"], sys.argv[1] + "/bin/" + m["target"]["name"])
' "$D"
strip --strip-debug "$D"/bin/*
tar cJf "$D/bin.tar.xz" -C "$D/bin" .
rm -rf "$D/bin"
cp kernels/cuda/tools/decode7_run.sh "$D/run.sh"
cp /work/main/.carry/d1/drive.py "$D/drive.py" # the lead's serve-mode driver (diag1)
rm -rf .carry/decode7 && mv "$D" .carry/decode7
ls -la .carry/decode7
