// Causal grouped-query attention of a prompt batch over an f16 KV cache on the f16 tensor cores (mma.sync
// m16n8k16, f32 accumulation): flash-attention style, the same arithmetic as attention.cu's attn_f16 (scores
// in f32, scale, optional softcap, online softmax in f32) except that the queries and the softmax weights
// are rounded to f16 for the products (as llama.cpp's flash attention does).
//
// Layouts as attn_f16: q [n_q, n_head*D] f32; k, v [n_kv, n_head_kv*D] f16 bits; positions [n_q]; out
// [n_q, n_head*D] f32. Rows are (query, head) pairs of one KV head's group (row r = query r / group, head
// hk*group + r % group). A block: one KV head, FA_ROWS rows (FA_WARPS warps of 16); per tile of KT keys it
// stages the keys (row-major) and the values (transposed) in shared memory, each warp computes its 16 x KT
// scores (mma), masks them (causal, window), updates its rows' running max and sum, rounds the weights to
// f16 and adds weights x values (mma) into its 16 x D output in registers. Dynamic shared memory (the
// launcher raises the limit): Q, one K tile and one V tile.

#define FA_WARPS 4
#define FA_ROWS (16 * FA_WARPS)

struct FaArgs {
    int n_q, n_kv, n_head, n_head_kv;
    float scale, softcap; // softcap 0: none
    int window;           // 0: none
};

static __device__ __forceinline__ void mma_f16(const uint32_t (&a)[4], uint32_t b0, uint32_t b1, float (&c)[4]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
    return (uint32_t) f32_to_f16(lo) | ((uint32_t) f32_to_f16(hi) << 16);
}

// D: head dimension (keys and values); KT: keys per tile.
template <int D, int KT>
static __device__ __forceinline__ void attn_mma(const float * __restrict__ q, const int32_t * __restrict__ positions,
                                                const uint16_t * __restrict__ k, const uint16_t * __restrict__ v,
                                                float * __restrict__ out, FaArgs a) {
    // Strides in 32-bit words (pairs of f16): 4 mod 32 (or 20 for KT 32), so the fragment loads (8 rows x 4
    // words) hit 32 different banks.
    constexpr int QW = D / 2 + 4;
    constexpr int VW = KT / 2 + 4;
    extern __shared__ uint32_t fa_smem[];
    uint32_t * sq = fa_smem;                 // [FA_ROWS][QW]
    uint32_t * sk = sq + FA_ROWS * QW;       // [KT][QW]
    uint32_t * svt = sk + KT * QW;           // [D][VW]: values transposed
    __shared__ int range[2];

    const int group = a.n_head / a.n_head_kv;
    const int n_rows = a.n_q * group;
    const int hk = blockIdx.y;
    const int row0 = blockIdx.x * FA_ROWS;
    const int lane = threadIdx.x, warp = threadIdx.y;
    const int tid = warp * WARP_SIZE + lane;
    constexpr int threads = FA_WARPS * WARP_SIZE;
    const int g = lane / 4, t = lane % 4;

    if (tid == 0) {
        range[0] = 0x7fffffff;
        range[1] = -1;
    }
    // Queries as f16 pairs; rows past the last are zeros.
    for (int idx = tid; idx < FA_ROWS * (D / 2); idx += threads) {
        const int r = idx / (D / 2), w = idx % (D / 2);
        const int row = row0 + r;
        float2 val = make_float2(0.0f, 0.0f);
        if (row < n_rows) {
            const int qi = row / group, h = hk * group + row % group;
            val = *(const float2 *) (q + ((int64_t) qi * a.n_head + h) * D + 2 * w);
        }
        sq[r * QW + w] = pack_f16(val.x, val.y);
    }
    __syncthreads();
    // The keys any row of the block sees.
    if (tid < FA_ROWS && row0 + tid < n_rows) {
        const int p = positions[(row0 + tid) / group];
        const int first = a.window > 0 ? max(0, p + 1 - a.window) : 0;
        atomicMin(&range[0], first);
        atomicMax(&range[1], min(p, a.n_kv - 1));
    }
    // This thread's two rows (g and g + 8 of its warp): visible keys first..last (none past the rows).
    int first[2], last[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row0 + 16 * warp + g + 8 * h;
        if (row < n_rows) {
            last[h] = positions[row / group];
            first[h] = a.window > 0 ? max(0, last[h] + 1 - a.window) : 0;
        } else {
            first[h] = 1;
            last[h] = 0;
        }
    }
    __syncthreads();
    const int lo = range[0] / KT * KT, hi = range[1];

    float o[D / 8][4];
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            o[nd][i] = 0.0f;
        }
    }
    float m[2] = {-POLY_INF, -POLY_INF};
    float l[2] = {0.0f, 0.0f}; // this thread's share of each row's sum
    const int64_t kv_row_w = (int64_t) a.n_head_kv * (D / 2); // words per cache row
    const uint32_t * k32 = (const uint32_t *) k + (int64_t) hk * (D / 2);
    const uint32_t * v32 = (const uint32_t *) v + (int64_t) hk * (D / 2);
    const uint32_t * qa = sq + (16 * warp + g) * QW;

    for (int j0 = lo; j0 <= hi; j0 += KT) {
        __syncthreads(); // the previous tile is no longer read
        for (int idx = tid; idx < KT * (D / 2); idx += threads) {
            const int j = idx / (D / 2), w = idx % (D / 2);
            sk[j * QW + w] = j0 + j <= hi ? k32[(int64_t) (j0 + j) * kv_row_w + w] : 0u;
        }
        // Two keys x two dimensions per thread: value pairs (d, d+1) of keys j, j+1 become the pairs (j, j+1)
        // of dimensions d and d+1.
        for (int idx = tid; idx < (KT / 2) * (D / 2); idx += threads) {
            const int jp = idx / (D / 2), w = idx % (D / 2);
            const int j = j0 + 2 * jp;
            const uint32_t w0 = j <= hi ? v32[(int64_t) j * kv_row_w + w] : 0u;
            const uint32_t w1 = j + 1 <= hi ? v32[(int64_t) (j + 1) * kv_row_w + w] : 0u;
            svt[(2 * w) * VW + jp] = __byte_perm(w0, w1, 0x5410);
            svt[(2 * w + 1) * VW + jp] = __byte_perm(w0, w1, 0x7632);
        }
        __syncthreads();

        // Scores of this warp's 16 rows with the KT keys.
        float s[KT / 8][4];
#pragma unroll
        for (int nt = 0; nt < KT / 8; ++nt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                s[nt][i] = 0.0f;
            }
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const uint32_t af[4] = {qa[8 * kk + t], qa[8 * QW + 8 * kk + t], qa[8 * kk + 4 + t],
                                    qa[8 * QW + 8 * kk + 4 + t]};
#pragma unroll
            for (int nt = 0; nt < KT / 8; ++nt) {
                const uint32_t * kb = sk + (8 * nt + g) * QW + 8 * kk;
                mma_f16(af, kb[t], kb[4 + t], s[nt]);
            }
        }
        // Scale, softcap, mask; the rows' new maxima.
        float mx[2] = {-POLY_INF, -POLY_INF};
