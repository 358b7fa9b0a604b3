//! The first GGML formats (blocks of 32): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and the Q8_0/Q8_1 activation
//! formats their dot products use.

use super::{put_f16, GgmlType, QuantOps};

/// The operations of this family's types.
pub(crate) fn ops(_ty: GgmlType) -> Option<&'static QuantOps> {
    None
}

/// Quantizes `x` to Q8_0 blocks: `d = amax / 127`, `q = round(x / d)`.
pub(crate) fn quantize_q8_0(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(34)) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(&mut ob[0..2], d);
        for (o, v) in ob[2..].iter_mut().zip(xb) {
            *o = (v * id).round() as i8 as u8;
        }
    }
}

/// Quantizes `x` to Q8_1 blocks: as Q8_0, plus `s = d × Σq` for formats with a minimum.
pub(crate) fn quantize_q8_1(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(36)) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (o, v) in ob[4..].iter_mut().zip(xb) {
            let q = (v * id).round() as i8;
            sum += q as i32;
            *o = q as u8;
        }
        put_f16(&mut ob[0..2], d);
        put_f16(&mut ob[2..4], d * sum as f32);
    }
}
