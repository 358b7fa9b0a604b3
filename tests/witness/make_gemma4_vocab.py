#!/usr/bin/env python3
"""A small Gemma 4-style vocabulary as a GGUF of metadata only: tests/fixtures/text/gemma4-vocab.gguf.

Gemma 4's tokenizer (`tokenizer.ggml.model = gemma4`) is BPE over raw UTF-8: spaces become U+2581, the text
is split only at runs of newlines, merges are ranked, pieces that are not tokens fall back to `<0xXX>` byte
tokens, a run of newlines that is a token is taken whole, and llama.cpp adds BOS whatever the file says. No
real Gemma 4 file is reachable from here, so this vocabulary exercises each of those rules: byte tokens,
merges that build words, newline-run tokens with no merges, control tokens, and characters with no token.
It carries the `llama` architecture's minimal hyperparameters (llama.cpp loads its vocabulary only).

    python tests/witness/make_gemma4_vocab.py   # needs the gguf package (PyPI)

Then `make_tokenizer_ids.py --only synthetic_gemma4_vocab` writes llama.cpp's ids for it.
"""
import os

import gguf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests/fixtures/text/gemma4-vocab.gguf")

NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6

# Merges in rank order; each joins two tokens into a new one.
MERGES = [
    ("▁", "t"), ("h", "e"), ("▁t", "he"), ("i", "n"), ("in", "g"), ("▁", "a"), ("n", "d"), ("▁a", "nd"),
    ("l", "l"), ("e", "r"), ("o", "r"), ("▁", "w"), ("▁w", "or"), ("l", "d"), ("▁wor", "ld"), ("▁", "h"),
    ("he", "ll"), ("hell", "o"), ("▁", "hello"), ("▁", "i"), ("▁i", "s"), ("e", "s"), ("o", "n"),
    ("▁", "o"), ("▁o", "f"), ("▁", "c"), ("a", "t"), ("▁c", "at"), ("▁", "▁"), ("▁▁", "▁▁"), ("世", "界"),
    ("T", "he"), ("▁", "T"), ("r", "e"), ("▁", "s"), ("t", "h"), ("▁", "1"), ("1", "2"), ("▁", "("),
    ("H", "e"), ("He", "ll"), ("Hell", "o"), ("é", "t"), ("▁", "é"), ("n", "t"), ("e", "n"), ("en", "t"),
]


def main():
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"]
    types = [CONTROL, CONTROL, CONTROL, UNKNOWN]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    tokens += ["<start_of_turn>", "<end_of_turn>"]
    types += [CONTROL, CONTROL]
    chars = ["\n", "\n\n", "\n\n\n", "▁"]
    chars += [chr(c) for c in range(ord("a"), ord("z") + 1)]
    chars += [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    chars += [str(d) for d in range(10)]
    chars += list(".,!?'\"-:;()[]{}<>/=_+*#@&%$|")
    chars += ["é", "ü", "世", "界"]
    for c in chars:
        if c not in tokens:
            tokens.append(c)
            types.append(NORMAL)
    merges = []
    for a, b in MERGES:
        assert a in tokens and b in tokens, (a, b)
        if a + b not in tokens:
            tokens.append(a + b)
            types.append(NORMAL)
        merges.append(f"{a} {b}")

    w = gguf.GGUFWriter(OUT, "llama")
    w.add_name("gemma4-style vocabulary (tokenizer fixture)")
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gemma4")
    w.add_tokenizer_pre("gemma4")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    # llama.cpp adds BOS for this vocabulary anyway ("workaround for Gemma 4"): the file says no.
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {OUT}: {len(tokens)} tokens, {len(merges)} merges")


if __name__ == "__main__":
    main()
