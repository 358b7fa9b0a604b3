//! The engine's execution knobs: switches between variants that compute the same values (a fused kernel
//! or its primitive launches, one decode attention kernel or another, launch shapes), for measurements on
//! new cards and CPUs; the defaults are the measured best.
//!
//! `poly-engine`'s flags (`cli::knobs`) parse them once, at start, into [`Knobs`]; [`set`] installs them
//! before a model is loaded: the kernel-level ones in [`poly_kernels::options`], the forward pass's here.
//! A global rather than a value passed down, because the readers sit deep in the GPU forward pass; but
//! never read from the environment, and echoed in READY (`knobs`: those that differ from the defaults).
//! README.md's table of environment variables lists what remains there (diagnosis only).

use crate::state::KvPrecision;
use poly_kernels::options::KernelOptions;
use std::collections::BTreeMap;
use std::sync::OnceLock;

/// The GPU forward pass's knobs (engine-level; the kernels' are in [`KernelOptions`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForwardOptions {
    /// Which fusions run as fused kernels (`--fuse`): `None` the default set; else the setting, `off`,
    /// `all`, or a comma-separated list of `no-NAME` (see `gpu::forward::fused`).
    pub fuse: Option<String>,
    /// One token's attention on the flash-decoding kernel (off: the prompts' split-K kernel).
    pub attn_decode_flash: bool,
    /// One token's gate and up experts as one fused launch (off: two launches and the SwiGLU).
    pub moe_glu_fused: bool,
    /// The flash-decoding kernel also stores the token's key and value (off: `kv_store_f16_pos` first).
    pub attn_kv_store_fused: bool,
    /// The blocks the flash-decoding kernel aims at, instead of the built-in target.
    pub attn_blocks: Option<usize>,
    /// Query heads per block of the flash-decoding kernel (at most; the group's size or more: the whole
    /// GQA group in one block).
    pub attn_heads_per_block: usize,
    /// One-token calls captured into CUDA graphs and replayed (off: every launch queued per token).
    pub gpu_graphs: bool,
    /// Tokens whose MoE layers need the host (a partly resident expert cache) as segmented graphs (off:
    /// such tokens run without graphs).
    pub gpu_segments: bool,
    /// Who computes a partly resident token's CPU share.
    pub cpu_share: CpuShareThreads,
    /// How a segmented token's MoE layers hand over between the card and the host (`--gpu-handoff`).
    pub handoff: Handoff,
    /// How a segmented token's graph meets the host at its MoE layers (`--gpu-host-points`).
    pub host_points: HostPoints,
    /// At a one-graph token's host points, the next MoE layer's guessed missing experts read into the
    /// host's caches while the card works (`--cpu-warm`).
    pub cpu_warm: bool,
    /// At a partly resident token's host points, up to this many of the next MoE layer's guessed missing
    /// experts copied to the card while it computes the layer between (`--copy-ahead`; 0: none).
    pub copy_ahead: usize,
    /// The bus time a layer's copies ahead may take at the cache's measured copy rate, in µs
    /// (`--copy-ahead-us`; 0: `copy_ahead` copies whatever they take).
    pub copy_ahead_us: u32,
    /// Who guesses the next MoE layer's experts for `--copy-ahead` and `--cpu-warm` (`--guess-on`).
    pub guess_on: GuessOn,
    /// When a one-graph token's admissions over the bus are queued (`--bus-admissions-at`).
    pub bus_admissions_at: BusAdmissionsAt,
    /// When a layer's copies ahead are queued (`--copy-ahead-at`).
    pub copy_ahead_at: CopyAheadAt,
    /// When a one-graph token finishes a layer (its admissions planned) (`--finish-layers-at`).
    pub finish_layers_at: FinishLayersAt,
}

/// Who guesses the next MoE layer's experts (its router applied to this layer's input) (`--guess-on`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuessOn {
    /// The card: one more router launch in the token's graph before the route point, its ids handed
    /// down with the layer's own, so the guess is there when the host meets the layer.
    Card,
    /// The CPU share's threads, once the layer's share is done (reading the f32 router from host memory).
    Host,
}

/// When a layer's copies ahead (the next layer's guessed experts) are queued (`--copy-ahead-at`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyAheadAt {
    /// At the layer's route point, right after its copies on demand (beside the CPU's share).
    Route,
    /// Once the layer's CPU share is done and its sum written (while the card computes the layer between).
    Sum,
}

/// When a one-graph token queues the admissions a layer earned over the bus (`--bus-admissions-at`). The
/// copy stream runs its copies in order, and the next layer's card experts wait on a flag it sets after
/// that layer's copies on demand or ahead: admissions queued before those delay them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BusAdmissionsAt {
    /// When the layer is finished, at the next layer's route point: before that layer's copies.
    Finish,
    /// Planned there (victims leave the cache before the next layer's choices), queued after the next
    /// layer's staged flag and its copies ahead, while the card computes. Measured on an H100 host at
    /// 8 GB (2026-12-06, two alternating rounds): +6% on q3u and +6% on q35s over `finish`.
    Ahead,
}

