/* backend: a table of tensor operations over device buffers, chosen at run time.
 *
 * A backend is a struct of function pointers plus a `void *ctx` (ggml_backend_i style). The CPU
 * backend (fp32: OpenBLAS sgemm and vectorised kernels on its own thread pool, see
 * common/backend/cpu/) is always built and is the reference for tests; a CUDA backend lives in
 * common/backend/cuda/ and fills the same table.
 *
 *   prism_backend_t *be = NULL;
 *   int rc = prism_backend_create("cpu", 4, 1 << 30, &be);      // device, threads, pool bytes
 *   float *x = prism_backend_buf_alloc(be, n * sizeof(float));       // device memory from the pool
 *   be->i.upload(be->ctx, x, host, n * sizeof(float));
 *   be->i.rmsnorm(be->ctx, y, x, w, rows, dim, 1e-5f);
 *   be->i.download(be->ctx, host, y, n * sizeof(float));
 *   prism_backend_buf_free(be, x);
 *   prism_backend_destroy(be);
 *
 * Conventions for every op:
 *  - Pointers named as tensors are DEVICE pointers (on the CPU backend device == host). Device
 *    pointers may be offset with byte arithmetic on the host ((char *)p + off); callers carve
 *    large allocations into named tensors this way.
 *  - Integer index arrays (token ids, positions, slots, block tables, seq offsets) are DEVICE
 *    int32 arrays too, uploaded once per forward by the caller; scalar sizes are host ints.
 *  - Activations are always float32. Matmul weights and embedding tables are in the backend's
 *    `weight_dtype` (fp32 on CPU unless bf16 is asked for, bf16 on CUDA); norm weights and biases
 *    are always float32.
 *  - Matrices are row-major. A "row stride" is in elements and lets ops read views (e.g. the q
 *    part of a fused qkv row) without copies.
 *  - Ops are asynchronous on devices with streams; `synchronize` waits; download is synchronous.
 *  - Return PRISM_OK or a negative prism_status_t for bad arguments; ops never allocate memory
 *    (scratch is fixed at create time, or by set_weight_dtype before a model loads), so a forward
 *    pass can assert no allocation.
 *  - A NULL optional member means "not supported"; required members are never NULL.
 */
#ifndef PRISM_BACKEND_H
#define PRISM_BACKEND_H

#include "core/core.h"
#include "backend/dtype.h"

/* RoPE pairing. */
typedef enum {
    PRISM_ROPE_NEOX       = 0,  /* rotate_half: (x[i], x[i+D/2]) — Llama/Qwen in HF layout */
    PRISM_ROPE_INTERLEAVE = 1,  /* (x[2i], x[2i+1]) — Llama-4 */
} prism_rope_mode_t;

/* RoPE whose position depends on the frequency (rope_multi): section of each rotated pair. */
#define PRISM_ROPE_MAX_PAIRS 256
#define PRISM_ROPE_MAX_SECTIONS 4
typedef struct {
    uint8_t of[PRISM_ROPE_MAX_PAIRS];   /* pair j takes its position from row of[j] (< PRISM_ROPE_MAX_SECTIONS) */
} prism_rope_sections_t;

/* Per-row parameters of the sample op (HOST arrays of n_rows). uniform[r] is the request RNG's next
 * draw in [0, 1) (prism_rng_uniform), used only when the row is not greedy. */
typedef struct {
    const float *temperature;   /* < 1e-5 (or NaN): greedy */
    const float *top_p;         /* (0, 1]; >= 1 off */
    const int32_t *top_k;       /* <= 0 off; 1 greedy */
    const double *uniform;
} prism_backend_sample_rows_t;

/* Penalties of one logits row (the penalties op reads a DEVICE array of them). */
typedef struct {
    float presence, frequency, repetition;   /* 0, 0, 1 = off */
    int32_t slot;                            /* token-count table row; < 0 = no penalties for this row */
} prism_backend_penalty_row_t;

/* Most experts a token may be routed to (moe_route's top_k). */
#define PRISM_MOE_MAX_TOPK 8

/* Describes where each new token's sequence sits in the paged KV cache, for attention over a
 * flattened batch of sequences. All arrays are DEVICE int32 arrays. */
