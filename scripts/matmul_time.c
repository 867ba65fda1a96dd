// One matrix product on ggml's CPU backend, timed alone: the way to see a kernel's speed without a
// model's noise around it (issue 41: the batch-invariant patch's gemv against llama.cpp's vec_dot).
//
// Build against the llama.cpp that scripts/llama_build.py installed (headers from its source tree):
//   LIB=.venv/lib/python3.11/site-packages/llama_cpp/lib
//   SRC=build/llama-src/0.3.36-$(python -c "import json;print(json.load(open('$LIB/eesd-build.json'))['patch'][:12])")/vendor/llama.cpp
//   cc -O2 -o build/matmul_time scripts/matmul_time.c -I$SRC/ggml/include -L$LIB -lggml-base -lggml-cpu -lggml -Wl,-rpath,$LIB
// Run (TYPE is ggml's type number: 14 Q6_K, 12 Q4_K, 13 Q5_K, 8 Q8_0):
//   build/matmul_time TYPE K N M [ITERS [THREADS [COPIES [REPACK]]]]
// times y = W x for W of N rows of K elements of TYPE (random, quantized) and x of M rows of K floats;
// COPIES distinct W in one graph (each its own product) make the weights stream from memory as in a
// model's decode rather than sit in the last-level cache. Prints the fastest and the median of ITERS
// runs in ms and a checksum of the first product's output: run it once as is and once with
// GGML_CPU_EXACT_ROWS=0 (llama.cpp's own kernels), alternating, and compare. REPACK=1 puts the weights in
// the CPU backend's first extra buffer type (the repacked layouts a model's weights get by default, Q4_K as
// 8x8 blocks on x86) and runs the graph through the backend, as llama.cpp does; 0 (default) a plain buffer.
// Also needs -lggml (the backend API): add it to the cc line.
#include "ggml.h"
#include "ggml-cpu.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

static int cmp_double(const void * a, const void * b) {
    const double x = *(const double *) a, y = *(const double *) b;
    return x < y ? -1 : x > y;
}

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s TYPE K N M [ITERS [THREADS [COPIES]]]\n", argv[0]);
        return 2;
    }
    const enum ggml_type type = (enum ggml_type) atoi(argv[1]);
    const int k = atoi(argv[2]), n = atoi(argv[3]), m = atoi(argv[4]);
    const int iters = argc > 5 ? atoi(argv[5]) : 30;
    const int threads = argc > 6 ? atoi(argv[6]) : 2;
    const int copies = argc > 7 ? atoi(argv[7]) : 1;
    const int repack = argc > 8 ? atoi(argv[8]) : 0;
    if (k <= 0 || n <= 0 || m <= 0 || iters <= 0 || threads <= 0 || copies <= 0 || copies > 64 ||
        type >= GGML_TYPE_COUNT || k % ggml_blck_size(type) != 0) {
        fprintf(stderr, "bad arguments (K must be a multiple of the type's block, COPIES at most 64)\n");
        return 2;
    }
    const size_t mem = (size_t) copies * ggml_row_size(type, k) * n + (size_t) k * m * 4 +
                       (size_t) copies * n * m * 4 + (size_t) (copies + 2) * 1024 + ggml_graph_overhead() + (16u << 20);
    struct ggml_init_params ip = { mem, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_init_params wp = { ggml_tensor_overhead() * 64 + 1024, NULL, true };
    struct ggml_context * wctx = repack ? ggml_init(wp) : NULL;
    ggml_backend_t backend = NULL;
    if (repack) {
        backend = ggml_backend_cpu_init();
        ggml_backend_cpu_set_n_threads(backend, threads);
    }

    float * tmp = malloc(sizeof(float) * (size_t) k * n);
    srand(1);
    for (size_t i = 0; i < (size_t) k * n; i++) {
        tmp[i] = ((float) rand() / (float) RAND_MAX - 0.5f) * 0.1f;
    }
    struct ggml_tensor * w[64];
    for (int c = 0; c < copies; c++) {
        w[c] = ggml_new_tensor_2d(repack ? wctx : ctx, type, k, n);
    }
    if (repack) {
        ggml_backend_reg_t reg = ggml_backend_cpu_reg();
        ggml_backend_dev_get_extra_bufts_t get_extra =
            (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
        ggml_backend_buffer_type_t * extra = get_extra ? get_extra(ggml_backend_reg_dev_get(reg, 0)) : NULL;
        if (!extra || !extra[0] || !ggml_backend_alloc_ctx_tensors_from_buft(wctx, extra[0])) {
            fprintf(stderr, "no extra buffer type to repack into\n");
            return 1;
        }
        fprintf(stderr, "weights in %s\n", ggml_backend_buft_name(extra[0]));
    }
    void * qbuf = malloc(ggml_row_size(type, k) * n);
    for (int c = 0; c < copies; c++) {
        ggml_quantize_chunk(type, tmp, repack ? qbuf : w[c]->data, 0, n, k, NULL);
        if (repack) {
            ggml_backend_tensor_set(w[c], qbuf, 0, ggml_nbytes(w[c]));
        }
    }
    free(qbuf);
    free(tmp);
    struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, m);
    for (size_t i = 0; i < (size_t) k * m; i++) {
        ((float *) x->data)[i] = (float) rand() / (float) RAND_MAX - 0.5f;
    }
    struct ggml_cgraph * graph = ggml_new_graph(ctx);
    struct ggml_tensor * y = ggml_mul_mat(ctx, w[0], x);
    ggml_build_forward_expand(graph, y);
    for (int c = 1; c < copies; c++) {
        ggml_build_forward_expand(graph, ggml_mul_mat(ctx, w[c], x));
    }
    struct ggml_cplan plan = ggml_graph_plan(graph, threads, NULL);
    plan.work_data = malloc(plan.work_size + 64);
    if (repack) {
        ggml_backend_graph_compute(backend, graph);  // warm-up
    } else {
        ggml_graph_compute(graph, &plan);  // warm-up
    }

    double * times = malloc(sizeof(double) * iters);
    for (int i = 0; i < iters; i++) {
        const double t0 = now_ms();
        if (repack) {
            ggml_backend_graph_compute(backend, graph);
        } else {
            ggml_graph_compute(graph, &plan);
        }
        times[i] = now_ms() - t0;
    }
    qsort(times, iters, sizeof(double), cmp_double);
    double checksum = 0.0;
    for (size_t i = 0; i < (size_t) n * m; i++) {
        checksum += ((const float *) y->data)[i] * (double) (1 + i % 7);
    }
    printf("%s%s K=%d N=%d M=%d copies=%d threads=%d exact=%d min %.3f median %.3f ms checksum %.9g\n",
           ggml_type_name(type), repack ? " repacked" : "", k, n, m, copies, threads, ggml_cpu_exact_rows(), times[0], times[iters / 2], checksum);
    free(times);
    free(plan.work_data);
    if (repack) {
        ggml_backend_free(backend);
        ggml_free(wctx);
    }
    ggml_free(ctx);
    return 0;
}
