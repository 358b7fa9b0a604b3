//! One token's MoE launches fused through launch tickets (`last_block_of` in common.cuh: the block that
//! finishes a piece of work last completes it) against the launches they replace, bit for bit: the router
//! with the choice of experts, gate and up with the quantization of their output, the down experts with the
//! weighted sum of the slots; each run several times and inside a captured graph's replays (the tickets
//! must come back to zero every time). Also the warp-per-token choice of experts on ties and NaN, and the
//! choice with a selection bias (the engine's `--cache-bias`) against the CPU's rule.
//!
//! Runs on the GPU machine; without a CUDA device (CI) each test prints "skipped: no CUDA device" and
//! passes.

#![cfg(feature = "cuda")]

use poly_kernels::cuda::ops::{self, ExpertInput, Routing, SelectionBias, SlotSum, Tickets};
use poly_kernels::cuda::{BlockQ8_1, Device, DeviceBuffer, StackedExperts};
use poly_kernels::ops::topk::{changed_by_bias, route, route_biased, Gating};
use poly_kernels::quant::GgmlType;
use poly_kernels::rng::Rng;

mod common;
use common::{assert_no_failures, device, normals, random_weights};

/// Tickets as the engine holds them (one set for every launch).
const TICKETS: usize = 1 << 14;

fn differing_bits(a: &[f32], b: &[f32]) -> usize {
    if a.len() != b.len() {
        return a.len().max(b.len());
    }
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

fn check_tickets_zero(dev: &Device, tickets: &Tickets, failures: &mut Vec<String>, what: &str) {
    let counts = tickets.counts(dev).unwrap();
    let left = counts.iter().filter(|&&c| c != 0).count();
    if left > 0 {
        failures.push(format!("{what}: {left} tickets left non-zero"));
    }
}

fn routing(n_expert: usize, k: usize, gating: Gating) -> Routing {
    Routing {
        n_expert,
        k,
        gating,
        norm: true,
        scale: 1.0,
    }
}

#[test]
fn router_topk_equals_the_router_then_route_topk() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(11);
    let mut failures = Vec::new();
    let mut tickets = Tickets::new(&dev, TICKETS).unwrap();
    // (router format, experts, k, gating, width, rows in equal pairs): qwen3moe, qwen35moe, a sigmoid
    // router, F16 and BF16; 512 experts (4 a thread of the last block, more logits than a lane loads at
    // once), 62 (keys ranked one at a time); pairs of equal rows, so equal logits (ties go to the lower
    // id).
    for (ty, n_expert, k, gating, cols, paired) in [
        (GgmlType::F32, 128, 8, Gating::Softmax, 2048, false),
        (GgmlType::F32, 256, 8, Gating::Softmax, 2048, false),
        (GgmlType::F32, 64, 6, Gating::Sigmoid, 1024, false),
        (GgmlType::F16, 128, 8, Gating::Softmax, 2048, false),
        (GgmlType::BF16, 60, 4, Gating::Softmax, 512, false),
        (GgmlType::F32, 512, 10, Gating::Softmax, 256, false),
        (GgmlType::F32, 62, 6, Gating::Sigmoid, 256, false),
        (GgmlType::F32, 128, 8, Gating::Softmax, 512, true),
    ] {
        let mut w = random_weights(ty, &mut rng, n_expert * cols);
        if paired {
            let row_bytes = w.len() / n_expert;
            for e in (0..n_expert).step_by(2) {
                let (a, b) = w.split_at_mut((e + 1) * row_bytes);
                b[..row_bytes].copy_from_slice(&a[e * row_bytes..]);
            }
        }
        let router = StackedExperts::upload(&dev, ty, (n_expert, cols, 1), &w).unwrap();
        let r = routing(n_expert, k, gating);
        let zero_ids = dev.zeros::<i32>(1).unwrap();
        for rep in 0..3 {
            let x = dev.upload(&normals(&mut rng, cols)).unwrap();
            let mut logits = dev.zeros::<f32>(n_expert).unwrap();
            let (mut ids, mut weights) = (dev.zeros(k).unwrap(), dev.zeros(k).unwrap());
            ops::matvec_experts_f(
                &dev,
                router.table(),
                &zero_ids,
                &x,
                ExpertInput::Shared,
                &mut logits,
            )
            .unwrap();
            ops::route_topk(&dev, &logits, &r, &mut ids, &mut weights).unwrap();
            let mut f_logits = dev.zeros::<f32>(n_expert).unwrap();
            let (mut f_ids, mut f_weights) = (dev.zeros(k).unwrap(), dev.zeros(k).unwrap());
            ops::router_topk(
                &dev,
                (router.table(), &x),
                &r,
                (&mut f_logits, &mut tickets),
                (&mut f_ids, &mut f_weights),
            )
            .unwrap();
            let what = format!("{ty} {n_expert} experts k {k} {gating:?} rep {rep}");
            let (want_l, got_l) = (
                dev.download(&logits).unwrap(),
                dev.download(&f_logits).unwrap(),
            );
            let (want_i, got_i) = (dev.download(&ids).unwrap(), dev.download(&f_ids).unwrap());
            let (want_w, got_w) = (
                dev.download(&weights).unwrap(),
                dev.download(&f_weights).unwrap(),
            );
            check_tickets_zero(&dev, &tickets, &mut failures, &what);
            if differing_bits(&got_l, &want_l) > 0 {
                failures.push(format!("{what}: logits differ"));
            }
            if got_i != want_i || differing_bits(&got_w, &want_w) > 0 {
                failures.push(format!(
                    "{what}: {got_i:?} {got_w:?} against {want_i:?} {want_w:?}"
                ));
            }
            // And the CPU's choice from the same logits.
            let cpu: Vec<i32> = route(&want_l, gating, k, true, 1.0)
                .iter()
                .map(|p| p.0 as i32)
                .collect();
            if got_i != cpu {
                failures.push(format!("{what}: {got_i:?}, the CPU chose {cpu:?}"));
            }
        }
    }
    assert_no_failures(failures);
}

