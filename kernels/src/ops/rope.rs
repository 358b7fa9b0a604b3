//! Rotary position embedding (RoPE) as ggml computes it (`ggml_rope_ext` without YaRN extrapolation).
//!
//! Pair `i` of a head (`i < n_rot/2`) is rotated by the angle `p · freq_scale · base^(-2i/n_rot)` at
//! position `p`. The angles are formed the way ggml forms them, by repeated multiplication in f32
//! (`θ₀ = p`, `θᵢ₊₁ = θᵢ · base^(-2/n_rot)`), so positions far into a context round like llama.cpp's, and
//! each rotated value is `fma(x0, cos, -(x1·sin))` / `fma(x0, sin, x1·cos)`, as llama.cpp's build computes
//! ggml's `rotate_pairs`: the results are llama.cpp's bit for bit.
//!
//! With frequency factors (Llama 3.1+'s `rope_freqs.weight`, one per pair) pair `i`'s angle is
//! `freq_scale · (θᵢ / factors[i])`, as ggml's `rope_cache_init` and `rope_yarn` form it (the division before
//! the scale).

/// Which dimensions form a rotated pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeMode {
    /// Adjacent dimensions `(2i, 2i+1)`.
    Normal,
    /// Dimensions `(i, i + n_rot/2)` (GPT-NeoX).
    Neox,
}

/// The shape and frequencies of a rotation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeParams {
    pub mode: RopeMode,
    /// Values per head.
    pub head_dim: usize,
    /// Rotated dimensions of each head (even, at most `head_dim`); the rest pass through.
    pub n_rot: usize,
    pub freq_base: f32,
    pub freq_scale: f32,
}

/// `(cos, sin)` of every pair's angle at position `pos`, into `cache` (`n_rot/2` pairs).
pub fn angles(p: &RopeParams, pos: u32, cache: &mut [(f32, f32)]) {
    angles_with_factors(p, None, pos, cache)
}

/// [`angles`] with each pair's angle divided by its frequency factor (`factors`: `n_rot/2` values).
pub fn angles_with_factors(
    p: &RopeParams,
    factors: Option<&[f32]>,
    pos: u32,
    cache: &mut [(f32, f32)],
) {
    let theta_scale = p.freq_base.powf(-2.0 / p.n_rot as f32);
    let mut theta = pos as f32;
    for (i, c) in cache.iter_mut().take(p.n_rot / 2).enumerate() {
        // ggml: theta_extrap = theta / ff, then theta_interp = freq_scale * theta_extrap.
        let t = match factors {
            Some(f) => p.freq_scale * (theta / f[i]),
            None => p.freq_scale * theta,
        };
        *c = (t.cos(), t.sin());
        theta *= theta_scale;
    }
}

/// Rotates `x`, rows of `n_heads · head_dim` values, row `r` at position `positions[r]`, in place.
pub fn rope(x: &mut [f32], positions: &[u32], p: &RopeParams) {
    rope_with_factors(x, positions, p, None)
}

/// [`rope`] with per-pair frequency factors (`n_rot/2` values, `rope_freqs.weight`) when given.
pub fn rope_with_factors(
    x: &mut [f32],
    positions: &[u32],
    p: &RopeParams,
    factors: Option<&[f32]>,
) {
    assert!(
        p.n_rot.is_multiple_of(2) && p.n_rot <= p.head_dim && p.head_dim > 0,
        "rope: n_rot must be even and at most head_dim"
    );
    if let Some(f) = factors {
        assert_eq!(f.len(), p.n_rot / 2, "rope: one frequency factor per pair");
    }
    rotate_rows(x, positions.len(), p, |r, cache| {
        angles_with_factors(p, factors, positions[r], cache)
    });
}

