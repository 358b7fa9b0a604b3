//! One GEN: checked when it arrives ([`Job::check`]: every error a request can carry is answered before
//! it waits), then run ([`Session::execute`]): resume from the kept state, read the rest of the prompt
//! (taking checkpoints), write tokens with `T` lines, looking at the input between tokens.
//!
//! Reading only the rest of a prompt after a kept prefix runs the same computation as reading it whole,
//! except that the prompt is split into forward calls at other places, and the CPU kernels' summation
//! order depends on how many rows a call has (one-row, four-row and tiled matrix products, per expert
//! the rows routed to it; tiled attention from 64 rows): sums round differently there. On the tiny
//! fixtures the greedy tokens agree and probabilities move by a few hundredths; replaying the same calls
//! gives the same numbers bit for bit (`engine/tests/serve_conversations.rs`).

use std::time::Instant;

use poly_models::arch::ModelInfo;
use poly_models::compute::Logits;
use poly_protocol::{Done, ErrorCode, FromEngine, Gen, Progress, StopReason, Tokens};

use super::repeats::Repeats;
use super::session::{Control, Session};
use super::store::Conversation;
use crate::model::EngineError;
use crate::sample::{Sampler, SamplerConfig, TopLogprobs};

/// A checked GEN, ready to run.
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    pub id: String,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    pub stop_tokens: Vec<u32>,
    pub top_logprobs: usize,
    pub conversation: Option<String>,
    /// A position of the prompt to keep a checkpoint at.
    pub checkpoint_at: Option<usize>,
}

impl Job {
    /// Checks `gen` against the model and the context; the error's code and message otherwise.
    pub fn check(gen: Gen, info: &ModelInfo, n_ctx: usize) -> Result<Job, (ErrorCode, String)> {
        let bad = |m: String| Err((ErrorCode::BadRequest, m));
        // The parser checked it already; checking again keeps a Gen built elsewhere honest.
        if let Err(e) = gen.check() {
            return bad(e.message);
        }
        let n_vocab = info.n_vocab;
        let outside = |t: &u32| *t as usize >= n_vocab;
        if let Some(t) = gen.tokens.iter().find(|t| outside(t)) {
            return bad(format!(
                "prompt token {t} is outside the vocabulary of {n_vocab}"
            ));
        }
        let stop_tokens = gen
            .stop_tokens
            .clone()
            .unwrap_or_else(|| info.stop_tokens());
        if let Some(t) = stop_tokens.iter().find(|t| outside(t)) {
            return bad(format!(
                "stop token {t} is outside the vocabulary of {n_vocab}"
            ));
        }
        let max_tokens = gen.max_tokens() as usize;
        let prompt_len = gen.tokens.len();
        if prompt_len.saturating_add(max_tokens) > n_ctx {
            return Err((
                ErrorCode::ContextOverflow,
                format!(
                    "{prompt_len} prompt tokens and up to {max_tokens} more do not fit in the context of {n_ctx}"
                ),
            ));
        }
        let top_logprobs = (gen.top_logprobs() as usize).min(n_vocab);
        let checkpoint_at = gen.checkpoint_at.map(|p| p as usize);
        if let Some(p) = checkpoint_at.filter(|&p| p > prompt_len) {
            return bad(format!(
                "checkpoint_at {p} lies beyond the prompt of {prompt_len} tokens"
            ));
        }
        let sampler = SamplerConfig {
            temperature: gen.temperature(),
            top_k: gen.top_k() as usize,
            top_p: gen.top_p(),
            min_p: gen.min_p(),
            min_keep: 0,
            repeat_penalty: gen.repeat_penalty(),
            presence_penalty: gen.presence_penalty(),
            frequency_penalty: gen.frequency_penalty(),
            penalty_last_n: gen.penalty_last_n() as usize,
            seed: gen.seed.unwrap_or_else(random_seed),
        };
        Ok(Job {
            id: gen.id,
            prompt: gen.tokens,
            max_tokens,
            sampler,
            stop_tokens,
            top_logprobs,
            conversation: gen.conversation,
            checkpoint_at,
        })
    }

    /// Whether a checkpoint belongs at prompt position `pos`: every `every` tokens and where asked.
    fn checkpoint_here(&self, pos: usize, every: usize) -> bool {
        (every > 0 && pos > 0 && pos.is_multiple_of(every)) || self.checkpoint_at == Some(pos)
    }

    /// The first position after `pos` where a checkpoint belongs, if before `end`.
    fn next_checkpoint(&self, pos: usize, end: usize, every: usize) -> Option<usize> {
        let periodic = (every > 0).then(|| (pos / every + 1) * every);
        let named = self.checkpoint_at.filter(|&p| p > pos);
        [periodic, named]
            .into_iter()
            .flatten()
            .filter(|&p| p < end)
            .min()
    }
}

