//! Synthetic models: GGUF files with the exact layout of a real architecture (names, shapes, metadata,
//! tokenizer) whose weights are random valid blocks written directly in their target types.
//!
//! They let the engine be tested and benchmarked on the real layouts without downloading the real weights:
//! llama.cpp loads and runs them, activations stay of order 1 through every block, the output is confident
//! (the likeliest token's probability averages about 0.5 on random prompts), and routers spread tokens over
//! every expert, uniformly or with a chosen skew.
//!
//! - [`shapes`]: the named shapes (`tiny`, `small`, the real ones) of each architecture.
//! - [`plan`]: each tensor's type (with llama.cpp's fallback) and how its values are drawn (the scaling).
//! - [`route`]: router weights with a popularity skew, their calibration on the hidden states of a forward
//!   pass (run by `poly-engine synth`, which has the forward pass), and the routing estimate on random
//!   hidden states.
//! - [`agree`]: models whose draft block agrees with the main model at a chosen rate
//!   (`--draft-agreement`).
//! - [`fill`]: filling a tensor's bytes in parallel, deterministically for a seed.
//! - [`mmproj`]: projector (`mmproj`) files of the vision encoders' layouts.
//! - [`vocab`]: the small byte-level BPE vocabulary and chat template.
//!
//! [`Synthesis::prepare`] plans a model and simulates its routers; [`Synthesis::write`] streams it to disk,
//! generating the next tensor while the previous one is written.

pub mod agree;
pub mod fill;
pub mod mmproj;
pub mod mmproj_gemma4v;
pub mod plan;
pub mod route;
pub mod shapes;
pub mod vocab;

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Instant;

use poly_kernels::matmul::QuantMatrix;
use poly_kernels::quant::GgmlType;
use poly_kernels::rng::Rng;

use crate::arch::{resolve_tensors, ArchHparams, Dim, ModelHparams, Role, TensorClass};
use crate::gguf::{GgufWriter, Value};

use plan::{Init, PlannedTensor, TypeChoice};
use route::{RouteStats, RouterSpec};
use shapes::Shape;
use vocab::Vocab;

/// An error of `synth`: a message for people.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthError(pub String);

impl std::fmt::Display for SynthError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SynthError {}

/// What to synthesize.
#[derive(Clone, Debug)]
pub struct SynthOptions {
    pub shape: Shape,
    pub types: TypeChoice,
    pub seed: u64,
    /// `--route-skew` (≥ 0; 0 = every expert equally likely).
    pub route_skew: f32,
}

/// One block's router, before calibration.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockRouter {
    pub layer: u32,
    /// The tensor's name (`blk.N.ffn_gate_inp.weight`) and type.
    pub name: String,
    pub ty: GgmlType,
    pub parts: route::RouterParts,
}

/// The seed of block `layer`'s router draws.
fn router_seed(seed: u64, layer: u32) -> u64 {
    fill::stream_seed(seed, u64::MAX, layer as u64)
}

/// The routing estimate of one MoE block.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockRouting {
    pub layer: u32,
    pub stats: RouteStats,
}

/// A planned model, ready to write.
#[derive(Clone, Debug)]
pub struct Synthesis {
    pub shape: Shape,
    pub seed: u64,
    /// `--route-skew`.
    pub route_skew: f32,
    pub tensors: Vec<PlannedTensor>,
    pub vocab: Vocab,
    /// Router bytes per block (`None` for blocks without a router), as the file holds them.
    routers: Vec<Option<Vec<u8>>>,
    /// The routing estimate of every MoE block.
    pub routing: Vec<BlockRouting>,
    pub total_params: u64,
    pub active_params: u64,
    pub size_label: String,
    /// The type holding the most bytes (`general.file_type`).
    pub main_type: GgmlType,
    pub metadata: Vec<(String, Value)>,
    /// The draft block's agreement, when the model is written for one
    /// ([`Synthesis::with_draft_agreement`]).
    pub agreement: Option<std::sync::Arc<agree::AgreementPlan>>,
}

