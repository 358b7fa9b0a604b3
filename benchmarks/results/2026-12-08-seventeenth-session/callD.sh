#!/bin/bash
# Seventeenth session, call D (after C, on its machine; a fresh machine unpacks first): the draft block guessing on the card with
# every weight in VRAM: q35a (written to agree at 0.8, started in call C) through the server, --draft-block on
# against --no-draft.
#   there: DEVOUT=$OUT bash .carry/s17/callD.sh
set -u
OUT=$DEVOUT; S=$OUT/callD.txt; T0=$(date +%s); C=.carry/s17; . benchmarks/device_helpers.sh
R=/tmp/r; mkdir -p $R /tmp/bin /dev/shm/m $POLY_KERNEL_CACHE
if [ ! -x $E ]; then tar xJf $C/bin.tar.xz -C /tmp/bin; tar xJf /tmp/bin/kc.tar.xz -C $POLY_KERNEL_CACHE; st "fresh machine"; fi
mkdir -p $HOME/.cache/polystrata/kernels && tar xJf /tmp/bin/kc.tar.xz -C $HOME/.cache/polystrata/kernels
mkdir -p target/release && ln -sf /tmp/bin/poly-engine target/release/poly-engine
export POLY_ENGINE_BIN=/tmp/bin/poly-engine
# q35a: written here unless call C started it.
if [ ! -e /tmp/synth-q35a.rc ] && ! pgrep -f "draft-agreement" > /dev/null; then
  $E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --draft-agreement 0.8 \
    --agreement-steps 32 --out /dev/shm/m/q35a.gguf > /tmp/synth-q35a.txt 2>&1; echo $? > /tmp/synth-q35a.rc
fi
while [ ! -e /tmp/synth-q35a.rc ]; do sleep 2; [ $(( $(date +%s) - T0 )) -gt 300 ] && break; done
st "synth q35a rc=$(cat /tmp/synth-q35a.rc 2>/dev/null) $(grep -iE 'agree' /tmp/synth-q35a.txt | tail -2 | tr '\n' ' ')"
cp /tmp/synth-q35a.txt $OUT/ 2>/dev/null
srv() { # label, extra engine args: every weight in VRAM, a 2,000-token prompt, 256-token answers
  [ $(( $(date +%s) - T0 )) -gt 520 ] && return
  SERVER_TIMEOUT=90 server_bench q35a $1 ', "--max-context", "8192"'"$2" --prompt-tokens 2000 --answer-tokens 256 --runs 2
}
srv nodraft ', "--no-draft"'
srv mtp ', "--draft-block", "on"'
st done
pack_out
cat $S