typedef struct {
    int n_seqs;
    int n_tokens;                 /* total query tokens = seq_start[n_seqs] */
    int max_q_len;                /* max over seqs of seq_start[s+1]-seq_start[s] (launch sizing) */
    int max_ctx_len;              /* max over seqs of pos0[s] + q_len(s) */
    int block_size;               /* tokens per KV block */
    int max_blocks_per_seq;       /* row stride of block_tables */
    const int32_t *seq_start;     /* [n_seqs+1] offsets of each sequence's queries */
    const int32_t *pos0;          /* [n_seqs] tokens already cached before this step */
    const int32_t *block_tables;  /* [n_seqs][max_blocks_per_seq] block ids (padded rows) */
    /* Chunked (local) attention, Llama-4's attention_chunk_size: 0 = plain causal; > 0: the query
     * at position p sees cached positions k with k <= p and k / chunk == p / chunk. Last so
     * positional initialisers that stop at block_tables keep meaning plain causal. */
    int chunk;
} prism_attn_meta_t;

typedef struct prism_backend_i {
    const char *(*name)(void *ctx);

    /* ---- memory ----
     * alloc takes from the backend's pool sized at create time (NULL when it is exhausted); the
     * returned pointer is aligned to at least 256 bytes. */
    void *(*alloc)(void *ctx, size_t bytes);
    void  (*free)(void *ctx, void *p);
    size_t (*pool_used)(void *ctx);
    size_t (*pool_peak)(void *ctx);
    size_t (*pool_cap)(void *ctx);        /* 0 = unlimited */
    int (*upload)(void *ctx, void *dst, const void *src_host, size_t bytes);
    int (*download)(void *ctx, void *dst_host, const void *src, size_t bytes);
    int (*copy)(void *ctx, void *dst, const void *src, size_t bytes);
    int (*memset0)(void *ctx, void *dst, size_t bytes);
    /* dst[r*dst_stride ..] = src[r*src_stride ..], row_bytes each, strides in bytes. */
    int (*copy_2d)(void *ctx, void *dst, size_t dst_stride, const void *src, size_t src_stride,
                   size_t row_bytes, size_t n_rows);
    /* Host float32 [n] -> device in `dt` (weights at load time; converts on the host side). */
    int (*upload_convert)(void *ctx, void *dst, prism_dtype_t dt, const float *src_host, size_t n);
    int (*synchronize)(void *ctx);

    /* ---- linear algebra ----
     * y[M][N] (row stride ldy) = x[M][K] (row stride ldx) · W[N][K]ᵀ (+ b[N]) (+ y when accumulate).
     * W dtype wdt; b may be NULL. accumulate fuses residual adds. */
    int (*matmul)(void *ctx, float *y, int ldy, const float *x, int ldx, const void *w,
                  prism_dtype_t wdt, const float *b, int M, int N, int K, bool accumulate);

    /* ---- norms (rows of dim elements, contiguous; y == x allowed) ---- */
    int (*rmsnorm)(void *ctx, float *y, const float *x, const float *w, int n_rows, int dim, float eps);
    int (*layernorm)(void *ctx, float *y, const float *x, const float *w, const float *b,
                     int n_rows, int dim, float eps);

    /* ---- RoPE, in place on x[n_tokens] rows of stride ld; n_heads heads of head_dim each;
     * the first rot_dim dims of each head rotate (rot_dim == head_dim for Llama). inv_freq is a
     * device float[rot_dim/2] precomputed by the caller (llama3 scaling already applied);
     * pos[n_tokens] device int32. cos/sin are computed in fp32. */
    int (*rope)(void *ctx, float *x, int ld, int n_tokens, int n_heads, int head_dim, int rot_dim,
                const int32_t *pos, const float *inv_freq, prism_rope_mode_t mode);

    /* ---- elementwise ----
     * act: y[i] = f(x[i]) for n elements (y may equal x).
     * silu_mul: out[r][i] = silu(gate[r*ld + i]) * up[r*ld + i]; out is [n_rows][dim] contiguous.
     * add: y[i] = a[i] + b[i % nb] (nb == n: plain residual; nb < n: broadcast rows). */
    int (*act)(void *ctx, prism_act_t act, float *y, const float *x, size_t n);
    int (*silu_mul)(void *ctx, float *out, const float *gate, const float *up, int ld,
                    int n_rows, int dim);
    int (*add)(void *ctx, float *y, const float *a, const float *b, size_t n, size_t nb);
    int (*scale)(void *ctx, float *y, const float *x, float s, size_t n);

    /* ---- gathers ----
     * get_rows: out[i][dim] (f32) = table[ids[i]][dim] (dtype dt); embedding lookup and row
     * selection (e.g. the last token of each sequence before lm_head). ids device int32[n].
     * Ids outside [0, n_table) produce zero rows (validated by the caller beforehand). */
    int (*get_rows)(void *ctx, float *out, const void *table, prism_dtype_t dt, int n_table,
                    const int32_t *ids, int n, int dim);
    /* im2patch: pixels [n_img][C][H][W] -> out [n_img * (H/p)*(W/p)][C*p*p], patches row-major,
     * feature index c*p*p + ky*p + kx (matches Conv2d weight [out][C][p][p] flattened). */
    int (*im2patch)(void *ctx, float *out, const float *pixels, int n_img, int C, int H, int W, int p);

    /* ---- attention ----
     * All attention is blockwise with online softmax: memory is O(block) per worker, never an
     * N×N score matrix. Scale multiplies q·k. q/out rows: [n_tokens][n_heads*head_dim] with row
     * stride ldq/ldo (elements). GQA: kv head = q head / (n_heads / n_kv_heads).
     *
     * KV cache layout, per layer: k_cache/v_cache [n_blocks][block_size][n_kv_heads][head_dim].
     *
     * kv_write: writes k/v rows (row stride ld) of n_tokens new tokens into slots
     *   (slot = block_id*block_size + offset; device int32[n_tokens]; slot < 0 skips the token). */
    int (*kv_write)(void *ctx, float *k_cache, float *v_cache, const float *k, const float *v, int ld,
                    const int32_t *slots, int n_tokens, int n_kv_heads, int head_dim);
    /* attn_paged: causal attention of each sequence's new queries over its cached context
     * (pos0 + q_len tokens, the new ones already written by kv_write), restricted to the query's
     * own chunk when meta->chunk > 0. Prefill chunks and decode steps mix freely in one call. */
    int (*attn_paged)(void *ctx, float *out, int ldo, const float *q, int ldq,
                      const float *k_cache, const float *v_cache, const prism_attn_meta_t *meta,
                      int n_heads, int n_kv_heads, int head_dim, float scale);
    /* attn_decode: the q_len == 1 special case of attn_paged (split-K friendly on GPUs).
     * Optional: when NULL callers use attn_paged. */
    int (*attn_decode)(void *ctx, float *out, int ldo, const float *q, int ldq,
                       const float *k_cache, const float *v_cache, const prism_attn_meta_t *meta,
                       int n_heads, int n_kv_heads, int head_dim, float scale);
    /* attn_dense: attention over contiguous q/k/v, n_seqs sequences of seq_len tokens each
     * (ViT tiles), rows of stride ld{q,k,v,o}; non-causal unless causal. */
    int (*attn_dense)(void *ctx, float *out, int ldo, const float *q, int ldq, const float *k, int ldk,
                      const float *v, int ldv, int n_seqs, int seq_len, int n_heads, int n_kv_heads,
                      int head_dim, float scale, bool causal);

    /* ---- Llama-4 ops (optional: NULL means the backend cannot run Llama-4; the model refuses to
     * load then) ----
     * head_rmsnorm: in place over n_tokens rows of stride ld, each holding n_heads heads of
     *   head_dim: x = x * rsqrt(mean(x^2) + eps), times w[head_dim] when w != NULL (fp32).
     *   Llama-4's QK norm is the w == NULL case.
     * scale_rows: x[r][0..dim) *= s[r] for n_rows rows of stride ld; s is a DEVICE float[n_rows]
     *   (per-position attention temperature of q, router scores on expert inputs). */
    int (*head_rmsnorm)(void *ctx, float *x, int ld, int n_tokens, int n_heads, int head_dim, const float *w,
                        float eps);
    int (*scale_rows)(void *ctx, float *x, int ld, int n_rows, int dim, const float *s);
    /* moe_route: router logits [n_tokens][n_experts] -> the top_k experts of each token (largest
     *   logits; equal logits: lower expert first), each scored sigmoid(logit) (HF Llama4Router).
     *   Writes, all DEVICE arrays: choice[n_tokens*top_k] (scratch: expert of choice i of token t
     *   at t*top_k+i); the routed rows grouped by expert, ascending token within a group:
     *   order[n_tokens*top_k] (token of each row), weight[n_tokens*top_k] (its score),
     *   offsets[n_experts+1] (group boundaries, offsets[n_experts] = n_tokens*top_k), and
     *   slot[n_tokens*top_k] (row of choice i of token t). No host round trip: the grouped
     *   matmul reads offsets on the device. */
    int (*moe_route)(void *ctx, const float *logits, int n_tokens, int n_experts, int top_k, int32_t *choice,
                     int32_t *order, float *weight, int32_t *offsets, int32_t *slot);
    /* matmul_grouped: for each group e < n_groups, rows r in [offsets[e], offsets[e+1]):
     *   y[r][N] (row stride ldy) = x[r][K] (row stride ldx) · W_e, W_e = w + e*K*N elements in
     *   HF's expert layout [K][N] (x @ W, not x @ Wᵀ), dtype wdt. offsets is a DEVICE int32
     *   [n_groups+1] with offsets[0] = 0 and offsets[n_groups] = M: one GEMM per group, sizes
     *   read on the device. */
    int (*matmul_grouped)(void *ctx, float *y, int ldy, const float *x, int ldx, const void *w, prism_dtype_t wdt,
                          const int32_t *offsets, int n_groups, int M, int N, int K);
    /* moe_combine: y[t][0..dim) (row stride ldy) += sum over i < top_k of src[slot[t*top_k+i]]
     *   (src rows contiguous, dim wide), in i order; slot DEVICE int32. */
    int (*moe_combine)(void *ctx, float *y, int ldy, const float *src, const int32_t *slot, int n_tokens,
                       int top_k, int dim);
    /* pixel_shuffle: x [n_img][rows_per_img][C] whose first g*g rows per image are a g x g patch
     *   grid (row-major; further rows, e.g. a CLS, are skipped) -> out [n_img][(g/s)^2][s*s*C]:
     *   out[i][h2*(g/s)+w2][(dh*s+dw)*C + c] = x[i][(s*h2+dh)*g + s*w2+dw][c]
     *   (transformers' pixel_shuffle with ratio 1/s). */
    int (*pixel_shuffle)(void *ctx, float *out, const float *x, int n_img, int rows_per_img, int g, int C, int s);

    /* ---- KV block transfer ----
     * Copies n whole blocks (block_bytes each, contiguous at base + id*block_bytes) to/from host
     * memory: dst_host + i*host_stride <- block ids[i]. ids are HOST int32 here (transfer
     * planning is a host-side operation). */
    int (*blocks_to_host)(void *ctx, void *dst_host, size_t host_stride, const void *base,
                          size_t block_bytes, const int32_t *ids, int n);
    int (*blocks_from_host)(void *ctx, void *base, size_t block_bytes, const int32_t *ids, int n,
                            const void *src_host, size_t host_stride);
    /* host_pin / host_unpin: page-locks host memory the caller owns and keeps for a long time (the
     * decode worker's KV swap region), so blocks_to_host / blocks_from_host copy it by DMA at full
     * speed; unpin before the memory is freed. Optional: NULL = host memory is used as it is (the
     * CPU backend, whose "device" is host memory). */
    int  (*host_pin)(void *ctx, void *host, size_t bytes);
    void (*host_unpin)(void *ctx, void *host);

    /* ---- sampling helpers ----
     * argmax over rows: out_host[r] = argmax(logits[r][vocab]) (first max on ties). Optional. */
    int (*argmax)(void *ctx, int32_t *out_host, const float *logits, int n_rows, int vocab);

    /* ---- sampling on the device (optional: NULL = not provided; then the host samples the
     * downloaded logits with common/sample and common/seq, which are also these ops' reference) ----
     * A decode loop on a device keeps the per-sequence token-count table there (counts
     * [slots][vocab] int32, prompt bits [slots][(vocab+31)/32] uint32: prism_token_counts_t's
     * layout), adds each step's tokens to it there, applies the processors to the batch's logits and
     * samples, so only token ids (and mask words for guided sequences) cross PCIe per step.
     * sample: one token per row of logits [n_rows][vocab]: softmax(l / T), top-k, the smallest
     *   top-p prefix, inverse-CDF with uniform[r], in the order (probability desc, id asc) — the
     *   rule of prism_sample(); deterministic for a given uniform. out_host[n_rows]; n_rows <= 4096.
     * penalties: logits in place, row r by rows[r] (DEVICE array) over counts / prompt_bits.
     * token_counts_add: counts[slots[i]][tokens[i]] += 1 for i < n (out-of-range entries skipped).
     * logit_bias: logits[r][ids[k]] += bias[k] for k in [offsets[r], offsets[r+1]); offsets [n_rows+1].
     * token_mask: logits[r][i] = -inf where bit i of masks[mask_row[r]] (words int32 per mask) is
     *   clear; mask_row[r] < 0 leaves row r untouched. */
    int (*sample)(void *ctx, int32_t *out_host, const float *logits, int n_rows, int vocab,
                  const prism_backend_sample_rows_t *rows);
    int (*penalties)(void *ctx, float *logits, int n_rows, int vocab, const int32_t *counts,
                     const uint32_t *prompt_bits, const prism_backend_penalty_row_t *rows);
    int (*token_counts_add)(void *ctx, int32_t *counts, int n_slots, int vocab, const int32_t *slots,
                            const int32_t *tokens, int n);
    int (*logit_bias)(void *ctx, float *logits, int n_rows, int vocab, const int32_t *offsets, const int32_t *ids,
                      const float *bias);
    int (*token_mask)(void *ctx, float *logits, int n_rows, int vocab, const int32_t *masks, int words,
                      const int32_t *mask_row);

    /* ---- Qwen-VL ops (optional: NULL means the backend cannot run Qwen2.5-VL / Qwen3-VL; the
     * models refuse to load then) ----
     * rope_multi: NeoX-paired RoPE (rotate_half: pair j is (x[j], x[j + head_dim/2]) of every
     *   head, j < head_dim/2) whose position depends on the pair: pair j of token t turns by
     *   pos[sec->of[j] * pos_ld + t] * inv_freq[j] (fp32 product, fp32 cos/sin). pos DEVICE int32
     *   [sections][pos_ld]; inv_freq DEVICE float [head_dim/2]; sec a HOST table read during the
     *   call. M-RoPE (Qwen2.5-VL: runs of t, h, w pairs; Qwen3-VL: interleaved) and the vision
     *   towers' 2D RoPE (rows, then columns, the same frequencies twice) are this op.
     * attn_varlen: non-causal attention within each of n_seqs sequences of a flattened batch:
     *   sequence s is rows [cu[s], cu[s+1]) (DEVICE int32 [n_seqs+1], cu[0] = 0, non-decreasing;
     *   empty sequences allowed). max_len >= every cu[s+1] - cu[s] (launch sizing). Rows of stride
     *   ld{q,k,v,o}. A window attention is this op over the windows, a full one over the images:
     *   blockwise with online softmax like every attention here, never an n x n matrix. */
    int (*rope_multi)(void *ctx, float *x, int ld, int n_tokens, int n_heads, int head_dim, const int32_t *pos,
                      int pos_ld, const float *inv_freq, const prism_rope_sections_t *sec);
    int (*attn_varlen)(void *ctx, float *out, int ldo, const float *q, int ldq, const float *k, int ldk,
                       const float *v, int ldv, const int32_t *cu, int n_seqs, int max_len, int n_heads,
                       int n_kv_heads, int head_dim, float scale);
    /* add_rows: y[rows[i]][0..dim) (row stride ldy) += src[i][0..dim) (row stride lds) for every i < n
     *   with rows[i] >= 0 (DEVICE int32; rows distinct): DeepStack (Qwen3-VL), the merged features
     *   of a vision layer added into the LM's hidden states at the image tokens after an early layer. */
    int (*add_rows)(void *ctx, float *y, int ldy, const float *src, int lds, const int32_t *rows, int n, int dim);

    /* ---- random init (--random-weights) ----
     * fill_random: dst[i] = std * prism_random_normalish(seed, i) (dtype.h) for i < n, stored as dt.
     * Optional: when NULL the loader computes the same values on the host and uploads them; a
     * device fills an 8B-parameter model in milliseconds instead of a minute of host work. */
    int (*fill_random)(void *ctx, void *dst, prism_dtype_t dt, size_t n, uint64_t seed, float std);

    /* ---- weight storage ----
     * set_weight_dtype: prepares matmul (and grouped matmul) for weights of dtype dt; called once
     * by prism_backend_set_weight_dtype before a model loads. Optional: NULL = the backend takes
     * only its default weight_dtype. */
    int (*set_weight_dtype)(void *ctx, prism_dtype_t dt);
    /* set_compute_dtype: the arithmetic of matmuls on bf16 weights (--compute-dtype): fp32 (x as
     * it is), or bf16 (x rounded to bf16, exact products summed in fp32: the CPU's vdpbf16ps);
     * called once by prism_backend_set_compute_dtype, after set_weight_dtype(bf16), before a model
     * loads. Optional: NULL = the backend computes only in its default compute_dtype. */
    int (*set_compute_dtype)(void *ctx, prism_dtype_t dt);
    /* Matmul weights in a layout of the backend's own (optional pair: NULL = weights stay [N][K]
     * row-major, as everywhere else; both NULL on CUDA). For a weight W[N][K] of weight_dtype that
     * only matmul reads (not an embedding table get_rows also reads, e.g. a tied lm_head):
     * weight_pack_bytes: the bytes the loader reserves for it, at least N*K elements (more when
     *   the layout pads N or K), or 0 when this backend keeps such a weight as it is (the CPU
     *   packs bf16 weights under --compute-dtype bf16 with AVX-512 BF16 dot products, and under the
     *   default fp32 compute on AVX-512).
     * weight_pack: after W was written as [N][K] at the front of those bytes (after any tensor-
     *   parallel slicing), rearranges it in place, once, at load time (it may allocate then).
     *   PRISM_OK without touching it when weight_pack_bytes is 0. From then on w may be passed to
     *   matmul only whole (this pointer, with these N and K), until the block holding it is freed.
     * Both are answered by the compute dtype set before the model loads. */
    size_t (*weight_pack_bytes)(void *ctx, int N, int K);
    int (*weight_pack)(void *ctx, void *w, int N, int K);

    void (*destroy)(void *ctx);
} prism_backend_i;

