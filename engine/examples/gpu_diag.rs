//! Where the GPU backend and the CPU part on the fixtures, and whether it is a bug or the chaos of tiny
//! random 4-bit models (issue 7 §3). Two modes:
//!
//! - `gpu_diag lockstep MODEL...`: the scenarios of tests/gpu_forward.rs (a 40-token prompt then 8 greedy
//!   steps; every row of a 12-token call) run on the CPU and the card side by side
//!   ([`poly_engine::gpu::lockstep`]); prints per call the logits' agreement, per layer the largest
//!   local (one operation on the CPU's inputs) and propagated differences and the MoE routing flips, and
//!   the full operation table of the worst call.
//! - `gpu_diag sensitivity MODEL...` (CPU only): the same scenarios against a CPU run whose matmul and MoE
//!   inputs are first rounded to q8_1 (per 32 values, as the card quantizes activations): how far the CPU
//!   moves from itself under the card's activation rounding alone.
//!
//! Diagnosis only (a few seconds per fixture in release); not a test.

use poly_engine::gpu::lockstep::{LockstepCall, OpDiff};
use poly_engine::gpu::DeviceChoice;
use poly_engine::Model;
use poly_models::compute::Logits;

fn softmax(logits: &[f32]) -> Vec<f64> {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = logits.iter().map(|&l| (l as f64 - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

fn top(p: &[f64], n: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..p.len()).collect();
    idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    idx.truncate(n);
    idx
}

/// tests/gpu_forward.rs's comparison of one row: (top-5 difference, greedy mismatch outside a near tie,
/// near tie, CPU's top-2 gap).
fn compare(cpu: &[f32], gpu: &[f32]) -> (f64, bool, bool, f64) {
    let (pc, pg) = (softmax(cpu), softmax(gpu));
    let tc = top(&pc, 5);
    let d = tc
        .iter()
        .map(|&i| (pc[i] - pg[i]).abs())
        .fold(0.0, f64::max);
    let tg = top(&pg, 1)[0];
    let gap = pc[tc[0]] - pc[tc[1]];
    if tg == tc[0] {
        return (d, false, false, gap);
    }
    let near = gap < 0.05 || pg[tg] - pg[tc[0]] < 0.05;
    (d, !near, near, gap)
}

fn prompt(n_vocab: usize, n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n_vocab as u64) as u32
        })
        .collect()
}

