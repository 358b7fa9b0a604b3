#!/bin/bash
# Thirteenth session, call A (fresh machine): the card tests with this build (one warp a row, the router's
# choice ranked by the whole last block, the MoE end loading its 8 slots at once), greedy answers with logprobs byte for byte against the build
# before (poly-engine-base = e15dfec), every weight in VRAM; BASE and NEW alternating, pp512/tg128.
# llama.cpp builds in the background (nice 19) for call B.
set -u
OUT=$DEVOUT; S=$OUT/callA.txt; T0=$(date +%s); . .carry/s13/common.sh
mkdir -p /tmp/bin /dev/shm/m /tmp/lsrc /tmp/lcb
tar xJf $C/bin.tar.xz -C /tmp/bin && tar xJf $C/llama.cpp.tar.xz -C /tmp/lsrc
setsid nice -n 19 bash $C/llamacpp_build_cuda.sh /tmp/lsrc/llama.cpp /tmp/lcb/build /tmp/lcb > /tmp/lcb/llama_build.txt 2>&1 < /dev/null &
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> $S
lscpu | grep -E "^(Model name|L3)" >> $S
$E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 0 --out /dev/shm/m/q3u.gguf > /tmp/s1.txt 2>&1 &
P1=$!
$E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35s.gguf > /tmp/s2.txt 2>&1 &
P2=$!
for t in cuda_moe_fused cuda_fused cuda_ops gpu_forward; do
  timeout 170 /tmp/bin/$t --test-threads 1 > $OUT/test-$t.txt 2>&1
  st "$t rc=$?: $(grep -E '^test result' $OUT/test-$t.txt | tail -1) $(grep -E '^test .*FAILED$' $OUT/test-$t.txt | head -5 | tr '\n' ' ')"
done
wait $P1; st "q3u written: $(grep -E 'routing measured' /tmp/s1.txt | head -1)"
wait $P2; st "q35s written: $(grep -E 'routing measured' /tmp/s2.txt | head -1)"
ident q3u full
ident q35s full
for r in 1 2; do for m in q3u q35s; do
  [ $(( $(date +%s) - T0 )) -gt 520 ] && break 2
  b "$m full BASE" $BE --model /dev/shm/m/$m.gguf --prompt 512 --gen 128 --reps 2
  b "$m full NEW" $E --model /dev/shm/m/$m.gguf --prompt 512 --gen 128 --reps 2
done; done
st "llama build: $(ls /tmp/lcb/build.* 2>/dev/null) $(cat /tmp/lcb/build_time.txt 2>/dev/null)"
cat $S
