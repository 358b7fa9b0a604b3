#!/usr/bin/env python3
"""Drives `polystrata --model NAME` through a pseudo-terminal (Python's standard `pty`/`os.openpty`), as a
person at a terminal would: commands and messages typed line by line, the output read as it comes.

Usage:
  chat_terminal.py own   --bin POLYSTRATA --home HOME --port PORT --first qwen --second gem
      no server on PORT: the chat starts one, lists, chats, switches by part of a name, shows info,
      unloads, chats again (the model loads again), refuses an unknown name, and stops its server at /quit.
  chat_terminal.py shared --bin POLYSTRATA --home HOME --port PORT --first gem
      a server already runs on PORT: the chat switches it to the model, chats, ends at EOF (Ctrl-D), and the
      server keeps running with that model.
  chat_terminal.py interrupt --bin POLYSTRATA --home HOME --port PORT --first qwen
      Ctrl-C (SIGINT to the chat's process group, as a terminal sends it) during a long answer stops the
      answer (the server cancels it and keeps running), the chat goes on; Ctrl-C at the prompt says how to
      quit, a second one quits and stops the chat's server.
  chat_terminal.py picture --bin POLYSTRATA --home HOME --port PORT --first vision --second qwen --picture F
      a server runs with a model that reads pictures: /image refuses a missing file, a directory, a file
      past 5 MB and one that is no picture, attaches F, and the next message's answer is the server's
      answer to F and the text over HTTP; a text model refuses /image.
Exits non-zero with the reason (and the transcript) on the first failure.
"""

