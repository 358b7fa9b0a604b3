#!/usr/bin/env python3
"""Load a GGUF with llama.cpp (CPU, via llama-cpp-python) and measure how confident it is.

usage: llama_check.py MODEL.gguf [--prompts N] [--len L] [--seed S] [--greedy G]
                      [--threads T] [--no-bos] [--json] [--verbose]

For each of N prompts of L token ids drawn uniformly from the vocabulary (control, unused, unknown
and end-of-generation tokens skipped; BOS prepended when the vocab says to add it, unless --no-bos),
it decodes the prompt and reports the probability of the likeliest next token (softmax of the last
logits). The mean of those top-1 probabilities says whether a synthetic model is "confident" (we aim
for 0.3-0.8). With --greedy G it also prints the G-token greedy continuation of each prompt.

Exit status: 0 when the model loaded and every decode gave finite logits; 2 when loading failed;
3 when a decode failed or produced non-finite logits. The confidence band does not change the exit
status; it is printed (and in --json, reported as "in_band").

Needs the witness venv (tests/witness/setup_witness_env.sh): llama-cpp-python 0.3.36 and numpy.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

import numpy as np

import llama_cpp

# Tokens a random prompt must not contain: they are not text and a model is not trained on them
# appearing at random.
_SKIP_ATTRS = (
    llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    | llama_cpp.LLAMA_TOKEN_ATTR_UNUSED
    | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
)

# ggml_log_level in this ggml: 1 debug, 2 info, 3 warn, 4 error, 5 continuation of the previous line.
_LOG_WARN, _LOG_CONT = 3, 5
_verbose_log = False
_last_log_level = 0


@llama_cpp.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # Warnings and errors always reach stderr (they flag odd GGUF metadata); the rest only with --verbose.
    global _last_log_level
    if level != _LOG_CONT:
        _last_log_level = level
    if _verbose_log or _last_log_level >= _LOG_WARN:
        sys.stderr.write(text.decode("utf-8", errors="replace"))


def _meta_str(model, key: str) -> str | None:
    buf = ctypes.create_string_buffer(512)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    if n < 0:
        return None
    return buf.value.decode("utf-8", errors="replace")


def _piece(vocab, token: int) -> str:
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, True)
    if n < 0:
        return "?"
    return buf.raw[:n].decode("utf-8", errors="replace")


def _sampleable_tokens(vocab, n_vocab: int) -> np.ndarray:
    keep = []
    for t in range(n_vocab):
        attr = llama_cpp.llama_vocab_get_attr(vocab, t)
        if attr == llama_cpp.LLAMA_TOKEN_ATTR_UNDEFINED or attr & _SKIP_ATTRS:
            continue
        if llama_cpp.llama_vocab_is_eog(vocab, t) or llama_cpp.llama_vocab_is_control(vocab, t):
            continue
        keep.append(t)
    return np.asarray(keep, dtype=np.int32)


class DecodeError(RuntimeError):
    pass


def _decode(ctx, tokens: list[int], n_vocab: int) -> np.ndarray:
    """Decodes `tokens` after what the context already holds; returns the last token's logits."""
    arr = (llama_cpp.llama_token * len(tokens))(*tokens)
    rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(tokens)))
    if rc != 0:
        raise DecodeError(f"llama_decode returned {rc}")
    ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
    if not ptr:
        raise DecodeError("llama_get_logits_ith returned NULL")
    logits = np.ctypeslib.as_array(ptr, shape=(n_vocab,)).astype(np.float64)
    if not np.all(np.isfinite(logits)):
        raise DecodeError(f"non-finite logits ({int(np.sum(~np.isfinite(logits)))} of {n_vocab})")
    return logits


def _softmax_top1(logits: np.ndarray) -> tuple[int, float, float]:
    """Returns (argmax, its probability, entropy in nats)."""
    z = logits - logits.max()
    p = np.exp(z)
    p /= p.sum()
    top = int(np.argmax(p))
    nz = p[p > 0]
    return top, float(p[top]), float(-(nz * np.log(nz)).sum())


