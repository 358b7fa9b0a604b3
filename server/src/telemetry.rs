//! What the generations since the server started add up to (tokens, the time the engine took for them,
//! the share of expert uses served from VRAM, guessed tokens), for `/metrics`; and one generation's
//! figures as llama-server's `timings` object and as the server log's line per request.

use crate::generate::Finish;
use serde_json::{json, Value};
use std::sync::Mutex;

/// Totals over every generation that reached the engine's DONE.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Totals {
    /// Prompt tokens the engine read (cached ones left out).
    pub prompt_tokens: u64,
    /// Prompt tokens served from a kept state.
    pub cached_tokens: u64,
    /// The engine's prompt reading time (DONE's `prefill_ms`), in seconds.
    pub prompt_seconds: f64,
    pub predicted_tokens: u64,
    /// The engine's answer time (DONE's `decode_ms`), in seconds.
    pub predicted_seconds: f64,
    /// Generations that reached DONE.
    pub generations: u64,
    /// The last DONE's share of routed-expert uses served from VRAM (`None`: on the CPU, a dense model,
    /// or none yet).
    pub experts_vram_share: Option<f64>,
    pub draft_proposed: u64,
    pub draft_accepted: u64,
}

/// The totals, shared by every lease.
#[derive(Debug, Default)]
pub struct Telemetry {
    totals: Mutex<Totals>,
}

impl Telemetry {
    /// Adds one generation's DONE.
    pub fn record(&self, f: &Finish) {
        let mut t = self.totals.lock().unwrap_or_else(|p| p.into_inner());
        t.prompt_tokens += u64::from(f.prompt_tokens.saturating_sub(f.cached_tokens));
        t.cached_tokens += u64::from(f.cached_tokens);
        t.prompt_seconds += f.prefill_ms / 1000.0;
        t.predicted_tokens += u64::from(f.completion_tokens);
        t.predicted_seconds += f.decode_ms / 1000.0;
        t.generations += 1;
        if f.experts_vram_share.is_some() {
            t.experts_vram_share = f.experts_vram_share;
        }
        t.draft_proposed += u64::from(f.draft_proposed);
        t.draft_accepted += u64::from(f.draft_accepted);
    }

