//! The named shapes `synth` writes: for each architecture `tiny` (a few MB, the small BPE vocabulary, for
//! tests), `small` (1–2 GB at 4 bits: the real widths and vocabulary with few layers, for CPU benchmarks)
//! and the real model's shape.

use poly_kernels::quant::GgmlType;

use crate::arch::deepseek4::{Yarn, CSA_RATIO, HCA_RATIO};
use crate::arch::qwen35moe::Qwen35Form;
use crate::arch::{
    deepseek4, gemma3, gemma4, glm5_next, lfm2moe, llama, qwen35moe, qwen3moe, Deepseek4Hparams,
    Gemma3Hparams, Gemma4Hparams, Glm5NextHparams, Lfm2MoeHparams, LlamaHparams, ModelHparams,
    Qwen35MoeHparams, Qwen3MoeHparams,
};
use crate::compute::Gating;

use super::vocab::SMALL_VOCAB_SIZE;

/// One named shape of one architecture.
#[derive(Clone, Debug, PartialEq)]
pub struct Shape {
    /// `general.architecture`.
    pub arch: &'static str,
    /// The name `--shape` takes (matched case-insensitively).
    pub name: &'static str,
    /// Other accepted names.
    pub aliases: &'static [&'static str],
    /// One line for `--list-shapes`.
    pub description: &'static str,
    /// Weight type of the quantizable tensors when `--type` is not given.
    pub default_type: GgmlType,
    /// The hyperparameters (vocabulary size included: the small BPE vocabulary is padded up to it).
    pub hparams: ModelHparams,
}

/// Context length written into tiny files.
const TINY_CONTEXT: u32 = 4096;

fn qwen3moe_real(n_layer: u32, n_vocab: u64) -> Qwen3MoeHparams {
    // Qwen/Qwen3-30B-A3B config.json.
    Qwen3MoeHparams {
        n_vocab,
        n_ctx_train: 40960,
        n_embd: 2048,
        n_layer,
        n_ff: 6144,
        n_head: 32,
        n_head_kv: 4,
        head_dim: 128,
        n_expert: 128,
        n_expert_used: 8,
        n_ff_exp: 768,
        rope_freq_base: 1_000_000.0,
        rms_eps: 1e-6,
    }
}

fn qwen35moe_real(n_layer: u32, full_attention_interval: u32) -> Qwen35MoeHparams {
    // Qwen/Qwen3.6-35B-A3B (= Qwen3.5-35B-A3B) text config: hidden 2048, 40 layers (3 gated delta-net : 1
    // gated attention), 256 experts + 1 shared (512 wide), 8 used, 16 Q / 2 KV heads of 256 (a quarter
    // rotated, mrope sections 11/11/10), delta-net 16 key / 32 value heads of 128 with a 4-tap conv, one
    // MTP block, vocabulary 248320, rope_theta 1e7.
    Qwen35MoeHparams {
        n_vocab: 248_320,
        n_ctx_train: 262_144,
        n_embd: 2048,
        n_layer,
        n_nextn: 1,
        n_head: 16,
        n_head_kv: 2,
        head_dim: 256,
        rope_dim: 64,
        rope_sections: [11, 11, 10, 0],
        rope_freq_base: 10_000_000.0,
        rms_eps: 1e-6,
        n_expert: 256,
        n_expert_used: 8,
        n_ff_exp: 512,
        n_ff_shexp: 512,
        ssm_conv_kernel: 4,
        ssm_state_size: 128,
        ssm_group_count: 16,
        ssm_time_step_rank: 32,
        ssm_inner_size: 4096,
        full_attention_interval,
        recurrent_layers: None,
        form: Qwen35Form::Qwen35,
    }
}

