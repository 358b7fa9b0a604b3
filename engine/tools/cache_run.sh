#!/bin/bash
# Runs on the GPU machine from the repository root (see make_cache_carry.sh). Logs in $OUT:
# summary.txt (the tails), cache_tests.txt, forward_tests.txt, bench.txt.
set -u
OUT=${OUT:-/tmp/poly-c8-out}
mkdir -p "$OUT"
C=.carry/c8
S="$OUT/summary.txt"
: > "$S"
export POLY_KERNEL_CACHE=/tmp/poly-kernel-cache
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv >> "$S" 2>&1
nproc >> "$S"

echo "== gpu_expert_cache (all / none / half / following vs frozen)" | tee -a "$S"
timeout 200 $C/gpu_expert_cache --nocapture --test-threads=1 > "$OUT/cache_tests.txt" 2>&1
echo "rc=$?" | tee -a "$S"
grep -vE "^\s*$|^running|^stack|^ +[0-9]+:|^note:" "$OUT/cache_tests.txt" | cut -c1-400 | tail -60 >> "$S"

echo "== gpu_forward (regression: experts through the cache, all in VRAM)" | tee -a "$S"
timeout 150 $C/gpu_forward --nocapture --test-threads=1 > "$OUT/forward_tests.txt" 2>&1
echo "rc=$?" | tee -a "$S"
grep -E "test result|panicked|FAILED|failures|top5" "$OUT/forward_tests.txt" | cut -c1-300 | tail -30 >> "$S"

echo "== synth qwen3-30b-a3b Q4_K skew 1" | tee -a "$S"
M=/dev/shm/q3.gguf
( time $C/poly-engine synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --route-skew 1 --out $M ) > "$OUT/synth.txt" 2>&1
tail -4 "$OUT/synth.txt" >> "$S"
ls -la $M >> "$S" 2>&1
B="$OUT/bench.txt"
: > "$B"
for flags in "" "--expert-budget-mib 8000" "--expert-budget-mib 8000 --expert-staging-only" "--expert-budget-mib 8000 --expert-uploads 0" "--expert-budget-mib 0 --expert-uploads 0"; do
    echo "-- bench --gpu 0 $flags" | tee -a "$S" >> "$B"
    timeout 120 $C/poly-engine bench --model $M --gpu 0 --prompt 512 --gen 32 --reps 2 --no-expert-profile $flags >> "$B" 2>&1
    echo "rc=$?" | tee -a "$S"
    grep -E "expert cache|^\{|rror|panick" "$B" | tail -2 | cut -c1-1500 >> "$S"
done
echo "== done" | tee -a "$S"
