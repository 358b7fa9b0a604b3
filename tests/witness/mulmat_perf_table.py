#!/usr/bin/env python3
"""Turn `test-backend-ops perf -o MUL_MAT` output and/or ggml_mulmat_bench output into markdown tables.

usage: mulmat_perf_table.py [--backend-ops FILE] [--bench FILE ...] > table.md

For test-backend-ops lines, weight GB/s = M * row_bytes(type, K) / (µs/run); the tool runs with
hardware_concurrency()/2 threads (given by --backend-ops-threads, default 1). Needs gguf (for the
block sizes), e.g. the witness venv.
"""

from __future__ import annotations

import argparse
import re
import sys

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_BOPS = re.compile(
    r"MUL_MAT\(type_a=(?P<type>\w+),type_b=f32,m=(?P<m>\d+),n=(?P<n>\d+),k=(?P<k>\d+),.*?\):\s+"
    r"(?P<runs>\d+) runs -\s+(?P<us>[\d.]+) us/run -\s+[\d.]+ [KMGT]?FLOP/run -\s+(?:\x1b\[[\d;]*m)?\s*"
    r"(?P<fl>[\d.]+) (?P<unit>[KMGT]?)FLOPS"
)
_UNIT = {"": 1e-9, "K": 1e-6, "M": 1e-3, "G": 1.0, "T": 1e3}


def row_bytes(type_name: str, k: int) -> int:
    t = GGMLQuantizationType[type_name.upper()]
    block, size = GGML_QUANT_SIZES[t]
    return k // block * size


def backend_ops_rows(path: str, threads: int) -> list[str]:
    out = []
    for line in open(path, encoding="utf-8", errors="replace"):
        m = _BOPS.search(line)
        if not m:
            continue
        t, mm, n, k = m["type"], int(m["m"]), int(m["n"]), int(m["k"])
        us = float(m["us"])
        gflops = float(m["fl"]) * _UNIT[m["unit"]]
        wbytes = mm * row_bytes(t, k)
        out.append(
            f"| {t.upper()} | {mm}x{k} | {n} | {threads} | {us:.1f} | {gflops:.2f} | {wbytes / 1e6:.1f} | "
            f"{wbytes / us * 1e-3:.2f} |"
        )
    return out


def bench_rows(path: str) -> list[str]:
    out = []
    for line in open(path, encoding="utf-8", errors="replace"):
        f = line.split()
        if len(f) != 17 or line.startswith("#"):
            continue
        (t, layout, m, k, n, thr, cps, reps, us_med, us_min, us_cpu, gflops, mb, g_med, g_min, g_cpu, chk) = f
        out.append(
            f"| {t.upper()} | {layout} | {m}x{k} | {n} | {thr} | {cps} | {float(us_med):.1f} | {float(us_min):.1f} | "
            f"{float(us_cpu):.1f} | {gflops} | {mb} | {g_med} | {g_min} | {g_cpu} |"
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend-ops")
    ap.add_argument("--backend-ops-threads", type=int, default=1)
    ap.add_argument("--bench", nargs="*", default=[])
    a = ap.parse_args()
    if a.backend_ops:
        print(f"### test-backend-ops perf ({a.backend_ops})\n")
        print("| type | weight MxK | n | threads | µs/run | GFLOPS | weight MB | weight GB/s |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        print("\n".join(backend_ops_rows(a.backend_ops, a.backend_ops_threads)))
        print()
    for b in a.bench:
        print(f"### ggml_mulmat_bench ({b})\n")
        print(
            "| type | layout | weight MxK | n | threads | copies | µs med | µs min | µs cpu | GFLOPS (min) | "
            "weight MB | GB/s med | GB/s min | GB/s cpu |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        print("\n".join(bench_rows(b)))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
