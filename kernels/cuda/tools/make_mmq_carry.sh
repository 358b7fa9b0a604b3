#!/bin/bash
# Builds the prompt-speed checks (tensor-core matmul tests and benchmarks, the engine's GPU forward test,
# poly-engine for `bench`) here, stripped, into .carry/mmq/ (git-ignored) with mmq_run.sh; on the GPU
# machine, from the repository root: `bash .carry/mmq/run.sh` (logs and summary.txt in $OUT).
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=.carry/mmq
mkdir -p $D
{
    cargo test --release -p poly-kernels --test cuda_layer_ops --test cuda_layer_bench --test cuda_prompt_attention --no-run --message-format=json 2>/dev/null
    cargo test --release -p poly-engine --test gpu_forward --no-run --message-format=json 2>/dev/null
} | python3 -c '
import json, shutil, subprocess, sys
want = {"cuda_layer_ops", "cuda_layer_bench", "cuda_prompt_attention", "gpu_forward"}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in want:
        dst = "'$D'/" + m["target"]["name"]
        shutil.copy(m["executable"], dst)
        subprocess.run(["strip", "--strip-debug", dst], check=True)
        print("carried", dst)
'
cargo build --release -p poly-engine --bin poly-engine
cp target/release/poly-engine $D/poly-engine
strip --strip-debug $D/poly-engine
cp kernels/cuda/tools/mmq_run.sh $D/run.sh
du -sh $D
