//! `GET /metrics` in Prometheus' text format: llama-server's `llamacpp:*` figures under their names
//! (tokens, the engine's time for them and the rates they make, requests running and waiting), and
//! polystrata's own (requests by outcome, the model in use, the share of expert uses served from VRAM,
//! the engine's memory, guessed tokens).

use super::body::{bytes_response, RespBody};
use super::AppState;
use bytes::Bytes;
use hyper::{Response, StatusCode};
use std::fmt::Write;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How long `/metrics` waits for an idle engine's STATS (memory figures); a scrape must not hang on a
/// stuck engine, which `/health` reports.
const STATS_WAIT: Duration = Duration::from_millis(500);

/// The text being written: one `# HELP`, `# TYPE` and sample per metric.
struct Exposition(String);

impl Exposition {
    fn metric(&mut self, name: &str, kind: &str, help: &str, value: f64) {
        self.labelled(name, kind, help, &[("", value)]);
    }

    /// A metric with one sample per `(labels, value)`; `labels` is written as is inside `{}`.
    fn labelled(&mut self, name: &str, kind: &str, help: &str, samples: &[(&str, f64)]) {
        let _ = writeln!(self.0, "# HELP {name} {help}");
        let _ = writeln!(self.0, "# TYPE {name} {kind}");
        for (labels, value) in samples {
            if labels.is_empty() {
                let _ = writeln!(self.0, "{name} {value}");
            } else {
                let _ = writeln!(self.0, "{name}{{{labels}}} {value}");
            }
        }
    }
}

/// A label value with Prometheus' escapes (backslash, quote, newline).
fn label_value(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn rate(n: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        n as f64 / seconds
    } else {
        0.0
    }
}

pub async fn metrics(state: &AppState) -> Response<RespBody> {
    let sup = &state.supervisor;
    let t = sup.telemetry().totals();
    let (running, waiting) = sup.queue();
    let c = sup.counters();
    let mut out = Exposition(String::new());
    out.metric(
        "llamacpp:prompt_tokens_total",
        "counter",
        "Prompt tokens read by the engine (cached ones left out).",
        t.prompt_tokens as f64,
    );
    out.metric(
        "llamacpp:prompt_seconds_total",
        "counter",
        "The engine's time reading prompts.",
        t.prompt_seconds,
    );
    out.metric(
        "llamacpp:tokens_predicted_total",
        "counter",
        "Answer tokens written.",
        t.predicted_tokens as f64,
    );
    out.metric(
        "llamacpp:tokens_predicted_seconds_total",
        "counter",
        "The engine's time writing answers.",
        t.predicted_seconds,
    );
    out.metric(
        "llamacpp:prompt_tokens_seconds",
        "gauge",
        "Prompt tokens read per second, over every request so far.",
        rate(t.prompt_tokens, t.prompt_seconds),
    );
    out.metric(
        "llamacpp:predicted_tokens_seconds",
        "gauge",
        "Answer tokens written per second, over every request so far.",
        rate(t.predicted_tokens, t.predicted_seconds),
    );
    out.metric(
        "llamacpp:requests_processing",
        "gauge",
        "Requests holding the engine now.",
        running as f64,
    );
    out.metric(
        "llamacpp:requests_deferred",
        "gauge",
        "Requests waiting for the engine.",
        waiting as f64,
    );
    out.metric(
        "polystrata_parallel_slots",
        "gauge",
        "Requests that may run at once (--parallel).",
        sup.parallel() as f64,
    );
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed) as f64;
    out.labelled(
        "polystrata_requests_total",
        "counter",
        "Generations by how they ended.",
        &[
            ("outcome=\"completed\"", load(&c.completed)),
            ("outcome=\"cancelled\"", load(&c.cancelled)),
            ("outcome=\"failed\"", load(&c.failed)),
            ("outcome=\"refused_busy\"", load(&c.refused_busy)),
        ],
    );
    out.metric(
        "polystrata_prompt_cached_tokens_total",
        "counter",
        "Prompt tokens served from a kept conversation state.",
        t.cached_tokens as f64,
    );
    out.metric(
        "polystrata_draft_tokens_proposed_total",
        "counter",
        "Tokens a draft model proposed.",
        t.draft_proposed as f64,
    );
    out.metric(
        "polystrata_draft_tokens_accepted_total",
        "counter",
        "Proposed tokens that were kept.",
        t.draft_accepted as f64,
    );
    let current = sup.current();
    if let Some(model) = &current.model {
        let labels = format!("model=\"{}\"", label_value(model));
        out.labelled(
            "polystrata_model_loaded",
            "gauge",
            "1 while the model in use has its engine up, else 0.",
            &[(&labels, f64::from(u8::from(current.loaded)))],
        );
    }
    if let Some(ready) = sup.ready() {
        if ready.experts_total > 0 {
            out.metric(
                "polystrata_experts_total",
                "gauge",
                "Routed experts of the model in use (layers x experts).",
                ready.experts_total as f64,
            );
            out.metric(
                "polystrata_experts_vram",
                "gauge",
                "Of those, the experts kept in VRAM.",
                ready.experts_vram as f64,
            );
        }
    }
    if let Some(share) = t.experts_vram_share {
        out.metric(
            "polystrata_experts_vram_share",
            "gauge",
            "The last request's share of expert uses served from VRAM (the expert cache's hit share).",
            share,
        );
    }
    if let Some(rss) = current.rss_bytes {
        out.metric(
            "polystrata_engine_rss_bytes",
            "gauge",
            "The engine process's resident memory.",
            rss as f64,
        );
    }
    // VRAM only where the engine reports it (STATS, asked only while the engine is idle).
    if let Some(vram) = sup
        .idle_engine_stats(STATS_WAIT)
        .await
        .and_then(|s| s.vram_bytes)
    {
        out.metric(
            "polystrata_engine_vram_bytes",
            "gauge",
            "VRAM the engine holds.",
            vram as f64,
        );
    }
    let mut resp = bytes_response(
        StatusCode::OK,
        "text/plain; version=0.0.4; charset=utf-8",
        Bytes::from(out.0),
    );
    // A scrape is never cached.
    resp.headers_mut().insert(
        hyper::header::CACHE_CONTROL,
        hyper::header::HeaderValue::from_static("no-cache"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_lines() {
        let mut e = Exposition(String::new());
        e.metric("a_total", "counter", "A.", 3.0);
        e.labelled("b", "gauge", "B.", &[("x=\"1\"", 0.5)]);
        assert_eq!(
            e.0,
            "# HELP a_total A.\n# TYPE a_total counter\na_total 3\n# HELP b B.\n# TYPE b gauge\nb{x=\"1\"} 0.5\n"
        );
        assert_eq!(label_value("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
        assert_eq!(rate(10, 0.0), 0.0);
    }
}