fn rows_line(cpu: &[f32], gpu: &[f32], n_vocab: usize) -> String {
    cpu.chunks(n_vocab)
        .zip(gpu.chunks(n_vocab))
        .enumerate()
        .map(|(r, (c, g))| {
            let (d, bad, near, gap) = compare(c, g);
            let flag = if bad {
                "MISMATCH"
            } else if near {
                "near-tie"
            } else {
                ""
            };
            format!("r{r}: top5 {d:.4} gap {gap:.3} {flag}")
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn op_line(o: &OpDiff) -> String {
    format!(
        "  {:4} L{:<2} {:16} [{}x{}] prop {:.2e} (worst r{} {:.2e}) local {} {}",
        o.index,
        o.layer.map(|l| l.to_string()).unwrap_or("-".into()),
        o.op,
        o.rows,
        o.cols,
        o.propagated,
        o.worst_row.0,
        o.worst_row.1,
        o.local
            .map(|l| format!("{l:.2e}"))
            .unwrap_or("   -    ".into()),
        o.note
    )
}

/// Per layer: the largest local difference (and its op), the largest propagated, and the routing notes
/// that name flips.
fn layer_summary(ops: &[OpDiff]) -> Vec<String> {
    let mut out = Vec::new();
    let layers: Vec<Option<usize>> = {
        let mut v: Vec<Option<usize>> = ops.iter().map(|o| o.layer).collect();
        v.dedup();
        v
    };
    for l in layers {
        let of: Vec<&OpDiff> = ops.iter().filter(|o| o.layer == l).collect();
        let loc = of
            .iter()
            .filter_map(|o| o.local.map(|v| (v, o.op, o.index)))
            .fold((0.0, "", 0), |a, b| if b.0 > a.0 { b } else { a });
        let prop = of.iter().map(|o| o.propagated).fold(0.0, f64::max);
        let last = of.last().map(|o| o.propagated).unwrap_or(0.0);
        out.push(format!(
            "  layer {:?}: max local {:.2e} ({} #{}), max propagated {:.2e}, at its end {:.2e}",
            l, loc.0, loc.1, loc.2, prop, last
        ));
        for o in of.iter().filter(|o| o.op == "moe") {
            out.push(format!("    moe #{}: {}", o.index, o.note));
        }
    }
    out
}

fn lockstep(path: &str) {
    let name = std::path::Path::new(path)
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let mut model = match Model::load(path) {
        Ok(m) => m,
        Err(e) => return println!("{name}: load: {e:?}"),
    };
    if let Err(e) = model.use_device(DeviceChoice::Gpu(0)) {
        return println!("{name}: GPU: {e:?}");
    }
    let n_vocab = model.info().n_vocab;
    let p = prompt(n_vocab, 40, 7);
    println!("==== {name} (lockstep: card vs CPU, op by op)");

    // Every row of a 12-token call.
    let (mut sc, mut sg) = (model.new_state(256), model.new_state(256));
    match model.gpu_lockstep(&mut sc, &mut sg, &p[..12], Logits::All) {
        Ok(call) => {
            println!(
                "-- all rows of 12: {}",
                rows_line(&call.cpu_logits, &call.gpu_logits, n_vocab)
            );
            println!(
                "  (lockstep logits vs the graph's own run: same path, so should match the test)"
            );
            for l in layer_summary(&call.ops) {
                println!("{l}");
            }
            println!("  ops:");
            for o in &call.ops {
                println!("{}", op_line(o));
            }
        }
        Err(e) => println!("-- all rows: {e:?}"),
    }

    // The prompt then 8 greedy steps, the CPU's token fed to both.
    let (mut sc, mut sg) = (model.new_state(256), model.new_state(256));
    let mut calls: Vec<(String, LockstepCall)> = Vec::new();
    let mut tokens = p.clone();
    for step in 0..9 {
        let call = match model.gpu_lockstep(&mut sc, &mut sg, &tokens, Logits::Last) {
            Ok(c) => c,
            Err(e) => return println!("-- decode step {step}: {e:?}"),
        };
        let (d, bad, near, gap) = compare(&call.cpu_logits, &call.gpu_logits);
        let flips: Vec<String> = call
            .ops
            .iter()
            .filter(|o| o.op == "moe" && o.note.contains("r") && o.note.contains("(margin"))
            .map(|o| format!("L{:?}: {}", o.layer, o.note))
            .collect();
        let head = format!(
            "-- decode step {step} ({} tokens): top5 {d:.4} gap {gap:.3}{}{}; logits rel {:.2e}; routing flips: {}",
            tokens.len(),
            if bad { " MISMATCH" } else { "" },
            if near { " near-tie" } else { "" },
            poly_engine::gpu::lockstep::rel_diff(&call.gpu_logits, &call.cpu_logits),
            if flips.is_empty() { "none".to_string() } else { flips.join(" | ") }
        );
        println!("{head}");
        let t = top(&softmax(&call.cpu_logits), 1)[0] as u32;
        tokens = vec![t];
        calls.push((head, call));
    }
    let worst = calls.iter().max_by(|a, b| {
        let da = compare(&a.1.cpu_logits, &a.1.gpu_logits).0;
        let db = compare(&b.1.cpu_logits, &b.1.gpu_logits).0;
        da.total_cmp(&db)
    });
    if let Some((head, call)) = worst {
        println!("  worst decode call: {head}");
        for l in layer_summary(&call.ops) {
            println!("{l}");
        }
        println!("  ops:");
        for o in &call.ops {
            println!("{}", op_line(o));
        }
    }
}

fn sensitivity(path: &str) {
    let name = std::path::Path::new(path)
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let model = match Model::load(path) {
        Ok(m) => m,
        Err(e) => return println!("{name}: {e:?}"),
    };
    let n_vocab = model.info().n_vocab;
    let p = prompt(n_vocab, 40, 7);
    println!("==== {name} (sensitivity: CPU vs CPU with q8_1-rounded matmul/MoE inputs)");
    let (mut sa, mut sb) = (model.new_state(256), model.new_state(256));
    let a = model.eval(&mut sa, &p[..12], Logits::All).expect("eval");
    let b = model
        .eval_q8_1_reference(&mut sb, &p[..12], Logits::All)
        .expect("eval");
    println!("-- all rows of 12: {}", rows_line(&a, &b, n_vocab));
    let (mut sa, mut sb) = (model.new_state(256), model.new_state(256));
    let mut tokens = p.clone();
    for step in 0..9 {
        let a = model.eval(&mut sa, &tokens, Logits::Last).expect("eval");
        let b = model
            .eval_q8_1_reference(&mut sb, &tokens, Logits::Last)
            .expect("eval");
        let (d, bad, near, gap) = compare(&a, &b);
        println!(
            "-- decode step {step}: top5 {d:.4} gap {gap:.3}{}{}",
            if bad { " MISMATCH" } else { "" },
            if near { " near-tie" } else { "" }
        );
        tokens = vec![top(&softmax(&a), 1)[0] as u32];
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: gpu_diag lockstep|sensitivity MODEL...");
        std::process::exit(2);
    }
    for path in &args[2..] {
        match args[1].as_str() {
            "lockstep" => lockstep(path),
            "sensitivity" => sensitivity(path),
            m => {
                eprintln!("unknown mode {m}");
                std::process::exit(2);
            }
        }
    }
}
