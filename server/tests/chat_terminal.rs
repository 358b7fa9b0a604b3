//! The terminal chat (`polystrata --model NAME`) driven through a pseudo-terminal by
//! tests/server/chat_terminal.py (Python's standard `pty` support), over real `poly-engine` children on two
//! CPU fixtures: once with no server on the port (the chat starts one and stops it at `/quit`: list, chat,
//! switch by part of a name, info, unload, chat again, an unknown name) and once with a server already
//! running (the chat switches it, chats, ends at EOF and leaves it running); and Ctrl-C: during an answer
//! it stops the answer (the server cancels it), at the prompt twice it quits and stops the chat's server.
//!
//! Python: `POLYSTRATA_PYTHON`, else `python3`. Cost: five model loads and three answers of at most 16
//! tokens; about 2-3 s on a loaded 2-core machine.

mod common;

use common::{Home, Server};
use serde_json::json;
use std::process::Command;

fn python() -> String {
    std::env::var("POLYSTRATA_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn two_models(tag: &str) -> Home {
    let home = Home::new(tag);
    home.add_model("qwen3-tiny", "qwen3moe-tiny-q4km.gguf", json!({}));
    home.add_model("gemma3-tiny", "gemma3-tiny-q4km.gguf", json!({}));
    home
}

fn drive(mode: &str, home: &Home, port: u16, names: &[&str]) {
    drive_with(mode, home, port, names, &[]);
}

fn drive_with(mode: &str, home: &Home, port: u16, names: &[&str], extra: &[String]) {
    let script = common::workspace_root().join("tests/server/chat_terminal.py");
    let mut cmd = Command::new(python());
    cmd.env("XDG_CONFIG_HOME", common::config_dir())
        .arg(&script)
        .arg(mode)
        .arg("--bin")
        .arg(common::polystrata_bin())
        .arg("--home")
        .arg(&home.dir)
        .args(["--port", &port.to_string(), "--first", names[0]]);
    if let Some(second) = names.get(1) {
        cmd.args(["--second", second]);
    }
    cmd.args(extra);
    let out = cmd.output().expect("run tests/server/chat_terminal.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "the terminal chat test ({mode}) failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains(&format!("chat {mode}: ok")));
}

/// A port nothing listens on now (the chat's own server takes it a moment later).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("local addr").port()
}

#[test]
fn the_chat_starts_its_own_server_lists_switches_unloads_and_chats() {
    let home = two_models("chat-own");
    drive("own", &home, free_port(), &["qwen", "gem"]);
}

#[test]
fn ctrl_c_stops_an_answer_and_twice_at_the_prompt_quits() {
    let home = Home::new("chat-interrupt");
    home.add_model("qwen3-tiny", "qwen3moe-tiny-q4km.gguf", json!({}));
    drive("interrupt", &home, free_port(), &["qwen"]);
}

#[test]
fn the_chat_switches_a_running_server_and_leaves_it_running() {
    let home = two_models("chat-shared");
    let server = Server::start_logged(&home, &["--load", "qwen3-tiny"], &[]);
    let port: u16 = server
        .addr
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("the server's port");
    drive("shared", &home, port, &["gem"]);
    assert_eq!(
        server.get("/api/models/current").json()["model"],
        "gemma3-tiny"
    );
}

/// `/image PATH` with a model that reads pictures (the tiny qwen35moe fixture with the tiny projector
/// `poly-engine synth` writes): refusals, then the picture with the next message, answered as the server
/// answers the same picture and text over HTTP; a text model refuses `/image`.
#[test]
fn image_attaches_a_local_picture_to_the_next_message() {
    let home = Home::new("chat-picture");
    home.add_vision_model("vision-tiny");
    home.add_model("qwen3-tiny", "qwen3moe-tiny-q4km.gguf", json!({}));
    let server = Server::start_logged(&home, &["--load", "vision-tiny"], &[]);
    let port: u16 = server
        .addr
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("the server's port");
    let picture = common::workspace_root().join("tests/fixtures/vision/picture-64x48.png");
    drive_with(
        "picture",
        &home,
        port,
        &["vision-tiny", "qwen3-tiny"],
        &["--picture".into(), picture.display().to_string()],
    );
}
