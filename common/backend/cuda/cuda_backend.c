/* CUDA backend, host side: device selection, the one-allocation pool, pinned staging for
 * transfers, the op table. Kernels are in the .cu files (one op each), GEMMs in cuda_matmul.c.
 *
 * Everything runs on one non-blocking stream per backend, so ops are ordered without
 * synchronisation and the host only waits in download / synchronize / transfers back. */
#include "backend/cuda/cuda_impl.h"

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#define STAGE_BYTES   ((size_t)16 << 20)   /* per pinned staging buffer (two of them) */
#define CUBLAS_WS     ((size_t)32 << 20)   /* NVIDIA's recommended cuBLAS workspace on Hopper */
#define CONV_MAX      ((size_t)128 << 20)
#define CONV_MIN      ((size_t)4 << 20)
#define ATTN_PART     ((size_t)32 << 20)
#define SMALL_BYTES   ((size_t)1 << 20)
#define FREE_MARGIN   ((size_t)1 << 30)    /* left to the driver / other contexts when pool_bytes is 0 */

static atomic_uint_fast64_t g_malloc_count;

uint64_t prism_cuda_malloc_count(void) { return (uint64_t)atomic_load(&g_malloc_count); }
void prism_cuda_count_malloc(void) { atomic_fetch_add(&g_malloc_count, 1); }

int prism_cuda_status(cudaError_t e, const char *what, const char *file, int line)
{
    if (e == cudaSuccess) return PRISM_OK;
    prism_log(PRISM_LOG_ERROR, file, line, "cuda: %s failed: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
    if (e == cudaErrorMemoryAllocation) return PRISM_ENOMEM;
    if (e == cudaErrorInvalidValue || e == cudaErrorInvalidConfiguration) return PRISM_EINVAL;
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver || e == cudaErrorInvalidDevice) return PRISM_ENOTSUP;
    return PRISM_EIO;
}

int prism_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();   /* clear the sticky "no driver" error */
        return 0;
    }
    return n;
}

bool prism_cuda_available(void) { return prism_cuda_device_count() > 0; }

/* ---------------------------------------------------------------- pool */

static void *cu_alloc(void *ctx, size_t bytes) { return prism_cuda_pool_take(&((prism_cuda_ctx_t *)ctx)->pool, bytes); }
static void cu_free(void *ctx, void *p) { prism_cuda_pool_give(&((prism_cuda_ctx_t *)ctx)->pool, p); }
static size_t cu_pool_used(void *ctx) { return ((prism_cuda_ctx_t *)ctx)->pool.used; }
static size_t cu_pool_peak(void *ctx) { return ((prism_cuda_ctx_t *)ctx)->pool.peak; }
static size_t cu_pool_cap(void *ctx) { return ((prism_cuda_ctx_t *)ctx)->pool.cap; }

/* ---------------------------------------------------------------- transfers */

/* Host -> device through the pinned buffers, alternating so the host fills one while the
 * other is in flight. Returns once the source may be reused; the copy itself is stream-ordered. */
/* Whether [p, p + n) lies in a range host_pin registered. */
static bool is_pinned(const prism_cuda_ctx_t *c, const void *p, size_t n)
{
    for (size_t i = 0; i < PRISM_ARRAY_LEN(c->pinned); i++)
        if (c->pinned[i].p && (const uint8_t *)p >= c->pinned[i].p &&
            (const uint8_t *)p + n <= c->pinned[i].p + c->pinned[i].n)
            return true;
    return false;
}

int prism_cuda_upload_raw(prism_cuda_ctx_t *c, void *dst, const void *src, size_t bytes)
{
    int rc;
    if (is_pinned(c, src, bytes)) {   /* one DMA; synchronous, as a staged copy's source is free at return */
        if ((rc = PRISM_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream)))) return rc;
        return PRISM_CUDA_TRY(cudaStreamSynchronize(c->stream));
    }
    for (size_t off = 0; off < bytes; off += c->stage_bytes) {
        size_t n = PRISM_MIN(c->stage_bytes, bytes - off);
        int b = c->stage_next;
        c->stage_next ^= 1;
        if ((rc = PRISM_CUDA_TRY(cudaEventSynchronize(c->stage_ev[b])))) return rc;
        memcpy(c->stage[b], (const uint8_t *)src + off, n);
        if ((rc = PRISM_CUDA_TRY(cudaMemcpyAsync((uint8_t *)dst + off, c->stage[b], n, cudaMemcpyHostToDevice,
                                                 c->stream))))
            return rc;
        if ((rc = PRISM_CUDA_TRY(cudaEventRecord(c->stage_ev[b], c->stream)))) return rc;
    }
    return PRISM_OK;
}

