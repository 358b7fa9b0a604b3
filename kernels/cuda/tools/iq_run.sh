#!/bin/bash
# Runs on the GPU machine from the repository root: the GPU tests that cover the i-quant kernels (issue 16
# §5), each in its own process, then every test of their three binaries, from the binaries make_carry.sh
# puts in .carry/ (the device tool's call: `bash kernels/cuda/tools/iq_run.sh` with carry [".carry"]).
# Logs and summary.txt go to $OUT.
set -u
OUT=${OUT:-/tmp/poly-cuda-out}
mkdir -p "$OUT"
C=.carry
export POLY_KERNEL_CACHE=/tmp/poly-kernel-cache
summary="$OUT/summary.txt"
: > "$summary"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee -a "$summary"
run() {
    local bin=$1 t=$2
    timeout 240 $C/$bin --exact "$t" --nocapture > "$OUT/${bin}_$t.txt" 2>&1
    echo "$bin $t rc=$?" | tee -a "$summary"
    grep -E "nmse|skipped|panicked|error|Error|failures|first load" "$OUT/${bin}_$t.txt" | grep -E "IQ|skipped|panicked|rror|failures|first load" | head -80 | sed 's/^/    /' | tee -a "$summary"
}
run cuda_ops matvec_matches_cpu_for_quantized_formats
run cuda_ops expert_matvec_matches_cpu_per_slot
run cuda_ops fused_gate_up_experts_equal_the_separate_launches
run cuda_fused matvec_many_matches_the_cpu_and_one_launch_per_matrix
run cuda_layer_ops prompt_matmul_matches_cpu_and_equals_the_matvec
run cuda_layer_ops expert_grouped_matmul_matches_cpu
for bin in cuda_ops cuda_fused cuda_layer_ops; do
    timeout 400 $C/$bin --test-threads 1 > "$OUT/${bin}_all.txt" 2>&1
    echo "$bin (all) rc=$? $(grep -E '^test result' "$OUT/${bin}_all.txt")" | tee -a "$summary"
done
echo "== done; logs in $OUT"
