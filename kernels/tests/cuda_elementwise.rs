//! The element-wise and layout kernels of `elementwise.cu` against plain CPU loops on random inputs: add and
//! multiply (same shape, per row, per column), scale, sigmoid / softplus / tanh / exp (normalized error),
//! column slices, head parts, repeated heads (both orders), the f16 KV store (also at device positions), the
//! SwiGLU and the RMS norm fused with q8_1 quantization (bit for bit the two-step results), and the partial
//! device copies and cache-prefix attention the engine's GPU backend uses.
//!
//! Runs on the GPU machine; without a CUDA device (CI) each test prints "skipped: no CUDA device" and
//! passes. Cost: well under a second on an H200.

#![cfg(feature = "cuda")]

use poly_kernels::cuda::attention::{attention_f16, attention_f16_cache, AttnSplit, KvCacheView};
use poly_kernels::cuda::elementwise::{self as ew, BinaryOp, Broadcast, UnaryFn};
use poly_kernels::cuda::ops;
use poly_kernels::cuda::BlockQ8_1;
use poly_kernels::ops::act::{sigmoid, softplus};
use poly_kernels::ops::attention::AttnParams;
use poly_kernels::rng::Rng;

mod common;
use common::{device, nmse};

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.f32() * 4.0 - 2.0).collect()
}

#[test]
fn binary_scale_and_unary_match_the_cpu() {
    let Some(dev) = device() else { return };
    let (rows, cols) = (7, 96);
    let a = random(rows * cols, 1);
    let b = random(rows * cols, 2);
    let (da, db) = (dev.upload(&a).unwrap(), dev.upload(&b).unwrap());
    let mut out = dev.zeros::<f32>(rows * cols).unwrap();
    for (op, bc) in [
        (BinaryOp::Add, Broadcast::None),
        (BinaryOp::Mul, Broadcast::None),
        (BinaryOp::Mul, Broadcast::PerRow),
        (BinaryOp::Add, Broadcast::PerColumn),
        (BinaryOp::Mul, Broadcast::PerColumn),
    ] {
        let blen = match bc {
            Broadcast::None => rows * cols,
            Broadcast::PerRow => rows,
            Broadcast::PerColumn => cols,
        };
        let bb = dev.upload(&b[..blen]).unwrap();
        let db_use = if blen == rows * cols { &db } else { &bb };
        ew::binary(&dev, &da, db_use, cols, op, bc, &mut out).unwrap();
        let got = dev.download(&out).unwrap();
        let want: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let bv = match bc {
                    Broadcast::None => b[i],
                    Broadcast::PerRow => b[i / cols],
                    Broadcast::PerColumn => b[i % cols],
                };
                match op {
                    BinaryOp::Add => a[i] + bv,
                    BinaryOp::Mul => a[i] * bv,
                }
            })
            .collect();
        assert_eq!(got, want, "{op:?} {bc:?}");
    }
    ew::scale(&dev, &da, 0.37, &mut out).unwrap();
    let want: Vec<f32> = a.iter().map(|v| v * 0.37).collect();
    assert_eq!(dev.download(&out).unwrap(), want);
    let big: Vec<f32> = a.iter().map(|v| v * 15.0).collect();
    let dbig = dev.upload(&big).unwrap();
    for (f, cpu) in [
        (UnaryFn::Sigmoid, sigmoid as fn(f32) -> f32),
        (UnaryFn::Softplus, softplus),
        (UnaryFn::Tanh, f32::tanh),
        (UnaryFn::Exp, f32::exp),
    ] {
        ew::unary(&dev, &dbig, f, &mut out).unwrap();
        let got = dev.download(&out).unwrap();
        let want: Vec<f32> = big.iter().map(|&v| cpu(v)).collect();
        let e = nmse(&got, &want);
        println!("{f:?}: nmse {e:.3e}");
        assert!(e < 1e-12, "{f:?}: nmse {e:.3e}");
    }
}

