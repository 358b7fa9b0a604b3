// Quantized matrix x matrix for prompt batches on the int8 tensor cores (mma.sync m16n8k32 / m16n8k16, s8 x s8
// -> s32; sm_80 and later): llama.cpp's mmq idea. Activations are block_q8_1 (quantize.cu); a thread block
// computes MMQ_ROWS weight rows x BN tokens. Per step of MMQ_K values along the row it unpacks the weights'
// quants to int8 in shared memory (with one (scale, offset) pair per 32 values), copies the tokens' q8_1
// quants and (d, s) there, and each of the MMQ_WARPS warps multiplies its 16 rows with all BN tokens: one
// integer mma per 32 values (two of 16 for formats with a scale per 16 values), then
//     acc += isum * scale_w * d_x - offset_w * s_x
// in f32 (s_x = d_x * sum of the 32 quants, so the offset of Q4_K/Q5_K's minimum costs no integer work).
//
// Entry points (per format and token tile BN):
//   mmq_<fmt>_<BN>          : one matrix; grid (row tiles, token tiles); y [n_tokens, nrows].
//   mmq_experts_<fmt>_<BN>  : tokens grouped by expert (prompt.rs ExpertGrouping); grid (row tiles, tiles);
//                             tile t = (expert, first sorted row, rows <= BN) from device memory; x and y in
//                             sorted order. A null address or an id outside 0..n_expert writes zeros for
//                             the tile's rows; an empty tile (rows 0) writes nothing.

#define MMQ_WARPS 8
#define MMQ_ROWS (16 * MMQ_WARPS)
#define MMQ_K 128
#define MMQ_SUBS (MMQ_K / 32)
// ints per row of the shared tiles: 32 of quants + 4 of padding, so a fragment load (rows g, ints t, for
// g < 8, t < 4) touches 32 different banks.
#define MMQ_STRIDE (MMQ_K / 4 + 4)

// ----- formats: the quants of one 32-value sub-block as int8, 4 at a time, and its (scale, offset) --------
// quants(b, sub, i): values 4i..4i+3 of sub-block `sub` of weight block b; value = scale * q - offset
// (k16 formats: scale.x for values 0..15, scale.y for 16..31, no offset).

// The 6-bit (scale, min) of sub-block j of a Q4_K/Q5_K block.
static __device__ __forceinline__ void scale_min_k4(const uint8_t * q, int j, int & sc, int & m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

struct mmq_q4_K {
    static constexpr int qk = QK_K;
    static constexpr bool k16 = false;
    typedef block_q4_K block;
    static __device__ __forceinline__ int quants(const block * b, int sub, int i) {
        const int v = get_int_b4(b->qs, 8 * (sub / 2) + i);
        return (v >> (4 * (sub & 1))) & 0x0F0F0F0F;
    }
    static __device__ __forceinline__ float2 scale(const block * b, int sub) {
        int sc, m;
        scale_min_k4(b->scales, sub, sc, m);
        return make_float2(f16_to_f32(b->d) * (float) sc, f16_to_f32(b->dmin) * (float) m);
    }
};

struct mmq_q5_K {
    static constexpr int qk = QK_K;
    static constexpr bool k16 = false;
    typedef block_q5_K block;
    static __device__ __forceinline__ int quants(const block * b, int sub, int i) {
        const int v = get_int_b4(b->qs, 8 * (sub / 2) + i);
        const int h = get_int_b4(b->qh, i);
        return ((v >> (4 * (sub & 1))) & 0x0F0F0F0F) | (((h >> sub) & 0x01010101) << 4);
    }
    static __device__ __forceinline__ float2 scale(const block * b, int sub) {
        int sc, m;
        scale_min_k4(b->scales, sub, sc, m);
        return make_float2(f16_to_f32(b->d) * (float) sc, f16_to_f32(b->dmin) * (float) m);
    }
};

// Q6_K: value v of the 256 is in half n = v/128, quarter qq = (v%128)/32; its low 4 bits are the
// (qq/2)-th nibble of ql[64n + 32(qq%2) + l], its high 2 bits bits 2qq of qh[32n + l] (l = v%32); a scale
// per 16 values. Sub-block s of 32 values is (n, qq) = (s/4, s%4).
struct mmq_q6_K {
    static constexpr int qk = QK_K;
    static constexpr bool k16 = true;
    typedef block_q6_K block;
    static __device__ __forceinline__ int quants(const block * b, int sub, int i) {
        const int n = sub / 4, qq = sub % 4;
        const int vl = (get_int_b2(b->ql, 16 * n + 8 * (qq & 1) + i) >> (4 * (qq >> 1))) & 0x0F0F0F0F;
        const int vh = ((get_int_b2(b->qh, 8 * n + i) >> (2 * qq)) & 0x03030303) << 4;
        return __vsub4(vl | vh, 0x20202020);
    }
    static __device__ __forceinline__ float2 scale(const block * b, int sub) {
        const int n = sub / 4, qq = sub % 4;
        const float d = f16_to_f32(b->d);
        return make_float2(d * (float) b->scales[8 * n + 2 * qq], d * (float) b->scales[8 * n + 2 * qq + 1]);
    }
};

struct mmq_q8_0 {
    static constexpr int qk = 32;
    static constexpr bool k16 = false;
    typedef block_q8_0 block;
    static __device__ __forceinline__ int quants(const block * b, int, int i) {
        return get_int_b2(b->qs, i);
    }
    static __device__ __forceinline__ float2 scale(const block * b, int) {
        return make_float2(f16_to_f32(b->d), 0.0f);
    }
};

// ----- the tensor core instructions ---------------------------------------------------------------------

// c = a (16x32, rows g and g+8, ints t and t+4 of each) x b (32x8, column g, ints t and t+4).
static __device__ __forceinline__ void mma_k32(const int (&a)[4], const int (&b)[2], int (&c)[4]) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%10, %10, %10, %10};"
                 : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(0));
}

