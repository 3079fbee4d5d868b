/* Causal attention of a batch's new tokens over their requests' paged K/V, float32 on CPU, in one call
 * for every request, head and token: prefill (extend) and decode alike.
 *
 * Request b has seq_lens[b] tokens, of which the last ext_lens[b] are new (decode: 1); its queries are
 * rows q_starts[b] ... of q, and its tokens' K/V sit in the pool at slots kv_slots[b][0 : seq_lens[b]].
 * The new token i (0-based among the new ones) sees the first seq_lens[b] - ext_lens[b] + i + 1 tokens.
 *
 * A task is one request, one KV head and a block of its new tokens: the rows of the block's queries for
 * every query head sharing that KV head (grouped-query attention), at most MAX_ROWS. It walks the keys in
 * blocks of KEYS, as flash attention does: gathers the block's K transposed and its V into panels, takes
 * scores and the weighted sum of V as register-tiled products (tiles.h), and keeps each row's running
 * maximum and sum (online softmax), so that no score matrix longer than a block is ever held. Every task
 * takes this one path, whatever its number of rows: a row's result does not depend on how many new tokens
 * its request has (a seeded answer is the same with and without a prefix-cache hit; a path of its own for
 * a few rows summed in another order and flipped a draw on a knife's edge).
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "tiles.h"

#define KEYS 64      /* keys per block: the width of one score panel */
#define MAX_ROWS 64  /* query rows per task */

/* floats of scratch one thread needs for head_dim d (the caller provides threads times this) */
int64_t attention_scratch_floats(int64_t d) { return KEYS * d * 2 + MAX_ROWS * (KEYS + 2 * d + 2); }

/* One row's scores for a block of keys, s[0 : KEYS] of which the first `visible` count, become its
 * softmax weights against the running maximum (the rest 0); the row's sum and output o (d floats) are
 * rescaled to the new maximum. */
static inline void softmax_block(float *s, int64_t visible, float scale, float *row_max, float *row_sum, float *o,
                                 int64_t d) {
    if (visible <= 0) { /* a block past the row's last key (it has earlier keys: its maximum is finite) */
        memset(s, 0, KEYS * sizeof(float));
        return;
    }
    vec sv[KEYS / LANES];
    const vec lane = lane_index();
    vec top = splat(-INFINITY);
    for (int v = 0; v < KEYS / LANES; v++) {
        sv[v] = vselect(lane + (float)(v * LANES) < (float)visible, load(s + v * LANES) * scale, splat(-INFINITY));
        top = vmax(sv[v], top);
    }
    const float new_max = fmaxf(*row_max, hmax(top));
    const float alpha = expf(*row_max - new_max);
    vec sum = splat(0.0f);
    for (int v = 0; v < KEYS / LANES; v++) {
        const vec p = vexp(sv[v] - new_max);
        sum += p;
        store(s + v * LANES, p);
    }
    *row_sum = *row_sum * alpha + hsum(sum);
    *row_max = new_max;
    if (alpha != 1.0f)
        for (int64_t i = 0; i < d; i++) o[i] *= alpha;
}

/* Asks for the K and V rows of keys j0 ... j0 + KEYS (fewer at the end) into L2 ahead of their use. In a
 * model the weights stream through the caches between two layers' attention, so every row comes from
 * memory, and a request's slots lie anywhere in the pool, where the hardware prefetchers cannot foresee
 * them. */
static inline void prefetch_block(const float *k_cache, const float *v_cache, const int32_t *slots, int64_t j0,
                                  int64_t keys, int64_t Hkv, int64_t h, int64_t D) {
    const int64_t end = j0 + KEYS < keys ? j0 + KEYS : keys;
    for (int64_t j = j0; j < end; j++) {
        const int64_t at = (slots[j] * Hkv + h) * D;
        for (int64_t c = 0; c < D; c += 16) { /* one 64-byte line at a time */
            __builtin_prefetch(k_cache + at + c, 0, 1);
            __builtin_prefetch(v_cache + at + c, 0, 1);
        }
    }
}

typedef struct {
    int64_t b, h, first, count; /* request, KV head, first new token and how many */
} task_t;

/* The batch's tasks, written to `tasks` (where not NULL); returns how many there are. */
static int64_t attention_plan(task_t *tasks, int64_t B, const int64_t *ext_lens, int64_t Hq, int64_t Hkv) {
    const int64_t G = Hq / Hkv, per_task = MAX_ROWS / G > 0 ? MAX_ROWS / G : 1;
    int64_t n = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t first = 0; first < ext_lens[b]; first += per_task)
            for (int64_t h = 0; h < Hkv; h++, n++) {
                const int64_t left = ext_lens[b] - first;
                if (tasks != NULL) tasks[n] = (task_t){b, h, first, left < per_task ? left : per_task};
            }
    return n;
}

/* The new tokens' K/V into the pool: token i's (Hkv, D) rows of k_new and v_new, k_stride and v_stride
 * floats apart (v a view inside the qkv output), to slot new_slots[i]. Shared out over the threads of the
 * parallel region it is called in. */
static void store_kv(float *k_cache, float *v_cache, int64_t Hkv, int64_t D, const float *k_new, int64_t k_stride,
                     const float *v_new, int64_t v_stride, const int64_t *new_slots, int64_t new_tokens) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < new_tokens; i++) {
        memcpy(k_cache + new_slots[i] * Hkv * D, k_new + i * k_stride, Hkv * D * sizeof(float));
        memcpy(v_cache + new_slots[i] * Hkv * D, v_new + i * v_stride, Hkv * D * sizeof(float));
    }
}

