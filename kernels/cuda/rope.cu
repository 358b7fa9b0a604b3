// Rotary position embedding in place, ggml's rope_ext without YaRN: pair i of each head (i < n_rot/2) turns by
// pos * freq_scale * freq_base^(-2i/n_rot). NeoX pairs (i, i + n_rot/2), normal pairs (2i, 2i+1); dimensions
// from n_rot on pass through. Positions come from device memory (one per row), so a captured graph replays
// at new positions.

// x: [nrows, n_heads * head_dim]; positions: [nrows]. Grid (nrows, n_heads); block: n_rot/2 threads (<= 1024).
extern "C" __global__ void rope(float * __restrict__ x, const int32_t * __restrict__ positions, int n_heads,
                                int head_dim, int n_rot, int neox, float freq_base, float freq_scale) {
    const int i = threadIdx.x;
    const int half = n_rot / 2;
    if (i >= half) {
        return;
    }
    const int64_t row = blockIdx.x;
    float * head = x + (row * n_heads + blockIdx.y) * head_dim;
    const float theta_scale = powf(freq_base, -2.0f / (float) n_rot);
    const float theta = (float) positions[row] * powf(theta_scale, (float) i) * freq_scale;
    float s, c;
    sincosf(theta, &s, &c);
    const int a = neox ? i : 2 * i;
    const int b = neox ? i + half : 2 * i + 1;
    const float x0 = head[a];
    const float x1 = head[b];
    head[a] = x0 * c - x1 * s;
    head[b] = x0 * s + x1 * c;
}
