/* Batched LoRA on CPU: for each segment (start, end, slot) of a batch's rows,
 *     y[start:end] += (x[start:end] @ A[slot][:rank]^T) @ B[slot][:, :rank]^T
 * summed in float32 and rounded once into y (float32 or bfloat16, updated in place); x float32 or bfloat16,
 * A (slots, R, in) and B (slots, out, R) float32, the first `rank` of R ranks used. Rows in no segment are
 * left alone. Each slot's rows are multiplied by its own matrices where they lie in the batch: no gather of
 * the rows, no copy of the weights.
 *
 * Two passes over the segments' rows, in one parallel region (none for small products):
 * - shrink: t = x @ A^T (rows, rank), dot products along `in`: a tile of SHRINK_ROWS rows by SHRINK_RANKS
 *   ranks loads each x and A vector once for all its products. Tasks: row tiles, and where they are fewer
 *   than the threads (decode), groups of ranks too.
 * - expand: y += t @ B^T, PANEL outputs at a time. B's rows of those outputs are transposed (in registers,
 *   LANES x LANES at a time) into a (rank, PANEL) panel, which tiles.h's tiles multiply by up to MR rows of
 *   t at once. One or two rows instead sum each output's products along the ranks and gather LANES
 *   outputs' sums with half a transpose's shuffles. Tasks: chunks of EXPAND_ROWS rows by groups of
 *   outputs, enough of them for every thread at one row.
 */
#include <omp.h>
#include <stdlib.h>

#define TILE_FUNCTIONS /* (tiles as functions of their own: inlined, 16-register builds spill their sums) */
#include "tiles.h"

#define SHRINK_ROWS 4
#define SHRINK_RANKS (REGISTERS >= 32 ? 4 : 2) /* SHRINK_ROWS x this accumulators, + the rows' x, + 1 */
#define EXPAND_ROWS (8 * MR)                  /* rows per expand task: each panel transposed once for them */
#define PARALLEL_FROM (1 << 16)               /* multiply-adds: below this, one thread */

/* Runs the statements with the constant NR equal to nr (1 ... SHRINK_ROWS): a copy of them per tile height. */
#define WITH_SHRINK_ROWS(nr, ...)                         \
    switch (nr) {                                         \
        case 1: { const int NR = 1; __VA_ARGS__; } break; \
        case 2: { const int NR = 2; __VA_ARGS__; } break; \
        case 3: { const int NR = 3; __VA_ARGS__; } break; \
        default: { const int NR = 4; __VA_ARGS__; } break; \
    }
_Static_assert(SHRINK_ROWS == 4, "WITH_SHRINK_ROWS");

/* bfloat16 as stored (its bits) */
typedef uint16_t hvec __attribute__((vector_size(LANES * 2)));

static inline vec load_bf16(const uint16_t *p) {
    hvec h;
    memcpy(&h, p, sizeof h);
    const uvec bits = __builtin_convertvector(h, uvec) << 16;
    vec v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* v rounded to bfloat16, to nearest even (NaN stays NaN), as torch rounds */
static inline void store_bf16(uint16_t *p, vec v) {
    uvec bits;
    memcpy(&bits, &v, sizeof bits);
    const uvec rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const ivec nan = v != v;
    const hvec h = __builtin_convertvector((uvec)(((ivec)rounded & ~nan) | (0x7FC0 & nan)), hvec);
    memcpy(p, &h, sizeof h);
}

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* n < LANES values from p (float32 or bfloat16), the other lanes 0 */
static inline vec load_part(const void *p, int n, int bf16) {
    float part[LANES] = {0};
    for (int j = 0; j < n; j++) part[j] = bf16 ? bf16_to_float(((const uint16_t *)p)[j]) : ((const float *)p)[j];
    return load(part);
}

static inline void store_part(void *p, int n, int bf16, vec v) {
    if (!bf16) {
        memcpy(p, &v, n * sizeof(float));
        return;
    }
    uint16_t part[LANES];
    store_bf16(part, v);
    memcpy(p, part, n * sizeof(uint16_t));
}

/* y[0 : n] += v[0 : n], y float32 or bfloat16, n <= LANES */
static inline void add_to(void *y, int n, int bf16, vec v) {
    if (n < LANES)
        store_part(y, n, bf16, load_part(y, n, bf16) + v);
    else if (bf16)
        store_bf16(y, load_bf16(y) + v);
    else
        store(y, load(y) + v);
}

/* t[r][j] = xr[r] . ar[j] over `in`, for r < NR rows and j < nk ranks (the tile computes SHRINK_RANKS:
 * ar's last ones repeated) */
static inline __attribute__((always_inline)) void shrink_tile(const float *const *xr, const int NR,
                                                              const float *const *ar, int nk, int64_t in,
                                                              float *const *t) {
    vec acc[SHRINK_ROWS][SHRINK_RANKS];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < SHRINK_RANKS; j++) acc[r][j] = splat(0.0f);
    int64_t k = 0;
    for (; k + LANES <= in; k += LANES) {
        vec xv[SHRINK_ROWS];
        for (int r = 0; r < NR; r++) {
            xv[r] = load(xr[r] + k);
            IN_REGISTER(xv[r]);
        }
        for (int j = 0; j < SHRINK_RANKS; j++) {
            vec a = load(ar[j] + k);
            IN_REGISTER(a);
            for (int r = 0; r < NR; r++) acc[r][j] += xv[r] * a;
        }
    }
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < nk; j++) {
            float sum = hsum(acc[r][j]);
            for (int64_t i = k; i < in; i++) sum += xr[r][i] * ar[j][i];
            t[r][j] = sum;
        }
}

