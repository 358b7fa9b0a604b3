//! Two-dimensional rotary position embedding of vision encoders (ggml's `GGML_ROPE_TYPE_VISION`, the mode
//! Qwen2-VL and Qwen3-VL's image encoders call through `ggml_rope_multi`).
//!
//! Each patch has a row `y` and a column `x`. A head of `head_dim` values is rotated in NeoX pairs
//! `(i, i + head_dim/2)`: the first quarter of the pairs (`i < head_dim/4`) turn by `y · θᵢ`, the second
//! quarter by `x · θ_{i − head_dim/4}`, with `θⱼ = base^(−4j/head_dim)` (the frequencies of a rotation of
//! `head_dim/2` dimensions, restarted for the second axis). ggml forms the angles by repeated multiplication
//! in f32 from the position, as [`super::rope`] does, and so does this.

use super::rope::{angles, rotate_rows, RopeMode, RopeParams};

/// Rotates `x`, rows of whole heads of `head_dim` values, row `r` at patch `(rows[r], cols[r])`, in place.
///
/// `head_dim` must be a multiple of 4; `rows` and `cols` have one entry per row of `x`.
pub fn rope_2d(x: &mut [f32], (rows, cols): (&[u32], &[u32]), head_dim: usize, freq_base: f32) {
    assert!(
        head_dim > 0 && head_dim.is_multiple_of(4),
        "rope_2d: head_dim must be a multiple of 4"
    );
    assert_eq!(
        rows.len(),
        cols.len(),
        "rope_2d: one row and column per row"
    );
    let (half, quarter) = (head_dim / 2, head_dim / 4);
    let p = RopeParams {
        mode: RopeMode::Neox,
        head_dim,
        n_rot: head_dim,
        freq_base,
        freq_scale: 1.0,
    };
    let theta_scale = freq_base.powf(-2.0 / half as f32);
    rotate_rows(x, rows.len(), &p, |r, cache| {
        let (py, px) = (rows[r], cols[r]);
        let (mut theta_y, mut theta_x) = (py as f32, px as f32);
        for (i, c) in cache.iter_mut().enumerate() {
            // ggml restarts the second axis' angle at its own position when its section begins.
            if i == quarter {
                theta_x = px as f32;
            }
            let t = if i < quarter { theta_y } else { theta_x };
            *c = (t.cos(), t.sin());
            theta_y *= theta_scale;
            theta_x *= theta_scale;
        }
    });
}

