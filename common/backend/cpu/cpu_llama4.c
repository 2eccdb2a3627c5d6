/* CPU kernels of the Llama-4 ops (backend.h "Llama-4 ops"): per-head RMS norm, row scaling, MoE
 * routing / grouped GEMM / combine, pixel shuffle. Reference semantics for the CUDA versions.
 * The heavy ones (the grouped GEMM, and the row ops once large) run on the backend's pool like
 * every other op: OpenBLAS is single-threaded inside each pool thread (cpu_backend.c). */
#include "backend/cpu/cpu_impl.h"

#include <cblas.h>
#include <math.h>

/* Row ops split over the pool: rows [r0, r1) per thread. */
typedef enum { L4_HEAD_RMSNORM, L4_SCALE_ROWS, L4_COMBINE } l4_op_t;

typedef struct {
    l4_op_t op;
    const prism_cpu_kern_t *k;
    float *x; int ld;
    const float *w, *s, *src;
    const int32_t *slot;
    int n_rows, dim, n_heads, top_k;
    float eps;
} l4_rows_t;

static void l4_rows_worker(void *arg, int ith, int nth)
{
    const l4_rows_t *t = arg;
    int r0 = (int)((long)t->n_rows * ith / nth), r1 = (int)((long)t->n_rows * (ith + 1) / nth);
    const prism_cpu_kern_t *k = t->k;
    for (int r = r0; r < r1; r++) {
        switch (t->op) {
        case L4_HEAD_RMSNORM: {   /* row r = (token r / n_heads, head r % n_heads) */
            float *v = t->x + (size_t)(r / t->n_heads) * t->ld + (size_t)(r % t->n_heads) * t->dim;
            k->rmsnorm(v, v, t->w, t->dim, t->eps);
            break;
        }
        case L4_SCALE_ROWS: {
            float *v = t->x + (size_t)r * t->ld;
            k->scale(v, v, t->s[r], (size_t)t->dim);
            break;
        }
        case L4_COMBINE: {        /* in i order, as the reference */
            float *y = t->x + (size_t)r * t->ld;
            for (int i = 0; i < t->top_k; i++)
                k->add(y, y, t->src + (size_t)t->slot[(size_t)r * t->top_k + i] * t->dim, (size_t)t->dim);
            break;
        }
        }
    }
}

static void l4_rows_run(prism_cpu_ctx_t *c, l4_rows_t *t, size_t work)
{
    t->k = c->k;
    int nth = prism_cpu_nth(c, work, PRISM_CPU_EW_GRAIN);
    if (nth > t->n_rows) nth = t->n_rows;
    prism_cpu_pool_run(&c->pool, nth < 1 ? 1 : nth, l4_rows_worker, t);
}

int prism_cpu_head_rmsnorm(void *ctx, float *x, int ld, int n_tokens, int n_heads, int head_dim, const float *w,
                           float eps)
{
    if (n_tokens < 0 || n_heads <= 0 || head_dim <= 0 || (long)ld < (long)n_heads * head_dim ||
        (long)n_tokens * n_heads > INT32_MAX)
        return PRISM_EINVAL;
    if (n_tokens == 0) return PRISM_OK;
    l4_rows_t t = {.op = L4_HEAD_RMSNORM, .x = x, .ld = ld, .w = w, .n_rows = n_tokens * n_heads, .dim = head_dim,
                   .n_heads = n_heads, .eps = eps};
    l4_rows_run(ctx, &t, (size_t)n_tokens * n_heads * head_dim * 2);
    return PRISM_OK;
}

int prism_cpu_scale_rows(void *ctx, float *x, int ld, int n_rows, int dim, const float *s)
{
    if (n_rows < 0 || dim < 0 || ld < dim) return PRISM_EINVAL;
    if (n_rows == 0 || dim == 0) return PRISM_OK;
    l4_rows_t t = {.op = L4_SCALE_ROWS, .x = x, .ld = ld, .s = s, .n_rows = n_rows, .dim = dim};
    l4_rows_run(ctx, &t, (size_t)n_rows * dim);
    return PRISM_OK;
}

