//! AVX-512 VNNI tile kernel of the K-quant batch order (ggml's tiled matmul, `kquants::tiled_step`):
//! sixteen weight rows against many activation rows, for Q2_K, Q3_K, Q4_K, Q5_K and Q6_K, and for IQ2_XS,
//! IQ3_XXS and IQ4_XS (`iquants::tiled`: their signed values as codes `value + 128`, the offset taken off
//! with the activation sums as for Q6_K).
//!
//! The row-by-row batch kernels unpack a weight super-block once per activation row and reduce each dot
//! product across a vector's lanes; here one super-block of sixteen rows is unpacked once for all the
//! activation rows of a prompt product into unsigned 8-bit codes laid out four values per row and lane
//! ([`Tile::w`]: lane `r` of vector `k` holds values `4k .. 4k + 4` of row `r`), so `vpdpbusd` with an
//! activation's four bytes broadcast gives the sixteen rows' sums at once and nothing is reduced across
//! lanes. Per 16-value group (32 for Q5_K) the sums are multiplied by the rows' scales (`vpdpwssd` where
//! the group's sum fits i16: Q2_K, Q3_K; `vpmulld` otherwise) into each row's exact integer total `T`; the
//! minimums (Q2_K, Q5_K) and the code offsets (Q3_K: 4, Q6_K: 32) meet the activation's 16-value sums with
//! `vpdpwssd`. Integers are exact whatever their grouping, so `T` and `M` are the same integers as
//! `kquants::block_lanes` gives; the float step is `tiled_step`'s, lane by lane (`xd·T`, less `xdmin·M`
//! fused, then `fma(r, yd, acc)`), so the results are the portable code's bit for bit.
//!
//! Callers check `super::super::has_avx512_vnni()` first.

use core::arch::x86_64::*;

use crate::quant::iquants::tiled::IqKind;
use crate::quant::kquants::{block_scales, scales_mins_k4, scales_q3_k, KKind, Q8K_BYTES, QK_K};

/// `[f(0), .., f(N − 1)]` for arrays of vectors and pointers, in place of `core::array::from_fn`:
/// its closure carries this file's target features, which `from_fn` itself lacks, so LLVM may not
/// inline one into the other and every element became a call with the vectors passed through memory.
macro_rules! each {
    (|$i:ident| $e:expr) => {{
        // SAFETY: the elements are SIMD vectors, integers or raw pointers, for which all-zero bits
        // are a value; every one is overwritten below.
        let mut a = unsafe { core::mem::zeroed::<[_; _]>() };
        #[allow(clippy::needless_range_loop)]
        for $i in 0..a.len() {
            a[$i] = $e;
        }
        a
    }};
}

/// Rows of a tile (the lanes of a `zmm` of i32).
pub(crate) const TILE_ROWS: usize = 16;

/// One super-block of sixteen weight rows, unpacked.
#[repr(C, align(64))]
pub(crate) struct Tile {
    /// Vector `k`: lane `r` (bytes `4r .. 4r + 4`) holds codes `4k .. 4k + 4` of row `r` (unsigned: the
    /// quant plus the format's offset).
    pub(super) w: [[u8; 64]; 64],
    /// Per 16-value group (Q5_K: 32-value sub-block, the first eight), the rows' scales: i32 for
    /// `vpmulld`, or `(scale, 0)` as i16 pairs for `vpdpwssd` (Q2_K, Q3_K).
    pub(super) sc: [[i32; TILE_ROWS]; 16],
    /// Per pair `p` of 16-value groups, the rows' i16 pair meeting the activation sums `2p`, `2p + 1`:
    /// minimums (Q2_K), the sub-block's minimum twice (Q5_K) or scales (Q3_K, Q6_K: the offset's term).
    pub(super) pair: [[i32; TILE_ROWS]; 8],
    pub(super) xd: [f32; TILE_ROWS],
    pub(super) xdmin: [f32; TILE_ROWS],
}

impl Tile {
    /// An all-zero tile, to be overwritten by [`unpack`].
    pub(crate) fn zeroed() -> Tile {
        Tile {
            w: [[0; 64]; 64],
            sc: [[0; TILE_ROWS]; 16],
            pair: [[0; TILE_ROWS]; 8],
            xd: [0.0; TILE_ROWS],
            xdmin: [0.0; TILE_ROWS],
        }
    }
}

/// `(lo, hi)` as the two i16 of an i32.
#[inline(always)]
fn pair16(lo: i32, hi: i32) -> i32 {
    (lo as i16 as u16 as u32 | (hi as i16 as u16 as u32) << 16) as i32
}