#[test]
fn layout_kernels_move_the_right_values() {
    let Some(dev) = device() else { return };
    let (rows, n_heads, head) = (3, 4, 8);
    // cols
    let x = random(rows * 40, 3);
    let dx = dev.upload(&x).unwrap();
    let mut out = dev.zeros::<f32>(rows * 12).unwrap();
    ew::cols(&dev, &dx, 40, 5, 12, &mut out).unwrap();
    let want: Vec<f32> = (0..rows)
        .flat_map(|r| x[r * 40 + 5..r * 40 + 17].to_vec())
        .collect();
    assert_eq!(dev.download(&out).unwrap(), want);
    // head_part: 2 parts of each head group
    let x = random(rows * n_heads * 2 * head, 4);
    let dx = dev.upload(&x).unwrap();
    let mut out = dev.zeros::<f32>(rows * n_heads * head).unwrap();
    for part in 0..2 {
        ew::head_part(&dev, &dx, rows, head, 2, part, &mut out).unwrap();
        let mut want = Vec::new();
        for r in 0..rows {
            for h in 0..n_heads {
                let s = r * n_heads * 2 * head + h * 2 * head + part * head;
                want.extend_from_slice(&x[s..s + head]);
            }
        }
        assert_eq!(dev.download(&out).unwrap(), want, "part {part}");
    }
    // repeat_heads, both orders
    let times = 3;
    let x = random(rows * n_heads * head, 5);
    let dx = dev.upload(&x).unwrap();
    let mut out = dev.zeros::<f32>(rows * n_heads * times * head).unwrap();
    for interleave in [false, true] {
        ew::repeat_heads(&dev, &dx, rows, head, times, interleave, &mut out).unwrap();
        let mut want = vec![0f32; rows * n_heads * times * head];
        for r in 0..rows {
            for h in 0..n_heads {
                for t in 0..times {
                    let slot = if interleave {
                        h * times + t
                    } else {
                        t * n_heads + h
                    };
                    let dst = r * n_heads * times * head + slot * head;
                    let src = r * n_heads * head + h * head;
                    want[dst..dst + head].copy_from_slice(&x[src..src + head]);
                }
            }
        }
        assert_eq!(dev.download(&out).unwrap(), want, "interleave {interleave}");
    }
    // kv_store_f16 and partial copies
    let v = random(64, 6);
    let dv = dev.upload(&v).unwrap();
    let mut cache = dev.zeros::<u16>(256).unwrap();
    ew::kv_store_f16(&dev, &dv, &mut cache, 100).unwrap();
    let got = dev.download_range(&cache, 100, 64).unwrap();
    let want: Vec<u16> = v
        .iter()
        .map(|&x| half::f16::from_f32(x).to_bits())
        .collect();
    assert_eq!(got, want);
    assert!(ew::kv_store_f16(&dev, &dv, &mut cache, 200).is_err());
    dev.write_at(&[7u16, 8, 9], &mut cache, 10).unwrap();
    assert_eq!(
        dev.download_range(&cache, 9, 5).unwrap(),
        vec![0, 7, 8, 9, 0]
    );
}

#[test]
fn attention_over_a_cache_prefix_equals_attention_over_exactly_those_rows() {
    let Some(dev) = device() else { return };
    let p = AttnParams {
        n_head: 4,
        n_head_kv: 2,
        head_dim_k: 64,
        head_dim_v: 64,
        scale: 0.125,
        window: None,
        softcap: None,
        sees_together: None,
    };
    let (n_kv, cap, n_q) = (37, 128, 3);
    let kw = p.n_head_kv * p.head_dim_k;
    let to16 = |x: &[f32]| -> Vec<u16> {
        x.iter()
            .map(|&v| half::f16::from_f32(v).to_bits())
            .collect()
    };
    let k = to16(&random(n_kv * kw, 7));
    let v = to16(&random(n_kv * kw, 8));
    let q = random(n_q * p.n_head * p.head_dim_k, 9);
    let pos: Vec<i32> = (0..n_q as i32)
        .map(|i| n_kv as i32 - n_q as i32 + i)
        .collect();
    let (dq, dpos) = (dev.upload(&q).unwrap(), dev.upload(&pos).unwrap());
    let (dk, dvv) = (dev.upload(&k).unwrap(), dev.upload(&v).unwrap());
    let mut want = dev.zeros::<f32>(n_q * p.n_head * p.head_dim_v).unwrap();
    attention_f16(
        &dev,
        &dq,
        &dpos,
        &dk,
        &dvv,
        &p,
        AttnSplit::none(n_kv),
        None,
        &mut want,
    )
    .unwrap();
    // The same rows at the start of a larger cache whose other rows hold garbage.
    let mut big_k = to16(&random(cap * kw, 10));
    let mut big_v = to16(&random(cap * kw, 11));
    big_k[..k.len()].copy_from_slice(&k);
    big_v[..v.len()].copy_from_slice(&v);
    let (bk, bv) = (dev.upload(&big_k).unwrap(), dev.upload(&big_v).unwrap());
    let mut got = dev.zeros::<f32>(n_q * p.n_head * p.head_dim_v).unwrap();
    let view = KvCacheView {
        k: &bk,
        v: &bv,
        n_kv: Some(n_kv),
    };
    attention_f16_cache(
        &dev,
        &dq,
        &dpos,
        view,
        &p,
        AttnSplit::none(n_kv),
        None,
        &mut got,
    )
    .unwrap();
    assert_eq!(dev.download(&got).unwrap(), dev.download(&want).unwrap());
}

