//! One token's experts as a single job of a [`HotPool`]: a partly resident model's CPU share of a MoE
//! layer, which must start within microseconds and is itself 20–200 µs of work.
//!
//! The job's tasks are row ranges: first the gate and up products of every expert, then the down
//! products. The thread that finishes an expert's last gate or up range applies its gated unit and
//! quantizes the result for the down product there and then, and the down ranges of that expert wait
//! (spinning, bounded by ranges already running) until it did. So there is one parallel region a layer,
//! no serial step between the products, and a thread that finishes its gate and up ranges goes on to
//! ready experts' down ranges instead of waiting for the slowest range.
//!
//! Every dot product, the gated unit and the quantizations are those of [`super::moe::decode_experts`],
//! and the outputs are summed in routing order: the same bits.

use poly_kernels::hot_pool::HotPool;
use poly_kernels::matmul::{part_bytes, row_ranges, QuantMatrix, RowDots};
use poly_models::compute::Moe;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use super::moe::{activate, mul_mat_id_order};
use super::{profile, CpuWeights, Mat};

/// A buffer that the job's tasks write in disjoint ranges, and read only after the write was published
/// (an expert's readiness flag, or the job's end). Reached only through its raw pointer while the job
/// runs, so no reference to the whole vector exists beside the tasks' ranges.
struct Shared<T> {
    ptr: *mut T,
    len: usize,
    owner: Vec<T>,
}

// SAFETY: tasks write disjoint ranges of the buffer (each range belongs to one task) and read a range
// only after its writer published it with a release store that the reader acquired (`Progress`), or
// after `HotPool::run_beside` returned (every task done).
unsafe impl<T: Send> Sync for Shared<T> {}

impl<T> Shared<T> {
    fn new(mut owner: Vec<T>) -> Shared<T> {
        Shared {
            ptr: owner.as_mut_ptr(),
            len: owner.len(),
            owner,
        }
    }

    /// # Safety
    /// No other task touches `range` meanwhile, and nobody reads it until this write is published.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut(&self, range: Range<usize>) -> &mut [T] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "a job range past its buffer"
        );
        // SAFETY: the range lies inside the buffer (checked) and is this task's alone (the contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }

    /// # Safety
    /// Every write of `range` was published to this thread and none is under way.
    unsafe fn slice(&self, range: Range<usize>) -> &[T] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "a job range past its buffer"
        );
        // SAFETY: the range lies inside the buffer (checked) and nobody writes it now (the contract).
        unsafe { std::slice::from_raw_parts(self.ptr.add(range.start), range.len()) }
    }

    fn into_inner(self) -> Vec<T> {
        self.owner
    }
}

/// One task of the job.
enum Task {
    /// Rows of expert `j`'s gate (`up == false`) or up product.
    GateUp {
        j: usize,
        up: bool,
        rows: Range<usize>,
    },
    /// Rows of expert `j`'s down product.
    Down { j: usize, rows: Range<usize> },
}

/// Per expert: gate and up ranges still running, and whether its quantized hidden row is written.
struct Progress {
    left: Vec<AtomicUsize>,
    ready: Vec<AtomicBool>,
    /// A gate or up range panicked: the down ranges waiting for it give up.
    failed: AtomicBool,
}

/// Sets `failed` if the task holding it unwinds, so no down range waits for an expert forever.
struct FailOnUnwind<'a>(&'a AtomicBool);

impl Drop for FailOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Release);
        }
    }
}

