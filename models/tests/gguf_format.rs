//! GGUF reading and writing of good files: every value type, versions 2 and 3, custom alignment, split
//! models, zero-copy tensor views, typed accessors, and the writer's own checks.

use std::path::{Path, PathBuf};

use poly_kernels::quant::GgmlType;
use poly_models::gguf::{
    parse_gguf_bytes, Array, ErrorKind, GgufFile, GgufWriter, TensorInfo, Value,
};

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("poly-gguf-format-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Deterministic content of tensor `index`: distinct per tensor and per byte.
fn pattern(index: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (index.wrapping_mul(131) ^ j.wrapping_mul(7) ^ (j >> 8)) as u8)
        .collect()
}

fn fill_pattern(index: usize, _info: &TensorInfo, out: &mut [u8]) -> std::io::Result<()> {
    out.copy_from_slice(&pattern(index, out.len()));
    Ok(())
}

/// One value of every type, arrays of every element type, and nested arrays.
fn every_value() -> Vec<(String, Value)> {
    let scalars = vec![
        ("t.u8", Value::U8(200)),
        ("t.i8", Value::I8(-100)),
        ("t.u16", Value::U16(60000)),
        ("t.i16", Value::I16(-30000)),
        ("t.u32", Value::U32(4_000_000_000)),
        ("t.i32", Value::I32(-2_000_000_000)),
        ("t.f32", Value::F32(-1.5e-3)),
        ("t.bool.true", Value::Bool(true)),
        ("t.bool.false", Value::Bool(false)),
        ("t.string", Value::from("héllo, wörld ✓")),
        ("t.string.empty", Value::from("")),
        ("t.u64", Value::U64(u64::MAX - 3)),
        ("t.i64", Value::I64(i64::MIN + 5)),
        ("t.f64", Value::F64(std::f64::consts::PI)),
    ];
    let arrays = vec![
        ("a.u8", Value::from(vec![0u8, 1, 255])),
        ("a.i8", Value::from(vec![-128i8, 0, 127])),
        ("a.u16", Value::from(vec![1u16, 65535])),
        ("a.i16", Value::from(vec![-32768i16, 32767])),
        ("a.u32", Value::u32_array([1, 2, 3, u32::MAX])),
        ("a.i32", Value::i32_array([-1, 0, 1])),
        ("a.f32", Value::f32_array([0.0, -0.25, 1e30])),
        ("a.bool", Value::bool_array([true, false, true])),
        ("a.string", Value::string_array(["a", "", "b c", "ü"])),
        ("a.u64", Value::from(vec![u64::MAX, 0])),
        ("a.i64", Value::from(vec![i64::MIN, i64::MAX])),
        ("a.f64", Value::from(vec![1.0f64, -2.5])),
        ("a.empty.u32", Value::Array(Array::U32(vec![]))),
        ("a.empty.string", Value::Array(Array::String(vec![]))),
        (
            "a.nested",
            Value::from(vec![
                Array::U32(vec![1, 2]),
                Array::String(vec!["x".into()]),
                Array::Array(vec![Array::F64(vec![0.5]), Array::Bool(vec![])]),
                Array::I8(vec![]),
            ]),
        ),
        ("a.nested.empty", Value::Array(Array::Array(vec![]))),
    ];
    scalars
        .into_iter()
        .chain(arrays)
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

#[test]
fn every_value_type_round_trips_in_order() {
    let dir = TempDir::new("values");
    let path = dir.path("values.gguf");
    let mut w = GgufWriter::new();
    let values = every_value();
    for (k, v) in &values {
        w.add_kv(k.clone(), v.clone());
    }
    w.write_to_path(&path, fill_pattern).expect("write");

    let f = GgufFile::open(&path).expect("open");
    assert_eq!(f.version(), 3);
    assert_eq!(f.metadata().entries(), &values[..]);
    for (k, v) in &values {
        assert_eq!(f.metadata().get(k), Some(v), "{k}");
    }
    assert_eq!(f.n_tensors(), 0);

    // The byte-slice parser sees the same thing as the mapped file.
    let bytes = w.to_bytes(fill_pattern).expect("to_bytes");
    assert_eq!(bytes, std::fs::read(&path).expect("read back"));
    let parsed = parse_gguf_bytes(&bytes, "mem").expect("parse");
    assert_eq!(parsed.metadata.entries(), &values[..]);
}

#[test]
fn tensors_round_trip_with_data_borrowed_from_the_mapping() {
    let dir = TempDir::new("tensors");
    let path = dir.path("t.gguf");
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "test");
    let decl: Vec<(&str, GgmlType, Vec<u64>)> = vec![
        ("token_embd.weight", GgmlType::Q4_K, vec![256, 3]),
        ("blk.0.ffn_gate_exps.weight", GgmlType::Q8_0, vec![64, 5, 4]),
        ("blk.0.attn_norm.weight", GgmlType::F32, vec![7]),
        ("blk.0.odd.weight", GgmlType::F16, vec![3, 3, 1, 2]),
        ("empty.weight", GgmlType::F32, vec![0, 4]),
        ("scalar", GgmlType::F32, vec![]),
        ("mxfp4.weight", GgmlType::MXFP4, vec![32, 1]),
    ];
    for (name, ty, dims) in &decl {
        w.add_tensor(*name, *ty, dims).expect("add_tensor");
    }
    let mut seen = Vec::new();
    w.write_to_path(&path, |i, info, out| {
        seen.push((i, info.clone()));
        fill_pattern(i, info, out)
    })
    .expect("write");

    let f = GgufFile::open(&path).expect("open");
    assert_eq!(f.n_tensors(), decl.len());
    assert_eq!(
        f.file_bytes(),
        std::fs::metadata(&path).expect("stat").len()
    );
    assert_eq!(f.paths(), vec![path.as_path()]);
    let whole = f.part_bytes(0).expect("part 0");
    let whole_range = whole.as_ptr_range();
    for (i, (name, ty, dims)) in decl.iter().enumerate() {
        let t = f.tensor(name).expect("tensor present");
        assert_eq!(t.ty(), *ty);
        assert_eq!(t.dims(), &dims[..]);
        let n: u64 = dims.iter().product();
        assert_eq!(t.info.n_elements(), n);
        assert_eq!(Some(t.info.n_bytes), ty.bytes_for(n));
        assert_eq!(t.data.len() as u64, t.info.n_bytes);
        assert_eq!(t.info.offset % 32, 0, "{name} aligned");
        assert_eq!(t.data, &pattern(i, t.data.len())[..], "{name} data");
        // Zero copy: the view points into the mapping.
        if !t.data.is_empty() {
            assert!(whole_range.contains(&t.data.as_ptr()));
        }
        // The writer told the callback where each tensor lands.
        assert_eq!(&seen[i].1, t.info);
    }
    let names: Vec<&str> = f.tensors().map(|t| t.name()).collect();
    let expected: Vec<&str> = decl.iter().map(|d| d.0).collect();
    assert_eq!(names, expected);
    assert!(f.tensor("missing").is_none());
}