/* Device -> host, synchronous (waits for all earlier work on the stream). */
int prism_cuda_download_raw(prism_cuda_ctx_t *c, void *dst, const void *src, size_t bytes)
{
    int rc;
    if (is_pinned(c, dst, bytes)) {
        if ((rc = PRISM_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream)))) return rc;
        return PRISM_CUDA_TRY(cudaStreamSynchronize(c->stream));
    }
    for (size_t off = 0; off < bytes; off += c->stage_bytes) {
        size_t n = PRISM_MIN(c->stage_bytes, bytes - off);
        int b = c->stage_next;
        c->stage_next ^= 1;
        if ((rc = PRISM_CUDA_TRY(cudaMemcpyAsync(c->stage[b], (const uint8_t *)src + off, n, cudaMemcpyDeviceToHost,
                                                 c->stream))))
            return rc;
        if ((rc = PRISM_CUDA_TRY(cudaEventRecord(c->stage_ev[b], c->stream)))) return rc;
        if ((rc = PRISM_CUDA_TRY(cudaEventSynchronize(c->stage_ev[b])))) return rc;
        memcpy((uint8_t *)dst + off, c->stage[b], n);
    }
    return PRISM_OK;
}

static int cu_upload(void *ctx, void *dst, const void *src, size_t bytes)
{
    if (!bytes) return PRISM_OK;
    if (!dst || !src) return PRISM_EINVAL;
    return prism_cuda_upload_raw(ctx, dst, src, bytes);
}

static int cu_download(void *ctx, void *dst, const void *src, size_t bytes)
{
    if (!bytes) return PRISM_OK;
    if (!dst || !src) return PRISM_EINVAL;
    return prism_cuda_download_raw(ctx, dst, src, bytes);
}

static int cu_copy(void *ctx, void *dst, const void *src, size_t bytes)
{
    prism_cuda_ctx_t *c = ctx;
    if (!bytes || dst == src) return PRISM_OK;
    return PRISM_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream));
}

static int cu_memset0(void *ctx, void *dst, size_t bytes)
{
    prism_cuda_ctx_t *c = ctx;
    if (!bytes) return PRISM_OK;
    return PRISM_CUDA_TRY(cudaMemsetAsync(dst, 0, bytes, c->stream));
}

static int cu_copy_2d(void *ctx, void *dst, size_t dst_stride, const void *src, size_t src_stride, size_t row_bytes,
                      size_t n_rows)
{
    prism_cuda_ctx_t *c = ctx;
    if (!n_rows || !row_bytes) return PRISM_OK;
    if (dst_stride < row_bytes || src_stride < row_bytes) return PRISM_EINVAL;
    return PRISM_CUDA_TRY(cudaMemcpy2DAsync(dst, dst_stride, src, src_stride, row_bytes, n_rows,
                                            cudaMemcpyDeviceToDevice, c->stream));
}

/* Weights arrive as fp32 on the host: stage fp32 chunks into the conversion scratch and convert
 * on the device (half the PCIe bytes of converting on the host would save, but the host loop
 * is the slower part on big checkpoints). */
static int cu_upload_convert(void *ctx, void *dst, prism_dtype_t dt, const float *src, size_t n)
{
    prism_cuda_ctx_t *c = ctx;
    if (dt == PRISM_DTYPE_F32) return cu_upload(ctx, dst, src, n * 4);
    if (dt != PRISM_DTYPE_BF16 && dt != PRISM_DTYPE_F16) return PRISM_EINVAL;
    size_t chunk = c->conv_bytes / 4;
    for (size_t off = 0; off < n; off += chunk) {
        size_t m = PRISM_MIN(chunk, n - off);
        int rc = prism_cuda_upload_raw(c, c->conv, src + off, m * 4);
        if (rc == PRISM_OK) rc = prism_cuda_convert(c->stream, (uint8_t *)dst + off * 2, dt, c->conv, 1, m, m);
        if (rc != PRISM_OK) return rc;
    }
    return PRISM_OK;
}

