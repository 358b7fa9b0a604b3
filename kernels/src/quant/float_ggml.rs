//! llama.cpp's CPU orders for F32 weight matrices (AVX2 + FMA build), so products with F32 weights (MoE
//! routers, gate vectors) equal llama.cpp's bit for bit:
//!
//! - one activation row (`ggml_vec_dot_f32`): four accumulators of eight lanes fed by fused multiply-adds
//!   over steps of 32 elements, reduced as `GGML_F32_VEC_REDUCE` does; [`crate::ops::recurrent::dot_ggml`].
//! - a batch of two rows or more (`llamafile_sgemm`, tinyBLAS with `__m256`, when the row length is a
//!   multiple of 8): one accumulator of eight lanes fed by fused multiply-adds over steps of 8 elements,
//!   reduced by `hsum` (the order of `sum_lanes8`). Other row lengths fall back to `ggml_vec_dot_f32`.

use super::float::sum_lanes8;
use super::BatchDot;
use crate::ops::recurrent::dot_ggml;

/// The dot product of tinyBLAS's F32 kernel (module documentation); `x.len()` is a multiple of 8.
#[inline(always)]
fn dot_tinyblas(x: &[f32], y: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    for (a, b) in x.chunks_exact(8).zip(y.chunks_exact(8)) {
        for l in 0..8 {
            lanes[l] = a[l].mul_add(b[l], lanes[l]);
        }
    }
    sum_lanes8(&lanes)
}

/// [`dot_tinyblas`] of one row `x` with four rows `ys` at once: four independent chains of fused steps
/// (one alone waits on the latency of each multiply-add; tinyBLAS's tiles also run several), each the
/// same operations as alone.
#[inline(always)]
fn dot_tinyblas_x4(x: &[f32], ys: [&[f32]; 4]) -> [f32; 4] {
    let mut lanes = [[0f32; 8]; 4];
    let n8 = x.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        let a = &x[i..i + 8];
        for (lk, y) in lanes.iter_mut().zip(&ys) {
            let b = &y[i..i + 8];
            for l in 0..8 {
                lk[l] = a[l].mul_add(b[l], lk[l]);
            }
        }
    }
    lanes.map(|l| sum_lanes8(&l))
}

/// [`dot_tinyblas_x4`] compiled with FMA instructions.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_tinyblas_x4_fma(x: &[f32], ys: [&[f32]; 4]) -> [f32; 4] {
    dot_tinyblas_x4(x, ys)
}

/// [`F32_TINYBLAS`]'s dot product of one row with four activation rows (rows of a multiple of 8 values;
/// others take [`tinyblas_f32`] one by one).
fn tinyblas_f32_x4(n: usize, row: &[u8], acts: [&[u8]; 4]) -> [f32; 4] {
    if !n.is_multiple_of(8) {
        return acts.map(|a| tinyblas_f32(n, row, a));
    }
    let mut bx = Vec::new();
    let mut bys: [Vec<f32>; 4] = Default::default();
    let x = as_f32(row, n, &mut bx);
    let [b0, b1, b2, b3] = &mut bys;
    let ys = [
        as_f32(acts[0], n, b0),
        as_f32(acts[1], n, b1),
        as_f32(acts[2], n, b2),
        as_f32(acts[3], n, b3),
    ];
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        // SAFETY: `has_avx2_fma` confirmed AVX2 and FMA at run time.
        return unsafe { dot_tinyblas_x4_fma(x, ys) };
    }
    dot_tinyblas_x4(x, ys)
}

/// Which of the two orders.
#[derive(Clone, Copy)]
enum Order {
    VecDot,
    TinyBlas,
}

#[inline(always)]
fn dot_in(order: Order, x: &[f32], y: &[f32]) -> f32 {
    match order {
        Order::TinyBlas if x.len().is_multiple_of(8) => dot_tinyblas(x, y),
        _ => dot_ggml(x, y),
    }
}

/// The same arithmetic compiled with FMA instructions (`mul_add` is otherwise a library call).
///
/// # Safety
/// The CPU must support FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_in_fma(order: Order, x: &[f32], y: &[f32]) -> f32 {
    dot_in(order, x, y)
}

