//! The forward-pass side of the architectures: what an engine needs to run a model.
//!
//! [`ModelGraph::from_file`] reads a file's hyperparameters, binds every tensor of the architecture's table
//! to its [`WeightId`] (checking names, shapes and types once, so the forward pass cannot meet a bad
//! tensor), and builds the architecture's graph. Every graph implements [`Forward`]:
//!
//! - [`Forward::forward`] runs one batch (the backend's [`Compute::batch`]) through the model, written in
//!   [`Compute`] operations so one forward pass serves every backend, and returns the logits of the rows
//!   the batch asks for (`[rows, n_vocab]`);
//! - [`Forward::layer_states`] says what sequence state each layer carries ([`StateSpec`]), so the engine
//!   can allocate, copy and restore it without knowing the architecture;
//! - [`Forward::info`] gives the vocabulary size, training context and special tokens.
//!
//! To add an architecture's forward pass: write a graph struct in `arch/<name>.rs` built from a
//! [`TensorMap`], implement [`Forward`] for it, add a [`ModelGraph`] variant and its arm in
//! [`ModelGraph::from_file`] and in the dispatching methods.

use std::collections::HashMap;

use super::{
    deepseek4, gemma3, gemma4, glm5_next, lfm2moe, llama, qwen35moe, qwen3moe, ArchError,
    ArchHparams, ModelHparams, Presence, Role, TensorClass,
};
use crate::compute::{Compute, WeightId};
use crate::gguf::{GgufFile, Metadata};

/// What sequence state one layer carries between forward calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateSpec {
    /// A KV cache: keys and values of every position seen so far (only the last `window` positions are
    /// ever read when `window` is set).
    Kv {
        n_head_kv: usize,
        head_dim_k: usize,
        head_dim_v: usize,
        window: Option<u32>,
    },
    /// A recurrent state of fixed size: the convolution's last `conv_kernel - 1` inputs of
    /// `conv_channels` values, and the delta rule's `[n_v_heads, head_v, head_k]` matrix (none, with
    /// `n_v_heads` 0, for a block that only convolves: LFM2's short convolution).
    Recurrent {
        conv_kernel: usize,
        conv_channels: usize,
        n_v_heads: usize,
        head_k: usize,
        head_v: usize,
    },
}

/// What an engine needs to know about a model besides its layers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelInfo {
    /// `general.architecture`.
    pub arch: &'static str,
    pub n_vocab: usize,
    pub n_embd: usize,
    /// The context length the model was trained with.
    pub n_ctx_train: u32,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// End of turn (`tokenizer.ggml.eot_token_id`), when the file names one.
    pub eot: Option<u32>,
}

impl ModelInfo {
    /// Reads the special tokens from `md`; the sizes come from the caller.
    pub fn new(
        arch: &'static str,
        n_vocab: usize,
        n_embd: usize,
        n_ctx_train: u32,
        md: &Metadata,
    ) -> Result<ModelInfo, ArchError> {
        let token = |key: &str| -> Result<Option<u32>, ArchError> {
            Ok(md.get_u32(key)?.filter(|&t| (t as usize) < n_vocab))
        };
        Ok(ModelInfo {
            arch,
            n_vocab,
            n_embd,
            n_ctx_train,
            bos: token("tokenizer.ggml.bos_token_id")?,
            eos: token("tokenizer.ggml.eos_token_id")?,
            eot: token("tokenizer.ggml.eot_token_id")?,
        })
    }

    /// Tokens that end a generation: end of sequence and end of turn.
    pub fn stop_tokens(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.eos.into_iter().chain(self.eot).collect();
        v.dedup();
        v
    }
}

/// The tensors of a model file bound to their roles: `(role, block)` → [`WeightId`].
#[derive(Clone, Debug, Default)]
pub struct TensorMap {
    ids: HashMap<(Role, Option<u32>), WeightId>,
}

impl TensorMap {
    /// The tensor of `role` outside the blocks, if the file has it.
    pub fn global(&self, role: Role) -> Option<WeightId> {
        self.ids.get(&(role, None)).copied()
    }

    /// The tensor of `role` in block `il`, if the file has it.
    pub fn layer_opt(&self, role: Role, il: u32) -> Option<WeightId> {
        self.ids.get(&(role, Some(il))).copied()
    }

    /// The tensor of `role` in block `il`; an error when absent.
    pub fn layer(&self, role: Role, il: u32) -> Result<WeightId, ArchError> {
        self.layer_opt(role, il)
            .ok_or_else(|| ArchError(format!("tensor {} is missing", role.name(il))))
    }

