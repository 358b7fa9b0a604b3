//! Wall time per kind of operation of the CPU forward pass, for finding what does not scale with the
//! threads: set `POLY_CPU_PROFILE=1` and the running totals go to stderr about once a second. Off, a span
//! costs one check of a flag.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("POLY_CPU_PROFILE").is_some())
}

/// (calls, total wall time) per operation name.
fn totals() -> &'static Mutex<BTreeMap<&'static str, (u64, Duration)>> {
    static TOTALS: OnceLock<Mutex<BTreeMap<&'static str, (u64, Duration)>>> = OnceLock::new();
    TOTALS.get_or_init(|| Mutex::new(BTreeMap::new()))
}

/// The span name `"{op} {ty}"` (one leaked string per pair, made only when profiling is on; `op` alone when
/// it is off), so the totals say which weight formats a mix spends its time in.
pub fn typed(op: &'static str, ty: poly_kernels::quant::GgmlType) -> &'static str {
    if !enabled() {
        return op;
    }
    type Names = Mutex<BTreeMap<(&'static str, String), &'static str>>;
    static NAMES: OnceLock<Names> = OnceLock::new();
    let key = (op, ty.to_string());
    let mut names = NAMES
        .get_or_init(|| Mutex::new(BTreeMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    names
        .entry(key)
        .or_insert_with_key(|(op, ty)| Box::leak(format!("{op} {ty}").into_boxed_str()))
}

/// Times its scope under `name` when profiling is on.
pub struct Span {
    name: &'static str,
    start: Option<Instant>,
}

/// A span of operation `name`, ending when dropped.
pub fn span(name: &'static str) -> Span {
    Span {
        name,
        start: enabled().then(Instant::now),
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some(t0) = self.start {
            let dt = t0.elapsed();
            if let Ok(mut m) = totals().lock() {
                let e = m.entry(self.name).or_insert((0, Duration::ZERO));
                e.0 += 1;
                e.1 += dt;
                maybe_print(&m);
            }
        }
    }
}

/// Prints the running totals when a second has passed since the last print.
fn maybe_print(m: &BTreeMap<&'static str, (u64, Duration)>) {
    static LAST: Mutex<Option<Instant>> = Mutex::new(None);
    let Ok(mut last) = LAST.lock() else { return };
    let now = Instant::now();
    match *last {
        None => {
            *last = Some(now);
            return;
        }
        Some(t) if now.duration_since(t) < Duration::from_secs(1) => return,
        _ => *last = Some(now),
    }
    let all: Duration = m.values().map(|v| v.1).sum();
    let line: Vec<String> = m
        .iter()
        .map(|(k, (n, d))| format!("{k} {:.1} ({n})", d.as_secs_f64() * 1e3))
        .collect();
    eprintln!(
        "profile: wall ms (calls) so far: total {:.1} | {}",
        all.as_secs_f64() * 1e3,
        line.join(" | ")
    );
}
