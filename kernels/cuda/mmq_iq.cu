// The int8 tensor-core prompt kernels of mmq.cuh for the i-quants: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S,
// IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS (llama.cpp's load_tiles_iq* idea: each format unpacks to int8 in shared
// memory, then the products are the other formats'). The Rust side puts common.cuh, iq_grids.cuh and
// mmq.cuh in front of this file.
//
// Every format here has the `raw` / load / unpack form of mmq.cuh (a_stage_sub): a thread item is one
// 32-value sub-block of one row, whose bits (grid indexes, signs, scale bits, the block's f16 d) are loaded
// into registers before the previous step's products and unpacked after them. Blocks of these formats are
// 2-byte aligned (66, 74, 82, 98, 110, 50, 56, 18 bytes; IQ4_XS's 136 are 4-aligned), so the loads are 16-bit
// (get_int_b2) where the format's block is not 4-aligned.
//
// The section between this line and "end of the i-quant formats" is also compiled on the host by
// kernels/cuda/tools/mmq_iq_host_check.py (each format's unpacked int8 x scale checked against the gguf
// package's dequantizer): keep it plain C++ and the formats' names as they are.

// The 8 sign bits of a group of 8 values (bit j negates value j) as two byte masks, 0xFF where negative:
// `lo` for values 0..3, `hi` for 4..7. Each bit is moved to the top of a byte of its own, then __vcmpne4
// widens it.
static __device__ __forceinline__ void mmq_sign_masks(uint32_t s, int & lo, int & hi) {
    lo = (int) __vcmpne4(((s & 0x03) << 7) | ((s & 0x0C) << 21), 0);
    hi = (int) __vcmpne4(((s & 0x30) << 3) | ((s & 0xC0) << 17), 0);
}

// The bytes of v negated where mask m is 0xFF ((v ^ m) - m per byte; the magnitudes are below 128).
static __device__ __forceinline__ int mmq_apply_signs(uint32_t v, int m) {
    return (int) __vsub4(v ^ (uint32_t) m, (uint32_t) m);
}

// One group of 8 grid magnitudes (value j in byte j) with its sign byte, as two ints of int8.
static __device__ __forceinline__ void mmq_signed_group(uint64_t grid, uint32_t signs, int & q0, int & q1) {
    int lo, hi;
    mmq_sign_masks(signs, lo, hi);
    q0 = mmq_apply_signs((uint32_t) grid, lo);
    q1 = mmq_apply_signs((uint32_t) (grid >> 32), hi);
}

// IQ2_XXS: sub-block s is 8 bytes of qs: 4 grid indexes (one per 8 values), then a word of 4 x 7 sign bits
// (ksigns_iq2xs adds the parity bit) and a 4-bit scale ls; value = d * (2 ls + 1) / 8 * grid * sign.
struct mmq_iq2_xxs {
    static constexpr int qk = QK_K;
    static constexpr bool k16 = false;
    static constexpr bool offset = false;
    typedef block_iq2_xxs block;
    struct raw {
        uint32_t idx, aux, d;
    };
    static __device__ __forceinline__ raw load(const block * b, int sub) {
        return raw{(uint32_t) get_int_b2(b->qs, 2 * sub), (uint32_t) get_int_b2(b->qs, 2 * sub + 1), b->d};
    }
    static __device__ __forceinline__ float2 unpack(const raw & r, int (&q)[8]) {
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            mmq_signed_group(iq2xxs_grid[(r.idx >> (8 * g)) & 0xFF], ksigns_iq2xs[(r.aux >> (7 * g)) & 0x7F],
                             q[2 * g], q[2 * g + 1]);
        }
        return make_float2(f16_to_f32((uint16_t) r.d) * (float) (2 * (r.aux >> 28) + 1) * 0.125f, 0.0f);
    }
};

