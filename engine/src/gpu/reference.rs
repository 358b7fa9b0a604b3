//! A CPU reference whose activation quantization matches the card's: the CPU backend with the inputs of
//! every matmul over quantized weights and of every quantized MoE block first rounded to q8_1 (32 values
//! share the scale `amax/127`), as the card quantizes activations (llama.cpp's CUDA build does the same),
//! while the CPU proper quantizes them per 256 values (q8_K) for K-quant weights, as llama.cpp's CPU does.
//!
//! On the tiny random 4-bit fixtures that difference alone flips greedy tokens (issue 7 §3): this
//! reference is what tests/gpu_forward.rs holds the card to. The CPU then quantizes the rounded values
//! again (to q8_K or q8_0), which is exact for q8_0 inputs on the same grid and close for q8_K; the
//! expert FFN's inner activation (the down projection's input) is not rounded (it is inside the CPU's
//! MoE). A reference for tests and diagnosis, not a product path.

use poly_kernels::quant::GgmlType;
use poly_models::compute::{
    Attention, Batch, Compute, DeltaNet, DeltaNetInputs, FusedMoe, HyperConnection, KPoolIndexer,
    Moe, Rope, Unary, WeightId,
};

use crate::cpu::{CpuForward, CpuWeights, Mat};

/// The CPU backend with the inputs of matmuls over quantized weights and of MoE blocks rounded to q8_1
/// first (32 values share a scale `amax/127`), as the card quantizes activations.
pub struct Q81Cpu<'a> {
    pub cpu: CpuForward<'a>,
    pub weights: &'a CpuWeights,
}

/// F32 and F16 weights are multiplied in floats on both sides; every other type quantizes the activations.
fn quantized(ty: GgmlType) -> bool {
    !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// `x` rounded to q8_1's grid per 32 values.
pub fn round_q8_1(x: &Mat) -> Mat {
    let mut out = x.clone();
    poly_kernels::quant::legacy::round_to_q8_1_grid(&mut out.data);
    out
}

impl Compute for Q81Cpu<'_> {
    type Act = Mat;
    fn shape(&self, x: &Mat) -> (usize, usize) {
        self.cpu.shape(x)
    }
    fn embed(&mut self, t: WeightId, tokens: &[u32]) -> Mat {
        self.cpu.embed(t, tokens)
    }
    fn matmul(&mut self, w: WeightId, x: &Mat) -> Mat {
        if quantized(self.weights.info(w).ty) {
            self.cpu.matmul(w, &round_q8_1(x))
        } else {
            self.cpu.matmul(w, x)
        }
    }
    fn rms_norm(&mut self, x: &Mat, w: Option<WeightId>, eps: f32, g: usize) -> Mat {
        self.cpu.rms_norm(x, w, eps, g)
    }
    fn l2_norm(&mut self, x: &Mat, eps: f32, g: usize) -> Mat {
        self.cpu.l2_norm(x, eps, g)
    }
    fn add(&mut self, a: &Mat, b: &Mat) -> Mat {
        self.cpu.add(a, b)
    }
    fn mul(&mut self, a: &Mat, b: &Mat) -> Mat {
        self.cpu.mul(a, b)
    }
    fn add_weight(&mut self, x: &Mat, w: WeightId) -> Mat {
        self.cpu.add_weight(x, w)
    }
    fn mul_weight(&mut self, x: &Mat, w: WeightId) -> Mat {
        self.cpu.mul_weight(x, w)
    }
    fn scale(&mut self, x: &Mat, s: f32) -> Mat {
        self.cpu.scale(x, s)
    }
    fn unary(&mut self, x: &Mat, f: Unary) -> Mat {
        self.cpu.unary(x, f)
    }
    fn cols(&mut self, x: &Mat, s: usize, l: usize) -> Mat {
        self.cpu.cols(x, s, l)
    }
    fn head_part(&mut self, x: &Mat, h: usize, parts: usize, part: usize) -> Mat {
        self.cpu.head_part(x, h, parts, part)
    }
    fn repeat_heads(&mut self, x: &Mat, h: usize, t: usize, i: bool) -> Mat {
        self.cpu.repeat_heads(x, h, t, i)
    }
    fn rows(&mut self, x: &Mat, rows: &[usize]) -> Mat {
        self.cpu.rows(x, rows)
    }
    fn rope(&mut self, x: &Mat, r: &Rope) -> Mat {
        self.cpu.rope(x, r)
    }
    fn attention(&mut self, l: usize, q: &Mat, k: &Mat, v: &Mat, a: &Attention) -> Mat {
        self.cpu.attention(l, q, k, v, a)
    }
    fn moe(&mut self, l: usize, x: &Mat, m: &Moe) -> Mat {
        if quantized(self.weights.info(m.gate_exps).ty) {
            self.cpu.moe(l, &round_q8_1(x), m)
        } else {
            self.cpu.moe(l, x, m)
        }
    }
    fn fused_moe(&mut self, l: usize, x: &Mat, rx: &Mat, m: &FusedMoe) -> Mat {
        if quantized(self.weights.info(m.gate_up_exps).ty) {
            self.cpu.fused_moe(l, &round_q8_1(x), rx, m)
        } else {
            self.cpu.fused_moe(l, x, rx, m)
        }
    }
    fn ssm_conv(&mut self, l: usize, x: &Mat, k: WeightId) -> Mat {
        self.cpu.ssm_conv(l, x, k)
    }
    fn gated_delta_net(&mut self, l: usize, x: DeltaNetInputs<'_, Mat>, n: &DeltaNet) -> Mat {
        self.cpu.gated_delta_net(l, x, n)
    }
    fn layer_norm(&mut self, x: &Mat, w: Option<WeightId>, b: Option<WeightId>, eps: f32) -> Mat {
        self.cpu.layer_norm(x, w, b, eps)
    }
    fn hc_pre(&mut self, s: &Mat, m: &Mat, hc: &HyperConnection) -> (Mat, Mat) {
        self.cpu.hc_pre(s, m, hc)
    }
    fn hc_post(&mut self, x: &Mat, s: &Mat, w: &Mat) -> Mat {
        self.cpu.hc_post(x, s, w)
    }
    fn matmul_heads(&mut self, w: WeightId, x: &Mat) -> Mat {
        self.cpu.matmul_heads(w, x)
    }
    fn kpool_select(
        &mut self,
        l: usize,
        q: &Mat,
        k: &Mat,
        g: &Mat,
        w: &Mat,
        i: &KPoolIndexer,
    ) -> Mat {
        self.cpu.kpool_select(l, q, k, g, w, i)
    }
    fn attention_cells(
        &mut self,
        l: usize,
        q: &Mat,
        k: &Mat,
        v: &Mat,
        a: &Attention,
        c: &Mat,
    ) -> Mat {
        self.cpu.attention_cells(l, q, k, v, a, c)
    }
    fn batch(&self) -> Batch<'_> {
        self.cpu.batch()
    }
}
