//! A GGUF vocabulary as a Hugging Face `tokenizer.json`, built so that the `tokenizers` crate gives
//! llama.cpp's ids.
//!
//! - `gpt2` (byte-level BPE): the GGUF's tokens (already in GPT-2's byte alphabet) and ranked merges,
//!   llama.cpp's pre-tokenizer regexes as `Split` steps, then `ByteLevel` without its own regex.
//! - `llama` (SentencePiece): llama.cpp merges the adjacent pair whose joined text is the token with the
//!   highest score. That is BPE whose merges are every split of a token into two tokens, ranked by the
//!   joined token's score, with byte fallback; spaces become `▁` first (and a leading `▁` when the file
//!   asks for a space prefix).
//!
//! - `gemma4` (BPE over raw UTF-8): spaces become `▁`, the text is split only at runs of newlines, and
//!   each part is merged by the GGUF's ranked merges with byte fallback. llama.cpp takes a run of newlines
//!   that is itself a token whole, without merges (a longer run is merged like any text): here every part
//!   that is a token is taken whole (`ignore_merges`), which for the other parts, whole lines, gives what
//!   the merges give whenever the line's token is reachable by them.
//!
//! Control, user-defined and unknown tokens are added tokens matched before the model runs (llama.cpp's
//! special-token partition); user-defined ones are not `special`, so they are split out even when special
//! tokens are not parsed, as in llama.cpp.

use super::pretokenize::pre_tokenizer;
use super::vocab::{GgufVocab, TokenKind, VocabModel};
use super::{Result, TextError};
use serde_json::{json, Map, Value};

/// The `tokenizer.json` document for `vocab`.
pub fn tokenizer_json(vocab: &GgufVocab) -> Result<Value> {
    let added: Vec<Value> = vocab
        .tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| vocab.kinds[*i].is_special())
        .map(|(i, t)| {
            json!({
                "id": i,
                "content": t,
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": false,
                "special": vocab.kinds[i] != TokenKind::UserDefined,
            })
        })
        .collect();
    let mut vocab_map = Map::with_capacity(vocab.tokens.len());
    for (i, t) in vocab.tokens.iter().enumerate() {
        vocab_map.insert(t.clone(), json!(i));
    }
    let (normalizer, pre_tok, model, decoder) = match vocab.model {
        VocabModel::BytePairGpt2 => byte_level_parts(vocab, vocab_map)?,
        VocabModel::SentencePiece => sentencepiece_parts(vocab, vocab_map)?,
        VocabModel::BytePairSpm => spm_bpe_parts(vocab, vocab_map),
    };
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tok,
        "post_processor": post_processor(vocab)?,
        "decoder": decoder,
        "model": model,
    }))
}

/// For `gemma4` only: the tokenizer that encodes with special-token texts left as text (llama.cpp's
/// `parse_special = false`). Its model takes a part that is a token whole (`ignore_merges`), so a line
/// reading `<end_of_turn>` would become the control token: here the control and unknown tokens' vocabulary
/// entries are renamed to texts no input has (their ids unchanged) and they are no added tokens.
pub fn literal_tokenizer_json(vocab: &GgufVocab) -> Result<Option<Value>> {
    if vocab.model != VocabModel::BytePairSpm {
        return Ok(None);
    }
    let mut doc = tokenizer_json(vocab)?;
    let control =
        |i: usize| vocab.kinds[i].is_special() && vocab.kinds[i] != TokenKind::UserDefined;
    if let Some(map) = doc["model"]["vocab"].as_object_mut() {
        for (i, t) in vocab.tokens.iter().enumerate().filter(|&(i, _)| control(i)) {
            if map.get(t).and_then(Value::as_u64) == Some(i as u64) {
                map.remove(t);
                // U+0000 is never in a request's text (the server refuses it in prompts' JSON strings
                // only as an escape, and the vocabulary's own tokens have none).
                map.insert(format!("\u{0}control-{i}"), json!(i));
            }
        }
    }
    if let Some(added) = doc["added_tokens"].as_array_mut() {
        added.retain(|a| a["id"].as_u64().is_some_and(|i| !control(i as usize)));
    }
    Ok(Some(doc))
}

type Parts = (Value, Value, Value, Value);

fn byte_level_parts(vocab: &GgufVocab, vocab_map: Map<String, Value>) -> Result<Parts> {
    let pre = pre_tokenizer(&vocab.pre).ok_or_else(|| {
        TextError::new(format!(
            "pre-tokenizer '{}' is not known to this server",
            vocab.pre
        ))
    })?;
    let mut steps: Vec<Value> = pre
        .regexes
        .iter()
        .map(|r| {
            json!({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": false})
        })
        .collect();
    steps.push(json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}));
    let merges = split_merges(vocab);
    let model = json!({
        "type": "BPE",
        "dropout": null,
        "unk_token": null,
        "continuing_subword_prefix": null,
        "end_of_word_suffix": null,
        "fuse_unk": false,
        "byte_fallback": false,
        "ignore_merges": pre.ignore_merges,
        "vocab": vocab_map,
        "merges": merges,
    });
    let decoder = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    Ok((
        Value::Null,
        json!({"type": "Sequence", "pretokenizers": steps}),
        model,
        decoder,
    ))
}

