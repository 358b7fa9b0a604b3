//! Free memory as `memory_debug` prints it around a switch: RAM from `/proc/meminfo`, VRAM from
//! `nvidia-smi` when there is one.

use std::process::Command;

/// `MemAvailable` of `/proc/meminfo`, in bytes.
pub fn ram_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Free VRAM per GPU in MiB, as `nvidia-smi` reports it; empty without a GPU.
pub fn vram_free_mib() -> Vec<u64> {
    let Ok(out) = Command::new("nvidia-smi")
        .args(["--query-gpu=memory.free", "--format=csv,noheader,nounits"])
        .output()
    else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// The resident set of process `pid` in bytes (`VmRSS` of `/proc/<pid>/status`).
pub fn rss_of(pid: i32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = text.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// One line for the log: `"<when>: RAM free X GiB, VRAM free [a, b] MiB"`.
pub fn report(when: &str) -> String {
    let ram = ram_available()
        .map(|b| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64))
        .unwrap_or_else(|| "?".into());
    let vram = vram_free_mib();
    let vram = if vram.is_empty() {
        "no GPU".to_string()
    } else {
        format!("{vram:?} MiB")
    };
    format!("memory {when}: RAM available {ram}, VRAM free {vram}")
}

/// Hands the heap's free pages back to the OS (glibc's `malloc_trim`), after a switch or an unload has
/// dropped a model's text side.
///
/// A text side (tokenizer, vocabulary maps, template) is tens to hundreds of MB of small allocations
/// made on a blocking thread, so in one of glibc's per-thread arenas; freed, its pages stay with the
/// process, and the next model's text side lands in another arena: the server grew from 46 to 118 MiB
/// over 30 switches between two small models (and to 1.05 GB with large vocabularies) and kept it
/// after an unload. `malloc_trim(0)` walks every arena and returns their free pages.
pub fn give_back_freed() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> std::ffi::c_int;
        }
        // SAFETY: malloc_trim takes no pointers and only releases memory that no allocation holds; it
        // is safe to call at any time from any thread (glibc locks each arena it trims).
        unsafe {
            malloc_trim(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_rss_and_free_ram() {
        let rss = rss_of(std::process::id() as i32).expect("own VmRSS");
        assert!(
            rss > 1 << 20,
            "a running test has more than 1 MiB resident: {rss}"
        );
        assert!(ram_available().expect("MemAvailable") > 0);
        assert!(report("now").starts_with("memory now: RAM available"));
    }
}
