//! `polystrata benchmark --model NAME`: how fast a model reads prompts and writes answers through the
//! server's own path: the registry's run config, the [`Supervisor`] that starts and leases the engine, the
//! engine child and its protocol (the same code `polystrata serve` runs for every HTTP request, less the
//! HTTP and the text of the answer). It does not use a running server: it starts the model's engine
//! itself and stops it at the end.
//!
//! For each run, a short prompt then long ones (2,000 and 8,000 tokens unless `--prompt-tokens` says
//! otherwise, cut from [`prompts::BENCH_TEXT`]), each with `--answer-tokens` (256) answer tokens, greedy,
//! end tokens ignored (an empty `stop_tokens`). A prompt the engine refuses as longer than its context
//! is sent again cut to fit, and the report says so. For each request: time to first token, prompt and
//! answer tokens/s on the server's clock and on the engine's (DONE's `prefill_ms` / `decode_ms`), DONE's
//! expert and draft figures, and from outside the engine ([`probe`]) its peak VRAM and RAM and the mean
//! GPU and CPU load.
//!
//! - [`concurrent`]: `--concurrent N`, answers per second with N chats at once;
//! - [`prompts`]: the text and the prompts cut from it;
//! - [`probe`]: `/proc` and `nvidia-smi` readings around a request;
//! - [`report`]: the results, as JSON or a table.

pub mod concurrent;
pub mod probe;
pub mod prompts;
pub mod report;

use crate::engine::process::{EngineEvent, EngineProcess};
use crate::engine::supervisor::{Limits, ServeError, Supervisor};
use crate::registry::Registry;
use poly_protocol::{Done, ErrorCode, Gen};
use probe::RequestProbe;
use prompts::{Prompt, PromptSource};
use report::{Clock, Report, RequestResult};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The long prompts' lengths by default, in tokens.
pub const DEFAULT_LONG_PROMPTS: [usize; 2] = [2000, 8000];

/// Characters of each answer kept in the report.
const ANSWER_START_CHARS: usize = 160;

/// What `polystrata benchmark` was asked.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// A registry name (id, alias or unique part of an id).
    pub model: String,
    /// The long prompts' lengths in tokens (the short prompt always runs first).
    pub long_prompts: Vec<usize>,
    pub runs: usize,
    pub answer_tokens: u32,
    pub json: bool,
    /// How long the engine may take to load.
    pub ready_timeout: Duration,
}

/// Parses `--prompt-tokens N,M,...` (each at least 1).
pub fn parse_prompt_tokens(s: &str) -> Result<Vec<usize>, String> {
    let lengths = s
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| match p.parse::<usize>() {
            Ok(n) if n >= 1 => Ok(n),
            _ => Err(format!("`{p}` is not a prompt length (a whole number ≥ 1)")),
        })
        .collect::<Result<Vec<_>, _>>()?;
    if lengths.is_empty() {
        return Err("give at least one prompt length".into());
    }
    Ok(lengths)
}

