//! `poly-engine --model FILE`: the engine as a long-lived process serving one model over the line
//! protocol (`poly-protocol`; its README is the specification): requests on stdin, protocol lines on
//! stdout, logs on stderr.
//!
//! - [`input`]: a thread reads stdin line by line (bounded) and passes what it parsed through a channel,
//!   so CANCEL and STATS are seen while a GEN runs;
//! - [`session`]: the serve loop: up to `--parallel` requests run at once, taking turns one forward call
//!   each (one at a time by default), others wait in a bounded FIFO queue;
//! - [`request`]: checking a GEN and running it step by step (reading the prompt from the kept state,
//!   checkpoints, cancellation between tokens);
//! - [`store`]: the conversations kept between requests;
//! - [`memory`]: the process's resident memory for STATS.
//!
//! On a GPU, a short read and a few tokens before READY ([`warm_up`], `--no-warmup` skips it) load the
//! kernels and capture the shallow decode graph, so the first answer runs at the speed of the others.

pub(crate) mod draft;
pub(crate) mod draft_block;
mod input;
pub(crate) mod memory;
mod orphan;
mod pictures;
mod repeats;
mod request;
mod session;
pub mod store;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use poly_models::compute::Logits;
use poly_models::gguf::GgufFile;
use poly_protocol::{ErrorCode, ErrorReply, FromEngine};

use crate::model::{Arithmetic, EngineError, Model};

/// Requests that may wait while `--parallel` run; a GEN beyond them is answered `busy`.
pub const QUEUE_DEPTH: usize = 8;

/// How the engine process serves.
#[derive(Clone, Debug, PartialEq)]
pub struct ServeOptions {
    /// The GGUF model file.
    pub model: PathBuf,
    /// Most tokens a conversation holds (0: the model's training context).
    pub max_context: usize,
    /// Worker threads (`None`: one per core).
    pub threads: Option<usize>,
    /// Bytes the parked conversations may hold.
    pub park_bytes: usize,
    /// A checkpoint of the recurrent layers every this many prompt tokens read (0: none; `None`: every
    /// [`DEFAULT_CHECKPOINT_EVERY`] tokens, or every long call's worth where prompts are read in long
    /// calls).
    pub checkpoint_every: Option<usize>,
    /// Most prompt tokens per forward call (`None`: [`crate::generate::DEFAULT_UBATCH`] on the CPU,
    /// [`GPU_UBATCH`] on a GPU).
    pub ubatch: Option<usize>,
    /// Prompt tokens per forward call while more than `ubatch` remain (0: always `ubatch`; `None`:
    /// [`LONG_UBATCH`] on a card that holds only part of the routed experts, else 0).
    pub long_ubatch: Option<usize>,
    /// Where the model runs (a GPU when there is one, unless asked otherwise).
    pub device: crate::gpu::DeviceChoice,
    /// Where a GPU run puts the routed experts.
    pub placement: crate::gpu::Placement,
    /// The summation orders ([`DEFAULT_ARITHMETIC`] unless asked otherwise).
    pub arithmetic: Arithmetic,
    /// The attention caches' precision (`--kv`; Q8_0 is refused on a GPU).
    pub kv: crate::state::KvPrecision,
    /// Guessed tokens (from repeats, where the model's state can be cut back on the CPU); `--no-draft`
    /// turns them off.
    pub guesses: bool,
    /// Tokens that must repeat before their sequel is guessed (`--repeats-min-match`).
    pub repeats_min_match: usize,
    /// A draft model of the same vocabulary whose greedy tokens are guessed instead of repeats
    /// (`--draft`; on the CPU).
    pub draft: Option<PathBuf>,
    /// Guesses from the model's own draft block (its MTP head; `--draft-block on`) instead of repeats,
    /// on the CPU.
    pub draft_block: bool,
    /// The warm-up before READY on a GPU ([`warm_up`]); `--no-warmup` turns it off.
    pub warm_up: bool,
    /// Most requests running at once, taking turns token by token (`--parallel`; 1: one at a time).
    pub parallel: usize,
    /// The vision projector (`mmproj`) that reads GENs' pictures (`--mmproj`; on the CPU).
    pub mmproj: Option<PathBuf>,
}

