/* Internal to the CPU backend: context, a persistent worker pool and kernel entry points. */
#ifndef PRISM_BACKEND_CPU_IMPL_H
#define PRISM_BACKEND_CPU_IMPL_H

#include "backend/backend.h"
#include "backend/cpu/cpu_kern.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#define PRISM_CPU_MAX_THREADS 256

/* Fork-join pool of n-1 persistent threads plus the caller. Tasks are split by ith/nth; the
 * caller runs ith 0. Created once, so running a task never allocates. */
typedef void (*prism_cpu_task_fn)(void *arg, int ith, int nth);

typedef struct prism_cpu_pool {
    int n_threads;
    pthread_t *threads;           /* [n_threads-1] */
    void *args;                   /* [n_threads-1] per-worker start arguments */
    int n_active;                 /* nth of the running task */
    pthread_mutex_t mu;
    pthread_cond_t start_cv, done_cv;
    prism_cpu_task_fn fn;
    void *arg;
    atomic_uint_fast64_t generation;   /* bumped once per task; workers wait for a change */
    atomic_int pending;                /* workers that have not finished the current task */
    atomic_bool stop;
} prism_cpu_pool_t;

int  prism_cpu_pool_init(prism_cpu_pool_t *p, int n_threads);
void prism_cpu_pool_free(prism_cpu_pool_t *p);
/* Runs fn(arg, ith, nth) for ith in [0, nth); nth <= n_threads, 1 runs inline. */
void prism_cpu_pool_run(prism_cpu_pool_t *p, int nth, prism_cpu_task_fn fn, void *arg);

/* Limits the attention kernels rely on for their fixed scratch. */
#define PRISM_CPU_MAX_HEAD_DIM 512
#define PRISM_CPU_MAX_GQA      64    /* q heads per kv head */
/* (token, q head) rows per tile: each packed K/V tile serves this many rows, so packing is a
 * small share of the work; fewer rows for head_dim > 64 so Q and O stay within QO floats. */
#define PRISM_CPU_ATTN_ROWS    256
#define PRISM_CPU_ATTN_QO      (PRISM_CPU_ATTN_ROWS * 64)   /* floats of packed Q, and of O */
/* Per-thread attention scratch (floats): packed Q, O accumulators, packed Kᵀ and V, scores. */
#define PRISM_CPU_ATTN_SCRATCH \
    (2 * PRISM_CPU_ATTN_QO + 2 * PRISM_CPU_MAX_HEAD_DIM * PRISM_CPU_ATTN_NK + PRISM_CPU_ATTN_ROWS * PRISM_CPU_ATTN_NK)

/* Per-thread fp32 copy of a bf16 weight slice (floats, 16 MiB): a matmul of many rows widens its
 * columns chunk by chunk into it for sgemm. Chunks must stay wide: at 256 columns (a 4 MiB
 * scratch, K 4096) a 2,048-token prefill ran 1.1-1.35x slower than with fp32 weights; at 16 MiB
 * within a few %. Bounds K of a bf16 matmul to this / 16 (/ 32 when --compute-dtype bf16 runs
 * without the bf16 dot products: half of it then holds the rounded x rows). */
#define PRISM_CPU_WIDEN_FLOATS (1 << 22)

/* One packed matmul weight: [N][K] bf16 rearranged into bytes at p (prism_cpu_bf16p_pack). */
typedef struct {
    const uint8_t *p;
    size_t bytes;
    int N, K;
} prism_cpu_packed_t;

typedef struct {
    prism_cpu_pool_t pool;
    const prism_cpu_kern_t *k;    /* kernels for this CPU (or PRISM_CPU_ISA) */
    float *attn_scratch;          /* [n_threads][PRISM_CPU_ATTN_SCRATCH], carved at create */
    float *widen_scratch;         /* [n_threads][PRISM_CPU_WIDEN_FLOATS] once weights are bf16, else NULL */
    size_t widen_floats;          /* of each thread's scratch, what a chunk may fill (tests narrow it) */
    bool bf16dp;                  /* --compute-dtype bf16: matmuls on bf16 weights round x to bf16; the
                                   * widen scratch then holds the rounded rows of x */
    /* weights in the packed layout (cpu_weight_pack) of matmul_bf16p (bf16 compute) or matmul_f32p
     * (fp32 compute; the compute dtype cannot change once one is here), sorted by address: matmul
     * looks its w up here; freeing the block that holds one drops it (under mem_mu) */
    prism_cpu_packed_t *packed;
    int n_packed, cap_packed;
    size_t pool_cap, pool_used, pool_peak;   /* memory pool accounting (bytes) */
    pthread_mutex_t mem_mu;
} prism_cpu_ctx_t;

/* Work a thread should get before another is woken: multiply-adds for matmuls, elements for
 * elementwise and row ops. */
#define PRISM_CPU_MATMUL_GRAIN (1L << 19)
#define PRISM_CPU_EW_GRAIN     (1L << 15)

/* Threads for a job of `work` units where one thread should get at least `grain` of them. */
static inline int prism_cpu_nth(const prism_cpu_ctx_t *c, size_t work, size_t grain)
{
    size_t n = grain ? work / grain : work;
    if (n < 1) n = 1;
    return n < (size_t)c->pool.n_threads ? (int)n : c->pool.n_threads;
}

int prism_cpu_attn_paged(void *ctx, float *out, int ldo, const float *q, int ldq,
                         const float *k_cache, const float *v_cache, const prism_attn_meta_t *meta,
                         int n_heads, int n_kv_heads, int head_dim, float scale);
int prism_cpu_attn_dense(void *ctx, float *out, int ldo, const float *q, int ldq, const float *k, int ldk,
                         const float *v, int ldv, int n_seqs, int seq_len, int n_heads, int n_kv_heads,
                         int head_dim, float scale, bool causal);
int prism_cpu_attn_varlen(void *ctx, float *out, int ldo, const float *q, int ldq, const float *k, int ldk,
                          const float *v, int ldv, const int32_t *cu, int n_seqs, int max_len, int n_heads,
                          int n_kv_heads, int head_dim, float scale);

/* Columns of a bf16 weight slice with K inputs widened at once into a thread's widen scratch
 * (whole 16-column groups; 0 when K is too long for it). */
static inline int prism_cpu_widen_cols(const prism_cpu_ctx_t *c, int K)
{
    size_t n = c->widen_floats;
    return K > 0 && (size_t)K * 16 <= n ? (int)(n / (size_t)K / 16 * 16) : 0;
}

/* Llama-4 ops (cpu_llama4.c); semantics in backend.h. */
int prism_cpu_head_rmsnorm(void *ctx, float *x, int ld, int n_tokens, int n_heads, int head_dim, const float *w,
                           float eps);
int prism_cpu_scale_rows(void *ctx, float *x, int ld, int n_rows, int dim, const float *s);
int prism_cpu_moe_route(void *ctx, const float *logits, int n_tokens, int n_experts, int top_k, int32_t *choice,
                        int32_t *order, float *weight, int32_t *offsets, int32_t *slot);
int prism_cpu_matmul_grouped(void *ctx, float *y, int ldy, const float *x, int ldx, const void *w, prism_dtype_t wdt,
                             const int32_t *offsets, int n_groups, int M, int N, int K);
int prism_cpu_moe_combine(void *ctx, float *y, int ldy, const float *src, const int32_t *slot, int n_tokens, int top_k,
                          int dim);
int prism_cpu_pixel_shuffle(void *ctx, float *out, const float *x, int n_img, int rows_per_img, int g, int C, int s);

#endif
