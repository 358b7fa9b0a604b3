//! The compound operations of [`Compute`] on the card ([`poly_kernels::cuda::fused`]): the residual add with
//! the norm after it, the per-head norm with the RoPE after it, one token's projections of one input in
//! one launch; Qwen3.5's delta-net pieces (q/k L2 norms on the convolution's columns, the gates, the delta
//! rule reading unrepeated key heads); and, with kernels that already existed, the gated activation
//! (SwiGLU, GeGLU), the convolution with its SiLU and the gated output norm. Each gives the values of the
//! launches it replaces, so only the launch count changes. `--fuse off` runs the primitive sequences
//! instead ([`poly_models::compute::composed`]) and `--fuse no-many,no-norm-rope,...` turns single
//! fusions off ([`Fusion`]), for before/after measurements; so does any shape a fused kernel does not take.

use poly_kernels::cuda::fused::{
    self, RoutedOut, SharedOut, MATVEC_MANY_MAX, NORM_ROPE_MAX_HEAD_DIM,
};
use poly_kernels::cuda::recurrent;
use poly_kernels::cuda::recurrent::DeltaInputs;
use poly_kernels::cuda::{ops, BlockQ8_1, CudaError, CudaResult, DeviceBuffer, DeviceMatrix};
use poly_kernels::ops::recurrent::DeltaShape;
use poly_models::compute::{
    composed, DeltaNet, DeltaNetInputs, Moe, NormAfter, Rope, SharedExpert, Unary, WeightId,
};

use super::moe::MoeLeft;
use super::{rope_params, DevAct, DeviceLayer, GpuForward};
use crate::gpu::weights::GpuWeight;

/// One fused kernel (or kernel standing for an op sequence) of this module, by its `--fuse` name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fusion {
    /// `add_rms_norm`: `add-norm`.
    AddNorm,
    /// `rms_norm_rope`: `norm-rope`.
    NormRope,
    /// `matmul_many`: `many`.
    Many,
    /// `glu`: `glu`.
    Glu,
    /// `ssm_conv_silu`: `conv-silu`.
    ConvSilu,
    /// `rms_norm_gated`: `gated-norm`.
    GatedNorm,
    /// `cols_rms_norm_scale`: `cols-norm`.
    ColsNorm,
    /// `delta_gates`: `gates`.
    Gates,
    /// `gated_delta_net_grouped`: `delta`.
    DeltaGrouped,
    /// `router_topk` (one token's router and its choice of experts): `router-topk`.
    RouterTopk,
    /// `matvec_experts_glu_q8` (one token's gate and up experts quantizing their output for down): `glu-q8`.
    GluQ8,
    /// `matvec_experts_q_sum` (one token's down experts summing the slots): `down-sum`.
    DownSum,
    /// `rms_norm_rope_pair` (a layer's query and key norms with their rotation): `norm-rope-pair`.
    NormRopePair,
    /// `attn_decode_reduce` writing its output quantized for the output projection: `attn-q8`.
    AttnQ8,
    /// `moe_add_rms_norm_q8_1` (one token's expert sum, shared expert, residual add and next norm):
    /// `moe-norm`.
    MoeNorm,
}

impl Fusion {
    const ALL: [Fusion; 15] = [
        Fusion::AddNorm,
        Fusion::NormRope,
        Fusion::Many,
        Fusion::Glu,
        Fusion::ConvSilu,
        Fusion::GatedNorm,
        Fusion::ColsNorm,
        Fusion::Gates,
        Fusion::DeltaGrouped,
        Fusion::RouterTopk,
        Fusion::GluQ8,
        Fusion::DownSum,
        Fusion::NormRopePair,
        Fusion::AttnQ8,
        Fusion::MoeNorm,
    ];

