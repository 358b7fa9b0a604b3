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

/// GELU, tanh approximation: `½x(1 + tanh(√(2/π)(x + 0.044715x³)))`. (ggml's CPU backend reads this
/// function from a table indexed by `x` rounded to f16, so its values differ from these by up to f16
/// rounding.)
#[inline]
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)).tanh())
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

/// `gelu(gate) · up`, element-wise into `gate` (GeGLU).
pub fn geglu_in_place(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "geglu: lengths differ");
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = gelu(*g) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            let sp = (1.0 + xd.exp()).ln();
            assert!((softplus(x) as f64 - sp).abs() < 1e-5, "softplus {x}");
        }
        assert_eq!(softplus(100.0), 100.0);
        let mut g = [1.0f32, -2.0];
        swiglu_in_place(&mut g, &[2.0, 3.0]);
        assert!((g[0] - 2.0 * silu(1.0)).abs() < 1e-7 && (g[1] - 3.0 * silu(-2.0)).abs() < 1e-7);
        let mut g = [1.0f32];
        geglu_in_place(&mut g, &[2.0]);
        assert!((g[0] - 2.0 * gelu(1.0)).abs() < 1e-7);
    }
}
