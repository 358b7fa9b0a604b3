// The row loops and entry points shared by the quantized matrix x vector modules, matvec_q.cu (the
// classic and k-quant formats, IQ4_NL, IQ4_XS) and matvec_iq.cu (the lattice i-quants): the Rust side
// (kernels/src/cuda/module.rs) puts this text after common.cuh in front of both, and each file instantiates
// MATVEC_ENTRY_POINTS for its formats. Two modules rather than one because NVRTC takes about as long for the
// 7 i-quants as for the 12 others: a launch outside a graph capture compiles only the module it needs, and
// an edit of one file leaves the other's cached cubin valid.
//
// Quantized matrix x vector for one token (decode): y[r] = W[r,:] . x, W in a GGML block format, x already
// quantized to block_q8_1 (quantize.cu). Weights are dequantized in registers and multiplied with 8-bit
// integer dot products (dp4a), as ggml-cuda's mmvq does; the per-format dot products follow vecdotq.cuh.
//
// Work split: a thread block of (32, MATVEC_WARPS) threads computes MATVEC_WARPS / warps_per_row output rows,
// warps_per_row warps (1, 2 or 4: a launch argument the host picks; one-token launches take one warp a row
// unless `--matvec-warps-per-row` allows more, which measured slower on an H100) per row. The QI/VDR threads that share one
// weight block each take VDR ints of its quants (`iqs`), a row's threads stride over the row's blocks, then
// the row's warps reduce through shared memory. Entry points per format:
//   matvec_<fmt>          : one matrix, one vector.
//   matvec_many_<fmt>     : up to MATVEC_MANY_MAX matrices of one width times one vector (q, k, v).
//   matvec_experts_glu_<fmt>: gate and up experts of one token in one launch, writing silu(gate)*up.
//   matvec_experts_<fmt>  : several experts of one stacked tensor in one launch. Slot s of the launch
//                           (blockIdx.y) multiplies expert ids[s] (read from device memory, so a captured
//                           CUDA graph replays with new routing) with activation vector s*x_stride_blocks,
//                           writing y[s*nrows + row]. The expert's weights are found through a table of
//                           device addresses, one per expert: all experts in one allocation today, slots of
//                           the VRAM expert cache later. A null address or an id outside 0..n_expert
//                           writes 0 (the expert is computed elsewhere, e.g. on the CPU).

#define MATVEC_WARPS 4

// ----- the shared row loop ---------------------------------------------------------------------------------

// The row of this thread's warp group: warps threadIdx.y / wpr * wpr .. + wpr share one row.
static __device__ __forceinline__ int group_row(int wpr) {
    return blockIdx.x * (MATVEC_WARPS / wpr) + threadIdx.y / wpr;
}

// Whether this thread writes its group's result (lane 0 of the group's first warp).
static __device__ __forceinline__ bool group_writer(int wpr) {
    return threadIdx.x == 0 && threadIdx.y % wpr == 0;
}

// Several consecutive rows per warp group (rpg <= MATVEC_MAX_RPG, a launch argument): the weight loads of
// all of them are in flight together and the block's fixed costs (the expert lookup, the reduction) are
// shared, so a launch needs fewer, longer blocks (one token's matvecs are short: with one row per group
// they run as many waves of blocks whose lives are mostly waiting). Each row's sum is formed as row_dot
// forms it, so the value of a row does not depend on rpg. Row r of the group is row0 + r; rows r >= nr
// contribute nothing. The results are valid in the group's writer.
#define MATVEC_MAX_RPG 4

