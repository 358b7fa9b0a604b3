//! Prompt attention on the f16 tensor cores (`kernels/cuda/attention_mma.cu`): the causal GQA attention of
//! [`super::attention::attention_f16_cache`] for a batch of queries, flash-attention style (mma.sync
//! m16n8k16, f32 accumulation, online softmax in f32; queries and softmax weights rounded to f16 for the
//! products; keys and values copied to shared memory by cp.async, two tiles in flight, their fragments read
//! by ldmatrix). For head dimensions 64, 128 and 256 (keys and values alike) on sm_80 and later; no split of
//! the context (a prompt has blocks enough).

use super::attention::KvCacheView;
use super::module::KernelModule;
use super::ops::{as_i32, check_len, invalid};
use super::{CudaResult, Device, DeviceBuffer};
use crate::ops::attention::AttnParams;
use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::LaunchConfig;

/// (query, head) rows per block (`FA_ROWS`).
const FA_ROWS: usize = 64;
/// Fewest queries for which the tensor-core kernel is used.
pub const MIN_QUERIES: usize = 8;

/// The kernel's argument struct (`FaArgs` in attention_mma.cu), field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct FaArgs {
    n_q: i32,
    n_kv: i32,
    n_head: i32,
    n_head_kv: i32,
    scale: f32,
    softcap: f32,
    window: i32,
}

// Passed by its bytes: a plain `repr(C)` struct of 32-bit numbers, laid out as the kernel's `FaArgs`.
super::launch::value_args!(FaArgs);

/// (kernel, keys per tile) for a head dimension.
fn kernel(d: usize) -> Option<(&'static str, usize)> {
    match d {
        64 => Some(("attn_mma_64", 64)),
        128 => Some(("attn_mma_128", 64)),
        256 => Some(("attn_mma_256", 32)),
        _ => None,
    }
}

/// Dynamic shared memory of a block: the queries (FA_ROWS rows) and two tiles of keys and two of values
/// (kt rows each), every row d + 8 f16 values.
fn shared_bytes(d: usize, kt: usize) -> usize {
    2 * (FA_ROWS + 4 * kt) * (d + 8)
}

/// Whether `--fa off` turned the tensor-core attention off (to measure against attn_f16).
fn disabled() -> bool {
    !crate::options::get().gpu.flash_attention
}

/// Whether [`attention_prompt`] takes `n_q` queries of these heads on `dev`.
pub fn takes(dev: &Device, p: &AttnParams, n_q: usize) -> bool {
    n_q >= MIN_QUERIES
        && p.head_dim_k == p.head_dim_v
        && kernel(p.head_dim_k).is_some()
        && p.n_head_kv > 0
        && p.n_head.is_multiple_of(p.n_head_kv)
        && dev.compute_capability().0 >= 8
        && !disabled()
}

/// Attention of the `positions.len()` queries `q` (`[n_q, n_head·d]`) over the first `cache.n_kv` rows of
/// an f16 KV cache (`[rows, n_head_kv·d]` each), into `out` (`[n_q, n_head·d]`); every position below the
/// cache's rows.
pub fn attention_prompt(
    dev: &Device,
    q: &DeviceBuffer<f32>,
    positions: &DeviceBuffer<i32>,
    cache: KvCacheView<'_>,
    p: &AttnParams,
    out: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    let d = p.head_dim_k;
    let Some((name, kt)) = kernel(d).filter(|_| p.head_dim_v == d) else {
        return invalid(format!("attention_prompt: head dims {d}/{}", p.head_dim_v));
    };
    if p.n_head_kv == 0 || !p.n_head.is_multiple_of(p.n_head_kv) {
        return invalid(format!("attention_prompt: bad heads {p:?}"));
    }
    let n_q = positions.len();
    check_len("attention_prompt q", q, n_q * p.n_head * d)?;
    check_len("attention_prompt out", out, n_q * p.n_head * d)?;
    let row = p.n_head_kv * d;
    let n_kv = cache.n_kv.unwrap_or(cache.k.len() / row.max(1));
    if n_kv == 0 || n_kv * row > cache.k.len() || n_kv * row > cache.v.len() {
        return invalid(format!(
            "attention_prompt: {n_kv} cache rows of k {} / v {} values",
            cache.k.len(),
            cache.v.len()
        ));
    }
    if n_q == 0 {
        return Ok(());
    }
    let args = FaArgs {
        n_q: as_i32("n_q", n_q)?,
        n_kv: as_i32("n_kv", n_kv)?,
        n_head: as_i32("n_head", p.n_head)?,
        n_head_kv: as_i32("n_head_kv", p.n_head_kv)?,
        scale: p.scale,
        softcap: p.softcap.unwrap_or(0.0),
        window: p.window.map_or(Ok(0), |w| as_i32("window", w as usize))?,
    };
    let group = p.n_head / p.n_head_kv;
    let shared = shared_bytes(d, kt);
    let cfg = LaunchConfig {
        grid_dim: (
            (n_q * group).div_ceil(FA_ROWS) as u32,
            p.n_head_kv as u32,
            1,
        ),
        block_dim: (32, (FA_ROWS / 16) as u32, 1),
        shared_mem_bytes: shared as u32,
    };
    let f = dev.function(KernelModule::AttentionMma, name)?;
    f.set_attribute(
        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        shared as i32,
    )?;
    let mut b = dev.launch_builder(&f);
    b.arg(q.slice())
        .arg(positions.slice())
        .arg(cache.k.slice())
        .arg(cache.v.slice())
        .arg(out.slice_mut())
        .arg(&args);
    // SAFETY: q and out hold n_q × n_head × d values, k and v at least n_kv rows (checked above), each its
    // own allocation (so 16-byte aligned, as cp.async's 16-byte copies of a row's pieces need: rows are d
    // f16 values, d a multiple of 8); the kernel reads keys and values only up to the largest position of
    // its rows, clamped below n_kv, and writes the rows of its (query, head) pairs; its dynamic shared
    // memory is sized by shared_bytes as the kernel lays it out (the function's limit raised to it).
    unsafe { b.launch(cfg) }?;
    dev.after_launch(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_head_dim_has_an_entry_point_and_fits_the_card() {
        let src = KernelModule::AttentionMma.source();
        for d in [64, 128, 256] {
            let (name, kt) = kernel(d).expect("a kernel");
            assert!(
                src.contains(&format!("FA_ENTRY_POINT({d}, {kt})")),
                "{name}"
            );
            // Ampere's largest opt-in shared memory per block is 163 KiB (sm_86: 99 KiB).
            assert!(shared_bytes(d, kt) <= 99 * 1024, "d {d}");
        }
    }
}
