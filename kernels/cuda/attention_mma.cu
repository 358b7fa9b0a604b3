// Causal grouped-query attention of a prompt batch over an f16 KV cache on the f16 tensor cores (mma.sync
// m16n8k16, f32 accumulation): flash-attention style, the same arithmetic as attention.cu's attn_f16 (scores
// in f32, scale, optional softcap, online softmax in f32) except that the queries and the softmax weights
// are rounded to f16 for the products (as llama.cpp's flash attention does) and the exponentials are taken
// base 2 of the scores times log2(e).
//
// Layouts as attn_f16: q [n_q, n_head*D] f32; k, v [n_kv, n_head_kv*D] f16 bits; positions [n_q]; out
// [n_q, n_head*D] f32. Rows are (query, head) pairs of one KV head's group (row r = query r / group, head
// hk*group + r % group). A block: one KV head, FA_ROWS rows (FA_WARPS warps of 16). Its KT-key tiles of keys
// and values are copied to shared memory by cp.async, two tiles in flight (the next copies while this one
// is used), both row-major as the cache holds them; each warp computes its 16 x KT scores (mma, the keys'
// fragments by ldmatrix), masks them (causal, window), updates its rows' running max and sum, rounds the
// weights to f16 and adds weights x values (mma, the values' fragments by ldmatrix.trans) into its 16 x D
// output in registers. Dynamic shared memory (the launcher raises the limit): the queries and two tiles of
// keys and of values, rows padded by 16 bytes so that ldmatrix's eight rows fall in distinct banks.

#define FA_WARPS 4
#define FA_ROWS (16 * FA_WARPS)
#define FA_LOG2E 1.4426950408889634f

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

