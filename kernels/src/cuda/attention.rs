//! Attention over an f16 KV cache on the card (`kernels/cuda/attention.cu`): one launch for a decode step or
//! a prompt batch, the context optionally split into chunks (split-K) whose partial results a second launch
//! merges, and a flash-decoding launch for one token ([`attention_decode_f16`]). The arithmetic is the
//! CPU's [`crate::ops::attention::attention`] (f32 scores and an online softmax in f32) over keys and values
//! stored as f16.

use super::module::KernelModule;
use super::ops::{as_i32, check_len, invalid};
use super::{BlockQ8_1, CudaResult, Device, DeviceBuffer};
use crate::ops::attention::AttnParams;
use cudarc::driver::LaunchConfig;

/// Keys per tile of the kernel (`ATT_KEYS`); a split's chunk is a multiple of it.
pub const ATTN_KEY_TILE: usize = 32;
/// Largest head dimension the kernel takes (`ATT_MAX_D`).
pub const ATTN_MAX_HEAD_DIM: usize = 256;
/// Rows ((query, head) pairs of one KV head) per warp (`ATT_ROWS_PER_WARP`).
const ROWS_PER_WARP: usize = 4;
/// Shared memory a block may use without opting in.
const SHARED_LIMIT: usize = 48 * 1024;

/// The kernel's argument struct (`AttnArgs` in attention.cu), field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct AttnArgs {
    n_q: i32,
    n_kv: i32,
    n_head: i32,
    n_head_kv: i32,
    dk: i32,
    dv: i32,
    k_stride_row: i32,
    scale: f32,
    softcap: f32,
    window: i32,
    chunk: i32,
    n_split: i32,
}

// Passed by its bytes: a plain `repr(C)` struct of 32-bit numbers, laid out as the kernel's `AttnArgs`.
super::launch::value_args!(AttnArgs);

/// How the context is cut: `chunk` keys per split (a multiple of [`ATTN_KEY_TILE`]); the grid has
/// `ceil(n_kv / chunk)` splits, so a graph captured for a cache of `n_kv` positions replays at any position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnSplit {
    pub chunk: usize,
}

impl AttnSplit {
    /// No split: one chunk covering the whole cache.
    pub fn none(n_kv: usize) -> Self {
        AttnSplit {
            chunk: n_kv.div_ceil(ATTN_KEY_TILE).max(1) * ATTN_KEY_TILE,
        }
    }

    /// A split that gives about `target_blocks` thread blocks (say two per SM) for `n_q` queries over a
    /// cache of `n_kv` positions, with chunks of at least 256 keys (below that the merge costs more than
    /// the parallelism gains).
    pub fn for_occupancy(p: &AttnParams, n_q: usize, n_kv: usize, target_blocks: usize) -> Self {
        let blocks = tile_blocks(p, n_q) * p.n_head_kv;
        let splits = target_blocks.div_ceil(blocks.max(1)).max(1);
        let chunk = n_kv.div_ceil(splits).max(256);
        AttnSplit {
            chunk: chunk.div_ceil(ATTN_KEY_TILE) * ATTN_KEY_TILE,
        }
    }

    /// Splits of a cache of `n_kv` positions.
    pub fn n_split(&self, n_kv: usize) -> usize {
        n_kv.div_ceil(self.chunk).max(1)
    }

    /// Floats of the scratch buffer [`attention_f16`] needs for `n_q` queries (0 without a split).
    pub fn scratch_len(&self, p: &AttnParams, n_q: usize, n_kv: usize) -> usize {
        let n = self.n_split(n_kv);
        if n == 1 {
            0
        } else {
            n * n_q * p.n_head * (p.head_dim_v + 2)
        }
    }
}

/// Warps per block and shared bytes for these head dimensions (4 warps when that fits in 48 KiB).
fn block_shape(p: &AttnParams) -> (usize, usize) {
    let k_stride = k_stride_row(p.head_dim_k);
    let bytes = |warps: usize| {
        warps * ROWS_PER_WARP * p.head_dim_k * 4
            + ATTN_KEY_TILE * k_stride * 2
            + ATTN_KEY_TILE * p.head_dim_v * 2
    };
    let warps = (1..=4)
        .rev()
        .find(|&w| bytes(w) <= SHARED_LIMIT)
        .unwrap_or(1);
    (warps, bytes(warps))
}

