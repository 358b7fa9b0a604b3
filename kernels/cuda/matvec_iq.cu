// Quantized matrix x vector (and the dp4a prompt tiles) for the lattice i-quants: IQ2_XXS, IQ2_XS, IQ2_S,
// IQ3_XXS, IQ3_S, IQ1_S, IQ1_M. The per-format dot products of one weight block with q8_1 activations
// follow ggml-cuda's vecdotq.cuh; they are instantiated into the entry points of matvec.cuh. The Rust
// side puts common.cuh, iq_grids.cuh (the grids, generated from the CPU's tables) and matvec.cuh in
// front of this file.

// ----- i-quants (IQ2_XXS .. IQ1_M) -------------------------------------------------------------------------
// Lattice formats: each group of 8 (IQ2, IQ1) or 4 (IQ3) values is one entry of a fixed grid (iq_grids.cuh,
// put in front of this module by the Rust side), with sign bits and sub-block scales beside it. A thread takes
// one sub-block of 32 values (one q8_1 block): ggml-cuda's vec_dot_iq*_q8_1 split (qi/vdr = 8 threads per
// 256-value block). The scales are applied in float after the integer sums, so no sum is rounded.
// The section between this line and "end of the i-quants" is also compiled on the host by
// kernels/cuda/tools/iq_host_check.py (checked against the gguf package's dequantizer): keep it plain C++.

// The 8 sign bits of a group of 8 values (bit j negates value j) as two byte masks, 0xFF where negative:
// `lo` for values 0..3, `hi` for 4..7. Each bit is moved to a byte of its own, then __vcmpne4 widens it.
static __device__ __forceinline__ void iq_sign_masks(uint32_t s, int & lo, int & hi) {
    lo = (int) __vcmpne4(((s & 0x03) << 7) | ((s & 0x0C) << 21), 0);
    hi = (int) __vcmpne4(((s & 0x30) << 3) | ((s & 0xC0) << 17), 0);
}

// The bytes of v negated where mask m is 0xFF ((v ^ m) - m per byte).
static __device__ __forceinline__ int iq_apply_signs(int v, int m) {
    return (int) __vsub4((uint32_t) (v ^ m), (uint32_t) m);
}

// One group of 8 grid magnitudes (8 bytes) with its signs, dotted with 8 activation quants (2 ints of u).
static __device__ __forceinline__ int iq_dot8(uint64_t grid, uint32_t signs, const int8_t * u, int j, int sumi) {
    int lo, hi;
    iq_sign_masks(signs, lo, hi);
    sumi = __dp4a(iq_apply_signs((int) (uint32_t) grid, lo), get_int_b4(u, j), sumi);
    return __dp4a(iq_apply_signs((int) (uint32_t) (grid >> 32), hi), get_int_b4(u, j + 1), sumi);
}

// The sum of 8 activation quants (2 ints of u).
static __device__ __forceinline__ int q8_sum8(const int8_t * u, int j) {
    return __dp4a(0x01010101, get_int_b4(u, j + 1), __dp4a(0x01010101, get_int_b4(u, j), 0));
}

// IQ2_XXS: sub-block ib = iqs/2 is 8 bytes: 4 grid indexes (one per 8 values), then 4 x 7 sign bits (the
// eighth sign is the parity, ksigns_iq2xs) and a 4-bit scale ls; value = d * (ls + 1/2) / 4 * grid * sign.
struct fmt_iq2_xxs {
    static constexpr int qk = QK_K, qi = 16, vdr = 2;
    typedef block_iq2_xxs block;
    static __device__ __forceinline__ float dot(const block * b, const block_q8_1 * y, int iqs) {
        const block_q8_1 * yi = y + iqs / 2;
        const uint32_t idx = (uint32_t) get_int_b2(b->qs, iqs);
        const uint32_t aux = (uint32_t) get_int_b2(b->qs, iqs + 1);
        int sumi = 0;
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            const uint32_t signs = ksigns_iq2xs[(aux >> (7 * g)) & 0x7F];
            sumi = iq_dot8(iq2xxs_grid[(idx >> (8 * g)) & 0xFF], signs, yi->qs, 2 * g, sumi);
        }
        const float scale = 0.25f * (0.5f + (float) (aux >> 28));
        return f16_to_f32(b->d) * scale * f16_to_f32(yi->d) * (float) sumi;
    }
};

// IQ2_XS: a 16-bit word per 8 values (9-bit grid index, 7 sign bits), a 4-bit scale per 16 values.
struct fmt_iq2_xs {
    static constexpr int qk = QK_K, qi = 16, vdr = 2;
    typedef block_iq2_xs block;
    static __device__ __forceinline__ float dot(const block * b, const block_q8_1 * y, int iqs) {
        const block_q8_1 * yi = y + iqs / 2;
        const uint32_t q01 = (uint32_t) get_int_b2(b->qs, iqs);
        const uint32_t q23 = (uint32_t) get_int_b2(b->qs, iqs + 1);
        int sumi[2] = {0, 0};
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            const uint32_t q = ((g < 2 ? q01 : q23) >> (16 * (g & 1))) & 0xFFFF;
            sumi[g / 2] = iq_dot8(iq2xs_grid[q & 0x1FF], ksigns_iq2xs[q >> 9], yi->qs, 2 * g, sumi[g / 2]);
        }
        const int sc = b->scales[iqs / 2];
        const float s0 = 0.5f + (float) (sc & 0x0F), s1 = 0.5f + (float) (sc >> 4);
        return f16_to_f32(b->d) * 0.25f * f16_to_f32(yi->d) * (s0 * (float) sumi[0] + s1 * (float) sumi[1]);
    }
};

