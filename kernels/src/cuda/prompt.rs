//! Matrix×matrix for prompt batches (`matmul_*` of `kernels/cuda/matvec.cuh`, instantiated in matvec_q.cu
//! and matvec_iq.cu): the matvec kernels' integer dot products over tiles of [`MATMUL_TILE`] tokens, so each
//! weight block comes from memory once per tile (the tensor-core kernels of `mmq.cuh` where the format has
//! one: Q4_K, Q5_K, Q6_K, Q8_0 in `matmul_mma.cu`, the nine i-quants in `mmq_iq.cu`; module `mma`;
//! [`matmul_path`] says which a product takes); and the expert-grouped form for MoE prompts: the (token,
//! expert) pairs sorted by expert ([`group_by_expert`] on the card, [`ExpertGrouping`] on the host), the
//! quantized activations gathered into that order, each tile one expert's run of rows (gate and up in one
//! launch), the outputs combined back per token with the routing weights.

mod mma;

use super::formats::q_format;
use super::module::KernelModule;
use super::ops::{as_i32, check_len, invalid, q_matvec_config};
use super::{BlockQ8_1, CudaError, CudaResult, Device, DeviceBuffer, DeviceMatrix, ExpertTable};
use crate::quant::GgmlType;
use cudarc::driver::LaunchConfig;

/// Tokens per tile of the matmul kernels (`MATMUL_COLS`).
pub const MATMUL_TILE: usize = 8;

/// The dp4a matmul kernel of `ty` (`matmul_<fmt>`, or `matmul_experts_<fmt>`) and its module.
fn matmul_kernel(ty: GgmlType, experts: bool) -> CudaResult<(KernelModule, &'static str)> {
    let fmt = q_format(ty)
        .ok_or_else(|| CudaError::Invalid(format!("no quantized matmul kernel for {ty}")))?;
    Ok((
        fmt.module,
        if experts {
            fmt.matmul_experts
        } else {
            fmt.matmul
        },
    ))
}

/// Which kernels a prompt product takes: the int8 tensor cores (`mmq.cuh`, instantiated in `matmul_mma.cu`
/// and `mmq_iq.cu`; `MmaPair`: gate and up in one launch of `mmq_experts_pair_*`) or the dp4a tiles of
/// [`MATMUL_TILE`] tokens (`matmul_*` of `matvec_q.cu` and `matvec_iq.cu`). The functions that say it are
/// those the launchers decide by, so a test can require the path it means to check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulPath {
    MmaPair,
    Mma,
    Dp4a,
}

/// The kernels [`matmul_q`] takes for `n` tokens of a matrix of `ty` with rows of `cols` values on `dev`.
pub fn matmul_path(dev: &Device, ty: GgmlType, cols: usize, n: usize) -> MatmulPath {
    if n >= mma::MIN_TOKENS && mma::takes(dev, ty, cols) {
        MatmulPath::Mma
    } else {
        MatmulPath::Dp4a
    }
}

/// The kernels [`matmul_experts_q`] takes for `table` with tiles of `tile_rows` rows (an error for a tile
/// size the format has no kernel for).
pub fn experts_path(dev: &Device, table: &ExpertTable, tile_rows: usize) -> CudaResult<MatmulPath> {
    if tile_rows == MATMUL_TILE {
        Ok(MatmulPath::Dp4a)
    } else if mma::takes(dev, table.ty, table.cols) {
        Ok(MatmulPath::Mma)
    } else {
        invalid(format!(
            "matmul_experts {}: tiles of {tile_rows} rows",
            table.ty
        ))
    }
}

