// Float matrix x vector for one token: y[r] = W[r,:] . x with W in F32, F16 or BF16 and x in f32 (products
// and sums in f32). One thread block of (32, MATVEC_F_WARPS) threads per row; threads stride over the columns
// two at a time (rows of an even number of columns start 4-byte aligned for the 16-bit formats, which is
// what the Rust side checks). Entry points mirror matvec_q.cu: one matrix, or several experts of one stacked
// tensor through a table of device addresses and ids read from device memory (a null address or an id
// outside 0..n_expert: the slot's output is 0).

// The row dot product and the weight loads are float_dot.cuh's (shared with route.cu's fused router).

#define MATVEC_F_ENTRY_POINTS(name, L)                                                                          \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * MATVEC_F_WARPS)                                    \
        matvec_##name(const L::elem * __restrict__ w, const float * __restrict__ x, float * __restrict__ y,     \
                      int ncols, int nrows) {                                                                   \
        launch_prologue_prefetch(w, (int64_t) nrows * ncols * (int64_t) sizeof(typename L::elem));             \
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
                              int ncols, int nrows) { launch_prologue();                                        \
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

// ----- matrix x matrix for prompt batches: y[n, nrows] = x[n, ncols] . W^T --------------------------------
// A block of 256 threads computes 64 rows x 64 tokens (4 x 4 per thread), staging 16 columns of both in
// shared memory per step; each product is summed over the columns in order, in f32. The matrix is expert 0
// of an expert table (the engine keeps float matrices as one-expert tables).

#define MMF_TILE 64
#define MMF_K 16

template <typename L>
static __device__ __forceinline__ void matmul_f(const uint64_t * __restrict__ table, const float * __restrict__ x,
                                                float * __restrict__ y, int ncols, int nrows, int n) {
    const typename L::elem * w = (const typename L::elem *) table[0];
    __shared__ float sw[MMF_K][MMF_TILE + 1];
    __shared__ float sx[MMF_K][MMF_TILE + 1];
    const int tid = threadIdx.x;
    const int tr = tid / 16, tc = tid % 16;
    const int r0 = blockIdx.x * MMF_TILE, t0 = blockIdx.y * MMF_TILE;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc[i][j] = 0.0f;
        }
    }
    for (int k0 = 0; k0 < ncols; k0 += MMF_K) {
#pragma unroll
        for (int it = 0; it < 4; ++it) {
            const int idx = tid + 256 * it;
            const int r = idx / MMF_K, kk = idx % MMF_K;
            const int col = k0 + kk;
            const int row = r0 + r, tok = t0 + r;
            sw[kk][r] = row < nrows && col < ncols ? L::one(w, (int64_t) row * ncols + col) : 0.0f;
            sx[kk][r] = tok < n && col < ncols ? x[(int64_t) tok * ncols + col] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < MMF_K; ++kk) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                a[i] = sw[kk][4 * tr + i];
                b[i] = sx[kk][4 * tc + i];
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int row = r0 + 4 * tr + i, tok = t0 + 4 * tc + j;
            if (row < nrows && tok < n) {
                y[(int64_t) tok * nrows + row] = acc[i][j];
            }
        }
    }
}

#define MATMUL_F_ENTRY_POINT(name, L)                                                                           \
    extern "C" __global__ void __launch_bounds__(256)                                                           \
        matmul_f_##name(const uint64_t * __restrict__ table, const float * __restrict__ x, float * __restrict__ y, \
                        int ncols, int nrows, int n) { launch_prologue();                                       \
        matmul_f<L>(table, x, y, ncols, nrows, n);                                                              \
    }

MATMUL_F_ENTRY_POINT(f32, load_f32)
MATMUL_F_ENTRY_POINT(f16, load_f16)
MATMUL_F_ENTRY_POINT(bf16, load_bf16)
