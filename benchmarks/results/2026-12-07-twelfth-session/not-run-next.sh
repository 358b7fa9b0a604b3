#!/bin/bash
# NOT RUN (the twelfth session's device time was spent): the next stay's first call.
#   here:  TESTS="gpu_forward cuda_ops cuda_fused cuda_moe_fused" NO_LLAMA=1 bash benchmarks/make_gpu_carry.sh .carry/s13
#          (repack poly-engine with the four tests into one bin.tar.xz: about 3.5 MB), cp .carry/s11/llama.cpp.tar.xz
#          .carry/s13/, bash benchmarks/device_lean.sh on
#   there: DEVOUT=$OUT bash benchmarks/results/2026-12-07-twelfth-session/not-run-next.sh
# 1. The card tests with one warp a row as the default (9def31e): gpu_forward, cuda_ops, cuda_fused,
#    cuda_moe_fused — the bench ran that path, no test did.
# 2. Where a resident token's time goes at tg128's context (a 256-row cache, 8 splits of attention and
#    their merge), ours and llama.cpp's, Nsight Compute node by node: the twelfth session's profile ran at a
#    32-token context.
set -u
OUT=$DEVOUT; export POLY_KERNEL_CACHE=/tmp/pkc
C=.carry/s13; E=/tmp/bin/poly-engine; T0=$(date +%s); S=$OUT/next.txt
st() { echo "[$(( $(date +%s) - T0 )) s] $*" >> $S; }
mkdir -p /tmp/bin /dev/shm/m /tmp/lsrc /tmp/lcb && tar xJf $C/bin.tar.xz -C /tmp/bin && tar xJf $C/llama.cpp.tar.xz -C /tmp/lsrc
setsid nice -n 19 bash $C/llamacpp_build_cuda.sh /tmp/lsrc/llama.cpp /tmp/lcb/build /tmp/lcb > /tmp/lcb/llama_build.txt 2>&1 < /dev/null &
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> $S
$E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 0 --out /dev/shm/m/q3u.gguf > /tmp/s1.txt 2>&1 &
for t in gpu_forward cuda_ops cuda_moe_fused cuda_fused; do
  timeout 150 /tmp/bin/$t --test-threads 1 > $OUT/test-$t.txt 2>&1
  st "$t rc=$?: $(grep -E '^test result' $OUT/test-$t.txt | tail -1) $(grep -E '^test .*FAILED$' $OUT/test-$t.txt | head -5 | tr '\n' ' ')"
done
wait
# A steady token 100 positions into a 640-row context (bench --prompt 512 --gen 128's), ours.
timeout 150 ncu --graph-profiling node --launch-skip 6000 --launch-count 240 --metrics gpu__time_duration.sum --csv \
  $E bench --model /dev/shm/m/q3u.gguf --gpu 0 --prompt 0 --gen 160 --reps 1 --no-expert-profile > $OUT/ncu-q3u-ours-tg.csv 2>/dev/null
st "ncu ours rc=$?"
while [ ! -e /tmp/lcb/build.done ] && [ ! -e /tmp/lcb/build.failed ]; do sleep 2; done
timeout 150 ncu --graph-profiling node --launch-skip 6000 --launch-count 240 --metrics gpu__time_duration.sum --csv \
  /tmp/lcb/build/bin/llama-bench -m /dev/shm/m/q3u.gguf -ngl 99 -fa 1 -p 0 -n 160 -r 1 > $OUT/ncu-q3u-llama-tg.csv 2>/dev/null
st "ncu llama rc=$?"
