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
# Call 2 (the same warm machine: /tmp/bin, /dev/shm/m and llama.cpp's build from call 1):
# llama.cpp on the same files (every layer on the card; 8 GB at --n-cpu-moe 34 / 31, the earlier scans),
# its peak checked by nvidia-smi; then ours at 8 GB: the prefetch's identity there and off / ahead
# alternating (the build is done by then, so the CPU share has the host to itself).
set -u
OUT=$DEVOUT; export POLY_KERNEL_CACHE=/tmp/pkc
E=/tmp/bin/poly-engine; T0=$(date +%s)
S=$OUT/stay2.txt
st() { echo "[$(( $(date +%s) - T0 )) s] $*" >> $S; }
[ -x /tmp/bin/poly-engine ] || { st "no /tmp/bin: a fresh machine"; exit 1; }
while [ ! -e /tmp/lcb/build.done ] && [ ! -e /tmp/lcb/build.failed ]; do sleep 2; [ $(( $(date +%s) - T0 )) -gt 300 ] && break; done
st "llama.cpp: $(tail -1 /tmp/lcb/llama_build.txt)"
LB=/tmp/lcb/build/bin/llama-bench
peak() { # runs "$@" while sampling nvidia-smi's used memory; prints the peak
  local mx=0 u; "$@" & local p=$!
  while kill -0 $p 2>/dev/null; do u=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1); [ "$u" -gt "$mx" ] && mx=$u; sleep 0.2; done
  wait $p; echo "peak $mx MiB" >> $S
}
for m in q3u q35s; do timeout 90 $LB -m /dev/shm/m/$m.gguf -ngl 99 -fa 1 -p 512 -n 128 -r 2 -o md 2>&1 | grep -E "pp|tg|error" >> $S; st "llama $m full"; done
peak timeout 90 $LB -m /dev/shm/m/q3u.gguf -ngl 99 --n-cpu-moe 34 -fa 1 -p 0 -n 64 -r 2 -o md > /tmp/l1.txt 2>&1; grep -E "tg|error" /tmp/l1.txt >> $S
peak timeout 90 $LB -m /dev/shm/m/q35s.gguf -ngl 99 --n-cpu-moe 31 -fa 1 -p 0 -n 64 -r 2 -o md > /tmp/l2.txt 2>&1; grep -E "tg|error" /tmp/l2.txt >> $S
st "llama done"
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); RES=$(( TOTAL - 8192 ))
b() { # label, args
  local l=$1; shift
  timeout 90 $E bench --gpu 0 "$@" > /tmp/b.json 2>/tmp/b.err
  st "$l: $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(" | ".join("%s%d %.1f (%s)" % (k, d[k]["n_tokens"], d[k]["avg_ts"], ", ".join("%.1f" % x for x in d[k]["samples_ts"])) for k in ("pp","tg") if k in d), "| vram share %.3f" % ((d.get("experts") or {}).get("vram_share") or 0))' /tmp/b.json 2>&1 | tail -1)"
}
for p in off ahead; do
  timeout 90 $E run --model /dev/shm/m/q3u.gguf --gpu 0 --vram-reserve-mib $RES --no-expert-profile --prompt-tokens 1,2,3,4,5,6,7,8,9,10 --max-tokens 48 --top 4 --json --gpu-prefetch $p > /tmp/run8-$p.json 2>/dev/null
done
st "identity q3u 8gb: ahead $(cmp -s /tmp/run8-off.json /tmp/run8-ahead.json && echo equal || echo DIFFERS)"
for m in q3u q35s; do for p in off ahead off ahead; do b "$m 8GB $p" --model /dev/shm/m/$m.gguf --vram-reserve-mib $RES --prompt 0 --gen 64 --reps 2 --no-expert-profile --gpu-prefetch $p; done; done
for m in q3u q35s; do peak timeout 90 $E bench --gpu 0 --model /dev/shm/m/$m.gguf --vram-reserve-mib $RES --prompt 0 --gen 64 --reps 2 --no-expert-profile > /tmp/b.json 2>/dev/null; st "ours $m 8GB off tg64 (peak above) $(python3 -c 'import json; d=json.load(open("/tmp/b.json")); print(d["tg"]["avg_ts"])' 2>&1 | tail -1)"; done
st done
