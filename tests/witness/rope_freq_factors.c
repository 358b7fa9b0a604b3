// ggml's CPU rope with frequency factors (ggml_rope_ext's third tensor, Llama 3.1's rope_freqs.weight) on
// fixed inputs, written as the witness fixture tests/fixtures/rope/freq_factors.txt that
// kernels/tests/rope_ggml.rs compares kernels/src/ops/rope.rs with, bit for bit.
//
// Build against a CMake build of the pinned ggml (llama-cpp-python 0.3.36's vendor/llama.cpp/ggml, GGML_NATIVE
// on, as the witness's llama.cpp build; see tests/witness/README.md):
//   cc -O2 -I$GGML/include tests/witness/rope_freq_factors.c $BUILD/src/libggml-cpu.a $BUILD/src/libggml-base.a \
//      -lstdc++ -lm -lpthread -o /tmp/rope_freq_factors && /tmp/rope_freq_factors > tests/fixtures/rope/freq_factors.txt
//
// Output: one case per line, `case MODE HEAD_DIM N_ROT N_HEADS FREQ_BASE FREQ_SCALE`, then lines `pos ...`,
// `factors ...`, `x ...`, `y ...` of space-separated values (positions as integers, floats as the hex of their
// f32 bits). x is [n_pos, n_heads, head_dim] (head_dim contiguous), y the rotated x.
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <math.h>

#include "ggml.h"
#include "ggml-cpu.h"

static uint32_t bits(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}

static void print_floats(const char * tag, const float * v, int n) {
    printf("%s", tag);
    for (int i = 0; i < n; ++i) {
        printf(" %08x", bits(v[i]));
    }
    printf("\n");
}

static void run_case(int mode, int head_dim, int n_rot, float base, float scale) {
    const int n_heads = 2;
    const int32_t positions[] = {0, 1, 7, 100, 2047, 8191, 65000};
    const int n_pos = (int) (sizeof(positions) / sizeof(positions[0]));
    struct ggml_init_params ip = {64 * 1024 * 1024, NULL, false};
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, head_dim, n_heads, n_pos);
    struct ggml_tensor * pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_pos);
    struct ggml_tensor * ff = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n_rot / 2);
    float * xd = (float *) x->data;
    for (int i = 0; i < head_dim * n_heads * n_pos; ++i) {
        // A fixed, irregular pattern (its bits are written out, so the test need not recompute it).
        xd[i] = (float) sin(0.7311 * i + 0.3) * 1.5f;
    }
    memcpy(pos->data, positions, sizeof(positions));
    float * fd = (float *) ff->data;
    const int half = n_rot / 2;
    for (int i = 0; i < half; ++i) {
        // Llama 3.1's shape: 1 for the short wavelengths, rising to 8 for the long ones.
        const float t = half > 1 ? (float) i / (float) (half - 1) : 0.0f;
        fd[i] = 1.0f + 7.0f * t * t;
    }
    // llama.cpp's llama graph: ext_factor 0 (no YaRN), attn_factor 1, beta_fast 32, beta_slow 1.
    struct ggml_tensor * y = ggml_rope_ext(ctx, x, pos, ff, n_rot, mode, 0, base, scale, 0.0f, 1.0f, 32.0f, 1.0f);
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    ggml_graph_compute_with_ctx(ctx, gf, 1);
    printf("case %s %d %d %d %.9g %.9g\n", mode == GGML_ROPE_TYPE_NEOX ? "neox" : "normal", head_dim, n_rot,
           n_heads, base, scale);
    printf("pos");
    for (int i = 0; i < n_pos; ++i) {
        printf(" %d", positions[i]);
    }
    printf("\n");
    print_floats("factors", fd, half);
    print_floats("x", xd, head_dim * n_heads * n_pos);
    print_floats("y", (const float *) y->data, head_dim * n_heads * n_pos);
    ggml_free(ctx);
}

int main(void) {
    run_case(0, 128, 128, 500000.0f, 1.0f);  // Llama 3.1 8B's head, base and factors
    run_case(0, 64, 64, 10000.0f, 0.25f);    // with linear scaling
    run_case(0, 64, 32, 10000.0f, 1.0f);     // partial rotation
    run_case(GGML_ROPE_TYPE_NEOX, 64, 64, 1000000.0f, 1.0f);
    return 0;
}
