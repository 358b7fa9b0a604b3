//! Microbenchmarks of the CUDA kernels, for the GPU machine: `cargo test --release -p poly-kernels --test
//! cuda_bench -- --ignored --nocapture --test-threads 1`. Ignored by default (CI has no GPU, and timings
//! mean nothing there). Each case prints microseconds per launch (CUDA events around 50 launches after 5
//! warm-up ones) and the weight bytes moved per second against the card's measured 4.3 TB/s.

#![cfg(feature = "cuda")]

use cudarc::driver::sys::CUevent_flags;
use poly_kernels::cuda::ops::{self, ExpertInput};
use poly_kernels::cuda::prompt;
use poly_kernels::cuda::{BlockQ8_1, CudaError, Device, DeviceMatrix, StackedExperts};
use poly_kernels::quant::GgmlType;
use poly_kernels::rng::Rng;

mod common;
use common::{device, random_weights, I_QUANTS};

/// The H200's measured device memory rate (`shared/device/README.md`).
const CARD_GBPS: f64 = 4300.0;
const WARMUP: usize = 5;
const ITERS: usize = 50;

/// Mean seconds per call of `launch` on the compute stream, by CUDA events.
fn time_launches(dev: &Device, mut launch: impl FnMut()) -> f64 {
    for _ in 0..WARMUP {
        launch();
    }
    let stream = dev.stream();
    let start = stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("event");
    for _ in 0..ITERS {
        launch();
    }
    let end = stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("event");
    end.synchronize().expect("sync");
    start.elapsed_ms(&end).expect("elapsed") as f64 / 1e3 / ITERS as f64
}

fn report(name: &str, seconds: f64, bytes: usize) {
    let gbps = bytes as f64 / seconds / 1e9;
    println!(
        "bench {name}: {:.2} us/launch, {:.1} MB of weights, {gbps:.0} GB/s ({:.0}% of {CARD_GBPS:.0})",
        seconds * 1e6,
        bytes as f64 / 1e6,
        100.0 * gbps / CARD_GBPS
    );
}

/// Several experts of one format in one launch, at the expert shapes of a Qwen3-30B-A3B-like model: one
/// random tensor of `n_expert` experts, one launch measured per set of ids.
fn bench_experts(
    dev: &Device,
    ty: GgmlType,
    (rows, cols, n_expert): (usize, usize, usize),
    input: ExpertInput,
    id_sets: &[&[i32]],
) {
    let mut rng = Rng::new(7);
    let w = random_weights(ty, &mut rng, rows * cols * n_expert);
    let stacked = StackedExperts::upload(dev, ty, (rows, cols, n_expert), &w).expect("upload");
    for ids in id_sets {
        let idsd = dev.upload(ids).expect("ids");
        let n_vec = if input == ExpertInput::Shared {
            1
        } else {
            ids.len()
        };
        let x: Vec<f32> = (0..cols * n_vec).map(|_| rng.normal()).collect();
        let xd = dev.upload(&x).expect("x");
        let mut y = dev.zeros::<f32>(ids.len() * rows).expect("y");
        let secs = if matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            time_launches(dev, || {
                ops::matvec_experts_f(dev, stacked.table(), &idsd, &xd, input, &mut y)
                    .expect("launch")
            })
        } else {
            let mut xq = dev.zeros::<BlockQ8_1>(x.len() / 32).expect("xq");
            ops::quantize_q8_1(dev, &xd, &mut xq).expect("quantize");
            time_launches(dev, || {
                ops::matvec_experts_q(dev, stacked.table(), &idsd, &xq, input, &mut y)
                    .expect("launch")
            })
        };
        dev.synchronize().expect("sync");
        let bytes = ids.len() * w.len() / n_expert;
        report(
            &format!(
                "experts {ty} {rows}x{cols} x{} slots of {n_expert} ({input:?})",
                ids.len()
            ),
            secs,
            bytes,
        );
    }
}

