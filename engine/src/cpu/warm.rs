//! The next MoE layer's likely experts guessed, and read into the host's caches while the card works
//! (`--cpu-warm`, off by default: measured slower).
//!
//! A partly resident token's CPU share reads its experts from host memory, and on the machines measured
//! it is bound by that memory: on an H100 host at 8 GB (qwen3moe shape, uniform routing) the CPU alone
//! wrote as fast as the split between CPU and copies (88.8 against 88.0 tokens/s), because both read
//! the same memory. Meanwhile, between a layer's CPU sum and the next layer's router, the card computes
//! that layer's attention for some 50–90 µs, and host memory sits idle. So the host guesses the next
//! layer's experts from this layer's input (the next layer's router applied to it: the residual stream
//! changes little from one layer to the next) and the share's threads read the guessed experts that are
//! not on the card until the card reaches the next route point. Nothing computed changes: this only
//! reads.
//!
//! Measured on an H100 host (BENCHMARKS.md, 2026-12-06): the guess is good (84% of the guessed missing
//! experts routed on the uniform qwen3moe shape, 77% on the skewed qwen35moe one) and the reading done
//! in time, yet answers fell from 82 to 52 tokens/s (q3u) and from 112 to 80 (q35s): the share itself
//! got slower and so did the card's stretch between the points. Likely causes: the lines land in the
//! reading core's own caches, from which other cores read them no faster than from memory, and the
//! card's own page-locked reads and writes at the points wait behind the reading. The guess stays for
//! its accuracy figure (the profile's `--cpu-warm` line) and for copying the guessed experts to the
//! card ahead, which needs no host core.

use std::sync::atomic::{AtomicBool, Ordering};

use poly_kernels::hot_pool::HotPool;
use poly_kernels::matmul::{QuantMatrix, RowDots};
use poly_models::compute::Moe;

use super::CpuWeights;

/// Router rows per task of the guess.
const ROUTER_ROWS_PER_TASK: usize = 8;

/// Bytes read per task of the warm-up (a task checks for the card between chunks).
const WARM_CHUNK: usize = 128 << 10;

/// The `n` experts `m`'s router scores highest for the one-token input `x` (`[n_embd]`), highest first,
/// computed on `pool`. A guess only: the router's logits in the file's format with the single-row dot
/// product, ranked by [`poly_kernels::ops::topk::top_k`]; with `bias` (`--cache-bias`'s vector of the
/// layer: the choice the card will make), by probability plus bias
/// ([`poly_kernels::ops::topk::route_biased`]).
pub(crate) fn likeliest_experts(
    w: &CpuWeights,
    m: &Moe,
    x: &[f32],
    (n, bias): (usize, Option<&[f32]>),
    pool: &HotPool,
) -> Vec<usize> {
    let router = w.matrix(m.router);
    if x.len() != router.cols || router.rows == 0 {
        return Vec::new();
    }
    let Some(ops) = router.ty.ops() else {
        return Vec::new();
    };
    let mut act = vec![0u8; ops.act.bytes_for(router.cols)];
    ops.act.quantize(x, &mut act);
    let dots = RowDots::new(&router, None);
    let logits: Vec<std::sync::Mutex<Vec<f32>>> = (0..router.rows.div_ceil(ROUTER_ROWS_PER_TASK))
        .map(|_| std::sync::Mutex::new(Vec::new()))
        .collect();
    pool.run(logits.len(), &|t| {
        let rows = t * ROUTER_ROWS_PER_TASK..((t + 1) * ROUTER_ROWS_PER_TASK).min(router.rows);
        let mut y = vec![0f32; rows.len()];
        dots.rows(&router, &act, rows, &mut y);
        *logits[t].lock().unwrap_or_else(|p| p.into_inner()) = y;
    });
    let logits: Vec<f32> = logits
        .into_iter()
        .flat_map(|l| l.into_inner().unwrap_or_else(|p| p.into_inner()))
        .collect();
    match bias.filter(|b| b.len() == logits.len()) {
        Some(b) => {
            use poly_kernels::ops::topk::{route_biased, Gating as KGating};
            let gating = match m.gating {
                poly_models::compute::Gating::Softmax => KGating::Softmax,
                poly_models::compute::Gating::Sigmoid => KGating::Sigmoid,
            };
            route_biased(&logits, gating, Some(b), n, false, 1.0)
                .into_iter()
                .map(|(e, _)| e as usize)
                .collect()
        }
        None => poly_kernels::ops::topk::top_k(&logits, n),
    }
}