    /// The tensor of `role` outside the blocks; an error when absent.
    pub fn global_req(&self, role: Role) -> Result<WeightId, ArchError> {
        self.global(role)
            .ok_or_else(|| ArchError(format!("tensor {} is missing", role.name(0))))
    }
}

/// One MoE block's routed-expert tensors (each `[cols, rows, n_expert]`), as the architecture's tensor
/// table binds them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoutedExperts {
    /// The file's block number.
    pub block: u32,
    pub gate: WeightId,
    pub up: WeightId,
    pub down: WeightId,
}

impl TensorMap {
    /// The blocks among the first `n_blocks` whose gate, up and down expert tensors are all bound, in
    /// block order.
    pub fn routed_experts(&self, n_blocks: u32) -> Vec<RoutedExperts> {
        (0..n_blocks)
            .filter_map(|block| {
                Some(RoutedExperts {
                    block,
                    gate: self.layer_opt(Role::FfnGateExps, block)?,
                    up: self.layer_opt(Role::FfnUpExps, block)?,
                    down: self.layer_opt(Role::FfnDownExps, block)?,
                })
            })
            .collect()
    }
}

/// The routed experts of `file`'s MoE blocks, found through its architecture's tensor table (what an
/// expert cache holds; no tensor name is parsed): empty for a dense model.
pub fn routed_experts(file: &GgufFile) -> Result<Vec<RoutedExperts>, ArchError> {
    let (hp, tensors) = read_and_bind(file)?;
    Ok(tensors.routed_experts(hp.as_dyn().n_layer_all()))
}

/// The file's hyperparameters and its tensors bound to them. An absurd block count is refused first,
/// before anything sizes or loops by it.
fn read_and_bind(file: &GgufFile) -> Result<(ModelHparams, TensorMap), ArchError> {
    file.check_counts()?;
    let hp = ModelHparams::from_metadata(file.metadata())?;
    let tensors = bind_tensors(hp.as_dyn(), file)?;
    Ok((hp, tensors))
}

/// Binds every tensor of the architecture's table to the file's tensor of that name, checking that each
/// required one exists, that each has the table's shape, and that the engine computes with its type.
pub fn bind_tensors(hp: &dyn ArchHparams, file: &GgufFile) -> Result<TensorMap, ArchError> {
    let arch = hp.arch_name();
    let index: HashMap<&str, usize> = file
        .tensor_infos()
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    let mut map = TensorMap::default();
    let blocks = (0..hp.n_layer_all()).map(Some);
    for layer in std::iter::once(None).chain(blocks) {
        for def in hp.tensor_defs() {
            match (layer, def.layers) {
                (None, None) => {}
                (Some(il), Some(sel)) if sel.selects(hp, il) => {}
                _ => continue,
            }
            let name = def.role.name(layer.unwrap_or(0));
            let Some(&i) = index.get(name.as_str()) else {
                if def.presence == Presence::Required {
                    return Err(ArchError(format!("{arch}: tensor {name} is missing")));
                }
                continue;
            };
            let info = &file.tensor_infos()[i];
            let want: Vec<u64> = def
                .dims
                .iter()
                .map(|&d| {
                    hp.dim(d).ok_or_else(|| {
                        ArchError(format!("{arch}: dimension {d:?} of {name} is not defined"))
                    })
                })
                .collect::<Result<_, _>>()?;
            if !same_shape(&info.dims, &want) {
                return Err(ArchError(format!(
                    "{arch}: tensor {name} has shape {:?}, the model needs {want:?}",
                    info.dims
                )));
            }
            if def.class == TensorClass::Index {
                // An integer table is read as integers, never as a product's weight.
                let fixed = poly_kernels::quant::GgmlType::I32;
                if info.ty != fixed {
                    return Err(ArchError(format!(
                        "{arch}: tensor {name} is of type {}, the model needs {fixed}",
                        info.ty
                    )));
                }
            } else if info.ty.ops().is_none() || info.ty.bytes_for(info.row_len()).is_none() {
                return Err(ArchError(format!(
                    "{arch}: tensor {name} is of type {}, which the engine does not compute with",
                    info.ty
                )));
            }
            map.ids.insert((def.role, layer), WeightId(i as u32));
        }
    }
    Ok(map)
}

/// Whether two shapes are equal up to trailing dimensions of 1.
fn same_shape(a: &[u64], b: &[u64]) -> bool {
    let n = a.len().max(b.len());
    (0..n).all(|i| a.get(i).copied().unwrap_or(1) == b.get(i).copied().unwrap_or(1))
}

/// The forward pass of one architecture.
pub trait Forward {
    /// Sizes and special tokens.
    fn info(&self) -> &ModelInfo;

    /// The state each layer carries, by layer index (the `layer` argument of the stateful [`Compute`]
    /// operations).
    fn layer_states(&self) -> Vec<StateSpec>;

