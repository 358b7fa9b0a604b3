//! AVX2 tile kernel of the K-quant batch orders, for machines without AVX-512 VNNI: the tiles of
//! `ktile_avx512` (sixteen weight rows of one super-block unpacked once for every activation row of a
//! prompt product, lane `r` of vector `k` holding codes `4k .. 4k + 4` of row `r`), multiplied as two
//! halves of eight rows in `ymm` registers.
//!
//! Without `vpdpbusd`, each four-value sum is `vpmaddubsw` (unsigned codes times the broadcast
//! activation bytes, in i16 pairs) then `vpmaddwd` with ones. `vpmaddubsw` saturates at ±32767, which the
//! K-quants' codes never reach (at most 63, so a pair is at most 2·63·128 = 16128); the IQ formats'
//! codes `value + 128` would, so they keep their row kernels here. The integer totals are exact and the
//! float steps those of `ktile_avx512::step`, lane by lane, so the results are the portable code's bit
//! for bit (tested in `kquants::tile` with `--cpu-avx512 off` semantics: [`dot`] is called directly).
//!
//! Callers check `super::super::has_avx2_fma()` first.

use core::arch::x86_64::*;

use super::ktile_avx512::{fill_rows, Order, Tile, TILE_ROWS};
use crate::quant::kquants::{KKind, Q8K_BYTES, QK_K};

/// Unpacks super-block `b` of sixteen rows of `kind` into `tile`: the codes and scales of
/// `ktile_avx512::fill_rows`, then the transpose, element by element.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; each of `rows` must be readable for `b + 1` blocks of
/// `kind`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn unpack(kind: KKind, rows: &[*const u8; TILE_ROWS], b: usize, tile: &mut Tile) {
    let mut all = [[0u8; QK_K]; TILE_ROWS];
    fill_rows(kind, rows, b, tile, &mut all);
    for (k, w) in tile.w.iter_mut().enumerate() {
        for (r, codes) in all.iter().enumerate() {
            w[4 * r..4 * r + 4].copy_from_slice(&codes[4 * k..4 * k + 4]);
        }
    }
}