// IQ2_XS: a 16-bit word per 8 values (9-bit grid index, 7 sign bits), a 4-bit scale per 16 values (the low
// nibble of scales[s] for values 0..15 of sub-block s, the high one for 16..31): a k16 format.
struct mmq_iq2_xs {
    static constexpr int qk = QK_K;
    static constexpr bool k16 = true;
    typedef block_iq2_xs block;
    struct raw {
        uint32_t q01, q23, sc_d; // sc_d: the scale byte, d << 16
    };
    static __device__ __forceinline__ raw load(const block * b, int sub) {
        return raw{(uint32_t) get_int_b2(b->qs, 2 * sub), (uint32_t) get_int_b2(b->qs, 2 * sub + 1),
                   (uint32_t) b->scales[sub] | ((uint32_t) b->d << 16)};
    }
    static __device__ __forceinline__ float2 unpack(const raw & r, int (&q)[8]) {
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            const uint32_t w = ((g < 2 ? r.q01 : r.q23) >> (16 * (g & 1))) & 0xFFFF;
            mmq_signed_group(iq2xs_grid[w & 0x1FF], ksigns_iq2xs[w >> 9], q[2 * g], q[2 * g + 1]);
        }
        const float d8 = f16_to_f32((uint16_t) (r.sc_d >> 16)) * 0.125f;
        return make_float2(d8 * (float) (2 * (r.sc_d & 0x0F) + 1), d8 * (float) (2 * ((r.sc_d >> 4) & 0x0F) + 1));
    }
};

// IQ2_S: 10-bit grid indexes per 8 values (the low 8 bits in qs[0..32], 2 high bits per group in qh[s]), a
// plain sign byte per 8 values (qs[32..64]), a 4-bit scale per 16 values as IQ2_XS: a k16 format.
struct mmq_iq2_s {
    static constexpr int qk = QK_K;
    static constexpr bool k16 = true;
    typedef block_iq2_s block;
    struct raw {
        uint32_t qs, signs, misc; // misc: qh, scale byte << 8, d << 16
    };
    static __device__ __forceinline__ raw load(const block * b, int sub) {
        return raw{(uint32_t) get_int_b2(b->qs, sub), (uint32_t) get_int_b2(b->qs, QK_K / 32 + sub),
                   (uint32_t) b->qh[sub] | ((uint32_t) b->scales[sub] << 8) | ((uint32_t) b->d << 16)};
    }
    static __device__ __forceinline__ float2 unpack(const raw & r, int (&q)[8]) {
        const uint32_t qh = r.misc & 0xFF;
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            const uint32_t idx = ((r.qs >> (8 * g)) & 0xFF) | ((qh << (8 - 2 * g)) & 0x300);
            mmq_signed_group(iq2s_grid[idx], (r.signs >> (8 * g)) & 0xFF, q[2 * g], q[2 * g + 1]);
        }
        const float d8 = f16_to_f32((uint16_t) (r.misc >> 16)) * 0.125f;
        return make_float2(d8 * (float) (2 * ((r.misc >> 8) & 0x0F) + 1),
                           d8 * (float) (2 * ((r.misc >> 12) & 0x0F) + 1));
    }
};

// IQ3_XXS: an 8-bit grid index per 4 values (qs[0..64]: 8 per sub-block), then per sub-block a word of
// 4 x 7 sign bits (ksigns_iq2xs) and a 4-bit scale ls (qs[64..96]); value = d * (2 ls + 1) / 4 * grid * sign.
struct mmq_iq3_xxs {
    static constexpr int qk = QK_K;
    static constexpr bool k16 = false;
    static constexpr bool offset = false;
    typedef block_iq3_xxs block;
    struct raw {
        uint32_t q0, q1, aux, d;
    };
    static __device__ __forceinline__ raw load(const block * b, int sub) {
        return raw{(uint32_t) get_int_b2(b->qs, 2 * sub), (uint32_t) get_int_b2(b->qs, 2 * sub + 1),
                   (uint32_t) get_int_b2(b->qs, QK_K / 16 + sub), b->d};
    }
    static __device__ __forceinline__ float2 unpack(const raw & r, int (&q)[8]) {
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            const uint32_t i2 = (g < 2 ? r.q0 : r.q1) >> (16 * (g & 1));
            const uint64_t grid = (uint64_t) iq3xxs_grid[i2 & 0xFF] | ((uint64_t) iq3xxs_grid[(i2 >> 8) & 0xFF] << 32);
            mmq_signed_group(grid, ksigns_iq2xs[(r.aux >> (7 * g)) & 0x7F], q[2 * g], q[2 * g + 1]);
        }
        return make_float2(f16_to_f32((uint16_t) r.d) * (float) (2 * (r.aux >> 28) + 1) * 0.25f, 0.0f);
    }
};

