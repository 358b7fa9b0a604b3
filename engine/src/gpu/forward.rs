//! One forward call on the card: [`Compute`] with activations in device buffers.
//!
//! Every operation queues its kernels on the device's compute stream and returns at once; the host waits
//! only for the logits at the end ([`GpuForward::finish`]). An operation that fails records the error
//! and the rest of the call queues nothing more (the trait's operations return activations, not results);
//! `finish` reports it. Activations of no rows (a call that asks for no logits) are kept without a buffer.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use poly_kernels::cuda::attention::{attention_f16_cache, AttnSplit, KvCacheView};
use poly_kernels::cuda::attention_mma;
use poly_kernels::cuda::elementwise::{self as ew, BinaryOp, Broadcast, UnaryFn};
use poly_kernels::cuda::ops::{self, ExpertInput, Routing};
use poly_kernels::cuda::prompt::{
    self, gather_rows, matmul_experts_q, matmul_q, moe_combine_sorted, ExpertGrouping,
};
use poly_kernels::cuda::recurrent::{self, DeltaInputs, L2Form};
use poly_kernels::cuda::{CudaError, CudaResult, Device, DeviceBuffer, ExpertTable};
use poly_kernels::ops::attention::AttnParams;
use poly_kernels::ops::recurrent::DeltaShape;
use poly_kernels::ops::rope::{RopeMode, RopeParams};
use poly_kernels::ops::topk::Gating as KGating;
use poly_models::compute::{
    Attention, Batch, Compute, DeltaNet, DeltaNetInputs, Gating, Logits, Moe, Rope, RopeKind,
    Unary, WeightId,
};

use super::pool::Pool;
use super::seq::{DeviceLayer, DeviceSeq};
use super::weights::{GpuWeight, GpuWeights};
use crate::cpu::CpuWeights;

/// Blocks the split-K attention aims for on one token (a few per SM of a large card).
const ATTN_TARGET_BLOCKS: usize = 264;
/// Most expert slots (tokens × experts per token) of one expert launch.
const MAX_SLOTS: usize = 65_535;

/// A `[rows, cols]` f32 activation on the card; its buffer goes back to the pool when dropped.
pub struct DevAct {
    rows: usize,
    cols: usize,
    buf: Option<DeviceBuffer<f32>>,
    pool: Rc<Pool>,
}

impl Drop for DevAct {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.put_f32(b);
        }
    }
}

impl DevAct {
    fn len(&self) -> usize {
        self.rows * self.cols
    }

    fn buf(&self) -> CudaResult<&DeviceBuffer<f32>> {
        self.buf
            .as_ref()
            .ok_or_else(|| CudaError::Invalid("an activation without data".into()))
    }

    fn buf_mut(&mut self) -> CudaResult<&mut DeviceBuffer<f32>> {
        self.buf
            .as_mut()
            .ok_or_else(|| CudaError::Invalid("an activation without data".into()))
    }
}

/// A prompt's routing grouped by expert, on the card ([`GpuForward::group_experts`]).
struct ExpertGroups {
    /// `[slots]` the token of each sorted row.
    rows: DeviceBuffer<i32>,
    /// `[slots]` the sorted row of each (token, choice).
    slot_row: DeviceBuffer<i32>,
    /// `[n_tiles·3]` (expert, first row, rows) tiles of at most `tile_rows` rows, padded with empty ones.
    tiles: DeviceBuffer<i32>,
    tile_rows: usize,
}

impl ExpertGroups {
    fn give_back(self, pool: &Pool) {
        pool.put_i32(self.rows);
        pool.put_i32(self.slot_row);
        pool.put_i32(self.tiles);
    }
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
    error: Option<CudaError>,
    /// Per-operation times of a prompt call when `POLY_GPU_OPTIME=1` ([`OpTimes`]).
    optime: Option<OpTimes>,
}

/// Wall time per kind of operation of one prompt call (64 tokens or more), when the environment has
/// `POLY_GPU_OPTIME=1`: a diagnosis of prompt speed. Each timed operation waits for the card before and
/// after, so the figures include launch and wait costs and the call runs slower than untimed; `finish`
/// prints the table to stderr.
struct OpTimes {
    started: Instant,
    by_op: RefCell<Vec<(&'static str, f64, u32)>>,
}

impl OpTimes {
    fn wanted(n_tokens: usize) -> Option<OpTimes> {
        let on = std::env::var("POLY_GPU_OPTIME").is_ok_and(|v| v == "1");
        (on && n_tokens >= 64).then(|| OpTimes {
            started: Instant::now(),
            by_op: RefCell::new(Vec::new()),
        })
    }

