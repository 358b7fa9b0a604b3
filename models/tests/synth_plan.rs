//! Plans of synthetic models without writing them: routing estimates, type choices and fallbacks, refused
//! types, and the real shapes' sizes.

use poly_kernels::quant::GgmlType;
use poly_models::arch::{Dim, TensorClass};
use poly_models::synth::plan::TypeChoice;
use poly_models::synth::shapes::{all_shapes, find_shape};
use poly_models::synth::{check_class_type, SynthOptions, Synthesis};

fn prepare(arch: &str, shape: &str, types: TypeChoice, skew: f32) -> Synthesis {
    let shape = find_shape(arch, shape).expect("shape");
    Synthesis::prepare(&SynthOptions {
        shape,
        types,
        seed: 5,
        route_skew: skew,
    })
    .expect("prepare")
}

fn default_types(arch: &str, shape: &str) -> TypeChoice {
    TypeChoice {
        default: find_shape(arch, shape).expect("shape").default_type,
        overrides: Vec::new(),
    }
}

fn mean_top10(s: &Synthesis) -> f64 {
    s.routing.iter().map(|r| r.stats.top10_share).sum::<f64>() / s.routing.len() as f64
}

#[test]
fn routers_reach_every_expert_and_skew_concentrates() {
    for arch in ["qwen3moe", "qwen35moe"] {
        let flat = prepare(arch, "tiny", default_types(arch, "tiny"), 0.0);
        let n_blocks = flat.shape.hparams.as_dyn().n_layer_all() as usize;
        assert_eq!(
            flat.routing.len(),
            n_blocks,
            "{arch}: one router per block (MTP included)"
        );
        assert!(
            flat.routing.iter().all(|r| r.stats.all_reached),
            "{arch}: skew 0 reaches every expert"
        );
        let skewed = prepare(arch, "tiny", default_types(arch, "tiny"), 2.0);
        assert!(
            mean_top10(&skewed) > mean_top10(&flat) + 0.03,
            "{arch}: {} vs {}",
            mean_top10(&skewed),
            mean_top10(&flat)
        );
    }
    // The real Qwen3 shape at skew 1 looks like a real model: the top 10% take 25–35%, all experts used.
    let real = prepare(
        "qwen3moe",
        "qwen3-30b-a3b",
        default_types("qwen3moe", "small"),
        1.0,
    );
    let share = mean_top10(&real);
    assert!((0.22..0.36).contains(&share), "{share}");
    assert!(real.routing.iter().all(|r| r.stats.all_reached));
}

#[test]
fn class_overrides_and_llama_cpp_fallbacks() {
    let types = TypeChoice {
        default: GgmlType::Q4_K,
        overrides: vec![
            (TensorClass::Expert, GgmlType::Q2_K),
            (TensorClass::Attention, GgmlType::Q8_0),
            (TensorClass::Embedding, GgmlType::Q6_K),
            (TensorClass::Router, GgmlType::BF16),
        ],
    };
    let s = prepare("qwen3moe", "tiny", types, 0.0);
    for t in &s.tensors {
        let want = match t.desc.class {
            TensorClass::Expert => GgmlType::Q2_K,
            TensorClass::Attention => GgmlType::Q8_0,
            TensorClass::Embedding => GgmlType::Q6_K,
            TensorClass::Router => GgmlType::BF16,
            TensorClass::Norm => GgmlType::F32,
            _ => GgmlType::Q4_K,
        };
        assert_eq!(t.ty, want, "{}", t.desc.name);
        assert!(
            t.fell_back_from.is_none(),
            "tiny rows are whole 256-blocks: {}",
            t.desc.name
        );
    }
    // Gemma-3-270M rows are 640 wide: Q4_K falls back to Q5_0 as llama.cpp's quantizer does, except
    // where a row is a multiple of 256 (the FFN down projection, 2048 wide; attn_output, 1024 wide).
    let g = prepare(
        "gemma3",
        "gemma3-270m",
        TypeChoice {
            default: GgmlType::Q4_K,
            overrides: Vec::new(),
        },
        0.0,
    );
    let ty = |name: &str| {
        g.tensors
            .iter()
            .find(|t| t.desc.name == name)
            .expect(name)
            .ty
    };
    assert_eq!(ty("blk.0.attn_q.weight"), GgmlType::Q5_0);
    assert_eq!(ty("blk.0.ffn_up.weight"), GgmlType::Q5_0);
    assert_eq!(ty("blk.0.ffn_down.weight"), GgmlType::Q4_K);
    assert_eq!(ty("blk.0.attn_output.weight"), GgmlType::Q4_K);
    assert!(g
        .fallbacks()
        .all(|t| t.fell_back_from == Some(GgmlType::Q4_K)));
}

#[test]
fn refused_types() {
    assert!(check_class_type(TensorClass::Norm, GgmlType::Q8_0).is_err());
    assert!(check_class_type(TensorClass::DeltaNetParam, GgmlType::F16).is_err());
    assert!(check_class_type(TensorClass::Router, GgmlType::Q4_K).is_err());
    assert!(check_class_type(TensorClass::Router, GgmlType::F16).is_ok());
    assert!(
        check_class_type(TensorClass::Expert, GgmlType::Q8_K).is_err(),
        "not a weight type"
    );
    assert!(check_class_type(TensorClass::Expert, GgmlType::IQ2_XXS).is_ok());
    let shape = find_shape("qwen3moe", "tiny").expect("shape");
    let bad_skew = Synthesis::prepare(&SynthOptions {
        types: TypeChoice {
            default: GgmlType::Q8_0,
            overrides: Vec::new(),
        },
        shape,
        seed: 1,
        route_skew: -1.0,
    });
    assert!(bad_skew.is_err());
}

#[test]
fn real_shapes_have_the_published_sizes() {
    let q3 = prepare(
        "qwen3moe",
        "qwen3-30b-a3b",
        default_types("qwen3moe", "small"),
        0.0,
    );
    assert_eq!(q3.size_label, "30B-A3B");
    assert_eq!(q3.vocab.len(), 151_936);
    let q35 = prepare(
        "qwen35moe",
        "Qwen3.6-35B-A3B",
        default_types("qwen35moe", "small"),
        0.0,
    );
    assert_eq!(q35.size_label, "35B-A3B");
    let h = q35.shape.hparams.as_dyn();
    assert_eq!(h.n_layer_all(), 41, "40 blocks + MTP");
    assert_eq!(h.dim(Dim::SsmConvDim), Some(8192), "2·16·128 + 32·128");
    let n_full = (0..40)
        .filter(|&il| h.layer_kind(il) == poly_models::arch::LayerKind::Attention)
        .count();
    assert_eq!(n_full, 10);
    let g = prepare(
        "gemma3",
        "270m",
        default_types("gemma3", "gemma3-270m"),
        0.0,
    );
    assert_eq!(g.size_label, "268M");
    let smol = prepare(
        "llama",
        "smollm2-135m",
        default_types("llama", "smollm2-135m"),
        0.0,
    );
    // SmolLM2-135M's 134,515,008 parameters: the output tied to the embedding.
    assert_eq!(smol.size_label, "134M");
    let g4 = prepare(
        "gemma4",
        "26b-a4b",
        default_types("gemma4", "gemma-4-26b-a4b"),
        0.0,
    );
    // Google's 25.2B parameters, 3.8B active: the output tied to the embedding.
    assert_eq!(g4.size_label, "25B-A3B");
    // Every listed shape plans.
    assert_eq!(
        all_shapes().len(),
        22,
        "with deepseek4 tiny, tiny-mtp and deepseek-v4-flash"
    );
}
