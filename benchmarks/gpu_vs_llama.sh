#!/bin/bash
# The GPU comparison of issues 7 and 8 on the H200 machine, in one stay: llama.cpp CUDA built there from the
# same sdist, synthetic models at the real shapes (Q4_K, real-like route skew) in /dev/shm, then
#  1. correctness: the kernels' CUDA tests (every GPU op against the CPU op), gpu_forward, gpu_expert_cache,
#     and witness_gpu (against llama.cpp CPU references, our CPU, and llama.cpp CUDA references written here
#     by tests/witness/cuda_references.cpp);
#  2. every weight in VRAM: poly-engine bench --gpu 0 against llama-bench -ngl 99 -fa 1 (pp512, tg128,
#     tg128 after 2,000 and 8,000 tokens of context (--depth / -d), pp8000 with its best -ub/-b), and the
#     serve mode (GEN requests in order, benchmarks/serve_drive.py);
#  3. the card held to 8 and 16 GB for the model: poly-engine --vram-reserve-mib against llama-bench
#     --n-cpu-moe (several values; the peak VRAM of each is recorded, so the fewest CPU layers that fit
#     the budget can be read off).
#  4. the CPU engine against llama.cpp's CPU (the same CUDA build with no GPU visible, native AVX-512) on
#     the host's 16 cores, `small` synthetic qwen3moe and qwen35moe in Q4_K (issue 3's table).
# usage (repository root on the device): bash benchmarks/gpu_vs_llama.sh CARRY_DIR [ours|llama|all]
# Two calls fit the device's 10-minute limit: `ours` starts the llama.cpp build (its own session, so it
# outlives the call) and runs steps 1-3 for our engine; `llama` (on the same machine, still warm) waits for
# the build and runs llama.cpp's side, the CUDA references and witness_gpu, and step 4.
# CARRY_DIR holds bin.tar.xz (poly-engine and the GPU test binaries, stripped; made by
# benchmarks/make_gpu_carry.sh) and llama.cpp.tar.xz with llamacpp_build_cuda.sh (shared/device).
# Results: $OUT/summary.txt, $OUT/results.tgz, $OUT/references-cuda.tgz. About 9 minutes.
set -u
C=$1
PHASE=${2:-all}
OUT=${OUT:-/tmp/gpu-vs-llama}
R=/tmp/gvl; mkdir -p $R "$OUT"
S=$OUT/summary.txt; : > $S
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $S; }
export POLY_KERNEL_CACHE=/tmp/pkc POLY_WITNESS_MODELS=/tmp/nogemma
mkdir -p /tmp/bin /tmp/lsrc /tmp/lcb /dev/shm/m
E=/tmp/bin/poly-engine
LB=/tmp/lcb/build/bin/llama-bench
if [ ! -x $E ]; then
    tar xJf $C/bin.tar.xz -C /tmp/bin && tar xJf $C/llama.cpp.tar.xz -C /tmp/lsrc
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> $S
    stamp "build llama.cpp CUDA (background, its own session)"
    setsid bash $C/llamacpp_build_cuda.sh /tmp/lsrc/llama.cpp /tmp/lcb/build /tmp/lcb > /tmp/lcb/llama_build.txt 2>&1 < /dev/null &
    $E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q3.gguf > $R/synth.txt 2>&1 &
    S1=$!
    $E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35.gguf >> $R/synth.txt 2>&1 &
    S2=$!
    wait $S1 $S2
    grep -E "wrote" $R/synth.txt | tee -a $S
fi
wait_llama() {
    stamp "wait for the llama.cpp build"
    while [ ! -e /tmp/lcb/build.done ] && [ ! -e /tmp/lcb/build.failed ]; do sleep 5; done
    tail -2 /tmp/lcb/llama_build.txt | tee -a $S
}

