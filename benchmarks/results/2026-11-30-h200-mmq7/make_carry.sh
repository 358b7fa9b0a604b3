#!/bin/bash
# Builds the carry of task mmq7 (run on the development machine): poly-engine of this branch (bin/poly-engine),
# main's (bin/poly-engine-main, from /tmp/mmq7/poly-engine-main), the GPU test binaries, stripped, in bin.tar.xz.
set -euo pipefail
cd "$(dirname "$0")/../.."
D=.carry/mmq7
rm -rf "$D/bin" && mkdir -p "$D/bin"
cargo build --release -p poly-engine --bin poly-engine
cp target/release/poly-engine "$D/bin/"
cp /tmp/mmq7/poly-engine-main "$D/bin/poly-engine-main"
{
    cargo test --release -p poly-kernels --test cuda_layer_ops --test cuda_layer_bench --no-run --message-format=json
    cargo test --release -p poly-engine --test gpu_forward --no-run --message-format=json
} 2>/dev/null | python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        shutil.copy(m["executable"], sys.argv[1] + "/bin/" + m["target"]["name"])
' "$D"
chmod u+w "$D"/bin/*
strip --strip-debug "$D"/bin/*
tar cJf "$D/bin.tar.xz" -C "$D/bin" .
rm -rf "$D/bin"
ls -la "$D"
