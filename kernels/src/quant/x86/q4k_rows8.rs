//! Q4_K prompt products on AVX2 with eight weight rows side by side, from a copy of the rows laid out
//! for it ([`repack`]): llama.cpp's repacked-Q4_K idea, with the same results as the row-by-row kernels.
//!
//! Why: in the row-by-row layout a sub-block of 32 values is one 32-byte vector, so every `maddubs`
//! (32 products) needs its own `madd` with the sub-block's scale, and each token reloads the weights it
//! multiplies. With eight rows interleaved in chunks of eight bytes, one vector holds the same eight
//! positions of four rows: four `maddubs` over the sub-block's four chunks add up in i16
//! (|sum| ≤ 4 · 2 · 15 · 128 = 15,360) before one `madd` applies the four rows' scales (ten multiplies per
//! 256 products instead of sixteen), and each weight vector, loaded once, serves two activation rows.
//! Measured on the development machine (Zen 3, one thread, `cargo bench -p poly-kernels --bench
//! prompt_matmul`): the one-activation-row form alone was no faster than the row-by-row kernels; with two
//! rows per load a 768×2048 product of 512 tokens took 18–21 ms against 26–50 ms.
//!
//! The integer totals are exact, so regrouping them changes nothing, and each row's float steps are those
//! of the order asked for: the single-row order (one fused step per super-block on its integer total,
//! [`super::kquants_avx2::q4k_dot_x4`]) or the repacked-gemm order (one per pair of sub-blocks,
//! [`super::kquants_avx2::q4k_dot_gemm4`]). Results equal those kernels' bit for bit (tested).
//!
//! The copy is made per product by the task that owns the rows (one pass over its weights, which the
//! token blocks then read many times); the nibbles are unpacked to bytes there, so the inner loop only
//! loads.

use super::kquants_avx2::q4k_scales_mins;
use core::arch::x86_64::*;

/// Bytes of one repacked super-block of eight rows: `xd`, `xdmin` (8 f32 each), the scales spread for
/// `madd` (8 sub-blocks × 2 halves × 16 i16), the minimum pairs (4 pairs × 8 rows × 2 i16), then the
/// quants as bytes: low nibbles then high nibbles, each `[pair 4][chunk 4][half 2][row 4][8]`.
pub(crate) const PACKED_BYTES: usize = 64 + SCALES_BYTES + MINS_BYTES + 2 * QUANT_BYTES;
const SCALES_BYTES: usize = 8 * 2 * 32;
const MINS_BYTES: usize = 4 * 32;
const QUANT_BYTES: usize = 4 * 4 * 2 * 32;
const OFF_SCALES: usize = 64;
const OFF_MINS: usize = OFF_SCALES + SCALES_BYTES;
const OFF_LO: usize = OFF_MINS + MINS_BYTES;
const OFF_HI: usize = OFF_LO + QUANT_BYTES;

/// Q4_K super-block bytes and Q8_K activation block bytes.
const Q4K_BYTES: usize = 144;
const Q8K_BYTES: usize = 292;

/// Lays out eight Q4_K rows (`rows[r]`: `nb` super-blocks each) for [`q4k_rows8`], into `out`
/// (`nb · PACKED_BYTES` bytes).
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn repack(nb: usize, rows: [&[u8]; 8], out: &mut [u8]) {
    assert!(out.len() >= nb * PACKED_BYTES, "repack: output too short");
    assert!(
        rows.iter().all(|r| r.len() >= nb * Q4K_BYTES),
        "repack: a row shorter than {nb} super-blocks"
    );
    let m4 = _mm256_set1_epi8(0x0F);
    for b in 0..nb {
        // Every write below lands in super-block b's PACKED_BYTES of `out` (each offset is below
        // PACKED_BYTES), every read in row r's super-block b (both lengths asserted above).
        let o = out[b * PACKED_BYTES..(b + 1) * PACKED_BYTES].as_mut_ptr();
        for (r, row) in rows.iter().enumerate() {
            let x = row[b * Q4K_BYTES..(b + 1) * Q4K_BYTES].as_ptr();
            let dd = _mm_cvtph_ps(_mm_cvtsi32_si128((x as *const i32).read_unaligned()));
            (o.add(4 * r) as *mut f32).write_unaligned(_mm_cvtss_f32(dd));
            (o.add(32 + 4 * r) as *mut f32).write_unaligned(_mm_cvtss_f32(_mm_movehdup_ps(dd)));
            let (sc, m) = q4k_scales_mins(x);
            let (sc, m) = (sc.to_le_bytes(), m.to_le_bytes());
            let (h, rr) = (r / 4, r % 4);
            for (c, &sc) in sc.iter().enumerate() {
                // Sub-block c, half h: row rr's scale in its four i16 lanes.
                let at = OFF_SCALES + (c * 2 + h) * 32 + rr * 8;
                (o.add(at) as *mut u64).write_unaligned(sc as u64 * 0x0001_0001_0001_0001);
            }
            for j in 0..4 {
                // Pair j: row r's (min 2j, min 2j+1) as two i16 lanes.
                let pair = m[2 * j] as u32 | (m[2 * j + 1] as u32) << 16;
                (o.add(OFF_MINS + j * 32 + r * 4) as *mut u32).write_unaligned(pair);
            }
            // Pair j's 32 quant bytes: chunk k (8 bytes) of each nibble plane goes to its slot.
            for j in 0..4 {
                let bits = _mm256_loadu_si256(x.add(16 + 32 * j) as *const __m256i);
                let planes = [
                    _mm256_and_si256(bits, m4),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4),
                ];
                for (plane, off) in planes.into_iter().zip([OFF_LO, OFF_HI]) {
                    let (lo128, hi128) = (
                        _mm256_castsi256_si128(plane),
                        _mm256_extracti128_si256::<1>(plane),
                    );
                    let chunks = [
                        lo128,
                        _mm_unpackhi_epi64(lo128, lo128),
                        hi128,
                        _mm_unpackhi_epi64(hi128, hi128),
                    ];
                    for (k, chunk) in chunks.into_iter().enumerate() {
                        let at = off + ((j * 4 + k) * 2 + h) * 32 + rr * 8;
                        _mm_storel_epi64(o.add(at) as *mut __m128i, chunk);
                    }
                }
            }
        }
    }
}

