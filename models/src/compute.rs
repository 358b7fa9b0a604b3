//! The operations an architecture's forward pass is written in, and what a backend implements.
//!
//! An architecture (`arch/<name>.rs`) reads like llama.cpp's `src/models/<name>.cpp`: it calls these
//! operations in order on activations and weight handles, and never asks which device runs them. The CPU
//! backend (`poly-engine`) implements [`Compute`] over the memory-mapped file with `poly-kernels`; the GPU
//! backend will implement the same trait, so one forward pass serves both.
//!
//! Activations ([`Compute::Act`]) are row-major `[n_tokens, width]` f32 matrices: one row per token of the
//! batch. Weights are named by [`WeightId`] (the index of the tensor in the file), resolved once at load.
//! Stateful operations ([`Compute::attention`], [`Compute::ssm_conv`], [`Compute::gated_delta_net`]) read
//! and extend the state of the layer they are given, at the positions of the current [`Batch`]; the
//! backend owns that state (KV cache, recurrent states) so it can keep, park and restore it.
//!
//! Compound operations (a residual add with the next norm, a head norm with RoPE, several projections of one
//! input, ...) have default bodies made of the primitive operations ([`composed`]): a backend overrides them
//! only to run them in fewer launches, with the same values.

/// A weight tensor of the loaded file: its index in [`crate::gguf::GgufFile::tensor_infos`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WeightId(pub u32);

/// The tokens of one forward call: `tokens[i]` sits at position `pos0 + i` of the sequence.
#[derive(Clone, Debug)]
pub struct Batch<'a> {
    pub tokens: &'a [u32],
    pub pos0: u32,
    /// Which tokens' logits the forward pass returns.
    pub logits: Logits,
}

/// Which tokens of a batch get logits. The forward pass drops the other rows before the last layer's
/// feed-forward block (as llama.cpp does with `inp_out_ids`), so asking for fewer saves work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// None: the call only extends the sequence state (a prompt read in several calls).
    None,
    /// The last token's.
    Last,
    /// Every token's.
    All,
}

impl Batch<'_> {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The rows (indices into the batch) whose logits are returned, in order.
    pub fn output_rows(&self) -> Vec<usize> {
        match self.logits {
            Logits::None => Vec::new(),
            Logits::Last => self.len().checked_sub(1).into_iter().collect(),
            Logits::All => (0..self.len()).collect(),
        }
    }
}

/// An element-wise function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unary {
    /// `x·σ(x)`.
    Silu,
    /// GELU, tanh approximation, as ggml's CPU backend computes it (from an f16 table).
    Gelu,
    /// `σ(x) = 1/(1+e^{-x})`.
    Sigmoid,
    /// `ln(1+e^x)`.
    Softplus,
    /// `tanh(x)`.
    Tanh,
    /// `e^x`.
    Exp,
}

/// How rotary position embedding pairs the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeKind {
    /// Adjacent pairs `(2i, 2i+1)` (ggml's "normal" mode).
    Normal,
    /// Halves `(i, i + n_rot/2)` (GPT-NeoX mode: Qwen, Gemma).
    Neox,
}

/// Rotary position embedding of a `[n_tokens, n_heads * head_dim]` activation at the batch's positions.
/// Multi-section RoPE with text positions (every section at the token's position) equals [`RopeKind::Neox`]
/// over `n_rot` dimensions, so text-only models need nothing more.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    pub kind: RopeKind,
    pub head_dim: usize,
    /// Rotated dimensions of each head (the first `n_rot`; the rest pass through).
    pub n_rot: usize,
    pub freq_base: f32,
    /// Position scale (linear RoPE scaling): angle of position `p` uses `p * freq_scale`.
    pub freq_scale: f32,
    /// Per-pair frequency factors (`[n_rot / 2]` F32, Llama 3.1+'s `rope_freqs.weight`): pair `i`'s angle
    /// is divided by factor `i` before the position scale, as ggml's `ggml_rope_ext` with `freq_factors`.
    pub freq_factors: Option<WeightId>,
    /// Multi-section RoPE's sections (`rope.dimension_sections`, interleaved as Qwen3-VL's IMRoPE): where a
    /// call gives its rows four positions each (a picture's time, row and column), pair `i` turns by the
    /// one its sector names (`poly_kernels::ops::rope_multi`). `None`: one position a row.
    pub sections: Option<[u32; 4]>,
}

/// Causal attention of a batch over the layer's KV cache (which the call extends with the batch's K and V).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Attention {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    /// Multiplies `q·k` before the softmax.
    pub scale: f32,
    /// Sliding window: a token at position `p` sees positions `> p - window` (llama.cpp's standard SWA).
    pub window: Option<u32>,
    /// `cap·tanh(s/cap)` on the scaled scores `s = scale·q·k` before the softmax (as ggml's flash
    /// attention applies it).
    pub softcap: Option<f32>,
    /// Whether the rows of a picture read in the call see each other whatever their order (a row also
    /// sees the picture's later rows; before it, still only its window): Gemma 4's sliding-window
    /// layers, which llama.cpp's mtmd reads a picture into with causal attention off. Text is causal
    /// either way.
    pub picture_rows_see_each_other: bool,
}

/// How the router's logits become expert weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    Softmax,
    Sigmoid,
}