#[test]
#[ignore = "benchmark for the GPU machine"]
fn bench_expert_matvec() {
    let Some(dev) = device() else { return };
    println!(
        "device: {} ({}), {:.1} GiB",
        dev.name(),
        dev.arch(),
        dev.total_memory() as f64 / (1u64 << 30) as f64
    );
    let all: Vec<i32> = (0..128).collect();
    // Decode: 8 of 128 experts, chosen like a router would (distinct, spread).
    let eight: Vec<i32> = vec![3, 17, 29, 64, 77, 90, 101, 126];
    // Gate/up: [2048 → 768], down: [768 → 2048], per expert.
    let gate = (768, 2048);
    let down = (2048, 768);
    let q4k = GgmlType::Q4_K;
    bench_experts(
        &dev,
        q4k,
        (gate.0, gate.1, 128),
        ExpertInput::Shared,
        &[&all, &eight],
    );
    bench_experts(
        &dev,
        q4k,
        (down.0, down.1, 128),
        ExpertInput::PerSlot,
        &[&all, &eight],
    );
    // Other formats over 32 experts (tens of MB per launch, enough to see the bandwidth; generating 128
    // experts' random weights of each would dominate the run).
    let some: Vec<i32> = (0..32).collect();
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_XS,
        GgmlType::Q3_K,
        GgmlType::BF16,
    ] {
        bench_experts(
            &dev,
            ty,
            (gate.0, gate.1, 32),
            ExpertInput::Shared,
            &[&some],
        );
        bench_experts(
            &dev,
            ty,
            (down.0, down.1, 32),
            ExpertInput::PerSlot,
            &[&some],
        );
    }
}

#[test]
#[ignore = "benchmark for the GPU machine"]
fn bench_dense_matvec() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(8);
    // Attention-like 4096×2048, and an output head 151936×2048 (Q6_K, as Q4_K_M files store it).
    for (ty, rows, cols) in [
        (GgmlType::Q4_K, 4096, 2048),
        (GgmlType::Q8_0, 4096, 2048),
        (GgmlType::F16, 4096, 2048),
        (GgmlType::F32, 4096, 2048),
        (GgmlType::Q6_K, 151_936, 2048),
    ] {
        let w = random_weights(ty, &mut rng, rows * cols);
        let wd = DeviceMatrix::upload(&dev, ty, rows, cols, &w).expect("upload");
        let x: Vec<f32> = (0..cols).map(|_| rng.normal()).collect();
        let xd = dev.upload(&x).expect("x");
        let mut xq = dev.zeros::<BlockQ8_1>(cols / 32).expect("xq");
        ops::quantize_q8_1(&dev, &xd, &mut xq).expect("quantize");
        let mut y = dev.zeros::<f32>(rows).expect("y");
        let secs = if matches!(ty, GgmlType::F32 | GgmlType::F16) {
            time_launches(&dev, || {
                ops::matvec_f(&dev, &wd, &xd, &mut y).expect("launch")
            })
        } else {
            time_launches(&dev, || {
                ops::matvec_q(&dev, &wd, &xq, &mut y).expect("launch")
            })
        };
        report(&format!("matvec {ty} {rows}x{cols}"), secs, w.len());
    }
}

