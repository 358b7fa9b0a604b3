// Quantized matrix x vector for one token (decode): y[r] = W[r,:] . x, W in a GGML block format, x already
// quantized to block_q8_1 (quantize.cu). Weights are dequantized in registers and multiplied with 8-bit
// integer dot products (dp4a), as ggml-cuda's mmvq does; the per-format dot products follow vecdotq.cuh.
//
// Work split: a thread block of (32, MATVEC_WARPS) threads computes MATVEC_WARPS / warps_per_row output rows,
// warps_per_row warps (1, 2 or 4: a launch argument the host picks so a short row, like the 768 columns of
// an expert's down projection, does not leave most threads idle) per row. The QI/VDR threads that share one
// weight block each take VDR ints of its quants (`iqs`), a row's threads stride over the row's blocks, then
// the row's warps reduce through shared memory. Entry points per format:
//   matvec_<fmt>          : one matrix, one vector.
//   matvec_many_<fmt>     : up to MATVEC_MANY_MAX matrices of one width times one vector (q, k, v).
//   matvec_experts_glu_<fmt>: gate and up experts of one token in one launch, writing silu(gate)*up.
//   matvec_experts_<fmt>  : several experts of one stacked tensor in one launch. Slot s of the launch
//                           (blockIdx.y) multiplies expert ids[s] (read from device memory, so a captured
//                           CUDA graph replays with new routing) with activation vector s*x_stride_blocks,
//                           writing y[s*nrows + row]. The expert's weights are found through a table of
//                           device addresses, one per expert: all experts in one allocation today, slots of
//                           the VRAM expert cache later. A null address or an id outside 0..n_expert
//                           writes 0 (the expert is computed elsewhere, e.g. on the CPU).

#define MATVEC_WARPS 4

// ----- per-format dot products of one weight block's share with the matching q8_1 blocks -----------------
// `qi`: ints of quants per weight block as the dot product counts them; `vdr`: ints one thread takes.

struct fmt_q8_0 {
    static constexpr int qk = 32, qi = 8, vdr = 2;
    typedef block_q8_0 block;
    static __device__ __forceinline__ float dot(const block * b, const block_q8_1 * y, int iqs) {
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < vdr; ++i) {
            sumi = __dp4a(get_int_b2(b->qs, iqs + i), get_int_b4(y->qs, iqs + i), sumi);
        }
        return f16_to_f32(b->d) * f16_to_f32(y->d) * (float) sumi;
    }
};

// Q4_0 .. Q5_1: 32 values per block; two threads per block, each taking 2 ints of nibbles (8 low, 8 high
// values). The offsets (-8, -16) and mins enter through the q8_1 block's sum s, split between the threads.
struct fmt_q4_0 {
    static constexpr int qk = 32, qi = 4, vdr = 2;
    typedef block_q4_0 block;
    static __device__ __forceinline__ float dot(const block * b, const block_q8_1 * y, int iqs) {
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < vdr; ++i) {
            const int v = get_int_b2(b->qs, iqs + i);
            sumi = __dp4a((v >> 0) & 0x0F0F0F0F, get_int_b4(y->qs, iqs + i), sumi);
            sumi = __dp4a((v >> 4) & 0x0F0F0F0F, get_int_b4(y->qs, iqs + i + qi), sumi);
        }
        return f16_to_f32(b->d) * ((float) sumi * f16_to_f32(y->d) - (float) (8 * vdr / qi) * f16_to_f32(y->s));
    }
};

struct fmt_q4_1 {
    static constexpr int qk = 32, qi = 4, vdr = 2;
    typedef block_q4_1 block;
    static __device__ __forceinline__ float dot(const block * b, const block_q8_1 * y, int iqs) {
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < vdr; ++i) {
            const int v = get_int_b4(b->qs, iqs + i);
            sumi = __dp4a((v >> 0) & 0x0F0F0F0F, get_int_b4(y->qs, iqs + i), sumi);
            sumi = __dp4a((v >> 4) & 0x0F0F0F0F, get_int_b4(y->qs, iqs + i + qi), sumi);
        }
        return (float) sumi * f16_to_f32(b->d) * f16_to_f32(y->d) +
               f16_to_f32(b->m) * f16_to_f32(y->s) / (float) (qi / vdr);
    }
};

// The fifth bits of 4 values (bits 0..3 of vh) moved to bit 4 of each byte, and of the 4 values 16 further
// (bits 16..19).
static __device__ __forceinline__ int q5_low_with_high(int vl, int vh) {
    int v = vl & 0x0F0F0F0F;
    v |= (vh << 4) & 0x00000010;
    v |= (vh << 11) & 0x00001000;
    v |= (vh << 18) & 0x00100000;
    v |= (vh << 25) & 0x10000000;
    return v;
}