    /// Runs the backend's batch through the model; returns `[rows, n_vocab]` logits for the rows
    /// [`crate::compute::Batch::output_rows`] names.
    fn forward<C: Compute>(&self, c: &mut C) -> C::Act;

    /// The sections of the model's multi-section RoPE, when it has one: a picture's rows then sit at
    /// positions of their own (time, row, column: [`crate::vision::mrope_positions`]) and the text after
    /// a picture goes on from its span. `None`: the forward pass reads no pictures.
    fn multi_section_rope(&self) -> Option<[u32; 4]> {
        None
    }

    /// Whether the forward pass reads a picture's rows at plain consecutive positions, as text (Gemma 4:
    /// mtmd's `set_position_normal`), the rows' attention as [`crate::compute::Attention`] says.
    fn reads_pictures_in_line(&self) -> bool {
        false
    }

    /// The state of the file's own draft block (an MTP head after the trunk, run apart from it), if the
    /// model has one this forward pass runs: a state of this one layer, kept beside the trunk's.
    fn draft_block_state(&self) -> Option<StateSpec> {
        None
    }

    /// The width of the trunk's hidden rows the draft block reads: `n_embd`, or a row per mHC stream.
    fn draft_block_hidden_width(&self) -> usize {
        self.info().n_embd
    }

    /// Runs the backend's batch through the draft block: token `i` of the batch at position `pos0 + i`
    /// with `hidden`'s row `i` (`[n, draft_block_hidden_width]`), the trunk's hidden row ([`Compute::keep_hidden`]) of the
    /// position before it. Returns the draft's logits of the rows the batch asks for, which guess the
    /// token after each, extending the draft block's state (layer 0 of a
    /// [`Forward::draft_block_state`] state). Only called where that state is `Some`.
    fn forward_draft_block<C: Compute>(&self, _c: &mut C, _hidden: &[f32]) -> C::Act {
        unreachable!("forward_draft_block of a model without a draft block")
    }
}

/// The forward pass of any architecture whose forward is implemented.
#[derive(Clone, Debug)]
pub enum ModelGraph {
    Qwen3Moe(qwen3moe::Qwen3MoeGraph),
    Gemma3(gemma3::Gemma3Graph),
    Qwen35Moe(qwen35moe::Qwen35MoeGraph),
    Llama(llama::LlamaGraph),
    Lfm2Moe(lfm2moe::Lfm2MoeGraph),
    Gemma4(gemma4::Gemma4Graph),
    Glm5Next(glm5_next::Glm5NextGraph),
    Deepseek4(deepseek4::Deepseek4Graph),
}

impl ModelGraph {
    /// Reads the file's architecture and builds its forward pass; an error for an unknown architecture,
    /// one whose forward pass is not implemented yet, or a file that does not match its architecture.
    pub fn from_file(file: &GgufFile) -> Result<ModelGraph, ArchError> {
        let (hp, tensors) = read_and_bind(file)?;
        match hp {
            ModelHparams::Qwen3Moe(h) => Ok(ModelGraph::Qwen3Moe(qwen3moe::Qwen3MoeGraph::new(
                h,
                &tensors,
                file.metadata(),
            )?)),
            ModelHparams::Gemma3(h) => Ok(ModelGraph::Gemma3(gemma3::Gemma3Graph::new(
                h,
                &tensors,
                file.metadata(),
            )?)),
            ModelHparams::Qwen35Moe(h) => Ok(ModelGraph::Qwen35Moe(
                qwen35moe::Qwen35MoeGraph::new(h, &tensors, file.metadata())?,
            )),
            ModelHparams::Llama(h) => Ok(ModelGraph::Llama(llama::LlamaGraph::new(
                h,
                &tensors,
                file.metadata(),
            )?)),
            ModelHparams::Lfm2Moe(h) => Ok(ModelGraph::Lfm2Moe(lfm2moe::Lfm2MoeGraph::new(
                h,
                &tensors,
                file.metadata(),
            )?)),
            ModelHparams::Gemma4(h) => Ok(ModelGraph::Gemma4(gemma4::Gemma4Graph::new(
                h,
                &tensors,
                file.metadata(),
                file,
            )?)),
            ModelHparams::Glm5Next(h) => Ok(ModelGraph::Glm5Next(glm5_next::Glm5NextGraph::new(
                h,
                &tensors,
                file.metadata(),
            )?)),
            ModelHparams::Deepseek4(h) => Ok(ModelGraph::Deepseek4(
                deepseek4::Deepseek4Graph::new(h, &tensors, file.metadata())?,
            )),
        }
    }

