#!/usr/bin/env python3
"""A stand-in engine for server tests that need a model to write a given reply (a tool call, reasoning):
it speaks the engine protocol (protocol/README.md) on stdin/stdout and answers every GEN with the token
ids of a reply from a JSON file (a list of token-id lists), then DONE reason "stop". The reply is chosen
by the request's max_tokens: 100 + i picks reply i (so a client picks the reply it wants), any other
value takes the replies in turn.

The synthetic fixtures write noise, so this is how the server's reply handling (reasoning_content,
tool_calls, tool_use blocks, finish reasons) is driven end to end with real tokenizers and templates. It is
a test double of the engine process only; the server under test is the real one.

usage: replay_engine.py --model FILE --replies FILE [--n-vocab N] [--eos ID] [--draft PROPOSED/ACCEPTED]

--draft makes every DONE report that many guessed tokens proposed and accepted (and 10 ms of prompt, 20 ms
of answer), so llama-server's draft_n / draft_n_accepted timings are checked end to end.
"""

import argparse
import json
import sys


def send(verb, body):
    sys.stdout.write(f"{verb} {json.dumps(body)}\n")
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--replies", required=True)
    ap.add_argument("--n-vocab", type=int, default=2048)
    ap.add_argument("--eos", type=int, default=0)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--draft", default=None)
    args, _ = ap.parse_known_args()
    proposed, accepted, prefill_ms, decode_ms = 0, 0, 0.0, 0.0
    if args.draft:
        proposed, accepted = (int(x) for x in args.draft.split("/"))
        prefill_ms, decode_ms = 10.0, 20.0
    with open(args.replies) as f:
        replies = json.load(f)
    send("READY", {"protocol": 1, "model": args.model, "arch": "replay", "n_vocab": args.n_vocab,
                   "n_ctx": args.max_context, "bos": None, "eos": [args.eos], "device": "cpu",
                   "experts_total": 0, "experts_vram": 0})
    turn = 0
    for line in sys.stdin:
        verb, _, body = line.strip().partition(" ")
        msg = json.loads(body) if body else {}
        if verb == "QUIT":
            return
        if verb == "GEN":
            pick = msg.get("max_tokens", 0) - 100
            if 0 <= pick < len(replies):
                reply = replies[pick]
            else:
                reply = replies[turn % len(replies)]
                turn += 1
            for tok in reply:
                send("T", {"id": msg["id"], "tokens": [tok], "logprobs": [-0.5]})
            send("DONE", {"id": msg["id"], "reason": "stop", "prompt_tokens": len(msg["tokens"]),
                          "cached_tokens": 0, "generated": len(reply), "prefill_ms": prefill_ms,
                          "decode_ms": decode_ms, "experts_vram_share": None,
                          "draft_proposed": proposed, "draft_accepted": accepted})
        elif verb == "CANCEL":
            send("ERR", {"id": msg.get("id"), "code": "bad_request", "message": "nothing running"})
        elif verb == "STATS":
            send("STATS", {"rss_bytes": 0, "vram_bytes": None, "conversations": [], "parked_bytes": 0,
                           "park_limit_bytes": 0, "queued": 0})


if __name__ == "__main__":
    main()
