//! Qwen3-VL's image encoder (`clip.projector_type` `qwen3vl_merger`): the projector of Qwen3-VL, Qwen3.5
//! and Qwen3.6 (`qwen35moe`), as llama.cpp's `tools/mtmd` reads it (`clip.cpp`, `models/qwen3vl.cpp`).
//!
//! A picture resized to multiples of `patch_size · 2` (`smart_size`: 8 to 4096 merged tokens) and
//! normalized is cut into `patch_size²` patches, each embedded by the two temporal slices of the original
//! 3D convolution (a still picture is both frames: the two products added) plus a bias. The patches are
//! ordered by 2×2 blocks (block row, block column, then row and column inside the block), so each merged
//! token's four patches are consecutive. A learned position table made for a square grid
//! (`position_embd`, √n × √n cells) is resampled bilinearly (aligned corners) to the picture's grid and
//! added in the same order. Then pre-norm ViT blocks (layer norms with bias, fused QKV with bias,
//! full attention with the 2D rotary embedding of each patch's row and column, a GELU MLP with biases),
//! a final layer norm (`post_ln`), and the merger: four consecutive patch rows concatenated, then
//! `mm.0` + GELU + `mm.2`, whose output width is the language model's embedding width.
//!
//! The arithmetic follows ggml's CPU backend where it rounds: the patches are made f16 for the convolution
//! (`ggml_conv_2d`'s `im2col`), a product's activations take its F16 or BF16 weights' type, and GELU is
//! read from ggml's f16 table. Attention is f32 (mtmd with flash attention off).
//!
//! Deepstack layers (Qwen3-VL's extra mergers of middle layers, concatenated to the output) are not read:
//! Qwen3.5 and Qwen3.6 have none, and a file that declares them is refused.

use super::picture::{normalize, resize, smart_size, Filter, Fit, Rgb8, RgbF32};
use super::products::{product, PatchKernel};
use super::{check_tensor_table, tensor_matrix, tensor_values, ImageRows, VisionError};
use crate::gguf::GgufFile;
use poly_kernels::matmul::QuantMatrix;
use poly_kernels::ops::act::gelu_ggml_in_place;
use poly_kernels::ops::attention::{attention_full, AttnParams};
use poly_kernels::ops::norm::layer_norm;
use poly_kernels::ops::resample::bilinear_align_corners;
use poly_kernels::ops::rope_2d::rope_2d;
use poly_kernels::quant::GgmlType;

/// `clip.projector_type` of this encoder.
pub const PROJECTOR_TYPE: &str = "qwen3vl_merger";

/// Patches merged into one output row, per side (the layout's reshapes assume 2).
pub const MERGE: usize = 2;

/// mtmd's token limits for Qwen-VL pictures (`set_limit_image_tokens(8, 4096)`).
pub const DEFAULT_TOKEN_LIMITS: (usize, usize) = (8, 4096);

/// The rotary base of the encoder's 2D RoPE (fixed in the graph, not in the file).
const ROPE_BASE: f32 = 10000.0;

/// Hyperparameters of a `qwen3vl_merger` projector file.
#[derive(Clone, Debug, PartialEq)]
pub struct Qwen3VlHparams {
    /// `clip.vision.image_size`: the side the position table was trained for.
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
    /// `clip.vision.attention.layer_norm_epsilon`.
    pub eps: f32,
    /// `clip.vision.projection_dim`: the language model's embedding width (the output rows' width).
    pub n_out: u32,
    /// `clip.vision.image_mean` and `image_std`, per RGB channel.
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    /// Cells per side of the learned position table (`√` of its rows).
    pub n_pos_side: u32,
}

impl Qwen3VlHparams {
    pub fn head_dim(&self) -> usize {
        (self.n_embd / self.n_head) as usize
    }

