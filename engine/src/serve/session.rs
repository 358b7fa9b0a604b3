//! The serve loop: announces READY, then answers what the reader passes on. Up to `--parallel` GENs run at
//! once (one by default); others wait in a FIFO queue of [`QUEUE_DEPTH`] (beyond it: ERR `busy`). The
//! running ones take turns in rounds, in the order they started: in each round a request reads a part of
//! its prompt, or writes one token, so a short answer is not held up by a long one. The written tokens'
//! forward calls of a round are made together ([`Session::finish_turns`]): on the CPU in
//! batch-invariant arithmetic (recurrent layers too, each state's recurrence over its own rows), as one forward call over all their
//! states (the weights read once for every row, each row's result bit for bit its own call's); else one
//! after the other. While GENs run, the loop looks at its input after each turn ([`Session::poll`]) so
//! that CANCEL, STATS and QUIT take effect at once. QUIT and the end of stdin cancel what runs and waits,
//! then end the loop.

use std::collections::VecDeque;
use std::io::Write;
use std::path::Path;
use std::sync::mpsc::{Receiver, TryRecvError};

use poly_protocol::{
    ConversationInfo, Done, ErrorCode, ErrorReply, FromEngine, PromptCalls, Ready, Stats,
    StopReason, ToEngine,
};
use serde_json::json;

use super::input::Input;
use super::request::{Job, Running, Stepped};
use super::store::{Conversation, Store};
use super::{memory, send, ServeOptions, QUEUE_DEPTH};
use crate::model::Model;
use poly_models::vision::VisionEncoder;

/// Running totals for STATS.
#[derive(Debug, Default)]
struct Totals {
    requests: u64,
    cancelled: u64,
    failed: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
    generated: u64,
}

/// What the input said about the request that runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    Continue,
    /// Stop it (CANCEL of its id, QUIT, or the end of input).
    Cancel,
}

/// The serve loop's state.
pub struct Session<'a, W: Write> {
    pub(super) model: &'a Model,
    pub(super) n_ctx: usize,
    pub(super) checkpoint_every: usize,
    /// Most prompt tokens per forward call.
    pub(super) ubatch: usize,
    /// Tokens per forward call while more than `ubatch` of a prompt remain (0: `ubatch`).
    pub(super) long_ubatch: usize,
    /// Whether answers guess tokens from repeats where they can ([`super::repeats`]).
    pub(super) guesses: bool,
    /// Tokens that must repeat before their sequel is guessed ([`super::repeats::Repeats::new`]).
    pub(super) repeats_min_match: usize,
    /// Whether guessing pays, measured over the session's answers.
    pub(super) guess_rates: super::repeats::GuessRates,
    /// A draft model whose tokens are guessed instead of repeats (`--draft`).
    pub(super) draft: Option<&'a Model>,
    /// Whether the model's own draft block guesses instead of repeats (`--draft-block on`).
    pub(super) draft_block: bool,
    pub(super) store: Store,
    /// Most requests running at once (`--parallel`).
    parallel: usize,
    queue: VecDeque<Job>,
    /// The running requests yet to take their turn in this round, in order.
    active: VecDeque<Box<Running>>,
    /// Those that took it, in order, some owing the forward call that ends their turn.
    turned: VecDeque<Box<Running>>,
    inputs: Receiver<Input>,
    out: &'a mut W,
    /// The request taking its turn: its id, and the conversation it works on as it was when it started
    /// (out of the store meanwhile).
    stepping: Option<(String, ConversationInfo)>,
    quitting: bool,
    totals: Totals,
    /// Forward calls made over several requests' states at once (STATS's `calls_over_states`).
    pub(super) calls_over_states: u64,
    /// The placement's settings that differ from the defaults, echoed in READY with the knobs.
    placement_echo: Vec<(String, String)>,
    /// The projector that reads GENs' pictures (`--mmproj`) and its file, echoed in READY.
    pub(super) vision: Option<(&'a VisionEncoder<'a>, &'a Path)>,
    /// The pictures encoded last, kept for the next turns that send them again.
    pictures: super::pictures::PictureCache,
}

