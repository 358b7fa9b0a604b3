#!/bin/bash
# Runs on the GPU machine from the repository root (see make_gpu_carry.sh); the summary is
# $OUT/summary.txt (logs of each step are in it too, tails only).
set -u
OUT=${OUT:-/tmp/poly-gpu-out}
mkdir -p "$OUT"
C=.carry
S="$OUT/summary.txt"
: > "$S"
export POLY_KERNEL_CACHE=/tmp/poly-kernel-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1

echo "== cuda_elementwise" | tee -a "$S"
timeout 120 $C/cuda_elementwise --nocapture --test-threads 1 > "$OUT/ew.txt" 2>&1
echo "rc=$?" | tee -a "$S"
grep -E "nmse|test |panicked|error|skipped" "$OUT/ew.txt" | head -40 | tee -a "$S"

echo "== gpu_forward (GPU vs CPU on every fixture)" | tee -a "$S"
for t in gpu_forward_agrees_with_the_cpu_on_every_fixture a_conversation_moved_between_sequences_is_uploaded_again; do
    timeout 200 $C/gpu_forward --exact $t --nocapture > "$OUT/gf_$t.txt" 2>&1
    echo "$t rc=$?" | tee -a "$S"
    grep -vE "^\s*$|^running|^test result" "$OUT/gf_$t.txt" | tail -40 | tee -a "$S"
done

echo "== poly-engine run, GPU then CPU, greedy" | tee -a "$S"
for f in tests/fixtures/models/*.gguf; do
    for dev in "--gpu 0" "--cpu"; do
        echo "-- $(basename $f) $dev" | tee -a "$S"
        timeout 60 $C/poly-engine run --model "$f" --prompt-tokens 1,2,3,4,5,6,7,8,9,10,11,12 --max-tokens 8 --top 3 --n-ctx 512 $dev > "$OUT/run.txt" 2>&1
        echo "rc=$?" | tee -a "$S"
        tail -12 "$OUT/run.txt" | tee -a "$S"
    done
done

echo "== poly-engine serve READY" | tee -a "$S"
f=$(ls tests/fixtures/models/*.gguf | head -1)
echo "" | timeout 60 $C/poly-engine --model "$f" --gpu 0 --max-context 512 > "$OUT/serve.txt" 2>&1
echo "rc=$?" | tee -a "$S"
head -5 "$OUT/serve.txt" | tee -a "$S"
echo "== done" | tee -a "$S"
