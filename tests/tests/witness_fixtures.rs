//! The committed witness fixtures are complete and consistent: every reference parses and passes its
//! own checks, names a committed model whose SHA-256 it records (or says how to fetch one that is not
//! committed), and every architecture has two type mixes (glm5-next and deepseek4: F32 and Q8_0, their
//! tiny shapes being too narrow for Q4_K rows) with the five prompt lengths; the fixture models open
//! with our GGUF reader and have the types their names promise. (The engine comparison itself is
//! tests/tests/witness_cpu.rs.)

use std::collections::{BTreeMap, BTreeSet};

use poly_kernels::quant::GgmlType;
use poly_models::GgufFile;
use poly_tests::fixtures_dir;
use poly_tests::witness::{load_references, references_dir, sha256_file};

const SYNTH_PROMPT_LENGTHS: [usize; 5] = [25, 100, 500, 2000, 4000];
/// The committed models together stay small (the brief aims at 15 MB; the tiny shapes make it larger:
/// this bounds growth, see tests/witness/README.md). 40 MiB held the first four architectures; lfm2moe's
/// two files (2.5 and 3.1 MiB) moved it to 48; gemma4's two (1.3 and 1.4 MiB) fit under it (46.5 MiB);
/// glm5-next's F32 and Q8_0 files (2.8 and 1.1 MiB) moved it to 51 (50.4 MiB); deepseek4's (3.0 and 1.0
/// MiB) to 55 (54.4 MiB).
const MAX_FIXTURE_MODEL_BYTES: u64 = 55 << 20;

#[test]
fn every_reference_matches_a_committed_or_fetchable_model() {
    let refs = load_references(&references_dir()).expect("references load");
    let models_dir = fixtures_dir().join("models");
    let mut hashes: BTreeMap<String, String> = BTreeMap::new();
    for r in &refs {
        assert_eq!(r.steps.len(), 64, "{}", r.label());
        assert!(
            r.steps.iter().all(|s| s.top.len() == 5),
            "{}: five likeliest per step",
            r.label()
        );
        if let Some(fetch) = &r.model_fetch {
            assert!(
                fetch.contains("fetch_gemma.sh") || fetch.contains("fetch_smollm2.sh"),
                "{}: fetch command {fetch}",
                r.label()
            );
            assert!(
                !models_dir.join(&r.model).exists(),
                "{} is not meant to be committed",
                r.model
            );
            continue;
        }
        let sha = hashes.entry(r.model.clone()).or_insert_with(|| {
            sha256_file(&models_dir.join(&r.model)).unwrap_or_else(|e| panic!("{}: {e}", r.model))
        });
        assert_eq!(
            *sha,
            r.model_sha256,
            "{}: model changed since its reference was made",
            r.label()
        );
    }

    // Each architecture: two fixture models, each with the five synthetic prompt lengths.
    let mut per_arch: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for r in refs.iter().filter(|r| r.model_fetch.is_none()) {
        per_arch.entry(&r.arch).or_default().insert(&r.model);
    }
    for arch in [
        "qwen3moe",
        "qwen35moe",
        "gemma3",
        "llama",
        "lfm2moe",
        "gemma4",
        "glm5-next",
        "deepseek4",
    ] {
        let models = per_arch.get(arch).cloned().unwrap_or_default();
        assert!(models.len() >= 2, "{arch}: {models:?}");
        for m in models {
            let lens: Vec<usize> = refs
                .iter()
                .filter(|r| r.model == m)
                .map(|r| r.prompt.len())
                .collect();
            assert_eq!(lens, SYNTH_PROMPT_LENGTHS, "{m}: prompt lengths");
        }
    }
    let real = |arch: &str| -> Vec<usize> {
        refs.iter()
            .filter(|r| r.model_fetch.is_some() && r.arch == arch)
            .map(|r| r.prompt.len())
            .collect()
    };
    assert_eq!(real("llama").len(), 5, "five SmolLM2-135M text prompts");
    let gemma = real("gemma3");
    assert_eq!(gemma.len(), 5, "five Gemma 3 270M text prompts");
    assert!(
        gemma.iter().any(|&n| n > 512 + 64),
        "a Gemma prompt crosses the 512-token window"
    );
}

#[test]
fn fixture_models_open_and_have_the_promised_types() {
    let dir = fixtures_dir().join("models");
    let mut total = 0;
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("fixtures/models") {
        let path = entry.expect("dir entry").path();
        if path.extension().is_none_or(|x| x != "gguf") {
            continue;
        }
        seen += 1;
        total += std::fs::metadata(&path).expect("metadata").len();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .expect("name")
            .to_owned();
        let f = GgufFile::open(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
        let arch = f.architecture().expect("architecture").to_owned();
        assert!(
            name.starts_with(&format!("{arch}-tiny-")),
            "{name} holds {arch}"
        );
        let types_of = |pat: &str| -> BTreeSet<GgmlType> {
            f.tensor_infos()
                .iter()
                .filter(|t| t.name.contains(pat))
                .map(|t| t.ty)
                .collect()
        };
        if name.ends_with("-q4k-q8.gguf") {
            let big = match arch.as_str() {
                "gemma3" | "llama" => "ffn_up",
                // Gemma 4's experts hold gate and up in one tensor.
                "gemma4" => "ffn_gate_up_exps",
                _ => "ffn_up_exps",
            };
            assert_eq!(
                types_of(big),
                BTreeSet::from([GgmlType::Q4_K]),
                "{name}: {big}"
            );
            assert_eq!(
                types_of("attn_q.weight"),
                BTreeSet::from([GgmlType::Q8_0]),
                "{name}: attn_q"
            );
        } else if name.ends_with("-q4km.gguf") {
            // llama.cpp's Q4_K_M recipe: mostly Q4_K, some tensors raised to Q6_K.
            let all: BTreeSet<GgmlType> = f.tensor_infos().iter().map(|t| t.ty).collect();
            assert!(
                all.contains(&GgmlType::Q4_K) && all.contains(&GgmlType::Q6_K),
                "{name}: {all:?}"
            );
        } else if name.ends_with("-q8_0.gguf") {
            // synth's default for the shape: every quantizable class Q8_0.
            // (deepseek4's query projection is attn_q_b, after its latent.)
            let attn_q = if arch == "deepseek4" {
                "attn_q_b.weight"
            } else {
                "attn_q.weight"
            };
            for pat in ["ffn_up_exps", attn_q, "token_embd"] {
                assert_eq!(
                    types_of(pat),
                    BTreeSet::from([GgmlType::Q8_0]),
                    "{name}: {pat}"
                );
            }
        } else if name.ends_with("-f32.gguf") {
            // Every tensor as synth writes it in F32 (glm5-next's witness: tests/witness/README.md), but
            // deepseek4's hash-routing table, which is I32.
            let all: BTreeSet<GgmlType> = f
                .tensor_infos()
                .iter()
                .filter(|t| !t.name.contains("ffn_gate_tid2eid"))
                .map(|t| t.ty)
                .collect();
            assert_eq!(all, BTreeSet::from([GgmlType::F32]), "{name}");
        } else {
            panic!("unexpected fixture model {name}");
        }
    }
    assert!(seen >= 16, "expected sixteen fixture models, found {seen}");
    assert!(
        total <= MAX_FIXTURE_MODEL_BYTES,
        "fixture models take {total} bytes"
    );
}