int prism_cpu_moe_route(void *ctx, const float *logits, int n_tokens, int n_experts, int top_k, int32_t *choice,
                        int32_t *order, float *weight, int32_t *offsets, int32_t *slot)
{
    if (n_tokens < 0 || n_experts <= 0 || top_k <= 0 || top_k > n_experts || top_k > PRISM_MOE_MAX_TOPK)
        return PRISM_EINVAL;
    for (int e = 0; e <= n_experts; e++) offsets[e] = 0;
    for (int t = 0; t < n_tokens; t++) {
        const float *l = logits + (size_t)t * n_experts;
        int32_t *ch = choice + (size_t)t * top_k;
        /* Selection by repeated max: k is 1 or 2 in practice. Strict '>' keeps the lower index on ties. */
        for (int i = 0; i < top_k; i++) {
            int best = -1;
            for (int e = 0; e < n_experts; e++) {
                bool taken = false;
                for (int j = 0; j < i; j++) taken = taken || ch[j] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            ch[i] = best;
            offsets[best + 1]++;
        }
    }
    for (int e = 0; e < n_experts; e++) offsets[e + 1] += offsets[e];
    /* Stable placement: rows of one expert in token order. offsets[e] serves as the cursor and is
     * restored after. */
    for (int t = 0; t < n_tokens; t++)
        for (int i = 0; i < top_k; i++) {
            int e = choice[(size_t)t * top_k + i];
            int r = offsets[e]++;
            order[r] = t;
            float z = logits[(size_t)t * n_experts + e];
            weight[r] = 1.0f / (1.0f + expf(-z));
            slot[(size_t)t * top_k + i] = r;
        }
    for (int e = n_experts; e > 0; e--) offsets[e] = offsets[e - 1];
    offsets[0] = 0;
    return PRISM_OK;
}

/* Grouped GEMM: each thread takes a slice of the output columns (whole 16-column groups) of every
 * group, so a decode step whose few rows all go to one expert still spreads that expert's weights
 * over the threads. W_e is [K][N] (x @ W): a slice is a strided block of it. One row (decode)
 * uses sgemv, which streams the slice once; OpenBLAS sgemm would pack it first. bf16 weights are
 * widened chunk by chunk (columns of every row of the slice) into the thread's scratch first. */
typedef struct {
    const prism_cpu_kern_t *k;
    float *y; int ldy;
    const float *x; int ldx;
    const void *w;                /* fp32, or bf16 when widen */
    const int32_t *offsets;
    int n_groups, N, K;
    float *widen;                 /* bf16 weights: the per-thread widen scratch; NULL: fp32 */
    int cw;                       /* bf16: columns widened per chunk */
} mmg_task_t;

/* y[m][:n] = x[m][:K] @ W[:K][:n] for W fp32 with row stride ldw. */
static void mmg_block(float *y, int ldy, const float *x, int ldx, const float *w, int ldw, int m, int n, int K)
{
    if (m == 1)
        cblas_sgemv(CblasRowMajor, CblasTrans, K, n, 1.0f, w, ldw, x, 1, 0.0f, y, 1);
    else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, K, 1.0f, x, ldx, w, ldw, 0.0f, y, ldy);
}

