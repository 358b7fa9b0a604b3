//! Writes the output of every [`Compute`] operation of one forward call, to compare our engine with
//! llama.cpp's intermediate tensors (`tests/witness/llama_dump.py`) and find where they first differ.
//!
//! `cargo run --release -p poly-engine --example dump_ops -- MODEL OUT_DIR TOKENS [PROMPT [STEPS]]`
//!
//! Reads PROMPT in one call, then each of STEPS alone, then TOKENS in one call (all rows' logits), and
//! writes each operation of that last call as `OUT_DIR/NNNN_OP_ROWSxCOLS.f32` (raw little-endian f32,
//! row-major, NNNN its order in the call), the logits last. Token lists are comma-separated ids.

use std::sync::Arc;

use poly_engine::cpu::{CpuForward, CpuWeights, Mat};
use poly_engine::state::SeqState;
use poly_models::arch::{Forward, ModelGraph};
use poly_models::compute::{
    Attention, Batch, Compute, DeltaNet, DeltaNetInputs, Dsv4Attention, Dsv4AttnInputs, Dsv4Moe,
    FusedMoe, HyperConnection, KPoolIndexer, Logits, Moe, Rope, TailRope, Unary, WeightId,
};
use poly_models::gguf::GgufFile;

/// A backend that records what the CPU backend computes.
struct Recorder<'a> {
    cpu: CpuForward<'a>,
    log: Vec<(&'static str, Mat)>,
}

impl Recorder<'_> {
    fn keep(&mut self, op: &'static str, m: Mat) -> Mat {
        self.log.push((op, m.clone()));
        m
    }
}

impl Compute for Recorder<'_> {
    type Act = Mat;
    fn shape(&self, x: &Mat) -> (usize, usize) {
        self.cpu.shape(x)
    }
    fn embed(&mut self, table: WeightId, tokens: &[u32]) -> Mat {
        let m = self.cpu.embed(table, tokens);
        self.keep("embed", m)
    }
    fn matmul(&mut self, w: WeightId, x: &Mat) -> Mat {
        let m = self.cpu.matmul(w, x);
        self.keep("matmul", m)
    }
    fn rms_norm(&mut self, x: &Mat, w: Option<WeightId>, eps: f32, group: usize) -> Mat {
        let m = self.cpu.rms_norm(x, w, eps, group);
        self.keep("rms_norm", m)
    }
    fn l2_norm(&mut self, x: &Mat, eps: f32, group: usize) -> Mat {
        let m = self.cpu.l2_norm(x, eps, group);
        self.keep("l2_norm", m)
    }
    fn add(&mut self, a: &Mat, b: &Mat) -> Mat {
        let m = self.cpu.add(a, b);
        self.keep("add", m)
    }
    fn mul(&mut self, a: &Mat, b: &Mat) -> Mat {
        let m = self.cpu.mul(a, b);
        self.keep("mul", m)
    }
    fn add_weight(&mut self, x: &Mat, w: WeightId) -> Mat {
        let m = self.cpu.add_weight(x, w);
        self.keep("add_weight", m)
    }
    fn mul_weight(&mut self, x: &Mat, w: WeightId) -> Mat {
        let m = self.cpu.mul_weight(x, w);
        self.keep("mul_weight", m)
    }
    fn scale(&mut self, x: &Mat, s: f32) -> Mat {
        let m = self.cpu.scale(x, s);
        self.keep("scale", m)
    }
    fn unary(&mut self, x: &Mat, f: Unary) -> Mat {
        let m = self.cpu.unary(x, f);
        self.keep("unary", m)
    }
    fn cols(&mut self, x: &Mat, start: usize, len: usize) -> Mat {
        self.cpu.cols(x, start, len)
    }
    fn head_part(&mut self, x: &Mat, head: usize, parts: usize, part: usize) -> Mat {
        self.cpu.head_part(x, head, parts, part)
    }
    fn repeat_heads(&mut self, x: &Mat, head: usize, times: usize, interleave: bool) -> Mat {
        self.cpu.repeat_heads(x, head, times, interleave)
    }
    fn rows(&mut self, x: &Mat, rows: &[usize]) -> Mat {
        self.cpu.rows(x, rows)
    }
    fn rope(&mut self, x: &Mat, r: &Rope) -> Mat {
        let m = self.cpu.rope(x, r);
        self.keep("rope", m)
    }
    fn attention(&mut self, layer: usize, q: &Mat, k: &Mat, v: &Mat, a: &Attention) -> Mat {
        let m = self.cpu.attention(layer, q, k, v, a);
        self.keep("attention", m)
    }
    fn moe(&mut self, layer: usize, x: &Mat, moe: &Moe) -> Mat {
        let m = self.cpu.moe(layer, x, moe);
        self.keep("moe", m)
    }
    fn fused_moe(&mut self, layer: usize, x: &Mat, rx: &Mat, moe: &FusedMoe) -> Mat {
        let m = self.cpu.fused_moe(layer, x, rx, moe);
        self.keep("fused_moe", m)
    }
    fn ssm_conv(&mut self, layer: usize, x: &Mat, kernel: WeightId) -> Mat {
        let m = self.cpu.ssm_conv(layer, x, kernel);
        self.keep("ssm_conv", m)
    }
    fn gated_delta_net(&mut self, layer: usize, x: DeltaNetInputs<'_, Mat>, net: &DeltaNet) -> Mat {
        let m = self.cpu.gated_delta_net(layer, x, net);
        self.keep("gated_delta_net", m)
    }
    fn layer_norm(&mut self, x: &Mat, w: Option<WeightId>, b: Option<WeightId>, eps: f32) -> Mat {
        let m = self.cpu.layer_norm(x, w, b, eps);
        self.keep("layer_norm", m)
    }
    fn hc_pre(&mut self, streams: &Mat, mix: &Mat, hc: &HyperConnection) -> (Mat, Mat) {
        let (x, w) = self.cpu.hc_pre(streams, mix, hc);
        let w = self.keep("hc_weights", w);
        (self.keep("hc_pre", x), w)
    }
    fn hc_post(&mut self, x: &Mat, streams: &Mat, w: &Mat) -> Mat {
        let m = self.cpu.hc_post(x, streams, w);
        self.keep("hc_post", m)
    }
    fn matmul_heads(&mut self, w: WeightId, x: &Mat) -> Mat {
        let m = self.cpu.matmul_heads(w, x);
        self.keep("matmul_heads", m)
    }
    fn kpool_select(
        &mut self,
        layer: usize,
        q: &Mat,
        k: &Mat,
        gate: &Mat,
        w: &Mat,
        idx: &KPoolIndexer,
    ) -> Mat {
        let m = self.cpu.kpool_select(layer, q, k, gate, w, idx);
        self.keep("kpool_select", m)
    }
    fn attention_cells(
        &mut self,
        layer: usize,
        q: &Mat,
        k: &Mat,
        v: &Mat,
        a: &Attention,
        cells: &Mat,
    ) -> Mat {
        let m = self.cpu.attention_cells(layer, q, k, v, a, cells);
        self.keep("attention_cells", m)
    }
    fn scale_bias(&mut self, x: &Mat, s: f32, b: f32) -> Mat {
        let m = self.cpu.scale_bias(x, s, b);
        self.keep("scale_bias", m)
    }
    fn rope_tail(&mut self, x: &Mat, r: &TailRope, inverse: bool) -> Mat {
        let m = self.cpu.rope_tail(x, r, inverse);
        self.keep(
            if inverse {
                "rope_tail_back"
            } else {
                "rope_tail"
            },
            m,
        )
    }
    fn matmul_groups(&mut self, w: WeightId, x: &Mat, groups: usize) -> Mat {
        let m = self.cpu.matmul_groups(w, x, groups);
        self.keep("matmul_groups", m)
    }
    fn dsv4_attention(
        &mut self,
        layer: usize,
        x: Dsv4AttnInputs<'_, Mat>,
        a: &Dsv4Attention,
    ) -> Mat {
        let m = self.cpu.dsv4_attention(layer, x, a);
        self.keep("dsv4_attention", m)
    }
    fn dsv4_moe(&mut self, layer: usize, x: &Mat, moe: &Dsv4Moe) -> Mat {
        let m = self.cpu.dsv4_moe(layer, x, moe);
        self.keep("dsv4_moe", m)
    }
    fn batch(&self) -> Batch<'_> {
        self.cpu.batch()
    }
}

