//! The byte-level BPE vocabulary of synthetic models: GPT-2's 256 byte tokens, merges learned at run time
//! from a small built-in English and code text (`corpus.txt`), the ChatML special tokens, and padding to a
//! real model's vocabulary size.
//!
//! The vocabulary is what llama.cpp's `gpt2` tokenizer model reads (`tokenizer.ggml.tokens`, `token_type`,
//! `merges`): token strings are written in GPT-2's byte-to-unicode alphabet (a space is `Ġ`, a newline
//! `Ċ`), every merge is `"left right"` and its result is a token. Training is deterministic (ties broken
//! by the pair's strings), so every synthetic file carries the same vocabulary.

use std::collections::HashMap;
use std::sync::OnceLock;

/// The built-in training text.
const CORPUS: &str = include_str!("corpus.txt");

/// Token types as GGUF stores them (llama.cpp's `llama_token_type`).
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
}

/// Special tokens appended after the learned tokens: (text, token type).
pub const SPECIAL_TOKENS: &[(&str, i32)] = &[
    ("<|endoftext|>", token_type::CONTROL),
    ("<|im_start|>", token_type::CONTROL),
    ("<|im_end|>", token_type::CONTROL),
    ("<think>", token_type::USER_DEFINED),
    ("</think>", token_type::USER_DEFINED),
    ("<tool_call>", token_type::USER_DEFINED),
    ("</tool_call>", token_type::USER_DEFINED),
];

/// Size of the small vocabulary: 256 byte tokens, learned merges, then the special tokens.
pub const SMALL_VOCAB_SIZE: usize = 2048;

/// A simple ChatML template (what llama.cpp detects as `chatml`).
pub const CHAT_TEMPLATE: &str = "{%- for message in messages -%}\
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}";

/// A tokenizer vocabulary ready for the `tokenizer.ggml.*` keys.
#[derive(Clone, Debug, PartialEq)]
pub struct Vocab {
    /// Token strings, in id order.
    pub tokens: Vec<String>,
    /// One token type per token.
    pub token_types: Vec<i32>,
    /// Merges in rank order, `"left right"`.
    pub merges: Vec<String>,
    /// `<|endoftext|>`: beginning of stream and padding.
    pub bos_id: u32,
    /// `<|im_end|>`: end of a turn, where generation stops.
    pub eos_id: u32,
    /// Padding token.
    pub pad_id: u32,
}

impl Vocab {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the vocabulary has no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The id of the token whose string is `text`.
    pub fn id_of(&self, text: &str) -> Option<u32> {
        self.tokens.iter().position(|t| t == text).map(|p| p as u32)
    }

    /// This vocabulary grown to `n` tokens with made-up normal tokens `<|tok_ID|>` (ids keep their
    /// meaning), so a synthetic file of a real shape has the real vocabulary size. No merge produces
    /// them; they exist so the embedding and output matrices have the real number of rows.
    pub fn padded_to(mut self, n: usize) -> Vocab {
        let start = self.tokens.len();
        for id in start..n {
            self.tokens.push(format!("<|tok_{id}|>"));
            self.token_types.push(token_type::NORMAL);
        }
        self
    }
}

/// The small vocabulary (`SMALL_VOCAB_SIZE` tokens), learned from the built-in text (once per process).
pub fn small_vocab() -> Vocab {
    static SMALL: OnceLock<Vocab> = OnceLock::new();
    SMALL
        .get_or_init(|| build_vocab(CORPUS, SMALL_VOCAB_SIZE))
        .clone()
}

/// GPT-2's byte-to-unicode table: printable bytes map to themselves, the others to code points from 256
/// on, so every byte is one visible character.
pub fn byte_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        let printable =
            (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let cp = if printable {
            b
        } else {
            let cp = next;
            next += 1;
            cp
        };
        // Every value is below 0x144 and not a surrogate, so the conversion always succeeds.
        table[b as usize] = char::from_u32(cp).unwrap_or('?');
    }
    table
}

/// The 256 byte tokens in GPT-2's order: the printable bytes in byte order, then the others.
fn byte_tokens(table: &[char; 256]) -> Vec<String> {
    let mut order: Vec<(u32, u8)> = (0..=255u8).map(|b| (table[b as usize] as u32, b)).collect();
    // GPT-2 lists the bytes that map to themselves first, in byte order, then the remapped ones; sorting
    // by code point gives exactly that order.
    order.sort();
    order
        .into_iter()
        .map(|(_, b)| table[b as usize].to_string())
        .collect()
}

