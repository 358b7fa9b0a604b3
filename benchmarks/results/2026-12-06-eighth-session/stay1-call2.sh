#!/bin/bash
# Session 8, call 2: llama.cpp at 8 GB (--n-cpu-moe scanned) and every layer on the card, then ours through
# the server with NEW's defaults, and with call 1's winning variant if one beat the defaults by 3%.
set -u
export POLY_ENGINE_BIN=/tmp/bin/poly-engine OUT=$DEVOUT RAW=0 POLY_KERNEL_CACHE=/tmp/pkc
C=.carry/s8
MODELS="q3u q35s" bash benchmarks/offload_vs_llama.sh $C llama
BENCH=0 LEAN=1 FULL=0 SERVER_MODELS="q35s q3u" bash benchmarks/offload_vs_llama.sh $C ours
mv $OUT/summary-ours.txt $OUT/summary-server.txt
V=$(python3 $C/pick.py /tmp/s8-ours1.txt)
echo "call 1's variant beating the defaults by 3% on both: [$V]" | tee -a $OUT/summary-server.txt
if [ -n "$V" ]; then
    A=$(python3 -c 'import json,sys; print(", ".join(json.dumps(a) for a in sys.argv[1].split()))' "$V")
    SERVER_ARGS="$A" BENCH=0 LEAN=1 FULL=0 SERVER_MODELS="q35s q3u" bash benchmarks/offload_vs_llama.sh $C ours
    mv $OUT/summary-ours.txt $OUT/summary-server-variant.txt
fi
rm -f $OUT/server-*.err $OUT/server-*.txt