/* Exchanges, between rows i and i + d of a LANES x LANES matrix (i's bit d clear), the elements whose
 * column has bit d set in row i and clear in row i + d; done for every power of two d < LANES, the matrix
 * is transposed. */
#define SWAP_LO(l, d) (((l) & (d)) ? LANES + (l) - (d) : (l))
#define SWAP_HI(l, d) (((l) & (d)) ? LANES + (l) : (l) + (d))
#if LANES == 16
#define EACH_LANE(F, d) \
    F(0, d), F(1, d), F(2, d), F(3, d), F(4, d), F(5, d), F(6, d), F(7, d), F(8, d), F(9, d), F(10, d), F(11, d), \
        F(12, d), F(13, d), F(14, d), F(15, d)
#elif LANES == 8
#define EACH_LANE(F, d) F(0, d), F(1, d), F(2, d), F(3, d), F(4, d), F(5, d), F(6, d), F(7, d)
#else
#define EACH_LANE(F, d) F(0, d), F(1, d), F(2, d), F(3, d)
#endif
#define SWAP_BIT(v, d)                                                             \
    _Pragma("GCC unroll 16") for (int i = 0; i < LANES; i++)                       \
        if (!(i & (d))) {                                                          \
            const vec a = v[i], b = v[i + (d)];                                    \
            v[i] = __builtin_shufflevector(a, b, EACH_LANE(SWAP_LO, d));           \
            v[i + (d)] = __builtin_shufflevector(a, b, EACH_LANE(SWAP_HI, d));     \
        }

static inline __attribute__((always_inline)) void transpose(vec v[LANES]) {
#if LANES == 16
    SWAP_BIT(v, 8)
#endif
#if LANES >= 8
    SWAP_BIT(v, 4)
#endif
    SWAP_BIT(v, 2)
    SWAP_BIT(v, 1)
}

/* v[0][l] = the sum of v[l]'s lanes, for every l < LANES: rows paired as SWAP_BIT pairs them, and each
 * pair's two exchanged rows added, which halves the rows every step */
#define FOLD_BIT(v, d)                                                                              \
    _Pragma("GCC unroll 16") for (int i = 0; i < (d); i++)                                          \
        v[i] = __builtin_shufflevector(v[i], v[i + (d)], EACH_LANE(SWAP_LO, d)) +                   \
               __builtin_shufflevector(v[i], v[i + (d)], EACH_LANE(SWAP_HI, d));

static inline __attribute__((always_inline)) void fold_rows(vec v[LANES]) {
#if LANES == 16
    FOLD_BIT(v, 8)
#endif
#if LANES >= 8
    FOLD_BIT(v, 4)
#endif
    FOLD_BIT(v, 2)
    FOLD_BIT(v, 1)
}

/* y[0 : n] += t[0 : rank] @ b^T for one row: b, B's rows of the n <= LANES outputs, R floats apart. Each
 * output's products with t summed along the ranks, then the LANES outputs' sums gathered into one vector
 * by fold_rows. */
