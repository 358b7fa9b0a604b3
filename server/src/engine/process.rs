//! One `poly-engine` child: started in its own process group, spoken to over the protocol crate, stopped
//! with QUIT, then SIGTERM, then SIGKILL.
//!
//! Three threads serve a child: a writer (protocol lines to stdin, so a full pipe never blocks a caller),
//! a reader (stdout lines, routed to the request they belong to by id) and a log forwarder (stderr, kept as
//! a short tail for error messages). When stdout ends the engine is dead: every request in flight gets an
//! error naming how the process ended, and the process is marked dead, so the next request starts a new
//! one.
//!
//! A fourth, the watchdog, catches an engine that is alive but stuck (stopped with SIGSTOP, hung in a
//! kernel call or a deadlock): while the engine owes an answer (a request or a STATS in flight) and sends
//! no line at all for the stall bound, it kills the process group. Its death then takes the usual path,
//! with a message that names the stall. An engine reading a long prompt is not stuck: it sends a
//! `PROGRESS` line after each forward call.

use poly_protocol::{read_line_bounded, FromEngine, LineRead, Ready, ToEngine, MAX_LINE_BYTES};
use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, watch};

/// What a request receives from its engine.
#[derive(Debug)]
pub enum EngineEvent {
    Tokens(poly_protocol::Tokens),
    Done(poly_protocol::Done),
    /// The engine refused the request (`ERR` with its id).
    Refused(poly_protocol::ErrorReply),
    /// The engine died while the request was in flight.
    Died(String),
}

/// How to start an engine.
#[derive(Clone, Debug)]
pub struct Launch {
    pub exe: PathBuf,
    pub args: Vec<String>,
    pub cwd: PathBuf,
    /// A name for logs (the model id).
    pub label: String,
}

/// How long stopping waits after QUIT and after SIGTERM before the next, harder step.
#[derive(Clone, Copy, Debug)]
pub struct StopTimeouts {
    pub after_quit: Duration,
    pub after_term: Duration,
}

impl Default for StopTimeouts {
    fn default() -> Self {
        StopTimeouts {
            after_quit: Duration::from_secs(10),
            after_term: Duration::from_secs(5),
        }
    }
}

/// What the reader, the request side and the watchdog share about one engine.
struct Shared {
    table: Mutex<Table>,
    /// Notified when the engine comes to owe an answer, when its stdout ends and when it is reaped: the
    /// watchdog and the reader wait on it instead of polling.
    changed: Condvar,
}

struct Table {
    /// The requests in flight, by id.
    routes: HashMap<String, mpsc::UnboundedSender<EngineEvent>>,
    /// STATS answers owed, in order.
    stats_waiters: VecDeque<oneshot::Sender<poly_protocol::Stats>>,
    /// When the engine last wrote a line (or, if it owed nothing then, when it came to owe an answer).
    last_line: Instant,
    /// The engine's stdout ended.
    ended: bool,
    /// How the process ended, once reaped.
    exit: Option<String>,
    /// Why the watchdog killed the engine, if it did.
    stalled: Option<String>,
}

impl Table {
    fn owes_answer(&self) -> bool {
        !self.routes.is_empty() || !self.stats_waiters.is_empty()
    }

    /// Called before a request or a STATS is added: an engine that owed nothing starts its clock now
    /// (its last line may be minutes old).
    fn start_owing(&mut self) {
        if !self.owes_answer() {
            self.last_line = Instant::now();
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Table> {
        lock(&self.table)
    }
}

/// How a running engine is doing, as `/health` reports it.
#[derive(Clone, Debug, PartialEq)]
pub enum Activity {
    /// Nothing in flight.
    Idle,
    /// Answers are owed; the engine's last line was this long ago.
    Working { quiet: Duration },
    /// Its stdout ended.
    Ended,
}

/// A handle on a running engine that the supervisor's view keeps (no lease needed): its activity, and a
/// STATS probe.
#[derive(Clone)]
pub struct Monitor {
    shared: Arc<Shared>,
    writer: std::sync::mpsc::Sender<String>,
    stall: Option<Duration>,
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitor")
            .field("stall", &self.stall)
            .finish()
    }
}

impl Monitor {
    pub fn activity(&self) -> Activity {
        let t = self.shared.lock();
        if t.ended {
            Activity::Ended
        } else if t.owes_answer() {
            Activity::Working {
                quiet: t.last_line.elapsed(),
            }
        } else {
            Activity::Idle
        }
    }

