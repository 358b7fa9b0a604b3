//! Register-tiled products in llamafile tinyBLAS's order ([`super::f16_tinyblas_order`],
//! [`super::f32_tinyblas_order`]): `y = x·Wᵀ` for F16 or F32 weights `W` (`m` rows of `k` values) and f32
//! activations `x` (`n` rows of `k`), `k` a multiple of 8.
//!
//! As in tinyBLAS (`sgemm.cpp`'s `gemm<RM, RN>`), the output is cut into tiles of `RM` weight rows by `RN`
//! activation rows, and a tile keeps one accumulator of eight lanes per output, fed by fused
//! multiply-adds over `k` in steps of 8 and summed at the end in the order of
//! [`sum_lanes8`](super::float::sum_lanes8): per output, exactly the operations of `float_ggml`'s one-row
//! kernels, so every output equals them bit for bit whatever the tile or the thread count. The tile
//! only shares the loads: each weight vector (converted from f16 once) serves `RN` activation rows and
//! each activation vector `RM` weight rows, where the one-row kernels load five vectors for four
//! multiply-adds.
//!
//! Kernels, chosen at run time: AVX-512 (F, VL, with the crate's other AVX-512 kernels: `--cpu-avx512`)
//! 4×6, AVX2 (FMA, F16C) 4×2, and a portable 4×3 of the same operations. Rows and activation rows that
//! do not fill a tile repeat the last one (computed and not written). The output is cut into blocks of
//! [`BLOCK_ROWS`] weight rows by [`BLOCK_ACTS`] activation rows, spread over the rayon pool the call
//! runs in; within a block the weight rows stay in cache for every activation tile.

use super::float::{f16_bits_to_f32, sum_lanes8};
use rayon::prelude::*;

/// The weight matrix of a tiled product: `m` rows of `k` little-endian values.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Weights<'a> {
    F16(&'a [u8]),
    F32(&'a [u8]),
}

impl Weights<'_> {
    fn bytes(&self) -> (&[u8], usize) {
        match self {
            Weights::F16(b) => (b, 2),
            Weights::F32(b) => (b, 4),
        }
    }
}

/// The weights of `w` as a tiled product's, where `matmul_ordered` with the order `batch` and `n`
/// activation rows computes every output in a tinyBLAS float order ([`super::f16_tinyblas_order`] with
/// F16 weights, [`super::f32_tinyblas_order`] with F32 ones: two activation rows or more, rows of a
/// multiple of 8 values); `None` otherwise.
pub(crate) fn for_matmul<'a>(
    w: &crate::matmul::QuantMatrix<'a>,
    batch: Option<&'static super::BatchDot>,
    n: usize,
) -> Option<Weights<'a>> {
    let b = batch?;
    if n < 2 || w.cols == 0 || !w.cols.is_multiple_of(8) || !(0..n).all(|j| (b.applies)(n, j)) {
        return None;
    }
    match w.ty {
        super::GgmlType::F16 if std::ptr::eq(b, super::f16_tinyblas_order()) => {
            Some(Weights::F16(w.data))
        }
        super::GgmlType::F32 if std::ptr::eq(b, super::f32_tinyblas_order()) => {
            Some(Weights::F32(w.data))
        }
        _ => None,
    }
}

/// Weight rows of a block (a multiple of every kernel's `RM`).
const BLOCK_ROWS: usize = 64;
/// Activation rows of a block (a multiple of every kernel's `RN`).
const BLOCK_ACTS: usize = 48;

/// Which tile kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Kernel {
    /// The best kernel this CPU (and `--cpu-simd`, `--cpu-avx512`) allows.
    pub(crate) fn best() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if super::has_avx512_vnni() {
                return Kernel::Avx512;
            }
            if super::has_avx2_fma() {
                return Kernel::Avx2;
            }
        }
        Kernel::Portable
    }

    /// The kernels this CPU can run (for tests).
    #[cfg(test)]
    fn available() -> Vec<Kernel> {
        let mut v = vec![Kernel::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if super::has_avx2_fma() {
                v.push(Kernel::Avx2);
            }
            if super::has_avx512_vnni() {
                v.push(Kernel::Avx512);
            }
        }
        v
    }
}

/// The output pointer shared by the blocks of [`gemm`], which write disjoint elements.
struct Out(*mut f32);
// SAFETY: the blocks holding it write disjoint elements of one live buffer (see `gemm`).
unsafe impl Sync for Out {}

