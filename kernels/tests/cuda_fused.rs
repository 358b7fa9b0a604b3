//! The fused kernels of `poly_kernels::cuda::fused` against the CPU operations they stand for, on random
//! inputs (normalized error, as `cuda_ops.rs`), and against the GPU launches they replace, bit for bit (a
//! fused forward pass must give the unfused pass's values): the residual add with the RMS norm (and its
//! quantized copy), the per-head RMS norm with RoPE, and several quantized matrices times one vector; and
//! that the existing kernels the engine uses for op sequences (gated norm, SwiGLU/GeGLU, convolution with
//! SiLU) equal those sequences; Qwen3.5's L2 norm of q and k on the convolution's columns, and its gates.
//!
//! Runs on the GPU machine; without a CUDA device (CI) each test prints "skipped: no CUDA device" and
//! passes. Cost: a few seconds on an H200 (NVRTC compiling three modules, or reading them from the cache).

#![cfg(feature = "cuda")]

use poly_kernels::cuda::elementwise::{self as ew, BinaryOp, Broadcast, UnaryFn};
use poly_kernels::cuda::fused::{self, MATVEC_MANY_MAX};
use poly_kernels::cuda::{ops, recurrent};
use poly_kernels::cuda::{BlockQ8_1, CudaError, Device, DeviceBuffer, DeviceMatrix};
use poly_kernels::matmul::{matvec, QuantMatrix};
use poly_kernels::ops::act::{sigmoid, softplus};
use poly_kernels::ops::norm::rms_norm;
use poly_kernels::ops::rope::{rope_with_factors, RopeMode, RopeParams};
use poly_kernels::quant::GgmlType;
use poly_kernels::rng::Rng;

mod common;
use common::{assert_no_failures, device, nmse, normals, random_weights};

fn check_nmse(failures: &mut Vec<String>, what: &str, gpu: &[f32], cpu: &[f32], bound: f64) {
    let e = nmse(gpu, cpu);
    println!("{what}: nmse {e:.3e} (bound {bound:.0e})");
    if e.is_nan() || e > bound {
        failures.push(format!("{what}: nmse {e:.3e} above {bound:.0e}"));
    }
}

fn check_bits(failures: &mut Vec<String>, what: &str, fused: &[f32], separate: &[f32]) {
    let differ = fused
        .iter()
        .zip(separate)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    if differ > 0 || fused.len() != separate.len() {
        failures.push(format!(
            "{what}: {differ} of {} values differ from the separate launches",
            separate.len()
        ));
    }
}

#[test]
fn add_rms_norm_matches_the_cpu_and_the_two_launches() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(70);
    let mut failures = Vec::new();
    // (group, rows, weighted): a qwen3moe row, heads, a group past 1024 threads, an odd group.
    for (group, rows, weighted) in [
        (2048, 3, true),
        (128, 16, false),
        (5120, 2, true),
        (100, 7, true),
    ] {
        let n = group * rows;
        let a: Vec<f32> = normals(&mut rng, n).iter().map(|v| v * 3.0).collect();
        let b = normals(&mut rng, n);
        let w = normals(&mut rng, group);
        let sum_cpu: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        let mut want = vec![0f32; n];
        rms_norm(&sum_cpu, group, weighted.then_some(&w[..]), 1e-6, &mut want);

        let (ad, bd, wd) = (
            dev.upload(&a).unwrap(),
            dev.upload(&b).unwrap(),
            dev.upload(&w).unwrap(),
        );
        let wopt = weighted.then_some(&wd);
        let mut sum = dev.zeros::<f32>(n).unwrap();
        let mut out = dev.zeros::<f32>(n).unwrap();
        fused::add_rms_norm(
            &dev,
            (&ad, &bd),
            group,
            wopt,
            1e-6,
            (&mut sum, &mut out),
            None,
        )
        .unwrap();
        let (got_sum, got) = (dev.download(&sum).unwrap(), dev.download(&out).unwrap());
        let what = format!("add_rms_norm group {group} rows {rows}");
        check_nmse(
            &mut failures,
            &format!("{what} sum"),
            &got_sum,
            &sum_cpu,
            0.0,
        );
        check_nmse(&mut failures, &what, &got, &want, 1e-11);

        // The launches it replaces: ew add, then rms_norm.
        let mut sum2 = dev.zeros::<f32>(n).unwrap();
        let mut out2 = dev.zeros::<f32>(n).unwrap();
        ew::binary(
            &dev,
            &ad,
            &bd,
            group,
            BinaryOp::Add,
            Broadcast::None,
            &mut sum2,
        )
        .unwrap();
        ops::rms_norm(&dev, &sum2, group, wopt, 1e-6, &mut out2).unwrap();
        check_bits(&mut failures, &what, &got, &dev.download(&out2).unwrap());
    }
    assert_no_failures(failures);
}

