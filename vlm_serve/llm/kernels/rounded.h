/* Products whose rows of x are rounded once, before any panel is read: W8A8's int8 weights (int8.h) take each
 * row rounded to int8 with its own scale, and, where the build has AVX-512-BF16's dot products (BF16_DOT),
 * 4-bit codes take each row's pairs of x rounded to bfloat16 with their sum over each block of k. Rounding a
 * row once per product rather than once per panel and tile is what keeps a decode step (one row, every
 * panel) reading weights: for groups of 32 4-bit codes the rounding and block sums cost about as much as
 * the products when redone for each panel.
 *
 * A rounded row is `bytes` of values (int8 codes, or bfloat16 pairs as uint32) and `floats` of figures (its
 * int8 scale, or one sum per block), as `rounding` sizes them and `round_row` makes them.
 */
#ifndef VLM_SERVE_ROUNDED_H
#define VLM_SERVE_ROUNDED_H

#include "int8.h"

static inline int rounded(int format) { return format == W_I8 || (BF16_DOT && format == W_U4); }

#define ROUNDED_ROWS (REGISTERS < 32 ? 2 : MR) /* rows per tile: NVI vectors of sums a row, in registers */

typedef struct {
    int64_t bytes, floats; /* of a rounded row's values and figures */
} Rounding;

static inline Rounding rounding(int format, Weights w, int64_t k) {
    if (format == W_I8) return (Rounding){(k + 3) / 4 * 4, 1};
    return (Rounding){((k + 7) / 8 * 4 + 15) / 16 * 16 * 4, blocks_of(w, k)}; /* (whole vectors of pairs) */
}

#if BF16_DOT
/* the n pairs' bfloat16 values at `pairs` summed in float32 (16 pairs at a time, then one by one): what a
 * block's dot products add up over x */
static inline float pair_sum(const uint32_t *pairs, int64_t n) {
    __m512 s = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512i both = _mm512_loadu_si512(pairs + i);
        s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(both, 16)));
        s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_and_si512(both, _mm512_set1_epi32((int)0xFFFF0000))));
    }
    float total = _mm512_reduce_add_ps(s);
    for (; i < n; i++) {
        const uint32_t lo = pairs[i] << 16, hi = pairs[i] & 0xFFFF0000u;
        float a, b;
        memcpy(&a, &lo, 4), memcpy(&b, &hi, 4);
        total += a + b;
    }
    return total;
}
#endif

/* x[0 : k] rounded for a product in `format` by matrix w: values and figures as `rounding` sizes them */
static inline void round_row(int format, const float *x, Weights w, int64_t k, void *values, float *figures) {
    if (format == W_I8) {
        figures[0] = quantize_row(x, k, values);
        return;
    }
#if BF16_DOT
    uint32_t *pairs = values;
    const int64_t n = (k + 7) / 8 * 4;
    round_pairs(x, 0, k, n, pairs); /* (zeros past k, to whole vectors) */
    for (int64_t b = 0, p0 = 0, p1 = w.first < k ? w.first : k; p0 < k; b++, p0 = p1, p1 = k - p1 > w.block ? p1 + w.block : k)
        figures[b] = pair_sum(pairs + p0 / 2, (p1 - p0 + 1) / 2);
#endif
}

#if BF16_DOT
/* W_U4 panels with vdpbf16ps, whose builds lay a lane's nibbles out as rows 0, 2, 4, 6 in its low half and 1,
 * 3, 5, 7 in its high (`linear_cpu.int_panels`): pair p of a group, rows 2p and 2p + 1, is (lane >> 4p) &
 * 0x000F000F, which or-ed with 0x43004300 is the pair of bfloat16 values 128 + q, exactly. One dot
 * instruction multiplies it by the row's pair of x rounded to bfloat16 (as bfloat16 weights are multiplied)
 * and adds both: half the instructions per weight of the float32 path. A block's sum less 128 times its sum
 * of x (rounded alike: the row's figures) is sum x q, which scale_block scales. c[r][0 : nv * LANES] = the
 * rows' products with the panel, for r < nr. */
