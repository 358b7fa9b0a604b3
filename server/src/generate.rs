//! One generation as both APIs drive it: the engine's tokens turned into text (stop strings cut the
//! text and cancel the engine), parsed into content, reasoning and tool calls, with log-probabilities
//! and usage; a client that goes away cancels the request and the lease is held until the engine's DONE.

use crate::engine::process::EngineEvent;
use crate::engine::supervisor::{Counters, Lease};
use crate::model_text::{Decoder, ModelText, OutputParser, ParserSetup, Piece, Resume};
use poly_protocol::{Gen, StopReason};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// Sampling fields common to the APIs, as requests give them (absent means the model's default).
#[derive(Clone, Debug, Default)]
pub struct Sampling {
    pub max_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub top_logprobs: Option<u32>,
    pub stop: Vec<String>,
}

/// How the output is read: raw text (completions) or parsed for reasoning and tool calls (chat).
#[derive(Clone, Debug)]
pub enum Output {
    Raw,
    Chat(ParserSetup),
}

/// One generated token with its log-probability and, when asked, the likeliest alternatives.
#[derive(Clone, Debug)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// What one step of a generation yields.
#[derive(Debug)]
pub enum Step {
    Pieces {
        pieces: Vec<Piece>,
        logprobs: Vec<TokenLogprob>,
    },
    Finished(Finish),
    Failed(Failure),
}

/// Why a generation failed: the engine refused the request (its `ERR` code) or died (`code` is `None`).
#[derive(Clone, Debug)]
pub struct Failure {
    pub code: Option<poly_protocol::ErrorCode>,
    pub message: String,
}

impl Failure {
    fn died(message: impl Into<String>) -> Failure {
        Failure {
            code: None,
            message: message.into(),
        }
    }
}

/// Why and how a generation ended.
#[derive(Clone, Debug)]
pub struct Finish {
    pub reason: FinishReason,
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    pub completion_tokens: u32,
    /// The engine's own clock: reading the prompt, and writing the answer (DONE's `prefill_ms`,
    /// `decode_ms`).
    pub prefill_ms: f64,
    pub decode_ms: f64,
    /// DONE's share of routed-expert uses served from VRAM (`None` on the CPU or for a dense model), over
    /// the request and over its answer alone.
    pub experts_vram_share: Option<f64>,
    pub experts_vram_share_answer: Option<f64>,
    /// Tokens a draft model proposed, and how many of them were kept.
    pub draft_proposed: u32,
    pub draft_accepted: u32,
}

#[derive(Clone, Debug, PartialEq)]
pub enum FinishReason {
    /// An end token.
    Stop,
    /// A stop string (which one).
    StopString(String),
    Length,
    Cancelled,
}

/// Why an engine that announced `vision` in READY cannot read a request's pictures written for a
/// projector of type `written_for` ([`crate::model_text::PictureTokens::projector`]), if it cannot.
fn refuses_pictures(
    vision: Option<&poly_protocol::Vision>,
    model: &str,
    written_for: &str,
) -> Option<String> {
    match vision {
        None => Some(format!(
            "messages hold pictures, but model {model:?} reads text only (its run config names no \
             projector, `mmproj`); send text"
        )),
        // The picture tokens around each placeholder are those of the model's family
        // (`crate::model_text::PictureTokens`), which mtmd writes for one projector type.
        Some(v) if v.projector != written_for => Some(format!(
            "the engine's projector {:?} is not the one model {model:?} writes pictures for \
             ({written_for:?})",
            v.projector
        )),
        Some(_) => None,
    }
}

/// A generation in progress. Dropping it without finishing cancels the engine request (best effort).
pub struct Generation {
    lease: Lease,
    id: String,
    events: mpsc::UnboundedReceiver<EngineEvent>,
    decoder: Decoder,
    /// `None` for raw completions: the text goes out as content, unparsed.
    parser: Option<OutputParser>,
    stops: StopMatcher,
    stopped_by: Option<String>,
    finished: bool,
    pending_finish: Option<Finish>,
}