static __device__ __forceinline__ int q5_high_with_high(int vl, int vh) {
    int v = (vl >> 4) & 0x0F0F0F0F;
    v |= (vh >> 12) & 0x00000010;
    v |= (vh >> 5) & 0x00001000;
    v |= (vh << 2) & 0x00100000;
    v |= (vh << 9) & 0x10000000;
    return v;
}

struct fmt_q5_0 {
    static constexpr int qk = 32, qi = 4, vdr = 2;
    typedef block_q5_0 block;
    static __device__ __forceinline__ float dot(const block * b, const block_q8_1 * y, int iqs) {
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < vdr; ++i) {
            const int vl = get_int_b2(b->qs, iqs + i);
            const int vh = get_int_b2(b->qh, 0) >> (4 * (iqs + i));
            sumi = __dp4a(q5_low_with_high(vl, vh), get_int_b4(y->qs, iqs + i), sumi);
            sumi = __dp4a(q5_high_with_high(vl, vh), get_int_b4(y->qs, iqs + i + qi), sumi);
        }
        return f16_to_f32(b->d) * ((float) sumi * f16_to_f32(y->d) - (float) (16 * vdr / qi) * f16_to_f32(y->s));
    }
};

struct fmt_q5_1 {
    static constexpr int qk = 32, qi = 4, vdr = 2;
    typedef block_q5_1 block;
    static __device__ __forceinline__ float dot(const block * b, const block_q8_1 * y, int iqs) {
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < vdr; ++i) {
            const int vl = get_int_b4(b->qs, iqs + i);
            const int vh = get_int_b4(b->qh, 0) >> (4 * (iqs + i));
            sumi = __dp4a(q5_low_with_high(vl, vh), get_int_b4(y->qs, iqs + i), sumi);
            sumi = __dp4a(q5_high_with_high(vl, vh), get_int_b4(y->qs, iqs + i + qi), sumi);
        }
        return (float) sumi * f16_to_f32(b->d) * f16_to_f32(y->d) +
               f16_to_f32(b->m) * f16_to_f32(y->s) / (float) (qi / vdr);
    }
};

// Q2_K: 16 threads per block, each one int of 2-bit quants (4 groups of 16 values, 4 q8_1 blocks apart).
struct fmt_q2_K {
    static constexpr int qk = QK_K, qi = 16, vdr = 1;
    typedef block_q2_K block;
    static __device__ __forceinline__ float dot(const block * b, const block_q8_1 * y, int iqs) {
        const int bq8_offset = 4 * (iqs / 8);
        const int scale_offset = iqs - iqs % 8 + (iqs % 8) / 4;
        const uint8_t * scales = b->scales + scale_offset;
        const int v = get_int_b4(b->qs, iqs);
        float sumf_d = 0.0f, sumf_m = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const block_q8_1 * yi = y + bq8_offset + i;
            const float d8 = f16_to_f32(yi->d);
            const int u = get_int_b4(yi->qs, iqs % 8);
            const int sc = scales[2 * i];
            const int vi = (v >> (2 * i)) & 0x03030303;
            sumf_d += d8 * (float) (__dp4a(vi, u, 0) * (sc & 0xF));
            int m = sc >> 4;
            m |= m << 8;
            m |= m << 16;
            sumf_m += d8 * (float) __dp4a(m, u, 0);
        }
        return f16_to_f32(b->d) * sumf_d - f16_to_f32(b->dmin) * sumf_m;
    }
};

// Q3_K: 16 threads per block, each one int of 2-bit quants with the matching high bits (a set hmask bit
// means "do not subtract 4"), 6-bit signed scales unpacked from the 12 scale bytes.
struct fmt_q3_K {
    static constexpr int qk = QK_K, qi = 16, vdr = 1;
    typedef block_q3_K block;
    static __device__ __forceinline__ float dot(const block * b, const block_q8_1 * y, int iqs) {
        const int bq8_offset = 4 * (iqs / 8);
        const int scale_offset = iqs - iqs % 8 + (iqs % 8) / 4;
        const int vl = get_int_b2(b->qs, iqs);
        const int vh = ~get_int_b2(b->hmask, iqs % 8) >> bq8_offset;
        float sumf = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const block_q8_1 * yi = y + bq8_offset + i;
            const int u = get_int_b4(yi->qs, iqs % 8);
            const int isc = scale_offset + 2 * i;
            const int sc_low = (b->scales[isc % 8] >> (4 * (isc / 8))) & 0xF;
            const int sc_high = ((b->scales[8 + isc % 4] >> (2 * (isc / 4))) & 3) << 4;
            const int sc = (sc_low | sc_high) - 32;
            const int vil = (vl >> (2 * i)) & 0x03030303;
            const int vih = ((vh >> i) << 2) & 0x04040404;
            const int vi = __vsub4(vil, vih);
            sumf += f16_to_f32(yi->d) * (float) (__dp4a(vi, u, 0) * sc);
        }
        return f16_to_f32(b->d) * sumf;
    }
};

