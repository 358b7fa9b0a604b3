//! Synthetic Gemma 4 projector (`mmproj`, `clip.projector_type` `gemma4v`) files of the real layout, with
//! random weights of sane scale: what llama.cpp's mtmd and [`crate::vision::gemma4v`] both load, so the
//! two encoders can be compared on the same file without the real weights.
//!
//! The metadata are the keys llama.cpp's converter writes for Gemma 4 (`Gemma4VisionAudioModel`:
//! `clip.vision.projector_type`, no `clip.use_gelu`, no scale factor, image size 224), the tensors those
//! of [`crate::vision::gemma4v::tensor_table`] plus `v.std_bias`, `v.std_scale` and the clamp scalars of
//! every product (`Gemma4ClippableLinear`), drawn near the spread of the normed activations so that the
//! clamping shows in the output (leaving it out moves the tiny projector's rows by about a quarter).
//! Matrices are drawn `N(0, 1/cols)`, norm weights near 1, the position tables of order 0.5. The file
//! depends only on the shape, the matrices' type and the seed.

use poly_kernels::quant::GgmlType;
use poly_kernels::rng::Rng;
use std::path::Path;

use super::mmproj::write_drawn;
use super::SynthError;
use crate::gguf::{GgufWriter, Value};
use crate::vision::gemma4v::{
    tensor_table, Activation, Gemma4vHparams, CLAMP_SUFFIXES, DEFAULT_MERGE, PROJECTOR_TYPE,
};

/// A named Gemma 4 projector shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma4vProjectorShape {
    pub name: &'static str,
    pub description: &'static str,
    pub hparams: Gemma4vHparams,
}

/// The projector shapes `synth --arch gemma4v-mmproj` knows.
pub fn gemma4v_projector_shapes() -> Vec<Gemma4vProjectorShape> {
    vec![Gemma4vProjectorShape {
        name: "tiny",
        description:
            "2 blocks 32 wide (2 heads of 16), MLP 64, patches of 16 pooled 3×3, position \
                      tables of 128, rows 256 wide (the tiny gemma4's embedding)",
        hparams: Gemma4vHparams {
            image_size: 224,
            patch_size: 16,
            n_embd: 32,
            n_ff: 64,
            n_layer: 2,
            n_head: 2,
            n_head_kv: 2,
            head_dim: 16,
            eps: 1e-6,
            n_out: 256,
            // Gemma 4's processor rescales to [0, 1] only; the graph maps to [−1, 1].
            image_mean: [0.0; 3],
            image_std: [1.0; 3],
            n_merge: DEFAULT_MERGE,
            n_pos: 128,
            activation: Activation::GeluQuick,
        },
    }]
}

/// The shape named `name` (case-insensitive).
pub fn find_gemma4v_projector_shape(name: &str) -> Option<Gemma4vProjectorShape> {
    gemma4v_projector_shapes()
        .into_iter()
        .find(|s| s.name.eq_ignore_ascii_case(name))
}

/// The products that carry clamp scalars: every block's seven and the input projection.
fn clippable(hp: &Gemma4vHparams) -> Vec<String> {
    (0..hp.n_layer)
        .flat_map(|il| {
            [
                "attn_q", "attn_k", "attn_v", "attn_out", "ffn_gate", "ffn_up", "ffn_down",
            ]
            .map(|p| format!("v.blk.{il}.{p}"))
        })
        .chain(std::iter::once("mm.input_projection".to_string()))
        .collect()
}

/// How a tensor's values are drawn.
fn draw(name: &str, dims: &[u64], rng: &mut Rng) -> Vec<f32> {
    let n = dims.iter().product::<u64>() as usize;
    let fan_in = dims[..dims.len().saturating_sub(1)].iter().product::<u64>() as f32;
    let is_norm = ["ln1.", "ln2.", "_norm.", "post_norm."]
        .iter()
        .any(|s| name.contains(s));
    if let Some(suffix) = CLAMP_SUFFIXES.iter().find(|s| name.ends_with(*s)) {
        // Normed inputs are of order 1: bounds of 2 to 3 (outputs 2.5 to 3.5) cut their tails.
        let bound = if suffix.starts_with("input") {
            2.0
        } else {
            2.5
        } + 0.5 * rng.normal().abs();
        let sign = if suffix.ends_with("min") { -1.0 } else { 1.0 };
        vec![sign * bound]
    } else if is_norm {
        (0..n).map(|_| 1.0 + 0.1 * rng.normal()).collect()
    } else if name.ends_with("out_scale.weight") {
        vec![0.8 + 0.1 * rng.normal()]
    } else if name == "v.std_bias" {
        (0..n).map(|_| 0.5 * rng.normal()).collect()
    } else if name == "v.std_scale" {
        (0..n).map(|_| 1.0 + 0.2 * rng.normal()).collect()
    } else if name == "v.position_embd.weight" {
        (0..n).map(|_| 0.5 * rng.normal()).collect()
    } else {
        let scale = 1.0 / fan_in.sqrt();
        (0..n).map(|_| scale * rng.normal()).collect()
    }
}

