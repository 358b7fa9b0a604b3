// Writes kernels/testdata/ssm-conv-taps.bin: ggml's CPU `ggml_ssm_conv` on fixed inputs for kernels of 3
// and 6 taps (LFM2's short convolution has 3), which `ops::recurrent`'s tests hold `conv1d_causal` to,
// bit for bit. Kernels of 4 taps (Qwen3.5's) are covered by qwen35moe-recurrent-step.bin.
//
// The compiled loop of ggml-cpu/ops.cpp adds the rounded products of whole groups of four taps and fuses
// the rest (the compiler contracts its scalar remainder to FMA), so 3 and 6 taps both show it.
//
// Build against the witness's llama.cpp (AVX2 + FMA, no AVX-512; tests/witness/README.md), e.g.
//   gcc -O1 -ffp-contract=off -I$LLAMA/ggml/include ssm_conv_taps.c -L$LIB -lggml -lggml-base -lggml-cpu -lm
//   LD_LIBRARY_PATH=$LIB ./a.out > ssm-conv-taps.bin
//
// Output: for each kernel length, sections of a little-endian u32 count then that many f32:
//   window [channels][kernel - 1 + tokens]   ggml's layout (per channel, oldest first)
//   weight [channels][kernel]
//   out    [tokens][channels]
#include "ggml.h"
#include "ggml-cpu.h"
#include <stdint.h>
#include <stdio.h>

static uint32_t seed = 12345;
static float rnd(void) {
    seed = seed * 1103515245u + 12345u;
    return ((seed >> 8) & 0xffff) / 32768.0f - 1.0f;
}

static void section(const float *x, uint32_t n) {
    fwrite(&n, 4, 1, stdout);
    fwrite(x, 4, n, stdout);
}

int main(void) {
    const int channels = 32, tokens = 4;
    const int kernels[2] = {3, 6};
    for (int k = 0; k < 2; k++) {
        const int nc = kernels[k];
        struct ggml_init_params ip = {16 * 1024 * 1024, NULL, false};
        struct ggml_context *ctx = ggml_init(ip);
        struct ggml_tensor *sx = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, nc - 1 + tokens, channels, 1);
        struct ggml_tensor *w = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, nc, channels);
        float *a = (float *)sx->data, *b = (float *)w->data;
        for (int i = 0; i < (nc - 1 + tokens) * channels; i++) a[i] = rnd() * 3.0f;
        for (int i = 0; i < nc * channels; i++) b[i] = rnd();
        struct ggml_tensor *y = ggml_ssm_conv(ctx, sx, w);
        struct ggml_cgraph *gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, y);
        ggml_graph_compute_with_ctx(ctx, gf, 2);
        section(a, (nc - 1 + tokens) * channels);
        section(b, nc * channels);
        section((const float *)y->data, tokens * channels);
        ggml_free(ctx);
    }
    return 0;
}
