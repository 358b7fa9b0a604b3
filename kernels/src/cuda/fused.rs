//! Compound operations on the card, one launch where a forward pass ran two or three: the residual add with
//! the RMS norm after it ([`add_rms_norm`], `quantize.cu`), the per-head RMS norm with the RoPE after it
//! ([`rms_norm_rope`], `rope.cu`), several quantized matrices times one vector ([`matvec_q_many`],
//! `matvec_q.cu`), and Qwen3.5's delta-net pieces: the L2 norm of q and k on their columns of the
//! convolution's output ([`rms_norm_cols_scale`], `norm.cu`) and the gates ([`delta_gates`],
//! `elementwise.cu`). Each gives bit for bit the values of the launches it replaces (the kernels keep their
//! loops, thread counts and summation orders), so fusing changes no result; `kernels/tests/cuda_fused.rs`
//! checks them against the CPU's operations.

use super::formats::q_format;
use super::module::KernelModule;
use super::ops::{as_i32, check_len, grid_1d, invalid, q_matvec_rows_config};
use super::rope::RopeShape;
use super::{BlockQ8_1, CudaError, CudaResult, Device, DeviceBuffer, DeviceMatrix};
use crate::ops::rope::RopeParams;
use crate::quant::GgmlType;
use cudarc::driver::LaunchConfig;

/// Most matrices of one [`matvec_q_many`] launch (`MATVEC_MANY_MAX` in matvec.cuh).
pub const MATVEC_MANY_MAX: usize = 4;

/// Largest head of [`rms_norm_rope`]: its normed values live in a block's shared memory (48 KiB).
pub const NORM_ROPE_MAX_HEAD_DIM: usize = 12 * 1024;

/// Threads of a norm's block over `group` values: rms_norm's count (`ops::rms_norm`), so the block sums
/// are formed alike.
fn norm_threads(group: usize) -> u32 {
    if group >= 1024 {
        1024
    } else {
        (group.div_ceil(32) * 32) as u32
    }
}

