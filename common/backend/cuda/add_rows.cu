/* DeepStack's row adds (Qwen3-VL): y[rows[i]][0..dim) += src[i][0..dim) for the rows[i] >= 0
 * (distinct, so no two threads touch one element). Grid-stride over the n x dim elements: one add
 * each, the same rounding as the CPU kernel. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256

static __global__ void add_rows_kernel(float *y, int ldy, const float *src, int lds, const int32_t *rows, int n, int dim)
{
    size_t total = (size_t)n * dim;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
        size_t i = k / dim, j = k % dim;
        int32_t r = rows[i];
        if (r >= 0) y[(size_t)r * ldy + j] += src[i * lds + j];
    }
}

extern "C" int prism_cuda_add_rows(cudaStream_t st, float *y, int ldy, const float *src, int lds, const int32_t *rows,
                                   int n, int dim)
{
    if (n < 0 || dim < 0 || ldy < dim || lds < dim || (n && (!y || !src || !rows))) return PRISM_EINVAL;
    if (n == 0 || dim == 0) return PRISM_OK;
    size_t total = (size_t)n * dim;
    add_rows_kernel<<<prism_cuda_blocks(total, THREADS), THREADS, 0, st>>>(y, ldy, src, lds, rows, n, dim);
    return PRISM_CUDA_LAUNCHED("add_rows");
}
