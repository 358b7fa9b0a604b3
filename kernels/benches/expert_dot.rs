//! Speed of the decode expert products, in GB/s of weights: the row dot products on one thread (weights in
//! cache: the kernels' compute rate; weights streamed from memory: what one thread gets), and a decode
//! step's expert products ([`matvec_many`]: 8 experts' gate and up matrices in one parallel region, then
//! their 8 down matrices) on 1 and on N threads.
//!
//! `cargo bench -p poly-kernels --bench expert_dot [-- TYPE,TYPE,...] [--threads N,N] [--ff N] [--embd N]
//! [--rotate-mb N] [--ms N] [--cpu-avx512 off] [--cpu-simd off] [--cpu-rows4 off] [--cpu-ktile off]]`
//!
//! Defaults: Q4_K,Q5_K,Q6_K,Q8_0; threads 1 and all; expert shape of Qwen3-30B-A3B (`--embd 2048 --ff 768`):
//! gate/up `[n_embd → n_ff]`, down `[n_ff → n_embd]`. The CPU path is the run-time choice of the kernels
//! (`--cpu-avx512 off` turns the AVX-512 kernels off, `--cpu-simd off` every SIMD kernel, as
//! `poly-engine`'s flags of the same names); the header says which is in use.

use poly_kernels::matmul::{matvec_many, matvec_quantized, MatvecJob, QuantMatrix};
use poly_kernels::quant::{fill_random, simd_level, GgmlType};
use poly_kernels::rng::Rng;
use std::time::{Duration, Instant};

/// Fastest time of `f(i)` (i = run number) over runs lasting at least `budget` in all (at least 5).
fn fastest_time(budget: Duration, mut f: impl FnMut(usize)) -> Duration {
    f(0);
    let start = Instant::now();
    let mut times = Vec::new();
    while times.len() < 5 || start.elapsed() < budget {
        let t = Instant::now();
        f(times.len() + 1);
        times.push(t.elapsed());
    }
    // The fastest run, not the median: on a machine shared with other work the median counts the
    // other work too; the fastest run is the kernels' own time.
    times.into_iter().min().expect("at least five runs")
}

/// `count` random matrices of `rows × cols` values of `ty`.
fn matrices(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize, count: usize) -> Vec<Vec<u8>> {
    let bytes = rows * ty.bytes_for(cols as u64).expect("whole blocks") as usize;
    (0..count)
        .map(|_| {
            let mut d = vec![0u8; bytes];
            fill_random(ty, rng, 0.05, &mut d).expect("fill");
            d
        })
        .collect()
}

fn quantized(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let act = ty.ops().expect("computes").act;
    let mut q = vec![0u8; act.bytes_for(x.len())];
    act.quantize(x, &mut q);
    q
}

struct Args {
    types: Vec<GgmlType>,
    threads: Vec<usize>,
    n_embd: usize,
    n_ff: usize,
    rotate_mb: usize,
    budget: Duration,
    cpu: poly_kernels::options::CpuKernelOptions,
}

fn parse_args() -> Args {
    let all = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut a = Args {
        types: vec![
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
            GgmlType::Q8_0,
        ],
        threads: if all > 1 { vec![1, all] } else { vec![1] },
        n_embd: 2048,
        n_ff: 768,
        rotate_mb: 512,
        budget: Duration::from_millis(400),
        cpu: Default::default(),
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let next = |i: usize| args.get(i + 1).map(String::as_str).unwrap_or("");
        match args[i].as_str() {
            "--threads" => {
                a.threads = next(i)
                    .split(',')
                    .map(|t| t.parse().expect("--threads N,N"))
                    .collect();
                i += 1;
            }
            "--ff" => {
                a.n_ff = next(i).parse().expect("--ff N");
                i += 1;
            }
            "--embd" => {
                a.n_embd = next(i).parse().expect("--embd N");
                i += 1;
            }
            "--rotate-mb" => {
                a.rotate_mb = next(i).parse().expect("--rotate-mb N");
                i += 1;
            }
            "--ms" => {
                a.budget = Duration::from_millis(next(i).parse().expect("--ms N"));
                i += 1;
            }
            "--bench" => {}
            knob @ ("--cpu-avx512" | "--cpu-simd" | "--cpu-rows4" | "--cpu-ktile") => {
                let on = match next(i) {
                    "on" | "1" => true,
                    "off" | "0" => false,
                    v => panic!("{knob} on|off, not {v:?}"),
                };
                let c = &mut a.cpu;
                match knob {
                    "--cpu-avx512" => c.avx512 = on,
                    "--cpu-simd" => c.simd = on,
                    "--cpu-rows4" => c.rows4 = on,
                    _ => c.ktile = on,
                }
                i += 1;
            }
            list => {
                a.types = list
                    .split(',')
                    .map(|n| GgmlType::from_name(n).unwrap_or_else(|| panic!("unknown type {n}")))
                    .collect()
            }
        }
        i += 1;
    }
    a
}

