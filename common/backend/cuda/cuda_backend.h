/* cuda_backend: the CUDA implementation of prism_backend_i (H100/H200, sm_90 + PTX).
 *
 * Normally reached through prism_backend_create("cuda" | "cuda:N", ...); this header adds what
 * the generic interface does not carry: a run-time "is there a GPU" probe, the device-allocation
 * counter tests assert on, and one op that is not in prism_backend_i (the image-embedding row
 * scatter). Sampling on the device is in the table (backend.h: sample, penalties, token_counts_add,
 * logit_bias, token_mask; one kernel each: sample.cu, penalties.cu, ...).
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
PRISM_API prism_backend_t *prism_backend_cuda_create(int device, size_t pool_bytes, int *status);

/* Run-time probe: true when the driver works and at least one device is visible. Never aborts;
 * safe to call on machines without a driver. */
PRISM_API bool prism_cuda_available(void);
PRISM_API int  prism_cuda_device_count(void);

/* Number of cudaMalloc / cudaHostAlloc calls the CUDA backend made in this process. */
PRISM_API uint64_t prism_cuda_malloc_count(void);

/* Bytes of the pool taken by internal scratch at create (included in pool_used). */
PRISM_API size_t prism_cuda_reserved_bytes(const prism_backend_t *be);

/* The backend's one stream (a cudaStream_t) and device index, for code that enqueues work of its
 * own in the backend's order (the NCCL communicator, common/comm). NULL / -1 for other backends. */
PRISM_API void *prism_cuda_stream(const prism_backend_t *be);
PRISM_API int   prism_cuda_device(const prism_backend_t *be);

/* dst[rows[i]*ld ..][dim] = src[i*dim ..][dim] for i < n (device pointers; rows device int32,
 * rows < 0 skipped): writes image-embedding rows into the token embedding stream. */
PRISM_API int prism_cuda_scatter_rows(prism_backend_t *be, float *dst, int ld, const float *src,
                                      const int32_t *rows, int n, int dim);

#ifdef __cplusplus
}
#endif

#endif