impl<'a, W: Write> Session<'a, W> {
    /// The session of `model` served as `opts` says, in forward calls of at most `max_call_tokens`.
    pub fn new(
        model: &'a Model,
        opts: &ServeOptions,
        max_call_tokens: usize,
        inputs: Receiver<Input>,
        out: &'a mut W,
    ) -> Self {
        let n_ctx = if opts.max_context == 0 {
            model.info().n_ctx_train as usize
        } else {
            opts.max_context
        };
        let ubatch = opts
            .ubatch
            .unwrap_or(if model.on_gpu() {
                super::GPU_UBATCH
            } else {
                crate::generate::DEFAULT_UBATCH
            })
            .clamp(1, max_call_tokens.max(1));
        let partly_resident = model.on_gpu() && model.experts_in_vram() < model.experts_total();
        let long_ubatch = opts.long_ubatch.unwrap_or(if partly_resident {
            super::LONG_UBATCH
        } else {
            0
        });
        let long_ubatch = long_ubatch.min(max_call_tokens);
        let long_ubatch = if long_ubatch > ubatch { long_ubatch } else { 0 };
        Session {
            model,
            n_ctx,
            // A checkpoint splits a read: a long call's worth apart unless told otherwise.
            checkpoint_every: opts
                .checkpoint_every
                .unwrap_or(super::DEFAULT_CHECKPOINT_EVERY.max(long_ubatch)),
            ubatch,
            long_ubatch,
            guesses: opts.guesses,
            repeats_min_match: opts.repeats_min_match,
            guess_rates: Default::default(),
            draft: None,
            draft_block: opts.draft_block,
            store: Store::new(opts.park_bytes),
            parallel: opts.parallel.max(1),
            queue: VecDeque::new(),
            active: VecDeque::new(),
            turned: VecDeque::new(),
            inputs,
            out,
            stepping: None,
            placement_echo: if model.on_gpu() {
                opts.placement.non_default()
            } else {
                Vec::new()
            },
            quitting: false,
            totals: Totals::default(),
            calls_over_states: 0,
            vision: None,
            pictures: Default::default(),
        }
    }

    /// Sends one line.
    pub(super) fn send(&mut self, msg: &FromEngine) -> std::io::Result<()> {
        send(self.out, msg)
    }

    fn error(
        &mut self,
        id: Option<String>,
        code: ErrorCode,
        message: impl Into<String>,
    ) -> std::io::Result<()> {
        self.send(&FromEngine::Err(ErrorReply {
            id,
            code,
            message: message.into(),
        }))
    }

