//! The GPU backend against the CPU engine: the next-token probabilities of a prompt read in one call, in
//! several calls, of every row of a call and of a few greedy steps after it, and the state on the card
//! copied back to the host.
//!
//! - Float models (`synth --type F16` of each architecture, written into a temporary directory): no
//!   activation is quantized on either side, so the two backends differ only by summation order and must
//!   agree closely (top-5 probabilities within 0.01, the same greedy tokens, states within 5e-3; measured
//!   on the H200: ≤ 0.0025 and ≤ 1.3e-3). This is the test that finds a wrong graph or kernel.
//! - The committed 4-bit fixtures (tests/fixtures/models/*.gguf), against a CPU run with the card's
//!   activation rounding (`Model::eval_q8_1_reference`; the CPU proper is printed too). These random tiny
//!   models are chaotic: the CPU against itself with q8_1-rounded activations differs by up to 0.57 in
//!   probability and flips greedy tokens where routing margins are ~1e-3 (examples/gpu_diag.rs
//!   `sensitivity` and `lockstep`), so they are held only to gross-error bounds (top-5 within 0.3, states
//!   within 0.1) and issue 7 §3's bounds (0.05 near ties, 0.1) are printed, not asserted.
//!
//! Needs a CUDA device: without one (CI) each test prints why it is skipped and passes. Cost on the H200:
//! a few seconds (the CPU side dominates: six tiny models, a 40-token prompt, 8 steps).
//!
//! The fixtures are found through `POLY_FIXTURES`, else `tests/fixtures/models` under the current
//! directory (the repository root, where the device machine runs the carried binary), else relative to this
//! crate's source.

use std::path::{Path, PathBuf};

use poly_engine::gpu::DeviceChoice;
use poly_engine::state::{LayerState, SeqState};
use poly_engine::Model;
use poly_kernels::cuda::Device;
use poly_kernels::quant::GgmlType;
use poly_models::compute::Logits;
use poly_models::synth::plan::TypeChoice;
use poly_models::synth::shapes::find_shape;
use poly_models::synth::{SynthOptions, Synthesis};

fn fixtures_dir() -> PathBuf {
    if let Ok(d) = std::env::var("POLY_FIXTURES") {
        return PathBuf::from(d);
    }
    let here = PathBuf::from("tests/fixtures/models");
    if here.is_dir() {
        return here;
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models")
}

fn fixtures() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .expect("the fixtures directory")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .filter(|p| card_runs(p))
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no fixtures in {:?}", fixtures_dir());
    v
}

/// Whether the card runs the model at `path`: a fixture of an architecture it refuses (lfm2moe's selection
/// bias, gemma4's MoE form, glm5-next's operations only the CPU runs) is left out, saying so.
fn card_runs(path: &Path) -> bool {
    let why = Model::load(path).ok().and_then(|m| m.gpu_refuses());
    if let Some(why) = &why {
        eprintln!("{}: left out: {why}", path.display());
    }
    why.is_none()
}

fn gpu_present() -> bool {
    if Device::count() == 0 {
        eprintln!("skipped: no CUDA device");
        return false;
    }
    true
}

