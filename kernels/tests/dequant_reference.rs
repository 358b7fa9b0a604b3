//! Dequantization of every weight type equals, bit for bit, the independent numpy implementation in the
//! `gguf` PyPI package (0.19.0).
//!
//! The references are written by `tests/fixtures/quant/make_refs.py` (random blocks with finite scales,
//! including zero, negative and subnormal ones) and committed, so this test needs no Python. A value
//! matches when its f32 bits are equal; the one tolerance is the sign of a zero (`-0.0 == 0.0`), which no
//! computation downstream can observe.

use poly_kernels::quant::{dequantize, GgmlType};
use std::path::PathBuf;

struct Reference {
    blocks: Vec<u8>,
    values: Vec<f32>,
}

fn load(ty: GgmlType) -> Reference {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/quant")
        .join(format!("{}.bin", ty.name()));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(
        &bytes[..8],
        b"PQREF1\0\0",
        "{}: not a reference file",
        path.display()
    );
    let word =
        |i: usize| u32::from_le_bytes(bytes[8 + 4 * i..12 + 4 * i].try_into().unwrap()) as usize;
    let (id, n_blocks, block_elems, block_bytes) = (word(0), word(1), word(2), word(3));
    assert_eq!(id as u32, ty.id());
    assert_eq!(
        (block_elems, block_bytes),
        (ty.block_elems(), ty.block_bytes())
    );
    let blocks_end = 24 + n_blocks * block_bytes;
    let values = bytes[blocks_end..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect::<Vec<_>>();
    assert_eq!(values.len(), n_blocks * block_elems);
    Reference {
        blocks: bytes[24..blocks_end].to_vec(),
        values,
    }
}

fn check(ty: GgmlType) {
    let reference = load(ty);
    let mut ours = vec![f32::NAN; reference.values.len()];
    dequantize(ty, &reference.blocks, &mut ours).unwrap_or_else(|e| panic!("{ty}: {e}"));
    let per_block = ty.block_elems();
    for (i, (a, b)) in ours.iter().zip(&reference.values).enumerate() {
        let same = a.to_bits() == b.to_bits() || (*a == 0.0 && *b == 0.0);
        assert!(
            same,
            "{ty}: value {i} (block {}, element {}) is {a:e} ({:#010x}), gguf gives {b:e} ({:#010x})",
            i / per_block,
            i % per_block,
            a.to_bits(),
            b.to_bits()
        );
    }
}

macro_rules! reference_tests {
    ($($name:ident => $ty:ident),* $(,)?) => {
        $( #[test] fn $name() { check(GgmlType::$ty); } )*

        #[test]
        fn every_weight_type_has_a_reference_test() {
            let tested = [$(GgmlType::$ty),*];
            for ty in poly_kernels::quant::WEIGHT_TYPES {
                assert!(tested.contains(ty), "{ty} has no reference test");
            }
        }
    };
}

reference_tests! {
    f32 => F32, f16 => F16, bf16 => BF16,
    q4_0 => Q4_0, q4_1 => Q4_1, q5_0 => Q5_0, q5_1 => Q5_1, q8_0 => Q8_0,
    q2_k => Q2_K, q3_k => Q3_K, q4_k => Q4_K, q5_k => Q5_K, q6_k => Q6_K,
    iq2_xxs => IQ2_XXS, iq2_xs => IQ2_XS, iq2_s => IQ2_S, iq3_xxs => IQ3_XXS, iq3_s => IQ3_S,
    iq4_nl => IQ4_NL, iq4_xs => IQ4_XS, mxfp4 => MXFP4, iq1_s => IQ1_S, iq1_m => IQ1_M,
}
