/* CPU backend: fp32 activations; weights fp32, or bf16 when asked (prism_backend_set_weight_dtype:
 * half the bytes a decode step streams); with --compute-dtype bf16 (prism_backend_set_compute_dtype)
 * the matmuls on bf16 weights round x to bf16 and run AVX-512 BF16 dot products, on weights the
 * model loader had packed into 16-column panels (weight_pack) where it could (on AVX-512 the
 * default fp32 compute packs bf16 weights too, and runs fp32 FMAs on them). Matmuls are
 * OpenBLAS sgemm (or a vectorised gemv for a few rows) on column slices spread over the backend's
 * own thread pool; attention is tiled matrix products (cpu_attn.c); elementwise and row ops run
 * the kernel table chosen at create for this CPU (cpu_kern.h: scalar / AVX2 / AVX-512 / AVX-512
 * BF16), split over the pool once they are big enough to pay
 * for the hand-off. It is the reference other backends are tested against: every vector path
 * equals the scalar one within fp32 rounding (tests/unit/model/test_backend_cpu.c). */
#include "backend/cpu/cpu_impl.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define POOL_HDR 256  /* per-allocation header: keeps 256-byte alignment and stores the size */

static const char *cpu_name(void *ctx) { (void)ctx; return "cpu"; }

/* ---- memory ---- */

static void *cpu_alloc(void *vctx, size_t bytes)
{
    prism_cpu_ctx_t *c = vctx;
    if (bytes > SIZE_MAX - POOL_HDR) return NULL;
    pthread_mutex_lock(&c->mem_mu);
    bool ok = !c->pool_cap || c->pool_used + bytes <= c->pool_cap;
    if (ok) {
        c->pool_used += bytes;
        if (c->pool_used > c->pool_peak) c->pool_peak = c->pool_used;
    }
    pthread_mutex_unlock(&c->mem_mu);
    if (!ok) return NULL;
    uint8_t *raw = prism_malloc_aligned(bytes + POOL_HDR, POOL_HDR);
    if (!raw) {
        pthread_mutex_lock(&c->mem_mu);
        c->pool_used -= bytes;
        pthread_mutex_unlock(&c->mem_mu);
        return NULL;
    }
    memcpy(raw, &bytes, sizeof bytes);
    return raw + POOL_HDR;
}

static void cpu_free(void *vctx, void *p)
{
    prism_cpu_ctx_t *c = vctx;
    if (!p) return;
    uint8_t *raw = (uint8_t *)p - POOL_HDR;
    size_t bytes;
    memcpy(&bytes, raw, sizeof bytes);
    pthread_mutex_lock(&c->mem_mu);
    c->pool_used -= bytes;
    /* packed weights inside the block go with it (sorted: one run) */
    int a = 0, e;
    while (a < c->n_packed && c->packed[a].p < (const uint8_t *)p) a++;
    for (e = a; e < c->n_packed && c->packed[e].p < (const uint8_t *)p + bytes; e++) {}
    if (e > a) {
        memmove(c->packed + a, c->packed + e, (size_t)(c->n_packed - e) * sizeof *c->packed);
        c->n_packed -= e - a;
    }
    pthread_mutex_unlock(&c->mem_mu);
    prism_free_aligned(raw);
}

static size_t cpu_pool_used(void *vctx) { prism_cpu_ctx_t *c = vctx; return c->pool_used; }
static size_t cpu_pool_peak(void *vctx) { prism_cpu_ctx_t *c = vctx; return c->pool_peak; }
static size_t cpu_pool_cap(void *vctx) { prism_cpu_ctx_t *c = vctx; return c->pool_cap; }

static int cpu_copy(void *ctx, void *dst, const void *src, size_t bytes)
{
    if (bytes && dst != src) memmove(dst, src, bytes);
    return PRISM_OK;
}

static int cpu_memset0(void *ctx, void *dst, size_t bytes)
{
    memset(dst, 0, bytes);
    return PRISM_OK;
}

static int cpu_copy_2d(void *ctx, void *dst, size_t dst_stride, const void *src, size_t src_stride,
                       size_t row_bytes, size_t n_rows)
{
    for (size_t r = 0; r < n_rows; r++)
        memmove((uint8_t *)dst + r * dst_stride, (const uint8_t *)src + r * src_stride, row_bytes);
    return PRISM_OK;
}