/// A mixture-of-experts feed-forward block: route, run each token's top-k experts (`down(act(gate·x) ·
/// up·x)`), and sum them weighted.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Moe {
    /// `[n_embd, n_expert]`.
    pub router: WeightId,
    /// `[n_embd, n_ff_exp, n_expert]`.
    pub gate_exps: WeightId,
    /// `[n_embd, n_ff_exp, n_expert]`.
    pub up_exps: WeightId,
    /// `[n_ff_exp, n_embd, n_expert]`.
    pub down_exps: WeightId,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub gating: Gating,
    /// A selection bias `[n_expert]` (F32; DeepSeek V3's and LFM2's `exp_probs_b`), added to the
    /// probabilities only to choose the experts: their weights are the unbiased probabilities.
    pub selection_bias: Option<WeightId>,
    /// Renormalize the chosen experts' weights to sum to one.
    pub norm_weights: bool,
    /// Multiplies the chosen experts' weights.
    pub weights_scale: f32,
    pub act: Unary,
}

/// A mixture-of-experts block in Gemma 4's form ([`Compute::fused_moe`]): the router reads an input of its
/// own, each expert's gate and up projections are one matrix, and each expert's output has a scale of its
/// own. As llama.cpp's `build_moe_ffn` computes it with precomputed logits (`probs_in`), `gate_up_exps`
/// and `down_exps_s`: route as [`Moe`] does, then each chosen expert's
/// `down(act(gate·x) ⊙ up·x) · down_scale[e]`, summed with its routing weight.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FusedMoe {
    /// `[n_embd, n_expert]`, applied to the router's input.
    pub router: WeightId,
    /// `[n_embd, 2·n_ff_exp, n_expert]`: each expert's gate rows, then its up rows.
    pub gate_up_exps: WeightId,
    /// `[n_ff_exp, n_embd, n_expert]`.
    pub down_exps: WeightId,
    /// `[n_expert]` (F32): multiplies each expert's output before its routing weight, when given.
    pub down_scale: Option<WeightId>,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub gating: Gating,
    /// Renormalize the chosen experts' weights to sum to one.
    pub norm_weights: bool,
    /// Multiplies the chosen experts' weights.
    pub weights_scale: f32,
    pub act: Unary,
}

/// A shared expert beside a MoE block's routed ones (Qwen3.5's): `down(act(gate·x) ⊙ up·x)`, scaled by
/// `sigmoid(gate_inp·x)` when it has that gate (`gate_inp` `[n_embd]`: one logit per token).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SharedExpert {
    pub gate: WeightId,
    pub up: WeightId,
    pub down: WeightId,
    pub gate_inp: Option<WeightId>,
    pub act: Unary,
}

/// The norm that follows a block's output in [`Compute::moe_add_rms_norm`]: the residual the output is added
/// to, then [`Compute::add_rms_norm`]'s weight, epsilon and group.
#[derive(Clone, Copy, Debug)]
pub struct NormAfter<'a, A> {
    pub residual: &'a A,
    pub weight: Option<WeightId>,
    pub eps: f32,
    pub group: usize,
}

/// The gated delta rule over the layer's recurrent state `S` (`[n_v_heads, head_v, head_k]`), as llama.cpp's
/// `build_delta_net` computes it (`src/models/delta-net-base.cpp`): for each token and head, with
/// `g = e^{gate}`, `S ← g·S`, then `S ← S + β·(v − S·k)·kᵀ`, output `S·q` (q scaled as llama.cpp does).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeltaNet {
    pub n_v_heads: usize,
    pub head_k: usize,
    pub head_v: usize,
}

/// The inputs of [`Compute::gated_delta_net`]: `q` and `k` `[n, n_v_heads·head_k]` (L2-normed, repeated to
/// the value heads), `v` `[n, n_v_heads·head_v]`, `gate` (log-decay) `[n, n_v_heads]`, or `[n,
/// n_v_heads·head_k]` for a decay per key channel (Kimi delta attention: `S[j][i] ← e^{gate[i]}·S[j][i]`;
/// only the CPU runs that form), and `beta` `[n, n_v_heads]`.
pub struct DeltaNetInputs<'a, A> {
    pub q: &'a A,
    pub k: &'a A,
    pub v: &'a A,
    pub gate: &'a A,
    pub beta: &'a A,
}

/// Hyper-connection residual streams (mHC, GLM5-Next's): `hc` streams of `n_embd` values per token, read
/// into a block's input and written back by weights computed per token from `mix` (the flattened streams'
/// RMS norm times the block's mixing matrix, `(2 + hc)·hc` values). See [`Compute::hc_pre`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HyperConnection {
    /// Streams.
    pub hc: usize,
    /// `[3]`: the scales of the pre, post and combination mixes.
    pub scale: WeightId,
    /// `[(2 + hc)·hc]`: their bias.
    pub base: WeightId,
    /// Sinkhorn iterations of the combination matrix.
    pub sinkhorn_iters: usize,
    pub eps: f32,
}

/// A k-pool sparse-attention indexer (GLM5-Next's DSA indexer), its cache in the state of the layer
/// [`Compute::kpool_select`] is given. See that operation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KPoolIndexer {
    pub n_head: usize,
    pub head_dim: usize,
    /// Cells per pool.
    pub kpool: usize,
    /// Cells a token keeps (a multiple of `kpool`): `top_k / kpool` pools.
    pub top_k: usize,
    /// A token also sees the cells of its own incomplete pool.
    pub select_tail: bool,
    /// `[head_dim, kpool]`: the pool position bias added to the gates.
    pub ape: WeightId,
}

