//! The generation loop: read a prompt in batches of up to `ubatch` tokens (each batch through every layer
//! together), then write tokens one at a time until a stop token, the token limit or the end of the
//! context, reporting each step's token, its log-probability and the likeliest alternatives.
//!
//! After a generation the state holds the prompt and every generated token but the last (the last one
//! has not been read by the model: a continuation reads it first).

use poly_models::compute::Logits;

use crate::model::{EngineError, Model};
use crate::sample::{Sampler, TopLogprobs};
use crate::state::SeqState;

/// Prompt tokens read per forward call unless told otherwise (llama.cpp's default `n_ubatch`).
pub const DEFAULT_UBATCH: usize = 512;

/// What a generation does besides sampling.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateOptions {
    /// Most tokens to write.
    pub max_tokens: usize,
    /// Tokens that end the generation (written, then the loop stops).
    pub stop_tokens: Vec<u32>,
    /// Most prompt tokens per forward call.
    pub ubatch: usize,
    /// How many likeliest tokens each step reports.
    pub top_n: usize,
    /// Tokens to write instead of sampling (an earlier answer written again, so that two configurations
    /// can be compared step by step on the same tokens); the generation ends with them.
    pub follow: Option<Vec<u32>>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: 16,
            stop_tokens: Vec::new(),
            ubatch: DEFAULT_UBATCH,
            top_n: 5,
            follow: None,
        }
    }
}

/// One written token.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub token: u32,
    /// Its log-probability under the model (log-softmax of the raw logits).
    pub logprob: f32,
    /// The `top_n` likeliest tokens and their log-probabilities, likeliest first.
    pub top: Vec<(u32, f32)>,
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// `max_tokens` were written.
    MaxTokens,
    /// The last token written is a stop token.
    StopToken,
    /// The context is full.
    ContextFull,
}

/// The result of [`generate`].
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    pub steps: Vec<Step>,
    pub stop: StopReason,
}

/// Reads `tokens` into `state` in forward calls of at most `ubatch` tokens; returns the logits after the
/// last token.
pub fn prefill(
    model: &Model,
    state: &mut SeqState,
    tokens: &[u32],
    ubatch: usize,
) -> Result<Vec<f32>, EngineError> {
    if ubatch == 0 {
        return Err(EngineError("ubatch must be at least 1".into()));
    }
    if tokens.is_empty() {
        return Err(EngineError("the prompt is empty".into()));
    }
    if tokens.len() > state.room() {
        return Err(EngineError(format!(
            "the prompt of {} tokens does not fit in the context of {} ({} used)",
            tokens.len(),
            state.n_ctx(),
            state.n_past()
        )));
    }
    let n_chunks = tokens.len().div_ceil(ubatch);
    if n_chunks > 1 {
        model.expect_tokens(state, tokens.len())?;
    }
    let mut logits = Vec::new();
    for (i, chunk) in tokens.chunks(ubatch).enumerate() {
        let want = if i + 1 == n_chunks {
            Logits::Last
        } else {
            Logits::None
        };
        logits = model.eval(state, chunk, want)?;
    }
    Ok(logits)
}

/// Reads `prompt` (which the sampler's penalties count too), then writes tokens with `sampler`, calling
/// `on_step` after each.
pub fn generate(
    model: &Model,
    state: &mut SeqState,
    prompt: &[u32],
    opts: &GenerateOptions,
    sampler: &mut Sampler,
    mut on_step: impl FnMut(&Step),
) -> Result<Generation, EngineError> {
    for &t in prompt {
        sampler.accept(t);
    }
    let mut logits = prefill(model, state, prompt, opts.ubatch)?;
    let mut steps = Vec::new();
    let stop = loop {
        if steps.len() >= opts.max_tokens {
            break StopReason::MaxTokens;
        }
        let lp = TopLogprobs::new(&logits);
        let token = match &opts.follow {
            Some(f) => match f.get(steps.len()) {
                Some(&t) => t,
                None => break StopReason::MaxTokens,
            },
            None => sampler.sample(&logits),
        };
        sampler.accept(token);
        let step = Step {
            token,
            logprob: lp.of(token),
            top: lp.top(opts.top_n),
        };
        on_step(&step);
        steps.push(step);
        if opts.stop_tokens.contains(&token) && opts.follow.is_none() {
            break StopReason::StopToken;
        }
        let followed = opts.follow.as_ref().is_some_and(|f| steps.len() >= f.len());
        if steps.len() >= opts.max_tokens || followed {
            break StopReason::MaxTokens;
        }
        if state.room() == 0 {
            break StopReason::ContextFull;
        }
        logits = model.eval(state, &[token], Logits::Last)?;
    };
    Ok(Generation { steps, stop })
}
