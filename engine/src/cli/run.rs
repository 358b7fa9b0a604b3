//! `poly-engine run`: reads prompt token ids, generates tokens on the CPU, and prints every step's token
//! and the likeliest tokens with their probabilities (as JSON lines with `--json`). With `--image` and
//! `--mmproj` a picture, encoded by the projector, is read before prompt token `--image-at` (on the CPU).

use super::CliResult;
use clap::Args;
use poly_engine::generate::{generate, GenerateOptions, Step, DEFAULT_UBATCH};
use poly_engine::model::Arithmetic;
use poly_engine::sample::{Sampler, SamplerConfig};
use poly_engine::state::{KvPrecision, SeqState};
use poly_engine::{EngineError, Model};
use poly_models::compute::Logits;
use poly_models::vision::{ImageRows, VisionEncoder};
use poly_models::GgufFile;
use serde_json::json;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args)]
pub struct RunArgs {
    /// The GGUF model file.
    #[arg(long)]
    model: PathBuf,
    /// Prompt token ids, comma-separated.
    #[arg(long, value_name = "IDS", conflicts_with = "prompt_file")]
    prompt_tokens: Option<String>,
    /// A file of prompt token ids separated by commas or white space.
    #[arg(long, value_name = "FILE")]
    prompt_file: Option<PathBuf>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
    /// How many likeliest tokens to print per step.
    #[arg(long, default_value_t = 5)]
    top: usize,
    /// Most prompt tokens per forward call.
    #[arg(long, default_value_t = DEFAULT_UBATCH)]
    ubatch: usize,
    /// Worker threads (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Run on the CPU even when there is a GPU.
    #[arg(long, conflicts_with = "gpu")]
    cpu: bool,
    /// Run on GPU N (default: GPU 0 when there is one, else the CPU).
    #[arg(long, value_name = "N")]
    gpu: Option<usize>,
    /// Context size in tokens (default: the model's training context).
    #[arg(long, default_value_t = 0)]
    n_ctx: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temp: f32,
    /// Top-k (0: off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Top-p (1: off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Min-p (0: off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Repetition penalty (1: off).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Presence penalty (0: off).
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// Frequency penalty (0: off).
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Tokens the penalties look back over.
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Keep keys and values in the KV cache at f32 precision (default: rounded to f16, as llama.cpp).
    #[arg(long, conflicts_with = "kv")]
    kv_f32: bool,
    /// Print JSON lines instead of text.
    #[arg(long)]
    json: bool,
    /// Write these tokens instead of sampling (a file of token ids, or an earlier `run --json`'s output):
    /// the same answer again, so that two configurations can be compared step by step (`poly-engine
    /// kl`). Stop tokens do not end it; --max-tokens is the file's length.
    #[arg(long, value_name = "FILE")]
    follow: Option<PathBuf>,
    /// Batch-invariant arithmetic: the same results however the prompt is split into calls (--ubatch)
    /// and on any thread count (default: llama.cpp's orders, which depend on both).
    #[arg(long)]
    batch_invariant: bool,
    /// A picture (PNG, JPEG, WebP) read into the prompt, encoded by --mmproj's projector (CPU only).
    #[arg(long, value_name = "FILE", requires = "mmproj")]
    image: Option<PathBuf>,
    /// The vision projector GGUF (`mmproj`) that encodes --image.
    #[arg(long, value_name = "FILE", requires = "image")]
    mmproj: Option<PathBuf>,
    /// Where the picture goes: before this prompt token (default 0: before the prompt). At least one
    /// prompt token must follow it.
    #[arg(long, default_value_t = 0, requires = "image")]
    image_at: usize,
    /// The token id the picture's rows stand for in the sequence's record (their embeddings are replaced).
    #[arg(long, default_value_t = 0, requires = "image")]
    image_token: u32,
    #[command(flatten)]
    placement: super::PlacementArgs,
    #[command(flatten)]
    pub knobs: super::knobs::KnobArgs,
}

