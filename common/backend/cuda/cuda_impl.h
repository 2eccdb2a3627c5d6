/* Internal to the CUDA backend: the context, error-check helpers and the kernel entry points.
 *
 * Each op lives in its own .cu file: a `static __global__` kernel, a launcher that takes a
 * cudaStream_t, and the extern "C" entry point declared here, which checks shapes and dtypes,
 * launches and checks the launch. The host side (pool, transfers, cuBLAS) is plain C. */
#ifndef PRISM_BACKEND_CUDA_IMPL_H
#define PRISM_BACKEND_CUDA_IMPL_H

#if defined(__cplusplus) && !defined(_Noreturn)
#define _Noreturn [[noreturn]]   /* core.h is C11; nvcc compiles .cu files as C++ */
#endif
#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_pool.h"

#include <cuda_runtime_api.h>
#include <pthread.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Limits the kernels rely on for their fixed shared-memory and register tiles. */
#define PRISM_CUDA_MAX_HEAD_DIM  256
#define PRISM_CUDA_MAX_ROWS      (1 << 24)   /* rows per launch (grid.x bound with margin) */
#define PRISM_CUDA_MAX_SAMPLE_ROWS 4096

/* Logs a failed CUDA call with file:line and returns a prism status (PRISM_OK when ok). */
int prism_cuda_status(cudaError_t e, const char *what, const char *file, int line);
#define PRISM_CUDA_TRY(call) prism_cuda_status((call), #call, __FILE__, __LINE__)
/* After every launch: catches bad configurations (and, in debug, asynchronous faults). */
#define PRISM_CUDA_LAUNCHED(name) prism_cuda_status(cudaGetLastError(), name, __FILE__, __LINE__)

void prism_cuda_count_malloc(void);

typedef struct {
    int device;
    char name[320];
    int n_sm;
    cudaStream_t stream;
    void *cublas;                 /* cublasHandle_t */

    prism_cuda_pool_t pool;       /* the one device allocation, carved (cuda_pool.c) */

    /* scratch carved at create */
    void *cublas_ws;   size_t cublas_ws_bytes;
    void *conv;        size_t conv_bytes;    /* bf16 matmul inputs; fp32 staging for converts / KV gathers */
    float *attn_part;  size_t attn_part_floats;  /* split-K decode partials */
    void *small;       size_t small_bytes;   /* ids / sampling parameters / argmax results */
    size_t reserved;

    /* pinned host staging, double-buffered */
    uint8_t *stage[2];
    size_t stage_bytes;
    cudaEvent_t stage_ev[2];
    int stage_next;
    /* host ranges page-locked by host_pin (the KV swap region): copied by DMA, not staged */
    struct { const uint8_t *p; size_t n; } pinned[4];
} prism_cuda_ctx_t;

/* ---- host-side helpers in cuda_backend.c ---- */
int prism_cuda_upload_raw(prism_cuda_ctx_t *c, void *dst, const void *src, size_t bytes);
int prism_cuda_download_raw(prism_cuda_ctx_t *c, void *dst, const void *src, size_t bytes);

/* ---- matmul (cuda_matmul.c, cuBLAS) ---- */
int prism_cuda_matmul(void *ctx, float *y, int ldy, const float *x, int ldx, const void *w,
                      prism_dtype_t wdt, const float *b, int M, int N, int K, bool accumulate);
int prism_cuda_gemm_init(prism_cuda_ctx_t *c);
void prism_cuda_gemm_free(prism_cuda_ctx_t *c);

/* ---- kernels: one .cu file each ---- */
int prism_cuda_rmsnorm(cudaStream_t st, float *y, const float *x, const float *w, int n_rows, int dim, float eps);
int prism_cuda_layernorm(cudaStream_t st, float *y, const float *x, const float *w, const float *b,
                         int n_rows, int dim, float eps);
int prism_cuda_rope(cudaStream_t st, float *x, int ld, int n_tokens, int n_heads, int head_dim, int rot_dim,
                    const int32_t *pos, const float *inv_freq, prism_rope_mode_t mode);
int prism_cuda_act(cudaStream_t st, prism_act_t act, float *y, const float *x, size_t n);
int prism_cuda_silu_mul(cudaStream_t st, float *out, const float *gate, const float *up, int ld, int n_rows, int dim);
int prism_cuda_add(cudaStream_t st, float *y, const float *a, const float *b, size_t n, size_t nb);
int prism_cuda_scale(cudaStream_t st, float *y, const float *x, float s, size_t n);
int prism_cuda_get_rows(cudaStream_t st, float *out, const void *table, prism_dtype_t dt, int n_table,
                        const int32_t *ids, int n, int dim);
int prism_cuda_scatter_rows_k(cudaStream_t st, float *dst, int ld, const float *src, const int32_t *rows,
                              int n, int dim);
int prism_cuda_im2patch(cudaStream_t st, float *out, const float *pixels, int n_img, int C, int H, int W, int p);
int prism_cuda_kv_write(cudaStream_t st, float *k_cache, float *v_cache, const float *k, const float *v, int ld,
                        const int32_t *slots, int n_tokens, int n_kv_heads, int head_dim);
