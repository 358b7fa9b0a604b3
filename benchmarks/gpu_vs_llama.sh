#!/bin/bash
# The GPU comparison of issues 7 and 8 on the H200 machine, in one stay: llama.cpp CUDA built there from the
# same sdist, synthetic models at the real shapes (Q4_K, real-like route skew) in /dev/shm, then
#  1. correctness: witness_gpu (against llama.cpp CPU references, our CPU, and llama.cpp CUDA references
#     written here by tests/witness/cuda_references.cpp), gpu_forward, gpu_expert_cache;
#  2. every weight in VRAM: poly-engine bench --gpu 0 against llama-bench -ngl 99 -fa 1 (pp512, tg128,
#     pp8000 with its best -ub/-b);
#  3. the card held to about 8 GB for the model: poly-engine --expert-budget-mib against llama-bench
#     --n-cpu-moe (the fewest CPU layers that fit the same 8 GB).
# usage (repository root on the device): bash benchmarks/gpu_vs_llama.sh CARRY_DIR
# CARRY_DIR holds bin.tar.xz (poly-engine and the GPU test binaries, stripped) and llama.cpp.tar.xz with
# llamacpp_build_cuda.sh (shared/device). Results: $OUT/summary.txt, $OUT/results.tgz.
set -u
C=$1
OUT=${OUT:-/tmp/gpu-vs-llama}
R=/tmp/gvl; mkdir -p $R "$OUT"
S=$OUT/summary.txt; : > $S
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $S; }
export POLY_KERNEL_CACHE=/tmp/pkc POLY_WITNESS_MODELS=/tmp/nogemma
mkdir -p /tmp/bin /tmp/lsrc /tmp/lcb /dev/shm/m
tar xJf $C/bin.tar.xz -C /tmp/bin && tar xJf $C/llama.cpp.tar.xz -C /tmp/lsrc
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> $S
stamp "build llama.cpp CUDA (background)"
setsid bash $C/llamacpp_build_cuda.sh /tmp/lsrc/llama.cpp /tmp/lcb/build /tmp/lcb > $R/llama_build.txt 2>&1 &
BPID=$!
E=/tmp/bin/poly-engine
$E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q3.gguf > $R/synth.txt 2>&1 &
S1=$!
$E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35.gguf >> $R/synth.txt 2>&1 &
S2=$!

stamp "1. correctness"
timeout 120 /tmp/bin/gpu_forward --test-threads 1 > $R/gpu_forward.txt 2>&1; echo "gpu_forward rc=$?" | tee -a $S
grep -E "^test .*(ok|FAILED)$|test result" $R/gpu_forward.txt | tee -a $S
timeout 120 /tmp/bin/gpu_expert_cache --test-threads 1 --nocapture > $R/gpu_expert_cache.txt 2>&1; echo "gpu_expert_cache rc=$?" | tee -a $S
grep -E "^test .*(ok|FAILED)$|test result" $R/gpu_expert_cache.txt | tee -a $S
wait $S1 $S2
grep -E "wrote" $R/synth.txt | tee -a $S

bench() { # label, args...
    local label=$1; shift
    stamp "ours $label"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > $R/vram.txt 2>/dev/null &
    local SMI=$!
    timeout 150 $E bench "$@" > $R/b.json 2> $R/b.err
    echo "rc=$?" >> $S
    python3 - "$label" $R/b.json >> $S 2>&1 <<'PY'
import json, sys
d = json.load(open(sys.argv[2]))
out = [sys.argv[1]]
for k in ("pp", "tg"):
    if k in d:
        out.append("%s%d %.1f t/s (%s)" % (k, d[k]["n_tokens"], d[k]["avg_ts"], ", ".join("%.1f" % x for x in d[k]["samples_ts"])))
if "experts" in d:
    e = d["experts"]
    out.append("experts in VRAM %s/%s share %.3f" % (e.get("in_vram"), e.get("slots"), e.get("vram_share") or 0))
print("  " + " | ".join(out))
PY
    kill $SMI 2>/dev/null; wait $SMI 2>/dev/null
    echo "  peak VRAM used on the card: $(sort -n $R/vram.txt | tail -1) MiB" >> $S
    grep -E "expert cache:" $R/b.err | head -2 >> $S
    cat $R/b.json >> $R/ours_all.jsonl; echo >> $R/ours_all.jsonl
}
stamp "2. every weight in VRAM (ours)"
for m in q3 q35; do
    POLY_GPU_PROFILE=1 bench "$m full pp512 tg128" --model /dev/shm/m/$m.gguf --gpu 0 --prompt 512 --gen 128 --reps 3
    grep -E "decode \(1 token\)" $R/b.err | head -2 >> $S
    bench "$m full pp8000 ub4096" --model /dev/shm/m/$m.gguf --gpu 0 --prompt 8000 --gen 0 --reps 2 --ubatch 4096
