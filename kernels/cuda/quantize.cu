// Activation quantization for the integer dot products of matvec_q.cu: f32 -> block_q8_1, as ggml-cuda's
// quantize_q8_1 (d = max|x|/127, quants rounded to nearest), but with s = d * (sum of the quants), as ggml's
// CPU q8_1.

// x: [n] f32 (n a multiple of 32, several rows back to back are one long vector); y: [n/32] block_q8_1.
// One warp per block of 32 values; any block shape whose size is a multiple of 32.
extern "C" __global__ void quantize_q8_1(const float * __restrict__ x, block_q8_1 * __restrict__ y, int n) {
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t ib = i / QK8_1;
    const int iq = (int) (i % QK8_1);
    // Whole warps are inside or outside together since n is a multiple of 32.
    if (i >= n) {
        return;
    }
    const float xi = x[i];
    const float amax = warp_max(fabsf(xi));
    const float d = amax / 127.0f;
    const int8_t q = amax == 0.0f ? 0 : (int8_t) roundf(xi / d);
    // s = d * (sum of the quants), as ggml's CPU q8_1 (ggml-cuda stores the sum of the unquantized values
    // instead): the formats with an offset or minimum (Q4_0, Q4_1, Q5_0, Q5_1) then multiply their offset
    // by the same quantized activations as their quants, and their error against the exact product is the
    // CPU's (about 6x lower for Q4_1 than with the exact sum; kernels/tests/cuda_layer_ops.rs measures it).
    const float sumq = warp_sum((float) q); // exact: integers below 2^24
    y[ib].qs[iq] = q;
    if (iq == 0) {
        y[ib].d = f32_to_f16(d);
        y[ib].s = f32_to_f16(d * sumq);
    }
}
