//! Vision encoders: the projector files (`mmproj`, the `clip` layout llama.cpp's `tools/mtmd` reads) that
//! turn a picture into rows as wide as a language model's token embedding.
//!
//! - [`picture`]: decoding PNG, JPEG and WebP, mtmd's resize (Pillow's fixed-point resampling, its
//!   `smart_resize` sizes) and normalization.
//! - [`qwen3vl`]: `qwen3vl_merger`, the encoder of Qwen3-VL, Qwen3.5 and Qwen3.6.
//! - [`gemma4v`]: `gemma4v`, the encoder of Gemma 4.
//! - [`products`]: the matrix products and patch convolution in ggml's arithmetic, shared by the encoders.
//!
//! One file per projector type, as `arch/` has one per architecture: its hyperparameters, its tensor
//! table and its forward pass, written over `poly-kernels`' primitives.

pub mod gemma4v;
pub mod jpeg;
pub mod picture;
mod products;
pub mod qwen3vl;

use crate::gguf::GgufFile;
use poly_kernels::matmul::QuantMatrix;
use poly_kernels::quant::dequantize;

/// An error of a vision encoder: a message for people.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionError(pub String);

impl std::fmt::Display for VisionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for VisionError {}

/// A picture's rows: `n_x · n_y` rows of `width` values, row-major over the merged patch grid (`n_x`
/// columns), in the order the language model reads them.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageRows {
    pub n_x: usize,
    pub n_y: usize,
    pub width: usize,
    pub values: Vec<f32>,
}

impl ImageRows {
    pub fn n_rows(&self) -> usize {
        self.n_x * self.n_y
    }
}

/// The projector type a file declares (`clip.vision.projector_type`, else `clip.projector_type`).
pub fn projector_type(file: &GgufFile) -> Result<String, VisionError> {
    let md = file.metadata();
    for key in ["clip.vision.projector_type", "clip.projector_type"] {
        if let Some(t) = md.get_str(key).map_err(|e| VisionError(e.to_string()))? {
            return Ok(t.to_string());
        }
    }
    Err(VisionError(
        "not a projector file: no clip.projector_type".into(),
    ))
}

/// Checks that `file` holds every tensor of `table` (name, ggml dimensions) with those dimensions.
fn check_tensor_table(file: &GgufFile, table: &[(String, Vec<u64>)]) -> Result<(), VisionError> {
    for (name, dims) in table {
        let info = file
            .tensor_info(name)
            .ok_or_else(|| VisionError(format!("missing tensor {name}")))?;
        if &info.dims != dims {
            return Err(VisionError(format!(
                "{name}: dimensions {:?}, expected {dims:?}",
                info.dims
            )));
        }
    }
    Ok(())
}

/// Tensor `name` of `file` as a matrix read in place: its last dimension the rows, the others the columns.
fn tensor_matrix<'a>(file: &'a GgufFile, name: &str) -> Result<QuantMatrix<'a>, VisionError> {
    let t = file
        .tensor(name)
        .ok_or_else(|| VisionError(format!("missing tensor {name}")))?;
    let (rows, cols) = match t.dims().split_last() {
        Some((&rows, rest)) => (rows, rest.iter().product::<u64>()),
        None => (0, 0),
    };
    QuantMatrix::new(t.ty(), rows as usize, cols as usize, t.data)
        .map_err(|e| VisionError(format!("{name}: {e}")))
}

/// Tensor `name` of `file`, every value as f32.
fn tensor_values(file: &GgufFile, name: &str) -> Result<Vec<f32>, VisionError> {
    let t = file
        .tensor(name)
        .ok_or_else(|| VisionError(format!("missing tensor {name}")))?;
    let n: u64 = t.dims().iter().product();
    let mut out = vec![0f32; n as usize];
    dequantize(t.ty(), t.data, &mut out).map_err(|e| VisionError(format!("{name}: {e}")))?;
    Ok(out)
}

