#!/usr/bin/env python3
"""Sums Nsight Compute's per-kernel durations (the CSV of benchmarks/profile_kernels.sh) by kernel name:
launches, total and mean microseconds, share of the window; with --per N, also microseconds per N (say, per
layer: the number of layers a window's launches cover is the count of one kernel that runs once a layer).

    python3 benchmarks/kernel_table.py ours-q3u.csv [--per-kernel NAME]
"""
import csv
import sys
from collections import OrderedDict


def main():
    args = sys.argv[1:]
    per_kernel = None
    if "--per-kernel" in args:
        i = args.index("--per-kernel")
        per_kernel = args[i + 1]
        del args[i : i + 2]
    for path in args:
        rows = list(csv.DictReader(open(path)))
        sums = OrderedDict()
        for r in rows:
            if r.get("Metric Name") != "gpu__time_duration.sum":
                continue
            name = r["Kernel Name"].split("(")[0]
            ns = float(r["Metric Value"].replace(",", ""))
            n, t = sums.get(name, (0, 0.0))
            sums[name] = (n + 1, t + ns)
        total = sum(t for _, t in sums.values())
        units = None
        if per_kernel:
            units = next((n for k, (n, _) in sums.items() if per_kernel in k), None)
        print(f"# {path}: {sum(n for n, _ in sums.values())} launches, {total / 1e3:.1f} us of kernel time")
        head = "| kernel | launches | total us | mean us | share |"
        if units:
            head += f" us per {per_kernel} launch ({units}) |"
        print(head)
        print("|" + " --- |" * (head.count("|") - 1))
        for k, (n, t) in sorted(sums.items(), key=lambda kv: -kv[1][1]):
            line = f"| {k} | {n} | {t / 1e3:.1f} | {t / n / 1e3:.2f} | {100 * t / total:.1f}% |"
            if units:
                line += f" {t / units / 1e3:.2f} |"
            print(line)


if __name__ == "__main__":
    main()