/// The rows of the picture in `image` as the projector in `mmproj` encodes it for `model`.
fn encode_picture(
    model: &Model,
    image: &std::path::Path,
    mmproj: &std::path::Path,
) -> Result<ImageRows, Box<dyn std::error::Error>> {
    let file = GgufFile::open(mmproj)?;
    let bytes = std::fs::read(image).map_err(|e| format!("reading {}: {e}", image.display()))?;
    let encoder = VisionEncoder::load(&file)?;
    model.check_projector(encoder.projector_type())?;
    Ok(encoder.encode_picture(&bytes)?)
}

/// Reads the prompt tokens before `at` and then the picture's rows (standing for `token`s) into `state`.
fn read_picture(
    model: &Model,
    state: &mut SeqState,
    prompt: &[u32],
    (at, token): (usize, u32),
    rows: &ImageRows,
) -> Result<(), EngineError> {
    if at >= prompt.len() {
        return Err(EngineError(format!(
            "--image-at {at}: the picture needs prompt tokens after it (the prompt has {})",
            prompt.len()
        )));
    }
    let mut tokens = prompt[..at].to_vec();
    tokens.extend(std::iter::repeat_n(token, rows.n_rows()));
    model.eval_picture(state, &tokens, (at, rows), Logits::None)?;
    Ok(())
}

/// Token ids separated by commas and/or white space.
fn parse_ids(s: &str) -> Result<Vec<u32>, EngineError> {
    s.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|p| !p.is_empty())
        .map(|p| {
            p.parse::<u32>()
                .map_err(|_| EngineError(format!("{p:?} is not a token id")))
        })
        .collect()
}

fn step_json(i: usize, s: &Step, n_vocab: usize) -> serde_json::Value {
    let top: Vec<serde_json::Value> = s
        .top
        .iter()
        .map(|&(t, lp)| json!({"token": t, "logprob": lp, "prob": lp.exp()}))
        .collect();
    json!({"step": i, "token": s.token, "logprob": s.logprob, "prob": s.logprob.exp(), "top": top,
           "n_vocab": n_vocab})
}

/// The tokens to follow: JSON lines with a `token` each (an earlier `run --json`), else token ids.
fn follow_tokens(path: &PathBuf) -> Result<Vec<u32>, EngineError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| EngineError(format!("{}: {e}", path.display())))?;
    if !text.trim_start().starts_with('{') {
        return parse_ids(&text);
    }
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            let v: serde_json::Value = serde_json::from_str(l)
                .map_err(|e| EngineError(format!("{} line {}: {e}", path.display(), i + 1)))?;
            v.get("token")
                .and_then(serde_json::Value::as_u64)
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| EngineError(format!("{} line {}: no token", path.display(), i + 1)))
        })
        .collect()
}

fn step_text(i: usize, s: &Step) -> String {
    let top: Vec<String> = s
        .top
        .iter()
        .map(|&(t, lp)| format!("{t}:{:.4}", lp.exp()))
        .collect();
    format!(
        "{i:4} token {:6} p {:.4}  top {}",
        s.token,
        s.logprob.exp(),
        top.join(" ")
    )
}

