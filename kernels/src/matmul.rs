//! Matrix×vector and matrix×matrix products over many threads, for any weight format with
//! [`QuantOps`](crate::quant::QuantOps).
//!
//! A weight matrix is `rows` rows of `cols` values in one format, row-major as GGUF stores it (a GGUF
//! tensor of dims `[cols, rows]`). Activations are quantized once per call to the format's activation type
//! and every dot product reads them from there, as llama.cpp does. Work is split over the rayon pool the
//! call runs in (`ThreadPool::install` chooses the thread count) by ranges of weight rows, so every thread
//! streams its own part of the weights once.

use crate::quant::kquants::{Dot8, Rows4};
use crate::quant::legacy::{TILE_ACTS, TILE_ROWS};
use crate::quant::{BatchDot, Dot4, GgmlType, QuantError, QuantOps};
use rayon::prelude::*;

/// A borrowed weight matrix: `rows` rows of `cols` values of type `ty`.
#[derive(Clone, Copy, Debug)]
pub struct QuantMatrix<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl<'a> QuantMatrix<'a> {
    /// Checks that `data` holds exactly `rows` rows of `cols` values of `ty`, and that `ty` can compute.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self, QuantError> {
        ty.ops().ok_or_else(|| {
            QuantError(format!("tensor type {ty} is not supported for computation"))
        })?;
        let row_bytes = ty.bytes_for(cols as u64).ok_or_else(|| {
            QuantError(format!("{ty}: a row of {cols} values is not whole blocks"))
        })?;
        if (rows as u64).checked_mul(row_bytes) != Some(data.len() as u64) {
            return Err(QuantError(format!(
                "{ty}: {} bytes are not {rows} rows of {cols} values",
                data.len()
            )));
        }
        Ok(QuantMatrix {
            ty,
            rows,
            cols,
            data,
        })
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.data.len() / self.rows.max(1)
    }

    fn ops(&self) -> &'static QuantOps {
        self.ty.ops().expect("checked in QuantMatrix::new")
    }

    /// Row `r`'s bytes.
    #[inline]
    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }
}

/// Weight rows per task: enough work per task to hide scheduling, few enough tasks to balance threads.
fn rows_per_task(rows: usize, row_bytes: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    // At least 16 KiB of weights per task, and about 8 tasks per thread.
    let min_rows = (16 * 1024 / row_bytes.max(1)).max(1);
    // A multiple of four, for the kernels that take four weight rows at once.
    (rows / (threads * 8))
        .max(min_rows)
        .next_multiple_of(4)
        .min(rows.max(1))
}

/// `y = W·x` for one activation vector: `x` has `cols` values, `y` gets `rows`.
pub fn matvec(w: &QuantMatrix<'_>, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), w.cols, "matvec: x has the wrong length");
    assert_eq!(y.len(), w.rows, "matvec: y has the wrong length");
    let ops = w.ops();
    let mut act = vec![0u8; ops.act.bytes_for(w.cols)];
    ops.act.quantize(x, &mut act);
    matvec_quantized(w, &act, y);
}

/// `y = W·x` with `x` already quantized to the format's activation type.
pub fn matvec_quantized(w: &QuantMatrix<'_>, act: &[u8], y: &mut [f32]) {
    let ops = w.ops();
    let rows4 = single_row_rows4(w.ty);
    let chunk = rows_per_task(w.rows, w.row_bytes());
    y.par_chunks_mut(chunk).enumerate().for_each(|(c, ys)| {
        let first = c * chunk;
        let mut i = 0;
        if let Some(rows4) = rows4 {
            while i + 4 <= ys.len() {
                let r = first + i;
                let v = rows4(
                    w.cols,
                    [w.row(r), w.row(r + 1), w.row(r + 2), w.row(r + 3)],
                    act,
                );
                ys[i..i + 4].copy_from_slice(&v);
                i += 4;
            }
        }
        for (k, out) in ys.iter_mut().enumerate().skip(i) {
            *out = (ops.vec_dot)(w.cols, w.row(first + k), act);
        }
    });
}

/// One product of [`matvec_many`]: `y = W·x` for one activation row `act`, already quantized to the
/// format's activation type, each dot product in the order `order` takes for a call of one row (the
/// single-row order, [`QuantOps::vec_dot`], where it is `None` or does not apply to one row).
pub struct MatvecJob<'a, 'y> {
    pub w: QuantMatrix<'a>,
    pub order: Option<&'static BatchDot>,
    pub act: &'a [u8],
    pub y: &'y mut [f32],
}

