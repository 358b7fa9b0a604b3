//! Speed of the prompt's matrix products on one thread: `matmul` (each format's batch order, as the
//! engine reads a prompt) of `tokens` activation rows times weight matrices of the given shapes, weights
//! in cache. Prints the minimum time of a call over the runs (min-of-N: the figure least disturbed by
//! other work on a shared machine) and the multiply-adds per nanosecond.
//!
//! `cargo bench -p poly-kernels --bench prompt_matmul [-- TYPE:ROWSxCOLS,... ] [--tokens N] [--runs N]
//! [--single] [--copies N]`
//!
//! `--copies N`: each call takes the next of N copies of the weights (a prompt's expert products stream
//! every expert's weights from memory once: `--copies 128 --tokens 32` for a Qwen3 MoE layer's experts).
//!
//! `--single`: every row in the format's single-row order (`matmul_ordered` without a batch order), as
//! llama.cpp's `MUL_MAT_ID` over repacked Q4_K weights computes a prompt's expert products.
//!
//! Defaults: Gemma 3 270M's prompt products (Q5_0 640→2048 and 640→1024, Q8_0 640→256, Q4_K 1024→640,
//! Q6_K 2048→640) and a Qwen3 MoE expert's (Q4_K 2048→768, 768→2048), 512 tokens (64 for the expert).

use poly_kernels::matmul::{matmul, matmul_ordered, QuantMatrix};
use poly_kernels::quant::{fill_random, GgmlType};
use poly_kernels::rng::Rng;
use std::time::{Duration, Instant};

/// One product to time: `rows × cols` weights of `ty`, `tokens` activation rows.
struct Case {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    tokens: usize,
}

fn parse_case(s: &str, tokens: usize) -> Case {
    let (ty, shape) = s.split_once(':').expect("TYPE:ROWSxCOLS");
    let (rows, cols) = shape.split_once('x').expect("TYPE:ROWSxCOLS");
    Case {
        ty: GgmlType::from_name(ty).unwrap_or_else(|| panic!("unknown type {ty}")),
        rows: rows.parse().expect("rows"),
        cols: cols.parse().expect("cols"),
        tokens,
    }
}

/// Minimum time of `f()` over `runs` runs (after one warm-up run).
fn min_time(runs: usize, mut f: impl FnMut()) -> Duration {
    f();
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .unwrap_or_default()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mut tokens, mut runs, mut list) = (512usize, 20usize, None::<String>);
    let mut single = false;
    let mut copies = 1usize;
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--tokens" => {
                tokens = args[i + 1].parse().expect("--tokens N");
                i += 1;
            }
            "--runs" => {
                runs = args[i + 1].parse().expect("--runs N");
                i += 1;
            }
            "--single" => single = true,
            "--copies" => {
                copies = args[i + 1].parse().expect("--copies N");
                i += 1;
            }
            "--bench" => {}
            l => list = Some(l.to_string()),
        }
        i += 1;
    }
    let cases: Vec<Case> = match list {
        Some(l) => l.split(',').map(|c| parse_case(c, tokens)).collect(),
        None => {
            let mut c: Vec<Case> = [
                "Q5_0:2048x640",
                "Q5_0:1024x640",
                "Q8_0:256x640",
                "Q4_K:640x1024",
                "Q6_K:640x2048",
            ]
            .iter()
            .map(|c| parse_case(c, tokens))
            .collect();
            c.extend(
                ["Q4_K:768x2048", "Q4_K:2048x768"]
                    .iter()
                    .map(|s| parse_case(s, 64)),
            );
            c
        }
    };
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("thread pool");
    let order = if single {
        "single-row order"
    } else {
        "batch order"
    };
    println!("one thread, min of {runs} runs, {order}");
    println!("| type | rows x cols | tokens | ms | MAC/ns |");
    println!("|---|---|---:|---:|---:|");
    let mut rng = Rng::new(17);
    for c in &cases {
        let bytes = c.rows * c.ty.bytes_for(c.cols as u64).expect("whole blocks") as usize;
        let mut data = vec![0u8; bytes];
        fill_random(c.ty, &mut rng, 0.05, &mut data).expect("fill");
        let datas: Vec<Vec<u8>> = (0..copies).map(|_| data.clone()).collect();
        let ws: Vec<QuantMatrix> = datas
            .iter()
            .map(|d| QuantMatrix::new(c.ty, c.rows, c.cols, d).expect("matrix"))
            .collect();
        let mut next = 0;
        let x: Vec<f32> = (0..c.tokens * c.cols).map(|_| rng.normal()).collect();
        let mut y = vec![0f32; c.tokens * c.rows];
        let t = one.install(|| {
            min_time(runs, || {
                let w = &ws[next % copies];
                next += 1;
                if single {
                    matmul_ordered(w, &x, c.tokens, &mut y, None)
                } else {
                    matmul(w, &x, c.tokens, &mut y)
                }
            })
        });
        let macs = (c.rows * c.cols * c.tokens) as f64;
        println!(
            "| {} | {}x{} | {} | {:.3} | {:.2} |",
            c.ty,
            c.rows,
            c.cols,
            c.tokens,
            t.as_secs_f64() * 1e3,
            macs / t.as_nanos() as f64
        );
    }
}