#[test]
fn add_rms_norm_quantized_copy_equals_rms_norm_quantize() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(71);
    let mut failures = Vec::new();
    // One token's row (the decode path), and several rows.
    for (group, rows) in [(2048, 1), (4096, 1), (1024, 3), (64, 5)] {
        let n = group * rows;
        let a = normals(&mut rng, n);
        let b = normals(&mut rng, n);
        let w = normals(&mut rng, group);
        let (ad, bd, wd) = (
            dev.upload(&a).unwrap(),
            dev.upload(&b).unwrap(),
            dev.upload(&w).unwrap(),
        );
        let mut sum = dev.zeros::<f32>(n).unwrap();
        let mut out = dev.zeros::<f32>(n).unwrap();
        let mut q = dev.zeros::<BlockQ8_1>(n / 32).unwrap();
        fused::add_rms_norm(
            &dev,
            (&ad, &bd),
            group,
            Some(&wd),
            1e-6,
            (&mut sum, &mut out),
            Some(&mut q),
        )
        .unwrap();
        let mut out2 = dev.zeros::<f32>(n).unwrap();
        let mut q2 = dev.zeros::<BlockQ8_1>(n / 32).unwrap();
        ops::rms_norm_quantize_q8_1(&dev, &sum, group, Some(&wd), 1e-6, (&mut out2, &mut q2))
            .unwrap();
        let what = format!("add_rms_norm q8_1 group {group} rows {rows}");
        check_bits(
            &mut failures,
            &what,
            &dev.download(&out).unwrap(),
            &dev.download(&out2).unwrap(),
        );
        let (got_q, want_q) = (dev.download(&q).unwrap(), dev.download(&q2).unwrap());
        let same = got_q
            .iter()
            .zip(&want_q)
            .all(|(x, y)| x.d() == y.d() && x.s() == y.s() && (0..32).all(|i| x.q(i) == y.q(i)));
        if !same {
            failures.push(format!("{what}: the quantized copy differs"));
        }
    }
    assert_no_failures(failures);
}

