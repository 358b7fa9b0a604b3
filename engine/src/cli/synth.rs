//! `poly-engine synth`: writes a synthetic model of a real layout (random weights in their target types)
//! and reports its plan, the routing estimate and the write speed.
//!
//! With `--route-skew` given (or `--calibrate-routers true`), the token-mixing outputs are written at a
//! lower gain and the MoE routers are then calibrated on the model's own forward pass
//! ([`poly_engine::calibrate`]) so that the routing a forward pass does is the one the skew asks for,
//! and synth reports the routing it measured over fresh random tokens. Without it the file is byte for
//! byte what synth always wrote (the committed test fixtures were written so).
//!
//! With `--draft-agreement F` (qwen35moe) the model is written so that its draft block guesses the
//! trunk's next greedy token at about `F` ([`poly_models::synth::agree`]), and synth reports the
//! agreement it measured by running the written file's trunk and draft block on the CPU
//! ([`poly_engine::draft_agreement`]).

use super::CliResult;
use clap::Args;
use poly_engine::calibrate;
use poly_engine::cpu::moe::top_tenth_share;
use poly_engine::draft_agreement;
use poly_kernels::quant::GgmlType;
use poly_models::arch::{TensorClass, ARCH_NAMES, NOT_RUN_ARCH_NAMES};
use poly_models::synth::mmproj::{find_projector_shape, projector_shapes, write_qwen3vl_projector};
use poly_models::synth::mmproj_gemma4v::{
    find_gemma4v_projector_shape, gemma4v_projector_shapes, write_gemma4v_projector,
};
use poly_models::synth::plan::{TypeChoice, CALIBRATED_MIXING_GAIN};
use poly_models::synth::shapes::{all_shapes, find_shape};
use poly_models::synth::{check_class_type, SynthError, SynthOptions, Synthesis};
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Args)]
pub struct SynthArgs {
    /// Architecture: qwen3moe, qwen35moe, gemma3, llama, lfm2moe or gemma4, or qwen3vl-mmproj or
    /// gemma4v-mmproj for a vision projector (see --list-shapes).
    #[arg(long, required_unless_present = "list_shapes")]
    arch: Option<String>,
    /// Shape: tiny, small, or the real model's name (see --list-shapes; case-insensitive).
    #[arg(long, required_unless_present = "list_shapes")]
    shape: Option<String>,
    /// Type of every quantizable tensor (default: the shape's, Q8_0 for tiny, Q4_K otherwise).
    #[arg(long = "type", value_name = "TYPE")]
    default_type: Option<String>,
    /// Per-class types, e.g. expert=Q4_K,attn=Q8_0,embd=Q6_K (classes: embd, output, attn, ssm, conv,
    /// ffn, expert, shexp, router, nextn; norm and ssm_param are always F32).
    #[arg(long, value_name = "CLASS=TYPE,...")]
    types: Option<String>,
    /// Seed of every random value (the file depends on nothing else).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Expert popularity skew: 0 = uniform (default); 1 ≈ real models (the top 10% of experts take
    /// ~25-35%). Given, the routers are calibrated on the model's forward pass (--calibrate-routers).
    #[arg(long)]
    route_skew: Option<f32>,
    /// Write the model so that its forward pass routes as the skew says: attention and delta-net outputs
    /// at gain 0.3 (random attention otherwise collapses each sequence onto a common vector that picks
    /// its experts), then the MoE routers calibrated on the model's own hidden states; and report the
    /// routing measured on fresh tokens (default: true when --route-skew is given, false otherwise:
    /// what synth always wrote, routers drawn for random isotropic states).
    #[arg(long, value_name = "BOOL")]
    calibrate_routers: Option<bool>,
    /// Attention, delta-net and short-convolution outputs scaled by this gain (default 1, or 0.3 when
    /// calibrating routers). Near 0 a token's next token depends mostly on the token itself, so greedy
    /// answers fall into repeats: a model on which guessed tokens are right often (issue 18's tests).
    #[arg(long, value_name = "F")]
    mixing_gain: Option<f32>,
    /// Write the model so that its draft block (a qwen35moe file's MTP block) guesses the main model's
    /// next greedy token at about this share, 0 to 1: the main model's next token mostly a function of
    /// the current one (blocks' outputs at a tenth of their scale), the draft block shown that token's
    /// embedding for this share of the vocabulary. The token embedding and eh_proj are then written in
    /// Q8_0 unless asked in F32, F16, BF16 or Q8_0. Synth measures the agreement on the written file and
    /// prints it. Off by default (the file is what synth always wrote).
    #[arg(long, value_name = "F")]
    draft_agreement: Option<f32>,
    /// Greedy steps of the agreement measured after writing with --draft-agreement, after each of 8
    /// prompts of 8 random tokens (0: no measurement).
    #[arg(long, value_name = "N", default_value_t = draft_agreement::DEFAULT_STEPS)]
    agreement_steps: usize,
    /// Measure the routing of a forward pass over fresh random tokens after writing (default: when
    /// calibrating; with --calibrate-routers false it measures the routers as drawn).
    #[arg(long, value_name = "BOOL")]
    measure_routing: Option<bool>,
    /// Random tokens of the calibration's forward call.
    #[arg(long, default_value_t = poly_engine::calibrate::DEFAULT_CALIBRATION_TOKENS)]
    calibration_tokens: usize,
    /// Fresh random prompt tokens of the routing measured after calibration (then 32 single tokens).
    #[arg(long, default_value_t = poly_engine::calibrate::DEFAULT_MEASURE_TOKENS)]
    measure_tokens: usize,
    /// Output file.
    #[arg(long, required_unless_present = "list_shapes")]
    out: Option<PathBuf>,
    /// Print the shapes of every architecture and exit.
    #[arg(long)]
    list_shapes: bool,
    /// Plan and report only; write nothing.
    #[arg(long)]
    dry_run: bool,
}