    pub fn totals(&self) -> Totals {
        self.totals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// Tokens per second, 0 when no time was spent (a rate of an empty interval is not infinite).
fn per_second(n: u32, ms: f64) -> f64 {
    if ms > 0.0 {
        f64::from(n) * 1000.0 / ms
    } else {
        0.0
    }
}

/// Milliseconds per token, 0 for no tokens.
fn per_token_ms(n: u32, ms: f64) -> f64 {
    if n > 0 {
        ms / f64::from(n)
    } else {
        0.0
    }
}

/// llama-server's `timings` of one answer: `cache_n`, `prompt_n` (tokens read, cached ones left out),
/// `prompt_ms`, `prompt_per_token_ms`, `prompt_per_second`, `predicted_n`, `predicted_ms`,
/// `predicted_per_token_ms`, `predicted_per_second`, and `draft_n` / `draft_n_accepted` when a draft
/// model proposed tokens (llama-server leaves them out otherwise); and `experts_vram_share` when the
/// engine reports it.
pub fn timings(f: &Finish) -> Value {
    let prompt_n = f.prompt_tokens.saturating_sub(f.cached_tokens);
    let mut t = json!({
        "cache_n": f.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": f.prefill_ms,
        "prompt_per_token_ms": per_token_ms(prompt_n, f.prefill_ms),
        "prompt_per_second": per_second(prompt_n, f.prefill_ms),
        "predicted_n": f.completion_tokens,
        "predicted_ms": f.decode_ms,
        "predicted_per_token_ms": per_token_ms(f.completion_tokens, f.decode_ms),
        "predicted_per_second": per_second(f.completion_tokens, f.decode_ms),
    });
    // Ours, beside llama-server's fields: the share of expert uses served from VRAM (the web page
    // shows it), where the engine reports one.
    if let Some(share) = f.experts_vram_share {
        t["experts_vram_share"] = json!(share);
    }
    if let Some(share) = f.experts_vram_share_answer {
        t["experts_vram_share_answer"] = json!(share);
    }
    if f.draft_proposed > 0 {
        t["draft_n"] = json!(f.draft_proposed);
        t["draft_n_accepted"] = json!(f.draft_accepted);
    }
    t
}

/// The server log's line for one finished request.
pub fn log_line(id: &str, model: &str, f: &Finish) -> String {
    let prompt_n = f.prompt_tokens.saturating_sub(f.cached_tokens);
    let experts = match (f.experts_vram_share, f.experts_vram_share_answer) {
        (Some(s), Some(a)) => format!("{:.1}% (answer {:.1}%)", s * 100.0, a * 100.0),
        (Some(s), None) => format!("{:.1}%", s * 100.0),
        _ => "n/a".into(),
    };
    let draft = if f.draft_proposed > 0 {
        format!(", draft {}/{} accepted", f.draft_accepted, f.draft_proposed)
    } else {
        String::new()
    };
    format!(
        "polystrata: request {id} model {model}: prompt {prompt_n} tokens ({} cached) in {:.1} ms ({:.1} t/s), \
         answer {} tokens in {:.1} ms ({:.1} t/s), {:?}, experts from VRAM {experts}{draft}",
        f.cached_tokens,
        f.prefill_ms,
        per_second(prompt_n, f.prefill_ms),
        f.completion_tokens,
        f.decode_ms,
        per_second(f.completion_tokens, f.decode_ms),
        f.reason,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::FinishReason;

    fn finish(draft: u32) -> Finish {
        Finish {
            reason: FinishReason::Length,
            prompt_tokens: 30,
            cached_tokens: 10,
            completion_tokens: 8,
            prefill_ms: 40.0,
            decode_ms: 16.0,
            experts_vram_share: Some(0.5),
            experts_vram_share_answer: Some(0.75),
            draft_proposed: draft,
            draft_accepted: draft / 2,
        }
    }

    #[test]
    fn timings_are_llama_servers() {
        let t = timings(&finish(0));
        assert_eq!(t["prompt_n"], 20);
        assert_eq!(t["cache_n"], 10);
        assert_eq!(t["prompt_per_second"], 500.0);
        assert_eq!(t["predicted_n"], 8);
        assert_eq!(t["predicted_per_second"], 500.0);
        assert_eq!(t["predicted_per_token_ms"], 2.0);
        assert!(
            t.get("draft_n").is_none(),
            "no draft fields without a draft"
        );
        let d = timings(&finish(6));
        assert_eq!(d["draft_n"], 6);
        assert_eq!(d["draft_n_accepted"], 3);
        let zero = Finish {
            decode_ms: 0.0,
            ..finish(0)
        };
        assert_eq!(timings(&zero)["predicted_per_second"], 0.0);
    }

    #[test]
    fn totals_add_up() {
        let t = Telemetry::default();
        t.record(&finish(4));
        t.record(&finish(0));
        let s = t.totals();
        assert_eq!(s.prompt_tokens, 40);
        assert_eq!(s.cached_tokens, 20);
        assert_eq!(s.predicted_tokens, 16);
        assert_eq!(s.generations, 2);
        assert_eq!(s.draft_proposed, 4);
        assert!((s.prompt_seconds - 0.08).abs() < 1e-9);
        assert_eq!(s.experts_vram_share, Some(0.5));
        let line = log_line("r1", "m", &finish(4));
        assert!(line.contains("draft 2/4 accepted"), "{line}");
        assert!(
            line.contains("experts from VRAM 50.0% (answer 75.0%)"),
            "{line}"
        );
        assert_eq!(timings(&finish(0))["experts_vram_share_answer"], 0.75);
    }
}
