//! The Qwen3-VL / Qwen3.6 image encoder (`qwen3vl_merger`) against llama.cpp's mtmd: the committed rows
//! `tests/witness/vision_rows.cpp` wrote for the committed picture and the tiny projectors `synth` writes
//! (F32, F16 and BF16 matrices). The projector is written again here (its SHA-256 must be the one the reference
//! was made from), the picture decoded, resized, normalized and encoded, and the rows compared:
//! `‖ours − theirs‖ / ‖theirs‖` below the reference's bound, with the same shape.
//!
//! The bounds: both encoders compute in f32, read GELU from ggml's f16 table and round a product's
//! activations to its F16 or BF16 weights' type, as ggml does; f32 summation-order differences show only
//! where they move a value across an f16 rounding boundary (one f16 step, 2⁻¹¹ of that element).
//! Measured: 3.7e-5 with F32 matrices (bound 2e-4: the GELU table's roundings); 3.3e-4 with F16 (bound
//! 1e-3: every product's input is rounded to f16, so such flips happen at every matrix); 6.9e-8 with BF16
//! (bound 1e-5: bf16 products are exact in f32 and a flip of bf16's coarse rounding is rare).
//! Errors of the encoder's structure (patch order, positions, RoPE axes, the merge) are of order 1e-1,
//! and leaving out the f16 rounding of the patches that ggml's `conv_2d` does already gives 4.2e-4 on F32.

use poly_kernels::quant::GgmlType;
use poly_models::synth::mmproj::{find_projector_shape, write_qwen3vl_projector};
use poly_models::vision::picture::decode;
use poly_models::vision::qwen3vl::{Qwen3VlEncoder, DEFAULT_TOKEN_LIMITS};
use poly_models::vision::VisionEncoder;
use poly_models::GgufFile;
use poly_tests::fixtures_dir;
use poly_tests::witness::sha256_file;
use serde_json::Value;

fn vision_dir() -> std::path::PathBuf {
    fixtures_dir().join("vision")
}

fn read_f32(path: &std::path::Path) -> Vec<f32> {
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

#[test]
fn qwen3vl_rows_match_llama_cpp_mtmd() {
    let manifest: Value = serde_json::from_slice(
        &std::fs::read(vision_dir().join("references.json")).expect("references.json"),
    )
    .expect("references.json parses");
    let picture_bytes =
        std::fs::read(vision_dir().join(manifest["picture"].as_str().expect("picture")))
            .expect("picture");
    let picture = decode(&picture_bytes).expect("the picture decodes");
    assert_eq!((picture.width, picture.height), (64, 48));
    let refs = manifest["references"].as_array().expect("references");
    assert_eq!(refs.len(), 3);
    let dir = std::env::temp_dir().join(format!("poly-vision-witness-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let shape = find_projector_shape("tiny").expect("tiny");
    for r in refs {
        let ty_name = r["type"].as_str().expect("type");
        let ty = GgmlType::from_name(ty_name).expect("a type");
        let path = dir.join(format!("mmproj-tiny-{ty_name}.gguf"));
        let seed = r["seed"].as_u64().expect("seed");
        write_qwen3vl_projector(&shape, ty, seed, &path).expect("synth writes the projector");
        assert_eq!(
            sha256_file(&path).expect("hash"),
            r["projector_sha256"].as_str().expect("sha"),
            "{ty_name}: synth no longer writes the projector the reference was made from"
        );
        let file = GgufFile::open(&path).expect("open");
        let enc = Qwen3VlEncoder::load(&file).expect("load");
        let prepared = enc.prepare(&picture, DEFAULT_TOKEN_LIMITS);
        assert_eq!((prepared.width, prepared.height), pair(&r["resized"]));
        let rows = enc.encode(&prepared).expect("encode");
        let theirs = read_f32(&vision_dir().join(r["rows_file"].as_str().expect("rows file")));
        let (gx, gy) = pair(&r["grid"]);
        let width = r["width"].as_u64().expect("width") as usize;
        // One row per merged 2×2 block of 16-pixel patches, as wide as the LM's embedding (256).
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
        // The generic entry (decode + prepare + encode) gives the same rows.
        let again = VisionEncoder::load(&file)
            .expect("load")
            .encode_picture(&picture_bytes)
            .expect("encode");
        assert_eq!(again, rows);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The picture mtmd hands its encoder, byte for byte: decoding, `smart_resize`'s size, Pillow's
/// fixed-point bicubic (up and down), the black bands of `PAD_CEIL` and the mean/std normalization.
#[test]
fn preprocessing_matches_llama_cpp_mtmd_exactly() {
    let manifest: Value = serde_json::from_slice(
        &std::fs::read(vision_dir().join("references.json")).expect("references.json"),
    )
    .expect("references.json parses");
    let dir = std::env::temp_dir().join(format!("poly-vision-pre-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("mmproj-tiny.gguf");
    let shape = find_projector_shape("tiny").expect("tiny");
    write_qwen3vl_projector(&shape, GgmlType::F32, 1, &path).expect("synth writes the projector");
    let file = GgufFile::open(&path).expect("open");
    let enc = Qwen3VlEncoder::load(&file).expect("load");
    let cases = manifest["preprocessing"].as_array().expect("preprocessing");
    assert_eq!(cases.len(), 3);
    for case in cases {
        let name = case["picture"].as_str().expect("picture");
        let bytes = std::fs::read(vision_dir().join(name)).expect("picture");
        let picture = decode(&bytes).expect("decodes");
        let max_tokens = case["max_tokens"].as_u64().expect("max_tokens") as usize;
        let prepared = enc.prepare(&picture, (DEFAULT_TOKEN_LIMITS.0, max_tokens));
        assert_eq!(
            (prepared.width, prepared.height),
            pair(&case["resized"]),
            "{name}"
        );
        let raw: Vec<u8> = prepared
            .values
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(
            poly_tests::witness::sha256_hex(&raw),
            case["sha256"].as_str().expect("sha256"),
            "{name}: the preprocessed picture differs from mtmd's"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