// IQ3_S: 9-bit grid indexes per 4 values (the low 8 bits in qs, the ninth in qh[s]: bit i for index i of
// the sub-block's 8), a plain sign byte per 8 values, a 4-bit scale ls per sub-block (nibble s % 2 of
// scales[s / 2]); value = d * (2 ls + 1) * grid * sign.
struct mmq_iq3_s {
    static constexpr int qk = QK_K;
    static constexpr bool k16 = false;
    static constexpr bool offset = false;
    typedef block_iq3_s block;
    struct raw {
        uint32_t q0, q1, signs, misc; // misc: qh, ls << 8, d << 16
    };
    static __device__ __forceinline__ raw load(const block * b, int sub) {
        const uint32_t ls = (b->scales[sub / 2] >> (4 * (sub & 1))) & 0x0F;
        return raw{(uint32_t) get_int_b2(b->qs, 2 * sub), (uint32_t) get_int_b2(b->qs, 2 * sub + 1),
                   (uint32_t) get_int_b2(b->signs, sub), (uint32_t) b->qh[sub] | (ls << 8) | ((uint32_t) b->d << 16)};
    }
    static __device__ __forceinline__ float2 unpack(const raw & r, int (&q)[8]) {
        const uint32_t qh = r.misc & 0xFF;
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            const uint32_t i2 = (g < 2 ? r.q0 : r.q1) >> (16 * (g & 1));
            const uint32_t lo = iq3s_grid[(i2 & 0xFF) | ((qh << (8 - 2 * g)) & 0x100)];
            const uint32_t hi = iq3s_grid[((i2 >> 8) & 0xFF) | ((qh << (7 - 2 * g)) & 0x100)];
            mmq_signed_group((uint64_t) lo | ((uint64_t) hi << 32), (r.signs >> (8 * g)) & 0xFF, q[2 * g],
                             q[2 * g + 1]);
        }
        return make_float2(f16_to_f32((uint16_t) (r.misc >> 16)) * (float) (2 * ((r.misc >> 8) & 0x0F) + 1), 0.0f);
    }
};

// IQ1_S and IQ1_M: values dl * (v + delta) with v in {-1, 0, 1} from the grid and delta = +-1/8 per group
// of 8 (IQ1_S: one sign per 32 values, IQ1_M: one per 8). The shift is folded into the int8 quants:
// dl * (v + delta) = dl/8 * (8 v +- 1), so q = 8 v +- 1 (in -9..9) with scale dl/8, exact, and no offset
// term (IQ1_M's per-8 shift could not go through the activations' per-32 sums). The grid entries
// (iq1s_grid_gpu) hold v + 1 in nibbles: the low nibble of byte j is value j, the high nibble value j + 4;
// 8 (v + 1) - 7 = 8 v + 1 (delta +1/8), 8 (v + 1) - 9 = 8 v - 1 (delta -1/8).
static __device__ __forceinline__ void mmq_iq1_group(uint32_t grid, bool negative_delta, int & q0, int & q1) {
    const uint32_t c = negative_delta ? 0x09090909u : 0x07070707u;
    q0 = (int) __vsub4((grid & 0x0F0F0F0Fu) << 3, c);
    q1 = (int) __vsub4(((grid >> 4) & 0x0F0F0F0Fu) << 3, c);
}