/// The 256 unsigned codes of one super-block `x` of `kind` (the quant plus the format's offset; Q3_K:
/// `low | high << 2`, Q5_K: `nibble | high << 4`, Q6_K: six bits), as `kquants::block_lanes` reads them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn codes(kind: KKind, x: *const u8, out: &mut [u8; QK_K]) {
    let o = out.as_mut_ptr();
    let st = |at: usize, v: __m256i| {
        // SAFETY: `at + 32 <= 256`, inside `out`.
        unsafe { _mm256_storeu_si256(o.add(at) as *mut __m256i, v) }
    };
    let ld = |at: usize| {
        // SAFETY: the callers' offsets stay inside the format's block, which `x` holds.
        unsafe { _mm256_loadu_si256(x.add(at) as *const __m256i) }
    };
    let m3 = _mm256_set1_epi8(3);
    let m15 = _mm256_set1_epi8(15);
    let one = _mm256_set1_epi8(1);
    match kind {
        KKind::Q2K | KKind::Q3K => {
            // Element 128h + 32s + l: bits 2s..2s+2 of qs[32h + l]; Q3_K adds bit (4h + s) of hmask[l]
            // as bit 2.
            let (qs, hm) = if kind == KKind::Q2K {
                (16, _mm256_setzero_si256())
            } else {
                (32, ld(0))
            };
            for h in 0..2 {
                let bits = ld(qs + 32 * h);
                for s in 0..4 {
                    let low = _mm256_and_si256(
                        _mm256_srl_epi16(bits, _mm_cvtsi32_si128(2 * s as i16 as i32)),
                        m3,
                    );
                    let b = (4 * h + s) as i16;
                    let high = _mm256_slli_epi16::<2>(_mm256_and_si256(
                        _mm256_srl_epi16(hm, _mm_cvtsi32_si128(b as i32)),
                        one,
                    ));
                    st(128 * h + 32 * s, _mm256_or_si256(low, high));
                }
            }
        }
        KKind::Q5K | KKind::Q4K => {
            // Sub-block 2c: low nibbles of qs[32c..32c+32], 2c+1 the high ones; Q5_K adds bit b of
            // qh[l] as bit 4 of element 32b + l.
            let (qs, hm) = if kind == KKind::Q4K {
                (16, _mm256_setzero_si256())
            } else {
                (48, ld(16))
            };
            for c in 0..4 {
                let v = ld(qs + 32 * c);
                let nib = [
                    _mm256_and_si256(v, m15),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(v), m15),
                ];
                for (k, n) in nib.into_iter().enumerate() {
                    let b = (2 * c + k) as i16;
                    let high = _mm256_slli_epi16::<4>(_mm256_and_si256(
                        _mm256_srl_epi16(hm, _mm_cvtsi32_si128(b as i32)),
                        one,
                    ));
                    st(64 * c + 32 * k, _mm256_or_si256(n, high));
                }
            }
        }
        KKind::Q6K => {
            for h in 0..2 {
                let (l0, l1, qh) = (ld(64 * h), ld(64 * h + 32), ld(128 + 32 * h));
                let hi = |s: i16| {
                    _mm256_slli_epi16::<4>(_mm256_and_si256(
                        _mm256_srl_epi16(qh, _mm_cvtsi32_si128(s as i32)),
                        m3,
                    ))
                };
                let at = 128 * h;
                st(at, _mm256_or_si256(_mm256_and_si256(l0, m15), hi(0)));
                st(at + 32, _mm256_or_si256(_mm256_and_si256(l1, m15), hi(2)));
                let n0 = _mm256_and_si256(_mm256_srli_epi16::<4>(l0), m15);
                let n1 = _mm256_and_si256(_mm256_srli_epi16::<4>(l1), m15);
                st(at + 64, _mm256_or_si256(n0, hi(4)));
                st(at + 96, _mm256_or_si256(n1, hi(6)));
            }
        }
    }
}

/// Unpacks super-block `b` of sixteen rows of `kind` into `tile`.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL and VNNI with AVX2, FMA and F16C; each of `rows` must be
/// readable for `b + 1` blocks of `kind`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn unpack(kind: KKind, rows: &[*const u8; TILE_ROWS], b: usize, tile: &mut Tile) {
    if kind == KKind::Q5K {
        unpack_q5k(rows, b, tile);
        return;
    }
    let mut all = [[0u8; QK_K]; TILE_ROWS];
    fill_rows(kind, rows, b, tile, &mut all);
    transpose(&all, tile);
}

