/* Per-head RMS norm in place (Llama-4 QK norm: no weight): one warp per (token, head) row of
 * head_dim values, fp32 sum of squares, optional weight[head_dim]. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256   /* 8 warps = 8 heads per block */

static __global__ void head_rmsnorm_kernel(float *x, int ld, int n_rows, int n_heads, int head_dim, const float *w,
                                           float eps)
{
    int row = blockIdx.x * (THREADS / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (row >= n_rows) return;
    float *v = x + (size_t)(row / n_heads) * ld + (size_t)(row % n_heads) * head_dim;
    float ss = 0.0f;
    for (int i = lane; i < head_dim; i += 32) ss += v[i] * v[i];
    ss = prism_warp_sum(ss);
    float inv = 1.0f / sqrtf(ss / (float)head_dim + eps);
    for (int i = lane; i < head_dim; i += 32) v[i] = w ? w[i] * (v[i] * inv) : v[i] * inv;
}

static int launch(cudaStream_t st, float *x, int ld, int n_rows, int n_heads, int head_dim, const float *w, float eps)
{
    unsigned blocks = (unsigned)((n_rows + THREADS / 32 - 1) / (THREADS / 32));
    head_rmsnorm_kernel<<<blocks, THREADS, 0, st>>>(x, ld, n_rows, n_heads, head_dim, w, eps);
    return PRISM_CUDA_LAUNCHED("head_rmsnorm");
}

extern "C" int prism_cuda_head_rmsnorm(cudaStream_t st, float *x, int ld, int n_tokens, int n_heads, int head_dim,
                                       const float *w, float eps)
{
    if (!x || n_tokens < 0 || n_heads <= 0 || head_dim <= 0 || (long)ld < (long)n_heads * head_dim ||
        (long)n_tokens * n_heads > PRISM_CUDA_MAX_ROWS)
        return PRISM_EINVAL;
    if (n_tokens == 0) return PRISM_OK;
    return launch(st, x, ld, n_tokens * n_heads, n_heads, head_dim, w, eps);
}