/// Ties go to the lower id and NaN probabilities sort below every number, over tokens of one launch
/// (several warps a block, a last block with fewer tokens).
#[test]
fn route_topk_breaks_ties_low_and_puts_nan_last() {
    let Some(dev) = device() else { return };
    let (n_expert, k, n_tokens) = (96, 8, 7);
    let mut logits = vec![0.5f32; n_expert * n_tokens];
    // Token 1: two groups of equal logits; token 2: NaN among them; token 3: NaN where the best would be.
    for e in 0..n_expert {
        logits[n_expert + e] = if e % 3 == 0 { 2.0 } else { 1.0 };
    }
    for e in [0, 5, 40, 95] {
        logits[2 * n_expert + e] = f32::NAN;
    }
    logits[3 * n_expert + 17] = f32::NAN;
    logits[3 * n_expert + 60] = 3.0;
    let d_logits = dev.upload(&logits).unwrap();
    let r = routing(n_expert, k, Gating::Sigmoid);
    let mut ids = dev.zeros::<i32>(n_tokens * k).unwrap();
    let mut weights = dev.zeros::<f32>(n_tokens * k).unwrap();
    ops::route_topk(&dev, &d_logits, &r, &mut ids, &mut weights).unwrap();
    let got = dev.download(&ids).unwrap();
    let row = |t: usize| got[t * k..(t + 1) * k].to_vec();
    assert_eq!(
        row(0),
        (0..8).collect::<Vec<i32>>(),
        "all equal: the lowest ids"
    );
    assert_eq!(
        row(1),
        vec![0, 3, 6, 9, 12, 15, 18, 21],
        "the higher group, lowest first"
    );
    assert_eq!(
        row(2),
        vec![1, 2, 3, 4, 6, 7, 8, 9],
        "NaN is never chosen before a number"
    );
    assert_eq!(row(3)[0], 60);
    assert!(!row(3).contains(&17));
    for t in 0..n_tokens {
        let cpu: Vec<i32> = route(
            &logits[t * n_expert..(t + 1) * n_expert],
            Gating::Sigmoid,
            k,
            true,
            1.0,
        )
        .iter()
        .map(|p| p.0 as i32)
        .collect();
        assert_eq!(row(t), cpu, "token {t} against the CPU");
    }
}

/// The gate and up experts of one token, their quantized output, the down experts and their sum, as the
/// engine's one-token path runs them: fused (glu_q8, q_sum) and separate (glu, quantize, down, combine).
struct TokenExperts {
    gate: StackedExperts,
    up: StackedExperts,
    down: StackedExperts,
    n_embd: usize,
    n_ff: usize,
}