#[test]
#[ignore = "benchmark for the GPU machine"]
fn bench_small_ops() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(9);
    let x: Vec<f32> = (0..2048).map(|_| rng.normal()).collect();
    let xd = dev.upload(&x).expect("x");
    let wd = dev.upload(&x).expect("w");
    let mut out = dev.zeros::<f32>(2048).expect("out");
    let secs = time_launches(&dev, || {
        ops::rms_norm(&dev, &xd, 2048, Some(&wd), 1e-6, &mut out).expect("launch")
    });
    println!(
        "bench rms_norm 2048: {:.2} us/launch (launch-bound)",
        secs * 1e6
    );
    let mut xq = dev.zeros::<BlockQ8_1>(64).expect("xq");
    let secs = time_launches(&dev, || {
        ops::quantize_q8_1(&dev, &xd, &mut xq).expect("launch")
    });
    println!("bench quantize_q8_1 2048: {:.2} us/launch", secs * 1e6);
    let logits: Vec<f32> = (0..128).map(|_| rng.normal()).collect();
    let ld = dev.upload(&logits).expect("logits");
    let mut ids = dev.zeros::<i32>(8).expect("ids");
    let mut weights = dev.zeros::<f32>(8).expect("w");
    let r = ops::Routing {
        n_expert: 128,
        k: 8,
        gating: poly_kernels::ops::topk::Gating::Softmax,
        norm: true,
        scale: 1.0,
    };
    let secs = time_launches(&dev, || {
        ops::route_topk(&dev, &ld, &r, &mut ids, &mut weights).expect("launch")
    });
    println!(
        "bench route_topk 128 experts k 8: {:.2} us/launch",
        secs * 1e6
    );
    for load in dev.module_log() {
        println!(
            "module {}: {:?} ({})",
            load.module.name(),
            load.origin,
            load.arch
        );
    }
}

/// One token's gate and up experts at Qwen3-30B-A3B's shapes (8 experts of [768, 2048] Q4_K each),
/// up to the down experts' quantized input: two expert launches and the SwiGLU-quantize (the old path)
/// against the fused gate-up launch and a quantize. The calls rotate over 8 sets of 8 of 64 experts (113 MB
/// in all, twice the L2), so the weights come mostly from memory.
#[test]
#[ignore = "benchmark for the GPU machine"]
fn bench_fused_gate_up() {
    let Some(dev) = device() else { return };
    let (ty, n_embd, n_ff, n_expert, k) = (GgmlType::Q4_K, 2048, 768, 64, 8);
    let mut rng = Rng::new(11);
    let gate_w = random_weights(ty, &mut rng, n_ff * n_embd * n_expert);
    let up_w = random_weights(ty, &mut rng, n_ff * n_embd * n_expert);
    let gate = StackedExperts::upload(&dev, ty, (n_ff, n_embd, n_expert), &gate_w).expect("gate");
    let up = StackedExperts::upload(&dev, ty, (n_ff, n_embd, n_expert), &up_w).expect("up");
    let id_sets: Vec<_> = (0..8)
        .map(|s| {
            let ids: Vec<i32> = (0..k as i32).map(|i| s * 8 + i).collect();
            dev.upload(&ids).expect("ids")
        })
        .collect();
    let x: Vec<f32> = (0..n_embd).map(|_| rng.normal()).collect();
    let xd = dev.upload(&x).expect("x");
    let mut xq = dev.zeros::<BlockQ8_1>(n_embd / 32).expect("xq");
    ops::quantize_q8_1(&dev, &xd, &mut xq).expect("quantize");
    let mut g = dev.zeros::<f32>(k * n_ff).expect("g");
    let mut u = dev.zeros::<f32>(k * n_ff).expect("u");
    let mut h = dev.zeros::<f32>(k * n_ff).expect("h");
    let mut hq = dev.zeros::<BlockQ8_1>(k * n_ff / 32).expect("hq");
    let bytes = 2 * k * gate_w.len() / n_expert;
    let shared = ExpertInput::Shared;
    let mut set = 0;
    let separate = time_launches(&dev, || {
        let ids = &id_sets[set % 8];
        set += 1;
        ops::matvec_experts_q(&dev, gate.table(), ids, &xq, shared, &mut g).expect("gate");
        ops::matvec_experts_q(&dev, up.table(), ids, &xq, shared, &mut u).expect("up");
        ops::swiglu_quantize_q8_1(&dev, &g, &u, &mut hq).expect("swiglu");
    });
    report("gate+up separate (3 launches)", separate, bytes);
    let fused = time_launches(&dev, || {
        let ids = &id_sets[set % 8];
        set += 1;
        ops::matvec_experts_glu_q(&dev, (gate.table(), up.table()), ids, &xq, &mut h).expect("glu");
        ops::quantize_q8_1(&dev, &h, &mut hq).expect("quantize");
    });
    report("gate+up fused (2 launches)", fused, bytes);
    let glu_only = time_launches(&dev, || {
        let ids = &id_sets[set % 8];
        set += 1;
        ops::matvec_experts_glu_q(&dev, (gate.table(), up.table()), ids, &xq, &mut h).expect("glu");
    });
    report("gate+up fused launch alone", glu_only, bytes);
    // The same calls replayed from graphs (the device's time without the host's launch cost).
    let mut graph_of = |fused: bool| {
        dev.capture(|dv| {
            for ids in id_sets.iter().cycle().take(ITERS) {
                if fused {
                    ops::matvec_experts_glu_q(dv, (gate.table(), up.table()), ids, &xq, &mut h)?;
                    ops::quantize_q8_1(dv, &h, &mut hq)?;
                } else {
                    ops::matvec_experts_q(dv, gate.table(), ids, &xq, shared, &mut g)?;
                    ops::matvec_experts_q(dv, up.table(), ids, &xq, shared, &mut u)?;
                    ops::swiglu_quantize_q8_1(dv, &g, &u, &mut hq)?;
                }
            }
            Ok(())
        })
        .expect("capture")
    };
    for (fused, name) in [(false, "separate"), (true, "fused")] {
        let graph = graph_of(fused);
        let secs = time_launches(&dev, || graph.replay().expect("replay")) / ITERS as f64;
        report(&format!("gate+up {name}, graph"), secs, bytes);
    }
}

