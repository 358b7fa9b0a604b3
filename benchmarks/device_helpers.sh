#!/bin/bash
# Helpers for device calls, sourced by a call script from the repository root after it sets C (its carry
# folder, e.g. C=.carry/s17) and S (its summary file): st (a timed line in S), b (bench's pp/tg figures),
# run / ident (a greedy answer with logprobs; BASE against this build), prep_machine (a fresh machine's
# binaries, llama.cpp's build in the background, q3u and q35s written). Top-level benchmarks/*.sh travel in
# device_lean.sh's lean mode, so calls source this instead of carrying a copy of it.
: "${C:?set C to the carry folder before sourcing device_helpers.sh}"
export POLY_KERNEL_CACHE=/tmp/pkc
E=/tmp/bin/poly-engine; BE=/tmp/bin/poly-engine-base; LB=/tmp/lcb/build/bin/llama-bench
T0=${T0:-$(date +%s)}
st() { echo "[$(( $(date +%s) - T0 )) s] $*" >> $S; }
b() { # label, binary, bench args: pp/tg averages and samples
  local l=$1 x=$2; shift 2
  timeout 90 $x bench --gpu 0 "$@" > /tmp/b.json 2>/tmp/b.err
  st "$l: $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(" | ".join("%s%d %.1f (%s)" % (k, d[k]["n_tokens"], d[k]["avg_ts"], ", ".join("%.1f" % x for x in d[k]["samples_ts"])) for k in ("pp","tg") if k in d), "| vram share %.3f" % ((d.get("experts") or {}).get("vram_share") or 0))' /tmp/b.json 2>&1 | tail -1)"
  grep -iE "error|panick" /tmp/b.err | head -3 >> $S
}
run() { # binary, model, out, args: a greedy answer with the 4 likeliest tokens' logprobs
  local x=$1 m=$2 o=$3; shift 3
  timeout 90 $x run --model /dev/shm/m/$m.gguf --gpu 0 --no-expert-profile --prompt-tokens 11,12,13,14,15,16,17,18,19,20 --max-tokens 48 --top 4 --json "$@" > $o 2>$o.err
}
ident() { # model, label, args: BASE against this build, byte for byte
  local m=$1 l=$2; shift 2
  run $BE $m /tmp/r-base.json "$@"; run $E $m /tmp/r-new.json "$@"
  if cmp -s /tmp/r-base.json /tmp/r-new.json; then st "identity $m $l: new = base ($(wc -l < /tmp/r-base.json) lines)"
  else st "identity $m $l: new != base"; cp /tmp/r-base.json $OUT/ident-$m-$l-base.json; cp /tmp/r-new.json $OUT/ident-$m-$l-new.json; fi
  grep -ciE "error|panick" /tmp/r-*.json.err | tr '\n' ' ' >> $S
}
prep_machine() { # a fresh machine: the binaries and llama.cpp's source unpacked, its build started (nice 19,
  # its own session), q3u and q35s written to /dev/shm (waits for the writers, not the build)
  mkdir -p /tmp/bin /dev/shm/m /tmp/lsrc /tmp/lcb
  tar xJf $C/bin.tar.xz -C /tmp/bin && tar xJf $C/llama.cpp.tar.xz -C /tmp/lsrc
  setsid nice -n 19 bash $C/llamacpp_build_cuda.sh /tmp/lsrc/llama.cpp /tmp/lcb/build /tmp/lcb > /tmp/lcb/llama_build.txt 2>&1 < /dev/null &
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> $S
  lscpu | grep -E "^(Model name|L3)" >> $S
  $E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 0 --out /dev/shm/m/q3u.gguf > /tmp/s1.txt 2>&1 &
  local p1=$!
  $E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35s.gguf > /tmp/s2.txt 2>&1 &
  local p2=$!
  "$@" # what runs while the models are written (the card tests)
  wait $p1 $p2
  st "written: q3u $(grep -oE 'top 10%[^(]*' /tmp/s1.txt | head -1); q35s $(grep -oE 'top 10%[^(]*' /tmp/s2.txt | head -1)"
}
server_bench() { # model, label, engine args (JSON list items after the common ones), benchmark args...:
  # a run config in $H (default /tmp/home) for /dev/shm/m/MODEL.gguf on GPU 0, then `polystrata benchmark`
  local m=$1 l=$2 x=$3; shift 3
  H=${H:-/tmp/home}; mkdir -p $H/packs
  [ -d $H/packs/$m/tokenizer ] || /tmp/bin/polystrata tokenizer --gguf /dev/shm/m/$m.gguf --out $H/packs/$m/tokenizer > /dev/null 2>&1
  cat > $H/strata-$m-$l.json <<J
{"exe": "$E", "args": ["--model", "/dev/shm/m/$m.gguf", "--gpu", "0", "--no-expert-profile"$x], "tokenizer": "packs/$m/tokenizer", "model_name": "$m-$l"}
J
  timeout ${SERVER_TIMEOUT:-100} /tmp/bin/polystrata benchmark --home $H --model $m-$l "$@" > $OUT/server-$m-$l.txt 2> $OUT/server-$m-$l.err
  st "server $m $l rc=$?"; grep -E "^(short|long)" $OUT/server-$m-$l.txt >> $S; grep -iE "error|panick" $OUT/server-$m-$l.err | head -3 >> $S
}
pack_out() { # a call's files beside its summary S, in one archive: at most 8 files come back from $OUT
  # (listed before the archive exists, which is written beside $OUT and moved in)
  (cd $OUT && ls | grep -vxF "$(basename $S)" > /tmp/pack_out.list \
    && tar cJf /tmp/pack_out.tar.xz -T /tmp/pack_out.list --remove-files && mv /tmp/pack_out.tar.xz files.tar.xz)
}