/// Runs the benchmark and prints its report (a table, or one JSON object with `json`) on stdout.
pub fn run(registry: Arc<Registry>, opts: BenchOptions) -> ExitCode {
    let Some(runtime) = crate::runtime() else {
        return ExitCode::FAILURE;
    };
    let outcome = runtime.block_on(async {
        let limits = Limits {
            ready_timeout: opts.ready_timeout,
            ..Limits::default()
        };
        let supervisor = Supervisor::new(registry, limits);
        let outcome = measure(&supervisor, &opts).await;
        supervisor.shutdown(Duration::from_secs(5)).await;
        outcome
    });
    match outcome {
        Ok(report) => {
            let text = if opts.json {
                match serde_json::to_string_pretty(&report) {
                    Ok(j) => j + "\n",
                    Err(e) => {
                        eprintln!("polystrata: cannot write the report: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            } else {
                report.table()
            };
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("polystrata benchmark: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Starts the model's engine, runs every prompt of every run, and gathers the report.
pub async fn measure(supervisor: &Supervisor, opts: &BenchOptions) -> Result<Report, String> {
    if opts.runs == 0 || opts.answer_tokens == 0 {
        return Err("--runs and --answer-tokens must be at least 1".into());
    }
    // Before the engine starts: the card's memory in use without it.
    let card_baseline = probe::card_memory_used_mib();
    let loading = Instant::now();
    supervisor.switch(&opts.model).await.map_err(|e| match e {
        // Say which home was read: a model installed into another home is otherwise a mystery.
        ServeError::ModelNotFound(m) => {
            format!("{m}; {}", crate::home::home_read_note(supervisor.home()))
        }
        other => other.message().to_string(),
    })?;
    let load_s = loading.elapsed().as_secs_f64();
    // One lease for the whole benchmark: nothing else can use the engine in between.
    let lease = supervisor
        .lease(Some(&opts.model))
        .await
        .map_err(|e| e.message().to_string())?;
    let engine = lease.engine();
    let ready = engine.ready().clone();
    let text = lease.text();
    let mut source = PromptSource::new(&text, ready.bos)?;
    let mut bench = Bench {
        supervisor,
        engine,
        answer_tokens: opts.answer_tokens,
        n_ctx: ready.n_ctx,
        gpu: probe::cuda_ordinal(&ready.device),
        card_baseline_mib: None,
        notes: Vec::new(),
    };
    bench.card_baseline_mib = bench.gpu.and_then(|g| card_baseline.get(g).copied());
    let mut results = Vec::new();
    for run in 1..=opts.runs {
        // Runs outside, prompts inside: no request follows one with the same start.
        let mut prompts = vec![source.short()];
        prompts.extend(opts.long_prompts.iter().map(|&n| source.long(n, n)));
        for prompt in prompts {
            results.push(bench.request(prompt, run, &text).await?);
        }
    }
    if results.iter().any(|r| r.ram_peak_scope == "process") {
        bench.notes.push(
            "the kernel would not reset the engine's peak RSS (/proc/<pid>/clear_refs): RAM peaks count from the engine's start".into(),
        );
    }
    if bench.gpu.is_some() && results.iter().all(|r| r.gpu_samples == 0) {
        bench
            .notes
            .push("nvidia-smi gave no samples: GPU load and VRAM are unknown".into());
    }
    Ok(Report {
        model: lease.model().id.clone(),
        arch: ready.arch.clone(),
        device: ready.device.clone(),
        n_ctx: ready.n_ctx,
        engine_pid: engine.pid(),
        load_s,
        experts_total: ready.experts_total,
        experts_vram: ready.experts_vram,
        answer_tokens: opts.answer_tokens,
        runs: opts.runs,
        ignore_eos: true,
        text_tokens: source.text_tokens(),
        results,
        notes: bench.notes,
    })
}

/// The benchmark's hold on the engine while it sends requests.
struct Bench<'a> {
    supervisor: &'a Supervisor,
    engine: &'a EngineProcess,
    answer_tokens: u32,
    n_ctx: u32,
    /// The card the engine runs on.
    gpu: Option<usize>,
    /// The card's memory in use before the engine started (MiB).
    card_baseline_mib: Option<u64>,
    notes: Vec<String>,
}

/// What came back for one request.
struct Answer {
    /// From sending to the first and to the last answer token's arrival.
    first_token: Duration,
    last_token: Duration,
    tokens: Vec<u32>,
    done: Done,
}

/// Why a request got no answer: the engine's refusal (its code) or its death (no code).
struct Refusal {
    code: Option<ErrorCode>,
    message: String,
}

impl Bench<'_> {
    /// Sends `prompt` (again, shorter, if the engine refuses it as longer than its context) and measures.
    async fn request(
        &mut self,
        prompt: Prompt,
        run: usize,
        text: &crate::model_text::ModelText,
    ) -> Result<RequestResult, String> {
        let asked = prompt.tokens.len();
        let mut tokens = prompt.tokens;
        let mut shortened = false;
        let (answer, readings) = loop {
            let probe = RequestProbe::start(self.engine.pid(), self.gpu);
            match self.send(tokens.clone()).await {
                Ok(answer) => break (answer, probe.finish()),
                Err(Refusal {
                    code: Some(ErrorCode::ContextOverflow),
                    message,
                }) if !shortened => {
                    let _ = probe.finish();
                    let fit = self.n_ctx.saturating_sub(self.answer_tokens) as usize;
                    if fit == 0 || fit >= tokens.len() {
                        return Err(format!(
                            "{} run {run}: the engine refused the prompt ({message}) and a context of {} cannot hold it with {} answer tokens",
                            prompt.name, self.n_ctx, self.answer_tokens
                        ));
                    }
                    self.notes.push(format!(
                        "{} run {run}: the server refused {asked} prompt tokens as longer than the context ({message}); sent again with {fit}",
                        prompt.name
                    ));
                    tokens.truncate(fit);
                    shortened = true;
                }
                Err(r) => return Err(format!("{} run {run}: {}", prompt.name, r.message)),
            }
        };
        let done = &answer.done;
        let read = done.prompt_tokens.saturating_sub(done.cached_tokens);
        let server = Clock::new(
            ms(answer.first_token),
            ms(answer.last_token.saturating_sub(answer.first_token)),
            read,
            done.generated,
        );
        let engine = Clock::new(done.prefill_ms, done.decode_ms, read, done.generated);
        let stats = self.engine.stats(Duration::from_secs(10)).await;
        let (vram_peak_bytes, vram_source) = self.vram(stats.as_ref(), &readings);
        let ram_peak_bytes = stats
            .as_ref()
            .and_then(|s| s.extra.get("rss_peak_bytes"))
            .and_then(|v| v.as_u64())
            .or(readings.ram_peak_bytes);
        // The answer's text, through the decoder the HTTP answers use.
        let mut decoder = text.decoder();
        let mut answer_text: String = answer.tokens.iter().map(|&t| decoder.push(t)).collect();
        answer_text.push_str(&decoder.finish());
        Ok(RequestResult {
            prompt: prompt.name,
            run,
            prompt_tokens_asked: asked as u32,
            prompt_tokens: done.prompt_tokens,
            shortened,
            cached_tokens: done.cached_tokens,
            generated: done.generated,
            answer_tokens_asked: self.answer_tokens,
            reason: serde_json::to_value(done.reason)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default(),
            time_to_first_token_ms: ms(answer.first_token),
            server,
            engine,
            experts_vram_share: done.experts_vram_share,
            experts_vram_share_answer: done.experts_vram_share_answer,
            draft_proposed: done.draft_proposed,
            draft_accepted: done.draft_accepted,
            draft_acceptance: (done.draft_proposed > 0)
                .then(|| done.draft_accepted as f64 / done.draft_proposed as f64),
            vram_peak_bytes,
            vram_source,
            ram_peak_bytes,
            ram_peak_scope: if readings.ram_peak_reset {
                "request"
            } else {
                "process"
            }
            .into(),
            gpu_load: readings.gpu_load,
            gpu_samples: readings.gpu_samples,
            cpu_load: readings.cpu_load,
            wall_ms: readings.wall_s * 1e3,
            answer_start: answer_text.chars().take(ANSWER_START_CHARS).collect(),
        })
    }

    /// The engine's VRAM at its highest and where the figure comes from, as nvidia-smi sees it: the
    /// card's sampled peak less what was in use before the engine started (the CUDA context, scratch and
    /// caches included: what a budget is about), else the driver's count for its process at the end,
    /// else the engine's STATS (its weights only: a lower bound). Nothing on the CPU.
    fn vram(
        &self,
        stats: Option<&poly_protocol::Stats>,
        readings: &probe::Readings,
    ) -> (Option<u64>, Option<String>) {
        if self.gpu.is_none() {
            return (None, None);
        }
        if let (Some(peak), Some(base)) = (readings.card_memory_peak_mib, self.card_baseline_mib) {
            return (
                Some(peak.saturating_sub(base) << 20),
                Some("nvidia-smi card".into()),
            );
        }
        if let Some(v) = probe::process_vram_bytes(self.engine.pid()) {
            return (Some(v), Some("nvidia-smi pid".into()));
        }
        match stats.and_then(|s| s.vram_bytes) {
            Some(v) => (Some(v), Some("stats (weights only)".into())),
            None => (None, None),
        }
    }

    /// One GEN: greedy, `answer_tokens` long, end tokens ignored; the answer's arrival times and DONE.
    async fn send(&self, tokens: Vec<u32>) -> Result<Answer, Refusal> {
        let gen = Gen {
            id: self.supervisor.next_request_id(),
            tokens,
            max_tokens: Some(self.answer_tokens),
            temperature: Some(0.0),
            // No end token stops the answer: every request writes the same number of tokens.
            stop_tokens: Some(Vec::new()),
            ..Gen::default()
        };
        let sent = Instant::now();
        let mut events = self.engine.generate(gen).map_err(|message| Refusal {
            code: None,
            message,
        })?;
        let mut first_token = None;
        let mut last_token = Duration::ZERO;
        let mut answer = Vec::new();
        while let Some(event) = events.recv().await {
            match event {
                EngineEvent::Tokens(t) => {
                    let now = sent.elapsed();
                    first_token.get_or_insert(now);
                    last_token = now;
                    answer.extend(t.tokens);
                }
                EngineEvent::Done(done) => {
                    return Ok(Answer {
                        first_token: first_token.unwrap_or(last_token),
                        last_token,
                        tokens: answer,
                        done,
                    })
                }
                EngineEvent::Refused(e) => {
                    return Err(Refusal {
                        code: Some(e.code),
                        message: e.message,
                    })
                }
                EngineEvent::Died(message) => {
                    return Err(Refusal {
                        code: None,
                        message,
                    })
                }
            }
        }
        Err(Refusal {
            code: None,
            message: "the engine dropped the request".into(),
        })
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_lengths() {
        assert_eq!(parse_prompt_tokens("20,60"), Ok(vec![20, 60]));
        assert_eq!(parse_prompt_tokens(" 512 "), Ok(vec![512]));
        assert!(parse_prompt_tokens("0").is_err());
        assert!(parse_prompt_tokens("2k").is_err());
        assert!(parse_prompt_tokens(",").is_err());
    }
}
