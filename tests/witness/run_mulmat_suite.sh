#!/bin/bash
# Run the ggml mul_mat speed suite we compare our Rust kernels against: 4096x4096 weight, every
# type, N=1 and N=512, 1 and 2 threads, plain and repacked layouts; cache-warm and (N=1 only)
# DRAM-bound (weights rotated over 256 MB). Writes raw outputs and a markdown table to OUT_DIR.
# ~15 min on the shared 2-core machine.
# usage: run_mulmat_suite.sh [OUT_DIR=/work/ref] [BENCH=/work/llama-build/bin/ggml_mulmat_bench] [PYTHON=/work/venv-witness/bin/python]
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-/work/ref}
B=${2:-/work/llama-build/bin/ggml_mulmat_bench}
PY=${3:-/work/venv-witness/bin/python}
# Passive OpenMP waiting: on a machine whose cores are shared with other jobs, spinning workers
# steal the core their partner needs and 2-thread ops slow down 10x; passive waiting avoids that.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
run() {
    local f=$1; shift
    { echo "# OMP_WAIT_POLICY=$OMP_WAIT_POLICY; started $(date -u +%FT%TZ); load: $(cat /proc/loadavg)"
      "$B" "$@" 2>&1 | grep --line-buffered -v '^repack: repack tensor'
      echo "# finished $(date -u +%FT%TZ); load: $(cat /proc/loadavg)"; } > "$f"
}
run "$OUT/ggml_mulmat_bench_4096_hot.txt"  --types all --n 1,512 --threads 1,2 --layout both --min-time 1.0 --min-reps 3
run "$OUT/ggml_mulmat_bench_4096_cold.txt" --types all --n 1 --threads 1,2 --layout both --rotate-mb 256 --min-time 1.0 --min-reps 5
"$PY" "$HERE/mulmat_perf_table.py" --summary \
    --bench "$OUT/ggml_mulmat_bench_4096_hot.txt" "$OUT/ggml_mulmat_bench_4096_cold.txt" > "$OUT/ggml_mulmat_bench_4096.md"
echo "wrote $OUT/ggml_mulmat_bench_4096.md"