fn gemma3_270m() -> Gemma3Hparams {
    // google/gemma-3-270m config.json.
    Gemma3Hparams {
        n_vocab: 262_144,
        n_ctx_train: 32768,
        n_embd: 640,
        n_layer: 18,
        n_ff: 2048,
        n_head: 4,
        n_head_kv: 1,
        head_dim: 256,
        rms_eps: 1e-6,
        rope_freq_base: 1_000_000.0,
        rope_freq_base_swa: 10_000.0,
        sliding_window: 512,
        swa_pattern: 6,
        final_logit_softcapping: None,
    }
}

fn smollm2_135m() -> LlamaHparams {
    // HuggingFaceTB/SmolLM2-135M-Instruct config.json.
    LlamaHparams {
        n_vocab: 49_152,
        n_ctx_train: 8192,
        n_embd: 576,
        n_layer: 30,
        n_ff: 1536,
        n_head: 9,
        n_head_kv: 3,
        head_dim: 64,
        rms_eps: 1e-5,
        rope_freq_base: 100_000.0,
        tied_output: true,
        rope_freqs: false,
        biases: false,
    }
}

/// The `tiny` llama shape.
fn llama_tiny(v: u64) -> LlamaHparams {
    LlamaHparams {
        n_vocab: v,
        n_ctx_train: TINY_CONTEXT,
        n_embd: 256,
        n_layer: 4,
        n_ff: 512,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 64,
        rms_eps: 1e-5,
        rope_freq_base: 10_000.0,
        // A separate output matrix, whose logit scale synth sets apart from the embedding's.
        tied_output: false,
        rope_freqs: false,
        biases: false,
    }
}