if [ $PHASE = ours ] || [ $PHASE = all ]; then
stamp "1. correctness"
# poly_kernels: the kernels' own unit tests (on this host: the AVX-512 kernels against the portable code).
for t in poly_kernels cuda_ops cuda_elementwise cuda_layer_ops cuda_prompt_attention cuda_fused gpu_forward gpu_expert_cache; do
    [ -x /tmp/bin/$t ] || continue
    # The kernels' CPU tests take longer than the slot while llama.cpp builds (SKIP_LIB=1 skips them).
    [ $t = poly_kernels ] && [ "${SKIP_LIB:-0}" = 1 ] && continue
    threads=1; [ $t = poly_kernels ] && threads=8  # CPU tests: no card shared between them
    timeout 150 /tmp/bin/$t --test-threads $threads > $R/$t.txt 2>&1; echo "$t rc=$?: $(grep -E '^test result' $R/$t.txt | tail -1)" | tee -a $S
    grep -E "^test .*FAILED$" $R/$t.txt | tee -a $S
done
fi

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
        out.append("%s%d @d%d %.1f t/s (%s)" % (k, d[k]["n_tokens"], d.get("depth", 0), d[k]["avg_ts"], ", ".join("%.1f" % x for x in d[k]["samples_ts"])))
if "experts" in d:
    e = d["experts"]
    out.append("experts in VRAM %s/%s share %.3f" % (e.get("in_vram"), e.get("slots"), e.get("vram_share") or 0))
    if e.get("cpu_experts") or e.get("staged_decode"):
        out.append("tokens' missing experts: %s copied, %s on the CPU (%.0f / %.0f us each)" % (
            e.get("staged_decode"), e.get("cpu_experts"), e.get("copy_us_per_expert") or 0, e.get("cpu_us_per_expert") or 0))
print("  " + " | ".join(out))
PY
    kill $SMI 2>/dev/null; wait $SMI 2>/dev/null
    echo "  peak VRAM used on the card: $(sort -n $R/vram.txt | tail -1) MiB" >> $S
    grep -E "expert cache:" $R/b.err | head -2 >> $S
    cat $R/b.json >> $R/ours_all.jsonl; echo >> $R/ours_all.jsonl
}
if [ $PHASE = ours ] || [ $PHASE = all ]; then
stamp "2. every weight in VRAM (ours)"
for m in q3 q35; do
    POLY_GPU_PROFILE=1 bench "$m full pp512 tg128" --model /dev/shm/m/$m.gguf --gpu 0 --prompt 512 --gen 128 --reps 3
    grep -E "decode \(1 token\)" $R/b.err | head -2 >> $S
    for d in 2000 8000; do
        bench "$m full tg128 depth $d" --model /dev/shm/m/$m.gguf --gpu 0 --prompt 0 --gen 128 --depth $d --reps 2 --ubatch 4096
    done
    bench "$m full pp8000 ub4096" --model /dev/shm/m/$m.gguf --gpu 0 --prompt 8000 --gen 0 --reps 2 --ubatch 4096
    stamp "ours $m serve mode (prompt:answer requests in order)"
    timeout 120 python3 benchmarks/serve_drive.py $E /dev/shm/m/$m.gguf 16384 40:128 2000:128 8000:128 40:128 -- --gpu 0 >> $S 2> $R/serve_$m.err