// IQ1_S: an 11-bit grid index per 8 values (8 bits in qs, 3 in the sub-block's 16-bit qh), qh's bits 12..14
// a 3-bit scale ls and bit 15 the sign of the shift; dl = d * (2 ls + 1).
struct mmq_iq1_s {
    static constexpr int qk = QK_K;
    static constexpr bool k16 = false;
    static constexpr bool offset = false;
    typedef block_iq1_s block;
    struct raw {
        uint32_t qs, qh_d; // qh_d: qh, d << 16
    };
    static __device__ __forceinline__ raw load(const block * b, int sub) {
        return raw{(uint32_t) get_int_b2(b->qs, sub), (uint32_t) b->qh[sub] | ((uint32_t) b->d << 16)};
    }
    static __device__ __forceinline__ float2 unpack(const raw & r, int (&q)[8]) {
        const uint32_t qh = r.qh_d & 0xFFFF;
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            const uint32_t grid = iq1s_grid_gpu[((r.qs >> (8 * g)) & 0xFF) | (((qh >> (3 * g)) & 7) << 8)];
            mmq_iq1_group(grid, (qh & 0x8000) != 0, q[2 * g], q[2 * g + 1]);
        }
        return make_float2(f16_to_f32((uint16_t) (r.qh_d >> 16)) * (float) (2 * ((qh >> 12) & 7) + 1) * 0.125f,
                           0.0f);
    }
};

// IQ1_M: as IQ1_S's grid, but the 3 high index bits and the shift's sign per 8 values in a nibble of qh
// (nibble g of qh[2s] | qh[2s + 1] << 8 for group g of sub-block s), a 3-bit scale per 16 values (scale word
// s / 2, bits 6 (s % 2) + 0..2 for values 0..15 and + 3..5 for 16..31: a k16 format), and the block's f16 d
// spread over the top nibbles of the 4 scale words (gathered at load).
struct mmq_iq1_m {
    static constexpr int qk = QK_K;
    static constexpr bool k16 = true;
    typedef block_iq1_m block;
    struct raw {
        uint32_t qs, qh_sc, d; // qh_sc: the sub-block's 16 bits of qh, its scale bits (6) << 16
    };
    static __device__ __forceinline__ raw load(const block * b, int sub) {
        uint32_t sc[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            sc[k] = (uint32_t) b->scales[2 * k] | ((uint32_t) b->scales[2 * k + 1] << 8);
        }
        const uint32_t d = (sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) | ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000);
        const uint32_t bits = (sc[sub / 2] >> (6 * (sub & 1))) & 0x3F;
        const uint32_t qh = (uint32_t) b->qh[2 * sub] | ((uint32_t) b->qh[2 * sub + 1] << 8);
        return raw{(uint32_t) get_int_b2(b->qs, sub), qh | (bits << 16), d};
    }
    static __device__ __forceinline__ float2 unpack(const raw & r, int (&q)[8]) {
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            const uint32_t h = (r.qh_sc >> (4 * g)) & 0x0F;
            const uint32_t grid = iq1s_grid_gpu[((r.qs >> (8 * g)) & 0xFF) | ((h & 7) << 8)];
            mmq_iq1_group(grid, (h & 8) != 0, q[2 * g], q[2 * g + 1]);
        }
        const float d8 = f16_to_f32((uint16_t) r.d) * 0.125f;
        return make_float2(d8 * (float) (2 * ((r.qh_sc >> 16) & 7) + 1), d8 * (float) (2 * ((r.qh_sc >> 19) & 7) + 1));
    }
};

// IQ4_NL and IQ4_XS: 4-bit indexes into 16 fixed levels; within 32 values the low nibbles of 16 bytes are
// values 0..15, the high nibbles 16..31. The levels as 4 little-endian words: -127 -104 -83 -65 | -49 -35
// -22 -10 | 1 13 25 38 | 53 69 89 113.
__constant__ uint32_t mmq_kvalues_iq4nl[4] = {0xBFAD9881u, 0xF6EADDCFu, 0x26190D01u, 0x71594535u};

