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

use poly_engine::cpu::{CpuForward, CpuWeights, Mat};
use poly_kernels::quant::GgmlType;
use poly_engine::gpu::lockstep::{LockstepCall, OpDiff};
use poly_engine::gpu::DeviceChoice;
use poly_engine::Model;
use poly_models::arch::{Forward, ModelGraph};
use poly_models::compute::{
    Attention, Batch, Compute, DeltaNet, DeltaNetInputs, Logits, Moe, Rope, Unary, WeightId,
};
use poly_models::gguf::GgufFile;

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
            println!("-- all rows of 12: {}", rows_line(&call.cpu_logits, &call.gpu_logits, n_vocab));
            println!("  (lockstep logits vs the graph's own run: same path, so should match the test)");
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

/// The CPU backend with the inputs of matmuls over quantized weights and of MoE blocks rounded to q8_1
/// first (32 values share a scale `amax/127`), as the card quantizes activations.
struct Q81Cpu<'a> {
    cpu: CpuForward<'a>,
    weights: &'a CpuWeights,
}

fn round_q8_1(x: &Mat) -> Mat {
    let mut out = x.clone();
    for block in out.data.chunks_mut(32) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        if d == 0.0 {
            continue;
        }
        for v in block.iter_mut() {
            *v = (*v / d).round() * d;
        }
    }
    out
}

impl Compute for Q81Cpu<'_> {
    type Act = Mat;
    fn shape(&self, x: &Mat) -> (usize, usize) {
        self.cpu.shape(x)
    }
    fn embed(&mut self, t: WeightId, tokens: &[u32]) -> Mat {
        self.cpu.embed(t, tokens)
    }
    fn matmul(&mut self, w: WeightId, x: &Mat) -> Mat {
        // F32 and F16 weights are multiplied in floats on both sides; every other type quantizes x.
        let ty = self.weights.info(w).ty;
        if !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            self.cpu.matmul(w, &round_q8_1(x))
        } else {
            self.cpu.matmul(w, x)
        }
    }
    fn rms_norm(&mut self, x: &Mat, w: Option<WeightId>, eps: f32, g: usize) -> Mat {
        self.cpu.rms_norm(x, w, eps, g)
    }
    fn l2_norm(&mut self, x: &Mat, eps: f32, g: usize) -> Mat {
        self.cpu.l2_norm(x, eps, g)
    }
    fn add(&mut self, a: &Mat, b: &Mat) -> Mat {
        self.cpu.add(a, b)
    }
    fn mul(&mut self, a: &Mat, b: &Mat) -> Mat {
        self.cpu.mul(a, b)
    }
    fn add_weight(&mut self, x: &Mat, w: WeightId) -> Mat {
        self.cpu.add_weight(x, w)
    }
    fn mul_weight(&mut self, x: &Mat, w: WeightId) -> Mat {
        self.cpu.mul_weight(x, w)
    }
    fn scale(&mut self, x: &Mat, s: f32) -> Mat {
        self.cpu.scale(x, s)
    }
    fn unary(&mut self, x: &Mat, f: Unary) -> Mat {
        self.cpu.unary(x, f)
    }
    fn cols(&mut self, x: &Mat, s: usize, l: usize) -> Mat {
        self.cpu.cols(x, s, l)
    }
    fn head_part(&mut self, x: &Mat, h: usize, parts: usize, part: usize) -> Mat {
        self.cpu.head_part(x, h, parts, part)
    }
    fn repeat_heads(&mut self, x: &Mat, h: usize, t: usize, i: bool) -> Mat {
        self.cpu.repeat_heads(x, h, t, i)
    }
    fn rows(&mut self, x: &Mat, rows: &[usize]) -> Mat {
        self.cpu.rows(x, rows)
    }
    fn rope(&mut self, x: &Mat, r: &Rope) -> Mat {
        self.cpu.rope(x, r)
    }
    fn attention(&mut self, l: usize, q: &Mat, k: &Mat, v: &Mat, a: &Attention) -> Mat {
        self.cpu.attention(l, q, k, v, a)
    }
    fn moe(&mut self, l: usize, x: &Mat, m: &Moe) -> Mat {
        self.cpu.moe(l, &round_q8_1(x), m)
    }
    fn ssm_conv(&mut self, l: usize, x: &Mat, k: WeightId) -> Mat {
        self.cpu.ssm_conv(l, x, k)
    }
    fn gated_delta_net(&mut self, l: usize, x: DeltaNetInputs<'_, Mat>, n: &DeltaNet) -> Mat {
        self.cpu.gated_delta_net(l, x, n)
    }
    fn batch(&self) -> Batch<'_> {
        self.cpu.batch()
    }
}

fn sensitivity(path: &str) {
    let name = std::path::Path::new(path)
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let file = match GgufFile::open(path) {
        Ok(f) => std::sync::Arc::new(f),
        Err(e) => return println!("{name}: {e:?}"),
    };
    let graph = ModelGraph::from_file(&file).expect("graph");
    let model = Model::from_file(file.clone()).expect("model");
    let weights = CpuWeights::new(file.clone());
    let n_vocab = model.info().n_vocab;
    let p = prompt(n_vocab, 40, 7);
    let rounded = |state: &mut poly_engine::state::SeqState, tokens: &[u32], l: Logits| {
        let out = {
            let mut c = Q81Cpu {
                cpu: CpuForward::new(&weights, state, tokens, l),
                weights: &weights,
            };
            graph.forward(&mut c)
        };
        state.push_tokens(tokens);
        out.data
    };
    println!("==== {name} (sensitivity: CPU vs CPU with q8_1-rounded matmul/MoE inputs)");
    let (mut sa, mut sb) = (model.new_state(256), model.new_state(256));
    let a = model.eval(&mut sa, &p[..12], Logits::All).expect("eval");
    let b = rounded(&mut sb, &p[..12], Logits::All);
    println!("-- all rows of 12: {}", rows_line(&a, &b, n_vocab));
    let (mut sa, mut sb) = (model.new_state(256), model.new_state(256));
    let mut tokens = p.clone();
    for step in 0..9 {
        let a = model.eval(&mut sa, &tokens, Logits::Last).expect("eval");
        let b = rounded(&mut sb, &tokens, Logits::Last);
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