/// The codes of super-block `b` of each of the sixteen rows into `all` (row by row), and their scales,
/// pairs, `xd` and `xdmin` into `tile`: all of [`unpack`] but the transpose (AVX2 only, so the AVX2 tile
/// kernel unpacks with it too).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; each of `rows` must be readable for `b + 1` blocks of
/// `kind`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn fill_rows(
    kind: KKind,
    rows: &[*const u8; TILE_ROWS],
    b: usize,
    tile: &mut Tile,
    all: &mut [[u8; QK_K]; TILE_ROWS],
) {
    let bb = kind.block_bytes();
    for (r, &row) in rows.iter().enumerate() {
        let x = row.add(b * bb);
        codes(kind, x, &mut all[r]);
        // SAFETY (of the slice): `x` holds one block of `bb` bytes.
        let xs = core::slice::from_raw_parts(x, bb);
        let (xd, xdmin) = block_scales(kind, xs);
        tile.xd[r] = xd;
        tile.xdmin[r] = xdmin;
        match kind {
            KKind::Q2K => {
                for (sc, &b) in tile.sc.iter_mut().zip(&xs[..16]) {
                    sc[r] = pair16((b & 15) as i32, 0);
                }
                for p in 0..8 {
                    tile.pair[p][r] = pair16((xs[2 * p] >> 4) as i32, (xs[2 * p + 1] >> 4) as i32);
                }
            }
            KKind::Q3K => {
                let s = scales_q3_k(&xs[96..108]);
                for (sc, &v) in tile.sc.iter_mut().zip(&s) {
                    sc[r] = pair16(v as i32 - 32, 0);
                }
                for p in 0..8 {
                    tile.pair[p][r] = pair16(s[2 * p] as i32 - 32, s[2 * p + 1] as i32 - 32);
                }
            }
            KKind::Q4K | KKind::Q5K => {
                let (sc, mn) = scales_mins_k4(&xs[4..16]);
                for c in 0..8 {
                    tile.sc[c][r] = sc[c] as i32;
                    tile.pair[c][r] = pair16(mn[c] as i32, mn[c] as i32);
                }
            }
            KKind::Q6K => {
                for (sc, &v) in tile.sc.iter_mut().zip(&xs[192..208]) {
                    sc[r] = v as i8 as i32;
                }
                for p in 0..8 {
                    tile.pair[p][r] =
                        pair16(xs[192 + 2 * p] as i8 as i32, xs[193 + 2 * p] as i8 as i32);
                }
            }
        }
    }
}

/// Q5_K's tile straight from the sixteen rows' blocks: each block's bytes transposed in registers (bytes
/// 0..64: the header, scales and high bits; 48..176: the nibbles), so the scales and minimums of sixteen
/// rows come out side by side and the codes are assembled in place, with no per-row code buffer. The
/// same codes and scales as [`codes`] and `kquants::scales_mins_k4` give (the tests compare the tile
/// kernel with the portable code).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unpack_q5k(rows: &[*const u8; TILE_ROWS], b: usize, tile: &mut Tile) {
    let bb = KKind::Q5K.block_bytes();
    // SAFETY: each row holds block `b` (the caller's contract).
    let x: [*const u8; TILE_ROWS] = each!(|r| unsafe { rows[r].add(b * bb) });
    // SAFETY: `at + 64 <= 176`, inside the block.
    let load = |at: usize| -> [__m512i; 16] {
        each!(|r| unsafe { _mm512_loadu_si512(x[r].add(at) as *const __m512i) })
    };
    // Dword 0: d | dmin << 16; 1..4: the twelve scale bytes; 4..12: qh.
    let head = transpose16(load(0));
    let dd = head[0];
    _mm512_store_ps(
        tile.xd.as_mut_ptr(),
        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd)),
    );
    _mm512_store_ps(
        tile.xdmin.as_mut_ptr(),
        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dd))),
    );
    // `scales_mins_k4`, four sub-blocks per byte lane: j < 4 from the low six bits of s[j] (scale) and
    // s[j + 4] (minimum); j >= 4 the nibbles of s[j + 4] with the top two bits of s[j − 4] / s[j] above.
    let (s0, s1, s2) = (head[1], head[2], head[3]);
    let b63 = _mm512_set1_epi8(63);
    let b15 = _mm512_set1_epi8(15);
    let b48 = _mm512_set1_epi8(48);
    let top = |v: __m512i| _mm512_and_si512(_mm512_srli_epi16::<2>(v), b48);
    let sc = [
        _mm512_and_si512(s0, b63),
        _mm512_or_si512(_mm512_and_si512(s2, b15), top(s0)),
    ];
    let mn = [
        _mm512_and_si512(s1, b63),
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(s2), b15), top(s1)),
    ];
    let byte = _mm512_set1_epi32(255);
    for c in 0..8 {
        let sh = _mm512_set1_epi32(8 * (c % 4) as i32);
        let s = _mm512_and_si512(_mm512_srlv_epi32(sc[c / 4], sh), byte);
        let m = _mm512_and_si512(_mm512_srlv_epi32(mn[c / 4], sh), byte);
        _mm512_store_si512(tile.sc[c].as_mut_ptr() as *mut __m512i, s);
        // pair16(m, m): the minimum meets both 16-value sums of the sub-block.
        _mm512_store_si512(
            tile.pair[c].as_mut_ptr() as *mut __m512i,
            _mm512_or_si512(m, _mm512_slli_epi32::<16>(m)),
        );
    }
    // Dword k = 16c + m of the codes: m < 8 the low nibbles of qs dword 8c + m with bit 2c of qh dword m
    // as bit 4; m >= 8 the high nibbles of qs dword 8c + m − 8 with bit 2c + 1 of qh dword m − 8.
    let one = _mm512_set1_epi8(1);
    for half in 0..2 {
        let qs = transpose16(load(48 + 64 * half));
        for (i, q) in qs.into_iter().enumerate() {
            let (c, m) = ((16 * half + i) / 8, i % 8);
            let qh = head[4 + m];
            let hb = |bit: usize| {
                let v = _mm512_srlv_epi16(qh, _mm512_set1_epi16(bit as i16));
                _mm512_slli_epi16::<4>(_mm512_and_si512(v, one))
            };
            let low = _mm512_or_si512(_mm512_and_si512(q, b15), hb(2 * c));
            let high = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16::<4>(q), b15),
                hb(2 * c + 1),
            );
            _mm512_store_si512(tile.w[16 * c + m].as_mut_ptr() as *mut __m512i, low);
            _mm512_store_si512(tile.w[16 * c + m + 8].as_mut_ptr() as *mut __m512i, high);
        }
    }
}

