#!/usr/bin/env python3
"""Dump llama.cpp's intermediate tensors of one decode call, to find where our engine first departs.

usage: llama_dump.py MODEL OUT_DIR --tokens IDS [--prompt IDS] [--steps IDS] [--threads T] [--no-repack]
                    [--f16]

Runs llama.cpp as make_references.py does (same context settings): decodes --prompt in calls of at most
n_batch tokens, then each --steps token alone (as the greedy steps of a reference are decoded), then
--tokens in one call, during which every F32 tensor the graph computes is saved as OUT_DIR/NAME.K.npy
(NAME the ggml tensor name, e.g. `attn_norm-0`, `Qcur-0`, `kqv_out-0`, `ffn_out-0`, `l_out-0`,
`result_output`; K counts tensors of the same name, in graph order), with ggml's dimensions reversed
(row-major, the token index outermost). IDS are comma-separated token ids. --no-repack keeps the weights
out of llama.cpp's CPU_REPACK buffer (other summation orders), for comparison. --f16 saves the F16 tensors
too (as float16: the K/V cache views and their concatenations, the flash-attention masks).

engine/examples/dump_ops.rs writes our side (every Compute operation's output).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_references as mr  # noqa: E402  (the witness's llama.cpp settings)
import llama_cpp  # noqa: E402


class GgmlTensor(ctypes.Structure):
    """`struct ggml_tensor` of ggml 0.25 (ggml/include/ggml.h)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


def ids(s: str | None) -> list[int]:
    return [int(x) for x in s.split(",")] if s else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("out_dir")
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--prompt")
    ap.add_argument("--steps")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-repack", action="store_true")
    ap.add_argument("--f16", action="store_true", help="save the F16 tensors too")
    a = ap.parse_args()
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    llama_cpp.llama_log_set(mr._log_callback, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    if a.no_repack:
        default = llama_cpp.llama_model_default_params

        def no_repack():
            p = default()
            p.use_extra_bufts = False
            return p

        llama_cpp.llama_model_default_params = no_repack

    dumping = [False]
    seen: dict[str, int] = {}

    @ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)
    def on_tensor(ptr, ask, _user):
        if ask:
            return dumping[0]
        t = GgmlTensor.from_address(ptr)
        kinds = {0: np.float32, 1: np.float16} if a.f16 else {0: np.float32}  # GGML_TYPE_F32, F16
        if t.type not in kinds:
            return True
        dtype = kinds[t.type]
        ne, nb = list(t.ne), list(t.nb)
        span = sum((ne[i] - 1) * nb[i] for i in range(4)) + np.dtype(dtype).itemsize
        raw = ctypes.string_at(t.data, span)
        arr = np.ndarray(tuple(reversed(ne)), dtype, raw, 0, tuple(reversed(nb))).copy()
        name = t.name.decode()
        k = seen.get(name, 0)
        seen[name] = k + 1
        np.save(out / f"{name}.{k}.npy", arr)
        return True

    w = mr.Witness(Path(a.model), a.threads)
    cp = w.context_params()
    cp.cb_eval = on_tensor
    cp.cb_eval_user_data = None
    ctx = llama_cpp.llama_init_from_model(w.model, cp)
    if not ctx:
        raise RuntimeError("llama_init_from_model failed")
    prompt = ids(a.prompt)
    n_batch = llama_cpp.llama_n_batch(ctx)
    for i in range(0, len(prompt), n_batch):
        w._decode(ctx, prompt[i : i + n_batch])
    for t in ids(a.steps):
        w._decode(ctx, [t])
    dumping[0] = True
    w._decode(ctx, ids(a.tokens))
    llama_cpp.llama_free(ctx)
    print(f"{sum(seen.values())} tensors of {len(seen)} names in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
