//! Every CUDA operation against the CPU operation it replaces, on random inputs, with a normalized error
//! bound per operation (test-backend-ops style: NMSE = Σ(gpu − cpu)² / Σ cpu²).
//!
//! Runs on the GPU machine; on a machine without a CUDA device (CI) each test prints
//! "skipped: no CUDA device" and passes. Any other CUDA failure (a kernel that does not compile, a launch
//! error) fails. Cost on an H200: a few seconds, most of it NVRTC compiling the modules on first use (or
//! reading them from the kernel cache).

#![cfg(feature = "cuda")]

use poly_kernels::cuda::ops::{self, ExpertInput, Routing};
use poly_kernels::cuda::{
    BlockQ8_1, CudaError, Device, DeviceMatrix, KernelModule, ModuleOrigin, StackedExperts,
};
use poly_kernels::matmul::{matvec, QuantMatrix};
use poly_kernels::ops::act::{silu, swiglu_in_place};
use poly_kernels::ops::norm::rms_norm;
use poly_kernels::ops::rope::{rope_with_factors, RopeMode, RopeParams};
use poly_kernels::ops::topk::{route, Gating};
use poly_kernels::quant::GgmlType;
use poly_kernels::rng::Rng;

mod common;
use common::{assert_no_failures, device, nmse, normals, random_weights};

/// Prints the NMSE of one comparison and returns a failure message when it is above `bound` (or the GPU
/// output is not finite), so a test checks every case before it fails and the log shows all of them.
fn nmse_check(what: &str, gpu: &[f32], cpu: &[f32], bound: f64) -> Option<String> {
    let e = nmse(gpu, cpu);
    let finite = gpu.iter().all(|v| v.is_finite());
    println!(
        "{what}: nmse {e:.3e} (bound {bound:.0e}){}",
        if finite { "" } else { " NOT FINITE" }
    );
    (!finite || e > bound.max(0.0) || e.is_nan())
        .then(|| format!("{what}: nmse {e:.3e} above {bound:.0e}"))
}

fn assert_nmse(what: &str, gpu: &[f32], cpu: &[f32], bound: f64) {
    if let Some(failure) = nmse_check(what, gpu, cpu, bound) {
        panic!("{failure}");
    }
}

/// Bound of the quantized matrix×vector: the GPU quantizes activations to Q8_1 blocks of 32, the CPU to its
/// format's activation type (Q8_K or Q8_0); each is within about 0.5% of the exact product per element, so
/// their NMSE stays far below ggml's 5e-4 for matrix products.
const MATVEC_Q_NMSE: f64 = 5e-4;
/// Float weights: both sides multiply in f32, in different orders.
const MATVEC_F_NMSE: f64 = 1e-9;

/// Every quantized format the card computes (the kernels' one table).
fn quant_types() -> Vec<GgmlType> {
    poly_kernels::cuda::quantized_formats().collect()
}

const FLOAT_TYPES: [GgmlType; 3] = [GgmlType::F32, GgmlType::F16, GgmlType::BF16];