/// Splits `text` into pre-tokens the way the `qwen2` pre-tokenizer's regular expression does for ASCII
/// text (contractions, an optional leading non-letter before letters, single digits, punctuation runs,
/// newlines, spaces). Non-ASCII bytes count as letters.
pub fn pre_tokenize(text: &str) -> Vec<&str> {
    let b = text.as_bytes();
    let is_letter = |c: u8| c.is_ascii_alphabetic() || c >= 0x80;
    let is_digit = |c: u8| c.is_ascii_digit();
    let is_space =
        |c: u8| c == b' ' || c == b'\t' || c == b'\r' || c == b'\n' || c == 0x0B || c == 0x0C;
    let is_nl = |c: u8| c == b'\r' || c == b'\n';
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let start = i;
        let c = b[i];
        // (?i:'s|'t|'re|'ve|'m|'ll|'d)
        if c == b'\'' {
            let rest = &text[i + 1..];
            let lower: String = rest
                .chars()
                .take(2)
                .collect::<String>()
                .to_ascii_lowercase();
            let n = if lower.starts_with("re") || lower.starts_with("ve") || lower.starts_with("ll")
            {
                2
            } else if lower.starts_with('s')
                || lower.starts_with('t')
                || lower.starts_with('m')
                || lower.starts_with('d')
            {
                1
            } else {
                0
            };
            if n > 0 {
                out.push(&text[i..i + 1 + n]);
                i += 1 + n;
                continue;
            }
        }
        // [^\r\n\p{L}\p{N}]?\p{L}+
        let lead = usize::from(!is_nl(c) && !is_letter(c) && !is_digit(c));
        if i + lead < b.len() && is_letter(b[i + lead]) {
            i += lead;
            while i < b.len() && is_letter(b[i]) {
                i += 1;
            }
            out.push(&text[start..i]);
            continue;
        }
        // \p{N}
        if is_digit(c) {
            out.push(&text[i..i + 1]);
            i += 1;
            continue;
        }
        // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
        let sp = usize::from(c == b' ');
        let punct = |c: u8| !is_space(c) && !is_letter(c) && !is_digit(c);
        if i + sp < b.len() && punct(b[i + sp]) {
            i += sp;
            while i < b.len() && punct(b[i]) {
                i += 1;
            }
            while i < b.len() && is_nl(b[i]) {
                i += 1;
            }
            out.push(&text[start..i]);
            continue;
        }
        // \s*[\r\n]+ | \s+(?!\S) | \s+
        let mut j = i;
        while j < b.len() && is_space(b[j]) {
            j += 1;
        }
        // The last newline in the run ends the first alternative.
        if let Some(last_nl) = (i..j).rev().find(|&k| is_nl(b[k])) {
            out.push(&text[i..last_nl + 1]);
            i = last_nl + 1;
            continue;
        }
        // Spaces followed by a non-space keep their last space for the next pre-token.
        let end = if j < b.len() && j - i > 1 { j - 1 } else { j };
        out.push(&text[i..end]);
        i = end;
    }
    out
}

