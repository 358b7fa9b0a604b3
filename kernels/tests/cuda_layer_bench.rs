//! Microbenchmarks of the layer-level CUDA kernels (attention, delta rule, prompt matmul, grouped experts,
//! sampling), for the GPU machine: `cargo test --release -p poly-kernels --test cuda_layer_bench --
//! --ignored --nocapture --test-threads 1`. Ignored by default (CI has no GPU). Each case prints
//! microseconds per call (CUDA events around 20 calls after 3 warm-up ones) and a rate: bytes read per
//! second for memory-bound kernels, tokens per second for prompt kernels.

#![cfg(feature = "cuda")]

use cudarc::driver::sys::CUevent_flags;
use poly_kernels::cuda::attention::{
    attention_decode_f16, attention_f16, decode_scratch_len, AttnSplit, DecodeCache, DecodeSplit,
    KvCacheView,
};
use poly_kernels::cuda::attention_mma::attention_prompt;
use poly_kernels::cuda::prompt::{self, ExpertGrouping};
use poly_kernels::cuda::recurrent::{self, DeltaInputs};
use poly_kernels::cuda::sample;
use poly_kernels::cuda::{BlockQ8_1, CudaError, Device, DeviceMatrix, StackedExperts};
use poly_kernels::ops::attention::AttnParams;
use poly_kernels::ops::recurrent::DeltaShape;
use poly_kernels::quant::GgmlType;
use poly_kernels::rng::Rng;

mod common;
use common::{device, random_weights};

const WARMUP: usize = 3;
const ITERS: usize = 20;

fn time_calls(dev: &Device, mut call: impl FnMut()) -> f64 {
    for _ in 0..WARMUP {
        call();
    }
    let stream = dev.stream();
    let start = stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("event");
    for _ in 0..ITERS {
        call();
    }
    let end = stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("event");
    end.synchronize().expect("sync");
    start.elapsed_ms(&end).expect("elapsed") as f64 / 1e3 / ITERS as f64
}

/// Seconds per call of `call` on the device alone: ITERS calls (`call(device, i)`) captured into one CUDA
/// graph and replayed, so the host's launch cost (which back-to-back launches of short kernels measure
/// instead) drops out, as in the engine's decode graphs.
fn time_graph(dev: &Device, mut call: impl FnMut(&Device, usize) -> Result<(), CudaError>) -> f64 {
    let graph = dev
        .capture(|dv| (0..ITERS).try_for_each(|i| call(dv, i)))
        .expect("capture");
    time_calls(dev, || graph.replay().expect("replay")) / ITERS as f64
}

