//! Reasoning and tool-call parsing per family, on each format's own strings.
//!
//! Every case is parsed as one chunk, and again streamed in two chunks cut at every byte position (on
//! character boundaries) and one character at a time: the events, with adjacent text deltas joined, must be
//! the same. Cost: a fraction of a second.

use polystrata::text::family::Family;
use polystrata::text::parse::{coalesce, parse_reply, ParseEvent, ParserOptions, ReplyParser};
use serde_json::{json, Value};

fn run(family: Family, opts: &ParserOptions, chunks: &[&str]) -> Vec<ParseEvent> {
    let mut p = ReplyParser::new(family, opts.clone());
    let mut ev = Vec::new();
    for c in chunks {
        ev.extend(p.feed(c));
    }
    ev.extend(p.finish());
    coalesce(ev)
}

/// Events of `text` in one chunk, checked equal under every two-way cut and per-character streaming.
fn events(family: Family, opts: &ParserOptions, text: &str) -> Vec<ParseEvent> {
    let whole = run(family, opts, &[text]);
    for (cut, _) in text.char_indices().skip(1) {
        let parts = [&text[..cut], &text[cut..]];
        assert_eq!(
            run(family, opts, &parts),
            whole,
            "{family:?}: cut at {cut} of {text:?}"
        );
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(
        run(family, opts, &refs),
        whole,
        "{family:?}: per character {text:?}"
    );
    whole
}

fn content(s: &str) -> ParseEvent {
    ParseEvent::Content(s.into())
}

fn reasoning(s: &str) -> ParseEvent {
    ParseEvent::Reasoning(s.into())
}

fn call(index: usize, name: &str, args: Value) -> [ParseEvent; 3] {
    [
        ParseEvent::ToolCallStart {
            index,
            name: name.into(),
        },
        ParseEvent::ToolCallArgs {
            index,
            arguments: args.to_string(),
        },
        ParseEvent::ToolCallEnd { index },
    ]
}

fn weather_tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}},
        }}}),
    ]
}

fn opts() -> ParserOptions {
    ParserOptions {
        starts_in_reasoning: false,
        tools: weather_tools(),
    }
}

fn expect(family: Family, opts: &ParserOptions, text: &str, want: Vec<ParseEvent>) {
    assert_eq!(events(family, opts, text), want, "{family:?}: {text:?}");
}

fn with_calls(
    mut head: Vec<ParseEvent>,
    calls: Vec<[ParseEvent; 3]>,
    tail: Vec<ParseEvent>,
) -> Vec<ParseEvent> {
    for c in calls {
        head.extend(c);
    }
    head.extend(tail);
    head
}

#[test]
fn qwen3_reasoning_and_both_tool_call_forms() {
    let f = Family::Qwen3;
    expect(
        f,
        &opts(),
        "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
        vec![reasoning("Let me think.\n"), content("The answer is 4.")],
    );
    // Qwen3.6 / Ornith / Clover: XML parameters; a string parameter stays text even when it looks numeric.
    let xml = "<think>\nweather?\n</think>\n\nChecking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n</function>\n</tool_call>";
    expect(
        f,
        &opts(),
        xml,
        with_calls(
            vec![reasoning("weather?\n"), content("Checking.\n")],
            vec![call(
                0,
                "get_weather",
                json!({"city": "Paris", "days": 3, "zip": "75001"}),
            )],
            vec![],
        ),
    );
    // Qwen3: JSON in the wrapper, two calls.
    let js = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\", \"days\": 2}}\n</tool_call>";
    expect(
        f,
        &opts(),
        js,
        with_calls(
            vec![],
            vec![
                call(0, "get_weather", json!({"city": "Oslo"})),
                call(1, "get_weather", json!({"city": "Rome", "days": 2})),
            ],
            vec![],
        ),
    );
    // The generation prompt opened <think>: the reply starts as reasoning.
    let open = ParserOptions {
        starts_in_reasoning: true,
        tools: vec![],
    };
    expect(
        f,
        &open,
        "step one\n</think>\n\nDone.",
        vec![reasoning("step one\n"), content("Done.")],
    );
    // A tool call while thinking ends the reasoning (llama.cpp's Qwen3-Coder parser).
    expect(f, &open, "hmm\n<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</parameter>\n</function>\n</tool_call>",
        with_calls(vec![reasoning("hmm\n")], vec![call(0, "get_weather", json!({"city": "Bern"}))], vec![]));
}

