#!/usr/bin/env python3
"""Our CPU engine against llama.cpp's CPU build on the same files, the same thread count, in one run.

For each model: `rounds` rounds, each running llama.cpp's `llama-bench` and `poly-engine bench` on the
reading test (pp: one 512-token prompt from an empty state) and then on the writing test (tg: 128
single-token decodes), alternating which engine goes first, so both share whatever else the machine does.
Every process is timed with its CPU time (os.wait4), and the whole machine's busy time over the run is
read from /proc/stat, so the table says how loaded the machine was by others.

Prints a markdown table (tokens per second, mean over every repetition of every round, and the ratio
ours / llama.cpp) and writes it with the raw samples to --out (a directory).

    python3 benchmarks/cpu_vs_llama.py --threads 2 --rounds 3 --reps 2 --out benchmarks/results/NAME
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODELS = [
    ("qwen3moe small Q4_K", "/work/bench_models/qwen3moe-small-q4k.gguf"),
    ("qwen35moe small Q4_K", "/work/bench_models/qwen35moe-small-q4k.gguf"),
    ("Gemma 3 270M Q4_K_M", "/work/models/gemma-3-270m-q4_k_m.gguf"),
]


def proc_stat():
    """(busy, total) jiffies of all CPUs."""
    with open("/proc/stat") as f:
        cpu = [int(v) for v in f.readline().split()[1:]]
    idle = cpu[3] + cpu[4]
    return sum(cpu) - idle, sum(cpu)


def run_timed(cmd):
    """Runs cmd; returns (stdout, wall s, cpu s of the process and its threads)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Read both pipes fully before waiting, then reap with wait4 for the child's resource use.
    out, err = p.stdout.read(), p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{err[-2000:]}")
    return out, wall, ru.ru_utime + ru.ru_stime


def llama(args, model, test):
    p, n = (args.prompt, 0) if test == "pp" else (0, args.gen)
    cmd = [args.llama_bench, "-m", model, "-p", str(p), "-n", str(n), "-t", str(args.threads),
           "-r", str(args.reps), "-o", "json"]
    out, wall, cpu = run_timed(cmd)
    rec = json.loads(out)[0]
    return {"samples_ts": rec["samples_ts"], "wall_s": wall, "cpu_s": cpu,
            "timed_s": sum(rec["samples_ns"]) / 1e9}