/// Several matrix×vector products in one parallel region (a decode step's expert products): every
/// job's rows are cut into ranges and all ranges of all jobs share rayon's pool, so the threads meet once
/// for the lot instead of once per product. Each dot product is the one [`matmul_ordered`] computes for
/// the same row in a call of one activation row. (A partly resident model's CPU share takes the same
/// ranges and [`RowDots`] as one job of a hot pool instead: `engine/src/cpu/expert_job.rs`.)
pub fn matvec_many<'a>(jobs: &mut [MatvecJob<'a, '_>]) {
    struct Part<'a> {
        w: QuantMatrix<'a>,
        act: &'a [u8],
        dots: RowDots,
        y: SharedOut,
        rows: std::ops::Range<usize>,
    }
    let threads = rayon::current_num_threads().max(1);
    let total_bytes: usize = jobs.iter().map(|j| j.w.data.len()).sum();
    let part_bytes = part_bytes(total_bytes, threads);
    let mut parts: Vec<Part<'a>> = Vec::new();
    for job in jobs.iter_mut() {
        let w = job.w;
        assert_eq!(
            job.act.len(),
            w.ops().act.bytes_for(w.cols),
            "matvec_many: act length"
        );
        assert_eq!(job.y.len(), w.rows, "matvec_many: y has the wrong length");
        let dots = RowDots::new(&w, job.order);
        for rows in row_ranges(&w, part_bytes) {
            parts.push(Part {
                w,
                act: job.act,
                dots,
                y: SharedOut(job.y.as_mut_ptr()),
                rows,
            });
        }
    }
    let run_part = |p: &Part<'_>| {
        // SAFETY: `rows` lies inside this job's `y` (`row_ranges` of its `w.rows`, checked against
        // `y.len()` above), which outlives the parallel loop; each part alone writes its own rows.
        let y = unsafe { std::slice::from_raw_parts_mut(p.y.0.add(p.rows.start), p.rows.len()) };
        p.dots.rows(&p.w, p.act, p.rows.clone(), y);
    };
    parts.par_iter().for_each(run_part);
}

/// Bytes of weights per range when `total_bytes` of matrix×vector products are split over `threads`:
/// about four ranges per thread, at least 16 KiB each.
pub fn part_bytes(total_bytes: usize, threads: usize) -> usize {
    (total_bytes / (threads.max(1) * 4)).max(16 * 1024)
}

/// `w`'s rows cut into ranges of about `part_bytes` of weights (a multiple of four rows, for the kernels
/// that take four at once).
pub fn row_ranges(
    w: &QuantMatrix<'_>,
    part_bytes: usize,
) -> impl Iterator<Item = std::ops::Range<usize>> {
    let rows = w.rows;
    let chunk = (part_bytes / w.row_bytes().max(1))
        .max(1)
        .next_multiple_of(4)
        .min(rows.max(1));
    (0..rows)
        .step_by(chunk)
        .map(move |first| first..(first + chunk).min(rows))
}

/// The arithmetic of one matrix×vector product, chosen once: `order`'s dot product where it applies to
/// a call of one row, else the format's single-row order ([`QuantOps::vec_dot`]) and its four-row kernel.
/// Any range of rows can be computed apart from the others, with the same results.
#[derive(Clone, Copy)]
pub struct RowDots {
    dot: fn(usize, &[u8], &[u8]) -> f32,
    rows4: Option<Rows4>,
}

impl RowDots {
    pub fn new(w: &QuantMatrix<'_>, order: Option<&'static BatchDot>) -> RowDots {
        match order {
            Some(b) if (b.applies)(1, 0) => RowDots {
                dot: b.dot,
                rows4: None,
            },
            _ => RowDots {
                dot: w.ops().vec_dot,
                rows4: single_row_rows4(w.ty),
            },
        }
    }

