#!/bin/bash
# Sixteenth session, call 2 (right after call 1, on its machine; a fresh machine does call 1's preparation
# first): llama.cpp, once its build is done, against ours on the same files on a quiet host.
#   every weight in VRAM: llama-bench -ngl 99 -fa 1 -p 512 -n 128 -r 2 (ours ran in call 1);
#   at 8 GB: llama.cpp tg64 at --n-cpu-moe 28 (q3u) / 26 (q35s), ours bench tg64 at the server's context
#   (34,000) and reserve total - 8,192, two rounds alternating; llama.cpp's prompts of 8,000 (34 / 31) and
#   30,000 (40 / 33) tokens (ours went through the server in call 1); each with its nvidia-smi peak.
#   there: DEVOUT=$OUT bash .carry/s16/call2.sh
set -u
OUT=$DEVOUT; S=$OUT/call2.txt; T0=$(date +%s); . .carry/s16/common.sh
R=/tmp/r; mkdir -p $R
if [ ! -x $E ]; then # a fresh machine
  mkdir -p /tmp/bin /dev/shm/m /tmp/lsrc /tmp/lcb $POLY_KERNEL_CACHE
  tar xJf $C/bin.tar.xz -C /tmp/bin && tar xJf /tmp/bin/kc.tar.xz -C $POLY_KERNEL_CACHE
  st "fresh machine"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> $S
  tar xJf $C/llama.cpp.tar.xz -C /tmp/lsrc
  setsid nice -n 19 bash $C/llamacpp_build_cuda.sh /tmp/lsrc/llama.cpp /tmp/lcb/build /tmp/lcb > /tmp/lcb/llama_build.txt 2>&1 < /dev/null &
  $E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 0 --out /dev/shm/m/q3u.gguf > /tmp/s1.txt 2>&1 &
  $E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35s.gguf > /tmp/s2.txt 2>&1
  wait
fi
while [ ! -e /tmp/lcb/build.done ] && [ ! -e /tmp/lcb/build.failed ]; do sleep 2; [ $(( $(date +%s) - T0 )) -gt 420 ] && break; done
st "llama build: $(ls /tmp/lcb/build.* 2>/dev/null) $(cat /tmp/lcb/build_time.txt 2>/dev/null)"
[ -e /tmp/lcb/build.done ] || { tail -20 /tmp/lcb/llama_build.txt >> $S; cat $S; exit 1; }
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); RES=$(( TOTAL - 8192 ))
smi_start() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > $R/vram.txt 2>/dev/null & SMI=$!; }
smi_stop() { kill $SMI 2>/dev/null; wait $SMI 2>/dev/null; st "  peak $(sort -n $R/vram.txt | tail -1) MiB"; }
ll() { # model, n-cpu-moe (or "" for every weight on the card), llama-bench args
  local m=$1 n=$2; shift 2
  [ $(( $(date +%s) - T0 )) -gt 560 ] && return
  smi_start
  timeout 90 $LB -m /dev/shm/m/$m.gguf -ngl 99 ${n:+--n-cpu-moe $n} -fa 1 "$@" -o md 2>&1 | grep -E "pp|tg|error" >> $S
  smi_stop
}
ours8() { # model
  [ $(( $(date +%s) - T0 )) -gt 560 ] && return
  smi_start
  b "$1 8GB tg64 ctx 34000" $E --model /dev/shm/m/$1.gguf --vram-reserve-mib $RES --prompt 0 --gen 64 --reps 2 --no-expert-profile --max-context 34000
  smi_stop
}
for m in q3u q35s; do ll $m "" -p 512 -n 128 -r 2; done
for r in 1 2; do
  ll q3u 28 -p 0 -n 64 -r 2; ours8 q3u
  ll q35s 26 -p 0 -n 64 -r 2; ours8 q35s
done
ll q35s 31 -p 8000 -n 0 -ub 2048 -b 8192 -r 1
ll q3u 34 -p 8000 -n 0 -ub 2048 -b 8192 -r 1
ll q35s 33 -p 30000 -n 0 -ub 2048 -b 8192 -r 1
ll q3u 40 -p 30000 -n 0 -ub 2048 -b 8192 -r 1
st done
cat $S