/// The dot products of eight repacked rows (`packed`, from [`repack`]) with `T` Q8_K activation rows `ys`
/// of `nb` blocks (each weight vector loaded once for the `T`): in the repacked-gemm order when `GEMM`,
/// else in the single-row order.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `packed` holds `nb · PACKED_BYTES` bytes and each of `ys` `nb`
/// Q8_K blocks.
// The indices (pair, chunk, half, token) address several arrays and offsets at once.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4k_rows8<const GEMM: bool, const T: usize>(
    nb: usize,
    packed: *const u8,
    ys: [*const u8; T],
) -> [[f32; 8]; T] {
    let mut acc = [_mm256_setzero_ps(); T];
    let mut acc_min = [_mm256_setzero_ps(); T];
    for b in 0..nb {
        let p = packed.add(b * PACKED_BYTES);
        let xd = _mm256_loadu_ps(p as *const f32);
        let xdmin = _mm256_loadu_ps(p.add(32) as *const f32);
        let mut d = [_mm256_setzero_ps(); T];
        let mut dmin = [_mm256_setzero_ps(); T];
        let mut q8 = [std::ptr::null::<u8>(); T];
        for t in 0..T {
            let yb = ys[t].add(b * Q8K_BYTES);
            let yd = _mm256_set1_ps((yb as *const f32).read_unaligned());
            d[t] = _mm256_mul_ps(xd, yd);
            dmin[t] = _mm256_mul_ps(xdmin, yd);
            q8[t] = yb.add(4);
        }
        let mut isum = [_mm256_setzero_si256(); T];
        let mut msum = [_mm256_setzero_si256(); T];
        for j in 0..4 {
            let mut halves = [[_mm256_setzero_si256(); 2]; T];
            for h in 0..2 {
                let mut p_lo = [_mm256_setzero_si256(); T];
                let mut p_hi = [_mm256_setzero_si256(); T];
                for k in 0..4 {
                    let at = ((j * 4 + k) * 2 + h) * 32;
                    let w_lo = _mm256_loadu_si256(p.add(OFF_LO + at) as *const __m256i);
                    let w_hi = _mm256_loadu_si256(p.add(OFF_HI + at) as *const __m256i);
                    for t in 0..T {
                        let a_lo = _mm256_set1_epi64x(
                            (q8[t].add(64 * j + 8 * k) as *const i64).read_unaligned(),
                        );
                        let a_hi = _mm256_set1_epi64x(
                            (q8[t].add(64 * j + 32 + 8 * k) as *const i64).read_unaligned(),
                        );
                        p_lo[t] = _mm256_add_epi16(p_lo[t], _mm256_maddubs_epi16(w_lo, a_lo));
                        p_hi[t] = _mm256_add_epi16(p_hi[t], _mm256_maddubs_epi16(w_hi, a_hi));
                    }
                }
                let s_lo =
                    _mm256_loadu_si256(p.add(OFF_SCALES + (2 * j * 2 + h) * 32) as *const __m256i);
                let s_hi = _mm256_loadu_si256(
                    p.add(OFF_SCALES + ((2 * j + 1) * 2 + h) * 32) as *const __m256i
                );
                for t in 0..T {
                    halves[t][h] = _mm256_add_epi32(
                        _mm256_madd_epi16(p_lo[t], s_lo),
                        _mm256_madd_epi16(p_hi[t], s_hi),
                    );
                }
            }
            let mins = _mm256_loadu_si256(p.add(OFF_MINS + j * 32) as *const __m256i);
            for t in 0..T {
                // Lanes 2r, 2r+1 of half h are row 4h + r: one round of pairwise adds gives
                // [r0 r1 r4 r5 | r2 r3 r6 r7], one permute the rows in order.
                let pair = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_hadd_epi32(
                    halves[t][0],
                    halves[t][1],
                ));
                // The minimum pair of each row: (min 2j, min 2j+1) · (bsum 2j, bsum 2j+1), the
                // activation's 16-value sums added in pairs (|sum| ≤ 32 · 128 fits i16).
                let bsums = ys[t].add(b * Q8K_BYTES + 260) as *const i16;
                let b2 = |c: usize| {
                    bsums.add(2 * c).read_unaligned() as i32
                        + bsums.add(2 * c + 1).read_unaligned() as i32
                };
                let bs = (b2(2 * j) as u32 & 0xFFFF) | ((b2(2 * j + 1) as u32) << 16);
                let mpair = _mm256_madd_epi16(mins, _mm256_set1_epi32(bs as i32));
                if GEMM {
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair), d[t], acc[t]);
                    acc_min[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mpair), dmin[t], acc_min[t]);
                } else {
                    isum[t] = _mm256_add_epi32(isum[t], pair);
                    msum[t] = _mm256_add_epi32(msum[t], mpair);
                }
            }
        }
        if !GEMM {
            for t in 0..T {
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), d[t], acc[t]);
                acc_min[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum[t]), dmin[t], acc_min[t]);
            }
        }
    }
    let mut out = [[0f32; 8]; T];
    for t in 0..T {
        _mm256_storeu_ps(out[t].as_mut_ptr(), _mm256_sub_ps(acc[t], acc_min[t]));
    }
    out
}
