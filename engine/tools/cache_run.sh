#!/bin/bash
# Runs on the GPU machine from the repository root (see make_cache_carry.sh); about 3-4 minutes. Logs in
# $OUT: summary.txt (the tails), cache_tests.txt, forward_tests.txt, bench.txt, serve.txt.
set -u
OUT=${OUT:-/tmp/poly-c8-out}
mkdir -p "$OUT"
C=.carry/c8
S="$OUT/summary.txt"
: > "$S"
export POLY_KERNEL_CACHE=/tmp/poly-kernel-cache
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv >> "$S" 2>&1
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)

echo "== gpu_expert_cache (all / none / half / eighth following, direct and staged copies)" | tee -a "$S"
timeout 90 $C/gpu_expert_cache --nocapture --test-threads=1 > "$OUT/cache_tests.txt" 2>&1
echo "rc=$?" | tee -a "$S"
grep -vE "^\s*$|^running|^stack|^ +[0-9]+:|^note:|^expert cache" "$OUT/cache_tests.txt" | cut -c1-300 | tail -45 >> "$S"

echo "== gpu_forward (GPU vs CPU; prompts' experts grouped by expert)" | tee -a "$S"
timeout 90 $C/gpu_forward --nocapture --test-threads=1 > "$OUT/forward_tests.txt" 2>&1
echo "rc=$?" | tee -a "$S"
grep -E "test result|panicked|FAILED|vs Cpu" "$OUT/forward_tests.txt" | cut -c1-300 | tail -20 >> "$S"

echo "== synth qwen3-30b-a3b Q4_K skew 1" | tee -a "$S"
M=/dev/shm/q3.gguf
( time $C/poly-engine synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --route-skew 1 --out $M ) > "$OUT/synth.txt" 2>&1
grep real "$OUT/synth.txt" >> "$S"
B="$OUT/bench.txt"
: > "$B"
CARD8=$((TOTAL - 8192))
run_bench() {
    echo "-- bench $*" | tee -a "$S" >> "$B"
    timeout 100 $C/poly-engine bench --model $M --gpu 0 --reps 2 --no-expert-profile "$@" >> "$B" 2>&1
    echo "rc=$?" | tee -a "$S"
    grep -E "expert cache|^\{|rror|panick" "$B" | tail -2 | cut -c1-1600 >> "$S"
}
run_bench --prompt 512 --gen 32
POLY_MOE_PER_SLOT=1 run_bench --prompt 512 --gen 0
run_bench --prompt 512 --gen 64 --vram-reserve-mib $CARD8
run_bench --prompt 512 --gen 64 --vram-reserve-mib $CARD8 --expert-uploads 0
run_bench --prompt 512 --gen 32 --expert-budget-mib 0
run_bench --prompt 4096 --ubatch 4096 --gen 0 --reps 1 --vram-reserve-mib $CARD8

echo "== serve: DONE experts_vram_share, STATS cache fields, the profile written" | tee -a "$S"
printf 'GEN {"id":"r1","tokens":[1,2,3,4,5,6,7,8],"max_tokens":16}\nSTATS\nQUIT\n' |
    timeout 60 $C/poly-engine --model $M --gpu 0 --max-context 256 --expert-budget-mib 4000 > "$OUT/serve.txt" 2> "$OUT/serve_err.txt"
echo "rc=$?" | tee -a "$S"
grep -E "^DONE|^STATS|^ERR" "$OUT/serve.txt" | cut -c1-900 >> "$S"
tail -3 "$OUT/serve_err.txt" >> "$S"
ls -la $M.poly-profile.json >> "$S" 2>&1
echo "== done" | tee -a "$S"