struct prism_backend {
    prism_backend_i i;
    void *ctx;
    const char *device;           /* "cpu" | "cuda" */
    prism_dtype_t weight_dtype;   /* dtype the model loader stores matmul weights/embeddings in */
    prism_dtype_t compute_dtype;  /* what a matmul rounds x to: f32 (the CPU's default) or bf16 (CUDA) */
    int n_threads;
};
typedef struct prism_backend prism_backend_t;

/* CPU backend: n_threads workers (<= 0: 1) that run every op, matmuls included (OpenBLAS is set
 * to one thread so the two never oversubscribe the cores). Kernels by cpuid, or PRISM_CPU_ISA.
 * Unlimited pool. */
prism_backend_t *prism_backend_cpu_create(int n_threads);
/* CPU backend whose pool refuses allocations beyond pool_bytes (0 = unlimited). */
prism_backend_t *prism_backend_cpu_create_pool(int n_threads, size_t pool_bytes);
/* Makes OpenBLAS use the kernels this CPU runs when its own detection fell back to generic ones
 * (a CPU model newer than the library). Once per process; creating a CPU backend calls it. */
void prism_backend_cpu_blas_setup(void);

/* Creates a backend by device name ("cpu" | "cuda" | "cuda:N"). Returns PRISM_ENOTSUP for cuda
 * in a build without the CUDA backend (or with no GPU), PRISM_EINVAL for unknown names. */
