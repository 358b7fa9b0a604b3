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
timeout 300 $C/poly_kernels_lib cuda:: --nocapture > "$OUT/lib.txt" 2>&1
echo "rc=$? $(grep -E '^test result' "$OUT/lib.txt")" | tee -a "$summary"

echo "== cuda_ops, one process per test" | tee -a "$summary"
for t in $($C/cuda_ops --list 2>/dev/null | sed -n 's/: test$//p'); do
    timeout 120 $C/cuda_ops --exact "$t" --nocapture > "$OUT/ops_$t.txt" 2>&1
    rc=$?
    echo "$t rc=$rc" | tee -a "$summary"
    grep -E "nmse|skipped|panicked|error|Error|first load" "$OUT/ops_$t.txt" | head -40 | sed 's/^/    /' | tee -a "$summary"
done

echo "== cuda_bench" | tee -a "$summary"
timeout 300 $C/cuda_bench --ignored --nocapture --test-threads 1 > "$OUT/bench.txt" 2>&1
echo "rc=$?" | tee -a "$summary"
grep -E "^(bench|device|module)|panicked" "$OUT/bench.txt" | tee -a "$summary"

SAN=/usr/local/cuda/bin/compute-sanitizer
if [ -x "$SAN" ]; then
    echo "== cuda_ops under compute-sanitizer (memcheck)" | tee -a "$summary"
    timeout 240 "$SAN" --tool memcheck --leak-check no $C/cuda_ops --test-threads 1 > "$OUT/sanitizer.txt" 2>&1
    echo "rc=$? $(grep -E 'ERROR SUMMARY|^test result' "$OUT/sanitizer.txt" | tr '\n' ' ')" | tee -a "$summary"
fi
echo "== done; logs in $OUT"