/// `sum = a + b` and `out = rms_norm(sum)` over groups of `group` values, times `weight` (`group` values)
/// when given: the values of `elementwise::binary` (add) then `ops::rms_norm`. With `q`, `out` is also
/// written quantized into it (`x.len()/32` blocks), as `ops::rms_norm_quantize_q8_1` writes it; `group`
/// must then be a multiple of 32.
pub fn add_rms_norm(
    dev: &Device,
    (a, b): (&DeviceBuffer<f32>, &DeviceBuffer<f32>),
    group: usize,
    weight: Option<&DeviceBuffer<f32>>,
    eps: f32,
    (sum, out): (&mut DeviceBuffer<f32>, &mut DeviceBuffer<f32>),
    q: Option<&mut DeviceBuffer<BlockQ8_1>>,
) -> CudaResult<()> {
    let n = a.len();
    if group == 0 || !n.is_multiple_of(group) {
        return invalid(format!(
            "add_rms_norm: {n} values are not groups of {group}"
        ));
    }
    check_len("add_rms_norm b", b, n)?;
    check_len("add_rms_norm sum", sum, n)?;
    check_len("add_rms_norm out", out, n)?;
    if let Some(w) = weight {
        check_len("add_rms_norm weight", w, group)?;
    }
    if let Some(q) = &q {
        if !group.is_multiple_of(BlockQ8_1::ELEMS) {
            return invalid(format!(
                "add_rms_norm: a quantized copy of groups of {group} (not a multiple of 32)"
            ));
        }
        check_len("add_rms_norm q", q, n / BlockQ8_1::ELEMS)?;
    }
    let ncols = as_i32("add_rms_norm group", group)?;
    let rows =
        u32::try_from(n / group).map_err(|_| CudaError::Invalid("add_rms_norm rows".into()))?;
    let null: u64 = 0;
    let f = dev.function(KernelModule::Quantize, "add_rms_norm_q8_1")?;
    let mut lb = dev.launch_builder(&f);
    lb.arg(a.slice()).arg(b.slice());
    match weight {
        Some(w) => lb.arg(w.slice()),
        None => lb.arg(&null),
    };
    lb.arg(sum.slice_mut()).arg(out.slice_mut());
    match q {
        Some(q) => lb.arg(q.slice_mut()),
        None => lb.arg(&null),
    };
    lb.arg(&ncols).arg(&eps);
    let cfg = LaunchConfig {
        grid_dim: (rows, 1, 1),
        block_dim: (norm_threads(group), 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: a, b, sum and out hold rows × group floats, q rows × group / 32 blocks or is null, weight
    // group floats or is null (all checked above; the kernel tests the nulls); with q, group and the
    // thread count are multiples of 32 as the kernel's quantization needs.
    unsafe { lb.launch(cfg) }?;
    dev.after_launch("add_rms_norm_q8_1")
}

/// The RMS norm of every head of `x` (`p.head_dim` values) times `weight` (`p.head_dim` values) when given,
/// then RoPE at `positions` (one per row, read on the card) into `out`: the values of `ops::rms_norm` with
/// `group = p.head_dim` then `ops::rope_into` (with the same optional frequency `factors`), in one launch.
pub fn rms_norm_rope(
    dev: &Device,
    (x, weight): (&DeviceBuffer<f32>, Option<&DeviceBuffer<f32>>),
    eps: f32,
    positions: &DeviceBuffer<i32>,
    (p, factors): (&RopeParams, Option<&DeviceBuffer<f32>>),
    out: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    check_len("rms_norm_rope out", out, x.len())?;
    if p.head_dim > NORM_ROPE_MAX_HEAD_DIM {
        return invalid(format!(
            "rms_norm_rope: heads of {} values (at most {NORM_ROPE_MAX_HEAD_DIM})",
            p.head_dim
        ));
    }
    if let Some(w) = weight {
        check_len("rms_norm_rope weight", w, p.head_dim)?;
    }
    let shape = RopeShape::new(x.len(), positions.len(), p, factors)?;
    let null: u64 = 0;
    let f = dev.function(KernelModule::Rope, "rms_norm_rope")?;
    let mut b = dev.launch_builder(&f);
    b.arg(x.slice());
    match weight {
        Some(w) => b.arg(w.slice()),
        None => b.arg(&null),
    };
    b.arg(out.slice_mut());
    shape.push_args(&mut b, positions, factors);
    b.arg(&eps);
    let mut cfg = shape.config();
    cfg.block_dim = (norm_threads(p.head_dim), 1, 1);
    cfg.shared_mem_bytes = (p.head_dim * std::mem::size_of::<f32>()) as u32;
    // SAFETY: x and out are distinct buffers of n_rows × n_heads × head_dim floats, positions n_rows ints
    // (RopeShape::new checks them), weight head_dim floats or null, factors n_rot/2 floats or null; a block reads one head of x and writes
    // the same head of out, its shared memory holds head_dim floats (at most NORM_ROPE_MAX_HEAD_DIM).
    unsafe { b.launch(cfg) }?;
    dev.after_launch("rms_norm_rope")
}

/// [`rms_norm_rope`] of two tensors of the same rows and head size (a layer's queries and keys), each with
/// its own norm weight and output, at the same positions and rotation: the values of two `rms_norm_rope`
/// launches, in one.
pub fn rms_norm_rope_pair(
    dev: &Device,
    [(x0, w0), (x1, w1)]: [(&DeviceBuffer<f32>, Option<&DeviceBuffer<f32>>); 2],
    eps: f32,
    positions: &DeviceBuffer<i32>,
    (p, factors): (&RopeParams, Option<&DeviceBuffer<f32>>),
    [out0, out1]: [&mut DeviceBuffer<f32>; 2],
) -> CudaResult<()> {
    check_len("rms_norm_rope_pair out0", out0, x0.len())?;
    check_len("rms_norm_rope_pair out1", out1, x1.len())?;
    if p.head_dim > NORM_ROPE_MAX_HEAD_DIM {
        return invalid(format!(
            "rms_norm_rope_pair: heads of {} values (at most {NORM_ROPE_MAX_HEAD_DIM})",
            p.head_dim
        ));
    }
    for w in [w0, w1].into_iter().flatten() {
        check_len("rms_norm_rope_pair weight", w, p.head_dim)?;
    }
    let shape0 = RopeShape::new(x0.len(), positions.len(), p, factors)?;
    let shape1 = RopeShape::new(x1.len(), positions.len(), p, factors)?;
    let heads0 = as_i32("rms_norm_rope_pair heads", shape0.n_heads())?;
    let null: u64 = 0;
    let f = dev.function(KernelModule::Rope, "rms_norm_rope_pair")?;
    let mut b = dev.launch_builder(&f);
    b.arg(x0.slice());
    match w0 {
        Some(w) => b.arg(w.slice()),
        None => b.arg(&null),
    };
    b.arg(out0.slice_mut()).arg(&heads0).arg(x1.slice());
    match w1 {
        Some(w) => b.arg(w.slice()),
        None => b.arg(&null),
    };
    b.arg(out1.slice_mut());
    shape1.push_args(&mut b, positions, factors);
    b.arg(&eps);
    let mut cfg = shape1.config();
    cfg.grid_dim.1 += shape0.n_heads() as u32;
    cfg.block_dim = (norm_threads(p.head_dim), 1, 1);
    cfg.shared_mem_bytes = (p.head_dim * std::mem::size_of::<f32>()) as u32;
    // SAFETY: x0/out0 and x1/out1 are pairs of distinct buffers of n_rows × heads × head_dim floats at the
    // same n_rows (RopeShape::new checks each against positions), weights head_dim floats or null, factors
    // n_rot/2 floats or null; block y reads and writes one head of the pair its index falls in, its shared
    // memory holds head_dim floats (at most NORM_ROPE_MAX_HEAD_DIM).
    unsafe { b.launch(cfg) }?;
    dev.after_launch("rms_norm_rope_pair")
}

/// The kernel's argument struct (`MoeAddNormArgs` in quantize.cu), field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct MoeAddNormArgs {
    y: u64,
    weights: u64,
    shared: u64,
    shared_gate: u64,
    residual: u64,
    weight: u64,
    sum_out: u64,
    out: u64,
    q: u64,
    k: i32,
    ncols: i32,
    eps: f32,
}

// Passed by its bytes: a plain `repr(C)` struct of device addresses and 32-bit numbers, laid out as the
// kernel's `MoeAddNormArgs`.
super::launch::value_args!(MoeAddNormArgs);

/// One token's routed experts as [`moe_add_rms_norm`] takes them: the `k` slot outputs `[k, n]` with their
/// weights (`moe_combine` sums them in the kernel), or their sum already formed.
pub enum RoutedOut<'a> {
    Slots {
        y: &'a DeviceBuffer<f32>,
        weights: &'a DeviceBuffer<f32>,
    },
    Summed(&'a DeviceBuffer<f32>),
}

/// The shared expert's part of [`moe_add_rms_norm`]: its output `[n]` and, when gated, its gate `[1]`
/// before the sigmoid.
pub struct SharedOut<'a> {
    pub y: &'a DeviceBuffer<f32>,
    pub gate: Option<&'a DeviceBuffer<f32>>,
}

