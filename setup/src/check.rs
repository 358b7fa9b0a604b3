//! `setup --check`: what this PC makes of each known and installed model, from the card's VRAM and the RAM.
//! Every line is an estimate and says so: the engine's real use depends on the context, the conversations it
//! keeps and the card's own reservations.

use std::fmt;

/// Memory the engine needs beyond the weights it holds (buffers, KV cache of a modest context, the OS page
/// cache's share): the same 1 GB the server's registry adds to the dense weights for `vram_gb.least`.
pub const WORKING_MEMORY: u64 = 1_000_000_000;

const GB: f64 = 1e9;
const MIB: u64 = 1 << 20;

/// This PC's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Machine {
    /// Total VRAM of the card the engine uses (GPU 0); `None` without a GPU.
    pub vram_bytes: Option<u64>,
    /// Total RAM.
    pub ram_bytes: u64,
}

/// What a model needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Needs {
    /// The model's GGUF bytes (all parts).
    pub file_bytes: u64,
    /// Bytes of its routed experts.
    pub expert_bytes: u64,
    /// VRAM before any expert: dense weights plus working memory.
    pub vram_before_experts: u64,
}

impl Needs {
    /// From a GGUF's dense and expert bytes, as the registry counts them.
    pub fn from_parts(file_bytes: u64, expert_bytes: u64, other_bytes: u64) -> Needs {
        Needs {
            file_bytes,
            expert_bytes,
            vram_before_experts: other_bytes + WORKING_MEMORY,
        }
    }
}

/// The verdict for one model on one machine.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fit {
    /// Every weight fits in VRAM.
    WholeInVram,
    /// The dense weights and about `percent` of the experts in VRAM, the rest read from RAM.
    PartlyInVram { percent: u32 },
    /// On the CPU from RAM (no GPU, or too little VRAM for the dense weights).
    CpuFromRam { has_gpu: bool },
    /// Not enough RAM: short by `short_bytes`.
    NeedsMoreRam { short_bytes: u64 },
}

impl fmt::Display for Fit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fit::WholeInVram => write!(f, "runs whole in VRAM"),
            Fit::PartlyInVram { percent } => write!(
                f,
                "runs with about {percent}% of its experts in VRAM, the rest from RAM"
            ),
            Fit::CpuFromRam { has_gpu: false } => write!(f, "runs on the CPU from RAM (no GPU)"),
            Fit::CpuFromRam { has_gpu: true } => write!(
                f,
                "runs on the CPU from RAM (the card is too small for its dense weights)"
            ),
            Fit::NeedsMoreRam { short_bytes } => write!(
                f,
                "needs about {:.1} GB more RAM",
                (*short_bytes as f64 / GB).max(0.1)
            ),
        }
    }
}

/// Where a model would run on `machine`.
pub fn assess(needs: &Needs, machine: &Machine) -> Fit {
    if let Some(vram) = machine.vram_bytes {
        if vram >= needs.vram_before_experts + needs.expert_bytes {
            return Fit::WholeInVram;
        }
        if vram >= needs.vram_before_experts && needs.expert_bytes > 0 {
            let in_vram = vram - needs.vram_before_experts;
            // The experts the card cannot hold are read from RAM (mapped from the file).
            let from_ram = needs.expert_bytes - in_vram + WORKING_MEMORY;
            if machine.ram_bytes < from_ram {
                return Fit::NeedsMoreRam {
                    short_bytes: from_ram - machine.ram_bytes,
                };
            }
            let percent = (in_vram as u128 * 100 / needs.expert_bytes as u128) as u32;
            return Fit::PartlyInVram { percent };
        }
    }
    let want = needs.file_bytes + WORKING_MEMORY;
    if machine.ram_bytes < want {
        return Fit::NeedsMoreRam {
            short_bytes: want - machine.ram_bytes,
        };
    }
    Fit::CpuFromRam {
        has_gpu: machine.vram_bytes.is_some(),
    }
}

/// One line of `--check`: `estimate: NAME (FILE GB, experts GB): VERDICT`.
pub fn line(name: &str, needs: &Needs, machine: &Machine) -> String {
    format!(
        "estimate: {name} ({:.1} GB file, {:.1} GB experts, {:.1} GB VRAM before experts): {}",
        needs.file_bytes as f64 / GB,
        needs.expert_bytes as f64 / GB,
        needs.vram_before_experts as f64 / GB,
        assess(needs, machine)
    )
}

/// The machine's memory: given figures (MiB) where passed, else `/proc/meminfo`'s `MemTotal` and the first
/// card's total from `nvidia-smi` (no `nvidia-smi` or no card: no GPU).
pub fn this_machine(vram_mib: Option<u64>, ram_mib: Option<u64>) -> Result<Machine, String> {
    let ram_bytes = match ram_mib {
        Some(m) => m * MIB,
        None => total_ram()?,
    };
    let vram_bytes = match vram_mib {
        Some(0) => None,
        Some(m) => Some(m * MIB),
        None => first_gpu_vram(),
    };
    Ok(Machine {
        vram_bytes,
        ram_bytes,
    })
}

fn total_ram() -> Result<u64, String> {
    let text = std::fs::read_to_string("/proc/meminfo")
        .map_err(|e| format!("cannot read /proc/meminfo ({e}); pass --ram-mib"))?;
    parse_meminfo_total(&text).ok_or_else(|| "no MemTotal in /proc/meminfo; pass --ram-mib".into())
}

/// `MemTotal:  24576000 kB` → bytes.
pub fn parse_meminfo_total(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn first_gpu_vram() -> Option<u64> {
    let out = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=memory.total", "--format=csv,noheader,nounits"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mib: u64 = text.lines().next()?.trim().parse().ok()?;
    Some(mib * MIB)
}

/// A figure for people: `12.3 GB`.
pub fn gb(bytes: u64) -> String {
    format!("{:.1} GB", bytes as f64 / GB)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_total() {
        let text = "MemTotal:       24576000 kB\nMemFree:  100 kB\n";
        assert_eq!(parse_meminfo_total(text), Some(24_576_000 * 1024));
        assert_eq!(parse_meminfo_total("MemFree: 1 kB"), None);
    }
}
