/* Residual / broadcast add: y[i] = a[i] + b[i % nb] (nb == n: plain residual add). */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256

static __global__ void add_kernel(float *y, const float *a, const float *b, size_t n, size_t nb)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = a[i] + b[nb == n ? i : i % nb];
}

static int launch(cudaStream_t st, float *y, const float *a, const float *b, size_t n, size_t nb)
{
    add_kernel<<<prism_cuda_blocks(n, THREADS), THREADS, 0, st>>>(y, a, b, n, nb);
    return PRISM_CUDA_LAUNCHED("add");
}

extern "C" int prism_cuda_add(cudaStream_t st, float *y, const float *a, const float *b, size_t n, size_t nb)
{
    if (nb == 0 || nb > n) return PRISM_EINVAL;
    return launch(st, y, a, b, n, nb);
}
