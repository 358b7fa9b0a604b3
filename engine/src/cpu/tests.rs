//! The CPU backend's operations on a small hand-made file, against naive references.

use super::*;
use crate::state::KvPrecision;
use poly_kernels::quant::GgmlType;
use poly_kernels::rng::Rng;
use poly_models::arch::StateSpec;
use poly_models::compute::Gating;
use poly_models::gguf::{GgufWriter, Value};

const N_EMBD: usize = 32;
const N_FF: usize = 8;
const N_EXPERT: usize = 4;

/// A tensor of the test file: name, dims, values (F32).
type TestTensor = (&'static str, Vec<u64>, Vec<f32>);

/// The tensors of the test file.
fn tensors() -> Vec<TestTensor> {
    let mut rng = Rng::new(21);
    let mut normal = |n: usize, s: f32| (0..n).map(|_| rng.normal() * s).collect::<Vec<f32>>();
    let (e, f, x) = (N_EMBD as u64, N_FF as u64, N_EXPERT as u64);
    vec![
        ("w", vec![4], vec![1.0, 2.0, 3.0, 4.0]),
        ("conv", vec![3, 2], normal(6, 1.0)),
        ("router", vec![e, x], normal(N_EMBD * N_EXPERT, 0.5)),
        ("gate", vec![e, f, x], normal(N_EMBD * N_FF * N_EXPERT, 0.3)),
        ("up", vec![e, f, x], normal(N_EMBD * N_FF * N_EXPERT, 0.3)),
        ("down", vec![f, e, x], normal(N_FF * N_EMBD * N_EXPERT, 0.3)),
    ]
}

fn weights() -> (CpuWeights, Vec<TestTensor>) {
    let t = tensors();
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", Value::from("test"));
    for (name, dims, _) in &t {
        w.add_tensor(*name, GgmlType::F32, dims).unwrap();
    }
    let dir = std::env::temp_dir().join(format!("poly-engine-cpu-ops-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("ops-{:?}.gguf", std::thread::current().id()));
    w.write_to_path(&path, |i, _, out: &mut [u8]| {
        for (o, v) in out.chunks_exact_mut(4).zip(&t[i].2) {
            o.copy_from_slice(&v.to_le_bytes());
        }
        Ok(())
    })
    .unwrap();
    let file = Arc::new(GgufFile::open(&path).unwrap());
    (CpuWeights::new(file), t)
}

fn id(name: &str, t: &[TestTensor]) -> WeightId {
    WeightId(t.iter().position(|x| x.0 == name).unwrap() as u32)
}

fn mat(rows: usize, cols: usize, mut f: impl FnMut(usize, usize) -> f32) -> Mat {
    Mat::from_vec(
        rows,
        cols,
        (0..rows * cols).map(|i| f(i / cols, i % cols)).collect(),
    )
}

#[test]
fn reshaping_and_element_wise_ops() {
    let (w, t) = weights();
    let mut state = SeqState::new(&[], 8);
    let mut c = CpuForward::new(&w, &mut state, &[1, 2], Logits::Last);
    let x = mat(2, 4, |r, k| (r * 10 + k) as f32);
    assert_eq!(c.cols(&x, 1, 2).data, [1.0, 2.0, 11.0, 12.0]);
    assert_eq!(c.rows(&x, &[1]).data, [10.0, 11.0, 12.0, 13.0]);
    assert_eq!(c.mul_weight(&x, id("w", &t)).row(0), [0.0, 2.0, 6.0, 12.0]);
    assert_eq!(
        c.add_weight(&x, id("w", &t)).row(1),
        [11.0, 13.0, 15.0, 17.0]
    );
    let col = mat(2, 1, |r, _| r as f32 + 2.0);
    assert_eq!(c.mul(&x, &col).row(1), [30.0, 33.0, 36.0, 39.0]);
    // Two heads of two parts of 1 value: [h0p0, h0p1, h1p0, h1p1].
    assert_eq!(c.head_part(&x, 1, 2, 1).row(0), [1.0, 3.0]);
    // Heads [a b] of 2 values, repeated twice.
    let h = mat(1, 4, |_, k| k as f32);
    assert_eq!(
        c.repeat_heads(&h, 2, 2, true).data,
        [0.0, 1.0, 0.0, 1.0, 2.0, 3.0, 2.0, 3.0]
    );
    assert_eq!(
        c.repeat_heads(&h, 2, 2, false).data,
        [0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0]
    );
    assert_eq!(c.batch().output_rows(), [1]);
    assert_eq!(c.batch().pos0, 0);
}

#[test]
fn moe_matches_a_naive_reference() {
    let (w, t) = weights();
    let m = Moe {
        router: id("router", &t),
        gate_exps: id("gate", &t),
        up_exps: id("up", &t),
        down_exps: id("down", &t),
        n_expert: N_EXPERT,
        n_expert_used: 2,
        gating: Gating::Softmax,
        selection_bias: None,
        norm_weights: true,
        weights_scale: 1.5,
        act: Unary::Silu,
    };
    let mut rng = Rng::new(5);
    let n = 7;
    let x = mat(n, N_EMBD, |_, _| rng.normal());
    let mut state = SeqState::new(&[], 8);
    let tokens = vec![0u32; n];
    let out = CpuForward::new(&w, &mut state, &tokens, Logits::All).moe(0, &x, &m);
    let v = |name: &str| &t[id(name, &t).0 as usize].2;
    let (router, gate, up, down) = (v("router"), v("gate"), v("up"), v("down"));
    for r in 0..n {
        let xr = x.row(r);
        let logits: Vec<f64> = (0..N_EXPERT)
            .map(|e| {
                (0..N_EMBD)
                    .map(|k| router[e * N_EMBD + k] as f64 * xr[k] as f64)
                    .sum()
            })
            .collect();
        let z: f64 = logits.iter().map(|l| l.exp()).sum();
        let mut order: Vec<usize> = (0..N_EXPERT).collect();
        order.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap());
        let chosen = &order[..2];
        let psum: f64 = chosen.iter().map(|&e| logits[e].exp() / z).sum();
        let mut expect = vec![0f64; N_EMBD];
        for &e in chosen {
            let weight = logits[e].exp() / z / psum * 1.5;
            let h: Vec<f64> = (0..N_FF)
                .map(|j| {
                    let row = (e * N_FF + j) * N_EMBD;
                    let g: f64 = (0..N_EMBD)
                        .map(|k| gate[row + k] as f64 * xr[k] as f64)
                        .sum();
                    let u: f64 = (0..N_EMBD).map(|k| up[row + k] as f64 * xr[k] as f64).sum();
                    g / (1.0 + (-g).exp()) * u
                })
                .collect();
            for (i, o) in expect.iter_mut().enumerate() {
                let row = (e * N_EMBD + i) * N_FF;
                *o += weight * (0..N_FF).map(|j| down[row + j] as f64 * h[j]).sum::<f64>();
            }
        }
        for (i, &e) in expect.iter().enumerate() {
            assert!((out.row(r)[i] as f64 - e).abs() < 1e-4, "token {r} dim {i}");
        }
    }
    // A batch of no tokens gives no rows.
    let empty =
        CpuForward::new(&w, &mut state, &[], Logits::None).moe(0, &Mat::zeros(0, N_EMBD), &m);
    assert_eq!((empty.rows, empty.cols), (0, N_EMBD));
}

#[test]
fn stateful_ops_give_the_same_results_in_one_call_or_token_by_token() {
    let (w, t) = weights();
    let specs = [
        StateSpec::Kv {
            n_head_kv: 1,
            head_dim_k: 4,
            head_dim_v: 4,
            window: None,
        },
        StateSpec::Recurrent {
            conv_kernel: 3,
            conv_channels: 2,
            n_v_heads: 2,
            head_k: 4,
            head_v: 3,
        },
    ];
    let attn = Attention {
        n_head: 2,
        n_head_kv: 1,
        head_dim_k: 4,
        head_dim_v: 4,
        scale: 0.5,
        window: Some(3),
        softcap: None,
        picture_rows_see_each_other: false,
    };
    let net = DeltaNet {
        n_v_heads: 2,
        head_k: 4,
        head_v: 3,
    };
    let n = 5;
    let tokens = vec![0u32; n];
    let mut rng = Rng::new(9);
    let mut r = |cols: usize| mat(n, cols, |_, _| rng.normal() * 0.5);
    let (q, k, v, cx) = (r(8), r(4), r(4), r(2));
    let (dq, dk, dv, dg, db) = (r(8), r(8), r(6), r(2), r(2));
    let run = |rows: std::ops::Range<usize>, state: &mut SeqState| {
        let pick = |m: &Mat| {
            Mat::from_vec(
                rows.len(),
                m.cols,
                m.data[rows.start * m.cols..rows.end * m.cols].to_vec(),
            )
        };
        let mut c = CpuForward::new(&w, state, &tokens[rows.clone()], Logits::All);
        let a = c.attention(0, &pick(&q), &pick(&k), &pick(&v), &attn);
        let s = c.ssm_conv(1, &pick(&cx), id("conv", &t));
        let d = c.gated_delta_net(
            1,
            DeltaNetInputs {
                q: &pick(&dq),
                k: &pick(&dk),
                v: &pick(&dv),
                gate: &pick(&dg),
                beta: &pick(&db),
            },
            &net,
        );
        state.push_tokens(&tokens[rows]);
        (a, s, d)
    };
    let mut whole = SeqState::with_precision(&specs, 8, KvPrecision::F32);
    let all = run(0..n, &mut whole);
    let mut steps = SeqState::with_precision(&specs, 8, KvPrecision::F32);
    for i in 0..n {
        let one = run(i..i + 1, &mut steps);
        assert_eq!(one.0.row(0), all.0.row(i), "attention, token {i}");
        assert_eq!(one.1.row(0), all.1.row(i), "conv, token {i}");
        assert_eq!(one.2.row(0), all.2.row(i), "delta rule, token {i}");
    }
    assert_eq!(steps, whole);
    let LayerState::Kv(cache) = whole.layer(0) else {
        panic!("layer 0 is a KV cache")
    };
    assert_eq!(cache.keys(), &k.data[..]);
}

/// A Q8_0 cache's attention: keys and values stored rotated (llama.cpp's Walsh-Hadamard rotations around
/// a quantized cache) and quantized, the output rotated back, so it stays within the blocks' rounding of
/// the f32 cache's, and one call equals token by token.
#[test]
fn q8_0_attention_is_the_f32_cache_s_within_rounding() {
    let (w, _) = weights();
    let (dk, dv) = (128, 64);
    let specs = [StateSpec::Kv {
        n_head_kv: 2,
        head_dim_k: dk,
        head_dim_v: dv,
        window: Some(6),
    }];
    let attn = Attention {
        n_head: 4,
        n_head_kv: 2,
        head_dim_k: dk,
        head_dim_v: dv,
        scale: 1.0 / (dk as f32).sqrt(),
        window: Some(6),
        softcap: None,
        picture_rows_see_each_other: false,
    };
    let n = 9;
    let tokens = vec![0u32; n];
    let mut rng = Rng::new(3);
    let mut r = |cols: usize| mat(n, cols, |_, _| rng.normal());
    let (q, k, v) = (r(4 * dk), r(2 * dk), r(2 * dv));
    let rows = |m: &Mat, at: std::ops::Range<usize>| {
        Mat::from_vec(
            at.len(),
            m.cols,
            m.data[at.start * m.cols..at.end * m.cols].to_vec(),
        )
    };
    let run = |precision: KvPrecision, calls: &[std::ops::Range<usize>]| {
        let mut state = SeqState::with_precision(&specs, 16, precision);
        let mut out = Vec::new();
        for c in calls {
            let mut f = CpuForward::new(&w, &mut state, &tokens[c.clone()], Logits::None);
            let a = f.attention(
                0,
                &rows(&q, c.clone()),
                &rows(&k, c.clone()),
                &rows(&v, c.clone()),
                &attn,
            );
            out.extend(a.data);
            state.push_tokens(&tokens[c.clone()]);
        }
        (out, state)
    };
    let whole = vec![0..n; 1];
    let (exact, _) = run(KvPrecision::F32, &whole);
    let (q8, state) = run(KvPrecision::Q8_0, &whole);
    let rot = state.kv_rotation();
    assert_eq!((rot.k, rot.v), (Some(128), Some(64)));
    let d = exact
        .iter()
        .zip(&q8)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(d > 0.0 && d < 0.05, "largest difference {d}");
    let LayerState::Kv(c) = state.layer(0) else {
        panic!("layer 0 is a KV cache")
    };
    // The cache holds the rotated keys' blocks.
    let mut kr = k.data.clone();
    attention::hadamard_ggml(&mut kr, 128);
    let mut blocks = Vec::new();
    attention::quantize_q8_0_rows(&kr, &mut blocks);
    assert_eq!(c.keys_q8_0(), &blocks[..]);
    let (steps, _) = run(
        KvPrecision::Q8_0,
        &(0..n).map(|i| i..i + 1).collect::<Vec<_>>(),
    );
    assert_eq!(steps, q8, "token by token");
    // Heads of 32 are not rotated (llama.cpp rotates multiples of 64 only).
    let small = SeqState::with_precision(
        &[StateSpec::Kv {
            n_head_kv: 1,
            head_dim_k: 32,
            head_dim_v: 32,
            window: None,
        }],
        4,
        KvPrecision::Q8_0,
    );
    assert_eq!(small.kv_rotation(), attention::KvRotation::default());
    assert_eq!(
        SeqState::new(&specs, 4).kv_rotation(),
        attention::KvRotation::default()
    );
}