    fn name(self) -> &'static str {
        match self {
            Fusion::AddNorm => "add-norm",
            Fusion::NormRope => "norm-rope",
            Fusion::Many => "many",
            Fusion::Glu => "glu",
            Fusion::ConvSilu => "conv-silu",
            Fusion::GatedNorm => "gated-norm",
            Fusion::ColsNorm => "cols-norm",
            Fusion::Gates => "gates",
            Fusion::DeltaGrouped => "delta",
            Fusion::RouterTopk => "router-topk",
            Fusion::GluQ8 => "glu-q8",
            Fusion::DownSum => "down-sum",
            Fusion::NormRopePair => "norm-rope-pair",
            Fusion::AttnQ8 => "attn-q8",
            Fusion::MoeNorm => "moe-norm",
        }
    }
}

/// Fusions left off unless `--fuse all` turns them on (see [`fusions`]). `delta`: on the H200 (device
/// run 2, 14:20 UTC) gpu_forward's `decode_graph_replays_equal_the_eager_calls_and_follow_switched_sequences`
/// failed once on qwen35moe with every fusion on (two sequences alternating over one decode graph: the
/// second sequence's greedy tokens left the CPU's); in run 3 the same test passed with each single fusion
/// off in turn, so no fusion was shown guilty and the cause is not known. The setting verified whole there
/// (gpu_forward 6/6, witness_gpu as main) is every fusion but this one, which costs nothing measurable
/// (q35 tg128 236.0 against 236.6 t/s); `--fuse all` turns it back on for whoever looks further.
/// `glu-q8` and `down-sum`: correct (kernels/tests/cuda_moe_fused.rs, bit for bit) but slower. On an H100
/// (2026-12-06, BENCHMARKS.md "Launch tickets") each launch's blocks pay a fence and an atomic count before
/// the last one completes the work: under Nsight Compute the gate and up launch took 24.2 µs against
/// 16.1 µs plus 2.7 µs for the quantize it replaces, the down launch 20.6 µs against 13.8 µs plus 3.0 µs
/// for the combine; with every weight in VRAM a token of the qwen3moe shape answered at 229 t/s with both
/// on, 267 t/s with both off.
/// Tried and taken out (2026-12-06, seventh session): `host-points`, a one-graph token's hand-over copies and
/// the host point beside each in one launch that spun on the flag itself. On an H100 it was slower wherever it
/// ran (every routing on the card: qwen3moe 200.1/198.7 → 186.4/184.0 t/s, qwen35moe 187.5/179.7 →
/// 172.1/176.2; at 8 GB qwen35moe 128.5/130.8 → 124.9/121.0) and a qwen3moe token at 8 GB never reached a
/// host point: a stream's wait on a flag costs the card less than a kernel spinning on it.
const DEFAULT_OFF: &[Fusion] = &[Fusion::DeltaGrouped, Fusion::GluQ8, Fusion::DownSum];

/// The fusions `--fuse` leaves on: by default all but [`DEFAULT_OFF`]; `all` every one; `off` none; a
/// comma-separated list of `no-NAME` (names of [`Fusion`]) turns those off, for measuring each one.
fn fusions(setting: Option<&str>) -> [bool; Fusion::ALL.len()] {
    let mut on = Fusion::ALL.map(|f| !DEFAULT_OFF.contains(&f));
    let Some(setting) = setting else { return on };
    for part in setting.split(',').map(str::trim) {
        if part == "off" {
            on = [false; Fusion::ALL.len()];
        } else if part == "all" {
            on = [true; Fusion::ALL.len()];
        } else if let Some(name) = part.strip_prefix("no-") {
            for (i, f) in Fusion::ALL.iter().enumerate() {
                if f.name() == name {
                    on[i] = false;
                }
            }
        }
    }
    on
}

