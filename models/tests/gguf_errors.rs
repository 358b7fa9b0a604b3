//! Bad GGUF files: each case builds a good file with the writer (or by hand, for what the writer refuses
//! to write), corrupts it, and checks that reading fails with the right error naming the file, without
//! panicking or allocating absurdly. Regressions found by fuzzing are at the end.

use std::path::PathBuf;

use poly_kernels::quant::GgmlType;
use poly_models::gguf::{
    parse_gguf_bytes, ErrorKind, GgufError, GgufFile, GgufWriter, Section, TensorInfo, Value,
};

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("poly-gguf-errors-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn fill(index: usize, _info: &TensorInfo, out: &mut [u8]) -> std::io::Result<()> {
    for (j, b) in out.iter_mut().enumerate() {
        *b = (index * 17 + j) as u8;
    }
    Ok(())
}

/// A small good file: a few keys (a string, an array, a u32) and three tensors.
fn good_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "llama");
    w.add_kv(
        "tokenizer.ggml.tokens",
        Value::string_array(["a", "b", "c"]),
    );
    w.add_kv("llama.block_count", 2u32);
    w.add_tensor("tensor_a", GgmlType::F32, &[8, 2]).unwrap();
    w.add_tensor("tensor_b", GgmlType::Q8_0, &[64, 2]).unwrap();
    w.add_tensor("tensor_c", GgmlType::F32, &[16]).unwrap();
    w.to_bytes(fill).unwrap()
}

fn find(bytes: &[u8], needle: &[u8]) -> usize {
    bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap_or_else(|| panic!("{:?} not in file", String::from_utf8_lossy(needle)))
}

/// Position of the `n_dims` field of the tensor info of `name`.
fn tensor_fields(bytes: &[u8], name: &str) -> usize {
    find(bytes, name.as_bytes()) + name.len()
}

/// Position of the `offset` field of a tensor with `n_dims` dimensions.
fn offset_field(bytes: &[u8], name: &str, n_dims: usize) -> usize {
    tensor_fields(bytes, name) + 4 + 8 * n_dims + 4
}

/// Position of the value type of `key` (its value follows).
fn value_field(bytes: &[u8], key: &str) -> usize {
    find(bytes, key.as_bytes()) + key.len()
}

