//! Helpers shared by the forward-pass tests: synthetic models, random prompts and comparing next-token
//! distributions.

use std::path::Path;

use poly_engine::generate::prefill;
use poly_engine::Model;
use poly_kernels::quant::GgmlType;
use poly_kernels::rng::Rng;
use poly_models::compute::Logits;
use poly_models::synth::plan::TypeChoice;
use poly_models::synth::shapes::Shape;
use poly_models::synth::{SynthOptions, Synthesis};

/// Writes `shape` with every matrix in `ty` (vectors F32), even routing, from `seed`, to `path`.
pub fn write_synth(shape: Shape, ty: GgmlType, seed: u64, path: &Path) {
    let opts = SynthOptions {
        shape,
        types: TypeChoice {
            default: ty,
            overrides: Vec::new(),
        },
        seed,
        route_skew: 0.0,
    };
    Synthesis::prepare(&opts)
        .unwrap()
        .write(path, |_, _| {})
        .unwrap();
}

/// The synth shape `arch`/`shape` in `ty` (seed 3), written to a temporary file of `tag`'s name, loaded,
/// and the file removed once mapped.
#[allow(dead_code)]
pub fn load_synth(arch: &str, shape: &str, ty: GgmlType, tag: &str) -> poly_engine::Model {
    let dir = std::env::temp_dir().join(format!("poly-engine-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{tag}.gguf"));
    write_synth(
        poly_models::synth::shapes::find_shape(arch, shape).unwrap(),
        ty,
        3,
        &path,
    );
    let model = poly_engine::Model::load(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    model
}

/// `n` token ids drawn uniformly from the vocabulary.
pub fn random_tokens(n: usize, n_vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.below(n_vocab as u32)).collect()
}

/// Probabilities of `logits`, in f64.
pub fn softmax(logits: &[f32]) -> Vec<f64> {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = logits.iter().map(|&l| (l as f64 - m).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|v| v / z).collect()
}

/// The largest absolute difference of two distributions.
pub fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

// The checks below are shared by the architectures' forward tests; a test crate that includes this
// module without calling them leaves them unused.

/// A prompt of `n_prompt` random tokens read in one call predicts what reading it in calls of each of
/// `ubatches` tokens predicts (next-token probabilities within `tol`), leaving the same tokens in the
/// state; the prediction is not degenerate, and the prompt before the last token matters to it.
#[allow(dead_code)]
pub fn check_prompt_splits(model: &Model, n_prompt: usize, ubatches: &[usize], tol: f64) {
    let n_vocab = model.info().n_vocab;
    let prompt = random_tokens(n_prompt, n_vocab, 1);
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
    for &ubatch in ubatches {
        let (p, state) = next(ubatch);
        let d = max_diff(&whole, &p);
        assert!(d <= tol, "ubatch {ubatch}: probabilities differ by {d}");
        assert_eq!(state.tokens(), whole_state.tokens());
    }
    // The state matters: the same last token read without the prompt before it predicts otherwise.
    let mut fresh = model.new_state(256);
    let alone = softmax(&prefill(model, &mut fresh, &prompt[prompt.len() - 1..], 1).unwrap());
    assert!(
        max_diff(&whole, &alone) > 1e-2,
        "the prompt before the last token changed nothing"
    );
}

/// Every row's logits of one call give the probabilities that reading its tokens one at a time gives
/// (within `tol`).
#[allow(dead_code)]
pub fn check_rows_match_single_tokens(model: &Model, tol: f64) {
    let n_vocab = model.info().n_vocab;
    let prompt = random_tokens(12, n_vocab, 2);
    let mut state = model.new_state(64);
    let all = model.eval(&mut state, &prompt, Logits::All).unwrap();
    assert_eq!(all.len(), prompt.len() * n_vocab);
    let mut one = model.new_state(64);
    for (i, &t) in prompt.iter().enumerate() {
        let l = model.eval(&mut one, &[t], Logits::Last).unwrap();
        let d = max_diff(&softmax(&all[i * n_vocab..(i + 1) * n_vocab]), &softmax(&l));
        assert!(d <= tol, "position {i}: probabilities differ by {d}");
    }
}

/// A clone of a state continues exactly like the original, and reading the continuation again from the
/// advanced state gives something else (the state moved on).
#[allow(dead_code)]
pub fn check_forked_state_continues(model: &Model) {
    let n_vocab = model.info().n_vocab;
    let prompt = random_tokens(20, n_vocab, 3);
    let more = random_tokens(5, n_vocab, 4);
    let mut state = model.new_state(64);
    prefill(model, &mut state, &prompt, 8).unwrap();
    let mut fork = state.clone();
    let a = model.eval(&mut state, &more, Logits::Last).unwrap();
    let b = model.eval(&mut fork, &more, Logits::Last).unwrap();
    assert_eq!(a, b);
    let c = model.eval(&mut fork, &more, Logits::Last).unwrap();
    assert!(max_diff(&softmax(&a), &softmax(&c)) > 1e-3);
}