fn softmax(logits: &[f32]) -> Vec<f64> {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = logits.iter().map(|&l| (l as f64 - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

/// Ids of the `n` likeliest, likeliest first (lowest id among equals).
fn top(p: &[f64], n: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..p.len()).collect();
    idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    idx.truncate(n);
    idx
}

/// How one step's distributions compare.
#[derive(Default, Debug, Clone, Copy)]
struct Agreement {
    /// Largest difference of the CPU's top-5 probabilities.
    top5: f64,
    /// Greedy tokens that differ outside a near tie.
    greedy_mismatch: usize,
    /// Greedy tokens that differ at a near tie (allowed).
    near_ties: usize,
}

impl Agreement {
    fn add(&mut self, cpu: &[f32], gpu: &[f32]) {
        let (pc, pg) = (softmax(cpu), softmax(gpu));
        let tc = top(&pc, 5);
        for &i in &tc {
            self.top5 = self.top5.max((pc[i] - pg[i]).abs());
        }
        let tg = top(&pg, 1)[0];
        if tg != tc[0] {
            if pc[tc[0]] - pc[tc[1]] < 0.05 || pg[tg] - pg[tc[0]] < 0.05 {
                self.near_ties += 1;
            } else {
                self.greedy_mismatch += 1;
            }
        }
    }

    fn check(&self, what: &str, top5_bound: f64, greedy: bool) {
        assert!(
            !greedy || self.greedy_mismatch == 0,
            "{what}: greedy tokens differ outside near ties: {self:?}"
        );
        assert!(
            self.top5 <= top5_bound,
            "{what}: top-5 probabilities differ: {self:?}"
        );
    }
}

fn prompt(n_vocab: usize, n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n_vocab as u64) as u32
        })
        .collect()
}

/// Reads `prompt` in calls of `chunk` tokens (the last call asks for the last token's logits).
fn read(model: &Model, state: &mut SeqState, prompt: &[u32], chunk: usize) -> Vec<f32> {
    let mut last = Vec::new();
    let mut pos = 0;
    while pos < prompt.len() {
        let end = (pos + chunk).min(prompt.len());
        let want = if end == prompt.len() {
            Logits::Last
        } else {
            Logits::None
        };
        last = model.eval(state, &prompt[pos..end], want).expect("eval");
        pos = end;
    }
    last
}

/// Largest relative difference of the states' KV rows and recurrent states (the host copies, brought up
/// to date from the card first).
fn state_diff(a: &SeqState, b: &SeqState) -> f64 {
    let (mut a, mut b) = (a.clone(), b.clone());
    a.sync().expect("state a back from the card");
    b.sync().expect("state b back from the card");
    let (a, b) = (&a, &b);
    let rel = |x: &[f32], y: &[f32]| -> f64 {
        assert_eq!(x.len(), y.len(), "state sizes differ");
        let num: f64 = x.iter().zip(y).map(|(p, q)| ((p - q) as f64).powi(2)).sum();
        let den: f64 = x
            .iter()
            .map(|p| (*p as f64).powi(2))
            .sum::<f64>()
            .max(1e-30);
        (num / den).sqrt()
    };
    let mut worst = 0f64;
    for il in 0..a.n_layers() {
        let d = match (a.layer(il), b.layer(il)) {
            (LayerState::Kv(x), LayerState::Kv(y)) => {
                rel(x.keys(), y.keys()).max(rel(x.values(), y.values()))
            }
            (LayerState::Recurrent(x), LayerState::Recurrent(y)) => {
                rel(&x.conv, &y.conv).max(rel(&x.delta, &y.delta))
            }
            _ => panic!("layer kinds differ"),
        };
        worst = worst.max(d);
    }
    worst
}

/// The CPU a comparison runs against: the CPU proper, or the CPU with the card's activation rounding.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Reference {
    Cpu,
    CpuQ81,
}

fn eval_on(model: &Model, r: Reference, s: &mut SeqState, t: &[u32], l: Logits) -> Vec<f32> {
    match r {
        Reference::Cpu => model.eval(s, t, l).expect("eval"),
        Reference::CpuQ81 => model.eval_q8_1_reference(s, t, l).expect("reference eval"),
    }
}

/// The three comparisons of one fixture against one reference.
struct FixtureResult {
    decode: Agreement,
    split: Agreement,
    rows: Agreement,
    state: f64,
    split_state: f64,
}