done
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
stamp "3. the card held to 8 / 16 GB (ours)"
for case in q3:8192 q3:16384 q35:8192 q35:16384; do
    m=${case%%:*}; mib=${case##*:}
    bench "$m ${mib}MiB pp512 tg64" --model /dev/shm/m/$m.gguf --gpu 0 --vram-reserve-mib $(( TOTAL - mib )) --prompt 512 --gen 64 --reps 2
    # Where a token's missing experts are computed, and (--gpu-segments off) the token without graphs.
    modes="card"; [ $case = q3:8192 ] && modes="cpu card mapped"
    for mode in $modes; do
        bench "$m ${mib}MiB tg64 --missing-experts $mode" --model /dev/shm/m/$m.gguf --gpu 0 --vram-reserve-mib $(( TOTAL - mib )) --prompt 0 --gen 64 --reps 2 --missing-experts $mode
    done
    bench "$m ${mib}MiB tg64 --gpu-segments off" --model /dev/shm/m/$m.gguf --gpu 0 --vram-reserve-mib $(( TOTAL - mib )) --prompt 0 --gen 64 --reps 2 --gpu-segments off
    [ $case = q3:8192 ] && timeout 120 python3 benchmarks/serve_drive.py $E /dev/shm/m/q3.gguf 16384 40:128 2000:128 8000:128 -- --gpu 0 --vram-reserve-mib $(( TOTAL - mib )) >> $S 2> $R/serve_q3_8g.err
    bench "$m ${mib}MiB pp8000" --model /dev/shm/m/$m.gguf --gpu 0 --vram-reserve-mib $(( TOTAL - mib )) --prompt 8000 --gen 0 --reps 1 --ubatch 4096
    # One call of the whole prompt: each layer's uncached experts staged once for the read.
    bench "$m ${mib}MiB pp8000 ub8000" --model /dev/shm/m/$m.gguf --gpu 0 --vram-reserve-mib $(( TOTAL - mib )) --prompt 8000 --gen 0 --reps 1 --ubatch 8000
done
fi
if [ $PHASE = llama ] || [ $PHASE = all ]; then
wait_llama
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
    timeout 120 $LB -m /dev/shm/m/$m.gguf -ngl 99 -fa 1 -p 0 -n 128 -d 2000,8000 -ub 2048 -b 8192 -r 2 -o md 2>/dev/null | grep -E "tg" | tee -a $S
    timeout 120 $LB -m /dev/shm/m/$m.gguf -ngl 99 -fa 1 -p 8000 -n 0 -ub 2048 -b 8192 -r 2 -o md 2>/dev/null | grep -E "pp" | tee -a $S
done
stamp "llama.cpp held (--n-cpu-moe)"
for case in q3:29 q3:8 q35:31 q35:12; do
    m=${case%%:*}; ncmoe=${case##*:}
    stamp "llama.cpp $m --n-cpu-moe $ncmoe"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > $R/vram.txt 2>/dev/null &
    SMI=$!
    timeout 100 $LB -m /dev/shm/m/$m.gguf -ngl 99 --n-cpu-moe $ncmoe -fa 1 -p 512 -n 64 -r 2 -o md 2>&1 | grep -E "pp|tg|error" | tee -a $S
    timeout 100 $LB -m /dev/shm/m/$m.gguf -ngl 99 --n-cpu-moe $ncmoe -fa 1 -p 8000 -n 0 -ub 2048 -b 8192 -r 1 -o md 2>&1 | grep -E "pp|error" | tee -a $S
    kill $SMI 2>/dev/null; wait $SMI 2>/dev/null
    echo "  peak VRAM used on the card: $(sort -n $R/vram.txt | tail -1) MiB" | tee -a $S
done
[ "${SKIP_CPU:-0}" = 1 ] || {
stamp "4. the CPU engine against llama.cpp's CPU (no GPU visible), 16 threads"
$E synth --arch qwen3moe --shape small --type Q4_K --seed 1 --out /dev/shm/m/q3s.gguf > /dev/null 2>&1
$E synth --arch qwen35moe --shape small --type Q4_K --seed 1 --out /dev/shm/m/q35s.gguf > /dev/null 2>&1
CUDA_VISIBLE_DEVICES= timeout 200 python3 benchmarks/cpu_vs_llama.py --threads 16 --rounds 1 --reps 2 --engine $E \
    --llama-bench $LB --model "qwen3moe small Q4_K=/dev/shm/m/q3s.gguf" \
    --model "qwen35moe small Q4_K=/dev/shm/m/q35s.gguf" --out $R/cpu16 2>&1 | tail -8 | tee -a $S
}
fi
stamp "done"

tar czf $OUT/results-$PHASE.tgz -C $R .
