#!/usr/bin/env python3
"""Joins `quant_matmul` (ours) and `ggml_mulmat_bench` (llama.cpp) outputs into BENCHMARKS.md's table.

usage: quant_table.py OURS.txt GGML_NATIVE.txt [GGML_AVX2.txt]
Ratios are ours / llama.cpp on GB/s of weights (weight bytes / median time of one call; for the
512-token product the ratio of times). llama.cpp's figure is its best layout (plain or repacked)."""
import re
import sys


def ours(path):
    rows, threads = {}, None
    for line in open(path):
        m = re.match(r"matrix .* (\d+) threads", line)
        if m:
            threads = int(m.group(1))
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.match(r"^[A-Z0-9_]+$", cells[0]) and cells[0] != "type":
            ms = float(re.search(r"\(([\d.]+) ms\)", cells[4]).group(1))
            rows[cells[0].upper()] = dict(mb=float(cells[1]), mv1=float(cells[2]), mvn=float(cells[3]), mm_ms=ms)
    return rows, threads


def ggml(path):
    best = {}
    for line in open(path):
        f = line.split()
        if len(f) < 13 or f[0].startswith("#") or f[-1] != "ok":
            continue
        ty, layout, n, thr, us, gbs = f[0].upper(), f[1], int(f[4]), int(f[5]), float(f[7]), float(f[11])
        key = (ty, n, thr)
        if key not in best or us < best[key][0]:
            best[key] = (us, gbs, layout)
    return best


def main():
    o, threads = ours(sys.argv[1])
    peers = [("native", ggml(sys.argv[2]))] + ([("avx2", ggml(sys.argv[3]))] if len(sys.argv) > 3 else [])
    for name, g in peers:
        print(f"\nllama.cpp build: {name}\n")
        print(f"| type | matvec 1 thr: ours / llama.cpp GB/s | ratio | matvec {threads} thr: ours / llama.cpp GB/s | ratio "
              f"| matmul 512 tok, {threads} thr: ours / llama.cpp ms | ratio |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for ty, r in o.items():
            a, b, c = g.get((ty, 1, 1)), g.get((ty, 1, threads)), g.get((ty, 512, threads))
            if not (a and b and c):
                print(f"| {ty} | – | | – | | – | |")
                continue
            print(f"| {ty} | {r['mv1']:.2f} / {a[1]:.2f} | {r['mv1'] / a[1]:.2f} | {r['mvn']:.1f} / {b[1]:.1f}{' (repack)' if b[2] == 'repack' else ''} "
                  f"| {r['mvn'] / b[1]:.2f} | {r['mm_ms']:.1f} / {c[0] / 1e3:.1f}{' (repack)' if c[2] == 'repack' else ''} | {c[0] / 1e3 / r['mm_ms']:.2f} |")


main()
