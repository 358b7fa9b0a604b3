//! The `qwen35moe` forward pass on the CPU, end to end on a synthetic tiny model (written by `synth` into
//! a temporary directory): its layers carry the right state, and the recurrent state (conv window and
//! delta-rule matrices) carries across forward calls, so how a prompt is split into calls does not change
//! the result.

use std::path::PathBuf;
use std::sync::OnceLock;

use poly_engine::generate::prefill;
use poly_engine::Model;
use poly_kernels::quant::GgmlType;
use poly_models::arch::{Forward, ModelHparams, StateSpec};
use poly_models::synth::shapes::find_shape;

mod common;
use common::{max_diff, random_tokens, softmax, write_synth};

/// The tiny `qwen35moe` shape in Q8_0 (three delta-net blocks, one gated-attention block, an MTP block),
/// loaded once; the file is removed once mapped.
fn model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| tiny_model(None))
}

/// The tiny shape's model, with other `rope.dimension_sections` when given (same seed, same tensors).
fn tiny_model(sections: Option<[u32; 4]>) -> Model {
    {
        let tag = sections.map_or("default".to_string(), |s| {
            format!("{s:?}").replace(", ", "-")
        });
        let dir: PathBuf =
            std::env::temp_dir().join(format!("poly-engine-q35-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("qwen35moe-q8_0.gguf");
        let mut shape = find_shape("qwen35moe", "tiny").expect("a tiny shape");
        if let (Some(s), ModelHparams::Qwen35Moe(h)) = (sections, &mut shape.hparams) {
            h.rope_sections = s;
        }
        write_synth(shape, GgmlType::Q8_0, 3, &path);
        let model = Model::load(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        model
    }
}

/// llama.cpp runs a file whose `rope.dimension_sections` do not sum to `rope.dimension_count / 2`: ggml's
/// interleaved multi-section RoPE takes rotated pair i's sector as i mod the sections' sum. For the tiny
/// shape's 8 rotated pairs, [2, 2, 2, 0] (sum 6) puts every pair in a text section, as [3, 3, 2, 0] does,
/// so with text positions both are NeoX RoPE over the same pairs and the logits are the same.
#[test]
fn rope_sections_that_do_not_sum_to_the_rotated_pairs_run_as_in_llama_cpp() {
    let odd = tiny_model(Some([2, 2, 2, 0]));
    let base = model();
    let n_vocab = base.info().n_vocab;
    let prompt = random_tokens(20, n_vocab, 4);
    let logits = |m: &Model| {
        let mut state = m.new_state(64);
        prefill(m, &mut state, &prompt, 512).unwrap()
    };
    assert_eq!(logits(&odd), logits(base));
}

#[test]
fn trunk_layers_carry_recurrent_or_kv_state_by_kind() {
    let g = model().graph();
    let states = g.layer_states();
    // full_attention_interval 4: blocks 0-2 are delta-net, block 3 attention; the MTP block has none.
    assert_eq!(states.len(), 4);
    for (il, s) in states.iter().enumerate() {
        match (il, s) {
            (
                3,
                StateSpec::Kv {
                    n_head_kv: 2,
                    window: None,
                    ..
                },
            ) => {}
            (
                0..=2,
                &StateSpec::Recurrent {
                    conv_kernel: 4,
                    conv_channels,
                    n_v_heads: 4,
                    head_k,
                    head_v,
                },
            ) => {
                // Q and K over 2 key heads, V over 4 value heads.
                assert_eq!(conv_channels, 2 * 2 * head_k + 4 * head_v, "layer {il}");
            }
            _ => panic!("layer {il}: unexpected state {s:?}"),
        }
    }
}

#[test]
fn prompt_in_one_call_several_calls_or_token_by_token_gives_the_same_next_token() {
    common::check_prompt_splits(model(), 45, &[16, 7, 3, 1], 1e-3);
}

#[test]
fn logits_of_every_row_match_reading_one_token_at_a_time() {
    common::check_rows_match_single_tokens(model(), 1e-3);
}

#[test]
fn a_forked_state_continues_like_the_original() {
    common::check_forked_state_continues(model());
}

/// Rewrites the `qwen35moe` file at `src` in Clover's form (`clover_moe`): keys under `clover_moe.`, no
/// `rope.dimension_sections`, and each `ssm_a` as `A_log = ln(-A)` when `a_as_log` (else left as A, a file
/// that would be wrong: the control).
fn rewrite_as_clover(src: &std::path::Path, dst: &std::path::Path, a_as_log: bool) {
    use poly_models::gguf::{GgufFile, GgufWriter, Value};
    let file = GgufFile::open(src).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata().entries() {
        if k == "general.architecture" {
            w.add_kv(k.clone(), Value::from("clover_moe"));
        } else if k == "qwen35moe.rope.dimension_sections" {
            continue;
        } else {
            w.add_kv(k.replacen("qwen35moe.", "clover_moe.", 1), v.clone());
        }
    }
    let tensors: Vec<_> = file.tensors().collect();
    for t in &tensors {
        w.add_tensor(t.info.name.clone(), t.info.ty, &t.info.dims)
            .unwrap();
    }
    w.write_to_path(dst, |i, info, out| {
        let data = tensors[i].data;
        if a_as_log && info.name.ends_with(".ssm_a") {
            assert_eq!(info.ty, GgmlType::F32, "ssm_a is F32");
            for (o, a) in out.chunks_exact_mut(4).zip(data.chunks_exact(4)) {
                let a = f32::from_le_bytes(a.try_into().unwrap());
                assert!(a < 0.0, "qwen35moe's ssm_a holds -exp(A_log) < 0, not {a}");
                o.copy_from_slice(&(-a).ln().to_le_bytes());
            }
        } else {
            out.copy_from_slice(data);
        }
        Ok(())
    })
    .unwrap();
}

/// llama.cpp has no `clover_moe`; the witness is the `qwen35moe` original: the same tiny model
/// written in Clover's form (its `ssm_a` as `A_log`, no rope sections) gives the original's logits (within
/// the rounding of `-exp(ln(-A))`) and its greedy tokens; left with `A` in `ssm_a` it does not, so the
/// load maps the values.
#[test]
fn a_qwen35moe_file_in_clovers_form_gives_the_originals_outputs() {
    let dir = std::env::temp_dir().join(format!("poly-engine-clover-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("qwen35moe.gguf");
    write_synth(
        find_shape("qwen35moe", "tiny").expect("a tiny shape"),
        GgmlType::Q8_0,
        3,
        &src,
    );
    let (clover, wrong) = (dir.join("clover.gguf"), dir.join("clover-a-not-log.gguf"));
    rewrite_as_clover(&src, &clover, true);
    rewrite_as_clover(&src, &wrong, false);
    let (original, clover, wrong) = (
        Model::load(&src).unwrap(),
        Model::load(&clover).unwrap(),
        Model::load(&wrong).unwrap(),
    );
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(clover.info().arch, "clover_moe");
    let n_vocab = original.info().n_vocab;
    let prompt = random_tokens(24, n_vocab, 9);
    // The prompt's last logits, then 8 greedy tokens one by one.
    let run = |m: &Model| {
        let mut state = m.new_state(64);
        let mut logits = prefill(m, &mut state, &prompt, 512).unwrap();
        let mut out = vec![softmax(&logits)];
        let mut tokens = Vec::new();
        for _ in 0..8 {
            let t = logits
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0 as u32;
            tokens.push(t);
            logits = prefill(m, &mut state, &[t], 512).unwrap();
            out.push(softmax(&logits));
        }
        (out, tokens)
    };
    let (p0, t0) = run(&original);
    let (p1, t1) = run(&clover);
    let (p2, _) = run(&wrong);
    assert_eq!(t1, t0, "greedy tokens");
    let worst = p0
        .iter()
        .zip(&p1)
        .map(|(a, b)| max_diff(a, b))
        .fold(0.0, f64::max);
    assert!(worst < 1e-4, "probabilities differ by {worst}");
    let wrong_worst = p0
        .iter()
        .zip(&p2)
        .map(|(a, b)| max_diff(a, b))
        .fold(0.0, f64::max);
    assert!(
        wrong_worst > 100.0 * worst.max(1e-7),
        "a Clover file read without its value map was not told apart ({wrong_worst} vs {worst})"
    );
}
