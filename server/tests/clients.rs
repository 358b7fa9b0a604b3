//! The official `openai` and `anthropic` Python packages as clients (tests/server/clients.py) against
//! `polystrata serve` with real engine children: the synthetic qwen3moe and gemma3 fixtures, and the real
//! Gemma 3 270M with its run config naming Gemma 3's turn format when its GGUF is present
//! (`POLY_GEMMA_GGUF`, which tests/run.sh sets, else /work/models/gemma-3-270m-q4_k_m.gguf).
//!
//! A picture and a question through both clients go to the tiny qwen35moe with the tiny projector
//! `poly-engine synth --arch qwen3vl-mmproj` writes (its run config's `mmproj`), and to the tiny gemma4
//! with the tiny `gemma4v` projector (Gemma 4's picture words, its rows seeing each other).
//!
//! Python: `POLYSTRATA_PYTHON`, else `python3`; it needs `pip install -r tests/server/requirements.txt`.
//! Cost: about 40 short generations per model; under a minute in release on 2 cores.

mod common;

use common::{Home, Server};
use serde_json::json;
use std::path::PathBuf;
use std::process::Command;

fn python() -> String {
    std::env::var("POLYSTRATA_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn gemma_270m() -> Option<PathBuf> {
    let path = std::env::var_os("POLY_GEMMA_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/work/models/gemma-3-270m-q4_k_m.gguf"));
    path.is_file().then_some(path)
}

#[test]
fn openai_and_anthropic_packages_as_clients() {
    let probe = Command::new(python())
        .args(["-c", "import openai, anthropic"])
        .status()
        .expect("run python");
    assert!(
        probe.success(),
        "{} cannot import openai and anthropic: pip install -r tests/server/requirements.txt (or set POLYSTRATA_PYTHON)",
        python()
    );
    let home = Home::new("clients");
    home.add_model("qwen3", "qwen3moe-tiny-q4km.gguf", json!({}));
    home.add_model("gemma3", "gemma3-tiny-q4km.gguf", json!({}));
    // Pictures are read on the CPU.
    home.add_vision_model("vision");
    home.add_gemma4_vision_model("vision-gemma4");
    let mut models = vec!["qwen3", "gemma3"];
    if let Some(gguf) = gemma_270m() {
        let tok = home.tokenizer_for("gemma-270m", &gguf);
        home.write_config(
            "gemma-270m",
            &json!({
                "exe": common::engine_bin(),
                "args": ["--model", gguf, "--max-context", "2048", "--threads", "2"],
                "tokenizer": tok,
                "chat_template": "gemma3",
            }),
        );
        models.push("gemma-270m");
    } else {
        eprintln!("Gemma 3 270M GGUF not present: checked the synthetic fixtures only");
    }
    let server = Server::start(&home, &[]);
    let script = common::workspace_root().join("tests/server/clients.py");
    let out = Command::new(python())
        .arg(&script)
        .env("POLYSTRATA_URL", format!("http://{}", server.addr))
        .env("POLYSTRATA_MODELS", models.join(","))
        .env("POLYSTRATA_VISION_MODELS", "vision,vision-gemma4")
        .env(
            "POLYSTRATA_PICTURE",
            common::workspace_root().join("tests/fixtures/vision/picture-64x48.png"),
        )
        .output()
        .expect("run clients.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "clients.py failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("client checks passed"), "{stdout}");
}