/// Half `h` (rows `8h .. 8h + 8`) of super-block `tile`'s step for `NT` activation rows, as
/// `ktile_avx512::step` for the sixteen (the same `K` and `ORD` codes, K-quants only).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn step<const K: u8, const ORD: u8, const NT: usize>(
    tile: &Tile,
    h: usize,
    ys: [*const u8; NT],
    acc: [*mut f32; NT],
) {
    let sub32 = K == 2 || K == 3;
    let (groups, per_group) = if sub32 { (8, 8) } else { (16, 4) };
    let dpw = K <= 1;
    let zero = _mm256_setzero_si256();
    let ones = _mm256_set1_epi16(1);
    let at = 8 * h;
    let ld = |p: *const i32| {
        // SAFETY: `p` is row `at`'s entry of one of the tile's arrays of sixteen i32.
        unsafe { _mm256_loadu_si256(p.add(at) as *const __m256i) }
    };
    let xd = _mm256_loadu_ps(tile.xd.as_ptr().add(at));
    let xdmin = _mm256_loadu_ps(tile.xdmin.as_ptr().add(at));
    let mut yd = [_mm256_setzero_ps(); NT];
    let mut d = [_mm256_setzero_ps(); NT];
    let mut dmin = [_mm256_setzero_ps(); NT];
    for t in 0..NT {
        yd[t] = _mm256_set1_ps((ys[t] as *const f32).read_unaligned());
        d[t] = _mm256_mul_ps(xd, yd[t]);
        dmin[t] = _mm256_mul_ps(xdmin, yd[t]);
    }
    let mut tot = [zero; NT];
    let mut m = [zero; NT];
    // Row `at`'s slot of accumulator `t`: its sums, then (Q4_K orders) its minimum sums 16 later.
    let slot = |t: usize, min: bool| acc[t].add(at + if min { TILE_ROWS } else { 0 });
    for g in 0..groups {
        let mut a = [zero; NT];
        for k in 0..per_group {
            let kk = g * per_group + k;
            let w = _mm256_load_si256(tile.w[kk].as_ptr().add(32 * h) as *const __m256i);
            for t in 0..NT {
                let q8 = (ys[t].add(4 + 4 * kk) as *const i32).read_unaligned();
                let p = _mm256_maddubs_epi16(w, _mm256_set1_epi32(q8));
                a[t] = _mm256_add_epi32(a[t], _mm256_madd_epi16(p, ones));
            }
        }
        let s = ld(tile.sc[g].as_ptr());
        for t in 0..NT {
            tot[t] = if dpw {
                // `vpdpwssd` of the AVX-512 kernel: the sums fit i16, paired with (scale, 0).
                _mm256_add_epi32(tot[t], _mm256_madd_epi16(a[t], s))
            } else {
                _mm256_add_epi32(tot[t], _mm256_mullo_epi32(a[t], s))
            };
        }
        if ORD == 2 {
            let pr = ld(tile.pair[g].as_ptr());
            for t in 0..NT {
                let bs = (ys[t].add(260 + 4 * g) as *const i32).read_unaligned();
                m[t] = _mm256_add_epi32(m[t], _mm256_madd_epi16(pr, _mm256_set1_epi32(bs)));
            }
            if g % 2 == 1 {
                for t in 0..NT {
                    let a = _mm256_loadu_ps(slot(t, false));
                    let am = _mm256_loadu_ps(slot(t, true));
                    let a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot[t]), d[t], a);
                    let am = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m[t]), dmin[t], am);
                    _mm256_storeu_ps(slot(t, false), a);
                    _mm256_storeu_ps(slot(t, true), am);
                    tot[t] = zero;
                    m[t] = zero;
                }
            }
        }
    }
    if ORD == 2 {
        return;
    }
    for p in 0..8 {
        let pr = ld(tile.pair[p].as_ptr());
        for t in 0..NT {
            let bs = (ys[t].add(260 + 4 * p) as *const i32).read_unaligned();
            m[t] = _mm256_add_epi32(m[t], _mm256_madd_epi16(pr, _mm256_set1_epi32(bs)));
        }
    }
    for t in 0..NT {
        if ORD == 1 {
            let a = _mm256_loadu_ps(slot(t, false));
            let am = _mm256_loadu_ps(slot(t, true));
            let a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot[t]), d[t], a);
            let am = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m[t]), dmin[t], am);
            _mm256_storeu_ps(slot(t, false), a);
            _mm256_storeu_ps(slot(t, true), am);
            continue;
        }
        let total = match K {
            1 => _mm256_sub_epi32(tot[t], _mm256_slli_epi32::<2>(m[t])),
            4 => _mm256_sub_epi32(tot[t], _mm256_slli_epi32::<5>(m[t])),
            _ => tot[t],
        };
        let mut r = _mm256_mul_ps(xd, _mm256_cvtepi32_ps(total));
        if matches!(K, 0 | 2 | 3) {
            // fma(−xdmin, M, r), as `tiled_step`.
            r = _mm256_fnmadd_ps(xdmin, _mm256_cvtepi32_ps(m[t]), r);
        }
        let a = _mm256_loadu_ps(slot(t, false));
        _mm256_storeu_ps(slot(t, false), _mm256_fmadd_ps(r, yd[t], a));
    }
}

/// The accumulators of one activation row, as `ktile_avx512`'s.
type Acc = [f32; 2 * TILE_ROWS];

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn steps<const K: u8, const ORD: u8>(
    tile: &Tile,
    b: usize,
    acts: &[*const u8],
    accs: &mut [Acc],
) {
    let y = |t: usize| acts[t].add(b * Q8K_BYTES);
    for h in 0..2 {
        // Four activation rows at a time: their sums, totals and minimum sums fill twelve of the
        // sixteen `ymm` registers.
        let mut t = 0;
        while t + 4 <= acts.len() {
            let mut acc = [core::ptr::null_mut(); 4];
            let mut ys = [core::ptr::null(); 4];
            for i in 0..4 {
                acc[i] = accs[t + i].as_mut_ptr();
                ys[i] = y(t + i);
            }
            step::<K, ORD, 4>(tile, h, ys, acc);
            t += 4;
        }
        while t < acts.len() {
            step::<K, ORD, 1>(tile, h, [y(t)], [accs[t].as_mut_ptr()]);
            t += 1;
        }
    }
}

/// `ktile_avx512::dot` on AVX2, for K-quant tiles.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; each of `acts` must be readable for `tiles.len()` Q8_K
/// blocks; `out.len() == acts.len()`; the Q4_K orders only with Q4_K tiles.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot(
    kind: KKind,
    order: Order,
    tiles: &[Tile],
    acts: &[*const u8],
    out: &mut [[f32; TILE_ROWS]],
) {
    // On the stack: at most `KTile::MAX_ACTS` rows (the caller asserts it).
    let mut all = [[0f32; 2 * TILE_ROWS]; crate::quant::kquants::KTile::MAX_ACTS];
    let accs = &mut all[..acts.len()];
    for (b, tile) in tiles.iter().enumerate() {
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