// IQ2_S: 10-bit grid indexes (8 low bits in qs, 2 high bits per group in qh), a full sign byte per 8 values
// (qs[32..64]), a 4-bit scale per 16 values.
struct fmt_iq2_s {
    static constexpr int qk = QK_K, qi = 16, vdr = 2;
    typedef block_iq2_s block;
    static __device__ __forceinline__ float dot(const block * b, const block_q8_1 * y, int iqs) {
        const int ib = iqs / 2;
        const block_q8_1 * yi = y + ib;
        const uint32_t qs = (uint32_t) get_int_b2(b->qs, ib);
        const uint32_t signs = (uint32_t) get_int_b2(b->qs, QK_K / 32 + ib);
        const int qh = b->qh[ib];
        int sumi[2] = {0, 0};
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            const int idx = (int) ((qs >> (8 * g)) & 0xFF) | ((qh << (8 - 2 * g)) & 0x300);
            sumi[g / 2] = iq_dot8(iq2s_grid[idx], (signs >> (8 * g)) & 0xFF, yi->qs, 2 * g, sumi[g / 2]);
        }
        const int sc = b->scales[ib];
        const float s0 = 0.5f + (float) (sc & 0x0F), s1 = 0.5f + (float) (sc >> 4);
        return f16_to_f32(b->d) * 0.25f * f16_to_f32(yi->d) * (s0 * (float) sumi[0] + s1 * (float) sumi[1]);
    }
};

// IQ3_XXS: an 8-bit grid index per 4 values (qs[0..64]), then per sub-block a word of 4 x 7 sign bits and a
// 4-bit scale (qs[64..96]); value = d * (ls + 1/2) / 2 * grid * sign.
struct fmt_iq3_xxs {
    static constexpr int qk = QK_K, qi = 16, vdr = 2;
    typedef block_iq3_xxs block;
    static __device__ __forceinline__ float dot(const block * b, const block_q8_1 * y, int iqs) {
        const int ib = iqs / 2;
        const block_q8_1 * yi = y + ib;
        const uint32_t q0 = (uint32_t) get_int_b2(b->qs, 2 * ib);
        const uint32_t q1 = (uint32_t) get_int_b2(b->qs, 2 * ib + 1);
        const uint32_t aux = (uint32_t) get_int_b2(b->qs, QK_K / 16 + ib);
        int sumi = 0;
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            const uint32_t q = (g < 2 ? q0 : q1) >> (16 * (g & 1));
            const uint64_t grid = (uint64_t) iq3xxs_grid[q & 0xFF] | ((uint64_t) iq3xxs_grid[(q >> 8) & 0xFF] << 32);
            sumi = iq_dot8(grid, ksigns_iq2xs[(aux >> (7 * g)) & 0x7F], yi->qs, 2 * g, sumi);
        }
        const float scale = 0.5f * (0.5f + (float) (aux >> 28));
        return f16_to_f32(b->d) * scale * f16_to_f32(yi->d) * (float) sumi;
    }
};

// IQ3_S: 9-bit grid indexes per 4 values (8 low bits in qs, the ninth in qh), a sign byte per 8 values, a
// 4-bit scale per sub-block; value = d * (1 + 2 ls) * grid * sign.
struct fmt_iq3_s {
    static constexpr int qk = QK_K, qi = 16, vdr = 2;
    typedef block_iq3_s block;
    static __device__ __forceinline__ float dot(const block * b, const block_q8_1 * y, int iqs) {
        const int ib = iqs / 2;
        const block_q8_1 * yi = y + ib;
        const uint32_t q0 = (uint32_t) get_int_b2(b->qs, 2 * ib);
        const uint32_t q1 = (uint32_t) get_int_b2(b->qs, 2 * ib + 1);
        const uint32_t signs = (uint32_t) get_int_b2(b->signs, ib);
        const int qh = b->qh[ib];
        int sumi = 0;
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            const uint32_t q = (g < 2 ? q0 : q1) >> (16 * (g & 1));
            const uint32_t lo = iq3s_grid[(int) (q & 0xFF) | ((qh << (8 - 2 * g)) & 0x100)];
            const uint32_t hi = iq3s_grid[(int) ((q >> 8) & 0xFF) | ((qh << (7 - 2 * g)) & 0x100)];
            sumi = iq_dot8((uint64_t) lo | ((uint64_t) hi << 32), (signs >> (8 * g)) & 0xFF, yi->qs, 2 * g, sumi);
        }
        const int ls = 1 + 2 * ((b->scales[ib / 2] >> (4 * (ib & 1))) & 0x0F);
        return f16_to_f32(b->d) * f16_to_f32(yi->d) * (float) (ls * sumi);
    }
};