/// One decode step of a MoE FFN at Qwen3-30B-A3B's shapes (2048 wide, 128 experts of 768, 8 chosen, Q4_K):
/// quantize, route, gate and up experts, SwiGLU, quantize the 8 vectors, down experts, weighted sum into
/// the residual: 8 launches, eagerly and as a replayed graph. Bytes: the 8 experts' three matrices.
#[test]
#[ignore = "benchmark for the GPU machine"]
fn bench_moe_step_eager_and_graph() {
    let Some(dev) = device() else { return };
    let (ty, n_embd, n_ff, n_expert, k) = (GgmlType::Q4_K, 2048, 768, 128, 8);
    let mut rng = Rng::new(10);
    let gate_w = random_weights(ty, &mut rng, n_ff * n_embd * n_expert);
    let up_w = random_weights(ty, &mut rng, n_ff * n_embd * n_expert);
    let down_w = random_weights(ty, &mut rng, n_embd * n_ff * n_expert);
    let gate = StackedExperts::upload(&dev, ty, (n_ff, n_embd, n_expert), &gate_w).expect("gate");
    let up = StackedExperts::upload(&dev, ty, (n_ff, n_embd, n_expert), &up_w).expect("up");
    let down = StackedExperts::upload(&dev, ty, (n_embd, n_ff, n_expert), &down_w).expect("down");
    let r = ops::Routing {
        n_expert,
        k,
        gating: poly_kernels::ops::topk::Gating::Softmax,
        norm: true,
        scale: 1.0,
    };
    let x: Vec<f32> = (0..n_embd).map(|_| rng.normal()).collect();
    let logits: Vec<f32> = (0..n_expert).map(|_| rng.normal()).collect();
    let xd = dev.upload(&x).expect("x");
    let ld = dev.upload(&logits).expect("logits");
    let mut xq = dev.zeros::<BlockQ8_1>(n_embd / 32).expect("xq");
    let mut ids = dev.zeros::<i32>(k).expect("ids");
    let mut weights = dev.zeros::<f32>(k).expect("weights");
    let mut g = dev.zeros::<f32>(k * n_ff).expect("g");
    let mut u = dev.zeros::<f32>(k * n_ff).expect("u");
    let mut h = dev.zeros::<f32>(k * n_ff).expect("h");
    let mut hq = dev.zeros::<BlockQ8_1>(k * n_ff / 32).expect("hq");
    let mut d = dev.zeros::<f32>(k * n_embd).expect("d");
    let mut residual = dev.zeros::<f32>(n_embd).expect("residual");
    let mut step = |dv: &Device| -> Result<(), CudaError> {
        ops::quantize_q8_1(dv, &xd, &mut xq)?;
        ops::route_topk(dv, &ld, &r, &mut ids, &mut weights)?;
        ops::matvec_experts_q(dv, gate.table(), &ids, &xq, ExpertInput::Shared, &mut g)?;
        ops::matvec_experts_q(dv, up.table(), &ids, &xq, ExpertInput::Shared, &mut u)?;
        ops::swiglu(dv, &g, &u, &mut h)?;
        ops::quantize_q8_1(dv, &h, &mut hq)?;
        ops::matvec_experts_q(dv, down.table(), &ids, &hq, ExpertInput::PerSlot, &mut d)?;
        ops::moe_combine(dv, &d, &weights, k, true, &mut residual)
    };
    let bytes = 3 * k * gate_w.len() / n_expert;
    let eager = time_launches(&dev, || step(&dev).expect("step"));
    report("moe step eager (8 launches)", eager, bytes);
    let graph = dev.capture(|dv| step(dv)).expect("capture");
    let replayed = time_launches(&dev, || graph.replay().expect("replay"));
    report("moe step graph (8 launches)", replayed, bytes);
    println!(
        "bench moe step: x48 layers = {:.0} us eager, {:.0} us graph per token for the routed experts alone",
        eager * 48e6,
        replayed * 48e6
    );
}

