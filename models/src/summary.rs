//! What a GGUF model file is, in the facts `poly-engine inspect` prints and the model registry shows:
//! architecture, names, size label, tensor types, and how its bytes divide between routed experts (what an
//! expert cache holds) and everything else (what must sit in VRAM).

use crate::gguf::{Array, GgufFile, Value};
use poly_kernels::GgmlType;
use std::collections::BTreeMap;

/// Count and bytes of the tensors of one type.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TypeShare {
    pub tensors: usize,
    pub bytes: u64,
}

/// The facts of one model file (all parts of a split model together).
#[derive(Clone, Debug)]
pub struct ModelSummary {
    pub architecture: String,
    pub name: Option<String>,
    pub size_label: Option<String>,
    pub file_bytes: u64,
    pub n_parts: usize,
    pub gguf_version: u32,
    pub n_metadata: usize,
    pub n_tensors: usize,
    pub n_elements: u64,
    pub block_count: Option<u32>,
    pub context_length: Option<u32>,
    pub embedding_length: Option<u32>,
    /// Tensors and bytes per type, ordered by type id.
    pub types: BTreeMap<GgmlType, TypeShare>,
    /// Bytes of routed experts (`*_exps` tensors; a shared expert is not routed).
    pub expert_bytes: u64,
    /// Bytes of everything else: what must be resident before any expert.
    pub other_bytes: u64,
    /// Routed experts per MoE layer (`<arch>.expert_count`, else the experts dimension of an `*_exps`
    /// tensor); `None` for a dense model.
    pub n_experts: Option<u64>,
    /// Experts each token routes to (`<arch>.expert_used_count`).
    pub n_experts_used: Option<u32>,
    /// The type holding most routed-expert bytes.
    pub expert_type: Option<GgmlType>,
    /// The type holding most bytes overall.
    pub main_type: Option<GgmlType>,
    /// Whether the file carries a multi-token-prediction (nextn) block.
    pub has_mtp: bool,
    pub chat_template: bool,
    pub tokenizer_model: Option<String>,
    pub vocab_size: Option<usize>,
}

/// Whether tensor `name` holds routed experts (llama.cpp's `ffn_{gate,up,down,gate_up}_exps`).
pub fn is_routed_expert(name: &str) -> bool {
    name.contains("_exps.")
}

impl ModelSummary {
    /// Gathers the facts of `file`. Only the architecture is required; missing optional keys stay `None`.
    pub fn of(file: &GgufFile) -> Result<ModelSummary, crate::gguf::GgufError> {
        let md = file.metadata();
        let architecture = md.architecture()?.to_string();
        // Refused here too, so `inspect`, the server's registry and the engine's load all say so.
        file.check_counts()?;
        let mut types: BTreeMap<GgmlType, TypeShare> = BTreeMap::new();
        let mut expert_types: BTreeMap<GgmlType, u64> = BTreeMap::new();
        let (mut expert_bytes, mut other_bytes, mut n_elements) = (0u64, 0u64, 0u64);
        let mut experts_dim = None;
        for info in file.tensor_infos() {
            let share = types.entry(info.ty).or_default();
            share.tensors += 1;
            share.bytes += info.n_bytes;
            n_elements = n_elements.saturating_add(info.n_elements());
            if is_routed_expert(&info.name) {
                expert_bytes += info.n_bytes;
                *expert_types.entry(info.ty).or_default() += info.n_bytes;
                experts_dim = experts_dim.or(info.dims.get(2).copied());
            } else {
                other_bytes += info.n_bytes;
            }
        }
        let largest =
            |m: &BTreeMap<GgmlType, u64>| m.iter().max_by_key(|(_, b)| **b).map(|(t, _)| *t);
        let by_bytes: BTreeMap<GgmlType, u64> = types.iter().map(|(t, s)| (*t, s.bytes)).collect();
        let n_experts = md
            .arch_u32_opt("expert_count")
            .ok()
            .flatten()
            .filter(|&n| n > 0)
            .map(u64::from)
            .or(experts_dim);
        Ok(ModelSummary {
            name: md.name().ok().flatten().map(str::to_string),
            size_label: md.size_label().ok().flatten().map(str::to_string),
            file_bytes: file.file_bytes(),
            n_parts: file.n_parts(),
            gguf_version: file.version(),
            n_metadata: md.len(),
            n_tensors: file.n_tensors(),
            n_elements,
            block_count: md.arch_u32_opt("block_count").ok().flatten(),
            context_length: md.arch_u32_opt("context_length").ok().flatten(),
            embedding_length: md.arch_u32_opt("embedding_length").ok().flatten(),
            expert_type: largest(&expert_types),
            main_type: largest(&by_bytes),
            types,
            expert_bytes,
            other_bytes,
            n_experts,
            n_experts_used: md.arch_u32_opt("expert_used_count").ok().flatten(),
            has_mtp: md
                .arch_u32_opt("nextn_predict_layers")
                .ok()
                .flatten()
                .unwrap_or(0)
                > 0
                || file
                    .tensor_infos()
                    .iter()
                    .any(|t| t.name.contains(".nextn.")),
            chat_template: md.chat_template().ok().flatten().is_some(),
            tokenizer_model: md.tokenizer_model().ok().map(str::to_string),
            vocab_size: md.tokenizer_tokens().ok().map(<[String]>::len),
            architecture,
        })
    }
}

/// A one-line rendering of a metadata value for people: long arrays and strings are shortened.
pub fn short_value(value: &Value) -> String {
    fn clip(s: &str, max: usize) -> String {
        if s.chars().count() <= max {
            format!("{s:?}")
        } else {
            let head: String = s.chars().take(max).collect();
            format!("{head:?}… ({} chars)", s.chars().count())
        }
    }
    match value {
        Value::String(s) => clip(s, 60),
        Value::Array(a) => short_array(a),
        Value::U8(v) => v.to_string(),
        Value::I8(v) => v.to_string(),
        Value::U16(v) => v.to_string(),
        Value::I16(v) => v.to_string(),
        Value::U32(v) => v.to_string(),
        Value::I32(v) => v.to_string(),
        Value::U64(v) => v.to_string(),
        Value::I64(v) => v.to_string(),
        Value::F32(v) => v.to_string(),
        Value::F64(v) => v.to_string(),
        Value::Bool(v) => v.to_string(),
    }
}

fn short_array(a: &Array) -> String {
    const SHOWN: usize = 6;
    fn list<T: std::fmt::Debug>(v: &[T]) -> String {
        let items: Vec<String> = v.iter().take(SHOWN).map(|x| format!("{x:?}")).collect();
        let more = if v.len() > SHOWN { ", …" } else { "" };
        format!("[{}{more}]", items.join(", "))
    }
    let body = match a {
        Array::U8(v) => list(v),
        Array::I8(v) => list(v),
        Array::U16(v) => list(v),
        Array::I16(v) => list(v),
        Array::U32(v) => list(v),
        Array::I32(v) => list(v),
        Array::F32(v) => list(v),
        Array::Bool(v) => list(v),
        Array::String(v) => list(v),
        Array::Array(v) => {
            let items: Vec<String> = v.iter().take(SHOWN).map(short_array).collect();
            format!(
                "[{}{}]",
                items.join(", "),
                if v.len() > SHOWN { ", …" } else { "" }
            )
        }
        Array::U64(v) => list(v),
        Array::I64(v) => list(v),
        Array::F64(v) => list(v),
    };
    format!("{} × {}: {body}", a.len(), a.element_type().name())
}
