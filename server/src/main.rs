//! `polystrata`: the long-lived server users talk to.
//!
//! It supervises one `poly-engine` child at a time over the `poly-protocol` crate and owns everything about
//! text (tokenizers, chat templates, reasoning and tool-call formats) and the HTTP APIs. It never links the
//! kernels or the engine's internals: the engine is a separate process so that switching models returns
//! every byte of VRAM, pinned memory and mapping to the OS.
//!
//! Commands: `polystrata serve` (the server alone), `polystrata --list-models` (the registry),
//! `polystrata tokenizer --gguf FILE --out DIR` (a model's tokenizer directory), `polystrata benchmark
//! --model NAME` (prompt and answer speed through the supervisor, `bench`). The terminal chat
//! (`polystrata --model NAME`) is a client of the HTTP API (`chat`).

use clap::{Parser, Subcommand};
use polystrata::engine::process::StopTimeouts;
use polystrata::engine::supervisor::{Limits, Supervisor};
use polystrata::registry::Registry;
use polystrata::{home, http};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

#[derive(Parser)]
#[command(
    name = "polystrata",
    version,
    about = "PolyStrata: an LLM server over poly-engine"
)]
struct Args {
    /// The installation home (run configs `strata-<name>.json`, `models.json`); else POLYSTRATA_HOME,
    /// else the home the last `serve` used (remembered in ~/.config/polystrata/home),
    /// else ~/.polystrata.
    #[arg(long, global = true)]
    home: Option<PathBuf>,
    /// Print the installed models with their registry fields and exit.
    #[arg(long)]
    list_models: bool,
    /// Chat in the terminal with this model (a server on --port is switched to it, else one is started).
    #[arg(long)]
    model: Option<String>,
    /// The port of the server the terminal chat uses (or starts); else the one `setup.sh --background`
    /// recorded in the home (`polystrata.url`), else 8080.
    #[arg(long)]
    port: Option<u16>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the HTTP server.
    Serve(ServeArgs),
    /// Write a model's tokenizer directory (tokenizer.json, chat template, tokenizer_config.json) from
    /// its GGUF.
    Tokenizer {
        /// The model's GGUF file (the first part of a split model).
        #[arg(long)]
        gguf: PathBuf,
        /// The directory to write (created if missing).
        #[arg(long)]
        out: PathBuf,
    },
    /// Measure a model: a short prompt and long ones, each answered greedily, through the supervisor and
    /// the engine as `serve` runs them (it starts the model's engine itself; stop a server that holds the
    /// same GPU first).
    Benchmark(BenchmarkArgs),
    /// Check a model as it is served (its run config: device, expert placement, knobs) against the CPU
    /// reference on prompts of the repository's text: mean KL, largest KL and the share of steps with
    /// the same likeliest token, within bounds or a non-zero exit.
    Verify(VerifyArgs),
    /// Say what the server on --port has loaded: the model, its engine's pid and memory, how long it
    /// has been loaded and unused, and when it will be unloaded for idleness.
    Ps {
        /// The server's port; else the one `setup.sh --background` recorded in the home
        /// (`polystrata.url`), else 8080.
        #[arg(long)]
        port: Option<u16>,
    },
}

/// `--prompt-tokens` parsed whole (an alias, so clap does not read `Vec` as one value per flag).
type PromptLengths = Vec<usize>;

