//! The command line of `poly-engine`: serving a model (`--model FILE`, the engine process) or one of the
//! model-file tools, one module per subcommand.

mod bench;
mod dump;
mod encode_image;
mod inspect;
mod kernels;
mod kl;
mod knobs;
mod run;
mod synth;

mod verify;

use clap::{Args, Parser, Subcommand};
use poly_engine::gpu::{
    AdmissionRule, Admissions, LendRefill, MissingExperts, MissingSkip, Placement,
};
use poly_engine::model::Arithmetic;
use poly_engine::serve::{serve, ServeOptions, DEFAULT_ARITHMETIC};
use std::path::PathBuf;
use std::process::ExitCode;

/// Errors of the command-line tools: a message for people.
pub type CliResult = Result<(), Box<dyn std::error::Error>>;

#[derive(Parser)]
#[command(
    name = "poly-engine",
    version,
    about = "PolyStrata engine: serves a model over the line protocol on stdin/stdout \
             (poly-engine --model FILE), or runs a model-file tool",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

/// The engine process's flags.
#[derive(Args)]
struct ServeArgs {
    /// The GGUF model file to serve.
    #[arg(long, required = true)]
    model: Option<PathBuf>,
    /// Most tokens a conversation holds (default: the model's training context). On a card held to a
    /// reserve the attention caches grow with the conversation (2,048 rows at a time, the expert cache
    /// giving up and taking back what they take); with `--expert-budget-mib` they are reserved whole.
    #[arg(long, default_value_t = 0)]
    max_context: usize,
    /// Worker threads (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Run on the CPU even when there is a GPU.
    #[arg(long, conflicts_with = "gpu")]
    cpu: bool,
    /// Run on GPU N (default: GPU 0 when there is one, else the CPU).
    #[arg(long, value_name = "N")]
    gpu: Option<usize>,
    /// MiB of RAM that parked conversations may hold (least recently used dropped first).
    #[arg(long, default_value_t = 1024)]
    park_mib: usize,
    /// Most requests running at once, each on its own conversation state, taking turns (a written token,
    /// or a part of a prompt, each); others wait in the queue. A round's written tokens are one forward
    /// call on the CPU (recurrent layers run each state's own rows), else one call each; a short answer no longer
    /// waits for a long one.
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    parallel: u32,
    /// Keep a checkpoint of recurrent layers every N prompt tokens read (0: only where asked; default
    /// 2048, or --long-ubatch where prompts are read in long calls).
    #[arg(long, value_name = "N")]
    checkpoint_every: Option<usize>,
    /// Most prompt tokens per forward call (default: 512 on the CPU, 2048 on a GPU, whose grouped expert
    /// kernels gain from more tokens per expert).
    #[arg(long, value_name = "N")]
    ubatch: Option<usize>,
    /// Prompt tokens per forward call while more than --ubatch remain (0: never; default 8192 on a card
    /// that holds only part of the routed experts, whose cache lends these calls' scratch, else 0).
    #[arg(long, value_name = "N")]
    long_ubatch: Option<usize>,
    /// No guessed tokens (by default an answer on the CPU guesses from the conversation's repeats where
    /// the model's state can be cut back; the answer is the same either way).
    #[arg(long)]
    no_draft: bool,
    /// Guesses from repeats: how many of the conversation's last tokens (the one just written included)
    /// must have occurred before for what followed them then to be guessed (llama.cpp's n-gram lookup
    /// size). Fewer guess more often and more wrongly; the answer is the same either way.
    #[arg(long, value_name = "N", default_value_t = poly_engine::serve::DEFAULT_REPEATS_MIN_MATCH,
          value_parser = clap::value_parser!(u32).range(1..=16))]
    repeats_min_match: u32,
    /// A draft model of the same vocabulary (a GGUF file, run on the CPU beside a model on the CPU):
    /// its greedy tokens are guessed instead of the conversation's repeats, and checked as those are (the
    /// answer is the same either way). Its state is KV caches only.
    #[arg(long, value_name = "FILE")]
    draft: Option<PathBuf>,
    /// Guesses from the model's own draft block (the MTP head of a Qwen3.5/3.6 file), one token a window
    /// on the CPU, checked as the others are (the answer is the same either way). Off until it is
    /// measured to pay.
    #[arg(long, value_name = "on|off", default_value = "off", conflicts_with = "draft",
          action = clap::ArgAction::Set,
          value_parser = parse_on_off)]
    draft_block: bool,
    /// llama.cpp's summation orders, bit for bit with its CPU build, instead of the batch-invariant
    /// default (with them, a conversation resumed from a kept state or a prompt split into other calls
    /// can differ from a fresh read in the last bits, a few hundredths in probability on 4-bit models).
    #[arg(long, conflicts_with = "batch_invariant")]
    llama_orders: bool,
    /// Batch-invariant arithmetic (the default): any split of a prompt into calls, and any thread
    /// count, gives the same results bit for bit.
    #[arg(long)]
    batch_invariant: bool,
    /// A vision projector (`mmproj` GGUF, the `clip` layout llama.cpp's mtmd reads) that reads the
    /// pictures GENs carry into the prompt (on the CPU; READY's `vision` echoes it).
    #[arg(long, value_name = "FILE")]
    mmproj: Option<PathBuf>,
    /// No warm-up before READY on a GPU (a short read and a few tokens that load the kernels and capture
    /// the shallow decode graph; was POLY_WARMUP=0).
    #[arg(long)]
    no_warmup: bool,
    /// Instead of serving: judge this configuration (device, placement, knobs) against the CPU
    /// reference on the prompts of FILE (token ids, one prompt a line), print the figures as one JSON
    /// object and exit 1 when they are out of bounds (`polystrata verify`).
    #[arg(long, value_name = "FILE")]
    verify: Option<PathBuf>,
    /// Tokens written per prompt by --verify.
    #[arg(long, value_name = "N", default_value_t = 24)]
    verify_tokens: usize,
    /// --verify's bound on the mean KL divergence from the reference (nats).
    #[arg(long, value_name = "NATS", default_value_t = VERIFY_MAX_MEAN_KL)]
    verify_max_mean_kl: f64,
    /// --verify's bound on the share of steps whose likeliest token is the reference's.
    #[arg(long, value_name = "SHARE", default_value_t = VERIFY_MIN_SAME_TOP)]
    verify_min_same_top: f64,
    #[command(flatten)]
    placement: PlacementArgs,
    #[command(flatten)]
    knobs: knobs::KnobArgs,
}