template <typename F, int N_MAT, int RPG>
static __device__ __forceinline__ void rows_dot_n(const uint8_t * const (&w_row0)[N_MAT], int64_t row_bytes,
                                                  const block_q8_1 * __restrict__ x, int ncols, int wpr, int nr,
                                                  float (&total)[N_MAT][MATVEC_MAX_RPG]) {
    constexpr int threads_per_block = F::qi / F::vdr;
    const int blocks_per_iter = F::vdr * wpr * WARP_SIZE / F::qi;
    const int tid = WARP_SIZE * (threadIdx.y % wpr) + threadIdx.x;
    const int blocks_per_row = nr > 0 ? ncols / F::qk : 0;
    const int iqs = F::vdr * (tid % threads_per_block);
    float acc[N_MAT][RPG];
#pragma unroll
    for (int m = 0; m < N_MAT; ++m) {
#pragma unroll
        for (int r = 0; r < RPG; ++r) {
            acc[m][r] = 0.0f;
        }
    }
    for (int kb = tid / threads_per_block; kb < blocks_per_row; kb += blocks_per_iter) {
        const block_q8_1 * xb = x + kb * (F::qk / QK8_1);
        // Rows past nr read the group's first row again (unconditional loads the compiler can issue
        // together); their sums are never written.
#pragma unroll
        for (int r = 0; r < RPG; ++r) {
#pragma unroll
            for (int m = 0; m < N_MAT; ++m) {
                const typename F::block * w = (const typename F::block *) (w_row0[m] + (r < nr ? r : 0) * row_bytes);
                // Weights live in the card's global memory (allocations, cache slots, mapped host memory):
                // said so, the loads are global ones instead of generic ones (the expert kernels' addresses
                // come from a table, so the compiler could not tell).
                __builtin_assume(__isGlobal(w));
                acc[m][r] += F::dot(w + kb, xb, iqs);
            }
        }
    }
    __shared__ float partial[N_MAT][RPG][MATVEC_WARPS];
#pragma unroll
    for (int m = 0; m < N_MAT; ++m) {
#pragma unroll
        for (int r = 0; r < RPG; ++r) {
            const float v = warp_sum(acc[m][r]);
            if (threadIdx.x == 0) {
                partial[m][r][threadIdx.y] = v;
            }
        }
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < N_MAT; ++m) {
#pragma unroll
        for (int r = 0; r < MATVEC_MAX_RPG; ++r) {
            total[m][r] = 0.0f;
            if (r < RPG && group_writer(wpr)) {
                for (int w8 = 0; w8 < wpr; ++w8) {
                    total[m][r] += partial[m][r][threadIdx.y + w8];
                }
            }
        }
    }
}

// rows_dot_n for the launch's rpg (1, 2 or 4; uniform over the launch, so one branch per block): each
// variant keeps exactly its rows' loads in flight.
template <typename F, int N_MAT>
static __device__ __forceinline__ void rows_dot_rpg(const uint8_t * const (&w_row0)[N_MAT], int64_t row_bytes,
                                                    const block_q8_1 * __restrict__ x, int ncols, int wpr, int rpg,
                                                    int nr, float (&total)[N_MAT][MATVEC_MAX_RPG]) {
    if (rpg >= 4) {
        rows_dot_n<F, N_MAT, 4>(w_row0, row_bytes, x, ncols, wpr, nr, total);
    } else if (rpg == 2) {
        rows_dot_n<F, N_MAT, 2>(w_row0, row_bytes, x, ncols, wpr, nr, total);
    } else {
        rows_dot_n<F, N_MAT, 1>(w_row0, row_bytes, x, ncols, wpr, nr, total);
    }
}

template <typename F>
static __device__ __forceinline__ void matvec(const uint8_t * __restrict__ w, const block_q8_1 * __restrict__ x,
                                              float * __restrict__ y, int ncols, int nrows, int wpr, int rpg) {
    const int row0 = group_row(wpr) * rpg;
    const int nr = max(0, min(rpg, nrows - row0));
    const int64_t row_bytes = (int64_t) (ncols / F::qk) * sizeof(typename F::block);
    const uint8_t * const w_row0[1] = {w + (nr > 0 ? row0 : 0) * row_bytes};
    float total[1][MATVEC_MAX_RPG];
    rows_dot_rpg<F, 1>(w_row0, row_bytes, x, ncols, wpr, rpg, nr, total);
    if (group_writer(wpr)) {
#pragma unroll
        for (int r = 0; r < MATVEC_MAX_RPG; ++r) {
            if (r < nr) {
                y[row0 + r] = total[0][r];
            }
        }
    }
}

