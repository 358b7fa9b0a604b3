//! The element-wise and layout operations of a forward pass on the card (`kernels/cuda/elementwise.cu`):
//! add and multiply (same shapes, a per-row scalar, a per-column weight), scale, sigmoid / softplus / tanh /
//! exp, column slices, one part of interleaved head groups, repeated heads, and the f32 → f16 store of new
//! keys and values into a KV cache. Layouts are the CPU backend's: row-major `[rows, cols]` f32.

use super::module::KernelModule;
use super::ops::{as_i32, check_len, grid_1d, invalid};
use super::{CudaResult, Device, DeviceBuffer};

/// A binary operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    Add,
    Mul,
}

/// How the second operand of [`binary`] spreads over the first (`[rows, cols]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Broadcast {
    /// Same shape.
    None,
    /// One value per row (`[rows]`).
    PerRow,
    /// One value per column (`[cols]`), the same for every row.
    PerColumn,
}

/// A unary function of [`unary`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnaryFn {
    Sigmoid,
    /// `ln(1+e^x)`, `x` above 20 unchanged (ggml's).
    Softplus,
    Tanh,
    Exp,
}

/// `out = a op b` with `a` and `out` of `rows × cols` values and `b` as `bc` says.
pub fn binary(
    dev: &Device,
    a: &DeviceBuffer<f32>,
    b: &DeviceBuffer<f32>,
    cols: usize,
    op: BinaryOp,
    bc: Broadcast,
    out: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    if cols == 0 || !a.len().is_multiple_of(cols) {
        return invalid(format!("binary: {} values in rows of {cols}", a.len()));
    }
    let rows = a.len() / cols;
    let want_b = match bc {
        Broadcast::None => a.len(),
        Broadcast::PerRow => rows,
        Broadcast::PerColumn => cols,
    };
    check_len("binary b", b, want_b)?;
    check_len("binary out", out, a.len())?;
    let n = a.len() as i64;
    let cols_i = as_i32("cols", cols)?;
    let op_i: i32 = match op {
        BinaryOp::Add => 0,
        BinaryOp::Mul => 1,
    };
    let mode: i32 = match bc {
        Broadcast::None => 0,
        Broadcast::PerRow => 1,
        Broadcast::PerColumn => 2,
    };
    let f = dev.function(KernelModule::Elementwise, "ew_binary")?;
    let mut l = dev.launch_builder(&f);
    l.arg(a.slice())
        .arg(b.slice())
        .arg(out.slice_mut())
        .arg(&n)
        .arg(&cols_i)
        .arg(&op_i)
        .arg(&mode);
    // SAFETY: a and out hold n floats, b as many as its broadcast reads (checked above).
    unsafe { l.launch(grid_1d(a.len(), 256)?) }?;
    dev.after_launch("ew_binary")
}

/// `out = s·x`.
pub fn scale(
    dev: &Device,
    x: &DeviceBuffer<f32>,
    s: f32,
    out: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    check_len("scale out", out, x.len())?;
    let n = x.len() as i64;
    let f = dev.function(KernelModule::Elementwise, "ew_scale")?;
    let mut l = dev.launch_builder(&f);
    l.arg(x.slice()).arg(out.slice_mut()).arg(&s).arg(&n);
    // SAFETY: both buffers hold n floats.
    unsafe { l.launch(grid_1d(x.len(), 256)?) }?;
    dev.after_launch("ew_scale")
}

/// `out = f(x)` element-wise.
pub fn unary(
    dev: &Device,
    x: &DeviceBuffer<f32>,
    func: UnaryFn,
    out: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    check_len("unary out", out, x.len())?;
    let n = x.len() as i64;
    let f_i: i32 = match func {
        UnaryFn::Sigmoid => 0,
        UnaryFn::Softplus => 1,
        UnaryFn::Tanh => 2,
        UnaryFn::Exp => 3,
    };
    let f = dev.function(KernelModule::Elementwise, "ew_unary")?;
    let mut l = dev.launch_builder(&f);
    l.arg(x.slice()).arg(out.slice_mut()).arg(&n).arg(&f_i);
    // SAFETY: both buffers hold n floats.
    unsafe { l.launch(grid_1d(x.len(), 256)?) }?;
    dev.after_launch("ew_unary")
}

