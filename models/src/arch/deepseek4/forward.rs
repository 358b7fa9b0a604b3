//! The forward pass of a `deepseek4` model (llama.cpp's `llama_model_deepseek4::graph`), written in
//! [`Compute`] operations: the module's parent says what it computes.
//!
//! The layer states ([`Forward::layer_states`]): one per block, its cache of the shared K = V rows (as
//! keys and values alike); then, in block order, each compressed block's compressor state and each CSA
//! block's indexer-compressor state: a KV cache of one head whose key row is the token's KV row followed,
//! in an entry's last token, by the entry (normed and turned), and whose value row is the token's gate
//! row (with `ape`). Entries are computed once, by the call that completes them, and cutting the cache
//! cuts them with it, so a conversation read in several calls is the one read at once.
//!
//! The first MTP block is the draft block ([`Forward::forward_draft_block`], llama.cpp's `graph_mtp`),
//! which the main forward pass does not run; its state is its own window cache (layer 0 of a
//! [`Forward::draft_block_state`] state), and the trunk keeps its last streams for it
//! ([`Compute::keep_hidden`]).

use super::{Deepseek4Hparams, ARCH, CSA_RATIO, HCA_RATIO};
use crate::arch::common::hc_block_input;
use crate::arch::graph::{Forward, ModelInfo, StateSpec, TensorMap};
use crate::arch::{ArchError, Role};
use crate::compute::{
    Compute, Dsv4Attention, Dsv4AttnInputs, Dsv4Compressor, Dsv4Indexer, Dsv4IndexerInputs,
    Dsv4Moe, HyperConnection, SharedExpert, TailRope, Unary, WeightId,
};
use crate::gguf::Metadata;

/// A compressor's weights (the KV and gate projections; `spec` holds the rest).
#[derive(Clone, Debug)]
struct Compressor {
    wkv: WeightId,
    wgate: WeightId,
    spec: Dsv4Compressor,
}

/// A CSA block's lightning indexer.
#[derive(Clone, Debug)]
struct Indexer {
    attn_q_b: WeightId,
    proj: WeightId,
    comp: Compressor,
    rope: TailRope,
    n_head: usize,
    head_dim: usize,
    top_k: usize,
}

/// One trunk block.
#[derive(Clone, Debug)]
struct Block {
    hc_attn_fn: WeightId,
    hc_attn: HyperConnection,
    attn_norm: WeightId,
    q_a: WeightId,
    q_a_norm: WeightId,
    q_b: WeightId,
    kv: WeightId,
    kv_norm: WeightId,
    sinks: WeightId,
    out_a: WeightId,
    out_b: WeightId,
    rope: TailRope,
    comp: Option<Compressor>,
    indexer: Option<Indexer>,
    hc_ffn_fn: WeightId,
    hc_ffn: HyperConnection,
    ffn_norm: WeightId,
    moe: Dsv4Moe,
}

/// The MTP block run as the draft block: a window-only block like the trunk's and the `nextn.*`
/// tensors that feed it.
#[derive(Clone, Debug)]
struct NextnBlock {
    block: Block,
    eh_proj: WeightId,
    enorm: WeightId,
    hnorm: WeightId,
    /// Its own token embedding, when the file has one (else `token_embd`).
    embed_tokens: Option<WeightId>,
    /// Its own LM head, when the file has one (else `output`).
    head: Option<WeightId>,
    /// Its own final norm, when the file has one (else `output_norm`).
    head_norm: Option<WeightId>,
}

/// The forward pass of a `deepseek4` model.
#[derive(Clone, Debug)]
pub struct Deepseek4Graph {
    hp: Deepseek4Hparams,
    info: ModelInfo,
    tok_embd: WeightId,
    output_norm: WeightId,
    output: WeightId,
    hc_head_fn: WeightId,
    hc_head_base: WeightId,
    hc_head_scale: WeightId,
    blocks: Vec<Block>,
    /// The draft block, when the file has an MTP block llama.cpp's `graph_mtp` runs (boxed: a block
    /// is large beside the other graphs, and most files have none).
    nextn: Option<Box<NextnBlock>>,
    /// The extra layer states after the blocks' own, in order.
    extra_states: Vec<StateSpec>,
}