fn parse_type(s: &str) -> Result<GgmlType, SynthError> {
    GgmlType::from_name(s.trim()).ok_or_else(|| SynthError(format!("unknown tensor type {s:?}")))
}

/// Parses `CLASS=TYPE,...`.
fn parse_types(s: &str) -> Result<Vec<(TensorClass, GgmlType)>, SynthError> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|pair| {
            let (c, t) = pair
                .split_once('=')
                .ok_or_else(|| SynthError(format!("--types: {pair:?} is not CLASS=TYPE")))?;
            let class = TensorClass::from_name(c.trim()).ok_or_else(|| {
                let names: Vec<&str> = TensorClass::all().map(|c| c.name()).collect();
                SynthError(format!(
                    "--types: unknown class {c:?} (classes: {})",
                    names.join(", ")
                ))
            })?;
            let ty = parse_type(t)?;
            check_class_type(class, ty)?;
            Ok((class, ty))
        })
        .collect()
}

fn list_shapes() {
    for s in all_shapes() {
        let aliases = if s.aliases.is_empty() {
            String::new()
        } else {
            format!(" (also {})", s.aliases.join(", "))
        };
        println!("{:<10} {:<16} {}{aliases}", s.arch, s.name, s.description);
    }
    for s in projector_shapes() {
        println!("{MMPROJ_ARCH} {:<16} {}", s.name, s.description);
    }
    for s in gemma4v_projector_shapes() {
        println!("{GEMMA4V_MMPROJ_ARCH} {:<16} {}", s.name, s.description);
    }
}

/// `--arch` of Gemma 4's vision projector (`clip.projector_type` `gemma4v`).
const GEMMA4V_MMPROJ_ARCH: &str = "gemma4v-mmproj";

/// Writes a Gemma 4 projector file: matrices in `--type` (F32, F16 or BF16; default F16, as the
/// published projectors), vectors and scalars in F32.
fn write_gemma4v(shape_name: &str, ty: Option<&str>, seed: u64, out: &Path) -> CliResult {
    let shape = find_gemma4v_projector_shape(shape_name).ok_or_else(|| {
        let names: Vec<&str> = gemma4v_projector_shapes().iter().map(|s| s.name).collect();
        format!(
            "unknown shape {shape_name:?} for {GEMMA4V_MMPROJ_ARCH} (shapes: {})",
            names.join(", ")
        )
    })?;
    let ty = match ty {
        Some(t) => parse_type(t)?,
        None => GgmlType::F16,
    };
    write_gemma4v_projector(&shape, ty, seed, out)?;
    eprintln!(
        "synth: {GEMMA4V_MMPROJ_ARCH} {} ({ty} matrices, seed {seed}) -> {}",
        shape.name,
        out.display()
    );
    Ok(())
}

