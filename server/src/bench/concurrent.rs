//! `polystrata benchmark --model NAME --concurrent N`: answers per second with N chats at once, through the
//! server's own path (the registry's run config, the [`Supervisor`] started with `--parallel`, its places
//! and queue, the engine child and its protocol), less the HTTP. N clients each send `--chats` requests
//! one after the other: a prompt of `--prompt-tokens` tokens cut from the benchmark text (no two alike,
//! so none resumes another's state) and `--answer-tokens` answer tokens, greedy, end tokens ignored. A
//! request's latency counts from the client's send, its wait for a place included.

use super::prompts::PromptSource;
use crate::engine::process::EngineEvent;
use crate::engine::supervisor::{Limits, Supervisor};
use crate::registry::Registry;
use poly_protocol::Gen;
use serde::Serialize;
use std::fmt::Write as _;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What `polystrata benchmark --concurrent N` was asked.
#[derive(Clone, Debug)]
pub struct ConcurrentOptions {
    pub model: String,
    /// Clients sending at once.
    pub clients: usize,
    /// Places for requests running at once (the server's `--parallel`; by default `clients`).
    pub parallel: usize,
    /// Requests each client sends, one after the other.
    pub chats: usize,
    pub prompt_tokens: usize,
    pub answer_tokens: u32,
    pub json: bool,
    pub ready_timeout: Duration,
}

/// One request as its client saw it.
#[derive(Clone, Debug, Serialize)]
pub struct ChatResult {
    pub client: usize,
    /// From the send to the first answer token, and to the DONE (ms).
    pub first_token_ms: f64,
    pub latency_ms: f64,
    pub generated: u32,
}

/// The measurement.
#[derive(Clone, Debug, Serialize)]
pub struct ConcurrentReport {
    pub model: String,
    pub device: String,
    pub clients: usize,
    pub parallel: usize,
    pub chats: usize,
    pub prompt_tokens: usize,
    pub answer_tokens: u32,
    /// From the first send to the last DONE.
    pub wall_s: f64,
    pub answers_per_s: f64,
    /// Answer tokens of every request over the wall time.
    pub answer_tokens_per_s: f64,
    pub mean_latency_ms: f64,
    pub max_latency_ms: f64,
    pub mean_first_token_ms: f64,
    pub results: Vec<ChatResult>,
}

impl ConcurrentReport {
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{} on {}: {} clients, --parallel {}, {} requests of {} prompt and {} answer tokens",
            self.model,
            self.device,
            self.clients,
            self.parallel,
            self.results.len(),
            self.prompt_tokens,
            self.answer_tokens
        );
        let _ = writeln!(
            out,
            "answers/s {:.3}  answer tokens/s {:.1}  latency mean {:.0} ms, max {:.0} ms  first token mean {:.0} ms  wall {:.2} s",
            self.answers_per_s,
            self.answer_tokens_per_s,
            self.mean_latency_ms,
            self.max_latency_ms,
            self.mean_first_token_ms,
            self.wall_s
        );
        out
    }
}

