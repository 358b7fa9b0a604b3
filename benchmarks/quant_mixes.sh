#!/usr/bin/env bash
# Issue 24: files as users have them. Writes F32 models with `poly-engine synth`, turns each into
# llama-quantize's type mixes, then times our CPU engine against llama.cpp's llama-bench on every file
# (benchmarks/cpu_vs_llama.py: pp512 and tg128, both engines back to back, alternating which goes first).
#
#   bash benchmarks/quant_mixes.sh                      # defaults below
#   THREADS=16 LLAMA_BIN=/path/to/llama.cpp/build/bin WORK=/dev/shm/qmix bash benchmarks/quant_mixes.sh
#   MIXES="Q4_K_M UD_Q2_K_XL" SHAPES="qwen3moe:mix" ROUNDS=3 bash benchmarks/quant_mixes.sh
#   QUANTIZE_ONLY=1 bash benchmarks/quant_mixes.sh      # write the files, run nothing
#
# Environment (all optional):
#   LLAMA_BIN   directory holding llama-quantize and llama-bench        [/tmp/llama-tools/bin]
#   ENGINE      poly-engine binary                                      [target/release/poly-engine]
#   WORK        where the F32 and quantized files go (not the repo)     [/tmp/qmix]
#   THREADS     threads of both engines                                 [2]
#   QUANT_THREADS  llama-quantize's threads                             [nproc]
#   SHAPES      ARCH:SHAPE ... (see `poly-engine synth --list-shapes`)  [qwen3moe:mix]
#   MIXES       Q4_K_M Q5_K_M Q3_K_M Q2_K IQ4_XS UD_Q2_K_XL              [all six]
#   ROUNDS      rounds per file (each: both engines, pp then tg)        [3]
#   REPS        repetitions per process (llama-bench -r)                [2]
#   OUT         directory for table.md and raw.json per shape           [$WORK/results]
#   KEEP_F32    1: keep the F32 file after quantizing (it is ~10 GB)    [1]
#
# UD_Q2_K_XL is a mix like unsloth's UD-Q2_K_XL: routed experts' gate/up in IQ2_XS and down in IQ3_XXS,
# the rest as llama-quantize's Q4_K_M makes it (attention Q4_K/Q6_K, output Q6_K). IQ2_XS and IQ3_XXS need
# an importance matrix in llama-quantize; the script writes one of all ones (no information: the speed of
# a file does not depend on it, its quality does, and these files are for timing only).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
LLAMA_BIN=${LLAMA_BIN:-/tmp/llama-tools/bin}
ENGINE=${ENGINE:-$ROOT/target/release/poly-engine}
WORK=${WORK:-/tmp/qmix}
THREADS=${THREADS:-2}
QUANT_THREADS=${QUANT_THREADS:-$(nproc)}
SHAPES=${SHAPES:-qwen3moe:mix}
MIXES=${MIXES:-Q4_K_M Q5_K_M Q3_K_M Q2_K IQ4_XS UD_Q2_K_XL}
ROUNDS=${ROUNDS:-3}
REPS=${REPS:-2}
OUT=${OUT:-$WORK/results}
KEEP_F32=${KEEP_F32:-1}

for tool in "$LLAMA_BIN/llama-quantize" "$LLAMA_BIN/llama-bench" "$ENGINE"; do
    [[ -x $tool ]] || { echo "missing $tool (set LLAMA_BIN / ENGINE)" >&2; exit 1; }
done
mkdir -p "$WORK" "$OUT"

# An importance matrix of ones (llama.cpp's legacy imatrix format) for every routed-expert tensor of
# `$1`: int32 count, then per entry int32 name length, name, int32 ncall, int32 nval, nval × f32.
# nval is ne0 × n_expert (llama-quantize checks it), read from the GGUF header.
ones_imatrix() {
    python3 - "$1" "$2" <<'PY'
import struct, sys
src, dst = sys.argv[1], sys.argv[2]
f = open(src, "rb")
def rd(fmt):
    return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))
def rstr():
    (n,) = rd("Q")
    return f.read(n).decode()
SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
def skip(t):
    if t == 8:
        rstr()
    elif t == 9:
        (et, n) = rd("IQ")
        for _ in range(n):
            skip(et)
    else:
        f.read(SIZES[t])
magic, version, n_t, n_kv = rd("4sIQQ")
assert magic == b"GGUF", src
for _ in range(n_kv):
    rstr()
    (t,) = rd("I")
    skip(t)
entries = []
for _ in range(n_t):
    name = rstr()
    (nd,) = rd("I")
    dims = rd("Q" * nd)
    rd("IQ")
    if "_exps." in name and nd == 3:
        entries.append((name, dims[0] * dims[2]))
with open(dst, "wb") as o:
    o.write(struct.pack("<i", len(entries)))
    for name, nval in entries:
        b = name.encode()
        o.write(struct.pack("<i", len(b)) + b + struct.pack("<ii", 1, nval))
        o.write(struct.pack("<f", 1.0) * nval)
print(f"{dst}: {len(entries)} expert tensors")
PY
}

quantize() { # F32 OUT MIX
    local f32=$1 out=$2 mix=$3
    [[ -s $out ]] && return 0
    local args=()
    local ftype=$mix
    if [[ $mix == UD_Q2_K_XL ]]; then
        local imat=${f32%.gguf}.ones.imatrix
        [[ -s $imat ]] || ones_imatrix "$f32" "$imat"
        args=(--imatrix "$imat"
              --tensor-type ffn_gate_exps=iq2_xs --tensor-type ffn_up_exps=iq2_xs
              --tensor-type ffn_down_exps=iq3_xxs)
        ftype=Q4_K_M
    fi
    echo "== llama-quantize $mix -> $out" >&2
    "$LLAMA_BIN/llama-quantize" "${args[@]}" "$f32" "$out.tmp" "$ftype" "$QUANT_THREADS" > "$out.log" 2>&1 \
        || { tail -20 "$out.log" >&2; exit 1; }
    mv "$out.tmp" "$out"
}

for sa in $SHAPES; do
    arch=${sa%%:*} shape=${sa#*:}
    stem=$WORK/$arch-$shape
    f32=$stem-f32.gguf
    if [[ ! -s $f32 ]] && ! (for m in $MIXES; do [[ -s $stem-$m.gguf ]] || exit 1; done); then
        echo "== synth $arch $shape F32 -> $f32" >&2
        "$ENGINE" synth --arch "$arch" --shape "$shape" --type F32 --seed 1 --out "$f32"
    fi
    models=()
    for m in $MIXES; do
        quantize "$f32" "$stem-$m.gguf" "$m"
        models+=(--model "$arch $shape $m=$stem-$m.gguf")
    done
    [[ $KEEP_F32 == 1 ]] || rm -f "$f32"
    [[ ${QUANTIZE_ONLY:-0} == 1 ]] && continue
    python3 "$ROOT/benchmarks/cpu_vs_llama.py" --threads "$THREADS" --rounds "$ROUNDS" --reps "$REPS" \
        --engine "$ENGINE" --llama-bench "$LLAMA_BIN/llama-bench" "${models[@]}" \
        --out "$OUT/$arch-$shape-t$THREADS"
done
