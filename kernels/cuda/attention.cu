// Causal grouped-query attention over an f16 KV cache, for one token (decode) and for a prompt batch, with
// the context split into chunks (split-K) so a long context keeps every SM busy; the CPU op it replaces is
// kernels/src/ops/attention.rs (`attention`).
//
// Layouts (as the CPU op): q [n_q, n_head*dk] f32; k [n_kv, n_head_kv*dk] and v [n_kv, n_head_kv*dv] f16
// bits (row j = position j); positions [n_q] i32 in device memory (a captured graph replays at new
// positions); out [n_q, n_head*dv] f32. Query i at position p sees keys j with first <= j <= p, first =
// p + 1 - window (0 without a window). Scores s = scale * q.k, then cap*tanh(s/cap) with a softcap.
//
// Work split: a thread block serves one KV head and a tile of "rows", a row being a (query, head) pair of
// that KV head's group (row r = query r / group, head hk*group + r % group), so a decode step's heads of
// one group share each key and value read. Each warp owns ATT_ROWS_PER_WARP rows. Keys come in tiles of 32:
// the block stages the tile's keys and values (f16) in shared memory, lane j of a warp scores key j for
// each of its rows, the warp updates its rows' running maximum and sum (online softmax, f32) and every lane
// accumulates dv/32 of the output dimensions. blockIdx.z is the split: it covers keys [z*chunk,
// (z+1)*chunk). With one split the block writes the normalized output; with several it writes
// (max, sum, unnormalized accumulator) per row and split, which `attn_reduce` merges.

#define ATT_ROWS_PER_WARP 4
#define ATT_KEYS 32
#define ATT_MAX_D 256
#define ATT_D_PER_LANE (ATT_MAX_D / WARP_SIZE)

struct AttnArgs {
    int n_q, n_kv, n_head, n_head_kv, dk, dv;
    int k_stride_row; // padded f16 row of the staged keys (odd number of 32-bit words: no bank conflicts)
    float scale, softcap;  // softcap 0: none
    int window;            // 0: none
    int chunk;             // keys per split (a multiple of ATT_KEYS)
    int n_split;
};

