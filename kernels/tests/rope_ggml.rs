//! RoPE with frequency factors (Llama 3.1+'s `rope_freqs.weight`) against ggml's CPU `ggml_rope_ext`, bit
//! for bit: `tests/fixtures/rope/freq_factors.txt` holds ggml's inputs and outputs, written by
//! `tests/witness/rope_freq_factors.c` against the pinned ggml (llama-cpp-python 0.3.36's llama.cpp).

use std::path::PathBuf;

use poly_kernels::ops::rope::{rope_with_factors, RopeMode, RopeParams};

/// One case of the fixture.
struct Case {
    params: RopeParams,
    positions: Vec<u32>,
    factors: Vec<f32>,
    x: Vec<f32>,
    y: Vec<f32>,
}

fn floats(words: &[&str]) -> Vec<f32> {
    words
        .iter()
        .map(|w| f32::from_bits(u32::from_str_radix(w, 16).expect("hex bits")))
        .collect()
}

fn cases() -> Vec<Case> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/rope/freq_factors.txt");
    let text = std::fs::read_to_string(&path).expect("the ggml rope fixture");
    let lines: Vec<&str> = text.lines().collect();
    lines
        .chunks_exact(5)
        .map(|c| {
            let field = |i: usize, tag: &str| -> Vec<&str> {
                let mut w = c[i].split_whitespace();
                assert_eq!(w.next(), Some(tag), "line {i} of a case");
                w.collect()
            };
            let head = field(0, "case");
            let params = RopeParams {
                mode: match head[0] {
                    "normal" => RopeMode::Normal,
                    "neox" => RopeMode::Neox,
                    m => panic!("mode {m}"),
                },
                head_dim: head[1].parse().expect("head_dim"),
                n_rot: head[2].parse().expect("n_rot"),
                freq_base: head[4].parse().expect("freq_base"),
                freq_scale: head[5].parse().expect("freq_scale"),
            };
            Case {
                params,
                positions: field(1, "pos")
                    .iter()
                    .map(|p| p.parse().expect("position"))
                    .collect(),
                factors: floats(&field(2, "factors")),
                x: floats(&field(3, "x")),
                y: floats(&field(4, "y")),
            }
        })
        .collect()
}

#[test]
fn rope_with_frequency_factors_is_ggmls_bit_for_bit() {
    let cases = cases();
    assert_eq!(cases.len(), 4);
    for c in &cases {
        let p = &c.params;
        assert_eq!(c.factors.len(), p.n_rot / 2);
        // The factors are not all 1: the test compares something.
        assert!(c.factors.iter().any(|&f| f > 2.0));
        let mut y = c.x.clone();
        rope_with_factors(&mut y, &c.positions, p, Some(&c.factors));
        let differing = y
            .iter()
            .zip(&c.y)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differing,
            0,
            "{:?} head {} n_rot {} base {}: {differing} of {} values differ from ggml",
            p.mode,
            p.head_dim,
            p.n_rot,
            p.freq_base,
            y.len()
        );
    }
}
