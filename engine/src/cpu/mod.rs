//! The CPU backend: [`Compute`] over the memory-mapped model file with `poly-kernels`.
//!
//! - [`CpuWeights`]: the file's tensors as matrices (borrowed from the mapping, never copied) and, for
//!   the small float tensors the element-wise operations read (norm weights, conv kernels), dequantized
//!   f32 copies made on first use.
//! - [`CpuForward`]: one forward call: the batch, the sequence state it advances, and the operations.
//!   Matrix products go through `poly_kernels::matmul` (a batch of one through `matvec`); everything runs
//!   on the rayon pool the caller installs.
//! - [`moe`]: the mixture-of-experts block (routing, tokens grouped by expert, weighted sum).
//!
//! Activations ([`Mat`]) are row-major f32 `[n_tokens, width]`.
//!
//! [`Arithmetic`] chooses the summation orders: llama.cpp's (which depend on how many rows a call
//! computes and, for long decodes, on the thread count) or one order per operation for every call
//! ([`Arithmetic::BatchInvariant`]), so that any split of a prompt into calls gives the same bits.

mod dsv4;
pub(crate) mod expert_job;
pub mod moe;
pub mod profile;
mod sparse;
#[cfg(test)]
mod tests;
pub(crate) mod warm;

use std::ops::Range;
use std::sync::{Arc, OnceLock};

use rayon::prelude::*;

use poly_kernels::matmul::{matmul, matmul_ordered, matvec, QuantMatrix};
use poly_kernels::ops::{act, attention, norm, recurrent, rope, rope_multi};
use poly_kernels::quant::{dequantize, f32_tinyblas_order, unrepacked_order, BatchDot, GgmlType};
use poly_models::arch::{ModelGraph, ValueMap};
use poly_models::compute::{
    Attention, Batch, Compute, DeltaNet, DeltaNetInputs, Dsv4Attention, Dsv4AttnInputs, Dsv4Moe,
    FusedMoe, HyperConnection, KPoolIndexer, Logits, Moe, Rope, RopeKind, TailRope, Unary,
    WeightId,
};
use poly_models::gguf::{GgufFile, TensorInfo};
use poly_models::vision::ImageRows;

use crate::state::{KvPrecision, LayerState, RecurrentState, SeqState};

/// A row-major `[rows, cols]` f32 activation.
#[derive(Clone, Debug, PartialEq)]
pub struct Mat {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Mat {
    /// A matrix of zeros.
    pub fn zeros(rows: usize, cols: usize) -> Mat {
        Mat {
            rows,
            cols,
            data: vec![0.0; rows * cols],
        }
    }

    /// `data` as `rows` rows.
    pub fn from_vec(rows: usize, cols: usize, data: Vec<f32>) -> Mat {
        assert_eq!(data.len(), rows * cols, "Mat: data is not rows × cols");
        Mat { rows, cols, data }
    }

    /// Row `r`.
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// Row `r`, to write.
    pub fn row_mut(&mut self, r: usize) -> &mut [f32] {
        &mut self.data[r * self.cols..(r + 1) * self.cols]
    }

    fn map(&self, f: impl Fn(f32) -> f32 + Sync) -> Mat {
        let mut out = Mat::zeros(self.rows, self.cols);
        par_zip(&self.data, &mut out.data, self.cols, |x, o| {
            o.iter_mut().zip(x).for_each(|(o, &v)| *o = f(v))
        });
        out
    }
}

/// Elements below which element-wise work stays on the calling thread (a decode step's rows): splitting
/// costs more than it saves.
const PAR_MIN_ELEMENTS: usize = 1 << 15;

/// Rows of `cols` per parallel task for `len` elements: whole rows, about four tasks per thread; `None`
/// when the work is too small to split.
fn par_rows(len: usize, cols: usize) -> Option<usize> {
    if len < PAR_MIN_ELEMENTS || cols == 0 {
        return None;
    }
    let rows = len / cols;
    let tasks = rayon::current_num_threads().max(1) * 4;
    Some(rows.div_ceil(tasks).max(1))
}

/// `f(x_rows, out_rows)` over matching runs of whole rows of `x` and `out`, in parallel for large
/// inputs. Each element's result depends only on its own row, so the split does not change it.
fn par_zip(x: &[f32], out: &mut [f32], cols: usize, f: impl Fn(&[f32], &mut [f32]) + Sync) {
    match par_rows(out.len(), cols) {
        Some(rows) => out
            .par_chunks_mut(rows * cols)
            .zip(x.par_chunks(rows * cols))
            .for_each(|(o, x)| f(x, o)),
        None => f(x, out),
    }
}

/// `f(r, x_row, out_row)` for every row `r` of `x` (`cols` wide) and of `out` (`out_cols` wide), in
/// parallel for large outputs. Each output row depends only on its own input row.
fn par_rows_map(
    x: &[f32],
    cols: usize,
    out: &mut [f32],
    out_cols: usize,
    f: impl Fn(usize, &[f32], &mut [f32]) + Sync,
) {
    if out_cols == 0 || cols == 0 {
        return;
    }
    let min_rows = match par_rows(out.len(), out_cols) {
        Some(_) => (PAR_MIN_ELEMENTS / 4).div_ceil(out_cols),
        None => usize::MAX,
    };
    out.par_chunks_mut(out_cols)
        .zip(x.par_chunks(cols))
        .enumerate()
        .with_min_len(min_rows)
        .for_each(|(r, (o, x))| f(r, x, o));
}

/// `f(a_rows, b_rows, out_rows)` over matching runs of whole rows, as [`par_zip`].
fn par_zip2(
    a: &[f32],
    b: &[f32],
    out: &mut [f32],
    cols: usize,
    f: impl Fn(&[f32], &[f32], &mut [f32]) + Sync,
) {
    match par_rows(out.len(), cols) {
        Some(rows) => out
            .par_chunks_mut(rows * cols)
            .zip(a.par_chunks(rows * cols))
            .zip(b.par_chunks(rows * cols))
            .for_each(|((o, a), b)| f(a, b, o)),
        None => f(a, b, out),
    }
}

/// `f(x)`.
pub fn apply_unary(f: Unary, x: f32) -> f32 {
    match f {
        Unary::Silu => act::silu(x),
        Unary::Gelu => act::gelu_ggml_tabled(x),
        Unary::Sigmoid => act::sigmoid(x),
        Unary::Softplus => act::softplus(x),
        Unary::Tanh => x.tanh(),
        Unary::Exp => x.exp(),
    }
}

/// Which summation orders the CPU backend uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Arithmetic {
    /// llama.cpp's CPU orders (AVX2 build), bit for bit: a matrix product sums in one order for one
    /// activation row and in others for batches (Q4_K's repacked gemm, the tiled K-quant matmul,
    /// tinyBLAS), attention takes a tiled path from 64 queries and splits long decodes over the threads.
    /// A prompt read in other splits, or a conversation resumed from a kept state, can then differ in the
    /// last bits, and 4-bit models amplify that to a few hundredths in probability.
    #[default]
    LlamaCpp,
    /// Every row's arithmetic independent of the call's row count and of the thread count: matrix
    /// products in the order llama.cpp uses for one row, attention on the vector path over all positions
    /// in order (no tiles, no split), everything else per row already. Any split of a prompt gives the
    /// same logits and states bit for bit, and decoding (one row per call) is llama.cpp's own arithmetic
    /// up to 512 cached positions.
    BatchInvariant,
}