/// The kernel's host copies move every word both ways, four copies in a launch, a fifth refused; the
/// pinned memory written by the kernel is what the host reads after a synchronize, and what the host
/// wrote before the launch is what the kernel reads.
#[test]
fn host_copies_by_kernel_move_every_word() {
    use poly_kernels::cuda::{HostCopies, HOST_COPIES_MAX};
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(3);
    let x = normals(&mut rng, 5_000);
    let ids: Vec<i32> = (0..8).map(|i| i * 31 - 7).collect();
    let xd = dev.upload(&x).unwrap();
    let idd = dev.upload(&ids).unwrap();
    let mut hx = dev.pinned::<f32>(x.len()).unwrap();
    let mut hid = dev.pinned::<i32>(ids.len()).unwrap();
    let mut up = dev.pinned::<u64>(3).unwrap();
    up.as_mut_slice()
        .unwrap()
        .copy_from_slice(&[u64::MAX, 1 << 40 | 5, 0]);
    let mut upd = dev.zeros::<u64>(3).unwrap();
    let mut back = dev.zeros::<f32>(x.len()).unwrap();
    // SAFETY: the host reads the pinned buffers only after the synchronize below and writes them only
    // before the launch; all outlive it.
    unsafe {
        HostCopies::new()
            .download(&xd, &mut hx)
            .unwrap()
            .download(&idd, &mut hid)
            .unwrap()
            .upload(&up, &mut upd)
            .unwrap()
            .queue(&dev)
            .unwrap();
    }
    dev.synchronize().unwrap();
    assert_eq!(hx.as_slice().unwrap(), &x[..]);
    assert_eq!(hid.as_slice().unwrap(), &ids[..]);
    assert_eq!(dev.download(&upd).unwrap(), vec![u64::MAX, 1 << 40 | 5, 0]);
    // The host's own values up again, through a kernel reading its memory.
    hx.as_mut_slice()
        .unwrap()
        .iter_mut()
        .for_each(|v| *v *= 2.0);
    // SAFETY: as above.
    unsafe {
        HostCopies::new()
            .upload(&hx, &mut back)
            .unwrap()
            .queue(&dev)
            .unwrap()
    };
    let doubled: Vec<f32> = x.iter().map(|v| v * 2.0).collect();
    assert_eq!(dev.download(&back).unwrap(), doubled);
    // Lengths that differ and a copy past HOST_COPIES_MAX are refused.
    let short = dev.zeros::<f32>(3).unwrap();
    // SAFETY: nothing is queued.
    unsafe {
        assert!(HostCopies::new().download(&short, &mut hx).is_err());
        let mut c = HostCopies::new();
        for _ in 0..HOST_COPIES_MAX {
            c.download(&idd, &mut hid).unwrap();
        }
        assert!(c.download(&idd, &mut hid).is_err());
    }
}

#[test]
fn quantize_q8_1_matches_its_definition() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(1);
    let mut x = normals(&mut rng, 32 * 40);
    x[32..64].iter_mut().for_each(|v| *v = 0.0); // an all-zero block
    let xd = dev.upload(&x).unwrap();
    let mut q = dev.zeros::<BlockQ8_1>(40).unwrap();
    ops::quantize_q8_1(&dev, &xd, &mut q).unwrap();
    let blocks = dev.download(&q).unwrap();
    for (b, xs) in blocks.iter().zip(x.chunks_exact(32)) {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        assert_eq!(b.d(), half::f16::from_f32(d).to_f32());
        // s = d · Σq (ggml's CPU q8_1), d in f32 before rounding: exact.
        let sum_q: i32 = (0..32).map(|i| b.q(i) as i32).sum();
        assert_eq!(b.s(), half::f16::from_f32(d * sum_q as f32).to_f32());
        for (i, &v) in xs.iter().enumerate() {
            let want = if amax == 0.0 {
                0
            } else {
                (v / d).round() as i8
            };
            assert_eq!(b.q(i), want, "value {v}");
        }
    }
}