/// Learns merges from `text` until the vocabulary (bytes + merges + special tokens) has `size` tokens or no
/// pair is left, and returns the vocabulary.
pub fn build_vocab(text: &str, size: usize) -> Vocab {
    let table = byte_to_unicode();
    let mut tokens = byte_tokens(&table);
    let mut token_types = vec![token_type::NORMAL; tokens.len()];
    let mut id_of: HashMap<String, u32> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();

    // Unique words with their counts, each as a sequence of token ids; sorted so training is deterministic.
    let mut word_counts: HashMap<&str, u64> = HashMap::new();
    for w in pre_tokenize(text) {
        *word_counts.entry(w).or_insert(0) += 1;
    }
    let mut words: Vec<(Vec<u32>, u64)> = word_counts
        .into_iter()
        .map(|(w, n)| {
            (
                w.bytes()
                    .map(|b| id_of[&table[b as usize].to_string()])
                    .collect(),
                n,
            )
        })
        .collect();
    words.sort();

    let n_merges = size.saturating_sub(tokens.len() + SPECIAL_TOKENS.len());
    let mut merges = Vec::with_capacity(n_merges);
    while merges.len() < n_merges {
        let mut pairs: HashMap<(u32, u32), u64> = HashMap::new();
        for (w, n) in &words {
            for p in w.windows(2) {
                *pairs.entry((p[0], p[1])).or_insert(0) += n;
            }
        }
        // Most frequent pair; ties go to the pair whose strings sort first.
        let best = pairs.into_iter().max_by(|(pa, na), (pb, nb)| {
            na.cmp(nb).then_with(|| {
                let ka = (&tokens[pa.0 as usize], &tokens[pa.1 as usize]);
                let kb = (&tokens[pb.0 as usize], &tokens[pb.1 as usize]);
                kb.cmp(&ka)
            })
        });
        let Some(((l, r), _)) = best else { break };
        let merged = format!("{}{}", tokens[l as usize], tokens[r as usize]);
        merges.push(format!("{} {}", tokens[l as usize], tokens[r as usize]));
        let new_id = match id_of.get(&merged) {
            Some(&id) => id,
            None => {
                let id = tokens.len() as u32;
                tokens.push(merged.clone());
                token_types.push(token_type::NORMAL);
                id_of.insert(merged, id);
                id
            }
        };
        for (w, _) in words.iter_mut() {
            let mut k = 0;
            while k + 1 < w.len() {
                if w[k] == l && w[k + 1] == r {
                    w[k] = new_id;
                    w.remove(k + 1);
                }
                k += 1;
            }
        }
    }

    let first_special = tokens.len() as u32;
    for &(text, ty) in SPECIAL_TOKENS {
        tokens.push(text.to_string());
        token_types.push(ty);
    }
    Vocab {
        tokens,
        token_types,
        merges,
        bos_id: first_special,
        eos_id: first_special + 2,
        pad_id: first_special,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_a_bijection_onto_gpt2_alphabet() {
        let t = byte_to_unicode();
        let mut seen: Vec<char> = t.to_vec();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 256);
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'A' as usize], 'A');
        let toks = byte_tokens(&t);
        assert_eq!(toks[0], "!");
        assert_eq!(toks[93], "~");
        assert_eq!(toks[188], "Ā");
    }

    #[test]
    fn pre_tokenizer_splits_like_qwen2() {
        assert_eq!(pre_tokenize("Hello world"), vec!["Hello", " world"]);
        assert_eq!(
            pre_tokenize("it's 2024!\n"),
            vec!["it", "'s", " ", "2", "0", "2", "4", "!\n"]
        );
        assert_eq!(pre_tokenize("a  b"), vec!["a", " ", " b"]);
        assert_eq!(
            pre_tokenize("x = (y)\n\n    z"),
            vec!["x", " =", " (", "y", ")\n\n", "   ", " z"]
        );
        // Nothing is lost.
        let text = "fn main() {\n    let x = 1;\n}\n";
        assert_eq!(pre_tokenize(text).concat(), text);
    }

    #[test]
    fn small_vocab_is_consistent() {
        let v = small_vocab();
        assert_eq!(v.len(), SMALL_VOCAB_SIZE);
        assert_eq!(v.tokens.len(), v.token_types.len());
        let mut sorted = v.tokens.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), v.len(), "token strings are unique");
        // Every merge joins two tokens into a token that exists.
        for m in &v.merges {
            let (l, r) = m.split_once(' ').expect("merge has two parts");
            assert!(v.id_of(l).is_some() && v.id_of(r).is_some(), "{m}");
            assert!(v.id_of(&format!("{l}{r}")).is_some(), "{m}");
        }
        assert_eq!(
            v.merges.len(),
            SMALL_VOCAB_SIZE - 256 - SPECIAL_TOKENS.len()
        );
        // Common words became single tokens.
        for w in ["Ġthe", "Ġand", "Ġmodel", "self", "Ġreturn"] {
            assert!(v.id_of(w).is_some(), "{w}");
        }
        assert_eq!(v.tokens[v.eos_id as usize], "<|im_end|>");
        assert_eq!(v.tokens[v.bos_id as usize], "<|endoftext|>");
        assert_eq!(v.token_types[v.eos_id as usize], token_type::CONTROL);
        assert_eq!(build_vocab(CORPUS, SMALL_VOCAB_SIZE), v, "deterministic");
    }

    #[test]
    fn padding_keeps_ids() {
        let v = small_vocab();
        let p = v.clone().padded_to(5000);
        assert_eq!(p.len(), 5000);
        assert_eq!(&p.tokens[..v.len()], &v.tokens[..]);
        assert_eq!(p.tokens[4999], "<|tok_4999|>");
    }
}
