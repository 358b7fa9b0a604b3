#!/usr/bin/env python3
"""Guessed tokens from repeats on the CPU (issue 18): a real model's answer rate with guesses against
`--no-draft`, on a task that copies a document and on one that writes freely, same process order
alternated over rounds. Checks that both write the same tokens.

usage: guesses_cpu.py --engine target/release/poly-engine --model SmolLM2.gguf --tokenizer DIR
                      [--threads 2] [--rounds 3] [--max-tokens 200] [--engine-base OLD_BINARY]

A synthetic model has no tokenizer: `--ids N` gives it a prompt of N random token ids said twice (task
"ids") instead of the two chats; `--flags "..."` adds engine flags to every process (e.g.
`--repeats-min-match 1`).

--engine-base runs an earlier build with guesses too, in the same rotation (a third column, and its ratio
to `--no-draft`): a change of the guessing policy measured against the one before it.

DIR is `polystrata tokenizer --gguf MODEL --out DIR`'s tokenizer.json directory; the prompts are ChatML
(SmolLM2-Instruct's template, its default system prompt). Needs the `tokenizers` package.
"""
import argparse
import json
import subprocess

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
    ap.add_argument("--tokenizer")
    ap.add_argument("--ids", type=int, default=0)
    ap.add_argument("--flags", default="")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--engine-base")
    a = ap.parse_args()
    more = a.flags.split()
    variants = {"with": (a.engine, more), "without": (a.engine, more + ["--no-draft"])}
    if a.engine_base:
        variants["base"] = (a.engine_base, more)
    if a.ids:
        import random
        rng = random.Random(5)
        part = [rng.randrange(1, 2000) for _ in range(a.ids)]
        prompts = {"ids": part + part}
        tok = None
    else:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(a.tokenizer + "/tokenizer.json")
        prompts = {name: tok.encode(chatml(user), add_special_tokens=False).ids for name, user in TASKS.items()}
    base_cols = " base with guesses | base ratio |" if a.engine_base else ""
    print("| task | tokens | guessed / kept | answer t/s with guesses | `--no-draft` | ratio |" + base_cols)
    print("| --- | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if a.engine_base else ""))
    for name, prompt in prompts.items():
        rates = {k: [] for k in variants}
        names = list(variants)
        for r in range(a.rounds):
            # Each round starts with the next variant, so none always goes first.
            order = names[r % len(names):] + names[:r % len(names)]
            outs = {}
            for which in order:
                engine, extra = variants[which]
                tokens, done = run(engine, a.model, a.threads, extra, prompt, a.max_tokens)
                outs[which] = (tokens, done)
                rates[which].append(done["generated"] / (done["decode_ms"] / 1e3))
            for which in outs:
                assert outs[which][0] == outs["without"][0], f"{name}: {which}'s answer differs"
        done = outs["with"][1]

        def med(k):
            return sorted(rates[k])[len(rates[k]) // 2]

        def cell(k):
            return f"{med(k):.1f} ({', '.join('%.1f' % x for x in rates[k])})"

        w, o = med("with"), med("without")
        row = (f"| {name} | {done['generated']} | {done['draft_proposed']} / {done['draft_accepted']} | "
               f"{cell('with')} | {cell('without')} | {w / o:.2f}× |")
        if a.engine_base:
            b = outs["base"][1]
            row += f" {cell('base')} ({b['draft_proposed']} / {b['draft_accepted']}) | {med('base') / o:.2f}× |"
        print(row)
        if name == "copy" and tok:
            print("<!-- copy answer: " + tok.decode(outs["with"][0])[:200].replace("\n", " ") + " -->")


if __name__ == "__main__":
    main()