static void mmg_worker(void *arg, int ith, int nth)
{
    const mmg_task_t *t = arg;
    int groups16 = (t->N + 15) / 16;
    int n0 = PRISM_MIN(t->N, (int)((long)groups16 * ith / nth) * 16);
    int n1 = PRISM_MIN(t->N, (int)((long)groups16 * (ith + 1) / nth) * 16);
    if (n0 >= n1) return;
    for (int e = 0; e < t->n_groups; e++) {
        int r0 = t->offsets[e], m = t->offsets[e + 1] - r0;
        if (m == 0) continue;
        const float *x = t->x + (size_t)r0 * t->ldx;
        float *y = t->y + (size_t)r0 * t->ldy + n0;
        size_t off = (size_t)e * t->K * t->N + n0;
        if (!t->widen) {
            mmg_block(y, t->ldy, x, t->ldx, (const float *)t->w + off, t->N, m, n1 - n0, t->K);
            continue;
        }
        const uint16_t *we = (const uint16_t *)t->w + off;
        float *buf = t->widen + (size_t)ith * PRISM_CPU_WIDEN_FLOATS;
        for (int c0 = 0; c0 < n1 - n0; c0 += t->cw) {
            int c = PRISM_MIN(t->cw, n1 - n0 - c0);
            for (int k = 0; k < t->K; k++) t->k->bf16_to_f32(buf + (size_t)k * c, we + (size_t)k * t->N + c0, (size_t)c);
            mmg_block(y + c0, t->ldy, x, t->ldx, buf, c, m, c, t->K);
        }
    }
}

int prism_cpu_matmul_grouped(void *ctx, float *y, int ldy, const float *x, int ldx, const void *w, prism_dtype_t wdt,
                             const int32_t *offsets, int n_groups, int M, int N, int K)
{
    prism_cpu_ctx_t *c = ctx;
    bool bf16 = wdt == PRISM_DTYPE_BF16;
    int cw = bf16 && c->widen_scratch ? prism_cpu_widen_cols(c, K) : 0;
    if (wdt != PRISM_DTYPE_F32 && !cw) return PRISM_ENOTSUP;
    if (n_groups <= 0 || M < 0 || N <= 0 || K <= 0 || ldy < N || ldx < K || offsets[0] != 0 || offsets[n_groups] != M)
        return PRISM_EINVAL;
    for (int e = 0; e < n_groups; e++)   /* all checked before any thread writes */
        if (offsets[e + 1] < offsets[e]) return PRISM_EINVAL;
    if (M == 0) return PRISM_OK;
    int nth = prism_cpu_nth(c, (size_t)M * N * K, PRISM_CPU_MATMUL_GRAIN);
    nth = PRISM_MIN(nth, (N + 15) / 16);
    mmg_task_t t = {c->k, y, ldy, x, ldx, w, offsets, n_groups, N, K, bf16 ? c->widen_scratch : NULL, cw};
    prism_cpu_pool_run(&c->pool, nth, mmg_worker, &t);
    return PRISM_OK;
}

int prism_cpu_moe_combine(void *ctx, float *y, int ldy, const float *src, const int32_t *slot, int n_tokens, int top_k,
                          int dim)
{
    if (n_tokens < 0 || top_k <= 0 || dim <= 0 || ldy < dim) return PRISM_EINVAL;
    if (n_tokens == 0) return PRISM_OK;
    l4_rows_t t = {.op = L4_COMBINE, .x = y, .ld = ldy, .src = src, .slot = slot, .n_rows = n_tokens, .dim = dim,
                   .top_k = top_k};
    l4_rows_run(ctx, &t, (size_t)n_tokens * top_k * dim);
    return PRISM_OK;
}

int prism_cpu_pixel_shuffle(void *ctx, float *out, const float *x, int n_img, int rows_per_img, int g, int C, int s)
{
    if (n_img < 0 || g <= 0 || C <= 0 || s <= 0 || g % s || rows_per_img < g * g) return PRISM_EINVAL;
    int go = g / s;
    for (int i = 0; i < n_img; i++)
        for (int h2 = 0; h2 < go; h2++)
            for (int w2 = 0; w2 < go; w2++) {
                float *o = out + ((size_t)i * go * go + (size_t)h2 * go + w2) * s * s * C;
                for (int dh = 0; dh < s; dh++)
                    for (int dw = 0; dw < s; dw++) {
                        const float *src = x + ((size_t)i * rows_per_img + (size_t)(s * h2 + dh) * g + s * w2 + dw) * C;
                        memcpy(o + (size_t)(dh * s + dw) * C, src, (size_t)C * sizeof(float));
                    }
            }
    return PRISM_OK;
}
