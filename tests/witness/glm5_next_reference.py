#!/usr/bin/env python3
"""A numpy reading of llama.cpp's glm5-next forward pass (GLM 5.3 Flash), checked against llama.cpp.

usage: glm5_next_reference.py MODEL.gguf [--lengths 8,30,100,300,1000] [--seed 7] [--threads 2]

This script is the algorithm of the pinned sdist's src/models/glm5-next.cpp, written out plainly for one
sequence read whole (no cache): mHC streams with the Sinkhorn-normalized mixing, KDA blocks (three causal
convs, per-channel decay in the delta rule, the gated RMS norm), MLA without RoPE over the F16-rounded
latent, the k-pool indexer (layer-normed keys and gates rounded to F16 as its cache holds them, pools of
kpool tokens, relu-scored, the best top_k / kpool visible pools plus the incomplete tail), the dense FFN,
the sigmoid-routed experts with their selection bias, renormalization and scale, the shared expert. It
reads F32 tensors only (synth --type F32). For each prompt length it prints, for the last position, the
top 5 probabilities of this reading and of llama.cpp (CPU, the witness settings of make_references.py),
and per MLA block the number of tokens whose top-k cut fell on a tie of scores, which it breaks as ggml's
CPU top_k does (libstdc++'s std::partial_sort: partial_sort_top_k below).

Checked on 2026-12-06 on synth's tiny shape (seed 1, F32; 64 wide since the engine runs glm5-next): top-5
probabilities within 3e-4 of llama.cpp at 25, 100, 500, 2000 and 4000 tokens (llama.cpp in ubatches of
512), with 8 indexer heads (15 tokens per MLA block with a tie at the cut at 4000). With 2 indexer heads a
pool's score is exactly 0 (every head's relu 0) often enough that ties are the rule, not the exception.
The engine's glm5-next forward agrees with both to the same 3e-4; its witness is the committed fixture
tests/fixtures/models/glm5-next-tiny-f32.gguf with llama.cpp's references.

Needs numpy, llama-cpp-python 0.3.36 (the witness venv, tests/witness/setup_witness_env.sh) and
gguf-py: the package `gguf`, else the sdist's vendor/llama.cpp/gguf-py (set GGUF_PY to its path).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

import numpy as np

try:
    from gguf import GGUFReader
except ImportError:
    SDIST_GGUF_PY = "/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py"
    sys.path.insert(0, os.environ.get("GGUF_PY", SDIST_GGUF_PY))
    from gguf import GGUFReader

A = "glm5-next"

class M:
    """The hyperparameters (llama.cpp's keys and defaults) and the F32 tensors of a glm5-next file."""

    def __init__(self, path):
        r = GGUFReader(path)
        kv = {k: v.contents() for k, v in r.fields.items()}
        self.t = {t.name: np.array(t.data, dtype=np.float32) for t in r.tensors}

        def g(key, default=None):
            return kv.get(f"{A}.{key}", default)

        self.n_all = g("block_count")
        self.L = self.n_all - g("nextn_predict_layers", 0)
        self.H = g("attention.head_count")
        self.kvh = g("attention.head_count_kv")
        self.eps = g("attention.layer_norm_rms_epsilon")
        self.neps = g("attention.layer_norm_epsilon")
        self.hd = g("kda.head_dim")
        self.dc = g("ssm.conv_kernel")
        self.lb = g("kda.gate_lower_bound")
        self.qkn = g("attention.key_length_mla")
        self.ih = g("attention.indexer.head_count")
        self.idim = g("attention.indexer.key_length")
        self.topk = g("attention.indexer.top_k")
        self.kp = g("attention.indexer.kpool")
        self.tail = g("attention.indexer.kpool_select_tail", True)
        self.itypes = g("attention.indexer.types", [True] * self.L)
        self.iters = g("hyper_connection.sinkhorn_iterations")
        self.hceps = g("hyper_connection.epsilon")
        self.dense = g("leading_dense_block_count", 0)
        self.nu = g("expert_used_count")
        self.wscale = g("expert_weights_scale", 0.0)
        self.wnorm = g("expert_weights_norm", False)
        self.gating = g("expert_gating_func", 2)

    def w(self, name):
        return self.t[name]


def rms(x, eps):
    return x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps).astype(np.float32)