/// What writing took.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WriteStats {
    /// Bytes of tensor data.
    pub tensor_bytes: u64,
    /// Size of the file.
    pub file_bytes: u64,
    pub seconds: f64,
}

impl WriteStats {
    /// Megabytes (10^6) of file per second.
    pub fn mb_per_s(&self) -> f64 {
        self.file_bytes as f64 / 1e6 / self.seconds.max(1e-9)
    }
}

impl Synthesis {
    /// Plans the model of `opts`: tensors and their types, the vocabulary, metadata, and the routers (with
    /// their routing estimate on random hidden states).
    pub fn prepare(opts: &SynthOptions) -> Result<Synthesis, SynthError> {
        if !(opts.route_skew >= 0.0 && opts.route_skew.is_finite()) {
            return Err(SynthError(format!(
                "--route-skew must be a number ≥ 0, not {}",
                opts.route_skew
            )));
        }
        for &(class, ty) in &opts.types.overrides {
            check_class_type(class, ty)?;
        }
        check_weight_type(opts.types.default)?;
        let hp = &opts.shape.hparams;
        let h = hp.as_dyn();
        h.validate().map_err(|e| SynthError(e.to_string()))?;
        let descs = resolve_tensors(h).map_err(|e| SynthError(e.to_string()))?;
        let tensors = plan::plan(hp, descs, &opts.types);

        let n_vocab = h.dim(Dim::Vocab).unwrap_or(0) as usize;
        let small = vocab::small_vocab();
        if n_vocab < small.len() {
            return Err(SynthError(format!(
                "the vocabulary of {n_vocab} tokens is smaller than the built-in vocabulary ({})",
                small.len()
            )));
        }
        let vocab = small.padded_to(n_vocab);

        let (routers, routing) = make_routers(h, &tensors, opts.seed, opts.route_skew)?;
        let (total_params, active_params) = plan::param_counts(h, &tensors);
        let size_label = plan::size_label(total_params, active_params);
        let main_type = main_type(&tensors);
        let mut s = Synthesis {
            shape: opts.shape.clone(),
            seed: opts.seed,
            route_skew: opts.route_skew,
            tensors,
            vocab,
            routers,
            routing,
            total_params,
            active_params,
            size_label,
            main_type,
            metadata: Vec::new(),
            agreement: None,
        };
        s.metadata = s.build_metadata();
        Ok(s)
    }

    /// The same model with the outputs of its token-mixing blocks (attention's `attn_output`, the
    /// delta-net's `ssm_out`) drawn at `gain` times their usual scale.
    ///
    /// Random attention averages the values of the whole context, so every token of a sequence gets the
    /// same vector added; the residual stream sums it layer after layer and the blocks after it feed it
    /// back (random transformers' rank collapse): deep in the qwen3moe 30B-A3B shape a sequence's router
    /// inputs share a common part that differs from sequence to sequence, and a few experts, different
    /// in each sequence, take most of its routings whatever the router. No router can undo that (the
    /// common part is new in every sequence), so a model meant to route as its skew says is written with
    /// quieter mixing ([`plan::CALIBRATED_MIXING_GAIN`]) and the token's own part leads the stream, as in
    /// trained models. The shapes, types and the work of every block are unchanged.
    pub fn with_mixing_gain(mut self, gain: f32) -> Synthesis {
        for t in &mut self.tensors {
            if let (Role::AttnOut | Role::SsmOut | Role::ShortConvOutProj, Init::Random { rms }) =
                (t.desc.role, &mut t.init)
            {
                *rms *= gain;
            }
        }
        self
    }