// The two 6-bit (scale, min) pairs a Q4_K/Q5_K thread needs: sub-blocks 2j and 2j+1 of the 8, unpacked from
// the 12 scale bytes without branches (j = which pair of sub-blocks).
static __device__ __forceinline__ void k_scales_mins(const uint8_t * scales12, int j, uint8_t sc[2], uint8_t m[2]) {
    const uint16_t * scales = (const uint16_t *) scales12;
    const int jm = j & 1;
    const uint32_t s0 = scales[jm + 0];
    const uint32_t s2 = scales[jm + 2];
    const uint32_t s4 = scales[jm + 4];
    const uint32_t hi = (uint32_t) -(int32_t) (j >= 2);
    const uint16_t a0 = (uint16_t) (((s0 & 0x3f3f) & ~hi) | ((((s4 >> 0) & 0x0f0f) | ((s0 & 0xc0c0) >> 2)) & hi));
    const uint16_t a1 = (uint16_t) (((s2 & 0x3f3f) & ~hi) | ((((s4 >> 4) & 0x0f0f) | ((s2 & 0xc0c0) >> 2)) & hi));
    sc[0] = (uint8_t) (a0 & 0xff);
    sc[1] = (uint8_t) (a0 >> 8);
    m[0] = (uint8_t) (a1 & 0xff);
    m[1] = (uint8_t) (a1 >> 8);
}

struct fmt_q4_K {
    static constexpr int qk = QK_K, qi = 32, vdr = 2;
    typedef block_q4_K block;
    // iqs in 0, 2, ..., 30: quants of sub-blocks 2j, 2j+1 (j = iqs/8), 8 values of each.
    static __device__ __forceinline__ float dot(const block * b, const block_q8_1 * y, int iqs) {
        const int bq8_offset = 2 * ((iqs / 2) / 4);
        const int * q4 = (const int *) (b->qs + 16 * bq8_offset + 4 * ((iqs / 2) % 4));
        const int v0 = q4[0];
        const int v1 = q4[4];
        uint8_t sc[2], m[2];
        k_scales_mins(b->scales, bq8_offset / 2, sc, m);
        float sumf_d = 0.0f, sumf_m = 0.0f;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const block_q8_1 * yi = y + bq8_offset + i;
            const float d8 = f16_to_f32(yi->d);
            const int * q8 = (const int *) yi->qs + ((iqs / 2) % 4);
            const int v0i = (v0 >> (4 * i)) & 0x0F0F0F0F;
            const int v1i = (v1 >> (4 * i)) & 0x0F0F0F0F;
            const int dot1 = __dp4a(v1i, q8[4], __dp4a(v0i, q8[0], 0));
            const int dot2 = __dp4a(0x01010101, q8[4], __dp4a(0x01010101, q8[0], 0));
            sumf_d += d8 * (float) (dot1 * sc[i]);
            sumf_m += d8 * (float) (dot2 * m[i]);
        }
        return f16_to_f32(b->d) * sumf_d - f16_to_f32(b->dmin) * sumf_m;
    }
};

struct fmt_q5_K {
    static constexpr int qk = QK_K, qi = 32, vdr = 2;
    typedef block_q5_K block;
    static __device__ __forceinline__ float dot(const block * b, const block_q8_1 * y, int iqs) {
        const int bq8_offset = 2 * ((iqs / 2) / 4);
        const int * ql = (const int *) (b->qs + 16 * bq8_offset + 4 * ((iqs / 2) % 4));
        const int * qh = (const int *) (b->qh + 4 * ((iqs / 2) % 4));
        const int vl0 = ql[0], vl1 = ql[4];
        const int vh0 = qh[0] >> bq8_offset, vh1 = qh[4] >> bq8_offset;
        uint8_t sc[2], m[2];
        k_scales_mins(b->scales, bq8_offset / 2, sc, m);
        float sumf_d = 0.0f, sumf_m = 0.0f;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const block_q8_1 * yi = y + bq8_offset + i;
            const float d8 = f16_to_f32(yi->d);
            const int * q8 = (const int *) yi->qs + ((iqs / 2) % 4);
            const int v0i = ((vl0 >> (4 * i)) & 0x0F0F0F0F) | (((vh0 >> i) << 4) & 0x10101010);
            const int v1i = ((vl1 >> (4 * i)) & 0x0F0F0F0F) | (((vh1 >> i) << 4) & 0x10101010);
            const int dot1 = __dp4a(v0i, q8[0], __dp4a(v1i, q8[4], 0));
            const int dot2 = __dp4a(0x01010101, q8[0], __dp4a(0x01010101, q8[4], 0));
            sumf_d += d8 * (float) (dot1 * sc[i]);
            sumf_m += d8 * (float) (dot2 * m[i]);
        }
        return f16_to_f32(b->d) * sumf_d - f16_to_f32(b->dmin) * sumf_m;
    }
};

