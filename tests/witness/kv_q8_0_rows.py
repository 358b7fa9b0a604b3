#!/usr/bin/env python3
"""Q8_0 KV rows as llama.cpp stores them, for `kernels/tests/kv_q8_0_rows.rs`.

usage: kv_q8_0_rows.py LIBDIR [OUT]   (LIBDIR: a llama.cpp CPU build's libggml-base.so and libggml-cpu.so,
                                      e.g. /tmp/llama-tools/bin; OUT: tests/fixtures/kv/q8_0_rows.bin)

A `-ctk q8_0 -ctv q8_0` cache is written by `ggml_set_rows`, which quantizes each f32 row with the CPU
type traits' `from_float`: `quantize_row_q8_0` of ggml-cpu (on x86 the AVX2 code: `q = x · (127/amax)`
rounded to nearest, ties to even). The `gguf` Python package and ggml's portable reference
(`quantize_row_q8_0_ref`: `q = roundf(x · (1/d))`, ties away from zero) round a few values differently;
both are written, so the test can say where ours stands against each.

Inputs (Python's `random`, seed 23, no numpy needed): 256 blocks of 32 values: Gaussian blocks at
scales from 1e-3 to 1e3 (the range of keys and values), blocks with an outlier, blocks of exact ties
(amax 127, halves), an all-zero block. File: u32 number of values n, n f32, then n/32·34 bytes of
`quantize_row_q8_0`, then n/32·34 bytes of `quantize_row_q8_0_ref` (all little-endian).
"""

import ctypes
import random
import struct
import sys
from pathlib import Path


def inputs() -> list[float]:
    rng = random.Random(23)
    blocks = []
    for i in range(200):
        scale = 10 ** rng.uniform(-3, 3)
        b = [rng.gauss(0, scale) for _ in range(32)]
        if i % 5 == 0:
            b[rng.randrange(32)] *= 40
        blocks.append(b)
    for i in range(55):
        # Exact halves with the block maximum 127: 127/amax is 1, every value a tie.
        b = [rng.randrange(-126, 126) + 0.5 for _ in range(32)]
        b[i % 32] = 127.0 if i % 2 else -127.0
        blocks.append(b)
    blocks.append([0.0] * 32)
    return [struct.unpack("<f", struct.pack("<f", x))[0] for b in blocks for x in b]


def main() -> None:
    libdir = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else (
        Path(__file__).resolve().parents[1] / "fixtures/kv/q8_0_rows.bin")
    base = ctypes.CDLL(str(libdir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(libdir / "libggml-cpu.so"))
    cpu.ggml_cpu_init()
    x = inputs()
    n = len(x)
    xs = (ctypes.c_float * n)(*x)
    nbytes = n // 32 * 34
    got_cpu = (ctypes.c_uint8 * nbytes)()
    got_ref = (ctypes.c_uint8 * nbytes)()
    cpu.quantize_row_q8_0(xs, got_cpu, ctypes.c_int64(n))
    base.quantize_row_q8_0_ref(xs, got_ref, ctypes.c_int64(n))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(struct.pack("<I", n) + struct.pack(f"<{n}f", *x) + bytes(got_cpu) + bytes(got_ref))
    differ = sum(a != b for a, b in zip(bytes(got_cpu), bytes(got_ref)))
    print(f"{out}: {n} values, {differ} of {nbytes} bytes differ between quantize_row_q8_0 and its reference")


if __name__ == "__main__":
    main()
