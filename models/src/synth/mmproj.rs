//! Synthetic projector (`mmproj`) files of the vision encoders' real layouts, with random weights of sane
//! scale: what llama.cpp's mtmd and [`crate::vision`] both load, so the two encoders can be compared on the
//! same file without the real weights.
//!
//! Matrices are drawn `N(0, 1/cols)` (each output of order its input), biases and norm offsets small,
//! norm scales near 1, and the position table of order 0.5 so that its resampling shows in the output.
//! The file depends only on the shape, the matrices' type and the seed.

use poly_kernels::quant::GgmlType;
use poly_kernels::rng::Rng;
use std::path::Path;

use super::fill::{encode_floats, stream_seed};
use super::SynthError;
use crate::gguf::{GgufWriter, Value};
use crate::vision::qwen3vl::{tensor_table, Qwen3VlHparams, PROJECTOR_TYPE};

/// A named projector shape.
#[derive(Clone, Debug, PartialEq)]
pub struct ProjectorShape {
    pub name: &'static str,
    pub description: &'static str,
    pub hparams: Qwen3VlHparams,
}

/// Qwen's preprocessing constants (its `preprocessor_config.json`: mean and std 0.5 per channel).
const QWEN_MEAN_STD: [f32; 3] = [0.5, 0.5, 0.5];

/// The projector shapes `synth --arch qwen3vl-mmproj` knows.
pub fn projector_shapes() -> Vec<ProjectorShape> {
    vec![
        ProjectorShape {
            name: "tiny",
            description:
                "2 blocks 32 wide (2 heads), patches of 16, a 4×4 position table, rows 256 wide \
                          (the tiny qwen35moe's embedding)",
            hparams: Qwen3VlHparams {
                image_size: 64,
                patch_size: 16,
                n_embd: 32,
                n_ff: 64,
                n_layer: 2,
                n_head: 2,
                eps: 1e-6,
                n_out: 256,
                image_mean: QWEN_MEAN_STD,
                image_std: QWEN_MEAN_STD,
                n_pos_side: 4,
            },
        },
        ProjectorShape {
            name: "qwen3.6-35b-a3b",
            description:
                "Qwen3.6-35B-A3B's vision encoder: 27 blocks 1152 wide (16 heads), MLP 4304, \
                          patches of 16, a 48×48 position table, rows 2048 wide",
            hparams: Qwen3VlHparams {
                image_size: 768,
                patch_size: 16,
                n_embd: 1152,
                n_ff: 4304,
                n_layer: 27,
                n_head: 16,
                eps: 1e-6,
                n_out: 2048,
                image_mean: QWEN_MEAN_STD,
                image_std: QWEN_MEAN_STD,
                n_pos_side: 48,
            },
        },
    ]
}

/// The shape named `name` (case-insensitive).
pub fn find_projector_shape(name: &str) -> Option<ProjectorShape> {
    projector_shapes()
        .into_iter()
        .find(|s| s.name.eq_ignore_ascii_case(name))
}

/// How a tensor's values are drawn.
fn draw(name: &str, dims: &[u64], rng: &mut Rng) -> Vec<f32> {
    let n: u64 = dims.iter().product();
    let n = n as usize;
    let fan_in = dims[..dims.len().saturating_sub(1)].iter().product::<u64>() as f32;
    let is_norm = name.contains("ln1.") || name.contains("ln2.") || name.contains("post_ln.");
    if name.ends_with(".bias") {
        let scale = if is_norm { 0.1 } else { 0.02 };
        (0..n).map(|_| scale * rng.normal()).collect()
    } else if is_norm {
        (0..n).map(|_| 1.0 + 0.1 * rng.normal()).collect()
    } else if name == "v.position_embd.weight" {
        (0..n).map(|_| 0.5 * rng.normal()).collect()
    } else {
        let scale = 1.0 / fan_in.sqrt();
        (0..n).map(|_| scale * rng.normal()).collect()
    }
}

/// Writes a `qwen3vl_merger` projector of `shape` at `path`: matrices of more than one dimension in
/// `matrix_type` (F32, F16 or BF16; the patch convolution as llama.cpp's converter keeps it, in the same
/// type), vectors and the position table in F32.
pub fn write_qwen3vl_projector(
    shape: &ProjectorShape,
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
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", Value::String("clip".into()));
    w.add_kv("general.type", Value::String("mmproj".into()));
    w.add_kv(
        "general.name",
        Value::String(format!("synth qwen3vl-mmproj {}", shape.name)),
    );
    w.add_kv("clip.projector_type", Value::String(PROJECTOR_TYPE.into()));
    w.add_kv("clip.has_vision_encoder", Value::Bool(true));
    w.add_kv("clip.use_gelu", Value::Bool(true));
    let u = |v: u32| Value::U32(v);
    w.add_kv("clip.vision.projection_dim", u(hp.n_out));
    w.add_kv("clip.vision.image_size", u(hp.image_size));
    w.add_kv("clip.vision.patch_size", u(hp.patch_size));
    w.add_kv("clip.vision.embedding_length", u(hp.n_embd));
    w.add_kv("clip.vision.feed_forward_length", u(hp.n_ff));
    w.add_kv("clip.vision.block_count", u(hp.n_layer));
    w.add_kv("clip.vision.attention.head_count", u(hp.n_head));
    w.add_kv(
        "clip.vision.attention.layer_norm_epsilon",
        Value::F32(hp.eps),
    );
    let floats = |v: [f32; 3]| Value::from(v.to_vec());
    w.add_kv("clip.vision.image_mean", floats(hp.image_mean));
    w.add_kv("clip.vision.image_std", floats(hp.image_std));
    w.add_kv("clip.vision.spatial_merge_size", u(2));
    let table = tensor_table(hp);
    let mut types = Vec::with_capacity(table.len());
    for (name, dims) in &table {
        // llama.cpp resamples the position table with `ggml_interpolate`, which reads only F32.
        let ty = if dims.len() > 1 && name != "v.position_embd.weight" {
            matrix_type
        } else {
            GgmlType::F32
        };
        w.add_tensor(name.clone(), ty, dims)
            .map_err(|e| SynthError(e.to_string()))?;
        types.push(ty);
    }
    write_drawn(w, path, (&table, &types), (seed, 0x6d6d_7072_6f6a), draw)
}