/// Rotates `x`, rows of whole heads of `head_dim` values, row `r` at patch `(cols[r], rows[r])`, in place,
/// as Gemma 4's image encoder does it (`models/gemma4v.cpp`: two `ggml_rope_ext` calls in NeoX mode, the
/// second with `ggml_rope_set_offset`): the first half of each head is a NeoX rotation of `head_dim/2`
/// dimensions by the column, the second half one by the row. Each half's pairs are `(i, i + head_dim/4)`
/// within the half, turning by `p · base^(−4i/head_dim)`, the angles formed as [`super::rope`] forms them.
///
/// `head_dim` must be a multiple of 4; `cols` and `rows` have one entry per row of `x`.
pub fn rope_2d_halves(
    x: &mut [f32],
    (cols, rows): (&[u32], &[u32]),
    head_dim: usize,
    freq_base: f32,
) {
    assert!(
        head_dim > 0 && head_dim.is_multiple_of(4),
        "rope_2d_halves: head_dim must be a multiple of 4"
    );
    assert_eq!(
        rows.len(),
        cols.len(),
        "rope_2d_halves: one row and column per row"
    );
    let half = head_dim / 2;
    let p = RopeParams {
        mode: RopeMode::Neox,
        head_dim: half,
        n_rot: half,
        freq_base,
        freq_scale: 1.0,
    };
    if rows.is_empty() {
        assert!(x.is_empty(), "rope_2d_halves: rows without positions");
        return;
    }
    assert_eq!(
        x.len() % rows.len(),
        0,
        "rope_2d_halves: rows of unequal length"
    );
    let width = x.len() / rows.len();
    assert_eq!(
        width % head_dim,
        0,
        "rope_2d_halves: row is not whole heads"
    );
    let mut by_col = vec![(0f32, 0f32); half / 2];
    let mut by_row = vec![(0f32, 0f32); half / 2];
    let rotate = |part: &mut [f32], cache: &[(f32, f32)]| {
        let quarter = cache.len();
        for (i, &(c, s)) in cache.iter().enumerate() {
            let (x0, x1) = (part[i], part[i + quarter]);
            // As [`super::rope`]: the first product fused with the sum, as GCC compiles ggml's.
            part[i] = x0.mul_add(c, -(x1 * s));
            part[i + quarter] = x0.mul_add(s, x1 * c);
        }
    };
    for (r, row) in x.chunks_exact_mut(width).enumerate() {
        angles(&p, cols[r], &mut by_col);
        angles(&p, rows[r], &mut by_row);
        for head in row.chunks_exact_mut(head_dim) {
            let (first, second) = head.split_at_mut(half);
            rotate(first, &by_col);
            rotate(second, &by_row);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{max_diff, normals};
    use crate::rng::Rng;

    /// The rotation written out in f64 from its definition.
    fn reference(x: &[f32], rows: &[u32], cols: &[u32], head_dim: usize, base: f64) -> Vec<f64> {
        let width = x.len() / rows.len();
        let (half, quarter) = (head_dim / 2, head_dim / 4);
        let mut out: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        for r in 0..rows.len() {
            for h in 0..width / head_dim {
                let b = r * width + h * head_dim;
                for i in 0..half {
                    let (pos, j) = if i < quarter {
                        (rows[r] as f64, i)
                    } else {
                        (cols[r] as f64, i - quarter)
                    };
                    let theta = pos * base.powf(-4.0 * j as f64 / head_dim as f64);
                    let (x0, x1) = (x[b + i] as f64, x[b + i + half] as f64);
                    out[b + i] = x0 * theta.cos() - x1 * theta.sin();
                    out[b + i + half] = x0 * theta.sin() + x1 * theta.cos();
                }
            }
        }
        out
    }

    #[test]
    fn rope_2d_matches_the_f64_definition() {
        let mut rng = Rng::new(11);
        let rows = [0u32, 0, 1, 5, 47, 3];
        let cols = [0u32, 1, 0, 9, 2, 47];
        for head_dim in [16usize, 72] {
            let x = normals(&mut rng, rows.len() * 3 * head_dim);
            let mut y = x.clone();
            rope_2d(&mut y, (&rows, &cols), head_dim, 10000.0);
            let expect = reference(&x, &rows, &cols, head_dim, 10000.0);
            assert!(max_diff(&y, &expect) < 1e-4, "head_dim {head_dim}");
            // Patch (0, 0) is the identity.
            assert_eq!(&y[..3 * head_dim], &x[..3 * head_dim]);
        }
    }

    #[test]
    fn rope_2d_halves_turns_the_first_half_by_column_and_the_second_by_row() {
        let mut rng = Rng::new(13);
        let (cols, rows) = ([0u32, 3, 0, 7, 29], [0u32, 0, 5, 2, 23]);
        for head_dim in [16usize, 72] {
            let (half, quarter) = (head_dim / 2, head_dim / 4);
            let x = normals(&mut rng, cols.len() * 2 * head_dim);
            let mut y = x.clone();
            rope_2d_halves(&mut y, (&cols, &rows), head_dim, 100.0);
            // The definition in f64: in each half, pair (i, i + quarter) by pos · 100^(−2i/half).
            let mut expect: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            for r in 0..cols.len() {
                for h in 0..2 {
                    for (offset, pos) in [(0, cols[r]), (half, rows[r])] {
                        let b = (r * 2 + h) * head_dim + offset;
                        for i in 0..quarter {
                            let theta = pos as f64 * 100f64.powf(-2.0 * i as f64 / half as f64);
                            let (x0, x1) = (x[b + i] as f64, x[b + i + quarter] as f64);
                            expect[b + i] = x0 * theta.cos() - x1 * theta.sin();
                            expect[b + i + quarter] = x0 * theta.sin() + x1 * theta.cos();
                        }
                    }
                }
            }
            assert!(max_diff(&y, &expect) < 1e-4, "head_dim {head_dim}");
            // Patch (0, 0) is the identity; a column alone leaves the second halves, a row the first.
            assert_eq!(&y[..2 * head_dim], &x[..2 * head_dim]);
            let b = 2 * head_dim;
            assert_eq!(&y[b + half..b + head_dim], &x[b + half..b + head_dim]);
            assert_ne!(&y[b..b + half], &x[b..b + half]);
            let b = 4 * head_dim;
            assert_eq!(&y[b..b + half], &x[b..b + half]);
            assert_ne!(&y[b + half..b + head_dim], &x[b + half..b + head_dim]);
        }
    }

    #[test]
    fn rows_turn_the_first_quarter_and_columns_the_second() {
        let mut rng = Rng::new(12);
        let head_dim = 16;
        let x = normals(&mut rng, head_dim);
        // A row alone moves pairs 0..4 (dims 0..4 and 8..12), a column alone pairs 4..8.
        let mut by_row = x.clone();
        rope_2d(&mut by_row, (&[3], &[0]), head_dim, 10000.0);
        let mut by_col = x.clone();
        rope_2d(&mut by_col, (&[0], &[3]), head_dim, 10000.0);
        for i in 0..head_dim {
            let first_quarter = i % 8 < 4;
            assert_eq!(by_row[i] == x[i], !first_quarter, "row, dim {i}");
            assert_eq!(by_col[i] == x[i], first_quarter, "column, dim {i}");
        }
    }
}
