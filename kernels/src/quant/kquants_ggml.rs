//! Single-row K-quant dot products in the order of llama.cpp's AVX2 `ggml_vec_dot_q*_K_q8_K`, where
//! `quant::kquants`' own order differs:
//!
//! - Q4_K ([`Q4K_PLAIN`]): llama.cpp multiplies Q4_K matrices it does not repack (row count not a multiple
//!   of 8) with `ggml_vec_dot_q4_K_q8_K`: per super-block `acc = fma(yd·xd, lane, acc)` on eight f32 lanes
//!   and `acc_m = fma(−yd·xdmin, pair, acc_m)` on four (pair `m` = min lanes `2m` and `2m+1`); the result
//!   is `hsum(acc) + ((acc_m0 + acc_m2) + (acc_m1 + acc_m3))`. ([`super::kquants`]' Q4_K order is the
//!   repacked gemv's, which llama.cpp uses for every other Q4_K matrix.)
//! - Q5_K (its `vec_dot`): the eight scale lanes as Q4_K's, the mins as one total `M` per super-block
//!   added to one f32 as `summs = fma(−yd·xdmin, M, summs)` (GCC contracts that line); the result is
//!   `hsum(acc) + summs`.
//!
//! The integer lanes are `kquants::block_lanes` (portable) or `x86::kquants_avx2::block` (AVX2, equal);
//! these functions only add the float work.

use super::float::sum_lanes8;
use super::kquants::{block_lanes, block_scales, check_lengths, q8k_d, KKind, Q8K_BYTES};
use super::BatchDot;

#[inline(always)]
fn q4k_plain_body(nb: usize, row: &[u8], act: &[u8]) -> f32 {
    let (mut acc, mut acc_m) = ([0f32; 8], [0f32; 4]);
    for (x, y) in row
        .chunks_exact(144)
        .zip(act.chunks_exact(Q8K_BYTES))
        .take(nb)
    {
        let (lanes, min_lanes) = block_lanes(KKind::Q4K, x, y);
        let (xd, xdmin) = block_scales(KKind::Q4K, x);
        let yd = q8k_d(y);
        let (d, dmin) = (yd * xd, -yd * xdmin);
        for l in 0..8 {
            acc[l] = d.mul_add(lanes[l] as f32, acc[l]);
        }
        for m in 0..4 {
            let pair = min_lanes[2 * m] + min_lanes[2 * m + 1];
            acc_m[m] = dmin.mul_add(pair as f32, acc_m[m]);
        }
    }
    sum_lanes8(&acc) + ((acc_m[0] + acc_m[2]) + (acc_m[1] + acc_m[3]))
}

#[inline(always)]
fn q5k_body(nb: usize, row: &[u8], act: &[u8]) -> f32 {
    let (mut acc, mut summs) = ([0f32; 8], 0f32);
    for (x, y) in row
        .chunks_exact(176)
        .zip(act.chunks_exact(Q8K_BYTES))
        .take(nb)
    {
        let (lanes, min_lanes) = block_lanes(KKind::Q5K, x, y);
        let (xd, xdmin) = block_scales(KKind::Q5K, x);
        let yd = q8k_d(y);
        let (d, dmin) = (yd * xd, -yd * xdmin);
        let m: i32 = min_lanes.iter().sum();
        summs = dmin.mul_add(m as f32, summs);
        for l in 0..8 {
            acc[l] = d.mul_add(lanes[l] as f32, acc[l]);
        }
    }
    sum_lanes8(&acc) + summs
}

/// The AVX2 form of both orders: the integer lanes from `x86::kquants_avx2::block`, the float work as the
/// portable bodies (`Q5 = false`: Q4_K plain, `true`: Q5_K).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `row` and `act` hold `nb` blocks each.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_body<const Q5: bool>(nb: usize, row: &[u8], act: &[u8]) -> f32 {
    use core::arch::x86_64::*;
    let bb = if Q5 { 176 } else { 144 };
    let (mut acc, mut acc_m, mut summs) = (_mm256_setzero_ps(), [0f32; 4], 0f32);
    for i in 0..nb {
        let (x, y) = (row.as_ptr().add(i * bb), act.as_ptr().add(i * Q8K_BYTES));
        let (lanes, min_lanes, (xd, xdmin)) = if Q5 {
            super::x86::kquants_avx2::block::<3>(x, y)
        } else {
            super::x86::kquants_avx2::block::<2>(x, y)
        };
        let yd = (y as *const f32).read_unaligned();
        let (d, dmin) = (yd * xd, -yd * xdmin);
        let mut mins = [0i32; 8];
        _mm256_storeu_si256(mins.as_mut_ptr() as *mut __m256i, min_lanes);
        if Q5 {
            summs = dmin.mul_add(mins.iter().sum::<i32>() as f32, summs);
        } else {
            for m in 0..4 {
                acc_m[m] = dmin.mul_add((mins[2 * m] + mins[2 * m + 1]) as f32, acc_m[m]);
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(lanes), acc);
    }
    let mut a = [0f32; 8];
    _mm256_storeu_ps(a.as_mut_ptr(), acc);
    if Q5 {
        sum_lanes8(&a) + summs
    } else {
        sum_lanes8(&a) + ((acc_m[0] + acc_m[2]) + (acc_m[1] + acc_m[3]))
    }
}

