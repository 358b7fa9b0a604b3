//! Interleaved multi-section rotary position embedding (ggml's `GGML_ROPE_TYPE_IMROPE`, `ggml_rope_multi`):
//! each row carries four positions (time, height, width and an extra one) and every rotated pair of a head
//! reads one of them.
//!
//! The pairs are NeoX pairs `(i, i + n_rot/2)`. Pair `i`'s sector is `i mod (s₀+s₁+s₂+s₃)` for the sections
//! `s`; a sector `k` reads the height position when `k mod 3 = 1` and `k < 3·s₁`, the width position when
//! `k mod 3 = 2` and `k < 3·s₂`, the time position when `k mod 3 = 0` and `k < 3·s₀`, and the fourth
//! position otherwise. The angle of pair `i` at position `p` is `freq_scale · p · base^(-2i/n_rot)`, formed as
//! ggml forms it (`p` times `base^(-2/n_rot)` repeated, in f32, one running angle per section), and the
//! rotation is computed as [`super::rope`] computes it, so a row whose four positions every pair reads alike
//! is rotated exactly as NeoX RoPE rotates it.

use super::rope::{rotate_rows, RopeMode, RopeParams};

/// Which of a row's four positions pair `pair` reads, for `sections` (interleaved, as qwen3vl's IMRoPE).
pub fn section_of_pair(sections: [u32; 4], pair: usize) -> usize {
    let sect_dims: u32 = sections.iter().sum();
    assert!(sect_dims > 0, "rope_multi: the sections are all empty");
    let sector = pair as u32 % sect_dims;
    match sector % 3 {
        1 if sector < 3 * sections[1] => 1,
        2 if sector < 3 * sections[2] => 2,
        0 if sector < 3 * sections[0] => 0,
        _ => 3,
    }
}

/// `(cos, sin)` of every pair's angle for a row at `pos` (time, height, width, extra), into `cache`.
pub fn angles(p: &RopeParams, sections: [u32; 4], pos: [u32; 4], cache: &mut [(f32, f32)]) {
    let theta_scale = p.freq_base.powf(-2.0 / p.n_rot as f32);
    let mut theta = pos.map(|q| q as f32);
    for (i, c) in cache.iter_mut().take(p.n_rot / 2).enumerate() {
        let t = p.freq_scale * theta[section_of_pair(sections, i)];
        *c = (t.cos(), t.sin());
        for th in &mut theta {
            *th *= theta_scale;
        }
    }
}