    /// Every block's router as its parts (the same draws as the file's routers), for a calibration on
    /// the model's own hidden states ([`route::calibrate`]).
    pub fn router_parts(&self) -> Vec<BlockRouter> {
        let n_used = self.shape.hparams.as_dyn().n_expert_used() as usize;
        self.tensors
            .iter()
            .filter(|t| matches!(t.init, Init::Router { .. }))
            .map(|t| {
                let layer = t.desc.layer.unwrap_or(0);
                let spec = RouterSpec {
                    n_embd: t.desc.dims[0] as usize,
                    n_expert: t.desc.dims[1] as usize,
                    n_used,
                    skew: self.route_skew,
                };
                let mut rng = Rng::new(router_seed(self.seed, layer));
                BlockRouter {
                    layer,
                    name: t.desc.name.clone(),
                    ty: t.ty,
                    parts: route::router_parts(&spec, &mut rng),
                }
            })
            .collect()
    }

    /// Bytes of tensor data.
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| t.ty.bytes_for(t.desc.n_elements()).unwrap_or(0))
            .sum()
    }

    /// The tensors whose type fell back from the one asked (llama.cpp's quantizer rule).
    pub fn fallbacks(&self) -> impl Iterator<Item = &PlannedTensor> {
        self.tensors.iter().filter(|t| t.fell_back_from.is_some())
    }

    fn build_metadata(&self) -> Vec<(String, Value)> {
        let h = self.shape.hparams.as_dyn();
        let arch = h.arch_name();
        let mut kv: Vec<(String, Value)> = vec![
            ("general.architecture".into(), arch.into()),
            ("general.type".into(), "model".into()),
            (
                "general.name".into(),
                format!("PolyStrata synthetic {arch} {}", self.shape.name).into(),
            ),
            ("general.size_label".into(), self.size_label.clone().into()),
            (
                "general.file_type".into(),
                plan::file_type(self.main_type).into(),
            ),
            ("general.quantization_version".into(), 2u32.into()),
        ];
        kv.extend(h.to_metadata());
        let v = &self.vocab;
        kv.extend([
            ("tokenizer.ggml.model".into(), "gpt2".into()),
            ("tokenizer.ggml.pre".into(), "qwen2".into()),
            (
                "tokenizer.ggml.tokens".into(),
                Value::string_array(v.tokens.iter().cloned()),
            ),
            (
                "tokenizer.ggml.token_type".into(),
                Value::i32_array(v.token_types.iter().copied()),
            ),
            (
                "tokenizer.ggml.merges".into(),
                Value::string_array(v.merges.iter().cloned()),
            ),
            ("tokenizer.ggml.eos_token_id".into(), v.eos_id.into()),
            ("tokenizer.ggml.padding_token_id".into(), v.pad_id.into()),
            ("tokenizer.ggml.bos_token_id".into(), v.bos_id.into()),
            // Gemma reads a BOS first; the Qwen models do not.
            (
                "tokenizer.ggml.add_bos_token".into(),
                matches!(self.shape.hparams, ModelHparams::Gemma3(_)).into(),
            ),
            (
                "tokenizer.chat_template".into(),
                vocab::CHAT_TEMPLATE.into(),
            ),
        ]);
        kv
    }

    /// Writes the model to `path` (through `<path>.tmp`). `progress(done, total)` is called after each
    /// tensor with bytes of tensor data written so far.
    pub fn write(
        &self,
        path: &Path,
        mut progress: impl FnMut(u64, u64),
    ) -> Result<WriteStats, SynthError> {
        let mut w = GgufWriter::new();
        for (k, v) in &self.metadata {
            w.add_kv(k.clone(), v.clone());
        }
        for t in &self.tensors {
            w.add_tensor(t.desc.name.clone(), t.ty, &t.desc.dims)
                .map_err(|e| SynthError(format!("{}: {e}", t.desc.name)))?;
        }
        let total = self.tensor_bytes();
        let start = Instant::now();
        let routers = &self.routers;

        // One thread generates tensor i+1 (in parallel inside) while the writer copies and writes tensor i.
        // Buffers go back to the generator once copied, so pages are reused instead of faulted in afresh.
        let (tx, rx) = mpsc::sync_channel::<Result<Vec<u8>, SynthError>>(0);
        let (back_tx, back_rx) = mpsc::channel::<Vec<u8>>();
        let written = std::thread::scope(|scope| {
            scope.spawn(move || {
                for (i, t) in self.tensors.iter().enumerate() {
                    let n = t.ty.bytes_for(t.desc.n_elements()).unwrap_or(0) as usize;
                    let mut buf = back_rx.try_recv().unwrap_or_default();
                    buf.resize(n, 0);
                    let r = fill::fill_tensor(t, i, self.seed, routers, &mut buf).map(|()| buf);
                    let failed = r.is_err();
                    // The writer stops receiving when it fails; then there is nobody to send to.
                    if tx.send(r).is_err() || failed {
                        break;
                    }
                }
            });
            let mut done = 0u64;
            let result = write_with_writeback(&w, path, |i, info, out| {
                let buf = rx
                    .recv()
                    .map_err(|_| std::io::Error::other("the tensor generator stopped"))?
                    .map_err(|e| std::io::Error::other(e.0))?;
                if buf.len() != out.len() {
                    return Err(std::io::Error::other(format!(
                        "tensor {i} ({}): generated {} bytes for {}",
                        info.name,
                        buf.len(),
                        out.len()
                    )));
                }
                out.copy_from_slice(&buf);
                done += buf.len() as u64;
                progress(done, total);
                // The generator may have finished; then the buffer is simply dropped.
                let _ = back_tx.send(buf);
                Ok(())
            });
            drop(rx);
            result
        });
        written?;
        let file_bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(total);
        Ok(WriteStats {
            tensor_bytes: total,
            file_bytes,
            seconds: start.elapsed().as_secs_f64(),
        })
    }
}

