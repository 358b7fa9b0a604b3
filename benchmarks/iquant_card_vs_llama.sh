#!/bin/bash
# The i-quants on the card against llama.cpp's CUDA build on the same card (issue 16 §5): our kernels by
# cuda_bench's `bench_iquants_as_test_backend_ops`, llama.cpp's by its own `test-backend-ops perf` at the
# same shapes (MUL_MAT m=4096 k=14336 n=1/8/512, MUL_MAT_ID at Qwen3-30B-A3B's expert shape), then the two
# paired per type and shape. Both include quantizing the f32 activations to q8_1, as llama.cpp's op does.
#
# usage (repository root on the device, after benchmarks/offload_vs_llama.sh's prep has unpacked the
# binaries into /tmp/bin and built llama.cpp into /tmp/lcb/build):
#   bash benchmarks/iquant_card_vs_llama.sh CARRY_DIR
# CARRY_DIR holds test-backend-ops.cpp from the pinned sdist's tests/ (the trimmed llama.cpp carry has no
# tests/). Results: $OUT/iquants.txt (paired table), $OUT/iquants-ours.txt, $OUT/iquants-llama.txt.
set -u
C=$1
OUT=${OUT:-/tmp/offload-out}
mkdir -p "$OUT"
export POLY_KERNEL_CACHE=/tmp/pkc
while [ ! -e /tmp/lcb/build.done ] && [ ! -e /tmp/lcb/build.failed ]; do sleep 2; done
TBO=/tmp/lcb/test-backend-ops
if [ ! -x $TBO ] && [ -e /tmp/lcb/build.done ]; then
    g++ -O2 -std=c++17 -I/tmp/lsrc/llama.cpp/ggml/include "$C/test-backend-ops.cpp" \
        -L/tmp/lcb/build/bin -lggml -lggml-base -lggml-cpu -lpthread -Wl,-rpath,/tmp/lcb/build/bin \
        -o $TBO > "$OUT/tbo-build.txt" 2>&1 || echo "test-backend-ops did not build: $(tail -3 "$OUT/tbo-build.txt")"
fi
timeout 300 /tmp/bin/cuda_bench --ignored --exact bench_iquants_as_test_backend_ops --nocapture \
    > "$OUT/iquants-ours.txt" 2>&1
if [ -x $TBO ]; then
    timeout 300 $TBO perf -b CUDA0 -o MUL_MAT -p 'type_a=(iq1_s|iq1_m|iq2_xxs|iq2_xs|iq2_s|iq3_xxs|iq3_s|iq4_xs|iq4_nl|q4_K),type_b=f32,m=4096,n=(1|8|512),k=14336,' \
        > "$OUT/iquants-llama.txt" 2>&1
    timeout 300 $TBO perf -b CUDA0 -o MUL_MAT_ID -p 'type_a=(iq2_xs|iq4_xs|q4_K),type_b=f32,n_mats=128,n_used=8,b=0,m=768,n=1,k=2048' \
        >> "$OUT/iquants-llama.txt" 2>&1
fi
python3 - "$OUT/iquants-ours.txt" "$OUT/iquants-llama.txt" > "$OUT/iquants.txt" <<'PY'
import re, sys
ours, llama = {}, {}
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"iq (MUL_MAT(?:_ID)?) type_a=(\S+) .*?n=(\d+) .*eager ([\d.]+) us, graph ([\d.]+) us", line)
    if m:
        ours[(m[1], m[2], int(m[3]))] = (float(m[4]), float(m[5]))
try:
    lines = open(sys.argv[2], errors="replace").readlines()
except OSError:
    lines = []
for line in lines:
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    m = re.match(r"\s*(MUL_MAT(?:_ID)?)\(type_a=([^,]+),.*?,n=(\d+),.*?\):\s+\d+ runs -\s+([\d.]+) us/run", line)
    # Not test_mul_mat_id_fusion's lines (their parameters end in o= and mul=).
    if m and not (m[1] == "MUL_MAT_ID" and ",mul=" in line):
        llama.setdefault((m[1], m[2].lower(), int(m[3])), float(m[4]))
print("| op | type | n | ours eager us | ours graph us | llama.cpp us | llama.cpp / ours (eager) |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
for key in sorted(ours, key=lambda k: (k[0], k[1], k[2])):
    e, g = ours[key]
    l = llama.get((key[0], key[1].lower(), key[2]))
    ratio = "%.2fx" % (l / e) if l else "-"
    print("| %s | %s | %d | %.2f | %.2f | %s | %s |" % (key[0], key[1], key[2], e, g, "%.2f" % l if l else "-", ratio))
PY
cat "$OUT/iquants.txt"