    /// `y[i] = w.row(rows.start + i) · act` for the rows of `rows`.
    pub fn rows(
        &self,
        w: &QuantMatrix<'_>,
        act: &[u8],
        rows: std::ops::Range<usize>,
        y: &mut [f32],
    ) {
        assert_eq!(y.len(), rows.len(), "RowDots::rows: y has the wrong length");
        assert!(rows.end <= w.rows, "RowDots::rows: rows past the matrix");
        let first = rows.start;
        let mut i = 0;
        if let Some(rows4) = self.rows4 {
            while i + 4 <= y.len() {
                let r = first + i;
                let v = rows4(
                    w.cols,
                    [w.row(r), w.row(r + 1), w.row(r + 2), w.row(r + 3)],
                    act,
                );
                y[i..i + 4].copy_from_slice(&v);
                i += 4;
            }
        }
        for (k, out) in y.iter_mut().enumerate().skip(i) {
            *out = (self.dot)(w.cols, w.row(first + k), act);
        }
    }
}

/// `Y = X·Wᵀ` for `n` activation vectors: `x` is `n × cols` (row-major), `y` gets `n × rows`.
///
/// Every weight row is read once from memory and used for all `n` vectors while it is in cache. Each dot
/// product takes the order llama.cpp's CPU backend uses for its row of the batch
/// ([`crate::quant::batch_dot`]).
pub fn matmul(w: &QuantMatrix<'_>, x: &[f32], n: usize, y: &mut [f32]) {
    matmul_ordered(w, x, n, y, crate::quant::batch_dot(w.ty));
}

/// The kernel taking four activation rows at once in the single-row order ([`QuantOps::vec_dot`]) of
/// `ty`, where there is one.
fn single_row_dot4(ty: GgmlType) -> Option<Dot4> {
    crate::quant::legacy::dot4(ty).or_else(|| crate::quant::kquants::single_row_dot4(ty))
}

/// The kernel taking four weight rows at once against one activation row in the single-row order of
/// `ty`, where there is one.
fn single_row_rows4(ty: GgmlType) -> Option<Rows4> {
    crate::quant::kquants::single_row_rows4(ty)
}

