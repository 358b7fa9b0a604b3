//! Other commands remember the home (issue 20: `polystrata benchmark --model demo` after setup said
//! "model demo not found (installed: none)" without naming the home it read): `serve --home H`
//! remembers H (`$XDG_CONFIG_HOME/polystrata/home`), and `--list-models`, `benchmark` and `setup.sh`
//! given no `--home` read H; a model not found there is reported with the home that was read; `ps`
//! and the terminal chat without `--port` use the server recorded there (`polystrata.url`).
//!
//! The chat loads the tiny qwen3moe fixture in the real engine. Cost: well under a second.

mod common;

use common::{Home, Server};
use serde_json::json;

#[test]
fn commands_after_serve_read_the_home_it_served() {
    let home = Home::new("remembered");
    home.add_model("tiny", "qwen3moe-tiny-q4km.gguf", json!({}));
    let config = home.dir.join("config");
    let config_arg = config.display().to_string();
    let server = Server::start_logged(&home, &[], &[("XDG_CONFIG_HOME", &config_arg)]);
    // `ps` without --port asks the server setup.sh recorded in the (remembered) home.
    std::fs::write(
        home.dir.join("polystrata.url"),
        format!("http://{}\n", server.addr),
    )
    .expect("write polystrata.url");
    let ps = common::polystrata()
        .env("XDG_CONFIG_HOME", &config)
        .env_remove("POLYSTRATA_HOME")
        .arg("ps")
        .output()
        .expect("run polystrata ps");
    let stdout = String::from_utf8_lossy(&ps.stdout);
    assert!(
        ps.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&ps.stderr)
    );
    assert!(stdout.contains("(nothing loaded)"), "{stdout}");
    // So does the terminal chat: it uses that server rather than starting one on 8080.
    let mut chat = common::polystrata()
        .env("XDG_CONFIG_HOME", &config)
        .env_remove("POLYSTRATA_HOME")
        .args(["--model", "tiny"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the chat");
    if let Some(mut stdin) = chat.stdin.take() {
        use std::io::Write;
        let _ = stdin.write_all(b"/bye\n");
    }
    let out = chat.wait_with_output().expect("the chat ends");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let port = server.addr.rsplit(':').next().unwrap_or_default();
    assert!(
        out.status.success() && stdout.contains(&format!("using the server on port {port}")),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(server.get("/api/models/current").json()["model"], "tiny");
    server.stop();
    std::fs::remove_file(home.dir.join("polystrata.url")).expect("remove polystrata.url");
    let remembered = std::fs::read_to_string(config.join("polystrata/home")).expect("remembered");
    let canonical = std::fs::canonicalize(&home.dir).expect("canonical home");
    assert_eq!(remembered.trim(), canonical.display().to_string());

    // Neither --home nor POLYSTRATA_HOME: the served home is read.
    let run = |args: &[&str]| {
        common::polystrata()
            .env("XDG_CONFIG_HOME", &config)
            .env_remove("POLYSTRATA_HOME")
            .args(args)
            .output()
            .expect("run polystrata")
    };
    let listed = run(&["--list-models"]);
    let stdout = String::from_utf8_lossy(&listed.stdout);
    assert!(listed.status.success(), "{stdout}");
    assert!(stdout.starts_with("tiny "), "{stdout}");

    // The benchmark (both kinds) and verify name the home they read when the model is not there.
    for args in [
        &["benchmark", "--model", "demo"][..],
        &["benchmark", "--model", "demo", "--concurrent", "2"],
        &["verify", "demo"],
    ] {
        let missing = run(args);
        assert!(!missing.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&missing.stderr);
        assert!(stderr.contains("\"demo\""), "{args:?}: {stderr}");
        assert!(
            stderr.contains(&format!("home {}", canonical.display())),
            "{args:?}: the error names the home it read: {stderr}"
        );
    }

    // setup.sh reads it too (here `--stop`, which finds no server recorded there).
    let stop = std::process::Command::new("bash")
        .arg(common::workspace_root().join("setup.sh"))
        .arg("--stop")
        .env("XDG_CONFIG_HOME", &config)
        .env_remove("POLYSTRATA_HOME")
        .output()
        .expect("run setup.sh --stop");
    let stdout = String::from_utf8_lossy(&stop.stdout);
    assert!(stop.status.success(), "{stdout}");
    assert!(
        stdout.contains(&canonical.join("polystrata.pid").display().to_string()),
        "{stdout}"
    );

    // A remembered home that is gone is not read: the default one is, and named.
    let empty_home = home.dir.join("user");
    std::fs::create_dir_all(&empty_home).expect("a HOME");
    std::fs::write(config.join("polystrata/home"), "/nonexistent/polystrata\n").expect("write");
    let out = common::polystrata()
        .env("XDG_CONFIG_HOME", &config)
        .env("HOME", &empty_home)
        .env_remove("POLYSTRATA_HOME")
        .arg("--list-models")
        .output()
        .expect("run polystrata");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!(
            "no models installed in {}",
            empty_home.join(".polystrata").display()
        )),
        "{stdout}"
    );
}

/// The terminal chat names the home it read when the model is not there: with no server on the port it
/// stops before starting one (issue 20: "installed: none" without the home); with a server it names the
/// server's home.
#[test]
fn the_chat_names_the_home_when_the_model_is_missing() {
    let home = Home::new("chat-missing");
    let empty = home.dir.join("empty");
    std::fs::create_dir_all(&empty).expect("an empty home");
    // A port nothing listens on: bound, then let go.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
        .to_string();
    let out = common::polystrata()
        .env_remove("POLYSTRATA_HOME")
        .arg("--home")
        .arg(&empty)
        .args(["--port", &port, "--model", "demo"])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run the chat");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stdout}{stderr}");
    assert!(
        stderr.contains("no model is called \"demo\"; installed: none"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("home {}", empty.display())),
        "{stderr}"
    );
    assert!(!stdout.contains("starting a server"), "{stdout}");

    // A server on the port: its home is named.
    home.add_model("tiny", "qwen3moe-tiny-q4km.gguf", json!({}));
    let server = Server::start(&home, &[]);
    let port = server
        .addr
        .rsplit(':')
        .next()
        .unwrap_or_default()
        .to_string();
    let out = common::polystrata()
        .env_remove("POLYSTRATA_HOME")
        .arg("--home")
        .arg(&empty)
        .args(["--port", &port, "--model", "demo"])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run the chat");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("installed: tiny")
            && stderr.contains(&format!("the server reads home {}", home.dir.display())),
        "{stderr}"
    );
    server.stop();
}
