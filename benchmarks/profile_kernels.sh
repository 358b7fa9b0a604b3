#!/bin/bash
# Where a decoded token's time goes on the card, ours against llama.cpp's, kernel by kernel: every weight in
# VRAM, one synthetic model per shape written on the H200 machine, and both engines answering under Nsight
# Compute (`ncu`, graph kernels profiled node by node, caches and clocks left alone): each kernel's own
# duration over a window of a steady token's launches, as CSV (`benchmarks/kernel_table.py` sums them per
# kernel and per layer). The machine's `nsys` (the copy inside Nsight Compute) records but cannot convert
# its reports (no QdstrmImporter there), so the launch gaps are what a token's time leaves over.
#
# usage (repository root on the device): bash benchmarks/profile_kernels.sh CARRY_DIR
# CARRY_DIR holds bin.tar.xz (poly-engine), llama.cpp.tar.xz and llamacpp_build_cuda.sh, as for
# offload_vs_llama.sh. MODELS: which shapes (q3u: qwen3moe 30B-A3B uniform; q35s: qwen35moe 35B-A3B skew 1).
# GEN: tokens answered per run. Results in $OUT.
set -u
C=$1
OUT=${OUT:-/tmp/profile-out}
MODELS=${MODELS:-"q3u q35s"}
GEN=${GEN:-32}
mkdir -p "$OUT" /tmp/bin /tmp/lsrc /tmp/lcb /dev/shm/m /tmp/prof
S=$OUT/summary.txt; : > "$S"
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$S"; }
export POLY_KERNEL_CACHE=/tmp/pkc
E=/tmp/bin/poly-engine
LB=/tmp/lcb/build/bin/llama-bench

# A stay that ran offload_vs_llama.sh's prep before has the binaries, the models and llama.cpp already.
[ -x $E ] || tar xJf $C/bin.tar.xz -C /tmp/bin
[ -d /tmp/lsrc/llama.cpp ] || tar xJf $C/llama.cpp.tar.xz -C /tmp/lsrc
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
stamp "ncu: ${NCU:-none}"
[ -n "$NCU" ] || exit 2
# SKIP: launches before the window (past the warm-up and the first tokens); COUNT: the window.
SKIP=${SKIP:-3000}
COUNT=${COUNT:-240}
if [ ! -e /tmp/lcb/build.done ]; then
    stamp "build llama.cpp CUDA (background, its own session)"
    setsid bash $C/llamacpp_build_cuda.sh /tmp/lsrc/llama.cpp /tmp/lcb/build /tmp/lcb > /tmp/lcb/llama_build.txt 2>&1 < /dev/null &
fi
synth() {
    [ -e /dev/shm/m/$4.gguf ] && return
    $E synth --arch $1 --shape $2 --type Q4_K --seed 1 --route-skew $3 --out /dev/shm/m/$4.gguf > /tmp/prof/synth-$4.txt 2>&1
}
P=()
for m in $MODELS; do
    case $m in
        q3u) synth qwen3moe qwen3-30b-a3b 0 q3u & P+=($!) ;;
        q35s) synth qwen35moe qwen3.6-35b-a3b 1 q35s & P+=($!) ;;
    esac
done
wait "${P[@]}"
stamp "models written"

trace() { # name, command...
    local name=$1; shift
    timeout 240 $NCU --graph-profiling node --launch-skip $SKIP --launch-count $COUNT \
        --metrics gpu__time_duration.sum --cache-control none --clock-control none --csv --print-units base \
        "$@" > /tmp/prof/$name.out 2> /tmp/prof/$name.err
    echo "$name rc=$?" | tee -a "$S"
    grep '^"' /tmp/prof/$name.out > "$OUT/$name.csv"
    wc -l "$OUT/$name.csv" | tee -a "$S"
    tail -3 /tmp/prof/$name.err >> "$S"
}
for m in $MODELS; do
    trace ours-$m $E bench --model /dev/shm/m/$m.gguf --gpu 0 --prompt 0 --gen $GEN --reps 1 --no-expert-profile
done
stamp "wait for the llama.cpp build"
while [ ! -e /tmp/lcb/build.done ] && [ ! -e /tmp/lcb/build.failed ]; do sleep 2; done
tail -2 /tmp/lcb/llama_build.txt | tee -a "$S"
for m in $MODELS; do
    trace llama-$m $LB -m /dev/shm/m/$m.gguf -ngl 99 -fa 1 -p 0 -n $GEN -r 1
done
stamp done
