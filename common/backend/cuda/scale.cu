/* y[i] = x[i] * s. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256

static __global__ void scale_kernel(float *y, const float *x, float s, size_t n)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = x[i] * s;
}

static int launch(cudaStream_t st, float *y, const float *x, float s, size_t n)
{
    scale_kernel<<<prism_cuda_blocks(n, THREADS), THREADS, 0, st>>>(y, x, s, n);
    return PRISM_CUDA_LAUNCHED("scale");
}

extern "C" int prism_cuda_scale(cudaStream_t st, float *y, const float *x, float s, size_t n)
{
    if (n == 0) return PRISM_OK;
    return launch(st, y, x, s, n);
}
