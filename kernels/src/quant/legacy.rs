//! The first GGML formats (blocks of 32): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and the Q8_0/Q8_1 activation
//! formats their dot products use.
//!
//! Dot products follow llama.cpp's `vec_dot_type`: Q4_0, Q5_0 and Q8_0 rows meet Q8_0 activations, Q4_1 and
//! Q5_1 rows meet Q8_1. The float work is ggml's AVX2 order (`ggml_vec_dot_q*_q8_*` and llamafile's
//! `tinyBLAS_Q0_AVX`, which agree), so results are llama.cpp's bit for bit: each block gives eight exact
//! integer sums of four neighbouring products (values `4l..4l+4` in lane `l`), and lane `l` accumulates
//! `fma(dx·dy, sum_l, lane_l)` block after block; the lanes are summed by [`sum_lanes8`]. The formats
//! with a minimum add `m·s` per block to one scalar (fused, as GCC contracts ggml's `summs += m*s`), added
//! after the lanes. The AVX2 code (`x86/legacy_avx2.rs`) computes exactly that, so it equals the portable
//! code bit for bit.

use super::float::sum_lanes8;
use super::{f16_at, put_f16, ActType, Dot4, GgmlType, QuantOps};
use crate::rng::Rng;

/// Values per block of every format here.
const QK: usize = 32;

/// The block formats of this family, with their byte layouts.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum LegacyKind {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
}

impl LegacyKind {
    /// Bytes per weight block.
    pub(crate) const fn block_bytes(self) -> usize {
        match self {
            LegacyKind::Q4_0 => 18,
            LegacyKind::Q4_1 => 20,
            LegacyKind::Q5_0 => 22,
            LegacyKind::Q5_1 => 24,
            LegacyKind::Q8_0 => 34,
        }
    }

    /// Bytes per activation block (Q8_0: 34, Q8_1: 36).
    pub(crate) const fn act_bytes(self) -> usize {
        if self.has_min() {
            36
        } else {
            34
        }
    }

    /// Whether the format stores a minimum `m` (value = d·q + m) and so meets Q8_1 activations.
    pub(crate) const fn has_min(self) -> bool {
        matches!(self, LegacyKind::Q4_1 | LegacyKind::Q5_1)
    }
}

macro_rules! legacy_ops {
    ($name:ident, $kind:expr, $act:expr, $deq:ident, $dot:ident, $portable:ident, $fill:ident) => {
        static $name: QuantOps = QuantOps {
            dequantize: $deq,
            act: $act,
            vec_dot: $dot,
            vec_dot_portable: $portable,
            fill_random: $fill,
        };
        fn $dot(n: usize, row: &[u8], act: &[u8]) -> f32 {
            vec_dot($kind, n, row, act)
        }
        fn $portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
            vec_dot_portable($kind, n, row, act)
        }
        fn $fill(rng: &mut Rng, rms: f32, dst: &mut [u8]) {
            fill_random($kind, rng, rms, dst)
        }
    };
}

legacy_ops!(
    Q4_0_OPS,
    LegacyKind::Q4_0,
    ActType::Q8_0,
    dequantize_q4_0,
    dot_q4_0,
    portable_q4_0,
    fill_q4_0
);
legacy_ops!(
    Q4_1_OPS,
    LegacyKind::Q4_1,
    ActType::Q8_1,
    dequantize_q4_1,
    dot_q4_1,
    portable_q4_1,
    fill_q4_1
);
legacy_ops!(
    Q5_0_OPS,
    LegacyKind::Q5_0,
    ActType::Q8_0,
    dequantize_q5_0,
    dot_q5_0,
    portable_q5_0,
    fill_q5_0
);
legacy_ops!(
    Q5_1_OPS,
    LegacyKind::Q5_1,
    ActType::Q8_1,
    dequantize_q5_1,
    dot_q5_1,
    portable_q5_1,
    fill_q5_1
);
legacy_ops!(
    Q8_0_OPS,
    LegacyKind::Q8_0,
    ActType::Q8_0,
    dequantize_q8_0,
    dot_q8_0,
    portable_q8_0,
    fill_q8_0
);

