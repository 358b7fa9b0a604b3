//! Resampling a grid of vectors to another grid size (ggml's `ggml_interpolate`, bilinear with aligned
//! corners): what vision encoders do to a learned position-embedding table made for another patch grid.

/// Bilinear resampling with aligned corners of a `src_w × src_h` grid of `channels`-wide vectors (row-major:
/// vector `(x, y)` at `(y·src_w + x)·channels`) to `dst_w × dst_h`, in ggml's f32 arithmetic: output `(i, j)`
/// reads the source at `(i·(src_w−1)/(dst_w−1), j·(src_h−1)/(dst_h−1))` (the scale formed in f32 as
/// `(dst−1)/(src−1)` and divided by, as ggml does), weighting its four neighbours.
pub fn bilinear_align_corners(
    src: &[f32],
    (src_w, src_h): (usize, usize),
    channels: usize,
    (dst_w, dst_h): (usize, usize),
) -> Vec<f32> {
    assert_eq!(
        src.len(),
        src_w * src_h * channels,
        "bilinear_align_corners: source size"
    );
    assert!(
        src_w > 0 && src_h > 0,
        "bilinear_align_corners: empty source"
    );
    // ggml keeps the plain ratio where a side has one cell (nothing to align).
    let scale = |dst: usize, src: usize| {
        if dst > 1 && src > 1 {
            (dst - 1) as f32 / (src - 1) as f32
        } else {
            dst as f32 / src as f32
        }
    };
    let (sx, sy) = (scale(dst_w, src_w), scale(dst_h, src_h));
    // Source cell index below `t` and the weight of the one above, both clamped to the grid.
    let locate = |t: f32, n: usize| {
        let lo = t.floor() as i64;
        let clamp = |i: i64| i.clamp(0, n as i64 - 1) as usize;
        let (i0, i1) = (clamp(lo), clamp(lo + 1));
        (i0, i1, (t - i0 as f32).clamp(0.0, 1.0))
    };
    let mut out = vec![0f32; dst_w * dst_h * channels];
    for j in 0..dst_h {
        let (y0, y1, dy) = locate(j as f32 / sy, src_h);
        for i in 0..dst_w {
            let (x0, x1, dx) = locate(i as f32 / sx, src_w);
            let at = |x: usize, y: usize| &src[(y * src_w + x) * channels..][..channels];
            let (a, b, c, d) = (at(x0, y0), at(x1, y0), at(x0, y1), at(x1, y1));
            let o = &mut out[(j * dst_w + i) * channels..][..channels];
            for k in 0..channels {
                o[k] = a[k] * (1.0 - dx) * (1.0 - dy)
                    + b[k] * dx * (1.0 - dy)
                    + c[k] * (1.0 - dx) * dy
                    + d[k] * dx * dy;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corners_are_kept_and_a_plane_is_reproduced() {
        // A plane f(x, y) = 2x − 3y + 1 sampled on 4×3 cells: bilinear interpolation of a plane is exact,
        // and with aligned corners the output's corners are the input's.
        let (sw, sh) = (4usize, 3usize);
        let f = |x: f32, y: f32| 2.0 * x - 3.0 * y + 1.0;
        let src: Vec<f32> = (0..sh)
            .flat_map(|y| (0..sw).map(move |x| f(x as f32, y as f32)))
            .collect();
        let (dw, dh) = (7usize, 5usize);
        let out = bilinear_align_corners(&src, (sw, sh), 1, (dw, dh));
        for j in 0..dh {
            for i in 0..dw {
                let (x, y) = (i as f32 * 3.0 / 6.0, j as f32 * 2.0 / 4.0);
                let got = out[j * dw + i];
                assert!(
                    (got - f(x, y)).abs() < 1e-5,
                    "({i}, {j}): {got} vs {}",
                    f(x, y)
                );
            }
        }
        assert_eq!(out[0], src[0]);
        assert_eq!(out[dw - 1], src[sw - 1]);
        assert_eq!(out[dw * dh - 1], src[sw * sh - 1]);
    }

    #[test]
    fn channels_are_independent_and_same_size_is_identity() {
        let src: Vec<f32> = (0..2 * 2 * 3).map(|v| v as f32 * 0.5 - 1.0).collect();
        assert_eq!(bilinear_align_corners(&src, (2, 2), 3, (2, 2)), src);
        let out = bilinear_align_corners(&src, (2, 2), 3, (3, 1));
        // One output row: the source's first row (y = 0), its middle column the mean of the two cells.
        for k in 0..3 {
            assert_eq!(out[k], src[k]);
            assert!((out[3 + k] - 0.5 * (src[k] + src[3 + k])).abs() < 1e-6);
            assert_eq!(out[6 + k], src[3 + k]);
        }
    }
}