#[test]
fn kv_store_at_device_positions_writes_those_rows_only() {
    let Some(dev) = device() else { return };
    let (kw, vw, n_ctx) = (24, 40, 16);
    let mut k_cache = dev.zeros::<u16>(n_ctx * kw).unwrap();
    let mut v_cache = dev.zeros::<u16>(n_ctx * vw).unwrap();
    // Rows 0..3 to positions 5, 9, 2, and a fourth row past the cache (skipped).
    let positions = [5i32, 9, 2, n_ctx as i32];
    let k = random(4 * kw, 7);
    let v = random(4 * vw, 8);
    let (dk, dv) = (dev.upload(&k).unwrap(), dev.upload(&v).unwrap());
    let dpos = dev.upload(&positions).unwrap();
    let dst = ew::KvDst {
        k: &mut k_cache,
        v: &mut v_cache,
        k_width: kw,
        v_width: vw,
    };
    ew::kv_store_f16_pos(&dev, &dk, &dv, &dpos, dst).unwrap();
    let f16 = |x: &[f32]| -> Vec<u16> {
        x.iter()
            .map(|&y| half::f16::from_f32(y).to_bits())
            .collect()
    };
    let mut want_k = vec![0u16; n_ctx * kw];
    let mut want_v = vec![0u16; n_ctx * vw];
    for (r, &p) in positions.iter().enumerate().take(3) {
        let p = p as usize;
        want_k[p * kw..(p + 1) * kw].copy_from_slice(&f16(&k[r * kw..(r + 1) * kw]));
        want_v[p * vw..(p + 1) * vw].copy_from_slice(&f16(&v[r * vw..(r + 1) * vw]));
    }
    assert_eq!(dev.download(&k_cache).unwrap(), want_k);
    assert_eq!(dev.download(&v_cache).unwrap(), want_v);
    // Wrong lengths are refused.
    let dst = ew::KvDst {
        k: &mut k_cache,
        v: &mut v_cache,
        k_width: kw + 1,
        v_width: vw,
    };
    assert!(ew::kv_store_f16_pos(&dev, &dk, &dv, &dpos, dst).is_err());
}

#[test]
fn swiglu_into_q8_1_equals_swiglu_then_quantize() {
    let Some(dev) = device() else { return };
    let n = 8 * 768;
    let gate: Vec<f32> = random(n, 9).iter().map(|v| v * 4.0).collect();
    let up = random(n, 10);
    let (dg, du) = (dev.upload(&gate).unwrap(), dev.upload(&up).unwrap());
    let mut h = dev.zeros::<f32>(n).unwrap();
    ops::swiglu(&dev, &dg, &du, &mut h).unwrap();
    let mut want = dev.zeros::<BlockQ8_1>(n / 32).unwrap();
    ops::quantize_q8_1(&dev, &h, &mut want).unwrap();
    let mut got = dev.zeros::<BlockQ8_1>(n / 32).unwrap();
    ops::swiglu_quantize_q8_1(&dev, &dg, &du, &mut got).unwrap();
    assert_eq!(dev.download(&got).unwrap(), dev.download(&want).unwrap());
    // Not whole blocks: refused.
    let (g5, u5) = (
        dev.upload(&gate[..40]).unwrap(),
        dev.upload(&up[..40]).unwrap(),
    );
    let mut q = dev.zeros::<BlockQ8_1>(1).unwrap();
    assert!(ops::swiglu_quantize_q8_1(&dev, &g5, &u5, &mut q).is_err());
}

#[test]
fn rms_norm_with_q8_1_equals_rms_norm_then_quantize() {
    let Some(dev) = device() else { return };
    for (rows, group, weighted) in [(1, 2048, true), (3, 128, false), (2, 4096, true)] {
        let x = random(rows * group, 11);
        let w = random(group, 12);
        let (dx, dw) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
        let weight = weighted.then_some(&dw);
        let mut want = dev.zeros::<f32>(rows * group).unwrap();
        ops::rms_norm(&dev, &dx, group, weight, 1e-6, &mut want).unwrap();
        let mut want_q = dev.zeros::<BlockQ8_1>(rows * group / 32).unwrap();
        ops::quantize_q8_1(&dev, &want, &mut want_q).unwrap();
        let mut got = dev.zeros::<f32>(rows * group).unwrap();
        let mut got_q = dev.zeros::<BlockQ8_1>(rows * group / 32).unwrap();
        ops::rms_norm_quantize_q8_1(&dev, &dx, group, weight, 1e-6, (&mut got, &mut got_q))
            .unwrap();
        let what = format!("{rows} × {group}, weight {weighted}");
        assert_eq!(
            dev.download(&got).unwrap(),
            dev.download(&want).unwrap(),
            "{what}"
        );
        assert_eq!(
            dev.download(&got_q).unwrap(),
            dev.download(&want_q).unwrap(),
            "{what}"
        );
    }
    // Groups that are not whole blocks of 32 are refused.
    let dx = dev.upload(&random(40, 13)).unwrap();
    let mut out = dev.zeros::<f32>(40).unwrap();
    let mut q = dev.zeros::<BlockQ8_1>(1).unwrap();
    assert!(ops::rms_norm_quantize_q8_1(&dev, &dx, 40, None, 1e-6, (&mut out, &mut q)).is_err());
}
