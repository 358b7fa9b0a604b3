//! `polystrata benchmark` against the real engine on a tiny fixture: the JSON report has every field, its
//! figures are positive and agree with each other and with what was asked (prompt lengths, a prompt
//! longer than the context sent again cut to fit, answers of the length asked with end tokens ignored);
//! the table names every request; an unknown model fails with a message.
//!
//! Cost: the qwen3moe fixture loaded twice (well under a second each in release), five requests of at
//! most 60 prompt and 16 answer tokens; a few seconds in release on 2 cores.

mod common;

use common::Home;
use serde_json::{json, Value};
use std::process::Output;

/// The fixture's context in the run config: the 60-token prompt with 16 answer tokens does not fit.
const CONTEXT: usize = 64;
const ANSWER: u64 = 16;

fn home_with_tiny(tag: &str) -> Home {
    let home = Home::new(tag);
    let gguf = common::fixture("qwen3moe-tiny-q4km.gguf");
    home.add_model(
        "tiny",
        "qwen3moe-tiny-q4km.gguf",
        json!({"args": ["--model", gguf, "--max-context", CONTEXT.to_string(), "--threads", "1"]}),
    );
    home
}

fn benchmark(home: &Home, args: &[&str]) -> Output {
    common::polystrata()
        .arg("benchmark")
        .arg("--home")
        .arg(&home.dir)
        .args(args)
        .output()
        .expect("run polystrata benchmark")
}

fn num(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {v}"))
}

#[test]
fn json_report_fields_are_present_positive_and_consistent() {
    let home = home_with_tiny("bench-json");
    let out = benchmark(
        &home,
        &[
            "--model",
            "tiny",
            "--json",
            "--prompt-tokens",
            "20,60",
            "--runs",
            "1",
            "--answer-tokens",
            &ANSWER.to_string(),
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "benchmark failed: {stderr}");
    let report: Value = serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
    assert_eq!(report["model"], "tiny");
    assert_eq!(report["arch"], "qwen3moe");
    assert_eq!(report["n_ctx"].as_u64(), Some(CONTEXT as u64));
    assert_eq!(report["answer_tokens"].as_u64(), Some(ANSWER));
    assert_eq!(report["ignore_eos"], true);
    assert!(num(&report, "load_s") > 0.0);
    assert!(report["engine_pid"].as_i64().is_some_and(|p| p > 0));
    // The text is ~58 KB of English: thousands of tokens under any real vocabulary.
    assert!(num(&report, "text_tokens") > 5000.0, "{report}");
    let on_gpu = report["device"] != "cpu";

    let results = report["results"].as_array().expect("results");
    let names: Vec<&str> = results
        .iter()
        .map(|r| r["prompt"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(names, ["short", "long-20", "long-60"]);
    for r in results {
        let name = &r["prompt"];
        assert_eq!(r["run"], 1);
        let asked = r["prompt_tokens_asked"].as_u64().expect("asked");
        let served = r["prompt_tokens"].as_u64().expect("served");
        let shortened = r["shortened"].as_bool().expect("shortened");
        if name == "long-60" {
            // 60 + 16 > 64: refused, then sent with 64 − 16 tokens.
            assert_eq!(asked, 60);
            assert!(shortened, "{r}");
            assert_eq!(served, CONTEXT as u64 - ANSWER);
        } else {
            assert!(!shortened, "{r}");
            assert_eq!(served, asked);
        }
        if name == "long-20" {
            assert_eq!(asked, 20);
        }
        // End tokens are ignored: every answer has the length asked.
        assert_eq!(r["generated"].as_u64(), Some(ANSWER), "{r}");
        assert_eq!(r["reason"], "length");
        // Successive prompts start differently: at most a BOS is shared with the state kept before.
        assert!(r["cached_tokens"].as_u64().expect("cached") <= 1, "{r}");

        let ttft = num(r, "time_to_first_token_ms");
        let server = &r["server"];
        let engine = &r["engine"];
        assert!(ttft > 0.0);
        assert_eq!(num(server, "prompt_ms"), ttft);
        for clock in [server, engine] {
            for k in [
                "prompt_ms",
                "answer_ms",
                "prompt_tokens_per_s",
                "answer_tokens_per_s",
            ] {
                assert!(num(clock, k) > 0.0, "{k} of {clock}");
            }
        }
        // The engine reads the prompt inside the server's time to first token, and writes the answer
        // in a time the server sees too (its answer clock starts at the first token's arrival, the
        // engine's at the prompt's end, just before the first token).
        assert!(num(engine, "prompt_ms") < ttft, "{r}");
        assert!(num(engine, "answer_ms") <= num(r, "wall_ms"), "{r}");
        assert!(
            ttft + num(server, "answer_ms") <= num(r, "wall_ms") + 1.0,
            "{r}"
        );
        // Tokens/s are the counts over the times: prompt tokens read, answer tokens after the first.
        let read = (served - r["cached_tokens"].as_u64().unwrap_or(0)) as f64;
        let rate = num(engine, "prompt_tokens_per_s");
        assert!((rate - read * 1e3 / num(engine, "prompt_ms")).abs() < 1e-6 * rate);
        let rate = num(server, "answer_tokens_per_s");
        assert!((rate - (ANSWER - 1) as f64 * 1e3 / num(server, "answer_ms")).abs() < 1e-6 * rate);

        assert_eq!(r["draft_proposed"], 0);
        assert!(r["draft_acceptance"].is_null());
        assert!(num(r, "ram_peak_bytes") > (1u64 << 20) as f64);
        // `request` where the kernel lets the peak be reset (Linux 4.0 on); the report says so if not.
        let scope = r["ram_peak_scope"].as_str().unwrap_or("");
        assert!(scope == "request" || scope == "process", "{r}");
        if scope == "process" {
            assert!(report["notes"].to_string().contains("clear_refs"));
        }
        let cpu = num(r, "cpu_load");
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        assert!(cpu >= 0.0 && cpu <= cores + 0.5, "cpu_load {cpu}");
        assert!(r["answer_start"].is_string());
        if on_gpu {
            assert!(num(r, "vram_peak_bytes") > 0.0, "{r}");
            assert!(r["gpu_load"].is_number(), "{r}");
        } else {
            assert!(r["experts_vram_share"].is_null());
            assert!(r["vram_peak_bytes"].is_null());
            assert!(r["gpu_load"].is_null());
            assert_eq!(r["gpu_samples"], 0);
        }
    }
    let notes = report["notes"].as_array().expect("notes");
    assert!(
        notes.iter().any(|n| n
            .as_str()
            .is_some_and(|n| n.contains("long-60") && n.contains("sent again with 48"))),
        "{notes:?}"
    );
}

#[test]
fn table_names_every_request_and_unknown_models_fail() {
    let home = home_with_tiny("bench-table");
    let out = benchmark(
        &home,
        &[
            "--model",
            "tiny",
            "--prompt-tokens",
            "30",
            "--runs",
            "2",
            "--answer-tokens",
            "4",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "benchmark failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.starts_with("polystrata benchmark: tiny (qwen3moe)"),
        "{stdout}"
    );
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("short ") || l.starts_with("long-30 "))
        .collect();
    assert_eq!(rows.len(), 4, "two prompts, two runs:\n{stdout}");
    assert!(rows.iter().all(|r| r.contains(" / ")), "{stdout}");

    let out = benchmark(&home, &["--model", "no-such-model", "--answer-tokens", "4"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no-such-model"), "{stderr}");
    // The home it read is named (a model installed into another home is not a mystery).
    assert!(
        stderr.contains(&format!("home {}", home.dir.display())),
        "{stderr}"
    );
}
