// Element-wise activations: SiLU and SwiGLU (silu(gate) * up), as ggml defines them (x / (1 + e^-x)).

static __device__ __forceinline__ float silu(float x) {
    return x / (1.0f + expf(-x));
}

extern "C" __global__ void silu_f32(const float * __restrict__ x, float * __restrict__ out, int64_t n) {
    launch_prologue();
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = silu(x[i]);
    }
}

// out may alias gate.
extern "C" __global__ void swiglu_f32(const float * gate, const float * __restrict__ up, float * out, int64_t n) {
    launch_prologue();
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = silu(gate[i]) * up[i];
    }
}

// GELU (tanh approximation) as ggml's CPU backend computes it (kernels/src/ops/act.rs `gelu_ggml`): 0 at or
// below -10, x at or above 10, otherwise gelu of x rounded to f16, itself rounded to f16 (ggml reads an f16
// table indexed by the f16 bits of x). The inner formula as ggml_gelu_f32 is compiled.
static __device__ __forceinline__ float gelu_ggml(float x) {
    if (x <= -10.0f) {
        return 0.0f;
    }
    if (x >= 10.0f) {
        return x;
    }
    const float xh = f16_to_f32(f32_to_f16(x));
    const float p = fmaf(0.044715f * xh, xh, 1.0f);
    const float g = 0.5f * xh * (1.0f + tanhf(0.7978846f * xh * p));
    return f16_to_f32(f32_to_f16(g));
}

extern "C" __global__ void gelu_f32(const float * __restrict__ x, float * __restrict__ out, int64_t n) {
    launch_prologue();
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = gelu_ggml(x[i]);
    }
}

// out may alias gate.
extern "C" __global__ void geglu_f32(const float * gate, const float * __restrict__ up, float * out, int64_t n) {
    launch_prologue();
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = gelu_ggml(gate[i]) * up[i];
    }
}

// x = cap * tanh(x / cap) in place (Gemma's final logit softcapping).
extern "C" __global__ void softcap_f32(float * x, float cap, int64_t n) {
    launch_prologue();
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        x[i] = cap * tanhf(x[i] / cap);
    }
}