static int cpu_upload_convert(void *ctx, void *dst, prism_dtype_t dt, const float *src, size_t n)
{
    switch (dt) {
    case PRISM_DTYPE_F32: memcpy(dst, src, n * 4); return PRISM_OK;
    case PRISM_DTYPE_BF16:
        for (size_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = prism_f32_to_bf16(src[i]);
        return PRISM_OK;
    case PRISM_DTYPE_F16:
        for (size_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = prism_f32_to_f16(src[i]);
        return PRISM_OK;
    }
    return PRISM_EINVAL;
}

static int cpu_sync(void *ctx) { return PRISM_OK; }

/* ---- matmul ----
 * The pool splits the output columns (rows of W) over threads — and the rows of x too when the
 * column slices would get narrow (many threads, small N) — and each thread runs OpenBLAS sgemm
 * single-threaded on its block (OpenBLAS threads are set to 1 at create, so BLAS threads and
 * ours never oversubscribe the cores). For a few rows of x (decode) it runs the vectorised gemv
 * instead, which streams each weight row once for all rows of x. bf16 weights: the gemv widens
 * them in registers; sgemm gets each thread's slice widened chunk by chunk into its scratch (a
 * cost of K·N conversions against M·N·K multiply-adds). Products and sums stay fp32.
 * --compute-dtype bf16 (MM_BF16DP): the table's matmul_bf16dp on each thread's block, for every M
 * (same thread grid), rounding the block's x rows into the widen scratch; it has no sgemm. A weight
 * the loader had packed (cpu_weight_pack) runs the table's matmul_bf16p instead: the column
 * slices are whole 16-column groups, so each starts on a panel. Under the default fp32 compute a
 * bf16 weight the loader packed (AVX-512 tables) runs matmul_f32p for every M instead of the gemv
 * and the widened sgemm: x stays fp32, the weight pairs widen in registers (same grid). */

#define GEMV_MAX_M 16             /* up to this many rows of x the gemv beats OpenBLAS sgemm (which packs all of W) */

typedef enum {
    MM_F32,                       /* fp32 weights */
    MM_BF16W,                     /* bf16 weights widened, fp32 arithmetic (--weight-dtype bf16) */
    MM_BF16DP,                    /* --compute-dtype bf16: the table's matmul_bf16dp */
    MM_BF16DP_EMUL,               /* --compute-dtype bf16 on a table without it: x rounded to bf16 into
                                   * the upper half of the scratch, then MM_BF16W on it (same numerics) */
} mm_mode_t;

typedef struct {
    const prism_cpu_kern_t *k;
    float *y; int ldy;
    const float *x; int ldx;
    const void *w;                /* fp32, or bf16 (every mode but MM_F32) */
    const float *b;
    int M, N, K;
    bool accumulate;
    mm_mode_t mode;
    bool packed;                  /* MM_BF16DP / MM_BF16W: w is in the packed layout (matmul_bf16p /
                                   * matmul_f32p) */
    int pm, pn;                   /* thread grid: row blocks x column slices */
    float *widen;                 /* the per-thread widen scratch (bf16 weights) */
    size_t widen_floats;          /* of each thread's scratch, what may be used */
    int cw;                       /* MM_BF16W / _EMUL, many rows: columns widened per chunk */
    int rx;                       /* MM_BF16DP_EMUL: rows of x rounded per chunk */
} mm_task_t;

#define MM_MIN_COLS 256           /* narrower column slices split the rows of x instead */

/* bf16 weights, fp32 arithmetic: the gemv widens them in registers, sgemm gets them widened chunk
 * by chunk into buf */
static void mm_bf16w(const mm_task_t *t, float *y, const float *x, int ldx, const uint16_t *w, int mm, int nn,
                     bool acc, float *buf)
{
    if (t->M <= GEMV_MAX_M) {
        t->k->gemv_bf16(y, t->ldy, x, ldx, w, t->K, mm, nn, t->K, acc);
        return;
    }
    for (int c0 = 0; c0 < nn; c0 += t->cw) {
        int c = PRISM_MIN(t->cw, nn - c0);
        t->k->bf16_to_f32(buf, w + (size_t)c0 * t->K, (size_t)c * t->K);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, mm, c, t->K, 1.0f, x, ldx, buf, t->K,
                    acc ? 1.0f : 0.0f, y + c0, t->ldy);
    }
}

static void mm_worker(void *arg, int ith, int nth)
{
    const mm_task_t *t = arg;
    if (ith >= t->pm * t->pn) return;
    int im = ith / t->pn, in = ith % t->pn;
    /* column slices of whole 16-column groups, the last one takes the rest */
    int groups = (t->N + 15) / 16;
    int n0 = PRISM_MIN(t->N, (int)((long)groups * in / t->pn) * 16);
    int n1 = PRISM_MIN(t->N, (int)((long)groups * (in + 1) / t->pn) * 16);
    int m0 = (int)((long)t->M * im / t->pm), m1 = (int)((long)t->M * (im + 1) / t->pm);
    if (n0 >= n1 || m0 >= m1) return;
    int nn = n1 - n0, mm = m1 - m0;
    float *y = t->y + (size_t)m0 * t->ldy + n0;
    const float *x = t->x + (size_t)m0 * t->ldx;
    bool acc = t->accumulate;
    if (t->b) {
        for (int r = 0; r < mm; r++) {
            float *yr = y + (size_t)r * t->ldy;
            if (acc) t->k->add(yr, yr, t->b + n0, (size_t)nn);
            else memcpy(yr, t->b + n0, (size_t)nn * 4);
        }
        acc = true;
    }
    if (t->mode == MM_F32) {
        const float *w = (const float *)t->w + (size_t)n0 * t->K;
        if (t->M <= GEMV_MAX_M)
            t->k->gemv(y, t->ldy, x, t->ldx, w, t->K, mm, nn, t->K, acc);
        else
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, mm, nn, t->K, 1.0f, x, t->ldx, w, t->K,
                        acc ? 1.0f : 0.0f, y, t->ldy);
        return;
    }
    const uint16_t *w = (const uint16_t *)t->w + (size_t)n0 * t->K;
    float *buf = t->widen + (size_t)ith * PRISM_CPU_WIDEN_FLOATS;
    switch (t->mode) {
    case MM_BF16W:
        if (t->packed)
            t->k->matmul_f32p(y, t->ldy, x, t->ldx,
                              (const uint16_t *)t->w + (size_t)(n0 / PRISM_CPU_BF16P_COLS) * prism_cpu_bf16p_panel(t->K),
                              mm, nn, t->K, acc);
        else
            mm_bf16w(t, y, x, t->ldx, w, mm, nn, acc, buf);
        break;
    case MM_BF16DP:
        if (t->packed)
            t->k->matmul_bf16p(y, t->ldy, x, t->ldx,
                               (const uint16_t *)t->w + (size_t)(n0 / PRISM_CPU_BF16P_COLS) * prism_cpu_bf16p_panel(t->K),
                               mm, nn, t->K, acc, (uint16_t *)buf, 2 * t->widen_floats);
        else
            t->k->matmul_bf16dp(y, t->ldy, x, t->ldx, w, t->K, mm, nn, t->K, acc, (uint16_t *)buf,
                                2 * t->widen_floats);
        break;
    case MM_BF16DP_EMUL: {
        float *xr = buf + t->widen_floats / 2;
        for (int r0 = 0; r0 < mm; r0 += t->rx) {
            int rows = PRISM_MIN(t->rx, mm - r0);
            for (int r = 0; r < rows; r++)
                t->k->round_bf16(xr + (size_t)r * t->K, x + (size_t)(r0 + r) * t->ldx, (size_t)t->K);
            mm_bf16w(t, y + (size_t)r0 * t->ldy, xr, t->K, w, rows, nn, acc, buf);
        }
        break;
    }
    default: break;
    }
}

