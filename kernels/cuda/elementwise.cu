// Element-wise and layout kernels the engine's forward pass needs between the heavier operations: binary
// add/mul (same shapes, a per-row scalar, or a per-column weight broadcast over rows), scaling, the unary
// functions of the graph (sigmoid, softplus, tanh, exp), column slices, one part of interleaved head
// groups, repeated heads, and the f32 -> f16 store of new keys/values into a KV cache. Layouts are the CPU
// backend's (engine/src/cpu/mod.rs): row-major [rows, cols] f32.

// op: 0 add, 1 mul. b_mode: 0 same shape as a, 1 one value per row (b[r]), 2 one value per column (b[c]).
extern "C" __global__ void ew_binary(const float * __restrict__ a, const float * __restrict__ b,
                                     float * __restrict__ out, int64_t n, int cols, int op, int b_mode) {
    launch_prologue();
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    float bv;
    if (b_mode == 0) {
        bv = b[i];
    } else if (b_mode == 1) {
        bv = b[i / cols];
    } else {
        bv = b[i % cols];
    }
    out[i] = op == 0 ? a[i] + bv : a[i] * bv;
}

extern "C" __global__ void ew_scale(const float * __restrict__ x, float * __restrict__ out, float s, int64_t n) {
    launch_prologue();
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = x[i] * s;
    }
}

// f: 0 sigmoid, 1 softplus (x above 20 passes, else logf(1 + expf(x)) as ggml), 2 tanh, 3 exp.
extern "C" __global__ void ew_unary(const float * __restrict__ x, float * __restrict__ out, int64_t n, int f) {
    launch_prologue();
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    const float v = x[i];
    float r;
    switch (f) {
        case 0: r = 1.0f / (1.0f + expf(-v)); break;
        case 1: r = v > 20.0f ? v : logf(1.0f + expf(v)); break;
        case 2: r = tanhf(v); break;
        default: r = expf(v); break;
    }
    out[i] = r;
}

// out [rows, len] = x[:, start..start+len] of x [rows, in_cols].
extern "C" __global__ void ew_cols(const float * __restrict__ x, float * __restrict__ out, int64_t rows,
                                   int in_cols, int start, int len) {
    launch_prologue();
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * len) {
        return;
    }
    const int64_t r = i / len;
    const int c = (int) (i % len);
    out[i] = x[r * in_cols + start + c];
}

// x rows of n_heads groups of parts*head values; out rows of n_heads*head: part `part` of each group.
extern "C" __global__ void ew_head_part(const float * __restrict__ x, float * __restrict__ out, int64_t rows,
                                        int n_heads, int head, int parts, int part) {
    launch_prologue();
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    const int out_cols = n_heads * head;
    if (i >= rows * out_cols) {
        return;
    }
    const int64_t r = i / out_cols;
    const int c = (int) (i % out_cols);
    const int h = c / head;
    const int d = c % head;
    out[i] = x[r * (int64_t) (out_cols * parts) + (int64_t) h * head * parts + part * head + d];
}

// out rows of n_heads*times heads: slot s reads head s / times (interleave) or s % n_heads (tiled).
extern "C" __global__ void ew_repeat_heads(const float * __restrict__ x, float * __restrict__ out, int64_t rows,
                                           int n_heads, int head, int times, int interleave) {
    launch_prologue();
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    const int out_cols = n_heads * times * head;
    if (i >= rows * out_cols) {
        return;
    }
    const int64_t r = i / out_cols;
    const int c = (int) (i % out_cols);
    const int slot = c / head;
    const int d = c % head;
    const int h = interleave ? slot / times : slot % n_heads;
    out[i] = x[r * (int64_t) (n_heads * head) + (int64_t) h * head + d];
}

// dst[offset + i] = f16(src[i]) for i < n: new keys or values into an f16 KV cache at a row offset.
extern "C" __global__ void kv_store_f16(const float * __restrict__ src, uint16_t * __restrict__ dst, int64_t n,
                                        int64_t offset) {
    launch_prologue();
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        dst[offset + i] = f32_to_f16(src[i]);
    }
}

// The KV store of a captured decode graph: row r of k_src / v_src goes to row positions[r] of the caches
// (read on the card, so a replay stores at the new position); one launch stores keys and values. Rows whose
// position lies outside the cache (n_ctx rows) are skipped.
extern "C" __global__ void kv_store_f16_pos(const float * __restrict__ k_src, const float * __restrict__ v_src,
                                            uint16_t * __restrict__ k_dst, uint16_t * __restrict__ v_dst,
                                            const int * __restrict__ positions, int n_rows, int k_width,
                                            int v_width, int n_ctx) {
    launch_prologue();
    const int r = blockIdx.y;
    if (r >= n_rows) {
        return;
    }
    const int p = positions[r];
    if (p < 0 || p >= n_ctx) {
        return;
    }
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < k_width + v_width; i += gridDim.x * blockDim.x) {
        if (i < k_width) {
            k_dst[(int64_t) p * k_width + i] = f32_to_f16(k_src[(int64_t) r * k_width + i]);
        } else {
            const int j = i - k_width;
            v_dst[(int64_t) p * v_width + j] = f32_to_f16(v_src[(int64_t) r * v_width + j]);
        }
    }
}