/// `y[j·m + r] = W_r · x_j` (`r < m`, `j < n`) in tinyBLAS's order, with the best kernel.
pub(crate) fn gemm(w: Weights<'_>, m: usize, k: usize, x: &[f32], n: usize, y: &mut [f32]) {
    gemm_with(Kernel::best(), w, m, k, x, n, y)
}

/// [`gemm`] with a chosen kernel (one the CPU supports, as [`Kernel::best`] finds: else a panic).
pub(crate) fn gemm_with(
    kernel: Kernel,
    w: Weights<'_>,
    m: usize,
    k: usize,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) {
    let (wb, width) = w.bytes();
    assert!(
        k > 0 && k.is_multiple_of(8),
        "float_tiles: k must be a positive multiple of 8"
    );
    assert_eq!(wb.len(), m * k * width, "float_tiles: weights' length");
    assert_eq!(x.len(), n * k, "float_tiles: activations' length");
    assert_eq!(y.len(), n * m, "float_tiles: output's length");
    // The SIMD kernels' safety rests on this (`kernel` is chosen by the caller).
    #[cfg(target_arch = "x86_64")]
    match kernel {
        Kernel::Avx512 => assert!(super::has_avx512_vnni(), "float_tiles: no AVX-512 here"),
        Kernel::Avx2 => assert!(super::has_avx2_fma(), "float_tiles: no AVX2 here"),
        Kernel::Portable => {}
    }
    if m == 0 || n == 0 {
        return;
    }
    let (row_blocks, act_blocks) = (m.div_ceil(BLOCK_ROWS), n.div_ceil(BLOCK_ACTS));
    let out = Out(y.as_mut_ptr());
    (0..row_blocks * act_blocks).into_par_iter().for_each(|t| {
        let out = &out;
        let (rb, ab) = (t / act_blocks, t % act_blocks);
        let rows = rb * BLOCK_ROWS..((rb + 1) * BLOCK_ROWS).min(m);
        let acts = ab * BLOCK_ACTS..((ab + 1) * BLOCK_ACTS).min(n);
        let put = |j: usize, r: usize, v: f32| {
            // SAFETY: `j < n` and `r < m`, so `j * m + r` is inside `y` (length `n * m`, asserted
            // above); this block alone writes rows `rows` of activation rows `acts`, so no two threads
            // write the same element, and `y` outlives the parallel loop.
            unsafe { *out.0.add(j * m + r) = v };
        };
        #[cfg(target_arch = "x86_64")]
        use super::x86::float_tiles::{tile_avx2, tile_avx512};
        match kernel {
            Kernel::Portable => block::<4, 3>(w, k, x, rows, acts, put, portable_tile),
            // SAFETY (both arms): the kernel's features were found on this CPU (asserted above:
            // `has_avx2_fma` for AVX2, FMA, F16C; `has_avx512_vnni` for AVX-512 F and VL besides).
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe {
                simd_block::<2>(
                    w,
                    k,
                    x,
                    (rows, acts),
                    put,
                    [tile_avx2::<false>, tile_avx2::<true>],
                )
            },
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => unsafe {
                simd_block::<6>(
                    w,
                    k,
                    x,
                    (rows, acts),
                    put,
                    [tile_avx512::<false>, tile_avx512::<true>],
                )
            },
        }
    });
}

/// A SIMD tile kernel: `out[j][i] = w_i · x_j` for 4 weight rows of `k` values and `RN` activation rows.
#[cfg(target_arch = "x86_64")]
type SimdTile<const RN: usize> =
    unsafe fn(usize, [*const u8; 4], [*const f32; RN], &mut [[f32; 4]; RN]);

/// [`block`] with a SIMD tile kernel: `kernels[1]` for f16 weights, `kernels[0]` for f32 ones.
///
/// # Safety
/// The CPU must have the features the kernels are compiled for.
#[cfg(target_arch = "x86_64")]
unsafe fn simd_block<const RN: usize>(
    w: Weights<'_>,
    k: usize,
    x: &[f32],
    (rows, acts): (std::ops::Range<usize>, std::ops::Range<usize>),
    put: impl Fn(usize, usize, f32),
    kernels: [SimdTile<RN>; 2],
) {
    let kernel = kernels[usize::from(matches!(w, Weights::F16(_)))];
    block::<4, RN>(w, k, x, rows, acts, put, |w, k, rs, xs| {
        simd_tile(w, k, rs, xs, |k, wp, xp, o| {
            // SAFETY: the caller vouches for the CPU's features; `simd_tile` passes rows of `k`
            // values, `k` a multiple of 8 (asserted by `gemm_with`).
            unsafe { kernel(k, wp, xp, o) }
        })
    });
}

