// Element-wise activations: SiLU and SwiGLU (silu(gate) * up), as ggml defines them (x / (1 + e^-x)).

static __device__ __forceinline__ float silu(float x) {
    return x / (1.0f + expf(-x));
}

extern "C" __global__ void silu_f32(const float * __restrict__ x, float * __restrict__ out, int64_t n) {
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = silu(x[i]);
    }
}

// out may alias gate.
extern "C" __global__ void swiglu_f32(const float * gate, const float * __restrict__ up, float * out, int64_t n) {
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = silu(gate[i]) * up[i];
    }
}
