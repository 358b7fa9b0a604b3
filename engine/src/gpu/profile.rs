//! `POLY_GPU_PROFILE`: where the time of the card's forward calls goes, summarized on stderr when the
//! backend is dropped (at the end of `poly-engine bench`, say).
//!
//! - `POLY_GPU_PROFILE=1`: per call, the host's time in each phase of [`super::GpuBackend::call`] (following
//!   the host state, queueing the operations, the final synchronization with the logits' download, copying
//!   the state back), the kernel launches queued, and the device time from the call's first operation to its
//!   last (two events a call). Decode calls (one token) and prompt calls are summed apart.
//! - `POLY_GPU_PROFILE=2`: also the device time of every operation kind (an event before and after each
//!   operation; the MoE layer split into its steps as `moe.*`). The events cost host time of their own, so
//!   level 1 gives the truer host figures. When the host queues more slowly than the card computes, an
//!   operation's device time includes the wait for its own launches: the span against the host's queueing
//!   time tells which side bounds the call.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use poly_kernels::cuda::{CudaResult, Device, TimingEvent};

use super::decode_graph::HostTimes;

/// Which profile, from `POLY_GPU_PROFILE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ProfileLevel {
    /// Host phases, launches, device span.
    Calls,
    /// Also device time per operation kind.
    Ops,
}

impl ProfileLevel {
    /// The level `POLY_GPU_PROFILE` asks for, if any.
    pub fn from_env() -> Option<ProfileLevel> {
        match std::env::var("POLY_GPU_PROFILE").ok()?.trim() {
            "1" => Some(ProfileLevel::Calls),
            "2" => Some(ProfileLevel::Ops),
            _ => None,
        }
    }
}

/// The host's time in each phase of one call.
#[derive(Clone, Copy, Debug, Default)]
pub struct CallPhases {
    /// `DeviceSeq::follow`: keeping or uploading the card's state.
    pub follow: Duration,
    /// Building the call and queueing every operation.
    pub queue: Duration,
    /// The final synchronization and the logits' download.
    pub finish: Duration,
    /// Copying the new KV rows and recurrent states to the host state.
    pub copy_back: Duration,
}

/// Sums over calls of one kind.
#[derive(Default)]
struct CallTotals {
    calls: u64,
    tokens: u64,
    phases: CallPhases,
    total: Duration,
    launches: u64,
    device_span_ms: f64,
}

/// Device time of one operation kind.
#[derive(Default)]
struct OpTotals {
    count: u64,
    ms: f64,
}

#[derive(Default)]
struct Totals {
    /// Segmented decode graphs' host points.
    host_points: HostTimes,
    decode: CallTotals,
    prompt: CallTotals,
    decode_ops: BTreeMap<&'static str, OpTotals>,
    prompt_ops: BTreeMap<&'static str, OpTotals>,
    /// Events of earlier calls, for reuse.
    spare: Vec<TimingEvent>,
}

/// The profile of a backend.
pub struct Profiler {
    level: ProfileLevel,
    totals: Mutex<Totals>,
}

/// The device-side marks of one call: its span and, at [`ProfileLevel::Ops`], each operation's.
pub struct CallMarks {
    level: ProfileLevel,
    start: TimingEvent,
    end: Option<TimingEvent>,
    ops: Vec<(&'static str, TimingEvent, TimingEvent)>,
    spare: Vec<TimingEvent>,
    launches0: u64,
}

impl CallMarks {
    fn event(&mut self, dev: &Device) -> CudaResult<TimingEvent> {
        match self.spare.pop() {
            Some(e) => Ok(e),
            None => dev.timing_event(),
        }
    }

    /// Records the start of an operation (at [`ProfileLevel::Ops`]).
    pub fn op_begin(&mut self, dev: &Device) -> Option<TimingEvent> {
        if self.level < ProfileLevel::Ops {
            return None;
        }
        let e = self.event(dev).ok()?;
        e.record(dev).ok()?;
        Some(e)
    }

    /// Records the end of the operation `begin` started.
    pub fn op_end(&mut self, dev: &Device, kind: &'static str, begin: Option<TimingEvent>) {
        let Some(b) = begin else { return };
        let Ok(e) = self.event(dev) else { return };
        if e.record(dev).is_ok() {
            self.ops.push((kind, b, e));
        }
    }

