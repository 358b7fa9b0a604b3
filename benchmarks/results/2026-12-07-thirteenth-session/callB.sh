#!/bin/bash
# Thirteenth session, call B (a fresh machine): call A measured this build 6-9% slower than the base
# (q3u tg128 301-304 vs 320, q35s 259-260 vs 281-284) with greedy answers equal value for value. Which
# part: BASE and NEW (built as BASE was, with polystrata) and NEW1 (call A's binary, poly-engine built
# alone) with each new fused kernel turned off (`--fuse no-router-topk`, `--fuse no-moe-norm`), every
# weight in VRAM; then Nsight Compute node by node on a steady answer token about 520 positions in
# (bench --prompt 512; llama-bench -d 512), BASE and NEW, and llama.cpp's (built in the background).
set -u
OUT=$DEVOUT; S=$OUT/callB.txt; T0=$(date +%s); . .carry/s13/common.sh
N1=/tmp/bin/poly-engine-new1
mkdir -p /tmp/bin /dev/shm/m /tmp/lsrc /tmp/lcb
tar xJf $C/bin.tar.xz -C /tmp/bin && tar xJf $C/llama.cpp.tar.xz -C /tmp/lsrc
setsid nice -n 19 bash $C/llamacpp_build_cuda.sh /tmp/lsrc/llama.cpp /tmp/lcb/build /tmp/lcb > /tmp/lcb/llama_build.txt 2>&1 < /dev/null &
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> $S
$E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 0 --out /dev/shm/m/q3u.gguf > /tmp/s1.txt 2>&1 &
P1=$!
$E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35s.gguf > /tmp/s2.txt 2>&1 &
P2=$!
wait $P1 $P2; st "written"
for m in q3u q35s; do
  for f in "" "--fuse no-router-topk" "--fuse no-moe-norm"; do
    b "$m BASE $f" $BE --model /dev/shm/m/$m.gguf --prompt 512 --gen 128 --reps 2 $f
    b "$m NEW $f" $E --model /dev/shm/m/$m.gguf --prompt 512 --gen 128 --reps 2 $f
    b "$m NEW1 $f" $N1 --model /dev/shm/m/$m.gguf --prompt 512 --gen 128 --reps 2 $f
  done
done
for m in q3u q35s; do
  b "$m BASE" $BE --model /dev/shm/m/$m.gguf --prompt 512 --gen 128 --reps 2
  b "$m NEW" $E --model /dev/shm/m/$m.gguf --prompt 512 --gen 128 --reps 2
done
ncu_ours() { # label, binary, model
  [ $(( $(date +%s) - T0 )) -gt 330 ] && return
  timeout 80 ncu --graph-profiling node --launch-skip 9000 --launch-count 200 --metrics gpu__time_duration.sum --csv \
    $2 bench --model /dev/shm/m/$3.gguf --gpu 0 --prompt 512 --gen 48 --reps 1 --no-expert-profile > $OUT/ncu-$3-$1.csv 2>/dev/null
  st "ncu $1 $3 rc=$?"
}
ncu_ours new $E q3u; ncu_ours base $BE q3u; ncu_ours new $E q35s
while [ ! -e /tmp/lcb/build.done ] && [ ! -e /tmp/lcb/build.failed ]; do sleep 2; [ $(( $(date +%s) - T0 )) -gt 420 ] && break; done
st "llama build: $(ls /tmp/lcb/build.* 2>/dev/null) $(cat /tmp/lcb/build_time.txt 2>/dev/null)"
for m in q3u q35s; do timeout 60 $LB -m /dev/shm/m/$m.gguf -ngl 99 -fa 1 -p 512 -n 128 -r 2 -o md 2>&1 | grep -E "pp|tg|error" >> $S; done
st llama-full-done
for m in q3u q35s; do
  [ $(( $(date +%s) - T0 )) -gt 520 ] && break
  timeout 70 ncu --graph-profiling node --launch-skip 9000 --launch-count 200 --metrics gpu__time_duration.sum --csv \
    $LB -m /dev/shm/m/$m.gguf -ngl 99 -fa 1 -p 0 -d 512 -n 48 -r 1 > $OUT/ncu-$m-llama.csv 2>/dev/null
  st "ncu llama $m rc=$?"
done
cat $S
