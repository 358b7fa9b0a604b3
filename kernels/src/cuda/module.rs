//! The kernel modules: one per `.cu` file under `kernels/cuda/`, compiled by NVRTC the first time a kernel
//! of the module is launched on a device, for that device's exact architecture (`sm_XY`, a cubin: loading it
//! costs nothing, and no PTX is left for the driver to JIT), and kept in an on-disk cache so a machine
//! compiles each module once.
//!
//! The cache key is the module's full source (`common.cuh` + the `.cu` file), the architecture, the NVRTC
//! version and the compile options; the file name carries them all (the source as a 64-bit FNV-1a hash), so
//! a changed kernel, another GPU or another NVRTC never loads a stale cubin. The cache lives in
//! `$POLY_KERNEL_CACHE` if set (`off` disables it), else `$XDG_CACHE_HOME/polystrata/kernels`, else
//! `~/.cache/polystrata/kernels`. A cache that cannot be written only costs a recompilation next time; a
//! cached file the driver rejects is compiled again and overwritten.

use super::{CudaError, CudaResult};
use std::ffi::CString;
use std::path::PathBuf;
use std::time::Instant;

/// The text in front of every module (types, conversions, block layouts, reductions).
const COMMON: &str = include_str!("../../cuda/common.cuh");

/// Bumped when the way modules are compiled changes in a way the key does not see.
const CACHE_FORMAT: u32 = 1;

/// One kernel module (one `.cu` file).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelModule {
    /// `quantize.cu`: f32 activations to block_q8_1.
    Quantize,
    /// `matvec_q.cu`: quantized matrix×vector, single matrix and batched experts.
    MatvecQ,
    /// `matvec_f.cu`: F32/F16/BF16 matrix×vector, single matrix and batched experts.
    MatvecF,
    /// `norm.cu`: RMS norm.
    Norm,
    /// `rope.cu`: rotary position embedding.
    Rope,
    /// `act.cu`: SiLU, SwiGLU.
    Act,
    /// `route.cu`: softmax/sigmoid + top-k routing, weighted sum of expert outputs, the gather and combine
    /// of a prompt's tokens grouped by expert.
    Route,
    /// `attention.cu`: attention over an f16 KV cache (decode and prompt batches, split over the context).
    Attention,
    /// `recurrent.cu`: causal conv1d with state, L2 norm, gated delta rule, gated RMS norm.
    Recurrent,
    /// `sample.cu`: argmax and top-k/top-p/temperature sampling on the card.
    Sample,
    /// `elementwise.cu`: add/mul/scale/unary, column slices, head parts, repeated heads, KV stores.
    Elementwise,
    /// `matmul_mma.cu`: quantized matrix×matrix for prompts on the int8 tensor cores (plain and grouped
    /// by expert).
    MatmulMma,
    /// `attention_mma.cu`: prompt attention over the f16 KV cache on the f16 tensor cores.
    AttentionMma,
}

impl KernelModule {
    /// Every module, in [`KernelModule::index`] order.
    pub const ALL: [KernelModule; 13] = [
        KernelModule::Quantize,
        KernelModule::MatvecQ,
        KernelModule::MatvecF,
        KernelModule::Norm,
        KernelModule::Rope,
        KernelModule::Act,
        KernelModule::Route,
        KernelModule::Attention,
        KernelModule::Recurrent,
        KernelModule::Sample,
        KernelModule::Elementwise,
        KernelModule::MatmulMma,
        KernelModule::AttentionMma,
    ];

    /// The file name without `.cu`.
    pub fn name(self) -> &'static str {
        match self {
            KernelModule::Quantize => "quantize",
            KernelModule::MatvecQ => "matvec_q",
            KernelModule::MatvecF => "matvec_f",
            KernelModule::Norm => "norm",
            KernelModule::Rope => "rope",
            KernelModule::Act => "act",
            KernelModule::Route => "route",
            KernelModule::Attention => "attention",
            KernelModule::Recurrent => "recurrent",
            KernelModule::Sample => "sample",
            KernelModule::Elementwise => "elementwise",
            KernelModule::MatmulMma => "matmul_mma",
            KernelModule::AttentionMma => "attention_mma",
        }
    }

    /// Position in [`KernelModule::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    fn file_source(self) -> &'static str {
        match self {
            KernelModule::Quantize => include_str!("../../cuda/quantize.cu"),
            KernelModule::MatvecQ => include_str!("../../cuda/matvec_q.cu"),
            KernelModule::MatvecF => include_str!("../../cuda/matvec_f.cu"),
            KernelModule::Norm => include_str!("../../cuda/norm.cu"),
            KernelModule::Rope => include_str!("../../cuda/rope.cu"),
            KernelModule::Act => include_str!("../../cuda/act.cu"),
            KernelModule::Route => include_str!("../../cuda/route.cu"),
            KernelModule::Attention => include_str!("../../cuda/attention.cu"),
            KernelModule::Recurrent => include_str!("../../cuda/recurrent.cu"),
            KernelModule::Sample => include_str!("../../cuda/sample.cu"),
            KernelModule::Elementwise => include_str!("../../cuda/elementwise.cu"),
            KernelModule::MatmulMma => include_str!("../../cuda/matmul_mma.cu"),
            KernelModule::AttentionMma => include_str!("../../cuda/attention_mma.cu"),
        }
    }

    /// What NVRTC compiles: `common.cuh`, then the file (a `#line` keeps the file's own line numbers in
    /// NVRTC's messages).
    pub fn source(self) -> String {
        format!(
            "{COMMON}\n#line 1 \"{}.cu\"\n{}",
            self.name(),
            self.file_source()
        )
    }
}