impl TokenExperts {
    fn new(
        dev: &Device,
        rng: &mut Rng,
        ty: GgmlType,
        (n_embd, n_ff, n_expert): (usize, usize, usize),
    ) -> Self {
        let up_shape = (n_ff, n_embd, n_expert);
        let make = |rng: &mut Rng, (rows, cols, n): (usize, usize, usize)| {
            let w = random_weights(ty, rng, rows * cols * n);
            StackedExperts::upload(dev, ty, (rows, cols, n), &w).unwrap()
        };
        TokenExperts {
            gate: make(rng, up_shape),
            up: make(rng, up_shape),
            down: make(rng, (n_embd, n_ff, n_expert)),
            n_embd,
            n_ff,
        }
    }
}

/// Buffers of one token's experts.
struct TokenBuffers {
    xq: DeviceBuffer<BlockQ8_1>,
    ids: DeviceBuffer<i32>,
    weights: DeviceBuffer<f32>,
    h: DeviceBuffer<f32>,
    hq: DeviceBuffer<BlockQ8_1>,
    y: DeviceBuffer<f32>,
    out: DeviceBuffer<f32>,
}

impl TokenBuffers {
    fn new(dev: &Device, e: &TokenExperts, k: usize) -> Self {
        TokenBuffers {
            xq: dev.zeros(e.n_embd / 32).unwrap(),
            ids: dev.zeros(k).unwrap(),
            weights: dev.zeros(k).unwrap(),
            h: dev.zeros(k * e.n_ff).unwrap(),
            hq: dev.zeros(k * e.n_ff / 32).unwrap(),
            y: dev.zeros(k * e.n_embd).unwrap(),
            out: dev.zeros(e.n_embd).unwrap(),
        }
    }

    fn fused(&mut self, dev: &Device, e: &TokenExperts, tickets: &mut Tickets, accumulate: bool) {
        let tables = (e.gate.table(), e.up.table());
        ops::matvec_experts_glu_q8(
            dev,
            tables,
            (&self.ids, &self.xq),
            &mut self.h,
            (&mut self.hq, tickets),
        )
        .unwrap();
        let sum = SlotSum {
            weights: &self.weights,
            out: &mut self.out,
            accumulate,
            tickets,
        };
        let input = (&self.ids, &self.hq, ExpertInput::PerSlot);
        ops::matvec_experts_q_sum(dev, e.down.table(), input, &mut self.y, sum).unwrap();
    }

    fn separate(&mut self, dev: &Device, e: &TokenExperts, accumulate: bool) {
        let tables = (e.gate.table(), e.up.table());
        ops::matvec_experts_glu_q(dev, tables, &self.ids, &self.xq, &mut self.h).unwrap();
        ops::quantize_q8_1(dev, &self.h, &mut self.hq).unwrap();
        ops::matvec_experts_q(
            dev,
            e.down.table(),
            &self.ids,
            &self.hq,
            ExpertInput::PerSlot,
            &mut self.y,
        )
        .unwrap();
        let k = self.ids.len();
        ops::moe_combine(dev, &self.y, &self.weights, k, accumulate, &mut self.out).unwrap();
    }

    /// Writes a token's inputs: x (quantized), ids (one of them missing: -1), weights, the old out.
    fn write_inputs(&mut self, dev: &Device, rng: &mut Rng, e: &TokenExperts, n_expert: usize) {
        let x = dev.upload(&normals(rng, e.n_embd)).unwrap();
        ops::quantize_q8_1(dev, &x, &mut self.xq).unwrap();
        let k = self.ids.len();
        let mut ids: Vec<i32> = (0..k)
            .map(|s| ((s * 7 + rng.below(n_expert as u32) as usize) % n_expert) as i32)
            .collect();
        ids[k / 2] = -1;
        dev.write(&ids, &mut self.ids).unwrap();
        let w: Vec<f32> = (0..k).map(|_| rng.f32()).collect();
        dev.write(&w, &mut self.weights).unwrap();
        dev.write(&normals(rng, e.n_embd), &mut self.out).unwrap();
    }

    fn results(&self, dev: &Device) -> (Vec<f32>, Vec<BlockQ8_1>, Vec<f32>, Vec<f32>) {
        (
            dev.download(&self.h).unwrap(),
            dev.download(&self.hq).unwrap(),
            dev.download(&self.y).unwrap(),
            dev.download(&self.out).unwrap(),
        )
    }
}

