//! `polystrata verify` against the real engine on a tiny fixture: the model as served passes against the
//! CPU reference (on the CPU with the default orders the two agree bit for bit, the prompt read in one
//! call against token by token), a deliberately broken product (`POLY_BREAK_BATCHES=1`: products of a
//! prompt's rows lose their first output) fails with the figures and a non-zero exit, and an unknown
//! model is a clear error.
//!
//! Cost: the qwen3moe fixture loaded a few times; a few seconds in release on 2 cores.

mod common;

use common::Home;
use serde_json::{json, Value};

fn home_with_tiny(tag: &str) -> Home {
    let home = Home::new(tag);
    let gguf = common::fixture("qwen3moe-tiny-q4km.gguf");
    home.add_model(
        "tiny",
        "qwen3moe-tiny-q4km.gguf",
        json!({"args": ["--model", gguf, "--max-context", "256", "--threads", "2", "--cpu"]}),
    );
    home
}

fn verify(home: &Home, args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut c = common::polystrata();
    c.arg("--home").arg(&home.dir).arg("verify").args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run polystrata verify")
}

#[test]
fn the_served_model_passes_and_a_broken_product_fails() {
    let home = home_with_tiny("verify");
    let out = verify(&home, &["tiny", "--json", "--answer-tokens", "12"], &[]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "verify failed: {log}");
    let r: Value = serde_json::from_slice(&out.stdout).expect("the engine's JSON report");
    assert_eq!(r["pass"], true, "{r}");
    assert_eq!(r["steps"].as_u64(), Some(3 * 12), "{r}");
    // The same arithmetic either way: no difference at all.
    assert_eq!(r["mean_kl"].as_f64(), Some(0.0), "{r}");
    assert_eq!(r["same_top"].as_f64(), Some(1.0), "{r}");

    let out = verify(&home, &["tiny"], &[("POLY_BREAK_BATCHES", "1")]);
    let text = String::from_utf8_lossy(&out.stdout);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a broken product passed: {text}");
    assert!(text.contains("FAIL: mean KL"), "{text}");
    assert!(
        log.contains("out of bounds against the CPU reference"),
        "{log}"
    );
    let mean: f64 = text
        .lines()
        .last()
        .and_then(|l| l.split("mean KL ").nth(1))
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .expect("the summary's mean KL");
    assert!(mean > 0.05, "{text}");

    let out = verify(&home, &["no-such-model"], &[]);
    assert!(!out.status.success());
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        log.contains("polystrata verify:") && log.contains("no-such-model"),
        "{log}"
    );
}