    /// READY, then requests until QUIT or the end of input. An error is stdout or stdin failing.
    pub fn run(&mut self, model_path: &Path, experts_total: u64) -> std::io::Result<()> {
        let info = self.model.info();
        let ready = Ready {
            knobs: crate::knobs::in_force_non_default(self.model.kv())
                .into_iter()
                .chain(self.placement_echo.iter().cloned())
                .chain((self.parallel != 1).then(|| ("parallel".into(), self.parallel.to_string())))
                .chain(
                    (self.repeats_min_match != super::DEFAULT_REPEATS_MIN_MATCH as usize).then(
                        || {
                            (
                                "repeats-min-match".into(),
                                self.repeats_min_match.to_string(),
                            )
                        },
                    ),
                )
                .collect(),
            protocol: poly_protocol::PROTOCOL_VERSION,
            model: model_path.display().to_string(),
            arch: info.arch.to_string(),
            n_vocab: info.n_vocab as u32,
            n_ctx: self.n_ctx as u32,
            bos: info.bos,
            eos: info.stop_tokens(),
            device: self.model.device_name(),
            experts_total,
            experts_vram: self.model.experts_in_vram() as u64,
            guesses: Some(
                match (self.guessing(), self.draft) {
                    (true, Some(_)) => "draft",
                    (true, None) if self.draft_block => "draft-block",
                    (true, None) => "repeats",
                    (false, _) => "off",
                }
                .into(),
            ),
            prompt_calls: Some(PromptCalls {
                ubatch: self.ubatch as u32,
                long_ubatch: self.long_ubatch as u32,
                checkpoint_every: self.checkpoint_every as u32,
            }),
            vision: self.vision.map(|(v, path)| poly_protocol::Vision {
                mmproj: path.display().to_string(),
                projector: v.projector_type().into(),
            }),
        };
        self.send(&FromEngine::Ready(ready))?;
        loop {
            if self.quitting {
                while let Some(running) = self.active.pop_front() {
                    let ended = self.cancel(running);
                    self.report(ended)?;
                }
                return self.cancel_queued();
            }
            while self.active.len() < self.parallel {
                let Some(job) = self.queue.pop_front() else {
                    break;
                };
                match self.start(job) {
                    Stepped::Going(running) => self.active.push_back(running),
                    ended => self.report(ended)?,
                }
            }
            if !self.active.is_empty() {
                self.round()?;
                continue;
            }
            // Idle: wait for input (a closed channel is the reader gone: end of input).
            let input = self.inputs.recv().unwrap_or(Input::Closed);
            self.handle(input)?;
        }
    }

    /// Looks at the input that arrived while a request runs; says whether to stop it.
    pub(super) fn poll(&mut self) -> std::io::Result<Control> {
        let mut control = Control::Continue;
        loop {
            let input = match self.inputs.try_recv() {
                Ok(input) => input,
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => Input::Closed,
            };
            if self.handle(input)? == Control::Cancel {
                control = Control::Cancel;
            }
            if self.quitting {
                control = Control::Cancel;
                break;
            }
        }
        Ok(control)
    }

    /// Answers one input. Returns [`Control::Cancel`] when it stops the request taking its turn.
    fn handle(&mut self, input: Input) -> std::io::Result<Control> {
        match input {
            Input::Message(msg) => self.handle_message(msg),
            Input::Bad(e) => {
                self.send(&FromEngine::Err(ErrorReply::from(e)))?;
                Ok(Control::Continue)
            }
            Input::TooLong => {
                self.error(
                    None,
                    ErrorCode::BadRequest,
                    format!(
                        "a line longer than {} bytes (skipped)",
                        poly_protocol::MAX_LINE_BYTES
                    ),
                )?;
                Ok(Control::Continue)
            }
            Input::Closed => {
                self.quitting = true;
                Ok(Control::Cancel)
            }
            Input::Failed(e) => {
                eprintln!("poly-engine: reading stdin: {e}");
                self.quitting = true;
                Ok(Control::Cancel)
            }
        }
    }

    fn handle_message(&mut self, msg: ToEngine) -> std::io::Result<Control> {
        match msg {
            ToEngine::Gen(gen) => {
                let id = gen.id.clone();
                let taken = self.stepping_id() == Some(id.as_str())
                    || self.others().any(|r| r.job.id == id)
                    || self.queue.iter().any(|j| j.id == id);
                if taken {
                    self.error(
                        Some(id.clone()),
                        ErrorCode::BadRequest,
                        format!("request {id:?} is already running or waiting"),
                    )?;
                } else if self.queue.len() >= QUEUE_DEPTH {
                    self.error(
                        Some(id),
                        ErrorCode::Busy,
                        format!("{QUEUE_DEPTH} requests are already waiting"),
                    )?;
                } else {
                    let vision = self.vision.map(|(v, _)| v);
                    let cache = &mut self.pictures;
                    match Job::check(gen, self.model.info(), self.n_ctx, vision, cache) {
                        Ok(job) => self.queue.push_back(job),
                        Err((code, message)) => self.error(Some(id), code, message)?,
                    }
                }
                Ok(Control::Continue)
            }
            ToEngine::Cancel(poly_protocol::Cancel { id }) => {
                if self.stepping_id() == Some(id.as_str()) {
                    return Ok(Control::Cancel);
                }
                let running = self
                    .active
                    .iter_mut()
                    .chain(self.turned.iter_mut())
                    .find(|r| r.job.id == id);
                if let Some(running) = running {
                    // It ends at its next turn, before its next token.
                    running.cancel_requested = true;
                } else if let Some(i) = self.queue.iter().position(|j| j.id == id) {
                    if let Some(job) = self.queue.remove(i) {
                        self.done_unstarted(&job)?;
                    }
                } else {
                    self.error(
                        Some(id.clone()),
                        ErrorCode::BadRequest,
                        format!("no request {id:?} is running or waiting"),
                    )?;
                }
                Ok(Control::Continue)
            }
            ToEngine::Stats => {
                let stats = self.stats();
                self.send(&FromEngine::Stats(stats))?;
                Ok(Control::Continue)
            }
            ToEngine::Quit => {
                self.quitting = true;
                Ok(Control::Cancel)
            }
        }
    }

