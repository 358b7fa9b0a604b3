#!/usr/bin/env python3
"""Drives poly-engine's serve mode directly (no HTTP server): starts the engine, sends GEN requests of random
prompt tokens one after another, and prints for each the engine's own clock from its DONE line (prefill and
decode milliseconds) and the wall time seen here. Every request starts a new conversation, so a request
after a long one also shows what switching conversations costs.

    python3 benchmarks/serve_drive.py ENGINE MODEL N_CTX PROMPT:ANSWER... [-- ENGINE_ARGS...]
    python3 benchmarks/serve_drive.py target/release/poly-engine m.gguf 16384 40:128 2000:128 -- --gpu 0
"""

import json
import random
import subprocess
import sys
import time


def main():
    args = sys.argv[1:]
    extra = []
    if "--" in args:
        extra = args[args.index("--") + 1:]
        args = args[: args.index("--")]
    if len(args) < 4:
        sys.exit(__doc__)
    engine, model, n_ctx, specs = args[0], args[1], args[2], args[3:]
    t0 = time.time()
    p = subprocess.Popen([engine, "--model", model, "--max-context", n_ctx] + extra,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    ready = p.stdout.readline()
    print("ready after %.1f s: %s" % (time.time() - t0, ready.strip()[:160]), flush=True)
    if not ready.startswith("READY"):
        sys.exit("the engine did not start")
    n_vocab = json.loads(ready[len("READY"):])["n_vocab"]
    low, high = min(1000, n_vocab // 2), min(30000, n_vocab)  # ordinary tokens, not the special ones
    rng = random.Random(7)
    for i, spec in enumerate(specs):
        n_prompt, n_answer = map(int, spec.split(":"))
        req = {"id": "r%d" % i, "tokens": [rng.randrange(low, high) for _ in range(n_prompt)],
               "max_tokens": n_answer, "stop_tokens": []}
        start = time.time()
        p.stdin.write("GEN " + json.dumps(req) + "\n")
        p.stdin.flush()
        first = None
        while True:
            line = p.stdout.readline()
            if not line:
                sys.exit("the engine closed its output")
            if line.startswith("T ") and first is None:
                first = time.time()
            elif line.startswith("DONE"):
                d = json.loads(line[5:])
                evals = max(d["generated"] - 1, 0)  # the first token comes from the prompt's logits
                print("%s prompt %d answer %d: prefill %.0f ms (%.0f t/s), decode %.0f ms (%.1f t/s), "
                      "TTFT %.0f ms, wall %.2f s" % (
                          req["id"], n_prompt, d["generated"], d["prefill_ms"],
                          n_prompt / max(d["prefill_ms"], 1e-9) * 1e3, d["decode_ms"],
                          evals / max(d["decode_ms"], 1e-9) * 1e3, ((first or time.time()) - start) * 1e3,
                          time.time() - start), flush=True)
                break
            elif line.startswith("ERR"):
                print(line.strip(), flush=True)
                break
    p.stdin.write("QUIT\n")
    p.stdin.flush()
    p.stdin.close()
    p.wait()


if __name__ == "__main__":
    main()
