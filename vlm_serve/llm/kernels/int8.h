/* W8A8 (tiles.h's W_I8): int8 weights, symmetric per output channel (compressed-tensors' int-quantized), times
 * each row of x rounded to int8 as it comes (dynamic, symmetric: scale amax / 127, what compressed-tensors'
 * `token` strategy computes), summed exactly in int32 and scaled once: y = (sum x_q w_q) * s_x * s_w.
 *
 * A panel's lanes hold 4 rows of k of a column as signed bytes; per panel, its columns' weight scales and
 * then their sums of weights (as int32, for the unsigned dot products below). The products of 4 rows at a
 * time, by ISA (each the instruction its CPU has for it; the C vector extensions have no such operation):
 * - AVX-512-VNNI, AVX-VNNI: vpdpbusd, unsigned by signed bytes into int32: x + 128 by w, less 128 times the
 *   column's sum of w at the end;
 * - AVX2: vpmaddubsw of |x| by w with x's sign (no pair reaches int16's bounds: |x|, |w| <= 127), then
 *   vpmaddwd by ones into int32;
 * - Arm with the dot product extension: sdot, signed by signed;
 * - elsewhere (SSE, NEON without it) each row's bytes widened to int32 and multiplied.
 */
#ifndef VLM_SERVE_INT8_H
#define VLM_SERVE_INT8_H

#include <math.h>
#include <stdlib.h>

#include "tiles.h"

/* A row's 4 bytes of x, made ready once for all the vectors of weights they multiply (`spread`), and
 * acc + their products with each column's 4 weights (`dot4`). */
#if defined(__AVX512VNNI__) && LANES == 16
#include <immintrin.h>
#define I8_DOT "AVX-512-VNNI"
#define I8_UNSIGNED 1
typedef struct { ivec x; } spread_t;
static inline spread_t spread(int32_t x) { return (spread_t){(ivec)_mm512_set1_epi32(x)}; }
static inline ivec dot4(ivec acc, spread_t x, ivec w) {
    return (ivec)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)x.x, (__m512i)w);
}
#elif defined(__AVXVNNI__) && LANES == 8
#include <immintrin.h>
#define I8_DOT "AVX-VNNI"
#define I8_UNSIGNED 1
typedef struct { ivec x; } spread_t;
static inline spread_t spread(int32_t x) { return (spread_t){(ivec)_mm256_set1_epi32(x)}; }
static inline ivec dot4(ivec acc, spread_t x, ivec w) {
    return (ivec)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)x.x, (__m256i)w);
}
#elif defined(__AVX2__) && LANES == 8
#include <immintrin.h>
#define I8_DOT "AVX2"
#define I8_UNSIGNED 0
typedef struct { ivec x, abs; } spread_t; /* (x's sign goes onto the weights, |x| is the unsigned operand) */
static inline spread_t spread(int32_t x) {
    const __m256i xb = _mm256_set1_epi32(x);
    return (spread_t){(ivec)xb, (ivec)_mm256_abs_epi8(xb)};
}
static inline ivec dot4(ivec acc, spread_t x, ivec w) {
    const __m256i pairs = _mm256_maddubs_epi16((__m256i)x.abs, _mm256_sign_epi8((__m256i)w, (__m256i)x.x));
    return acc + (ivec)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
#elif defined(__ARM_FEATURE_DOTPROD) && LANES == 4
#include <arm_neon.h>
#define I8_DOT "NEON dot product"
#define I8_UNSIGNED 0
typedef struct { int8x16_t x; } spread_t;
static inline spread_t spread(int32_t x) { return (spread_t){vreinterpretq_s8_s32(vdupq_n_s32(x))}; }
static inline ivec dot4(ivec acc, spread_t x, ivec w) { return (ivec)vdotq_s32((int32x4_t)acc, (int8x16_t)w, x.x); }
#else
#define I8_DOT "portable"
#define I8_UNSIGNED 0
typedef struct { int32_t x[4]; } spread_t;
static inline spread_t spread(int32_t x) {
    return (spread_t){{(int8_t)x, (int8_t)(x >> 8), (int8_t)(x >> 16), (int8_t)(x >> 24)}};
}
static inline ivec dot4(ivec acc, spread_t x, ivec w) {
    for (int j = 0; j < 4; j++) acc += ((w << (24 - 8 * j)) >> 24) * x.x[j];
    return acc;
}
#endif

BASELINE const char *kernel_int8_dot(void) { return I8_DOT; }

/* x[0 : k] rounded to int8 with its own scale, returned: q = round(x / s) (to nearest even), s = amax / 127
 * (the smallest float where x is all zeros); q is padded with zeros to whole groups of 4 and, where the
 * products take unsigned bytes, offset by 128. */
static inline float quantize_row(const float *x, int64_t k, int8_t *q) {
    vec m = splat(0.0f);
    int64_t i = 0;
    for (; i + LANES <= k; i += LANES) m = vmax(m, vmax(load(x + i), -load(x + i)));
    float amax = hmax(m);
    for (; i < k; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float s = amax > 0 ? amax / 127.0f : 0x1p-126f;
    const vec round = splat(12582912.0f), scale = splat(s); /* (1.5 * 2^23 added and taken away: to nearest even) */
    for (i = 0; i + LANES <= k; i += LANES) {
        const ivec v = __builtin_convertvector((load(x + i) / scale + round) - round, ivec) ^ (I8_UNSIGNED ? 0x80 : 0);
        for (int j = 0; j < LANES; j++) q[i + j] = (int8_t)v[j];
    }
    for (; i < k; i++) q[i] = (int8_t)((int)rintf(x[i] / s) ^ (I8_UNSIGNED ? 0x80 : 0));
    for (; i % 4; i++) q[i] = (int8_t)(I8_UNSIGNED ? 0x80 : 0);
    return s;
}

/* c[r][0 : nv * LANES] = (xq[r] @ panel) * sx[r] * the columns' scales, for r < nr: the panel's k rows in
 * groups of 4 (whole, zero-padded), its `scale` floats: nv * LANES weight scales, then as many int32 sums
 * of weights */
static inline __attribute__((always_inline)) void
tile_i8(const int8_t *const *xq, const float *sx, int nr, const char *w, const float *scale, int64_t k, int nv,
        float *const *c) {
    const int64_t groups = (k + 3) / 4, row = nv * LANES * 4;
    ivec acc[MR][NVI] = {{{0}}};
    for (int64_t g = 0; g < groups; g++) {
        spread_t x[MR];
        for (int r = 0; r < nr; r++) {
            int32_t bytes;
            memcpy(&bytes, xq[r] + 4 * g, 4);
            x[r] = spread(bytes);
        }
        for (int v = 0; v < nv; v++) {
            ivec b;
            memcpy(&b, w + g * row + v * LANES * 4, sizeof b);
            for (int r = 0; r < nr; r++) acc[r][v] = dot4(acc[r][v], x[r], b);
        }
    }
    for (int v = 0; v < nv; v++) {
        const vec ws = load(scale + v * LANES);
        ivec sums;
        memcpy(&sums, scale + (nv + v) * LANES, sizeof sums);
        for (int r = 0; r < nr; r++) {
            const ivec exact = I8_UNSIGNED ? acc[r][v] - 128 * sums : acc[r][v];
            store(c[r] + v * LANES, __builtin_convertvector(exact, vec) * (ws * splat(sx[r])));
        }
    }
}

#endif