/// One token's routed experts at Qwen3-30B-A3B's shapes from the router on (F32 router of 128 × 2048, 8 of
/// 128 experts of [768, 2048] Q4_K, 8 input vectors in turn so the chosen experts change): the engine's
/// separate launches (router, route_topk, gate+up, quantize, down, combine: 6) against the ticket-fused
/// ones (router_topk, gate+up quantizing, down summing: 3), each as a replayed graph of 8 steps.
#[test]
#[ignore = "benchmark for the GPU machine"]
fn bench_moe_token_fused() {
    let Some(dev) = device() else { return };
    let (ty, n_embd, n_ff, n_expert, k) = (GgmlType::Q4_K, 2048, 768, 128, 8);
    let mut rng = Rng::new(12);
    let make = |rng: &mut Rng, t: GgmlType, (rows, cols, n): (usize, usize, usize)| {
        let w = random_weights(t, rng, rows * cols * n);
        StackedExperts::upload(&dev, t, (rows, cols, n), &w).expect("upload")
    };
    let router = make(&mut rng, GgmlType::F32, (n_expert, n_embd, 1));
    let gate = make(&mut rng, ty, (n_ff, n_embd, n_expert));
    let up = make(&mut rng, ty, (n_ff, n_embd, n_expert));
    let down = make(&mut rng, ty, (n_embd, n_ff, n_expert));
    let r = ops::Routing {
        n_expert,
        k,
        gating: poly_kernels::ops::topk::Gating::Softmax,
        norm: true,
        scale: 1.0,
    };
    let xs: Vec<_> = (0..8)
        .map(|_| {
            let x: Vec<f32> = (0..n_embd).map(|_| rng.normal() * 4.0).collect();
            let xd = dev.upload(&x).expect("x");
            let mut xq = dev.zeros::<BlockQ8_1>(n_embd / 32).expect("xq");
            ops::quantize_q8_1(&dev, &xd, &mut xq).expect("quantize");
            (xd, xq)
        })
        .collect();
    let zero = dev.zeros::<i32>(1).expect("zero");
    let mut tickets = ops::Tickets::new(&dev, 1 << 14).expect("tickets");
    let mut logits = dev.zeros::<f32>(n_expert).expect("logits");
    let mut ids = dev.zeros::<i32>(k).expect("ids");
    let mut weights = dev.zeros::<f32>(k).expect("weights");
    let mut h = dev.zeros::<f32>(k * n_ff).expect("h");
    let mut hq = dev.zeros::<BlockQ8_1>(k * n_ff / 32).expect("hq");
    let mut y = dev.zeros::<f32>(k * n_embd).expect("y");
    let mut out = dev.zeros::<f32>(n_embd).expect("out");
    let bytes = 3 * k * down.table().expert_bytes() + n_expert * n_embd * 4;
    for fused in [false, true] {
        let graph = dev
            .capture(|dv| {
                for (xd, xq) in &xs {
                    if fused {
                        let t = &mut tickets;
                        ops::router_topk(
                            dv,
                            (router.table(), xd),
                            &r,
                            (&mut logits, t),
                            (&mut ids, &mut weights),
                        )?;
                        let tables = (gate.table(), up.table());
                        ops::matvec_experts_glu_q8(
                            dv,
                            tables,
                            (&ids, xq),
                            &mut h,
                            (&mut hq, &mut *t),
                        )?;
                        let sum = ops::SlotSum {
                            weights: &weights,
                            out: &mut out,
                            accumulate: false,
                            tickets: t,
                        };
                        ops::matvec_experts_q_sum(
                            dv,
                            down.table(),
                            (&ids, &hq, ExpertInput::PerSlot),
                            &mut y,
                            sum,
                        )?;
                    } else {
                        ops::matvec_experts_f(
                            dv,
                            router.table(),
                            &zero,
                            xd,
                            ExpertInput::Shared,
                            &mut logits,
                        )?;
                        ops::route_topk(dv, &logits, &r, &mut ids, &mut weights)?;
                        ops::matvec_experts_glu_q(
                            dv,
                            (gate.table(), up.table()),
                            &ids,
                            xq,
                            &mut h,
                        )?;
                        ops::quantize_q8_1(dv, &h, &mut hq)?;
                        ops::matvec_experts_q(
                            dv,
                            down.table(),
                            &ids,
                            &hq,
                            ExpertInput::PerSlot,
                            &mut y,
                        )?;
                        ops::moe_combine(dv, &y, &weights, k, false, &mut out)?;
                    }
                }
                Ok(())
            })
            .expect("capture");
        let secs = time_launches(&dev, || graph.replay().expect("replay")) / xs.len() as f64;
        let name = if fused {
            "fused (3 launches)"
        } else {
            "separate (6 launches)"
        };
        report(&format!("moe token {name}, graph"), secs, bytes);
    }
}