extern "C" __global__ void attn_f16(const float * __restrict__ q, const int32_t * __restrict__ positions,
                                    const uint16_t * __restrict__ k, const uint16_t * __restrict__ v,
                                    float * __restrict__ out, float * __restrict__ partial, AttnArgs a) {
    launch_prologue();
    extern __shared__ float smem[];
    const int warps = blockDim.y;
    const int rows_per_block = warps * ATT_ROWS_PER_WARP;
    const int group = a.n_head / a.n_head_kv;
    const int n_rows = a.n_q * group;
    const int hk = blockIdx.y;
    const int row0 = blockIdx.x * rows_per_block;
    const int lane = threadIdx.x;
    const int warp = threadIdx.y;
    const int tid = warp * WARP_SIZE + lane;
    const int n_threads = warps * WARP_SIZE;

    float * qs = smem;                                               // [rows_per_block][dk]
    uint16_t * ks = (uint16_t *) (qs + rows_per_block * a.dk);       // [ATT_KEYS][k_stride_row]
    uint16_t * vs = ks + ATT_KEYS * a.k_stride_row;                  // [ATT_KEYS][dv]

    // Stage the rows' queries; rows past the last are zeros (never written out).
    for (int idx = tid; idx < rows_per_block * a.dk; idx += n_threads) {
        const int r = idx / a.dk, d = idx % a.dk;
        const int row = row0 + r;
        float val = 0.0f;
        if (row < n_rows) {
            const int qi = row / group, h = hk * group + row % group;
            val = q[((int64_t) qi * a.n_head + h) * a.dk + d];
        }
        qs[idx] = val;
    }

    // The key range this block covers: the union of its rows' visible ranges, cut to its split.
    int my_first[ATT_ROWS_PER_WARP], my_last[ATT_ROWS_PER_WARP];
    int lo = 0x7fffffff, hi = -1;
    for (int r = 0; r < rows_per_block; ++r) {
        const int row = row0 + r;
        if (row >= n_rows) {
            break;
        }
        const int p = positions[row / group];
        const int first = a.window > 0 ? max(0, p + 1 - a.window) : 0;
        lo = min(lo, first);
        hi = max(hi, p);
        if (r / ATT_ROWS_PER_WARP == warp) {
            my_first[r % ATT_ROWS_PER_WARP] = first;
            my_last[r % ATT_ROWS_PER_WARP] = p;
        }
    }
#pragma unroll
    for (int rr = 0; rr < ATT_ROWS_PER_WARP; ++rr) {
        if (row0 + warp * ATT_ROWS_PER_WARP + rr >= n_rows) {
            my_first[rr] = 1;
            my_last[rr] = 0; // sees nothing
        }
    }
    const int split_lo = blockIdx.z * a.chunk;
    const int split_hi = split_lo + a.chunk - 1;
    lo = max(lo, split_lo);
    hi = min(min(hi, split_hi), a.n_kv - 1); // positions past the cache read nothing
    lo = lo / ATT_KEYS * ATT_KEYS; // tiles aligned to ATT_KEYS

    float m[ATT_ROWS_PER_WARP], l[ATT_ROWS_PER_WARP], acc[ATT_ROWS_PER_WARP][ATT_D_PER_LANE];
#pragma unroll
    for (int rr = 0; rr < ATT_ROWS_PER_WARP; ++rr) {
        m[rr] = -POLY_INF;
        l[rr] = 0.0f;
#pragma unroll
        for (int t = 0; t < ATT_D_PER_LANE; ++t) {
            acc[rr][t] = 0.0f;
        }
    }
    const int64_t k_row = (int64_t) a.n_head_kv * a.dk;
    const int64_t v_row = (int64_t) a.n_head_kv * a.dv;

    for (int j0 = lo; j0 <= hi; j0 += ATT_KEYS) {
        __syncthreads(); // the previous tile is no longer read (and the queries are staged)
        for (int idx = tid; idx < ATT_KEYS * a.dk; idx += n_threads) {
            const int j = idx / a.dk, d = idx % a.dk;
            ks[j * a.k_stride_row + d] = j0 + j <= hi ? k[(j0 + j) * k_row + (int64_t) hk * a.dk + d] : 0;
        }
        for (int idx = tid; idx < ATT_KEYS * a.dv; idx += n_threads) {
            const int j = idx / a.dv, d = idx % a.dv;
            vs[idx] = j0 + j <= hi ? v[(j0 + j) * v_row + (int64_t) hk * a.dv + d] : 0;
        }
        __syncthreads();
        const int key = j0 + lane;
#pragma unroll
        for (int rr = 0; rr < ATT_ROWS_PER_WARP; ++rr) {
            const bool visible = key >= my_first[rr] && key <= my_last[rr] && key >= split_lo && key <= split_hi;
            if (__all_sync(FULL_MASK, !visible)) {
                continue;
            }
            const float * qr = qs + (warp * ATT_ROWS_PER_WARP + rr) * a.dk;
            const uint16_t * kr = ks + lane * a.k_stride_row;
            float s = 0.0f;
            for (int d = 0; d < a.dk; ++d) {
                s = fmaf(qr[d], f16_to_f32(kr[d]), s);
            }
            s *= a.scale;
            if (a.softcap != 0.0f) {
                s = a.softcap * tanhf(s / a.softcap);
            }
            s = visible ? s : -POLY_INF;
            const float new_m = fmaxf(m[rr], warp_max(s));
            const float keep = expf(m[rr] - new_m); // 0 while m is -inf
            const float pj = visible ? expf(s - new_m) : 0.0f;
            l[rr] = l[rr] * keep + warp_sum(pj);
            m[rr] = new_m;
#pragma unroll
            for (int t = 0; t < ATT_D_PER_LANE; ++t) {
                acc[rr][t] *= keep;
            }
            for (int j = 0; j < ATT_KEYS; ++j) {
                const float pk = __shfl_sync(FULL_MASK, pj, j);
                if (pk == 0.0f) {
                    continue;
                }
                const uint16_t * vr = vs + j * a.dv;
#pragma unroll
                for (int t = 0; t < ATT_D_PER_LANE; ++t) {
                    const int d = lane + t * WARP_SIZE;
                    if (d < a.dv) {
                        acc[rr][t] = fmaf(pk, f16_to_f32(vr[d]), acc[rr][t]);
                    }
                }
            }
        }
    }

#pragma unroll
    for (int rr = 0; rr < ATT_ROWS_PER_WARP; ++rr) {
        const int row = row0 + warp * ATT_ROWS_PER_WARP + rr;
        if (row >= n_rows) {
            continue;
        }
        const int qi = row / group, h = hk * group + row % group;
        const int64_t o = (int64_t) qi * a.n_head + h; // (query, head) index
        if (a.n_split == 1) {
            const float inv = l[rr] > 0.0f ? 1.0f / l[rr] : 0.0f;
#pragma unroll
            for (int t = 0; t < ATT_D_PER_LANE; ++t) {
                const int d = lane + t * WARP_SIZE;
                if (d < a.dv) {
                    out[o * a.dv + d] = acc[rr][t] * inv;
                }
            }
        } else {
            // partial: [n_split][n_q*n_head][dv + 2]: accumulator, then max and sum.
            float * pr = partial + ((int64_t) blockIdx.z * a.n_q * a.n_head + o) * (a.dv + 2);
#pragma unroll
            for (int t = 0; t < ATT_D_PER_LANE; ++t) {
                const int d = lane + t * WARP_SIZE;
                if (d < a.dv) {
                    pr[d] = acc[rr][t];
                }
            }
            if (lane == 0) {
                pr[a.dv] = m[rr];
                pr[a.dv + 1] = l[rr];
            }
        }
    }
}

