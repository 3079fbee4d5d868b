/* Register-tiled products of a few rows by a column panel, what the linear, MoE and attention kernels
 * share.
 *
 * A panel is `width` consecutive columns of every row of a (k, n) matrix, contiguous: (k, width), with
 * width PANEL or LANES (n a multiple of LANES), in the weights' own format (W_* below). A tile of up to
 * MR rows by `width` columns streams its panel once while its MR x NV accumulators stay in registers.
 * The blocking follows the register file: with 32 vector registers 6 x 4 accumulators (+ 4 panel vectors
 * + 1 broadcast), with 16 of them 6 x 2 (+ 2 + 1), which keeps 12 multiply-adds in flight where two FMA
 * units of latency 4 need 8. (4 rows instead of 6: 8% slower at 64+ rows with AVX2, 0-15% with AVX-512,
 * measured on an AMD EPYC.)
 */
#ifndef VLM_SERVE_TILES_H
#define VLM_SERVE_TILES_H

#include "simd.h"

#define MR 6                         /* rows per tile */
#define NV (REGISTERS >= 32 ? 4 : 2) /* vectors per panel row */
#define PANEL (NV * LANES)           /* floats per panel row: 64 on AVX-512, 16 on AVX2 and NEON */
/* Integer panels are 4 vectors wide on every ISA: a row of x (decode) then feeds 4 independent sums, which
 * keep the multiply-adds' latency hidden where 2 (AVX2's PANEL) would leave every other cycle idle. */
#define NVI 4
#define PANEL_INT (NVI * LANES)

BASELINE int kernel_panel(void) { return PANEL; }
BASELINE int kernel_int_panel(void) { return PANEL_INT; }

/* The formats a panel's weights are stored in. The kernels read them as stored, widen them to float32 in
 * registers and accumulate in float32 (x and y stay float32): at decode batch sizes the products are
 * bound by reading the weights, so fewer bytes per weight are that much faster.
 *
 * A panel of a 2- or 1-byte format holds its k rows in groups of G = 2 or 4 (4 / bytes per weight): one
 * 32-bit lane holds a column's G weights of the group, so one vector load brings G rows' weights for
 * LANES columns, and each row is had from it with shifts and masks on whole lanes (no widening loads,
 * which GCC's vector extensions compile to shuffles beyond 128 bits). Panels are padded with zero rows to
 * whole groups, `lead` of them before row 0 (W_E4M3: so that scale blocks start on a group).
 * - W_BF16: the top half of a float32: row 0's half shifted up 16 bits, row 1's masked.
 * - W_F16 and W_E4M3 (FP8: 4 exponent bits, 3 mantissa bits, bias 7): the bits after the sign are put
 *   where the lowest exponent bit lands on float32's (bit 13 or 20) and the sign on bit 31 (one
 *   arithmetic shift right, a mask): a float32 with the same mantissa and an exponent short by the
 *   difference of the biases (112, 120), so one multiply by 2^112 or 2^120 gives the value, subnormals
 *   included (they become float32 subnormals, which the multiply scales back exactly unless the CPU
 *   flushes denormals: torch and C leave that off). For W_E4M3 the multiplier is the block scale times
 *   2^120, one per panel and block of k. Infinities and NaNs are not decoded as such (e4m3fn's NaN
 *   becomes 480 * scale): checkpoints hold none.
 * - W_U4 and W_U8: unsigned integer codes q of 4 or 8 bits (compressed-tensors', AWQ's and GPTQ's
 *   weights, `quantization.int_config`), 8 or 4 rows of k to a lane, the first in the lowest bits. The
 *   weight is (q - z) s, each column with its own scale s and zero point z for each block of k (a
 *   quantization group; one block of all of k per channel), s as the checkpoint stores it (float32,
 *   bfloat16 or float16: a 16-bit scale widened exactly) and z a byte: at groups of 32 4-bit codes, 16
 *   bytes, the scale and zero add 3 where float32 scales and biases added 8. See tile_int.
 * Where the build asks for AVX-512-BF16's dot products, W_BF16 panels are the exception: see BF16_DOT. */
#define W_F32 0
#define W_BF16 1
#define W_F16 2
#define W_E4M3 3
#define W_U4 4
#define W_U8 5
#define W_I8 6 /* int8 weights times int8 activations (W8A8): int8.h's, not these tiles */

static inline int is_int(int format) { return format == W_U4 || format == W_U8; }

/* rows of k a 32-bit lane holds (G) */
static inline int lane_rows(int format) {
    return format == W_F32 ? 1 : format == W_U4 ? 8 : format == W_E4M3 || format == W_U8 || format == W_I8 ? 4 : 2;
}

