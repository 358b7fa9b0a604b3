//! Element-wise activations, as ggml defines them.

/// `√(2/π)`.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// The cubic coefficient of the tanh approximation of GELU.
const GELU_COEF_A: f32 = 0.044715;

/// `x·σ(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation: `½x(1 + tanh(√(2/π)(x + 0.044715x³)))`, computed as ggml's `ggml_gelu_f32`
/// is compiled (`0.5x·(1 + tanh((√(2/π)·x)·fma(0.044715x, x, 1)))`). ggml's CPU backend reads this
/// function from a table indexed by `x` rounded to f16: see [`gelu_ggml`].
#[inline]
pub fn gelu(x: f32) -> f32 {
    let p = (GELU_COEF_A * x).mul_add(x, 1.0);
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * p).tanh())
}

/// GELU as ggml's CPU backend computes it (`ggml_vec_gelu_f32` with `GGML_GELU_FP16`, also its GeGLU):
/// 0 at or below −10, `x` at or above 10, otherwise [`gelu`] of `x` rounded to f16, itself rounded to f16
/// (ggml reads a table of f16 values indexed by the f16 bits of `x`). Models trained in bf16 do not care;
/// agreement with llama.cpp on sensitive models does.
#[inline]
pub fn gelu_ggml(x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        let xh = half::f16::from_f32(x).to_f32();
        half::f16::from_f32(gelu(xh)).to_f32()
    }
}

/// [`gelu_ggml`] read from a table of its value at every f16 input (built once): inside (−10, 10)
/// `gelu_ggml` rounds its input to f16 first, so there its value is a function of the f16 bits, which the
/// table holds exactly (the same bits, without a `tanh` per element; ggml's CPU backend reads such a table
/// too).
#[inline]
pub fn gelu_ggml_tabled(x: f32) -> f32 {
    static TABLE: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    if x <= -10.0 || x >= 10.0 {
        return gelu_ggml(x);
    }
    let table = TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| {
                let xh = crate::quant::float::f16_bits_to_f32(bits);
                half::f16::from_f32(gelu(xh)).to_f32()
            })
            .collect()
    });
    // The inline conversion (`half`'s goes through a run-time dispatch per call; the same bits).
    table[crate::quant::float::f32_to_f16_bits(x) as usize]
}

/// [`gelu_ggml_tabled`] of every element in place, over the rayon pool the call runs in.
pub fn gelu_ggml_in_place(xs: &mut [f32]) {
    use rayon::prelude::*;
    xs.par_chunks_mut(1 << 14).for_each(|c| {
        for v in c {
            *v = gelu_ggml_tabled(*v);
        }
    });
}

/// The coefficient of quick GELU (`x·σ(1.702x)`), as ggml's `GELU_QUICK_COEF` (negated).
const GELU_QUICK_COEF: f32 = -1.702;

/// Quick GELU, `x·σ(1.702x)`, computed as ggml's `ggml_gelu_quick_f32` (`x·(1/(1 + expf(−1.702·x)))`).
#[inline]
pub fn gelu_quick(x: f32) -> f32 {
    x * (1.0 / (1.0 + (GELU_QUICK_COEF * x).exp()))
}

/// Quick GELU as ggml's CPU backend computes it (`ggml_vec_gelu_quick_f32` and its GeGLU with
/// `GGML_GELU_QUICK_FP16`): [`gelu_quick`] of `x` rounded to f16, itself rounded to f16 (a table of f16
/// values indexed by the f16 bits of `x`). Unlike [`gelu_ggml`] there is no cut-off at ±10.
#[inline]
pub fn gelu_quick_ggml(x: f32) -> f32 {
    let xh = half::f16::from_f32(x).to_f32();
    half::f16::from_f32(gelu_quick(xh)).to_f32()
}

/// `1/(1+e^{-x})`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `ln(1+e^x)`, computed without overflow (ggml returns `x` above 20), as ggml computes it: `logf(1 +
/// expf(x))` (not `log1p`, which rounds differently).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        (1.0 + x.exp()).ln()
    }
}

/// `silu(gate) · up`, element-wise into `gate` (SwiGLU).
pub fn swiglu_in_place(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "swiglu: lengths differ");
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// `gelu(gate) · up`, element-wise into `gate` (GeGLU, with ggml's CPU GELU: [`gelu_ggml`], read from its
/// table, [`gelu_ggml_tabled`]: the same bits).
pub fn geglu_in_place(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "geglu: lengths differ");
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = gelu_ggml_tabled(*g) * u;
    }
}