struct fmt_q6_K {
    static constexpr int qk = QK_K, qi = 32, vdr = 1;
    typedef block_q6_K block;
    // iqs in 0..31: 4 low-nibble bytes of ql and the matching 2-bit pairs of qh, two q8_1 blocks apart.
    static __device__ __forceinline__ float dot(const block * b, const block_q8_1 * y, int iqs) {
        const int bq8_offset = 4 * (iqs / 16) + (iqs % 16) / 8;
        const int scale_offset = 8 * (iqs / 16) + (iqs % 16) / 4;
        const int vh_shift = 2 * ((iqs % 16) / 8);
        const int vl = get_int_b2(b->ql, iqs);
        const int vh = get_int_b2(b->qh, 8 * (iqs / 16) + iqs % 8) >> vh_shift;
        const int8_t * scales = b->scales + scale_offset;
        float sumf = 0.0f;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const block_q8_1 * yi = y + bq8_offset + 2 * i;
            const int u = get_int_b4(yi->qs, iqs % 8);
            const int vil = (vl >> (4 * i)) & 0x0F0F0F0F;
            const int vih = ((vh >> (4 * i)) << 4) & 0x30303030;
            const int vi = __vsub4(vil | vih, 0x20202020);
            sumf += f16_to_f32(yi->d) * (float) (__dp4a(vi, u, 0) * scales[4 * i]);
        }
        return f16_to_f32(b->d) * sumf;
    }
};

// The 16 IQ4_NL/IQ4_XS values as 4 little-endian words: -127 -104 -83 -65 | -49 -35 -22 -10 | 1 13 25 38 |
// 53 69 89 113.
__constant__ uint32_t kvalues_iq4nl_u32[4] = {0xBFAD9881u, 0xF6EADDCFu, 0x26190D01u, 0x71594535u};

// The table values of the eight 4-bit indices in q4: .x gets those of the low nibbles, .y of the high ones.
static __device__ __forceinline__ int2 lookup_16(int q4) {
    const uint32_t sel = 0x32103210u | (((uint32_t) q4 & 0x88888888u) >> 1);
    uint32_t tmp[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const uint32_t shift = 16 * i;
        const uint32_t lo = __byte_perm(kvalues_iq4nl_u32[0], kvalues_iq4nl_u32[1], (uint32_t) q4 >> shift);
        const uint32_t hi = __byte_perm(kvalues_iq4nl_u32[2], kvalues_iq4nl_u32[3], (uint32_t) q4 >> shift);
        tmp[i] = __byte_perm(lo, hi, sel >> shift);
    }
    return make_int2((int) __byte_perm(tmp[0], tmp[1], 0x6420), (int) __byte_perm(tmp[0], tmp[1], 0x7531));
}

struct fmt_iq4_nl {
    static constexpr int qk = 32, qi = 4, vdr = 2;
    typedef block_iq4_nl block;
    static __device__ __forceinline__ float dot(const block * b, const block_q8_1 * y, int iqs) {
        int sumi = 0;
#pragma unroll
        for (int l = 0; l < vdr; ++l) {
            const int2 v = lookup_16(get_int_b2(b->qs, iqs + l));
            sumi = __dp4a(v.x, get_int_b4(y->qs, iqs + l), sumi);
            sumi = __dp4a(v.y, get_int_b4(y->qs, iqs + l + 4), sumi);
        }
        return f16_to_f32(b->d) * f16_to_f32(y->d) * (float) sumi;
    }
};

struct fmt_iq4_xs {
    static constexpr int qk = QK_K, qi = 32, vdr = 4;
    typedef block_iq4_xs block;
    // iqs in 0, 4, ..., 28: sub-block iqs/4 (32 values: 16 bytes of nibbles).
    static __device__ __forceinline__ float dot(const block * b, const block_q8_1 * y, int iqs) {
        const block_q8_1 * yi = y + iqs / 4;
        int sumi = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int2 v = lookup_16(get_int_b4(b->qs, iqs + j));
            sumi = __dp4a(v.x, get_int_b4(yi->qs, j), sumi);
            sumi = __dp4a(v.y, get_int_b4(yi->qs, j + 4), sumi);
        }
        const int ls = ((b->scales_l[iqs / 8] >> (iqs & 4)) & 0x0F) | (((b->scales_h >> (iqs / 2)) & 0x03) << 4);
        return f16_to_f32(b->d) * f16_to_f32(yi->d) * (float) (sumi * (ls - 32));
    }
};

// ----- the shared row loop ---------------------------------------------------------------------------------

// The row of this thread's warp group: warps threadIdx.y / wpr * wpr .. + wpr share one row.
static __device__ __forceinline__ int group_row(int wpr) {
    return blockIdx.x * (MATVEC_WARPS / wpr) + threadIdx.y / wpr;
}

// Whether this thread writes its group's result (lane 0 of the group's first warp).
static __device__ __forceinline__ bool group_writer(int wpr) {
    return threadIdx.x == 0 && threadIdx.y % wpr == 0;
}