/// Every shape, in `--list-shapes` order.
pub fn all_shapes() -> Vec<Shape> {
    let v = SMALL_VOCAB_SIZE as u64;
    vec![
        Shape {
            arch: qwen3moe::ARCH,
            name: "tiny",
            aliases: &[],
            description: "3 layers, 256 wide, 16 experts (4 used) of 256, small BPE vocabulary",
            default_type: GgmlType::Q8_0,
            hparams: ModelHparams::Qwen3Moe(Qwen3MoeHparams {
                n_vocab: v,
                n_ctx_train: TINY_CONTEXT,
                n_embd: 256,
                n_layer: 3,
                n_ff: 1024,
                n_head: 4,
                n_head_kv: 2,
                head_dim: 64,
                n_expert: 16,
                n_expert_used: 4,
                n_ff_exp: 256,
                rope_freq_base: 1_000_000.0,
                rms_eps: 1e-6,
            }),
        },
        Shape {
            arch: qwen3moe::ARCH,
            name: "small",
            aliases: &[],
            description: "Qwen3-30B-A3B widths and vocabulary, 4 layers",
            default_type: GgmlType::Q4_K,
            hparams: ModelHparams::Qwen3Moe(qwen3moe_real(4, 151_936)),
        },
        Shape {
            arch: qwen3moe::ARCH,
            name: "mix",
            aliases: &[],
            description: "8 layers, 2048 wide, 64 experts (8 used) of 768, vocabulary 4096: issue 24's file for llama-quantize's mixes (benchmarks/quant_mixes.sh)",
            default_type: GgmlType::Q4_K,
            hparams: ModelHparams::Qwen3Moe(Qwen3MoeHparams {
                n_expert: 64,
                ..qwen3moe_real(8, 4096)
            }),
        },
        Shape {
            arch: qwen3moe::ARCH,
            name: "qwen3-30b-a3b",
            aliases: &["30b-a3b"],
            description: "Qwen3-30B-A3B: 48 layers, 2048 wide, 128 experts (8 used) of 768, vocabulary 151936",
            default_type: GgmlType::Q4_K,
            hparams: ModelHparams::Qwen3Moe(qwen3moe_real(48, 151_936)),
        },
        Shape {
            arch: qwen35moe::ARCH,
            name: "tiny",
            aliases: &[],
            description: "3 delta-net + 1 full-attention layers + MTP, 256 wide, 8 experts (2 used) + shared",
            default_type: GgmlType::Q8_0,
            hparams: ModelHparams::Qwen35Moe(Qwen35MoeHparams {
                n_vocab: v,
                n_ctx_train: TINY_CONTEXT,
                n_embd: 256,
                n_layer: 4,
                n_nextn: 1,
                n_head: 4,
                n_head_kv: 2,
                head_dim: 64,
                rope_dim: 16,
                rope_sections: [3, 3, 2, 0],
                rope_freq_base: 10_000_000.0,
                rms_eps: 1e-6,
                n_expert: 8,
                n_expert_used: 2,
                n_ff_exp: 256,
                n_ff_shexp: 256,
                ssm_conv_kernel: 4,
                ssm_state_size: 64,
                ssm_group_count: 2,
                ssm_time_step_rank: 4,
                ssm_inner_size: 256,
                full_attention_interval: 4,
                recurrent_layers: None,
                form: Qwen35Form::Qwen35,
            }),
        },
        Shape {
            arch: qwen35moe::ARCH,
            name: "small",
            aliases: &[],
            description: "Qwen3.6-35B-A3B widths and vocabulary: 1 delta-net + 1 full-attention layer + MTP",
            default_type: GgmlType::Q4_K,
            hparams: ModelHparams::Qwen35Moe(qwen35moe_real(2, 2)),
        },
        Shape {
            arch: qwen35moe::ARCH,
            name: "qwen3.6-35b-a3b",
            aliases: &["qwen3.5-35b-a3b", "35b-a3b"],
            description: "Qwen3.6-35B-A3B: 40 layers (30 delta-net, 10 full attention) + MTP, 256 experts (8 used) of 512 + shared, vocabulary 248320",
            default_type: GgmlType::Q4_K,
            hparams: ModelHparams::Qwen35Moe(qwen35moe_real(40, 4)),
        },
        Shape {
            arch: gemma3::ARCH,
            name: "tiny",
            aliases: &[],
            description: "6 layers (5 sliding-window of 64, 1 global), 256 wide, FFN 512, small BPE vocabulary",
            default_type: GgmlType::Q8_0,
            hparams: ModelHparams::Gemma3(Gemma3Hparams {
                n_vocab: v,
                n_ctx_train: TINY_CONTEXT,
                n_embd: 256,
                n_layer: 6,
                n_ff: 512,
                n_head: 4,
                n_head_kv: 1,
                head_dim: 64,
                rms_eps: 1e-6,
                rope_freq_base: 1_000_000.0,
                rope_freq_base_swa: 10_000.0,
                sliding_window: 64,
                swa_pattern: 6,
                final_logit_softcapping: None,
            }),
        },
        Shape {
            arch: gemma3::ARCH,
            name: "small",
            aliases: &[],
            description: "Gemma-3-4B widths (2560, FFN 10240, 8/4 heads of 256) and vocabulary 262144, 12 layers",
            default_type: GgmlType::Q4_K,
            hparams: ModelHparams::Gemma3(Gemma3Hparams {
                n_vocab: 262_144,
                n_ctx_train: 131_072,
                n_embd: 2560,
                n_layer: 12,
                n_ff: 10240,
                n_head: 8,
                n_head_kv: 4,
                head_dim: 256,
                rms_eps: 1e-6,
                rope_freq_base: 1_000_000.0,
                rope_freq_base_swa: 10_000.0,
                sliding_window: 1024,
                swa_pattern: 6,
                final_logit_softcapping: None,
            }),
        },
        Shape {
            arch: gemma3::ARCH,
            name: "gemma3-270m",
            aliases: &["270m"],
            description: "Gemma-3-270M: 18 layers, 640 wide, FFN 2048, 4/1 heads of 256, sliding window 512, vocabulary 262144",
            default_type: GgmlType::Q8_0,
            hparams: ModelHparams::Gemma3(gemma3_270m()),
        },
        Shape {
            arch: llama::ARCH,
            name: "tiny",
            aliases: &[],
            description: "4 layers, 256 wide, FFN 512, 4/2 heads of 64, separate output, small BPE vocabulary",
            default_type: GgmlType::Q8_0,
            hparams: ModelHparams::Llama(llama_tiny(v)),
        },
        Shape {
            arch: llama::ARCH,
            name: "tiny-rope-freqs",
            aliases: &[],
            description: "tiny with Llama 3.1's rope_freqs.weight (RoPE frequency factors) and freq_base 500000",
            default_type: GgmlType::Q8_0,
            hparams: ModelHparams::Llama(LlamaHparams {
                rope_freq_base: 500_000.0,
                rope_freqs: true,
                ..llama_tiny(v)
            }),
        },
        Shape {
            arch: llama::ARCH,
            name: "tiny-bias",
            aliases: &[],
            description: "tiny with biases on the Q/K/V/output and FFN gate/up/down projections",
            default_type: GgmlType::Q8_0,
            hparams: ModelHparams::Llama(LlamaHparams {
                biases: true,
                ..llama_tiny(v)
            }),
        },
        Shape {
            arch: lfm2moe::ARCH,
            name: "tiny",
            aliases: &[],
            description: "4 layers (short conv, short conv, attention, short conv; the first with a dense FFN), 256 wide, 4 sigmoid-routed experts (2 used) of 256 with a selection bias, tied output",
            default_type: GgmlType::Q8_0,
            hparams: ModelHparams::Lfm2Moe(Lfm2MoeHparams {
                n_vocab: v,
                n_ctx_train: TINY_CONTEXT,
                n_embd: 256,
                n_layer: 4,
                n_ff: 256,
                n_head: 4,
                n_head_kv: 2,
                head_dim: 64,
                rope_dim: 64,
                rope_freq_base: 1_000_000.0,
                rms_eps: 1e-5,
                n_expert: 4,
                n_expert_used: 2,
                n_ff_exp: 256,
                n_dense_lead: 1,
                gating: Gating::Sigmoid,
                conv_l_cache: 3,
                attention_layers: vec![false, false, true, false],
            }),
        },
        Shape {
            arch: gemma4::ARCH,
            name: "tiny",
            aliases: &[],
            description: "3 layers (2 sliding-window of 64 with heads of 64, 1 global with heads of 128 and no V projection), 256 wide, a GELU MLP of 128 beside 4 experts (2 used) of 64, tied output",
            default_type: GgmlType::Q8_0,
            hparams: ModelHparams::Gemma4(gemma4_tiny(v)),
        },
        Shape {
            arch: gemma4::ARCH,
            name: "tiny-dense",
            aliases: &[],
            description: "the tiny shape without experts (Gemma 4 31B's form: a GELU MLP in every block)",
            default_type: GgmlType::Q8_0,
            hparams: ModelHparams::Gemma4(Gemma4Hparams {
                n_expert: 0,
                n_expert_used: 0,
                n_ff_exp: 0,
                n_ff: 256,
                ..gemma4_tiny(v)
            }),
        },
        Shape {
            arch: gemma4::ARCH,
            name: "gemma-4-26b-a4b",
            aliases: &["26b-a4b", "26b"],
            description: "Gemma-4-26B-A4B: 30 layers (25 sliding-window, 5 global), 2816 wide, MLP 2112 beside 128 experts (8 used) of 704, vocabulary 262144",
            default_type: GgmlType::Q4_K,
            hparams: ModelHparams::Gemma4(gemma4_26b_a4b()),
        },
        Shape {
            arch: glm5_next::ARCH,
            name: "tiny",
            aliases: &[],
            description: "4 layers (KDA, MLA with a full indexer, KDA, MLA reusing it) and an MTP block, 64 wide, 4 mHC streams, 2 heads, a dense first block, then 4 experts (2 used) of 64 and a shared one; indexer pools of 4, 16 cells kept",
            default_type: GgmlType::Q8_0,
            hparams: ModelHparams::Glm5Next(glm5_next_tiny(v)),
        },
        Shape {
            arch: deepseek4::ARCH,
            name: "tiny",
            aliases: &[],
            description: "4 layers (window only, CSA, HCA, CSA), 64 wide, 4 mHC streams, 4 heads of 128 (32 turning) sharing one K/V head, window 16, 2 output groups; 4 experts (2 used) of 32 and a shared one, the first block hash-routed; indexer of 8 heads of 64 keeping 16 entries",
            default_type: GgmlType::Q8_0,
            hparams: ModelHparams::Deepseek4(deepseek4_tiny(v)),
        },
        Shape {
            arch: deepseek4::ARCH,
            name: "tiny-mtp",
            aliases: &[],
            description: "the tiny shape and an MTP block after it (window only, routed by the bias): the draft block of --draft-block on",
            default_type: GgmlType::Q8_0,
            hparams: ModelHparams::Deepseek4(deepseek4_tiny_mtp(v)),
        },
        Shape {
            arch: deepseek4::ARCH,
            name: "deepseek-v4-flash",
            aliases: &["v4-flash", "flash"],
            description: "DeepSeek-V4-Flash (284B-A13B): 43 layers (2 window-only, then CSA and HCA alternating), 4096 wide, 64 heads of 512 sharing one K/V head, window 128, 256 experts (6 used) of 2048 and a shared one, the first 3 blocks hash-routed, vocabulary 129280",
            default_type: GgmlType::Q4_K,
            hparams: ModelHparams::Deepseek4(deepseek4_v4_flash()),
        },
        Shape {
            arch: llama::ARCH,
            name: "smollm2-135m",
            aliases: &["135m"],
            description: "SmolLM2-135M: 30 layers, 576 wide, FFN 1536, 9/3 heads of 64, tied output, vocabulary 49152",
            default_type: GgmlType::Q8_0,
            hparams: ModelHparams::Llama(smollm2_135m()),
        },
    ]
}