/* The tasks (attention_plan's), shared out over the threads of the parallel region it is called in,
 * each thread with its attention_scratch_floats(D) of `scratch`. */
static void attention_tasks(const task_t *tasks, int64_t n, const float *q, const float *k_cache,
                            const float *v_cache, const int32_t *kv_slots, int64_t stride, const int64_t *seq_lens,
                            const int64_t *ext_lens, const int64_t *q_starts, int64_t Hq, int64_t Hkv, int64_t D,
                            float scale, float *out, float *scratch) {
    const int64_t G = Hq / Hkv;
    const int width = D % PANEL == 0 ? PANEL : LANES; /* V panels */
    float *kt = scratch + (int64_t)omp_get_thread_num() * attention_scratch_floats(D);
    float *vp = kt + KEYS * D, *s = vp + KEYS * D, *pv = s + MAX_ROWS * KEYS, *o = pv + MAX_ROWS * D;
    float *row_max = o + MAX_ROWS * D, *row_sum = row_max + MAX_ROWS;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n; t++) {
        const task_t task = tasks[t];
        const int64_t rows = task.count * G, prefix = seq_lens[task.b] - ext_lens[task.b];
        const int32_t *slots = kv_slots + task.b * stride;
        const float *qrow[MAX_ROWS], *krow[KEYS], *vrow[KEYS];
        float *srow[MAX_ROWS], *pvrow[MAX_ROWS];
        for (int64_t r = 0; r < rows; r++) {
            qrow[r] = q + ((q_starts[task.b] + task.first + r / G) * Hq + task.h * G + r % G) * D;
            srow[r] = s + r * KEYS, pvrow[r] = pv + r * D;
            row_max[r] = -INFINITY, row_sum[r] = 0;
        }
        memset(o, 0, rows * D * sizeof(float));
        const int64_t keys = prefix + task.first + task.count; /* what the block's last token sees */
        prefetch_block(k_cache, v_cache, slots, 0, keys, Hkv, task.h, D);
        for (int64_t j0 = 0; j0 < keys; j0 += KEYS) {
            const int64_t nk = keys - j0 < KEYS ? keys - j0 : KEYS;
            prefetch_block(k_cache, v_cache, slots, j0 + KEYS, keys, Hkv, task.h, D);
            for (int64_t j = 0; j < nk; j++) {
                krow[j] = k_cache + (slots[j0 + j] * Hkv + task.h) * D;
                vrow[j] = v_cache + (slots[j0 + j] * Hkv + task.h) * D;
            }
            /* K^T as (D, KEYS) and V as (KEYS, D) in panels; keys past nk are 0 */
            for (int64_t j = 0; j < KEYS; j++) {
                float *col = kt + j / PANEL * D * PANEL + j % PANEL;
                for (int64_t d = 0; d < D; d++) col[d * PANEL] = j < nk ? krow[j][d] : 0.0f;
                for (int64_t c = 0; c < D; c += width) {
                    float *dst = vp + c * KEYS + j * width;
                    if (j < nk)
                        memcpy(dst, vrow[j] + c, width * sizeof(float));
                    else
                        memset(dst, 0, width * sizeof(float));
                }
            }
            matmul_rows(qrow, rows, kt, D, KEYS, PANEL, srow);
            for (int64_t r = 0; r < rows; r++) {
                const int64_t seen = prefix + task.first + r / G + 1 - j0; /* keys of this block it sees */
                softmax_block(srow[r], seen < nk ? seen : nk, scale, row_max + r, row_sum + r, o + r * D, D);
            }
            matmul_rows((const float *const *)srow, rows, vp, KEYS, D, width, pvrow);
            for (int64_t i = 0; i < rows * D; i++) o[i] += pv[i];
        }
        for (int64_t r = 0; r < rows; r++) {
            float *dst = out + (qrow[r] - q);
            const float inv = 1.0f / row_sum[r];
            for (int64_t d = 0; d < D; d++) dst[d] = o[r * D + d] * inv;
        }
    }
}

/* store_kv, then attention_tasks, on `threads` threads */
void paged_attention_f32(const float *q, float *k_cache, float *v_cache, const int32_t *kv_slots, int64_t stride,
                         const int64_t *seq_lens, const int64_t *ext_lens, const int64_t *q_starts, int64_t B,
                         int64_t Hq, int64_t Hkv, int64_t D, float scale, const float *k_new, int64_t k_stride,
                         const float *v_new, int64_t v_stride, const int64_t *new_slots, int64_t new_tokens,
                         float *out, float *scratch, int threads) {
    const int64_t n = attention_plan(NULL, B, ext_lens, Hq, Hkv);
    task_t *tasks = malloc((n > 0 ? n : 1) * sizeof *tasks);
    attention_plan(tasks, B, ext_lens, Hq, Hkv);
#pragma omp parallel num_threads(threads)
    {
        store_kv(k_cache, v_cache, Hkv, D, k_new, k_stride, v_new, v_stride, new_slots, new_tokens);
        attention_tasks(tasks, n, q, k_cache, v_cache, kv_slots, stride, seq_lens, ext_lens, q_starts, Hq, Hkv, D,
                        scale, out, scratch);
    }
    free(tasks);
}