pub fn run(args: RunArgs) -> CliResult {
    let prompt = match (&args.prompt_tokens, &args.prompt_file) {
        (Some(s), _) => parse_ids(s)?,
        (None, Some(f)) => parse_ids(
            &std::fs::read_to_string(f)
                .map_err(|e| EngineError(format!("{}: {e}", f.display())))?,
        )?,
        (None, None) => {
            return Err(EngineError("give --prompt-tokens or --prompt-file".into()).into())
        }
    };
    let mut pool = rayon::ThreadPoolBuilder::new();
    if let Some(n) = args.threads {
        pool = pool.num_threads(n);
    }
    let pool = pool.build()?;

    let start = Instant::now();
    let arithmetic = if args.batch_invariant {
        Arithmetic::BatchInvariant
    } else {
        Arithmetic::LlamaCpp
    };
    let precision = if args.kv_f32 {
        KvPrecision::F32
    } else {
        args.knobs.kv()
    };
    let mut model = Model::load(&args.model)?
        .with_arithmetic(arithmetic)
        .with_kv(precision)?;
    model.use_device_with(
        poly_engine::gpu::DeviceChoice::from_flags(args.cpu, args.gpu)?,
        &args.placement.placement(args.n_ctx, args.ubatch),
    )?;
    eprintln!("running on {}", model.device_name());
    let loaded = start.elapsed();
    let mut state = model.new_state(args.n_ctx);
    let follow = args.follow.as_ref().map(follow_tokens).transpose()?;
    if follow.as_ref().is_some_and(Vec::is_empty) {
        return Err(EngineError("--follow: the file names no tokens".into()).into());
    }
    let n_vocab = model.info().n_vocab;
    if let Some(t) = follow.iter().flatten().find(|&&t| t as usize >= n_vocab) {
        return Err(EngineError(format!("--follow: token {t} is outside the vocabulary")).into());
    }
    let opts = GenerateOptions {
        max_tokens: follow.as_ref().map_or(args.max_tokens, Vec::len),
        follow,
        stop_tokens: if args.ignore_eos {
            Vec::new()
        } else {
            model.info().stop_tokens()
        },
        ubatch: args.ubatch,
        top_n: args.top,
    };
    let mut sampler = Sampler::new(SamplerConfig {
        temperature: args.temp,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        min_keep: 0,
        repeat_penalty: args.repeat_penalty,
        frequency_penalty: args.frequency_penalty,
        presence_penalty: args.presence_penalty,
        penalty_last_n: args.repeat_last_n,
        seed: args.seed,
    });

    let prompt = match (&args.image, &args.mmproj) {
        (Some(image), Some(mmproj)) => {
            let rows = encode_picture(&model, image, mmproj)?;
            read_picture(
                &model,
                &mut state,
                &prompt,
                (args.image_at, args.image_token),
                &rows,
            )?;
            for &t in &prompt[..args.image_at] {
                sampler.accept(t);
            }
            eprintln!(
                "picture: {}×{} rows read before prompt token {}",
                rows.n_x, rows.n_y, args.image_at
            );
            prompt[args.image_at..].to_vec()
        }
        _ => prompt,
    };

    let mut out = std::io::stdout();
    let mut io_error = None;
    let mut n_steps = 0usize;
    let gen_start = Instant::now();
    let generation = pool.install(|| {
        generate(&model, &mut state, &prompt, &opts, &mut sampler, |s| {
            let line = if args.json {
                step_json(n_steps, s, n_vocab).to_string()
            } else {
                step_text(n_steps, s)
            };
            n_steps += 1;
            if let Err(e) = writeln!(out, "{line}") {
                io_error.get_or_insert(e);
            }
        })
    })?;
    if let Some(e) = io_error {
        return Err(e.into());
    }
    let secs = gen_start.elapsed().as_secs_f64();
    eprintln!(
        "{} prompt tokens, {} generated ({:?}) in {secs:.2} s; model loaded in {:.2} s",
        prompt.len(),
        generation.steps.len(),
        generation.stop,
        loaded.as_secs_f64()
    );
    if let Some(c) = model.expert_stats() {
        eprintln!(
            "expert cache: {} of {} routings from VRAM; {} experts copied on demand, {} computed on \
             the CPU, {} copied ahead ({} of them routed); {} admitted ({} from scratch slots)",
            c.routed_vram,
            c.routed,
            c.staged_decode,
            c.cpu_experts,
            c.ahead_copied,
            c.ahead_routed,
            c.policy.uploads,
            c.admitted_on_card
        );
        if c.skipped.steps > 0 {
            eprintln!(
                "left out (--tail-skip / --skip-weight / --cold-mass): {} experts, {:.4} of a token's \
                 routed weight per layer on average, {} MiB not read",
                c.skipped.experts,
                c.skipped.mean_weight(),
                c.skipped.bytes >> 20
            );
        }
        if c.swapped.steps > 0 {
            eprintln!(
                "swapped in (--cache-bias): {} experts, {:.4} of a token's routed weight per layer on \
                 average",
                c.swapped.experts,
                c.swapped.mean_weight()
            );
        }
    }
    Ok(())
}