/// [`matmul`] with the order chosen by the caller: `batch`'s ([`BatchDot::dot`]) for the rows of the batch
/// it [applies](BatchDot::applies) to, the format's single-row order ([`QuantOps::vec_dot`]) for the others
/// (every row when `batch` is `None`). Results do not depend on threads or tiling.
pub fn matmul_ordered(
    w: &QuantMatrix<'_>,
    x: &[f32],
    n: usize,
    y: &mut [f32],
    batch: Option<&'static BatchDot>,
) {
    assert_eq!(x.len(), n * w.cols, "matmul: x has the wrong length");
    assert_eq!(y.len(), n * w.rows, "matmul: y has the wrong length");
    // tinyBLAS's float orders: register tiles of weight rows by activation rows (the same sums).
    if let Some(weights) = crate::quant::float_tiles::for_matmul(w, batch, n) {
        crate::quant::float_tiles::gemm(weights, w.rows, w.cols, x, n, y);
        return;
    }
    let ops = w.ops();
    let act_bytes = ops.act.bytes_for(w.cols);
    let mut act_buf = KeptBuffer::take(&ACT_BUFFER, n * act_bytes);
    let act = act_buf.get();
    act.par_chunks_mut(act_bytes)
        .zip(x.par_chunks(w.cols))
        .for_each(|(a, xs)| ops.act.quantize(xs, a));
    let act = &*act;

    // Four activation rows per weight row at once where all four take one order that has such a kernel:
    // the batch order's four-row kernel, or the single-row order's.
    let single4 = single_row_dot4(w.ty);
    let rows4 = single_row_rows4(w.ty);
    let tile = crate::quant::legacy::tile(w.ty);
    // Which activation rows take the batch order, looked up once (the loops below ask per kernel call).
    let batch_rows: Vec<bool> = (0..n)
        .map(|j| batch.is_some_and(|b| (b.applies)(n, j)))
        .collect();
    let applies = |j: usize| batch_rows[j];
    let group4 = |j: usize| -> Option<Dot4> {
        if (j..j + 4).all(applies) {
            batch.and_then(|b| b.dot4)
        } else if !(j..j + 4).any(applies) {
            single4
        } else {
            None
        }
    };
    // Eight activation rows at once where all eight take one order that has such a kernel.
    let (batch8, single8) = (
        batch.and_then(|b| crate::quant::kquants::dot8(w.ty, Some(b))),
        crate::quant::kquants::dot8(w.ty, None),
    );
    let group8 = |j: usize| -> Option<Dot8> {
        if (j..j + 8).all(applies) {
            batch8
        } else if !(j..j + 8).any(applies) {
            single8
        } else {
            None
        }
    };
    let dot_of = |j: usize| match batch {
        Some(b) if applies(j) => b.dot,
        _ => ops.vec_dot,
    };

    // Sixteen weight rows at a time where the tile kernel exists for the order of every activation row
    // (the K-quants' batch orders, Q4_K's single-row one) and there are enough rows to repay unpacking.
    let tile_single = crate::quant::kquants::ktile(w.ty, None);
    let tile_batch = batch.and_then(|b| crate::quant::kquants::ktile(w.ty, Some(b)));
    let tile_of = |j: usize| if applies(j) { tile_batch } else { tile_single };
    if (0..n).all(|j| tile_of(j).is_some_and(|kt| n >= kt.min_tokens())) {
        let (batch_rows, single_rows): (Vec<usize>, Vec<usize>) = (0..n).partition(|&j| applies(j));
        let groups: Vec<_> = [(tile_batch, batch_rows), (tile_single, single_rows)]
            .into_iter()
            .filter_map(|(kt, js)| Some((kt?, js)).filter(|(_, js)| !js.is_empty()))
            .collect();
        matmul_tiles(w, &groups, act, act_bytes, y);
        return;
    }

    // Tasks own ranges of weight rows; each writes its columns of y, so tasks write disjoint elements.
    // Eight-row kernels (Q4_K on AVX2) take a task's rows in groups of eight, laid out once per task
    // for all its tokens, when there are enough tokens to repay the copy.
    let rows8 = crate::quant::kquants::rows8(w.ty) && n >= ROWS8_MIN_TOKENS;
    let mut chunk = rows_per_task(w.rows, w.row_bytes()).min(64);
    if rows8 {
        chunk = chunk.next_multiple_of(8);
    }
    let n_tasks = w.rows.div_ceil(chunk);
    let out = SharedOut(y.as_mut_ptr());
    (0..n_tasks).into_par_iter().for_each(|t| {
        let out = &out;
        let first = t * chunk;
        let last = (first + chunk).min(w.rows);
        let groups = if rows8 { (last - first) / 8 } else { 0 };
        let group_bytes = crate::quant::kquants::rows8_bytes(w.cols);
        let mut packed = KeptBuffer::take(&PACK_BUFFER, groups * group_bytes);
        let packed = packed.get();
        for (g, out) in packed.chunks_exact_mut(group_bytes.max(1)).enumerate() {
            let r = first + 8 * g;
            crate::quant::kquants::Rows8::pack(w.cols, std::array::from_fn(|i| w.row(r + i)), out);
        }
        let packed = &*packed;
        // Tokens in groups so the group's activations and the task's weight rows stay in cache together.
        for tokens in (0..n).step_by(16) {
            let tokens_end = (tokens + 16).min(n);
            let put = |j: usize, r: usize, v: f32| {
                // SAFETY: `j < n` and `r < w.rows`, so `j * w.rows + r` is inside `y` (length
                // `n * w.rows`, asserted above); task `t` alone writes the rows `first..last`, so no
                // two threads write the same element, and `y` outlives the parallel loop.
                unsafe { *out.0.add(j * w.rows + r) = v };
            };
            let act_row = |j: usize| &act[j * act_bytes..(j + 1) * act_bytes];
            for g in 0..groups {
                let rows = crate::quant::kquants::Rows8::new(
                    w.cols,
                    &packed[g * group_bytes..(g + 1) * group_bytes],
                );
                let mut j = tokens;
                while j < tokens_end {
                    // Two activation rows at once where both take one order.
                    if j + 2 <= tokens_end && applies(j) == applies(j + 1) {
                        let v = rows.dot(applies(j), [act_row(j), act_row(j + 1)]);
                        for (t, v) in v.iter().enumerate() {
                            for (i, &v) in v.iter().enumerate() {
                                put(j + t, first + 8 * g + i, v);
                            }
                        }
                        j += 2;
                    } else {
                        let [v] = rows.dot(applies(j), [act_row(j)]);
                        for (i, &v) in v.iter().enumerate() {
                            put(j, first + 8 * g + i, v);
                        }
                        j += 1;
                    }
                }
            }
            // Weight rows four at a time where a four-row kernel exists (for the activation rows in
            // the single-row order), else one at a time.
            let mut r = first + 8 * groups;
            while r < last {
                // Legacy formats: tiles of two weight rows by four activation rows.
                if let Some(tile) = tile.filter(|_| r + TILE_ROWS <= last) {
                    let rows: [&[u8]; TILE_ROWS] = std::array::from_fn(|i| w.row(r + i));
                    let mut j = tokens;
                    while j < tokens_end {
                        if j + TILE_ACTS <= tokens_end && !(j..j + TILE_ACTS).any(applies) {
                            let v = tile(w.cols, rows, std::array::from_fn(|t| act_row(j + t)));
                            for (i, &v) in v.iter().enumerate() {
                                put(j + i % TILE_ACTS, r + i / TILE_ACTS, v);
                            }
                            j += TILE_ACTS;
                        } else {
                            for (i, row) in rows.iter().enumerate() {
                                put(j, r + i, dot_of(j)(w.cols, row, act_row(j)));
                            }
                            j += 1;
                        }
                    }
                    r += TILE_ROWS;
                    continue;
                }
                let quad = rows4.filter(|_| r + 4 <= last);
                let span = if quad.is_some() { 4 } else { 1 };
                let mut j = tokens;
                while j < tokens_end {
                    // Eight (else four) activation rows at once where the order allows (16 is a
                    // multiple of 8, so groups never straddle the token blocks).
                    if j + 8 <= tokens_end {
                        if let Some(dot8) = group8(j) {
                            for r in r..r + span {
                                let acts: [&[u8]; 8] = std::array::from_fn(|k| act_row(j + k));
                                let v = dot8(w.cols, w.row(r), acts);
                                for (k, &v) in v.iter().enumerate() {
                                    put(j + k, r, v);
                                }
                            }
                            j += 8;
                            continue;
                        }
                    }
                    if j + 4 <= tokens_end {
                        if let Some(dot4) = group4(j) {
                            for r in r..r + span {
                                let v = dot4(
                                    w.cols,
                                    w.row(r),
                                    [act_row(j), act_row(j + 1), act_row(j + 2), act_row(j + 3)],
                                );
                                for (k, &v) in v.iter().enumerate() {
                                    put(j + k, r, v);
                                }
                            }
                            j += 4;
                            continue;
                        }
                    }
                    match quad {
                        Some(rows4) if !applies(j) => {
                            let v = rows4(
                                w.cols,
                                [w.row(r), w.row(r + 1), w.row(r + 2), w.row(r + 3)],
                                act_row(j),
                            );
                            for (k, &v) in v.iter().enumerate() {
                                put(j, r + k, v);
                            }
                        }
                        _ => {
                            for r in r..r + span {
                                put(j, r, dot_of(j)(w.cols, w.row(r), act_row(j)));
                            }
                        }
                    }
                    j += 1;
                }
                r += span;
            }
        }
    });
}