/// The tensors of a model file, for the CPU.
pub struct CpuWeights {
    file: Arc<GgufFile>,
    /// Dequantized copies of the tensors element-wise operations read, made on first use.
    f32_copies: Vec<OnceLock<Vec<f32>>>,
    /// The tensors whose stored values map to the forward pass's ([`ModelGraph::value_maps`]), by
    /// tensor index.
    value_maps: Vec<Option<ValueMap>>,
}

impl CpuWeights {
    /// The tensors of `file`. Their types and shapes are trusted: the architecture checked them when it
    /// bound them ([`poly_models::arch::bind_tensors`]).
    pub fn new(file: Arc<GgufFile>) -> CpuWeights {
        let n = file.n_tensors();
        CpuWeights {
            file,
            f32_copies: (0..n).map(|_| OnceLock::new()).collect(),
            value_maps: vec![None; n],
        }
    }

    /// The tensors of `file` as `graph` reads them: [`CpuWeights::f32`] applies the graph's value maps
    /// (Clover's `ssm_a`, stored as `A_log`), so every backend reads the mapped values.
    pub fn for_graph(file: Arc<GgufFile>, graph: &ModelGraph) -> CpuWeights {
        let mut w = CpuWeights::new(file);
        for (id, map) in graph.value_maps() {
            if let Some(slot) = w.value_maps.get_mut(id.0 as usize) {
                *slot = Some(map);
            }
        }
        w
    }

    /// The file.
    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    /// The file, shared (for users that must keep its mapping alive, e.g. the card's copies from it).
    pub fn shared_file(&self) -> &Arc<GgufFile> {
        &self.file
    }

    /// The tensor's name, type and shape.
    pub fn info(&self, w: WeightId) -> &TensorInfo {
        &self.file.tensor_infos()[w.0 as usize]
    }

    /// The tensor's bytes, borrowed from the mapping.
    pub fn bytes(&self, w: WeightId) -> &[u8] {
        let info = self.info(w);
        let part = self
            .file
            .part_bytes(info.part)
            .expect("a tensor's part file is mapped");
        // The parser checked every tensor against its part's length.
        &part[info.offset as usize..(info.offset + info.n_bytes) as usize]
    }

    /// The tensor as a matrix of `ne0`-long rows (every further dimension counts rows).
    pub fn matrix(&self, w: WeightId) -> QuantMatrix<'_> {
        let info = self.info(w);
        QuantMatrix::new(
            info.ty,
            info.n_rows() as usize,
            info.row_len() as usize,
            self.bytes(w),
        )
        .expect("bound tensors are computable matrices")
    }

    /// Matrix `e` of a 3-D tensor `[ne0, ne1, n]`: its rows `e·ne1 .. (e+1)·ne1`.
    pub fn sub_matrix(&self, w: WeightId, e: usize) -> QuantMatrix<'_> {
        let info = self.info(w);
        let rows = info.dims.get(1).copied().unwrap_or(1) as usize;
        let full = self.matrix(w);
        let rb = full.row_bytes();
        QuantMatrix::new(
            full.ty,
            rows,
            full.cols,
            &full.data[e * rows * rb..(e + 1) * rows * rb],
        )
        .expect("an expert is whole rows of its tensor")
    }

    /// The whole tensor as f32 (dequantized once, then kept).
    pub fn f32(&self, w: WeightId) -> &[f32] {
        self.f32_copies[w.0 as usize].get_or_init(|| {
            let info = self.info(w);
            let mut out = vec![0f32; info.n_elements() as usize];
            dequantize(info.ty, self.bytes(w), &mut out).expect("bound tensors dequantize");
            if let Some(map) = self.value_maps[w.0 as usize] {
                map.apply(&mut out);
            }
            out
        })
    }

    /// Row `r` of the tensor, dequantized into `out`.
    pub fn row_into(&self, w: WeightId, r: usize, out: &mut [f32]) {
        let m = self.matrix(w);
        dequantize(m.ty, m.row(r), out).expect("bound tensors dequantize");
    }
}

/// Whether llama.cpp's CPU backend (AVX2 build) moves a weight of type `ty` with `rows` rows (its `ne[1]`)
/// into its `CPU_REPACK` buffer (`ggml_repack_get_optimal_repack_type`), which changes the order its
/// products sum in.
pub fn llama_repacks(ty: GgmlType, rows: usize) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0 | GgmlType::Q4_K | GgmlType::IQ4_NL | GgmlType::MXFP4
    ) && rows.is_multiple_of(8)
}

