//! Ctrl-C in the terminal chat, as llama-cli and `ollama run` have it: during an answer it stops the
//! answer (the stream's connection is shut, so the server cancels the generation) and the chat goes on;
//! at the prompt it says how to quit, and a second Ctrl-C there quits (stopping the server the chat
//! started, as `/quit` does).
//!
//! SIGINT is taken by a thread of its own (a small tokio runtime waiting on `ctrl_c`), because the chat
//! itself blocks on stdin and on the stream; the server the chat starts runs in its own process group,
//! so the terminal's SIGINT reaches the chat only.

use crate::client::Client;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What the Ctrl-C thread shares with the chat.
pub struct Interrupts {
    client: Client,
    /// Set when a Ctrl-C stopped an answer; the chat takes it.
    stopped: AtomicBool,
    /// Set by a Ctrl-C at the prompt; a second one quits. Cleared by a typed line.
    armed: AtomicBool,
    /// The pid of the server the chat started (0: none), stopped before a Ctrl-C quits.
    server_pid: AtomicI32,
}

impl Interrupts {
    /// Starts the Ctrl-C thread for `client`'s streams. `None` when SIGINT cannot be taken (the chat
    /// then ends at Ctrl-C, as before).
    pub fn install(client: Client) -> Option<Arc<Interrupts>> {
        let shared = Arc::new(Interrupts {
            client,
            stopped: AtomicBool::new(false),
            armed: AtomicBool::new(false),
            server_pid: AtomicI32::new(0),
        });
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .ok()?;
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let inner = shared.clone();
        std::thread::Builder::new()
            .name("ctrl-c".into())
            .spawn(move || {
                runtime.block_on(async move {
                    // The handler is in place once the first `ctrl_c` future is polled; the chat waits
                    // for that, so an early Ctrl-C is not lost to the default action.
                    let mut first = true;
                    loop {
                        let pressed = tokio::signal::ctrl_c();
                        tokio::pin!(pressed);
                        if first {
                            let poll = futures_poll_once(pressed.as_mut()).await;
                            let _ = ready_tx.send(());
                            first = false;
                            if poll.is_some() {
                                inner.pressed();
                                continue;
                            }
                        }
                        if pressed.await.is_err() {
                            return;
                        }
                        inner.pressed();
                    }
                })
            })
            .ok()?;
        ready_rx.recv_timeout(Duration::from_secs(5)).ok()?;
        Some(shared)
    }

    /// Names the server to stop before a Ctrl-C quits.
    pub fn set_server_pid(&self, pid: u32) {
        self.server_pid.store(pid as i32, Ordering::SeqCst);
    }

    /// Whether a Ctrl-C stopped the last answer (and forgets it).
    pub fn take_stopped(&self) -> bool {
        self.stopped.swap(false, Ordering::SeqCst)
    }

    /// A line was typed: the next Ctrl-C at the prompt only warns again.
    pub fn disarm(&self) {
        self.armed.store(false, Ordering::SeqCst);
    }

    fn pressed(&self) {
        // Marked before the socket is shut: the chat reads the mark as soon as its read fails.
        if self
            .client
            .stop_stream(|| self.stopped.store(true, Ordering::SeqCst))
        {
            self.armed.store(false, Ordering::SeqCst);
            return;
        }
        if !self.armed.swap(true, Ordering::SeqCst) {
            println!("\n(Ctrl-C again or /bye to quit)");
            return;
        }
        println!();
        let pid = self.server_pid.load(Ordering::SeqCst);
        if pid > 0 {
            println!("stopping the server");
            stop_server(pid);
        }
        std::process::exit(0);
    }
}

/// Polls `f` once: `Some` if it is ready at once (it registers the signal handler either way).
async fn futures_poll_once<F: std::future::Future + Unpin>(mut f: F) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        std::task::Poll::Ready(match std::pin::Pin::new(&mut f).poll(cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        })
    })
    .await
}

/// SIGTERM to the chat's server, then a wait for it to end (it stops its engine first), at most 15 s:
/// the chat is its parent, and a thread blocked in `waitpid` reaps it and says so.
fn stop_server(pid: i32) {
    let pid = nix::unistd::Pid::from_raw(pid);
    if nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).is_err() {
        return;
    }
    let (ended_tx, ended) = std::sync::mpsc::channel();
    let waiter = std::thread::Builder::new()
        .name("server-exit".into())
        .spawn(move || {
            let _ = nix::sys::wait::waitpid(pid, None);
            let _ = ended_tx.send(());
        });
    if waiter.is_ok() {
        // Ended, or the 15 s are up (the chat exits either way), or the waiter is gone.
        let _ = ended.recv_timeout(Duration::from_secs(15));
    }
}
