//! The `llama` forward pass on the CPU with its optional tensors, end to end on synthetic tiny models
//! (written by `synth` into a temporary directory): Llama 3.1's RoPE frequency factors
//! (`rope_freqs.weight`) and the projections' biases are applied, not ignored.
//!
//! Each test writes a file with the tensors, then derives variants of it byte for byte: the tensor renamed
//! (a name no architecture reads, so the model runs without it), or its values set to the identity (factors
//! of 1, biases of 0). The identity must give the logits of the file without the tensor bit for bit (the
//! tensor takes the path llama.cpp's graph takes, and changes nothing else), and the real values must change
//! them (the tensor is used). The math of the factors themselves is checked against ggml's formula in
//! `kernels/src/ops/rope.rs`.

use std::path::{Path, PathBuf};

use poly_engine::generate::prefill;
use poly_engine::Model;
use poly_kernels::quant::GgmlType;
use poly_models::gguf::GgufFile;
use poly_models::synth::shapes::find_shape;

mod common;
use common::{max_diff, random_tokens, softmax, write_synth};

fn temp_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("poly-engine-llama-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The llama shape `shape` in Q8_0 (vectors F32), written to `<shape>.gguf`.
fn synth(shape: &str) -> PathBuf {
    let path = temp_dir().join(format!("{shape}.gguf"));
    write_synth(
        find_shape("llama", shape).expect("a llama shape"),
        GgmlType::Q8_0,
        5,
        &path,
    );
    path
}

/// A copy of `src` as `tag.gguf`: the tensors whose names `pick` accepts renamed (last letter changed, so
/// no architecture reads them) when `rename`, else their F32 values set to `value`.
fn variant(src: &Path, tag: &str, pick: impl Fn(&str) -> bool, edit: Edit) -> PathBuf {
    let file = GgufFile::open(src).unwrap();
    let mut bytes = std::fs::read(src).unwrap();
    let header_end = file.data_offset(0).unwrap() as usize;
    let mut n = 0;
    for t in file.tensor_infos().iter().filter(|t| pick(&t.name)) {
        n += 1;
        match edit {
            Edit::Rename => {
                // The name as the header stores it: a u64 length, then the bytes.
                let mut needle = (t.name.len() as u64).to_le_bytes().to_vec();
                needle.extend_from_slice(t.name.as_bytes());
                let at = bytes[..header_end]
                    .windows(needle.len())
                    .position(|w| w == needle)
                    .expect("the tensor's name in the header");
                let last = at + needle.len() - 1;
                bytes[last] = if bytes[last] == b'z' { b'y' } else { b'z' };
            }
            Edit::Fill(value) => {
                assert_eq!(t.ty, GgmlType::F32, "{}", t.name);
                let data = &mut bytes[t.offset as usize..(t.offset + t.n_bytes) as usize];
                for v in data.chunks_exact_mut(4) {
                    v.copy_from_slice(&value.to_le_bytes());
                }
            }
        }
    }
    assert!(n > 0, "{tag}: no tensor picked");
    let path = temp_dir().join(format!("{tag}.gguf"));
    std::fs::write(&path, bytes).unwrap();
    path
}

#[derive(Clone, Copy)]
enum Edit {
    Rename,
    Fill(f32),
}

/// The last position's logits of `prompt`, prefilled in calls of `ubatch` tokens.
fn logits(path: &Path, prompt: &[u32], ubatch: usize) -> Vec<f32> {
    let model = Model::load(path).unwrap();
    let mut state = model.new_state(256);
    prefill(&model, &mut state, prompt, ubatch).unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn n_vocab(path: &Path) -> usize {
    Model::load(path).unwrap().info().n_vocab
}

#[test]
fn rope_frequency_factors_are_applied_and_factors_of_one_change_nothing() {
    let src = synth("tiny-rope-freqs");
    let is_freqs = |n: &str| n == "rope_freqs.weight";
    let without = variant(&src, "freqs-renamed", is_freqs, Edit::Rename);
    let ones = variant(&src, "freqs-ones", is_freqs, Edit::Fill(1.0));
    // 60 positions: the long-wavelength pairs' angles (which the factors divide) grow large enough to matter.
    let prompt = random_tokens(60, n_vocab(&src), 2);
    let with = logits(&src, &prompt, 512);
    let plain = logits(&without, &prompt, 512);
    assert_eq!(
        logits(&ones, &prompt, 512),
        plain,
        "factors of 1 are the rotation without factors, bit for bit"
    );
    let d = max_abs_diff(&with, &plain);
    assert!(d > 1e-3, "the factors change the logits (by {d})");
    // The factors apply at every position of the KV cache alike: token by token gives the same logits.
    let stepwise = logits(&src, &prompt, 1);
    let d = max_diff(&softmax(&with), &softmax(&stepwise));
    assert!(
        d < 1e-3,
        "one call and token by token: probabilities differ by {d}"
    );
}

#[test]
fn every_bias_is_applied_and_zero_biases_change_nothing() {
    let src = synth("tiny-bias");
    let is_bias = |n: &str| n.ends_with(".bias");
    let without = variant(&src, "bias-renamed", is_bias, Edit::Rename);
    let zeros = variant(&src, "bias-zeros", is_bias, Edit::Fill(0.0));
    let prompt = random_tokens(20, n_vocab(&src), 3);
    let with = logits(&src, &prompt, 512);
    let plain = logits(&without, &prompt, 512);
    // x + 0 is x: zero biases leave every value as it was.
    assert_eq!(logits(&zeros, &prompt, 512), plain, "zero biases");
    // Each kind of bias on its own changes the logits: none is dropped.
    for kind in [
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ] {
        let suffix = format!(".{kind}.bias");
        let one_less = variant(
            &src,
            &format!("bias-no-{kind}"),
            |n| n.ends_with(&suffix),
            Edit::Rename,
        );
        let d = max_abs_diff(&with, &logits(&one_less, &prompt, 512));
        assert!(d > 1e-4, "{kind}.bias changes the logits (by {d})");
    }
    let stepwise = logits(&src, &prompt, 1);
    let d = max_diff(&softmax(&with), &softmax(&stepwise));
    assert!(
        d < 1e-3,
        "one call and token by token: probabilities differ by {d}"
    );
}
