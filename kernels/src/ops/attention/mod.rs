//! Causal grouped-query attention of a block of queries over a key/value sequence.
//!
//! Keys and values are rows indexed by position (`k[j]` is position `j`), as a KV cache stores them; query
//! `i` sits at position `positions[i]` and sees the positions `j ≤ positions[i]` (and, with a sliding
//! window `w`, only `positions[i] - j < w`). Query head `h` reads key/value head `h / (n_head /
//! n_head_kv)`, as ggml broadcasts. Work is spread over (query, head) pairs with rayon.
//!
//! Two arithmetics: [`attention`] (f32 throughout, a two-pass softmax: what llama.cpp's CPU flash
//! attention computes for batches of at least [`GGML_FA_TILE_Q`] queries, up to f32 rounding) and
//! [`attention_ggml_f16`] (llama.cpp's vector path over an F16 cache, for smaller batches and decoding:
//! f16 query, one-pass softmax, values summed in f16). Over a Q8_0 cache (`--kv q8_0`),
//! [`attention_ggml_q8_0`] is llama.cpp's one path for a quantized cache (Q8_0 query, values summed in
//! f32), with [`hadamard_ggml`] for the rotations llama.cpp applies around such a cache. [`cells`]:
//! attention over the cells a sparse-attention indexer selected. [`attention_full`]: every query sees
//! every key (a vision encoder's patches), as two matrix products per head.

use super::{axpy, dot};
use rayon::prelude::*;

mod cells;
mod full;
pub use cells::{
    attention_gathered_ggml, attention_ggml_f16_cells, attention_ggml_f16_cells_sink,
    attention_ggml_f16_cells_sinks_tiled,
};
pub use full::attention_full;

/// The shape and options of an attention call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnParams {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    /// Multiplies `q·k`.
    pub scale: f32,
    /// Sliding window: a query at position `p` sees positions `> p - window`.
    pub window: Option<u32>,
    /// `cap·tanh(s/cap)` on the scaled scores `s` (as ggml's flash attention applies it).
    pub softcap: Option<f32>,
    /// The first and last positions of rows that see each other whatever their order: a query among
    /// them also sees the later ones, up to the last (the window still bounds what it sees before it).
    /// A picture's rows in Gemma 4's sliding-window layers, as llama.cpp decodes a picture there with
    /// causal attention off; `None`: causal.
    pub sees_together: Option<(u32, u32)>,
}

impl AttnParams {
    /// The first position a query at `pos` sees.
    #[inline]
    pub fn first_visible(&self, pos: u32) -> usize {
        match self.window {
            Some(w) => (pos + 1).saturating_sub(w) as usize,
            None => 0,
        }
    }

    /// The last position a query at `pos` sees: `pos`, or the end of the rows that see each other
    /// ([`AttnParams::sees_together`]) when it is one of them.
    #[inline]
    pub fn last_visible(&self, pos: u32) -> usize {
        match self.sees_together {
            Some((first, last)) if (first..=last).contains(&pos) => last.max(pos) as usize,
            _ => pos as usize,
        }
    }
}

/// `out[i, h] = Σ_j softmax_j(s_ij) · v[j, h_kv]` with `s_ij = scale · q[i, h]·k[j, h_kv]`.
///
/// `q` is `[n_q, n_head·head_dim_k]`, `k` `[n_kv, n_head_kv·head_dim_k]`, `v` `[n_kv,
/// n_head_kv·head_dim_v]`, `out` `[n_q, n_head·head_dim_v]`; every query position must be below `n_kv`.
pub fn attention(
    q: &[f32],
    positions: &[u32],
    k: &[f32],
    v: &[f32],
    p: &AttnParams,
    out: &mut [f32],
) {
    let (dk, dv) = (p.head_dim_k, p.head_dim_v);
    check_shapes(q, positions, k, v, p, out);
    let (k_row, v_row) = (p.n_head_kv * dk, p.n_head_kv * dv);
    let group = p.n_head / p.n_head_kv;

    out.par_chunks_mut(dv).enumerate().for_each_init(
        Vec::new,
        |scores: &mut Vec<f32>, (idx, o)| {
            let (i, h) = (idx / p.n_head, idx % p.n_head);
            let hk = h / group;
            let pos = positions[i];
            let first = p.first_visible(pos);
            let last = p.last_visible(pos);
            let qh = &q[(i * p.n_head + h) * dk..][..dk];
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for j in first..=last {
                let mut s = p.scale * dot(qh, &k[j * k_row + hk * dk..][..dk]);
                if let Some(cap) = p.softcap {
                    s = cap * (s / cap).tanh();
                }
                max = max.max(s);
                scores.push(s);
            }
            o.fill(0.0);
            let mut sum = 0f32;
            for (j, s) in (first..=last).zip(scores.iter()) {
                let w = (s - max).exp();
                sum += w;
                axpy(w, &v[j * v_row + hk * dv..][..dv], o);
            }
            let inv = 1.0 / sum;
            o.iter_mut().for_each(|x| *x *= inv);
        },
    );
}

/// Checks the shapes [`attention`] documents; returns the number of key/value positions.
fn check_shapes(
    q: &[f32],
    positions: &[u32],
    k: &[f32],
    v: &[f32],
    p: &AttnParams,
    out: &[f32],
) -> usize {
    check_shapes_of(q, positions, (k.len(), v.len()), |values| values, p, out)
}

/// [`check_shapes`] for caches of `kv_lens` elements whose rows of `n` values take `row_len(n)`
/// elements (f32 values, or the bytes of Q8_0 blocks).
fn check_shapes_of(
    q: &[f32],
    positions: &[u32],
    (k_len, v_len): (usize, usize),
    row_len: impl Fn(usize) -> usize,
    p: &AttnParams,
    out: &[f32],
) -> usize {
    let (dk, dv) = (p.head_dim_k, p.head_dim_v);
    assert!(
        p.n_head > 0 && p.n_head_kv > 0 && p.n_head.is_multiple_of(p.n_head_kv) && dk > 0 && dv > 0,
        "attention: bad head counts"
    );
    let n_q = positions.len();
    assert_eq!(
        q.len(),
        n_q * p.n_head * dk,
        "attention: q has the wrong length"
    );
    assert_eq!(
        out.len(),
        n_q * p.n_head * dv,
        "attention: out has the wrong length"
    );
    let (k_row, v_row) = (row_len(p.n_head_kv * dk), row_len(p.n_head_kv * dv));
    assert_eq!(k_len % k_row, 0, "attention: k is not whole rows");
    let n_kv = k_len / k_row;
    assert_eq!(v_len, n_kv * v_row, "attention: v has the wrong length");
    assert!(
        positions.iter().all(|&pos| p.last_visible(pos) < n_kv),
        "attention: a query position, or the last of the rows that see each other, is past the keys"
    );
    n_kv
}

/// The number of queries from which llama.cpp's CPU flash attention takes its tiled path (f32 throughout,
/// which [`attention`] matches); smaller batches take the vector path [`attention_ggml_f16`] emulates
/// (`GGML_FA_TILE_Q`).
pub const GGML_FA_TILE_Q: usize = 64;

