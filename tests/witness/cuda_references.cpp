// llama.cpp's CUDA build as a second witness: for every committed reference (tests/fixtures/references/*.json,
// written by make_references.py with llama.cpp's CPU build), runs the same model file and prompt through
// llama.cpp with every layer on the GPU and writes a reference of the same format, so our GPU engine can be
// compared with the llama.cpp backend that rounds activations the way a card does (q8_1), and llama.cpp's CUDA
// and CPU builds can be compared with each other under the same rule.
//
// The run copies make_references.py's settings (llama_context_default_params() except n_ctx = the
// reference's, so n_batch 2048 / n_ubatch 512; flash attention "auto", which is on for CUDA; K/V F16;
// swa_full as the reference says; the prompt decoded in calls of at most n_batch tokens; 64 greedy steps,
// each the argmax of the last position's logits with the lowest id on a tie; probabilities the float64
// softmax of all logits; no stop on end-of-generation tokens). Only n_gpu_layers differs (999).
//
// Build (on the GPU machine, against a llama.cpp CUDA build of the same sdist, e.g. the one
// shared/device/llamacpp_build_cuda.sh makes):
//   g++ -O2 -std=c++17 cuda_references.cpp -I$SRC/include -I$SRC/ggml/include -I$SRC/vendor \
//       -L$BUILD/bin -lllama -lggml -lggml-base -Wl,-rpath,$BUILD/bin -o cuda_references
// Run: cuda_references MODELS_DIR REFERENCES_DIR OUT_DIR [NAME_FILTER]
//   MODELS_DIR holds the model files the references name (tests/fixtures/models); references whose model is
//   missing there are skipped with a line on stderr.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "llama.h"
#include "nlohmann/json.hpp"

using json = nlohmann::ordered_json;
namespace fs = std::filesystem;

static constexpr int N_TOP = 5;

static void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

static double round7(double x) { return std::round(x * 1e7) / 1e7; }

// One greedy run of `prompt` in a fresh context; the steps in the references' JSON form.
static json generate(llama_model * model, const json & ref) {
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = ref["n_ctx"].get<uint32_t>();
    if (ref.contains("settings") && ref["settings"].contains("swa_full")) {
        cp.swa_full = ref["settings"]["swa_full"].get<bool>();
    }
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        throw std::runtime_error("llama_init_from_model failed");
    }
    std::vector<llama_token> prompt = ref["prompt"].get<std::vector<llama_token>>();
    const int n_batch = (int) llama_n_batch(ctx);
    for (size_t i = 0; i < prompt.size(); i += n_batch) {
        int n = (int) std::min<size_t>(n_batch, prompt.size() - i);
        if (llama_decode(ctx, llama_batch_get_one(prompt.data() + i, n)) != 0) {
            llama_free(ctx);
            throw std::runtime_error("llama_decode failed on the prompt");
        }
    }
    const int n_steps = (int) ref["steps"].size();
    json steps = json::array();
    std::vector<double> p(n_vocab);
    std::vector<int> order(n_vocab);
    for (int step = 0; step < n_steps; ++step) {
        const float * logits = llama_get_logits_ith(ctx, -1);
        double mx = -INFINITY;
        for (int t = 0; t < n_vocab; ++t) {
            mx = std::max(mx, (double) logits[t]);
        }
        double sum = 0;
        for (int t = 0; t < n_vocab; ++t) {
            p[t] = std::exp((double) logits[t] - mx);
            sum += p[t];
        }
        for (int t = 0; t < n_vocab; ++t) {
            p[t] /= sum;
            order[t] = t;
        }
        // Stable: equal probabilities keep ascending ids, like argmax.
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
        json top = json::array();
        for (int k = 0; k < N_TOP; ++k) {
            top.push_back(json::array({order[k], round7(p[order[k]])}));
        }
        llama_token token = order[0];
        steps.push_back({{"token", token}, {"top", top}, {"gap", round7(p[order[0]] - p[order[1]])}});
        if (step + 1 < n_steps && llama_decode(ctx, llama_batch_get_one(&token, 1)) != 0) {
            llama_free(ctx);
            throw std::runtime_error("llama_decode failed on a step");
        }
    }
    llama_free(ctx);
    return steps;
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODELS_DIR REFERENCES_DIR OUT_DIR [NAME_FILTER]\n", argv[0]);
        return 2;
    }
    const fs::path models_dir = argv[1], refs_dir = argv[2], out_dir = argv[3];
    const std::string filter = argc > 4 ? argv[4] : "";
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    fs::create_directories(out_dir);

    std::vector<fs::path> refs;
    for (const auto & e : fs::directory_iterator(refs_dir)) {
        if (e.path().extension() == ".json" && e.path().filename().string().find(filter) != std::string::npos) {
            refs.push_back(e.path());
        }
    }
    std::sort(refs.begin(), refs.end());
    std::string loaded_name;
    llama_model * model = nullptr;
    int failures = 0;
    for (const auto & path : refs) {
        json ref;
        std::ifstream(path) >> ref;
        const std::string name = ref["model"].get<std::string>();
        const fs::path model_path = models_dir / name;
        if (!fs::exists(model_path)) {
            fprintf(stderr, "skip %s: %s is not in %s\n", path.filename().c_str(), name.c_str(), models_dir.c_str());
            continue;
        }
        if (name != loaded_name) {
            if (model) {
                llama_model_free(model);
            }
            llama_model_params mp = llama_model_default_params();
            mp.n_gpu_layers = 999;
            model = llama_model_load_from_file(model_path.c_str(), mp);
            loaded_name = model ? name : "";
            if (!model) {
                fprintf(stderr, "FAIL %s: llama.cpp could not load %s\n", path.filename().c_str(), name.c_str());
                ++failures;
                continue;
            }
        }
        try {
            json doc = ref;
            doc["steps"] = generate(model, ref);
            doc["llama_cpp"] = ref["llama_cpp"].get<std::string>() + "; CUDA build (n_gpu_layers 999)";
            doc["settings"]["device"] = "CUDA, every layer on the GPU (n_gpu_layers 999)";
            doc["settings"]["flash_attn"] = "auto (enabled on CUDA)";
            doc["system_info"] = llama_print_system_info();
            std::ofstream(out_dir / path.filename()) << doc.dump() << "\n";
            fprintf(stderr, "ok %s\n", path.filename().c_str());
        } catch (const std::exception & e) {
            fprintf(stderr, "FAIL %s: %s\n", path.filename().c_str(), e.what());
            ++failures;
        }
    }
    if (model) {
        llama_model_free(model);
    }
    llama_backend_free();
    return failures == 0 ? 0 : 1;
}