static int cu_sync(void *ctx)
{
    prism_cuda_ctx_t *c = ctx;
    return PRISM_CUDA_TRY(cudaStreamSynchronize(c->stream));
}

/* ---------------------------------------------------------------- op wrappers */

static const char *cu_name(void *ctx) { return ((prism_cuda_ctx_t *)ctx)->name; }

#define ST(ctx) (((prism_cuda_ctx_t *)(ctx))->stream)

static int cu_rmsnorm(void *ctx, float *y, const float *x, const float *w, int n_rows, int dim, float eps)
{ return prism_cuda_rmsnorm(ST(ctx), y, x, w, n_rows, dim, eps); }
static int cu_layernorm(void *ctx, float *y, const float *x, const float *w, const float *b, int n_rows, int dim, float eps)
{ return prism_cuda_layernorm(ST(ctx), y, x, w, b, n_rows, dim, eps); }
static int cu_rope(void *ctx, float *x, int ld, int n_tokens, int n_heads, int head_dim, int rot_dim,
                   const int32_t *pos, const float *inv_freq, prism_rope_mode_t mode)
{ return prism_cuda_rope(ST(ctx), x, ld, n_tokens, n_heads, head_dim, rot_dim, pos, inv_freq, mode); }
static int cu_act(void *ctx, prism_act_t act, float *y, const float *x, size_t n)
{ return prism_cuda_act(ST(ctx), act, y, x, n); }
static int cu_silu_mul(void *ctx, float *out, const float *gate, const float *up, int ld, int n_rows, int dim)
{ return prism_cuda_silu_mul(ST(ctx), out, gate, up, ld, n_rows, dim); }
static int cu_add(void *ctx, float *y, const float *a, const float *b, size_t n, size_t nb)
{ return prism_cuda_add(ST(ctx), y, a, b, n, nb); }
static int cu_scale(void *ctx, float *y, const float *x, float s, size_t n)
{ return prism_cuda_scale(ST(ctx), y, x, s, n); }
static int cu_get_rows(void *ctx, float *out, const void *table, prism_dtype_t dt, int n_table, const int32_t *ids,
                       int n, int dim)
{ return prism_cuda_get_rows(ST(ctx), out, table, dt, n_table, ids, n, dim); }
static int cu_head_rmsnorm(void *ctx, float *x, int ld, int n_tokens, int n_heads, int head_dim, const float *w,
                           float eps)
{ return prism_cuda_head_rmsnorm(ST(ctx), x, ld, n_tokens, n_heads, head_dim, w, eps); }
static int cu_scale_rows(void *ctx, float *x, int ld, int n_rows, int dim, const float *s)
{ return prism_cuda_scale_rows(ST(ctx), x, ld, n_rows, dim, s); }
static int cu_moe_route(void *ctx, const float *logits, int n_tokens, int n_experts, int top_k, int32_t *choice,
                        int32_t *order, float *weight, int32_t *offsets, int32_t *slot)
{ return prism_cuda_moe_route(ST(ctx), logits, n_tokens, n_experts, top_k, choice, order, weight, offsets, slot); }
static int cu_matmul_grouped(void *ctx, float *y, int ldy, const float *x, int ldx, const void *w, prism_dtype_t wdt,
                             const int32_t *offsets, int n_groups, int M, int N, int K)
{ return prism_cuda_matmul_grouped(ST(ctx), y, ldy, x, ldx, w, wdt, offsets, n_groups, M, N, K); }
static int cu_moe_combine(void *ctx, float *y, int ldy, const float *src, const int32_t *slot, int n_tokens, int top_k,
                          int dim)
{ return prism_cuda_moe_combine(ST(ctx), y, ldy, src, slot, n_tokens, top_k, dim); }
static int cu_pixel_shuffle(void *ctx, float *out, const float *x, int n_img, int rows_per_img, int g, int C, int s)
{ return prism_cuda_pixel_shuffle(ST(ctx), out, x, n_img, rows_per_img, g, C, s); }
static int cu_rope_multi(void *ctx, float *x, int ld, int n_tokens, int n_heads, int head_dim, const int32_t *pos,
                         int pos_ld, const float *inv_freq, const prism_rope_sections_t *sec)
{ return prism_cuda_rope_multi(ST(ctx), x, ld, n_tokens, n_heads, head_dim, pos, pos_ld, inv_freq, sec); }
static int cu_add_rows(void *ctx, float *y, int ldy, const float *src, int lds, const int32_t *rows, int n, int dim)
{ return prism_cuda_add_rows(ST(ctx), y, ldy, src, lds, rows, n, dim); }
static int cu_attn_varlen(void *ctx, float *out, int ldo, const float *q, int ldq, const float *k, int ldk,
                          const float *v, int ldv, const int32_t *cu, int n_seqs, int max_len, int n_heads,
                          int n_kv_heads, int head_dim, float scale)
{
    return prism_cuda_attn_varlen(ST(ctx), out, ldo, q, ldq, k, ldk, v, ldv, cu, n_seqs, max_len, n_heads, n_kv_heads,
                                  head_dim, scale);
}
static int cu_fill_random(void *ctx, void *dst, prism_dtype_t dt, size_t n, uint64_t seed, float std)
{ return prism_cuda_fill_random(ST(ctx), dst, dt, n, seed, std); }
static int cu_im2patch(void *ctx, float *out, const float *pixels, int n_img, int C, int H, int W, int p)
{ return prism_cuda_im2patch(ST(ctx), out, pixels, n_img, C, H, W, p); }
static int cu_kv_write(void *ctx, float *kc, float *vc, const float *k, const float *v, int ld, const int32_t *slots,
                       int n_tokens, int n_kv_heads, int head_dim)
{ return prism_cuda_kv_write(ST(ctx), kc, vc, k, v, ld, slots, n_tokens, n_kv_heads, head_dim); }
static int cu_attn_paged(void *ctx, float *out, int ldo, const float *q, int ldq, const float *kc, const float *vc,
                         const prism_attn_meta_t *meta, int n_heads, int n_kv_heads, int head_dim, float scale)
{ return prism_cuda_attn_paged(ST(ctx), out, ldo, q, ldq, kc, vc, meta, n_heads, n_kv_heads, head_dim, scale); }
static int cu_attn_decode(void *ctx, float *out, int ldo, const float *q, int ldq, const float *kc, const float *vc,
                          const prism_attn_meta_t *meta, int n_heads, int n_kv_heads, int head_dim, float scale)
{
    prism_cuda_ctx_t *c = ctx;
    return prism_cuda_attn_decode(c->stream, out, ldo, q, ldq, kc, vc, meta, n_heads, n_kv_heads, head_dim, scale,
                                  c->attn_part, c->attn_part_floats, c->n_sm);
}
static int cu_attn_dense(void *ctx, float *out, int ldo, const float *q, int ldq, const float *k, int ldk,
                         const float *v, int ldv, int n_seqs, int seq_len, int n_heads, int n_kv_heads, int head_dim,
                         float scale, bool causal)
{
    return prism_cuda_attn_dense(ST(ctx), out, ldo, q, ldq, k, ldk, v, ldv, n_seqs, seq_len, n_heads, n_kv_heads,
                                 head_dim, scale, causal);
}

