//! The `gemma3` forward pass on synthetic models written by `synth` (the library, into a temporary
//! directory): which blocks slide and how far they see, that batching does not change results across the
//! window, the tied output and the final logit soft-capping.

use std::path::PathBuf;

use poly_engine::generate::prefill;
use poly_engine::state::KvPrecision;
use poly_engine::Model;
use poly_kernels::quant::GgmlType;
use poly_models::arch::{Forward, Gemma3Hparams, ModelHparams, StateSpec};
use poly_models::compute::Logits;
use poly_models::synth::shapes::find_shape;

mod common;
use common::{max_diff, random_tokens, softmax, write_synth};

/// The tiny `gemma3` shape (6 blocks, 5 of them sliding over 64 positions, 256 wide), changed by `edit`,
/// written in Q8_0 as `name` and loaded; the file is removed once mapped.
fn model(name: &str, edit: impl FnOnce(&mut Gemma3Hparams)) -> Model {
    let mut shape = find_shape("gemma3", "tiny").expect("the tiny gemma3 shape");
    match &mut shape.hparams {
        ModelHparams::Gemma3(h) => edit(h),
        _ => unreachable!("a gemma3 shape"),
    }
    let dir = std::env::temp_dir().join(format!("poly-engine-gemma3-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path: PathBuf = dir.join(format!("{name}.gguf"));
    write_synth(shape, GgmlType::Q8_0, 5, &path);
    let m = Model::load(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    m
}

/// The last position's logits after reading `tokens` in one call.
fn last_logits(m: &Model, tokens: &[u32], precision: KvPrecision) -> Vec<f32> {
    let mut s = m.new_state_with(tokens.len(), precision);
    m.eval(&mut s, tokens, Logits::Last).unwrap()
}

#[test]
fn five_of_six_blocks_slide_over_the_window() {
    let m = model("pattern", |_| {});
    let states = m.graph().layer_states();
    let windows: Vec<Option<u32>> = states
        .iter()
        .map(|s| match s {
            StateSpec::Kv { window, .. } => *window,
            other => panic!("a gemma3 block carries a KV cache, not {other:?}"),
        })
        .collect();
    assert_eq!(
        windows,
        [Some(64), Some(64), Some(64), Some(64), Some(64), None]
    );
    // Without attention.sliding_window every block is global.
    let m = model("no-window", |h| h.sliding_window = 0);
    assert!(m
        .graph()
        .layer_states()
        .iter()
        .all(|s| matches!(s, StateSpec::Kv { window: None, .. })));
}

#[test]
fn sliding_blocks_forget_what_lies_beyond_their_reach() {
    // Every block slides over 8 positions (pattern 0: no global block), so the last position can only
    // be reached from the 6·7 = 42 positions before it.
    let m = model("all-sliding", |h| {
        h.swa_pattern = 0;
        h.sliding_window = 8;
    });
    let n_vocab = m.info().n_vocab;
    let a = random_tokens(60, n_vocab, 1);
    let mut far = a.clone();
    for t in &mut far[..12] {
        *t = (*t + 1) % n_vocab as u32;
    }
    let mut near = a.clone();
    near[50] = (near[50] + 1) % n_vocab as u32;
    let la = last_logits(&m, &a, KvPrecision::F16);
    assert_eq!(
        la,
        last_logits(&m, &far, KvPrecision::F16),
        "tokens out of reach changed the result"
    );
    assert_ne!(
        la,
        last_logits(&m, &near, KvPrecision::F16),
        "a token in reach did not matter"
    );
    // With the default pattern block 5 is global, and the first tokens do reach the last position.
    let g = model("one-global", |h| h.sliding_window = 8);
    assert_ne!(
        last_logits(&g, &a, KvPrecision::F16),
        last_logits(&g, &far, KvPrecision::F16),
        "the global block did not see the first tokens"
    );
}

#[test]
fn reading_the_prompt_in_pieces_gives_the_same_result_across_the_window() {
    // 150 tokens cross the 64-position window; with an f32 cache every batch split computes the same
    // arithmetic up to summation order.
    let m = model("pieces", |_| {});
    let prompt = random_tokens(150, m.info().n_vocab, 2);
    let run = |ubatch: usize, precision| {
        let mut s = m.new_state_with(256, precision);
        softmax(&prefill(&m, &mut s, &prompt, ubatch).unwrap())
    };
    let whole = run(512, KvPrecision::F32);
    let top = whole.iter().copied().fold(0.0, f64::max);
    assert!(top > 0.01 && top < 0.999, "top probability {top}");
    for ubatch in [64, 13, 1] {
        let d = max_diff(&whole, &run(ubatch, KvPrecision::F32));
        assert!(d <= 1e-4, "ubatch {ubatch}: probabilities differ by {d}");
    }
    // The f16 cache (llama.cpp's arithmetic for batches under 64) stays close to it.
    for ubatch in [512, 13, 1] {
        let d = max_diff(&whole, &run(ubatch, KvPrecision::F16));
        assert!(
            d <= 2e-2,
            "f16 cache, ubatch {ubatch}: probabilities differ by {d}"
        );
    }
}

#[test]
fn final_soft_capping_bounds_the_logits() {
    // The same weights (same seed and shape) with and without final_logit_softcapping.
    let plain = model("plain", |_| {});
    let capped = model("capped", |h| h.final_logit_softcapping = Some(0.5));
    let prompt = random_tokens(20, plain.info().n_vocab, 3);
    let raw = last_logits(&plain, &prompt, KvPrecision::F16);
    let cap = last_logits(&capped, &prompt, KvPrecision::F16);
    assert!(
        raw.iter().any(|l| l.abs() > 0.5),
        "the raw logits never reach the cap: the test would show nothing"
    );
    for (r, c) in raw.iter().zip(&cap) {
        assert!(c.abs() <= 0.5);
        assert!((c - 0.5 * (r / 0.5).tanh()).abs() < 1e-5, "{r} -> {c}");
    }
}