    /// The stall bound the watchdog applies (`None`: off).
    pub fn stall(&self) -> Option<Duration> {
        self.stall
    }

    /// Asks the engine for its STATS (at most `timeout`). An unanswered STATS stays owed: the watchdog
    /// kills an engine that never answers it.
    pub async fn stats(&self, timeout: Duration) -> Option<poly_protocol::Stats> {
        let (tx, rx) = oneshot::channel();
        {
            let mut t = self.shared.lock();
            if t.ended {
                return None;
            }
            t.start_owing();
            t.stats_waiters.push_back(tx);
        }
        self.shared.changed.notify_all();
        self.writer.send(ToEngine::Stats.to_line()).ok()?;
        tokio::time::timeout(timeout, rx).await.ok()?.ok()
    }
}

/// A running engine child.
pub struct EngineProcess {
    pid: i32,
    label: String,
    ready: Ready,
    writer: std::sync::mpsc::Sender<String>,
    shared: Arc<Shared>,
    stall: Option<Duration>,
    dead: Arc<AtomicBool>,
    /// `Some(description)` once the process has exited.
    exited: watch::Receiver<Option<String>>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
}

const STDERR_TAIL_LINES: usize = 20;

/// The variables an engine child inherits from the server; its environment is cleared of all others.
/// What the engine computes is set by its flags (echoed in READY), so these are only what a process
/// needs to run (PATH, HOME, locale, the CUDA libraries and devices, the kernel cache's location) and
/// the diagnostic switches of README.md's table of environment variables.
pub const ENGINE_ENV_ALLOW: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LANG",
    "LC_ALL",
    "TMPDIR",
    "XDG_CACHE_HOME",
    "LD_LIBRARY_PATH",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "CUDA_PATH",
    "CUDA_HOME",
    "RUST_LOG",
    "RUST_BACKTRACE",
    "POLY_GPU_PROFILE",
    "POLY_CPU_PROFILE",
    "POLY_CUDA_SYNC",
    "POLY_KERNEL_CACHE",
    "POLY_BREAK_BATCHES",
];

