//! The terminal chat, `polystrata --model NAME`: a client of the HTTP API. If a server answers on the
//! port it is switched to the model; else one is started (the same binary's `serve`) and stopped when the
//! chat ends. Lines are read from stdin (so it works on a terminal, a pty or a pipe); answers stream as
//! they come, reasoning dimmed. Commands: `/model`, `/model list`, `/model switch NAME` (a new
//! conversation), `/model info [NAME]`, `/model unload`, `/new`, `/set max_tokens|temperature V`,
//! `/help`, `/quit` (or `/bye`). Ctrl-C stops an answer; twice at the prompt it quits (`interrupt`).
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
/model unload, /new (a new conversation), /set max_tokens N, /set temperature T, /help, /quit (or /bye); Ctrl-C stops an answer, twice at the prompt quits";

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
    /// Sampling fields sent with every request (`/set`).
    settings: serde_json::Map<String, Value>,
    color: bool,
}

impl Chat {
    fn command(&mut self, input: &str) -> Flow {
        let words: Vec<&str> = input.split_whitespace().collect();
        let result = match words.as_slice() {
            ["/quit"] | ["/exit"] | ["/q"] | ["/bye"] => return Flow::Quit,
            ["/help"] | ["/?"] => {
                println!("{HELP}");
                Ok(())
            }
            ["/new"] => {
                self.history.clear();
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

    /// Sends a user message and streams the answer.
    fn say(&mut self, text: &str) {
        self.history.push(json!({"role": "user", "content": text}));
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
                // The question stays unanswered: take it back so the next one is not sent twice.
                self.history.pop();
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
    fn an_ambiguous_or_unknown_name_is_refused_with_the_candidates() {
        let e = resolve(&models(), "qwen").unwrap_err();
        assert!(e.contains("qwen3-30b") && e.contains("qwen3.6-35b"), "{e}");
        let e = resolve(&models(), "llama").unwrap_err();
        assert!(e.contains("gemma3"), "{e}");
    }
}
