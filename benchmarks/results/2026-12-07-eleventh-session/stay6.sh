#!/bin/bash
# Eleventh session, one call on a fresh machine: the three launch fusions (norm-rope-pair, attn-q8,
# moe-norm) checked (their kernel tests, gpu_forward, greedy answers equal with them off) and measured
# against the same binary with them off, alternating, every weight in VRAM and at 8 GB, and llama.cpp
# built in the background (nice 19) and run on the same files at the end.
set -u
OUT=$DEVOUT; export POLY_KERNEL_CACHE=/tmp/pkc
C=.carry/s11; E=/tmp/bin/poly-engine; T0=$(date +%s)
OLD="--fuse no-norm-rope-pair,no-attn-q8,no-moe-norm"
S=$OUT/stay.txt
st() { echo "[$(( $(date +%s) - T0 )) s] $*" >> $S; }
mkdir -p /tmp/bin /dev/shm/m /tmp/lsrc /tmp/lcb && for a in $C/parts/*.tar.xz; do tar xJf $a -C /tmp/bin; done
tar xJf $C/llama.cpp.tar.xz -C /tmp/lsrc
setsid nice -n 19 bash $C/llamacpp_build_cuda.sh /tmp/lsrc/llama.cpp /tmp/lcb/build /tmp/lcb > /tmp/lcb/llama_build.txt 2>&1 < /dev/null &
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> $S
lscpu | grep -E "^(Model name|L3)" >> $S
$E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 0 --out /dev/shm/m/q3u.gguf > /tmp/s1.txt 2>&1 &
P1=$!
$E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35s.gguf > /tmp/s2.txt 2>&1 &
P2=$!
for t in cuda_fused cuda_layer_ops; do
  timeout 150 /tmp/bin/$t --test-threads 1 > $OUT/test-$t.txt 2>&1
  st "$t rc=$?: $(grep -E '^test result' $OUT/test-$t.txt | tail -1) $(grep -E '^test .*FAILED$' $OUT/test-$t.txt | head -5 | tr '\n' ' ')"
done
b() { # label, args
  local l=$1; shift
  timeout 90 $E bench --gpu 0 "$@" > /tmp/b.json 2>/tmp/b.err
  st "$l: $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(" | ".join("%s%d %.1f (%s)" % (k, d[k]["n_tokens"], d[k]["avg_ts"], ", ".join("%.1f" % x for x in d[k]["samples_ts"])) for k in ("pp","tg") if k in d), "| vram share %.3f" % ((d.get("experts") or {}).get("vram_share") or 0))' /tmp/b.json 2>&1 | tail -1)"
  grep -iE "error|panick" /tmp/b.err | head -3 >> $S
}
ident() { # model, label, extra args: greedy answers (logprobs too) with the fusions on and off
  local m=$1 l=$2; shift 2
  timeout 90 $E run --model /dev/shm/m/$m.gguf --gpu 0 "$@" --no-expert-profile --prompt-tokens 11,12,13,14,15,16,17,18,19,20 --max-tokens 48 --top 4 --json > /tmp/run-new.json 2>/tmp/run-new.err
  timeout 90 $E run --model /dev/shm/m/$m.gguf --gpu 0 "$@" --no-expert-profile --prompt-tokens 11,12,13,14,15,16,17,18,19,20 --max-tokens 48 --top 4 --json $OLD > /tmp/run-old.json 2>/tmp/run-old.err
  st "identity $m $l: new $(cmp -s /tmp/run-old.json /tmp/run-new.json && echo EQUALS || echo DIFFERS FROM) old ($(wc -l < /tmp/run-new.json) / $(wc -l < /tmp/run-old.json) lines; errors $(grep -ciE 'error|panick' /tmp/run-new.err /tmp/run-old.err | tr '\n' ' '))"
  cmp -s /tmp/run-old.json /tmp/run-new.json || cp /tmp/run-new.json /tmp/run-old.json /tmp/run-new.err $OUT/ 2>/dev/null
}
wait $P1; st "q3u written: $(grep -E 'routing' /tmp/s1.txt | head -2 | tr '\n' ' ')"
wait $P2; st "q35s written: $(grep -E 'routing' /tmp/s2.txt | head -2 | tr '\n' ' ')"
ident q3u full
ident q35s full
for r in 1 2; do for m in q3u q35s; do
  b "$m full NEW" --model /dev/shm/m/$m.gguf --prompt 512 --gen 128 --reps 2
  b "$m full OLD" --model /dev/shm/m/$m.gguf --prompt 512 --gen 128 --reps 2 $OLD
done; done
timeout 120 /tmp/bin/gpu_forward --test-threads 1 > $OUT/test-gpu_forward.txt 2>&1
st "gpu_forward rc=$?: $(grep -E '^test result' $OUT/test-gpu_forward.txt | tail -1) $(grep -E '^test .*FAILED$' $OUT/test-gpu_forward.txt | head -5 | tr '\n' ' ')"
while [ ! -e /tmp/lcb/build.done ] && [ ! -e /tmp/lcb/build.failed ]; do sleep 2; [ $(( $(date +%s) - T0 )) -gt 420 ] && break; done
st "llama.cpp: $(tail -1 /tmp/lcb/llama_build.txt)"
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); RES=$(( TOTAL - 8192 ))
ident q35s 8gb --vram-reserve-mib $RES
for m in q3u q35s; do for p in NEW OLD NEW OLD; do A=""; [ $p = OLD ] && A=$OLD
  b "$m 8GB $p" --model /dev/shm/m/$m.gguf --vram-reserve-mib $RES --prompt 0 --gen 64 --reps 2 --no-expert-profile $A
done; done
LB=/tmp/lcb/build/bin/llama-bench
for m in q3u q35s; do timeout 60 $LB -m /dev/shm/m/$m.gguf -ngl 99 -fa 1 -p 512 -n 128 -r 2 -o md 2>&1 | grep -E "pp|tg|error" >> $S; st "llama $m full"; done
timeout 40 $LB -m /dev/shm/m/q3u.gguf -ngl 99 --n-cpu-moe 28 -fa 1 -p 0 -n 64 -r 2 -o md 2>&1 | grep -E "tg|error" >> $S
timeout 40 $LB -m /dev/shm/m/q35s.gguf -ngl 99 --n-cpu-moe 26 -fa 1 -p 0 -n 64 -r 2 -o md 2>&1 | grep -E "tg|error" >> $S
st done