// Qwen3.5's delta-net gates in one launch, per value i of beta, alpha [rows, n_heads] (head h = i % n_heads):
// beta_out = sigmoid(beta) and gate = softplus(alpha + dt_bias[h]) * a[h] (the log of the state's decay).
// The expressions of ew_unary (sigmoid, softplus) and ew_binary (the per-column add and multiply), so the
// values are those of the four launches, bit for bit.
extern "C" __global__ void delta_gates(const float * __restrict__ beta, const float * __restrict__ alpha,
                                       const float * __restrict__ dt_bias, const float * __restrict__ a,
                                       float * __restrict__ beta_out, float * __restrict__ gate_out, int64_t n,
                                       int n_heads) {
    launch_prologue();
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    const int h = (int) (i % n_heads);
    const float b = beta[i];
    beta_out[i] = 1.0f / (1.0f + expf(-b));
    const float v = alpha[i] + dt_bias[h];
    const float sp = v > 20.0f ? v : logf(1.0f + expf(v));
    gate_out[i] = sp * a[h];
}

// Up to HOST_COPIES_MAX copies of 32-bit words in one launch, any side of each in the host's page-locked
// memory (its device address): a partly resident token's hand-over between the card and the host at each
// MoE layer (the router's ids and weights, the layer's input, the next layer's guessed ids and the choices
// a cache bias made down; the CPU's sum and the token's expert addresses up) as one kernel beside the
// others, where copy-engine transfers cost a hand-off between engines each. Writes to the host are visible
// to it once the stream passed the kernel (a synchronize); the host's writes before a launch are visible to
// the kernel. Grid-stride over each copy's words. pinned.rs's HOST_COPIES_MAX is this one (its test).
#define HOST_COPIES_MAX 6
struct HostCopyArgs {
    unsigned long long src[HOST_COPIES_MAX];
    unsigned long long dst[HOST_COPIES_MAX];
    int words[HOST_COPIES_MAX];
    int n_copies;
};

extern "C" __global__ void copy_words(const HostCopyArgs a) {
    launch_prologue();
    const int stride = gridDim.x * blockDim.x;
    for (int c = 0; c < a.n_copies; ++c) {
        const uint32_t * __restrict__ src = (const uint32_t *) a.src[c];
        uint32_t * __restrict__ dst = (uint32_t *) a.dst[c];
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < a.words[c]; i += stride) {
            dst[i] = src[i];
        }
    }
}

// Flags in the host's page-locked memory (their device address) that let one graph a token run through the
// host points of its MoE layers: `flags[0]` is the token's number, written by the host before the replay;
// `flags[1]` gets a number the card gave up waiting for; the points' flags follow. A point the card passes
// is *signalled* (the host spins on its flag, instead of a synchronize); a point that needs the host is
// *awaited* (the card spins on its flag, which the host or the host's copy stream sets, instead of a graph
// launched after it). A flag holds the number of the token that last passed it, so nothing is reset.
static __device__ __forceinline__ unsigned int load_acquire_sys(const unsigned int * p) {
    unsigned int v;
    asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

static __device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// `flags[index]` = the token's number, after every write of the kernels before it (completed: the prologue
// waits for them) is visible to the host.
extern "C" __global__ void host_signal(unsigned int * flags, const int index) {
    launch_prologue();
    if (blockIdx.x != 0 || threadIdx.x != 0) {
        return;
    }
    const unsigned int seq = load_acquire_sys(flags);
    __threadfence_system();
    asm volatile("st.release.sys.u32 [%0], %1;" :: "l"(flags + index), "r"(seq) : "memory");
}

// Returns once `flags[index]` holds the token's number (the host's writes before it are then visible to
// the kernels after), or after `timeout_ns`: then `flags[1]` gets the number, which the host reports as an
// error, and the stream goes on (a host that failed never leaves the card spinning). `waited[index]` gets
// the nanoseconds the card spent here (host memory as well: a posted write, read by the host after the
// token, for the profile of where a token's time goes).
extern "C" __global__ void host_wait(unsigned int * flags, const int index, const unsigned long long timeout_ns,
                                     unsigned long long * waited) {
    launch_prologue();
    if (blockIdx.x != 0 || threadIdx.x != 0) {
        return;
    }
    const unsigned int seq = load_acquire_sys(flags);
    const unsigned long long start = global_ns();
    while (load_acquire_sys(flags + index) != seq) {
        if (global_ns() - start > timeout_ns) {
            asm volatile("st.release.sys.u32 [%0], %1;" :: "l"(flags + 1), "r"(seq) : "memory");
            break;
        }
        __nanosleep(100);
    }
    waited[index] = global_ns() - start;
}
