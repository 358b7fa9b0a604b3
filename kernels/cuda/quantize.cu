// Activation quantization for the integer dot products of matvec_q.cu: f32 -> block_q8_1, as ggml-cuda's
// quantize_q8_1 (d = max|x|/127, quants rounded to nearest), but with s = d * (sum of the quants), as ggml's
// CPU q8_1.

// x: [n] f32 (n a multiple of 32, several rows back to back are one long vector); y: [n/32] block_q8_1.
// One warp per block of 32 values (common.cuh's quantize_value); any block shape whose size is a multiple
// of 32.
extern "C" __global__ void quantize_q8_1(const float * __restrict__ x, block_q8_1 * __restrict__ y, int n) {
    launch_prologue();
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    // Whole warps are inside or outside together since n is a multiple of 32.
    if (i >= n) {
        return;
    }
    quantize_value(x[i], y, i);
}

// SwiGLU straight into the quantized input of the next matrix (an MoE layer's down experts): y =
// q8_1(silu(gate) * up), the value act.cu's swiglu_f32 computes (the same expression), so the result is
// that of swiglu_f32 then quantize_q8_1 bit for bit, in one launch and without the f32 intermediate.
extern "C" __global__ void swiglu_quantize_q8_1(const float * __restrict__ gate, const float * __restrict__ up,
                                                block_q8_1 * __restrict__ y, int n) {
    launch_prologue();
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    const float g = gate[i];
    const float silu = g / (1.0f + expf(-g)); // act.cu's silu
    quantize_value(silu * up[i], y, i);
}

// RMS norm (norm.cu's rms_norm, the same loops and reduction, so the same values) that also writes the
// result quantized, for a norm whose output feeds quantized matrices (one launch instead of two). One block
// per row; ncols a multiple of 32 and blockDim.x a multiple of 32, so each warp quantizes whole blocks of 32
// consecutive values.
extern "C" __global__ void rms_norm_quantize_q8_1(const float * __restrict__ x, const float * __restrict__ weight,
                                                  float * __restrict__ out, block_q8_1 * __restrict__ y, int ncols,
                                                  float eps) {
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
        const float o = weight ? v * weight[i] : v;
        outr[i] = o;
        quantize_value(o, y, row * ncols + i);
    }
}

// The residual add and the RMS norm after it, in one launch (the end of a block and the start of the next):
// sum = a + b (as elementwise.cu's ew_binary adds), out = rms_norm(sum) * weight (weight may be null) with
// norm.cu's loops and reduction, and, when y is not null, out quantized into y as rms_norm_quantize_q8_1
// does. So sum, out and y are bit for bit those of ew_binary then rms_norm (or rms_norm_quantize_q8_1), in
// one launch instead of two. One block per row of ncols values; with y, ncols and blockDim.x are multiples
// of 32 (each warp quantizes whole blocks of 32 values; y null or not is uniform over the launch).
extern "C" __global__ void add_rms_norm_q8_1(const float * __restrict__ a, const float * __restrict__ b,
                                             const float * __restrict__ weight, float * __restrict__ sum_out,
                                             float * __restrict__ out, block_q8_1 * __restrict__ y, int ncols,
                                             float eps) {
    launch_prologue();
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const float * ar = a + row * ncols;
    const float * br = b + row * ncols;
    float * sr = sum_out + row * ncols;
    float * outr = out + row * ncols;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < ncols; i += blockDim.x) {
        const float s = ar[i] + br[i];
        sr[i] = s;
        sum = fmaf(s, s, sum);
    }
    sum = block_sum(sum, scratch);
    const float scale = rsqrtf(sum / (float) ncols + eps);
    // Each thread reads back only the values it wrote itself.
    for (int i = threadIdx.x; i < ncols; i += blockDim.x) {
        const float v = sr[i] * scale;
        const float o = weight ? v * weight[i] : v;
        outr[i] = o;
        if (y) {
            quantize_value(o, y, row * ncols + i);
        }
    }
}