    /// Records the end of the call's operations.
    pub fn end(&mut self, dev: &Device) {
        if let Ok(e) = self.event(dev) {
            if e.record(dev).is_ok() {
                self.end = Some(e);
            }
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl Profiler {
    /// The profiler `POLY_GPU_PROFILE` asks for.
    pub fn from_env() -> Option<Profiler> {
        ProfileLevel::from_env().map(|level| Profiler {
            level,
            totals: Mutex::new(Totals::default()),
        })
    }

    fn totals(&self) -> std::sync::MutexGuard<'_, Totals> {
        // Plain sums: a panic elsewhere leaves them usable.
        self.totals.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks the start of a call's operations on the card.
    pub fn begin(&self, dev: &Device) -> Option<CallMarks> {
        let spare = std::mem::take(&mut self.totals().spare);
        let mut marks = CallMarks {
            level: self.level,
            start: dev.timing_event().ok()?,
            end: None,
            ops: Vec::new(),
            spare,
            launches0: dev.launches(),
        };
        if let Some(e) = marks.spare.pop() {
            marks.start = e;
        }
        marks.start.record(dev).ok()?;
        Some(marks)
    }

    /// Adds one finished call (its stream synchronized) of `n_tokens` tokens.
    pub fn record(
        &self,
        dev: &Device,
        n_tokens: usize,
        phases: CallPhases,
        marks: Option<CallMarks>,
    ) {
        let mut t = self.totals();
        let decode = n_tokens == 1;
        let totals = if decode { &mut t.decode } else { &mut t.prompt };
        totals.calls += 1;
        totals.tokens += n_tokens as u64;
        totals.phases.follow += phases.follow;
        totals.phases.queue += phases.queue;
        totals.phases.finish += phases.finish;
        totals.phases.copy_back += phases.copy_back;
        totals.total += phases.follow + phases.queue + phases.finish + phases.copy_back;
        let Some(mut marks) = marks else { return };
        totals.launches += dev.launches().saturating_sub(marks.launches0);
        if let Some(end) = &marks.end {
            totals.device_span_ms += marks.start.elapsed_ms(end).unwrap_or(0.0) as f64;
        }
        let mut ops = BTreeMap::<&'static str, OpTotals>::new();
        for (kind, b, e) in &marks.ops {
            let o = ops.entry(kind).or_default();
            o.count += 1;
            o.ms += b.elapsed_ms(e).unwrap_or(0.0) as f64;
        }
        let into = if decode {
            &mut t.decode_ops
        } else {
            &mut t.prompt_ops
        };
        for (kind, o) in ops {
            let sum = into.entry(kind).or_default();
            sum.count += o.count;
            sum.ms += o.ms;
        }
        let spare = &mut t.spare;
        spare.append(&mut marks.spare);
        spare.push(marks.start);
        spare.extend(marks.end);
        for (_, b, e) in marks.ops {
            spare.push(b);
            spare.push(e);
        }
    }

    /// Adds the host points of segmented decode graphs' replays.
    pub fn add_host_points(&self, times: &HostTimes) {
        self.totals().host_points.add(times);
    }

    /// The summary, one table per kind of call.
    pub fn summary(&self) -> String {
        let t = self.totals();
        let mut s = String::from("POLY_GPU_PROFILE summary (per call, milliseconds)\n");
        let h = &t.host_points;
        if h.steps > 0 && t.decode.calls > 0 {
            let n = t.decode.calls as f64;
            s += &format!(
                "segmented decode graphs, host per call: {:.1} MoE steps; waiting for the router {:.3} + \
                 the cache's decisions {:.3} + beside the CPU's share (its own {:.3}): copies on demand \
                 {:.3}, tables {:.3}, the launches, then waiting for the share {:.3} + finishing layers \
                 {:.3} (admissions {:.3})\n",
                h.steps as f64 / n,
                ms(h.route_wait) / n,
                ms(h.prepare) / n,
                ms(h.cpu_share) / n,
                ms(h.stage) / n,
                ms(h.tables) / n,
                ms(h.share_wait) / n,
                ms(h.finish) / n,
                ms(h.admit) / n,
            );
            if h.ahead > std::time::Duration::ZERO {
                s += &format!(
                    "--copy-ahead: queueing the next layers' copies {:.3} per call (counts in the \
                     bench's experts.ahead_copied / ahead_routed)\n",
                    ms(h.ahead) / n,
                );
            }
            if h.card_tokens > 0 {
                let t = h.card_tokens as f64;
                s += &format!(
                    "one graph a token, the card's own waits per token: at the staged flags (the host's \
                     decisions, copies on demand and ahead) {:.3}, at the sum flags (the CPU's share) \
                     {:.3}\n",
                    ms(h.card_staged_wait) / t,
                    ms(h.card_sum_wait) / t,
                );
            }
            if h.guessed > 0 {
                s += &format!(
                    "--cpu-warm: {:.1} next-layer experts guessed missing per call, {:.1}% of them \
                     routed; {:.1} MiB read ahead per call\n",
                    h.guessed as f64 / n,
                    100.0 * h.guessed_right as f64 / h.guessed as f64,
                    h.warmed_bytes as f64 / n / (1u64 << 20) as f64,
                );
            }
        }
        for (name, c, ops) in [
            ("decode (1 token)", &t.decode, &t.decode_ops),
            ("prompt (>1 token)", &t.prompt, &t.prompt_ops),
        ] {
            if c.calls == 0 {
                continue;
            }
            let n = c.calls as f64;
            s += &format!(
                "{name}: {} calls, {} tokens; host per call: total {:.3} = follow {:.3} + queue {:.3} + \
                 finish(sync+logits) {:.3} + copy_back {:.3}; launches/call {:.1}; device span/call {:.3}\n",
                c.calls,
                c.tokens,
                ms(c.total) / n,
                ms(c.phases.follow) / n,
                ms(c.phases.queue) / n,
                ms(c.phases.finish) / n,
                ms(c.phases.copy_back) / n,
                c.launches as f64 / n,
                c.device_span_ms / n,
            );
            // `moe.*` are steps inside `moe`: the shares are of the top-level operations.
            let op_total: f64 = ops
                .iter()
                .filter(|(k, _)| !k.contains('.'))
                .map(|(_, o)| o.ms)
                .sum();
            let mut by_time: Vec<_> = ops.iter().collect();
            by_time.sort_by(|a, b| b.1.ms.total_cmp(&a.1.ms));
            for (kind, o) in by_time {
                s += &format!(
                    "  op {kind:<16} {:>8.1}/call {:>9.4} ms/call {:>7.2} us/op {:>5.1}%\n",
                    o.count as f64 / n,
                    o.ms / n,
                    1e3 * o.ms / o.count.max(1) as f64,
                    100.0 * o.ms / op_total.max(1e-9),
                );
            }
        }
        s
    }
}
