//! An engine whose server is gone while the model loads exits at once instead of at the end of the load.
//!
//! The server starts the engine in a process group of its own (so a Ctrl-C at the server's terminal does
//! not reach it) and talks to it over its stdin. A server that dies without stopping it (killed, or
//! crashed) closes that pipe; an engine serving requests sees the end of its input and exits, but one
//! still loading reads nothing until the load is done, which for a large model on a card is minutes of
//! VRAM, pinned memory and mappings held for nobody, in the way of the next server's engine (on an H100,
//! 2026-12-07, a run started right after a server benchmark killed during its engine's first kernel
//! compilation found the card 2.4 GB fuller than it should be and no room for one expert: most likely
//! that engine, still loading). So while the model loads, a thread waits in
//! poll(2) for stdin, reading nothing: a hang-up with nothing to read ends the process; input to read
//! (a server that wrote early, requests piped from a file or `printf`, a regular file or /dev/null as
//! stdin) ends the watch, and the session reads it and sees its end after the load, as before.

use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

/// The exit status of an engine whose server went away while it loaded.
pub const ORPHANED_EXIT: i32 = 3;

/// Watches stdin while the model loads; [`LoadWatch::done`] (or dropping it) ends the watch.
pub struct LoadWatch {
    loading: Arc<AtomicBool>,
}

impl LoadWatch {
    /// Starts the watch: a hang-up of stdin before [`LoadWatch::done`] ends the process.
    pub fn start() -> LoadWatch {
        let loading = Arc::new(AtomicBool::new(true));
        let flag = loading.clone();
        let spawned = std::thread::Builder::new()
            .name("stdin-hangup".into())
            .spawn(move || {
                if stdin_hangs_up() && flag.load(Ordering::Acquire) {
                    eprintln!(
                        "poly-engine: the server closed the protocol pipe while the model loaded; exiting"
                    );
                    std::process::exit(ORPHANED_EXIT);
                }
            });
        if let Err(e) = spawned {
            eprintln!("poly-engine: no watch on stdin while loading ({e}): a gone server is seen after the load");
        }
        LoadWatch { loading }
    }

    /// The model is loaded: from here the session reads stdin and sees its end itself.
    pub fn done(self) {}
}

impl Drop for LoadWatch {
    fn drop(&mut self) {
        self.loading.store(false, Ordering::Release);
    }
}

/// Blocks until stdin hangs up with nothing to read (true) or has input or cannot be polled (false),
/// reading nothing.
fn stdin_hangs_up() -> bool {
    let stdin = std::io::stdin();
    let mut fds = [PollFd::new(stdin.as_fd(), PollFlags::POLLIN)];
    loop {
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {
                let r = fds[0].revents().unwrap_or(PollFlags::empty());
                let gone = r.intersects(PollFlags::POLLHUP | PollFlags::POLLERR);
                return gone && !r.contains(PollFlags::POLLIN);
            }
            Err(Errno::EINTR) => continue,
            Err(_) => return false,
        }
    }
}
