//! Filling one tensor's bytes: random valid blocks of its type in parallel, or exact F32/F16/BF16 values
//! for norms, the delta-net's small parameters and routers.
//!
//! A tensor is cut into chunks of a fixed byte size (whole blocks), and chunk `c` of tensor `t` draws
//! from its own generator seeded from `(seed, t, c)`: the bytes depend on the seed only, never on the
//! number of threads or the order in which chunks run.

use poly_kernels::quant::{self, GgmlType};
use poly_kernels::rng::Rng;
use rayon::prelude::*;

use super::plan::{Init, PlannedTensor};
use super::SynthError;

/// Bytes per chunk of random blocks (rounded down to whole blocks): large enough that scheduling costs
/// nothing, small enough that a few tensors keep every core busy.
const CHUNK_BYTES: usize = 1 << 20;

/// splitmix64's finalizer: a well-mixed 64-bit hash of `x`.
pub fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The seed of stream `(a, b)` under `seed`.
pub fn stream_seed(seed: u64, a: u64, b: u64) -> u64 {
    mix64(mix64(mix64(seed) ^ a) ^ b.rotate_left(32))
}

/// Fills `out` (exactly the tensor's bytes) with tensor `index`'s data. `routers[layer]` holds the bytes of
/// block `layer`'s router (generated ahead so they could be simulated).
pub fn fill_tensor(
    t: &PlannedTensor,
    index: usize,
    seed: u64,
    routers: &[Option<Vec<u8>>],
    out: &mut [u8],
) -> Result<(), SynthError> {
    let name = &t.desc.name;
    match &t.init {
        Init::Random { rms } => {
            fill_random_blocks(t.ty, *rms, stream_seed(seed, index as u64, 0), out)
                .map_err(|e| SynthError(format!("{name}: {e}")))
        }
        Init::Norm { mean, noise } => {
            let mut rng = Rng::new(stream_seed(seed, index as u64, 0));
            write_floats(t.ty, out, |_| mean + noise * rng.normal(), name)
        }
        Init::Gaussian { rms } => {
            let mut rng = Rng::new(stream_seed(seed, index as u64, 0));
            write_floats(t.ty, out, |_| rms * rng.normal(), name)
        }
        Init::Uniform { lo, hi } => {
            let mut rng = Rng::new(stream_seed(seed, index as u64, 0));
            write_floats(t.ty, out, |_| lo + (hi - lo) * rng.f32(), name)
        }
        Init::Steps { first, a, b } => {
            let first = *first as usize;
            write_floats(t.ty, out, |i| if i < first { *a } else { *b }, name)
        }
        Init::ExpertIds { n_expert, per_row } => {
            if t.ty != GgmlType::I32 || *per_row == 0 || per_row > n_expert {
                return Err(SynthError(format!(
                    "{name}: expert ids are I32 rows of at most {n_expert} distinct experts"
                )));
            }
            let mut rng = Rng::new(stream_seed(seed, index as u64, 0));
            let (n, k) = (*n_expert as usize, *per_row as usize);
            let mut ids: Vec<i32> = (0..n as i32).collect();
            for row in out.chunks_exact_mut(4 * k) {
                // A partial Fisher-Yates shuffle: the first k of the ids are the row's.
                for i in 0..k {
                    let j = i + (rng.f32() * (n - i) as f32) as usize;
                    ids.swap(i, j.min(n - 1));
                }
                for (b, id) in row.chunks_exact_mut(4).zip(&ids[..k]) {
                    b.copy_from_slice(&id.to_le_bytes());
                }
            }
            Ok(())
        }
        Init::AgreeingEmbedding(plan) => super::agree::fill_embedding(plan, seed, t.ty, out),
        Init::AgreeingEhProj(plan) => {
            super::agree::fill_eh_proj(plan, stream_seed(seed, index as u64, 0), t.ty, out)
        }
        Init::Router { layer } => {
            let w = routers
                .get(*layer as usize)
                .and_then(Option::as_ref)
                .filter(|w| w.len() == out.len())
                .ok_or_else(|| SynthError(format!("{name}: router of block {layer} missing")))?;
            out.copy_from_slice(w);
            Ok(())
        }
    }
}

/// Random valid blocks of `ty` with zero mean and RMS ≈ `rms`, in parallel chunks.
pub fn fill_random_blocks(
    ty: GgmlType,
    rms: f32,
    tensor_seed: u64,
    out: &mut [u8],
) -> Result<(), quant::QuantError> {
    let bb = ty.block_bytes();
    let chunk = (CHUNK_BYTES / bb).max(1) * bb;
    out.par_chunks_mut(chunk)
        .enumerate()
        .try_for_each(|(c, dst)| {
            let mut rng = Rng::new(mix64(tensor_seed ^ mix64(c as u64)));
            quant::fill_random(ty, &mut rng, rms, dst)
        })
}

/// Writes values `f(0), f(1), …` in a float type (F32, F16 or BF16) over all of `out`.
pub(super) fn write_floats(
    ty: GgmlType,
    out: &mut [u8],
    mut f: impl FnMut(usize) -> f32,
    name: &str,
) -> Result<(), SynthError> {
    match ty {
        GgmlType::F32 => out
            .chunks_exact_mut(4)
            .enumerate()
            .for_each(|(i, o)| o.copy_from_slice(&f(i).to_le_bytes())),
        GgmlType::F16 => out.chunks_exact_mut(2).enumerate().for_each(|(i, o)| {
            o.copy_from_slice(&half::f16::from_f32(f(i)).to_bits().to_le_bytes())
        }),
        GgmlType::BF16 => out.chunks_exact_mut(2).enumerate().for_each(|(i, o)| {
            o.copy_from_slice(&half::bf16::from_f32(f(i)).to_bits().to_le_bytes())
        }),
        other => {
            return Err(SynthError(format!(
                "{name}: exact values can be written only as F32, F16 or BF16, not {other}"
            )))
        }
    }
    Ok(())
}

/// `values` in a float type (F32, F16 or BF16).
pub fn encode_floats(ty: GgmlType, values: &[f32], name: &str) -> Result<Vec<u8>, SynthError> {
    let mut out = vec![0u8; values.len() * ty.block_bytes()];
    write_floats(ty, &mut out, |i| values[i], name)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_seeds_differ() {
        let a = stream_seed(1, 0, 0);
        assert_ne!(a, stream_seed(1, 1, 0));
        assert_ne!(a, stream_seed(1, 0, 1));
        assert_ne!(a, stream_seed(2, 0, 0));
        assert_eq!(a, stream_seed(1, 0, 0));
    }

    #[test]
    fn floats_are_written_exactly() {
        let mut out = vec![0u8; 12];
        write_floats(GgmlType::F32, &mut out, |i| i as f32 + 0.5, "t").expect("f32");
        assert_eq!(f32::from_le_bytes([out[4], out[5], out[6], out[7]]), 1.5);
        let mut out = vec![0u8; 4];
        write_floats(GgmlType::BF16, &mut out, |_| 2.0, "t").expect("bf16");
        assert_eq!(out[..2], half::bf16::from_f32(2.0).to_bits().to_le_bytes());
        assert!(write_floats(GgmlType::Q8_0, &mut out, |_| 0.0, "t").is_err());
    }
}
