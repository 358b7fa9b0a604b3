//! Gemma 4's image encoder (`clip.projector_type` `gemma4v`), as llama.cpp's `tools/mtmd` reads it
//! (`clip.cpp`, `models/gemma4v.cpp`).
//!
//! A picture resized to multiples of `patch_size · n_merge` (`smart_size`: 70 to 1120 pooled tokens,
//! Pillow bicubic, centred on black) and normalized with the file's mean and std is mapped to `[−1, 1]`
//! (`2v − 1`, in the graph) and cut into `patch_size²` patches in raster order, each embedded by the patch
//! convolution (no bias). Two learned position tables, one for the column and one for the row of a patch
//! (`v.position_embd.weight`, `[n_embd, n_pos, 2]`), are looked up and added. Then pre-norm ViT blocks with
//! RMS norms: separate Q, K, V products; Q and K normed per head (with weights) and V per head (without),
//! the 2D RoPE of [`rope_2d_halves`] (base 100: the first half of a head turns by the column, the second
//! by the row), full attention at scale 1, the output product, a post-attention norm before the residual;
//! a gated MLP (`gate`, `up`, `down`) with a post-MLP norm before the residual; and the block's output
//! scaled by its `out_scale`. Every product may clamp its input and output (`Gemma4ClippableLinear`: the
//! scalars `<name>.input_min`, `.input_max`, `.output_min`, `.output_max` beside a weight).
//!
//! The pooler averages `n_merge × n_merge` patches (a 3×3 average by default) and scales by `√n_embd`;
//! then `(x − std_bias) · std_scale` when the file has both, an RMS norm without weight, and
//! `mm.input_projection` to the language model's embedding width.
//!
//! The MLP's activation is what `clip.cpp` reads for any projector: GELU with `clip.use_gelu`, SiLU with
//! `clip.use_silu`, otherwise quick GELU — llama.cpp's converter writes neither key for Gemma 4, so its
//! files run quick GELU, and so does this.
//!
//! The arithmetic follows ggml's CPU backend as [`super::qwen3vl`] does: the patches are made f16 for the
//! convolution, a product's activations take its F16 or BF16 weights' type, the activations are read
//! from ggml's f16 tables. Attention is f32 (mtmd with flash attention off).

use super::picture::{normalize, resize, smart_size, Filter, Fit, Rgb8, RgbF32};
use super::products::{product, PatchKernel};
use super::{check_tensor_table, tensor_matrix, tensor_values, ImageRows, VisionError};
use crate::gguf::GgufFile;
use poly_kernels::matmul::QuantMatrix;
use poly_kernels::ops::act::{geglu_in_place, gelu_quick_ggml, swiglu_ggml_rows};
use poly_kernels::ops::attention::{attention_full, AttnParams};
use poly_kernels::ops::norm::rms_norm;
use poly_kernels::ops::rope_2d::rope_2d_halves;
use poly_kernels::quant::GgmlType;

/// `clip.projector_type` (or `clip.vision.projector_type`) of this encoder.
pub const PROJECTOR_TYPE: &str = "gemma4v";

/// mtmd's token limits for Gemma 4 pictures (`set_limit_image_tokens(70, 1120)`), in pooled rows.
pub const DEFAULT_TOKEN_LIMITS: (usize, usize) = (70, 1120);

/// The pooling kernel's side when the file does not say (`clip.vision.projector.scale_factor`).
pub const DEFAULT_MERGE: u32 = 3;

/// The rotary base of the encoder's 2D RoPE (fixed in `clip.cpp`, not in the file).
const ROPE_BASE: f32 = 100.0;

const POS_EMBD: &str = "v.position_embd.weight";
const PATCH_EMBD: &str = "v.patch_embd.weight";
const STD_BIAS: &str = "v.std_bias";
const STD_SCALE: &str = "v.std_scale";
const INPUT_PROJECTION: &str = "mm.input_projection.weight";

