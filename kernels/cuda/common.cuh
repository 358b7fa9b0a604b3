// Shared by every module of kernels/cuda/: NVRTC compiles one .cu file at a time with no standard headers, so
// the Rust side (kernels/src/cuda/module.rs) puts this text in front of each .cu file before compiling. It
// holds fixed-width integer names, f16/bf16 conversions through PTX (no cuda_fp16.h needed), the GGML block
// layouts the kernels read, and warp reductions.

typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu
// +infinity (NVRTC has no math.h for INFINITY).
#define POLY_INF __int_as_float(0x7f800000)

// The first statement of every kernel (kernels/src/cuda/launch.rs says why; a source test checks it): wait
// until the kernel before this one on the stream has completed and its writes are visible, then let the
// kernel after this one be scheduled, so its launch overlaps this kernel's work. Before sm_90, and for a
// launch made without the programmatic attribute, the wait returns at once (stream order already holds).
static __device__ __forceinline__ void launch_prologue() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// POLY_L2_PREFETCH (0 off, 1 own, 2 ahead) comes before this text (kernels/src/cuda/module.rs,
// `--gpu-prefetch`).
#ifndef POLY_L2_PREFETCH
#define POLY_L2_PREFETCH 0
#endif

// Asks the L2 cache to fetch [p, p + bytes) (its 16-byte aligned interior) in the background: sm_90's bulk
// prefetch, issued by the calling thread alone; nothing on older cards or with the knob off. A hint only:
// every access to the card's memory, kernels' and copies' alike, meets in the L2, so a prefetch never
// changes a value read later, and it may name memory that kernels before this one are still writing.
static __device__ __forceinline__ void prefetch_l2(const void * p, int64_t bytes) {
#if POLY_L2_PREFETCH && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const uint64_t a = (uint64_t) p;
    const uint64_t end = (a + (uint64_t) bytes) & ~15ull;
    // Pieces of at most 1 MiB: the instruction takes a 32-bit size.
    for (uint64_t s = (a + 15) & ~15ull; s < end; s += 1u << 20) {
        const uint32_t n = (uint32_t) (end - s < (1u << 20) ? end - s : (1u << 20));
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(s), "r"(n) : "memory");
    }
#endif
}

// The most bytes of one matrix a launch prefetches before its wait: the dense weights of a layer fit many
// times in a large card's L2 (50 MB on the H100), an output head of 100+ MB would only evict what the
// kernels after it read.
#define PREFETCH_MAX_BYTES (16ll << 20)
// How many of a launch's first blocks share that prefetch (the first blocks start first; a small grid's
// blocks are all its own).
#define PREFETCH_BLOCKS 16

// This block's share of the prefetch of [p, p + min(bytes, PREFETCH_MAX_BYTES)): the launch's first
// PREFETCH_BLOCKS blocks (of blockIdx.x, in row y = z = 0) take one piece each, thread (0, 0, 0) asks.
static __device__ __forceinline__ void prefetch_l2_share(const void * p, int64_t bytes) {
    const int parts = (int) gridDim.x < PREFETCH_BLOCKS ? (int) gridDim.x : PREFETCH_BLOCKS;
    if (threadIdx.x != 0 || threadIdx.y != 0 || threadIdx.z != 0 || blockIdx.y != 0 || blockIdx.z != 0 ||
        (int) blockIdx.x >= parts) {
        return;
    }
    const int64_t total = bytes < PREFETCH_MAX_BYTES ? bytes : PREFETCH_MAX_BYTES;
    const int64_t piece = (total / parts + 127) & ~127ll;
    const int64_t from = piece * blockIdx.x;
    if (from < total) {
        prefetch_l2((const uint8_t *) p + from, piece < total - from ? piece : total - from);
    }
}

// The first statement of a kernel whose weights are its arguments (never written by a kernel): their
// share of the prefetch (prefetch_l2_share: what no kernel before it changes may be asked for before the
// wait), then launch_prologue.
static __device__ __forceinline__ void launch_prologue_prefetch(const void * p, int64_t bytes) {
    prefetch_l2_share(p, bytes);
    launch_prologue();
}

// f16 bits -> f32 (exact).
static __device__ __forceinline__ float f16_to_f32(uint16_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// f32 -> f16 bits, rounded to nearest even (as ggml's __float2half).
static __device__ __forceinline__ uint16_t f32_to_f16(float f) {
    uint16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// bf16 bits -> f32 (exact).
static __device__ __forceinline__ float bf16_to_f32(uint16_t b) {
    return __uint_as_float(((uint32_t) b) << 16);
}

static __device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(FULL_MASK, v, offset);
    }
    return v;
}

