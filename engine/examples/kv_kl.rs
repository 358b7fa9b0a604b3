//! `--kv q8_0` against the f16 cache over a text, as llama-perplexity's `--kl-divergence` measures
//! llama.cpp's `-ctk q8_0 -ctv q8_0` against its default: the text's tokens in chunks of N (BOS first
//! where the model adds one), each chunk read in calls of 512 tokens with every position's logits, and at
//! positions N/2 … N-2 the KL divergence of the q8_0 run's next-token distribution from the f16 run's,
//! summed over the whole vocabulary in f64, and whether their likeliest tokens agree.
//!
//! `cargo run --release -p poly-engine --example kv_kl -- MODEL TOKENS.json [N [CHUNKS [BOS]]]`
//!
//! TOKENS.json: a witness reference (`tests/fixtures/references/*.text-t3000.json`), whose `prompt` is
//! the text as llama.cpp tokenizes it. Threads: rayon's default (`RAYON_NUM_THREADS`). Prints one JSON
//! line.

use poly_engine::model::Arithmetic;
use poly_engine::state::KvPrecision;
use poly_engine::Model;
use poly_models::compute::Logits;

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = x.iter().map(|&v| (v as f64 - max).exp()).sum();
    let ln = sum.ln();
    x.iter().map(|&v| v as f64 - max - ln).collect()
}

fn argmax(x: &[f32]) -> usize {
    (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b })
}

/// Every position's logits of `chunk`, read in calls of 512 tokens.
fn logits(model: &Model, chunk: &[u32]) -> Vec<f32> {
    let mut state = model.new_state(chunk.len());
    let mut out = Vec::new();
    for call in chunk.chunks(512) {
        out.extend(model.eval(&mut state, call, Logits::All).expect("eval"));
    }
    out
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: kv_kl MODEL TOKENS.json [N [CHUNKS [BOS]]]");
        std::process::exit(2);
    }
    let n: usize = args.get(3).map_or(1024, |s| s.parse().expect("N"));
    let chunks: usize = args.get(4).map_or(2, |s| s.parse().expect("CHUNKS"));
    let bos: Option<u32> = args.get(5).map(|s| s.parse().expect("BOS"));
    let text = std::fs::read_to_string(&args[2]).expect("TOKENS.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let tokens: Vec<u32> = v["prompt"]
        .as_array()
        .expect("a prompt")
        .iter()
        .map(|t| t.as_u64().expect("a token id") as u32)
        .collect();
    let load = |kv| {
        Model::load(&args[1])
            .expect("model")
            .with_arithmetic(Arithmetic::LlamaCpp)
            .with_kv(kv)
            .expect("kv")
    };
    let (f16, q8) = (load(KvPrecision::F16), load(KvPrecision::Q8_0));
    let n_vocab = f16.info().n_vocab;
    let mut kls = Vec::new();
    let mut same = 0usize;
    for c in 0..chunks.min(tokens.len() / n) {
        let mut chunk = tokens[c * n..(c + 1) * n].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        let (a, b) = (logits(&f16, &chunk), logits(&q8, &chunk));
        for pos in n / 2..n - 1 {
            let (x, y) = (
                &a[pos * n_vocab..(pos + 1) * n_vocab],
                &b[pos * n_vocab..(pos + 1) * n_vocab],
            );
            let (p, q) = (log_softmax(x), log_softmax(y));
            let kl: f64 = p.iter().zip(&q).map(|(lp, lq)| lp.exp() * (lp - lq)).sum();
            kls.push(kl.max(0.0));
            same += (argmax(x) == argmax(y)) as usize;
        }
    }
    let mean = kls.iter().sum::<f64>() / kls.len() as f64;
    let max = kls.iter().copied().fold(0.0, f64::max);
    let mut sorted = kls.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    let p99 = sorted[(sorted.len() as f64 * 0.99) as usize];
    println!(
        "{}",
        serde_json::json!({
            "model": args[1], "n_ctx": n, "scored": kls.len(), "mean_kl": mean, "median_kl": median,
            "p99_kl": p99, "max_kl": max, "same_top": same as f64 / kls.len() as f64,
        })
    );
}