/// ggml's vectorized SiLU on AVX2 (`ggml_v_silu`), one lane: `x / (1 + ggml_v_expf(0 − x))`.
#[inline(always)]
pub fn ggml_v_silu(x: f32) -> f32 {
    x / (1.0 + super::attention::ggml_v_expf(0.0 - x))
}

/// ggml's element-wise loops over one row of `n` values (`ggml_vec_silu_f32`, `ggml_vec_swiglu_f32`):
/// the vector form for the first `8·⌊n/8⌋` values, the scalar form (libm `expf`) for the rest.
#[inline(always)]
fn ggml_row_loop(n: usize, mut f: impl FnMut(usize, bool)) {
    let main = n - n % 8;
    for i in 0..n {
        f(i, i < main);
    }
}

#[inline(always)]
fn silu_rows_body(x: &mut [f32], row: usize) {
    for r in x.chunks_mut(row) {
        ggml_row_loop(r.len(), |i, vector| {
            r[i] = if vector {
                ggml_v_silu(r[i])
            } else {
                silu(r[i])
            };
        });
    }
}

#[inline(always)]
fn swiglu_rows_body(gate: &mut [f32], up: &[f32], row: usize) {
    for (g, u) in gate.chunks_mut(row).zip(up.chunks(row)) {
        ggml_row_loop(g.len(), |i, vector| {
            let a = if vector {
                ggml_v_silu(g[i])
            } else {
                silu(g[i])
            };
            g[i] = a * u[i];
        });
    }
}

/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_rows_fma(x: &mut [f32], row: usize) {
    silu_rows_body(x, row)
}

/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn swiglu_rows_fma(gate: &mut [f32], up: &[f32], row: usize) {
    swiglu_rows_body(gate, up, row)
}

/// Whether FMA instructions may be used (`mul_add` is otherwise a library call: same results, slower).
#[inline]
pub(crate) fn fma_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// SiLU in place over rows of `row` values, as ggml's CPU backend computes `ggml_silu` (AVX2 + FMA
/// build): [`ggml_v_silu`] for whole groups of eight in a row, [`silu`] for the rest.
pub fn silu_ggml_rows(x: &mut [f32], row: usize) {
    assert!(row > 0, "silu: empty rows");
    #[cfg(target_arch = "x86_64")]
    if fma_available() {
        // SAFETY: AVX2 and FMA were detected at run time.
        return unsafe { silu_rows_fma(x, row) };
    }
    silu_rows_body(x, row)
}