impl KPoolIndexer {
    /// Most cells one token selects: the width of [`Compute::kpool_select`]'s result.
    pub fn max_cells(&self) -> usize {
        self.top_k / self.kpool * self.kpool + if self.select_tail { self.kpool - 1 } else { 0 }
    }
}

/// RoPE in ggml's normal mode (adjacent pairs) on the last `n_rot` values of each head, optionally with
/// YaRN (`ext_factor` above 0), as llama.cpp's `ggml_rope_ext` after `ggml_rope_set_offset(head_dim −
/// n_rot)` turns DeepSeek V4's heads. YaRN's magnitude correction is cancelled by the attention factor
/// llama.cpp passes with it, so only the angles change.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TailRope {
    pub head_dim: usize,
    pub n_rot: usize,
    pub freq_base: f32,
    pub freq_scale: f32,
    /// 0: no YaRN.
    pub ext_factor: f32,
    pub n_ctx_orig: u32,
    pub beta_fast: f32,
    pub beta_slow: f32,
}

/// DeepSeek V4's KV compressor of one block ([`Dsv4Attention::comp`]): every `ratio` tokens make one
/// entry, the per-channel softmax over its tokens' gate rows (the gate plus `ape`'s row of the token's
/// place in the block) weighing their KV rows; with `overlap` (ratio 4) the rows are two halves wide and
/// an entry also weighs the previous block's tokens by their first halves (its own by their second).
/// The entry is RMS-normed (`norm`, `eps`) and turned at its first token's position (`rope`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dsv4Compressor {
    pub ratio: usize,
    pub overlap: bool,
    /// The entry's width (the head size, or the indexer's key size).
    pub dim: usize,
    /// `[rows' width, ratio]`: the gate's position bias.
    pub ape: WeightId,
    pub norm: WeightId,
    pub eps: f32,
    pub rope: TailRope,
    /// The entries are turned by the normalized Walsh-Hadamard matrix before the cache keeps them (the
    /// lightning indexer's keys, as llama.cpp keeps them; the indexer turns its queries alike, which
    /// cancels in their products but not in the cache's rounding).
    pub hadamard: bool,
    /// The layer state holding the tokens' rows and the entries.
    pub state: usize,
}

/// DeepSeek V4's lightning indexer of a CSA block: scores each visible compressed entry `e` of its own
/// compressor as `Σ_h relu(q_h·k_e)·w_h` and keeps the `top_k` best.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dsv4Indexer {
    pub n_head: usize,
    pub top_k: usize,
    pub comp: Dsv4Compressor,
}

/// DeepSeek V4's attention of one block ([`Compute::dsv4_attention`]): `n_head` query heads over one
/// K = V head of `head_dim`, over the last `window` tokens and, with a compressor, its entries (every
/// visible one, or the indexer's choice), with a sink logit per head in the softmax.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dsv4Attention {
    pub n_head: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub window: usize,
    /// `[n_head]`: each head's sink logit.
    pub sinks: WeightId,
    pub comp: Option<Dsv4Compressor>,
    pub indexer: Option<Dsv4Indexer>,
}

/// The rows [`Compute::dsv4_attention`] reads: `q` `[n, n_head·head_dim]` and `kv` `[n, head_dim]`
/// (normed and turned); the compressor's KV and gate rows (gate without `ape`); the indexer's queries
/// `[n, heads·key]` (turned), head weights `[n, heads]` and its compressor's rows.
pub struct Dsv4AttnInputs<'a, A> {
    pub q: &'a A,
    pub kv: &'a A,
    pub comp: Option<(&'a A, &'a A)>,
    pub indexer: Option<Dsv4IndexerInputs<'a, A>>,
}

/// The indexer's rows of [`Dsv4AttnInputs`].
pub struct Dsv4IndexerInputs<'a, A> {
    pub q: &'a A,
    pub weights: &'a A,
    pub kv: &'a A,
    pub score: &'a A,
}

/// DeepSeek V4's experts ([`Compute::dsv4_moe`]): sqrt-softplus scores of the router, the experts chosen
/// by score plus `selection_bias`, or by the token's row of `hash` (I32 `[n_used, n_vocab]`); their
/// scores renormalized (`norm_weights`) and scaled; SwiGLU limited by `clamp` (0: none) in the routed
/// experts and `clamp_shared` in the shared one, which is added.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dsv4Moe {
    pub router: WeightId,
    pub gate_exps: WeightId,
    pub up_exps: WeightId,
    pub down_exps: WeightId,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub selection_bias: Option<WeightId>,
    pub hash: Option<WeightId>,
    pub norm_weights: bool,
    pub weights_scale: f32,
    pub clamp: f32,
    pub shared: SharedExpert,
    pub clamp_shared: f32,
}

/// What a backend without one of the operations only the CPU runs says, if a graph reached it: the
/// backend refuses such a graph at load ([`crate::arch::GraphUses::cpu_only`]), so this never runs.
fn cpu_only(op: &str) -> ! {
    panic!(
        "{op} is an operation this backend does not run; a graph that uses it is refused at load"
    )
}

