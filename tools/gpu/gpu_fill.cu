/* Device-side random init for the benchmark models (16 GB of Llama-3-8B-shaped weights in
 * milliseconds instead of minutes of host generation + PCIe): a counter-based hash, so the values
 * depend only on (seed, index). */
#include "backend/cuda/cuda_common.cuh"

#include "gpu_model.h"

__device__ __forceinline__ float hash_uniform(uint64_t seed, size_t i)
{
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * (i + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
}

static __global__ void fill_kernel(void *dst, int dt, size_t n, float scale, float offset, uint64_t seed)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v = offset + scale * hash_uniform(seed, i);
        if (dt == PRISM_DTYPE_BF16) ((__nv_bfloat16 *)dst)[i] = __float2bfloat16_rn(v);
        else ((float *)dst)[i] = v;
    }
}

extern "C" int gm_device_fill(prism_backend_t *be, void *dst, prism_dtype_t dt, size_t n, float scale, float offset,
                              uint64_t seed)
{
    if (strcmp(be->device, "cuda") != 0 || (dt != PRISM_DTYPE_BF16 && dt != PRISM_DTYPE_F32)) return PRISM_EINVAL;
    if (n == 0) return PRISM_OK;
    cudaStream_t st = ((prism_cuda_ctx_t *)be->ctx)->stream;
    fill_kernel<<<prism_cuda_blocks(n, 256, 132 * 16), 256, 0, st>>>(dst, (int)dt, n, scale, offset, seed);
    return PRISM_CUDA_LAUNCHED("gm_device_fill");
}