/// The suffixes of a product's clamp scalars, in the order [`Clamp`] keeps them.
pub const CLAMP_SUFFIXES: [&str; 4] = ["input_min", "input_max", "output_min", "output_max"];

/// The activation of the MLP's gate, as `clip.cpp` chooses it for every projector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `clip.use_gelu`: GELU (tanh approximation).
    Gelu,
    /// `clip.use_silu`: SiLU.
    Silu,
    /// Neither key: quick GELU, `x·σ(1.702x)`.
    GeluQuick,
}

/// Hyperparameters of a `gemma4v` projector file.
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma4vHparams {
    /// `clip.vision.image_size` (unused by the encoder; llama.cpp's converter writes 224).
    pub image_size: u32,
    /// `clip.vision.patch_size`.
    pub patch_size: u32,
    /// `clip.vision.embedding_length`: the encoder's width.
    pub n_embd: u32,
    /// `clip.vision.feed_forward_length`.
    pub n_ff: u32,
    /// `clip.vision.block_count`.
    pub n_layer: u32,
    /// `clip.vision.attention.head_count`.
    pub n_head: u32,
    /// `clip.vision.attention.head_count_kv` (default: `n_head`).
    pub n_head_kv: u32,
    /// `clip.vision.attention.head_dim` (default: `n_embd / n_head`).
    pub head_dim: u32,
    /// `clip.vision.attention.layer_norm_epsilon`.
    pub eps: f32,
    /// `clip.vision.projection_dim`: the language model's embedding width (the output rows' width).
    pub n_out: u32,
    /// `clip.vision.image_mean` and `image_std`, per RGB channel.
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    /// `clip.vision.projector.scale_factor`: the pooling kernel's side (default [`DEFAULT_MERGE`]).
    pub n_merge: u32,
    /// Entries of each position table (the second dimension of `v.position_embd.weight`): the most
    /// patches a side may have.
    pub n_pos: u32,
    /// The MLP's activation (`clip.use_gelu`, `clip.use_silu`).
    pub activation: Activation,
}