/// One token's attention with the flash-decoding kernel over caches of Qwen3-30B-A3B (32/4 heads of 128)
/// and Qwen3.6-35B-A3B (16/2 of 256), at several split counts, against the split-K kernel. The calls rotate
/// over enough separate caches (one per layer, as a forward pass) that the keys come from memory, not L2;
/// each case is timed launched from the host and replayed from a graph (the device's own time).
#[test]
#[ignore = "GPU benchmark"]
fn bench_attention_decode() {
    let Some(dev) = device() else { return };
    for (n_head, n_head_kv, d) in [(32usize, 4usize, 128usize), (16, 2, 256)] {
        let p = AttnParams {
            n_head,
            n_head_kv,
            head_dim_k: d,
            head_dim_v: d,
            scale: 1.0 / (d as f32).sqrt(),
            window: None,
            softcap: None,
            sees_together: None,
        };
        for (position, n_kv) in [(100usize, 256usize), (2000, 2048), (8000, 8192)] {
            let row = n_head_kv * d;
            let layers = (256usize << 20).div_ceil(2 * 2 * n_kv * row).clamp(1, 48);
            let mut rng = Rng::new(2);
            let q: Vec<f32> = (0..n_head * d).map(|_| rng.normal()).collect();
            let kv: Vec<u16> = (0..n_kv * row)
                .map(|_| half::f16::from_f32(rng.normal()).to_bits())
                .collect();
            let caches: Vec<_> = (0..layers)
                .map(|_| (dev.upload(&kv).unwrap(), dev.upload(&kv).unwrap()))
                .collect();
            let (qd, posd) = (
                dev.upload(&q).unwrap(),
                dev.upload(&[position as i32]).unwrap(),
            );
            let mut out = dev.zeros::<f32>(n_head * d).unwrap();
            let bytes = 2 * (position + 1) * row * 2;
            for n_split in [1usize, 4, 8, 16, 32, 64, 128, 256] {
                let len = decode_scratch_len(&p, n_split);
                let mut scratch = (len > 0).then(|| dev.zeros::<f32>(len).unwrap());
                let mut layer = 0;
                let s = time_calls(&dev, || {
                    let (k, v) = &caches[layer % layers];
                    layer += 1;
                    let cache = KvCacheView {
                        k,
                        v,
                        n_kv: Some(n_kv),
                    };
                    attention_decode_f16(
                        &dev,
                        &qd,
                        &posd,
                        DecodeCache::Read(cache),
                        &p,
                        DecodeSplit::keys(n_split),
                        scratch.as_mut(),
                        (&mut out, None),
                    )
                    .unwrap()
                });
                let g = time_graph(&dev, |dv, i| {
                    let (k, v) = &caches[i % layers];
                    let cache = KvCacheView {
                        k,
                        v,
                        n_kv: Some(n_kv),
                    };
                    attention_decode_f16(
                        dv,
                        &qd,
                        &posd,
                        DecodeCache::Read(cache),
                        &p,
                        DecodeSplit::keys(n_split),
                        scratch.as_mut(),
                        (&mut out, None),
                    )
                });
                println!(
                    "bench attention_decode heads {n_head}/{n_head_kv} d {d} position {position} (bucket {n_kv}) splits {n_split}: {:.2} us launched, {:.2} us in a graph, KV {:.0} GB/s",
                    s * 1e6,
                    g * 1e6,
                    bytes as f64 / g / 1e9
                );
            }
            // The split-K kernel as the engine called it before (264 blocks over the bucket).
            let chunk = n_kv
                .div_ceil(264usize.div_ceil(n_head_kv))
                .max(32)
                .div_ceil(32)
                * 32;
            let split = AttnSplit { chunk };
            let len = split.scratch_len(&p, 1, n_kv);
            let mut scratch = (len > 0).then(|| dev.zeros::<f32>(len).unwrap());
            let mut layer = 0;
            let s = time_calls(&dev, || {
                let (k, v) = &caches[layer % layers];
                layer += 1;
                let cache = KvCacheView {
                    k,
                    v,
                    n_kv: Some(n_kv),
                };
                poly_kernels::cuda::attention::attention_f16_cache(
                    &dev,
                    &qd,
                    &posd,
                    cache,
                    &p,
                    split,
                    scratch.as_mut(),
                    &mut out,
                )
                .unwrap()
            });
            println!(
                "bench attention split-K heads {n_head}/{n_head_kv} d {d} position {position} (bucket {n_kv}) splits {}: {:.2} us, KV {:.0} GB/s",
                split.n_split(n_kv),
                s * 1e6,
                bytes as f64 / s / 1e9
            );
        }
    }
}

#[test]
#[ignore = "GPU benchmark"]
fn bench_attention() {
    let Some(dev) = device() else { return };
    // Qwen3-30B-A3B's attention: 32 query heads, 4 KV heads of 128.
    let p = AttnParams {
        n_head: 32,
        n_head_kv: 4,
        head_dim_k: 128,
        head_dim_v: 128,
        scale: 0.088,
        window: None,
        softcap: None,
        sees_together: None,
    };
    for (n_q, n_kv) in [
        (1usize, 512usize),
        (1, 8192),
        (1, 32768),
        (512, 512),
        (2048, 2048),
        (4096, 4096),
        // A long prompt's calls of 8,192 tokens: the first, and the last of 30,000.
        (8192, 8192),
        (8192, 30000),
    ] {
        let mut rng = Rng::new(1);
        let q: Vec<f32> = (0..n_q * 32 * 128).map(|_| rng.normal()).collect();
        let kv: Vec<u16> = (0..n_kv * 4 * 128)
            .map(|_| half::f16::from_f32(rng.normal()).to_bits())
            .collect();
        let pos: Vec<i32> = ((n_kv - n_q) as i32..n_kv as i32).collect();
        let (qd, kd, vd, posd) = (
            dev.upload(&q).unwrap(),
            dev.upload(&kv).unwrap(),
            dev.upload(&kv).unwrap(),
            dev.upload(&pos).unwrap(),
        );
        let mut out = dev.zeros::<f32>(n_q * 32 * 128).unwrap();
        // The CUDA-core kernel takes seconds a call for the long prompts' calls.
        let splits = if n_q > 4096 {
            vec![]
        } else {
            vec![
                AttnSplit::none(n_kv),
                AttnSplit::for_occupancy(&p, n_q, n_kv, 264),
            ]
        };
        for split in splits {
            let len = split.scratch_len(&p, n_q, n_kv);
            let mut scratch = (len > 0).then(|| dev.zeros::<f32>(len).unwrap());
            let s = time_calls(&dev, || {
                attention_f16(
                    &dev,
                    &qd,
                    &posd,
                    &kd,
                    &vd,
                    &p,
                    split,
                    scratch.as_mut(),
                    &mut out,
                )
                .unwrap()
            });
            let bytes = 2 * kv.len() * 2;
            println!(
                "bench attention n_q {n_q} n_kv {n_kv} splits {}: {:.1} us, KV {:.0} GB/s, {:.0} query tokens/s",
                split.n_split(n_kv),
                s * 1e6,
                bytes as f64 / s / 1e9,
                n_q as f64 / s
            );
        }
        if n_q > 1 {
            let cache = KvCacheView {
                k: &kd,
                v: &vd,
                n_kv: Some(n_kv),
            };
            let s = time_calls(&dev, || {
                attention_prompt(&dev, &qd, &posd, cache, &p, &mut out).unwrap()
            });
            // Causal: query i sees its position + 1 keys; two products of d a key and head.
            let seen: f64 = pos.iter().map(|&x| x as f64 + 1.0).sum();
            let flops = 4.0 * 128.0 * 32.0 * seen;
            println!(
                "bench attention_mma n_q {n_q} n_kv {n_kv}: {:.1} us, {:.0} query tokens/s, {:.0} TFLOP/s",
                s * 1e6,
                n_q as f64 / s,
                flops / s / 1e12
            );
        }
    }
}