#[derive(clap::Args)]
struct BenchmarkArgs {
    /// The model (a registry id, alias or unique part of an id), or a GGUF file's path (registered in
    /// the home as `serve --gguf` does).
    #[arg(long)]
    model: String,
    /// One JSON object on stdout instead of the table.
    #[arg(long)]
    json: bool,
    /// The long prompts' lengths in tokens, comma-separated (the short prompt always runs too; default
    /// 2000,8000). With --concurrent: the first is every request's prompt length (default 64).
    #[arg(long, value_parser = polystrata::bench::parse_prompt_tokens)]
    prompt_tokens: Option<PromptLengths>,
    /// Instead: N clients sending chats at once through the supervisor (answers/s, latency).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=64))]
    concurrent: Option<u32>,
    /// With --concurrent: requests each client sends, one after the other.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    chats: u32,
    /// With --concurrent: requests running at once (the server's --parallel; default: N).
    #[arg(long, value_name = "P", value_parser = clap::value_parser!(u32).range(1..=64))]
    parallel: Option<u32>,
    /// How many times to send every prompt.
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Answer tokens per prompt (greedy; end tokens do not stop the answer).
    #[arg(long, default_value_t = 256)]
    answer_tokens: u32,
    /// Seconds the engine may take to load before READY.
    #[arg(long, default_value_t = 600)]
    ready_timeout: u64,
}

#[derive(clap::Args)]
struct VerifyArgs {
    /// The model (a registry id, alias or unique part of an id), or a GGUF file's path (registered in
    /// the home as `serve --gguf` does).
    model: String,
    /// Prompts, from places spread over the text.
    #[arg(long, default_value_t = 3)]
    prompts: usize,
    /// Tokens of each prompt.
    #[arg(long, default_value_t = 64)]
    prompt_tokens: usize,
    /// Tokens written per prompt.
    #[arg(long, default_value_t = 24)]
    answer_tokens: usize,
    /// The engine's JSON report on stdout instead of the summary.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct ServeArgs {
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require this key (`Authorization: Bearer KEY` or `x-api-key: KEY`) on every API request.
    #[arg(long, value_parser = non_empty_key)]
    api_key: Option<String>,
    /// A web origin (`scheme://host[:port]`, or `*` for any) whose pages may use the API, with CORS;
    /// repeatable. Other sites' pages cannot change anything (their POSTs are refused).
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    cors_origins: Vec<String>,
    /// A `Host` name (or `NAME:PORT`, or `*`) the server answers to besides localhost and IP addresses;
    /// repeatable. Other names are refused (DNS rebinding).
    #[arg(long = "allowed-host", value_name = "NAME")]
    allowed_hosts: Vec<String>,
    /// Load this model at start (else the first request or /api/models/load chooses).
    #[arg(long)]
    load: Option<String>,
    /// Serve this GGUF file without a hand-written run config: it is registered in the home (its
    /// tokenizer directory in the home's cache, a run config beside the others) and loaded at start
    /// unless --load names another; repeatable.
    #[arg(long = "gguf", value_name = "FILE")]
    gguf: Vec<PathBuf>,
    /// Requests that may wait behind the running ones; more get 503 with Retry-After.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Requests that run at once (the engine is started with `--parallel N` and writes their tokens in
    /// turns, so a short request is not held up by a long one; the total rate stays about one request's).
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    parallel: u32,
    /// Seconds a switch waits for the running request before it is refused.
    #[arg(long, default_value_t = 120)]
    switch_wait: u64,
    /// Seconds an engine may take to load before READY.
    #[arg(long, default_value_t = 600)]
    ready_timeout: u64,
    /// Seconds an engine that owes an answer (a request or a STATS in flight) may send no protocol line
    /// before it is killed and started again, its requests answered with the cause (0: never). A long
    /// prompt reports progress after each forward call, so this bounds one call, not a whole read. A
    /// model's run config may set its own (`stall_timeout_s`).
    #[arg(long, default_value_t = polystrata::engine::supervisor::DEFAULT_STALL.as_secs())]
    stall_timeout: u64,
    /// Seconds a stopping engine gets after QUIT before SIGTERM.
    #[arg(long, default_value_t = 10)]
    quit_timeout: u64,
    /// Seconds a stopping engine gets after SIGTERM before SIGKILL.
    #[arg(long, default_value_t = 5)]
    term_timeout: u64,
    /// Connections served at once (more wait until one closes); default: what the descriptor limit
    /// leaves after a reserve for engines and files, at most 4096.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: Option<u32>,
    /// Seconds a connection may take to send a request's head, also while idle between requests.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    header_timeout: u64,
    /// Seconds a request's body may take to arrive.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    body_timeout: u64,
    /// Seconds an engine may sit unused before it is unloaded (0: never); the next request loads it
    /// again. An Ollama request's `keep_alive` overrides it.
    #[arg(long, default_value_t = 0)]
    idle_unload: u64,
    /// The largest request body, in MiB.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=1024))]
    max_body_mib: u64,
}

