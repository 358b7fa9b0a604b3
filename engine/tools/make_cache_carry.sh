#!/bin/bash
# Builds the expert-cache checks here (no GPU or toolkit needed) and puts them, stripped, with
# cache_run.sh into .carry/c8/ (git-ignored) for the GPU machine, which has no Rust. There, from the
# repository root: `bash .carry/c8/run.sh` (carry [".carry/c8"]) runs tests/gpu_expert_cache.rs and
# gpu_forward.rs, then benchmarks a synthetic Qwen3-30B-A3B-shaped model with every expert in VRAM, about
# half, and none; everything goes to $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
D=.carry/c8
mkdir -p $D
cargo test --release -p poly-engine --test gpu_forward --test gpu_expert_cache --no-run --message-format=json 2>/dev/null |
python3 -c '
import json, shutil, subprocess, sys
want = {"gpu_forward", "gpu_expert_cache"}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in want:
        dst = ".carry/c8/" + m["target"]["name"]
        shutil.copy(m["executable"], dst)
        subprocess.run(["strip", "--strip-debug", dst], check=True)
        print("carried", dst)
'
cargo build --release -p poly-engine --bin poly-engine
cp target/release/poly-engine $D/poly-engine
strip --strip-debug $D/poly-engine
cp engine/tools/cache_run.sh $D/run.sh
ls -la $D
du -sh $D
