// ggml_mulmat_bench: time ggml_mul_mat (weight type T, M x K weight, K x N f32 activations) on the
// ggml CPU backend, for chosen types, N (columns), thread counts and weight layouts, and print one
// line per case with µs/run, GFLOPS and GB/s of weights (weight bytes / time).
//
// Why this exists: test-backend-ops' perf mode runs with hardware_concurrency()/2 threads (1 on a
// 2-core machine), only on a 4096x14336 weight, and always in the plain CPU buffer, so it never
// measures the "repacked" kernels (CPU_REPACK extra buffer: Q4_0, Q4_K, IQ4_NL, MXFP4 on AVX2)
// that llama.cpp uses when it loads a model. This tool measures both layouts:
//   plain  : weight in the ordinary CPU buffer (ggml_vec_dot_* / llamafile sgemm paths)
//   repack : weight in the CPU_REPACK buffer (interleaved gemv/gemm); only for types it repacks
// Activation quantisation (f32 -> q8_0/q8_K) is part of the timed op, as in llama.cpp.
//
// Cache note: a 4096x4096 quantised weight (2-18 MB) fits in a 32 MB L3, so N=1 runs repeated on
// one weight are cache-warm. --rotate-mb X allocates enough copies of the weight to exceed X MB and
// cycles through them, giving DRAM-bound figures.
//
// Build: see build_ggml_mulmat_bench.sh next to this file.
// usage: ggml_mulmat_bench [--types all|F32,Q4_0,...] [--m 4096] [--k 4096] [--n 1,512]
//                          [--threads 1,2] [--layout both|plain|repack] [--rotate-mb 0]
//                          [--min-time 1.0] [--min-reps 5] [--poll 50]

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <ctime>
#include <string>
#include <vector>

static const ggml_type k_all_types[] = {
    GGML_TYPE_F32,     GGML_TYPE_F16,    GGML_TYPE_BF16,  GGML_TYPE_Q4_0,    GGML_TYPE_Q4_1,   GGML_TYPE_Q5_0,
    GGML_TYPE_Q5_1,    GGML_TYPE_Q8_0,   GGML_TYPE_Q2_K,  GGML_TYPE_Q3_K,    GGML_TYPE_Q4_K,   GGML_TYPE_Q5_K,
    GGML_TYPE_Q6_K,    GGML_TYPE_IQ2_XXS, GGML_TYPE_IQ2_XS, GGML_TYPE_IQ2_S, GGML_TYPE_IQ3_XXS, GGML_TYPE_IQ3_S,
    GGML_TYPE_IQ4_NL,  GGML_TYPE_IQ4_XS, GGML_TYPE_MXFP4, GGML_TYPE_IQ1_S,   GGML_TYPE_IQ1_M,
};

static std::vector<std::string> split(const std::string & s) {
    std::vector<std::string> out;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ',')) {
        if (!item.empty()) {
            out.push_back(item);
        }
    }
    return out;
}

static bool parse_type(const std::string & name, ggml_type & out) {
    for (int t = 0; t < GGML_TYPE_COUNT; t++) {
        const char * tn = ggml_type_name((ggml_type) t);
        if (tn && strcasecmp(tn, name.c_str()) == 0) {
            out = (ggml_type) t;
            return true;
        }
    }
    return false;
}

static double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// CPU time of the calling thread. With 1 thread the op runs entirely on this thread, so this time
// excludes the time the thread waited for a core: the figure to trust on a shared, busy machine.
static double thread_cpu_s() {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
}

struct options {
    std::vector<ggml_type> types;
    int64_t                m = 4096;
    int64_t                k = 4096;
    std::vector<int>       ns{ 1, 512 };
    std::vector<int>       threads{ 1, 2 };
    bool                   plain     = true;
    bool                   repack    = true;
    double                 rotate_mb = 0;
    double                 min_time  = 1.0;
    int                    min_reps  = 5;
    int                    poll      = 50;
};

