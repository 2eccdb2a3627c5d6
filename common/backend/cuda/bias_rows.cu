/* Bias broadcast before a GEMM that then runs with beta = 1: y[r][j] = b[j] (+ y[r][j] when
 * accumulating a residual), rows ldy apart. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256

static __global__ void bias_rows_kernel(float *y, int ldy, const float *b, int M, int N, int accumulate)
{
    size_t total = (size_t)M * N;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
        size_t r = k / N, j = k % N;
        float *p = y + r * ldy + j;
        *p = accumulate ? *p + b[j] : b[j];
    }
}

static int launch(cudaStream_t st, float *y, int ldy, const float *b, int M, int N, bool accumulate)
{
    bias_rows_kernel<<<prism_cuda_blocks((size_t)M * N, THREADS), THREADS, 0, st>>>(y, ldy, b, M, N, accumulate);
    return PRISM_CUDA_LAUNCHED("bias_rows");
}

extern "C" int prism_cuda_bias_rows(cudaStream_t st, float *y, int ldy, const float *b, int M, int N, bool accumulate)
{
    if (M < 0 || N <= 0 || ldy < N || !b) return PRISM_EINVAL;
    if (M == 0) return PRISM_OK;
    return launch(st, y, ldy, b, M, N, accumulate);
}
