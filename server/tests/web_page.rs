//! The web page in a real browser: headless Chromium (Debian `chromium`) driven over the DevTools
//! protocol by tests/server/web_page.py (Python standard library only) loads `/` from `polystrata serve`
//! over real `poly-engine` children on two CPU fixtures, picks a model in the header, sees a failing load
//! reported (the server keeps its model), sends a message, watches the answer stream in, sees the model's
//! notes, stops a long answer with the Stop button, reloads and finds the conversation kept. The screenshot
//! is kept at `<target>/test-artifacts/web/chat.png`.
//!
//! Chromium: `CHROMIUM`, else `chromium` on PATH; Python: `POLYSTRATA_PYTHON`, else `python3`.
//! Cost: three loads (one failing), a 24-token answer and a stopped one; about 5-7 s on a loaded 2-core
//! machine (Chromium's start is most of it).

mod common;

use common::{Home, Server};
use serde_json::json;
use std::path::PathBuf;
use std::process::Command;

fn python() -> String {
    std::env::var("POLYSTRATA_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// `<target dir>/test-artifacts/web`: next to the binaries' profile directory.
fn artifacts() -> PathBuf {
    let bin = common::polystrata_bin();
    let target = bin
        .parent()
        .and_then(|profile| profile.parent())
        .expect("the binary lives in <target>/<profile>/");
    target.join("test-artifacts").join("web")
}

/// What the picked model's run config says about it; the page shows it under the header.
const NOTES: &str = "A small synthetic base model: it writes noise.";

#[test]
fn the_page_picks_a_model_and_streams_an_answer_in_chromium() {
    let home = Home::new("web");
    home.add_model("qwen3-tiny", "qwen3moe-tiny-q4km.gguf", json!({}));
    home.add_model(
        "gemma3-tiny",
        "gemma3-tiny-q4km.gguf",
        // A display name that holds the id, as setup's demo has ("Gemma 3 270M (demo)"): the picker
        // shows it once, not with the id again.
        // Its run config asks for more context than the model was trained for: the page says so
        // beside the notes (the registry's context_note).
        json!({"notes": NOTES, "display_name": "Gemma 3 tiny (gemma3-tiny)",
               "args": ["--model", common::fixture("gemma3-tiny-q4km.gguf"),
                        "--max-context", "999999", "--threads", "1"]}),
    );
    // A model whose engine exits at once: its load fails and the server keeps the model it had.
    home.write_config(
        "broken-engine",
        &json!({
            "exe": "/bin/false",
            "args": ["--model", common::fixture("gemma3-tiny-q4km.gguf")],
            "tokenizer": "packs/gemma3-tiny/tokenizer",
        }),
    );
    // The page starts on qwen3 and the test picks gemma3 in the header.
    let server = Server::start_logged(&home, &["--load", "qwen3-tiny"], &[]);
    let root = server.get("/");
    assert_eq!(root.status, 200);
    assert!(root.text().contains("<title>PolyStrata</title>"));

    let shot = artifacts().join("chat.png");
    let _ = std::fs::remove_file(&shot);
    let script = common::workspace_root().join("tests/server/web_page.py");
    let out = Command::new(python())
        .arg(&script)
        .args(["--url", &server.url("/")])
        .args(["--pick", "gemma3-tiny", "--other", "qwen3-tiny"])
        .args(["--broken", "broken-engine"])
        .args(["--notes", NOTES])
        .arg("--clamped")
        .arg("--shot")
        .arg(&shot)
        .output()
        .expect("run tests/server/web_page.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}{stderr}");
    let log = std::fs::read_to_string(home.dir.join("server.log")).unwrap_or_default();
    assert!(
        out.status.success(),
        "the browser test failed:\n{stdout}\n{stderr}\nserver log:\n{log}"
    );
    assert!(stdout.contains("web page: ok"));
    let png = std::fs::read(&shot).expect("the screenshot");
    assert!(
        png.len() > 1000 && png.starts_with(b"\x89PNG"),
        "not a PNG screenshot"
    );
    // The server ran the model the page picked.
    assert_eq!(
        server.get("/api/models/current").json()["model"],
        "gemma3-tiny"
    );
}

/// A model that reads pictures (the tiny qwen35moe fixture with the tiny projector `poly-engine synth`
/// writes, named by its run config's `mmproj`) and one that reads none: the page shows the Picture button
/// for the first only, sends a chosen JPEG with the question as an `image_url` data URL of the file's
/// bytes, shows it in the conversation (after a reload too), and the answer comes.
#[test]
fn the_page_sends_a_picture_to_a_model_that_reads_them_in_chromium() {
    let home = Home::new("web-pictures");
    home.add_vision_model("vision-tiny");
    home.add_model("qwen3-tiny", "qwen3moe-tiny-q4km.gguf", json!({}));
    let server = Server::start_logged(&home, &["--load", "vision-tiny"], &[]);
    let shot = artifacts().join("picture.png");
    let _ = std::fs::remove_file(&shot);
    let picture = common::workspace_root().join("tests/fixtures/vision/jpeg/big-420.jpg");
    let out = Command::new(python())
        .arg(common::workspace_root().join("tests/server/web_page.py"))
        .args(["--url", &server.url("/")])
        .arg("--picture")
        .arg(&picture)
        .args([
            "--vision-model",
            "vision-tiny",
            "--text-model",
            "qwen3-tiny",
        ])
        .args(["--max-tokens", "4"])
        .arg("--shot")
        .arg(&shot)
        .output()
        .expect("run tests/server/web_page.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}{stderr}");
    let log = std::fs::read_to_string(home.dir.join("server.log")).unwrap_or_default();
    assert!(
        out.status.success(),
        "the browser test failed:\n{stdout}\n{stderr}\nserver log:\n{log}"
    );
    assert!(stdout.contains("web page: ok") && stdout.contains("picture sent"));
    assert!(std::fs::read(&shot).is_ok_and(|p| p.starts_with(b"\x89PNG")));
    // The page switched the server to the text model.
    let stats = server.get("/api/models/current").json();
    assert_eq!(stats["model"], "qwen3-tiny", "{stats}");
}