/* Whether w lies in a packed weight (its entry copied to *out), under mem_mu: entries change only
 * at load and free. */
static bool packed_find(prism_cpu_ctx_t *c, const void *w, prism_cpu_packed_t *out)
{
    bool hit = false;
    pthread_mutex_lock(&c->mem_mu);
    int lo = 0, hi = c->n_packed;   /* lo: the first entry starting above w */
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (c->packed[mid].p <= (const uint8_t *)w) lo = mid + 1;
        else hi = mid;
    }
    if (lo > 0 && (const uint8_t *)w < c->packed[lo - 1].p + c->packed[lo - 1].bytes) {
        *out = c->packed[lo - 1];
        hit = true;
    }
    pthread_mutex_unlock(&c->mem_mu);
    return hit;
}

static int cpu_matmul(void *vctx, float *y, int ldy, const float *x, int ldx, const void *w,
                      prism_dtype_t wdt, const float *b, int M, int N, int K, bool accumulate)
{
    prism_cpu_ctx_t *c = vctx;
    bool bf16 = wdt == PRISM_DTYPE_BF16;
    if (wdt != PRISM_DTYPE_F32 && !(bf16 && c->widen_scratch)) return PRISM_ENOTSUP;
    if (M < 0 || N <= 0 || K <= 0 || ldy < N || ldx < K) return PRISM_EINVAL;
    mm_mode_t mode = !bf16 ? MM_F32 : !c->bf16dp ? MM_BF16W : c->k->matmul_bf16dp ? MM_BF16DP : MM_BF16DP_EMUL;
    /* the scratch a thread may fill: all of it, or its lower half beside the rounded x rows */
    size_t room = mode == MM_BF16DP_EMUL ? c->widen_floats / 2 : c->widen_floats;
    int cw = K > 0 && (size_t)K * 16 <= room ? (int)(room / (size_t)K / 16 * 16) : 0;
    int rx = (int)PRISM_MIN((size_t)M, room / (size_t)K);
    if ((mode == MM_BF16W || mode == MM_BF16DP_EMUL) && M > GEMV_MAX_M && !cw) return PRISM_ENOTSUP;
    if (mode == MM_BF16DP_EMUL && M && rx < 1) return PRISM_ENOTSUP;
    if (mode == MM_BF16DP &&
        (size_t)PRISM_CPU_BF16DP_ROWS * ((K + PRISM_CPU_BF16DP_KPAD - 1) / PRISM_CPU_BF16DP_KPAD * PRISM_CPU_BF16DP_KPAD) >
            2 * c->widen_floats)
        return PRISM_ENOTSUP;
    bool packed = false;
    if (bf16 && c->n_packed) {
        prism_cpu_packed_t pk;
        packed = packed_find(c, w, &pk);
        /* a packed weight is taken whole only (backend.h: weight_pack) */
        if (packed && ((const uint8_t *)w != pk.p || N != pk.N || K != pk.K || (mode != MM_BF16DP && mode != MM_BF16W)))
            return PRISM_EINVAL;
    }
    if (M == 0) return PRISM_OK;
    int nth = prism_cpu_nth(c, (size_t)M * N * K, PRISM_CPU_MATMUL_GRAIN);
    /* gemv: columns only (each weight row streamed once); sgemm: rows too once slices narrow */
    int pn = M <= GEMV_MAX_M ? PRISM_MIN(nth, (N + 15) / 16) : PRISM_MAX(1, PRISM_MIN(nth, N / MM_MIN_COLS));
    int pm = M <= GEMV_MAX_M ? 1 : PRISM_MAX(1, PRISM_MIN(nth / pn, M / 64));
    mm_task_t t = {c->k, y, ldy, x, ldx, w, b, M, N, K, accumulate, mode, packed, pm, pn, c->widen_scratch,
                   c->widen_floats, cw, rx};
    prism_cpu_pool_run(&c->pool, pm * pn, mm_worker, &t);
    return PRISM_OK;
}