// Several matrices of one format and width times the same x in one launch (one token's q, k and v
// projections): the launch's blocks are those of a matvec launch of each matrix (same rpg) back to back, and
// each block does what that launch's block would, so every y is bit for bit matvec's. Matrix m's rows go to
// y[m]. Up to MATVEC_MANY_MAX matrices; the argument struct is MatvecManyArgs in kernels/src/cuda/fused.rs.
#define MATVEC_MANY_MAX 4

struct MatvecManyArgs {
    uint64_t w[MATVEC_MANY_MAX]; // each matrix's address
    uint64_t y[MATVEC_MANY_MAX]; // each result's address (nrows[m] floats)
    int nrows[MATVEC_MANY_MAX];
    int n_mat;
    int ncols;
    int wpr;
    int rpg;
};

template <typename F>
static __device__ __forceinline__ void matvec_many(const MatvecManyArgs & p, const block_q8_1 * __restrict__ x) {
    const int rows_per_block = MATVEC_WARPS / p.wpr;
    const int rows_per_launch_block = rows_per_block * p.rpg;
    // Which matrix this block serves (w, y, nrows), and its block index within that matrix's launch. The
    // loop is unrolled so every field is read at a constant offset of the parameter space (an index known
    // only at run time would copy the struct to each thread's local memory).
    int block = blockIdx.x;
    uint64_t w = p.w[0], y_addr = p.y[0];
    int nrows = p.nrows[0];
    bool found = false;
#pragma unroll
    for (int m = 0; m < MATVEC_MANY_MAX; ++m) {
        if (!found && m < p.n_mat) {
            const int blocks_m = (p.nrows[m] + rows_per_launch_block - 1) / rows_per_launch_block;
            w = p.w[m];
            y_addr = p.y[m];
            nrows = p.nrows[m];
            if (block < blocks_m || m == p.n_mat - 1) {
                found = true;
            } else {
                block -= blocks_m;
            }
        }
    }
    const int row0 = (block * rows_per_block + threadIdx.y / p.wpr) * p.rpg;
    const int nr = max(0, min(p.rpg, nrows - row0));
    const int64_t row_bytes = (int64_t) (p.ncols / F::qk) * sizeof(typename F::block);
    const uint8_t * const w_row0[1] = {(const uint8_t *) w + (nr > 0 ? row0 : 0) * row_bytes};
    float total[1][MATVEC_MAX_RPG];
    rows_dot_rpg<F, 1>(w_row0, row_bytes, x, p.ncols, p.wpr, p.rpg, nr, total);
    if (group_writer(p.wpr)) {
        float * y = (float *) y_addr;
#pragma unroll
        for (int r = 0; r < MATVEC_MAX_RPG; ++r) {
            if (r < nr) {
                y[row0 + r] = total[0][r];
            }
        }
    }
}

// The weighted sum of a one-token launch's slots, done by the launch itself (what route.cu's moe_combine
// does after it): out[row] (+)= sum_s weights[s] * y[s*nrows + row]. Null out: no sum.
struct ExpertsSum {
    const float * weights; // [slots]
    float * out;           // [nrows]
    unsigned int * tickets; // one per block column (gridDim.x), 0 between launches
    int accumulate;
};

// After a block of a one-token expert launch wrote its rows of y: the block that finishes its block column
// last (of gridDim.y slots) forms the weighted sum of those rows over the slots, in slot order with fmaf
// from 0 or the old out, as moe_combine: the same value.
static __device__ __forceinline__ void sum_slots(const ExpertsSum & sum, const float * y, int nrows,
                                                 int rows_per_launch_block) {
    if (sum.out == nullptr || !last_block_of(sum.tickets + blockIdx.x, gridDim.y)) {
        return;
    }
    const int r0 = blockIdx.x * rows_per_launch_block;
    const int tid = threadIdx.y * WARP_SIZE + threadIdx.x;
    for (int i = tid; i < rows_per_launch_block && r0 + i < nrows; i += WARP_SIZE * MATVEC_WARPS) {
        const int row = r0 + i;
        float acc = sum.accumulate ? sum.out[row] : 0.0f;
        for (int s = 0; s < (int) gridDim.y; ++s) {
            acc = fmaf(sum.weights[s], __ldcg(y + (int64_t) s * nrows + row), acc);
        }
        sum.out[row] = acc;
    }
}