// The levels of the eight 4-bit indexes in q4: .x those of the low nibbles (byte j of q4 -> byte j), .y those
// of the high ones. __byte_perm picks a byte of a pair of words by a 3-bit selector: the low 3 bits of each
// index choose within the levels 0..7 and 8..15, then bit 3 chooses between the two.
static __device__ __forceinline__ int2 mmq_levels16(uint32_t q4) {
    const uint32_t sel = 0x32103210u | ((q4 & 0x88888888u) >> 1);
    uint32_t tmp[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const uint32_t shift = 16 * i;
        const uint32_t lo = __byte_perm(mmq_kvalues_iq4nl[0], mmq_kvalues_iq4nl[1], q4 >> shift);
        const uint32_t hi = __byte_perm(mmq_kvalues_iq4nl[2], mmq_kvalues_iq4nl[3], q4 >> shift);
        tmp[i] = __byte_perm(lo, hi, sel >> shift);
    }
    return make_int2((int) __byte_perm(tmp[0], tmp[1], 0x6420), (int) __byte_perm(tmp[0], tmp[1], 0x7531));
}

// The 32 values of 16 nibble bytes (4 words) as 8 ints of int8 levels.
static __device__ __forceinline__ void mmq_iq4_levels(const uint32_t (&w)[4], int (&q)[8]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int2 v = mmq_levels16(w[j]);
        q[j] = v.x;
        q[j + 4] = v.y;
    }
}

// IQ4_NL: blocks of 32 values (d, 16 nibble bytes); value = d * level.
struct mmq_iq4_nl {
    static constexpr int qk = 32;
    static constexpr bool k16 = false;
    static constexpr bool offset = false;
    typedef block_iq4_nl block;
    struct raw {
        uint32_t w[4], d;
    };
    static __device__ __forceinline__ raw load(const block * b, int) {
        raw r;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            r.w[j] = (uint32_t) get_int_b2(b->qs, j);
        }
        r.d = b->d;
        return r;
    }
    static __device__ __forceinline__ float2 unpack(const raw & r, int (&q)[8]) {
        mmq_iq4_levels(r.w, q);
        return make_float2(f16_to_f32((uint16_t) r.d), 0.0f);
    }
};

// IQ4_XS: super-blocks of 256 (d, 8 x 6-bit scales ls: 4 low bits in scales_l, 2 high in scales_h), 16
// nibble bytes per sub-block; value = d * (ls - 32) * level.
struct mmq_iq4_xs {
    static constexpr int qk = QK_K;
    static constexpr bool k16 = false;
    static constexpr bool offset = false;
    typedef block_iq4_xs block;
    struct raw {
        uint32_t w[4], ls_d; // ls_d: ls, d << 16
    };
    static __device__ __forceinline__ raw load(const block * b, int sub) {
        raw r;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            r.w[j] = (uint32_t) get_int_b4(b->qs, 4 * sub + j);
        }
        const uint32_t ls = ((b->scales_l[sub / 2] >> (4 * (sub & 1))) & 0x0F) | (((b->scales_h >> (2 * sub)) & 3) << 4);
        r.ls_d = ls | ((uint32_t) b->d << 16);
        return r;
    }
    static __device__ __forceinline__ float2 unpack(const raw & r, int (&q)[8]) {
        mmq_iq4_levels(r.w, q);
        return make_float2(f16_to_f32((uint16_t) (r.ls_d >> 16)) * (float) ((int) (r.ls_d & 0x3F) - 32), 0.0f);
    }
};

// ----- end of the i-quant formats --------------------------------------------------------------------------

template <> struct a_stage_of<mmq_iq1_s> { typedef a_stage_sub<mmq_iq1_s> type; };
template <> struct a_stage_of<mmq_iq1_m> { typedef a_stage_sub<mmq_iq1_m> type; };
template <> struct a_stage_of<mmq_iq2_xxs> { typedef a_stage_sub<mmq_iq2_xxs> type; };
template <> struct a_stage_of<mmq_iq2_xs> { typedef a_stage_sub<mmq_iq2_xs> type; };
template <> struct a_stage_of<mmq_iq2_s> { typedef a_stage_sub<mmq_iq2_s> type; };
template <> struct a_stage_of<mmq_iq3_xxs> { typedef a_stage_sub<mmq_iq3_xxs> type; };
template <> struct a_stage_of<mmq_iq3_s> { typedef a_stage_sub<mmq_iq3_s> type; };
template <> struct a_stage_of<mmq_iq4_nl> { typedef a_stage_sub<mmq_iq4_nl> type; };
template <> struct a_stage_of<mmq_iq4_xs> { typedef a_stage_sub<mmq_iq4_xs> type; };

