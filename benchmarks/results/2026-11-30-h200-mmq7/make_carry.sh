#!/bin/bash
# Builds the carry of task mmq7 (run on the development machine): poly-engine of this branch (poly-engine),
# main's (poly-engine-main, from /tmp/mmq7/poly-engine-main), the GPU test binaries, stripped, in
# .carry/mmq7/bin.tar.xz (staged outside the carry and moved in at the end, so a copy never sees half of it).
set -euo pipefail
cd "$(dirname "$0")/../.."
D=.carry/mmq7
T=/tmp/mmq7/carrybin
rm -rf "$T" && mkdir -p "$T"
cargo build --release -p poly-engine --bin poly-engine
cp target/release/poly-engine "$T/"
cp /tmp/mmq7/poly-engine-main "$T/poly-engine-main"
{
    cargo test --release -p poly-kernels --test cuda_layer_ops --test cuda_layer_bench --no-run --message-format=json
    cargo test --release -p poly-engine --test gpu_forward --no-run --message-format=json
} 2>/dev/null | python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        shutil.copy(m["executable"], sys.argv[1] + "/" + m["target"]["name"])
' "$T"
chmod u+w "$T"/*
strip --strip-debug "$T"/*
tar cJf /tmp/mmq7/bin.tar.xz -C "$T" . && mv /tmp/mmq7/bin.tar.xz "$D/bin.tar.xz"
rm -rf "$T"
ls -la "$D"
