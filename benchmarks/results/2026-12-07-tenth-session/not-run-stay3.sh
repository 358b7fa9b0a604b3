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
# Call 3: the eighth session's server A/B (benchmarks/results/2026-12-06-eighth-session/not-run-server-ab.sh) on the warm machine.
# Session 8, stay 3 (one short call): is the server's gap to bench (stay 2) the new copies-ahead defaults?
# q3u through the server with the new defaults and the old ones (--copy-ahead-at sum --copy-ahead 2
# --copy-ahead-us 0), alternating, and bench at the server's context with each.
set -u
export POLY_ENGINE_BIN=/tmp/bin/poly-engine OUT=$DEVOUT RAW=0 POLY_KERNEL_CACHE=/tmp/pkc
C=.carry/s10
[ -x /tmp/bin/poly-engine ] || { mkdir -p /tmp/bin /dev/shm/m && tar xJf $C/bin.tar.xz -C /tmp/bin; }
E=/tmp/bin/poly-engine
[ -e /dev/shm/m/q3u.gguf ] || timeout 90 $E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 0 --measure-routing false --out /dev/shm/m/q3u.gguf > $OUT/synth.txt 2>&1
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); RES=$(( TOTAL - 8192 ))
OLD='"--copy-ahead-at", "sum", "--copy-ahead", "2", "--copy-ahead-us", "0"'
for round in 1 2; do
  for cfg in new old; do
    A=""; [ $cfg = old ] && A="$OLD"
    SERVER_PROMPTS=2000 SERVER_ARGS="$A" BENCH=0 LEAN=1 FULL=0 SERVER_MODELS=q3u bash benchmarks/offload_vs_llama.sh $C ours > /dev/null 2>&1
    { echo "== $cfg round $round"; grep -E "^short|^long" $OUT/summary-ours.txt; } >> $OUT/server-ab.txt
    F=""; [ $cfg = old ] && F="--copy-ahead-at sum --copy-ahead 2 --copy-ahead-us 0"
    timeout 60 $E bench --model /dev/shm/m/q3u.gguf --gpu 0 --vram-reserve-mib $RES --prompt 0 --gen 64 --reps 2 --no-expert-profile --max-context 34000 $F > /tmp/b.json 2>/dev/null
    echo "bench $cfg: $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("tg64 %.1f share %.3f" % (d["tg"]["avg_ts"], d["experts"]["vram_share"]))' /tmp/b.json 2>&1)" >> $OUT/server-ab.txt
  done
done
rm -f $OUT/server-*.err $OUT/server-q3u-*.txt $OUT/summary-ours.txt
