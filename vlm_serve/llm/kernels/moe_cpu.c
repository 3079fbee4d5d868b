/* A mixture-of-experts layer's experts on CPU, x and y float32, in one call: the routed tokens' rows through
 * their experts, weighted, and summed per token.
 *
 * Pairs (token t, its k-th expert) are numbered t * K + k; `order` lists them grouped by expert, so
 * positions starts[e] .. starts[e + 1] of `order` are expert e's (pairs of experts this rank does not
 * hold come after starts[E] and are left out). For a pair of token t with expert e and weight w:
 *     gate_up = x[t] @ w13[e]                    (H) @ (H, 2I): gate columns first, then up
 *     y       = w * (silu(gate) * up) @ w2[e]    (I) @ (I, H)
 * and out[t] is the sum of its pairs' y.
 *
 * The weights are packed once into column panels (tiles.h), in their own format (float32, bfloat16,
 * float16 or FP8 e4m3 with block scales). At decode batch sizes most experts have a
 * row or two and the layer is bound by reading the weights; tasks of one expert each are shared out over
 * the threads, so all threads stream weights at once.
 */
#include <math.h>
#include <omp.h>

#define TILE_FUNCTIONS
#include "rounded.h"

#define CHUNK 32    /* rows per task: an expert's weights stay in cache across a task's tiles */

/* The router's choices, from its logits (T, E_all), rows `stride` floats apart: each token's top K experts,
 * by logit, in expert[t * K ...], weighted by their softmax probabilities (renormalized over the K where
 * `renormalize`). Shared out over the threads of the parallel region it is called in. */
static void route_rows(const float *logits, int64_t stride, int64_t T, int64_t E_all, int64_t K, int renormalize,
                       float *weights, int64_t *expert) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * stride;
        int64_t *top = expert + t * K, n = 0; /* the largest so far, in descending order (ties: lower index first) */
        for (int64_t e = 0; e < E_all; e++) {
            if (n == K && l[e] <= l[top[K - 1]]) continue;
            int64_t j = n < K ? n++ : K - 1;
            for (; j > 0 && l[e] > l[top[j - 1]]; j--) top[j] = top[j - 1];
            top[j] = e;
        }
        const float max = l[top[0]];
        float all = 0, chosen = 0;
        for (int64_t e = 0; e < E_all; e++) all += expf(l[e] - max);
        for (int64_t k = 0; k < K; k++) chosen += weights[t * K + k] = expf(l[top[k]] - max);
        for (int64_t k = 0; k < K; k++) weights[t * K + k] /= renormalize ? chosen : all;
    }
}

/* The pairs of this rank's experts expert_start ... + E grouped by expert in pair order (order, starts: as
 * moe_forward takes them), the other pairs after them; starts: E + 2 entries. */
static void group_pairs(const int64_t *expert, int64_t pairs, int64_t expert_start, int64_t E, int64_t *order,
                        int64_t *starts) {
    for (int64_t e = 0; e <= E + 1; e++) starts[e] = 0;
    for (int64_t p = 0; p < pairs; p++) { /* counts, shifted by one: local expert e counts at e + 1 */
        const int64_t e = expert[p] - expert_start;
        starts[(e >= 0 && e < E ? e : E) + 1]++;
    }
    for (int64_t e = 0; e < E; e++) starts[e + 1] += starts[e];
    int64_t next[E + 1];
    for (int64_t e = 0; e <= E; e++) next[e] = starts[e];
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t e = expert[p] - expert_start;
        order[next[e >= 0 && e < E ? e : E]++] = p;
    }
}

/* route_rows, then group_pairs; expert: scratch for T * K */
void moe_route_f32(const float *logits, int64_t T, int64_t E_all, int64_t K, int renormalize, int64_t expert_start,
                   int64_t E, float *weights, int64_t *order, int64_t *starts, int64_t *expert, int threads) {
#pragma omp parallel num_threads(threads) if (T >= 64)
    route_rows(logits, E_all, T, E_all, K, renormalize, weights, expert);
    group_pairs(expert, T * K, expert_start, E, order, starts);
}

/* y[r] = weight * (silu(gate) * up)(x[r] @ w13) @ w2 for each pair of a task (up to CHUNK pairs of one
 * expert); gate_up: scratch for CHUNK * 2I floats */