/* The KV swap region (backend.h host_pin): registered in place, portable to every context, and
 * remembered so that copies to and from it skip the staging buffers. A few ranges at most. */
static int cu_host_pin(void *ctx, void *host, size_t bytes)
{
    prism_cuda_ctx_t *c = ctx;
    if (!host || !bytes) return PRISM_EINVAL;
    size_t i = 0;
    while (i < PRISM_ARRAY_LEN(c->pinned) && c->pinned[i].p) i++;
    if (i == PRISM_ARRAY_LEN(c->pinned)) return PRISM_ENOMEM;
    int rc = PRISM_CUDA_TRY(cudaHostRegister(host, bytes, cudaHostRegisterPortable));
    if (rc == PRISM_OK) {
        c->pinned[i].p = host;
        c->pinned[i].n = bytes;
    }
    return rc;
}

static void cu_host_unpin(void *ctx, void *host)
{
    prism_cuda_ctx_t *c = ctx;
    for (size_t i = 0; host && i < PRISM_ARRAY_LEN(c->pinned); i++)
        if (c->pinned[i].p == host) {
            (void)PRISM_CUDA_TRY(cudaHostUnregister(host));
            c->pinned[i].p = NULL;
            c->pinned[i].n = 0;
        }
}

/* KV export: gather the blocks into the conversion scratch, one PCIe copy, then spread to the
 * host layout. Ids travel through the small scratch. */