import argparse
import base64
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request

ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Terminal:
    def __init__(self, argv):
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
        os.close(slave)
        self.raw = b""  # everything read, escapes included
        self.pending = ""  # read but not yet matched, escapes removed

    def _fill(self, timeout):
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: the child closed the terminal
            data = b""
        if not data:
            return False
        self.raw += data
        self.pending += ANSI.sub("", data.decode("utf-8", "replace")).replace("\r", "")
        return True

    def expect(self, pattern, timeout=120):
        """Waits for `pattern` (a regex over the text without escapes); returns the text before it."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while True:
            m = regex.search(self.pending)
            if m:
                before = self.pending[: m.start()]
                self.pending = self.pending[m.end():]
                return before, m
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"timed out waiting for {pattern!r}; pending output: {self.pending[-2000:]!r}")
            if not self._fill(min(left, 1.0)):
                if not regex.search(self.pending):
                    raise RuntimeError(f"the chat ended before {pattern!r}; output: {self.pending[-2000:]!r}")

    def send(self, line):
        os.write(self.master, line.encode() + b"\n")

    def eof(self):
        os.write(self.master, b"\x04")

    def wait(self, timeout=60):
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._fill(0.2)
        return self.proc.wait(timeout=max(1, deadline - time.monotonic()))


def get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return json.load(r)


def answers(port):
    try:
        get(port, "/health")
        return True
    except OSError:
        return False


def check(cond, message):
    if not cond:
        raise RuntimeError(message)


def prompt(model):
    return rf"\n{re.escape(model)}> "


def chat_once(term, model, text):
    """Sends a message; returns what was shown between the echoed line and the next prompt."""
    term.send(text)
    term.expect(re.escape(text) + r"\n", 10)
    shown, _ = term.expect(prompt(model), 180)
    check(shown.strip() != "", f"no answer shown to {text!r}")
    check("error:" not in shown, f"the answer was an error: {shown!r}")
    return shown


def own(args, term):
    term.expect(r"starting a server on port", 30)
    _, m = term.expect(r"loading (\S+) \.\.\.", 60)
    first = m.group(1)
    check(args.first in first, f"{args.first!r} resolved to {first!r}")
    term.expect(rf"{re.escape(first)} loaded in", 180)
    term.expect(prompt(first), 10)
    check(answers(args.port), "the chat's server does not answer")

    term.send("/model list")
    listing, _ = term.expect(prompt(first), 30)
    lines = [l for l in listing.splitlines() if l.strip() and "/model list" not in l]
    check(len(lines) == 2, f"/model list printed {lines}")
    check(any(l.startswith(f"* {first} ") and "[loaded]" in l for l in lines), f"current not marked: {lines}")
    second = next(l.split()[0] for l in lines if not l.startswith("*"))
    check(args.second in second, f"the other model is {second!r}")

    term.send("/set max_tokens 16")
    term.expect(prompt(first), 10)
    shown = chat_once(term, first, "Hello there, who are you?")
    print(f"{first} answered {len(shown)} characters")

    term.send(f"/model switch {args.second}")
    term.expect(rf"{re.escape(second)} loaded in .*a new conversation", 180)
    term.expect(prompt(second), 10)
    current = get(args.port, "/api/models/current")
    check(current["model"] == second and current["loaded"], f"after the switch the server has {current}")

    term.send("/model info")
    info, _ = term.expect(prompt(second), 30)
    check(f"id: {second}" in info and "backend: " in info and "status: loaded" in info, f"/model info: {info!r}")
    term.send(f"/model info {args.first}")
    info, _ = term.expect(prompt(second), 30)
    check(f"id: {first}" in info and "status: available" in info, f"/model info {args.first}: {info!r}")
    term.send("/model")
    shown, _ = term.expect(prompt(second), 30)
    check(f"model {second}" in shown and "loaded" in shown, f"/model: {shown!r}")

    term.send("/model unload")
    term.expect(rf"unloaded {re.escape(second)}", 60)
    term.expect(prompt(second), 10)
    check(not get(args.port, "/api/models/current")["loaded"], "the model is still loaded after /model unload")

    shown = chat_once(term, second, "Tell me about the sea.")
    check(get(args.port, "/api/models/current")["loaded"], "the next message did not load the model again")
    print(f"{second} answered {len(shown)} characters after the unload")

    term.send("/model switch nosuchmodel")
    shown, _ = term.expect(prompt(second), 30)
    check("no model is called" in shown, f"an unknown name: {shown!r}")

    term.send("/quit")
    term.expect(r"stopping the server", 30)
    rc = term.wait(90)
    check(rc == 0, f"the chat exited {rc}")
    check(not answers(args.port), "the chat's server still answers after /quit")


def shared(args, term):
    term.expect(rf"using the server on port {args.port}", 30)
    _, m = term.expect(r"loading (\S+) \.\.\.", 60)
    model = m.group(1)
    check(args.first in model, f"{args.first!r} resolved to {model!r}")
    term.expect(prompt(model), 180)
    term.send("/set max_tokens 12")
    term.expect(prompt(model), 10)
    chat_once(term, model, "Hi!")
    term.eof()
    rc = term.wait(30)
    check(rc == 0, f"the chat exited {rc} at EOF")
    current = get(args.port, "/api/models/current")
    check(current["model"] == model and current["loaded"], f"the shared server now has {current}")


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def picture(args, term):
    """`/image PATH` attaches the user's picture to the next message: the answer is the server's answer
    to the same picture and text sent over HTTP; a missing file, a directory, a file past 5 MB and a
    file that is no picture are refused; a model that reads no pictures refuses /image."""
    term.expect(rf"using the server on port {args.port}", 30)
    _, m = term.expect(r"loading (\S+) \.\.\.", 60)
    model = m.group(1)
    term.expect(prompt(model), 180)
    for line in ("/set max_tokens 4", "/set temperature 0"):
        term.send(line)
        term.expect(prompt(model), 10)
    work = os.path.dirname(os.path.abspath(args.picture))
    huge = os.path.join(args.home, "huge.jpg")
    with open(huge, "wb") as f:
        f.truncate(6 << 20)
    for arg, needle in ((os.path.join(args.home, "missing.png"), "missing.png"),
                        (work, "is a directory"),
                        (huge, "up to 5 MB"),
                        (os.path.abspath(__file__), "not a PNG, JPEG or WebP")):
        term.send(f"/image {arg}")
        shown, _ = term.expect(prompt(model), 10)
        check("error:" in shown and needle in shown, f"/image {arg}: {shown!r}")
    term.send(f"/image {args.picture}")
    shown, _ = term.expect(prompt(model), 10)
    check("attached" in shown, f"/image {args.picture}: {shown!r}")
    term.send("/image")
    shown, _ = term.expect(prompt(model), 10)
    check(args.picture in shown, f"/image lists {shown!r}")
    text = "What is in this picture?"
    shown = chat_once(term, model, text)
    with open(args.picture, "rb") as f:
        data = base64.b64encode(f.read()).decode()
    mime = "image/png" if args.picture.endswith(".png") else "image/jpeg"
    direct = post(args.port, "/v1/chat/completions", {
        "model": model, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}},
            {"type": "text", "text": text}]}]})
    want = direct["choices"][0]["message"]["content"].strip()
    check(want != "" and want in shown, f"the chat showed {shown!r}; over HTTP the same picture gets {want!r}")
    # The picture went with that message only: /image lists none now.
    term.send("/image")
    shown, _ = term.expect(prompt(model), 10)
    check("no pictures attached" in shown, f"/image after the message: {shown!r}")
    if args.second:
        term.send(f"/model switch {args.second}")
        _, m = term.expect(r"loading (\S+) \.\.\.", 30)
        other = m.group(1)
        term.expect(prompt(other), 180)
        term.send(f"/image {args.picture}")
        shown, _ = term.expect(prompt(other), 10)
        check("reads no pictures" in shown, f"/image for a text model: {shown!r}")
    term.eof()
    rc = term.wait(30)
    check(rc == 0, f"the chat exited {rc} at EOF")


def ctrl_c(term):
    os.killpg(term.proc.pid, signal.SIGINT)


def interrupt(args, term):
    term.expect(r"starting a server on port", 30)
    _, m = term.expect(r"loading (\S+) \.\.\.", 60)
    model = m.group(1)
    term.expect(prompt(model), 180)
    # As long as the context allows, greedy (the synthetic model then writes no end token): the answer
    # is still running when Ctrl-C comes.
    term.send("/set max_tokens 4000")
    term.expect(prompt(model), 10)
    term.send("/set temperature 0")
    term.expect(prompt(model), 10)
    text = "Tell me a very long story."
    term.send(text)
    term.expect(re.escape(text) + r"\n", 10)
    term.expect(r"\S", 60)  # the answer has begun
    ctrl_c(term)
    shown, _ = term.expect(r"\(stopped\)", 30)
    term.expect(prompt(model), 10)
    # The server counts the cancel once the engine's DONE for it came.
    deadline = time.monotonic() + 15
    while get(args.port, "/health")["requests"]["cancelled"] < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    health = get(args.port, "/health")
    check(health["requests"]["cancelled"] >= 1, f"the server did not cancel the answer: {health}")
    check(get(args.port, "/api/models/current")["loaded"], "the server lost its model")
    # The chat goes on.
    term.send("/set max_tokens 8")
    term.expect(prompt(model), 10)
    chat_once(term, model, "And now briefly?")
    # At the prompt: a warning, then quit.
    ctrl_c(term)
    term.expect(r"Ctrl-C again or /bye to quit", 10)
    ctrl_c(term)
    term.expect(r"stopping the server", 10)
    rc = term.wait(60)
    check(rc == 0, f"the chat exited {rc} at the second Ctrl-C")
    check(not answers(args.port), "the chat's server still answers after the chat quit")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["own", "shared", "interrupt", "picture"])
    ap.add_argument("--bin", required=True)
    ap.add_argument("--home", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--first", required=True)
    ap.add_argument("--second", default="")
    ap.add_argument("--picture", default="", help="picture mode: the picture /image attaches")
    args = ap.parse_args()
    argv = [args.bin, "--home", args.home, "--port", str(args.port), "--model", args.first]
    term = Terminal(argv)
    t0 = time.monotonic()
    try:
        {"own": own, "shared": shared, "interrupt": interrupt, "picture": picture}[args.mode](args, term)
        dim = b"\x1b[2m" in term.raw
        print(f"chat {args.mode}: ok in {time.monotonic() - t0:.1f} s (reasoning dimmed: {dim})")
    except Exception as e:
        print(f"chat {args.mode}: FAILED: {e}", file=sys.stderr)
        print("transcript:\n" + term.raw.decode("utf-8", "replace")[-6000:], file=sys.stderr)
        if term.proc.poll() is None:
            os.killpg(term.proc.pid, 15)
            term.proc.wait()
        sys.exit(1)


if __name__ == "__main__":
    main()