/// Where a loaded module's cubin came from.
#[derive(Clone, Debug, PartialEq)]
pub enum ModuleOrigin {
    /// Read from the on-disk cache.
    Cached,
    /// Compiled by NVRTC now, taking this many seconds; `cached` says whether the cubin was written to the
    /// cache.
    Compiled { seconds: f64, cached: bool },
}

/// A record of one module load (for diagnostics and the run logs on the GPU machine).
#[derive(Clone, Debug)]
pub struct ModuleLoad {
    pub module: KernelModule,
    pub arch: String,
    pub origin: ModuleOrigin,
    pub path: Option<PathBuf>,
}

/// The NVRTC options every module is compiled with (part of the cache key). Precise division and square
/// root, no fast math: the kernels are checked against the CPU's arithmetic.
fn compile_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
    ]
}

/// 64-bit FNV-1a: a stable hash (unlike std's `DefaultHasher`, whose algorithm may change between Rust
/// releases), good enough to tell sources apart in a cache key.
fn fnv1a64(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // Separate the parts so ("ab", "c") and ("a", "bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The cache directory, or `None` when caching is off or no home is known.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("POLY_KERNEL_CACHE") {
        if dir == "off" {
            return None;
        }
        return Some(PathBuf::from(dir));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("polystrata").join("kernels"))
}

/// NVRTC's version `(major, minor)`.
pub fn nvrtc_version() -> CudaResult<(i32, i32)> {
    nvrtc_present()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both pointers are valid for writes of one int; the library is present (checked above).
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| nvrtc_err("version", format!("{e:?}")))?;
    Ok((major, minor))
}

fn nvrtc_present() -> CudaResult<()> {
    // SAFETY: only tries to open the library by its usual names.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::Compile {
            module: "(any)",
            log: "libnvrtc was not found (install the CUDA runtime's NVRTC, e.g. the cuda-nvrtc package, \
                  or put it on LD_LIBRARY_PATH)"
                .to_string(),
        })
    }
}

fn nvrtc_err(what: &str, detail: String) -> CudaError {
    CudaError::Compile {
        module: "(any)",
        log: format!("NVRTC {what}: {detail}"),
    }
}

/// The cache file of `module` for `arch` under `dir`.
fn cache_path(
    dir: &std::path::Path,
    module: KernelModule,
    arch: &str,
    nvrtc: (i32, i32),
) -> PathBuf {
    let source = module.source();
    let options = compile_options(arch).join(" ");
    let key = fnv1a64(&[
        source.as_bytes(),
        arch.as_bytes(),
        options.as_bytes(),
        &CACHE_FORMAT.to_le_bytes(),
    ]);
    dir.join(format!(
        "{}-{arch}-nvrtc{}.{}-{key:016x}.cubin",
        module.name(),
        nvrtc.0,
        nvrtc.1
    ))
}

/// A cubin of `module` for `arch` (`"sm_90"`), from the cache or compiled now. `fresh` skips the cache read
/// (used when the driver rejected a cached file).
pub(crate) fn cubin(
    module: KernelModule,
    arch: &str,
    fresh: bool,
) -> CudaResult<(Vec<u8>, ModuleLoad)> {
    let nvrtc = nvrtc_version()?;
    let path = cache_dir().map(|d| cache_path(&d, module, arch, nvrtc));
    if !fresh {
        if let Some(p) = &path {
            if let Ok(bytes) = std::fs::read(p) {
                if !bytes.is_empty() {
                    let load = ModuleLoad {
                        module,
                        arch: arch.to_string(),
                        origin: ModuleOrigin::Cached,
                        path: path.clone(),
                    };
                    return Ok((bytes, load));
                }
            }
        }
    }
    let start = Instant::now();
    let bytes = compile(module, arch)?;
    let seconds = start.elapsed().as_secs_f64();
    let cached = path.as_ref().is_some_and(|p| write_atomically(p, &bytes));
    let load = ModuleLoad {
        module,
        arch: arch.to_string(),
        origin: ModuleOrigin::Compiled { seconds, cached },
        path,
    };
    Ok((bytes, load))
}

