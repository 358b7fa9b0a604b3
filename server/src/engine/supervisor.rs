//! The supervisor: which model is in use, its engine child and its text side; up to `--parallel` requests
//! run at once (one by default; the engine takes them in turns, token by token), the rest wait in
//! arrival order (a bounded queue, beyond it `Busy`); the one switch path every way of changing the
//! model goes through.
//!
//! A request holds a [`Lease`]: one of the `--parallel` slots, taken in arrival order, and a shared hold
//! on the engine. A switch, an unload or a restart holds the engine alone, so it waits for every running
//! request, and requests that come after it wait for it.
//!
//! A switch finds the model and checks it, waits for the running requests (at most
//! [`Limits::switch_wait`]), stops the old engine before starting the new one (two models are never in
//! memory together), waits for READY, and on failure starts the earlier model again. An engine that died
//! is started again by the next request.

use super::memory;
use super::process::{Activity, EngineProcess, Launch, Monitor, StopTimeouts};
use crate::model_text::ModelText;
use crate::registry::{find_in, ModelEntry, Registry, Status};
use crate::telemetry::Telemetry;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, OwnedRwLockReadGuard, OwnedSemaphorePermit, RwLock, Semaphore};

/// Why a request or a switch cannot be served. The HTTP layer maps each kind to each API's error shape.
#[derive(Clone, Debug, PartialEq)]
pub enum ServeError {
    /// The queue is full; try again later.
    Busy(String),
    /// No such model.
    ModelNotFound(String),
    /// The model exists but cannot run (or no model is chosen).
    ModelUnavailable(String),
    /// A switch waited too long for the running request.
    SwitchTimeout(String),
    /// The request itself is wrong.
    BadRequest(String),
    /// The engine failed or died.
    Engine(String),
}

impl ServeError {
    pub fn message(&self) -> &str {
        match self {
            ServeError::Busy(m)
            | ServeError::ModelNotFound(m)
            | ServeError::ModelUnavailable(m)
            | ServeError::SwitchTimeout(m)
            | ServeError::BadRequest(m)
            | ServeError::Engine(m) => m,
        }
    }
}

/// The supervisor's limits.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Requests waiting for the engine beyond the running ones; more get `Busy`.
    pub queue: usize,
    /// Requests running at once (`--parallel`; the engine is started with it and takes them in turns).
    pub parallel: usize,
    /// How long a switch waits for the running request.
    pub switch_wait: Duration,
    /// How long an engine may take to load before READY.
    pub ready_timeout: Duration,
    /// How long an engine that owes an answer may send nothing before it is killed and replaced
    /// (`None`: never). A model's run config may set its own (`stall_timeout_s`).
    pub stall: Option<Duration>,
    pub stop: StopTimeouts,
    /// How long an engine may sit unused before it is unloaded (`--idle-unload`; `None`: never). An
    /// Ollama request's `keep_alive` overrides it until the next Ollama request.
    pub idle_unload: Option<Duration>,
}

/// The stall bound by default: long enough for one forward call of a long prompt on a slow CPU (the
/// engine reports progress between calls, not within one), short enough that a stopped engine is
/// replaced within minutes.
pub const DEFAULT_STALL: Duration = Duration::from_secs(300);

impl Default for Limits {
    fn default() -> Self {
        Limits {
            queue: 64,
            parallel: 1,
            switch_wait: Duration::from_secs(120),
            ready_timeout: Duration::from_secs(600),
            stall: Some(DEFAULT_STALL),
            stop: StopTimeouts::default(),
            idle_unload: None,
        }
    }
}

/// What happened to requests since the server started (`/health` shows them).
#[derive(Debug, Default, serde::Serialize)]
pub struct Counters {
    /// Ended by an end token, a stop string or the token limit.
    pub completed: AtomicU64,
    /// Cancelled because the client went away.
    pub cancelled: AtomicU64,
    /// Ended by an engine error or death.
    pub failed: AtomicU64,
    /// Refused because the queue was full.
    pub refused_busy: AtomicU64,
}

