/* dst[i] = std * prism_random_normalish(seed, i) in dt: the same values the host loader would
 * compute (dtype.h), generated in place instead of over PCIe. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256

static __global__ void fill_random_kernel(void *dst, int dt, size_t n, uint64_t seed, float std)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v = __fmul_rn(std, prism_random_normalish(seed, i));
        if (dt == PRISM_DTYPE_BF16) ((__nv_bfloat16 *)dst)[i] = __float2bfloat16_rn(v);
        else if (dt == PRISM_DTYPE_F16) ((__half *)dst)[i] = __float2half_rn(v);
        else ((float *)dst)[i] = v;
    }
}

static int launch(cudaStream_t st, void *dst, prism_dtype_t dt, size_t n, uint64_t seed, float std)
{
    fill_random_kernel<<<prism_cuda_blocks(n, THREADS), THREADS, 0, st>>>(dst, (int)dt, n, seed, std);
    return PRISM_CUDA_LAUNCHED("fill_random");
}

extern "C" int prism_cuda_fill_random(cudaStream_t st, void *dst, prism_dtype_t dt, size_t n, uint64_t seed, float std)
{
    if (dt != PRISM_DTYPE_F32 && dt != PRISM_DTYPE_BF16 && dt != PRISM_DTYPE_F16) return PRISM_EINVAL;
    if (n == 0) return PRISM_OK;
    return launch(st, dst, dt, n, seed, std);
}