/// The kernels [`matmul_experts_q_pair`] takes for `tables` with tiles of `tile_rows` rows: one launch of
/// both on the tensor cores when they have one format and shape (and `--mmq-pair off` did not ask for two),
/// else [`experts_path`] of each.
pub fn experts_pair_path(
    dev: &Device,
    tables: [&ExpertTable; 2],
    tile_rows: usize,
) -> CudaResult<MatmulPath> {
    let [ta, tb] = tables;
    let same = (ta.ty, ta.rows, ta.cols, ta.n_expert) == (tb.ty, tb.rows, tb.cols, tb.n_expert);
    let path = experts_path(dev, ta, tile_rows)?;
    Ok(
        if same && path == MatmulPath::Mma && !mma::pair_disabled() {
            MatmulPath::MmaPair
        } else {
            path
        },
    )
}

/// Whether [`matmul_experts_q`] takes experts of `ty`.
pub fn has_matmul_experts(ty: GgmlType) -> bool {
    q_format(ty).is_some()
}

/// The rows per tile [`matmul_experts_q`] takes for `table` when `slots` (token, expert) pairs are spread
/// over `n_expert` experts: build the [`ExpertGrouping`] with it. The tensor-core kernels unpack a tile's
/// weights once and multiply only the tile's groups of 32 tokens holding one, so the cost of a tile is the
/// unpacking plus its tokens: few tiles per expert win, but below about 48 tokens per expert the smaller
/// tile of 32 keeps more blocks in flight; from there 128 (one block per SM, a quarter of the unpacking of
/// 32).
/// With fewer than about 4 tokens per expert the dp4a kernel's tiles of [`MATMUL_TILE`] waste less.
/// `--mmq-expert-tile` (8, 16, 32, 64 or 128) overrides the choice, to measure the others;
/// `--mmq-expert-tiles old` takes the earlier choice (the smallest tile holding the average share).
pub fn expert_tile_rows(dev: &Device, table: &ExpertTable, slots: usize, n_expert: usize) -> usize {
    if !mma::takes(dev, table.ty, table.cols) {
        return MATMUL_TILE;
    }
    if let Some(tile) = mma::forced_expert_tile() {
        return tile;
    }
    let per_expert = slots / n_expert.max(1);
    if per_expert < 4 {
        return MATMUL_TILE;
    }
    if mma::old_expert_tiles() {
        return match per_expert {
            0..24 => 16,
            24..48 => 32,
            _ => 64,
        };
    }
    // Measured on the H200 (cuda_layer_bench, Q4_K, uniform and skewed routing): with 16-32 tokens per
    // expert tiles of 32 beat 64 by 5-10% (more blocks in flight), from 64 per expert 128 is best.
    if per_expert < 48 {
        32
    } else {
        128
    }
}

/// `y = x·Wᵀ` for `n` tokens: `xq` the tokens' activations quantized ([`super::ops::quantize_q8_1`] over
/// `[n, W.cols]`), `y` `[n, W.rows]`.
pub fn matmul_q(
    dev: &Device,
    w: &DeviceMatrix,
    xq: &DeviceBuffer<BlockQ8_1>,
    y: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    let per_token = w.cols / BlockQ8_1::ELEMS;
    if per_token == 0 || !xq.len().is_multiple_of(per_token) {
        return invalid(format!("matmul x: {} blocks", xq.len()));
    }
    let n = xq.len() / per_token;
    check_len("matmul y", y, n * w.rows)?;
    if matmul_path(dev, w.ty, w.cols, n) == MatmulPath::Mma {
        return mma::matmul(dev, w, xq, n, y);
    }
    matmul_q_dp4a(dev, w, xq, y)
}

/// [`matmul_q`] on the tensor cores with tiles of `tile` tokens (16, 32, 64 or 128), for formats and rows
/// [`has_mma`] accepts: to test and measure each tile size.
pub fn matmul_q_mma(
    dev: &Device,
    w: &DeviceMatrix,
    xq: &DeviceBuffer<BlockQ8_1>,
    tile: usize,
    y: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    if !mma::takes(dev, w.ty, w.cols) {
        return invalid(format!("no tensor-core matmul for {} × {}", w.ty, w.cols));
    }
    let per_token = w.cols / BlockQ8_1::ELEMS;
    if per_token == 0 || !xq.len().is_multiple_of(per_token) {
        return invalid(format!("matmul x: {} blocks", xq.len()));
    }
    let n = xq.len() / per_token;
    check_len("matmul y", y, n * w.rows)?;
    mma::matmul_tiled(dev, w, xq, n, tile, y)
}

