//! `poly-engine bench`: the engine's speed on one model file, measured the way llama.cpp's `llama-bench`
//! measures it, so the two can be compared on the same file and thread count.
//!
//! - Reading (`pp`): from an empty state, one prompt of `--prompt` random tokens (the first is BOS when the
//!   file names one) read in forward calls of `--ubatch` tokens, logits of the last token only.
//! - Writing (`tg`): from an empty state, `--gen` single-token forward calls, each asking for logits (the
//!   next token is random, as llama-bench's, so no sampling is timed).
//!
//! `--gpu N` measures the card (dense weights in VRAM, routed experts as `--vram-reserve-mib` and
//! `--expert-budget-mib` place them; the JSON's `experts` says how many were in VRAM and how often they
//! served); the CPU is the default. On the CPU the JSON's `route_top10_share` is the measured skew of the
//! routing over every call of the run (the expert cache's definition: the share of routings that went to
//! each MoE layer's most-routed tenth of its experts); `--route-report` adds it per layer.
//!
//! `--depth N` (llama-bench's `-d`): each repetition of either test first reads N random tokens, untimed,
//! so the timed prompt or tokens attend to a context of N (answers late in a long conversation).
//!
//! One warm-up of each (a whole prompt, one decode step) precedes the timed repetitions, as llama-bench
//! does. Each repetition reports wall time and the CPU time of the whole process (all threads) over it:
//! CPU seconds over wall seconds near the thread count means the threads ran; well below it means the
//! machine was busy with other work. The result is one JSON object on stdout.

use super::CliResult;
use clap::Args;
use poly_engine::cpu::moe::top_tenth_share;
use poly_engine::generate::{prefill, DEFAULT_UBATCH};
use poly_engine::gpu::DeviceChoice;
use poly_engine::model::Arithmetic;
use poly_engine::state::SeqState;
use poly_engine::{EngineError, Model};
use poly_kernels::rng::Rng;
use poly_models::compute::Logits;
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args)]
pub struct BenchArgs {
    /// The GGUF model file.
    #[arg(long)]
    model: PathBuf,
    /// Prompt tokens read per repetition (0: skip the reading test).
    #[arg(long, default_value_t = 512)]
    prompt: usize,
    /// Tokens written per repetition (0: skip the writing test).
    #[arg(long, default_value_t = 128)]
    gen: usize,
    /// Tokens of context read (untimed) before each repetition of either test, as llama-bench's `-d`.
    #[arg(long, default_value_t = 0)]
    depth: usize,
    /// Tokens of context the state has room for, as the serve mode's `--max-context` (default: what
    /// the tests need): the model is placed for it as when serving (a fixed expert budget reserves its
    /// attention caches whole), so an answer rate can be compared with the server's at the same context.
    #[arg(long)]
    max_context: Option<usize>,
    /// Worker threads (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Timed repetitions of each test.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Most prompt tokens per forward call.
    #[arg(long, default_value_t = DEFAULT_UBATCH)]
    ubatch: usize,
    /// Seed of the random tokens.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Skip the warm-up runs.
    #[arg(long)]
    no_warmup: bool,
    /// Run on GPU N (default: the CPU, so CPU figures stay comparable with `llama-bench -ngl 0`).
    #[arg(long)]
    gpu: Option<usize>,
    /// Compute in the serve mode's batch-invariant arithmetic instead of llama.cpp's orders.
    #[arg(long)]
    batch_invariant: bool,
    /// Also print each MoE layer's measured top-tenth share (CPU: `route_top10_by_layer` in the JSON).
    #[arg(long)]
    route_report: bool,
    #[command(flatten)]
    placement: super::PlacementArgs,
    #[command(flatten)]
    pub knobs: super::knobs::KnobArgs,
}

/// CPU seconds (user + system) this process has used, all threads; `None` where /proc is missing.
fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name (which may hold spaces): state is field 3, utime and
    // stime are fields 14 and 15, in clock ticks (100 per second on Linux).
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

/// Wall and CPU seconds of one timed run.
struct Sample {
    wall: f64,
    cpu: Option<f64>,
}