impl Deepseek4Hparams {
    /// The RoPE of block `il`'s heads (`dim` wide): the compressed blocks' base with YaRN when the
    /// file asks, the window-only blocks' base without.
    fn tail_rope(&self, dim: u32, compressed: bool) -> TailRope {
        let yarn = self.yarn.filter(|_| compressed);
        TailRope {
            head_dim: dim as usize,
            n_rot: self.n_rot as usize,
            freq_base: if compressed {
                self.compress_rope_freq_base
            } else {
                self.rope_freq_base
            },
            freq_scale: yarn.map_or(1.0, |y| 1.0 / y.factor),
            ext_factor: if yarn.is_some() { 1.0 } else { 0.0 },
            n_ctx_orig: yarn.map_or(0, |y| y.n_ctx_orig),
            beta_fast: yarn.map_or(0.0, |y| y.beta_fast),
            beta_slow: yarn.map_or(0.0, |y| y.beta_slow),
        }
    }
}

/// SwiGLU limits as llama.cpp applies them: only above 1e-6.
fn limit(x: f32) -> f32 {
    if x > 1e-6 {
        x
    } else {
        0.0
    }
}

impl Deepseek4Graph {
    /// Builds the forward pass from bound tensors.
    pub fn new(
        hp: Deepseek4Hparams,
        t: &TensorMap,
        md: &Metadata,
    ) -> Result<Deepseek4Graph, ArchError> {
        let n_layer = hp.n_layer as usize;
        let (d, di) = (hp.head_dim as usize, hp.indexer_head_dim as usize);
        let mut extra_states = Vec::new();
        let mut next_state = |width: usize, entry: usize| {
            extra_states.push(StateSpec::Kv {
                n_head_kv: 1,
                head_dim_k: width + entry,
                head_dim_v: width,
                window: None,
            });
            n_layer + extra_states.len() - 1
        };
        let hc = |fn_: Role, scale: Role, base: Role, il: u32| -> Result<_, ArchError> {
            Ok((
                t.layer(fn_, il)?,
                HyperConnection {
                    hc: hp.hc_mult as usize,
                    scale: t.layer(scale, il)?,
                    base: t.layer(base, il)?,
                    sinkhorn_iters: hp.hc_sinkhorn_iters as usize,
                    eps: hp.hc_eps,
                },
            ))
        };
        let mut block = |il: u32| -> Result<Block, ArchError> {
            let ratio = hp.ratio(il);
            let compressed = ratio != 0;
            let rope = hp.tail_rope(hp.head_dim, compressed);
            let comp = if compressed {
                let overlap = ratio == CSA_RATIO;
                let width = if overlap { 2 * d } else { d };
                Some(Compressor {
                    wkv: t.layer(Role::AttnCompressorKv, il)?,
                    wgate: t.layer(Role::AttnCompressorGate, il)?,
                    spec: Dsv4Compressor {
                        ratio: ratio as usize,
                        overlap,
                        dim: d,
                        ape: t.layer(Role::AttnCompressorApe, il)?,
                        norm: t.layer(Role::AttnCompressorNorm, il)?,
                        eps: hp.rms_eps,
                        rope,
                        hadamard: false,
                        state: next_state(width, d),
                    },
                })
            } else {
                None
            };
            let indexer = if ratio == CSA_RATIO {
                let rope = hp.tail_rope(hp.indexer_head_dim, true);
                Some(Indexer {
                    attn_q_b: t.layer(Role::IndexerAttnQB, il)?,
                    proj: t.layer(Role::IndexerProj, il)?,
                    comp: Compressor {
                        wkv: t.layer(Role::IndexerCompressorKv, il)?,
                        wgate: t.layer(Role::IndexerKpoolGate, il)?,
                        spec: Dsv4Compressor {
                            ratio: CSA_RATIO as usize,
                            overlap: true,
                            dim: di,
                            ape: t.layer(Role::IndexerKpoolApe, il)?,
                            norm: t.layer(Role::IndexerCompressorNorm, il)?,
                            eps: hp.rms_eps,
                            rope,
                            hadamard: true,
                            state: next_state(2 * di, di),
                        },
                    },
                    rope,
                    n_head: hp.indexer_n_head as usize,
                    head_dim: di,
                    top_k: hp.indexer_top_k as usize,
                })
            } else {
                None
            };
            debug_assert!(ratio == 0 || ratio == CSA_RATIO || ratio == HCA_RATIO);
            let hashed = il < hp.n_hash_layers;
            let moe = Dsv4Moe {
                router: t.layer(Role::FfnGateInp, il)?,
                gate_exps: t.layer(Role::FfnGateExps, il)?,
                up_exps: t.layer(Role::FfnUpExps, il)?,
                down_exps: t.layer(Role::FfnDownExps, il)?,
                n_expert: hp.n_expert as usize,
                n_expert_used: hp.n_expert_used as usize,
                selection_bias: if hashed {
                    None
                } else {
                    Some(t.layer(Role::FfnExpProbsB, il)?)
                },
                hash: if hashed {
                    Some(t.layer(Role::FfnGateTid2eid, il)?)
                } else {
                    None
                },
                norm_weights: hp.expert_weights_norm,
                weights_scale: hp.expert_weights_scale,
                clamp: limit(hp.swiglu_clamp_exp[il as usize]),
                shared: SharedExpert {
                    gate: t.layer(Role::FfnGateShexp, il)?,
                    up: t.layer(Role::FfnUpShexp, il)?,
                    down: t.layer(Role::FfnDownShexp, il)?,
                    gate_inp: None,
                    act: Unary::Silu,
                },
                clamp_shared: limit(hp.swiglu_clamp_shexp[il as usize]),
            };
            let (hc_attn_fn, hc_attn) =
                hc(Role::HcAttnFn, Role::HcAttnScale, Role::HcAttnBase, il)?;
            let (hc_ffn_fn, hc_ffn) = hc(Role::HcFfnFn, Role::HcFfnScale, Role::HcFfnBase, il)?;
            Ok(Block {
                hc_attn_fn,
                hc_attn,
                attn_norm: t.layer(Role::AttnNorm, il)?,
                q_a: t.layer(Role::AttnQA, il)?,
                q_a_norm: t.layer(Role::AttnQANorm, il)?,
                q_b: t.layer(Role::AttnQB, il)?,
                kv: t.layer(Role::AttnKv, il)?,
                kv_norm: t.layer(Role::AttnKvANorm, il)?,
                sinks: t.layer(Role::AttnSinks, il)?,
                out_a: t.layer(Role::AttnOutA, il)?,
                out_b: t.layer(Role::AttnOutB, il)?,
                rope,
                comp,
                indexer,
                hc_ffn_fn,
                hc_ffn,
                ffn_norm: t.layer(Role::FfnNorm, il)?,
                moe,
            })
        };
        let blocks = (0..hp.n_layer)
            .map(&mut block)
            .collect::<Result<Vec<_>, _>>()?;
        // llama.cpp's `graph_mtp` runs the first MTP block when the file has its projection (its loader
        // drops the MTP blocks otherwise), and only as a window-only block routed by the bias: a
        // compressed or hash-routed one it refuses, and this forward pass offers no draft block then.
        let il = hp.n_layer;
        let nextn = match t.layer_opt(Role::NextnEhProj, il) {
            Some(eh_proj) if hp.n_nextn > 0 && hp.ratio(il) == 0 && il >= hp.n_hash_layers => {
                Some(Box::new(NextnBlock {
                    block: block(il)?,
                    eh_proj,
                    enorm: t.layer(Role::NextnEnorm, il)?,
                    hnorm: t.layer(Role::NextnHnorm, il)?,
                    embed_tokens: t.layer_opt(Role::NextnEmbedTokens, il),
                    head: t.layer_opt(Role::NextnSharedHeadHead, il),
                    head_norm: t.layer_opt(Role::NextnSharedHeadNorm, il),
                }))
            }
            _ => None,
        };
        let info = ModelInfo::new(
            ARCH,
            hp.n_vocab as usize,
            hp.n_embd as usize,
            hp.n_ctx_train,
            md,
        )?;
        Ok(Deepseek4Graph {
            tok_embd: t.global_req(Role::TokenEmbd)?,
            output_norm: t.global_req(Role::OutputNorm)?,
            output: t.global_req(Role::Output)?,
            hc_head_fn: t.global_req(Role::HcHeadFn)?,
            hc_head_base: t.global_req(Role::HcHeadBase)?,
            hc_head_scale: t.global_req(Role::HcHeadScale)?,
            blocks,
            nextn,
            extra_states,
            info,
            hp,
        })
    }

