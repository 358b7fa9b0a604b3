//! Tiny synthetic files of every architecture: written, re-opened with the reader, checked against the
//! architecture's table and metadata; deterministic for a seed whatever the thread count; values scaled
//! as planned.

use poly_kernels::quant::{self, GgmlType};
use poly_models::arch::{
    resolve_tensors, LayerKind, LayerSel, ModelGraph, ModelHparams, Presence, Role, TensorClass,
};
use poly_models::gguf::GgufFile;
use poly_models::synth::plan::TypeChoice;
use poly_models::synth::shapes::{find_shape, Shape};
use poly_models::synth::{SynthOptions, Synthesis};
use std::path::PathBuf;

const ARCHS: &[&str] = &["qwen3moe", "qwen35moe", "gemma3", "glm5-next", "deepseek4"];

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("poly-synth-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

fn tiny(arch: &str) -> Shape {
    find_shape(arch, "TINY").expect("tiny shape (names are case-insensitive)")
}

fn options(shape: Shape, seed: u64, skew: f32) -> SynthOptions {
    SynthOptions {
        types: TypeChoice {
            default: shape.default_type,
            overrides: Vec::new(),
        },
        shape,
        seed,
        route_skew: skew,
    }
}

fn write(opts: &SynthOptions, name: &str) -> (Synthesis, PathBuf) {
    let s = Synthesis::prepare(opts).expect("prepare");
    let path = tmp(name);
    s.write(&path, |_, _| {}).expect("write");
    (s, path)
}

fn rms(v: &[f32]) -> f64 {
    (v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / v.len() as f64).sqrt()
}

fn values(file: &GgufFile, name: &str) -> Vec<f32> {
    let t = file
        .tensor(name)
        .unwrap_or_else(|| panic!("{name} missing"));
    let mut out = vec![0f32; t.info.n_elements() as usize];
    quant::dequantize(t.ty(), t.data, &mut out).expect("dequantize");
    out
}

#[test]
fn tiny_files_match_their_architecture() {
    for &arch in ARCHS {
        let opts = options(tiny(arch), 7, 0.0);
        let (s, path) = write(&opts, &format!("{arch}.gguf"));
        let file = GgufFile::open(&path).expect("open");
        let md = file.metadata();
        assert_eq!(md.architecture().expect("arch"), arch);
        assert_eq!(
            md.name().expect("name"),
            Some(format!("PolyStrata synthetic {arch} tiny").as_str())
        );
        assert!(md.size_label().expect("size label").is_some());
        assert_eq!(
            md.get_u32("general.file_type").expect("file type"),
            Some(7),
            "Q8_0"
        );
        assert_eq!(md.tokenizer_model().expect("tokenizer"), "gpt2");
        assert_eq!(md.tokenizer_tokens().expect("tokens").len(), s.vocab.len());
        assert!(md
            .tokenizer_merges()
            .expect("merges")
            .is_some_and(|m| !m.is_empty()));
        assert!(md
            .chat_template()
            .expect("template")
            .is_some_and(|t| t.contains("<|im_start|>")));
        let eos = md.eos_token_id().expect("eos").expect("eos id") as usize;
        assert_eq!(md.tokenizer_tokens().expect("tokens")[eos], "<|im_end|>");

        // The hyperparameters read back are the shape's, and every table tensor is there with its shape.
        let hp = ModelHparams::from_metadata(md).expect("hparams from metadata");
        assert_eq!(hp, opts.shape.hparams, "{arch}: metadata round trip");
        let expected = resolve_tensors(hp.as_dyn()).expect("tensors");
        assert_eq!(file.n_tensors(), expected.len(), "{arch}: no extra tensors");
        for d in &expected {
            let info = file
                .tensor_info(&d.name)
                .unwrap_or_else(|| panic!("{arch}: {} missing", d.name));
            assert_eq!(info.dims, d.dims, "{}", d.name);
            let want = if let Some(fixed) = d.class.fixed_type() {
                fixed
            } else if d.dims.len() == 1 || d.class == TensorClass::Router {
                GgmlType::F32
            } else {
                GgmlType::Q8_0
            };
            assert_eq!(info.ty, want, "{}", d.name);
        }
        // Every required row of the table is represented in some block (MTP rows where the shape has
        // an MTP block: deepseek4's tiny shape, like converted trunk files, has none).
        let h = hp.as_dyn();
        let has_mtp = (0..h.n_layer_all()).any(|il| h.layer_kind(il) == LayerKind::NextN);
        for def in h.tensor_defs() {
            if def.layers == Some(LayerSel::NextN) && !has_mtp {
                continue;
            }
            if def.presence == Presence::Required {
                assert!(
                    expected.iter().any(|d| d.role == def.role),
                    "{arch}: {:?} never written",
                    def.role
                );
            }
        }
        std::fs::remove_file(&path).ok();
    }
}

/// A `deepseek4` file binds against its table (its hash-routing table as I32 integers, whatever the
/// weights' type) into a forward pass whose operations only the CPU runs; its hash table names, for
/// every token, distinct experts of the model.
#[test]
fn a_deepseek4_file_binds_into_a_forward_pass_only_the_cpu_runs() {
    let (_, path) = write(&options(tiny("deepseek4"), 5, 0.0), "deepseek4-graph.gguf");
    let file = GgufFile::open(&path).expect("open");
    let hp = ModelHparams::from_metadata(file.metadata()).expect("hparams");
    let ModelHparams::Deepseek4(h) = &hp else {
        panic!("not deepseek4: {hp:?}");
    };
    let graph = ModelGraph::from_file(&file).expect("deepseek4 binds");
    let ops = graph
        .uses(&file)
        .needs_cpu_only_ops()
        .expect("CPU-only operations");
    assert!(ops.contains("DeepSeek V4"), "{ops}");
    let table = file
        .tensor("blk.0.ffn_gate_tid2eid.weight")
        .expect("hash table");
    assert_eq!(table.ty(), GgmlType::I32);
    let ids: Vec<i32> = table
        .data
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let k = h.n_expert_used as usize;
    assert_eq!(ids.len(), k * h.n_vocab as usize);
    let mut seen = vec![0usize; h.n_expert as usize];
    for row in ids.chunks_exact(k) {
        assert!(
            row.iter().all(|&e| (0..h.n_expert as i32).contains(&e)),
            "{row:?}"
        );
        assert!(
            row.iter().enumerate().all(|(i, e)| !row[..i].contains(e)),
            "{row:?}"
        );
        for &e in row {
            seen[e as usize] += 1;
        }
    }
    assert!(
        seen.iter().all(|&n| n > 0),
        "every expert is some token's: {seen:?}"
    );
    std::fs::remove_file(&path).ok();
}

/// A `glm5-next` file is read and bound against its table into a forward pass whose operations only the
/// CPU runs (so a card refuses it at load, with these names).
#[test]
fn a_glm5_next_file_binds_into_a_forward_pass_only_the_cpu_runs() {
    let (_, path) = write(&options(tiny("glm5-next"), 5, 0.0), "glm5-next-graph.gguf");
    let file = GgufFile::open(&path).expect("open");
    let graph = ModelGraph::from_file(&file).expect("glm5-next binds");
    let uses = graph.uses(&file);
    let ops = uses
        .needs_cpu_only_ops()
        .expect("operations only the CPU runs");
    for what in ["mHC", "k-pool", "per key channel", "per-head", "layer norm"] {
        assert!(ops.contains(what), "{what}: {ops}");
    }
    std::fs::remove_file(&path).ok();
}

#[test]
fn same_seed_same_bytes_whatever_the_threads() {
    for &arch in ARCHS {
        let opts = options(tiny(arch), 11, 1.0);
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .expect("pool");
        let (_, a) = one.install(|| write(&opts, &format!("{arch}-a.gguf")));
        let three = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("pool");
        let (_, b) = three.install(|| write(&opts, &format!("{arch}-b.gguf")));
        let (_, c) = write(&options(tiny(arch), 12, 1.0), &format!("{arch}-c.gguf"));
        let (a_bytes, b_bytes, c_bytes) = (
            std::fs::read(&a).expect("a"),
            std::fs::read(&b).expect("b"),
            std::fs::read(&c).expect("c"),
        );
        assert!(a_bytes == b_bytes, "{arch}: same seed, different bytes");
        assert!(
            a_bytes != c_bytes,
            "{arch}: another seed gave the same bytes"
        );
        for p in [a, b, c] {
            std::fs::remove_file(p).ok();
        }
    }
}

#[test]
fn values_are_scaled_as_planned() {
    let (s, path) = write(&options(tiny("qwen35moe"), 3, 0.0), "scaled.gguf");
    let file = GgufFile::open(&path).expect("open");
    let n_embd = 256f64;
    // Projections: RMS 1/sqrt(fan_in), zero mean.
    for name in [
        "blk.3.attn_q.weight",
        "blk.0.attn_qkv.weight",
        "blk.1.ffn_up_exps.weight",
    ] {
        let v = values(&file, name);
        let r = rms(&v);
        assert!((r * n_embd.sqrt() - 1.0).abs() < 0.1, "{name}: rms {r}");
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.05 * r, "{name}: mean {mean}");
    }
    // Norms near 1; the delta-net's A negative, dt bias negative.
    for name in [
        "blk.0.attn_norm.weight",
        "blk.0.ssm_norm.weight",
        "output_norm.weight",
    ] {
        let v = values(&file, name);
        assert!(v.iter().all(|&x| (x - 1.0).abs() < 0.2), "{name}");
    }
    assert!(values(&file, "blk.0.ssm_a")
        .iter()
        .all(|&a| (-2.0..-0.5).contains(&a)));
    assert!(values(&file, "blk.0.ssm_dt.bias")
        .iter()
        .all(|&d| (-2.0..-1.0).contains(&d)));
    // The output spreads logits by the target sigma on a unit-RMS hidden state.
    let out = values(&file, "output.weight");
    let sigma = rms(&out) * n_embd.sqrt();
    let target = poly_models::synth::plan::target_logit_sigma(s.vocab.len() as u64) as f64;
    assert!((sigma / target - 1.0).abs() < 0.1, "{sigma} vs {target}");
    std::fs::remove_file(&path).ok();
}

#[test]
fn gemma_ties_output_and_keeps_the_embedding_small() {
    let (_, path) = write(&options(tiny("gemma3"), 3, 0.0), "gemma.gguf");
    let file = GgufFile::open(&path).expect("open");
    assert!(
        file.tensor_info(Role::Output.pattern()).is_none(),
        "tied output"
    );
    let emb = rms(&values(&file, "token_embd.weight"));
    let norm = rms(&values(&file, "output_norm.weight"));
    // Input scale sqrt(n_embd)·rms stays below the blocks' sum; the output norm restores the logit scale.
    assert!(emb * 16.0 < 1.0, "embedding rms {emb}");
    assert!(norm > 4.0, "output norm {norm}");
    std::fs::remove_file(&path).ok();
}