#[test]
fn rms_norm_rope_matches_the_cpu_and_the_two_launches() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(72);
    let positions: Vec<u32> = vec![0, 1, 7, 100, 2047, 40_000];
    let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
    let posd = dev.upload(&pos).unwrap();
    let mut failures = Vec::new();
    // (mode, head_dim, n_rot, base, n_heads, weighted): Qwen3 (128, whole head), Qwen3.5 (256, 64 rotated),
    // Gemma 3 270M (256), a head past 1024 threads, the normal pairing.
    for (mode, head_dim, n_rot, base, n_heads, weighted) in [
        (RopeMode::Neox, 128, 128, 1.0e6f32, 4, true),
        (RopeMode::Neox, 256, 64, 1.0e7, 2, true),
        (RopeMode::Neox, 256, 256, 1.0e4, 1, false),
        (RopeMode::Neox, 2048, 2048, 1.0e4, 1, true),
        (RopeMode::Normal, 64, 32, 1.0e4, 3, true),
    ] {
        let p = RopeParams {
            mode,
            head_dim,
            n_rot,
            freq_base: base,
            freq_scale: 1.0,
        };
        let x: Vec<f32> = normals(&mut rng, positions.len() * n_heads * head_dim)
            .iter()
            .map(|v| v * 2.0 + 0.3)
            .collect();
        let w = normals(&mut rng, head_dim);
        let wopt = weighted.then_some(&w[..]);
        // The normal-mode case also divides its angles by frequency factors (rope_freqs.weight).
        let factors: Vec<f32> = (0..n_rot / 2).map(|i| 1.0 + (i % 4) as f32 * 1.5).collect();
        let factors = (mode == RopeMode::Normal).then_some(&factors[..]);
        let mut want = vec![0f32; x.len()];
        rms_norm(&x, head_dim, wopt, 1e-6, &mut want);
        rope_with_factors(&mut want, &positions, &p, factors);
        let fd = factors.map(|f| dev.upload(f).unwrap());

        let xd = dev.upload(&x).unwrap();
        let wd = dev.upload(&w).unwrap();
        let wdopt = weighted.then_some(&wd);
        let mut out = dev.upload(&vec![f32::NAN; x.len()]).unwrap();
        fused::rms_norm_rope(&dev, (&xd, wdopt), 1e-6, &posd, (&p, fd.as_ref()), &mut out).unwrap();
        let got = dev.download(&out).unwrap();
        let what = format!("rms_norm_rope {mode:?} head {head_dim} n_rot {n_rot}");
        // The rope test's bound (sin/cos of large angles round differently on the two sides).
        check_nmse(&mut failures, &what, &got, &want, 1e-10);

        let mut normed = dev.zeros::<f32>(x.len()).unwrap();
        ops::rms_norm(&dev, &xd, head_dim, wdopt, 1e-6, &mut normed).unwrap();
        let mut out2 = dev.zeros::<f32>(x.len()).unwrap();
        ops::rope_into(&dev, &normed, &posd, &p, fd.as_ref(), &mut out2).unwrap();
        check_bits(&mut failures, &what, &got, &dev.download(&out2).unwrap());

        // The pair launch: x as the first tensor and a second one of other heads (a layer's keys) with
        // its own weight, each equal bit for bit to its own launch.
        let heads1 = n_heads % 3 + 1;
        let x1: Vec<f32> = normals(&mut rng, positions.len() * heads1 * head_dim);
        let w1 = normals(&mut rng, head_dim);
        let (x1d, w1d) = (dev.upload(&x1).unwrap(), dev.upload(&w1).unwrap());
        let mut alone1 = dev.zeros::<f32>(x1.len()).unwrap();
        fused::rms_norm_rope(
            &dev,
            (&x1d, Some(&w1d)),
            1e-6,
            &posd,
            (&p, fd.as_ref()),
            &mut alone1,
        )
        .unwrap();
        let mut pair0 = dev.upload(&vec![f32::NAN; x.len()]).unwrap();
        let mut pair1 = dev.upload(&vec![f32::NAN; x1.len()]).unwrap();
        let inputs = [(&xd, wdopt), (&x1d, Some(&w1d))];
        let rp = (&p, fd.as_ref());
        fused::rms_norm_rope_pair(&dev, inputs, 1e-6, &posd, rp, [&mut pair0, &mut pair1]).unwrap();
        let what =
            format!("rms_norm_rope_pair {mode:?} head {head_dim} heads {n_heads} + {heads1}");
        check_bits(&mut failures, &what, &dev.download(&pair0).unwrap(), &got);
        let alone1 = dev.download(&alone1).unwrap();
        check_bits(
            &mut failures,
            &what,
            &dev.download(&pair1).unwrap(),
            &alone1,
        );
    }
    assert_no_failures(failures);
}

