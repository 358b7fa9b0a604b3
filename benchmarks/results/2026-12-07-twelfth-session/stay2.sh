#!/bin/bash
# Twelfth session, call 2 (the machine of call 1, still warm: /tmp/bin, /dev/shm/m and llama.cpp's build
# kept): through the server at 8 GB (prompts of 8,000 and 30,000 tokens, with the row loop as before and
# unrolled by $UNROLL), llama.cpp's 30,000-token prompts at 8 GB with nvidia-smi's peak (the eleventh
# session's stays did not reach them), and the server with every weight in VRAM.
#   there: DEVOUT=$OUT UNROLL=2 bash benchmarks/results/2026-12-07-twelfth-session/stay2.sh
set -u
OUT=$DEVOUT; export POLY_KERNEL_CACHE=/tmp/pkc POLY_ENGINE_BIN=/tmp/bin/poly-engine
mkdir -p /tmp/bin; tar xJf .carry/s12p/polystrata.tar.xz -C /tmp/bin
C=.carry/s12; T0=$(date +%s); S=$OUT/stay2.txt
st() { echo "[$(( $(date +%s) - T0 )) s] $*" >> $S; }
W=${WPR:-1}
b() { # label, args: bench at 8 GB
  local l=$1; shift
  timeout 90 /tmp/bin/poly-engine bench --gpu 0 --model /dev/shm/m/$1.gguf --vram-reserve-mib $(( 81559 - 8192 )) --prompt 0 --gen 64 --reps 2 --no-expert-profile "${@:2}" > /tmp/b.json 2>/dev/null
  st "$l: $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("tg64 %.1f (%s)" % (d["tg"]["avg_ts"], ", ".join("%.1f" % x for x in d["tg"]["samples_ts"])))' /tmp/b.json 2>&1 | tail -1)"
}
for r in 1 2; do for m in q3u q35s; do b "$m 8GB default" $m; b "$m 8GB --matvec-warps-per-row $W" $m --matvec-warps-per-row $W; done; done
srv() { # label, then the offload script's environment
  local l=$1; shift
  env "$@" BENCH=0 LEAN=1 FULL=0 SERVER_MODELS="q35s q3u" bash benchmarks/offload_vs_llama.sh $C ours > /dev/null 2>&1
  { echo "== $l"; grep -E "^short|^long|peak VRAM|rc=" $OUT/summary-ours.txt; } >> $S
  st "$l done"
}
srv "8 GB server, row loop as before" SERVER_PROMPTS=8000,30000
srv "8 GB server, --matvec-warps-per-row $W" SERVER_PROMPTS=8000,30000 SERVER_ARGS="\"--matvec-warps-per-row\", \"$W\""
LB=/tmp/lcb/build/bin/llama-bench
for mn in "q35s 31" "q3u 34"; do set -- $mn
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > /tmp/vram.txt 2>/dev/null & SMI=$!
  timeout 150 $LB -m /dev/shm/m/$1.gguf -ngl 99 --n-cpu-moe $2 -fa 1 -p 30000 -n 0 -ub 2048 -b 8192 -r 1 -o md 2>&1 | grep -E "pp|error" >> $S
  kill $SMI; wait $SMI 2>/dev/null
  st "llama $1 pp30000 --n-cpu-moe $2: peak $(sort -n /tmp/vram.txt | tail -1) MiB"
done
srv "every weight in VRAM, server, row loop as before" BUDGET=80000 SERVER_PROMPTS=2000
srv "every weight in VRAM, server, --matvec-warps-per-row $W" BUDGET=80000 SERVER_PROMPTS=2000 SERVER_ARGS="\"--matvec-warps-per-row\", \"$W\""
st done
