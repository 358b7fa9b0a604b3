#!/usr/bin/env python3
"""Write kernels/testdata/qwen35moe-recurrent-step.bin: one decode step of llama.cpp's recurrent ops, the
reference the tests of `ops::recurrent` hold our kernels to, bit for bit.

usage: /work/venv-witness/bin/python kernels/testdata/make_recurrent_step.py

llama.cpp (the witness venv, tests/witness/README.md) runs the committed fixture
tests/fixtures/models/qwen35moe-tiny-q4k-q8.gguf on the CPU with 2 threads: a first decode call reads
eight tokens, a second reads one more; an eval callback copies the inputs and outputs of block 0's
`ssm_conv` and `gated_delta_net` in the second call (so both start from a carried, non-zero state).

File: a sequence of sections, each a little-endian u32 count then that many little-endian f32:
  conv_state    [64][3]  the first 64 channels' conv state, ggml's layout (per channel, oldest tap first)
  conv_x        [64]     those channels of this token's input (the QKV projection)
  conv_weight   [64][4]  those channels' kernel taps (ggml's [d_conv, channels])
  conv_out      [64]     ggml_ssm_conv's output (before SiLU)
  q             [2][64]  both key heads' L2-normed queries (not repeated to the value heads)
  k             [2][64]  both key heads' L2-normed keys
  v             [64]     value head 2's values
  gate          [1]      value head 2's log-decay
  beta          [1]      value head 2's write strength
  state         [64][64] value head 2's delta-rule state before the step ([v][k]: row j for value j)
  out           [64]     value head 2's output
  new_state     [64][64] value head 2's state after the step
"""

import ctypes
import struct
from pathlib import Path

import numpy as np
import llama_cpp

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests/fixtures/models/qwen35moe-tiny-q4k-q8.gguf"
OUT = ROOT / "kernels/testdata/qwen35moe-recurrent-step.bin"
TOKENS = [564, 1392, 1226, 1754, 1350, 593, 986, 1827, 1990]
HEAD = 2  # value head; reads key head 2 % 2 = 0 in llama.cpp's (tiled) order
CHANNELS = 64


class Tensor(ctypes.Structure):
    """The leading fields of ggml's `struct ggml_tensor` (x86-64)."""

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
    ]


WANT = {
    "conv_states_reshaped-0",
    "linear_attn_qkv_mixed-0",
    "conv_output_raw-0",
    "q_conv_predelta-0",
    "k_conv_predelta-0",
    "v_conv_predelta-0",
    "gate-0",
    "beta_sigmoid-0",
    "state_predelta-0",
    "attn_output-0",
    "new_state-0",
}
captured: dict[str, np.ndarray] = {}
recording = {"on": False}


@ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)
def on_tensor(ptr, ask, _user):
    if ask or not recording["on"]:
        return True
    t = Tensor.from_address(ptr)
    name = t.name.decode()
    if name in WANT and name not in captured and t.type == 0:  # GGML_TYPE_F32
        ne, nb = list(t.ne), list(t.nb)
        base = np.ctypeslib.as_array((ctypes.c_float * 1).from_address(t.data))
        arr = np.lib.stride_tricks.as_strided(
            base, shape=(ne[3], ne[2], ne[1], ne[0]), strides=(nb[3], nb[2], nb[1], nb[0])
        )
        captured[name] = arr.copy()
    return True


@llama_cpp.llama_log_callback
def quiet(level, text, user):
    pass


def main() -> None:
    llama_cpp.llama_log_set(quiet, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(MODEL).encode(), mp)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = 256
    cp.n_threads = cp.n_threads_batch = 2
    cp.cb_eval = on_tensor
    ctx = llama_cpp.llama_init_from_model(model, cp)

    def decode(tokens):
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(tokens))) == 0

    decode(TOKENS[:8])
    recording["on"] = True
    decode(TOKENS[8:])
    missing = WANT - captured.keys()
    assert not missing, missing

    # The conv kernel from the file (F32, [d_conv, channels]).
    from gguf import GGUFReader

    w = next(t for t in GGUFReader(str(MODEL)).tensors if t.name == "blk.0.ssm_conv1d.weight")
    conv_w = np.asarray(w.data, dtype=np.float32).reshape(-1, 4)[:CHANNELS]

    c = captured
    sections = [
        c["conv_states_reshaped-0"].reshape(-1, 3)[:CHANNELS],
        c["linear_attn_qkv_mixed-0"].reshape(-1)[:CHANNELS],
        conv_w,
        c["conv_output_raw-0"].reshape(-1)[:CHANNELS],
        c["q_conv_predelta-0"].reshape(2, 64),
        c["k_conv_predelta-0"].reshape(2, 64),
        c["v_conv_predelta-0"].reshape(4, 64)[HEAD],
        c["gate-0"].reshape(4)[HEAD : HEAD + 1],
        c["beta_sigmoid-0"].reshape(4)[HEAD : HEAD + 1],
        c["state_predelta-0"].reshape(4, 64, 64)[HEAD],
        c["attn_output-0"].reshape(4, 64)[HEAD],
        c["new_state-0"].reshape(4, 64, 64)[HEAD],
    ]
    with open(OUT, "wb") as f:
        for s in sections:
            flat = np.ascontiguousarray(s, dtype="<f4").reshape(-1)
            f.write(struct.pack("<I", flat.size))
            f.write(flat.tobytes())
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)


if __name__ == "__main__":
    main()