/// The operations of this family's types.
pub(crate) fn ops(ty: GgmlType) -> Option<&'static QuantOps> {
    match ty {
        GgmlType::Q4_0 => Some(&Q4_0_OPS),
        GgmlType::Q4_1 => Some(&Q4_1_OPS),
        GgmlType::Q5_0 => Some(&Q5_0_OPS),
        GgmlType::Q5_1 => Some(&Q5_1_OPS),
        GgmlType::Q8_0 => Some(&Q8_0_OPS),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------------------------
// Dequantization: the same f32 operations, in the same order, as gguf-py's numpy code.

#[inline(always)]
fn qh_at(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// The 32 quants of a 4-bit block: element `j < 16` is the low nibble of byte `j`, `j + 16` its high one.
#[inline(always)]
fn nibbles(qs: &[u8]) -> [u8; 32] {
    let mut q = [0u8; 32];
    for j in 0..16 {
        q[j] = qs[j] & 0x0F;
        q[j + 16] = qs[j] >> 4;
    }
    q
}

/// The 32 quants (0..31) of a 5-bit block: nibbles plus bit `j` of `qh` as bit 4.
#[inline(always)]
fn fives(qh: u32, qs: &[u8]) -> [u8; 32] {
    let mut q = nibbles(qs);
    for (j, v) in q.iter_mut().enumerate() {
        *v |= (((qh >> j) & 1) as u8) << 4;
    }
    q
}

fn dequantize_q4_0(src: &[u8], dst: &mut [f32]) {
    for (b, o) in src.chunks_exact(18).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b);
        for (o, q) in o.iter_mut().zip(nibbles(&b[2..18])) {
            *o = d * (q as i32 - 8) as f32;
        }
    }
}

fn dequantize_q4_1(src: &[u8], dst: &mut [f32]) {
    for (b, o) in src.chunks_exact(20).zip(dst.chunks_exact_mut(QK)) {
        let (d, m) = (f16_at(b), f16_at(&b[2..]));
        for (o, q) in o.iter_mut().zip(nibbles(&b[4..20])) {
            *o = d * q as f32 + m;
        }
    }
}

fn dequantize_q5_0(src: &[u8], dst: &mut [f32]) {
    for (b, o) in src.chunks_exact(22).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b);
        for (o, q) in o.iter_mut().zip(fives(qh_at(&b[2..]), &b[6..22])) {
            *o = d * (q as i32 - 16) as f32;
        }
    }
}

fn dequantize_q5_1(src: &[u8], dst: &mut [f32]) {
    for (b, o) in src.chunks_exact(24).zip(dst.chunks_exact_mut(QK)) {
        let (d, m) = (f16_at(b), f16_at(&b[2..]));
        for (o, q) in o.iter_mut().zip(fives(qh_at(&b[4..]), &b[8..24])) {
            *o = d * q as f32 + m;
        }
    }
}

