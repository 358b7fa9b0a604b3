//! Helpers shared by the forward-pass tests: synthetic models, random prompts and comparing next-token
//! distributions.

use std::path::Path;

use poly_kernels::quant::GgmlType;
use poly_kernels::rng::Rng;
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
