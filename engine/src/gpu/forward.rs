//! One forward call on the card: [`Compute`] with activations in device buffers.
//!
//! Every operation queues its kernels on the device's compute stream and returns at once; the host waits
//! only for the logits at the end ([`GpuForward::finish`]). An operation that fails records the error
//! and the rest of the call queues nothing more (the trait's operations return activations, not results);
//! `finish` reports it. Activations of no rows (a call that asks for no logits) are kept without a buffer.

use std::rc::Rc;
use std::sync::Arc;

use poly_kernels::cuda::attention::{attention_f16_cache, AttnSplit, KvCacheView};
use poly_kernels::cuda::elementwise::{self as ew, BinaryOp, Broadcast, UnaryFn};
use poly_kernels::cuda::ops::{self, ExpertInput, Routing};
use poly_kernels::cuda::prompt::{
    gather_rows, matmul_experts_q, matmul_q, moe_combine_sorted, ExpertGrouping,
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

use super::expert_cache::ExpertCache;
use super::pool::Pool;
use super::seq::{DeviceLayer, DeviceSeq};
use super::weights::{GpuWeight, GpuWeights};
use crate::cpu::CpuWeights;

/// Blocks the split-K attention aims for on one token (a few per SM of a large card).
const ATTN_TARGET_BLOCKS: usize = 264;
/// Most expert slots (tokens × experts per token) of one expert launch.
const MAX_SLOTS: usize = 65_535;

/// `POLY_MOE_PER_SLOT=1`: a prompt's experts one matrix×vector per (token, expert) slot, as before the
/// grouped path (a diagnosis switch).
fn per_slot_prompts() -> bool {
    static PER_SLOT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PER_SLOT.get_or_init(|| std::env::var_os("POLY_MOE_PER_SLOT").is_some_and(|v| v == "1"))
}

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
            error: None,
            experts: None,
        })
    }

    /// The call with the routed experts found through `cache`.
    pub fn with_expert_cache(mut self, cache: Option<&'a mut ExpertCache>) -> GpuForward<'a> {
        self.experts = cache;
        self
    }

    /// The logits `out` holds, downloaded; or the first error of the call.
    pub fn finish(mut self, out: DevAct) -> CudaResult<Vec<f32>> {
        let result = match self.error.take() {
            Some(e) => Err(e),
            None if out.len() == 0 => self.dev.synchronize().map(|_| Vec::new()),
            None => out.buf().and_then(|b| self.dev.download(b)),
        };
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

    fn moe_into(&mut self, x: &DevAct, m: &Moe, out: &mut DevAct) -> CudaResult<()> {
        let dev = self.dev;
        let (n, n_embd, k) = (x.rows, x.cols, m.n_expert_used);
        let slots = n * k;
        if slots > MAX_SLOTS {
            return Err(CudaError::Invalid(format!(
                "{n} tokens × {k} experts in one call"
            )));
        }
        let cached = self
            .experts
            .as_deref()
            .and_then(|c| c.layer_of(m.gate_exps));
        // Router logits [n, n_expert], then ids and weights [n, k] on the card.
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
        // A prompt's expert products are grouped by expert on the host (quantized experts): one launch
        // per tensor reads each expert's weights once per 8 of its tokens.
        let grouped = n > 1
            && !per_slot_prompts()
            && self
                .expert_tables(m, cached)?
                .iter()
                .all(|t| ops::activation_form(t.ty) == Some(ops::ActivationForm::Q8_1));
        let cache_partial = self.experts.as_deref().is_some_and(|c| !c.holds_all());
        let host_ids = if grouped || (cached.is_some() && cache_partial) {
            Some(dev.download(&ids)?)
        } else {
            None
        };
        // Experts the cache lacks: staged for a prompt, the CPU's share for one token.
        let cpu_share = match (cached, self.experts.as_deref_mut(), &host_ids) {
            (Some(layer), Some(cache), Some(host_ids)) if !cache.holds_all() => {
                let fetch = || Ok((dev.download(x.buf()?)?, dev.download(&weights)?));
                cache.prepare(dev, self.cpu, layer, n, host_ids, fetch)?
            }
            (Some(_), Some(cache), _) => {
                cache.count_all_vram(slots);
                None
            }
            _ => None,
        };
        let card_computes = !cpu_share.as_ref().is_some_and(|s| s.all);
        if let (true, Some(host_ids)) = (grouped, &host_ids) {
            // (A prompt has no CPU share: every expert is on the card.)
            self.experts_grouped(x, m, cached, host_ids, &weights, out)?;
        } else if card_computes {
            let h = self.experts_ffn(x, m, &ids, cached)?;
            let mut y = self.pool.f32(dev, slots * n_embd)?;
            let tables = self.expert_tables(m, cached)?;
            let r = self.experts_mul(tables[2], &ids, &h, ExpertInput::PerSlot, &mut y);
            self.pool.put_f32(h);
            r?;
            // The CPU's experts while the card computes the cached ones; their sum goes first into `out`,
            // the card's adds to it.
            let accumulate = match &cpu_share {
                Some(share) => {
                    let sum = share.compute_for(self.experts.as_deref_mut(), self.cpu, m);
                    dev.write(&sum, out.buf_mut()?)?;
                    true
                }
                None => false,
            };
            ops::moe_combine(dev, &y, &weights, k, accumulate, out.buf_mut()?)?;
            self.pool.put_f32(y);
        } else if let Some(share) = &cpu_share {
            let sum = share.compute_for(self.experts.as_deref_mut(), self.cpu, m);
            dev.write(&sum, out.buf_mut()?)?;
        }
        if let (Some(layer), Some(cache)) = (cached, self.experts.as_deref_mut()) {
            cache.finish_layer(dev, layer)?;
        }
        self.pool.put_i32(ids);
        self.pool.put_f32(weights);
        Ok(())
    }

    /// The MoE block's experts for a prompt (`x` `[n, n_embd]`, quantized experts), grouped by expert:
    /// the (token, expert) rows sorted by expert ([`ExpertGrouping`] of the host's copy of the routing
    /// `ids`), each tensor one `matmul_experts_q` launch over tiles of one expert's rows, the outputs
    /// summed back per token with `weights` into `out`.
    fn experts_grouped(
        &self,
        x: &DevAct,
        m: &Moe,
        cached: Option<usize>,
        ids: &[i32],
        weights: &DeviceBuffer<f32>,
        out: &mut DevAct,
    ) -> CudaResult<()> {
        let dev = self.dev;
        let (n_embd, k) = (x.cols, m.n_expert_used);
        let slots = ids.len();
        let [gate_t, up_t, down_t] = self.expert_tables(m, cached)?;
        let n_ff = gate_t.rows;
        let g = ExpertGrouping::new(ids, k, m.n_expert);
        if g.rows.len() != slots || g.tiles.is_empty() {
            return Err(CudaError::Invalid(
                "a prompt's routing groups no row".into(),
            ));
        }
        let upload = |v: &[i32]| -> CudaResult<DeviceBuffer<i32>> {
            let mut b = self.pool.i32(dev, v.len())?;
            dev.write(v, &mut b)?;
            Ok(b)
        };
        let tiles_flat: Vec<i32> = g.tiles.iter().flatten().copied().collect();
        let rows = upload(&g.rows)?;
        let slot_row = upload(&g.slot_row)?;
        let tiles = upload(&tiles_flat)?;
        // [slots, n_embd] in expert order, quantized once for gate and up.
        let mut xs = self.pool.f32(dev, slots * n_embd)?;
        gather_rows(dev, x.buf()?, &rows, n_embd, &mut xs)?;
        let mut xq = self.pool.q8(dev, slots * n_embd / 32)?;
        ops::quantize_q8_1(dev, &xs, &mut xq)?;
        self.pool.put_f32(xs);
        let mut gate = self.pool.f32(dev, slots * n_ff)?;
        let mut up = self.pool.f32(dev, slots * n_ff)?;
        matmul_experts_q(dev, gate_t, &tiles, &xq, &mut gate)?;
        matmul_experts_q(dev, up_t, &tiles, &xq, &mut up)?;
        self.pool.put_q8(xq);
        let h = self.gated_act(m, gate, up, n_ff)?;
        let mut hq = self.pool.q8(dev, slots * n_ff / 32)?;
        ops::quantize_q8_1(dev, &h, &mut hq)?;
        self.pool.put_f32(h);
        // [slots, n_embd] in expert order.
        let mut y = self.pool.f32(dev, slots * n_embd)?;
        matmul_experts_q(dev, down_t, &tiles, &hq, &mut y)?;
        self.pool.put_q8(hq);
        moe_combine_sorted(dev, &y, &slot_row, weights, k, false, out.buf_mut()?)?;
        self.pool.put_f32(y);
        self.pool.put_i32(rows);
        self.pool.put_i32(slot_row);
        self.pool.put_i32(tiles);
        Ok(())
    }

    /// The gate, up and down expert tables of `m`: the cache's for its layer, else the uploaded tensors'.
    fn expert_tables(&self, m: &Moe, cached: Option<usize>) -> CudaResult<[&ExpertTable; 3]> {
        match (cached, self.experts.as_deref()) {
            (Some(layer), Some(cache)) => {
                let [g, u, d] = cache.tables(layer)?;
                Ok([g, u, d])
            }
            _ => Ok([
                self.table(m.gate_exps)?,
                self.table(m.up_exps)?,
                self.table(m.down_exps)?,
            ]),
        }
    }

    /// `act(gate·x) ⊙ up·x` of every (token, expert) slot of `ids`: `[n·k, n_ff]`.
    fn experts_ffn(
        &self,
        x: &DevAct,
        m: &Moe,
        ids: &DeviceBuffer<i32>,
        cached: Option<usize>,
    ) -> CudaResult<DeviceBuffer<f32>> {
        let dev = self.dev;
        let (n, n_embd, k) = (x.rows, x.cols, m.n_expert_used);
        let slots = n * k;
        let [gate_t, up_t, _] = self.expert_tables(m, cached)?;
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
        self.gated_act(m, gate, up, n_ff)
    }

    /// `act(gate) ⊙ up` (rows of `n_ff`), giving `gate` and `up` back to the pool.
    fn gated_act(
        &self,
        m: &Moe,
        mut gate: DeviceBuffer<f32>,
        up: DeviceBuffer<f32>,
        n_ff: usize,
    ) -> CudaResult<DeviceBuffer<f32>> {
        let dev = self.dev;
        let mut h = self.pool.f32(dev, gate.len())?;
        match m.act {
            Unary::Silu => ops::swiglu(dev, &gate, &up, &mut h)?,
            Unary::Gelu => ops::geglu(dev, &gate, &up, &mut h)?,
            f => {
                self.unary_into(&gate, f, &mut h)?;
                ew::binary(
                    dev,
                    &h,
                    &up,
                    n_ff,
                    BinaryOp::Mul,
                    Broadcast::None,
                    &mut gate,
                )?;
                std::mem::swap(&mut h, &mut gate);
            }
        }
        self.pool.put_f32(gate);
        self.pool.put_f32(up);
        Ok(h)
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
        self.run(x.len() == 0, |c| c.matmul_into(w, x, &mut y));
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
        out
    }

    fn moe(&mut self, _layer: usize, x: &DevAct, m: &Moe) -> DevAct {
        let mut out = self.alloc(x.rows, x.cols);
        self.run(x.len() == 0 || m.n_expert_used == 0, |c| {
            c.moe_into(x, m, &mut out)
        });
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