/// Whether `setting` is one [`fusions`] reads whole (`--fuse` refuses others rather than ignore a
/// misspelt name).
pub fn check_fuse_setting(setting: &str) -> Result<(), String> {
    for part in setting.split(',').map(str::trim) {
        let known = part == "off"
            || part == "all"
            || part
                .strip_prefix("no-")
                .is_some_and(|n| Fusion::ALL.iter().any(|f| f.name() == n));
        if !known {
            let names: Vec<&str> = Fusion::ALL.iter().map(|f| f.name()).collect();
            return Err(format!(
                "{part:?}: give off, all, or no-NAME (comma-separated) with NAME one of {}",
                names.join(", ")
            ));
        }
    }
    Ok(())
}

/// Whether fusion `f` runs as its fused kernel (see [`fusions`]).
pub fn fuse_on(f: Fusion) -> bool {
    // Parsed once: this is asked for every launch.
    static ON: std::sync::OnceLock<[bool; Fusion::ALL.len()]> = std::sync::OnceLock::new();
    let on = ON.get_or_init(|| fusions(crate::knobs::forward().fuse.as_deref()));
    Fusion::ALL
        .iter()
        .position(|&g| g == f)
        .is_some_and(|i| on[i])
}

/// Whether the fused norm-and-rotation kernels take `x`'s rows: whole heads of at most
/// [`NORM_ROPE_MAX_HEAD_DIM`] values.
fn norm_rope_fits(x: &DevAct, rope: &Rope) -> bool {
    rope.head_dim > 0
        && rope.head_dim <= NORM_ROPE_MAX_HEAD_DIM
        && x.cols.is_multiple_of(rope.head_dim)
}