#[test]
#[ignore = "GPU benchmark"]
fn bench_delta_rule() {
    let Some(dev) = device() else { return };
    // Qwen3.6-35B-A3B's linear attention: 16 key heads, 32 value heads of 128.
    let (n_k, n_v, head) = (16usize, 32usize, 128usize);
    let shape = DeltaShape {
        n_heads: n_v,
        head_k: head,
        head_v: head,
    };
    for n in [1usize, 512, 2048] {
        let q = dev.upload(&vec![0.01f32; n * n_k * head]).unwrap();
        let k = dev.upload(&vec![0.01f32; n * n_k * head]).unwrap();
        let v = dev.upload(&vec![0.5f32; n * n_v * head]).unwrap();
        let g = dev.upload(&vec![-0.1f32; n * n_v]).unwrap();
        let b = dev.upload(&vec![0.5f32; n * n_v]).unwrap();
        let mut state = dev.zeros::<f32>(n_v * head * head).unwrap();
        let mut out = dev.zeros::<f32>(n * n_v * head).unwrap();
        let x = DeltaInputs {
            q: &q,
            k: &k,
            v: &v,
            gate: &g,
            beta: &b,
            n_k_heads: n_k,
        };
        let s = time_calls(&dev, || {
            recurrent::gated_delta_rule(&dev, &x, shape, &mut state, &mut out).unwrap()
        });
        println!(
            "bench delta rule n {n}: {:.1} us, {:.0} tokens/s, state {:.0} GB/s",
            s * 1e6,
            n as f64 / s,
            (2 * n_v * head * head * 4) as f64 / s / 1e9
        );
    }
}

#[test]
#[ignore = "GPU benchmark"]
fn bench_prompt_matmul() {
    let Some(dev) = device() else { return };
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::Q5_K,
        GgmlType::IQ4_XS,
    ] {
        // Qwen3-30B-A3B's q_proj (2048 -> 4096) and k_proj (2048 -> 512) shapes over 512 tokens, q_proj over
        // 4,096 (a long prompt's ubatch).
        for (rows, cols, n) in [
            (4096usize, 2048usize, 512usize),
            (512, 2048, 512),
            (4096, 2048, 4096),
        ] {
            let mut rng = Rng::new(2);
            let w = random_weights(ty, &mut rng, rows * cols);
            let wd = DeviceMatrix::upload(&dev, ty, rows, cols, &w).unwrap();
            let xq = dev.zeros::<BlockQ8_1>(n * cols / 32).unwrap();
            let mut y = dev.zeros::<f32>(n * rows).unwrap();
            // matmul_q's choice, each tensor-core tile, and the dp4a kernel.
            let mut variants = vec![("matmul".to_string(), 0usize), ("dp4a".to_string(), 1)];
            if prompt::has_mma(&dev, ty, cols) {
                for tile in [16, 32, 64, 128] {
                    variants.push((format!("mma tile {tile}"), tile));
                }
            }
            for (what, v) in variants {
                let s = time_calls(&dev, || match v {
                    0 => prompt::matmul_q(&dev, &wd, &xq, &mut y).unwrap(),
                    1 => prompt::matmul_q_dp4a(&dev, &wd, &xq, &mut y).unwrap(),
                    tile => prompt::matmul_q_mma(&dev, &wd, &xq, tile, &mut y).unwrap(),
                });
                println!(
                    "bench {what} {ty} {rows}x{cols} n {n}: {:.1} us, {:.2} TFLOP/s, {:.0} tokens/s",
                    s * 1e6,
                    2.0 * (rows * cols * n) as f64 / s / 1e12,
                    n as f64 / s
                );
            }
        }
    }
}

