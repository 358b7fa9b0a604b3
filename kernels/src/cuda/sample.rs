//! Picking the next token on the card (`kernels/cuda/sample.cu`), so only its id crosses to the host:
//! greedy (argmax, the lowest id among equals, as the engine's sampler) and a top-k / top-p / temperature
//! draw whose uniform number comes from a seed and a step counter kept in device memory (the kernel
//! advances it, so a captured graph draws anew at each replay).

use super::module::KernelModule;
use super::ops::{as_i32, check_len, invalid};
use super::{CudaResult, Device, DeviceBuffer};
use cudarc::driver::LaunchConfig;

/// Threads of the sampling block (`SAMPLE_THREADS`).
const SAMPLE_THREADS: u32 = 1024;
/// Largest top-k the card draws from (`SAMPLE_MAX_K`).
pub const SAMPLE_MAX_K: usize = 128;

fn one_block() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (SAMPLE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `token[0]` = the id of the largest logit (the lowest among equals).
pub fn argmax(
    dev: &Device,
    logits: &DeviceBuffer<f32>,
    token: &mut DeviceBuffer<i32>,
) -> CudaResult<()> {
    check_len("argmax token", token, 1)?;
    if logits.is_empty() {
        return invalid("argmax: no logits".to_string());
    }
    let n = as_i32("vocabulary", logits.len())?;
    let f = dev.function(KernelModule::Sample, "sample_argmax")?;
    let mut b = dev.launch_builder(&f);
    b.arg(logits.slice()).arg(&n).arg(token.slice_mut());
    // SAFETY: logits holds n floats, token one int (checked above).
    unsafe { b.launch(one_block()) }?;
    dev.after_launch("sample_argmax")
}

/// The draw's settings: `top_k` in `1..=SAMPLE_MAX_K`, `top_p` in `(0, 1]`, `temperature > 0`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DrawParams {
    pub top_k: usize,
    pub top_p: f32,
    pub temperature: f32,
    pub seed: u64,
}

/// The uniform number of draw `step` with `seed`, as the kernel forms it:
/// `(splitmix64(seed ^ step) >> 11) / 2^53`.
pub fn draw_uniform(seed: u64, step: u64) -> f64 {
    let mut z = (seed ^ step).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Draws `token[0]` from the `top_k` likeliest logits, cut to the smallest prefix whose softmax reaches
/// `top_p`, at `temperature`; the uniform number is [`draw_uniform`]`(seed, counter[0])` and the kernel
/// adds one to `counter[0]`.
pub fn sample_top_k(
    dev: &Device,
    logits: &DeviceBuffer<f32>,
    params: DrawParams,
    counter: &mut DeviceBuffer<u64>,
    token: &mut DeviceBuffer<i32>,
) -> CudaResult<()> {
    check_len("sample token", token, 1)?;
    check_len("sample counter", counter, 1)?;
    let ok = (1..=SAMPLE_MAX_K).contains(&params.top_k)
        && params.top_p > 0.0
        && params.top_p <= 1.0
        && params.temperature > 0.0;
    if !ok || logits.is_empty() {
        return invalid(format!("sample_top_k: {params:?}"));
    }
    let (n, k) = (as_i32("vocabulary", logits.len())?, params.top_k as i32);
    let f = dev.function(KernelModule::Sample, "sample_top_k")?;
    let mut b = dev.launch_builder(&f);
    b.arg(logits.slice())
        .arg(&n)
        .arg(&k)
        .arg(&params.top_p)
        .arg(&params.temperature)
        .arg(&params.seed)
        .arg(counter.slice_mut())
        .arg(token.slice_mut());
    // SAFETY: logits holds n floats, counter one u64 and token one int (checked above); k is at most the
    // kernel's candidate array.
    unsafe { b.launch(one_block()) }?;
    dev.after_launch("sample_top_k")
}