// Merges the splits of attn_f16: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s. Grid: n_q*n_head
// blocks; block: 128 threads over the dv dimensions.
extern "C" __global__ void attn_reduce(const float * __restrict__ partial, float * __restrict__ out, int n_rows,
                                       int dv, int n_split) {
    launch_prologue();
    const int64_t o = blockIdx.x;
    float big = -POLY_INF;
    for (int s = 0; s < n_split; ++s) {
        big = fmaxf(big, partial[((int64_t) s * n_rows + o) * (dv + 2) + dv]);
    }
    for (int d = threadIdx.x; d < dv; d += blockDim.x) {
        float num = 0.0f, den = 0.0f;
        for (int s = 0; s < n_split; ++s) {
            const float * pr = partial + ((int64_t) s * n_rows + o) * (dv + 2);
            if (pr[dv] == -POLY_INF) {
                continue; // the split saw no key of this row
            }
            const float w = expf(pr[dv] - big);
            num = fmaf(w, pr[d], num);
            den = fmaf(w, pr[dv + 1], den);
        }
        out[o * dv + d] = den > 0.0f ? num / den : 0.0f;
    }
}

// ----- one-token attention (flash decoding) -----------------------------------------------------------------
// attn_decode_f16: the query of one token over a KV cache, for head dims d of 32, 64, 128, 256 (dk = dv) and
// GQA groups of up to ATD_MAX_G heads. Grid: (n_split, n_head_kv, group blocks); block: ATD_THREADS threads.
// The block of split x serves the query heads of KV head blockIdx.y that are its part of the group (all of
// them for attn_decode_f16, G of them for the _gG entry points below; each K and V row is read once for a
// block's heads) over the x-th of n_split equal parts of the keys the token sees. The parts are cut from the real
// position read on the card, not from the launch's cache rows, so a graph captured for a bucket of rows
// spends its blocks on the keys that exist and reads nothing past the position.
//
// Inside a block, d/8 consecutive threads hold one key: each loads 16 bytes (8 f16) of the key row and of
// the value row, scores its 8 dimensions against every head of the block (queries in registers), and the
// key's threads sum the scores with shuffles. The block's ATD_THREADS/(d/8) key slots walk the keys
// ATD_UNROLL at a time (all loads of a step issued before any arithmetic), each slot keeping its own
// running maximum, sum and accumulator (online softmax, f32); the slots merge through shared memory at the
// end. One split writes the normalized output; several write (accumulator, max, sum) per head, merged by
// attn_decode_reduce.

