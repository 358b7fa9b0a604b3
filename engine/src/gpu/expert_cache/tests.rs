//! CPU-side tests of the cache's pieces that need a model file but no GPU: the expert layout of the
//! fixtures and the CPU's share of a token's experts against the CPU MoE block.

use std::path::PathBuf;
use std::sync::Arc;

use poly_kernels::ops::topk::{route, Gating as KGating};
use poly_models::compute::{Gating, Moe, Unary};
use poly_models::gguf::GgufFile;

use super::layout::{expert_layers, slot_bytes};
use super::CpuShare;
use crate::cpu::moe::moe_with;
use crate::cpu::{mat_mul_with, Arithmetic, CpuWeights, Mat};

pub(crate) fn fixture(name: &str) -> CpuWeights {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/models")
        .join(name);
    CpuWeights::new(Arc::new(GgufFile::open(&path).expect("fixture")))
}

/// The first MoE block of `w` (a qwen3moe file) as the engine binds it (softmax over the experts, the top
/// four's weights normalized, SiLU), and its width.
pub(crate) fn first_moe(w: &CpuWeights) -> (Moe, usize) {
    let layer = &expert_layers(w).expect("binds")[0];
    let id = |name: &str| {
        let i = w
            .file()
            .tensor_infos()
            .iter()
            .position(|t| t.name == name)
            .expect("tensor");
        poly_models::compute::WeightId(i as u32)
    };
    let m = Moe {
        router: id(&format!("blk.{}.ffn_gate_inp.weight", layer.block)),
        gate_exps: layer.mats[0].weight,
        up_exps: layer.mats[1].weight,
        down_exps: layer.mats[2].weight,
        n_expert: layer.n_expert,
        n_expert_used: 4,
        gating: Gating::Softmax,
        selection_bias: None,
        norm_weights: true,
        weights_scale: 1.0,
        act: Unary::Silu,
    };
    (m, layer.mats[0].cols)
}

#[test]
fn the_fixtures_expert_layers_are_found_and_laid_out_in_slots() {
    let w = fixture("qwen3moe-tiny-q4km.gguf");
    let layers = expert_layers(&w).expect("binds");
    assert!(!layers.is_empty());
    let n_blocks = w
        .file()
        .tensor_infos()
        .iter()
        .filter(|t| t.name.ends_with(".ffn_gate_exps.weight"))
        .count();
    assert_eq!(layers.len(), n_blocks, "one cache layer per MoE block");
    let slot = slot_bytes(&layers);
    for l in &layers {
        assert_eq!(l.n_expert, 16);
        for m in &l.mats {
            assert_eq!(m.bytes * l.n_expert, w.info(m.weight).n_bytes as usize);
            assert_eq!(m.offset % 256, 0);
        }
        assert!(l.mats[0].offset + l.mats[0].bytes <= l.mats[1].offset);
        assert!(l.mats[1].offset + l.mats[1].bytes <= l.mats[2].offset);
        assert!(l.mats[2].offset + l.mats[2].bytes <= slot);
    }
    // qwen35moe: every trunk block and the MTP block, which has routed experts of its own (the shared
    // expert is not routed).
    let q35 = fixture("qwen35moe-tiny-q4k-q8.gguf");
    let blocks: Vec<u32> = expert_layers(&q35)
        .expect("binds")
        .iter()
        .map(|l| l.block)
        .collect();
    let n_blocks = q35
        .file()
        .metadata()
        .arch_u32("block_count")
        .expect("blocks");
    assert_eq!(blocks, (0..n_blocks).collect::<Vec<_>>());
    // A dense model has none.
    assert!(expert_layers(&fixture("gemma3-tiny-q4km.gguf"))
        .expect("binds")
        .is_empty());
}