/// Of `vars` (the server's environment), those an engine child gets: the ones named in
/// [`ENGINE_ENV_ALLOW`].
pub fn engine_env(
    vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> Vec<(std::ffi::OsString, std::ffi::OsString)> {
    vars.into_iter()
        .filter(|(k, _)| ENGINE_ENV_ALLOW.iter().any(|a| k == a))
        .collect()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl EngineProcess {
    /// Starts the engine and waits for its READY (at most `ready_timeout`). A child that exits, sends an
    /// ERR or says nothing in time is stopped and the reason returned, with the tail of its log. Once
    /// ready, an engine that owes an answer and writes nothing for `stall` is killed (`None`: never).
    pub async fn start(
        launch: &Launch,
        ready_timeout: Duration,
        stall: Option<Duration>,
    ) -> Result<EngineProcess, String> {
        let mut child = Command::new(&launch.exe)
            .args(&launch.args)
            .current_dir(&launch.cwd)
            // Only the allow-list: a variable left in the server's environment must not change how
            // the engine computes behind its flags (those are in its READY line).
            .env_clear()
            .envs(engine_env(std::env::vars_os()))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group: a signal to the group reaches any helper the engine starts, and a
            // Ctrl-C at the server's terminal does not kill the engine behind the server's back.
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot start engine {}: {e}", launch.exe.display()))?;
        let pid = child.id() as i32;
        let (stdin, stdout, stderr) =
            match (child.stdin.take(), child.stdout.take(), child.stderr.take()) {
                (Some(i), Some(o), Some(e)) => (i, o, e),
                _ => return Err("engine pipes missing".into()),
            };

        let stderr_tail: Arc<Mutex<VecDeque<String>>> = Arc::default();
        // Set when the log ends, so that an engine's last words are in the tail before it is quoted.
        let (log_done_tx, mut log_done) = watch::channel(false);
        {
            let tail = stderr_tail.clone();
            let label = launch.label.clone();
            std::thread::spawn(move || {
                forward_stderr(stderr, &label, &tail);
                let _ = log_done_tx.send(true);
            });
        }

        let shared = Arc::new(Shared {
            table: Mutex::new(Table {
                routes: HashMap::new(),
                stats_waiters: VecDeque::new(),
                last_line: Instant::now(),
                ended: false,
                exit: None,
                stalled: None,
            }),
            changed: Condvar::new(),
        });
        let (exit_tx, exited) = watch::channel(None);
        {
            let shared = shared.clone();
            std::thread::spawn(move || {
                let description = match child.wait() {
                    Ok(status) => status.to_string(),
                    Err(e) => format!("wait failed: {e}"),
                };
                shared.lock().exit = Some(description.clone());
                shared.changed.notify_all();
                let _ = exit_tx.send(Some(description));
            });
        }

        let (writer, lines) = std::sync::mpsc::channel::<String>();
        std::thread::spawn(move || write_lines(stdin, lines));

        let dead = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = oneshot::channel::<Result<Ready, String>>();
        {
            let reader = Reader {
                shared: shared.clone(),
                dead: dead.clone(),
                label: launch.label.clone(),
            };
            std::thread::spawn(move || reader.run(stdout, ready_tx));
        }

        let mut process = EngineProcess {
            pid,
            label: launch.label.clone(),
            ready: Ready {
                protocol: 0,
                model: String::new(),
                arch: String::new(),
                n_vocab: 0,
                n_ctx: 0,
                bos: None,
                eos: Vec::new(),
                device: String::new(),
                experts_total: 0,
                experts_vram: 0,
                prompt_calls: None,
                guesses: None,
                knobs: Default::default(),
                vision: None,
            },
            writer,
            shared: shared.clone(),
            stall,
            dead,
            exited,
            stderr_tail,
        };
        let outcome = match tokio::time::timeout(ready_timeout, ready_rx).await {
            Ok(Ok(Ok(ready))) if ready.protocol == poly_protocol::PROTOCOL_VERSION => Ok(ready),
            Ok(Ok(Ok(ready))) => Err(format!(
                "engine speaks protocol {}, this server {}",
                ready.protocol,
                poly_protocol::PROTOCOL_VERSION
            )),
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(_)) => Err("engine reader ended before READY".into()),
            Err(_) => Err(format!("no READY within {} s", ready_timeout.as_secs())),
        };
        match outcome {
            Ok(ready) => {
                process.ready = ready;
                // Loading is bounded by `ready_timeout`; the watchdog guards what comes after.
                if let Some(stall) = stall {
                    let label = launch.label.clone();
                    std::thread::spawn(move || watchdog(&shared, stall, pid, &label));
                }
                Ok(process)
            }
            Err(e) => {
                process.stop(StopTimeouts::default()).await;
                let _ =
                    tokio::time::timeout(Duration::from_secs(2), log_done.wait_for(|done| *done))
                        .await;
                let tail = process.stderr_tail();
                Err(if tail.is_empty() {
                    e
                } else {
                    format!("{e}; engine log: {tail}")
                })
            }
        }
    }

    pub fn ready(&self) -> &Ready {
        &self.ready
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// A handle for the supervisor's view: activity and STATS without the lease.
    pub fn monitor(&self) -> Monitor {
        Monitor {
            shared: self.shared.clone(),
            writer: self.writer.clone(),
            stall: self.stall,
        }
    }

    /// The flag the reader sets when the engine's stdout ends.
    pub fn dead_flag(&self) -> Arc<AtomicBool> {
        self.dead.clone()
    }

    /// A receiver that turns `Some(description)` once the process has been reaped.
    pub fn exit_watch(&self) -> watch::Receiver<Option<String>> {
        self.exited.clone()
    }

    /// Whether the engine has died (its stdout ended).
    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// The last lines of the engine's log, joined, for error messages.
    pub fn stderr_tail(&self) -> String {
        lock(&self.stderr_tail)
            .iter()
            .cloned()
            .collect::<Vec<_>>()
            .join(" | ")
    }

    /// Sends a request and returns the channel its tokens, DONE or error arrive on.
    pub fn generate(
        &self,
        gen: poly_protocol::Gen,
    ) -> Result<mpsc::UnboundedReceiver<EngineEvent>, String> {
        let (tx, rx) = mpsc::unbounded_channel();
        let id = gen.id.clone();
        {
            let mut table = self.shared.lock();
            // Checked under the table's lock: the reader marks the engine ended and drains the routes
            // under the same lock, so a request is either drained or refused here, never lost.
            if table.ended {
                drop(table);
                return Err(self.death_message());
            }
            table.start_owing();
            table.routes.insert(id.clone(), tx);
        }
        // The watchdog waits without a deadline while nothing is owed: wake it.
        self.shared.changed.notify_all();
        if self.writer.send(ToEngine::Gen(gen).to_line()).is_err() {
            self.shared.lock().routes.remove(&id);
            return Err(self.death_message());
        }
        Ok(rx)
    }

    /// Asks the engine to stop a request; its DONE (reason `cancel`) still arrives on its channel.
    pub fn cancel(&self, id: &str) {
        let _ = self
            .writer
            .send(ToEngine::Cancel(poly_protocol::Cancel { id: id.to_string() }).to_line());
    }

    /// Asks the engine for its STATS (at most `timeout`).
    pub async fn stats(&self, timeout: Duration) -> Option<poly_protocol::Stats> {
        self.monitor().stats(timeout).await
    }

    fn death_message(&self) -> String {
        let (status, stalled) = {
            let t = self.shared.lock();
            (t.exit.clone(), t.stalled.clone())
        };
        let tail = self.stderr_tail();
        format!(
            "the engine of {} {}{}{}",
            self.label,
            stalled.unwrap_or_else(|| "died".into()),
            status.map(|s| format!(" ({s})")).unwrap_or_default(),
            if tail.is_empty() {
                String::new()
            } else {
                format!("; engine log: {tail}")
            }
        )
    }

    /// A description of the engine's end, waiting for it at most `timeout`.
    async fn wait_exit(&mut self, timeout: Duration) -> Option<String> {
        let waited = tokio::time::timeout(timeout, self.exited.wait_for(Option::is_some)).await;
        match waited {
            Ok(Ok(status)) => status.clone(),
            _ => None,
        }
    }

    /// Stops the engine: QUIT, then SIGTERM to its process group, then SIGKILL, each after its timeout.
    /// Returns how it ended.
    pub async fn stop(&mut self, timeouts: StopTimeouts) -> String {
        if let Some(s) = self.exited.borrow().clone() {
            return s;
        }
        let _ = self.writer.send(ToEngine::Quit.to_line());
        if let Some(s) = self.wait_exit(timeouts.after_quit).await {
            return s;
        }
        eprintln!("polystrata: engine {} did not quit; SIGTERM", self.label);
        self.signal_group(nix::sys::signal::Signal::SIGTERM);
        // A stopped engine (SIGSTOP) would hold SIGTERM pending until continued: continue it so that it
        // ends now rather than at SIGKILL.
        self.signal_group(nix::sys::signal::Signal::SIGCONT);
        if let Some(s) = self.wait_exit(timeouts.after_term).await {
            return format!("{s} after SIGTERM");
        }
        eprintln!("polystrata: engine {} ignored SIGTERM; SIGKILL", self.label);
        self.signal_group(nix::sys::signal::Signal::SIGKILL);
        match self.wait_exit(Duration::from_secs(30)).await {
            Some(s) => format!("{s} after SIGKILL"),
            None => "did not end after SIGKILL".into(),
        }
    }

    fn signal_group(&self, signal: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(self.pid), signal);
    }
}

impl Drop for EngineProcess {
    fn drop(&mut self) {
        // A process never outlives its handle: whoever drops an engine without stopping it (a server
        // shutting down on an error) still takes the whole group down.
        if self.exited.borrow().is_none() {
            self.signal_group(nix::sys::signal::Signal::SIGKILL);
        }
    }
}

fn write_lines(mut stdin: std::process::ChildStdin, lines: std::sync::mpsc::Receiver<String>) {
    for line in lines {
        if stdin
            .write_all(line.as_bytes())
            .and_then(|_| stdin.write_all(b"\n"))
            .and_then(|_| stdin.flush())
            .is_err()
        {
            return;
        }
    }
}

fn forward_stderr(stderr: std::process::ChildStderr, label: &str, tail: &Mutex<VecDeque<String>>) {
    let reader = BufReader::new(stderr);
    for line in reader.split(b'\n') {
        let Ok(line) = line else { return };
        let line = String::from_utf8_lossy(&line).trim_end().to_string();
        eprintln!("[engine {label}] {line}");
        let mut tail = lock(tail);
        if tail.len() == STDERR_TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back(line);
    }
}

/// How long the reader, once stdout has ended, waits for the exit status to quote it.
const EXIT_STATUS_WAIT: Duration = Duration::from_secs(2);

/// The watchdog of one engine: returns when its stdout ends, or kills it after `stall` of silence while
/// it owes an answer.
fn watchdog(shared: &Shared, stall: Duration, pid: i32, label: &str) {
    let mut t = shared.lock();
    loop {
        if t.ended {
            return;
        }
        if !t.owes_answer() {
            t = shared.changed.wait(t).unwrap_or_else(|p| p.into_inner());
            continue;
        }
        let quiet = t.last_line.elapsed();
        if quiet >= stall {
            break;
        }
        // Woken early by any change; the loop then looks at the clock again.
        t = shared
            .changed
            .wait_timeout(t, stall - quiet)
            .map(|(g, _)| g)
            .unwrap_or_else(|p| p.into_inner().0);
    }
    let cause = format!(
        "made no progress for {} s (no protocol line while a request was in flight) and was killed",
        stall.as_secs()
    );
    eprintln!("polystrata: engine {label} (pid {pid}) {cause}");
    t.stalled = Some(cause);
    drop(t);
    // The whole group, as `stop` does; SIGKILL also ends a stopped process. Its stdout then closes and
    // the reader answers every request in flight with the cause.
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
}

struct Reader {
    shared: Arc<Shared>,
    dead: Arc<AtomicBool>,
    label: String,
}

impl Reader {
    fn run(
        self,
        stdout: std::process::ChildStdout,
        ready_tx: oneshot::Sender<Result<Ready, String>>,
    ) {
        let mut ready_tx = Some(ready_tx);
        let mut reader = BufReader::new(stdout);
        let mut buf = Vec::new();
        loop {
            match read_line_bounded(&mut reader, &mut buf, MAX_LINE_BYTES) {
                Ok(LineRead::Line) => {}
                Ok(LineRead::TooLong) => {
                    eprintln!(
                        "polystrata: engine {}: an overlong line skipped",
                        self.label
                    );
                    continue;
                }
                Ok(LineRead::Eof) | Err(_) => break,
            }
            // Any line is progress, even one this server cannot read.
            self.shared.lock().last_line = Instant::now();
            let text = String::from_utf8_lossy(&buf);
            if text.trim().is_empty() {
                continue;
            }
            let message = match FromEngine::parse(&text) {
                Ok(m) => m,
                Err(e) => {
                    eprintln!(
                        "polystrata: engine {}: unreadable line: {}",
                        self.label, e.message
                    );
                    continue;
                }
            };
            match message {
                FromEngine::Ready(ready) => {
                    if let Some(tx) = ready_tx.take() {
                        let _ = tx.send(Ok(ready));
                    }
                }
                FromEngine::Err(err) if err.id.is_none() => {
                    if let Some(tx) = ready_tx.take() {
                        let _ = tx.send(Err(format!("engine error: {}", err.message)));
                    } else {
                        eprintln!("polystrata: engine {}: {}", self.label, err.message);
                    }
                }
                FromEngine::Stats(stats) => {
                    let waiter = self.shared.lock().stats_waiters.pop_front();
                    if let Some(tx) = waiter {
                        let _ = tx.send(stats);
                    }
                }
                // Progress only (the line's time was noted above).
                FromEngine::Progress(_) => {}
                FromEngine::Tokens(t) => self.route(&t.id.clone(), EngineEvent::Tokens(t), false),
                FromEngine::Done(d) => self.route(&d.id.clone(), EngineEvent::Done(d), true),
                FromEngine::Err(e) => {
                    let id = e.id.clone().unwrap_or_default();
                    self.route(&id, EngineEvent::Refused(e), true)
                }
            }
        }
        // stdout ended: the engine is gone (or going). No request is taken from here on; everyone
        // waiting hears how it ended, once the process is reaped (a moment after its stdout closes).
        let mut t = self.shared.lock();
        t.ended = true;
        self.dead.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        let deadline = Instant::now() + EXIT_STATUS_WAIT;
        while t.exit.is_none() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            t = self
                .shared
                .changed
                .wait_timeout(t, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
        let how = t.exit.clone().unwrap_or_else(|| "its output closed".into());
        let message = match &t.stalled {
            Some(cause) => format!("the engine of {} {cause} ({how})", self.label),
            None => format!("the engine of {} ended ({how})", self.label),
        };
        for (_, tx) in t.routes.drain() {
            let _ = tx.send(EngineEvent::Died(message.clone()));
        }
        t.stats_waiters.clear();
        drop(t);
        if let Some(tx) = ready_tx.take() {
            let _ = tx.send(Err(format!("the engine exited before READY ({how})")));
        }
    }

    fn route(&self, id: &str, event: EngineEvent, last: bool) {
        let mut t = self.shared.lock();
        let tx = if last {
            t.routes.remove(id)
        } else {
            t.routes.get(id).cloned()
        };
        if let Some(tx) = tx {
            let _ = tx.send(event);
        }
    }
}

#[cfg(test)]
mod env_tests {
    use super::engine_env;
    use std::ffi::OsString;

    #[test]
    fn the_child_gets_the_allow_list_only() {
        let vars = [
            ("PATH", "/usr/bin"),
            ("POLY_FUSE", "off"),
            ("POLY_GPU_PROFILE", "1"),
            ("SOME_SECRET", "x"),
            ("CUDA_VISIBLE_DEVICES", "1"),
        ]
        .map(|(k, v)| (OsString::from(k), OsString::from(v)));
        let kept: Vec<String> = engine_env(vars)
            .into_iter()
            .map(|(k, _)| k.to_string_lossy().into_owned())
            .collect();
        assert_eq!(kept, ["PATH", "POLY_GPU_PROFILE", "CUDA_VISIBLE_DEVICES"]);
    }
}
