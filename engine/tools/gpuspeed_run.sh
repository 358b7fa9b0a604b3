#!/bin/bash
# Decode-speed run on the GPU machine (see make_gpuspeed_carry.sh), from the repository root: the CUDA
# elementwise tests and the engine's gpu_forward tests, synth models at the real shapes in /dev/shm, then
# `poly-engine bench` tg128 with decode graphs on and off (--gpu-graphs off), under POLY_GPU_PROFILE=1, with
# fewer warps per matvec row (--matvec-warps-per-row), and, time permitting, ncu per-kernel durations
# over three decode tokens with graphs.
# Logs go to $OUT (summary.txt first).
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
( time $C/poly-engine synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35.gguf ) > "$OUT/synth35.txt" 2>&1 &
SYN35=$!
for t in cuda_elementwise gpu_forward; do
    [ -x $C/$t ] || continue
    echo "== $t" | tee -a "$S"
    timeout 150 $C/$t --test-threads 1 --nocapture > "$OUT/$t.txt" 2>&1
    echo "$t rc=$?" | tee -a "$S"
    grep -E "^test |test result|panicked|FAIL|alternating|assert" "$OUT/$t.txt" | cut -c1-400 | head -40 | tee -a "$S"
done
wait $SYN3 $SYN35
cat "$OUT/synth35.txt" >> "$OUT/synth.txt"; rm -f "$OUT/synth35.txt"
grep -E "wrote|real" "$OUT/synth.txt" | tee -a "$S"
bench() { # model, label, env...
    local f=$1 label=$2; shift 2
    echo "== $label" | tee -a "$S"
    # NAME=VALUE words are diagnostic environment variables (POLY_GPU_PROFILE, ...), the rest
    # poly-engine flags (the execution knobs, e.g. --mmq off).
    local envs=() flags=()
    for a in "$@"; do case $a in -*) flags+=("$a") ;; *=*) envs+=("$a") ;; *) flags+=("$a") ;; esac; done
    env "${envs[@]}" timeout 60 $C/poly-engine bench --model $f --gpu 0 --prompt 0 --gen 128 --reps 3 "${flags[@]}" > "$OUT/b.json" 2> "$OUT/prof.txt"
    echo "rc=$?" | tee -a "$S"
    python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); t=d["tg"]; print("tg128 %.1f t/s (samples %s) cpu/wall %.2f" % (t["avg_ts"], [round(x,1) for x in t["samples_ts"]], t["cpu_per_wall"] or 0))' "$OUT/b.json" 2>&1 | tee -a "$S"
    grep -v "^\s*$" "$OUT/prof.txt" | head -50 | tee -a "$S"
}
for m in q3 q35; do
    f=/dev/shm/m/$m.gguf
    bench $f "$m graphs on"
    bench $f "$m graphs on, profile 1" POLY_GPU_PROFILE=1
    bench $f "$m graphs off" --gpu-graphs off
    bench $f "$m graphs on, matvec 1 warp per row" --matvec-warps-per-row 1
    [ $m = q3 ] && bench $f "$m graphs on, matvec 2 warps per row" --matvec-warps-per-row 2
done
if [ "$MODE" = profile ] && [ $SECONDS -lt 180 ] && [ -x /usr/local/cuda/bin/ncu ]; then
    echo "== q3 ncu per-kernel over 3 decode tokens with graphs (gpu__time_duration), at ${SECONDS}s" | tee -a "$S"
    timeout 50 /usr/local/cuda/bin/ncu --metrics gpu__time_duration.sum --print-summary per-kernel \
        $C/poly-engine bench --model /dev/shm/m/q3.gguf --gpu 0 --prompt 0 --gen 3 --reps 1 --no-warmup > "$OUT/ncu_q3.txt" 2>&1
    echo "ncu rc=$?" | tee -a "$S"
    grep -E "^  [a-z_0-9]+ \(|gpu__time_duration" "$OUT/ncu_q3.txt" | paste - - | sed -E 's/ +/ /g' | cut -c1-200 >> "$S"
fi
rm -f "$OUT/b.json" "$OUT/prof.txt"
echo "== done at ${SECONDS}s" | tee -a "$S"
