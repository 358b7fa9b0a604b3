#!/bin/bash
# Fourteenth session, call 1 (a fresh machine): three changes for one token with every weight in VRAM.
#   - `--attn-heads-per-block 1|2|4` (thirteenth session, never run): a GQA group's heads in shorter
#     blocks of the flash-decoding kernel (default: the whole group in one block, 255 registers);
#   - `--matvec-small-k on` (new): short rows (an expert's down row of 768 Q4_K values) in llama.cpp's
#     small-K shape, four warps over the row and four rows a thread (off: one warp a row, two passes);
#   - three changes that keep every value and are on by default (BASE is main's 9f186c6 without them):
#     the router's choice of experts by two warp reductions in hardware (redux.sync) instead of five
#     rounds of shuffles; the MoE end (moe_add_rms_norm_q8_1) loading a token's k slot outputs together
#     before it sums them in order; the attention merge (attn_decode_reduce) issuing all its loads before
#     its first reduction (one trip to memory instead of three);
#   - (for call 2) the budget keeps a 512-token call's scratch where larger calls can borrow: the lending
#     test of gpu_expert_cache.
# The card tests of each; greedy answers with logprobs of each setting against the default's; bench tg128
# pp512 for each, alternating; llama.cpp (built in the background) on the same files.
set -u
OUT=$DEVOUT; S=$OUT/call1.txt; T0=$(date +%s); . .carry/s14/common.sh
R=/tmp/r; mkdir -p $R
tests() {
  tt() { # binary, filter, label
    timeout 150 /tmp/bin/$1 --test-threads 1 $2 > $R/t-$3.txt 2>&1
    st "$1 $2 rc=$?: $(grep -E '^test result' $R/t-$3.txt | tail -1)"
    grep -E "FAILED|panicked|DIFFER|above" $R/t-$3.txt | head -6 >> $S
    cp $R/t-$3.txt $OUT/
  }
  tt cuda_layer_ops attention_decode layer_ops
  tt cuda_matvec_small_k "" small_k
  tt cuda_ops "" ops
  tt cuda_moe_fused route moe_fused_route
  tt cuda_moe_fused selection_bias moe_fused_bias
  tt cuda_fused "" fused
  POLY_ENGINE_BIN=$E tt gpu_expert_cache long_calls_borrow expert_cache_lend
}
prep_machine tests
cmp_run() { # model, label, reference, args
  local m=$1 l=$2 ref=$3; shift 3
  run $E $m $R/r-$m-$l.json "$@"
  st "identity $m $l: $(python3 $C/cmp.py $ref $R/r-$m-$l.json 2>&1 | tail -1)"
}
for m in q3u q35s; do
  run $BE $m $R/r-$m-base.json
  cmp_run $m default $R/r-$m-base.json
  for h in 1 2 4; do cmp_run $m hpb$h $R/r-$m-default.json --attn-heads-per-block $h; done
  cmp_run $m smallk $R/r-$m-default.json --matvec-small-k on
  cp $R/r-$m-base.json $R/r-$m-smallk.json $OUT/
done
st "bench round 1"
for m in q3u q35s; do
  A="--model /dev/shm/m/$m.gguf --prompt 512 --gen 128 --reps 2"
  b "$m BASE" $BE $A
  b "$m default" $E $A
  for h in 1 2 4; do b "$m hpb $h" $E $A --attn-heads-per-block $h; done
  b "$m small-k" $E $A --matvec-small-k on
  b "$m hpb 1 small-k" $E $A --attn-heads-per-block 1 --matvec-small-k on
done
st "bench round 2 (reversed)"
for m in q35s q3u; do
  A="--model /dev/shm/m/$m.gguf --prompt 512 --gen 128 --reps 2"
  [ $(( $(date +%s) - T0 )) -gt 470 ] && break
  b "$m hpb 1 small-k" $E $A --attn-heads-per-block 1 --matvec-small-k on
  b "$m small-k" $E $A --matvec-small-k on
  b "$m hpb 2" $E $A --attn-heads-per-block 2
  b "$m hpb 1" $E $A --attn-heads-per-block 1
  b "$m default" $E $A
  b "$m BASE" $BE $A
done
while [ ! -e /tmp/lcb/build.done ] && [ ! -e /tmp/lcb/build.failed ]; do sleep 2; [ $(( $(date +%s) - T0 )) -gt 500 ] && break; done
st "llama build: $(ls /tmp/lcb/build.* 2>/dev/null) $(cat /tmp/lcb/build_time.txt 2>/dev/null)"
for m in q3u q35s; do
  [ $(( $(date +%s) - T0 )) -gt 540 ] && break
  timeout 50 $LB -m /dev/shm/m/$m.gguf -ngl 99 -fa 1 -p 512 -n 128 -r 2 -o md 2>&1 | grep -E "pp|tg|error" >> $S
done
st done
cat $S