    /// DONE `cancel` for a request that never started.
    fn done_unstarted(&mut self, job: &Job) -> std::io::Result<()> {
        self.totals.cancelled += 1;
        let done = Done {
            id: job.id.clone(),
            reason: StopReason::Cancel,
            prompt_tokens: job.prompt.len() as u32,
            cached_tokens: 0,
            generated: 0,
            prefill_ms: 0.0,
            decode_ms: 0.0,
            experts_vram_share: None,
            experts_vram_share_answer: None,
            draft_proposed: 0,
            draft_accepted: 0,
            experts_left_out: None,
            experts_swapped_in: None,
        };
        self.send(&FromEngine::Done(done))
    }

    fn cancel_queued(&mut self) -> std::io::Result<()> {
        while let Some(job) = self.queue.pop_front() {
            self.done_unstarted(&job)?;
        }
        Ok(())
    }

    /// One turn of every running request, in order, then the forward calls the turns left, together.
    /// A QUIT ends the round at once (the loop then cancels everything).
    fn round(&mut self) -> std::io::Result<()> {
        while let Some(running) = self.active.pop_front() {
            self.stepping = Some((running.job.id.clone(), running.started_on.clone()));
            let stepped = self.step(running);
            self.stepping = None;
            match stepped? {
                Stepped::Going(running) => self.turned.push_back(running),
                ended => self.report(ended)?,
            }
            if self.quitting {
                break;
            }
        }
        let turned = std::mem::take(&mut self.turned);
        let finished = if self.quitting {
            turned.into_iter().map(Stepped::Going).collect()
        } else {
            self.finish_turns(turned)
        };
        // The next round: those that went on first, in order, then any the QUIT left untaken.
        let untaken = std::mem::take(&mut self.active);
        for stepped in finished {
            match stepped {
                Stepped::Going(running) => self.active.push_back(running),
                ended => self.report(ended)?,
            }
        }
        self.active.extend(untaken);
        Ok(())
    }

    /// Whether answers guess tokens: `--guesses` on and the model on the CPU (a card checks no windows
    /// yet).
    pub(super) fn guessing(&self) -> bool {
        self.guesses && !self.model.on_gpu()
    }

    /// Whether the model's own draft block makes the guesses (`--draft-block on`, guessing).
    pub(super) fn guessing_by_draft_block(&self) -> bool {
        self.draft_block && self.guessing()
    }

    /// The running requests but the one taking its turn.
    fn others(&self) -> impl Iterator<Item = &Running> {
        self.active
            .iter()
            .chain(self.turned.iter())
            .map(|r| r.as_ref())
    }

    fn stepping_id(&self) -> Option<&str> {
        self.stepping.as_ref().map(|(id, _)| id.as_str())
    }

