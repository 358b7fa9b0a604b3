//! A diagnosis of GPU-vs-CPU differences: one forward call run on the CPU and on the card side by side,
//! operation by operation ([`Lockstep`]), so the first operation where they part is visible.
//!
//! For every operation it records how far the card's activation (computed from the card's own inputs:
//! the errors of the call so far, *propagated*) is from the CPU's, and, for operations that do not change
//! the sequence state, how far the card's result is when it is given the CPU's inputs (*local*: that one
//! operation's own error, e.g. the activation quantization of a matmul). For MoE blocks it also compares
//! the experts each row picks: the CPU's router on the CPU's input against the card's router on the same
//! input (a routing flip from quantization noise alone) and on the card's own input, with the margin
//! between the k-th and the (k+1)-th router logit (a flip at a small margin is chaos, not a bug).
//!
//! Costs a download per operation (a synchronization each): for diagnosis only, never in a product path.

use poly_models::compute::{
    Attention, Batch, Compute, DeltaNet, DeltaNetInputs, FusedMoe, Moe, Rope, Unary, WeightId,
};

use super::forward::{DevAct, GpuForward};
use crate::cpu::{CpuForward, Mat};

/// One operation's comparison.
#[derive(Clone, Debug)]
pub struct OpDiff {
    /// Its order in the call.
    pub index: usize,
    pub op: &'static str,
    /// The layer of the last layer-bound operation (attention, MoE, conv, delta net) seen so far.
    pub layer: Option<usize>,
    pub rows: usize,
    pub cols: usize,
    /// ‖gpu − cpu‖ / ‖cpu‖ over the whole activation, the card on its own inputs.
    pub propagated: f64,
    /// The row with the largest relative difference (propagated), and that difference.
    pub worst_row: (usize, f64),
    /// The same for the card on the CPU's inputs (`None` for operations that change the state).
    pub local: Option<f64>,
    /// MoE routing: rows whose expert sets differ, margins.
    pub note: String,
}

/// One call's result: both sides' logits and each operation's comparison.
pub struct LockstepCall {
    pub cpu_logits: Vec<f32>,
    pub gpu_logits: Vec<f32>,
    pub ops: Vec<OpDiff>,
}

/// ‖a − b‖ / ‖b‖ (0 for two empty activations, 1 for a missing one).
pub fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return 1.0;
    }
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>();
    if den == 0.0 {
        return num.sqrt();
    }
    (num / den).sqrt()
}

fn worst_row(g: &[f32], c: &Mat) -> (usize, f64) {
    if g.len() != c.data.len() || c.cols == 0 {
        return (0, 1.0);
    }
    (0..c.rows)
        .map(|r| {
            let s = r * c.cols..(r + 1) * c.cols;
            (r, rel_diff(&g[s.clone()], &c.data[s]))
        })
        .fold((0, 0.0), |a, b| if b.1 > a.1 { b } else { a })
}

/// The `k` largest of `logits` (ids, ascending) and the margin between the k-th and the (k+1)-th.
fn top_k(logits: &[f32], k: usize) -> (Vec<usize>, f32) {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let margin = match (idx.get(k.wrapping_sub(1)), idx.get(k)) {
        (Some(&a), Some(&b)) => logits[a] - logits[b],
        _ => f32::INFINITY,
    };
    let mut chosen = idx[..k.min(idx.len())].to_vec();
    chosen.sort_unstable();
    (chosen, margin)
}

/// The CPU and the card computing one call together.
pub struct Lockstep<'c, 'a, 'g> {
    cpu: CpuForward<'c>,
    gpu: &'g mut GpuForward<'a>,
    log: Vec<OpDiff>,
    layer: Option<usize>,
}

/// An activation on both sides.
pub struct Pair {
    pub cpu: Mat,
    gpu: DevAct,
}

impl<'c, 'a, 'g> Lockstep<'c, 'a, 'g> {
    pub fn new(cpu: CpuForward<'c>, gpu: &'g mut GpuForward<'a>) -> Self {
        Lockstep {
            cpu,
            gpu,
            log: Vec::new(),
            layer: None,
        }
    }

    /// The card's side of the output, the CPU's, and the comparisons.
    pub fn finish(self, out: Pair) -> (DevAct, Mat, Vec<OpDiff>) {
        (out.gpu, out.cpu, self.log)
    }

    fn up(&mut self, m: &Mat) -> DevAct {
        self.gpu.upload(m.rows, m.cols, &m.data)
    }

    fn record(
        &mut self,
        op: &'static str,
        c: &Mat,
        g: &DevAct,
        local: Option<&DevAct>,
        note: String,
    ) {
        let gd = self.gpu.download_act(g);
        let local = local.map(|l| {
            let ld = self.gpu.download_act(l);
            rel_diff(&ld, &c.data)
        });
        self.log.push(OpDiff {
            index: self.log.len(),
            op,
            layer: self.layer,
            rows: c.rows,
            cols: c.cols,
            propagated: rel_diff(&gd, &c.data),
            worst_row: worst_row(&gd, c),
            local,
            note,
        });
    }