/// A version-2 file built byte by byte (not by our writer): same layout as v3 with u64 counts.
#[test]
fn opened_files_can_be_shared_between_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<GgufFile>();
    assert_send_sync::<poly_models::gguf::Tensor<'static>>();
    assert_send_sync::<GgufWriter>();
}

#[test]
fn version_2_file_built_by_hand_reads() {
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&2u32.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes()); // tensors
    b.extend_from_slice(&1u64.to_le_bytes()); // kv
    let key = b"general.architecture";
    b.extend_from_slice(&(key.len() as u64).to_le_bytes());
    b.extend_from_slice(key);
    b.extend_from_slice(&8u32.to_le_bytes()); // string
    b.extend_from_slice(&5u64.to_le_bytes());
    b.extend_from_slice(b"llama");
    let name = b"w";
    b.extend_from_slice(&(name.len() as u64).to_le_bytes());
    b.extend_from_slice(name);
    b.extend_from_slice(&1u32.to_le_bytes()); // n_dims
    b.extend_from_slice(&4u64.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes()); // F32
    b.extend_from_slice(&0u64.to_le_bytes()); // offset
    while b.len() % 32 != 0 {
        b.push(0);
    }
    let data_start = b.len() as u64;
    for v in [1.0f32, 2.0, 3.0, 4.0] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    let h = parse_gguf_bytes(&b, "v2").expect("v2 parses");
    assert_eq!(h.version, 2);
    assert_eq!(h.metadata.architecture().expect("arch"), "llama");
    assert_eq!(h.data_offset, data_start);
    assert_eq!(h.tensors[0].offset, data_start);
    assert_eq!(h.tensors[0].n_bytes, 16);
}

#[test]
fn writer_version_2_option_matches_version_3_but_for_the_field() {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "x");
    w.add_tensor("a", GgmlType::F32, &[5]).expect("add");
    let v3 = w.to_bytes(fill_pattern).expect("v3");
    w.set_version(2).expect("v2 allowed");
    let v2 = w.to_bytes(fill_pattern).expect("v2");
    assert_eq!(&v2[4..8], &2u32.to_le_bytes());
    assert_eq!(v2[..4], v3[..4]);
    assert_eq!(v2[8..], v3[8..]);
    let h = parse_gguf_bytes(&v2, "v2").expect("parse v2");
    assert_eq!(h.version, 2);
    assert!(matches!(
        w.set_version(1).map_err(|e| e.into_kind()),
        Err(ErrorKind::UnsupportedVersion { version: 1 })
    ));
}

