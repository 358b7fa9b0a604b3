//! AVX2/FMA/F16C kernels of the quantization formats, chosen at run time by the family files.
//!
//! Every function here is `unsafe` and compiled with `#[target_feature(enable = "avx2,fma,f16c")]`; callers
//! check `super::has_avx2_fma()` first. The AVX-512 kernels (`*_avx512`) add `avx512f,avx512bw,avx512vl,
//! avx512vnni`; callers check `super::has_avx512_vnni()`.

pub(crate) mod act_avx2;
pub(crate) mod float_avx2;
pub(crate) mod float_tiles;
pub(crate) mod iquants_avx2;
pub(crate) mod kquants_avx2;
pub(crate) mod kquants_avx512;
pub(crate) mod ktile_avx2;
pub(crate) mod ktile_avx512;
pub(crate) mod legacy_avx2;
pub(crate) mod legacy_avx512;
pub(crate) mod q4k_rows8;