/// `Y = X·Wᵀ` on the pool the caller runs in, in llama.cpp's orders.
pub fn mat_mul(m: &QuantMatrix<'_>, x: &Mat) -> Mat {
    mat_mul_with(m, x, Arithmetic::LlamaCpp)
}

/// The order a product of `rows` activation rows takes where it is not the one `matmul` picks from the
/// format alone: `Some(order)` for `matmul_ordered` (`Some(None)`: the single-row order), `None` for
/// `matmul`/`matvec`.
fn llama_order(m: &QuantMatrix<'_>, rows: usize) -> Option<Option<&'static BatchDot>> {
    // F32 matrices take llamafile's tinyBLAS for batches of two rows or more when their row count is a
    // multiple of 4 (MoE routers), ggml_vec_dot_f32 otherwise (qwen35moe's one-row shared-expert gate);
    // Q4_K matrices llama.cpp does not repack (a row count that is not a multiple of 8, e.g. qwen35moe's
    // ssm_alpha / ssm_beta) take their own orders.
    match m.ty {
        GgmlType::F32 if rows >= 2 && m.rows.is_multiple_of(4) => Some(Some(f32_tinyblas_order())),
        GgmlType::F32 => Some(None),
        ty if !llama_repacks(ty, m.rows) => unrepacked_order(ty, rows).map(Some),
        _ => None,
    }
}

/// `Y = X·Wᵀ` on the pool the caller runs in, in the orders `arith` chooses. Batch-invariant: every
/// row in llama.cpp's order for a call of one row (`matmul_ordered` computes each dot product whole,
/// so neither the row count nor the thread count changes a sum).
pub fn mat_mul_with(m: &QuantMatrix<'_>, x: &Mat, arith: Arithmetic) -> Mat {
    assert_eq!(
        x.cols, m.cols,
        "matmul: activation width differs from the weight's rows"
    );
    let mut y = Mat::zeros(x.rows, m.rows);
    if x.rows == 0 {
        return y;
    }
    if arith == Arithmetic::BatchInvariant {
        let order = llama_order(m, 1).flatten();
        matmul_ordered(m, &x.data, x.rows, &mut y.data, order);
        break_on_purpose(m, x, &mut y);
        return y;
    }
    let order = llama_order(m, x.rows);
    match x.rows {
        n if order.is_some() => matmul_ordered(m, &x.data, n, &mut y.data, order.flatten()),
        1 => matvec(m, &x.data, &mut y.data),
        n => matmul(m, &x.data, n, &mut y.data),
    }
    break_on_purpose(m, x, &mut y);
    y
}

/// `POLY_BREAK_BATCHES=1`, for diagnosis only: products of more than one activation row (a prompt's)
/// lose their first output, a deliberately broken kernel that `polystrata verify`, whose reference reads
/// prompts one token at a time, must catch (its test sets it).
fn break_on_purpose(m: &QuantMatrix<'_>, x: &Mat, y: &mut Mat) {
    static BROKEN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let broken =
        *BROKEN.get_or_init(|| std::env::var("POLY_BREAK_BATCHES").is_ok_and(|v| v == "1"));
    if broken && x.rows > 1 && m.rows > 0 {
        y.data.chunks_mut(m.rows).for_each(|row| row[0] = 0.0);
    }
}

/// The chunk of positions of llama.cpp's split-KV decode (one query over at least 512 cache cells: each of
/// its `threads` threads sums one chunk, the partial results are merged), or `None` when it does not
/// split. llama.cpp looks at the cells in use rounded up to 256 (`llama_kv_cache::get_n_kv`), here
/// `n_kv` positions.
fn split_kv_chunk(n_kv: usize, threads: usize) -> Option<usize> {
    let padded = n_kv.div_ceil(256).max(1) * 256;
    (padded >= 512).then(|| padded.div_ceil(threads.max(1)))
}

/// One forward call on the CPU: a batch of tokens advancing one sequence's state, or several sequences'
/// states at once ([`CpuForward::many`]: each its own rows, the weights read once for all).
pub struct CpuForward<'a> {
    weights: &'a CpuWeights,
    /// The states the call advances, each with the rows of `tokens` it reads.
    seqs: Vec<(&'a mut SeqState, Range<usize>)>,
    tokens: &'a [u32],
    logits: Logits,
    /// Each row's cell in its state's cache (its attention sees the cells up to it); also its RoPE
    /// position unless `rope_positions` says otherwise.
    positions: Vec<u32>,
    /// Each row's four multi-section RoPE positions, where they are not its cell: a call with a
    /// picture's rows, or one after a picture was read.
    rope_positions: Option<Vec<[u32; 4]>>,
    /// The rows of the call that a picture's rows replace the token embeddings of, and those rows.
    given_rows: Option<(Range<usize>, &'a [f32])>,
    arithmetic: Arithmetic,
    /// Where the call counts its routings, when someone measures them.
    routes: Option<&'a moe::RouteCounts>,
    /// Routers that replace the file's for this call (a calibration).
    routers: Option<&'a mut dyn RouterSource>,
}

/// Routers a forward call uses instead of the file's: `poly-engine synth` calibrates each MoE layer's
/// router on the hidden states that reach it, layer after layer within one call.
pub trait RouterSource {
    /// The f32 rows (`n_expert × n_embd`) to route MoE layer `layer`'s input `x` with (the file's router
    /// is `router`), or `None` for the file's.
    fn router(&mut self, layer: usize, router: &TensorInfo, x: &Mat) -> Option<Vec<f32>>;
}

impl<'a> CpuForward<'a> {
    /// A call reading `tokens` at the state's next positions. The caller checks that the tokens are in
    /// the vocabulary and fit in the context, and records them in the state afterwards.
    pub fn new(
        weights: &'a CpuWeights,
        state: &'a mut SeqState,
        tokens: &'a [u32],
        logits: Logits,
    ) -> CpuForward<'a> {
        let pos0 = state.n_past() as u32;
        let rope_positions = text_rope_positions(state, tokens.len());
        CpuForward {
            weights,
            seqs: vec![(state, 0..tokens.len())],
            tokens,
            logits,
            positions: (0..tokens.len() as u32).map(|i| pos0 + i).collect(),
            rope_positions,
            given_rows: None,
            arithmetic: Arithmetic::default(),
            routes: None,
            routers: None,
        }
    }

    /// A call reading `tokens` into several states: state `i` reads the next `counts[i]` of them at its
    /// next positions, and every row's logits are returned. Matrix products and experts see all rows
    /// together (one read of the weights); attention reads each state's own cache, and a recurrent
    /// layer runs each state's recurrence over its own rows. The caller checks the tokens as for
    /// [`CpuForward::new`] and records them in each state afterwards.
    pub fn many(
        weights: &'a CpuWeights,
        states: Vec<&'a mut SeqState>,
        counts: &[usize],
        tokens: &'a [u32],
    ) -> CpuForward<'a> {
        assert_eq!(states.len(), counts.len(), "one row count per state");
        assert_eq!(
            counts.iter().sum::<usize>(),
            tokens.len(),
            "rows and tokens"
        );
        let mut positions = Vec::with_capacity(tokens.len());
        let mut seqs = Vec::with_capacity(states.len());
        let any_pictures = states.iter().any(|s| s.has_pictures());
        let mut rope_positions = Vec::new();
        for (state, &n) in states.into_iter().zip(counts) {
            let pos0 = state.n_past() as u32;
            let start = positions.len();
            positions.extend((0..n as u32).map(|i| pos0 + i));
            if any_pictures {
                let cells = state.n_past()..state.n_past() + n;
                rope_positions.extend(cells.map(|c| state.text_rope_position(c)));
            }
            seqs.push((state, start..positions.len()));
        }
        CpuForward {
            weights,
            seqs,
            tokens,
            logits: Logits::All,
            positions,
            rope_positions: any_pictures.then_some(rope_positions),
            given_rows: None,
            arithmetic: Arithmetic::default(),
            routes: None,
            routers: None,
        }
    }

    /// The same call with `picture`'s rows in place of the token embeddings of the rows from `at` on
    /// (they replace its placeholder tokens), at the multi-section RoPE positions `rope_positions` (one
    /// for each row of the call) when given, else at their cells as text (a model that reads pictures
    /// in line). The caller checks that they fit.
    pub fn with_given_rows(
        mut self,
        at: usize,
        picture: &'a ImageRows,
        rope_positions: Option<Vec<[u32; 4]>>,
    ) -> CpuForward<'a> {
        if let Some(p) = &rope_positions {
            assert_eq!(p.len(), self.tokens.len(), "one position a row");
        }
        self.given_rows = Some((at..at + picture.n_rows(), &picture.values));
        if rope_positions.is_some() {
            self.rope_positions = rope_positions;
        }
        self
    }

    /// The first and last cells of the picture read in the call (its given rows), if any.
    fn picture_cells(&self) -> Option<(u32, u32)> {
        let (rows, _) = self.given_rows.as_ref()?;
        let last = rows.end.checked_sub(1).filter(|&l| l >= rows.start)?;
        Some((self.positions[rows.start], self.positions[last]))
    }

    /// The same call counting its routings in `routes`.
    pub fn with_route_counts(mut self, routes: &'a moe::RouteCounts) -> CpuForward<'a> {
        self.routes = Some(routes);
        self
    }

    /// The same call routing with `routers`' rows where it gives them.
    pub fn with_routers(mut self, routers: &'a mut dyn RouterSource) -> CpuForward<'a> {
        self.routers = Some(routers);
        self
    }

    /// The same call in the orders `arithmetic` chooses.
    pub fn with_arithmetic(mut self, arithmetic: Arithmetic) -> CpuForward<'a> {
        self.arithmetic = arithmetic;
        self
    }

    /// The first state's position (the call's only one but in [`CpuForward::many`]).
    fn pos0(&self) -> u32 {
        self.seqs.first().map_or(0, |(s, _)| s.n_past() as u32)
    }

    /// Each state's recurrent state of `layer` with the call's rows it reads (`op` names the operation
    /// for the panic a layer without one deserves).
    fn recurrent_states(
        &mut self,
        layer: usize,
        op: &str,
    ) -> Vec<(&mut RecurrentState, Range<usize>)> {
        self.seqs
            .iter_mut()
            .map(|(state, rows)| {
                let LayerState::Recurrent(s) = state.layer_mut(layer) else {
                    panic!("{op} on layer {layer}, whose state is not recurrent");
                };
                (s, rows.clone())
            })
            .collect()
    }
}

