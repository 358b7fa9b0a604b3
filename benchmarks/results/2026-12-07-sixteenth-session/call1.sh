#!/bin/bash
# Sixteenth session, call 1 (a fresh machine): the expert cache resized in place (branch resize15, written in
# the fifteenth session, never run). Card tests (cuda_slot_pool; gpu_expert_cache whole, fixtures qwen3moe /
# qwen35moe / deepseek4 only), then the server at 8 GB on a quiet host: a 40-token chat then prompts of 2,000,
# 8,000 and 30,000 tokens, 128 answer tokens after each, context 34,000, `--scratch-tokens 512` against the
# default (the largest call's scratch kept), q35s then q3u, peaks by nvidia-smi, the lending's log lines.
# Then llama.cpp's build starts (nice 19) and ours runs every weight in VRAM while it builds (call 2 waits
# for it: llama.cpp at 8 GB and in VRAM, ours at 8 GB by bench).
#   here:  build engine + polystrata + the two test binaries, kernel cache (poly-engine kernels --arch
#          sm_90 with NVRTC 13.0), strip into a folder with kc.tar.xz; XZ_OPT=-9e tar cJf .carry/s16/bin.tar.xz;
#          benchmarks/device_lean.sh on 'qwen3moe-tiny-q4km|qwen35moe-tiny-q4km|deepseek4-tiny-q8_0'
#   there: DEVOUT=$OUT bash .carry/s16/call1.sh
set -u
OUT=$DEVOUT; S=$OUT/call1.txt; T0=$(date +%s); . .carry/s16/common.sh
R=/tmp/r; mkdir -p $R /tmp/bin /dev/shm/m /tmp/lsrc /tmp/lcb $POLY_KERNEL_CACHE $HOME/.cache/polystrata/kernels
tar xJf $C/bin.tar.xz -C /tmp/bin
tar xJf /tmp/bin/kc.tar.xz -C $POLY_KERNEL_CACHE && tar xJf /tmp/bin/kc.tar.xz -C $HOME/.cache/polystrata/kernels
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> $S
lscpu | grep -E "^(Model name|L3)" >> $S
$E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35s.gguf > /tmp/s2.txt 2>&1 &
P2=$!
$E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 0 --out /dev/shm/m/q3u.gguf > /tmp/s1.txt 2>&1 &
P1=$!
timeout 60 /tmp/bin/cuda_slot_pool --test-threads 1 > $OUT/t-slot_pool.txt 2>&1
st "cuda_slot_pool rc=$? $(grep 'test result' $OUT/t-slot_pool.txt)"
POLY_ENGINE_BIN=$E timeout 200 /tmp/bin/gpu_expert_cache --test-threads 1 --nocapture > $OUT/t-expert_cache.txt 2>&1
st "gpu_expert_cache rc=$? $(grep 'test result' $OUT/t-expert_cache.txt)"
grep -E "MiB above the reserve|borrowed|FAILED|panicked" $OUT/t-expert_cache.txt | head -8 >> $S
wait $P1 $P2
st "written: q3u $(grep -oE 'top 10%[^(]*' /tmp/s1.txt | head -1); q35s $(grep -oE 'top 10%[^(]*' /tmp/s2.txt | head -1)"
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); RES=$(( TOTAL - 8192 ))
smi_start() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > $R/vram.txt 2>/dev/null & SMI=$!; }
smi_stop() { kill $SMI 2>/dev/null; wait $SMI 2>/dev/null; st "  peak $(sort -n $R/vram.txt | tail -1) MiB"; }
H=/tmp/home; mkdir -p $H
server() { # model, label, extra engine args (JSON list items)
  local m=$1 l=$2 x=$3
  [ $(( $(date +%s) - T0 )) -gt 330 ] && return
  cat > $H/strata-$m-$l.json <<J
{"exe": "$E", "args": ["--model", "/dev/shm/m/$m.gguf", "--max-context", "34000", "--gpu", "0", "--vram-reserve-mib", "$RES", "--no-expert-profile"$x], "tokenizer": "packs/$m/tokenizer", "model_name": "$m-$l"}
J
  smi_start
  timeout 120 /tmp/bin/polystrata benchmark --home $H --model $m-$l --prompt-tokens 2000,8000,30000 --answer-tokens 128 --runs 1 > $OUT/server-$m-$l.txt 2> $R/server-$m-$l.err
  st "server $m $l rc=$?"; smi_stop
  grep -E "^(short|long)" $OUT/server-$m-$l.txt >> $S
  grep -E "lent|took back|gave up|resiz" $R/server-$m-$l.err | head -8 >> $S
}
for m in q35s q3u; do /tmp/bin/polystrata tokenizer --gguf /dev/shm/m/$m.gguf --out $H/packs/$m/tokenizer > /dev/null 2>&1; done
server q35s new ', "--scratch-tokens", "512"'
server q35s old ""
server q3u new ', "--scratch-tokens", "512"'
server q3u old ""
tar xJf $C/llama.cpp.tar.xz -C /tmp/lsrc
setsid nice -n 19 bash $C/llamacpp_build_cuda.sh /tmp/lsrc/llama.cpp /tmp/lcb/build /tmp/lcb > /tmp/lcb/llama_build.txt 2>&1 < /dev/null &
st "llama.cpp build started"
for r in 1 2; do for m in q3u q35s; do
  [ $(( $(date +%s) - T0 )) -gt 540 ] && break
  b "$m full round $r" $E --model /dev/shm/m/$m.gguf --no-expert-profile --prompt 512 --gen 128 --reps 2
done; done
st done
cp $R/*.err $OUT/ 2>/dev/null
cat $S