/// Rotates the `n_rows` rows of `x` (whole heads of `p.head_dim`, pairs as `p.mode` says) in place, row `r`
/// by the `(cos, sin)` of its `p.n_rot / 2` pairs that `row_angles(r, cache)` writes: the rotation every
/// RoPE variant shares (one position a row, [`super::rope_multi`]'s four, [`super::rope_2d`]'s two).
pub(crate) fn rotate_rows(
    x: &mut [f32],
    n_rows: usize,
    p: &RopeParams,
    mut row_angles: impl FnMut(usize, &mut [(f32, f32)]),
) {
    if n_rows == 0 {
        assert!(x.is_empty(), "rope: rows without positions");
        return;
    }
    assert_eq!(x.len() % n_rows, 0, "rope: rows of unequal length");
    let width = x.len() / n_rows;
    assert_eq!(width % p.head_dim, 0, "rope: row is not whole heads");
    let half = p.n_rot / 2;
    let mut cache = vec![(0f32, 0f32); half];
    for (r, row) in x.chunks_exact_mut(width).enumerate() {
        row_angles(r, &mut cache);
        for head in row.chunks_exact_mut(p.head_dim) {
            for (i, &(c, s)) in cache.iter().enumerate() {
                let (a, b) = match p.mode {
                    RopeMode::Normal => (2 * i, 2 * i + 1),
                    RopeMode::Neox => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                // ggml's `x0*cos - x1*sin` and `x0*sin + x1*cos` as GCC compiles them: the first
                // product fused with the sum.
                head[a] = x0.mul_add(c, -(x1 * s));
                head[b] = x0.mul_add(s, x1 * c);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{max_diff, normals};
    use crate::rng::Rng;

    fn reference(x: &[f32], positions: &[u32], p: &RopeParams) -> Vec<f64> {
        let width = x.len() / positions.len();
        let mut out: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let half = p.n_rot / 2;
        for (r, &pos) in positions.iter().enumerate() {
            for h in 0..width / p.head_dim {
                let base = r * width + h * p.head_dim;
                for i in 0..half {
                    let theta = pos as f64
                        * p.freq_scale as f64
                        * (p.freq_base as f64).powf(-2.0 * i as f64 / p.n_rot as f64);
                    let (a, b) = match p.mode {
                        RopeMode::Normal => (2 * i, 2 * i + 1),
                        RopeMode::Neox => (i, i + half),
                    };
                    let (x0, x1) = (x[base + a] as f64, x[base + b] as f64);
                    out[base + a] = x0 * theta.cos() - x1 * theta.sin();
                    out[base + b] = x0 * theta.sin() + x1 * theta.cos();
                }
            }
        }
        out
    }

    #[test]
    fn rope_matches_f64_reference_in_both_modes_with_partial_rotation() {
        let mut rng = Rng::new(5);
        let positions = [0u32, 1, 7, 100, 2047];
        for mode in [RopeMode::Normal, RopeMode::Neox] {
            for (n_rot, freq_scale) in [(32, 1.0), (16, 0.25)] {
                let p = RopeParams {
                    mode,
                    head_dim: 32,
                    n_rot,
                    freq_base: 10000.0,
                    freq_scale,
                };
                let x = normals(&mut rng, positions.len() * 2 * 32);
                let mut y = x.clone();
                rope(&mut y, &positions, &p);
                let expect = reference(&x, &positions, &p);
                // Angles up to ~2000 rad are formed in f32: a few ulps of the angle.
                assert!(max_diff(&y, &expect) < 2e-3, "{mode:?} n_rot {n_rot}");
                // Dimensions past n_rot are untouched; position 0 is the identity.
                for r in 0..positions.len() {
                    for h in 0..2 {
                        let b = r * 64 + h * 32;
                        assert_eq!(&y[b + n_rot..b + 32], &x[b + n_rot..b + 32]);
                    }
                }
                assert_eq!(&y[..64], &x[..64]);
            }
        }
    }

    /// ggml's formula with frequency factors (`ggml-cpu/ops.cpp`'s `rope_cache_init` and `rope_yarn`
    /// without extrapolation), computed in f64: pair `i` turns by `freq_scale · p · base^(-2i/n_rot) / ff[i]`.
    #[test]
    fn frequency_factors_divide_each_pairs_angle_as_in_ggml() {
        let mut rng = Rng::new(7);
        let positions = [0u32, 3, 100, 5000];
        let p = RopeParams {
            mode: RopeMode::Normal,
            head_dim: 16,
            n_rot: 16,
            freq_base: 500000.0,
            freq_scale: 0.5,
        };
        // Llama 3.1's shape of factors: 1 for the short wavelengths, up to 8 for the long ones.
        let factors = [1.0, 1.0, 1.0, 1.5, 2.7, 4.0, 8.0, 8.0];
        let x = normals(&mut rng, positions.len() * 2 * 16);
        let mut y = x.clone();
        rope_with_factors(&mut y, &positions, &p, Some(&factors));
        let mut expect: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        for (r, &pos) in positions.iter().enumerate() {
            for h in 0..2 {
                let base = r * 32 + h * 16;
                for (i, &ff) in factors.iter().enumerate() {
                    let theta = p.freq_scale as f64
                        * pos as f64
                        * (p.freq_base as f64).powf(-2.0 * i as f64 / 16.0)
                        / ff as f64;
                    let (x0, x1) = (x[base + 2 * i] as f64, x[base + 2 * i + 1] as f64);
                    expect[base + 2 * i] = x0 * theta.cos() - x1 * theta.sin();
                    expect[base + 2 * i + 1] = x0 * theta.sin() + x1 * theta.cos();
                }
            }
        }
        assert!(max_diff(&y, &expect) < 2e-3);
        // Factors of 1 are the plain rotation bit for bit.
        let (mut a, mut b) = (x.clone(), x.clone());
        rope_with_factors(&mut a, &positions, &p, Some(&[1.0; 8]));
        rope(&mut b, &positions, &p);
        assert_eq!(a, b);
        // A factor changes only its own pair.
        let mut c = x.clone();
        let mut one = [1.0f32; 8];
        one[6] = 8.0;
        rope_with_factors(&mut c, &positions, &p, Some(&one));
        for (i, (u, v)) in c.iter().zip(&b).enumerate() {
            if i % 16 / 2 != 6 {
                assert_eq!(u, v, "value {i}");
            }
        }
    }

    #[test]
    fn rotation_preserves_pair_norms() {
        let mut rng = Rng::new(6);
        let p = RopeParams {
            mode: RopeMode::Neox,
            head_dim: 8,
            n_rot: 8,
            freq_base: 1e6,
            freq_scale: 1.0,
        };
        let x = normals(&mut rng, 8);
        let mut y = x.clone();
        rope(&mut y, &[12345], &p);
        for i in 0..4 {
            let n0 = x[i].hypot(x[i + 4]);
            let n1 = y[i].hypot(y[i + 4]);
            assert!((n0 - n1).abs() < 1e-5);
        }
    }
}