// The end of an MoE block and the norm of the next, in one launch (one token): the routed experts' sum
// `moe`, plus the shared expert's output times the sigmoid of its gate, plus the residual, then
// add_rms_norm_q8_1's norm and quantized copy. Each piece is the expression of the launch it replaces, in
// the same order and rounding: route.cu's moe_combine (from 0, fmaf over the slots in order) when the
// slots come unsummed (k > 0; else `y` is the routed sum itself), elementwise.cu's ew_unary sigmoid and
// ew_binary multiply and add (written __fmul_rn/__fadd_rn so no multiply-add is contracted), then the
// residual add and the norm as add_rms_norm_q8_1 forms them. So sum_out, out and q are bit for bit those of
// moe_combine, the shared expert's sigmoid, multiply and add, and add_rms_norm_q8_1.
struct MoeAddNormArgs {
    const float * y;           // [k, ncols] slot outputs, or [ncols] the routed sum (k == 0)
    const float * weights;     // [k] the slots' weights (k > 0)
    const float * shared;      // [ncols] the shared expert's output, or null
    const float * shared_gate; // [1] its gate before the sigmoid, or null (no gate)
    const float * residual;    // [ncols]
    const float * weight;      // [ncols] the norm's weight, or null
    float * sum_out;           // [ncols] the block's output (the next residual)
    float * out;               // [ncols] normed
    block_q8_1 * q;            // [ncols / 32] normed, quantized
    int k, ncols;
    float eps;
};

// Slots whose outputs a thread loads all at once before it sums them (the sum's order unchanged): a
// token's k experts are 8 to 10 in the families here; more take the plain loop, one load at a time.
#define MOE_ADD_MAX_K 16

extern "C" __global__ void moe_add_rms_norm_q8_1(const MoeAddNormArgs a) {
    launch_prologue();
    __shared__ float scratch[32];
    float gate = 1.0f;
    if (a.shared_gate) {
        const float v = a.shared_gate[0];
        gate = 1.0f / (1.0f + expf(-v)); // ew_unary's sigmoid
    }
    const bool unrolled = a.k > 0 && a.k <= MOE_ADD_MAX_K;
    float w[MOE_ADD_MAX_K];
#pragma unroll
    for (int j = 0; j < MOE_ADD_MAX_K; ++j) {
        w[j] = unrolled && j < a.k ? a.weights[j] : 0.0f;
    }
    float sum = 0.0f;
    for (int i = threadIdx.x; i < a.ncols; i += blockDim.x) {
        float m;
        if (unrolled) {
            // Every slot's load in flight together, then the sum in slot order as moe_combine's.
            float v[MOE_ADD_MAX_K];
#pragma unroll
            for (int j = 0; j < MOE_ADD_MAX_K; ++j) {
                v[j] = j < a.k ? a.y[(int64_t) j * a.ncols + i] : 0.0f;
            }
            m = 0.0f;
#pragma unroll
            for (int j = 0; j < MOE_ADD_MAX_K; ++j) {
                if (j < a.k) {
                    m = fmaf(w[j], v[j], m);
                }
            }
        } else if (a.k > 0) {
            m = 0.0f;
            for (int j = 0; j < a.k; ++j) {
                m = fmaf(a.weights[j], a.y[(int64_t) j * a.ncols + i], m);
            }
        } else {
            m = a.y[i];
        }
        if (a.shared) {
            const float sv = a.shared_gate ? __fmul_rn(a.shared[i], gate) : a.shared[i];
            m = __fadd_rn(m, sv);
        }
        const float s = __fadd_rn(m, a.residual[i]);
        a.sum_out[i] = s;
        sum = fmaf(s, s, sum);
    }
    sum = block_sum(sum, scratch);
    const float scale = rsqrtf(sum / (float) a.ncols + a.eps);
    // Each thread reads back only the values it wrote itself.
    for (int i = threadIdx.x; i < a.ncols; i += blockDim.x) {
        const float v = a.sum_out[i] * scale;
        const float o = a.weight ? v * a.weight[i] : v;
        a.out[i] = o;
        quantize_value(o, a.q, i);
    }
}