#[test]
fn moe_add_rms_norm_equals_the_combine_the_shared_expert_and_the_norm() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(73);
    let mut failures = Vec::new();
    // (width, slots, shared expert, gated): qwen3moe's token (2048, 8 slots), qwen35moe's (2048, 8, gated
    // shared expert), a routed sum given whole with an ungated shared expert, a narrow row, more slots
    // than the kernel keeps in registers (summed a slot at a time).
    for (n, k, shared, gated) in [
        (2048, 8, false, false),
        (2048, 8, true, true),
        (1024, 0, true, false),
        (96, 4, true, true),
        (512, 10, true, false),
    ] {
        let y: Vec<f32> = normals(&mut rng, k.max(1) * n);
        let weights: Vec<f32> = (0..k).map(|j| 0.05 + 0.1 * j as f32).collect();
        let sh = normals(&mut rng, n);
        let gate = [0.7f32];
        let residual: Vec<f32> = normals(&mut rng, n).iter().map(|v| v * 3.0).collect();
        let w = normals(&mut rng, n);
        let (yd, wtd, shd, gd) = (
            dev.upload(&y).unwrap(),
            dev.upload(&weights)
                .unwrap_or_else(|_| dev.zeros::<f32>(1).unwrap()),
            dev.upload(&sh).unwrap(),
            dev.upload(&gate).unwrap(),
        );
        let (rd, wd) = (dev.upload(&residual).unwrap(), dev.upload(&w).unwrap());

        // The separate launches, as the composed forward runs them.
        let mut routed = dev.zeros::<f32>(n).unwrap();
        match k {
            0 => routed = dev.upload(&y).unwrap(),
            _ => ops::moe_combine(&dev, &yd, &wtd, k, false, &mut routed).unwrap(),
        }
        let mut ffn_out = routed;
        if shared {
            let mut scaled = dev.zeros::<f32>(n).unwrap();
            match gated {
                true => {
                    let mut sig = dev.zeros::<f32>(1).unwrap();
                    ew::unary(&dev, &gd, UnaryFn::Sigmoid, &mut sig).unwrap();
                    ew::binary(
                        &dev,
                        &shd,
                        &sig,
                        n,
                        BinaryOp::Mul,
                        Broadcast::PerRow,
                        &mut scaled,
                    )
                    .unwrap();
                }
                false => scaled = dev.upload(&sh).unwrap(),
            }
            let mut sum = dev.zeros::<f32>(n).unwrap();
            ew::binary(
                &dev,
                &ffn_out,
                &scaled,
                n,
                BinaryOp::Add,
                Broadcast::None,
                &mut sum,
            )
            .unwrap();
            ffn_out = sum;
        }
        let (mut sum_a, mut out_a) = (dev.zeros::<f32>(n).unwrap(), dev.zeros::<f32>(n).unwrap());
        let mut q_a = dev.zeros::<BlockQ8_1>(n / 32).unwrap();
        let outs = (&mut sum_a, &mut out_a);
        fused::add_rms_norm(
            &dev,
            (&ffn_out, &rd),
            n,
            Some(&wd),
            1e-6,
            outs,
            Some(&mut q_a),
        )
        .unwrap();

        let (mut sum_b, mut out_b) = (dev.zeros::<f32>(n).unwrap(), dev.zeros::<f32>(n).unwrap());
        let mut q_b = dev.zeros::<BlockQ8_1>(n / 32).unwrap();
        let routed_in = match k {
            0 => fused::RoutedOut::Summed(&yd),
            _ => fused::RoutedOut::Slots {
                y: &yd,
                weights: &wtd,
            },
        };
        let shared_in = shared.then(|| fused::SharedOut {
            y: &shd,
            gate: gated.then_some(&gd),
        });
        fused::moe_add_rms_norm(
            &dev,
            (routed_in, shared_in),
            (&rd, Some(&wd), 1e-6),
            (&mut sum_b, &mut out_b, &mut q_b),
        )
        .unwrap();
        let what = format!("moe_add_rms_norm width {n} slots {k} shared {shared} gated {gated}");
        let (sa, sb) = (dev.download(&sum_a).unwrap(), dev.download(&sum_b).unwrap());
        check_bits(&mut failures, &format!("{what}: sum"), &sb, &sa);
        let (oa, ob) = (dev.download(&out_a).unwrap(), dev.download(&out_b).unwrap());
        check_bits(&mut failures, &format!("{what}: normed"), &ob, &oa);
        if dev.download(&q_a).unwrap() != dev.download(&q_b).unwrap() {
            failures.push(format!("{what}: the quantized copy differs"));
        }
    }
    assert_no_failures(failures);
}

/// Bound of a quantized matrix×vector against the CPU (as `cuda_ops.rs`): the two sides quantize the
/// activation to different formats.
const MATVEC_Q_NMSE: f64 = 5e-4;