/* A (k, n) matrix of weights in panels, as the products below read it. */
typedef struct {
    const void *data;     /* n / width panels of (lead + k) / G groups, rounded up, of (width, G) weights */
    const void *scale;    /* W_E4M3: per panel, its float32 multiplier for each block of k (scale * 2^120);
                             W_U4, W_U8: per panel and block of k, its columns' `width` scales in
                             scale_format, then their zero points, a byte each; W_I8: int8.h's; else NULL */
    int64_t first, block; /* W_E4M3, W_U4, W_U8: k rows of the first block and of every later one (the last
                             may be shorter; lead + first and block are whole groups); else k and k */
    int64_t lead;         /* zero rows before row 0 */
    int scale_format;     /* W_U4, W_U8: their scales' format, W_F32, W_BF16 or W_F16 */
} Weights;

/* A weight's fields as the kernels' entry points take them, after its format: WEIGHT_ARGS(p) declares
 * them, WEIGHTS_OF(p) is the Weights they make. */
#define WEIGHT_ARGS(p) \
    const void *p##_w, const void *p##_scale, int64_t p##_first, int64_t p##_block, int64_t p##_lead, int p##_scale_format
#define WEIGHTS_OF(p) ((Weights){p##_w, p##_scale, p##_first, p##_block, p##_lead, p##_scale_format})

static inline int scale_bytes(int scale_format) { return scale_format == W_F32 ? 4 : 2; }

/* bytes of `scale` per panel and block of k */
static inline int64_t block_bytes(int format, int width, int scale_format) {
    return is_int(format) ? (int64_t)width * (scale_bytes(scale_format) + 1) : format == W_I8 ? 8 * width : 4;
}

/* a float32 matrix: one block of k, no scales */
static inline Weights plain(const float *w, int64_t k) { return (Weights){w, NULL, k, k, 0, W_F32}; }

typedef uint32_t uvec __attribute__((vector_size(LANES * 4)));

/* row j of a group, from the LANES lanes that hold its columns' weights: as float32, times m where the
 * format needs it */
static inline __attribute__((always_inline)) vec unpack(int format, uvec bits, int j, vec m) {
    if (format == W_BF16) {
        bits = j == 0 ? bits << 16 : bits & 0xFFFF0000u;
    } else if (format == W_F16) {
        const ivec s = (ivec)(j == 0 ? bits << 16 : bits);
        bits = (uvec)(s >> 3) & 0x8FFFE000u;
    } else if (format == W_E4M3) {
        const ivec s = (ivec)(bits << (24 - 8 * j));
        bits = (uvec)(s >> 4) & 0x87F00000u;
    }
    vec v;
    memcpy(&v, &bits, sizeof v);
    return format == W_F16 || format == W_E4M3 ? v * m : v;
}

/* Integer codes are summed a block of k at a time and scaled at its end: each row's products with the
 * block's codes, part = sum x q, and its sum of x, xs, make sum x (q - z) s = (part - xs z) s for each
 * column (tile_int). Row j of a group is had from its lane without a shift, but for the last (the lane's top bits,
 * which would read as negative): masked in place it is the integer q 2^(bits j), which multiplies x
 * 2^-(bits j), the same product exactly. So each weight costs a mask, a conversion and a multiply-add. */

/* row j of an integer group as float32, from the LANES lanes that hold its columns' codes: q 2^(bits j),
 * or q for the last row */
static inline __attribute__((always_inline)) vec int_row(int format, uvec bits, int j) {
    const int width = format == W_U4 ? 4 : 8, last = 32 / width - 1;
    const uvec q = j == last ? bits >> (width * j) : bits & (((1u << width) - 1) << (width * j));
    return __builtin_convertvector((ivec)q, vec);
}

/* what x is multiplied by to meet row j's int_row */
static inline __attribute__((always_inline)) float int_row_scale(int format, int j) {
    const int width = format == W_U4 ? 4 : 8;
    return j == 32 / width - 1 ? 1.0f : 1.0f / (float)(1u << (width * j));
}

/* Where the compiler targets AVX-512-BF16 (-march=native on Zen 4, Cooper Lake, Sapphire Rapids and
 * later) and the build asks for it (VLM_SERVE_BF16_DOT: unless $VLM_SERVE_CPU_BF16_DOT=0), a W_BF16 tile
 * multiplies bfloat16 weights by x rounded to bfloat16 (to nearest even) with
 * vdpbf16ps, summing in float32: bfloat16 compute for a bfloat16 model, as vLLM's and oneDNN's CPU paths
 * do. One instruction takes a lane's pair of weights (rows 2i and 2i + 1 of k, the group) and the
 * broadcast pair x[2i], x[2i + 1], so a group costs one instruction per weight vector where the
 * portable path spends two multiply-adds and the unpacking shifts. The results differ from float32 x
 * by bfloat16's rounding of x (~2^-9 relative), and the instruction reads subnormal inputs as zero.
 * This is the one ISA-specific path of the kernels (intrinsics); every other target builds the portable
 * one. AMX's bfloat16 tiles (Sapphire Rapids) are not used: the CPUs this is measured on have none. */
#if defined(__AVX512BF16__) && LANES == 16 && defined(VLM_SERVE_BF16_DOT)
#include <immintrin.h>
#define BF16_DOT 1
#define DOT_PAIRS 128 /* groups of k whose rows of x a tile rounds to bfloat16 at once (on the stack) */
#else
#define BF16_DOT 0
#endif