/// The operations of a forward pass. Every method returns a new activation; inputs are not changed.
pub trait Compute {
    /// A `[n_tokens, width]` f32 activation.
    type Act;

    /// `(n_tokens, width)` of an activation.
    fn shape(&self, x: &Self::Act) -> (usize, usize);

    /// Rows of the embedding table `[n_embd, n_vocab]` for `tokens`, dequantized: `[n_tokens, n_embd]`.
    fn embed(&mut self, table: WeightId, tokens: &[u32]) -> Self::Act;

    /// `x·Wᵀ`: `x` is `[n, in]`, `w` is `[in, out]` (GGUF order), the result `[n, out]`.
    fn matmul(&mut self, w: WeightId, x: &Self::Act) -> Self::Act;

    /// RMS norm over each group of `group` columns (the whole row when `group` is the width; one head
    /// when it is the head size), times `weight` (`[group]`) when given.
    fn rms_norm(
        &mut self,
        x: &Self::Act,
        weight: Option<WeightId>,
        eps: f32,
        group: usize,
    ) -> Self::Act;

    /// L2 norm over each group of `group` columns: `x / max(‖x‖, eps)`.
    fn l2_norm(&mut self, x: &Self::Act, eps: f32, group: usize) -> Self::Act;

    /// `a + b`, same shapes.
    fn add(&mut self, a: &Self::Act, b: &Self::Act) -> Self::Act;

    /// `a ⊙ b`, same shapes; or `b` of width 1 broadcast over each row of `a`.
    fn mul(&mut self, a: &Self::Act, b: &Self::Act) -> Self::Act;

    /// `x + w` with a `[width]` weight broadcast over rows.
    fn add_weight(&mut self, x: &Self::Act, w: WeightId) -> Self::Act;

    /// `x ⊙ w` with a `[width]` weight broadcast over rows.
    fn mul_weight(&mut self, x: &Self::Act, w: WeightId) -> Self::Act;

    /// `s·x`.
    fn scale(&mut self, x: &Self::Act, s: f32) -> Self::Act;

    /// `s·x` on the rows that are token embeddings, the rows of a picture read in the call left as
    /// they are (Gemma 4 scales token embeddings by `√n_embd`, never a picture's rows, as llama.cpp's
    /// `ubatch.token ? sqrtf(n_embd) : 1.0f`). Without pictures: [`Compute::scale`].
    fn scale_token_rows(&mut self, x: &Self::Act, s: f32) -> Self::Act {
        self.scale(x, s)
    }

    /// `f(x)` element-wise.
    fn unary(&mut self, x: &Self::Act, f: Unary) -> Self::Act;

    /// Columns `start..start+len` of every row.
    fn cols(&mut self, x: &Self::Act, start: usize, len: usize) -> Self::Act;

    /// From rows made of `n_heads` groups of `parts·head` columns, part `part` of each group:
    /// `[n, n_heads·parts·head] → [n, n_heads·head]` (Qwen3.5's query and gate, interleaved per head).
    fn head_part(&mut self, x: &Self::Act, head: usize, parts: usize, part: usize) -> Self::Act;

    /// Each group of `head` columns repeated so `[n, n_heads·head]` becomes `[n, n_heads·times·head]`.
    /// Copy `r` of head `h` lands at head slot `h·times + r` when `interleave` (each head's copies side by
    /// side), else at `r·n_heads + h` (the whole row tiled `times` times: ggml_repeat's order, which makes
    /// slot `s` read head `s mod n_heads`, as llama.cpp's broadcasting of key heads over value heads does).
    fn repeat_heads(
        &mut self,
        x: &Self::Act,
        head: usize,
        times: usize,
        interleave: bool,
    ) -> Self::Act;

    /// The given rows, in order.
    fn rows(&mut self, x: &Self::Act, rows: &[usize]) -> Self::Act;

    /// RoPE at the batch's positions.
    fn rope(&mut self, x: &Self::Act, rope: &Rope) -> Self::Act;

    /// Causal attention for `layer`, extending its KV cache with `k` and `v` at the batch's positions.
    /// `q` is `[n, n_head·head_dim_k]`, `k` `[n, n_head_kv·head_dim_k]`, `v` `[n, n_head_kv·head_dim_v]`;
    /// the result is `[n, n_head·head_dim_v]`.
    fn attention(
        &mut self,
        layer: usize,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        attn: &Attention,
    ) -> Self::Act;

    /// A mixture-of-experts block on `x` (`[n, n_embd]`) for `layer`.
    fn moe(&mut self, layer: usize, x: &Self::Act, moe: &Moe) -> Self::Act;

    /// A MoE block in Gemma 4's form ([`FusedMoe`]) for `layer`: the experts run on `x`, the router on
    /// `router_x` (both `[n, n_embd]`).
    fn fused_moe(
        &mut self,
        layer: usize,
        x: &Self::Act,
        router_x: &Self::Act,
        moe: &FusedMoe,
    ) -> Self::Act;

    /// [`Compute::moe`] plus a shared expert on the same `x`: `moe + shared`. One operation so that a
    /// backend which hands a MoE layer over to the host in its middle can compute the shared expert while
    /// the host decides where the routed experts run.
    fn moe_shared(
        &mut self,
        layer: usize,
        x: &Self::Act,
        moe: &Moe,
        shared: &SharedExpert,
    ) -> Self::Act {
        composed::moe_shared(self, layer, x, moe, shared)
    }

