#!/usr/bin/env bash
# The differential check of models/src/vision/jpeg.rs against stb_image on random JPEGs
# (make_jpeg_random.py: N clean ones, and 500 damaged: cut short or with bits flipped):
# - clean: stb as mtmd compiles it (jpeg_stb.cpp) must be matched byte for byte;
# - damaged: where stb reads memory it never wrote (no scan, blocks after a missing restart marker, a
#   progressive picture cut short, which it hands back unfinished), its answer is whatever the heap held,
#   so they are compared with a copy of the same stb whose allocations are zeroed and which finishes a
#   progressive picture at an early end (two lines changed, below); everything else is stb's own code.
#   bash tests/witness/jpeg_stb_diff.sh [LLAMA=…/vendor/llama.cpp] [PYTHON with Pillow] [N=400] [SEED=7]
# (2026-12-07: 530 clean JPEGs equal; 427 damaged equal, 38 refused by both, 35 without a scan refused
# here where stb hands back unwritten memory.)
set -euo pipefail
LLAMA=${1:-/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp}
PYTHON=${2:-python3}
N=${3:-400}
SEED=${4:-7}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
W=$(mktemp -d)
g++ -O3 -DNDEBUG -std=c++17 -I"$LLAMA/vendor" "$HERE/jpeg_stb.cpp" -o "$W/stb"
mkdir -p "$W/zeroed/stb"
sed 's/         if (!stbi__process_marker(j, m)) return 1;/         if (!stbi__process_marker(j, m)) { if (j->progressive) stbi__jpeg_finish(j); return 1; }/' \
    "$LLAMA/vendor/stb/stb_image.h" > "$W/zeroed/stb/stb_image.h"
grep -q 'if (j->progressive) stbi__jpeg_finish(j); return 1;' "$W/zeroed/stb/stb_image.h"
sed 's|#define STB_IMAGE_IMPLEMENTATION|#include <cstdlib>\n#define STBI_MALLOC(sz) calloc(1, sz)\n#define STBI_REALLOC(p, sz) realloc(p, sz)\n#define STBI_FREE(p) free(p)\n#define STB_IMAGE_IMPLEMENTATION|' \
    "$HERE/jpeg_stb.cpp" > "$W/zeroed/jpeg_stb.cpp"
g++ -O3 -DNDEBUG -std=c++17 -I"$W/zeroed" "$W/zeroed/jpeg_stb.cpp" -o "$W/stb-zeroed"
"$PYTHON" "$HERE/make_jpeg_random.py" "$W/clean/set" "$SEED" "$N" --damage "$W/damaged/set" 2>/dev/null
for kind in clean damaged; do
  mkdir -p "$W/$kind/stbout"
  bin=$W/stb; [ "$kind" = damaged ] && bin=$W/stb-zeroed
  "$bin" "$W/$kind/stbout" "$W/$kind"/set/*.jpg > "$W/$kind/stb.txt"
  echo "== $kind: $(wc -l < "$W/$kind/stb.txt") files"
  (cd "$ROOT" && JPEG_STB_DIFF=$W/$kind cargo test -q -p poly-models --test jpeg_stb_diff -- --ignored --nocapture)
done
rm -rf "$W"