static int cu_blocks_to_host(void *ctx, void *dst, size_t host_stride, const void *base, size_t block_bytes,
                             const int32_t *ids, int n)
{
    prism_cuda_ctx_t *c = ctx;
    if (n < 0 || block_bytes == 0 || (n > 0 && (!ids || !dst)) || host_stride < block_bytes) return PRISM_EINVAL;
    int per = (int)PRISM_MIN(c->conv_bytes / block_bytes, c->small_bytes / sizeof(int32_t));
    int rc = PRISM_OK;
    if (per < 1) {   /* blocks larger than the scratch: one copy each */
        for (int i = 0; i < n && rc == PRISM_OK; i++)
            rc = prism_cuda_download_raw(c, (uint8_t *)dst + (size_t)i * host_stride,
                                         (const uint8_t *)base + (size_t)ids[i] * block_bytes, block_bytes);
        return rc;
    }
    for (int i0 = 0; i0 < n && rc == PRISM_OK; i0 += per) {
        int m = PRISM_MIN(per, n - i0);
        rc = prism_cuda_upload_raw(c, c->small, ids + i0, (size_t)m * sizeof(int32_t));
        if (rc == PRISM_OK) rc = prism_cuda_kv_gather(c->stream, c->conv, base, block_bytes, c->small, m);
        if (rc != PRISM_OK) break;
        if (host_stride == block_bytes) {
            rc = prism_cuda_download_raw(c, (uint8_t *)dst + (size_t)i0 * host_stride, c->conv, (size_t)m * block_bytes);
        } else {
            for (int i = 0; i < m && rc == PRISM_OK; i++)
                rc = prism_cuda_download_raw(c, (uint8_t *)dst + (size_t)(i0 + i) * host_stride,
                                             (uint8_t *)c->conv + (size_t)i * block_bytes, block_bytes);
        }
    }
    return rc;
}

static int cu_blocks_from_host(void *ctx, void *base, size_t block_bytes, const int32_t *ids, int n, const void *src,
                               size_t host_stride)
{
    prism_cuda_ctx_t *c = ctx;
    if (n < 0 || block_bytes == 0 || (n > 0 && (!ids || !src)) || host_stride < block_bytes) return PRISM_EINVAL;
    int per = (int)PRISM_MIN(c->conv_bytes / block_bytes, c->small_bytes / sizeof(int32_t));
    int rc = PRISM_OK;
    if (per < 1) {
        for (int i = 0; i < n && rc == PRISM_OK; i++)
            rc = prism_cuda_upload_raw(c, (uint8_t *)base + (size_t)ids[i] * block_bytes,
                                       (const uint8_t *)src + (size_t)i * host_stride, block_bytes);
        return rc;
    }
    for (int i0 = 0; i0 < n && rc == PRISM_OK; i0 += per) {
        int m = PRISM_MIN(per, n - i0);
        /* Stream order keeps the previous chunk's scatter ahead of these copies into the scratch. */
        if (host_stride == block_bytes)
            rc = prism_cuda_upload_raw(c, c->conv, (const uint8_t *)src + (size_t)i0 * host_stride,
                                       (size_t)m * block_bytes);
        for (int i = 0; i < m && rc == PRISM_OK && host_stride != block_bytes; i++)
            rc = prism_cuda_upload_raw(c, (uint8_t *)c->conv + (size_t)i * block_bytes,
                                       (const uint8_t *)src + (size_t)(i0 + i) * host_stride, block_bytes);
        if (rc == PRISM_OK) rc = prism_cuda_upload_raw(c, c->small, ids + i0, (size_t)m * sizeof(int32_t));
        if (rc == PRISM_OK) rc = prism_cuda_kv_scatter(c->stream, base, block_bytes, c->small, m, c->conv);
    }
    return rc;
}

static int cu_argmax(void *ctx, int32_t *out_host, const float *logits, int n_rows, int vocab)
{
    prism_cuda_ctx_t *c = ctx;
    if (n_rows < 0 || (size_t)n_rows * sizeof(int32_t) > c->small_bytes) return PRISM_EINVAL;
    if (n_rows == 0) return PRISM_OK;
    int rc = prism_cuda_argmax(c->stream, c->small, logits, n_rows, vocab);
    return rc ? rc : prism_cuda_download_raw(c, out_host, c->small, (size_t)n_rows * sizeof(int32_t));
}