def sig(x):
    return 1 / (1 + np.exp(-x))


def silu(x):
    return x * sig(x)


def softplus(x):
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def f16(a):
    """Rounded to F16, as llama.cpp's caches (type_k F16) hold the MLA latent and the indexer rows."""
    return a.astype(np.float16).astype(np.float32)


def hc_pre(m, Hs, il, kind):
    """mHC before a mixer (kind "attn") or an FFN ("ffn"): the block's input, post weights, comb[src, dst]."""
    T = Hs.shape[0]
    fn = m.w(f"blk.{il}.hc_{kind}_fn.weight")
    base = m.w(f"blk.{il}.hc_{kind}_base.weight")
    sc = m.w(f"blk.{il}.hc_{kind}_scale.weight")
    mix = rms(Hs.reshape(T, -1), m.eps) @ fn.T
    pre = sig(mix[:, 0:4] * sc[0] + base[0:4]) + m.hceps
    post = 2 * sig(mix[:, 4:8] * sc[1] + base[4:8])
    C = (mix[:, 8:24] * sc[2] + base[8:24]).reshape(T, 4, 4)  # [t, src, dst]
    C = np.exp(C - C.max(-1, keepdims=True))
    C = C / C.sum(-1, keepdims=True)
    C = C + m.hceps
    def cols():
        return C / (C.sum(1, keepdims=True) + m.hceps)
    def rows():
        return C / (C.sum(2, keepdims=True) + m.hceps)
    C = cols()
    for _ in range(1, m.iters):
        C = rows()
        C = cols()
    x = (Hs * pre[:, :, None]).sum(1)
    return x, post, C

def hc_post(out, Hs, post, C):
    # new[dst] = out*post[dst] + sum_src Hs[src]*C[src,dst]
    return out[:, None, :] * post[:, :, None] + np.einsum("tse,tsd->tde", Hs, C)

def conv(m, xp, w):
    T = xp.shape[0]
    w = w.reshape(-1, m.dc)  # [d_inner, d_conv]
    pad = np.concatenate([np.zeros((m.dc - 1, xp.shape[1]), np.float32), xp])
    out = sum(pad[j:j + T] * w[:, j] for j in range(m.dc))
    return silu(out)

def kda(m, x, il):
    b = f"blk.{il}."
    T, H, hd = x.shape[0], m.H, m.hd
    q = conv(m, x @ m.w(b + "attn_q.weight").T, m.w(b + "ssm_conv1d_q.weight")).reshape(T, H, hd)
    k = conv(m, x @ m.w(b + "attn_k.weight").T, m.w(b + "ssm_conv1d_k.weight")).reshape(T, H, hd)
    v = conv(m, x @ m.w(b + "attn_v.weight").T, m.w(b + "ssm_conv1d_v.weight")).reshape(T, H, hd)
    g1 = (x @ m.w(b + "ssm_f_a.weight").T) @ m.w(b + "ssm_f_b.weight").T + m.w(b + "ssm_dt.bias")
    Aa = m.w(b + "ssm_a").reshape(1, H, 1)
    if m.lb is not None:
        g = m.lb * sig(-(g1.reshape(T, H, hd) * Aa))
    else:
        g = softplus(g1).reshape(T, H, hd) * Aa
    beta = sig(x @ m.w(b + "ssm_beta.weight").T)  # [T, H]
    q = q / np.sqrt((q**2).sum(-1, keepdims=True) + 1e-6)
    k = k / np.sqrt((k**2).sum(-1, keepdims=True) + 1e-6)
    S = np.zeros((H, hd, hd), np.float32)  # S[h, i(key), j(value)]
    o = np.zeros((T, H, hd), np.float32)
    sc = 1 / np.sqrt(hd)
    for t in range(T):
        S *= np.exp(g[t])[:, :, None]
        d = (v[t] - np.einsum("hij,hi->hj", S, k[t])) * beta[t][:, None]
        S += k[t][:, :, None] * d[:, None, :]
        o[t] = np.einsum("hij,hi->hj", S, q[t]) * sc
    g2 = ((x @ m.w(b + "ssm_g_a.weight").T) @ m.w(b + "ssm_g_b.weight").T).reshape(T, H, hd)
    gated = rms(o, m.eps) * m.w(b + "ssm_norm.weight") * sig(g2)
    return gated.reshape(T, -1) @ m.w(b + "attn_output.weight").T

