// RMS norm over rows: out[r,:] = x[r,:] / sqrt(mean(x[r,:]^2) + eps) * weight (weight may be null), as ggml's
// rms_norm followed by the multiplication with the norm's weight. One thread block per row (group);
// squares summed in f32 per thread, then across the block.

extern "C" __global__ void rms_norm(const float * __restrict__ x, const float * __restrict__ weight,
                                    float * __restrict__ out, int ncols, float eps) {
    launch_prologue();
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const float * xr = x + row * ncols;
    float * outr = out + row * ncols;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < ncols; i += blockDim.x) {
        sum = fmaf(xr[i], xr[i], sum);
    }
    sum = block_sum(sum, scratch);
    const float scale = rsqrtf(sum / (float) ncols + eps);
    for (int i = threadIdx.x; i < ncols; i += blockDim.x) {
        const float v = xr[i] * scale;
        outr[i] = weight ? v * weight[i] : v;
    }
}

// Columns start..start+len of each row of x [rows, in_cols], RMS-normed in groups of `group` values (no
// weight) and multiplied by s, into out [rows, len]: Qwen3.5's L2 norm of q and k (llama.cpp's
// build_gdn_l2_norm: rms_norm with eps/n, times 1/sqrt(n)) read straight from the convolution's output.
// The values of elementwise.cu's ew_cols, rms_norm above (the same loops over the same thread count) and
// ew_scale, bit for bit, in one launch. One block per group: grid rows * (len / group).
extern "C" __global__ void rms_norm_cols_scale(const float * __restrict__ x, float * __restrict__ out,
                                               int in_cols, int start, int len, int group, float eps, float s) {
    launch_prologue();
    __shared__ float scratch[32];
    const int groups_per_row = len / group;
    const int64_t row = blockIdx.x / groups_per_row;
    const int g = blockIdx.x % groups_per_row;
    const float * xr = x + row * in_cols + start + (int64_t) g * group;
    float * outr = out + row * len + (int64_t) g * group;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        sum = fmaf(xr[i], xr[i], sum);
    }
    sum = block_sum(sum, scratch);
    const float scale = rsqrtf(sum / (float) group + eps);
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        const float v = xr[i] * scale;
        outr[i] = v * s;
    }
}
