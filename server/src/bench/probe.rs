//! What the benchmark measures around the engine process while a request runs, from outside it: CPU time
//! (`/proc/<pid>/stat`), peak resident memory (`/proc/<pid>/status` `VmHWM`, reset before each request
//! through `/proc/<pid>/clear_refs`), and on a GPU the card's load and memory (`nvidia-smi`, sampled by
//! its own loop `-lms` and read in a thread) and the engine's share of the card's memory (`nvidia-smi
//! --query-compute-apps`).
//!
//! Each reading is optional: a system without `/proc` or `nvidia-smi` gives `None`, never an error.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;
use std::time::Instant;

/// Linux's user-visible clock tick (`USER_HZ`), in which `/proc/<pid>/stat` counts CPU time: fixed at 100
/// by the kernel's ABI on every architecture the engine runs on (`getconf CLK_TCK`).
const USER_HZ: f64 = 100.0;

/// How often `nvidia-smi` samples the card, in milliseconds.
const GPU_SAMPLE_MS: u32 = 100;

/// CPU seconds (user + system, all threads) process `pid` has used, from `/proc/<pid>/stat`.
pub fn cpu_seconds(pid: i32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    cpu_seconds_of_stat(&stat)
}

/// `utime + stime` of a `/proc/<pid>/stat` line, in seconds. The command name (field 2) is in
/// parentheses and may hold spaces, so fields are counted from the last `)`.
fn cpu_seconds_of_stat(stat: &str) -> Option<f64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // After the name: state (3), ppid (4), ... utime (14), stime (15): indexes 11 and 12 from field 3.
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) as f64 / USER_HZ)
}

/// The value of a `Name:   1234 kB` line of a `/proc/<pid>/status` text, in bytes.
fn status_kib(status: &str, name: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with(name))?;
    let mut words = line[name.len()..].split_whitespace();
    let kib: u64 = words.next()?.parse().ok()?;
    (words.next() == Some("kB")).then_some(kib * 1024)
}

/// The peak resident memory of process `pid` (`VmHWM`), in bytes.
pub fn peak_rss(pid: i32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status_kib(&status, "VmHWM:")
}

/// Resets process `pid`'s peak resident memory to its current one (`echo 5 > /proc/<pid>/clear_refs`,
/// Linux 4.0 on), so that the next `VmHWM` is the peak of what follows. Whether it worked.
pub fn reset_peak_rss(pid: i32) -> bool {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}

