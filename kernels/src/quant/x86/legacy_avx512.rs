//! The legacy formats (Q4_0, Q5_0, Q8_0 against Q8_0 activations; Q4_1, Q5_1 against Q8_1) sixteen
//! weight rows at a time with AVX-512 VNNI: each weight block is unpacked once ([`unpack`]) into eight vectors, one
//! per group of four values (`4g..4g+4`), holding that group's quants of all sixteen rows, made unsigned
//! by the format's offset. [`dot`] then takes one `vpdpbusd` per group and activation row for the group's
//! exact integer sums of all sixteen rows, and works each row in its own lane.
//!
//! The float work is the single-row order of `legacy_avx2::dot` lane for lane (see `quant::legacy`): for
//! every block, lane `g` of row `r` takes `fma(dx·dy, sum_g, lane_g)`, here lane `r` of accumulator `g`,
//! and the eight lanes end in `sum_lanes8`'s order; the formats with a minimum add their `fma(m, s, ·)`
//! chain after it, as the single-row kernel does. The results equal the single-row kernel bit for bit
//! (tested in `quant::kquants::tile`, through `KTile`).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use crate::quant::kquants::TILE_ROWS;
use crate::quant::legacy::LegacyKind;

/// One block of sixteen weight rows: `q[g][r]` the four quants `4g..4g+4` of row `r` (bytes in value
/// order, each plus the format's offset), `d[r]` the row's block scale and `m[r]` its minimum (formats
/// with one) as f32.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Block {
    q: [[u32; TILE_ROWS]; 8],
    d: [f32; TILE_ROWS],
    m: [f32; TILE_ROWS],
}

impl Block {
    pub(crate) fn zeroed() -> Block {
        Block {
            q: [[0; TILE_ROWS]; 8],
            d: [0.0; TILE_ROWS],
            m: [0.0; TILE_ROWS],
        }
    }
}

/// The offset that makes a format's quants unsigned (its `-8`, `-16`, or Q8_0's sign; the formats with a
/// minimum store them unsigned).
fn offset(kind: LegacyKind) -> i32 {
    match kind {
        LegacyKind::Q4_0 => 8,
        LegacyKind::Q5_0 => 16,
        LegacyKind::Q8_0 => 128,
        LegacyKind::Q4_1 | LegacyKind::Q5_1 => 0,
    }
}

/// The 32 quants of a block at `x`, each plus the format's offset (so in `0..=255`), in value order.
///
/// # Safety
/// The CPU must support AVX2; `x` must be readable for one block of `kind`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unsigned_quants(kind: LegacyKind, x: *const u8) -> __m256i {
    use super::legacy_avx2::{bits_to_bytes, nibbles};
    match kind {
        // Nibbles 0..16: q + 8.
        LegacyKind::Q4_0 => nibbles(x.add(2)),
        // Nibbles with the fifth bit from `qh`, 0..32: q + 16.
        LegacyKind::Q5_0 => _mm256_or_si256(
            nibbles(x.add(6)),
            _mm256_and_si256(bits_to_bytes(x.add(2)), _mm256_set1_epi8(0x10)),
        ),
        // Signed bytes with the sign bit flipped: q + 128.
        LegacyKind::Q8_0 => _mm256_xor_si256(
            _mm256_loadu_si256(x.add(2) as *const __m256i),
            _mm256_set1_epi8(0x80u8 as i8),
        ),
        // Unsigned nibbles after `d` and `m`.
        LegacyKind::Q4_1 => nibbles(x.add(4)),
        LegacyKind::Q5_1 => _mm256_or_si256(
            nibbles(x.add(8)),
            _mm256_and_si256(bits_to_bytes(x.add(4)), _mm256_set1_epi8(0x10)),
        ),
    }
}

/// Unpacks block `b` of the sixteen rows at `rows` (a row may repeat) into `out`.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL and VNNI with AVX2, FMA and F16C; every row must be readable
/// for `b + 1` blocks of `kind`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn unpack(
    kind: LegacyKind,
    rows: &[*const u8; TILE_ROWS],
    b: usize,
    out: &mut Block,
) {
    let mut words = [0u32; 8];
    for (r, &row) in rows.iter().enumerate() {
        let x = row.add(b * kind.block_bytes());
        out.d[r] = crate::quant::f16_at(std::slice::from_raw_parts(x, 2));
        if kind.has_min() {
            out.m[r] = crate::quant::f16_at(std::slice::from_raw_parts(x.add(2), 2));
        }
        _mm256_storeu_si256(words.as_mut_ptr() as *mut __m256i, unsigned_quants(kind, x));
        for (g, &w) in words.iter().enumerate() {
            out.q[g][r] = w;
        }
    }
}

