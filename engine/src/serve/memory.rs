//! Memory as the kernel counts it: the process's (`/proc/self/status`, for STATS) and the host's
//! (`/proc/meminfo`, for what the engine may lock or map ahead).

/// Resident and peak resident bytes of this process (`VmRSS`, `VmHWM`); `None` where the system has no
/// `/proc` (or does not say).
pub fn resident_bytes() -> (Option<u64>, Option<u64>) {
    match std::fs::read_to_string("/proc/self/status") {
        Ok(status) => (field_kib(&status, "VmRSS:"), field_kib(&status, "VmHWM:")),
        Err(_) => (None, None),
    }
}

/// The `name` line of `/proc/meminfo` (`"MemTotal:"`, `"MemAvailable:"`), in bytes; `None` where the
/// system has no `/proc` (or does not say).
pub fn host_bytes(name: &str) -> Option<u64> {
    field_kib(&std::fs::read_to_string("/proc/meminfo").ok()?, name)
}

/// The value of a `Name:   1234 kB` line of `/proc/self/status`, in bytes.
fn field_kib(status: &str, name: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with(name))?;
    let mut words = line[name.len()..].split_whitespace();
    let kib: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => Some(kib * 1024),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_kib_fields() {
        let status = "Name:\tpoly-engine\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\nThreads:\t3\n";
        assert_eq!(field_kib(status, "VmRSS:"), Some(1024 * 1024));
        assert_eq!(field_kib(status, "VmHWM:"), Some(2048 * 1024));
        assert_eq!(field_kib(status, "Threads:"), None);
        assert_eq!(field_kib(status, "VmSwap:"), None);
        if cfg!(target_os = "linux") {
            let (rss, peak) = resident_bytes();
            assert!(rss.is_some_and(|r| r > 0) && peak >= rss);
        }
    }
}
