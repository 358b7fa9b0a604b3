//! Activation quantization rounds as ggml's x86 CPU backend does: `q = x · (127 / amax)` rounded to
//! nearest with ties to even (not `x / d` with ties away from zero, the portable reference), so the
//! quantized activations, and every dot product after them, are llama.cpp's.

use poly_kernels::quant::ActType;

/// A block of `n` values whose largest magnitude is 127 (so `127 / amax` is exactly 1) with `ties` at
/// the front: every quantized value is then the rounding of the value itself.
fn block(n: usize, ties: &[f32]) -> Vec<f32> {
    let mut x = vec![0.25f32; n];
    x[..ties.len()].copy_from_slice(ties);
    x[n - 1] = 127.0;
    x
}

const TIES: [f32; 6] = [0.5, 1.5, 2.5, -2.5, -3.5, 126.5];
const EVEN: [i8; 6] = [0, 2, 2, -2, -4, 126];

fn quants(act: ActType, x: &[f32], offset: usize, n: usize) -> Vec<i8> {
    let mut out = vec![0u8; act.bytes_for(x.len())];
    act.quantize(x, &mut out);
    out[offset..offset + n].iter().map(|&b| b as i8).collect()
}

#[test]
fn q8_0_and_q8_1_round_ties_to_even() {
    assert_eq!(quants(ActType::Q8_0, &block(32, &TIES), 2, 6), EVEN);
    assert_eq!(quants(ActType::Q8_1, &block(32, &TIES), 4, 6), EVEN);
    // The rest of the block: 0.25 → 0, the maximum → 127.
    assert_eq!(quants(ActType::Q8_0, &block(32, &TIES), 32, 2), [0, 127]);
}

#[test]
fn q8_k_rounds_ties_to_even_and_keeps_d_times_q() {
    let x = block(256, &TIES);
    assert_eq!(quants(ActType::Q8_K, &x, 4, 6), EVEN);
    let mut out = vec![0u8; ActType::Q8_K.bytes_for(256)];
    ActType::Q8_K.quantize(&x, &mut out);
    let d = f32::from_le_bytes(out[0..4].try_into().unwrap());
    assert_eq!(d, 1.0);
    // The first group's sum of quants: the six ties, ten values of 0.25 (→ 0).
    let sum0 = i16::from_le_bytes([out[260], out[261]]);
    assert_eq!(sum0, EVEN.iter().map(|&q| q as i16).sum::<i16>());
}

#[test]
fn the_scale_multiplies_by_127_over_amax() {
    // Find a block maximum for which 127/amax and 1/(amax/127) differ in the last bit, and a value whose
    // product with them lands on opposite sides of a rounding boundary: ggml's quantization follows the
    // first.
    let mut found = None;
    'search: for m in 1..2000u32 {
        let amax = 1.0 + m as f32 * 0.013;
        let (ggml, reference) = (127.0 / amax, 1.0 / (amax / 127.0));
        if ggml == reference {
            continue;
        }
        for i in 0..20_000u32 {
            let v = amax * (i as f32 / 20_000.0);
            if (v * ggml).round_ties_even() != (v * reference).round_ties_even() {
                found = Some((amax, v, (v * ggml).round_ties_even() as i8));
                break 'search;
            }
        }
    }
    let (amax, v, want) = found.expect("a value where the two scales round differently");
    let mut x = vec![0f32; 32];
    x[0] = v;
    x[31] = amax;
    assert_eq!(
        quants(ActType::Q8_0, &x, 2, 1),
        [want],
        "amax {amax}, x {v}"
    );
}