/// Staged key rows are padded to an odd number of 32-bit words, so the 32 lanes reading 32 keys hit 32
/// banks.
fn k_stride_row(dk: usize) -> usize {
    if (dk / 2).is_multiple_of(2) {
        dk + 2
    } else {
        dk + 4
    }
}

fn tile_blocks(p: &AttnParams, n_q: usize) -> usize {
    let (warps, _) = block_shape(p);
    let group = p.n_head / p.n_head_kv.max(1);
    (n_q * group).div_ceil(warps * ROWS_PER_WARP)
}

/// Attention of `n_q` queries over an f16 KV cache of `n_kv` positions.
///
/// `q` `[n_q, n_head·head_dim_k]`, `positions` `[n_q]` (each below `n_kv`; read on the card, so a graph
/// replays at new positions), `k` `[n_kv, n_head_kv·head_dim_k]` and `v` `[n_kv, n_head_kv·head_dim_v]` f16
/// bits, `out` `[n_q, n_head·head_dim_v]`; `scratch` (needed when the split cuts the cache) holds
/// [`AttnSplit::scratch_len`] floats.
#[allow(clippy::too_many_arguments)]
pub fn attention_f16(
    dev: &Device,
    q: &DeviceBuffer<f32>,
    positions: &DeviceBuffer<i32>,
    k: &DeviceBuffer<u16>,
    v: &DeviceBuffer<u16>,
    p: &AttnParams,
    split: AttnSplit,
    scratch: Option<&mut DeviceBuffer<f32>>,
    out: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    let cache = KvCacheView { k, v, n_kv: None };
    attention_f16_cache(dev, q, positions, cache, p, split, scratch, out)
}

/// The keys and values [`attention_f16_cache`] reads: the first `n_kv` rows of `k` and `v` (all of them when
/// `None`), so a cache allocated for the whole context is read only as far as it is filled.
#[derive(Clone, Copy, Debug)]
pub struct KvCacheView<'a> {
    pub k: &'a DeviceBuffer<u16>,
    pub v: &'a DeviceBuffer<u16>,
    pub n_kv: Option<usize>,
}

