//! Rotary position embedding on the card (`kernels/cuda/rope.cu`): in place, or from one buffer into another
//! (one launch where a copy and the rotation were two). The angles are formed as the CPU's
//! [`crate::ops::rope::rope_with_factors`] forms them, with optional per-pair frequency factors (`n_rot/2`
//! floats on the card, Llama 3.1+'s `rope_freqs.weight`). Re-exported by [`super::ops`].

use super::module::KernelModule;
use super::ops::{as_i32, check_len, invalid};
use super::{CudaResult, Device, DeviceBuffer};
use crate::ops::rope::{RopeMode, RopeParams};
use cudarc::driver::LaunchConfig;

/// Rotates `x` in place: rows of whole heads, row `r` at `positions[r]` (read on the card), each pair's
/// angle divided by its entry of `factors` when given.
pub fn rope(
    dev: &Device,
    x: &mut DeviceBuffer<f32>,
    positions: &DeviceBuffer<i32>,
    p: &RopeParams,
    factors: Option<&DeviceBuffer<f32>>,
) -> CudaResult<()> {
    let shape = RopeShape::new(x.len(), positions.len(), p, factors)?;
    let f = dev.function(KernelModule::Rope, "rope")?;
    let mut b = dev.launch_builder(&f);
    // In place: the kernel reads and writes x (its input goes as x's device address).
    let src: u64 = x.address();
    b.arg(&src).arg(x.slice_mut());
    shape.push_args(&mut b, positions, factors);
    // SAFETY: x holds n_rows × n_heads × head_dim floats, positions n_rows ints and factors n_rot/2 floats
    // or is null (checked by RopeShape::new); each thread reads and writes values of its own head only.
    unsafe { b.launch(shape.config()) }?;
    dev.after_launch("rope")
}

/// [`rope`] of `x` into `out` (same length), one launch instead of a copy and the rotation.
pub fn rope_into(
    dev: &Device,
    x: &DeviceBuffer<f32>,
    positions: &DeviceBuffer<i32>,
    p: &RopeParams,
    factors: Option<&DeviceBuffer<f32>>,
    out: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    check_len("rope out", out, x.len())?;
    let shape = RopeShape::new(x.len(), positions.len(), p, factors)?;
    let f = dev.function(KernelModule::Rope, "rope")?;
    let mut b = dev.launch_builder(&f);
    b.arg(x.slice()).arg(out.slice_mut());
    shape.push_args(&mut b, positions, factors);
    // SAFETY: x and out hold n_rows × n_heads × head_dim floats, positions n_rows ints and factors n_rot/2
    // floats or is null (checked above);
    // each thread reads its head of x and writes the same head of out.
    unsafe { b.launch(shape.config()) }?;
    dev.after_launch("rope")
}

/// The checked shape and scalar arguments of a rope launch.
pub(super) struct RopeShape {
    n_rows: usize,
    n_heads: usize,
    half: usize,
    args: (i32, i32, i32, i32, f32, f32),
    /// The null device pointer passed when there are no frequency factors.
    null: u64,
}

impl RopeShape {
    pub(super) fn new(
        len: usize,
        n_rows: usize,
        p: &RopeParams,
        factors: Option<&DeviceBuffer<f32>>,
    ) -> CudaResult<RopeShape> {
        if let Some(f) = factors {
            check_len("rope frequency factors", f, p.n_rot / 2)?;
        }
        if !p.n_rot.is_multiple_of(2) || p.n_rot > p.head_dim || p.n_rot == 0 || p.n_rot > 2048 {
            return invalid(format!(
                "rope: n_rot {} with head_dim {}",
                p.n_rot, p.head_dim
            ));
        }
        if n_rows == 0 || !len.is_multiple_of(n_rows) || !(len / n_rows).is_multiple_of(p.head_dim)
        {
            return invalid(format!(
                "rope: {len} values are not {n_rows} rows of whole heads of {}",
                p.head_dim
            ));
        }
        let n_heads = len / n_rows / p.head_dim;
        let neox: i32 = (p.mode == RopeMode::Neox) as i32;
        // As the CPU path computes it (f32 powf on the host), so both form the same angles.
        let theta_scale = p.freq_base.powf(-2.0 / p.n_rot as f32);
        Ok(RopeShape {
            n_rows,
            n_heads,
            half: p.n_rot / 2,
            args: (
                as_i32("heads", n_heads)?,
                as_i32("head_dim", p.head_dim)?,
                as_i32("n_rot", p.n_rot)?,
                neox,
                theta_scale,
                p.freq_scale,
            ),
            null: 0,
        })
    }

    pub(super) fn push_args<'a>(
        &'a self,
        b: &mut super::launch::KernelLaunch<'a>,
        positions: &'a DeviceBuffer<i32>,
        factors: Option<&'a DeviceBuffer<f32>>,
    ) {
        let (n_heads, head_dim, n_rot, neox, theta_scale, freq_scale) = &self.args;
        b.arg(positions.slice())
            .arg(n_heads)
            .arg(head_dim)
            .arg(n_rot)
            .arg(neox)
            .arg(theta_scale)
            .arg(freq_scale);
        match factors {
            Some(f) => b.arg(f.slice()),
            None => b.arg(&self.null),
        };
    }

    /// Heads per row.
    pub(super) fn n_heads(&self) -> usize {
        self.n_heads
    }

    pub(super) fn config(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (self.n_rows as u32, self.n_heads as u32, 1),
            block_dim: (self.half as u32, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}