// c = a (16x16, rows g and g+8, int t of each) x b (16x8, column g, int t).
static __device__ __forceinline__ void mma_k16(const int (&a)[2], int b, int (&c)[4]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
                 "{%7, %7, %7, %7};"
                 : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b), "r"(0));
}

// ----- one tile: MMQ_ROWS rows (from row0) x BN tokens ---------------------------------------------------

// w: the matrix (rows of row_bytes); x: the tile's first token's q8_1 blocks, tokens x_stride blocks apart;
// y: the tile's first token's output row (nrows floats per token); ncol tokens valid.
template <typename F, int BN>
static __device__ __forceinline__ void mmq_tile(const uint8_t * __restrict__ w, int64_t row_bytes, int nrows,
                                                int ncols, int row0, const block_q8_1 * __restrict__ x,
                                                int64_t x_stride, int ncol, float * __restrict__ y) {
    typedef typename F::block block;
    __shared__ int sa[MMQ_ROWS * MMQ_STRIDE];
    __shared__ float2 sa_scale[MMQ_ROWS * MMQ_SUBS];
    __shared__ int sb[BN * MMQ_STRIDE];
    __shared__ float2 sb_ds[BN * MMQ_SUBS];

    const int tid = threadIdx.y * WARP_SIZE + threadIdx.x;
    constexpr int threads = MMQ_WARPS * WARP_SIZE;
    const int lane = threadIdx.x, warp = threadIdx.y;
    const int g = lane / 4, t = lane % 4;
    constexpr int nt_count = BN / 8;

    float acc[nt_count][4];
#pragma unroll
    for (int nt = 0; nt < nt_count; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            acc[nt][i] = 0.0f;
        }
    }

    for (int k0 = 0; k0 < ncols; k0 += MMQ_K) {
        // Weights: MMQ_ROWS rows x MMQ_K values as int8 (a warp takes one row's 32 ints at a time). Rows past
        // the last repeat the last (their results are not stored).
#pragma unroll 4
        for (int idx = tid; idx < MMQ_ROWS * (MMQ_K / 4); idx += threads) {
            const int r = idx / (MMQ_K / 4), j = idx % (MMQ_K / 4);
            const int row = min(row0 + r, nrows - 1);
            const int v = k0 + 32 * (j / 8); // first value of the sub-block
            const block * b = (const block *) (w + row * row_bytes) + v / F::qk;
            sa[r * MMQ_STRIDE + j] = F::quants(b, (v % F::qk) / 32, j % 8);
        }
        for (int idx = tid; idx < MMQ_ROWS * MMQ_SUBS; idx += threads) {
            const int r = idx / MMQ_SUBS, s = idx % MMQ_SUBS;
            const int row = min(row0 + r, nrows - 1);
            const int v = k0 + 32 * s;
            const block * b = (const block *) (w + row * row_bytes) + v / F::qk;
            sa_scale[idx] = F::scale(b, (v % F::qk) / 32);
        }
        // Tokens: BN x MMQ_SUBS q8_1 blocks; tokens past ncol are zeros.
#pragma unroll 4
        for (int idx = tid; idx < BN * (MMQ_K / 4); idx += threads) {
            const int c = idx / (MMQ_K / 4), j = idx % (MMQ_K / 4);
            int q = 0;
            if (c < ncol) {
                q = get_int_b4(x[c * x_stride + k0 / 32 + j / 8].qs, j % 8);
            }
            sb[c * MMQ_STRIDE + j] = q;
        }
        for (int idx = tid; idx < BN * MMQ_SUBS; idx += threads) {
            const int c = idx / MMQ_SUBS, s = idx % MMQ_SUBS;
            float2 ds = make_float2(0.0f, 0.0f);
            if (c < ncol) {
                const block_q8_1 * xb = x + c * x_stride + k0 / 32 + s;
                ds = make_float2(f16_to_f32(xb->d), f16_to_f32(xb->s));
            }
            sb_ds[idx] = ds;
        }
        __syncthreads();

        const int ra = 16 * warp + g;
#pragma unroll
        for (int s = 0; s < MMQ_SUBS; ++s) {
            const int * a_lo = sa + ra * MMQ_STRIDE + 8 * s;
            const int * a_hi = a_lo + 8 * MMQ_STRIDE;
            const float2 sc_lo = sa_scale[ra * MMQ_SUBS + s];
            const float2 sc_hi = sa_scale[(ra + 8) * MMQ_SUBS + s];
            if constexpr (!F::k16) {
                const int a[4] = {a_lo[t], a_hi[t], a_lo[t + 4], a_hi[t + 4]};
#pragma unroll
                for (int nt = 0; nt < nt_count; ++nt) {
                    const int * bp = sb + (8 * nt + g) * MMQ_STRIDE + 8 * s;
                    const int b[2] = {bp[t], bp[t + 4]};
                    int c[4];
                    mma_k32(a, b, c);
                    const float2 d0 = sb_ds[(8 * nt + 2 * t) * MMQ_SUBS + s];
                    const float2 d1 = sb_ds[(8 * nt + 2 * t + 1) * MMQ_SUBS + s];
                    acc[nt][0] = fmaf((float) c[0], sc_lo.x * d0.x, fmaf(-sc_lo.y, d0.y, acc[nt][0]));
                    acc[nt][1] = fmaf((float) c[1], sc_lo.x * d1.x, fmaf(-sc_lo.y, d1.y, acc[nt][1]));
                    acc[nt][2] = fmaf((float) c[2], sc_hi.x * d0.x, fmaf(-sc_hi.y, d0.y, acc[nt][2]));
                    acc[nt][3] = fmaf((float) c[3], sc_hi.x * d1.x, fmaf(-sc_hi.y, d1.y, acc[nt][3]));
                }
            } else {
                const int a0[2] = {a_lo[t], a_hi[t]};
                const int a1[2] = {a_lo[t + 4], a_hi[t + 4]};
#pragma unroll
                for (int nt = 0; nt < nt_count; ++nt) {
                    const int * bp = sb + (8 * nt + g) * MMQ_STRIDE + 8 * s;
                    int c0[4], c1[4];
                    mma_k16(a0, bp[t], c0);
                    mma_k16(a1, bp[t + 4], c1);
                    const float d0 = sb_ds[(8 * nt + 2 * t) * MMQ_SUBS + s].x;
                    const float d1 = sb_ds[(8 * nt + 2 * t + 1) * MMQ_SUBS + s].x;
                    acc[nt][0] = fmaf((float) c0[0] * sc_lo.x + (float) c1[0] * sc_lo.y, d0, acc[nt][0]);
                    acc[nt][1] = fmaf((float) c0[1] * sc_lo.x + (float) c1[1] * sc_lo.y, d1, acc[nt][1]);
                    acc[nt][2] = fmaf((float) c0[2] * sc_hi.x + (float) c1[2] * sc_hi.y, d0, acc[nt][2]);
                    acc[nt][3] = fmaf((float) c0[3] * sc_hi.x + (float) c1[3] * sc_hi.y, d1, acc[nt][3]);
                }
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int nt = 0; nt < nt_count; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = row0 + 16 * warp + g + 8 * (i >> 1);
            const int c = 8 * nt + 2 * t + (i & 1);
            if (row < nrows && c < ncol) {
                y[(int64_t) c * nrows + row] = acc[nt][i];
            }
        }
    }
}

