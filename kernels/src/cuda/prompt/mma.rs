//! Launchers of the tensor-core prompt kernels (`kernels/cuda/mmq.cuh`, instantiated in `matmul_mma.cu` and
//! `mmq_iq.cu`): int8 `mma.sync` over tiles of [`MMQ_ROWS`] weight rows × 16, 32, 64 or 128 tokens, for the
//! formats with such a kernel (Q4_K, Q5_K, Q6_K, Q8_0, and IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
//! IQ3_S, IQ4_NL, IQ4_XS) on Ampere and later; [`super::matmul_q`] and [`super::matmul_experts_q`] choose
//! them.

use super::super::module::KernelModule;
use super::super::ops::{as_i32, check_len, invalid};
use super::super::{BlockQ8_1, CudaResult, Device, DeviceBuffer, DeviceMatrix, ExpertTable};
use crate::quant::GgmlType;
use cudarc::driver::LaunchConfig;

/// Weight rows per thread block (`MMQ_ROWS`: 8 warps of 16).
pub const MMQ_ROWS: usize = 128;
/// Values of a row per step (`MMQ_K`): the row length must be a multiple.
const MMQ_K: usize = 128;
/// Fewest tokens for which a plain matmul takes the tensor cores (below, the dp4a tiles of 8 waste less), for
/// every format. The lattice i-quants, which the dp4a kernel decodes again for every token, were measured too
/// (H100, 2026-12-06, `cuda_bench`'s `bench_iquants_as_test_backend_ops`, 4096 x 14336 at n = 8): their
/// tensor-core tile of 16 took 171-327 µs against the dp4a kernel's 117-157 µs.
pub const MIN_TOKENS: usize = 16;
const BLOCK: (u32, u32, u32) = (32, 8, 1);
/// Blocks that keep a large card busy (two per SM of an H100/H200, with two blocks resident per SM).
const ENOUGH_BLOCKS: usize = 256;

/// The token tiles the kernels come in.
pub const TILES: [usize; 4] = [16, 32, 64, 128];