static __device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
    }
    return v;
}

// Sum over a whole thread block of at most 1024 threads (one-dimensional); every thread gets the result.
// `scratch` holds 32 floats of shared memory; the call synchronizes the block twice.
static __device__ __forceinline__ float block_sum(float v, float * scratch) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int n_warps = (blockDim.x + WARP_SIZE - 1) / WARP_SIZE;
    v = warp_sum(v);
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}

static __device__ __forceinline__ float block_max(float v, float * scratch) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int n_warps = (blockDim.x + WARP_SIZE - 1) / WARP_SIZE;
    v = warp_max(v);
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : -POLY_INF;
    v = warp_max(v);
    __syncthreads();
    return v;
}

// ---------------------------------------------------------------------------------------------------------
// GGML block layouts (byte for byte what GGUF stores; sizes checked by the static_asserts below).

#define QK_K 256
#define QK8_1 32

// Activations for the integer dot products: 32 values, d = max|x|/127, s = d * (sum of the 32 quants)
// (f16 both, as ggml-cuda's block_q8_1), 32 quants.
struct block_q8_1 {
    uint16_t d;
    uint16_t s;
    int8_t qs[32];
};

struct block_q8_0 {
    uint16_t d;
    int8_t qs[32];
};

struct block_q4_0 {
    uint16_t d;
    uint8_t qs[16];
};

struct block_q4_1 {
    uint16_t d;
    uint16_t m;
    uint8_t qs[16];
};

struct block_q5_0 {
    uint16_t d;
    uint8_t qh[4];
    uint8_t qs[16];
};

struct block_q5_1 {
    uint16_t d;
    uint16_t m;
    uint8_t qh[4];
    uint8_t qs[16];
};

struct block_iq4_nl {
    uint16_t d;
    uint8_t qs[16];
};

struct block_q2_K {
    uint8_t scales[16];
    uint8_t qs[64];
    uint16_t d;
    uint16_t dmin;
};

struct block_q3_K {
    uint8_t hmask[32];
    uint8_t qs[64];
    uint8_t scales[12];
    uint16_t d;
};

struct block_q4_K {
    uint16_t d;
    uint16_t dmin;
    uint8_t scales[12];
    uint8_t qs[128];
};

struct block_q5_K {
    uint16_t d;
    uint16_t dmin;
    uint8_t scales[12];
    uint8_t qh[32];
    uint8_t qs[128];
};

struct block_q6_K {
    uint8_t ql[128];
    uint8_t qh[64];
    int8_t scales[16];
    uint16_t d;
};

struct block_iq4_xs {
    uint16_t d;
    uint16_t scales_h;
    uint8_t scales_l[4];
    uint8_t qs[128];
};

// The i-quants (lattice formats; the grids are in iq_grids.cuh, in front of matvec_iq.cu and mmq_iq.cu only).
struct block_iq2_xxs {
    uint16_t d;
    uint16_t qs[QK_K / 8]; // per 32 values: 4 grid indexes (bytes), then 4 x 7 sign bits and a 4-bit scale
};

struct block_iq2_xs {
    uint16_t d;
    uint16_t qs[QK_K / 8]; // per 8 values: 9-bit grid index | 7 sign bits << 9
    uint8_t scales[QK_K / 32];
};

struct block_iq2_s {
    uint16_t d;
    uint8_t qs[QK_K / 4]; // 32 bytes of grid indexes (low 8 bits), then 32 sign bytes
    uint8_t qh[QK_K / 32];
    uint8_t scales[QK_K / 32];
};

struct block_iq3_xxs {
    uint16_t d;
    uint8_t qs[3 * QK_K / 8]; // 64 bytes of grid indexes, then per 32 values 4 x 7 sign bits and a scale
};

struct block_iq3_s {
    uint16_t d;
    uint8_t qs[QK_K / 4];
    uint8_t qh[QK_K / 32];
    uint8_t signs[QK_K / 8];
    uint8_t scales[QK_K / 64];
};

struct block_iq1_s {
    uint16_t d;
    uint8_t qs[QK_K / 8];
    uint16_t qh[QK_K / 32];
};

struct block_iq1_m {
    uint8_t qs[QK_K / 8];
    uint8_t qh[QK_K / 16];
    uint8_t scales[QK_K / 32]; // 3-bit scales; the top nibbles of the 4 words hold the block's f16 scale
};