template <typename F, int BN>
static __device__ __forceinline__ void mmq(const uint8_t * __restrict__ w, const block_q8_1 * __restrict__ x,
                                           float * __restrict__ y, int ncols, int nrows, int n_tokens) {
    const int64_t x_stride = ncols / QK8_1;
    const int64_t row_bytes = (int64_t) (ncols / F::qk) * sizeof(typename F::block);
    const int t0 = blockIdx.y * BN;
    mmq_tile<F, BN>(w, row_bytes, nrows, ncols, blockIdx.x * MMQ_ROWS, x + t0 * x_stride, x_stride,
                    min(BN, n_tokens - t0), y + (int64_t) t0 * nrows);
}

template <typename F, int BN>
static __device__ __forceinline__ void mmq_experts(const uint64_t * __restrict__ expert_table, int n_expert,
                                                   const int32_t * __restrict__ tiles,
                                                   const block_q8_1 * __restrict__ x, float * __restrict__ y,
                                                   int ncols, int nrows) {
    const int32_t expert = tiles[3 * blockIdx.y];
    const int r0 = tiles[3 * blockIdx.y + 1];
    const int ncol = min(BN, (int) tiles[3 * blockIdx.y + 2]);
    if (ncol <= 0) {
        return;
    }
    const uint64_t base = expert < 0 || expert >= n_expert ? 0 : expert_table[expert];
    float * yt = y + (int64_t) r0 * nrows;
    const int row0 = blockIdx.x * MMQ_ROWS;
    if (base == 0) {
        const int tid = threadIdx.y * WARP_SIZE + threadIdx.x;
        for (int i = tid; i < ncol * MMQ_ROWS; i += MMQ_WARPS * WARP_SIZE) {
            const int row = row0 + i % MMQ_ROWS;
            if (row < nrows) {
                yt[(int64_t) (i / MMQ_ROWS) * nrows + row] = 0.0f;
            }
        }
        return;
    }
    const int64_t x_stride = ncols / QK8_1;
    const int64_t row_bytes = (int64_t) (ncols / F::qk) * sizeof(typename F::block);
    mmq_tile<F, BN>((const uint8_t *) base, row_bytes, nrows, ncols, row0, x + r0 * x_stride, x_stride, ncol, yt);
}

