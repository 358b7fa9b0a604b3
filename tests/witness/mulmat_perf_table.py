#!/usr/bin/env python3
"""Turn `test-backend-ops perf -o MUL_MAT` output and/or ggml_mulmat_bench output into markdown tables.

usage: mulmat_perf_table.py [--backend-ops FILE] [--bench FILE ...] [--summary] > table.md

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


def bench_records(path: str) -> list[dict]:
    recs = []
    for line in open(path, encoding="utf-8", errors="replace"):
        f = line.split()
        if len(f) != 17 or line.startswith("#"):
            continue
        keys = "type layout m k n thr cps reps us_med us_min us_cpu gflops mb g_med g_min g_cpu chk".split()
        r = dict(zip(keys, f))
        for key in ("m", "k", "n", "thr", "cps", "reps"):
            r[key] = int(r[key])
        for key in ("us_med", "us_min", "us_cpu", "mb", "g_med", "g_min", "g_cpu"):
            r[key] = float(r[key])
        r["type"] = r["type"].upper()
        r["flop"] = 2.0 * r["m"] * r["k"] * r["n"]
        recs.append(r)
    return recs


def bench_rows(recs: list[dict]) -> list[str]:
    out = []
    for r in recs:
        out.append(
            f"| {r['type']} | {r['layout']} | {r['m']}x{r['k']} | {r['n']} | {r['thr']} | {r['cps']} | {r['reps']} | "
            f"{r['us_med']:.1f} | {r['us_min']:.1f} | {r['us_cpu']:.1f} | {r['flop'] / r['us_min'] * 1e-3:.2f} | "
            f"{r['flop'] / r['us_cpu'] * 1e-3:.2f} | {r['mb']:.2f} | {r['g_med']:.2f} | {r['g_min']:.2f} | "
            f"{r['g_cpu']:.2f} | {r['chk']} |"
        )
    return out


def summary_rows(recs: list[dict]) -> list[str]:
    """Per type and layout: matvec GB/s and 512-column GFLOPS from CPU time of the calling thread
    (median) and from the best wall time. On a busy machine the CPU-time figures are the ones to
    trust for 1 thread; for 2 threads the main thread's CPU time also counts OpenMP barrier spinning,
    which matters for n=1 (short ops) and little for n=512."""
    by = {}
    for r in recs:
        by[(r["type"], r["layout"], r["n"], r["thr"])] = r
    order = []
    for r in recs:
        if (r["type"], r["layout"]) not in order:
            order.append((r["type"], r["layout"]))
    out = []
    for t, layout in order:
        def cell(n, thr, what):
            r = by.get((t, layout, n, thr))
            if r is None:
                return "-"
            if what == "gbs":
                return f"{r['g_cpu']:.2f}"
            if what == "gbs_min":
                return f"{r['g_min']:.2f}"
            if what == "gf":
                return f"{r['flop'] / r['us_cpu'] * 1e-3:.1f}"
            return f"{r['flop'] / r['us_min'] * 1e-3:.1f}"
        mb = next(r["mb"] for r in recs if r["type"] == t)
        out.append(
            f"| {t} | {layout} | {mb:.2f} | {cell(1, 1, 'gbs')} | {cell(1, 1, 'gbs_min')} | {cell(1, 2, 'gbs_min')} | "
            f"{cell(1, 2, 'gbs')} | {cell(512, 1, 'gf')} | {cell(512, 2, 'gf')} | {cell(512, 2, 'gf_min')} |"
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend-ops")
    ap.add_argument("--backend-ops-threads", type=int, default=1)
    ap.add_argument("--bench", nargs="*", default=[])
    ap.add_argument("--summary", action="store_true", help="also print a per-type summary of each bench file")
    a = ap.parse_args()
    if a.backend_ops:
        print(f"### test-backend-ops perf ({a.backend_ops})\n")
        print("| type | weight MxK | n | threads | µs/run | GFLOPS | weight MB | weight GB/s |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        print("\n".join(backend_ops_rows(a.backend_ops, a.backend_ops_threads)))
        print()
    for b in a.bench:
        recs = bench_records(b)
        if a.summary:
            print(f"### ggml_mulmat_bench summary ({b})\n")
            print(
                "| type | layout | weight MB | n=1 1thr GB/s (cpu) | n=1 1thr GB/s (best wall) | "
                "n=1 2thr GB/s (best wall) | n=1 2thr GB/s (main-thread cpu) | n=512 1thr GFLOPS (cpu) | "
                "n=512 2thr GFLOPS (main-thread cpu) | n=512 2thr GFLOPS (best wall) |"
            )
            print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
            print("\n".join(summary_rows(recs)))
            print()
        print(f"### ggml_mulmat_bench ({b})\n")
        print(
            "| type | layout | weight MxK | n | threads | copies | reps | µs med | µs min | µs cpu | GFLOPS (min) | "
            "GFLOPS (cpu) | weight MB | GB/s med | GB/s min | GB/s cpu | check |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        print("\n".join(bench_rows(recs)))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