/// `--verify`'s default bounds (KL over the whole vocabulary). Measured on the CPU against the reference,
/// three prompts of 64 tokens and 24 answered: llama.cpp's own orders (a prompt read in one call against
/// token by token) 0.0084 (SmolLM2) and 0.0132 (Gemma 3 270M), the same likeliest token in 94–100% of
/// steps; `--kv q8_0` 0.0092 and 0.0124; a deliberately broken product (`POLY_BREAK_BATCHES=1`)
/// 0.096–0.228 and 85–89%. A card is held to the same bounds.
const VERIFY_MAX_MEAN_KL: f64 = 0.05;
const VERIFY_MIN_SAME_TOP: f64 = 0.85;

/// Where a GPU run puts the routed experts (issue 8's VRAM expert cache).
#[derive(Args, Clone, Debug)]
pub struct PlacementArgs {
    /// MiB of VRAM left free on the card (default: a 32nd of the card, 256 to 768 MiB).
    #[arg(long, value_name = "MIB")]
    vram_reserve_mib: Option<usize>,
    /// MiB of VRAM for the routed-expert cache instead of all that is left (0: no expert in VRAM).
    #[arg(long, value_name = "MIB")]
    expert_budget_mib: Option<usize>,
    /// Experts the cache may upload per MoE layer and generated token (0: the cache stays as placed).
    #[arg(long, value_name = "N", default_value_t = Placement::DEFAULT_UPLOADS_PER_LAYER)]
    expert_uploads: usize,
    /// Which missing experts those uploads take: only those on the card for the token, copied on demand
    /// or ahead (`card`: no admission crosses the bus), or those and then those the CPU computed
    /// (`all`). Measured on an H100 host at 8 GB: `card` faster on four files (+3% to +8%).
    #[arg(long, value_enum, default_value_t = Admissions::Card)]
    expert_admissions: Admissions,
    /// Decay per token of the routing scores admissions compare (above 0, below 1).
    #[arg(long, value_name = "D", default_value_t = AdmissionRule::default().decay,
          value_parser = parse_decay)]
    expert_decay: f32,
    /// How much higher than its victim's a newcomer's score must be, before the noise part.
    #[arg(long, value_name = "M", default_value_t = AdmissionRule::default().margin,
          value_parser = parse_at_least_zero)]
    expert_margin: f32,
    /// The noise part of that margin, in standard deviations of the two scores' difference (0: the
    /// fixed margin alone, which admits on almost every miss when routing does not change).
    #[arg(long, value_name = "Z", default_value_t = AdmissionRule::default().noise_margin,
          value_parser = parse_at_least_zero)]
    expert_noise_margin: f32,
    /// Neither read nor write the expert profile (`<model>.poly-profile.json`).
    #[arg(long)]
    no_expert_profile: bool,
    /// Copy experts to the card through pinned staging buffers only (not straight from the model file's
    /// mapping, page-locked).
    #[arg(long)]
    expert_staging_only: bool,
    /// Where a single token's experts that are not in VRAM are computed: all on the CPU while the card
    /// computes its own (the default; measured on two H100 hosts at 8 GB as fast as the split or
    /// faster), split between copies to the card and the CPU by measured cost, all copied to the card,
    /// or read by the card's kernels from the page-locked file over the bus (`mapped`: no host work,
    /// decode graphs). Small prompt calls split by cost under `cpu` and `split`.
    #[arg(long, value_enum, default_value_t = MissingExperts::Cpu)]
    missing_experts: MissingExperts,
    /// Approximate, off by default: a single token's expert that is not in VRAM and ranks N+1 or later
    /// among its choices is left out (neither copied nor computed; prompts untouched). DONE and STATS
    /// count what was left out; `polystrata verify` measures how far the answers move.
    #[arg(long, value_name = "N")]
    tail_skip: Option<usize>,
    /// Approximate, off by default: a single token's expert that is not in VRAM and carries less than F
    /// (0 < F < 1) of the token's routed weight is left out (overrides --tail-skip).
    #[arg(long, value_name = "F", value_parser = parse_fraction)]
    skip_weight: Option<f32>,
    /// Approximate, off by default (Krasis's cold-mass pruning): a single token's lightest experts that
    /// are not in VRAM are left out, lightest first, while together they carry at most P (0 < P < 1) of
    /// its routed weight (overrides --tail-skip and --skip-weight).
    #[arg(long, value_name = "P", value_parser = parse_fraction)]
    cold_mass: Option<f32>,
    /// With --cold-mass: at most M experts a token left out (default: no cap but P).
    #[arg(long, value_name = "M", requires = "cold_mass")]
    cold_max: Option<usize>,
    /// Approximate, off by default: F (0 < F <= 1; 0: off) added to a single token's router probability of
    /// every expert in VRAM before its top-k, so its routing leans to the card; the chosen experts keep
    /// their unbiased weights (prompts untouched). 1 puts every cached expert first. DONE and STATS count
    /// the choices it changed.
    #[arg(long, value_name = "F", default_value_t = 0.0, value_parser = parse_cache_bias)]
    cache_bias: f32,
    /// The scratch the budget keeps is that of a call of N tokens (default 512, or the largest call's if
    /// smaller; the serve mode's calls are 2,048). A larger call borrows VRAM from the expert cache for
    /// its scratch (or takes free room above the reserve) and the cache takes it back before the answer,
    /// so answers keep a larger cache (a held card only).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    scratch_tokens: Option<u64>,
    /// What the cache holds again when it takes back what it lent to a large call: the experts of the
    /// highest scores before the call (`before`), of the highest scores now, the prompt's routings
    /// counted (`now`), or those it held before (`resident`).
    #[arg(long, value_enum, default_value_t = LendRefill::Before)]
    lend_refill: LendRefill,
}