/// [`attention_f16`] over the first `cache.n_kv` rows of a larger cache.
#[allow(clippy::too_many_arguments)]
pub fn attention_f16_cache(
    dev: &Device,
    q: &DeviceBuffer<f32>,
    positions: &DeviceBuffer<i32>,
    cache: KvCacheView<'_>,
    p: &AttnParams,
    split: AttnSplit,
    scratch: Option<&mut DeviceBuffer<f32>>,
    out: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    let KvCacheView { k, v, n_kv } = cache;
    let n_kv_given = n_kv;

    let (dk, dv) = (p.head_dim_k, p.head_dim_v);
    if p.n_head_kv == 0 || !p.n_head.is_multiple_of(p.n_head_kv) || dk == 0 || dv == 0 {
        return invalid(format!("attention: bad heads {p:?}"));
    }
    if dk > ATTN_MAX_HEAD_DIM || dv > ATTN_MAX_HEAD_DIM || !dk.is_multiple_of(2) {
        return invalid(format!(
            "attention: head dims {dk}/{dv} (even, at most {ATTN_MAX_HEAD_DIM})"
        ));
    }
    if split.chunk == 0 || !split.chunk.is_multiple_of(ATTN_KEY_TILE) {
        return invalid(format!("attention: chunk {}", split.chunk));
    }
    let n_q = positions.len();
    check_len("attention q", q, n_q * p.n_head * dk)?;
    check_len("attention out", out, n_q * p.n_head * dv)?;
    let k_row = p.n_head_kv * dk;
    if k.is_empty() || !k.len().is_multiple_of(k_row) {
        return invalid(format!("attention: k of {} values", k.len()));
    }
    let n_kv = match n_kv {
        Some(n) => n,
        None => k.len() / k_row,
    };
    if n_kv == 0 || n_kv * k_row > k.len() || n_kv * p.n_head_kv * dv > v.len() {
        return invalid(format!(
            "attention: {n_kv} cache rows of k {} / v {} values",
            k.len(),
            v.len()
        ));
    }
    if n_kv_given.is_none() {
        check_len("attention v", v, n_kv * p.n_head_kv * dv)?;
    }
    let n_split = split.n_split(n_kv);
    let scratch = match scratch {
        Some(s) if n_split > 1 => {
            check_len("attention scratch", s, split.scratch_len(p, n_q, n_kv))?;
            Some(s)
        }
        _ if n_split > 1 => return invalid("attention: a split needs scratch".to_string()),
        _ => None,
    };
    if n_q == 0 {
        return Ok(());
    }
    let (warps, shared) = block_shape(p);
    let args = AttnArgs {
        n_q: as_i32("n_q", n_q)?,
        n_kv: as_i32("n_kv", n_kv)?,
        n_head: as_i32("n_head", p.n_head)?,
        n_head_kv: as_i32("n_head_kv", p.n_head_kv)?,
        dk: dk as i32,
        dv: dv as i32,
        k_stride_row: k_stride_row(dk) as i32,
        scale: p.scale,
        softcap: p.softcap.unwrap_or(0.0),
        window: p.window.map_or(Ok(0), |w| as_i32("window", w as usize))?,
        chunk: as_i32("chunk", split.chunk)?,
        n_split: as_i32("n_split", n_split)?,
    };
    let cfg = LaunchConfig {
        grid_dim: (
            tile_blocks(p, n_q) as u32,
            p.n_head_kv as u32,
            n_split as u32,
        ),
        block_dim: (32, warps as u32, 1),
        shared_mem_bytes: shared as u32,
    };
    let f = dev.function(KernelModule::Attention, "attn_f16")?;
    let mut b = dev.launch_builder(&f);
    // `partial` goes as a device address: scratch with a split; without one the kernel never touches it
    // (out's address stands in).
    b.arg(q.slice())
        .arg(positions.slice())
        .arg(k.slice())
        .arg(v.slice());
    let partial_ptr: u64 = scratch.as_ref().map_or(out.address(), |s| s.address());
    b.arg(out.slice_mut()).arg(&partial_ptr).arg(&args);
    // SAFETY: q, out, k, v, positions and scratch have the lengths checked above; the kernel reads keys and
    // values only below n_kv and writes out (one split) or scratch (several); the shared memory is sized by
    // block_shape as the kernel lays it out.
    unsafe { b.launch(cfg) }?;
    dev.after_launch("attn_f16")?;
    if let Some(scratch) = scratch {
        let rows = n_q * p.n_head;
        let f = dev.function(KernelModule::Attention, "attn_reduce")?;
        let mut b = dev.launch_builder(&f);
        let (rows_i, dv_i, split_i) = (as_i32("rows", rows)?, dv as i32, n_split as i32);
        b.arg(scratch.slice())
            .arg(out.slice_mut())
            .arg(&rows_i)
            .arg(&dv_i)
            .arg(&split_i);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: scratch holds n_split × rows × (dv + 2) floats and out rows × dv (checked above).
        unsafe { b.launch(cfg) }?;
        dev.after_launch("attn_reduce")?;
    }
    Ok(())
}

/// Most splits of a one-token attention ([`attention_decode_f16`], `ATD_MAX_SPLIT`).
pub const DECODE_MAX_SPLIT: usize = 256;
/// Largest GQA group (query heads per KV head) the one-token kernel takes (`ATD_MAX_G`).
const DECODE_MAX_GROUP: usize = 8;

/// The one-token kernel's argument struct (`AttnDecodeArgs` in attention.cu), field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct AttnDecodeArgs {
    n_kv: i32,
    n_head: i32,
    n_head_kv: i32,
    d: i32,
    scale: f32,
    softcap: f32,
    window: i32,
    n_split: i32,
}

// Passed by its bytes: a plain `repr(C)` struct of 32-bit numbers, laid out as the kernel's `AttnDecodeArgs`.
super::launch::value_args!(AttnDecodeArgs);

