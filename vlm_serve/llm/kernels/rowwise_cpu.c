/* The decoder layer's row-by-row ops, float32 on CPU, each over every row in one call (torch takes
 * several ops, and as many passes over the rows, for each). */
#include <math.h>

#include "tiles.h"

#define PARALLEL_FROM (1 << 15) /* floats: below this, one thread (waking the others costs more) */

/* RMSNorm as Qwen3 computes it, y = weight * x / sqrt(mean(x^2) + eps), then, where cos is given, the
 * rotary embedding of the row's token: y * cos + rotate_half(y) * sin, with cos and sin (tokens, n).
 * Row i of x starts at x + (i / per) * stride + (i % per) * n: `per` rows of n floats side by side in each
 * token's row, `stride` floats apart (a head-by-head view of q or k inside the qkv output); y is
 * contiguous. */
void rms_norm_f32(const float *x, int64_t rows, int64_t per, int64_t stride, int64_t n, const float *weight,
                  float eps, const float *cos, const float *sin, float *y, int threads) {
    const int64_t half = n / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= PARALLEL_FROM)
    for (int64_t i = 0; i < rows; i++) {
        const float *xi = x + (i / per) * stride + (i % per) * n;
        float *yi = y + i * n;
        float ss = 0;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < n; j++) ss += xi[j] * xi[j];
        const float r = 1.0f / sqrtf(ss / n + eps);
        if (cos == NULL) {
            for (int64_t j = 0; j < n; j++) yi[j] = weight[j] * (xi[j] * r);
            continue;
        }
        const float *c = cos + (i / per) * n, *s = sin + (i / per) * n;
        for (int64_t j = 0; j < half; j++) {
            const float a = weight[j] * (xi[j] * r), b = weight[j + half] * (xi[j + half] * r);
            yi[j] = a * c[j] - b * s[j];
            yi[j + half] = b * c[j + half] + a * s[j + half];
        }
    }
}

/* y = silu(x[:, :n]) * x[:, n:] for x (rows, 2n), y (rows, n) */
void silu_and_mul_f32(const float *x, int64_t rows, int64_t n, float *y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= PARALLEL_FROM)
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
