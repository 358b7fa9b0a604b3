#!/bin/bash
# (Its build was the merged attention of that call, taken out after it: `--fuse no-attn-merge` no longer exists.)
# Fifteenth session, call 2 (right after call 1, on its machine: the files in /dev/shm, the binaries in
# /tmp/bin; on a fresh machine it unpacks and writes them first): a token's attention merging its splits in
# its own last blocks (`attn-merge`, on by default) against the second launch (`--fuse no-attn-merge`):
# the card test (every cut, merged or not, bit for bit), greedy answers with logprobs byte for byte, and
# bench with every weight in VRAM (tg128, pp512), alternating.
#   there: DEVOUT=$OUT bash .carry/s15/call2.sh
set -u
OUT=$DEVOUT; S=$OUT/call2.txt; T0=$(date +%s); . .carry/s15/common.sh
if [ ! -x /tmp/bin/cuda_layer_ops ]; then
  mkdir -p /tmp/bin /dev/shm/m $POLY_KERNEL_CACHE $HOME/.cache/polystrata/kernels
  tar xJf $C/bin.tar.xz -C /tmp/bin
  tar xJf /tmp/bin/kc.tar.xz -C $POLY_KERNEL_CACHE && tar xJf /tmp/bin/kc.tar.xz -C $HOME/.cache/polystrata/kernels
  st "fresh machine: $(nvidia-smi --query-gpu=name --format=csv,noheader)"
fi
[ -f /dev/shm/m/q3u.gguf ] || $E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 0 --out /dev/shm/m/q3u.gguf > /tmp/s1.txt 2>&1 &
[ -f /dev/shm/m/q35s.gguf ] || $E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35s.gguf > /tmp/s2.txt 2>&1 &
timeout 150 /tmp/bin/cuda_layer_ops attention_decode > $OUT/t-layer_ops.txt 2>&1
st "cuda_layer_ops attention_decode rc=$? $(grep 'test result' $OUT/t-layer_ops.txt)"
wait
same() { # model: greedy answers with logprobs, merged against the second launch
  local m=$1
  run $E $m /tmp/r-merge.json; run $E $m /tmp/r-two.json --fuse no-attn-merge
  if cmp -s /tmp/r-merge.json /tmp/r-two.json; then st "identity $m: merged = two launches ($(wc -l < /tmp/r-merge.json) lines)"
  else st "identity $m: merged != two launches"; cp /tmp/r-merge.json $OUT/ident-$m-merge.json; cp /tmp/r-two.json $OUT/ident-$m-two.json; fi
}
same q3u
same q35s
for r in 1 2; do
  for m in q3u q35s; do
    b "$m merge" $E --model /dev/shm/m/$m.gguf --no-expert-profile --prompt 512 --gen 128 --reps 2
    b "$m two" $E --model /dev/shm/m/$m.gguf --no-expert-profile --prompt 512 --gen 128 --reps 2 --fuse no-attn-merge
  done
done
b "q3u merge hpb1" $E --model /dev/shm/m/q3u.gguf --no-expert-profile --prompt 512 --gen 128 --reps 2 --attn-heads-per-block 1
b "q35s merge hpb1" $E --model /dev/shm/m/q35s.gguf --no-expert-profile --prompt 512 --gen 128 --reps 2 --attn-heads-per-block 1
st done
cat $S
