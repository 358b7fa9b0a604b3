//! The benchmark's results: one [`RequestResult`] per prompt and run inside a [`Report`], written as one
//! JSON object (`--json`) or as a table for people.

use serde::Serialize;
use std::fmt::Write;

/// Figures on one clock: the server's (from sending GEN to the `T` lines' arrival) or the engine's (DONE's
/// `prefill_ms` and `decode_ms`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Clock {
    /// Server: from sending the request to the first answer token's arrival (time to first token).
    /// Engine: `prefill_ms`, the prompt's read.
    pub prompt_ms: f64,
    /// Server: from the first answer token's arrival to the last's. Engine: `decode_ms`.
    pub answer_ms: f64,
    /// Prompt tokens read (not taken from a kept state) per second of `prompt_ms`.
    pub prompt_tokens_per_s: Option<f64>,
    /// Answer tokens after the first (those that needed a forward step of their own) per second of
    /// `answer_ms`.
    pub answer_tokens_per_s: Option<f64>,
}

impl Clock {
    pub fn new(prompt_ms: f64, answer_ms: f64, read: u32, generated: u32) -> Clock {
        let rate = |n: u32, ms: f64| (n > 0 && ms > 0.0).then(|| n as f64 * 1e3 / ms);
        Clock {
            prompt_ms,
            answer_ms,
            prompt_tokens_per_s: rate(read, prompt_ms),
            answer_tokens_per_s: rate(generated.saturating_sub(1), answer_ms),
        }
    }
}

/// One request: a prompt in one run.
#[derive(Clone, Debug, Serialize)]
pub struct RequestResult {
    /// `short` or `long-N` (N the tokens asked for).
    pub prompt: String,
    /// 1-based.
    pub run: usize,
    /// The prompt's length as first sent.
    pub prompt_tokens_asked: u32,
    /// DONE's `prompt_tokens`: the length served, shorter than asked when the engine refused the first
    /// as longer than its context.
    pub prompt_tokens: u32,
    /// Whether the prompt was sent again shorter after a `context_overflow` refusal.
    pub shortened: bool,
    /// DONE's `cached_tokens`: prompt tokens the engine did not read again.
    pub cached_tokens: u32,
    /// DONE's `generated`, and why the answer ended (`length`, or `stop` at an end token when the
    /// engine would not ignore them).
    pub generated: u32,
    pub answer_tokens_asked: u32,
    pub reason: String,
    pub time_to_first_token_ms: f64,
    pub server: Clock,
    pub engine: Clock,
    /// DONE's share of routed-expert uses served from VRAM (null on the CPU or a dense model): over the
    /// request (a long prompt's routings weigh most), and over the answer's tokens alone.
    pub experts_vram_share: Option<f64>,
    pub experts_vram_share_answer: Option<f64>,
    pub draft_proposed: u32,
    pub draft_accepted: u32,
    /// `draft_accepted / draft_proposed`; null when nothing was proposed.
    pub draft_acceptance: Option<f64>,
    /// The engine's VRAM at its highest (null without a GPU), and where the figure comes from
    /// (`stats`: the engine's STATS; `nvidia-smi pid`: the driver's count for the engine's process;
    /// `nvidia-smi card`: the card's memory in use at its highest during the request less what was in
    /// use before the engine started).
    pub vram_peak_bytes: Option<u64>,
    pub vram_source: Option<String>,
    /// The engine's peak resident memory; `ram_peak_scope` `request` when the kernel's peak was reset
    /// before the request, `process` when it counts from the engine's start.
    pub ram_peak_bytes: Option<u64>,
    pub ram_peak_scope: String,
    /// The card's mean utilization over the request, 0 to 1 (null on the CPU), from `gpu_samples`
    /// samples of `nvidia-smi`.
    pub gpu_load: Option<f64>,
    pub gpu_samples: usize,
    /// The engine's CPU time over the request's wall time (1.0: one core busy throughout).
    pub cpu_load: Option<f64>,
    pub wall_ms: f64,
    /// The start of the answer's text.
    pub answer_start: String,
}

/// The whole benchmark.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub model: String,
    pub arch: String,
    /// READY's `device`: `cpu` or `cuda:N <name>`.
    pub device: String,
    pub n_ctx: u32,
    pub engine_pid: i32,
    /// From the start of the engine to its READY.
    pub load_s: f64,
    pub experts_total: u64,
    pub experts_vram: u64,
    pub answer_tokens: u32,
    pub runs: usize,
    /// Whether the requests asked the engine to ignore end tokens (an empty `stop_tokens`).
    pub ignore_eos: bool,
    /// Tokens of the benchmark text under the model's tokenizer.
    pub text_tokens: usize,
    pub results: Vec<RequestResult>,
    /// Things the reader should know (prompts sent again shorter, figures missing and why).
    pub notes: Vec<String>,
}