#define ATD_THREADS 128
#define ATD_MAX_G 8
#define ATD_UNROLL 4
#define ATD_MAX_SPLIT 256

struct AttnDecodeArgs {
    int n_kv;            // cache rows the launch may read
    int n_head, n_head_kv, d;
    float scale, softcap; // softcap 0: none
    int window;           // 0: none
    int n_split;
};

// 8 f16 (a 16-byte load) -> 8 f32.
static __device__ __forceinline__ void f16x8_to_f32(const uint4 u, float f[8]) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = f16_to_f32((uint16_t) (w[i] & 0xffff));
        f[2 * i + 1] = f16_to_f32((uint16_t) (w[i] >> 16));
    }
}

// 8 f32 (32-byte aligned) -> 8 f16 (rounded to nearest even), packed for a 16-byte store.
static __device__ __forceinline__ uint4 f32x8_to_f16(const float * f) {
    const float4 a = ((const float4 *) f)[0], b = ((const float4 *) f)[1];
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        w[i] = (uint32_t) f32_to_f16(v[2 * i]) | ((uint32_t) f32_to_f16(v[2 * i + 1]) << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// The body of the entry points below (each begins with launch_prologue): G heads of a GQA group a block.
template <int G>
static __device__ __forceinline__ void
    attn_decode_heads(const float * __restrict__ q, const int32_t * __restrict__ positions, uint16_t * __restrict__ k,
                      uint16_t * __restrict__ v, const float * __restrict__ k_new, const float * __restrict__ v_new,
                      float * __restrict__ out, float * __restrict__ partial, const AttnDecodeArgs a) {
    __shared__ float acc_s[ATD_THREADS * 8 * G]; // [slot][h][d]: KPS * d = 8 * ATD_THREADS
    __shared__ float ml_s[32 * G][2];            // [slot][h] (max, sum): d >= 32, so KPS <= 32
    const int tid = threadIdx.x;
    const int tpk = a.d / 8;            // threads per key
    const int kps = ATD_THREADS / tpk;  // key slots of the block
    const int slot = tid / tpk, sub = tid % tpk;
    const int group = a.n_head / a.n_head_kv;
    // This block's heads of the group: gh (at most G) from h0 (blockIdx.z's share; G divides the group
    // when the group is split, so gh < G only where one block takes a whole group smaller than G).
    const int h0 = blockIdx.z * G;
    const int gh = min(G, group - h0);
    const int hk = blockIdx.y, z = blockIdx.x;

    // The keys this split sees: its part of [first, last].
    const int p = positions[0];
    const int first = a.window > 0 ? max(0, p + 1 - a.window) : 0;
    const int last = min(p, a.n_kv - 1);
    const int n_vis = max(0, last - first + 1);
    const int chunk = (n_vis + a.n_split - 1) / a.n_split;
    const int lo = first + z * chunk;
    const int hi = min(lo + chunk, last + 1); // exclusive

    float qf[G][8];
#pragma unroll
    for (int h = 0; h < G; ++h) {
        // 8 consecutive floats (32-byte aligned: d and the offset are multiples of 8) as two 16-byte loads.
        float4 lo4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f), hi4 = lo4;
        if (h < gh) {
            const float4 * qh = (const float4 *) (q + (int64_t) (hk * group + h0 + h) * a.d + sub * 8);
            lo4 = qh[0];
            hi4 = qh[1];
        }
        qf[h][0] = lo4.x, qf[h][1] = lo4.y, qf[h][2] = lo4.z, qf[h][3] = lo4.w;
        qf[h][4] = hi4.x, qf[h][5] = hi4.y, qf[h][6] = hi4.z, qf[h][7] = hi4.w;
    }
    float m[G], l[G], acc[G][8];
#pragma unroll
    for (int h = 0; h < G; ++h) {
        m[h] = -POLY_INF;
        l[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            acc[h][i] = 0.0f;
        }
    }
    const int64_t row = (int64_t) a.n_head_kv * a.d; // f16 per cache row (k and v alike: dk = dv)
    uint16_t * kh = k + (int64_t) hk * a.d + sub * 8;
    uint16_t * vh = v + (int64_t) hk * a.d + sub * 8;
    // With k_new/v_new (f32 [n_head_kv * d], the token's own key and value) the block whose part holds the
    // position stores them into the cache row (as f16, as kv_store_f16_pos) and uses them from registers.
    const float * kn = k_new ? k_new + (int64_t) hk * a.d + sub * 8 : nullptr;
    const float * vn = v_new ? v_new + (int64_t) hk * a.d + sub * 8 : nullptr;

    // The loop is the same for every thread (shuffles inside); keys past hi are masked.
    for (int base = lo; base < hi; base += kps * ATD_UNROLL) {
        uint4 kk[ATD_UNROLL], vv[ATD_UNROLL];
#pragma unroll
        for (int u = 0; u < ATD_UNROLL; ++u) {
            const int j = base + u * kps + slot;
            if (kn != nullptr && j == p && j < hi) {
                kk[u] = f32x8_to_f16(kn);
                vv[u] = f32x8_to_f16(vn);
                // One block of the group's stores the row (the others use the same values from registers
                // and never read that row from memory).
                if (blockIdx.z == 0) {
                    *(uint4 *) (kh + j * row) = kk[u];
                    *(uint4 *) (vh + j * row) = vv[u];
                }
            } else if (j < hi) {
                kk[u] = *(const uint4 *) (kh + j * row);
                vv[u] = *(const uint4 *) (vh + j * row);
            } else {
                kk[u] = make_uint4(0, 0, 0, 0);
                vv[u] = make_uint4(0, 0, 0, 0);
            }
        }
        float s[ATD_UNROLL][G];
#pragma unroll
        for (int u = 0; u < ATD_UNROLL; ++u) {
            float kf[8];
            f16x8_to_f32(kk[u], kf);
#pragma unroll
            for (int h = 0; h < G; ++h) {
                float d0 = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    d0 = fmaf(qf[h][i], kf[i], d0);
                }
                s[u][h] = d0;
            }
        }
        // Sum over the key's threads (aligned groups of tpk lanes).
        for (int off = tpk / 2; off > 0; off >>= 1) {
#pragma unroll
            for (int u = 0; u < ATD_UNROLL; ++u) {
#pragma unroll
                for (int h = 0; h < G; ++h) {
                    s[u][h] += __shfl_xor_sync(FULL_MASK, s[u][h], off);
                }
            }
        }
#pragma unroll
        for (int h = 0; h < G; ++h) {
            if (h >= gh) {
                continue;
            }
            float mx = m[h];
#pragma unroll
            for (int u = 0; u < ATD_UNROLL; ++u) {
                float sc = s[u][h] * a.scale;
                if (a.softcap != 0.0f) {
                    sc = a.softcap * tanhf(sc / a.softcap);
                }
                sc = base + u * kps + slot < hi ? sc : -POLY_INF;
                s[u][h] = sc;
                mx = fmaxf(mx, sc);
            }
            const float mx_safe = mx == -POLY_INF ? 0.0f : mx;
            // __expf (ex2.approx): arguments are <= 0 and the weights' relative error ~1e-6 is far below the
            // f16 rounding of the values they weigh.
            const float keep = __expf(m[h] - mx_safe);
            m[h] = mx;
            float lsum = l[h] * keep;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                acc[h][i] *= keep;
            }
#pragma unroll
            for (int u = 0; u < ATD_UNROLL; ++u) {
                const float pu = __expf(s[u][h] - mx_safe);
                lsum += pu;
                float vf[8];
                f16x8_to_f32(vv[u], vf);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    acc[h][i] = fmaf(pu, vf[i], acc[h][i]);
                }
            }
            l[h] = lsum;
        }
    }

    // Merge the key slots.