/// Unpacks super-block `b` of sixteen rows of an IQ format into `tile`: codes `value + 128`, the 16-value
/// groups' scales, the offset's pairs (`128·Σ scale·bsum` is taken off) and `xd`.
///
/// # Safety
/// As [`unpack`], for blocks of `kind`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn unpack_iq(
    kind: IqKind,
    rows: &[*const u8; TILE_ROWS],
    b: usize,
    tile: &mut Tile,
) {
    if kind == IqKind::Iq4Xs {
        unpack_iq4xs(rows, b, tile);
        return;
    }
    let bb = kind.block_bytes();
    let mut all = [[0u8; QK_K]; TILE_ROWS];
    for (r, &row) in rows.iter().enumerate() {
        // SAFETY (of the slice): row `r` holds block `b` of `bb` bytes.
        let xs = core::slice::from_raw_parts(row.add(b * bb), bb);
        let (sc, xd) = iq_codes(kind, xs, &mut all[r]);
        if sub32(kind) {
            // One scale per 32-value sub-block (both of its groups share it), as `dot` reads them.
            for (t, &s) in tile.sc.iter_mut().zip(sc.iter().step_by(2)) {
                t[r] = s;
            }
        } else {
            for (t, &s) in tile.sc.iter_mut().zip(&sc) {
                t[r] = s;
            }
        }
        for p in 0..8 {
            tile.pair[p][r] = pair16(sc[2 * p], sc[2 * p + 1]);
        }
        tile.xd[r] = xd;
        tile.xdmin[r] = 0.0;
    }
    transpose(&all, tile);
}

/// Whether IQ format `kind` has one scale per 32-value sub-block: its tiles then hold [`Tile::sc`] per
/// sub-block (the first eight) and [`dot`] scales sums of 32 values, half the multiplies of 16-value
/// groups (sums of 32 codes up to 255 times 128 still fit i32 with the scale, 32·255·128·31 < 2³¹/8).
pub(crate) fn sub32(kind: IqKind) -> bool {
    matches!(kind, IqKind::Iq3Xxs | IqKind::Iq4Xs)
}