BASELINE int kernel_bf16_dot(void) { return BF16_DOT; }

/* Bytes a tile reads its panel ahead of itself with software prefetches, where a group of k rows is one
 * cache line (AVX2 and NEON) or less; none where it is four (AVX-512: with float32 they cost a third).
 * Measured on an AMD EPYC, one thread, weights from memory. Float32: 1 KB from two rows on: with AVX2
 * the hardware prefetcher alone leaves 4 or 16 rows reading 12 and 6.8 GB/s of weights, with these
 * 13-16 and 8.1-9.1; one row gains nothing. Narrower formats, whose cache lines hold 2 or 4 rows of k:
 * 2 KB at every tile height: one row read 8.7-10.2 GB/s of bfloat16 and 6.5-8.5 of FP8 without, 10-11.6
 * and 8.8-9.5 with them. */
#define PREFETCH_AHEAD(format, nr) (PANEL > 16 ? 0 : (format) != W_F32 ? 2048 : (nr) > 1 ? 1024 : 0)

/* acc[r] += a[r][p0 + j] * the group's row j, for j0 <= j < j1 and r < nr: the group of k rows whose
 * first row is p0, at w */
static inline __attribute__((always_inline)) void
group(int format, vec acc[MR][NV], const float *const *a, int nr, const char *w, int64_t p0, int j0, int j1,
      vec m, int nv) {
    for (int j = j0; j < j1; j++) {
        vec b[NV];
        for (int v = 0; v < nv; v++) {
            uvec bits;
            memcpy(&bits, w + v * LANES * 4, sizeof bits);
            b[v] = unpack(format, bits, j, m);
            IN_REGISTER(b[v]);
        }
        for (int r = 0; r < nr; r++) {
            const vec ar = splat(a[r][p0 + j]);
            for (int v = 0; v < nv; v++) acc[r][v] += ar * b[v];
        }
    }
}

/* part[r] += a[r][p0 + j] * the group's codes of row j, for j0 <= j < j1 and r < nr: the integer group of
 * k rows whose first row is p0, at w */
static inline __attribute__((always_inline)) void
group_codes(int format, vec part[MR][NVI], const float *const *a, int nr, const char *w, int64_t p0, int j0, int j1,
            int nv) {
    for (int j = j0; j < j1; j++) {
        vec q[NVI];
        for (int v = 0; v < nv; v++) {
            uvec bits;
            memcpy(&bits, w + v * LANES * 4, sizeof bits);
            q[v] = int_row(format, bits, j);
            IN_REGISTER(q[v]);
        }
        for (int r = 0; r < nr; r++) {
            const vec xr = splat(a[r][p0 + j] * int_row_scale(format, j));
            for (int v = 0; v < nv; v++) part[r][v] += xr * q[v];
        }
    }
}

/* x[0] + ... + x[n - 1], in vectors (the same sum wherever it is taken: no chain of scalar additions) */
static inline __attribute__((always_inline)) float row_sum(const float *x, int64_t n) {
    vec s = splat(0.0f);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) s += load(x + i);
    float total = hsum(s);
    for (; i < n; i++) total += x[i];
    return total;
}

typedef uint16_t hvec __attribute__((vector_size(LANES * 2)));
typedef uint8_t bvec __attribute__((vector_size(LANES)));

/* the LANES scales at p, stored in scale_format, as float32 */
static inline __attribute__((always_inline)) vec load_scales(const char *p, int scale_format) {
    if (scale_format == W_F32) {
        vec s;
        memcpy(&s, p, sizeof s);
        return s;
    }
    hvec h;
    memcpy(&h, p, sizeof h);
    return unpack(scale_format, __builtin_convertvector(h, uvec), 0, splat(0x1p112f));
}

/* Runs the statements with the constant SCALE_FORMAT equal to scale_format (W_F32, W_BF16 or W_F16): a copy
 * per format of integer scales, so that a block's end (every 32 rows of k for groups of 32) does not branch on
 * it (measured: groups of 32 at one row 25% slower with the branches). */
#define WITH_SCALE_FORMAT(scale_format, ...)                                   \
    switch (scale_format) {                                                    \
        case W_BF16: { const int SCALE_FORMAT = W_BF16; __VA_ARGS__; } break;  \
        case W_F16: { const int SCALE_FORMAT = W_F16; __VA_ARGS__; } break;    \
        default: { const int SCALE_FORMAT = W_F32; __VA_ARGS__; } break;       \
    }

/* acc[r] += (part[r] - xs[r] z) s for the nv vectors of a panel, their block's scales s (in scale_format)
 * and zero points z at `scale` (block_bytes): a block of integer codes done */
