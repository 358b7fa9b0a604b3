//! The CPU forward pass end to end on synthetic models written by `synth` (the library, into a temporary
//! directory): batching does not change results, generation and its errors behave.

use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use poly_engine::generate::{generate, prefill, GenerateOptions, StopReason};
use poly_engine::sample::{Sampler, SamplerConfig};
use poly_engine::state::KvPrecision;
use poly_engine::Model;
use poly_kernels::quant::GgmlType;
use poly_models::compute::Logits;
use poly_models::synth::shapes::find_shape;

mod common;
use common::{max_diff, random_tokens, softmax, write_synth};

fn temp_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("poly-engine-forward-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The `tiny` shape of `arch` in `ty`, written once per test process (tests run in parallel: the lock
/// keeps two of them from writing one file at once).
fn synth(arch: &str, ty: GgmlType) -> PathBuf {
    static WRITTEN: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
    let mut written = WRITTEN.lock().unwrap();
    let path = temp_dir().join(format!("{arch}-{ty}.gguf"));
    if written.contains(&path) {
        return path;
    }
    write_synth(
        find_shape(arch, "tiny").expect("a tiny shape"),
        ty,
        3,
        &path,
    );
    written.push(path.clone());
    path
}

fn qwen3moe_q8() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| Model::load(synth("qwen3moe", GgmlType::Q8_0)).unwrap())
}

#[test]
fn prompt_in_one_call_several_calls_or_token_by_token_gives_the_same_next_token() {
    let model = qwen3moe_q8();
    let n_vocab = model.info().n_vocab;
    let prompt = random_tokens(45, n_vocab, 1);
    let next = |ubatch: usize| {
        let mut state = model.new_state(256);
        let logits = prefill(model, &mut state, &prompt, ubatch).unwrap();
        assert_eq!(logits.len(), n_vocab);
        assert_eq!(state.n_past(), prompt.len());
        (softmax(&logits), state)
    };
    let (whole, whole_state) = next(512);
    // The distribution is not degenerate: the test compares something.
    let top = whole.iter().copied().fold(0.0, f64::max);
    assert!(top > 0.01 && top < 0.999, "top probability {top}");
    for ubatch in [16, 7, 1] {
        let (p, state) = next(ubatch);
        let d = max_diff(&whole, &p);
        assert!(d <= 1e-3, "ubatch {ubatch}: probabilities differ by {d}");
        assert_eq!(state.tokens(), whole_state.tokens());
    }
}

#[test]
fn logits_of_every_row_match_reading_one_token_at_a_time() {
    let model = qwen3moe_q8();
    let n_vocab = model.info().n_vocab;
    let prompt = random_tokens(12, n_vocab, 2);
    let mut state = model.new_state(64);
    let all = model.eval(&mut state, &prompt, Logits::All).unwrap();
    assert_eq!(all.len(), prompt.len() * n_vocab);
    let mut one = model.new_state(64);
    for (i, &t) in prompt.iter().enumerate() {
        let l = model.eval(&mut one, &[t], Logits::Last).unwrap();
        let d = max_diff(&softmax(&all[i * n_vocab..(i + 1) * n_vocab]), &softmax(&l));
        assert!(d <= 1e-3, "position {i}: probabilities differ by {d}");
    }
    // Asking for no logits still advances the state.
    let mut none = model.new_state(64);
    assert!(model
        .eval(&mut none, &prompt, Logits::None)
        .unwrap()
        .is_empty());
    assert_eq!(none.n_past(), prompt.len());
}

#[test]
fn f32_and_f16_kv_caches_agree_closely_on_a_float_model() {
    let path = synth("qwen3moe", GgmlType::F32);
    let model = Model::load(&path).unwrap();
    // The mapping outlives the name; the biggest test file need not stay behind.
    std::fs::remove_file(&path).unwrap();
    let prompt = random_tokens(30, model.info().n_vocab, 3);
    let run = |precision| {
        let mut s = model.new_state_with(64, precision);
        softmax(&prefill(&model, &mut s, &prompt, 512).unwrap())
    };
    let d = max_diff(&run(KvPrecision::F32), &run(KvPrecision::F16));
    assert!(
        d > 0.0 && d < 1e-2,
        "f16 rounding of the cache moved probabilities by {d}"
    );
}

