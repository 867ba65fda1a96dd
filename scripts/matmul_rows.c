// Whether ggml's CPU matrix products are batch-invariant, type by type, without a model: for W of N rows
// of K elements (random, quantized to TYPE) and a batch x of M rows, every row of W x computed in one
// product must be bit-identical to the same row of x multiplied alone (M = 1). The weights and batch rows
// are fixed at random; each M from the list is its own graph. Prints one line per M: the rows that differ.
// Exit status 1 if any row differs, 0 if none.
//
// Build as scripts/matmul_time.c is built (tests/test_kernel_rows.py compiles and runs it):
//   cc -O2 -o build/matmul_rows scripts/matmul_rows.c -I$SRC/ggml/include -L$LIB -lggml-base -lggml-cpu -lggml -Wl,-rpath,$LIB
// Run: build/matmul_rows TYPE K N THREADS M1 [M2 ...]    (TYPE: ggml's type number, 12 Q4_K, 13 Q5_K, 14 Q6_K)
// With GGML_CPU_EXACT_ROWS=0 (llama.cpp's stock kernel choice) rows of some batch sizes differ.
// MATMUL_ROWS_REPEAT=R computes each batch R times (default 1), each compared with the rows alone: where the
// patch times two kernels for a batch size and keeps the faster (the K-quants' 8 to 63 rows), the first
// runs alternate between them, so both are checked.
#include "ggml.h"
#include "ggml-cpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// y = W x for the first m rows of x (one graph, one product), into out (m rows of n floats)
static void product(struct ggml_tensor * w, const float * x, int k, int m, int threads, float * out) {
    const int n = (int) w->ne[1];
    const size_t mem = (size_t) k * m * 4 + (size_t) n * m * 4 + ggml_graph_overhead() + (4u << 20);
    struct ggml_init_params ip = { mem, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * xt = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, m);
    memcpy(xt->data, x, (size_t) k * m * 4);
    struct ggml_tensor * y = ggml_mul_mat(ctx, w, xt);
    struct ggml_cgraph * graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, y);
    struct ggml_cplan plan = ggml_graph_plan(graph, threads, NULL);
    plan.work_data = malloc(plan.work_size + 64);
    ggml_graph_compute(graph, &plan);
    memcpy(out, y->data, (size_t) n * m * 4);
    free(plan.work_data);
    ggml_free(ctx);
}

int main(int argc, char ** argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s TYPE K N THREADS M1 [M2 ...]\n", argv[0]);
        return 2;
    }
    const enum ggml_type type = (enum ggml_type) atoi(argv[1]);
    const int k = atoi(argv[2]), n = atoi(argv[3]), threads = atoi(argv[4]);
    int mmax = 1;
    for (int a = 5; a < argc; a++) {
        const int m = atoi(argv[a]);
        if (m <= 0) {
            fprintf(stderr, "bad batch size %s\n", argv[a]);
            return 2;
        }
        mmax = m > mmax ? m : mmax;
    }
    if (k <= 0 || n <= 0 || threads <= 0 || type >= GGML_TYPE_COUNT || k % ggml_blck_size(type) != 0) {
        fprintf(stderr, "bad arguments (K must be a multiple of the type's block)\n");
        return 2;
    }
    struct ggml_init_params wp = { ggml_row_size(type, k) * n + (1u << 20), NULL, false };
    struct ggml_context * wctx = ggml_init(wp);
    struct ggml_tensor * w = ggml_new_tensor_2d(wctx, type, k, n);
    float * tmp = malloc(sizeof(float) * (size_t) k * n);
    srand(7);
    for (size_t i = 0; i < (size_t) k * n; i++) {
        tmp[i] = ((float) rand() / (float) RAND_MAX - 0.5f) * 0.1f;
    }
    ggml_quantize_chunk(type, tmp, w->data, 0, n, k, NULL);
    free(tmp);
    float * x = malloc(sizeof(float) * (size_t) k * mmax);
    for (size_t i = 0; i < (size_t) k * mmax; i++) {
        x[i] = (float) rand() / (float) RAND_MAX - 0.5f;
    }
    // each row of x alone: the reference
    float * ref = malloc(sizeof(float) * (size_t) n * mmax);
    for (int r = 0; r < mmax; r++) {
        product(w, x + (size_t) r * k, k, 1, threads, ref + (size_t) r * n);
    }
    float * got = malloc(sizeof(float) * (size_t) n * mmax);
    const char * rep = getenv("MATMUL_ROWS_REPEAT");
    const int repeats = rep != NULL && atoi(rep) > 0 ? atoi(rep) : 1;
    int bad = 0;
    for (int a = 5; a < argc; a++) {
        const int m = atoi(argv[a]);
        int rows = 0;  // rows that differ in any of the repeats
        for (int i = 0; i < repeats; i++) {
            product(w, x, k, m, threads, got);
            int differ = 0;
            for (int r = 0; r < m; r++) {
                differ += memcmp(got + (size_t) r * n, ref + (size_t) r * n, (size_t) n * 4) != 0;
            }
            rows = differ > rows ? differ : rows;
        }
        printf("%s K=%d N=%d threads=%d exact=%d M=%d: %d of %d rows differ\n", ggml_type_name(type), k, n, threads,
               ggml_cpu_exact_rows(), m, rows, m);
        bad += rows;
    }
    free(got);
    free(ref);
    free(x);
    ggml_free(wctx);
    return bad ? 1 : 0;
}
