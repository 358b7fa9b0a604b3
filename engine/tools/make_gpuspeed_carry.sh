#!/bin/bash
# Builds the decode-speed run for the GPU machine into .carry/gpuspeed/ (git-ignored): poly-engine and
# the gpu_forward test, stripped, and gpuspeed_run.sh as run.sh. There, from the repository root:
#     bash .carry/gpuspeed/run.sh [profile|quick]
set -euo pipefail
cd "$(dirname "$0")/../.."
D=.carry/gpuspeed
mkdir -p $D
cargo build --release -p poly-engine --bin poly-engine
cp target/release/poly-engine $D/poly-engine
strip --strip-debug $D/poly-engine
if [ "${WITH_TESTS:-1}" = 1 ]; then
    {
        cargo test --release -p poly-engine --test gpu_forward --no-run --message-format=json 2>/dev/null
        cargo test --release -p poly-kernels --test cuda_elementwise --no-run --message-format=json 2>/dev/null
    } | python3 -c '
import json, shutil, subprocess, sys
for line in sys.stdin:
    m = json.loads(line)
    name = m.get("target", {}).get("name")
    if m.get("reason") == "compiler-artifact" and m.get("executable") and name in ("gpu_forward", "cuda_elementwise"):
        shutil.copy(m["executable"], ".carry/gpuspeed/" + name)
        subprocess.run(["strip", "--strip-debug", ".carry/gpuspeed/" + name], check=True)
        print("carried", name)
'
fi
cp engine/tools/gpuspeed_run.sh $D/run.sh
ls -la $D
du -sh $D