#[test]
fn custom_alignment_is_written_and_honoured() {
    for alignment in [1u32, 64, 256] {
        let mut w = GgufWriter::new();
        w.set_alignment(alignment).expect("power of two");
        w.add_kv("general.architecture", "x");
        for (i, n) in [3u64, 17, 100, 1].iter().enumerate() {
            w.add_tensor(format!("t{i}"), GgmlType::F32, &[*n])
                .expect("add");
        }
        let bytes = w.to_bytes(fill_pattern).expect("write");
        let h = parse_gguf_bytes(&bytes, "aligned").expect("parse");
        assert_eq!(h.alignment, u64::from(alignment));
        assert_eq!(
            h.metadata.get("general.alignment"),
            Some(&Value::U32(alignment))
        );
        assert_eq!(h.data_offset % u64::from(alignment), 0);
        let mut expected = h.data_offset;
        for (i, t) in h.tensors.iter().enumerate() {
            assert_eq!(t.offset, expected, "back to back");
            assert_eq!(t.offset % u64::from(alignment), 0);
            let data = &bytes[t.offset as usize..(t.offset + t.n_bytes) as usize];
            assert_eq!(data, &pattern(i, data.len())[..]);
            expected = (t.offset + t.n_bytes).div_ceil(u64::from(alignment)) * u64::from(alignment);
        }
    }
    let mut w = GgufWriter::new();
    assert!(matches!(
        w.set_alignment(48).map_err(|e| e.into_kind()),
        Err(ErrorKind::BadAlignment { .. })
    ));
    assert!(w.set_alignment(0).is_err());
    // A general.alignment set by hand with the wrong type fails the write instead of writing a file
    // llama.cpp refuses.
    w.add_kv("general.alignment", Value::U64(64));
    assert!(matches!(
        w.to_bytes(fill_pattern).map_err(|e| e.into_kind()),
        Err(ErrorKind::BadAlignment { .. })
    ));
}

fn split_model(n_tensors: usize) -> GgufWriter {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "qwen3moe");
    w.add_kv("general.name", "split test");
    w.add_kv("qwen3moe.block_count", 7u32);
    for i in 0..n_tensors {
        w.add_tensor(format!("blk.{i}.w"), GgmlType::Q8_0, &[32, i as u64 + 1])
            .expect("add");
    }
    w
}

#[test]
fn split_model_opens_whole_from_any_part() {
    let dir = TempDir::new("split");
    let w = split_model(7);
    let mut fills = Vec::new();
    let paths = w
        .write_split(dir.path("model.gguf"), 3, |i, info, out| {
            fills.push((i, info.part));
            fill_pattern(i, info, out)
        })
        .expect("write_split");
    let names: Vec<String> = paths
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "model-00001-of-00003.gguf",
            "model-00002-of-00003.gguf",
            "model-00003-of-00003.gguf"
        ]
    );
    assert_eq!(
        fills,
        [(0, 0), (1, 0), (2, 0), (3, 1), (4, 1), (5, 1), (6, 2)]
    );

    // Only the first part carries the model's metadata; every part carries the split keys.
    let second = parse_gguf_bytes(&std::fs::read(&paths[1]).unwrap(), "p2").expect("part 2");
    assert_eq!(second.metadata.get("general.architecture"), None);
    assert_eq!(second.metadata.get("split.no"), Some(&Value::U16(1)));
    assert_eq!(second.metadata.get("split.count"), Some(&Value::U16(3)));
    assert_eq!(
        second.metadata.get("split.tensors.count"),
        Some(&Value::I32(7))
    );

    let total: u64 = paths
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum();
    for opened_from in &paths {
        let f = GgufFile::open(opened_from).expect("open split");
        assert_eq!(f.n_parts(), 3);
        assert_eq!(
            f.paths(),
            paths.iter().map(PathBuf::as_path).collect::<Vec<_>>()
        );
        assert_eq!(f.file_bytes(), total);
        assert_eq!(f.architecture().unwrap(), "qwen3moe");
        assert_eq!(f.name().unwrap(), Some("split test"));
        assert_eq!(f.n_tensors(), 7);
        for i in 0..7 {
            let t = f.tensor(&format!("blk.{i}.w")).expect("tensor");
            assert_eq!(t.info.part, i / 3);
            assert_eq!(t.data, &pattern(i, t.data.len())[..]);
            let part = f.part_bytes(t.info.part).unwrap().as_ptr_range();
            assert!(part.contains(&t.data.as_ptr()));
        }
    }
}

