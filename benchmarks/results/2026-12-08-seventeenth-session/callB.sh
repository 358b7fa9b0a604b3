#!/bin/bash
# Seventeenth session, call B (right after call A, on its machine): every weight in VRAM, ours with 64 and
# 128 attention rows against llama.cpp (built in the background since call A) on the same files; then where
# q3u's 30,000-token prompt at 8 GB spends its time (POLY_GPU_PROFILE=2, calls of 8,192 as the server reads).
#   there: DEVOUT=$OUT bash .carry/s17/callB.sh
set -u
OUT=$DEVOUT; S=$OUT/callB.txt; T0=$(date +%s); C=.carry/s17; . benchmarks/device_helpers.sh
R=/tmp/r; mkdir -p $R
for m in q3u q35s; do for r in 64 128; do
  b "$m full r$r pp8192" $E --model /dev/shm/m/$m.gguf --no-expert-profile --prompt 8192 --gen 0 --reps 1 --fa-rows $r
  b "$m full r$r pp512 tg128" $E --model /dev/shm/m/$m.gguf --no-expert-profile --prompt 512 --gen 128 --reps 2 --fa-rows $r
done; done
while [ ! -e /tmp/lcb/build.done ] && [ ! -e /tmp/lcb/build.failed ]; do sleep 2; [ $(( $(date +%s) - T0 )) -gt 400 ] && break; done
st "llama build: $(ls /tmp/lcb/build.* 2>/dev/null) $(cat /tmp/lcb/build_time.txt 2>/dev/null)"
if [ -e /tmp/lcb/build.done ]; then
  for m in q3u q35s; do
    [ $(( $(date +%s) - T0 )) -gt 500 ] && break
    timeout 100 $LB -m /dev/shm/m/$m.gguf -ngl 99 -fa 1 -p 512,8192 -n 128 -r 2 -o md 2>&1 | grep -E "pp|tg|error" >> $S
  done
else tail -20 /tmp/lcb/llama_build.txt >> $S; fi
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); RES=$(( TOTAL - 8192 ))
if [ -e /tmp/lcb/build.done ] && [ $(( $(date +%s) - T0 )) -lt 420 ]; then # llama.cpp's q3u 30,000 at 8 GB
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > $R/vram.txt 2>/dev/null & SMI=$!
  timeout 100 $LB -m /dev/shm/m/q3u.gguf -ngl 99 --n-cpu-moe 40 -fa 1 -p 30000 -n 0 -ub 2048 -b 8192 -r 1 -o md 2>&1 | grep -E "pp|error" >> $S
  kill $SMI; wait $SMI 2>/dev/null; st "  peak $(sort -n $R/vram.txt | tail -1) MiB"
fi
if [ $(( $(date +%s) - T0 )) -lt 480 ]; then
POLY_GPU_PROFILE=2 timeout 100 $E bench --gpu 0 --model /dev/shm/m/q3u.gguf --no-expert-profile --max-context 34000 \
  --vram-reserve-mib $RES --prompt 30000 --gen 0 --reps 1 --ubatch 8192 > $R/prof.json 2> $OUT/prof-q3u-30000.txt
st "profile rc=$? $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["pp"]["avg_ts"])' $R/prof.json 2>&1 | tail -1)"
tail -40 $OUT/prof-q3u-30000.txt >> $S
fi
st done
pack_out
cat $S