/// One format's tensor-core kernels: the three entry points `MMQ_ENTRY_POINTS(<suffix>, F, <tile>, ..)` makes
/// in `mmq.cuh`, for each tile of [`TILES`], and the module whose file instantiates them.
struct MmqFormat {
    ty: GgmlType,
    module: KernelModule,
    /// `mmq_<suffix>_<tile>`: one matrix.
    plain: [&'static str; 4],
    /// `mmq_experts_<suffix>_<tile>`: tokens grouped by expert.
    experts: [&'static str; 4],
    /// `mmq_experts_pair_<suffix>_<tile>`: two expert tables (gate and up) in one launch.
    pair: [&'static str; 4],
}

macro_rules! mmq_formats {
    ($($ty:ident => $module:ident, $suffix:literal;)*) => {
        /// Every format with tensor-core kernels.
        const MMQ_FORMATS: &[MmqFormat] = &[$(MmqFormat {
            ty: GgmlType::$ty,
            module: KernelModule::$module,
            plain: [
                concat!("mmq_", $suffix, "_16"),
                concat!("mmq_", $suffix, "_32"),
                concat!("mmq_", $suffix, "_64"),
                concat!("mmq_", $suffix, "_128"),
            ],
            experts: [
                concat!("mmq_experts_", $suffix, "_16"),
                concat!("mmq_experts_", $suffix, "_32"),
                concat!("mmq_experts_", $suffix, "_64"),
                concat!("mmq_experts_", $suffix, "_128"),
            ],
            pair: [
                concat!("mmq_experts_pair_", $suffix, "_16"),
                concat!("mmq_experts_pair_", $suffix, "_32"),
                concat!("mmq_experts_pair_", $suffix, "_64"),
                concat!("mmq_experts_pair_", $suffix, "_128"),
            ],
        }),*];
    };
}

mmq_formats! {
    Q4_K => MatmulMma, "q4_k";
    Q5_K => MatmulMma, "q5_k";
    Q6_K => MatmulMma, "q6_k";
    Q8_0 => MatmulMma, "q8_0";
    IQ1_S => MmqIq, "iq1_s";
    IQ1_M => MmqIq, "iq1_m";
    IQ2_XXS => MmqIq, "iq2_xxs";
    IQ2_XS => MmqIq, "iq2_xs";
    IQ2_S => MmqIq, "iq2_s";
    IQ3_XXS => MmqIq, "iq3_xxs";
    IQ3_S => MmqIq, "iq3_s";
    IQ4_NL => MmqIq, "iq4_nl";
    IQ4_XS => MmqIq, "iq4_xs";
}

/// The tensor-core kernels of `ty`, if it has them.
fn format(ty: GgmlType) -> Option<&'static MmqFormat> {
    MMQ_FORMATS.iter().find(|f| f.ty == ty)
}

/// Whether `--mmq off` turned the tensor-core kernels off (to measure against the dp4a ones).
fn disabled() -> bool {
    !crate::options::get().gpu.mmq
}

/// The expert tile `--mmq-expert-tile` asks for (8: the dp4a kernel; 16, 32, 64, 128), if any.
pub fn forced_expert_tile() -> Option<usize> {
    crate::options::get()
        .gpu
        .mmq_expert_tile
        .filter(|t| *t == super::MATMUL_TILE || TILES.contains(t))
}

/// Whether `--mmq-expert-tiles old` asked for the tile sizes chosen before the kernels skipped a short
/// tile's empty tokens (the smallest tile holding an expert's average share), to measure against them.
pub fn old_expert_tiles() -> bool {
    crate::options::get().gpu.mmq_old_expert_tiles
}

/// Whether `--mmq-pair off` asked for gate and up as two launches (to measure the pair kernel).
pub fn pair_disabled() -> bool {
    !crate::options::get().gpu.mmq_pair
}

/// Whether a tensor-core kernel takes rows of `cols` values of `ty` on `dev` (sm_80 or later).
pub fn takes(dev: &Device, ty: GgmlType, cols: usize) -> bool {
    format(ty).is_some()
        && cols > 0
        && cols.is_multiple_of(MMQ_K)
        && dev.compute_capability().0 >= 8
        && !disabled()
}

/// The kernel of `ty` for tiles of `tile` tokens (plain, grouped by expert or the pair of grouped tables)
/// and its module.
fn kernel(ty: GgmlType, kind: Kind, tile: usize) -> CudaResult<(KernelModule, &'static str)> {
    let Some(f) = format(ty) else {
        return invalid(format!("no tensor-core matmul for {ty}"));
    };
    let Some(i) = TILES.iter().position(|&t| t == tile) else {
        return invalid(format!("tensor-core matmul: tiles of {tile} tokens"));
    };
    let names = match kind {
        Kind::Plain => &f.plain,
        Kind::Experts => &f.experts,
        Kind::Pair => &f.pair,
    };
    Ok((f.module, names[i]))
}

/// Which of a format's entry points.
#[derive(Clone, Copy)]
enum Kind {
    Plain,
    Experts,
    Pair,
}

/// `y = x·Wᵀ` for `n` tokens (`xq` `[n, cols/32]` blocks, `y` `[n, rows]`, checked by the caller).
pub fn matmul(
    dev: &Device,
    w: &DeviceMatrix,
    xq: &DeviceBuffer<BlockQ8_1>,
    n: usize,
    y: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    // The largest tile that still gives the card enough blocks (a 512-row projection over 512 tokens has
    // only 32 blocks of 64 tokens); else the smallest. Tiles of 128 run one block per SM, so about one
    // block per SM is enough for them (H200: 4096×2048 Q4_K over 512 tokens, 128 blocks of 128 tokens:
    // 108 TFLOP/s against 96 with tiles of 64; Q6_K/Q8_0 85 against 68).
    let row_blocks = w.rows.div_ceil(MMQ_ROWS);
    let tile = if n > 64 && row_blocks * n.div_ceil(128) >= ENOUGH_BLOCKS / 2 {
        128
    } else {
        [64, 32]
            .into_iter()
            .find(|&t| n > t / 2 && row_blocks * n.div_ceil(t) >= ENOUGH_BLOCKS)
            .unwrap_or(16)
    };
    matmul_tiled(dev, w, xq, n, tile, y)
}

/// [`matmul`] with tiles of `tile` tokens (one of [`TILES`]).
pub fn matmul_tiled(
    dev: &Device,
    w: &DeviceMatrix,
    xq: &DeviceBuffer<BlockQ8_1>,
    n: usize,
    tile: usize,
    y: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    let (module, name) = kernel(w.ty, Kind::Plain, tile)?;
    check_len("mmq x", xq, n * (w.cols / BlockQ8_1::ELEMS))?;
    check_len("mmq y", y, n * w.rows)?;
    let tiles = n.div_ceil(tile);
    if tiles > 65535 {
        return invalid(format!("mmq: {n} tokens in one call"));
    }
    let (ncols, nrows, n_i) = (
        as_i32("cols", w.cols)?,
        as_i32("rows", w.rows)?,
        as_i32("tokens", n)?,
    );
    let cfg = LaunchConfig {
        grid_dim: (w.rows.div_ceil(MMQ_ROWS) as u32, tiles as u32, 1),
        block_dim: BLOCK,
        shared_mem_bytes: 0,
    };
    let f = dev.function(module, name)?;
    let mut b = dev.launch_builder(&f);
    b.arg(w.data().slice())
        .arg(xq.slice())
        .arg(y.slice_mut())
        .arg(&ncols)
        .arg(&nrows)
        .arg(&n_i);
    // SAFETY: the matrix holds rows × cols of its format (checked at upload; cols a multiple of MMQ_K, so
    // every step reads whole blocks); x holds n × cols/32 blocks and y n × rows floats (checked above).
    // Block (i, t) reads rows below `rows` (clamped) and tokens t·tile.. below n, and writes those only.
    unsafe { b.launch(cfg) }?;
    dev.after_launch(name)
}

/// [`matmul_experts`] for two tables of one format and shape over the same tiles and `xq` (gate and up),
/// in one launch (`mmq_experts_pair_*`: grid z 0 the first table into `ys[0]`, 1 the second into `ys[1]`).
pub fn matmul_experts_pair(
    dev: &Device,
    tables: [&ExpertTable; 2],
    tiles: &DeviceBuffer<i32>,
    tile: usize,
    xq: &DeviceBuffer<BlockQ8_1>,
    ys: [&mut DeviceBuffer<f32>; 2],
) -> CudaResult<()> {
    let [ta, tb] = tables;
    if (ta.ty, ta.rows, ta.cols, ta.n_expert) != (tb.ty, tb.rows, tb.cols, tb.n_expert) {
        return invalid("mmq_experts_pair: tables of different shapes".to_string());
    }
    let (module, name) = kernel(ta.ty, Kind::Pair, tile)?;
    let per_row = ta.cols / BlockQ8_1::ELEMS;
    if per_row == 0 || !xq.len().is_multiple_of(per_row) || !tiles.len().is_multiple_of(3) {
        return invalid(format!(
            "mmq_experts_pair: {} blocks, {} tile ints",
            xq.len(),
            tiles.len()
        ));
    }
    let n_sorted = xq.len() / per_row;
    let [ya, yb] = ys;
    check_len("mmq_experts_pair y", ya, n_sorted * ta.rows)?;
    check_len("mmq_experts_pair y", yb, n_sorted * ta.rows)?;
    let n_tiles = tiles.len() / 3;
    if n_tiles == 0 {
        return Ok(());
    }
    if n_tiles > 65535 {
        return invalid(format!("mmq_experts_pair: {n_tiles} tiles in one call"));
    }
    let (ncols, nrows, n_exp) = (
        as_i32("cols", ta.cols)?,
        as_i32("rows", ta.rows)?,
        as_i32("experts", ta.n_expert)?,
    );
    let cfg = LaunchConfig {
        grid_dim: (ta.rows.div_ceil(MMQ_ROWS) as u32, n_tiles as u32, 2),
        block_dim: BLOCK,
        shared_mem_bytes: 0,
    };
    let f = dev.function(module, name)?;
    let mut b = dev.launch_builder(&f);
    b.arg(ta.table_address())
        .arg(tb.table_address())
        .arg(&n_exp)
        .arg(tiles.slice())
        .arg(xq.slice())
        .arg(ya.slice_mut())
        .arg(yb.slice_mut())
        .arg(&ncols)
        .arg(&nrows);
    // SAFETY: as matmul_experts, for each of the two tables (same shape, checked above) and its output.
    unsafe { b.launch(cfg) }?;
    dev.after_launch(name)
}

/// `y[r] = W_e·x[r]` over the tiles of `tiles` (`(expert, first row, rows ≤ tile)`, as
/// [`super::ExpertGrouping::tile_table`]); `xq` `[n_sorted, cols/32]`, `y` `[n_sorted, rows]`.
pub fn matmul_experts(
    dev: &Device,
    table: &ExpertTable,
    tiles: &DeviceBuffer<i32>,
    tile: usize,
    xq: &DeviceBuffer<BlockQ8_1>,
    y: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    let (module, name) = kernel(table.ty, Kind::Experts, tile)?;
    let per_row = table.cols / BlockQ8_1::ELEMS;
    if per_row == 0 || !xq.len().is_multiple_of(per_row) || !tiles.len().is_multiple_of(3) {
        return invalid(format!(
            "mmq_experts: {} blocks, {} tile ints",
            xq.len(),
            tiles.len()
        ));
    }
    let n_sorted = xq.len() / per_row;
    check_len("mmq_experts y", y, n_sorted * table.rows)?;
    let n_tiles = tiles.len() / 3;
    if n_tiles == 0 {
        return Ok(());
    }
    if n_tiles > 65535 {
        return invalid(format!("mmq_experts: {n_tiles} tiles in one call"));
    }
    let (ncols, nrows, n_exp) = (
        as_i32("cols", table.cols)?,
        as_i32("rows", table.rows)?,
        as_i32("experts", table.n_expert)?,
    );
    let cfg = LaunchConfig {
        grid_dim: (table.rows.div_ceil(MMQ_ROWS) as u32, n_tiles as u32, 1),
        block_dim: BLOCK,
        shared_mem_bytes: 0,
    };
    let f = dev.function(module, name)?;
    let mut b = dev.launch_builder(&f);
    b.arg(table.table_address())
        .arg(&n_exp)
        .arg(tiles.slice())
        .arg(xq.slice())
        .arg(y.slice_mut())
        .arg(&ncols)
        .arg(&nrows);
    // SAFETY: the table holds n_expert addresses of rows × cols matrices (or null); the tiles are read on
    // the card, so the kernel trusts them: ExpertGrouping builds them over n_sorted rows with at most
    // `tile` rows each (empty padding tiles write nothing). x and y are checked above.
    unsafe { b.launch(cfg) }?;
    dev.after_launch(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tensor_core_kernel_has_an_entry_point() {
        for &ty in crate::quant::WEIGHT_TYPES {
            let Some(f) = format(ty) else { continue };
            let src = f.module.source();
            for (i, tile) in TILES.into_iter().enumerate() {
                // MMQ_ENTRY_POINTS(suffix, F, tile, min_blocks) makes mmq_<suffix>_<tile>,
                // mmq_experts_<suffix>_<tile> and mmq_experts_pair_<suffix>_<tile>.
                let suffix = f.plain[i]
                    .trim_start_matches("mmq_")
                    .trim_end_matches(&format!("_{tile}"));
                assert_eq!(f.experts[i], format!("mmq_experts_{suffix}_{tile}"));
                assert_eq!(f.pair[i], format!("mmq_experts_pair_{suffix}_{tile}"));
                assert!(
                    src.lines()
                        .any(|l| l.starts_with(&format!("MMQ_ENTRY_POINTS({suffix}, "))
                            && l.contains(&format!(", {tile}, "))),
                    "{} in {}.cu",
                    f.plain[i],
                    f.module.name()
                );
            }
        }
        // The macro makes the three entry points from the suffix.
        for stem in [
            "mmq_##name##_##BN(",
            "mmq_experts_##name##_##BN(",
            "mmq_experts_pair_##name##_##BN(",
        ] {
            assert!(KernelModule::MmqIq.source().contains(stem), "{stem}");
        }
    }

    #[test]
    fn every_i_quant_has_tensor_core_kernels() {
        for ty in crate::quant::I_QUANTS {
            let f = format(ty).unwrap_or_else(|| panic!("{ty}"));
            assert_eq!(f.module, KernelModule::MmqIq, "{ty}");
        }
        assert_eq!(MMQ_FORMATS.len(), 13);
        for (i, f) in MMQ_FORMATS.iter().enumerate() {
            assert!(
                MMQ_FORMATS[i + 1..].iter().all(|g| g.ty != f.ty),
                "{}",
                f.ty
            );
        }
    }
}
