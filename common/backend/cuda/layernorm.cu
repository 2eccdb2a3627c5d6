/* LayerNorm: y = (x - mean) / sqrt(var + eps) * w + b (w, b optional), one block per row; two
 * passes over the row (mean, then centred variance) as the CPU reference does. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256

static __global__ void layernorm_kernel(float *y, const float *x, const float *w, const float *b, int dim,
                                        float eps)
{
    __shared__ float sh[33];
    const float *xr = x + (size_t)blockIdx.x * dim;
    float *yr = y + (size_t)blockIdx.x * dim;
    float s = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += xr[i];
    float mean = prism_block_sum(s, sh) / (float)dim;
    float v = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float d = xr[i] - mean;
        v += d * d;
    }
    float var = prism_block_sum(v, sh) / (float)dim;
    float inv = 1.0f / sqrtf(var + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        yr[i] = (xr[i] - mean) * inv * (w ? w[i] : 1.0f) + (b ? b[i] : 0.0f);
}

static int launch(cudaStream_t st, float *y, const float *x, const float *w, const float *b, int n_rows, int dim,
                  float eps)
{
    layernorm_kernel<<<n_rows, THREADS, 0, st>>>(y, x, w, b, dim, eps);
    return PRISM_CUDA_LAUNCHED("layernorm");
}

extern "C" int prism_cuda_layernorm(cudaStream_t st, float *y, const float *x, const float *w, const float *b,
                                    int n_rows, int dim, float eps)
{
    if (dim <= 0 || n_rows < 0 || n_rows > PRISM_CUDA_MAX_ROWS || !x || !y) return PRISM_EINVAL;
    if (n_rows == 0) return PRISM_OK;
    return launch(st, y, x, w, b, n_rows, dim, eps);
}