fn dequantize_q8_0(src: &[u8], dst: &mut [f32]) {
    for (b, o) in src.chunks_exact(34).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b);
        for (o, &q) in o.iter_mut().zip(&b[2..34]) {
            *o = q as i8 as f32 * d;
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// Dot products.

/// The eight exact integer sums of one block's `qx·qy` (`x` a weight block, `qy` the 32 activation
/// quants): lane `l` sums the products of values `4l..4l+4`.
#[inline(always)]
fn block_isums(kind: LegacyKind, x: &[u8], qy: &[u8]) -> [i32; 8] {
    let qx: [i8; 32] = match kind {
        LegacyKind::Q4_0 => nibbles(&x[2..18]).map(|q| q as i8 - 8),
        LegacyKind::Q4_1 => nibbles(&x[4..20]).map(|q| q as i8),
        LegacyKind::Q5_0 => fives(qh_at(&x[2..]), &x[6..22]).map(|q| q as i8 - 16),
        LegacyKind::Q5_1 => fives(qh_at(&x[4..]), &x[8..24]).map(|q| q as i8),
        LegacyKind::Q8_0 => std::array::from_fn(|j| x[2 + j] as i8),
    };
    std::array::from_fn(|l| {
        (4 * l..4 * l + 4)
            .map(|j| qx[j] as i32 * qy[j] as i8 as i32)
            .sum()
    })
}

/// Adds blocks `first .. nb` to `lanes` and, for the formats with a minimum, their `m·s` to `mins`.
#[inline(always)]
fn add_blocks(
    kind: LegacyKind,
    first: usize,
    nb: usize,
    row: &[u8],
    act: &[u8],
    lanes: &mut [f32; 8],
    mins: &mut f32,
) {
    let (xb, yb) = (kind.block_bytes(), kind.act_bytes());
    let qy_off = if kind.has_min() { 4 } else { 2 };
    for b in first..nb {
        let (x, y) = (&row[b * xb..(b + 1) * xb], &act[b * yb..(b + 1) * yb]);
        let d = f16_at(x) * f16_at(y);
        let sums = block_isums(kind, x, &y[qy_off..]);
        for (lane, &s) in lanes.iter_mut().zip(&sums) {
            *lane = d.mul_add(s as f32, *lane);
        }
        if kind.has_min() {
            *mins = f16_at(&x[2..]).mul_add(f16_at(&y[2..]), *mins);
        }
    }
}

#[inline(always)]
fn check_lengths(kind: LegacyKind, n: usize, row: &[u8], act: &[u8]) -> usize {
    let nb = n / QK;
    assert!(
        row.len() >= nb * kind.block_bytes() && act.len() >= nb * kind.act_bytes(),
        "{kind:?} row or activations shorter than {n} values"
    );
    nb
}

#[inline(always)]
fn vec_dot_portable(kind: LegacyKind, n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = check_lengths(kind, n, row, act);
    let (mut lanes, mut mins) = ([0f32; 8], 0f32);
    add_blocks(kind, 0, nb, row, act, &mut lanes, &mut mins);
    sum_lanes8(&lanes) + mins
}

#[inline(always)]
fn vec_dot(kind: LegacyKind, n: usize, row: &[u8], act: &[u8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        let nb = check_lengths(kind, n, row, act);
        // SAFETY: `has_avx2_fma` confirmed AVX2, FMA and F16C at run time; `check_lengths` showed that
        // `row` and `act` hold `nb` blocks, all the kernel reads.
        let (lanes, mins) =
            unsafe { super::x86::legacy_avx2::dot(kind, nb, row.as_ptr(), act.as_ptr()) };
        return sum_lanes8(&lanes) + mins;
    }
    vec_dot_portable(kind, n, row, act)
}

/// [`vec_dot`] of one row with four activation rows: the same four results, the row decoded once.
#[inline(always)]
fn vec_dot4(kind: LegacyKind, n: usize, row: &[u8], acts: [&[u8]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        let nb = check_lengths(kind, n, row, acts[0]);
        for a in &acts[1..] {
            check_lengths(kind, n, row, a);
        }
        // SAFETY: as in `vec_dot`, for each of the four activation rows.
        let r = unsafe {
            super::x86::legacy_avx2::dot4(kind, nb, row.as_ptr(), acts.map(|a| a.as_ptr()))
        };
        return r.map(|(lanes, mins)| sum_lanes8(&lanes) + mins);
    }
    acts.map(|a| vec_dot_portable(kind, n, row, a))
}

/// [`QuantOps::vec_dot`] of one row with four activation rows at once, for the formats of this family
/// (the same four results; the row's blocks are decoded once). llama.cpp sums a batch of these formats in
/// the order of a single row (its `tinyBLAS_Q0_AVX` equals `vec_dot`), so a matrix product may use this
/// for any rows of a batch.
pub fn dot4(ty: GgmlType) -> Option<Dot4> {
    fn q4_0(n: usize, row: &[u8], acts: [&[u8]; 4]) -> [f32; 4] {
        vec_dot4(LegacyKind::Q4_0, n, row, acts)
    }
    fn q4_1(n: usize, row: &[u8], acts: [&[u8]; 4]) -> [f32; 4] {
        vec_dot4(LegacyKind::Q4_1, n, row, acts)
    }
    fn q5_0(n: usize, row: &[u8], acts: [&[u8]; 4]) -> [f32; 4] {
        vec_dot4(LegacyKind::Q5_0, n, row, acts)
    }
    fn q5_1(n: usize, row: &[u8], acts: [&[u8]; 4]) -> [f32; 4] {
        vec_dot4(LegacyKind::Q5_1, n, row, acts)
    }
    fn q8_0(n: usize, row: &[u8], acts: [&[u8]; 4]) -> [f32; 4] {
        vec_dot4(LegacyKind::Q8_0, n, row, acts)
    }
    match ty {
        GgmlType::Q4_0 => Some(q4_0),
        GgmlType::Q4_1 => Some(q4_1),
        GgmlType::Q5_0 => Some(q5_0),
        GgmlType::Q5_1 => Some(q5_1),
        GgmlType::Q8_0 => Some(q8_0),
        _ => None,
    }
}

/// Weight rows of a [`Tile`].
pub const TILE_ROWS: usize = 2;
/// Activation rows of a [`Tile`].
pub const TILE_ACTS: usize = 4;

/// The dot products of [`TILE_ROWS`] weight rows with [`TILE_ACTS`] activation rows, each equal to
/// [`QuantOps::vec_dot`] bit for bit: `out[r·TILE_ACTS + t]` for weight row `r`, activation row `t`.
pub type Tile = fn(
    n: usize,
    rows: [&[u8]; TILE_ROWS],
    acts: [&[u8]; TILE_ACTS],
) -> [f32; TILE_ROWS * TILE_ACTS];

#[inline(always)]
fn vec_dot_tile(
    kind: LegacyKind,
    n: usize,
    rows: [&[u8]; TILE_ROWS],
    acts: [&[u8]; TILE_ACTS],
) -> [f32; TILE_ROWS * TILE_ACTS] {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        let nb = n / QK;
        let rows_ok = rows.iter().all(|r| r.len() >= nb * kind.block_bytes());
        let acts_ok = acts.iter().all(|a| a.len() >= nb * kind.act_bytes());
        assert!(
            rows_ok && acts_ok,
            "{kind:?} rows or activations shorter than {n} values"
        );
        // SAFETY: as in `vec_dot`, for each pair of a weight row and an activation row (each row and
        // each activation row holds `nb` blocks, asserted above).
        return unsafe {
            super::x86::legacy_avx2::tile(
                kind,
                nb,
                rows.map(|r| r.as_ptr()),
                acts.map(|a| a.as_ptr()),
            )
        };
    }
    std::array::from_fn(|i| vec_dot_portable(kind, n, rows[i / TILE_ACTS], acts[i % TILE_ACTS]))
}