#[test]
fn split_with_one_part_and_no_tensors() {
    let dir = TempDir::new("split1");
    let w = split_model(0);
    let paths = w
        .write_split(dir.path("m"), 4, fill_pattern)
        .expect("write");
    assert_eq!(paths, vec![dir.path("m-00001-of-00001.gguf")]);
    let f = GgufFile::open(&paths[0]).expect("open");
    assert_eq!(f.n_parts(), 1);
    assert_eq!(f.n_tensors(), 0);
}

#[test]
fn split_missing_or_inconsistent_parts_are_named() {
    let dir = TempDir::new("splitbad");
    let paths = split_model(7)
        .write_split(dir.path("m"), 3, fill_pattern)
        .expect("write");

    // A missing part: the error names that part, whichever part was opened.
    std::fs::rename(&paths[2], dir.path("elsewhere.gguf")).unwrap();
    for p in &paths[..2] {
        let e = GgufFile::open(p).expect_err("part 3 missing");
        assert_eq!(e.file(), paths[2].display().to_string());
        assert!(matches!(
            e.kind(),
            ErrorKind::SplitPartMissing { part: 3, count: 3 }
        ));
        assert!(e.to_string().contains("m-00003-of-00003.gguf"));
    }
    std::fs::rename(dir.path("elsewhere.gguf"), &paths[2]).unwrap();
    GgufFile::open(&paths[0]).expect("whole again");

    // A part from another split of the same shape but a different tensor total.
    let other = split_model(8)
        .write_split(dir.path("other"), 3, fill_pattern)
        .expect("write other");
    std::fs::copy(&other[1], &paths[1]).unwrap();
    let e = GgufFile::open(&paths[0]).expect_err("counts disagree");
    assert!(matches!(e.kind(), ErrorKind::SplitMismatch { .. }), "{e}");

    // A part that claims another position.
    std::fs::copy(&paths[0], &paths[1]).unwrap();
    let e = GgufFile::open(&paths[0]).expect_err("split.no disagrees");
    assert_eq!(e.file(), paths[1].display().to_string());
    assert!(matches!(e.kind(), ErrorKind::SplitMismatch { .. }), "{e}");

    // A part renamed away from the llama.cpp naming.
    let renamed = dir.path("renamed.gguf");
    std::fs::copy(&other[0], &renamed).unwrap();
    let e = GgufFile::open(&renamed).expect_err("bad split name");
    assert!(matches!(e.kind(), ErrorKind::SplitName { .. }), "{e}");
}

fn accessor_model() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "qwen3moe");
    w.add_kv("general.name", "Tiny MoE");
    w.add_kv("general.size_label", "30B-A3B");
    w.add_kv("qwen3moe.block_count", Value::U64(4)); // any integer width
    w.add_kv("qwen3moe.context_length", Value::I32(4096));
    w.add_kv("qwen3moe.expert_count", Value::U8(8));
    w.add_kv("qwen3moe.rope.freq_base", Value::F32(1_000_000.0));
    w.add_kv(
        "qwen3moe.attention.layer_norm_rms_epsilon",
        Value::F64(1e-6),
    );
    w.add_kv("qwen3moe.attention.head_count", 32u32);
    w.add_kv(
        "qwen3moe.attention.head_count_kv",
        Value::from(vec![4i32, 4, 8, 8]),
    );
    w.add_kv(
        "qwen3moe.attention.sliding_window_pattern",
        Value::bool_array([true, true, false, true]),
    );
    w.add_kv("qwen3moe.negative", Value::I32(-1));
    w.add_kv("qwen3moe.text", "not a number");
    w.add_kv("tokenizer.ggml.model", "gpt2");
    w.add_kv("tokenizer.ggml.pre", "qwen2");
    w.add_kv(
        "tokenizer.ggml.tokens",
        Value::string_array(["a", "b", "ab", "<|im_end|>"]),
    );
    w.add_kv(
        "tokenizer.ggml.scores",
        Value::f32_array([0.0, -1.0, -2.0, 0.0]),
    );
    w.add_kv("tokenizer.ggml.token_type", Value::i32_array([1, 1, 1, 3]));
    w.add_kv("tokenizer.ggml.merges", Value::string_array(["a b"]));
    w.add_kv("tokenizer.ggml.bos_token_id", 0u32);
    w.add_kv("tokenizer.ggml.eos_token_id", Value::U64(3));
    w.add_kv("tokenizer.chat_template", "{{ messages }}");
    w
}

