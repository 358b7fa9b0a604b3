//! The benchmark's prompts: a short question, and long prompts cut to a number of tokens from the English
//! text the repository carries (`server/bench/`, embedded in the binary), tokenized by the model's own
//! tokenizer.
//!
//! Each long prompt starts at another place of the text, so that no request begins with the tokens the
//! engine kept from the one before (a kept prefix is not read again, which would flatter prompt speed);
//! a prompt longer than the text wraps around to its start.

use crate::model_text::ModelText;

/// The text long prompts are cut from: `server/bench/GPL-3.txt` then `server/bench/GFDL-1.3.txt`
/// (`server/bench/README.md` says where they come from and on what terms).
pub const BENCH_TEXT: &str = concat!(
    include_str!("../../bench/GPL-3.txt"),
    "\n",
    include_str!("../../bench/GFDL-1.3.txt")
);

/// The short prompt, sent as is (no chat template, like a raw completion).
pub const SHORT_PROMPT: &str =
    "Explain in a few paragraphs what a free software licence allows the people who receive a program to do.";

/// One prompt to send: a name for the report and its tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct Prompt {
    /// `short`, or `long-N` for a long prompt of N tokens asked.
    pub name: String,
    pub tokens: Vec<u32>,
}

/// The tokenized text, ready to cut prompts from.
pub struct PromptSource {
    /// The tokens the tokenizer puts first (BOS), kept at the head of every prompt.
    head: Vec<u32>,
    /// The text's tokens after the head.
    body: Vec<u32>,
    short: Vec<u32>,
    /// Where the next long prompt starts in `body`.
    next_offset: usize,
}

/// How far apart in the text successive long prompts start (tokens; a prime, so starts spread over the
/// whole text).
const OFFSET_STEP: usize = 997;

impl PromptSource {
    /// Tokenizes the text and the short prompt with the model's tokenizer; `bos` is READY's.
    pub fn new(text: &ModelText, bos: Option<u32>) -> Result<PromptSource, String> {
        PromptSource::from_tokens(
            text.encode(BENCH_TEXT)
                .map_err(|e| format!("cannot tokenize the benchmark text: {e}"))?,
            text.encode(SHORT_PROMPT)
                .map_err(|e| format!("cannot tokenize the short prompt: {e}"))?,
            bos,
        )
    }

    fn from_tokens(
        text: Vec<u32>,
        short: Vec<u32>,
        bos: Option<u32>,
    ) -> Result<PromptSource, String> {
        let head_len = usize::from(bos.is_some() && text.first() == bos.as_ref());
        let head = text[..head_len].to_vec();
        let body = text[head_len..].to_vec();
        if body.is_empty() || short.is_empty() {
            return Err("the benchmark text gives no tokens under this tokenizer".into());
        }
        Ok(PromptSource {
            head,
            body,
            short,
            next_offset: 0,
        })
    }

    /// Tokens of the whole text (the head included).
    pub fn text_tokens(&self) -> usize {
        self.head.len() + self.body.len()
    }

    pub fn short(&self) -> Prompt {
        Prompt {
            name: "short".into(),
            tokens: self.short.clone(),
        }
    }

    /// A long prompt of exactly `n` tokens (n ≥ 1), named after `asked` (the length first asked for, when
    /// this one is a shortened resend): the head, then the text from the next start, wrapping around.
    pub fn long(&mut self, asked: usize, n: usize) -> Prompt {
        let n = n.max(1);
        let mut tokens: Vec<u32> = self.head.iter().copied().take(n).collect();
        let len = self.body.len();
        let start = self.next_offset % len;
        tokens.extend(self.body.iter().cycle().skip(start).take(n - tokens.len()));
        // The next prompt starts elsewhere, on a token other than this one's first (else the engine
        // would find a common prefix longer than the head).
        let first = self.body[start];
        let mut next = (start + OFFSET_STEP) % len;
        for _ in 0..len {
            if self.body[next] != first {
                break;
            }
            next = (next + 1) % len;
        }
        self.next_offset = next;
        Prompt {
            name: format!("long-{asked}"),
            tokens,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_prompts_have_the_length_asked_and_start_apart() {
        let text: Vec<u32> = std::iter::once(1).chain(10..1010).collect();
        let mut src = PromptSource::from_tokens(text, vec![1, 5, 6], Some(1)).expect("source");
        assert_eq!(src.text_tokens(), 1001);
        let a = src.long(20, 20);
        assert_eq!(a.name, "long-20");
        assert_eq!(a.tokens.len(), 20);
        assert_eq!(a.tokens[0], 1, "the BOS head stays first");
        assert_eq!(&a.tokens[1..4], &[10, 11, 12]);
        // Longer than the text: wraps around.
        let b = src.long(3000, 2500);
        assert_eq!(b.tokens.len(), 2500);
        assert_eq!(b.tokens[0], 1);
        assert_ne!(
            b.tokens[1], a.tokens[1],
            "another start than the last prompt"
        );
        assert_eq!(b.tokens[1], 1007, "the next start is 997 tokens on");
        assert_eq!(src.short().tokens, vec![1, 5, 6]);
    }

    #[test]
    fn a_repeated_token_at_the_next_start_is_stepped_over() {
        // Every token the same but one: the next start must land on the other one.
        let mut body = vec![7u32; 1200];
        body[998] = 8;
        let mut src = PromptSource::from_tokens(body, vec![3], None).expect("source");
        let a = src.long(5, 5);
        assert_eq!(a.tokens, vec![7; 5], "no BOS: no head");
        let b = src.long(5, 5);
        assert_eq!(b.tokens[0], 8);
    }

    #[test]
    fn the_embedded_text_is_the_readme_s() {
        // server/bench/README.md gives the sizes; a changed file must change the README too.
        assert_eq!(BENCH_TEXT.len(), 35_149 + 1 + 22_955);
        assert!(BENCH_TEXT.starts_with("                    GNU GENERAL PUBLIC LICENSE"));
    }
}
