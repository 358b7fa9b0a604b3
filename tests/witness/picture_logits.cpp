// llama.cpp with its mtmd on a prompt of text, a picture and text, on the CPU: the language model and the
// projector are loaded as llama.cpp's mtmd tools load them, the text before the picture is decoded as
// token ids at positions 0.., the picture goes through mtmd (encoded, then decoded as mtmd's helper decodes
// an image chunk: its own batch, its positions (M-RoPE's for Qwen-VL, plain ones for Gemma 4), causal
// attention off where mtmd turns it off (Gemma 4), n_past advanced by its position span), and the text
// after it is decoded from the new n_past with every row's logits requested. Writes those rows' logits
// (little-endian f32, row after row) to OUT and prints a JSON line: the picture's grid, its rows, n_past
// before and after it, n_vocab, whether mtmd used M-RoPE and non-causal attention.
//
// Usage: picture_logits MODEL MMPROJ PICTURE OUT.bin FLASH BEFORE AFTER
//   FLASH: on|off (the language model's and the encoder's flash attention); BEFORE, AFTER: token ids,
//   comma-separated (the text before and after the picture). PICTURE_MIN_TOKENS=N: mtmd's
//   --image-min-tokens (default: the projector's).
// Build: tests/witness/build_picture_logits.sh.

#include "llama.h"
#include "mtmd.h"
#include "mtmd-helper.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

static void die(const char * what) {
    fprintf(stderr, "picture_logits: %s\n", what);
    exit(1);
}

static std::vector<llama_token> ids(const char * list) {
    std::vector<llama_token> out;
    std::stringstream ss(list);
    std::string item;
    while (std::getline(ss, item, ',')) {
        out.push_back((llama_token) atoi(item.c_str()));
    }
    return out;
}

// Decodes `tokens` at positions pos0.. of sequence 0, asking for every row's logits when `logits`.
static void decode_text(llama_context * lctx, const std::vector<llama_token> & tokens, llama_pos pos0, bool logits) {
    llama_batch batch = llama_batch_init((int32_t) tokens.size(), 0, 1);
    for (size_t i = 0; i < tokens.size(); i++) {
        batch.token[i] = tokens[i];
        batch.pos[i] = pos0 + (llama_pos) i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = logits;
    }
    batch.n_tokens = (int32_t) tokens.size();
    if (llama_decode(lctx, batch) != 0) {
        die("decoding text failed");
    }
    llama_batch_free(batch);
}

int main(int argc, char ** argv) {
    if (argc != 8) {
        die("usage: picture_logits MODEL MMPROJ PICTURE OUT.bin on|off BEFORE AFTER");
    }
    const bool flash = strcmp(argv[5], "on") == 0;
    if (!flash && strcmp(argv[5], "off") != 0) {
        die("FLASH must be on or off");
    }
    const std::vector<llama_token> before = ids(argv[6]);
    const std::vector<llama_token> after = ids(argv[7]);
    if (after.empty()) {
        die("no text after the picture");
    }

    llama_backend_init();
    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mparams);
    if (model == nullptr) {
        die("the model did not load");
    }
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = 512;
    cparams.n_batch = 512;
    cparams.n_ubatch = 512;
    cparams.n_threads = 1;
    cparams.n_threads_batch = 1;
    cparams.flash_attn_type = flash ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    llama_context * lctx = llama_init_from_model(model, cparams);
    if (lctx == nullptr) {
        die("no context");
    }

    mtmd_context_params vparams = mtmd_context_params_default();
    vparams.use_gpu = false;
    vparams.n_threads = 1;
    vparams.warmup = false;
    vparams.flash_attn_type = cparams.flash_attn_type;
    vparams.image_min_tokens = getenv("PICTURE_MIN_TOKENS") ? atoi(getenv("PICTURE_MIN_TOKENS")) : -1;
    mtmd_context * vctx = mtmd_init_from_file(argv[2], model, vparams);
    if (vctx == nullptr) {
        die("the projector did not load");
    }
    mtmd_bitmap * bitmap = mtmd_helper_bitmap_init_from_file(vctx, argv[3], false, mtmd_helper_init_opt_default()).bitmap;
    if (bitmap == nullptr) {
        die("the picture did not load");
    }
    // The marker alone: mtmd's chunks are the picture and whatever text it puts around it, of which only
    // the picture is read here (the text is given as ids).
    mtmd_input_text text = {mtmd_default_marker(), strlen(mtmd_default_marker()), false, true};
    mtmd_input_chunks * chunks = mtmd_input_chunks_init();
    const mtmd_bitmap * bitmaps[] = {bitmap};
    if (mtmd_tokenize(vctx, chunks, &text, bitmaps, 1) != 0) {
        die("mtmd_tokenize failed");
    }
    const mtmd_input_chunk * picture = nullptr;
    for (size_t i = 0; i < mtmd_input_chunks_size(chunks); i++) {
        const mtmd_input_chunk * c = mtmd_input_chunks_get(chunks, i);
        if (mtmd_input_chunk_get_type(c) == MTMD_INPUT_CHUNK_TYPE_IMAGE) {
            picture = c;
        }
    }
    if (picture == nullptr) {
        die("no picture chunk");
    }

    const llama_pos n_before = (llama_pos) before.size();
    if (!before.empty()) {
        decode_text(lctx, before, 0, false);
    }
    llama_pos n_past = n_before;
    if (mtmd_helper_eval_chunk_single(vctx, lctx, picture, n_before, 0, 512, false, &n_past) != 0) {
        die("the picture's chunk failed");
    }
    decode_text(lctx, after, n_past, true);

    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::vector<float> logits;
    for (size_t i = 0; i < after.size(); i++) {
        const float * row = llama_get_logits_ith(lctx, (int32_t) i);
        for (int j = 0; j < n_vocab; j++) {
            if (!std::isfinite(row[j])) {
                die("a logit is not finite");
            }
        }
        logits.insert(logits.end(), row, row + n_vocab);
    }
    FILE * out = fopen(argv[4], "wb");
    if (out == nullptr || fwrite(logits.data(), sizeof(float), logits.size(), out) != logits.size()) {
        die("writing the logits failed");
    }
    fclose(out);
    const mtmd_image_tokens * tokens = mtmd_input_chunk_get_tokens_image(picture);
    mtmd_decoder_pos first = mtmd_image_tokens_get_decoder_pos(tokens, n_before, 0);
    printf("{\"rows\":%zu,\"n_pos\":%d,\"n_past_before\":%d,\"n_past_after\":%d,\"first_pos\":[%u,%u,%u,%u],"
           "\"n_vocab\":%d,\"mrope\":%s,\"non_causal\":%s}\n",
           mtmd_input_chunk_get_n_tokens(picture), (int) mtmd_input_chunk_get_n_pos(picture), (int) n_before,
           (int) n_past, first.t, first.x, first.y, first.z, n_vocab,
           mtmd_decode_use_mrope(vctx) ? "true" : "false",
           mtmd_decode_use_non_causal(vctx, picture) ? "true" : "false");
    mtmd_input_chunks_free(chunks);
    mtmd_bitmap_free(bitmap);
    mtmd_free(vctx);
    llama_free(lctx);
    llama_model_free(model);
    return 0;
}