#[test]
#[ignore = "GPU benchmark"]
fn bench_grouped_experts() {
    let Some(dev) = device() else { return };
    // Qwen3-30B-A3B's gate/up (768 x 2048, 128 experts, 8 per token) and down (2048 x 768) projections and
    // Qwen3.6-35B-A3B's gate/up (512 x 2048, 256 experts) over 512 and 2,048 tokens: 32-128 and 16-64
    // tokens per expert on average; routing uniform or skewed toward some experts (as real routers are).
    for (rows, cols, n_expert, k, n) in [
        (768usize, 2048usize, 128usize, 8usize, 512usize),
        (768, 2048, 128, 8, 2048),
        (2048, 768, 128, 8, 512),
        (2048, 768, 128, 8, 2048),
        (512, 2048, 256, 8, 512),
        (512, 2048, 256, 8, 2048),
    ] {
        let ty = GgmlType::Q4_K;
        let mut rng = Rng::new(3);
        let w = random_weights(ty, &mut rng, rows * cols * n_expert);
        let stacked = StackedExperts::upload(&dev, ty, (rows, cols, n_expert), &w).unwrap();
        for skewed in [false, true] {
            let ids: Vec<i32> = (0..n * k)
                .map(|_| {
                    let u = if skewed {
                        rng.f32() * rng.f32()
                    } else {
                        rng.f32()
                    };
                    ((u * n_expert as f32) as i32).min(n_expert as i32 - 1)
                })
                .collect();
            let xq = dev.zeros::<BlockQ8_1>(n * k * cols / 32).unwrap();
            let mut y = dev.zeros::<f32>(n * k * rows).unwrap();
            let chosen = prompt::expert_tile_rows(&dev, stacked.table(), n * k, n_expert);
            for tile in [prompt::MATMUL_TILE, 16, 32, 64, 128] {
                let g = ExpertGrouping::with_tile(&ids, k, n_expert, tile);
                // Padded as the engine pads the table (empty tiles cost a block that returns at once).
                let tiles = g.tile_table(ExpertGrouping::max_tiles(n * k, n_expert, tile));
                let tilesd = dev.upload(&tiles).unwrap();
                let s = time_calls(&dev, || {
                    prompt::matmul_experts_q(&dev, stacked.table(), &tilesd, tile, &xq, &mut y)
                        .unwrap()
                });
                println!(
                    "bench grouped experts {ty} {rows}x{cols} x{n_expert} k {k} n {n}{} (tiles of {tile}{}: {}): \
                     {:.1} us, {:.0} tokens/s, {:.2} TFLOP/s",
                    if skewed { " skewed" } else { "" },
                    if tile == chosen { ", chosen" } else { "" },
                    g.tiles.len(),
                    s * 1e6,
                    n as f64 / s,
                    2.0 * (rows * cols * n * k) as f64 / s / 1e12
                );
                if tile == chosen && tile != prompt::MATMUL_TILE {
                    // Gate and up in one launch (the same table twice: the same work as two).
                    let mut y2 = dev.zeros::<f32>(n * k * rows).unwrap();
                    let t = stacked.table();
                    let s = time_calls(&dev, || {
                        prompt::matmul_experts_q_pair(
                            &dev,
                            [t, t],
                            &tilesd,
                            tile,
                            &xq,
                            [&mut y, &mut y2],
                        )
                        .unwrap()
                    });
                    println!(
                        "bench grouped experts pair {ty} {rows}x{cols} x{n_expert} k {k} n {n}{} (tiles of {tile}): \
                         {:.1} us for two, {:.2} TFLOP/s",
                        if skewed { " skewed" } else { "" },
                        s * 1e6,
                        4.0 * (rows * cols * n * k) as f64 / s / 1e12
                    );
                }
            }
        }
    }
}

#[test]
#[ignore = "GPU benchmark"]
fn bench_sampling() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(4);
    let logits: Vec<f32> = (0..151_936).map(|_| rng.normal()).collect();
    let ld = dev.upload(&logits).unwrap();
    let mut token = dev.zeros::<i32>(1).unwrap();
    let mut counter = dev.zeros::<u64>(1).unwrap();
    let s = time_calls(&dev, || sample::argmax(&dev, &ld, &mut token).unwrap());
    println!("bench argmax 151936: {:.1} us", s * 1e6);
    let d = sample::DrawParams {
        top_k: 40,
        top_p: 0.95,
        temperature: 0.8,
        seed: 1,
    };
    let s = time_calls(&dev, || {
        sample::sample_top_k(&dev, &ld, d, &mut counter, &mut token).unwrap()
    });
    println!("bench top-k 40 draw 151936: {:.1} us", s * 1e6);
}