/* ---- elementwise and row ops, split over the pool ---- */

/* Ops before EW_SILU_MUL split elements (in groups of 16), the others whole rows. */
typedef enum { EW_ACT, EW_ADD, EW_ADD_BCAST, EW_SCALE, EW_SILU_MUL, EW_RMSNORM, EW_LAYERNORM, EW_ROPE } ew_op_t;

typedef struct {
    ew_op_t op;
    const prism_cpu_kern_t *k;
    float *y;
    const float *x, *a, *b, *w;
    size_t n;                    /* units to split: elements, or rows */
    size_t nb;                   /* EW_ADD_BCAST: length of b, repeated along y */
    int dim, ld;                 /* row ops: row length, input row stride */
    float s, eps;
    prism_act_t act;
    /* rope */
    const int32_t *pos;
    const float *inv_freq;
    int n_heads, head_dim, half;
    prism_rope_mode_t mode;
    const prism_rope_sections_t *sec;   /* rope_multi: section of each pair, positions [sections][pos_ld] */
    size_t pos_ld;
} ew_task_t;

static void ew_worker(void *arg, int ith, int nth)
{
    const ew_task_t *t = arg;
    bool rows = t->op >= EW_SILU_MUL;
    size_t align = rows ? 1 : 16;
    size_t units = (t->n + align - 1) / align;
    size_t i0 = PRISM_MIN(t->n, units * (size_t)ith / (size_t)nth * align);
    size_t i1 = PRISM_MIN(t->n, units * (size_t)(ith + 1) / (size_t)nth * align);
    if (i0 >= i1) return;
    size_t n = i1 - i0;
    const prism_cpu_kern_t *k = t->k;
    switch (t->op) {
    case EW_ACT: k->act(t->act, t->y + i0, t->x + i0, n); break;
    case EW_ADD: k->add(t->y + i0, t->a + i0, t->b + i0, n); break;
    case EW_SCALE: k->scale(t->y + i0, t->x + i0, t->s, n); break;
    case EW_SILU_MUL:
        for (size_t r = i0; r < i1; r++)
            k->silu_mul(t->y + r * t->dim, t->a + r * t->ld, t->b + r * t->ld, (size_t)t->dim);
        break;
    case EW_ADD_BCAST:   /* y[i] = a[i] + b[i % nb], a run of b at a time */
        for (size_t i = i0; i < i1;) {
            size_t off = i % t->nb, len = PRISM_MIN(t->nb - off, i1 - i);
            k->add(t->y + i, t->a + i, t->b + off, len);
            i += len;
        }
        break;
    case EW_RMSNORM:
        for (size_t r = i0; r < i1; r++) k->rmsnorm(t->y + r * t->dim, t->x + r * t->dim, t->w, t->dim, t->eps);
        break;
    case EW_LAYERNORM:
        for (size_t r = i0; r < i1; r++)
            k->layernorm(t->y + r * t->dim, t->x + r * t->dim, t->w, t->b, t->dim, t->eps);
        break;
    case EW_ROPE: {
        float cs[PRISM_CPU_MAX_HEAD_DIM / 2], sn[PRISM_CPU_MAX_HEAD_DIM / 2];
        for (size_t r = i0; r < i1; r++) {
            float p = (float)t->pos[r];
            for (int i = 0; i < t->half; i++) {
                if (t->sec) p = (float)t->pos[(size_t)t->sec->of[i] * t->pos_ld + r];
                float ang = p * t->inv_freq[i];  /* fp32 product as in HF */
                cs[i] = cosf(ang);
                sn[i] = sinf(ang);
            }
            k->rope(t->y + r * t->ld, t->n_heads, t->head_dim, t->half, cs, sn, t->mode);
        }
        break;
    }
    }
}

static void ew_run(prism_cpu_ctx_t *c, ew_task_t *t, size_t work)
{
    t->k = c->k;
    int nth = prism_cpu_nth(c, work, PRISM_CPU_EW_GRAIN);
    if (t->op >= EW_SILU_MUL) nth = (int)PRISM_MIN((size_t)nth, t->n);
    prism_cpu_pool_run(&c->pool, nth, ew_worker, t);
}

/* ---- norms ---- */

static int cpu_rmsnorm(void *ctx, float *y, const float *x, const float *w, int n_rows, int dim, float eps)
{
    if (dim <= 0 || n_rows < 0) return PRISM_EINVAL;
    if (n_rows == 0) return PRISM_OK;
    ew_task_t t = {.op = EW_RMSNORM, .y = y, .x = x, .w = w, .n = (size_t)n_rows, .dim = dim, .eps = eps};
    ew_run(ctx, &t, (size_t)n_rows * dim);
    return PRISM_OK;
}