done
nvidia-smi --query-gpu=memory.used --format=csv,noheader >> $S
stamp "wait for the llama.cpp build"
wait $BPID
tail -2 $R/llama_build.txt | tee -a $S
LB=/tmp/lcb/build/bin/llama-bench
stamp "CUDA references (tests/witness/cuda_references.cpp)"
L=/tmp/lsrc/llama.cpp
g++ -O2 -std=c++17 tests/witness/cuda_references.cpp -I$L/include -I$L/ggml/include -I$L/vendor \
    -L/tmp/lcb/build/bin -lllama -lggml -lggml-base -Wl,-rpath,/tmp/lcb/build/bin -o /tmp/bin/cuda_references > $R/cref_build.txt 2>&1
echo "cuda_references build rc=$?" | tee -a $S
mkdir -p tests/fixtures/references-cuda
timeout 150 /tmp/bin/cuda_references tests/fixtures/models tests/fixtures/references tests/fixtures/references-cuda > $R/cref.txt 2>&1
echo "cuda_references rc=$? ($(ls tests/fixtures/references-cuda | wc -l) files)" | tee -a $S
tar czf $OUT/references-cuda.tgz -C tests/fixtures references-cuda
timeout 150 /tmp/bin/witness_gpu --nocapture > $R/witness_gpu.txt 2>&1; echo "witness_gpu rc=$?" | tee -a $S
grep -E "references accepted|CUDA against CPU" $R/witness_gpu.txt | tee -a $S
stamp "llama.cpp, every layer on the card"
for m in q3 q35; do
    timeout 120 $LB -m /dev/shm/m/$m.gguf -ngl 99 -fa 1 -p 512 -n 128 -r 3 -o md 2>/dev/null | grep -E "pp|tg" | tee -a $S
    timeout 120 $LB -m /dev/shm/m/$m.gguf -ngl 99 -fa 1 -p 8000 -n 0 -ub 2048 -b 8192 -r 2 -o md 2>/dev/null | grep -E "pp" | tee -a $S
done
stamp "3. the card held to 8 GB for the model (qwen3moe 30B-A3B shape)"
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
RES=$(( TOTAL - 8192 ))
bench "q3 8GB pp512 tg64" --model /dev/shm/m/q3.gguf --gpu 0 --vram-reserve-mib $RES --prompt 512 --gen 64 --reps 2
bench "q3 8GB pp8000" --model /dev/shm/m/q3.gguf --gpu 0 --vram-reserve-mib $RES --prompt 8000 --gen 0 --reps 1 --ubatch 4096
for ncmoe in 29; do
    stamp "llama.cpp --n-cpu-moe $ncmoe"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > $R/vram.txt 2>/dev/null &
    SMI=$!
    timeout 120 $LB -m /dev/shm/m/q3.gguf -ngl 99 --n-cpu-moe $ncmoe -fa 1 -p 512 -n 64 -r 2 -o md 2>&1 | grep -E "pp|tg|error" | tee -a $S
    timeout 150 $LB -m /dev/shm/m/q3.gguf -ngl 99 --n-cpu-moe $ncmoe -fa 1 -p 8000 -n 0 -ub 2048 -b 8192 -r 1 -o md 2>&1 | grep -E "pp|error" | tee -a $S
    kill $SMI 2>/dev/null; wait $SMI 2>/dev/null
    echo "  peak VRAM used on the card: $(sort -n $R/vram.txt | tail -1) MiB" | tee -a $S
done
stamp "done"

tar czf $OUT/results.tgz -C $R .
