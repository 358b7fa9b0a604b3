//! A loaded model: the mapped file, its forward pass, and its weights for the CPU backend; and
//! [`Model::eval`], one forward call that advances a sequence's state.

use std::path::Path;
use std::sync::Arc;

use poly_models::arch::{Forward, ModelGraph, ModelInfo};
use poly_models::compute::Logits;
use poly_models::gguf::GgufFile;
use poly_models::vision::{mrope_positions, mrope_span, ImageRows};

use crate::cpu::moe::RouteCounts;
pub use crate::cpu::Arithmetic;
use crate::cpu::{CpuForward, CpuWeights, RouterSource};
use crate::state::{KvPrecision, SeqState};

/// An error of the engine: a message for people.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineError(pub String);

impl std::fmt::Display for EngineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for EngineError {}

impl From<poly_models::arch::ArchError> for EngineError {
    fn from(e: poly_models::arch::ArchError) -> Self {
        EngineError(e.to_string())
    }
}

impl From<poly_models::GgufError> for EngineError {
    fn from(e: poly_models::GgufError) -> Self {
        EngineError(e.to_string())
    }
}

/// A model ready to run on the CPU, or on a GPU once [`Model::use_device`] put it there.
pub struct Model {
    graph: ModelGraph,
    weights: CpuWeights,
    /// The GPU backend, when the model runs on a card.
    gpu: Option<crate::gpu::GpuBackend>,
    arithmetic: Arithmetic,
    /// The KV caches' precision of the states [`Model::new_state`] makes (`--kv`).
    kv: KvPrecision,
    /// Routings of the CPU backend's forward calls, per (layer, expert).
    routes: RouteCounts,
}

/// Why `--kv q8_0` is refused on a card.
pub const Q8_0_KV_CPU_ONLY: &str =
    "--kv q8_0: q8_0 attention caches run on the CPU only for now (the \
     card's attention kernels read f16 caches); run with --cpu, or leave --kv at f16";

impl Model {
    /// Opens (memory-maps) the GGUF file at `path` and builds its forward pass.
    pub fn load(path: impl AsRef<Path>) -> Result<Model, EngineError> {
        Model::from_file(Arc::new(GgufFile::open(path)?))
    }

    /// Builds the forward pass of an opened file.
    pub fn from_file(file: Arc<GgufFile>) -> Result<Model, EngineError> {
        let graph = ModelGraph::from_file(&file)?;
        let weights = CpuWeights::for_graph(file, &graph);
        Ok(Model {
            graph,
            weights,
            gpu: None,
            arithmetic: Arithmetic::default(),
            kv: KvPrecision::default(),
            routes: RouteCounts::default(),
        })
    }

    /// Sets the precision of the KV caches of the states [`Model::new_state`] makes from now on (`--kv`).
    /// Refused for [`KvPrecision::Q8_0`] on a GPU (its caches are f16, [`Q8_0_KV_CPU_ONLY`]) and for a
    /// model whose attention heads are not whole Q8_0 blocks (multiples of 32 values).
    pub fn set_kv(&mut self, kv: KvPrecision) -> Result<(), EngineError> {
        if kv == KvPrecision::Q8_0 {
            if self.gpu.is_some() {
                return Err(EngineError(Q8_0_KV_CPU_ONLY.into()));
            }
            // The operations only the CPU runs read f16 or f32 cache rows.
            if let Some(ops) = self.graph.uses(self.weights.file()).needs_cpu_only_ops() {
                return Err(EngineError(format!(
                    "--kv q8_0: this model's caches are read by {ops}, which take f16 or f32 rows only"
                )));
            }
            for (il, spec) in self.graph.layer_states().iter().enumerate() {
                if let poly_models::arch::StateSpec::Kv {
                    head_dim_k,
                    head_dim_v,
                    ..
                } = *spec
                {
                    if !head_dim_k.is_multiple_of(32) || !head_dim_v.is_multiple_of(32) {
                        return Err(EngineError(format!(
                            "--kv q8_0: layer {il}'s attention heads ({head_dim_k} key, {head_dim_v} \
                             value values) are not whole Q8_0 blocks of 32"
                        )));
                    }
                }
            }
        }
        self.kv = kv;
        Ok(())
    }

    /// The model with [`Model::set_kv`] applied.
    pub fn with_kv(mut self, kv: KvPrecision) -> Result<Model, EngineError> {
        self.set_kv(kv)?;
        Ok(self)
    }