fn check_matvec(dev: &Device, ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Option<String> {
    let mut rng = Rng::new(seed);
    let w = random_weights(ty, &mut rng, rows * cols);
    let x = normals(&mut rng, cols);
    let mut want = vec![0f32; rows];
    matvec(
        &QuantMatrix::new(ty, rows, cols, &w).unwrap(),
        &x,
        &mut want,
    );

    let wd = DeviceMatrix::upload(dev, ty, rows, cols, &w).unwrap();
    let xd = dev.upload(&x).unwrap();
    let mut scratch = dev.zeros::<BlockQ8_1>(cols / 32).unwrap();
    let mut yd = dev.zeros::<f32>(rows).unwrap();
    ops::matvec(dev, &wd, &xd, &mut scratch, &mut yd).unwrap();
    let got = dev.download(&yd).unwrap();
    let bound = if FLOAT_TYPES.contains(&ty) {
        MATVEC_F_NMSE
    } else {
        MATVEC_Q_NMSE
    };
    nmse_check(&format!("matvec {ty} {rows}x{cols}"), &got, &want, bound)
}

#[test]
fn matvec_matches_cpu_for_quantized_formats() {
    let Some(dev) = device() else { return };
    let mut failures = Vec::new();
    for ty in quant_types() {
        // 768 columns: fewer weight blocks per row than threads (the expert down projection's shape).
        // 1027 and 2050 rows: with --matvec-rpg 4, launches with 4 rows per warp group, the last short.
        for (rows, cols) in [(67, 2048), (130, 768), (5, 4096), (1027, 2048), (2050, 768)] {
            failures.extend(check_matvec(&dev, ty, rows, cols, 10 + rows as u64));
        }
    }
    assert_no_failures(failures);
}

#[test]
fn matvec_matches_cpu_for_float_formats() {
    let Some(dev) = device() else { return };
    let mut failures = Vec::new();
    for ty in FLOAT_TYPES {
        for (rows, cols) in [(67, 2048), (33, 130), (3, 4098)] {
            failures.extend(check_matvec(&dev, ty, rows, cols, 20 + rows as u64));
        }
    }
    assert_no_failures(failures);
}

/// The expert kernels: slots with ids read on the card, shared and per-slot inputs, and ids that name no
/// expert (negative, or past the last) giving zeros.
fn check_experts(
    dev: &Device,
    ty: GgmlType,
    (rows, cols): (usize, usize),
    seed: u64,
) -> Vec<String> {
    let mut failures = Vec::new();
    let n_expert = 6;
    let mut rng = Rng::new(seed);
    let w = random_weights(ty, &mut rng, rows * cols * n_expert);
    let expert_bytes = w.len() / n_expert;
    let stacked = StackedExperts::upload(dev, ty, (rows, cols, n_expert), &w).unwrap();
    let ids: Vec<i32> = vec![4, 0, 5, -1, 4, 6, 2];
    let idsd = dev.upload(&ids).unwrap();
    let float = FLOAT_TYPES.contains(&ty);
    let bound = if float { MATVEC_F_NMSE } else { MATVEC_Q_NMSE };

    for input in [ExpertInput::Shared, ExpertInput::PerSlot] {
        let n_vec = if input == ExpertInput::Shared {
            1
        } else {
            ids.len()
        };
        let x = normals(&mut rng, cols * n_vec);
        let xd = dev.upload(&x).unwrap();
        let mut yd = dev.zeros::<f32>(ids.len() * rows).unwrap();
        if float {
            ops::matvec_experts_f(dev, stacked.table(), &idsd, &xd, input, &mut yd).unwrap();
        } else {
            let mut xq = dev.zeros::<BlockQ8_1>(x.len() / 32).unwrap();
            ops::quantize_q8_1(dev, &xd, &mut xq).unwrap();
            ops::matvec_experts_q(dev, stacked.table(), &idsd, &xq, input, &mut yd).unwrap();
        }
        let got = dev.download(&yd).unwrap();
        for (s, &e) in ids.iter().enumerate() {
            let got_s = &got[s * rows..(s + 1) * rows];
            if e < 0 || e as usize >= n_expert {
                if got_s.iter().any(|&v| v != 0.0) {
                    failures.push(format!("experts {ty} {input:?} slot {s} (id {e}) not zero"));
                }
                continue;
            }
            let e = e as usize;
            let m = QuantMatrix::new(ty, rows, cols, &w[e * expert_bytes..(e + 1) * expert_bytes])
                .unwrap();
            let xs = if n_vec == 1 {
                &x[..]
            } else {
                &x[s * cols..(s + 1) * cols]
            };
            let mut want = vec![0f32; rows];
            matvec(&m, xs, &mut want);
            failures.extend(nmse_check(
                &format!("experts {ty} {rows}x{cols} {input:?} slot {s}"),
                got_s,
                &want,
                bound,
            ));
        }
    }
    failures
}

/// The fused gate-and-up launch: bit for bit the two expert launches and the SwiGLU (so a decode graph
/// with it computes what the separate launches did), zeros for ids that name no expert, and close to the CPU's
/// silu(gate·x)·(up·x). Rows of 2048 columns (4 warps per row) and of 768 (2).
fn check_experts_glu(dev: &Device, ty: GgmlType, cols: usize, seed: u64) -> Vec<String> {
    let mut failures = Vec::new();
    // 770 rows: with --matvec-rpg 4, 4 rows per warp group (8 slots), the last group short.
    let (rows, n_expert) = (770, 6);
    let mut rng = Rng::new(seed);
    let wg = random_weights(ty, &mut rng, rows * cols * n_expert);
    let wu = random_weights(ty, &mut rng, rows * cols * n_expert);
    let gate = StackedExperts::upload(dev, ty, (rows, cols, n_expert), &wg).unwrap();
    let up = StackedExperts::upload(dev, ty, (rows, cols, n_expert), &wu).unwrap();
    let ids: Vec<i32> = vec![4, 0, 5, -1, 4, 6, 2, 1];
    let idsd = dev.upload(&ids).unwrap();
    let x = normals(&mut rng, cols);
    let xd = dev.upload(&x).unwrap();
    let mut xq = dev.zeros::<BlockQ8_1>(cols / 32).unwrap();
    ops::quantize_q8_1(dev, &xd, &mut xq).unwrap();
    let n = ids.len() * rows;
    let mut hd = dev.zeros::<f32>(n).unwrap();
    ops::matvec_experts_glu_q(dev, (gate.table(), up.table()), &idsd, &xq, &mut hd).unwrap();
    let got = dev.download(&hd).unwrap();
    let (mut gd, mut ud, mut sd) = (
        dev.zeros::<f32>(n).unwrap(),
        dev.zeros::<f32>(n).unwrap(),
        dev.zeros::<f32>(n).unwrap(),
    );
    let shared = ExpertInput::Shared;
    ops::matvec_experts_q(dev, gate.table(), &idsd, &xq, shared, &mut gd).unwrap();
    ops::matvec_experts_q(dev, up.table(), &idsd, &xq, shared, &mut ud).unwrap();
    ops::swiglu(dev, &gd, &ud, &mut sd).unwrap();
    let separate = dev.download(&sd).unwrap();
    let differ = got
        .iter()
        .zip(&separate)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    if differ > 0 {
        failures.push(format!(
            "experts_glu {ty} cols {cols}: {differ} of {n} values differ from the separate launches"
        ));
    }
    let expert_bytes = wg.len() / n_expert;
    for (s, &e) in ids.iter().enumerate() {
        let got_s = &got[s * rows..(s + 1) * rows];
        if e < 0 || e as usize >= n_expert {
            if got_s.iter().any(|&v| v != 0.0) {
                failures.push(format!("experts_glu {ty} slot {s} (id {e}) not zero"));
            }
            continue;
        }
        let e = e as usize;
        let part = |w: &[u8]| {
            let m = QuantMatrix::new(ty, rows, cols, &w[e * expert_bytes..(e + 1) * expert_bytes])
                .unwrap();
            let mut y = vec![0f32; rows];
            matvec(&m, &x, &mut y);
            y
        };
        let mut want = part(&wg);
        let u = part(&wu);
        swiglu_in_place(&mut want, &u);
        failures.extend(nmse_check(
            &format!("experts_glu {ty} cols {cols} slot {s}"),
            got_s,
            &want,
            4.0 * MATVEC_Q_NMSE,
        ));
    }
    failures
}

#[test]
fn fused_gate_up_experts_equal_the_separate_launches() {
    let Some(dev) = device() else { return };
    let mut failures = Vec::new();
    for (i, ty) in quant_types().iter().enumerate() {
        for cols in [2048, 768] {
            if cols % ty.block_elems() == 0 {
                failures.extend(check_experts_glu(&dev, *ty, cols, 60 + i as u64));
            }
        }
    }
    assert_no_failures(failures);
}

#[test]
fn expert_matvec_matches_cpu_per_slot() {
    let Some(dev) = device() else { return };
    let mut failures = Vec::new();
    for (i, ty) in quant_types().iter().chain(FLOAT_TYPES.iter()).enumerate() {
        // 514 rows of 2048: with --matvec-rpg 4, 4 rows per warp group, the last group short.
        for shape in [(96, 512), (514, 2048)] {
            failures.extend(check_experts(&dev, *ty, shape, 30 + i as u64));
        }
    }
    assert_no_failures(failures);
}

#[test]
fn rms_norm_matches_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(40);
    let mut failures = Vec::new();
    for (group, rows, weighted) in [
        (2048, 3, true),
        (128, 32, false),
        (5120, 2, true),
        (100, 7, true),
    ] {
        let x: Vec<f32> = normals(&mut rng, group * rows)
            .iter()
            .map(|v| v * 3.0 + 0.5)
            .collect();
        let w = normals(&mut rng, group);
        let mut want = vec![0f32; x.len()];
        rms_norm(&x, group, weighted.then_some(&w[..]), 1e-6, &mut want);
        let xd = dev.upload(&x).unwrap();
        let wd = dev.upload(&w).unwrap();
        let mut out = dev.zeros::<f32>(x.len()).unwrap();
        ops::rms_norm(&dev, &xd, group, weighted.then_some(&wd), 1e-6, &mut out).unwrap();
        let got = dev.download(&out).unwrap();
        failures.extend(nmse_check(
            &format!("rms_norm group {group}"),
            &got,
            &want,
            1e-11,
        ));
    }
    assert_no_failures(failures);
}