impl Gemma4vHparams {
    /// Reads and checks the hyperparameters of `file`.
    pub fn from_file(file: &GgufFile) -> Result<Gemma4vHparams, VisionError> {
        let md = file.metadata();
        let err = |e: crate::gguf::GgufError| VisionError(e.to_string());
        let u32_key = |key: &str| {
            md.get_u32(key)
                .map_err(err)?
                .ok_or_else(|| VisionError(format!("missing metadata {key}")))
        };
        let rgb = |key: &str| -> Result<[f32; 3], VisionError> {
            let v = md
                .get_f32_array(key)
                .map_err(err)?
                .ok_or_else(|| VisionError(format!("missing metadata {key}")))?;
            // clip.cpp reads the first three values and refuses fewer.
            v.get(..3)
                .and_then(|s| <[f32; 3]>::try_from(s).ok())
                .ok_or_else(|| VisionError(format!("{key}: expected 3 values, found {}", v.len())))
        };
        let use_gelu = md.get_bool("clip.use_gelu").map_err(err)?.unwrap_or(false);
        let use_silu = md.get_bool("clip.use_silu").map_err(err)?.unwrap_or(false);
        let activation = match (use_gelu, use_silu) {
            (true, true) => {
                return Err(VisionError(
                    "both clip.use_gelu and clip.use_silu are set".into(),
                ))
            }
            (true, false) => Activation::Gelu,
            (false, true) => Activation::Silu,
            (false, false) => Activation::GeluQuick,
        };
        let n_embd = u32_key("clip.vision.embedding_length")?;
        let n_head = u32_key("clip.vision.attention.head_count")?;
        let n_head_kv = md
            .get_u32("clip.vision.attention.head_count_kv")
            .map_err(err)?
            .unwrap_or(n_head);
        let head_dim = match md.get_u32("clip.vision.attention.head_dim").map_err(err)? {
            Some(d) if d > 0 => d,
            _ if n_head > 0 => n_embd / n_head,
            _ => 0,
        };
        let pos = file
            .tensor_info(POS_EMBD)
            .ok_or_else(|| VisionError(format!("missing tensor {POS_EMBD}")))?;
        if pos.dims.len() != 3 || pos.dims[2] != 2 {
            return Err(VisionError(format!(
                "{POS_EMBD}: dimensions {:?}, expected [n_embd, n_pos, 2] (a column table and a row table)",
                pos.dims
            )));
        }
        let n_pos = u32::try_from(pos.dims[1])
            .map_err(|_| VisionError(format!("{POS_EMBD}: {} positions", pos.dims[1])))?;
        let hp = Gemma4vHparams {
            image_size: u32_key("clip.vision.image_size")?,
            patch_size: u32_key("clip.vision.patch_size")?,
            n_embd,
            n_ff: u32_key("clip.vision.feed_forward_length")?,
            n_layer: u32_key("clip.vision.block_count")?,
            n_head,
            n_head_kv,
            head_dim,
            eps: md
                .get_f32("clip.vision.attention.layer_norm_epsilon")
                .map_err(err)?
                .ok_or_else(|| VisionError("missing layer_norm_epsilon".into()))?,
            n_out: u32_key("clip.vision.projection_dim")?,
            image_mean: rgb("clip.vision.image_mean")?,
            image_std: rgb("clip.vision.image_std")?,
            n_merge: md
                .get_u32("clip.vision.projector.scale_factor")
                .map_err(err)?
                .unwrap_or(DEFAULT_MERGE),
            n_pos,
            activation,
        };
        if hp.patch_size == 0
            || hp.n_embd == 0
            || hp.n_head == 0
            || hp.n_head_kv == 0
            || !hp.n_head.is_multiple_of(hp.n_head_kv)
            || hp.n_merge == 0
            || hp.n_merge >= 65536
        {
            return Err(VisionError(format!(
                "bad shape: patch {} width {} heads {}/{} merge {}",
                hp.patch_size, hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_merge
            )));
        }
        if hp.head_dim == 0 || !hp.head_dim.is_multiple_of(4) {
            return Err(VisionError(format!(
                "head width {} is not a positive multiple of 4 (2D RoPE on each half)",
                hp.head_dim
            )));
        }
        Ok(hp)
    }

    /// The size a `width × height` picture is resized to (mtmd's rule for Gemma 4), with `tokens` the
    /// least and most pooled rows.
    pub fn target_size(&self, picture: (usize, usize), tokens: (usize, usize)) -> (usize, usize) {
        let align = (self.patch_size * self.n_merge) as usize;
        let area = align * align;
        smart_size(picture, align, (tokens.0 * area, tokens.1 * area))
    }
}

/// The names of the products of block `il` (each `<name>.weight`, with optional clamp scalars).
fn block_products(il: u32) -> [String; 7] {
    [
        "attn_q", "attn_k", "attn_v", "attn_out", "ffn_gate", "ffn_up", "ffn_down",
    ]
    .map(|p| format!("v.blk.{il}.{p}"))
}

