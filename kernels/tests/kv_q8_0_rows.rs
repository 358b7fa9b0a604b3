//! Q8_0 KV rows (`--kv q8_0`) are llama.cpp's bit for bit: `quantize_q8_0_rows` against what ggml's CPU
//! backend stores in a `-ctk q8_0 -ctv q8_0` cache (`quantize_row_q8_0`, through `ggml_set_rows`), and
//! where it stands against the portable reference (`quantize_row_q8_0_ref`, which the `gguf` Python
//! package reproduces): the same scales, quants one step apart on ties and near-ties only.
//!
//! The fixture is written by `tests/witness/kv_q8_0_rows.py` from a llama.cpp CPU build of the pinned
//! sdist (its header says the layout).

use poly_kernels::ops::attention::quantize_q8_0_rows;

fn fixture() -> (Vec<f32>, Vec<u8>, Vec<u8>) {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/kv/q8_0_rows.bin");
    let b = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let n = u32::from_le_bytes(b[0..4].try_into().unwrap()) as usize;
    let x: Vec<f32> = b[4..4 + 4 * n]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let q = n / 32 * 34;
    let at = 4 + 4 * n;
    assert_eq!(b.len(), at + 2 * q, "fixture length");
    (x, b[at..at + q].to_vec(), b[at + q..].to_vec())
}

#[test]
fn kv_rows_are_ggml_cpu_blocks_bit_for_bit() {
    let (x, cpu, _) = fixture();
    let mut ours = Vec::new();
    quantize_q8_0_rows(&x, &mut ours);
    assert_eq!(ours.len(), cpu.len());
    let first = ours.iter().zip(&cpu).position(|(a, b)| a != b);
    assert_eq!(
        first,
        None,
        "first differing byte (block {:?})",
        first.map(|i| i / 34)
    );
    // Row by row (as a cache appends them) gives the same bytes.
    let mut rows = Vec::new();
    for r in x.chunks(256) {
        quantize_q8_0_rows(r, &mut rows);
    }
    assert_eq!(rows, ours);
}

#[test]
fn against_the_reference_only_ties_round_the_other_way() {
    let (x, cpu, reference) = fixture();
    let (mut quants, mut ties) = (0, 0);
    for (b, (c, r)) in cpu
        .chunks_exact(34)
        .zip(reference.chunks_exact(34))
        .enumerate()
    {
        assert_eq!(c[..2], r[..2], "block {b}: the same f16 scale");
        let xb = &x[b * 32..(b + 1) * 32];
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        for j in 0..32 {
            let (qc, qr) = (c[2 + j] as i8 as i32, r[2 + j] as i8 as i32);
            if qc == qr {
                continue;
            }
            quants += 1;
            assert_eq!((qc - qr).abs(), 1, "block {b} value {j}: one step apart");
            // On the rounding boundary up to the two scales' difference (127/amax against 1/d).
            let t = xb[j] as f64 * 127.0 / amax as f64;
            let frac = t.abs().fract();
            assert!(
                (frac - 0.5).abs() < 1e-5,
                "block {b} value {j}: {t} is no tie"
            );
            if frac == 0.5 {
                ties += 1;
            }
        }
    }
    eprintln!(
        "{quants} of {} quants differ from the reference, {ties} exact ties",
        x.len()
    );
    assert!(quants > 0 && ties > 0, "the fixture has ties");
}