/// The end of one token's MoE block and the norm of the next, in one launch: `sum = routed (+ shared ·
/// σ(gate)) + residual` and `out = rms_norm(sum)·weight`, written also quantized into `q`. The values of
/// `moe_combine`, the shared expert's `unary` sigmoid, `binary` multiply and add, then [`add_rms_norm`]
/// with `q`, bit for bit. `n` (the residual's length) must be a multiple of 32.
pub fn moe_add_rms_norm(
    dev: &Device,
    (routed, shared): (RoutedOut<'_>, Option<SharedOut<'_>>),
    (residual, weight, eps): (&DeviceBuffer<f32>, Option<&DeviceBuffer<f32>>, f32),
    (sum, out, q): (
        &mut DeviceBuffer<f32>,
        &mut DeviceBuffer<f32>,
        &mut DeviceBuffer<BlockQ8_1>,
    ),
) -> CudaResult<()> {
    let n = residual.len();
    if n == 0 || !n.is_multiple_of(BlockQ8_1::ELEMS) {
        return invalid(format!(
            "moe_add_rms_norm: a row of {n} values (a multiple of 32)"
        ));
    }
    let mut args = MoeAddNormArgs {
        ncols: as_i32("moe_add_rms_norm width", n)?,
        eps,
        residual: residual.address(),
        ..MoeAddNormArgs::default()
    };
    match routed {
        RoutedOut::Slots { y, weights } => {
            let k = weights.len();
            if k == 0 {
                return invalid("moe_add_rms_norm: no slot".into());
            }
            check_len("moe_add_rms_norm slots", y, k * n)?;
            args.y = y.address();
            args.weights = weights.address();
            args.k = as_i32("moe_add_rms_norm slots", k)?;
        }
        RoutedOut::Summed(y) => {
            check_len("moe_add_rms_norm routed", y, n)?;
            args.y = y.address();
        }
    }
    if let Some(s) = shared {
        check_len("moe_add_rms_norm shared", s.y, n)?;
        args.shared = s.y.address();
        if let Some(g) = s.gate {
            check_len("moe_add_rms_norm shared gate", g, 1)?;
            args.shared_gate = g.address();
        }
    }
    if let Some(w) = weight {
        check_len("moe_add_rms_norm weight", w, n)?;
        args.weight = w.address();
    }
    check_len("moe_add_rms_norm sum", sum, n)?;
    check_len("moe_add_rms_norm out", out, n)?;
    check_len("moe_add_rms_norm q", q, n / BlockQ8_1::ELEMS)?;
    args.sum_out = sum.address();
    args.out = out.address();
    args.q = q.address();
    let f = dev.function(KernelModule::Quantize, "moe_add_rms_norm_q8_1")?;
    let mut b = dev.launch_builder(&f);
    b.arg(&args);
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (norm_threads(n), 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: every address in args is a live buffer of the length checked above (y k × n or n floats,
    // weights k, shared n, its gate 1, residual, weight, sum and out n floats, q n/32 blocks; the optional
    // ones null otherwise, which the kernel tests); n and the thread count are multiples of 32 as the
    // quantization needs. The kernel writes only sum, out and q, which the caller lends mutably.
    unsafe { b.launch(cfg) }?;
    dev.after_launch("moe_add_rms_norm_q8_1")
}

/// The kernel's argument struct (`MatvecManyArgs` in matvec.cuh), field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct MatvecManyArgs {
    w: [u64; MATVEC_MANY_MAX],
    y: [u64; MATVEC_MANY_MAX],
    nrows: [i32; MATVEC_MANY_MAX],
    n_mat: i32,
    ncols: i32,
    wpr: i32,
    rpg: i32,
}

// Passed by its bytes: a plain `repr(C)` struct of 64- and 32-bit numbers, laid out as the kernel's `MatvecManyArgs`.
super::launch::value_args!(MatvecManyArgs);

/// Whether [`matvec_q_many`] takes matrices of this format.
pub fn many_takes(ty: GgmlType) -> bool {
    q_format(ty).is_some()
}

/// `ys[m] = ws[m]·x` for up to [`MATVEC_MANY_MAX`] quantized matrices of one format and width, with `x`
/// already quantized (`cols/32` blocks): the values of one `ops::matvec_q` per matrix, in one launch.
pub fn matvec_q_many(
    dev: &Device,
    ws: &[&DeviceMatrix],
    xq: &DeviceBuffer<BlockQ8_1>,
    ys: &mut [&mut DeviceBuffer<f32>],
) -> CudaResult<()> {
    let Some(first) = ws.first() else {
        return invalid("matvec_q_many: no matrix".into());
    };
    if ws.len() > MATVEC_MANY_MAX || ys.len() != ws.len() {
        return invalid(format!(
            "matvec_q_many: {} matrices and {} results (at most {MATVEC_MANY_MAX})",
            ws.len(),
            ys.len()
        ));
    }
    let (ty, cols) = (first.ty, first.cols);
    if let Some(w) = ws.iter().find(|w| w.ty != ty || w.cols != cols) {
        return invalid(format!(
            "matvec_q_many: a {} matrix of {} columns beside {ty} of {cols}",
            w.ty, w.cols
        ));
    }
    let fmt = q_format(ty)
        .ok_or_else(|| CudaError::Invalid(format!("no matvec_many kernel for {ty}")))?;
    let name = fmt.many;
    check_len("matvec_many x", xq, cols / BlockQ8_1::ELEMS)?;
    let mut args = MatvecManyArgs {
        n_mat: ws.len() as i32,
        ncols: as_i32("cols", cols)?,
        ..MatvecManyArgs::default()
    };
    for (m, (w, y)) in ws.iter().zip(ys.iter()).enumerate() {
        check_len("matvec_many y", y, w.rows)?;
        args.w[m] = w.data().address();
        args.y[m] = y.address();
        args.nrows[m] = as_i32("rows", w.rows)?;
    }
    let total_rows: usize = ws.iter().map(|w| w.rows).sum();
    let (mut cfg, wpr, rpg) = q_matvec_rows_config(ty, total_rows, cols, 1);
    // Each matrix's blocks as its own launch would have them, back to back (the kernel's walk).
    let rows_per_block = (cfg.block_dim.1 as usize / wpr as usize) * rpg as usize;
    let blocks: usize = ws.iter().map(|w| w.rows.div_ceil(rows_per_block)).sum();
    cfg.grid_dim = (
        u32::try_from(blocks).map_err(|_| CudaError::Invalid("matvec_many blocks".into()))?,
        1,
        1,
    );
    args.wpr = wpr;
    args.rpg = rpg;
    let f = dev.function(fmt.module, name)?;
    let mut b = dev.launch_builder(&f);
    b.arg(&args).arg(xq.slice());
    // SAFETY: each matrix holds rows × cols of the launch's format (checked at upload, the format and width
    // checked above), each y its matrix's rows floats and x cols/32 blocks (checked above); the y buffers
    // are borrowed mutably for the launch, and the kernel writes only y[m][0..rows_m].
    unsafe { b.launch(cfg) }?;
    dev.after_launch(name)
}

/// Columns `start..start+len` of every row of `x` (`[rows, in_cols]`), RMS-normed in groups of `group`
/// values (no weight) and times `s`, into `out` (`[rows, len]`): the values of `elementwise::cols`,
/// `ops::rms_norm` and `elementwise::scale`, in one launch (Qwen3.5's L2 norm of q and k).
pub fn rms_norm_cols_scale(
    dev: &Device,
    (x, in_cols): (&DeviceBuffer<f32>, usize),
    (start, len): (usize, usize),
    (group, eps, s): (usize, f32, f32),
    out: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    if in_cols == 0 || !x.len().is_multiple_of(in_cols) || start + len > in_cols {
        return invalid(format!(
            "rms_norm_cols_scale: columns {start}..{} of {} values in rows of {in_cols}",
            start + len,
            x.len()
        ));
    }
    if group == 0 || len == 0 || !len.is_multiple_of(group) {
        return invalid(format!(
            "rms_norm_cols_scale: {len} columns are not groups of {group}"
        ));
    }
    let rows = x.len() / in_cols;
    check_len("rms_norm_cols_scale out", out, rows * len)?;
    let blocks = u32::try_from(rows * (len / group))
        .map_err(|_| CudaError::Invalid("rms_norm_cols_scale groups".into()))?;
    let (in_i, start_i, len_i, group_i) = (
        as_i32("in_cols", in_cols)?,
        as_i32("start", start)?,
        as_i32("len", len)?,
        as_i32("group", group)?,
    );
    let f = dev.function(KernelModule::Norm, "rms_norm_cols_scale")?;
    let mut b = dev.launch_builder(&f);
    b.arg(x.slice())
        .arg(out.slice_mut())
        .arg(&in_i)
        .arg(&start_i)
        .arg(&len_i)
        .arg(&group_i)
        .arg(&eps)
        .arg(&s);
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (norm_threads(group), 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: x holds rows × in_cols floats and start + len <= in_cols, out rows × len floats, len a whole
    // number of groups (checked above); a block reads and writes one group.
    unsafe { b.launch(cfg) }?;
    dev.after_launch("rms_norm_cols_scale")
}

/// The inputs of [`delta_gates`]: `beta` and `alpha` `[rows, n_heads]`, `dt_bias` and `a` `[n_heads]`.
pub struct DeltaGateInputs<'a> {
    pub beta: &'a DeviceBuffer<f32>,
    pub alpha: &'a DeviceBuffer<f32>,
    pub dt_bias: &'a DeviceBuffer<f32>,
    pub a: &'a DeviceBuffer<f32>,
}

/// Qwen3.5's delta-net gates: `beta_out = sigmoid(beta)` and `gate = softplus(alpha + dt_bias)·a` (per
/// head), the values of the four element-wise launches they replace, in one.
pub fn delta_gates(
    dev: &Device,
    x: &DeltaGateInputs<'_>,
    beta_out: &mut DeviceBuffer<f32>,
    gate: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    let (n, n_heads) = (x.beta.len(), x.dt_bias.len());
    if n_heads == 0 || !n.is_multiple_of(n_heads) {
        return invalid(format!(
            "delta_gates: {n} values are not rows of {n_heads} heads"
        ));
    }
    check_len("delta_gates alpha", x.alpha, n)?;
    check_len("delta_gates a", x.a, n_heads)?;
    check_len("delta_gates beta out", beta_out, n)?;
    check_len("delta_gates gate", gate, n)?;
    let (n_i, heads_i) = (n as i64, as_i32("heads", n_heads)?);
    let f = dev.function(KernelModule::Elementwise, "delta_gates")?;
    let mut b = dev.launch_builder(&f);
    b.arg(x.beta.slice())
        .arg(x.alpha.slice())
        .arg(x.dt_bias.slice())
        .arg(x.a.slice())
        .arg(beta_out.slice_mut())
        .arg(gate.slice_mut())
        .arg(&n_i)
        .arg(&heads_i);
    // SAFETY: beta, alpha and both outputs hold n floats, dt_bias and a n_heads (checked above).
    unsafe { b.launch(grid_1d(n, 256)?) }?;
    dev.after_launch("delta_gates")
}