/// The tensors every `gemma4v` file has, with their dimensions in terms of `(P)atch`, `(E)mbd`, `(F)f`,
/// `(O)ut`, `(H)ead` and the K/V width: what `synth` writes and the loader checks. The optional ones are
/// `v.std_bias` and `v.std_scale` (`[E]`, both or neither) and the clamp scalars (`[1]`) beside any
/// product's weight.
pub fn tensor_table(hp: &Gemma4vHparams) -> Vec<(String, Vec<u64>)> {
    let (p, e, f, o) = (
        u64::from(hp.patch_size),
        u64::from(hp.n_embd),
        u64::from(hp.n_ff),
        u64::from(hp.n_out),
    );
    let (hd, q, kv) = (
        u64::from(hp.head_dim),
        u64::from(hp.head_dim * hp.n_head),
        u64::from(hp.head_dim * hp.n_head_kv),
    );
    let mut t: Vec<(String, Vec<u64>)> = vec![
        (PATCH_EMBD.into(), vec![p, p, 3, e]),
        (POS_EMBD.into(), vec![e, u64::from(hp.n_pos), 2]),
    ];
    for il in 0..hp.n_layer {
        let b = |s: &str| format!("v.blk.{il}.{s}");
        t.extend([
            (b("ln1.weight"), vec![e]),
            (b("attn_q.weight"), vec![e, q]),
            (b("attn_k.weight"), vec![e, kv]),
            (b("attn_v.weight"), vec![e, kv]),
            (b("attn_q_norm.weight"), vec![hd]),
            (b("attn_k_norm.weight"), vec![hd]),
            (b("attn_out.weight"), vec![q, e]),
            (b("attn_post_norm.weight"), vec![e]),
            (b("ln2.weight"), vec![e]),
            (b("ffn_gate.weight"), vec![e, f]),
            (b("ffn_up.weight"), vec![e, f]),
            (b("ffn_down.weight"), vec![f, e]),
            (b("ffn_post_norm.weight"), vec![e]),
            (b("out_scale.weight"), vec![1]),
        ]);
    }
    t.push((INPUT_PROJECTION.into(), vec![e, o]));
    t
}

/// The bounds a clippable product puts on its input and output (`±f32::MAX` where the file has no
/// scalar, as `clip.cpp` defaults them).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Clamp {
    input: (f32, f32),
    output: (f32, f32),
}

/// A product without bias, clamped as `Gemma4ClippableLinear` (mtmd's `build_mm` for gemma4v).
struct Product<'a> {
    w: QuantMatrix<'a>,
    clamp: Clamp,
}

impl Product<'_> {
    fn apply(&self, x: &[f32], n: usize) -> Vec<f32> {
        // ggml_clamp: max(min(x, hi), lo).
        let (lo, hi) = self.clamp.input;
        let clamped: Vec<f32> = x.iter().map(|&v| v.min(hi).max(lo)).collect();
        let mut y = product(&self.w, &clamped, n);
        let (lo, hi) = self.clamp.output;
        y.iter_mut().for_each(|v| *v = v.min(hi).max(lo));
        y
    }

    fn rows(&self) -> usize {
        self.w.rows
    }
}

struct Block<'a> {
    ln1: Vec<f32>,
    q: Product<'a>,
    k: Product<'a>,
    v: Product<'a>,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    out: Product<'a>,
    attn_post_norm: Vec<f32>,
    ln2: Vec<f32>,
    gate: Product<'a>,
    up: Product<'a>,
    down: Product<'a>,
    ffn_post_norm: Vec<f32>,
    out_scale: f32,
}

/// A loaded `gemma4v` encoder: matrices borrowed from the mapped file, vectors read as f32.
pub struct Gemma4vEncoder<'a> {
    pub hp: Gemma4vHparams,
    /// The patch convolution as an `[n_embd, 3·p·p]` matrix.
    patch: PatchKernel,
    /// `[2, n_pos, n_embd]`: the column table, then the row table.
    pos_embd: Vec<f32>,
    blocks: Vec<Block<'a>>,
    /// `(std_bias, std_scale)`, when the file has both.
    standardize: Option<(Vec<f32>, Vec<f32>)>,
    projection: Product<'a>,
}

