//! Gemma 4's image encoder (`gemma4v`) against llama.cpp's mtmd: the committed rows
//! `tests/witness/vision_rows.cpp` wrote for the committed picture and the tiny projectors `synth` writes
//! (F32, F16 and BF16 matrices), and mtmd's preprocessed pictures. The projector is written again here (its
//! SHA-256 must be the one the reference was made from), the picture decoded, resized, normalized and
//! encoded, and the rows compared: `‖ours − theirs‖ / ‖theirs‖` below the reference's bound, with the same
//! shape.
//!
//! The references take at least 8 rows (mtmd's `--image-min-tokens 8`: 4×3 rows, 12 KB a file) instead of
//! Gemma 4's 70, to keep the fixtures small; the default limits' sizes and resampling are checked on the
//! preprocessed pictures, byte for byte.
//!
//! The bounds: both encoders compute in f32, read quick GELU from ggml's f16 table and round a product's
//! activations to its F16 or BF16 weights' type, as ggml does. The patch convolution's f32 sums (ggml:
//! tinyBLAS over f16 patches) differ from ours in the last bit for most values; that alone is 1e-7, but
//! where a later product rounds its input to f16 or bf16 such a difference sometimes crosses a rounding
//! boundary (one step: 2⁻¹¹ of the element for f16, 2⁻⁸ for bf16). Measured: 9.1e-6 with F32 matrices
//! (bound 1e-4), 2.6e-4 with F16 (bound 1e-3), 1.2e-3 with BF16 (bound 5e-3; the converter keeps a BF16
//! file's patch kernel in F32, so its convolution is the f16 one). Errors of the encoder's structure are
//! far above: the two RoPE axes swapped 0.79, the input clamps left out 0.27, `out_scale` left out 0.22,
//! GELU in place of quick GELU 1.0e-2.

use poly_kernels::quant::GgmlType;
use poly_models::synth::mmproj_gemma4v::{find_gemma4v_projector_shape, write_gemma4v_projector};
use poly_models::vision::gemma4v::{Gemma4vEncoder, DEFAULT_TOKEN_LIMITS};
use poly_models::vision::picture::decode;
use poly_models::vision::VisionEncoder;
use poly_models::GgufFile;
use poly_tests::fixtures_dir;
use poly_tests::witness::{sha256_file, sha256_hex};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn vision_dir() -> PathBuf {
    fixtures_dir().join("vision")
}

fn manifest() -> Value {
    serde_json::from_slice(
        &std::fs::read(vision_dir().join("gemma4v-references.json"))
            .expect("gemma4v-references.json"),
    )
    .expect("gemma4v-references.json parses")
}

