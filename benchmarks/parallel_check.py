"""`poly-engine --parallel N` on a device: the same GENs alone (one engine, --parallel 1) and at once (another,
--parallel N) must give the same tokens. On the CPU the engine tests check this bit for bit against the
library (engine/tests/serve_parallel.rs); this script is for a GPU, whose answers are compared with its
own answers alone (its arithmetic is not the CPU's).

usage: python3 benchmarks/parallel_check.py ENGINE MODEL.gguf N [engine args...]
Prints one line per request and `parallel check passed` or exits 1.
"""

import json
import subprocess
import sys
import time

ENGINE, MODEL, N = sys.argv[1], sys.argv[2], int(sys.argv[3])
EXTRA = sys.argv[4:]
LENGTHS = [48, 12, 24, 36]


def prompts(n_vocab):
    # Fixed pseudo-random prompts (a small LCG), different lengths.
    x, out = 12345, []
    for i in range(len(LENGTHS)):
        p = []
        for _ in range(8 + 3 * i):
            x = (x * 1103515245 + 12345) % (1 << 31)
            p.append(x % n_vocab)
        out.append(p)
    return out


def start(parallel):
    proc = subprocess.Popen(
        [ENGINE, "--model", MODEL, "--max-context", "1024", "--parallel", str(parallel)] + EXTRA,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    verb, body = proc.stdout.readline().split(" ", 1)
    if verb != "READY":
        sys.exit(f"no READY: {verb} {body}")
    return proc, json.loads(body)


def send(proc, i, p):
    gen = {"id": f"g{i}", "tokens": p, "max_tokens": LENGTHS[i], "stop_tokens": []}
    proc.stdin.write("GEN " + json.dumps(gen) + "\n")
    proc.stdin.flush()


def collect(proc, ids):
    answers, order = {i: ([], []) for i in ids}, []
    left = set(ids)
    while left:
        verb, body = proc.stdout.readline().split(" ", 1)
        msg = json.loads(body)
        if verb == "T":
            answers[msg["id"]][0].extend(msg["tokens"])
            answers[msg["id"]][1].extend(msg["logprobs"])
            order.append(msg["id"])
        elif verb == "DONE":
            left.discard(msg["id"])
            order.append(msg["id"] + " done")
        elif verb == "ERR":
            sys.exit(f"ERR {body}")
    return answers, order


alone_proc, ready = start(1)
ps = prompts(ready["n_vocab"])
alone = {}
t0 = time.time()
for i, p in enumerate(ps):
    send(alone_proc, i, p)
    alone.update(collect(alone_proc, [f"g{i}"])[0])
alone_s = time.time() - t0
alone_proc.stdin.close()
alone_proc.wait()

par_proc, ready_par = start(N)
t0 = time.time()
for i, p in enumerate(ps):
    send(par_proc, i, p)
together, order = collect(par_proc, [f"g{i}" for i in range(len(ps))])
together_s = time.time() - t0
par_proc.stdin.close()
par_proc.wait()

print(f"device {ready['device']}, knobs {ready_par.get('knobs')}: alone {alone_s:.2f} s, at once {together_s:.2f} s")
ok = True
for i in range(len(ps)):
    a, b = alone[f"g{i}"], together[f"g{i}"]
    same = a[0] == b[0]
    worst = max((abs(x - y) for x, y in zip(a[1], b[1])), default=0.0)
    print(f"g{i}: {len(b[0])} tokens, same tokens {same}, largest logprob difference {worst:.3g}")
    ok &= same
interleaved = order.index("g1 done") < order.index("g0 done")
print(f"turns interleaved: {interleaved}")
if not (ok and interleaved):
    sys.exit("parallel check FAILED")
print("parallel check passed")
