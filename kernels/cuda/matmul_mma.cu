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

// Byte i (0..11) of the 12 scale bytes of a K-quant header held as an int4 (d/dmin in .x).
static __device__ __forceinline__ int hdr_byte(const int4 & h, int i) {
    const int word = i < 4 ? h.y : (i < 8 ? h.z : h.w);
    return (word >> (8 * (i & 3))) & 0xFF;
}

// Q4_K / Q5_K: a step (128 values) of a row is half a super-block: 64 bytes of nibbles (4 int4), the
// 16-byte header (d, dmin, 12 scale bytes) and for Q5_K 32 bytes of fifth bits. Thread item (row r, part p)
// loads nibble int4 p: values of sub-blocks 2(p/2) (low nibbles) and 2(p/2)+1 (high) of the step, ints
// 4(p%2)..+3 of each; parts 0 and 2 also unpack those two sub-blocks' scales.
template <bool Q5>
struct a_stage_k4 {
    static constexpr int items = MMQ_ROWS * 4 / (MMQ_WARPS * WARP_SIZE);
    int4 q[items], hdr[items], qh[Q5 ? items : 1];
    int half_;
    __device__ __forceinline__ void fetch(const uint8_t * __restrict__ w, int64_t row_bytes, int nrows, int row0,
                                          int k0, int tid) {
        half_ = (k0 % QK_K) / 128;
#pragma unroll
        for (int it = 0; it < items; ++it) {
            const int idx = tid + it * MMQ_WARPS * WARP_SIZE;
            const int r = idx / 4, p = idx % 4;
            const int row = min(row0 + r, nrows - 1);
            const uint8_t * b = w + row * row_bytes + (int64_t) (k0 / QK_K) * (Q5 ? sizeof(block_q5_K) : sizeof(block_q4_K));
            const int qs_off = Q5 ? 48 : 16;
            q[it] = *(const int4 *) (b + qs_off + 64 * half_ + 16 * p);
            hdr[it] = *(const int4 *) b;
            if constexpr (Q5) {
                qh[it] = *(const int4 *) (b + 16 + 16 * (p % 2));
            }
        }
    }
    __device__ __forceinline__ void store(int * sa, float2 * sa_scale, int tid) const {
#pragma unroll
        for (int it = 0; it < items; ++it) {
            const int idx = tid + it * MMQ_WARPS * WARP_SIZE;
            const int r = idx / 4, p = idx % 4;
            const int sub = 2 * (p / 2);       // first of the two sub-blocks, within the step
            const int sg = 4 * half_ + sub;    // ... within the super-block
            const int qv[4] = {q[it].x, q[it].y, q[it].z, q[it].w};
            int lo[4], hi[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                lo[i] = qv[i] & 0x0F0F0F0F;
                hi[i] = (qv[i] >> 4) & 0x0F0F0F0F;
            }
            if constexpr (Q5) {
                const int hv[4] = {qh[it].x, qh[it].y, qh[it].z, qh[it].w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    lo[i] |= ((hv[i] >> sg) & 0x01010101) << 4;
                    hi[i] |= ((hv[i] >> (sg + 1)) & 0x01010101) << 4;
                }
            }
            int * dst = sa + r * MMQ_STRIDE + 8 * sub + 4 * (p % 2);
            *(int4 *) dst = make_int4(lo[0], lo[1], lo[2], lo[3]);
            *(int4 *) (dst + 8) = make_int4(hi[0], hi[1], hi[2], hi[3]);
            if (p % 2 == 0) {
                const int4 h = hdr[it];
                const float d = f16_to_f32((uint16_t) (h.x & 0xFFFF));
                const float dmin = f16_to_f32((uint16_t) ((uint32_t) h.x >> 16));
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int j = sg + e;
                    int sc, m;
                    if (j < 4) {
                        sc = hdr_byte(h, j) & 63;
                        m = hdr_byte(h, j + 4) & 63;
                    } else {
                        sc = (hdr_byte(h, j + 4) & 0xF) | ((hdr_byte(h, j - 4) >> 6) << 4);
                        m = (hdr_byte(h, j + 4) >> 4) | ((hdr_byte(h, j) >> 6) << 4);
                    }
                    sa_scale[r * MMQ_SUBS + sub + e] = make_float2(d * (float) sc, dmin * (float) m);
                }
            }
        }
    }
};