impl Generation {
    /// Sends the request to the engine, with no conversation hints (completions, benchmarks).
    pub fn start(
        lease: Lease,
        id: String,
        prompt: Vec<u32>,
        sampling: &Sampling,
        output: Output,
    ) -> Result<Generation, Failure> {
        Generation::start_in(
            lease,
            id,
            prompt,
            sampling,
            output,
            Resume::default(),
            Vec::new(),
        )
    }

    /// Sends the request to the engine as part of the conversation `resume` names, with `pictures` at
    /// their placeholders in `prompt`. Pictures for an engine without a projector are refused here with
    /// the APIs' text-only message.
    pub fn start_in(
        lease: Lease,
        id: String,
        prompt: Vec<u32>,
        sampling: &Sampling,
        output: Output,
        resume: Resume,
        pictures: Vec<poly_protocol::Picture>,
    ) -> Result<Generation, Failure> {
        let text: Arc<ModelText> = lease.text();
        let ready = lease.engine().ready().clone();
        let refused = |message: String| Failure {
            code: Some(poly_protocol::ErrorCode::BadRequest),
            message,
        };
        if prompt.is_empty() {
            return Err(refused("the prompt is empty".into()));
        }
        if !pictures.is_empty() {
            let written_for = text.picture_tokens().projector;
            if let Some(why) =
                refuses_pictures(ready.vision.as_ref(), &lease.model().id, written_for)
            {
                return Err(refused(why));
            }
        }
        let room = ready.n_ctx.saturating_sub(prompt.len() as u32);
        if room == 0 {
            return Err(refused(format!(
                "the prompt has {} tokens; the model's context holds {}",
                prompt.len(),
                ready.n_ctx
            )));
        }
        let mut stop_tokens = ready.eos.clone();
        for t in text.stop_tokens() {
            if !stop_tokens.contains(&t) {
                stop_tokens.push(t);
            }
        }
        // A field the request leaves out takes the model's default (run config, GGUF, family table,
        // llama-server's; `crate::defaults`); a chat gets a default answer length (a small model that
        // never stops should not ramble until the context is full), and no length may exceed the room
        // left.
        let defaults = text.defaults();
        let default_max = match output {
            Output::Chat(_) => Some(defaults.chat_max_tokens),
            Output::Raw => defaults.max_tokens,
        };
        let max_tokens = sampling
            .max_tokens
            .or(default_max)
            .unwrap_or(room)
            .min(room);
        let f = |k: &str| defaults.f32(k);
        let gen = Gen {
            id: id.clone(),
            tokens: prompt,
            max_tokens: Some(max_tokens),
            temperature: sampling.temperature.or_else(|| f("temperature")),
            top_k: sampling.top_k.or_else(|| defaults.u32("top_k")),
            top_p: sampling.top_p.or_else(|| f("top_p")),
            min_p: sampling.min_p.or_else(|| f("min_p")),
            repeat_penalty: sampling.repeat_penalty.or_else(|| f("repeat_penalty")),
            presence_penalty: sampling.presence_penalty.or_else(|| f("presence_penalty")),
            frequency_penalty: sampling
                .frequency_penalty
                .or_else(|| f("frequency_penalty")),
            penalty_last_n: None,
            seed: sampling.seed,
            stop_tokens: Some(stop_tokens),
            top_logprobs: sampling.top_logprobs,
            conversation: resume.conversation,
            checkpoint_at: resume.checkpoint_at,
            pictures,
        };
        let events = lease.engine().generate(gen).map_err(Failure::died)?;
        Ok(Generation {
            decoder: text.decoder(),
            parser: match output {
                Output::Raw => None,
                Output::Chat(setup) => Some(text.parser(setup)),
            },
            stops: StopMatcher::new(sampling.stop.clone()),
            lease,
            id,
            events,
            stopped_by: None,
            finished: false,
            pending_finish: None,
        })
    }

    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// The next step; `Finished` or `Failed` ends the generation.
    pub async fn next(&mut self) -> Step {
        if let Some(finish) = self.pending_finish.take() {
            return Step::Finished(finish);
        }
        if self.finished {
            return Step::Failed(Failure::died("the generation has ended"));
        }
        loop {
            let Some(event) = self.events.recv().await else {
                self.finished = true;
                Counters::add(&self.lease.counters().failed);
                return Step::Failed(Failure::died("the engine dropped the request"));
            };
            match event {
                EngineEvent::Tokens(t) => {
                    if self.stopped_by.is_some() {
                        continue; // cancelled after a stop string; drain until DONE
                    }
                    let mut logprobs = Vec::new();
                    let mut text = String::new();
                    for (i, &id) in t.tokens.iter().enumerate() {
                        text.push_str(&self.decoder.push(id));
                        logprobs.push(TokenLogprob {
                            id,
                            logprob: t.logprobs.get(i).copied().unwrap_or(0.0),
                            top: t
                                .top
                                .as_ref()
                                .and_then(|top| top.get(i).cloned())
                                .unwrap_or_default(),
                        });
                    }
                    let (emit, hit) = self.stops.push(&text);
                    let mut pieces = self.parse(&emit);
                    if let Some(stop) = hit {
                        self.stopped_by = Some(stop);
                        self.lease.engine().cancel(&self.id);
                        pieces.extend(self.finish_parse());
                    }
                    if pieces.is_empty() && logprobs.is_empty() {
                        continue;
                    }
                    return Step::Pieces { pieces, logprobs };
                }
                EngineEvent::Done(done) => {
                    self.finished = true;
                    Counters::add(&self.lease.counters().completed);
                    let reason = match (&self.stopped_by, done.reason) {
                        (Some(s), _) => FinishReason::StopString(s.clone()),
                        (None, StopReason::Stop) => FinishReason::Stop,
                        (None, StopReason::Length) => FinishReason::Length,
                        (None, StopReason::Cancel) => FinishReason::Cancelled,
                    };
                    let mut pieces = Vec::new();
                    if self.stopped_by.is_none() {
                        let tail = self.decoder.finish();
                        let (mut rest, _) = self.stops.push(&tail);
                        rest.push_str(&self.stops.flush());
                        pieces.extend(self.parse(&rest));
                        pieces.extend(self.finish_parse());
                    }
                    let finish = Finish {
                        reason,
                        prompt_tokens: done.prompt_tokens,
                        cached_tokens: done.cached_tokens,
                        completion_tokens: done.generated,
                        prefill_ms: done.prefill_ms,
                        decode_ms: done.decode_ms,
                        experts_vram_share: done.experts_vram_share,
                        experts_vram_share_answer: done.experts_vram_share_answer,
                        draft_proposed: done.draft_proposed,
                        draft_accepted: done.draft_accepted,
                    };
                    self.lease.telemetry().record(&finish);
                    // One line per request with its figures, as llama-server logs its timings.
                    eprintln!(
                        "{}",
                        crate::telemetry::log_line(&self.id, &self.lease.model().id, &finish)
                    );
                    if !pieces.is_empty() {
                        // Hand the last text out first; the finish follows on the next call.
                        self.pending_finish = Some(finish);
                        return Step::Pieces {
                            pieces,
                            logprobs: Vec::new(),
                        };
                    }
                    return Step::Finished(finish);
                }
                EngineEvent::Refused(err) => {
                    self.finished = true;
                    Counters::add(&self.lease.counters().failed);
                    return Step::Failed(Failure {
                        code: Some(err.code),
                        message: format!("the engine refused the request: {}", err.message),
                    });
                }
                EngineEvent::Died(msg) => {
                    self.finished = true;
                    Counters::add(&self.lease.counters().failed);
                    return Step::Failed(Failure::died(msg));
                }
            }
        }
    }

