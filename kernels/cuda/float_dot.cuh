// Float rows times an f32 vector, for one token: the weight loads of F32, F16 and BF16 and the row dot
// product of a thread block of (32, MATVEC_F_WARPS) threads (products and sums in f32). The Rust side puts
// this after common.cuh in front of matvec_f.cu (the float matvec kernels) and route.cu (the router fused
// with the choice of experts), so both compute a router logit alike.

#define MATVEC_F_WARPS 4

struct load_f32 {
    typedef float elem;
    static __device__ __forceinline__ float2 pair(const elem * w, int i) {
        return make_float2(w[i], w[i + 1]);
    }
    static __device__ __forceinline__ float one(const elem * w, int64_t i) {
        return w[i];
    }
};

struct load_f16 {
    typedef uint16_t elem;
    static __device__ __forceinline__ float2 pair(const elem * w, int i) {
        const uint32_t both = *(const uint32_t *) (w + i);
        return make_float2(f16_to_f32((uint16_t) (both & 0xffff)), f16_to_f32((uint16_t) (both >> 16)));
    }
    static __device__ __forceinline__ float one(const elem * w, int64_t i) {
        return f16_to_f32(w[i]);
    }
};

struct load_bf16 {
    typedef uint16_t elem;
    static __device__ __forceinline__ float2 pair(const elem * w, int i) {
        const uint32_t both = *(const uint32_t *) (w + i);
        return make_float2(__uint_as_float(both << 16), __uint_as_float(both & 0xffff0000u));
    }
    static __device__ __forceinline__ float one(const elem * w, int64_t i) {
        return __uint_as_float(((uint32_t) w[i]) << 16);
    }
};

template <typename L>
static __device__ __forceinline__ float row_dot_f(const typename L::elem * __restrict__ w, const float * __restrict__ x,
                                                  int ncols) {
    const int tid = WARP_SIZE * threadIdx.y + threadIdx.x;
    const int stride = 2 * WARP_SIZE * MATVEC_F_WARPS;
    float acc = 0.0f;
    for (int i = 2 * tid; i < ncols; i += stride) {
        const float2 wv = L::pair(w, i);
        acc = fmaf(wv.x, x[i], acc);
        acc = fmaf(wv.y, x[i + 1], acc);
    }
    __shared__ float partial[MATVEC_F_WARPS];
    acc = warp_sum(acc);
    if (threadIdx.x == 0) {
        partial[threadIdx.y] = acc;
    }
    __syncthreads();
    float total = 0.0f;
    if (threadIdx.y == 0) {
        total = warp_sum(threadIdx.x < MATVEC_F_WARPS ? partial[threadIdx.x] : 0.0f);
    }
    return total;
}