/// The [`Tile`] kernel of the formats of this family: [`TILE_ROWS`] weight rows times [`TILE_ACTS`]
/// activation rows in the single-row order (llama.cpp's order for their batches too, see [`dot4`]), each
/// weight block decoded once for all activation rows and the lane sums done together.
pub fn tile(ty: GgmlType) -> Option<Tile> {
    macro_rules! tile_fn {
        ($kind:expr) => {{
            fn f(
                n: usize,
                rows: [&[u8]; TILE_ROWS],
                acts: [&[u8]; TILE_ACTS],
            ) -> [f32; TILE_ROWS * TILE_ACTS] {
                vec_dot_tile($kind, n, rows, acts)
            }
            f as Tile
        }};
    }
    match ty {
        GgmlType::Q4_0 => Some(tile_fn!(LegacyKind::Q4_0)),
        GgmlType::Q4_1 => Some(tile_fn!(LegacyKind::Q4_1)),
        GgmlType::Q5_0 => Some(tile_fn!(LegacyKind::Q5_0)),
        GgmlType::Q5_1 => Some(tile_fn!(LegacyKind::Q5_1)),
        GgmlType::Q8_0 => Some(tile_fn!(LegacyKind::Q8_0)),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------------------------
// Random blocks.

/// The smallest block scale written: f16's smallest normal number, so scales are never denormal.
pub(crate) const MIN_SCALE: f32 = 1.0 / 16384.0;
/// The largest block scale written (its multiples by 15.5 stay far inside f16's range).
pub(crate) const MAX_SCALE: f32 = 2048.0;

/// Per-block scale multipliers (0.75 … 1.25), chosen at random so blocks do not all look alike.
const SCALE_JITTER: [f32; 8] = [0.75, 0.82, 0.89, 0.96, 1.04, 1.11, 1.18, 1.25];

/// The block scale `d` (before jitter) giving root-mean-square `rms` when `d·q` has mean square `q_ms`
/// and the jitter multiplies it; 0 for unusable targets.
fn base_scale(rms: f32, q_ms: f32) -> f32 {
    if !(rms.is_finite() && rms > 0.0) {
        return 0.0;
    }
    let jitter_ms = SCALE_JITTER.iter().map(|j| j * j).sum::<f32>() / 8.0;
    rms / (q_ms * jitter_ms).sqrt()
}

/// Writes random blocks: uniformly random quants, a jittered scale with a random sign for the symmetric
/// formats (quants `q - 8`, `q - 16` and Q8_0's bytes have mean −½, so the sign keeps the mean at zero
/// and every value's distribution symmetric), and for Q4_1/Q5_1 a positive scale with `m = −7.5·d`
/// (`−15.5·d`) so each block is centered. Scales never fall below [`MIN_SCALE`], so an `rms` smaller than
/// about `MIN_SCALE·√(mean q²)` gives larger values than asked.
fn fill_random(kind: LegacyKind, rng: &mut Rng, rms: f32, dst: &mut [u8]) {
    // Mean square of the integer factor multiplying d, over uniformly random quants.
    let (q_ms, center) = match kind {
        LegacyKind::Q4_0 => (21.5, 0.0),
        LegacyKind::Q4_1 => (21.25, -7.5),
        LegacyKind::Q5_0 => (85.5, 0.0),
        LegacyKind::Q5_1 => (85.25, -15.5),
        LegacyKind::Q8_0 => (5461.5, 0.0),
    };
    let base = base_scale(rms, q_ms);
    // The 16 possible scale headers (jitter level × sign), as the bytes to copy.
    let mut headers = [[0u8; 4]; 16];
    for (i, h) in headers.iter_mut().enumerate() {
        let mut d = base * SCALE_JITTER[i % 8];
        if d != 0.0 {
            d = d.clamp(MIN_SCALE, MAX_SCALE);
        }
        if kind.has_min() {
            put_f16(&mut h[0..2], d);
            let m = center * f16_at(&h[0..2]);
            put_f16(&mut h[2..4], m);
        } else {
            if i >= 8 {
                d = -d;
            }
            put_f16(&mut h[0..2], d);
        }
    }
    let hb = if kind.has_min() { 4 } else { 2 };
    let bb = kind.block_bytes();
    // Random bytes everywhere in one pass, then each header replaced by one of the sixteen, chosen by the
    // random byte it replaces.
    rng.fill_bytes(dst);
    for block in dst.chunks_exact_mut(bb) {
        let h = &headers[(block[0] & 15) as usize];
        block[..hb].copy_from_slice(&h[..hb]);
    }
}

// ---------------------------------------------------------------------------------------------------------
// Activation quantizers.

/// Quantizes `x` to Q8_0 blocks as ggml's x86 CPU backend does (`quantize_row_q8_0`, AVX2): `d = amax /
/// 127` (stored f16), `q = x · (127 / amax)` rounded to nearest, ties to even. (The portable reference
/// multiplies by `1/d` and rounds ties away from zero; the two differ on a few values per million, which
/// sensitive models turn into visible differences.)
pub(crate) fn quantize_q8_0(x: &[f32], out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        let nb = (x.len() / 32).min(out.len() / 34);
        // SAFETY: `has_avx2_fma` confirmed AVX2, FMA and F16C at run time; `x` holds `32·nb` values and
        // `out` `34·nb` bytes.
        unsafe { super::x86::act_avx2::quantize_q8_0(nb, x.as_ptr(), out.as_mut_ptr()) };
        return;
    }
    quantize_q8_0_portable(x, out)
}

/// [`quantize_q8_0`] in portable code (the AVX2 code computes the same bytes).
pub(crate) fn quantize_q8_0_portable(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(34)) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        put_f16(&mut ob[0..2], d);
        for (o, v) in ob[2..].iter_mut().zip(xb) {
            *o = round_ties_even(v * id) as i8 as u8;
        }
    }
}