#define MMQ_ENTRY_POINTS(name, F, BN)                                                                          \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * MMQ_WARPS)                                        \
        mmq_##name##_##BN(const uint8_t * __restrict__ w, const block_q8_1 * __restrict__ x,                   \
                          float * __restrict__ y, int ncols, int nrows, int n_tokens) {                        \
        mmq<F, BN>(w, x, y, ncols, nrows, n_tokens);                                                           \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * MMQ_WARPS)                                        \
        mmq_experts_##name##_##BN(const uint64_t * __restrict__ expert_table, int n_expert,                    \
                                  const int32_t * __restrict__ tiles, const block_q8_1 * __restrict__ x,       \
                                  float * __restrict__ y, int ncols, int nrows) {                              \
        mmq_experts<F, BN>(expert_table, n_expert, tiles, x, y, ncols, nrows);                                 \
    }

MMQ_ENTRY_POINTS(q4_k, mmq_q4_K, 32)
MMQ_ENTRY_POINTS(q4_k, mmq_q4_K, 64)
MMQ_ENTRY_POINTS(q5_k, mmq_q5_K, 32)
MMQ_ENTRY_POINTS(q5_k, mmq_q5_K, 64)
MMQ_ENTRY_POINTS(q6_k, mmq_q6_K, 32)
MMQ_ENTRY_POINTS(q6_k, mmq_q6_K, 64)
MMQ_ENTRY_POINTS(q8_0, mmq_q8_0, 32)
MMQ_ENTRY_POINTS(q8_0, mmq_q8_0, 64)
