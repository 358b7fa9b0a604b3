#!/usr/bin/env python3
"""Guessed tokens from repeats on the CPU (issue 18): a real model's answer rate with guesses against
`--no-draft`, on a task that copies a document and on one that writes freely, same process order
alternated over rounds. Checks that both write the same tokens.

usage: guesses_cpu.py --engine target/release/poly-engine --model SmolLM2.gguf --tokenizer DIR
                      [--threads 2] [--rounds 3] [--max-tokens 200]

DIR is `polystrata tokenizer --gguf MODEL --out DIR`'s tokenizer.json directory; the prompts are ChatML
(SmolLM2-Instruct's template, its default system prompt). Needs the `tokenizers` package.
"""
import argparse
import json
import subprocess
import time

DOCUMENT = (
    "The expert cache keeps the routed experts that the answer uses most in the memory of the card. "
    "Every layer of the model chooses eight experts for each token, and the experts that are not in the "
    "cache are computed by the processor while the card computes the others. A long prompt is read in "
    "large calls, so that each layer's missing experts are copied to the card once for the whole call."
)
TASKS = {
    "copy": "Repeat the following text exactly, word for word:\n\n" + DOCUMENT,
    "free": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(user):
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def run(engine, model, threads, extra, prompt, max_tokens):
    p = subprocess.Popen(
        [engine, "--model", model, "--cpu", "--threads", str(threads), "--max-context", "2048", *extra],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ready = p.stdout.readline()
    assert ready.startswith("READY"), ready
    gen = {"id": "g", "tokens": prompt, "max_tokens": max_tokens}
    p.stdin.write("GEN " + json.dumps(gen) + "\n")
    p.stdin.flush()
    tokens = []
    while True:
        line = p.stdout.readline()
        verb, _, body = line.partition(" ")
        if verb == "T":
            tokens += json.loads(body)["tokens"]
        elif verb == "DONE":
            done = json.loads(body)
            break
        elif verb != "PROGRESS":
            raise SystemExit("unexpected: " + line)
    p.stdin.write("QUIT\n")
    p.stdin.flush()
    p.wait()
    return tokens, done


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=200)
    a = ap.parse_args()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(a.tokenizer + "/tokenizer.json")
    print("| task | tokens | guessed / kept | answer t/s with guesses | `--no-draft` | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, user in TASKS.items():
        prompt = tok.encode(chatml(user), add_special_tokens=False).ids
        rates = {"with": [], "without": []}
        for r in range(a.rounds):
            order = ["with", "without"] if r % 2 == 0 else ["without", "with"]
            outs = {}
            for which in order:
                extra = [] if which == "with" else ["--no-draft"]
                t0 = time.time()
                tokens, done = run(a.engine, a.model, a.threads, extra, prompt, a.max_tokens)
                outs[which] = (tokens, done)
                rates[which].append(done["generated"] / (done["decode_ms"] / 1e3))
            assert outs["with"][0] == outs["without"][0], f"{name}: the answers differ"
        done = outs["with"][1]
        w = sorted(rates["with"])[len(rates["with"]) // 2]
        o = sorted(rates["without"])[len(rates["without"]) // 2]
        print(f"| {name} | {done['generated']} | {done['draft_proposed']} / {done['draft_accepted']} | "
              f"{w:.1f} ({', '.join('%.1f' % x for x in rates['with'])}) | "
              f"{o:.1f} ({', '.join('%.1f' % x for x in rates['without'])}) | {w / o:.2f}× |")
        if name == "copy":
            print("<!-- copy answer: " + tok.decode(outs["with"][0])[:200].replace("\n", " ") + " -->")


if __name__ == "__main__":
    main()