def partial_sort_top_k(s, k):
    """The indices ggml's CPU top_k keeps: libstdc++'s std::partial_sort (value greater first) of 0..n,
    whose __heap_select keeps, among equal values at the cut, those its heap of the first k holds."""
    idx = list(range(len(s)))

    def comp(a, b):
        return s[a] > s[b]

    def push_heap(h, hole, top, value):
        parent = (hole - 1) // 2
        while hole > top and comp(h[parent], value):
            h[hole] = h[parent]
            hole = parent
            parent = (hole - 1) // 2
        h[hole] = value

    def adjust_heap(h, hole, n, value):
        top = second = hole
        while second < (n - 1) // 2:
            second = 2 * (second + 1)
            if comp(h[second], h[second - 1]):
                second -= 1
            h[hole] = h[second]
            hole = second
        if n % 2 == 0 and second == (n - 2) // 2:
            second = 2 * (second + 1)
            h[hole] = h[second - 1]
            hole = second - 1
        push_heap(h, hole, top, value)

    heap = idx[:k]
    if k >= 2:
        for parent in range((k - 2) // 2, -1, -1):
            adjust_heap(heap, parent, k, heap[parent])
    for i in idx[k:]:
        if comp(i, heap[0]):
            adjust_heap(heap, 0, k, i)
    return np.array(sorted(heap))


def indexer(m, x, qr, il):
    b = f"blk.{il}."
    T, kp = x.shape[0], m.kp
    iq = (qr @ m.w(b + "indexer.attn_q_b.weight").T).reshape(T, m.ih, m.idim)
    ik = x @ m.w(b + "indexer.attn_k.weight").T
    mu = ik.mean(-1, keepdims=True)
    var = ((ik - mu) ** 2).mean(-1, keepdims=True)
    ik = (ik - mu) / np.sqrt(var + m.neps) * m.w(b + "indexer.k_norm.weight") + m.w(b + "indexer.k_norm.bias")
    ig = x @ m.w(b + "indexer_compressor_gate.weight").T
    ik, ig = f16(ik), f16(ig)
    ape = m.w(b + "indexer_compressor_ape.weight")  # [kp, idim]
    n_pool = T // kp
    lg = ig[: n_pool * kp].reshape(n_pool, kp, -1) + ape[None]
    p = np.exp(lg - lg.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    pooled = f16((p * ik[: n_pool * kp].reshape(n_pool, kp, -1)).sum(1))  # [n_pool, idim]
    wts = (x @ m.w(b + "indexer.proj.weight").T) / np.sqrt(m.idim * m.ih)
    score = (np.maximum(np.einsum("thd,pd->thp", iq, pooled), 0) * wts[:, :, None]).sum(1)  # [T, n_pool]
    ends = np.arange(n_pool) * kp + kp - 1
    n_top = min(n_pool, m.topk // kp) if n_pool else 0
    sel = np.zeros((T, T), bool)
    ties = 0
    for t in range(T):
        vis = np.nonzero(ends <= t)[0]
        if len(vis) > n_top:
            s = score[t, vis]
            order = np.argsort(-s, kind="stable")
            chosen = vis[partial_sort_top_k(s, n_top)]
            if s[order[n_top - 1]] == s[order[n_top]]:
                ties += 1
        else:
            chosen = vis
        for pidx in chosen:
            sel[t, pidx * kp: pidx * kp + kp] = True
        if m.tail:
            nt = (t + 1) % kp
            sel[t, t - nt + 1: t + 1] = True
    return sel, ties

def mla(m, x, il, prev):
    b = f"blk.{il}."
    T, H = x.shape[0], m.H
    qr = rms(x @ m.w(b + "attn_q_a.weight").T, m.eps) * m.w(b + "attn_q_a_norm.weight")
    q = (qr @ m.w(b + "attn_q_b.weight").T).reshape(T, H, m.qkn)
    kv = f16(rms(x @ m.w(b + "attn_kv_a_mqa.weight").T, m.eps) * m.w(b + "attn_kv_a_norm.weight"))
    qa = np.einsum("hcd,thd->thc", m.w(b + "attn_k_b.weight"), q)
    if m.itypes[il]:
        sel, ties = indexer(m, x, qr, il)
    else:
        sel, ties = prev
    s = np.einsum("thc,sc->hts", f16(qa), kv) / np.sqrt(m.qkn)
    s = np.where(sel[None], s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    ol = np.einsum("hts,sc->thc", s, kv)
    ov = np.einsum("hvc,thc->thv", m.w(b + "attn_v_b.weight"), ol)
    return ov.reshape(T, -1) @ m.w(b + "attn_output.weight").T, (sel, ties)

def ffn(m, x, il):
    b = f"blk.{il}."
    if il < m.dense:
        up = x @ m.w(b + "ffn_up.weight").T
        return (silu(x @ m.w(b + "ffn_gate.weight").T) * up) @ m.w(b + "ffn_down.weight").T
    logits = x @ m.w(b + "ffn_gate_inp.weight").T
    probs = sig(logits) if m.gating == 2 else np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    chooser = probs + m.w(b + "exp_probs_b.bias")
    top = np.argsort(-chooser, -1, kind="stable")[:, : m.nu]
    wt = np.take_along_axis(probs, top, -1)
    if m.wnorm:
        wt = wt / wt.sum(-1, keepdims=True)
    if m.wscale not in (0.0, 1.0):
        wt = wt * m.wscale
    G = m.w(b + "ffn_gate_exps.weight")
    U = m.w(b + "ffn_up_exps.weight")
    D = m.w(b + "ffn_down_exps.weight")
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(top[t]):
            h = silu(G[e] @ x[t]) * (U[e] @ x[t])
            out[t] += wt[t, j] * (D[e] @ h)
    up = x @ m.w(b + "ffn_up_shexp.weight").T
    sh = (silu(x @ m.w(b + "ffn_gate_shexp.weight").T) * up) @ m.w(b + "ffn_down_shexp.weight").T
    return out + sh

def forward(m, tokens):
    x = m.w("token_embd.weight")[tokens]
    Hs = np.repeat(x[:, None, :], 4, 1)
    prev = None
    ties = []
    for il in range(m.L):
        xin, post, C = hc_pre(m, Hs, il, "attn")
        xn = rms(xin, m.eps) * m.w(f"blk.{il}.attn_norm.weight")
        if m.kvh[il] == 0:
            out = kda(m, xn, il)
        else:
            out, prev = mla(m, xn, il, prev)
            ties.append(prev[1])
        Hs = hc_post(out, Hs, post, C)
        xin, post, C = hc_pre(m, Hs, il, "ffn")
        xn = rms(xin, m.eps) * m.w(f"blk.{il}.ffn_norm.weight")
        Hs = hc_post(ffn(m, xn, il), Hs, post, C)
    h = rms(Hs[-1:].mean(1), m.eps) * m.w("output_norm.weight")
    return (h @ m.w("output.weight").T)[0], ties



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--lengths", default="8,30,100,300,1000")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import llama_cpp
    import make_references as mr

    llama_cpp.llama_log_set(mr._log_callback, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    w = mr.Witness(Path(args.model), args.threads)
    rng = np.random.default_rng(args.seed)
    prompt = [int(x) for x in rng.choice(w.normal_tokens(), max(lengths))]
    m = M(args.model)
    for n in lengths:
        theirs = [(t[0], round(t[1], 5)) for t in w.generate(prompt[:n])[0]["top"]]
        lg, ties = forward(m, np.array(prompt[:n]))
        p = np.exp(lg - lg.max())
        p /= p.sum()
        ours = [(int(i), round(float(p[i]), 5)) for i in np.argsort(-p)[:5]]
        print(f"{n} tokens: ties at the cut per MLA block {ties}")
        print(f"  numpy     {ours}")
        print(f"  llama.cpp {theirs}")
    w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