/// Whether the tensor-core kernels take rows of `cols` values of `ty` on `dev`.
pub fn has_mma(dev: &Device, ty: GgmlType, cols: usize) -> bool {
    mma::takes(dev, ty, cols)
}

/// [`matmul_q`] on the CUDA cores (dp4a over tiles of [`MATMUL_TILE`] tokens), whatever the format: the
/// fallback for formats without a tensor-core kernel, and the reference the tests compare it with.
pub fn matmul_q_dp4a(
    dev: &Device,
    w: &DeviceMatrix,
    xq: &DeviceBuffer<BlockQ8_1>,
    y: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    let (module, name) = matmul_kernel(w.ty, false)?;
    let per_token = w.cols / BlockQ8_1::ELEMS;
    if per_token == 0 || !xq.len().is_multiple_of(per_token) {
        return invalid(format!("matmul x: {} blocks", xq.len()));
    }
    let n = xq.len() / per_token;
    check_len("matmul y", y, n * w.rows)?;
    let (mut cfg, wpr) = q_matvec_config(w.ty, w.rows, w.cols, 1);
    let tiles = n.div_ceil(MATMUL_TILE);
    if tiles > 65535 {
        return invalid(format!("matmul: {n} tokens in one call"));
    }
    cfg.grid_dim.1 = tiles as u32;
    let (ncols, nrows, n_i) = (
        as_i32("cols", w.cols)?,
        as_i32("rows", w.rows)?,
        as_i32("tokens", n)?,
    );
    let f = dev.function(module, name)?;
    let mut b = dev.launch_builder(&f);
    b.arg(w.data().slice())
        .arg(xq.slice())
        .arg(y.slice_mut())
        .arg(&ncols)
        .arg(&nrows)
        .arg(&n_i)
        .arg(&wpr);
    // SAFETY: the matrix holds rows × cols of its format (checked at upload); x holds n × cols/32 blocks
    // and y n × rows floats (checked above); tile t reads and writes tokens 8t .. 8t+7 below n only.
    unsafe { b.launch(cfg) }?;
    dev.after_launch(name)
}

