//! GGML block formats: layouts, dequantization, activation quantization and dot products.
//!
//! A weight matrix is stored row by row; each row is a sequence of blocks of `block_elems` values packed in
//! `block_bytes` bytes. Every format the engine reads supplies a [`QuantOps`] table: how to dequantize whole
//! blocks, which activation format its dot product wants ([`ActType`]), the dot product of one row with
//! quantized activations, and how to write random valid blocks (for `synth` and tests).
//!
//! Families live in their own files: [`float`] (F32, F16, BF16), [`legacy`] (Q4_0 … Q8_0), [`kquants`]
//! (Q2_K … Q6_K), [`iquants`] (IQ1_S … IQ4_XS) and [`mxfp4`]. Dequantization is checked bit for bit
//! against the `gguf` PyPI package (`tests/fixtures/quant/`).

pub mod float;
mod float_ggml;
pub(crate) mod float_tiles;
pub mod iquants;
pub mod kquants;
mod kquants_ggml;
pub mod legacy;
pub mod mxfp4;
#[cfg(target_arch = "x86_64")]
mod x86;

use crate::rng::Rng;

pub use crate::ggml_type::GgmlType;

/// The nine i-quants (the lattice formats and IQ4_NL/IQ4_XS), each with kernels of its own on the card.
pub const I_QUANTS: [GgmlType; 9] = [
    GgmlType::IQ1_S,
    GgmlType::IQ1_M,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ3_S,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
];

/// The weight formats the engine computes with (the list); every one has a [`QuantOps`].
pub const WEIGHT_TYPES: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ3_S,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::MXFP4,
    GgmlType::IQ1_S,
    GgmlType::IQ1_M,
];

impl GgmlType {
    /// The operations of a weight format the engine computes with; `None` for types it stores but never
    /// multiplies (integers, F64, ternary formats).
    pub fn ops(self) -> Option<&'static QuantOps> {
        float::ops(self)
            .or_else(|| legacy::ops(self))
            .or_else(|| kquants::ops(self))
            .or_else(|| iquants::ops(self))
            .or_else(|| mxfp4::ops(self))
    }
}

/// The format activations are quantized to before a dot product with a weight row, as llama.cpp does
/// (its `vec_dot_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum ActType {
    /// Plain little-endian f32 (float weights).
    F32,
    /// 32 values: f16 scale, 32 × i8.
    Q8_0,
    /// 32 values: f16 scale, f16 scale × sum of the quants, 32 × i8.
    Q8_1,
    /// 256 values: f32 scale, 256 × i8, 16 × i16 sums of 16 quants.
    Q8_K,
}

impl ActType {
    /// Values per activation block.
    pub fn block_elems(self) -> usize {
        match self {
            ActType::F32 => 1,
            ActType::Q8_0 | ActType::Q8_1 => 32,
            ActType::Q8_K => 256,
        }
    }

    /// Bytes per activation block.
    pub fn block_bytes(self) -> usize {
        match self {
            ActType::F32 => 4,
            ActType::Q8_0 => 34,
            ActType::Q8_1 => 36,
            ActType::Q8_K => 292,
        }
    }

    /// Bytes of `n` activations in this format (`n` a multiple of `block_elems`).
    pub fn bytes_for(self, n: usize) -> usize {
        n / self.block_elems() * self.block_bytes()
    }

