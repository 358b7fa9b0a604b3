//! Speed of matrix×vector and matrix×matrix per weight format, in GB/s of weights.
//!
//! `cargo bench -p poly-kernels --bench quant_matmul [-- TYPE,TYPE,...] [--rows N] [--cols N] [--tokens N]
//! [--rotate-mb N]`
//!
//! For each type: a `rows × cols` matrix (default 4096 × 4096) of random valid blocks; matrix×vector on one
//! thread and on all threads, and a `tokens`-column (default 512) matrix×matrix on all threads. The figure
//! is the weight bytes over the median time of a call (activation quantization included), the definition
//! `tests/witness/ggml_mulmat_bench` uses for llama.cpp. A 4096×4096 quantized matrix fits in a large L3
//! cache, so the calls cycle through copies of the matrix totalling at least `--rotate-mb` (default 256):
//! the figures are then memory-bound, as for a real model. Prints a Markdown table.

use poly_kernels::matmul::{matmul, matvec, QuantMatrix};
use poly_kernels::quant::{fill_random, GgmlType, WEIGHT_TYPES};
use poly_kernels::rng::Rng;
use std::time::{Duration, Instant};

/// Median time of `f(i)` (i = run number) over runs lasting at least `budget` in all (at least 5).
fn median_time(budget: Duration, mut f: impl FnMut(usize)) -> Duration {
    f(0); // warm the pool
    let start = Instant::now();
    let mut times = Vec::new();
    while times.len() < 5 || start.elapsed() < budget {
        let t = Instant::now();
        f(times.len() + 1);
        times.push(t.elapsed());
    }
    times.sort();
    times[times.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut types: Vec<GgmlType> = WEIGHT_TYPES.to_vec();
    let (mut rows, mut cols, mut tokens) = (4096usize, 4096usize, 512usize);
    let mut rotate_mb = 256usize;
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--rows" => {
                rows = args[i + 1].parse().expect("--rows N");
                i += 1;
            }
            "--cols" => {
                cols = args[i + 1].parse().expect("--cols N");
                i += 1;
            }
            "--tokens" => {
                tokens = args[i + 1].parse().expect("--tokens N");
                i += 1;
            }
            "--rotate-mb" => {
                rotate_mb = args[i + 1].parse().expect("--rotate-mb N");
                i += 1;
            }
            "--bench" => {}
            list => {
                types = list
                    .split(',')
                    .map(|n| GgmlType::from_name(n).unwrap_or_else(|| panic!("unknown type {n}")))
                    .collect()
            }
        }
        i += 1;
    }
    let all = std::thread::available_parallelism().map_or(1, |n| n.get());
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("thread pool");
    let many = rayon::ThreadPoolBuilder::new()
        .num_threads(all)
        .build()
        .expect("thread pool");

    println!("matrix {rows} x {cols}, {tokens} tokens for matrix x matrix, {all} threads");
    println!("rotating over {rotate_mb} MB of weight copies; GB/s = weight bytes / median time");
    println!("| type | MB | matvec 1 thread GB/s | matvec {all} threads GB/s | matmul {tokens} tok, {all} threads GB/s (time) |");
    println!("|---|---:|---:|---:|---:|");
    let mut rng = Rng::new(11);
    for ty in types {
        let Some(row_bytes) = ty.bytes_for(cols as u64) else {
            println!("| {ty} | row of {cols} not whole blocks | | | |");
            continue;
        };
        let bytes = rows * row_bytes as usize;
        let copies = (rotate_mb << 20).div_ceil(bytes).max(1);
        let datas: Vec<Vec<u8>> = (0..copies)
            .map(|_| {
                let mut data = vec![0u8; bytes];
                fill_random(ty, &mut rng, 0.05, &mut data).expect("fill");
                data
            })
            .collect();
        let ws: Vec<QuantMatrix> = datas
            .iter()
            .map(|d| QuantMatrix::new(ty, rows, cols, d).expect("matrix"))
            .collect();
        let x: Vec<f32> = (0..cols * tokens).map(|_| rng.normal()).collect();
        let mut y = vec![0f32; rows * tokens];
        let gb = bytes as f64 / 1e9;
        let budget = Duration::from_millis(600);
        let mut mv = |i: usize| matvec(&ws[i % copies], &x[..cols], &mut y[..rows]);
        let t1 = one.install(|| median_time(budget, &mut mv));
        let tn = many.install(|| median_time(budget, &mut mv));
        let tm =
            many.install(|| median_time(budget, |i| matmul(&ws[i % copies], &x, tokens, &mut y)));
        println!(
            "| {ty} | {:.1} | {:.2} | {:.2} | {:.2} ({:.1} ms) |",
            gb * 1e3,
            gb / t1.as_secs_f64(),
            gb / tn.as_secs_f64(),
            gb / tm.as_secs_f64(),
            tm.as_secs_f64() * 1e3
        );
    }
}
