#!/bin/bash
# Runs on the GPU machine from the repository root (see make_carry.sh). Prints a summary at the end; every
# log is also under $OUT.
set -u
OUT=${OUT:-/tmp/poly-cuda-out}
mkdir -p "$OUT"
C=.carry
# A fresh kernel cache, so the first load compiles (and its time is measured) and the second reads it.
export POLY_KERNEL_CACHE=/tmp/poly-kernel-cache
rm -rf "$POLY_KERNEL_CACHE"
summary="$OUT/summary.txt"
: > "$summary"
if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/gpu.txt" 2>&1
    cat "$OUT/gpu.txt"
fi

echo "== lib cuda:: unit tests (NVRTC compiles every module for sm_80 and sm_90)" | tee -a "$summary"
timeout 200 $C/poly_kernels_lib cuda:: --nocapture > "$OUT/lib.txt" 2>&1
echo "rc=$? $(grep -E '^test result' "$OUT/lib.txt")" | tee -a "$summary"

for bin in cuda_ops cuda_layer_ops; do
    echo "== $bin, one process per test" | tee -a "$summary"
    for t in $($C/$bin --list 2>/dev/null | sed -n 's/: test$//p'); do
        timeout 180 $C/$bin --exact "$t" --nocapture > "$OUT/${bin}_$t.txt" 2>&1
        rc=$?
        echo "$t rc=$rc" | tee -a "$summary"
        grep -E "nmse|skipped|panicked|error|Error|first load|vs exact" "$OUT/${bin}_$t.txt" | head -40 | sed 's/^/    /' | tee -a "$summary"
    done
done

for bin in cuda_bench cuda_layer_bench; do
    echo "== $bin" | tee -a "$summary"
    timeout 180 $C/$bin --ignored --nocapture --test-threads 1 > "$OUT/$bin.txt" 2>&1
    echo "rc=$?" | tee -a "$summary"
    grep -E "^(bench|device|module)|panicked" "$OUT/$bin.txt" | tee -a "$summary"
done

SAN=/usr/local/cuda/bin/compute-sanitizer
if [ -x "$SAN" ]; then
    for bin in cuda_ops cuda_layer_ops; do
        echo "== $bin under compute-sanitizer (memcheck)" | tee -a "$summary"
        timeout 150 "$SAN" --tool memcheck --leak-check no $C/$bin --test-threads 1 > "$OUT/sanitizer_$bin.txt" 2>&1
        echo "rc=$? $(grep -E 'ERROR SUMMARY|^test result' "$OUT/sanitizer_$bin.txt" | tr '\n' ' ')" | tee -a "$summary"
    done
fi
echo "== done; logs in $OUT"