    /// The hyperparameters.
    pub fn hparams(&self) -> &Deepseek4Hparams {
        &self.hp
    }

    /// A compressor's rows of `x`: its KV and gate projections.
    fn comp_rows<C: Compute>(&self, c: &mut C, m: &Compressor, x: &C::Act) -> (C::Act, C::Act) {
        let [kv, gate] = c.matmul_many([m.wkv, m.wgate], x);
        (kv, gate)
    }

    /// A block's attention (llama.cpp's `build_attention_impl`) on the normed input `x`.
    fn attention<C: Compute>(&self, c: &mut C, il: usize, b: &Block, x: &C::Act) -> C::Act {
        let hp = &self.hp;
        let (d, eps) = (hp.head_dim as usize, hp.rms_eps);
        let qr = c.matmul(b.q_a, x);
        let qr = c.rms_norm(&qr, Some(b.q_a_norm), eps, hp.q_lora_rank as usize);
        let q = c.matmul(b.q_b, &qr);
        let q = c.rms_norm(&q, None, eps, d);
        let q = c.rope_tail(&q, &b.rope, false);
        let kv = c.matmul(b.kv, x);
        let kv = c.rms_norm(&kv, Some(b.kv_norm), eps, d);
        let kv = c.rope_tail(&kv, &b.rope, false);
        let comp = b.comp.as_ref().map(|m| self.comp_rows(c, m, x));
        let indexer = b.indexer.as_ref().map(|ix| {
            let iq = c.matmul(ix.attn_q_b, &qr);
            let iq = c.rope_tail(&iq, &ix.rope, false);
            let w = c.matmul(ix.proj, x);
            let w = c.scale(&w, 1.0 / ((ix.head_dim * ix.n_head) as f32).sqrt());
            let (ikv, iscore) = self.comp_rows(c, &ix.comp, x);
            (iq, w, ikv, iscore)
        });
        let spec = Dsv4Attention {
            n_head: hp.n_head as usize,
            head_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
            window: hp.sliding_window as usize,
            sinks: b.sinks,
            comp: b.comp.as_ref().map(|m| m.spec),
            indexer: b.indexer.as_ref().map(|ix| Dsv4Indexer {
                n_head: ix.n_head,
                top_k: ix.top_k,
                comp: ix.comp.spec,
            }),
        };
        let inputs = Dsv4AttnInputs {
            q: &q,
            kv: &kv,
            comp: comp.as_ref().map(|(kv, g)| (kv, g)),
            indexer: indexer.as_ref().map(|(q, w, kv, s)| Dsv4IndexerInputs {
                q,
                weights: w,
                kv,
                score: s,
            }),
        };
        let out = c.dsv4_attention(il, inputs, &spec);
        let out = c.rope_tail(&out, &b.rope, true);
        let oa = c.matmul_groups(b.out_a, &out, hp.o_groups as usize);
        c.matmul(b.out_b, &oa)
    }