def ours(args, model, test):
    p, n = (args.prompt, 0) if test == "pp" else (0, args.gen)
    cmd = [args.engine, "bench", "--model", model, "--prompt", str(p), "--gen", str(n),
           "--threads", str(args.threads), "--reps", str(args.reps)]
    out, wall, cpu = run_timed(cmd)
    rec = json.loads(out)[test]
    return {"samples_ts": rec["samples_ts"], "wall_s": wall, "cpu_s": cpu,
            "timed_s": rec["wall_s"], "timed_cpu_s": rec["cpu_s"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2, help="repetitions per process (llama-bench -r)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--engine", default=str(ROOT / "target/release/poly-engine"))
    ap.add_argument("--llama-bench", default="/work/llama-build/bin/llama-bench")
    ap.add_argument("--model", action="append", metavar="NAME=PATH",
                    help="model to run (repeatable; default: the three of issue 3)")
    ap.add_argument("--out", type=Path, help="directory for table.md and raw.json")
    args = ap.parse_args()
    models = [tuple(m.split("=", 1)) for m in args.model] if args.model else DEFAULT_MODELS

    raw = {"threads": args.threads, "rounds": args.rounds, "reps": args.reps, "models": {}}
    rows = []
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load0 = os.getloadavg()
    for name, path in models:
        runs = {(e, t): [] for e in ("llama", "ours") for t in ("pp", "tg")}
        busy0, total0 = proc_stat()
        our_cpu = 0.0
        for r in range(args.rounds):
            order = [("llama", llama), ("ours", ours)]
            if r % 2:
                order.reverse()
            for test in ("pp", "tg"):
                for engine, fn in order:
                    res = fn(args, path, test)
                    runs[(engine, test)].append(res)
                    our_cpu += res["cpu_s"]
                    print(f"{name} round {r + 1} {engine:5} {test}: "
                          f"{statistics.mean(res['samples_ts']):8.2f} t/s "
                          f"(wall {res['wall_s']:.1f} s, cpu {res['cpu_s']:.1f} s)", file=sys.stderr)
        busy1, total1 = proc_stat()
        ticks = os.sysconf("SC_CLK_TCK")
        n_cpu = os.cpu_count()
        # Busy CPU of the whole machine, and the part of it that was not our benchmark processes.
        busy_s = (busy1 - busy0) / ticks
        span_s = (total1 - total0) / ticks / n_cpu
        others = max(0.0, busy_s - our_cpu) / span_s
        row = {"model": name, "path": path, "others_cores": others, "span_s": span_s}
        for test in ("pp", "tg"):
            for engine in ("llama", "ours"):
                res = runs[(engine, test)]
                ts = [t for x in res for t in x["samples_ts"]]
                row[f"{engine}_{test}"] = statistics.mean(ts)
                row[f"{engine}_{test}_sd"] = statistics.stdev(ts) if len(ts) > 1 else 0.0
                # The spread of the rounds: each round's mean, lowest and highest.
                means = [statistics.mean(x["samples_ts"]) for x in res]
                row[f"{engine}_{test}_min"], row[f"{engine}_{test}_max"] = min(means), max(means)
                row[f"{engine}_{test}_cpu_per_wall"] = (
                    sum(x["cpu_s"] for x in res) / sum(x["wall_s"] for x in res))
                # Tokens per CPU second of the whole process (loading and the one warm-up included,
                # alike on both sides): the work each engine does, whatever the load.
                n_tok = args.prompt if test == "pp" else args.gen
                row[f"{engine}_{test}_per_cpu"] = (
                    n_tok * args.reps * len(res) / sum(x["cpu_s"] for x in res))
            row[f"ratio_{test}"] = row[f"ours_{test}"] / row[f"llama_{test}"]
            # Per round (both engines of one round ran minutes apart at most): lowest and highest ratio.
            ratios = [statistics.mean(o["samples_ts"]) / statistics.mean(l["samples_ts"])
                      for o, l in zip(runs[("ours", test)], runs[("llama", test)])]
            row[f"ratio_{test}_min"], row[f"ratio_{test}_max"] = min(ratios), max(ratios)
        rows.append(row)
        raw["models"][name] = {"path": path, "runs": {f"{e}_{t}": v for (e, t), v in runs.items()},
                               "summary": row}
    load1 = os.getloadavg()

    lines = [
        f"Run {started}, {args.threads} threads, {args.rounds} rounds × {args.reps} repetitions per "
        f"engine and test, pp{args.prompt} / tg{args.gen}; load average {load0[0]:.1f} before, "
        f"{load1[0]:.1f} after.",
        "",
        f"| model | pp{args.prompt} ours t/s | pp llama.cpp t/s | pp ratio | tg{args.gen} ours t/s | "
        "tg llama.cpp t/s | tg ratio | CPU/wall ours pp, tg | CPU/wall llama.cpp pp, tg | "
        "other load (cores) | t/CPU-s ours / llama.cpp pp, tg |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['ours_pp']:.1f} ± {r['ours_pp_sd']:.1f} | "
            f"{r['llama_pp']:.1f} ± {r['llama_pp_sd']:.1f} | **{r['ratio_pp']:.2f}** | "
            f"{r['ours_tg']:.2f} ± {r['ours_tg_sd']:.2f} | {r['llama_tg']:.2f} ± {r['llama_tg_sd']:.2f} | "
            f"**{r['ratio_tg']:.2f}** | {r['ours_pp_cpu_per_wall']:.2f}, {r['ours_tg_cpu_per_wall']:.2f} | "
            f"{r['llama_pp_cpu_per_wall']:.2f}, {r['llama_tg_cpu_per_wall']:.2f} | "
            f"{r['others_cores']:.2f} | {r['ours_pp_per_cpu']:.1f} / {r['llama_pp_per_cpu']:.1f}, "
            f"{r['ours_tg_per_cpu']:.1f} / {r['llama_tg_per_cpu']:.1f} |")
    lines += [
        "",
        "Rounds (each round's mean; ratio: ours / llama.cpp of the same round), lowest – highest:",
        "",
        f"| model | pp{args.prompt} ours | pp llama.cpp | pp ratio | tg{args.gen} ours | tg llama.cpp | tg ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = []
        for test in ("pp", "tg"):
            for e in ("ours", "llama"):
                cells.append(f"{r[f'{e}_{test}_min']:.1f}–{r[f'{e}_{test}_max']:.1f}")
            cells.append(f"**{r[f'ratio_{test}_min']:.2f}–{r[f'ratio_{test}_max']:.2f}**")
        lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(table + "\n")
        (args.out / "raw.json").write_text(json.dumps(raw, indent=1) + "\n")


if __name__ == "__main__":
    main()