template <typename F> struct a_stage_of { typedef a_stage_generic<F> type; };
template <> struct a_stage_of<mmq_q4_K> { typedef a_stage_k4<false> type; };
template <> struct a_stage_of<mmq_q5_K> { typedef a_stage_k4<true> type; };

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
                        acc[nt][0] = fmaf((float) c[0], sc_lo.x * d0.x, fmaf(-sc_lo.y, d0.y, acc[nt][0]));
                        acc[nt][1] = fmaf((float) c[1], sc_lo.x * d1.x, fmaf(-sc_lo.y, d1.y, acc[nt][1]));
                        acc[nt][2] = fmaf((float) c[2], sc_hi.x * d0.x, fmaf(-sc_hi.y, d0.y, acc[nt][2]));
                        acc[nt][3] = fmaf((float) c[3], sc_hi.x * d1.x, fmaf(-sc_hi.y, d1.y, acc[nt][3]));
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

MMQ_ENTRY_POINTS(q4_k, mmq_q4_K, 16, 2)
MMQ_ENTRY_POINTS(q4_k, mmq_q4_K, 32, 2)
MMQ_ENTRY_POINTS(q4_k, mmq_q4_K, 64, 2)
MMQ_ENTRY_POINTS(q4_k, mmq_q4_K, 128, 1)
MMQ_ENTRY_POINTS(q5_k, mmq_q5_K, 16, 2)
MMQ_ENTRY_POINTS(q5_k, mmq_q5_K, 32, 2)
MMQ_ENTRY_POINTS(q5_k, mmq_q5_K, 64, 2)
MMQ_ENTRY_POINTS(q5_k, mmq_q5_K, 128, 1)
MMQ_ENTRY_POINTS(q6_k, mmq_q6_K, 16, 1)
MMQ_ENTRY_POINTS(q6_k, mmq_q6_K, 32, 1)
MMQ_ENTRY_POINTS(q6_k, mmq_q6_K, 64, 1)
MMQ_ENTRY_POINTS(q6_k, mmq_q6_K, 128, 1)
MMQ_ENTRY_POINTS(q8_0, mmq_q8_0, 16, 1)
MMQ_ENTRY_POINTS(q8_0, mmq_q8_0, 32, 1)
MMQ_ENTRY_POINTS(q8_0, mmq_q8_0, 64, 1)
MMQ_ENTRY_POINTS(q8_0, mmq_q8_0, 128, 1)

// ----- grouping a prompt's slots by expert on the card -----------------------------------------------------

#define GROUP_THREADS 1024
#define GROUP_MAX_EXPERTS 1024