#[test]
fn the_cpu_share_of_every_routing_is_the_cpu_moe_block() {
    let w = fixture("qwen3moe-tiny-q4km.gguf");
    let (m, n_embd) = first_moe(&w);
    let x: Vec<f32> = (0..n_embd)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
        .collect();
    let xm = Mat::from_vec(1, n_embd, x.clone());
    // All four routings on the CPU: the block's output on the card's rounding of x (routed as the
    // block routes it), bit for bit (same products, same order).
    let xq = crate::gpu::reference::round_q8_1(&xm);
    let whole = moe_with(&w, &xq, &m, Arithmetic::BatchInvariant);
    let logits = mat_mul_with(&w.matrix(m.router), &xq, Arithmetic::BatchInvariant);
    let routes = route(logits.row(0), KGating::Softmax, 4, true, 1.0);
    let all = CpuShare {
        x: x.clone(),
        items: routes.iter().map(|&(e, p)| (e as usize, p)).collect(),
        n_rows: 1,
        rows: Vec::new(),
        all: true,
        fetch_seconds: 0.0,
        pool: None,
    };
    assert_eq!(all.compute(&w, &m), whole.row(0));
    // On the spinning share pool: the same bits.
    let hot = CpuShare {
        pool: Some(std::sync::Arc::new(poly_kernels::hot_pool::HotPool::new(
            3,
            std::time::Duration::from_millis(1),
        ))),
        ..all
    };
    let (sum, beside, seconds) = hot.compute_beside(&w, &m, || 7);
    assert_eq!(sum, whole.row(0));
    assert_eq!(beside, 7);
    assert!(seconds > 0.0);
    // With the caller busy beside it for a while (the workers take every range), and on more threads
    // than ranges of some experts: still the same bits.
    for threads in [2, 4, 8] {
        let hot = CpuShare {
            pool: Some(std::sync::Arc::new(poly_kernels::hot_pool::HotPool::new(
                threads,
                std::time::Duration::from_millis(1),
            ))),
            ..hot.clone()
        };
        let busy = || {
            let since = std::time::Instant::now();
            while since.elapsed() < std::time::Duration::from_millis(2) {
                std::hint::spin_loop();
            }
        };
        assert_eq!(
            hot.compute_beside(&w, &m, busy).0,
            whole.row(0),
            "{threads} threads"
        );
        assert_eq!(
            hot.compute_for(None, &w, &m),
            whole.row(0),
            "{threads} threads"
        );
    }
    // Two on the CPU, two elsewhere: the parts add up to the block (to rounding).
    let part = |r: &[(u32, f32)]| {
        CpuShare {
            x: x.clone(),
            items: r.iter().map(|&(e, p)| (e as usize, p)).collect(),
            n_rows: 1,
            rows: Vec::new(),
            all: false,
            fetch_seconds: 0.0,
            pool: None,
        }
        .compute(&w, &m)
    };
    let (a, b) = (part(&routes[..2]), part(&routes[2..]));
    let scale = whole.row(0).iter().fold(0f32, |s, v| s.max(v.abs()));
    for ((p, q), r) in a.iter().zip(&b).zip(whole.row(0)) {
        assert!(
            (p + q - r).abs() <= 1e-5 * scale.max(1.0),
            "{p} + {q} vs {r}"
        );
    }
    assert!(a.iter().any(|v| *v != 0.0) && b.iter().any(|v| *v != 0.0));
}