    fn parse(&mut self, text: &str) -> Vec<Piece> {
        match &mut self.parser {
            Some(p) => p.push(text),
            None if text.is_empty() => Vec::new(),
            None => vec![Piece::Content(text.to_string())],
        }
    }

    fn finish_parse(&mut self) -> Vec<Piece> {
        self.parser
            .as_mut()
            .map(OutputParser::finish)
            .unwrap_or_default()
    }

    /// Cancels the request (the client went away) and waits for the engine's DONE, at most `timeout`,
    /// so that the next request finds the engine free.
    pub async fn cancel(mut self, timeout: Duration) {
        if self.finished {
            return;
        }
        self.lease.engine().cancel(&self.id);
        let drain = async {
            while let Some(event) = self.events.recv().await {
                match event {
                    EngineEvent::Tokens(_) => {}
                    EngineEvent::Done(d) => return Some(d.reason == StopReason::Cancel),
                    EngineEvent::Refused(_) | EngineEvent::Died(_) => return None,
                }
            }
            None
        };
        let ended = tokio::time::timeout(timeout, drain).await.unwrap_or(None);
        let counters = self.lease.counters();
        Counters::add(match ended {
            Some(true) => &counters.cancelled,
            Some(false) => &counters.completed,
            None => &counters.failed,
        });
        self.finished = true;
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        // A generation abandoned midway (an error in the handler, a dropped task) still stops the engine.
        if !self.finished {
            self.lease.engine().cancel(&self.id);
        }
    }
}