/// `out` (`[rows, len]`) = columns `start..start+len` of `x` (`[rows, in_cols]`).
pub fn cols(
    dev: &Device,
    x: &DeviceBuffer<f32>,
    in_cols: usize,
    start: usize,
    len: usize,
    out: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    if in_cols == 0 || !x.len().is_multiple_of(in_cols) || start + len > in_cols || len == 0 {
        return invalid(format!(
            "cols: {start}+{len} of rows of {in_cols} ({} values)",
            x.len()
        ));
    }
    let rows = x.len() / in_cols;
    check_len("cols out", out, rows * len)?;
    let (r, ic, s, n) = (
        rows as i64,
        as_i32("in_cols", in_cols)?,
        start as i32,
        len as i32,
    );
    let f = dev.function(KernelModule::Elementwise, "ew_cols")?;
    let mut l = dev.launch_builder(&f);
    l.arg(x.slice())
        .arg(out.slice_mut())
        .arg(&r)
        .arg(&ic)
        .arg(&s)
        .arg(&n);
    // SAFETY: x holds rows × in_cols floats, out rows × len; every read is below start + len ≤ in_cols.
    unsafe { l.launch(grid_1d(rows * len, 256)?) }?;
    dev.after_launch("ew_cols")
}

/// From rows of `n_heads` groups of `parts·head` values, part `part` of each group (`[rows, n_heads·head]`).
pub fn head_part(
    dev: &Device,
    x: &DeviceBuffer<f32>,
    rows: usize,
    head: usize,
    parts: usize,
    part: usize,
    out: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    let group = head * parts;
    if rows == 0 || group == 0 || part >= parts || !x.len().is_multiple_of(rows * group) {
        return invalid(format!(
            "head_part: {} values, {rows} rows, head {head}, parts {parts}",
            x.len()
        ));
    }
    let n_heads = x.len() / rows / group;
    check_len("head_part out", out, rows * n_heads * head)?;
    let args = [
        as_i32("n_heads", n_heads)?,
        as_i32("head", head)?,
        parts as i32,
        part as i32,
    ];
    let (r, cfg) = (rows as i64, grid_1d(out.len(), 256)?);
    let f = dev.function(KernelModule::Elementwise, "ew_head_part")?;
    let mut l = dev.launch_builder(&f);
    l.arg(x.slice()).arg(out.slice_mut()).arg(&r);
    for a in &args {
        l.arg(a);
    }
    // SAFETY: x holds rows × n_heads × parts × head floats, out rows × n_heads × head (checked above).
    unsafe { l.launch(cfg) }?;
    dev.after_launch("ew_head_part")
}

/// Each head of `head` values repeated `times` times (see `Compute::repeat_heads` for the two orders).
pub fn repeat_heads(
    dev: &Device,
    x: &DeviceBuffer<f32>,
    rows: usize,
    head: usize,
    times: usize,
    interleave: bool,
    out: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    if rows == 0 || head == 0 || times == 0 || !x.len().is_multiple_of(rows * head) {
        return invalid(format!(
            "repeat_heads: {} values, {rows} rows, head {head}",
            x.len()
        ));
    }
    let n_heads = x.len() / rows / head;
    check_len("repeat_heads out", out, x.len() * times)?;
    let args = [
        as_i32("n_heads", n_heads)?,
        as_i32("head", head)?,
        as_i32("times", times)?,
        interleave as i32,
    ];
    let (r, cfg) = (rows as i64, grid_1d(out.len(), 256)?);
    let f = dev.function(KernelModule::Elementwise, "ew_repeat_heads")?;
    let mut l = dev.launch_builder(&f);
    l.arg(x.slice()).arg(out.slice_mut()).arg(&r);
    for a in &args {
        l.arg(a);
    }
    // SAFETY: x holds rows × n_heads × head floats, out `times` as many (checked above).
    unsafe { l.launch(cfg) }?;
    dev.after_launch("ew_repeat_heads")
}