#[test]
fn rope_matches_cpu_in_both_modes() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(50);
    let positions: Vec<u32> = vec![0, 1, 7, 100, 2047, 4096, 40_000];
    let mut failures = Vec::new();
    for mode in [RopeMode::Neox, RopeMode::Normal] {
        for (head_dim, n_rot, base) in [(128, 128, 1.0e6f32), (128, 64, 1.0e4), (256, 64, 1.0e7)] {
            let p = RopeParams {
                mode,
                head_dim,
                n_rot,
                freq_base: base,
                freq_scale: 1.0,
            };
            let n_heads = 3;
            let x = normals(&mut rng, positions.len() * n_heads * head_dim);
            // The partial rotations also divide their angles by frequency factors (rope_freqs.weight).
            let factors: Vec<f32> = (0..n_rot / 2).map(|i| 1.0 + (i % 5) as f32 * 0.7).collect();
            let factors = (n_rot < head_dim).then_some(&factors[..]);
            let mut want = x.clone();
            rope_with_factors(&mut want, &positions, &p, factors);
            let fd = factors.map(|f| dev.upload(f).unwrap());
            let mut xd = dev.upload(&x).unwrap();
            let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
            let posd = dev.upload(&pos).unwrap();
            // Out of place (the engine's call) first: the same values as in place, bit for bit, with the
            // dimensions past n_rot copied.
            let mut outd = dev.upload(&vec![f32::NAN; x.len()]).unwrap();
            ops::rope_into(&dev, &xd, &posd, &p, fd.as_ref(), &mut outd).unwrap();
            let into = dev.download(&outd).unwrap();
            ops::rope(&dev, &mut xd, &posd, &p, fd.as_ref()).unwrap();
            let got = dev.download(&xd).unwrap();
            if into
                .iter()
                .zip(&got)
                .any(|(a, b)| a.to_bits() != b.to_bits())
            {
                failures.push(format!(
                    "rope_into {mode:?} n_rot {n_rot} differs from rope in place"
                ));
            }
            // Same angles bit for bit; only sin/cos may round differently (a few ulp of angles up to 4e4).
            failures.extend(nmse_check(
                &format!("rope {mode:?} n_rot {n_rot} base {base}"),
                &got,
                &want,
                1e-10,
            ));
        }
    }
    assert_no_failures(failures);
}