    /// The precision of the KV caches [`Model::new_state`] makes.
    pub fn kv(&self) -> KvPrecision {
        self.kv
    }

    /// Maps the model file's pages in a background thread ([`GgufFile::populate`]), so that the first
    /// answers do not pay a page fault per 4 KiB of the weights the CPU reads; skipped when the file is
    /// larger than three quarters of the memory available (it would push other pages out).
    pub fn populate_in_background(&self) {
        let file = Arc::clone(self.weights.shared_file());
        let bytes = file.file_bytes();
        let available = crate::serve::memory::host_bytes("MemAvailable:");
        if available.is_none_or(|m| bytes > m / 4 * 3) {
            return;
        }
        let spawned = std::thread::Builder::new()
            .name("populate".into())
            .spawn(move || {
                let t = std::time::Instant::now();
                match file.populate() {
                    Ok(()) => eprintln!(
                        "poly-engine: the model file's {} MiB mapped in {:.1} s",
                        bytes >> 20,
                        t.elapsed().as_secs_f64()
                    ),
                    Err(e) => eprintln!("poly-engine: the model file was not mapped ahead: {e}"),
                }
            });
        if let Err(e) = spawned {
            eprintln!("poly-engine: no thread to map the model file ahead: {e}");
        }
    }

    /// Why the card cannot run this model ([`crate::gpu::GpuBackend::refuses`]); `None` when it can. Asks
    /// no device.
    pub fn gpu_refuses(&self) -> Option<String> {
        crate::gpu::GpuBackend::refuses(&self.graph, &self.weights)
    }

    /// Runs the model where `choice` says: on the CPU, or with every weight uploaded to a GPU
    /// ([`crate::gpu`]).
    pub fn use_device(&mut self, choice: crate::gpu::DeviceChoice) -> Result<(), EngineError> {
        self.use_device_with(choice, &crate::gpu::Placement::new())
    }

    /// [`Model::use_device`] with the expert cache placed as `placement` says.
    pub fn use_device_with(
        &mut self,
        choice: crate::gpu::DeviceChoice,
        placement: &crate::gpu::Placement,
    ) -> Result<(), EngineError> {
        self.gpu = None;
        let ordinal = choice.ordinal()?;
        if let (Some(_), true) = (ordinal, self.kv == KvPrecision::Q8_0) {
            return Err(EngineError(Q8_0_KV_CPU_ONLY.into()));
        }
        if let (Some(_), crate::gpu::DeviceChoice::Auto) = (ordinal, choice) {
            // A card chosen by default that cannot run the model leaves it on the CPU, saying why; one
            // asked for (`--gpu N`) refuses it in `GpuBackend::load`.
            if let Some(why) = crate::gpu::GpuBackend::refuses(&self.graph, &self.weights) {
                eprintln!("poly-engine: {why}; running on the CPU");
                return Ok(());
            }
        }
        self.gpu = match ordinal {
            Some(n) => Some(crate::gpu::GpuBackend::load(
                n,
                &self.graph,
                &self.weights,
                placement,
            )?),
            None => None,
        };
        Ok(())
    }

    /// The expert cache's figures when the model runs on a GPU and has routed experts.
    pub fn expert_stats(&self) -> Option<crate::gpu::expert_cache::CacheStats> {
        self.gpu.as_ref().and_then(|g| g.expert_stats())
    }

    /// Routed experts in VRAM now (0 on the CPU).
    pub fn experts_in_vram(&self) -> usize {
        self.gpu.as_ref().map_or(0, |g| g.experts_in_vram().0)
    }

    /// Routed experts over all layers, as the GPU's expert cache counts them (0 on the CPU).
    pub fn experts_total(&self) -> usize {
        self.gpu.as_ref().map_or(0, |g| g.experts_in_vram().1)
    }

    /// Bytes of weights on the GPU (`None` on the CPU).
    pub fn gpu_weight_bytes(&self) -> Option<usize> {
        self.gpu.as_ref().map(|g| g.weight_bytes())
    }

    /// Adds the routings of the answers since the last call to the expert profile beside the model and
    /// saves it (nothing on the CPU or for a dense model).
    pub fn save_expert_profile(&self) -> std::io::Result<()> {
        match &self.gpu {
            Some(g) => g.save_expert_profile(),
            None => Ok(()),
        }
    }

