//! The terminal chat, `polystrata --model NAME`: a client of the HTTP API. If a server answers on the
//! port it is switched to the model; else one is started (the same binary's `serve`) and stopped when the
//! chat ends. Lines are read from stdin (so it works on a terminal, a pty or a pipe); answers stream as
//! they come, reasoning dimmed. Commands: `/model`, `/model list`, `/model switch NAME` (a new
//! conversation), `/model info [NAME]`, `/model unload`, `/new`, `/set max_tokens|temperature V`,
//! `/image PATH` (a local picture for the next message, for a model that reads pictures), `/help`,
//! `/quit` (or `/bye`). Ctrl-C stops an answer; twice at the prompt it quits (`interrupt`).
//! Part of a model's name is enough when only one name has it.

mod interrupt;
mod local_server;
mod render;

use crate::client::Client;
use interrupt::Interrupts;
use local_server::LocalServer;
use render::AnswerPrinter;
use serde_json::{json, Value};
use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

/// What `polystrata --model NAME` was given.
pub struct ChatOptions {
    pub model: String,
    /// `--home` as given (the server the chat starts is given it too).
    pub home: Option<PathBuf>,
    /// The home read: `--home`, else `POLYSTRATA_HOME`, else the remembered one, else the default.
    pub resolved_home: PathBuf,
    pub port: u16,
}

const HELP: &str =
    "commands: /model (the model in use), /model list, /model switch NAME, /model info [NAME], \
/model unload, /new (a new conversation), /set max_tokens N, /set temperature T, /image PATH (a picture \
for the next message; /image alone lists them, /image clear drops them), /help, /quit (or /bye); Ctrl-C \
stops an answer, twice at the prompt quits";

/// The largest picture `/image` attaches: its base64 (4/3 of it) goes in every request of the
/// conversation, whose body the server takes up to 8 MiB by default (`--max-body-mib`).
const MAX_PICTURE_BYTES: u64 = 5 << 20;

/// Runs the chat until `/quit` or the end of stdin.
pub fn run(opts: ChatOptions) -> ExitCode {
    let api_key = std::env::var("POLYSTRATA_API_KEY")
        .ok()
        .filter(|k| !k.is_empty());
    let client = Client::new(format!("127.0.0.1:{}", opts.port), api_key);
    let server = if client.is_running() {
        println!("using the server on port {}", opts.port);
        None
    } else {
        // A name the home does not have stops here, naming the home, before a server is started for it.
        if let Err(e) = model_in_home(&opts.resolved_home, &opts.model) {
            eprintln!("polystrata: {e}");
            return ExitCode::FAILURE;
        }
        println!("starting a server on port {} ...", opts.port);
        match LocalServer::start(opts.home.as_deref(), opts.port) {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("polystrata: {e}");
                return ExitCode::FAILURE;
            }
        }
    };
    let interrupts = Interrupts::install(client.clone());
    if let (Some(i), Some(s)) = (&interrupts, &server) {
        i.set_server_pid(s.pid());
    }
    let mut chat = Chat {
        interrupts,
        client,
        model: None,
        history: Vec::new(),
        pictures: Vec::new(),
        settings: serde_json::Map::new(),
        color: std::io::stdout().is_terminal(),
    };
    if let Err(e) = chat.switch(&opts.model) {
        eprintln!("polystrata: {e}");
        return ExitCode::FAILURE;
    }
    println!("{HELP}");
    let stdin = std::io::stdin();
    let mut line = String::new();
    loop {
        print!("{}> ", chat.model.as_deref().unwrap_or("(no model)"));
        let _ = std::io::stdout().flush();
        line.clear();
        match stdin.lock().read_line(&mut line) {
            Ok(0) | Err(_) => {
                println!();
                break;
            }
            Ok(_) => {}
        }
        if let Some(i) = &chat.interrupts {
            i.disarm();
        }
        let input = line.trim();
        if input.is_empty() {
            continue;
        }
        if input.starts_with('/') {
            match chat.command(input) {
                Flow::Quit => break,
                Flow::Continue => {}
            }
        } else {
            chat.say(input);
        }
    }
    if server.is_some() {
        println!("stopping the server");
    }
    // Dropping the server the chat started stops it (and its engine).
    drop(server);
    ExitCode::SUCCESS
}

