//! The quantized weight formats the card computes, one row each: every entry point's kernel name, the
//! module that holds it and the per-format launch constant derive from the row, so adding a format is one
//! line here (with its `fmt_*` struct and `MATVEC_ENTRY_POINTS(<suffix>, fmt_*)` line in the module's `.cu`
//! file; the tests below check that the two agree).

use super::module::KernelModule;
use crate::quant::GgmlType;

/// One quantized format's kernels: the six entry points `MATVEC_ENTRY_POINTS(<suffix>, ..)` makes in
/// `matvec.cuh`.
#[derive(Debug)]
pub(crate) struct QFormat {
    pub ty: GgmlType,
    /// The module whose `.cu` file instantiates the format (matvec_q.cu or matvec_iq.cu).
    pub module: KernelModule,
    /// Threads that share one weight block (`qi / vdr` of the format's `fmt_*` struct).
    pub threads_per_block: usize,
    /// `matvec_<suffix>`: one matrix × one vector.
    pub matvec: &'static str,
    /// `matvec_many_<suffix>`: up to 4 matrices of one width × one vector.
    pub many: &'static str,
    /// `matvec_experts_<suffix>`: several experts of a stacked tensor, one slot each.
    pub experts: &'static str,
    /// `matvec_experts_glu_<suffix>`: gate and up experts in one launch, silu(gate)·up.
    pub glu: &'static str,
    /// `matmul_<suffix>`: prompt tiles of 8 tokens (dp4a).
    pub matmul: &'static str,
    /// `matmul_experts_<suffix>`: prompt tiles grouped by expert (dp4a).
    pub matmul_experts: &'static str,
}

macro_rules! q_formats {
    ($($ty:ident => $module:ident, $suffix:literal, $threads:literal;)*) => {
        /// Every quantized format the card computes.
        pub(crate) const Q_FORMATS: &[QFormat] = &[$(QFormat {
            ty: GgmlType::$ty,
            module: KernelModule::$module,
            threads_per_block: $threads,
            matvec: concat!("matvec_", $suffix),
            many: concat!("matvec_many_", $suffix),
            experts: concat!("matvec_experts_", $suffix),
            glu: concat!("matvec_experts_glu_", $suffix),
            matmul: concat!("matmul_", $suffix),
            matmul_experts: concat!("matmul_experts_", $suffix),
        }),*];
    };
}

q_formats! {
    Q4_0 => MatvecQ, "q4_0", 2;
    Q4_1 => MatvecQ, "q4_1", 2;
    Q5_0 => MatvecQ, "q5_0", 2;
    Q5_1 => MatvecQ, "q5_1", 2;
    Q8_0 => MatvecQ, "q8_0", 4;
    Q2_K => MatvecQ, "q2_k", 16;
    Q3_K => MatvecQ, "q3_k", 16;
    Q4_K => MatvecQ, "q4_k", 16;
    Q5_K => MatvecQ, "q5_k", 16;
    Q6_K => MatvecQ, "q6_k", 32;
    IQ4_NL => MatvecQ, "iq4_nl", 2;
    IQ4_XS => MatvecQ, "iq4_xs", 8;
    IQ2_XXS => MatvecIq, "iq2_xxs", 8;
    IQ2_XS => MatvecIq, "iq2_xs", 8;
    IQ2_S => MatvecIq, "iq2_s", 8;
    IQ3_XXS => MatvecIq, "iq3_xxs", 8;
    IQ3_S => MatvecIq, "iq3_s", 8;
    IQ1_S => MatvecIq, "iq1_s", 8;
    IQ1_M => MatvecIq, "iq1_m", 8;
}

/// Every quantized format the card computes, in the table's order (for tests and tools that go through
/// them all).
pub fn quantized_formats() -> impl Iterator<Item = GgmlType> {
    Q_FORMATS.iter().map(|f| f.ty)
}

/// The row of `ty`, if the card computes it as a quantized format.
pub(crate) fn q_format(ty: GgmlType) -> Option<&'static QFormat> {
    Q_FORMATS.iter().find(|f| f.ty == ty)
}

#[cfg(test)]
mod tests {
    //! The table against the `.cu` sources (no GPU needed).

    use super::*;

    /// `(qk, qi, vdr)` of `struct fmt` in `src`, from its `static constexpr int qk = .., qi = .., vdr = ..;`
    /// line; `qk` is `QK_K` (256) or a number.
    fn constants(src: &str, fmt: &str) -> (usize, usize, usize) {
        let start = src
            .find(&format!("struct {fmt} {{"))
            .unwrap_or_else(|| panic!("struct {fmt}"));
        let line = src[start..]
            .lines()
            .find(|l| l.contains("static constexpr int qk"))
            .expect("constants line");
        let value = |key: &str| -> usize {
            let at = line.find(&format!("{key} = ")).expect("key") + key.len() + 3;
            let word: String = line[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if word == "QK_K" {
                256
            } else {
                word.parse().expect("number")
            }
        };
        (value("qk"), value("qi"), value("vdr"))
    }

    #[test]
    fn every_format_has_its_entry_points_and_matching_constants() {
        for f in Q_FORMATS {
            let src = f.module.source();
            let suffix = f.matvec.trim_start_matches("matvec_");
            let line = src
                .lines()
                .find_map(|l| {
                    l.trim()
                        .strip_prefix(&format!("MATVEC_ENTRY_POINTS({suffix},"))
                })
                .unwrap_or_else(|| panic!("{}: no entry points in {}.cu", f.ty, f.module.name()));
            let fmt = line.trim().trim_end_matches(')').trim();
            let (qk, qi, vdr) = constants(&src, fmt);
            assert_eq!(f.threads_per_block, qi / vdr, "{} ({fmt})", f.ty);
            assert_eq!(f.ty.block_elems(), qk, "{} ({fmt})", f.ty);
            // The block layout the struct reads has GGUF's size (common.cuh asserts the number).
            let body = &src[src.find(&format!("struct {fmt} {{")).expect("struct")..];
            let block = body
                .lines()
                .find_map(|l| l.trim().strip_prefix("typedef "))
                .and_then(|l| l.strip_suffix(" block;"))
                .expect("typedef .. block;");
            let size: usize = src
                .split(&format!("static_assert(sizeof({block}) == "))
                .nth(1)
                .and_then(|rest| rest.split(',').next())
                .and_then(|n| n.trim().parse().ok())
                .unwrap_or_else(|| panic!("no size assertion for {block}"));
            assert_eq!(f.ty.block_bytes(), size, "{} ({block})", f.ty);
            for name in [f.many, f.experts, f.glu, f.matmul, f.matmul_experts] {
                assert!(name.ends_with(suffix), "{name}");
            }
        }
        // The macro makes all six entry points from the suffix.
        let shared = KernelModule::MatvecQ.source();
        for stem in [
            "matvec_##name(",
            "matvec_many_##name(",
            "matvec_experts_##name(",
            "matvec_experts_glu_##name(",
            "matmul_##name(",
            "matmul_experts_##name(",
        ] {
            assert!(shared.contains(stem), "{stem}");
        }
    }

    #[test]
    fn every_format_is_listed_once() {
        for (i, f) in Q_FORMATS.iter().enumerate() {
            assert!(Q_FORMATS[i + 1..].iter().all(|g| g.ty != f.ty), "{}", f.ty);
        }
        assert!(q_format(GgmlType::IQ2_XXS).is_some());
        assert!(q_format(GgmlType::F16).is_none());
    }
}