/// [`matmul_ordered`] with tile kernels: `groups` pairs a kernel with the activation rows (indices into
/// `act`, `act_bytes` each) that take its order. Tasks own ranges of weight rows (multiples of 16),
/// unpack them sixteen at a time once and run every activation row against them, 64 at a time (so their
/// blocks stay in cache with the tile).
fn matmul_tiles(
    w: &QuantMatrix<'_>,
    groups: &[(crate::quant::kquants::KTile, Vec<usize>)],
    act: &[u8],
    act_bytes: usize,
    y: &mut [f32],
) {
    use crate::quant::kquants::{KTile, Tiles, TILE_ROWS};
    const TOKENS: usize = KTile::MAX_ACTS;
    let chunk = rows_per_task(w.rows, w.row_bytes())
        .min(64)
        .next_multiple_of(TILE_ROWS);
    let n_tasks = w.rows.div_ceil(chunk);
    let out = SharedOut(y.as_mut_ptr());
    // A task's unpacked tiles and results are made once per rayon job, not per task: their allocation
    // and zeroing were a tenth of a 64-token product (perf), as were the per-block vectors of row and
    // activation slices, now arrays.
    let scratch = || (Tiles::default(), [[0f32; TILE_ROWS]; TOKENS]);
    (0..n_tasks)
        .into_par_iter()
        .for_each_init(scratch, |(tiles, res), t| {
            let out = &out;
            let first = t * chunk;
            let last = (first + chunk).min(w.rows);
            for r0 in (first..last).step_by(TILE_ROWS) {
                let n_rows = (last - r0).min(TILE_ROWS);
                let rows: [&[u8]; TILE_ROWS] =
                    std::array::from_fn(|i| w.row(r0 + i.min(n_rows - 1)));
                let rows = &rows[..n_rows];
                // The orders share the unpacking (it depends on the format only).
                groups[0].0.unpack(w.cols, rows, tiles);
                for (kt, js) in groups {
                    for block in js.chunks(TOKENS) {
                        let acts: [&[u8]; TOKENS] = std::array::from_fn(|i| {
                            let j = block[i.min(block.len() - 1)];
                            &act[j * act_bytes..(j + 1) * act_bytes]
                        });
                        let res = &mut res[..block.len()];
                        kt.dot(tiles, &acts[..block.len()], res);
                        for (&j, v) in block.iter().zip(res.iter()) {
                            // One slice copy per activation row (element by element, the stores were a
                            // tenth of a 64-token product: `out.0` was read again for each).
                            // SAFETY: `j < n` and `r0 + rows.len() <= last <= w.rows`, so the elements are
                            // inside `y` (length `n * w.rows`, asserted by the caller); task `t` alone
                            // writes rows `first..last`, so no other thread touches them while the slice
                            // lives, and `y` outlives the parallel loop.
                            let dst = unsafe {
                                std::slice::from_raw_parts_mut(
                                    out.0.add(j * w.rows + r0),
                                    rows.len(),
                                )
                            };
                            dst.copy_from_slice(&v[..rows.len()]);
                        }
                    }
                }
            }
        });
}

