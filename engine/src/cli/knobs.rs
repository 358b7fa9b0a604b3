//! The execution knobs' flags, shared by serving, `run` and `bench`: parsed once into
//! [`poly_engine::knobs::Knobs`] and installed before the model loads. Each replaces an environment
//! variable of earlier builds (named in its help; README.md's table of environment variables); the
//! defaults are today's behaviour.

use clap::{Args, ValueEnum};
use poly_engine::knobs::{
    BusAdmissionsAt as BusAdmissionsAtKnob, CopyAheadAt as CopyAheadAtKnob, CpuShareThreads,
    FinishLayersAt as FinishLayersAtKnob, ForwardOptions, GuessOn as GuessOnKnob, Handoff,
    HostPoints, Knobs,
};
use poly_engine::state::KvPrecision;
use poly_kernels::options::{
    CpuKernelOptions, GpuKernelOptions, KernelOptions, L2Prefetch, LaunchOverlap,
};

/// A knob that is on or off (`1` and `0` are taken too, as the variables took them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Switch {
    #[value(alias = "1")]
    On,
    #[value(alias = "0")]
    Off,
}

impl Switch {
    fn on(self) -> bool {
        self == Switch::On
    }
}

/// Which one-token attention kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AttnDecode {
    /// The flash-decoding kernel.
    Flash,
    /// The prompts' split-K kernel.
    Old,
}

/// Where the decode attention's key and value are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum KvStore {
    /// By the flash-decoding kernel itself.
    Fused,
    /// By `kv_store_f16_pos` first.
    Separate,
}

/// How the attention caches keep keys and values (`--kv`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum KvType {
    /// f16 values (llama.cpp's default cache type).
    F16,
    /// ggml Q8_0 blocks, 34 bytes for 32 values (llama.cpp's `-ctk q8_0 -ctv q8_0`; CPU only for now).
    #[value(name = "q8_0")]
    Q8_0,
}

/// Which expert tile sizes the grouped expert products choose.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExpertTiles {
    New,
    Old,
}

/// Who computes a partly resident token's CPU share.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CpuShare {
    /// The spinning pool, all experts' products in one region each.
    Hot,
    /// Rayon's pool, the same regions.
    Rayon,
    /// Rayon's pool, a region per expert.
    PerExpert,
}

/// Where a call's tokens are grouped by expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MoeGroup {
    Card,
    Host,
}

/// How a partly resident token hands over between the card and the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum GpuHandoff {
    Kernel,
    Copy,
}

/// How a partly resident token's graph meets the host at its MoE layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum GpuHostPoints {
    Flags,
    Cuts,
}

/// Who guesses the next MoE layer's experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum GuessOn {
    Card,
    Host,
}

/// When a one-graph token's admissions over the bus are queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BusAdmissionsAt {
    Finish,
    Ahead,
}

/// When a one-graph token finishes a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FinishLayersAt {
    Route,
    Sum,
}

/// When a layer's copies ahead are queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CopyAheadAt {
    Route,
    Sum,
}

/// Which kernel launches overlap the one before them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum GpuPdl {
    Off,
    Decode,
    All,
}

/// What one-token launches ask the card's L2 cache for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum GpuPrefetch {
    Off,
    Own,
    Ahead,
}

fn one_two_four(s: &str) -> Result<u32, String> {
    match s.trim() {
        "1" => Ok(1),
        "2" => Ok(2),
        "4" => Ok(4),
        v => Err(format!("{v:?}: give 1, 2 or 4")),
    }
}

fn positive(s: &str) -> Result<usize, String> {
    match s.trim().parse() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{s:?}: give a whole number above 0")),
    }
}

fn fuse_setting(s: &str) -> Result<String, String> {
    poly_engine::gpu::forward::check_fuse_setting(s)?;
    Ok(s.to_string())
}