    /// Quantizes `x` (a multiple of `block_elems` values) into `out` (exactly `bytes_for(x.len())` bytes).
    pub fn quantize(self, x: &[f32], out: &mut [u8]) {
        assert_eq!(
            x.len() % self.block_elems(),
            0,
            "activations not a whole number of blocks"
        );
        assert_eq!(
            out.len(),
            self.bytes_for(x.len()),
            "activation buffer of the wrong size"
        );
        match self {
            ActType::F32 => {
                for (o, v) in out.chunks_exact_mut(4).zip(x) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
            ActType::Q8_0 => legacy::quantize_q8_0(x, out),
            ActType::Q8_1 => legacy::quantize_q8_1(x, out),
            ActType::Q8_K => kquants::quantize_q8_k(x, out),
        }
    }
}

/// What a weight format supplies. Functions take whole blocks; lengths are checked by the callers in this
/// module ([`dequantize`], [`vec_dot`]), which are what the rest of the project calls.
pub struct QuantOps {
    /// Dequantizes `src` (whole blocks) into `dst` (`block_elems` values per block).
    pub dequantize: fn(src: &[u8], dst: &mut [f32]),
    /// The activation format of [`QuantOps::vec_dot`].
    pub act: ActType,
    /// Dot product of one weight row (`n` values, whole blocks) with `n` activations in format `act`.
    pub vec_dot: fn(n: usize, row: &[u8], act: &[u8]) -> f32,
    /// The portable (no SIMD) dot product: the reference the SIMD path is tested against, and what runs on
    /// CPUs without AVX2/FMA. `vec_dot` chooses between them at run time.
    pub vec_dot_portable: fn(n: usize, row: &[u8], act: &[u8]) -> f32,
    /// Writes random valid blocks into `dst` (whole blocks) whose values have zero mean and a
    /// root-mean-square of about `rms`.
    pub fill_random: fn(rng: &mut Rng, rms: f32, dst: &mut [u8]),
}

/// Error of a quantization call with mismatched lengths or an unsupported type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantError(pub String);

impl std::fmt::Display for QuantError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for QuantError {}

fn ops_or_err(ty: GgmlType) -> Result<&'static QuantOps, QuantError> {
    ty.ops()
        .ok_or_else(|| QuantError(format!("tensor type {ty} is not supported for computation")))
}

/// Dequantizes `src` (whole blocks of `ty`) into `dst`, which must hold exactly as many values.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    let ops = ops_or_err(ty)?;
    let (be, bb) = (ty.block_elems(), ty.block_bytes());
    if !src.len().is_multiple_of(bb) || src.len() / bb * be != dst.len() {
        return Err(QuantError(format!(
            "{ty}: {} bytes do not hold {} values",
            src.len(),
            dst.len()
        )));
    }
    (ops.dequantize)(src, dst);
    Ok(())
}

/// Dot product of one weight row of `ty` (`n` values) with activations already quantized to
/// `ty.ops().act`.
pub fn vec_dot(ty: GgmlType, n: usize, row: &[u8], act: &[u8]) -> Result<f32, QuantError> {
    let ops = ops_or_err(ty)?;
    if ty.bytes_for(n as u64) != Some(row.len() as u64) {
        return Err(QuantError(format!(
            "{ty}: row of {} bytes is not {n} values",
            row.len()
        )));
    }
    if !n.is_multiple_of(ops.act.block_elems()) || ops.act.bytes_for(n) != act.len() {
        return Err(QuantError(format!(
            "{ty}: activations of {} bytes are not {n} values",
            act.len()
        )));
    }
    Ok((ops.vec_dot)(n, row, act))
}

/// The dot product of a format in the order llama.cpp's CPU backend uses when it multiplies a batch of
/// activation rows, where that differs from the order of [`QuantOps::vec_dot`] (its order for a single
/// row). A matrix product that wants llama.cpp's results bit for bit uses [`BatchDot::dot`] for the rows
/// [`BatchDot::applies`] names.
///
/// - Q4_K (repacked by llama.cpp, `CPU_REPACK`): `ggml_gemm_q4_K_8x8_q8_K` takes the first `4·⌊n/4⌋` rows
///   of a batch of `n > 3`, four at a time; the rest go through the gemv order of `vec_dot`.
/// - Q2_K, Q3_K, Q5_K, Q6_K: batches of 8 rows or more take ggml's tiled K-quant matmul
///   (`ggml-cpu/tiled`), one fused step per super-block on its integer totals.
/// - IQ2_XS, IQ3_XXS, IQ4_XS: the same tiled matmul (`iquants::tiled`).
pub struct BatchDot {
    /// Chosen at run time, like [`QuantOps::vec_dot`].
    pub dot: fn(n: usize, row: &[u8], act: &[u8]) -> f32,
    /// The portable code, equal to `dot` bit for bit.
    pub portable: fn(n: usize, row: &[u8], act: &[u8]) -> f32,
    /// Whether row `j` of a batch of `n_rows` takes this order.
    pub applies: fn(n_rows: usize, j: usize) -> bool,
    /// Where the order comes in groups of four rows (Q4_K), the four dot products of one weight row with
    /// four activation rows at once, equal to [`BatchDot::dot`] on each (faster: their sums interleave).
    pub dot4: Option<Dot4>,
}

/// Four dot products of one weight row with four activation rows ([`BatchDot::dot4`]).
pub type Dot4 = fn(n: usize, row: &[u8], acts: [&[u8]; 4]) -> [f32; 4];

