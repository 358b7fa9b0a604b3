"""The official `openai` and `anthropic` Python packages as clients of a running `polystrata serve`.

Driven by server/tests/clients.rs, which starts the server over real engine children and passes:
  POLYSTRATA_URL     http://127.0.0.1:PORT
  POLYSTRATA_MODELS  comma-separated model ids to chat with (each gets every check)
  POLYSTRATA_VISION_MODELS, POLYSTRATA_PICTURE  (optional) models that read pictures (comma-separated) and a
                                                 PNG to show them
Synthetic models write noise, so the checks are about the protocol: shapes, streaming, tools carried in
the conversation, usage, logprobs, and errors; parsing of each family's formats is proven in the text
side's own tests.

usage: python clients.py   (exits non-zero on the first failure, printing which check failed)
"""

import base64
import json
import os
import sys

import anthropic
import openai

URL = os.environ["POLYSTRATA_URL"]
MODELS = [m for m in os.environ["POLYSTRATA_MODELS"].split(",") if m]

oa = openai.OpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0, timeout=300)
an = anthropic.Anthropic(base_url=URL, api_key="unused", max_retries=0, timeout=300)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]

# A conversation that carries an earlier tool call and its result.
TOOL_HISTORY = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 1})},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
]


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def openai_chat(model):
    r = oa.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0
    )
    choice = r.choices[0]
    check(r.object == "chat.completion", "object")
    check(r.model == model, f"model {r.model}")
    check(choice.message.role == "assistant", "role")
    check(isinstance(choice.message.content, str), "content is text")
    check(choice.finish_reason in ("stop", "length"), f"finish_reason {choice.finish_reason}")
    check(r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 8, f"usage {r.usage}")
    check(r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, "total")

    # Greedy twice gives the same answer (the engine's kept state does not change the result).
    again = oa.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0
    )
    check(again.choices[0].message.content == choice.message.content, "greedy is repeatable")

    # Streaming gives the same text as the whole answer.
    stream = oa.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage, n_chunks = "", None, None, 0
    for chunk in stream:
        n_chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                text += c.delta.content
            if c.finish_reason:
                finish = c.finish_reason
    check(n_chunks >= 3, f"streamed in chunks ({n_chunks})")
    check(text == choice.message.content, f"stream {text!r} != whole {choice.message.content!r}")
    check(finish == choice.finish_reason, "stream finish_reason")
    check(usage is not None and usage.completion_tokens == r.usage.completion_tokens, f"stream usage {usage}")

    # Sampling fields are accepted; seed makes sampling repeatable.
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": "Tell a story."}],
        max_tokens=6,
        temperature=0.9,
        top_p=0.9,
        seed=1234,
        presence_penalty=0.5,
        frequency_penalty=0.5,
    )
    a = oa.chat.completions.create(**kw).choices[0].message.content
    b = oa.chat.completions.create(**kw).choices[0].message.content
    check(a == b, "the same seed gives the same sample")

    # Log-probabilities: one entry per generated token, with the asked number of alternatives.
    r = oa.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Count."}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    check(len(content) == r.usage.completion_tokens, f"{len(content)} logprobs for {r.usage.completion_tokens} tokens")
    for entry in content:
        check(entry.logprob <= 0.0, "logprob")
        check(len(entry.top_logprobs) == 3, "top_logprobs")
        check(entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob, "likeliest first")

    # Stop strings cut the answer (the stop text itself is not returned).
    whole = oa.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12, temperature=0
    ).choices[0].message.content
    if len(whole) > 4:
        stop = whole[2:4]
        cut = oa.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12, temperature=0, stop=[stop]
        ).choices[0]
        check(cut.message.content == whole[: whole.find(stop)], f"stop {stop!r}: {cut.message.content!r} / {whole!r}")
        check(cut.finish_reason == "stop", "stop finish_reason")