#[test]
fn typed_accessors_read_what_the_engine_needs() {
    let dir = TempDir::new("accessors");
    let path = dir.path("acc.gguf");
    accessor_model()
        .write_to_path(&path, fill_pattern)
        .expect("write");
    let f = GgufFile::open(&path).expect("open");
    assert_eq!(f.architecture().unwrap(), "qwen3moe");
    assert_eq!(f.name().unwrap(), Some("Tiny MoE"));
    assert_eq!(f.size_label().unwrap(), Some("30B-A3B"));
    assert_eq!(f.arch_u32("block_count").unwrap(), 4);
    assert_eq!(f.arch_u32("context_length").unwrap(), 4096);
    assert_eq!(f.arch_u32("expert_count").unwrap(), 8);
    assert_eq!(f.arch_u32_opt("expert_used_count").unwrap(), None);
    assert_eq!(f.arch_f32("rope.freq_base").unwrap(), 1_000_000.0);
    assert_eq!(
        f.arch_f32("attention.layer_norm_rms_epsilon").unwrap(),
        1e-6f64 as f32
    );
    assert_eq!(f.arch_f32_opt("rope.scaling.factor").unwrap(), None);
    assert_eq!(
        f.arch_u32_array("attention.head_count_kv").unwrap(),
        [4, 4, 8, 8]
    );
    assert_eq!(
        f.arch_u32_per_layer("attention.head_count_kv", 4).unwrap(),
        [4, 4, 8, 8]
    );
    assert_eq!(
        f.arch_u32_per_layer("attention.head_count", 4).unwrap(),
        [32, 32, 32, 32]
    );
    assert_eq!(
        f.metadata()
            .arch_bool_array_opt("attention.sliding_window_pattern")
            .unwrap(),
        Some(vec![true, true, false, true])
    );
    assert_eq!(f.tokenizer_model().unwrap(), "gpt2");
    assert_eq!(f.tokenizer_pre().unwrap(), Some("qwen2"));
    assert_eq!(
        f.tokenizer_tokens().unwrap(),
        ["a", "b", "ab", "<|im_end|>"]
    );
    assert_eq!(
        f.tokenizer_scores().unwrap(),
        Some(&[0.0f32, -1.0, -2.0, 0.0][..])
    );
    assert_eq!(f.tokenizer_token_types().unwrap(), Some(&[1, 1, 1, 3][..]));
    assert_eq!(
        f.tokenizer_merges().unwrap().map(|m| m.to_vec()),
        Some(vec!["a b".to_string()])
    );
    assert_eq!(f.bos_token_id().unwrap(), Some(0));
    assert_eq!(f.eos_token_id().unwrap(), Some(3));
    assert_eq!(f.chat_template().unwrap(), Some("{{ messages }}"));

    // Problems are errors that name the file and the full key.
    let file = path.display().to_string();
    let e = f.arch_u32("expert_used_count").unwrap_err();
    assert_eq!(e.file(), file);
    assert!(
        matches!(e.kind(), ErrorKind::MissingKey { key } if key == "qwen3moe.expert_used_count")
    );
    let e = f.arch_u32("negative").unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::OutOfRange { .. }), "{e}");
    let e = f.arch_u32("text").unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::WrongType { .. }), "{e}");
    let e = f.arch_f32("block_count").unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::WrongType { .. }), "{e}");
    let e = f
        .arch_u32_per_layer("attention.head_count_kv", 5)
        .unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::OutOfRange { .. }), "{e}");
    assert!(f.metadata().get_str("qwen3moe.block_count").is_err());
}

#[test]
fn accessors_report_missing_architecture_and_tokenizer() {
    let w = GgufWriter::new();
    let bytes = w.to_bytes(fill_pattern).expect("write");
    let h = parse_gguf_bytes(&bytes, "empty.gguf").expect("parse");
    let e = h.metadata.architecture().unwrap_err();
    assert_eq!(e.file(), "empty.gguf");
    assert!(matches!(e.kind(), ErrorKind::MissingKey { key } if key == "general.architecture"));
    assert!(h.metadata.arch_u32("block_count").is_err());
    assert!(h.metadata.tokenizer_tokens().is_err());
    assert_eq!(h.metadata.tokenizer_scores().unwrap(), None);
    assert_eq!(h.metadata.chat_template().unwrap(), None);
}