/// The multi-section positions of `n` text rows read next into `state`, when a picture read before
/// moved them off their cells; `None` when they are their cells.
fn text_rope_positions(state: &SeqState, n: usize) -> Option<Vec<[u32; 4]>> {
    state.has_pictures().then(|| {
        (state.n_past()..state.n_past() + n)
            .map(|c| state.text_rope_position(c))
            .collect()
    })
}

/// `rotate(rows, their positions)` over `out`'s rows, in parallel chunks of rows when the matrix is
/// large enough ([`par_rows`]).
fn rope_by_rows<P: Sync>(out: &mut Mat, positions: &[P], rotate: impl Fn(&mut [f32], &[P]) + Sync) {
    let cols = out.cols;
    match par_rows(out.data.len(), cols) {
        Some(rows) => out
            .data
            .par_chunks_mut(rows * cols)
            .zip(positions.par_chunks(rows))
            .for_each(|(o, pos)| rotate(o, pos)),
        None => rotate(&mut out.data, positions),
    }
}

/// Rows `rows` of `x`, in place.
fn rows_of<'m>(x: &'m Mat, rows: &Range<usize>) -> &'m [f32] {
    &x.data[rows.start * x.cols..rows.end * x.cols]
}

/// Rows `rows` of `x`.
fn row_range(x: &Mat, rows: &Range<usize>) -> Mat {
    Mat {
        rows: rows.len(),
        cols: x.cols,
        data: x.data[rows.start * x.cols..rows.end * x.cols].to_vec(),
    }
}