enum Flow {
    Continue,
    Quit,
}

struct Chat {
    /// Ctrl-C's handler (`None` where SIGINT could not be taken).
    interrupts: Option<Arc<Interrupts>>,
    client: Client,
    /// The chat's model; requests name it, so a server unloaded in between loads it again.
    model: Option<String>,
    history: Vec<Value>,
    /// Pictures attached for the next message (`/image`): the path as given and its data URL.
    pictures: Vec<(String, String)>,
    /// Sampling fields sent with every request (`/set`).
    settings: serde_json::Map<String, Value>,
    color: bool,
}

impl Chat {
    fn command(&mut self, input: &str) -> Flow {
        let words: Vec<&str> = input.split_whitespace().collect();
        // A path may hold spaces: everything after `/image `.
        if let Some(rest) = input.strip_prefix("/image") {
            if rest.is_empty() || rest.starts_with(char::is_whitespace) {
                if let Err(e) = self.image(rest.trim()) {
                    println!("error: {e}");
                }
                return Flow::Continue;
            }
        }
        let result = match words.as_slice() {
            ["/quit"] | ["/exit"] | ["/q"] | ["/bye"] => return Flow::Quit,
            ["/help"] | ["/?"] => {
                println!("{HELP}");
                Ok(())
            }
            ["/new"] => {
                self.history.clear();
                self.pictures.clear();
                println!("a new conversation");
                Ok(())
            }
            ["/model"] => self.show_current(),
            ["/model", "list"] => self.list(),
            ["/model", "switch", name] => self.switch(name),
            ["/model", "info"] => match self.model.clone() {
                Some(m) => self.info(&m),
                None => Err("no model in use; say /model info NAME".into()),
            },
            ["/model", "info", name] => self.info(name),
            ["/model", "unload"] => self.unload(),
            ["/set", key, value] => self.set(key, value),
            _ => Err(format!("unknown command {input:?}; {HELP}")),
        };
        if let Err(e) = result {
            println!("error: {e}");
        }
        Flow::Continue
    }

    fn models(&self) -> Result<(Vec<Value>, Option<String>), String> {
        let r = self.client.models().map_err(|e| e.to_string())?;
        let models = r["models"].as_array().cloned().unwrap_or_default();
        Ok((models, r["current"].as_str().map(str::to_string)))
    }

    fn show_current(&self) -> Result<(), String> {
        let current = &self.client.current().map_err(|e| e.to_string())?;
        match current["model"].as_str() {
            Some(id) => {
                let state = if current["loaded"].as_bool() == Some(true) {
                    "loaded"
                } else {
                    "unloaded"
                };
                let name = current["entry"]["display_name"].as_str().unwrap_or(id);
                println!("model {id} ({name}), {state}");
            }
            None => println!("no model loaded"),
        }
        Ok(())
    }

    fn list(&self) -> Result<(), String> {
        let (models, current) = self.models()?;
        if models.is_empty() {
            println!("no models installed");
        }
        for m in &models {
            let id = m["id"].as_str().unwrap_or("?");
            let mark = if current.as_deref() == Some(id) {
                "*"
            } else {
                " "
            };
            let field = |k: &str| match &m[k] {
                Value::Null => "-".to_string(),
                Value::String(s) => s.clone(),
                v => v.to_string(),
            };
            println!(
                "{mark} {id}  {}  [{}]  {} {} {}{}",
                field("display_name"),
                field("status"),
                field("backend"),
                field("quantization"),
                field("params_total"),
                m["problem"]
                    .as_str()
                    .map(|p| format!("  ({p})"))
                    .unwrap_or_default()
            );
        }
        Ok(())
    }

