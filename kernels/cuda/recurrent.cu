// The linear-attention (gated delta-net) pieces of qwen35moe, for decode and prompts: the causal depthwise
// convolution with its carried state (ggml's ssm_conv, optionally followed by SiLU), the L2 norm of q and k,
// the gated delta rule advancing its state, and the RMS norm gated by silu(z). The CPU ops they replace:
// kernels/src/ops/recurrent.rs, kernels/src/ops/norm.rs (and the composition in
// models/src/arch/qwen35moe.rs).

static __device__ __forceinline__ float silu_f(float x) {
    return x / (1.0f + expf(-x));
}

#define CONV_MAX_KERNEL 8

// One tap of the convolution's sum, in the CPU's order (kernels/src/ops/recurrent.rs, ggml's compiled
// ssm_conv): the taps of whole groups of four add rounded products, the remaining taps are fused (so
// Qwen3.5's 4 taps add rounded products and LFM2's 3 fuse all three).
static __device__ __forceinline__ float conv_tap(float s, float x, float w, bool rounded) {
    return rounded ? __fadd_rn(s, __fmul_rn(x, w)) : fmaf(x, w, s);
}

// x [n, channels]; weight [channels, kernel]; state [kernel-1, channels] (oldest first), advanced;
// out [n, channels]. One thread per channel walks the tokens in order, the window in registers. The taps
// added in order from zero as the CPU op adds them (conv_tap): equal results.
extern "C" __global__ void conv1d_causal(const float * __restrict__ x, const float * __restrict__ weight,
                                         float * __restrict__ state, float * __restrict__ out, int n,
                                         int channels, int kernel, int apply_silu) {
    launch_prologue();
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
            s = conv_tap(s, win[i], w[i], i < kernel / 4 * 4);
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

// The prompt form of conv1d_causal: the same sums (conv_tap in tap order from zero: equal results), every output independent of the others, so the tokens spread over the card instead of one thread
// per channel walking them all (a latency-bound chain of 2,000 loads for a 2,000-token prompt). Output t reads
// the window cat[t .. t+kernel) of cat = (state rows, then x rows); a thread computes CONV_TOKENS tokens of
// one channel from one window in registers. The state is left for conv1d_state_advance (launched after it:
// this kernel's first tokens read the old state). Grid (channels / 128 rounded up, n / CONV_TOKENS rounded
// up); block 128.
#define CONV_TOKENS 8

extern "C" __global__ void conv1d_causal_tokens(const float * __restrict__ x, const float * __restrict__ weight,
                                                const float * __restrict__ state, float * __restrict__ out,
                                                int n, int channels, int kernel, int apply_silu) {
    launch_prologue();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int t0 = blockIdx.y * CONV_TOKENS;
    if (c >= channels) {
        return;
    }
    float w[CONV_MAX_KERNEL];
    for (int i = 0; i < kernel; ++i) {
        w[i] = weight[(int64_t) c * kernel + i];
    }
    // cat[t0 + i] for i < kernel - 1 + CONV_TOKENS.
    float win[CONV_MAX_KERNEL - 1 + CONV_TOKENS];
#pragma unroll
    for (int i = 0; i < CONV_MAX_KERNEL - 1 + CONV_TOKENS; ++i) {
        const int p = t0 + i; // position in cat
        float v = 0.0f;
        if (i < kernel - 1 + CONV_TOKENS && p < n + kernel - 1) {
            v = p < kernel - 1 ? state[(int64_t) p * channels + c] : x[(int64_t) (p - (kernel - 1)) * channels + c];
        }
        win[i] = v;
    }
#pragma unroll
    for (int j = 0; j < CONV_TOKENS; ++j) {
        const int t = t0 + j;
        if (t < n) {
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < CONV_MAX_KERNEL; ++i) {
                if (i < kernel) {
                    s = conv_tap(s, win[j + i], w[i], i < kernel / 4 * 4);
                }
            }
            out[(int64_t) t * channels + c] = apply_silu ? silu_f(s) : s;
        }
    }
}

// state <- cat[n .. n+kernel-1) (the last kernel-1 rows of state then x), after conv1d_causal_tokens. One
// thread per channel, rows in ascending order: row i reads row n + i > i of the old state, not yet written.
extern "C" __global__ void conv1d_state_advance(const float * __restrict__ x, float * __restrict__ state, int n,
                                                int channels, int kernel) {
    launch_prologue();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) {
        return;
    }
    for (int i = 0; i < kernel - 1; ++i) {
        const int p = n + i;
        state[(int64_t) i * channels + c] =
            p < kernel - 1 ? state[(int64_t) p * channels + c] : x[(int64_t) (p - (kernel - 1)) * channels + c];
    }
}