/// How a run ended, if it was not a failure.
struct Finished {
    reason: StopReason,
    generated: usize,
    prefill_ms: f64,
    decode_ms: f64,
    /// Guessed tokens checked, and of those kept.
    draft_proposed: u64,
    draft_accepted: u64,
}

impl<W: std::io::Write> Session<'_, W> {
    /// Runs `job` on its conversation and keeps the result (published when it completes, handed back
    /// unchanged otherwise). The outer error is stdout or stdin failing; the inner one the DONE to send
    /// or the engine's failure.
    pub(super) fn execute(&mut self, job: &Job) -> std::io::Result<Result<Done, EngineError>> {
        let model = self.model;
        let n_ctx = self.n_ctx;
        let (mut conv, origin) = self
            .store
            .take(job.conversation.as_deref(), || model.new_state(n_ctx));
        let resume = conv.resume_point(&job.prompt);
        let undo = conv.rewind(resume);
        let cached = conv.state.n_past();
        self.in_flight = Some(poly_protocol::ConversationInfo {
            id: conv.id.clone().unwrap_or_default(),
            tokens: cached as u32,
            active: true,
            bytes: conv.bytes() as u64,
            checkpoints: conv.n_checkpoints() as u32,
        });
        let experts_before = model.expert_stats();
        let result = self.generate(&mut conv, job);
        let experts_after = model.expert_stats();
        let experts_vram_share = match (experts_before, experts_after) {
            (Some(a), Some(b)) if b.routed > a.routed => {
                Some((b.routed_vram - a.routed_vram) as f64 / (b.routed - a.routed) as f64)
            }
            _ => None,
        };
        // What `--tail-skip` / `--skip-weight` left out of this answer (absent when neither is set).
        let experts_left_out = match (experts_before, experts_after) {
            (Some(a), Some(b)) if b.skipped.steps > a.skipped.steps => {
                let d = b.skipped.since(&a.skipped);
                Some(poly_protocol::LeftOut {
                    experts: d.experts,
                    weight_share: d.mean_weight(),
                    bytes: d.bytes,
                })
            }
            _ => None,
        };
        if let Err(e) = model.save_expert_profile() {
            eprintln!("poly-engine: the expert profile was not saved: {e}");
        }
        let finished = match result {
            Ok(Ok(f)) if f.reason != StopReason::Cancel => {
                self.store.publish(conv, origin);
                Ok(f)
            }
            other => {
                undo.apply(&mut conv);
                self.store.put_back(conv, origin);
                other?
            }
        };
        Ok(finished.map(|f| Done {
            id: job.id.clone(),
            reason: f.reason,
            prompt_tokens: job.prompt.len() as u32,
            cached_tokens: cached as u32,
            generated: f.generated as u32,
            prefill_ms: f.prefill_ms,
            decode_ms: f.decode_ms,
            experts_vram_share,
            draft_proposed: f.draft_proposed as u32,
            draft_accepted: f.draft_accepted as u32,
            experts_left_out,
        }))
    }

    /// Tokens of the next forward call of a prompt with `remaining` tokens left to read: a long call
    /// while more than one ordinary call's worth remain, so the rest is never a long call's sliver.
    fn call_tokens(&self, remaining: usize) -> usize {
        if self.long_ubatch > 0 && remaining > self.ubatch {
            self.long_ubatch
        } else {
            self.ubatch
        }
    }

    /// Reads the prompt past what `conv` holds, then writes tokens.
    fn generate(
        &mut self,
        conv: &mut Conversation,
        job: &Job,
    ) -> std::io::Result<Result<Finished, EngineError>> {
        let model = self.model;
        let every = self.checkpoint_every;
        // KV caches are cut anywhere: only recurrent layers need checkpoints (and the reads split there).
        let recurrent = conv.state.has_recurrent();
        let cancelled = |generated, prefill_ms, decode_ms| {
            Ok(Ok(Finished {
                reason: StopReason::Cancel,
                generated,
                prefill_ms,
                decode_ms,
                draft_proposed: 0,
                draft_accepted: 0,
            }))
        };
        let started = Instant::now();
        let end = job.prompt.len();
        let mut pos = conv.state.n_past();
        let mut logits = Vec::new();
        if end > pos + self.call_tokens(end - pos) {
            if let Err(e) = model.expect_tokens(&mut conv.state, end - pos) {
                return Ok(Err(e));
            }
        }
        while pos < end {
            if recurrent && job.checkpoint_here(pos, every) {
                conv.add_checkpoint();
            }
            let next = recurrent
                .then(|| job.next_checkpoint(pos, end, every))
                .flatten()
                .unwrap_or(end)
                .min(pos + self.call_tokens(end - pos));
            let want = if next == end {
                Logits::Last
            } else {
                Logits::None
            };
            logits = match model.eval(&mut conv.state, &job.prompt[pos..next], want) {
                Ok(l) => l,
                Err(e) => return Ok(Err(e)),
            };
            pos = next;
            if pos < end {
                // A long read sends nothing else until its first token: this line tells the server the
                // engine is working, not stopped (its stall bound counts from the last line).
                self.send(&FromEngine::Progress(Progress {
                    id: job.id.clone(),
                    prompt_read: pos as u32,
                    prompt_tokens: end as u32,
                }))?;
                if self.poll()? == Control::Cancel {
                    return cancelled(0, ms(started), 0.0);
                }
            }
        }
        if recurrent && job.checkpoint_here(end, every) {
            conv.add_checkpoint();
        }
        let prefill_ms = ms(started);
        let decoding = Instant::now();
        let mut sampler = Sampler::new(job.sampler.clone());
        for &t in &job.prompt {
            sampler.accept(t);
        }
        let mut generated = 0usize;
        // Guesses from repeats where the state can be cut back and a call of a few rows is cheap.
        let mut repeats =
            (self.guesses && !model.on_gpu() && !conv.state.has_recurrent()).then(Repeats::default);
        // Guessed tokens in the state past the last written one, with the logits that follow each.
        let mut ahead: std::collections::VecDeque<(u32, Vec<f32>)> = Default::default();
        let n_vocab = model.info().n_vocab;
        let reason = loop {
            if generated >= job.max_tokens {
                break StopReason::Length;
            }
            let lp = TopLogprobs::new(&logits);
            let token = sampler.sample(&logits);
            sampler.accept(token);
            generated += 1;
            let top = (job.top_logprobs > 0).then(|| vec![lp.top(job.top_logprobs)]);
            self.send(&FromEngine::Tokens(Tokens {
                id: job.id.clone(),
                tokens: vec![token],
                logprobs: vec![lp.of(token)],
                top,
            }))?;
            if job.stop_tokens.contains(&token) {
                break StopReason::Stop;
            }
            if generated >= job.max_tokens || conv.state.room() == 0 {
                break StopReason::Length;
            }
            if self.poll()? == Control::Cancel {
                return cancelled(generated, prefill_ms, ms(decoding));
            }
            // The token was guessed: its logits were computed with the guess.
            if let Some((guess, row)) = ahead.pop_front() {
                if guess == token {
                    if let Some(r) = repeats.as_mut() {
                        r.kept_one();
                    }
                    logits = row;
                    continue;
                }
                if let Some(r) = repeats.as_mut() {
                    r.window_missed();
                }
                // The rest of the window follows a wrong guess.
                let kept = conv.state.n_past() - 1 - ahead.len();
                ahead.clear();
                conv.state.truncate(kept);
            }
            let guesses = match repeats.as_mut() {
                Some(r) => r.propose(
                    conv.state.tokens(),
                    token,
                    conv.state.room().saturating_sub(1),
                ),
                None => Vec::new(),
            };
            let mut call = vec![token];
            call.extend_from_slice(&guesses);
            let want = if guesses.is_empty() {
                Logits::Last
            } else {
                Logits::All
            };
            let rows = match model.eval(&mut conv.state, &call, want) {
                Ok(l) => l,
                Err(e) => return Ok(Err(e)),
            };
            if guesses.is_empty() {
                logits = rows;
            } else {
                let mut rows = rows.chunks_exact(n_vocab).map(<[f32]>::to_vec);
                logits = rows.next().unwrap_or_default();
                ahead.extend(guesses.into_iter().zip(rows));
                if let Some(r) = repeats.as_mut() {
                    r.window_started();
                }
            }
        };
        // Guesses past the last written token leave the state: it ends where an answer written token by
        // token ends (before its last token).
        if !ahead.is_empty() {
            let kept = conv.state.n_past() - ahead.len();
            conv.state.truncate(kept);
        }
        let (draft_proposed, draft_accepted) = repeats.map_or((0, 0), |r| (r.proposed, r.accepted));
        Ok(Ok(Finished {
            reason,
            generated,
            prefill_ms,
            decode_ms: ms(decoding),
            draft_proposed,
            draft_accepted,
        }))
    }
}

/// A seed of the engine's choosing (a request that names none): the process's random hash keys.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}