/// `rows` matrices of `ty` and `cols` columns times one vector in one launch, against the CPU and against
/// one `matvec_q` per matrix.
fn check_many(dev: &Device, ty: GgmlType, rows: &[usize], cols: usize, seed: u64) -> Vec<String> {
    let mut failures = Vec::new();
    let mut rng = Rng::new(seed);
    let x = normals(&mut rng, cols);
    let host: Vec<Vec<u8>> = rows
        .iter()
        .map(|&r| random_weights(ty, &mut rng, r * cols))
        .collect();
    let mats: Vec<DeviceMatrix> = rows
        .iter()
        .zip(&host)
        .map(|(&r, w)| DeviceMatrix::upload(dev, ty, r, cols, w).unwrap())
        .collect();
    let xd = dev.upload(&x).unwrap();
    let mut xq = dev.zeros::<BlockQ8_1>(cols / 32).unwrap();
    ops::quantize_q8_1(dev, &xd, &mut xq).unwrap();
    let mut ys: Vec<_> = rows
        .iter()
        .map(|&r| dev.upload(&vec![f32::NAN; r]).unwrap())
        .collect();
    {
        let refs: Vec<&DeviceMatrix> = mats.iter().collect();
        let mut outs: Vec<_> = ys.iter_mut().collect();
        fused::matvec_q_many(dev, &refs, &xq, &mut outs).unwrap();
    }
    for (m, (&r, w)) in rows.iter().zip(&host).enumerate() {
        let what = format!("matvec_many {ty} matrix {m} of {rows:?} x {cols}");
        let got = dev.download(&ys[m]).unwrap();
        let mut want = vec![0f32; r];
        matvec(&QuantMatrix::new(ty, r, cols, w).unwrap(), &x, &mut want);
        check_nmse(&mut failures, &what, &got, &want, MATVEC_Q_NMSE);
        let mut alone = dev.zeros::<f32>(r).unwrap();
        ops::matvec_q(dev, &mats[m], &xq, &mut alone).unwrap();
        check_bits(&mut failures, &what, &got, &dev.download(&alone).unwrap());
    }
    failures
}

#[test]
fn matvec_many_matches_the_cpu_and_one_launch_per_matrix() {
    let Some(dev) = device() else { return };
    let mut failures = Vec::new();
    let types = [
        GgmlType::Q4_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_XS,
        GgmlType::IQ2_XXS,
        GgmlType::IQ2_XS,
        GgmlType::IQ2_S,
        GgmlType::IQ3_XXS,
        GgmlType::IQ3_S,
        GgmlType::IQ1_S,
        GgmlType::IQ1_M,
    ];
    for (i, ty) in types.into_iter().enumerate() {
        // qwen3moe's q, k, v (4096, 512, 512 rows of 2048); Qwen3.5's delta-net inputs (qkv, z, beta,
        // alpha: 8192, 4096, 32, 32 rows); rows that end inside a block; two matrices of 768 columns.
        let shapes: [(&[usize], usize); 4] = [
            (&[4096, 512, 512], 2048),
            (&[8192, 4096, 32, 32], 2048),
            (&[67, 5, 130], 1024),
            (&[1027, 2050], 768),
        ];
        for (j, (rows, cols)) in shapes.into_iter().enumerate() {
            failures.extend(check_many(
                &dev,
                ty,
                rows,
                cols,
                100 + 10 * i as u64 + j as u64,
            ));
        }
    }
    assert_no_failures(failures);
}

