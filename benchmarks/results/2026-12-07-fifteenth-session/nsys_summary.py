#!/usr/bin/env python3
"""One token's kernels from an Nsight Systems trace (nsys stats -r cuda_gpu_trace -f csv): per kernel name
its launches a token, mean time on the card, and the mean gap from the end of the kernel before it to its
start (negative: the launches overlap, as programmatic dependent launches do). Only the trace's last
`--tokens` tokens count (a token ends at the launch named by --token-end). Usage:
  nsys_summary.py TRACE.csv --token-end NAME_PART [--tokens 32]"""
import csv, sys, argparse, collections

ap = argparse.ArgumentParser()
ap.add_argument("trace")
ap.add_argument("--token-end", default="auto")
ap.add_argument("--tokens", type=int, default=32)
a = ap.parse_args()
rows = []
with open(a.trace) as f:
    for r in csv.DictReader(f):
        name = r.get("Name", "")
        if "[CUDA mem" in name or "memcpy" in name.lower() or "memset" in name.lower():
            continue
        rows.append((int(r["Start (ns)"]), int(r["Duration (ns)"]), name))
rows.sort()
if a.token_end == "auto":
    # The launch made once a token that comes last: of the names launched fewest times (at least a
    # token's worth), the one whose last launch is latest.
    count = collections.Counter(r[2] for r in rows)
    fewest = min(c for c in count.values() if c > a.tokens)
    last_at = {r[2]: i for i, r in enumerate(rows) if count[r[2]] == fewest}
    a.token_end = max(last_at, key=last_at.get)
    print(f"token end: {a.token_end.split('(')[0]} ({fewest} launches)")
ends = [i for i, r in enumerate(rows) if a.token_end in r[2]]
if len(ends) < a.tokens + 1:
    sys.exit(f"only {len(ends)} launches named {a.token_end!r}")
first, last = ends[-a.tokens - 1] + 1, ends[-1]
sel = rows[first:last + 1]
n = a.tokens
span = (sel[-1][0] + sel[-1][1] - sel[0][0]) / 1e3 / n
stat = collections.defaultdict(lambda: [0, 0.0, 0.0])
busy = 0.0
prev_end = rows[first - 1][0] + rows[first - 1][1]
for s, d, name in sel:
    short = name.split("(")[0][:60]
    e = stat[short]
    e[0] += 1
    e[1] += d / 1e3
    e[2] += (s - prev_end) / 1e3
    prev_end = max(prev_end, s + d)
    busy += d / 1e3
print(f"tokens {n}: {span:.1f} us a token, {len(sel) / n:.0f} launches a token, kernels' sum {busy / n:.1f} us")
print(f"{'kernel':60s} {'/token':>7s} {'us each':>8s} {'us/token':>9s} {'gap each':>9s}")
for k, (c, d, g) in sorted(stat.items(), key=lambda kv: -kv[1][1]):
    print(f"{k:60s} {c / n:7.1f} {d / c:8.2f} {d / n:9.1f} {g / c:9.2f}")