#[test]
fn silu_and_swiglu_match_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(60);
    let n = 3 * 768 + 5;
    let gate: Vec<f32> = normals(&mut rng, n).iter().map(|v| v * 4.0).collect();
    let up = normals(&mut rng, n);
    let gd = dev.upload(&gate).unwrap();
    let ud = dev.upload(&up).unwrap();
    let mut out = dev.zeros::<f32>(n).unwrap();
    ops::silu(&dev, &gd, &mut out).unwrap();
    let want: Vec<f32> = gate.iter().map(|&v| silu(v)).collect();
    assert_nmse("silu", &dev.download(&out).unwrap(), &want, 1e-12);
    ops::swiglu(&dev, &gd, &ud, &mut out).unwrap();
    let mut want = gate.clone();
    swiglu_in_place(&mut want, &up);
    assert_nmse("swiglu", &dev.download(&out).unwrap(), &want, 1e-12);
}

#[test]
fn routing_matches_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(70);
    for (n_expert, k, gating, norm, scale) in [
        (128, 8, Gating::Softmax, true, 1.0),
        (256, 8, Gating::Sigmoid, true, 2.5),
        (60, 4, Gating::Softmax, false, 1.0),
        (512, 10, Gating::Softmax, true, 1.0),
    ] {
        let n_tokens = 5;
        let logits: Vec<f32> = normals(&mut rng, n_tokens * n_expert)
            .iter()
            .map(|v| v * 2.0)
            .collect();
        let r = Routing {
            n_expert,
            k,
            gating,
            norm,
            scale,
        };
        let ld = dev.upload(&logits).unwrap();
        let mut ids = dev.zeros::<i32>(n_tokens * k).unwrap();
        let mut weights = dev.zeros::<f32>(n_tokens * k).unwrap();
        ops::route_topk(&dev, &ld, &r, &mut ids, &mut weights).unwrap();
        let (got_ids, got_w) = (dev.download(&ids).unwrap(), dev.download(&weights).unwrap());
        let mut want_w = Vec::new();
        for t in 0..n_tokens {
            let want = route(
                &logits[t * n_expert..(t + 1) * n_expert],
                gating,
                k,
                norm,
                scale,
            );
            let ids_t: Vec<u32> = want.iter().map(|p| p.0).collect();
            let got_t: Vec<u32> = got_ids[t * k..(t + 1) * k]
                .iter()
                .map(|&i| i as u32)
                .collect();
            assert_eq!(got_t, ids_t, "token {t} of {n_expert} experts, {gating:?}");
            want_w.extend(want.iter().map(|p| p.1));
        }
        assert_nmse(
            &format!("route {n_expert} {gating:?}"),
            &got_w,
            &want_w,
            1e-11,
        );
    }
}