/* f32 [rows][ld] -> dt [rows][cols] contiguous (rows = 1, ld = cols for flat arrays). */
int prism_cuda_convert(cudaStream_t st, void *dst, prism_dtype_t dt, const float *src, size_t rows, size_t cols,
                       size_t ld);
/* y[r][j] = b[j] (+ y[r][j] when accumulate), rows ldy apart. */
int prism_cuda_bias_rows(cudaStream_t st, float *y, int ldy, const float *b, int M, int N, bool accumulate);
int prism_cuda_attn_paged(cudaStream_t st, float *out, int ldo, const float *q, int ldq,
                          const float *k_cache, const float *v_cache, const prism_attn_meta_t *meta,
                          int n_heads, int n_kv_heads, int head_dim, float scale);
int prism_cuda_attn_decode(cudaStream_t st, float *out, int ldo, const float *q, int ldq,
                           const float *k_cache, const float *v_cache, const prism_attn_meta_t *meta,
                           int n_heads, int n_kv_heads, int head_dim, float scale,
                           float *part, size_t part_floats, int n_sm);
int prism_cuda_attn_dense(cudaStream_t st, float *out, int ldo, const float *q, int ldq, const float *k, int ldk,
                          const float *v, int ldv, int n_seqs, int seq_len, int n_heads, int n_kv_heads,
                          int head_dim, float scale, bool causal);
/* dst (device, contiguous) <- n blocks base + ids[i]*block_bytes; and the reverse. ids device. */
int prism_cuda_kv_gather(cudaStream_t st, void *dst, const void *base, size_t block_bytes, const int32_t *ids, int n);
int prism_cuda_kv_scatter(cudaStream_t st, void *base, size_t block_bytes, const int32_t *ids, int n, const void *src);
int prism_cuda_argmax(cudaStream_t st, int32_t *out, const float *logits, int n_rows, int vocab);
/* Llama-4 ops (semantics in backend.h). */
int prism_cuda_head_rmsnorm(cudaStream_t st, float *x, int ld, int n_tokens, int n_heads, int head_dim, const float *w,
                            float eps);
int prism_cuda_scale_rows(cudaStream_t st, float *x, int ld, int n_rows, int dim, const float *s);
int prism_cuda_moe_route(cudaStream_t st, const float *logits, int n_tokens, int n_experts, int top_k, int32_t *choice,
                         int32_t *order, float *weight, int32_t *offsets, int32_t *slot);
int prism_cuda_matmul_grouped(cudaStream_t st, float *y, int ldy, const float *x, int ldx, const void *w,
                              prism_dtype_t wdt, const int32_t *offsets, int n_groups, int M, int N, int K);
int prism_cuda_moe_combine(cudaStream_t st, float *y, int ldy, const float *src, const int32_t *slot, int n_tokens,
                           int top_k, int dim);
int prism_cuda_pixel_shuffle(cudaStream_t st, float *out, const float *x, int n_img, int rows_per_img, int g, int C,
                             int s);
int prism_cuda_fill_random(cudaStream_t st, void *dst, prism_dtype_t dt, size_t n, uint64_t seed, float std);
/* Qwen-VL ops (semantics in backend.h). */
int prism_cuda_rope_multi(cudaStream_t st, float *x, int ld, int n_tokens, int n_heads, int head_dim, const int32_t *pos,
                          int pos_ld, const float *inv_freq, const prism_rope_sections_t *sec);
int prism_cuda_attn_varlen(cudaStream_t st, float *out, int ldo, const float *q, int ldq, const float *k, int ldk,
                           const float *v, int ldv, const int32_t *cu, int n_seqs, int max_len, int n_heads,
                           int n_kv_heads, int head_dim, float scale);
int prism_cuda_add_rows(cudaStream_t st, float *y, int ldy, const float *src, int lds, const int32_t *rows, int n,
                        int dim);

typedef struct {
    float temperature, top_p;
    int32_t top_k;
    int32_t pad;
    double uniform;
} prism_cuda_sample_row_t;
int prism_cuda_sample_k(cudaStream_t st, int32_t *out, const float *logits, int n_rows, int vocab,
                        const prism_cuda_sample_row_t *rows);

/* logits processors (backend.h: the sampling ops) */
int prism_cuda_penalties_k(cudaStream_t st, float *logits, int n_rows, int vocab, const int32_t *counts,
                           const uint32_t *prompt_bits, const prism_backend_penalty_row_t *rows);
int prism_cuda_token_counts_add_k(cudaStream_t st, int32_t *counts, int n_slots, int vocab, const int32_t *slots,
                                  const int32_t *tokens, int n);
int prism_cuda_logit_bias_k(cudaStream_t st, float *logits, int n_rows, int vocab, const int32_t *offsets,
                            const int32_t *ids, const float *bias);
int prism_cuda_token_mask_k(cudaStream_t st, float *logits, int n_rows, int vocab, const int32_t *masks, int words,
                            const int32_t *mask_row);

/* Raises the dynamic shared-memory limit of the attention kernels (called once at create). */
int prism_cuda_attn_paged_init(void);
int prism_cuda_attn_decode_init(void);
int prism_cuda_attn_dense_init(void);
int prism_cuda_attn_varlen_init(void);

#ifdef __cplusplus
}
#endif

#endif
