//! The operations of the CUDA backend: each checks its arguments, queues one kernel on the device's compute
//! stream and checks the launch (see [`Device`] for ordering and fault reporting). Layouts are those of the
//! CPU operations in [`crate::ops`] and [`crate::matmul`], which the tests compare against.

use super::buffer::{check_shape, gpu_act, GpuAct};
use super::formats::{q_format, QFormat};
use super::module::KernelModule;
pub use super::rope::{rope, rope_into};
use super::{BlockQ8_1, CudaError, CudaResult, Device, DeviceBuffer, DeviceMatrix, ExpertTable};
use crate::ops::topk::Gating;
use crate::quant::GgmlType;
use cudarc::driver::LaunchConfig;

pub use super::buffer::{gpu_act as activation_form, GpuAct as ActivationForm};

/// Threads of a thread block of the matrix×vector kernels (32 × 4 warps; `MATVEC_WARPS` in the `.cu` files).
const MATVEC_BLOCK: (u32, u32, u32) = (32, 4, 1);

pub(crate) fn invalid<T>(msg: String) -> CudaResult<T> {
    Err(CudaError::Invalid(msg))
}

pub(crate) fn check_len<T>(what: &str, buf: &DeviceBuffer<T>, want: usize) -> CudaResult<()> {
    if buf.len() != want {
        return invalid(format!("{what}: {} elements, {want} expected", buf.len()));
    }
    Ok(())
}

pub(crate) fn as_i32(what: &str, v: usize) -> CudaResult<i32> {
    i32::try_from(v).map_err(|_| CudaError::Invalid(format!("{what} = {v} is too large")))
}

pub(crate) fn grid_1d(n: usize, threads: u32) -> CudaResult<LaunchConfig> {
    let blocks = n.div_ceil(threads as usize);
    let blocks = u32::try_from(blocks).map_err(|_| CudaError::Invalid(format!("{n} elements")))?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Quantizes `x` (a multiple of 32 values; several rows back to back are fine) into `out` (`x.len()/32`
/// blocks).
pub fn quantize_q8_1(
    dev: &Device,
    x: &DeviceBuffer<f32>,
    out: &mut DeviceBuffer<BlockQ8_1>,
) -> CudaResult<()> {
    if !x.len().is_multiple_of(BlockQ8_1::ELEMS) {
        return invalid(format!(
            "quantize_q8_1: {} values are not whole blocks",
            x.len()
        ));
    }
    check_len("quantize_q8_1 output", out, x.len() / BlockQ8_1::ELEMS)?;
    let n = as_i32("quantize_q8_1 length", x.len())?;
    let f = dev.function(KernelModule::Quantize, "quantize_q8_1")?;
    let mut b = dev.launch_builder(&f);
    b.arg(x.slice()).arg(out.slice_mut()).arg(&n);
    // SAFETY: the kernel reads n floats of x and writes n/32 blocks of out; both lengths checked above.
    unsafe { b.launch(grid_1d(x.len(), 256)?) }?;
    dev.after_launch("quantize_q8_1")
}

/// `out = q8_1(silu(gate)·up)`: [`swiglu`] then [`quantize_q8_1`] in one launch, bit for bit the same
/// (`gate.len()` a multiple of 32; `out` `gate.len()/32` blocks).
pub fn swiglu_quantize_q8_1(
    dev: &Device,
    gate: &DeviceBuffer<f32>,
    up: &DeviceBuffer<f32>,
    out: &mut DeviceBuffer<BlockQ8_1>,
) -> CudaResult<()> {
    if !gate.len().is_multiple_of(BlockQ8_1::ELEMS) {
        return invalid(format!(
            "swiglu_quantize_q8_1: {} values are not whole blocks",
            gate.len()
        ));
    }
    check_len("swiglu_quantize_q8_1 up", up, gate.len())?;
    check_len(
        "swiglu_quantize_q8_1 output",
        out,
        gate.len() / BlockQ8_1::ELEMS,
    )?;
    let n = as_i32("swiglu_quantize_q8_1 length", gate.len())?;
    let f = dev.function(KernelModule::Quantize, "swiglu_quantize_q8_1")?;
    let mut b = dev.launch_builder(&f);
    b.arg(gate.slice())
        .arg(up.slice())
        .arg(out.slice_mut())
        .arg(&n);
    // SAFETY: the kernel reads n floats of gate and up and writes n/32 blocks of out (lengths checked).
    unsafe { b.launch(grid_1d(gate.len(), 256)?) }?;
    dev.after_launch("swiglu_quantize_q8_1")
}

/// The quantized format of `ty` (its kernels and module), or why the card has none.
pub(crate) fn q_fmt(ty: GgmlType) -> CudaResult<&'static QFormat> {
    q_format(ty).ok_or_else(|| CudaError::Invalid(format!("no quantized matvec kernel for {ty}")))
}

fn f_kernel(ty: GgmlType, experts: bool) -> CudaResult<&'static str> {
    let name = match (ty, experts) {
        (GgmlType::F32, false) => "matvec_f32",
        (GgmlType::F16, false) => "matvec_f16",
        (GgmlType::BF16, false) => "matvec_bf16",
        (GgmlType::F32, true) => "matvec_experts_f32",
        (GgmlType::F16, true) => "matvec_experts_f16",
        (GgmlType::BF16, true) => "matvec_experts_bf16",
        _ => return invalid(format!("no float matvec kernel for {ty}")),
    };
    Ok(name)
}

/// Threads that share one weight block in the quantized matvec kernels (`qi / vdr` of the format's `fmt_*`
/// struct; 1 for a format the card has no quantized kernel for, which no launch reaches).
fn threads_per_weight_block(ty: GgmlType) -> usize {
    q_format(ty).map_or(1, |f| f.threads_per_block)
}

/// Warps per output row of the few-token quantized matmul kernels (so a thread block computes 4, 2 or 1
/// rows): one warp for a row of up to two warps' work (a second pass of one warp costs less than two
/// warps' sums meeting in shared memory behind a barrier), else 4. llama.cpp's mmvq gives such short
/// rows (an expert's down row of 768 Q4_K values, 48 threads' work) its `small_k` shape, four warps over
/// a row and four rows a thread: tried for one token's launches on an H100 (2026-12-07, BENCHMARKS.md
/// "Issue 15, fourteenth session"), answers 11-13% slower, taken out. The one-token kernels take at most
/// `--matvec-warps-per-row` of these ([`rows_config_capped`]).
fn warps_per_row(ty: GgmlType, cols: usize) -> u32 {
    let threads = cols / ty.block_elems() * threads_per_weight_block(ty);
    match threads {
        0..=64 => 1,
        _ => 4,
    }
}