/// Seconds per `call` launched eagerly, and per call replayed from a graph of [`ITERS`] of them.
fn eager_and_graph(
    dev: &Device,
    call: &mut impl FnMut(&Device) -> Result<(), CudaError>,
) -> (f64, f64) {
    let eager = time_launches(dev, || call(dev).expect("launch"));
    let graph = dev
        .capture(|dv| (0..ITERS).try_for_each(|_| call(dv)))
        .expect("capture");
    let replayed = time_launches(dev, || graph.replay().expect("replay")) / ITERS as f64;
    (eager, replayed)
}

/// The i-quants on the card at llama.cpp's `test-backend-ops perf` shapes (issue 16 §5), to set beside its
/// `MUL_MAT(type_a=…,type_b=f32,m=4096,n=N,k=14336)` and `MUL_MAT_ID(…,n_mats=128,n_used=8,m=768,n=1,k=2048)`
/// lines on the same card: `benchmarks/iquant_card_vs_llama.sh` runs both and pairs them. As there, the
/// activations come in f32, so each call quantizes them (`quantize_q8_1`) before the product. Printed per
/// type: eager launches (as test-backend-ops times its graphs) and the same calls replayed from a graph,
/// with the path `matmul_q` took (`prompt::matmul_path`: the tensor cores or the dp4a tiles); at n = 8 also
/// the dp4a kernel (`dp4a` lines), to set the tensor cores' threshold by. The formats the issue names,
/// IQ4_XS/IQ4_NL and Q4_K for scale.
#[test]
#[ignore = "benchmark for the GPU machine"]
fn bench_iquants_as_test_backend_ops() {
    let Some(dev) = device() else { return };
    println!("device: {} ({})", dev.name(), dev.arch());
    let (m, k) = (4096, 14336);
    let mut rng = Rng::new(16);
    for ty in I_QUANTS.into_iter().chain([GgmlType::Q4_K]) {
        let w = random_weights(ty, &mut rng, m * k);
        let wd = DeviceMatrix::upload(&dev, ty, m, k, &w).expect("upload");
        for n in [1usize, 8, 512] {
            let x: Vec<f32> = (0..n * k).map(|_| rng.normal()).collect();
            let xd = dev.upload(&x).expect("x");
            let mut xq = dev.zeros::<BlockQ8_1>(n * k / 32).expect("xq");
            let mut y = dev.zeros::<f32>(n * m).expect("y");
            let mut call = |dv: &Device| -> Result<(), CudaError> {
                ops::quantize_q8_1(dv, &xd, &mut xq)?;
                match n {
                    1 => ops::matvec_q(dv, &wd, &xq, &mut y),
                    _ => prompt::matmul_q(dv, &wd, &xq, &mut y),
                }
            };
            let (eager, replayed) = eager_and_graph(&dev, &mut call);
            let path = match n {
                1 => "matvec".to_string(),
                _ => format!("{:?}", prompt::matmul_path(&dev, ty, k, n)),
            };
            println!(
                "iq MUL_MAT type_a={} m={m} n={n} k={k}: eager {:.2} us, graph {:.2} us, {:.1} MB of weights ({path})",
                ty.name().to_lowercase(),
                eager * 1e6,
                replayed * 1e6,
                w.len() as f64 / 1e6
            );
            if n == 8 {
                let mut dp4a = |dv: &Device| -> Result<(), CudaError> {
                    ops::quantize_q8_1(dv, &xd, &mut xq)?;
                    prompt::matmul_q_dp4a(dv, &wd, &xq, &mut y)
                };
                let (eager, replayed) = eager_and_graph(&dev, &mut dp4a);
                println!(
                    "iq MUL_MAT dp4a type_a={} m={m} n={n} k={k}: eager {:.2} us, graph {:.2} us",
                    ty.name().to_lowercase(),
                    eager * 1e6,
                    replayed * 1e6
                );
            }
        }
    }
    // MUL_MAT_ID at Qwen3-30B-A3B's expert shape, one token, 8 of 128 experts (the two i-quants
    // test-backend-ops measures there).
    let eight: Vec<i32> = vec![3, 17, 29, 64, 77, 90, 101, 126];
    let idsd = dev.upload(&eight).expect("ids");
    for ty in [GgmlType::IQ2_XS, GgmlType::IQ4_XS, GgmlType::Q4_K] {
        let (rows, cols, n_expert) = (768, 2048, 128);
        let w = random_weights(ty, &mut rng, rows * cols * n_expert);
        let stacked = StackedExperts::upload(&dev, ty, (rows, cols, n_expert), &w).expect("upload");
        let x: Vec<f32> = (0..cols).map(|_| rng.normal()).collect();
        let xd = dev.upload(&x).expect("x");
        let mut xq = dev.zeros::<BlockQ8_1>(cols / 32).expect("xq");
        let mut y = dev.zeros::<f32>(eight.len() * rows).expect("y");
        let mut call = |dv: &Device| -> Result<(), CudaError> {
            ops::quantize_q8_1(dv, &xd, &mut xq)?;
            ops::matvec_experts_q(dv, stacked.table(), &idsd, &xq, ExpertInput::Shared, &mut y)
        };
        let (eager, replayed) = eager_and_graph(&dev, &mut call);
        println!(
            "iq MUL_MAT_ID type_a={} n_mats={n_expert} n_used=8 m={rows} n=1 k={cols}: eager {:.2} us, graph {:.2} us",
            ty.name().to_lowercase(),
            eager * 1e6,
            replayed * 1e6
        );
    }
}