    /// Reads and checks the hyperparameters of `file`.
    pub fn from_file(file: &GgufFile) -> Result<Qwen3VlHparams, VisionError> {
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
            <[f32; 3]>::try_from(v.as_slice())
                .map_err(|_| VisionError(format!("{key}: expected 3 values, found {}", v.len())))
        };
        let merge = md
            .get_u32("clip.vision.spatial_merge_size")
            .map_err(err)?
            .unwrap_or(MERGE as u32);
        if merge as usize != MERGE {
            return Err(VisionError(format!(
                "spatial_merge_size {merge}: only 2 is supported (llama.cpp's graph assumes it)"
            )));
        }
        let deepstack = md
            .get_bool_array("clip.vision.is_deepstack_layers")
            .map_err(err)?
            .is_some_and(|layers| layers.iter().any(|&d| d));
        if deepstack {
            return Err(VisionError(
                "deepstack layers (Qwen3-VL) are not supported yet; Qwen3.5/3.6 projectors have none"
                    .into(),
            ));
        }
        let pos = file
            .tensor_info(POS_EMBD)
            .ok_or_else(|| VisionError(format!("missing tensor {POS_EMBD}")))?;
        let n_pos = pos.dims.get(1).copied().unwrap_or(0);
        let n_pos_side = (n_pos as f64).sqrt().round() as u32;
        if u64::from(n_pos_side) * u64::from(n_pos_side) != n_pos {
            return Err(VisionError(format!(
                "{POS_EMBD}: {n_pos} positions are not a square grid"
            )));
        }
        let hp = Qwen3VlHparams {
            image_size: u32_key("clip.vision.image_size")?,
            patch_size: u32_key("clip.vision.patch_size")?,
            n_embd: u32_key("clip.vision.embedding_length")?,
            n_ff: u32_key("clip.vision.feed_forward_length")?,
            n_layer: u32_key("clip.vision.block_count")?,
            n_head: u32_key("clip.vision.attention.head_count")?,
            eps: md
                .get_f32("clip.vision.attention.layer_norm_epsilon")
                .map_err(err)?
                .ok_or_else(|| VisionError("missing layer_norm_epsilon".into()))?,
            n_out: u32_key("clip.vision.projection_dim")?,
            image_mean: rgb("clip.vision.image_mean")?,
            image_std: rgb("clip.vision.image_std")?,
            n_pos_side,
        };
        if hp.patch_size == 0 || hp.n_head == 0 || !hp.n_embd.is_multiple_of(hp.n_head) {
            return Err(VisionError(format!(
                "bad shape: patch {} width {} heads {}",
                hp.patch_size, hp.n_embd, hp.n_head
            )));
        }
        if !hp.head_dim().is_multiple_of(4) {
            return Err(VisionError(format!(
                "head width {} is not a multiple of 4 (2D RoPE)",
                hp.head_dim()
            )));
        }
        Ok(hp)
    }

    /// The size a `width × height` picture is resized to (mtmd's rule for Qwen-VL), with `tokens` the
    /// least and most merged tokens.
    pub fn target_size(&self, picture: (usize, usize), tokens: (usize, usize)) -> (usize, usize) {
        let align = self.patch_size as usize * MERGE;
        let area = align * align;
        smart_size(picture, align, (tokens.0 * area, tokens.1 * area))
    }
}

const POS_EMBD: &str = "v.position_embd.weight";

/// The tensors of a `qwen3vl_merger` file, `{}` standing for the block number, with their dimensions in
/// terms of `(P)atch`, `(E)mbd`, `(F)f`, `(O)ut`: what `synth` writes and the loader checks.
pub fn tensor_table(hp: &Qwen3VlHparams) -> Vec<(String, Vec<u64>)> {
    let (p, e, f, o) = (
        u64::from(hp.patch_size),
        u64::from(hp.n_embd),
        u64::from(hp.n_ff),
        u64::from(hp.n_out),
    );
    let n_pos = u64::from(hp.n_pos_side) * u64::from(hp.n_pos_side);
    let mut t: Vec<(String, Vec<u64>)> = vec![
        ("v.patch_embd.weight".into(), vec![p, p, 3, e]),
        ("v.patch_embd.weight.1".into(), vec![p, p, 3, e]),
        ("v.patch_embd.bias".into(), vec![e]),
        (POS_EMBD.into(), vec![e, n_pos]),
    ];
    for il in 0..hp.n_layer {
        let b = |s: &str| format!("v.blk.{il}.{s}");
        t.extend([
            (b("ln1.weight"), vec![e]),
            (b("ln1.bias"), vec![e]),
            (b("attn_qkv.weight"), vec![e, 3 * e]),
            (b("attn_qkv.bias"), vec![3 * e]),
            (b("attn_out.weight"), vec![e, e]),
            (b("attn_out.bias"), vec![e]),
            (b("ln2.weight"), vec![e]),
            (b("ln2.bias"), vec![e]),
            (b("ffn_up.weight"), vec![e, f]),
            (b("ffn_up.bias"), vec![f]),
            (b("ffn_down.weight"), vec![f, e]),
            (b("ffn_down.bias"), vec![e]),
        ]);
    }
    let m = 4 * e;
    t.extend([
        ("v.post_ln.weight".into(), vec![e]),
        ("v.post_ln.bias".into(), vec![e]),
        ("mm.0.weight".into(), vec![m, m]),
        ("mm.0.bias".into(), vec![m]),
        ("mm.2.weight".into(), vec![m, o]),
        ("mm.2.bias".into(), vec![o]),
    ]);
    t
}

/// A matrix product with bias: `y = x·Wᵀ + b`.
struct Linear<'a> {
    w: QuantMatrix<'a>,
    b: Vec<f32>,
}

