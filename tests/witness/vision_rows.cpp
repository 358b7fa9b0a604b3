// llama.cpp's mtmd image encoder (tools/mtmd's clip) on one picture: the projector file is loaded on the
// CPU, the picture decoded with stb_image (three channels, as mtmd's helper decodes), preprocessed with the
// projector type's own preprocessor (for qwen3vl_merger: smart resize to multiples of 32, Pillow bicubic,
// mean/std; for gemma4v the same to multiples of 48) and encoded. Writes the rows (little-endian f32, row after row) to OUT and prints their shape
// as JSON. clip.h's internal API is used so that no language model is needed.
//
// FLASH is `off` (ggml's f32 soft_max attention, what the committed reference uses) or `on` (flash
// attention with K and V cast to f16, mtmd's default on the CPU).
//
// Build: tests/witness/build_vision_rows.sh (a CPU build of the pinned llama.cpp's `mtmd` target, static).
// Run (the committed reference, from the projector `poly-engine synth` writes):
//   poly-engine synth --arch qwen3vl-mmproj --shape tiny --type F32 --seed 1 --out /tmp/mmproj-tiny-f32.gguf
//   /tmp/vision_rows /tmp/mmproj-tiny-f32.gguf tests/fixtures/vision/picture-64x48.png \
//       tests/fixtures/vision/qwen3vl-tiny-f32.rows.bin off

#include "clip.h"
#include "ggml-backend.h"
#include "clip-impl.h"
#include "clip-model.h"
#include "mtmd-image.h"

#define STB_IMAGE_IMPLEMENTATION
#include "stb/stb_image.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

// VISION_ROWS_TRACE=DIR: every contiguous f32 tensor of the graph written to DIR/<name>.bin (for finding
// where two encoders part).
static bool trace_tensor(ggml_tensor * t, bool ask, void * user_data) {
    if (ask) {
        return t->type == GGML_TYPE_F32 && ggml_is_contiguous(t);
    }
    std::vector<float> data(ggml_nelements(t));
    ggml_backend_tensor_get(t, data.data(), 0, ggml_nbytes(t));
    std::string path = std::string((const char *) user_data) + "/" + ggml_get_name(t) + ".bin";
    FILE * f = fopen(path.c_str(), "wb");
    if (f != nullptr) {
        fwrite(data.data(), sizeof(float), data.size(), f);
        fclose(f);
    }
    return true;
}

static void die(const char * what) {
    fprintf(stderr, "vision_rows: %s\n", what);
    exit(1);
}

int main(int argc, char ** argv) {
    if (argc != 5) {
        die("usage: vision_rows MMPROJ PICTURE OUT.bin on|off");
    }
    const bool flash = strcmp(argv[4], "on") == 0;
    if (!flash && strcmp(argv[4], "off") != 0) {
        die("FLASH must be on or off");
    }

    clip_context_params params{};
    params.use_gpu = false;
    params.device = nullptr;
    params.flash_attn_type = flash ? CLIP_FLASH_ATTN_TYPE_ENABLED : CLIP_FLASH_ATTN_TYPE_DISABLED;
    // VISION_ROWS_MIN_TOKENS=N: mtmd's --image-min-tokens (pictures scaled up to at least N output rows).
    params.image_min_tokens = getenv("VISION_ROWS_MIN_TOKENS") ? atoi(getenv("VISION_ROWS_MIN_TOKENS")) : -1;
    // VISION_ROWS_MAX_TOKENS=N: mtmd's --image-max-tokens (pictures scaled down to at most N merged rows).
    params.image_max_tokens = getenv("VISION_ROWS_MAX_TOKENS") ? atoi(getenv("VISION_ROWS_MAX_TOKENS")) : -1;
    params.warmup = false;
    if (const char * dir = getenv("VISION_ROWS_TRACE")) {
        params.cb_eval = trace_tensor;
        params.cb_eval_user_data = (void *) dir;
    }
    clip_ctx * ctx = clip_init(argv[1], params).ctx_v;
    if (ctx == nullptr) {
        die("the projector did not load");
    }

    int w = 0, h = 0, channels = 0;
    unsigned char * pixels = stbi_load(argv[2], &w, &h, &channels, 3);
    if (pixels == nullptr) {
        die("the picture did not decode");
    }
    clip_image_u8 img;
    img.set_size({w, h}, false);
    img.cpy_buf(std::vector<uint8_t>(pixels, pixels + (size_t) w * h * 3));
    stbi_image_free(pixels);

    mtmd_image_preprocessor_dyn_size preprocessor(ctx);
    mtmd_image_preproc_out prepared = preprocessor.preprocess(img);
    if (prepared.entries.size() != 1) {
        die("expected one preprocessed picture");
    }
    clip_image_f32_batch batch;
    batch.entries = std::move(prepared.entries);
    // VISION_ROWS_PICTURE=FILE: also the preprocessed picture (f32 RGB interleaved, row-major).
    if (const char * dump = getenv("VISION_ROWS_PICTURE")) {
        const std::vector<float> & buf = batch.entries[0].get_ro_buf();
        FILE * f = fopen(dump, "wb");
        if (f == nullptr || fwrite(buf.data(), sizeof(float), buf.size(), f) != buf.size()) {
            die("writing the preprocessed picture failed");
        }
        fclose(f);
    }

    const clip_image_f32 & entry = batch.entries[0];
    const int n_rows = clip_n_output_tokens(ctx, &entry);
    const int width = clip_n_mmproj_embd(ctx);
    // clip_encode writes into a buffer the caller sized (as mtmd sizes it).
    std::vector<float> rows((size_t) n_rows * width, NAN);
    // VISION_ROWS_THREADS=N: the encoder's CPU threads (default 1, as the references were written).
    const int n_threads = getenv("VISION_ROWS_THREADS") ? atoi(getenv("VISION_ROWS_THREADS")) : 1;
    const auto t0 = std::chrono::steady_clock::now();
    if (!clip_image_batch_encode(ctx, n_threads, &batch, rows)) {
        die("encoding failed");
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (float v : rows) {
        if (!std::isfinite(v)) {
            die("a row value is not finite (not written?)");
        }
    }
    FILE * out = fopen(argv[3], "wb");
    if (out == nullptr || fwrite(rows.data(), sizeof(float), rows.size(), out) != rows.size()) {
        die("writing the rows failed");
    }
    fclose(out);
    printf("{\"picture\":[%d,%d],\"resized\":[%d,%d],\"grid\":[%d,%d],\"rows\":%d,\"width\":%d,\"threads\":%d,"
           "\"encode_seconds\":%.3f}\n",
           w, h, entry.nx(), entry.ny(), clip_n_output_tokens_x(ctx, &entry), clip_n_output_tokens_y(ctx, &entry),
           n_rows, width, n_threads, seconds);
    clip_free(ctx);
    return 0;
}