int  prism_backend_create(const char *device, int n_threads, size_t pool_bytes, prism_backend_t **out);
/* Stores the weights of models loaded from now on as dt (the CPU takes fp32 or bf16; CUDA its
 * bf16 only): PRISM_ENOTSUP when the backend cannot compute with it. */
int  prism_backend_set_weight_dtype(prism_backend_t *be, prism_dtype_t dt);
/* Matmuls round their input x to dt before multiplying (products summed in fp32): f32 keeps it,
 * bf16 also stores the weights as bf16 (set_weight_dtype). The CPU takes both (bf16 runs AVX-512
 * BF16 dot products, or emulates them with a warning on a CPU without); CUDA computes in bf16
 * only. PRISM_ENOTSUP when the backend cannot. */
int  prism_backend_set_compute_dtype(prism_backend_t *be, prism_dtype_t dt);
void prism_backend_destroy(prism_backend_t *be);
bool prism_backend_has_cuda(void);
/* dlopen()s a shared module of this build (RTLD_NOW | RTLD_LOCAL), looking in $PRISM_BACKEND_DIR,
 * next to the executable, in ../lib beside it, in the build's lib/ folder, then on the normal library
 * path: the CUDA backend and the NCCL communicator (common/comm) are found the same way. NULL with
 * the reason in err when none opens. */
void *prism_backend_module_open(const char *file, char *err, size_t errlen);

/* A buffer from / back to the backend's pool (the backend itself: create / destroy). */
static inline void *prism_backend_buf_alloc(prism_backend_t *be, size_t bytes) { return be->i.alloc(be->ctx, bytes); }
static inline void  prism_backend_buf_free(prism_backend_t *be, void *p) { if (p) be->i.free(be->ctx, p); }

#endif
