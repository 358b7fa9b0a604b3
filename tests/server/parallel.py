"""Two chats at once through the official `openai` client: a long streamed answer, and a short request
sent once the long one's first chunk has come. Prints one JSON object: when each ended and when the long
one's last chunk came (monotonic seconds), how each finished, and how many of the long answer's chunks
came after the short answer was complete, so that server/tests/parallel.rs can tell whether the short one waited for the long one.

Driven by server/tests/parallel.rs, which passes:
  POLYSTRATA_URL    http://127.0.0.1:PORT
  POLYSTRATA_MODEL  the model id
  LONG_TOKENS       the long answer's max_tokens
"""

import json
import os
import threading
import time

import openai

URL = os.environ["POLYSTRATA_URL"]
MODEL = os.environ["POLYSTRATA_MODEL"]
LONG_TOKENS = int(os.environ["LONG_TOKENS"])

oa = openai.OpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0, timeout=300)

result = {}
long_chunk_times = []
long_started = threading.Event()


def long_answer():
    try:
        stream = oa.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a very long story about a lighthouse."}],
            max_tokens=LONG_TOKENS,
            temperature=0,
            stream=True,
        )
        for chunk in stream:
            long_chunk_times.append(time.monotonic())
            long_started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                result["long_finish"] = chunk.choices[0].finish_reason
    finally:
        result["long_done"] = time.monotonic()
        long_started.set()


worker = threading.Thread(target=long_answer)
worker.start()
if not long_started.wait(300):
    raise SystemExit("the long answer sent nothing within 300 s")
short = oa.chat.completions.create(
    model=MODEL,
    messages=[{"role": "user", "content": "Hi"}],
    max_tokens=4,
    temperature=0,
)
result["short_done"] = time.monotonic()
result["short_finish"] = short.choices[0].finish_reason
result["short_tokens"] = short.usage.completion_tokens
worker.join(600)
result["long_chunks"] = len(long_chunk_times)
# When the long answer's last chunk came: `long_done` is taken after the stream's teardown, on another
# thread, so with one place it can read a moment after the short answer's end though the short one
# waited for every chunk.
result["long_last_chunk"] = long_chunk_times[-1] if long_chunk_times else None
result["long_chunks_after_short"] = sum(1 for t in long_chunk_times if t > result["short_done"])
print(json.dumps(result))