#[test]
fn token_experts_fused_equal_the_separate_launches() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(23);
    let mut failures = Vec::new();
    let mut tickets = Tickets::new(&dev, TICKETS).unwrap();
    // (format, n_embd, n_ff, experts, k): the qwen3moe and qwen35moe shapes, Q6_K, a k past one warp.
    for (ty, n_embd, n_ff, n_expert, k) in [
        (GgmlType::Q4_K, 2048, 768, 128, 8),
        (GgmlType::Q4_K, 2048, 512, 256, 8),
        (GgmlType::Q6_K, 1024, 256, 32, 4),
        (GgmlType::Q8_0, 512, 128, 64, 40),
    ] {
        if !ops::glu_q8_takes(ty, n_ff, n_embd, k) {
            failures.push(format!(
                "{ty} [{n_ff}, {n_embd}] × {k}: glu_q8 refuses the shape"
            ));
            continue;
        }
        let e = TokenExperts::new(&dev, &mut rng, ty, (n_embd, n_ff, n_expert));
        let mut fused = TokenBuffers::new(&dev, &e, k);
        let mut separate = TokenBuffers::new(&dev, &e, k);
        for (rep, accumulate) in [false, true, false].into_iter().enumerate() {
            let mut inputs_rng = Rng::new(100 + rep as u64);
            fused.write_inputs(&dev, &mut inputs_rng, &e, n_expert);
            let mut inputs_rng = Rng::new(100 + rep as u64);
            separate.write_inputs(&dev, &mut inputs_rng, &e, n_expert);
            fused.fused(&dev, &e, &mut tickets, accumulate);
            separate.separate(&dev, &e, accumulate);
            let (fh, fq, fy, fo) = fused.results(&dev);
            let (sh, sq, sy, so) = separate.results(&dev);
            let what = format!("{ty} [{n_embd}, {n_ff}] k {k} rep {rep} accumulate {accumulate}");
            if differing_bits(&fh, &sh) > 0 || differing_bits(&fy, &sy) > 0 {
                failures.push(format!("{what}: h or y differ"));
            }
            let q_differ = fq.iter().zip(&sq).filter(|(a, b)| a != b).count();
            if q_differ > 0 {
                failures.push(format!(
                    "{what}: {q_differ} of {} quantized blocks differ",
                    sq.len()
                ));
            }
            let o_differ = differing_bits(&fo, &so);
            if o_differ > 0 {
                failures.push(format!("{what}: {o_differ} of {} sums differ", so.len()));
            }
            check_tickets_zero(&dev, &tickets, &mut failures, &what);
        }
    }
    assert_no_failures(failures);
}

/// A captured graph of the fused launches replays on new inputs with the separate launches' values: the
/// tickets the graph holds come back to zero after each replay.
#[test]
fn fused_token_experts_replay_in_a_graph() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(31);
    let (ty, n_embd, n_ff, n_expert, k) = (GgmlType::Q4_K, 2048, 768, 128, 8);
    let e = TokenExperts::new(&dev, &mut rng, ty, (n_embd, n_ff, n_expert));
    let mut tickets = Tickets::new(&dev, TICKETS).unwrap();
    let mut fused = TokenBuffers::new(&dev, &e, k);
    let mut separate = TokenBuffers::new(&dev, &e, k);
    let graph = {
        let (f, t) = (&mut fused, &mut tickets);
        dev.capture(|d| {
            f.fused(d, &e, t, true);
            Ok(())
        })
        .unwrap()
    };
    let mut failures = Vec::new();
    for rep in 0..5 {
        let mut inputs_rng = Rng::new(200 + rep);
        fused.write_inputs(&dev, &mut inputs_rng, &e, n_expert);
        let mut inputs_rng = Rng::new(200 + rep);
        separate.write_inputs(&dev, &mut inputs_rng, &e, n_expert);
        graph.replay().unwrap();
        separate.separate(&dev, &e, true);
        let (_, fq, _, fo) = fused.results(&dev);
        let (_, sq, _, so) = separate.results(&dev);
        if fq != sq || differing_bits(&fo, &so) > 0 {
            failures.push(format!(
                "replay {rep}: the fused graph left the separate launches"
            ));
        }
    }
    check_tickets_zero(&dev, &tickets, &mut failures, "after the replays");
    assert_no_failures(failures);
}