static inline __attribute__((always_inline)) void
scale_block(vec acc[MR][NVI], vec part[MR][NVI], const float *xs, int nr, const char *scale, int scale_format,
            int nv) {
    const char *zeros = scale + nv * LANES * scale_bytes(scale_format);
    for (int v = 0; v < nv; v++) {
        bvec zb;
        memcpy(&zb, zeros + v * LANES, sizeof zb);
        const vec s = load_scales(scale + v * LANES * scale_bytes(scale_format), scale_format);
        const vec z = __builtin_convertvector(zb, vec);
        for (int r = 0; r < nr; r++) { /* (each step alone, so that every caller rounds the same) */
            vec t = splat(xs[r]) * z;
            IN_REGISTER(t);
            t = part[r][v] - t;
            IN_REGISTER(t);
            t = t * s;
            IN_REGISTER(t);
            acc[r][v] = acc[r][v] + t;
        }
    }
}

/* c[r][0 : nv * LANES] = (c[r] where `add`, else 0) + (part[r] - xs[r] z) s: scale_block on the sums kept in
 * c between blocks (registers are the blocks' part sums') */
static inline __attribute__((always_inline)) void
scale_block_into(float *const *c, vec part[MR][NVI], const float *xs, int nr, const char *scale, int scale_format,
                 int nv, int add) {
    vec acc[MR][NVI];
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = add ? load(c[r] + v * LANES) : splat(0.0f);
    scale_block(acc, part, xs, nr, scale, scale_format, nv);
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) store(c[r] + v * LANES, acc[r][v]);
}

/* tile() for W_U4 and W_U8 panels (no lead): a block of k at a time, part sums scaled at its end */
static inline __attribute__((always_inline)) void
tile_int(int format, const float *const *a, int nr, const char *w, const char *scale, int scale_format,
         int64_t first, int64_t block, int64_t k, int nv, float *const *c, int accumulate) {
    const int G = lane_rows(format);
    const int64_t groups = (k + G - 1) / G, whole = k / G, row = nv * LANES * 4; /* bytes per group */
    for (int64_t g0 = 0, g1 = first / G < groups ? first / G : groups; g0 < groups;
         g0 = g1, g1 = groups - g1 > block / G ? g1 + block / G : groups,
                 scale += block_bytes(format, nv * LANES, scale_format)) {
        vec part[MR][NVI] = {{{0}}};
        int64_t g = g0;
        for (const int64_t end = g1 < whole ? g1 : whole; g < end; g++) {
            if (PREFETCH_AHEAD(format, nr)) __builtin_prefetch(w + g * row + PREFETCH_AHEAD(format, nr), 0, 3);
            group_codes(format, part, a, nr, w + g * row, g * G, 0, G, nv);
        }
        if (g < g1) group_codes(format, part, a, nr, w + g * row, g * G, 0, k - g * G, nv); /* the last, in part */
        float xs[MR];
        const int64_t p1 = g1 * G < k ? g1 * G : k;
        for (int r = 0; r < nr; r++) xs[r] = row_sum(a[r] + g0 * G, p1 - g0 * G);
        scale_block_into(c, part, xs, nr, scale, scale_format, nv, g0 > 0 || accumulate);
    }
}

#if BF16_DOT
/* out[i] = x[p + 2i] and x[p + 2i + 1] rounded to bfloat16, in the low and high half, for i < n rounded
 * up to 16; rows of x outside 0 ... k - 1 (the panel's zero rows) are 0. (Not inlined: its constants
 * would take registers from the tile's accumulators.) */
