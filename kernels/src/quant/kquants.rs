//! The K-quant formats (super-blocks of 256): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and the Q8_K activation format.

use super::{GgmlType, QuantOps};

/// The operations of this family's types.
pub(crate) fn ops(_ty: GgmlType) -> Option<&'static QuantOps> {
    None
}

/// Quantizes `x` to Q8_K blocks: f32 `d = amax / 127`, 256 × i8, 16 × i16 sums of 16 quants.
pub(crate) fn quantize_q8_k(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(256).zip(out.chunks_exact_mut(292)) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        ob[0..4].copy_from_slice(&d.to_le_bytes());
        let (qs, sums) = ob[4..].split_at_mut(256);
        for (g, (qg, xg)) in qs.chunks_exact_mut(16).zip(xb.chunks_exact(16)).enumerate() {
            let mut sum = 0i16;
            for (o, v) in qg.iter_mut().zip(xg) {
                let q = (v * id).round().clamp(-127.0, 127.0) as i8;
                sum += q as i16;
                *o = q as u8;
            }
            sums[2 * g..2 * g + 2].copy_from_slice(&sum.to_le_bytes());
        }
    }
}
