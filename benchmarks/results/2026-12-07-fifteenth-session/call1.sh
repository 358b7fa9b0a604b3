#!/bin/bash
# Fifteenth session, call 1: the fourteenth session's not-run-next.sh (the server at 8 GB with the kept
# admission scores: `--scratch-tokens 512` against the default, q35s then q3u, `--lend-refill resident`
# once), with the kernel cache built here (`poly-engine kernels --arch sm_90` with NVRTC 13.0, so no
# compiling there), then one resident token's launches in Nsight Systems (q3u and q35s, every weight in
# VRAM, bench tg64; q3u with --gpu-pdl off too), summarised by nsys_summary.py.
#   here:  build engine + polystrata, strip into a folder with kc.tar.xz (the cache); XZ_OPT=-9e tar cJf
#          .carry/s15/bin.tar.xz; copy common.sh, this script and nsys_summary.py into .carry/s15; lean on
#   there: DEVOUT=$OUT bash .carry/s15/call1.sh
set -u
OUT=$DEVOUT; S=$OUT/call1.txt; T0=$(date +%s); . .carry/s15/common.sh
R=/tmp/r; mkdir -p $R /tmp/bin /dev/shm/m $POLY_KERNEL_CACHE $HOME/.cache/polystrata/kernels
tar xJf $C/bin.tar.xz -C /tmp/bin
tar xJf /tmp/bin/kc.tar.xz -C $POLY_KERNEL_CACHE && tar xJf /tmp/bin/kc.tar.xz -C $HOME/.cache/polystrata/kernels
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> $S
lscpu | grep -E "^(Model name|L3)" >> $S
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda*/nsight-systems*/bin/nsys 2>/dev/null | head -1)
st "nsys: ${NSYS:-none}"
$E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35s.gguf > /tmp/s2.txt 2>&1 &
P2=$!
$E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 0 --out /dev/shm/m/q3u.gguf > /tmp/s1.txt 2>&1 &
P1=$!
wait $P2
st "q35s written: $(grep -oE 'top 10%[^(]*' /tmp/s2.txt | head -1)"
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); RES=$(( TOTAL - 8192 ))
smi_start() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > $R/vram.txt 2>/dev/null & SMI=$!; }
smi_stop() { kill $SMI 2>/dev/null; wait $SMI 2>/dev/null; st "  peak $(sort -n $R/vram.txt | tail -1) MiB"; }
H=/tmp/home; mkdir -p $H
server() { # model, label, extra engine args (JSON list items)
  local m=$1 l=$2 x=$3
  [ $(( $(date +%s) - T0 )) -gt 470 ] && return
  cat > $H/strata-$m-$l.json <<J
{"exe": "$E", "args": ["--model", "/dev/shm/m/$m.gguf", "--max-context", "34000", "--gpu", "0", "--vram-reserve-mib", "$RES", "--no-expert-profile"$x], "tokenizer": "packs/$m/tokenizer", "model_name": "$m-$l"}
J
  smi_start
  timeout 75 /tmp/bin/polystrata benchmark --home $H --model $m-$l --prompt-tokens 2000 --answer-tokens 128 --runs 1 > $OUT/server-$m-$l.txt 2> $R/server-$m-$l.err
  st "server $m $l rc=$?"; smi_stop
  grep -E "^(short|long)" $OUT/server-$m-$l.txt >> $S
  grep -E "kernel|compil" $R/server-$m-$l.err | head -2 >> $S
}
/tmp/bin/polystrata tokenizer --gguf /dev/shm/m/q35s.gguf --out $H/packs/q35s/tokenizer > /dev/null 2>&1
server q35s new ', "--scratch-tokens", "512"'
server q35s old ""
wait $P1
st "q3u written: $(grep -oE 'top 10%[^(]*' /tmp/s1.txt | head -1)"
/tmp/bin/polystrata tokenizer --gguf /dev/shm/m/q3u.gguf --out $H/packs/q3u/tokenizer > /dev/null 2>&1
server q3u new ', "--scratch-tokens", "512"'
server q3u old ""
prof() { # model, label, extra bench args: one resident token's launches
  local m=$1 l=$2; shift 2
  [ -z "$NSYS" ] && return
  [ $(( $(date +%s) - T0 )) -gt 500 ] && return
  timeout 60 $NSYS profile -t cuda --cuda-graph-trace=node -o /tmp/p-$m-$l --force-overwrite true \
    $E bench --gpu 0 --model /dev/shm/m/$m.gguf --no-expert-profile --prompt 0 --gen 64 --reps 1 "$@" > /tmp/p-$m-$l.json 2> $R/p-$m-$l.err
  st "nsys $m $l rc=$? tg $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["tg"]["avg_ts"])' /tmp/p-$m-$l.json 2>&1 | tail -1)"
  timeout 60 $NSYS stats -r cuda_gpu_trace -f csv -o /tmp/p-$m-$l /tmp/p-$m-$l.nsys-rep > /dev/null 2>> $R/p-$m-$l.err
  local csvf=$(ls /tmp/p-$m-$l*cuda_gpu_trace*.csv 2>/dev/null | head -1)
  [ -n "$csvf" ] && python3 $C/nsys_summary.py $csvf --tokens 32 > $OUT/nsys-$m-$l.txt 2>&1 && head -30 $OUT/nsys-$m-$l.txt >> $S
  [ -n "$csvf" ] && xz -9 -c $csvf > $OUT/nsys-$m-$l.csv.xz
  tail -3 $R/p-$m-$l.err >> $S
}
prof q3u pdl
prof q3u nopdl --gpu-pdl off
prof q35s pdl
server q35s resident ', "--scratch-tokens", "512", "--lend-refill", "resident"'
st done
cp $R/*.err $OUT/ 2>/dev/null
cat $S
