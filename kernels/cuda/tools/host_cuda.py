"""What the host-side checks of the i-quant kernels share (iq_host_check.py, mmq_iq_host_check.py): device
intrinsics shimmed as plain host C++, the extraction of a section of a .cu file, the compile into a
shared library, and random i-quant blocks with a sane f16 scale."""

import ctypes
import os
import subprocess

import numpy as np

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
CUDA = os.path.join(ROOT, "kernels", "cuda")

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
#define __constant__
#define __forceinline__ inline
struct float2 { float x, y; };
struct int2 { int x, y; };
static inline float2 make_float2(float x, float y) { return float2{x, y}; }
static inline int2 make_int2(int x, int y) { return int2{x, y}; }
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
// PTX prmt (default mode): byte k of the result is byte (s >> 4k) & 7 of the 8 bytes {x, y}.
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long v = (unsigned long long) x | ((unsigned long long) y << 32);
    unsigned r = 0;
    for (int k = 0; k < 4; ++k) r |= (unsigned) ((v >> (8 * ((s >> (4 * k)) & 7))) & 0xFF) << (8 * k);
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


def section(text, start, end):
    i = text.index(start)
    j = text.index(end, i)
    return text[i:j]


def read(name):
    return open(os.path.join(CUDA, name)).read()


def compile_host(tmp, stem, kernel_section, driver):
    """The shims, common.cuh's block layouts and get_int_b2/b4 (the rest of it is device code), the grids,
    `kernel_section` and `driver` compiled by g++ into a shared library in `tmp`, loaded."""
    layouts = section(read("common.cuh"), "#define QK_K 256", "// ----- shared by several modules")
    src = "\n".join([SHIMS, layouts, read("iq_grids.cuh"), kernel_section, driver])
    cpp = os.path.join(tmp, stem + ".cpp")
    lib = os.path.join(tmp, stem + ".so")
    open(cpp, "w").write(src)
    subprocess.run(["g++", "-O1", "-std=c++17", "-shared", "-fPIC", "-Wno-unknown-pragmas", "-o", lib, cpp],
                   check=True)
    return ctypes.CDLL(lib)


def random_blocks(rng, n, size, scale_kind, signed_scale=False):
    """`n` random blocks of `size` bytes whose f16 scale is 0.5e-3..4e-3 (negative too with
    `signed_scale`): at byte 0 (`scale_kind` "d"), or for IQ1_M nibble k of it in the top nibble of scale
    word k (bytes 48 + 2k + 1)."""
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    if signed_scale:
        sign = rng.choice([-1.0, 1.0], size=n)
        d = (sign * rng.uniform(0.5e-3, 4e-3, size=n)).astype(np.float16).view(np.uint16)
    else:
        d = rng.uniform(0.5e-3, 4e-3, size=n).astype(np.float16).view(np.uint16)
    if scale_kind == "d":
        raw[:, 0] = d & 0xFF
        raw[:, 1] = d >> 8
    else:
        for k in range(4):
            b = raw[:, 48 + 2 * k + 1]
            raw[:, 48 + 2 * k + 1] = (b & 0x0F) | (((d >> (4 * k)) & 0x0F) << 4).astype(np.uint8)
    return raw