/// `dst[offset..offset + src.len()] = f16(src)`: new rows of keys or values into an f16 KV cache.
pub fn kv_store_f16(
    dev: &Device,
    src: &DeviceBuffer<f32>,
    dst: &mut DeviceBuffer<u16>,
    offset: usize,
) -> CudaResult<()> {
    if offset + src.len() > dst.len() {
        return invalid(format!(
            "kv_store: {} values at {offset} into a cache of {}",
            src.len(),
            dst.len()
        ));
    }
    let (n, off) = (src.len() as i64, offset as i64);
    let f = dev.function(KernelModule::Elementwise, "kv_store_f16")?;
    let mut l = dev.launch_builder(&f);
    l.arg(src.slice()).arg(dst.slice_mut()).arg(&n).arg(&off);
    // SAFETY: the writes land in offset .. offset + n ≤ dst.len() (checked above); src holds n floats.
    unsafe { l.launch(grid_1d(src.len(), 256)?) }?;
    dev.after_launch("kv_store_f16")
}

/// Where [`kv_store_f16_pos`] writes: the f16 caches of one layer, `[n_ctx, k_width]` and `[n_ctx, v_width]`.
pub struct KvDst<'a> {
    pub k: &'a mut DeviceBuffer<u16>,
    pub v: &'a mut DeviceBuffer<u16>,
    pub k_width: usize,
    pub v_width: usize,
}

/// Row `r` of `k` (`[n, k_width]`) and `v` (`[n, v_width]`) into row `positions[r]` of the caches, as f16, in
/// one launch. The positions are read on the card (a captured graph stores at each replay's position); a
/// position outside the caches stores nothing.
pub fn kv_store_f16_pos(
    dev: &Device,
    k: &DeviceBuffer<f32>,
    v: &DeviceBuffer<f32>,
    positions: &DeviceBuffer<i32>,
    dst: KvDst<'_>,
) -> CudaResult<()> {
    let n = positions.len();
    let (kw, vw) = (dst.k_width, dst.v_width);
    if kw == 0 || vw == 0 || n == 0 {
        return invalid(format!("kv_store_pos: widths {kw}/{vw}, {n} rows"));
    }
    check_len("kv_store_pos k", k, n * kw)?;
    check_len("kv_store_pos v", v, n * vw)?;
    let n_ctx = dst.k.len() / kw;
    if dst.k.len() != n_ctx * kw || dst.v.len() != n_ctx * vw {
        return invalid(format!(
            "kv_store_pos: caches of {} and {} values for widths {kw}/{vw}",
            dst.k.len(),
            dst.v.len()
        ));
    }
    let (n_i, kw_i, vw_i, ctx_i) = (
        as_i32("rows", n)?,
        as_i32("k width", kw)?,
        as_i32("v width", vw)?,
        as_i32("n_ctx", n_ctx)?,
    );
    let blocks_x = (kw + vw).div_ceil(256).min(64) as u32;
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (blocks_x, n as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let f = dev.function(KernelModule::Elementwise, "kv_store_f16_pos")?;
    let mut l = dev.launch_builder(&f);
    l.arg(k.slice())
        .arg(v.slice())
        .arg(dst.k.slice_mut())
        .arg(dst.v.slice_mut())
        .arg(positions.slice())
        .arg(&n_i)
        .arg(&kw_i)
        .arg(&vw_i)
        .arg(&ctx_i);
    // SAFETY: k and v hold n rows of their widths, the caches n_ctx rows (checked above); the kernel writes
    // only rows below n_ctx and reads n positions.
    unsafe { l.launch(cfg) }?;
    dev.after_launch("kv_store_f16_pos")
}
