#!/bin/bash
# Runs on the GPU machine from the repository root (see make_mmq_carry.sh): the tensor-core matmul and
# attention tests against the CPU, their benchmarks, the engine's GPU forward tests on the fixtures, and
# poly-engine bench on synth models at real shapes (with the per-operation times of POLY_GPU_PROFILE=2).
# Everything is summarized in $OUT/summary.txt (full logs: $OUT/logs.txt); at most a few minutes.
set -u
OUT=${OUT:-/tmp/poly-mmq-out}
mkdir -p "$OUT"
# The binaries' folder: cuda_layer_ops, cuda_layer_bench, cuda_prompt_attention, poly-engine (gpu_forward
# optional).
C=${C:-.carry/mmq}
S="$OUT/summary.txt"
L="$OUT/logs.txt"
: > "$S"
: > "$L"
export POLY_KERNEL_CACHE=/tmp/poly-kernel-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$S"; }
log() { echo "===== $1" >> "$L"; cat "$2" >> "$L"; }

stamp "== kernel tests against the CPU"
for t in prompt_matmul_on_the_tensor_cores_matches_cpu iquant_prompt_matmul_on_the_tensor_cores_matches_cpu expert_grouped_matmul_matches_cpu float_prompt_matmul_matches_cpu prompt_matmul_matches_cpu_and_equals_the_matvec; do
    timeout 100 $C/cuda_layer_ops --exact $t --nocapture > /tmp/mmq_t.txt 2>&1
    echo "$t rc=$?" | tee -a "$S"
    grep -E "nmse|panicked|rror" /tmp/mmq_t.txt | grep -vE "vs dp4a|vs matvec" | head -60 | sed 's/^/    /' | tee -a "$S"
    log $t /tmp/mmq_t.txt
done
timeout 60 $C/cuda_prompt_attention --nocapture > /tmp/mmq_t.txt 2>&1
echo "cuda_prompt_attention rc=$?" | tee -a "$S"
grep -E "nmse|panicked|rror" /tmp/mmq_t.txt | head -20 | sed 's/^/    /' | tee -a "$S"
log attention /tmp/mmq_t.txt

stamp "== kernel benchmarks"
timeout 100 $C/cuda_layer_bench --ignored --nocapture --test-threads 1 bench_prompt_matmul bench_grouped_experts bench_attention > /tmp/mmq_t.txt 2>&1
echo "rc=$?" | tee -a "$S"
grep -E "^bench|panicked" /tmp/mmq_t.txt | grep -vE "IQ4_XS|Q5_K|Q8_0" | tee -a "$S"
log bench /tmp/mmq_t.txt

if [ -x $C/gpu_forward ] && [ -z "${SKIP_GPU_FORWARD:-}" ]; then
    stamp "== gpu_forward (GPU vs CPU on every fixture and on F16 synth models)"
    timeout 100 $C/gpu_forward --nocapture --test-threads 1 > /tmp/mmq_t.txt 2>&1
    echo "rc=$?" | tee -a "$S"
    grep -vE "^\s*$|^running|^stack|^ +[0-9]+:|^note:" /tmp/mmq_t.txt | tail -30 | cut -c1-400 | tee -a "$S"
    log gpu_forward /tmp/mmq_t.txt
fi

# bench <model> <prompt> <ubatch> [env...]: one line of tokens/s; with POLY_GPU_PROFILE=2 also the
# profile's summary (where the calls' time goes, device time per operation kind).
bench() {
    local model=$1 pp=$2 ub=$3
    shift 3
    # NAME=VALUE words are diagnostic environment variables (POLY_GPU_PROFILE, ...), the rest
    # poly-engine flags (the execution knobs, e.g. --mmq off).
    local envs=() flags=()
    for a in "$@"; do case $a in -*) flags+=("$a") ;; *=*) envs+=("$a") ;; *) flags+=("$a") ;; esac; done
    env "${envs[@]}" timeout 100 $C/poly-engine bench --model "$model" --gpu 0 --prompt $pp --ubatch $ub --gen 0 --reps 2 \
        "${flags[@]}" > /tmp/mmq_b.txt 2> /tmp/mmq_e.txt
    echo "  pp$pp ub$ub $*: $(python3 -c 'import json,sys; d=json.load(open("/tmp/mmq_b.txt")); p=d["pp"]; print("%.0f t/s samples %s wall/call %s" % (p["avg_ts"], [round(x) for x in p["samples_ts"]], [round(x, 4) for x in p["samples_wall_s"]]))' 2>&1)" | tee -a "$S"
    case "$*" in *PROFILE*) grep -vE "^\s*$" /tmp/mmq_e.txt | tail -40 | cut -c1-300 | sed 's/^/    /' | tee -a "$S" ;; esac
    grep -iE "error|panick" /tmp/mmq_e.txt | head -3 | tee -a "$S"
    log "bench $model $pp $*" /tmp/mmq_e.txt
}

model() { # model <name> <arch> <shape>: an existing /dev/shm/m/<name>.gguf, else a new one in /dev/shm/mmq
    if [ -f /dev/shm/m/$1.gguf ]; then
        echo /dev/shm/m/$1.gguf
    else
        mkdir -p /dev/shm/mmq
        $C/poly-engine synth --arch $2 --shape $3 --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/mmq/$1.gguf > /tmp/mmq_s.txt 2>&1
        echo /dev/shm/mmq/$1.gguf
    fi
}

stamp "== qwen3moe 30B-A3B shape"
M=$(model q3 qwen3moe qwen3-30b-a3b)
stamp "model $M"
bench $M 512 512 --mmq on
bench $M 4096 4096 --mmq on
bench $M 512 512 --fa off
bench $M 512 512 --mmq-expert-tile 16
bench $M 512 512 --mmq-expert-tile 64
bench $M 512 512 POLY_GPU_PROFILE=2
rm -f /dev/shm/mmq/q3.gguf

stamp "== qwen35moe 35B-A3B shape"
M=$(model q35 qwen35moe qwen3.6-35b-a3b)
stamp "model $M"
bench $M 512 512 --mmq on
bench $M 4096 4096 --mmq on
bench $M 512 512 --mmq-expert-tile 32
bench $M 512 512 POLY_GPU_PROFILE=2
rm -f /dev/shm/mmq/q35.gguf
stamp "== done"