static int cpu_layernorm(void *ctx, float *y, const float *x, const float *w, const float *b,
                         int n_rows, int dim, float eps)
{
    if (dim <= 0 || n_rows < 0) return PRISM_EINVAL;
    if (n_rows == 0) return PRISM_OK;
    ew_task_t t = {.op = EW_LAYERNORM, .y = y, .x = x, .w = w, .b = b, .n = (size_t)n_rows, .dim = dim, .eps = eps};
    ew_run(ctx, &t, (size_t)n_rows * dim);
    return PRISM_OK;
}

/* ---- rope ---- */

static int cpu_rope(void *ctx, float *x, int ld, int n_tokens, int n_heads, int head_dim, int rot_dim,
                    const int32_t *pos, const float *inv_freq, prism_rope_mode_t mode)
{
    if (rot_dim <= 0 || rot_dim > head_dim || (rot_dim & 1) || head_dim > PRISM_CPU_MAX_HEAD_DIM ||
        ld < n_heads * head_dim || n_tokens < 0)
        return PRISM_EINVAL;
    if (n_tokens == 0 || n_heads <= 0) return PRISM_OK;
    ew_task_t t = {.op = EW_ROPE, .y = x, .n = (size_t)n_tokens, .ld = ld, .pos = pos, .inv_freq = inv_freq,
                   .n_heads = n_heads, .head_dim = head_dim, .half = rot_dim / 2, .mode = mode};
    ew_run(ctx, &t, (size_t)n_tokens * n_heads * rot_dim * 4);
    return PRISM_OK;
}

static int cpu_rope_multi(void *ctx, float *x, int ld, int n_tokens, int n_heads, int head_dim, const int32_t *pos,
                          int pos_ld, const float *inv_freq, const prism_rope_sections_t *sec)
{
    if (head_dim <= 0 || (head_dim & 1) || head_dim > PRISM_CPU_MAX_HEAD_DIM || head_dim / 2 > PRISM_ROPE_MAX_PAIRS ||
        ld < n_heads * head_dim || n_tokens < 0 || pos_ld < n_tokens || !sec)
        return PRISM_EINVAL;
    for (int j = 0; j < head_dim / 2; j++)
        if (sec->of[j] >= PRISM_ROPE_MAX_SECTIONS) return PRISM_EINVAL;
    if (n_tokens == 0 || n_heads <= 0) return PRISM_OK;
    ew_task_t t = {.op = EW_ROPE, .y = x, .n = (size_t)n_tokens, .ld = ld, .pos = pos, .inv_freq = inv_freq,
                   .n_heads = n_heads, .head_dim = head_dim, .half = head_dim / 2, .mode = PRISM_ROPE_NEOX,
                   .sec = sec, .pos_ld = (size_t)pos_ld};
    ew_run(ctx, &t, (size_t)n_tokens * n_heads * head_dim * 4);
    return PRISM_OK;
}

static int cpu_add_rows(void *ctx, float *y, int ldy, const float *src, int lds, const int32_t *rows, int n, int dim)
{
    prism_cpu_ctx_t *c = ctx;
    if (n < 0 || dim < 0 || ldy < dim || lds < dim || (n && !rows)) return PRISM_EINVAL;
    for (int i = 0; i < n; i++)
        if (rows[i] >= 0) c->k->add(y + (size_t)rows[i] * ldy, y + (size_t)rows[i] * ldy, src + (size_t)i * lds, (size_t)dim);
    return PRISM_OK;
}

/* ---- elementwise ---- */

static int cpu_act(void *ctx, prism_act_t act, float *y, const float *x, size_t n)
{
    if ((unsigned)act > PRISM_ACT_RELU) return PRISM_EINVAL;
    if (n == 0 || (act == PRISM_ACT_NONE && y == x)) return PRISM_OK;
    ew_task_t t = {.op = EW_ACT, .act = act, .y = y, .x = x, .n = n};
    ew_run(ctx, &t, act == PRISM_ACT_RELU || act == PRISM_ACT_NONE ? n : n * 8);
    return PRISM_OK;
}

static int cpu_silu_mul(void *ctx, float *out, const float *gate, const float *up, int ld, int n_rows, int dim)
{
    if (ld < dim || dim < 0 || n_rows < 0) return PRISM_EINVAL;
    if (n_rows == 0 || dim == 0) return PRISM_OK;
    ew_task_t t = {.op = EW_SILU_MUL, .y = out, .a = gate, .b = up, .ld = ld, .dim = dim, .n = (size_t)n_rows};
    ew_run(ctx, &t, (size_t)n_rows * dim * 8);
    return PRISM_OK;
}

static int cpu_add(void *ctx, float *y, const float *a, const float *b, size_t n, size_t nb)
{
    if (nb == 0 || nb > n) return PRISM_EINVAL;
    ew_task_t t = {.op = nb == n ? EW_ADD : EW_ADD_BCAST, .y = y, .a = a, .b = b, .n = n, .nb = nb};
    ew_run(ctx, &t, n);
    return PRISM_OK;
}