#pragma unroll
        for (int nt = 0; nt < KT / 8; ++nt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int h = i >> 1;
                const int key = j0 + 8 * nt + 2 * t + (i & 1);
                float x = s[nt][i] * a.scale;
                if (a.softcap != 0.0f) {
                    x = a.softcap * tanhf(x / a.softcap);
                }
                x = key >= first[h] && key <= last[h] ? x : -POLY_INF;
                s[nt][i] = x;
                mx[h] = fmaxf(mx[h], x);
            }
        }
        float keep[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(FULL_MASK, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(FULL_MASK, mx[h], 2));
            const float new_m = fmaxf(m[h], mx[h]);
            // Nothing visible yet: keep the (zero) sums, weights 0.
            keep[h] = new_m == -POLY_INF ? 1.0f : expf(m[h] - new_m);
            m[h] = new_m;
            l[h] *= keep[h];
        }
#pragma unroll
        for (int nd = 0; nd < D / 8; ++nd) {
            o[nd][0] *= keep[0];
            o[nd][1] *= keep[0];
            o[nd][2] *= keep[1];
            o[nd][3] *= keep[1];
        }
#pragma unroll
        for (int nt = 0; nt < KT / 8; ++nt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int h = i >> 1;
                const float p = s[nt][i] == -POLY_INF ? 0.0f : expf(s[nt][i] - m[h]);
                s[nt][i] = p;
                l[h] += p;
            }
        }
        // Weights (f16) x values.
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) {
            const uint32_t pf[4] = {pack_f16(s[2 * kk][0], s[2 * kk][1]), pack_f16(s[2 * kk][2], s[2 * kk][3]),
                                    pack_f16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    pack_f16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int nd = 0; nd < D / 8; ++nd) {
                const uint32_t * vb = svt + (8 * nd + g) * VW + 8 * kk;
                mma_f16(pf, vb[t], vb[4 + t], o[nd]);
            }
        }
    }

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(FULL_MASK, l[h], 1);
        l[h] += __shfl_xor_sync(FULL_MASK, l[h], 2);
        const int row = row0 + 16 * warp + g + 8 * h;
        if (row >= n_rows) {
            continue;
        }
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        const int qi = row / group, hq = hk * group + row % group;
        float * orow = out + ((int64_t) qi * a.n_head + hq) * D;
#pragma unroll
        for (int nd = 0; nd < D / 8; ++nd) {
            *(float2 *) (orow + 8 * nd + 2 * t) = make_float2(o[nd][2 * h] * inv, o[nd][2 * h + 1] * inv);
        }
    }
}

#define FA_ENTRY_POINT(D, KT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * FA_WARPS)                                         \
        attn_mma_##D(const float * __restrict__ q, const int32_t * __restrict__ positions,                     \
                     const uint16_t * __restrict__ k, const uint16_t * __restrict__ v, float * __restrict__ out, \
                     FaArgs a) { launch_prologue();                                                            \
        attn_mma<D, KT>(q, positions, k, v, out, a);                                                           \
    }

FA_ENTRY_POINT(64, 64)
FA_ENTRY_POINT(128, 64)
FA_ENTRY_POINT(256, 32)