/// Runs `nvidia-smi` with `args` once; its stdout, `None` without the tool or on a failure.
fn nvidia_smi(args: &[&str]) -> Option<String> {
    let out = Command::new("nvidia-smi")
        .args(args)
        .stderr(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Memory in use on each card (MiB, by index), as `nvidia-smi` reports it; empty without a GPU.
pub fn card_memory_used_mib() -> Vec<u64> {
    nvidia_smi(&["--query-gpu=memory.used", "--format=csv,noheader,nounits"])
        .map(|text| text.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

/// The card memory process `pid` holds, in bytes (`nvidia-smi --query-compute-apps`); `None` when the
/// tool does not list it (no GPU, or a container whose process ids the driver does not see).
pub fn process_vram_bytes(pid: i32) -> Option<u64> {
    let text = nvidia_smi(&[
        "--query-compute-apps=pid,used_memory",
        "--format=csv,noheader,nounits",
    ])?;
    compute_apps_mib(&text, pid).map(|mib| mib << 20)
}

/// The `used_memory` (MiB) of `pid` in `--query-compute-apps=pid,used_memory` CSV (a process on several
/// cards is listed once per card: summed).
fn compute_apps_mib(text: &str, pid: i32) -> Option<u64> {
    let mut found = None;
    for line in text.lines() {
        let mut cols = line.split(',').map(str::trim);
        let (Some(p), Some(m)) = (cols.next(), cols.next()) else {
            continue;
        };
        if p.parse::<i32>().ok() == Some(pid) {
            if let Ok(mib) = m.parse::<u64>() {
                found = Some(found.unwrap_or(0) + mib);
            }
        }
    }
    found
}

/// The CUDA ordinal of a READY `device` (`"cuda:0 NVIDIA H200"`); `None` for the CPU.
pub fn cuda_ordinal(device: &str) -> Option<usize> {
    let rest = device.strip_prefix("cuda:")?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// One sample of the card: utilization (percent) and memory in use (MiB).
#[derive(Clone, Copy, Debug, PartialEq)]
struct CardSample {
    load_pct: f64,
    memory_mib: u64,
}

/// A line `37, 1234` of `--query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits`.
fn parse_card_sample(line: &str) -> Option<CardSample> {
    let mut cols = line.split(',').map(str::trim);
    let load_pct = cols.next()?.parse().ok()?;
    let memory_mib = cols.next()?.parse().ok()?;
    Some(CardSample {
        load_pct,
        memory_mib,
    })
}

/// `nvidia-smi` sampling one card every [`GPU_SAMPLE_MS`] in its own loop; a thread reads its lines.
struct CardSampler {
    child: Child,
    reader: JoinHandle<Vec<CardSample>>,
}

impl CardSampler {
    /// `None` without `nvidia-smi`.
    fn start(ordinal: usize) -> Option<CardSampler> {
        let mut child = Command::new("nvidia-smi")
            .args([
                "--query-gpu=utilization.gpu,memory.used",
                "--format=csv,noheader,nounits",
                "-i",
                &ordinal.to_string(),
                "-lms",
                &GPU_SAMPLE_MS.to_string(),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let stdout = child.stdout.take()?;
        let reader = std::thread::spawn(move || {
            BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
                .filter_map(|l| parse_card_sample(&l))
                .collect()
        });
        Some(CardSampler { child, reader })
    }

    /// Stops the sampler (its stdout closes, which ends the reader) and returns what it read.
    fn finish(mut self) -> Vec<CardSample> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.reader.join().unwrap_or_default()
    }
}

/// The readings of one request, taken from outside the engine.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Readings {
    pub wall_s: f64,
    /// The engine's CPU time over the wall time (1.0: one core busy throughout).
    pub cpu_load: Option<f64>,
    /// `VmHWM` after the request; the peak of the request alone when `ram_peak_reset`.
    pub ram_peak_bytes: Option<u64>,
    pub ram_peak_reset: bool,
    /// The card's mean utilization over the request, 0 to 1 (`None` on the CPU or without samples).
    pub gpu_load: Option<f64>,
    pub gpu_samples: usize,
    /// The most memory in use on the card during the request, in MiB (the whole card's).
    pub card_memory_peak_mib: Option<u64>,
}

/// Measures one request of engine `pid`: start it before sending, finish it at DONE.
pub struct RequestProbe {
    pid: i32,
    started: Instant,
    cpu_start: Option<f64>,
    ram_peak_reset: bool,
    card: Option<CardSampler>,
}

impl RequestProbe {
    /// `gpu`: the card the engine runs on, if any.
    pub fn start(pid: i32, gpu: Option<usize>) -> RequestProbe {
        let ram_peak_reset = reset_peak_rss(pid);
        let card = gpu.and_then(CardSampler::start);
        RequestProbe {
            pid,
            cpu_start: cpu_seconds(pid),
            started: Instant::now(),
            ram_peak_reset,
            card,
        }
    }

    pub fn finish(self) -> Readings {
        let wall_s = self.started.elapsed().as_secs_f64();
        let cpu_end = cpu_seconds(self.pid);
        let samples = self.card.map(CardSampler::finish).unwrap_or_default();
        let cpu_load = match (self.cpu_start, cpu_end) {
            (Some(a), Some(b)) if wall_s > 0.0 => Some((b - a).max(0.0) / wall_s),
            _ => None,
        };
        let gpu_load = (!samples.is_empty()).then(|| {
            samples.iter().map(|s| s.load_pct).sum::<f64>() / samples.len() as f64 / 100.0
        });
        Readings {
            wall_s,
            cpu_load,
            ram_peak_bytes: peak_rss(self.pid),
            ram_peak_reset: self.ram_peak_reset,
            gpu_load,
            gpu_samples: samples.len(),
            card_memory_peak_mib: samples.iter().map(|s| s.memory_mib).max(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_cpu_time_counts_past_a_name_with_spaces() {
        // Fields after the name: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
        // utime stime ...
        let stat = "4242 (poly engine) R 1 4242 4242 0 -1 4194304 100 0 0 0 250 50 0 0 20 0 3 0";
        assert_eq!(cpu_seconds_of_stat(stat), Some(3.0));
        assert_eq!(cpu_seconds_of_stat("4242 (x) R 1"), None);
    }

    #[test]
    fn own_process_readings() {
        let pid = std::process::id() as i32;
        // Burn a little CPU so the count is positive.
        let mut x = 0u64;
        let t = Instant::now();
        while t.elapsed().as_millis() < 30 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        assert!(x != 1);
        assert!(cpu_seconds(pid).is_some_and(|s| s > 0.0));
        assert!(peak_rss(pid).is_some_and(|b| b > 1 << 20));
    }

    #[test]
    fn nvidia_smi_lines() {
        assert_eq!(
            parse_card_sample("37, 1234"),
            Some(CardSample {
                load_pct: 37.0,
                memory_mib: 1234
            })
        );
        assert_eq!(parse_card_sample("[N/A], 5"), None);
        let apps = "111, 500\n4242, 20480\n4242, 100\nbad line\n";
        assert_eq!(compute_apps_mib(apps, 4242), Some(20580));
        assert_eq!(compute_apps_mib(apps, 7), None);
        assert_eq!(status_kib("VmHWM:\t  2048 kB\n", "VmHWM:"), Some(2 << 20));
    }

    #[test]
    fn device_names() {
        assert_eq!(cuda_ordinal("cuda:0 NVIDIA H200"), Some(0));
        assert_eq!(cuda_ordinal("cuda:12 X"), Some(12));
        assert_eq!(cuda_ordinal("cpu"), None);
    }
}