template <typename F>
static __device__ __forceinline__ void matvec_experts(const uint64_t * __restrict__ expert_table,
                                                      const int32_t * __restrict__ ids, int n_expert,
                                                      const block_q8_1 * __restrict__ x, int64_t x_stride_blocks,
                                                      float * __restrict__ y, int ncols, int nrows, int wpr, int rpg,
                                                      const ExpertsSum & sum) {
    const int row0 = group_row(wpr) * rpg;
    const int slot = blockIdx.y;
    const int32_t expert = ids[slot];
    const uint64_t base = expert < 0 || expert >= n_expert ? 0 : expert_table[expert];
    const int n_out = max(0, min(rpg, nrows - row0));
    const int nr = base != 0 ? n_out : 0;
    const int64_t row_bytes = (int64_t) (ncols / F::qk) * sizeof(typename F::block);
    const uint8_t * const w_row0[1] = {nr > 0 ? (const uint8_t *) base + row0 * row_bytes : nullptr};
    float total[1][MATVEC_MAX_RPG];
    rows_dot_rpg<F, 1>(w_row0, row_bytes, x + slot * x_stride_blocks, ncols, wpr, rpg, nr, total);
    if (group_writer(wpr)) {
#pragma unroll
        for (int r = 0; r < MATVEC_MAX_RPG; ++r) {
            if (r < n_out) {
                y[(int64_t) slot * nrows + row0 + r] = total[0][r];
            }
        }
    }
    sum_slots(sum, y, nrows, MATVEC_WARPS / wpr * rpg);
}

// Gate and up projections of the same experts in one launch, for one token: slot s (blockIdx.y) multiplies
// expert ids[s] of both tables with the shared x and writes h[s*nrows + row] = silu(gate . x) * (up . x).
// Both matrices' rows go through the same loop (their weight loads in flight together) and each sum is
// formed in the order of row_dot, so h is bit for bit swiglu_f32 of two matvec_experts launches. A missing
// expert (address 0 in either table) writes 0. With hq not null, h is also quantized for the down experts
// (hq[s*nrows/32 ..], quantize_q8_1 of h: the same blocks): the block that finishes a 32-row piece of a
// slot last (tickets: one per piece, slot-major, 0 between launches) quantizes it; the launch's blocks then
// cover whole pieces (the host's rows per block divide 32, nrows is a multiple of 32).
template <typename F>
static __device__ __forceinline__ void matvec_experts_glu(const uint64_t * __restrict__ gate_table,
                                                          const uint64_t * __restrict__ up_table,
                                                          const int32_t * __restrict__ ids, int n_expert,
                                                          const block_q8_1 * __restrict__ x, float * __restrict__ h,
                                                          int ncols, int nrows, int wpr, int rpg,
                                                          block_q8_1 * __restrict__ hq, unsigned int * tickets) {
    const int row0 = group_row(wpr) * rpg;
    const int slot = blockIdx.y;
    const int32_t expert = ids[slot];
    const bool known = expert >= 0 && expert < n_expert;
    const uint64_t base_g = known ? gate_table[expert] : 0;
    const uint64_t base_u = known ? up_table[expert] : 0;
    const int n_out = max(0, min(rpg, nrows - row0));
    const int nr = base_g != 0 && base_u != 0 ? n_out : 0;
    const int64_t row_bytes = (int64_t) (ncols / F::qk) * sizeof(typename F::block);
    const uint8_t * const w_row0[2] = {nr > 0 ? (const uint8_t *) base_g + row0 * row_bytes : nullptr,
                                       nr > 0 ? (const uint8_t *) base_u + row0 * row_bytes : nullptr};
    float total[2][MATVEC_MAX_RPG];
    rows_dot_rpg<F, 2>(w_row0, row_bytes, x, ncols, wpr, rpg, nr, total);
    if (group_writer(wpr)) {
#pragma unroll
        for (int r = 0; r < MATVEC_MAX_RPG; ++r) {
            if (r < n_out) {
                const float g = total[0][r], u = total[1][r];
                const float silu = g / (1.0f + expf(-g)); // act.cu's silu
                h[(int64_t) slot * nrows + row0 + r] = silu * u;
            }
        }
    }
    if (hq == nullptr) {
        return;
    }
    const int rows_per_launch_block = MATVEC_WARPS / wpr * rpg;
    const int blocks_per_piece = QK8_1 / rows_per_launch_block;
    const int piece = blockIdx.x / blocks_per_piece;
    const int pieces = nrows / QK8_1;
    if (last_block_of(tickets + slot * pieces + piece, blocks_per_piece) && threadIdx.y == 0) {
        const int64_t i = (int64_t) slot * nrows + piece * QK8_1 + threadIdx.x;
        quantize_value(__ldcg(h + i), hq, i);
    }
}