#[test]
fn glm_tool_calls() {
    let f = Family::Glm;
    let text = "<think>plan</think>Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Lima</arg_value>\n<arg_key>days</arg_key>\n<arg_value>5</arg_value>\n</tool_call>";
    expect(
        f,
        &opts(),
        text,
        with_calls(
            vec![reasoning("plan"), content("Sure.")],
            vec![call(0, "get_weather", json!({"city": "Lima", "days": 5}))],
            vec![],
        ),
    );
    // GLM-4.7 writes no newlines between the tags.
    let tight =
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Kyiv</arg_value></tool_call>";
    expect(
        f,
        &opts(),
        tight,
        with_calls(
            vec![],
            vec![call(0, "get_weather", json!({"city": "Kyiv"}))],
            vec![],
        ),
    );
}

#[test]
fn gemma4_channels_and_calls() {
    let f = Family::Gemma4;
    let text = "<|channel>thought\nThe user wants weather.<channel|>Let me look.<|tool_call>call:get_weather{city:<|\"|>New York, NY<|\"|>,days:2,opts:{metric:true,tags:[<|\"|>a<|\"|>,1]}}<tool_call|>";
    expect(
        f,
        &opts(),
        text,
        with_calls(
            vec![
                reasoning("The user wants weather."),
                content("Let me look."),
            ],
            vec![call(
                0,
                "get_weather",
                json!({"city": "New York, NY", "days": 2, "opts": {"metric": true, "tags": ["a", 1]}}),
            )],
            vec![],
        ),
    );
}

#[test]
fn deepseek_v4_dsml() {
    let f = Family::DeepSeekV4;
    let text = "<think>need data</think>\n\nOne moment.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Tokyo</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">4</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Osaka</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
    expect(
        f,
        &opts(),
        text,
        with_calls(
            vec![reasoning("need data"), content("One moment.\n\n")],
            vec![
                call(0, "get_weather", json!({"city": "Tokyo", "days": 4})),
                call(1, "get_weather", json!({"city": "Osaka"})),
            ],
            vec![],
        ),
    );
}

#[test]
fn lfm2_python_calls() {
    let f = Family::Lfm2;
    let text = "<think>ok</think>Calling.<|tool_call_start|>[get_weather(city='Quito', days=3), get_weather(city=\"St. John's\", metric=True, extra=None)]<|tool_call_end|>Done.";
    expect(
        f,
        &opts(),
        text,
        with_calls(
            vec![reasoning("ok"), content("Calling.")],
            vec![
                call(0, "get_weather", json!({"city": "Quito", "days": 3})),
                call(
                    1,
                    "get_weather",
                    json!({"city": "St. John's", "metric": true, "extra": null}),
                ),
            ],
            vec![content("Done.")],
        ),
    );
}

#[test]
fn json_in_wrapper() {
    let f = Family::JsonWrapper;
    let text = "Let me check.\n<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Cairo\"}}</tool_call>";
    expect(
        f,
        &opts(),
        text,
        with_calls(
            vec![content("Let me check.\n")],
            vec![call(0, "get_weather", json!({"city": "Cairo"}))],
            vec![],
        ),
    );
    let fenced = "```json\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Accra\"}}\n```";
    expect(
        f,
        &opts(),
        fenced,
        with_calls(
            vec![],
            vec![call(0, "get_weather", json!({"city": "Accra"}))],
            vec![],
        ),
    );
    // A JSON code block that is not a call is content, as written.
    let code = "Here:\n```json\n{\"a\": 1}\n```\nbye";
    expect(f, &opts(), code, vec![content(code)]);
}

#[test]
fn malformed_and_truncated_calls_stay_text() {
    let cases: &[(Family, &str)] = &[
        (Family::Qwen3, "Hi <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call> after"),
        (Family::Qwen3, "Hi <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par"),
        (Family::Glm, "x<tool_call>get_weather<arg_key>city</arg_key></tool_call>"),
        (Family::Gemma4, "<|tool_call>call:get_weather{city:<|\"|>Par<tool_call|>"),
        (Family::DeepSeekV4, "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"n\" string=\"false\">not json</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"),
        (Family::Lfm2, "<|tool_call_start|>[get_weather(city='Lima'<|tool_call_end|>"),
        (Family::JsonWrapper, "<tool_call>{\"arguments\": {}}</tool_call>"),
    ];
    for &(f, text) in cases {
        let ev = events(f, &opts(), text);
        assert_eq!(ev, vec![content(text)], "{f:?}");
    }
    // A reply cut inside reasoning keeps the reasoning.
    assert_eq!(
        events(Family::Qwen3, &opts(), "<think>half a thou"),
        vec![reasoning("half a thou")]
    );
}

#[test]
fn parse_reply_collects_a_whole_reply() {
    let r = parse_reply(Family::Qwen3, opts(), "<think>a</think>b<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Doha\\\"}\"}\n</tool_call>");
    assert_eq!(r.reasoning, "a");
    assert_eq!(r.content, "b");
    assert_eq!(
        r.tool_calls,
        vec![(
            "get_weather".to_string(),
            json!({"city": "Doha"}).to_string()
        )]
    );
}