#[test]
fn add_kv_replaces_in_place() {
    let mut w = GgufWriter::new();
    w.add_kv("a", 1u32);
    w.add_kv("b", 2u32);
    w.add_kv("a", "one");
    let h = parse_gguf_bytes(&w.to_bytes(fill_pattern).unwrap(), "kv").unwrap();
    let keys: Vec<&str> = h
        .metadata
        .entries()
        .iter()
        .map(|(k, _)| k.as_str())
        .collect();
    assert_eq!(keys, ["a", "b"]);
    assert_eq!(h.metadata.get("a"), Some(&Value::from("one")));
}

#[test]
fn writer_refuses_what_readers_refuse() {
    let mut w = GgufWriter::new();
    let kind = |r: Result<(), poly_models::GgufError>| r.map_err(|e| e.into_kind());
    assert!(matches!(
        kind(w.add_tensor("q", GgmlType::Q4_K, &[128, 2])),
        Err(ErrorKind::NotBlockMultiple {
            ne0: 128,
            block: 256,
            ..
        })
    ));
    assert!(matches!(
        kind(w.add_tensor("q", GgmlType::Q4_K, &[])),
        Err(ErrorKind::NotBlockMultiple { ne0: 1, .. })
    ));
    assert!(matches!(
        kind(w.add_tensor("d", GgmlType::F32, &[1, 1, 1, 1, 1])),
        Err(ErrorKind::TooManyDims { n_dims: 5, .. })
    ));
    assert!(matches!(
        kind(w.add_tensor("o", GgmlType::F32, &[1 << 32, 1 << 32])),
        Err(ErrorKind::SizeOverflow { .. })
    ));
    assert!(matches!(
        kind(w.add_tensor("x".repeat(64), GgmlType::F32, &[1])),
        Err(ErrorKind::TensorNameTooLong { len: 64, .. })
    ));
    w.add_tensor("x".repeat(63), GgmlType::F32, &[1])
        .expect("63 bytes is fine");
    w.add_tensor("t", GgmlType::F32, &[1]).expect("first");
    assert!(matches!(
        kind(w.add_tensor("t", GgmlType::F32, &[2])),
        Err(ErrorKind::DuplicateTensor { .. })
    ));
    w.add_kv("", 1u8);
    assert!(matches!(
        w.to_bytes(fill_pattern).map_err(|e| e.into_kind()),
        Err(ErrorKind::EmptyKey { .. })
    ));
}

#[test]
fn writer_goes_through_a_temporary_file() {
    let dir = TempDir::new("tmpfile");
    let path = dir.path("m.gguf");
    let tmp = dir.path("m.gguf.tmp");
    let mut w = GgufWriter::new();
    w.add_tensor("a", GgmlType::F32, &[4]).unwrap();
    w.add_tensor("b", GgmlType::F32, &[4]).unwrap();
    w.write_to_path(&path, |i, info, out| {
        assert!(!path.exists(), "final name appears only when complete");
        assert!(tmp.exists());
        fill_pattern(i, info, out)
    })
    .expect("write");
    assert!(path.exists());
    assert!(!tmp.exists());

    // A failing fill leaves neither the final file nor the temporary one.
    let path2 = dir.path("fail.gguf");
    let e = w
        .write_to_path(&path2, |i, _, _| {
            if i == 1 {
                Err(std::io::Error::other("generator failed"))
            } else {
                Ok(())
            }
        })
        .expect_err("fill fails");
    assert!(matches!(e.kind(), ErrorKind::FillFailed { tensor, .. } if tensor == "b"));
    assert_eq!(e.file(), path2.display().to_string());
    assert!(!path2.exists());
    assert!(!Path::new(&format!("{}.tmp", path2.display())).exists());
}

/// Checks written in Python against the independent `gguf` package (0.19.0): it must read our file with
/// the same keys, values, tensor names, types, shapes, offsets and bytes.
const PY_CHECK: &str = r#"
import sys, gguf
r = gguf.GGUFReader(sys.argv[1])
keys = [k for k in r.fields.keys() if not k.startswith('GGUF.')]
expect_keys = ['general.architecture', 'general.alignment', 't.u8', 't.i8', 't.u16', 't.i16', 't.u32',
    't.i32', 't.f32', 't.bool', 't.string', 't.u64', 't.i64', 't.f64', 'a.u32', 'a.f32', 'a.string',
    'a.bool', 'a.nested', 'after.nested']
