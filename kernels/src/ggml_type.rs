//! GGML tensor types as GGUF files name them: ids, names, block sizes.
//!
//! This table is all a reader of GGUF files needs to size tensors; it compiles without the `compute` feature,
//! so the server can read GGUF metadata without linking the numeric code.

/// A GGML tensor type, with the numeric ids GGUF files use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
}

/// (type, GGUF id, name, elements per block, bytes per block)
const TYPE_TABLE: &[(GgmlType, u32, &str, usize, usize)] = &[
    (GgmlType::F32, 0, "F32", 1, 4),
    (GgmlType::F16, 1, "F16", 1, 2),
    (GgmlType::Q4_0, 2, "Q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "Q4_1", 32, 20),
    (GgmlType::Q5_0, 6, "Q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "Q5_1", 32, 24),
    (GgmlType::Q8_0, 8, "Q8_0", 32, 34),
    (GgmlType::Q8_1, 9, "Q8_1", 32, 36),
    (GgmlType::Q2_K, 10, "Q2_K", 256, 84),
    (GgmlType::Q3_K, 11, "Q3_K", 256, 110),
    (GgmlType::Q4_K, 12, "Q4_K", 256, 144),
    (GgmlType::Q5_K, 13, "Q5_K", 256, 176),
    (GgmlType::Q6_K, 14, "Q6_K", 256, 210),
    (GgmlType::Q8_K, 15, "Q8_K", 256, 292),
    (GgmlType::IQ2_XXS, 16, "IQ2_XXS", 256, 66),
    (GgmlType::IQ2_XS, 17, "IQ2_XS", 256, 74),
    (GgmlType::IQ3_XXS, 18, "IQ3_XXS", 256, 98),
    (GgmlType::IQ1_S, 19, "IQ1_S", 256, 50),
    (GgmlType::IQ4_NL, 20, "IQ4_NL", 32, 18),
    (GgmlType::IQ3_S, 21, "IQ3_S", 256, 110),
    (GgmlType::IQ2_S, 22, "IQ2_S", 256, 82),
    (GgmlType::IQ4_XS, 23, "IQ4_XS", 256, 136),
    (GgmlType::I8, 24, "I8", 1, 1),
    (GgmlType::I16, 25, "I16", 1, 2),
    (GgmlType::I32, 26, "I32", 1, 4),
    (GgmlType::I64, 27, "I64", 1, 8),
    (GgmlType::F64, 28, "F64", 1, 8),
    (GgmlType::IQ1_M, 29, "IQ1_M", 256, 56),
    (GgmlType::BF16, 30, "BF16", 1, 2),
    (GgmlType::TQ1_0, 34, "TQ1_0", 256, 54),
    (GgmlType::TQ2_0, 35, "TQ2_0", 256, 66),
    (GgmlType::MXFP4, 39, "MXFP4", 32, 17),
];

impl GgmlType {
    fn row(self) -> &'static (GgmlType, u32, &'static str, usize, usize) {
        TYPE_TABLE
            .iter()
            .find(|r| r.0 == self)
            .expect("every GgmlType has a TYPE_TABLE row")
    }

    /// The type with GGUF id `id`, if GGML defines it (removed ids such as 4 and 5 give `None`).
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TYPE_TABLE.iter().find(|r| r.1 == id).map(|r| r.0)
    }

    /// The type named `name` (`"Q4_K"`, case-insensitive).
    pub fn from_name(name: &str) -> Option<GgmlType> {
        TYPE_TABLE
            .iter()
            .find(|r| r.2.eq_ignore_ascii_case(name))
            .map(|r| r.0)
    }

    /// The GGUF id.
    pub fn id(self) -> u32 {
        self.row().1
    }

    /// GGML's name of the type.
    pub fn name(self) -> &'static str {
        self.row().2
    }

    /// Values per block.
    pub fn block_elems(self) -> usize {
        self.row().3
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        self.row().4
    }

    /// Bytes of `n` values, or `None` when `n` is not a whole number of blocks or the size overflows.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let be = self.block_elems() as u64;
        if !n.is_multiple_of(be) {
            return None;
        }
        (n / be).checked_mul(self.block_bytes() as u64)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_table_matches_ids_and_sizes() {
        for &(ty, id, name, _, _) in TYPE_TABLE {
            assert_eq!(GgmlType::from_id(id), Some(ty));
            assert_eq!(GgmlType::from_name(name), Some(ty));
        }
        assert_eq!(GgmlType::from_id(4), None);
        assert_eq!(GgmlType::Q4_K.bytes_for(512), Some(288));
        assert_eq!(GgmlType::Q4_K.bytes_for(100), None);
        assert_eq!(GgmlType::F32.bytes_for(u64::MAX), None);
    }
}
