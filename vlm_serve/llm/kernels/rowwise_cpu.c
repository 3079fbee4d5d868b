/* The decoder layer's row-by-row ops, float32 on CPU, each over every row in one call (torch takes
 * several ops, and as many passes over the rows, for each). */
#include <math.h>

#include "tiles.h"

#define PARALLEL_FROM (1 << 15) /* floats: below this, one thread (waking the others costs more) */

/* RMSNorm as Qwen3 computes it, y = weight * x / sqrt(mean(x^2) + eps), of one row of n floats, then,
 * where cos is given, the rotary embedding of the row's token: y * cos + rotate_half(y) * sin */
static inline void norm_row(const float *x, int64_t n, const float *weight, float eps, const float *cos,
                            const float *sin, float *y) {
    float ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < n; j++) ss += x[j] * x[j];
    const float r = 1.0f / sqrtf(ss / n + eps);
    if (cos == NULL) {
        for (int64_t j = 0; j < n; j++) y[j] = weight[j] * (x[j] * r);
        return;
    }
    const int64_t half = n / 2;
    for (int64_t j = 0; j < half; j++) {
        const float a = weight[j] * (x[j] * r), b = weight[j + half] * (x[j + half] * r);
        y[j] = a * cos[j] - b * sin[j];
        y[j + half] = b * cos[j + half] + a * sin[j + half];
    }
}

/* Each op below is a loop over rows shared out over the threads of the parallel region it is called in
 * (`_rows`: every thread calls it, and they meet at its end), and an exported function running it on
 * `threads` threads, or on one below PARALLEL_FROM floats. */

/* norm_row of every row of x, with cos and sin (tokens, n) or NULL. Row i of x starts at
 * x + (i / per) * stride + (i % per) * n: `per` rows of n floats side by side in each token's row,
 * `stride` floats apart (a head-by-head view of q or k inside the qkv output); y is contiguous. */
static void rms_norm_rows(const float *x, int64_t rows, int64_t per, int64_t stride, int64_t n, const float *weight,
                          float eps, const float *cos, const float *sin, float *y) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows; i++)
        norm_row(x + (i / per) * stride + (i % per) * n, n, weight, eps, cos == NULL ? NULL : cos + (i / per) * n,
                 sin == NULL ? NULL : sin + (i / per) * n, y + i * n);
}

void rms_norm_f32(const float *x, int64_t rows, int64_t per, int64_t stride, int64_t n, const float *weight,
                  float eps, const float *cos, const float *sin, float *y, int threads) {
#pragma omp parallel num_threads(threads) if (rows * n >= PARALLEL_FROM)
    rms_norm_rows(x, rows, per, stride, n, weight, eps, cos, sin, y);
}

/* Qwen3's q and k heads, normed (each with its weight) and rotated, straight from the qkv output: token
 * t's row of qkv (`stride` floats apart) holds hq q heads then hk k heads of n floats; q (tokens, hq, n)
 * and k (tokens, hk, n) are contiguous. */
static void qk_norm_rope_rows(const float *qkv, int64_t tokens, int64_t stride, int64_t hq, int64_t hk, int64_t n,
                              const float *q_weight, const float *k_weight, float eps, const float *cos,
                              const float *sin, float *q, float *k) {
    const int64_t per = hq + hk;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < tokens * per; i++) {
        const int64_t t = i / per, h = i % per;
        norm_row(qkv + t * stride + h * n, n, h < hq ? q_weight : k_weight, eps, cos + t * n, sin + t * n,
                 h < hq ? q + (t * hq + h) * n : k + (t * hk + h - hq) * n);
    }
}

void qk_norm_rope_f32(const float *qkv, int64_t tokens, int64_t stride, int64_t hq, int64_t hk, int64_t n,
                      const float *q_weight, const float *k_weight, float eps, const float *cos, const float *sin,
                      float *q, float *k, int threads) {
#pragma omp parallel num_threads(threads) if (tokens * (hq + hk) * n >= PARALLEL_FROM)
    qk_norm_rope_rows(qkv, tokens, stride, hq, hk, n, q_weight, k_weight, eps, cos, sin, q, k);
}

/* sum = x + add (x where add is NULL), then y = norm_row(sum): the residual stream's add and the next
 * norm in one pass (as SGLang's fused_add_rmsnorm); x, add, sum and y are (rows, n), contiguous, and sum
 * may be x. */
static void add_rms_norm_rows(const float *x, const float *add, int64_t rows, int64_t n, const float *weight,
                              float eps, float *sum, float *y) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        float *si = sum + i * n;
        if (add != NULL)
            for (int64_t j = 0; j < n; j++) si[j] = x[i * n + j] + add[i * n + j];
        else if (si != x + i * n)
            memcpy(si, x + i * n, n * sizeof(float));
        norm_row(si, n, weight, eps, NULL, NULL, y + i * n);
    }
}

void add_rms_norm_f32(const float *x, const float *add, int64_t rows, int64_t n, const float *weight, float eps,
                      float *sum, float *y, int threads) {
#pragma omp parallel num_threads(threads) if (rows * n >= PARALLEL_FROM)
    add_rms_norm_rows(x, add, rows, n, weight, eps, sum, y);
}

/* y = silu(x[:, :n]) * x[:, n:] for x (rows, 2n), y (rows, n) */
static void silu_and_mul_rows(const float *x, int64_t rows, int64_t n, float *y) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const float *gate = x + i * 2 * n, *up = gate + n;
        float *yi = y + i * n;
        int64_t j = 0;
        for (; j + LANES <= n; j += LANES) {
            const vec g = load(gate + j);
            store(yi + j, g / (1.0f + vexp(-g)) * load(up + j));
        }
        for (; j < n; j++) yi[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
    }
}

void silu_and_mul_f32(const float *x, int64_t rows, int64_t n, float *y, int threads) {
#pragma omp parallel num_threads(threads) if (rows * n >= PARALLEL_FROM)
    silu_and_mul_rows(x, rows, n, y);
}

/* The vision tower's rotary embedding of heads stored side by side: token t's row of x (`stride` floats
 * apart) holds `heads` heads of n floats from its start; each is turned by its token's angles, cos and
 * sin (tokens, n / 2), dimension j with dimension j + n / 2, into y (tokens, heads, n), contiguous. */
static void rotate_halves_rows(const float *x, int64_t tokens, int64_t stride, int64_t heads, int64_t n,
                               const float *cos, const float *sin, float *y) {
    const int64_t half = n / 2;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < tokens * heads; i++) {
        const int64_t t = i / heads;
        const float *xi = x + t * stride + (i % heads) * n, *c = cos + t * half, *s = sin + t * half;
        float *yi = y + i * n;
        for (int64_t j = 0; j < half; j++) {
            yi[j] = xi[j] * c[j] - xi[j + half] * s[j];
            yi[j + half] = xi[j + half] * c[j] + xi[j] * s[j];
        }
    }
}

void rotate_halves_f32(const float *x, int64_t tokens, int64_t stride, int64_t heads, int64_t n, const float *cos,
                       const float *sin, float *y, int threads) {
#pragma omp parallel num_threads(threads) if (tokens * heads * n >= PARALLEL_FROM)
    rotate_halves_rows(x, tokens, stride, heads, n, cos, sin, y);
}