// A shared-memory address as the 32-bit offset ldmatrix and cp.async take.
static __device__ __forceinline__ uint32_t shared_addr(const void * p) {
    uint32_t r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// Four 8x8 matrices of f16: lanes 8m..8m+7 name the rows of matrix m; register m of lane l holds row l/4,
// columns 2(l%4) and 2(l%4)+1 of matrix m (with .trans: column l/4, rows 2(l%4) and 2(l%4)+1).
static __device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

static __device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// 16 bytes from global to shared memory without passing through registers; zeros where `ok` is false (the
// source is then not read).
static __device__ __forceinline__ void cp_async_16(uint32_t dst, const void * src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}

static __device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// Until at most N of this thread's committed groups are still in flight.
template <int N> static __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// D: head dimension (keys and values); KT: keys per tile.
template <int D, int KT>
static __device__ __forceinline__ void attn_mma(const float * __restrict__ q, const int32_t * __restrict__ positions,
                                                const uint16_t * __restrict__ k, const uint16_t * __restrict__ v,
                                                float * __restrict__ out, FaArgs a) {
    constexpr int RS = D + 8;  // f16 values per staged row: 16 bytes of padding
    constexpr int CH = D / 8;  // 16-byte pieces of a row
    constexpr bool Q_IN_REGISTERS = D <= 128;
    extern __shared__ __align__(16) uint16_t fa_smem[];
    uint16_t * sq = fa_smem;          // [FA_ROWS][RS]
    uint16_t * sk = sq + FA_ROWS * RS; // [2][KT][RS]
    uint16_t * sv = sk + 2 * KT * RS;  // [2][KT][RS]

    const int group = a.n_head / a.n_head_kv;
    const int n_rows = a.n_q * group;
    const int hk = blockIdx.y;
    // The longest blocks (the last rows see the most keys) first, so that the short ones fill the tail.
    const int row0 = (gridDim.x - 1 - blockIdx.x) * FA_ROWS;
    const int lane = threadIdx.x, warp = threadIdx.y;
    const int tid = warp * WARP_SIZE + lane;
    constexpr int threads = FA_WARPS * WARP_SIZE;
    const int g = lane / 4, t = lane % 4;

    // Queries as f16; rows past the last are zeros.
    for (int idx = tid; idx < FA_ROWS * (D / 4); idx += threads) {
        const int r = idx / (D / 4), c = idx % (D / 4);
        const int row = row0 + r;
        float4 val = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (row < n_rows) {
            const int qi = row / group, h = hk * group + row % group;
            val = *(const float4 *) (q + ((int64_t) qi * a.n_head + h) * D + 4 * c);
        }
        *(uint2 *) (sq + r * RS + 4 * c) = make_uint2(pack_f16(val.x, val.y), pack_f16(val.z, val.w));
    }
    // The keys any row of the block sees (every warp finds the same): lo..hi.
    int lo = 0x7fffffff, hi = -1;
#pragma unroll
    for (int i = 0; i < FA_ROWS / WARP_SIZE; ++i) {
        const int row = row0 + lane + WARP_SIZE * i;
        if (row < n_rows) {
            const int p = positions[row / group];
            lo = min(lo, a.window > 0 ? max(0, p + 1 - a.window) : 0);
            hi = max(hi, min(p, a.n_kv - 1));
        }
    }
#pragma unroll
    for (int off = WARP_SIZE / 2; off > 0; off /= 2) {
        lo = min(lo, __shfl_xor_sync(FULL_MASK, lo, off));
        hi = max(hi, __shfl_xor_sync(FULL_MASK, hi, off));
    }
    lo = lo / KT * KT;
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
    const int all_first = max(first[0], first[1]), all_last = min(last[0], last[1]);

    // Tile j0's keys and values (rows past hi as zeros: never read, so a cache's unwritten rows, whatever
    // they hold, cannot make a NaN of a zero weight) into buffer b, as one cp.async group.
    const int64_t kv_row = (int64_t) a.n_head_kv * D; // f16 values per cache row
    const uint16_t * kh = k + (int64_t) hk * D;
    const uint16_t * vh = v + (int64_t) hk * D;
    const uint32_t sk_at = shared_addr(sk), sv_at = shared_addr(sv);
    auto load_tile = [&](int j0, int b) {
        for (int idx = tid; idx < KT * CH; idx += threads) {
            const int j = idx / CH, c = idx % CH;
            const bool ok = j0 + j <= hi;
            const int64_t from = (int64_t) (ok ? j0 + j : 0) * kv_row + 8 * c;
            const uint32_t to = 2 * ((b * KT + j) * RS + 8 * c);
            cp_async_16(sk_at + to, kh + from, ok);
            cp_async_16(sv_at + to, vh + from, ok);
        }
        cp_async_commit();
    };
    load_tile(lo, 0);
    __syncthreads(); // the queries are staged

    // ldmatrix's row of this lane: the A operand's (query rows l%16, columns 8(l/16)), the keys' (key
    // 8(l/16) + l%8, dimensions 8((l/8)%2)), the values' (key 8((l/8)%2) + l%8, dimensions 8(l/16)).
    const uint32_t q_at = shared_addr(sq + (16 * warp + lane % 16) * RS + 8 * (lane / 16));
    const uint32_t k_lane = 2 * ((8 * (lane / 16) + lane % 8) * RS + 8 * ((lane / 8) % 2));
    const uint32_t v_lane = 2 * ((8 * ((lane / 8) % 2) + lane % 8) * RS + 8 * (lane / 16));
    uint32_t qf[Q_IN_REGISTERS ? D / 16 : 1][4];
    if constexpr (Q_IN_REGISTERS) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            ldsm_x4(q_at + 2 * 16 * kk, qf[kk]);
        }
    }

    float o[D / 8][4];
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            o[nd][i] = 0.0f;
        }
    }
    float m[2] = {-POLY_INF, -POLY_INF}; // running maxima, times log2(e)
    float l[2] = {0.0f, 0.0f};           // this thread's share of each row's sum

    int b = 0;
    for (int j0 = lo; j0 <= hi; j0 += KT, b ^= 1) {
        if (j0 + KT <= hi) {
            load_tile(j0 + KT, b ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads(); // tile j0 is in buffer b for every thread
        const uint32_t kb = sk_at + 2 * b * KT * RS + k_lane;
        const uint32_t vb = sv_at + 2 * b * KT * RS + v_lane;

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
            uint32_t af[4];
            if constexpr (Q_IN_REGISTERS) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    af[i] = qf[kk][i];
                }
            } else {
                ldsm_x4(q_at + 2 * 16 * kk, af);
            }
#pragma unroll
            for (int np = 0; np < KT / 16; ++np) {
                uint32_t bf[4];
                ldsm_x4(kb + 2 * (16 * np * RS + 16 * kk), bf);
                mma_f16(af, bf[0], bf[1], s[2 * np]);
                mma_f16(af, bf[2], bf[3], s[2 * np + 1]);
            }
        }
        // Scale (to base 2), softcap, mask; the rows' new maxima.
        const bool masked = j0 < all_first || j0 + KT - 1 > all_last;
        float mx[2] = {-POLY_INF, -POLY_INF};
#pragma unroll
        for (int nt = 0; nt < KT / 8; ++nt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int h = i >> 1;
                float x = s[nt][i] * a.scale;
                if (a.softcap != 0.0f) {
                    x = a.softcap * tanhf(x / a.softcap);
                }
                x *= FA_LOG2E;
                if (masked) {
                    const int key = j0 + 8 * nt + 2 * t + (i & 1);
                    x = key >= first[h] && key <= last[h] ? x : -POLY_INF;
                }
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
            keep[h] = new_m == -POLY_INF ? 1.0f : exp2f(m[h] - new_m);
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
                const float p = s[nt][i] == -POLY_INF ? 0.0f : exp2f(s[nt][i] - m[h]);
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
            for (int dp = 0; dp < D / 16; ++dp) {
                uint32_t bf[4];
                ldsm_x4_trans(vb + 2 * (16 * kk * RS + 16 * dp), bf);
                mma_f16(pf, bf[0], bf[1], o[2 * dp]);
                mma_f16(pf, bf[2], bf[3], o[2 * dp + 1]);
            }
        }
        __syncthreads(); // buffer b is no longer read: the next round's copies may fill it
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