static_assert(sizeof(block_q8_1) == 36, "block_q8_1 size");
static_assert(sizeof(block_q8_0) == 34, "block_q8_0 size");
static_assert(sizeof(block_q4_0) == 18, "block_q4_0 size");
static_assert(sizeof(block_q4_1) == 20, "block_q4_1 size");
static_assert(sizeof(block_q5_0) == 22, "block_q5_0 size");
static_assert(sizeof(block_q5_1) == 24, "block_q5_1 size");
static_assert(sizeof(block_iq4_nl) == 18, "block_iq4_nl size");
static_assert(sizeof(block_q2_K) == 84, "block_q2_K size");
static_assert(sizeof(block_q3_K) == 110, "block_q3_K size");
static_assert(sizeof(block_q4_K) == 144, "block_q4_K size");
static_assert(sizeof(block_q5_K) == 176, "block_q5_K size");
static_assert(sizeof(block_q6_K) == 210, "block_q6_K size");
static_assert(sizeof(block_iq4_xs) == 136, "block_iq4_xs size");
static_assert(sizeof(block_iq2_xxs) == 66, "block_iq2_xxs size");
static_assert(sizeof(block_iq2_xs) == 74, "block_iq2_xs size");
static_assert(sizeof(block_iq2_s) == 82, "block_iq2_s size");
static_assert(sizeof(block_iq3_xxs) == 98, "block_iq3_xxs size");
static_assert(sizeof(block_iq3_s) == 110, "block_iq3_s size");
static_assert(sizeof(block_iq1_s) == 50, "block_iq1_s size");
static_assert(sizeof(block_iq1_m) == 56, "block_iq1_m size");

// Four consecutive bytes as an int, from data aligned to 2 bytes (Q8_0 and Q6_K blocks are not 4-aligned).
static __device__ __forceinline__ int get_int_b2(const void * x, int i32) {
    const uint16_t * x16 = (const uint16_t *) x;
    return (int) ((uint32_t) x16[2 * i32] | ((uint32_t) x16[2 * i32 + 1] << 16));
}

// Four consecutive bytes as an int, from data aligned to 4 bytes.
static __device__ __forceinline__ int get_int_b4(const void * x, int i32) {
    return ((const int *) x)[i32];
}

// ----- shared by several modules ----------------------------------------------------------------------

// Activation quantization f32 -> block_q8_1 (quantize.cu's kernels, and the matvec kernels that quantize
// their own output for the next matrix).
// Quantizes value xi (element i of a vector of n, n a multiple of 32) into y; every lane of the warp takes
// part (whole warps are inside or outside together).
static __device__ __forceinline__ void quantize_value(float xi, block_q8_1 * __restrict__ y, int64_t i) {
    const int64_t ib = i / QK8_1;
    const int iq = (int) (i % QK8_1);
    const float amax = warp_max(fabsf(xi));
    const float d = amax / 127.0f;
    const int8_t q = amax == 0.0f ? 0 : (int8_t) roundf(xi / d);
    // s = d * (sum of the quants), as ggml's CPU q8_1 (ggml-cuda stores the sum of the unquantized values
    // instead): the formats with an offset or minimum (Q4_0, Q4_1, Q5_0, Q5_1) then multiply their offset
    // by the same quantized activations as their quants, and their error against the exact product is the
    // CPU's (about 6x lower for Q4_1 than with the exact sum; kernels/tests/cuda_layer_ops.rs measures it).
    const float sumq = warp_sum((float) q); // exact: integers below 2^24
    y[ib].qs[iq] = q;
    if (iq == 0) {
        y[ib].d = f32_to_f16(d);
        y[ib].s = f32_to_f16(d * sumq);
    }
}

// The last block of a launch to finish a piece of work that `n` blocks share, counted on `ticket` (a
// counter in device memory that is 0 before the launch): call it in every thread of each of the n blocks
// after the block wrote its part; it returns true in every thread of the block that arrived last, which
// then reads the others' parts (with __ldcg: they were written by other SMs, past this SM's L1) and combines
// them. The last block puts the ticket back to 0 (every block has counted by then), so the next launch, or
// a graph's next replay, finds it as this one did. The fence makes each block's writes visible on the
// device before its count (CUDA's threadFenceReduction pattern).
static __device__ __forceinline__ bool last_block_of(unsigned int * ticket, unsigned int n) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0) {
        last = atomicAdd(ticket, 1u) == n - 1;
        if (last) {
            *ticket = 0;
        }
    }
    __syncthreads();
    return last;
}
