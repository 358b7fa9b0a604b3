#!/bin/bash
# (`--matvec-unroll` existed in the binaries of this stay only: measured slower, it was taken out after.)
# Twelfth session, call 1 on a fresh machine: 57c5908's conv1d order on the card (cuda_layer_ops), the
# one-token matvec's row loop unrolled (`--matvec-unroll 1|2|4`; its weights read as global loads) checked
# (greedy answers with logprobs equal across the settings and against the binary before) and measured
# against the binary before (poly-engine-base = 3f908f9), every weight in VRAM and at 8 GB, alternating;
# llama.cpp built in the background (nice 19) and run on the same files at the end.
#   here:  BASE=/tmp/base12/poly-engine TESTS="gpu_forward cuda_layer_ops" NO_LLAMA=1 \
#            bash benchmarks/make_gpu_carry.sh .carry/s12; cp .carry/s11/llama.cpp.tar.xz .carry/s12/
#   there: DEVOUT=$OUT bash benchmarks/results/2026-12-07-twelfth-session/stay1.sh
set -u
OUT=$DEVOUT; export POLY_KERNEL_CACHE=/tmp/pkc
C=.carry/s12; E=/tmp/bin/poly-engine; BE=/tmp/bin/poly-engine-base; T0=$(date +%s)
S=$OUT/stay1.txt
st() { echo "[$(( $(date +%s) - T0 )) s] $*" >> $S; }
mkdir -p /tmp/bin /dev/shm/m /tmp/lsrc /tmp/lcb
for a in $C/bin.tar.xz $C/parts/*.tar.xz; do [ -e $a ] && tar xJf $a -C /tmp/bin; done
tar xJf $C/llama.cpp.tar.xz -C /tmp/lsrc
setsid nice -n 19 bash $C/llamacpp_build_cuda.sh /tmp/lsrc/llama.cpp /tmp/lcb/build /tmp/lcb > /tmp/lcb/llama_build.txt 2>&1 < /dev/null &
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> $S
lscpu | grep -E "^(Model name|L3)" >> $S
$E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 0 --out /dev/shm/m/q3u.gguf > /tmp/s1.txt 2>&1 &
P1=$!
$E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35s.gguf > /tmp/s2.txt 2>&1 &
P2=$!
for t in cuda_layer_ops gpu_forward; do
  timeout 150 /tmp/bin/$t --test-threads 1 > $OUT/test-$t.txt 2>&1
  st "$t rc=$?: $(grep -E '^test result' $OUT/test-$t.txt | tail -1) $(grep -E '^test .*FAILED$' $OUT/test-$t.txt | head -5 | tr '\n' ' ')"
done
b() { # label, binary, args
  local l=$1 x=$2; shift 2
  timeout 90 $x bench --gpu 0 "$@" > /tmp/b.json 2>/tmp/b.err
  st "$l: $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(" | ".join("%s%d %.1f (%s)" % (k, d[k]["n_tokens"], d[k]["avg_ts"], ", ".join("%.1f" % x for x in d[k]["samples_ts"])) for k in ("pp","tg") if k in d), "| vram share %.3f" % ((d.get("experts") or {}).get("vram_share") or 0))' /tmp/b.json 2>&1 | tail -1)"
  grep -iE "error|panick" /tmp/b.err | head -3 >> $S
}
run() { # binary, model, out, args: greedy answer with the 4 likeliest tokens' logprobs
  local x=$1 m=$2 o=$3; shift 3
  timeout 90 $x run --model /dev/shm/m/$m.gguf --gpu 0 --no-expert-profile --prompt-tokens 11,12,13,14,15,16,17,18,19,20 --max-tokens 48 --top 4 --json "$@" > $o 2>$o.err
}
ident() { # model, label, extra args: base, unroll 1, 2, 4 and unroll 4 with one warp a row
  local m=$1 l=$2; shift 2
  run $BE $m /tmp/r-base.json "$@"
  run $E $m /tmp/r-u1.json "$@"
  run $E $m /tmp/r-u2.json "$@" --matvec-unroll 2
  run $E $m /tmp/r-u4.json "$@" --matvec-unroll 4
  run $E $m /tmp/r-u4w1.json "$@" --matvec-unroll 4 --matvec-warps-per-row 1
  local r=""
  for v in u1 u2 u4 u4w1; do cmp -s /tmp/r-base.json /tmp/r-$v.json && r="$r $v=base" || { r="$r $v!=base"; cp /tmp/r-$v.json $OUT/ident-$m-$l-$v.json; }; done
  cmp -s /tmp/r-u4w1.json /tmp/r-u1.json && r="$r u4w1=u1" || r="$r u4w1!=u1"
  st "identity $m $l ($(wc -l < /tmp/r-base.json) lines):$r; errors $(cat /tmp/r-*.json.err | grep -ciE 'error|panick')"
  cp /tmp/r-base.json $OUT/ident-$m-$l-base.json
}
wait $P1; st "q3u written: $(grep -E 'routing measured' /tmp/s1.txt | head -1)"
wait $P2; st "q35s written: $(grep -E 'routing measured' /tmp/s2.txt | head -1)"
ident q3u full
ident q35s full
V=("BASE" "u1" "u2 --matvec-unroll 2" "u4 --matvec-unroll 4" "u4w1 --matvec-unroll 4 --matvec-warps-per-row 1")
for r in 1 2; do for m in q3u q35s; do for v in "${V[@]}"; do
  set -- $v; l=$1; shift
  if [ $l = BASE ]; then b "$m full $l" $BE --model /dev/shm/m/$m.gguf --prompt 512 --gen 128 --reps 2
  else b "$m full $l" $E --model /dev/shm/m/$m.gguf --prompt 512 --gen 128 --reps 2 "$@"; fi
done; done; done
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); RES=$(( TOTAL - 8192 ))
ident q35s 8gb --vram-reserve-mib $RES
for r in 1 2; do for m in q3u q35s; do for v in "BASE" "u1" "u2 --matvec-unroll 2" "u4 --matvec-unroll 4"; do
  set -- $v; l=$1; shift
  if [ $l = BASE ]; then b "$m 8GB $l" $BE --model /dev/shm/m/$m.gguf --vram-reserve-mib $RES --prompt 0 --gen 64 --reps 2 --no-expert-profile
  else b "$m 8GB $l" $E --model /dev/shm/m/$m.gguf --vram-reserve-mib $RES --prompt 0 --gen 64 --reps 2 --no-expert-profile "$@"; fi
done; done; done
while [ ! -e /tmp/lcb/build.done ] && [ ! -e /tmp/lcb/build.failed ]; do sleep 2; [ $(( $(date +%s) - T0 )) -gt 470 ] && break; done
st "llama.cpp: $(tail -1 /tmp/lcb/llama_build.txt)"
LB=/tmp/lcb/build/bin/llama-bench
for m in q3u q35s; do timeout 60 $LB -m /dev/shm/m/$m.gguf -ngl 99 -fa 1 -p 512 -n 128 -r 2 -o md 2>&1 | grep -E "pp|tg|error" >> $S; st "llama $m full"; done
timeout 40 $LB -m /dev/shm/m/q3u.gguf -ngl 99 --n-cpu-moe 28 -fa 1 -p 0 -n 64 -r 2 -o md 2>&1 | grep -E "tg|error" >> $S
timeout 40 $LB -m /dev/shm/m/q35s.gguf -ngl 99 --n-cpu-moe 26 -fa 1 -p 0 -n 64 -r 2 -o md 2>&1 | grep -E "tg|error" >> $S
st done
