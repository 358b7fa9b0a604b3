// The int8 tensor-core matrix x matrix for prompt batches, shared by matmul_mma.cu (Q4_K, Q5_K, Q6_K, Q8_0)
// and mmq_iq.cu (the i-quants): the Rust side (kernels/src/cuda/module.rs) puts this text after common.cuh
// in front of both, and each file defines its formats and instantiates MMQ_ENTRY_POINTS for them. Two
// modules rather than one because NVRTC takes about 22 s per architecture for the nine i-quants and 12 s for
// the four others (development CPU): a launch outside a graph capture compiles only the module it needs.
//
// Quantized matrix x matrix for prompt batches on the int8 tensor cores (mma.sync m16n8k32 / m16n8k16, s8 x s8
// -> s32; sm_80 and later): llama.cpp's mmq idea. Activations are block_q8_1 (quantize.cu); a thread block
// computes MMQ_ROWS weight rows x BN tokens. Per step of MMQ_K values along the row it unpacks the weights'
// quants to int8 in shared memory (with one (scale, offset) pair per 32 values), copies the tokens' q8_1
// quants and (d, s) there, and each of the MMQ_WARPS warps multiplies its 16 rows with all BN tokens: one
// integer mma per 32 values (two of 16 for formats with a scale per 16 values), then
//     acc += isum * scale_w * d_x - offset_w * s_x
// in f32 (s_x = d_x * sum of the 32 quants, so the offset of Q4_K/Q5_K's minimum costs no integer work).
// The next step's weights and tokens are loaded into registers while the current step multiplies (Q4_K and
// Q5_K as raw 16-byte words, unpacked when stored to shared memory).
//
// Entry points (per format and token tile BN: 16, 32, 64 or 128):
//   mmq_<fmt>_<BN>          : one matrix; grid (row tiles, token tiles); y [n_tokens, nrows].
//   mmq_experts_<fmt>_<BN>  : tokens grouped by expert (prompt.rs ExpertGrouping); grid (row tiles, tiles);
//                             tile t = (expert, first sorted row, rows <= BN) from device memory; x and y in
//                             sorted order. A null address or an id outside 0..n_expert writes zeros for
//                             the tile's rows; an empty tile (rows 0) writes nothing.
//   mmq_experts_pair_<fmt>_<BN>: two expert tensors of one shape over the same tiles and x (gate and up):
//                             grid z 0 the first, 1 the second; one launch, so one tail instead of two.

#define MMQ_WARPS 8
#define MMQ_ROWS (16 * MMQ_WARPS)
#define MMQ_K 128
#define MMQ_SUBS (MMQ_K / 32)
// ints per row of the shared tiles: 32 of quants + 4 of padding, so a fragment load (rows g, ints t, for
// g < 8, t < 4) touches 32 different banks.
#define MMQ_STRIDE (MMQ_K / 4 + 4)

// ----- formats: the quants of one 32-value sub-block as int8, 4 at a time, and its (scale, offset) --------
// A format is a struct with qk (values per block), k16, `typedef <layout> block;` and either
//   quants(b, sub, i): values 4i..4i+3 of sub-block `sub` of weight block b, and scale(b, sub): read through
//   a_stage_generic (no prefetch); or
//   raw, load(b, sub) and unpack(raw, q[8]) -> scale: a_stage_sub (below) prefetches `raw` (the bits of one
//   sub-block) into registers before the products and unpacks all 8 ints after them.
// value = scale.x * q - scale.y (k16 formats: scale.x for values 0..15, scale.y for 16..31, no offset).
// A format without k16 also says `offset`: false where scale.y is always 0, so the products skip the offset
// term. Besides the work, that keeps such formats finite for huge activations: s_x is an f16 (up to 32 max|x|),
// which overflows to inf from max|x| of about 2048 in a block, and 0 * inf would be NaN.
// a_stage_of<F> names the stage; the file of a format with a stage of its own specializes it.

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

// ----- staging: global memory -> registers (fetch, before the previous step's products) -> shared memory
// (store, after them), so the loads of step k+1 are in flight while step k multiplies.