/// `x` rounded to the nearest integer, ties to even (as `_mm256_round_ps(_, _MM_ROUND_NEAREST)` and
/// ggml's `nearest_int`), for `|x| < 2²²`: adding 1.5·2²³ leaves no fraction bits.
#[inline]
pub(crate) fn round_ties_even(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (x + MAGIC) - MAGIC
}

/// Quantizes `x` to Q8_1 blocks: as [`quantize_q8_0`] (ggml's x86 `quantize_row_q8_1`), plus `s = d ×
/// Σq` for formats with a minimum.
pub(crate) fn quantize_q8_1(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(36)) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (o, v) in ob[4..].iter_mut().zip(xb) {
            let q = round_ties_even(v * id) as i8;
            sum += q as i32;
            *o = q as u8;
        }
        put_f16(&mut ob[0..2], d);
        put_f16(&mut ob[2..4], d * sum as f32);
    }
}

/// `data` (a whole number of blocks of 32) put on the card's q8_1 grid in floats: per block `d = amax /
/// 127` and each value `roundf(v / d) · d` (ties away from zero), as llama.cpp's CUDA `quantize_q8_1`
/// rounds an activation, so a CPU that computes some of a layer's experts sees the values the card's
/// own experts see. A partly resident model's CPU share rounds its input this way on every MoE layer of
/// every token, on the critical path: AVX2 where the CPU has it (same bits: every step is one IEEE
/// operation), and a loop the compiler vectorizes on any CPU.
pub fn round_to_q8_1_grid(data: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        // SAFETY: AVX2 was detected at run time.
        return unsafe { round_to_q8_1_grid_avx2(data) };
    }
    round_to_q8_1_grid_body(data)
}

