#!/bin/bash
# NOT RUN (the eleventh session's device time was spent): the next stay's first call.
#   here:  TESTS="gpu_forward cuda_fused cuda_layer_ops" NO_LLAMA=1 bash benchmarks/make_gpu_carry.sh .carry/s12
#          (keep poly-engine, polystrata and the three tests; the lean tree is 54.8 MiB, so with llama.cpp's
#          source, 3.9 MiB, the binaries must stay under about 5 MiB compressed: drop witness_gpu),
#          cp .carry/s11/llama.cpp.tar.xz and this script into .carry/s12, bash benchmarks/device_lean.sh on
#   there: DEVOUT=$OUT bash .carry/s12/not-run-next.sh
# It checks 57c5908 (cuda_layer_ops' conv1d for LFM2's 3 taps), then measures the three launch fusions
# through the server at 8 GB and every weight in VRAM (on against off, alternating) and llama.cpp's
# 30,000-token prompts at 8 GB, which the eleventh session's stays did not reach.
set -u
OUT=$DEVOUT; export POLY_KERNEL_CACHE=/tmp/pkc POLY_ENGINE_BIN=/tmp/bin/poly-engine RAW=0
C=.carry/s12; E=/tmp/bin/poly-engine; T0=$(date +%s); S=$OUT/next.txt
OLD='"--fuse", "no-norm-rope-pair,no-attn-q8,no-moe-norm"'
st() { echo "[$(( $(date +%s) - T0 )) s] $*" >> $S; }
mkdir -p /tmp/bin /dev/shm/m /tmp/lsrc /tmp/lcb && for a in $C/parts/*.tar.xz $C/bin.tar.xz; do [ -e $a ] && tar xJf $a -C /tmp/bin; done
tar xJf $C/llama.cpp.tar.xz -C /tmp/lsrc
setsid nice -n 19 bash $C/llamacpp_build_cuda.sh /tmp/lsrc/llama.cpp /tmp/lcb/build /tmp/lcb > /tmp/lcb/llama_build.txt 2>&1 < /dev/null &
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> $S
$E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 0 --out /dev/shm/m/q3u.gguf > /tmp/s1.txt 2>&1 &
$E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35s.gguf > /tmp/s2.txt 2>&1 &
timeout 150 /tmp/bin/cuda_layer_ops --test-threads 1 > $OUT/test-cuda_layer_ops.txt 2>&1
st "cuda_layer_ops rc=$?: $(grep -E '^test result' $OUT/test-cuda_layer_ops.txt | tail -1)"
wait
grep -h "routing measured" /tmp/s1.txt /tmp/s2.txt >> $S
for round in 1 2; do for cfg in new old; do
  A=""; [ $cfg = old ] && A="$OLD"
  SERVER_PROMPTS=8000,30000 SERVER_ARGS="$A" BENCH=0 LEAN=1 FULL=0 SERVER_MODELS="q35s q3u" bash benchmarks/offload_vs_llama.sh $C ours > /dev/null 2>&1
  { echo "== 8 GB server, fusions $cfg, round $round"; cat $OUT/summary-ours.txt | grep -E "^short|^long|peak VRAM"; } >> $S
done; done
while [ ! -e /tmp/lcb/build.done ] && [ ! -e /tmp/lcb/build.failed ]; do sleep 2; done
LB=/tmp/lcb/build/bin/llama-bench
timeout 120 $LB -m /dev/shm/m/q35s.gguf -ngl 99 --n-cpu-moe 31 -fa 1 -p 30000 -n 0 -ub 2048 -b 8192 -r 1 -o md 2>&1 | grep -E "pp|error" >> $S
timeout 120 $LB -m /dev/shm/m/q3u.gguf -ngl 99 --n-cpu-moe 34 -fa 1 -p 30000 -n 0 -ub 2048 -b 8192 -r 1 -o md 2>&1 | grep -E "pp|error" >> $S
st done