fn put_u32(bytes: &mut [u8], at: usize, v: u32) {
    bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(bytes: &mut [u8], at: usize, v: u64) {
    bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn parse_err(bytes: &[u8]) -> GgufError {
    let e = parse_gguf_bytes(bytes, "bad.gguf").expect_err("must be refused");
    assert_eq!(e.file(), "bad.gguf");
    assert!(e.to_string().starts_with("bad.gguf: "), "{e}");
    e
}

/// Writes `bytes` to a file and opens it through the mmap path: the error must name the path.
fn open_err(tag: &str, bytes: &[u8]) -> GgufError {
    let dir = TempDir::new(tag);
    let path = dir.0.join("bad.gguf");
    std::fs::write(&path, bytes).unwrap();
    let e = GgufFile::open(&path).expect_err("must be refused");
    assert_eq!(e.file(), path.display().to_string());
    assert!(e.to_string().contains(&path.display().to_string()));
    e
}

/// Minimal hand-built files for what the writer refuses to produce.
struct Raw(Vec<u8>);

impl Raw {
    fn new(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&version.to_le_bytes());
        b.extend_from_slice(&n_tensors.to_le_bytes());
        b.extend_from_slice(&n_kv.to_le_bytes());
        Raw(b)
    }
    fn u32(mut self, v: u32) -> Raw {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Raw {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn str(self, s: &[u8]) -> Raw {
        let mut r = self.u64(s.len() as u64);
        r.0.extend_from_slice(s);
        r
    }
}

#[test]
fn the_good_file_is_good() {
    let bytes = good_file();
    let h = parse_gguf_bytes(&bytes, "good.gguf").expect("good");
    assert_eq!(h.tensors.len(), 3);
}

#[test]
fn bad_magic() {
    let mut bytes = good_file();
    bytes[..4].copy_from_slice(b"GGML");
    assert!(matches!(parse_err(&bytes).kind(), ErrorKind::BadMagic { found } if found == b"GGML"));
    assert!(matches!(
        open_err("magic", &bytes).kind(),
        ErrorKind::BadMagic { .. }
    ));
    // Even a file shorter than the magic is recognised as not GGUF when its bytes differ.
    assert!(matches!(
        parse_err(b"PK").kind(),
        ErrorKind::BadMagic { .. }
    ));
}

#[test]
fn truncated_header() {
    let bytes = good_file();
    for len in [0, 3, 4, 10, 23] {
        let e = parse_err(&bytes[..len]);
        assert!(
            matches!(
                e.kind(),
                ErrorKind::Truncated {
                    section: Section::Header,
                    ..
                }
            ),
            "{len}: {e}"
        );
    }
    // An empty file through the mmap path.
    assert!(matches!(
        open_err("empty", &[]).kind(),
        ErrorKind::Truncated {
            section: Section::Header,
            ..
        }
    ));
}

#[test]
fn truncated_in_metadata() {
    let bytes = good_file();
    let cut = value_field(&bytes, "tokenizer.ggml.tokens") + 10;
    for len in [24, 30, cut, value_field(&bytes, "llama.block_count") + 2] {
        let e = parse_err(&bytes[..len]);
        assert!(
            matches!(
                e.kind(),
                ErrorKind::Truncated {
                    section: Section::Metadata,
                    ..
                }
            ),
            "{len}: {e}"
        );
    }
}

#[test]
fn truncated_in_tensor_infos() {
    let bytes = good_file();
    for len in [
        find(&bytes, b"tensor_a") - 2,
        tensor_fields(&bytes, "tensor_b") + 9,
        offset_field(&bytes, "tensor_c", 1) + 7,
    ] {
        let e = parse_err(&bytes[..len]);
        assert!(
            matches!(
                e.kind(),
                ErrorKind::Truncated {
                    section: Section::TensorInfo,
                    ..
                }
            ),
            "{len}: {e}"
        );
    }
}

#[test]
fn truncated_in_data() {
    let bytes = good_file();
    let h = parse_gguf_bytes(&bytes, "good").unwrap();
    // Cut in the padding before the data section.
    let e = parse_err(&bytes[..h.data_offset as usize - 1]);
    assert!(
        matches!(
            e.kind(),
            ErrorKind::Truncated {
                section: Section::TensorData,
                ..
            }
        ),
        "{e}"
    );
    // Cut inside the last tensor's data, through the file path too.
    let last = &h.tensors[2];
    let cut = &bytes[..(last.offset + last.n_bytes - 1) as usize];
    for e in [parse_err(cut), open_err("trunc-data", cut)] {
        assert!(
            matches!(e.kind(), ErrorKind::TensorOutOfBounds { tensor, .. } if tensor == "tensor_c"),
            "{e}"
        );
    }
}

#[test]
fn tensor_outside_the_file() {
    let mut bytes = good_file();
    let at = offset_field(&bytes, "tensor_c", 1);
    put_u64(&mut bytes, at, 1 << 40);
    let e = parse_err(&bytes);
    assert!(
        matches!(e.kind(), ErrorKind::TensorOutOfBounds { tensor, .. } if tensor == "tensor_c"),
        "{e}"
    );
    // An offset whose end overflows u64.
    put_u64(&mut bytes, at, u64::MAX - 31);
    assert!(matches!(
        parse_err(&bytes).kind(),
        ErrorKind::TensorOutOfBounds { .. }
    ));
}

#[test]
fn unknown_tensor_type() {
    for id in [4, 5, 31, 40, 99, u32::MAX] {
        let mut bytes = good_file();
        let at = tensor_fields(&bytes, "tensor_c") + 4 + 8;
        put_u32(&mut bytes, at, id);
        let e = parse_err(&bytes);
        assert!(
            matches!(e.kind(), ErrorKind::UnknownTensorType { tensor, id: got } if tensor == "tensor_c" && *got == id),
            "{e}"
        );
    }
}

#[test]
fn unsupported_versions() {
    for version in [0, 1, 4, 0xFFFF] {
        let mut bytes = good_file();
        put_u32(&mut bytes, 4, version);
        let e = parse_err(&bytes);
        assert!(
            matches!(e.kind(), ErrorKind::UnsupportedVersion { version: v } if *v == version),
            "{version}: {e}"
        );
    }
    let mut bytes = good_file();
    put_u32(&mut bytes, 4, 1);
    assert!(open_err("v1", &bytes).to_string().contains("version 1"));
}

#[test]
fn big_endian_files_are_refused_clearly() {
    let mut bytes = good_file();
    bytes[4..8].copy_from_slice(&3u32.to_be_bytes());
    let e = parse_err(&bytes);
    assert!(matches!(e.kind(), ErrorKind::BigEndian { .. }), "{e}");
    assert!(e.to_string().contains("big-endian"));
}

#[test]
fn duplicate_tensor_names() {
    let mut bytes = good_file();
    let at = find(&bytes, b"tensor_b");
    bytes[at..at + 8].copy_from_slice(b"tensor_a");
    let e = parse_err(&bytes);
    assert!(
        matches!(e.kind(), ErrorKind::DuplicateTensor { name } if name == "tensor_a"),
        "{e}"
    );
}

#[test]
fn duplicate_and_empty_keys() {
    let mut w = GgufWriter::new();
    w.add_kv("key.one", 1u32);
    w.add_kv("key.two", 2u32);
    let mut bytes = w.to_bytes(fill).unwrap();
    let at = find(&bytes, b"key.two");
    bytes[at..at + 7].copy_from_slice(b"key.one");
    assert!(
        matches!(parse_err(&bytes).kind(), ErrorKind::DuplicateKey { key } if key == "key.one")
    );

    let raw = Raw::new(3, 0, 1).str(b"").u32(4).u32(7);
    assert!(matches!(
        parse_err(&raw.0).kind(),
        ErrorKind::EmptyKey { index: 0 }
    ));
}

#[test]
fn unknown_value_types() {
    let raw = Raw::new(3, 0, 1).str(b"k").u32(13).u32(0);
    assert!(
        matches!(parse_err(&raw.0).kind(), ErrorKind::UnknownValueType { key, id: 13 } if key == "k")
    );
    let raw = Raw::new(3, 0, 1).str(b"k").u32(9).u32(77).u64(0);
    assert!(matches!(
        parse_err(&raw.0).kind(),
        ErrorKind::UnknownValueType { id: 77, .. }
    ));
}

#[test]
fn dims_product_overflow_and_huge_dims() {
    let mut bytes = good_file();
    let at = tensor_fields(&bytes, "tensor_a") + 4;
    put_u64(&mut bytes, at, 1 << 32);
    put_u64(&mut bytes, at + 8, 1 << 32);
    let e = parse_err(&bytes);
    assert!(
        matches!(e.kind(), ErrorKind::SizeOverflow { tensor, .. } if tensor == "tensor_a"),
        "{e}"
    );

    let mut bytes = good_file();
    put_u64(&mut bytes, at, u64::MAX);
    assert!(matches!(
        parse_err(&bytes).kind(),
        ErrorKind::DimTooLarge { dim: u64::MAX, .. }
    ));

    // 2^62 elements fit in i64, but as F32 they take 2^64 bytes.
    let mut bytes = good_file();
    put_u64(&mut bytes, at, 1 << 31);
    put_u64(&mut bytes, at + 8, 1 << 31);
    let e = parse_err(&bytes);
    assert!(matches!(e.kind(), ErrorKind::SizeOverflow { .. }), "{e}");
}

#[test]
fn huge_string_and_array_lengths_are_refused_without_allocating() {
    // Above llama.cpp's 2^30 limit.
    let mut bytes = good_file();
    let key_len_at = find(&bytes, b"general.architecture") - 8;
    put_u64(&mut bytes, key_len_at, u64::MAX);
    assert!(matches!(
        parse_err(&bytes).kind(),
        ErrorKind::LengthTooLarge { len: u64::MAX, .. }
    ));

    // Below the limit but beyond the end of the file: truncated, nothing allocated first.
    let mut bytes = good_file();
    let value_at = value_field(&bytes, "general.architecture") + 4;
    put_u64(&mut bytes, value_at, (1 << 30) - 1);
    assert!(matches!(
        parse_err(&bytes).kind(),
        ErrorKind::Truncated {
            section: Section::Metadata,
            needed,
            ..
        } if *needed == (1 << 30) - 1
    ));

    // Array counts: 2^40 elements is over the limit; 2^29 strings would need 4 GiB of lengths alone.
    let count_at = value_field(&bytes, "tokenizer.ggml.tokens") + 4 + 4;
    let mut bytes = good_file();
    put_u64(&mut bytes, count_at, 1 << 40);
    assert!(matches!(
        parse_err(&bytes).kind(),
        ErrorKind::LengthTooLarge { len, .. } if *len == 1 << 40
    ));
    put_u64(&mut bytes, count_at, 1 << 29);
    assert!(matches!(
        parse_err(&bytes).kind(),
        ErrorKind::Truncated {
            section: Section::Metadata,
            ..
        }
    ));

    // Huge counts of pairs and tensors: refused by truncation, reservations capped by the input.
    let raw = Raw::new(3, u64::MAX, u64::MAX);
    assert!(matches!(
        parse_err(&raw.0).kind(),
        ErrorKind::Truncated { .. }
    ));
    let raw = Raw::new(3, u64::MAX, 0);
    assert!(matches!(
        parse_err(&raw.0).kind(),
        ErrorKind::Truncated {
            section: Section::TensorInfo,
            ..
        }
    ));
}

#[test]
fn misaligned_and_out_of_order_offsets() {
    let mut bytes = good_file();
    let at = offset_field(&bytes, "tensor_b", 2);
    let h = parse_gguf_bytes(&bytes, "good").unwrap();
    let rel_b = h.tensors[1].offset - h.data_offset;
    put_u64(&mut bytes, at, rel_b + 1);
    let e = parse_err(&bytes);
    assert!(
        matches!(e.kind(), ErrorKind::MisalignedOffset { tensor, alignment: 32, .. } if tensor == "tensor_b"),
        "{e}"
    );

    // Aligned, inside the file, but not where llama.cpp expects it (back to back, in order).
    let mut bytes = good_file();
    put_u64(&mut bytes, at, 0);
    let e = parse_err(&bytes);
    assert!(
        matches!(e.kind(), ErrorKind::UnexpectedOffset { tensor, offset: 0, expected } if tensor == "tensor_b" && *expected == rel_b),
        "{e}"
    );
}

#[test]
fn bad_alignment_values() {
    let mut w = GgufWriter::new();
    w.set_alignment(64).unwrap();
    w.add_tensor("t", GgmlType::F32, &[4]).unwrap();
    let good = w.to_bytes(fill).unwrap();
    let at = value_field(&good, "general.alignment") + 4;
    for bad in [0u32, 48, 3, u32::MAX] {
        let mut bytes = good.clone();
        put_u32(&mut bytes, at, bad);
        let e = parse_err(&bytes);
        assert!(
            matches!(e.kind(), ErrorKind::BadAlignment { .. }),
            "{bad}: {e}"
        );
    }
    // The right value with the wrong type (llama.cpp requires u32).
    let raw = Raw::new(3, 0, 1).str(b"general.alignment").u32(10).u64(32);
    assert!(matches!(
        parse_err(&raw.0).kind(),
        ErrorKind::BadAlignment { .. }
    ));
}

#[test]
fn too_many_dims() {
    let mut bytes = good_file();
    let at = tensor_fields(&bytes, "tensor_a");
    put_u32(&mut bytes, at, 5);
    assert!(matches!(
        parse_err(&bytes).kind(),
        ErrorKind::TooManyDims { n_dims: 5, .. }
    ));
    put_u32(&mut bytes, at, u32::MAX);
    assert!(matches!(
        parse_err(&bytes).kind(),
        ErrorKind::TooManyDims { .. }
    ));
}

/// llama.cpp accepts zero dimensions (non-negative `ne`) and zero-dimensional tensors (all `ne` 1);
/// so do we.
#[test]
fn zero_sized_and_scalar_tensors_are_legal() {
    let mut w = GgufWriter::new();
    w.add_tensor("zero", GgmlType::F32, &[0, 5]).unwrap();
    w.add_tensor("zero_rows", GgmlType::Q4_K, &[256, 0])
        .unwrap();
    w.add_tensor("scalar", GgmlType::F32, &[]).unwrap();
    w.add_tensor("after", GgmlType::F32, &[3]).unwrap();
    let bytes = w.to_bytes(fill).unwrap();
    let h = parse_gguf_bytes(&bytes, "zero").expect("legal");
    let sizes: Vec<(u64, u64)> = h
        .tensors
        .iter()
        .map(|t| (t.n_elements(), t.n_bytes))
        .collect();
    assert_eq!(sizes, [(0, 0), (0, 0), (1, 4), (3, 12)]);
    // A zero-sized tensor takes no room: the next one starts at the same offset.
    assert_eq!(h.tensors[0].offset, h.tensors[1].offset);
    assert_eq!(h.tensors[1].offset, h.tensors[2].offset);
}

#[test]
fn row_not_a_multiple_of_the_block() {
    let mut bytes = good_file();
    let at = tensor_fields(&bytes, "tensor_b") + 4;
    put_u64(&mut bytes, at, 48);
    let e = parse_err(&bytes);
    assert!(
        matches!(e.kind(), ErrorKind::NotBlockMultiple { tensor, ne0: 48, block: 32, ty: "Q8_0" } if tensor == "tensor_b"),
        "{e}"
    );
    // A quantized tensor without dimensions has ne0 = 1.
    let mut bytes = good_file();
    put_u32(&mut bytes, at - 4, 0);
    // (shift the rest of the info: drop the two dims)
    bytes.drain(at..at + 16);
    assert!(matches!(
        parse_err(&bytes).kind(),
        ErrorKind::NotBlockMultiple { ne0: 1, .. }
    ));
}

#[test]
fn tensor_name_too_long() {
    let name = vec![b'n'; 64];
    let raw = Raw::new(3, 1, 0).str(&name).u32(1).u64(1).u32(0).u64(0);
    assert!(matches!(
        parse_err(&raw.0).kind(),
        ErrorKind::TensorNameTooLong { len: 64, .. }
    ));
}

#[test]
fn arrays_nested_too_deeply() {
    // 17 nested arrays, each holding one array, the last one empty u8.
    let mut raw = Raw::new(3, 0, 1).str(b"deep").u32(9);
    for _ in 0..17 {
        raw = raw.u32(9).u64(1);
    }
    raw = raw.u32(0).u64(0);
    assert!(matches!(parse_err(&raw.0).kind(), ErrorKind::ArrayTooDeep { key } if key == "deep"));
    // 16 levels are fine.
    let mut raw = Raw::new(3, 0, 1).str(b"deep").u32(9);
    for _ in 0..15 {
        raw = raw.u32(9).u64(1);
    }
    raw = raw.u32(0).u64(0);
    let h = parse_gguf_bytes(&raw.0, "deep").expect("16 levels");
    let depth = h.metadata.get("deep").unwrap().as_array().unwrap().depth();
    assert_eq!(depth, 16);
}

#[test]
fn invalid_utf8_strings() {
    let raw = Raw::new(3, 0, 1).str(b"k").u32(8).str(&[0xff, 0xfe]);
    assert!(matches!(
        parse_err(&raw.0).kind(),
        ErrorKind::InvalidUtf8 { .. }
    ));
}

/// Issue 17: a `block_count` of 2^32-1 made the engine size per-layer tables by it (16 GiB) and abort;
/// `inspect` and the server's registry read the file as fine. It is an error wherever the file is used
/// as a model.
#[test]
fn a_block_count_above_the_tensor_count_is_an_error() {
    let mut bytes = good_file();
    let at = value_field(&bytes, "llama.block_count") + 4;
    put_u32(&mut bytes, at, u32::MAX);
    let dir = TempDir::new("block-count");
    let path = dir.0.join("blocks.gguf");
    std::fs::write(&path, &bytes).expect("write");
    let file = GgufFile::open(&path).expect("the file itself reads");
    let e = file.check_counts().expect_err("too many blocks");
    assert!(
        e.to_string()
            .contains("4294967295 (more blocks than the file's 3 tensors)"),
        "{e}"
    );
    let e = poly_models::summary::ModelSummary::of(&file).expect_err("the summary refuses it");
    assert!(e.to_string().contains("llama.block_count"), "{e}");
    // Within the tensor count it is fine.
    let good = dir.0.join("good.gguf");
    std::fs::write(&good, good_file()).expect("write");
    let f = GgufFile::open(&good).expect("open");
    assert!(f.check_counts().is_ok());
    assert!(poly_models::summary::ModelSummary::of(&f).is_ok());
}