// ----- matrix x matrix for prompts (a tile of MATMUL_COLS tokens per block) ------------------------------
// As matvec, but each thread block also takes up to MATMUL_COLS activation rows (tokens), so a weight block
// is read once from memory for MATMUL_COLS tokens (the repeated reads hit L1): the mmvq-with-several-columns
// idea. matmul_<fmt>: blockIdx.y is a tile of tokens, y [n_tokens, nrows]. matmul_experts_<fmt>: tokens
// grouped by expert (the host or the router sorts the (token, expert) pairs by expert), blockIdx.y is a
// tile (expert, first sorted row, rows <= MATMUL_COLS) from a table in device memory; x and y are in sorted
// order ([n_sorted, ...]). An expert id outside 0..n_expert or a null address writes zeros.

#define MATMUL_COLS 8

template <typename F>
static __device__ __forceinline__ void rows_dot_cols(const uint8_t * __restrict__ w_row,
                                                     const block_q8_1 * __restrict__ x, int64_t x_stride_blocks,
                                                     int ncol, int ncols, int wpr, bool active,
                                                     float (&total)[MATMUL_COLS]) {
    constexpr int threads_per_block = F::qi / F::vdr;
    const int blocks_per_iter = F::vdr * wpr * WARP_SIZE / F::qi;
    const int tid = WARP_SIZE * (threadIdx.y % wpr) + threadIdx.x;
    const int blocks_per_row = active ? ncols / F::qk : 0;
    const int iqs = F::vdr * (tid % threads_per_block);
    const typename F::block * w = (const typename F::block *) w_row;
    float acc[MATMUL_COLS];
#pragma unroll
    for (int c = 0; c < MATMUL_COLS; ++c) {
        acc[c] = 0.0f;
    }
    for (int kb = tid / threads_per_block; kb < blocks_per_row; kb += blocks_per_iter) {
#pragma unroll
        for (int c = 0; c < MATMUL_COLS; ++c) {
            if (c < ncol) {
                acc[c] += F::dot(w + kb, x + c * x_stride_blocks + kb * (F::qk / QK8_1), iqs);
            }
        }
    }
    __shared__ float partial[MATVEC_WARPS][MATMUL_COLS];
#pragma unroll
    for (int c = 0; c < MATMUL_COLS; ++c) {
        const float v = warp_sum(acc[c]);
        if (threadIdx.x == 0) {
            partial[threadIdx.y][c] = v;
        }
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < MATMUL_COLS; ++c) {
        total[c] = 0.0f;
        if (group_writer(wpr)) {
            for (int w8 = 0; w8 < wpr; ++w8) {
                total[c] += partial[threadIdx.y + w8][c];
            }
        }
    }
}