assert keys == expect_keys, keys
c = lambda k: r.fields[k].contents()
assert c('general.architecture') == 'qwen3moe'
assert c('general.alignment') == 64
assert (c('t.u8'), c('t.i8'), c('t.u16'), c('t.i16')) == (200, -100, 60000, -30000)
assert (c('t.u32'), c('t.i32')) == (4000000000, -2000000000)
assert c('t.f32') == 0.5 and c('t.bool') is True and c('t.string') == 'héllo ✓'
assert (c('t.u64'), c('t.i64'), c('t.f64')) == (2**64 - 4, -2**63 + 5, 0.25)
assert c('a.u32') == [1, 2, 3] and c('a.f32') == [0.5, -1.0] and c('a.string') == ['a', '', 'b c']
assert c('a.bool') == [True, False]
assert c('a.nested') == [1, 2, 7], c('a.nested')  # the package flattens nested arrays
assert c('after.nested') == 'still in sync'
types = [f.types for f in [r.fields['a.nested']]][0]
assert types[0] == gguf.GGUFValueType.ARRAY and types[1] == gguf.GGUFValueType.ARRAY, types
assert r.alignment == 64
want = [('blk.0.ffn_gate_exps.weight', 'Q4_K', [512, 3, 2]), ('blk.0.attn_norm.weight', 'F32', [7]),
        ('token_embd.weight', 'Q8_0', [64, 5]), ('output.weight', 'F16', [3, 3])]
assert len(r.tensors) == len(want)
for i, (t, (name, ty, shape)) in enumerate(zip(r.tensors, want)):
    assert t.name == name, t.name
    assert t.tensor_type.name == ty, t.tensor_type
    assert t.shape.tolist() == shape, t.shape
    data = t.data.tobytes()
    assert len(data) == t.n_bytes
    pattern = bytes(((i * 131) ^ (j * 7) ^ (j >> 8)) & 0xff for j in range(len(data)))
    assert data == pattern, name
    print(name, ty, shape, t.n_bytes, t.data_offset)
print('python gguf read', len(keys), 'keys and', len(r.tensors), 'tensors: all equal')
"#;

#[test]
#[ignore = "needs the gguf Python package: GGUF_PY=/path/to/gguf-py cargo test -- --ignored"]
fn python_gguf_package_reads_our_file() {
    let gguf_py = std::env::var("GGUF_PY").expect("set GGUF_PY to the gguf-py directory");
    let dir = TempDir::new("python");
    let path = dir.path("py.gguf");
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "qwen3moe");
    w.set_alignment(64).unwrap();
    w.add_kv("t.u8", 200u8);
    w.add_kv("t.i8", -100i8);
    w.add_kv("t.u16", 60000u16);
    w.add_kv("t.i16", -30000i16);
    w.add_kv("t.u32", 4_000_000_000u32);
    w.add_kv("t.i32", -2_000_000_000i32);
    w.add_kv("t.f32", 0.5f32);
    w.add_kv("t.bool", true);
    w.add_kv("t.string", "héllo ✓");
    w.add_kv("t.u64", u64::MAX - 3);
    w.add_kv("t.i64", i64::MIN + 5);
    w.add_kv("t.f64", 0.25f64);
    w.add_kv("a.u32", Value::u32_array([1, 2, 3]));
    w.add_kv("a.f32", Value::f32_array([0.5, -1.0]));
    w.add_kv("a.string", Value::string_array(["a", "", "b c"]));
    w.add_kv("a.bool", Value::bool_array([true, false]));
    w.add_kv(
        "a.nested",
        Value::from(vec![Array::U32(vec![1, 2]), Array::U32(vec![7])]),
    );
    w.add_kv("after.nested", "still in sync");
    w.add_tensor("blk.0.ffn_gate_exps.weight", GgmlType::Q4_K, &[512, 3, 2])
        .unwrap();
    w.add_tensor("blk.0.attn_norm.weight", GgmlType::F32, &[7])
        .unwrap();
    w.add_tensor("token_embd.weight", GgmlType::Q8_0, &[64, 5])
        .unwrap();
    w.add_tensor("output.weight", GgmlType::F16, &[3, 3])
        .unwrap();
    w.write_to_path(&path, fill_pattern).expect("write");

    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(PY_CHECK)
        .arg(&path)
        .env("PYTHONPATH", gguf_py)
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "python failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Python's view of where the data lies matches ours.
    let f = GgufFile::open(&path).unwrap();
    for line in stdout.lines().filter(|l| l.contains(".weight")) {
        let name = line.split(' ').next().unwrap();
        let py_offset: u64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert_eq!(f.tensor_info(name).unwrap().offset, py_offset, "{name}");
    }
}

