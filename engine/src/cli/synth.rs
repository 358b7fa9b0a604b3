//! `poly-engine synth`: writes a synthetic model of a real layout (random weights in their target types)
//! and reports its plan, the routing estimate and the write speed.

use super::CliResult;
use clap::Args;
use poly_kernels::quant::GgmlType;
use poly_models::arch::{TensorClass, ARCH_NAMES};
use poly_models::synth::plan::TypeChoice;
use poly_models::synth::shapes::{all_shapes, find_shape};
use poly_models::synth::{check_class_type, SynthError, SynthOptions, Synthesis};
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args)]
pub struct SynthArgs {
    /// Architecture: qwen3moe, qwen35moe or gemma3.
    #[arg(long, required_unless_present = "list_shapes")]
    arch: Option<String>,
    /// Shape: tiny, small, or the real model's name (see --list-shapes; case-insensitive).
    #[arg(long, required_unless_present = "list_shapes")]
    shape: Option<String>,
    /// Type of every quantizable tensor (default: the shape's, Q8_0 for tiny, Q4_K otherwise).
    #[arg(long = "type", value_name = "TYPE")]
    default_type: Option<String>,
    /// Per-class types, e.g. expert=Q4_K,attn=Q8_0,embd=Q6_K (classes: embd, output, attn, ssm, ffn,
    /// expert, shexp, router, nextn; norm and ssm_param are always F32).
    #[arg(long, value_name = "CLASS=TYPE,...")]
    types: Option<String>,
    /// Seed of every random value (the file depends on nothing else).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Expert popularity skew: 0 = uniform; 1 ≈ real models (the top 10% of experts take ~25-35%).
    #[arg(long, default_value_t = 0.0)]
    route_skew: f32,
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
    if !ARCH_NAMES.iter().any(|a| a.eq_ignore_ascii_case(&arch)) {
        return Err(format!(
            "unknown architecture {arch:?} (known: {})",
            ARCH_NAMES.join(", ")
        )
        .into());
    }
    let shape = find_shape(&arch, &shape_name).ok_or_else(|| {
        let names: Vec<&str> = all_shapes()
            .into_iter()
            .filter(|s| s.arch.eq_ignore_ascii_case(&arch))
            .map(|s| s.name)
            .collect();
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
    let opts = SynthOptions {
        shape,
        types: TypeChoice { default, overrides },
        seed: args.seed,
        route_skew: args.route_skew,
    };
    let t0 = Instant::now();
    let s = Synthesis::prepare(&opts)?;
    print_plan(&s);
    print_routing(&s, args.route_skew);
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
    Ok(())
}