/// A selection bias (`--cache-bias`: F on the experts a cache holds, 0 elsewhere) chooses as the CPU's
/// `route_biased` does — the experts by probability plus bias, their weights the unbiased probabilities,
/// renormalized over the chosen — and the launch says which choices the bias made as the CPU's
/// `changed_by_bias` does; over several tokens of one launch (`route_topk`) and one token of the fused
/// router (`router_topk`), softmax and sigmoid. A zero bias chooses as no bias, bit for bit, and changes
/// nothing; a bias of 1 (above every probability) makes every choice a biased expert while k of them exist.
#[test]
fn a_selection_bias_chooses_as_the_cpu_and_says_what_it_changed() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(23);
    let mut failures = Vec::new();
    let mut tickets = Tickets::new(&dev, TICKETS).unwrap();
    let n_tokens = 9;
    for (n_expert, k, gating, cols) in [
        (128, 8, Gating::Softmax, 512),
        (64, 6, Gating::Sigmoid, 256),
        (256, 8, Gating::Softmax, 256),
    ] {
        let r = routing(n_expert, k, gating);
        // Every third expert "cached".
        let cached: Vec<bool> = (0..n_expert).map(|e| e % 3 == 1).collect();
        for f in [0.0f32, 0.002, 0.02, 0.2, 1.0] {
            let bias: Vec<f32> = cached.iter().map(|&c| if c { f } else { 0.0 }).collect();
            let d_bias = dev.upload(&bias).unwrap();
            // The same vector inside a larger buffer (another router's before it, large values): the
            // launch reads from its offset.
            let mut shared = vec![5.0f32; 7];
            shared.extend(&bias);
            shared.extend([5.0f32; 3]);
            let d_shared = dev.upload(&shared).unwrap();
            let what = format!("{n_expert} experts k {k} {gating:?} bias {f}");
            // route_topk over several tokens, each warp its own token.
            let logits: Vec<f32> = normals(&mut rng, n_tokens * n_expert)
                .iter()
                .map(|v| 2.0 * v)
                .collect();
            let d_logits = dev.upload(&logits).unwrap();
            let mut ids = dev.zeros::<i32>(n_tokens * k).unwrap();
            let mut weights = dev.zeros::<f32>(n_tokens * k).unwrap();
            let mut changed = dev.zeros::<i32>(n_tokens).unwrap();
            let b = SelectionBias {
                bias: &d_shared,
                offset: 7,
                changed: Some(&mut changed),
            };
            ops::route_topk_biased(&dev, &d_logits, &r, Some(b), &mut ids, &mut weights).unwrap();
            let (got_i, got_w, got_c) = (
                dev.download(&ids).unwrap(),
                dev.download(&weights).unwrap(),
                dev.download(&changed).unwrap(),
            );
            for t in 0..n_tokens {
                let l = &logits[t * n_expert..(t + 1) * n_expert];
                let cpu = route_biased(l, gating, Some(&bias), k, true, 1.0);
                let cpu_ids: Vec<i32> = cpu.iter().map(|p| p.0 as i32).collect();
                let row = &got_i[t * k..(t + 1) * k];
                if row != cpu_ids.as_slice() {
                    failures.push(format!("{what} token {t}: {row:?}, the CPU {cpu_ids:?}"));
                    continue;
                }
                for (j, p) in cpu.iter().enumerate() {
                    let w = got_w[t * k + j];
                    if (w - p.1).abs() > 1e-5 * p.1.abs().max(1e-3) {
                        failures.push(format!(
                            "{what} token {t} choice {j}: weight {w}, the CPU {}",
                            p.1
                        ));
                    }
                }
                let want_c = changed_by_bias(l, gating, &bias, k);
                if got_c[t] as u32 != want_c {
                    failures.push(format!(
                        "{what} token {t}: changed {:#b}, the CPU {want_c:#b}",
                        got_c[t]
                    ));
                }
                if f == 1.0 && row.iter().any(|&e| !cached[e as usize]) {
                    failures.push(format!(
                        "{what} token {t}: {row:?} holds an unbiased expert"
                    ));
                }
            }
            if f == 0.0 {
                // No bias at all: the same ids and weights, bit for bit.
                let mut p_ids = dev.zeros::<i32>(n_tokens * k).unwrap();
                let mut p_w = dev.zeros::<f32>(n_tokens * k).unwrap();
                ops::route_topk(&dev, &d_logits, &r, &mut p_ids, &mut p_w).unwrap();
                if dev.download(&p_ids).unwrap() != got_i
                    || differing_bits(&dev.download(&p_w).unwrap(), &got_w) > 0
                {
                    failures.push(format!("{what}: a zero bias chose otherwise than none"));
                }
                if got_c.iter().any(|&c| c != 0) {
                    failures.push(format!("{what}: a zero bias changed {got_c:?}"));
                }
            }
            // The fused router of one token with the same bias: route_topk_biased's choice of its logits.
            let w = random_weights(GgmlType::F32, &mut rng, n_expert * cols);
            let router =
                StackedExperts::upload(&dev, GgmlType::F32, (n_expert, cols, 1), &w).unwrap();
            let x = dev.upload(&normals(&mut rng, cols)).unwrap();
            let mut f_logits = dev.zeros::<f32>(n_expert).unwrap();
            let (mut f_ids, mut f_w) = (dev.zeros::<i32>(k).unwrap(), dev.zeros::<f32>(k).unwrap());
            let mut f_changed = dev.zeros::<i32>(1).unwrap();
            let b = SelectionBias {
                bias: &d_bias,
                offset: 0,
                changed: Some(&mut f_changed),
            };
            ops::router_topk_biased(
                &dev,
                (router.table(), &x),
                &r,
                Some(b),
                (&mut f_logits, &mut tickets),
                (&mut f_ids, &mut f_w),
            )
            .unwrap();
            check_tickets_zero(&dev, &tickets, &mut failures, &what);
            let mut s_ids = dev.zeros::<i32>(k).unwrap();
            let mut s_w = dev.zeros::<f32>(k).unwrap();
            let mut s_changed = dev.zeros::<i32>(1).unwrap();
            let b = SelectionBias {
                bias: &d_shared,
                offset: 7,
                changed: Some(&mut s_changed),
            };
            ops::route_topk_biased(&dev, &f_logits, &r, Some(b), &mut s_ids, &mut s_w).unwrap();
            if dev.download(&f_ids).unwrap() != dev.download(&s_ids).unwrap()
                || differing_bits(&dev.download(&f_w).unwrap(), &dev.download(&s_w).unwrap()) > 0
                || dev.download(&f_changed).unwrap() != dev.download(&s_changed).unwrap()
            {
                failures.push(format!(
                    "{what}: router_topk_biased differs from route_topk_biased"
                ));
            }
        }
    }
    assert_no_failures(failures);
}

