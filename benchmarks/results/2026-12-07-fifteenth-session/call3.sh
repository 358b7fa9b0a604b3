#!/bin/bash
# Fifteenth session, call 3: the expert cache resized in place (slots given up for a long prompt's scratch
# and taken back move no resident expert over the bus; the pool in allocations of 32 slots). Card tests
# (cuda_slot_pool; gpu_expert_cache whole), then the server at 8 GB as in call 1 (40-token chat, a prompt
# of 2,000 tokens, 128 answer tokens, context 34,000) with `--scratch-tokens 512` against the default (the
# largest call's scratch kept), q35s then q3u, with the lending's log lines.
#   here:  build engine + polystrata + the two test binaries, kernel cache, bin.tar.xz as in call1.sh
#   there: DEVOUT=$OUT bash .carry/s15/call3.sh, or with SHORT=1 in front when little device time is left
#          (only gpu_expert_cache's long_calls_borrow, and q35s through the server)
set -u
SHORT=${SHORT:-0}
OUT=$DEVOUT; S=$OUT/call3.txt; T0=$(date +%s); . .carry/s15/common.sh
R=/tmp/r; mkdir -p $R /tmp/bin /dev/shm/m $POLY_KERNEL_CACHE $HOME/.cache/polystrata/kernels
tar xJf $C/bin.tar.xz -C /tmp/bin
tar xJf /tmp/bin/kc.tar.xz -C $POLY_KERNEL_CACHE && tar xJf /tmp/bin/kc.tar.xz -C $HOME/.cache/polystrata/kernels
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> $S
lscpu | grep -E "^(Model name|L3)" >> $S
[ -f /dev/shm/m/q35s.gguf ] || $E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35s.gguf > /tmp/s2.txt 2>&1 &
P2=$!
[ $SHORT = 1 ] || [ -f /dev/shm/m/q3u.gguf ] || $E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 0 --out /dev/shm/m/q3u.gguf > /tmp/s1.txt 2>&1 &
P1=$!
timeout 60 /tmp/bin/cuda_slot_pool --test-threads 1 > $OUT/t-slot_pool.txt 2>&1
st "cuda_slot_pool rc=$? $(grep 'test result' $OUT/t-slot_pool.txt)"
if [ $SHORT = 1 ]; then ONLY=long_calls_borrow; LIMIT=170; else ONLY=""; LIMIT=330; fi
POLY_ENGINE_BIN=$E timeout 150 /tmp/bin/gpu_expert_cache --test-threads 1 --nocapture $ONLY > $OUT/t-expert_cache.txt 2>&1
st "gpu_expert_cache rc=$? $(grep 'test result' $OUT/t-expert_cache.txt)"
grep -E "MiB above the reserve|borrowed|FAILED|panicked" $OUT/t-expert_cache.txt | head -8 >> $S
wait $P2
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); RES=$(( TOTAL - 8192 ))
smi_start() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > $R/vram.txt 2>/dev/null & SMI=$!; }
smi_stop() { kill $SMI 2>/dev/null; wait $SMI 2>/dev/null; st "  peak $(sort -n $R/vram.txt | tail -1) MiB"; }
H=/tmp/home; mkdir -p $H
server() { # model, label, extra engine args (JSON list items)
  local m=$1 l=$2 x=$3
  [ $(( $(date +%s) - T0 )) -gt $LIMIT ] && return
  cat > $H/strata-$m-$l.json <<J
{"exe": "$E", "args": ["--model", "/dev/shm/m/$m.gguf", "--max-context", "34000", "--gpu", "0", "--vram-reserve-mib", "$RES", "--no-expert-profile"$x], "tokenizer": "packs/$m/tokenizer", "model_name": "$m-$l"}
J
  smi_start
  timeout 90 /tmp/bin/polystrata benchmark --home $H --model $m-$l --prompt-tokens 2000 --answer-tokens 128 --runs 1 > $OUT/server-$m-$l.txt 2> $R/server-$m-$l.err
  st "server $m $l rc=$?"; smi_stop
  grep -E "^(short|long)" $OUT/server-$m-$l.txt >> $S
  grep -E "lent|took back|gave up" $R/server-$m-$l.err | head -6 >> $S
}
/tmp/bin/polystrata tokenizer --gguf /dev/shm/m/q35s.gguf --out $H/packs/q35s/tokenizer > /dev/null 2>&1
server q35s new ', "--scratch-tokens", "512"'
server q35s old ""
if [ $SHORT = 0 ]; then
  wait $P1
  /tmp/bin/polystrata tokenizer --gguf /dev/shm/m/q3u.gguf --out $H/packs/q3u/tokenizer > /dev/null 2>&1
  server q3u new ', "--scratch-tokens", "512"'
  server q3u old ""
fi
st done
cp $R/*.err $OUT/ 2>/dev/null
cat $S
