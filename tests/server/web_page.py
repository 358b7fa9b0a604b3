#!/usr/bin/env python3
"""Drives the chat page of a running `polystrata serve` in headless Chromium over the DevTools protocol.

Standard library only: the DevTools websocket (RFC 6455, client side: masked frames out, plain frames in,
fragments joined) is a few dozen lines, which keeps the test free of pip packages; Chromium is the one
thing to install (Debian: `apt-get install -y chromium`).

Usage: web_page.py --url http://127.0.0.1:PORT/ --pick MODEL --other MODEL --broken MODEL --shot OUT.png
       web_page.py --url ... --picture FILE --vision-model MODEL --text-model MODEL --shot OUT.png
The page must list the three models; a load of the broken one must fail; the script picks MODEL in the header, sends a message, watches the answer
stream in, checks the Markdown renderer escapes HTML and reasoning shows collapsed, reloads and finds the conversation kept, and saves
a screenshot. It exits non-zero with the reason on the first failure.
"""

import argparse
import base64
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request


class WebSocket:
    """A minimal websocket client: text frames, enough for the DevTools protocol."""

    def __init__(self, url, timeout):
        parts = urllib.parse.urlparse(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET {parts.path} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
                "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise RuntimeError("websocket handshake: connection closed")
            head += chunk
        status = head.split(b"\r\n", 1)[0]
        if b" 101 " not in status:
            raise RuntimeError(f"websocket handshake refused: {status!r}")
        self.buffer = head.split(b"\r\n\r\n", 1)[1]

    def send(self, text):
        payload = text.encode()
        header = bytes([0x81])
        n = len(payload)
        if n < 126:
            header += bytes([0x80 | n])
        elif n < 65536:
            header += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            header += bytes([0x80 | 127]) + struct.pack(">Q", n)
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(header + mask + masked)

    def _read(self, n):
        while len(self.buffer) < n:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise RuntimeError("websocket closed")
            self.buffer += chunk
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out

    def recv(self):
        message = b""
        while True:
            b0, b1 = self._read(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._read(8))[0]
            mask = self._read(4) if b1 & 0x80 else None
            data = self._read(n)
            if mask:
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
            opcode = b0 & 0x0F
            if opcode == 0x8:
                raise RuntimeError("websocket closed by the browser")
            if opcode == 0x9:  # ping: answer with pong
                self.sock.sendall(bytes([0x8A, 0x80 | len(data)]) + b"\0\0\0\0" + data)
                continue
            if opcode in (0x0, 0x1, 0x2):
                message += data
                if b0 & 0x80:
                    return message.decode()


class DevTools:
    def __init__(self, ws_url, timeout):
        self.ws = WebSocket(ws_url, timeout)
        self.next_id = 0

    def call(self, method, **params):
        self.next_id += 1
        wanted = self.next_id
        self.ws.send(json.dumps({"id": wanted, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == wanted:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def eval(self, expression):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"page error in {expression!r}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression, what, timeout):
        """Polls `expression` until it is truthy; the page changes on its own (streams, loads)."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.05)


def find_chromium():
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise SystemExit("no chromium found: apt-get install -y chromium (or set CHROMIUM)")


def start_browser(profile):
    args = [
        find_chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--mute-audio",
        "--remote-debugging-port=0", f"--user-data-dir={profile}", "--window-size=1200,860", "about:blank",
    ]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # Chromium names its DevTools address on stderr once it listens.
    for line in proc.stderr:
        if "DevTools listening on" in line:
            port = urllib.parse.urlparse(line.split("DevTools listening on", 1)[1].strip()).port
            return proc, port
    raise SystemExit(f"chromium exited ({proc.wait()}) before it listened")


def page_socket(port, timeout):
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            pages = [t for t in json.load(r) if t.get("type") == "page"]
        if pages:
            return pages[0]["webSocketDebuggerUrl"]
        if time.monotonic() > deadline:
            raise RuntimeError("chromium has no page target")
        time.sleep(0.1)


def check(cond, message):
    if not cond:
        raise RuntimeError(message)


def run(args, cdp):
    cdp.call("Page.enable")
    cdp.call("Runtime.enable")
    cdp.call("Page.navigate", url=args.url)
    cdp.wait_for("document.body && document.body.dataset.ready === '1'", "the page to read /api/models", 60)
    # A short answer keeps the run fast on 2 cores; the page sends max_tokens when this is set.
    cdp.eval(f"localStorage.setItem('polystrata.maxTokens', '{args.max_tokens}')")
    # Greedy: the models' defaults sample, and the long answer below must not end by itself before Stop.
    cdp.eval("localStorage.setItem('polystrata.temperature', '0')")

    options = cdp.eval("[...document.querySelectorAll('#model-picker option')].map(o => o.value)")
    check(sorted(options) == sorted([args.pick, args.other, args.broken]), f"the picker lists {options}")
    check(cdp.eval("!document.getElementById('model-picker').hidden"), "the picker is hidden with two models")

    # The renderer escapes what a model writes and still renders Markdown.
    html = cdp.eval("renderMarkdown('**bold** <img src=x onerror=alert(1)> `a<b`\\n```js\\nlet x = 1 < 2;\\n```')")
    check("<strong>bold</strong>" in html and "<img" not in html and "&lt;img" in html, f"markdown: {html}")
    check('<pre><code class="language-js">let x = 1 &lt; 2;</code></pre>' in html, f"code block: {html}")

    # Reasoning shows collapsed above the answer.
    view = cdp.eval(
        "(() => { const v = messageView({role: 'assistant', content: 'The answer', reasoning: 'Thinking it over'});"
        " const d = v.querySelector('details.reasoning');"
        " return [d.hidden, d.open, d.textContent, v.querySelector('.content').textContent]; })()"
    )
    check(view == [False, False, "ReasoningThinking it over", "The answer"], f"reasoning view: {view}")

    # Pick the model in the header: the page loads it and shows progress, then "loaded".
    t0 = time.monotonic()
    # The state right after the change event: the page shows progress before the load answers.
    saw_loading = cdp.eval(
        f"(() => {{ const p = document.getElementById('model-picker'); p.value = {json.dumps(args.pick)};"
        " p.dispatchEvent(new Event('change')); return document.body.dataset.modelState"
        " + ' ' + document.getElementById('model-status').textContent; })()"
    ).startswith("loading loading " + args.pick)
    cdp.wait_for("document.body.dataset.modelState === 'loaded'", f"{args.pick} to load", 120)
    check(saw_loading, "the page showed no progress while loading")
    check(cdp.eval("document.getElementById('model-picker').value") == args.pick, "the picker did not keep the model")
    with urllib.request.urlopen(urllib.parse.urljoin(args.url, "/api/models/current"), timeout=10) as r:
        current = json.load(r)
    check(current.get("model") == args.pick and current.get("loaded"), f"the server's model is {current}")
    print(f"picked {args.pick}: loaded in {time.monotonic() - t0:.1f} s")

    # A model whose engine fails to start: the page says so, and the server keeps the model it had.
    cdp.eval(
        f"(() => {{ const p = document.getElementById('model-picker'); p.value = {json.dumps(args.broken)};"
        " p.dispatchEvent(new Event('change')); })()"
    )
    cdp.wait_for("document.body.dataset.modelState === 'error'", f"{args.broken} to fail", 120)
    status = cdp.eval("document.getElementById('model-status').textContent")
    check(status.startswith(f"could not load {args.broken}: "), f"the failed load shows {status!r}")
    check(cdp.eval("document.getElementById('model-picker').value") == args.pick, "the picker left the loaded model")
    print(f"failed load shown: {status}")

    # Send a message as a person would: type into the box and press Enter.
    cdp.eval("document.getElementById('input').focus()")
    cdp.call("Input.insertText", text="Write a short poem about rivers.")
    for kind in ("keyDown", "keyUp"):
        cdp.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13,
                 **({"text": "\r"} if kind == "keyDown" else {}))
    t0 = time.monotonic()
    try:
        cdp.wait_for("!!document.querySelector('.message.assistant')", "the answer to appear", 10)
    except RuntimeError:
        seen = cdp.eval("[document.getElementById('input').value, document.activeElement.id,"
                        " document.getElementById('send').disabled, document.body.dataset.modelState]")
        raise RuntimeError(f"no answer appeared after Enter (input, focus, send disabled, model state: {seen})")
    # While streaming, the Stop button shows; the text grows event by event.
    lengths = set()
    deadline = time.monotonic() + 120
    while True:
        state, n = cdp.eval(
            "(() => { const m = document.querySelector('.message.assistant');"
            " return [m.dataset.state, m.querySelector('.content').textContent.length]; })()"
        )
        lengths.add(n)
        if state != "streaming":
            break
        check(time.monotonic() < deadline, "the answer did not finish in 120 s")
        time.sleep(0.02)
    answer = cdp.eval("document.querySelector('.message.assistant .content').textContent")
    chunks = int(cdp.eval("document.querySelector('.message.assistant').dataset.chunks || '0'"))
    error = cdp.eval("document.querySelector('.message.assistant .error').textContent")
    check(state == "done", f"the answer ended {state}: {error}")
    check(answer.strip() != "", "the answer is empty")
    check(chunks > 1, f"the answer came in {chunks} event(s), not a stream")
    check(cdp.eval("document.getElementById('stop').hidden"), "the Stop button stays after the answer")
    print(f"answer streamed in {chunks} events, {len(answer)} characters, {len(lengths)} sizes seen, "
          f"{time.monotonic() - t0:.1f} s")

    # The model's notes (from its run config) show under the header.
    if args.notes:
        notice = cdp.eval("document.getElementById('notice').hidden ? '' : document.getElementById('notice').textContent")
        check(args.notes in notice, f"the notice says {notice!r}")
    if args.clamped:
        check("--max-context 999999" in notice and "clamped to" in notice,
              f"the notice does not say the context was clamped: {notice!r}")

    # Stop: a long answer is cut off by the Stop button (the fetch is aborted, the server cancels).
    cdp.eval("localStorage.setItem('polystrata.maxTokens', '3000')")
    cdp.eval("document.getElementById('input').value = 'Go on, at length.';"
             " document.getElementById('composer').requestSubmit()")
    last = "document.querySelectorAll('.message.assistant')[1]"
    cdp.wait_for(f"!!{last} && Number({last}.dataset.chunks || 0) > 2", "the long answer to start", 60)
    check(not cdp.eval("document.getElementById('stop').hidden"), "no Stop button while streaming")
    cdp.eval("document.getElementById('stop').click()")
    cdp.wait_for(f"{last}.dataset.state !== 'streaming'", "the stop", 30)
    check(cdp.eval(f"{last}.dataset.state") == "stopped", "the answer did not end as stopped")
    stopped_at = cdp.eval(f"Number({last}.dataset.chunks)")
    check(stopped_at < 3000, f"the stop came after {stopped_at} events")
    print(f"stopped after {stopped_at} events")
    cdp.eval(f"localStorage.setItem('polystrata.maxTokens', '{args.max_tokens}')")

    # The conversation is kept in the browser: a reload shows it again in the list and the messages.
    shot = cdp.call("Page.captureScreenshot", format="png")["data"]
    os.makedirs(os.path.dirname(os.path.abspath(args.shot)), exist_ok=True)
    with open(args.shot, "wb") as f:
        f.write(base64.b64decode(shot))
    print(f"screenshot {args.shot}")
    cdp.call("Page.reload")
    cdp.wait_for("document.body && document.body.dataset.ready === '1'", "the reloaded page", 60)
    kept = cdp.eval(
        "[document.querySelectorAll('#conversations li').length,"
        " document.querySelector('.message.assistant .content').textContent,"
        " document.querySelectorAll('.message').length,"
        " document.querySelectorAll('.message.assistant')[1].dataset.state]"
    )
    check(kept == [1, answer, 4, "stopped"], f"after a reload: {kept}")
    # New and delete work on the list.
    cdp.eval("document.getElementById('new-chat').click()")
    check(cdp.eval("document.querySelectorAll('#conversations li').length") == 2, "New chat added no entry")
    cdp.eval("document.querySelector('#conversations li .delete').click()")
    check(cdp.eval("document.querySelectorAll('#conversations li').length") == 1, "delete removed no entry")
    more(args, cdp)


def answer_done(cdp, index, what):
    m = f"document.querySelectorAll('.message.assistant')[{index}]"
    cdp.wait_for(f"!!{m} && {m}.dataset.state !== 'streaming'", what, 120)
    check(cdp.eval(f"{m}.dataset.state") == "done", f"{what}: {cdp.eval(m + '.dataset.state')}")


def more(args, cdp):
    """Issue 20's rows: the name once in the picker, settings sent with the request, the speed after each
    answer, regenerate and edit, the header following the server after an unload, the phone layout."""
    labels = cdp.eval("[...document.querySelectorAll('#model-picker option')].map(o => o.textContent)")
    for label in labels:
        name = label.split(" - ")[0]
        check(all(name.count(i) <= 1 for i in (args.pick, args.other)), f"a name shown twice: {labels}")
    # Record what the page sends.
    cdp.eval("(() => { const f = window.fetch; window.__bodies = [];"
             " window.fetch = (u, i) => { if (i && i.body && String(u).includes('chat')) window.__bodies.push(JSON.parse(i.body));"
             " return f(u, i); }; })()")
    # Settings, typed as a person would: they are kept and sent.
    cdp.eval("(() => { const set = (id, v) => { const e = document.getElementById(id); e.value = v;"
             " e.dispatchEvent(new Event('input')); };"
             f" set('set-temperature', '0.3'); set('set-max-tokens', '{args.max_tokens}'); set('set-system', 'Answer in verse.'); }})()")
    n = cdp.eval("document.querySelectorAll('.message.assistant').length")
    cdp.eval("document.getElementById('input').value = 'A third question.'; document.getElementById('composer').requestSubmit()")
    answer_done(cdp, n, "the answer with settings")
    body = cdp.eval("window.__bodies[window.__bodies.length - 1]")
    check(body.get("temperature") == 0.3 and body.get("max_tokens") == args.max_tokens, f"settings not sent: {body}")
    check(body["messages"][0] == {"role": "system", "content": "Answer in verse."}, f"no system prompt: {body['messages'][:1]}")
    speed = cdp.eval(f"document.querySelectorAll('.message.assistant')[{n}].querySelector('.speed').textContent")
    check("tokens/s" in speed and "first token" in speed, f"the speed after the answer: {speed!r}")
    print(f"speed shown: {speed}")
    # Regenerate the last answer: the same number of messages, a new answer.
    count = cdp.eval("document.querySelectorAll('.message').length")
    cdp.eval(f"document.querySelectorAll('.message.assistant')[{n}].querySelector('.regenerate').click()")
    answer_done(cdp, n, "the regenerated answer")
    check(cdp.eval("document.querySelectorAll('.message').length") == count, "regenerate changed the message count")
    check(cdp.eval("window.__bodies.length") >= 2, "regenerate sent nothing")
    check(cdp.eval("!!document.querySelector('.message.assistant .copy')"), "no Copy button")
    # Edit the last question: the conversation is cut there and the text is back in the input.
    cdp.eval("[...document.querySelectorAll('.message.user')].pop().querySelector('.edit').click()")
    check(cdp.eval("document.getElementById('input').value") == "A third question.", "edit did not fill the input")
    check(cdp.eval("document.querySelectorAll('.message').length") == count - 2, "edit did not cut the conversation")
    # The header follows the server: unloaded elsewhere, then a message loads the model again.
    cdp.eval("fetch('/api/models/unload', {method: 'POST', headers: {'Content-Type': 'application/json'}, body: '{}'})"
             ".then(() => refreshModels())")
    cdp.wait_for("document.body.dataset.modelState === 'unloaded'", "the header to say unloaded", 30)
    n = cdp.eval("document.querySelectorAll('.message.assistant').length")
    cdp.eval("document.getElementById('composer').requestSubmit()")
    answer_done(cdp, n, "the answer after the unload")
    cdp.wait_for("document.body.dataset.modelState === 'loaded'", "the header to say loaded again", 30)
    # Phone width (390 px): the input takes the width, the conversations do not take half of it.
    cdp.call("Emulation.setDeviceMetricsOverride", width=390, height=800, deviceScaleFactor=1, mobile=True)
    time.sleep(0.3)
    widths = cdp.eval("[document.getElementById('input').getBoundingClientRect().width,"
                      " document.getElementById('sidebar').getBoundingClientRect().height,"
                      " document.querySelector('main').getBoundingClientRect().width, window.innerWidth]")
    check(widths[0] >= 250, f"the input is {widths[0]} px wide at 390 px")
    wide = cdp.eval("[...document.querySelectorAll('body *')].filter(e => e.getBoundingClientRect().right > 392)"
                    ".slice(0, 6).map(e => e.tagName + '#' + e.id + '.' + e.className + ' ' + Math.round(e.getBoundingClientRect().right))")
    check(widths[2] >= widths[3] - 2, f"the chat is {widths[2]} of {widths[3]} px wide; past 390 px: {wide}")
    check(widths[1] <= 0.3 * 800, f"the conversations take {widths[1]} px of 800")
    bottom = cdp.eval("document.getElementById('input').getBoundingClientRect().bottom")
    check(bottom <= 800, f"the input is below the screen ({bottom} px of 800)")
    shot = cdp.call("Page.captureScreenshot", format="png")["data"]
    phone = os.path.join(os.path.dirname(os.path.abspath(args.shot)), "phone.png")
    with open(phone, "wb") as f:
        f.write(base64.b64decode(shot))
    print(f"phone layout: input {widths[0]:.0f} px, screenshot {phone}")


def run_pictures(args, cdp):
    """A model that reads pictures: the Picture button shows, a chosen file is previewed, sent with the
    question as an image_url data URL of the file's bytes, shown in the conversation and answered; after a
    reload the picture is still shown; a text model hides the button."""
    cdp.call("Page.enable")
    cdp.call("Runtime.enable")
    cdp.call("DOM.enable")
    cdp.call("Page.navigate", url=args.url)
    cdp.wait_for("document.body && document.body.dataset.ready === '1'", "the page to read /api/models", 60)
    cdp.eval(f"localStorage.setItem('polystrata.maxTokens', '{args.max_tokens}')")
    cdp.eval("localStorage.setItem('polystrata.temperature', '0')")
    cdp.wait_for("document.body.dataset.modelState === 'loaded'", f"{args.vision_model} loaded", 60)
    check(cdp.eval("document.body.dataset.vision") == "1", "the page does not say the model reads pictures")
    check(not cdp.eval("document.getElementById('attach').hidden"), "no Picture button for a model that reads pictures")
    cdp.eval("(() => { const f = window.fetch; window.__bodies = [];"
             " window.fetch = (u, i) => { if (i && i.body && String(u).includes('chat')) window.__bodies.push(JSON.parse(i.body));"
             " return f(u, i); }; })()")
    # Choose the file as a person would through the file dialog (DevTools sets the input's files and the
    # page gets its change event).
    root = cdp.call("DOM.getDocument")["root"]["nodeId"]
    node = cdp.call("DOM.querySelector", nodeId=root, selector="#picture-file")["nodeId"]
    cdp.call("DOM.setFileInputFiles", nodeId=node, files=[os.path.abspath(args.picture)])
    cdp.wait_for("document.querySelectorAll('#attachments img').length === 1", "the picture's preview", 10)
    cdp.eval("document.getElementById('input').value = 'What is in this picture?';"
             " document.getElementById('composer').requestSubmit()")
    answer_done(cdp, 0, "the answer about the picture")
    with open(args.picture, "rb") as f:
        want = base64.b64encode(f.read()).decode()
    mime = "image/png" if args.picture.endswith(".png") else "image/jpeg"
    body = cdp.eval("window.__bodies[window.__bodies.length - 1]")
    content = body["messages"][-1]["content"]
    check(isinstance(content, list) and len(content) == 2, f"the message's content: {str(content)[:200]}")
    check(content[0].get("type") == "image_url" and content[0]["image_url"]["url"] == f"data:{mime};base64,{want}",
          f"the picture part is not the file's data URL: {str(content[0])[:200]}")
    check(content[1] == {"type": "text", "text": "What is in this picture?"}, f"the text part: {content[1]}")
    answer = cdp.eval("document.querySelector('.message.assistant .content').textContent")
    check(answer.strip() != "", "the answer is empty")
    shown = cdp.eval("[...document.querySelectorAll('.message.user .pictures img')].map(i => [i.src.length, i.naturalWidth])")
    check(len(shown) == 1 and shown[0][1] > 0, f"the picture is not shown in the conversation: {shown}")
    check(cdp.eval("document.getElementById('attachments').hidden"), "the preview stays after sending")
    print(f"picture sent ({len(want)} base64 characters), answered: {answer[:60]!r}")
    # A picture pasted into the box is attached too (a paste event carrying a file, as a browser makes
    # one from the clipboard); its x removes it; pasted text stays text.
    pasted = cdp.eval(
        f"(() => {{ const bytes = Uint8Array.from(atob({json.dumps(want)}), c => c.charCodeAt(0));"
        f" const dt = new DataTransfer(); dt.items.add(new File([bytes], 'pasted', {{type: {json.dumps(mime)}}}));"
        " const ev = new ClipboardEvent('paste', {clipboardData: dt, cancelable: true, bubbles: true});"
        " document.getElementById('input').dispatchEvent(ev); return ev.defaultPrevented; })()"
    )
    check(pasted, "the page did not take the pasted picture")
    cdp.wait_for("document.querySelectorAll('#attachments img').length === 1", "the pasted picture's preview", 10)
    cdp.eval("document.querySelector('#attachments .remove').click()")
    check(cdp.eval("document.getElementById('attachments').hidden"), "the x did not remove the picture")
    text_paste = cdp.eval(
        "(() => { const dt = new DataTransfer(); dt.setData('text/plain', 'words');"
        " const ev = new ClipboardEvent('paste', {clipboardData: dt, cancelable: true, bubbles: true});"
        " document.getElementById('input').dispatchEvent(ev); return ev.defaultPrevented; })()"
    )
    check(not text_paste, "a text paste was taken as a picture")
    print("paste: a picture attached and removed, text left alone")
    shot = cdp.call("Page.captureScreenshot", format="png")["data"]
    os.makedirs(os.path.dirname(os.path.abspath(args.shot)), exist_ok=True)
    with open(args.shot, "wb") as f:
        f.write(base64.b64decode(shot))
    # Kept with the conversation.
    cdp.call("Page.reload")
    cdp.wait_for("document.body && document.body.dataset.ready === '1'", "the reloaded page", 60)
    check(cdp.eval("document.querySelectorAll('.message.user .pictures img').length") == 1, "the picture is gone after a reload")
    # A text model: no Picture button.
    cdp.eval(
        f"(() => {{ const p = document.getElementById('model-picker'); p.value = {json.dumps(args.text_model)};"
        " p.dispatchEvent(new Event('change')); })()"
    )
    cdp.wait_for(f"document.body.dataset.modelState === 'loaded' && document.getElementById('model-picker').value === {json.dumps(args.text_model)}"
                 " && !document.body.dataset.vision", f"{args.text_model} loaded", 120)
    check(cdp.eval("document.getElementById('attach').hidden"), "a Picture button for a text model")
    print("text model: no Picture button")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--pick")
    ap.add_argument("--other")
    ap.add_argument("--broken", help="a model whose engine fails to start")
    ap.add_argument("--picture", help="pictures mode: a PNG or JPEG to send to --vision-model")
    ap.add_argument("--vision-model", help="pictures mode: the loaded model, which reads pictures")
    ap.add_argument("--text-model", help="pictures mode: a model that reads none")
    ap.add_argument("--shot", required=True)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--notes", default="", help="text the picked model's notes hold")
    ap.add_argument("--clamped", action="store_true", help="the picked model's context was clamped")
    args = ap.parse_args()
    profile = tempfile.mkdtemp(prefix="polystrata-chromium-")
    browser, port = start_browser(profile)
    try:
        cdp = DevTools(page_socket(port, 30), timeout=180)
        if args.picture:
            run_pictures(args, cdp)
        else:
            if not (args.pick and args.other and args.broken):
                raise RuntimeError("--pick, --other and --broken are needed (or --picture)")
            run(args, cdp)
        print("web page: ok")
    except Exception as e:  # the reason is what the test shows
        print(f"web page: FAILED: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        browser.terminate()
        try:
            browser.wait(timeout=20)
        except subprocess.TimeoutExpired:
            browser.kill()
            browser.wait()
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    main()