// Several consecutive rows per warp group (rpg <= MATVEC_MAX_RPG, a launch argument): the weight loads of
// all of them are in flight together and the block's fixed costs (the expert lookup, the reduction) are
// shared, so a launch needs fewer, longer blocks (one token's matvecs are short: with one row per group
// they run as many waves of blocks whose lives are mostly waiting). Each row's sum is formed as row_dot
// forms it, so the value of a row does not depend on rpg. Row r of the group is row0 + r; rows r >= nr
// contribute nothing. The results are valid in the group's writer.
#define MATVEC_MAX_RPG 4

template <typename F, int N_MAT, int RPG>
static __device__ __forceinline__ void rows_dot_n(const uint8_t * const (&w_row0)[N_MAT], int64_t row_bytes,
                                                  const block_q8_1 * __restrict__ x, int ncols, int wpr, int nr,
                                                  float (&total)[N_MAT][MATVEC_MAX_RPG]) {
    constexpr int threads_per_block = F::qi / F::vdr;
    const int blocks_per_iter = F::vdr * wpr * WARP_SIZE / F::qi;
    const int tid = WARP_SIZE * (threadIdx.y % wpr) + threadIdx.x;
    const int blocks_per_row = nr > 0 ? ncols / F::qk : 0;
    const int iqs = F::vdr * (tid % threads_per_block);
    float acc[N_MAT][RPG];
#pragma unroll
    for (int m = 0; m < N_MAT; ++m) {
#pragma unroll
        for (int r = 0; r < RPG; ++r) {
            acc[m][r] = 0.0f;
        }
    }
    for (int kb = tid / threads_per_block; kb < blocks_per_row; kb += blocks_per_iter) {
        const block_q8_1 * xb = x + kb * (F::qk / QK8_1);
        // Rows past nr read the group's first row again (unconditional loads the compiler can issue
        // together); their sums are never written.
#pragma unroll
        for (int r = 0; r < RPG; ++r) {
#pragma unroll
            for (int m = 0; m < N_MAT; ++m) {
                const typename F::block * w = (const typename F::block *) (w_row0[m] + (r < nr ? r : 0) * row_bytes);
                acc[m][r] += F::dot(w + kb, xb, iqs);
            }
        }
    }
    __shared__ float partial[N_MAT][RPG][MATVEC_WARPS];
#pragma unroll
    for (int m = 0; m < N_MAT; ++m) {
#pragma unroll
        for (int r = 0; r < RPG; ++r) {
            const float v = warp_sum(acc[m][r]);
            if (threadIdx.x == 0) {
                partial[m][r][threadIdx.y] = v;
            }
        }
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < N_MAT; ++m) {
#pragma unroll
        for (int r = 0; r < MATVEC_MAX_RPG; ++r) {
            total[m][r] = 0.0f;
            if (r < RPG && group_writer(wpr)) {
                for (int w8 = 0; w8 < wpr; ++w8) {
                    total[m][r] += partial[m][r][threadIdx.y + w8];
                }
            }
        }
    }
}

// rows_dot_n for the launch's rpg (1, 2 or 4; uniform over the launch, so one branch per block): each
// variant keeps exactly its rows' loads in flight.
template <typename F, int N_MAT>
static __device__ __forceinline__ void rows_dot_rpg(const uint8_t * const (&w_row0)[N_MAT], int64_t row_bytes,
                                                    const block_q8_1 * __restrict__ x, int ncols, int wpr, int rpg,
                                                    int nr, float (&total)[N_MAT][MATVEC_MAX_RPG]) {
    if (rpg >= 4) {
        rows_dot_n<F, N_MAT, 4>(w_row0, row_bytes, x, ncols, wpr, nr, total);
    } else if (rpg == 2) {
        rows_dot_n<F, N_MAT, 2>(w_row0, row_bytes, x, ncols, wpr, nr, total);
    } else {
        rows_dot_n<F, N_MAT, 1>(w_row0, row_bytes, x, ncols, wpr, nr, total);
    }
}

template <typename F>
static __device__ __forceinline__ void matvec(const uint8_t * __restrict__ w, const block_q8_1 * __restrict__ x,
                                              float * __restrict__ y, int ncols, int nrows, int wpr, int rpg) {
    const int row0 = group_row(wpr) * rpg;
    const int nr = max(0, min(rpg, nrows - row0));
    const int64_t row_bytes = (int64_t) (ncols / F::qk) * sizeof(typename F::block);
    const uint8_t * const w_row0[1] = {w + (nr > 0 ? row0 : 0) * row_bytes};
    float total[1][MATVEC_MAX_RPG];
    rows_dot_rpg<F, 1>(w_row0, row_bytes, x, ncols, wpr, rpg, nr, total);
    if (group_writer(wpr)) {
#pragma unroll
        for (int r = 0; r < MATVEC_MAX_RPG; ++r) {
            if (r < nr) {
                y[row0 + r] = total[0][r];
            }
        }
    }
}

