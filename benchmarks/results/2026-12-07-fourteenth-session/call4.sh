#!/bin/bash
# Fourteenth session, call 4 (a fresh machine): what the cache holds after lending to a prompt's scratch.
# Call 3 (q3u, 8 GB): with the budget keeping a 512-token call's scratch the server's short answer went
# 114.8 -> 120.3 t/s and its 2,000-token prompt 4,147 -> 5,243 t/s, but the answer after that prompt
# 101.3 -> 92.0 (31.1% of routings from VRAM against 33.1%): the slots taken back were filled by the scores
# before the prompt. Here `--lend-refill before` (that), `now` (the scores after the prompt), `resident`
# (the experts held before), and `--scratch-tokens 2048` (the scratch the server kept before), q3u and q35s,
# through polystrata benchmark (40-token chat, 2,000-token prompt, 128 answer tokens, context 34,000),
# this build's default `--attn-heads-per-block 2`; bench tg128 at the same context.
set -u
OUT=$DEVOUT; S=$OUT/call4.txt; T0=$(date +%s); . .carry/s14/common.sh
R=/tmp/r; mkdir -p $R /tmp/bin /dev/shm/m
tar xJf $C/bin3.tar.xz -C /tmp/bin
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> $S
lscpu | grep -E "^(Model name|L3)" >> $S
$E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 0 --out /dev/shm/m/q3u.gguf > /tmp/s1.txt 2>&1 &
P1=$!
$E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35s.gguf > /tmp/s2.txt 2>&1 &
P2=$!
wait $P1 $P2
st "written: q3u $(grep -oE 'top 10%[^(]*' /tmp/s1.txt | head -1); q35s $(grep -oE 'top 10%[^(]*' /tmp/s2.txt | head -1)"
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); RES=$(( TOTAL - 8192 ))
smi_start() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > $R/vram.txt 2>/dev/null & SMI=$!; }
smi_stop() { kill $SMI 2>/dev/null; wait $SMI 2>/dev/null; st "  peak $(sort -n $R/vram.txt | tail -1) MiB"; }
H=/tmp/home; mkdir -p $H
server() { # model, label, extra engine args (JSON list items)
  local m=$1 l=$2 x=$3
  cat > $H/strata-$m-$l.json <<J
{"exe": "$E", "args": ["--model", "/dev/shm/m/$m.gguf", "--max-context", "34000", "--gpu", "0", "--vram-reserve-mib", "$RES", "--no-expert-profile"$x], "tokenizer": "packs/$m/tokenizer", "model_name": "$m-$l"}
J
  smi_start
  timeout 120 /tmp/bin/polystrata benchmark --home $H --model $m-$l --prompt-tokens 2000 --answer-tokens 128 --runs 1 > $OUT/server-$m-$l.txt 2> $R/server-$m-$l.err
  st "server $m $l rc=$?"; smi_stop
  grep -E "^(short|long)" $OUT/server-$m-$l.txt >> $S
  grep -E "expert cache: (lent|took back)" $R/server-$m-$l.err | head -2 | cut -c1-200 >> $S
}
for m in q3u q35s; do
  /tmp/bin/polystrata tokenizer --gguf /dev/shm/m/$m.gguf --out $H/packs/$m/tokenizer > /dev/null 2>&1
  server $m before ""
  server $m now ', "--lend-refill", "now"'
  server $m resident ', "--lend-refill", "resident"'
  server $m old ', "--scratch-tokens", "2048"'
  b "$m 8GB bench tg128" $E --model /dev/shm/m/$m.gguf --vram-reserve-mib $RES --no-expert-profile --max-context 34000 --prompt 0 --gen 128 --reps 2
done
cp $R/server-*.err $OUT/ 2>/dev/null
st done
cat $S