// Per group of `group` values: mode 0: x / max(|x|, eps) (ggml's l2_norm); mode 1: x / sqrt(|x|^2 + eps)
// (llama.cpp's delta-net q/k norm, an rms_norm with eps/n times 1/sqrt(n)). One block per group.
extern "C" __global__ void l2_norm(const float * __restrict__ x, float * __restrict__ out, int group, float eps,
                                   int mode) {
    launch_prologue();
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
    launch_prologue();
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
    launch_prologue();
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
    // A token's inputs (k, q, e^gate, beta, v_j), loaded one token ahead so the loads are in flight while the
    // previous token's sums reduce: the loop is then a chain of reductions only.
    float kv[DELTA_K_PER_LANE], qv[DELTA_K_PER_LANE];
    float g = 0.0f, b = 0.0f, vj = 0.0f;
    auto load = [&](int tok, float (&kd)[DELTA_K_PER_LANE], float (&qd)[DELTA_K_PER_LANE], float & gd,
                    float & bd, float & vd) {
        const float * kt = k + ((int64_t) tok * n_k_heads + hq) * head_k;
        const float * qt = q + ((int64_t) tok * n_k_heads + hq) * head_k;
#pragma unroll
        for (int t = 0; t < DELTA_K_PER_LANE; ++t) {
            const int i = lane + t * WARP_SIZE;
            kd[t] = i < head_k ? kt[i] : 0.0f;
            qd[t] = i < head_k ? qt[i] : 0.0f;
        }
        gd = expf(gate[(int64_t) tok * n_v_heads + h]);
        bd = beta[(int64_t) tok * n_v_heads + h];
        vd = v[((int64_t) tok * n_v_heads + h) * head_v + j];
    };
    if (n > 0) {
        load(0, kv, qv, g, b, vj);
    }
    for (int tok = 0; tok < n; ++tok) {
        float kn[DELTA_K_PER_LANE], qn[DELTA_K_PER_LANE];
        float gn = 0.0f, bn = 0.0f, vn = 0.0f;
        if (tok + 1 < n) {
            load(tok + 1, kn, qn, gn, bn, vn);
        }
        // With S' = g S: S'k, S'q and k.q in one reduction; then S'' = S' + delta k^T gives
        // S''q = S'q + delta (k.q) without a second one.
        float sk = 0.0f, sq = 0.0f, kq = 0.0f;
#pragma unroll
        for (int t = 0; t < DELTA_K_PER_LANE; ++t) {
            s[t] *= g;
            sk = fmaf(s[t], kv[t], sk);
            sq = fmaf(s[t], qv[t], sq);
            kq = fmaf(kv[t], qv[t], kq);
        }
#pragma unroll
        for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
            sk += __shfl_xor_sync(FULL_MASK, sk, offset);
            sq += __shfl_xor_sync(FULL_MASK, sq, offset);
            kq += __shfl_xor_sync(FULL_MASK, kq, offset);
        }
        const float delta = (vj - sk) * b;
#pragma unroll
        for (int t = 0; t < DELTA_K_PER_LANE; ++t) {
            s[t] = fmaf(kv[t], delta, s[t]);
        }
        if (lane == 0) {
            out[((int64_t) tok * n_v_heads + h) * head_v + j] = fmaf(delta, kq, sq) * out_scale;
        }
#pragma unroll
        for (int t = 0; t < DELTA_K_PER_LANE; ++t) {
            kv[t] = kn[t];
            qv[t] = qn[t];
        }
        g = gn;
        b = bn;
        vj = vn;
    }
#pragma unroll
    for (int t = 0; t < DELTA_K_PER_LANE; ++t) {
        const int i = lane + t * WARP_SIZE;
        if (i < head_k) {
            srow[i] = s[t];
        }
    }
}