// Several matrices of one format and width times the same x in one launch (one token's q, k and v
// projections): the launch's blocks are those of a matvec launch of each matrix (same rpg) back to back, and
// each block does what that launch's block would, so every y is bit for bit matvec's. Matrix m's rows go to
// y[m]. Up to MATVEC_MANY_MAX matrices; the argument struct is MatvecManyArgs in kernels/src/cuda/fused.rs.
#define MATVEC_MANY_MAX 4

struct MatvecManyArgs {
    uint64_t w[MATVEC_MANY_MAX]; // each matrix's address
    uint64_t y[MATVEC_MANY_MAX]; // each result's address (nrows[m] floats)
    int nrows[MATVEC_MANY_MAX];
    int n_mat;
    int ncols;
    int wpr;
    int rpg;
};

template <typename F>
static __device__ __forceinline__ void matvec_many(const MatvecManyArgs & p, const block_q8_1 * __restrict__ x) {
    const int rows_per_block = MATVEC_WARPS / p.wpr;
    const int rows_per_launch_block = rows_per_block * p.rpg;
    // Which matrix this block serves (w, y, nrows), and its block index within that matrix's launch. The
    // loop is unrolled so every field is read at a constant offset of the parameter space (an index known
    // only at run time would copy the struct to each thread's local memory).
    int block = blockIdx.x;
    uint64_t w = p.w[0], y_addr = p.y[0];
    int nrows = p.nrows[0];
    bool found = false;
#pragma unroll
    for (int m = 0; m < MATVEC_MANY_MAX; ++m) {
        if (!found && m < p.n_mat) {
            const int blocks_m = (p.nrows[m] + rows_per_launch_block - 1) / rows_per_launch_block;
            w = p.w[m];
            y_addr = p.y[m];
            nrows = p.nrows[m];
            if (block < blocks_m || m == p.n_mat - 1) {
                found = true;
            } else {
                block -= blocks_m;
            }
        }
    }
    const int row0 = (block * rows_per_block + threadIdx.y / p.wpr) * p.rpg;
    const int nr = max(0, min(p.rpg, nrows - row0));
    const int64_t row_bytes = (int64_t) (p.ncols / F::qk) * sizeof(typename F::block);
    const uint8_t * const w_row0[1] = {(const uint8_t *) w + (nr > 0 ? row0 : 0) * row_bytes};
    float total[1][MATVEC_MAX_RPG];
    rows_dot_rpg<F, 1>(w_row0, row_bytes, x, p.ncols, p.wpr, p.rpg, nr, total);
    if (group_writer(p.wpr)) {
        float * y = (float *) y_addr;
#pragma unroll
        for (int r = 0; r < MATVEC_MAX_RPG; ++r) {
            if (r < nr) {
                y[row0 + r] = total[0][r];
            }
        }
    }
}

template <typename F>
static __device__ __forceinline__ void matvec_experts(const uint64_t * __restrict__ expert_table,
                                                      const int32_t * __restrict__ ids, int n_expert,
                                                      const block_q8_1 * __restrict__ x, int64_t x_stride_blocks,
                                                      float * __restrict__ y, int ncols, int nrows, int wpr, int rpg) {
    const int row0 = group_row(wpr) * rpg;
    const int slot = blockIdx.y;
    const int32_t expert = ids[slot];
    const uint64_t base = expert < 0 || expert >= n_expert ? 0 : expert_table[expert];
    const int n_out = max(0, min(rpg, nrows - row0));
    const int nr = base != 0 ? n_out : 0;
    const int64_t row_bytes = (int64_t) (ncols / F::qk) * sizeof(typename F::block);
    const uint8_t * const w_row0[1] = {nr > 0 ? (const uint8_t *) base + row0 * row_bytes : nullptr};
    float total[1][MATVEC_MAX_RPG];
    rows_dot_rpg<F, 1>(w_row0, row_bytes, x + slot * x_stride_blocks, ncols, wpr, rpg, nr, total);
    if (group_writer(wpr)) {
#pragma unroll
        for (int r = 0; r < MATVEC_MAX_RPG; ++r) {
            if (r < n_out) {
                y[(int64_t) slot * nrows + row0 + r] = total[0][r];
            }
        }
    }
}

