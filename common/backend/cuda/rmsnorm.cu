/* RMSNorm: y = w * (x * rsqrt(mean(x^2) + eps)), one block per row, fp32 sum of squares. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256

static __global__ void rmsnorm_kernel(float *y, const float *x, const float *w, int dim, float eps)
{
    __shared__ float sh[33];
    const float *xr = x + (size_t)blockIdx.x * dim;
    float *yr = y + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = prism_block_sum(ss, sh);
    float inv = 1.0f / sqrtf(ss / (float)dim + eps);   /* y may alias x: all reads done above */
    for (int i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = w[i] * (xr[i] * inv);
}

static int launch(cudaStream_t st, float *y, const float *x, const float *w, int n_rows, int dim, float eps)
{
    rmsnorm_kernel<<<n_rows, THREADS, 0, st>>>(y, x, w, dim, eps);
    return PRISM_CUDA_LAUNCHED("rmsnorm");
}

extern "C" int prism_cuda_rmsnorm(cudaStream_t st, float *y, const float *x, const float *w, int n_rows, int dim,
                                  float eps)
{
    if (dim <= 0 || n_rows < 0 || n_rows > PRISM_CUDA_MAX_ROWS || !x || !y || !w) return PRISM_EINVAL;
    if (n_rows == 0) return PRISM_OK;
    return launch(st, y, x, w, n_rows, dim, eps);
}