/// llama.cpp's CPU flash attention over an F16 KV cache for batches of fewer than [`GGML_FA_TILE_Q`]
/// queries (`ggml_compute_forward_flash_attn_ext_f16_one_chunk`), step for step, so a model whose outputs
/// are sensitive to rounding follows llama.cpp. Shapes and visibility as in [`attention`]; `k` and `v`
/// must hold f16 values (a cache that rounds them). Per query and head:
///
/// - the query is rounded to f16 and each score `q·k` summed as `ggml_vec_dot_f16` does on AVX2 (32
///   lanes, fused multiply-add, a fixed pairwise reduction), then multiplied by `scale` (and soft-capped);
/// - the softmax is online: on a new maximum the running sum of values is rescaled;
/// - that running sum of values is kept in f16: every rescale and every `acc + w·v` is rounded to f16;
/// - at the end it is divided by the sum of weights (kept in f32).
///
/// `kv_chunk` emulates ggml's split-KV decode (one query, `n_kv ≥ 512`): positions `0..` are cut into
/// chunks of that many, each chunk is summed as above from scratch, and the partial results are merged
/// in f32 (`ggml_flash_attn_ext_reduce_partials`).
pub fn attention_ggml_f16(
    q: &[f32],
    positions: &[u32],
    k: &[f32],
    v: &[f32],
    p: &AttnParams,
    kv_chunk: Option<usize>,
    out: &mut [f32],
) {
    let (dk, dv) = (p.head_dim_k, p.head_dim_v);
    let n_kv = check_shapes(q, positions, k, v, p, out);
    let (k_row, v_row) = (p.n_head_kv * dk, p.n_head_kv * dv);
    let group = p.n_head / p.n_head_kv;
    let chunk = kv_chunk.unwrap_or(n_kv).max(1);

    out.par_chunks_mut(dv).enumerate().for_each_init(
        || (Vec::new(), Vec::new()),
        |(qh16, acc): &mut (Vec<f32>, Vec<f32>), (idx, o)| {
            let (i, h) = (idx / p.n_head, idx % p.n_head);
            let one = VectorQuery {
                q: &q[(i * p.n_head + h) * dk..][..dk],
                k: &k[(h / group) * dk..],
                v: &v[(h / group) * dv..],
                k_row,
                v_row,
                first: p.first_visible(positions[i]),
                last: p.last_visible(positions[i]),
                chunk,
                split: kv_chunk.is_some(),
                cells: None,
            };
            #[cfg(target_arch = "x86_64")]
            if crate::quant::has_avx2_fma() {
                // SAFETY: the CPU supports AVX2, FMA and F16C (checked at run time).
                return unsafe { vector_query_fma(&one, p, qh16, acc, o) };
            }
            vector_query::<PortableF16>(&one, p, qh16, acc, o);
        },
    );
}

/// One query and head of [`attention_ggml_f16`]: its query, its key/value head's columns (`k[j·k_row..]`
/// is position `j`'s key), the positions it sees and the chunking.
struct VectorQuery<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    k_row: usize,
    v_row: usize,
    first: usize,
    last: usize,
    chunk: usize,
    split: bool,
    /// Only these positions (ascending), as ggml skips the cells its mask sets to −∞.
    cells: Option<&'a [u32]>,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn vector_query_fma(
    one: &VectorQuery<'_>,
    p: &AttnParams,
    qh16: &mut Vec<f32>,
    acc: &mut Vec<f32>,
    o: &mut [f32],
) {
    vector_query::<x86_f16::F16c>(one, p, qh16, acc, o)
}

/// The f16-rounded vector steps of the vector path.
trait F16Steps {
    /// `acc[i] = f16(acc[i] · s)`.
    fn scale(acc: &mut [f32], s: f32);
    /// `acc[i] = f16(fma(v[i], s, acc[i]))`.
    fn mad(acc: &mut [f32], v: &[f32], s: f32);
}

/// [`F16Steps`] one value at a time.
struct PortableF16;

