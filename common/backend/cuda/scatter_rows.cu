/* Image-embedding scatter: dst[rows[i]*ld ..][dim] = src[i*dim ..][dim]; rows[i] < 0 skipped.
 * The image features of a prompt land on its <image> token positions in one launch. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256

static __global__ void scatter_rows_kernel(float *dst, int ld, const float *src, const int32_t *rows, int dim)
{
    int r = rows[blockIdx.x];
    if (r < 0) return;
    const float *s = src + (size_t)blockIdx.x * dim;
    float *d = dst + (size_t)r * ld;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) d[j] = s[j];
}

static int launch(cudaStream_t st, float *dst, int ld, const float *src, const int32_t *rows, int n, int dim)
{
    scatter_rows_kernel<<<n, THREADS, 0, st>>>(dst, ld, src, rows, dim);
    return PRISM_CUDA_LAUNCHED("scatter_rows");
}

extern "C" int prism_cuda_scatter_rows_k(cudaStream_t st, float *dst, int ld, const float *src, const int32_t *rows,
                                         int n, int dim)
{
    if (dim <= 0 || ld < dim || n < 0 || n > PRISM_CUDA_MAX_ROWS) return PRISM_EINVAL;
    if (n == 0) return PRISM_OK;
    return launch(st, dst, ld, src, rows, n, dim);
}