def openai_tools(model):
    for stream in (False, True):
        kw = dict(model=model, messages=TOOL_HISTORY, tools=TOOLS, tool_choice="auto", max_tokens=8)
        if not stream:
            r = oa.chat.completions.create(**kw)
            msg = r.choices[0].message
            check(r.choices[0].finish_reason in ("stop", "length", "tool_calls"), "finish")
            check(msg.content is not None or msg.tool_calls, "an answer")
            check(r.usage.prompt_tokens > 20, f"the tools and history are in the prompt ({r.usage.prompt_tokens})")
        else:
            n = 0
            for chunk in oa.chat.completions.create(stream=True, **kw):
                n += 1
            check(n >= 2, "streamed")


def openai_completions(model):
    r = oa.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2)
    c = r.choices[0]
    check(r.object == "text_completion", "object")
    check(isinstance(c.text, str) and r.usage.completion_tokens == 6, f"usage {r.usage}")
    check(c.finish_reason == "length", c.finish_reason)
    check(len(c.logprobs.tokens) == 6 and len(c.logprobs.top_logprobs) == 6, "logprobs")
    check("".join(c.logprobs.tokens) == c.text, f"tokens {c.logprobs.tokens} text {c.text!r}")
    ids = oa.completions.create(model=model, prompt=[1, 2, 3], max_tokens=3, temperature=0)
    check(ids.usage.prompt_tokens == 3, f"token-id prompt {ids.usage}")
    text = "".join(ch.choices[0].text for ch in oa.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True) if ch.choices)
    check(text == c.text, f"stream {text!r} != {c.text!r}")


def openai_errors():
    try:
        oa.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        check(False, "unknown model accepted")
    except openai.NotFoundError as e:
        check("no-such-model" in str(e), str(e))
    try:
        oa.chat.completions.create(model=MODELS[0], messages=[{"role": "wizard", "content": "x"}])
        check(False, "bad role accepted")
    except openai.BadRequestError as e:
        check("role" in str(e), str(e))
    ids = [m.id for m in oa.models.list().data]
    check(all(m in ids for m in MODELS), f"models {ids}")
    check(oa.models.retrieve(MODELS[0]).id == MODELS[0], "models.retrieve")
    try:
        oa.models.retrieve("no-such-model")
        check(False, "unknown model retrieved")
    except openai.NotFoundError:
        pass


def anthropic_messages(model):
    # Greedy (temperature 0, sent as an extra field: this SDK has no `temperature`): the models' defaults sample, and the stream must equal the whole answer.
    r = an.messages.create(
        model=model, max_tokens=8, extra_body={"temperature": 0}, system="Be brief.", messages=[{"role": "user", "content": "Say hello."}]
    )
    check(r.type == "message" and r.role == "assistant", "shape")
    check(r.stop_reason in ("end_turn", "max_tokens"), f"stop_reason {r.stop_reason}")
    check(0 < r.usage.output_tokens <= 8, f"usage {r.usage}")
    whole = "".join(b.text for b in r.content if b.type == "text")

    with an.messages.stream(
        model=model, max_tokens=8, extra_body={"temperature": 0}, system="Be brief.", messages=[{"role": "user", "content": "Say hello."}]
    ) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    check(streamed == whole, f"stream {streamed!r} != {whole!r}")
    check(final.stop_reason == r.stop_reason, "stream stop_reason")
    check(final.usage.output_tokens == r.usage.output_tokens, "stream usage")

    # Tools, an earlier tool_use and its tool_result, thinking enabled; streaming and not.
    conv = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should call the tool.", "signature": ""},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"}]},
    ]
    tools = [
        {
            "name": "get_weather",
            "description": "The weather in a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        }
    ]
    kw = dict(
        model=model, max_tokens=8, extra_body={"temperature": 0}, messages=conv, tools=tools, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    r = an.messages.create(**kw)
    check(r.stop_reason in ("end_turn", "max_tokens", "tool_use"), r.stop_reason)
    check(r.usage.input_tokens > 20, f"history in the prompt ({r.usage})")
    with an.messages.stream(**kw) as s:
        final = s.get_final_message()
    check(final.stop_reason == r.stop_reason, "stream with tools")

    try:
        an.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "x"}])
        check(False, "unknown model accepted")
    except anthropic.NotFoundError as e:
        check("no-such-model" in str(e), str(e))