impl<'a> Gemma4vEncoder<'a> {
    /// Reads the hyperparameters and every tensor of `file`, checking each tensor's dimensions and
    /// refusing tensors of the vision tower that this encoder does not read (mtmd would apply them).
    pub fn load(file: &'a GgufFile) -> Result<Gemma4vEncoder<'a>, VisionError> {
        let hp = Gemma4vHparams::from_file(file)?;
        let table = tensor_table(&hp);
        check_tensor_table(file, &table)?;
        let e = u64::from(hp.n_embd);
        for name in [STD_BIAS, STD_SCALE] {
            if let Some(info) = file.tensor_info(name) {
                if info.dims != [e] {
                    return Err(VisionError(format!(
                        "{name}: dimensions {:?}, expected [{e}]",
                        info.dims
                    )));
                }
            }
        }
        let products: Vec<String> = (0..hp.n_layer)
            .flat_map(block_products)
            .chain(std::iter::once("mm.input_projection".to_string()))
            .collect();
        let known = |name: &str| {
            table.iter().any(|(n, _)| n == name)
                || name == STD_BIAS
                || name == STD_SCALE
                || products.iter().any(|p| {
                    name.strip_prefix(p.as_str())
                        .and_then(|s| s.strip_prefix('.'))
                        .is_some_and(|s| CLAMP_SUFFIXES.contains(&s))
                })
        };
        // The audio tower of a file with both encoders (`a.`, `mm.a.`) is not the picture's business.
        if let Some(other) = file.tensor_infos().iter().find(|t| {
            (t.name.starts_with("v.")
                || (t.name.starts_with("mm.") && !t.name.starts_with("mm.a.")))
                && !known(&t.name)
        }) {
            return Err(VisionError(format!(
                "tensor {} is not part of the gemma4v layout this encoder reads",
                other.name
            )));
        }
        let matrix = |name: &str| tensor_matrix(file, name);
        let vector = |name: &str| tensor_values(file, name);
        // clip.cpp's get_scalar: an F32 tensor of one value, else the default.
        let scalar = |name: &str, default: f32| -> Result<f32, VisionError> {
            let Some(t) = file.tensor(name) else {
                return Ok(default);
            };
            if t.ty() != GgmlType::F32 {
                return Err(VisionError(format!(
                    "{name}: type {}, a clamp scalar must be F32",
                    t.ty()
                )));
            }
            match vector(name)?.as_slice() {
                [v] => Ok(*v),
                other => Err(VisionError(format!(
                    "{name}: {} values, a clamp scalar has one",
                    other.len()
                ))),
            }
        };
        let clippable = |base: &str| -> Result<Product<'a>, VisionError> {
            let s = |suffix: &str, default| scalar(&format!("{base}.{suffix}"), default);
            Ok(Product {
                w: matrix(&format!("{base}.weight"))?,
                clamp: Clamp {
                    input: (s("input_min", -f32::MAX)?, s("input_max", f32::MAX)?),
                    output: (s("output_min", -f32::MAX)?, s("output_max", f32::MAX)?),
                },
            })
        };
        let blocks = (0..hp.n_layer)
            .map(|il| {
                let b = |s: &str| format!("v.blk.{il}.{s}");
                let out_scale = vector(&b("out_scale.weight"))?
                    .first()
                    .copied()
                    .ok_or_else(|| VisionError(format!("{}: empty", b("out_scale.weight"))))?;
                Ok(Block {
                    ln1: vector(&b("ln1.weight"))?,
                    q: clippable(&b("attn_q"))?,
                    k: clippable(&b("attn_k"))?,
                    v: clippable(&b("attn_v"))?,
                    q_norm: vector(&b("attn_q_norm.weight"))?,
                    k_norm: vector(&b("attn_k_norm.weight"))?,
                    out: clippable(&b("attn_out"))?,
                    attn_post_norm: vector(&b("attn_post_norm.weight"))?,
                    ln2: vector(&b("ln2.weight"))?,
                    gate: clippable(&b("ffn_gate"))?,
                    up: clippable(&b("ffn_up"))?,
                    down: clippable(&b("ffn_down"))?,
                    ffn_post_norm: vector(&b("ffn_post_norm.weight"))?,
                    out_scale,
                })
            })
            .collect::<Result<Vec<_>, VisionError>>()?;
        let standardize = match (file.tensor(STD_BIAS), file.tensor(STD_SCALE)) {
            (Some(_), Some(_)) => Some((vector(STD_BIAS)?, vector(STD_SCALE)?)),
            (None, None) => None,
            _ => {
                return Err(VisionError(format!(
                    "{STD_BIAS} and {STD_SCALE} come together; the file has one of them"
                )))
            }
        };
        let pos = file.tensor(POS_EMBD).expect("checked above");
        if !matches!(pos.ty(), GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            return Err(VisionError(format!(
                "{POS_EMBD}: type {} not supported",
                pos.ty()
            )));
        }
        Ok(Gemma4vEncoder {
            patch: PatchKernel::new(matrix(PATCH_EMBD)?, PATCH_EMBD)?,
            pos_embd: vector(POS_EMBD)?,
            blocks,
            standardize,
            projection: clippable("mm.input_projection")?,
            hp,
        })
    }