/// Writes `w` to `path`, tensor `i` (`table[i]`, added as `types[i]`) drawn by `draw` from a random
/// stream of its own (`seed` and `stream`, which tells projector types apart).
pub(super) fn write_drawn(
    w: GgufWriter,
    path: &Path,
    (table, types): (&[(String, Vec<u64>)], &[GgmlType]),
    (seed, stream): (u64, u64),
    draw: fn(&str, &[u64], &mut Rng) -> Vec<f32>,
) -> Result<(), SynthError> {
    let mut failure = None;
    w.write_to_path(path, |i, info, out| {
        let mut rng = Rng::new(stream_seed(seed, stream, i as u64));
        let values = draw(&info.name, &table[i].1, &mut rng);
        match encode_floats(types[i], &values, &info.name) {
            Ok(bytes) => {
                out.copy_from_slice(&bytes);
                Ok(())
            }
            Err(e) => {
                let msg = e.0.clone();
                failure = Some(e);
                Err(std::io::Error::other(msg))
            }
        }
    })
    .map_err(|e| failure.take().unwrap_or_else(|| SynthError(e.to_string())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;
    use crate::vision::qwen3vl::Qwen3VlEncoder;
    use crate::vision::VisionEncoder;

    #[test]
    fn a_file_without_a_projector_type_is_not_a_projector() {
        let dir = std::env::temp_dir().join(format!("poly-mmproj-none-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("plain.gguf");
        let mut w = GgufWriter::new();
        w.add_kv("general.architecture", Value::String("clip".into()));
        w.write_to_path(&path, |_, _, _| Ok(())).expect("write");
        let file = GgufFile::open(&path).expect("open");
        let err = VisionEncoder::load(&file).err().expect("refused");
        assert!(err.0.contains("projector_type"), "{err}");
        let mut w = GgufWriter::new();
        w.add_kv("clip.projector_type", Value::String("gemma3".into()));
        w.write_to_path(&path, |_, _, _| Ok(())).expect("write");
        let file = GgufFile::open(&path).expect("open");
        let err = VisionEncoder::load(&file).err().expect("refused");
        assert!(err.0.contains("\"gemma3\" is not supported"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_tiny_projector_loads_with_the_hparams_it_was_written_with() {
        let dir = std::env::temp_dir().join(format!("poly-mmproj-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("tiny.gguf");
        let shape = find_projector_shape("TINY").expect("tiny");
        write_qwen3vl_projector(&shape, GgmlType::F16, 3, &path).expect("write");
        let file = GgufFile::open(&path).expect("open");
        let enc = Qwen3VlEncoder::load(&file).expect("load");
        assert_eq!(enc.hp, shape.hparams);
        assert_eq!(
            file.tensor_info("mm.0.weight").expect("mm.0").ty,
            GgmlType::F16
        );
        assert_eq!(
            file.tensor_info("v.blk.1.ln2.bias").expect("ln2").ty,
            GgmlType::F32
        );
        // The same seed writes the same bytes; another seed other weights.
        let again = dir.join("again.gguf");
        write_qwen3vl_projector(&shape, GgmlType::F16, 3, &again).expect("write");
        assert_eq!(std::fs::read(&path).ok(), std::fs::read(&again).ok());
        write_qwen3vl_projector(&shape, GgmlType::F16, 4, &again).expect("write");
        assert_ne!(std::fs::read(&path).ok(), std::fs::read(&again).ok());
        assert!(write_qwen3vl_projector(&shape, GgmlType::Q8_0, 3, &again).is_err());
        // A picture whose sides are not multiples of two patches is refused, not cut.
        let odd = crate::vision::picture::RgbF32 {
            width: 48,
            height: 32,
            values: vec![0.0; 48 * 32 * 3],
        };
        assert!(enc.encode(&odd).is_err());
        let even = crate::vision::picture::RgbF32 {
            width: 64,
            height: 32,
            values: vec![0.1; 64 * 32 * 3],
        };
        let rows = enc.encode(&even).expect("encode");
        assert_eq!((rows.n_x, rows.n_y, rows.width), (2, 1, 256));
        assert!(rows.values.iter().all(|v| v.is_finite()));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
