/* Row scaling in place: x[r][0..dim) *= s[r] (s on the device: per-token attention temperature,
 * router scores on expert inputs). Grid-stride over the n_rows x dim elements. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256

static __global__ void scale_rows_kernel(float *x, int ld, int n_rows, int dim, const float *s)
{
    size_t total = (size_t)n_rows * dim;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
        size_t r = k / dim;
        x[r * ld + k % dim] *= s[r];
    }
}

static int launch(cudaStream_t st, float *x, int ld, int n_rows, int dim, const float *s)
{
    size_t total = (size_t)n_rows * dim;
    scale_rows_kernel<<<prism_cuda_blocks(total, THREADS), THREADS, 0, st>>>(x, ld, n_rows, dim, s);
    return PRISM_CUDA_LAUNCHED("scale_rows");
}

extern "C" int prism_cuda_scale_rows(cudaStream_t st, float *x, int ld, int n_rows, int dim, const float *s)
{
    if (!x || !s || n_rows < 0 || dim < 0 || ld < dim) return PRISM_EINVAL;
    if (n_rows == 0 || dim == 0) return PRISM_OK;
    return launch(st, x, ld, n_rows, dim, s);
}
