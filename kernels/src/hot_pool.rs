//! A small pool of worker threads that spin between jobs for a bounded time, for work that arrives in
//! bursts microseconds apart and must start at once: a partly resident model's CPU share of a token's
//! experts comes once per MoE layer, every 100–400 µs, and is itself 20–200 µs of work. Rayon's workers go
//! to sleep within microseconds of running dry, and waking sixteen of them costs tens of microseconds,
//! which is as much as the work.
//!
//! [`HotPool::run`] hands out the tasks `0..n` of one job to the workers and the calling thread (each task
//! claimed once, by an atomic counter) and returns when all ran. A worker that saw no job for
//! [`HotPool`]'s spin window parks on a condition variable until the next; nothing waits on a parked
//! worker (the caller and the spinning ones claim every task), so a job never depends on a wake-up.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The job being run: its tasks and how many.
#[derive(Clone, Copy)]
struct Job {
    /// Points at the caller's `&(dyn Fn(usize) + Sync)` for the life of its [`HotPool::run`] call.
    task: *const (dyn Fn(usize) + Sync + 'static),
    n: usize,
}

struct Shared {
    /// Odd while a job is open, even between jobs; a worker joins the job of the epoch it saw.
    epoch: AtomicU64,
    /// Written by the caller before the epoch turns odd and after every worker left the last job; read by
    /// workers inside the odd epoch they saw (see [`HotPool::run`]). Not a lock: fifteen workers taking
    /// one at the same instant queued on it for microseconds, a share's whole budget.
    job: UnsafeCell<Option<Job>>,
    /// The next task to claim, and tasks finished, of the open job.
    next: AtomicUsize,
    done: AtomicUsize,
    /// Workers that may be reading the open job (the caller closes it only when none is).
    inside: AtomicUsize,
    /// Parked workers (waiting on `wake`), and the lock they park under.
    parked: AtomicUsize,
    park: Mutex<()>,
    wake: Condvar,
    stop: AtomicBool,
}

// SAFETY: `Job::task` is only dereferenced by workers inside an open job, whose caller keeps the closure
// alive (and, being `Sync`, shareable) until every worker left (`HotPool::run` waits for `inside == 0`
// after closing the epoch).
unsafe impl Send for Job {}

// SAFETY: `job` is the only field that is not itself `Sync`. The caller writes it only while no worker
// can read it: before publishing an odd epoch (a worker reads only after seeing that epoch, which the
// publishing `fetch_add` orders after the write), and after closing the epoch and seeing `inside == 0`
// (a worker that enters later sees a closed or newer epoch and does not read). Workers only read it.
unsafe impl Sync for Shared {}

/// Worker threads that spin for `spin` after each job before they park.
pub struct HotPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// One job at a time: `run` takes `&self`, so concurrent callers queue here.
    running: Mutex<()>,
}

impl std::fmt::Debug for HotPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HotPool[{} workers + the caller]", self.workers.len())
    }
}