#pragma unroll
    for (int h = 0; h < G; ++h) {
        if (h < gh) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                acc_s[(slot * gh + h) * a.d + sub * 8 + i] = acc[h][i];
            }
            if (sub == 0) {
                ml_s[slot * gh + h][0] = m[h];
                ml_s[slot * gh + h][1] = l[h];
            }
        }
    }
    __syncthreads();
    // Per head: the largest slot maximum, each slot's weight (in place of its maximum) and the merged sum.
    __shared__ float big_s[G], den_s[G];
    if (tid < gh) {
        const int h = tid;
        float big = -POLY_INF;
        for (int sl = 0; sl < kps; ++sl) {
            big = fmaxf(big, ml_s[sl * gh + h][0]);
        }
        const float big_safe = big == -POLY_INF ? 0.0f : big;
        float den = 0.0f;
        for (int sl = 0; sl < kps; ++sl) {
            const float w = __expf(ml_s[sl * gh + h][0] - big_safe);
            ml_s[sl * gh + h][0] = w;
            den = fmaf(w, ml_s[sl * gh + h][1], den);
        }
        big_s[h] = big;
        den_s[h] = den;
    }
    __syncthreads();
    for (int idx = tid; idx < gh * a.d; idx += ATD_THREADS) {
        const int h = idx / a.d, dd = idx % a.d;
        const float big = big_s[h], den = den_s[h];
        float num = 0.0f;
        for (int sl = 0; sl < kps; ++sl) {
            num = fmaf(ml_s[sl * gh + h][0], acc_s[(sl * gh + h) * a.d + dd], num);
        }
        const int head = hk * group + h0 + h;
        if (a.n_split == 1) {
            out[(int64_t) head * a.d + dd] = den > 0.0f ? num / den : 0.0f;
        } else {
            // partial: accumulators [n_split][n_head][d], then (max, sum) [n_split][n_head][2].
            partial[((int64_t) z * a.n_head + head) * a.d + dd] = num;
            if (dd == 0) {
                float * ml = partial + (int64_t) a.n_split * a.n_head * a.d;
                ml[((int64_t) z * a.n_head + head) * 2] = big;
                ml[((int64_t) z * a.n_head + head) * 2 + 1] = den;
            }
        }
    }
}