/// The reverse direction: a file written by the `gguf` Python package opens with the same contents.
const PY_WRITE: &str = r#"
import sys, numpy as np, gguf
w = gguf.GGUFWriter(sys.argv[1], 'llama')
w.add_uint32('llama.block_count', 3)
w.add_float32('llama.rope.freq_base', 10000.0)
w.add_token_list(['<s>', 'a', 'b'])
w.add_token_scores([0.0, -1.5, -2.5])
w.add_token_types([3, 1, 1])
w.add_array('llama.attention.head_count_kv', [2, 4, 8])
w.add_string('tokenizer.chat_template', '{{ x }}')
w.add_tensor('tok.weight', np.arange(12, dtype=np.float32).reshape(3, 4))
w.add_tensor('q.weight', np.arange(34 * 2, dtype=np.uint8).reshape(2, 34), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
"#;

#[test]
#[ignore = "needs the gguf Python package: GGUF_PY=/path/to/gguf-py cargo test -- --ignored"]
fn we_read_a_file_the_python_package_wrote() {
    let gguf_py = std::env::var("GGUF_PY").expect("set GGUF_PY to the gguf-py directory");
    let dir = TempDir::new("python-writes");
    let path = dir.path("from-python.gguf");
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(PY_WRITE)
        .arg(&path)
        .env("PYTHONPATH", gguf_py)
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let f = GgufFile::open(&path).expect("open python's file");
    assert_eq!(f.architecture().unwrap(), "llama");
    assert_eq!(f.arch_u32("block_count").unwrap(), 3);
    assert_eq!(f.arch_f32("rope.freq_base").unwrap(), 10000.0);
    assert_eq!(f.tokenizer_tokens().unwrap(), ["<s>", "a", "b"]);
    assert_eq!(f.tokenizer_scores().unwrap(), Some(&[0.0, -1.5, -2.5][..]));
    assert_eq!(f.tokenizer_token_types().unwrap(), Some(&[3, 1, 1][..]));
    assert_eq!(
        f.arch_u32_array("attention.head_count_kv").unwrap(),
        [2, 4, 8]
    );
    assert_eq!(f.chat_template().unwrap(), Some("{{ x }}"));
    let tok = f.tensor("tok.weight").unwrap();
    assert_eq!((tok.ty(), tok.dims()), (GgmlType::F32, &[4u64, 3][..]));
    let values: Vec<f32> = tok
        .data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(values, (0..12).map(|v| v as f32).collect::<Vec<_>>());
    let q = f.tensor("q.weight").unwrap();
    assert_eq!((q.ty(), q.dims()), (GgmlType::Q8_0, &[32u64, 2][..]));
    assert_eq!(q.data, (0..68u8).collect::<Vec<_>>());
}

/// Opening parses only the header: a 500k-token vocabulary with merges opens in well under a second in
/// release builds. Prints the time; run with
/// `cargo test --release -p poly-models --test gguf_format -- --ignored large_vocab --nocapture`.
#[test]
#[ignore = "timing report; run in release"]
fn large_vocab_opens_quickly() {
    let dir = TempDir::new("vocab");
    let path = dir.path("vocab.gguf");
    let n = 500_000;
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "qwen3moe");
    w.add_kv("tokenizer.ggml.model", "gpt2");
    w.add_kv(
        "tokenizer.ggml.tokens",
        Value::string_array((0..n).map(|i| format!("token-{i}"))),
    );
    w.add_kv(
        "tokenizer.ggml.scores",
        Value::f32_array((0..n).map(|i| -(i as f32))),
    );
    w.add_kv(
        "tokenizer.ggml.token_type",
        Value::i32_array((0..n).map(|_| 1)),
    );
    w.add_kv(
        "tokenizer.ggml.merges",
        Value::string_array((0..n).map(|i| format!("tok{i} en"))),
    );
    for i in 0..2000 {
        w.add_tensor(
            format!("blk.{i}.ffn_down_exps.weight"),
            GgmlType::Q4_K,
            &[256, 4],
        )
        .unwrap();
    }
    w.write_to_path(&path, fill_pattern).unwrap();
    let size = std::fs::metadata(&path).unwrap().len();
    // The best of a few opens, as the machine may be busy.
    let mut elapsed = std::time::Duration::MAX;
    for _ in 0..3 {
        let start = std::time::Instant::now();
        let f = GgufFile::open(&path).unwrap();
        elapsed = elapsed.min(start.elapsed());
        drop(f);
    }
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.tokenizer_tokens().unwrap().len(), n);
    assert_eq!(f.tokenizer_merges().unwrap().unwrap().len(), n);
    assert_eq!(f.n_tensors(), 2000);
    println!(
        "opened {size} bytes ({n} tokens, {n} merges, 2000 tensors) in {:.1} ms",
        elapsed.as_secs_f64() * 1e3
    );
}