/// `--matvec-warps-per-row` (1, 2 or 4, default 1): at most this many warps share a row of a one-token
/// matvec, so a block computes more rows with each thread looping over more weight blocks. One warp a row
/// measured fastest on an H100 (2026-12-07, BENCHMARKS.md "Issue 15, twelfth session"): every weight in
/// VRAM, answers +11% (qwen3moe) and +13% (qwen35moe) against 4 (the four warps' sums meet in shared
/// memory behind a barrier, and the launches have four times the blocks); held to 8 GB +2% and +5–7%.
/// Every value computes the same sums per thread group, in another order.
fn max_warps_per_row() -> u32 {
    match crate::options::get().gpu.matvec_warps_per_row {
        1 => 1,
        2 => 2,
        _ => 4,
    }
}

/// The launch shape of a quantized matvec over `rows` rows (`slots` expert slots); returns it with the
/// warps per row.
pub(crate) fn q_matvec_config(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    slots: usize,
) -> (LaunchConfig, i32) {
    let wpr = warps_per_row(ty, cols);
    let rows_per_block = (MATVEC_BLOCK.1 / wpr) as usize;
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(rows_per_block) as u32, slots as u32, 1),
        block_dim: MATVEC_BLOCK,
        shared_mem_bytes: 0,
    };
    (cfg, wpr as i32)
}

/// Most rows per warp group of the one-token matvec kernels (`MATVEC_MAX_RPG` in matvec.cuh).
const MATVEC_MAX_RPG: usize = 4;
/// Fewest blocks a one-token matvec launch keeps when it gives each warp group more rows (about two per SM
/// of a large card).
const MATVEC_MIN_BLOCKS: usize = 256;

/// `--matvec-rpg` (1, 2 or 4, default 1): at most this many rows per warp group in the one-token matvec
/// kernels. Every value computes every row's sum alike (the same values). One row per group is the
/// default because it measured fastest end to end: on the H200, q3 `bench` tg128 242.4 t/s with 1 against
/// 231.4 with 4 (the grouped launches have fewer, longer blocks; the decode graph overlaps short ones
/// better). A knob for measurements on other cards.
fn max_rows_per_group() -> usize {
    match crate::options::get().gpu.matvec_rows_per_group {
        4 => MATVEC_MAX_RPG,
        2 => 2,
        _ => 1,
    }
}

/// The launch shape of a one-token quantized matvec (the `matvec_*`, `matvec_experts_*` and
/// `matvec_experts_glu_*` kernels) over `rows` rows and `slots` expert slots: warps per row as
/// [`q_matvec_config`], and the most rows per warp group (4, 2, 1, at most `--matvec-rpg`) that leaves
/// the launch [`MATVEC_MIN_BLOCKS`] blocks. Returns it with the warps per row and the rows per group.
pub(crate) fn q_matvec_rows_config(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    slots: usize,
) -> (LaunchConfig, i32, i32) {
    rows_config_capped(
        ty,
        (rows, cols, slots),
        max_rows_per_group(),
        max_warps_per_row(),
    )
}

/// [`q_matvec_rows_config`] with at most `max_rpg` rows per group and `max_wpr` warps per row.
fn rows_config_capped(
    ty: GgmlType,
    (rows, cols, slots): (usize, usize, usize),
    max_rpg: usize,
    max_wpr: u32,
) -> (LaunchConfig, i32, i32) {
    let wpr = warps_per_row(ty, cols).min(max_wpr);
    let rows_per_block = (MATVEC_BLOCK.1 / wpr) as usize;
    let blocks = |rpg: usize| rows.div_ceil(rows_per_block * rpg) * slots;
    let rpg = [4, 2, 1]
        .into_iter()
        .filter(|&r| r <= max_rpg)
        .find(|&r| r == 1 || blocks(r) >= MATVEC_MIN_BLOCKS)
        .unwrap_or(1);
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(rows_per_block * rpg) as u32, slots as u32, 1),
        block_dim: MATVEC_BLOCK,
        shared_mem_bytes: 0,
    };
    (cfg, wpr as i32, rpg as i32)
}

/// `y = W·x` for a quantized `W`, with `x` already quantized ([`quantize_q8_1`]; `W.cols/32` blocks).
pub fn matvec_q(
    dev: &Device,
    w: &DeviceMatrix,
    xq: &DeviceBuffer<BlockQ8_1>,
    y: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    let fmt = q_fmt(w.ty)?;
    let name = fmt.matvec;
    check_len("matvec x", xq, w.cols / BlockQ8_1::ELEMS)?;
    check_len("matvec y", y, w.rows)?;
    let (ncols, nrows) = (as_i32("cols", w.cols)?, as_i32("rows", w.rows)?);
    let (cfg, wpr, rpg) = q_matvec_rows_config(w.ty, w.rows, w.cols, 1);
    let f = dev.function(fmt.module, name)?;
    let mut b = dev.launch_builder(&f);
    b.arg(w.data().slice())
        .arg(xq.slice())
        .arg(y.slice_mut())
        .arg(&ncols)
        .arg(&nrows)
        .arg(&wpr)
        .arg(&rpg);
    // SAFETY: the matrix holds rows × cols of its format (checked at upload); x holds cols/32 blocks and y
    // rows floats (checked above); the kernel touches nothing else.
    unsafe { b.launch(cfg) }?;
    dev.after_launch(name)
}

/// `y = W·x` for a float `W` (F32, F16, BF16).
pub fn matvec_f(
    dev: &Device,
    w: &DeviceMatrix,
    x: &DeviceBuffer<f32>,
    y: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    let name = f_kernel(w.ty, false)?;
    check_len("matvec x", x, w.cols)?;
    check_len("matvec y", y, w.rows)?;
    let (ncols, nrows) = (as_i32("cols", w.cols)?, as_i32("rows", w.rows)?);
    let f = dev.function(KernelModule::MatvecF, name)?;
    let mut b = dev.launch_builder(&f);
    b.arg(w.data().slice())
        .arg(x.slice())
        .arg(y.slice_mut())
        .arg(&ncols)
        .arg(&nrows);
    let cfg = LaunchConfig {
        grid_dim: (w.rows as u32, 1, 1),
        block_dim: MATVEC_BLOCK,
        shared_mem_bytes: 0,
    };
    // SAFETY: as in `matvec_q`, with x of cols floats.
    unsafe { b.launch(cfg) }?;
    dev.after_launch(name)
}

/// `y = W·x` for any format the GPU computes: quantizes `x` into `scratch` first when the format's dot
/// product wants [`BlockQ8_1`] (callers that multiply several matrices by one `x` quantize once and call
/// [`matvec_q`] instead).
pub fn matvec(
    dev: &Device,
    w: &DeviceMatrix,
    x: &DeviceBuffer<f32>,
    scratch: &mut DeviceBuffer<BlockQ8_1>,
    y: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    match gpu_act(w.ty) {
        Some(GpuAct::F32) => matvec_f(dev, w, x, y),
        Some(GpuAct::Q8_1) => {
            quantize_q8_1(dev, x, scratch)?;
            matvec_q(dev, w, scratch, y)
        }
        None => invalid(format!("the GPU does not compute {} matrices yet", w.ty)),
    }
}