#[test]
fn fused_ops_refuse_bad_arguments() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(73);
    let cols = 256;
    let a = dev.upload(&normals(&mut rng, 2 * cols)).unwrap();
    let short = dev.upload(&normals(&mut rng, cols)).unwrap();
    let mut s = dev.zeros::<f32>(2 * cols).unwrap();
    let mut o = dev.zeros::<f32>(2 * cols).unwrap();
    // b of another length; a group that does not divide the row; a quantized copy of groups of 100.
    let r = fused::add_rms_norm(&dev, (&a, &short), cols, None, 1e-6, (&mut s, &mut o), None);
    assert!(matches!(r, Err(CudaError::Invalid(_))), "{r:?}");
    let r = fused::add_rms_norm(&dev, (&a, &a), 300, None, 1e-6, (&mut s, &mut o), None);
    assert!(matches!(r, Err(CudaError::Invalid(_))), "{r:?}");
    let a100 = dev.upload(&normals(&mut rng, 200)).unwrap();
    let (mut s100, mut o100) = (
        dev.zeros::<f32>(200).unwrap(),
        dev.zeros::<f32>(200).unwrap(),
    );
    let mut q = dev.zeros::<BlockQ8_1>(200 / 32).unwrap();
    let r = fused::add_rms_norm(
        &dev,
        (&a100, &a100),
        100,
        None,
        1e-6,
        (&mut s100, &mut o100),
        Some(&mut q),
    );
    assert!(matches!(r, Err(CudaError::Invalid(_))), "{r:?}");

    // Matrices of two formats, or too many, in one launch.
    let mk = |ty: GgmlType, rows: usize, rng: &mut Rng| {
        DeviceMatrix::upload(&dev, ty, rows, cols, &random_weights(ty, rng, rows * cols)).unwrap()
    };
    let m4 = mk(GgmlType::Q4_K, 8, &mut rng);
    let m6 = mk(GgmlType::Q6_K, 8, &mut rng);
    let xq = dev.zeros::<BlockQ8_1>(cols / 32).unwrap();
    let mut y1 = dev.zeros::<f32>(8).unwrap();
    let mut y2 = dev.zeros::<f32>(8).unwrap();
    let r = fused::matvec_q_many(&dev, &[&m4, &m6], &xq, &mut [&mut y1, &mut y2]);
    assert!(matches!(r, Err(CudaError::Invalid(_))), "{r:?}");
    let many = vec![&m4; MATVEC_MANY_MAX + 1];
    let mut bufs: Vec<_> = (0..MATVEC_MANY_MAX + 1)
        .map(|_| dev.zeros::<f32>(8).unwrap())
        .collect();
    let mut outs: Vec<_> = bufs.iter_mut().collect();
    let r = fused::matvec_q_many(&dev, &many, &xq, &mut outs);
    assert!(matches!(r, Err(CudaError::Invalid(_))), "{r:?}");
    // A result of the wrong length.
    let mut y_short = dev.zeros::<f32>(7).unwrap();
    let r = fused::matvec_q_many(&dev, &[&m4, &m4], &xq, &mut [&mut y1, &mut y_short]);
    assert!(matches!(r, Err(CudaError::Invalid(_))), "{r:?}");
    // The device still works after the refusals.
    dev.synchronize().unwrap();
}