    /// Causal depthwise convolution over time with the layer's conv state (the last `kernel - 1` inputs),
    /// which the call advances: `x` `[n, channels]`, `kernel` `[kernel, channels]`.
    fn ssm_conv(&mut self, layer: usize, x: &Self::Act, kernel: WeightId) -> Self::Act;

    /// The gated delta rule with the layer's recurrent state, which the call advances; the result is
    /// `[n, n_v_heads·head_v]`.
    fn gated_delta_net(
        &mut self,
        layer: usize,
        x: DeltaNetInputs<'_, Self::Act>,
        net: &DeltaNet,
    ) -> Self::Act;

    // ----- Operations only the CPU runs (GLM5-Next's) ----------------------------------------------------
    // A backend that lacks them keeps these bodies: the graphs using them are refused at load (what
    // [`crate::arch::ModelGraph::uses`] finds), so the bodies are never reached.

    /// Layer norm over each whole row: `(x − mean)/sqrt(var + eps) ⊙ weight + bias` (ggml's `norm`).
    fn layer_norm(
        &mut self,
        _x: &Self::Act,
        _weight: Option<WeightId>,
        _bias: Option<WeightId>,
        _eps: f32,
    ) -> Self::Act {
        cpu_only("layer_norm")
    }

    /// A block's input from the hyper-connection `streams` (`[n, hc·n_embd]`) and the per-token weights
    /// derived from `mix` (`[n, (2 + hc)·hc]`): returns `(Σ_s pre[s]·stream[s]` `[n, n_embd]`, the weights
    /// `[n, (2 + hc)·hc]` for [`Compute::hc_post`]), with `pre = sigmoid(s0·m + b) + eps`, `post =
    /// 2·sigmoid(s1·m + b)` and the Sinkhorn-normalized combination matrix (`poly_kernels::ops::hyper`).
    fn hc_pre(
        &mut self,
        _streams: &Self::Act,
        _mix: &Self::Act,
        _hc: &HyperConnection,
    ) -> (Self::Act, Self::Act) {
        cpu_only("hc_pre")
    }

    /// New hyper-connection streams from a block's output `x` (`[n, n_embd]`), the old `streams` and the
    /// weights [`Compute::hc_pre`] returned: `stream'[d] = post[d]·x + Σ_s comb(d, s)·stream[s]`.
    fn hc_post(&mut self, _x: &Self::Act, _streams: &Self::Act, _weights: &Self::Act) -> Self::Act {
        cpu_only("hc_post")
    }

    /// A product per head: `w` is `[in, out, n_head]`, `x` `[n, n_head·in]`; head `h` of the result
    /// (`[n, n_head·out]`) is `x_h·W_hᵀ` (MLA's absorbed K and V expansions).
    fn matmul_heads(&mut self, _w: WeightId, _x: &Self::Act) -> Self::Act {
        cpu_only("matmul_heads")
    }

    /// The k-pool indexer of `layer` (whose state is its cache: per position a key row of `2·head_dim`,
    /// the key then, in a pool's last cell, the pool's key, and the gate as the value): appends the
    /// batch's keys `k` (layer-normed) and pool gates `gate` (`[n, head_dim]` each, rounded to f16 as an
    /// f16 cache holds them), pools every pool the batch completes (per channel, a softmax over its
    /// members of gate + `ape` weighs their keys), and for each token scores the pools
    /// it can see (those ending at or before it) as `Σ_h relu(q_h·pool)·w_h` (`q` `[n, n_head·head_dim]`,
    /// `w` `[n, n_head]`), keeping the best `top_k / kpool` and, with `select_tail`, the cells of its own
    /// incomplete pool. Returns `[n, max_cells]`: each token's cells (positions, as f32) in the slots
    /// llama.cpp gathers them into — the kept pools by descending score, each pool's cells in order, −1
    /// for pools it cannot see, then its incomplete pool's cells from itself backwards, −1 for the rest.
    fn kpool_select(
        &mut self,
        _layer: usize,
        _q: &Self::Act,
        _k: &Self::Act,
        _gate: &Self::Act,
        _w: &Self::Act,
        _idx: &KPoolIndexer,
    ) -> Self::Act {
        cpu_only("kpool_select")
    }

    /// [`Compute::attention`] where each token sees only the cells `cells` names for it (a
    /// [`Compute::kpool_select`] result of the same rows): extends `layer`'s KV cache with `k` and `v`,
    /// then attends, in llama.cpp's arithmetic for the call (the CPU: over the gathered slots for calls of
    /// at most 16 tokens, a masked flash attention over the f16 cache for larger ones).
    fn attention_cells(
        &mut self,
        _layer: usize,
        _q: &Self::Act,
        _k: &Self::Act,
        _v: &Self::Act,
        _attn: &Attention,
        _cells: &Self::Act,
    ) -> Self::Act {
        cpu_only("attention_cells")
    }

    /// `s·x + b` element-wise (ggml's `scale_bias`).
    fn scale_bias(&mut self, _x: &Self::Act, _s: f32, _b: f32) -> Self::Act {
        cpu_only("scale_bias")
    }

    /// [`TailRope`] at the batch's positions, or turned back (`inverse`: the angle negated, ggml's
    /// `rope_ext_back`).
    fn rope_tail(&mut self, _x: &Self::Act, _rope: &TailRope, _inverse: bool) -> Self::Act {
        cpu_only("rope_tail")
    }