fn main() {
    let a = parse_args();
    let set = poly_kernels::options::set(poly_kernels::options::KernelOptions {
        cpu: a.cpu,
        ..Default::default()
    });
    set.expect("the knobs are set before any kernel runs");
    let (n_embd, n_ff) = (a.n_embd, a.n_ff);
    let rows4 = a.cpu.rows4;
    println!(
        "kernels: {}, Q4_K four-row kernel {}; expert gate/up {n_embd}->{n_ff}, down {n_ff}->{n_embd}; GB/s = weight bytes / fastest time",
        simd_level(),
        if rows4 { "on" } else { "off" }
    );
    println!("| type | threads | row dots, in cache GB/s | down rows, in cache GB/s | matvec from memory GB/s | decode experts (8x gate+up, 8x down) GB/s | per step us |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let mut rng = Rng::new(5);
    for &ty in &a.types {
        let (Some(up_row), Some(down_row)) =
            (ty.bytes_for(n_embd as u64), ty.bytes_for(n_ff as u64))
        else {
            println!("| {ty} | rows not whole blocks | | | | |");
            continue;
        };
        // One expert's three matrices; sets of 8 experts rotating over `rotate_mb` of weights.
        // gate and up: n_ff rows of n_embd values; down: n_embd rows of n_ff values.
        let expert_bytes = 2 * n_ff * up_row as usize + n_embd * down_row as usize;
        let sets = ((a.rotate_mb << 20) / (8 * expert_bytes)).max(2);
        let ups = matrices(&mut rng, ty, n_ff, n_embd, 16 * sets);
        let downs = matrices(&mut rng, ty, n_embd, n_ff, 8 * sets);
        let up = |i: usize| QuantMatrix::new(ty, n_ff, n_embd, &ups[i]).expect("matrix");
        let down = |i: usize| QuantMatrix::new(ty, n_embd, n_ff, &downs[i]).expect("matrix");
        let x: Vec<f32> = (0..n_embd).map(|_| rng.normal()).collect();
        let h: Vec<f32> = (0..n_ff).map(|_| rng.normal()).collect();
        let (xq, hq) = (quantized(ty, &x), quantized(ty, &h));
        let mut y = vec![0f32; 16 * n_ff + 8 * n_embd];
        let up_bytes = ups[0].len() as f64;
        let step_bytes = (8 * expert_bytes) as f64;
        for &threads in &a.threads {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("thread pool");
            // One gate matrix (885 KB at the default shape) again and again: in L2/L3.
            let t_cache = pool.install(|| {
                fastest_time(a.budget, |_| matvec_quantized(&up(0), &xq, &mut y[..n_ff]))
            });
            // One down matrix (rows of n_ff values: 3 super-blocks at the default shape), in cache.
            let t_down = pool.install(|| {
                fastest_time(a.budget, |_| {
                    matvec_quantized(&down(0), &hq, &mut y[..n_embd])
                })
            });
            let t_mem = pool.install(|| {
                fastest_time(a.budget, |i| {
                    matvec_quantized(&up(i % ups.len()), &xq, &mut y[..n_ff])
                })
            });
            let t_step = pool.install(|| {
                fastest_time(a.budget, |i| {
                    let s = i % sets;
                    let (gu, dn) = y.split_at_mut(8 * n_ff * 2);
                    let mut jobs: Vec<MatvecJob<'_, '_>> = gu
                        .chunks_mut(n_ff)
                        .enumerate()
                        .map(|(j, yj)| MatvecJob {
                            w: up(16 * s + j),
                            order: None,
                            act: &xq,
                            y: yj,
                        })
                        .collect();
                    matvec_many(&mut jobs);
                    let mut jobs: Vec<MatvecJob<'_, '_>> = dn[..8 * n_embd]
                        .chunks_mut(n_embd)
                        .enumerate()
                        .map(|(j, yj)| MatvecJob {
                            w: down(8 * s + j),
                            order: None,
                            act: &hq,
                            y: yj,
                        })
                        .collect();
                    matvec_many(&mut jobs);
                })
            });
            println!(
                "| {ty} | {threads} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} |",
                up_bytes / t_cache.as_secs_f64() / 1e9,
                downs[0].len() as f64 / t_down.as_secs_f64() / 1e9,
                up_bytes / t_mem.as_secs_f64() / 1e9,
                step_bytes / t_step.as_secs_f64() / 1e9,
                t_step.as_secs_f64() * 1e6
            );
        }
    }
}