/// Prompt tokens per forward call on a GPU unless told otherwise: the grouped expert kernels read each
/// expert's weights once per tile of its tokens, so more tokens per call means fewer weight reads (llama.cpp's
/// best `-ub` for long prompts on the H200 was 2048 as well).
pub const GPU_UBATCH: usize = 2048;

/// `--repeats-min-match` unless told otherwise: two matching tokens are common chance in a
/// conversation; three rarely are.
pub const DEFAULT_REPEATS_MIN_MATCH: u32 = 3;

/// Prompt tokens per forward call of a long prompt on a card that holds only part of the routed experts:
/// each call copies every layer's uncached experts to the card once, so fewer, larger calls copy less;
/// the expert cache lends the larger calls' scratch ([`crate::gpu`]'s `lend`).
pub const LONG_UBATCH: usize = 8192;

/// Prompt tokens between checkpoints of the recurrent layers unless told otherwise.
pub const DEFAULT_CHECKPOINT_EVERY: usize = 2048;

/// The engine process's arithmetic by default: batch-invariant, so that a conversation continued from a
/// kept state, a checkpoint or a parked copy, a prompt split at the ubatch, and a fresh read of the same
/// tokens all give the same probabilities bit for bit (llama.cpp's orders differ by up to a few
/// hundredths in probability on 4-bit models between such splits).
pub const DEFAULT_ARITHMETIC: Arithmetic = Arithmetic::BatchInvariant;

/// The facts the READY line announces, read once at load.
struct Loaded {
    model: Model,
    /// Routed experts over all layers (experts per layer × layers with experts).
    experts_total: u64,
    /// Most tokens one forward call may have.
    max_call_tokens: usize,
}

fn load(
    path: &PathBuf,
    device: crate::gpu::DeviceChoice,
    placement: &crate::gpu::Placement,
    arithmetic: Arithmetic,
    kv: crate::state::KvPrecision,
) -> Result<Loaded, EngineError> {
    let file = Arc::new(GgufFile::open(path)?);
    // The MoE blocks as the architecture's tensor table binds them.
    let expert_blocks = poly_models::arch::routed_experts(&file)?.len() as u64;
    let summary = poly_models::summary::ModelSummary::of(&file)?;
    let per_layer = summary.n_experts.unwrap_or(0);
    let experts_total = per_layer * expert_blocks;
    let mut model = Model::from_file(file.clone())?
        .with_arithmetic(arithmetic)
        .with_kv(kv)?;
    model.use_device_with(device, placement)?;
    // Only where the CPU will read weights: not for a card that holds every one.
    if !model.on_gpu() || (model.experts_in_vram() as u64) < experts_total {
        model.populate_in_background();
    }
    // The card computes a call's routed experts in one launch per matrix, whose slots are bounded.
    let max_call_tokens = match summary.n_experts_used {
        Some(k) if k > 0 && model.on_gpu() => crate::gpu::forward::MAX_SLOTS / k as usize,
        _ => usize::MAX,
    };
    Ok(Loaded {
        model,
        experts_total,
        max_call_tokens,
    })
}

/// Prompt tokens and written tokens of the warm-up before READY.
const WARM_PROMPT: usize = 16;
const WARM_TOKENS: usize = 4;

/// Before READY on a GPU: a short read and a few tokens written into a state of the serve context, so
/// that the first request does not pay the kernels' first loads (NVRTC compiles or cache reads) and the
/// capture of the shallow decode graph. The card keeps the state's buffers and their graphs, which the
/// first request's state (of the same context) reuses. Bounded: [`WARM_PROMPT`] + [`WARM_TOKENS`]
/// tokens; a failure is logged and changes nothing (the request would meet it again).
fn warm_up(model: &Model, n_ctx: usize) {
    let started = std::time::Instant::now();
    let n_vocab = model.info().n_vocab.max(1);
    let mut state = model.new_state(n_ctx);
    let prompt: Vec<u32> = (0..WARM_PROMPT)
        .map(|i| ((i * 7919 + 13) % n_vocab) as u32)
        .collect();
    let mut written = 0;
    let result = (|| -> Result<(), EngineError> {
        if state.room() <= WARM_PROMPT + WARM_TOKENS {
            return Ok(());
        }
        let mut logits = model.eval(&mut state, &prompt, Logits::Last)?;
        for _ in 0..WARM_TOKENS {
            let token = crate::sample::max_logit(&logits);
            let token = logits.iter().position(|&v| v == token).unwrap_or(0) as u32;
            logits = model.eval(&mut state, &[token], Logits::Last)?;
            written += 1;
        }
        Ok(())
    })();
    let ms = started.elapsed().as_secs_f64() * 1e3;
    match result {
        Ok(()) => eprintln!(
            "poly-engine: warm-up before READY: a {WARM_PROMPT}-token read and {written} tokens written \
             (kernels loaded, the shallow decode graph captured) in {ms:.0} ms"
        ),
        Err(e) => eprintln!("poly-engine: warm-up before READY failed after {ms:.0} ms: {e}"),
    }
}