    /// The tensors whose stored values are not the values the forward pass reads, each with the map from
    /// one to the other. A backend applies it where it reads the tensor as f32 values (the engine's
    /// `CpuWeights::f32`, which the card's vectors come from too); only vectors are mapped.
    pub fn value_maps(&self) -> Vec<(WeightId, ValueMap)> {
        match self {
            ModelGraph::Qwen35Moe(g) => g.value_maps(),
            ModelGraph::Qwen3Moe(_)
            | ModelGraph::Gemma3(_)
            | ModelGraph::Llama(_)
            | ModelGraph::Lfm2Moe(_)
            | ModelGraph::Gemma4(_)
            | ModelGraph::Glm5Next(_)
            | ModelGraph::Deepseek4(_) => Vec::new(),
        }
    }
}

/// How a tensor's stored values become the values a forward pass reads ([`ModelGraph::value_maps`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueMap {
    /// The file stores `log(-x)`: the value is `-exp(stored)` (Clover's `ssm_a`, which holds `A_log`
    /// where Qwen3.5/3.6 files hold `-exp(A_log)`, computed at conversion).
    NegExp,
}

impl ValueMap {
    /// Turns stored values into the forward pass's, in place.
    pub fn apply(self, values: &mut [f32]) {
        match self {
            ValueMap::NegExp => values.iter_mut().for_each(|v| *v = -v.exp()),
        }
    }
}

impl Forward for ModelGraph {
    fn info(&self) -> &ModelInfo {
        match self {
            ModelGraph::Qwen3Moe(g) => g.info(),
            ModelGraph::Gemma3(g) => g.info(),
            ModelGraph::Qwen35Moe(g) => g.info(),
            ModelGraph::Llama(g) => g.info(),
            ModelGraph::Lfm2Moe(g) => g.info(),
            ModelGraph::Gemma4(g) => g.info(),
            ModelGraph::Glm5Next(g) => g.info(),
            ModelGraph::Deepseek4(g) => g.info(),
        }
    }

    fn layer_states(&self) -> Vec<StateSpec> {
        match self {
            ModelGraph::Qwen3Moe(g) => g.layer_states(),
            ModelGraph::Gemma3(g) => g.layer_states(),
            ModelGraph::Qwen35Moe(g) => g.layer_states(),
            ModelGraph::Llama(g) => g.layer_states(),
            ModelGraph::Lfm2Moe(g) => g.layer_states(),
            ModelGraph::Gemma4(g) => g.layer_states(),
            ModelGraph::Glm5Next(g) => g.layer_states(),
            ModelGraph::Deepseek4(g) => g.layer_states(),
        }
    }

    fn forward<C: Compute>(&self, c: &mut C) -> C::Act {
        match self {
            ModelGraph::Qwen3Moe(g) => g.forward(c),
            ModelGraph::Gemma3(g) => g.forward(c),
            ModelGraph::Qwen35Moe(g) => g.forward(c),
            ModelGraph::Llama(g) => g.forward(c),
            ModelGraph::Lfm2Moe(g) => g.forward(c),
            ModelGraph::Gemma4(g) => g.forward(c),
            ModelGraph::Glm5Next(g) => g.forward(c),
            ModelGraph::Deepseek4(g) => g.forward(c),
        }
    }

    fn multi_section_rope(&self) -> Option<[u32; 4]> {
        match self {
            ModelGraph::Qwen35Moe(g) => g.multi_section_rope(),
            _ => None,
        }
    }

    fn reads_pictures_in_line(&self) -> bool {
        match self {
            ModelGraph::Gemma4(g) => g.reads_pictures_in_line(),
            _ => false,
        }
    }

    fn draft_block_state(&self) -> Option<StateSpec> {
        match self {
            ModelGraph::Qwen35Moe(g) => g.draft_block_state(),
            ModelGraph::Deepseek4(g) => g.draft_block_state(),
            _ => None,
        }
    }

    fn draft_block_hidden_width(&self) -> usize {
        match self {
            ModelGraph::Deepseek4(g) => g.draft_block_hidden_width(),
            _ => self.info().n_embd,
        }
    }

    fn forward_draft_block<C: Compute>(&self, c: &mut C, hidden: &[f32]) -> C::Act {
        match self {
            ModelGraph::Qwen35Moe(g) => g.forward_draft_block(c, hidden),
            ModelGraph::Deepseek4(g) => g.forward_draft_block(c, hidden),
            _ => unreachable!("forward_draft_block of a model without a draft block"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_compare_up_to_trailing_ones() {
        assert!(same_shape(&[4, 1], &[4]));
        assert!(same_shape(&[4, 3], &[4, 3, 1]));
        assert!(!same_shape(&[4, 3], &[3, 4]));
        assert!(!same_shape(&[4], &[4, 2]));
    }
}
