// Float matrix x vector for one token: y[r] = W[r,:] . x with W in F32, F16 or BF16 and x in f32 (products
// and sums in f32). One thread block of (32, MATVEC_F_WARPS) threads per row; threads stride over the columns
// two at a time (rows of an even number of columns start 4-byte aligned for the 16-bit formats, which is
// what the Rust side checks). Entry points mirror matvec_q.cu: one matrix, or several experts of one stacked
// tensor through a table of device addresses and ids read from device memory (a null address or an id
// outside 0..n_expert: the slot's output is 0).

#define MATVEC_F_WARPS 4

struct load_f32 {
    typedef float elem;
    static __device__ __forceinline__ float2 pair(const elem * w, int i) {
        return make_float2(w[i], w[i + 1]);
    }
};

struct load_f16 {
    typedef uint16_t elem;
    static __device__ __forceinline__ float2 pair(const elem * w, int i) {
        const uint32_t both = *(const uint32_t *) (w + i);
        return make_float2(f16_to_f32((uint16_t) (both & 0xffff)), f16_to_f32((uint16_t) (both >> 16)));
    }
};

struct load_bf16 {
    typedef uint16_t elem;
    static __device__ __forceinline__ float2 pair(const elem * w, int i) {
        const uint32_t both = *(const uint32_t *) (w + i);
        return make_float2(__uint_as_float(both << 16), __uint_as_float(both & 0xffff0000u));
    }
};

template <typename L>
static __device__ __forceinline__ float row_dot_f(const typename L::elem * __restrict__ w, const float * __restrict__ x,
                                                  int ncols) {
    const int tid = WARP_SIZE * threadIdx.y + threadIdx.x;
    const int stride = 2 * WARP_SIZE * MATVEC_F_WARPS;
    float acc = 0.0f;
    for (int i = 2 * tid; i < ncols; i += stride) {
        const float2 wv = L::pair(w, i);
        acc = fmaf(wv.x, x[i], acc);
        acc = fmaf(wv.y, x[i + 1], acc);
    }
    __shared__ float partial[MATVEC_F_WARPS];
    acc = warp_sum(acc);
    if (threadIdx.x == 0) {
        partial[threadIdx.y] = acc;
    }
    __syncthreads();
    float total = 0.0f;
    if (threadIdx.y == 0) {
        total = warp_sum(threadIdx.x < MATVEC_F_WARPS ? partial[threadIdx.x] : 0.0f);
    }
    return total;
}

#define MATVEC_F_ENTRY_POINTS(name, L)                                                                          \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * MATVEC_F_WARPS)                                    \
        matvec_##name(const L::elem * __restrict__ w, const float * __restrict__ x, float * __restrict__ y,     \
                      int ncols, int nrows) {                                                                   \
        const int row = blockIdx.x;                                                                             \
        if (row >= nrows) {                                                                                     \
            return;                                                                                             \
        }                                                                                                       \
        const float v = row_dot_f<L>(w + (int64_t) row * ncols, x, ncols);                                     \
        if (threadIdx.x == 0 && threadIdx.y == 0) {                                                             \
            y[row] = v;                                                                                         \
        }                                                                                                       \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * MATVEC_F_WARPS)                                    \
        matvec_experts_##name(const uint64_t * __restrict__ expert_table, const int32_t * __restrict__ ids,    \
                              int n_expert, const float * __restrict__ x, int64_t x_stride, float * __restrict__ y,          \
                              int ncols, int nrows) {                                                           \
        const int row = blockIdx.x;                                                                             \
        const int slot = blockIdx.y;                                                                            \
        if (row >= nrows) {                                                                                     \
            return;                                                                                             \
        }                                                                                                       \
        const int32_t expert = ids[slot];                                                                       \
        const uint64_t base = expert < 0 || expert >= n_expert ? 0 : expert_table[expert];                                           \
        float v = 0.0f;                                                                                         \
        if (base != 0) {                                                                                        \
            const L::elem * w = (const L::elem *) base + (int64_t) row * ncols;                                 \
            v = row_dot_f<L>(w, x + slot * x_stride, ncols);                                                    \
        }                                                                                                       \
        if (threadIdx.x == 0 && threadIdx.y == 0) {                                                             \
            y[(int64_t) slot * nrows + row] = v;                                                                \
        }                                                                                                       \
    }

MATVEC_F_ENTRY_POINTS(f32, load_f32)
MATVEC_F_ENTRY_POINTS(f16, load_f16)
MATVEC_F_ENTRY_POINTS(bf16, load_bf16)
