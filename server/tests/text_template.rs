//! Chat templates render what llama.cpp's Jinja renders.
//!
//! `tests/fixtures/text/chat_cases.json` pairs templates (the synthetic models' ChatML, Qwen3, a
//! Qwen3.6-style template with XML tool calls, GLM-4.6, Gemma 4, DeepSeek V4, LFM2, and our Gemma 3
//! family template) with conversations that carry tools, earlier tool calls and their results;
//! `chat_renders.json` is llama.cpp's rendering of each (tests/witness/chat_render/make_chat_renders.sh,
//! a small program linking llama.cpp's common library, clock fixed at 2026-01-02 03:04:05 UTC).
//! Cost: well under a second.

use polystrata::text::template::{ChatInput, ChatTemplate};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, UNIX_EPOCH};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/text")
}

fn load(name: &str) -> Value {
    let p = fixtures().join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).expect("fixture")).expect("fixture JSON")
}

#[test]
fn renders_equal_llama_cpp() {
    let cases = load("chat_cases.json");
    let renders = load("chat_renders.json");
    let now = UNIX_EPOCH + Duration::from_secs(1_767_323_045);
    let mut failures = Vec::new();
    let renders = renders["renders"].as_array().expect("renders");
    assert!(renders.len() >= 30, "too few reference renders");
    for r in renders {
        let tname = r["template"].as_str().expect("template");
        let cname = r["conversation"].as_str().expect("conversation");
        let t = &cases["templates"][tname];
        let c = &cases["conversations"][cname];
        let src = std::fs::read_to_string(fixtures().join(t["file"].as_str().expect("file")))
            .expect("template file");
        let tmpl = ChatTemplate::new(
            &src,
            t["bos"].as_str().expect("bos"),
            t["eos"].as_str().expect("eos"),
        )
        .expect("template compiles");
        let input = ChatInput {
            messages: c["messages"].as_array().expect("messages").clone(),
            tools: c["tools"].as_array().cloned().unwrap_or_default(),
            add_generation_prompt: c["add_generation_prompt"].as_bool().unwrap_or(true),
            enable_thinking: c["enable_thinking"].as_bool(),
            now: Some(now),
            ..Default::default()
        };
        // The witness renders with add_bos = false: the BOS text stays.
        let ours = tmpl.render(&input, false);
        match (r.get("prompt").and_then(Value::as_str), ours) {
            (Some(want), Ok(got)) if want == got => {}
            (Some(want), Ok(got)) => failures.push(format!(
                "{tname} × {cname}: differs at byte {}\n--- llama.cpp\n{want}\n--- ours\n{got}",
                want.bytes()
                    .zip(got.bytes())
                    .take_while(|(a, b)| a == b)
                    .count()
            )),
            (Some(_), Err(e)) => failures.push(format!("{tname} × {cname}: ours failed: {e}")),
            (None, Ok(_)) => failures.push(format!(
                "{tname} × {cname}: llama.cpp failed, ours rendered"
            )),
            (None, Err(_)) => {}
        }
    }
    assert!(
        failures.is_empty(),
        "{} renders differ:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn templates_are_sandboxed_and_raise() {
    let t = ChatTemplate::new("{% include 'x.jinja' %}", "", "").expect("compiles");
    assert!(
        t.render(&ChatInput::default(), false).is_err(),
        "include has no loader"
    );
    let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "")
        .expect("compiles");
    let e = t.render(&ChatInput::default(), false).expect_err("raises");
    assert!(e.to_string().contains("roles must alternate"), "{e}");
    let t = ChatTemplate::new("{% for i in range(1000000000) %}{% endfor %}", "", "")
        .expect("compiles");
    assert!(
        t.render(&ChatInput::default(), false).is_err(),
        "runaway loop is stopped"
    );
    let t = ChatTemplate::new(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content.strip().upper() }}{{ strftime_now('%Y') }}{% endfor %}",
        "",
        "",
    )
    .expect("compiles");
    let input = ChatInput {
        messages: vec![
            serde_json::json!({"role": "user", "content": "  hi  "}),
            serde_json::json!({"role": "user", "content": "never"}),
        ],
        now: Some(UNIX_EPOCH + Duration::from_secs(1_767_323_045)),
        ..Default::default()
    };
    assert_eq!(t.render(&input, false).expect("renders"), "HI2026");
}

#[test]
fn a_template_printing_without_end_is_stopped_at_the_output_limit() {
    // 1 GB of output (issue 17 killed the server at the first chat with this): refused at 64 MiB.
    let t = ChatTemplate::new(
        "{% set s = 'x' * 1000000 %}{% for i in range(1000) %}{{ s }}{% endfor %}",
        "",
        "",
    )
    .expect("compiles (the capability probe's renders fail, they do not abort)");
    let e = t
        .render(&ChatInput::default(), false)
        .expect_err("over the limit");
    assert!(e.to_string().contains("output is over"), "{e}");
    let t = ChatTemplate::new("{{ 'y' * 1000 }}", "", "").expect("compiles");
    assert_eq!(
        t.render(&ChatInput::default(), false)
            .expect("renders")
            .len(),
        1000
    );
}

#[test]
fn families_and_open_reasoning_from_real_templates() {
    use polystrata::text::family::Family;
    use polystrata::text::parse::prompt_opens_reasoning;
    let cases = load("chat_cases.json");
    let renders = load("chat_renders.json");
    let expected = [
        ("synthetic", Family::Qwen3, false),
        ("qwen3", Family::Qwen3, false),
        ("qwen3.6", Family::Qwen3, true),
        ("glm-4.6", Family::Glm, false),
        ("gemma4", Family::Gemma4, false),
        ("deepseek-v4", Family::DeepSeekV4, true),
        ("lfm2", Family::Lfm2, false),
        ("gemma3", Family::JsonWrapper, false),
    ];
    for (name, family, opens) in expected {
        let file = cases["templates"][name]["file"].as_str().expect("file");
        let src = std::fs::read_to_string(fixtures().join(file)).expect("template");
        // The synthetic models' plain ChatML template says nothing: their `qwen2` pre-tokenizer decides.
        assert_eq!(Family::detect("qwen2", Some(&src), "x"), family, "{name}");
        let prompt = renders["renders"]
            .as_array()
            .expect("renders")
            .iter()
            .find(|r| r["template"] == name && r["conversation"] == "plain")
            .and_then(|r| r["prompt"].as_str())
            .expect("plain render");
        assert_eq!(prompt_opens_reasoning(family, prompt), opens, "{name}");
    }
}