impl F16Steps for PortableF16 {
    #[inline(always)]
    fn scale(acc: &mut [f32], s: f32) {
        acc.iter_mut().for_each(|a| *a = round_f16(*a * s));
    }
    #[inline(always)]
    fn mad(acc: &mut [f32], v: &[f32], s: f32) {
        for (a, &x) in acc.iter_mut().zip(v) {
            *a = round_f16(x.mul_add(s, *a));
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86_f16 {
    use super::{F16Steps, PortableF16};
    use core::arch::x86_64::*;

    /// [`F16Steps`] eight values at a time with F16C conversions (round to nearest even, as ggml's
    /// `_mm256_cvtps_ph(x, 0)`). Only for code compiled with AVX2, FMA and F16C (`vector_query_fma`).
    pub(super) struct F16c;

    impl F16Steps for F16c {
        #[inline(always)]
        fn scale(acc: &mut [f32], s: f32) {
            let n8 = acc.len() / 8 * 8;
            for c in acc[..n8].chunks_exact_mut(8) {
                // SAFETY: only monomorphized into `vector_query_fma`, which runs on CPUs with AVX2,
                // FMA and F16C; `c` holds eight values.
                unsafe {
                    let r = _mm256_mul_ps(_mm256_loadu_ps(c.as_ptr()), _mm256_set1_ps(s));
                    let r = _mm256_cvtph_ps(_mm256_cvtps_ph::<0>(r));
                    _mm256_storeu_ps(c.as_mut_ptr(), r);
                }
            }
            PortableF16::scale(&mut acc[n8..], s);
        }
        #[inline(always)]
        fn mad(acc: &mut [f32], v: &[f32], s: f32) {
            let n8 = acc.len() / 8 * 8;
            for (c, x) in acc[..n8].chunks_exact_mut(8).zip(v.chunks_exact(8)) {
                // SAFETY: as in `scale`; `c` and `x` hold eight values each.
                unsafe {
                    let r = _mm256_fmadd_ps(
                        _mm256_loadu_ps(x.as_ptr()),
                        _mm256_set1_ps(s),
                        _mm256_loadu_ps(c.as_ptr()),
                    );
                    let r = _mm256_cvtph_ps(_mm256_cvtps_ph::<0>(r));
                    _mm256_storeu_ps(c.as_mut_ptr(), r);
                }
            }
            PortableF16::mad(&mut acc[n8..], &v[n8..], s);
        }
    }
}

/// The online softmax of one query and head over `positions` (in order) with the f16 accumulator:
/// `acc` gets the unnormalized weighted sum of values; returns the running maximum and sum of weights.
#[inline(always)]
fn online_softmax<F: F16Steps>(
    one: &VectorQuery<'_>,
    p: &AttnParams,
    qh16: &[f32],
    acc: &mut [f32],
    positions: impl Iterator<Item = usize>,
) -> (f32, f32) {
    let (dk, dv) = (p.head_dim_k, p.head_dim_v);
    let (mut m, mut s) = (f32::NEG_INFINITY, 0f32);
    acc.fill(0.0);
    for j in positions {
        let d = dot_f16_ggml(qh16, &one.k[j * one.k_row..][..dk]);
        let x = match p.softcap {
            // ggml folds 1/cap into the scale.
            Some(cap) => cap * (d * (p.scale / cap)).tanh(),
            None => d * p.scale,
        };
        let vj = &one.v[j * one.v_row..][..dv];
        let (ms, vs);
        if x > m {
            ms = (m - x).exp();
            m = x;
            vs = 1.0;
            F::scale(acc, ms);
        } else {
            ms = 1.0;
            vs = (x - m).exp();
        }
        F::mad(acc, vj, vs);
        // GCC contracts ggml's `S*ms + vs` into one fused multiply-add.
        s = s.mul_add(ms, vs);
    }
    (m, s)
}

/// The output of one query and head of [`attention_ggml_f16`] into `o`.
#[inline(always)]
fn vector_query<F: F16Steps>(
    one: &VectorQuery<'_>,
    p: &AttnParams,
    qh16: &mut Vec<f32>,
    acc: &mut Vec<f32>,
    o: &mut [f32],
) {
    let dv = p.head_dim_v;
    qh16.clear();
    qh16.extend(one.q.iter().map(|&x| round_f16(x)));
    acc.resize(dv, 0.0);
    let (mut m_all, mut s_all) = (f32::NEG_INFINITY, 0f32);
    o.fill(0.0);
    if let Some(cells) = one.cells {
        // A mask's live cells only, in one pass (ggml's `if (mv == -INFINITY) continue;`).
        let (_, s) = online_softmax::<F>(one, p, qh16, acc, cells.iter().map(|&j| j as usize));
        let inv = if s == 0.0 { 0.0 } else { 1.0 / s };
        o.iter_mut().zip(acc.iter()).for_each(|(y, a)| *y = a * inv);
        return;
    }
    let mut start = 0;
    while start <= one.last {
        let end = (start + one.chunk).min(one.last + 1);
        let lo = start.max(one.first);
        start += one.chunk;
        if lo >= end {
            continue;
        }
        // One chunk: the online softmax with the f16 accumulator.
        let (m, s) = online_softmax::<F>(one, p, qh16, acc, lo..end);
        if !one.split {
            let inv = if s == 0.0 { 0.0 } else { 1.0 / s };
            o.iter_mut().zip(acc.iter()).for_each(|(y, a)| *y = a * inv);
            return;
        }
        if s == 0.0 {
            continue;
        }
        // Merge the chunk into the result so far, as ggml reduces the partials (GCC fuses
        // `old·scale_old + new·scale_new` into `fma(old, scale_old, new·scale_new)`).
        let m_new = m_all.max(m);
        let (scale_old, scale_new) = ((m_all - m_new).exp(), (m - m_new).exp());
        for (y, &a) in o.iter_mut().zip(acc.iter()) {
            *y = y.mul_add(scale_old, a * scale_new);
        }
        s_all = s_all.mul_add(scale_old, s * scale_new);
        m_all = m_new;
    }
    if s_all != 0.0 {
        let inv = 1.0 / s_all;
        o.iter_mut().for_each(|y| *y *= inv);
    }
}

/// Bytes of one Q8_0 block (32 values: an f16 scale and 32 signed bytes), the unit of a Q8_0 KV row.
pub const Q8_0_BLOCK_BYTES: usize = 34;

/// Bytes of `n` values (a multiple of 32) as Q8_0 blocks.
pub fn q8_0_bytes(n: usize) -> usize {
    n / 32 * Q8_0_BLOCK_BYTES
}

/// Quantizes KV rows to Q8_0 blocks as llama.cpp's CPU backend stores them in a `q8_0` cache
/// (`ggml_set_rows` through the type's `from_float`, `quantize_row_q8_0`: on x86 `d = amax / 127` kept
/// as f16, `q = x · (127 / amax)` rounded to nearest with ties to even). `x` is a multiple of 32 values;
/// the blocks are appended to `out`.
pub fn quantize_q8_0_rows(x: &[f32], out: &mut Vec<u8>) {
    assert!(
        x.len().is_multiple_of(32),
        "Q8_0 rows: {} values are not whole blocks",
        x.len()
    );
    let at = out.len();
    out.resize(at + q8_0_bytes(x.len()), 0);
    crate::quant::ActType::Q8_0.quantize(x, &mut out[at..]);
}

/// llama.cpp's CPU flash attention over a Q8_0 KV cache (`-ctk q8_0 -ctv q8_0`,
/// `ggml_compute_forward_flash_attn_ext_f16_one_chunk`, which every batch takes with a quantized cache:
/// the tiled and split-KV paths are only for F32 and F16 caches), step for step. Shapes and visibility
/// as in [`attention`], but `k` and `v` are rows of Q8_0 blocks: position `j`'s keys are `n_head_kv ·
/// head_dim_k / 32` blocks of [`Q8_0_BLOCK_BYTES`] (head after head), its values likewise; both head
/// sizes must be multiples of 32. Per query and head:
///
/// - the query is quantized to Q8_0 (as ggml converts it to the key type's `vec_dot_type`) and each score
///   is `ggml_vec_dot_q8_0_q8_0` of the key row and the query, times `scale` (and soft-capped);
/// - the softmax is online, the running sum of values kept in f32: on a new maximum it is scaled by
///   `expf(old - new)`, else the value row (dequantized, exact) is added with weight `expf(s - max)` by
///   fused multiply-adds;
/// - at the end it is divided by the sum of weights.
///
/// Each query's result depends only on the cache and the query, not on the batch or the thread count.
pub fn attention_ggml_q8_0(
    q: &[f32],
    positions: &[u32],
    k: &[u8],
    v: &[u8],
    p: &AttnParams,
    out: &mut [f32],
) {
    let (dk, dv) = (p.head_dim_k, p.head_dim_v);
    assert!(
        dk.is_multiple_of(32) && dv.is_multiple_of(32),
        "attention: Q8_0 rows need head sizes that are multiples of 32 ({dk}, {dv})"
    );
    let n_q = positions.len();
    check_shapes_of(q, positions, (k.len(), v.len()), q8_0_bytes, p, out);
    let (k_row, v_row) = (q8_0_bytes(p.n_head_kv * dk), q8_0_bytes(p.n_head_kv * dv));
    let group = p.n_head / p.n_head_kv;
    // Where more than one query head reads each value row, the rows are dequantized once for the call
    // (exact, so the same sums), up to the last position a query sees.
    let seen = positions
        .iter()
        .map(|&x| p.last_visible(x) + 1)
        .max()
        .unwrap_or(0);
    let v_f32 = (n_q * group > 1).then(|| {
        let w = p.n_head_kv * dv;
        let mut f = vec![0f32; seen * w];
        f.par_chunks_mut(w)
            .zip(v.par_chunks(v_row))
            .with_min_len(64)
            .for_each(|(o, b)| {
                crate::quant::dequantize(crate::quant::GgmlType::Q8_0, b, o)
                    .expect("whole Q8_0 rows")
            });
        f
    });
    out.par_chunks_mut(dv).enumerate().for_each_init(
        || (Vec::new(), Vec::new()),
        |(qq, v32): &mut (Vec<u8>, Vec<f32>), (idx, o)| {
            let (i, h) = (idx / p.n_head, idx % p.n_head);
            let hk = h / group;
            let one = Q8Query {
                q: &q[(i * p.n_head + h) * dk..][..dk],
                k: &k[hk * q8_0_bytes(dk)..],
                v: match &v_f32 {
                    Some(f) => Values::F32(&f[hk * dv..], p.n_head_kv * dv),
                    None => Values::Q8_0(&v[hk * q8_0_bytes(dv)..], v_row),
                },
                k_row,
                first: p.first_visible(positions[i]),
                last: p.last_visible(positions[i]),
            };
            #[cfg(target_arch = "x86_64")]
            if crate::quant::has_avx2_fma() {
                // SAFETY: the CPU supports AVX2 and FMA (checked at run time).
                return unsafe { q8_query_fma(&one, p, qq, v32, o) };
            }
            q8_query(&one, p, qq, v32, o);
        },
    );
}

/// One query and head of [`attention_ggml_q8_0`]: its query, its key/value head's blocks (`k[j·k_row..]`
/// is position `j`'s), the positions it sees.
struct Q8Query<'a> {
    q: &'a [f32],
    k: &'a [u8],
    v: Values<'a>,
    k_row: usize,
    first: usize,
    last: usize,
}

/// The value rows of one head of [`attention_ggml_q8_0`], from its position 0, with the distance
/// between positions: the cache's blocks, or the same dequantized.
enum Values<'a> {
    Q8_0(&'a [u8], usize),
    F32(&'a [f32], usize),
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn q8_query_fma(
    one: &Q8Query<'_>,
    p: &AttnParams,
    qq: &mut Vec<u8>,
    v32: &mut Vec<f32>,
    o: &mut [f32],
) {
    q8_query(one, p, qq, v32, o)
}

/// The output of one query and head of [`attention_ggml_q8_0`] into `o`.
#[inline(always)]
fn q8_query(
    one: &Q8Query<'_>,
    p: &AttnParams,
    qq: &mut Vec<u8>,
    v32: &mut Vec<f32>,
    o: &mut [f32],
) {
    let (dk, dv) = (p.head_dim_k, p.head_dim_v);
    let kb = q8_0_bytes(dk);
    qq.clear();
    quantize_q8_0_rows(one.q, qq);
    v32.resize(dv, 0.0);
    let ops = crate::quant::GgmlType::Q8_0
        .ops()
        .expect("Q8_0 has its operations");
    let (mut m, mut s) = (f32::NEG_INFINITY, 0f32);
    o.fill(0.0);
    for j in one.first..=one.last {
        let d = (ops.vec_dot)(dk, &one.k[j * one.k_row..][..kb], qq);
        let x = match p.softcap {
            // ggml folds 1/cap into the scale.
            Some(cap) => cap * (d * (p.scale / cap)).tanh(),
            None => d * p.scale,
        };
        let (ms, vs);
        if x > m {
            ms = (m - x).exp();
            m = x;
            vs = 1.0;
            o.iter_mut().for_each(|y| *y *= ms);
        } else {
            ms = 1.0;
            vs = (x - m).exp();
        }
        let vj: &[f32] = match one.v {
            Values::Q8_0(b, row) => {
                (ops.dequantize)(&b[j * row..][..q8_0_bytes(dv)], v32);
                v32
            }
            Values::F32(f, row) => &f[j * row..][..dv],
        };
        for (y, &vv) in o.iter_mut().zip(vj) {
            *y = vv.mul_add(vs, *y);
        }
        // GCC contracts ggml's `S*ms + vs` into one fused multiply-add.
        s = s.mul_add(ms, vs);
    }
    let inv = if s == 0.0 { 0.0 } else { 1.0 / s };
    o.iter_mut().for_each(|y| *y *= inv);
}

/// The rotations llama.cpp applies around a quantized KV cache (`attn_rot_k`, `attn_rot_v` of
/// `llama_kv_cache`): queries and keys by an orthonormal Walsh-Hadamard matrix of `k` values, values by
/// one of `v` values (the attention's output rotated back by the same), so that the blocks quantize
/// vectors whose outliers are spread out. `None` where llama.cpp does not rotate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct KvRotation {
    pub k: Option<usize>,
    pub v: Option<usize>,
}

impl KvRotation {
    /// llama.cpp's choice for a quantized cache whose layers all have heads of `head_dim_k` key and
    /// `head_dim_v` value values (`None`: the layers differ, which turns the rotation off): keys by the
    /// largest power of two from 64 up that divides the head, values by 64, each only where the head is
    /// a multiple of 64.
    pub fn ggml(head_dim_k: Option<usize>, head_dim_v: Option<usize>) -> KvRotation {
        let k = head_dim_k
            .filter(|d| *d > 0 && d.is_multiple_of(64))
            .map(|d| {
                let mut n = 64;
                while d.is_multiple_of(2 * n) {
                    n *= 2;
                }
                n
            });
        let v = head_dim_v
            .filter(|d| *d > 0 && d.is_multiple_of(64))
            .map(|_| 64);
        KvRotation { k, v }
    }
}

/// Rotates every group of `n` consecutive values of `x` (`n` a power of two dividing its length) by the
/// orthonormal Walsh-Hadamard matrix, as ggml's CPU backend computes `ggml_mul_mat` with
/// `GGML_HINT_SRC0_IS_HADAMARD` (`ggml_compute_forward_fwht`): each value times `1/sqrtf(n)` first, then
/// the butterflies `(u + v, u - v)` at distances 1, 2, 4, … The matrix is its own inverse.
pub fn hadamard_ggml(x: &mut [f32], n: usize) {
    assert!(
        n.is_power_of_two() && x.len().is_multiple_of(n),
        "Hadamard rotation: {} values are not groups of {n}",
        x.len()
    );
    let scale = 1.0 / (n as f32).sqrt();
    for g in x.chunks_exact_mut(n) {
        g.iter_mut().for_each(|v| *v *= scale);
        let mut len = 1;
        while len < n {
            for i in (0..n).step_by(2 * len) {
                for j in i..i + len {
                    let (u, v) = (g[j], g[j + len]);
                    g[j] = u + v;
                    g[j + len] = u - v;
                }
            }
            len *= 2;
        }
    }
}

/// Keys per tile of llama.cpp's tiled CPU flash attention (`GGML_FA_TILE_KV`).
pub const FA_TILE_KV: usize = 64;

/// Output values per chunk of the tiled path's value sums: eight AVX2 registers, held over a tile's keys.
const V_CHUNK: usize = 64;

/// llama.cpp's CPU flash attention over an F16 KV cache for batches of at least [`GGML_FA_TILE_Q`]
/// queries (`ggml_compute_forward_flash_attn_ext_tiled`), step for step. Shapes and visibility as in
/// [`attention`]; `k` and `v` must hold f16 values. Per query and head, over the positions in tiles of 64
/// from position 0 (tiles it sees nothing of are skipped):
///
/// - each score is `q·k` summed in order with fused multiply-adds (f32 query), times `scale`;
/// - the tile's maximum updates the running maximum (rescaling the running sums by `expf` of the
///   difference), the weights are ggml's vectorized `expf` ([`ggml_v_expf`]) of score minus maximum,
///   summed eight at a time as AVX2 reduces a vector and added to the running sum in f64 (which stays
///   f32 between tiles);
/// - the values are accumulated with fused multiply-adds, key after key; the result is divided by the sum.
pub fn attention_ggml_f16_tiled(
    q: &[f32],
    positions: &[u32],
    k: &[f32],
    v: &[f32],
    p: &AttnParams,
    out: &mut [f32],
) {
    check_shapes(q, positions, k, v, p, out);
    let (n_q, dv) = (positions.len(), p.head_dim_v);
    // One task per (head, 64 queries), as llama.cpp tiles them; each returns its rows.
    let tasks: Vec<(usize, usize)> = (0..p.n_head)
        .flat_map(|h| (0..n_q).step_by(GGML_FA_TILE_Q).map(move |i0| (h, i0)))
        .collect();
    let results: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(h, i0)| {
            let rows = i0..(i0 + GGML_FA_TILE_Q).min(n_q);
            #[cfg(target_arch = "x86_64")]
            if crate::quant::has_avx2_fma() {
                // SAFETY: the CPU supports AVX2 and FMA (checked at run time).
                return unsafe { tiled_task_fma(q, positions, k, v, p, h, rows, (None, None)) };
            }
            tiled_task(q, positions, k, v, p, h, rows, (None, None))
        })
        .collect();
    for (&(h, i0), res) in tasks.iter().zip(&results) {
        for (r, o) in res.chunks_exact(dv).enumerate() {
            let i = i0 + r;
            out[(i * p.n_head + h) * dv..][..dv].copy_from_slice(o);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn tiled_task_fma(
    q: &[f32],
    positions: &[u32],
    k: &[f32],
    v: &[f32],
    p: &AttnParams,
    h: usize,
    rows: std::ops::Range<usize>,
    mask: (Option<Cells<'_>>, Option<f32>),
) -> Vec<f32> {
    tiled_task(q, positions, k, v, p, h, rows, mask)
}

/// Each query's live cells (ascending): `cells[offsets[i]..offsets[i + 1]]`.
type Cells<'a> = (&'a [u32], &'a [usize]);

/// The rows `rows` of head `h` of [`attention_ggml_f16_tiled`], `head_dim_v` values each.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn tiled_task(
    q: &[f32],
    positions: &[u32],
    k: &[f32],
    v: &[f32],
    p: &AttnParams,
    h: usize,
    rows: std::ops::Range<usize>,
    (cells, sink): (Option<Cells<'_>>, Option<f32>),
) -> Vec<f32> {
    const T: usize = FA_TILE_KV;
    let (dk, dv) = (p.head_dim_k, p.head_dim_v);
    let (k_row, v_row) = (p.n_head_kv * dk, p.n_head_kv * dv);
    let hk = h / (p.n_head / p.n_head_kv);
    let n_rows = rows.len();
    let mut out = vec![0f32; n_rows * dv];
    let mut m = vec![f32::NEG_INFINITY; n_rows];
    let mut s = vec![0f32; n_rows];
    let first = rows
        .clone()
        .map(|i| p.first_visible(positions[i]))
        .min()
        .unwrap_or(0);
    let last = rows
        .clone()
        .map(|i| p.last_visible(positions[i]))
        .max()
        .unwrap_or(0);
    // The tile's keys transposed (`kt[d·T + t]`), as ggml packs them.
    let mut kt = vec![0f32; dk * T];
    let mut scores = [0f32; T];
    let mut t0 = first / T * T;
    while t0 <= last {
        let n_keys = (t0 + T).min(last + 1) - t0;
        for t in 0..n_keys {
            let kj = &k[(t0 + t) * k_row + hk * dk..][..dk];
            for (d, &x) in kj.iter().enumerate() {
                kt[d * T + t] = x;
            }
        }
        for (r, i) in rows.clone().enumerate() {
            let lo = p.first_visible(positions[i]).max(t0);
            let hi = (t0 + T).min(p.last_visible(positions[i]) + 1);
            if lo >= hi {
                continue;
            }
            // With a cell mask: the tile's live cells of this query (a tile without any is skipped,
            // as one past the query is).
            let mut live = [true; T];
            if let Some((cells, offsets)) = cells {
                live = [false; T];
                let mine = &cells[offsets[i]..offsets[i + 1]];
                let from = mine.partition_point(|&c| (c as usize) < lo);
                for &c in mine[from..].iter().take_while(|&&c| (c as usize) < hi) {
                    live[c as usize - t0] = true;
                }
                if !live[lo - t0..hi - t0].contains(&true) {
                    continue;
                }
            }
            // Scores: q·k in order, fused, for the whole tile at once.
            let qh = &q[(i * p.n_head + h) * dk..][..dk];
            scores.fill(0.0);
            for (d, &qd) in qh.iter().enumerate() {
                let kd = &kt[d * T..(d + 1) * T];
                for (sc, &kv) in scores.iter_mut().zip(kd) {
                    *sc = kv.mul_add(qd, *sc);
                }
            }
            let (a, b) = (lo - t0, hi - t0);
            for sc in &mut scores[a..b] {
                *sc = match p.softcap {
                    Some(cap) => cap * (*sc * (p.scale / cap)).tanh(),
                    None => *sc * p.scale,
                };
            }
            let tile_max = scores[a..b]
                .iter()
                .zip(&live[a..b])
                .filter(|(_, &l)| l)
                .map(|(&x, _)| x)
                .fold(f32::NEG_INFINITY, f32::max);
            let m_new = m[r].max(tile_max);
            let o = &mut out[r * dv..(r + 1) * dv];
            if m_new > m[r] {
                let ms = (m[r] - m_new).exp();
                o.iter_mut().for_each(|x| *x *= ms);
                s[r] *= ms;
            }
            m[r] = m_new;
            // Weights, summed eight at a time (positions aligned to the tile) in f64.
            let mut sum = 0f64;
            let mut w = [0f32; T];
            for g in (a / 8)..b.div_ceil(8) {
                let mut lanes = [0f32; 8];
                for (l, lane) in lanes.iter_mut().enumerate() {
                    let t = 8 * g + l;
                    if (a..b).contains(&t) && live[t] {
                        *lane = ggml_v_expf(scores[t] - m_new);
                    }
                }
                w[8 * g..8 * g + 8].copy_from_slice(&lanes);
                sum += super::super::quant::float::sum_lanes8(&lanes) as f64;
            }
            s[r] = (s[r] as f64 + sum) as f32;
            // Values: each output element takes its fused steps key after key; chunks of the output
            // stay in registers over the keys (instead of a load and a store per key and element).
            let v_head = &v[t0 * v_row + hk * dv..];
            let mut chunks = o.chunks_exact_mut(V_CHUNK);
            for (c, oc) in chunks.by_ref().enumerate() {
                let mut acc = [0f32; V_CHUNK];
                acc.copy_from_slice(oc);
                for (t, &wt) in w.iter().enumerate().take(b).skip(a) {
                    let vj = &v_head[t * v_row + c * V_CHUNK..][..V_CHUNK];
                    for (x, &vv) in acc.iter_mut().zip(vj) {
                        *x = vv.mul_add(wt, *x);
                    }
                }
                oc.copy_from_slice(&acc);
            }
            let tail = chunks.into_remainder();
            let done = dv - tail.len();
            for (t, &wt) in w.iter().enumerate().take(b).skip(a) {
                let vj = &v_head[t * v_row + done..][..tail.len()];
                for (x, &vv) in tail.iter_mut().zip(vj) {
                    *x = vv.mul_add(wt, *x);
                }
            }
        }
        t0 += T;
    }
    for (r, o) in out.chunks_exact_mut(dv).enumerate() {
        // An attention sink (a logit without a value), as ggml's tiled path applies it.
        if let Some(sk) = sink {
            if sk > m[r] {
                let ms = (m[r] - sk).exp();
                o.iter_mut().for_each(|x| *x *= ms);
                s[r] = s[r].mul_add(ms, 1.0);
            } else {
                s[r] = s[r].mul_add(1.0, (sk - m[r]).exp());
            }
        }
        let inv = if s[r] == 0.0 { 0.0 } else { 1.0 / s[r] };
        o.iter_mut().for_each(|x| *x *= inv);
    }
    out
}

/// ggml's vectorized `expf` on AVX2 (`ggml_v_expf`), one lane: a polynomial with fused steps, exact to
/// about one ulp, and bit-identical to llama.cpp's softmax weights. `e^-∞ = 0`.
#[inline(always)]
pub fn ggml_v_expf(x: f32) -> f32 {
    let c = f32::from_bits;
    let r = c(0x4b40_0000); // 0x1.8p23
    let z = x.mul_add(c(0x3fb8_aa3b), r); // log2(e)
    let n = z - r;
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x));
    let e = z.to_bits() << 23;
    let k = f32::from_bits(e.wrapping_add(1f32.to_bits()));
    let u = b * b;
    let j = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)))
        .mul_add(u, c(0x3f7f_fff6) * b);
    if n.abs() <= 126.0 {
        return k.mul_add(j, k);
    }
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
    let s2 = f32::from_bits(e.wrapping_sub(g));
    if n.abs() > 192.0 {
        s1 * s1
    } else {
        s2.mul_add(j, s2) * s1
    }
}

/// `x` rounded to the nearest f16 value (ties to even), as an f32.
#[inline]
fn round_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// `ggml_vec_dot_f16` on AVX2 for f16 values held in f32: four 8-lane accumulators over steps of 32 with
/// fused multiply-add, reduced `(a0+a2)+(a1+a3)`, then the 8 lanes `(l0+l4)`… pairwise as `_mm_hadd_ps`
/// does; a tail (length not a multiple of 32) added one by one after.
// Always inlined: in `vector_query_fma` its `mul_add` then compiles to FMA instructions (a separate
// copy, built without FMA, called the software `fmaf` for each one).
#[inline(always)]
fn dot_f16_ggml(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [[0f32; 8]; 4];
    let n32 = a.len() / 32 * 32;
    for (xa, xb) in a[..n32].chunks_exact(32).zip(b[..n32].chunks_exact(32)) {
        for (j, lanes) in acc.iter_mut().enumerate() {
            for (l, lane) in lanes.iter_mut().enumerate() {
                *lane = xa[j * 8 + l].mul_add(xb[j * 8 + l], *lane);
            }
        }
    }
    let mut r = [0f32; 8];
    for l in 0..8 {
        r[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let t = [r[0] + r[4], r[1] + r[5], r[2] + r[6], r[3] + r[7]];
    let mut sum = ((t[0] + t[1]) + (t[2] + t[3])) as f64;
    for (x, y) in a[n32..].iter().zip(&b[n32..]) {
        sum += (x * y) as f64;
    }
    sum as f32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{max_diff, normals};
    use crate::rng::Rng;

    fn reference(q: &[f32], positions: &[u32], k: &[f32], v: &[f32], p: &AttnParams) -> Vec<f64> {
        let (dk, dv) = (p.head_dim_k, p.head_dim_v);
        let mut out = vec![0f64; positions.len() * p.n_head * dv];
        for (i, &pos) in positions.iter().enumerate() {
            for h in 0..p.n_head {
                let hk = h * p.n_head_kv / p.n_head;
                let mut s = Vec::new();
                for j in 0..=p.last_visible(pos) {
                    if let Some(w) = p.window {
                        if (pos as usize).saturating_sub(j) >= w as usize {
                            s.push(f64::NEG_INFINITY);
                            continue;
                        }
                    }
                    let mut d = 0f64;
                    for t in 0..dk {
                        d += q[(i * p.n_head + h) * dk + t] as f64
                            * k[(j * p.n_head_kv + hk) * dk + t] as f64;
                    }
                    let mut x = d * p.scale as f64;
                    if let Some(c) = p.softcap {
                        x = c as f64 * (x / c as f64).tanh();
                    }
                    s.push(x);
                }
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for (j, x) in s.iter().enumerate() {
                    let w = (x - m).exp() / z;
                    for t in 0..dv {
                        out[(i * p.n_head + h) * dv + t] +=
                            w * v[(j * p.n_head_kv + hk) * dv + t] as f64;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn attention_matches_f64_reference() {
        let mut rng = Rng::new(9);
        let n_kv = 40;
        for (n_head, n_head_kv, dk, dv, window, softcap) in [
            (4, 2, 16, 16, None, None),
            (6, 3, 8, 12, Some(5), None),
            (2, 2, 32, 8, None, Some(0.5)),
            (8, 1, 16, 16, Some(1), None),
        ] {
            let p = AttnParams {
                n_head,
                n_head_kv,
                head_dim_k: dk,
                head_dim_v: dv,
                scale: 1.0 / (dk as f32).sqrt(),
                window,
                softcap,
                sees_together: None,
            };
            let k: Vec<f32> = normals(&mut rng, n_kv * n_head_kv * dk)
                .iter()
                .map(|x| x * 2.0)
                .collect();
            let v = normals(&mut rng, n_kv * n_head_kv * dv);
            let positions: Vec<u32> = (30..40).chain([0, 3]).collect();
            let q = normals(&mut rng, positions.len() * n_head * dk);
            let mut out = vec![0f32; positions.len() * n_head * dv];
            attention(&q, &positions, &k, &v, &p, &mut out);
            let expect = reference(&q, &positions, &k, &v, &p);
            assert!(max_diff(&out, &expect) < 1e-5, "{p:?}");
        }
    }

    #[test]
    fn a_query_reads_only_its_past() {
        // Keys past the query's position must not change its output.
        let mut rng = Rng::new(10);
        let p = AttnParams {
            n_head: 2,
            n_head_kv: 1,
            head_dim_k: 4,
            head_dim_v: 4,
            scale: 0.5,
            window: None,
            softcap: None,
            sees_together: None,
        };
        let q = normals(&mut rng, 8);
        let mut k = normals(&mut rng, 4 * 10);
        let mut v = normals(&mut rng, 4 * 10);
        let mut a = vec![0f32; 8];
        attention(&q, &[5], &k, &v, &p, &mut a);
        for x in k[6 * 4..].iter_mut().chain(v[6 * 4..].iter_mut()) {
            *x = 100.0;
        }
        let mut b = vec![0f32; 8];
        attention(&q, &[5], &k, &v, &p, &mut b);
        assert_eq!(a, b);
    }

    #[test]
    fn ggml_vector_path_stays_within_f16_rounding_of_exact_attention() {
        let mut rng = Rng::new(11);
        let n_kv = 300;
        for (n_head, n_head_kv, dk, window, softcap) in [
            (4, 1, 64, None, None),
            (4, 2, 32, Some(50), None),
            (2, 2, 40, None, Some(2.0)),
        ] {
            let p = AttnParams {
                n_head,
                n_head_kv,
                head_dim_k: dk,
                head_dim_v: dk,
                scale: 1.0 / (dk as f32).sqrt(),
                window,
                softcap,
                sees_together: None,
            };
            // The cache holds f16 values, as the vector path requires.
            let f16s = |v: Vec<f32>| v.into_iter().map(round_f16).collect::<Vec<_>>();
            let k = f16s(normals(&mut rng, n_kv * n_head_kv * dk));
            let v = f16s(normals(&mut rng, n_kv * n_head_kv * dk));
            let positions: Vec<u32> = vec![299, 0, 37, 150];
            let q = normals(&mut rng, positions.len() * n_head * dk);
            let q16: Vec<f32> = q.iter().map(|&x| round_f16(x)).collect();
            let expect = reference(&q16, &positions, &k, &v, &p);
            let mut out = vec![0f32; q.len()];
            attention_ggml_f16(&q, &positions, &k, &v, &p, None, &mut out);
            // Values are summed in f16 (relative steps of 2⁻¹¹), over up to 300 terms.
            let d = max_diff(&out, &expect);
            assert!(d > 0.0 && d < 3e-3, "{p:?}: {d}");
            // The query is rounded to f16 first: a query already in f16 gives the same bits.
            let mut out16 = vec![0f32; q.len()];
            attention_ggml_f16(&q16, &positions, &k, &v, &p, None, &mut out16);
            assert_eq!(out, out16);
            // Split into chunks merged in f32 (ggml's split-KV decode): as close to exact.
            let mut chunked = vec![0f32; q.len()];
            attention_ggml_f16(&q, &positions, &k, &v, &p, Some(128), &mut chunked);
            let d = max_diff(&chunked, &expect);
            assert!(d < 3e-3, "{p:?}, chunks of 128: {d}");
            assert_ne!(chunked, out, "chunks change the f16 rounding");
        }
    }

    #[test]
    fn ggml_dot_sums_in_its_lane_order() {
        // Lane l of accumulator j collects elements 32·i + 8·j + l; the sum (a0+a2)+(a1+a3) per lane, then
        // lanes (l0+l4)+(l1+l5) and (l2+l6)+(l3+l7). Values chosen so another order rounds differently.
        let mut a = vec![0f32; 64];
        let b = vec![1f32; 64];
        a[0] = 1e8; // lane 0 of accumulator 0
        a[16] = -1e8; // lane 0 of accumulator 2: cancels first
        a[1] = 1.0; // lane 1 of accumulator 0
        a[40] = 0.5; // lane 0 of accumulator 1, second step
        let got = dot_f16_ggml(&a, &b);
        assert_eq!(got, 1.5);
        // A tail beyond a multiple of 32 is added after the reduction, in f64.
        let mut a = vec![0f32; 33];
        let mut b = vec![0f32; 33];
        a[0] = 3.0;
        b[0] = 2.0;
        a[32] = 0.25;
        b[32] = 4.0;
        assert_eq!(dot_f16_ggml(&a, &b), 7.0);
    }

    #[test]
    fn ggml_tiled_path_matches_exact_attention_and_sees_only_its_window() {
        let mut rng = Rng::new(12);
        let n_kv = 200;
        for (n_head, n_head_kv, dk, window, softcap) in [
            (4, 1, 64, None, None),
            (4, 2, 32, Some(70), None),
            (2, 2, 16, None, Some(3.0)),
        ] {
            let p = AttnParams {
                n_head,
                n_head_kv,
                head_dim_k: dk,
                head_dim_v: dk,
                scale: 1.0 / (dk as f32).sqrt(),
                window,
                softcap,
                sees_together: None,
            };
            let f16s = |v: Vec<f32>| v.into_iter().map(round_f16).collect::<Vec<_>>();
            let k = f16s(normals(&mut rng, n_kv * n_head_kv * dk));
            let v = f16s(normals(&mut rng, n_kv * n_head_kv * dk));
            // 70 queries: two query tiles, positions across several key tiles.
            let positions: Vec<u32> = (130..200).collect();
            let q = normals(&mut rng, positions.len() * n_head * dk);
            let mut out = vec![0f32; q.len()];
            attention_ggml_f16_tiled(&q, &positions, &k, &v, &p, &mut out);
            let d = max_diff(&out, &reference(&q, &positions, &k, &v, &p));
            assert!(d < 1e-5, "{p:?}: {d}");
            // Keys past a query, or before its window, do not change it.
            let (mut k2, mut v2) = (k.clone(), v.clone());
            let (row_k, row_v) = (n_head_kv * dk, n_head_kv * dk);
            for j in (150..200).chain(0..10) {
                k2[j * row_k..(j + 1) * row_k].fill(7.0);
                v2[j * row_v..(j + 1) * row_v].fill(-7.0);
            }
            let first_query = [130u32, 140, 149];
            let qs = &q[..first_query.len() * n_head * dk];
            let (mut a, mut b) = (vec![0f32; qs.len()], vec![0f32; qs.len()]);
            attention_ggml_f16_tiled(qs, &first_query, &k, &v, &p, &mut a);
            attention_ggml_f16_tiled(qs, &first_query, &k2, &v2, &p, &mut b);
            assert_eq!(a == b, window.is_some_and(|w| w <= 120), "{p:?}");
        }
    }

    /// Q8_0 rows of `x` and their dequantized values.
    fn q8_0_rows(x: &[f32]) -> (Vec<u8>, Vec<f32>) {
        let mut b = Vec::new();
        quantize_q8_0_rows(x, &mut b);
        let mut back = vec![0f32; x.len()];
        crate::quant::dequantize(crate::quant::GgmlType::Q8_0, &b, &mut back).unwrap();
        (b, back)
    }

    #[test]
    fn ggml_q8_0_path_is_attention_over_the_dequantized_cache() {
        let mut rng = Rng::new(13);
        let n_kv = 150;
        for (n_head, n_head_kv, dk, dv, window, softcap) in [
            (4, 1, 64, 64, None, None),
            (4, 2, 32, 64, Some(50), None),
            (2, 2, 64, 32, None, Some(2.0)),
        ] {
            let p = AttnParams {
                n_head,
                n_head_kv,
                head_dim_k: dk,
                head_dim_v: dv,
                scale: 1.0 / (dk as f32).sqrt(),
                window,
                softcap,
                sees_together: None,
            };
            let (kq, k) = q8_0_rows(&normals(&mut rng, n_kv * n_head_kv * dk));
            let (vq, v) = q8_0_rows(&normals(&mut rng, n_kv * n_head_kv * dv));
            assert_eq!(kq.len(), n_kv * n_head_kv * dk / 32 * 34);
            let positions: Vec<u32> = vec![149, 0, 37, 100, 120];
            let q = normals(&mut rng, positions.len() * n_head * dk);
            let mut out = vec![0f32; positions.len() * n_head * dv];
            attention_ggml_q8_0(&q, &positions, &kq, &vq, &p, &mut out);
            // Against exact attention over the dequantized cache with the query quantized as well:
            // only f32 rounding apart.
            let qd: Vec<f32> = q.chunks(dk).flat_map(|h| q8_0_rows(h).1).collect();
            let d = max_diff(&out, &reference(&qd, &positions, &k, &v, &p));
            assert!(d < 1e-5, "{p:?}: {d}");
            // Each query alone gives the same bits as in the batch.
            for (i, &pos) in positions.iter().enumerate() {
                let qi = &q[i * n_head * dk..(i + 1) * n_head * dk];
                let mut one = vec![0f32; n_head * dv];
                attention_ggml_q8_0(qi, &[pos], &kq, &vq, &p, &mut one);
                assert_eq!(one, out[i * n_head * dv..(i + 1) * n_head * dv], "{p:?}");
            }
            // Positions past a query, or before its window, do not change it.
            let (mut k2, mut v2) = (kq.clone(), vq.clone());
            let (rk, rv) = (q8_0_bytes(n_head_kv * dk), q8_0_bytes(n_head_kv * dv));
            for j in (38..150).chain(0..3) {
                k2[j * rk + 2..(j + 1) * rk].fill(9);
                v2[j * rv + 2..(j + 1) * rv].fill(247);
            }
            let (mut a, mut b) = (vec![0f32; n_head * dv], vec![0f32; n_head * dv]);
            let q37 = &q[2 * n_head * dk..3 * n_head * dk];
            attention_ggml_q8_0(q37, &[37], &kq, &vq, &p, &mut a);
            attention_ggml_q8_0(q37, &[37], &k2, &v2, &p, &mut b);
            assert_eq!(a == b, window.is_some_and(|w| w <= 35), "{p:?}");
        }
    }

    #[test]
    fn rows_that_see_each_other_see_the_later_ones_on_every_path() {
        // Positions 20..=29 see each other (a picture's rows), in a window of 8; the query at 35 and
        // those before 20 stay causal.
        let mut rng = Rng::new(15);
        let (n_head, n_head_kv, d, n_kv) = (4, 2, 32, 40);
        let causal = AttnParams {
            n_head,
            n_head_kv,
            head_dim_k: d,
            head_dim_v: d,
            scale: 1.0 / (d as f32).sqrt(),
            window: Some(8),
            softcap: None,
            sees_together: None,
        };
        let p = AttnParams {
            sees_together: Some((20, 29)),
            ..causal
        };
        let f16s = |v: Vec<f32>| v.into_iter().map(round_f16).collect::<Vec<_>>();
        let k = f16s(normals(&mut rng, n_kv * n_head_kv * d));
        let v = f16s(normals(&mut rng, n_kv * n_head_kv * d));
        let positions: Vec<u32> = vec![20, 24, 29, 35, 5];
        let q = f16s(normals(&mut rng, positions.len() * n_head * d));
        let expect = reference(&q, &positions, &k, &v, &p);
        let run = |f: &dyn Fn(&AttnParams, &mut [f32])| {
            let mut out = vec![0f32; q.len()];
            f(&p, &mut out);
            let mut causal_out = vec![0f32; q.len()];
            f(&causal, &mut causal_out);
            (out, causal_out)
        };
        let row = n_head * d;
        type Path<'a> = (&'a str, &'a dyn Fn(&AttnParams, &mut [f32]));
        let paths: [Path; 3] = [
            ("f32", &|p, o| attention(&q, &positions, &k, &v, p, o)),
            ("vector", &|p, o| {
                attention_ggml_f16(&q, &positions, &k, &v, p, None, o)
            }),
            ("tiled", &|p, o| {
                attention_ggml_f16_tiled(&q, &positions, &k, &v, p, o)
            }),
        ];
        for (name, f) in paths {
            let (out, causal_out) = run(f);
            let d = max_diff(&out, &expect);
            assert!(d < 2e-3, "{name}: {d}");
            // The picture's rows before its last changed (they see later rows); its last row, which
            // has none to see, and the rows outside it did not.
            for i in 0..2 {
                assert_ne!(
                    out[i * row..][..row],
                    causal_out[i * row..][..row],
                    "{name}"
                );
            }
            assert_eq!(out[2 * row..], causal_out[2 * row..], "{name}");
        }
        // Over a Q8_0 cache: the same visibility (checked by keys past the picture not mattering and
        // its last rows mattering to its first row).
        let (kq, _) = q8_0_rows(&k);
        let (vq, _) = q8_0_rows(&v);
        let q20 = &q[..row];
        let rk = q8_0_bytes(n_head_kv * d);
        let changed = |rows: std::ops::Range<usize>| {
            let mut k2 = kq.clone();
            for j in rows {
                k2[j * rk + 2..(j + 1) * rk].fill(9);
            }
            let (mut a, mut b) = (vec![0f32; row], vec![0f32; row]);
            attention_ggml_q8_0(q20, &[20], &kq, &vq, &p, &mut a);
            attention_ggml_q8_0(q20, &[20], &k2, &vq, &p, &mut b);
            a != b
        };
        assert!(changed(29..30), "row 20 sees the picture's last row");
        assert!(!changed(30..40), "nor anything after the picture");
        assert!(!changed(0..13), "nor anything before its window");
    }

    #[test]
    fn q8_0_rows_are_34_bytes_a_block_and_round_as_ggml_stores_them() {
        // The largest magnitude 127 makes 127/amax exactly 1: each quant is the value rounded, ties to
        // even as ggml's x86 quantize_row_q8_0 does (its reference rounds them away from zero).
        let mut x = vec![0.25f32; 64];
        x[..4].copy_from_slice(&[0.5, 1.5, -2.5, 126.5]);
        x[31] = 127.0;
        x[32..].fill(0.0);
        x[32 + 5] = -0.0;
        let (b, back) = q8_0_rows(&x);
        assert_eq!(b.len(), 2 * 34);
        assert_eq!(u16::from_le_bytes([b[0], b[1]]), 0x3c00, "d = 1");
        assert_eq!(
            b[2..6].iter().map(|&q| q as i8).collect::<Vec<_>>(),
            [0, 2, -2, 126]
        );
        assert_eq!(b[34..36], [0, 0], "an all-zero block has d = 0");
        assert!(back[32..].iter().all(|&x| x == 0.0));
        assert_eq!(back[31], 127.0);
    }

    #[test]
    fn the_hadamard_rotation_is_sylvesters_matrix_and_its_own_inverse() {
        // Column j of the rotation of unit vector i: (-1)^popcount(i & j) / sqrt(n).
        for n in [64usize, 128, 256] {
            for i in [0usize, 1, 5, n - 1] {
                let mut x = vec![0f32; n];
                x[i] = 1.0;
                hadamard_ggml(&mut x, n);
                for (j, &y) in x.iter().enumerate() {
                    let sign = if (i & j).count_ones() % 2 == 0 {
                        1.0
                    } else {
                        -1.0
                    };
                    assert_eq!(y, sign / (n as f32).sqrt(), "n {n}, e{i}, value {j}");
                }
            }
        }
        let mut rng = Rng::new(14);
        let x = normals(&mut rng, 4 * 128);
        let mut y = x.clone();
        hadamard_ggml(&mut y, 128);
        let norm = |v: &[f32]| v.iter().map(|a| (*a as f64).powi(2)).sum::<f64>();
        assert!((norm(&x[..128]) - norm(&y[..128])).abs() < 1e-4 * norm(&x[..128]));
        hadamard_ggml(&mut y, 128);
        assert!(max_diff(&y, &x.iter().map(|&a| a as f64).collect::<Vec<_>>()) < 1e-5);
        // llama.cpp's choice of sizes.
        assert_eq!(
            KvRotation::ggml(Some(64), Some(64)),
            KvRotation {
                k: Some(64),
                v: Some(64)
            }
        );
        assert_eq!(
            KvRotation::ggml(Some(256), Some(256)),
            KvRotation {
                k: Some(256),
                v: Some(64)
            }
        );
        assert_eq!(
            KvRotation::ggml(Some(192), Some(128)),
            KvRotation {
                k: Some(64),
                v: Some(64)
            }
        );
        assert_eq!(KvRotation::ggml(Some(96), None), KvRotation::default());
    }

    #[test]
    fn ggml_v_expf_is_within_two_ulps_of_exp() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let got = ggml_v_expf(x) as f64;
            let want = (x as f64).exp();
            assert!(
                ((got - want) / want).abs() < 2.5e-7,
                "e^{x}: {got} vs {want}"
            );
            x += 0.0137;
        }
        assert_eq!(ggml_v_expf(0.0), 1.0);
        assert_eq!(ggml_v_expf(f32::NEG_INFINITY), 0.0);
        assert_eq!(ggml_v_expf(-200.0), 0.0);
        assert!(ggml_v_expf(100.0).is_infinite());
    }
}