/// Execution knobs: variants that compute the same values, for measurements (the defaults are the
/// measured best). Non-default ones are echoed in READY.
#[derive(Args, Clone, Debug)]
#[command(next_help_heading = "Execution knobs (for measurements; were POLY_* variables)")]
pub struct KnobArgs {
    /// GPU fusions: `off` (the primitive launches), `all` (the default-off ones too), or a
    /// comma-separated list of `no-NAME` (was POLY_FUSE).
    #[arg(long, value_name = "SETTING", value_parser = fuse_setting)]
    fuse: Option<String>,
    /// One-token attention kernel (was POLY_ATTN_DECODE).
    #[arg(long, value_enum, default_value_t = AttnDecode::Flash)]
    attn_decode: AttnDecode,
    /// Who stores a decoded token's key and value (was POLY_ATTN_KV_STORE).
    #[arg(long, value_enum, default_value_t = KvStore::Fused)]
    attn_kv_store: KvStore,
    /// Blocks the flash-decoding kernel aims at (default: the built-in target; was POLY_ATTN_BLOCKS).
    #[arg(long, value_name = "N", value_parser = positive)]
    attn_blocks: Option<usize>,
    /// Query heads of a GQA group per block of the flash-decoding kernel (1, 2 or 4, taken down to one
    /// that divides the group; the group's size or more: the whole group in one block, the default
    /// before 2026-12-07). The same bits either way. 2 measured fastest on an H100 (qwen3moe shape +10%
    /// against the whole group of 8, qwen35moe +1%; 1 as fast, 4 a little slower).
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = positive)]
    attn_heads_per_block: usize,
    /// One-token calls as CUDA graphs (was POLY_GPU_GRAPHS).
    #[arg(long, value_enum, default_value_t = Switch::On)]
    gpu_graphs: Switch,
    /// Tokens whose MoE layers need the host as segmented graphs (off: without graphs; was
    /// POLY_GPU_SEGMENTS).
    #[arg(long, value_enum, default_value_t = Switch::On)]
    gpu_segments: Switch,
    /// The threads of a partly resident token's CPU share (was POLY_CPU_SHARE).
    #[arg(long, value_enum, default_value_t = CpuShare::Hot)]
    cpu_share: CpuShare,
    /// How a partly resident token's MoE layers hand over between the card and the host: kernels
    /// reading and writing page-locked host memory, or copy-engine transfers.
    #[arg(long, value_enum, default_value_t = GpuHandoff::Kernel)]
    gpu_handoff: GpuHandoff,
    /// How a partly resident token's graph meets the host at its MoE layers: one graph a token whose
    /// host points are page-locked flags (the card signals one and waits on another), or a graph per
    /// stretch between points, with a synchronize and a launch at each.
    #[arg(long, value_enum, default_value_t = GpuHostPoints::Flags)]
    gpu_host_points: GpuHostPoints,
    /// At a partly resident token's host points (one graph a token), the next MoE layer's experts
    /// guessed from this layer's input and not on the card read into the host's caches while the card
    /// computes (measured slower on an H100 host: 52 against 82 tokens/s; kept for the guess's
    /// accuracy, which the profile prints).
    #[arg(long, value_enum, default_value_t = Switch::Off)]
    cpu_warm: Switch,
    /// At a partly resident token's host points (one graph a token, or its cuts), up to N of the next
    /// MoE layer's experts guessed from this layer's input (the next router applied to it) and not on
    /// the card copied to it over the bus while the card computes the layer between, when host memory
    /// is otherwise idle; those the layer then routes to are computed on the card. 0 turns it off.
    /// Measured on H100 hosts at 8 GB: 1 gave +2% to +9% over 0 on four files; with copies on demand
    /// beside them 2 was 4-11% slower than 1, and with the CPU computing every other missing expert
    /// (`--missing-experts cpu`, the default) 2 was as fast or faster on all four (2026-12-06). The
    /// count a layer copies is also bounded by --copy-ahead-us.
    #[arg(long, value_name = "N", default_value_t = poly_engine::knobs::DEFAULT_COPY_AHEAD)]
    copy_ahead: usize,
    /// The bus time a layer's copies ahead may take, in microseconds at the copy rate the cache measured
    /// when it was filled: a layer copies at most this budget's worth of experts (at least one), up to
    /// --copy-ahead. 0: --copy-ahead's count whatever it takes. Measured on an H100 host at 8 GB with
    /// the copies at the route point: 2 ahead was best for qwen3moe's experts (116 us of bus) and 3 for
    /// qwen35moe's (125 us); one more was slower on both (174 and 166 us, as long as a whole layer).
    #[arg(long, value_name = "US", default_value_t = poly_engine::knobs::DEFAULT_COPY_AHEAD_US)]
    copy_ahead_us: u32,
    /// Who guesses the next MoE layer's experts for --copy-ahead and --cpu-warm: the card (one more
    /// router launch in the token's graph, its ids handed down with the layer's own at the route point)
    /// or the CPU share's threads once the layer's share is done (they read the f32 router from host
    /// memory, 31-38 us a layer measured on an H100 host, before the copies can start). Measured at 8
    /// GB: the same speed and the same guesses (98% of q3u's copies ahead routed either way).
    #[arg(long, value_enum, default_value_t = GuessOn::Card)]
    guess_on: GuessOn,
    /// When a layer's copies ahead are queued: at its route point right after its copies on demand
    /// (the bus then works beside the CPU's share; needs the card's guess, with --guess-on host they
    /// wait for the share), or once its CPU share is done (while the card computes the layer between).
    /// Measured on H100 hosts at 8 GB: with copies on demand beside them (2026-12-06, fourth session)
    /// route was no faster than sum on four files; with the CPU computing every other missing expert
    /// (the default) route gave q3u +10% (123 against 112 t/s) and let q35s copy 3 ahead (+4.5%), where
    /// 3 after the share had gained nothing (eighth session).
    #[arg(long, value_enum, default_value_t = CopyAheadAt::Route)]
    copy_ahead_at: CopyAheadAt,
    /// When a partly resident token (one graph) queues the admissions a layer earned over the bus:
    /// planned when the layer is finished and queued after the next layer's staged flag and copies
    /// ahead (ahead: the bus carries them while the card computes), or queued at once (finish: the copy
    /// stream then runs them before the next layer's copies, which its card experts wait for). Measured
    /// on an H100 host at 8 GB: ahead +6% on q3u and on q35s.
    #[arg(long, value_enum, default_value_t = BusAdmissionsAt::Ahead)]
    bus_admissions_at: BusAdmissionsAt,
    /// When a partly resident token (one graph) finishes a layer, planning its admissions: once the
    /// layer's sum and copies ahead are queued, while the host waits for the next router anyway (sum),
    /// or at the next layer's route point, between the router and that layer's choices (route: the
    /// former place, on the token's critical path).
    #[arg(long, value_enum, default_value_t = FinishLayersAt::Sum)]
    finish_layers_at: FinishLayersAt,
    /// One token's gate and up experts in one fused launch (was POLY_MOE_GLU).
    #[arg(long, value_enum, default_value_t = Switch::On)]
    moe_glu: Switch,
    /// Where a call's tokens are grouped by expert (was POLY_MOE_GROUP).
    #[arg(long, value_enum, default_value_t = MoeGroup::Card)]
    moe_group: MoeGroup,
    /// Tensor-core prompt attention (off: CUDA cores; was POLY_FA).
    #[arg(long, value_enum, default_value_t = Switch::On)]
    fa: Switch,
    /// Tensor-core prompt matrix products (off: dp4a; was POLY_MMQ).
    #[arg(long, value_enum, default_value_t = Switch::On)]
    mmq: Switch,
    /// Gate and up of the grouped experts in one launch (was POLY_MMQ_PAIR).
    #[arg(long, value_enum, default_value_t = Switch::On)]
    mmq_pair: Switch,
    /// Force this expert tile: 8 (dp4a), 16, 32, 64 or 128 (was POLY_MMQ_EXPERT_TILE).
    #[arg(long, value_name = "N", value_parser = ["8", "16", "32", "64", "128"])]
    mmq_expert_tile: Option<String>,
    /// The expert tile sizes chosen before short tiles skipped empty tokens (was
    /// POLY_MMQ_EXPERT_TILES).
    #[arg(long, value_enum, default_value_t = ExpertTiles::New)]
    mmq_expert_tiles: ExpertTiles,
    /// At most this many rows per warp group of the one-token matvec: 1, 2 or 4 (was POLY_MATVEC_RPG).
    #[arg(long, value_name = "N", default_value = "1", value_parser = one_two_four)]
    matvec_rpg: u32,
    /// At most this many warps per row of the one-token quantized matvec: 1, 2 or 4 (was
    /// POLY_MATVEC_WARPS_PER_ROW; 4 before 2026-12-07).
    #[arg(long, value_name = "N", default_value = "1", value_parser = one_two_four)]
    matvec_warps_per_row: u32,
    /// Which kernel launches are programmatic dependent launches on sm_90+ (each one's launch overlaps
    /// the kernel before it): those of one-token calls, all, or none.
    #[arg(long, value_enum, default_value_t = GpuPdl::Decode)]
    gpu_pdl: GpuPdl,
    /// What one-token launches ask the card's L2 cache for (sm_90+): `own` (matvecs their weights
    /// before they wait for the kernel before them, expert launches their slots' experts), `ahead`
    /// (besides, gate and up the down experts after them), or `off` (the default until a card has
    /// measured the others).
    #[arg(long, value_enum, default_value_t = GpuPrefetch::Off)]
    gpu_prefetch: GpuPrefetch,
    /// Any SIMD CPU kernel (off: the portable code; was POLY_NO_SIMD).
    #[arg(long, value_enum, default_value_t = Switch::On)]
    cpu_simd: Switch,
    /// The AVX-512 VNNI CPU kernels where the CPU has them (off: AVX2; was POLY_CPU_AVX512).
    #[arg(long, value_enum, default_value_t = Switch::On)]
    cpu_avx512: Switch,
    /// Q4_K's four-row CPU kernel (was POLY_CPU_ROWS4).
    #[arg(long, value_enum, default_value_t = Switch::On)]
    cpu_rows4: Switch,
    /// The K-quant tile CPU kernels (off: row by row; was POLY_CPU_KTILE).
    #[arg(long, value_enum, default_value_t = Switch::On)]
    cpu_ktile: Switch,
    /// How the attention caches keep keys and values: f16, or Q8_0 blocks (a little over half the memory,
    /// answers a little further from exact; the CPU only for now). Not an exact variant: it changes the
    /// values, as llama.cpp's `-ctk q8_0 -ctv q8_0` does.
    #[arg(long, value_enum, default_value_t = KvType::F16)]
    kv: KvType,
}

