#!/bin/bash
# Decode-speed profile on the GPU machine (see make_gpuspeed_carry.sh), from the repository root:
# synth models at the real shapes to /dev/shm, then `poly-engine bench` tg128 plain and under
# POLY_GPU_PROFILE=1 and 2, and ncu's per-kernel durations over a few decode tokens. Logs go to $OUT.
set -u
OUT=${OUT:-/tmp/poly-gpuspeed-out}
mkdir -p "$OUT"
C=.carry/gpuspeed
S="$OUT/summary.txt"
: > "$S"
export POLY_KERNEL_CACHE=/tmp/poly-kernel-cache
MODE=${1:-profile}
mkdir -p /dev/shm/m
( time $C/poly-engine synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q3.gguf ) > "$OUT/synth.txt" 2>&1 &
SYN3=$!
( time $C/poly-engine synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35.gguf ) >> "$OUT/synth.txt" 2>&1 &
SYN35=$!
if [ -x $C/gpu_forward ]; then
    echo "== gpu_forward" | tee -a "$S"
    timeout 150 $C/gpu_forward --test-threads 1 > "$OUT/gpu_forward.txt" 2>&1
    echo "gpu_forward rc=$?" | tee -a "$S"
    grep -E "^test |test result|panicked|FAIL" "$OUT/gpu_forward.txt" | head -30 | tee -a "$S"
fi
wait $SYN3 $SYN35
grep -E "wrote|real" "$OUT/synth.txt" | tee -a "$S"
for m in q3 q35; do
    f=/dev/shm/m/$m.gguf
    echo "== $m tg128 plain" | tee -a "$S"
    timeout 60 $C/poly-engine bench --model $f --gpu 0 --prompt 0 --gen 128 --reps 3 2>> "$OUT/err.txt" | tee -a "$S"
    for lvl in 1 2; do
        echo "== $m tg128 POLY_GPU_PROFILE=$lvl" | tee -a "$S"
        POLY_GPU_PROFILE=$lvl timeout 60 $C/poly-engine bench --model $f --gpu 0 --prompt 0 --gen 128 --reps 2 --no-warmup > "$OUT/b.json" 2> "$OUT/prof.txt"
        echo "rc=$?" | tee -a "$S"
        cat "$OUT/b.json" | tee -a "$S"
        grep -v "^\s*$" "$OUT/prof.txt" | head -60 | tee -a "$S"
    done
    if [ "$MODE" = profile ] && [ "$m" = q3 ] && [ -x /usr/local/cuda/bin/ncu ]; then
        echo "== $m ncu per-kernel over 2 decode tokens (gpu__time_duration)" | tee -a "$S"
        timeout 75 /usr/local/cuda/bin/ncu --metrics gpu__time_duration.sum --print-summary per-kernel \
            $C/poly-engine bench --model $f --gpu 0 --prompt 0 --gen 2 --reps 1 --no-warmup > "$OUT/ncu_$m.txt" 2>&1
        echo "ncu rc=$?" | tee -a "$S"
        grep -E "^\s+[a-z_0-9]+.*\(|gpu__time_duration|Invocations|^  [a-z]" "$OUT/ncu_$m.txt" | head -120 >> "$S"
    fi
done
rm -f "$OUT/b.json"
echo "== done" | tee -a "$S"