/// A thread's scratch buffer kept between calls in a thread-local slot: a prompt's products each need
/// up to a few MB (quantized activations, laid-out weight rows), which a fresh allocation zeroes (or
/// faults in page by page) only for the caller to overwrite every byte. Taken out of the slot for the call
/// and put back after, so a product started on the same thread meanwhile (rayon runs other tasks while
/// one waits) gets a buffer of its own. At most [`KEEP_BYTES`] stay with a thread.
struct KeptBuffer {
    buf: Vec<u8>,
    len: usize,
    slot: &'static std::thread::LocalKey<std::cell::Cell<Vec<u8>>>,
}

thread_local! {
    /// [`matmul_ordered`]'s quantized activations.
    static ACT_BUFFER: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
    /// A [`matmul_ordered`] task's laid-out weight rows ([`crate::quant::kquants::Rows8`]).
    static PACK_BUFFER: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

impl KeptBuffer {
    fn take(
        slot: &'static std::thread::LocalKey<std::cell::Cell<Vec<u8>>>,
        len: usize,
    ) -> KeptBuffer {
        let mut buf = slot.take();
        if buf.len() < len {
            buf.resize(len, 0);
        }
        KeptBuffer { buf, len, slot }
    }

    /// The first `len` bytes (stale contents: the caller overwrites them all).
    fn get(&mut self) -> &mut [u8] {
        &mut self.buf[..self.len]
    }
}

/// The largest buffer a thread keeps (a long prompt's larger one is freed after its call).
const KEEP_BYTES: usize = 16 << 20;

impl Drop for KeptBuffer {
    fn drop(&mut self) {
        if self.buf.len() <= KEEP_BYTES {
            self.slot.set(std::mem::take(&mut self.buf));
        }
    }
}

/// Fewest tokens for which [`matmul_ordered`] lays out a task's rows for the eight-row kernels.
const ROWS8_MIN_TOKENS: usize = 16;

/// The output pointer shared by the tasks of [`matmul`], which write disjoint elements.
struct SharedOut(*mut f32);
// SAFETY: the tasks holding it write disjoint elements of one live buffer (see `matmul`).
unsafe impl Sync for SharedOut {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize, fill_random};
    use crate::rng::Rng;

    fn matrix(ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
        let mut data = vec![0u8; rows * ty.bytes_for(cols as u64).unwrap() as usize];
        fill_random(ty, &mut Rng::new(3), 0.1, &mut data).unwrap();
        data
    }

    #[test]
    fn matvec_and_matmul_agree_with_row_dot_products() {
        let (rows, cols, n) = (37, 512, 5);
        let ty = GgmlType::F32;
        let data = matrix(ty, rows, cols);
        let w = QuantMatrix::new(ty, rows, cols, &data).unwrap();
        let mut wf = vec![0f32; rows * cols];
        dequantize(ty, &data, &mut wf).unwrap();
        let mut rng = Rng::new(4);
        let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
        let mut y = vec![0f32; n * rows];
        matmul(&w, &x, n, &mut y);
        for j in 0..n {
            let mut yv = vec![0f32; rows];
            matvec(&w, &x[j * cols..(j + 1) * cols], &mut yv);
            for r in 0..rows {
                let exact: f64 = (0..cols)
                    .map(|k| wf[r * cols + k] as f64 * x[j * cols + k] as f64)
                    .sum();
                assert!((yv[r] as f64 - exact).abs() < 1e-3, "matvec row {r}");
                assert_eq!(y[j * rows + r], yv[r], "matmul token {j} row {r}");
            }
        }
    }

    #[test]
    fn legacy_matmul_equals_the_single_row_dot_bit_for_bit() {
        // Batches of these formats go four activation rows at a time through `legacy::dot4`, which
        // must give `vec_dot`'s result exactly (llama.cpp sums their batches in the single-row order).
        let (rows, cols, n) = (9, 800, 7);
        let mut rng = Rng::new(5);
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
        ] {
            let data = matrix(ty, rows, cols);
            let w = QuantMatrix::new(ty, rows, cols, &data).unwrap();
            let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
            let mut y = vec![0f32; n * rows];
            matmul(&w, &x, n, &mut y);
            assert_equals_vec_dot(&w, &x, n, &y, &ty.to_string());
        }
    }

    /// Every output of `y = x·Wᵀ` (`n` tokens) equals `vec_dot` (and its portable form) bit for bit.
    fn assert_equals_vec_dot(w: &QuantMatrix, x: &[f32], n: usize, y: &[f32], what: &str) {
        let (rows, cols) = (w.rows, w.cols);
        let ops = w.ty.ops().unwrap();
        for j in 0..n {
            let mut act = vec![0u8; ops.act.bytes_for(cols)];
            ops.act.quantize(&x[j * cols..(j + 1) * cols], &mut act);
            for r in 0..rows {
                let want = (ops.vec_dot)(cols, w.row(r), &act);
                let portable = (ops.vec_dot_portable)(cols, w.row(r), &act);
                assert_eq!(
                    y[j * rows + r].to_bits(),
                    want.to_bits(),
                    "{what} token {j} row {r}"
                );
                assert_eq!(
                    want.to_bits(),
                    portable.to_bits(),
                    "{what} token {j} row {r}"
                );
            }
        }
    }

    #[test]
    fn single_row_order_for_a_batch_equals_vec_dot_bit_for_bit() {
        // `matmul_ordered` without a batch order takes four activation rows at once through the
        // single-row kernels (`kquants::single_row_dot4`), which must equal `vec_dot` exactly.
        let (rows, cols, n) = (5, 768, 9);
        let mut rng = Rng::new(6);
        let ty = GgmlType::Q4_K;
        let data = matrix(ty, rows, cols);
        let w = QuantMatrix::new(ty, rows, cols, &data).unwrap();
        let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
        let mut y = vec![0f32; n * rows];
        matmul_ordered(&w, &x, n, &mut y, None);
        assert_equals_vec_dot(&w, &x, n, &y, "Q4_K");
    }

    #[test]
    fn eight_row_q4k_kernels_equal_both_orders_bit_for_bit() {
        // Q4_K batches of `ROWS8_MIN_TOKENS` or more tokens go eight weight rows at a time through a
        // laid-out copy (`kquants::Rows8`, on AVX2 machines without AVX-512 VNNI; elsewhere this checks
        // the other kernels): every output must equal its order's dot product exactly. 21 rows: two
        // groups of eight and a remainder; 19 tokens: four groups of four in the gemm order, three in
        // the single-row order (pairs and a single); then every token in the single-row order.
        let (rows, cols, n) = (21, 768, 19);
        assert!(n >= ROWS8_MIN_TOKENS);
        let mut rng = Rng::new(8);
        let ty = GgmlType::Q4_K;
        let data = matrix(ty, rows, cols);
        let w = QuantMatrix::new(ty, rows, cols, &data).unwrap();
        let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
        let ops = ty.ops().unwrap();
        let batch = crate::quant::batch_dot(ty).unwrap();
        for order in [Some(batch), None] {
            let mut y = vec![f32::NAN; n * rows];
            matmul_ordered(&w, &x, n, &mut y, order);
            for j in 0..n {
                let mut act = vec![0u8; ops.act.bytes_for(cols)];
                ops.act.quantize(&x[j * cols..(j + 1) * cols], &mut act);
                let gemm = order.is_some_and(|b| (b.applies)(n, j));
                for r in 0..rows {
                    let want = if gemm {
                        crate::quant::kquants::q4k_vec_dot_gemm4_portable(cols, w.row(r), &act)
                    } else {
                        (ops.vec_dot_portable)(cols, w.row(r), &act)
                    };
                    assert_eq!(
                        y[j * rows + r].to_bits(),
                        want.to_bits(),
                        "gemm order {gemm}, token {j} row {r}"
                    );
                }
            }
        }
    }

    #[test]
    fn four_weight_row_kernel_equals_vec_dot_bit_for_bit() {
        // `matvec` (and `matmul_ordered` for rows in the single-row order) take Q4_K weight rows four at
        // a time through `kquants::single_row_rows4`, which must equal `vec_dot` exactly; 11 rows: two
        // groups of four and a remainder, 3 activation rows: none through the four-activation kernel.
        let (rows, cols, n) = (11, 1024, 3);
        let mut rng = Rng::new(7);
        let ty = GgmlType::Q4_K;
        let data = matrix(ty, rows, cols);
        let w = QuantMatrix::new(ty, rows, cols, &data).unwrap();
        let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
        let mut y = vec![0f32; n * rows];
        matmul_ordered(&w, &x, n, &mut y, None);
        let ops = ty.ops().unwrap();
        for j in 0..n {
            let xj = &x[j * cols..(j + 1) * cols];
            let mut one = vec![0f32; rows];
            matvec(&w, xj, &mut one);
            let mut act = vec![0u8; ops.act.bytes_for(cols)];
            ops.act.quantize(xj, &mut act);
            for r in 0..rows {
                let want = (ops.vec_dot_portable)(cols, w.row(r), &act);
                assert_eq!(one[r].to_bits(), want.to_bits(), "matvec token {j} row {r}");
                assert_eq!(
                    y[j * rows + r].to_bits(),
                    want.to_bits(),
                    "token {j} row {r}"
                );
            }
        }
    }

    #[test]
    fn matrix_shape_is_checked() {
        let data = vec![0u8; 144];
        assert!(QuantMatrix::new(GgmlType::Q4_K, 1, 256, &data).is_ok());
        assert!(QuantMatrix::new(GgmlType::Q4_K, 2, 256, &data).is_err());
        assert!(QuantMatrix::new(GgmlType::Q4_K, 1, 100, &data).is_err());
        assert!(QuantMatrix::new(GgmlType::I32, 1, 36, &data).is_err());
    }

    #[test]
    fn batch_order_matches_matmul_and_single_row_order_matches_matvec() {
        let (ty, rows, cols, n) = (GgmlType::Q4_K, 24, 512, 9);
        let mut rng = Rng::new(5);
        let mut data = vec![0u8; rows * ty.bytes_for(cols as u64).unwrap() as usize];
        fill_random(ty, &mut rng, 1.0, &mut data).unwrap();
        let w = QuantMatrix::new(ty, rows, cols, &data).unwrap();
        let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
        let (mut a, mut b) = (vec![0f32; n * rows], vec![0f32; n * rows]);
        matmul(&w, &x, n, &mut a);
        matmul_ordered(&w, &x, n, &mut b, crate::quant::batch_dot(ty));
        assert_eq!(a, b);
        matmul_ordered(&w, &x, n, &mut b, None);
        for j in 0..n {
            let mut one = vec![0f32; rows];
            crate::matmul::matvec(&w, &x[j * cols..(j + 1) * cols], &mut one);
            assert_eq!(&b[j * rows..(j + 1) * rows], &one[..], "row {j}");
        }
        // The gemm order of Q4_K differs from its gemv order on some element.
        assert_ne!(a, b);
    }
}
