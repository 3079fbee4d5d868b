/* Register-tiled products of a few rows by a column panel, what the linear, MoE and attention kernels
 * share.
 *
 * A panel is `width` consecutive columns of every row of a (k, n) matrix, contiguous: (k, width), with
 * width PANEL or LANES (n a multiple of LANES). A tile of up to MR rows by `width` columns streams its
 * panel once while its MR x NV accumulators stay in registers. The blocking follows the register file:
 * with 32 vector registers 6 x 4 accumulators (+ 4 panel vectors + 1 broadcast), with 16 of them 6 x 2
 * (+ 2 + 1), which keeps 12 multiply-adds in flight where two FMA units of latency 4 need 8. (4 rows
 * instead of 6: 8% slower at 64+ rows with AVX2, 0-15% with AVX-512, measured on an AMD EPYC.)
 */
#ifndef VLM_SERVE_TILES_H
#define VLM_SERVE_TILES_H

#include "simd.h"

#define MR 6                         /* rows per tile */
#define NV (REGISTERS >= 32 ? 4 : 2) /* vectors per panel row */
#define PANEL (NV * LANES)           /* floats per panel row: 64 on AVX-512, 16 on AVX2 and NEON */

BASELINE int kernel_panel(void) { return PANEL; }

/* Floats a tile of two rows or more reads its panel ahead of itself with software prefetches: 1 KB where
 * a k-step reads one cache line (AVX2, NEON) or less, none where it reads four (AVX-512). Measured on an
 * AMD EPYC, one thread, weights from memory: with AVX2 the hardware prefetcher alone leaves 4 or 16 rows
 * reading 12 and 6.8 GB/s of weights, with these 13-16 and 8.1-9.1; one row gains nothing; with
 * AVX-512 they cost a third. */
#define PREFETCH_AHEAD (PANEL <= 16 ? 256 : 0)

/* c[r][0 : nv * LANES] = a[r][0 : k] @ panel (k, nv * LANES) for r < nr */
static inline __attribute__((always_inline)) void
tile(const float *const *a, int nr, const float *panel, int64_t k, int nv, float *const *c) {
    vec acc[MR][NV] = {{{0}}};
    for (int64_t p = 0; p < k; p++) {
        if (PREFETCH_AHEAD && nr > 1) __builtin_prefetch(panel + p * nv * LANES + PREFETCH_AHEAD, 0, 3);
        vec b[NV];
        for (int v = 0; v < nv; v++) {
            b[v] = load(panel + p * nv * LANES + v * LANES);
            IN_REGISTER(b[v]);
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
        if (width == PANEL)
            tile(a, nr, w + j * k, k, NV, cj);
        else
            tile(a, nr, w + j * k, k, 1, cj);
    }
}

/* Runs the statements with the constant NR equal to nr (1 ... MR): a copy of them per tile height, each
 * keeping its tile's accumulators in registers. */
#define WITH_TILE_HEIGHT(nr, ...)                                     \
    switch (nr) {                                                     \
        case 1: { const int NR = 1; __VA_ARGS__; } break;             \
        case 2: { const int NR = 2; __VA_ARGS__; } break;             \
        case 3: { const int NR = 3; __VA_ARGS__; } break;             \
        case 4: { const int NR = 4; __VA_ARGS__; } break;             \
        case 5: { const int NR = 5; __VA_ARGS__; } break;             \
        default: { const int NR = MR; __VA_ARGS__; } break;           \
    }

/* matmul over any number of rows, MR at a time */
static inline __attribute__((always_inline)) void
matmul_rows(const float *const *a, int64_t rows, const float *w, int64_t k, int64_t n, int width, float *const *c) {
    for (int64_t r0 = 0; r0 < rows; r0 += MR) {
        WITH_TILE_HEIGHT(rows - r0 < MR ? rows - r0 : MR, matmul(a + r0, NR, w, k, n, width, c + r0));
    }
}

#endif