def main(argv: list[str] | None = None) -> int:
    global _verbose_log
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=8, help="number of random prompts (default 8)")
    ap.add_argument("--len", type=int, default=32, help="random tokens per prompt (default 32)")
    ap.add_argument("--seed", type=int, default=0, help="RNG seed for the prompts (default 0)")
    ap.add_argument("--greedy", type=int, default=0, help="also print G greedy continuation tokens")
    # One thread by default: on a shared, busy machine every extra thread waits at ggml's per-op
    # barriers for a CPU, which made 2-thread decoding many times slower than 1 thread.
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    ap.add_argument("--no-bos", action="store_true", help="never prepend BOS")
    ap.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    ap.add_argument("--verbose", action="store_true", help="show llama.cpp's log")
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.len < 1 or args.greedy < 0:
        ap.error("--prompts and --len must be >= 1, --greedy >= 0")

    _verbose_log = args.verbose
    llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()

    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    t0 = time.perf_counter()
    model = llama_cpp.llama_model_load_from_file(args.model.encode(), mparams)
    if not model:
        print(f"error: llama.cpp could not load {args.model}", file=sys.stderr)
        return 2
    t_load = time.perf_counter() - t0

    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    arch = _meta_str(model, "general.architecture") or "?"
    desc = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(model, desc, len(desc))
    add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab)) and not args.no_bos
    bos = llama_cpp.llama_vocab_bos(vocab)
    print(f"model:        {args.model}")
    print(f"architecture: {arch}")
    print(f"description:  {desc.value.decode(errors='replace')}")
    print(f"n_vocab:      {n_vocab}")
    n_layer = llama_cpp.llama_model_n_layer(model)
    print(f"n_layer:      {n_layer}")
    print(f"n_embd:       {llama_cpp.llama_model_n_embd(model)}")
    print(f"n_params:     {llama_cpp.llama_model_n_params(model)}")
    print(f"load time:    {t_load:.2f} s")

    candidates = _sampleable_tokens(vocab, n_vocab)
    print(f"prompt pool:  {len(candidates)} of {n_vocab} tokens (control/unused/unknown/eog skipped)")
    print(f"bos:          {'prepended (id %d)' % bos if add_bos and bos >= 0 else 'none'}")
    if len(candidates) == 0:
        print("error: vocabulary has no ordinary tokens to sample", file=sys.stderr)
        return 3

    n_prompt = args.len + (1 if add_bos and bos >= 0 else 0)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = n_prompt + args.greedy + 16
    cparams.n_batch = max(n_prompt, 32)
    cparams.n_ubatch = cparams.n_batch
    cparams.n_threads = args.threads
    cparams.n_threads_batch = args.threads
    cparams.no_perf = True
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        print("error: llama_init_from_model failed", file=sys.stderr)
        llama_cpp.llama_model_free(model)
        return 2

    rng = np.random.default_rng(args.seed)
    results = []
    status = 0
    t0 = time.perf_counter()
    try:
        for i in range(args.prompts):
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
            prompt = [int(t) for t in rng.choice(candidates, size=args.len)]
            if add_bos and bos >= 0:
                prompt = [bos] + prompt
            logits = _decode(ctx, prompt, n_vocab)
            top, p_top, entropy = _softmax_top1(logits)
            rec = {"prompt": i, "top1": top, "p_top1": p_top, "entropy": entropy}
            line = (
                f"prompt {i:3d}: top1 id {top:6d} p={p_top:.4f} entropy={entropy:.3f} "
                f"piece={_piece(vocab, top)!r}"
            )
            if args.greedy:
                cont = [top]
                for _ in range(args.greedy - 1):
                    if llama_cpp.llama_vocab_is_eog(vocab, cont[-1]):
                        break
                    cont.append(int(np.argmax(_decode(ctx, [cont[-1]], n_vocab))))
                rec["greedy"] = cont
                line += f"\n    greedy: {cont}\n    text:   {''.join(_piece(vocab, t) for t in cont)!r}"
            print(line)
            results.append(rec)
    except DecodeError as e:
        print(f"error: decode failed: {e}", file=sys.stderr)
        status = 3
    t_decode = time.perf_counter() - t0
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)

    summary = {
        "model": args.model,
        "architecture": arch,
        "n_vocab": n_vocab,
        "n_layer": n_layer,
        "prompts": len(results),
        "len": args.len,
        "seed": args.seed,
        "ok": status == 0,
    }
    if results:
        p = np.array([r["p_top1"] for r in results])
        mean = float(p.mean())
        in_band = 0.3 <= mean <= 0.8
        summary.update(mean_p_top1=mean, min_p_top1=float(p.min()), max_p_top1=float(p.max()), in_band=in_band)
        print(
            f"mean top-1 probability: {mean:.4f} (min {p.min():.4f}, max {p.max():.4f}) over {len(p)} prompts; "
            f"{'in' if in_band else 'outside'} the 0.3-0.8 band"
        )
    print(f"decode time: {t_decode:.2f} s")
    if args.json:
        summary["results"] = results
        print(json.dumps(summary))
    return status


if __name__ == "__main__":
    sys.exit(main())