impl HotPool {
    /// A pool of `threads` threads in all (the caller counts as one: `threads - 1` workers are started),
    /// whose workers spin for `spin` after a job before parking.
    pub fn new(threads: usize, spin: Duration) -> HotPool {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            inside: AtomicUsize::new(0),
            parked: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let workers = (1..threads.max(1))
            .filter_map(|i| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("poly-hot-{i}"))
                    .spawn(move || worker(&s, spin))
                    .ok()
            })
            .collect();
        HotPool {
            shared,
            workers,
            running: Mutex::new(()),
        }
    }

    /// Threads that run a job's tasks (the workers and the caller).
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `task(i)` for every `i` in `0..n`, each once, on the workers and this thread; returns when
    /// all have run. A panic in a task is propagated to the caller after the others ran.
    pub fn run(&self, n: usize, task: &(dyn Fn(usize) + Sync)) {
        self.run_beside(n, task, || ());
    }

    /// [`HotPool::run`], with this thread running `beside` first while the workers start on the tasks;
    /// it then claims what is left and returns `beside`'s result when all ran. For host work that must
    /// happen while the pool computes (a decode step's copies and launches beside the CPU's share of
    /// its experts). A panic in `beside` or a task is propagated after every task ran.
    pub fn run_beside<R>(
        &self,
        n: usize,
        task: &(dyn Fn(usize) + Sync),
        beside: impl FnOnce() -> R,
    ) -> R {
        if n == 0 {
            return beside();
        }
        let _one = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let s = &*self.shared;
        // Tasks claimed by a worker that panicked still count as done, so the caller is not left waiting;
        // the panic is reported here.
        let panicked = AtomicBool::new(false);
        let guarded = |i: usize| {
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| task(i))).is_err() {
                panicked.store(true, Ordering::Relaxed);
            }
        };
        let guarded: &(dyn Fn(usize) + Sync) = &guarded;
        // SAFETY: the lifetime is erased only for the workers' copy of the pointer, which they use only
        // while the epoch stays the odd value published below; this call closes the epoch and waits for
        // every worker inside to leave before `guarded` goes out of scope (also when `beside` panics:
        // its unwinding is caught and resumed after that).
        let ptr = unsafe {
            std::mem::transmute::<
                &(dyn Fn(usize) + Sync + '_),
                *const (dyn Fn(usize) + Sync + 'static),
            >(guarded)
        };
        // SAFETY: no worker reads `job` now: the last job's epoch is closed and every worker left it
        // (`Shared`'s `Sync`); this one's epoch is published below, after the write.
        unsafe { *s.job.get() = Some(Job { task: ptr, n }) };
        s.next.store(0, Ordering::SeqCst);
        s.done.store(0, Ordering::SeqCst);
        let open = s.epoch.fetch_add(1, Ordering::SeqCst) + 1;
        debug_assert!(!open.is_multiple_of(2));
        if s.parked.load(Ordering::SeqCst) > 0 {
            let _g = s.park.lock().unwrap_or_else(|p| p.into_inner());
            s.wake.notify_all();
        }
        let beside = std::panic::catch_unwind(std::panic::AssertUnwindSafe(beside));
        claim_tasks(s, guarded, n);
        while s.done.load(Ordering::Acquire) < n {
            std::hint::spin_loop();
        }
        // Closed: a worker that comes in now sees an even epoch and leaves without reading the job.
        s.epoch.fetch_add(1, Ordering::SeqCst);
        while s.inside.load(Ordering::SeqCst) > 0 {
            std::hint::spin_loop();
        }
        // SAFETY: the epoch is closed and no worker is inside it: none reads `job`.
        unsafe { *s.job.get() = None };
        let r = match beside {
            Ok(r) => r,
            Err(p) => std::panic::resume_unwind(p),
        };
        if panicked.load(Ordering::Relaxed) {
            panic!("a task of a HotPool job panicked");
        }
        r
    }
}

/// Claims and runs tasks of the open job until none is left.
fn claim_tasks(s: &Shared, task: &(dyn Fn(usize) + Sync), n: usize) {
    loop {
        let i = s.next.fetch_add(1, Ordering::AcqRel);
        if i >= n {
            return;
        }
        task(i);
        s.done.fetch_add(1, Ordering::AcqRel);
    }
}