/// `silu(gate) · up` in place over rows of `row` values, as ggml's CPU backend computes `ggml_swiglu`
/// (`ggml_vec_swiglu_f32`: [`ggml_v_silu`] for whole groups of eight in a row, [`silu`] for the rest).
pub fn swiglu_ggml_rows(gate: &mut [f32], up: &[f32], row: usize) {
    assert_eq!(gate.len(), up.len(), "swiglu: lengths differ");
    assert!(row > 0, "swiglu: empty rows");
    #[cfg(target_arch = "x86_64")]
    if fma_available() {
        // SAFETY: AVX2 and FMA were detected at run time.
        return unsafe { swiglu_rows_fma(gate, up, row) };
    }
    swiglu_rows_body(gate, up, row)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_ggml_in_place_equals_gelu_ggml() {
        // Every f16 value, the edges of the cut-off, and random floats between the f16 values.
        let mut xs: Vec<f32> = (0..=u16::MAX)
            .map(|h| half::f16::from_bits(h).to_f32())
            .filter(|v| !v.is_nan())
            .collect();
        xs.extend([-10.0, 10.0, -9.999, 9.999, -10.001, 10.001, 0.0, -0.0]);
        let mut rng = crate::rng::Rng::new(9);
        xs.extend((0..100_000).map(|_| rng.normal() * 4.0));
        let want: Vec<u32> = xs.iter().map(|&x| gelu_ggml(x).to_bits()).collect();
        gelu_ggml_in_place(&mut xs);
        let got: Vec<u32> = xs.iter().map(|x| x.to_bits()).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn activations_match_f64_formulas() {
        for i in -400..=400 {
            let x = i as f32 * 0.05;
            let xd = x as f64;
            let sig = 1.0 / (1.0 + (-xd).exp());
            assert!((sigmoid(x) as f64 - sig).abs() < 1e-6, "sigmoid {x}");
            assert!((silu(x) as f64 - xd * sig).abs() < 1e-5, "silu {x}");
            let g = 0.5
                * xd
                * (1.0
                    + ((2.0 / std::f64::consts::PI).sqrt() * (xd + 0.044715 * xd.powi(3))).tanh());
            assert!((gelu(x) as f64 - g).abs() < 1e-5, "gelu {x}");
            let q = xd / (1.0 + (-1.702 * xd).exp());
            assert!((gelu_quick(x) as f64 - q).abs() < 1e-5, "gelu_quick {x}");
            // The table's two f16 roundings (of x, then of the value) move it by about 2⁻¹¹ of each.
            let bound = (xd.abs() + q.abs()) / 1024.0 + 1e-7;
            assert!(
                (gelu_quick_ggml(x) as f64 - q).abs() <= bound,
                "gelu_quick_ggml {x}"
            );
            let sp = (1.0 + xd.exp()).ln();
            assert!((softplus(x) as f64 - sp).abs() < 1e-5, "softplus {x}");
        }
        assert_eq!(softplus(100.0), 100.0);
        let mut g = [1.0f32, -2.0];
        swiglu_in_place(&mut g, &[2.0, 3.0]);
        assert!((g[0] - 2.0 * silu(1.0)).abs() < 1e-7 && (g[1] - 3.0 * silu(-2.0)).abs() < 1e-7);
        let mut g = [1.0f32];
        geglu_in_place(&mut g, &[2.0]);
        assert!((g[0] - 2.0 * gelu_ggml(1.0)).abs() < 1e-7);
    }

    #[test]
    fn ggml_silu_takes_the_vector_form_for_whole_groups_of_eight_per_row() {
        // Rows of 11: the first 8 of each row through ggml_v_silu, the last 3 through libm's expf.
        let x: Vec<f32> = (0..22).map(|i| i as f32 * 0.37 - 4.0).collect();
        let mut y = x.clone();
        silu_ggml_rows(&mut y, 11);
        for (i, (&a, &b)) in x.iter().zip(&y).enumerate() {
            let want = if i % 11 < 8 { ggml_v_silu(a) } else { silu(a) };
            assert_eq!(b.to_bits(), want.to_bits(), "element {i}");
            assert!((b - silu(a)).abs() <= 2e-7 * (1.0 + a.abs()), "element {i}");
        }
        let up: Vec<f32> = (0..22).map(|i| 1.0 - i as f32 * 0.1).collect();
        let mut g = x.clone();
        swiglu_ggml_rows(&mut g, &up, 11);
        for i in 0..22 {
            assert_eq!(g[i].to_bits(), (y[i] * up[i]).to_bits(), "element {i}");
        }
        // The two forms differ somewhere in this range, so the split matters.
        assert!((0..2000).any(|i| {
            let v = i as f32 * 0.01 - 10.0;
            ggml_v_silu(v) != silu(v)
        }));
    }

    #[test]
    fn ggml_gelu_is_the_f16_table_value() {
        use half::f16;
        // Every f16 input in (-10, 10) gives the f16 rounding of GELU at it; an f32 input between two f16
        // values reads the table at the nearer one.
        for bits in 0..=u16::MAX {
            let x = f16::from_bits(bits).to_f32();
            if !x.is_finite() || x <= -10.0 || x >= 10.0 {
                continue;
            }
            let y = gelu_ggml(x);
            assert_eq!(y, f16::from_f32(gelu(x)).to_f32(), "x = {x}");
        }
        // Entries of llama.cpp's own table (`ggml_table_gelu_f16` read from libggml-cpu), among them the
        // ones where an unfused `1 + 0.044715x²` rounds to the other f16 value.
        for (x, want) in [
            (-1.817_382_8f32, -0.062_866_21f32),
            (-2.013_671_9, -0.044_219_97),
            (-3.060_546_9, -0.002_992_63),
            (0.700_195_3, 0.530_761_7),
            (3.300_781_3, 3.298_828_1),
        ] {
            assert_eq!(gelu_ggml(x), f16::from_f32(want).to_f32(), "x = {x}");
        }
        let x = 1.0f32 + 0.3 * f16::EPSILON.to_f32();
        assert_eq!(gelu_ggml(x), gelu_ggml(1.0));
        assert_ne!(gelu_ggml(x), gelu(x));
        assert_eq!(gelu_ggml(-10.0), 0.0);
        assert_eq!(gelu_ggml(-12.5), 0.0);
        assert_eq!(gelu_ggml(10.0), 10.0);
        assert_eq!(gelu_ggml(37.0), 37.0);
    }
}
