//! One forward call on the card: [`Compute`] with activations in device buffers.
//!
//! Every operation queues its kernels on the device's compute stream and returns at once; the host waits
//! only for the logits at the end ([`GpuForward::finish`]). An operation that fails records the error
//! and the rest of the call queues nothing more (the trait's operations return activations, not results);
//! `finish` reports it. Activations of no rows (a call that asks for no logits) are kept without a buffer.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use poly_kernels::cuda::attention::{
    self, attention_f16_cache, AttnSplit, DecodeCache, KvCacheView, ATTN_KEY_TILE,
};
use poly_kernels::cuda::attention_mma;
use poly_kernels::cuda::elementwise::{self as ew, BinaryOp, Broadcast, UnaryFn};
use poly_kernels::cuda::ops::{self, ExpertInput, Routing};
use poly_kernels::cuda::prompt::{
    self, gather_rows, gather_rows_q8_1, matmul_experts_q, matmul_q, moe_combine_sorted,
    ExpertGrouping,
};
use poly_kernels::cuda::recurrent::{self, L2Form};
use poly_kernels::cuda::{BlockQ8_1, CudaError, CudaResult, Device, DeviceBuffer, ExpertTable};
use poly_kernels::ops::attention::AttnParams;
use poly_kernels::ops::rope::{RopeMode, RopeParams};
use poly_kernels::ops::topk::Gating as KGating;
use poly_models::compute::{
    composed, Attention, Batch, Compute, DeltaNet, DeltaNetInputs, FusedMoe, Gating, Logits, Moe,
    NormAfter, Rope, RopeKind, SharedExpert, Unary, WeightId,
};
use rayon::prelude::*;

use super::decode_graph::{
    guesses_on_card, queue_guess_signal, HostPoint, HostTimes, MoeStep, MoeSteps,
};
use super::expert_cache::{CpuShare, ExpertCache};
use super::pool::Pool;
use super::profile::CallMarks;
use super::seq::{DeviceLayer, DeviceSeq};
use super::weights::{GpuWeight, GpuWeights};
use crate::cpu::CpuWeights;

mod act;
mod fused;
mod moe;

use fused::{fuse_on, Fusion};

pub use fused::check_fuse_setting;

pub use act::DevAct;

/// Blocks the split-K attention aims for on one token (a few per SM of a large card).
const ATTN_TARGET_BLOCKS: usize = 264;
/// Most expert slots (tokens × experts per token) of one expert launch (a grid dimension's limit).
pub const MAX_SLOTS: usize = 65_535;

/// Fewest tokens whose embedding rows the host makes on several threads.
const PARALLEL_EMBED_ROWS: usize = 64;

/// The cache rows a one-token call at context length `n_kv` reads: the next power of two from 256, at most
/// the cache's `n_ctx` rows. Positions past the token's own are masked, so one graph serves a whole bucket;
/// the split of the context (and so the summation order) is the bucket's.
pub fn decode_kv_rows(n_kv: usize, n_ctx: usize) -> usize {
    n_kv.next_power_of_two().max(256).min(n_ctx).max(n_kv)
}

/// The split of a one-token attention over `n_kv` cache rows: about [`ATTN_TARGET_BLOCKS`] blocks (one per
/// KV head and chunk), chunks of one key tile and up. One token's attention has only a block per KV head
/// to begin with, and a block walks its chunk tile by tile, so short chunks are what make it fast (the
/// merge is one small launch).
fn decode_split(p: &AttnParams, n_kv: usize) -> AttnSplit {
    let splits = ATTN_TARGET_BLOCKS.div_ceil(p.n_head_kv.max(1));
    let chunk = n_kv.div_ceil(splits).max(ATTN_KEY_TILE);
    AttnSplit {
        chunk: chunk.div_ceil(ATTN_KEY_TILE) * ATTN_KEY_TILE,
    }
}

/// Whether one-token attention uses the flash-decoding kernel (`attention_decode_f16`);
/// `--attn-decode old` selects the split-K kernel of prompts instead (for before/after measurements).
fn decode_kernel_on() -> bool {
    crate::knobs::forward().attn_decode_flash
}

/// Whether one token's gate and up experts run as one fused launch (`--moe-glu off`: two launches and
/// the SwiGLU, for before/after measurements).
fn fused_glu_on() -> bool {
    crate::knobs::forward().moe_glu_fused
}

/// Whether the flash-decoding kernel also stores the token's key and value into the cache (one launch
/// fewer per layer; on the H200 q3 through serve mode 169.6 -> 175.9 t/s at depth 40, 155.2 -> 157.2 at
/// 8,000); `--attn-kv-store separate` runs `kv_store_f16_pos` first.
fn decode_store_fused() -> bool {
    crate::knobs::forward().attn_kv_store_fused
}