/// Writes `bytes` to `path` through a temporary file and a rename, so a concurrent reader never sees half
/// a cubin. Returns whether it worked.
fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> bool {
    let Some(dir) = path.parent() else {
        return false;
    };
    if std::fs::create_dir_all(dir).is_err() {
        return false;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_err() {
        let _ = std::fs::remove_file(&tmp);
        return false;
    }
    std::fs::rename(&tmp, path).is_ok()
}

/// An NVRTC program, destroyed when dropped.
struct Program(cudarc::nvrtc::sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by `create_program` and is destroyed only here. A failure to
        // destroy leaks a little host memory and is not worth a panic.
        let _ = unsafe { cudarc::nvrtc::result::destroy_program(self.0) };
    }
}

/// Compiles `module` to a cubin for `arch` with NVRTC.
fn compile(module: KernelModule, arch: &str) -> CudaResult<Vec<u8>> {
    use cudarc::nvrtc::{result, sys};
    let compile_err = |log: String| CudaError::Compile {
        module: module.name(),
        log,
    };
    let src =
        CString::new(module.source()).map_err(|_| compile_err("source holds a NUL".into()))?;
    let name = CString::new(format!("{}.cu", module.name()))
        .map_err(|_| compile_err("name holds a NUL".into()))?;
    let prog = Program(
        result::create_program(&src, Some(&name)).map_err(|e| compile_err(format!("{e:?}")))?,
    );
    let options = compile_options(arch);
    // SAFETY: `prog` is a live program (dropped at the end of this function, after every use).
    let compiled = unsafe { result::compile_program(prog.0, &options) };
    if let Err(e) = compiled {
        // SAFETY: as above.
        let log = unsafe { result::get_program_log(prog.0) }
            .map(|raw| {
                let bytes: Vec<u8> = raw
                    .iter()
                    .take_while(|&&c| c != 0)
                    .map(|&c| c as u8)
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_default();
        return Err(compile_err(format!("{e:?} with {options:?}\n{log}")));
    }
    let mut size = 0usize;
    // SAFETY: `prog` compiled successfully; `size` is valid for one write.
    unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }
        .result()
        .map_err(|e| compile_err(format!("cubin size: {e:?}")))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` holds exactly the `size` bytes NVRTC reported for this program.
    unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr() as *mut std::ffi::c_char) }
        .result()
        .map_err(|e| compile_err(format!("cubin: {e:?}")))?;
    if cubin.is_empty() {
        return Err(compile_err(format!(
            "NVRTC produced no cubin for {arch} (it may be too old for this GPU)"
        )));
    }
    Ok(cubin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_paths_change_with_source_arch_and_nvrtc() {
        let dir = std::path::Path::new("/tmp/x");
        let a = cache_path(dir, KernelModule::Norm, "sm_90", (13, 0));
        assert_ne!(a, cache_path(dir, KernelModule::Norm, "sm_89", (13, 0)));
        assert_ne!(a, cache_path(dir, KernelModule::Norm, "sm_90", (12, 8)));
        assert_ne!(a, cache_path(dir, KernelModule::Rope, "sm_90", (13, 0)));
        assert_eq!(a, cache_path(dir, KernelModule::Norm, "sm_90", (13, 0)));
        assert!(a
            .to_string_lossy()
            .starts_with("/tmp/x/norm-sm_90-nvrtc13.0-"));
    }

    /// Compiles every module for Ampere, Hopper and consumer Blackwell where NVRTC is installed (it
    /// needs no GPU); elsewhere says so and passes. About 0.6 s per module and target.
    #[test]
    fn every_module_compiles_where_nvrtc_is_present() {
        if nvrtc_version().is_err() {
            println!("skipped: no NVRTC library");
            return;
        }
        for arch in ["sm_80", "sm_90", "sm_120"] {
            for m in KernelModule::ALL {
                match compile(m, arch) {
                    Ok(cubin) => assert!(cubin.len() > 100, "{} {arch}", m.name()),
                    Err(e) => panic!("{e}"),
                }
            }
        }
    }

    #[test]
    fn fnv_separates_parts() {
        assert_ne!(fnv1a64(&[b"ab", b"c"]), fnv1a64(&[b"a", b"bc"]));
    }

    #[test]
    fn every_module_starts_with_the_common_text() {
        for m in KernelModule::ALL {
            assert!(m.source().starts_with(COMMON));
            assert_eq!(KernelModule::ALL[m.index()], m);
        }
    }
}
