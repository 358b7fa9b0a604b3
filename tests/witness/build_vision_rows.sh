#!/usr/bin/env bash
# Builds tests/witness/vision_rows.cpp against a CPU build of the pinned llama.cpp's mtmd library (static,
# native, no OpenMP). SRC: the llama.cpp of the pinned sdist; BUILD: where its CMake build goes; OUT: the
# binary.
#   bash tests/witness/build_vision_rows.sh [SRC] [BUILD=/tmp/llama-vision] [OUT=/tmp/vision_rows]
set -euo pipefail
SRC=${1:-/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp}
BUILD=${2:-/tmp/llama-vision}
OUT=${3:-/tmp/vision_rows}
HERE=$(cd "$(dirname "$0")" && pwd)
cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_OPENMP=OFF \
      -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
      -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
ninja -C "$BUILD" mtmd
g++ -O2 -std=c++17 "$HERE/vision_rows.cpp" -I"$SRC/tools/mtmd" -I"$SRC/include" -I"$SRC/ggml/include" \
    -I"$SRC/vendor" "$BUILD/tools/mtmd/libmtmd.a" "$BUILD/ggml/src/libggml.a" \
    "$BUILD/ggml/src/libggml-cpu.a" "$BUILD/ggml/src/libggml-base.a" -lpthread -o "$OUT"
echo "built $OUT"
