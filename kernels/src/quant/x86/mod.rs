//! x86-64 SIMD (AVX2/FMA/F16C) dot products, chosen at run time by the format families.

pub(crate) mod iquants_avx2;