/// Splits of the flash-decoding kernel over a bucket of `n_kv` cache rows: about
/// [`ATTN_TARGET_BLOCKS`] blocks (`--attn-blocks` overrides it, for measurements) with at least
/// [`DECODE_MIN_KEYS`] keys each when the bucket is full, at most [`attention::DECODE_MAX_SPLIT`]. The
/// kernel cuts the keys the token sees (not the bucket) into that many parts, so the blocks stay busy
/// anywhere in the bucket.
fn decode_n_split(p: &AttnParams, n_kv: usize) -> usize {
    let target = crate::knobs::forward()
        .attn_blocks
        .filter(|&b| b > 0)
        .unwrap_or(ATTN_TARGET_BLOCKS);
    let by_blocks = target.div_ceil(p.n_head_kv.max(1));
    let by_keys = (n_kv / DECODE_MIN_KEYS).max(1);
    by_blocks.min(by_keys).clamp(1, attention::DECODE_MAX_SPLIT)
}

/// `--attn-heads-per-block`'s cut of a GQA group for the flash-decoding kernel.
fn decode_heads_per_block(p: &AttnParams) -> usize {
    let group = p.n_head / p.n_head_kv.max(1);
    attention::decode_heads_per_block(group, crate::knobs::forward().attn_heads_per_block)
}

/// The fewest keys a block of the flash-decoding kernel takes in a full bucket (below that the merge costs
/// more than the blocks gain).
const DECODE_MIN_KEYS: usize = 32;

/// The changing inputs of a decode graph, in buffers its launches read: the token's embedding row
/// `[n_embd]` and its position `[1]`.
pub struct GraphInputs {
    /// Made by the first (running) call, which learns the width.
    pub row: Option<DeviceBuffer<f32>>,
    pub positions: DeviceBuffer<i32>,
}

/// How a call takes part in a decode graph.
pub struct GraphMode<'a> {
    pub inputs: &'a mut GraphInputs,
    /// Launches are being captured (nothing runs, the host writes no input).
    pub capturing: bool,
    /// The embedding table and width `embed` read, for the host's writes before replays.
    pub embed: Option<(WeightId, usize)>,
    /// The expert cache needs the host in each MoE layer: the graph is cut there ([`MoeSteps`]).
    pub segmented: bool,
    /// A segmented graph's MoE steps (made by the running call, reused by the capture).
    pub steps: &'a mut MoeSteps,
}

/// What a call runs against: the device, the weights and the sequence on it, and the buffer pool.
pub struct Backing<'a> {
    pub dev: &'a Device,
    pub weights: &'a GpuWeights,
    pub cpu: &'a CpuWeights,
    pub seq: &'a mut DeviceSeq,
    pub pool: Rc<Pool>,
    /// The routed experts' cache.
    pub experts: Option<&'a mut ExpertCache>,
}

/// One forward call on the card.
pub struct GpuForward<'a> {
    dev: &'a Device,
    weights: &'a GpuWeights,
    cpu: &'a CpuWeights,
    seq: &'a mut DeviceSeq,
    pool: Rc<Pool>,
    tokens: &'a [u32],
    pos0: usize,
    logits: Logits,
    /// `[n]` positions of the batch's tokens.
    positions: Option<DeviceBuffer<i32>>,
    /// Set when the call's launches are captured into (or prepared for) a decode graph.
    graph: Option<GraphMode<'a>>,
    error: Option<CudaError>,
    /// The next activation id.
    next_id: std::cell::Cell<u64>,
    /// The last one-row activation quantized for a quantized matrix×vector, by activation id: the q, k and
    /// v projections (and an MoE layer's gate and up experts) read the same input, quantized once.
    q8_cache: RefCell<Option<(u64, DeviceBuffer<BlockQ8_1>)>>,
    /// `POLY_GPU_PROFILE`'s device marks, when profiling.
    marks: RefCell<Option<CallMarks>>,
    /// The routed experts' cache, when the model has some (their tables, the CPU's share, staging).
    experts: Option<&'a mut ExpertCache>,
}

fn rope_params(r: &Rope) -> RopeParams {
    RopeParams {
        mode: match r.kind {
            RopeKind::Normal => RopeMode::Normal,
            RopeKind::Neox => RopeMode::Neox,
        },
        head_dim: r.head_dim,
        n_rot: r.n_rot,
        freq_base: r.freq_base,
        freq_scale: r.freq_scale,
    }
}