    /// Sends what an ended request left: its DONE, or an ERR for the engine's failure.
    fn report(&mut self, ended: Stepped) -> std::io::Result<()> {
        match ended {
            Stepped::Going(_) => Ok(()),
            Stepped::Ended(Ok(done)) => {
                self.totals.requests += 1;
                self.totals.prompt_tokens += u64::from(done.prompt_tokens);
                self.totals.cached_tokens += u64::from(done.cached_tokens);
                self.totals.generated += u64::from(done.generated);
                if done.reason == StopReason::Cancel {
                    self.totals.cancelled += 1;
                }
                self.send(&FromEngine::Done(done))
            }
            Stepped::Ended(Err((id, e))) => {
                self.totals.failed += 1;
                self.error(Some(id), ErrorCode::Internal, e.0)
            }
        }
    }

    /// The STATS answer: memory, kept conversations, cache figures.
    fn stats(&self) -> Stats {
        let (rss, rss_peak) = memory::resident_bytes();
        let info = |c: &Conversation, active: bool| ConversationInfo {
            // The conversation of requests that named none has no name.
            id: c.id.clone().unwrap_or_default(),
            tokens: c.state.n_past() as u32,
            active,
            bytes: c.bytes() as u64,
            checkpoints: c.n_checkpoints() as u32,
        };
        let conversations = self
            .store
            .active()
            .map(|c| info(c, true))
            .into_iter()
            .chain(self.store.parked().iter().map(|c| info(c, false)))
            .collect();
        let t = &self.totals;
        // The request taking its turn, else the next to take one.
        let (running, running_conversation) = match (&self.stepping, self.others().next()) {
            (Some((id, conv)), _) => (Some(id.clone()), Some(conv.clone())),
            (None, Some(r)) => (Some(r.job.id.clone()), Some(r.started_on.clone())),
            (None, None) => (None, None),
        };
        let extra = json!({
            "rss_peak_bytes": rss_peak,
            "evicted": self.store.evicted,
            "running": running,
            "running_conversation": running_conversation,
            "active_requests": self.others().count() + usize::from(self.stepping.is_some()),
            "parallel": self.parallel,
            "calls_over_states": self.calls_over_states,
            "requests": t.requests,
            "cancelled": t.cancelled,
            "failed": t.failed,
            "prompt_tokens": t.prompt_tokens,
            "cached_tokens": t.cached_tokens,
            "generated": t.generated,
            "guesses": self.guess_rates.report(),
            "pictures_encoded": self.pictures.encoded,
            "pictures_reused": self.pictures.reused,
        });
        let mut extra = extra;
        if let (Some(c), serde_json::Value::Object(m)) = (self.model.expert_stats(), &mut extra) {
            m.insert("expert_cache_bytes".into(), json!(c.bytes));
            m.insert("expert_cache_slots".into(), json!(c.policy.slots));
            m.insert("expert_cache_occupied".into(), json!(c.policy.occupied));
            m.insert("expert_uploads".into(), json!(c.policy.uploads));
            m.insert("expert_evictions".into(), json!(c.policy.evictions));
            m.insert("experts_staged".into(), json!(c.staged));
            if c.skipped.steps > 0 {
                m.insert("experts_left_out".into(), json!(c.skipped.experts));
                m.insert(
                    "experts_left_out_weight_share".into(),
                    json!(c.skipped.mean_weight()),
                );
                m.insert("experts_left_out_bytes".into(), json!(c.skipped.bytes));
            }
            if c.swapped.steps > 0 {
                m.insert("experts_swapped_in".into(), json!(c.swapped.experts));
                m.insert(
                    "experts_swapped_in_weight_share".into(),
                    json!(c.swapped.mean_weight()),
                );
            }
        }
        Stats {
            rss_bytes: rss.unwrap_or(0),
            vram_bytes: self.model.gpu_weight_bytes().map(|b| b as u64),
            conversations,
            parked_bytes: self.store.parked_bytes() as u64,
            park_limit_bytes: self.store.park_limit() as u64,
            queued: self.queue.len() as u32,
            extra: match extra {
                serde_json::Value::Object(m) => m,
                _ => serde_json::Map::new(),
            },
        }
    }
}
