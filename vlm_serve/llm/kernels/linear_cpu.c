/* y = x @ w^T (+ bias) on CPU, x and y float32, with w packed once into column panels (tiles.h) in its
 * own format: float32, bfloat16, float16 or FP8 e4m3 with block scales, widened in registers.
 *
 * A task is one panel (`width` output columns) for a block of up to ROWS rows. At decode batch sizes
 * there is one row block and the product is bound by reading the weights: the tasks, one per panel,
 * keep every thread streaming its own panels, at close to the machine's memory bandwidth where oneDNN's
 * GEMM, made for large products, reads at half of it. At prefill sizes both reach the same FLOP rate.
 * Threads take the tasks in guided chunks: runs of adjacent panels, one long stream of weights each,
 * shrinking towards the end so that a thread slowed by other load is still helped. (Measured on an AMD
 * EPYC, AVX2, 2 threads, the medium dense model's 64 linears at 1 row, formats alternating: FP8 16.0 ms
 * against 19.5 one panel at a time, float32 and bfloat16 alike; at 16 rows within 4% either way.)
 */
#define TILE_FUNCTIONS
#include "rounded.h"

#define ROWS 64 /* rows per task: a task's rows of x stay in cache while its panel streams */

/* The product's tasks, shared out over the threads of the parallel region it is called in (every thread
 * calls it; they meet at its end). x: (M, K) rows `x_stride` floats apart; w: (N, K) in N / width panels
 * in `format` (W_*); bias: (N) or NULL; y: (M, N). */
static void linear_rounded_tasks(const float *x, int64_t M, int64_t K, int64_t x_stride, Weights weights, int format,
                                 int64_t N, int width, const float *bias, float *y);

static void linear_tasks(const float *x, int64_t M, int64_t K, int64_t x_stride, Weights weights, int format,
                         int64_t N, int width, const float *bias, float *y) {
    if (rounded(format)) {
        linear_rounded_tasks(x, M, K, x_stride, weights, format, N, width, bias, y);
        return;
    }
    const int64_t panels = N / width, blocks = (M + ROWS - 1) / ROWS;
#pragma omp for schedule(guided)
    for (int64_t t = 0; t < panels * blocks; t++) {
        const int64_t p = t % panels, r0 = t / panels * ROWS, rows = M - r0 < ROWS ? M - r0 : ROWS;
        const float *a[ROWS];
        float *c[ROWS];
        for (int64_t r = 0; r < rows; r++) a[r] = x + (r0 + r) * x_stride, c[r] = y + (r0 + r) * N + p * width;
        /* (the format's switch inside the parallel loop, so that each format's copy is compiled for it) */
        WITH_FORMAT(format, matmul_rows_as(FORMAT, a, rows, nth_matrix(FORMAT, weights, K, width, width, p), K, width,
                                           width, c));
        if (bias != NULL)
            for (int64_t r = 0; r < rows; r++)
                for (int j = 0; j < width; j++) c[r][j] += bias[p * width + j];
    }
}

/* linear_tasks for rounded(format) panels (rounded.h): x's rows rounded once, shared out over the threads
 * first, then the panels' tasks */
static void linear_rounded_tasks(const float *x, int64_t M, int64_t K, int64_t x_stride, Weights weights, int format,
                                 int64_t N, int width, const float *bias, float *y) {
    const Rounding size = rounding(format, weights, K);
    const int64_t panels = N / width, blocks = (M + ROWS - 1) / ROWS;
    char *values;
    float *figures;
#pragma omp single copyprivate(values, figures)
    values = malloc(M * size.bytes), figures = malloc(M * size.floats * sizeof(float));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < M; r++)
        round_row(format, x + r * x_stride, weights, K, values + r * size.bytes, figures + r * size.floats);
#pragma omp for schedule(guided)
    for (int64_t t = 0; t < panels * blocks; t++) {
        const int64_t p = t % panels, r0 = t / panels * ROWS, rows = M - r0 < ROWS ? M - r0 : ROWS;
        const Weights panel = nth_matrix(format, weights, K, width, width, p);
        for (int64_t i = 0; i < rows; i += ROUNDED_ROWS) {
            const int nr = rows - i < ROUNDED_ROWS ? rows - i : ROUNDED_ROWS;
            const void *v[MR];
            const float *f[MR];
            float *c[MR];
            for (int r = 0; r < nr; r++) {
                const int64_t row = r0 + i + r;
                v[r] = values + row * size.bytes, f[r] = figures + row * size.floats, c[r] = y + row * N + p * width;
            }
            /* (each format's copy compiled for it) */
            if (format == W_I8)
                panels_rounded(W_I8, v, f, nr, panel, K, width, width, c);
            else
                panels_rounded(W_U4, v, f, nr, panel, K, width, width, c);
            if (bias != NULL)
                for (int r = 0; r < nr; r++)
                    for (int j = 0; j < width; j++) c[r][j] += bias[p * width + j];
        }
    }
#pragma omp single
    free(values), free(figures);
}

/* linear_tasks on `threads` threads; w packed as tiles.h's Weights (WEIGHT_ARGS) in `format` */
void linear_forward(const float *x, int64_t M, int64_t K, int64_t x_stride, int format, WEIGHT_ARGS(w), int64_t N,
                    int width, const float *bias, float *y, int threads) {
#pragma omp parallel num_threads(threads)
    linear_tasks(x, M, K, x_stride, WEIGHTS_OF(w), format, N, width, bias, y);
}
