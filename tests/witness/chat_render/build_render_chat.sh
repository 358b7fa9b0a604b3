#!/bin/bash
# Builds render_chat (llama.cpp's chat template rendering) against the CMake build of llama.cpp.
# usage: build_render_chat.sh [LLAMA_SRC] [LLAMA_BUILD] -> prints the binary's path
set -euo pipefail
SRC=${1:-/work/ref/llama_cpp_python-0.3.36/vendor/llama.cpp}
BUILD=${2:-/work/llama-build}
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/render_chat}
g++ -std=c++17 -O1 -o "$OUT" "$HERE/render_chat.cpp" \
    -I"$SRC/common" -I"$SRC/include" -I"$SRC/ggml/include" -I"$SRC/vendor" \
    -L"$BUILD/bin" -lllama-common -lllama -Wl,-rpath,"$BUILD/bin"
echo "$OUT"