impl<'a> GpuForward<'a> {
    /// A call reading `tokens` at `pos0..` into `seq`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        dev: &'a Device,
        weights: &'a GpuWeights,
        cpu: &'a CpuWeights,
        seq: &'a mut DeviceSeq,
        pool: Rc<Pool>,
        tokens: &'a [u32],
        pos0: usize,
        logits: Logits,
    ) -> CudaResult<GpuForward<'a>> {
        let pos: Vec<i32> = (0..tokens.len()).map(|i| (pos0 + i) as i32).collect();
        let mut positions = pool.i32(dev, pos.len().max(1))?;
        if !pos.is_empty() {
            dev.write(&pos, &mut positions)?;
        }
        Ok(GpuForward {
            dev,
            weights,
            cpu,
            seq,
            pool,
            tokens,
            pos0,
            logits,
            positions: Some(positions),
            graph: None,
            error: None,
            next_id: std::cell::Cell::new(0),
            q8_cache: RefCell::new(None),
            marks: RefCell::new(None),
            experts: None,
        })
    }

    /// The call with the routed experts found through `cache`.
    pub fn with_expert_cache(mut self, cache: Option<&'a mut ExpertCache>) -> GpuForward<'a> {
        self.experts = cache;
        self
    }

    /// A one-token call whose changing inputs (the token's embedding row, its position) are `mode`'s
    /// buffers, so its launches can be captured and replayed ([`super::decode_graph`]). Unless capturing,
    /// the call runs as any other (it writes the row itself); the host writes the position before.
    pub(super) fn for_graph(
        backing: Backing<'a>,
        tokens: &'a [u32],
        pos0: usize,
        mode: GraphMode<'a>,
    ) -> GpuForward<'a> {
        GpuForward {
            dev: backing.dev,
            weights: backing.weights,
            cpu: backing.cpu,
            seq: backing.seq,
            pool: backing.pool,
            tokens,
            pos0,
            logits: Logits::Last,
            positions: None,
            graph: Some(mode),
            error: None,
            next_id: std::cell::Cell::new(0),
            q8_cache: RefCell::new(None),
            marks: RefCell::new(None),
            experts: backing.experts,
        }
    }

    fn new_id(&self) -> u64 {
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        id
    }

    /// The embedding table and row width a graph call's `embed` read (the host writes the row before a
    /// replay).
    pub(super) fn graph_embed(&self) -> Option<(WeightId, usize)> {
        self.graph.as_ref().and_then(|g| g.embed)
    }

    /// For a captured call: the buffer the logits land in (kept by the graph), or the call's first error.
    pub(super) fn finish_captured(mut self, mut out: DevAct) -> CudaResult<DeviceBuffer<f32>> {
        self.release_scratch();
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        out.buf
            .take()
            .ok_or_else(|| CudaError::Invalid("a captured call without logits".into()))
    }

    /// Gives the call's own buffers back to the pool.
    fn release_scratch(&mut self) {
        if let Some((_, q)) = self.q8_cache.get_mut().take() {
            self.pool.put_q8(q);
        }
        if let Some(p) = self.positions.take() {
            self.pool.put_i32(p);
        }
    }

    /// [`ops::rms_norm_quantize_q8_1`] into `out`, its quantized copy kept as `out`'s in the cache.
    fn rms_norm_quantized(
        &self,
        x: &DeviceBuffer<f32>,
        group: usize,
        weight: Option<&DeviceBuffer<f32>>,
        eps: f32,
        out: &mut DevAct,
    ) -> CudaResult<()> {
        let mut cache = self.q8_cache.borrow_mut();
        if let Some((_, old)) = cache.take() {
            self.pool.put_q8(old);
        }
        let mut q = self.pool.q8(self.dev, out.len() / 32)?;
        let id = out.id;
        match ops::rms_norm_quantize_q8_1(self.dev, x, group, weight, eps, (out.buf_mut()?, &mut q))
        {
            Ok(()) => {
                *cache = Some((id, q));
                Ok(())
            }
            Err(e) => {
                self.pool.put_q8(q);
                Err(e)
            }
        }
    }

    /// Runs `f` on `x` quantized to q8_1 (one row: through the cache, by `id`).
    fn with_q8<R>(
        &self,
        id: Option<u64>,
        x: &DeviceBuffer<f32>,
        f: impl FnOnce(&DeviceBuffer<BlockQ8_1>) -> CudaResult<R>,
    ) -> CudaResult<R> {
        let dev = self.dev;
        let Some(id) = id else {
            let mut xq = self.pool.q8(dev, x.len() / 32)?;
            let r = ops::quantize_q8_1(dev, x, &mut xq).and_then(|_| f(&xq));
            self.pool.put_q8(xq);
            return r;
        };
        let mut cache = self.q8_cache.borrow_mut();
        if cache.as_ref().map(|c| c.0) != Some(id) {
            if let Some((_, old)) = cache.take() {
                self.pool.put_q8(old);
            }
            let mut xq = self.pool.q8(dev, x.len() / 32)?;
            if let Err(e) = ops::quantize_q8_1(dev, x, &mut xq) {
                self.pool.put_q8(xq);
                return Err(e);
            }
            *cache = Some((id, xq));
        }
        match cache.as_ref() {
            Some((_, xq)) => f(xq),
            None => Err(CudaError::Invalid(
                "the quantized input went missing".into(),
            )),
        }
    }

    /// Profiles this call's operations into `marks`.
    pub(super) fn set_marks(&mut self, marks: Option<CallMarks>) {
        *self.marks.get_mut() = marks;
    }

    /// The profile marks, once the operations are queued.
    pub(super) fn take_marks(&mut self) -> Option<CallMarks> {
        self.marks.get_mut().take()
    }

    /// Starts timing an operation (when profiling operations).
    fn op_begin(&self) -> Option<poly_kernels::cuda::TimingEvent> {
        self.marks
            .borrow_mut()
            .as_mut()
            .and_then(|m| m.op_begin(self.dev))
    }

    /// Ends timing the operation `begin` started, as `kind`.
    fn op_end(&self, kind: &'static str, begin: Option<poly_kernels::cuda::TimingEvent>) {
        if begin.is_some() {
            if let Some(m) = self.marks.borrow_mut().as_mut() {
                m.op_end(self.dev, kind, begin);
            }
        }
    }

    /// The logits `out` holds, downloaded; or the first error of the call.
    pub fn finish(mut self, out: DevAct) -> CudaResult<Vec<f32>> {
        let result = match self.error.take() {
            Some(e) => Err(e),
            None if out.len() == 0 => self.dev.synchronize().map(|_| Vec::new()),
            None => out.buf().and_then(|b| self.dev.download(b)),
        };
        drop(out);
        self.release_scratch();
        result
    }

    /// An activation holding `data` (`[rows, cols]`), for the lockstep diagnosis ([`super::lockstep`]).
    pub(super) fn upload(&mut self, rows: usize, cols: usize, data: &[f32]) -> DevAct {
        let mut out = self.alloc(rows, cols);
        self.run("upload", data.is_empty(), |c| {
            c.dev.write(data, out.buf_mut()?)
        });
        out
    }

    /// `x` downloaded (waits for the stream); empty when it has no data or the call failed.
    pub(super) fn download_act(&mut self, x: &DevAct) -> Vec<f32> {
        if self.error.is_some() || x.len() == 0 {
            return Vec::new();
        }
        match x.buf().and_then(|b| self.dev.download(b)) {
            Ok(v) => v,
            Err(e) => {
                self.error.get_or_insert(e);
                Vec::new()
            }
        }
    }

    fn positions(&self) -> CudaResult<&DeviceBuffer<i32>> {
        match &self.graph {
            Some(g) => Ok(&g.inputs.positions),
            None => self
                .positions
                .as_ref()
                .ok_or_else(|| CudaError::Invalid("the call's positions are gone".into())),
        }
    }

    /// A new activation of `rows × cols` (no buffer when empty or after an error).
    fn alloc(&mut self, rows: usize, cols: usize) -> DevAct {
        let buf = if rows * cols == 0 || self.error.is_some() {
            None
        } else {
            match self.pool.f32(self.dev, rows * cols) {
                Ok(b) => Some(b),
                Err(e) => {
                    self.error.get_or_insert(e);
                    None
                }
            }
        };
        DevAct {
            rows,
            cols,
            id: self.new_id(),
            buf,
            pool: self.pool.clone(),
        }
    }

    /// Runs `f` (operation `kind`) unless the call already failed or there is nothing to compute; records
    /// its error.
    fn run(
        &mut self,
        kind: &'static str,
        empty: bool,
        f: impl FnOnce(&mut Self) -> CudaResult<()>,
    ) {
        if self.error.is_some() || empty {
            return;
        }
        let t = self.op_begin();
        let r = f(self);
        self.op_end(kind, t);
        if let Err(e) = r {
            self.error.get_or_insert(e);
        }
    }

    fn vector(&self, w: WeightId) -> CudaResult<Arc<DeviceBuffer<f32>>> {
        self.weights.vector(self.dev, self.cpu, w)
    }

    /// `y = x·Wᵀ` into `y` (`[n, rows]`) for any matrix on the card.
    fn matmul_into(&self, w: WeightId, x: &DevAct, y: &mut DevAct) -> CudaResult<()> {
        let dev = self.dev;
        match self.weights.matrix(w)? {
            GpuWeight::Quant(m) => {
                let id = (x.rows == 1).then_some(x.id);
                self.with_q8(id, x.buf()?, |xq| {
                    if x.rows == 1 {
                        ops::matvec_q(dev, m, xq, y.buf_mut()?)
                    } else {
                        matmul_q(dev, m, xq, y.buf_mut()?)
                    }
                })
            }
            // A prompt's float matrices (the router): tiles of 64 rows × 64 tokens.
            GpuWeight::Float(s) if x.rows > 1 => {
                prompt::matmul_f(dev, s.table(), x.buf()?, y.buf_mut()?)
            }
            GpuWeight::Float(s) => {
                if x.rows > MAX_SLOTS {
                    return Err(CudaError::Invalid(format!("{} rows in one matmul", x.rows)));
                }
                let ids = self.pool.zeros_i32(dev, x.rows)?;
                let input = if x.rows == 1 {
                    ExpertInput::Shared
                } else {
                    ExpertInput::PerSlot
                };
                ops::matvec_experts_f(dev, s.table(), &ids, x.buf()?, input, y.buf_mut()?)
            }
            GpuWeight::Experts(_) => Err(CudaError::Invalid(format!(
                "weight {} is an expert tensor, not a matrix",
                w.0
            ))),
        }
    }

    fn out_rows(&self, w: WeightId) -> usize {
        let info = self.cpu.info(w);
        info.dims.get(1).copied().unwrap_or(1) as usize
    }

    fn binary(&mut self, a: &DevAct, b: &DevAct, op: BinaryOp, bc: Broadcast) -> DevAct {
        let mut out = self.alloc(a.rows, a.cols);
        let cols = a.cols;
        let kind = match op {
            BinaryOp::Add => "add",
            BinaryOp::Mul => "mul",
        };
        self.run(kind, a.len() == 0, |c| {
            ew::binary(c.dev, a.buf()?, b.buf()?, cols, op, bc, out.buf_mut()?)
        });
        out
    }

    fn weight_binary(&mut self, x: &DevAct, w: WeightId, op: BinaryOp) -> DevAct {
        let mut out = self.alloc(x.rows, x.cols);
        let cols = x.cols;
        let kind = match op {
            BinaryOp::Add => "add_weight",
            BinaryOp::Mul => "mul_weight",
        };
        self.run(kind, x.len() == 0, |c| {
            let v = c.vector(w)?;
            ew::binary(
                c.dev,
                x.buf()?,
                &v,
                cols,
                op,
                Broadcast::PerColumn,
                out.buf_mut()?,
            )
        });
        out
    }

    fn unary_into(
        &self,
        x: &DeviceBuffer<f32>,
        f: Unary,
        out: &mut DeviceBuffer<f32>,
    ) -> CudaResult<()> {
        let dev = self.dev;
        match f {
            Unary::Silu => ops::silu(dev, x, out),
            Unary::Gelu => ops::gelu(dev, x, out),
            Unary::Sigmoid => ew::unary(dev, x, UnaryFn::Sigmoid, out),
            Unary::Softplus => ew::unary(dev, x, UnaryFn::Softplus, out),
            Unary::Tanh => ew::unary(dev, x, UnaryFn::Tanh, out),
            Unary::Exp => ew::unary(dev, x, UnaryFn::Exp, out),
        }
    }
}