static inline __attribute__((always_inline)) void expand_row(const float *t, const float *b, int64_t R,
                                                             int64_t rank, int n, void *y, int bf16) {
    const float *row[LANES];
    for (int j = 0; j < LANES; j++) row[j] = b + (j < n ? j : n - 1) * R;
    vec v[LANES];
#pragma GCC unroll 16
    for (int j = 0; j < LANES; j++) v[j] = splat(0.0f);
    int64_t c = 0;
    for (; c + LANES <= rank; c += LANES) {
        const vec tv = load(t + c);
#pragma GCC unroll 16
        for (int j = 0; j < LANES; j++) v[j] += tv * load(row[j] + c);
    }
    if (c < rank) { /* the last ranks: lanes past them are 0, whatever B holds there */
        const vec tv = load_part(t + c, rank - c, 0);
        const ivec keep = lane_index() < (float)(rank - c);
#pragma GCC unroll 16
        for (int j = 0; j < LANES; j++)
            v[j] += vselect(keep, tv * (c + LANES <= R ? load(row[j] + c) : load_part(row[j] + c, R - c, 0)),
                            splat(0.0f));
    }
    fold_rows(v);
    add_to(y, n, bf16, v[0]);
}

/* panel[q][0 : width] = B[0 : n, q] for q < rank: b, B's rows of the n <= width outputs, R floats apart
 * (the last one repeated up to width) */
static void transpose_panel(const float *b, int n, int64_t R, int64_t rank, int width, float *panel) {
    for (int g = 0; g < width; g += LANES) {
        const float *row[LANES];
        for (int j = 0; j < LANES; j++) row[j] = b + (g + j < n ? g + j : n - 1) * R;
        for (int64_t c = 0; c < rank; c += LANES) {
            vec v[LANES];
            if (c + LANES <= R)
#pragma GCC unroll 16
                for (int j = 0; j < LANES; j++) v[j] = load(row[j] + c);
            else /* (the last of R's columns: no reading past B's last row) */
#pragma GCC unroll 16
                for (int j = 0; j < LANES; j++) v[j] = load_part(row[j] + c, R - c, 0);
            transpose(v);
            const int nq = rank - c < LANES ? rank - c : LANES;
#pragma GCC unroll 16
            for (int q = 0; q < LANES; q++) {
                if (q == nq) break;
                store(panel + (c + q) * width + g, v[q]);
            }
        }
    }
}

/* floats of scratch each thread needs (the caller provides threads times this): bfloat16 x's rows of a
 * shrink tile, or an expand task's panel and the products of a tile of bfloat16 y */
int64_t lora_scratch_floats(int64_t in, int64_t rank, int bf16) {
    const int64_t expand = (rank + MR) * PANEL, shrink = bf16 ? SHRINK_ROWS * in : 0;
    return expand > shrink ? expand : shrink;
}

typedef struct {
    int64_t start, end, slot;
} segment_t;

typedef struct {
    const void *x;
    int64_t x_stride;
    void *y;
    int64_t y_stride;
    int bf16;
    int64_t in, out;
    const float *A, *B;
    int64_t R, rank;
    const segment_t *segments;
    int64_t count;
    float *t; /* (rows, rank) */
    float *scratch;
} lora_t;

static float *thread_scratch(const lora_t *p) {
    return p->scratch + (int64_t)omp_get_thread_num() * lora_scratch_floats(p->in, p->rank, p->bf16);
}

/* y[row0 : row0 + nr][o : o + n] += t[those rows] @ B[o : o + n, :rank]^T, n <= width (PANEL or LANES): b,
 * B's row o. B's rows transposed into a panel once, then multiplied by tiles of up to MR rows of t; float32
 * y of a whole panel accumulates in place, bfloat16 y and a part of a panel take the tile's products. */
