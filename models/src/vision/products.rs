//! Matrix products of the vision encoders in the arithmetic ggml's CPU backend gives them, shared by every
//! encoder file: the rounding of a product's activations to its weights' type, and the patch convolution
//! (`ggml_conv_2d`) as an `im2col` product.

use super::VisionError;
use poly_kernels::matmul::{matmul, matmul_ordered, QuantMatrix};
use poly_kernels::quant::float::{f16_bits_to_f32, f32_to_f16_bits};
use poly_kernels::quant::{dequantize, f16_tinyblas_order, GgmlType};
use rayon::prelude::*;

/// The rounding ggml's CPU backend applies to the activations of a product with weights of `ty` (its
/// `vec_dot_type`): F16 and BF16 weights take f16 and bf16 activations. (The quantized types' own
/// activation formats are applied by `matmul` itself.) Following it keeps a projector published in F16 or
/// BF16 within f32 rounding of mtmd instead of within the activations' rounding.
pub(super) fn round_for(ty: GgmlType) -> Option<fn(f32) -> f32> {
    match ty {
        // The inline conversions (`half`'s go through a run-time dispatch per call; the same bits).
        GgmlType::F16 => Some(|v| f16_bits_to_f32(f32_to_f16_bits(v))),
        GgmlType::BF16 => Some(|v| half::bf16::from_f32(v).to_f32()),
        _ => None,
    }
}

/// `y = x·Wᵀ` for `n` rows of `x`, the activations rounded as ggml rounds them for `w`'s type.
pub(super) fn product(w: &QuantMatrix<'_>, x: &[f32], n: usize) -> Vec<f32> {
    let mut y = vec![0f32; n * w.rows];
    match round_for(w.ty) {
        Some(round) => {
            let rounded: Vec<f32> = x.par_iter().map(|&v| round(v)).collect();
            // F16 weights times a batch of f16 activations: llamafile's tinyBLAS order, as ggml's CPU
            // backend runs mtmd's products (fused multiply-adds, each weight converted once for four rows).
            let order = (w.ty == GgmlType::F16).then(f16_tinyblas_order);
            matmul_ordered(w, &rounded, n, &mut y, order);
        }
        None => matmul(w, x, n, &mut y),
    }
    y
}

/// The patch convolution in the arithmetic ggml's `ggml_conv_2d` gives it: the patches (`im2col`) are made
/// f16 and the kernel, as the other operand of an f16 product, too; a BF16 kernel keeps f32 patches
/// instead (and is read in f32). Following it keeps the encoder within f32 rounding of llama.cpp's: the
/// f16 rounding of the input alone moves the rows by about 2e-4 of their norm.
pub(super) struct PatchKernel {
    /// The kernel as an f16 matrix (F32 and F16 kernels) or an f32 one (BF16 kernels).
    ty: GgmlType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl PatchKernel {
    /// `name` is the tensor's, for errors.
    pub(super) fn new(w: QuantMatrix<'_>, name: &str) -> Result<PatchKernel, VisionError> {
        let mut values = vec![0f32; w.rows * w.cols];
        dequantize(w.ty, w.data, &mut values).map_err(|e| VisionError(e.to_string()))?;
        let (ty, data) = match w.ty {
            GgmlType::F32 | GgmlType::F16 => (
                GgmlType::F16,
                values
                    .iter()
                    .flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes())
                    .collect(),
            ),
            GgmlType::BF16 => (
                GgmlType::F32,
                values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ),
            other => {
                return Err(VisionError(format!(
                    "{name}: type {other} not supported (F32, F16 or BF16)"
                )))
            }
        };
        Ok(PatchKernel {
            ty,
            rows: w.rows,
            cols: w.cols,
            data,
        })
    }

    /// `n` patch rows through the kernel: a [`product`] (the patches made f16 first when the kernel is).
    pub(super) fn apply(&self, patches: &[f32], n: usize) -> Vec<f32> {
        let w = QuantMatrix::new(self.ty, self.rows, self.cols, &self.data)
            .expect("built with its own shape");
        product(&w, patches, n)
    }
}
