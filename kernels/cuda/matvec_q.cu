// Quantized matrix x vector (and the dp4a prompt tiles) for the classic formats (Q4_0 .. Q8_0), the
// k-quants and IQ4_NL/IQ4_XS: the per-format dot products of one weight block with q8_1 activations
// (following ggml-cuda's vecdotq.cuh), instantiated into the entry points of matvec.cuh (which the Rust
// side puts in front of this file; it describes the work split and the entry points). The lattice
// i-quants are matvec_iq.cu's.

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