/// A biased choice never takes a NaN probability before a number (the CPU puts NaN last), also without
/// `changed`; a k above 32 with `changed` is refused, and so is a vector that runs past its buffer.
#[test]
fn a_selection_bias_keeps_nan_last_and_refuses_k_above_32_with_changed() {
    let Some(dev) = device() else { return };
    let (n_expert, k) = (64, 8);
    let mut logits = vec![0.0f32; n_expert];
    for (e, v) in logits.iter_mut().enumerate() {
        *v = (e as f32 * 0.37).sin();
    }
    for e in [1, 4, 7] {
        logits[e] = f32::NAN;
    }
    // The NaN experts biased too: still last.
    let bias: Vec<f32> = (0..n_expert)
        .map(|e| if e % 3 == 1 { 0.5 } else { 0.0 })
        .collect();
    let d_logits = dev.upload(&logits).unwrap();
    let d_bias = dev.upload(&bias).unwrap();
    let r = routing(n_expert, k, Gating::Sigmoid);
    let mut ids = dev.zeros::<i32>(k).unwrap();
    let mut weights = dev.zeros::<f32>(k).unwrap();
    let b = SelectionBias {
        bias: &d_bias,
        offset: 0,
        changed: None,
    };
    ops::route_topk_biased(&dev, &d_logits, &r, Some(b), &mut ids, &mut weights).unwrap();
    let got = dev.download(&ids).unwrap();
    let cpu: Vec<i32> = route_biased(&logits, Gating::Sigmoid, Some(&bias), k, true, 1.0)
        .iter()
        .map(|p| p.0 as i32)
        .collect();
    assert_eq!(got, cpu, "against the CPU");
    assert!(!got.iter().any(|e| [1, 4, 7].contains(e)), "{got:?}");
    let wide = routing(64, 33, Gating::Sigmoid);
    let mut ids = dev.zeros::<i32>(33).unwrap();
    let mut weights = dev.zeros::<f32>(33).unwrap();
    let mut changed = dev.zeros::<i32>(1).unwrap();
    let b = SelectionBias {
        bias: &d_bias,
        offset: 0,
        changed: Some(&mut changed),
    };
    assert!(
        ops::route_topk_biased(&dev, &d_logits, &wide, Some(b), &mut ids, &mut weights).is_err()
    );
    // A vector that would run past its buffer is refused.
    let mut ids = dev.zeros::<i32>(k).unwrap();
    let mut weights = dev.zeros::<f32>(k).unwrap();
    let b = SelectionBias {
        bias: &d_bias,
        offset: 1,
        changed: None,
    };
    assert!(ops::route_topk_biased(&dev, &d_logits, &r, Some(b), &mut ids, &mut weights).is_err());
}