    /// A product per group: `w` is `[in, groups·out]`, `x` `[n, groups·in]`; group `g` of the result
    /// (`[n, groups·out]`) is `x_g` times rows `g·out..(g+1)·out` of `w` (DeepSeek V4's grouped output).
    fn matmul_groups(&mut self, _w: WeightId, _x: &Self::Act, _groups: usize) -> Self::Act {
        cpu_only("matmul_groups")
    }

    /// DeepSeek V4's attention of `layer` ([`Dsv4Attention`]): appends the batch's K = V rows to the
    /// layer's cache, its compressors' rows (and the entries the batch completes) to their states, and
    /// attends; the result is `[n, n_head·head_dim]`, not yet turned back.
    fn dsv4_attention(
        &mut self,
        _layer: usize,
        _x: Dsv4AttnInputs<'_, Self::Act>,
        _a: &Dsv4Attention,
    ) -> Self::Act {
        cpu_only("dsv4_attention")
    }

    /// DeepSeek V4's routed and shared experts of `layer` on `x` ([`Dsv4Moe`]).
    fn dsv4_moe(&mut self, _layer: usize, _x: &Self::Act, _m: &Dsv4Moe) -> Self::Act {
        cpu_only("dsv4_moe")
    }

    /// Host rows as an activation, `rows.len() / width` of them (a draft block's input: the trunk's
    /// hidden rows, which an earlier call kept through [`Compute::keep_hidden`]).
    fn input(&mut self, _rows: &[f32], _width: usize) -> Self::Act {
        cpu_only("input")
    }

    /// `[a | b]`: each row of `a` followed by the same row of `b` (ggml_concat on dimension 0).
    fn concat_cols(&mut self, _a: &Self::Act, _b: &Self::Act) -> Self::Act {
        cpu_only("concat_cols")
    }

    /// The same values read as rows of `width` (ggml_reshape_2d): `[n, k·width]` becomes `[n·k, width]`
    /// and back, row `i·k + j` holding part `j` of row `i` (DeepSeek V4's draft block projects each mHC
    /// stream of a token as a row of its own).
    fn reshape(&mut self, _x: &Self::Act, _width: usize) -> Self::Act {
        cpu_only("reshape")
    }

    /// The trunk's hidden rows, every row of the batch: what a draft block reads for the next position
    /// (llama.cpp's `t_h_nextn`: qwen35moe's after the output norm, DeepSeek V4's last streams). A
    /// backend that runs no draft block drops them, so the default does nothing.
    fn keep_hidden(&mut self, _x: &Self::Act) {}

    /// The batch this forward call runs.
    fn batch(&self) -> Batch<'_>;

    // ----- Compound operations ------------------------------------------------------------------------
    // Sequences of the operations above that an architecture runs on every layer. Their default bodies are
    // exactly those sequences (see [`composed`]), so a backend computes the same values whether it fuses
    // them or not; the GPU backend overrides them with one launch each where the shapes allow, to save the
    // launches of one token's forward call.

    /// `a + b` and the RMS norm of that sum (see [`Compute::rms_norm`]): the residual add at the end of a
    /// block and the norm at the start of the next. Returns `(sum, normed)`.
    fn add_rms_norm(
        &mut self,
        a: &Self::Act,
        b: &Self::Act,
        weight: Option<WeightId>,
        eps: f32,
        group: usize,
    ) -> (Self::Act, Self::Act) {
        composed::add_rms_norm(self, a, b, weight, eps, group)
    }

    /// The RMS norm of each head (`rope.head_dim` columns) times `weight`, then RoPE: the per-head Q or K
    /// norm of Qwen3 and Gemma 3 followed by the rotation.
    fn rms_norm_rope(
        &mut self,
        x: &Self::Act,
        weight: Option<WeightId>,
        eps: f32,
        rope: &Rope,
    ) -> Self::Act {
        composed::rms_norm_rope(self, x, weight, eps, rope)
    }

    /// [`Compute::rms_norm_rope`] of a layer's queries and of its keys, each with its own norm weight, at
    /// the same rotation.
    fn rms_norm_rope_pair(
        &mut self,
        [q, k]: [&Self::Act; 2],
        [q_norm, k_norm]: [Option<WeightId>; 2],
        eps: f32,
        rope: &Rope,
    ) -> [Self::Act; 2] {
        composed::rms_norm_rope_pair(self, [q, k], [q_norm, k_norm], eps, rope)
    }

    /// The routed experts on `x` (with the shared expert beside them when given: [`Compute::moe_shared`]),
    /// then [`Compute::add_rms_norm`] of their output and `after.residual`: the end of a MoE block and the
    /// norm of the next. Returns `(sum, normed)`.
    fn moe_add_rms_norm(
        &mut self,
        layer: usize,
        x: &Self::Act,
        (moe, shared): (&Moe, Option<&SharedExpert>),
        after: NormAfter<'_, Self::Act>,
    ) -> (Self::Act, Self::Act) {
        composed::moe_add_rms_norm(self, layer, x, (moe, shared), after)
    }

    /// `x·Wᵀ` for each of several matrices of the same input (the q, k and v projections), in order.
    fn matmul_many<const N: usize>(&mut self, ws: [WeightId; N], x: &Self::Act) -> [Self::Act; N] {
        composed::matmul_many(self, ws, x)
    }

