//! Prompt attention on the tensor cores (`attention_mma`) against the CPU op, on random queries, keys and
//! values (the keys and values rounded to f16 for both sides, as the cache holds them), with a normalized
//! error bound (NMSE = Σ(gpu − cpu)² / Σ cpu²) that allows for the f16 rounding of the queries and of the
//! softmax weights the kernel multiplies with; and against the CUDA-core kernel (`attention_f16`).
//!
//! Runs on the GPU machine; without a CUDA device (CI) it prints "skipped: no CUDA device" and passes.
//! Cost on an H200: about a second (the CPU reference dominates).

#![cfg(feature = "cuda")]

use poly_kernels::cuda::attention::{attention_f16, AttnSplit, KvCacheView};
use poly_kernels::cuda::attention_mma::{attention_prompt, takes};
use poly_kernels::ops::attention::{attention, AttnParams};
use poly_kernels::rng::Rng;

mod common;
use common::{device, nmse};

fn params(n_head: usize, n_head_kv: usize, d: usize) -> AttnParams {
    AttnParams {
        n_head,
        n_head_kv,
        head_dim_k: d,
        head_dim_v: d,
        scale: 1.0 / (d as f32).sqrt(),
        window: None,
        softcap: None,
        sees_together: None,
    }
}

#[test]
fn prompt_attention_on_the_tensor_cores_matches_cpu() {
    let Some(dev) = device() else { return };
    let qwen3 = params(32, 4, 128);
    let qwen35 = params(16, 2, 256);
    let gemma = AttnParams {
        window: Some(50),
        softcap: Some(30.0),
        ..params(4, 1, 256)
    };
    let small = params(8, 8, 64);
    // (params, queries, cache rows): from the start of the context and after earlier context; query counts
    // that leave partial row tiles, caches that leave partial key tiles.
    let cases = [
        (qwen3, 70, 70),
        (qwen3, 100, 1000),
        (qwen35, 33, 33),
        (qwen35, 64, 300),
        (gemma, 100, 180),
        (small, 9, 130),
    ];
    let mut failures = Vec::new();
    for (i, &(p, n_q, n_kv)) in cases.iter().enumerate() {
        assert!(takes(&dev, &p, n_q), "case {i}");
        let mut rng = Rng::new(900 + i as u64);
        let mut normals = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.normal()).collect() };
        let q = normals(n_q * p.n_head * p.head_dim_k);
        let f16 = |v: Vec<f32>| -> (Vec<f32>, Vec<u16>) {
            let h: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
            (
                h.iter().map(|x| x.to_f32()).collect(),
                h.iter().map(|x| x.to_bits()).collect(),
            )
        };
        let (k, kbits) = f16(normals(n_kv * p.n_head_kv * p.head_dim_k));
        let (v, vbits) = f16(normals(n_kv * p.n_head_kv * p.head_dim_v));
        let positions: Vec<u32> = ((n_kv - n_q) as u32..n_kv as u32).collect();
        let mut want = vec![0f32; n_q * p.n_head * p.head_dim_v];
        attention(&q, &positions, &k, &v, &p, &mut want);

        let qd = dev.upload(&q).unwrap();
        let pos: Vec<i32> = positions.iter().map(|&x| x as i32).collect();
        let posd = dev.upload(&pos).unwrap();
        // A cache with room past the filled rows (garbage there must not be read).
        let mut kpad = kbits.clone();
        kpad.extend(std::iter::repeat_n(
            0x7c00u16,
            32 * p.n_head_kv * p.head_dim_k,
        ));
        let mut vpad = vbits.clone();
        vpad.extend(std::iter::repeat_n(
            0x7c00u16,
            32 * p.n_head_kv * p.head_dim_v,
        ));
        let (kd, vd) = (dev.upload(&kpad).unwrap(), dev.upload(&vpad).unwrap());
        let cache = KvCacheView {
            k: &kd,
            v: &vd,
            n_kv: Some(n_kv),
        };
        let mut out = dev.zeros::<f32>(want.len()).unwrap();
        attention_prompt(&dev, &qd, &posd, cache, &p, &mut out).unwrap();
        let got = dev.download(&out).unwrap();
        let e = nmse(&got, &want);
        let finite = got.iter().all(|x| x.is_finite());
        println!(
            "attention_mma heads {}/{} d {} n_q {n_q} n_kv {n_kv} window {:?} softcap {:?}: nmse {e:.3e}",
            p.n_head, p.n_head_kv, p.head_dim_k, p.window, p.softcap
        );
        if !finite || e.is_nan() || e > 2e-5 {
            failures.push(format!("case {i}: nmse {e:.3e}, finite {finite}"));
        }
        // The CUDA-core kernel on the same cache: the same numbers up to the f16 roundings.
        let (k2, v2) = (dev.upload(&kbits).unwrap(), dev.upload(&vbits).unwrap());
        let mut out2 = dev.zeros::<f32>(want.len()).unwrap();
        attention_f16(
            &dev,
            &qd,
            &posd,
            &k2,
            &v2,
            &p,
            AttnSplit::none(n_kv),
            None,
            &mut out2,
        )
        .unwrap();
        let e2 = nmse(&got, &dev.download(&out2).unwrap());
        if e2 > 2e-5 {
            failures.push(format!("case {i}: nmse {e2:.3e} against attn_f16"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