static void expand_panel(const lora_t *p, const float *b, int64_t o, int n, int width, int64_t row0, int64_t nr) {
    float *panel = thread_scratch(p), *products = panel + p->rank * PANEL;
    transpose_panel(b, n, p->R, p->rank, width, panel);
    const int direct = !p->bf16 && n == width;
    const int size = p->bf16 ? 2 : 4;
    for (int64_t r0 = 0; r0 < nr; r0 += MR) {
        const int rows = nr - r0 < MR ? nr - r0 : MR;
        const float *a[MR];
        float *c[MR];
        for (int r = 0; r < rows; r++) {
            a[r] = p->t + (row0 + r0 + r) * p->rank;
            c[r] = direct ? (float *)p->y + (row0 + r0 + r) * p->y_stride + o : products + r * width;
        }
        run_tile(W_F32, a, rows, panel, NULL, W_F32, p->rank, p->rank, 0, p->rank, width / LANES, c, direct);
        if (direct) continue;
        for (int r = 0; r < rows; r++) {
            char *y = (char *)p->y + ((row0 + r0 + r) * p->y_stride + o) * size;
            for (int j = 0; j < n; j += LANES)
                add_to(y + j * size, n - j < LANES ? n - j : LANES, p->bf16, load(c[r] + j));
        }
    }
}

/* first[s]: the number of tiles of `height` rows in the segments before s, s <= count */
static void tile_counts(const segment_t *segments, int64_t count, int64_t height, int64_t *first) {
    first[0] = 0;
    for (int64_t s = 0; s < count; s++)
        first[s + 1] = first[s] + (segments[s].end - segments[s].start + height - 1) / height;
}

/* the segment holding tile `task` of the ones tile_counts numbered (first[0] <= task < first[count]) */
static int64_t segment_of(const int64_t *first, int64_t count, int64_t task) {
    int64_t lo = 0, hi = count - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (first[mid] <= task)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* t of the segments' rows, tasks shared out over the threads of the parallel region it is called in */
static void shrink_tasks(const lora_t *p, const int64_t *first, int64_t groups) {
    const int64_t blocks = (p->rank + SHRINK_RANKS - 1) / SHRINK_RANKS, tiles = first[p->count];
    const int64_t per_group = (blocks + groups - 1) / groups;
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tiles * groups; task++) {
        const int64_t tile = task / groups, group = task % groups, s = segment_of(first, p->count, tile);
        const segment_t seg = p->segments[s];
        const int64_t row0 = seg.start + (tile - first[s]) * SHRINK_ROWS;
        const int nr = seg.end - row0 < SHRINK_ROWS ? seg.end - row0 : SHRINK_ROWS;
        const float *xr[SHRINK_ROWS];
        if (p->bf16) { /* the tile's rows widened once for all its ranks */
            float *rows = thread_scratch(p);
            for (int r = 0; r < nr; r++) {
                const uint16_t *src = (const uint16_t *)p->x + (row0 + r) * p->x_stride;
                float *dst = rows + r * p->in;
                int64_t k = 0;
                for (; k + LANES <= p->in; k += LANES) store(dst + k, load_bf16(src + k));
                for (; k < p->in; k++) dst[k] = bf16_to_float(src[k]);
                xr[r] = dst;
            }
        } else {
            for (int r = 0; r < nr; r++) xr[r] = (const float *)p->x + (row0 + r) * p->x_stride;
        }
        const float *a = p->A + seg.slot * p->R * p->in;
        const int64_t end = (group + 1) * per_group < blocks ? (group + 1) * per_group : blocks;
        for (int64_t block = group * per_group; block < end; block++) {
            const int64_t r0 = block * SHRINK_RANKS;
            const int nk = p->rank - r0 < SHRINK_RANKS ? p->rank - r0 : SHRINK_RANKS;
            const float *ar[SHRINK_RANKS];
            float *t[SHRINK_ROWS];
            for (int j = 0; j < SHRINK_RANKS; j++) ar[j] = a + (r0 + (j < nk ? j : nk - 1)) * p->in;
            for (int r = 0; r < nr; r++) t[r] = p->t + (row0 + r) * p->rank + r0;
            WITH_SHRINK_ROWS(nr, shrink_tile(xr, NR, ar, nk, p->in, t));
        }
    }
}