// Any format through F::quants / F::scale, without prefetch (holding 16 unpacked ints per thread across the
// products costs more registers than it saves): fetch only notes the step, store reads and unpacks.
template <typename F>
struct a_stage_generic {
    typedef typename F::block block;
    const uint8_t * w;
    int64_t row_bytes;
    int nrows, row0, k0;
    __device__ __forceinline__ void fetch(const uint8_t * __restrict__ w_, int64_t row_bytes_, int nrows_,
                                          int row0_, int k0_, int) {
        w = w_;
        row_bytes = row_bytes_;
        nrows = nrows_;
        row0 = row0_;
        k0 = k0_;
    }
    __device__ __forceinline__ void store(int * sa, float2 * sa_scale, int tid) const {
#pragma unroll 4
        for (int idx = tid; idx < MMQ_ROWS * (MMQ_K / 4); idx += MMQ_WARPS * WARP_SIZE) {
            const int r = idx / (MMQ_K / 4), j = idx % (MMQ_K / 4);
            const int row = min(row0 + r, nrows - 1);
            const int v = k0 + 32 * (j / 8);
            const block * b = (const block *) (w + row * row_bytes) + v / F::qk;
            sa[r * MMQ_STRIDE + j] = F::quants(b, (v % F::qk) / 32, j % 8);
        }
        for (int idx = tid; idx < MMQ_ROWS * MMQ_SUBS; idx += MMQ_WARPS * WARP_SIZE) {
            const int r = idx / MMQ_SUBS, s = idx % MMQ_SUBS;
            const int row = min(row0 + r, nrows - 1);
            const int v = k0 + 32 * s;
            const block * b = (const block *) (w + row * row_bytes) + v / F::qk;
            sa_scale[idx] = F::scale(b, (v % F::qk) / 32);
        }
    }
};

// Formats with `raw` / load / unpack: a thread item is one 32-value sub-block of one row (MMQ_ROWS x
// MMQ_SUBS items, 2 per thread). fetch loads each item's raw bits (a few words: the lattice formats' indexes,
// signs and scale bits) into registers; store unpacks them into the sub-block's 8 ints of int8 and its
// scale. One item per sub-block reads the bits every int of the sub-block shares (the scale word, the
// block's d) once, where a_stage_generic would read them for each int.
template <typename F>
struct a_stage_sub {
    typedef typename F::block block;
    static constexpr int items = MMQ_ROWS * MMQ_SUBS / (MMQ_WARPS * WARP_SIZE);
    typename F::raw raw[items];
    __device__ __forceinline__ void fetch(const uint8_t * __restrict__ w, int64_t row_bytes, int nrows, int row0,
                                          int k0, int tid) {
#pragma unroll
        for (int it = 0; it < items; ++it) {
            const int idx = tid + it * MMQ_WARPS * WARP_SIZE;
            const int r = idx / MMQ_SUBS, s = idx % MMQ_SUBS;
            const int row = min(row0 + r, nrows - 1);
            const int v = k0 + 32 * s;
            const block * b = (const block *) (w + row * row_bytes) + v / F::qk;
            raw[it] = F::load(b, (v % F::qk) / 32);
        }
    }
    // Item (r, s) writes ints 8s..8s+7 of row r: the four threads of a row and the next row's four (36 ints
    // on) cover all 32 banks once per 16-byte phase.
    __device__ __forceinline__ void store(int * sa, float2 * sa_scale, int tid) const {
#pragma unroll
        for (int it = 0; it < items; ++it) {
            const int idx = tid + it * MMQ_WARPS * WARP_SIZE;
            const int r = idx / MMQ_SUBS, s = idx % MMQ_SUBS;
            int q[8];
            const float2 sc = F::unpack(raw[it], q);
            int * dst = sa + r * MMQ_STRIDE + 8 * s;
            *(int4 *) dst = make_int4(q[0], q[1], q[2], q[3]);
            *(int4 *) (dst + 4) = make_int4(q[4], q[5], q[6], q[7]);
            sa_scale[r * MMQ_SUBS + s] = sc;
        }
    }
};

template <typename F> struct a_stage_of { typedef a_stage_generic<F> type; };