fn same_shape(a: &Mat, b: &Mat, op: &str) {
    assert!(
        a.rows == b.rows && a.cols == b.cols,
        "{op}: shapes [{}, {}] and [{}, {}] differ",
        a.rows,
        a.cols,
        b.rows,
        b.cols
    );
}

impl Compute for CpuForward<'_> {
    type Act = Mat;

    fn shape(&self, x: &Mat) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn embed(&mut self, table: WeightId, tokens: &[u32]) -> Mat {
        let _span = profile::span("embed");
        let n_embd = self.weights.info(table).row_len() as usize;
        let mut out = Mat::zeros(tokens.len(), n_embd);
        let weights = self.weights;
        out.data
            .par_chunks_mut(n_embd.max(1))
            .zip(tokens)
            .with_min_len(16)
            .for_each(|(o, &t)| weights.row_into(table, t as usize, o));
        if let Some((rows, values)) = &self.given_rows {
            out.data[rows.start * n_embd..rows.end * n_embd].copy_from_slice(values);
        }
        out
    }

    fn matmul(&mut self, w: WeightId, x: &Mat) -> Mat {
        let m = self.weights.matrix(w);
        let op = if x.rows == 1 { "matvec" } else { "matmul" };
        let _span = profile::span(profile::typed(op, m.ty));
        mat_mul_with(&m, x, self.arithmetic)
    }

    fn rms_norm(&mut self, x: &Mat, weight: Option<WeightId>, eps: f32, group: usize) -> Mat {
        let _span = profile::span("rms_norm");
        let w = weight.map(|w| self.weights.f32(w));
        let mut out = Mat::zeros(x.rows, x.cols);
        par_zip(&x.data, &mut out.data, x.cols, |x, o| {
            norm::rms_norm(x, group, w, eps, o)
        });
        out
    }

    fn l2_norm(&mut self, x: &Mat, eps: f32, group: usize) -> Mat {
        let _span = profile::span("l2_norm");
        let mut out = Mat::zeros(x.rows, x.cols);
        norm::l2_norm(&x.data, group, eps, &mut out.data);
        out
    }

    fn add(&mut self, a: &Mat, b: &Mat) -> Mat {
        let _span = profile::span("add");
        same_shape(a, b, "add");
        let mut out = Mat::zeros(a.rows, a.cols);
        par_zip2(&a.data, &b.data, &mut out.data, a.cols, |a, b, o| {
            o.iter_mut()
                .zip(a.iter().zip(b))
                .for_each(|(o, (x, y))| *o = x + y)
        });
        out
    }

    fn mul(&mut self, a: &Mat, b: &Mat) -> Mat {
        let _span = profile::span("mul");
        if b.cols == 1 && a.cols != 1 {
            assert_eq!(a.rows, b.rows, "mul: broadcast column of the wrong height");
            let mut out = Mat::zeros(a.rows, a.cols);
            par_rows_map(&a.data, a.cols, &mut out.data, a.cols, |r, x, o| {
                let s = b.data[r];
                o.iter_mut().zip(x).for_each(|(o, &v)| *o = v * s);
            });
            return out;
        }
        same_shape(a, b, "mul");
        let mut out = Mat::zeros(a.rows, a.cols);
        par_zip2(&a.data, &b.data, &mut out.data, a.cols, |a, b, o| {
            o.iter_mut()
                .zip(a.iter().zip(b))
                .for_each(|(o, (x, y))| *o = x * y)
        });
        out
    }

    fn add_weight(&mut self, x: &Mat, w: WeightId) -> Mat {
        let _span = profile::span("add_weight");
        let w = self.weights.f32(w);
        assert_eq!(w.len(), x.cols, "add_weight: weight of the wrong width");
        let mut out = x.clone();
        for r in 0..x.rows {
            out.row_mut(r).iter_mut().zip(w).for_each(|(v, b)| *v += b);
        }
        out
    }

    fn mul_weight(&mut self, x: &Mat, w: WeightId) -> Mat {
        let _span = profile::span("mul_weight");
        let w = self.weights.f32(w);
        assert_eq!(w.len(), x.cols, "mul_weight: weight of the wrong width");
        let mut out = x.clone();
        for r in 0..x.rows {
            out.row_mut(r).iter_mut().zip(w).for_each(|(v, s)| *v *= s);
        }
        out
    }

    fn scale(&mut self, x: &Mat, s: f32) -> Mat {
        let _span = profile::span("scale");
        x.map(|v| v * s)
    }

    fn scale_token_rows(&mut self, x: &Mat, s: f32) -> Mat {
        let mut out = self.scale(x, s);
        if let Some((rows, _)) = &self.given_rows {
            let span = rows.start * x.cols..rows.end * x.cols;
            out.data[span.clone()].copy_from_slice(&x.data[span]);
        }
        out
    }

    fn unary(&mut self, x: &Mat, f: Unary) -> Mat {
        let _span = profile::span("unary");
        match f {
            // ggml's vectorized SiLU, row by row (its loop splits each row into groups of eight).
            Unary::Silu if x.cols > 0 => {
                let mut out = x.clone();
                let cols = x.cols;
                match par_rows(out.data.len(), cols) {
                    Some(rows) => out
                        .data
                        .par_chunks_mut(rows * cols)
                        .for_each(|o| act::silu_ggml_rows(o, cols)),
                    None => act::silu_ggml_rows(&mut out.data, cols),
                }
                out
            }
            // The table lookup inlined into the loop (one call per element was 2% of Gemma's prompt).
            Unary::Gelu => x.map(act::gelu_ggml_tabled),
            _ => x.map(|v| apply_unary(f, v)),
        }
    }

    fn cols(&mut self, x: &Mat, start: usize, len: usize) -> Mat {
        let _span = profile::span("cols");
        assert!(start + len <= x.cols, "cols: range past the row");
        let mut out = Mat::zeros(x.rows, len);
        par_rows_map(&x.data, x.cols, &mut out.data, len, |_, x, o| {
            o.copy_from_slice(&x[start..start + len])
        });
        out
    }

    fn head_part(&mut self, x: &Mat, head: usize, parts: usize, part: usize) -> Mat {
        let _span = profile::span("head_part");
        let group = head * parts;
        assert!(
            part < parts && head > 0 && x.cols.is_multiple_of(group),
            "head_part: row is not whole groups"
        );
        let n_heads = x.cols / group;
        let mut out = Mat::zeros(x.rows, n_heads * head);
        par_rows_map(
            &x.data,
            x.cols,
            &mut out.data,
            n_heads * head,
            |_, src, dst| {
                for h in 0..n_heads {
                    dst[h * head..(h + 1) * head]
                        .copy_from_slice(&src[h * group + part * head..][..head]);
                }
            },
        );
        out
    }

    fn repeat_heads(&mut self, x: &Mat, head: usize, times: usize, interleave: bool) -> Mat {
        let _span = profile::span("repeat_heads");
        assert!(
            head > 0 && x.cols.is_multiple_of(head),
            "repeat_heads: row is not whole heads"
        );
        let n_heads = x.cols / head;
        let width = n_heads * times * head;
        let mut out = Mat::zeros(x.rows, width);
        par_rows_map(&x.data, x.cols, &mut out.data, width, |_, src, dst| {
            for h in 0..n_heads {
                for t in 0..times {
                    let slot = if interleave {
                        h * times + t
                    } else {
                        t * n_heads + h
                    };
                    dst[slot * head..(slot + 1) * head]
                        .copy_from_slice(&src[h * head..(h + 1) * head]);
                }
            }
        });
        out
    }

    fn input(&mut self, rows: &[f32], width: usize) -> Mat {
        assert!(
            width > 0 && rows.len().is_multiple_of(width),
            "input: not whole rows of {width}"
        );
        Mat {
            rows: rows.len() / width,
            cols: width,
            data: rows.to_vec(),
        }
    }

    fn concat_cols(&mut self, a: &Mat, b: &Mat) -> Mat {
        assert_eq!(a.rows, b.rows, "concat_cols: row counts differ");
        let mut out = Mat::zeros(a.rows, a.cols + b.cols);
        for i in 0..a.rows {
            let o = out.row_mut(i);
            o[..a.cols].copy_from_slice(a.row(i));
            o[a.cols..].copy_from_slice(b.row(i));
        }
        out
    }

    fn reshape(&mut self, x: &Mat, width: usize) -> Mat {
        assert!(
            width > 0 && x.data.len().is_multiple_of(width),
            "reshape: not whole rows of {width}"
        );
        Mat {
            rows: x.data.len() / width,
            cols: width,
            data: x.data.clone(),
        }
    }

    fn keep_hidden(&mut self, x: &Mat) {
        for (state, rows) in &mut self.seqs {
            if state.keeps_hidden() {
                let pos0 = state.n_past();
                state.record_hidden(pos0, x.cols, rows_of(x, rows));
            }
        }
    }

    fn rows(&mut self, x: &Mat, rows: &[usize]) -> Mat {
        let _span = profile::span("rows");
        let mut out = Mat::zeros(rows.len(), x.cols);
        for (i, &r) in rows.iter().enumerate() {
            out.row_mut(i).copy_from_slice(x.row(r));
        }
        out
    }

    fn rope(&mut self, x: &Mat, r: &Rope) -> Mat {
        let _span = profile::span("rope");
        let p = rope::RopeParams {
            mode: match r.kind {
                RopeKind::Normal => rope::RopeMode::Normal,
                RopeKind::Neox => rope::RopeMode::Neox,
            },
            head_dim: r.head_dim,
            n_rot: r.n_rot,
            freq_base: r.freq_base,
            freq_scale: r.freq_scale,
        };
        let mut out = x.clone();
        if let Some(positions) = &self.rope_positions {
            let sections = r
                .sections
                .expect("rows with four positions reach a RoPE without sections (refused before)");
            assert!(
                r.freq_factors.is_none(),
                "multi-section RoPE with frequency factors"
            );
            rope_by_rows(&mut out, positions, |o, pos| {
                rope_multi::rope_multi(o, pos, sections, &p)
            });
            return out;
        }
        // Llama 3.1+'s rope_freqs.weight ([n_rot / 2] F32), when the model has one.
        let factors = r.freq_factors.map(|w| self.weights.f32(w));
        rope_by_rows(&mut out, &self.positions, |o, pos| {
            rope::rope_with_factors(o, pos, &p, factors)
        });
        out
    }

    fn attention(&mut self, layer: usize, q: &Mat, k: &Mat, v: &Mat, a: &Attention) -> Mat {
        let _span = profile::span("attention");
        let arithmetic = self.arithmetic;
        let together = self
            .picture_cells()
            .filter(|_| a.picture_rows_see_each_other);
        if let [(state, _)] = self.seqs.as_mut_slice() {
            let positions = (self.positions.as_slice(), together);
            return attend(state, layer, (q, k, v), a, positions, arithmetic);
        }
        // Several states: each attends over its own cache with its own rows.
        let mut out = Mat::zeros(q.rows, a.n_head * a.head_dim_v);
        for (state, rows) in &mut self.seqs {
            let qkv = (
                &row_range(q, rows),
                &row_range(k, rows),
                &row_range(v, rows),
            );
            // Several states' calls read no pictures (a picture is read in a call of one state).
            let o = attend(
                state,
                layer,
                qkv,
                a,
                (&self.positions[rows.clone()], None),
                arithmetic,
            );
            out.data[rows.start * out.cols..rows.end * out.cols].copy_from_slice(&o.data);
        }
        out
    }

    fn moe(&mut self, layer: usize, x: &Mat, m: &Moe) -> Mat {
        let _span = profile::span("moe");
        let replaced = self
            .routers
            .as_mut()
            .and_then(|r| r.router(layer, self.weights.info(m.router), x))
            .map(|rows| {
                rows.iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect::<Vec<u8>>()
            });
        let router = replaced.as_ref().map(|bytes| {
            QuantMatrix::new(GgmlType::F32, m.n_expert, x.cols, bytes)
                .expect("a replacement router is n_expert rows of the layer's width")
        });
        let routes = self.routes;
        moe::moe_observed(self.weights, x, m, self.arithmetic, router.as_ref(), |r| {
            if let Some(c) = routes {
                c.record(layer, m.n_expert, r);
            }
        })
    }

    fn fused_moe(&mut self, layer: usize, x: &Mat, router_x: &Mat, m: &FusedMoe) -> Mat {
        let _span = profile::span("moe");
        // A calibration's replacement router is fitted to what the router reads: its own input.
        let replaced = self
            .routers
            .as_mut()
            .and_then(|r| r.router(layer, self.weights.info(m.router), router_x))
            .map(|rows| {
                rows.iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect::<Vec<u8>>()
            });
        let router = replaced.as_ref().map(|bytes| {
            QuantMatrix::new(GgmlType::F32, m.n_expert, router_x.cols, bytes)
                .expect("a replacement router is n_expert rows of the layer's width")
        });
        let routes = self.routes;
        let observe = |r: &[Vec<(u32, f32)>]| {
            if let Some(c) = routes {
                c.record(layer, m.n_expert, r);
            }
        };
        moe::fused_moe_observed(
            self.weights,
            (x, router_x),
            m,
            self.arithmetic,
            router.as_ref(),
            observe,
        )
    }

    fn ssm_conv(&mut self, layer: usize, x: &Mat, kernel: WeightId) -> Mat {
        let _span = profile::span("ssm_conv");
        let info = self.weights.info(kernel);
        let taps = info.row_len() as usize;
        let w = self.weights.f32(kernel);
        let cols = x.cols;
        let mut out = Mat::zeros(x.rows, cols);
        for (s, rows) in self.recurrent_states(layer, "ssm_conv") {
            assert_eq!(
                taps, s.conv_kernel,
                "ssm_conv: kernel length differs from the state's"
            );
            let span = rows.start * cols..rows.end * cols;
            recurrent::conv1d_causal(
                &x.data[span.clone()],
                cols,
                w,
                taps,
                &mut s.conv,
                &mut out.data[span],
            );
        }
        out
    }

    fn gated_delta_net(&mut self, layer: usize, x: DeltaNetInputs<'_, Mat>, net: &DeltaNet) -> Mat {
        let _span = profile::span("gated_delta_net");
        let shape = recurrent::DeltaShape {
            n_heads: net.n_v_heads,
            head_k: net.head_k,
            head_v: net.head_v,
        };
        let out_cols = net.n_v_heads * net.head_v;
        let mut out = Mat::zeros(x.v.rows, out_cols);
        for (s, rows) in self.recurrent_states(layer, "gated_delta_net") {
            recurrent::gated_delta_rule(
                rows_of(x.q, &rows),
                rows_of(x.k, &rows),
                rows_of(x.v, &rows),
                rows_of(x.gate, &rows),
                rows_of(x.beta, &rows),
                shape,
                &mut s.delta,
                &mut out.data[rows.start * out_cols..rows.end * out_cols],
            );
        }
        out
    }

    fn layer_norm(
        &mut self,
        x: &Mat,
        weight: Option<WeightId>,
        bias: Option<WeightId>,
        eps: f32,
    ) -> Mat {
        let _span = profile::span("layer_norm");
        sparse::layer_norm(self.weights, x, (weight, bias), eps)
    }

    fn hc_pre(&mut self, streams: &Mat, mix: &Mat, hc: &HyperConnection) -> (Mat, Mat) {
        let _span = profile::span("hc_pre");
        sparse::hc_pre(self.weights, streams, mix, hc)
    }

    fn hc_post(&mut self, x: &Mat, streams: &Mat, weights: &Mat) -> Mat {
        let _span = profile::span("hc_post");
        sparse::hc_post(x, streams, weights)
    }

    fn matmul_heads(&mut self, w: WeightId, x: &Mat) -> Mat {
        let _span = profile::span("matmul_heads");
        sparse::matmul_heads(self.weights, w, x)
    }

    fn kpool_select(
        &mut self,
        layer: usize,
        q: &Mat,
        k: &Mat,
        gate: &Mat,
        w: &Mat,
        idx: &KPoolIndexer,
    ) -> Mat {
        let _span = profile::span("kpool_select");
        sparse::kpool_select(
            self.weights,
            &mut self.seqs,
            &self.positions,
            layer,
            (q, k, gate, w),
            idx,
        )
    }

    fn attention_cells(
        &mut self,
        layer: usize,
        q: &Mat,
        k: &Mat,
        v: &Mat,
        a: &Attention,
        cells: &Mat,
    ) -> Mat {
        let _span = profile::span("attention");
        sparse::attention_cells(&mut self.seqs, layer, (q, k, v), a, cells, self.arithmetic)
    }

    fn scale_bias(&mut self, x: &Mat, s: f32, b: f32) -> Mat {
        x.map(|v| v * s + b)
    }

    fn rope_tail(&mut self, x: &Mat, r: &TailRope, inverse: bool) -> Mat {
        let _span = profile::span("rope");
        dsv4::rope_tail(x, &self.positions, r, inverse)
    }

    fn matmul_groups(&mut self, w: WeightId, x: &Mat, groups: usize) -> Mat {
        let _span = profile::span("matmul_groups");
        dsv4::matmul_groups(self.weights, w, x, (groups, self.arithmetic))
    }

    fn dsv4_attention(
        &mut self,
        layer: usize,
        x: Dsv4AttnInputs<'_, Mat>,
        a: &Dsv4Attention,
    ) -> Mat {
        let _span = profile::span("attention");
        dsv4::dsv4_attention(
            self.weights,
            &mut self.seqs,
            layer,
            &x,
            (a, self.arithmetic),
        )
    }

    fn dsv4_moe(&mut self, _layer: usize, x: &Mat, m: &Dsv4Moe) -> Mat {
        let _span = profile::span("moe");
        dsv4::dsv4_moe(self.weights, x, self.tokens, m, self.arithmetic)
    }

    fn batch(&self) -> Batch<'_> {
        Batch {
            tokens: self.tokens,
            pos0: self.pos0(),
            logits: self.logits,
        }
    }
}

