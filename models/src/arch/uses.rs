//! What a model's forward pass asks of a backend, found by running the graph on shapes alone
//! ([`ModelGraph::uses`]): a backend that lacks an operation (or a form of one) refuses the model at load,
//! with the reason, rather than fail in the middle of a call. No backend asks which architecture it runs:
//! the graph's own calls say what it needs.

use super::graph::{Forward, ModelGraph};
use crate::compute::{
    Attention, Batch, Compute, DeltaNet, DeltaNetInputs, Dsv4Attention, Dsv4AttnInputs, Dsv4Moe,
    FusedMoe, Gating, HyperConnection, KPoolIndexer, Logits, Moe, Rope, TailRope, Unary, WeightId,
};
use crate::gguf::GgufFile;

/// The operations, and the forms of them, that one forward call of a graph uses.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GraphUses {
    /// A MoE block routes with a selection bias ([`Moe::selection_bias`], `exp_probs_b`).
    pub moe_selection_bias: bool,
    /// A MoE block in Gemma 4's form ([`Compute::fused_moe`]: the router on an input of its own, fused
    /// gate/up experts, per-expert output scales).
    pub fused_moe: bool,
    /// The gating functions of its MoE blocks.
    pub moe_gatings: Vec<Gating>,
    /// A causal convolution over a layer's state ([`Compute::ssm_conv`]).
    pub ssm_conv: bool,
    /// A layer convolves without a delta rule after it (LFM2's short convolution): its recurrent state
    /// holds only the convolution's window.
    pub conv_without_delta_net: bool,
    /// The gated delta rule ([`Compute::gated_delta_net`]).
    pub gated_delta_net: bool,
    /// The operations, or forms of them, that only the CPU backend runs (GLM5-Next's: layer norm,
    /// hyper-connection streams, per-head products, the k-pool indexer, attention over selected cells,
    /// a delta rule with a decay per key channel), each named once in the order first used.
    pub cpu_only: Vec<&'static str>,
}

impl GraphUses {
    /// What a backend lacking the MoE selection bias says of these uses: `None` when they do not need it.
    pub fn needs_moe_selection_bias(&self) -> Option<&'static str> {
        self.moe_selection_bias
            .then_some("MoE routing with an expert selection bias (exp_probs_b)")
    }

    /// What a backend lacking [`Compute::fused_moe`] says of these uses: `None` when they do not need it.
    pub fn needs_fused_moe(&self) -> Option<&'static str> {
        self.fused_moe.then_some(
            "MoE blocks in Gemma 4's form (a router on its own input, fused gate/up experts, \
             per-expert scales)",
        )
    }

    /// What a backend that runs only the common operations says of these uses: `None` when they need
    /// none of the CPU's own ([`GraphUses::cpu_only`]).
    pub fn needs_cpu_only_ops(&self) -> Option<String> {
        (!self.cpu_only.is_empty()).then(|| self.cpu_only.join(", "))
    }

    fn cpu_only(&mut self, what: &'static str) {
        if !self.cpu_only.contains(&what) {
            self.cpu_only.push(what);
        }
    }
}

impl ModelGraph {
    /// What one forward call of this graph uses, found by running it over `file`'s tensor shapes on a
    /// one-token batch (no weight is read, nothing is computed).
    pub fn uses(&self, file: &GgufFile) -> GraphUses {
        let mut probe = Probe {
            file,
            uses: GraphUses::default(),
            conv_layers: Vec::new(),
            delta_layers: Vec::new(),
        };
        self.forward(&mut probe);
        let mut uses = probe.uses;
        uses.conv_without_delta_net = probe
            .conv_layers
            .iter()
            .any(|l| !probe.delta_layers.contains(l));
        uses
    }
}

/// A [`Compute`] whose activations are their shapes `(rows, cols)`.
struct Probe<'a> {
    file: &'a GgufFile,
    uses: GraphUses,
    conv_layers: Vec<usize>,
    delta_layers: Vec<usize>,
}

const TOKENS: &[u32] = &[0];

impl Probe<'_> {
    /// `ne[1]` of a matrix: the width of a product with it.
    fn rows_of(&self, w: WeightId) -> usize {
        self.file
            .tensor_infos()
            .get(w.0 as usize)
            .and_then(|t| t.dims.get(1).copied())
            .unwrap_or(1) as usize
    }

    /// `ne[0]` of a tensor: a row's length.
    fn row_len(&self, w: WeightId) -> usize {
        self.file
            .tensor_infos()
            .get(w.0 as usize)
            .and_then(|t| t.dims.first().copied())
            .unwrap_or(1) as usize
    }
}

