/* Elementwise activations: SiLU, GELU (erf and tanh forms), quick_gelu, ReLU; y may equal x.
 * Accurate expf/erff/tanhf (no fast-math) so GELU matches the CPU reference to a few ulp. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256

__device__ __forceinline__ float act_one(int act, float v)
{
    switch (act) {
    case PRISM_ACT_SILU: return v / (1.0f + expf(-v));
    case PRISM_ACT_GELU_ERF: return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    case PRISM_ACT_GELU_TANH: return 0.5f * v * (1.0f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
    case PRISM_ACT_QUICK_GELU: return v / (1.0f + expf(-1.702f * v));
    case PRISM_ACT_RELU: return v > 0.0f ? v : 0.0f;
    default: return v;
    }
}

static __global__ void act_kernel(int act, float *y, const float *x, size_t n)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = act_one(act, x[i]);
}

static int launch(cudaStream_t st, int act, float *y, const float *x, size_t n)
{
    act_kernel<<<prism_cuda_blocks(n, THREADS), THREADS, 0, st>>>(act, y, x, n);
    return PRISM_CUDA_LAUNCHED("act");
}

extern "C" int prism_cuda_act(cudaStream_t st, prism_act_t act, float *y, const float *x, size_t n)
{
    if ((unsigned)act > PRISM_ACT_RELU) return PRISM_EINVAL;
    if (n == 0) return PRISM_OK;
    if (act == PRISM_ACT_NONE) return y == x ? PRISM_OK : PRISM_CUDA_TRY(cudaMemcpyAsync(y, x, n * 4, cudaMemcpyDeviceToDevice, st));
    return launch(st, (int)act, y, x, n);
}