// What ExpertGrouping::with_tile computes on the host, without taking the ids there (a wait of the host on
// the card per MoE layer): ids [n_slots] (token t's j-th choice at t*k + j); rows [n_slots] the token of
// each sorted row; slot_row [n_slots] the sorted row of each slot; tiles [max_tiles*3] (expert, first row,
// rows <= tile) per run of an expert's rows, experts in order, padded with (-1, 0, 0). The rows of an
// expert come in the order the atomics hand out (not the slots' order as on the host): each output row is
// computed from its own token only, so the results are the same. Ids outside 0..n_expert are placed after
// every expert's rows and get no tile. One block of GROUP_THREADS; n_expert <= GROUP_MAX_EXPERTS, and
// max_tiles at least ExpertGrouping::max_tiles.
extern "C" __global__ void __launch_bounds__(GROUP_THREADS)
    group_by_expert(const int32_t * __restrict__ ids, int n_slots, int k, int n_expert, int tile, int max_tiles,
                    int32_t * __restrict__ rows, int32_t * __restrict__ slot_row, int32_t * __restrict__ tiles) {
    launch_prologue();
    // Per expert (and at n_expert the ids outside): rows, first sorted row, first tile.
    __shared__ int count[GROUP_MAX_EXPERTS + 1];
    __shared__ int start[GROUP_MAX_EXPERTS + 1];
    __shared__ int tile0[GROUP_MAX_EXPERTS + 1];
    __shared__ int n_tiles;
    const int tid = threadIdx.x;
    for (int e = tid; e <= n_expert; e += blockDim.x) {
        count[e] = 0;
    }
    __syncthreads();
    // Pass 1: each slot's place among its expert's rows, kept in slot_row until pass 2 (same thread, same slot).
    for (int s = tid; s < n_slots; s += blockDim.x) {
        int e = ids[s];
        if (e < 0 || e >= n_expert) {
            e = n_expert;
        }
        slot_row[s] = atomicAdd(&count[e], 1);
    }
    __syncthreads();
    // Exclusive prefix sums of rows and tiles over the experts: warp 0, each lane a run of entries.
    if (tid < WARP_SIZE) {
        const int per = (n_expert + 1 + WARP_SIZE - 1) / WARP_SIZE;
        int rsum = 0, tsum = 0;
        for (int i = 0; i < per; ++i) {
            const int e = tid * per + i;
            if (e <= n_expert) {
                rsum += count[e];
                tsum += e < n_expert ? (count[e] + tile - 1) / tile : 0;
            }
        }
        int rinc = rsum, tinc = tsum;
#pragma unroll
        for (int o = 1; o < WARP_SIZE; o <<= 1) {
            const int a = __shfl_up_sync(FULL_MASK, rinc, o);
            const int b = __shfl_up_sync(FULL_MASK, tinc, o);
            if (tid >= o) {
                rinc += a;
                tinc += b;
            }
        }
        int r = rinc - rsum, t = tinc - tsum;
        for (int i = 0; i < per; ++i) {
            const int e = tid * per + i;
            if (e <= n_expert) {
                start[e] = r;
                tile0[e] = t;
                r += count[e];
                t += e < n_expert ? (count[e] + tile - 1) / tile : 0;
            }
        }
        if (tid == WARP_SIZE - 1) {
            n_tiles = tinc;
        }
    }
    __syncthreads();
    for (int s = tid; s < n_slots; s += blockDim.x) {
        int e = ids[s];
        if (e < 0 || e >= n_expert) {
            e = n_expert;
        }
        const int r = start[e] + slot_row[s];
        slot_row[s] = r;
        rows[r] = s / k;
    }
    for (int e = tid; e < n_expert; e += blockDim.x) {
        const int nt = (count[e] + tile - 1) / tile;
        for (int i = 0; i < nt; ++i) {
            int32_t * te = tiles + 3 * (tile0[e] + i);
            te[0] = e;
            te[1] = start[e] + i * tile;
            te[2] = min(tile, count[e] - i * tile);
        }
    }
    for (int i = n_tiles + tid; i < max_tiles; i += blockDim.x) {
        tiles[3 * i] = -1;
        tiles[3 * i + 1] = 0;
        tiles[3 * i + 2] = 0;
    }
}

// dst[r] = src[rows[r]] for rows of `words` 32-bit words (a row of q8_1 blocks is 9 words a block): a
// prompt's tokens quantized once, then put in expert order, instead of gathering the f32 rows (4.5x the
// bytes) and quantizing every (token, expert) row. Grid (n_rows); block 256.
extern "C" __global__ void gather_rows_words(const int32_t * __restrict__ src, const int32_t * __restrict__ rows,
                                             int32_t * __restrict__ dst, int words) {
    launch_prologue();
    const int64_t r = blockIdx.x;
    const int64_t from = rows[r];
    for (int i = threadIdx.x; i < words; i += blockDim.x) {
        dst[r * words + i] = src[from * words + i];
    }
}