    /// One block on the mHC `streams`: its attention over layer state `attn_layer` and its experts
    /// (`moe_layer`: the file's block number), each between its stream mixing (llama.cpp's
    /// `build_hc_pre` and `build_hc_post`).
    fn block<C: Compute>(
        &self,
        c: &mut C,
        (attn_layer, moe_layer): (usize, usize),
        b: &Block,
        streams: &C::Act,
    ) -> C::Act {
        let (n_embd, eps) = (self.hp.n_embd as usize, self.hp.rms_eps);
        let (cur, w) = hc_block_input(c, streams, (b.hc_attn_fn, &b.hc_attn), (n_embd, eps));
        let cur = c.rms_norm(&cur, Some(b.attn_norm), eps, n_embd);
        let out = self.attention(c, attn_layer, b, &cur);
        let streams = c.hc_post(&out, streams, &w);
        let (cur, w) = hc_block_input(c, &streams, (b.hc_ffn_fn, &b.hc_ffn), (n_embd, eps));
        let cur = c.rms_norm(&cur, Some(b.ffn_norm), eps, n_embd);
        let out = c.dsv4_moe(moe_layer, &cur, &b.moe);
        c.hc_post(&out, &streams, &w)
    }

    /// A block's own state: its cache of the shared K = V rows.
    fn block_state(&self) -> StateSpec {
        let d = self.hp.head_dim as usize;
        StateSpec::Kv {
            n_head_kv: 1,
            head_dim_k: d,
            head_dim_v: d,
            window: None,
        }
    }

    /// The mHC head (llama.cpp's `build_hc_head`): one weight per stream, `sigmoid(s·m + b) + eps` with
    /// `m` the mixing of the normed flattened streams, then the streams' weighted sum.
    fn hc_head<C: Compute>(&self, c: &mut C, streams: &C::Act) -> C::Act {
        let hp = &self.hp;
        let (n_embd, hc) = (hp.n_embd as usize, hp.hc_mult as usize);
        let n = c.shape(streams).0;
        let flat = c.rms_norm(streams, None, hp.rms_eps, hc * n_embd);
        let mix = c.matmul(self.hc_head_fn, &flat);
        // The `[1]` scale as one column per row (the tensor read as a one-row embedding table).
        let scale = c.embed(self.hc_head_scale, &vec![0; n]);
        let pre = c.mul(&mix, &scale);
        let pre = c.add_weight(&pre, self.hc_head_base);
        let pre = c.unary(&pre, Unary::Sigmoid);
        let pre = c.scale_bias(&pre, 1.0, hp.hc_eps);
        // The streams' weighted sum, stream after stream (llama.cpp's `build_hc_pre` outside blocks).
        let mut sum: Option<C::Act> = None;
        for s in 0..hc {
            let w = c.cols(&pre, s, 1);
            let part = c.cols(streams, s * n_embd, n_embd);
            let weighted = c.mul(&part, &w);
            sum = Some(match sum {
                Some(acc) => c.add(&acc, &weighted),
                None => weighted,
            });
        }
        sum.expect("hyper_connection.count is 4")
    }
}