template <typename F>
static __device__ __forceinline__ void matmul(const uint8_t * __restrict__ w, const block_q8_1 * __restrict__ x,
                                              float * __restrict__ y, int ncols, int nrows, int n_tokens, int wpr) {
    const int row = group_row(wpr);
    const bool active = row < nrows;
    const int t0 = blockIdx.y * MATMUL_COLS;
    const int ncol = min(MATMUL_COLS, n_tokens - t0);
    const int64_t x_stride = ncols / QK8_1;
    const int64_t row_bytes = (int64_t) (ncols / F::qk) * sizeof(typename F::block);
    float total[MATMUL_COLS];
    rows_dot_cols<F>(w + (active ? row : 0) * row_bytes, x + t0 * x_stride, x_stride, ncol, ncols, wpr, active,
                     total);
    if (active && group_writer(wpr)) {
        for (int c = 0; c < ncol; ++c) {
            y[(int64_t) (t0 + c) * nrows + row] = total[c];
        }
    }
}

template <typename F>
static __device__ __forceinline__ void matmul_experts(const uint64_t * __restrict__ expert_table, int n_expert,
                                                      const int32_t * __restrict__ tiles,
                                                      const block_q8_1 * __restrict__ x, float * __restrict__ y,
                                                      int ncols, int nrows, int wpr) {
    const int row = group_row(wpr);
    const int32_t expert = tiles[3 * blockIdx.y];
    const int r0 = tiles[3 * blockIdx.y + 1];
    const int ncol = min(MATMUL_COLS, (int) tiles[3 * blockIdx.y + 2]);
    const uint64_t base = expert < 0 || expert >= n_expert ? 0 : expert_table[expert];
    const bool active = row < nrows && base != 0;
    const int64_t x_stride = ncols / QK8_1;
    const int64_t row_bytes = (int64_t) (ncols / F::qk) * sizeof(typename F::block);
    const uint8_t * w_row = active ? (const uint8_t *) base + row * row_bytes : nullptr;
    float total[MATMUL_COLS];
    rows_dot_cols<F>(w_row, x + r0 * x_stride, x_stride, ncol, ncols, wpr, active, total);
    if (row < nrows && group_writer(wpr)) {
        for (int c = 0; c < ncol; ++c) {
            y[(int64_t) (r0 + c) * nrows + row] = total[c];
        }
    }
}

// ----- L2 prefetch (common.cuh's prefetch_l2) -------------------------------------------------------------

// The bytes of an nrows x ncols matrix of format F.
template <typename F>
static __device__ __forceinline__ int64_t matrix_bytes(int ncols, int nrows) {
    return (int64_t) nrows * (ncols / F::qk) * (int64_t) sizeof(typename F::block);
}

// matvec_many's matrices: each one's share of the prefetch, then the prologue.
template <typename F>
static __device__ __forceinline__ void launch_prologue_prefetch_many(const MatvecManyArgs & p) {
#pragma unroll
    for (int m = 0; m < MATVEC_MANY_MAX; ++m) {
        if (m < p.n_mat) {
            prefetch_l2_share((const void *) p.w[m], matrix_bytes<F>(p.ncols, p.nrows[m]));
        }
    }
    launch_prologue();
}

// After the prologue of a one-token expert launch (grid (row blocks, slots)): block (s, 0) asks the L2 for
// the whole matrix of slot s's expert in each table given (null: none), so the launch's later blocks find
// their rows there; the gate and up launch also for the down experts after it (`next_table`, its matrices
// `next_bytes` each; null: none), which then arrive while gate and up compute. The routing is only known
// after the wait, hence not before it.
static __device__ __forceinline__ void prefetch_slot_experts(const uint64_t * __restrict__ table_a,
                                                             const uint64_t * __restrict__ table_b,
                                                             const int32_t * __restrict__ ids, int n_expert,
                                                             int64_t bytes) {
#if POLY_L2_PREFETCH
    if (threadIdx.x != 0 || threadIdx.y != 0 || blockIdx.y != 0 || blockIdx.x >= gridDim.y) {
        return;
    }
    const int32_t expert = ids[blockIdx.x];
    if (table_a == nullptr || expert < 0 || expert >= n_expert) {
        return;
    }
    const int64_t n = bytes < PREFETCH_MAX_BYTES ? bytes : PREFETCH_MAX_BYTES;
    const uint64_t a = table_a[expert];
    if (a != 0) {
        prefetch_l2((const void *) a, n);
    }
    const uint64_t b = table_b != nullptr ? table_b[expert] : 0;
    if (b != 0) {
        prefetch_l2((const void *) b, n);
    }
#endif
}

