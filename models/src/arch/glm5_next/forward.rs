//! The forward pass of a `glm5-next` model (llama.cpp's `llama_model_glm5_next::graph`), written in
//! [`Compute`] operations: the module's parent says what it computes.
//!
//! The layer states ([`Forward::layer_states`]): one per trunk block (a KDA block's Q convolution and
//! its delta-rule matrices; an MLA block's cache of the normed KV latent, as keys and values alike),
//! then, in block order, each KDA block's K and V convolutions and each full-indexer block's indexer
//! cache (a KV cache of one head: as the key the layer-normed key and, in a pool's last cell, the pool's
//! key; the pool gate as the value; rounded to f16 as llama.cpp's cache rounds them). Every state is one the engine already
//! keeps, cuts, parks and restores, so a conversation read in several calls is the one read at once.
//!
//! The MTP block is not run (llama.cpp has no graph for it either). The SwiGLU limits
//! (`swiglu_clamp_*`) are read but not applied, as llama.cpp's graph does not apply them.

use super::{Glm5NextHparams, ARCH};
use crate::arch::common::hc_block_input;
use crate::arch::graph::{Forward, ModelInfo, StateSpec, TensorMap};
use crate::arch::{ArchError, ArchHparams, Role};
use crate::compute::{
    Attention, Compute, DeltaNet, DeltaNetInputs, HyperConnection, KPoolIndexer, Moe, SharedExpert,
    Unary, WeightId,
};
use crate::gguf::Metadata;

/// A KDA block's weights.
#[derive(Clone, Debug)]
struct Kda {
    wq: WeightId,
    wk: WeightId,
    wv: WeightId,
    conv_q: WeightId,
    conv_k: WeightId,
    conv_v: WeightId,
    f_a: WeightId,
    f_b: WeightId,
    beta: WeightId,
    /// `[n_head]`: `−exp(A_log)` per head.
    a: WeightId,
    dt_bias: WeightId,
    g_a: WeightId,
    g_b: WeightId,
    norm: WeightId,
    wo: WeightId,
    /// The layer states of the K and V convolutions (the Q convolution's is the block's own).
    k_state: usize,
    v_state: usize,
}

/// A full indexer's weights and the layer state of its cache.
#[derive(Clone, Debug)]
struct Indexer {
    k_norm: WeightId,
    k_norm_b: WeightId,
    proj: WeightId,
    attn_k: WeightId,
    attn_q_b: WeightId,
    gate: WeightId,
    spec: KPoolIndexer,
    state: usize,
}

/// An MLA block's weights; `indexer` is `None` where the block reuses the previous selection.
#[derive(Clone, Debug)]
struct Mla {
    q_a: WeightId,
    q_a_norm: WeightId,
    q_b: WeightId,
    kv_a: WeightId,
    kv_a_norm: WeightId,
    k_b: WeightId,
    v_b: WeightId,
    wo: WeightId,
    indexer: Option<Indexer>,
}

#[derive(Clone, Debug)]
enum Mixer {
    Kda(Kda),
    Mla(Mla),
}

#[derive(Clone, Debug)]
enum Ffn {
    Dense {
        gate: WeightId,
        up: WeightId,
        down: WeightId,
    },
    Moe(Moe, SharedExpert),
}

/// One trunk block.
#[derive(Clone, Debug)]
struct Block {
    hc_attn_fn: WeightId,
    hc_attn: HyperConnection,
    attn_norm: WeightId,
    mixer: Mixer,
    hc_ffn_fn: WeightId,
    hc_ffn: HyperConnection,
    ffn_norm: WeightId,
    ffn: Ffn,
}

/// The forward pass of a `glm5-next` model.
#[derive(Clone, Debug)]
pub struct Glm5NextGraph {
    hp: Glm5NextHparams,
    info: ModelInfo,
    tok_embd: WeightId,
    output_norm: WeightId,
    output: WeightId,
    blocks: Vec<Block>,
    /// The extra layer states after the blocks' own, in order.
    extra_states: Vec<StateSpec>,
}

