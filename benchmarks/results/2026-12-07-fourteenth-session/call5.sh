#!/bin/bash
# Fourteenth session, call 5 (a fresh machine): call 4 found the answer after a 2,000-token prompt that
# borrowed the cache's slots 4-6 points lower in VRAM share whatever the slots were filled with (before,
# now, resident), so not the refill's choice: the refill reset the admission scores. This build keeps them
# across a resize (CachePolicy::history). Server (polystrata benchmark: 40-token chat, 2,000-token prompt,
# 128 answer tokens, context 34,000, 8 GB) with the budget keeping a 512-token call's scratch (default here)
# against `--scratch-tokens 2048` (before), q35s then q3u; `--lend-refill resident` once. A bench first
# compiles the kernel modules (the server's engine runs with a clean environment: its own cache).
set -u
OUT=$DEVOUT; S=$OUT/call5.txt; T0=$(date +%s); . .carry/s14/common.sh
R=/tmp/r; mkdir -p $R /tmp/bin /dev/shm/m
tar xJf $C/bin3.tar.xz -C /tmp/bin
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> $S
lscpu | grep -E "^(Model name|L3)" >> $S
$E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35s.gguf > /tmp/s2.txt 2>&1 &
P2=$!
$E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 0 --out /dev/shm/m/q3u.gguf > /tmp/s1.txt 2>&1 &
P1=$!
wait $P2
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); RES=$(( TOTAL - 8192 ))
env -u POLY_KERNEL_CACHE timeout 200 $E bench --gpu 0 --model /dev/shm/m/q35s.gguf --vram-reserve-mib $RES --no-expert-profile --prompt 64 --gen 8 --reps 1 > /dev/null 2>&1
st "compiled: rc=$?"
smi_start() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > $R/vram.txt 2>/dev/null & SMI=$!; }
smi_stop() { kill $SMI 2>/dev/null; wait $SMI 2>/dev/null; st "  peak $(sort -n $R/vram.txt | tail -1) MiB"; }
H=/tmp/home; mkdir -p $H
server() { # model, label, extra engine args (JSON list items)
  local m=$1 l=$2 x=$3
  [ $(( $(date +%s) - T0 )) -gt 230 ] && return
  cat > $H/strata-$m-$l.json <<J
{"exe": "$E", "args": ["--model", "/dev/shm/m/$m.gguf", "--max-context", "34000", "--gpu", "0", "--vram-reserve-mib", "$RES", "--no-expert-profile"$x], "tokenizer": "packs/$m/tokenizer", "model_name": "$m-$l"}
J
  smi_start
  timeout 60 /tmp/bin/polystrata benchmark --home $H --model $m-$l --prompt-tokens 2000 --answer-tokens 128 --runs 1 > $OUT/server-$m-$l.txt 2> $R/server-$m-$l.err
  st "server $m $l rc=$?"; smi_stop
  grep -E "^(short|long)" $OUT/server-$m-$l.txt >> $S
}
/tmp/bin/polystrata tokenizer --gguf /dev/shm/m/q35s.gguf --out $H/packs/q35s/tokenizer > /dev/null 2>&1
server q35s new ""
server q35s old ', "--scratch-tokens", "2048"'
wait $P1
/tmp/bin/polystrata tokenizer --gguf /dev/shm/m/q3u.gguf --out $H/packs/q3u/tokenizer > /dev/null 2>&1
server q3u new ""
server q3u old ', "--scratch-tokens", "2048"'
server q35s resident ', "--lend-refill", "resident"'
st done
cat $S