    fn info(&self, name: &str) -> Result<(), String> {
        let (models, _) = self.models()?;
        let id = resolve(&models, name)?;
        let Some(Value::Object(entry)) = models.iter().find(|m| m["id"] == id.as_str()) else {
            return Err(format!("no model {id}"));
        };
        for (key, value) in entry {
            let shown = match value {
                Value::String(s) => s.clone(),
                Value::Null => "-".into(),
                v => v.to_string(),
            };
            println!("  {key}: {shown}");
        }
        Ok(())
    }

    /// Loads the model `name` names and starts a new conversation with it.
    fn switch(&mut self, name: &str) -> Result<(), String> {
        let r = self.client.models().map_err(|e| e.to_string())?;
        let models = r["models"].as_array().cloned().unwrap_or_default();
        let id = resolve(&models, name).map_err(|e| match r["home"].as_str() {
            // The server's home, which is not the chat's own when it was started with another.
            Some(home) => format!("{e}; the server reads home {home}"),
            None => e,
        })?;
        println!("loading {id} ...");
        let started = Instant::now();
        if let Err(e) = self.client.load(&id) {
            return Err(format!("could not load {id}: {e}"));
        }
        println!(
            "{id} loaded in {:.1} s; a new conversation",
            started.elapsed().as_secs_f64()
        );
        self.model = Some(id);
        self.history.clear();
        self.pictures.clear();
        Ok(())
    }

    fn unload(&mut self) -> Result<(), String> {
        self.client.unload().map_err(|e| e.to_string())?;
        println!(
            "unloaded {} (the next message loads it again)",
            self.model.as_deref().unwrap_or("the model")
        );
        Ok(())
    }

    fn set(&mut self, key: &str, value: &str) -> Result<(), String> {
        let parsed = match key {
            "max_tokens" => value.parse::<u64>().map(|v| json!(v)).ok(),
            "temperature" | "top_p" => value.parse::<f64>().map(|v| json!(v)).ok(),
            "seed" => value.parse::<i64>().map(|v| json!(v)).ok(),
            _ => {
                return Err(format!(
                    "cannot set {key}; max_tokens, temperature, top_p or seed"
                ))
            }
        };
        let Some(v) = parsed else {
            return Err(format!("{value:?} is not a value for {key}"));
        };
        self.settings.insert(key.to_string(), v);
        println!("{key} = {value}");
        Ok(())
    }

    /// `/image PATH`: the picture at PATH (the user's own file, read here) goes with the next message;
    /// `/image` lists the pictures waiting, `/image clear` drops them.
    fn image(&mut self, arg: &str) -> Result<(), String> {
        match arg {
            "" => {
                if self.pictures.is_empty() {
                    println!("no pictures attached; /image PATH attaches one to the next message");
                }
                for (path, _) in &self.pictures {
                    println!("  {path}");
                }
                return Ok(());
            }
            "clear" => {
                self.pictures.clear();
                println!("no pictures attached");
                return Ok(());
            }
            _ => {}
        }
        let model = self
            .model
            .clone()
            .ok_or("no model in use; /model switch NAME first")?;
        let (models, _) = self.models()?;
        let reads = models
            .iter()
            .find(|m| m["id"] == model.as_str())
            .is_some_and(|m| m["multimodal"].as_bool() == Some(true));
        if !reads {
            return Err(format!(
                "{model} reads no pictures (its run config names no projector, `mmproj`)"
            ));
        }
        let url = picture_data_url(&picture_path(arg))?;
        self.pictures.push((arg.to_string(), url));
        println!(
            "attached {arg}; {} picture(s) go with your next message",
            self.pictures.len()
        );
        Ok(())
    }