fn gemma4_26b_a4b() -> Gemma4Hparams {
    // google/gemma-4-26B-A4B: 30 blocks, every sixth global ((i + 1) % 6 == 0), 2816 wide; 16 heads,
    // sliding blocks 8 KV heads of 256 (window 1024, base 1e4), global blocks 2 KV heads of 512 without a
    // V projection (base 1e6, a quarter of each head turning); a dense GELU MLP of 2112 beside 128
    // experts (8 used) of 704; final logits capped at 30; vocabulary 262144.
    Gemma4Hparams {
        n_vocab: 262_144,
        n_ctx_train: 262_144,
        n_embd: 2816,
        n_layer: 30,
        n_ff: 2112,
        n_head: 16,
        n_head_kv_swa: 8,
        n_head_kv: 2,
        head_dim: 512,
        head_dim_swa: 256,
        n_rot: 512,
        n_rot_swa: 256,
        rms_eps: 1e-6,
        rope_freq_base: 1_000_000.0,
        rope_freq_base_swa: 10_000.0,
        sliding_window: 1024,
        swa_layers: (0..30).map(|i| (i + 1) % 6 != 0).collect(),
        n_expert: 128,
        n_expert_used: 8,
        n_ff_exp: 704,
        final_logit_softcapping: Some(30.0),
    }
}

