//! `poly-engine inspect` and `poly-engine dump`, driven as a user runs them: the real binary on a file
//! written with the GGUF writer.

use poly_kernels::quant::{dequantize, fill_random, GgmlType};
use poly_kernels::rng::Rng;
use poly_models::gguf::{GgufWriter, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

const ENGINE: &str = env!("CARGO_BIN_EXE_poly-engine");

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("poly-engine-tools-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `poly-engine run --cpu --json --top 40 --batch-invariant` of fixture `model` on `prompt` (token ids)
/// for `max_tokens`, with `extra` flags and following `follow` when given; its steps written to
/// `dir/out`, whose path it returns.
fn run_json(
    dir: &Path,
    (model, prompt, max_tokens): (&str, &str, &str),
    extra: &[&str],
    follow: Option<&Path>,
    out: &str,
) -> PathBuf {
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models");
    let mut c = Command::new(ENGINE);
    c.args(["run", "--cpu", "--json", "--top", "40", "--batch-invariant"])
        .args(["--prompt-tokens", prompt, "--max-tokens", max_tokens])
        .args(extra)
        .arg("--model")
        .arg(fixtures.join(model));
    if let Some(f) = follow {
        c.arg("--follow").arg(f);
    }
    let o = c.output().expect("run");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let path = dir.join(out);
    std::fs::write(&path, &o.stdout).unwrap();
    path
}

/// `poly-engine kl a b extra`: whether it succeeded, and its JSON (null when it printed none).
fn kl_json(a: &Path, b: &Path, extra: &[&str]) -> (bool, serde_json::Value) {
    let o = Command::new(ENGINE)
        .arg("kl")
        .arg(a)
        .arg(b)
        .args(extra)
        .output()
        .expect("kl");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
    (o.status.success(), v)
}

/// A small MoE-shaped file: routed experts in Q4_K, attention in Q8_0, a norm in F32.
fn write_model(path: &Path) -> Vec<Vec<u8>> {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", Value::from("qwen3moe"));
    w.add_kv("general.name", Value::from("tools test"));
    w.add_kv("general.size_label", Value::from("1M-A1M"));
    w.add_kv("qwen3moe.block_count", Value::from(1u32));
    w.add_kv("qwen3moe.expert_count", Value::from(4u32));
    w.add_kv("qwen3moe.expert_used_count", Value::from(2u32));
    let tensors: [(&str, GgmlType, Vec<u64>); 3] = [
        ("blk.0.attn_norm.weight", GgmlType::F32, vec![256]),
        ("blk.0.attn_q.weight", GgmlType::Q8_0, vec![256, 64]),
        ("blk.0.ffn_up_exps.weight", GgmlType::Q4_K, vec![256, 32, 4]),
    ];
    let mut rng = Rng::new(5);
    let mut datas = Vec::new();
    for (name, ty, dims) in &tensors {
        w.add_tensor(*name, *ty, dims).unwrap();
        let n: u64 = dims.iter().product();
        let mut data = vec![0u8; ty.bytes_for(n).unwrap() as usize];
        fill_random(*ty, &mut rng, 0.5, &mut data).unwrap();
        datas.push(data);
    }
    w.write_to_path(path, |i, _info, out: &mut [u8]| {
        out.copy_from_slice(&datas[i]);
        Ok(())
    })
    .unwrap();
    datas
}

#[test]
fn inspect_reports_architecture_types_and_expert_bytes() {
    let dir = temp_dir("inspect");
    let path = dir.join("m.gguf");
    let datas = write_model(&path);
    let out = Command::new(ENGINE)
        .args(["inspect", "--json"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["architecture"], "qwen3moe");
    assert_eq!(v["name"], "tools test");
    assert_eq!(v["size_label"], "1M-A1M");
    assert_eq!(v["tensor_count"], 3);
    assert_eq!(v["expert_count"], 4);
    assert_eq!(v["expert_used_count"], 2);
    assert_eq!(v["expert_type"], "Q4_K");
    assert_eq!(v["expert_bytes"], datas[2].len() as u64);
    assert_eq!(v["other_bytes"], (datas[0].len() + datas[1].len()) as u64);
    assert_eq!(v["types"]["Q8_0"]["tensors"], 1);
    assert_eq!(v["file_bytes"], std::fs::metadata(&path).unwrap().len());

    let text = Command::new(ENGINE)
        .arg("inspect")
        .arg(&path)
        .output()
        .unwrap();
    assert!(text.status.success());
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(text.contains("architecture  qwen3moe"), "{text}");
    assert!(
        text.contains("4 routed per layer, 2 used per token, mostly Q4_K"),
        "{text}"
    );
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn dump_writes_dequantized_f32_in_gguf_order() {
    let dir = temp_dir("dump");
    let path = dir.join("m.gguf");
    let datas = write_model(&path);
    let out_path = dir.join("up.f32");
    let st = Command::new(ENGINE)
        .arg("dump")
        .arg(&path)
        .arg("blk.0.ffn_up_exps.weight")
        .arg(&out_path)
        .status()
        .unwrap();
    assert!(st.success());
    let bytes = std::fs::read(&out_path).unwrap();
    let mut expected = vec![0f32; 256 * 32 * 4];
    dequantize(GgmlType::Q4_K, &datas[2], &mut expected).unwrap();
    let got: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(got, expected);

    let missing = Command::new(ENGINE)
        .arg("dump")
        .arg(&path)
        .arg("nope")
        .arg(&out_path)
        .output()
        .unwrap();
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no tensor named \"nope\""));
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn inspect_refuses_a_file_that_is_not_gguf() {
    let dir = temp_dir("bad");
    let path = dir.join("bad.gguf");
    std::fs::write(&path, b"not a model at all, just text").unwrap();
    let out = Command::new(ENGINE)
        .arg("inspect")
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.gguf"), "error names the file: {err}");
    std::fs::remove_dir_all(dir).ok();
}

/// `poly-engine run --follow` writes a reference answer again; `poly-engine kl` measures how far another
/// configuration's distributions are from the reference's on those tokens (issue 23): zero against
/// itself, more than zero for the other quantization of the same model, and a non-zero exit when asked
/// for a bound it misses.
#[test]
fn a_followed_answer_is_compared_step_by_step() {
    let dir = temp_dir("kl");
    let run = |model: &str, follow: Option<&Path>, out: &str| {
        run_json(&dir, (model, "1,5,9,200,31,7", "12"), &[], follow, out)
    };
    let kl = kl_json;
    let reference = run("qwen3moe-tiny-q4km.gguf", None, "ref.jsonl");
    let again = run("qwen3moe-tiny-q4km.gguf", Some(&reference), "again.jsonl");
    let (ok, same) = kl(&reference, &again, &[]);
    assert!(ok, "{same}");
    assert_eq!(same["mean_kl"].as_f64(), Some(0.0), "{same}");
    assert_eq!(same["same_top"].as_f64(), Some(1.0), "{same}");
    let other = run("qwen3moe-tiny-q4k-q8.gguf", Some(&reference), "q8.jsonl");
    let (ok, v) = kl(&reference, &other, &[]);
    assert!(ok, "{v}");
    let mean = v["mean_kl"].as_f64().unwrap();
    assert!(mean > 0.0 && v["max_kl"].as_f64().unwrap() >= mean, "{v}");
    let (ok, _) = kl(&reference, &other, &["--max-mean-kl", "0"]);
    assert!(!ok, "a bound the run misses fails");
    // A run that did not follow the reference is refused.
    let free = run("qwen3moe-tiny-q4k-q8.gguf", None, "free.jsonl");
    let differs =
        std::fs::read_to_string(&free).unwrap() != std::fs::read_to_string(&other).unwrap();
    if differs {
        assert!(!kl(&reference, &free, &[]).0);
    }
}

/// `--kv q8_0` (issue 23): on the CPU the answer stays near the f16 cache's, step by step on the same
/// tokens (`run --follow`, `kl`: bounded mean KL and same-top share on a dense model with a sliding
/// window and on a MoE one); `--kv f16` is the default; on a card it is refused at load with the reason.
#[test]
fn q8_0_caches_answer_near_f16_ones_and_are_refused_on_a_card() {
    let dir = temp_dir("kv-q8");
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models");
    let prompt: Vec<String> = (0..80).map(|i| (100 + i * 23 % 1800).to_string()).collect();
    let prompt = prompt.join(",");
    let run = |model: &str, extra: &[&str], follow: Option<&Path>, out: &str| {
        run_json(&dir, (model, &prompt, "40"), extra, follow, out)
    };
    let kl = |a: &Path, b: &Path| {
        let (ok, v) = kl_json(a, b, &[]);
        assert!(ok, "{v}");
        v
    };
    for model in ["gemma3-tiny-q4km.gguf", "qwen3moe-tiny-q4km.gguf"] {
        let reference = run(model, &[], None, "f16.jsonl");
        let f16 = run(model, &["--kv", "f16"], Some(&reference), "f16-again.jsonl");
        assert_eq!(
            kl(&reference, &f16)["mean_kl"].as_f64(),
            Some(0.0),
            "{model}"
        );
        let q8 = run(model, &["--kv", "q8_0"], Some(&reference), "q8.jsonl");
        let v = kl(&reference, &q8);
        eprintln!("{model}: --kv q8_0 against f16: {v}");
        let (mean, same) = (
            v["mean_kl"].as_f64().unwrap(),
            v["same_top"].as_f64().unwrap(),
        );
        assert!(mean > 0.0 && mean < 0.02, "{model}: {v}");
        assert!(same >= 0.8, "{model}: {v}");
    }
    // On a card: refused before anything loads there (so on any machine, with or without one).
    let model = fixtures.join("llama-tiny-q4km.gguf");
    let o = Command::new(ENGINE)
        .args([
            "run",
            "--gpu",
            "0",
            "--kv",
            "q8_0",
            "--prompt-tokens",
            "1,2",
        ])
        .arg("--model")
        .arg(&model)
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("q8_0 attention caches run on the CPU only for now"),
        "{err}"
    );
    let o = Command::new(ENGINE)
        .args(["--gpu", "0", "--kv", "q8_0", "--model"])
        .arg(&model)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("serve");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(!o.status.success(), "{out}");
    assert!(
        out.starts_with("ERR") && out.contains("q8_0 attention caches run on the CPU only for now"),
        "{out}"
    );
    std::fs::remove_dir_all(dir).ok();
}

/// `synth` writes a tiny `glm5-next` file (GLM 5.3 Flash's layout), and `run --cpu` writes tokens from
/// it (issue 19).
#[test]
fn a_glm5_next_file_is_written_and_run_on_the_cpu() {
    let dir = temp_dir("glm5");
    let path = dir.join("glm5-next-tiny.gguf");
    let synth = Command::new(ENGINE)
        .args([
            "synth",
            "--arch",
            "glm5-next",
            "--shape",
            "tiny",
            "--seed",
            "1",
        ])
        .arg("--out")
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        synth.status.success(),
        "{}",
        String::from_utf8_lossy(&synth.stderr)
    );
    let run = Command::new(ENGINE)
        .args([
            "run",
            "--cpu",
            "--prompt-tokens",
            "1,2,3",
            "--max-tokens",
            "3",
            "--model",
        ])
        .arg(&path)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    // One line per written token: "   0 token   1272 p 0.2012  top ...".
    let written = out.lines().filter(|l| l.contains(" token ")).count();
    assert_eq!(written, 3, "{out}");
    std::fs::remove_dir_all(dir).ok();
}

/// `poly-engine synth --arch qwen3vl-mmproj` and `poly-engine encode-image`: the tiny projector written,
/// the committed test picture encoded to 4×3 rows of 256, and the rows written with `--out` the ones
/// llama.cpp's mtmd wrote for the same file (tests/tests/vision_witness.rs has the bounds' reasons).
#[test]
fn a_projector_is_synthesized_and_a_picture_encoded_to_mtmds_rows() {
    let dir = temp_dir("vision");
    let vision = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vision");
    let mmproj = dir.join("mmproj.gguf");
    let o = Command::new(ENGINE)
        .args(["synth", "--arch", "qwen3vl-mmproj", "--shape", "tiny"])
        .args(["--type", "F32", "--seed", "1", "--out"])
        .arg(&mmproj)
        .output()
        .expect("synth");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rows_path = dir.join("rows.bin");
    let o = Command::new(ENGINE)
        .arg("encode-image")
        .arg("--mmproj")
        .arg(&mmproj)
        .arg("--image")
        .arg(vision.join("picture-64x48.png"))
        .arg("--out")
        .arg(&rows_path)
        .output()
        .expect("encode-image");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let report: serde_json::Value =
        serde_json::from_slice(&o.stdout).expect("encode-image prints JSON");
    assert_eq!(report["resized"], serde_json::json!([128, 96]));
    assert_eq!(report["grid"], serde_json::json!([4, 3]));
    assert_eq!(report["rows"], 12);
    assert_eq!(report["width"], 256);
    let floats = |p: &Path| -> Vec<f64> {
        std::fs::read(p)
            .expect("rows")
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)
            .collect()
    };
    let ours = floats(&rows_path);
    let theirs = floats(&vision.join("qwen3vl-tiny-f32.rows.bin"));
    assert_eq!(ours.len(), 12 * 256);
    assert_eq!(ours.len(), theirs.len());
    let diff: f64 = ours.iter().zip(&theirs).map(|(a, b)| (a - b).powi(2)).sum();
    let norm: f64 = theirs.iter().map(|b| b * b).sum();
    assert!((diff / norm).sqrt() < 2e-4, "{}", (diff / norm).sqrt());
    // A file that is not a projector is refused with the reason.
    let o = Command::new(ENGINE)
        .arg("encode-image")
        .arg("--mmproj")
        .arg(vision.join("picture-64x48.png"))
        .arg("--image")
        .arg(vision.join("picture-64x48.png"))
        .output()
        .expect("encode-image");
    assert!(!o.status.success());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `poly-engine synth --arch gemma4v-mmproj` and `poly-engine encode-image` on Gemma 4's projector: by
/// default the picture is taken to Gemma 4's 70 rows at least (480×384, 10×8 pooled rows); with
/// `--min-tokens 8` the rows are the ones llama.cpp's mtmd wrote for the same file
/// (tests/tests/gemma4v_witness.rs has the bounds' reasons).
#[test]
fn a_gemma4_projector_is_synthesized_and_a_picture_encoded_to_mtmds_rows() {
    let dir = temp_dir("vision-gemma4v");
    let vision = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vision");
    let mmproj = dir.join("mmproj.gguf");
    let o = Command::new(ENGINE)
        .args(["synth", "--arch", "gemma4v-mmproj", "--shape", "tiny"])
        .args(["--type", "F32", "--seed", "1", "--out"])
        .arg(&mmproj)
        .output()
        .expect("synth");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let encode = |extra: &[&str], out: &Path| -> serde_json::Value {
        let o = Command::new(ENGINE)
            .arg("encode-image")
            .arg("--mmproj")
            .arg(&mmproj)
            .arg("--image")
            .arg(vision.join("picture-64x48.png"))
            .args(extra)
            .arg("--out")
            .arg(out)
            .output()
            .expect("encode-image");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).expect("encode-image prints JSON")
    };
    let rows_path = dir.join("rows.bin");
    let report = encode(&[], &rows_path);
    assert_eq!(report["resized"], serde_json::json!([480, 384]));
    assert_eq!(report["grid"], serde_json::json!([10, 8]));
    let report = encode(&["--min-tokens", "8"], &rows_path);
    assert_eq!(report["resized"], serde_json::json!([192, 144]));
    assert_eq!(report["grid"], serde_json::json!([4, 3]));
    assert_eq!(report["width"], 256);
    let floats = |p: &Path| -> Vec<f64> {
        std::fs::read(p)
            .expect("rows")
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)
            .collect()
    };
    let ours = floats(&rows_path);
    let theirs = floats(&vision.join("gemma4v-tiny-f32.rows.bin"));
    assert_eq!(ours.len(), 12 * 256);
    assert_eq!(ours.len(), theirs.len());
    let diff: f64 = ours.iter().zip(&theirs).map(|(a, b)| (a - b).powi(2)).sum();
    let norm: f64 = theirs.iter().map(|b| b * b).sum();
    assert!((diff / norm).sqrt() < 1e-4, "{}", (diff / norm).sqrt());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `poly-engine run --image --mmproj --image-at` as a user runs it: the tiny qwen35moe and projector
