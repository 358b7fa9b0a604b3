#!/bin/bash
# Session 8, stay 2 (one call): the copies ahead at the route point within a bus budget (NEW defaults:
# --copy-ahead-at route, --copy-ahead-us 140, --copy-ahead 4) against the guess change with the old ones
# (BASE: --copy-ahead 2 after the share), alternating; the card tests of copies ahead; the server; and
# llama.cpp at 8 GB on the same host.
set -u
export POLY_ENGINE_BIN=/tmp/bin/poly-engine OUT=$DEVOUT RAW=0 POLY_KERNEL_CACHE=/tmp/pkc
C=.carry/s9
MODELS="q3u q35s" TEST_BINS="gpu_expert_cache" TEST_TIMEOUT=200 bash benchmarks/offload_vs_llama.sh $C prep
grep -hE "^test .*(FAILED|ok)$" /tmp/ovl/gpu_expert_cache.txt > $OUT/tests.txt 2>&1
grep -h -B2 -A12 "panicked" /tmp/ovl/gpu_expert_cache.txt | head -60 >> $OUT/tests.txt
MODELS="q3u q35s" PP_ROUNDS=0 ROUNDS=3 VGEN=64 VBASE=1 VARIANTS="--copy-ahead-us 0 --copy-ahead 2" LEAN=1 SERVER=1 FULL=0 SERVER_MODELS="q35s q3u" bash benchmarks/offload_vs_llama.sh $C ours
rm -f $OUT/server-*.err $OUT/server-*.txt
MODELS="q3u q35s" PP30000=0 bash benchmarks/offload_vs_llama.sh $C llama