static inline __attribute__((always_inline)) void
moe_forward_as(int format, const float *x, int64_t K, const int64_t *order, const int64_t *starts, int64_t ntasks,
               const int64_t *task_expert, const int64_t *task_row, const float *weights, Weights w13, int width13,
               Weights w2, int width2, int64_t H, int64_t I, float *ys, float *gate_up) {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < ntasks; i++) {
        const int64_t e = task_expert[i], r0 = task_row[i];
        const int64_t rows = starts[e + 1] - r0 < CHUNK ? starts[e + 1] - r0 : CHUNK;
        const Weights e13 = nth_matrix(format, w13, H, 2 * I, width13, e), e2 = nth_matrix(format, w2, I, H, width2, e);
        const float *xr[CHUNK];
        float *g[CHUNK], *yr[CHUNK];
        for (int64_t r = 0; r < rows; r++)
            xr[r] = x + order[r0 + r] / K * H, g[r] = gate_up + r * 2 * I, yr[r] = ys + (r0 + r) * H;
        if (rounded(format))
            matmul_rows_rounded(format, xr, rows, e13, H, 2 * I, width13, g);
        else
            matmul_rows_as(format, xr, rows, e13, H, 2 * I, width13, g);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < I; i++) g[r][i] = g[r][i] / (1.0f + expf(-g[r][i])) * g[r][I + i];
        if (rounded(format))
            matmul_rows_rounded(format, (const float *const *)g, rows, e2, I, H, width2, yr);
        else
            matmul_rows_as(format, (const float *const *)g, rows, e2, I, H, width2, yr);
        for (int64_t r = 0; r < rows; r++) {
            const float w = weights[order[r0 + r]];
            for (int64_t h = 0; h < H; h++) yr[r][h] *= w;
        }
    }
}

/* The tasks of the grouped pairs: up to CHUNK pairs of one expert each, task i's expert and first pair
 * in task_expert[i] and task_row[i] (T * K + E of each are room enough); pos[p]: where pair p's row
 * of ys is (-1: another rank's expert). Returns how many tasks. */
static int64_t plan_experts(const int64_t *order, const int64_t *starts, int64_t E, int64_t pairs,
                            int64_t *task_expert, int64_t *task_row, int64_t *pos) {
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++)
        for (int64_t r = starts[e]; r < starts[e + 1]; r += CHUNK) task_expert[n] = e, task_row[n++] = r;
    for (int64_t r = 0; r < pairs; r++) pos[order[r]] = r < starts[E] ? r : -1;
    return n;
}

/* The planned tasks, then each token's sum over its pairs into out: shared out over the threads of the
 * parallel region it is called in, each with its CHUNK * 2I floats of gate_up. */
static void experts_and_sum(int format, const float *x, int64_t T, int64_t K, const int64_t *order,
                            const int64_t *starts, int64_t ntasks, const int64_t *task_expert, const int64_t *task_row,
                            const float *weights, Weights w13, int width13, Weights w2, int width2, int64_t H,
                            int64_t I, float *out, float *ys, const int64_t *pos, float *gate_up) {
    float *mine = gate_up + omp_get_thread_num() * CHUNK * 2 * I;
    WITH_FORMAT(format, moe_forward_as(FORMAT, x, K, order, starts, ntasks, task_expert, task_row, weights, w13,
                                       width13, w2, width2, H, I, ys, mine));
    /* (the implicit barrier above: every y is written) */
#pragma omp for schedule(static)
    for (int64_t tok = 0; tok < T; tok++) {
        float *o = out + tok * H;
        memset(o, 0, H * sizeof(float));
        for (int64_t k = 0; k < K; k++) {
            const int64_t r = pos[tok * K + k];
            if (r < 0) continue;
            for (int64_t h = 0; h < H; h++) o[h] += ys[r * H + h];
        }
    }
}

/* x, out: (T, H); order: (T * K) pair numbers; starts: (E + 1); weights: (T * K) by pair number;
 * w13: E (H, 2I) matrices, w2: E (I, H) ones, packed (tiles.h's Weights: WEIGHT_ARGS) in `format` (W_*); ys: scratch for (T * K, H) floats; pos: scratch for T * K int64s; gate_up: scratch
 * for threads * CHUNK * 2I floats. */
void moe_forward(const float *x, int64_t T, int64_t K, const int64_t *order, const int64_t *starts, int64_t E,
                 const float *weights, int format, WEIGHT_ARGS(w13), int width13, WEIGHT_ARGS(w2), int width2, int64_t H,
                 int64_t I, float *out, float *ys, int64_t *pos, float *gate_up, int threads) {
    const Weights p13 = WEIGHTS_OF(w13), p2 = WEIGHTS_OF(w2);
    int64_t ntasks = 0;
    for (int64_t e = 0; e < E; e++) ntasks += (starts[e + 1] - starts[e] + CHUNK - 1) / CHUNK;
    int64_t task_expert[ntasks + 1], task_row[ntasks + 1];
    plan_experts(order, starts, E, T * K, task_expert, task_row, pos);
#pragma omp parallel num_threads(threads)
    experts_and_sum(format, x, T, K, order, starts, ntasks, task_expert, task_row, weights, p13, width13, p2, width2,
                    H, I, out, ys, pos, gate_up);
}
