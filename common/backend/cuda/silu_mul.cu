/* SwiGLU gate: out[r][i] = silu(gate[r*ld + i]) * up[r*ld + i]; out is [n_rows][dim] contiguous. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256

static __global__ void silu_mul_kernel(float *out, const float *gate, const float *up, int ld, int n_rows, int dim)
{
    size_t total = (size_t)n_rows * dim;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
        size_t r = k / dim, i = k % dim;
        float g = gate[r * ld + i];
        out[k] = g / (1.0f + expf(-g)) * up[r * ld + i];
    }
}

static int launch(cudaStream_t st, float *out, const float *gate, const float *up, int ld, int n_rows, int dim)
{
    silu_mul_kernel<<<prism_cuda_blocks((size_t)n_rows * dim, THREADS), THREADS, 0, st>>>(out, gate, up, ld, n_rows, dim);
    return PRISM_CUDA_LAUNCHED("silu_mul");
}

extern "C" int prism_cuda_silu_mul(cudaStream_t st, float *out, const float *gate, const float *up, int ld,
                                   int n_rows, int dim)
{
    if (ld < dim || dim <= 0 || n_rows < 0) return PRISM_EINVAL;
    if (n_rows == 0) return PRISM_OK;
    return launch(st, out, gate, up, ld, n_rows, dim);
}
