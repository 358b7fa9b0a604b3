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
import os
import subprocess
import sys
import tempfile

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
CUDA = os.path.join(ROOT, "kernels", "cuda")

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

SHIMS = r"""
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#define __device__
#define __forceinline__ inline
static inline int __dp4a(int a, int b, int c) {
    for (int k = 0; k < 4; ++k) c += (int) (int8_t) (a >> (8 * k)) * (int) (int8_t) (b >> (8 * k));
    return c;
}
static inline unsigned __vcmpne4(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int k = 0; k < 4; ++k) if (((a >> (8 * k)) & 0xFF) != ((b >> (8 * k)) & 0xFF)) r |= 0xFFu << (8 * k);
    return r;
}
static inline unsigned __vsub4(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int k = 0; k < 4; ++k) r |= ((((a >> (8 * k)) & 0xFF) - ((b >> (8 * k)) & 0xFF)) & 0xFF) << (8 * k);
    return r;
}
static inline float f16_to_f32(uint16_t h) {
    const int s = h >> 15, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    float v;
    if (e == 0) v = (float) m / 16777216.0f;            // subnormal: m * 2^-24
    else if (e == 31) v = m ? __builtin_nanf("") : __builtin_inff();
    else v = (1.0f + (float) m / 1024.0f) * __builtin_ldexpf(1.0f, e - 15);
    return s ? -v : v;
}
"""

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


def section(text, start, end):
    i = text.index(start)
    j = text.index(end, i)
    return text[i:j]


def build(tmp):
    common = open(os.path.join(CUDA, "common.cuh")).read()
    matvec = open(os.path.join(CUDA, "matvec_iq.cu")).read()
    grids = open(os.path.join(CUDA, "iq_grids.cuh")).read()
    # The block layouts and get_int_b2/b4 (the rest of common.cuh is device code).
    layouts = section(common, "#define QK_K 256", "// ----- shared by several modules")
    dots = section(matvec, "// ----- i-quants (IQ2_XXS .. IQ1_M)", "// ----- end of the i-quants")
    src = "\n".join([SHIMS, layouts, grids, dots, DRIVER])
    cpp = os.path.join(tmp, "iq_host.cpp")
    lib = os.path.join(tmp, "iq_host.so")
    open(cpp, "w").write(src)
    subprocess.run(["g++", "-O1", "-std=c++17", "-shared", "-fPIC", "-Wno-unknown-pragmas", "-o", lib, cpp],
                   check=True)
    dll = ctypes.CDLL(lib)
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


def random_blocks(rng, n, size, scale_kind):
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    d = rng.uniform(0.5e-3, 4e-3, size=n).astype(np.float16).view(np.uint16)
    if scale_kind == "d":
        raw[:, 0] = d & 0xFF
        raw[:, 1] = d >> 8
    else:  # IQ1_M: nibble k of d in the top nibble of scale word k (bytes 48 + 2k + 1)
        for k in range(4):
            b = raw[:, 48 + 2 * k + 1]
            raw[:, 48 + 2 * k + 1] = (b & 0x0F) | (((d >> (4 * k)) & 0x0F) << 4).astype(np.uint8)
    return raw


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
