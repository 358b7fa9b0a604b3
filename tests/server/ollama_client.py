"""The official `ollama` Python package as a client of a running `polystrata serve`.

Driven by server/tests/ollama_client.rs, which starts the server over a real engine child and passes:
  POLYSTRATA_URL    http://127.0.0.1:PORT
  POLYSTRATA_MODEL  the model id to chat with
  POLYSTRATA_VISION_MODELS, POLYSTRATA_PICTURES  (optional) models that read pictures (comma-separated) and
                                                  two PNGs to show them (comma-separated)
Synthetic models write noise, so the checks are about the protocol: list, show, ps, chat and generate
streamed and not (the stream equals the whole answer under greedy decoding), Ollama's figures, the
`:latest` tag, options, and errors as `ollama.ResponseError` with their status.

usage: python ollama_client.py   (exits non-zero on the first failure, printing which check failed)
"""

import os

import ollama

URL = os.environ["POLYSTRATA_URL"]
MODEL = os.environ["POLYSTRATA_MODEL"]

client = ollama.Client(host=URL, timeout=300)
GREEDY = {"temperature": 0, "num_predict": 8, "seed": 1}


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def listing():
    names = [m.model for m in client.list().models]
    check(MODEL in names, f"list: {names}")
    m = next(m for m in client.list().models if m.model == MODEL)
    check(m.details.format == "gguf", f"details {m.details}")
    check(m.size and m.size > 0, f"size {m.size}")
    check(m.modified_at is not None, "modified_at")


def chat():
    messages = [{"role": "user", "content": "Say hello."}]
    whole = client.chat(model=MODEL + ":latest", messages=messages, options=GREEDY, stream=False)
    check(whole.done and whole.message.role == "assistant", f"chat {whole}")
    check(isinstance(whole.message.content, str), "content is text")
    check(whole.eval_count == 8 and whole.done_reason == "length", f"eval_count {whole.eval_count}")
    check(whole.prompt_eval_count > 0 and whole.total_duration > 0, "figures")
    parts = list(client.chat(model=MODEL, messages=messages, options=GREEDY, stream=True))
    check(parts[-1].done and not any(p.done for p in parts[:-1]), "only the last part is done")
    streamed = "".join(p.message.content or "" for p in parts)
    check(streamed == whole.message.content, f"stream {streamed!r} != whole {whole.message.content!r}")
    check(parts[-1].eval_count == 8, "stream figures")
    # A conversation with an earlier answer and a system message.
    more = client.chat(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "And again?"},
        ],
        options=GREEDY,
    )
    check(more.done, "multi-turn")


def generate():
    whole = client.generate(model=MODEL, prompt="Once upon a time", options=GREEDY, stream=False)
    check(whole.done and isinstance(whole.response, str), f"generate {whole}")
    check(whole.eval_count == 8, f"eval_count {whole.eval_count}")
    parts = list(client.generate(model=MODEL, prompt="Once upon a time", options=GREEDY, stream=True))
    check("".join(p.response for p in parts) == whole.response, "generate stream equals whole")
    raw = client.generate(model=MODEL, prompt="Once upon a time", raw=True, options=GREEDY)
    check(raw.done and raw.eval_count == 8, "raw")


def show_and_ps():
    s = client.show(MODEL)
    check("completion" in (s.capabilities or []), f"capabilities {s.capabilities}")
    check(s.parameters and "temperature" in s.parameters, f"parameters {s.parameters}")
    check(s.details.format == "gguf", "show details")
    running = [m.model for m in client.ps().models]
    check(MODEL in running, f"ps {running}")


def errors():
    try:
        client.chat(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        raise AssertionError("an unknown model was served")
    except ollama.ResponseError as e:
        check(e.status_code == 404, f"status {e.status_code}")
        check("no-such-model" in e.error, f"message {e.error}")
    try:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "x"}], format="json")
        raise AssertionError("format was ignored")
    except ollama.ResponseError as e:
        check(e.status_code == 400 and "not supported" in e.error, f"format: {e.status_code} {e.error}")
    try:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "x", "images": [b"\x89PNG\r\n"]}])
        raise AssertionError("an image was ignored")
    except ollama.ResponseError as e:
        check(e.status_code == 400 and "text only" in e.error, f"image: {e.status_code} {e.error}")


def pictures(model, path, other):
    """A picture (the client reads the file) in a chat and another in a generate (a picture already read
    would be found in the conversation cache): their rows are prompt tokens, and `show` says the model
    reads pictures."""
    check("vision" in (client.show(model).capabilities or []), f"{model}: capabilities")
    question = [{"role": "user", "content": "What is this?"}]
    alone = client.chat(model=model, messages=question, options=GREEDY)
    seen = client.chat(model=model, messages=[dict(question[0], images=[path])], options=GREEDY)
    check(seen.done and seen.eval_count == 8, f"{model}: chat {seen}")
    check(
        seen.prompt_eval_count >= alone.prompt_eval_count + 16,
        f"{model}: prompt {seen.prompt_eval_count} with the picture, {alone.prompt_eval_count} without",
    )
    gen = client.generate(model=model, prompt="What is this?", images=[other], options=GREEDY)
    check(gen.done and gen.eval_count == 8 and gen.prompt_eval_count >= 16, f"{model}: generate {gen}")


STEPS = [(s.__name__, s) for s in (listing, chat, generate, show_and_ps, errors)]
for vision in filter(None, os.environ.get("POLYSTRATA_VISION_MODELS", "").split(",")):
    path, other = os.environ["POLYSTRATA_PICTURES"].split(",")
    STEPS.append((f"{vision} pictures", lambda vision=vision: pictures(vision, path, other)))
for name, step in STEPS:
    try:
        step()
    except Exception as e:  # noqa: BLE001 - report which check failed, then fail
        print(f"FAILED {name}: {e!r}")
        raise
    print(f"ok {name}")
print("ollama client checks passed")
