#!/bin/bash
# Builds what benchmarks/gpu_vs_llama.sh needs on the GPU machine into a git-ignored folder (default
# .carry/final): poly-engine, polystrata and the GPU test binaries (the kernels' CUDA tests, gpu_forward, gpu_expert_cache,
# witness_gpu) (stripped, in bin.tar.xz), the llama.cpp source of the
# pinned sdist (llama.cpp.tar.xz, from shared/device/make_llamacpp_carry.sh's folder .carry/llama.cpp) and
# its CUDA build script. Run on the development machine; no GPU needed.
set -euo pipefail
cd "$(dirname "$0")/.."
D=${1:-.carry/final}
mkdir -p "$D/bin"
# TESTS: the GPU test binaries to pack (default: all of them). The device takes 64 MiB a call, tracked
# files included: pack what the stay runs.
TESTS=${TESTS:-"witness_gpu gpu_forward gpu_expert_cache cuda_ops cuda_elementwise cuda_layer_ops cuda_prompt_attention cuda_fused cuda_moe_fused cuda_host_flags cuda_bench poly_kernels"}
cargo build --release -p poly-engine --bin poly-engine -p polystrata --bin polystrata
cp target/release/poly-engine target/release/polystrata "$D/bin/"
# BASE: a poly-engine binary to compare with (packed as poly-engine-base; the ours phase runs it beside).
[ -n "${BASE:-}" ] && cp "$BASE" "$D/bin/poly-engine-base"
{
    cargo test --release -p poly-tests --test witness_gpu --no-run --message-format=json
    cargo test --release -p poly-engine --test gpu_forward --test gpu_expert_cache --no-run --message-format=json
    cargo test --release -p poly-kernels --test cuda_ops --test cuda_elementwise --test cuda_layer_ops \
        --test cuda_prompt_attention --test cuda_fused --test cuda_moe_fused --test cuda_host_flags --test cuda_bench --lib --no-run --message-format=json
} 2>/dev/null | python3 -c '
import json, shutil, sys
# Only the test targets asked for (other binaries of a package, such as fuzz_smoke, come along otherwise).
want = set(sys.argv[2].split())
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in want:
        shutil.copy(m["executable"], sys.argv[1] + "/bin/" + m["target"]["name"])
' "$D" "$TESTS"
# Every symbol stripped and xz at its strongest: a call carries 64 MiB with the tracked tree, so each
# megabyte is a binary more per call (a panic still says where; no backtraces needed there).
strip --strip-all "$D"/bin/*
export XZ_OPT=-9e
tar cJf "$D/bin.tar.xz" -C "$D/bin" .
rm -rf "$D/bin"
# NO_LLAMA=1: llama.cpp's source is carried in a call of its own.
[ "${NO_LLAMA:-0}" = 1 ] || [ -f "$D/llama.cpp.tar.xz" ] || tar cJf "$D/llama.cpp.tar.xz" -C .carry llama.cpp
cp ../shared/device/llamacpp_build_cuda.sh "$D/" 2>/dev/null || cp .carry/llamacpp_build_cuda.sh "$D/"
ls -la "$D"
# What a call carries: the tracked files plus this folder, against the device's 64 MiB a call.
TRACKED=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s}')
CARRY=$(du -cb "$D" | tail -1 | cut -f1)
TOTAL=$(( TRACKED + CARRY ))
echo "a call carries $(( TOTAL >> 20 )) MiB (tracked $(( TRACKED >> 20 )) MiB + $D $(( CARRY >> 20 )) MiB) of 64"
if [ $TOTAL -gt $(( 64 << 20 )) ]; then
    # Over a call's limit: archives of a few binaries each in $D/parts/, each carried by a call of its own
    # (the machine keeps /tmp while warm: each call unpacks its part into /tmp/bin), then the phases run
    # with CARRY_DIR=$D/parts/NONE (offload_vs_llama.sh's prep skips a missing bin.tar.xz).
    # PARTS: the groups, ';' between them (default: each binary alone). Binaries packed together share
    # their code in xz's window: poly-engine with four test binaries is 2.6 MB, alone 1.6 MB.
    mkdir -p "$D/parts"
    tar xJf "$D/bin.tar.xz" -C "$D/parts"
    IFS=';' read -ra GROUPS_ <<< "${PARTS:-$(cd "$D/parts" && ls | tr '\n' ';')}"
    for g in "${GROUPS_[@]}"; do
        # shellcheck disable=SC2086 # a group of names, split on purpose
        set -- $g
        [ $# -gt 0 ] || continue
        tar cJf "$D/parts/$1.tar.xz" -C "$D/parts" "$@"
    done
    find "$D/parts" -type f ! -name '*.tar.xz' -delete
    echo "OVER the device's 64 MiB a call with bin.tar.xz whole: carry $D/parts/NAME.tar.xz one or a few at a time," >&2
    echo "each call running: mkdir -p /tmp/bin && for a in $D/parts/*.tar.xz; do tar xJf \$a -C /tmp/bin; done" >&2
    ls -la "$D/parts" >&2
fi