/// Bytes written between two requests to the disk to write back what is dirty.
const WRITEBACK_BYTES: u64 = 256 << 20;

/// A stream that asks a helper thread to flush the file to disk every [`WRITEBACK_BYTES`].
struct WritebackWriter {
    inner: BufWriter<File>,
    since_flush: u64,
    flush: mpsc::Sender<()>,
}

impl Write for WritebackWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.since_flush += n as u64;
        if self.since_flush >= WRITEBACK_BYTES {
            self.since_flush = 0;
            // The flusher only stops when this writer is dropped.
            let _ = self.flush.send(());
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Writes `w`'s file at `path` through `<path>.tmp` (renamed when complete and synced, removed on error),
/// as [`GgufWriter::write_to_path`] does, but with the disk writing from the start: a helper thread syncs
/// the file's data every [`WRITEBACK_BYTES`] while generation continues. Otherwise the kernel holds up to
/// a fifth of memory in dirty pages and the whole of a small model waits for the final sync, so
/// generating and writing would not overlap.
fn write_with_writeback<F>(w: &GgufWriter, path: &Path, fill: F) -> Result<(), SynthError>
where
    F: FnMut(usize, &crate::gguf::TensorInfo, &mut [u8]) -> std::io::Result<()>,
{
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let io = |what: &str, e: std::io::Error| SynthError(format!("{}: {what}: {e}", tmp.display()));
    let file = File::create(&tmp).map_err(|e| io("creating", e))?;
    let result = (|| {
        let flusher = file.try_clone().map_err(|e| io("opening", e))?;
        let (tx, rx) = mpsc::channel::<()>();
        let flush_thread = std::thread::spawn(move || {
            while rx.recv().is_ok() {
                // Several requests may have queued while syncing: one sync covers them all.
                while rx.try_recv().is_ok() {}
                // A failure shows again in the final sync, which is checked.
                let _ = flusher.sync_data();
            }
        });
        let mut out = WritebackWriter {
            inner: BufWriter::with_capacity(1 << 20, file),
            since_flush: 0,
            flush: tx,
        };
        let written = w
            .write_to(&mut out, fill)
            .map_err(|e| SynthError(e.to_string()));
        let WritebackWriter { inner, flush, .. } = out;
        drop(flush);
        let _ = flush_thread.join();
        written?;
        let file = inner
            .into_inner()
            .map_err(|e| io("writing", e.into_error()))?;
        file.sync_all().map_err(|e| io("syncing", e))?;
        std::fs::rename(&tmp, path).map_err(|e| io("renaming", e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Refuses types `synth` cannot write for a class: norms and the delta-net's small parameters are F32
/// only, routers float only, and every type must be one the engine computes with.
pub fn check_class_type(class: TensorClass, ty: GgmlType) -> Result<(), SynthError> {
    if let Some(fixed) = class.fixed_type() {
        if ty != fixed {
            return Err(SynthError(format!(
                "{} tensors ({}) are always {fixed} (llama.cpp needs them so), not {ty}",
                class.name(),
                class.description()
            )));
        }
        if class == TensorClass::Index {
            // Integer tables are no weights: the engine reads them as integers.
            return Ok(());
        }
    }
    if class == TensorClass::Router && !plan::ROUTER_TYPES.contains(&ty) {
        return Err(SynthError(format!(
            "router weights are written as F32, F16 or BF16 (llama.cpp never quantizes them), not {ty}"
        )));
    }
    check_weight_type(ty)
}

fn check_weight_type(ty: GgmlType) -> Result<(), SynthError> {
    if poly_kernels::quant::WEIGHT_TYPES.contains(&ty) {
        Ok(())
    } else {
        Err(SynthError(format!(
            "{ty} is not a weight type the engine computes with"
        )))
    }
}

/// The type holding the most bytes.
fn main_type(tensors: &[PlannedTensor]) -> GgmlType {
    let mut by_type: Vec<(GgmlType, u64)> = Vec::new();
    for t in tensors {
        let b = t.ty.bytes_for(t.desc.n_elements()).unwrap_or(0);
        match by_type.iter_mut().find(|(ty, _)| *ty == t.ty) {
            Some(e) => e.1 += b,
            None => by_type.push((t.ty, b)),
        }
    }
    by_type
        .into_iter()
        .max_by_key(|&(_, b)| b)
        .map_or(GgmlType::F32, |(ty, _)| ty)
}

/// Draws every block's router (each from its own stream), encodes it in its type and simulates its
/// routing on what the file will hold.
#[allow(clippy::type_complexity)]
fn make_routers(
    h: &dyn ArchHparams,
    tensors: &[PlannedTensor],
    seed: u64,
    skew: f32,
) -> Result<(Vec<Option<Vec<u8>>>, Vec<BlockRouting>), SynthError> {
    let n_used = h.n_expert_used() as usize;
    let mut by_layer: Vec<Option<Vec<u8>>> = vec![None; h.n_layer_all() as usize];
    let mut routing = Vec::new();
    for t in tensors
        .iter()
        .filter(|t| matches!(t.init, Init::Router { .. }))
    {
        let layer = t.desc.layer.unwrap_or(0);
        let (n_embd, n_expert) = (t.desc.dims[0] as usize, t.desc.dims[1] as usize);
        let spec = RouterSpec {
            n_embd,
            n_expert,
            n_used,
            skew,
        };
        let mut rng = Rng::new(router_seed(seed, layer));
        let bytes =
            fill::encode_floats(t.ty, &route::router_weights(&spec, &mut rng), &t.desc.name)?;
        let m = QuantMatrix::new(t.ty, n_expert, n_embd, &bytes)
            .map_err(|e| SynthError(format!("{}: {e}", t.desc.name)))?;
        let samples = route::default_samples(n_expert, n_used);
        let stats = route::simulate(
            &m,
            n_used,
            samples,
            fill::stream_seed(seed, u64::MAX - 1, layer as u64),
        )
        .map_err(|e| SynthError(format!("{}: {e}", t.desc.name)))?;
        routing.push(BlockRouting { layer, stats });
        let slot = by_layer
            .get_mut(layer as usize)
            .ok_or_else(|| SynthError(format!("router of block {layer} outside the model")))?;
        *slot = Some(bytes);
    }
    Ok((by_layer, routing))
}