/// A loaded vision encoder of one of the supported projector types.
pub enum VisionEncoder<'a> {
    Qwen3Vl(qwen3vl::Qwen3VlEncoder<'a>),
    Gemma4v(gemma4v::Gemma4vEncoder<'a>),
}

impl<'a> VisionEncoder<'a> {
    /// Loads the encoder `file` declares; other projector types are an error that names them.
    pub fn load(file: &'a GgufFile) -> Result<VisionEncoder<'a>, VisionError> {
        match projector_type(file)?.as_str() {
            qwen3vl::PROJECTOR_TYPE => {
                Ok(VisionEncoder::Qwen3Vl(qwen3vl::Qwen3VlEncoder::load(file)?))
            }
            gemma4v::PROJECTOR_TYPE => {
                Ok(VisionEncoder::Gemma4v(gemma4v::Gemma4vEncoder::load(file)?))
            }
            other => Err(VisionError(format!(
                "projector type {other:?} is not supported (supported: {}, {})",
                qwen3vl::PROJECTOR_TYPE,
                gemma4v::PROJECTOR_TYPE
            ))),
        }
    }

    /// The width of the rows it writes (the language model's embedding width it was made for).
    pub fn out_width(&self) -> usize {
        match self {
            VisionEncoder::Qwen3Vl(enc) => enc.hp.n_out as usize,
            VisionEncoder::Gemma4v(enc) => enc.hp.n_out as usize,
        }
    }

    /// The projector type it reads (`clip.projector_type`).
    pub fn projector_type(&self) -> &'static str {
        match self {
            VisionEncoder::Qwen3Vl(_) => qwen3vl::PROJECTOR_TYPE,
            VisionEncoder::Gemma4v(_) => gemma4v::PROJECTOR_TYPE,
        }
    }

    /// mtmd's least and most output rows of a picture for this projector type (its `--image-min-tokens`
    /// and `--image-max-tokens` defaults).
    pub fn default_token_limits(&self) -> (usize, usize) {
        match self {
            VisionEncoder::Qwen3Vl(_) => qwen3vl::DEFAULT_TOKEN_LIMITS,
            VisionEncoder::Gemma4v(_) => gemma4v::DEFAULT_TOKEN_LIMITS,
        }
    }

    /// Resizes and normalizes a decoded picture as mtmd does for this projector, to between `tokens.0`
    /// and `tokens.1` output rows.
    pub fn prepare(&self, picture: &picture::Rgb8, tokens: (usize, usize)) -> picture::RgbF32 {
        match self {
            VisionEncoder::Qwen3Vl(enc) => enc.prepare(picture, tokens),
            VisionEncoder::Gemma4v(enc) => enc.prepare(picture, tokens),
        }
    }

    /// Encodes a prepared picture.
    pub fn encode(&self, prepared: &picture::RgbF32) -> Result<ImageRows, VisionError> {
        match self {
            VisionEncoder::Qwen3Vl(enc) => enc.encode(prepared),
            VisionEncoder::Gemma4v(enc) => enc.encode(prepared),
        }
    }

    /// Decodes, resizes, normalizes and encodes a picture file's bytes with the projector's default
    /// token limits.
    pub fn encode_picture(&self, bytes: &[u8]) -> Result<ImageRows, VisionError> {
        let picture = picture::decode(bytes).map_err(VisionError)?;
        self.encode(&self.prepare(&picture, self.default_token_limits()))
    }
}

/// The multi-section RoPE positions of a picture's rows when its first row's time position is `pos0`, as
/// llama.cpp's mtmd gives them to an M-RoPE language model: every row at time `pos0`, row `r` and column
/// `c` of the merged grid at `pos0 + r` and `pos0 + c` in the second and third sections, 0 in the fourth.
pub fn mrope_positions(rows: &ImageRows, pos0: u32) -> Vec<[u32; 4]> {
    (0..rows.n_rows())
        .map(|i| {
            let (r, c) = ((i / rows.n_x) as u32, (i % rows.n_x) as u32);
            [pos0, pos0 + r, pos0 + c, 0]
        })
        .collect()
}

/// How far a picture moves the positions of what follows it under multi-section RoPE: the larger side of
/// its merged grid (mtmd's `n_pos`), not its row count; the text after it starts at `pos0 + span`.
pub fn mrope_span(rows: &ImageRows) -> u32 {
    rows.n_x.max(rows.n_y) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mrope_positions_walk_the_grid_by_row_then_column() {
        let rows = ImageRows {
            n_x: 3,
            n_y: 2,
            width: 1,
            values: vec![0.0; 6],
        };
        let p = mrope_positions(&rows, 10);
        assert_eq!(
            p,
            vec![
                [10, 10, 10, 0],
                [10, 10, 11, 0],
                [10, 10, 12, 0],
                [10, 11, 10, 0],
                [10, 11, 11, 0],
                [10, 11, 12, 0],
            ]
        );
        assert_eq!(mrope_span(&rows), 3);
    }
}