static void usage(const char * argv0) {
    fprintf(stderr,
            "usage: %s [--types all|F32,Q4_0,...] [--m 4096] [--k 4096] [--n 1,512] [--threads 1,2]\n"
            "          [--layout both|plain|repack] [--rotate-mb 0] [--min-time 1.0] [--min-reps 5] [--poll 50]\n",
            argv0);
}

static bool parse_args(int argc, char ** argv, options & o) {
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        auto        v = [&]() -> std::string { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
        if (a == "--types") {
            std::string s = v();
            if (s == "all") {
                o.types.assign(std::begin(k_all_types), std::end(k_all_types));
            } else {
                for (auto & n : split(s)) {
                    ggml_type t;
                    if (!parse_type(n, t)) {
                        fprintf(stderr, "unknown type %s\n", n.c_str());
                        return false;
                    }
                    o.types.push_back(t);
                }
            }
        } else if (a == "--m") {
            o.m = atoll(v().c_str());
        } else if (a == "--k") {
            o.k = atoll(v().c_str());
        } else if (a == "--n") {
            o.ns.clear();
            for (auto & n : split(v())) o.ns.push_back(atoi(n.c_str()));
        } else if (a == "--threads") {
            o.threads.clear();
            for (auto & n : split(v())) o.threads.push_back(atoi(n.c_str()));
        } else if (a == "--layout") {
            std::string s = v();
            o.plain       = s == "both" || s == "plain";
            o.repack      = s == "both" || s == "repack";
        } else if (a == "--rotate-mb") {
            o.rotate_mb = atof(v().c_str());
        } else if (a == "--min-time") {
            o.min_time = atof(v().c_str());
        } else if (a == "--min-reps") {
            o.min_reps = atoi(v().c_str());
        } else if (a == "--poll") {
            o.poll = atoi(v().c_str());
        } else {
            usage(argv[0]);
            return false;
        }
    }
    if (o.types.empty()) {
        o.types.assign(std::begin(k_all_types), std::end(k_all_types));
    }
    return true;
}

// Quantised bytes of an M x K weight: `unique` distinct random rows tiled over M rows. Timing does not
// depend on values, and quantising few rows keeps the slow IQ quantisers quick.
static std::vector<uint8_t> make_weight(ggml_type type, int64_t m, int64_t k, std::mt19937 & rng) {
    const int64_t unique = std::min<int64_t>(m, 32);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float>              src(unique * k);
    for (auto & x : src) x = dist(rng);
    std::vector<float> imatrix(k, 1.0f);  // IQ1/IQ2 quantisers require an importance matrix
    const size_t       row_size = ggml_row_size(type, k);
    std::vector<uint8_t> rows(unique * row_size);
    ggml_quantize_chunk(type, src.data(), rows.data(), 0, unique, k,
                        ggml_quantize_requires_imatrix(type) ? imatrix.data() : nullptr);
    std::vector<uint8_t> w(m * row_size);
    for (int64_t r = 0; r < m; r++) {
        memcpy(w.data() + r * row_size, rows.data() + (r % unique) * row_size, row_size);
    }
    return w;
}

struct case_result {
    bool   ok = false;
    double us_med = 0, us_min = 0;
    int    reps = 0;
};

