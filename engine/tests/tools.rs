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