#[test]
fn missing_experts_split_so_that_both_sides_finish_together() {
    use super::{split_missing, MissingCosts};
    let costs = |cpu: f64, copy: f64| MissingCosts {
        cpu_overhead: 0.0,
        cpu_per_expert: cpu,
        copy_per_expert: copy,
        copy_latency: 0.0,
    };
    // Equal costs: half each way (the odd one to either side).
    assert_eq!(split_missing(4, &costs(1.0, 1.0)), 2);
    assert!([2, 3].contains(&split_missing(5, &costs(1.0, 1.0))));
    // A CPU three times slower than the copies: three of four copied.
    assert_eq!(split_missing(4, &costs(3.0, 1.0)), 3);
    // Copies far slower (staging through the host, a slow bus): everything on the CPU.
    assert_eq!(split_missing(4, &costs(1.0, 100.0)), 0);
    // A busy CPU: everything copied.
    assert_eq!(split_missing(8, &costs(100.0, 1.0)), 8);
    assert_eq!(split_missing(0, &costs(1.0, 1.0)), 0);
    // The copy latency keeps a single missing expert on the CPU when the two rates are close.
    let with_latency = MissingCosts {
        cpu_overhead: 0.0,
        cpu_per_expert: 60e-6,
        copy_per_expert: 50e-6,
        copy_latency: 20e-6,
    };
    assert_eq!(split_missing(1, &with_latency), 0);
    assert_eq!(split_missing(4, &with_latency), 2);
    // What the H200 host measured: a CPU call costing ~150 µs before its first expert makes copies win
    // until many experts are missing, and then the CPU takes a share.
    let measured = MissingCosts {
        cpu_overhead: 150e-6,
        cpu_per_expert: 40e-6,
        copy_per_expert: 58e-6,
        copy_latency: 20e-6,
    };
    assert_eq!(split_missing(2, &measured), 2);
    // Four: three copied (194 µs) while the CPU computes one (190 µs).
    assert_eq!(split_missing(4, &measured), 3);
    let j = split_missing(8, &measured);
    assert!((4..=5).contains(&j), "{j}");
}

#[test]
fn the_card_wait_line_is_fitted_only_over_varied_copies() {
    // The card's waits at staged flags: 20 µs of host work and 110 µs a copy on demand.
    let mut fit = super::CostFit::default();
    for i in 0..60 {
        let j = [0, 0, 1, 2][i % 4];
        fit.add(j, 20e-6 + 110e-6 * j as f64);
    }
    let (a, b) = fit.fitted_line().expect("a line over varied counts");
    assert!(
        (a - 20e-6).abs() < 1e-9 && (b - 110e-6).abs() < 1e-9,
        "{a} {b}"
    );
    // All samples of one count say nothing of a copy's cost.
    let mut flat = super::CostFit::default();
    for _ in 0..60 {
        flat.add(0, 30e-6);
    }
    assert_eq!(flat.fitted_line(), None);
    // Noise that says a copy saves time is no line either.
    let mut odd = super::CostFit::default();
    for i in 0..60 {
        let j = i % 3;
        odd.add(j, 100e-6 - 10e-6 * j as f64);
    }
    assert_eq!(odd.fitted_line(), None);
}

#[test]
fn the_cpu_cost_line_separates_the_overhead_from_the_per_expert_time() {
    let mut fit = super::CostFit::default();
    assert_eq!(fit.line(), None);
    for i in 0..40 {
        let c = 1 + i % 6;
        fit.add(c, 150e-6 + c as f64 * 40e-6);
    }
    let (a, b) = fit.line().expect("a line");
    assert!(
        (a - 150e-6).abs() < 1e-9 && (b - 40e-6).abs() < 1e-9,
        "{a} {b}"
    );
    // Calls of one size only: the mean per expert.
    let mut one = super::CostFit::default();
    for _ in 0..10 {
        one.add(2, 100e-6);
    }
    let (a, b) = one.line().expect("a line");
    assert_eq!(a, 0.0);
    assert!((b - 50e-6).abs() < 1e-12);
}

#[test]
fn the_measured_skew_is_the_share_of_each_layers_top_tenth() {
    use super::top_tenth_share;
    // Even routing over 20 experts: the top two hold a tenth.
    assert!((top_tenth_share(&[vec![5; 20]]) - 0.1).abs() < 1e-12);
    // One expert of ten takes everything.
    assert_eq!(top_tenth_share(&[vec![0, 0, 7, 0, 0, 0, 0, 0, 0, 0]]), 1.0);
    // Two layers add up: top tenths 9 of 18 and 1 of 2 (rounded up: one of three experts).
    let s = top_tenth_share(&[vec![9, 9, 0, 0, 0, 0, 0, 0, 0, 0], vec![1, 1, 0]]);
    assert!((s - 10.0 / 20.0).abs() < 1e-12);
    assert_eq!(top_tenth_share(&[vec![0; 8]]), 0.0);
}