#[test]
fn moe_combine_matches_a_weighted_sum() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(80);
    let (n_tokens, k, n) = (3, 8, 2048 + 7);
    let y = normals(&mut rng, n_tokens * k * n);
    let w = normals(&mut rng, n_tokens * k);
    let base = normals(&mut rng, n_tokens * n);
    let yd = dev.upload(&y).unwrap();
    let wd = dev.upload(&w).unwrap();
    for accumulate in [false, true] {
        let mut out = dev.upload(&base).unwrap();
        ops::moe_combine(&dev, &yd, &wd, k, accumulate, &mut out).unwrap();
        let mut want = if accumulate {
            base.clone()
        } else {
            vec![0f32; base.len()]
        };
        for t in 0..n_tokens {
            for j in 0..k {
                for i in 0..n {
                    want[t * n + i] += w[t * k + j] * y[(t * k + j) * n + i];
                }
            }
        }
        assert_nmse(
            &format!("moe_combine accumulate={accumulate}"),
            &dev.download(&out).unwrap(),
            &want,
            1e-12,
        );
    }
}

#[test]
fn bad_arguments_are_errors_not_faults() {
    let Some(dev) = device() else { return };
    let x = dev.upload(&[1.0f32; 64]).unwrap();
    let mut q = dev.zeros::<BlockQ8_1>(3).unwrap();
    assert!(matches!(
        ops::quantize_q8_1(&dev, &x, &mut q),
        Err(CudaError::Invalid(_))
    ));
    // MXFP4 has no kernel on the card (the i-quants have since issue 16 §5).
    let w = vec![0u8; GgmlType::MXFP4.bytes_for(256).unwrap() as usize];
    assert!(matches!(
        DeviceMatrix::upload(&dev, GgmlType::MXFP4, 1, 256, &w),
        Err(CudaError::Invalid(_))
    ));
    let w = vec![0u8; GgmlType::Q4_K.bytes_for(256).unwrap() as usize];
    assert!(matches!(
        DeviceMatrix::upload(&dev, GgmlType::Q4_K, 2, 256, &w),
        Err(CudaError::Invalid(_))
    ));
    dev.synchronize().unwrap();
}