/// Rotates `x`, rows of `n_heads · head_dim` values, row `r` at the four positions `positions[r]`, in
/// place. `p.mode` must be [`RopeMode::Neox`] (the pairing of multi-section RoPE).
pub fn rope_multi(x: &mut [f32], positions: &[[u32; 4]], sections: [u32; 4], p: &RopeParams) {
    assert_eq!(p.mode, RopeMode::Neox, "rope_multi: NeoX pairs only");
    assert!(
        p.n_rot.is_multiple_of(2) && p.n_rot <= p.head_dim && p.head_dim > 0,
        "rope_multi: n_rot must be even and at most head_dim"
    );
    rotate_rows(x, positions.len(), p, |r, cache| {
        angles(p, sections, positions[r], cache)
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::rope::rope;
    use crate::ops::testutil::{max_diff, normals};
    use crate::rng::Rng;

    fn params(n_rot: usize, head_dim: usize) -> RopeParams {
        RopeParams {
            mode: RopeMode::Neox,
            head_dim,
            n_rot,
            freq_base: 10000.0,
            freq_scale: 1.0,
        }
    }

    /// ggml's IMRoPE in f64, written from its definition: the section rule spelled out per sector.
    fn reference(
        x: &[f32],
        positions: &[[u32; 4]],
        sections: [u32; 4],
        p: &RopeParams,
    ) -> Vec<f64> {
        let width = x.len() / positions.len();
        let half = p.n_rot / 2;
        let total: u32 = sections.iter().sum();
        let mut out: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        for (r, pos) in positions.iter().enumerate() {
            for h in 0..width / p.head_dim {
                let base = r * width + h * p.head_dim;
                for i in 0..half {
                    let k = i as u32 % total;
                    let which = if k % 3 == 1 && k < 3 * sections[1] {
                        1
                    } else if k % 3 == 2 && k < 3 * sections[2] {
                        2
                    } else if k.is_multiple_of(3) && k < 3 * sections[0] {
                        0
                    } else {
                        3
                    };
                    let theta = pos[which] as f64
                        * p.freq_scale as f64
                        * (p.freq_base as f64).powf(-2.0 * i as f64 / p.n_rot as f64);
                    let (x0, x1) = (x[base + i] as f64, x[base + i + half] as f64);
                    out[base + i] = x0 * theta.cos() - x1 * theta.sin();
                    out[base + i + half] = x0 * theta.sin() + x1 * theta.cos();
                }
            }
        }
        out
    }

    #[test]
    fn matches_the_f64_definition_with_four_different_positions() {
        let mut rng = Rng::new(11);
        let positions = [
            [7u32, 9, 12, 0],
            [40, 41, 55, 3],
            [0, 0, 0, 0],
            [300, 305, 302, 1],
        ];
        // Qwen3.5/3.6's sections over 64 rotated dims, the tiny fixtures' over 16, and sections with a
        // fourth part and pairs past the sections' sum (sectors wrap).
        for (sections, n_rot, head_dim) in [
            ([11, 11, 10, 0], 64, 128),
            ([3, 3, 2, 0], 16, 32),
            ([2, 2, 2, 2], 16, 16),
            ([4, 2, 2, 0], 32, 32),
        ] {
            let p = params(n_rot, head_dim);
            let x = normals(&mut rng, positions.len() * 2 * head_dim);
            let mut y = x.clone();
            rope_multi(&mut y, &positions, sections, &p);
            let expect = reference(&x, &positions, sections, &p);
            assert!(max_diff(&y, &expect) < 1e-3, "{sections:?}");
            // Dimensions past n_rot pass through.
            for r in 0..positions.len() * 2 {
                let b = r * head_dim;
                assert_eq!(&y[b + n_rot..b + head_dim], &x[b + n_rot..b + head_dim]);
            }
        }
    }

    #[test]
    fn each_position_turns_only_its_own_interleaved_pairs() {
        // [3, 3, 2, 0] over 8 pairs: sectors 1, 4, 7 are height; 2, 5 width; 0, 3, 6 time.
        let sections = [3, 3, 2, 0];
        let p = params(16, 16);
        let x: Vec<f32> = (0..16).map(|i| 0.5 + i as f32 * 0.1).collect();
        for (slot, pairs) in [(0, vec![0, 3, 6]), (1, vec![1, 4, 7]), (2, vec![2, 5])] {
            let mut pos = [0u32; 4];
            pos[slot] = 9;
            let mut y = x.clone();
            rope_multi(&mut y, &[pos], sections, &p);
            for i in 0..8 {
                let turned = y[i] != x[i] || y[i + 8] != x[i + 8];
                assert_eq!(turned, pairs.contains(&i), "position {slot}, pair {i}");
            }
        }
        // Only the fourth position moves nothing here: no pair reads it.
        let mut y = x.clone();
        rope_multi(&mut y, &[[0, 0, 0, 5]], sections, &p);
        assert_eq!(y, x);
    }

    #[test]
    fn text_positions_are_neox_rope_bit_for_bit() {
        // llama.cpp gives a text token at p the positions [p, p, p, 0].
        let mut rng = Rng::new(3);
        let ps = [0u32, 1, 17, 4000];
        let positions: Vec<[u32; 4]> = ps.iter().map(|&q| [q, q, q, 0]).collect();
        for (sections, n_rot) in [([11, 11, 10, 0], 64), ([3, 3, 2, 0], 16)] {
            let p = params(n_rot, 64);
            let x = normals(&mut rng, ps.len() * 3 * 64);
            let (mut a, mut b) = (x.clone(), x.clone());
            rope_multi(&mut a, &positions, sections, &p);
            rope(&mut b, &ps, &p);
            assert_eq!(a, b, "{sections:?}");
        }
    }
}