/// Reads the gate, up and down matrices of `m`'s `experts` on `pool`'s workers while this thread runs
/// `beside` (the wait for the card), and stops reading once `beside` returned. Returns `beside`'s result
/// and the bytes read.
pub(crate) fn warm_experts_beside<R>(
    w: &CpuWeights,
    m: &Moe,
    experts: &[usize],
    pool: &HotPool,
    beside: impl FnOnce() -> R,
) -> (R, usize) {
    let mut chunks: Vec<&[u8]> = Vec::new();
    for &e in experts.iter().filter(|&&e| e < m.n_expert) {
        for id in [m.gate_exps, m.up_exps, m.down_exps] {
            let mat: QuantMatrix<'_> = w.sub_matrix(id, e);
            chunks.extend(mat.data.chunks(WARM_CHUNK));
        }
    }
    let stop = AtomicBool::new(false);
    let read = std::sync::atomic::AtomicUsize::new(0);
    let task = |i: usize| {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let chunk = chunks[i];
        let mut acc = 0u8;
        for line in chunk.chunks(64) {
            // SAFETY: `line` is a live, non-empty slice of the mapped file; a volatile read keeps the
            // load (its value is unused beyond the black box).
            acc ^= unsafe { std::ptr::read_volatile(line.as_ptr()) };
        }
        std::hint::black_box(acc);
        read.fetch_add(chunk.len(), Ordering::Relaxed);
    };
    let r = pool.run_beside(chunks.len(), &task, || {
        let r = beside();
        stop.store(true, Ordering::Relaxed);
        r
    });
    (r, read.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::moe::moe_observed;
    use crate::cpu::{Arithmetic, Mat};
    use std::time::Duration;

    /// A layer's own router on its own input guesses exactly the experts the layer routes to, and the
    /// warm-up reads every guessed byte when the card is slow and stops when it is not.
    #[test]
    fn the_guess_is_the_routing_and_the_warm_up_stops_for_the_card() {
        let w = crate::gpu::expert_cache::tests::fixture("qwen3moe-tiny-q4km.gguf");
        let (m, n_embd) = crate::gpu::expert_cache::tests::first_moe(&w);
        let pool = HotPool::new(2, Duration::from_millis(1));
        for seed in 0..8u32 {
            let x: Vec<f32> = (0..n_embd)
                .map(|i| {
                    let h = (i as u32).wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503);
                    (h % 1000) as f32 / 500.0 - 1.0
                })
                .collect();
            let mut routed = Vec::new();
            let xm = Mat::from_vec(1, n_embd, x.clone());
            moe_observed(&w, &xm, &m, Arithmetic::LlamaCpp, None, |r| {
                routed = r[0].iter().map(|&(e, _)| e as usize).collect()
            });
            let mut guess = likeliest_experts(&w, &m, &x, (m.n_expert_used, None), &pool);
            guess.sort_unstable();
            routed.sort_unstable();
            assert_eq!(guess, routed, "seed {seed}");
            // `--cache-bias`'s lean: a zero vector guesses the same, a bias of 1 on every other expert
            // only those.
            let zeros = vec![0.0f32; m.n_expert];
            let mut same = likeliest_experts(&w, &m, &x, (m.n_expert_used, Some(&zeros)), &pool);
            same.sort_unstable();
            assert_eq!(same, routed, "seed {seed}, a zero bias");
            let odd: Vec<f32> = (0..m.n_expert).map(|e| (e % 2) as f32).collect();
            let leaned = likeliest_experts(&w, &m, &x, (m.n_expert_used, Some(&odd)), &pool);
            assert_eq!(leaned.len(), m.n_expert_used);
            assert!(leaned.iter().all(|e| e % 2 == 1), "seed {seed}: {leaned:?}");
        }
        let all: Vec<usize> = (0..m.n_expert).collect();
        let bytes: usize = [m.gate_exps, m.up_exps, m.down_exps]
            .iter()
            .map(|&id| w.sub_matrix(id, 0).data.len())
            .sum::<usize>()
            * m.n_expert;
        let (r, read) = warm_experts_beside(&w, &m, &all, &pool, || {
            std::thread::sleep(Duration::from_millis(200));
            7
        });
        assert_eq!((r, read), (7, bytes));
        // A card already there: nothing is left to read after `beside`, and no more than what the
        // workers had begun meanwhile was read.
        let (_, read) = warm_experts_beside(&w, &m, &all, &pool, || ());
        assert!(read <= bytes);
        // Unknown experts are skipped.
        let (_, read) = warm_experts_beside(&w, &m, &[m.n_expert + 3], &pool, || ());
        assert_eq!(read, 0);
    }
}