/* y of the segments' rows, from t; tasks shared out as shrink_tasks' */
static void expand_tasks(const lora_t *p, const int64_t *first, int64_t groups) {
    const int64_t panels = (p->out + PANEL - 1) / PANEL, tiles = first[p->count];
    const int64_t per_group = (panels + groups - 1) / groups, size = p->bf16 ? 2 : 4;
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tiles * groups; task++) {
        const int64_t tile = task / groups, group = task % groups, s = segment_of(first, p->count, tile);
        const segment_t seg = p->segments[s];
        const int64_t row0 = seg.start + (tile - first[s]) * EXPAND_ROWS;
        const int64_t nr = seg.end - row0 < EXPAND_ROWS ? seg.end - row0 : EXPAND_ROWS;
        const float *b = p->B + seg.slot * p->out * p->R;
        const int64_t end = (group + 1) * per_group < panels ? (group + 1) * per_group : panels;
        for (int64_t o = group * per_group * PANEL; o < end * PANEL && o < p->out;) {
            const int n = p->out - o < PANEL ? p->out - o : PANEL;
            if (nr <= 2) { /* (row by row: a panel's transpose would cost more than it saves) */
                for (int64_t r = row0; r < row0 + nr; r++)
                    for (int j = 0; j < n; j += LANES)
                        expand_row(p->t + r * p->rank, b + (o + j) * p->R, p->R, p->rank, n - j < LANES ? n - j : LANES,
                                   (char *)p->y + (r * p->y_stride + o + j) * size, p->bf16);
                o += n;
            } else if (n == PANEL) {
                expand_panel(p, b + o * p->R, o, PANEL, PANEL, row0, nr);
                o += PANEL;
            } else { /* the last outputs, less than a panel: vector by vector */
                const int part = n < LANES ? n : LANES;
                expand_panel(p, b + o * p->R, o, part, LANES, row0, nr);
                o += part;
            }
        }
    }
}

/* y += the LoRA products of x's rows in `segments` (count of them, (start, end, slot) each, in row order);
 * x (rows, in) and y (rows, out) rows x_stride and y_stride elements apart, both float32 or both bfloat16
 * (bf16); t: scratch for rows * rank floats, scratch: threads * lora_scratch_floats(in, rank, bf16) floats.
 * Returns 0, or 1 where a segment is out of bounds (rows, slots), 2 where they are not in row order or
 * overlap (nothing is computed then). */
int lora_add(const void *x, int64_t x_stride, void *y, int64_t y_stride, int bf16, int64_t rows, int64_t in,
             int64_t out, const float *A, const float *B, int64_t slots, int64_t R, int64_t rank,
             const int64_t *segments, int64_t count, float *t, float *scratch, int threads) {
    const segment_t *seg = (const segment_t *)segments;
    int64_t covered = 0;
    for (int64_t s = 0; s < count; s++) {
        if (seg[s].start < 0 || seg[s].end > rows || seg[s].start > seg[s].end || seg[s].slot < 0 ||
            seg[s].slot >= slots)
            return 1;
        if (s > 0 && seg[s].start < seg[s - 1].end) return 2;
        covered += seg[s].end - seg[s].start;
    }
    if (covered == 0 || rank <= 0) return 0;
    int64_t *first = malloc(2 * (count + 1) * sizeof *first);
    tile_counts(seg, count, SHRINK_ROWS, first);
    tile_counts(seg, count, EXPAND_ROWS, first + count + 1);
    const lora_t p = {x, x_stride, y, y_stride, bf16, in, out, A, B, R, rank, seg, count, t, scratch};
    /* groups of ranks and of outputs per row tile: work for every thread however few the rows */
    const int64_t rank_blocks = (rank + SHRINK_RANKS - 1) / SHRINK_RANKS, panels = (out + PANEL - 1) / PANEL;
    const int64_t shrink_tiles = first[count], expand_tiles = first[2 * count + 1];
    int64_t rank_groups = (threads + shrink_tiles - 1) / shrink_tiles, out_groups = 4 * threads / expand_tiles;
    rank_groups = rank_groups < rank_blocks ? rank_groups : rank_blocks;
    out_groups = out_groups < 1 ? 1 : out_groups < panels ? out_groups : panels;
    if (covered * rank * (in + out) < PARALLEL_FROM) { /* (outside a parallel region: its start costs ~1 us) */
        shrink_tasks(&p, first, rank_groups);
        expand_tasks(&p, first + count + 1, out_groups);
    } else {
#pragma omp parallel num_threads(threads)
        {
            shrink_tasks(&p, first, rank_groups);
            expand_tasks(&p, first + count + 1, out_groups);
        }
    }
    free(first);
    return 0;
}