/// The activations of an expert launch: one vector shared by every slot (gate and up projections of one
/// token), or one per slot (the down projection, whose input is each expert's own).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertInput {
    Shared,
    PerSlot,
}

/// Several experts of one tensor in one launch: for slot `s` of `ids.len()`, `y[s·rows..][..rows] =
/// W[ids[s]]·x_s`, where `x_s` is `xq` itself ([`ExpertInput::Shared`]) or its `s`-th vector of `cols`
/// values ([`ExpertInput::PerSlot`]). The ids are read on the card; an expert the table has no address
/// for gives zeros, as does an id outside `0..n_expert`. Quantized formats take [`BlockQ8_1`] input; see
/// [`matvec_experts_f`] for float ones.
pub fn matvec_experts_q(
    dev: &Device,
    table: &ExpertTable,
    ids: &DeviceBuffer<i32>,
    xq: &DeviceBuffer<BlockQ8_1>,
    input: ExpertInput,
    y: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    let fmt = q_fmt(table.ty)?;
    let blocks_per_vec = table.cols / BlockQ8_1::ELEMS;
    let x_stride = expert_input_len("matvec_experts_q", xq, blocks_per_vec, ids.len(), input)?;
    let q = QuantArgs::default();
    expert_launch(
        dev,
        (fmt.module, fmt.experts),
        table,
        (ids, xq, x_stride),
        (y, Some(q)),
    )
}

/// Where the weighted sum of a one-token expert launch's slots goes (`ExpertsSum` in matvec.cuh):
/// `out (+)= Σ_s weights[s]·y_s`, as [`moe_combine`] forms it.
pub struct SlotSum<'a> {
    /// One weight per slot.
    pub weights: &'a DeviceBuffer<f32>,
    /// The sum, `rows` values.
    pub out: &'a mut DeviceBuffer<f32>,
    /// Add to `out` instead of overwriting it.
    pub accumulate: bool,
    /// One ticket per block column of the launch.
    pub tickets: &'a mut Tickets,
}

/// [`matvec_experts_q`] that also sums the slots into `sum.out` in the same launch (the block that finishes
/// a block column last adds that column's rows over the slots): `y` as [`matvec_experts_q`] writes it,
/// `sum.out` bit for bit what [`moe_combine`] of `y` gives, one launch fewer.
pub fn matvec_experts_q_sum(
    dev: &Device,
    table: &ExpertTable,
    (ids, xq, input): (&DeviceBuffer<i32>, &DeviceBuffer<BlockQ8_1>, ExpertInput),
    y: &mut DeviceBuffer<f32>,
    sum: SlotSum<'_>,
) -> CudaResult<()> {
    let fmt = q_fmt(table.ty)?;
    let blocks_per_vec = table.cols / BlockQ8_1::ELEMS;
    let x_stride = expert_input_len("matvec_experts_q_sum", xq, blocks_per_vec, ids.len(), input)?;
    check_len("matvec_experts_q_sum weights", sum.weights, ids.len())?;
    check_len("matvec_experts_q_sum out", sum.out, table.rows)?;
    let (cfg, _, _) = q_matvec_rows_config(table.ty, table.rows, table.cols, ids.len());
    sum.tickets
        .check("matvec_experts_q_sum", cfg.grid_dim.0 as usize)?;
    let q = QuantArgs {
        sum: ExpertsSumArgs {
            weights: sum.weights.address(),
            out: sum.out.address(),
            tickets: sum.tickets.buf.address(),
            accumulate: sum.accumulate as i32,
            _pad: 0,
        },
    };
    expert_launch(
        dev,
        (fmt.module, fmt.experts),
        table,
        (ids, xq, x_stride),
        (y, Some(q)),
    )
}

/// The tickets [`matvec_experts_q_sum`] counts on for experts of this shape (one per block column).
pub fn slot_sum_tickets(ty: GgmlType, rows: usize, cols: usize, slots: usize) -> usize {
    q_matvec_rows_config(ty, rows, cols, slots).0.grid_dim.0 as usize
}

/// The tail arguments of the quantized expert kernels.
#[derive(Clone, Copy, Default)]
struct QuantArgs {
    sum: ExpertsSumArgs,
}

/// `ExpertsSum` of matvec.cuh, field for field (all zero: no sum).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct ExpertsSumArgs {
    weights: u64,
    out: u64,
    tickets: u64,
    accumulate: i32,
    _pad: i32,
}

// Passed by its bytes: a plain `repr(C)` struct of 64- and 32-bit numbers without implicit padding, laid
// out as the kernel's `ExpertsSum`.
super::launch::value_args!(ExpertsSumArgs);

/// Counters in device memory for kernels whose last block to finish a piece of work completes it
/// (`last_block_of` in common.cuh): zero when made, and every such launch leaves them zero, so one set
/// serves every launch on the compute stream (launches there run one after another) and a captured graph's
/// replays. Its address goes into graphs: keep it as long as they live.
pub struct Tickets {
    buf: DeviceBuffer<u32>,
}

