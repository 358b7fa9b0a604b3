#!/usr/bin/env python3
"""How far llama.cpp is from itself: re-run committed witness references under other llama.cpp settings
(and, with --engine, our poly-engine binary) and apply the harness's acceptance rule to each against the
committed reference.

usage: witness_spread.py REFERENCE.json ... [--variants no_fa,no_fa_kv_f32,no_repack,ubatch64]
                         [--engine target/release/poly-engine] [--gemma-dir DIR] [--threads 2]

Variants (each changes one thing from the reference's settings, see make_references.py):
  no_fa          flash_attn disabled (the CPU flash-attention kernel accumulates V in F16)
  no_fa_kv_f32   flash_attn disabled and the K/V cache in F32 (all-F32 attention)
  no_repack      weights in the plain CPU buffer instead of CPU_REPACK (other dot-product kernels)
  ubatch64       n_ubatch 64 instead of 512
  threads1       one thread
  engine         our `poly-engine run --json --ignore-eos` (with --engine)

For each (reference, variant) it prints the acceptance rule's numbers: leading steps with the same
token, llama.cpp's first near tie (top two within 0.02), the largest difference of llama.cpp's five
probabilities over the compared steps, and ok/FAIL. It is a measurement for people; nothing runs it in CI.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
from pathlib import Path

import llama_cpp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_references as mr  # noqa: E402

NEAR_TIE = 0.02
MAX_DIFF = 0.02


class VariantWitness(mr.Witness):
    """A Witness whose model and context parameters differ from the reference's by one variant."""

    def __init__(self, path: Path, threads: int, variant: str):
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = variant != "no_repack"
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.threads = 1 if variant == "threads1" else threads
        self.variant = variant

    def context_params(self):
        cp = super().context_params()
        if self.variant in ("no_fa", "no_fa_kv_f32"):
            cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        if self.variant == "no_fa_kv_f32":
            cp.type_k = cp.type_v = llama_cpp.GGML_TYPE_F32
        if self.variant == "ubatch64":
            cp.n_ubatch = 64
        return cp


def engine_steps(engine: str, model: Path, ref: dict) -> list[dict]:
    ids = ",".join(map(str, ref["prompt"]))
    cmd = [engine, "run", "--model", str(model), "--prompt-tokens", ids, "--max-tokens",
           str(len(ref["steps"])), "--top", "20", "--json", "--ignore-eos", "--n-ctx", str(ref["n_ctx"])]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    steps = []
    for line in out.splitlines():
        if line.startswith("{"):
            o = json.loads(line)
            if "token" in o:
                steps.append({"token": o["token"], "top": [[t["token"], t["prob"]] for t in o["top"]]})
    return steps


def rule(ref: list[dict], ours: list[dict]) -> tuple[int, int | None, float, bool]:
    """(same leading tokens, first near tie, largest probability difference, accepted) as the harness."""
    tie = next((i for i, s in enumerate(ref) if s["top"][0][1] - s["top"][1][1] < NEAR_TIE), None)
    same, maxd, ok = 0, 0.0, True
    for i, (a, b) in enumerate(zip(ref, ours)):
        listed = dict((t, p) for t, p in b["top"])
        smallest = min(listed.values())
        for t, p in a["top"]:
            maxd = max(maxd, abs(p - listed[t]) if t in listed else max(0.0, p - smallest))
        if a["token"] != b["token"]:
            ok = tie is not None and tie <= i
            break
        same += 1
    return same, tie, maxd, ok and maxd <= MAX_DIFF and len(ours) >= min(len(ref), same + 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("references", nargs="+")
    ap.add_argument("--variants", default="no_fa,no_fa_kv_f32,no_repack,ubatch64")
    ap.add_argument("--engine", help="also run this poly-engine binary")
    ap.add_argument("--gemma-dir", default=str(mr.ROOT / "target" / "gemma3-270m"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    llama_cpp.llama_log_set(mr._log_callback, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    mr.N_TOP = 20  # list more than five, so llama.cpp's five are found in a variant's list
    variants = [v for v in args.variants.split(",") if v] + (["engine"] if args.engine else [])
    print(f"{'reference':44s} {'variant':13s} {'same':>4s} {'tie':>4s} {'max diff':>8s}  result")
    for f in args.references:
        ref = json.loads(Path(f).read_text())
        folder = Path(args.gemma_dir) if "model_fetch" in ref else mr.MODELS_DIR
        model = folder / ref["model"]
        for v in variants:
            if v == "engine":
                try:
                    steps = engine_steps(args.engine, model, ref)
                except subprocess.CalledProcessError as e:
                    why = (e.stderr or "").strip().splitlines()[-1:] or ["?"]
                    print(f"{Path(f).name:44s} {v:13s} engine failed: {why[0]}", flush=True)
                    continue
            else:
                w = VariantWitness(model, args.threads, v)
                try:
                    steps = w.generate(ref["prompt"])
                finally:
                    w.close()
            same, tie, maxd, ok = rule(ref["steps"], steps)
            verdict = "ok" if ok else "FAIL"
            print(f"{Path(f).name:44s} {v:13s} {same:4d} {str(tie):>4s} {maxd:8.4f}  {verdict}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