#define DELTA_LPR 8
#define DELTA_ROWS_PER_WARP (WARP_SIZE / DELTA_LPR)
#define DELTA_BLOCK_ROWS (DELTA_WARPS * DELTA_ROWS_PER_WARP)
#define DELTA_SMALL_K 128
#define DELTA_SMALL_KPL (DELTA_SMALL_K / DELTA_LPR)
#define DELTA_CHUNK 16
#define DELTA_THREADS (WARP_SIZE * DELTA_WARPS)
// float4 loads per thread to stage a chunk's k (or q): DELTA_CHUNK x DELTA_SMALL_K floats.
#define DELTA_KQ_ITEMS (DELTA_CHUNK * DELTA_SMALL_K / 4 / DELTA_THREADS)

// gated_delta_rule for key heads of at most DELTA_SMALL_K (Qwen3.5/3.6: 128), over a prompt. The rows
// (DELTA_LPR lanes each, DELTA_SMALL_KPL values per lane) are cheap to advance; what bounds the prompt
// form is the latency of each token's loads, which a row's chain of tokens waits for. So the block (the
// DELTA_BLOCK_ROWS rows of one head, which all read the same k and q) stages DELTA_CHUNK tokens' k, q,
// gate, beta and its rows' v in shared memory, the next chunk's loads in flight in registers while the
// current one is advanced token by token from shared memory. Per token: S <- g S; S'k, S'q and k.q in one
// reduction over the row's lanes; delta = beta (v - S'k); S <- S + delta k^T; out = (S'q + delta k.q) /
// sqrt(dk) (the same value as S q after the update). Grid (head_v / DELTA_BLOCK_ROWS rounded up,
// n_v_heads); block (32, DELTA_WARPS).
extern "C" __global__ void __launch_bounds__(DELTA_THREADS)
    gated_delta_rule_k128(const float * __restrict__ q, const float * __restrict__ k, const float * __restrict__ v,
                          const float * __restrict__ gate, const float * __restrict__ beta,
                          float * __restrict__ state, float * __restrict__ out, int n, int n_k_heads,
                          int n_v_heads, int head_k, int head_v) {
    launch_prologue();
    __shared__ __align__(16) float sh_k[DELTA_CHUNK][DELTA_SMALL_K];
    __shared__ __align__(16) float sh_q[DELTA_CHUNK][DELTA_SMALL_K];
    __shared__ float sh_g[DELTA_CHUNK], sh_b[DELTA_CHUNK];
    __shared__ float sh_v[DELTA_CHUNK][DELTA_BLOCK_ROWS];
    const int h = blockIdx.y;
    const int tid = threadIdx.y * WARP_SIZE + threadIdx.x;
    const int lane = threadIdx.x;
    const int sub = lane % DELTA_LPR;
    const int row_in_block = threadIdx.y * DELTA_ROWS_PER_WARP + lane / DELTA_LPR;
    const int block_row0 = blockIdx.x * DELTA_BLOCK_ROWS;
    // A row past head_v (head_v not a multiple of the block's rows) computes row head_v - 1 again, for the
    // shuffles, and writes nothing. The block stays whole: it synchronizes.
    const int j_raw = block_row0 + row_in_block;
    const bool valid = j_raw < head_v;
    const int j = valid ? j_raw : head_v - 1;
    const int hq = h % n_k_heads;
    // head_k a multiple of 4 (the launcher checks) so k/q rows load as float4.
    const int k4 = head_k / 4;

    // The staging registers of one chunk: k and q (float4 items), gate/beta (thread < DELTA_CHUNK), v.
    float4 rk[DELTA_KQ_ITEMS], rq[DELTA_KQ_ITEMS];
    float rg = 0.0f, rb = 0.0f;
    float rv[DELTA_CHUNK * DELTA_BLOCK_ROWS / DELTA_THREADS];
    auto fetch = [&](int t0) {
#pragma unroll
        for (int it = 0; it < DELTA_KQ_ITEMS; ++it) {
            const int idx = tid + it * DELTA_THREADS;
            const int tt = idx / (DELTA_SMALL_K / 4), c4 = idx % (DELTA_SMALL_K / 4);
            const int tok = t0 + tt;
            float4 kk = make_float4(0.0f, 0.0f, 0.0f, 0.0f), qq = kk;
            if (tok < n && c4 < k4) {
                kk = *(const float4 *) (k + ((int64_t) tok * n_k_heads + hq) * head_k + 4 * c4);
                qq = *(const float4 *) (q + ((int64_t) tok * n_k_heads + hq) * head_k + 4 * c4);
            }
            rk[it] = kk;
            rq[it] = qq;
        }
        if (tid < DELTA_CHUNK) {
            const int tok = t0 + tid;
            rg = tok < n ? expf(gate[(int64_t) tok * n_v_heads + h]) : 1.0f;
            rb = tok < n ? beta[(int64_t) tok * n_v_heads + h] : 0.0f;
        }
#pragma unroll
        for (int it = 0; it < DELTA_CHUNK * DELTA_BLOCK_ROWS / DELTA_THREADS; ++it) {
            const int idx = tid + it * DELTA_THREADS;
            const int tt = idx / DELTA_BLOCK_ROWS, r = idx % DELTA_BLOCK_ROWS;
            const int tok = t0 + tt;
            const int jr = min(block_row0 + r, head_v - 1);
            rv[it] = tok < n ? v[((int64_t) tok * n_v_heads + h) * head_v + jr] : 0.0f;
        }
    };
    auto store = [&]() {
#pragma unroll
        for (int it = 0; it < DELTA_KQ_ITEMS; ++it) {
            const int idx = tid + it * DELTA_THREADS;
            const int tt = idx / (DELTA_SMALL_K / 4), c4 = idx % (DELTA_SMALL_K / 4);
            *(float4 *) &sh_k[tt][4 * c4] = rk[it];
            *(float4 *) &sh_q[tt][4 * c4] = rq[it];
        }
        if (tid < DELTA_CHUNK) {
            sh_g[tid] = rg;
            sh_b[tid] = rb;
        }
#pragma unroll
        for (int it = 0; it < DELTA_CHUNK * DELTA_BLOCK_ROWS / DELTA_THREADS; ++it) {
            const int idx = tid + it * DELTA_THREADS;
            sh_v[idx / DELTA_BLOCK_ROWS][idx % DELTA_BLOCK_ROWS] = rv[it];
        }
    };

    float * srow = state + ((int64_t) h * head_v + j) * head_k;
    float s[DELTA_SMALL_KPL];
#pragma unroll
    for (int t = 0; t < DELTA_SMALL_KPL; ++t) {
        const int i = sub + t * DELTA_LPR;
        s[t] = i < head_k ? srow[i] : 0.0f;
    }
    const float out_scale = rsqrtf((float) head_k);

    fetch(0);
    store();
    __syncthreads();
    for (int t0 = 0; t0 < n; t0 += DELTA_CHUNK) {
        const bool more = t0 + DELTA_CHUNK < n;
        if (more) {
            fetch(t0 + DELTA_CHUNK);
        }
        const int tn = min(DELTA_CHUNK, n - t0);
        for (int tt = 0; tt < tn; ++tt) {
            const float g = sh_g[tt];
            float kv[DELTA_SMALL_KPL], qv[DELTA_SMALL_KPL];
#pragma unroll
            for (int t = 0; t < DELTA_SMALL_KPL; ++t) {
                kv[t] = sh_k[tt][sub + t * DELTA_LPR];
                qv[t] = sh_q[tt][sub + t * DELTA_LPR];
            }
            float sk = 0.0f, sq = 0.0f, kq = 0.0f;
#pragma unroll
            for (int t = 0; t < DELTA_SMALL_KPL; ++t) {
                s[t] *= g;
                sk = fmaf(s[t], kv[t], sk);
                sq = fmaf(s[t], qv[t], sq);
                kq = fmaf(kv[t], qv[t], kq);
            }
#pragma unroll
            for (int offset = DELTA_LPR / 2; offset > 0; offset >>= 1) {
                sk += __shfl_xor_sync(FULL_MASK, sk, offset);
                sq += __shfl_xor_sync(FULL_MASK, sq, offset);
                kq += __shfl_xor_sync(FULL_MASK, kq, offset);
            }
            const float delta = (sh_v[tt][row_in_block] - sk) * sh_b[tt];
#pragma unroll
            for (int t = 0; t < DELTA_SMALL_KPL; ++t) {
                s[t] = fmaf(kv[t], delta, s[t]);
            }
            if (sub == 0 && valid) {
                out[((int64_t) (t0 + tt) * n_v_heads + h) * head_v + j] = fmaf(delta, kq, sq) * out_scale;
            }
        }
        __syncthreads();
        if (more) {
            store();
        }
        __syncthreads();
    }
    if (valid) {
#pragma unroll
        for (int t = 0; t < DELTA_SMALL_KPL; ++t) {
            const int i = sub + t * DELTA_LPR;
            if (i < head_k) {
                srow[i] = s[t];
            }
        }
    }
}
