//! The kernel-level knobs: which kernel variant or launch shape runs where several compute the same
//! values (tensor-core or dp4a prompt products, rows per warp group, the CPU's SIMD level, ...). They are
//! A/B switches for measurements; the defaults are the measured best.
//!
//! They are set once, at process start, from `poly-engine`'s flags ([`set`]), and read by the kernels
//! through [`get`] (the defaults when nothing was set: tests and benches). A global rather than a value
//! passed down, because the readers sit deep in kernel selection code called from everywhere; but never
//! read from the environment: what changes the execution path is a flag, echoed in the engine's READY
//! line (README.md's table of environment variables lists the few diagnostic ones that remain).

use std::sync::OnceLock;

/// The GPU kernels' knobs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuKernelOptions {
    /// The tensor-core prompt attention (off: `attn_f16` on CUDA cores).
    pub flash_attention: bool,
    /// The tensor-core (mma) prompt matrix products (off: the dp4a ones).
    pub mmq: bool,
    /// Gate and up of the grouped experts as one launch (off: two).
    pub mmq_pair: bool,
    /// The expert tile forced on the grouped expert products (8: the dp4a kernel; 16, 32, 64, 128), if
    /// any.
    pub mmq_expert_tile: Option<usize>,
    /// The expert tile sizes chosen before the kernels skipped a short tile's empty tokens.
    pub mmq_old_expert_tiles: bool,
    /// Group a call's tokens by expert on the host (a download of the ids, a wait per MoE layer) instead
    /// of on the card.
    pub moe_group_host: bool,
    /// At most this many warps share a row of the quantized matvec (1, 2 or 4).
    pub matvec_warps_per_row: u32,
    /// At most this many rows per warp group of the one-token matvec kernels (1, 2 or 4).
    pub matvec_rows_per_group: usize,
    /// Which launches are programmatic dependent launches on sm_90+ (each kernel's launch and prologue
    /// overlap the kernel before it).
    pub launch_overlap: LaunchOverlap,
    /// What one-token launches ask the L2 cache for ahead of their reads (common.cuh's `prefetch_l2`).
    pub l2_prefetch: L2Prefetch,
}

/// `--gpu-prefetch`: what one-token launches ask the card's L2 cache for (sm_90's bulk prefetch; a hint,
/// the same values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum L2Prefetch {
    /// Nothing.
    Off,
    /// Matvec launches their weights before their prologue's wait (so the fetch overlaps the kernel
    /// before them); expert launches their slots' whole experts once the routing is known.
    Own,
    /// Besides, the gate and up launch the down experts of its slots, which then arrive while it
    /// computes.
    Ahead,
}

impl L2Prefetch {
    /// The flag's value.
    pub fn name(self) -> &'static str {
        match self {
            L2Prefetch::Off => "off",
            L2Prefetch::Own => "own",
            L2Prefetch::Ahead => "ahead",
        }
    }

    /// The value of the macro `POLY_L2_PREFETCH` the kernels read (0, 1, 2).
    pub fn level(self) -> u8 {
        self as u8
    }
}

/// `--gpu-pdl`: which kernel launches overlap the kernel before them (kernels/src/cuda/launch.rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchOverlap {
    /// Plain stream order everywhere.
    Off,
    /// The launches of one-token calls (decode, and the graphs captured from them): a chain of short
    /// kernels, bound by the gaps between them. Measured on the H200 (BENCHMARKS.md, "Launches that
    /// overlap"): answers 4–8% faster with every weight in VRAM, while 512-token prompts read 1–5%
    /// slower with every launch overlapped.
    Decode,
    /// Every launch.
    All,
}

impl LaunchOverlap {
    /// Whether the launches of a call of `rows` rows overlap.
    pub fn for_rows(self, rows: usize) -> bool {
        match self {
            LaunchOverlap::Off => false,
            LaunchOverlap::Decode => rows == 1,
            LaunchOverlap::All => true,
        }
    }

    /// The flag's value.
    pub fn name(self) -> &'static str {
        match self {
            LaunchOverlap::Off => "off",
            LaunchOverlap::Decode => "decode",
            LaunchOverlap::All => "all",
        }
    }
}

impl Default for GpuKernelOptions {
    fn default() -> Self {
        GpuKernelOptions {
            flash_attention: true,
            mmq: true,
            mmq_pair: true,
            mmq_expert_tile: None,
            mmq_old_expert_tiles: false,
            moe_group_host: false,
            // One warp a row: measured fastest on an H100 (kernels/src/cuda/ops.rs, max_warps_per_row).
            matvec_warps_per_row: 1,
            matvec_rows_per_group: 1,
            launch_overlap: LaunchOverlap::Decode,
            // Off until measured on a card: written and compiled for sm_90 (NVRTC), never yet run on one.
            l2_prefetch: L2Prefetch::Off,
        }
    }
}