// The entry points: G heads of a GQA group per block. attn_decode_f16 takes the whole group (up to
// ATD_MAX_G heads, grid z 1); the _g1/_g2/_g4 variants take 1, 2 or 4 of its heads (grid z group / G), so a
// token's attention runs as more, shorter blocks: a block's warps execute the group's dot products,
// shuffles and merge for its G heads only. Each head's arithmetic is the same in every variant (its
// scores, its online softmax over the same slots, its merge), so all give the same bits.
#define ATD_ENTRY(name, G)                                                                                      \
    extern "C" __global__ void __launch_bounds__(ATD_THREADS)                                                   \
        name(const float * __restrict__ q, const int32_t * __restrict__ positions, uint16_t * __restrict__ k,   \
             uint16_t * __restrict__ v, const float * __restrict__ k_new, const float * __restrict__ v_new,      \
             float * __restrict__ out, float * __restrict__ partial, AttnDecodeArgs a) {                        \
        launch_prologue();                                                                                      \
        attn_decode_heads<G>(q, positions, k, v, k_new, v_new, out, partial, a);                                \
    }

ATD_ENTRY(attn_decode_f16, ATD_MAX_G)
ATD_ENTRY(attn_decode_f16_g1, 1)
ATD_ENTRY(attn_decode_f16_g2, 2)
ATD_ENTRY(attn_decode_f16_g4, 4)

