#!/bin/bash
# Runs on the GPU machine from the repository root (see make_gpu_carry.sh); the summary is
# $OUT/summary.txt (tails of each step's log are in it; the full lockstep tables in $OUT/lockstep.txt).
set -u
OUT=${OUT:-/tmp/poly-gpu-out}
mkdir -p "$OUT"
C=.carry
S="$OUT/summary.txt"
: > "$S"
export POLY_KERNEL_CACHE=/tmp/poly-kernel-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1

echo "== gpu_forward (GPU vs CPU and vs CPU with q8_1-rounded activations, every fixture)" | tee -a "$S"
for t in gpu_forward_agrees_with_the_cpu_on_every_fixture a_conversation_moved_between_sequences_is_uploaded_again; do
    timeout 240 $C/gpu_forward --exact $t --nocapture > "$OUT/gf_$t.txt" 2>&1
    echo "$t rc=$?" | tee -a "$S"
    grep -vE "^\s*$|^running|^test result|^stack|^ +[0-9]+:|^note:" "$OUT/gf_$t.txt" | tail -40 | tee -a "$S"
done

echo "== sensitivity (CPU only): CPU vs CPU with q8_1-rounded matmul/MoE inputs" | tee -a "$S"
timeout 120 $C/gpu_diag sensitivity tests/fixtures/models/*.gguf 2>&1 | tee -a "$S"

echo "== lockstep (card vs CPU op by op; local = one op on the CPU's inputs; full tables in lockstep.txt)" | tee -a "$S"
timeout 200 $C/gpu_diag lockstep tests/fixtures/models/qwen35moe-tiny-q4k-q8.gguf tests/fixtures/models/qwen3moe-tiny-q4k-q8.gguf \
    tests/fixtures/models/qwen35moe-tiny-q4km.gguf tests/fixtures/models/qwen3moe-tiny-q4km.gguf \
    tests/fixtures/models/gemma3-tiny-q4k-q8.gguf > "$OUT/lockstep.txt" 2>&1
echo "rc=$?" | tee -a "$S"
grep -E "^====|^--|^  layer|^    moe|^  worst|rror|panick" "$OUT/lockstep.txt" | cut -c1-1200 | tee -a "$S"
echo "-- full op table of qwen35moe-tiny-q4k-q8 all rows (first lockstep block):" | tee -a "$S"
awk '/^====/{n++} n==1' "$OUT/lockstep.txt" | sed -n '/-- all rows/,/-- decode step 0/p' | grep -E "^ +[0-9]+ L" | cut -c1-300 | tee -a "$S"

echo "== dense F16 synth models (no activation quantization: GPU vs CPU at float precision)" | tee -a "$S"
mkdir -p /tmp/f16
for a in qwen35moe qwen3moe gemma3; do
    $C/poly-engine synth --arch $a --shape tiny --type F16 --seed 3 --out /tmp/f16/$a-tiny-f16.gguf > /dev/null 2>&1 || echo "synth $a failed" | tee -a "$S"
done
POLY_FIXTURES=/tmp/f16 timeout 200 $C/gpu_forward --exact gpu_forward_agrees_with_the_cpu_on_every_fixture --nocapture > "$OUT/gf_f16.txt" 2>&1
echo "gpu_forward on F16 rc=$?" | tee -a "$S"
grep -vE "^\s*$|^running|^test result|^stack|^ +[0-9]+:|^note:" "$OUT/gf_f16.txt" | tail -30 | tee -a "$S"
timeout 120 $C/gpu_diag lockstep /tmp/f16/*.gguf > "$OUT/lockstep_f16.txt" 2>&1
echo "lockstep F16 rc=$?" | tee -a "$S"
grep -E "^====|^--|^  layer|^  worst|rror|panick" "$OUT/lockstep_f16.txt" | cut -c1-1200 | tee -a "$S"

echo "== poly-engine run on the GPU, greedy (smoke)" | tee -a "$S"
for f in tests/fixtures/models/qwen35moe-tiny-q4k-q8.gguf; do
    timeout 60 $C/poly-engine run --model "$f" --prompt-tokens 1,2,3,4,5,6,7,8,9,10,11,12 --max-tokens 4 --top 3 --n-ctx 512 --gpu 0 > "$OUT/run.txt" 2>&1
    echo "rc=$?" | tee -a "$S"
    tail -6 "$OUT/run.txt" | tee -a "$S"
done
echo "== done" | tee -a "$S"