/// A second device handle finds every module in the on-disk cache the first one filled (when the cache is
/// writable), and both run kernels.
#[test]
fn modules_come_from_the_cache_the_second_time() {
    let Some(first) = device() else { return };
    first.load_all_modules().unwrap();
    let first_log = first.module_log();
    assert_eq!(first_log.len(), KernelModule::ALL.len());
    for load in &first_log {
        println!(
            "first load of {}: {:?} at {:?}",
            load.module.name(),
            load.origin,
            load.path
        );
    }
    let second = Device::open(0).unwrap();
    second.load_all_modules().unwrap();
    for (a, b) in first_log.iter().zip(second.module_log()) {
        assert_eq!(a.module, b.module);
        let written = matches!(
            a.origin,
            ModuleOrigin::Cached | ModuleOrigin::Compiled { cached: true, .. }
        );
        if written {
            assert_eq!(b.origin, ModuleOrigin::Cached, "{}", b.module.name());
        }
    }
    let x = second.upload(&[3.0f32; 32]).unwrap();
    let mut out = second.zeros::<f32>(32).unwrap();
    ops::rms_norm(&second, &x, 32, None, 0.0, &mut out).unwrap();
    assert!(second
        .download(&out)
        .unwrap()
        .iter()
        .all(|&v| (v - 1.0).abs() < 1e-6));
}

/// A captured MoE step (quantize the input, route, multiply the chosen experts) replays on new inputs
/// written into its buffers: the routing and the experts follow the new values, as a decode graph needs.
#[test]
fn a_captured_moe_step_replays_with_new_inputs() {
    let Some(dev) = device() else { return };
    let (ty, rows, cols, n_expert, k) = (GgmlType::Q4_K, 64, 512, 16, 4);
    let mut rng = Rng::new(90);
    let w = random_weights(ty, &mut rng, rows * cols * n_expert);
    let expert_bytes = w.len() / n_expert;
    let stacked = StackedExperts::upload(&dev, ty, (rows, cols, n_expert), &w).unwrap();
    let r = Routing {
        n_expert,
        k,
        gating: Gating::Softmax,
        norm: true,
        scale: 1.0,
    };
    let mut x = dev.zeros::<f32>(cols).unwrap();
    let mut logits = dev.zeros::<f32>(n_expert).unwrap();
    let mut xq = dev.zeros::<BlockQ8_1>(cols / 32).unwrap();
    let mut ids = dev.zeros::<i32>(k).unwrap();
    let mut weights = dev.zeros::<f32>(k).unwrap();
    let mut y = dev.zeros::<f32>(k * rows).unwrap();
    let graph = dev
        .capture(|d| {
            ops::quantize_q8_1(d, &x, &mut xq)?;
            ops::route_topk(d, &logits, &r, &mut ids, &mut weights)?;
            ops::matvec_experts_q(d, stacked.table(), &ids, &xq, ExpertInput::Shared, &mut y)
        })
        .unwrap();
    let mut failures = Vec::new();
    for step in 0..3 {
        let xs = normals(&mut rng, cols);
        let ls: Vec<f32> = normals(&mut rng, n_expert)
            .iter()
            .map(|v| v * 3.0)
            .collect();
        dev.write(&xs, &mut x).unwrap();
        dev.write(&ls, &mut logits).unwrap();
        graph.replay().unwrap();
        let got_ids = dev.download(&ids).unwrap();
        let got_y = dev.download(&y).unwrap();
        let want = route(&ls, Gating::Softmax, k, true, 1.0);
        let want_ids: Vec<i32> = want.iter().map(|p| p.0 as i32).collect();
        assert_eq!(got_ids, want_ids, "step {step}");
        for (s, &e) in want_ids.iter().enumerate() {
            let e = e as usize;
            let m = QuantMatrix::new(ty, rows, cols, &w[e * expert_bytes..(e + 1) * expert_bytes])
                .unwrap();
            let mut want_y = vec![0f32; rows];
            matvec(&m, &xs, &mut want_y);
            failures.extend(nmse_check(
                &format!("graph step {step} slot {s}"),
                &got_y[s * rows..(s + 1) * rows],
                &want_y,
                MATVEC_Q_NMSE,
            ));
        }
    }
    assert_no_failures(failures);
}
