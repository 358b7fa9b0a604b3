// Rotary position embedding (in place or into another buffer), ggml's rope_ext without YaRN: pair i of each head (i < n_rot/2) turns by
// pos * freq_scale * freq_base^(-2i/n_rot). NeoX pairs (i, i + n_rot/2), normal pairs (2i, 2i+1); dimensions
// from n_rot on pass through. Positions come from device memory (one per row), so a captured graph replays
// at new positions.
//
// The angle is formed as the CPU path forms it (kernels/src/ops/rope.rs, ggml's CPU backend): theta_0 = pos,
// theta_{i+1} = theta_i * theta_scale in f32, with theta_scale = freq_base^(-2/n_rot) computed once on the
// host, and each rotated value as fma(x0, cos, -(x1 sin)) / fma(x0, sin, x1 cos). So the GPU and CPU engines
// rotate alike (up to sin/cos rounding), at any position.
//
// freq_factors (n_rot/2 floats, may be null: Llama 3.1+'s rope_freqs.weight) divides pair i's angle before the
// position scale, freq_scale * (theta / freq_factors[i]), as ggml's rope_yarn does with its freq_factors.

// x, out: [nrows, n_heads * head_dim] (out may be x: in place); positions: [nrows]; freq_factors: [n_rot/2] or
// null. Grid (nrows, n_heads); block: n_rot/2 threads (<= 1024). Out of place the dimensions from n_rot on
// are copied.
extern "C" __global__ void rope(const float * x, float * out, const int32_t * __restrict__ positions, int n_heads,
                                int head_dim, int n_rot, int neox, float theta_scale, float freq_scale,
                                const float * __restrict__ freq_factors) {
    launch_prologue();
    const int i = threadIdx.x;
    const int half = n_rot / 2;
    if (i >= half) {
        return;
    }
    const int64_t row = blockIdx.x;
    const float * head = x + (row * n_heads + blockIdx.y) * head_dim;
    float * head_out = out + (row * n_heads + blockIdx.y) * head_dim;
    float theta = (float) positions[row];
    for (int j = 0; j < i; ++j) {
        theta *= theta_scale;
    }
    if (freq_factors) {
        theta = theta / freq_factors[i];
    }
    float s, c;
    sincosf(freq_scale * theta, &s, &c);
    const int a = neox ? i : 2 * i;
    const int b = neox ? i + half : 2 * i + 1;
    const float x0 = head[a];
    const float x1 = head[b];
    for (int d = n_rot + i; d < head_dim; d += half) {
        head_out[d] = head[d];
    }
    head_out[a] = fmaf(x0, c, -(x1 * s));
    head_out[b] = fmaf(x0, s, x1 * c);
}

// The per-head RMS norm (Qwen3's and Gemma 3's Q and K norms) and the rotation after it, in one launch: each
// head is normed as norm.cu's rms_norm norms a row of head_dim values (the same loops over the same number
// of threads, so the same sums) times weight (head_dim values, may be null), kept in shared memory, then
// rotated as rope() above rotates it. The result is bit for bit rms_norm then rope, without the round trip
// of the normed values through global memory and one launch instead of two.
//
// x, out: [nrows, n_heads * head_dim] (distinct); positions: [nrows]; freq_factors: [n_rot/2] or null. Grid
// (nrows, n_heads); block: head_dim rounded up to a multiple of 32 threads, at most 1024 (rms_norm's count for
// a group of head_dim); dynamic shared memory: head_dim floats.
// One head of rms_norm_rope (below): normed into shared memory, then rotated.
static __device__ __forceinline__ void norm_rope_head(const float * __restrict__ head, const float * __restrict__ weight,
                                                      float * __restrict__ head_out, float * normed, float * scratch,
                                                      int position, int head_dim, int n_rot, int neox,
                                                      float theta_scale, float freq_scale,
                                                      const float * __restrict__ freq_factors, float eps) {
    float sum = 0.0f;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        sum = fmaf(head[i], head[i], sum);
    }
    sum = block_sum(sum, scratch);
    const float scale = rsqrtf(sum / (float) head_dim + eps);
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        const float v = head[i] * scale;
        normed[i] = weight ? v * weight[i] : v;
    }
    __syncthreads();
    const int half = n_rot / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float theta = (float) position;
        for (int j = 0; j < i; ++j) {
            theta *= theta_scale;
        }
        if (freq_factors) {
            theta = theta / freq_factors[i];
        }
        float s, c;
        sincosf(freq_scale * theta, &s, &c);
        const int a = neox ? i : 2 * i;
        const int b = neox ? i + half : 2 * i + 1;
        const float x0 = normed[a];
        const float x1 = normed[b];
        head_out[a] = fmaf(x0, c, -(x1 * s));
        head_out[b] = fmaf(x0, s, x1 * c);
    }
    for (int d = n_rot + threadIdx.x; d < head_dim; d += blockDim.x) {
        head_out[d] = normed[d];
    }
}

extern "C" __global__ void rms_norm_rope(const float * __restrict__ x, const float * __restrict__ weight,
                                         float * __restrict__ out, const int32_t * __restrict__ positions,
                                         int n_heads, int head_dim, int n_rot, int neox, float theta_scale,
                                         float freq_scale, const float * __restrict__ freq_factors,
                                         float eps) {
    launch_prologue();
    extern __shared__ float normed[];
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const int64_t at = (row * n_heads + blockIdx.y) * head_dim;
    norm_rope_head(x + at, weight, out + at, normed, scratch, positions[row], head_dim, n_rot, neox, theta_scale,
                   freq_scale, freq_factors, eps);
}

// rms_norm_rope of two tensors of the same rows and heads' shape (a layer's queries and keys, each with its
// own norm weight), in one launch: blocks y < n_heads0 take head y of x0, the others head y - n_heads0 of x1,
// each exactly as rms_norm_rope takes it (the same function), so the values are those of two launches.
// Grid (nrows, n_heads0 + n_heads1); block and shared memory as rms_norm_rope's.
extern "C" __global__ void rms_norm_rope_pair(const float * __restrict__ x0, const float * __restrict__ weight0,
                                              float * __restrict__ out0, int n_heads0,
                                              const float * __restrict__ x1, const float * __restrict__ weight1,
                                              float * __restrict__ out1, const int32_t * __restrict__ positions,
                                              int n_heads1, int head_dim, int n_rot, int neox, float theta_scale,
                                              float freq_scale, const float * __restrict__ freq_factors,
                                              float eps) {
    launch_prologue();
    extern __shared__ float normed[];
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const bool first = (int) blockIdx.y < n_heads0;
    const int64_t at = first ? (row * n_heads0 + blockIdx.y) * head_dim
                             : (row * n_heads1 + (blockIdx.y - n_heads0)) * head_dim;
    const float * x = first ? x0 : x1;
    float * out = first ? out0 : out1;
    norm_rope_head(x + at, first ? weight0 : weight1, out + at, normed, scratch, positions[row], head_dim, n_rot,
                   neox, theta_scale, freq_scale, freq_factors, eps);
}