// Gate and up projections of the same experts in one launch, for one token: slot s (blockIdx.y) multiplies
// expert ids[s] of both tables with the shared x and writes h[s*nrows + row] = silu(gate . x) * (up . x).
// Both matrices' rows go through the same loop (their weight loads in flight together) and each sum is
// formed in the order of row_dot, so h is bit for bit swiglu_f32 of two matvec_experts launches. A missing
// expert (address 0 in either table) writes 0.
template <typename F>
static __device__ __forceinline__ void matvec_experts_glu(const uint64_t * __restrict__ gate_table,
                                                          const uint64_t * __restrict__ up_table,
                                                          const int32_t * __restrict__ ids, int n_expert,
                                                          const block_q8_1 * __restrict__ x, float * __restrict__ h,
                                                          int ncols, int nrows, int wpr, int rpg) {
    const int row0 = group_row(wpr) * rpg;
    const int slot = blockIdx.y;
    const int32_t expert = ids[slot];
    const bool known = expert >= 0 && expert < n_expert;
    const uint64_t base_g = known ? gate_table[expert] : 0;
    const uint64_t base_u = known ? up_table[expert] : 0;
    const int n_out = max(0, min(rpg, nrows - row0));
    const int nr = base_g != 0 && base_u != 0 ? n_out : 0;
    const int64_t row_bytes = (int64_t) (ncols / F::qk) * sizeof(typename F::block);
    const uint8_t * const w_row0[2] = {nr > 0 ? (const uint8_t *) base_g + row0 * row_bytes : nullptr,
                                       nr > 0 ? (const uint8_t *) base_u + row0 * row_bytes : nullptr};
    float total[2][MATVEC_MAX_RPG];
    rows_dot_rpg<F, 2>(w_row0, row_bytes, x, ncols, wpr, rpg, nr, total);
    if (group_writer(wpr)) {
#pragma unroll
        for (int r = 0; r < MATVEC_MAX_RPG; ++r) {
            if (r < n_out) {
                const float g = total[0][r], u = total[1][r];
                const float silu = g / (1.0f + expf(-g)); // act.cu's silu
                h[(int64_t) slot * nrows + row0 + r] = silu * u;
            }
        }
    }
}

// ----- matrix x matrix for prompts (a tile of MATMUL_COLS tokens per block) ------------------------------
// As matvec, but each thread block also takes up to MATMUL_COLS activation rows (tokens), so a weight block
// is read once from memory for MATMUL_COLS tokens (the repeated reads hit L1): the mmvq-with-several-columns
// idea. matmul_<fmt>: blockIdx.y is a tile of tokens, y [n_tokens, nrows]. matmul_experts_<fmt>: tokens
// grouped by expert (the host or the router sorts the (token, expert) pairs by expert), blockIdx.y is a
// tile (expert, first sorted row, rows <= MATMUL_COLS) from a table in device memory; x and y are in sorted
// order ([n_sorted, ...]). An expert id outside 0..n_expert or a null address writes zeros.

#define MATMUL_COLS 8

template <typename F>
static __device__ __forceinline__ void rows_dot_cols(const uint8_t * __restrict__ w_row,
                                                     const block_q8_1 * __restrict__ x, int64_t x_stride_blocks,
                                                     int ncol, int ncols, int wpr, bool active,
                                                     float (&total)[MATMUL_COLS]) {
    constexpr int threads_per_block = F::qi / F::vdr;
    const int blocks_per_iter = F::vdr * wpr * WARP_SIZE / F::qi;
    const int tid = WARP_SIZE * (threadIdx.y % wpr) + threadIdx.x;
    const int blocks_per_row = active ? ncols / F::qk : 0;
    const int iqs = F::vdr * (tid % threads_per_block);
    const typename F::block * w = (const typename F::block *) w_row;
    float acc[MATMUL_COLS];
#pragma unroll
    for (int c = 0; c < MATMUL_COLS; ++c) {
        acc[c] = 0.0f;
    }
    for (int kb = tid / threads_per_block; kb < blocks_per_row; kb += blocks_per_iter) {
#pragma unroll
        for (int c = 0; c < MATMUL_COLS; ++c) {
            if (c < ncol) {
                acc[c] += F::dot(w + kb, x + c * x_stride_blocks + kb * (F::qk / QK8_1), iqs);
            }
        }
    }
    __shared__ float partial[MATVEC_WARPS][MATMUL_COLS];
#pragma unroll
    for (int c = 0; c < MATMUL_COLS; ++c) {
        const float v = warp_sum(acc[c]);
        if (threadIdx.x == 0) {
            partial[threadIdx.y][c] = v;
        }
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < MATMUL_COLS; ++c) {
        total[c] = 0.0f;
        if (group_writer(wpr)) {
            for (int w8 = 0; w8 < wpr; ++w8) {
                total[c] += partial[threadIdx.y + w8][c];
            }
        }
    }
}

template <typename F>
static __device__ __forceinline__ void matmul(const uint8_t * __restrict__ w, const block_q8_1 * __restrict__ x,
                                              float * __restrict__ y, int ncols, int nrows, int n_tokens, int wpr) {
    const int row = group_row(wpr);
    const bool active = row < nrows;
    const int t0 = blockIdx.y * MATMUL_COLS;
    const int ncol = min(MATMUL_COLS, n_tokens - t0);
    const int64_t x_stride = ncols / QK8_1;
    const int64_t row_bytes = (int64_t) (ncols / F::qk) * sizeof(typename F::block);
    float total[MATMUL_COLS];
    rows_dot_cols<F>(w + (active ? row : 0) * row_bytes, x + t0 * x_stride, x_stride, ncol, ncols, wpr, active,
                     total);
    if (active && group_writer(wpr)) {
        for (int c = 0; c < ncol; ++c) {
            y[(int64_t) (t0 + c) * nrows + row] = total[c];
        }
    }
}