/// When a one-graph token finishes a layer: plans the admissions it earned, choosing their victims
/// (`--finish-layers-at`). Either way before the next layer's choices, so they see the same cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishLayersAt {
    /// At the next layer's route point, after the card signalled it: the host's planning (a scan of the
    /// cache's slots per victim, the on-card copies' driver calls) sits between the router and the
    /// next layer's choices, on the token's critical path.
    Route,
    /// Right after the layer's own sum, copies ahead and held admissions are queued, while the host waits
    /// for the next router anyway. The card may still compute the layer's experts then: victims are
    /// never experts the layer routed to (the policy spares them), so no slot the card reads is
    /// overwritten.
    Sum,
}

/// How a segmented token's graph meets the host at its MoE layers (`--gpu-host-points`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostPoints {
    /// One graph a token, queued whole: the card signals a point through a page-locked flag the host
    /// spins on, and waits on a flag the host sets.
    Flags,
    /// One graph per stretch between points: the host synchronizes at each and launches the next.
    Cuts,
}

/// How a segmented token hands over between the card and the host at each MoE layer (`--gpu-handoff`):
/// the router's ids and weights and the layer's input down, the token's expert addresses and the CPU's
/// sum up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handoff {
    /// Kernels that read and write the host's page-locked memory (one launch a hand-over).
    Kernel,
    /// Copy-engine transfers (five a layer).
    Copy,
}

/// The threads of a partly resident token's CPU share (`--cpu-share`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuShareThreads {
    /// A pool that spins between MoE layers, the products of all experts in one parallel region each.
    Hot,
    /// Rayon's pool, the same regions (to compare).
    Rayon,
    /// Rayon's pool, a parallel region per expert (the former path, to compare).
    PerExpert,
}

/// `--copy-ahead`'s default: the most a layer copies ahead, the count itself set by
/// [`DEFAULT_COPY_AHEAD_US`].
pub const DEFAULT_COPY_AHEAD: usize = 4;

/// `--copy-ahead-us`'s default. Measured on an H100 host at 8 GB with the copies queued at the route
/// point (2026-12-06, eighth session): the best count was 2 for qwen3moe's experts of 2.6 MB (116 µs of
/// bus a layer at the 58 µs an expert measured) and 3 for qwen35moe's of 1.7 MB (125 µs at 41.5), and
/// one more copy was slower on both (174 and 166 µs, about a whole layer's time of 160–170 µs: the last
/// copies land after the card wants them). The budget sits between.
pub const DEFAULT_COPY_AHEAD_US: u32 = 140;

impl Default for ForwardOptions {
    fn default() -> Self {
        ForwardOptions {
            fuse: None,
            attn_decode_flash: true,
            moe_glu_fused: true,
            attn_kv_store_fused: true,
            attn_blocks: None,
            attn_heads_per_block: 2,
            gpu_graphs: true,
            gpu_segments: true,
            cpu_share: CpuShareThreads::Hot,
            handoff: Handoff::Kernel,
            host_points: HostPoints::Flags,
            cpu_warm: false,
            copy_ahead: DEFAULT_COPY_AHEAD,
            copy_ahead_us: DEFAULT_COPY_AHEAD_US,
            guess_on: GuessOn::Card,
            copy_ahead_at: CopyAheadAt::Route,
            bus_admissions_at: BusAdmissionsAt::Ahead,
            finish_layers_at: FinishLayersAt::Sum,
        }
    }
}

/// Every execution knob of a `poly-engine` process.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Knobs {
    pub kernels: KernelOptions,
    pub forward: ForwardOptions,
    /// The attention caches' precision (`--kv`): unlike the others it changes the values (Q8_0 caches
    /// answer a little further from exact, as llama.cpp's do). Not a global: the caller passes it to the
    /// model ([`crate::Model::set_kv`]), whose states keep it; [`set`] leaves it out.
    pub kv: KvPrecision,
}