fn q4k_plain(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = check_lengths(KKind::Q4K, n, row, act);
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        // SAFETY: `has_avx2_fma` confirmed AVX2, FMA and F16C at run time; `check_lengths` showed that
        // `row` and `act` hold `nb` blocks each.
        return unsafe { avx2_body::<false>(nb, row, act) };
    }
    q4k_plain_body(nb, row, act)
}

fn q4k_plain_portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = check_lengths(KKind::Q4K, n, row, act);
    q4k_plain_body(nb, row, act)
}

/// Q5_K's single-row dot product (`ggml_vec_dot_q5_K_q8_K`).
pub(crate) fn q5k_vec_dot(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = check_lengths(KKind::Q5K, n, row, act);
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        // SAFETY: as in `q4k_plain`.
        return unsafe { avx2_body::<true>(nb, row, act) };
    }
    q5k_body(nb, row, act)
}

/// [`q5k_vec_dot`] without SIMD (equal bit for bit).
pub(crate) fn q5k_vec_dot_portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = check_lengths(KKind::Q5K, n, row, act);
    q5k_body(nb, row, act)
}

/// Q4_K's order in matrices llama.cpp does not repack, for batches under 8 rows (every row).
pub static Q4K_PLAIN: BatchDot = BatchDot {
    dot: q4k_plain,
    portable: q4k_plain_portable,
    applies: |_, _| true,
    dot4: None,
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize, fill_random, GgmlType};
    use crate::rng::Rng;

    /// Weights and activations of `n` values, the activations quantized to Q8_K, and `Σ|w·x|`.
    fn operands(ty: GgmlType, n: usize, seed: u64) -> (Vec<u8>, Vec<u8>, Vec<f32>, f64) {
        let mut rng = Rng::new(seed);
        let mut w = vec![0u8; ty.bytes_for(n as u64).unwrap() as usize];
        fill_random(ty, &mut rng, 0.05, &mut w).unwrap();
        let x: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
        let act_ty = ty.ops().unwrap().act;
        let mut act = vec![0u8; act_ty.bytes_for(n)];
        act_ty.quantize(&x, &mut act);
        let mut wf = vec![0f32; n];
        dequantize(ty, &w, &mut wf).unwrap();
        let magnitude = wf.iter().zip(&x).map(|(a, b)| (a * b).abs() as f64).sum();
        (w, act, x, magnitude)
    }

    #[test]
    fn plain_q4k_and_q5k_orders_equal_their_portable_code_and_spelled_out_sums() {
        let n = 1024;
        let mut plain_differs_from_gemv = false;
        for seed in 0..20 {
            let (w, act, _, magnitude) = operands(GgmlType::Q4_K, n, seed);
            let fast = (Q4K_PLAIN.dot)(n, &w, &act);
            assert_eq!(fast.to_bits(), (Q4K_PLAIN.portable)(n, &w, &act).to_bits());
            // Spelled out: eight fused scale lanes, four fused min-pair lanes, summed as hsum does.
            let (mut acc, mut acc_m) = ([0f32; 8], [0f32; 4]);
            for (x, y) in w.chunks_exact(144).zip(act.chunks_exact(Q8K_BYTES)) {
                let (lanes, mins) = block_lanes(KKind::Q4K, x, y);
                let (xd, xdmin) = block_scales(KKind::Q4K, x);
                let yd = q8k_d(y);
                for l in 0..8 {
                    acc[l] = (yd * xd).mul_add(lanes[l] as f32, acc[l]);
                }
                for m in 0..4 {
                    acc_m[m] =
                        (-yd * xdmin).mul_add((mins[2 * m] + mins[2 * m + 1]) as f32, acc_m[m]);
                }
            }
            let l = acc;
            let want = (((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7])))
                + ((acc_m[0] + acc_m[2]) + (acc_m[1] + acc_m[3]));
            assert_eq!(fast.to_bits(), want.to_bits(), "seed {seed}");
            let gemv = crate::quant::vec_dot(GgmlType::Q4_K, n, &w, &act).unwrap();
            assert!(((fast - gemv) as f64).abs() <= 1e-5 * magnitude);
            plain_differs_from_gemv |= fast != gemv;

            let (w, act, _, magnitude) = operands(GgmlType::Q5_K, n, 100 + seed);
            let fast = q5k_vec_dot(n, &w, &act);
            assert_eq!(fast.to_bits(), q5k_vec_dot_portable(n, &w, &act).to_bits());
            let (mut acc, mut summs) = ([0f32; 8], 0f32);
            for (x, y) in w.chunks_exact(176).zip(act.chunks_exact(Q8K_BYTES)) {
                let (lanes, mins) = block_lanes(KKind::Q5K, x, y);
                let (xd, xdmin) = block_scales(KKind::Q5K, x);
                let yd = q8k_d(y);
                summs = (-yd * xdmin).mul_add(mins.iter().sum::<i32>() as f32, summs);
                for l in 0..8 {
                    acc[l] = (yd * xd).mul_add(lanes[l] as f32, acc[l]);
                }
            }
            let l = acc;
            let want = (((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))) + summs;
            assert_eq!(fast.to_bits(), want.to_bits(), "seed {seed}");
            let tiled = (crate::quant::batch_dot(GgmlType::Q5_K).unwrap().dot)(n, &w, &act);
            assert!(((fast - tiled) as f64).abs() <= 1e-5 * magnitude);
        }
        assert!(
            plain_differs_from_gemv,
            "Q4_K's plain and gemv orders never differed"
        );
    }
}