impl Counters {
    pub fn add(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// The model in use, its engine (absent when unloaded or not yet started) and its text side.
#[derive(Default)]
struct Slot {
    model: Option<ModelEntry>,
    engine: Option<EngineProcess>,
    text: Option<Arc<ModelText>>,
}

/// How long a shutdown waits for an engine it killed to be reaped.
const KILL_REAP_WAIT: Duration = Duration::from_secs(30);

/// The running engine, as the view holds it.
#[derive(Clone, Debug)]
struct EngineView {
    pid: i32,
    /// Set when the engine's stdout ends.
    dead: Arc<std::sync::atomic::AtomicBool>,
    /// `Some(description)` once the process has been reaped.
    exited: tokio::sync::watch::Receiver<Option<String>>,
    monitor: Monitor,
}

/// What can be read without waiting for the running request.
#[derive(Clone, Debug, Default)]
struct View {
    current: Option<String>,
    /// The current engine, as seen without taking the slot.
    engine: Option<EngineView>,
    ready: Option<poly_protocol::Ready>,
    text: Option<Arc<ModelText>>,
}

/// How the engine is doing, for `/health`.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineHealth {
    /// No engine runs (none loaded yet, unloaded, or it died and the next request starts it).
    NotRunning,
    /// It answers (idle, it answered a STATS; working, its last line is within the stall bound).
    Ok,
    /// It owes an answer and has been silent too long, or it left a STATS unanswered: the message.
    Stalled(String),
}

/// How long `/health` waits for an idle engine's STATS before calling it stalled.
const HEALTH_PROBE: Duration = Duration::from_secs(2);

/// What `/api/models/current` shows.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CurrentModel {
    pub model: Option<String>,
    pub loaded: bool,
    pub pid: Option<i32>,
    /// The engine process's resident memory (`VmRSS`), in bytes.
    pub rss_bytes: Option<u64>,
    pub ready: Option<serde_json::Value>,
    /// Seconds since the engine was started, while it is up.
    pub loaded_for_s: Option<u64>,
    /// Seconds since a request or a load last used it.
    pub idle_for_s: Option<u64>,
    /// Seconds until it is unloaded for idleness (`None`: it stays).
    pub unload_in_s: Option<u64>,
}

pub struct Supervisor {
    registry: Arc<Registry>,
    /// Shared by the running requests, held alone by a switch, an unload or a restart.
    slot: Arc<RwLock<Slot>>,
    /// The `--parallel` places for running requests, handed out in arrival order.
    places: Arc<Semaphore>,
    /// Requests holding the engine (leases alive).
    running: Arc<AtomicUsize>,
    waiting: Arc<AtomicUsize>,
    view: Mutex<View>,
    limits: Limits,
    next_id: AtomicU64,
    memory_debug_env: bool,
    counters: Arc<Counters>,
    telemetry: Arc<Telemetry>,
    idle: Arc<Mutex<Idle>>,
    /// Wakes the idle watcher when what it judges by changes: a request lets the engine go, a switch or
    /// an unload ends, a `keep_alive` is set.
    idle_changed: Arc<Notify>,
}

/// When the engine was last used and started, and the keep-alive in force.
#[derive(Clone, Copy, Debug)]
struct Idle {
    last_used: Instant,
    /// The engine's pid and when it was seen first (its start).
    started: Option<(i32, Instant)>,
    keep_alive: KeepAlive,
}

/// How long an unused engine stays loaded.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KeepAlive {
    /// `--idle-unload` (or forever without it).
    Default,
    For(Duration),
    Forever,
}

/// The right to use the engine: held for a whole request, released on drop (the next in line goes).
pub struct Lease {
    guard: OwnedRwLockReadGuard<Slot>,
    _place: OwnedSemaphorePermit,
    _running: QueueTicket,
    _queued: QueueTicket,
    counters: Arc<Counters>,
    telemetry: Arc<Telemetry>,
    /// Last: dropped after the guard and the tickets, so the idle watcher it wakes finds them gone.
    _idle: IdleTouch,
}

/// The idle clock restarted and the idle watcher woken when a request lets the engine go.
struct IdleTouch {
    idle: Arc<Mutex<Idle>>,
    changed: Arc<Notify>,
}

impl Drop for IdleTouch {
    fn drop(&mut self) {
        lock(&self.idle).last_used = Instant::now();
        self.changed.notify_one();
    }
}

/// Wakes the idle watcher when dropped; made before a write guard is taken, so it drops after it.
struct IdleWake(Arc<Notify>);

impl Drop for IdleWake {
    fn drop(&mut self) {
        self.0.notify_one();
    }
}