/// Runs the measurement and prints its report (a line, or one JSON object with `json`) on stdout.
pub fn run(registry: Arc<Registry>, opts: ConcurrentOptions) -> ExitCode {
    let Some(runtime) = crate::runtime() else {
        return ExitCode::FAILURE;
    };
    let outcome = runtime.block_on(async {
        let limits = Limits {
            ready_timeout: opts.ready_timeout,
            parallel: opts.parallel,
            ..Limits::default()
        };
        let supervisor = Arc::new(Supervisor::new(registry, limits));
        let outcome = measure(&supervisor, &opts).await;
        supervisor.shutdown(Duration::from_secs(5)).await;
        outcome
    });
    match outcome {
        Ok(report) => {
            if opts.json {
                match serde_json::to_string_pretty(&report) {
                    Ok(j) => println!("{j}"),
                    Err(e) => {
                        eprintln!("polystrata: cannot write the report: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            } else {
                print!("{}", report.table());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("polystrata benchmark: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Starts the model's engine, runs every client's requests at once, and gathers the report.
pub async fn measure(
    supervisor: &Arc<Supervisor>,
    opts: &ConcurrentOptions,
) -> Result<ConcurrentReport, String> {
    if opts.clients == 0 || opts.chats == 0 || opts.answer_tokens == 0 || opts.prompt_tokens == 0 {
        return Err(
            "--concurrent, --chats, --prompt-tokens and --answer-tokens must be at least 1".into(),
        );
    }
    supervisor.switch(&opts.model).await.map_err(|e| match e {
        crate::engine::supervisor::ServeError::ModelNotFound(m) => {
            format!("{m}; {}", crate::home::home_read_note(supervisor.home()))
        }
        other => other.message().to_string(),
    })?;
    let (ready, text, model) = {
        let lease = supervisor
            .lease(Some(&opts.model))
            .await
            .map_err(|e| e.message().to_string())?;
        (
            lease.engine().ready().clone(),
            lease.text(),
            lease.model().id.clone(),
        )
    };
    if opts.prompt_tokens as u64 + u64::from(opts.answer_tokens) > u64::from(ready.n_ctx) {
        return Err(format!(
            "{} prompt and {} answer tokens do not fit in the context of {}",
            opts.prompt_tokens, opts.answer_tokens, ready.n_ctx
        ));
    }
    let mut source = PromptSource::new(&text, ready.bos)?;
    let started = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for client in 0..opts.clients {
        let prompts: Vec<Vec<u32>> = (0..opts.chats)
            .map(|_| source.long(opts.prompt_tokens, opts.prompt_tokens).tokens)
            .collect();
        let supervisor = supervisor.clone();
        let model = model.clone();
        let answer_tokens = opts.answer_tokens;
        clients.spawn(async move {
            let mut results = Vec::new();
            for tokens in prompts {
                results.push(chat(&supervisor, &model, client, tokens, answer_tokens).await?);
            }
            Ok::<_, String>(results)
        });
    }
    let mut results = Vec::new();
    while let Some(joined) = clients.join_next().await {
        results.extend(joined.map_err(|e| format!("a client failed: {e}"))??);
    }
    let wall_s = started.elapsed().as_secs_f64();
    let n = results.len().max(1) as f64;
    let generated: u64 = results.iter().map(|r| u64::from(r.generated)).sum();
    Ok(ConcurrentReport {
        model,
        device: ready.device.clone(),
        clients: opts.clients,
        parallel: supervisor.parallel(),
        chats: opts.chats,
        prompt_tokens: opts.prompt_tokens,
        answer_tokens: opts.answer_tokens,
        wall_s,
        answers_per_s: results.len() as f64 / wall_s,
        answer_tokens_per_s: generated as f64 / wall_s,
        mean_latency_ms: results.iter().map(|r| r.latency_ms).sum::<f64>() / n,
        max_latency_ms: results.iter().map(|r| r.latency_ms).fold(0.0, f64::max),
        mean_first_token_ms: results.iter().map(|r| r.first_token_ms).sum::<f64>() / n,
        results,
    })
}

/// One request: waits for a place (a lease, as an HTTP request does), sends the GEN and reads its answer.
async fn chat(
    supervisor: &Supervisor,
    model: &str,
    client: usize,
    tokens: Vec<u32>,
    answer_tokens: u32,
) -> Result<ChatResult, String> {
    let sent = Instant::now();
    let lease = supervisor
        .lease(Some(model))
        .await
        .map_err(|e| e.message().to_string())?;
    let gen = Gen {
        id: supervisor.next_request_id(),
        tokens,
        max_tokens: Some(answer_tokens),
        temperature: Some(0.0),
        // No end token stops the answer: every request writes the same number of tokens.
        stop_tokens: Some(Vec::new()),
        ..Gen::default()
    };
    let mut events = lease.engine().generate(gen)?;
    let mut first_token = None;
    while let Some(event) = events.recv().await {
        match event {
            EngineEvent::Tokens(_) => {
                first_token.get_or_insert(sent.elapsed());
            }
            EngineEvent::Done(done) => {
                let latency = sent.elapsed();
                return Ok(ChatResult {
                    client,
                    first_token_ms: ms(first_token.unwrap_or(latency)),
                    latency_ms: ms(latency),
                    generated: done.generated,
                });
            }
            EngineEvent::Refused(e) => return Err(format!("the engine refused: {}", e.message)),
            EngineEvent::Died(message) => return Err(message),
        }
    }
    Err("the engine dropped the request".into())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
