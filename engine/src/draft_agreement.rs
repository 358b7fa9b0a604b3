//! How often a model's draft block (the MTP head of a qwen35moe file) guesses the model's next greedy
//! token, measured on the CPU: what `synth --draft-agreement` prints beside the rate it was asked for
//! ([`poly_models::synth::agree`] builds such models; the rate is a design, this is the measurement).
//!
//! Each prompt (random tokens of the seed) is read by the trunk, which keeps its hidden rows, and by the
//! draft block (token `q` with the trunk's hidden row of `q − 1`, zeros for the first, as the server's
//! guessing reads them); then, step after step, the trunk's greedy token is written, the draft block
//! reads it with the hidden row before it and guesses the token after, and the trunk reads it and
//! gives its own next greedy token. A step agrees when the guess is that token: exactly when the
//! server, greedy, would keep the guess (one guess a window, read by the server's own
//! [`draft_block::catch_up`] and [`draft_block::guesses`]).

use poly_kernels::rng::Rng;
use poly_models::compute::Logits;
use poly_models::synth::fill;

use crate::model::{EngineError, Model};
use crate::serve::draft::greedy;
use crate::serve::draft_block;

/// Prompts of a measurement unless told otherwise: several, so that no one stretch of the answers
/// decides.
pub const DEFAULT_PROMPTS: usize = 8;

/// Random tokens of each prompt.
pub const PROMPT_TOKENS: usize = 8;

/// Greedy steps after each prompt unless told otherwise: where each token agrees or not as a coin
/// tossed (the design of [`poly_models::synth::agree`]), 8 × 32 steps put the measured share within
/// about ±0.06 (two standard deviations) of the rate at 0.5. Seconds on the CPU for the real widths.
pub const DEFAULT_STEPS: usize = 32;

/// One step: the token written, the trunk's next greedy token after it, and the draft block's guess of
/// that token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub token: u32,
    pub next: u32,
    pub guess: u32,
}

/// The steps of a measurement.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Agreement {
    pub steps: Vec<Step>,
}

impl Agreement {
    /// Steps whose guess was the trunk's token.
    pub fn agreed(&self) -> usize {
        self.steps.iter().filter(|s| s.guess == s.next).count()
    }

    /// The share of steps that agreed (0 without steps).
    pub fn rate(&self) -> f64 {
        self.agreed() as f64 / self.steps.len().max(1) as f64
    }
}

/// The agreement of `model`'s draft block over `n_prompts` prompts of [`PROMPT_TOKENS`] random tokens
/// of `seed`, `steps` greedy steps each.
pub fn measure(
    model: &Model,
    seed: u64,
    n_prompts: usize,
    steps: usize,
) -> Result<Agreement, EngineError> {
    let info = model.info();
    let n_vocab = info.n_vocab;
    let n_ctx = PROMPT_TOKENS + steps + 1;
    let mut out = Agreement::default();
    for p in 0..n_prompts {
        let mut rng = Rng::new(fill::stream_seed(seed, u64::MAX - 6, p as u64));
        let prompt: Vec<u32> = (0..PROMPT_TOKENS)
            .map(|_| rng.below(n_vocab as u32))
            .collect();
        let mut main = model.new_state(n_ctx);
        main.keep_hidden(true);
        let mut logits = model.eval(&mut main, &prompt, Logits::Last)?;
        let mut block = model
            .new_draft_block_state(n_ctx)
            .ok_or_else(|| EngineError(format!("{} has no draft block", info.arch)))?;
        // The block reads the prompt and guesses as `--draft-block on` makes it.
        draft_block::catch_up(model, &mut block, &mut main)?;
        for _ in 0..steps {
            let token = greedy(&logits);
            let guess = draft_block::guesses(model, &mut block, &mut main, token)?[0];
            logits = model.eval(&mut main, &[token], Logits::Last)?;
            out.steps.push(Step {
                token,
                next: greedy(&logits),
                guess,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use poly_kernels::quant::GgmlType;
    use poly_models::synth::plan::TypeChoice;
    use poly_models::synth::shapes::find_shape;
    use poly_models::synth::{SynthOptions, Synthesis};

    /// The tiny qwen35moe shape (Q8_0) from seed 6, with its draft block written to agree at `rate`
    /// (`None`: as synth always wrote it), loaded; and its plan.
    fn tiny(rate: Option<f32>, name: &str) -> (Model, Synthesis) {
        let shape = find_shape("qwen35moe", "tiny").expect("tiny");
        let mut s = Synthesis::prepare(&SynthOptions {
            types: TypeChoice {
                default: GgmlType::Q8_0,
                overrides: Vec::new(),
            },
            shape,
            seed: 6,
            route_skew: 0.0,
        })
        .expect("prepare");
        if let Some(rate) = rate {
            s = s.with_draft_agreement(rate).expect("a draft block");
        }
        let dir = std::env::temp_dir().join(format!("poly-agreement-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join(name);
        s.write(&path, |_, _| {}).expect("write");
        let model = Model::load(&path).expect("load");
        std::fs::remove_file(&path).ok();
        (model, s)
    }

    /// Asked 0.9 the draft block agrees most of the time, the trunk follows the planned next token, and
    /// the steps that agree are the known tokens'; asked 0, and written as synth always wrote it, it
    /// guesses at chance.
    #[test]
    fn the_draft_block_agrees_at_about_the_rate_asked() {
        let (model, s) = tiny(Some(0.9), "agree-0.9.gguf");
        let plan = s.agreement.as_ref().expect("plan");
        let a = measure(&model, 1, DEFAULT_PROMPTS, DEFAULT_STEPS).expect("measure");
        assert_eq!(a.steps.len(), DEFAULT_PROMPTS * DEFAULT_STEPS);
        let followed = a
            .steps
            .iter()
            .filter(|st| st.next == plan.next[st.token as usize])
            .count();
        assert_eq!(followed, a.steps.len(), "the trunk follows the plan");
        // Agreement is the known tokens': right after each, wrong after the others.
        for st in &a.steps {
            assert_eq!(st.guess == st.next, plan.known[st.token as usize], "{st:?}");
        }
        assert!(a.rate() >= 0.7, "asked 0.9, measured {}", a.rate());

        for (rate, name) in [(Some(0.0), "agree-0.gguf"), (None, "plain.gguf")] {
            let (model, _) = tiny(rate, name);
            let a = measure(&model, 1, DEFAULT_PROMPTS, DEFAULT_STEPS).expect("measure");
            assert!(a.rate() <= 0.1, "{name}: measured {}", a.rate());
        }
    }
}