// IQ1_S and IQ1_M's grid entries hold v + 1 in nibbles (iq1s_grid_gpu); the dot of a group of 8 with u is
// then sum((v + 1) u), and the -1 and the group's shift (+-IQ1_DELTA) enter through sum(u).
#define IQ1_DELTA 0.125f

// IQ1_S: an 11-bit grid index per 8 values (8 bits in qs, 3 in the sub-block's 16-bit qh), qh's bits 12..14
// a 3-bit scale and bit 15 the sign of the shift; value = d * (2 ls + 1) * (v +- IQ1_DELTA).
struct fmt_iq1_s {
    static constexpr int qk = QK_K, qi = 8, vdr = 1;
    typedef block_iq1_s block;
    static __device__ __forceinline__ float dot(const block * b, const block_q8_1 * y, int iqs) {
        const block_q8_1 * yi = y + iqs;
        const uint32_t qs = (uint32_t) get_int_b2(b->qs, iqs);
        const int qh = b->qh[iqs];
        int sumi = 0, sumu = 0;
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            const uint32_t w = iq1s_grid_gpu[(int) ((qs >> (8 * g)) & 0xFF) | (((qh >> (3 * g)) & 7) << 8)];
            sumi = __dp4a((int) (w & 0x0F0F0F0F), get_int_b4(yi->qs, 2 * g), sumi);
            sumi = __dp4a((int) ((w >> 4) & 0x0F0F0F0F), get_int_b4(yi->qs, 2 * g + 1), sumi);
            sumu += q8_sum8(yi->qs, 2 * g);
        }
        const float dl = f16_to_f32(b->d) * (float) (2 * ((qh >> 12) & 7) + 1);
        const float shift = (qh & 0x8000) ? -1.0f - IQ1_DELTA : -1.0f + IQ1_DELTA;
        return dl * f16_to_f32(yi->d) * ((float) sumi + shift * (float) sumu);
    }
};

// IQ1_M: as IQ1_S's grid, but the 3 high index bits and the shift's sign per 8 values in a nibble of qh, a
// 3-bit scale per 16 values, and the block's f16 scale spread over the top nibbles of the 4 scale words.
struct fmt_iq1_m {
    static constexpr int qk = QK_K, qi = 8, vdr = 1;
    typedef block_iq1_m block;
    static __device__ __forceinline__ float dot(const block * b, const block_q8_1 * y, int iqs) {
        const block_q8_1 * yi = y + iqs;
        const uint32_t qs = (uint32_t) get_int_b2(b->qs, iqs);
        const int qh = b->qh[2 * iqs] | (b->qh[2 * iqs + 1] << 8);
        int sumi[2] = {0, 0};
        float shifted[2] = {0.0f, 0.0f};
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            const int h = (qh >> (4 * g)) & 0x0F;
            const uint32_t w = iq1s_grid_gpu[(int) ((qs >> (8 * g)) & 0xFF) | ((h & 7) << 8)];
            sumi[g / 2] = __dp4a((int) (w & 0x0F0F0F0F), get_int_b4(yi->qs, 2 * g), sumi[g / 2]);
            sumi[g / 2] = __dp4a((int) ((w >> 4) & 0x0F0F0F0F), get_int_b4(yi->qs, 2 * g + 1), sumi[g / 2]);
            const float shift = (h & 8) ? -1.0f - IQ1_DELTA : -1.0f + IQ1_DELTA;
            shifted[g / 2] += shift * (float) q8_sum8(yi->qs, 2 * g);
        }
        uint32_t sc[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            sc[k] = (uint32_t) b->scales[2 * k] | ((uint32_t) b->scales[2 * k + 1] << 8);
        }
        const uint16_t d = (uint16_t) ((sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) | ((sc[2] >> 4) & 0x0F00) |
                                       (sc[3] & 0xF000));
        const uint32_t tmp = sc[iqs / 2] >> (6 * (iqs % 2));
        const float s0 = (float) (2 * (tmp & 7) + 1), s1 = (float) (2 * ((tmp >> 3) & 7) + 1);
        return f16_to_f32(d) * f16_to_f32(yi->d) *
               (s0 * ((float) sumi[0] + shifted[0]) + s1 * ((float) sumi[1] + shifted[1]));
    }
};

// ----- end of the i-quants ---------------------------------------------------------------------------------

MATVEC_ENTRY_POINTS(iq2_xxs, fmt_iq2_xxs)
MATVEC_ENTRY_POINTS(iq2_xs, fmt_iq2_xs)
MATVEC_ENTRY_POINTS(iq2_s, fmt_iq2_s)
MATVEC_ENTRY_POINTS(iq3_xxs, fmt_iq3_xxs)
MATVEC_ENTRY_POINTS(iq3_s, fmt_iq3_s)
MATVEC_ENTRY_POINTS(iq1_s, fmt_iq1_s)
MATVEC_ENTRY_POINTS(iq1_m, fmt_iq1_m)