    /// `act(gate) ⊙ up` (SwiGLU, GeGLU): a dense feed-forward block's gated activation.
    fn glu(&mut self, gate: &Self::Act, up: &Self::Act, act: Unary) -> Self::Act {
        composed::glu(self, gate, up, act)
    }

    /// [`Compute::ssm_conv`] then SiLU (the delta-net block's convolution).
    fn ssm_conv_silu(&mut self, layer: usize, x: &Self::Act, kernel: WeightId) -> Self::Act {
        composed::ssm_conv_silu(self, layer, x, kernel)
    }

    /// The RMS norm of `x` (groups of `group`, times `weight`) gated by `silu(z)` (same shape as `x`): the
    /// delta-net block's output norm.
    fn rms_norm_gated(
        &mut self,
        x: &Self::Act,
        weight: Option<WeightId>,
        eps: f32,
        group: usize,
        z: &Self::Act,
    ) -> Self::Act {
        composed::rms_norm_gated(self, x, (weight, eps, group), z)
    }

    /// Columns `cols.0..cols.0+cols.1` of every row, RMS-normed in groups of `group` columns (no weight)
    /// and times `s`: Qwen3.5's L2 norm of q and k (llama.cpp's `build_gdn_l2_norm`) on their columns of
    /// the convolution's output.
    fn cols_rms_norm_scale(
        &mut self,
        x: &Self::Act,
        cols: (usize, usize),
        eps: f32,
        group: usize,
        s: f32,
    ) -> Self::Act {
        composed::cols_rms_norm_scale(self, x, cols, (eps, group), s)
    }

    /// Qwen3.5's delta-net gates from the `beta` and `alpha` projections (`[n, n_v_heads]`):
    /// `(sigmoid(beta), softplus(alpha + dt_bias)·a)`, the second the log of the state's decay.
    fn delta_gates(
        &mut self,
        beta: &Self::Act,
        alpha: &Self::Act,
        dt_bias: WeightId,
        a: WeightId,
    ) -> (Self::Act, Self::Act) {
        composed::delta_gates(self, (beta, alpha), dt_bias, a)
    }

    /// [`Compute::gated_delta_net`] with `q` and `k` of `n_k_heads` heads (`[n, n_k_heads·head_k]`): value
    /// head `h` reads key head `h mod n_k_heads` (ggml_repeat's tiling, as [`Compute::repeat_heads`]
    /// without `interleave` makes it).
    fn gated_delta_net_grouped(
        &mut self,
        layer: usize,
        x: DeltaNetInputs<'_, Self::Act>,
        net: &DeltaNet,
        n_k_heads: usize,
    ) -> Self::Act {
        composed::gated_delta_net_grouped(self, layer, x, net, n_k_heads)
    }
}

/// The compound operations of [`Compute`] as the sequences of primitive operations they stand for: the
/// trait's default bodies, and what a backend that fuses them runs when a shape does not fit its fused
/// kernel (or fusion is switched off).
pub mod composed {
    use super::{
        Compute, DeltaNet, DeltaNetInputs, Moe, NormAfter, Rope, SharedExpert, Unary, WeightId,
    };

    /// [`Compute::moe_shared`]: `moe`, the shared expert, their sum.
    pub fn moe_shared<C: Compute + ?Sized>(
        c: &mut C,
        layer: usize,
        x: &C::Act,
        moe: &Moe,
        s: &SharedExpert,
    ) -> C::Act {
        let moe_out = c.moe(layer, x, moe);
        let shared = shared_expert(c, x, s);
        c.add(&moe_out, &shared)
    }

    /// The shared expert of [`Compute::moe_shared`] alone.
    pub fn shared_expert<C: Compute + ?Sized>(c: &mut C, x: &C::Act, s: &SharedExpert) -> C::Act {
        match shared_expert_parts(c, x, s) {
            (y, Some(gate)) => {
                let scale = c.unary(&gate, Unary::Sigmoid);
                c.mul(&y, &scale)
            }
            (y, None) => y,
        }
    }

    /// The shared expert's output before its gate, and the gate's logit `[rows, 1]` when it has one
    /// ([`shared_expert`] multiplies the two after a sigmoid).
    pub fn shared_expert_parts<C: Compute + ?Sized>(
        c: &mut C,
        x: &C::Act,
        s: &SharedExpert,
    ) -> (C::Act, Option<C::Act>) {
        match s.gate_inp {
            Some(gate_inp) => {
                let [gate, up, logit] = c.matmul_many([s.gate, s.up, gate_inp], x);
                let h = c.glu(&gate, &up, s.act);
                (c.matmul(s.down, &h), Some(logit))
            }
            None => {
                let [gate, up] = c.matmul_many([s.gate, s.up], x);
                let h = c.glu(&gate, &up, s.act);
                (c.matmul(s.down, &h), None)
            }
        }
    }

    /// [`Compute::add_rms_norm`]: `add` then `rms_norm`.
    pub fn add_rms_norm<C: Compute + ?Sized>(
        c: &mut C,
        a: &C::Act,
        b: &C::Act,
        weight: Option<WeightId>,
        eps: f32,
        group: usize,
    ) -> (C::Act, C::Act) {
        let sum = c.add(a, b);
        let normed = c.rms_norm(&sum, weight, eps, group);
        (sum, normed)
    }