/// The CPU kernels' knobs (each variant computes the same bits as the one it replaces).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuKernelOptions {
    /// Any SIMD kernel (off: the portable code everywhere).
    pub simd: bool,
    /// The AVX-512 VNNI kernels where the CPU has them (off: AVX2).
    pub avx512: bool,
    /// Q4_K's four-row kernel (off: each row alone).
    pub rows4: bool,
    /// The K-quant tile kernels (off: the row-by-row kernels).
    pub ktile: bool,
}

impl Default for CpuKernelOptions {
    fn default() -> Self {
        CpuKernelOptions {
            simd: true,
            avx512: true,
            rows4: true,
            ktile: true,
        }
    }
}

/// Every kernel-level knob.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelOptions {
    pub gpu: GpuKernelOptions,
    pub cpu: CpuKernelOptions,
}

impl KernelOptions {
    /// The knobs that differ from the defaults, as `name=value` with the names of `poly-engine`'s flags
    /// (without `--`), for READY and logs.
    pub fn non_default(&self) -> Vec<(&'static str, String)> {
        let d = KernelOptions::default();
        let on_off = |b: bool| if b { "on" } else { "off" }.to_string();
        let mut out = Vec::new();
        let (g, dg) = (&self.gpu, &d.gpu);
        if g.flash_attention != dg.flash_attention {
            out.push(("fa", on_off(g.flash_attention)));
        }
        if g.mmq != dg.mmq {
            out.push(("mmq", on_off(g.mmq)));
        }
        if g.mmq_pair != dg.mmq_pair {
            out.push(("mmq-pair", on_off(g.mmq_pair)));
        }
        if let Some(t) = g.mmq_expert_tile {
            out.push(("mmq-expert-tile", t.to_string()));
        }
        if g.mmq_old_expert_tiles != dg.mmq_old_expert_tiles {
            out.push(("mmq-expert-tiles", "old".to_string()));
        }
        if g.moe_group_host != dg.moe_group_host {
            out.push(("moe-group", "host".to_string()));
        }
        if g.matvec_warps_per_row != dg.matvec_warps_per_row {
            out.push(("matvec-warps-per-row", g.matvec_warps_per_row.to_string()));
        }
        if g.matvec_rows_per_group != dg.matvec_rows_per_group {
            out.push(("matvec-rpg", g.matvec_rows_per_group.to_string()));
        }
        if g.launch_overlap != dg.launch_overlap {
            out.push(("gpu-pdl", g.launch_overlap.name().to_string()));
        }
        if g.l2_prefetch != dg.l2_prefetch {
            out.push(("gpu-prefetch", g.l2_prefetch.name().to_string()));
        }
        let (c, dc) = (&self.cpu, &d.cpu);
        if c.simd != dc.simd {
            out.push(("cpu-simd", on_off(c.simd)));
        }
        if c.avx512 != dc.avx512 {
            out.push(("cpu-avx512", on_off(c.avx512)));
        }
        if c.rows4 != dc.rows4 {
            out.push(("cpu-rows4", on_off(c.rows4)));
        }
        if c.ktile != dc.ktile {
            out.push(("cpu-ktile", on_off(c.ktile)));
        }
        out
    }
}

static OPTIONS: OnceLock<KernelOptions> = OnceLock::new();

/// Sets the knobs for this process: once, before any kernel runs. A second call, or a call after a
/// kernel read the defaults, is refused with the knobs in force (unless it asks for the same).
pub fn set(options: KernelOptions) -> Result<(), KernelOptions> {
    let now = OPTIONS.get_or_init(|| options);
    if *now == options {
        Ok(())
    } else {
        Err(*now)
    }
}

/// The knobs in force: those [`set`] gave, else the defaults.
pub fn get() -> &'static KernelOptions {
    OPTIONS.get_or_init(KernelOptions::default)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_not_echoed_and_changes_are() {
        assert!(KernelOptions::default().non_default().is_empty());
        let mut o = KernelOptions::default();
        o.gpu.mmq = false;
        o.gpu.matvec_rows_per_group = 4;
        o.cpu.ktile = false;
        assert_eq!(
            o.non_default(),
            [
                ("mmq", "off".to_string()),
                ("matvec-rpg", "4".to_string()),
                ("cpu-ktile", "off".to_string())
            ]
        );
    }
}