/// `y = x·Wᵀ` for `n` tokens and a float matrix (F32, F16 or BF16), the first expert of `table` (the engine
/// keeps float matrices as one-expert tables): `x` `[n, cols]`, `y` `[n, rows]`. Tiles of 64 rows × 64
/// tokens (`matmul_f_*` in `matvec_f.cu`), each weight read once per tile instead of once per token.
pub fn matmul_f(
    dev: &Device,
    table: &ExpertTable,
    x: &DeviceBuffer<f32>,
    y: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    let name = match table.ty {
        GgmlType::F32 => "matmul_f_f32",
        GgmlType::F16 => "matmul_f_f16",
        GgmlType::BF16 => "matmul_f_bf16",
        ty => return invalid(format!("no float matmul kernel for {ty}")),
    };
    if table.n_expert == 0 || table.cols == 0 || !x.len().is_multiple_of(table.cols) {
        return invalid(format!("matmul_f: x of {} values", x.len()));
    }
    let n = x.len() / table.cols;
    check_len("matmul_f y", y, n * table.rows)?;
    if n == 0 {
        return Ok(());
    }
    let token_tiles = n.div_ceil(64);
    if token_tiles > 65535 {
        return invalid(format!("matmul_f: {n} tokens in one call"));
    }
    let (ncols, nrows, n_i) = (
        as_i32("cols", table.cols)?,
        as_i32("rows", table.rows)?,
        as_i32("tokens", n)?,
    );
    let cfg = LaunchConfig {
        grid_dim: (table.rows.div_ceil(64) as u32, token_tiles as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let f = dev.function(KernelModule::MatvecF, name)?;
    let mut b = dev.launch_builder(&f);
    b.arg(table.table_address())
        .arg(x.slice())
        .arg(y.slice_mut())
        .arg(&ncols)
        .arg(&nrows)
        .arg(&n_i);
    // SAFETY: the table's first address is a rows × cols matrix of its float type (StackedExperts checks
    // the shape at upload); x holds n × cols and y n × rows floats (checked above); block (i, j) reads rows
    // 64i.. and tokens 64j.. below those bounds only.
    unsafe { b.launch(cfg) }?;
    dev.after_launch(name)
}

/// A prompt's (token, expert) pairs sorted by expert: `rows[r]` is the token of sorted row `r`,
/// `slot_row[t·k + j]` the sorted row of token `t`'s `j`-th choice, `tiles` the `(expert, first row, rows)`
/// runs of at most `tile` rows, one expert each (the launch's table).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertGrouping {
    pub rows: Vec<i32>,
    pub slot_row: Vec<i32>,
    pub tiles: Vec<[i32; 3]>,
}

impl ExpertGrouping {
    /// Groups the router's choices `ids` (`[n_tokens, k]`, expert ids below `n_expert`; others are left
    /// out: their rows stay zero, as computed elsewhere) into tiles of [`MATMUL_TILE`] rows (the dp4a
    /// kernels' tile).
    pub fn new(ids: &[i32], k: usize, n_expert: usize) -> Self {
        Self::with_tile(ids, k, n_expert, MATMUL_TILE)
    }

    /// As [`ExpertGrouping::new`] with tiles of at most `tile` rows (what [`expert_tile_rows`] says the
    /// kernel of a format takes).
    pub fn with_tile(ids: &[i32], k: usize, n_expert: usize, tile: usize) -> Self {
        let order = stable_order_by_id(ids, n_expert);
        let mut rows = Vec::with_capacity(ids.len());
        let mut slot_row = vec![0i32; ids.len()];
        let mut tiles: Vec<[i32; 3]> = Vec::new();
        for (r, &s) in order.iter().enumerate() {
            rows.push((s / k.max(1)) as i32);
            slot_row[s] = r as i32;
            let e = ids[s];
            let extend =
                matches!(tiles.last(), Some(&[te, _, n]) if te == e && (n as usize) < tile);
            if extend {
                if let Some(t) = tiles.last_mut() {
                    t[2] += 1;
                }
            } else if e >= 0 && (e as usize) < n_expert {
                tiles.push([e, r as i32, 1]);
            }
        }
        ExpertGrouping {
            rows,
            slot_row,
            tiles,
        }
    }

    /// The most tiles a grouping of `slots` choices among `n_expert` experts can have with tiles of `tile`
    /// rows: each expert's run ends in at most one partial tile.
    pub fn max_tiles(slots: usize, n_expert: usize, tile: usize) -> usize {
        slots.div_ceil(tile.max(1)) + n_expert.min(slots)
    }

    /// The tile table as the kernels read it (`[n_tiles·3]`), padded to `n_tiles` entries with empty tiles
    /// (`(-1, 0, 0)`: no expert, no rows), so a caller can keep buffers of one length per shape.
    pub fn tile_table(&self, n_tiles: usize) -> Vec<i32> {
        let mut t: Vec<i32> = self.tiles.iter().flatten().copied().collect();
        t.resize(3 * n_tiles.max(self.tiles.len()), 0);
        for e in t.chunks_mut(3).skip(self.tiles.len()) {
            e[0] = -1;
        }
        t
    }
}

/// The slots of `ids` ordered by id, each id's slots in their order (a stable sort): a counting sort over
/// the ids below `n_expert` (linear: a prompt call groups tens of thousands of slots per layer while the
/// card waits), the others (which get no tile) after them in a stable comparison sort.
fn stable_order_by_id(ids: &[i32], n_expert: usize) -> Vec<usize> {
    let in_range = |e: i32| e >= 0 && (e as usize) < n_expert;
    let mut start = vec![0usize; n_expert + 1];
    let mut others: Vec<usize> = Vec::new();
    for (s, &e) in ids.iter().enumerate() {
        if in_range(e) {
            start[e as usize + 1] += 1;
        } else {
            others.push(s);
        }
    }
    for e in 0..n_expert {
        start[e + 1] += start[e];
    }
    let mut order = vec![0usize; ids.len()];
    for (s, &e) in ids.iter().enumerate() {
        if in_range(e) {
            let at = &mut start[e as usize];
            order[*at] = s;
            *at += 1;
        }
    }
    // Ids outside the experts: sorted among themselves, as a full sort would (negative ones first would
    // change nothing the kernels see: they get no tile and their rows are not read).
    others.sort_by_key(|&s| ids[s]);
    let placed = ids.len() - others.len();
    order[placed..].copy_from_slice(&others);
    order
}

/// Most experts [`group_by_expert`] takes (`GROUP_MAX_EXPERTS`).
pub const GROUP_MAX_EXPERTS: usize = 1024;

/// Whether `--moe-group host` asked for the grouping on the host ([`ExpertGrouping`] after a download
/// of the ids: a wait per MoE layer) instead of [`group_by_expert`], to measure the two.
pub fn host_grouping() -> bool {
    crate::options::get().gpu.moe_group_host
}

/// [`ExpertGrouping::with_tile`] on the card (`group_by_expert` in `matmul_mma.cu`), so the host need not
/// wait for the router: `ids` `[slots]` (`[n, k]`), `rows` and `slot_row` `[slots]`, `tiles` the padded
/// tile table of at least [`ExpertGrouping::max_tiles`] entries (`[n_tiles·3]`). The same tiles as the
/// host's; an expert's rows may come in another order (each output row depends on its own token only).
pub fn group_by_expert(
    dev: &Device,
    ids: &DeviceBuffer<i32>,
    (k, n_expert, tile): (usize, usize, usize),
    rows: &mut DeviceBuffer<i32>,
    slot_row: &mut DeviceBuffer<i32>,
    tiles: &mut DeviceBuffer<i32>,
) -> CudaResult<()> {
    let slots = ids.len();
    if k == 0 || tile == 0 || n_expert == 0 || n_expert > GROUP_MAX_EXPERTS {
        return invalid(format!(
            "group_by_expert: k {k}, tile {tile}, {n_expert} experts"
        ));
    }
    if !slots.is_multiple_of(k) || !tiles.len().is_multiple_of(3) {
        return invalid(format!(
            "group_by_expert: {slots} ids for k {k}, {} tile ints",
            tiles.len()
        ));
    }
    check_len("group_by_expert rows", rows, slots)?;
    check_len("group_by_expert slot_row", slot_row, slots)?;
    let max_tiles = tiles.len() / 3;
    if max_tiles < ExpertGrouping::max_tiles(slots, n_expert, tile) {
        return invalid(format!(
            "group_by_expert: room for {max_tiles} tiles of {tile} for {slots} slots"
        ));
    }
    if slots == 0 {
        return Ok(());
    }
    let ints = [
        as_i32("slots", slots)?,
        as_i32("k", k)?,
        as_i32("experts", n_expert)?,
        as_i32("tile", tile)?,
        as_i32("tiles", max_tiles)?,
    ];
    let f = dev.function(KernelModule::MatmulMma, "group_by_expert")?;
    let mut b = dev.launch_builder(&f);
    b.arg(ids.slice());
    for i in &ints {
        b.arg(i);
    }
    b.arg(rows.slice_mut())
        .arg(slot_row.slice_mut())
        .arg(tiles.slice_mut());
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: ids, rows and slot_row hold `slots` ints, tiles max_tiles·3 (checked above, max_tiles at
    // least the tiles any ids can make); the kernel writes rows below slots and tiles below max_tiles only.
    unsafe { b.launch(cfg) }?;
    dev.after_launch("group_by_expert")
}

/// `y[r] = W_{e}·x[r]` for every sorted row `r` of every tile `(e, r0, n)` of `tiles` (`[n_tiles·3]` i32 in
/// device memory, as [`ExpertGrouping::tile_table`]; `n` at most `tile_rows`, which must be what
/// [`expert_tile_rows`] gave for this table's format): `xq` `[n_sorted, cols/32]` blocks, `y` `[n_sorted,
/// rows]`. Rows no tile covers are not written.
pub fn matmul_experts_q(
    dev: &Device,
    table: &ExpertTable,
    tiles: &DeviceBuffer<i32>,
    tile_rows: usize,
    xq: &DeviceBuffer<BlockQ8_1>,
    y: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    if experts_path(dev, table, tile_rows)? == MatmulPath::Mma {
        return mma::matmul_experts(dev, table, tiles, tile_rows, xq, y);
    }
    let (module, name) = matmul_kernel(table.ty, true)?;
    let per_row = table.cols / BlockQ8_1::ELEMS;
    if per_row == 0 || !xq.len().is_multiple_of(per_row) || !tiles.len().is_multiple_of(3) {
        return invalid(format!(
            "matmul_experts: {} blocks, {} tile ints",
            xq.len(),
            tiles.len()
        ));
    }
    let n_sorted = xq.len() / per_row;
    check_len("matmul_experts y", y, n_sorted * table.rows)?;
    let n_tiles = tiles.len() / 3;
    if n_tiles == 0 {
        return Ok(());
    }
    if n_tiles > 65535 {
        return invalid(format!("matmul_experts: {n_tiles} tiles in one call"));
    }
    let (mut cfg, wpr) = q_matvec_config(table.ty, table.rows, table.cols, 1);
    cfg.grid_dim.1 = n_tiles as u32;
    let (ncols, nrows, n_exp) = (
        as_i32("cols", table.cols)?,
        as_i32("rows", table.rows)?,
        as_i32("experts", table.n_expert)?,
    );
    let f = dev.function(module, name)?;
    let mut b = dev.launch_builder(&f);
    b.arg(table.table_address())
        .arg(&n_exp)
        .arg(tiles.slice())
        .arg(xq.slice())
        .arg(y.slice_mut())
        .arg(&ncols)
        .arg(&nrows)
        .arg(&wpr);
    // SAFETY: the table holds n_expert addresses of rows × cols matrices (or null); the tiles are read on
    // the card, so the kernel must trust them: the caller builds them with ExpertGrouping over n_sorted
    // rows (first row + count within n_sorted), which is what `tiles` documents. x and y are checked above.
    unsafe { b.launch(cfg) }?;
    dev.after_launch(name)
}

/// [`matmul_experts_q`] for two expert tables over the same tiles and `xq` (a MoE's gate and up): one
/// launch on the tensor cores when both have the same format and shape, else one call each.
pub fn matmul_experts_q_pair(
    dev: &Device,
    tables: [&ExpertTable; 2],
    tiles: &DeviceBuffer<i32>,
    tile_rows: usize,
    xq: &DeviceBuffer<BlockQ8_1>,
    ys: [&mut DeviceBuffer<f32>; 2],
) -> CudaResult<()> {
    let [ta, tb] = tables;
    if experts_pair_path(dev, tables, tile_rows)? == MatmulPath::MmaPair {
        return mma::matmul_experts_pair(dev, tables, tiles, tile_rows, xq, ys);
    }
    let [ya, yb] = ys;
    matmul_experts_q(dev, ta, tiles, tile_rows, xq, ya)?;
    matmul_experts_q(dev, tb, tiles, tile_rows, xq, yb)
}

/// `dst[r] = src[rows[r]]` for rows of `width` values (activations into expert order).
pub fn gather_rows(
    dev: &Device,
    src: &DeviceBuffer<f32>,
    rows: &DeviceBuffer<i32>,
    width: usize,
    dst: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    check_len("gather_rows dst", dst, rows.len() * width)?;
    if width == 0 || !src.len().is_multiple_of(width) {
        return invalid(format!("gather_rows: src of {} values", src.len()));
    }
    if rows.is_empty() {
        return Ok(());
    }
    let w_i = as_i32("width", width)?;
    let f = dev.function(KernelModule::Route, "gather_rows")?;
    let mut b = dev.launch_builder(&f);
    b.arg(src.slice())
        .arg(rows.slice())
        .arg(dst.slice_mut())
        .arg(&w_i);
    let cfg = LaunchConfig {
        grid_dim: (rows.len() as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: dst holds rows × width floats (checked); the row ids are read on the card and must be
    // below src.len()/width, which ExpertGrouping guarantees for the tokens it was built from.
    unsafe { b.launch(cfg) }?;
    dev.after_launch("gather_rows")
}

/// `dst[r] = src[rows[r]]` for rows of `blocks` q8_1 blocks (a prompt's quantized tokens into expert
/// order: the same blocks as [`gather_rows`] then quantizing, with a quarter of the bytes moved).
pub fn gather_rows_q8_1(
    dev: &Device,
    src: &DeviceBuffer<BlockQ8_1>,
    rows: &DeviceBuffer<i32>,
    blocks: usize,
    dst: &mut DeviceBuffer<BlockQ8_1>,
) -> CudaResult<()> {
    check_len("gather_rows_q8_1 dst", dst, rows.len() * blocks)?;
    if blocks == 0 || !src.len().is_multiple_of(blocks) {
        return invalid(format!("gather_rows_q8_1: src of {} blocks", src.len()));
    }
    if rows.is_empty() {
        return Ok(());
    }
    if rows.len() > i32::MAX as usize {
        return invalid(format!("gather_rows_q8_1: {} rows", rows.len()));
    }
    let words = as_i32("words", blocks * std::mem::size_of::<BlockQ8_1>() / 4)?;
    let f = dev.function(KernelModule::MatmulMma, "gather_rows_words")?;
    let mut b = dev.launch_builder(&f);
    b.arg(src.slice())
        .arg(rows.slice())
        .arg(dst.slice_mut())
        .arg(&words);
    let cfg = LaunchConfig {
        grid_dim: (rows.len() as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: a block is 36 bytes (9 words, 4-aligned), so a row is `words` words; dst holds rows × blocks
    // blocks (checked); the row ids are read on the card and must be below src.len()/blocks, which the
    // grouping guarantees for the tokens it was built from.
    unsafe { b.launch(cfg) }?;
    dev.after_launch("gather_rows_words")
}

/// `out[t] (+)= Σ_j weights[t, j] · y_sorted[slot_row[t·k + j]]`: the weighted sum of each token's `k`
/// expert outputs from expert order (`y_sorted` `[n_sorted, width]`, `out` `[n_tokens, width]`).
pub fn moe_combine_sorted(
    dev: &Device,
    y_sorted: &DeviceBuffer<f32>,
    slot_row: &DeviceBuffer<i32>,
    weights: &DeviceBuffer<f32>,
    k: usize,
    accumulate: bool,
    out: &mut DeviceBuffer<f32>,
) -> CudaResult<()> {
    if k == 0 || !weights.len().is_multiple_of(k) || weights.is_empty() {
        return invalid(format!(
            "moe_combine_sorted: {} weights, k {k}",
            weights.len()
        ));
    }
    check_len("moe_combine_sorted slot_row", slot_row, weights.len())?;
    let n_tokens = weights.len() / k;
    if !out.len().is_multiple_of(n_tokens) {
        return invalid(format!("moe_combine_sorted: out of {}", out.len()));
    }
    let width = out.len() / n_tokens;
    check_len("moe_combine_sorted y", y_sorted, weights.len() * width)?;
    let (k_i, w_i, add) = (as_i32("k", k)?, as_i32("width", width)?, accumulate as i32);
    let f = dev.function(KernelModule::Route, "moe_combine_sorted")?;
    let mut b = dev.launch_builder(&f);
    b.arg(y_sorted.slice())
        .arg(slot_row.slice())
        .arg(weights.slice())
        .arg(out.slice_mut())
        .arg(&k_i)
        .arg(&w_i)
        .arg(&add);
    let cfg = LaunchConfig {
        grid_dim: (n_tokens as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: y_sorted holds n_tokens·k rows of width (checked), slot_row values are below n_tokens·k as
    // ExpertGrouping builds them; out holds n_tokens × width.
    unsafe { b.launch(cfg) }?;
    dev.after_launch("moe_combine_sorted")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_matmul_kernel_has_an_entry_point() {
        for &ty in crate::quant::WEIGHT_TYPES {
            for experts in [false, true] {
                if let Ok((module, name)) = matmul_kernel(ty, experts) {
                    // The entry points are made by MATVEC_ENTRY_POINTS(suffix, ..) from matmul_##name.
                    let suffix = name
                        .trim_start_matches("matmul_")
                        .trim_start_matches("experts_");
                    let src = module.source();
                    assert!(
                        src.contains(&format!("MATVEC_ENTRY_POINTS({suffix},")),
                        "{name}"
                    );
                    assert!(src.contains("matmul_experts_##name("));
                }
            }
        }
    }

    #[test]
    fn grouping_sorts_by_expert_and_tiles_each_run() {
        // 3 tokens, k = 2.
        let ids = [2, 0, 0, 2, 2, 1];
        let g = ExpertGrouping::new(&ids, 2, 3);
        assert_eq!(g.rows, vec![0, 1, 2, 0, 1, 2]);
        assert_eq!(g.tiles, vec![[0, 0, 2], [1, 2, 1], [2, 3, 3]]);
        for (s, &r) in g.slot_row.iter().enumerate() {
            assert_eq!(g.rows[r as usize] as usize, s / 2);
        }
        let many = vec![5i32; 20];
        let g = ExpertGrouping::new(&many, 1, 8);
        assert_eq!(g.tiles, vec![[5, 0, 8], [5, 8, 8], [5, 16, 4]]);
        // An id outside the experts gets no tile.
        assert!(ExpertGrouping::new(&[9, 9], 1, 8).tiles.is_empty());
    }

    #[test]
    fn the_counting_sort_is_the_stable_sort() {
        let mut rng = crate::rng::Rng::new(7);
        for (n_expert, slots) in [(128usize, 4096usize), (8, 37), (1, 5)] {
            let mut ids: Vec<i32> = (0..slots)
                .map(|_| rng.below(n_expert as u32) as i32)
                .collect();
            let mut want: Vec<usize> = (0..slots).collect();
            want.sort_by_key(|&s| ids[s]);
            assert_eq!(stable_order_by_id(&ids, n_expert), want);
            // Ids past the experts go last, in order among themselves.
            ids[0] = n_expert as i32 + 1;
            ids[slots - 1] = n_expert as i32;
            let order = stable_order_by_id(&ids, n_expert);
            assert_eq!(&order[slots - 2..], &[slots - 1, 0]);
            let mut seen = order.clone();
            seen.sort_unstable();
            assert_eq!(seen, (0..slots).collect::<Vec<_>>());
        }
    }
}
