#!/bin/bash
# Seventeenth session, call 0 (the budget down to ~460 s): only the card tests of this session's branches
# and the attention kernel alone, in order of what they decide (no models written, no llama.cpp).
#   there: DEVOUT=$OUT bash .carry/s17/call0.sh
set -u
OUT=$DEVOUT; S=$OUT/call0.txt; T0=$(date +%s); C=.carry/s17; . benchmarks/device_helpers.sh
mkdir -p /tmp/bin $POLY_KERNEL_CACHE $HOME/.cache/polystrata/kernels
tar xJf $C/bin.tar.xz -C /tmp/bin && tar xJf /tmp/bin/kc.tar.xz -C $POLY_KERNEL_CACHE && tar xJf /tmp/bin/kc.tar.xz -C $HOME/.cache/polystrata/kernels
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> $S
mkdir -p target/release && ln -sf /tmp/bin/poly-engine target/release/poly-engine
export POLY_ENGINE_BIN=/tmp/bin/poly-engine
t() { # binary, timeout, args
  local x=$1 to=$2; shift 2
  timeout $to /tmp/bin/$x --test-threads 1 "$@" > $OUT/t-$x.txt 2>&1
  st "$x rc=$? $(grep 'test result' $OUT/t-$x.txt | tail -1)"; grep -E "FAILED|panicked" $OUT/t-$x.txt | head -6 >> $S
}
t cuda_prompt_attention 45 --nocapture; grep -E "nmse" $OUT/t-cuda_prompt_attention.txt | head -8 >> $S
timeout 45 /tmp/bin/cuda_layer_bench --test-threads 1 --ignored --nocapture bench_attention > $OUT/t-bench.txt 2>&1
st "cuda_layer_bench rc=$?"; grep -E "attention_mma" $OUT/t-bench.txt >> $S
t gpu_draft_block 120
t cuda_gemma4_ops 40
t cuda_elementwise 30
t cuda_layer_ops 45
t gpu_forward 120
t gpu_expert_cache 150
st done
pack_out
cat $S
