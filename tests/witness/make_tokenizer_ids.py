#!/usr/bin/env python3
"""Token ids of llama.cpp's own tokenizer for the texts of tests/fixtures/text/tokenizer_texts.json.

The server's tokenizer directory (`polystrata tokenizer`) must give the same ids as llama.cpp for the same
GGUF. CI has no llama.cpp, so this script writes the expected ids once, as a fixture:

    /work/venv-witness/bin/python tests/witness/make_tokenizer_ids.py \
        [--gemma /work/models/gemma-3-270m-q4_k_m.gguf]

writes tests/fixtures/text/tokenizer_ids.json: {model_key: {"gguf": path, "add_bos": .., "ids": [[...], ...]}}.
Tokenization is llama.cpp's `llama_tokenize(text, add_special=True, parse_special=True)`: BOS is added when the
GGUF says so (as llama.cpp's server does for a prompt) and special-token texts in the input become their
tokens (as the server does for a rendered chat prompt). Needs llama-cpp-python (the witness venv).
"""
import argparse
import json
import os

import llama_cpp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXTS = os.path.join(ROOT, "tests/fixtures/text/tokenizer_texts.json")
OUT = os.path.join(ROOT, "tests/fixtures/text/tokenizer_ids.json")

SYNTHETIC = {
    # every synthetic model carries the same vocabulary; the two differ in add_bos
    "synthetic_qwen3moe": "tests/fixtures/models/qwen3moe-tiny-q4km.gguf",
    "synthetic_gemma3": "tests/fixtures/models/gemma3-tiny-q4km.gguf",
    # a Gemma 4-style vocabulary (tokenizer.ggml.model gemma4): tests/witness/make_gemma4_vocab.py
    "synthetic_gemma4_vocab": "tests/fixtures/text/gemma4-vocab.gguf",
}


def tokenize_all(path, texts):
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise SystemExit(f"cannot load {path}")
    vocab = llama_cpp.llama_model_get_vocab(model)
    out = []
    for text in texts:
        data = text.encode("utf-8")
        cap = len(data) * 2 + 16
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, cap, True, True)
        if n < 0:
            raise SystemExit(f"buffer too small for {text!r}")
        out.append([int(buf[i]) for i in range(n)])
    add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
    llama_cpp.llama_model_free(model)
    return add_bos, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemma", default="/work/models/gemma-3-270m-q4_k_m.gguf")
    ap.add_argument("--only", help="rewrite this key only, keeping the others as stored")
    args = ap.parse_args()
    texts = json.load(open(TEXTS, encoding="utf-8"))
    result = {}
    models = dict(SYNTHETIC)
    models["gemma3_270m"] = args.gemma
    if args.only:
        result = json.load(open(OUT, encoding="utf-8"))
        models = {args.only: models[args.only]}
    for key, path in models.items():
        full = path if os.path.isabs(path) else os.path.join(ROOT, path)
        add_bos, ids = tokenize_all(full, texts)
        stored = path if not os.path.isabs(path) else os.path.basename(path)
        result[key] = {"gguf": stored, "add_bos": add_bos, "ids": ids}
        print(key, add_bos, sum(len(i) for i in ids), "tokens")
    with open(OUT, "w", encoding="utf-8") as f:
        f.write("{\n")
        for n, (key, entry) in enumerate(result.items()):
            ids = ",\n".join("   " + json.dumps(i, separators=(",", ":")) for i in entry["ids"])
            f.write(f' "{key}": {{"gguf": {json.dumps(entry["gguf"])}, "add_bos": {json.dumps(entry["add_bos"])}, "ids": [\n{ids}\n ]}}')
            f.write(",\n" if n + 1 < len(result) else "\n")
        f.write("}\n")


if __name__ == "__main__":
    main()