/// IQ4_XS's tile straight from the sixteen rows' blocks, the rows' scales side by side in vectors and
/// the packed nibbles transposed in registers before they are looked up (`value + 128`), so no per-row
/// code buffer is written and read back: the same codes, scales and `xd` as [`iq_codes`] gives (and as
/// `iquants::tiled::block`, which the tests compare through the tile kernel).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unpack_iq4xs(rows: &[*const u8; TILE_ROWS], b: usize, tile: &mut Tile) {
    use crate::quant::iquants::tables::KVALUES_IQ4NL;
    let bb = IqKind::Iq4Xs.block_bytes();
    // SAFETY: each row holds block `b` (the caller's contract).
    let x: [*const u8; TILE_ROWS] = each!(|r| unsafe { rows[r].add(b * bb) });
    // Bytes 0..8 of each block: d (f16), scales_h (u16), scales_l (4 bytes).
    // SAFETY: the block is 136 bytes long.
    let head = |r: usize| unsafe { (x[r] as *const i64).read_unaligned() };
    let h: [__m512i; 2] = each!(|k| {
        let r = 8 * k;
        _mm512_set_epi64(
            head(r + 7),
            head(r + 6),
            head(r + 5),
            head(r + 4),
            head(r + 3),
            head(r + 2),
            head(r + 1),
            head(r),
        )
    });
    let lo = _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(_mm512_cvtepi64_epi32(h[0])),
        _mm512_cvtepi64_epi32(h[1]),
    );
    let sl = _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(_mm512_cvtepi64_epi32(_mm512_srli_epi64::<32>(h[0]))),
        _mm512_cvtepi64_epi32(_mm512_srli_epi64::<32>(h[1])),
    );
    let sh = _mm512_srli_epi32::<16>(lo);
    _mm512_store_ps(
        tile.xd.as_mut_ptr(),
        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(lo)),
    );
    _mm512_store_ps(tile.xdmin.as_mut_ptr(), _mm512_setzero_ps());
    let (m15, m3) = (_mm512_set1_epi32(15), _mm512_set1_epi32(3));
    for ib in 0..8 {
        // `iquants::tiled::iq4xs_scale`: low four bits from scales_l, high two from scales_h.
        let l = _mm512_and_si512(_mm512_srlv_epi32(sl, _mm512_set1_epi32(4 * ib as i32)), m15);
        let hb = _mm512_and_si512(_mm512_srlv_epi32(sh, _mm512_set1_epi32(2 * ib as i32)), m3);
        let ls = _mm512_sub_epi32(
            _mm512_or_si512(l, _mm512_slli_epi32::<4>(hb)),
            _mm512_set1_epi32(32),
        );
        // Per sub-block, as for every format of [`sub32`].
        _mm512_store_si512(tile.sc[ib].as_mut_ptr() as *mut __m512i, ls);
        // pair16(ls, ls): both groups of the sub-block share its scale.
        let pair = _mm512_or_si512(
            _mm512_and_si512(ls, _mm512_set1_epi32(0xffff)),
            _mm512_slli_epi32::<16>(ls),
        );
        _mm512_store_si512(tile.pair[ib].as_mut_ptr() as *mut __m512i, pair);
    }
    let mut lut = [0u8; 16];
    for (l, &v) in lut.iter_mut().zip(&KVALUES_IQ4NL) {
        *l = (v as i32 + 128) as u8;
    }
    let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(lut.as_ptr() as *const __m128i));
    let n15 = _mm512_set1_epi8(15);
    for half in 0..2 {
        // SAFETY: bytes `8 + 64·half .. 72 + 64·half` of the block: its packed nibbles.
        let v: [__m512i; 16] =
            each!(|r| unsafe { _mm512_loadu_si512(x[r].add(8 + 64 * half) as *const __m512i) });
        // Dword `d` of the nibbles (sub-block `d / 4`, bytes `4(d % 4) ..` of its sixteen) holds values
        // `4(d % 4) ..` of the sub-block in its low nibbles and `16 + 4(d % 4) ..` in its high ones.
        for (d, t) in transpose16(v).into_iter().enumerate() {
            let dd = 16 * half + d;
            let (ib, m) = (dd / 4, dd % 4);
            let low = _mm512_shuffle_epi8(lut, _mm512_and_si512(t, n15));
            let high = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16::<4>(t), n15));
            _mm512_store_si512(tile.w[8 * ib + m].as_mut_ptr() as *mut __m512i, low);
            _mm512_store_si512(tile.w[8 * ib + m + 4].as_mut_ptr() as *mut __m512i, high);
        }
    }
}

/// 32 codes `value + 128` from four grid entries of eight magnitudes (`g[l]`: values `8l .. 8l + 8`) and
/// their four sign bytes (bit `j` of `signs[l]`: value `8l + j` negative), as `iquants::tiled::block`
/// signs them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn signed32(g: [u64; 4], signs: [u8; 4], out: *mut u8) {
    let v = _mm256_set_epi64x(g[3] as i64, g[2] as i64, g[1] as i64, g[0] as i64);
    // Byte `8l + j` of the mask: bit `j` of sign byte `l`.
    let mask: __mmask32 = u32::from_le_bytes(signs);
    let neg = _mm256_sub_epi8(_mm256_setzero_si256(), v);
    let signed = _mm256_mask_blend_epi8(mask, v, neg);
    _mm256_storeu_si256(
        out as *mut __m256i,
        _mm256_add_epi8(signed, _mm256_set1_epi8(-128)),
    );
}

/// The codes `value + 128` of IQ super-block `b` into `out`, and the 16-value groups' scales and `xd`:
/// the values, scales and `xd` of `iquants::tiled::block` (its tests compare the two through the tile
/// kernel), with the sign and level lookups in vectors.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn iq_codes(kind: IqKind, b: &[u8], out: &mut [u8; QK_K]) -> ([i32; 16], f32) {
    use crate::quant::iquants::tables::{IQ2XS_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS};
    let o = out.as_mut_ptr();
    let mut sc = [0i32; 16];
    let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let f16 = crate::quant::f16_at(b);
    match kind {
        IqKind::Iq2Xs => {
            for ib in 0..8 {
                let q: [u16; 4] = each!(|l| u16_at(2 + 8 * ib + 2 * l));
                let g = q.map(|q| IQ2XS_GRID[(q & 511) as usize]);
                let signs = q.map(|q| KSIGNS_IQ2XS[(q >> 9) as usize]);
                signed32(g, signs, o.add(32 * ib));
                sc[2 * ib] = 2 * (b[66 + ib] & 15) as i32 + 1;
                sc[2 * ib + 1] = 2 * (b[66 + ib] >> 4) as i32 + 1;
            }
            (sc, f16 * 0.125)
        }
        IqKind::Iq3Xxs => {
            for ib in 0..8 {
                let aux = u32_at(66 + 4 * ib);
                let ls = 2 * (aux >> 28) as i32 + 1;
                sc[2 * ib] = ls;
                sc[2 * ib + 1] = ls;
                let g: [u64; 4] = each!(|l| {
                    let g1 = IQ3XXS_GRID[b[2 + 8 * ib + 2 * l] as usize] as u64;
                    let g2 = IQ3XXS_GRID[b[3 + 8 * ib + 2 * l] as usize] as u64;
                    g1 | g2 << 32
                });
                let signs: [u8; 4] = each!(|l| KSIGNS_IQ2XS[(aux >> (7 * l) & 127) as usize]);
                signed32(g, signs, o.add(32 * ib));
            }
            (sc, f16 * 0.25)
        }
        // Unpacked by `unpack_iq4xs`, straight from the blocks.
        IqKind::Iq4Xs => unreachable!("IQ4_XS tiles are unpacked by unpack_iq4xs"),
    }
}

