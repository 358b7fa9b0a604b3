#!/usr/bin/env python3
"""Host-side check of the i-quant formats of the tensor-core prompt kernels (kernels/cuda/mmq_iq.cu), without
a GPU.

Compiles the section of mmq_iq.cu between "The 8 sign bits" and "end of the i-quant formats", the block
layouts of common.cuh and the grids of iq_grids.cuh as host C++ (g++; __vcmpne4, __vsub4, __byte_perm and the
f16 conversion shimmed as plain functions), then, for each of the 9 formats, unpacks random blocks sub-block
by sub-block as the kernels' a_stage_sub does (load, then unpack to 8 ints of int8 and a scale) and compares
value = scale.x * q - scale.y (k16 formats: scale.x for values 0..15, scale.y for 16..31) with the gguf
package's dequantizer (`gguf.quants.dequantize`). The products on the tensor cores are exact integer sums of
these int8 values, so this checks what the kernels multiply. Prints the largest error per format (relative to
the block's largest |value|; the values are small integers times an f16, so both sides are exact in f32 and
the error is 0 when the unpacking is right); exits 1 if one exceeds 1e-6, if a quant leaves int8 or if a
format that says it has no offset returns one.

Needs g++, numpy and gguf (`pip install gguf numpy`). From the repository root:

    python3 kernels/cuda/tools/mmq_iq_host_check.py
"""

import ctypes
import sys
import tempfile

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from host_cuda import compile_host, random_blocks, read, section

# (name, gguf type, block bytes, values per block, index in the C switch, where the f16 scale lives)
FORMATS = [
    ("iq1_s", T.IQ1_S, 50, 256, 0, "d"),
    ("iq1_m", T.IQ1_M, 56, 256, 1, "iq1m"),
    ("iq2_xxs", T.IQ2_XXS, 66, 256, 2, "d"),
    ("iq2_xs", T.IQ2_XS, 74, 256, 3, "d"),
    ("iq2_s", T.IQ2_S, 82, 256, 4, "d"),
    ("iq3_xxs", T.IQ3_XXS, 98, 256, 5, "d"),
    ("iq3_s", T.IQ3_S, 110, 256, 6, "d"),
    ("iq4_nl", T.IQ4_NL, 18, 32, 7, "d"),
    ("iq4_xs", T.IQ4_XS, 136, 256, 8, "d"),
]

DRIVER = r"""
// One row of nblocks blocks unpacked as a_stage_sub does: every sub-block of every block through load and
// unpack. Returns 1 if a quant left the int8 range the unpacking promises (|q| <= 127).
template <typename F>
static int row(const uint8_t * w, int nblocks, float * out) {
    const typename F::block * b = (const typename F::block *) w;
    for (int kb = 0; kb < nblocks; ++kb) {
        for (int sub = 0; sub < F::qk / 32; ++sub) {
            const typename F::raw r = F::load(b + kb, sub);
            int q[8];
            const float2 sc = F::unpack(r, q);
            if constexpr (!F::k16) {
                if (!F::offset && sc.y != 0.0f) return 3; // the products would drop this offset
            }
            for (int i = 0; i < 32; ++i) {
                const int v = (int) (int8_t) (q[i / 4] >> (8 * (i % 4)));
                if (v == -128) return 1;
                float s = sc.x, off = sc.y;
                if (F::k16) {
                    s = i < 16 ? sc.x : sc.y;
                    off = 0.0f;
                }
                out[kb * F::qk + 32 * sub + i] = s * (float) v - off;
            }
        }
    }
    return 0;
}

extern "C" int unpack_row(int fmt, const uint8_t * w, int nblocks, float * out) {
    switch (fmt) {
    case 0: return row<mmq_iq1_s>(w, nblocks, out);
    case 1: return row<mmq_iq1_m>(w, nblocks, out);
    case 2: return row<mmq_iq2_xxs>(w, nblocks, out);
    case 3: return row<mmq_iq2_xs>(w, nblocks, out);
    case 4: return row<mmq_iq2_s>(w, nblocks, out);
    case 5: return row<mmq_iq3_xxs>(w, nblocks, out);
    case 6: return row<mmq_iq3_s>(w, nblocks, out);
    case 7: return row<mmq_iq4_nl>(w, nblocks, out);
    case 8: return row<mmq_iq4_xs>(w, nblocks, out);
    }
    return 2;
}
"""


def build(tmp):
    formats = section(read("mmq_iq.cu"), "// The 8 sign bits", "// ----- end of the i-quant formats")
    dll = compile_host(tmp, "mmq_iq_host", formats, DRIVER)
    dll.unpack_row.restype = ctypes.c_int
    dll.unpack_row.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    return dll


def main():
    rng = np.random.default_rng(16)
    rows, cols = 64, 2048
    worst_all = 0.0
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        dll = build(tmp)
        for name, ty, size, qk, idx, scale_kind in FORMATS:
            nblocks = cols // qk
            w = random_blocks(rng, rows * nblocks, size, scale_kind, signed_scale=True).reshape(rows, nblocks * size)
            want = dequantize(w, ty).astype(np.float32).reshape(rows, cols)
            worst = 0.0
            out = np.zeros(cols, dtype=np.float32)
            for r in range(rows):
                wr = np.ascontiguousarray(w[r])
                rc = dll.unpack_row(idx, wr.ctypes.data, nblocks, out.ctypes.data)
                if rc != 0:
                    print(f"{name}: " + ("a quant outside -127..127" if rc == 1 else "an offset the products drop"))
                    failed = True
                    break
                scale = max(float(np.abs(want[r]).max()), 1e-30)
                worst = max(worst, float(np.abs(out.astype(np.float64) - want[r]).max()) / scale)
            worst_all = max(worst_all, worst)
            print(f"{name:8s} max |unpacked - gguf| / max|value| = {worst:.2e}")
    if failed or worst_all > 1e-6:
        print("FAILED")
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
