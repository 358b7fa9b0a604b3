//! Writes a few small valid GGUF files with the crate's writer as seeds:
//! `cargo +nightly run --release --bin make_seeds` fills `corpus/gguf_parse` and `corpus/gguf_open`.

use poly_kernels::quant::GgmlType;
use poly_models::gguf::{Array, GgufWriter, TensorInfo, Value};

fn fill(i: usize, _: &TensorInfo, out: &mut [u8]) -> std::io::Result<()> {
    for (j, b) in out.iter_mut().enumerate() {
        *b = (i * 31 + j) as u8;
    }
    Ok(())
}

fn model(n_tensors: usize, alignment: Option<u32>, version: u32) -> GgufWriter {
    let mut w = GgufWriter::new();
    w.set_version(version).expect("version");
    if let Some(a) = alignment {
        w.set_alignment(a).expect("alignment");
    }
    w.add_kv("general.architecture", "qwen3moe");
    w.add_kv("general.name", "seed");
    w.add_kv("qwen3moe.block_count", 2u32);
    w.add_kv("qwen3moe.rope.freq_base", 1e6f32);
    w.add_kv(
        "qwen3moe.attention.head_count_kv",
        Value::from(vec![2i32, 4]),
    );
    w.add_kv("tokenizer.ggml.model", "gpt2");
    w.add_kv(
        "tokenizer.ggml.tokens",
        Value::string_array(["a", "b", "ab"]),
    );
    w.add_kv("tokenizer.ggml.scores", Value::f32_array([0.0, -1.0, -2.0]));
    w.add_kv("tokenizer.ggml.token_type", Value::i32_array([1, 1, 1]));
    w.add_kv(
        "t.nested",
        Value::from(vec![Array::U8(vec![1]), Array::String(vec!["x".into()])]),
    );
    w.add_kv("t.values", Value::from(vec![1u64, 2]));
    w.add_kv("t.bool", true);
    w.add_kv("t.f64", 0.5f64);
    w.add_kv("t.i16", -3i16);
    let types = [
        GgmlType::F32,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::F16,
        GgmlType::MXFP4,
    ];
    for i in 0..n_tensors {
        let ty = types[i % types.len()];
        let dims = [ty.block_elems() as u64, (i % 3 + 1) as u64];
        w.add_tensor(format!("blk.{i}.weight"), ty, &dims)
            .expect("tensor");
    }
    w
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let parse_dir = std::path::Path::new("corpus/gguf_parse");
    let open_dir = std::path::Path::new("corpus/gguf_open");
    std::fs::create_dir_all(parse_dir)?;
    std::fs::create_dir_all(open_dir)?;
    let seeds = [
        ("empty", GgufWriter::new()),
        ("v3", model(3, None, 3)),
        ("v2", model(2, None, 2)),
        ("aligned64", model(4, Some(64), 3)),
        ("aligned1", model(2, Some(1), 3)),
        ("meta_only", model(0, None, 3)),
    ];
    for (name, w) in &seeds {
        let bytes = w.to_bytes(fill)?;
        std::fs::write(parse_dir.join(name), &bytes)?;
        std::fs::write(open_dir.join(name), &bytes)?;
    }
    // A split seed for gguf_open: `S`, u32 length of part 1, part 1, part 2.
    let tmp = std::env::temp_dir().join(format!("poly-make-seeds-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let parts = model(4, None, 3).write_split(tmp.join("s"), 2, fill)?;
    let p1 = std::fs::read(&parts[0])?;
    let p2 = std::fs::read(&parts[1])?;
    let mut split = vec![b'S'];
    split.extend_from_slice(&(p1.len() as u32).to_le_bytes());
    split.extend_from_slice(&p1);
    split.extend_from_slice(&p2);
    std::fs::write(open_dir.join("split2"), &split)?;
    std::fs::write(parse_dir.join("split_part1"), &p1)?;
    std::fs::write(parse_dir.join("split_part2"), &p2)?;
    std::fs::remove_dir_all(&tmp)?;
    println!("wrote {} seeds", seeds.len() * 2 + 3);
    Ok(())
}
