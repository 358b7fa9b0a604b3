//! The gated delta-net pieces on the card (`kernels/cuda/recurrent.cu`): the causal depthwise convolution
//! with its carried state (a prompt's tokens in parallel), the L2 norm, the gated delta rule (decode and
//! prompts: the state in registers for the whole batch; a prompt with 8 lanes per state row and its
//! tokens staged in shared memory a chunk at a time) and the RMS norm gated by `silu(z)`. Layouts are those of the CPU ops in
//! [`crate::ops::recurrent`] and [`crate::ops::norm`].

use super::module::KernelModule;
use super::ops::{as_i32, check_len, invalid};
use super::{CudaResult, Device, DeviceBuffer};
use crate::ops::recurrent::DeltaShape;
use cudarc::driver::LaunchConfig;

/// Longest convolution the kernel keeps in registers (`CONV_MAX_KERNEL`).
pub const CONV_MAX_KERNEL: usize = 8;
/// Largest key head the delta-rule kernel holds in registers (`DELTA_MAX_K`).
pub const DELTA_MAX_HEAD_K: usize = 256;
/// Largest key head of the prompt kernel with 8 lanes per state row (`DELTA_SMALL_K`).
const DELTA_SMALL_HEAD_K: usize = 128;
/// Warps per block of the delta rule (`DELTA_WARPS`): a state row each, or 4 in `gated_delta_rule_k128`.
const DELTA_WARPS: u32 = 4;

