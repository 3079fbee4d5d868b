/* A mixture-of-experts layer's experts on CPU, float32, in one call: the routed tokens' rows through
 * their experts, weighted, and summed per token.
 *
 * Pairs (token t, its k-th expert) are numbered t * K + k; `order` lists them grouped by expert, so
 * positions starts[e] .. starts[e + 1] of `order` are expert e's (pairs of experts this rank does not
 * hold come after starts[E] and are left out). For a pair of token t with expert e and weight w:
 *     gate_up = x[t] @ w13[e]                    (H) @ (H, 2I): gate columns first, then up
 *     y       = w * (silu(gate) * up) @ w2[e]    (I) @ (I, H)
 * and out[t] is the sum of its pairs' y.
 *
 * The weights are packed once into column panels (tiles.h). At decode batch sizes most experts have a
 * row or two and the layer is bound by reading the weights; tasks of one expert each are shared out over
 * the threads, so all threads stream weights at once.
 */
#include <math.h>

#include "tiles.h"

#define CHUNK 32    /* rows per task: an expert's weights stay in cache across a task's tiles */

/* y[r] = (silu(gate) * up)(x[r] @ w13) @ w2 for r < nr; gate_up is scratch for MR * 2I floats */
static inline __attribute__((always_inline)) void
expert_tile(const float *const *x, int nr, const float *w13, int width13, const float *w2, int width2, int64_t H,
            int64_t I, float *gate_up, float *const *y) {
    float *g[MR];
    for (int r = 0; r < nr; r++) g[r] = gate_up + r * 2 * I;
    matmul(x, nr, w13, H, 2 * I, width13, g);
    for (int r = 0; r < nr; r++)
        for (int64_t i = 0; i < I; i++) g[r][i] = g[r][i] / (1.0f + expf(-g[r][i])) * g[r][I + i];
    matmul((const float *const *)g, nr, w2, I, H, width2, y);
}

/* The router's choices, from its logits (T, E_all): each token's top K experts, by logit, weighted by their
 * softmax probabilities (renormalized over the K where `renormalize`); then the pairs of this rank's
 * experts expert_start ... + E grouped by expert in pair order (order, starts: as moe_forward_f32 takes
 * them), the other pairs after them. starts: E + 2 entries; expert: scratch for T * K. */
void moe_route_f32(const float *logits, int64_t T, int64_t E_all, int64_t K, int renormalize, int64_t expert_start,
                   int64_t E, float *weights, int64_t *order, int64_t *starts, int64_t *expert, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T >= 64)
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E_all;
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
    for (int64_t e = 0; e <= E + 1; e++) starts[e] = 0;
    for (int64_t p = 0; p < T * K; p++) { /* counts, shifted by one: local expert e counts at e + 1 */
        const int64_t e = expert[p] - expert_start;
        starts[(e >= 0 && e < E ? e : E) + 1]++;
    }
    for (int64_t e = 0; e < E; e++) starts[e + 1] += starts[e];
    int64_t next[E + 1];
    for (int64_t e = 0; e <= E; e++) next[e] = starts[e];
    for (int64_t p = 0; p < T * K; p++) {
        const int64_t e = expert[p] - expert_start;
        order[next[e >= 0 && e < E ? e : E]++] = p;
    }
}

/* x, out: (T, H); order: (T * K) pair numbers; starts: (E + 1); weights: (T * K) by pair number;
 * w13: E packed (H, 2I) matrices; w2: E packed (I, H) ones; ys: scratch for (T * K, H) floats;
 * pos: scratch for T * K int64s. */
void moe_forward_f32(const float *x, int64_t T, int64_t K, const int64_t *order, const int64_t *starts, int64_t E,
                     const float *weights, const float *w13, int width13, const float *w2, int width2, int64_t H,
                     int64_t I, float *out, float *ys, int64_t *pos, int threads) {
    const int64_t pairs = starts[E];
    int64_t ntasks = 0;
    for (int64_t e = 0; e < E; e++) ntasks += (starts[e + 1] - starts[e] + CHUNK - 1) / CHUNK;
    int64_t task_expert[ntasks + 1], task_row[ntasks + 1];
    int64_t t = 0;
    for (int64_t e = 0; e < E; e++)
        for (int64_t r = starts[e]; r < starts[e + 1]; r += CHUNK) task_expert[t] = e, task_row[t++] = r;
    for (int64_t r = 0; r < T * K; r++) pos[order[r]] = r < pairs ? r : -1;

#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < ntasks; i++) {
            const int64_t e = task_expert[i], end = starts[e + 1] < task_row[i] + CHUNK ? starts[e + 1] : task_row[i] + CHUNK;
            const float *e13 = w13 + e * H * 2 * I, *e2 = w2 + e * I * H;
            float gate_up[MR * 2 * I];
            for (int64_t r0 = task_row[i]; r0 < end; r0 += MR) {
                const int nr = end - r0 < MR ? (int)(end - r0) : MR;
                const float *xr[MR];
                float *yr[MR];
                for (int r = 0; r < nr; r++) xr[r] = x + order[r0 + r] / K * H, yr[r] = ys + (r0 + r) * H;
                WITH_TILE_HEIGHT(nr, expert_tile(xr, NR, e13, width13, e2, width2, H, I, gate_up, yr));
                for (int r = 0; r < nr; r++) {
                    const float w = weights[order[r0 + r]];
                    for (int64_t h = 0; h < H; h++) yr[r][h] *= w;
                }
            }
        }
        /* each token's sum over its pairs (the implicit barrier above: every y is written) */
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
}
