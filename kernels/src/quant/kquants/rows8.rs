//! Q4_K prompt products eight weight rows at a time from a laid-out copy of the rows (AVX2 machines
//! without AVX-512 VNNI): [`Rows8`] wraps [`crate::quant::x86::q4k_rows8`], whose results equal the
//! row-by-row kernels' in both of Q4_K's orders bit for bit.

use super::Q8K_BYTES;
use crate::quant::GgmlType;

/// Q4_K super-block bytes.
const Q4K_BLOCK: usize = 144;

/// Eight Q4_K rows of `nb` super-blocks laid out for the eight-row kernel.
pub struct Rows8<'a> {
    nb: usize,
    packed: &'a [u8],
}

/// Whether products of `ty` go eight rows at a time on this machine.
pub fn rows8(ty: GgmlType) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        ty == GgmlType::Q4_K && super::super::has_avx2_fma() && !super::super::has_avx512_vnni()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = ty;
        false
    }
}

/// Bytes [`Rows8::pack`] writes for eight rows of `n` values.
pub fn rows8_bytes(n: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        n / 256 * crate::quant::x86::q4k_rows8::PACKED_BYTES
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = n;
        0
    }
}

impl<'a> Rows8<'a> {
    /// Lays out `rows` (eight Q4_K rows of `n` values) in `out` ([`rows8_bytes`] bytes), for
    /// [`Rows8::new`].
    pub fn pack(n: usize, rows: [&[u8]; 8], out: &mut [u8]) {
        let nb = n / 256;
        assert!(n.is_multiple_of(256), "Q4_K rows of {n} values");
        assert!(
            rows.iter().all(|r| r.len() == nb * Q4K_BLOCK),
            "Q4_K rows of {n} values"
        );
        assert!(rows8(GgmlType::Q4_K), "Rows8 without AVX2");
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `rows8` confirmed AVX2, FMA and F16C; `repack` checks the lengths it reads and writes.
        unsafe {
            crate::quant::x86::q4k_rows8::repack(nb, rows, out)
        };
    }

    /// Eight rows of `n` values that [`Rows8::pack`] laid out in `packed`.
    pub fn new(n: usize, packed: &'a [u8]) -> Rows8<'a> {
        assert!(packed.len() >= rows8_bytes(n), "packed rows too short");
        Rows8 {
            nb: n / 256,
            packed,
        }
    }

    /// The eight rows' dot products with the Q8_K activation rows `acts`, each in Q4_K's repacked-gemm
    /// order (`gemm`) or its single-row order; two rows at a time where both take one order.
    pub fn dot<const T: usize>(&self, gemm: bool, acts: [&[u8]; T]) -> [[f32; 8]; T] {
        assert!(
            acts.iter().all(|a| a.len() >= self.nb * Q8K_BYTES),
            "Q8_K activations too short"
        );
        #[cfg(target_arch = "x86_64")]
        if rows8(GgmlType::Q4_K) {
            use crate::quant::x86::q4k_rows8::q4k_rows8;
            let ys = acts.map(|a| a.as_ptr());
            // SAFETY: `rows8` confirmed AVX2, FMA and F16C; `packed` holds `nb` packed super-blocks
            // and each of `acts` `nb` Q8_K blocks (both asserted), all the kernel reads.
            return unsafe {
                if gemm {
                    q4k_rows8::<true, T>(self.nb, self.packed.as_ptr(), ys)
                } else {
                    q4k_rows8::<false, T>(self.nb, self.packed.as_ptr(), ys)
                }
            };
        }
        panic!("Rows8::dot without AVX2")
    }
}
