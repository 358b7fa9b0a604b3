// Mixture-of-experts routing on the card (llama.cpp's build_moe_ffn): router logits -> probabilities (softmax
// or sigmoid) -> the k likeliest experts (ties to the lower id, NaN below every number) -> optional
// renormalization to sum 1 (the sum clamped below at the smallest normal f16, as llama.cpp) -> scale. The
// chosen ids and weights stay in device memory, where the expert matvec kernels read them. Also the weighted
// sum of the chosen experts' outputs.

#define ROUTE_MIN_WEIGHT_SUM 6.103515625e-5f

// The choice of one token's experts by one warp, from its n_expert logits l (global memory, possibly
// written by other blocks of this launch, so read past L1) into probs (n_expert floats of shared memory
// that only this warp uses): probabilities, the k likeliest (k rounds of a warp-wide arg max; the entries
// of lane j are e = j, j+32, ..., so each lane reads and clears only its own and the rounds need no
// barrier), then the weights normalized and scaled. A chosen entry's key becomes -inf and a NaN's is -1,
// so NaN sorts below every probability (which are >= 0) and still above the chosen ones; ties go to the
// lower id. The weights are written in the order chosen and summed in that order.
//
// BIASED (a selection bias, n_expert floats in device memory, as llama.cpp's exp_probs_b): the experts are
// chosen by probability plus bias, their weights are still the unbiased probabilities (the bias only
// chooses). A NaN's biased key is -FLT_MAX (below every number, above the chosen entries' -inf), as the
// CPU's top_k puts NaN last. With changed (one int per token), bit j of it says that the j-th choice is
// one the unbiased choice would not have made: the unbiased k-th key is found first (k rounds of the next
// key below the last, nothing cleared), and a chosen expert ranking after it was brought in by the bias.
// The unbiased instantiation is the kernel as it was, so a launch without a bias computes and costs the
// same.
#define ROUTE_NAN_BIASED_KEY (-3.402823466e38f)

// The warp's largest (v, idx) by v, ties to the lower idx, into every lane (v never NaN: the callers map
// NaN to a number first). On sm_80+ two warp reductions in hardware (redux.sync: one for the largest key,
// one for the lowest index holding it) over a u32 image of v that keeps the order of floats (-0 taken as
// +0, which it equals); before, five rounds of shuffles. The same result either way, so the choice of
// experts does not depend on the card.
static __device__ __forceinline__ void warp_arg_max(float & v, int & idx) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const uint32_t bits = __float_as_uint(v + 0.0f);
    const uint32_t key = bits & 0x80000000u ? ~bits : bits | 0x80000000u;
    const uint32_t best = __reduce_max_sync(FULL_MASK, key);
    idx = (int) __reduce_min_sync(FULL_MASK, key == best ? (uint32_t) idx : 0xffffffffu);
    v = __uint_as_float(best & 0x80000000u ? best & 0x7fffffffu : ~best);
#else
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, v, offset);
        const int oi = __shfl_xor_sync(FULL_MASK, idx, offset);
        if (ov > v || (ov == v && oi < idx)) {
            v = ov;
            idx = oi;
        }
    }
#endif
}