/// written by `synth` (F32, seed 1), the committed picture read before prompt token 5. The first step's
/// likeliest token and its probability are llama.cpp's for the same prompt (the last row of the reference
/// `tests/tests/picture_witness.rs` compares, flash attention off), the probability within 1e-3 (that
/// test's bound). A picture with no prompt token after it is refused.
#[test]
fn run_reads_a_picture_into_the_prompt_as_llama_cpp_does() {
    let dir = temp_dir("run-image");
    let vision = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vision");
    let (model, mmproj) = (dir.join("q35.gguf"), dir.join("mmproj.gguf"));
    for (arch, out) in [("qwen35moe", &model), ("qwen3vl-mmproj", &mmproj)] {
        let o = Command::new(ENGINE)
            .args(["synth", "--arch", arch, "--shape", "tiny"])
            .args(["--type", "F32", "--seed", "1", "--out"])
            .arg(out)
            .output()
            .expect("synth");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let run = |prompt: &str, at: &str| {
        Command::new(ENGINE)
            .args(["run", "--cpu", "--json", "--max-tokens", "1", "--model"])
            .arg(&model)
            .args(["--prompt-tokens", prompt, "--image-at", at, "--mmproj"])
            .arg(&mmproj)
            .arg("--image")
            .arg(vision.join("picture-64x48.png"))
            .output()
            .expect("run")
    };
    let o = run("11,22,33,44,55,66,77,88,99", "5");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let step: serde_json::Value =
        serde_json::from_slice(o.stdout.split(|&b| b == b'\n').next().expect("a step"))
            .expect("a JSON step");
    // llama.cpp's last row: the fourth of the reference's rows of 2048 logits.
    let logits: Vec<f64> = std::fs::read(vision.join("picture-logits-off.bin"))
        .expect("reference")
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)
        .collect();
    let last = &logits[3 * 2048..];
    let max = last.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = last.iter().map(|v| (v - max).exp()).sum();
    let top = last.iter().position(|&v| v == max).expect("a top token");
    assert_eq!(step["token"], top);
    let prob = step["prob"].as_f64().expect("prob");
    assert!((prob - 1.0 / z).abs() < 1e-3, "{prob} against {}", 1.0 / z);
    let o = run("11,22", "2");
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("after it"));
    let _ = std::fs::remove_dir_all(&dir);
}
