#!/bin/bash
# Fourteenth session, call 3 (a fresh machine): the server against bench at 8 GB, q3u (the goal: the
# server's answers within 10% of bench's at the same context; the eleventh session measured 4-17% under).
# The budget's scratch: this build keeps a 512-token call's scratch and lets the server's 2,048-token calls
# borrow from the cache (default) against `--scratch-tokens 2048` (the scratch the server's engine kept
# before); both with `--attn-heads-per-block 2` (call 1's pick). polystrata benchmark: a 40-token chat and a
# 2,000-token prompt, 128 answer tokens each, context 34,000; bench tg128 at the same context between.
set -u
OUT=$DEVOUT; S=$OUT/call3.txt; T0=$(date +%s); . .carry/s14/common.sh
R=/tmp/r; mkdir -p $R /tmp/bin /dev/shm/m
tar xJf $C/bin3.tar.xz -C /tmp/bin
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> $S
lscpu | grep -E "^(Model name|L3)" >> $S
$E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 0 --out /dev/shm/m/q3u.gguf > /tmp/s1.txt 2>&1
st "written: q3u $(grep -oE 'top 10%[^(]*' /tmp/s1.txt | head -1)"
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); RES=$(( TOTAL - 8192 ))
smi_start() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > $R/vram.txt 2>/dev/null & SMI=$!; }
smi_stop() { kill $SMI 2>/dev/null; wait $SMI 2>/dev/null; st "  peak $(sort -n $R/vram.txt | tail -1) MiB"; }
H=/tmp/home; mkdir -p $H
/tmp/bin/polystrata tokenizer --gguf /dev/shm/m/q3u.gguf --out $H/packs/q3u/tokenizer > /dev/null 2>&1
server() { # label, extra engine args (JSON list items)
  local l=$1 x=$2
  cat > $H/strata-q3u-$l.json <<J
{"exe": "$E", "args": ["--model", "/dev/shm/m/q3u.gguf", "--max-context", "34000", "--gpu", "0", "--vram-reserve-mib", "$RES", "--no-expert-profile", "--attn-heads-per-block", "2"$x], "tokenizer": "packs/q3u/tokenizer", "model_name": "q3u-$l"}
J
  smi_start
  timeout 150 /tmp/bin/polystrata benchmark --home $H --model q3u-$l --prompt-tokens 2000 --answer-tokens 128 --runs 1 > $OUT/server-q3u-$l.txt 2> $R/server-$l.err
  st "server q3u $l rc=$?"; smi_stop
  grep -E "^(short|long)" $OUT/server-q3u-$l.txt >> $S
  grep -E "expert cache: (lent|took back)" $R/server-$l.err | head -4 >> $S
}
G="--model /dev/shm/m/q3u.gguf --vram-reserve-mib $RES --no-expert-profile --max-context 34000 --attn-heads-per-block 2"
server new ""
b "q3u 8GB bench tg128" $E $G --prompt 0 --gen 128 --reps 2
server old ', "--scratch-tokens", "2048"'
b "q3u 8GB bench tg128" $E $G --prompt 0 --gen 128 --reps 2
[ $(( $(date +%s) - T0 )) -lt 380 ] && server new ""
[ $(( $(date +%s) - T0 )) -lt 470 ] && server old ', "--scratch-tokens", "2048"'
cp $R/server-*.err $OUT/ 2>/dev/null
st done
cat $S