fn compare_fixture(cpu: &Model, gpu: &Model, r: Reference) -> FixtureResult {
    let n_vocab = cpu.info().n_vocab;
    let p = prompt(n_vocab, 40, 7);
    let ev = |s: &mut SeqState, t: &[u32], l: Logits| eval_on(cpu, r, s, t, l);

    // The prompt in one call, then 8 greedy steps (the reference's token fed to both).
    let mut sc = cpu.new_state(256);
    let mut sg = gpu.new_state(256);
    let mut decode = Agreement::default();
    let mut lc = ev(&mut sc, &p, Logits::Last);
    let mut lg = read(gpu, &mut sg, &p, p.len());
    decode.add(&lc, &lg);
    for _ in 0..8 {
        let t = top(&softmax(&lc), 1)[0] as u32;
        lc = ev(&mut sc, &[t], Logits::Last);
        lg = gpu.eval(&mut sg, &[t], Logits::Last).unwrap();
        decode.add(&lc, &lg);
    }
    let state = state_diff(&sc, &sg);

    // The prompt in calls of 7, 16 and 1 tokens, each against the reference's one-call read.
    let mut split = Agreement::default();
    let mut one = cpu.new_state(256);
    let reference = ev(&mut one, &p, Logits::Last);
    let mut split_state = 0f64;
    for chunk in [7, 16, 1] {
        let mut s = gpu.new_state(256);
        let l = read(gpu, &mut s, &p, chunk);
        split.add(&reference, &l);
        split_state = split_state.max(state_diff(&one, &s));
    }

    // Every row's logits of one call against the reference's.
    let mut rows = Agreement::default();
    let mut sa = cpu.new_state(256);
    let mut sb = gpu.new_state(256);
    let ac = ev(&mut sa, &p[..12], Logits::All);
    let ag = gpu.eval(&mut sb, &p[..12], Logits::All).unwrap();
    assert_eq!(ac.len(), ag.len());
    for (c, g) in ac.chunks(n_vocab).zip(ag.chunks(n_vocab)) {
        rows.add(c, g);
    }
    FixtureResult {
        decode,
        split,
        rows,
        state,
        split_state,
    }
}

/// Compares every model in `paths` against `reference`, printing each result, and returns the failures
/// of `top5_bound` (and, with `greedy`, of greedy tokens outside near ties) and `state_bound`.
fn compare_all(
    paths: &[PathBuf],
    references: &[Reference],
    held: Reference,
    bounds: (f64, bool, f64),
) -> Vec<String> {
    let (top5_bound, greedy, state_bound) = bounds;
    let mut failures = Vec::new();
    for path in paths {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let cpu = Model::load(path).expect("load");
        let mut gpu = Model::load(path).expect("load");
        gpu.use_device(DeviceChoice::Gpu(0)).expect("GPU backend");
        for &r in references {
            let f = compare_fixture(&cpu, &gpu, r);
            eprintln!(
                "{name} vs {r:?}: {}: decode top5 {:.4} mismatches {} near-ties {}; split reads top5 \
                 {:.4} mismatches {} near-ties {}; all rows top5 {:.4} mismatches {}; state rel diff \
                 {:.2e}, split {:.2e}",
                gpu.device_name(),
                f.decode.top5,
                f.decode.greedy_mismatch,
                f.decode.near_ties,
                f.split.top5,
                f.split.greedy_mismatch,
                f.split.near_ties,
                f.rows.top5,
                f.rows.greedy_mismatch,
                f.state,
                f.split_state
            );
            if r != held {
                continue;
            }
            for (what, a) in [("decode", f.decode), ("split", f.split), ("rows", f.rows)] {
                let check = || a.check(&format!("{name} {what}"), top5_bound, greedy);
                if let Err(e) = std::panic::catch_unwind(check) {
                    let msg = e
                        .downcast_ref::<String>()
                        .cloned()
                        .unwrap_or_else(|| format!("{name} {what}: failed"));
                    failures.push(msg);
                }
            }
            if f.state > state_bound || f.split_state > state_bound {
                failures.push(format!(
                    "{name}: state differs: {:.3e} / {:.3e}",
                    f.state, f.split_state
                ));
            }
        }
    }
    failures
}