impl Linear<'_> {
    fn apply(&self, x: &[f32], n: usize) -> Vec<f32> {
        let mut y = product(&self.w, x, n);
        for row in y.chunks_exact_mut(self.w.rows) {
            row.iter_mut().zip(&self.b).for_each(|(v, b)| *v += b);
        }
        y
    }
}

/// A layer norm's weight and bias.
struct Norm {
    w: Vec<f32>,
    b: Vec<f32>,
}

impl Norm {
    fn apply(&self, x: &[f32], eps: f32) -> Vec<f32> {
        let mut y = vec![0f32; x.len()];
        layer_norm(x, self.w.len(), (Some(&self.w), Some(&self.b)), eps, &mut y);
        y
    }
}

struct Block<'a> {
    ln1: Norm,
    qkv: Linear<'a>,
    out: Linear<'a>,
    ln2: Norm,
    up: Linear<'a>,
    down: Linear<'a>,
}

/// A loaded `qwen3vl_merger` encoder: matrices borrowed from the mapped file, vectors read as f32.
pub struct Qwen3VlEncoder<'a> {
    pub hp: Qwen3VlHparams,
    /// The two temporal slices of the patch convolution, as `[n_embd, 3·p·p]` matrices.
    patch: [PatchKernel; 2],
    patch_bias: Vec<f32>,
    /// `[n_pos_side², n_embd]`.
    pos_embd: Vec<f32>,
    blocks: Vec<Block<'a>>,
    post_ln: Norm,
    mm0: Linear<'a>,
    mm2: Linear<'a>,
}

impl<'a> Qwen3VlEncoder<'a> {
    /// Reads the hyperparameters and every tensor of `file`, checking each tensor's dimensions.
    pub fn load(file: &'a GgufFile) -> Result<Qwen3VlEncoder<'a>, VisionError> {
        let hp = Qwen3VlHparams::from_file(file)?;
        check_tensor_table(file, &tensor_table(&hp))?;
        let matrix = |name: &str| tensor_matrix(file, name);
        let vector = |name: &str| tensor_values(file, name);
        let linear = |base: &str| -> Result<Linear<'a>, VisionError> {
            Ok(Linear {
                w: matrix(&format!("{base}.weight"))?,
                b: vector(&format!("{base}.bias"))?,
            })
        };
        let norm = |base: &str| -> Result<Norm, VisionError> {
            Ok(Norm {
                w: vector(&format!("{base}.weight"))?,
                b: vector(&format!("{base}.bias"))?,
            })
        };
        let blocks = (0..hp.n_layer)
            .map(|il| {
                Ok(Block {
                    ln1: norm(&format!("v.blk.{il}.ln1"))?,
                    qkv: linear(&format!("v.blk.{il}.attn_qkv"))?,
                    out: linear(&format!("v.blk.{il}.attn_out"))?,
                    ln2: norm(&format!("v.blk.{il}.ln2"))?,
                    up: linear(&format!("v.blk.{il}.ffn_up"))?,
                    down: linear(&format!("v.blk.{il}.ffn_down"))?,
                })
            })
            .collect::<Result<Vec<_>, VisionError>>()?;
        let pos = file.tensor(POS_EMBD).expect("checked above");
        if pos.ty() != GgmlType::F32 && pos.ty() != GgmlType::F16 && pos.ty() != GgmlType::BF16 {
            return Err(VisionError(format!(
                "{POS_EMBD}: type {} not supported",
                pos.ty()
            )));
        }
        Ok(Qwen3VlEncoder {
            patch: [
                PatchKernel::new(matrix("v.patch_embd.weight")?, "v.patch_embd.weight")?,
                PatchKernel::new(matrix("v.patch_embd.weight.1")?, "v.patch_embd.weight.1")?,
            ],
            patch_bias: vector("v.patch_embd.bias")?,
            pos_embd: vector(POS_EMBD)?,
            blocks,
            post_ln: norm("v.post_ln")?,
            mm0: linear("mm.0")?,
            mm2: linear("mm.2")?,
            hp,
        })
    }

    /// Resizes and normalizes a decoded picture as mtmd does for this projector (`tokens`: the least and
    /// most merged tokens, [`DEFAULT_TOKEN_LIMITS`] by default).
    pub fn prepare(&self, picture: &Rgb8, tokens: (usize, usize)) -> RgbF32 {
        let size = self.hp.target_size((picture.width, picture.height), tokens);
        let resized = resize(picture, size, Filter::Bicubic, Fit::PadCeil);
        normalize(&resized, self.hp.image_mean, self.hp.image_std)
    }

