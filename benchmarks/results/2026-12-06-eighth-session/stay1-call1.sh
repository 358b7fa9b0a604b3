#!/bin/bash
# Session 8, call 1: the models, llama.cpp's build (background), the card tests, then our A/B at 8 GB
# (BASE = main before the change, NEW = the card's guess behind the route point) and every weight in VRAM.
set -u
export POLY_ENGINE_BIN=/tmp/bin/poly-engine OUT=$DEVOUT RAW=0 POLY_KERNEL_CACHE=/tmp/pkc
C=.carry/s8
MODELS="q3u q35s" TEST_BINS="cuda_host_flags gpu_expert_cache gpu_forward" TEST_TIMEOUT=200 bash benchmarks/offload_vs_llama.sh $C prep
grep -hE "^test .*(FAILED|ok)$" /tmp/ovl/cuda_host_flags.txt /tmp/ovl/gpu_expert_cache.txt /tmp/ovl/gpu_forward.txt > $OUT/tests.txt 2>&1
grep -h -B2 -A12 "panicked" /tmp/ovl/cuda_host_flags.txt /tmp/ovl/gpu_expert_cache.txt /tmp/ovl/gpu_forward.txt | head -60 >> $OUT/tests.txt
MODELS="q3u q35s" PP_ROUNDS=1 ROUNDS=2 VGEN=64 VBASE=1 VARIANTS="--copy-ahead-at route;--copy-ahead-at route --copy-ahead 3;--copy-ahead-at route --copy-ahead 4" LEAN=1 SERVER=0 FULL=1 bash benchmarks/offload_vs_llama.sh $C ours
cp $OUT/summary-ours.txt /tmp/s8-ours1.txt