/// The tiny shape of `arch` with every tensor in F16, written once into a temporary directory.
fn float_model(arch: &str) -> PathBuf {
    float_shape(arch, "tiny")
}

/// The shape `shape` of `arch` with every tensor in F16, written once into a temporary directory.
fn float_shape(arch: &str, shape: &str) -> PathBuf {
    // Tests run in parallel: the lock keeps two of them from writing one file at once.
    static WRITING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = WRITING.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("poly-gpu-forward-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(format!("{arch}-{shape}-f16.gguf"));
    if path.is_file() {
        return path;
    }
    let opts = SynthOptions {
        shape: find_shape(arch, shape).expect("a synth shape"),
        types: TypeChoice {
            default: GgmlType::F16,
            overrides: Vec::new(),
        },
        seed: 1,
        route_skew: 0.0,
    };
    Synthesis::prepare(&opts)
        .expect("synth plan")
        .write(&path, |_, _| {})
        .expect("synth write");
    path
}

#[test]
fn gpu_forward_matches_the_cpu_closely_on_float_models() {
    if !gpu_present() {
        return;
    }
    let mut paths: Vec<PathBuf> = ["qwen3moe", "qwen35moe", "gemma3"]
        .iter()
        .map(|a| float_model(a))
        .collect();
    // llama's optional tensors: Llama 3.1's RoPE frequency factors (the rope kernel's factor pointer) and
    // the projections' biases (add_weight).
    paths.extend(["tiny-rope-freqs", "tiny-bias"].map(|s| float_shape("llama", s)));
    let failures = compare_all(
        &paths,
        &[Reference::Cpu],
        Reference::Cpu,
        (0.01, true, 5e-3),
    );
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn gpu_forward_stays_within_gross_bounds_on_the_4bit_fixtures() {
    if !gpu_present() {
        return;
    }
    let failures = compare_all(
        &fixtures(),
        &[Reference::Cpu, Reference::CpuQ81],
        Reference::CpuQ81,
        (0.3, false, 0.1),
    );
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn a_conversation_moved_between_sequences_is_uploaded_again() {
    if !gpu_present() {
        return;
    }
    // Two sequences alternating on one card: each call finds the other's state there and must upload its
    // own from the host first.
    // A float model, so the comparison is tight (see the crate doc).
    let path = float_model("qwen35moe");
    let cpu = Model::load(&path).unwrap();
    let mut gpu = Model::load(&path).unwrap();
    gpu.use_device(DeviceChoice::Gpu(0)).unwrap();
    let n_vocab = cpu.info().n_vocab;
    let (pa, pb) = (prompt(n_vocab, 20, 1), prompt(n_vocab, 20, 2));
    let (mut ga, mut gb) = (gpu.new_state(128), gpu.new_state(128));
    let (mut ca, mut cb) = (cpu.new_state(128), cpu.new_state(128));
    let mut agree = Agreement::default();
    for i in 0..4 {
        let (a, b) = (&pa[i * 5..i * 5 + 5], &pb[i * 5..i * 5 + 5]);
        let la = gpu.eval(&mut ga, a, Logits::Last).unwrap();
        let lb = gpu.eval(&mut gb, b, Logits::Last).unwrap();
        agree.add(&cpu.eval(&mut ca, a, Logits::Last).unwrap(), &la);
        agree.add(&cpu.eval(&mut cb, b, Logits::Last).unwrap(), &lb);
    }
    eprintln!("alternating sequences: {agree:?}");
    agree.check("alternating sequences", 0.01, true);
}

#[test]
fn decode_graph_replays_equal_the_eager_calls_and_follow_switched_sequences() {
    if !gpu_present() {
        return;
    }
    // One-token calls asking for the last row go through decode graphs (run and captured once per context
    // bucket, then replayed); asking for all rows of the same one-token call runs eagerly through the same
    // kernels. The two must give identical logits and states, including when two sequences alternate on
    // the card (each call uploads the other's state first) and across a context bucket (256 rows).
    for arch in ["qwen35moe", "qwen3moe", "gemma3"] {
        let path = float_model(arch);
        let cpu = Model::load(&path).unwrap();
        let mut gpu = Model::load(&path).unwrap();
        gpu.use_device(DeviceChoice::Gpu(0)).unwrap();
        let n_vocab = cpu.info().n_vocab;
        let (pa, pb) = (prompt(n_vocab, 250, 3), prompt(n_vocab, 12, 4));
        let mut graph_a = gpu.new_state(512);
        let mut eager_a = gpu.new_state(512);
        let mut graph_b = gpu.new_state(512);
        let mut cpu_b = cpu.new_state(512);
        read(&gpu, &mut graph_a, &pa, pa.len());
        read(&gpu, &mut eager_a, &pa, pa.len());
        read(&gpu, &mut graph_b, &pb, pb.len());
        read(&cpu, &mut cpu_b, &pb, pb.len());
        let mut agree = Agreement::default();
        for i in 0..12u32 {
            let t = (i * 7919 + 11) % n_vocab as u32;
            let g = gpu.eval(&mut graph_a, &[t], Logits::Last).unwrap();
            let e = gpu.eval(&mut eager_a, &[t], Logits::All).unwrap();
            assert_eq!(g, e, "{arch}: step {i} (position {})", 250 + i);
            let gb = gpu.eval(&mut graph_b, &[t], Logits::Last).unwrap();
            agree.add(&cpu.eval(&mut cpu_b, &[t], Logits::Last).unwrap(), &gb);
        }
        assert_eq!(state_diff(&graph_a, &eager_a), 0.0, "{arch}: states");
        eprintln!("{arch}: alternating decode vs the CPU {agree:?}");
        agree.check(&format!("{arch} alternating decode"), 0.01, true);
        let d = state_diff(&cpu_b, &graph_b);
        assert!(
            d < 5e-3,
            "{arch}: decoded state differs from the CPU's by {d}"
        );
    }
}

#[test]
fn states_left_on_the_card_fork_checkpoint_and_restore_as_on_the_cpu() {
    if !gpu_present() {
        return;
    }
    // After a call the host state is behind the card's (copied back when read). A fork (clone) of it, a
    // checkpoint, and a restore must still behave as the CPU's: the fork keeps the state of the moment it
    // was taken while the original goes on, and each continues on its own.
    let path = float_model("qwen35moe");
    let cpu = Model::load(&path).unwrap();
    let mut gpu = Model::load(&path).unwrap();
    gpu.use_device(DeviceChoice::Gpu(0)).unwrap();
    let n_vocab = cpu.info().n_vocab;
    let p = prompt(n_vocab, 16, 5);
    let (mut g, mut c) = (gpu.new_state(128), cpu.new_state(128));
    read(&gpu, &mut g, &p, p.len());
    read(&cpu, &mut c, &p, p.len());
    let mut agree = Agreement::default();
    let step = |g: &mut SeqState, c: &mut SeqState, t: u32, agree: &mut Agreement| {
        let lg = gpu.eval(g, &[t], Logits::Last).unwrap();
        agree.add(&cpu.eval(c, &[t], Logits::Last).unwrap(), &lg);
    };
    for t in [3, 5, 7] {
        step(&mut g, &mut c, t, &mut agree);
    }
    let (mut g_fork, mut c_fork) = (g.clone(), c.clone());
    let (g_cp, c_cp) = (g.checkpoint(), c.checkpoint());
    for t in [11, 13, 17] {
        step(&mut g, &mut c, t, &mut agree);
    }
    for t in [19, 23] {
        step(&mut g_fork, &mut c_fork, t, &mut agree);
    }
    let fork_diff = state_diff(&c_fork, &g_fork);
    assert!(g.restore(&g_cp) && c.restore(&c_cp));
    for t in [29, 31] {
        step(&mut g, &mut c, t, &mut agree);
    }
    eprintln!("fork/checkpoint/restore: {agree:?}, fork state {fork_diff:.2e}");
    agree.check("fork/checkpoint/restore", 0.01, true);
    assert!(fork_diff < 5e-3, "fork state differs by {fork_diff}");
    let d = state_diff(&c, &g);
    assert!(d < 5e-3, "restored state differs by {d}");
}

#[test]
fn a_kept_state_survives_other_sequences_written_over_it_bit_for_bit() {
    if !gpu_present() {
        return;
    }
    // A kept copy of a state left on the card (a request's undo copy, a parked conversation) is saved to
    // the host only as other sequences overwrite its rows (copy on write, in chunks of 256 rows and up)
    // and its recurrent states. Continued afterwards (uploaded again), it must give exactly what the
    // same calls give with nothing in between.
    for arch in ["qwen3moe", "qwen35moe"] {
        let path = float_model(arch);
        let mut gpu = Model::load(&path).unwrap();
        gpu.use_device(DeviceChoice::Gpu(0)).unwrap();
        let n_vocab = gpu.info().n_vocab;
        let (pa, pb, pc) = (
            prompt(n_vocab, 600, 6),
            prompt(n_vocab, 40, 7),
            prompt(n_vocab, 400, 8),
        );
        let steps: Vec<u32> = (0..4u32).map(|i| (i * 7919 + 5) % n_vocab as u32).collect();
        let run_kept = |s: &mut SeqState| {
            read(&gpu, s, &pa, 512);
            for &t in &steps[..3] {
                gpu.eval(s, &[t], Logits::Last).unwrap();
            }
        };
        let mut kept = gpu.new_state(1024);
        run_kept(&mut kept);
        let cp = kept.checkpoint();
        assert_eq!(cp.n_past(), 603);
        let mut undo = kept.clone();
        // A KV-only state is cut while behind (a conversation resumed before its end): its copy on the
        // card is cut, not brought back.
        let kv_only = arch == "qwen3moe";
        let mut cut = kept.clone();
        assert_eq!(cut.truncate(550), kv_only);
        // Another conversation over it: a short read and 20 tokens (the first chunk of rows saved),
        // then a long read (the next chunk).
        kept.clear();
        read(&gpu, &mut kept, &pb, 512);
        for i in 0..20u32 {
            gpu.eval(&mut kept, &[(i * 31 + 1) % n_vocab as u32], Logits::Last)
                .unwrap();
        }
        read(&gpu, &mut kept, &pc, 512);
        let l_undo = gpu.eval(&mut undo, &[steps[3]], Logits::Last).unwrap();
        // The same calls with nothing in between.
        let mut fresh = gpu.new_state(1024);
        run_kept(&mut fresh);
        let l_fresh = gpu.eval(&mut fresh, &[steps[3]], Logits::Last).unwrap();
        let worst = l_undo
            .iter()
            .zip(&l_fresh)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!(
            "{arch}: kept state continued vs the same calls alone: logits differ by {worst:e}, \
             states by {:e}",
            state_diff(&undo, &fresh)
        );
        assert_eq!(
            l_undo, l_fresh,
            "{arch}: logits after the kept state came back"
        );
        assert_eq!(state_diff(&undo, &fresh), 0.0, "{arch}: states");
        // The other conversation, continued from where it was left, is intact too.
        let l_other = gpu.eval(&mut kept, &[9], Logits::Last).unwrap();
        let mut again = gpu.new_state(1024);
        read(&gpu, &mut again, &pb, 512);
        for i in 0..20u32 {
            gpu.eval(&mut again, &[(i * 31 + 1) % n_vocab as u32], Logits::Last)
                .unwrap();
        }
        read(&gpu, &mut again, &pc, 512);
        let l_again = gpu.eval(&mut again, &[9], Logits::Last).unwrap();
        assert_eq!(l_other, l_again, "{arch}: the other conversation");
        assert_eq!(state_diff(&kept, &again), 0.0, "{arch}: other states");
        if kv_only {
            // A fork cut back and written on (an answer regenerated): the kept state saves only the
            // rows past the cut, and comes back with them.
            let mut forked = gpu.new_state(1024);
            run_kept(&mut forked);
            let mut before = forked.clone();
            assert!(forked.truncate(550));
            for i in 0..10u32 {
                gpu.eval(&mut forked, &[(i * 17 + 3) % n_vocab as u32], Logits::Last)
                    .unwrap();
            }
            let l_before = gpu.eval(&mut before, &[steps[3]], Logits::Last).unwrap();
            assert_eq!(l_before, l_fresh, "{arch}: a fork's kept state");
            assert_eq!(
                state_diff(&before, &fresh),
                0.0,
                "{arch}: a fork's kept state"
            );
            let l_cut = gpu.eval(&mut cut, &[steps[3]], Logits::Last).unwrap();
            let mut whole = gpu.new_state(1024);
            run_kept(&mut whole);
            whole.sync().unwrap();
            assert!(whole.truncate(550));
            let l_whole = gpu.eval(&mut whole, &[steps[3]], Logits::Last).unwrap();
            assert_eq!(l_cut, l_whole, "{arch}: a state cut while behind");
            assert_eq!(state_diff(&cut, &whole), 0.0, "{arch}: cut states");
        }
        eprintln!("{arch}: kept state bit for bit after 460 rows written over it");
    }
}

#[test]
fn attention_caches_grown_past_the_growth_step_keep_every_row() {
    if !gpu_present() {
        return;
    }
    // Held to a reserve (the default placement of a model with routed experts), the card's KV buffers
    // hold the rows a conversation needs rounded up to 2,048 and grow in place (the rows copied on the
    // card, the decode graphs captured again) when a call needs more. A prompt read across the step in
    // calls of 700 tokens, answered token by token past it, another sequence read in between and the
    // first one continued: every step as the CPU's.
    for arch in ["qwen3moe", "qwen35moe"] {
        let path = float_model(arch);
        let cpu = Model::load(&path).unwrap();
        let mut gpu = Model::load(&path).unwrap();
        gpu.use_device(DeviceChoice::Gpu(0)).unwrap();
        let n_vocab = cpu.info().n_vocab;
        let long = prompt(n_vocab, 2040, 5);
        let (mut g, mut c) = (gpu.new_state(4200), cpu.new_state(4200));
        let mut agree = Agreement::default();
        agree.add(
            &read(&cpu, &mut c, &long, 700),
            &read(&gpu, &mut g, &long, 700),
        );
        let step = |agree: &mut Agreement, g: &mut SeqState, c: &mut SeqState, i: u32| {
            let t = (i * 7919 + 13) % n_vocab as u32;
            let lc = cpu.eval(c, &[t], Logits::Last).unwrap();
            let lg = gpu.eval(g, &[t], Logits::Last).unwrap();
            agree.add(&lc, &lg);
        };
        for i in 0..16 {
            step(&mut agree, &mut g, &mut c, i);
        }
        let other = prompt(n_vocab, 30, 6);
        let (mut g2, mut c2) = (gpu.new_state(4200), cpu.new_state(4200));
        agree.add(
            &read(&cpu, &mut c2, &other, 30),
            &read(&gpu, &mut g2, &other, 30),
        );
        for i in 16..20 {
            step(&mut agree, &mut g, &mut c, i);
        }
        eprintln!("{arch}: caches grown past 2,048 rows vs the CPU {agree:?}");
        agree.check(&format!("{arch} grown caches"), 0.01, true);
        let d = state_diff(&c, &g);
        assert!(
            d < 5e-3,
            "{arch}: the grown state differs from the CPU's by {d}"
        );
    }
}
