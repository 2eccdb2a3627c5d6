/* CPU backend: OpenBLAS sgemm for matmuls, plain C kernels for the rest, fp32 throughout.
 * It is the reference every other backend is tested against, so kernels favour clarity and
 * exact HF semantics over speed; attention is threaded over (token, kv head) work items. */
#include "backend/cpu/cpu_impl.h"

#include <cblas.h>
#include <math.h>
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

/* ---- matmul ---- */

static int cpu_matmul(void *ctx, float *y, int ldy, const float *x, int ldx, const void *w,
                      prism_dtype_t wdt, const float *b, int M, int N, int K, bool accumulate)
{
    if (wdt != PRISM_DTYPE_F32) return PRISM_ENOTSUP;  /* CPU stores weights as fp32 */
    if (M < 0 || N <= 0 || K <= 0 || ldy < N || ldx < K) return PRISM_EINVAL;
    if (M == 0) return PRISM_OK;
    float beta = accumulate ? 1.0f : 0.0f;
    if (b) {
        for (int r = 0; r < M; r++) {
            float *yr = y + (size_t)r * ldy;
            if (accumulate)
                for (int j = 0; j < N; j++) yr[j] += b[j];
            else
                memcpy(yr, b, (size_t)N * 4);
        }
        beta = 1.0f;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, x, ldx, (const float *)w, K,
                beta, y, ldy);
    return PRISM_OK;
}

/* ---- norms ---- */

static int cpu_rmsnorm(void *ctx, float *y, const float *x, const float *w, int n_rows, int dim, float eps)
{
    if (dim <= 0 || n_rows < 0) return PRISM_EINVAL;
    for (int r = 0; r < n_rows; r++) {
        const float *xr = x + (size_t)r * dim;
        float *yr = y + (size_t)r * dim;
        double ss = 0;
        for (int i = 0; i < dim; i++) ss += (double)xr[i] * xr[i];
        float inv = 1.0f / sqrtf((float)(ss / dim) + eps);
        for (int i = 0; i < dim; i++) yr[i] = w[i] * (xr[i] * inv);
    }
    return PRISM_OK;
}

static int cpu_layernorm(void *ctx, float *y, const float *x, const float *w, const float *b,
                         int n_rows, int dim, float eps)
{
    if (dim <= 0 || n_rows < 0) return PRISM_EINVAL;
    for (int r = 0; r < n_rows; r++) {
        const float *xr = x + (size_t)r * dim;
        float *yr = y + (size_t)r * dim;
        double mean = 0, var = 0;
        for (int i = 0; i < dim; i++) mean += xr[i];
        mean /= dim;
        for (int i = 0; i < dim; i++) {
            double d = xr[i] - mean;
            var += d * d;
        }
        var /= dim;
        float inv = (float)(1.0 / sqrt(var + eps)), m = (float)mean;
        for (int i = 0; i < dim; i++) yr[i] = (xr[i] - m) * inv * (w ? w[i] : 1.0f) + (b ? b[i] : 0.0f);
    }
    return PRISM_OK;
}

/* ---- rope ---- */

static int cpu_rope(void *ctx, float *x, int ld, int n_tokens, int n_heads, int head_dim, int rot_dim,
                    const int32_t *pos, const float *inv_freq, prism_rope_mode_t mode)
{
    if (rot_dim <= 0 || rot_dim > head_dim || (rot_dim & 1) || ld < n_heads * head_dim) return PRISM_EINVAL;
    int half = rot_dim / 2;
    for (int t = 0; t < n_tokens; t++) {
        float p = (float)pos[t];
        for (int i = 0; i < half; i++) {
            float ang = p * inv_freq[i];  /* fp32 product as in HF */
            float c = cosf(ang), s = sinf(ang);
            for (int h = 0; h < n_heads; h++) {
                float *xh = x + (size_t)t * ld + (size_t)h * head_dim;
                int i0 = mode == PRISM_ROPE_NEOX ? i : 2 * i;
                int i1 = mode == PRISM_ROPE_NEOX ? i + half : 2 * i + 1;
                float a = xh[i0], b = xh[i1];
                xh[i0] = a * c - b * s;
                xh[i1] = b * c + a * s;
            }
        }
    }
    return PRISM_OK;
}

/* ---- elementwise ---- */

static inline float act_one(prism_act_t act, float v)
{
    switch (act) {
    case PRISM_ACT_NONE: return v;
    case PRISM_ACT_SILU: return v / (1.0f + expf(-v));
    case PRISM_ACT_GELU_ERF: return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    case PRISM_ACT_GELU_TANH:
        return 0.5f * v * (1.0f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
    case PRISM_ACT_QUICK_GELU: return v / (1.0f + expf(-1.702f * v));
    case PRISM_ACT_RELU: return v > 0 ? v : 0;
    }
    return v;
}

static int cpu_act(void *ctx, prism_act_t act, float *y, const float *x, size_t n)
{
    if ((unsigned)act > PRISM_ACT_RELU) return PRISM_EINVAL;
    for (size_t i = 0; i < n; i++) y[i] = act_one(act, x[i]);
    return PRISM_OK;
}

static int cpu_silu_mul(void *ctx, float *out, const float *gate, const float *up, int ld, int n_rows, int dim)
{
    if (ld < dim) return PRISM_EINVAL;
    for (int r = 0; r < n_rows; r++) {
        const float *g = gate + (size_t)r * ld, *u = up + (size_t)r * ld;
        float *o = out + (size_t)r * dim;
        for (int i = 0; i < dim; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    return PRISM_OK;
}

static int cpu_add(void *ctx, float *y, const float *a, const float *b, size_t n, size_t nb)
{
    if (nb == 0 || nb > n) return PRISM_EINVAL;
    if (nb == n) {
        for (size_t i = 0; i < n; i++) y[i] = a[i] + b[i];
        return PRISM_OK;
    }
    for (size_t i = 0; i < n; i++) y[i] = a[i] + b[i % nb];
    return PRISM_OK;
}

static int cpu_scale(void *ctx, float *y, const float *x, float s, size_t n)
{
    for (size_t i = 0; i < n; i++) y[i] = x[i] * s;
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

static void cpu_destroy(void *vctx)
{
    prism_cpu_ctx_t *c = vctx;
    if (!c) return;
    prism_cpu_pool_free(&c->pool);
    pthread_mutex_destroy(&c->mem_mu);
    prism_free(c);
}

prism_backend_t *prism_backend_cpu_create_pool(int n_threads, size_t pool_bytes)
{
    if (n_threads < 1) n_threads = 1;
    prism_backend_t *be = prism_calloc(1, sizeof *be);
    prism_cpu_ctx_t *c = prism_calloc(1, sizeof *c);
    if (!be || !c) goto fail;
    pthread_mutex_init(&c->mem_mu, NULL);
    c->pool_cap = pool_bytes;
    if (prism_cpu_pool_init(&c->pool, n_threads) != PRISM_OK) {
        pthread_mutex_destroy(&c->mem_mu);
        goto fail;
    }
    openblas_set_num_threads(n_threads);
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
        .destroy = cpu_destroy,
    };
    be->ctx = c;
    be->device = "cpu";
    be->weight_dtype = PRISM_DTYPE_F32;
    be->n_threads = n_threads;
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