/// One block: activation tiles in turn, each against every weight tile of the block (whose rows stay in
/// cache). `tile` computes `out[j][i] = W_{rows[i]} · x_{acts[j]}`.
fn block<const RM: usize, const RN: usize>(
    w: Weights<'_>,
    k: usize,
    x: &[f32],
    rows: std::ops::Range<usize>,
    acts: std::ops::Range<usize>,
    put: impl Fn(usize, usize, f32),
    tile: impl Fn(Weights<'_>, usize, [usize; RM], [&[f32]; RN]) -> [[f32; RM]; RN],
) {
    for j0 in acts.clone().step_by(RN) {
        let nj = (acts.end - j0).min(RN);
        let xs: [&[f32]; RN] = std::array::from_fn(|j| {
            let j = j0 + j.min(nj - 1);
            &x[j * k..(j + 1) * k]
        });
        for r0 in rows.clone().step_by(RM) {
            let nr = (rows.end - r0).min(RM);
            let rs: [usize; RM] = std::array::from_fn(|i| r0 + i.min(nr - 1));
            let v = tile(w, k, rs, xs);
            for (j, v) in v.iter().enumerate().take(nj) {
                for (i, &v) in v.iter().enumerate().take(nr) {
                    put(j0 + j, r0 + i, v);
                }
            }
        }
    }
}

/// A SIMD tile: the rows' pointers (checked to hold `k` values each) handed to `kernel`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn simd_tile<const RN: usize>(
    w: Weights<'_>,
    k: usize,
    rows: [usize; 4],
    xs: [&[f32]; RN],
    kernel: impl Fn(usize, [*const u8; 4], [*const f32; RN], &mut [[f32; 4]; RN]),
) -> [[f32; 4]; RN] {
    let (wb, width) = w.bytes();
    let wp = rows.map(|r| wb[r * k * width..(r + 1) * k * width].as_ptr());
    let xp = xs.map(|x| x[..k].as_ptr());
    let mut out = [[0f32; 4]; RN];
    kernel(k, wp, xp, &mut out);
    out
}