/// `tile.w` from the sixteen rows' codes: lane `r` of vector `k` = dword `k` of row `r`, by four
/// register transposes of 16×16 dwords (a gather per vector was a third of the unpacking).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn transpose(all: &[[u8; QK_K]; TILE_ROWS], tile: &mut Tile) {
    for q in 0..4 {
        let v: [__m512i; 16] = each!(|r| {
            // SAFETY: bytes `64q .. 64q + 64` of row `r`, inside `all`.
            unsafe { _mm512_loadu_si512(all[r].as_ptr().add(64 * q) as *const __m512i) }
        });
        let t = transpose16(v);
        for (c, v) in t.into_iter().enumerate() {
            _mm512_store_si512(tile.w[16 * q + c].as_mut_ptr() as *mut __m512i, v);
        }
    }
}

/// Lane `r` of output `c` = lane `c` of input `r` (sixteen vectors of sixteen dwords): dwords, then
/// qwords interleaved within 128-bit lanes (4×4 blocks transposed in each lane), then the 128-bit lanes
/// of four vectors transposed in two steps; 64 shuffles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
    // a[2i], a[2i+1]: rows 2i and 2i+1 interleaved (lane L: their dwords 4L, 4L+1 / 4L+2, 4L+3).
    let a: [__m512i; 16] = each!(|k| {
        let (x, y) = (r[k & !1], r[k | 1]);
        if k % 2 == 0 {
            _mm512_unpacklo_epi32(x, y)
        } else {
            _mm512_unpackhi_epi32(x, y)
        }
    });
    // b[4i + j], lane L: dword 4L + j of rows 4i .. 4i + 4.
    let b: [__m512i; 16] = each!(|k| {
        let (i, j) = (k / 4, k % 4);
        let (x, y) = (a[4 * i + j / 2], a[4 * i + j / 2 + 2]);
        if j % 2 == 0 {
            _mm512_unpacklo_epi64(x, y)
        } else {
            _mm512_unpackhi_epi64(x, y)
        }
    });
    // Output 4L + j takes lane L of b[j], b[4 + j], b[8 + j], b[12 + j].
    let mut out = [_mm512_setzero_si512(); 16];
    for j in 0..4 {
        let c0 = _mm512_shuffle_i32x4::<0x44>(b[j], b[4 + j]);
        let c1 = _mm512_shuffle_i32x4::<0xEE>(b[j], b[4 + j]);
        let c2 = _mm512_shuffle_i32x4::<0x44>(b[8 + j], b[12 + j]);
        let c3 = _mm512_shuffle_i32x4::<0xEE>(b[8 + j], b[12 + j]);
        out[j] = _mm512_shuffle_i32x4::<0x88>(c0, c2);
        out[4 + j] = _mm512_shuffle_i32x4::<0xDD>(c0, c2);
        out[8 + j] = _mm512_shuffle_i32x4::<0x88>(c1, c3);
        out[12 + j] = _mm512_shuffle_i32x4::<0xDD>(c1, c3);
    }
    out
}

/// The float orders [`dot`] finishes the exact totals in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Order {
    /// ggml's tiled matmul (`kquants::tiled_step`), every format.
    Tiled,
    /// Q4_K's repacked gemv (the single-row order): per super-block `acc = fma(T, xd·yd, acc)`,
    /// `accm = fma(M, xdmin·yd, accm)`, the result `acc − accm`.
    Q4kGemv,
    /// Q4_K's repacked gemm: the gemv's steps per pair of 32-value sub-blocks.
    Q4kGemm4,
}