impl KnobArgs {
    /// The knobs these flags ask for.
    pub fn knobs(&self) -> Knobs {
        Knobs {
            kv: match self.kv {
                KvType::F16 => KvPrecision::F16,
                KvType::Q8_0 => KvPrecision::Q8_0,
            },
            kernels: KernelOptions {
                gpu: GpuKernelOptions {
                    flash_attention: self.fa.on(),
                    mmq: self.mmq.on(),
                    mmq_pair: self.mmq_pair.on(),
                    // The parser took only numbers.
                    mmq_expert_tile: self.mmq_expert_tile.as_deref().and_then(|t| t.parse().ok()),
                    mmq_old_expert_tiles: self.mmq_expert_tiles == ExpertTiles::Old,
                    moe_group_host: self.moe_group == MoeGroup::Host,
                    matvec_warps_per_row: self.matvec_warps_per_row,
                    matvec_rows_per_group: self.matvec_rpg as usize,
                    launch_overlap: match self.gpu_pdl {
                        GpuPdl::Off => LaunchOverlap::Off,
                        GpuPdl::Decode => LaunchOverlap::Decode,
                        GpuPdl::All => LaunchOverlap::All,
                    },
                    l2_prefetch: match self.gpu_prefetch {
                        GpuPrefetch::Off => L2Prefetch::Off,
                        GpuPrefetch::Own => L2Prefetch::Own,
                        GpuPrefetch::Ahead => L2Prefetch::Ahead,
                    },
                },
                cpu: CpuKernelOptions {
                    simd: self.cpu_simd.on(),
                    avx512: self.cpu_avx512.on(),
                    rows4: self.cpu_rows4.on(),
                    ktile: self.cpu_ktile.on(),
                },
            },
            forward: ForwardOptions {
                fuse: self.fuse.clone(),
                attn_decode_flash: self.attn_decode == AttnDecode::Flash,
                moe_glu_fused: self.moe_glu.on(),
                attn_kv_store_fused: self.attn_kv_store == KvStore::Fused,
                attn_blocks: self.attn_blocks,
                attn_heads_per_block: self.attn_heads_per_block,
                gpu_graphs: self.gpu_graphs.on(),
                gpu_segments: self.gpu_segments.on(),
                cpu_share: match self.cpu_share {
                    CpuShare::Hot => CpuShareThreads::Hot,
                    CpuShare::Rayon => CpuShareThreads::Rayon,
                    CpuShare::PerExpert => CpuShareThreads::PerExpert,
                },
                handoff: match self.gpu_handoff {
                    GpuHandoff::Kernel => Handoff::Kernel,
                    GpuHandoff::Copy => Handoff::Copy,
                },
                cpu_warm: self.cpu_warm.on(),
                copy_ahead: self.copy_ahead,
                copy_ahead_us: self.copy_ahead_us,
                guess_on: match self.guess_on {
                    GuessOn::Card => GuessOnKnob::Card,
                    GuessOn::Host => GuessOnKnob::Host,
                },
                copy_ahead_at: match self.copy_ahead_at {
                    CopyAheadAt::Route => CopyAheadAtKnob::Route,
                    CopyAheadAt::Sum => CopyAheadAtKnob::Sum,
                },
                bus_admissions_at: match self.bus_admissions_at {
                    BusAdmissionsAt::Finish => BusAdmissionsAtKnob::Finish,
                    BusAdmissionsAt::Ahead => BusAdmissionsAtKnob::Ahead,
                },
                finish_layers_at: match self.finish_layers_at {
                    FinishLayersAt::Route => FinishLayersAtKnob::Route,
                    FinishLayersAt::Sum => FinishLayersAtKnob::Sum,
                },
                host_points: match self.gpu_host_points {
                    GpuHostPoints::Flags => HostPoints::Flags,
                    GpuHostPoints::Cuts => HostPoints::Cuts,
                },
            },
        }
    }