fn read_f32(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(bytes.len() % 4, 0, "{}: whole f32 values", path.display());
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn pair(v: &Value) -> (usize, usize) {
    let a = v.as_array().expect("a pair");
    (
        a[0].as_u64().expect("number") as usize,
        a[1].as_u64().expect("number") as usize,
    )
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("poly-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

#[test]
fn gemma4v_rows_match_llama_cpp_mtmd() {
    let manifest = manifest();
    let picture_bytes =
        std::fs::read(vision_dir().join(manifest["picture"].as_str().expect("picture")))
            .expect("picture");
    let picture = decode(&picture_bytes).expect("the picture decodes");
    assert_eq!((picture.width, picture.height), (64, 48));
    let min_tokens = manifest["min_tokens"].as_u64().expect("min_tokens") as usize;
    let refs = manifest["references"].as_array().expect("references");
    assert_eq!(refs.len(), 3);
    let dir = temp_dir("gemma4v-witness");
    let shape = find_gemma4v_projector_shape("tiny").expect("tiny");
    for r in refs {
        let ty_name = r["type"].as_str().expect("type");
        let ty = GgmlType::from_name(ty_name).expect("a type");
        let path = dir.join(format!("mmproj-gemma4v-tiny-{ty_name}.gguf"));
        let seed = r["seed"].as_u64().expect("seed");
        write_gemma4v_projector(&shape, ty, seed, &path).expect("synth writes the projector");
        assert_eq!(
            sha256_file(&path).expect("hash"),
            r["projector_sha256"].as_str().expect("sha"),
            "{ty_name}: synth no longer writes the projector the reference was made from"
        );
        let file = GgufFile::open(&path).expect("open");
        let enc = Gemma4vEncoder::load(&file).expect("load");
        let prepared = enc.prepare(&picture, (min_tokens, DEFAULT_TOKEN_LIMITS.1));
        assert_eq!((prepared.width, prepared.height), pair(&r["resized"]));
        let rows = enc.encode(&prepared).expect("encode");
        let theirs = read_f32(&vision_dir().join(r["rows_file"].as_str().expect("rows file")));
        let (gx, gy) = pair(&r["grid"]);
        let width = r["width"].as_u64().expect("width") as usize;
        // One row per pooled 3×3 block of 16-pixel patches, as wide as the LM's embedding (256).
        assert_eq!((rows.n_x, rows.n_y, rows.width), (gx, gy, width));
        assert_eq!(width, shape.hparams.n_out as usize);
        assert_eq!(rows.values.len(), theirs.len(), "{ty_name}: row count");
        let (mut diff, mut norm) = (0f64, 0f64);
        for (&a, &b) in rows.values.iter().zip(&theirs) {
            diff += (a as f64 - b as f64).powi(2);
            norm += (b as f64).powi(2);
        }
        let err = (diff / norm).sqrt();
        let bound = r["max_normalized_error"].as_f64().expect("bound");
        eprintln!("{ty_name}: normalized error {err:.3e} (bound {bound:.0e})");
        assert!(norm > 1.0, "{ty_name}: the reference rows are not empty");
        assert!(
            err < bound,
            "{ty_name}: normalized error {err:.3e} ≥ {bound:.0e}"
        );
        // The generic entry gives the same rows for the same limits.
        let generic = VisionEncoder::load(&file).expect("load");
        let again = generic
            .encode(&generic.prepare(&picture, (min_tokens, DEFAULT_TOKEN_LIMITS.1)))
            .expect("encode");
        assert_eq!(again, rows);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The picture mtmd hands Gemma 4's encoder, byte for byte: `smart_resize` to multiples of 48 within the
/// token limits, Pillow's fixed-point bicubic (up and down), the black bands of `PAD_CEIL`, and the
/// file's mean and std (0 and 1: the graph itself maps to [−1, 1]).
#[test]
fn gemma4v_preprocessing_matches_llama_cpp_mtmd_exactly() {
    let manifest = manifest();
    let dir = temp_dir("gemma4v-pre");
    let path = dir.join("mmproj-gemma4v-tiny.gguf");
    let shape = find_gemma4v_projector_shape("tiny").expect("tiny");
    write_gemma4v_projector(&shape, GgmlType::F32, 1, &path).expect("synth writes the projector");
    let file = GgufFile::open(&path).expect("open");
    let enc = Gemma4vEncoder::load(&file).expect("load");
    let cases = manifest["preprocessing"].as_array().expect("preprocessing");
    assert_eq!(cases.len(), 5);
    for case in cases {
        let name = case["picture"].as_str().expect("picture");
        let bytes = std::fs::read(vision_dir().join(name)).expect("picture");
        let picture = decode(&bytes).expect("decodes");
        let tokens = pair(&case["tokens"]);
        let prepared = enc.prepare(&picture, tokens);
        assert_eq!(
            (prepared.width, prepared.height),
            pair(&case["resized"]),
            "{name} {tokens:?}"
        );
        let raw: Vec<u8> = prepared
            .values
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(
            sha256_hex(&raw),
            case["sha256"].as_str().expect("sha256"),
            "{name} {tokens:?}: the preprocessed picture differs from mtmd's"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