/// Writes one protocol line to stdout and flushes it (the server reads line by line).
fn send(out: &mut impl Write, msg: &FromEngine) -> std::io::Result<()> {
    out.write_all(msg.to_line().as_bytes())?;
    out.write_all(b"\n")?;
    out.flush()
}

/// Serves the model on stdin/stdout until QUIT or the end of stdin. A model that cannot be loaded is
/// one `ERR` (id null) and a failure exit.
pub fn serve(opts: ServeOptions) -> ExitCode {
    // The session runs on a worker of its own pool, as bench and run do: the forward pass's parallel
    // regions then start from a worker (the caller takes part, the others are woken within the pool)
    // instead of being injected from outside and waited for on a lock, which cost a tiny model on two
    // threads more than half its token rate (measured: 1,450 against 3,800 t/s at depth 40).
    let mut pool = rayon::ThreadPoolBuilder::new().stack_size(SESSION_STACK);
    if let Some(n) = opts.threads {
        pool = pool.num_threads(n);
    }
    match pool.build() {
        Ok(pool) => pool.install(|| serve_on_pool(opts)),
        Err(e) => fail(
            &mut std::io::stdout().lock(),
            format!("cannot start the worker threads: {e}"),
        ),
    }
}

/// A start that cannot go on: the reason on stderr and as an ERR (the exit status says it all if stdout
/// is gone too).
fn fail(out: &mut impl Write, message: String) -> ExitCode {
    eprintln!("poly-engine: {message}");
    let err = FromEngine::Err(ErrorReply {
        id: None,
        code: ErrorCode::Internal,
        message,
    });
    let _ = send(out, &err);
    ExitCode::FAILURE
}

/// The draft model at `path` for `main`, on the CPU in `arithmetic`, or why not.
fn load_draft(path: &Path, main: &Model, arithmetic: Arithmetic) -> Result<Model, String> {
    if main.on_gpu() {
        return Err("guesses run with a model on the CPU only for now (give --cpu)".into());
    }
    let draft = Model::load(path)
        .map_err(|e| e.to_string())?
        .with_arithmetic(arithmetic);
    match draft::refuses(main, &draft) {
        Some(why) => Err(why),
        None => {
            eprintln!(
                "poly-engine: draft model {} ({}, {} layers)",
                path.display(),
                draft.info().arch,
                draft.new_state(1).n_layers()
            );
            Ok(draft)
        }
    }
}

/// The projector in `file` for `model`, or why it cannot read pictures into it.
fn load_vision<'f>(
    file: &'f GgufFile,
    model: &Model,
) -> Result<poly_models::vision::VisionEncoder<'f>, String> {
    let vision = poly_models::vision::VisionEncoder::load(file).map_err(|e| e.to_string())?;
    model
        .check_projector(vision.projector_type())
        .map_err(|e| e.to_string())?;
    if vision.out_width() != model.info().n_embd {
        return Err(format!(
            "its rows are {} wide, the model's embedding {}",
            vision.out_width(),
            model.info().n_embd
        ));
    }
    eprintln!(
        "poly-engine: projector {} for pictures",
        vision.projector_type()
    );
    Ok(vision)
}

/// The stack of the pool's threads, the session's among them (the main thread's size).
const SESSION_STACK: usize = 8 << 20;

