// The linear-attention (gated delta-net) pieces of qwen35moe, for decode and prompts: the causal depthwise
// convolution with its carried state (ggml's ssm_conv, optionally followed by SiLU), the L2 norm of q and k,
// the gated delta rule advancing its state, and the RMS norm gated by silu(z). The CPU ops they replace:
// kernels/src/ops/recurrent.rs, kernels/src/ops/norm.rs (and the composition in
// models/src/arch/qwen35moe.rs).

static __device__ __forceinline__ float silu_f(float x) {
    return x / (1.0f + expf(-x));
}

#define CONV_MAX_KERNEL 8

// x [n, channels]; weight [channels, kernel]; state [kernel-1, channels] (oldest first), advanced;
// out [n, channels]. One thread per channel walks the tokens in order, the window in registers. Products
// rounded, then added in tap order from zero (no fused multiply-add), as the CPU op: equal results.
extern "C" __global__ void conv1d_causal(const float * __restrict__ x, const float * __restrict__ weight,
                                         float * __restrict__ state, float * __restrict__ out, int n,
                                         int channels, int kernel, int apply_silu) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) {
        return;
    }
    float win[CONV_MAX_KERNEL];
    float w[CONV_MAX_KERNEL];
    for (int i = 0; i < kernel; ++i) {
        w[i] = weight[(int64_t) c * kernel + i];
    }
    for (int i = 0; i < kernel - 1; ++i) {
        win[i] = state[(int64_t) i * channels + c];
    }
    for (int t = 0; t < n; ++t) {
        win[kernel - 1] = x[(int64_t) t * channels + c];
        float s = 0.0f;
        for (int i = 0; i < kernel; ++i) {
            s = __fadd_rn(s, __fmul_rn(win[i], w[i]));
        }
        out[(int64_t) t * channels + c] = apply_silu ? silu_f(s) : s;
        for (int i = 0; i + 1 < kernel; ++i) {
            win[i] = win[i + 1];
        }
    }
    for (int i = 0; i < kernel - 1; ++i) {
        state[(int64_t) i * channels + c] = win[i];
    }
}

// Per group of `group` values: mode 0: x / max(|x|, eps) (ggml's l2_norm); mode 1: x / sqrt(|x|^2 + eps)
// (llama.cpp's delta-net q/k norm, an rms_norm with eps/n times 1/sqrt(n)). One block per group.
extern "C" __global__ void l2_norm(const float * __restrict__ x, float * __restrict__ out, int group, float eps,
                                   int mode) {
    __shared__ float scratch[32];
    const int64_t g = blockIdx.x;
    const float * xr = x + g * group;
    float * outr = out + g * group;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        sum = fmaf(xr[i], xr[i], sum);
    }
    sum = block_sum(sum, scratch);
    const float scale = mode == 0 ? 1.0f / fmaxf(sqrtf(sum), eps) : rsqrtf(sum + eps);
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        outr[i] = xr[i] * scale;
    }
}

// out = rms_norm(x) * weight * silu(z) per group of `group` values (weight has `group` values, shared by
// every group). One block per group.
extern "C" __global__ void rms_norm_gated(const float * __restrict__ x, const float * __restrict__ weight,
                                          const float * __restrict__ z, float * __restrict__ out, int group,
                                          float eps) {
    __shared__ float scratch[32];
    const int64_t g = blockIdx.x;
    const float * xr = x + g * group;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        sum = fmaf(xr[i], xr[i], sum);
    }
    sum = block_sum(sum, scratch);
    const float scale = rsqrtf(sum / (float) group + eps);
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        out[g * group + i] = xr[i] * scale * weight[i] * silu_f(z[g * group + i]);
    }
}

#define DELTA_MAX_K 256
#define DELTA_K_PER_LANE (DELTA_MAX_K / WARP_SIZE)
#define DELTA_WARPS 4

// The gated delta rule over n tokens (decode: n = 1; a prompt: its tokens in order). For each token and
// value head h, with g = e^gate: S <- g S; delta = beta (v - S k); S <- S + delta k^T; out = (S q)/sqrt(dk).
// Row j of a head's state S ([head_v][head_k]) only ever needs its own delta_j = beta (v_j - S_j . k), so
// the rows evolve independently: one warp per row, the row in registers (head_k/32 values per lane) for
// the whole prompt, read and written once. Value head h reads q/k head h % n_k_heads (llama.cpp's tiling
// of key heads over value heads), so q and k need not be repeated.
// q, k [n, n_k_heads*head_k]; v, out [n, n_v_heads*head_v]; gate, beta [n, n_v_heads];
// state [n_v_heads][head_v][head_k]. Grid (head_v / DELTA_WARPS rounded up, n_v_heads); block (32, DELTA_WARPS).
extern "C" __global__ void __launch_bounds__(WARP_SIZE * DELTA_WARPS)
    gated_delta_rule(const float * __restrict__ q, const float * __restrict__ k, const float * __restrict__ v,
                     const float * __restrict__ gate, const float * __restrict__ beta, float * __restrict__ state,
                     float * __restrict__ out, int n, int n_k_heads, int n_v_heads, int head_k, int head_v) {
    const int h = blockIdx.y;
    const int j = blockIdx.x * DELTA_WARPS + threadIdx.y;
    if (j >= head_v) {
        return; // whole warps leave: no block-wide synchronization below
    }
    const int lane = threadIdx.x;
    const int hq = h % n_k_heads;
    float * srow = state + ((int64_t) h * head_v + j) * head_k;
    float s[DELTA_K_PER_LANE];
#pragma unroll
    for (int t = 0; t < DELTA_K_PER_LANE; ++t) {
        const int i = lane + t * WARP_SIZE;
        s[t] = i < head_k ? srow[i] : 0.0f;
    }
    const float out_scale = rsqrtf((float) head_k);
    for (int tok = 0; tok < n; ++tok) {
        const float * kt = k + ((int64_t) tok * n_k_heads + hq) * head_k;
        const float * qt = q + ((int64_t) tok * n_k_heads + hq) * head_k;
        const float g = expf(gate[(int64_t) tok * n_v_heads + h]);
        const float b = beta[(int64_t) tok * n_v_heads + h];
        const float vj = v[((int64_t) tok * n_v_heads + h) * head_v + j];
        float kv[DELTA_K_PER_LANE];
        float sk = 0.0f;
#pragma unroll
        for (int t = 0; t < DELTA_K_PER_LANE; ++t) {
            const int i = lane + t * WARP_SIZE;
            kv[t] = i < head_k ? kt[i] : 0.0f;
            s[t] *= g;
            sk = fmaf(s[t], kv[t], sk);
        }
        sk = warp_sum(sk);
        const float delta = (vj - sk) * b;
        float sq = 0.0f;
#pragma unroll
        for (int t = 0; t < DELTA_K_PER_LANE; ++t) {
            const int i = lane + t * WARP_SIZE;
            s[t] = fmaf(kv[t], delta, s[t]);
            sq = fmaf(s[t], i < head_k ? qt[i] : 0.0f, sq);
        }
        sq = warp_sum(sq);
        if (lane == 0) {
            out[((int64_t) tok * n_v_heads + h) * head_v + j] = sq * out_scale;
        }
    }
#pragma unroll
    for (int t = 0; t < DELTA_K_PER_LANE; ++t) {
        const int i = lane + t * WARP_SIZE;
        if (i < head_k) {
            srow[i] = s[t];
        }
    }
}