/// Writes a `gemma4v` projector of `shape` at `path`: matrices in `matrix_type` (F32, F16 or BF16), the
/// patch convolution in F16 with F16 matrices and F32 otherwise, and the position tables, norms and
/// scalars in F32 (what llama.cpp's converter does for `--outtype f32|f16|bf16`).
pub fn write_gemma4v_projector(
    shape: &Gemma4vProjectorShape,
    matrix_type: GgmlType,
    seed: u64,
    path: &Path,
) -> Result<(), SynthError> {
    if !matches!(matrix_type, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
        return Err(SynthError(format!(
            "projector matrices are written as F32, F16 or BF16, not {matrix_type}"
        )));
    }
    let hp = &shape.hparams;
    if hp.activation != Activation::GeluQuick
        || hp.n_merge != DEFAULT_MERGE
        || hp.n_head_kv != hp.n_head
        || hp.head_dim * hp.n_head != hp.n_embd
    {
        // The converter writes no key for these: a file of another value could not say so.
        return Err(SynthError(format!(
            "{}: gemma4v files written as llama.cpp's converter writes them have quick GELU, a merge of \
             {DEFAULT_MERGE}, as many K/V heads as heads and heads of n_embd / n_head",
            shape.name
        )));
    }
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", Value::String("clip".into()));
    w.add_kv("general.type", Value::String("mmproj".into()));
    w.add_kv(
        "general.name",
        Value::String(format!("synth gemma4v-mmproj {}", shape.name)),
    );
    w.add_kv("clip.has_vision_encoder", Value::Bool(true));
    w.add_kv(
        "clip.vision.projector_type",
        Value::String(PROJECTOR_TYPE.into()),
    );
    let u = |v: u32| Value::U32(v);
    w.add_kv("clip.vision.projection_dim", u(hp.n_out));
    w.add_kv("clip.vision.image_size", u(hp.image_size));
    w.add_kv("clip.vision.patch_size", u(hp.patch_size));
    w.add_kv("clip.vision.embedding_length", u(hp.n_embd));
    w.add_kv("clip.vision.feed_forward_length", u(hp.n_ff));
    w.add_kv("clip.vision.block_count", u(hp.n_layer));
    w.add_kv("clip.vision.attention.head_count", u(hp.n_head));
    let floats = |v: [f32; 3]| Value::from(v.to_vec());
    w.add_kv("clip.vision.image_mean", floats(hp.image_mean));
    w.add_kv("clip.vision.image_std", floats(hp.image_std));
    w.add_kv(
        "clip.vision.attention.layer_norm_epsilon",
        Value::F32(hp.eps),
    );
    let e = u64::from(hp.n_embd);
    let mut table = tensor_table(hp);
    table.push(("v.std_bias".into(), vec![e]));
    table.push(("v.std_scale".into(), vec![e]));
    for base in clippable(hp) {
        for suffix in CLAMP_SUFFIXES {
            table.push((format!("{base}.{suffix}"), vec![1]));
        }
    }
    let mut types = Vec::with_capacity(table.len());
    for (name, dims) in &table {
        let ty = if name == "v.patch_embd.weight" {
            if matrix_type == GgmlType::F16 {
                GgmlType::F16
            } else {
                GgmlType::F32
            }
        } else if dims.len() > 1 && name != "v.position_embd.weight" {
            matrix_type
        } else {
            GgmlType::F32
        };
        w.add_tensor(name.clone(), ty, dims)
            .map_err(|e| SynthError(e.to_string()))?;
        types.push(ty);
    }
    write_drawn(
        w,
        path,
        (&table, &types),
        (seed, 0x0067_3476_7072_6f6a),
        draw,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;
    use crate::vision::gemma4v::Gemma4vEncoder;
    use crate::vision::picture::RgbF32;
    use crate::vision::VisionEncoder;

    fn temp_dir(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("poly-g4v-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    #[test]
    fn the_tiny_gemma4v_projector_loads_with_the_hparams_it_was_written_with() {
        let dir = temp_dir("load");
        let path = dir.join("tiny.gguf");
        let shape = find_gemma4v_projector_shape("TINY").expect("tiny");
        write_gemma4v_projector(&shape, GgmlType::F16, 3, &path).expect("write");
        let file = GgufFile::open(&path).expect("open");
        let enc = Gemma4vEncoder::load(&file).expect("load");
        assert_eq!(enc.hp, shape.hparams);
        let ty = |name: &str| file.tensor_info(name).expect(name).ty;
        assert_eq!(ty("v.blk.0.attn_q.weight"), GgmlType::F16);
        assert_eq!(ty("v.patch_embd.weight"), GgmlType::F16);
        assert_eq!(ty("v.position_embd.weight"), GgmlType::F32);
        assert_eq!(ty("v.blk.1.attn_q.input_max"), GgmlType::F32);
        let generic = VisionEncoder::load(&file).expect("load");
        assert_eq!(generic.projector_type(), "gemma4v");
        assert_eq!(generic.out_width(), 256);
        assert_eq!(generic.default_token_limits(), (70, 1120));
        // The same seed writes the same bytes; another seed other weights.
        let again = dir.join("again.gguf");
        write_gemma4v_projector(&shape, GgmlType::F16, 3, &again).expect("write");
        assert_eq!(std::fs::read(&path).ok(), std::fs::read(&again).ok());
        write_gemma4v_projector(&shape, GgmlType::F16, 4, &again).expect("write");
        assert_ne!(std::fs::read(&path).ok(), std::fs::read(&again).ok());
        assert!(write_gemma4v_projector(&shape, GgmlType::Q8_0, 3, &again).is_err());
        // A picture whose sides are not multiples of 3 patches is refused, not cut.
        let odd = RgbF32 {
            width: 64,
            height: 48,
            values: vec![0.0; 64 * 48 * 3],
        };
        assert!(enc.encode(&odd).is_err());
        // 96×48: 6×3 patches pooled to 2×1 rows.
        let even = RgbF32 {
            width: 96,
            height: 48,
            values: (0..96 * 48 * 3).map(|i| (i % 7) as f32 / 7.0).collect(),
        };
        let rows = enc.encode(&even).expect("encode");
        assert_eq!((rows.n_x, rows.n_y, rows.width), (2, 1, 256));
        assert!(rows.values.iter().all(|v| v.is_finite()));
        // Wider than the position tables (128 patches a side): refused with the reason.
        let wide = RgbF32 {
            width: 48 * 43,
            height: 48,
            values: vec![0.5; 48 * 43 * 48 * 3],
        };
        let err = enc.encode(&wide).expect_err("refused");
        assert!(err.0.contains("position tables"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A change to a tensor table.
    type TableEdit = dyn Fn(&mut Vec<(String, Vec<u64>)>);

    #[test]
    fn a_corrupt_gemma4v_projector_is_refused_with_the_reason() {
        let dir = temp_dir("corrupt");
        let shape = find_gemma4v_projector_shape("tiny").expect("tiny");
        // A file like the tiny one with one tensor's shape changed, one left out or one added.
        let write = |path: &Path, edit: &TableEdit| {
            let mut table = tensor_table(&shape.hparams);
            edit(&mut table);
            let mut w = GgufWriter::new();
            w.add_kv(
                "clip.vision.projector_type",
                Value::String("gemma4v".into()),
            );
            for (key, v) in [
                ("clip.vision.projection_dim", 256),
                ("clip.vision.image_size", 224),
                ("clip.vision.patch_size", 16),
                ("clip.vision.embedding_length", 32),
                ("clip.vision.feed_forward_length", 64),
                ("clip.vision.block_count", 2),
                ("clip.vision.attention.head_count", 2),
            ] {
                w.add_kv(key, Value::U32(v));
            }
            w.add_kv("clip.vision.image_mean", Value::from(vec![0f32; 3]));
            w.add_kv("clip.vision.image_std", Value::from(vec![1f32; 3]));
            w.add_kv("clip.vision.attention.layer_norm_epsilon", Value::F32(1e-6));
            for (name, dims) in &table {
                w.add_tensor(name.clone(), GgmlType::F32, dims)
                    .expect("tensor");
            }
            w.write_to_path(path, |_, _, out| {
                out.fill(0);
                Ok(())
            })
            .expect("write");
        };
        let path = dir.join("bad.gguf");
        let cases: [(&TableEdit, &str); 4] = [
            (
                &|t| t.retain(|(n, _)| n != "v.blk.1.ffn_gate.weight"),
                "missing tensor v.blk.1.ffn_gate.weight",
            ),
            (
                &|t| {
                    for (n, d) in t.iter_mut() {
                        if n == "v.blk.0.attn_k.weight" {
                            *d = vec![32, 16];
                        }
                    }
                },
                "v.blk.0.attn_k.weight: dimensions [32, 16], expected [32, 32]",
            ),
            (
                &|t| t.push(("v.blk.0.attn_q.bias".into(), vec![32])),
                "tensor v.blk.0.attn_q.bias is not part of the gemma4v layout",
            ),
            (
                &|t| t.push(("v.std_bias".into(), vec![32])),
                "come together",
            ),
        ];
        for (edit, expect) in cases {
            write(&path, edit);
            let file = GgufFile::open(&path).expect("open");
            let err = Gemma4vEncoder::load(&file).err().expect("refused");
            assert!(err.0.contains(expect), "{err} (expected {expect:?})");
        }
        // The position table must be the two tables of [n_embd, n_pos, 2].
        write(&path, &|t| {
            for (n, d) in t.iter_mut() {
                if n == "v.position_embd.weight" {
                    *d = vec![32, 256];
                }
            }
        });
        let file = GgufFile::open(&path).expect("open");
        let err = Gemma4vEncoder::load(&file).err().expect("refused");
        assert!(err.0.contains("[n_embd, n_pos, 2]"), "{err}");
        // The untouched table loads (all zeros: the layout, not the values, is what is checked).
        write(&path, &|_| {});
        let file = GgufFile::open(&path).expect("open");
        assert!(Gemma4vEncoder::load(&file).is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