#define MATVEC_ENTRY_POINTS(name, F)                                                                           \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * MATVEC_WARPS)                                     \
        matvec_##name(const uint8_t * __restrict__ w, const block_q8_1 * __restrict__ x, float * __restrict__ y, \
                      int ncols, int nrows, int wpr, int rpg) {                                                \
        launch_prologue_prefetch(w, matrix_bytes<F>(ncols, nrows));                                            \
        matvec<F>(w, x, y, ncols, nrows, wpr, rpg);                                                            \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * MATVEC_WARPS)                                     \
        matvec_many_##name(const MatvecManyArgs p, const block_q8_1 * __restrict__ x) {                        \
        launch_prologue_prefetch_many<F>(p);                                                                   \
        matvec_many<F>(p, x);                                                                                  \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * MATVEC_WARPS)                                     \
        matvec_experts_##name(const uint64_t * __restrict__ expert_table, const int32_t * __restrict__ ids,   \
                              int n_expert, const block_q8_1 * __restrict__ x, int64_t x_stride_blocks,      \
                              float * __restrict__ y, int ncols, int nrows, int wpr, int rpg,                \
                              const ExpertsSum sum) { launch_prologue();                                       \
        prefetch_slot_experts(expert_table, nullptr, ids, n_expert, matrix_bytes<F>(ncols, nrows));            \
        matvec_experts<F>(expert_table, ids, n_expert, x, x_stride_blocks, y, ncols, nrows, wpr, rpg, sum);    \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * MATVEC_WARPS)                                     \
        matvec_experts_glu_##name(const uint64_t * __restrict__ gate_table, const uint64_t * __restrict__ up_table, \
                                  const int32_t * __restrict__ ids, int n_expert,                              \
                                  const block_q8_1 * __restrict__ x, float * __restrict__ h, int ncols,        \
                                  int nrows, int wpr, int rpg, block_q8_1 * __restrict__ hq,                   \
                                  unsigned int * tickets, const uint64_t * __restrict__ next_table,            \
                                  int64_t next_bytes) { launch_prologue();                                     \
        prefetch_slot_experts(gate_table, up_table, ids, n_expert, matrix_bytes<F>(ncols, nrows));             \
        if (POLY_L2_PREFETCH >= 2) {                                                                           \
            prefetch_slot_experts(next_table, nullptr, ids, n_expert, next_bytes);                             \
        }                                                                                                      \
        matvec_experts_glu<F>(gate_table, up_table, ids, n_expert, x, h, ncols, nrows, wpr, rpg, hq, tickets); \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * MATVEC_WARPS)                                     \
        matmul_##name(const uint8_t * __restrict__ w, const block_q8_1 * __restrict__ x, float * __restrict__ y, \
                      int ncols, int nrows, int n_tokens, int wpr) { launch_prologue();                        \
        matmul<F>(w, x, y, ncols, nrows, n_tokens, wpr);                                                       \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARP_SIZE * MATVEC_WARPS)                                     \
        matmul_experts_##name(const uint64_t * __restrict__ expert_table, int n_expert,                        \
                              const int32_t * __restrict__ tiles, const block_q8_1 * __restrict__ x,           \
                              float * __restrict__ y, int ncols, int nrows, int wpr) { launch_prologue();      \
        matmul_experts<F>(expert_table, n_expert, tiles, x, y, ncols, nrows, wpr);                             \
    }