    /// The attention caches' precision (`--kv`), which the caller passes to the model.
    pub fn kv(&self) -> KvPrecision {
        self.knobs().kv
    }

    /// Installs the knobs for this process (before any model loads) and says the non-default ones on
    /// stderr.
    pub fn install(&self) -> Result<(), String> {
        let knobs = self.knobs();
        poly_engine::knobs::set(&knobs)?;
        let changed = knobs.non_default();
        if !changed.is_empty() {
            let list: Vec<String> = changed.iter().map(|(k, v)| format!("--{k} {v}")).collect();
            eprintln!("poly-engine: knobs {}", list.join(" "));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        k: KnobArgs,
    }

    #[test]
    fn no_flags_are_the_defaults_and_flags_set_their_knob() {
        let k = T::try_parse_from(["t"]).expect("parse").k.knobs();
        assert_eq!(k, Knobs::default());
        let k = T::try_parse_from([
            "t",
            "--mmq",
            "off",
            "--cpu-rows4",
            "0",
            "--matvec-rpg",
            "4",
            "--fuse",
            "no-many,no-glu",
            "--attn-decode",
            "old",
            "--mmq-expert-tile",
            "64",
        ])
        .expect("parse")
        .k
        .knobs();
        assert!(!k.kernels.gpu.mmq && !k.kernels.cpu.rows4);
        assert_eq!(k.kernels.gpu.matvec_rows_per_group, 4);
        assert_eq!(k.kernels.gpu.mmq_expert_tile, Some(64));
        assert_eq!(k.forward.fuse.as_deref(), Some("no-many,no-glu"));
        assert!(!k.forward.attn_decode_flash);
        assert_eq!(k.kv, KvPrecision::F16);
        let k = T::try_parse_from(["t", "--kv", "q8_0"])
            .expect("parse")
            .k
            .knobs();
        assert_eq!(k.kv, KvPrecision::Q8_0);
        assert_eq!(k.non_default().get("kv").map(String::as_str), Some("q8_0"));
        assert!(T::try_parse_from(["t", "--kv", "q4_0"]).is_err());
        assert!(T::try_parse_from(["t", "--fuse", "no-manny"]).is_err());
        assert!(T::try_parse_from(["t", "--matvec-rpg", "3"]).is_err());
    }

    #[test]
    fn the_whole_command_line_is_consistent() {
        // Flattened into serving, `run` and `bench`: no flag may clash with theirs.
        use clap::CommandFactory;
        super::super::Cli::command().debug_assert();
    }
}
