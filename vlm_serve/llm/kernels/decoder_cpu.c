/* A Qwen3 decoder layer on CPU in two calls, each one parallel region:
 * - the attention half: the residual add and input norm, the qkv projection, q and k normed and rotated,
 *   the new K/V into the pool, paged attention, the output projection, the residual add and the
 *   post-attention norm;
 * - the MLP half: the gated MLP, or the MoE's router, routing, experts and weighted sum.
 * Each step is the loop of the kernel that runs it alone (linear_cpu.c, rowwise_cpu.c, attention_cpu.c and
 * moe_cpu.c, compiled in here), shared out over the region's threads, which meet at a barrier between
 * steps. The sums are the same, in the same order, so the results equal those kernels' bit for bit; what
 * goes is the interpreter between them: a decode step made nine kernel calls a layer, with Python's tensor
 * bookkeeping around each and the threads woken for each.
 */
#define TILE_FUNCTIONS
#include "attention_cpu.c"
#include "linear_cpu.c"
#include "moe_cpu.c"
#include "rowwise_cpu.c"

/* A linear layer's weight as linear_forward takes it: its format, its panels and scales (tiles.h's
 * WEIGHT_ARGS), its N outputs and panel width, and its bias or NULL. */
#define LINEAR(p) int p##_format, WEIGHT_ARGS(p), int64_t p##_n, int p##_width, const float *p##_bias
#define WEIGHTS(p) WEIGHTS_OF(p), p##_format, p##_n, p##_width, p##_bias

/* Each half takes the layer's weights first (bound once, `CpuKernel.bind`), then the call's own tensors,
 * then the step's (the same for every layer of a forward: made C values once). */

/* The attention half of a layer over T tokens (hidden size H) of a batch of B requests.
 * In: x (T, H), the last sublayer's output, and residual (T, H), the stream before it (has_residual 0:
 * none yet, x is the stream). Out: residual = the stream after attention, h (T, H) = its
 * post-attention norm, the next half's input. Norm weights and eps as rms_norm_f32 takes them; q and
 * k are normed and rotated by cos and sin (T, D) as in qk_norm_rope_f32; the paged batch (k_cache ...
 * new_slots) as paged_attention_f32 takes it, with scratch `work`. qkv (T, (Hq + 2 Hkv) D), q (T, Hq D),
 * k (T, Hkv D), attn (T, Hq D) and o (T, H) are scratch. */
void attention_block_f32(const float *input_norm, const float *q_norm, const float *k_norm, const float *post_norm,
                         float eps, LINEAR(qkv), LINEAR(o), int64_t H, int64_t Hq, int64_t Hkv, int64_t D, float scale,
                         float *k_cache, float *v_cache, const float *x, float *residual, int has_residual, int64_t T,
                         const float *cos, const float *sin, const int32_t *kv_slots, int64_t stride,
                         const int64_t *seq_lens, const int64_t *ext_lens, const int64_t *q_starts, int64_t B,
                         const int64_t *new_slots, float *h, float *qkv, float *q, float *k, float *attn, float *o,
                         float *work, int threads) {
    const int64_t n = attention_plan(NULL, B, ext_lens, Hq, Hkv);
    task_t *tasks = malloc((n > 0 ? n : 1) * sizeof *tasks);
    attention_plan(tasks, B, ext_lens, Hq, Hkv);
#pragma omp parallel num_threads(threads)
    {
        add_rms_norm_rows(has_residual ? residual : x, has_residual ? x : NULL, T, H, input_norm, eps, residual, h);
        linear_tasks(h, T, H, H, WEIGHTS(qkv), qkv);
        qk_norm_rope_rows(qkv, T, qkv_n, Hq, Hkv, D, q_norm, k_norm, eps, cos, sin, q, k);
        store_kv(k_cache, v_cache, Hkv, D, k, Hkv * D, qkv + (Hq + Hkv) * D, qkv_n, new_slots, T);
        attention_tasks(tasks, n, q, k_cache, v_cache, kv_slots, stride, seq_lens, ext_lens, q_starts, Hq, Hkv, D,
                        scale, attn, work);
        linear_tasks(attn, T, Hq * D, Hq * D, WEIGHTS(o), o);
        add_rms_norm_rows(residual, o, T, H, post_norm, eps, residual, h);
    }
    free(tasks);
}

/* The gated MLP half: out (T, H) = down(silu(gate) * up) of h (T, H), with gate and up stacked in one
 * linear (gate_up_n = 2I outputs); gu (T, 2I) and act (T, I) are scratch. */
void mlp_block_f32(LINEAR(gate_up), LINEAR(down), int64_t H, int64_t T, const float *h, float *gu, float *act,
                   float *out, int threads) {
    const int64_t I = gate_up_n / 2;
#pragma omp parallel num_threads(threads)
    {
        linear_tasks(h, T, H, H, WEIGHTS(gate_up), gu);
        silu_and_mul_rows(gu, T, I, act);
        linear_tasks(act, T, I, I, WEIGHTS(down), out);
    }
}

/* The MoE half: out (T, H) = the experts' weighted sum for h (T, H) as moe_route_f32 and moe_forward
 * compute it, the router's logits for the E_all experts from its linear (router_n outputs: E_all and the
 * zero rows that make whole vectors). The experts (this rank's E from expert_start, intermediate size I)
 * in `format`, packed as moe_forward takes them. Scratch: logits (T, router_n); weights, expert, order,
 * pos (T K); starts (E + 2); task_expert and task_row (T K + E); ys (T K, H); gate_up (threads, 32
 * (moe_cpu.c's CHUNK), 2I). */
void moe_block_f32(LINEAR(router), int64_t E_all, int64_t K, int renormalize, int64_t expert_start, int64_t E,
                   int format, WEIGHT_ARGS(w13), int width13, WEIGHT_ARGS(w2), int width2, int64_t H, int64_t I, int64_t T, const float *h, float *logits, float *weights,
                   int64_t *expert, int64_t *order, int64_t *starts, int64_t *task_expert, int64_t *task_row,
                   int64_t *pos, float *ys, float *gate_up, float *out, int threads) {
    const Weights p13 = WEIGHTS_OF(w13), p2 = WEIGHTS_OF(w2);
    int64_t ntasks = 0;
#pragma omp parallel num_threads(threads)
    {
        linear_tasks(h, T, H, H, WEIGHTS(router), logits);
        route_rows(logits, router_n, T, E_all, K, renormalize, weights, expert);
#pragma omp single
        {
            group_pairs(expert, T * K, expert_start, E, order, starts);
            ntasks = plan_experts(order, starts, E, T * K, task_expert, task_row, pos);
        }
        experts_and_sum(format, h, T, K, order, starts, ntasks, task_expert, task_row, weights, p13, width13, p2,
                        width2, H, I, out, ys, pos, gate_up);
    }
}
