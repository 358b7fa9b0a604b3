#!/bin/bash
# Seventeenth session, call 1 (a fresh machine; the device budget was down to ~1,000 s by failed starts, so
# the card tests of every branch come first): the integration build s17int (main + fa128 + mtpgpu + agree18
# + g4gpu). llama.cpp's build starts in the background for call 2 (callB.sh); q3u and q35s are written.
#   tests: cuda_prompt_attention (64 and 128 rows), gpu_draft_block, cuda_elementwise, cuda_gemma4_ops,
#          cuda_layer_ops, gpu_forward, gpu_expert_cache; then the attention kernel alone (cuda_layer_bench),
#          full-VRAM pp8192 with 64 and 128 rows, and the server at 8 GB (q3u, 8,000 / 30,000) with each.
#   there: DEVOUT=$OUT bash .carry/s17/call1.sh
set -u
OUT=$DEVOUT; S=$OUT/call1.txt; T0=$(date +%s); C=.carry/s17; . benchmarks/device_helpers.sh
R=/tmp/r; mkdir -p $R $POLY_KERNEL_CACHE $HOME/.cache/polystrata/kernels
export POLY_ENGINE_BIN=/tmp/bin/poly-engine
t() { # binary, timeout, args
  local x=$1 to=$2; shift 2
  timeout $to /tmp/bin/$x --test-threads 1 "$@" > $OUT/t-$x.txt 2>&1
  st "$x rc=$? $(grep 'test result' $OUT/t-$x.txt | tail -1)"; grep -E "FAILED|panicked" $OUT/t-$x.txt | head -6 >> $S
}
tests() {
  tar xJf /tmp/bin/kc.tar.xz -C $POLY_KERNEL_CACHE && tar xJf /tmp/bin/kc.tar.xz -C $HOME/.cache/polystrata/kernels
  mkdir -p target/release && ln -sf /tmp/bin/poly-engine target/release/poly-engine
  t cuda_prompt_attention 60 --nocapture; grep -E "nmse" $OUT/t-cuda_prompt_attention.txt | head -8 >> $S
  t gpu_draft_block 150
  t cuda_elementwise 45
  t cuda_gemma4_ops 45
  t cuda_layer_ops 60
  t gpu_forward 150
}
prep_machine tests
t gpu_expert_cache 200
timeout 60 /tmp/bin/cuda_layer_bench --test-threads 1 --ignored --nocapture bench_attention > $OUT/t-bench.txt 2>&1
st "cuda_layer_bench rc=$?"; grep -E "attention_mma" $OUT/t-bench.txt >> $S
for r in 64 128; do
  [ $(( $(date +%s) - T0 )) -gt 500 ] && break
  b "q3u full r$r pp8192" $E --model /dev/shm/m/q3u.gguf --no-expert-profile --prompt 8192 --gen 0 --reps 1 --fa-rows $r
done
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); RES=$(( TOTAL - 8192 ))
at8() { # label, extra engine args: q3u at 8 GB (reserve total - 8,192), prompts of 8,000 and 30,000
  [ $(( $(date +%s) - T0 )) -gt 470 ] && return
  server_bench q3u $1 ', "--max-context", "34000", "--vram-reserve-mib", "'$RES'"'"$2" --prompt-tokens 8000,30000 --answer-tokens 64 --runs 1
}
at8 r128 ', "--fa-rows", "128"'
at8 r64 ""
st "llama build: $(ls /tmp/lcb/build.* 2>/dev/null)"
st done
pack_out
cat $S