fn gemma4_tiny(v: u64) -> Gemma4Hparams {
    Gemma4Hparams {
        n_vocab: v,
        n_ctx_train: TINY_CONTEXT,
        n_embd: 256,
        n_layer: 3,
        n_ff: 128,
        n_head: 2,
        n_head_kv_swa: 1,
        n_head_kv: 1,
        head_dim: 128,
        head_dim_swa: 64,
        n_rot: 128,
        n_rot_swa: 64,
        rms_eps: 1e-6,
        rope_freq_base: 1_000_000.0,
        rope_freq_base_swa: 10_000.0,
        sliding_window: 64,
        swa_layers: vec![true, true, false],
        n_expert: 4,
        n_expert_used: 2,
        n_ff_exp: 64,
        final_logit_softcapping: Some(30.0),
    }
}

fn glm5_next_tiny(v: u64) -> Glm5NextHparams {
    // 8 indexer heads: with 2, a pool's score is exactly 0 (every head's relu 0) often enough that a
    // token's top-k cut falls on a tie (16 of 100 tokens), which llama.cpp breaks in std::partial_sort's
    // order (tests/witness/glm5_next_reference.py). Small enough that a witness fixture is under 3 MB
    // even in F32: 64 wide, 4 trunk blocks, 2 heads, latents of 32, 4 experts.
    let n = 5;
    Glm5NextHparams {
        n_vocab: v,
        n_ctx_train: TINY_CONTEXT,
        n_embd: 64,
        n_layer: n - 1,
        n_nextn: 1,
        n_ff: 128,
        n_head: 2,
        rms_eps: 1e-6,
        norm_eps: Some(1e-6),
        recurrent: vec![true, false, true, false, false],
        ssm_conv_kernel: 4,
        kda_head_dim: 32,
        kda_gate_lower_bound: None,
        q_lora_rank: 32,
        kv_lora_rank: 32,
        head_k_mla: 32,
        head_v_mla: 32,
        indexer_n_head: 8,
        indexer_head_dim: 32,
        indexer_top_k: 16,
        indexer_kpool: 4,
        indexer_select_tail: true,
        indexer_full: vec![true, true, true, false],
        hc_mult: 4,
        hc_sinkhorn_iters: 20,
        hc_eps: 1e-6,
        n_expert: 4,
        n_expert_used: 2,
        n_ff_exp: 64,
        n_expert_shared: 1,
        n_dense_lead: 1,
        expert_weights_scale: 2.5,
        expert_weights_norm: true,
        gating: Gating::Sigmoid,
        swiglu_clamp_exp: vec![0.0; n as usize],
        swiglu_clamp_shexp: vec![0.0; n as usize],
    }
}