/// `--arch` of the Qwen3-VL / Qwen3.5 / Qwen3.6 vision projector (`clip.projector_type` `qwen3vl_merger`).
const MMPROJ_ARCH: &str = "qwen3vl-mmproj";

/// Writes a projector file: matrices in `--type` (F32, F16 or BF16; default F16, as the published
/// projectors), vectors in F32.
fn write_projector(shape_name: &str, ty: Option<&str>, seed: u64, out: &Path) -> CliResult {
    let shape = find_projector_shape(shape_name).ok_or_else(|| {
        let names: Vec<&str> = projector_shapes().iter().map(|s| s.name).collect();
        format!(
            "unknown shape {shape_name:?} for {MMPROJ_ARCH} (shapes: {})",
            names.join(", ")
        )
    })?;
    let ty = match ty {
        Some(t) => parse_type(t)?,
        None => GgmlType::F16,
    };
    write_qwen3vl_projector(&shape, ty, seed, out)?;
    eprintln!(
        "synth: {MMPROJ_ARCH} {} ({ty} matrices, seed {seed}) -> {}",
        shape.name,
        out.display()
    );
    Ok(())
}

fn gb(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

/// The plan in a few lines: size, types per class, fallbacks.
fn print_plan(s: &Synthesis) {
    let h = s.shape.hparams.as_dyn();
    eprintln!(
        "synth: {} {} — {} tensors, {} parameters ({} active, {}), vocabulary {}, {} of tensor data",
        h.arch_name(),
        s.shape.name,
        s.tensors.len(),
        s.total_params,
        s.active_params,
        s.size_label,
        s.vocab.len(),
        gb(s.tensor_bytes())
    );
    let mut by_class: BTreeMap<TensorClass, BTreeMap<GgmlType, (usize, u64)>> = BTreeMap::new();
    for t in &s.tensors {
        let e = by_class
            .entry(t.desc.class)
            .or_default()
            .entry(t.ty)
            .or_default();
        e.0 += 1;
        e.1 += t.ty.bytes_for(t.desc.n_elements()).unwrap_or(0);
    }
    for (class, types) in &by_class {
        let list: Vec<String> = types
            .iter()
            .map(|(ty, (n, b))| format!("{ty} ×{n} ({})", gb(*b)))
            .collect();
        eprintln!("  {:<10} {}", class.name(), list.join(", "));
    }
    // Fallbacks, grouped by tensor role (the same row width in every block).
    let mut fallbacks: BTreeMap<(String, GgmlType, GgmlType, u64), usize> = BTreeMap::new();
    for t in s.fallbacks() {
        let pattern = t.desc.role.pattern().replace("{}", "*");
        let from = t.fell_back_from.unwrap_or(t.ty);
        *fallbacks
            .entry((pattern, from, t.ty, t.desc.dims[0]))
            .or_default() += 1;
    }
    for ((pattern, from, to, ne0), n) in fallbacks {
        eprintln!(
            "  fallback: {pattern} ×{n}: {from} → {to} (rows of {ne0} are not whole {}-value blocks; llama.cpp's quantizer does the same)",
            from.block_elems()
        );
    }
}

fn print_routing(s: &Synthesis, skew: f32) {
    if s.routing.is_empty() {
        return;
    }
    let n = s.routing.len() as f64;
    let mean = s.routing.iter().map(|r| r.stats.top10_share).sum::<f64>() / n;
    let (min, max) = s.routing.iter().fold((f64::MAX, 0f64), |(lo, hi), r| {
        (lo.min(r.stats.top10_share), hi.max(r.stats.top10_share))
    });
    let reached = s.routing.iter().filter(|r| r.stats.all_reached).count();
    let samples: u64 = s.routing.first().map_or(0, |r| r.stats.counts.iter().sum());
    eprintln!(
        "  routing (estimate on random unit-RMS hidden states, not a forward pass; skew {skew}): top 10% of experts take {:.1}% of routings (blocks {:.1}–{:.1}%); every expert reached in {reached} of {} blocks ({samples} routings per block)",
        mean * 100.0,
        min * 100.0,
        max * 100.0,
        s.routing.len()
    );
    for r in s.routing.iter().filter(|r| !r.stats.all_reached) {
        let unused = r.stats.counts.iter().filter(|&&c| c == 0).count();
        eprintln!(
            "  routing: block {}: {unused} experts never chosen",
            r.layer
        );
    }
}

pub fn run(args: SynthArgs) -> CliResult {
    if args.list_shapes {
        list_shapes();
        return Ok(());
    }
    let (Some(arch), Some(shape_name), Some(out)) = (args.arch, args.shape, args.out) else {
        return Err("--arch, --shape and --out are required".into());
    };
    if arch.eq_ignore_ascii_case(MMPROJ_ARCH) {
        return write_projector(&shape_name, args.default_type.as_deref(), args.seed, &out);
    }
    if arch.eq_ignore_ascii_case(GEMMA4V_MMPROJ_ARCH) {
        return write_gemma4v(&shape_name, args.default_type.as_deref(), args.seed, &out);
    }
    let known = || ARCH_NAMES.iter().chain(NOT_RUN_ARCH_NAMES);
    if !known().any(|a| a.eq_ignore_ascii_case(&arch)) {
        let names: Vec<&str> = known().copied().collect();
        return Err(format!(
            "unknown architecture {arch:?} (known: {})",
            names.join(", ")
        )
        .into());
    }
    let shape = find_shape(&arch, &shape_name).ok_or_else(|| {
        let names: Vec<&str> = all_shapes()
            .into_iter()
            .filter(|s| s.arch.eq_ignore_ascii_case(&arch))
            .map(|s| s.name)
            .collect();
        if names.is_empty() {
            // clover_moe: its files are qwen35moe's in another form (engine/tests/forward_qwen35moe.rs).
            return format!("synth writes no {arch} shapes");
        }
        format!(
            "unknown shape {shape_name:?} for {arch} (shapes: {})",
            names.join(", ")
        )
    })?;
    let default = match &args.default_type {
        Some(t) => parse_type(t)?,
        None => shape.default_type,
    };
    let overrides = match &args.types {
        Some(s) => parse_types(s)?,
        None => Vec::new(),
    };
    let skew = args.route_skew.unwrap_or(0.0);
    let opts = SynthOptions {
        shape,
        types: TypeChoice { default, overrides },
        seed: args.seed,
        route_skew: skew,
    };
    let t0 = Instant::now();
    let calibrate = args.calibrate_routers.unwrap_or(args.route_skew.is_some());
    let mut s = Synthesis::prepare(&opts)?;
    let calibrate = calibrate && !s.routing.is_empty();
    let gain = match (args.mixing_gain, calibrate) {
        (Some(g), _) if g.is_finite() && g >= 0.0 => g,
        (Some(g), _) => {
            return Err(SynthError(format!("--mixing-gain {g}: a finite gain of 0 or more")).into())
        }
        (None, true) => CALIBRATED_MIXING_GAIN,
        (None, false) => 1.0,
    };
    if gain != 1.0 {
        s = s.with_mixing_gain(gain);
    }
    if let Some(rate) = args.draft_agreement {
        s = s.with_draft_agreement(rate)?;
    }
    print_plan(&s);
    print_routing(&s, skew);
    print_agreement_plan(&s);
    eprintln!("  planned in {:.2} s", t0.elapsed().as_secs_f64());
    if args.dry_run {
        return Ok(());
    }

    // Progress on a terminal only; logs get the final line.
    let mut next_report = if std::io::stderr().is_terminal() {
        0.0
    } else {
        f64::INFINITY
    };
    let stats = s.write(&out, |done, total| {
        let frac = done as f64 / total.max(1) as f64;
        if frac >= next_report {
            eprint!("\r  writing {:>3.0}%", frac * 100.0);
            let _ = std::io::stderr().flush();
            next_report = frac + 0.02;
        }
    })?;
    eprintln!(
        "\r  wrote {} ({}) in {:.2} s: {:.0} MB/s",
        out.display(),
        gb(stats.file_bytes),
        stats.seconds,
        stats.mb_per_s()
    );
    if s.agreement.is_some() && args.agreement_steps > 0 && !calibrate {
        print_measured_agreement(&s, &out, args.agreement_steps)?;
    }
    if s.routing.is_empty() {
        return Ok(());
    }
    if calibrate {
        let t = Instant::now();
        match calibrate::calibrate_file(&out, &s.router_parts(), args.calibration_tokens, s.seed) {
            Ok(n) => eprintln!(
                "  calibrated {n} routers on the model's own hidden states ({} random tokens, one forward call; attention and delta-net outputs written at gain {gain}) in {:.2} s",
                args.calibration_tokens,
                t.elapsed().as_secs_f64()
            ),
            Err(e) => {
                // A file whose routers are half rewritten is not the model asked for.
                let _ = std::fs::remove_file(&out);
                return Err(e.into());
            }
        }
    }
    if args.measure_routing.unwrap_or(calibrate) {
        print_measured_routing(&s, &out, args.measure_tokens, skew, calibrate)?;
    }
    // After the calibration, which rewrites the routers the measurement runs through.
    if s.agreement.is_some() && args.agreement_steps > 0 && calibrate {
        print_measured_agreement(&s, &out, args.agreement_steps)?;
    }
    Ok(())
}

/// What `--draft-agreement` changes in the plan.
fn print_agreement_plan(s: &Synthesis) {
    let Some(plan) = &s.agreement else { return };
    eprintln!(
        "  draft agreement asked {}: the draft block reads the embedding of {} of {} tokens; the next token follows the current one (one cycle through the ordinary tokens); blocks' outputs at gain {}",
        plan.rate,
        plan.n_known(),
        plan.next.len(),
        poly_models::synth::agree::BLOCK_GAIN
    );
    for (name, asked, written) in &plan.retyped {
        eprintln!("  {name}: {asked} → {written} (it holds exact values)");
    }
}

/// Reports the draft block's agreement with the trunk measured on the written file.
fn print_measured_agreement(s: &Synthesis, out: &Path, steps: usize) -> CliResult {
    let Some(plan) = &s.agreement else {
        return Ok(());
    };
    let t = Instant::now();
    let model = poly_engine::Model::load(out)?;
    let a = draft_agreement::measure(&model, s.seed, draft_agreement::DEFAULT_PROMPTS, steps)?;
    let followed = a
        .steps
        .iter()
        .filter(|st| plan.next.get(st.token as usize) == Some(&st.next))
        .count();
    eprintln!(
        "  draft agreement measured (asked {}): the draft block guessed the trunk's next greedy token at {} of {} steps = {:.3} ({} prompts of {} random tokens, {steps} greedy steps each, on the CPU); the trunk wrote the planned next token at {followed} of them; in {:.2} s",
        plan.rate,
        a.agreed(),
        a.steps.len(),
        a.rate(),
        draft_agreement::DEFAULT_PROMPTS,
        draft_agreement::PROMPT_TOKENS,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Reports the routing of a forward pass over `measure` fresh random tokens through the written file.
fn print_measured_routing(
    s: &Synthesis,
    out: &Path,
    measure: usize,
    skew: f32,
    calibrated: bool,
) -> CliResult {
    let t = Instant::now();
    let counts = calibrate::measure_routing(out, measure, s.seed)?;
    let layers: Vec<f64> = counts
        .iter()
        .filter(|l| !l.is_empty())
        .map(|l| top_tenth_share(std::slice::from_ref(l)))
        .collect();
    let (min, max) = layers
        .iter()
        .fold((f64::MAX, 0f64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let n_used = s.shape.hparams.as_dyn().n_expert_used() as usize;
    let routed: u64 = counts.iter().flatten().sum();
    eprintln!(
        "  routing measured in a forward pass ({}skew {skew}; {} fresh random tokens + {} answered one by one, {routed} routings): top 10% of experts take {:.1}% of routings (layers {:.1}–{:.1}%; perfectly even routing would read {:.1}% at this count) in {:.2} s",
        if calibrated {
            "quiet mixing and calibrated routers, "
        } else {
            "full mixing and routers as drawn, "
        },
        measure,
        calibrate::MEASURE_DECODE,
        top_tenth_share(&counts) * 100.0,
        min * 100.0,
        max * 100.0,
        calibrate::even_routing_share(&counts, n_used, s.seed) * 100.0,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