impl GpuForward<'_> {
    /// [`poly_models::compute::Compute::add_rms_norm`]: one launch. One token's whole-row norm also
    /// writes its quantized copy for the matrices it feeds (as `rms_norm` does).
    pub(super) fn fused_add_rms_norm(
        &mut self,
        (a, b): (&DevAct, &DevAct),
        weight: Option<WeightId>,
        eps: f32,
        group: usize,
    ) -> (DevAct, DevAct) {
        let fits = a.rows == b.rows && a.cols == b.cols && group > 0;
        if !fuse_on(Fusion::AddNorm) || !fits {
            return composed::add_rms_norm(self, a, b, weight, eps, group);
        }
        let mut sum = self.alloc(a.rows, a.cols);
        let mut out = self.alloc(a.rows, a.cols);
        self.run("add_rms_norm", a.len() == 0, |c| {
            let w = weight.map(|w| c.vector(w)).transpose()?;
            let inputs = (a.buf()?, b.buf()?);
            if a.rows == 1 && group == a.cols && group.is_multiple_of(BlockQ8_1::ELEMS) {
                let out_id = out.id;
                let outs = (sum.buf_mut()?, out.buf_mut()?);
                return c.with_new_q8(out_id, a.len() / BlockQ8_1::ELEMS, |q| {
                    fused::add_rms_norm(c.dev, inputs, group, w.as_deref(), eps, outs, Some(q))
                });
            }
            let outs = (sum.buf_mut()?, out.buf_mut()?);
            fused::add_rms_norm(c.dev, inputs, group, w.as_deref(), eps, outs, None)
        });
        (sum, out)
    }

    /// [`poly_models::compute::Compute::rms_norm_rope`]: one launch.
    pub(super) fn fused_rms_norm_rope(
        &mut self,
        x: &DevAct,
        weight: Option<WeightId>,
        eps: f32,
        rope: &Rope,
    ) -> DevAct {
        if !fuse_on(Fusion::NormRope) || !norm_rope_fits(x, rope) {
            return composed::rms_norm_rope(self, x, weight, eps, rope);
        }
        let mut out = self.alloc(x.rows, x.cols);
        let p = rope_params(rope);
        self.run("rms_norm_rope", x.len() == 0, |c| {
            let w = weight.map(|w| c.vector(w)).transpose()?;
            let f = rope.freq_factors.map(|w| c.vector(w)).transpose()?;
            let o = out.buf_mut()?;
            let (pos, rp) = (c.positions()?, (&p, f.as_deref()));
            fused::rms_norm_rope(c.dev, (x.buf()?, w.as_deref()), eps, pos, rp, o)
        });
        out
    }

    /// [`poly_models::compute::Compute::moe_add_rms_norm`]: for one token whose experts the card computes
    /// whole, the slots' weighted sum, the shared expert's gate and sum, the residual add and the next norm
    /// (with its quantized copy) in one launch after the experts' own; elsewhere the composed sequence.
    pub(super) fn fused_moe_add_rms_norm(
        &mut self,
        layer: usize,
        x: &DevAct,
        (m, shared): (&Moe, Option<&SharedExpert>),
        after: NormAfter<'_, DevAct>,
    ) -> (DevAct, DevAct) {
        let n = x.cols;
        let r = after.residual;
        let fits = x.rows == 1
            && (r.rows, r.cols) == (1, n)
            && after.group == n
            && n.is_multiple_of(BlockQ8_1::ELEMS)
            && m.n_expert_used > 0
            && self.segmented_layer(m).is_none();
        let on = fuse_on(Fusion::MoeNorm) && fuse_on(Fusion::AddNorm);
        if !on || !fits {
            return composed::moe_add_rms_norm(self, layer, x, (m, shared), after);
        }
        let mut routed = self.alloc(1, n);
        let mut left = None;
        self.run("moe", x.len() == 0, |c| {
            left = match c.moe_leaving(x, (m, None), &mut routed, true)? {
                MoeLeft::Slots { y, weights } => Some((y, weights)),
                _ => None,
            };
            Ok(())
        });
        let shared_parts = shared.map(|s| composed::shared_expert_parts(self, x, s));
        let (mut sum, mut out) = (self.alloc(1, n), self.alloc(1, n));
        self.run("add_rms_norm", false, |c| {
            let w = after.weight.map(|w| c.vector(w)).transpose()?;
            let routed_in = match &left {
                Some((y, weights)) => RoutedOut::Slots { y, weights },
                None => RoutedOut::Summed(routed.buf()?),
            };
            let shared_in = match &shared_parts {
                Some((y, gate)) => Some(SharedOut {
                    y: y.buf()?,
                    gate: gate.as_ref().map(|g| g.buf()).transpose()?,
                }),
                None => None,
            };
            let (dev, out_id) = (c.dev, out.id);
            let norm = (r.buf()?, w.as_deref(), after.eps);
            let (s, o) = (sum.buf_mut()?, out.buf_mut()?);
            c.with_new_q8(out_id, n / BlockQ8_1::ELEMS, |q| {
                fused::moe_add_rms_norm(dev, (routed_in, shared_in), norm, (s, o, q))
            })
        });
        if let Some((y, weights)) = left {
            self.pool.put_f32(y);
            self.pool.put_f32(weights);
        }
        (sum, out)
    }

    /// [`poly_models::compute::Compute::rms_norm_rope_pair`]: one launch for both.
    pub(super) fn fused_rms_norm_rope_pair(
        &mut self,
        [q, k]: [&DevAct; 2],
        [q_norm, k_norm]: [Option<WeightId>; 2],
        eps: f32,
        rope: &Rope,
    ) -> [DevAct; 2] {
        let on = fuse_on(Fusion::NormRope) && fuse_on(Fusion::NormRopePair);
        if !on || !norm_rope_fits(q, rope) || !norm_rope_fits(k, rope) || q.rows != k.rows {
            return composed::rms_norm_rope_pair(self, [q, k], [q_norm, k_norm], eps, rope);
        }
        let (mut q_out, mut k_out) = (self.alloc(q.rows, q.cols), self.alloc(k.rows, k.cols));
        let p = rope_params(rope);
        self.run("rms_norm_rope", q.len() == 0 || k.len() == 0, |c| {
            let wq = q_norm.map(|w| c.vector(w)).transpose()?;
            let wk = k_norm.map(|w| c.vector(w)).transpose()?;
            let f = rope.freq_factors.map(|w| c.vector(w)).transpose()?;
            let inputs = [(q.buf()?, wq.as_deref()), (k.buf()?, wk.as_deref())];
            let outs = [q_out.buf_mut()?, k_out.buf_mut()?];
            let (pos, rp) = (c.positions()?, (&p, f.as_deref()));
            fused::rms_norm_rope_pair(c.dev, inputs, eps, pos, rp, outs)
        });
        [q_out, k_out]
    }

    /// [`poly_models::compute::Compute::matmul_many`]: for one token, the quantized matrices of one format
    /// and width in one launch (up to [`MATVEC_MANY_MAX`]), the others one by one; a prompt's one by one.
    pub(super) fn fused_matmul_many<const N: usize>(
        &mut self,
        ws: [WeightId; N],
        x: &DevAct,
    ) -> [DevAct; N] {
        if !fuse_on(Fusion::Many) || x.rows != 1 || N < 2 {
            return composed::matmul_many(self, ws, x);
        }
        let rows = ws.map(|w| self.out_rows(w));
        let mut ys: [DevAct; N] = std::array::from_fn(|i| self.alloc(x.rows, rows[i]));
        self.run("matmul_many", x.len() == 0, |c| {
            let weights = c.weights;
            // Groups of matrices one launch takes (indices into ws, in order); the rest alone.
            let mut groups: Vec<Vec<(usize, &DeviceMatrix)>> = Vec::new();
            let mut alone = Vec::new();
            for (i, &w) in ws.iter().enumerate() {
                match weights.matrix(w)? {
                    GpuWeight::Quant(m) if fused::many_takes(m.ty) => {
                        let same = |g: &&mut Vec<(usize, &DeviceMatrix)>| {
                            g.len() < MATVEC_MANY_MAX
                                && g.first()
                                    .is_some_and(|(_, f)| f.ty == m.ty && f.cols == m.cols)
                        };
                        match groups.iter_mut().find(same) {
                            Some(g) => g.push((i, m)),
                            None => groups.push(vec![(i, m)]),
                        }
                    }
                    _ => alone.push(i),
                }
            }
            for group in &groups {
                if let [(i, _)] = group.as_slice() {
                    alone.push(*i);
                    continue;
                }
                let mats: Vec<&DeviceMatrix> = group.iter().map(|(_, m)| *m).collect();
                let mut outs = ys
                    .iter_mut()
                    .enumerate()
                    .filter(|(i, _)| group.iter().any(|(g, _)| g == i))
                    .map(|(_, y)| y.buf_mut())
                    .collect::<CudaResult<Vec<_>>>()?;
                let dev = c.dev;
                c.with_q8(Some(x.id), x.buf()?, |xq| {
                    fused::matvec_q_many(dev, &mats, xq, &mut outs)
                })?;
            }
            for i in alone {
                c.matmul_into(ws[i], x, &mut ys[i])?;
            }
            Ok(())
        });
        ys
    }

    /// [`poly_models::compute::Compute::glu`]: one launch for SiLU (`swiglu_f32`) and GELU (`geglu_f32`),
    /// the values of the activation's launch then the multiplication.
    pub(super) fn fused_glu(&mut self, gate: &DevAct, up: &DevAct, act: Unary) -> DevAct {
        let fits = gate.rows == up.rows && gate.cols == up.cols;
        if !fuse_on(Fusion::Glu) || !fits || !matches!(act, Unary::Silu | Unary::Gelu) {
            return composed::glu(self, gate, up, act);
        }
        let mut out = self.alloc(gate.rows, gate.cols);
        self.run("glu", gate.len() == 0, |c| {
            let (g, u, o) = (gate.buf()?, up.buf()?, out.buf_mut()?);
            match act {
                Unary::Gelu => ops::geglu(c.dev, g, u, o),
                _ => ops::swiglu(c.dev, g, u, o),
            }
        });
        out
    }

    /// [`poly_models::compute::Compute::ssm_conv_silu`]: the convolution kernel with its SiLU on (the same
    /// expression as the SiLU launch).
    pub(super) fn fused_ssm_conv_silu(
        &mut self,
        layer: usize,
        x: &DevAct,
        kernel: WeightId,
    ) -> DevAct {
        if !fuse_on(Fusion::ConvSilu) {
            return composed::ssm_conv_silu(self, layer, x, kernel);
        }
        self.ssm_conv_with(layer, x, kernel, true)
    }

    /// [`poly_models::compute::Compute::rms_norm_gated`]: `rms_norm_gated` of recurrent.cu, one launch
    /// (blocks of 128 threads: the values of `rms_norm` then SiLU and the product for groups up to 128).
    pub(super) fn fused_rms_norm_gated(
        &mut self,
        x: &DevAct,
        (weight, eps, group): (Option<WeightId>, f32, usize),
        z: &DevAct,
    ) -> DevAct {
        let fits = x.rows == z.rows
            && x.cols == z.cols
            && group > 0
            && x.cols.is_multiple_of(group)
            && weight.is_some_and(|w| self.cpu.info(w).n_elements() == group as u64);
        let (Some(w), true) = (weight, fits && fuse_on(Fusion::GatedNorm)) else {
            return composed::rms_norm_gated(self, x, (weight, eps, group), z);
        };
        let mut out = self.alloc(x.rows, x.cols);
        self.run("rms_norm_gated", x.len() == 0, |c| {
            let wv = c.vector(w)?;
            recurrent::rms_norm_gated(c.dev, x.buf()?, &wv, z.buf()?, eps, out.buf_mut()?)
        });
        out
    }

    /// [`poly_models::compute::Compute::cols_rms_norm_scale`]: one launch.
    pub(super) fn fused_cols_rms_norm_scale(
        &mut self,
        x: &DevAct,
        (start, len): (usize, usize),
        (eps, group): (f32, usize),
        s: f32,
    ) -> DevAct {
        let fits = group > 0 && len.is_multiple_of(group) && start + len <= x.cols;
        if !fuse_on(Fusion::ColsNorm) || !fits {
            return composed::cols_rms_norm_scale(self, x, (start, len), (eps, group), s);
        }
        let mut out = self.alloc(x.rows, len);
        let in_cols = x.cols;
        self.run("cols_rms_norm_scale", x.rows * len == 0, |c| {
            let part = (start, len);
            fused::rms_norm_cols_scale(
                c.dev,
                (x.buf()?, in_cols),
                part,
                (group, eps, s),
                out.buf_mut()?,
            )
        });
        out
    }

    /// [`poly_models::compute::Compute::delta_gates`]: one launch.
    pub(super) fn fused_delta_gates(
        &mut self,
        (beta, alpha): (&DevAct, &DevAct),
        dt_bias: WeightId,
        a: WeightId,
    ) -> (DevAct, DevAct) {
        let fits = beta.rows == alpha.rows && beta.cols == alpha.cols;
        if !fuse_on(Fusion::Gates) || !fits {
            return composed::delta_gates(self, (beta, alpha), dt_bias, a);
        }
        let mut beta_out = self.alloc(beta.rows, beta.cols);
        let mut gate = self.alloc(beta.rows, beta.cols);
        self.run("delta_gates", beta.len() == 0, |c| {
            let (bias, decay) = (c.vector(dt_bias)?, c.vector(a)?);
            let inputs = fused::DeltaGateInputs {
                beta: beta.buf()?,
                alpha: alpha.buf()?,
                dt_bias: &bias,
                a: &decay,
            };
            fused::delta_gates(c.dev, &inputs, beta_out.buf_mut()?, gate.buf_mut()?)
        });
        (beta_out, gate)
    }

    /// [`poly_models::compute::Compute::gated_delta_net_grouped`]: the delta-rule kernel reads key head
    /// `h mod n_k_heads` itself, so q and k are not repeated.
    pub(super) fn fused_gated_delta_net_grouped(
        &mut self,
        layer: usize,
        x: DeltaNetInputs<'_, DevAct>,
        net: &DeltaNet,
        n_k_heads: usize,
    ) -> DevAct {
        let fits = n_k_heads > 0
            && net.n_v_heads.is_multiple_of(n_k_heads)
            && x.q.cols == n_k_heads * net.head_k
            && x.k.cols == n_k_heads * net.head_k;
        if !fuse_on(Fusion::DeltaGrouped) || !fits {
            return composed::gated_delta_net_grouped(self, layer, x, net, n_k_heads);
        }
        self.delta_net_with(layer, x, net, n_k_heads)
    }

    /// [`poly_models::compute::Compute::gated_delta_net`] with q and k of `n_k_heads` heads (the delta-rule
    /// kernel's value head `h` reads key head `h mod n_k_heads`).
    pub(super) fn delta_net_with(
        &mut self,
        layer: usize,
        x: DeltaNetInputs<'_, DevAct>,
        net: &DeltaNet,
        n_k_heads: usize,
    ) -> DevAct {
        let mut out = self.alloc(x.v.rows, net.n_v_heads * net.head_v);
        self.run("gated_delta_net", x.v.len() == 0, |c| {
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
                n_k_heads,
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

    /// [`poly_models::compute::Compute::ssm_conv`], with SiLU on its output when `silu`.
    pub(super) fn ssm_conv_with(
        &mut self,
        layer: usize,
        x: &DevAct,
        kernel: WeightId,
        silu: bool,
    ) -> DevAct {
        let mut out = self.alloc(x.rows, x.cols);
        let taps = self.cpu.info(kernel).row_len() as usize;
        self.run("ssm_conv", x.len() == 0, |c| {
            let w = c.vector(kernel)?;
            let dev = c.dev;
            let Some(DeviceLayer::Recurrent { conv, .. }) = c.seq.layers.get_mut(layer) else {
                return Err(CudaError::Invalid(format!(
                    "ssm_conv on layer {layer}, whose state is not recurrent"
                )));
            };
            recurrent::conv1d_causal(dev, x.buf()?, &w, taps, conv, silu, out.buf_mut()?)
        });
        out
    }

    /// Runs `f` on a new quantized-input buffer of `blocks` blocks and keeps it in the cache as the
    /// quantized copy of activation `id` (the buffer `rms_norm_quantized` keeps).
    pub(super) fn with_new_q8(
        &self,
        id: u64,
        blocks: usize,
        f: impl FnOnce(&mut DeviceBuffer<BlockQ8_1>) -> CudaResult<()>,
    ) -> CudaResult<()> {
        let mut cache = self.q8_cache.borrow_mut();
        if let Some((_, old)) = cache.take() {
            self.pool.put_q8(old);
        }
        let mut q = self.pool.q8(self.dev, blocks)?;
        match f(&mut q) {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poly_fuse_turns_all_or_named_fusions_off() {
        let default = fusions(None);
        for (f, on) in Fusion::ALL.iter().zip(default) {
            assert_eq!(on, !DEFAULT_OFF.contains(f), "{f:?}");
        }
        assert!(fusions(Some("all")).iter().all(|&on| on));
        assert!(fusions(Some("off")).iter().all(|&on| !on));
        let some = fusions(Some("all, no-many, no-norm-rope"));
        for (f, on) in Fusion::ALL.iter().zip(some) {
            assert_eq!(on, !matches!(f, Fusion::Many | Fusion::NormRope), "{f:?}");
        }
        // Unknown names change nothing.
        assert_eq!(fusions(Some("no-such,fast")), default);
    }
}