// MIN_BLOCKS 2 for the tiles of 16..64 tokens (two blocks per SM hide each other's unpacking, which the
// lattice lookups make longer than Q4_K's), 1 for 128 (its accumulators need the registers), as Q4_K.
MMQ_ENTRY_POINTS(iq1_s, mmq_iq1_s, 16, 2)
MMQ_ENTRY_POINTS(iq1_s, mmq_iq1_s, 32, 2)
MMQ_ENTRY_POINTS(iq1_s, mmq_iq1_s, 64, 2)
MMQ_ENTRY_POINTS(iq1_s, mmq_iq1_s, 128, 1)
MMQ_ENTRY_POINTS(iq1_m, mmq_iq1_m, 16, 2)
MMQ_ENTRY_POINTS(iq1_m, mmq_iq1_m, 32, 2)
MMQ_ENTRY_POINTS(iq1_m, mmq_iq1_m, 64, 2)
MMQ_ENTRY_POINTS(iq1_m, mmq_iq1_m, 128, 1)
MMQ_ENTRY_POINTS(iq2_xxs, mmq_iq2_xxs, 16, 2)
MMQ_ENTRY_POINTS(iq2_xxs, mmq_iq2_xxs, 32, 2)
MMQ_ENTRY_POINTS(iq2_xxs, mmq_iq2_xxs, 64, 2)
MMQ_ENTRY_POINTS(iq2_xxs, mmq_iq2_xxs, 128, 1)
MMQ_ENTRY_POINTS(iq2_xs, mmq_iq2_xs, 16, 2)
MMQ_ENTRY_POINTS(iq2_xs, mmq_iq2_xs, 32, 2)
MMQ_ENTRY_POINTS(iq2_xs, mmq_iq2_xs, 64, 2)
MMQ_ENTRY_POINTS(iq2_xs, mmq_iq2_xs, 128, 1)
MMQ_ENTRY_POINTS(iq2_s, mmq_iq2_s, 16, 2)
MMQ_ENTRY_POINTS(iq2_s, mmq_iq2_s, 32, 2)
MMQ_ENTRY_POINTS(iq2_s, mmq_iq2_s, 64, 2)
MMQ_ENTRY_POINTS(iq2_s, mmq_iq2_s, 128, 1)
MMQ_ENTRY_POINTS(iq3_xxs, mmq_iq3_xxs, 16, 2)
MMQ_ENTRY_POINTS(iq3_xxs, mmq_iq3_xxs, 32, 2)
MMQ_ENTRY_POINTS(iq3_xxs, mmq_iq3_xxs, 64, 2)
MMQ_ENTRY_POINTS(iq3_xxs, mmq_iq3_xxs, 128, 1)
MMQ_ENTRY_POINTS(iq3_s, mmq_iq3_s, 16, 2)
MMQ_ENTRY_POINTS(iq3_s, mmq_iq3_s, 32, 2)
MMQ_ENTRY_POINTS(iq3_s, mmq_iq3_s, 64, 2)
MMQ_ENTRY_POINTS(iq3_s, mmq_iq3_s, 128, 1)
MMQ_ENTRY_POINTS(iq4_nl, mmq_iq4_nl, 16, 2)
MMQ_ENTRY_POINTS(iq4_nl, mmq_iq4_nl, 32, 2)
MMQ_ENTRY_POINTS(iq4_nl, mmq_iq4_nl, 64, 2)
MMQ_ENTRY_POINTS(iq4_nl, mmq_iq4_nl, 128, 1)
MMQ_ENTRY_POINTS(iq4_xs, mmq_iq4_xs, 16, 2)
MMQ_ENTRY_POINTS(iq4_xs, mmq_iq4_xs, 32, 2)
MMQ_ENTRY_POINTS(iq4_xs, mmq_iq4_xs, 64, 2)
MMQ_ENTRY_POINTS(iq4_xs, mmq_iq4_xs, 128, 1)