/// Whether [`attention_decode_f16`] takes these heads: equal key and value dims of 32, 64, 128 or 256 and
/// at most 8 query heads per KV head (other shapes use [`attention_f16_cache`]).
pub fn decode_takes(p: &AttnParams) -> bool {
    p.head_dim_k == p.head_dim_v
        && matches!(p.head_dim_k, 32 | 64 | 128 | 256)
        && p.n_head_kv > 0
        && p.n_head.is_multiple_of(p.n_head_kv)
        && p.n_head / p.n_head_kv <= DECODE_MAX_GROUP
}

/// How [`attention_decode_f16`] cuts a token's attention into blocks: `n_split` parts of the keys it sees,
/// and each GQA group's heads in blocks of `heads_per_block` ([`decode_heads_per_block`]: 1, 2 or 4 dividing
/// the group; the group's size or more: the whole group). Every cut of the heads gives the same bits; more
/// blocks of fewer heads are shorter (a block's warps run the dot products, shuffles and merge of its heads
/// only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeSplit {
    pub n_split: usize,
    pub heads_per_block: usize,
}

impl DecodeSplit {
    /// `n_split` parts of the keys, a block per GQA group.
    pub fn keys(n_split: usize) -> Self {
        DecodeSplit {
            n_split,
            heads_per_block: usize::MAX,
        }
    }
}

/// The heads per block the kernel takes for a GQA group of `group` heads when `wanted` are asked for: the
/// largest of the whole group, 4, 2 and 1 that is at most `wanted` (and at least 1) and divides the group.
pub fn decode_heads_per_block(group: usize, wanted: usize) -> usize {
    if group <= wanted.max(1) {
        return group;
    }
    [4, 2, 1]
        .into_iter()
        .find(|&h| h <= wanted && group.is_multiple_of(h))
        .unwrap_or(1)
}

/// Floats of the scratch [`attention_decode_f16`] needs with `n_split` splits (0 for one).
pub fn decode_scratch_len(p: &AttnParams, n_split: usize) -> usize {
    if n_split <= 1 {
        0
    } else {
        n_split * p.n_head * (p.head_dim_v + 2)
    }
}

/// The cache a one-token attention reads: the first `n_kv` rows of `k` and `v` as they are
/// ([`DecodeCache::Read`]), or after storing the token's own key and value (`k_new`, `v_new`, f32
/// `[n_head_kv·d]`) into the row of its position, as f16 ([`DecodeCache::Store`]: the store and the
/// attention in one launch, the values `kv_store_f16_pos` would store).
pub enum DecodeCache<'a> {
    Read(KvCacheView<'a>),
    Store {
        k_new: &'a DeviceBuffer<f32>,
        v_new: &'a DeviceBuffer<f32>,
        k: &'a mut DeviceBuffer<u16>,
        v: &'a mut DeviceBuffer<u16>,
        n_kv: usize,
    },
}

