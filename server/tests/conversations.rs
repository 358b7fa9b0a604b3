//! Kept conversations through the server: each chat request names its conversation (from the chat's
//! opening messages) and asks for a checkpoint where the assistant's turn opens, so two chats used in
//! turn both resume from the engine's kept states, on a model with recurrent layers (which can only
//! resume at a checkpoint or at the state's end).
//!
//! Real engine on the qwen35moe tiny fixture. Cost: a few seconds.

mod common;

use common::{Home, Server};
use serde_json::{json, Value};

fn ask(server: &Server, messages: &[Value]) -> (String, u64, u64) {
    let r = server.post(
        "/v1/chat/completions",
        &json!({"model": "hybrid", "messages": messages, "max_tokens": 6, "temperature": 0}),
    );
    let v = r.json();
    assert_eq!(r.status, 200, "{v}");
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    let prompt = v["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens");
    (text, prompt, cached)
}

#[test]
fn two_chats_in_turn_both_resume_from_kept_states() {
    let home = Home::new("conversations");
    home.add_model("hybrid", "qwen35moe-tiny-q4km.gguf", json!({}));
    let server = Server::start(&home, &["--load", "hybrid"]);

    let a1 = json!({"role": "user", "content": "Tell me about the sea and its tides."});
    let b1 = json!({"role": "user", "content": "Name three birds of the northern forests."});
    let (a_reply, a_prompt, _) = ask(&server, std::slice::from_ref(&a1));
    let (b_reply, b_prompt, _) = ask(&server, std::slice::from_ref(&b1));

    // Chat A again, after chat B: A's state was parked with a checkpoint where its first answer began.
    let a = [
        a1,
        json!({"role": "assistant", "content": a_reply}),
        json!({"role": "user", "content": "And the moon?"}),
    ];
    let (_, a2_prompt, a2_cached) = ask(&server, &a);
    assert!(a2_prompt > a_prompt);
    assert!(
        a2_cached * 2 >= a_prompt,
        "chat A resumed {a2_cached} of {a2_prompt} prompt tokens; its first prompt had {a_prompt}"
    );
    // And chat B after A.
    let b = [
        b1,
        json!({"role": "assistant", "content": b_reply}),
        json!({"role": "user", "content": "Which one sings at dawn?"}),
    ];
    let (_, _, b2_cached) = ask(&server, &b);
    assert!(
        b2_cached * 2 >= b_prompt,
        "chat B resumed {b2_cached} tokens; its first prompt had {b_prompt}"
    );
    server.stop();
}
