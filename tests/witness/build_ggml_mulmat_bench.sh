#!/bin/bash
# Build ggml_mulmat_bench against an existing llama.cpp CMake build (shared libs, BUILD_SHARED_LIBS=ON).
# usage: build_ggml_mulmat_bench.sh [LLAMA_SRC] [LLAMA_BUILD] [OUT]
#   defaults: /work/ref/llama_cpp_python-0.3.36/vendor/llama.cpp  /work/llama-build  /work/llama-build/bin/ggml_mulmat_bench
# The llama.cpp build itself (see README.md):
#   cmake -S $LLAMA_SRC -B $LLAMA_BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON ...
#   ninja -C $LLAMA_BUILD -j2 ggml
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=${1:-/work/ref/llama_cpp_python-0.3.36/vendor/llama.cpp}
BUILD=${2:-/work/llama-build}
OUT=${3:-$BUILD/bin/ggml_mulmat_bench}
LIBDIR=$(dirname "$(find "$BUILD" -name 'libggml-cpu.so' | head -1)")
g++ -O2 -std=c++17 -march=native -I"$SRC/ggml/include" "$HERE/ggml_mulmat_bench.cpp" \
    -L"$LIBDIR" -lggml -lggml-cpu -lggml-base -Wl,-rpath,"$LIBDIR" -lpthread -o "$OUT"
echo "built $OUT"
