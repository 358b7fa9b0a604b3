// Quantized matrix x matrix for prompt batches on the int8 tensor cores for Q4_K, Q5_K, Q6_K and Q8_0: the
// kernels are in mmq.cuh (put in front of this file by the Rust side; its header comment tells how they
// work); this file has the formats, Q4_K/Q5_K's prefetching stage and the entry points, and the grouping of
// a prompt's slots by expert on the card.

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
    static constexpr bool offset = true;
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
    static constexpr bool offset = true;
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
    static constexpr bool offset = false;
    typedef block_q8_0 block;
    static __device__ __forceinline__ int quants(const block * b, int, int i) {
        return get_int_b2(b->qs, i);
    }
    static __device__ __forceinline__ float2 scale(const block * b, int) {
        return make_float2(f16_to_f32(b->d), 0.0f);
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

template <> struct a_stage_of<mmq_q4_K> { typedef a_stage_k4<false> type; };
template <> struct a_stage_of<mmq_q5_K> { typedef a_stage_k4<true> type; };


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