def scripted_tool_calls():
    """Against tests/server/replay_engine.py: max_tokens 100 makes the "model" write reasoning and a
    get_weather call; the SDKs must hand them back as a tool call (OpenAI) and a tool_use block
    (Anthropic), streaming and not."""
    model = MODELS[0]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = oa.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=100)
    m = r.choices[0].message
    check(r.choices[0].finish_reason == "tool_calls", r.choices[0].finish_reason)
    check(m.tool_calls[0].function.name == "get_weather", str(m))
    check(json.loads(m.tool_calls[0].function.arguments) == {"city": "Paris"}, str(m))
    check("check the weather" in (getattr(m, "reasoning_content", None) or m.model_extra.get("reasoning_content", "")), str(m))
    calls = {}
    finish = None
    for chunk in oa.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=100, stream=True):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    check(finish == "tool_calls" and calls[0]["name"] == "get_weather", str(calls))
    check(json.loads(calls[0]["arguments"]) == {"city": "Paris"}, str(calls))
    atools = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    r = an.messages.create(model=model, max_tokens=100, messages=msgs, tools=atools)
    check(r.stop_reason == "tool_use", r.stop_reason)
    check([b.type for b in r.content] == ["thinking", "tool_use"], str(r.content))
    check(r.content[1].input == {"city": "Paris"}, str(r.content))
    with an.messages.stream(model=model, max_tokens=100, messages=msgs, tools=atools) as s:
        final = s.get_final_message()
    check(final.stop_reason == "tool_use", final.stop_reason)
    check(final.content[-1].type == "tool_use" and final.content[-1].input == {"city": "Paris"}, str(final.content))
    check("check the weather" in final.content[0].thinking, str(final.content))
    # The Responses API: a reasoning item and a function_call item, streaming and not.
    flat = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
    r = oa.responses.create(model=model, input=msgs, tools=flat, max_output_tokens=100)
    kinds = [o.type for o in r.output]
    check(kinds == ["reasoning", "function_call"], str(r.output))
    check(r.output[1].name == "get_weather" and json.loads(r.output[1].arguments) == {"city": "Paris"}, str(r.output))
    check("check the weather" in r.output[0].content[0].text, str(r.output[0]))
    events = list(oa.responses.create(model=model, input=msgs, tools=flat, max_output_tokens=100, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    check(len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}, str(done))
    check(any(e.type == "response.reasoning_text.delta" for e in events), "reasoning deltas")
    check([o.type for o in events[-1].response.output] == kinds, str(events[-1]))
    # The answer after the tool result (max_tokens 101 picks it).
    history = msgs + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": m.tool_calls[0].id, "type": "function",
            "function": {"name": "get_weather", "arguments": m.tool_calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "sunny"},
    ]
    r = oa.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=101)
    check(r.choices[0].message.content.startswith("It is sunny in Paris."), str(r.choices[0].message))


def openai_responses(model):
    """The Responses API: a string input with instructions, streamed (the text deltas and the final
    response equal the whole answer, also through the SDK's stream helper) and not; items carrying an
    earlier function call and its output; what the server cannot do refused."""
    kw = dict(model=model, input="Say hello.", instructions="Be brief.", max_output_tokens=8, temperature=0)
    r = oa.responses.create(**kw)
    check(r.object == "response" and r.status in ("completed", "incomplete"), f"status {r.status}")
    check(r.model == model, f"model {r.model}")
    check(isinstance(r.output_text, str), "output_text")
    check(0 < r.usage.output_tokens <= 8 and r.usage.input_tokens > 0, f"usage {r.usage}")
    check(r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, "total")
    events = list(oa.responses.create(stream=True, **kw))
    check(events[0].type == "response.created", events[0].type)
    check(events[-1].type in ("response.completed", "response.incomplete"), events[-1].type)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    check(deltas == r.output_text, f"stream {deltas!r} != whole {r.output_text!r}")
    check(events[-1].response.output_text == r.output_text, "the final response")
    check([e.sequence_number for e in events] == list(range(len(events))), "sequence numbers")
    # The SDK's helper: a final response for `response.completed`; a cut answer ends with
    # `response.incomplete`, as OpenAI's does, and carries the response itself.
    with oa.responses.stream(**kw) as s:
        last = None
        for last in s:
            pass
        final = s.get_final_response() if last.type == "response.completed" else last.response
    check(last.type == events[-1].type, f"stream helper ended with {last.type}")
    check(final.output_text == r.output_text, f"stream helper {final.output_text!r}")

    items = [
        # Another city than the other checks' histories: the same opening would resume their kept state
        # and move the prompt's tokens into `cached_tokens`.
        {"role": "user", "content": "What is the weather in Lisbon?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": json.dumps({"city": "Lisbon"})},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
    ]
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
              "parameters": TOOLS[0]["function"]["parameters"]}]
    r = oa.responses.create(model=model, input=items, tools=tools, max_output_tokens=8, temperature=0)
    check(r.usage.input_tokens > 20, f"the history and tools are in the prompt ({r.usage})")
    for bad in (dict(previous_response_id="resp_1"), dict(text={"format": {"type": "json_object"}})):
        try:
            oa.responses.create(model=model, input="x", max_output_tokens=4, **bad)
            check(False, f"{bad} accepted")
        except openai.BadRequestError as e:
            check(e.status_code == 400, str(e))