// Merges the splits of attn_decode_f16. Grid: (n_head, d/32); block: (32, 8): lane = dimension, the 8 warps
// stride over the splits and sum through shared memory. With out_q (d a multiple of 32, so each block's 32
// values are one q8_1 block) the output is also written quantized for the output projection, as
// quantize_q8_1 would quantize it (the same quantize_value), one launch fewer.
#define ATD_REDUCE_AHEAD 4

extern "C" __global__ void __launch_bounds__(256)
    attn_decode_reduce(const float * __restrict__ partial, float * __restrict__ out, block_q8_1 * __restrict__ out_q,
                       int n_head, int d, int n_split) {
    launch_prologue();
    __shared__ float w_s[ATD_MAX_SPLIT];
    __shared__ float num_s[8][33];
    __shared__ float red[32];
    const int head = blockIdx.x;
    const int lane = threadIdx.x, wy = threadIdx.y;
    const int tid = wy * WARP_SIZE + lane;
    const float * ml = partial + (int64_t) n_split * n_head * d;
    const int dd = blockIdx.y * WARP_SIZE + lane;
    // Every load this block needs, issued before the first reduction waits on any (one trip to memory
    // instead of three): this thread's split maximum and sum (n_split <= ATD_MAX_SPLIT = the block's
    // 256 threads: one split a thread at most) and its warp's first ATD_REDUCE_AHEAD splits' values.
    const bool has_split = tid < n_split;
    const float my_m = has_split ? ml[((int64_t) tid * n_head + head) * 2] : -POLY_INF;
    const float my_l = has_split ? ml[((int64_t) tid * n_head + head) * 2 + 1] : 0.0f;
    float ahead[ATD_REDUCE_AHEAD];
#pragma unroll
    for (int i = 0; i < ATD_REDUCE_AHEAD; ++i) {
        const int s = wy + 8 * i;
        ahead[i] = dd < d && s < n_split ? partial[((int64_t) s * n_head + head) * d + dd] : 0.0f;
    }
    float big = fmaxf(-POLY_INF, my_m); // as the loop over splits began: a NaN maximum is passed over
    // block_max and block_sum take a one-dimensional block: use the flat index through a local copy.
    {
        float v0 = warp_max(big);
        if (lane == 0) {
            red[wy] = v0;
        }
        __syncthreads();
        v0 = lane < 8 ? red[lane] : -POLY_INF;
        big = warp_max(v0);
        __syncthreads();
    }
    const float big_safe = big == -POLY_INF ? 0.0f : big;
    float den = 0.0f;
    if (has_split) {
        const float w = my_m == -POLY_INF ? 0.0f : __expf(my_m - big_safe);
        w_s[tid] = w;
        den = fmaf(w, my_l, den);
    }
    {
        float v0 = warp_sum(den);
        if (lane == 0) {
            red[wy] = v0;
        }
        __syncthreads();
        v0 = lane < 8 ? red[lane] : 0.0f;
        den = warp_sum(v0);
    }
    float num = 0.0f;
    if (dd < d) {
#pragma unroll
        for (int i = 0; i < ATD_REDUCE_AHEAD; ++i) {
            const int s = wy + 8 * i;
            if (s < n_split) {
                num = fmaf(w_s[s], ahead[i], num);
            }
        }
#pragma unroll 4
        for (int s = wy + 8 * ATD_REDUCE_AHEAD; s < n_split; s += 8) {
            num = fmaf(w_s[s], partial[((int64_t) s * n_head + head) * d + dd], num);
        }
    }
    num_s[wy][lane] = num;
    __syncthreads();
    if (wy == 0 && dd < d) {
        float t = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            t += num_s[i][lane];
        }
        const float o = den > 0.0f ? t / den : 0.0f;
        out[(int64_t) head * d + dd] = o;
        // out_q comes only with d a multiple of 32: the whole warp is here.
        if (out_q) {
            quantize_value(o, out_q, (int64_t) head * d + dd);
        }
    }
}
