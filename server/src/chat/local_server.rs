//! The server the terminal chat starts when none answers on its port: the same binary's `serve` as a
//! child, its log in a file (so it never mixes with the chat), stopped with SIGTERM when the chat ends
//! (the server's shutdown stops its engine).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};

pub struct LocalServer {
    child: Child,
    /// Held open so the server's stdout stays a live pipe for as long as it runs.
    _stdout: BufReader<ChildStdout>,
    pub log: PathBuf,
}

impl LocalServer {
    /// Starts `polystrata serve` on 127.0.0.1:`port` and waits until it listens.
    pub fn start(home: Option<&Path>, port: u16) -> Result<LocalServer, String> {
        let exe = std::env::current_exe()
            .map_err(|e| format!("cannot find the polystrata binary: {e}"))?;
        let log = std::env::temp_dir().join(format!("polystrata-chat-{}.log", std::process::id()));
        let log_file = std::fs::File::create(&log)
            .map_err(|e| format!("cannot create {}: {e}", log.display()))?;
        let mut cmd = Command::new(exe);
        cmd.arg("serve");
        if let Some(h) = home {
            cmd.arg("--home").arg(h);
        }
        // Its own process group: the terminal's Ctrl-C (SIGINT to the chat's group) stops an answer,
        // not the server.
        use std::os::unix::process::CommandExt;
        let mut child = cmd
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log_file))
            .spawn()
            .map_err(|e| format!("cannot start the server: {e}"))?;
        let Some(stdout) = child.stdout.take() else {
            return Err("the server's stdout is not a pipe".into());
        };
        let mut stdout = BufReader::new(stdout);
        // The server's one stdout line says it listens; anything else (an exit) is a failure.
        let mut line = String::new();
        let listening = stdout.read_line(&mut line).is_ok() && line.contains("listening on");
        let server = LocalServer {
            child,
            _stdout: stdout,
            log,
        };
        if !listening {
            let tail = std::fs::read_to_string(&server.log).unwrap_or_default();
            return Err(format!(
                "the server did not start on port {port}: {}",
                tail.trim()
            ));
        }
        Ok(server)
    }
}

impl LocalServer {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_file(&self.log);
    }
}
