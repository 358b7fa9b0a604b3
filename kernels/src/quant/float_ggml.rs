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

/// The dot product of tinyBLAS's F16 kernel (`tinyBLAS<8, __m256, __m256, ggml_fp16_t, ggml_fp16_t>`, which
/// llama.cpp's CPU backend and mtmd's encoders use for a batch times an F16 matrix, the activations made
/// f16 first): the f16 weights of `row` (`n` of them, a multiple of 8) against f32 activations holding f16
/// values, one accumulator of eight lanes fed by fused multiply-adds over steps of 8, reduced by `hsum`.
#[inline(always)]
fn dot_tinyblas_f16_x<const R: usize>(n: usize, row: &[u8], xs: [&[f32]; R]) -> [f32; R] {
    let mut lanes = [[0f32; 8]; R];
    for (c, wb) in row[..n * 2].chunks_exact(16).enumerate() {
        let w: [f32; 8] = std::array::from_fn(|l| {
            super::float::f16_bits_to_f32(u16::from_le_bytes([wb[2 * l], wb[2 * l + 1]]))
        });
        for (lk, x) in lanes.iter_mut().zip(&xs) {
            let x = &x[c * 8..c * 8 + 8];
            for l in 0..8 {
                lk[l] = w[l].mul_add(x[l], lk[l]);
            }
        }
    }
    lanes.map(|l| sum_lanes8(&l))
}

/// [`dot_tinyblas_f16_x`] with F16C and FMA instructions: the same operations lane for lane (the f16
/// conversion is exact either way).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `row` holds `n` f16 values and each `xs` row `n` floats, `n` a
/// multiple of 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_tinyblas_f16_simd<const R: usize>(n: usize, row: &[u8], xs: [&[f32]; R]) -> [f32; R] {
    use core::arch::x86_64::*;
    assert!(row.len() >= n * 2 && xs.iter().all(|x| x.len() >= n) && n.is_multiple_of(8));
    let mut acc = [_mm256_setzero_ps(); R];
    let mut i = 0;
    while i < n {
        let w = _mm256_cvtph_ps(_mm_loadu_si128(row.as_ptr().add(i * 2) as *const __m128i));
        for (a, x) in acc.iter_mut().zip(&xs) {
            *a = _mm256_fmadd_ps(w, _mm256_loadu_ps(x.as_ptr().add(i)), *a);
        }
        i += 8;
    }
    acc.map(|a| {
        let mut l = [0f32; 8];
        _mm256_storeu_ps(l.as_mut_ptr(), a);
        sum_lanes8(&l)
    })
}

/// [`F16_TINYBLAS`]'s dot products of one f16 row with `R` activation rows (`n` a multiple of 8).
fn tinyblas_f16_rows<const R: usize>(
    n: usize,
    row: &[u8],
    acts: [&[u8]; R],
    simd: bool,
) -> [f32; R] {
    let mut bufs: [Vec<f32>; R] = std::array::from_fn(|_| Vec::new());
    let mut xs: [&[f32]; R] = [&[]; R];
    for ((x, a), b) in xs.iter_mut().zip(acts).zip(bufs.iter_mut()) {
        *x = as_f32(a, n, b);
    }
    #[cfg(target_arch = "x86_64")]
    if simd && super::has_avx2_fma() {
        // SAFETY: `has_avx2_fma` confirmed AVX2, FMA and F16C at run time; the row holds n f16 values and
        // each activation row n floats (as_f32 takes exactly n), n a multiple of 8 (the order's condition).
        return unsafe { dot_tinyblas_f16_simd(n, row, xs) };
    }
    let _ = simd;
    dot_tinyblas_f16_x(n, row, xs)
}

fn tinyblas_f16(n: usize, row: &[u8], act: &[u8]) -> f32 {
    match n.is_multiple_of(8) {
        true => tinyblas_f16_rows(n, row, [act], true)[0],
        false => (super::float::ops(super::GgmlType::F16)
            .expect("F16 has ops")
            .vec_dot)(n, row, act),
    }
}

fn tinyblas_f16_portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
    match n.is_multiple_of(8) {
        true => tinyblas_f16_rows(n, row, [act], false)[0],
        false => (super::float::ops(super::GgmlType::F16)
            .expect("F16 has ops")
            .vec_dot_portable)(n, row, act),
    }
}

fn tinyblas_f16_x4(n: usize, row: &[u8], acts: [&[u8]; 4]) -> [f32; 4] {
    match n.is_multiple_of(8) {
        true => tinyblas_f16_rows(n, row, acts, true),
        false => acts.map(|a| tinyblas_f16(n, row, a)),
    }
}

/// F16's order for a batch of two rows or more (tinyBLAS, rows of a multiple of 8 values; other lengths
/// keep F16's own dot product): the encoders' products, whose activations are f16 values already.
pub(crate) static F16_TINYBLAS: BatchDot = BatchDot {
    dot: tinyblas_f16,
    portable: tinyblas_f16_portable,
    applies: |n, _| n >= 2,
    dot4: Some(tinyblas_f16_x4),
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn f16_tinyblas_order_is_one_fused_accumulator_of_eight_lanes() {
        let mut rng = Rng::new(22);
        for n in [8usize, 48, 1152] {
            let w: Vec<u16> = (0..n)
                .map(|i| {
                    super::super::float::f32_to_f16_bits(
                        rng.normal() * 10f32.powi(i as i32 % 3 - 1),
                    )
                })
                .collect();
            let wb: Vec<u8> = w.iter().flat_map(|h| h.to_le_bytes()).collect();
            let xs: Vec<Vec<f32>> = (0..4)
                .map(|_| {
                    (0..n)
                        .map(|_| half::f16::from_f32(rng.normal()).to_f32())
                        .collect()
                })
                .collect();
            let want: Vec<f32> = xs
                .iter()
                .map(|x| {
                    let mut lanes = [0f32; 8];
                    for (i, (h, v)) in w.iter().zip(x).enumerate() {
                        lanes[i % 8] = half::f16::from_bits(*h).to_f32().mul_add(*v, lanes[i % 8]);
                    }
                    sum_lanes8(&lanes)
                })
                .collect();
            let xb: Vec<Vec<u8>> = xs.iter().map(|x| bytes(x)).collect();
            for (k, x) in xb.iter().enumerate() {
                assert_eq!(
                    tinyblas_f16(n, &wb, x).to_bits(),
                    want[k].to_bits(),
                    "n {n} row {k}"
                );
                assert_eq!(
                    tinyblas_f16_portable(n, &wb, x).to_bits(),
                    want[k].to_bits(),
                    "n {n} row {k}"
                );
            }
            let four = tinyblas_f16_x4(n, &wb, [&xb[0], &xb[1], &xb[2], &xb[3]]);
            assert_eq!(
                four.map(f32::to_bits),
                std::array::from_fn(|k| want[k].to_bits()),
                "n {n}"
            );
        }
        // A length that is no multiple of 8 keeps F16's own dot product.
        let (wb, xb) = (
            [0x3c00u16.to_le_bytes(); 5].concat(),
            bytes(&[1.0, 2.0, 3.0, 4.0, 5.0]),
        );
        assert_eq!(tinyblas_f16(5, &wb, &xb), 15.0);
    }

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