/// The portable tile: the same operations as the SIMD ones, lane by lane.
fn portable_tile<const RM: usize, const RN: usize>(
    w: Weights<'_>,
    k: usize,
    rows: [usize; RM],
    xs: [&[f32]; RN],
) -> [[f32; RM]; RN] {
    let (wb, width) = w.bytes();
    let mut acc = [[[0f32; 8]; RM]; RN];
    for l in (0..k).step_by(8) {
        let a: [[f32; 8]; RM] = std::array::from_fn(|i| {
            let p = &wb[(rows[i] * k + l) * width..][..8 * width];
            std::array::from_fn(|e| match w {
                Weights::F16(_) => f16_bits_to_f32(u16::from_le_bytes([p[2 * e], p[2 * e + 1]])),
                Weights::F32(_) => {
                    f32::from_le_bytes([p[4 * e], p[4 * e + 1], p[4 * e + 2], p[4 * e + 3]])
                }
            })
        });
        for (accj, x) in acc.iter_mut().zip(&xs) {
            let b = &x[l..l + 8];
            for (c, a) in accj.iter_mut().zip(&a) {
                for e in 0..8 {
                    c[e] = a[e].mul_add(b[e], c[e]);
                }
            }
        }
    }
    acc.map(|accj| accj.map(|c| sum_lanes8(&c)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{f16_tinyblas_order, f32_tinyblas_order};
    use crate::rng::Rng;

    fn bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// Every kernel equals the one-row kernels of the tinyBLAS orders bit for bit, on sizes that are no
    /// multiple of any tile or block (rows, activation rows) and several `k`, weights of mixed scales.
    #[test]
    fn tiles_equal_the_one_row_tinyblas_order_bit_for_bit() {
        let mut rng = Rng::new(31);
        for &(m, n, k) in &[
            (1, 1, 8),
            (5, 7, 24),
            (7, 2, 72),
            (13, 50, 136),
            (67, 53, 64),
            (130, 97, 8),
        ] {
            let wf: Vec<f32> = (0..m * k)
                .map(|i| rng.normal() * 10f32.powi(i as i32 % 3 - 1))
                .collect();
            let w16: Vec<u8> = wf
                .iter()
                .flat_map(|&v| super::super::float::f32_to_f16_bits(v).to_le_bytes())
                .collect();
            let w32 = bytes(&wf);
            let x: Vec<f32> = (0..n * k)
                .map(|_| half::f16::from_f32(rng.normal()).to_f32())
                .collect();
            for (weights, order) in [
                (Weights::F16(&w16), f16_tinyblas_order()),
                (Weights::F32(&w32), f32_tinyblas_order()),
            ] {
                let (wb, width) = weights.bytes();
                let want: Vec<u32> = (0..n)
                    .flat_map(|j| {
                        let xj = bytes(&x[j * k..(j + 1) * k]);
                        (0..m)
                            .map(|r| {
                                let row = &wb[r * k * width..(r + 1) * k * width];
                                let v = (order.portable)(k, row, &xj);
                                assert_eq!(v.to_bits(), (order.dot)(k, row, &xj).to_bits());
                                v.to_bits()
                            })
                            .collect::<Vec<_>>()
                    })
                    .collect();
                for kernel in Kernel::available() {
                    let mut y = vec![f32::NAN; n * m];
                    gemm_with(kernel, weights, m, k, &x, n, &mut y);
                    let got: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, want, "{kernel:?} {weights:?} m {m} n {n} k {k}");
                }
            }
        }
    }

    #[test]
    fn matmul_ordered_takes_the_tiles_with_the_same_sums() {
        // Through `matmul_ordered` (the encoders' and the engine's call): every output equals the order's
        // one-row dot product; a row length no multiple of 8 keeps the old path.
        let mut rng = Rng::new(32);
        for &(m, n, k) in &[(9, 5, 72), (6, 2, 20)] {
            let wf: Vec<f32> = (0..m * k).map(|_| rng.normal()).collect();
            let w16: Vec<u8> = wf
                .iter()
                .flat_map(|&v| super::super::float::f32_to_f16_bits(v).to_le_bytes())
                .collect();
            let x: Vec<f32> = (0..n * k)
                .map(|_| half::f16::from_f32(rng.normal()).to_f32())
                .collect();
            let w32 = bytes(&wf);
            for (ty, data, order) in [
                (crate::quant::GgmlType::F16, &w16, f16_tinyblas_order()),
                (crate::quant::GgmlType::F32, &w32, f32_tinyblas_order()),
            ] {
                let w = crate::matmul::QuantMatrix::new(ty, m, k, data).unwrap();
                assert_eq!(for_matmul(&w, Some(order), n).is_some(), k % 8 == 0);
                let mut y = vec![f32::NAN; n * m];
                crate::matmul::matmul_ordered(&w, &x, n, &mut y, Some(order));
                for j in 0..n {
                    let xj = bytes(&x[j * k..(j + 1) * k]);
                    for r in 0..m {
                        let want = (order.dot)(k, w.row(r), &xj);
                        assert_eq!(y[j * m + r].to_bits(), want.to_bits(), "{ty} {j} {r}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_sum_is_one_fused_accumulator_of_eight_lanes() {
        // Written out for one output: lane l takes elements l, l + 8, ... by fused multiply-adds.
        let k = 40;
        let wf: Vec<f32> = (0..k).map(|i| 1.0 + i as f32 * 1e-3).collect();
        let x: Vec<f32> = (0..k).map(|i| 1e4 * (-1f32).powi(i as i32) + 0.1).collect();
        let mut lanes = [0f32; 8];
        for i in 0..k {
            lanes[i % 8] = wf[i].mul_add(x[i], lanes[i % 8]);
        }
        let want = sum_lanes8(&lanes);
        for kernel in Kernel::available() {
            let mut y = [0f32];
            gemm_with(kernel, Weights::F32(&bytes(&wf)), 1, k, &x, 1, &mut y);
            assert_eq!(y[0].to_bits(), want.to_bits(), "{kernel:?}");
        }
    }
}