    /// A stateless operation of one input.
    fn one(
        &mut self,
        op: &'static str,
        x: &Pair,
        fc: impl FnOnce(&mut CpuForward<'c>, &Mat) -> Mat,
        fg: impl Fn(&mut GpuForward<'a>, &DevAct) -> DevAct,
    ) -> Pair {
        let c = fc(&mut self.cpu, &x.cpu);
        let g = fg(self.gpu, &x.gpu);
        let xl = self.up(&x.cpu);
        let l = fg(self.gpu, &xl);
        self.record(op, &c, &g, Some(&l), String::new());
        Pair { cpu: c, gpu: g }
    }

    /// A stateless operation of two inputs.
    fn two(
        &mut self,
        op: &'static str,
        a: &Pair,
        b: &Pair,
        fc: impl FnOnce(&mut CpuForward<'c>, &Mat, &Mat) -> Mat,
        fg: impl Fn(&mut GpuForward<'a>, &DevAct, &DevAct) -> DevAct,
    ) -> Pair {
        let c = fc(&mut self.cpu, &a.cpu, &b.cpu);
        let g = fg(self.gpu, &a.gpu, &b.gpu);
        let (al, bl) = (self.up(&a.cpu), self.up(&b.cpu));
        let l = fg(self.gpu, &al, &bl);
        self.record(op, &c, &g, Some(&l), String::new());
        Pair { cpu: c, gpu: g }
    }

    /// Rows whose top-k expert sets differ between the CPU's router logits and the card's, with the
    /// CPU's margins there.
    fn routing_note(&mut self, x: &Pair, xl: &DevAct, m: &Moe) -> String {
        let k = m.n_expert_used;
        let rc = self.cpu.matmul(m.router, &x.cpu);
        let rl = self.gpu.matmul(m.router, xl);
        let rl = self.gpu.download_act(&rl);
        let rp = self.gpu.matmul(m.router, &x.gpu);
        let rp = self.gpu.download_act(&rp);
        if rl.len() != rc.data.len() || rp.len() != rc.data.len() {
            return "routing: no router logits".into();
        }
        let mut min_margin = f32::INFINITY;
        let (mut flips_local, mut flips_prop) = (Vec::new(), Vec::new());
        for r in 0..rc.rows {
            let s = r * rc.cols..(r + 1) * rc.cols;
            let (ec, margin) = top_k(&rc.data[s.clone()], k);
            min_margin = min_margin.min(margin);
            if top_k(&rl[s.clone()], k).0 != ec {
                flips_local.push(format!("r{r}(margin {margin:.2e})"));
            }
            if top_k(&rp[s], k).0 != ec {
                flips_prop.push(format!("r{r}(margin {margin:.2e})"));
            }
        }
        format!(
            "router: rel local {:.2e}; expert sets differ on CPU input: [{}]; on own input: [{}]; \
             smallest CPU k-th margin {min_margin:.2e}",
            rel_diff(&rl, &rc.data),
            flips_local.join(" "),
            flips_prop.join(" ")
        )
    }
}

impl Compute for Lockstep<'_, '_, '_> {
    type Act = Pair;

    fn shape(&self, x: &Pair) -> (usize, usize) {
        (x.cpu.rows, x.cpu.cols)
    }

    fn embed(&mut self, table: WeightId, tokens: &[u32]) -> Pair {
        let c = self.cpu.embed(table, tokens);
        let g = self.gpu.embed(table, tokens);
        self.record("embed", &c, &g, None, String::new());
        Pair { cpu: c, gpu: g }
    }

    fn matmul(&mut self, w: WeightId, x: &Pair) -> Pair {
        self.one("matmul", x, |c, x| c.matmul(w, x), |g, x| g.matmul(w, x))
    }

    fn rms_norm(&mut self, x: &Pair, w: Option<WeightId>, eps: f32, group: usize) -> Pair {
        self.one(
            "rms_norm",
            x,
            |c, x| c.rms_norm(x, w, eps, group),
            |g, x| g.rms_norm(x, w, eps, group),
        )
    }

    fn l2_norm(&mut self, x: &Pair, eps: f32, group: usize) -> Pair {
        self.one(
            "l2_norm",
            x,
            |c, x| c.l2_norm(x, eps, group),
            |g, x| g.l2_norm(x, eps, group),
        )
    }

    fn add(&mut self, a: &Pair, b: &Pair) -> Pair {
        self.two("add", a, b, |c, a, b| c.add(a, b), |g, a, b| g.add(a, b))
    }

    fn mul(&mut self, a: &Pair, b: &Pair) -> Pair {
        self.two("mul", a, b, |c, a, b| c.mul(a, b), |g, a, b| g.mul(a, b))
    }

    fn add_weight(&mut self, x: &Pair, w: WeightId) -> Pair {
        self.one(
            "add_weight",
            x,
            |c, x| c.add_weight(x, w),
            |g, x| g.add_weight(x, w),
        )
    }

    fn mul_weight(&mut self, x: &Pair, w: WeightId) -> Pair {
        self.one(
            "mul_weight",
            x,
            |c, x| c.mul_weight(x, w),
            |g, x| g.mul_weight(x, w),
        )
    }

    fn scale(&mut self, x: &Pair, s: f32) -> Pair {
        self.one("scale", x, |c, x| c.scale(x, s), |g, x| g.scale(x, s))
    }

    fn unary(&mut self, x: &Pair, f: Unary) -> Pair {
        self.one("unary", x, |c, x| c.unary(x, f), |g, x| g.unary(x, f))
    }

    fn cols(&mut self, x: &Pair, start: usize, len: usize) -> Pair {
        self.one(
            "cols",
            x,
            |c, x| c.cols(x, start, len),
            |g, x| g.cols(x, start, len),
        )
    }

    fn head_part(&mut self, x: &Pair, head: usize, parts: usize, part: usize) -> Pair {
        self.one(
            "head_part",
            x,
            |c, x| c.head_part(x, head, parts, part),
            |g, x| g.head_part(x, head, parts, part),
        )
    }

    fn repeat_heads(&mut self, x: &Pair, head: usize, times: usize, interleave: bool) -> Pair {
        self.one(
            "repeat_heads",
            x,
            |c, x| c.repeat_heads(x, head, times, interleave),
            |g, x| g.repeat_heads(x, head, times, interleave),
        )
    }

    fn rows(&mut self, x: &Pair, rows: &[usize]) -> Pair {
        self.one("rows", x, |c, x| c.rows(x, rows), |g, x| g.rows(x, rows))
    }

    fn rope(&mut self, x: &Pair, r: &Rope) -> Pair {
        self.one("rope", x, |c, x| c.rope(x, r), |g, x| g.rope(x, r))
    }

    fn attention(&mut self, layer: usize, q: &Pair, k: &Pair, v: &Pair, a: &Attention) -> Pair {
        self.layer = Some(layer);
        let c = self.cpu.attention(layer, &q.cpu, &k.cpu, &v.cpu, a);
        let g = self.gpu.attention(layer, &q.gpu, &k.gpu, &v.gpu, a);
        self.record("attention", &c, &g, None, String::new());
        Pair { cpu: c, gpu: g }
    }

    fn moe(&mut self, layer: usize, x: &Pair, m: &Moe) -> Pair {
        self.layer = Some(layer);
        let c = self.cpu.moe(layer, &x.cpu, m);
        let g = self.gpu.moe(layer, &x.gpu, m);
        let xl = self.up(&x.cpu);
        let l = self.gpu.moe(layer, &xl, m);
        let note = self.routing_note(x, &xl, m);
        self.record("moe", &c, &g, Some(&l), note);
        Pair { cpu: c, gpu: g }
    }

    fn fused_moe(&mut self, layer: usize, x: &Pair, rx: &Pair, m: &FusedMoe) -> Pair {
        self.layer = Some(layer);
        let c = self.cpu.fused_moe(layer, &x.cpu, &rx.cpu, m);
        let g = self.gpu.fused_moe(layer, &x.gpu, &rx.gpu, m);
        self.record("fused_moe", &c, &g, None, String::new());
        Pair { cpu: c, gpu: g }
    }

    fn ssm_conv(&mut self, layer: usize, x: &Pair, kernel: WeightId) -> Pair {
        self.layer = Some(layer);
        let c = self.cpu.ssm_conv(layer, &x.cpu, kernel);
        let g = self.gpu.ssm_conv(layer, &x.gpu, kernel);
        self.record("ssm_conv", &c, &g, None, String::new());
        Pair { cpu: c, gpu: g }
    }

    fn gated_delta_net(
        &mut self,
        layer: usize,
        x: DeltaNetInputs<'_, Pair>,
        net: &DeltaNet,
    ) -> Pair {
        self.layer = Some(layer);
        let ci = DeltaNetInputs {
            q: &x.q.cpu,
            k: &x.k.cpu,
            v: &x.v.cpu,
            gate: &x.gate.cpu,
            beta: &x.beta.cpu,
        };
        let c = self.cpu.gated_delta_net(layer, ci, net);
        let gi = DeltaNetInputs {
            q: &x.q.gpu,
            k: &x.k.gpu,
            v: &x.v.gpu,
            gate: &x.gate.gpu,
            beta: &x.beta.gpu,
        };
        let g = self.gpu.gated_delta_net(layer, gi, net);
        self.record("gated_delta_net", &c, &g, None, String::new());
        Pair { cpu: c, gpu: g }
    }

    fn batch(&self) -> Batch<'_> {
        self.cpu.batch()
    }
}
