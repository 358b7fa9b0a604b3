//! What the picture witnesses share (`tests/tests/picture_witness.rs` for Qwen3.6's pictures,
//! `tests/tests/gemma4_picture_witness.rs` for Gemma 4's): the tiny model a reference was made from, reading
//! the references' f32 files and id lists, and how far our logits are from llama.cpp's, row by row.

use serde_json::Value;

/// The little-endian f32 values of the file at `path` (a reference's logits or rows).
pub fn read_f32(path: &std::path::Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// The token ids of a reference's JSON array.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
}

fn softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = row.iter().map(|&l| (l as f64 - m).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|v| v / z).collect()
}

fn argmax(row: &[f32]) -> usize {
    (0..row.len())
        .max_by(|&a, &b| row[a].total_cmp(&row[b]))
        .expect("a row")
}

/// How far our logits are from llama.cpp's over rows of `n_vocab`: the largest `|Δlogit|` over the row's
/// logit standard deviation, the largest next-token probability difference, and how many rows' top
/// tokens differ.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogitGap {
    pub logit_over_sd: f64,
    pub probability: f64,
    pub top_tokens_differing: usize,
}

/// The [`LogitGap`] of `ours` from `theirs` (the same number of rows of `n_vocab`).
pub fn logit_gap(ours: &[f32], theirs: &[f32], n_vocab: usize) -> LogitGap {
    assert_eq!(ours.len(), theirs.len(), "rows");
    let mut gap = LogitGap {
        logit_over_sd: 0.0,
        probability: 0.0,
        top_tokens_differing: 0,
    };
    for (a, b) in ours.chunks(n_vocab).zip(theirs.chunks(n_vocab)) {
        let mean = b.iter().map(|&v| v as f64).sum::<f64>() / n_vocab as f64;
        let sd =
            (b.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n_vocab as f64).sqrt();
        let d = a
            .iter()
            .zip(b)
            .map(|(&x, &y)| (x as f64 - y as f64).abs())
            .fold(0f64, f64::max);
        gap.logit_over_sd = gap.logit_over_sd.max(d / sd);
        let (pa, pb) = (softmax(a), softmax(b));
        gap.probability = pa
            .iter()
            .zip(&pb)
            .map(|(x, y)| (x - y).abs())
            .fold(gap.probability, f64::max);
        gap.top_tokens_differing += usize::from(argmax(a) != argmax(b));
    }
    gap
}

/// Writes `synth`'s tiny F32 model of `arch` at `path` with the seed of a picture reference's metadata `m`
/// (`model_seed`), and checks it is the file the reference was made from (`model_sha256`).
pub fn write_tiny_f32_model(arch: &str, m: &Value, path: &std::path::Path) {
    use poly_kernels::quant::GgmlType;
    use poly_models::synth::plan::TypeChoice;
    use poly_models::synth::shapes::find_shape;
    use poly_models::synth::{SynthOptions, Synthesis};
    let opts = SynthOptions {
        shape: find_shape(arch, "tiny").expect("tiny"),
        types: TypeChoice {
            default: GgmlType::F32,
            overrides: Vec::new(),
        },
        seed: m["model_seed"].as_u64().expect("seed"),
        route_skew: 0.0,
    };
    Synthesis::prepare(&opts)
        .expect("a tiny model")
        .write(path, |_, _| {})
        .expect("written");
    assert_eq!(
        super::sha256_file(path).expect("hashed"),
        m["model_sha256"].as_str().expect("sha"),
        "synth no longer writes the model the reference was made from"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gap_measures_logits_probabilities_and_top_tokens() {
        let theirs = [0.0, 1.0, 2.0, 3.0, 3.0, 2.0, 1.0, 0.0];
        assert_eq!(logit_gap(&theirs, &theirs, 4).logit_over_sd, 0.0);
        let mut ours = theirs;
        ours[0] = 5.0; // row 0's top token moves to 0
        let gap = logit_gap(&ours, &theirs, 4);
        assert_eq!(gap.top_tokens_differing, 1);
        // sd of [0, 1, 2, 3] is √1.25.
        assert!((gap.logit_over_sd - 5.0 / 1.25f64.sqrt()).abs() < 1e-12);
        assert!(gap.probability > 0.5);
    }
}
