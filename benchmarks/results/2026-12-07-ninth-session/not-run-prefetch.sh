#!/bin/bash
# NOT RUN: this session's device time went to asks that got no machine (no H100 or H200 came in 1,800 s).
# The next stay's first call (repository root on the device; the carry as in the session's note):
#   here:  TESTS="gpu_forward cuda_ops" bash benchmarks/make_gpu_carry.sh .carry/s10 (llama.cpp's source in
#          .carry/s10/src/llama.cpp.tar.xz, not beside bin.tar.xz, so prep does not unpack it over the build),
#          bash benchmarks/device_lean.sh on
#   there: DEVOUT=$OUT bash benchmarks/results/2026-12-07-ninth-session/not-run-prefetch.sh
# Most wanted first (what is written under $OUT comes back even if the call is cut):
# 1. the prefetch is a hint: greedy answers with --gpu-prefetch ahead / own must equal off's token for token
#    and logprob for logprob (q3u and q35s, every weight in VRAM and at 8 GB);
# 2. every weight in VRAM, ahead / own / off alternating (q3u is the 0.92x case);
# 3. at 8 GB, ahead / off;
# 4. llama.cpp on the same files (every layer on the card; 8 GB at --n-cpu-moe 34 / 31, the earlier scans).
set -u
export POLY_ENGINE_BIN=/tmp/bin/poly-engine OUT=$DEVOUT RAW=0 POLY_KERNEL_CACHE=/tmp/pkc
C=.carry/s10; E=/tmp/bin/poly-engine
T0=$(date +%s)
mkdir -p /tmp/lsrc /tmp/lcb /tmp/bin
tar xJf $C/src/llama.cpp.tar.xz -C /tmp/lsrc
setsid bash $C/llamacpp_build_cuda.sh /tmp/lsrc/llama.cpp /tmp/lcb/build /tmp/lcb > /tmp/lcb/llama_build.txt 2>&1 < /dev/null &
LLAMA=0 MODELS="q3u q35s" TEST_BINS="gpu_forward" TEST_TIMEOUT=90 bash benchmarks/offload_vs_llama.sh $C prep
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); RES=$(( TOTAL - 8192 ))
for m in q3u q35s; do
    for where in full 8gb; do
        A=""; [ $where = 8gb ] && A="--vram-reserve-mib $RES"
        for p in off ahead own; do
            # shellcheck disable=SC2086 # the reserve's flag, split on purpose
            timeout 60 $E run --model /dev/shm/m/$m.gguf --gpu 0 $A --prompt-tokens 1,2,3,4,5,6,7,8,9,10 --max-tokens 48 --top 4 --json --gpu-prefetch $p > /tmp/run-$p.json 2>/dev/null
        done
        echo "$m $where: ahead $(cmp -s /tmp/run-off.json /tmp/run-ahead.json && echo equal || echo DIFFERS), own $(cmp -s /tmp/run-off.json /tmp/run-own.json && echo equal || echo DIFFERS) ($(wc -c < /tmp/run-off.json) bytes)" >> $OUT/identity.txt
    done
done
MODELS="q3u q35s" BENCH=0 ROUNDS=2 LEAN=1 SERVER=0 FULL=1 FULL_VARIANTS="--gpu-prefetch ahead;--gpu-prefetch own" bash benchmarks/offload_vs_llama.sh $C ours
mv $OUT/summary-ours.txt $OUT/summary-full.txt
MODELS="q3u q35s" PP_ROUNDS=0 ROUNDS=2 VGEN=64 VARIANTS="--gpu-prefetch ahead" LEAN=1 SERVER=0 FULL=0 bash benchmarks/offload_vs_llama.sh $C ours
mv $OUT/summary-ours.txt $OUT/summary-8gb.txt
while [ ! -e /tmp/lcb/build.done ] && [ ! -e /tmp/lcb/build.failed ]; do sleep 2; [ $(( $(date +%s) - T0 )) -gt 500 ] && break; done
LB=/tmp/lcb/build/bin/llama-bench
echo "[$(( $(date +%s) - T0 )) s] llama.cpp: $(tail -1 /tmp/lcb/llama_build.txt)" >> $OUT/llama.txt
for m in q3u q35s; do timeout 60 $LB -m /dev/shm/m/$m.gguf -ngl 99 -fa 1 -p 512 -n 128 -r 2 -o md 2>&1 | grep -E "pp|tg|error" >> $OUT/llama.txt; done
timeout 60 $LB -m /dev/shm/m/q3u.gguf -ngl 99 --n-cpu-moe 34 -fa 1 -p 0 -n 64 -r 2 -o md 2>&1 | grep -E "tg|error" >> $OUT/llama.txt
timeout 60 $LB -m /dev/shm/m/q35s.gguf -ngl 99 --n-cpu-moe 31 -fa 1 -p 0 -n 64 -r 2 -o md 2>&1 | grep -E "tg|error" >> $OUT/llama.txt
echo "[$(( $(date +%s) - T0 )) s] llama done" >> $OUT/llama.txt
cp /tmp/ovl/gpu_forward.txt $OUT/ 2>/dev/null