template <bool BIASED>
static __device__ __forceinline__ void choose_experts(const float * l, float * probs, int n_expert, int k,
                                                      int gating, int norm, float scale,
                                                      const float * __restrict__ bias,
                                                      int32_t * __restrict__ ids, float * __restrict__ weights,
                                                      int32_t * __restrict__ changed) {
    const int lane = threadIdx.x;
    if (gating == 0) {
        float mx = -POLY_INF;
        for (int e = lane; e < n_expert; e += WARP_SIZE) {
            mx = fmaxf(mx, __ldcg(l + e));
        }
        mx = warp_max(mx);
        float sum = 0.0f;
        for (int e = lane; e < n_expert; e += WARP_SIZE) {
            const float p = expf(__ldcg(l + e) - mx);
            probs[e] = p;
            sum += p;
        }
        const float inv = 1.0f / warp_sum(sum);
        for (int e = lane; e < n_expert; e += WARP_SIZE) {
            probs[e] *= inv;
        }
    } else {
        for (int e = lane; e < n_expert; e += WARP_SIZE) {
            probs[e] = 1.0f / (1.0f + expf(-__ldcg(l + e)));
        }
    }
    // BIASED with changed: the unbiased k-th key (last_v, last_i); every lane ends with the same.
    float last_v = POLY_INF;
    int last_i = -1;
    if (BIASED && changed != nullptr) {
        __syncwarp();
        for (int j = 0; j < k; ++j) {
            float v = -POLY_INF;
            int idx = 0x7fffffff;
            for (int e = lane; e < n_expert; e += WARP_SIZE) {
                float p = probs[e];
                p = p != p ? -1.0f : p;
                const bool after = p < last_v || (p == last_v && e > last_i);
                if (after && p > v) {
                    v = p;
                    idx = e;
                }
            }
            warp_arg_max(v, idx);
            last_v = v;
            last_i = idx;
        }
    }
    uint32_t swapped_mask = 0;
    float chosen_sum = 0.0f;
    for (int j = 0; j < k; ++j) {
        float v = -POLY_INF;
        int idx = 0x7fffffff;
        for (int e = lane; e < n_expert; e += WARP_SIZE) {
            float p = probs[e];
            if (BIASED) {
                p += bias[e];
                p = p != p ? ROUTE_NAN_BIASED_KEY : p;
            } else {
                p = p != p ? -1.0f : p;
            }
            if (p > v) { // e rises within a lane: the first of equal keys is the lowest id
                v = p;
                idx = e;
            }
        }
        warp_arg_max(v, idx);
        // Every lane holds the same (v, idx) now; the owner lane writes the choice and clears its entry.
        const int owner = idx % WARP_SIZE;
        float p = 0.0f;
        int swapped = 0;
        if (lane == owner) {
            p = probs[idx];
            probs[idx] = -POLY_INF;
            ids[j] = idx;
            weights[j] = p;
            if (BIASED) {
                const float key = p != p ? -1.0f : p;
                swapped = !(key > last_v || (key == last_v && idx <= last_i));
            }
        }
        chosen_sum += __shfl_sync(FULL_MASK, p, owner);
        if (BIASED) {
            swapped_mask |= (uint32_t) __shfl_sync(FULL_MASK, swapped, owner) << j;
        }
    }
    __syncwarp();
    if (BIASED && changed != nullptr && lane == 0) {
        *changed = (int32_t) swapped_mask;
    }
    const float renorm = norm ? 1.0f / fmaxf(chosen_sum, ROUTE_MIN_WEIGHT_SUM) : 1.0f;
    for (int j = lane; j < k; j += WARP_SIZE) {
        float w = weights[j];
        if (norm) {
            w *= renorm;
        }
        weights[j] = w * scale;
    }
}

// Either instantiation: a null bias chooses as the kernel always did.
static __device__ __forceinline__ void choose_experts_any(const float * l, float * probs, int n_expert, int k,
                                                          int gating, int norm, float scale,
                                                          const float * __restrict__ bias,
                                                          int32_t * __restrict__ ids, float * __restrict__ weights,
                                                          int32_t * __restrict__ changed) {
    if (bias != nullptr) {
        choose_experts<true>(l, probs, n_expert, k, gating, norm, scale, bias, ids, weights, changed);
    } else {
        choose_experts<false>(l, probs, n_expert, k, gating, norm, scale, nullptr, ids, weights, nullptr);
    }
}

// logits: [n_tokens, n_expert]; ids: [n_tokens, k] int32; weights: [n_tokens, k]. gating: 0 softmax,
// 1 sigmoid. bias: null, or [n_expert] added to every token's probabilities for the choice only; changed:
// null, or [n_tokens] (with a bias: the choices the bias made, bit j for choice j; k <= 32). Block (32,
// tokens per block): one warp per token; dynamic shared memory: n_expert floats per warp. Grid:
// ceil(n_tokens / tokens per block).
extern "C" __global__ void route_topk(const float * __restrict__ logits, int n_tokens, int n_expert, int k,
                                      int gating, int norm, float scale, int32_t * __restrict__ ids,
                                      float * __restrict__ weights, const float * __restrict__ bias,
                                      int32_t * __restrict__ changed) {
    launch_prologue();
    extern __shared__ float probs_all[];
    const int64_t token = (int64_t) blockIdx.x * blockDim.y + threadIdx.y;
    if (token >= n_tokens) {
        return; // a whole warp: the warp is the unit of work and no barrier spans the block
    }
    choose_experts_any(logits + token * n_expert, probs_all + threadIdx.y * n_expert, n_expert, k, gating,
                       norm, scale, bias, ids + token * k, weights + token * k,
                       changed != nullptr ? changed + token : nullptr);
}

