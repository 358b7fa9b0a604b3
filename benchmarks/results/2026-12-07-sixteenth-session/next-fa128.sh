#!/bin/bash
# Written in the sixteenth session, not run (its device time was spent): the next stay's first call.
# Branch fa128 (one commit on main): the prompt attention in blocks of 128 rows (`--fa-rows 128`, two
# 16-row tiles a warp) against the measured 64 (the default). Then where q3u's 30,000-token prompt at 8 GB
# spends its 4.4 s (POLY_GPU_PROFILE=2 over bench in calls of 8,192, as the server reads it).
#   here:  git checkout fa128; build poly-engine + polystrata; test binaries cuda_prompt_attention,
#          cuda_layer_bench; kernel cache (poly-engine kernels --arch sm_90 with NVRTC 13.0, see
#          call1.sh); strip into a folder with kc.tar.xz; XZ_OPT=-9e tar cJf .carry/s17/bin.tar.xz; copy
#          common.sh (C=.carry/s17) and this script there;
#          benchmarks/device_lean.sh on 'qwen3moe-tiny-q4km|qwen35moe-tiny-q4km|deepseek4-tiny-q8_0'
#   there: DEVOUT=$OUT bash .carry/s17/next-fa128.sh
# If 128 rows are faster and the test passes, make 128 the default for heads of 64 and 128.
set -u
OUT=$DEVOUT; S=$OUT/next.txt; T0=$(date +%s); . .carry/s17/common.sh
R=/tmp/r; mkdir -p $R /tmp/bin /dev/shm/m $POLY_KERNEL_CACHE $HOME/.cache/polystrata/kernels
tar xJf $C/bin.tar.xz -C /tmp/bin
tar xJf /tmp/bin/kc.tar.xz -C $POLY_KERNEL_CACHE && tar xJf /tmp/bin/kc.tar.xz -C $HOME/.cache/polystrata/kernels
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> $S
$E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 0 --out /dev/shm/m/q3u.gguf > /tmp/s1.txt 2>&1 &
P1=$!
$E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35s.gguf > /tmp/s2.txt 2>&1 &
P2=$!
timeout 60 /tmp/bin/cuda_prompt_attention --test-threads 1 --nocapture > $OUT/t-prompt_attention.txt 2>&1
st "cuda_prompt_attention rc=$? $(grep 'test result' $OUT/t-prompt_attention.txt)"
grep -E "nmse|FAILED|panicked" $OUT/t-prompt_attention.txt | head -14 >> $S
timeout 90 /tmp/bin/cuda_layer_bench --test-threads 1 --ignored --nocapture bench_attention > $OUT/t-bench.txt 2>&1
st "cuda_layer_bench rc=$?"; grep -E "attention_mma" $OUT/t-bench.txt >> $S
wait $P1 $P2
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); RES=$(( TOTAL - 8192 ))
H=/tmp/home; mkdir -p $H
server() { # model, label, extra engine args (JSON list items)
  local m=$1 l=$2 x=$3
  cat > $H/strata-$m-$l.json <<J
{"exe": "$E", "args": ["--model", "/dev/shm/m/$m.gguf", "--max-context", "34000", "--gpu", "0", "--vram-reserve-mib", "$RES", "--no-expert-profile"$x], "tokenizer": "packs/$m/tokenizer", "model_name": "$m-$l"}
J
  timeout 100 /tmp/bin/polystrata benchmark --home $H --model $m-$l --prompt-tokens 8000,30000 --answer-tokens 64 --runs 1 > $R/server-$m-$l.txt 2> $R/server-$m-$l.err
  st "server $m $l rc=$?"; grep -E "^(short|long)" $R/server-$m-$l.txt >> $S
}
for m in q3u q35s; do /tmp/bin/polystrata tokenizer --gguf /dev/shm/m/$m.gguf --out $H/packs/$m/tokenizer > /dev/null 2>&1; done
server q3u r128 ', "--fa-rows", "128"'
server q3u r64 ""
server q35s r128 ', "--fa-rows", "128"'
server q35s r64 ""
# Where the prompt's time goes: one 30,000-token read in calls of 8,192 at 8 GB, per operation kind.
POLY_GPU_PROFILE=2 timeout 120 $E bench --gpu 0 --model /dev/shm/m/q3u.gguf --no-expert-profile --max-context 34000 \
  --vram-reserve-mib $RES --prompt 30000 --gen 0 --reps 1 --ubatch 8192 > $R/prof.json 2> $OUT/prof-q3u-30000.txt
st "profile rc=$? $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["pp"]["avg_ts"])' $R/prof.json 2>&1 | tail -1)"
tail -40 $OUT/prof-q3u-30000.txt >> $S
st done
cat $S