impl Knobs {
    /// The knobs that differ from the defaults, by flag name (without `--`): what READY echoes.
    pub fn non_default(&self) -> BTreeMap<String, String> {
        let mut out: BTreeMap<String, String> = self
            .kernels
            .non_default()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let (f, d) = (&self.forward, ForwardOptions::default());
        let mut put = |k: &str, v: String| out.insert(k.to_string(), v);
        if let Some(s) = &f.fuse {
            put("fuse", s.clone());
        }
        if f.attn_decode_flash != d.attn_decode_flash {
            put("attn-decode", "old".into());
        }
        if f.moe_glu_fused != d.moe_glu_fused {
            put("moe-glu", "off".into());
        }
        if f.attn_kv_store_fused != d.attn_kv_store_fused {
            put("attn-kv-store", "separate".into());
        }
        if let Some(b) = f.attn_blocks {
            put("attn-blocks", b.to_string());
        }
        if f.attn_heads_per_block != d.attn_heads_per_block {
            put("attn-heads-per-block", f.attn_heads_per_block.to_string());
        }
        if f.gpu_graphs != d.gpu_graphs {
            put("gpu-graphs", "off".into());
        }
        if f.gpu_segments != d.gpu_segments {
            put("gpu-segments", "off".into());
        }
        match f.cpu_share {
            CpuShareThreads::Hot => {}
            CpuShareThreads::Rayon => _ = put("cpu-share", "rayon".into()),
            CpuShareThreads::PerExpert => _ = put("cpu-share", "per-expert".into()),
        }
        if f.handoff == Handoff::Copy {
            put("gpu-handoff", "copy".into());
        }
        if f.host_points == HostPoints::Cuts {
            put("gpu-host-points", "cuts".into());
        }
        if f.cpu_warm != d.cpu_warm {
            put("cpu-warm", if f.cpu_warm { "on" } else { "off" }.into());
        }
        if f.copy_ahead != d.copy_ahead {
            put("copy-ahead", f.copy_ahead.to_string());
        }
        if f.copy_ahead_us != d.copy_ahead_us {
            put("copy-ahead-us", f.copy_ahead_us.to_string());
        }
        if f.guess_on == GuessOn::Host {
            put("guess-on", "host".into());
        }
        if f.copy_ahead_at == CopyAheadAt::Sum {
            put("copy-ahead-at", "sum".into());
        }
        if f.bus_admissions_at == BusAdmissionsAt::Finish {
            put("bus-admissions-at", "finish".into());
        }
        if f.finish_layers_at == FinishLayersAt::Route {
            put("finish-layers-at", "route".into());
        }
        if self.kv != KvPrecision::default() {
            put("kv", self.kv.name().into());
        }
        out
    }
}

static FORWARD: OnceLock<ForwardOptions> = OnceLock::new();

/// Installs the knobs for this process: once, before a model is loaded. Refused (with what is in force)
/// if other knobs were set or read before.
pub fn set(knobs: &Knobs) -> Result<(), String> {
    poly_kernels::options::set(knobs.kernels)
        .map_err(|now| format!("the kernel options were already set: {now:?}"))?;
    let now = FORWARD.get_or_init(|| knobs.forward.clone());
    if *now == knobs.forward {
        Ok(())
    } else {
        Err(format!("the forward options were already set: {now:?}"))
    }
}

/// The forward pass's knobs in force: those [`set`] gave, else the defaults.
pub fn forward() -> &'static ForwardOptions {
    FORWARD.get_or_init(ForwardOptions::default)
}

/// The knobs in force, as [`Knobs::non_default`] says them, with the model's attention caches'
/// precision `kv` ([`crate::Model::kv`]; not a global).
pub fn in_force_non_default(kv: KvPrecision) -> BTreeMap<String, String> {
    Knobs {
        kernels: *poly_kernels::options::get(),
        forward: forward().clone(),
        kv,
    }
    .non_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_changed_knobs_are_echoed() {
        assert!(Knobs::default().non_default().is_empty());
        let mut k = Knobs::default();
        k.forward.fuse = Some("off".into());
        k.forward.moe_glu_fused = false;
        k.kernels.gpu.mmq = false;
        k.forward.gpu_segments = false;
        k.forward.cpu_share = CpuShareThreads::Rayon;
        k.forward.handoff = Handoff::Copy;
        k.forward.host_points = HostPoints::Cuts;
        k.forward.cpu_warm = true;
        k.forward.copy_ahead = 0;
        k.forward.guess_on = GuessOn::Host;
        k.forward.copy_ahead_us = 0;
        k.forward.copy_ahead_at = CopyAheadAt::Sum;
        k.forward.bus_admissions_at = BusAdmissionsAt::Finish;
        k.forward.finish_layers_at = FinishLayersAt::Route;
        k.kv = KvPrecision::Q8_0;
        let echoed: Vec<(String, String)> = k.non_default().into_iter().collect();
        let want = [
            ("bus-admissions-at", "finish"),
            ("copy-ahead", "0"),
            ("copy-ahead-at", "sum"),
            ("copy-ahead-us", "0"),
            ("cpu-share", "rayon"),
            ("cpu-warm", "on"),
            ("finish-layers-at", "route"),
            ("fuse", "off"),
            ("gpu-handoff", "copy"),
            ("gpu-host-points", "cuts"),
            ("gpu-segments", "off"),
            ("guess-on", "host"),
            ("kv", "q8_0"),
            ("mmq", "off"),
            ("moe-glu", "off"),
        ]
        .map(|(a, b)| (a.to_string(), b.to_string()));
        assert_eq!(echoed, want);
    }
}