fn timed(f: impl FnOnce() -> Result<(), EngineError>) -> Result<Sample, EngineError> {
    let cpu0 = process_cpu_seconds();
    let t0 = Instant::now();
    f()?;
    let wall = t0.elapsed().as_secs_f64();
    let cpu = cpu0.zip(process_cpu_seconds()).map(|(a, b)| b - a);
    Ok(Sample { wall, cpu })
}

/// `n` random tokens, the first BOS where the model has one.
fn random_tokens(rng: &mut Rng, n: usize, n_vocab: usize, bos: Option<u32>) -> Vec<u32> {
    (0..n)
        .map(|i| match (i, bos) {
            (0, Some(b)) => b,
            _ => rng.below(n_vocab as u32),
        })
        .collect()
}

/// The context the model is placed for and each state has room for: the depth, the prompt and the
/// tokens, or `--max-context` when larger.
fn context(args: &BenchArgs) -> usize {
    let needed = args.depth + args.prompt + args.gen;
    args.max_context.map_or(needed, |c| c.max(needed))
}

/// A fresh state with room for the context ([`context`]), holding `--depth` random tokens.
fn state_at_depth(model: &Model, rng: &mut Rng, args: &BenchArgs) -> Result<SeqState, EngineError> {
    let info = model.info();
    let mut state = model.new_state(context(args));
    if args.depth > 0 {
        let context = random_tokens(rng, args.depth, info.n_vocab, info.bos);
        prefill(model, &mut state, &context, args.ubatch)?;
    }
    Ok(state)
}

fn read_prompt(
    model: &Model,
    state: &mut SeqState,
    rng: &mut Rng,
    args: &BenchArgs,
) -> Result<(), EngineError> {
    let info = model.info();
    let bos = info.bos.filter(|_| args.depth == 0);
    let tokens = random_tokens(rng, args.prompt, info.n_vocab, bos);
    prefill(model, state, &tokens, args.ubatch).map(|_| ())
}

fn write_tokens(
    model: &Model,
    state: &mut SeqState,
    rng: &mut Rng,
    n: usize,
) -> Result<(), EngineError> {
    let info = model.info();
    let mut token = info.bos.unwrap_or(0);
    for _ in 0..n {
        model.eval(state, &[token], Logits::Last)?;
        token = rng.below(info.n_vocab as u32);
    }
    Ok(())
}

/// Tokens per second of each sample, their mean and standard deviation, and the CPU use.
fn summary(n_tokens: usize, samples: &[Sample]) -> serde_json::Value {
    let ts: Vec<f64> = samples.iter().map(|s| n_tokens as f64 / s.wall).collect();
    let mean = ts.iter().sum::<f64>() / ts.len().max(1) as f64;
    let var = ts.iter().map(|t| (t - mean).powi(2)).sum::<f64>() / (ts.len().max(2) - 1) as f64;
    let wall: f64 = samples.iter().map(|s| s.wall).sum();
    let cpu: Option<f64> = samples.iter().map(|s| s.cpu).sum();
    json!({
        "n_tokens": n_tokens,
        "avg_ts": mean,
        "stddev_ts": var.sqrt(),
        "samples_ts": ts,
        "samples_wall_s": samples.iter().map(|s| s.wall).collect::<Vec<_>>(),
        "wall_s": wall,
        "cpu_s": cpu,
        "cpu_per_wall": cpu.map(|c| c / wall),
    })
}