impl Tickets {
    pub fn new(dev: &Device, len: usize) -> CudaResult<Tickets> {
        Ok(Tickets {
            buf: dev.zeros::<u32>(len)?,
        })
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The counts on the card now (all zero between launches), for tests and diagnosis.
    pub fn counts(&self, dev: &Device) -> CudaResult<Vec<u32>> {
        dev.download(&self.buf)
    }

    fn check(&self, what: &str, want: usize) -> CudaResult<()> {
        if want > self.len() {
            return invalid(format!("{what}: {want} tickets, {} held", self.len()));
        }
        Ok(())
    }
}

/// The gate and up experts of one token in one launch: for slot `s` of `ids.len()`,
/// `h[s·rows..][..rows] = silu(G[ids[s]]·x) ⊙ (U[ids[s]]·x)` with `xq` the token's quantized input (shared by
/// every slot). Bit for bit [`matvec_experts_q`] of each table then `swiglu`; the two weight rows are read
/// in one loop. Both tables must have the same quantized format and shape; a slot whose expert has no
/// address in either table gives zeros.
pub fn matvec_experts_glu_q(
    dev: &Device,
    tables: (&ExpertTable, &ExpertTable),
    ids: &DeviceBuffer<i32>,
    xq: &DeviceBuffer<BlockQ8_1>,
    h: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    glu_launch(dev, tables, (ids, xq), h, None, None)
}

/// [`matvec_experts_glu_q`] whose launch also asks the card's L2 cache for the slots' experts of `down`
/// (the launch after it) while gate and up compute (`--gpu-prefetch`; a hint: the same values).
pub fn matvec_experts_glu_q_ahead(
    dev: &Device,
    tables: (&ExpertTable, &ExpertTable),
    down: &ExpertTable,
    ids: &DeviceBuffer<i32>,
    xq: &DeviceBuffer<BlockQ8_1>,
    h: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    glu_launch(dev, tables, (ids, xq), h, None, Some(down))
}

/// [`matvec_experts_glu_q`] that also quantizes `h` into `hq` for the down experts in the same launch (the
/// block that finishes a 32-row piece of a slot last quantizes it): `hq` bit for bit [`quantize_q8_1`] of
/// `h`, one launch fewer. Needs the rows a multiple of 32 and a launch whose blocks cover whole pieces.
pub fn matvec_experts_glu_q8(
    dev: &Device,
    tables: (&ExpertTable, &ExpertTable),
    (ids, xq): (&DeviceBuffer<i32>, &DeviceBuffer<BlockQ8_1>),
    h: &mut DeviceBuffer<f32>,
    (hq, tickets): (&mut DeviceBuffer<BlockQ8_1>, &mut Tickets),
) -> CudaResult<()> {
    glu_launch(dev, tables, (ids, xq), h, Some((hq, tickets)), None)
}

/// Whether [`matvec_experts_glu_q8`] takes gate and up experts of this shape (rows in whole q8_1 blocks,
/// launch blocks that cover whole 32-row pieces).
pub fn glu_q8_takes(ty: GgmlType, rows: usize, cols: usize, slots: usize) -> bool {
    let (_, wpr, rpg) = q_matvec_rows_config(ty, rows, cols, slots);
    let rows_per_block = (MATVEC_BLOCK.1 as usize / wpr as usize) * rpg as usize;
    q_format(ty).is_some()
        && rows.is_multiple_of(BlockQ8_1::ELEMS)
        && BlockQ8_1::ELEMS.is_multiple_of(rows_per_block)
}

fn glu_launch(
    dev: &Device,
    (gate, up): (&ExpertTable, &ExpertTable),
    (ids, xq): (&DeviceBuffer<i32>, &DeviceBuffer<BlockQ8_1>),
    h: &mut DeviceBuffer<f32>,
    quantized: Option<(&mut DeviceBuffer<BlockQ8_1>, &mut Tickets)>,
    next: Option<&ExpertTable>,
) -> CudaResult<()> {
    if (gate.ty, gate.rows, gate.cols, gate.n_expert) != (up.ty, up.rows, up.cols, up.n_expert) {
        return invalid(format!(
            "matvec_experts_glu_q: gate {} [{}, {}] × {} and up {} [{}, {}] × {} differ",
            gate.ty, gate.rows, gate.cols, gate.n_expert, up.ty, up.rows, up.cols, up.n_expert
        ));
    }
    let fmt = q_fmt(gate.ty)?;
    let name = fmt.glu;
    check_shape(gate.ty, gate.rows, gate.cols)?;
    check_len("matvec_experts_glu_q x", xq, gate.cols / BlockQ8_1::ELEMS)?;
    let n_slots = ids.len();
    if n_slots > 65_535 {
        return invalid(format!(
            "{name}: {n_slots} slots (at most 65535 per launch)"
        ));
    }
    check_len("matvec_experts_glu_q h", h, n_slots * gate.rows)?;
    let (ncols, nrows) = (as_i32("cols", gate.cols)?, as_i32("rows", gate.rows)?);
    let n_expert = as_i32("n_expert", gate.n_expert)?;
    let (cfg, wpr, rpg) = q_matvec_rows_config(gate.ty, gate.rows, gate.cols, n_slots);
    let (hq_addr, tickets_addr) = match &quantized {
        Some((hq, tickets)) => {
            if !glu_q8_takes(gate.ty, gate.rows, gate.cols, n_slots) {
                return invalid(format!(
                    "matvec_experts_glu_q8: {} rows of {} × {n_slots} slots do not quantize in the launch",
                    gate.rows, gate.ty
                ));
            }
            check_len("matvec_experts_glu_q8 hq", hq, h.len() / BlockQ8_1::ELEMS)?;
            tickets.check("matvec_experts_glu_q8", h.len() / BlockQ8_1::ELEMS)?;
            (hq.address(), tickets.buf.address())
        }
        None => (0, 0),
    };
    // The next launch's experts, prefetched (ids index both launches' tables alike).
    let (next_addr, next_bytes) = match next {
        Some(t) if t.n_expert == gate.n_expert => (*t.table_address(), t.expert_bytes() as i64),
        _ => (0u64, 0i64),
    };
    let f = dev.function(fmt.module, name)?;
    let mut b = dev.launch_builder(&f);
    b.arg(gate.table_address())
        .arg(up.table_address())
        .arg(ids.slice())
        .arg(&n_expert)
        .arg(xq.slice())
        .arg(h.slice_mut())
        .arg(&ncols)
        .arg(&nrows)
        .arg(&wpr)
        .arg(&rpg)
        .arg(&hq_addr)
        .arg(&tickets_addr)
        .arg(&next_addr)
        .arg(&next_bytes);
    // SAFETY: both tables hold n_expert addresses, each 0 or the start of a rows × cols matrix of their
    // (common) format that lives as long as the tables' owner; the kernel reads ids[0..n_slots] and gives
    // 0 for ids outside 0..n_expert; x holds cols/32 blocks and h n_slots × rows floats (checked above).
    // With hq (0 otherwise), hq holds h's blocks and the tickets one per block (checked above), both
    // borrowed mutably for the launch; the tickets are zero before and after it. The next table (0: none)
    // holds n_expert addresses of matrices of next_bytes each, only prefetched, never read by the kernel.
    unsafe { b.launch(cfg) }?;
    dev.after_launch(name)
}

/// [`matvec_experts_q`] for float expert tensors (F32, F16, BF16), with f32 input.
pub fn matvec_experts_f(
    dev: &Device,
    table: &ExpertTable,
    ids: &DeviceBuffer<i32>,
    x: &DeviceBuffer<f32>,
    input: ExpertInput,
    y: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    let name = f_kernel(table.ty, true)?;
    let x_stride = expert_input_len("matvec_experts_f", x, table.cols, ids.len(), input)?;
    expert_launch(
        dev,
        (KernelModule::MatvecF, name),
        table,
        (ids, x, x_stride),
        (y, None),
    )
}

/// Checks the input length of an expert launch; returns the stride between slots' vectors.
fn expert_input_len<T>(
    what: &str,
    x: &DeviceBuffer<T>,
    per_vec: usize,
    n_slots: usize,
    input: ExpertInput,
) -> CudaResult<i64> {
    let (want, stride) = match input {
        ExpertInput::Shared => (per_vec, 0),
        ExpertInput::PerSlot => (per_vec * n_slots, per_vec),
    };
    check_len(&format!("{what} x"), x, want)?;
    Ok(stride as i64)
}

/// One launch of an expert kernel over `ids.len()` slots; `q`: the tail arguments of the quantized
/// kernels (`None` for the float ones).
fn expert_launch<T>(
    dev: &Device,
    kernel: (KernelModule, &'static str),
    table: &ExpertTable,
    (ids, x, x_stride): (&DeviceBuffer<i32>, &DeviceBuffer<T>, i64),
    (y, q): (&mut DeviceBuffer<f32>, Option<QuantArgs>),
) -> CudaResult<()> {
    let (module, name) = kernel;
    check_shape(table.ty, table.rows, table.cols)?;
    let n_slots = ids.len();
    if n_slots > 65_535 {
        return invalid(format!(
            "{name}: {n_slots} slots (at most 65535 per launch)"
        ));
    }
    check_len(&format!("{name} y"), y, n_slots * table.rows)?;
    let (ncols, nrows) = (as_i32("cols", table.cols)?, as_i32("rows", table.rows)?);
    let n_expert = as_i32("n_expert", table.n_expert)?;
    // The quantized kernels take the warps per row, the rows per group and the slots' sum as their last
    // arguments; the float ones one row per block.
    let (cfg, wpr) = match (module, q) {
        (KernelModule::MatvecQ | KernelModule::MatvecIq, Some(q)) => {
            let (cfg, wpr, rpg) = q_matvec_rows_config(table.ty, table.rows, table.cols, n_slots);
            (cfg, Some((wpr, rpg, q)))
        }
        (KernelModule::MatvecQ | KernelModule::MatvecIq, None) => {
            return invalid(format!(
                "{name}: a quantized expert launch without its arguments"
            ));
        }
        _ => {
            let cfg = LaunchConfig {
                grid_dim: (table.rows as u32, n_slots as u32, 1),
                block_dim: MATVEC_BLOCK,
                shared_mem_bytes: 0,
            };
            (cfg, None)
        }
    };
    let f = dev.function(module, name)?;
    let mut b = dev.launch_builder(&f);
    b.arg(table.table_address())
        .arg(ids.slice())
        .arg(&n_expert)
        .arg(x.slice())
        .arg(&x_stride)
        .arg(y.slice_mut())
        .arg(&ncols)
        .arg(&nrows);
    if let Some((wpr, rpg, q)) = &wpr {
        b.arg(wpr).arg(rpg).arg(&q.sum);
    }
    // SAFETY: the table holds n_expert addresses, each 0 or the start of a rows × cols matrix of the
    // table's format that lives as long as the table's owner; the kernel reads ids[0..n_slots] and gives 0
    // for ids outside 0..n_expert; x and y lengths are checked above. A slots' sum (all zero otherwise)
    // has one weight per slot, an out of rows floats and a ticket per block column, checked by
    // `matvec_experts_q_sum`, which borrows out and the tickets mutably for the launch.
    unsafe { b.launch(cfg) }?;
    dev.after_launch(name)
}

/// RMS norm of every group of `group` values of `x` into `out` (same length), times `weight` (`group`
/// values) when given.
pub fn rms_norm(
    dev: &Device,
    x: &DeviceBuffer<f32>,
    group: usize,
    weight: Option<&DeviceBuffer<f32>>,
    eps: f32,
    out: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    if group == 0 || !x.len().is_multiple_of(group) {
        return invalid(format!(
            "rms_norm: {} values are not groups of {group}",
            x.len()
        ));
    }
    check_len("rms_norm out", out, x.len())?;
    if let Some(w) = weight {
        check_len("rms_norm weight", w, group)?;
    }
    let ncols = as_i32("rms_norm group", group)?;
    let rows =
        u32::try_from(x.len() / group).map_err(|_| CudaError::Invalid("rms_norm rows".into()))?;
    let null: u64 = 0;
    let f = dev.function(KernelModule::Norm, "rms_norm")?;
    let mut b = dev.launch_builder(&f);
    b.arg(x.slice());
    match weight {
        Some(w) => b.arg(w.slice()),
        None => b.arg(&null),
    };
    b.arg(out.slice_mut()).arg(&ncols).arg(&eps);
    let threads = if group >= 1024 {
        1024
    } else {
        (group.div_ceil(32) * 32) as u32
    };
    let cfg = LaunchConfig {
        grid_dim: (rows, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: x and out hold rows × group floats, weight group floats or is null (the kernel checks).
    unsafe { b.launch(cfg) }?;
    dev.after_launch("rms_norm")
}

/// [`rms_norm`] of rows of `group` values (a multiple of 32) that also writes the result quantized into
/// `q` (`x.len()/32` blocks): the values of [`rms_norm`] then [`quantize_q8_1`], in one launch.
pub fn rms_norm_quantize_q8_1(
    dev: &Device,
    x: &DeviceBuffer<f32>,
    group: usize,
    weight: Option<&DeviceBuffer<f32>>,
    eps: f32,
    (out, q): (&mut DeviceBuffer<f32>, &mut DeviceBuffer<BlockQ8_1>),
) -> CudaResult<()> {
    if group == 0 || !group.is_multiple_of(BlockQ8_1::ELEMS) || !x.len().is_multiple_of(group) {
        return invalid(format!(
            "rms_norm_quantize: {} values are not groups of {group} (a multiple of 32)",
            x.len()
        ));
    }
    check_len("rms_norm_quantize out", out, x.len())?;
    check_len("rms_norm_quantize q", q, x.len() / BlockQ8_1::ELEMS)?;
    if let Some(w) = weight {
        check_len("rms_norm_quantize weight", w, group)?;
    }
    let ncols = as_i32("rms_norm group", group)?;
    let rows =
        u32::try_from(x.len() / group).map_err(|_| CudaError::Invalid("rms_norm rows".into()))?;
    let null: u64 = 0;
    let f = dev.function(KernelModule::Quantize, "rms_norm_quantize_q8_1")?;
    let mut b = dev.launch_builder(&f);
    b.arg(x.slice());
    match weight {
        Some(w) => b.arg(w.slice()),
        None => b.arg(&null),
    };
    b.arg(out.slice_mut())
        .arg(q.slice_mut())
        .arg(&ncols)
        .arg(&eps);
    // The thread count of `rms_norm`, so the block's sum is formed alike.
    let threads = if group >= 1024 { 1024 } else { group as u32 };
    let cfg = LaunchConfig {
        grid_dim: (rows, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: x and out hold rows × group floats, q rows × group / 32 blocks, weight group floats or is
    // null (the kernel checks).
    unsafe { b.launch(cfg) }?;
    dev.after_launch("rms_norm_quantize_q8_1")
}

/// `out = silu(gate)·up`, element-wise.
pub fn swiglu(
    dev: &Device,
    gate: &DeviceBuffer<f32>,
    up: &DeviceBuffer<f32>,
    out: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    check_len("swiglu up", up, gate.len())?;
    check_len("swiglu out", out, gate.len())?;
    let n = gate.len() as i64;
    let f = dev.function(KernelModule::Act, "swiglu_f32")?;
    let mut b = dev.launch_builder(&f);
    b.arg(gate.slice())
        .arg(up.slice())
        .arg(out.slice_mut())
        .arg(&n);
    // SAFETY: all three buffers hold n floats.
    unsafe { b.launch(grid_1d(gate.len(), 256)?) }?;
    dev.after_launch("swiglu_f32")
}

/// `out = gelu(gate) · up`, element-wise (GeGLU with ggml's CPU GELU: [`crate::ops::act::gelu_ggml`]);
pub fn geglu(
    dev: &Device,
    gate: &DeviceBuffer<f32>,
    up: &DeviceBuffer<f32>,
    out: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    check_len("geglu up", up, gate.len())?;
    check_len("geglu out", out, gate.len())?;
    let n = gate.len() as i64;
    let f = dev.function(KernelModule::Act, "geglu_f32")?;
    let mut b = dev.launch_builder(&f);
    b.arg(gate.slice())
        .arg(up.slice())
        .arg(out.slice_mut())
        .arg(&n);
    // SAFETY: all three buffers hold n floats.
    unsafe { b.launch(grid_1d(gate.len(), 256)?) }?;
    dev.after_launch("geglu_f32")
}

/// `out = gelu(x)` element-wise, ggml's CPU GELU ([`crate::ops::act::gelu_ggml`]).
pub fn gelu(dev: &Device, x: &DeviceBuffer<f32>, out: &mut DeviceBuffer<f32>) -> CudaResult<()> {
    check_len("gelu out", out, x.len())?;
    let n = x.len() as i64;
    let f = dev.function(KernelModule::Act, "gelu_f32")?;
    let mut b = dev.launch_builder(&f);
    b.arg(x.slice()).arg(out.slice_mut()).arg(&n);
    // SAFETY: both buffers hold n floats.
    unsafe { b.launch(grid_1d(x.len(), 256)?) }?;
    dev.after_launch("gelu_f32")
}

/// `x = cap·tanh(x/cap)` in place (final logit softcapping).
pub fn softcap(dev: &Device, x: &mut DeviceBuffer<f32>, cap: f32) -> CudaResult<()> {
    if cap <= 0.0 || x.is_empty() {
        return invalid(format!("softcap: cap {cap} on {} values", x.len()));
    }
    let n = x.len() as i64;
    let cfg = grid_1d(x.len(), 256)?;
    let f = dev.function(KernelModule::Act, "softcap_f32")?;
    let mut b = dev.launch_builder(&f);
    b.arg(x.slice_mut()).arg(&cap).arg(&n);
    // SAFETY: x holds n floats.
    unsafe { b.launch(cfg) }?;
    dev.after_launch("softcap_f32")
}

/// `out = silu(x)`, element-wise.
pub fn silu(dev: &Device, x: &DeviceBuffer<f32>, out: &mut DeviceBuffer<f32>) -> CudaResult<()> {
    check_len("silu out", out, x.len())?;
    let n = x.len() as i64;
    let f = dev.function(KernelModule::Act, "silu_f32")?;
    let mut b = dev.launch_builder(&f);
    b.arg(x.slice()).arg(out.slice_mut()).arg(&n);
    // SAFETY: both buffers hold n floats.
    unsafe { b.launch(grid_1d(x.len(), 256)?) }?;
    dev.after_launch("silu_f32")
}

/// How router logits become the chosen experts (the arguments of [`crate::ops::topk::route`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Routing {
    pub n_expert: usize,
    pub k: usize,
    pub gating: Gating,
    pub norm: bool,
    pub scale: f32,
}

/// A selection bias for the choice of experts (as llama.cpp's `exp_probs_b`): the `n_expert` floats of
/// `bias` from element `offset` on (device memory read by every launch that chooses with it, so the host
/// may rewrite it between launches and a captured graph reads what it holds at each replay; one buffer
/// may hold the vectors of many routers) are added to each expert's probability before the top-k, and
/// the chosen experts' weights are still their unbiased probabilities
/// ([`crate::ops::topk::route_biased`]). With `changed` (`[n_tokens]`), the launch also writes per token
/// which of its choices the bias made: bit `j` set when the `j`-th chosen expert is not among the `k` the
/// unbiased probabilities choose (ties to the lower id either way); `k` ≤ 32 then.
pub struct SelectionBias<'a> {
    pub bias: &'a DeviceBuffer<f32>,
    pub offset: usize,
    pub changed: Option<&'a mut DeviceBuffer<i32>>,
}

impl SelectionBias<'_> {
    /// The device address of the routing's first bias value (checked by [`check_bias`]).
    fn address(&self) -> u64 {
        self.bias.address() + (self.offset * std::mem::size_of::<f32>()) as u64
    }
}

/// Checks a selection bias against a routing of `n_tokens` tokens.
fn check_bias(what: &str, r: &Routing, n_tokens: usize, b: &SelectionBias<'_>) -> CudaResult<()> {
    if b.offset + r.n_expert > b.bias.len() {
        return invalid(format!(
            "{what}: {} bias values from {} in a buffer of {}",
            r.n_expert,
            b.offset,
            b.bias.len()
        ));
    }
    if let Some(c) = &b.changed {
        check_len(&format!("{what} changed"), c, n_tokens)?;
        if r.k > 32 {
            return invalid(format!(
                "{what}: the choices a bias made are bits of one word: k {} > 32",
                r.k
            ));
        }
    }
    Ok(())
}

/// Routes every token of `logits` (`[n_tokens, n_expert]`): `ids` and `weights` get `[n_tokens, k]`, the
/// likeliest first, as [`crate::ops::topk::route`] computes them.
pub fn route_topk(
    dev: &Device,
    logits: &DeviceBuffer<f32>,
    r: &Routing,
    ids: &mut DeviceBuffer<i32>,
    weights: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    route_topk_biased(dev, logits, r, None, ids, weights)
}

/// [`route_topk`] with an optional [`SelectionBias`] (none: the same launch, the same values).
pub fn route_topk_biased(
    dev: &Device,
    logits: &DeviceBuffer<f32>,
    r: &Routing,
    mut bias: Option<SelectionBias<'_>>,
    ids: &mut DeviceBuffer<i32>,
    weights: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    let (n_expert, k) = check_routing("route_topk", r)?;
    if !logits.len().is_multiple_of(r.n_expert) {
        return invalid(format!(
            "route_topk: {} logits of {} experts",
            logits.len(),
            r.n_expert
        ));
    }
    let n_tokens = logits.len() / r.n_expert;
    check_len("route_topk ids", ids, n_tokens * r.k)?;
    check_len("route_topk weights", weights, n_tokens * r.k)?;
    if let Some(b) = &bias {
        check_bias("route_topk", r, n_tokens, b)?;
    }
    // One warp per token, up to 4 tokens a block as shared memory allows (n_expert floats each).
    let per_warp = r.n_expert * 4;
    let warps = (ROUTE_SHARED_MAX / per_warp)
        .clamp(1, 4)
        .min(n_tokens.max(1));
    let n_tokens_i = as_i32("n_tokens", n_tokens)?;
    let (gating, norm) = routing_flags(r);
    let f = dev.function(KernelModule::Route, "route_topk")?;
    let null: u64 = 0;
    let bias_address = bias.as_ref().map_or(0, SelectionBias::address);
    let mut b = dev.launch_builder(&f);
    b.arg(logits.slice())
        .arg(&n_tokens_i)
        .arg(&n_expert)
        .arg(&k)
        .arg(&gating)
        .arg(&norm)
        .arg(&r.scale)
        .arg(ids.slice_mut())
        .arg(weights.slice_mut());
    push_bias(&mut b, &mut bias, (&bias_address, &null));
    let blocks = u32::try_from(n_tokens.div_ceil(warps))
        .map_err(|_| CudaError::Invalid(format!("route_topk: {n_tokens} tokens")))?;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (32, warps as u32, 1),
        shared_mem_bytes: (warps * per_warp) as u32,
    };
    // SAFETY: logits hold n_tokens × n_expert floats, ids and weights n_tokens × k (checked above), the bias
    // buffer n_expert floats from its address and changed n_tokens ints, or they are null (checked above;
    // the kernel checks for null); each of the block's warps has n_expert floats of dynamic shared memory.
    unsafe { b.launch(cfg) }?;
    dev.after_launch("route_topk")
}

/// The last two arguments of a routing launch: the bias's address (`bias_address`: 0 without one) and
/// the choices it made, or null.
fn push_bias<'a>(
    b: &mut super::launch::KernelLaunch<'a>,
    bias: &'a mut Option<SelectionBias<'_>>,
    (bias_address, null): (&'a u64, &'a u64),
) {
    b.arg(bias_address);
    match bias.as_mut().and_then(|s| s.changed.as_mut()) {
        Some(c) => b.arg(c.slice_mut()),
        None => b.arg(null),
    };
}

/// Dynamic shared memory the routing kernels ask for at most (the default limit of a launch).
const ROUTE_SHARED_MAX: usize = 48 * 1024;

/// Checks a routing's shape (experts, k, shared memory for the probabilities); returns n_expert and k.
fn check_routing(what: &str, r: &Routing) -> CudaResult<(i32, i32)> {
    if r.n_expert == 0 || r.k == 0 || r.k > r.n_expert {
        return invalid(format!("{what}: {} experts, k {}", r.n_expert, r.k));
    }
    if r.n_expert * 4 > ROUTE_SHARED_MAX {
        return invalid(format!(
            "{what}: {} experts do not fit shared memory",
            r.n_expert
        ));
    }
    Ok((as_i32("n_expert", r.n_expert)?, as_i32("k", r.k)?))
}

/// The kernels' gating (0 softmax, 1 sigmoid) and renormalization flags.
fn routing_flags(r: &Routing) -> (i32, i32) {
    let gating = match r.gating {
        Gating::Softmax => 0,
        Gating::Sigmoid => 1,
    };
    (gating, r.norm as i32)
}

/// Whether [`router_topk`] takes a router of this format.
pub fn router_topk_takes(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// One token's router and the choice of its experts in one launch: `logits = W·x` (`W`: `[n_expert, cols]`
/// in F32, F16 or BF16, the one matrix of a one-expert table; the values of [`matvec_experts_f`]), then `ids` and `weights` as [`route_topk`] chooses
/// them from `logits`, done by the launch's last block to finish (one ticket).
pub fn router_topk(
    dev: &Device,
    (w, x): (&ExpertTable, &DeviceBuffer<f32>),
    r: &Routing,
    (logits, tickets): (&mut DeviceBuffer<f32>, &mut Tickets),
    (ids, weights): (&mut DeviceBuffer<i32>, &mut DeviceBuffer<f32>),
) -> CudaResult<()> {
    router_topk_biased(dev, (w, x), r, None, (logits, tickets), (ids, weights))
}

/// [`router_topk`] with an optional [`SelectionBias`] (none: the same launch, the same values).
pub fn router_topk_biased(
    dev: &Device,
    (w, x): (&ExpertTable, &DeviceBuffer<f32>),
    r: &Routing,
    mut bias: Option<SelectionBias<'_>>,
    (logits, tickets): (&mut DeviceBuffer<f32>, &mut Tickets),
    (ids, weights): (&mut DeviceBuffer<i32>, &mut DeviceBuffer<f32>),
) -> CudaResult<()> {
    let (n_expert, k) = check_routing("router_topk", r)?;
    let name = match w.ty {
        GgmlType::F32 => "router_topk_f32",
        GgmlType::F16 => "router_topk_f16",
        GgmlType::BF16 => "router_topk_bf16",
        ty => return invalid(format!("router_topk: no kernel for a {ty} router")),
    };
    check_shape(w.ty, w.rows, w.cols)?;
    if w.rows != r.n_expert || w.n_expert != 1 {
        return invalid(format!(
            "router_topk: a router of {} rows × {} matrices for {} experts",
            w.rows, w.n_expert, r.n_expert
        ));
    }
    check_len("router_topk x", x, w.cols)?;
    check_len("router_topk logits", logits, r.n_expert)?;
    check_len("router_topk ids", ids, r.k)?;
    check_len("router_topk weights", weights, r.k)?;
    tickets.check("router_topk", 1)?;
    if let Some(b) = &bias {
        check_bias("router_topk", r, 1, b)?;
    }
    let ncols = as_i32("cols", w.cols)?;
    let (gating, norm) = routing_flags(r);
    let f = dev.function(KernelModule::Route, name)?;
    let null: u64 = 0;
    let bias_address = bias.as_ref().map_or(0, SelectionBias::address);
    let mut b = dev.launch_builder(&f);
    b.arg(w.table_address())
        .arg(x.slice())
        .arg(&ncols)
        .arg(&n_expert)
        .arg(&k)
        .arg(&gating)
        .arg(&norm)
        .arg(&r.scale)
        .arg(logits.slice_mut())
        .arg(tickets.buf.slice_mut())
        .arg(ids.slice_mut())
        .arg(weights.slice_mut());
    push_bias(&mut b, &mut bias, (&bias_address, &null));
    let cfg = LaunchConfig {
        grid_dim: (r.n_expert as u32, 1, 1),
        block_dim: MATVEC_BLOCK,
        shared_mem_bytes: (r.n_expert * 4) as u32,
    };
    // SAFETY: the table's one address is the start of n_expert rows × cols of its format that lives as long
    // as the table's owner (rows checked above), x holds cols
    // floats, logits n_expert, ids and weights k, the bias buffer n_expert floats from its address and
    // changed one int, or they are null (checked above), the tickets at least one, zero before and after
    // the launch; the last block has n_expert floats of dynamic shared memory.
    unsafe { b.launch(cfg) }?;
    dev.after_launch(name)
}

/// `out[t] (+)= Σ_j weights[t, j] · y[t, j]`: the weighted sum of each token's `k` expert outputs of `n`
/// values (`y`: `[n_tokens, k, n]`, `out`: `[n_tokens, n]`); `accumulate` adds to `out` instead of
/// overwriting it.
pub fn moe_combine(
    dev: &Device,
    y: &DeviceBuffer<f32>,
    weights: &DeviceBuffer<f32>,
    k: usize,
    accumulate: bool,
    out: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    if k == 0 || !weights.len().is_multiple_of(k) {
        return invalid(format!("moe_combine: {} weights, k {k}", weights.len()));
    }
    let n_tokens = weights.len() / k;
    if !out.len().is_multiple_of(n_tokens) {
        return invalid(format!(
            "moe_combine: out of {} for {n_tokens} tokens",
            out.len()
        ));
    }
    let n = out.len() / n_tokens;
    check_len("moe_combine y", y, n_tokens * k * n)?;
    let (k_i, n_i, acc) = (as_i32("k", k)?, as_i32("n", n)?, accumulate as i32);
    let f = dev.function(KernelModule::Route, "moe_combine")?;
    let mut b = dev.launch_builder(&f);
    b.arg(y.slice())
        .arg(weights.slice())
        .arg(&k_i)
        .arg(&n_i)
        .arg(&acc)
        .arg(out.slice_mut());
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256) as u32, n_tokens as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: y holds n_tokens × k × n floats, weights n_tokens × k, out n_tokens × n (checked above).
    unsafe { b.launch(cfg) }?;
    dev.after_launch("moe_combine")
}

#[cfg(test)]
mod tests {
    //! Host-side checks that need no GPU: the kernel names and per-format constants the launchers use
    //! agree with the `.cu` sources.

