//! `setup`: installs a model family into the PolyStrata home (pinned, checksummed downloads; tokenizer
//! directory; run config; start script), lists the families, and says what this PC can run (`--check`).
//!
//! `./setup.sh` builds the binaries and calls `setup --family demo`; see README.md "Set up and run".
//! Environment: `POLY_SETUP_CACHE`, `POLY_SETUP_PYPI_URL` and `POLY_SETUP_HF_URL` locate the installer's cache and mirrors.

use clap::Parser;
use poly_setup::check::{self, Machine, Needs};
use poly_setup::families::{Family, FamilyTable, Size};
use poly_setup::fetch::Fetcher;
use poly_setup::install::{install, InstallOptions, Vision};
use poly_setup::sources::Hosts;
use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "setup",
    version,
    about = "PolyStrata installer: model families, checked downloads, what this PC can run"
)]
struct Args {
    /// Install this family (`--list` shows them).
    #[arg(long, conflicts_with_all = ["check", "list"])]
    family: Option<String>,
    /// The size (quantization) to install; default: the family's first, or its smallest on a PC with
    /// less RAM than the first wants.
    #[arg(long, value_name = "SIZE", requires = "family")]
    model: Option<String>,
    /// Take the size's files from this directory (checked by SHA-256 like downloads) instead of
    /// downloading them.
    #[arg(long, value_name = "DIR", requires = "family")]
    gguf_dir: Option<PathBuf>,
    /// Install the vision projector (yes, cpu or gpu: where it runs) or not.
    #[arg(long, value_enum, default_value = "no")]
    vision: Vision,
    /// Most tokens a conversation holds (default: the family's; asked when interactive).
    #[arg(long)]
    max_context: Option<u32>,
    /// MiB of RAM for kept conversations (0: one at a time; default 1024; asked when interactive).
    #[arg(long)]
    park_mib: Option<u64>,
    /// The port written into the run config and the start script.
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Take the defaults without asking.
    #[arg(long, short = 'y')]
    yes: bool,
    /// Say, for each known and installed model, how it would run on this PC (estimates).
    #[arg(long)]
    check: bool,
    /// VRAM of the card in MiB for --check (0: no GPU); default: nvidia-smi's figure.
    #[arg(long, value_name = "N")]
    vram_mib: Option<u64>,
    /// RAM in MiB for --check and the default size; default: what sysinfo reports.
    #[arg(long, value_name = "N")]
    ram_mib: Option<u64>,
    /// List the families and their sizes.
    #[arg(long)]
    list: bool,
    /// The installation home; else POLYSTRATA_HOME, else ~/.polystrata.
    #[arg(long)]
    home: Option<PathBuf>,
    /// Keep downloaded wheels here (else POLY_SETUP_CACHE, else <home>/cache, emptied after use).
    #[arg(long)]
    cache: Option<PathBuf>,
    /// Where poly-engine and polystrata are (default: beside this program).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Another family table (JSON, the shape of setup/src/families.json).
    #[arg(long, value_name = "FILE")]
    families: Option<PathBuf>,
    /// PyPI's base URL (else POLY_SETUP_PYPI_URL, else https://pypi.org).
    #[arg(long)]
    pypi_url: Option<String>,
    /// Hugging Face's base URL (else POLY_SETUP_HF_URL, else https://huggingface.co).
    #[arg(long)]
    hf_url: Option<String>,
    /// No progress lines.
    #[arg(long)]
    quiet: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("setup: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The home as the server resolves it: `--home`, else `POLYSTRATA_HOME`, else `~/.polystrata`.
fn resolve_home(flag: Option<&Path>) -> PathBuf {
    if let Some(dir) = flag {
        return dir.to_path_buf();
    }
    if let Some(dir) = std::env::var_os("POLYSTRATA_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
        .join(".polystrata")
}

fn run(args: Args) -> Result<(), String> {
    let table = match &args.families {
        Some(f) => FamilyTable::from_file(f)?,
        None => FamilyTable::builtin()?,
    };
    let home = resolve_home(args.home.as_deref());
    if args.list {
        print_list(&table);
        return Ok(());
    }
    if args.check {
        let machine = check::this_machine(args.vram_mib, args.ram_mib)?;
        print_check(&table, &home, &machine);
        return Ok(());
    }
    let Some(name) = args.family.as_deref() else {
        return Err("say --family NAME (see --list), --check or --list".into());
    };
    let family = table.family(name)?;
    if let Some(why) = &family.not_runnable {
        return Err(format!(
            "{} ({}) is not runnable yet: {why}",
            family.name, family.display
        ));
    }
    let interactive = !args.yes && std::io::stdin().is_terminal();
    let ram = match args.ram_mib {
        Some(m) => Some(m << 20),
        None => check::this_machine(Some(0), None).ok().map(|m| m.ram_bytes),
    };
    let size = match &args.model {
        Some(s) => family.size(s)?,
        None => {
            let default = family
                .default_size(ram)
                .ok_or_else(|| format!("family {} lists no sizes", family.name))?;
            if interactive && family.sizes.len() > 1 {
                ask_size(family, default)?
            } else {
                default
            }
        }
    };
    let max_context = match args.max_context {
        Some(c) => c,
        None if interactive => ask_number("Context length (tokens)", family.default_context)?,
        None => family.default_context,
    };
    let park_mib = match args.park_mib {
        Some(p) => p,
        None if interactive => {
            if ask_yes_no("Keep several conversations in RAM (1 GB for them)?", true)? {
                1024
            } else {
                0
            }
        }
        None => 1024,
    };
    let bin_dir = match &args.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()
            .ok()
            .and_then(|p| p.parent().map(Path::to_path_buf))
            .ok_or("cannot tell where setup is; pass --bin-dir")?,
    };
    let cache = args.cache.clone().or_else(|| {
        std::env::var_os("POLY_SETUP_CACHE")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    });
    let opts = InstallOptions {
        home: home.clone(),
        cache,
        gguf_dir: args.gguf_dir.clone(),
        max_context,
        park_mib,
        vision: args.vision,
        bin_dir,
        port: args.port,
    };
    let mut fetcher = Fetcher::new();
    fetcher.progress = !args.quiet;
    let hosts = Hosts::new(args.pypi_url.clone(), args.hf_url.clone());
    eprintln!(
        "setup: installing {} {} into {} (context {max_context}, {park_mib} MiB for kept conversations)",
        family.display,
        size.name,
        home.display()
    );
    let done = install(family, size, &opts, &fetcher, &hosts).map_err(|e| e.to_string())?;
    if let Some(notes) = &family.notes {
        eprintln!("setup: note: {notes}");
    }
    eprintln!("setup: model {}", done.model.display());
    eprintln!("setup: run config {}", done.config.display());
    eprintln!("setup: start it with {}", done.start_script.display());
    // The start script on stdout: scripts (setup.sh) read it from there.
    println!("{}", done.start_script.display());
    Ok(())
}

fn print_list(table: &FamilyTable) {
    for f in &table.families {
        let state = match &f.not_runnable {
            None => "runs".to_string(),
            Some(why) => format!("not runnable yet: {why}"),
        };
        println!("{}  {}  [{}]  {state}", f.name, f.display, f.arch);
        for s in &f.sizes {
            let bytes = s
                .model_bytes()
                .map(check::gb)
                .unwrap_or_else(|| "size unknown".into());
            println!("    {}  {bytes}", s.name);
        }
    }
}

/// What a table size needs, where its figures are known.
fn size_needs(size: &Size) -> Option<Needs> {
    Some(Needs {
        file_bytes: size.model_bytes()?,
        expert_bytes: size.expert_bytes?,
        vram_before_experts: size.vram_before_experts?,
    })
}

fn print_check(table: &FamilyTable, home: &Path, machine: &Machine) {
    println!(
        "this PC: {} RAM, {} (figures below are estimates)",
        check::gb(machine.ram_bytes),
        machine
            .vram_bytes
            .map(|v| format!("a card with {} VRAM", check::gb(v)))
            .unwrap_or_else(|| "no GPU".into())
    );
    for f in &table.families {
        if f.sizes.is_empty() {
            if let Some(why) = &f.not_runnable {
                println!("{}: not runnable yet: {why}", f.name);
            }
        }
        for s in &f.sizes {
            let name = format!("{} {}", f.name, s.name);
            match (&f.not_runnable, size_needs(s)) {
                (Some(why), _) => println!("{name}: not runnable yet: {why}"),
                (None, Some(needs)) => println!("{}", check::line(&name, &needs, machine)),
                (None, None) => println!("{name}: sizes not known in the table"),
            }
        }
    }
    for (name, path) in installed_models(home) {
        match gguf_needs(&path) {
            Ok(needs) => println!(
                "{}",
                check::line(&format!("installed {name}"), &needs, machine)
            ),
            Err(e) => println!("installed {name}: cannot read {}: {e}", path.display()),
        }
    }
}

/// The models of the home's run configs: (name, GGUF path).
fn installed_models(home: &Path) -> Vec<(String, PathBuf)> {
    let Ok(dir) = std::fs::read_dir(home) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in dir.flatten() {
        let file_name = entry.file_name().to_string_lossy().into_owned();
        let Some(stem) = file_name
            .strip_prefix("strata-")
            .and_then(|n| n.strip_suffix(".json"))
        else {
            continue;
        };
        let Ok(text) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        let Ok(config) = serde_json::from_str::<serde_json::Value>(&text) else {
            continue;
        };
        let name = config
            .get("model_name")
            .and_then(|v| v.as_str())
            .unwrap_or(stem)
            .to_string();
        let cwd = home.join(config.get("cwd").and_then(|v| v.as_str()).unwrap_or("."));
        let args: Vec<&str> = config
            .get("args")
            .and_then(|v| v.as_array())
            .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
            .unwrap_or_default();
        if let Some(at) = args.iter().position(|a| *a == "--model") {
            if let Some(model) = args.get(at + 1) {
                out.push((name, cwd.join(model)));
            }
        }
    }
    out.sort();
    out
}

/// What an installed GGUF needs, from its own tensors.
fn gguf_needs(path: &Path) -> Result<Needs, String> {
    let gguf = poly_models::GgufFile::open(path).map_err(|e| e.to_string())?;
    let s = poly_models::summary::ModelSummary::of(&gguf).map_err(|e| e.to_string())?;
    Ok(Needs::from_parts(
        s.file_bytes,
        s.expert_bytes,
        s.other_bytes,
    ))
}

fn read_answer(prompt: &str) -> Result<String, String> {
    eprint!("{prompt} ");
    let _ = std::io::stderr().flush();
    let mut line = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut line)
        .map_err(|e| format!("cannot read the answer: {e}"))?;
    Ok(line.trim().to_string())
}

fn ask_number(question: &str, default: u32) -> Result<u32, String> {
    loop {
        let answer = read_answer(&format!("{question} [{default}]:"))?;
        if answer.is_empty() {
            return Ok(default);
        }
        match answer.parse() {
            Ok(n) if n > 0 => return Ok(n),
            _ => eprintln!("a positive whole number, please"),
        }
    }
}

fn ask_yes_no(question: &str, default: bool) -> Result<bool, String> {
    let hint = if default { "Y/n" } else { "y/N" };
    loop {
        let answer = read_answer(&format!("{question} [{hint}]:"))?.to_lowercase();
        match answer.as_str() {
            "" => return Ok(default),
            "y" | "yes" => return Ok(true),
            "n" | "no" => return Ok(false),
            _ => eprintln!("yes or no, please"),
        }
    }
}

fn ask_size<'a>(family: &'a Family, default: &'a Size) -> Result<&'a Size, String> {
    eprintln!("Sizes of {}:", family.display);
    for (i, s) in family.sizes.iter().enumerate() {
        let bytes = s
            .model_bytes()
            .map(check::gb)
            .unwrap_or_else(|| "size unknown".into());
        eprintln!("  {}. {}  {bytes}", i + 1, s.name);
    }
    loop {
        let answer = read_answer(&format!("Which size [{}]:", default.name))?;
        if answer.is_empty() {
            return Ok(default);
        }
        if let Ok(i) = answer.parse::<usize>() {
            if let Some(s) = family.sizes.get(i.wrapping_sub(1)) {
                return Ok(s);
            }
        }
        if let Ok(s) = family.size(&answer) {
            return Ok(s);
        }
        eprintln!("a number from the list or a size name, please");
    }
}