    /// `[layer][expert]` routings of the CPU backend's forward calls since load or the last
    /// [`Model::reset_route_counts`] (a layer without experts has an empty row; nothing on a GPU, whose
    /// expert cache counts its own: [`Model::expert_stats`]).
    pub fn route_counts(&self) -> Vec<Vec<u64>> {
        self.routes.counts()
    }

    /// Forgets the routings counted.
    pub fn reset_route_counts(&self) {
        self.routes.reset()
    }

    /// [`Model::eval`] on the CPU, routing with `routers`' rows where it gives them (a calibration of
    /// the routers on the model's own hidden states). An error on a GPU.
    pub fn eval_with_routers(
        &self,
        state: &mut SeqState,
        tokens: &[u32],
        logits: Logits,
        routers: &mut dyn RouterSource,
    ) -> Result<Vec<f32>, EngineError> {
        if self.gpu.is_some() {
            return Err(EngineError(
                "replacing routers runs on the CPU backend only".into(),
            ));
        }
        self.check_call(state, tokens)?;
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        state.sync().map_err(EngineError)?;
        let out = {
            let mut c = CpuForward::new(&self.weights, state, tokens, logits)
                .with_arithmetic(self.arithmetic)
                .with_route_counts(&self.routes)
                .with_routers(routers);
            self.graph.forward(&mut c)
        };
        state.push_tokens(tokens);
        Ok(out.data)
    }

    /// Whether the model runs on a GPU.
    pub fn on_gpu(&self) -> bool {
        self.gpu.is_some()
    }

    /// Says that `state` is about to read `n` more tokens (a prompt read in several calls): on a card
    /// its attention caches grow for all of them at once, not once a call. Nothing on the CPU.
    pub fn expect_tokens(&self, state: &mut SeqState, n: usize) -> Result<(), EngineError> {
        match &self.gpu {
            Some(gpu) if n <= state.room() => gpu.expect_tokens(&self.weights, state, n),
            _ => Ok(()),
        }
    }

    /// Where the model runs: `cpu` or `cuda:N <name>`.
    pub fn device_name(&self) -> String {
        self.gpu
            .as_ref()
            .map_or_else(|| "cpu".to_string(), |g| g.describe())
    }

    /// The summation orders of every forward call ([`Arithmetic::LlamaCpp`] unless set).
    pub fn arithmetic(&self) -> Arithmetic {
        self.arithmetic
    }

    /// Sets the summation orders of every later forward call. A state read in one arithmetic can be
    /// continued in the other (the state's layout is the same), but only states and prompts read in
    /// [`Arithmetic::BatchInvariant`] throughout are independent of how they were split into calls.
    pub fn set_arithmetic(&mut self, arithmetic: Arithmetic) {
        self.arithmetic = arithmetic;
    }

    /// The model with [`Model::set_arithmetic`] applied.
    pub fn with_arithmetic(mut self, arithmetic: Arithmetic) -> Model {
        self.arithmetic = arithmetic;
        self
    }

    /// Sizes and special tokens.
    pub fn info(&self) -> &ModelInfo {
        self.graph.info()
    }

    /// The forward pass.
    pub fn graph(&self) -> &ModelGraph {
        &self.graph
    }

    /// An empty sequence of at most `n_ctx` tokens (0: the training context), its KV caches of the
    /// model's precision ([`Model::set_kv`]; f16 unless set).
    pub fn new_state(&self, n_ctx: usize) -> SeqState {
        self.new_state_with(n_ctx, self.kv)
    }

    /// An empty sequence of at most `n_ctx` tokens (0: the training context) whose KV caches keep
    /// `precision`.
    pub fn new_state_with(&self, n_ctx: usize, precision: KvPrecision) -> SeqState {
        let n_ctx = if n_ctx == 0 {
            self.info().n_ctx_train as usize
        } else {
            n_ctx
        };
        SeqState::with_precision(&self.graph.layer_states(), n_ctx, precision)
    }