// Builds copies x (A_i, C_i = A_i * B) in buffer type `buft`, then times graph compute per thread count.
static void run_layout(const options & o, ggml_backend_t backend, ggml_type type, const char * layout,
                       ggml_backend_buffer_type_t buft, const std::vector<uint8_t> & wdata,
                       const std::vector<ggml_threadpool_t> & pools) {
    const size_t wbytes = wdata.size();
    int          copies = 1;
    if (o.rotate_mb > 0) {
        copies = (int) std::ceil(o.rotate_mb * 1e6 / (double) wbytes);
        copies = std::max(copies, 1);
    }

    ggml_init_params wp = { ggml_tensor_overhead() * (copies + 1), nullptr, true };
    ggml_context *   ctx_w = ggml_init(wp);
    std::vector<ggml_tensor *> as;
    for (int c = 0; c < copies; c++) {
        as.push_back(ggml_new_tensor_2d(ctx_w, type, o.k, o.m));
    }
    ggml_backend_buffer_t buf_w = ggml_backend_alloc_ctx_tensors_from_buft(ctx_w, buft);
    if (!buf_w) {
        printf("%-8s %-6s alloc failed\n", ggml_type_name(type), layout);
        ggml_free(ctx_w);
        return;
    }
    ggml_backend_buffer_set_usage(buf_w, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    if (strcmp(layout, "repack") == 0 && as[0]->extra == nullptr) {
        // CPU_REPACK has no interleaved layout for this type on this CPU: llama.cpp keeps it plain.
        ggml_backend_buffer_free(buf_w);
        ggml_free(ctx_w);
        return;
    }
    for (auto * a : as) {
        ggml_backend_tensor_set(a, wdata.data(), 0, wbytes);
    }

    std::mt19937 rng(1234);
    std::uniform_real_distribution<float> ud(-1.0f, 1.0f);

    for (int n : o.ns) {
        ggml_init_params cp = { ggml_tensor_overhead() * (2 * copies + 4) + ggml_graph_overhead() * copies, nullptr,
                                true };
        ggml_context *   ctx_c = ggml_init(cp);
        ggml_tensor *    b     = ggml_new_tensor_2d(ctx_c, GGML_TYPE_F32, o.k, n);
        std::vector<ggml_tensor *> outs;
        for (auto * a : as) {
            outs.push_back(ggml_mul_mat(ctx_c, a, b));
        }
        std::vector<ggml_cgraph *> graphs;
        for (auto * c : outs) {
            ggml_cgraph * g = ggml_new_graph(ctx_c);
            ggml_build_forward_expand(g, c);
            graphs.push_back(g);
        }
        ggml_backend_buffer_t buf_c = ggml_backend_alloc_ctx_tensors(ctx_c, backend);
        std::vector<float>    bdata(o.k * n);
        for (auto & x : bdata) x = ud(rng);
        ggml_backend_tensor_set(b, bdata.data(), 0, bdata.size() * sizeof(float));

        if (!ggml_backend_supports_op(backend, outs[0])) {
            printf("%-8s %-6s n=%d not supported\n", ggml_type_name(type), layout, n);
        } else {
            for (size_t ti = 0; ti < o.threads.size(); ti++) {
                ggml_backend_cpu_set_n_threads(backend, o.threads[ti]);
                ggml_backend_cpu_set_threadpool(backend, pools[ti]);
                ggml_threadpool_resume(pools[ti]);
                // warm-up: one pass over every copy
                for (auto * g : graphs) ggml_backend_graph_compute(backend, g);
                std::vector<double> ts, cs;
                double              t_total = 0;
                size_t              gi      = 0;
                while (t_total < o.min_time || (int) ts.size() < o.min_reps) {
                    const double c0 = thread_cpu_s();
                    const double t0 = now_s();
                    ggml_backend_graph_compute(backend, graphs[gi]);
                    const double dt = now_s() - t0;
                    cs.push_back(thread_cpu_s() - c0);
                    ts.push_back(dt);
                    t_total += dt;
                    gi = (gi + 1) % graphs.size();
                }
                std::sort(ts.begin(), ts.end());
                std::sort(cs.begin(), cs.end());
                const double med   = ts[ts.size() / 2];
                const double mn    = ts[0];
                const double cpu   = cs[cs.size() / 2];
                const double flops = 2.0 * (double) o.m * (double) o.k * (double) n;
                float        probe = 0;
                ggml_backend_tensor_get(outs[0], &probe, 0, sizeof(float));
                printf("%-8s %-6s %6lld %6lld %4d %3d %4d %5zu %11.1f %11.1f %11.1f %9.2f %9.3f %8.2f %8.2f %8.2f %5s\n",
                       ggml_type_name(type), layout, (long long) o.m, (long long) o.k, n, o.threads[ti], copies,
                       ts.size(), med * 1e6, mn * 1e6, cpu * 1e6, flops / mn * 1e-9, wbytes / 1e6,
                       wbytes / med * 1e-9, wbytes / mn * 1e-9, wbytes / cpu * 1e-9,
                       std::isfinite(probe) ? "ok" : "NaN");
                fflush(stdout);
                ggml_threadpool_pause(pools[ti]);
            }
        }
        ggml_backend_buffer_free(buf_c);
        ggml_free(ctx_c);
    }
    ggml_backend_buffer_free(buf_w);
    ggml_free(ctx_w);
}

int main(int argc, char ** argv) {
    options o;
    if (!parse_args(argc, argv, o)) {
        return 1;
    }
    ggml_backend_t backend = ggml_backend_cpu_init();
    if (!backend) {
        fprintf(stderr, "no CPU backend\n");
        return 1;
    }

    // CPU_REPACK buffer type, as llama.cpp finds it (via the device's extra buffer types).
    ggml_backend_buffer_type_t repack_buft = nullptr;
    {
        ggml_backend_dev_t dev = ggml_backend_get_device(backend);
        ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
        auto               fn  = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
            reg, "ggml_backend_dev_get_extra_bufts");
        if (fn) {
            for (ggml_backend_buffer_type_t * p = fn(dev); p && *p; p++) {
                if (strcmp(ggml_backend_buft_name(*p), "CPU_REPACK") == 0) {
                    repack_buft = *p;
                }
            }
        }
    }

    std::vector<ggml_threadpool_t> pools;
    for (int t : o.threads) {
        ggml_threadpool_params tp = ggml_threadpool_params_default(t);
        tp.poll                   = o.poll;
        tp.paused                 = true;  // only the pool being timed runs, so idle workers never spin
        pools.push_back(ggml_threadpool_new(&tp));
    }

    printf("# ggml_mulmat_bench: M=%lld K=%lld, repack buffer %s, rotate_mb=%.0f, min_time=%.2fs, poll=%d\n",
           (long long) o.m, (long long) o.k, repack_buft ? "available" : "absent", o.rotate_mb, o.min_time, o.poll);
    printf("# columns: us_med/us_min = median/min wall time per op; us_cpu = median CPU time of the calling\n"
           "# thread (the whole op when thr=1; its share when thr>1); GFLOPS from us_min; GB/s = weight bytes\n"
           "# over us_med, us_min, us_cpu.\n");
    printf("# %-6s %-6s %6s %6s %4s %3s %4s %5s %11s %11s %11s %9s %9s %8s %8s %8s %5s\n", "type", "layout", "M", "K",
           "n", "thr", "cps", "reps", "us_med", "us_min", "us_cpu", "GFLOPS", "weight_MB", "GBs_med", "GBs_min",
           "GBs_cpu", "check");
    fflush(stdout);

    std::mt19937 rng(42);
    for (ggml_type type : o.types) {
        if (o.k % ggml_blck_size(type) != 0) {
            printf("%-8s K=%lld not a multiple of block %lld\n", ggml_type_name(type), (long long) o.k,
                   (long long) ggml_blck_size(type));
            continue;
        }
        std::vector<uint8_t> w = make_weight(type, o.m, o.k, rng);
        if (o.plain) {
            run_layout(o, backend, type, "plain", ggml_backend_cpu_buffer_type(), w, pools);
        }
        if (o.repack && repack_buft) {
            run_layout(o, backend, type, "repack", repack_buft, w, pools);
        }
    }

    ggml_backend_cpu_set_threadpool(backend, nullptr);
    for (auto * p : pools) ggml_threadpool_free(p);
    ggml_backend_free(backend);
    return 0;
}