#[test]
fn a_small_prompts_least_chosen_experts_go_to_the_cpu_until_both_sides_finish_together() {
    use super::prompt_share::{split_prompt, MAX_ROWS};
    use super::MissingCosts;
    let costs = |cpu: f64, copy: f64| MissingCosts {
        cpu_overhead: 0.0,
        cpu_per_expert: cpu,
        copy_per_expert: copy,
        copy_latency: 0.0,
    };
    // Experts 0..8 needed, routed to 1, 1, 1, 1, 2, 2, 3, 9 tokens.
    let needed: Vec<usize> = (0..8).collect();
    let rows = [1, 1, 1, 1, 2, 2, 3, 9];
    // Equal costs per expert and row: the CPU takes the one-row experts first, never one of more than
    // MAX_ROWS rows, and stops where its time passes the copies'.
    let c = split_prompt(&needed, &rows, &costs(1.0, 1.0));
    assert!(c.iter().all(|&e| rows[e] <= MAX_ROWS), "{c:?}");
    assert_eq!(c, vec![0, 1, 2, 3], "4 rows on the CPU beside 4 copies");
    // A slow CPU: nothing; a slow bus: every expert of at most MAX_ROWS rows.
    assert!(split_prompt(&needed, &rows, &costs(100.0, 1.0)).is_empty());
    assert_eq!(
        split_prompt(&needed, &rows, &costs(1.0, 100.0)),
        vec![0, 1, 2, 3, 4, 5]
    );
    assert!(split_prompt(&[], &rows, &costs(1.0, 1.0)).is_empty());
}

#[test]
fn a_prompt_calls_cpu_share_adds_up_to_the_cpu_moe_block_row_by_row() {
    let w = fixture("qwen3moe-tiny-q4km.gguf");
    let (m, n_embd) = first_moe(&w);
    let n_rows = 3;
    let x: Vec<f32> = (0..n_rows * n_embd)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0 + (i / n_embd) as f32 * 0.1)
        .collect();
    let xq = crate::gpu::reference::round_q8_1(&Mat::from_vec(n_rows, n_embd, x.clone()));
    let whole = moe_with(&w, &xq, &m, Arithmetic::BatchInvariant);
    let logits = mat_mul_with(&w.matrix(m.router), &xq, Arithmetic::BatchInvariant);
    // Every routing of the three rows on the CPU, as a prompt call's share.
    let mut rows = Vec::new();
    for r in 0..n_rows {
        for (e, p) in route(logits.row(r), KGating::Softmax, 4, true, 1.0) {
            rows.push((r, e as usize, p));
        }
    }
    let share = CpuShare {
        x,
        items: Vec::new(),
        n_rows,
        rows,
        all: false,
        fetch_seconds: 0.0,
        pool: None,
    };
    let sum = share.compute_rows(&w, &m);
    assert_eq!(sum.len(), n_rows * n_embd);
    for r in 0..n_rows {
        let got = &sum[r * n_embd..(r + 1) * n_embd];
        let want = whole.row(r);
        let scale = want.iter().fold(0f32, |s, v| s.max(v.abs())).max(1.0);
        for (a, b) in got.iter().zip(want) {
            assert!((a - b).abs() <= 1e-5 * scale, "row {r}: {a} vs {b}");
        }
        assert!(got.iter().any(|v| *v != 0.0));
    }
}

#[test]
fn a_cpu_given_nothing_is_probed_now_and_then() {
    let mut probe = super::CpuProbe::default();
    let every = super::CpuProbe::EVERY as usize;
    // All copied for EVERY steps: the last gives one expert to the CPU.
    let chosen: Vec<usize> = (0..every).map(|_| probe.adjust(3, 3)).collect();
    assert!(chosen[..every - 1].iter().all(|&c| c == 3));
    assert_eq!(chosen[every - 1], 2);
    // A step that gave the CPU some starts the count again.
    assert_eq!(probe.adjust(3, 3), 3);
    assert_eq!(probe.adjust(1, 3), 1);
    assert!((0..every - 1).all(|_| probe.adjust(2, 2) == 2));
    assert_eq!(probe.adjust(2, 2), 1);
    // Nothing missing: nothing to probe with.
    assert_eq!(probe.adjust(0, 0), 0);
}