static __attribute__((noinline)) void round_pairs(const float *x, int64_t p, int64_t k, int64_t n, uint32_t *out) {
    for (int64_t i = 0; i < n; i += 16, p += 32) {
        __m512 lo, hi;
        if (p >= 0 && p + 32 <= k) {
            lo = _mm512_loadu_ps(x + p), hi = _mm512_loadu_ps(x + p + 16);
        } else { /* the first or last pairs, in part */
            float part[32];
            for (int j = 0; j < 32; j++) part[j] = p + j >= 0 && p + j < k ? x[p + j] : 0.0f;
            lo = _mm512_loadu_ps(part), hi = _mm512_loadu_ps(part + 16);
        }
        _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* tile() for W_BF16 panels with vdpbf16ps (BF16_DOT): each row's pairs of x rounded DOT_PAIRS groups at
 * a time, then one dot instruction per weight vector and row; each row's sum in the same order
 * whatever nr is */
static inline __attribute__((always_inline)) void
tile_bf16_dot(const float *const *a, int nr, const char *w, int64_t lead, int64_t k, int nv, float *const *c,
              int accumulate) {
    const int64_t groups = (lead + k + 1) / 2, row = nv * LANES * 4;
    __m512 acc[MR][NV];
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = accumulate ? _mm512_loadu_ps(c[r] + v * LANES) : _mm512_setzero_ps();
    uint32_t pairs[MR][DOT_PAIRS] __attribute__((aligned(64)));
    for (int64_t g0 = 0; g0 < groups; g0 += DOT_PAIRS) {
        const int64_t n = groups - g0 < DOT_PAIRS ? groups - g0 : DOT_PAIRS;
        for (int r = 0; r < nr; r++) round_pairs(a[r], 2 * g0 - lead, k, n, pairs[r]);
        for (int64_t g = 0; g < n; g++) {
            __m512bh b[NV];
            for (int v = 0; v < nv; v++) {
                b[v] = (__m512bh)_mm512_loadu_si512(w + (g0 + g) * row + v * LANES * 4);
                IN_REGISTER(b[v]);
            }
            for (int r = 0; r < nr; r++) {
                const __m512bh x = (__m512bh)_mm512_set1_epi32((int)pairs[r][g]);
                for (int v = 0; v < nv; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], x, b[v]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(c[r] + v * LANES, acc[r][v]);
}

#endif

/* c[r][0 : nv * LANES] = a[r][0 : k] @ panel (k, nv * LANES) for r < nr (+ c[r] where `accumulate`),
 * the panel in `format`, `scale` its multipliers (W_E4M3). Each row's sum runs over k in order, whatever
 * nr is: a row's result does not depend on the rows batched with it. */
static inline __attribute__((always_inline)) void
tile(int format, const float *const *a, int nr, const void *panel, const void *scale, int scale_format,
     int64_t first, int64_t block, int64_t lead, int64_t k, int nv, float *const *c, int accumulate) {
    const int G = lane_rows(format);
    const int64_t groups = (lead + k + G - 1) / G, row = nv * LANES * 4; /* bytes per group */
    const int64_t whole0 = lead > 0, whole1 = (lead + k) / G;         /* the groups of G rows of k */
#if BF16_DOT
    if (format == W_BF16) {
        tile_bf16_dot(a, nr, panel, lead, k, nv, c, accumulate);
        return;
    }
#endif
    if (is_int(format)) {
        WITH_SCALE_FORMAT(scale_format,
                          tile_int(format, a, nr, panel, scale, SCALE_FORMAT, first, block, k, nv, c, accumulate));
        return;
    }
    const char *w = panel;
    const float *multiplier = scale; /* (W_E4M3) */
    vec acc[MR][NV] = {{{0}}};
    if (accumulate)
        for (int r = 0; r < nr; r++)
            for (int v = 0; v < nv; v++) acc[r][v] = load(c[r] + v * LANES);
    if (format == W_F32) { /* one row a group, one block, no lead */
        for (int64_t p = 0; p < k; p++) {
            if (PREFETCH_AHEAD(format, nr)) __builtin_prefetch(w + p * row + PREFETCH_AHEAD(format, nr), 0, 3);
            group(format, acc, a, nr, w + p * row, p, 0, 1, splat(1.0f), nv);
        }
    } else { /* blocks of k, in groups */
        for (int64_t g0 = 0, g1 = (lead + first) / G < groups ? (lead + first) / G : groups; g0 < groups;
             g0 = g1, g1 = groups - g1 > block / G ? g1 + block / G : groups) {
            const vec m = splat(format == W_E4M3 ? *multiplier++ : 0x1p112f);
            for (int64_t g = g0; g < g1;) {
                if (g >= whole0 && g < whole1) {
                    for (const int64_t end = g1 < whole1 ? g1 : whole1; g < end; g++) {
                        if (PREFETCH_AHEAD(format, nr))
                            __builtin_prefetch(w + g * row + PREFETCH_AHEAD(format, nr), 0, 3);
                        group(format, acc, a, nr, w + g * row, g * G - lead, 0, G, m, nv);
                    }
                } else { /* the first or last group, in part */
                    const int64_t p0 = g * G - lead;
                    group(format, acc, a, nr, w + g * row, p0, p0 < 0 ? -p0 : 0, k - p0 < G ? k - p0 : G, m, nv);
                    g++;
                }
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) store(c[r] + v * LANES, acc[r][v]);
}

/* blocks of k of a matrix with scales: `first` rows, then `block` each */
static inline int64_t blocks_of(Weights w, int64_t k) { return k <= w.first ? 1 : 1 + (k - w.first + w.block - 1) / w.block; }

/* matrix i of a stack of (k, n) matrices in panels `width` wide (panel i of a matrix: n = width) */
static inline Weights nth_matrix(int format, Weights w, int64_t k, int64_t n, int width, int64_t i) {
    const int G = lane_rows(format);
    const int64_t groups = (w.lead + k + G - 1) / G;
    const int scaled = format == W_E4M3 || is_int(format) || format == W_I8;
    const int64_t blocks = scaled ? blocks_of(w, k) : 1;
    w.data = (const char *)w.data + i * groups * n * 4;
    w.scale = scaled ? (const char *)w.scale + i * n / width * blocks * block_bytes(format, width, w.scale_format)
                     : NULL;
    return w;
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

/* Runs the statements with the constant FORMAT equal to format: a copy of them per weight format. */
#define WITH_FORMAT(format, ...)                                      \
    switch (format) {                                                 \
        case W_BF16: { const int FORMAT = W_BF16; __VA_ARGS__; } break; \
        case W_F16: { const int FORMAT = W_F16; __VA_ARGS__; } break;   \
        case W_E4M3: { const int FORMAT = W_E4M3; __VA_ARGS__; } break; \
        case W_U4: { const int FORMAT = W_U4; __VA_ARGS__; } break;     \
        case W_U8: { const int FORMAT = W_U8; __VA_ARGS__; } break;     \
        case W_I8: { const int FORMAT = W_I8; __VA_ARGS__; } break;     \
        default: { const int FORMAT = W_F32; __VA_ARGS__; } break;      \
    }

/* A tile as a function of its own for each format, height and width, where TILE_FUNCTIONS is defined
 * (the weight kernels): its loop has the registers to itself. Inlined into the large loops around it,
 * GCC kept some row pointers on the stack and reloaded them at every step of k: 25% slower. */
#define TILE_ARGS                                                                                           \
    const float *const *a, const void *panel, const void *scale, int scale_format, int64_t first, int64_t block, \
        int64_t lead, int64_t k, float *const *c, int accumulate
#ifdef TILE_FUNCTIONS
_Static_assert(MR == 6 && W_F32 == 0 && W_BF16 == 1 && W_F16 == 2 && W_E4M3 == 3 && W_U4 == 4 && W_U8 == 5,
               "the table below");
#define TILE_FN(F, R, NAME, V)                                                                   \
    static __attribute__((noinline)) void tile_##F##_##R##_##NAME(TILE_ARGS) {                   \
        tile(F, a, R, panel, scale, scale_format, first, block, lead, k, V, c, accumulate);      \
    }
#define TILE_FNS(F, V)                                                                           \
    TILE_FN(F, 1, one, 1) TILE_FN(F, 2, one, 1) TILE_FN(F, 3, one, 1) TILE_FN(F, 4, one, 1)      \
    TILE_FN(F, 5, one, 1) TILE_FN(F, 6, one, 1) TILE_FN(F, 1, all, V) TILE_FN(F, 2, all, V)      \
    TILE_FN(F, 3, all, V) TILE_FN(F, 4, all, V) TILE_FN(F, 5, all, V) TILE_FN(F, 6, all, V)
TILE_FNS(0, NV)
TILE_FNS(1, NV)
TILE_FNS(2, NV)
TILE_FNS(3, NV)
TILE_FNS(4, NVI) /* (integer panels: PANEL_INT wide) */
TILE_FNS(5, NVI)
#define TILE_ROW(F, NAME) {tile_##F##_1_##NAME, tile_##F##_2_##NAME, tile_##F##_3_##NAME, \
                           tile_##F##_4_##NAME, tile_##F##_5_##NAME, tile_##F##_6_##NAME}
/* [format][panel of NV vectors][rows - 1] */
static void (*const tile_functions[6][2][MR])(TILE_ARGS) = {
    {TILE_ROW(0, one), TILE_ROW(0, all)},
    {TILE_ROW(1, one), TILE_ROW(1, all)},
    {TILE_ROW(2, one), TILE_ROW(2, all)},
    {TILE_ROW(3, one), TILE_ROW(3, all)},
    {TILE_ROW(4, one), TILE_ROW(4, all)},
    {TILE_ROW(5, one), TILE_ROW(5, all)},
};
#endif

/* tile() for nr <= MR rows and a panel of nv (NV or 1) vectors */
static inline __attribute__((always_inline)) void
run_tile(int format, const float *const *a, int nr, const void *panel, const void *scale, int scale_format,
         int64_t first, int64_t block, int64_t lead, int64_t k, int nv, float *const *c, int accumulate) {
#ifdef TILE_FUNCTIONS
    tile_functions[format][nv != 1][nr - 1](a, panel, scale, scale_format, first, block, lead, k, c, accumulate);
#else
    WITH_TILE_HEIGHT(nr, if (nv == 1) tile(format, a, NR, panel, scale, scale_format, first, block, lead, k, 1, c,
                                           accumulate);
                         else tile(format, a, NR, panel, scale, scale_format, first, block, lead, k,
                                   is_int(format) ? NVI : NV, c, accumulate));
#endif
}

/* c[r][0 : n] = a[r][0 : k] @ the (k, n) matrix w, panels `width` columns wide, stored in `format`;
 * r < nr <= MR */
static inline __attribute__((always_inline)) void
matmul_as(int format, const float *const *a, int nr, Weights w, int64_t k, int64_t n, int width, float *const *c) {
    for (int64_t j = 0; j < n; j += width) {
        float *cj[MR];
        for (int r = 0; r < nr; r++) cj[r] = c[r] + j;
        const Weights panel = nth_matrix(format, w, k, width, width, j / width);
        run_tile(format, a, nr, panel.data, panel.scale, w.scale_format, w.first, w.block, w.lead, k, width / LANES,
                 cj, 0);
    }
}

/* Rows per tile that reads its panel as stored: one fewer than MR where 16 registers would not hold
 * the accumulators and a format's mask and multiplier as well; 2 for integer panels there (their 4
 * vectors a row). */
#define TILE_ROWS(format)                                                                        \
    (REGISTERS < 32 && is_int(format) ? 2 : REGISTERS < 32 && ((format) == W_F16 || (format) == W_E4M3) ? MR - 1 \
                                                                                                    : MR)
#define WIDE_ROWS 256 /* rows of k a product of more rows than a tile widens at once (whole groups) */

/* out[(j - j0) * nv * LANES ...] = row j of the group at w as float32, for j0 <= j < j1 */
static inline __attribute__((always_inline)) void
widen_group(int format, const char *w, int j0, int j1, vec m, int nv, float *out) {
    for (int j = j0; j < j1; j++)
        for (int v = 0; v < nv; v++) {
            uvec bits;
            memcpy(&bits, w + v * LANES * 4, sizeof bits);
            store(out + (j - j0) * nv * LANES + v * LANES, unpack(format, bits, j, m));
        }
}

/* Rows q0 <= p < q1 (q0 a whole group) of integer panel w (nv vectors wide) as their codes in float32, in
 * float32 panels `sub` columns wide (PANEL, or the panel's width if less), WIDE_ROWS rows apart:
 * out[h * WIDE_ROWS * sub + (p - q0) * sub + i] holds column h * sub + i. */
static inline __attribute__((always_inline)) void
widen_codes(int format, Weights w, int64_t k, int64_t q0, int64_t q1, int nv, int sub, float *out) {
    const int G = lane_rows(format);
    const int64_t row = nv * LANES * 4, end = q1 < k ? q1 : k;
    for (int64_t p = q0; p < end; p += G) {
        const char *group = (const char *)w.data + p / G * row;
        for (int j = 0; j < G && p + j < end; j++)
            for (int v = 0; v < nv; v++) {
                uvec bits;
                memcpy(&bits, group + v * LANES * 4, sizeof bits);
                const int column = v * LANES;
                store(out + column / sub * WIDE_ROWS * sub + (p + j - q0) * sub + column % sub,
                      int_row(format, bits, j) * int_row_scale(format, j));
            }
    }
}

/* The rows of panel w (a (k, nv * LANES) matrix, see nth_matrix) that lie in its rows q0 <= q < q1
 * (q0, q1: whole groups; q counts the lead rows), as float32: out[(p - *p0) * nv * LANES + ...] for
 * *p0 <= p < *p1, each value what tile() multiplies with. */
static inline __attribute__((always_inline)) void
widen(int format, Weights w, int64_t k, int64_t q0, int64_t q1, int nv, float *out, int64_t *p0, int64_t *p1) {
    const int G = lane_rows(format);
    const int64_t groups = (w.lead + k + G - 1) / G, row = nv * LANES * 4;
    const int64_t end = q1 / G < groups ? q1 / G : groups;
    const float *multiplier = w.scale; /* (W_E4M3) */
    *p0 = q0 - w.lead > 0 ? q0 - w.lead : 0;
    *p1 = q1 - w.lead < k ? q1 - w.lead : k;
    /* blocks of k, in groups, as tile() walks them */
    for (int64_t g0 = 0, g1 = (w.lead + w.first) / G < groups ? (w.lead + w.first) / G : groups; g0 < end;
         g0 = g1, g1 = groups - g1 > w.block / G ? g1 + w.block / G : groups, multiplier++) {
        if (g1 <= q0 / G) continue;
        const vec m = splat(format == W_E4M3 ? *multiplier : 0x1p112f);
        for (int64_t g = g0 > q0 / G ? g0 : q0 / G; g < g1 && g < end; g++) {
            const int64_t p = g * G - w.lead; /* the group's first row */
            float *to = out + (p - *p0) * nv * LANES;
            if (p >= 0 && p + G <= k)
                widen_group(format, (const char *)w.data + g * row, 0, G, m, nv, to);
            else /* the first or last group, in part */
                widen_group(format, (const char *)w.data + g * row, p < 0 ? -p : 0, k - p < G ? k - p : G, m, nv,
                            p < 0 ? out : to);
        }
    }
}

#define INT_ROWS 64 /* rows of x a widened integer product takes at once (their part sums are on the stack) */

/* matmul_rows_as for integer codes and more rows than two tiles (at most INT_ROWS): each block of k of a
 * panel widened to its codes as float32, WIDE_ROWS rows at a time, multiplied by float32 tiles into each
 * row's part sums, which scale_block scales: tile_int's sums, in its order. */
static inline __attribute__((always_inline)) void
matmul_rows_int(int format, const float *const *a, int64_t rows, Weights w, int64_t k, int64_t n, int width,
                float *const *c) {
    const int nv = width / LANES, sub = width < PANEL ? width : PANEL; /* (the float32 tiles' panels) */
    float wide[WIDE_ROWS * PANEL_INT], part[INT_ROWS * PANEL_INT], xs[INT_ROWS];
    for (int64_t j = 0; j < n; j += width) {
        const Weights panel = nth_matrix(format, w, k, width, width, j / width);
        const char *scale = panel.scale;
        for (int64_t b0 = 0, b1 = w.first < k ? w.first : k; b0 < k;
             b0 = b1, b1 = k - b1 > w.block ? b1 + w.block : k, scale += block_bytes(format, width, w.scale_format)) {
            for (int64_t q0 = b0; q0 < b1; q0 += WIDE_ROWS) {
                const int64_t q1 = b1 - q0 > WIDE_ROWS ? q0 + WIDE_ROWS : b1;
                if (nv == NVI)
                    widen_codes(format, panel, k, q0, q1, NVI, sub, wide);
                else
                    widen_codes(format, panel, k, q0, q1, 1, sub, wide);
                for (int h = 0; h < width / sub; h++)
                    for (int64_t r0 = 0; r0 < rows; r0 += MR) {
                        const float *ar[MR] = {0};
                        float *pr[MR] = {0};
                        for (int r = 0; r < MR && r0 + r < rows; r++)
                            ar[r] = a[r0 + r] + q0, pr[r] = part + (r0 + r) * width + h * sub;
                        run_tile(W_F32, ar, rows - r0 < MR ? rows - r0 : MR, wide + h * WIDE_ROWS * sub, NULL, W_F32, q1 - q0,
                                 q1 - q0, 0, q1 - q0, sub / LANES, pr, q0 > b0);
                    }
            }
            for (int64_t r = 0; r < rows; r++) xs[r] = row_sum(a[r] + b0, b1 - b0);
            for (int64_t r0 = 0; r0 < rows; r0 += MR) {
                const int nr = rows - r0 < MR ? rows - r0 : MR;
                vec acc[MR][NVI], pt[MR][NVI];
                for (int r = 0; r < nr; r++)
                    for (int v = 0; v < nv; v++) {
                        acc[r][v] = b0 > 0 ? load(c[r0 + r] + j + v * LANES) : splat(0.0f);
                        pt[r][v] = load(part + (r0 + r) * width + v * LANES);
                    }
                scale_block(acc, pt, xs + r0, nr, scale, w.scale_format, nv);
                for (int r = 0; r < nr; r++)
                    for (int v = 0; v < nv; v++) store(c[r0 + r] + j + v * LANES, acc[r][v]);
            }
        }
    }
}

/* matmul_as over any number of rows: tiles of up to TILE_ROWS rows, each reading the panels as stored.
 * From more than two tiles' rows on, float16, FP8 and integer panels are widened to float32 instead, WIDE_ROWS
 * rows of k at a time, once for all the tiles rather than once per tile (measured with FP8 on AVX2, one
 * thread, 4096 x 4096: 16 rows 14% faster, 64 and 128 rows 26%; 7 rows 24% slower). The same values are summed in
 * the same order either way: a row's result does not depend on the rows batched with it. (W_I8 panels, and
 * W_U4 ones where BF16_DOT lays them out for its dot products, take rounded.h's products instead.) */
static inline __attribute__((always_inline)) void
matmul_rows_as(int format, const float *const *a, int64_t rows, Weights w, int64_t k, int64_t n, int width,
               float *const *c) {
    const int tile_rows = TILE_ROWS(format);
    if ((format != W_F16 && format != W_E4M3 && !is_int(format)) || rows <= 2 * tile_rows) {
        for (int64_t r0 = 0; r0 < rows; r0 += tile_rows) {
#ifdef TILE_FUNCTIONS
            matmul_as(format, a + r0, rows - r0 < tile_rows ? rows - r0 : tile_rows, w, k, n, width, c + r0);
#else
            WITH_TILE_HEIGHT(rows - r0 < tile_rows ? rows - r0 : tile_rows,
                             matmul_as(format, a + r0, NR, w, k, n, width, c + r0));
#endif
        }
        return;
    }
    if (is_int(format)) {
        for (int64_t r0 = 0; r0 < rows; r0 += INT_ROWS)
            matmul_rows_int(format, a + r0, rows - r0 < INT_ROWS ? rows - r0 : INT_ROWS, w, k, n, width, c + r0);
        return;
    }
    float wide[WIDE_ROWS * PANEL];
    for (int64_t j = 0; j < n; j += width) {
        const Weights panel = nth_matrix(format, w, k, width, width, j / width);
        for (int64_t q0 = 0; q0 < w.lead + k; q0 += WIDE_ROWS) {
            int64_t p0, p1;
            if (width == PANEL)
                widen(format, panel, k, q0, q0 + WIDE_ROWS, NV, wide, &p0, &p1);
            else
                widen(format, panel, k, q0, q0 + WIDE_ROWS, 1, wide, &p0, &p1);
            for (int64_t r0 = 0; r0 < rows; r0 += MR) {
                const float *ar[MR] = {0};
                float *cr[MR] = {0};
                for (int r = 0; r < MR && r0 + r < rows; r++) ar[r] = a[r0 + r] + p0, cr[r] = c[r0 + r] + j;
                run_tile(W_F32, ar, rows - r0 < MR ? rows - r0 : MR, wide, NULL, W_F32, p1 - p0, p1 - p0, 0, p1 - p0,
                         width / LANES, cr, q0 > 0);
            }
        }
    }
}

/* matmul_rows_as for a float32 matrix */
static inline __attribute__((always_inline)) void
matmul_rows(const float *const *a, int64_t rows, const float *w, int64_t k, int64_t n, int width, float *const *c) {
    matmul_rows_as(W_F32, a, rows, plain(w, k), k, n, width, c);
}

#endif
