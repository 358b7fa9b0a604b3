#!/usr/bin/env bash
# The JPEG witness: the bytes llama.cpp's mtmd decodes JPEGs to (stb_image, compiled as mtmd compiles it:
# jpeg_stb.cpp), for the fixtures of tests/fixtures/vision/jpeg/ (written by make_jpeg_fixtures.py with
# Pillow). Writes FIXTURE.rgb next to each FIXTURE.jpg and stb.txt ("NAME WIDTH HEIGHT" a line), which
# models/src/vision/jpeg.rs's tests compare the decoder with byte for byte.
#   bash tests/witness/jpeg_stb_witness.sh [LLAMA=…/vendor/llama.cpp] [PYTHON=python3 with Pillow] [CJPEG]
#   (fixtures of 2026-12-07: Pillow 13.0.0, cjpeg of libjpeg-turbo 2.1.5 (Debian libjpeg-turbo-progs),
#   g++ of Debian 12, x86-64)
set -euo pipefail
LLAMA=${1:-/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp}
PYTHON=${2:-python3}
CJPEG=${3:-$(command -v cjpeg || true)}
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=$HERE/../fixtures/vision/jpeg
BIN=$(mktemp -d)/jpeg_stb
g++ -O3 -DNDEBUG -std=c++17 -I"$LLAMA/vendor" "$HERE/jpeg_stb.cpp" -o "$BIN"
mkdir -p "$OUT"
rm -f "$OUT"/*.jpg "$OUT"/*.rgb
"$PYTHON" "$HERE/make_jpeg_fixtures.py" "$OUT" $CJPEG
"$BIN" "$OUT" "$OUT"/*.jpg > "$OUT/stb.txt"
cat "$OUT/stb.txt"
du -ch "$OUT" | tail -1
