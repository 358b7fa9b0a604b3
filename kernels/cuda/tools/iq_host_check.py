#!/usr/bin/env python3
"""Host-side check of the i-quant dot products of kernels/cuda/matvec_iq.cu, without a GPU.

Compiles the section of matvec_iq.cu between "i-quants (IQ2_XXS .. IQ1_M)" and "end of the i-quants", the
block layouts of common.cuh and the grids of iq_grids.cuh as host C++ (g++; __dp4a, __vcmpne4, __vsub4 and
the f16 conversion shimmed as plain functions), then, for each of the 7 formats, multiplies rows of random
blocks with random activations rounded to q8_1 as quantize.cu rounds them, and compares each row's sum (the
kernel's split: every (block, iqs) share, as the threads of a row take them) with the same product from the
gguf package's dequantizer (`gguf.quants.dequantize`) in float64. Prints the largest relative error per
format (against the row's sum of |w x|); exits 1 if one exceeds 1e-5.

Needs g++, numpy and gguf (`pip install gguf numpy`). From the repository root:

    python3 kernels/cuda/tools/iq_host_check.py
"""

import ctypes
import sys
import tempfile

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from host_cuda import compile_host, random_blocks, read, section

# (name, gguf type, block bytes, index of the format in the C table, where the f16 scale lives)
FORMATS = [
    ("iq2_xxs", T.IQ2_XXS, 66, 0, "d"),
    ("iq2_xs", T.IQ2_XS, 74, 1, "d"),
    ("iq2_s", T.IQ2_S, 82, 2, "d"),
    ("iq3_xxs", T.IQ3_XXS, 98, 3, "d"),
    ("iq3_s", T.IQ3_S, 110, 4, "d"),
    ("iq1_s", T.IQ1_S, 50, 5, "d"),
    ("iq1_m", T.IQ1_M, 56, 6, "iq1m"),
]

DRIVER = r"""
template <typename F>
static double row(const uint8_t * w, const block_q8_1 * x, int nblocks) {
    float acc = 0.0f;
    for (int kb = 0; kb < nblocks; ++kb) {
        for (int iqs = 0; iqs < F::qi; iqs += F::vdr) {
            acc += F::dot((const typename F::block *) w + kb, x + kb * (F::qk / QK8_1), iqs);
        }
    }
    return acc;
}

extern "C" double row_dot(int fmt, const uint8_t * w, const block_q8_1 * x, int nblocks) {
    switch (fmt) {
    case 0: return row<fmt_iq2_xxs>(w, x, nblocks);
    case 1: return row<fmt_iq2_xs>(w, x, nblocks);
    case 2: return row<fmt_iq2_s>(w, x, nblocks);
    case 3: return row<fmt_iq3_xxs>(w, x, nblocks);
    case 4: return row<fmt_iq3_s>(w, x, nblocks);
    case 5: return row<fmt_iq1_s>(w, x, nblocks);
    case 6: return row<fmt_iq1_m>(w, x, nblocks);
    }
    return 0.0;
}
"""


def build(tmp):
    dots = section(read("matvec_iq.cu"), "// ----- i-quants (IQ2_XXS .. IQ1_M)", "// ----- end of the i-quants")
    dll = compile_host(tmp, "iq_host", dots, DRIVER)
    dll.row_dot.restype = ctypes.c_double
    dll.row_dot.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return dll


def quantize_q8_1(x):
    """quantize.cu's block_q8_1: d = max|x|/127 (f16), q = round(x/d) (half away from zero), s = d*sum(q)."""
    blocks = x.reshape(-1, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=1)
    d = (amax / np.float32(127.0)).astype(np.float32)
    safe = np.where(d == 0, np.float32(1), d)
    r = blocks / safe[:, None]
    q = np.where(d[:, None] == 0, 0, np.sign(r) * np.floor(np.abs(r) + 0.5)).astype(np.int8)
    d16 = d.astype(np.float16)
    s16 = (d * q.astype(np.float32).sum(axis=1)).astype(np.float16)
    raw = np.zeros((blocks.shape[0], 36), dtype=np.uint8)
    raw[:, 0:2] = d16.view(np.uint8).reshape(-1, 2)
    raw[:, 2:4] = s16.view(np.uint8).reshape(-1, 2)
    raw[:, 4:] = q.view(np.uint8)
    deq = q.astype(np.float64) * d16.astype(np.float64)[:, None]
    return raw, deq.reshape(-1)


def main():
    rng = np.random.default_rng(16)
    rows, cols = 64, 2048
    nblocks = cols // 256
    worst_all = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        dll = build(tmp)
        for name, ty, size, idx, scale_kind in FORMATS:
            w = random_blocks(rng, rows * nblocks, size, scale_kind).reshape(rows, nblocks * size)
            wf = dequantize(w, ty).astype(np.float64).reshape(rows, cols)
            worst, worst_abs = 0.0, 0.0
            for trial in range(4):
                x = rng.standard_normal(cols).astype(np.float32) * (1 + 3 * trial)
                xq, xd = quantize_q8_1(x)
                xq = np.ascontiguousarray(xq)
                for r in range(rows):
                    wr = np.ascontiguousarray(w[r])
                    got = dll.row_dot(idx, wr.ctypes.data, xq.ctypes.data, nblocks)
                    want = float(wf[r] @ xd)
                    scale = float(np.abs(wf[r]) @ np.abs(xd))
                    err = abs(got - want) / scale
                    worst = max(worst, err)
                    worst_abs = max(worst_abs, abs(got - want) / max(abs(want), 1e-30))
            worst_all = max(worst_all, worst)
            print(f"{name:8s} max |got - want| / sum|w x| = {worst:.2e}   (/ |want|: {worst_abs:.2e})")
    if worst_all > 1e-5:
        print("FAILED")
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