fn deepseek4_v4_flash() -> Deepseek4Hparams {
    // deepseek-ai/DeepSeek-V4-Flash config.json (as public ports read it): hidden 4096, 43 layers, 64
    // heads of 512 (64 turning), q_lora 1024, 8 output groups of 1024, window 128; compress_ratios 0 for
    // the first two layers, then 4 (CSA) and 128 (HCA) alternating; compressed blocks' RoPE base 160000
    // with YaRN (factor 16 over 65536), the window's 10000 without; indexer 64 heads of 128 keeping 512;
    // mHC 4 streams, 20 Sinkhorn iterations; 256 experts (6 used) of 2048, one shared, sqrt-softplus
    // scores renormalized and scaled by 1.5, SwiGLU limit 10, the first 3 layers hash-routed; vocabulary
    // 129280, context 1M.
    let n = 43;
    Deepseek4Hparams {
        n_vocab: 129_280,
        n_ctx_train: 1_048_576,
        n_embd: 4096,
        n_layer: n,
        n_nextn: 0,
        n_head: 64,
        head_dim: 512,
        n_rot: 64,
        rms_eps: 1e-6,
        rope_freq_base: 10_000.0,
        compress_rope_freq_base: 160_000.0,
        yarn: Some(Yarn {
            factor: 16.0,
            n_ctx_orig: 65_536,
            beta_fast: 32.0,
            beta_slow: 1.0,
        }),
        sliding_window: 128,
        q_lora_rank: 1024,
        o_groups: 8,
        o_lora_rank: 1024,
        compress_ratios: (0..n)
            .map(|il| match il {
                0 | 1 => 0,
                _ if il % 2 == 0 => CSA_RATIO,
                _ => HCA_RATIO,
            })
            .collect(),
        indexer_n_head: 64,
        indexer_head_dim: 128,
        indexer_top_k: 512,
        hc_mult: 4,
        hc_sinkhorn_iters: 20,
        hc_eps: 1e-6,
        n_hash_layers: 3,
        n_expert: 256,
        n_expert_used: 6,
        n_ff_exp: 2048,
        n_expert_shared: 1,
        expert_weights_scale: 1.5,
        expert_weights_norm: true,
        swiglu_clamp_exp: vec![10.0; n as usize],
        swiglu_clamp_shexp: vec![10.0; n as usize],
    }
}