/// Descriptors kept for what is not a connection: engine pipes, model and tokenizer files, the log.
const FD_RESERVE: u64 = 64;

/// Raises the soft descriptor limit to the hard one (connections are descriptors) and returns the
/// connection cap it leaves room for.
fn connection_cap() -> usize {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let soft = match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => hard,
            Err(_) => soft,
        },
        Ok((soft, _)) => soft,
        Err(_) => 1024,
    };
    soft.saturating_sub(FD_RESERVE).clamp(16, 4096) as usize
}

/// `--api-key`: an empty key would let an empty `x-api-key` in.
fn non_empty_key(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        Err("the API key must not be empty".into())
    } else {
        Ok(s.to_string())
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let home = home::resolve_home(args.home.as_deref());
    let registry = Arc::new(Registry::new(home));
    if args.list_models {
        return list_models(&registry);
    }
    if let Some(model) = args.model {
        // `--model ./file.gguf`: the file is registered in the home, then chatted with by its id.
        let model = match model_or_file(&registry, model) {
            Ok(m) => m,
            Err(code) => return code,
        };
        return polystrata::chat::run(polystrata::chat::ChatOptions {
            model,
            home: args.home,
            resolved_home: registry.home().to_path_buf(),
            port: args.port.unwrap_or_else(|| recorded_port(registry.home())),
        });
    }
    match args.command {
        Some(Command::Serve(mut serve)) => {
            for gguf in &serve.gguf {
                match polystrata::by_path::register(registry.home(), gguf) {
                    Ok(id) => {
                        serve.load.get_or_insert(id);
                    }
                    Err(e) => {
                        eprintln!("polystrata: cannot serve {}: {e}", gguf.display());
                        return ExitCode::FAILURE;
                    }
                }
            }
            // The home this server serves is the one later commands read (`benchmark`, `--model`).
            if registry.home().is_dir() {
                if let Err(e) = home::remember_home(registry.home()) {
                    eprintln!(
                        "polystrata: cannot remember the home ({e}); later commands may read another"
                    );
                }
            }
            run_server(registry, serve)
        }
        Some(Command::Benchmark(mut b)) if b.concurrent.is_some() => {
            b.model = match model_or_file(&registry, b.model) {
                Ok(m) => m,
                Err(code) => return code,
            };
            let clients = b.concurrent.unwrap_or(1) as usize;
            polystrata::bench::concurrent::run(
                registry,
                polystrata::bench::concurrent::ConcurrentOptions {
                    model: b.model,
                    clients,
                    parallel: b.parallel.map_or(clients, |p| p as usize),
                    chats: b.chats as usize,
                    prompt_tokens: b
                        .prompt_tokens
                        .and_then(|p| p.first().copied())
                        .unwrap_or(64),
                    answer_tokens: b.answer_tokens,
                    json: b.json,
                    ready_timeout: std::time::Duration::from_secs(b.ready_timeout),
                },
            )
        }
        Some(Command::Benchmark(b)) => polystrata::bench::run(
            registry.clone(),
            polystrata::bench::BenchOptions {
                model: match model_or_file(&registry, b.model) {
                    Ok(m) => m,
                    Err(code) => return code,
                },
                long_prompts: b
                    .prompt_tokens
                    .unwrap_or_else(|| polystrata::bench::DEFAULT_LONG_PROMPTS.to_vec()),
                runs: b.runs,
                answer_tokens: b.answer_tokens,
                json: b.json,
                ready_timeout: std::time::Duration::from_secs(b.ready_timeout),
            },
        ),
        Some(Command::Verify(v)) => polystrata::verify::run(
            registry.clone(),
            polystrata::verify::VerifyOptions {
                model: match model_or_file(&registry, v.model) {
                    Ok(m) => m,
                    Err(code) => return code,
                },
                prompts: v.prompts,
                prompt_tokens: v.prompt_tokens,
                answer_tokens: v.answer_tokens,
                json: v.json,
            },
        ),
        Some(Command::Tokenizer { gguf, out }) => {
            match polystrata::text::tokenizer_dir::tokenizer_command(&gguf, &out) {
                Ok(cfg) => {
                    eprintln!(
                        "polystrata: wrote {} ({} tokens, {} model, pre '{}', family {})",
                        out.display(),
                        cfg.n_vocab,
                        cfg.model,
                        cfg.pre,
                        cfg.family.name()
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("polystrata: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Some(Command::Ps { port }) => ps(port.unwrap_or_else(|| recorded_port(registry.home()))),
        None => {
            eprintln!("polystrata: say `serve`, `benchmark`, `ps` or `--list-models` (see --help)");
            ExitCode::from(2)
        }
    }
}

/// A command's `--model`: a registry name as given, or a GGUF file's path registered in the home (as
/// `serve --gguf` does) and named by its id; a name written as a path that names no file is an error
/// here, before anything starts.
fn model_or_file(registry: &Registry, model: String) -> Result<String, ExitCode> {
    if polystrata::by_path::is_gguf_path(&model) {
        polystrata::by_path::register(registry.home(), std::path::Path::new(&model)).map_err(|e| {
            eprintln!("polystrata: cannot serve {model}: {e}");
            ExitCode::FAILURE
        })
    } else if polystrata::by_path::looks_like_path(&model) {
        eprintln!(
            "polystrata: cannot serve {model}: no such file (a model name has no `/` and no .gguf)"
        );
        Err(ExitCode::FAILURE)
    } else {
        Ok(model)
    }
}

/// The port of the server `setup.sh --background` started on this home (`<home>/polystrata.url`,
/// `http://127.0.0.1:PORT`), else 8080.
fn recorded_port(home: &std::path::Path) -> u16 {
    std::fs::read_to_string(home.join("polystrata.url"))
        .ok()
        .and_then(|url| {
            let url = url.trim().trim_end_matches('/').to_string();
            url.rsplit(':').next().and_then(|p| p.parse().ok())
        })
        .unwrap_or(8080)
}

/// `polystrata ps`: the server's `/api/models/current` as one line per loaded model.
fn ps(port: u16) -> ExitCode {
    let api_key = std::env::var("POLYSTRATA_API_KEY")
        .ok()
        .filter(|k| !k.is_empty());
    let client = polystrata::client::Client::new(format!("127.0.0.1:{port}"), api_key);
    let current = match client.current() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("polystrata: no server answers on port {port} ({e})");
            return ExitCode::FAILURE;
        }
    };
    print!("{}", ps_text(&current));
    ExitCode::SUCCESS
}

/// The text of `polystrata ps` for a `/api/models/current` answer.
fn ps_text(c: &serde_json::Value) -> String {
    let secs = |k: &str| c[k].as_u64();
    let dur = |s: Option<u64>| match s {
        None => "-".to_string(),
        Some(s) if s >= 3600 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        Some(s) if s >= 60 => format!("{}m{:02}s", s / 60, s % 60),
        Some(s) => format!("{s}s"),
    };
    let mut out = format!(
        "{:<28} {:>8} {:>10} {:>10} {:>10} {:>8} {:>10}\n",
        "MODEL", "PID", "RSS", "VRAM", "LOADED", "IDLE", "UNLOADS IN"
    );
    let mib = |k: &str| {
        c[k].as_u64()
            .map_or("-".to_string(), |b| format!("{} MiB", b >> 20))
    };
    match (c["model"].as_str(), c["loaded"].as_bool()) {
        (Some(model), Some(true)) => {
            out.push_str(&format!(
                "{model:<28} {:>8} {:>10} {:>10} {:>10} {:>8} {:>10}\n",
                c["pid"].as_i64().map_or("-".to_string(), |p| p.to_string()),
                mib("rss_bytes"),
                mib("vram_bytes"),
                dur(secs("loaded_for_s")),
                dur(secs("idle_for_s")),
                secs("unload_in_s").map_or("never".to_string(), |s| dur(Some(s))),
            ));
        }
        (Some(model), _) => out.push_str(&format!("{model:<28} (chosen, not loaded)\n")),
        _ => out.push_str("(nothing loaded)\n"),
    }
    out
}

fn list_models(registry: &Registry) -> ExitCode {
    use std::io::Write;
    // One write of the whole listing; a reader that stops early (`| head`) is not an error.
    let text = model_list(registry);
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("polystrata: cannot write the list: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The text of `--list-models`: each installed model with its registry fields.
fn model_list(registry: &Registry) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let entries = registry.scan();
    if entries.is_empty() {
        let _ = writeln!(out, "no models installed in {}", registry.home().display());
        return out;
    }
    for e in entries {
        let status = serde_json::to_value(e.status)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        let _ = writeln!(out, "{}  [{status}]  {}", e.id, e.display_name);
        let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
        let _ = writeln!(
            out,
            "    backend {}  quantization {}  params {} (active {})  context {}",
            opt(&e.backend),
            opt(&e.quantization),
            opt(&e.params_total),
            opt(&e.params_active),
            e.context
                .map(|c| c.to_string())
                .unwrap_or_else(|| "-".into())
        );
        let _ = writeln!(
            out,
            "    vram_gb least {} all {}  ram_gb {}  multimodal {}  mtp {}",
            e.vram_gb
                .map(|v| v.least.to_string())
                .unwrap_or_else(|| "-".into()),
            e.vram_gb
                .map(|v| v.all.to_string())
                .unwrap_or_else(|| "-".into()),
            e.ram_gb
                .map(|v| v.to_string())
                .unwrap_or_else(|| "-".into()),
            e.multimodal,
            e.mtp
        );
        if let Some(p) = &e.path {
            let _ = writeln!(out, "    path {}", p.display());
        }
        if let Some(p) = &e.problem {
            let _ = writeln!(out, "    problem: {p}");
        }
        if let Some(n) = &e.context_note {
            let _ = writeln!(out, "    context: {n}");
        }
        if let Some(n) = &e.notes {
            let _ = writeln!(out, "    notes: {n}");
        }
        if !e.aliases.is_empty() {
            let _ = writeln!(out, "    aliases: {}", e.aliases.join(", "));
        }
    }
    out
}

fn run_server(registry: Arc<Registry>, args: ServeArgs) -> ExitCode {
    let Some(runtime) = polystrata::runtime() else {
        return ExitCode::FAILURE;
    };
    runtime.block_on(async move {
        let limits = Limits {
            queue: args.queue,
            parallel: args.parallel as usize,
            switch_wait: std::time::Duration::from_secs(args.switch_wait),
            ready_timeout: std::time::Duration::from_secs(args.ready_timeout),
            stall: (args.stall_timeout > 0)
                .then(|| std::time::Duration::from_secs(args.stall_timeout)),
            stop: StopTimeouts {
                after_quit: std::time::Duration::from_secs(args.quit_timeout),
                after_term: std::time::Duration::from_secs(args.term_timeout),
            },
            idle_unload: (args.idle_unload > 0)
                .then(|| std::time::Duration::from_secs(args.idle_unload)),
        };
        // Always raised; an explicit --max-connections is taken as given (above the limit, accept fails
        // and backs off instead).
        let cap = connection_cap();
        let conn_limits = http::ConnLimits {
            max_connections: args.max_connections.map_or(cap, |n| n as usize),
            header_timeout: std::time::Duration::from_secs(args.header_timeout),
            body_timeout: std::time::Duration::from_secs(args.body_timeout),
            max_body_bytes: (args.max_body_mib as usize) << 20,
        };
        // The bounds in force, once: what an operator needs to read a refusal or a killed engine.
        eprintln!(
            "polystrata: {} requests at once, queue {}, switch wait {} s, ready timeout {} s, stall timeout {}, \
             {} connections, header timeout {} s, body timeout {} s, bodies up to {} MiB, idle unload {}",
            limits.parallel,
            limits.queue,
            args.switch_wait,
            args.ready_timeout,
            limits
                .stall
                .map_or("off".to_string(), |d| format!("{} s", d.as_secs())),
            conn_limits.max_connections,
            args.header_timeout,
            args.body_timeout,
            args.max_body_mib,
            limits
                .idle_unload
                .map_or("off".to_string(), |d| format!("{} s", d.as_secs()))
        );
        let supervisor = Arc::new(Supervisor::new(registry, limits));
        tokio::spawn(supervisor.clone().watch_idle());
        let addr = format!("{}:{}", args.host, args.port);
        let listener = match tokio::net::TcpListener::bind(&addr).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("polystrata: cannot listen on {addr}: {e}");
                return ExitCode::FAILURE;
            }
        };
        let port = listener.local_addr().map(|a| a.port()).unwrap_or(args.port);
        let bound = listener.local_addr().map(|a| a.to_string()).unwrap_or(addr);
        // The one line on stdout: scripts and tests read the address from it (port 0 picks a free one).
        println!("polystrata listening on http://{bound}");
        if let Some(name) = &args.load {
            if let Err(e) = supervisor.switch(name).await {
                eprintln!("polystrata: could not load {name}: {}", e.message());
            }
        }
        let state = Arc::new(http::AppState {
            supervisor: supervisor.clone(),
            access: http::access::Access {
                port,
                allowed_hosts: args
                    .allowed_hosts
                    .iter()
                    .map(|h| h.trim().to_ascii_lowercase())
                    .collect(),
                cors_origins: args
                    .cors_origins
                    .iter()
                    .map(|o| o.trim().trim_end_matches('/').to_ascii_lowercase())
                    .collect(),
                api_key: args.api_key.clone(),
            },
            limits: conn_limits,
            text_work: http::prepare::TextWork::for_this_machine(),
        });
        http::serve(listener, state, shutdown_signal()).await;
        eprintln!("polystrata: shutting down");
        supervisor.shutdown(std::time::Duration::from_secs(5)).await;
        ExitCode::SUCCESS
    })
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::ps_text;
    use serde_json::json;

    #[test]
    fn ps_says_the_memory_and_the_times() {
        let gpu = ps_text(&json!({"model": "qwen36", "loaded": true, "pid": 42,
            "rss_bytes": 300u64 << 20, "vram_bytes": 8123u64 << 20, "loaded_for_s": 725,
            "idle_for_s": 41, "unload_in_s": null}));
        let row = gpu.lines().nth(1).unwrap_or_default();
        assert!(gpu.starts_with("MODEL") && gpu.contains("VRAM"), "{gpu}");
        for part in [
            "qwen36", "42", "300 MiB", "8123 MiB", "12m05s", "41s", "never",
        ] {
            assert!(row.contains(part), "{part} missing: {gpu}");
        }
        // On the CPU the engine reports no VRAM.
        let cpu = ps_text(&json!({"model": "tiny", "loaded": true, "pid": 7,
            "rss_bytes": 20u64 << 20, "loaded_for_s": 3, "idle_for_s": 1, "unload_in_s": 90}));
        let row = cpu.lines().nth(1).unwrap_or_default();
        assert!(
            row.contains("20 MiB") && row.contains(" - ") && row.contains("1m30s"),
            "{cpu}"
        );
        assert!(ps_text(&json!({"model": "tiny", "loaded": false})).contains("not loaded"));
        assert!(ps_text(&json!({"model": null})).contains("nothing loaded"));
    }
}
