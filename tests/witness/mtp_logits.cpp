// llama.cpp's MTP draft head (LLM_GRAPH_TYPE_DECODER_MTP) on a prompt, as common/speculative.cpp's
// `draft-mtp` feeds it: the target context reads the prompt with its post-norm hidden rows (`h_nextn`,
// unmasked: every row), then an MTP context (LLAMA_CONTEXT_TYPE_MTP, its own KV cache) reads token k at
// position k with the target's hidden row of k - 1 (zeros for k = 0, as `pending_h` starts), every row's
// logits out. Prints, per row, the draft's five likeliest tokens with their probabilities as JSON, the
// witness `engine/tests/draft_block_witness.rs` compares PolyStrata's draft block with.
//
// Build (a CPU build of the pinned llama.cpp, static, AVX2 + FMA: the build whose orders the engine's
// default arithmetic follows bit for bit; a native AVX-512 build differs by rounding, which these tiny
// MoE models amplify past the rule on some rows; see tests/witness/README.md):
//   cmake -S $SRC -B $SRC/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON \
//         -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF \
//         -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DGGML_OPENMP=OFF -DLLAMA_BUILD_TESTS=OFF \
//         -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
//   ninja -C $SRC/build llama
//   g++ -O2 -std=c++17 tests/witness/mtp_logits.cpp -I$SRC/include -I$SRC/ggml/include -I$SRC/src \
//       $SRC/build/src/libllama.a $SRC/build/ggml/src/libggml.a $SRC/build/ggml/src/libggml-cpu.a \
//       $SRC/build/ggml/src/libggml-base.a -lpthread -o /tmp/mtp_logits
// Run (the committed references: the tokens of tests/fixtures/references/mtp/*.json, the model's path made
// its file name):
//   /tmp/mtp_logits tests/fixtures/models/qwen35moe-tiny-q4km.gguf TOKEN... \
//     | sed 's#"tests/fixtures/models/#"#' > tests/fixtures/references/mtp/qwen35moe-tiny-q4km.mtp.json

#include "llama.h"
#include "llama-ext.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

static void die(const char * what) {
    fprintf(stderr, "mtp_logits: %s\n", what);
    exit(1);
}

// One decode of `tokens` at positions 0.. with optional per-token state rows (`h`, n_embd each: the
// hidden row's width); every row
// is an output.
static void decode(llama_context * ctx, const std::vector<llama_token> & tokens, const std::vector<float> * h,
                   size_t n_embd) {
    llama_batch_ext * b = llama_batch_ext_init(ctx);
    for (size_t i = 0; i < tokens.size(); ++i) {
        const int32_t idx = llama_batch_ext_add_token(b, 0, tokens[i]);
        if (idx < 0) {
            die("batch full");
        }
        const llama_pos pos[4] = { (llama_pos) i, 0, 0, 0 };
        llama_batch_ext_set_pos(b, idx, pos);
        if (h && !llama_batch_ext_set_embd_token(b, idx, { h->data() + i * n_embd, 1, n_embd })) {
            die("set_embd_token");
        }
        llama_batch_ext_set_output_logits(b, idx, true);
    }
    if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, b) != 0) {
        die("llama_process failed");
    }
    llama_batch_ext_free(b);
}

// The target's `h_nextn` as its graph computes it, every row (the scheduler's eval callback). Read after
// the decode, deepseek4's is not that: its `h_nextn` is the last block's streams, whose memory the pinned
// graph lets the mHC head's operations reuse (the rows read back hold the final norm's output instead);
// the callback sees the tensor before that.
static bool keep_h_nextn(struct ggml_tensor * t, bool ask, void * user_data) {
    if (strcmp(t->name, "h_nextn") != 0) {
        return ask ? false : true;
    }
    if (!ask) {
        if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t)) {
            die("h_nextn is not contiguous f32");
        }
        auto * rows = static_cast<std::vector<float> *>(user_data);
        rows->resize(ggml_nelements(t));
        ggml_backend_tensor_get(t, rows->data(), 0, ggml_nbytes(t));
    }
    return true;
}

int main(int argc, char ** argv) {
    if (argc < 3) {
        die("usage: mtp_logits MODEL.gguf TOKEN...");
    }
    std::vector<llama_token> tokens;
    for (int i = 2; i < argc; ++i) {
        tokens.push_back(atoi(argv[i]));
    }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.load_mtp = true; // the loader skips the MTP block unless asked
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        die("cannot load the model");
    }
    if (llama_model_n_layer_nextn(model) < 1) {
        die("the model has no MTP block");
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    // The hidden row's width: n_embd, or deepseek4's n_embd per mHC stream (its h_nextn is every stream).
    const size_t n_embd = (size_t) llama_model_n_embd_out(model);

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = 512;
    cp.n_ubatch = 512;
    cp.n_threads = 1;
    cp.n_threads_batch = 1;
    llama_context_params tp = cp;
    std::vector<float> h_nextn;
    tp.cb_eval = keep_h_nextn;
    tp.cb_eval_user_data = &h_nextn;
    llama_context * tgt = llama_init_from_model(model, tp);
    if (!tgt) {
        die("target context");
    }
    // Every row's post-norm hidden state, whatever its output flag (as the MTP driver asks).
    llama_set_embeddings_nextn(tgt, true, false);

    llama_context_params dp = cp;
    dp.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
    dp.n_rs_seq = 0;
    dp.ctx_other = tgt;
    llama_context * dft = llama_init_from_model(model, dp);
    if (!dft) {
        die("MTP context");
    }
    llama_set_embeddings_nextn(dft, true, true);

    decode(tgt, tokens, nullptr, n_embd);
    // The MTP pairs token k with the target's hidden row of k - 1.
    std::vector<float> h(tokens.size() * n_embd, 0.0f);
    if (h_nextn.size() != tokens.size() * n_embd) {
        die("h_nextn was not seen whole");
    }
    for (size_t k = 1; k < tokens.size(); ++k) {
        const float * row = h_nextn.data() + (k - 1) * n_embd;
        std::copy(row, row + n_embd, h.begin() + k * n_embd);
    }
    decode(dft, tokens, &h, n_embd);

    printf("{\"model\": \"%s\", \"tokens\": [", argv[1]);
    for (size_t i = 0; i < tokens.size(); ++i) {
        printf("%s%d", i ? ", " : "", tokens[i]);
    }
    printf("], \"rows\": [\n");
    for (size_t i = 0; i < tokens.size(); ++i) {
        const float * l = llama_get_logits_ith(dft, (int32_t) i);
        if (!l) {
            die("no logits");
        }
        float mx = *std::max_element(l, l + n_vocab);
        double sum = 0;
        for (int t = 0; t < n_vocab; ++t) {
            sum += std::exp((double) l[t] - mx);
        }
        std::vector<int> ids(n_vocab);
        for (int t = 0; t < n_vocab; ++t) {
            ids[t] = t;
        }
        std::partial_sort(ids.begin(), ids.begin() + 5, ids.end(),
                          [&](int a, int b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
        printf("  [");
        for (int j = 0; j < 5; ++j) {
            printf("%s[%d, %.6f]", j ? ", " : "", ids[j], std::exp((double) l[ids[j]] - mx) / sum);
        }
        printf("]%s\n", i + 1 < tokens.size() ? "," : "");
    }
    printf("]}\n");
    llama_free(dft);
    llama_free(tgt);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
