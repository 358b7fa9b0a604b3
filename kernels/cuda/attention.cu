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