pub fn run(args: BenchArgs) -> CliResult {
    if args.reps == 0 {
        return Err(EngineError("--reps must be at least 1".into()).into());
    }
    let mut pool = rayon::ThreadPoolBuilder::new();
    if let Some(n) = args.threads {
        pool = pool.num_threads(n);
    }
    let pool = pool.build()?;
    let threads = pool.current_num_threads();

    let t0 = Instant::now();
    let arithmetic = if args.batch_invariant {
        Arithmetic::BatchInvariant
    } else {
        Arithmetic::LlamaCpp
    };
    let mut model = Model::load(&args.model)?
        .with_arithmetic(arithmetic)
        .with_kv(args.knobs.kv())?;
    model.use_device_with(
        DeviceChoice::from_flags(args.gpu.is_none(), args.gpu)?,
        &args.placement.placement(context(&args), args.ubatch),
    )?;
    let load_s = t0.elapsed().as_secs_f64();
    let mut rng = Rng::new(args.seed);

    let (pp, tg) = pool.install(|| -> Result<_, EngineError> {
        let mut pp = Vec::new();
        let mut tg = Vec::new();
        if args.prompt > 0 {
            if !args.no_warmup {
                let mut state = state_at_depth(&model, &mut rng, &args)?;
                read_prompt(&model, &mut state, &mut rng, &args)?;
            }
            for _ in 0..args.reps {
                let mut state = state_at_depth(&model, &mut rng, &args)?;
                pp.push(timed(|| read_prompt(&model, &mut state, &mut rng, &args))?);
            }
        }
        if args.gen > 0 {
            if !args.no_warmup {
                let mut state = state_at_depth(&model, &mut rng, &args)?;
                write_tokens(&model, &mut state, &mut rng, 1)?;
            }
            for _ in 0..args.reps {
                let mut state = state_at_depth(&model, &mut rng, &args)?;
                tg.push(timed(|| {
                    write_tokens(&model, &mut state, &mut rng, args.gen)
                })?);
            }
        }
        Ok((pp, tg))
    })?;

    let mut out = json!({
        "model": args.model.display().to_string(),
        "arch": model.info().arch,
        "device": model.device_name(),
        "batch_invariant": args.batch_invariant,
        "threads": threads,
        "ubatch": args.ubatch,
        "depth": args.depth,
        "context": context(&args),
        "reps": args.reps,
        "load_s": load_s,
    });
    // The knobs that differ from the defaults, so a result file says what it measured.
    let knobs = poly_engine::knobs::in_force_non_default(model.kv());
    if !knobs.is_empty() {
        out["knobs"] = json!(knobs);
    }
    if !pp.is_empty() {
        out["pp"] = summary(args.prompt, &pp);
    }
    if !tg.is_empty() {
        out["tg"] = summary(args.gen, &tg);
    }
    // The CPU backend's measured routing, the GPU expert cache's definition (`route_top10_share`): the
    // share of the routings of every call above (warm-ups included) that went to each layer's
    // most-routed tenth of its experts.
    let counts = model.route_counts();
    if counts.iter().any(|l| !l.is_empty()) {
        out["route_top10_share"] = json!(top_tenth_share(&counts));
        out["routed"] = json!(counts.iter().flatten().sum::<u64>());
        if args.route_report {
            let by_layer: Vec<serde_json::Value> = counts
                .iter()
                .enumerate()
                .filter(|(_, c)| !c.is_empty())
                .map(|(layer, c)| {
                    json!({"layer": layer, "top10_share": top_tenth_share(std::slice::from_ref(c))})
                })
                .collect();
            out["route_top10_by_layer"] = json!(by_layer);
        }
    }
    if let Some(c) = model.expert_stats() {
        out["experts"] = json!({
            "in_vram": model.experts_in_vram(),
            "cache_bytes": c.bytes,
            "slots": c.policy.slots,
            "occupied": c.policy.occupied,
            "uploads": c.policy.uploads,
            "evictions": c.policy.evictions,
            "staged": c.staged,
            "staged_decode": c.staged_decode,
            "ahead_copied": c.ahead_copied,
            "ahead_routed": c.ahead_routed,
            "left_out": c.skipped.experts,
            "left_out_weight_share": c.skipped.mean_weight(),
            "left_out_bytes": c.skipped.bytes,
            "swapped_in": c.swapped.experts,
            "swapped_in_weight_share": c.swapped.mean_weight(),
            "admitted_on_card": c.admitted_on_card,
            "route_top10_share": c.route_top10_share,
            "cpu_us_overhead": c.cpu_us_overhead,
            "cpu_us_per_expert": c.cpu_us_per_expert,
            "copy_us_per_expert": c.copy_us_per_expert,
            "card_wait_us_base": c.card_wait_us_base,
            "card_wait_us_per_copy": c.card_wait_us_per_copy,
            "cpu_experts": c.cpu_experts,
            "cpu_seconds": c.cpu_seconds,
            "routed": c.routed,
            "vram_share": if c.routed > 0 { c.routed_vram as f64 / c.routed as f64 } else { 1.0 },
        });
    }
    println!("{out}");
    Ok(())
}