/// [`crate::ops::recurrent::conv1d_causal`] on the card: `x` `[n, channels]`, `weight` `[channels, kernel]`,
/// `state` `[kernel-1, channels]` (advanced), `out` `[n, channels]`; `silu` applies SiLU to the output (as
/// the delta-net block does next). Products and sums round as the CPU's: equal results.
pub fn conv1d_causal(
    dev: &Device,
    x: &DeviceBuffer<f32>,
    weight: &DeviceBuffer<f32>,
    kernel: usize,
    state: &mut DeviceBuffer<f32>,
    silu: bool,
    out: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    if kernel == 0 || kernel > CONV_MAX_KERNEL || !weight.len().is_multiple_of(kernel) {
        return invalid(format!(
            "conv1d: kernel {kernel}, weight of {}",
            weight.len()
        ));
    }
    let channels = weight.len() / kernel;
    if channels == 0 || !x.len().is_multiple_of(channels) {
        return invalid(format!("conv1d: x of {} for {channels} channels", x.len()));
    }
    let n = x.len() / channels;
    check_len("conv1d state", state, (kernel - 1) * channels)?;
    check_len("conv1d out", out, x.len())?;
    let (n_i, c_i, k_i, s_i) = (
        as_i32("n", n)?,
        as_i32("channels", channels)?,
        kernel as i32,
        silu as i32,
    );
    if n > 1 {
        return conv1d_prompt(dev, (x, weight), state, out, [n_i, c_i, k_i, s_i]);
    }
    let f = dev.function(KernelModule::Recurrent, "conv1d_causal")?;
    let mut b = dev.launch_builder(&f);
    b.arg(x.slice())
        .arg(weight.slice())
        .arg(state.slice_mut())
        .arg(out.slice_mut())
        .arg(&n_i)
        .arg(&c_i)
        .arg(&k_i)
        .arg(&s_i);
    let cfg = LaunchConfig {
        grid_dim: (channels.div_ceil(128) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: x and out hold n × channels floats, weight channels × kernel, state (kernel-1) × channels
    // (checked above); one thread per channel touches only its column.
    unsafe { b.launch(cfg) }?;
    dev.after_launch("conv1d_causal")
}

/// Tokens per thread of `conv1d_causal_tokens` (`CONV_TOKENS`).
const CONV_TOKENS: usize = 8;

/// [`conv1d_causal`] for a prompt (`n > 1`, lengths checked by the caller): the outputs of all tokens at
/// once (`conv1d_causal_tokens`, the same sums), then the state advanced (`conv1d_state_advance`).
fn conv1d_prompt(
    dev: &Device,
    (x, weight): (&DeviceBuffer<f32>, &DeviceBuffer<f32>),
    state: &mut DeviceBuffer<f32>,
    out: &mut DeviceBuffer<f32>,
    [n_i, c_i, k_i, s_i]: [i32; 4],
) -> CudaResult<()> {
    let (n, channels) = (n_i as usize, c_i as usize);
    let token_blocks = n.div_ceil(CONV_TOKENS);
    if token_blocks > 65535 {
        return invalid(format!("conv1d: {n} tokens in one call"));
    }
    let f = dev.function(KernelModule::Recurrent, "conv1d_causal_tokens")?;
    let mut b = dev.launch_builder(&f);
    b.arg(x.slice())
        .arg(weight.slice())
        .arg(state.slice())
        .arg(out.slice_mut())
        .arg(&n_i)
        .arg(&c_i)
        .arg(&k_i)
        .arg(&s_i);
    let cfg = LaunchConfig {
        grid_dim: (channels.div_ceil(128) as u32, token_blocks as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: x and out hold n × channels floats, weight channels × kernel, state (kernel-1) × channels
    // (checked by conv1d_causal); thread (c, block t) reads column c of state and of x rows below n and
    // writes column c of out rows t·CONV_TOKENS.. below n.
    unsafe { b.launch(cfg) }?;
    dev.after_launch("conv1d_causal_tokens")?;
    let f = dev.function(KernelModule::Recurrent, "conv1d_state_advance")?;
    let mut b = dev.launch_builder(&f);
    b.arg(x.slice())
        .arg(state.slice_mut())
        .arg(&n_i)
        .arg(&c_i)
        .arg(&k_i);
    let cfg = LaunchConfig {
        grid_dim: (channels.div_ceil(128) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: as above; one thread per channel rewrites column c of state from itself and from x.
    unsafe { b.launch(cfg) }?;
    dev.after_launch("conv1d_state_advance")
}

/// How [`l2_norm`] divides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum L2Form {
    /// `x / max(‖x‖, eps)` ([`crate::ops::norm::l2_norm`], ggml's `l2_norm`).
    MaxEps,
    /// `x / √(‖x‖² + eps)` (llama.cpp's delta-net q/k norm: an RMS norm with `eps/n` times `1/√n`).
    SqrtEps,
}

fn group_launch(n: usize) -> CudaResult<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (
            u32::try_from(n).map_err(|_| super::CudaError::Invalid(format!("{n} groups")))?,
            1,
            1,
        ),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The L2 norm of every group of `group` values of `x` into `out`.
pub fn l2_norm(
    dev: &Device,
    x: &DeviceBuffer<f32>,
    group: usize,
    eps: f32,
    form: L2Form,
    out: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    if group == 0 || !x.len().is_multiple_of(group) {
        return invalid(format!("l2_norm: {} values in groups of {group}", x.len()));
    }
    check_len("l2_norm out", out, x.len())?;
    let (g_i, mode) = (as_i32("group", group)?, (form == L2Form::SqrtEps) as i32);
    let f = dev.function(KernelModule::Recurrent, "l2_norm")?;
    let mut b = dev.launch_builder(&f);
    b.arg(x.slice())
        .arg(out.slice_mut())
        .arg(&g_i)
        .arg(&eps)
        .arg(&mode);
    // SAFETY: x and out hold a whole number of groups (checked above); block g touches group g only.
    unsafe { b.launch(group_launch(x.len() / group)?) }?;
    dev.after_launch("l2_norm")
}

/// `out = rms_norm(x)·weight ⊙ silu(z)` per group of `group` values (`weight` has `group` values): the
/// delta-net block's output norm.
pub fn rms_norm_gated(
    dev: &Device,
    x: &DeviceBuffer<f32>,
    weight: &DeviceBuffer<f32>,
    z: &DeviceBuffer<f32>,
    eps: f32,
    out: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    let group = weight.len();
    if group == 0 || !x.len().is_multiple_of(group) {
        return invalid(format!(
            "rms_norm_gated: {} values in groups of {group}",
            x.len()
        ));
    }
    check_len("rms_norm_gated z", z, x.len())?;
    check_len("rms_norm_gated out", out, x.len())?;
    let g_i = as_i32("group", group)?;
    let f = dev.function(KernelModule::Recurrent, "rms_norm_gated")?;
    let mut b = dev.launch_builder(&f);
    b.arg(x.slice())
        .arg(weight.slice())
        .arg(z.slice())
        .arg(out.slice_mut())
        .arg(&g_i)
        .arg(&eps);
    // SAFETY: x, z and out hold a whole number of groups, weight one group (checked above).
    unsafe { b.launch(group_launch(x.len() / group)?) }?;
    dev.after_launch("rms_norm_gated")
}

/// The inputs of [`gated_delta_rule`]: `q`, `k` `[n, n_k_heads·head_k]` (value head `h` reads key head
/// `h mod n_k_heads`, so they need not be repeated), `v` `[n, n_heads·head_v]`, `gate` and `beta`
/// `[n, n_heads]`.
pub struct DeltaInputs<'a> {
    pub q: &'a DeviceBuffer<f32>,
    pub k: &'a DeviceBuffer<f32>,
    pub v: &'a DeviceBuffer<f32>,
    pub gate: &'a DeviceBuffer<f32>,
    pub beta: &'a DeviceBuffer<f32>,
    pub n_k_heads: usize,
}

/// [`crate::ops::recurrent::gated_delta_rule`] on the card over all `n` tokens of the batch, advancing
/// `state` (`[n_heads][head_v][head_k]`); `out` `[n, n_heads·head_v]`.
pub fn gated_delta_rule(
    dev: &Device,
    x: &DeltaInputs<'_>,
    shape: DeltaShape,
    state: &mut DeviceBuffer<f32>,
    out: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    let DeltaShape {
        n_heads,
        head_k,
        head_v,
    } = shape;
    if n_heads == 0 || head_k == 0 || head_v == 0 || head_k > DELTA_MAX_HEAD_K {
        return invalid(format!("delta rule: shape {shape:?}"));
    }
    if x.n_k_heads == 0 || !n_heads.is_multiple_of(x.n_k_heads) {
        return invalid(format!(
            "delta rule: {} key heads for {n_heads} value heads",
            x.n_k_heads
        ));
    }
    let n = x.gate.len() / n_heads;
    check_len("delta gate", x.gate, n * n_heads)?;
    check_len("delta beta", x.beta, n * n_heads)?;
    check_len("delta q", x.q, n * x.n_k_heads * head_k)?;
    check_len("delta k", x.k, n * x.n_k_heads * head_k)?;
    check_len("delta v", x.v, n * n_heads * head_v)?;
    check_len("delta out", out, n * n_heads * head_v)?;
    check_len("delta state", state, n_heads * head_v * head_k)?;
    let ints = [
        as_i32("n", n)?,
        x.n_k_heads as i32,
        n_heads as i32,
        head_k as i32,
        head_v as i32,
    ];
    // A prompt with key heads of at most 128 (a multiple of 4): 8 lanes per state row, chunks of tokens
    // staged in shared memory (`gated_delta_rule_k128`); else (and for one token, the decode graphs'
    // kernel) a warp per row.
    let (name, rows_per_block) =
        if n > 1 && head_k <= DELTA_SMALL_HEAD_K && head_k.is_multiple_of(4) {
            ("gated_delta_rule_k128", DELTA_WARPS as usize * 4)
        } else {
            ("gated_delta_rule", DELTA_WARPS as usize)
        };
    let f = dev.function(KernelModule::Recurrent, name)?;
    let mut b = dev.launch_builder(&f);
    b.arg(x.q.slice())
        .arg(x.k.slice())
        .arg(x.v.slice())
        .arg(x.gate.slice())
        .arg(x.beta.slice())
        .arg(state.slice_mut())
        .arg(out.slice_mut());
    for i in &ints {
        b.arg(i);
    }
    let cfg = LaunchConfig {
        grid_dim: (head_v.div_ceil(rows_per_block) as u32, n_heads as u32, 1),
        block_dim: (32, DELTA_WARPS, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: every buffer has the length checked above for n tokens; the lanes of state row j of head h
    // touch that row and out column (h, j) only (rows past head_v write nothing).
    unsafe { b.launch(cfg) }?;
    dev.after_launch(name)
}