impl Compute for GpuForward<'_> {
    type Act = DevAct;

    fn shape(&self, x: &DevAct) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn embed(&mut self, table: WeightId, tokens: &[u32]) -> DevAct {
        let n_embd = self.cpu.info(table).row_len() as usize;
        let mut out = self.alloc(tokens.len(), n_embd);
        self.run("embed", tokens.is_empty(), |c| {
            // The rows are read from the mapped file and dequantized on the host: one small copy per
            // call, and no dequantization kernel per format.
            let mut rows = Vec::new();
            let cpu = c.cpu;
            let host_rows = |rows: &mut Vec<f32>| {
                rows.resize(tokens.len() * n_embd, 0.0);
                if tokens.len() >= PARALLEL_EMBED_ROWS {
                    // A prompt's rows on the pool's threads: 4,096 rows on one thread took about 20 ms
                    // of each prompt call on the H200 host (5% of a 4,096-token call).
                    rows.par_chunks_mut(n_embd)
                        .zip(tokens.par_iter())
                        .for_each(|(row, &t)| cpu.row_into(table, t as usize, row));
                    return;
                }
                for (i, &t) in tokens.iter().enumerate() {
                    cpu.row_into(table, t as usize, &mut rows[i * n_embd..(i + 1) * n_embd]);
                }
            };
            let Some(g) = c.graph.as_mut() else {
                host_rows(&mut rows);
                return c.dev.write(&rows, out.buf_mut()?);
            };
            // A graph reads the row from its input buffer, which the host fills before a replay (and this
            // call itself when it runs rather than being captured).
            g.embed = Some((table, n_embd));
            if tokens.len() != 1 {
                return Err(CudaError::Invalid(
                    "a decode graph of several tokens".into(),
                ));
            }
            if !g.capturing {
                if g.inputs.row.as_ref().map(|r| r.len()) != Some(n_embd) {
                    g.inputs.row = Some(c.dev.zeros(n_embd)?);
                }
                host_rows(&mut rows);
                if let Some(r) = g.inputs.row.as_mut() {
                    c.dev.write(&rows, r)?;
                }
            }
            match &g.inputs.row {
                Some(r) if r.len() == n_embd => ew::scale(c.dev, r, 1.0, out.buf_mut()?),
                _ => Err(CudaError::Invalid(
                    "a decode graph captured before its embedding row was made".into(),
                )),
            }
        });
        out
    }

    fn matmul(&mut self, w: WeightId, x: &DevAct) -> DevAct {
        let rows = self.out_rows(w);
        let mut y = self.alloc(x.rows, rows);
        self.run("matmul", x.len() == 0, |c| c.matmul_into(w, x, &mut y));
        y
    }

    fn rms_norm(&mut self, x: &DevAct, weight: Option<WeightId>, eps: f32, group: usize) -> DevAct {
        let mut out = self.alloc(x.rows, x.cols);
        self.run("rms_norm", x.len() == 0, |c| {
            let w = weight.map(|w| c.vector(w)).transpose()?;
            if x.rows == 1 && group == x.cols && group.is_multiple_of(32) {
                // One token's whole-row norm feeds quantized matrices (the projections after it): it
                // writes their quantized input too.
                return c.rms_norm_quantized(x.buf()?, group, w.as_deref(), eps, &mut out);
            }
            ops::rms_norm(c.dev, x.buf()?, group, w.as_deref(), eps, out.buf_mut()?)
        });
        out
    }

    fn l2_norm(&mut self, x: &DevAct, eps: f32, group: usize) -> DevAct {
        let mut out = self.alloc(x.rows, x.cols);
        self.run("l2_norm", x.len() == 0, |c| {
            recurrent::l2_norm(c.dev, x.buf()?, group, eps, L2Form::MaxEps, out.buf_mut()?)
        });
        out
    }

    fn add(&mut self, a: &DevAct, b: &DevAct) -> DevAct {
        self.binary(a, b, BinaryOp::Add, Broadcast::None)
    }

    fn mul(&mut self, a: &DevAct, b: &DevAct) -> DevAct {
        let bc = if b.cols == 1 && a.cols != 1 {
            Broadcast::PerRow
        } else {
            Broadcast::None
        };
        self.binary(a, b, BinaryOp::Mul, bc)
    }

    fn add_weight(&mut self, x: &DevAct, w: WeightId) -> DevAct {
        self.weight_binary(x, w, BinaryOp::Add)
    }

    fn mul_weight(&mut self, x: &DevAct, w: WeightId) -> DevAct {
        self.weight_binary(x, w, BinaryOp::Mul)
    }

    fn scale(&mut self, x: &DevAct, s: f32) -> DevAct {
        let mut out = self.alloc(x.rows, x.cols);
        self.run("scale", x.len() == 0, |c| {
            ew::scale(c.dev, x.buf()?, s, out.buf_mut()?)
        });
        out
    }

    fn unary(&mut self, x: &DevAct, f: Unary) -> DevAct {
        let mut out = self.alloc(x.rows, x.cols);
        self.run("unary", x.len() == 0, |c| {
            c.unary_into(x.buf()?, f, out.buf_mut()?)
        });
        out
    }

    fn cols(&mut self, x: &DevAct, start: usize, len: usize) -> DevAct {
        let mut out = self.alloc(x.rows, len);
        let in_cols = x.cols;
        self.run("cols", x.rows * len == 0, |c| {
            ew::cols(c.dev, x.buf()?, in_cols, start, len, out.buf_mut()?)
        });
        out
    }

    fn head_part(&mut self, x: &DevAct, head: usize, parts: usize, part: usize) -> DevAct {
        let width = x.cols / parts.max(1);
        let mut out = self.alloc(x.rows, width);
        let rows = x.rows;
        self.run("head_part", x.len() == 0, |c| {
            ew::head_part(c.dev, x.buf()?, rows, head, parts, part, out.buf_mut()?)
        });
        out
    }

    fn repeat_heads(&mut self, x: &DevAct, head: usize, times: usize, interleave: bool) -> DevAct {
        let mut out = self.alloc(x.rows, x.cols * times);
        let rows = x.rows;
        self.run("repeat_heads", x.len() == 0, |c| {
            ew::repeat_heads(
                c.dev,
                x.buf()?,
                rows,
                head,
                times,
                interleave,
                out.buf_mut()?,
            )
        });
        out
    }

    fn rows(&mut self, x: &DevAct, rows: &[usize]) -> DevAct {
        let mut out = self.alloc(rows.len(), x.cols);
        let width = x.cols;
        self.run("rows", rows.is_empty() || width == 0, |c| {
            let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
            if rows.iter().any(|&r| r >= x.rows) {
                return Err(CudaError::Invalid("rows: a row past the activation".into()));
            }
            let mut ib = c.pool.i32(c.dev, idx.len())?;
            c.dev.write(&idx, &mut ib)?;
            let r = gather_rows(c.dev, x.buf()?, &ib, width, out.buf_mut()?);
            c.pool.put_i32(ib);
            r
        });
        out
    }

    fn rope(&mut self, x: &DevAct, r: &Rope) -> DevAct {
        let mut out = self.alloc(x.rows, x.cols);
        let p = rope_params(r);
        self.run("rope", x.len() == 0, |c| {
            // Llama 3.1+'s rope_freqs.weight ([n_rot / 2] F32), when the model has one.
            let f = r.freq_factors.map(|w| c.vector(w)).transpose()?;
            let o = out.buf_mut()?;
            ops::rope_into(c.dev, x.buf()?, c.positions()?, &p, f.as_deref(), o)
        });
        out
    }

    fn attention(
        &mut self,
        layer: usize,
        q: &DevAct,
        k: &DevAct,
        v: &DevAct,
        a: &Attention,
    ) -> DevAct {
        let mut out = self.alloc(q.rows, a.n_head * a.head_dim_v);
        let (pos0, n) = (self.pos0, q.rows);
        self.run("attention", q.len() == 0, |c| {
            let p = AttnParams {
                n_head: a.n_head,
                n_head_kv: a.n_head_kv,
                head_dim_k: a.head_dim_k,
                head_dim_v: a.head_dim_v,
                scale: a.scale,
                window: a.window,
                softcap: a.softcap,
                sees_together: None,
            };
            let dev = c.dev;
            let positions = match &c.graph {
                Some(g) => &g.inputs.positions,
                None => c
                    .positions
                    .as_ref()
                    .ok_or_else(|| CudaError::Invalid("the call's positions are gone".into()))?,
            };
            let Some(DeviceLayer::Kv {
                k: kc,
                v: vc,
                k_width,
                v_width,
            }) = c.seq.layers.get_mut(layer)
            else {
                return Err(CudaError::Invalid(format!(
                    "attention on layer {layer}, whose state is not a KV cache"
                )));
            };
            let (n_kv, split) = if n == 1 {
                // One token: the store and the attention read the position on the card and the cache
                // is read up to a bucket of the context ([`decode_kv_rows`]; the causal mask stops at
                // the position), so the same launches serve every position of the bucket (a graph).
                let (k_width, v_width) = (*k_width, *v_width);
                let n_kv = decode_kv_rows(pos0 + 1, kc.len() / k_width.max(1));
                if decode_kernel_on() && attention::decode_takes(&p) && k_width == v_width {
                    let n_split = decode_n_split(&p, n_kv);
                    let scratch_len = attention::decode_scratch_len(&p, n_split);
                    let mut scratch = if scratch_len > 0 {
                        Some(c.pool.f32(dev, scratch_len)?)
                    } else {
                        None
                    };
                    let cache = if decode_store_fused() {
                        DecodeCache::Store {
                            k_new: k.buf()?,
                            v_new: v.buf()?,
                            k: kc,
                            v: vc,
                            n_kv,
                        }
                    } else {
                        let dst = ew::KvDst {
                            k: kc,
                            v: vc,
                            k_width,
                            v_width,
                        };
                        ew::kv_store_f16_pos(dev, k.buf()?, v.buf()?, positions, dst)?;
                        DecodeCache::Read(KvCacheView {
                            k: kc,
                            v: vc,
                            n_kv: Some(n_kv),
                        })
                    };
                    // The merge of several splits also writes the output quantized, kept as its
                    // copy for the output projection (`attn-q8`: one quantize launch fewer).
                    let quantized = fuse_on(Fusion::AttnQ8)
                        && n_split > 1
                        && p.head_dim_v.is_multiple_of(BlockQ8_1::ELEMS);
                    let mut out_q = match quantized {
                        true => Some(c.pool.q8(dev, out.len() / BlockQ8_1::ELEMS)?),
                        false => None,
                    };
                    let split = attention::DecodeSplit {
                        n_split,
                        heads_per_block: decode_heads_per_block(&p),
                    };
                    let r = attention::attention_decode_f16(
                        dev,
                        q.buf()?,
                        positions,
                        cache,
                        &p,
                        split,
                        scratch.as_mut(),
                        (out.buf_mut()?, out_q.as_mut()),
                    );
                    if let Some(s) = scratch {
                        c.pool.put_f32(s);
                    }
                    if let Some(copy) = out_q {
                        let mut kept = c.q8_cache.borrow_mut();
                        match (&r, kept.take()) {
                            (Ok(()), old) => {
                                if let Some((_, old)) = old {
                                    c.pool.put_q8(old);
                                }
                                *kept = Some((out.id, copy));
                            }
                            (Err(_), old) => {
                                *kept = old;
                                c.pool.put_q8(copy);
                            }
                        }
                    }
                    return r;
                }
                let dst = ew::KvDst {
                    k: kc,
                    v: vc,
                    k_width,
                    v_width,
                };
                ew::kv_store_f16_pos(dev, k.buf()?, v.buf()?, positions, dst)?;
                (n_kv, decode_split(&p, n_kv))
            } else {
                ew::kv_store_f16(dev, k.buf()?, kc, pos0 * *k_width)?;
                ew::kv_store_f16(dev, v.buf()?, vc, pos0 * *v_width)?;
                let n_kv = pos0 + n;
                if attention_mma::takes(dev, &p, n) {
                    let cache = KvCacheView {
                        k: kc,
                        v: vc,
                        n_kv: Some(n_kv),
                    };
                    return attention_mma::attention_prompt(
                        dev,
                        q.buf()?,
                        positions,
                        cache,
                        &p,
                        out.buf_mut()?,
                    );
                }
                (n_kv, AttnSplit::none(n_kv))
            };
            let scratch_len = split.scratch_len(&p, n, n_kv);
            let mut scratch = if scratch_len > 0 {
                Some(c.pool.f32(dev, scratch_len)?)
            } else {
                None
            };
            let cache = KvCacheView {
                k: kc,
                v: vc,
                n_kv: Some(n_kv),
            };
            let r = attention_f16_cache(
                dev,
                q.buf()?,
                positions,
                cache,
                &p,
                split,
                scratch.as_mut(),
                out.buf_mut()?,
            );
            if let Some(s) = scratch {
                c.pool.put_f32(s);
            }
            r
        });
        out
    }

    fn moe(&mut self, _layer: usize, x: &DevAct, m: &Moe) -> DevAct {
        let mut out = self.alloc(x.rows, x.cols);
        self.run("moe", x.len() == 0 || m.n_expert_used == 0, |c| {
            c.moe_into(x, m, None, &mut out).map(|_| ())
        });
        out
    }

    /// Not on the card yet: [`crate::gpu::GpuBackend::refuses`] turns such a model away at load (what it
    /// uses says so), and a call that reaches it fails with the reason.
    fn fused_moe(&mut self, _layer: usize, x: &DevAct, _rx: &DevAct, _m: &FusedMoe) -> DevAct {
        let out = self.alloc(x.rows, x.cols);
        self.run("fused_moe", x.len() == 0, |_| {
            Err(CudaError::Invalid(
                "the card does not run MoE blocks in Gemma 4's form yet".into(),
            ))
        });
        out
    }

    /// A segmented graph's step computes the shared expert between its two host points (the card
    /// would wait for the host's decisions otherwise); elsewhere the composed sequence.
    fn moe_shared(&mut self, layer: usize, x: &DevAct, m: &Moe, s: &SharedExpert) -> DevAct {
        if self.segmented_layer(m).is_none() || x.len() == 0 || m.n_expert_used == 0 {
            return composed::moe_shared(self, layer, x, m, s);
        }
        let mut out = self.alloc(x.rows, x.cols);
        let mut shared = None;
        self.run("moe", false, |c| {
            shared = c.moe_into(x, m, Some(s), &mut out)?;
            Ok(())
        });
        match shared {
            Some(shared) => self.add(&out, &shared),
            // Only when the step failed: the call reports that error.
            None => out,
        }
    }

    fn ssm_conv(&mut self, layer: usize, x: &DevAct, kernel: WeightId) -> DevAct {
        self.ssm_conv_with(layer, x, kernel, false)
    }

    fn gated_delta_net(
        &mut self,
        layer: usize,
        x: DeltaNetInputs<'_, DevAct>,
        net: &DeltaNet,
    ) -> DevAct {
        self.delta_net_with(layer, x, net, net.n_v_heads)
    }

    fn batch(&self) -> Batch<'_> {
        Batch {
            tokens: self.tokens,
            pos0: self.pos0 as u32,
            logits: self.logits,
        }
    }

    // The compound operations as fused kernels (`fused.rs`).
    fn add_rms_norm(
        &mut self,
        a: &DevAct,
        b: &DevAct,
        w: Option<WeightId>,
        eps: f32,
        group: usize,
    ) -> (DevAct, DevAct) {
        self.fused_add_rms_norm((a, b), w, eps, group)
    }

    fn rms_norm_rope(&mut self, x: &DevAct, w: Option<WeightId>, eps: f32, r: &Rope) -> DevAct {
        self.fused_rms_norm_rope(x, w, eps, r)
    }

    fn rms_norm_rope_pair(
        &mut self,
        qk: [&DevAct; 2],
        norms: [Option<WeightId>; 2],
        eps: f32,
        r: &Rope,
    ) -> [DevAct; 2] {
        self.fused_rms_norm_rope_pair(qk, norms, eps, r)
    }

    fn moe_add_rms_norm(
        &mut self,
        layer: usize,
        x: &DevAct,
        experts: (&Moe, Option<&SharedExpert>),
        after: NormAfter<'_, DevAct>,
    ) -> (DevAct, DevAct) {
        self.fused_moe_add_rms_norm(layer, x, experts, after)
    }

    fn matmul_many<const N: usize>(&mut self, ws: [WeightId; N], x: &DevAct) -> [DevAct; N] {
        self.fused_matmul_many(ws, x)
    }

    fn glu(&mut self, gate: &DevAct, up: &DevAct, act: Unary) -> DevAct {
        self.fused_glu(gate, up, act)
    }

    fn ssm_conv_silu(&mut self, layer: usize, x: &DevAct, kernel: WeightId) -> DevAct {
        self.fused_ssm_conv_silu(layer, x, kernel)
    }

    fn rms_norm_gated(
        &mut self,
        x: &DevAct,
        w: Option<WeightId>,
        eps: f32,
        g: usize,
        z: &DevAct,
    ) -> DevAct {
        self.fused_rms_norm_gated(x, (w, eps, g), z)
    }

    fn cols_rms_norm_scale(
        &mut self,
        x: &DevAct,
        cols: (usize, usize),
        eps: f32,
        g: usize,
        s: f32,
    ) -> DevAct {
        self.fused_cols_rms_norm_scale(x, cols, (eps, g), s)
    }

    fn delta_gates(
        &mut self,
        b: &DevAct,
        a: &DevAct,
        bias: WeightId,
        w: WeightId,
    ) -> (DevAct, DevAct) {
        self.fused_delta_gates((b, a), bias, w)
    }

    fn gated_delta_net_grouped(
        &mut self,
        layer: usize,
        x: DeltaNetInputs<'_, DevAct>,
        net: &DeltaNet,
        n_k_heads: usize,
    ) -> DevAct {
        self.fused_gated_delta_net_grouped(layer, x, net, n_k_heads)
    }
}