    /// Resizes and normalizes a decoded picture as mtmd does for this projector (`tokens`: the least and
    /// most pooled rows, [`DEFAULT_TOKEN_LIMITS`] by default).
    pub fn prepare(&self, picture: &Rgb8, tokens: (usize, usize)) -> RgbF32 {
        let size = self.hp.target_size((picture.width, picture.height), tokens);
        let resized = resize(picture, size, Filter::Bicubic, Fit::PadCeil);
        normalize(&resized, self.hp.image_mean, self.hp.image_std)
    }

    /// Encodes a prepared picture (sides multiples of `n_merge · patch_size`) to one row per pooled
    /// `n_merge × n_merge` block of patches, row-major over the blocks, each `n_out` wide.
    pub fn encode(&self, img: &RgbF32) -> Result<ImageRows, VisionError> {
        let hp = &self.hp;
        let ps = hp.patch_size as usize;
        let k = hp.n_merge as usize;
        if img.width == 0
            || img.height == 0
            || !img.width.is_multiple_of(ps * k)
            || !img.height.is_multiple_of(ps * k)
            || img.values.len() != img.width * img.height * 3
        {
            return Err(VisionError(format!(
                "picture {}×{} is not a multiple of {} on both sides",
                img.width,
                img.height,
                ps * k
            )));
        }
        let (nx, ny) = (img.width / ps, img.height / ps);
        let n_pos = hp.n_pos as usize;
        if nx > n_pos || ny > n_pos {
            return Err(VisionError(format!(
                "picture of {nx}×{ny} patches: the position tables have {n_pos} entries a side"
            )));
        }
        let n = nx * ny;
        let e = hp.n_embd as usize;
        // Each patch's pixels in the convolution's (channel, row, column) order, mapped to [−1, 1] as the
        // graph does (`ggml_scale_bias(x, 2, −1)`: one rounding either way).
        let kk = 3 * ps * ps;
        let mut patches = vec![0f32; n * kk];
        for (i, row) in patches.chunks_exact_mut(kk).enumerate() {
            let (py, px) = (i / nx, i % nx);
            for c in 0..3 {
                for ky in 0..ps {
                    for kx in 0..ps {
                        let (y, x) = (py * ps + ky, px * ps + kx);
                        let v = img.values[(y * img.width + x) * 3 + c];
                        row[(c * ps + ky) * ps + kx] = v.mul_add(2.0, -1.0);
                    }
                }
            }
        }
        let mut x = self.patch.apply(&patches, n);
        let (col_table, row_table) = self.pos_embd.split_at(n_pos * e);
        for (i, row) in x.chunks_exact_mut(e).enumerate() {
            let (py, px) = (i / nx, i % nx);
            let by_col = &col_table[px * e..][..e];
            let by_row = &row_table[py * e..][..e];
            for j in 0..e {
                row[j] = (row[j] + by_col[j]) + by_row[j];
            }
        }
        let cols: Vec<u32> = (0..n).map(|i| (i % nx) as u32).collect();
        let rows: Vec<u32> = (0..n).map(|i| (i / nx) as u32).collect();
        for block in &self.blocks {
            self.block(block, &mut x, n, (&cols, &rows));
        }
        // The pooler: the average of each k×k block of patches (summed row by row, as ggml's pool_2d),
        // scaled by √n_embd.
        let (ox, oy) = (nx / k, ny / k);
        let m = ox * oy;
        let scale = (e as f32).sqrt();
        let mut pooled = vec![0f32; m * e];
        for (o, out) in pooled.chunks_exact_mut(e).enumerate() {
            let (by, bx) = (o / ox, o % ox);
            for (j, v) in out.iter_mut().enumerate() {
                let mut sum = 0f32;
                for dy in 0..k {
                    for dx in 0..k {
                        sum += x[((by * k + dy) * nx + bx * k + dx) * e + j];
                    }
                }
                *v = (sum / (k * k) as f32) * scale;
            }
        }
        if let Some((bias, std_scale)) = &self.standardize {
            for row in pooled.chunks_exact_mut(e) {
                for ((v, b), s) in row.iter_mut().zip(bias).zip(std_scale) {
                    *v = (*v - b) * s;
                }
            }
        }
        let mut normed = vec![0f32; m * e];
        rms_norm(&pooled, e, None, hp.eps, &mut normed);
        let out = self.projection.apply(&normed, m);
        Ok(ImageRows {
            n_x: ox,
            n_y: oy,
            width: self.projection.rows(),
            values: out,
        })
    }