    /// Sends a user message and streams the answer.
    fn say(&mut self, text: &str) {
        let pictures = std::mem::take(&mut self.pictures);
        let content = if pictures.is_empty() {
            json!(text)
        } else {
            let mut parts: Vec<Value> = pictures
                .iter()
                .map(|(_, url)| json!({"type": "image_url", "image_url": {"url": url}}))
                .collect();
            parts.push(json!({"type": "text", "text": text}));
            Value::Array(parts)
        };
        self.history
            .push(json!({"role": "user", "content": content}));
        let mut body = json!({
            "model": self.model,
            "messages": self.history,
        });
        if let Value::Object(o) = &mut body {
            o.extend(self.settings.clone());
        }
        let (content, result) = self.stream_answer(body);
        let stopped = self.interrupts.as_ref().is_some_and(|i| i.take_stopped());
        match result {
            Ok(()) => self
                .history
                .push(json!({"role": "assistant", "content": content})),
            // Stopped by Ctrl-C: what was shown stays the answer, as llama-cli keeps it.
            Err(_) if stopped => {
                println!("(stopped)");
                self.history
                    .push(json!({"role": "assistant", "content": content}));
            }
            Err(e) => {
                // The question stays unanswered: take it back so the next one is not sent twice (its
                // pictures wait for the next message again).
                self.history.pop();
                self.pictures = pictures;
                println!("error: {e}");
            }
        }
    }

    /// The answer's text as shown, and whether it ended well.
    fn stream_answer(&self, body: Value) -> (String, Result<(), String>) {
        let mut printer = AnswerPrinter::new(std::io::stdout(), self.color);
        let result = self.client.chat_stream(body, |d| printer.show(&d));
        let (_, content) = printer.finish();
        (content, result.map_err(|e| e.to_string()))
    }
}

/// The path `/image` was given, as a shell would read it: quotes around it (a file dragged into a
/// terminal comes quoted) and backslashes before spaces dropped, `~/…` under `$HOME`; relative to the
/// chat's working directory.
fn picture_path(arg: &str) -> PathBuf {
    let quoted = arg.len() >= 2
        && ((arg.starts_with('\'') && arg.ends_with('\''))
            || (arg.starts_with('"') && arg.ends_with('"')));
    let path = if quoted {
        arg[1..arg.len() - 1].to_string()
    } else {
        arg.replace("\\ ", " ")
    };
    expand_home(&path)
}

/// `~/…` under `$HOME`; any other path as given.
fn expand_home(path: &str) -> PathBuf {
    match (path.strip_prefix("~/"), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => PathBuf::from(path),
    }
}

/// The picture file at `path` as a `data:` URL: a regular file of at most [`MAX_PICTURE_BYTES`] whose
/// bytes are a PNG, JPEG or WebP; else why not.
fn picture_data_url(path: &std::path::Path) -> Result<String, String> {
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| format!("{shown}: {e}"))?;
    if meta.is_dir() {
        return Err(format!("{shown} is a directory, not a picture"));
    }
    if !meta.is_file() {
        return Err(format!("{shown} is not a regular file"));
    }
    if meta.len() > MAX_PICTURE_BYTES {
        return Err(format!(
            "{shown} is {:.1} MB; pictures up to {} MB are sent (the server takes request bodies up to \
             8 MiB unless started with --max-body-mib)",
            meta.len() as f64 / f64::from(1 << 20),
            MAX_PICTURE_BYTES >> 20
        ));
    }
    let bytes = std::fs::read(path).map_err(|e| format!("{shown}: {e}"))?;
    let mime = if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        "image/png"
    } else if bytes.starts_with(&[0xff, 0xd8, 0xff]) {
        "image/jpeg"
    } else if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        "image/webp"
    } else {
        return Err(format!("{shown} is not a PNG, JPEG or WebP picture"));
    };
    Ok(format!(
        "data:{mime};base64,{}",
        poly_protocol::encode_base64(&bytes)
    ))
}

/// Whether the home has a model `name` stands for (as [`resolve`] reads names), else why not, naming
/// the home and where it came from.
fn model_in_home(home: &std::path::Path, name: &str) -> Result<String, String> {
    let models: Vec<Value> = crate::registry::Registry::new(home.to_path_buf())
        .scan()
        .iter()
        .filter_map(|m| serde_json::to_value(m).ok())
        .collect();
    resolve(&models, name).map_err(|e| format!("{e}; {}", crate::home::home_read_note(home)))
}