// Tokens: one q8_1 block (d, s, 32 quants: 9 words) per thread item; tokens past ncol are zeros.
template <int BN>
struct b_stage {
    static constexpr int items = (BN * MMQ_SUBS + MMQ_WARPS * WARP_SIZE - 1) / (MMQ_WARPS * WARP_SIZE);
    int words[items][9];
    __device__ __forceinline__ void fetch(const block_q8_1 * __restrict__ x, int64_t x_stride, int ncol, int k0,
                                          int tid) {
#pragma unroll
        for (int it = 0; it < items; ++it) {
            const int idx = tid + it * MMQ_WARPS * WARP_SIZE;
            const int c = idx / MMQ_SUBS, blk = idx % MMQ_SUBS;
            if (idx < BN * MMQ_SUBS && c < ncol) {
                const int * src = (const int *) (x + c * x_stride + k0 / 32 + blk);
#pragma unroll
                for (int i = 0; i < 9; ++i) {
                    words[it][i] = src[i];
                }
            } else {
#pragma unroll
                for (int i = 0; i < 9; ++i) {
                    words[it][i] = 0;
                }
            }
        }
    }
    __device__ __forceinline__ void store(int * sb, float2 * sb_ds, int tid) const {
#pragma unroll
        for (int it = 0; it < items; ++it) {
            const int idx = tid + it * MMQ_WARPS * WARP_SIZE;
            if (idx < BN * MMQ_SUBS) {
                const int c = idx / MMQ_SUBS, blk = idx % MMQ_SUBS;
                int * dst = sb + c * MMQ_STRIDE + 8 * blk;
                *(int4 *) dst = make_int4(words[it][1], words[it][2], words[it][3], words[it][4]);
                *(int4 *) (dst + 4) = make_int4(words[it][5], words[it][6], words[it][7], words[it][8]);
                sb_ds[idx] = make_float2(f16_to_f32((uint16_t) (words[it][0] & 0xFFFF)),
                                         f16_to_f32((uint16_t) ((uint32_t) words[it][0] >> 16)));
            }
        }
    }
};

// ----- one tile: MMQ_ROWS rows (from row0) x BN tokens ---------------------------------------------------

