#!/bin/bash
# NOT RUN: the tenth session's device time (1,800 s) went to 17 asks between 04:08 and 05:35 UTC, none of
# which got a machine (H100 and H200 alike: "no device machine could be started"), like the ninth session's.
# The next stay, back to back on one warm machine (repository root on the device):
#   here:  TESTS="gpu_forward cuda_ops" NO_LLAMA=1 bash benchmarks/make_gpu_carry.sh .carry/s10 (from the
#          commit to measure: --gpu-prefetch defaults to off there), llama.cpp's source in
#          .carry/s10/src/llama.cpp.tar.xz (tar cJf of .carry/llama.cpp), these scripts copied into
#          .carry/s10/, then bash benchmarks/device_lean.sh on (off again before any commit)
#   there: DEVOUT=$OUT bash .carry/s10/stay1.sh, then stay2.sh, then stay3.sh (each call's results are
#          appended as they come, so a cut call still brings back what ran)
# Call 1 (about 500 s; every line appended to $OUT/stay1.txt as it comes): llama.cpp's build in the
# background at the lowest priority (setsid: it outlives the call while the machine stays warm; the runs
# here are the card's, every weight in VRAM); q3u and q35s written; the prefetch is a hint (greedy answers
# with ahead and own equal off's, logprobs included); every weight in VRAM, off / ahead / own alternating.
# The 8 GB runs, whose CPU share the build would slow, are call 2's.
set -u
OUT=$DEVOUT; export POLY_KERNEL_CACHE=/tmp/pkc
C=.carry/s10; E=/tmp/bin/poly-engine; T0=$(date +%s)
mkdir -p /tmp/bin /dev/shm/m /tmp/lsrc /tmp/lcb && tar xJf $C/bin.tar.xz -C /tmp/bin

tar xJf $C/src/llama.cpp.tar.xz -C /tmp/lsrc
setsid nice -n 19 bash $C/llamacpp_build_cuda.sh /tmp/lsrc/llama.cpp /tmp/lcb/build /tmp/lcb > /tmp/lcb/llama_build.txt 2>&1 < /dev/null &
S=$OUT/stay1.txt
st() { echo "[$(( $(date +%s) - T0 )) s] $*" >> $S; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> $S
lscpu | grep -E "^(Model name|L3)" >> $S
$E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 0 --out /dev/shm/m/q3u.gguf > /tmp/s1.txt 2>&1 &
P1=$!
$E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35s.gguf > /tmp/s2.txt 2>&1 &
P2=$!
b() { # label, args
  local l=$1; shift
  timeout 90 $E bench --gpu 0 "$@" > /tmp/b.json 2>/tmp/b.err
  st "$l: $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(" | ".join("%s%d %.1f (%s)" % (k, d[k]["n_tokens"], d[k]["avg_ts"], ", ".join("%.1f" % x for x in d[k]["samples_ts"])) for k in ("pp","tg") if k in d), "| vram share %.3f" % ((d.get("experts") or {}).get("vram_share") or 0))' /tmp/b.json 2>&1 | tail -1)"
  grep -iE "error|panick" /tmp/b.err | head -3 >> $S
}
ident() { # model, label, extra args...: off vs ahead vs own greedy answers, logprobs included
  local m=$1 l=$2; shift 2
  for p in off ahead own; do
    timeout 90 $E run --model /dev/shm/m/$m.gguf --gpu 0 "$@" --no-expert-profile --prompt-tokens 1,2,3,4,5,6,7,8,9,10 --max-tokens 48 --top 4 --json --gpu-prefetch $p > /tmp/run-$p.json 2>/tmp/run-$p.err
  done
  cp /tmp/run-off.json $OUT/run-$m-$l-off.json
  st "identity $m $l: ahead $(cmp -s /tmp/run-off.json /tmp/run-ahead.json && echo equal || echo DIFFERS), own $(cmp -s /tmp/run-off.json /tmp/run-own.json && echo equal || echo DIFFERS) ($(wc -l < /tmp/run-off.json) lines; $(grep -ciE 'error|panick' /tmp/run-ahead.err /tmp/run-own.err | tr '\n' ' '))"
  cmp -s /tmp/run-off.json /tmp/run-ahead.json || cp /tmp/run-ahead.json $OUT/run-$m-$l-ahead.json
  cmp -s /tmp/run-off.json /tmp/run-own.json || cp /tmp/run-own.json $OUT/run-$m-$l-own.json
}
wait $P1; st "q3u written: $(grep -E 'routing|skew' /tmp/s1.txt | head -2 | tr '\n' ' ')"
ident q3u full
for p in off ahead own; do b "q3u full $p" --model /dev/shm/m/q3u.gguf --prompt 512 --gen 128 --reps 2 --gpu-prefetch $p; done
wait $P2; st "q35s written: $(grep -E 'routing|skew' /tmp/s2.txt | head -2 | tr '\n' ' ')"
ident q35s full
for p in off ahead own; do b "q35s full $p" --model /dev/shm/m/q35s.gguf --prompt 512 --gen 128 --reps 2 --gpu-prefetch $p; done
for m in q3u q35s; do for p in ahead off own; do b "$m full $p" --model /dev/shm/m/$m.gguf --prompt 512 --gen 128 --reps 2 --gpu-prefetch $p; done; done
st done