impl Lease {
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    pub fn telemetry(&self) -> &Telemetry {
        &self.telemetry
    }

    pub fn engine(&self) -> &EngineProcess {
        // A lease is only handed out with a running engine (`Supervisor::lease` checks it).
        self.guard
            .engine
            .as_ref()
            .expect("a lease always holds a started engine")
    }

    pub fn text(&self) -> Arc<ModelText> {
        self.guard
            .text
            .clone()
            .expect("a lease always holds the model's text side")
    }

    pub fn model(&self) -> &ModelEntry {
        self.guard
            .model
            .as_ref()
            .expect("a lease always holds a model")
    }
}

/// Counts a request from arrival to release.
struct QueueTicket(Arc<AtomicUsize>);

impl Drop for QueueTicket {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Supervisor {
    pub fn new(registry: Arc<Registry>, limits: Limits) -> Supervisor {
        Supervisor {
            registry,
            slot: Arc::default(),
            places: Arc::new(Semaphore::new(limits.parallel.max(1))),
            running: Arc::default(),
            waiting: Arc::default(),
            view: Mutex::default(),
            limits,
            next_id: AtomicU64::new(1),
            memory_debug_env: std::env::var("STRATA_MEMORY_DEBUG").is_ok_and(|v| v == "1"),
            counters: Arc::default(),
            telemetry: Arc::default(),
            idle: Arc::new(Mutex::new(Idle {
                last_used: Instant::now(),
                started: None,
                keep_alive: KeepAlive::Default,
            })),
            idle_changed: Arc::new(Notify::new()),
        }
    }

    /// Sets how long the engine stays loaded once unused (an Ollama request's `keep_alive`).
    pub fn set_keep_alive(&self, keep: KeepAlive) {
        lock(&self.idle).keep_alive = keep;
        self.idle_changed.notify_one();
    }

    /// The idle bound in force (`None`: the engine stays).
    fn idle_bound(&self) -> Option<Duration> {
        match lock(&self.idle).keep_alive {
            KeepAlive::Default => self.limits.idle_unload,
            KeepAlive::For(d) => Some(d),
            KeepAlive::Forever => None,
        }
    }

    /// How long the idle watcher may sleep before the engine is due to be unloaded: `Some(0)` now,
    /// `None` until something changes (no bound, no engine, or requests holding or waiting for it).
    fn idle_due_in(&self) -> Option<Duration> {
        let bound = self.idle_bound()?;
        let alive = view_engine_alive(&lock(&self.view));
        if !alive || self.slot_busy() || self.waiting.load(Ordering::SeqCst) > 0 {
            return None;
        }
        Some(bound.saturating_sub(lock(&self.idle).last_used.elapsed()))
    }