impl Forward for Deepseek4Graph {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn layer_states(&self) -> Vec<StateSpec> {
        let own = self.blocks.iter().map(|_| self.block_state());
        own.chain(self.extra_states.iter().copied()).collect()
    }

    /// The draft block's state: its window cache, one K = V head like the trunk's blocks.
    fn draft_block_state(&self) -> Option<StateSpec> {
        self.nextn.as_ref().map(|_| self.block_state())
    }

    /// The trunk's hidden row the draft block reads: the last block's streams, `hc·n_embd` wide.
    fn draft_block_hidden_width(&self) -> usize {
        (self.hp.hc_mult * self.hp.n_embd) as usize
    }

    /// llama.cpp's `graph_mtp`: the token's embedding (the block's own table, else the model's),
    /// RMS-normed (`enorm`) and repeated into every stream; the trunk's streams of the position before,
    /// each RMS-normed (`hnorm`); per stream the two concatenated in that order and projected by
    /// `eh_proj`, which gives the block's input streams. Then the block (its window cache at the
    /// token's position), the mHC head, the block's final norm (else `output_norm`) and its head (else
    /// `output`).
    fn forward_draft_block<C: Compute>(&self, c: &mut C, hidden: &[f32]) -> C::Act {
        let hp = &self.hp;
        let (n_embd, eps, hc) = (hp.n_embd as usize, hp.rms_eps, hp.hc_mult as usize);
        let nb = self
            .nextn
            .as_ref()
            .expect("forward_draft_block without a draft block");
        let (tokens, out_rows) = {
            let b = c.batch();
            (b.tokens.to_vec(), b.output_rows())
        };
        let e = c.embed(nb.embed_tokens.unwrap_or(self.tok_embd), &tokens);
        let e = c.rms_norm(&e, Some(nb.enorm), eps, n_embd);
        let e = c.repeat_heads(&e, n_embd, hc, false);
        let h = c.input(hidden, hc * n_embd);
        let h = c.rms_norm(&h, Some(nb.hnorm), eps, n_embd);
        // One row per token and stream (ggml's `[n_embd, hc, n]` read as rows), so that `eh_proj` maps
        // each stream's `[e | h]` as llama.cpp's one product over them does.
        let (e, h) = (c.reshape(&e, n_embd), c.reshape(&h, n_embd));
        let eh = c.concat_cols(&e, &h);
        let streams = c.matmul(nb.eh_proj, &eh);
        let streams = c.reshape(&streams, hc * n_embd);
        // Layer 0: the draft block's state has this one layer.
        let mut streams = self.block(c, (0, self.blocks.len()), &nb.block, &streams);
        if out_rows.len() < tokens.len() {
            streams = c.rows(&streams, &out_rows);
        }
        let cur = self.hc_head(c, &streams);
        let cur = c.rms_norm(
            &cur,
            Some(nb.head_norm.unwrap_or(self.output_norm)),
            eps,
            n_embd,
        );
        c.matmul(nb.head.unwrap_or(self.output), &cur)
    }

    fn forward<C: Compute>(&self, c: &mut C) -> C::Act {
        let hp = &self.hp;
        let (n_embd, eps, hc) = (hp.n_embd as usize, hp.rms_eps, hp.hc_mult as usize);
        let (tokens, out_rows) = {
            let b = c.batch();
            (b.tokens.to_vec(), b.output_rows())
        };
        let x = c.embed(self.tok_embd, &tokens);
        // The embedding repeated into every stream.
        let mut streams = c.repeat_heads(&x, n_embd, hc, false);
        for (il, b) in self.blocks.iter().enumerate() {
            // Every row goes through every block: the caches and compressor states need them all.
            streams = self.block(c, (il, il), b, &streams);
        }
        // The last streams, every row, feed the draft block's next call (llama.cpp's unmasked
        // `h_nextn`, taken before the mHC head and before the rows are picked).
        c.keep_hidden(&streams);
        if out_rows.len() < tokens.len() {
            streams = c.rows(&streams, &out_rows);
        }
        let cur = self.hc_head(c, &streams);
        let cur = c.rms_norm(&cur, Some(self.output_norm), eps, n_embd);
        c.matmul(self.output, &cur)
    }
}