    /// The GPU-vs-CPU diagnosis of one call ([`crate::gpu::lockstep`]): reads `tokens` into `cpu_state` on
    /// the CPU and into `gpu_state` on the card side by side; returns the CPU's logits, the card's, and
    /// each operation's comparison. An error when the model is not on a GPU.
    pub fn gpu_lockstep(
        &self,
        cpu_state: &mut SeqState,
        gpu_state: &mut SeqState,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<crate::gpu::lockstep::LockstepCall, EngineError> {
        let Some(gpu) = &self.gpu else {
            return Err(EngineError("the model is not on a GPU".into()));
        };
        let n_vocab = self.info().n_vocab;
        let layers = self.graph.layer_states().len();
        if tokens.is_empty()
            || tokens.len() > cpu_state.room().min(gpu_state.room())
            || tokens.iter().any(|&t| t as usize >= n_vocab)
            || cpu_state.n_layers() != layers
            || gpu_state.n_layers() != layers
        {
            return Err(EngineError(
                "lockstep: no tokens, no room, a token outside the vocabulary or another model's state"
                    .into(),
            ));
        }
        cpu_state.sync().map_err(EngineError)?;
        let (gpu_logits, (cpu_out, ops)) =
            gpu.call(&self.weights, gpu_state, tokens, logits, |g| {
                let cpu = CpuForward::new(&self.weights, cpu_state, tokens, logits);
                let mut l = crate::gpu::lockstep::Lockstep::new(cpu, g);
                let out = self.graph.forward(&mut l);
                let (g_out, c_out, ops) = l.finish(out);
                (g_out, (c_out, ops))
            })?;
        cpu_state.push_tokens(tokens);
        Ok(crate::gpu::lockstep::LockstepCall {
            cpu_logits: cpu_out.data,
            gpu_logits,
            ops,
        })
    }

    /// [`Model::eval`] on the CPU with the card's activation rounding ([`crate::gpu::reference`]): the
    /// reference the GPU backend is compared with.
    pub fn eval_q8_1_reference(
        &self,
        state: &mut SeqState,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<Vec<f32>, EngineError> {
        let n_vocab = self.info().n_vocab;
        if tokens.is_empty()
            || tokens.len() > state.room()
            || tokens.iter().any(|&t| t as usize >= n_vocab)
            || state.n_layers() != self.graph.layer_states().len()
        {
            return Err(EngineError(
                "reference: no tokens, no room, a token outside the vocabulary or another model's state"
                    .into(),
            ));
        }
        state.sync().map_err(EngineError)?;
        let out = {
            let mut c = crate::gpu::reference::Q81Cpu {
                cpu: CpuForward::new(&self.weights, state, tokens, logits),
                weights: &self.weights,
            };
            self.graph.forward(&mut c)
        };
        state.push_tokens(tokens);
        Ok(out.data)
    }

    /// Reads `tokens` into `state` in one forward call (every token through each layer together) and
    /// returns the logits `logits` asks for, `n_vocab` per row. Checks that the tokens are in the
    /// vocabulary, that they fit in the context, and that the state belongs to this model.
    pub fn eval(
        &self,
        state: &mut SeqState,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<Vec<f32>, EngineError> {
        self.check_call(state, tokens)?;
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        if let Some(gpu) = &self.gpu {
            return gpu.eval(&self.graph, &self.weights, state, tokens, logits);
        }
        state.sync().map_err(EngineError)?;
        let out = {
            let mut c = CpuForward::new(&self.weights, state, tokens, logits)
                .with_arithmetic(self.arithmetic)
                .with_route_counts(&self.routes);
            self.graph.forward(&mut c)
        };
        state.push_tokens(tokens);
        Ok(out.data)
    }

    /// Whether a projector of type `projector_type` (`clip.projector_type`) writes rows this model reads:
    /// Qwen3-VL's merger for a model with multi-section RoPE, Gemma 4's for a model that reads pictures
    /// in line. The widths are checked apart ([`Model::eval_picture`]).
    pub fn check_projector(&self, projector_type: &str) -> Result<(), EngineError> {
        let wanted = if self.graph.multi_section_rope().is_some() {
            poly_models::vision::qwen3vl::PROJECTOR_TYPE
        } else if self.graph.reads_pictures_in_line() {
            poly_models::vision::gemma4v::PROJECTOR_TYPE
        } else {
            return Err(EngineError(format!(
                "{} reads no pictures (its RoPE has no sections and it reads none in line)",
                self.info().arch
            )));
        };
        if projector_type != wanted {
            return Err(EngineError(format!(
                "a {} model reads pictures from a {wanted} projector, not {projector_type}",
                self.info().arch
            )));
        }
        Ok(())
    }

    /// Reads `tokens` into `state` as [`Model::eval`] does, with `picture`'s rows in place of the token
    /// embeddings of the rows from `at` on (its placeholder tokens, which the state records), as llama.cpp's
    /// mtmd decodes a picture. Under multi-section RoPE ([`Forward::multi_section_rope`], Qwen3.6): its
    /// rows at their positions (time, row, column), causal in row order, and the text after it
    /// positioned from the picture's span on. A model that reads pictures in line
    /// ([`Forward::reads_pictures_in_line`], Gemma 4): its rows at the next positions as text, seeing each
    /// other where the forward pass says so (Gemma 4's sliding-window layers), and not scaled as token
    /// embeddings are. On the CPU only.
    pub fn eval_picture(
        &self,
        state: &mut SeqState,
        tokens: &[u32],
        (at, picture): (usize, &ImageRows),
        logits: Logits,
    ) -> Result<Vec<f32>, EngineError> {
        if self.gpu.is_some() {
            return Err(EngineError(
                "pictures are read on the CPU only for now".into(),
            ));
        }
        let sections = self.graph.multi_section_rope();
        if sections.is_none() && !self.graph.reads_pictures_in_line() {
            return Err(EngineError(format!(
                "{} reads no pictures (its RoPE has no sections and it reads none in line)",
                self.info().arch
            )));
        }
        let n_rows = picture.n_rows();
        if picture.width != self.info().n_embd
            || picture.values.len() != n_rows * picture.width
            || n_rows == 0
            || at + n_rows > tokens.len()
        {
            return Err(EngineError(format!(
                "a picture of {n_rows} rows {} wide does not fit rows {at}.. of a call of {} tokens \
                 {} wide",
                picture.width,
                tokens.len(),
                self.info().n_embd
            )));
        }
        self.check_call(state, tokens)?;
        let n0 = state.n_past();
        let rope_positions = sections.map(|_| {
            let picture_pos0 = state.rope_position(n0 + at);
            let after = picture_pos0 + mrope_span(picture);
            let mut positions: Vec<[u32; 4]> =
                (n0..n0 + at).map(|c| state.text_rope_position(c)).collect();
            positions.extend(mrope_positions(picture, picture_pos0));
            positions.extend((0..(tokens.len() - at - n_rows) as u32).map(|k| {
                let p = after + k;
                [p, p, p, 0]
            }));
            positions
        });
        state.sync().map_err(EngineError)?;
        let out = {
            let mut c = CpuForward::new(&self.weights, state, tokens, logits)
                .with_arithmetic(self.arithmetic)
                .with_route_counts(&self.routes)
                .with_given_rows(at, picture, rope_positions);
            self.graph.forward(&mut c)
        };
        state.push_tokens(tokens);
        let end = n0 + at + n_rows;
        match sections {
            Some(_) => state.record_picture(end, n_rows, mrope_span(picture) as usize),
            None => state.record_picture_in_line(end, n_rows),
        }
        Ok(out.data)
    }

    /// An empty state of the model's own draft block (its MTP head) of at most `n_ctx` tokens, if the
    /// model has one the forward pass runs.
    pub fn new_draft_block_state(&self, n_ctx: usize) -> Option<SeqState> {
        let spec = self.graph.draft_block_state()?;
        Some(SeqState::with_precision(&[spec], n_ctx, self.kv))
    }

    /// The width of the trunk's hidden rows the draft block reads (`n_embd`, or DeepSeek V4's row of
    /// every mHC stream): what [`Model::eval_draft_block`] takes per token.
    pub fn draft_block_hidden_width(&self) -> usize {
        self.graph.draft_block_hidden_width()
    }

    /// Reads `tokens` into the draft block's `state` (from [`Model::new_draft_block_state`]) on the CPU,
    /// token `i` with `hidden`'s row `i` (the trunk's hidden row of the position before it, kept by
    /// [`SeqState::keep_hidden`]), and returns the draft's logits `logits` asks for: the guesses of the
    /// token after each.
    pub fn eval_draft_block(
        &self,
        state: &mut SeqState,
        (tokens, hidden): (&[u32], &[f32]),
        logits: Logits,
    ) -> Result<Vec<f32>, EngineError> {
        let info = self.info();
        if self.graph.draft_block_state().is_none() || state.n_layers() != 1 {
            return Err(EngineError(
                "the model has no draft block, or the state is not its draft block's".into(),
            ));
        }
        if tokens.is_empty()
            || tokens.len() > state.room()
            || tokens.iter().any(|&t| t as usize >= info.n_vocab)
            || hidden.len() != tokens.len() * self.draft_block_hidden_width()
        {
            return Err(EngineError(
                "draft block: no tokens, no room, a token outside the vocabulary or hidden rows that \
                 do not match the tokens"
                    .into(),
            ));
        }
        state.sync().map_err(EngineError)?;
        let out = {
            let mut c = CpuForward::new(&self.weights, state, tokens, logits)
                .with_arithmetic(self.arithmetic);
            self.graph.forward_draft_block(&mut c, hidden)
        };
        state.push_tokens(tokens);
        Ok(out.data)
    }

    /// Whether [`Model::eval_many`] reads several states in one forward call: on the CPU, in
    /// batch-invariant arithmetic (so that each state's rows come out bit for bit as in a call of its
    /// own; a recurrent layer runs each state's recurrence over its own rows).
    pub fn batches_states(&self, _state: &SeqState) -> bool {
        self.gpu.is_none() && self.arithmetic == Arithmetic::BatchInvariant
    }

    /// Reads each call's tokens into its state and returns every row's logits, call by call. Where
    /// [`Model::batches_states`] says so for every state, that is one forward call for all of them (the
    /// weights read once for all rows), else one call each. Each call's result is its own: a call that
    /// cannot be made (a token outside the vocabulary, no room) fails alone, the others go on.
    pub fn eval_many(
        &self,
        calls: &mut [(&mut SeqState, &[u32])],
    ) -> Vec<Result<Vec<f32>, EngineError>> {
        let together = calls.len() > 1
            && calls.iter().all(|(s, t)| {
                self.batches_states(s) && !t.is_empty() && self.check_call(s, t).is_ok()
            });
        if !together {
            // A call of one row asks for the last row's logits, as a decoding step always did.
            return calls
                .iter_mut()
                .map(|(state, tokens)| {
                    let want = if tokens.len() == 1 {
                        Logits::Last
                    } else {
                        Logits::All
                    };
                    self.eval(state, tokens, want)
                })
                .collect();
        }
        if let Some(e) = calls.iter_mut().find_map(|(s, _)| s.sync().err()) {
            let e = EngineError(e);
            return calls.iter().map(|_| Err(e.clone())).collect();
        }
        let counts: Vec<usize> = calls.iter().map(|(_, t)| t.len()).collect();
        let tokens: Vec<u32> = calls.iter().flat_map(|(_, t)| t.iter().copied()).collect();
        let out = {
            let states: Vec<&mut SeqState> = calls.iter_mut().map(|(s, _)| &mut **s).collect();
            let mut c = CpuForward::many(&self.weights, states, &counts, &tokens)
                .with_arithmetic(self.arithmetic)
                .with_route_counts(&self.routes);
            self.graph.forward(&mut c)
        };
        let n_vocab = self.info().n_vocab;
        let mut rows = out.data.chunks(n_vocab);
        calls
            .iter_mut()
            .map(|(state, tokens)| {
                state.push_tokens(tokens);
                Ok(rows
                    .by_ref()
                    .take(tokens.len())
                    .flatten()
                    .copied()
                    .collect())
            })
            .collect()
    }

    /// Checks that `tokens` are in the vocabulary, fit in `state`'s context and that the state belongs
    /// to this model.
    fn check_call(&self, state: &SeqState, tokens: &[u32]) -> Result<(), EngineError> {
        let n_vocab = self.info().n_vocab;
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(EngineError(format!(
                "token {t} is outside the vocabulary of {n_vocab} tokens"
            )));
        }
        if tokens.len() > state.room() {
            return Err(EngineError(format!(
                "{} more tokens do not fit in the context of {} ({} used)",
                tokens.len(),
                state.n_ctx(),
                state.n_past()
            )));
        }
        if self.gpu.is_some() && state.has_pictures() {
            return Err(EngineError(
                "a sequence that read a picture goes on on the CPU only for now".into(),
            ));
        }
        if state.n_layers() != self.graph.layer_states().len() {
            return Err(EngineError(
                "the sequence state was made for another model".into(),
            ));
        }
        Ok(())
    }
}
