#!/bin/bash
# Sixteenth session, call 3 (a fresh machine): prompt attention rewritten (attention_mma: keys and values by
# cp.async, two tiles in flight; fragments by ldmatrix; queries' fragments kept in registers for d <= 128;
# base-2 exponentials; the longest row blocks first). BASE = main with the old kernel (poly-engine-base,
# cuda_layer_bench-base), NEW = this tree. Both default to a 512-token kept scratch.
#   1. card tests: cuda_prompt_attention (against the CPU and attn_f16), gpu_forward (the witness on the
#      fixtures kept in the lean tree);
#   2. the kernel alone (cuda_layer_bench bench_attention: qwen3moe's 32/4 heads of 128), BASE and NEW;
#   3. llama.cpp's build (nice 19) runs during 1-2; after it: the server at 8 GB (a 40-token chat, prompts
#      of 2,000 / 8,000 / 30,000, 128 answer tokens, context 34,000), NEW and BASE alternating, q3u then
#      q35s; then llama.cpp's pp8000 / pp30000 at the fewest CPU layers that fit 8 GB (34 / 40 for q3u,
#      31 / 33 for q35s, call 2's peaks), each with its nvidia-smi peak.
#   there: DEVOUT=$OUT bash .carry/s16/call3.sh
set -u
OUT=$DEVOUT; S=$OUT/call3.txt; T0=$(date +%s); . .carry/s16/common.sh
R=/tmp/r; mkdir -p $R /tmp/bin /dev/shm/m /tmp/lsrc /tmp/lcb $POLY_KERNEL_CACHE $HOME/.cache/polystrata/kernels
tar xJf $C/bin3.tar.xz -C /tmp/bin
tar xJf /tmp/bin/kc.tar.xz -C $POLY_KERNEL_CACHE && tar xJf /tmp/bin/kc.tar.xz -C $HOME/.cache/polystrata/kernels
if [ ! -e /tmp/lcb/build.done ]; then
  tar xJf $C/llama.cpp.tar.xz -C /tmp/lsrc
  setsid nice -n 19 bash $C/llamacpp_build_cuda.sh /tmp/lsrc/llama.cpp /tmp/lcb/build /tmp/lcb > /tmp/lcb/llama_build.txt 2>&1 < /dev/null &
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> $S
lscpu | grep -E "^(Model name|L3)" >> $S
[ -f /dev/shm/m/q35s.gguf ] || $E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35s.gguf > /tmp/s2.txt 2>&1 &
P2=$!
[ -f /dev/shm/m/q3u.gguf ] || $E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 0 --out /dev/shm/m/q3u.gguf > /tmp/s1.txt 2>&1 &
P1=$!
tt() { # binary, label, args
  local x=$1 l=$2; shift 2
  timeout 150 /tmp/bin/$x --test-threads 1 "$@" > $OUT/t-$l.txt 2>&1
  st "$x $* rc=$?: $(grep -E '^test result' $OUT/t-$l.txt | tail -1)"
  grep -E "FAILED|panicked|nmse|TFLOP" $OUT/t-$l.txt | head -14 >> $S
}
tt cuda_prompt_attention prompt_attention --nocapture
POLY_ENGINE_BIN=$E tt gpu_forward gpu_forward
tt cuda_layer_bench-base bench-base --ignored --nocapture bench_attention
tt cuda_layer_bench bench-new --ignored --nocapture bench_attention
wait $P1 $P2
st "written: q3u $(grep -oE 'top 10%[^(]*' /tmp/s1.txt | head -1); q35s $(grep -oE 'top 10%[^(]*' /tmp/s2.txt | head -1)"
while [ ! -e /tmp/lcb/build.done ] && [ ! -e /tmp/lcb/build.failed ]; do sleep 2; [ $(( $(date +%s) - T0 )) -gt 330 ] && break; done
st "llama build: $(ls /tmp/lcb/build.* 2>/dev/null) $(cat /tmp/lcb/build_time.txt 2>/dev/null)"
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); RES=$(( TOTAL - 8192 ))
smi_start() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > $R/vram.txt 2>/dev/null & SMI=$!; }
smi_stop() { kill $SMI 2>/dev/null; wait $SMI 2>/dev/null; st "  peak $(sort -n $R/vram.txt | tail -1) MiB"; }
H=/tmp/home; mkdir -p $H
server() { # model, label, engine binary
  local m=$1 l=$2 x=$3
  [ $(( $(date +%s) - T0 )) -gt 450 ] && return
  cat > $H/strata-$m-$l.json <<J
{"exe": "$x", "args": ["--model", "/dev/shm/m/$m.gguf", "--max-context", "34000", "--gpu", "0", "--vram-reserve-mib", "$RES", "--no-expert-profile"], "tokenizer": "packs/$m/tokenizer", "model_name": "$m-$l"}
J
  smi_start
  timeout 100 /tmp/bin/polystrata benchmark --home $H --model $m-$l --prompt-tokens 2000,8000,30000 --answer-tokens 128 --runs 1 > $R/server-$m-$l.txt 2> $R/server-$m-$l.err
  st "server $m $l rc=$?"; smi_stop
  grep -E "^(short|long)" $R/server-$m-$l.txt >> $S
}
for m in q3u q35s; do /tmp/bin/polystrata tokenizer --gguf /dev/shm/m/$m.gguf --out $H/packs/$m/tokenizer > /dev/null 2>&1; done
server q3u new $E
server q3u base $BE
server q35s new $E
server q35s base $BE
ll() { # model, n-cpu-moe, llama-bench args
  local m=$1 n=$2; shift 2
  [ -e /tmp/lcb/build.done ] || return
  [ $(( $(date +%s) - T0 )) -gt 540 ] && return
  smi_start
  timeout 75 $LB -m /dev/shm/m/$m.gguf -ngl 99 --n-cpu-moe $n -fa 1 "$@" -o md 2>&1 | grep -E "pp|tg|error" >> $S
  smi_stop
}
ll q3u 34 -p 8000 -n 0 -ub 2048 -b 8192 -r 1
ll q35s 31 -p 8000 -n 0 -ub 2048 -b 8192 -r 1
ll q3u 40 -p 30000 -n 0 -ub 2048 -b 8192 -r 1
ll q35s 33 -p 30000 -n 0 -ub 2048 -b 8192 -r 1
st done
tar cJf $OUT/server.tar.xz -C $R $(cd $R && ls server-*) 2>/dev/null
cat $S