template <typename F>
static __device__ __forceinline__ void matmul_experts(const uint64_t * __restrict__ expert_table, int n_expert,
                                                      const int32_t * __restrict__ tiles,
                                                      const block_q8_1 * __restrict__ x, float * __restrict__ y,
                                                      int ncols, int nrows, int wpr) {
    const int row = group_row(wpr);
    const int32_t expert = tiles[3 * blockIdx.y];
    const int r0 = tiles[3 * blockIdx.y + 1];
    const int ncol = min(MATMUL_COLS, (int) tiles[3 * blockIdx.y + 2]);
    const uint64_t base = expert < 0 || expert >= n_expert ? 0 : expert_table[expert];
    const bool active = row < nrows && base != 0;
    const int64_t x_stride = ncols / QK8_1;
    const int64_t row_bytes = (int64_t) (ncols / F::qk) * sizeof(typename F::block);
    const uint8_t * w_row = active ? (const uint8_t *) base + row * row_bytes : nullptr;
    float total[MATMUL_COLS];
    rows_dot_cols<F>(w_row, x + r0 * x_stride, x_stride, ncol, ncols, wpr, active, total);
    if (row < nrows && group_writer(wpr)) {
        for (int c = 0; c < ncol; ++c) {
            y[(int64_t) (r0 + c) * nrows + row] = total[c];
        }
    }
}

#define MATVEC_ENTRY_POINTS(name, F)                                                                           \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * MATVEC_WARPS)                                     \
        matvec_##name(const uint8_t * __restrict__ w, const block_q8_1 * __restrict__ x, float * __restrict__ y, \
                      int ncols, int nrows, int wpr, int rpg) {                                                \
        matvec<F>(w, x, y, ncols, nrows, wpr, rpg);                                                            \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * MATVEC_WARPS)                                     \
        matvec_many_##name(const MatvecManyArgs p, const block_q8_1 * __restrict__ x) {                      \
        matvec_many<F>(p, x);                                                                                  \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * MATVEC_WARPS)                                     \
        matvec_experts_##name(const uint64_t * __restrict__ expert_table, const int32_t * __restrict__ ids,   \
                              int n_expert, const block_q8_1 * __restrict__ x, int64_t x_stride_blocks,      \
                              float * __restrict__ y, int ncols, int nrows, int wpr, int rpg) {                \
        matvec_experts<F>(expert_table, ids, n_expert, x, x_stride_blocks, y, ncols, nrows, wpr, rpg);         \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * MATVEC_WARPS)                                     \
        matvec_experts_glu_##name(const uint64_t * __restrict__ gate_table, const uint64_t * __restrict__ up_table, \
                                  const int32_t * __restrict__ ids, int n_expert,                              \
                                  const block_q8_1 * __restrict__ x, float * __restrict__ h, int ncols,        \
                                  int nrows, int wpr, int rpg) {                                               \
        matvec_experts_glu<F>(gate_table, up_table, ids, n_expert, x, h, ncols, nrows, wpr, rpg);              \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * MATVEC_WARPS)                                     \
        matmul_##name(const uint8_t * __restrict__ w, const block_q8_1 * __restrict__ x, float * __restrict__ y, \
                      int ncols, int nrows, int n_tokens, int wpr) {                                           \
        matmul<F>(w, x, y, ncols, nrows, n_tokens, wpr);                                                       \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * MATVEC_WARPS)                                     \
        matmul_experts_##name(const uint64_t * __restrict__ expert_table, int n_expert,                        \
                              const int32_t * __restrict__ tiles, const block_q8_1 * __restrict__ x,           \
                              float * __restrict__ y, int ncols, int nrows, int wpr) {                         \
        matmul_experts<F>(expert_table, n_expert, tiles, x, y, ncols, nrows, wpr);                             \
    }

MATVEC_ENTRY_POINTS(q4_0, fmt_q4_0)
MATVEC_ENTRY_POINTS(q4_1, fmt_q4_1)
MATVEC_ENTRY_POINTS(q5_0, fmt_q5_0)
MATVEC_ENTRY_POINTS(q5_1, fmt_q5_1)
MATVEC_ENTRY_POINTS(q8_0, fmt_q8_0)
MATVEC_ENTRY_POINTS(q2_k, fmt_q2_K)
MATVEC_ENTRY_POINTS(q3_k, fmt_q3_K)
MATVEC_ENTRY_POINTS(q4_k, fmt_q4_K)
MATVEC_ENTRY_POINTS(q5_k, fmt_q5_K)
MATVEC_ENTRY_POINTS(q6_k, fmt_q6_K)
MATVEC_ENTRY_POINTS(iq4_nl, fmt_iq4_nl)
MATVEC_ENTRY_POINTS(iq4_xs, fmt_iq4_xs)