// w: the matrix (rows of row_bytes); x: the tile's first token's q8_1 blocks, tokens x_stride blocks apart;
// y: the tile's first token's output row (nrows floats per token); ncol tokens valid. The products stop at
// the last group of 32 tokens holding a valid one, so a tile larger than an expert's run costs the weights'
// unpacking (once per tile) and little idle tensor-core work: a grouped launch takes one large tile per
// expert.
template <typename F, int BN, bool SKIP_EMPTY>
static __device__ __forceinline__ void mmq_tile(const uint8_t * __restrict__ w, int64_t row_bytes, int nrows,
                                                int ncols, int row0, const block_q8_1 * __restrict__ x,
                                                int64_t x_stride, int ncol, float * __restrict__ y) {
    __shared__ __align__(16) int sa[MMQ_ROWS * MMQ_STRIDE];
    __shared__ float2 sa_scale[MMQ_ROWS * MMQ_SUBS];
    __shared__ __align__(16) int sb[BN * MMQ_STRIDE];
    __shared__ float2 sb_ds[BN * MMQ_SUBS];

    const int tid = threadIdx.y * WARP_SIZE + threadIdx.x;
    const int lane = threadIdx.x, warp = threadIdx.y;
    const int g = lane / 4, t = lane % 4;
    constexpr int nt_count = BN / 8;
    // SKIP_EMPTY: products in groups of 4 token sub-tiles, a group without valid tokens skipped (grouped
    // experts); else all at once (a plain matmul's tiles are full but the last).
    constexpr int nt_group = SKIP_EMPTY && nt_count > 4 ? 4 : nt_count;

    float acc[nt_count][4];
#pragma unroll
    for (int nt = 0; nt < nt_count; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            acc[nt][i] = 0.0f;
        }
    }

    typename a_stage_of<F>::type a_stage;
    b_stage<BN> b_st;
    a_stage.fetch(w, row_bytes, nrows, row0, 0, tid);
    b_st.fetch(x, x_stride, ncol, 0, tid);
    for (int k0 = 0; k0 < ncols; k0 += MMQ_K) {
        a_stage.store(sa, sa_scale, tid);
        b_st.store(sb, sb_ds, tid);
        __syncthreads();
        if (k0 + MMQ_K < ncols) {
            a_stage.fetch(w, row_bytes, nrows, row0, k0 + MMQ_K, tid);
            b_st.fetch(x, x_stride, ncol, k0 + MMQ_K, tid);
        }

        const int ra = 16 * warp + g;
        // Groups of up to 4 token sub-tiles (32 tokens): a group past the tile's valid tokens is skipped (an
        // expert's short run in a large tile), while inside a group the products are independent of each
        // other for the scheduler.
#pragma unroll
        for (int ng = 0; ng < nt_count; ng += nt_group) {
            if (SKIP_EMPTY && 8 * ng >= ncol) {
                continue;
            }
#pragma unroll
            for (int s = 0; s < MMQ_SUBS; ++s) {
                const int * a_lo = sa + ra * MMQ_STRIDE + 8 * s;
                const int * a_hi = a_lo + 8 * MMQ_STRIDE;
                const float2 sc_lo = sa_scale[ra * MMQ_SUBS + s];
                const float2 sc_hi = sa_scale[(ra + 8) * MMQ_SUBS + s];
                if constexpr (!F::k16) {
                    const int a[4] = {a_lo[t], a_hi[t], a_lo[t + 4], a_hi[t + 4]};
#pragma unroll
                    for (int nt = ng; nt < ng + nt_group; ++nt) {
                        const int * bp = sb + (8 * nt + g) * MMQ_STRIDE + 8 * s;
                        const int b[2] = {bp[t], bp[t + 4]};
                        int c[4];
                        mma_k32(a, b, c);
                        const float2 d0 = sb_ds[(8 * nt + 2 * t) * MMQ_SUBS + s];
                        const float2 d1 = sb_ds[(8 * nt + 2 * t + 1) * MMQ_SUBS + s];
                        if constexpr (F::offset) {
                            acc[nt][0] = fmaf((float) c[0], sc_lo.x * d0.x, fmaf(-sc_lo.y, d0.y, acc[nt][0]));
                            acc[nt][1] = fmaf((float) c[1], sc_lo.x * d1.x, fmaf(-sc_lo.y, d1.y, acc[nt][1]));
                            acc[nt][2] = fmaf((float) c[2], sc_hi.x * d0.x, fmaf(-sc_hi.y, d0.y, acc[nt][2]));
                            acc[nt][3] = fmaf((float) c[3], sc_hi.x * d1.x, fmaf(-sc_hi.y, d1.y, acc[nt][3]));
                        } else {
                            acc[nt][0] = fmaf((float) c[0], sc_lo.x * d0.x, acc[nt][0]);
                            acc[nt][1] = fmaf((float) c[1], sc_lo.x * d1.x, acc[nt][1]);
                            acc[nt][2] = fmaf((float) c[2], sc_hi.x * d0.x, acc[nt][2]);
                            acc[nt][3] = fmaf((float) c[3], sc_hi.x * d1.x, acc[nt][3]);
                        }
                    }
                } else {
                    const int a0[2] = {a_lo[t], a_hi[t]};
                    const int a1[2] = {a_lo[t + 4], a_hi[t + 4]};
#pragma unroll
                    for (int nt = ng; nt < ng + nt_group; ++nt) {
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
    mmq_tile<F, BN, false>(w, row_bytes, nrows, ncols, blockIdx.x * MMQ_ROWS, x + t0 * x_stride, x_stride,
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
    mmq_tile<F, BN, true>((const uint8_t *) base, row_bytes, nrows, ncols, row0, x + r0 * x_stride, x_stride, ncol, yt);
}

// MIN_BLOCKS: blocks per SM the register allocation must allow (2 where the prefetch fits in 128
// registers without much spilling).
#define MMQ_ENTRY_POINTS(name, F, BN, MIN_BLOCKS)                                                              \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * MMQ_WARPS, MIN_BLOCKS)                             \
        mmq_##name##_##BN(const uint8_t * __restrict__ w, const block_q8_1 * __restrict__ x,                   \
                          float * __restrict__ y, int ncols, int nrows, int n_tokens) { launch_prologue();     \
        mmq<F, BN>(w, x, y, ncols, nrows, n_tokens);                                                           \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * MMQ_WARPS, MIN_BLOCKS)                             \
        mmq_experts_##name##_##BN(const uint64_t * __restrict__ expert_table, int n_expert,                    \
                                  const int32_t * __restrict__ tiles, const block_q8_1 * __restrict__ x,       \
                                  float * __restrict__ y, int ncols, int nrows) { launch_prologue();           \
        mmq_experts<F, BN>(expert_table, n_expert, tiles, x, y, ncols, nrows);                                 \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * MMQ_WARPS, MIN_BLOCKS)                             \
        mmq_experts_pair_##name##_##BN(const uint64_t * __restrict__ table_a,                                  \
                                       const uint64_t * __restrict__ table_b, int n_expert,                    \
                                       const int32_t * __restrict__ tiles, const block_q8_1 * __restrict__ x,  \
                                       float * __restrict__ y_a, float * __restrict__ y_b, int ncols,          \
                                       int nrows) { launch_prologue();                                         \
        const bool second = blockIdx.z != 0;                                                                   \
        mmq_experts<F, BN>(second ? table_b : table_a, n_expert, tiles, x, second ? y_b : y_a, ncols, nrows);  \
    }