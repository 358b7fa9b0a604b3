//! Our `vec_dot` against llama.cpp's, row by row on one thread, on the same weights, with timed passes
//! interleaved so both see the same machine load.
//!
//! `GGML_CPU_LIB=/path/to/libggml-cpu.so cargo run --release -p poly-kernels --example vs_llama -- ROWS COLS
//! PASSES TYPE...`
//!
//! llama.cpp's kernels come from a built `libggml-cpu.so` (for example `cmake -DGGML_NATIVE=ON` of the
//! reference tree), loaded with `dlopen`; each type's `ggml_type_traits_cpu` supplies its `vec_dot` and the
//! quantizer of its activation format. Weights are written by our `fill_random`; the activations are the
//! same f32 vector, quantized by each side's own quantizer. Buffers start at 64-byte boundaries (timings of
//! the float formats depend on it). Prints GB/s of weights for the best and the 25th-percentile pass.

use poly_kernels::quant::GgmlType;
use poly_kernels::rng::Rng;
use std::ffi::{c_char, c_int, c_void, CString};
use std::time::Instant;

extern "C" {
    fn dlopen(file: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

/// `struct ggml_type_traits_cpu` of ggml-cpu.h.
#[repr(C)]
struct TypeTraitsCpu {
    from_float: extern "C" fn(*const f32, *mut c_void, i64),
    vec_dot:
        extern "C" fn(c_int, *mut f32, usize, *const c_void, usize, *const c_void, usize, c_int),
    vec_dot_type: c_int,
    nrows: i64,
}

/// A zeroed buffer of `len` bytes starting at a 64-byte boundary: the vector and the offset of the start.
fn aligned(len: usize) -> (Vec<u8>, usize) {
    let v = vec![0u8; len + 64];
    let off = (64 - v.as_ptr() as usize % 64) % 64;
    (v, off)
}

fn symbol(lib: *mut c_void, name: &str) -> *mut c_void {
    let c = CString::new(name).expect("symbol name");
    // SAFETY: `lib` is a handle from `dlopen` and `c` a NUL-terminated string.
    let p = unsafe { dlsym(lib, c.as_ptr()) };
    assert!(!p.is_null(), "{name} not found in the library");
    p
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 4 {
        eprintln!("usage: GGML_CPU_LIB=libggml-cpu.so vs_llama ROWS COLS PASSES TYPE...");
        std::process::exit(2);
    }
    let rows: usize = args[0].parse().expect("ROWS");
    let cols: usize = args[1].parse().expect("COLS");
    let passes: usize = args[2].parse().expect("PASSES");
    let path = std::env::var("GGML_CPU_LIB").expect("GGML_CPU_LIB: path of libggml-cpu.so");
    let path = CString::new(path).expect("library path");
    // SAFETY: a NUL-terminated path; RTLD_NOW (2).
    let lib = unsafe { dlopen(path.as_ptr(), 2) };
    assert!(!lib.is_null(), "dlopen failed");
    // SAFETY: the symbols have these C signatures in ggml-cpu.h.
    let (init, traits): (
        extern "C" fn(),
        extern "C" fn(c_int) -> *const TypeTraitsCpu,
    ) = unsafe {
        (
            std::mem::transmute::<*mut c_void, extern "C" fn()>(symbol(lib, "ggml_cpu_init")),
            std::mem::transmute::<*mut c_void, extern "C" fn(c_int) -> *const TypeTraitsCpu>(
                symbol(lib, "ggml_get_type_traits_cpu"),
            ),
        )
    };
    init();
    let mut xrng = Rng::new(2);
    let x: Vec<f32> = (0..cols).map(|_| xrng.normal()).collect();
    for name in &args[3..] {
        let ty = GgmlType::from_name(name).expect("type name");
        let ops = ty.ops().expect("computable type");
        // SAFETY: ggml returns a pointer to its static traits table, valid for the program's life.
        let (tr, act_tr) = unsafe {
            let tr = &*traits(ty.id() as c_int);
            (tr, &*traits(tr.vec_dot_type))
        };
        let row_bytes = ty.bytes_for(cols as u64).expect("whole blocks") as usize;
        let (mut wv, wo) = aligned(rows * row_bytes);
        let w = &mut wv[wo..wo + rows * row_bytes];
        (ops.fill_random)(&mut Rng::new(1), 0.02, w);
        let w = &*w;
        let ours_bytes = ops.act.bytes_for(cols);
        let (mut av, ao) = aligned(ours_bytes);
        ops.act.quantize(&x, &mut av[ao..ao + ours_bytes]);
        let act = &av[ao..ao + ours_bytes];
        // Room for llama.cpp's activation row in any format (at most 4 bytes per value).
        let (mut lv, lo) = aligned(4 * cols);
        let lact = &mut lv[lo..lo + 4 * cols];
        if tr.vec_dot_type == 0 {
            lact.copy_from_slice(&av[ao..ao + 4 * cols]);
        } else {
            (act_tr.from_float)(x.as_ptr(), lact.as_mut_ptr() as *mut c_void, cols as i64);
        }
        let mut out = vec![0f32; rows];
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        for _ in 0..passes {
            let t = Instant::now();
            for (o, r) in out.iter_mut().zip(w.chunks_exact(row_bytes)) {
                *o = (ops.vec_dot)(cols, std::hint::black_box(r), act);
            }
            ours.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            for (o, r) in out.iter_mut().zip(w.chunks_exact(row_bytes)) {
                let r = std::hint::black_box(r).as_ptr() as *const c_void;
                (tr.vec_dot)(
                    cols as c_int,
                    o,
                    0,
                    r,
                    0,
                    lact.as_ptr() as *const c_void,
                    0,
                    1,
                );
            }
            theirs.push(t.elapsed().as_secs_f64());
        }
        ours.sort_by(f64::total_cmp);
        theirs.sort_by(f64::total_cmp);
        let gb = w.len() as f64 / 1e9;
        let q = passes / 4;
        println!(
            "{name:5} ours {:6.2} (p25 {:6.2}) | llama.cpp {:6.2} (p25 {:6.2}) GB/s | ratio {:.2} (p25 {:.2})",
            gb / ours[0],
            gb / ours[q],
            gb / theirs[0],
            gb / theirs[q],
            theirs[0] / ours[0],
            theirs[q] / ours[q]
        );
    }
}