/// Finds stop strings in streamed text, holding back only what could still become one.
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    /// Adds `text`; returns what may be sent now and the stop string found, if any (text from it on is
    /// dropped).
    pub fn push(&mut self, text: &str) -> (String, Option<String>) {
        self.held.push_str(text);
        if self.stops.is_empty() {
            return (std::mem::take(&mut self.held), None);
        }
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s.clone())))
            .min_by_key(|(at, _)| *at);
        if let Some((at, stop)) = first {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, Some(stop));
        }
        // Keep the longest tail that is a prefix of some stop string.
        let mut keep_from = self.held.len();
        for (i, _) in self.held.char_indices().rev() {
            let tail = &self.held[i..];
            if self.stops.iter().any(|s| s.starts_with(tail)) {
                keep_from = i;
            }
            if self.held.len() - i >= self.longest() {
                break;
            }
        }
        let rest = self.held.split_off(keep_from);
        let out = std::mem::replace(&mut self.held, rest);
        (out, None)
    }

    fn longest(&self) -> usize {
        self.stops.iter().map(String::len).max().unwrap_or(0)
    }

    /// What is held back, at the end of the generation.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], chunks: &[&str]) -> (String, Option<String>) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for c in chunks {
            let (text, hit) = m.push(c);
            out.push_str(&text);
            if hit.is_some() {
                return (out, hit);
            }
        }
        out.push_str(&m.flush());
        (out, None)
    }

    #[test]
    fn stop_strings_split_across_chunks() {
        assert_eq!(
            run(&["END"], &["hello E", "N", "D more"]),
            ("hello ".to_string(), Some("END".to_string()))
        );
        assert_eq!(
            run(&["END"], &["hello E", "x"]),
            ("hello Ex".to_string(), None)
        );
        assert_eq!(
            run(&["\n\n", "ab"], &["xa", "b"]),
            ("x".to_string(), Some("ab".to_string()))
        );
        assert_eq!(run(&[], &["a", "b"]), ("ab".to_string(), None));
        assert_eq!(
            run(&["ü!"], &["aü", "ü!"]),
            ("aü".to_string(), Some("ü!".to_string()))
        );
    }

    #[test]
    fn held_text_is_only_a_possible_prefix() {
        let mut m = StopMatcher::new(vec!["STOP".into()]);
        assert_eq!(m.push("abcS"), ("abc".to_string(), None));
        assert_eq!(m.push("x"), ("Sx".to_string(), None));
    }
}
