#!/usr/bin/env python3
"""Several chats at once over HTTP against any OpenAI-compatible server (issue 20): ours
(`polystrata serve --parallel N`) and llama-server (`-np N`) measured the same way.

N clients each send CHATS chats back to back to /v1/chat/completions, streamed, greedy, at most
ANSWER tokens each. Every chat asks to continue a different passage of the repository's benchmark text
(server/bench/GPL-3.txt), so no two prompts are alike and no prompt cache is shared. Reported: the
answer tokens the servers counted (usage.completion_tokens, or the streamed chunks when a server gives
no usage), their rate over the wall time, the mean time to the first token and the chats per second.
End tokens are not ignored (the OpenAI API has no such field), so a server whose answers end early
writes fewer tokens: compare the token rate, not the chat rate.

usage: concurrent_http.py --url http://127.0.0.1:8080 --model NAME --clients N [--chats 4]
       [--answer 128] [--label TEXT]
"""
import argparse
import json
import threading
import time
import urllib.request
from pathlib import Path

TEXT = (Path(__file__).resolve().parent.parent / "server" / "bench" / "GPL-3.txt").read_text()


def passage(i, words=60):
    w = TEXT.split()
    start = (i * 97) % max(1, len(w) - words)
    return " ".join(w[start:start + words])


def chat(url, model, i, answer):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Continue this text:\n\n" + passage(i)}],
        "max_tokens": answer,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    chunks = 0
    usage = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            msg = json.loads(data)
            if msg.get("usage"):
                usage = msg["usage"]
            for c in msg.get("choices", []):
                if c.get("delta", {}).get("content"):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter() - t0
    tokens = usage["completion_tokens"] if usage else chunks
    return tokens, first if first is not None else time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--clients", type=int, required=True)
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--answer", type=int, default=128)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    results = []
    errors = []
    lock = threading.Lock()

    def client(c):
        for j in range(a.chats):
            try:
                r = chat(a.url, a.model, c * a.chats + j, a.answer)
                with lock:
                    results.append(r)
            except Exception as e:  # reported below, counted as a failed chat
                with lock:
                    errors.append(repr(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r[0] for r in results)
    ttft = sum(r[1] for r in results) / max(1, len(results))
    print(json.dumps({
        "label": a.label, "clients": a.clients, "chats": len(results), "failed": len(errors),
        "answer_tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
        "chats_per_s": round(len(results) / wall, 3), "first_token_ms": round(1000 * ttft),
        "errors": errors[:3],
    }))


if __name__ == "__main__":
    main()