fn deepseek4_tiny(v: u64) -> Deepseek4Hparams {
    // Every kind of block in four: window only, CSA, HCA, CSA. A window of 16 and an indexer keeping 16
    // entries: the compressed entries matter from a few dozen tokens on, the indexer chooses from 68
    // (HCA's entries come from 128); with a window of 8 and 4 kept entries llama.cpp's own one- and
    // two-thread runs differed by 0.03 in probability. Heads of 128 and indexer keys of 64: llama.cpp
    // turns the indexer's keys and queries by a Hadamard matrix of at least 64 (and the heads too when
    // both sizes are equal).
    // About 3 MB in F32: 64 wide, 4 experts of 32.
    let n = 4;
    Deepseek4Hparams {
        n_vocab: v,
        n_ctx_train: TINY_CONTEXT,
        n_embd: 64,
        n_layer: n,
        n_nextn: 0,
        n_head: 4,
        head_dim: 128,
        n_rot: 32,
        rms_eps: 1e-6,
        rope_freq_base: 10_000.0,
        compress_rope_freq_base: 160_000.0,
        yarn: None,
        sliding_window: 16,
        q_lora_rank: 32,
        o_groups: 2,
        o_lora_rank: 16,
        compress_ratios: vec![0, CSA_RATIO, HCA_RATIO, CSA_RATIO],
        indexer_n_head: 8,
        indexer_head_dim: 64,
        indexer_top_k: 16,
        hc_mult: 4,
        hc_sinkhorn_iters: 20,
        hc_eps: 1e-6,
        n_hash_layers: 1,
        n_expert: 4,
        n_expert_used: 2,
        n_ff_exp: 32,
        n_expert_shared: 1,
        expert_weights_scale: 1.5,
        expert_weights_norm: true,
        swiglu_clamp_exp: vec![10.0; n as usize],
        swiglu_clamp_shexp: vec![10.0; n as usize],
    }
}

/// [`deepseek4_tiny`] with one MTP block after the trunk, as llama.cpp's `graph_mtp` runs it: window
/// only (compress ratio 0) and routed by the selection bias. Its own shape, so that the tiny fixtures
/// (written without one) stay what the tiny shape writes.
fn deepseek4_tiny_mtp(v: u64) -> Deepseek4Hparams {
    let tiny = deepseek4_tiny(v);
    let with_mtp = |mut per_block: Vec<f32>| {
        per_block.push(per_block[0]);
        per_block
    };
    Deepseek4Hparams {
        n_nextn: 1,
        compress_ratios: [tiny.compress_ratios.clone(), vec![0]].concat(),
        swiglu_clamp_exp: with_mtp(tiny.swiglu_clamp_exp.clone()),
        swiglu_clamp_shexp: with_mtp(tiny.swiglu_clamp_shexp.clone()),
        ..tiny
    }
}

/// The shape `name` (case-insensitive, aliases accepted) of architecture `arch`.
pub fn find_shape(arch: &str, name: &str) -> Option<Shape> {
    all_shapes().into_iter().find(|s| {
        s.arch.eq_ignore_ascii_case(arch)
            && (s.name.eq_ignore_ascii_case(name)
                || s.aliases.iter().any(|a| a.eq_ignore_ascii_case(name)))
    })
}
