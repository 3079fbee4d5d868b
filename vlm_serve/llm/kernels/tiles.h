/* What the CPU kernels share: a vector of LANES floats and register-tiled products of a few rows by a
 * column panel.
 *
 * A panel is `width` (16 or 64) consecutive columns of every row of a (k, n) matrix, contiguous: (k, width).
 * A tile of up to MR rows by `width` columns streams its panel once while its accumulators stay in
 * registers (MR x 4 vectors).
 */
#ifndef VLM_SERVE_TILES_H
#define VLM_SERVE_TILES_H

#include <stdint.h>
#include <string.h>

#define LANES 16 /* floats per vector: one AVX-512 register (two AVX2 ones, elsewhere) */
#define MR 4     /* rows per tile */

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

static inline vec splat(float s) { return (vec){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

/* c[r][0 : nv * LANES] = a[r][0 : k] @ panel (k, nv * LANES) for r < nr */
static inline __attribute__((always_inline)) void
tile(const float *const *a, int nr, const float *panel, int64_t k, int nv, float *const *c) {
    vec acc[MR][4] = {{{0}}};
    for (int64_t p = 0; p < k; p++) {
        vec b[4];
        for (int v = 0; v < nv; v++) {
            b[v] = load(panel + p * nv * LANES + v * LANES);
            __asm__("" : "+v"(b[v])); /* held in a register: each load feeds nr multiply-adds */
        }
        for (int r = 0; r < nr; r++) {
            const vec ar = splat(a[r][p]);
            for (int v = 0; v < nv; v++) acc[r][v] += ar * b[v];
        }
    }
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) store(c[r] + v * LANES, acc[r][v]);
}

/* c[r][0 : n] = a[r][0 : k] @ the packed (k, n) matrix w (panels `width` columns wide), r < nr <= MR */
static inline __attribute__((always_inline)) void
matmul(const float *const *a, int nr, const float *w, int64_t k, int64_t n, int width, float *const *c) {
    for (int64_t j = 0; j < n; j += width) {
        float *cj[MR];
        for (int r = 0; r < nr; r++) cj[r] = c[r] + j;
        if (width == 4 * LANES)
            tile(a, nr, w + j * k, k, 4, cj);
        else
            tile(a, nr, w + j * k, k, 1, cj);
    }
}

/* matmul over any number of rows, MR at a time, each tile height its own copy (accumulators in registers) */
static inline __attribute__((always_inline)) void
matmul_rows(const float *const *a, int64_t rows, const float *w, int64_t k, int64_t n, int width, float *const *c) {
    for (int64_t r0 = 0; r0 < rows; r0 += MR) {
        switch (rows - r0 < MR ? rows - r0 : MR) {
            case 1: matmul(a + r0, 1, w, k, n, width, c + r0); break;
            case 2: matmul(a + r0, 2, w, k, n, width, c + r0); break;
            case 3: matmul(a + r0, 3, w, k, n, width, c + r0); break;
            default: matmul(a + r0, MR, w, k, n, width, c + r0); break;
        }
    }
}

typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));

/* where mask (a comparison's result) holds, a; elsewhere b */
static inline vec vselect(ivec mask, vec a, vec b) {
    ivec ia, ib;
    memcpy(&ia, &a, sizeof a);
    memcpy(&ib, &b, sizeof b);
    ia = (ia & mask) | (ib & ~mask);
    memcpy(&a, &ia, sizeof a);
    return a;
}

/* e^x for a vector, to about 2 ulp; 0 at or below -87 (float e^x underflows there), masked scores too */
static inline vec vexp(vec x) {
    const vec lo = splat(-87.0f), round = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const ivec under = x <= lo;
    x = vselect(under, lo, x);
    const vec n = (x * 1.44269504088896341f + round) - round;
    vec r = x - n * 0.693359375f; /* x - n ln 2, with ln 2 in two parts so that the reduction is exact */
    r = r + n * 2.12194440e-4f;
    vec p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23; /* 2^n */
    vec scale;
    memcpy(&scale, &bits, sizeof scale);
    return vselect(under, splat(0.0f), p * scale);
}

#endif