/// `n` little-endian f32 of `b` as a slice: borrowed when aligned (always, for mapped GGUF tensors and
/// allocated activations), else copied into `buf`.
fn as_f32<'a>(b: &'a [u8], n: usize, buf: &'a mut Vec<f32>) -> &'a [f32] {
    let b = &b[..n * 4];
    // SAFETY: every bit pattern is a valid f32; `align_to` only yields the aligned middle part.
    let (head, mid, _) = unsafe { b.align_to::<f32>() };
    if head.is_empty() && mid.len() == n && cfg!(target_endian = "little") {
        return mid;
    }
    buf.clear();
    buf.extend(
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
    );
    buf
}

fn dot_bytes(order: Order, n: usize, row: &[u8], act: &[u8], simd: bool) -> f32 {
    let (mut bx, mut by) = (Vec::new(), Vec::new());
    let (x, y) = (as_f32(row, n, &mut bx), as_f32(act, n, &mut by));
    #[cfg(target_arch = "x86_64")]
    if simd && super::has_avx2_fma() {
        // SAFETY: `has_avx2_fma` confirmed FMA at run time.
        return unsafe { dot_in_fma(order, x, y) };
    }
    let _ = simd;
    dot_in(order, x, y)
}

/// `ggml_vec_dot_f32`'s order for one activation row.
pub(crate) fn vec_dot_f32(n: usize, row: &[u8], act: &[u8]) -> f32 {
    dot_bytes(Order::VecDot, n, row, act, true)
}

/// [`vec_dot_f32`] without SIMD (equal bit for bit).
pub(crate) fn vec_dot_f32_portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
    dot_bytes(Order::VecDot, n, row, act, false)
}

fn tinyblas_f32(n: usize, row: &[u8], act: &[u8]) -> f32 {
    dot_bytes(Order::TinyBlas, n, row, act, true)
}

fn tinyblas_f32_portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
    dot_bytes(Order::TinyBlas, n, row, act, false)
}

/// F32's batch order (`quant::BatchDot`): llamafile's tinyBLAS for every row of a batch of two or more.
pub(crate) static F32_TINYBLAS: BatchDot = BatchDot {
    dot: tinyblas_f32,
    portable: tinyblas_f32_portable,
    applies: |n, _| n >= 2,
    dot4: Some(tinyblas_f32_x4),
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    fn bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn tinyblas_order_is_one_fused_accumulator_of_eight_lanes() {
        let mut rng = Rng::new(21);
        let n = 48;
        let x: Vec<f32> = (0..n)
            .map(|i| rng.normal() * 10f32.powi(i as i32 % 5 - 2))
            .collect();
        let y: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
        let mut lanes = [0f32; 8];
        for (i, (a, b)) in x.iter().zip(&y).enumerate() {
            lanes[i % 8] = a.mul_add(*b, lanes[i % 8]);
        }
        let l = lanes;
        let expect = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
        let (bx, by) = (bytes(&x), bytes(&y));
        assert_eq!(tinyblas_f32(n, &bx, &by).to_bits(), expect.to_bits());
        assert_eq!(
            tinyblas_f32_portable(n, &bx, &by).to_bits(),
            expect.to_bits()
        );
        // Four activation rows at once: each the same bits as alone.
        let ys: Vec<Vec<u8>> = (0..4)
            .map(|k| bytes(&y.iter().map(|v| v * (k as f32 + 0.5)).collect::<Vec<f32>>()))
            .collect();
        let four = tinyblas_f32_x4(n, &bx, [&ys[0], &ys[1], &ys[2], &ys[3]]);
        for (k, yk) in ys.iter().enumerate() {
            assert_eq!(
                four[k].to_bits(),
                tinyblas_f32(n, &bx, yk).to_bits(),
                "row {k}"
            );
        }
        assert_eq!(
            vec_dot_f32(n, &bx, &by).to_bits(),
            dot_ggml(&x, &y).to_bits()
        );
        // Unaligned rows read the same values.
        let mut shifted = vec![0u8];
        shifted.extend_from_slice(&bx);
        assert_eq!(
            vec_dot_f32_portable(n, &shifted[1..], &by).to_bits(),
            dot_ggml(&x, &y).to_bits()
        );
    }
}