fn ids(s: Option<&String>) -> Vec<u32> {
    s.filter(|s| !s.is_empty())
        .map(|s| {
            s.split(',')
                .map(|t| t.parse().expect("a token id"))
                .collect()
        })
        .unwrap_or_default()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        eprintln!("usage: dump_ops MODEL OUT_DIR TOKENS [PROMPT [STEPS]]");
        std::process::exit(2);
    }
    let file = Arc::new(GgufFile::open(&args[1]).expect("a GGUF file"));
    let graph = ModelGraph::from_file(&file).expect("a model the engine runs");
    let weights = CpuWeights::for_graph(file, &graph);
    let out = std::path::Path::new(&args[2]);
    std::fs::create_dir_all(out).expect("the output folder");
    let (tokens, prompt, steps) = (ids(args.get(3)), ids(args.get(4)), ids(args.get(5)));
    let n_ctx = prompt.len() + steps.len() + tokens.len();
    let mut state = SeqState::with_precision(&graph.layer_states(), n_ctx, Default::default());
    let single: Vec<[u32; 1]> = steps.iter().map(|&t| [t]).collect();
    for chunk in std::iter::once(&prompt[..])
        .filter(|p| !p.is_empty())
        .chain(single.iter().map(|t| &t[..]))
    {
        let mut cpu = CpuForward::new(&weights, &mut state, chunk, Logits::None);
        graph.forward(&mut cpu);
        state.push_tokens(chunk);
    }
    let mut rec = Recorder {
        cpu: CpuForward::new(&weights, &mut state, &tokens, Logits::All),
        log: Vec::new(),
    };
    let logits = graph.forward(&mut rec);
    let mut log = rec.log;
    log.push(("logits", logits));
    for (i, (op, m)) in log.iter().enumerate() {
        let bytes: Vec<u8> = m.data.iter().flat_map(|v| v.to_le_bytes()).collect();
        let name = format!("{i:04}_{op}_{}x{}.f32", m.rows, m.cols);
        std::fs::write(out.join(name), bytes).expect("writable output");
    }
    eprintln!("{} operations in {}", log.len(), out.display());
}
