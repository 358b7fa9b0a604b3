#!/usr/bin/env bash
# Builds tests/witness/picture_logits.cpp against the CPU build of the pinned llama.cpp that
# build_vision_rows.sh configures (static, native, no OpenMP): its `llama` and `mtmd` targets.
#   bash tests/witness/build_picture_logits.sh [SRC] [BUILD=/tmp/llama-vision] [OUT=/tmp/picture_logits]
set -euo pipefail
SRC=${1:-/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp}
BUILD=${2:-/tmp/llama-vision}
OUT=${3:-/tmp/picture_logits}
HERE=$(cd "$(dirname "$0")" && pwd)
if [ ! -f "$BUILD/build.ninja" ]; then
    cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_OPENMP=OFF \
          -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
          -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
fi
ninja -C "$BUILD" llama mtmd
g++ -O2 -std=c++17 "$HERE/picture_logits.cpp" -I"$SRC/tools/mtmd" -I"$SRC/include" -I"$SRC/ggml/include" \
    "$BUILD/tools/mtmd/libmtmd.a" "$BUILD/src/libllama.a" "$BUILD/vendor/hash/libvendor-hash.a" \
    "$BUILD/ggml/src/libggml.a" "$BUILD/ggml/src/libggml-cpu.a" "$BUILD/ggml/src/libggml-base.a" \
    -lpthread -ldl -o "$OUT"
echo "built $OUT"