/// The [`BatchDot`] of `ty`, for the formats that have one.
pub fn batch_dot(ty: GgmlType) -> Option<&'static BatchDot> {
    match ty {
        GgmlType::Q4_K => Some(&kquants::Q4K_GEMM4),
        GgmlType::Q2_K => Some(&kquants::Q2K_TILED),
        GgmlType::Q3_K => Some(&kquants::Q3K_TILED),
        GgmlType::Q5_K => Some(&kquants::Q5K_TILED),
        GgmlType::Q6_K => Some(&kquants::Q6K_TILED),
        _ => iquants::tiled::batch_dot(ty),
    }
}

/// llama.cpp's order for the rows of a batch of `n_rows` multiplied by a `ty` matrix it does not repack
/// (`CPU_REPACK` takes Q4_K matrices whose row count is a multiple of 8), where that differs from the
/// orders [`crate::matmul::matmul`] uses ([`QuantOps::vec_dot`] and [`batch_dot`] are Q4_K's repacked
/// ones): for Q4_K, `ggml_vec_dot_q4_K_q8_K` under 8 rows, the tiled matmul from 8. `None`: the usual
/// orders apply.
pub fn unrepacked_order(ty: GgmlType, n_rows: usize) -> Option<&'static BatchDot> {
    match ty {
        GgmlType::Q4_K if n_rows >= 8 => Some(&kquants::Q4K_TILED),
        GgmlType::Q4_K => Some(&kquants_ggml::Q4K_PLAIN),
        _ => None,
    }
}

/// The order of llamafile's tinyBLAS F32 kernel, which llama.cpp's CPU backend uses for batches of two
/// rows or more times an F32 matrix whose row count is a multiple of 4 (MoE routers); the caller checks
/// those conditions (`applies` only checks the batch).
pub fn f32_tinyblas_order() -> &'static BatchDot {
    &float_ggml::F32_TINYBLAS
}

/// The order of llamafile's tinyBLAS F16 kernel, which llama.cpp's CPU backend (and mtmd's encoders) use
/// for a batch of two rows or more times an F16 matrix once the activations are made f16: pass it to
/// [`crate::matmul::matmul_ordered`] with activations that already hold f16 values. Rows whose length is no
/// multiple of 8 keep F16's own dot product.
pub fn f16_tinyblas_order() -> &'static BatchDot {
    &float_ggml::F16_TINYBLAS
}

/// Writes random valid blocks of `ty` (zero mean, root-mean-square about `rms`) into `dst`.
pub fn fill_random(
    ty: GgmlType,
    rng: &mut Rng,
    rms: f32,
    dst: &mut [u8],
) -> Result<(), QuantError> {
    let ops = ops_or_err(ty)?;
    if !dst.len().is_multiple_of(ty.block_bytes()) {
        return Err(QuantError(format!(
            "{ty}: {} bytes are not whole blocks",
            dst.len()
        )));
    }
    (ops.fill_random)(rng, rms, dst);
    Ok(())
}

/// Reads a little-endian f16 at `b[0..2]` as f32 (exact, inline: `half`'s conversion is a call through
/// a run-time dispatch, too slow once per block; NaN payloads are kept as numpy keeps them).
#[inline(always)]
pub(crate) fn f16_at(b: &[u8]) -> f32 {
    float::f16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]))
}

/// Writes `v` as a little-endian f16 at `b[0..2]` (rounded to nearest even, as `half` does, but inline).
#[inline(always)]
pub(crate) fn put_f16(b: &mut [u8], v: f32) {
    b[..2].copy_from_slice(&float::f32_to_f16_bits(v).to_le_bytes());
}

/// Whether AVX2 and FMA may be used (checked once, at run time).
#[inline]
pub(crate) fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            crate::options::get().cpu.simd
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the AVX-512 kernels (F, BW, VL, VNNI, with AVX2/FMA/F16C) may be used: checked once, at run
/// time; `--cpu-avx512 off` (or `--cpu-simd off`) turns them off, for comparisons and tests.
#[inline]
pub(crate) fn has_avx512_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            has_avx2_fma()
                && crate::options::get().cpu.avx512
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The SIMD level the CPU kernels run at in this process: `"avx512-vnni"`, `"avx2"` or `"portable"`.
pub fn simd_level() -> &'static str {
    if has_avx512_vnni() {
        "avx512-vnni"
    } else if has_avx2_fma() {
        "avx2"
    } else {
        "portable"
    }
}