/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn round_to_q8_1_grid_avx2(data: &mut [f32]) {
    round_to_q8_1_grid_body(data)
}

#[inline(always)]
fn round_to_q8_1_grid_body(data: &mut [f32]) {
    let mut blocks = data.chunks_exact_mut(32);
    for block in &mut blocks {
        let block: &mut [f32; 32] = block.try_into().expect("blocks of 32");
        // Eight running maxima in registers, so the block's maximum is not one chain of 32 dependent
        // steps (a fold measured 2.6 times slower). A NaN never wins a comparison, as `f32::max`
        // ignores it.
        let mut lanes = [0f32; 8];
        for part in 0..4 {
            for (l, m) in lanes.iter_mut().enumerate() {
                let a = block[part * 8 + l].abs();
                *m = if a > *m { a } else { *m };
            }
        }
        let amax = lanes.iter().fold(0f32, |m, &v| if v > m { v } else { m });
        round_block(block, amax);
    }
    let rest = blocks.into_remainder();
    let amax = rest.iter().fold(0f32, |m, v| m.max(v.abs()));
    round_block(rest, amax);
}

#[inline(always)]
fn round_block(block: &mut [f32], amax: f32) {
    let d = amax / 127.0;
    if d == 0.0 {
        return;
    }
    for v in block.iter_mut() {
        *v = round_half_away(*v / d) * d;
    }
}

