//! llama.cpp's pre-tokenizers of byte-level BPE vocabularies, by `tokenizer.ggml.pre` name
//! (`src/llama-vocab.cpp`: the names in `llama_vocab::impl::load`, the regexes in `llm_tokenizer_bpe`).
//!
//! Each regex splits the pieces the previous one left (matches and the text between them both stay
//! pieces), which is a Hugging Face `Split` pre-tokenizer with `Isolated` behaviour per regex.

/// How a pre-tokenizer name splits text before BPE.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreTokenizer {
    /// The regexes, applied one after the other.
    pub regexes: Vec<&'static str>,
    /// A piece that is itself a token is taken whole, without merges (llama.cpp's `ignore_merges`).
    pub ignore_merges: bool,
}

// The regexes as llama.cpp writes them (case-insensitive contractions spelled out, as it does).
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const DEEPSEEK3_DIGITS: &str = r"\p{N}{1,3}";
const DEEPSEEK3_CJK: &str = r"[一-龥぀-ゟ゠-ヿ]+";
const DEEPSEEK3_MAIN: &str = r"[!\x22#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const STARCODER_DIGITS: &str = r"\p{N}";
const DEFAULT_PUNCT: &str = r"[\p{P}\$\+<=>\^~\|]+";
const DEFAULT_NUMBERS: &str = r"\p{N}+";
const DEFAULT_TRIPLES: &str = r"[0-9][0-9][0-9]";

/// The pre-tokenizer of a `tokenizer.ggml.pre` name, or `None` for a name this server does not know.
pub fn pre_tokenizer(pre: &str) -> Option<PreTokenizer> {
    let (regexes, ignore_merges): (Vec<&'static str>, bool) = match pre {
        "default" => (
            vec![DEFAULT_PUNCT, GPT2, DEFAULT_NUMBERS, DEFAULT_TRIPLES],
            false,
        ),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => (vec![LLAMA3], true),
        "dbrx" | "smaug-bpe" => (vec![LLAMA3], false),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2" | "hunyuan"
        | "solar-open" | "grok-2" => (vec![QWEN2], false),
        "qwen35" => (vec![QWEN35], false),
        "chatglm-bpe" => (vec![LLAMA3_GLM], false),
        "glm4" | "glm5" => (vec![LLAMA3_GLM], true),
        "deepseek-v3" | "hunyuan-dense" | "joyai-llm" | "hy_v4" => {
            (vec![DEEPSEEK3_DIGITS, DEEPSEEK3_CJK, DEEPSEEK3_MAIN], false)
        }
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
        | "a.x-4.0" | "mellum" | "modern-bert" | "mpt" | "olmo" | "jais" | "trillion"
        | "granite-docling" | "exaone4" | "jina-v1-en" | "jina-v2-code" | "roberta-bpe" => {
            (vec![GPT2], false)
        }
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b"
        | "mellum2" => (vec![STARCODER_DIGITS, GPT2], false),
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => (vec![GPT4O], false),
        _ => return None,
    };
    Some(PreTokenizer {
        regexes,
        ignore_merges,
    })
}

/// ChatGLM-4 / GLM-4.5+: llama3's regex (digits in threes).
const LLAMA3_GLM: &str = LLAMA3;

/// Whether llama.cpp adds BOS by default for a BPE vocabulary with this pre-tokenizer (before the file's
/// own `add_bos_token` key).
pub fn adds_bos(pre: &str) -> bool {
    matches!(
        pre,
        "llama3"
            | "llama-v3"
            | "llama-bpe"
            | "falcon3"
            | "falcon-h1"
            | "pixtral"
            | "midm-2.0"
            | "lfm2"
            | "jina-v5-nano"
            | "tekken"
            | "chameleon"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_names_have_regexes_and_unknown_names_none() {
        assert_eq!(pre_tokenizer("qwen2").map(|p| p.regexes), Some(vec![QWEN2]));
        assert_eq!(pre_tokenizer("default").map(|p| p.regexes.len()), Some(4));
        assert!(pre_tokenizer("lfm2").is_some_and(|p| p.ignore_merges));
        assert!(pre_tokenizer("no-such-pre").is_none());
    }
}