    /// [`Compute::rms_norm_rope`]: `rms_norm` over each head then `rope`.
    pub fn rms_norm_rope<C: Compute + ?Sized>(
        c: &mut C,
        x: &C::Act,
        weight: Option<WeightId>,
        eps: f32,
        rope: &Rope,
    ) -> C::Act {
        let normed = c.rms_norm(x, weight, eps, rope.head_dim);
        c.rope(&normed, rope)
    }

    /// [`Compute::rms_norm_rope_pair`]: `rms_norm_rope` of the queries, then of the keys.
    pub fn rms_norm_rope_pair<C: Compute + ?Sized>(
        c: &mut C,
        [q, k]: [&C::Act; 2],
        [q_norm, k_norm]: [Option<WeightId>; 2],
        eps: f32,
        rope: &Rope,
    ) -> [C::Act; 2] {
        let q = c.rms_norm_rope(q, q_norm, eps, rope);
        let k = c.rms_norm_rope(k, k_norm, eps, rope);
        [q, k]
    }

    /// [`Compute::moe_add_rms_norm`]: `moe` (or `moe_shared`), then `add_rms_norm` with the residual.
    pub fn moe_add_rms_norm<C: Compute + ?Sized>(
        c: &mut C,
        layer: usize,
        x: &C::Act,
        (moe, shared): (&Moe, Option<&SharedExpert>),
        after: NormAfter<'_, C::Act>,
    ) -> (C::Act, C::Act) {
        let out = match shared {
            Some(s) => c.moe_shared(layer, x, moe, s),
            None => c.moe(layer, x, moe),
        };
        c.add_rms_norm(&out, after.residual, after.weight, after.eps, after.group)
    }

    /// [`Compute::matmul_many`]: one `matmul` per matrix, in order.
    pub fn matmul_many<C: Compute + ?Sized, const N: usize>(
        c: &mut C,
        ws: [WeightId; N],
        x: &C::Act,
    ) -> [C::Act; N] {
        ws.map(|w| c.matmul(w, x))
    }

    /// [`Compute::glu`]: `unary` then `mul`.
    pub fn glu<C: Compute + ?Sized>(c: &mut C, gate: &C::Act, up: &C::Act, act: Unary) -> C::Act {
        let gate = c.unary(gate, act);
        c.mul(&gate, up)
    }

    /// [`Compute::ssm_conv_silu`]: `ssm_conv` then `unary` SiLU.
    pub fn ssm_conv_silu<C: Compute + ?Sized>(
        c: &mut C,
        layer: usize,
        x: &C::Act,
        kernel: WeightId,
    ) -> C::Act {
        let conv = c.ssm_conv(layer, x, kernel);
        c.unary(&conv, Unary::Silu)
    }

    /// [`Compute::rms_norm_gated`]: `rms_norm`, `unary` SiLU of `z`, then `mul`; `norm` is
    /// `(weight, eps, group)`.
    pub fn rms_norm_gated<C: Compute + ?Sized>(
        c: &mut C,
        x: &C::Act,
        (weight, eps, group): (Option<WeightId>, f32, usize),
        z: &C::Act,
    ) -> C::Act {
        let normed = c.rms_norm(x, weight, eps, group);
        let z = c.unary(z, Unary::Silu);
        c.mul(&normed, &z)
    }

    /// [`Compute::cols_rms_norm_scale`]: `cols`, `rms_norm` without weight, then `scale`.
    pub fn cols_rms_norm_scale<C: Compute + ?Sized>(
        c: &mut C,
        x: &C::Act,
        (start, len): (usize, usize),
        (eps, group): (f32, usize),
        s: f32,
    ) -> C::Act {
        let part = c.cols(x, start, len);
        let normed = c.rms_norm(&part, None, eps, group);
        c.scale(&normed, s)
    }

    /// [`Compute::delta_gates`]: `unary` sigmoid of beta; `add_weight`, `unary` softplus and `mul_weight`
    /// of alpha.
    pub fn delta_gates<C: Compute + ?Sized>(
        c: &mut C,
        (beta, alpha): (&C::Act, &C::Act),
        dt_bias: WeightId,
        a: WeightId,
    ) -> (C::Act, C::Act) {
        let beta = c.unary(beta, Unary::Sigmoid);
        let alpha = c.add_weight(alpha, dt_bias);
        let alpha = c.unary(&alpha, Unary::Softplus);
        let gate = c.mul_weight(&alpha, a);
        (beta, gate)
    }

    /// [`Compute::gated_delta_net_grouped`]: `repeat_heads` of q and k to the value heads (tiled), then
    /// `gated_delta_net`.
    pub fn gated_delta_net_grouped<C: Compute + ?Sized>(
        c: &mut C,
        layer: usize,
        x: DeltaNetInputs<'_, C::Act>,
        net: &DeltaNet,
        n_k_heads: usize,
    ) -> C::Act {
        if n_k_heads == net.n_v_heads || n_k_heads == 0 {
            return c.gated_delta_net(layer, x, net);
        }
        let times = net.n_v_heads / n_k_heads;
        let q = c.repeat_heads(x.q, net.head_k, times, false);
        let k = c.repeat_heads(x.k, net.head_k, times, false);
        let inputs = DeltaNetInputs { q: &q, k: &k, ..x };
        c.gated_delta_net(layer, inputs, net)
    }
}