// The router of one token fused with the choice of its experts: block e (of n_expert) computes logit e =
// W[e, :] . x (W: the one matrix of a one-expert address table, as the engine keeps float matrices) as
// matvec_f.cu's matvec_experts_f32 (float_dot.cuh's row dot: the same value) into logits; the block
// that finishes last (last_block_of, ticket: one counter, 0 between launches) chooses the experts as
// route_topk does from all the logits (bias and changed as route_topk's, for the one token). Block (32,
// MATVEC_F_WARPS); dynamic shared memory: n_expert floats.
#define ROUTER_TOPK_ENTRY(name, L)                                                                              \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * MATVEC_F_WARPS)                                    \
        router_topk_##name(const uint64_t * __restrict__ table, const float * __restrict__ x, int ncols, int n_expert, \
                           int k, int gating, int norm, float scale, float * __restrict__ logits,               \
                           unsigned int * __restrict__ ticket, int32_t * __restrict__ ids,                      \
                           float * __restrict__ weights, const float * __restrict__ bias,                       \
                           int32_t * __restrict__ changed) { launch_prologue();                                 \
        extern __shared__ float probs[];                                                                        \
        const int e = blockIdx.x;                                                                               \
        const L::elem * w = (const L::elem *) table[0];                                                         \
        const float v = row_dot_f<L>(w + (int64_t) e * ncols, x, ncols);                                       \
        if (threadIdx.x == 0 && threadIdx.y == 0) {                                                             \
            logits[e] = v;                                                                                      \
        }                                                                                                       \
        if (last_block_of(ticket, gridDim.x) && threadIdx.y == 0) {                                             \
            choose_experts_any(logits, probs, n_expert, k, gating, norm, scale, bias, ids, weights, changed);   \
        }                                                                                                       \
    }

ROUTER_TOPK_ENTRY(f32, load_f32)
ROUTER_TOPK_ENTRY(f16, load_f16)
ROUTER_TOPK_ENTRY(bf16, load_bf16)

// out[t, i] (+)= sum_j weights[t, j] * y[t, j, i]: the weighted sum of a token's k expert outputs.
// y: [n_tokens, k, n]; weights: [n_tokens, k]; out: [n_tokens, n]. Grid (ceil(n/blockDim), n_tokens).
extern "C" __global__ void moe_combine(const float * __restrict__ y, const float * __restrict__ weights, int k,
                                       int n, int accumulate, float * __restrict__ out) {
    launch_prologue();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t t = blockIdx.y;
    if (i >= n) {
        return;
    }
    float acc = accumulate ? out[t * n + i] : 0.0f;
    for (int j = 0; j < k; ++j) {
        acc = fmaf(weights[t * k + j], y[(t * k + j) * n + i], acc);
    }
    out[t * n + i] = acc;
}

// For a prompt's experts grouped by expert (matmul_experts_*): dst[r, :] = src[rows[r], :] (the token of
// sorted row r). Grid (n_sorted); block: 256 threads over the width.
extern "C" __global__ void gather_rows(const float * __restrict__ src, const int32_t * __restrict__ rows,
                                       float * __restrict__ dst, int width) {
    launch_prologue();
    const int64_t r = blockIdx.x;
    const int64_t from = rows[r];
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        dst[r * width + i] = src[from * width + i];
    }
}

// out[t, i] (+)= sum_j weights[t, j] * y_sorted[slot_row[t*k + j], i]: moe_combine for outputs in sorted
// (grouped by expert) order; slot_row maps a token's j-th choice to its sorted row. Grid (n_tokens); block:
// 256 threads over the width. The sum runs over j in order, as moe_combine.
extern "C" __global__ void moe_combine_sorted(const float * __restrict__ y_sorted, const int32_t * __restrict__ slot_row,
                                              const float * __restrict__ weights, float * __restrict__ out, int k,
                                              int width, int add) {
    launch_prologue();
    const int64_t t = blockIdx.x;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float s = 0.0f;
        for (int j = 0; j < k; ++j) {
            s = fmaf(weights[t * k + j], y_sorted[(int64_t) slot_row[t * k + j] * width + i], s);
        }
        out[t * width + i] = add ? out[t * width + i] + s : s;
    }
}
