//! One GEN: checked when it arrives ([`Job::check`]: every error a request can carry is answered before
//! it waits), then started ([`Session::start`]: resume from the kept state) and stepped
//! ([`Session::step`], one forward call at a time, so that up to `--parallel` requests take turns): read
//! the rest of the prompt (taking checkpoints), write tokens with `T` lines, looking at the input between
//! tokens.
//!
//! Reading only the rest of a prompt after a kept prefix runs the same computation as reading it whole,
//! except that the prompt is split into forward calls at other places, and the CPU kernels' summation
//! order depends on how many rows a call has (one-row, four-row and tiled matrix products, per expert
//! the rows routed to it; tiled attention from 64 rows): sums round differently there. On the tiny
//! fixtures the greedy tokens agree and probabilities move by a few hundredths; replaying the same calls
//! gives the same numbers bit for bit (`engine/tests/serve_conversations.rs`).

use std::collections::VecDeque;
use std::time::Instant;

use poly_models::arch::ModelInfo;
use poly_models::compute::Logits;
use poly_protocol::{
    ConversationInfo, Done, ErrorCode, FromEngine, Gen, Progress, StopReason, Tokens,
};

use super::pictures::{self, JobPicture};
use super::repeats::Repeats;
use super::session::{Control, Session};
use super::store::{Conversation, Origin, Undo};
use crate::gpu::expert_cache::CacheStats;
use crate::model::EngineError;
use crate::sample::{Sampler, SamplerConfig, TopLogprobs};
use crate::state::{Checkpoint, PictureMark, SeqState};
use poly_models::vision::VisionEncoder;

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
    /// The pictures read into `prompt` (widened: each picture's placeholder repeated once per row).
    pub pictures: Vec<JobPicture>,
}

