//! Q4_K's kernels taking eight activation rows per weight row ([`dot8`]), for the orders that have them.

use super::{
    check_lengths, q4k_vec_dot_gemm4_portable, vec_dot_portable, KKind, Q4K_GEMM4, Q8K_BYTES,
};
use crate::quant::{BatchDot, GgmlType};

/// Eight dot products of one weight row with eight activation rows, each in one order.
pub type Dot8 = fn(n: usize, row: &[u8], acts: [&[u8]; 8]) -> [f32; 8];

/// The kernel taking eight activation rows at once for one weight row of `ty` in `order` (a batch order
/// from [`crate::quant::batch_dot`], or `None`: the single-row order), where there is one: Q4_K's single-row
/// and repacked-gemm orders on AVX2 (each super-block unpacked once for the eight; the same results as
/// the four-row kernels). Not on AVX-512 machines, whose four-row kernels are faster there.
pub fn dot8(ty: GgmlType, order: Option<&'static BatchDot>) -> Option<Dot8> {
    if ty != GgmlType::Q4_K || !super::super::has_avx2_fma() || super::super::has_avx512_vnni() {
        return None;
    }
    match order {
        None => Some(q4k_single_row_x8),
        // The statics are the orders themselves, so their addresses identify them.
        Some(b) if std::ptr::eq(b, &Q4K_GEMM4) => Some(q4k_gemm4_x8),
        Some(_) => None,
    }
}

/// The block count of a Q4_K row and eight activation rows of `n` values (checked).
#[inline(always)]
fn q4k_blocks8(n: usize, row: &[u8], acts: &[&[u8]; 8]) -> usize {
    let nb = check_lengths(KKind::Q4K, n, row, acts[0]);
    assert!(
        acts.iter().all(|a| a.len() >= nb * Q8K_BYTES),
        "Q4_K activations shorter than {n} values"
    );
    nb
}

fn q4k_single_row_x8(n: usize, row: &[u8], acts: [&[u8]; 8]) -> [f32; 8] {
    #[cfg(target_arch = "x86_64")]
    if super::super::has_avx2_fma() {
        let nb = q4k_blocks8(n, row, &acts);
        // SAFETY: `has_avx2_fma` confirmed AVX2, FMA and F16C; the row and the eight activation rows
        // hold `nb` blocks each (checked), all the kernel reads.
        return unsafe {
            super::super::x86::kquants_avx2::q4k_dot_x8(nb, row.as_ptr(), acts.map(|a| a.as_ptr()))
        };
    }
    acts.map(|a| vec_dot_portable(KKind::Q4K, n, row, a))
}

fn q4k_gemm4_x8(n: usize, row: &[u8], acts: [&[u8]; 8]) -> [f32; 8] {
    #[cfg(target_arch = "x86_64")]
    if super::super::has_avx2_fma() {
        let nb = q4k_blocks8(n, row, &acts);
        // SAFETY: as in `q4k_single_row_x8`.
        return unsafe {
            super::super::x86::kquants_avx2::q4k_dot_gemm4_x8(
                nb,
                row.as_ptr(),
                acts.map(|a| a.as_ptr()),
            )
        };
    }
    acts.map(|a| q4k_vec_dot_gemm4_portable(n, row, a))
}
