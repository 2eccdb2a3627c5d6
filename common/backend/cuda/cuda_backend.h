/* cuda_backend: the CUDA implementation of prism_backend_i (H100/H200, sm_90 + PTX).
 *
 * Normally reached through prism_backend_create("cuda" | "cuda:N", ...); this header adds what
 * the generic interface does not carry: a run-time "is there a GPU" probe, the device-allocation
 * counter tests assert on, and two ops that are not (yet) in prism_backend_i (GPU sampling and
 * the image-embedding row scatter).
 *
 *   if (!prism_cuda_available()) { fall back to "cpu" }
 *   int st;
 *   prism_backend_t *be = prism_backend_cuda_create(0, 8ull << 30, &st);   // one 8 GiB pool
 *   uint64_t n0 = prism_cuda_malloc_count();
 *   ... load weights, create the KV cache, run forwards ...
 *   assert(prism_cuda_malloc_count() == n0);   // nothing was allocated on the request path
 *
 * Memory: create makes exactly one device allocation (the pool, pool_bytes; 0 = all free device
 * memory less 1 GiB) and one pinned host allocation (transfer staging). Internal scratch (cuBLAS
 * workspace, the bf16 copy of matmul inputs, split-K attention partials, small parameter blocks)
 * is carved from the pool at create time; everything else comes from alloc(), which carves the
 * same pool. No op calls cudaMalloc/cudaFree.
 *
 * Numerics: activations, KV cache and all reductions are fp32; matmul weights are bf16
 * (weight_dtype) and the matmul input is rounded to bf16 before the tensor-core GEMM (fp32
 * accumulation and output). docs/CUDA.md gives the tolerances the consistency tests use.
 */
#ifndef PRISM_CUDA_BACKEND_H
#define PRISM_CUDA_BACKEND_H

#include "backend/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Creates the backend on `device`. Returns NULL and sets *status (may be NULL) to PRISM_ENOTSUP
 * when no usable GPU is present (with a log line saying why), PRISM_ENOMEM when the pool cannot
 * be allocated, PRISM_EINVAL for a bad device index. */
prism_backend_t *prism_backend_cuda_create(int device, size_t pool_bytes, int *status);

/* Run-time probe: true when the driver works and at least one device is visible. Never aborts;
 * safe to call on machines without a driver. */
bool prism_cuda_available(void);
int  prism_cuda_device_count(void);

/* Number of cudaMalloc / cudaHostAlloc calls the CUDA backend made in this process. */
uint64_t prism_cuda_malloc_count(void);

/* Bytes of the pool taken by internal scratch at create (included in pool_used). */
size_t prism_cuda_reserved_bytes(const prism_backend_t *be);

/* Per-row sampling parameters (host arrays of n_rows). uniform[r] is the request RNG's next
 * draw in [0, 1) (prism_rng_uniform), used only when the row is not greedy. */
typedef struct {
    const float *temperature;   /* < 1e-5 (or NaN): greedy */
    const float *top_p;         /* (0, 1]; >= 1 off */
    const int32_t *top_k;       /* <= 0 off; 1 greedy */
    const double *uniform;
} prism_cuda_sample_args_t;

/* Samples one token per row of logits [n_rows][vocab] (device) on the GPU: softmax(l / T),
 * top-k, then the smallest top-p prefix, then inverse-CDF with uniform[r], in the order
 * (probability desc, id asc) — the same rule as prism_sample(). Deterministic for a given
 * uniform. out_host[n_rows]. n_rows <= 4096. */
int prism_cuda_sample(prism_backend_t *be, int32_t *out_host, const float *logits, int n_rows, int vocab,
                      const prism_cuda_sample_args_t *args);

/* dst[rows[i]*ld ..][dim] = src[i*dim ..][dim] for i < n (device pointers; rows device int32,
 * rows < 0 skipped): writes image-embedding rows into the token embedding stream. */
int prism_cuda_scatter_rows(prism_backend_t *be, float *dst, int ld, const float *src, const int32_t *rows,
                            int n, int dim);

#ifdef __cplusplus
}
#endif

#endif