impl Job {
    /// Checks `gen` against the model and the context; the error's code and message otherwise.
    /// Pictures are decoded and encoded here with `vision` (a bad one is refused before the request
    /// waits) and the prompt widened by their rows; `prompt_tokens` and the context count the rows.
    pub fn check(
        gen: Gen,
        info: &ModelInfo,
        n_ctx: usize,
        vision: Option<&VisionEncoder>,
        cache: &mut pictures::PictureCache,
    ) -> Result<Job, (ErrorCode, String)> {
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
        let widened = pictures::widen(&gen.tokens, &gen.pictures, vision, n_ctx, cache)?;
        let prompt_len = widened.tokens.len();
        // A server cannot know how many rows the pictures take (the projector decides), so it cannot
        // size max_tokens to the room left: with pictures, the answer is cut to the room instead of
        // refused, as long as the widened prompt leaves room for one token.
        let max_tokens = match widened.pictures.is_empty() {
            true => max_tokens,
            false => max_tokens.min(n_ctx.saturating_sub(prompt_len).max(1)),
        };
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
        if let Some(p) = checkpoint_at.filter(|&p| p > gen.tokens.len()) {
            return bad(format!(
                "checkpoint_at {p} lies beyond the prompt of {} tokens",
                gen.tokens.len()
            ));
        }
        // Named in the request's tokens; kept in the widened prompt's.
        let checkpoint_at = checkpoint_at.map(|p| widened.position(p));
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
            prompt: widened.tokens,
            pictures: widened.pictures,
            max_tokens,
            sampler,
            stop_tokens,
            top_logprobs,
            conversation: gen.conversation,
            checkpoint_at,
        })
    }

    /// Where its pictures are, as the kept states record them.
    fn picture_marks(&self) -> Vec<PictureMark> {
        self.pictures
            .iter()
            .map(|p| PictureMark {
                start: p.start,
                end: p.end,
                key: p.key,
            })
            .collect()
    }

    /// The picture whose rows start at prompt position `pos`, if one does.
    fn picture_at(&self, pos: usize) -> Option<&JobPicture> {
        self.pictures.iter().find(|p| p.start == pos)
    }

    /// Whether prompt position `pos` is a picture's row (not a token of text).
    fn in_picture(&self, pos: usize) -> bool {
        self.pictures.iter().any(|p| p.start <= pos && pos < p.end)
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

/// Where a running request is.
enum Phase {
    /// Reading its prompt; `pos` tokens of it are in the state.
    Prompt { pos: usize },
    /// Writing tokens: the logits of the next one are ready.
    Answer(Box<Answering>),
}

/// The writing side of a running request.
struct Answering {
    prefill_ms: f64,
    /// The expert cache's figures when the prompt was read, for the answer's own share of routings
    /// served from VRAM.
    experts_at_answer: Option<CacheStats>,
    decoding: Instant,
    sampler: Sampler,
    generated: usize,
    /// Guesses from repeats where the state can be cut back and a call of a few rows is cheap.
    repeats: Option<Repeats>,
    /// The draft model's state (`--draft`; [`super::draft`]) or the draft block's (`--draft-block on`;
    /// [`super::draft_block`]): the conversation's tokens, brought up to the kept ones before each window.
    draft_state: Option<SeqState>,
    /// Guessed tokens in the state past the last written one, with the logits that follow each.
    ahead: VecDeque<(u32, Vec<f32>)>,
    /// A state with recurrent layers, which cannot be cut back: where it stood at or before the start of
    /// the window in `ahead` (taken before a call that guesses). A wrong guess restores it and the call
    /// after reads again the tokens kept since ([`Answering::cut_back`]).
    window_start: Option<Checkpoint>,
    /// Rows at the head of `call` that read kept tokens again after a restore: their logits are known.
    replayed: usize,
    /// Seconds the draft model or draft block took to guess `call`'s guesses: counted with the call, so
    /// that guessing pauses when guesses and their drafting together write slower than no guesses.
    drafting: f64,
    /// The forward call the turn ends with, made by the session for every turn of a round together
    /// ([`Session::finish_turns`]): the token just written and the guesses that follow it. Empty when
    /// none is owed.
    call: Vec<u32>,
}

/// A request that has started: its conversation, out of the store until it ends, and how far it got.
/// [`Session::step`] advances it by one forward call (a part of its prompt, or one written token), so
/// that several can take turns.
pub(super) struct Running {
    pub(super) job: Job,
    conv: Conversation,
    origin: Origin,
    undo: Undo,
    /// Prompt tokens the kept state spared.
    cached: usize,
    /// The conversation as it was when the request started (STATS's `running_conversation`).
    pub(super) started_on: ConversationInfo,
    experts_before: Option<CacheStats>,
    started: Instant,
    /// The logits of the last row read.
    logits: Vec<f32>,
    phase: Phase,
    /// A CANCEL for it arrived while another request was stepping: it ends at its next step.
    pub(super) cancel_requested: bool,
}

/// What a step left: the request goes on, or its outcome (the DONE to send, or the engine's failure).
pub(super) enum Stepped {
    Going(Box<Running>),
    Ended(Result<Done, (String, EngineError)>),
}

impl<W: std::io::Write> Session<'_, W> {
    /// Starts `job` on its conversation: takes it out of the store (a conversation another running
    /// request holds is not there, so this one starts from a fresh state of the same name; the last to
    /// complete is kept) and goes back to where the prompt departs from it.
    pub(super) fn start(&mut self, job: Job) -> Stepped {
        let model = self.model;
        let n_ctx = self.n_ctx;
        let (mut conv, origin) = self
            .store
            .take(job.conversation.as_deref(), || model.new_state(n_ctx));
        // The draft block reads the trunk's hidden rows, the prompt's included.
        if self.guessing_by_draft_block() {
            conv.state.keep_hidden(true);
        }
        let resume = conv.resume_point(&job.prompt, &job.picture_marks());
        let undo = conv.rewind(resume);
        let cached = conv.state.n_past();
        let started_on = ConversationInfo {
            id: conv.id.clone().unwrap_or_default(),
            tokens: cached as u32,
            active: true,
            bytes: conv.bytes() as u64,
            checkpoints: conv.n_checkpoints() as u32,
        };
        let mut running = Running {
            experts_before: model.expert_stats(),
            started: Instant::now(),
            phase: Phase::Prompt { pos: cached },
            logits: Vec::new(),
            job,
            conv,
            origin,
            undo,
            cached,
            started_on,
            cancel_requested: false,
        };
        let end = running.job.prompt.len();
        if end > cached + self.call_tokens(end - cached) {
            if let Err(e) = model.expect_tokens(&mut running.conv.state, end - cached) {
                return self.end(running, Err(e));
            }
        }
        Stepped::Going(Box::new(running))
    }

    /// One forward call of `running` (the next part of its prompt, or the next token written) with the
    /// lines it sends, and a look at the input after it. The outer error is stdout or stdin failing.
    pub(super) fn step(&mut self, mut running: Box<Running>) -> std::io::Result<Stepped> {
        if running.cancel_requested {
            let cancelled = running.cancelled();
            return Ok(self.end(*running, Ok(cancelled)));
        }
        let result = match running.phase {
            Phase::Prompt { pos } => self.read_prompt(&mut running, pos)?,
            Phase::Answer(_) => self.write_token(&mut running)?,
        };
        Ok(match result {
            None => Stepped::Going(running),
            Some(outcome) => self.end(*running, outcome),
        })
    }

    /// Ends `running` as cancelled (QUIT, the end of input).
    pub(super) fn cancel(&mut self, running: Box<Running>) -> Stepped {
        let cancelled = running.cancelled();
        self.end(*running, Ok(cancelled))
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

    /// Reads the prompt's next forward call from `pos` (taking checkpoints); after the last one the
    /// request turns to writing. `Some` when it ended.
    fn read_prompt(
        &mut self,
        r: &mut Running,
        mut pos: usize,
    ) -> std::io::Result<Option<Result<Finished, EngineError>>> {
        let model = self.model;
        let every = self.checkpoint_every;
        let job = &r.job;
        let end = job.prompt.len();
        // KV caches are cut anywhere: only recurrent layers need checkpoints (and the reads split there).
        let recurrent = r.conv.state.has_recurrent();
        if pos < end {
            if recurrent && job.checkpoint_here(pos, every) {
                r.conv.add_checkpoint();
            }
            let next = recurrent
                .then(|| job.next_checkpoint(pos, end, every))
                .flatten()
                .unwrap_or(end)
                .min(pos + self.call_tokens(end - pos));
            let next = pictures::call_end(&job.pictures, pos, next);
            let want = if next == end {
                Logits::Last
            } else {
                Logits::None
            };
            let call = &job.prompt[pos..next];
            let read = match job.picture_at(pos) {
                Some(p) => model
                    .eval_picture(&mut r.conv.state, call, (0, &p.rows), want)
                    .inspect(|_| r.conv.state.key_last_picture(p.key)),
                None => model.eval(&mut r.conv.state, call, want),
            };
            r.logits = match read {
                Ok(l) => l,
                Err(e) => return Ok(Some(Err(e))),
            };
            // The draft block reads the prompt call by call, so its hidden rows stay one call's worth.
            if self.guessing_by_draft_block() {
                let conv = &mut r.conv;
                if conv.draft.is_none() {
                    conv.draft = model.new_draft_block_state(conv.state.n_ctx());
                }
                if let Some(block) = conv.draft.as_mut() {
                    if let Err(e) = super::draft_block::catch_up(model, block, &mut conv.state) {
                        // The answer makes a fresh one.
                        eprintln!("poly-engine: the draft block failed on the prompt ({e})");
                        conv.draft = None;
                    }
                }
            }
            pos = next;
            if pos < end {
                r.phase = Phase::Prompt { pos };
                // A long read sends nothing else until its first token: this line tells the server the
                // engine is working, not stopped (its stall bound counts from the last line).
                self.send(&FromEngine::Progress(Progress {
                    id: job.id.clone(),
                    prompt_read: pos as u32,
                    prompt_tokens: end as u32,
                }))?;
                if self.poll()? == Control::Cancel {
                    return Ok(Some(Ok(r.cancelled())));
                }
                return Ok(None);
            }
        }
        if recurrent && job.checkpoint_here(end, every) {
            r.conv.add_checkpoint();
        }
        let mut sampler = Sampler::new(job.sampler.clone());
        // A picture's rows are no tokens the answer could repeat (`run --image` leaves them out too).
        for (i, &t) in job.prompt.iter().enumerate() {
            if !job.in_picture(i) {
                sampler.accept(t);
            }
        }
        let guesses = self.guessing();
        r.phase = Phase::Answer(Box::new(Answering {
            prefill_ms: ms(r.started),
            experts_at_answer: self.model.expert_stats(),
            decoding: Instant::now(),
            sampler,
            generated: 0,
            repeats: guesses.then(|| Repeats::new(self.repeats_min_match)),
            // The conversation's own draft state where the last answer left one (brought up to the
            // kept tokens before the first window), else a fresh one.
            draft_state: match self.draft.filter(|_| guesses) {
                Some(d) => Some(
                    r.conv
                        .draft
                        .take()
                        .unwrap_or_else(|| d.new_state(r.conv.state.n_ctx())),
                ),
                None if self.guessing_by_draft_block() => r
                    .conv
                    .draft
                    .take()
                    .or_else(|| model.new_draft_block_state(r.conv.state.n_ctx())),
                None => None,
            },
            ahead: VecDeque::new(),
            window_start: None,
            replayed: 0,
            drafting: 0.0,
            call: Vec::new(),
        }));
        Ok(None)
    }

    /// Writes the next token (its `T` line), looks at the input, then takes the logits of the one after
    /// it from a kept guess, or leaves the forward call that computes them in `call` for
    /// [`Session::finish_turns`]. `Some` when it ended.
    fn write_token(
        &mut self,
        r: &mut Running,
    ) -> std::io::Result<Option<Result<Finished, EngineError>>> {
        let job = &r.job;
        let Phase::Answer(a) = &mut r.phase else {
            return Ok(None);
        };
        let conv = &mut r.conv;
        if a.generated >= job.max_tokens {
            return Ok(Some(Ok(a.finish(StopReason::Length, conv))));
        }
        let lp = TopLogprobs::new(&r.logits);
        let token = a.sampler.sample(&r.logits);
        a.sampler.accept(token);
        a.generated += 1;
        let top = (job.top_logprobs > 0).then(|| vec![lp.top(job.top_logprobs)]);
        self.send(&FromEngine::Tokens(Tokens {
            id: job.id.clone(),
            tokens: vec![token],
            logprobs: vec![lp.of(token)],
            top,
        }))?;
        if job.stop_tokens.contains(&token) {
            return Ok(Some(Ok(a.finish(StopReason::Stop, conv))));
        }
        if a.generated >= job.max_tokens || conv.state.room() == 0 {
            return Ok(Some(Ok(a.finish(StopReason::Length, conv))));
        }
        if self.poll()? == Control::Cancel {
            return Ok(Some(Ok(a.finish(StopReason::Cancel, conv))));
        }
        // The token was guessed: its logits were computed with the guess.
        if let Some((guess, row)) = a.ahead.pop_front() {
            if guess == token {
                if let Some(rep) = a.repeats.as_mut() {
                    rep.kept_one();
                    self.guess_rates.guess_kept();
                }
                r.logits = row;
                return Ok(None);
            }
            if let Some(rep) = a.repeats.as_mut() {
                rep.window_missed();
            }
            // The rest of the window follows a wrong guess.
            let kept = conv.state.n_past() - 1 - a.ahead.len();
            a.ahead.clear();
            match a.cut_back(conv, kept) {
                Some(again) => a.call = again,
                None => {
                    return Ok(Some(Err(EngineError(
                        "the state could not be taken back before a wrong guess".into(),
                    ))))
                }
            }
        }
        // Room for the kept tokens read again, the token and its guesses; guesses only while they
        // write faster than none.
        // Guesses past the answer's length would never be checked.
        let room = conv
            .state
            .room()
            .saturating_sub(1 + a.call.len())
            .min(job.max_tokens.saturating_sub(a.generated));
        let drafting = Instant::now();
        let guesses = match (a.repeats.as_mut(), a.draft_state.as_mut(), self.draft) {
            (Some(rep), Some(ds), Some(draft)) if self.guess_rates.allow() => {
                let n = match rep.ready() {
                    true => rep.window_len(self.guess_rates.row_cost()).min(room),
                    false => 0,
                };
                a.call.push(token);
                let kept = (conv.state.tokens(), a.call.as_slice());
                let g = super::draft::guesses(draft, ds, kept, n);
                a.call.pop();
                match g {
                    Ok(g) => rep.count_proposed(g),
                    Err(e) => {
                        // The answer goes on without the draft model.
                        eprintln!("poly-engine: the draft model failed ({e}); no more guesses");
                        a.draft_state = None;
                        Vec::new()
                    }
                }
            }
            (Some(rep), Some(block), None) => {
                // One guess a window, as llama.cpp's single MTP head drafts; none while kept tokens
                // wait to be read again after a restore (their hidden rows are not computed yet).
                let n = match self.guess_rates.allow() && rep.ready() && a.call.is_empty() {
                    true => rep.window_len(self.guess_rates.row_cost()).min(room),
                    false => 0,
                };
                let drafted = match n {
                    // Not guessing for a while: the draft block reads the rows kept meanwhile in
                    // calls of many, so they do not pile up.
                    0 if conv.state.hidden_rows_kept() >= super::draft_block::CATCH_UP_ROWS => {
                        super::draft_block::catch_up(self.model, block, &mut conv.state)
                            .map(|()| Vec::new())
                    }
                    0 => Ok(Vec::new()),
                    _ => super::draft_block::guesses(self.model, block, &mut conv.state, token)
                        .map(|g| rep.count_proposed(g)),
                };
                drafted.unwrap_or_else(|e| {
                    // The answer goes on without the draft block.
                    eprintln!("poly-engine: the draft block failed ({e}); no more guesses");
                    a.draft_state = None;
                    Vec::new()
                })
            }
            (Some(rep), None, None) if self.guess_rates.allow() => {
                let n = rep.window_len(self.guess_rates.row_cost()).min(room);
                rep.propose(conv.state.tokens(), token, n)
            }
            _ => Vec::new(),
        };
        if a.draft_state.is_some() {
            a.drafting = drafting.elapsed().as_secs_f64();
        }
        a.replayed = a.call.len();
        // Where a recurrent state goes back to should a guess be wrong: here, or where a restore left
        // it (the tokens read again since then are in the state's tokens once the call is made).
        if guesses.is_empty() {
            a.window_start = None;
        } else if a.replayed == 0 && conv.state.has_recurrent() {
            a.window_start = Some(conv.state.checkpoint());
        }
        a.call.push(token);
        a.call.extend_from_slice(&guesses);
        Ok(None)
    }

    /// The forward calls the round's turns left ([`Session::write_token`]), made together where the
    /// model can ([`Model::eval_many`]: one call for every state, the weights read once), each turn's
    /// rows then taken as its next logits and guesses. Returns the turns in the same order, those whose
    /// call failed ended.
    pub(super) fn finish_turns(&mut self, turns: VecDeque<Box<Running>>) -> Vec<Stepped> {
        let model = self.model;
        let n_vocab = model.info().n_vocab;
        let mut turns = turns;
        let (results, secs) = {
            let mut calls: Vec<(&mut crate::state::SeqState, &[u32])> =
                turns.iter_mut().filter_map(|r| r.owed_call()).collect();
            if calls.len() > 1 && calls.iter().all(|(s, _)| model.batches_states(s)) {
                self.calls_over_states += 1;
            }
            let clock = Instant::now();
            let results = model.eval_many(&mut calls);
            // Each turn's share of the call's time: what a token (or a window) cost it.
            let secs = clock.elapsed().as_secs_f64() / calls.len().max(1) as f64;
            (results, secs)
        };
        let mut results = results.into_iter();
        let mut out = Vec::with_capacity(turns.len());
        for mut r in turns {
            let failed = match &mut r.phase {
                Phase::Answer(a) if !a.call.is_empty() => {
                    let call = std::mem::take(&mut a.call);
                    let secs = secs + std::mem::take(&mut a.drafting);
                    match results.next() {
                        Some(Ok(rows)) if call.len() == 1 => {
                            r.logits = rows;
                            if a.repeats.is_some() {
                                self.guess_rates.plain_call(secs);
                            }
                            None
                        }
                        Some(Ok(rows)) => {
                            // The kept tokens read again come first: their logits were used.
                            let replayed = std::mem::take(&mut a.replayed);
                            let mut rows = rows
                                .chunks_exact(n_vocab)
                                .skip(replayed)
                                .map(<[f32]>::to_vec);
                            r.logits = rows.next().unwrap_or_default();
                            let guesses = &call[replayed + 1..];
                            a.ahead.extend(guesses.iter().copied().zip(rows));
                            if let Some(rep) = a.repeats.as_mut() {
                                if !guesses.is_empty() {
                                    rep.window_started(guesses.len());
                                }
                                self.guess_rates.guessing_call(secs, call.len());
                            }
                            None
                        }
                        Some(Err(e)) => Some(e),
                        None => Some(EngineError("no result for a forward call".into())),
                    }
                }
                _ => None,
            };
            out.push(match failed {
                None => Stepped::Going(r),
                Some(e) => self.end(*r, Err(e)),
            });
        }
        out
    }

    /// Ends `r`: keeps its conversation (published when it completed, handed back unchanged otherwise)
    /// and makes its DONE, or says how the engine failed.
    fn end(&mut self, r: Running, result: Result<Finished, EngineError>) -> Stepped {
        let model = self.model;
        let experts_at_answer = match &r.phase {
            Phase::Answer(a) => a.experts_at_answer,
            Phase::Prompt { .. } => None,
        };
        let Running {
            job,
            mut conv,
            origin,
            undo,
            cached,
            experts_before,
            ..
        } = r;
        let experts_after = model.expert_stats();
        // With several requests running the cache's figures between start and end are theirs together.
        let experts_vram_share = vram_share(experts_before, experts_after);
        let experts_vram_share_answer = vram_share(experts_at_answer, experts_after);
        // What `--tail-skip` / `--skip-weight` / `--cold-mass` left out of this answer (absent when none
        // is set).
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
        // The choices `--cache-bias` made in this answer (absent when it is off).
        let experts_swapped_in = match (experts_before, experts_after) {
            (Some(a), Some(b)) if b.swapped.steps > a.swapped.steps => {
                let d = b.swapped.since(&a.swapped);
                Some(poly_protocol::SwappedIn {
                    experts: d.experts,
                    weight_share: d.mean_weight(),
                })
            }
            _ => None,
        };
        if let Err(e) = model.save_expert_profile() {
            eprintln!("poly-engine: the expert profile was not saved: {e}");
        }
        let finished = match result {
            Ok(f) if f.reason != StopReason::Cancel => {
                self.store.publish(conv);
                f
            }
            other => {
                undo.apply(&mut conv);
                self.store.put_back(conv, origin);
                match other {
                    Ok(f) => f,
                    Err(e) => return Stepped::Ended(Err((job.id, e))),
                }
            }
        };
        Stepped::Ended(Ok(Done {
            id: job.id.clone(),
            reason: finished.reason,
            prompt_tokens: job.prompt.len() as u32,
            cached_tokens: cached as u32,
            generated: finished.generated as u32,
            prefill_ms: finished.prefill_ms,
            decode_ms: finished.decode_ms,
            experts_vram_share,
            experts_vram_share_answer,
            draft_proposed: finished.draft_proposed as u32,
            draft_accepted: finished.draft_accepted as u32,
            experts_left_out,
            experts_swapped_in,
        }))
    }
}

/// The share of routed-expert uses served from VRAM between two readings of the cache's figures (none
/// without a cache, or without a routing between them).
fn vram_share(before: Option<CacheStats>, after: Option<CacheStats>) -> Option<f64> {
    match (before, after) {
        (Some(a), Some(b)) if b.routed > a.routed => {
            Some((b.routed_vram - a.routed_vram) as f64 / (b.routed - a.routed) as f64)
        }
        _ => None,
    }
}

impl Running {
    /// The state and the tokens of the forward call its turn left, if it left one.
    fn owed_call(&mut self) -> Option<(&mut crate::state::SeqState, &[u32])> {
        match &self.phase {
            Phase::Answer(a) if !a.call.is_empty() => Some((&mut self.conv.state, &a.call)),
            _ => None,
        }
    }

    /// How it ends when cancelled now.
    fn cancelled(&self) -> Finished {
        let (generated, prefill_ms, decode_ms) = match &self.phase {
            Phase::Prompt { .. } => (0, ms(self.started), 0.0),
            Phase::Answer(a) => (a.generated, a.prefill_ms, ms(a.decoding)),
        };
        Finished {
            reason: StopReason::Cancel,
            generated,
            prefill_ms,
            decode_ms,
            draft_proposed: 0,
            draft_accepted: 0,
        }
    }
}

impl Answering {
    /// The answer ended for `reason`: guesses past the last written token leave the state, so it ends
    /// where an answer written token by token ends (before its last token).
    fn finish(&mut self, reason: StopReason, conv: &mut Conversation) -> Finished {
        if !self.ahead.is_empty() {
            let kept = conv.state.n_past() - self.ahead.len();
            self.ahead.clear();
            // A recurrent state goes back to the window's start: the kept tokens after it leave the
            // state too, and the conversation's next prompt reads them again. A state that cannot go
            // back is not kept at all (the next prompt is read whole).
            if self.cut_back(conv, kept).is_none() {
                conv.state.clear();
            }
        }
        // The draft model's (or draft block's) state goes with the conversation for its next answer.
        conv.draft = self.draft_state.take();
        let (draft_proposed, draft_accepted) = self
            .repeats
            .as_ref()
            .map_or((0, 0), |r| (r.proposed, r.accepted));
        Finished {
            reason,
            generated: self.generated,
            prefill_ms: self.prefill_ms,
            decode_ms: ms(self.decoding),
            draft_proposed,
            draft_accepted,
        }
    }
}

impl Answering {
    /// Takes the state back to its first `kept` tokens after a wrong guess: KV caches are cut there; a
    /// state with recurrent layers is restored to the window's start, and the kept tokens after it are
    /// returned, to be read again at the head of the next call (`replayed`). `None` when it cannot go
    /// back (no window start: a call that guesses on a recurrent state takes one first).
    fn cut_back(&mut self, conv: &mut Conversation, kept: usize) -> Option<Vec<u32>> {
        if conv.state.truncate(kept) {
            return Some(Vec::new());
        }
        let start = self.window_start.as_ref()?;
        let again = conv.state.tokens().get(start.n_past()..kept)?.to_vec();
        conv.state.restore(start).then_some(again)
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