    fn add(&self, op: &'static str, seconds: f64) {
        let mut v = self.by_op.borrow_mut();
        match v.iter_mut().find(|e| e.0 == op) {
            Some(e) => {
                e.1 += seconds;
                e.2 += 1;
            }
            None => v.push((op, seconds, 1)),
        }
    }

    fn report(&self, n_tokens: usize) {
        let total = self.started.elapsed().as_secs_f64();
        let mut line = format!("optime n {n_tokens}: call {:.2} ms", total * 1e3);
        for (op, s, count) in self.by_op.borrow().iter() {
            line.push_str(&format!("; {op} {:.2} ms ({count})", s * 1e3));
        }
        eprintln!("{line}");
    }
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
            error: None,
            optime: OpTimes::wanted(tokens.len()),
        })
    }

    /// The logits `out` holds, downloaded; or the first error of the call.
    pub fn finish(mut self, out: DevAct) -> CudaResult<Vec<f32>> {
        let result = match self.error.take() {
            Some(e) => Err(e),
            None if out.len() == 0 => self.dev.synchronize().map(|_| Vec::new()),
            None => out.buf().and_then(|b| self.dev.download(b)),
        };
        if let Some(t) = &self.optime {
            t.report(self.tokens.len());
        }
        drop(out);
        if let Some(p) = self.positions.take() {
            self.pool.put_i32(p);
        }
        result
    }

    /// An activation holding `data` (`[rows, cols]`), for the lockstep diagnosis ([`super::lockstep`]).
    pub(super) fn upload(&mut self, rows: usize, cols: usize, data: &[f32]) -> DevAct {
        let mut out = self.alloc(rows, cols);
        self.run(data.is_empty(), |c| c.dev.write(data, out.buf_mut()?));
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

    /// The start of a timed operation (waits for the card) when times are kept.
    fn op_begin(&self) -> Option<Instant> {
        self.optime.as_ref()?;
        self.dev.synchronize().ok()?;
        Some(Instant::now())
    }

    /// The end of a timed operation begun at `t0` (waits for the card).
    fn op_end(&self, op: &'static str, t0: Option<Instant>) {
        if let (Some(t), Some(t0)) = (&self.optime, t0) {
            if self.dev.synchronize().is_ok() {
                t.add(op, t0.elapsed().as_secs_f64());
            }
        }
    }

    fn positions(&self) -> CudaResult<&DeviceBuffer<i32>> {
        self.positions
            .as_ref()
            .ok_or_else(|| CudaError::Invalid("the call's positions are gone".into()))
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
            buf,
            pool: self.pool.clone(),
        }
    }

    /// Runs `f` unless the call already failed or there is nothing to compute; records its error.
    fn run(&mut self, empty: bool, f: impl FnOnce(&mut Self) -> CudaResult<()>) {
        if self.error.is_some() || empty {
            return;
        }
        if let Err(e) = f(self) {
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
                let mut xq = self.pool.q8(dev, x.len() / 32)?;
                ops::quantize_q8_1(dev, x.buf()?, &mut xq)?;
                let r = if x.rows == 1 {
                    ops::matvec_q(dev, m, &xq, y.buf_mut()?)
                } else {
                    matmul_q(dev, m, &xq, y.buf_mut()?)
                };
                self.pool.put_q8(xq);
                r
            }
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
        self.run(a.len() == 0, |c| {
            ew::binary(c.dev, a.buf()?, b.buf()?, cols, op, bc, out.buf_mut()?)
        });
        out
    }

    fn weight_binary(&mut self, x: &DevAct, w: WeightId, op: BinaryOp) -> DevAct {
        let mut out = self.alloc(x.rows, x.cols);
        let cols = x.cols;
        self.run(x.len() == 0, |c| {
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

    /// The experts of `w` as the kernels see them.
    fn table(&self, w: WeightId) -> CudaResult<&'a ExpertTable> {
        match self.weights.matrix(w)? {
            GpuWeight::Experts(s) => Ok(s.table()),
            _ => Err(CudaError::Invalid(format!(
                "weight {} is not an expert tensor",
                w.0
            ))),
        }
    }

    /// `y = W[ids[s]]·x_s` for every slot, quantizing `x` first when the experts are quantized.
    fn experts_mul(
        &self,
        table: &ExpertTable,
        ids: &DeviceBuffer<i32>,
        x: &DeviceBuffer<f32>,
        input: ExpertInput,
        y: &mut DeviceBuffer<f32>,
    ) -> CudaResult<()> {
        match ops::activation_form(table.ty) {
            Some(ops::ActivationForm::Q8_1) => {
                let mut xq = self.pool.q8(self.dev, x.len() / 32)?;
                ops::quantize_q8_1(self.dev, x, &mut xq)?;
                let r = ops::matvec_experts_q(self.dev, table, ids, &xq, input, y);
                self.pool.put_q8(xq);
                r
            }
            _ => ops::matvec_experts_f(self.dev, table, ids, x, input, y),
        }
    }

    fn moe_into(&self, x: &DevAct, m: &Moe, out: &mut DevAct) -> CudaResult<()> {
        let dev = self.dev;
        let (n, k) = (x.rows, m.n_expert_used);
        let slots = n * k;
        let (gate_t, up_t, down_t) = (
            self.table(m.gate_exps)?,
            self.table(m.up_exps)?,
            self.table(m.down_exps)?,
        );
        // Router logits [n, n_expert], then ids and weights [n, k] on the card.
        let t_route = self.op_begin();
        let mut logits = self.pool.f32(dev, n * m.n_expert)?;
        {
            let mut la = DevAct {
                rows: n,
                cols: m.n_expert,
                buf: Some(logits),
                pool: self.pool.clone(),
            };
            let r = self.matmul_into(m.router, x, &mut la);
            logits = la
                .buf
                .take()
                .ok_or_else(|| CudaError::Invalid("router".into()))?;
            r?;
        }
        let mut ids = self.pool.i32(dev, slots)?;
        let mut weights = self.pool.f32(dev, slots)?;
        let routing = Routing {
            n_expert: m.n_expert,
            k,
            gating: match m.gating {
                Gating::Softmax => KGating::Softmax,
                Gating::Sigmoid => KGating::Sigmoid,
            },
            norm: m.norm_weights,
            scale: m.weights_scale,
        };
        ops::route_topk(dev, &logits, &routing, &mut ids, &mut weights)?;
        self.pool.put_f32(logits);
        self.op_end("moe route", t_route);
        let grouped = n > 1
            && [gate_t, up_t, down_t]
                .iter()
                .all(|t| prompt::has_matmul_experts(t.ty));
        let r = if grouped {
            self.moe_grouped(x, &ids, &weights, m, out)
        } else {
            self.moe_slots(x, &ids, &weights, m, out)
        };
        self.pool.put_i32(ids);
        self.pool.put_f32(weights);
        r
    }

    /// Groups a prompt's routing (`ids` `[n, k]` on the card) by expert for the grouped kernels: the ids
    /// come to the host (one small wait per layer), are sorted there ([`ExpertGrouping`]) and the sorted
    /// order, the way back and the tile table go to the card. The tile table has a fixed length per shape
    /// (padded with empty tiles) so the pool keeps one buffer for it. The one place that decides which
    /// expert a tile reads: an expert cache can rewrite the table here.
    fn group_experts(
        &self,
        ids: &DeviceBuffer<i32>,
        k: usize,
        n_expert: usize,
        tile_rows: usize,
    ) -> CudaResult<ExpertGroups> {
        let dev = self.dev;
        let host_ids = dev.download(ids)?;
        let g = ExpertGrouping::with_tile(&host_ids, k, n_expert, tile_rows);
        let n_tiles = ExpertGrouping::max_tiles(host_ids.len(), n_expert, tile_rows);
        let mut rows = self.pool.i32(dev, g.rows.len())?;
        dev.write(&g.rows, &mut rows)?;
        let mut slot_row = self.pool.i32(dev, g.slot_row.len())?;
        dev.write(&g.slot_row, &mut slot_row)?;
        let table = g.tile_table(n_tiles);
        let mut tiles = self.pool.i32(dev, table.len())?;
        dev.write(&table, &mut tiles)?;
        Ok(ExpertGroups {
            rows,
            slot_row,
            tiles,
            tile_rows,
        })
    }

    /// The routed experts of a prompt grouped by expert: the rows gathered into expert order and
    /// quantized once, gate and up as grouped matmuls, the activation, down, and the weighted sum back in
    /// token order.
    fn moe_grouped(
        &self,
        x: &DevAct,
        ids: &DeviceBuffer<i32>,
        weights: &DeviceBuffer<f32>,
        m: &Moe,
        out: &mut DevAct,
    ) -> CudaResult<()> {
        let dev = self.dev;
        let (n, n_embd, k) = (x.rows, x.cols, m.n_expert_used);
        let slots = n * k;
        let (gate_t, up_t, down_t) = (
            self.table(m.gate_exps)?,
            self.table(m.up_exps)?,
            self.table(m.down_exps)?,
        );
        let n_ff = gate_t.rows;
        let tile_rows = prompt::expert_tile_rows(dev, gate_t, slots, m.n_expert);
        let g = self.group_experts(ids, k, m.n_expert, tile_rows)?;
        // [slots, n_embd] in expert order, quantized once for gate and up.
        let mut xs = self.pool.f32(dev, slots * n_embd)?;
        gather_rows(dev, x.buf()?, &g.rows, n_embd, &mut xs)?;
        let mut xq = self.pool.q8(dev, slots * n_embd / 32)?;
        ops::quantize_q8_1(dev, &xs, &mut xq)?;
        self.pool.put_f32(xs);
        // [slots, n_ff] each.
        let mut gate = self.pool.f32(dev, slots * n_ff)?;
        let mut up = self.pool.f32(dev, slots * n_ff)?;
        matmul_experts_q(dev, gate_t, &g.tiles, g.tile_rows, &xq, &mut gate)?;
        matmul_experts_q(dev, up_t, &g.tiles, g.tile_rows, &xq, &mut up)?;
        self.pool.put_q8(xq);
        let mut h = self.pool.f32(dev, slots * n_ff)?;
        self.glu(m.act, n_ff, &mut gate, &up, &mut h)?;
        self.pool.put_f32(gate);
        self.pool.put_f32(up);
        let mut hq = self.pool.q8(dev, slots * n_ff / 32)?;
        ops::quantize_q8_1(dev, &h, &mut hq)?;
        self.pool.put_f32(h);
        // [slots, n_embd] in expert order, then summed per token with the routing weights.
        let mut y = self.pool.f32(dev, slots * n_embd)?;
        let down_tile = prompt::expert_tile_rows(dev, down_t, slots, m.n_expert);
        let r = if down_tile == g.tile_rows {
            matmul_experts_q(dev, down_t, &g.tiles, g.tile_rows, &hq, &mut y)
        } else {
            let gd = self.group_experts(ids, k, m.n_expert, down_tile)?;
            let r = matmul_experts_q(dev, down_t, &gd.tiles, gd.tile_rows, &hq, &mut y);
            gd.give_back(&self.pool);
            r
        };
        self.pool.put_q8(hq);
        r?;
        moe_combine_sorted(dev, &y, &g.slot_row, weights, k, false, out.buf_mut()?)?;
        self.pool.put_f32(y);
        g.give_back(&self.pool);
        Ok(())
    }

    /// `h = act(gate) · up` over rows of `width`; `gate` may be overwritten.
    fn glu(
        &self,
        act: Unary,
        width: usize,
        gate: &mut DeviceBuffer<f32>,
        up: &DeviceBuffer<f32>,
        h: &mut DeviceBuffer<f32>,
    ) -> CudaResult<()> {
        let dev = self.dev;
        match act {
            Unary::Silu => ops::swiglu(dev, gate, up, h),
            Unary::Gelu => ops::geglu(dev, gate, up, h),
            f => {
                self.unary_into(gate, f, h)?;
                ew::binary(dev, h, up, width, BinaryOp::Mul, Broadcast::None, gate)?;
                std::mem::swap(h, gate);
                Ok(())
            }
        }
    }

    /// The routed experts slot by slot (one token, or experts the grouped kernels do not take).
    fn moe_slots(
        &self,
        x: &DevAct,
        ids: &DeviceBuffer<i32>,
        weights: &DeviceBuffer<f32>,
        m: &Moe,
        out: &mut DevAct,
    ) -> CudaResult<()> {
        let dev = self.dev;
        let (n, n_embd, k) = (x.rows, x.cols, m.n_expert_used);
        let slots = n * k;
        // One launch's grid has a slot per block row.
        if slots > MAX_SLOTS {
            return Err(CudaError::Invalid(format!(
                "{n} tokens × {k} experts in one call"
            )));
        }
        let (gate_t, up_t, down_t) = (
            self.table(m.gate_exps)?,
            self.table(m.up_exps)?,
            self.table(m.down_exps)?,
        );
        let n_ff = gate_t.rows;
        // Each slot's input: one token's row for all its experts (a single token shares it).
        let (input, x_rep) = if n == 1 {
            (ExpertInput::Shared, None)
        } else {
            let mut rep = self.pool.f32(dev, slots * n_embd)?;
            ew::repeat_heads(dev, x.buf()?, n, n_embd, k, true, &mut rep)?;
            (ExpertInput::PerSlot, Some(rep))
        };
        let x_in = match &x_rep {
            Some(r) => r,
            None => x.buf()?,
        };
        let mut gate = self.pool.f32(dev, slots * n_ff)?;
        let mut up = self.pool.f32(dev, slots * n_ff)?;
        self.experts_mul(gate_t, ids, x_in, input, &mut gate)?;
        self.experts_mul(up_t, ids, x_in, input, &mut up)?;
        if let Some(r) = x_rep {
            self.pool.put_f32(r);
        }
        let mut h = self.pool.f32(dev, slots * n_ff)?;
        self.glu(m.act, n_ff, &mut gate, &up, &mut h)?;
        self.pool.put_f32(gate);
        self.pool.put_f32(up);
        let mut y = self.pool.f32(dev, slots * n_embd)?;
        self.experts_mul(down_t, ids, &h, ExpertInput::PerSlot, &mut y)?;
        ops::moe_combine(dev, &y, weights, k, false, out.buf_mut()?)?;
        self.pool.put_f32(h);
        self.pool.put_f32(y);
        Ok(())
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
        self.run(tokens.is_empty(), |c| {
            // The rows are read from the mapped file and dequantized on the host: one small copy per
            // call, and no dequantization kernel per format.
            let mut rows = vec![0f32; tokens.len() * n_embd];
            for (i, &t) in tokens.iter().enumerate() {
                c.cpu
                    .row_into(table, t as usize, &mut rows[i * n_embd..(i + 1) * n_embd]);
            }
            c.dev.write(&rows, out.buf_mut()?)
        });
        out
    }

    fn matmul(&mut self, w: WeightId, x: &DevAct) -> DevAct {
        let rows = self.out_rows(w);
        let mut y = self.alloc(x.rows, rows);
        let t0 = self.op_begin();
        self.run(x.len() == 0, |c| c.matmul_into(w, x, &mut y));
        self.op_end("matmul", t0);
        y
    }

    fn rms_norm(&mut self, x: &DevAct, weight: Option<WeightId>, eps: f32, group: usize) -> DevAct {
        let mut out = self.alloc(x.rows, x.cols);
        self.run(x.len() == 0, |c| {
            let w = weight.map(|w| c.vector(w)).transpose()?;
            ops::rms_norm(c.dev, x.buf()?, group, w.as_deref(), eps, out.buf_mut()?)
        });
        out
    }

    fn l2_norm(&mut self, x: &DevAct, eps: f32, group: usize) -> DevAct {
        let mut out = self.alloc(x.rows, x.cols);
        self.run(x.len() == 0, |c| {
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
        self.run(x.len() == 0, |c| {
            ew::scale(c.dev, x.buf()?, s, out.buf_mut()?)
        });
        out
    }

    fn unary(&mut self, x: &DevAct, f: Unary) -> DevAct {
        let mut out = self.alloc(x.rows, x.cols);
        self.run(x.len() == 0, |c| c.unary_into(x.buf()?, f, out.buf_mut()?));
        out
    }

    fn cols(&mut self, x: &DevAct, start: usize, len: usize) -> DevAct {
        let mut out = self.alloc(x.rows, len);
        let in_cols = x.cols;
        self.run(x.rows * len == 0, |c| {
            ew::cols(c.dev, x.buf()?, in_cols, start, len, out.buf_mut()?)
        });
        out
    }

    fn head_part(&mut self, x: &DevAct, head: usize, parts: usize, part: usize) -> DevAct {
        let width = x.cols / parts.max(1);
        let mut out = self.alloc(x.rows, width);
        let rows = x.rows;
        self.run(x.len() == 0, |c| {
            ew::head_part(c.dev, x.buf()?, rows, head, parts, part, out.buf_mut()?)
        });
        out
    }

    fn repeat_heads(&mut self, x: &DevAct, head: usize, times: usize, interleave: bool) -> DevAct {
        let mut out = self.alloc(x.rows, x.cols * times);
        let rows = x.rows;
        self.run(x.len() == 0, |c| {
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
        self.run(rows.is_empty() || width == 0, |c| {
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
        self.run(x.len() == 0, |c| {
            let o = out.buf_mut()?;
            ew::scale(c.dev, x.buf()?, 1.0, o)?;
            ops::rope(c.dev, o, c.positions()?, &p)
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
        let t0 = self.op_begin();
        self.run(q.len() == 0, |c| {
            let p = AttnParams {
                n_head: a.n_head,
                n_head_kv: a.n_head_kv,
                head_dim_k: a.head_dim_k,
                head_dim_v: a.head_dim_v,
                scale: a.scale,
                window: a.window,
                softcap: a.softcap,
            };
            let dev = c.dev;
            let positions = c
                .positions
                .as_ref()
                .ok_or_else(|| CudaError::Invalid("the call's positions are gone".into()))?;
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
            ew::kv_store_f16(dev, k.buf()?, kc, pos0 * *k_width)?;
            ew::kv_store_f16(dev, v.buf()?, vc, pos0 * *v_width)?;
            let n_kv = pos0 + n;
            if n > 1 && attention_mma::takes(dev, &p, n) {
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
            let split = if n == 1 {
                AttnSplit::for_occupancy(&p, n, n_kv, ATTN_TARGET_BLOCKS)
            } else {
                AttnSplit::none(n_kv)
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
        self.op_end("attention", t0);
        out
    }

    fn moe(&mut self, _layer: usize, x: &DevAct, m: &Moe) -> DevAct {
        let mut out = self.alloc(x.rows, x.cols);
        let t0 = self.op_begin();
        self.run(x.len() == 0 || m.n_expert_used == 0, |c| {
            c.moe_into(x, m, &mut out)
        });
        self.op_end("moe all", t0);
        out
    }

    fn ssm_conv(&mut self, layer: usize, x: &DevAct, kernel: WeightId) -> DevAct {
        let mut out = self.alloc(x.rows, x.cols);
        let taps = self.cpu.info(kernel).row_len() as usize;
        self.run(x.len() == 0, |c| {
            let w = c.vector(kernel)?;
            let dev = c.dev;
            let Some(DeviceLayer::Recurrent { conv, .. }) = c.seq.layers.get_mut(layer) else {
                return Err(CudaError::Invalid(format!(
                    "ssm_conv on layer {layer}, whose state is not recurrent"
                )));
            };
            recurrent::conv1d_causal(dev, x.buf()?, &w, taps, conv, false, out.buf_mut()?)
        });
        out
    }

    fn gated_delta_net(
        &mut self,
        layer: usize,
        x: DeltaNetInputs<'_, DevAct>,
        net: &DeltaNet,
    ) -> DevAct {
        let mut out = self.alloc(x.v.rows, net.n_v_heads * net.head_v);
        let t0 = self.op_begin();
        self.run(x.v.len() == 0, |c| {
            let dev = c.dev;
            let Some(DeviceLayer::Recurrent { delta, .. }) = c.seq.layers.get_mut(layer) else {
                return Err(CudaError::Invalid(format!(
                    "gated_delta_net on layer {layer}, whose state is not recurrent"
                )));
            };
            let inputs = DeltaInputs {
                q: x.q.buf()?,
                k: x.k.buf()?,
                v: x.v.buf()?,
                gate: x.gate.buf()?,
                beta: x.beta.buf()?,
                // The graph repeats q and k to the value heads.
                n_k_heads: net.n_v_heads,
            };
            let shape = DeltaShape {
                n_heads: net.n_v_heads,
                head_k: net.head_k,
                head_v: net.head_v,
            };
            recurrent::gated_delta_rule(dev, &inputs, shape, delta, out.buf_mut()?)
        });
        self.op_end("delta net", t0);
        out
    }

    fn batch(&self) -> Batch<'_> {
        Batch {
            tokens: self.tokens,
            pos0: self.pos0 as u32,
            logits: self.logits,
        }
    }
}