static int cpu_scale(void *ctx, float *y, const float *x, float s, size_t n)
{
    if (n == 0) return PRISM_OK;
    ew_task_t t = {.op = EW_SCALE, .y = y, .x = x, .s = s, .n = n};
    ew_run(ctx, &t, n);
    return PRISM_OK;
}

/* ---- gathers ---- */

static int cpu_get_rows(void *ctx, float *out, const void *table, prism_dtype_t dt, int n_table,
                        const int32_t *ids, int n, int dim)
{
    for (int i = 0; i < n; i++) {
        float *o = out + (size_t)i * dim;
        int id = ids[i];
        if (id < 0 || id >= n_table) {
            memset(o, 0, (size_t)dim * 4);
            continue;
        }
        switch (dt) {
        case PRISM_DTYPE_F32: memmove(o, (const float *)table + (size_t)id * dim, (size_t)dim * 4); break;
        case PRISM_DTYPE_BF16: {
            const uint16_t *r = (const uint16_t *)table + (size_t)id * dim;
            for (int j = 0; j < dim; j++) o[j] = prism_bf16_to_f32(r[j]);
            break;
        }
        case PRISM_DTYPE_F16: {
            const uint16_t *r = (const uint16_t *)table + (size_t)id * dim;
            for (int j = 0; j < dim; j++) o[j] = prism_f16_to_f32(r[j]);
            break;
        }
        default: return PRISM_EINVAL;
        }
    }
    return PRISM_OK;
}

static int cpu_im2patch(void *ctx, float *out, const float *pixels, int n_img, int C, int H, int W, int p)
{
    if (p <= 0 || H % p || W % p) return PRISM_EINVAL;
    int gh = H / p, gw = W / p, feat = C * p * p;
    for (int n = 0; n < n_img; n++)
        for (int py = 0; py < gh; py++)
            for (int px = 0; px < gw; px++) {
                float *o = out + ((size_t)n * gh * gw + (size_t)py * gw + px) * feat;
                for (int c = 0; c < C; c++)
                    for (int ky = 0; ky < p; ky++) {
                        const float *src = pixels + (((size_t)n * C + c) * H + (size_t)py * p + ky) * W + (size_t)px * p;
                        memcpy(o + (size_t)c * p * p + (size_t)ky * p, src, (size_t)p * 4);
                    }
            }
    return PRISM_OK;
}

/* ---- KV ---- */

static int cpu_kv_write(void *ctx, float *k_cache, float *v_cache, const float *k, const float *v, int ld,
                        const int32_t *slots, int n_tokens, int n_kv_heads, int head_dim)
{
    size_t row = (size_t)n_kv_heads * head_dim;
    if ((size_t)ld < row) return PRISM_EINVAL;
    for (int t = 0; t < n_tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + (size_t)slots[t] * row, k + (size_t)t * ld, row * 4);
        memcpy(v_cache + (size_t)slots[t] * row, v + (size_t)t * ld, row * 4);
    }
    return PRISM_OK;
}

static int cpu_blocks_to_host(void *ctx, void *dst, size_t host_stride, const void *base, size_t block_bytes,
                              const int32_t *ids, int n)
{
    for (int i = 0; i < n; i++)
        memcpy((uint8_t *)dst + (size_t)i * host_stride, (const uint8_t *)base + (size_t)ids[i] * block_bytes,
               block_bytes);
    return PRISM_OK;
}

static int cpu_blocks_from_host(void *ctx, void *base, size_t block_bytes, const int32_t *ids, int n,
                                const void *src, size_t host_stride)
{
    for (int i = 0; i < n; i++)
        memcpy((uint8_t *)base + (size_t)ids[i] * block_bytes, (const uint8_t *)src + (size_t)i * host_stride,
               block_bytes);
    return PRISM_OK;
}

static int cpu_argmax(void *ctx, int32_t *out, const float *logits, int n_rows, int vocab)
{
    if (vocab <= 0) return PRISM_EINVAL;
    for (int r = 0; r < n_rows; r++) {
        const float *l = logits + (size_t)r * vocab;
        int best = 0;
        for (int i = 1; i < vocab; i++)
            if (l[i] > l[best]) best = i;
        out[r] = best;
    }
    return PRISM_OK;
}

/* bf16 weights take a widen scratch per thread, carved once here (before the model loads). */
static int cpu_set_weight_dtype(void *vctx, prism_dtype_t dt)
{
    prism_cpu_ctx_t *c = vctx;
    if (dt == PRISM_DTYPE_F32) return PRISM_OK;
    if (dt != PRISM_DTYPE_BF16) return PRISM_ENOTSUP;
    if (!c->widen_scratch) {
        c->widen_scratch = prism_malloc_aligned(sizeof(float) * PRISM_CPU_WIDEN_FLOATS * (size_t)c->pool.n_threads, 64);
        if (!c->widen_scratch) return PRISM_ENOMEM;
        c->widen_floats = PRISM_CPU_WIDEN_FLOATS;
    }
    return PRISM_OK;
}