/* ---------------------------------------------------------------- sampling on the device */

static int cu_sample(void *ctx, int32_t *out_host, const float *logits, int n_rows, int vocab,
                     const prism_backend_sample_rows_t *a)
{
    prism_cuda_ctx_t *c = ctx;
    if (!a || !a->temperature || !a->top_p || !a->top_k || !a->uniform) return PRISM_EINVAL;
    if (n_rows < 0 || n_rows > PRISM_CUDA_MAX_SAMPLE_ROWS || vocab <= 0) return PRISM_EINVAL;
    if (n_rows == 0) return PRISM_OK;
    size_t pbytes = (size_t)n_rows * sizeof(prism_cuda_sample_row_t);
    size_t obytes = (size_t)n_rows * sizeof(int32_t);
    if (PRISM_ALIGN_UP(pbytes, 256) + obytes > c->small_bytes) return PRISM_ELIMIT;
    prism_cuda_sample_row_t rows[256];
    int32_t *d_out = (int32_t *)((uint8_t *)c->small + PRISM_ALIGN_UP(pbytes, 256));
    for (int r0 = 0; r0 < n_rows; r0 += 256) {   /* parameter rows go up in stack-sized pieces */
        int m = PRISM_MIN(256, n_rows - r0);
        for (int i = 0; i < m; i++) {
            int r = r0 + i;
            rows[i] = (prism_cuda_sample_row_t){a->temperature[r], a->top_p[r], a->top_k[r], 0, a->uniform[r]};
        }
        int rc = prism_cuda_upload_raw(c, (prism_cuda_sample_row_t *)c->small + r0, rows, (size_t)m * sizeof rows[0]);
        if (rc) return rc;
    }
    int rc = prism_cuda_sample_k(c->stream, d_out, logits, n_rows, vocab, c->small);
    return rc ? rc : prism_cuda_download_raw(c, out_host, d_out, obytes);
}

static int cu_penalties(void *ctx, float *logits, int n_rows, int vocab, const int32_t *counts,
                        const uint32_t *prompt_bits, const prism_backend_penalty_row_t *rows)
{
    return prism_cuda_penalties_k(ST(ctx), logits, n_rows, vocab, counts, prompt_bits, rows);
}

static int cu_token_counts_add(void *ctx, int32_t *counts, int n_slots, int vocab, const int32_t *slots,
                               const int32_t *tokens, int n)
{
    return prism_cuda_token_counts_add_k(ST(ctx), counts, n_slots, vocab, slots, tokens, n);
}

static int cu_logit_bias(void *ctx, float *logits, int n_rows, int vocab, const int32_t *offsets, const int32_t *ids,
                         const float *bias)
{
    return prism_cuda_logit_bias_k(ST(ctx), logits, n_rows, vocab, offsets, ids, bias);
}

static int cu_token_mask(void *ctx, float *logits, int n_rows, int vocab, const int32_t *masks, int words,
                         const int32_t *mask_row)
{
    return prism_cuda_token_mask_k(ST(ctx), logits, n_rows, vocab, masks, words, mask_row);
}

/* ---------------------------------------------------------------- extensions */

int prism_cuda_scatter_rows(prism_backend_t *be, float *dst, int ld, const float *src, const int32_t *rows, int n,
                            int dim)
{
    if (!be || strcmp(be->device, "cuda") != 0) return PRISM_EINVAL;
    return prism_cuda_scatter_rows_k(ST(be->ctx), dst, ld, src, rows, n, dim);
}

size_t prism_cuda_reserved_bytes(const prism_backend_t *be)
{
    return be && strcmp(be->device, "cuda") == 0 ? ((const prism_cuda_ctx_t *)be->ctx)->reserved : 0;
}

void *prism_cuda_stream(const prism_backend_t *be)
{
    return be && strcmp(be->device, "cuda") == 0 ? (void *)((const prism_cuda_ctx_t *)be->ctx)->stream : NULL;
}

int prism_cuda_device(const prism_backend_t *be)
{
    return be && strcmp(be->device, "cuda") == 0 ? ((const prism_cuda_ctx_t *)be->ctx)->device : -1;
}