/// The id `name` stands for: an id or alias exactly, else the one model whose id or display name contains
/// it (ignoring case).
fn resolve(models: &[Value], name: &str) -> Result<String, String> {
    let id_of = |m: &Value| m["id"].as_str().unwrap_or_default().to_string();
    if let Some(m) = models.iter().find(|m| {
        m["id"] == name
            || m["aliases"]
                .as_array()
                .is_some_and(|a| a.iter().any(|x| x == name))
    }) {
        return Ok(id_of(m));
    }
    let needle = name.to_lowercase();
    let matches: Vec<String> = models
        .iter()
        .filter(|m| {
            ["id", "display_name"].iter().any(|k| {
                m[*k]
                    .as_str()
                    .is_some_and(|s| s.to_lowercase().contains(&needle))
            })
        })
        .map(id_of)
        .collect();
    match matches.as_slice() {
        [one] => Ok(one.clone()),
        [] if models.is_empty() => Err(format!("no model is called {name:?}; installed: none")),
        [] => Err(format!(
            "no model is called {name:?}; installed: {}",
            models.iter().map(id_of).collect::<Vec<_>>().join(", ")
        )),
        many => Err(format!(
            "{name:?} could be any of {}; say more of the name",
            many.join(", ")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn models() -> Vec<Value> {
        vec![
            json!({"id": "qwen3-30b", "display_name": "Qwen3 30B", "aliases": ["q"]}),
            json!({"id": "qwen3.6-35b", "display_name": "Qwen3.6 35B"}),
            json!({"id": "gemma3", "display_name": "Gemma 3 270M"}),
        ]
    }

    #[test]
    fn part_of_a_name_is_enough_when_only_one_has_it() {
        assert_eq!(resolve(&models(), "gem").unwrap(), "gemma3");
        assert_eq!(resolve(&models(), "270M").unwrap(), "gemma3");
        assert_eq!(resolve(&models(), "3.6").unwrap(), "qwen3.6-35b");
        assert_eq!(resolve(&models(), "q").unwrap(), "qwen3-30b");
    }

    #[test]
    fn image_reads_pictures_and_refuses_directories_huge_files_and_other_bytes() {
        let dir =
            std::env::temp_dir().join(format!("polystrata-chat-image-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let png = dir.join("a b.png");
        let bytes = b"\x89PNG\r\n\x1a\nrest of it";
        std::fs::write(&png, bytes).unwrap();
        let url = picture_data_url(&png).unwrap();
        let shown = png.display().to_string();
        for typed in [
            format!("'{shown}'"),
            format!("\"{shown}\""),
            shown.replace(' ', "\\ "),
            shown.clone(),
        ] {
            assert_eq!(picture_path(&typed), png, "{typed}");
        }
        assert_eq!(
            url,
            format!(
                "data:image/png;base64,{}",
                poly_protocol::encode_base64(bytes)
            )
        );
        let e = picture_data_url(&dir).unwrap_err();
        assert!(e.contains("is a directory"), "{e}");
        let text = dir.join("notes.txt");
        std::fs::write(&text, "hello").unwrap();
        let e = picture_data_url(&text).unwrap_err();
        assert!(e.contains("not a PNG, JPEG or WebP"), "{e}");
        // A sparse file past the limit: refused from its size, not read.
        let huge = dir.join("huge.jpg");
        let f = std::fs::File::create(&huge).unwrap();
        f.set_len(MAX_PICTURE_BYTES + 1).unwrap();
        let e = picture_data_url(&huge).unwrap_err();
        assert!(e.contains("up to 5 MB"), "{e}");
        let e = picture_data_url(&dir.join("missing.png")).unwrap_err();
        assert!(e.contains("missing.png"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_ambiguous_or_unknown_name_is_refused_with_the_candidates() {
        let e = resolve(&models(), "qwen").unwrap_err();
        assert!(e.contains("qwen3-30b") && e.contains("qwen3.6-35b"), "{e}");
        let e = resolve(&models(), "llama").unwrap_err();
        assert!(e.contains("gemma3"), "{e}");
    }
}
