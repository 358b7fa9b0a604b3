#!/usr/bin/env python3
"""`--kv q8_0` against the f16 cache on a real model, the way llama-perplexity's `--kl-divergence` reads a
text: chunks of N tokens of the repository's text (BOS first where the model adds one), each read as a
prompt of N/2 + 1 tokens and then followed token by token (`poly-engine run --follow`), so the steps are
the distributions at positions N/2 … N-2 (llama-perplexity scores the same positions of each chunk).
The f16 run is the reference, the q8_0 run follows it, `poly-engine kl` compares them (top-40 lists plus
the rest as one bin; llama.cpp sums the whole vocabulary).

usage: kv_q8_0_kl.py --engine target/release/poly-engine --model FILE --tokens REFERENCE.json
                     [--ctx 1024] [--chunks 2] [--threads 2] [--bos ID] [--out DIR]

REFERENCE.json: a witness reference (tests/fixtures/references/*.text-t3000.json) whose `prompt` is the
text's tokens as llama.cpp tokenizes them. Prints one JSON line: the model, the tokens scored, and
`kl`'s mean/max KL and same-top share.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bos", type=int, default=None, help="BOS id put first in every chunk")
    ap.add_argument("--out", default="/tmp/kv-q8-kl")
    ap.add_argument("--top", type=int, default=40, help="likeliest tokens listed per step")
    a = ap.parse_args()
    tokens = json.load(open(a.tokens))["prompt"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    n, half = a.ctx, a.ctx // 2
    runs = {"f16": [], "q8_0": []}
    for c in range(min(a.chunks, len(tokens) // n)):
        chunk = tokens[c * n:(c + 1) * n]
        if a.bos is not None:
            chunk[0] = a.bos
        prompt, follow = chunk[:half + 1], chunk[half + 1:]
        follow_file = out / f"follow{c}.txt"
        follow_file.write_text(",".join(map(str, follow)))
        for kv in runs:
            cmd = [a.engine, "run", "--cpu", "--json", "--top", str(a.top), "--threads", str(a.threads),
                   "--n-ctx", str(n), "--kv", kv, "--model", a.model,
                   "--prompt-tokens", ",".join(map(str, prompt)), "--follow", str(follow_file)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"{' '.join(cmd[:12])}…: {r.stderr}")
            runs[kv].append(r.stdout)
    files = {}
    for kv, outs in runs.items():
        files[kv] = out / f"{kv}.jsonl"
        files[kv].write_text("".join(outs))
    r = subprocess.run([a.engine, "kl", str(files["f16"]), str(files["q8_0"])],
                       capture_output=True, text=True, check=True)
    kl = json.loads(r.stdout)
    steps = sum(1 for line in files["f16"].read_text().splitlines() if line.strip())
    print(json.dumps({"model": Path(a.model).name, "ctx": n, "chunks": len(runs["f16"]),
                      "scored": steps, **kl}))


if __name__ == "__main__":
    main()