/* ---------------------------------------------------------------- create / destroy */

static void cu_destroy(void *ctx)
{
    prism_cuda_ctx_t *c = ctx;
    if (!c) return;
    if (c->stream) cudaStreamSynchronize(c->stream);
    prism_cuda_gemm_free(c);
    for (int b = 0; b < 2; b++)
        if (c->stage_ev[b]) cudaEventDestroy(c->stage_ev[b]);
    if (c->stage[0]) cudaFreeHost(c->stage[0]);
    if (c->pool.base) cudaFree(c->pool.base);
    if (c->stream) cudaStreamDestroy(c->stream);
    prism_cuda_pool_destroy(&c->pool);
    prism_free(c);
}

static void *reserve(prism_cuda_ctx_t *c, size_t bytes)
{
    void *p = prism_cuda_pool_take(&c->pool, bytes);
    if (p) c->reserved += PRISM_ALIGN_UP(bytes, PRISM_CUDA_POOL_ALIGN);
    return p;
}

prism_backend_t *prism_backend_cuda_create(int device, size_t pool_bytes, int *status)
{
    int st_dummy;
    if (!status) status = &st_dummy;
    *status = PRISM_OK;
    int n_dev = prism_cuda_device_count();
    if (n_dev <= 0) {
        PRISM_ERROR("cuda: no CUDA device is available (no GPU or no driver); use --device cpu");
        *status = PRISM_ENOTSUP;
        return NULL;
    }
    if (device < 0 || device >= n_dev) {
        PRISM_ERROR("cuda: device %d does not exist (%d visible)", device, n_dev);
        *status = PRISM_EINVAL;
        return NULL;
    }
    prism_backend_t *be = prism_calloc(1, sizeof *be);
    prism_cuda_ctx_t *c = prism_calloc(1, sizeof *c);
    int rc = PRISM_ENOMEM;
    if (!be || !c) goto fail;
    c->device = device;
    if ((rc = PRISM_CUDA_TRY(cudaSetDevice(device)))) goto fail;
    struct cudaDeviceProp prop;
    if ((rc = PRISM_CUDA_TRY(cudaGetDeviceProperties(&prop, device)))) goto fail;
    c->n_sm = prop.multiProcessorCount;
    snprintf(c->name, sizeof c->name, "cuda:%d (%s, sm_%d%d)", device, prop.name, prop.major, prop.minor);
    if (prop.major < 8) {
        PRISM_ERROR("cuda: %s has compute capability %d.%d; bf16 GEMMs need 8.0+", prop.name, prop.major, prop.minor);
        rc = PRISM_ENOTSUP;
        goto fail;
    }
    if ((rc = PRISM_CUDA_TRY(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)))) goto fail;

    size_t free_b = 0, total_b = 0;
    if ((rc = PRISM_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b)))) goto fail;
    if (pool_bytes == 0) pool_bytes = free_b > FREE_MARGIN * 2 ? free_b - FREE_MARGIN : free_b / 2;
    pool_bytes = PRISM_ALIGN_UP(pool_bytes, PRISM_CUDA_POOL_ALIGN);
    size_t conv = PRISM_MIN(CONV_MAX, PRISM_MAX(CONV_MIN, pool_bytes / 16));
    size_t need = CUBLAS_WS + conv + ATTN_PART + SMALL_BYTES + 4 * PRISM_CUDA_POOL_ALIGN;
    if (pool_bytes < need + ((size_t)16 << 20)) {
        char a[32];
        PRISM_ERROR("cuda: pool of %s is too small (internal scratch alone needs %s)",
                    prism_fmt_bytes(pool_bytes, a, sizeof a), prism_fmt_bytes(need, (char[32]){0}, 32));
        rc = PRISM_EINVAL;
        goto fail;
    }
    /* The one device allocation of this backend. */
    void *dev = NULL;
    prism_cuda_count_malloc();
    if ((rc = PRISM_CUDA_TRY(cudaMalloc(&dev, pool_bytes)))) {
        char a[32], b[32];
        PRISM_ERROR("cuda: cannot allocate a %s pool (%s free)", prism_fmt_bytes(pool_bytes, a, sizeof a),
                    prism_fmt_bytes(free_b, b, sizeof b));
        goto fail;
    }
    if ((rc = prism_cuda_pool_init(&c->pool, dev, pool_bytes, PRISM_CUDA_MAX_SEGS))) {
        cudaFree(dev);
        goto fail;
    }

    c->cublas_ws_bytes = CUBLAS_WS;
    c->cublas_ws = reserve(c, CUBLAS_WS);
    c->conv_bytes = conv;
    c->conv = reserve(c, conv);
    c->attn_part_floats = ATTN_PART / 4;
    c->attn_part = reserve(c, ATTN_PART);
    c->small_bytes = SMALL_BYTES;
    c->small = reserve(c, SMALL_BYTES);
    if (!c->cublas_ws || !c->conv || !c->attn_part || !c->small) { rc = PRISM_ENOMEM; goto fail; }

    c->stage_bytes = STAGE_BYTES;
    prism_cuda_count_malloc();
    if ((rc = PRISM_CUDA_TRY(cudaHostAlloc((void **)&c->stage[0], 2 * STAGE_BYTES, cudaHostAllocPortable)))) {
        c->stage[0] = NULL;
        goto fail;
    }
    c->stage[1] = c->stage[0] + STAGE_BYTES;
    for (int b = 0; b < 2; b++)
        if ((rc = PRISM_CUDA_TRY(cudaEventCreateWithFlags(&c->stage_ev[b], cudaEventDisableTiming)))) goto fail;

    if ((rc = prism_cuda_gemm_init(c))) goto fail;
    if ((rc = prism_cuda_attn_paged_init()) || (rc = prism_cuda_attn_decode_init()) ||
        (rc = prism_cuda_attn_dense_init()) || (rc = prism_cuda_attn_varlen_init()))
        goto fail;

    be->i = (prism_backend_i){
        .name = cu_name,
        .alloc = cu_alloc, .free = cu_free,
        .pool_used = cu_pool_used, .pool_peak = cu_pool_peak, .pool_cap = cu_pool_cap,
        .upload = cu_upload, .download = cu_download, .copy = cu_copy, .memset0 = cu_memset0,
        .copy_2d = cu_copy_2d, .upload_convert = cu_upload_convert, .synchronize = cu_sync,
        .matmul = prism_cuda_matmul,
        .rmsnorm = cu_rmsnorm, .layernorm = cu_layernorm,
        .rope = cu_rope,
        .act = cu_act, .silu_mul = cu_silu_mul, .add = cu_add, .scale = cu_scale,
        .get_rows = cu_get_rows, .im2patch = cu_im2patch,
        .kv_write = cu_kv_write,
        .attn_paged = cu_attn_paged, .attn_decode = cu_attn_decode, .attn_dense = cu_attn_dense,
        .blocks_to_host = cu_blocks_to_host, .blocks_from_host = cu_blocks_from_host,
        .host_pin = cu_host_pin, .host_unpin = cu_host_unpin,
        .argmax = cu_argmax,
        .sample = cu_sample, .penalties = cu_penalties, .token_counts_add = cu_token_counts_add,
        .logit_bias = cu_logit_bias, .token_mask = cu_token_mask,
        .head_rmsnorm = cu_head_rmsnorm, .scale_rows = cu_scale_rows, .moe_route = cu_moe_route,
        .matmul_grouped = cu_matmul_grouped, .moe_combine = cu_moe_combine, .pixel_shuffle = cu_pixel_shuffle,
        .rope_multi = cu_rope_multi, .attn_varlen = cu_attn_varlen, .add_rows = cu_add_rows,
        .fill_random = cu_fill_random,
        .destroy = cu_destroy,
    };
    be->ctx = c;
    be->device = "cuda";
    be->weight_dtype = PRISM_DTYPE_BF16;
    be->compute_dtype = PRISM_DTYPE_BF16;   /* cu_matmul rounds x to bf16 for the tensor cores */
    be->n_threads = 1;
    {
        char a[32], b[32];
        PRISM_INFO("cuda: %s, %d SMs, pool %s (%s internal scratch), %s free before", c->name, c->n_sm,
                   prism_fmt_bytes(pool_bytes, a, sizeof a), prism_fmt_bytes(c->reserved, b, sizeof b),
                   prism_fmt_bytes(free_b, (char[32]){0}, 32));
    }
    return be;
fail:
    *status = rc ? rc : PRISM_ENOMEM;
    if (c) cu_destroy(c);
    prism_free(be);
    return NULL;
}
