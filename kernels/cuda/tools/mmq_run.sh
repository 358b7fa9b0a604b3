#!/bin/bash
# Runs on the GPU machine from the repository root (see make_mmq_carry.sh): the tensor-core matmul
# tests against the CPU, their benchmarks, the engine's GPU forward test on the fixtures, and poly-engine
# bench on synth models at real shapes (tensor cores on, and off with POLY_MMQ=off). Summary in
# $OUT/summary.txt.
set -u
OUT=${OUT:-/tmp/poly-mmq-out}
mkdir -p "$OUT"
C=.carry/mmq
S="$OUT/summary.txt"
: > "$S"
export POLY_KERNEL_CACHE=/tmp/poly-kernel-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$S"; }

stamp "== cuda_layer_ops (prompt matmul tests)"
for t in prompt_matmul_on_the_tensor_cores_matches_cpu expert_grouped_matmul_matches_cpu float_prompt_matmul_matches_cpu prompt_matmul_matches_cpu_and_equals_the_matvec; do
    timeout 120 $C/cuda_layer_ops --exact $t --nocapture > "$OUT/ops_$t.txt" 2>&1
    echo "$t rc=$?" | tee -a "$S"
    grep -E "nmse|panicked|rror" "$OUT/ops_$t.txt" | head -40 | sed 's/^/    /' | tee -a "$S"
done
timeout 60 $C/cuda_prompt_attention --nocapture > "$OUT/ops_attention.txt" 2>&1
echo "cuda_prompt_attention rc=$?" | tee -a "$S"
grep -E "nmse|panicked|rror" "$OUT/ops_attention.txt" | head -20 | sed 's/^/    /' | tee -a "$S"
stamp "== cuda_layer_bench"
timeout 90 $C/cuda_layer_bench --ignored --nocapture --test-threads 1 bench_prompt_matmul bench_grouped_experts > "$OUT/bench_kernels.txt" 2>&1
echo "rc=$?" | tee -a "$S"
grep -E "^bench|panicked" "$OUT/bench_kernels.txt" | tee -a "$S"

stamp "== synth + bench qwen3moe 30B-A3B shape"
mkdir -p /dev/shm/m
$C/poly-engine synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q3.gguf > "$OUT/synth_q3.txt" 2>&1 || echo "synth q3 failed" | tee -a "$S"
for cfg in "512 512 on on" "4096 4096 on on" "512 512 off on" "512 512 on off" "4096 4096 on off"; do
    set -- $cfg
    stamp "q3 pp$1 ubatch $2 mmq $3 fa $4"
    POLY_MMQ=$3 POLY_FA=$4 timeout 90 $C/poly-engine bench --model /dev/shm/m/q3.gguf --gpu 0 --prompt $1 --ubatch $2 --gen 0 --reps 2 2> "$OUT/bench_q3_err.txt" | python3 -c 'import json,sys; d=json.load(sys.stdin); p=d["pp"]; print("  pp avg_ts %.0f samples %s cpu/wall %.2f" % (p["avg_ts"], [round(x) for x in p["samples_ts"]], p["cpu_per_wall"]))' 2>&1 | tee -a "$S"
    tail -3 "$OUT/bench_q3_err.txt" | tee -a "$S"
done
rm -f /dev/shm/m/q3.gguf

stamp "== gpu_forward (GPU vs CPU on every fixture)"
timeout 100 $C/gpu_forward --nocapture --test-threads 1 > "$OUT/gpu_forward.txt" 2>&1
echo "rc=$?" | tee -a "$S"
grep -vE "^\s*$|^running|^test result|^stack|^ +[0-9]+:|^note:" "$OUT/gpu_forward.txt" | tail -25 | tee -a "$S"

stamp "== synth + bench qwen35moe 35B-A3B shape"
$C/poly-engine synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35.gguf > "$OUT/synth_q35.txt" 2>&1 || echo "synth q35 failed" | tee -a "$S"
for cfg in "512 512 on on" "4096 4096 on on"; do
    set -- $cfg
    stamp "q35 pp$1 ubatch $2 mmq $3 fa $4"
    POLY_MMQ=$3 POLY_FA=$4 timeout 90 $C/poly-engine bench --model /dev/shm/m/q35.gguf --gpu 0 --prompt $1 --ubatch $2 --gen 0 --reps 2 2> "$OUT/bench_q35_err.txt" | python3 -c 'import json,sys; d=json.load(sys.stdin); p=d["pp"]; print("  pp avg_ts %.0f samples %s cpu/wall %.2f" % (p["avg_ts"], [round(x) for x in p["samples_ts"]], p["cpu_per_wall"]))' 2>&1 | tee -a "$S"
    tail -3 "$OUT/bench_q35_err.txt" | tee -a "$S"
done
rm -f /dev/shm/m/q35.gguf
stamp "== done"
