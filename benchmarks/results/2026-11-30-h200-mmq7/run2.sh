#!/bin/bash
# mmq7 device run (repository root of main on the H200): GPU tests of the changed kernels (tensor-core
# matmul incl. tiles of 128, grouped experts and their pair launch, grouping on the card, conv1d, delta rule)
# and gpu_forward; kernel benchmarks
# (grouped experts by tile, prompt matmul, delta rule); poly-engine bench before (main's binary) / after on
# q3 and q35, pp512 and pp8000; one POLY_GPU_PROFILE=2 prompt per model. Summary in $OUT/summary.txt.
set -u
C=.carry/mmq7
OUT=${OUT:-/tmp/mmq7-out}
R=/tmp/mmq7r; mkdir -p $R "$OUT" /tmp/m7bin /dev/shm/m
S=$OUT/summary.txt; : > $S
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $S; }
left() { [ $(( $(date +%s) - T0 )) -lt $1 ]; }
export POLY_KERNEL_CACHE=/tmp/pkc
tar xJf $C/bin.tar.xz -C /tmp/m7bin
B=/tmp/m7bin
E=$B/poly-engine
EM=$B/poly-engine-main
[ -f /dev/shm/m/q3.gguf ] || $E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q3.gguf > $R/synth.txt 2>&1 &
S1=$!
[ -f /dev/shm/m/q35.gguf ] || $E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35.gguf >> $R/synth.txt 2>&1 &
S2=$!
stamp "tests"
timeout 150 $B/cuda_layer_ops prompt_matmul_on_the_tensor_cores expert_grouped_matmul expert_grouping_on_the_card conv1d gated_delta_rule --test-threads 4 > $R/ops.txt 2>&1
echo "cuda_layer_ops rc=$?" | tee -a $S
grep -E "^test .*(ok|FAILED)$|test result|failed|panicked|nmse" $R/ops.txt | head -30 | tee -a $S
timeout 60 $B/cuda_layer_bench bench_grouped_experts bench_delta_rule bench_prompt_matmul --ignored --nocapture --test-threads 1 > $R/kbench.txt 2>&1
echo "cuda_layer_bench rc=$?" | tee -a $S
grep -E "^bench" $R/kbench.txt | grep -v "tiles of 8:\|tiles of 16:\|IQ4_XS\|Q5_K\|dp4a\|mma tile 16\|mma tile 32" | tee -a $S
stamp "gpu_forward"
timeout 90 $B/gpu_forward --test-threads 4 > $R/gpu_forward.txt 2>&1; echo "gpu_forward rc=$?" | tee -a $S
grep -E "^test .*(ok|FAILED)$|test result|panicked" $R/gpu_forward.txt | head -12 | tee -a $S
wait $S1 $S2
grep -E "wrote" $R/synth.txt | tee -a $S
bench() { # label, binary, args...
    local label=$1 bin=$2; shift 2
    timeout 60 $bin bench "$@" > $R/b.json 2> $R/b.err
    local rc=$?
    python3 - "$label rc=$rc" $R/b.json >> $S 2>&1 <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[2]))
except Exception as e:
    print("  " + sys.argv[1] + " no json: " + str(e)); sys.exit()
out = [sys.argv[1]]
for k in ("pp", "tg"):
    if k in d:
        out.append("%s%d %.1f t/s (%s)" % (k, d[k]["n_tokens"], d[k]["avg_ts"], ", ".join("%.1f" % x for x in d[k]["samples_ts"])))
print("  " + " | ".join(out))
PY
}
stamp "engine bench (run 2: the staged delta rule, tiles of 32 below 48 tokens per expert)"
for m in q35 q3; do
    bench "$m new pp512" $E --model /dev/shm/m/$m.gguf --gpu 0 --prompt 512 --gen 0 --reps 3
    bench "$m main pp512" $EM --model /dev/shm/m/$m.gguf --gpu 0 --prompt 512 --gen 0 --reps 3
    POLY_GPU_PROFILE=2 bench "$m new pp8000 (profiled)" $E --model /dev/shm/m/$m.gguf --gpu 0 --prompt 8000 --ubatch 4096 --gen 0 --reps 2
    cp $R/b.err $R/prof_${m}_new.txt
    grep -E "prompt \(>1 token\)| op " $R/b.err | head -30 >> $S
    left 120 && bench "$m main pp8000" $EM --model /dev/shm/m/$m.gguf --gpu 0 --prompt 8000 --ubatch 4096 --gen 0 --reps 2
    stamp "$m done"
done
stamp "end"
cp $R/ops.txt $R/kbench.txt $R/gpu_forward.txt $OUT/ 2>/dev/null
tar czf $OUT/prof.tgz -C $R $(cd $R && ls prof_*.txt) 2>/dev/null
cat $S
