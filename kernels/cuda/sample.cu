// Picking the next token on the card, so only its id goes to the host: the argmax (greedy; the lowest id
// among equals, as the CPU sampler) and a top-k / top-p / temperature draw, as engine/src/sample.rs orders
// those steps (without penalties and min-p), with its uniform number from a seed and a step counter in
// device memory (a captured graph draws anew at each replay when the counter is advanced).

#define SAMPLE_THREADS 1024
#define SAMPLE_MAX_K 128

// (value, id) ordered by value, then lower id first.
static __device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

// Block-wide best (value, id) of the candidates each thread proposes; every thread gets the result.
static __device__ void block_best(float & v, int & i, float * sv, int * si) {
#pragma unroll
    for (int off = WARP_SIZE / 2; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, v, off);
        const int oi = __shfl_xor_sync(FULL_MASK, i, off);
        if (better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    const int n_warps = blockDim.x / WARP_SIZE;
    v = lane < n_warps ? sv[lane] : -POLY_INF;
    i = lane < n_warps ? si[lane] : 0x7fffffff;
#pragma unroll
    for (int off = WARP_SIZE / 2; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, v, off);
        const int oi = __shfl_xor_sync(FULL_MASK, i, off);
        if (better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
    __syncthreads();
}

// The best candidate strictly after (after_v, after_i) in the order above (after_i < 0: the best of all).
static __device__ void next_best(const float * __restrict__ logits, int n, float after_v, int after_i, float & v,
                                 int & id, float * sv, int * si) {
    v = -POLY_INF;
    id = 0x7fffffff;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float x = logits[j];
        const bool after = after_i < 0 || better(after_v, after_i, x, j);
        if (after && better(x, j, v, id)) {
            v = x;
            id = j;
        }
    }
    block_best(v, id, sv, si);
}

// One block of SAMPLE_THREADS threads. out[0] = the likeliest token.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_argmax(const float * __restrict__ logits, int n, int32_t * __restrict__ out) {
    launch_prologue();
    __shared__ float sv[32];
    __shared__ int si[32];
    float v;
    int id;
    next_best(logits, n, 0.0f, -1, v, id, sv, si);
    if (threadIdx.x == 0) {
        out[0] = id < n ? id : 0;
    }
}

static __device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Top-k (1..SAMPLE_MAX_K), then top-p over the candidates' softmax, then the temperature, then a draw with
// u = (splitmix64(seed ^ step) >> 11) / 2^53, step = *counter (the kernel advances it). One block of
// SAMPLE_THREADS threads; the k candidates are found by k block-wide passes (each the next best after the
// last), which costs k reads of the logits from L2.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_top_k(const float * __restrict__ logits, int n, int top_k, float top_p, float temperature,
                 uint64_t seed, uint64_t * __restrict__ counter, int32_t * __restrict__ out) {
    launch_prologue();
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ float cand_v[SAMPLE_MAX_K];
    __shared__ int cand_i[SAMPLE_MAX_K];
    float v = 0.0f;
    int id = -1;
    int found = 0;
    for (int r = 0; r < top_k && r < n; ++r) {
        next_best(logits, n, v, id, v, id, sv, si);
        if (threadIdx.x == 0) {
            cand_v[r] = v;
            cand_i[r] = id;
        }
        found = r + 1;
    }
    __syncthreads();
    if (threadIdx.x != 0) {
        return;
    }
    // top-p on the softmax of the candidates' logits (as the CPU's probabilities()).
    int keep = found;
    if (top_p < 1.0f) {
        float sum = 0.0f;
        for (int r = 0; r < found; ++r) {
            sum += expf(cand_v[r] - cand_v[0]);
        }
        float cum = 0.0f;
        for (int r = 0; r < found; ++r) {
            cum += expf(cand_v[r] - cand_v[0]) / sum;
            if (cum >= top_p) {
                keep = r + 1;
                break;
            }
        }
    }
    const uint64_t step = counter[0];
    counter[0] = step + 1;
    const double u = (double) (splitmix64(seed ^ step) >> 11) * (1.0 / 9007199254740992.0);
    double total = 0.0;
    const float top = cand_v[0] / temperature;
    for (int r = 0; r < keep; ++r) {
        total += (double) expf(cand_v[r] / temperature - top);
    }
    const double target = total * u;
    double run = 0.0;
    int pick = cand_i[keep - 1];
    for (int r = 0; r < keep; ++r) {
        const float w = expf(cand_v[r] / temperature - top);
        run += (double) w;
        if (run >= target && w > 0.0f) {
            pick = cand_i[r];
            break;
        }
    }
    out[0] = pick;
}