    /// Unloads the engine once it has been unused for the idle bound (`--idle-unload`, an Ollama
    /// `keep_alive`); runs until the server ends. It sleeps until the engine is due or until
    /// `idle_changed` says a request let it go, a switch or unload ended or the bound changed.
    pub async fn watch_idle(self: Arc<Self>) {
        loop {
            match self.idle_due_in() {
                None => self.idle_changed.notified().await,
                Some(due) if !due.is_zero() => {
                    tokio::select! {
                        _ = self.idle_changed.notified() => {}
                        _ = tokio::time::sleep(due) => {}
                    }
                }
                Some(_) => {
                    let bound = self.idle_bound().unwrap_or_default();
                    eprintln!(
                        "polystrata: unused for {} s (idle bound {} s): unloading",
                        lock(&self.idle).last_used.elapsed().as_secs(),
                        bound.as_secs()
                    );
                    if let Err(e) = self.unload().await {
                        eprintln!("polystrata: idle unload failed: {}", e.message());
                    }
                }
            }
        }
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// The installation home the registry reads.
    pub fn home(&self) -> &std::path::Path {
        self.registry.home()
    }

    /// Token and time totals of every generation so far (`/metrics`).
    pub fn telemetry(&self) -> &Telemetry {
        &self.telemetry
    }

    /// Requests holding or waiting for the engine: (running, waiting behind them).
    pub fn queue(&self) -> (usize, usize) {
        let all = self.waiting.load(Ordering::SeqCst);
        let running = self.running.load(Ordering::SeqCst).min(all);
        (running, all - running)
    }

    /// Requests that may run at once (`--parallel`).
    pub fn parallel(&self) -> usize {
        self.limits.parallel.max(1)
    }

    /// The engine's STATS when it is idle and answers within `timeout` (a working engine answers only
    /// between forward calls, so it is not asked: that would delay nothing but the answer here).
    pub async fn idle_engine_stats(&self, timeout: Duration) -> Option<poly_protocol::Stats> {
        let engine = lock(&self.view).engine.clone()?;
        match engine.monitor.activity() {
            Activity::Idle if !self.slot_busy() => engine.monitor.stats(timeout).await,
            _ => None,
        }
    }

    /// The engine's READY, while it is up.
    pub fn ready(&self) -> Option<poly_protocol::Ready> {
        let view = lock(&self.view);
        view.ready.clone().filter(|_| view_engine_alive(&view))
    }

    /// A fresh request id for the engine.
    pub fn next_request_id(&self) -> String {
        format!("r{}", self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// The registry's scan, on a blocking thread: it reads the home and model files, and a slow or
    /// hung path (a network mount) must hold up only this scan, never the runtime's threads.
    async fn scan(&self) -> Vec<ModelEntry> {
        let registry = self.registry.clone();
        match tokio::task::spawn_blocking(move || registry.scan()).await {
            Ok(entries) => entries,
            Err(e) => {
                eprintln!("polystrata: the registry scan failed: {e}");
                Vec::new()
            }
        }
    }

    /// Every model, the one in use marked `loaded` (engine up) or `unloaded`.
    pub async fn models(&self) -> Vec<ModelEntry> {
        let mut entries = self.scan().await;
        let view = lock(&self.view).clone();
        for e in &mut entries {
            if view.current.as_deref() == Some(e.id.as_str()) {
                e.status = if view_engine_alive(&view) {
                    Status::Loaded
                } else {
                    Status::Unloaded
                };
            }
        }
        entries
    }

    /// Whether the engine answers: an idle one is asked for its STATS (at most [`HEALTH_PROBE`]); a
    /// working one is judged by its last line against the stall bound (a request in flight is not
    /// disturbed). A stalled engine is killed by its watchdog at the bound; this only reports it.
    pub async fn engine_health(&self) -> EngineHealth {
        let Some(engine) = lock(&self.view).engine.clone() else {
            return EngineHealth::NotRunning;
        };
        let stalled_for = |quiet: Duration| {
            EngineHealth::Stalled(format!(
                "the engine (pid {}) owes an answer and has sent nothing for {} s",
                engine.pid,
                quiet.as_secs()
            ))
        };
        match engine.monitor.activity() {
            Activity::Ended => EngineHealth::NotRunning,
            Activity::Working { quiet } => match engine.monitor.stall() {
                Some(bound) if quiet >= bound => stalled_for(quiet),
                // A STATS left unanswered by an earlier probe also counts as owed: it is the probe's
                // answer that tells, not the clock.
                _ if quiet >= HEALTH_PROBE && !self.slot_busy() => stalled_for(quiet),
                _ => EngineHealth::Ok,
            },
            Activity::Idle => match engine.monitor.stats(HEALTH_PROBE).await {
                Some(_) => EngineHealth::Ok,
                // A request may have started meanwhile: its engine answers STATS only between
                // forward calls.
                None if self.slot_busy() => EngineHealth::Ok,
                None => EngineHealth::Stalled(format!(
                    "the engine (pid {}) answered no STATS within {} s",
                    engine.pid,
                    HEALTH_PROBE.as_secs()
                )),
            },
        }
    }

    /// Whether a request (or a switch) holds the engine now.
    fn slot_busy(&self) -> bool {
        self.slot.try_write().is_err()
    }

    /// The model in use.
    pub fn current(&self) -> CurrentModel {
        let view = lock(&self.view).clone();
        let loaded = view_engine_alive(&view);
        let pid = view.engine.as_ref().filter(|_| loaded).map(|e| e.pid);
        let idle = *lock(&self.idle);
        let bound = self.idle_bound();
        let unused = idle.last_used.elapsed();
        CurrentModel {
            model: view.current.clone(),
            loaded,
            pid,
            rss_bytes: pid.and_then(memory::rss_of),
            ready: view
                .ready
                .as_ref()
                .filter(|_| loaded)
                .and_then(|r| serde_json::to_value(r).ok()),
            loaded_for_s: idle
                .started
                .filter(|(p, _)| Some(*p) == pid)
                .map(|(_, t)| t.elapsed().as_secs()),
            idle_for_s: pid.map(|_| unused.as_secs()),
            unload_in_s: pid.and(bound).map(|b| b.saturating_sub(unused).as_secs()),
        }
    }

    /// The text side of the model in use (also while its engine is down), for work that needs no engine
    /// (counting tokens). `None` before any model was loaded.
    pub fn current_text(&self) -> Option<(String, Arc<ModelText>)> {
        let view = lock(&self.view);
        Some((view.current.clone()?, view.text.clone()?))
    }

    /// The text side and context of the model in use when a request naming `model` will be served by it
    /// without a switch (no name, or its exact id) and its engine has announced READY: the request's
    /// prompt can then be prepared before it takes the lease. `None` when that cannot be told cheaply
    /// (an alias, another model, nothing loaded): the prompt is prepared under the lease.
    pub fn text_for(&self, model: Option<&str>) -> Option<(Arc<ModelText>, u32)> {
        let view = lock(&self.view);
        let current = view.current.as_deref()?;
        if model.is_some_and(|m| !m.is_empty() && m != current) {
            return None;
        }
        Some((view.text.clone()?, view.ready.as_ref()?.n_ctx))
    }

    /// The id of the model in use, if any (for requests that name none).
    pub fn current_id(&self) -> Option<String> {
        lock(&self.view).current.clone()
    }

    fn enter_queue(&self) -> Result<QueueTicket, ServeError> {
        let before = self.waiting.fetch_add(1, Ordering::SeqCst);
        let ticket = QueueTicket(self.waiting.clone());
        // `parallel` requests run and `queue` wait: `before` counts the running ones too.
        let parallel = self.parallel();
        if before >= self.limits.queue + parallel {
            Counters::add(&self.counters.refused_busy);
            let behind = if parallel == 1 {
                "the running one".to_string()
            } else {
                format!("the {parallel} running")
            };
            return Err(ServeError::Busy(format!(
                "{} requests are waiting behind {behind} (the queue holds {}); try again shortly",
                before - parallel,
                self.limits.queue
            )));
        }
        Ok(ticket)
    }

    /// Waits for the engine (in arrival order) and returns it ready for one request, for `model` when
    /// given (switching to it if another is in use), else for the model in use (or the only installed
    /// one). An engine that died is started again here.
    pub async fn lease(&self, model: Option<&str>) -> Result<Lease, ServeError> {
        // Dropped last: a request that fails before it holds the engine (its ticket and any guard
        // gone) wakes the idle watcher too.
        let _wake = IdleWake(self.idle_changed.clone());
        let ticket = self.enter_queue()?;
        let wanted = match model.filter(|m| !m.is_empty()) {
            Some(name) => Some(self.resolve(name).await?),
            None => None,
        };
        // A place among the running requests, in arrival order (the semaphore is fair and never closed).
        let place = self
            .places
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ServeError::Engine("the server is shutting down".into()))?;
        // The model in use with its engine up is shared; anything else is changed holding it alone.
        let shared = self.slot.clone().read_owned().await;
        let target = match (&wanted, &shared.model) {
            (Some(entry), _) => entry.clone(),
            (None, Some(m)) => m.clone(),
            (None, None) => self.default_model().await?,
        };
        let ready = |slot: &Slot| {
            slot.model.as_ref().is_some_and(|m| m.id == target.id)
                && slot.engine.as_ref().is_some_and(|e| !e.is_dead())
        };
        let guard = if ready(&shared) {
            shared
        } else {
            drop(shared);
            let mut alone = self.slot.clone().write_owned().await;
            // Another request may have switched or restarted meanwhile.
            if !ready(&alone) {
                if alone.model.as_ref().is_some_and(|m| m.id == target.id) {
                    self.restart_locked(&mut alone).await?;
                } else {
                    self.switch_locked(&mut alone, target).await?;
                }
            }
            alone.downgrade()
        };
        self.running.fetch_add(1, Ordering::SeqCst);
        Ok(Lease {
            guard,
            _place: place,
            _running: QueueTicket(self.running.clone()),
            _queued: ticket,
            counters: self.counters.clone(),
            telemetry: self.telemetry.clone(),
            _idle: IdleTouch {
                idle: self.idle.clone(),
                changed: self.idle_changed.clone(),
            },
        })
    }

    /// The one switch path: HTTP, the terminal chat and the web page all come here.
    pub async fn switch(&self, name: &str) -> Result<CurrentModel, ServeError> {
        let target = self.resolve(name).await?;
        // Dropped after the guard: the idle watcher then judges the new engine (its clock restarted).
        let _wake = IdleWake(self.idle_changed.clone());
        let mut guard =
            tokio::time::timeout(self.limits.switch_wait, self.slot.clone().write_owned())
                .await
                .map_err(|_| {
                    ServeError::SwitchTimeout(format!(
                        "a request has been running for over {} s; the switch to {} was refused",
                        self.limits.switch_wait.as_secs(),
                        target.id
                    ))
                })?;
        let same = guard.model.as_ref().is_some_and(|m| m.id == target.id);
        let alive = guard.engine.as_ref().is_some_and(|e| !e.is_dead());
        if same && alive {
            return Ok(self.current());
        }
        if same {
            self.restart_locked(&mut guard).await?;
        } else {
            self.switch_locked(&mut guard, target).await?;
        }
        Ok(self.current())
    }

    /// Stops the engine of the model in use (the model stays chosen; the next request starts it again).
    pub async fn unload(&self) -> Result<CurrentModel, ServeError> {
        let _wake = IdleWake(self.idle_changed.clone());
        let mut guard =
            tokio::time::timeout(self.limits.switch_wait, self.slot.clone().write_owned())
                .await
                .map_err(|_| {
                    ServeError::SwitchTimeout(format!(
                        "a request has been running for over {} s; unload refused",
                        self.limits.switch_wait.as_secs()
                    ))
                })?;
        if let Some(mut engine) = guard.engine.take() {
            let how = engine.stop(self.limits.stop).await;
            eprintln!("polystrata: unloaded {} ({how})", engine_label(&guard));
        }
        self.publish(&guard);
        memory::give_back_freed();
        Ok(self.current())
    }

    /// Stops the engine for good (server shutdown).
    /// A request still running after `grace` is not waited for: the engine's process group is killed
    /// and the request ends with the engine's death.
    pub async fn shutdown(&self, grace: Duration) {
        match tokio::time::timeout(grace, self.slot.clone().write_owned()).await {
            Ok(mut guard) => {
                if let Some(mut engine) = guard.engine.take() {
                    engine.stop(self.limits.stop).await;
                }
                self.publish(&guard);
            }
            Err(_) => {
                let engine = lock(&self.view).engine.clone();
                if let Some(EngineView {
                    pid, mut exited, ..
                }) = engine
                {
                    eprintln!("polystrata: a request is still running; killing engine {pid}");
                    let _ = nix::sys::signal::killpg(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                    // SIGKILL is delivered asynchronously: the server waits until the engine has been
                    // reaped, so that no engine (and none of its VRAM) outlives the server's exit.
                    let reaped =
                        tokio::time::timeout(KILL_REAP_WAIT, exited.wait_for(Option::is_some))
                            .await;
                    if !matches!(reaped, Ok(Ok(_))) {
                        eprintln!("polystrata: engine {pid} did not end after SIGKILL");
                    }
                }
            }
        }
    }

    async fn resolve(&self, name: &str) -> Result<ModelEntry, ServeError> {
        let entries = self.scan().await;
        let entry = find_in(&entries, name)
            .map_err(ServeError::ModelNotFound)?
            .clone();
        match &entry.problem {
            Some(p) => Err(ServeError::ModelUnavailable(format!(
                "model {} is unavailable: {p}",
                entry.id
            ))),
            None => Ok(entry),
        }
    }

    async fn default_model(&self) -> Result<ModelEntry, ServeError> {
        let entries = self.scan().await;
        let runnable: Vec<&ModelEntry> = entries.iter().filter(|e| e.is_runnable()).collect();
        match runnable.as_slice() {
            [one] => Ok((*one).clone()),
            [] => Err(ServeError::ModelUnavailable(format!(
                "no model can run (home {}){}",
                self.registry.home().display(),
                entries
                    .iter()
                    .filter_map(|e| e.problem.as_ref().map(|p| format!("; {}: {p}", e.id)))
                    .collect::<String>()
            ))),
            many => Err(ServeError::ModelUnavailable(format!(
                "no model is loaded; name one in the request or POST /api/models/load (installed: {})",
                many.iter().map(|e| e.id.as_str()).collect::<Vec<_>>().join(", ")
            ))),
        }
    }

    fn memory_debug(&self, entry: Option<&ModelEntry>) -> bool {
        self.memory_debug_env
            || entry
                .and_then(|e| e.config.as_ref())
                .is_some_and(|c| c.memory_debug)
    }

    async fn switch_locked(&self, slot: &mut Slot, target: ModelEntry) -> Result<(), ServeError> {
        let debug = self.memory_debug(Some(&target)) || self.memory_debug(slot.model.as_ref());
        if debug {
            eprintln!("polystrata: {}", memory::report("before the switch"));
        }
        // Checked before anything stops: a model whose tokenizer or template cannot be read is refused
        // while the old one still runs.
        let text = load_text(&target)
            .await
            .map_err(|e| ServeError::ModelUnavailable(format!("model {}: {e}", target.id)))?;
        let previous = slot.model.clone();
        if let Some(mut engine) = slot.engine.take() {
            let how = engine.stop(self.limits.stop).await;
            eprintln!("polystrata: stopped {} ({how})", engine_label(slot));
        }
        slot.text = None;
        self.publish(slot);
        if debug {
            eprintln!(
                "polystrata: {}",
                memory::report("after the old engine ended")
            );
        }
        match self.start(&target).await {
            Ok(engine) => {
                slot.engine = Some(engine);
                slot.model = Some(target);
                slot.text = Some(Arc::new(text));
                self.publish(slot);
                // The old model's text side is gone from the slot and the view: give its pages back.
                memory::give_back_freed();
                if debug {
                    eprintln!("polystrata: {}", memory::report("with the new engine"));
                }
                Ok(())
            }
            Err(e) => {
                let back = match previous {
                    Some(prev) => {
                        let restarted = match (load_text(&prev).await, self.start(&prev).await) {
                            (Ok(text), Ok(engine)) => {
                                slot.engine = Some(engine);
                                slot.text = Some(Arc::new(text));
                                format!("{} is loaded again", prev.id)
                            }
                            (Err(e2), _) | (_, Err(e2)) => {
                                format!("{} could not be started again either ({e2}); no model is loaded", prev.id)
                            }
                        };
                        slot.model = Some(prev);
                        restarted
                    }
                    None => "no model is loaded".to_string(),
                };
                self.publish(slot);
                Err(ServeError::Engine(format!(
                    "switch to {} failed: {e}; {back}",
                    target.id
                )))
            }
        }
    }

    async fn restart_locked(&self, slot: &mut Slot) -> Result<(), ServeError> {
        let Some(model) = slot.model.clone() else {
            return Err(ServeError::ModelUnavailable("no model is loaded".into()));
        };
        if let Some(mut dead) = slot.engine.take() {
            let how = dead.stop(self.limits.stop).await;
            eprintln!(
                "polystrata: engine of {} ended ({how}); starting it again",
                model.id
            );
        }
        if slot.text.is_none() {
            let text = load_text(&model)
                .await
                .map_err(|e| ServeError::ModelUnavailable(format!("model {}: {e}", model.id)))?;
            slot.text = Some(Arc::new(text));
        }
        let engine = self.start(&model).await.map_err(|e| {
            ServeError::Engine(format!(
                "the engine of {} could not be started: {e}",
                model.id
            ))
        })?;
        slot.engine = Some(engine);
        self.publish(slot);
        Ok(())
    }

    async fn start(&self, entry: &ModelEntry) -> Result<EngineProcess, String> {
        let config = entry
            .config
            .as_ref()
            .ok_or_else(|| format!("model {} has no run config", entry.id))?;
        let mut args = config.args.clone();
        // A context over the model's training context (999999 was accepted at setup) is clamped to
        // it, so the engine and the registry say the same (the registry's `context_note` says why); a
        // GGUF that gives none (0) is left to the engine to refuse.
        if let (Some(note), Some(trained)) = (&entry.context_note, entry.context) {
            if let Some(at) = args.iter().position(|a| a == "--max-context") {
                if let Some(v) = args.get_mut(at + 1) {
                    *v = trained.to_string();
                }
            }
            eprintln!("polystrata: {}: {note}", entry.id);
        }
        // The engine takes as many requests at once as the supervisor sends (`--parallel`), whatever a
        // run config says: more would wait in the engine's short queue, fewer would waste places here.
        let parallel = self.parallel();
        let asked = args.iter().position(|a| a == "--parallel");
        match asked {
            Some(at) => {
                if let Some(v) = args.get_mut(at + 1) {
                    if *v != parallel.to_string() {
                        eprintln!(
                            "polystrata: {}: the run config's --parallel {v} is replaced by the server's {parallel}",
                            entry.id
                        );
                        *v = parallel.to_string();
                    }
                }
            }
            None if parallel > 1 => args.extend(["--parallel".to_string(), parallel.to_string()]),
            None => {}
        }
        // The run config's projector reads the pictures of chat requests (an explicit --mmproj in the
        // args wins).
        if let Some(m) = &config.mmproj {
            if !args.iter().any(|a| a == "--mmproj") {
                args.extend(["--mmproj".to_string(), m.display().to_string()]);
            }
        }
        let launch = Launch {
            exe: config.exe.clone(),
            args,
            cwd: config.cwd.clone(),
            label: entry.id.clone(),
        };
        eprintln!(
            "polystrata: starting {} ({})",
            entry.id,
            config.exe.display()
        );
        // A run config's own bound wins (0 turns the watchdog off for that model).
        let stall = match config.stall_timeout_s {
            Some(0) => None,
            Some(s) => Some(Duration::from_secs(s)),
            None => self.limits.stall,
        };
        let engine = EngineProcess::start(&launch, self.limits.ready_timeout, stall).await?;
        eprintln!(
            "polystrata: {} ready (pid {}, {}, n_ctx {})",
            entry.id,
            engine.pid(),
            engine.ready().device,
            engine.ready().n_ctx
        );
        Ok(engine)
    }

    fn publish(&self, slot: &Slot) {
        {
            // A new engine starts the loaded and idle clocks (a load counts as a use).
            let mut idle = lock(&self.idle);
            let pid = slot.engine.as_ref().map(|e| e.pid());
            if pid.is_some() && idle.started.map(|(p, _)| p) != pid {
                idle.started = pid.map(|p| (p, Instant::now()));
                idle.last_used = Instant::now();
            }
        }
        let mut view = lock(&self.view);
        view.current = slot.model.as_ref().map(|m| m.id.clone());
        view.engine = slot.engine.as_ref().map(|e| EngineView {
            pid: e.pid(),
            dead: e.dead_flag(),
            exited: e.exit_watch(),
            monitor: e.monitor(),
        });
        view.ready = slot.engine.as_ref().map(|e| e.ready().clone());
        view.text = slot.text.clone();
    }
}

/// A model's tokenizer and template, read on a blocking thread (files, and the template's probe).
async fn load_text(entry: &ModelEntry) -> Result<ModelText, String> {
    let entry = entry.clone();
    tokio::task::spawn_blocking(move || ModelText::load(&entry))
        .await
        .map_err(|e| format!("loading the text side failed: {e}"))?
}

fn view_engine_alive(view: &View) -> bool {
    view.engine
        .as_ref()
        .is_some_and(|e| !e.dead.load(Ordering::SeqCst))
}

fn engine_label(slot: &Slot) -> String {
    slot.model
        .as_ref()
        .map(|m| m.id.clone())
        .unwrap_or_else(|| "engine".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_says_how_many_wait() {
        let registry = Arc::new(Registry::new(
            std::env::temp_dir().join("polystrata-no-home"),
        ));
        let limits = Limits {
            queue: 2,
            ..Limits::default()
        };
        let supervisor = Supervisor::new(registry, limits);
        // One runs, two wait; the fourth is refused.
        let held: Vec<QueueTicket> = (0..3)
            .map(|_| supervisor.enter_queue().expect("room"))
            .collect();
        let refused = supervisor.enter_queue().err().expect("full");
        assert_eq!(
            refused.message(),
            "2 requests are waiting behind the running one (the queue holds 2); try again shortly"
        );
        drop(held);
        assert!(supervisor.enter_queue().is_ok());
    }
}
