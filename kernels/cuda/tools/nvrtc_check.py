#!/usr/bin/env python3
"""Compiles kernel modules with NVRTC as kernels/src/cuda/module.rs does (common.cuh, the module's headers,
then the file, each after a #line; options --gpu-architecture=<arch> --std=c++17), without a GPU or Rust.
Prints NVRTC's log, the cubin size and the time per (module, arch); exits 1 on an error.

Needs libnvrtc (`pip install nvidia-cuda-nvrtc-cu12`, or $NVRTC naming the library). From the repository root:

    python3 kernels/cuda/tools/nvrtc_check.py [module ...] [--arch sm_80,sm_90]

With PTXAS_V=1 the log also holds ptxas' registers, spills and shared memory per kernel.

(default: matvec_q and matvec_iq for sm_80 and sm_90).
"""

import ctypes
import glob
import os
import sys
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
CUDA = os.path.join(ROOT, "kernels", "cuda")
# The headers module.rs puts after common.cuh (KernelModule::headers).
HEADERS = {
    "matvec_q": ["matvec.cuh"],
    "matvec_iq": ["iq_grids.cuh", "matvec.cuh"],
    "matvec_f": ["float_dot.cuh"],
    "route": ["float_dot.cuh"],
    "matmul_mma": ["mmq.cuh"],
    "mmq_iq": ["iq_grids.cuh", "mmq.cuh"],
}


def find_nvrtc():
    if os.environ.get("NVRTC"):
        return os.environ["NVRTC"]
    for base in sys.path:
        hits = sorted(glob.glob(os.path.join(base, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")))
        if hits:
            return hits[0]
    return "libnvrtc.so"


def source(module):
    # The knobs' macros as module.rs puts them first, with every prefetch compiled in (--gpu-prefetch ahead).
    src = '#define POLY_L2_PREFETCH 2\n#line 1 "common.cuh"\n' + open(os.path.join(CUDA, "common.cuh")).read()
    for h in HEADERS.get(module, []):
        src += f'\n#line 1 "{h}"\n' + open(os.path.join(CUDA, h)).read()
    src += f'\n#line 1 "{module}.cu"\n' + open(os.path.join(CUDA, module + ".cu")).read()
    return src


def compile_one(lib, module, arch):
    prog = ctypes.c_void_p()
    src = source(module).encode()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src, f"{module}.cu".encode(), 0, None, None)
    if rc != 0:
        raise RuntimeError(f"nvrtcCreateProgram: {rc}")
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"] + ([b"--ptxas-options=-v"] if os.environ.get("PTXAS_V") else [])
    arr = (ctypes.c_char_p * len(opts))(*opts)
    t = time.time()
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    secs = time.time() - t
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    cubin = ctypes.c_size_t(0)
    if rc == 0:
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(cubin))
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace"), cubin.value, secs


def main():
    args = sys.argv[1:]
    archs = ["sm_80", "sm_90"]
    if "--arch" in args:
        i = args.index("--arch")
        archs = args[i + 1].split(",")
        del args[i : i + 2]
    modules = args or ["matvec_q", "matvec_iq"]
    lib = ctypes.CDLL(find_nvrtc())
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    print(f"NVRTC {major.value}.{minor.value}")
    failed = False
    for m in modules:
        for arch in archs:
            rc, log, size, secs = compile_one(lib, m, arch)
            print(f"{m} {arch}: rc={rc} cubin={size} bytes, {secs:.1f} s")
            if log.strip():
                print(log)
            failed |= rc != 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