/// `on` or `off` (a switch whose default may change once measured, so it is spelled out).
fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{s:?}: on or off")),
    }
}

fn parse_cache_bias(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!("a number from 0 to 1, not {s:?}")),
    }
}

fn parse_fraction(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(f) if f > 0.0 && f < 1.0 => Ok(f),
        _ => Err(format!("a number above 0 and below 1, not {s:?}")),
    }
}

fn parse_decay(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(d) if d > 0.0 && d < 1.0 => Ok(d),
        _ => Err(format!("a number above 0 and below 1, not {s:?}")),
    }
}

fn parse_at_least_zero(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(m) if m >= 0.0 && m.is_finite() => Ok(m),
        _ => Err(format!("a number ≥ 0, not {s:?}")),
    }
}

impl PlacementArgs {
    /// The placement for sequences of `n_ctx` tokens (0: the model's training context) read in forward
    /// calls of at most `call_tokens`.
    pub fn placement(&self, n_ctx: usize, call_tokens: usize) -> Placement {
        Placement {
            reserve_mib: self.vram_reserve_mib,
            expert_budget: self.expert_budget_mib.map(|m| m.saturating_mul(1 << 20)),
            uploads_per_layer: self.expert_uploads,
            admissions: self.expert_admissions,
            admission_rule: AdmissionRule {
                decay: self.expert_decay,
                margin: self.expert_margin,
                noise_margin: self.expert_noise_margin,
            },
            n_ctx,
            no_profile: self.no_expert_profile,
            staging_only: self.expert_staging_only,
            missing_experts: self.missing_experts,
            skip: MissingSkip {
                tail: self.tail_skip,
                weight: self.skip_weight,
                cold_mass: self.cold_mass,
                cold_max: self.cold_max,
            },
            cache_bias: self.cache_bias,
            call_tokens,
            scratch_tokens: self.scratch_tokens.map(|n| n as usize),
            lend_refill: self.lend_refill,
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Print what a GGUF model file holds: architecture, metadata, tensor types, expert bytes.
    Inspect(inspect::InspectArgs),
    /// Write one tensor dequantized to little-endian f32, row-major in GGUF order (ne0 fastest).
    Dump(dump::DumpArgs),
    /// Write a synthetic model of a real layout (random weights in their target types).
    Synth(synth::SynthArgs),
    /// Encode a picture with a vision projector (mmproj) file: the rows' shape and a checksum.
    EncodeImage(encode_image::EncodeImageArgs),
    /// Run a model on prompt token ids: greedy (or sampled) tokens with their top-N probabilities.
    Run(run::RunArgs),
    /// Time reading a prompt and writing tokens, as llama-bench does (JSON on stdout).
    Bench(bench::BenchArgs),
    /// How far a run (`run --json --follow REFERENCE`) is from a reference run, step by step: mean and
    /// largest KL divergence, and the share of steps with the same likeliest token.
    Kl(kl::KlArgs),
    /// Compile every CUDA kernel module for an architecture into the kernel cache (NVRTC, no GPU needed).
    Kernels(kernels::KernelsArgs),
}

/// Runs the chosen subcommand, or serves the model.
pub fn run(cli: Cli) -> ExitCode {
    // The knobs go in before anything computes: the kernels read them where they choose a variant.
    let knobs = match &cli.command {
        Some(Command::Run(a)) => Some(&a.knobs),
        Some(Command::Bench(a)) => Some(&a.knobs),
        None => Some(&cli.serve.knobs),
        Some(_) => None,
    };
    if let Some(Err(e)) = knobs.map(knobs::KnobArgs::install) {
        eprintln!("poly-engine: {e}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Some(Command::Inspect(args)) => inspect::run(args),
        Some(Command::Dump(args)) => dump::run(args),
        Some(Command::Synth(args)) => synth::run(args),
        Some(Command::EncodeImage(args)) => encode_image::run(args),
        Some(Command::Run(args)) => run::run(args),
        Some(Command::Bench(args)) => bench::run(args),
        Some(Command::Kl(args)) => kl::run(args),
        Some(Command::Kernels(args)) => kernels::run(args),
        None => {
            let a = cli.serve;
            let Some(model) = a.model else {
                eprintln!("poly-engine: give --model FILE, or a subcommand (see --help)");
                return ExitCode::FAILURE;
            };
            let device = match poly_engine::gpu::DeviceChoice::from_flags(a.cpu, a.gpu) {
                Ok(d) => d,
                Err(e) => {
                    eprintln!("poly-engine: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let ubatch = a.ubatch.unwrap_or(poly_engine::serve::GPU_UBATCH);
            if let Some(prompts) = a.verify {
                return match verify::run(verify::VerifyJob {
                    model,
                    prompts,
                    tokens: a.verify_tokens,
                    device,
                    placement: a.placement.placement(a.max_context, ubatch),
                    arithmetic: if a.llama_orders {
                        Arithmetic::LlamaCpp
                    } else {
                        DEFAULT_ARITHMETIC
                    },
                    kv: a.knobs.kv(),
                    threads: a.threads,
                    ubatch,
                    max_mean_kl: a.verify_max_mean_kl,
                    min_same_top: a.verify_min_same_top,
                }) {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        eprintln!("poly-engine: {e}");
                        ExitCode::FAILURE
                    }
                };
            }
            return serve(ServeOptions {
                model,
                max_context: a.max_context,
                threads: a.threads,
                park_bytes: a.park_mib.saturating_mul(1 << 20),
                checkpoint_every: a.checkpoint_every,
                ubatch: a.ubatch,
                long_ubatch: a.long_ubatch,
                guesses: !a.no_draft,
                repeats_min_match: a.repeats_min_match as usize,
                draft: a.draft,
                draft_block: a.draft_block,
                warm_up: !a.no_warmup,
                parallel: a.parallel as usize,
                mmproj: a.mmproj,
                device,
                placement: a.placement.placement(
                    a.max_context,
                    a.ubatch.unwrap_or(poly_engine::serve::GPU_UBATCH),
                ),
                kv: a.knobs.kv(),
                arithmetic: if a.llama_orders {
                    Arithmetic::LlamaCpp
                } else {
                    // --batch-invariant asks for the default.
                    let _ = a.batch_invariant;
                    DEFAULT_ARITHMETIC
                },
            });
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("poly-engine: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        p: PlacementArgs,
    }

    fn placement(args: &[&str]) -> Result<Placement, clap::Error> {
        let argv = std::iter::once("t").chain(args.iter().copied());
        T::try_parse_from(argv).map(|t| t.p.placement(0, 0))
    }

    /// The approximate placement flags, parsed once into the placement: off by default, each setting its
    /// field, values out of range refused.
    #[test]
    fn the_approximate_modes_are_off_by_default_and_parsed_into_the_placement() {
        let p = placement(&[]).expect("no flags");
        assert!(p.skip.is_off());
        assert_eq!(p.cache_bias, 0.0);
        assert!(p.non_default().is_empty());
        let p = placement(&[
            "--cache-bias",
            "0.05",
            "--cold-mass",
            "0.1",
            "--cold-max",
            "2",
        ])
        .expect("flags");
        assert_eq!(p.cache_bias, 0.05);
        assert_eq!((p.skip.cold_mass, p.skip.cold_max), (Some(0.1), Some(2)));
        assert_eq!(
            placement(&["--cache-bias", "0"]).expect("0").cache_bias,
            0.0
        );
        assert_eq!(
            placement(&["--cache-bias", "1"]).expect("1").cache_bias,
            1.0
        );
        for bad in [
            &["--cache-bias", "1.5"][..],
            &["--cache-bias", "-0.1"],
            &["--cache-bias", "NaN"],
            &["--cold-mass", "1"],
            &["--cold-max", "2"],
        ] {
            assert!(placement(bad).is_err(), "{bad:?}");
        }
    }
}