/// The existing kernels the engine's compound operations use in place of several launches give the values
/// of those launches bit for bit: `rms_norm_gated` (groups up to its 128 threads: qwen3.6's heads of 128)
/// against rms_norm, SiLU and the product; `swiglu_f32` / `geglu_f32` against the activation and the
/// product; the convolution with its SiLU against the convolution then SiLU. (Each is checked against the
/// CPU in cuda_layer_ops.rs / cuda_ops.rs.)
#[test]
fn kernels_standing_for_op_sequences_equal_those_sequences() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(74);
    let mut failures = Vec::new();
    let mul = |a: &DeviceBuffer<f32>, b: &DeviceBuffer<f32>, out: &mut DeviceBuffer<f32>| {
        ew::binary(&dev, a, b, 1, BinaryOp::Mul, Broadcast::None, out).unwrap();
    };
    for (group, rows) in [(128, 32), (64, 5)] {
        let n = group * rows;
        let x = dev.upload(&normals(&mut rng, n)).unwrap();
        let z = dev.upload(&normals(&mut rng, n)).unwrap();
        let w = dev.upload(&normals(&mut rng, group)).unwrap();
        let mut fused_out = dev.zeros::<f32>(n).unwrap();
        recurrent::rms_norm_gated(&dev, &x, &w, &z, 1e-6, &mut fused_out).unwrap();
        let mut normed = dev.zeros::<f32>(n).unwrap();
        ops::rms_norm(&dev, &x, group, Some(&w), 1e-6, &mut normed).unwrap();
        let mut zs = dev.zeros::<f32>(n).unwrap();
        ops::silu(&dev, &z, &mut zs).unwrap();
        let mut seq = dev.zeros::<f32>(n).unwrap();
        mul(&normed, &zs, &mut seq);
        check_bits(
            &mut failures,
            &format!("rms_norm_gated group {group}"),
            &dev.download(&fused_out).unwrap(),
            &dev.download(&seq).unwrap(),
        );
    }
    let n = 3 * 768;
    let g = dev.upload(&normals(&mut rng, n)).unwrap();
    let u = dev.upload(&normals(&mut rng, n)).unwrap();
    let (mut fused_out, mut act, mut seq) = (
        dev.zeros::<f32>(n).unwrap(),
        dev.zeros::<f32>(n).unwrap(),
        dev.zeros::<f32>(n).unwrap(),
    );
    ops::swiglu(&dev, &g, &u, &mut fused_out).unwrap();
    ops::silu(&dev, &g, &mut act).unwrap();
    mul(&act, &u, &mut seq);
    check_bits(
        &mut failures,
        "swiglu",
        &dev.download(&fused_out).unwrap(),
        &dev.download(&seq).unwrap(),
    );
    ops::geglu(&dev, &g, &u, &mut fused_out).unwrap();
    ops::gelu(&dev, &g, &mut act).unwrap();
    mul(&act, &u, &mut seq);
    check_bits(
        &mut failures,
        "geglu",
        &dev.download(&fused_out).unwrap(),
        &dev.download(&seq).unwrap(),
    );
    // The convolution over one token (decode) and a prompt, from the same state.
    let (channels, kernel) = (96, 4);
    let w = dev.upload(&normals(&mut rng, channels * kernel)).unwrap();
    let state0 = normals(&mut rng, (kernel - 1) * channels);
    for n_tok in [1, 20] {
        let x = dev.upload(&normals(&mut rng, n_tok * channels)).unwrap();
        let mut s1 = dev.upload(&state0).unwrap();
        let mut s2 = dev.upload(&state0).unwrap();
        let mut fused_out = dev.zeros::<f32>(n_tok * channels).unwrap();
        recurrent::conv1d_causal(&dev, &x, &w, kernel, &mut s1, true, &mut fused_out).unwrap();
        let mut conv = dev.zeros::<f32>(n_tok * channels).unwrap();
        recurrent::conv1d_causal(&dev, &x, &w, kernel, &mut s2, false, &mut conv).unwrap();
        let mut seq = dev.zeros::<f32>(n_tok * channels).unwrap();
        ops::silu(&dev, &conv, &mut seq).unwrap();
        check_bits(
            &mut failures,
            &format!("conv1d with SiLU, {n_tok} tokens"),
            &dev.download(&fused_out).unwrap(),
            &dev.download(&seq).unwrap(),
        );
        check_bits(
            &mut failures,
            &format!("conv1d state after {n_tok} tokens"),
            &dev.download(&s1).unwrap(),
            &dev.download(&s2).unwrap(),
        );
    }
    assert_no_failures(failures);
}

#[test]
fn cols_rms_norm_scale_matches_the_cpu_and_the_three_launches() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(75);
    let mut failures = Vec::new();
    // Qwen3.6's conv output (q, k of 16 heads of 128, v of 32 heads), one token and a prompt; the tiny
    // fixture's (heads of 64).
    for (rows, head, n_k, n_v) in [(1, 128, 16, 32), (9, 128, 16, 32), (3, 64, 2, 4)] {
        let key_dim = n_k * head;
        let in_cols = 2 * key_dim + n_v * head;
        let x = normals(&mut rng, rows * in_cols);
        let (eps, s) = (1e-6 / head as f32, 1.0 / (head as f32).sqrt());
        let xd = dev.upload(&x).unwrap();
        for start in [0, key_dim] {
            let part: Vec<f32> = x
                .chunks_exact(in_cols)
                .flat_map(|r| r[start..start + key_dim].to_vec())
                .collect();
            let mut want = vec![0f32; part.len()];
            rms_norm(&part, head, None, eps, &mut want);
            want.iter_mut().for_each(|v| *v *= s);
            let mut out = dev.upload(&vec![f32::NAN; rows * key_dim]).unwrap();
            fused::rms_norm_cols_scale(
                &dev,
                (&xd, in_cols),
                (start, key_dim),
                (head, eps, s),
                &mut out,
            )
            .unwrap();
            let got = dev.download(&out).unwrap();
            let what = format!("cols_rms_norm_scale rows {rows} head {head} from column {start}");
            check_nmse(&mut failures, &what, &got, &want, 1e-11);

            let mut cols = dev.zeros::<f32>(rows * key_dim).unwrap();
            ew::cols(&dev, &xd, in_cols, start, key_dim, &mut cols).unwrap();
            let mut normed = dev.zeros::<f32>(rows * key_dim).unwrap();
            ops::rms_norm(&dev, &cols, head, None, eps, &mut normed).unwrap();
            let mut seq = dev.zeros::<f32>(rows * key_dim).unwrap();
            ew::scale(&dev, &normed, s, &mut seq).unwrap();
            check_bits(&mut failures, &what, &got, &dev.download(&seq).unwrap());
        }
    }
    assert_no_failures(failures);
}

