//! Issue 17, item 4: a chat template cannot take the server's memory. A template that doubles a string
//! 40 times aborted the server at load (the capability probe: "memory allocation of 4294967312 bytes
//! failed"); each way a template can grow a string is tried here, at load and at render, and must end in
//! an error. Through the server: a model whose template doubles a string loads, and its chat requests
//! get a 400 naming the cause while the server keeps serving.
//!
//! Cost: each case builds strings up to the 100 MB bound once: a few seconds in all.

mod common;

use common::{Home, Server};
use polystrata::text::template::{ChatInput, ChatTemplate};
use serde_json::json;

/// Each way to double a string `s` (set to "x" first) in a loop of 40.
const DOUBLINGS: &[(&str, &str)] = &[
    ("+", "{% set ns.s = ns.s + ns.s %}"),
    ("~", "{% set ns.s = ns.s ~ ns.s %}"),
    ("join filter", "{% set ns.s = [ns.s, ns.s] | join %}"),
    (
        "replace filter",
        "{% set ns.s = ns.s | replace('x', 'xx') %}",
    ),
    ("str.replace", "{% set ns.s = ns.s.replace('x', 'xx') %}"),
    ("str.join", "{% set ns.s = ''.join([ns.s, ns.s]) %}"),
    ("str.format", "{% set ns.s = '{}{}'.format(ns.s, ns.s) %}"),
    (
        "indent",
        "{% set ns.s = (ns.s ~ '\\n' ~ ns.s) | indent(8) %}",
    ),
    (
        "capture",
        "{% set t %}{{ ns.s }}{{ ns.s }}{% endset %}{% set ns.s = t %}",
    ),
    ("*", "{% set ns.s = ns.s * 2 %}"),
];

fn doubling_template(step: &str) -> String {
    format!(
        "{{% set ns = namespace(s='x') %}}{{% for i in range(40) %}}{step}{{% endfor %}}\
         {{{{ ns.s | length }}}}{{% for m in messages %}}{{{{ m.content }}}}{{% endfor %}}"
    )
}

#[test]
fn a_template_that_doubles_a_string_fails_at_load_and_render_without_aborting() {
    let input = ChatInput {
        messages: vec![json!({"role": "user", "content": "hi"})],
        add_generation_prompt: true,
        ..Default::default()
    };
    for (name, step) in DOUBLINGS {
        // Loading runs the capability probe, which renders the template: it must come back.
        let template = ChatTemplate::new(&doubling_template(step), "", "")
            .unwrap_or_else(|e| panic!("{name}: the template compiles: {e}"));
        let err = template
            .render(&input, false)
            .expect_err(&format!("{name}: the doubling cannot finish"));
        eprintln!("{name}: {err}");
    }
    // The output bound still holds on its own: a template printing 1 GB.
    let loud = ChatTemplate::new(
        "{% for i in range(100000) %}{{ 'y' * 10000 }}{% endfor %}",
        "",
        "",
    )
    .expect("compiles");
    let err = loud.render(&input, false).expect_err("1 GB of output");
    assert!(err.to_string().contains("output is over"), "{err}");
}

#[test]
fn a_model_whose_template_doubles_a_string_is_served_with_a_clear_error() {
    let home = Home::new("template-bomb");
    home.add_model(
        "qwen3",
        "qwen3moe-tiny-q4km.gguf",
        json!({"chat_template": doubling_template("{% set ns.s = ns.s + ns.s %}")}),
    );
    let server = Server::start(&home, &["--load", "qwen3"]);
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("100000000 bytes"), "{}", r.text());
    assert_eq!(server.get("/health").status, 200);
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": [1, 2, 3], "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}