impl Glm5NextGraph {
    /// Builds the forward pass from bound tensors.
    pub fn new(
        hp: Glm5NextHparams,
        t: &TensorMap,
        md: &Metadata,
    ) -> Result<Glm5NextGraph, ArchError> {
        let n_layer = hp.n_layer as usize;
        let d_conv = hp.ssm_conv_kernel as usize;
        let d_inner = hp.kda_inner() as usize;
        let mut extra_states = Vec::new();
        let next_state = |spec: StateSpec, extra: &mut Vec<StateSpec>| {
            extra.push(spec);
            n_layer + extra.len() - 1
        };
        let conv_state = StateSpec::Recurrent {
            conv_kernel: d_conv,
            conv_channels: d_inner,
            n_v_heads: 0,
            head_k: 0,
            head_v: 0,
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
        let mut blocks = Vec::with_capacity(n_layer);
        for il in 0..hp.n_layer {
            let mixer = if hp.is_recurrent(il) {
                let k_state = next_state(conv_state, &mut extra_states);
                let v_state = next_state(conv_state, &mut extra_states);
                Mixer::Kda(Kda {
                    wq: t.layer(Role::AttnQ, il)?,
                    wk: t.layer(Role::AttnK, il)?,
                    wv: t.layer(Role::AttnV, il)?,
                    conv_q: t.layer(Role::SsmConv1dQ, il)?,
                    conv_k: t.layer(Role::SsmConv1dK, il)?,
                    conv_v: t.layer(Role::SsmConv1dV, il)?,
                    f_a: t.layer(Role::SsmFA, il)?,
                    f_b: t.layer(Role::SsmFB, il)?,
                    beta: t.layer(Role::SsmBeta, il)?,
                    a: t.layer(Role::SsmA, il)?,
                    dt_bias: t.layer(Role::SsmDt, il)?,
                    g_a: t.layer(Role::SsmGA, il)?,
                    g_b: t.layer(Role::SsmGB, il)?,
                    norm: t.layer(Role::SsmNorm, il)?,
                    wo: t.layer(Role::AttnOut, il)?,
                    k_state,
                    v_state,
                })
            } else {
                let indexer = if hp.indexer_full[il as usize] {
                    let dim = hp.indexer_head_dim as usize;
                    // Key rows hold the token's key, then its pool's key in a pool's last cell.
                    let state = next_state(
                        StateSpec::Kv {
                            n_head_kv: 1,
                            head_dim_k: 2 * dim,
                            head_dim_v: dim,
                            window: None,
                        },
                        &mut extra_states,
                    );
                    Some(Indexer {
                        k_norm: t.layer(Role::IndexerKNorm, il)?,
                        k_norm_b: t.layer(Role::IndexerKNormBias, il)?,
                        proj: t.layer(Role::IndexerProj, il)?,
                        attn_k: t.layer(Role::IndexerAttnK, il)?,
                        attn_q_b: t.layer(Role::IndexerAttnQB, il)?,
                        gate: t.layer(Role::IndexerKpoolGate, il)?,
                        spec: KPoolIndexer {
                            n_head: hp.indexer_n_head as usize,
                            head_dim: dim,
                            kpool: hp.indexer_kpool as usize,
                            top_k: hp.indexer_top_k as usize,
                            select_tail: hp.indexer_select_tail,
                            ape: t.layer(Role::IndexerKpoolApe, il)?,
                        },
                        state,
                    })
                } else {
                    None
                };
                Mixer::Mla(Mla {
                    q_a: t.layer(Role::AttnQA, il)?,
                    q_a_norm: t.layer(Role::AttnQANorm, il)?,
                    q_b: t.layer(Role::AttnQB, il)?,
                    kv_a: t.layer(Role::AttnKvAMqa, il)?,
                    kv_a_norm: t.layer(Role::AttnKvANorm, il)?,
                    k_b: t.layer(Role::AttnKB, il)?,
                    v_b: t.layer(Role::AttnVB, il)?,
                    wo: t.layer(Role::AttnOut, il)?,
                    indexer,
                })
            };
            let ffn = if hp.dense_ffn(il) {
                Ffn::Dense {
                    gate: t.layer(Role::FfnGate, il)?,
                    up: t.layer(Role::FfnUp, il)?,
                    down: t.layer(Role::FfnDown, il)?,
                }
            } else {
                Ffn::Moe(
                    Moe {
                        router: t.layer(Role::FfnGateInp, il)?,
                        gate_exps: t.layer(Role::FfnGateExps, il)?,
                        up_exps: t.layer(Role::FfnUpExps, il)?,
                        down_exps: t.layer(Role::FfnDownExps, il)?,
                        n_expert: hp.n_expert as usize,
                        n_expert_used: hp.n_expert_used as usize,
                        gating: hp.gating,
                        selection_bias: Some(t.layer(Role::FfnExpProbsB, il)?),
                        norm_weights: hp.expert_weights_norm,
                        // llama.cpp scales only by a scale that is given (0: absent).
                        weights_scale: if hp.expert_weights_scale == 0.0 {
                            1.0
                        } else {
                            hp.expert_weights_scale
                        },
                        act: Unary::Silu,
                    },
                    SharedExpert {
                        gate: t.layer(Role::FfnGateShexp, il)?,
                        up: t.layer(Role::FfnUpShexp, il)?,
                        down: t.layer(Role::FfnDownShexp, il)?,
                        gate_inp: None,
                        act: Unary::Silu,
                    },
                )
            };
            let (hc_attn_fn, hc_attn) =
                hc(Role::HcAttnFn, Role::HcAttnScale, Role::HcAttnBase, il)?;
            let (hc_ffn_fn, hc_ffn) = hc(Role::HcFfnFn, Role::HcFfnScale, Role::HcFfnBase, il)?;
            blocks.push(Block {
                hc_attn_fn,
                hc_attn,
                attn_norm: t.layer(Role::AttnNorm, il)?,
                mixer,
                hc_ffn_fn,
                hc_ffn,
                ffn_norm: t.layer(Role::FfnNorm, il)?,
                ffn,
            });
        }
        let info = ModelInfo::new(
            ARCH,
            hp.n_vocab as usize,
            hp.n_embd as usize,
            hp.n_ctx_train,
            md,
        )?;
        Ok(Glm5NextGraph {
            tok_embd: t.global_req(Role::TokenEmbd)?,
            output_norm: t.global_req(Role::OutputNorm)?,
            output: t.global_req(Role::Output)?,
            blocks,
            extra_states,
            info,
            hp,
        })
    }

    /// The hyperparameters.
    pub fn hparams(&self) -> &Glm5NextHparams {
        &self.hp
    }

    /// A KDA block (llama.cpp's `build_kda_layer`) on the normed input `x`; block `il`'s own state holds
    /// the Q convolution and the delta rule.
    fn kda<C: Compute>(&self, c: &mut C, il: usize, m: &Kda, x: &C::Act) -> C::Act {
        let hp = &self.hp;
        let (n_head, hd) = (hp.n_head as usize, hp.kda_head_dim as usize);
        let n = c.shape(x).0;
        let [q, k, v] = c.matmul_many([m.wq, m.wk, m.wv], x);
        let q = c.ssm_conv_silu(il, &q, m.conv_q);
        let k = c.ssm_conv_silu(m.k_state, &k, m.conv_k);
        let v = c.ssm_conv_silu(m.v_state, &v, m.conv_v);
        // The decay's log per key channel: softplus(f_b(f_a(x)) + dt_bias)·A_h, or with a lower bound lb,
        // lb·sigmoid(−(f_b(f_a(x)) + dt_bias)·A_h).
        let f = c.matmul(m.f_a, x);
        let g1 = c.matmul(m.f_b, &f);
        let g1 = c.add_weight(&g1, m.dt_bias);
        // A as one row per token (each row of the `[n_head]` tensor read as an embedding row: the
        // tensor is one row), each head's value repeated over its channels.
        let a = c.embed(m.a, &vec![0; n]);
        let a = c.repeat_heads(&a, 1, hd, true);
        let gate = match hp.kda_gate_lower_bound {
            Some(lb) => {
                let g = c.mul(&g1, &a);
                let g = c.scale(&g, -1.0);
                let g = c.unary(&g, Unary::Sigmoid);
                c.scale(&g, lb)
            }
            None => {
                let g = c.unary(&g1, Unary::Softplus);
                c.mul(&g, &a)
            }
        };
        let beta = c.matmul(m.beta, x);
        let beta = c.unary(&beta, Unary::Sigmoid);
        // FLA's L2 norm, x/sqrt(Σx² + 1e-6), as llama.cpp's build_gdn_l2_norm writes it: an RMS norm of
        // eps/head_dim scaled by 1/sqrt(head_dim).
        let l2_eps = 1e-6 / hd as f32;
        let inv = 1.0 / (hd as f32).sqrt();
        let q = c.rms_norm(&q, None, l2_eps, hd);
        let q = c.scale(&q, inv);
        let k = c.rms_norm(&k, None, l2_eps, hd);
        let k = c.scale(&k, inv);
        let net = DeltaNet {
            n_v_heads: n_head,
            head_k: hd,
            head_v: hd,
        };
        let inputs = DeltaNetInputs {
            q: &q,
            k: &k,
            v: &v,
            gate: &gate,
            beta: &beta,
        };
        let o = c.gated_delta_net(il, inputs, &net);
        let ga = c.matmul(m.g_a, x);
        let g2 = c.matmul(m.g_b, &ga);
        let g2 = c.unary(&g2, Unary::Sigmoid);
        let normed = c.rms_norm(&o, Some(m.norm), hp.rms_eps, hd);
        let gated = c.mul(&normed, &g2);
        c.matmul(m.wo, &gated)
    }

    /// The indexer's selection for the rows of `x` (llama.cpp's `build_kpool_select`); `qr` is the
    /// normed Q latent.
    fn select<C: Compute>(&self, c: &mut C, ix: &Indexer, x: &C::Act, qr: &C::Act) -> C::Act {
        let hp = &self.hp;
        let q = c.matmul(ix.attn_q_b, qr);
        let k = c.matmul(ix.attn_k, x);
        let k = c.layer_norm(
            &k,
            Some(ix.k_norm),
            Some(ix.k_norm_b),
            hp.norm_eps.unwrap_or(0.0),
        );
        let gate = c.matmul(ix.gate, x);
        let w = c.matmul(ix.proj, x);
        let w = c.scale(
            &w,
            1.0 / ((hp.indexer_head_dim * hp.indexer_n_head) as f32).sqrt(),
        );
        c.kpool_select(ix.state, &q, &k, &gate, &w, &ix.spec)
    }

    /// An MLA block without RoPE over its latent cache (llama.cpp's `build_dsa_layer`), attending to
    /// the cells of its own indexer's selection, else of the previous block's (`sel`).
    fn mla<C: Compute>(
        &self,
        c: &mut C,
        il: usize,
        m: &Mla,
        x: &C::Act,
        sel: &mut Option<C::Act>,
    ) -> C::Act {
        let hp = &self.hp;
        let kv_lora = hp.kv_lora_rank as usize;
        let qr = c.matmul(m.q_a, x);
        let qr = c.rms_norm(&qr, Some(m.q_a_norm), hp.rms_eps, hp.q_lora_rank as usize);
        let q = c.matmul(m.q_b, &qr);
        let kv = c.matmul(m.kv_a, x);
        let kv = c.rms_norm(&kv, Some(m.kv_a_norm), hp.rms_eps, kv_lora);
        // Absorb k_b so the cache holds only the latent.
        let q = c.matmul_heads(m.k_b, &q);
        if let Some(ix) = &m.indexer {
            *sel = Some(self.select(c, ix, x, &qr));
        }
        let attn = Attention {
            n_head: hp.n_head as usize,
            n_head_kv: 1,
            head_dim_k: kv_lora,
            head_dim_v: kv_lora,
            scale: 1.0 / (hp.head_k_mla as f32).sqrt(),
            window: None,
            softcap: None,
            picture_rows_see_each_other: false,
        };
        let cells = sel
            .as_ref()
            .expect("validated: the first MLA block has a full indexer");
        let out = c.attention_cells(il, &q, &kv, &kv, &attn, cells);
        let out = c.matmul_heads(m.v_b, &out);
        c.matmul(m.wo, &out)
    }
}

impl Forward for Glm5NextGraph {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn layer_states(&self) -> Vec<StateSpec> {
        let hp = &self.hp;
        let hd = hp.kda_head_dim as usize;
        let kv_lora = hp.kv_lora_rank as usize;
        let own = self.blocks.iter().map(|b| match b.mixer {
            Mixer::Kda(_) => StateSpec::Recurrent {
                conv_kernel: hp.ssm_conv_kernel as usize,
                conv_channels: hp.kda_inner() as usize,
                n_v_heads: hp.n_head as usize,
                head_k: hd,
                head_v: hd,
            },
            Mixer::Mla(_) => StateSpec::Kv {
                n_head_kv: 1,
                head_dim_k: kv_lora,
                head_dim_v: kv_lora,
                window: None,
            },
        });
        own.chain(self.extra_states.iter().copied()).collect()
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
        let mut sel = None;
        for (il, b) in self.blocks.iter().enumerate() {
            // Every row goes through every block: the caches and states need them all.
            let (cur, w) = hc_block_input(c, &streams, (b.hc_attn_fn, &b.hc_attn), (n_embd, eps));
            let cur = c.rms_norm(&cur, Some(b.attn_norm), eps, n_embd);
            let out = match &b.mixer {
                Mixer::Kda(m) => self.kda(c, il, m, &cur),
                Mixer::Mla(m) => self.mla(c, il, m, &cur, &mut sel),
            };
            streams = c.hc_post(&out, &streams, &w);
            let (cur, w) = hc_block_input(c, &streams, (b.hc_ffn_fn, &b.hc_ffn), (n_embd, eps));
            let cur = c.rms_norm(&cur, Some(b.ffn_norm), eps, n_embd);
            let out = match &b.ffn {
                Ffn::Dense { gate, up, down } => {
                    let [g, u] = c.matmul_many([*gate, *up], &cur);
                    let h = c.glu(&g, &u, Unary::Silu);
                    c.matmul(*down, &h)
                }
                Ffn::Moe(moe, shared) => c.moe_shared(il, &cur, moe, shared),
            };
            streams = c.hc_post(&out, &streams, &w);
        }
        // Narrow to the rows whose logits are wanted, then the streams' mean.
        if out_rows.len() < tokens.len() {
            streams = c.rows(&streams, &out_rows);
        }
        let mut mean = c.cols(&streams, 0, n_embd);
        for s in 1..hc {
            let part = c.cols(&streams, s * n_embd, n_embd);
            mean = c.add(&mean, &part);
        }
        let mean = c.scale(&mean, 1.0 / hc as f32);
        let cur = c.rms_norm(&mean, Some(self.output_norm), eps, n_embd);
        c.matmul(self.output, &cur)
    }
}