/// Adds super-block `tile`'s step to the accumulators of `NT` activation rows: `acc[t]` (sixteen f32,
/// one per row of the tile, then for the Q4_K orders sixteen of the minimums) for the Q8_K block at
/// `ys[t]`.
///
/// `K`: 0 Q2_K, 1 Q3_K, 2 Q4_K, 3 Q5_K, 4 Q6_K, 5 the IQ formats. `ORD`: 0 [`Order::Tiled`], 1 [`Order::Q4kGemv`],
/// 2 [`Order::Q4kGemm4`] (Q4_K only).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn step<const K: u8, const ORD: u8, const NT: usize>(
    tile: &Tile,
    ys: [*const u8; NT],
    acc: [*mut f32; NT],
) {
    // Q4_K/Q5_K: eight sub-blocks of 32, sums up to 32·31·128 (scaled by `vpmulld`); the others sixteen
    // groups of 16; Q2_K and Q3_K sums fit i16 (16·7·128), so `vpdpwssd` scales them.
    // K = 5: the IQ formats (codes `value + 128`, sums up to 16·255·128: `vpmulld`); K = 6 those with
    // a scale per 32 values ([`sub32`]).
    let sub32 = K == 2 || K == 3 || K == 6;
    let (groups, per_group) = if sub32 { (8, 8) } else { (16, 4) };
    let dpw = K <= 1;
    let zero = _mm512_setzero_si512();
    let xd = _mm512_load_ps(tile.xd.as_ptr());
    let xdmin = _mm512_load_ps(tile.xdmin.as_ptr());
    let yd: [__m512; NT] = each!(|t| _mm512_set1_ps((ys[t] as *const f32).read_unaligned()));
    // The Q4_K orders: `xd·yd` and `xdmin·yd` per row, rounded as the scalar code rounds them.
    let d: [__m512; NT] = each!(|t| _mm512_mul_ps(xd, yd[t]));
    let dmin: [__m512; NT] = each!(|t| _mm512_mul_ps(xdmin, yd[t]));
    let mut tot = [zero; NT];
    let mut m = [zero; NT];
    // The Q4_K orders' fused steps: row `t`'s sums (`tot`, `m`) scaled into its two accumulators.
    macro_rules! fold_q4k {
        ($t:expr) => {{
            let t = $t;
            let a = _mm512_loadu_ps(acc[t]);
            let am = _mm512_loadu_ps(acc[t].add(TILE_ROWS));
            let a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot[t]), d[t], a);
            let am = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m[t]), dmin[t], am);
            _mm512_storeu_ps(acc[t], a);
            _mm512_storeu_ps(acc[t].add(TILE_ROWS), am);
        }};
    }
    // Two groups at once: sixteen independent `vpdpbusd` chains for eight activation rows (this core
    // issues two a cycle at a latency of about four, so eight chains left half of it idle; 64 tokens of
    // Q5_K 2048×768: see BENCHMARKS.md, issue 24). Integer sums, so the grouping changes no bit.
    for g in (0..groups).step_by(2) {
        let mut a0 = [zero; NT];
        let mut a1 = [zero; NT];
        for k in 0..per_group {
            let k0 = g * per_group + k;
            let k1 = k0 + per_group;
            let w0 = _mm512_load_si512(tile.w[k0].as_ptr() as *const __m512i);
            let w1 = _mm512_load_si512(tile.w[k1].as_ptr() as *const __m512i);
            for t in 0..NT {
                let q0 = (ys[t].add(4 + 4 * k0) as *const i32).read_unaligned();
                let q1 = (ys[t].add(4 + 4 * k1) as *const i32).read_unaligned();
                a0[t] = _mm512_dpbusd_epi32(a0[t], w0, _mm512_set1_epi32(q0));
                a1[t] = _mm512_dpbusd_epi32(a1[t], w1, _mm512_set1_epi32(q1));
            }
        }
        let s0 = _mm512_load_si512(tile.sc[g].as_ptr() as *const __m512i);
        let s1 = _mm512_load_si512(tile.sc[g + 1].as_ptr() as *const __m512i);
        for t in 0..NT {
            tot[t] = if dpw {
                _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(tot[t], a0[t], s0), a1[t], s1)
            } else {
                let p =
                    _mm512_add_epi32(_mm512_mullo_epi32(a0[t], s0), _mm512_mullo_epi32(a1[t], s1));
                _mm512_add_epi32(tot[t], p)
            };
        }
        if ORD == 2 {
            // Sub-blocks g and g + 1's minimum terms, then the pair's fused steps.
            let pr0 = _mm512_load_si512(tile.pair[g].as_ptr() as *const __m512i);
            let pr1 = _mm512_load_si512(tile.pair[g + 1].as_ptr() as *const __m512i);
            for t in 0..NT {
                let bs0 = (ys[t].add(260 + 4 * g) as *const i32).read_unaligned();
                let bs1 = (ys[t].add(264 + 4 * g) as *const i32).read_unaligned();
                m[t] = _mm512_dpwssd_epi32(m[t], pr0, _mm512_set1_epi32(bs0));
                m[t] = _mm512_dpwssd_epi32(m[t], pr1, _mm512_set1_epi32(bs1));
            }
            for t in 0..NT {
                fold_q4k!(t);
                tot[t] = zero;
                m[t] = zero;
            }
        }
    }
    if ORD == 2 {
        return;
    }
    for p in 0..8 {
        let pr = _mm512_load_si512(tile.pair[p].as_ptr() as *const __m512i);
        for t in 0..NT {
            let bs = (ys[t].add(260 + 4 * p) as *const i32).read_unaligned();
            m[t] = _mm512_dpwssd_epi32(m[t], pr, _mm512_set1_epi32(bs));
        }
    }
    for t in 0..NT {
        if ORD == 1 {
            fold_q4k!(t);
            continue;
        }
        let total = match K {
            1 => _mm512_sub_epi32(tot[t], _mm512_slli_epi32::<2>(m[t])),
            4 => _mm512_sub_epi32(tot[t], _mm512_slli_epi32::<5>(m[t])),
            5 | 6 => _mm512_sub_epi32(tot[t], _mm512_slli_epi32::<7>(m[t])),
            _ => tot[t],
        };
        let mut r = _mm512_mul_ps(xd, _mm512_cvtepi32_ps(total));
        if matches!(K, 0 | 2 | 3) {
            // fma(−xdmin, M, r), as `tiled_step`.
            r = _mm512_fnmadd_ps(xdmin, _mm512_cvtepi32_ps(m[t]), r);
        }
        let a = _mm512_loadu_ps(acc[t]);
        _mm512_storeu_ps(acc[t], _mm512_fmadd_ps(r, yd[t], a));
    }
}

