/* MoE combine: y[t][d] += sum over i < top_k of src[slot[t*top_k+i]][d], in i order (no atomics:
 * each output element is owned by one thread, so the result is deterministic). */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256

static __global__ void moe_combine_kernel(float *y, int ldy, const float *src, const int32_t *slot, int n_tokens,
                                          int top_k, int dim)
{
    size_t total = (size_t)n_tokens * dim;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
        size_t t = k / dim, d = k % dim;
        float a = 0.0f;
        for (int i = 0; i < top_k; i++) a += src[(size_t)slot[t * top_k + i] * dim + d];
        y[t * ldy + d] += a;
    }
}

static int launch(cudaStream_t st, float *y, int ldy, const float *src, const int32_t *slot, int n_tokens, int top_k,
                  int dim)
{
    size_t total = (size_t)n_tokens * dim;
    moe_combine_kernel<<<prism_cuda_blocks(total, THREADS), THREADS, 0, st>>>(y, ldy, src, slot, n_tokens, top_k, dim);
    return PRISM_CUDA_LAUNCHED("moe_combine");
}

extern "C" int prism_cuda_moe_combine(cudaStream_t st, float *y, int ldy, const float *src, const int32_t *slot,
                                      int n_tokens, int top_k, int dim)
{
    if (!y || !src || !slot || n_tokens < 0 || top_k <= 0 || top_k > PRISM_MOE_MAX_TOPK || dim <= 0 || ldy < dim)
        return PRISM_EINVAL;
    if (n_tokens == 0) return PRISM_OK;
    return launch(st, y, ldy, src, slot, n_tokens, top_k, dim);
}
