// Mixture-of-experts routing on the card (llama.cpp's build_moe_ffn): router logits -> probabilities (softmax
// or sigmoid) -> the k likeliest experts (ties to the lower id, NaN below every number) -> optional
// renormalization to sum 1 (the sum clamped below at the smallest normal f16, as llama.cpp) -> scale. The
// chosen ids and weights stay in device memory, where the expert matvec kernels read them. Also the weighted
// sum of the chosen experts' outputs.

#define ROUTE_MIN_WEIGHT_SUM 6.103515625e-5f

// logits: [n_tokens, n_expert]; ids: [n_tokens, k] int32; weights: [n_tokens, k].
// Grid: n_tokens blocks; block: up to 1024 threads (a multiple of 32); dynamic shared memory: n_expert floats.
// gating: 0 softmax, 1 sigmoid.
extern "C" __global__ void route_topk(const float * __restrict__ logits, int n_expert, int k, int gating, int norm,
                                      float scale, int32_t * __restrict__ ids, float * __restrict__ weights) {
    launch_prologue();
    extern __shared__ float probs[];
    __shared__ float scratch[32];
    __shared__ float best_val[32];
    __shared__ int best_idx[32];
    __shared__ float chosen_sum;
    const int64_t token = blockIdx.x;
    const float * l = logits + token * n_expert;

    if (gating == 0) {
        float mx = -POLY_INF;
        for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
            mx = fmaxf(mx, l[e]);
        }
        mx = block_max(mx, scratch);
        float sum = 0.0f;
        for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
            const float p = expf(l[e] - mx);
            probs[e] = p;
            sum += p;
        }
        sum = block_sum(sum, scratch);
        const float inv = 1.0f / sum;
        for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
            probs[e] *= inv;
        }
    } else {
        for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
            probs[e] = 1.0f / (1.0f + expf(-l[e]));
        }
    }
    if (threadIdx.x == 0) {
        chosen_sum = 0.0f;
    }
    __syncthreads();

    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int n_warps = blockDim.x / WARP_SIZE;
    // Probabilities are >= 0: a chosen expert's key is -inf, a NaN's is -1, so NaN sorts below every number
    // and still above the chosen ones.
    for (int j = 0; j < k && j < n_expert; ++j) {
        float v = -POLY_INF;
        int idx = 0x7fffffff;
        for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
            float p = probs[e];
            p = p != p ? -1.0f : p;
            if (p > v || (p == v && e < idx)) {
                v = p;
                idx = e;
            }
        }
#pragma unroll
        for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, v, offset);
            const int oi = __shfl_xor_sync(FULL_MASK, idx, offset);
            if (ov > v || (ov == v && oi < idx)) {
                v = ov;
                idx = oi;
            }
        }
        if (lane == 0) {
            best_val[warp] = v;
            best_idx[warp] = idx;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < n_warps; ++w) {
                if (best_val[w] > v || (best_val[w] == v && best_idx[w] < idx)) {
                    v = best_val[w];
                    idx = best_idx[w];
                }
            }
            const float p = probs[idx];
            ids[token * k + j] = idx;
            weights[token * k + j] = p;
            chosen_sum += p;
            probs[idx] = -POLY_INF;
        }
        __syncthreads();
    }
    if (threadIdx.x < k) {
        float w = weights[token * k + threadIdx.x];
        if (norm) {
            w *= 1.0f / fmaxf(chosen_sum, ROUTE_MIN_WEIGHT_SUM);
        }
        weights[token * k + threadIdx.x] = w * scale;
    }
}

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
