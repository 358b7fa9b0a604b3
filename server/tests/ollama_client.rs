//! The official `ollama` Python package as a client (tests/server/ollama_client.py) against
//! `polystrata serve` with a real engine child on the tiny qwen3moe fixture: list, show, ps, chat and
//! generate streamed and not, and errors; then a picture in a chat and a generate for the tiny qwen35moe
//! and the tiny gemma4, each with its tiny projector (read on the CPU).
//!
//! Python: `POLYSTRATA_PYTHON`, else `python3`; it needs `pip install -r tests/server/requirements.txt`.
//! Cost: about 10 short generations, a few seconds.

mod common;

use common::{Home, Server};
use serde_json::json;
use std::process::Command;

fn python() -> String {
    std::env::var("POLYSTRATA_PYTHON").unwrap_or_else(|_| "python3".into())
}

#[test]
fn ollama_package_as_client() {
    let probe = Command::new(python())
        .args(["-c", "import ollama"])
        .status()
        .expect("run python");
    assert!(
        probe.success(),
        "{} cannot import ollama: pip install -r tests/server/requirements.txt (or set POLYSTRATA_PYTHON)",
        python()
    );
    let home = Home::new("ollama");
    home.add_model("tiny", "qwen3moe-tiny-q4km.gguf", json!({}));
    home.add_vision_model("vision");
    home.add_gemma4_vision_model("vision-gemma4");
    let server = Server::start(&home, &["--load", "tiny"]);
    let script = common::workspace_root().join("tests/server/ollama_client.py");
    let out = Command::new(python())
        .arg(&script)
        .env("POLYSTRATA_URL", format!("http://{}", server.addr))
        .env("POLYSTRATA_MODEL", "tiny")
        .env("POLYSTRATA_VISION_MODELS", "vision,vision-gemma4")
        .env("POLYSTRATA_PICTURES", {
            let dir = common::workspace_root().join("tests/fixtures/vision");
            format!(
                "{},{}",
                dir.join("picture-64x48.png").display(),
                dir.join("picture-64x48-gradient.png").display()
            )
        })
        .output()
        .expect("run ollama_client.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "ollama_client.py failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("ollama client checks passed"), "{stdout}");
}
