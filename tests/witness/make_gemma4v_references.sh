#!/usr/bin/env bash
# Writes the Gemma 4 vision references of tests/fixtures/vision/ (gemma4v-tiny-{f32,f16,bf16}.rows.bin) from
# llama.cpp's mtmd and prints the SHA-256 values gemma4v-references.json holds, so that a change shows in
# `git diff` and in the printed lines: the tiny gemma4v projectors `poly-engine synth` writes (seed 1), the
# committed 64x48 picture encoded with at least 8 rows, and mtmd's preprocessed pictures at the manifest's
# token limits. VISION_ROWS: tests/witness/vision_rows.cpp built by build_vision_rows.sh.
#   bash tests/witness/make_gemma4v_references.sh [POLY_ENGINE=target/release/poly-engine] [VISION_ROWS=/tmp/vision_rows]
set -euo pipefail
cd "$(dirname "$0")/../.."
ENGINE=${1:-target/release/poly-engine}
VISION_ROWS=${2:-/tmp/vision_rows}
V=tests/fixtures/vision
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
for t in F32 F16 BF16; do
  "$ENGINE" synth --arch gemma4v-mmproj --shape tiny --type $t --seed 1 --out "$TMP/g4v-$t.gguf" 2>/dev/null
  echo "$t projector_sha256 $(sha256sum "$TMP/g4v-$t.gguf" | cut -d' ' -f1)"
  VISION_ROWS_MIN_TOKENS=8 "$VISION_ROWS" "$TMP/g4v-$t.gguf" $V/picture-64x48.png \
      "$V/gemma4v-tiny-${t,,}.rows.bin" off 2>/dev/null
done
# Preprocessing: picture, least rows, most rows (mtmd's defaults are 70 and 1120).
for c in "picture-64x48.png 70 1120" "picture-50x30.png 70 1120" "picture-300x200.png 70 1120" \
         "picture-64x48.png 8 1120" "picture-300x200.png 8 20"; do
  set -- $c
  VISION_ROWS_MIN_TOKENS=$2 VISION_ROWS_MAX_TOKENS=$3 VISION_ROWS_PICTURE="$TMP/pic.bin" \
      "$VISION_ROWS" "$TMP/g4v-F32.gguf" "$V/$1" "$TMP/rows.bin" off 2>/dev/null | tr -d '\n'
  echo " $1 [$2, $3] sha256 $(sha256sum "$TMP/pic.bin" | cut -d' ' -f1)"
done