/// `v.round()` (halves away from zero, as the card's `roundf`) in selects and additions only, so a loop
/// of it vectorizes (`f32::round` is a library call per value, and a float-to-integer conversion is
/// scalar before AVX-512). Exact for every float: below 2²³ adding and subtracting 2²³ gives the
/// nearest integer, one less where that rounded up is the truncation, and the halves are added back
/// by comparison; from 2²³ up every float is an integer, and NaN is kept, as `round` keeps them.
#[inline(always)]
fn round_half_away(v: f32) -> f32 {
    const TWO_23: f32 = 8_388_608.0;
    let a = v.abs();
    let nearest = (a + TWO_23) - TWO_23;
    let trunc = if nearest > a { nearest - 1.0 } else { nearest };
    let r = (trunc + if a - trunc >= 0.5 { 1.0 } else { 0.0 }).copysign(v);
    if a < TWO_23 {
        r
    } else {
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rounding's edge cases and 100,000 quotients of the range the grid rounding meets.
    #[test]
    fn the_fast_rounding_is_f32_round() {
        let mut v = vec![
            0.5f32,
            -0.5,
            1.5,
            -1.5,
            2.5,
            126.5,
            -126.5,
            127.0,
            0.49999997,
            -0.49999997,
            0.0,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e10,
            -1e10,
            4_194_304.5,
            8_388_607.5,
            -8_388_607.5,
            8_388_608.0,
            16_777_218.0,
        ];
        let mut seed = 7u64;
        for _ in 0..100_000 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            v.push(((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 260.0);
        }
        for x in v {
            let (a, b) = (round_half_away(x), x.round());
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "{x}: {a} vs {b}"
            );
        }
    }

    /// The selects-only rounding equals `f32::round` on every float whose high 16 bits vary (and their
    /// neighbours around every integer and half below 2²⁴).
    #[test]
    fn round_half_away_is_round() {
        let check = |v: f32| {
            let (want, got) = (v.round(), round_half_away(v));
            assert!(
                want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()),
                "{v:e}: round {want:e}, ours {got:e}"
            );
        };
        for hi in 0..=u16::MAX as u32 {
            for lo in [0u32, 1, 0x7fff, 0x8000, 0xffff] {
                check(f32::from_bits(hi << 16 | lo));
            }
        }
        for i in 0..1 << 12 {
            let x = i as f32 * 0.5;
            for v in [x, -x] {
                check(v);
                check(f32::from_bits(v.to_bits() + 1));
                check(f32::from_bits(v.to_bits().wrapping_sub(1)));
            }
        }
    }

    /// The grid rounding (AVX2 where present) gives `roundf(v / d) · d` per block of 32, `d = amax / 127`,
    /// computed the plain way; a zero block stays zero and a NaN does not become the block's scale.
    #[test]
    fn the_q8_1_grid_is_the_cards() {
        let mut rng = Rng::new(5);
        let mut x: Vec<f32> = (0..32 * 64)
            .map(|i| {
                let mut b = [0u8; 4];
                rng.fill_bytes(&mut b);
                (u32::from_le_bytes(b) as f32 / u32::MAX as f32 - 0.5) * (1 + i % 7) as f32
            })
            .collect();
        x[32..64].fill(0.0);
        x[70] = f32::NAN;
        // A partial last block is rounded as a block of its own.
        x.truncate(32 * 63 + 5);
        let mut want = x.clone();
        for block in want.chunks_mut(32) {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            if d != 0.0 {
                block.iter_mut().for_each(|v| *v = (*v / d).round() * d);
            }
        }
        let mut got = x.clone();
        round_to_q8_1_grid(&mut got);
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert!(
                w.to_bits() == g.to_bits() || (w.is_nan() && g.is_nan()),
                "value {i}: {w} {g}"
            );
        }
        assert!(got[32..64].iter().all(|&v| v == 0.0));
        assert!(got[64..96]
            .iter()
            .filter(|v| !v.is_nan())
            .any(|&v| v != 0.0));
    }

    /// Block scales are normal f16 numbers (even for a tiny target); Q4_1/Q5_1 blocks are centered
    /// (`m = −7.5·d`, `−15.5·d`); the symmetric formats use both signs of `d` about equally.
    #[test]
    fn random_block_headers() {
        let kinds = [
            (LegacyKind::Q4_0, 0.0f32),
            (LegacyKind::Q4_1, 7.5),
            (LegacyKind::Q5_0, 0.0),
            (LegacyKind::Q5_1, 15.5),
            (LegacyKind::Q8_0, 0.0),
        ];
        for (kind, center) in kinds {
            for rms in [1e-7f32, 0.02, 1.0] {
                let mut buf = vec![0u8; 4096 * kind.block_bytes()];
                fill_random(kind, &mut Rng::new(9), rms, &mut buf);
                let mut negative = 0;
                for b in buf.chunks_exact(kind.block_bytes()) {
                    let d = f16_at(b);
                    assert!(d.abs() >= MIN_SCALE && d.is_finite(), "{kind:?}: scale {d}");
                    negative += (d < 0.0) as usize;
                    if kind.has_min() {
                        let m = f16_at(&b[2..]);
                        assert!(
                            (m + center * d).abs() <= 1e-3 * m.abs(),
                            "{kind:?}: d {d}, m {m}"
                        );
                    }
                }
                if kind.has_min() {
                    assert_eq!(negative, 0, "{kind:?}: negative scales");
                } else {
                    assert!(
                        (1800..2300).contains(&negative),
                        "{kind:?}: {negative} of 4096 negative"
                    );
                }
            }
        }
    }
}