def pictures(model, path):
    """A picture and a question through both clients: answered; remote pictures refused with a 400."""
    with open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode()
    r = oa.chat.completions.create(
        model=model,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                ],
            }
        ],
        max_tokens=4,
        temperature=0,
    )
    check(r.choices[0].finish_reason in ("stop", "length"), f"finish {r.choices[0].finish_reason}")
    # The picture's rows are prompt tokens: the question alone is fewer (a 64×48 picture through the tiny
    # projectors is 32 more prompt tokens for the tiny qwen35moe, 80 rows and its words for the tiny gemma4).
    alone = oa.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}]}],
        max_tokens=1,
        temperature=0,
    )
    check(
        r.usage.prompt_tokens >= alone.usage.prompt_tokens + 16,
        f"prompt tokens {r.usage.prompt_tokens} with the picture, {alone.usage.prompt_tokens} without",
    )
    m = an.messages.create(
        model=model,
        max_tokens=4,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
                    {"type": "text", "text": "What is in this picture?"},
                ],
            }
        ],
    )
    check(m.type == "message" and m.usage.output_tokens > 0, f"anthropic {m}")
    try:
        oa.chat.completions.create(
            model=model,
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}
            ],
            max_tokens=4,
        )
        raise AssertionError("a remote picture was accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and "not fetched" in str(e), str(e))
    try:
        an.messages.create(
            model=model,
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}],
                }
            ],
        )
        raise AssertionError("a remote picture was accepted")
    except anthropic.BadRequestError as e:
        check(e.status_code == 400 and "not fetched" in str(e), str(e))


def main():
    if "--scripted" in sys.argv:
        checks = [("scripted tool calls", scripted_tool_calls)]
        run(checks)
        return
    checks = [("openai errors and models", openai_errors)]
    for m in MODELS:
        checks += [
            (f"{m}: openai chat", lambda m=m: openai_chat(m)),
            (f"{m}: openai tools", lambda m=m: openai_tools(m)),
            (f"{m}: openai completions", lambda m=m: openai_completions(m)),
            (f"{m}: openai responses", lambda m=m: openai_responses(m)),
            (f"{m}: anthropic messages", lambda m=m: anthropic_messages(m)),
        ]
    for vision in filter(None, os.environ.get("POLYSTRATA_VISION_MODELS", "").split(",")):
        picture = os.environ["POLYSTRATA_PICTURE"]
        checks.append((f"{vision}: pictures", lambda vision=vision: pictures(vision, picture)))
    run(checks)


def run(checks):
    for name, fn in checks:
        try:
            fn()
        except Exception as e:  # report which check failed, then fail the run
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            sys.exit(1)
        print(f"ok   {name}", flush=True)
    print(f"all {len(checks)} client checks passed (openai {openai.__version__}, anthropic {anthropic.__version__})")


if __name__ == "__main__":
    main()