/// A share as a percentage with one decimal, `n/a` when there is none.
fn percent(share: Option<f64>) -> String {
    share.map_or_else(|| "n/a".into(), |s| format!("{:.1}%", s * 100.0))
}

fn opt(v: Option<f64>, decimals: usize) -> String {
    v.map(|v| format!("{v:.decimals$}"))
        .unwrap_or_else(|| "-".into())
}

/// Bytes for people: MiB below a GiB, else GiB.
fn bytes(v: Option<u64>) -> String {
    match v {
        None => "-".into(),
        Some(b) if b < 1 << 30 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        Some(b) => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
    }
}

impl Report {
    /// The table for people: one line per request, then the notes.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "polystrata benchmark: {} ({}) on {}, context {}, engine pid {}, loaded in {:.1} s",
            self.model, self.arch, self.device, self.n_ctx, self.engine_pid, self.load_s
        );
        let _ = writeln!(
            out,
            "{} answer tokens per prompt, greedy{}; {} run(s); text {} tokens; speeds: server clock / engine clock (DONE)",
            self.answer_tokens,
            if self.ignore_eos { ", end tokens ignored" } else { "" },
            self.runs,
            self.text_tokens
        );
        let header = [
            "prompt",
            "run",
            "tokens",
            "cached",
            "TTFT ms",
            "prompt t/s",
            "answer t/s",
            "gen",
            "experts VRAM all / answer",
            "draft acc",
            "VRAM peak",
            "RAM peak",
            "GPU load",
            "CPU load",
        ];
        let rows: Vec<[String; 14]> = self
            .results
            .iter()
            .map(|r| {
                [
                    r.prompt.clone(),
                    r.run.to_string(),
                    if r.shortened {
                        format!("{}*", r.prompt_tokens)
                    } else {
                        r.prompt_tokens.to_string()
                    },
                    r.cached_tokens.to_string(),
                    format!("{:.1}", r.time_to_first_token_ms),
                    format!(
                        "{} / {}",
                        opt(r.server.prompt_tokens_per_s, 1),
                        opt(r.engine.prompt_tokens_per_s, 1)
                    ),
                    format!(
                        "{} / {}",
                        opt(r.server.answer_tokens_per_s, 1),
                        opt(r.engine.answer_tokens_per_s, 1)
                    ),
                    r.generated.to_string(),
                    format!(
                        "{} / {}",
                        percent(r.experts_vram_share),
                        percent(r.experts_vram_share_answer)
                    ),
                    percent(r.draft_acceptance),
                    bytes(r.vram_peak_bytes),
                    bytes(r.ram_peak_bytes),
                    r.gpu_load
                        .map(|l| format!("{:.0}%", l * 100.0))
                        .unwrap_or_else(|| "-".into()),
                    opt(r.cpu_load, 2),
                ]
            })
            .collect();
        let widths: Vec<usize> = (0..header.len())
            .map(|i| {
                rows.iter()
                    .map(|r| r[i].chars().count())
                    .chain([header[i].len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |cells: Vec<&str>| {
            cells
                .iter()
                .zip(&widths)
                .enumerate()
                .map(|(i, (c, w))| {
                    if i == 0 {
                        format!("{c:<w$}")
                    } else {
                        format!("{c:>w$}")
                    }
                })
                .collect::<Vec<_>>()
                .join("  ")
        };
        let _ = writeln!(out);
        let _ = writeln!(out, "{}", line(header.to_vec()));
        for r in &rows {
            let _ = writeln!(out, "{}", line(r.iter().map(String::as_str).collect()));
        }
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "CPU load: the engine's CPU time over wall time (1.00 = one core busy); GPU load: nvidia-smi utilization; * sent again shorter"
        );
        for n in &self.notes {
            let _ = writeln!(out, "note: {n}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_rates_count_tokens_read_and_answer_steps() {
        let c = Clock::new(500.0, 2000.0, 1000, 257);
        assert_eq!(c.prompt_tokens_per_s, Some(2000.0));
        assert_eq!(c.answer_tokens_per_s, Some(128.0));
        let none = Clock::new(0.0, 0.0, 0, 1);
        assert_eq!(none.prompt_tokens_per_s, None);
        assert_eq!(none.answer_tokens_per_s, None);
    }
}
