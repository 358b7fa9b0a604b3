//! Speed of matrix×vector and matrix×matrix per weight format, in GB/s of weights.
//!
//! `cargo bench -p poly-kernels --bench quant_matmul [-- TYPE,TYPE,...] [--rows N] [--cols N] [--tokens N]`
//!
//! For each type: a `rows × cols` matrix (default 4096 × 4096) of random valid blocks; matrix×vector on one
//! thread and on all threads, and a `tokens`-column (default 512) matrix×matrix on all threads. The figure
//! is the weight bytes over the best time of several runs (for matrix×matrix: weight bytes × tokens over
//! time, i.e. the rate at which a naive kernel would have to stream the weights; the same definition is
//! used for llama.cpp's figures in BENCHMARKS.md). Prints a Markdown table.

use poly_kernels::matmul::{matmul, matvec, QuantMatrix};
use poly_kernels::quant::{fill_random, GgmlType, WEIGHT_TYPES};
use poly_kernels::rng::Rng;
use std::time::{Duration, Instant};

/// Best time of `f` over runs lasting at least `budget` in all (at least 3 runs).
fn best_time(budget: Duration, mut f: impl FnMut()) -> Duration {
    f(); // warm caches and the pool
    let start = Instant::now();
    let mut best = Duration::MAX;
    let mut runs = 0;
    while runs < 3 || start.elapsed() < budget {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed());
        runs += 1;
    }
    best
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut types: Vec<GgmlType> = WEIGHT_TYPES.to_vec();
    let (mut rows, mut cols, mut tokens) = (4096usize, 4096usize, 512usize);
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
    println!("| type | MB | matvec 1 thread GB/s | matvec {all} threads GB/s | matmul {tokens} tok, {all} threads GB/s |");
    println!("|---|---:|---:|---:|---:|");
    let mut rng = Rng::new(11);
    for ty in types {
        let Some(row_bytes) = ty.bytes_for(cols as u64) else {
            println!("| {ty} | row of {cols} not whole blocks | | | |");
            continue;
        };
        let mut data = vec![0u8; rows * row_bytes as usize];
        fill_random(ty, &mut rng, 0.05, &mut data).expect("fill");
        let w = QuantMatrix::new(ty, rows, cols, &data).expect("matrix");
        let x: Vec<f32> = (0..cols * tokens).map(|_| rng.normal()).collect();
        let mut y = vec![0f32; rows * tokens];
        let gb = data.len() as f64 / 1e9;
        let budget = Duration::from_millis(600);
        let t1 = one.install(|| best_time(budget, || matvec(&w, &x[..cols], &mut y[..rows])));
        let tn = many.install(|| best_time(budget, || matvec(&w, &x[..cols], &mut y[..rows])));
        let tm = many.install(|| best_time(budget, || matmul(&w, &x, tokens, &mut y)));
        println!(
            "| {ty} | {:.1} | {:.2} | {:.2} | {:.2} |",
            gb * 1e3,
            gb / t1.as_secs_f64(),
            gb / tn.as_secs_f64(),
            gb * tokens as f64 / tm.as_secs_f64()
        );
    }
}