/* --compute-dtype: bf16 needs the widen scratch of bf16 weights (prism_backend_set_compute_dtype
 * sets those first). A table without matmul_bf16dp (a CPU without AVX-512 BF16, or PRISM_CPU_ISA
 * forcing a lower path) emulates it: the same numerics on fp32 arithmetic, no faster than f32. */
static int cpu_set_compute_dtype(void *vctx, prism_dtype_t dt)
{
    prism_cpu_ctx_t *c = vctx;
    if (dt != PRISM_DTYPE_F32 && dt != PRISM_DTYPE_BF16) return PRISM_ENOTSUP;
    if (dt == PRISM_DTYPE_BF16 && !c->widen_scratch) return PRISM_ENOTSUP;
    if (c->n_packed && (dt == PRISM_DTYPE_BF16) != c->bf16dp)
        return PRISM_EINVAL;   /* packed weights need the kernel of the compute dtype they were packed for */
    c->bf16dp = dt == PRISM_DTYPE_BF16;
    if (c->bf16dp && !c->k->matmul_bf16dp)
        PRISM_WARN("cpu backend: --compute-dtype bf16 without AVX-512 BF16 (%s kernels%s): x is rounded to bf16 as "
                   "asked, but the products run in fp32 arithmetic (same results, no faster than f32)",
                   c->k->name, prism_cpu_has_avx512_bf16() ? ", PRISM_CPU_ISA forces them" : "");
    else if (c->bf16dp)
        PRISM_INFO("cpu backend: matmuls compute in bf16 (AVX-512 BF16 dot products, fp32 sums)");
    return PRISM_OK;
}

/* Packing, bf16 weights only, where the table has the packed kernel of the compute dtype:
 * --compute-dtype bf16 with matmul_bf16p (AVX-512 BF16), the default fp32 compute with matmul_f32p
 * (both AVX-512 tables). The emulation, fp32 weights and the other tables keep [N][K] and today's
 * kernels. */
static size_t cpu_weight_pack_bytes(void *vctx, int N, int K)
{
    prism_cpu_ctx_t *c = vctx;
    bool ok = c->bf16dp ? c->k->matmul_bf16p != NULL : c->widen_scratch && c->k->matmul_f32p;
    if (!ok || N <= 0 || K <= 0) return 0;
    return prism_cpu_bf16p_elems(N, K) * sizeof(uint16_t);
}

static int cpu_weight_pack(void *vctx, void *w, int N, int K)
{
    prism_cpu_ctx_t *c = vctx;
    size_t bytes = cpu_weight_pack_bytes(c, N, K);
    if (!bytes) return PRISM_OK;
    if (!w) return PRISM_EINVAL;
    uint16_t *tmp = prism_malloc((size_t)PRISM_CPU_BF16P_COLS * (size_t)K * sizeof *tmp);
    if (!tmp) return PRISM_ENOMEM;
    int rc = PRISM_OK;
    pthread_mutex_lock(&c->mem_mu);
    if (c->n_packed == c->cap_packed) {
        int cap = c->cap_packed ? 2 * c->cap_packed : 64;
        prism_cpu_packed_t *g = prism_realloc(c->packed, (size_t)cap * sizeof *g);
        if (!g) {
            rc = PRISM_ENOMEM;
            goto out;
        }
        c->packed = g;
        c->cap_packed = cap;
    }
    const uint8_t *p = w;
    int at = c->n_packed;
    while (at > 0 && c->packed[at - 1].p > p) at--;
    if ((at > 0 && c->packed[at - 1].p + c->packed[at - 1].bytes > p) ||
        (at < c->n_packed && p + bytes > c->packed[at].p)) {
        rc = PRISM_EINVAL;   /* packed twice, or overlapping another packed weight */
        goto out;
    }
    prism_cpu_bf16p_pack(w, N, K, tmp);
    memmove(c->packed + at + 1, c->packed + at, (size_t)(c->n_packed - at) * sizeof *c->packed);
    c->packed[at] = (prism_cpu_packed_t){p, bytes, N, K};
    c->n_packed++;
out:
    pthread_mutex_unlock(&c->mem_mu);
    prism_free(tmp);
    return rc;
}

static void cpu_destroy(void *vctx)
{
    prism_cpu_ctx_t *c = vctx;
    if (!c) return;
    prism_free(c->packed);
    prism_cpu_pool_free(&c->pool);
    prism_free_aligned(c->attn_scratch);
    prism_free_aligned(c->widen_scratch);
    pthread_mutex_destroy(&c->mem_mu);
    prism_free(c);
}

/* ---- OpenBLAS kernels ----
 * OpenBLAS built for many CPUs (DYNAMIC_ARCH, as Debian's is) picks its kernels by CPU model when
 * it loads. A model newer than the library — Emerald Rapids under 0.3.21 — falls back to its
 * generic Prescott (SSE3) kernels: sgemm 4-5x slower than the AVX-512 ones the CPU runs. When
 * that happened on a CPU with AVX2 or AVX-512 and nobody set OPENBLAS_CORETYPE, the kernels are
 * chosen again by instruction set, once per process, before the first BLAS call. The two entry
 * points are exported but only by dynamic builds: weak, so any other BLAS links and is left alone. */