/// The GGUF's merges as pairs: llama.cpp splits a merge at the first space after its first character.
fn split_merges(vocab: &GgufVocab) -> Vec<Value> {
    vocab
        .merges
        .iter()
        .filter_map(|m| {
            let first = m.chars().next()?.len_utf8();
            let pos = m[first..].find(' ')? + first;
            Some(json!([&m[..pos], &m[pos + 1..]]))
        })
        .collect()
}

/// `gemma4`: llama.cpp's pre-tokenizer for it splits only at runs of newlines (`[^\n]+|[\n]+`), after
/// its whitespace escape turned every space into `▁`; merges over raw UTF-8, bytes as `<0xXX>` tokens
/// where a piece is not a token.
fn spm_bpe_parts(vocab: &GgufVocab, vocab_map: Map<String, Value>) -> Parts {
    let model = json!({
        "type": "BPE",
        "dropout": null,
        "unk_token": null,
        "continuing_subword_prefix": null,
        "end_of_word_suffix": null,
        "fuse_unk": false,
        "byte_fallback": true,
        "ignore_merges": true,
        "vocab": vocab_map,
        "merges": split_merges(vocab),
    });
    let split = json!({"type": "Split", "pattern": {"Regex": "[^\n]+|[\n]+"}, "behavior": "Isolated", "invert": false});
    (
        json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"}),
        split,
        model,
        json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
        ]}),
    )
}

fn sentencepiece_parts(vocab: &GgufVocab, vocab_map: Map<String, Value>) -> Result<Parts> {
    if vocab.scores.len() != vocab.tokens.len() {
        return Err(TextError::new("a SentencePiece vocabulary without scores"));
    }
    let ids = vocab.token_to_id();
    // Every split of a mergeable token into two tokens; rank by the joined token's score (highest first).
    let mut merges: Vec<(f32, u32, usize, &str, &str)> = Vec::new();
    for (id, text) in vocab.tokens.iter().enumerate() {
        if vocab.kinds[id].is_special() || ids.get(text.as_str()) != Some(&(id as u32)) {
            continue;
        }
        for (pos, _) in text.char_indices().skip(1) {
            let (left, right) = text.split_at(pos);
            if ids.contains_key(left) && ids.contains_key(right) {
                merges.push((vocab.scores[id], id as u32, pos, left, right));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let merges: Vec<Value> = merges.iter().map(|m| json!([m.3, m.4])).collect();
    let unk = vocab.text(vocab.unk_id);
    let model = json!({
        "type": "BPE",
        "dropout": null,
        "unk_token": unk,
        "continuing_subword_prefix": null,
        "end_of_word_suffix": null,
        "fuse_unk": true,
        "byte_fallback": true,
        "ignore_merges": false,
        "vocab": vocab_map,
        "merges": merges,
    });
    let mut norm = vec![json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"})];
    let mut dec = vec![
        json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if vocab.add_space_prefix {
        norm.insert(0, json!({"type": "Prepend", "prepend": "▁"}));
        dec.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    Ok((
        json!({"type": "Sequence", "normalizers": norm}),
        Value::Null,
        model,
        json!({"type": "Sequence", "decoders": dec}),
    ))
}

/// BOS before and EOS after the text when the vocabulary adds them (applied with `add_special_tokens`).
fn post_processor(vocab: &GgufVocab) -> Result<Value> {
    let mut single = Vec::new();
    let mut special = Map::new();
    let mut add = |id: Option<u32>, what: &str, list: &mut Vec<Value>| -> Result<()> {
        let text = vocab.text(id).ok_or_else(|| {
            TextError::new(format!(
                "the vocabulary adds {what} but has no {what} token"
            ))
        })?;
        list.push(json!({"SpecialToken": {"id": text, "type_id": 0}}));
        special.insert(
            text.to_string(),
            json!({"id": text, "ids": [id], "tokens": [text]}),
        );
        Ok(())
    };
    if vocab.add_bos {
        add(vocab.bos_id, "BOS", &mut single)?;
    }
    single.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
    if vocab.add_eos {
        add(vocab.eos_id, "EOS", &mut single)?;
    }
    let mut pair = single.clone();
    pair.push(json!({"Sequence": {"id": "B", "type_id": 1}}));
    Ok(json!({
        "type": "TemplateProcessing",
        "single": single,
        "pair": pair,
        "special_tokens": special,
    }))
}