/// `Σ weight · expert(x)` over `route` (one token, `x` `[1, n_embd]`) on `pool`, with `beside` run on
/// this thread meanwhile; returns the sum, `beside`'s result and the seconds from the job's start to
/// its last range (the CPU's own time, whatever `beside` took).
pub(crate) fn decode_experts_beside<R>(
    w: &CpuWeights,
    x: &Mat,
    m: &Moe,
    route: &[(u32, f32)],
    pool: &HotPool,
    beside: impl FnOnce() -> R,
) -> (Mat, R, f64) {
    let n_embd = x.cols;
    let k = route.len();
    if k == 0 {
        return (Mat::zeros(1, n_embd), beside(), 0.0);
    }
    let start = Instant::now();
    let mats = |id, j: usize| w.sub_matrix(id, route[j].0 as usize);
    let gates: Vec<QuantMatrix<'_>> = (0..k).map(|j| mats(m.gate_exps, j)).collect();
    let ups: Vec<QuantMatrix<'_>> = (0..k).map(|j| mats(m.up_exps, j)).collect();
    let downs: Vec<QuantMatrix<'_>> = (0..k).map(|j| mats(m.down_exps, j)).collect();
    let n_ff = gates[0].rows;
    let act_of = |mat: &QuantMatrix<'_>| mat.ty.ops().expect("bound tensors compute").act;
    let quantized = |mat: &QuantMatrix<'_>, v: &[f32]| {
        let act = act_of(mat);
        let mut q = vec![0u8; act.bytes_for(mat.cols)];
        act.quantize(v, &mut q);
        q
    };
    // Experts of one tensor share the format, so one quantized activation per tensor (one for both
    // when gate and up share it).
    let xg = quantized(&gates[0], &x.data);
    let xu = if act_of(&ups[0]) == act_of(&gates[0]) {
        None
    } else {
        Some(quantized(&ups[0], &x.data))
    };
    let xu = xu.as_deref().unwrap_or(&xg);
    let dots = |mat: &QuantMatrix<'_>| RowDots::new(mat, mul_mat_id_order(mat, 1));
    let (gate_dots, up_dots, down_dots) = (dots(&gates[0]), dots(&ups[0]), dots(&downs[0]));
    let hidden_bytes = act_of(&downs[0]).bytes_for(n_ff);

    let total: usize = (0..k)
        .map(|j| gates[j].data.len() + ups[j].data.len() + downs[j].data.len())
        .sum();
    let part = part_bytes(total, pool.threads());
    let mut tasks: Vec<Task> = Vec::new();
    let mut left = Vec::with_capacity(k);
    for j in 0..k {
        let before = tasks.len();
        for (up, mat) in [(false, &gates[j]), (true, &ups[j])] {
            tasks.extend(row_ranges(mat, part).map(|rows| Task::GateUp { j, up, rows }));
        }
        left.push(AtomicUsize::new(tasks.len() - before));
    }
    for (j, d) in downs.iter().enumerate() {
        tasks.extend(row_ranges(d, part).map(|rows| Task::Down { j, rows }));
    }
    let progress = Progress {
        left,
        ready: (0..k).map(|_| AtomicBool::new(false)).collect(),
        failed: AtomicBool::new(false),
    };
    // [k, n_ff] each; [k, hidden_bytes]; [k, n_embd].
    let gate = Shared::new(vec![0f32; k * n_ff]);
    let up = Shared::new(vec![0f32; k * n_ff]);
    let hidden = Shared::new(vec![0u8; k * hidden_bytes]);
    let down = Shared::new(vec![0f32; k * n_embd]);
    let remaining = AtomicUsize::new(tasks.len());
    let finished: Mutex<Option<Instant>> = Mutex::new(None);

    let run = |i: usize| {
        match &tasks[i] {
            Task::GateUp { j, up: is_up, rows } => {
                let _unwind = FailOnUnwind(&progress.failed);
                let (mat, act, dots, out) = if *is_up {
                    (&ups[*j], xu, &up_dots, &up)
                } else {
                    (&gates[*j], &xg[..], &gate_dots, &gate)
                };
                let at = j * n_ff;
                // SAFETY: this task alone writes these rows of expert `j`'s gate or up row; they are
                // read only by the thread that sees `left[j]` reach zero, after every writer's release.
                let y = unsafe { out.slice_mut(at + rows.start..at + rows.end) };
                dots.rows(mat, act, rows.clone(), y);
                if progress.left[*j].fetch_sub(1, Ordering::AcqRel) == 1 {
                    let row = at..at + n_ff;
                    // SAFETY: every gate and up range of expert `j` is done and published to this
                    // thread (the acquire above, on the release sequence of `left[j]`); only this
                    // thread reaches here for `j`, and the down ranges read `hidden` after `ready[j]`.
                    unsafe {
                        let g = gate.slice_mut(row.clone());
                        activate(m.act, g, up.slice(row));
                        let q = hidden.slice_mut(j * hidden_bytes..(j + 1) * hidden_bytes);
                        act_of(&downs[*j]).quantize(g, q);
                    }
                    progress.ready[*j].store(true, Ordering::Release);
                }
            }
            Task::Down { j, rows } => {
                // The gate and up ranges of every expert were claimed before any down range, and run
                // without waiting, so this wait ends unless one of them failed.
                while !progress.ready[*j].load(Ordering::Acquire) {
                    if progress.failed.load(Ordering::Acquire) {
                        panic!("an expert's gate or up product failed");
                    }
                    std::hint::spin_loop();
                }
                // SAFETY: `ready[j]` published expert `j`'s hidden row, written once; this task alone
                // writes these rows of its down output, read after the job.
                let (h, y) = unsafe {
                    (
                        hidden.slice(j * hidden_bytes..(j + 1) * hidden_bytes),
                        down.slice_mut(j * n_embd + rows.start..j * n_embd + rows.end),
                    )
                };
                down_dots.rows(&downs[*j], h, rows.clone(), y);
            }
        }
        if remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            *finished.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        }
    };
    let r = {
        let _span = profile::span(profile::typed("moe.decode experts job", gates[0].ty));
        pool.run_beside(tasks.len(), &run, beside)
    };
    let seconds = finished
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .map_or(0.0, |t| (t - start).as_secs_f64());
    let down = down.into_inner();
    let mut out = Mat::zeros(1, n_embd);
    for (&(_, weight), y) in route.iter().zip(down.chunks(n_embd)) {
        out.data
            .iter_mut()
            .zip(y)
            .for_each(|(a, b)| *a += weight * b);
    }
    (out, r, seconds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::moe::decode_experts;
    use poly_kernels::quant::GgmlType;
    use poly_models::arch::qwen3moe::{self, Qwen3MoeHparams};
    use poly_models::arch::ModelHparams;
    use poly_models::gguf::GgufFile;
    use poly_models::synth::plan::TypeChoice;
    use poly_models::synth::shapes::Shape;
    use poly_models::synth::{SynthOptions, Synthesis};
    use std::sync::Arc;
    use std::time::Duration;

    /// A one-layer qwen3moe whose expert matrices are wide enough to be cut into several ranges each,
    /// in `ty`.
    fn wide_moe(ty: GgmlType, dir: &std::path::Path) -> (CpuWeights, Moe) {
        let shape = Shape {
            arch: qwen3moe::ARCH,
            name: "expert-job",
            aliases: &[],
            description: "one layer, 512 wide, 8 experts (4 used) of 768",
            default_type: ty,
            hparams: ModelHparams::Qwen3Moe(Qwen3MoeHparams {
                n_vocab: 2048,
                n_ctx_train: 256,
                n_embd: 512,
                n_layer: 1,
                n_ff: 512,
                n_head: 4,
                n_head_kv: 2,
                head_dim: 64,
                n_expert: 8,
                n_expert_used: 4,
                n_ff_exp: 768,
                rope_freq_base: 1_000_000.0,
                rms_eps: 1e-6,
            }),
        };
        let path = dir.join(format!("expert-job-{ty}.gguf"));
        let opts = SynthOptions {
            shape,
            types: TypeChoice {
                default: ty,
                overrides: Vec::new(),
            },
            seed: 7,
            route_skew: 0.0,
        };
        Synthesis::prepare(&opts)
            .expect("synth")
            .write(&path, |_, _| {})
            .expect("write");
        let w = CpuWeights::new(Arc::new(GgufFile::open(&path).expect("open")));
        let (m, _) = crate::gpu::expert_cache::tests::first_moe(&w);
        (w, m)
    }

    #[test]
    fn the_job_gives_the_bits_of_the_two_parallel_regions() {
        let dir = std::env::temp_dir().join(format!("poly-expert-job-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        for ty in [GgmlType::Q4_K, GgmlType::Q8_0] {
            let (w, m) = wide_moe(ty, &dir);
            let gate = w.sub_matrix(m.gate_exps, 0);
            assert!(
                row_ranges(&gate, part_bytes(0, 1)).count() > 1,
                "the fixture's experts must be cut into several ranges"
            );
            let x = Mat::from_vec(
                1,
                512,
                (0..512)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
                    .collect(),
            );
            let routes: [&[(u32, f32)]; 3] = [
                &[(3, 0.4), (0, 0.3), (7, 0.2), (5, 0.1)],
                &[(6, 1.0)],
                &[(1, 0.5), (2, 0.5)],
            ];
            for route in routes {
                let want = decode_experts(&w, &x, &m, route);
                for threads in [1, 2, 5, 16] {
                    let pool = HotPool::new(threads, Duration::from_millis(1));
                    let (got, beside, seconds) =
                        decode_experts_beside(&w, &x, &m, route, &pool, || threads);
                    assert_eq!(got.data, want.data, "{ty}, {threads} threads, {route:?}");
                    assert_eq!(beside, threads);
                    assert!(seconds > 0.0);
                }
            }
            let pool = HotPool::new(2, Duration::from_millis(1));
            let (none, (), _) = decode_experts_beside(&w, &x, &m, &[], &pool, || ());
            assert!(none.data.iter().all(|&v| v == 0.0));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