/// Attention of `q`'s rows over `state`'s cache of layer `layer`, after appending `k` and `v` to it; the
/// rows sit at `positions`, and those between the cells `together` (a picture's) see each other.
fn attend(
    state: &mut SeqState,
    layer: usize,
    (q, k, v): (&Mat, &Mat, &Mat),
    a: &Attention,
    (positions, together): (&[u32], Option<(u32, u32)>),
    arithmetic: Arithmetic,
) -> Mat {
    let pos0 = state.n_past();
    // A Q8_0 cache: queries, keys and values rotated as llama.cpp rotates them around a quantized
    // cache, the output rotated back.
    let rot = state.kv_rotation();
    let rotated = |x: &Mat, n: Option<usize>| {
        n.map(|n| {
            let mut r = x.clone();
            attention::hadamard_ggml(&mut r.data, n);
            r
        })
    };
    let (q_rot, k_rot, v_rot) = (rotated(q, rot.k), rotated(k, rot.k), rotated(v, rot.v));
    let (q, k, v) = (
        q_rot.as_ref().unwrap_or(q),
        k_rot.as_ref().unwrap_or(k),
        v_rot.as_ref().unwrap_or(v),
    );
    let LayerState::Kv(cache) = state.layer_mut(layer) else {
        panic!("attention on layer {layer}, whose state is not a KV cache");
    };
    assert_eq!(
        cache.len(),
        pos0,
        "attention: layer {layer}'s KV cache is not at the batch's position"
    );
    cache.append(&k.data, &v.data);
    let p = attention::AttnParams {
        n_head: a.n_head,
        n_head_kv: a.n_head_kv,
        head_dim_k: a.head_dim_k,
        head_dim_v: a.head_dim_v,
        scale: a.scale,
        window: a.window,
        softcap: a.softcap,
        sees_together: together,
    };
    let mut out = Mat::zeros(q.rows, a.n_head * a.head_dim_v);
    if cache.precision == KvPrecision::Q8_0 {
        // llama.cpp's one path over a quantized cache, for every batch (so batch-invariant too).
        attention::attention_ggml_q8_0(
            &q.data,
            positions,
            cache.keys_q8_0(),
            cache.values_q8_0(),
            &p,
            &mut out.data,
        );
        if let Some(n) = rot.v {
            attention::hadamard_ggml(&mut out.data, n);
        }
        return out;
    }
    let (keys, values) = (cache.keys(), cache.values());
    let invariant = arithmetic == Arithmetic::BatchInvariant;
    match cache.precision {
        // Batch-invariant: the vector path for every query count, over all positions in order (no
        // split-KV, whose chunks follow the thread count), as llama.cpp decodes below 512 positions.
        KvPrecision::F16 if invariant => {
            attention::attention_ggml_f16(
                &q.data,
                positions,
                keys,
                values,
                &p,
                None,
                &mut out.data,
            );
        }
        // llama.cpp's CPU flash attention over its F16 cache, step for step: the tiled path for
        // batches of 64 queries or more, the vector path below that.
        KvPrecision::F16 if q.rows >= attention::GGML_FA_TILE_Q => {
            attention::attention_ggml_f16_tiled(
                &q.data,
                positions,
                keys,
                values,
                &p,
                &mut out.data,
            );
        }
        KvPrecision::F16 => {
            let chunk = (q.rows == 1)
                .then(|| split_kv_chunk(cache.len(), rayon::current_num_threads()))
                .flatten();
            attention::attention_ggml_f16(
                &q.data,
                positions,
                keys,
                values,
                &p,
                chunk,
                &mut out.data,
            );
        }
        KvPrecision::F32 => {
            attention::attention(&q.data, positions, keys, values, &p, &mut out.data);
        }
        KvPrecision::Q8_0 => unreachable!("read above"),
    }
    out
}

#[cfg(test)]
mod gelu_table_tests {
    use super::*;

    #[test]
    fn gelu_table_gives_ggml_gelu_bit_for_bit() {
        // Every f16 value, the values between them that round either way, the edges of the table's
        // range, and a sweep of ordinary f32 values.
        let mut xs: Vec<f32> = (0..=u16::MAX)
            .map(|b| half::f16::from_bits(b).to_f32())
            .filter(|x| x.is_finite())
            .collect();
        xs.extend((-2_100_000..2_100_000).map(|i| i as f32 * 5e-6 + 0.3e-7));
        xs.extend([
            -10.0, 10.0, -9.999, 9.999, -10.001, 10.001, 0.0, -0.0, 1e-30, -1e-30,
        ]);
        for x in xs {
            let (got, want) = (apply_unary(Unary::Gelu, x), act::gelu_ggml(x));
            assert_eq!(got.to_bits(), want.to_bits(), "x = {x}");
        }
    }
}