    /// One ViT block over `n` patch rows, in place; `positions` are each patch's column and row.
    fn block(&self, b: &Block<'_>, x: &mut [f32], n: usize, positions: (&[u32], &[u32])) {
        let hp = &self.hp;
        let e = hp.n_embd as usize;
        let hd = hp.head_dim as usize;
        let norm = |v: &[f32], group: usize, w: Option<&[f32]>| {
            let mut y = vec![0f32; v.len()];
            rms_norm(v, group, w, hp.eps, &mut y);
            y
        };
        let h = norm(x, e, Some(&b.ln1));
        let mut q = norm(&b.q.apply(&h, n), hd, Some(&b.q_norm));
        let mut k = norm(&b.k.apply(&h, n), hd, Some(&b.k_norm));
        let v = norm(&b.v.apply(&h, n), hd, None);
        rope_2d_halves(&mut q, positions, hd, ROPE_BASE);
        rope_2d_halves(&mut k, positions, hd, ROPE_BASE);
        let params = AttnParams {
            n_head: hp.n_head as usize,
            n_head_kv: hp.n_head_kv as usize,
            head_dim_k: hd,
            head_dim_v: hd,
            // Q and K are normed: the graph sets kq_scale to 1.
            scale: 1.0,
            window: None,
            softcap: None,
            sees_together: None,
        };
        // Every patch sees every patch.
        let mut att = vec![0f32; n * hp.n_head as usize * hd];
        attention_full(&q, &k, &v, n, &params, &mut att);
        let o = norm(&b.out.apply(&att, n), e, Some(&b.attn_post_norm));
        x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        let h = norm(x, e, Some(&b.ln2));
        let mut gate = b.gate.apply(&h, n);
        let up = b.up.apply(&h, n);
        match hp.activation {
            Activation::GeluQuick => gate
                .iter_mut()
                .zip(&up)
                .for_each(|(g, u)| *g = gelu_quick_ggml(*g) * u),
            Activation::Gelu => geglu_in_place(&mut gate, &up),
            Activation::Silu => swiglu_ggml_rows(&mut gate, &up, hp.n_ff as usize),
        }
        let down = norm(&b.down.apply(&gate, n), e, Some(&b.ffn_post_norm));
        for (a, d) in x.iter_mut().zip(&down) {
            *a = (*a + d) * b.out_scale;
        }
    }
}