type Shape = (usize, usize);

impl Compute for Probe<'_> {
    type Act = Shape;

    fn shape(&self, x: &Shape) -> (usize, usize) {
        *x
    }

    fn embed(&mut self, table: WeightId, tokens: &[u32]) -> Shape {
        (tokens.len(), self.row_len(table))
    }

    fn matmul(&mut self, w: WeightId, x: &Shape) -> Shape {
        (x.0, self.rows_of(w))
    }

    fn rms_norm(&mut self, x: &Shape, _: Option<WeightId>, _: f32, _: usize) -> Shape {
        *x
    }

    fn l2_norm(&mut self, x: &Shape, _: f32, _: usize) -> Shape {
        *x
    }

    fn add(&mut self, a: &Shape, _: &Shape) -> Shape {
        *a
    }

    fn mul(&mut self, a: &Shape, _: &Shape) -> Shape {
        *a
    }

    fn add_weight(&mut self, x: &Shape, _: WeightId) -> Shape {
        *x
    }

    fn mul_weight(&mut self, x: &Shape, _: WeightId) -> Shape {
        *x
    }

    fn scale(&mut self, x: &Shape, _: f32) -> Shape {
        *x
    }

    fn unary(&mut self, x: &Shape, _: Unary) -> Shape {
        *x
    }

    fn cols(&mut self, x: &Shape, _: usize, len: usize) -> Shape {
        (x.0, len)
    }

    fn head_part(&mut self, x: &Shape, _: usize, parts: usize, _: usize) -> Shape {
        (x.0, x.1 / parts.max(1))
    }

    fn repeat_heads(&mut self, x: &Shape, _: usize, times: usize, _: bool) -> Shape {
        (x.0, x.1 * times)
    }

    fn rows(&mut self, x: &Shape, rows: &[usize]) -> Shape {
        (rows.len(), x.1)
    }

    fn rope(&mut self, x: &Shape, _: &Rope) -> Shape {
        *x
    }

    fn attention(&mut self, _: usize, q: &Shape, _: &Shape, _: &Shape, a: &Attention) -> Shape {
        (q.0, a.n_head * a.head_dim_v)
    }

    fn moe(&mut self, _: usize, x: &Shape, m: &Moe) -> Shape {
        self.uses.moe_selection_bias |= m.selection_bias.is_some();
        if !self.uses.moe_gatings.contains(&m.gating) {
            self.uses.moe_gatings.push(m.gating);
        }
        *x
    }

    fn fused_moe(&mut self, _: usize, x: &Shape, _: &Shape, m: &FusedMoe) -> Shape {
        self.uses.fused_moe = true;
        if !self.uses.moe_gatings.contains(&m.gating) {
            self.uses.moe_gatings.push(m.gating);
        }
        *x
    }

    fn ssm_conv(&mut self, layer: usize, x: &Shape, _: WeightId) -> Shape {
        self.uses.ssm_conv = true;
        self.conv_layers.push(layer);
        *x
    }

    fn gated_delta_net(
        &mut self,
        layer: usize,
        x: DeltaNetInputs<'_, Shape>,
        n: &DeltaNet,
    ) -> Shape {
        self.uses.gated_delta_net = true;
        self.delta_layers.push(layer);
        if n.head_k > 1 && x.gate.1 == n.n_v_heads * n.head_k {
            self.uses
                .cpu_only("a delta rule with a decay per key channel (KDA)");
        }
        (x.v.0, n.n_v_heads * n.head_v)
    }

    fn layer_norm(&mut self, x: &Shape, _: Option<WeightId>, _: Option<WeightId>, _: f32) -> Shape {
        self.uses.cpu_only("layer norm");
        *x
    }

    fn hc_pre(&mut self, streams: &Shape, mix: &Shape, hc: &HyperConnection) -> (Shape, Shape) {
        self.uses
            .cpu_only("hyper-connection residual streams (mHC)");
        ((streams.0, streams.1 / hc.hc.max(1)), *mix)
    }

    fn hc_post(&mut self, _: &Shape, streams: &Shape, _: &Shape) -> Shape {
        self.uses
            .cpu_only("hyper-connection residual streams (mHC)");
        *streams
    }

    fn matmul_heads(&mut self, w: WeightId, x: &Shape) -> Shape {
        self.uses.cpu_only("per-head products (MLA)");
        let heads = self
            .file
            .tensor_infos()
            .get(w.0 as usize)
            .and_then(|t| t.dims.get(2).copied())
            .unwrap_or(1) as usize;
        (x.0, self.rows_of(w) * heads)
    }

    fn kpool_select(
        &mut self,
        _: usize,
        q: &Shape,
        _: &Shape,
        _: &Shape,
        _: &Shape,
        idx: &KPoolIndexer,
    ) -> Shape {
        self.uses
            .cpu_only("the k-pool sparse-attention indexer and its cache");
        (q.0, idx.max_cells())
    }

    fn attention_cells(
        &mut self,
        _: usize,
        q: &Shape,
        _: &Shape,
        _: &Shape,
        a: &Attention,
        _: &Shape,
    ) -> Shape {
        self.uses
            .cpu_only("attention over the cells an indexer selected");
        (q.0, a.n_head * a.head_dim_v)
    }

    fn scale_bias(&mut self, x: &Shape, _: f32, _: f32) -> Shape {
        self.uses.cpu_only("a scale and bias of every value");
        *x
    }

    fn rope_tail(&mut self, x: &Shape, _: &TailRope, _: bool) -> Shape {
        self.uses
            .cpu_only("RoPE of the heads' last values (DeepSeek V4)");
        *x
    }

    fn matmul_groups(&mut self, w: WeightId, x: &Shape, _: usize) -> Shape {
        self.uses
            .cpu_only("grouped products (DeepSeek V4's output)");
        (x.0, self.rows_of(w))
    }

    fn dsv4_attention(
        &mut self,
        _: usize,
        x: Dsv4AttnInputs<'_, Shape>,
        a: &Dsv4Attention,
    ) -> Shape {
        self.uses
            .cpu_only("attention over a window and compressed KV (DeepSeek V4)");
        (x.q.0, a.n_head * a.head_dim)
    }

    fn dsv4_moe(&mut self, _: usize, x: &Shape, _: &Dsv4Moe) -> Shape {
        self.uses
            .cpu_only("sqrt-softplus and hash-routed experts (DeepSeek V4)");
        *x
    }

    fn batch(&self) -> Batch<'_> {
        Batch {
            tokens: TOKENS,
            pos0: 0,
            logits: Logits::Last,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uses_of(fixture: &str) -> GraphUses {
        let path = format!(
            "{}/../tests/fixtures/models/{fixture}",
            env!("CARGO_MANIFEST_DIR")
        );
        let file = GgufFile::open(&path).expect("fixture");
        ModelGraph::from_file(&file).expect("graph").uses(&file)
    }

    #[test]
    fn each_graph_says_what_its_forward_pass_uses() {
        let lfm = uses_of("lfm2moe-tiny-q4km.gguf");
        assert!(lfm.moe_selection_bias && lfm.ssm_conv && lfm.conv_without_delta_net);
        assert!(!lfm.gated_delta_net);
        assert_eq!(lfm.moe_gatings, vec![Gating::Sigmoid]);
        assert!(lfm.needs_moe_selection_bias().is_some());
        let q35 = uses_of("qwen35moe-tiny-q4km.gguf");
        assert!(q35.ssm_conv && q35.gated_delta_net && !q35.conv_without_delta_net);
        assert!(!q35.moe_selection_bias && q35.needs_moe_selection_bias().is_none());
        assert_eq!(q35.moe_gatings, vec![Gating::Softmax]);
        let g4 = uses_of("gemma4-tiny-q4km.gguf");
        assert!(g4.fused_moe && g4.needs_fused_moe().is_some());
        assert!(!g4.moe_selection_bias && !g4.ssm_conv && !g4.gated_delta_net);
        assert_eq!(g4.moe_gatings, vec![Gating::Softmax]);
        assert!(q35.needs_fused_moe().is_none());
        let llama = uses_of("llama-tiny-q4km.gguf");
        assert_eq!(llama, GraphUses::default());
        // Only glm5-next uses operations the card lacks.
        assert!([&lfm, &q35, &g4]
            .iter()
            .all(|u| u.needs_cpu_only_ops().is_none()));
        let glm = uses_of("glm5-next-tiny-f32.gguf");
        assert!(glm.moe_selection_bias && glm.gated_delta_net && glm.ssm_conv);
        let ops = glm
            .needs_cpu_only_ops()
            .expect("operations only the CPU runs");
        for what in [
            "mHC",
            "k-pool",
            "selected",
            "per key channel",
            "per-head",
            "layer norm",
        ] {
            assert!(ops.contains(what), "{what}: {ops}");
        }
    }
}