/// Attention of one token's query over the first `n_kv` rows of an f16 KV cache (flash decoding):
/// `split.n_split` blocks per KV head (times the group's blocks, [`DecodeSplit`]) each take an equal part
/// of the keys the token sees, cut from its position read on the card (`positions` `[1]`), so a graph
/// captured for a bucket of cache rows reads only the rows up to the position whatever the bucket; each
/// block reads a key and value row once for all its heads. `q` `[n_head·d]`, `out` `[n_head·d]`; `scratch`
/// holds [`decode_scratch_len`] floats when `n_split > 1` (a second launch merges the splits). The shapes
/// must pass [`decode_takes`].
#[allow(clippy::too_many_arguments)]
pub fn attention_decode_f16(
    dev: &Device,
    q: &DeviceBuffer<f32>,
    positions: &DeviceBuffer<i32>,
    cache: DecodeCache<'_>,
    p: &AttnParams,
    split: DecodeSplit,
    scratch: Option<&mut DeviceBuffer<f32>>,
    (out, out_q): (&mut DeviceBuffer<f32>, Option<&mut DeviceBuffer<BlockQ8_1>>),
) -> CudaResult<()> {
    if !decode_takes(p) {
        return invalid(format!("attention_decode: heads {p:?}"));
    }
    let n_split = split.n_split;
    let group = p.n_head / p.n_head_kv;
    let (name, group_blocks) = match split.heads_per_block {
        h if h >= group => ("attn_decode_f16", 1),
        1 => ("attn_decode_f16_g1", group),
        2 if group.is_multiple_of(2) => ("attn_decode_f16_g2", group / 2),
        4 if group.is_multiple_of(4) => ("attn_decode_f16_g4", group / 4),
        h => {
            return invalid(format!(
                "attention_decode: {h} heads a block of a group of {group} (1, 2 or 4 dividing it)"
            ))
        }
    };
    if n_split == 0 || n_split > DECODE_MAX_SPLIT {
        return invalid(format!("attention_decode: {n_split} splits"));
    }
    let d = p.head_dim_k;
    let row = p.n_head_kv * d;
    let (k_len, v_len, n_kv) = match &cache {
        DecodeCache::Read(c) => (c.k.len(), c.v.len(), c.n_kv.unwrap_or(c.k.len() / row)),
        DecodeCache::Store {
            k_new,
            v_new,
            k,
            v,
            n_kv,
        } => {
            check_len("attention_decode k_new", k_new, row)?;
            check_len("attention_decode v_new", v_new, row)?;
            (k.len(), v.len(), *n_kv)
        }
    };
    check_len("attention_decode positions", positions, 1)?;
    check_len("attention_decode q", q, p.n_head * d)?;
    check_len("attention_decode out", out, p.n_head * d)?;
    // The quantized copy comes from the merge of several splits, whose blocks hold 32 values each.
    let out_q = match out_q {
        Some(q) if n_split > 1 && d.is_multiple_of(BlockQ8_1::ELEMS) => {
            check_len("attention_decode out_q", q, p.n_head * d / BlockQ8_1::ELEMS)?;
            Some(q)
        }
        Some(_) => {
            return invalid(format!(
                "attention_decode: a quantized output needs several splits and heads of 32k values ({n_split} splits, d {d})"
            ))
        }
        None => None,
    };
    if n_kv == 0 || n_kv * row > k_len || n_kv * row > v_len {
        return invalid(format!(
            "attention_decode: {n_kv} cache rows of k {k_len} / v {v_len} values"
        ));
    }
    let scratch = match scratch {
        Some(s) if n_split > 1 => {
            check_len(
                "attention_decode scratch",
                s,
                decode_scratch_len(p, n_split),
            )?;
            Some(s)
        }
        _ if n_split > 1 => return invalid("attention_decode: a split needs scratch".to_string()),
        _ => None,
    };
    let args = AttnDecodeArgs {
        n_kv: as_i32("n_kv", n_kv)?,
        n_head: as_i32("n_head", p.n_head)?,
        n_head_kv: as_i32("n_head_kv", p.n_head_kv)?,
        d: d as i32,
        scale: p.scale,
        softcap: p.softcap.unwrap_or(0.0),
        window: p.window.map_or(Ok(0), |w| as_i32("window", w as usize))?,
        n_split: n_split as i32,
    };
    let cfg = LaunchConfig {
        grid_dim: (n_split as u32, p.n_head_kv as u32, group_blocks as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let f = dev.function(KernelModule::Attention, name)?;
    let mut b = dev.launch_builder(&f);
    b.arg(q.slice()).arg(positions.slice());
    // Without a store k_new and v_new go as null.
    let null: u64 = 0;
    match cache {
        DecodeCache::Read(c) => {
            b.arg(c.k.slice()).arg(c.v.slice()).arg(&null).arg(&null);
        }
        DecodeCache::Store {
            k_new, v_new, k, v, ..
        } => {
            b.arg(k.slice_mut())
                .arg(v.slice_mut())
                .arg(k_new.slice())
                .arg(v_new.slice());
        }
    }
    // `partial` goes as a device address: scratch with a split; without one the kernel never touches it.
    let partial_ptr: u64 = scratch.as_ref().map_or(out.address(), |s| s.address());
    b.arg(out.slice_mut()).arg(&partial_ptr).arg(&args);
    // SAFETY: q and out hold n_head·d floats, positions one value, k and v at least n_kv rows, k_new and
    // v_new (with a store) n_head_kv·d floats (checked above); the kernel reads cache rows only up to
    // min(position, n_kv − 1) with 16-byte loads (d a multiple of 8 and rows of n_head_kv·d f16 keep them
    // aligned), writes the position's row only with a store (the caches then borrowed mutably; one block
    // of each group's), and writes out (one split) or scratch (several: decode_scratch_len floats), each
    // head by the one block of its part of the group (grid z: group_blocks, checked above).
    unsafe { b.launch(cfg) }?;
    dev.after_launch(name)?;
    if let Some(scratch) = scratch {
        let f = dev.function(KernelModule::Attention, "attn_decode_reduce")?;
        let mut b = dev.launch_builder(&f);
        let (heads, d_i, split_i) = (p.n_head as i32, d as i32, n_split as i32);
        b.arg(scratch.slice()).arg(out.slice_mut());
        match out_q {
            Some(q) => b.arg(q.slice_mut()),
            None => b.arg(&null),
        };
        b.arg(&heads).arg(&d_i).arg(&split_i);
        let cfg = LaunchConfig {
            grid_dim: (p.n_head as u32, d.div_ceil(32) as u32, 1),
            block_dim: (32, 8, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: scratch holds n_split × n_head × (d + 2) floats, out n_head × d and out_q (or null)
        // n_head × d / 32 blocks with d a multiple of 32 (checked above).
        unsafe { b.launch(cfg) }?;
        dev.after_launch("attn_decode_reduce")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(n_head: usize, n_head_kv: usize, d: usize) -> AttnParams {
        AttnParams {
            n_head,
            n_head_kv,
            head_dim_k: d,
            head_dim_v: d,
            scale: 1.0,
            window: None,
            softcap: None,
            sees_together: None,
        }
    }

    #[test]
    fn blocks_fit_the_shared_memory_and_pad_keys_to_odd_words() {
        for d in [16, 64, 80, 96, 128, 256] {
            let (warps, bytes) = block_shape(&params(8, 2, d));
            assert!(bytes <= SHARED_LIMIT && warps >= 1, "d {d}");
            assert_eq!((k_stride_row(d) / 2) % 2, 1, "d {d}");
        }
        assert_eq!(block_shape(&params(8, 2, 128)).0, 4);
    }

    #[test]
    fn splits_cover_the_cache_in_whole_tiles() {
        let p = params(32, 4, 128);
        let s = AttnSplit::for_occupancy(&p, 1, 8000, 264);
        assert_eq!(s.chunk % ATTN_KEY_TILE, 0);
        assert!(s.n_split(8000) * s.chunk >= 8000 && s.n_split(8000) > 1);
        assert_eq!(AttnSplit::none(100).n_split(100), 1);
        assert_eq!(s.scratch_len(&p, 1, 8000), s.n_split(8000) * 32 * 130);
    }

    #[test]
    fn the_decode_kernel_takes_the_shapes_of_its_launch_geometry() {
        assert!(decode_takes(&params(32, 4, 128)));
        assert!(decode_takes(&params(16, 2, 256)));
        assert!(decode_takes(&params(4, 2, 64)));
        assert!(!decode_takes(&params(6, 3, 80)), "d not a power of two");
        assert!(!decode_takes(&params(32, 2, 128)), "group of 16");
        assert!(!decode_takes(&params(8, 2, 512)), "d over 256");
    }

    #[test]
    fn heads_per_block_divide_the_group_or_take_it_whole() {
        // qwen3moe's group of 8: each kernel's cut as asked, more than the group is the group.
        assert_eq!(
            [1, 2, 3, 4, 8, 16].map(|h| decode_heads_per_block(8, h)),
            [1, 2, 2, 4, 8, 8]
        );
        // qwen35moe's group of 2 (16 heads, 2 KV heads); a group of 6 takes 2 for 4 (4 does not divide it).
        assert_eq!([1, 2, 4].map(|h| decode_heads_per_block(2, h)), [1, 2, 2]);
        assert_eq!([1, 4, 6].map(|h| decode_heads_per_block(6, h)), [1, 2, 6]);
        assert_eq!(decode_heads_per_block(8, 0), 1, "at least one head");
        assert_eq!(decode_scratch_len(&params(32, 4, 128), 1), 0);
        assert_eq!(decode_scratch_len(&params(32, 4, 128), 64), 64 * 32 * 130);
    }
}