    /// Encodes a prepared picture (sides multiples of `2 · patch_size`) to one row per merged 2×2 block of
    /// patches, row-major over the blocks, each `n_out` wide.
    pub fn encode(&self, img: &RgbF32) -> Result<ImageRows, VisionError> {
        let hp = &self.hp;
        let ps = hp.patch_size as usize;
        if !img.width.is_multiple_of(ps * MERGE)
            || !img.height.is_multiple_of(ps * MERGE)
            || img.width == 0
            || img.height == 0
        {
            return Err(VisionError(format!(
                "picture {}×{} is not a multiple of {} on both sides",
                img.width,
                img.height,
                ps * MERGE
            )));
        }
        let (nx, ny) = (img.width / ps, img.height / ps);
        let n = nx * ny;
        let e = hp.n_embd as usize;
        // Patch grid cells in merge order: block row, block column, row and column inside the block.
        let mut cells = Vec::with_capacity(n);
        for by in (0..ny).step_by(MERGE) {
            for bx in (0..nx).step_by(MERGE) {
                for dy in 0..MERGE {
                    for dx in 0..MERGE {
                        cells.push((by + dy, bx + dx));
                    }
                }
            }
        }
        // Each patch's pixels in the convolution's (channel, row, column) order.
        let k = 3 * ps * ps;
        let mut patches = vec![0f32; n * k];
        for (row, &(py, px)) in patches.chunks_exact_mut(k).zip(&cells) {
            for c in 0..3 {
                for ky in 0..ps {
                    for kx in 0..ps {
                        let (y, x) = (py * ps + ky, px * ps + kx);
                        row[(c * ps + ky) * ps + kx] = img.values[(y * img.width + x) * 3 + c];
                    }
                }
            }
        }
        let x_first = self.patch[0].apply(&patches, n);
        let second = self.patch[1].apply(&patches, n);
        let mut x = x_first;
        let side = hp.n_pos_side as usize;
        let resampled;
        let pos: &[f32] = if (nx, ny) == (side, side) {
            &self.pos_embd
        } else {
            resampled = bilinear_align_corners(&self.pos_embd, (side, side), e, (nx, ny));
            &resampled
        };
        for (i, (row, s)) in x
            .chunks_exact_mut(e)
            .zip(second.chunks_exact(e))
            .enumerate()
        {
            let (py, px) = cells[i];
            let p = &pos[(py * nx + px) * e..][..e];
            for j in 0..e {
                row[j] = (row[j] + s[j]) + self.patch_bias[j] + p[j];
            }
        }
        let rows: Vec<u32> = cells.iter().map(|&(y, _)| y as u32).collect();
        let cols: Vec<u32> = cells.iter().map(|&(_, x)| x as u32).collect();
        for block in &self.blocks {
            self.block(block, &mut x, n, (&rows, &cols));
        }
        let x = self.post_ln.apply(&x, hp.eps);
        // Four consecutive patch rows are one merged row of 4·n_embd.
        let m = n / (MERGE * MERGE);
        let mut h = self.mm0.apply(&x, m);
        gelu_ggml_in_place(&mut h);
        let out = self.mm2.apply(&h, m);
        Ok(ImageRows {
            n_x: nx / MERGE,
            n_y: ny / MERGE,
            width: hp.n_out as usize,
            values: out,
        })
    }

    /// One ViT block over `n` patch rows, in place.
    fn block(&self, b: &Block<'_>, x: &mut [f32], n: usize, positions: (&[u32], &[u32])) {
        let hp = &self.hp;
        let e = hp.n_embd as usize;
        let hd = hp.head_dim();
        let h = b.ln1.apply(x, hp.eps);
        let qkv = b.qkv.apply(&h, n);
        let mut q = Vec::with_capacity(n * e);
        let mut k = Vec::with_capacity(n * e);
        let mut v = Vec::with_capacity(n * e);
        for row in qkv.chunks_exact(3 * e) {
            q.extend_from_slice(&row[..e]);
            k.extend_from_slice(&row[e..2 * e]);
            v.extend_from_slice(&row[2 * e..]);
        }
        rope_2d(&mut q, positions, hd, ROPE_BASE);
        rope_2d(&mut k, positions, hd, ROPE_BASE);
        let params = AttnParams {
            n_head: hp.n_head as usize,
            n_head_kv: hp.n_head as usize,
            head_dim_k: hd,
            head_dim_v: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            window: None,
            softcap: None,
            sees_together: None,
        };
        // Every patch sees every patch.
        let mut att = vec![0f32; n * e];
        attention_full(&q, &k, &v, n, &params, &mut att);
        let o = b.out.apply(&att, n);
        x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        let h = b.ln2.apply(x, hp.eps);
        let mut up = b.up.apply(&h, n);
        gelu_ggml_in_place(&mut up);
        let down = b.down.apply(&up, n);
        x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
    }
}