static inline __attribute__((always_inline)) void
tile_int4_dot(const uint32_t *const *pairs, const float *const *sums, int nr, const char *w, const char *scale,
              int scale_format, int64_t first, int64_t block, int64_t k, int nv, float *const *c) {
    const int64_t groups = (k + 7) / 8, row = nv * LANES * 4; /* bytes per group of 8 rows */
    const __m512i mask = _mm512_set1_epi32(0x000F000F), ones = _mm512_set1_epi32(0x43004300);
    /* Up to 3 rows keep their sums in registers from block to block (with each block's part sums, 2 nr nv of the
     * 32), more store them in c at each block's end: with groups of 32 codes, one row's product 15% faster. */
    const int held = nr <= 3;
    vec acc[MR][NVI] = {{{0}}};
    for (int64_t b = 0, g0 = 0, g1 = first / 8 < groups ? first / 8 : groups; g0 < groups;
         b++, g0 = g1, g1 = groups - g1 > block / 8 ? g1 + block / 8 : groups,
                 scale += block_bytes(W_U4, nv * LANES, scale_format)) {
        vec part[MR][NVI] = {{{0}}};
        for (int64_t g = g0; g < g1; g++) {
            __m512i bits[NVI];
            for (int v = 0; v < nv; v++) bits[v] = _mm512_loadu_si512(w + g * row + v * LANES * 4);
            for (int p = 0; p < 4; p++)
                for (int v = 0; v < nv; v++) {
                    /* (lane >> 4p) & mask | ones, in one instruction where p > 0 needs no shift */
                    const __m512i lane = p ? _mm512_srli_epi32(bits[v], 4 * p) : bits[v];
                    __m512bh q = (__m512bh)_mm512_ternarylogic_epi32(lane, mask, ones, 0xEA);
                    IN_REGISTER(q);
                    for (int r = 0; r < nr; r++) {
                        const __m512bh x = (__m512bh)_mm512_set1_epi32((int)pairs[r][4 * g + p]);
                        part[r][v] = (vec)_mm512_dpbf16_ps((__m512)part[r][v], x, q);
                    }
                }
        }
        float xs[MR];
        for (int r = 0; r < nr; r++) {
            xs[r] = sums[r][b];
            for (int v = 0; v < nv; v++) part[r][v] -= splat(128.0f * xs[r]);
        }
        if (held)
            scale_block(acc, part, xs, nr, scale, scale_format, nv);
        else
            scale_block_into(c, part, xs, nr, scale, scale_format, nv, g0 > 0);
    }
    if (held)
        for (int r = 0; r < nr; r++)
            for (int v = 0; v < nv; v++) store(c[r] + v * LANES, acc[r][v]);
}
#endif

/* c[r][0 : n] for nr <= ROUNDED_ROWS rounded rows (values, figures) of x by the (k, n) matrix w in `format`,
 * panels `width` wide */
static inline __attribute__((always_inline)) void
panels_rounded(int format, const void *const *values, const float *const *figures, int nr, Weights w, int64_t k,
               int64_t n, int width, float *const *c) {
    for (int64_t j = 0; j < n; j += width) {
        float *cj[MR];
        for (int r = 0; r < nr; r++) cj[r] = c[r] + j;
        const Weights panel = nth_matrix(format, w, k, width, width, j / width);
        if (format == W_I8) {
            float sx[MR];
            for (int r = 0; r < nr; r++) sx[r] = figures[r][0];
            /* (a copy per tile height: with nr unknown, GCC spilled the broadcast rows and branched at every row) */
            WITH_TILE_HEIGHT(nr, if (width == PANEL_INT) tile_i8((const int8_t *const *)values, sx, NR, panel.data,
                                                                 panel.scale, k, NVI, cj);
                                 else tile_i8((const int8_t *const *)values, sx, NR, panel.data, panel.scale, k, 1, cj));
        }
#if BF16_DOT
        else {
            const uint32_t *const *pairs = (const uint32_t *const *)values;
            WITH_SCALE_FORMAT(
                w.scale_format,
                WITH_TILE_HEIGHT(nr, if (width == PANEL_INT) tile_int4_dot(pairs, figures, NR, panel.data, panel.scale,
                                                                           SCALE_FORMAT, w.first, w.block, k, NVI, cj);
                                     else tile_int4_dot(pairs, figures, NR, panel.data, panel.scale, SCALE_FORMAT,
                                                        w.first, w.block, k, 1, cj)));
        }
#endif
    }
}

/* matmul_rows_as for rounded(format) panels: each tile's rows of x rounded once, then every panel */
static inline __attribute__((always_inline)) void
matmul_rows_rounded(int format, const float *const *a, int64_t rows, Weights w, int64_t k, int64_t n, int width,
                    float *const *c) {
    const Rounding size = rounding(format, w, k);
    char *values = malloc(ROUNDED_ROWS * size.bytes);
    float *figures = malloc(ROUNDED_ROWS * size.floats * sizeof(float));
    for (int64_t r0 = 0; r0 < rows; r0 += ROUNDED_ROWS) {
        const int nr = rows - r0 < ROUNDED_ROWS ? rows - r0 : ROUNDED_ROWS;
        const void *v[MR];
        const float *f[MR];
        for (int r = 0; r < nr; r++) {
            round_row(format, a[r0 + r], w, k, values + r * size.bytes, figures + r * size.floats);
            v[r] = values + r * size.bytes, f[r] = figures + r * size.floats;
        }
        panels_rounded(format, v, f, nr, w, k, n, width, c + r0);
    }
    free(values), free(figures);
}

#endif