    use super::*;
    use crate::quant::WEIGHT_TYPES;

    #[test]
    fn every_gpu_format_has_its_kernels() {
        // The quantized formats' entry points and constants are checked against their sources in
        // formats.rs; here, that every weight type the card takes has kernels of the matching kind.
        let f_src = KernelModule::MatvecF.source();
        for &ty in WEIGHT_TYPES {
            match gpu_act(ty) {
                Some(GpuAct::Q8_1) => assert!(q_fmt(ty).is_ok(), "{ty}"),
                Some(GpuAct::F32) => {
                    for experts in [false, true] {
                        let name = f_kernel(ty, experts).unwrap();
                        let suffix = name
                            .trim_start_matches("matvec_")
                            .trim_start_matches("experts_");
                        assert!(
                            f_src.contains(&format!("MATVEC_F_ENTRY_POINTS({suffix},")),
                            "{name} has no entry point in matvec_f.cu"
                        );
                    }
                }
                None => assert!(q_fmt(ty).is_err() && f_kernel(ty, false).is_err()),
            }
        }
    }

    #[test]
    fn warps_per_row_give_every_thread_work_where_they_can() {
        // Q4_K: 16 threads per 256 values.
        assert_eq!(warps_per_row(GgmlType::Q4_K, 512), 1);
        assert_eq!(warps_per_row(GgmlType::Q4_K, 768), 1);
        assert_eq!(warps_per_row(GgmlType::Q4_K, 2048), 4);
        // Q6_K: 32 threads per 256 values.
        assert_eq!(warps_per_row(GgmlType::Q6_K, 768), 4);
        let (cfg, wpr) = q_matvec_config(GgmlType::Q4_K, 769, 768, 8);
        assert_eq!((cfg.grid_dim, wpr), ((193, 8, 1), 1));
        // One token, rows grouped up to 4: 4 rows per group where 256 blocks remain, fewer where they
        // would not; with the cap at 1, the shape of q_matvec_config.
        let q4k = GgmlType::Q4_K;
        let (cfg, wpr, rpg) = rows_config_capped(q4k, (768, 2048, 8), 4, 4);
        assert_eq!((cfg.grid_dim, wpr, rpg), ((192, 8, 1), 4, 4));
        let (cfg, _, rpg) = rows_config_capped(q4k, (512, 2048, 1), 4, 4);
        assert_eq!((cfg.grid_dim.0, rpg), (256, 2));
        let (cfg, _, rpg) = rows_config_capped(q4k, (128, 2048, 1), 4, 4);
        assert_eq!((cfg.grid_dim.0, rpg), (128, 1));
        let (cfg, wpr, rpg) = rows_config_capped(q4k, (769, 768, 8), 1, 4);
        assert_eq!((cfg.grid_dim, wpr, rpg), ((193, 8, 1), 1, 1));
        // One warp a row (the default cap): a block of 4 warps computes 4 rows of 2048 values.
        let (cfg, wpr, rpg) = rows_config_capped(q4k, (768, 2048, 8), 1, 1);
        assert_eq!((cfg.grid_dim, wpr, rpg), ((192, 8, 1), 1, 1));
    }
    #[test]
    fn ticketed_launches_take_the_model_shapes_and_refuse_the_rest() {
        let q4k = GgmlType::Q4_K;
        // Gate and up quantizing their output: the qwen3moe and qwen35moe experts (rows of 768 and 512
        // for 8 slots) in whole 32-row pieces; not rows off the q8_1 blocks, not a float matrix.
        assert!(glu_q8_takes(q4k, 768, 2048, 8));
        assert!(glu_q8_takes(q4k, 512, 2048, 8));
        assert!(!glu_q8_takes(q4k, 768 + 16, 2048, 8));
        assert!(!glu_q8_takes(GgmlType::F32, 768, 2048, 8));
        // The down experts' sum: one ticket per block column, within the engine's set of 1 << 14.
        assert_eq!(slot_sum_tickets(q4k, 2048, 768, 8), 512);
        assert!(slot_sum_tickets(q4k, 2048, 512, 8) <= 1 << 14);
        // The fused router takes float routers only; a routing's shape is checked before any launch.
        assert!(router_topk_takes(GgmlType::BF16) && !router_topk_takes(q4k));
        let r = |n_expert, k| Routing {
            n_expert,
            k,
            gating: Gating::Softmax,
            norm: true,
            scale: 1.0,
        };
        assert_eq!(check_routing("t", &r(128, 8)).ok(), Some((128, 8)));
        assert!(check_routing("t", &r(8, 9)).is_err());
        assert!(check_routing("t", &r(0, 0)).is_err());
        assert!(check_routing("t", &r(ROUTE_SHARED_MAX, 8)).is_err());
    }
}