#[test]
fn greedy_generation_follows_the_likeliest_token_and_stops() {
    let model = qwen3moe_q8();
    let prompt = random_tokens(20, model.info().n_vocab, 4);
    let opts = GenerateOptions {
        max_tokens: 6,
        top_n: 3,
        ..GenerateOptions::default()
    };
    let mut state = model.new_state(128);
    let mut seen = 0;
    let g = generate(
        model,
        &mut state,
        &prompt,
        &opts,
        &mut Sampler::new(SamplerConfig::greedy()),
        |_| seen += 1,
    )
    .unwrap();
    assert_eq!((g.steps.len(), seen, g.stop), (6, 6, StopReason::MaxTokens));
    // The last token is not read yet.
    assert_eq!(state.n_past(), prompt.len() + 5);
    for s in &g.steps {
        assert_eq!(s.top.len(), 3);
        assert_eq!(s.top[0].0, s.token, "greedy takes the likeliest token");
        assert_eq!(s.top[0].1, s.logprob);
        assert!(s.top.windows(2).all(|w| w[0].1 >= w[1].1));
    }
    // Stopping on the third token's id ends there.
    let stop_opts = GenerateOptions {
        stop_tokens: vec![g.steps[2].token],
        ..opts.clone()
    };
    let mut state2 = model.new_state(128);
    let g2 = generate(
        model,
        &mut state2,
        &prompt,
        &stop_opts,
        &mut Sampler::new(SamplerConfig::greedy()),
        |_| {},
    )
    .unwrap();
    let first_stop = g
        .steps
        .iter()
        .position(|s| s.token == g.steps[2].token)
        .unwrap();
    assert_eq!(g2.stop, StopReason::StopToken);
    assert_eq!(g2.steps, g.steps[..=first_stop].to_vec());
    // A context of prompt + 2 tokens ends the generation when full.
    let mut small = model.new_state(prompt.len() + 2);
    let g3 = generate(
        model,
        &mut small,
        &prompt,
        &opts,
        &mut Sampler::new(SamplerConfig::greedy()),
        |_| {},
    )
    .unwrap();
    assert_eq!(g3.stop, StopReason::ContextFull);
    assert_eq!(g3.steps, g.steps[..3].to_vec());
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let model = qwen3moe_q8();
    let n_vocab = model.info().n_vocab as u32;
    let mut state = model.new_state(8);
    assert!(model.eval(&mut state, &[n_vocab], Logits::Last).is_err());
    assert!(model.eval(&mut state, &[1; 9], Logits::Last).is_err());
    assert!(prefill(model, &mut state, &[], 4).is_err());
    assert!(prefill(model, &mut state, &[1, 2], 0).is_err());
    assert_eq!(state.n_past(), 0, "failed calls leave the state alone");
    // A file that is not a model is refused.
    let junk = temp_dir().join("junk.gguf");
    std::fs::write(&junk, b"not a gguf file").unwrap();
    assert!(Model::load(&junk).is_err());
}

#[test]
fn run_subcommand_prints_json_steps_that_match_the_library() {
    let path = synth("qwen3moe", GgmlType::Q8_0);
    let model = qwen3moe_q8();
    let prompt = random_tokens(10, model.info().n_vocab, 5);
    let ids: Vec<String> = prompt.iter().map(|t| t.to_string()).collect();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_poly-engine"))
        .args([
            "run",
            "--json",
            "--ignore-eos",
            "--max-tokens",
            "3",
            "--top",
            "2",
        ])
        .args(["--ubatch", "4", "--threads", "2", "--n-ctx", "64"])
        .arg("--model")
        .arg(&path)
        .args(["--prompt-tokens", &ids.join(",")])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut state = model.new_state(64);
    let g = generate(
        model,
        &mut state,
        &prompt,
        &GenerateOptions {
            max_tokens: 3,
            top_n: 2,
            ..GenerateOptions::default()
        },
        &mut Sampler::new(SamplerConfig::greedy()),
        |_| {},
    )
    .unwrap();
    assert_eq!(lines.len(), 3);
    for (i, (line, step)) in lines.iter().zip(&g.steps).enumerate() {
        assert_eq!(line["step"], i);
        assert_eq!(line["token"], step.token);
        assert_eq!(line["top"].as_array().unwrap().len(), 2);
        assert_eq!(line["top"][1]["token"], step.top[1].0);
        let p = line["top"][0]["prob"].as_f64().unwrap();
        assert!((p - (step.top[0].1 as f64).exp()).abs() < 1e-6);
    }
    // Bad input is reported, not a crash.
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_poly-engine"))
        .args(["run", "--prompt-tokens", "1,x"])
        .arg("--model")
        .arg(&path)
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not a token id"));
}
