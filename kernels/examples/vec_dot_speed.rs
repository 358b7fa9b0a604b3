//! Single-threaded speed of one matrix×vector product done row by row with `vec_dot` (and the portable
//! fallback), and of `fill_random`, for the family-A formats.
//!
//! `cargo run --release -p poly-kernels --example vec_dot_speed [rows] [cols] [types…]`
//!
//! With `DUMP=dir` set, the weights (`dir/TYPE.w`) and the f32 activations (`dir/x.f32`) are written too,
//! so another implementation (llama.cpp) can be timed on the same data; the checksum (sum of the row
//! results) lets the two be compared.

use poly_kernels::quant::GgmlType;
use poly_kernels::rng::Rng;
use std::hint::black_box;
use std::time::Instant;

/// A zeroed buffer of `len` bytes starting at a 64-byte boundary (as mapped model files and the engine's
/// activation buffers are), so timings do not depend on where the allocator put it.
fn aligned(len: usize) -> (Vec<u8>, usize) {
    let v = vec![0u8; len + 64];
    let off = (64 - v.as_ptr() as usize % 64) % 64;
    (v, off)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rows: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(4096);
    let cols: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(4096);
    let names: Vec<&str> = if args.len() > 2 {
        args[2..].iter().map(|s| s.as_str()).collect()
    } else {
        vec![
            "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
            "Q5_K", "Q6_K",
        ]
    };
    println!("{rows}×{cols}, one thread; GB/s of weight bytes (best of several passes)");
    println!(
        "{:6} {:>9} {:>10} {:>10} {:>9} {:>10} {:>12}",
        "type", "MB", "vec_dot", "portable", "ns/row", "fill MB/s", "checksum"
    );
    let mut rng = Rng::new(1);
    let mut xrng = Rng::new(2);
    let x: Vec<f32> = (0..cols).map(|_| xrng.normal()).collect();
    for name in names {
        let ty = GgmlType::from_name(name).expect("type name");
        let ops = ty.ops().expect("computable type");
        let row_bytes = ty.bytes_for(cols as u64).expect("whole blocks") as usize;
        let (mut w_buf, w_off) = aligned(rows * row_bytes);
        let w = &mut w_buf[w_off..w_off + rows * row_bytes];
        // Best of several fills; the first also pays for the pages' first touch.
        let mut fill_time = f64::MAX;
        for _ in 0..6 {
            let t = Instant::now();
            (ops.fill_random)(&mut rng, 0.02, w);
            fill_time = fill_time.min(t.elapsed().as_secs_f64());
        }
        let fill = w.len() as f64 / fill_time / 1e6;
        let (mut act_buf, act_off) = aligned(ops.act.bytes_for(cols));
        let act = &mut act_buf[act_off..act_off + ops.act.bytes_for(cols)];
        ops.act.quantize(&x, act);
        let act = &*act;
        let w = &*w;
        if let Some(dir) = std::env::var_os("DUMP") {
            let dir = std::path::PathBuf::from(dir);
            std::fs::write(dir.join(format!("{name}.w")), w).expect("write weights");
            let xb: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
            std::fs::write(dir.join("x.f32"), xb).expect("write activations");
        }
        let mut out = vec![0f32; rows];
        let mut time = |f: fn(usize, &[u8], &[u8]) -> f32, passes: usize| {
            let mut best = f64::MAX;
            for _ in 0..passes {
                let t = Instant::now();
                for (o, r) in out.iter_mut().zip(w.chunks_exact(row_bytes)) {
                    *o = f(cols, black_box(r), act);
                }
                black_box(&out);
                best = best.min(t.elapsed().as_secs_f64());
            }
            best
        };
        let fast = time(ops.vec_dot, 20);
        let portable = time(ops.vec_dot_portable, 2);
        // Both paths give bit-identical results, so this is either's.
        let checksum: f64 = out.iter().map(|&v| v as f64).sum();
        let gb = w.len() as f64 / 1e9;
        println!(
            "{:6} {:9.1} {:10.2} {:10.2} {:9.0} {:10.0} {:12.6}",
            name,
            w.len() as f64 / 1e6,
            gb / fast,
            gb / portable,
            fast / rows as f64 * 1e9,
            fill,
            checksum
        );
    }
}