/// One activation block's per-group correction: `-offset · Σ` of each group's four signed quants (at
/// `qs`), the term that the offset added to the weights put into `vpdpbusd`'s sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn corrections(qs: *const u8, offset: i32) -> [i32; 8] {
    if offset == 0 {
        return [0; 8];
    }
    let qs = _mm256_loadu_si256(qs as *const __m256i);
    // Pairs of signed bytes summed (times one), then pairs of pairs times the negated offset: exact.
    let pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), qs);
    let sums = _mm256_madd_epi16(pairs, _mm256_set1_epi16(-(offset as i16)));
    let mut out = [0i32; 8];
    _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, sums);
    out
}

/// `out[t][r]`: the single-row-order dot product of row `r` of `blocks` with the activations `acts[t]`
/// (Q8_0, or Q8_1 for the formats with a minimum), two activation rows at a time.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL and VNNI with AVX2, FMA and F16C; `blocks` must come from
/// [`unpack`] of `kind`; each of `acts` must be readable for `blocks.len()` activation blocks of
/// `kind`; `out.len() == acts.len()`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn dot(
    kind: LegacyKind,
    blocks: &[Block],
    acts: &[*const u8],
    out: &mut [[f32; TILE_ROWS]],
) {
    let off = offset(kind);
    let (act_bytes, min) = (kind.act_bytes(), kind.has_min());
    // Q8_0: `d`, then the quants; Q8_1: `d`, `s` (d·Σq), then the quants.
    let act_qs = if min { 4 } else { 2 };
    let mut t = 0;
    while t < acts.len() {
        // Two activation rows share each weight vector's load; a lone last row runs twice.
        let pair = [acts[t], acts[(t + 1).min(acts.len() - 1)]];
        let mut acc = [[_mm512_setzero_ps(); 8]; 2];
        let mut mins = [_mm512_setzero_ps(); 2];
        for (b, blk) in blocks.iter().enumerate() {
            let dx = _mm512_load_ps(blk.d.as_ptr());
            let ys: [*const u8; 2] = pair.map(|y| y.add(b * act_bytes));
            let ds: [__m512; 2] = ys.map(|y| {
                let dy = crate::quant::f16_at(std::slice::from_raw_parts(y, 2));
                _mm512_mul_ps(dx, _mm512_set1_ps(dy))
            });
            if min {
                // The single-row kernel's `fma(m, s, mins)`, block after block.
                let mx = _mm512_load_ps(blk.m.as_ptr());
                for i in 0..2 {
                    let s = crate::quant::f16_at(std::slice::from_raw_parts(ys[i].add(2), 2));
                    mins[i] = _mm512_fmadd_ps(mx, _mm512_set1_ps(s), mins[i]);
                }
            }
            let cs: [[i32; 8]; 2] = ys.map(|y| corrections(y.add(act_qs), off));
            for g in 0..8 {
                let w = _mm512_load_si512(blk.q[g].as_ptr() as *const __m512i);
                for i in 0..2 {
                    let y4 = (ys[i].add(act_qs + 4 * g) as *const i32).read_unaligned();
                    let sums =
                        _mm512_dpbusd_epi32(_mm512_set1_epi32(cs[i][g]), w, _mm512_set1_epi32(y4));
                    acc[i][g] = _mm512_fmadd_ps(ds[i], _mm512_cvtepi32_ps(sums), acc[i][g]);
                }
            }
        }
        for i in 0..2.min(acts.len() - t) {
            let a = &acc[i];
            // sum_lanes8: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
            let sum = _mm512_add_ps(
                _mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6])),
                _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7])),
            );
            // The single-row result adds its minimum terms (0.0 for the formats without), as `vec_dot`.
            let sum = _mm512_add_ps(sum, mins[i]);
            _mm512_storeu_ps(out[t + i].as_mut_ptr(), sum);
        }
        t += 2;
    }
}