/// [`serve`] on a worker of the pool it built.
fn serve_on_pool(opts: ServeOptions) -> ExitCode {
    // Until the session reads stdin: a server gone while the model loads ends the engine at once.
    let loading = orphan::LoadWatch::start();
    let mut out = std::io::stdout().lock();
    let started = std::time::Instant::now();
    let loaded = match load(
        &opts.model,
        opts.device,
        &opts.placement,
        opts.arithmetic,
        opts.kv,
    ) {
        Ok(l) => l,
        Err(e) => {
            return fail(
                &mut out,
                format!("cannot load {}: {e}", opts.model.display()),
            )
        }
    };
    eprintln!(
        "poly-engine: {} ({}) loaded in {:.2} s on {}, {:?} arithmetic",
        opts.model.display(),
        loaded.model.info().arch,
        started.elapsed().as_secs_f64(),
        loaded.model.device_name(),
        opts.arithmetic
    );
    let n_ctx = if opts.max_context == 0 {
        loaded.model.info().n_ctx_train as usize
    } else {
        opts.max_context
    };
    // A file whose `context_length` is 0 with no --max-context would announce n_ctx 0 and refuse
    // every GEN; llama.cpp refuses it the same way ("n_ctx and n_ctx_train cannot both be zero").
    if n_ctx == 0 {
        return fail(
            &mut out,
            format!(
                "cannot serve {}: its context_length is 0; give --max-context N",
                opts.model.display()
            ),
        );
    }
    if loaded.model.on_gpu() && opts.parallel > 1 {
        // Each request keeps its own state on the card, used in turns: checked on the CPU only so far.
        eprintln!(
            "poly-engine: --parallel {} on a card: requests take turns one call each; not yet checked on a \
             card (benchmarks/parallel_check.py compares their answers with answers alone)",
            opts.parallel
        );
    }
    let draft = match &opts.draft {
        Some(path) => match load_draft(path, &loaded.model, opts.arithmetic) {
            Ok(d) => Some(d),
            Err(e) => {
                return fail(
                    &mut out,
                    format!("cannot use {} as the draft model: {e}", path.display()),
                )
            }
        },
        None => None,
    };
    if opts.draft_block && loaded.model.on_gpu() {
        // The card's forward keeps no hidden rows for the block (its Compute has no `keep_hidden`), so
        // its guesses would read zeros: refused rather than guessing blind.
        return fail(
            &mut out,
            "--draft-block on runs with the model on the CPU only so far (the card keeps no hidden rows \
             for the draft block)"
                .to_string(),
        );
    }
    if opts.draft_block && loaded.model.new_draft_block_state(1).is_none() {
        return fail(
            &mut out,
            format!(
                "--draft-block on: {} has no draft block this engine runs (an MTP block after the \
                 trunk whose attention and experts it computes)",
                opts.model.display()
            ),
        );
    }
    // Loaded here, before READY, so that a projector that cannot serve this model is one ERR at start
    // rather than one per request.
    // On a card the engine serves text only: pictures are read on the CPU so far, and a run config that
    // names a projector (setup writes one) must not keep the model from loading.
    let mmproj_path = opts.mmproj.as_ref().filter(|p| {
        let on_card = loaded.model.on_gpu();
        if on_card {
            eprintln!(
                "poly-engine: {} not used: pictures are read with the model on the CPU only for now \
                 (give --cpu); this engine reads text only",
                p.display()
            );
        }
        !on_card
    });
    let mmproj = match mmproj_path {
        Some(path) => match GgufFile::open(path) {
            Ok(file) => Some((file, path.as_path())),
            Err(e) => return fail(&mut out, format!("cannot read {}: {e}", path.display())),
        },
        None => None,
    };
    let vision = match &mmproj {
        Some((file, path)) => match load_vision(file, &loaded.model) {
            Ok(v) => Some((v, *path)),
            Err(e) => {
                return fail(
                    &mut out,
                    format!("cannot use {} as the projector: {e}", path.display()),
                )
            }
        },
        None => None,
    };
    if loaded.model.on_gpu() && opts.warm_up {
        warm_up(&loaded.model, n_ctx);
    }
    loading.done();
    let inputs = input::spawn_reader(std::io::stdin());
    let mut session = session::Session::new(
        &loaded.model,
        &opts,
        loaded.max_call_tokens,
        inputs,
        &mut out,
    );
    session.draft = draft.as_ref();
    session.vision = vision.as_ref().map(|(v, path)| (v, *path));
    match session.run(&opts.model, loaded.experts_total) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // stdout or stdin failed: the server is gone, nobody reads an ERR.
            eprintln!("poly-engine: {e}");
            ExitCode::FAILURE
        }
    }
}