extern char *openblas_get_corename(void) __attribute__((weak));
extern void gotoblas_dynamic_init(void) __attribute__((weak));
extern void gotoblas_dynamic_quit(void) __attribute__((weak));

static void cpu_blas_fix_kernels(void)
{
    if (!openblas_get_corename || !gotoblas_dynamic_init || !gotoblas_dynamic_quit) return;
    const char *core = openblas_get_corename();
    if (getenv("OPENBLAS_CORETYPE") || !core || strcmp(core, "Prescott") != 0) return;
    const char *want = prism_cpu_has_avx512_skx() ? "SkylakeX"
                     : prism_cpu_isa_detect() >= PRISM_CPU_ISA_AVX2 ? "Haswell" : NULL;
    if (!want) return;
    /* gotoblas_dynamic_init reads the core type from the environment only */
    setenv("OPENBLAS_CORETYPE", want, 1);
    gotoblas_dynamic_quit();
    gotoblas_dynamic_init();
    unsetenv("OPENBLAS_CORETYPE");
    PRISM_INFO("OpenBLAS did not know this CPU and took its generic Prescott kernels; now using its %s kernels "
               "(set OPENBLAS_CORETYPE to choose)", openblas_get_corename());
}

void prism_backend_cpu_blas_setup(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, cpu_blas_fix_kernels);
}

prism_backend_t *prism_backend_cpu_create_pool(int n_threads, size_t pool_bytes)
{
    prism_backend_cpu_blas_setup();
    if (n_threads < 1) n_threads = 1;
    prism_backend_t *be = prism_calloc(1, sizeof *be);
    prism_cpu_ctx_t *c = prism_calloc(1, sizeof *c);
    if (!be || !c) goto fail;
    pthread_mutex_init(&c->mem_mu, NULL);
    c->pool_cap = pool_bytes;
    c->k = prism_cpu_kern_select(getenv("PRISM_CPU_ISA"));
    if (n_threads > PRISM_CPU_MAX_THREADS) n_threads = PRISM_CPU_MAX_THREADS;
    c->attn_scratch = prism_malloc_aligned(sizeof(float) * PRISM_CPU_ATTN_SCRATCH * (size_t)n_threads, 64);
    if (!c->attn_scratch || prism_cpu_pool_init(&c->pool, n_threads) != PRISM_OK) {
        prism_free_aligned(c->attn_scratch);
        pthread_mutex_destroy(&c->mem_mu);
        goto fail;
    }
    /* Our pool owns the cores: OpenBLAS runs single-threaded inside each pool thread. */
    openblas_set_num_threads(1);
    be->i = (prism_backend_i){
        .name = cpu_name,
        .alloc = cpu_alloc, .free = cpu_free,
        .pool_used = cpu_pool_used, .pool_peak = cpu_pool_peak, .pool_cap = cpu_pool_cap,
        .upload = cpu_copy, .download = cpu_copy, .copy = cpu_copy, .memset0 = cpu_memset0,
        .copy_2d = cpu_copy_2d, .upload_convert = cpu_upload_convert, .synchronize = cpu_sync,
        .matmul = cpu_matmul,
        .rmsnorm = cpu_rmsnorm, .layernorm = cpu_layernorm,
        .rope = cpu_rope,
        .act = cpu_act, .silu_mul = cpu_silu_mul, .add = cpu_add, .scale = cpu_scale,
        .get_rows = cpu_get_rows, .im2patch = cpu_im2patch,
        .kv_write = cpu_kv_write,
        .attn_paged = prism_cpu_attn_paged, .attn_decode = prism_cpu_attn_paged,
        .attn_dense = prism_cpu_attn_dense,
        .blocks_to_host = cpu_blocks_to_host, .blocks_from_host = cpu_blocks_from_host,
        .argmax = cpu_argmax,
        .head_rmsnorm = prism_cpu_head_rmsnorm, .scale_rows = prism_cpu_scale_rows,
        .moe_route = prism_cpu_moe_route, .matmul_grouped = prism_cpu_matmul_grouped,
        .moe_combine = prism_cpu_moe_combine, .pixel_shuffle = prism_cpu_pixel_shuffle,
        .rope_multi = cpu_rope_multi, .attn_varlen = prism_cpu_attn_varlen, .add_rows = cpu_add_rows,
        .set_weight_dtype = cpu_set_weight_dtype, .set_compute_dtype = cpu_set_compute_dtype,
        .weight_pack_bytes = cpu_weight_pack_bytes, .weight_pack = cpu_weight_pack,
        .destroy = cpu_destroy,
    };
    be->ctx = c;
    be->device = "cpu";
    be->weight_dtype = PRISM_DTYPE_F32;
    be->compute_dtype = PRISM_DTYPE_F32;
    be->n_threads = n_threads;
    PRISM_INFO("cpu backend: %d threads, %s kernels", n_threads, c->k->name);
    return be;
fail:
    prism_free(c);
    prism_free(be);
    return NULL;
}

prism_backend_t *prism_backend_cpu_create(int n_threads)
{
    return prism_backend_cpu_create_pool(n_threads, 0);
}