fn worker(s: &Shared, spin: Duration) {
    let mut seen = 0u64;
    loop {
        let since = Instant::now();
        let mut spins = 0u32;
        let epoch = loop {
            let e = s.epoch.load(Ordering::SeqCst);
            if s.stop.load(Ordering::Relaxed) {
                return;
            }
            if e != seen && !e.is_multiple_of(2) {
                break e;
            }
            spins = spins.wrapping_add(1);
            // The clock is read every 64 spins: it costs more than a spin.
            if spins.is_multiple_of(64) && since.elapsed() > spin {
                park(s, seen);
                if s.stop.load(Ordering::Relaxed) {
                    return;
                }
                break s.epoch.load(Ordering::SeqCst);
            }
            std::hint::spin_loop();
        };
        seen = epoch;
        if epoch.is_multiple_of(2) {
            continue;
        }
        s.inside.fetch_add(1, Ordering::SeqCst);
        if s.epoch.load(Ordering::SeqCst) == epoch {
            // SAFETY: inside the odd epoch the job was published under, so the caller does not write
            // `job` until this worker leaves (`Shared`'s `Sync`).
            let job = unsafe { *s.job.get() };
            if let Some(job) = job {
                // SAFETY: the epoch is still the one the job was published under and this worker is
                // counted in `inside`, so the caller of `run` keeps the task alive until it leaves.
                let task = unsafe { &*job.task };
                claim_tasks(s, task, job.n);
            }
        }
        s.inside.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Waits on the condition variable until the epoch moves past `seen` or the pool stops.
fn park(s: &Shared, seen: u64) {
    let mut g = s.park.lock().unwrap_or_else(|p| p.into_inner());
    s.parked.fetch_add(1, Ordering::SeqCst);
    while s.epoch.load(Ordering::SeqCst) == seen && !s.stop.load(Ordering::SeqCst) {
        g = s.wake.wait(g).unwrap_or_else(|p| p.into_inner());
    }
    s.parked.fetch_sub(1, Ordering::SeqCst);
}

impl Drop for HotPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _g = self.shared.park.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_in_every_job() {
        let pool = HotPool::new(4, Duration::from_millis(2));
        for n in [1usize, 3, 4, 17, 1000] {
            for _ in 0..50 {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run(n, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n={n}");
            }
        }
    }

    #[test]
    fn beside_runs_on_the_caller_while_the_workers_take_the_tasks() {
        let pool = HotPool::new(3, Duration::from_millis(50));
        let caller = std::thread::current().id();
        for _ in 0..20 {
            let hits: Vec<AtomicUsize> = (0..64).map(|_| AtomicUsize::new(0)).collect();
            let started = AtomicUsize::new(0);
            let (r, seen) = pool.run_beside(
                64,
                &|i| {
                    started.fetch_add(1, Ordering::SeqCst);
                    hits[i].fetch_add(1, Ordering::Relaxed);
                },
                || {
                    // The workers start without the caller: wait (bounded) until one took a task.
                    let since = Instant::now();
                    while started.load(Ordering::SeqCst) == 0
                        && since.elapsed() < Duration::from_secs(5)
                    {
                        std::hint::spin_loop();
                    }
                    (std::thread::current().id(), started.load(Ordering::SeqCst))
                },
            );
            assert_eq!(r, caller);
            assert!(seen > 0, "no worker started while the caller ran beside");
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
        assert_eq!(pool.run_beside(0, &|_| unreachable!(), || 7), 7);
    }

    #[test]
    fn a_panic_beside_comes_back_after_every_task_ran() {
        let pool = HotPool::new(2, Duration::from_millis(5));
        let hits = AtomicUsize::new(0);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run_beside(
                100,
                &|_| {
                    hits.fetch_add(1, Ordering::SeqCst);
                },
                || panic!("beside"),
            )
        }));
        assert!(r.is_err());
        assert_eq!(hits.load(Ordering::SeqCst), 100);
        // The pool still works.
        let n = AtomicUsize::new(0);
        pool.run(10, &|_| {
            n.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(n.load(Ordering::SeqCst), 10);
    }

    #[test]
    fn parked_workers_come_back_and_jobs_still_complete() {
        let pool = HotPool::new(3, Duration::from_micros(50));
        let sum = AtomicUsize::new(0);
        for round in 0..5 {
            // Long enough for every worker to park.
            std::thread::sleep(Duration::from_millis(5));
            pool.run(64, &|i| {
                sum.fetch_add(i, Ordering::Relaxed);
            });
            assert_eq!(sum.load(Ordering::Relaxed), (round + 1) * (63 * 64 / 2));
        }
    }

    #[test]
    fn tasks_run_on_several_threads() {
        let pool = HotPool::new(4, Duration::from_millis(50));
        // Wait until the workers run: tasks that block until a second thread joins would hang if the
        // caller ran them all alone, so count distinct threads over many short jobs instead.
        let ids = Mutex::new(std::collections::HashSet::new());
        for _ in 0..200 {
            pool.run(64, &|_| {
                ids.lock().unwrap().insert(std::thread::current().id());
                std::thread::sleep(Duration::from_micros(20));
            });
        }
        assert!(ids.lock().unwrap().len() > 1, "only the caller ran tasks");
    }

    #[test]
    fn a_panicking_task_is_reported_and_the_pool_stays_usable() {
        let pool = HotPool::new(3, Duration::from_millis(1));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(8, &|i| assert!(i != 5, "task 5"))
        }));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        pool.run(8, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 8);
    }
}