/// The accumulators of one activation row: sixteen rows' sums, then (Q4_K orders) their minimum sums.
type Acc = [f32; 2 * TILE_ROWS];

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn steps<const K: u8, const ORD: u8>(
    tile: &Tile,
    b: usize,
    acts: &[*const u8],
    accs: &mut [Acc],
) {
    let y = |t: usize| acts[t].add(b * Q8K_BYTES);
    let mut t = 0;
    while t + 8 <= acts.len() {
        let acc: [*mut f32; 8] = each!(|i| accs[t + i].as_mut_ptr());
        step::<K, ORD, 8>(tile, each!(|i| y(t + i)), acc);
        t += 8;
    }
    if t + 4 <= acts.len() {
        let acc: [*mut f32; 4] = each!(|i| accs[t + i].as_mut_ptr());
        step::<K, ORD, 4>(tile, each!(|i| y(t + i)), acc);
        t += 4;
    }
    while t < acts.len() {
        step::<K, ORD, 1>(tile, [y(t)], [accs[t].as_mut_ptr()]);
        t += 1;
    }
}

/// `out[t][r]` = the dot product in `order` of tile row `r` with activation row `acts[t]`, over the
/// `tiles.len()` unpacked super-blocks in order (each super-block's steps added to running sums from
/// 0.0, as the portable code of each order).
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL and VNNI with AVX2, FMA and F16C; each of `acts` must be
/// readable for `tiles.len()` Q8_K blocks; `out.len() == acts.len()`; the Q4_K orders only with Q4_K
/// tiles; `iq` the format of tiles of [`unpack_iq`] (their order is the tiled one; `kind` is then not
/// read).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn dot(
    kind: KKind,
    iq: Option<IqKind>,
    order: Order,
    tiles: &[Tile],
    acts: &[*const u8],
    out: &mut [[f32; TILE_ROWS]],
) {
    // On the stack: at most `KTile::MAX_ACTS` rows (the caller asserts it).
    let mut all = [[0f32; 2 * TILE_ROWS]; crate::quant::kquants::KTile::MAX_ACTS];
    let accs = &mut all[..acts.len()];
    for (b, tile) in tiles.iter().enumerate() {
        if let Some(iq) = iq {
            if sub32(iq) {
                steps::<6, 0>(tile, b, acts, accs);
            } else {
                steps::<5, 0>(tile, b, acts, accs);
            }
            continue;
        }
        match (kind, order) {
            (KKind::Q2K, _) => steps::<0, 0>(tile, b, acts, accs),
            (KKind::Q3K, _) => steps::<1, 0>(tile, b, acts, accs),
            (KKind::Q4K, Order::Tiled) => steps::<2, 0>(tile, b, acts, accs),
            (KKind::Q4K, Order::Q4kGemv) => steps::<2, 1>(tile, b, acts, accs),
            (KKind::Q4K, Order::Q4kGemm4) => steps::<2, 2>(tile, b, acts, accs),
            (KKind::Q5K, _) => steps::<3, 0>(tile, b, acts, accs),
            (KKind::Q6K, _) => steps::<4, 0>(tile, b, acts, accs),
        }
    }
    for (o, a) in out.iter_mut().zip(accs.iter()) {
        for r in 0..TILE_ROWS {
            o[r] = if order == Order::Tiled {
                a[r]
            } else {
                a[r] - a[TILE_ROWS + r]
            };
        }
    }
}
