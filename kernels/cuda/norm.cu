// RMS norm over rows: out[r,:] = x[r,:] / sqrt(mean(x[r,:]^2) + eps) * weight (weight may be null), as ggml's
// rms_norm followed by the multiplication with the norm's weight. One thread block per row (group);
// squares summed in f32 per thread, then across the block.

extern "C" __global__ void rms_norm(const float * __restrict__ x, const float * __restrict__ weight,
                                    float * __restrict__ out, int ncols, float eps) {
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