#[test]
fn delta_gates_match_the_cpu_and_the_four_launches() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(76);
    let mut failures = Vec::new();
    for (rows, n_heads) in [(1, 32), (17, 32), (4, 4)] {
        let n = rows * n_heads;
        // Wide enough that softplus takes both branches (above 20 it passes).
        let beta: Vec<f32> = normals(&mut rng, n).iter().map(|v| v * 4.0).collect();
        let alpha: Vec<f32> = normals(&mut rng, n).iter().map(|v| v * 12.0).collect();
        let dt_bias = normals(&mut rng, n_heads);
        let a: Vec<f32> = normals(&mut rng, n_heads)
            .iter()
            .map(|v| -v.abs())
            .collect();
        let want_beta: Vec<f32> = beta.iter().map(|&b| sigmoid(b)).collect();
        let want_gate: Vec<f32> = (0..n)
            .map(|i| softplus(alpha[i] + dt_bias[i % n_heads]) * a[i % n_heads])
            .collect();
        let (bd, ad) = (dev.upload(&beta).unwrap(), dev.upload(&alpha).unwrap());
        let (biasd, decayd) = (dev.upload(&dt_bias).unwrap(), dev.upload(&a).unwrap());
        let inputs = fused::DeltaGateInputs {
            beta: &bd,
            alpha: &ad,
            dt_bias: &biasd,
            a: &decayd,
        };
        let mut beta_out = dev.zeros::<f32>(n).unwrap();
        let mut gate = dev.zeros::<f32>(n).unwrap();
        fused::delta_gates(&dev, &inputs, &mut beta_out, &mut gate).unwrap();
        let (got_beta, got_gate) = (
            dev.download(&beta_out).unwrap(),
            dev.download(&gate).unwrap(),
        );
        let what = format!("delta_gates rows {rows} heads {n_heads}");
        check_nmse(
            &mut failures,
            &format!("{what} beta"),
            &got_beta,
            &want_beta,
            1e-12,
        );
        check_nmse(
            &mut failures,
            &format!("{what} gate"),
            &got_gate,
            &want_gate,
            1e-12,
        );

        let mut seq_beta = dev.zeros::<f32>(n).unwrap();
        ew::unary(&dev, &bd, UnaryFn::Sigmoid, &mut seq_beta).unwrap();
        let mut t1 = dev.zeros::<f32>(n).unwrap();
        let col = Broadcast::PerColumn;
        ew::binary(&dev, &ad, &biasd, n_heads, BinaryOp::Add, col, &mut t1).unwrap();
        let mut t2 = dev.zeros::<f32>(n).unwrap();
        ew::unary(&dev, &t1, UnaryFn::Softplus, &mut t2).unwrap();
        let mut seq_gate = dev.zeros::<f32>(n).unwrap();
        ew::binary(
            &dev,
            &t2,
            &decayd,
            n_heads,
            BinaryOp::Mul,
            col,
            &mut seq_gate,
        )
        .unwrap();
        check_bits(
            &mut failures,
            &format!("{what} beta"),
            &got_beta,
            &dev.download(&seq_beta).unwrap(),
        );
        check_bits(
            &mut failures,
            &format!("{what} gate"),
            &got_gate,
            &dev.download(&seq_gate).unwrap(),
        );
    }
    assert_no_failures(failures);
}
