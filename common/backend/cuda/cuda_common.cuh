/* Device helpers shared by the kernel files (header-only, included by .cu files only). */
#ifndef PRISM_BACKEND_CUDA_COMMON_CUH
#define PRISM_BACKEND_CUDA_COMMON_CUH

#include "backend/cuda/cuda_impl.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

/* Grid-size helper: ceil(n / d) clamped for 1-D launches over huge n (kernels grid-stride). */
static inline unsigned prism_cuda_blocks(size_t n, unsigned threads, unsigned max_blocks = 65535u * 8u)
{
    size_t b = (n + threads - 1) / threads;
    if (b < 1) b = 1;
    return b > max_blocks ? max_blocks : (unsigned)b;
}

__device__ __forceinline__ float prism_warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float prism_warp_max(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Block-wide sum for blockDim.x a multiple of 32 (<= 1024); every thread gets the result.
 * `sh` needs 33 floats of shared memory. */
__device__ __forceinline__ float prism_block_sum(float v, float *sh)
{
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = prism_warp_sum(v);
    __syncthreads();               /* sh may still be read by a previous call */
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : 0.0f;
    if (w == 0) {
        v = prism_warp_sum(v);
        if (lane == 0) sh[32] = v;
    }
    __syncthreads();
    return sh[32];
}

__device__ __forceinline__ float prism_load_as_f32(const void *p, prism_dtype_t dt, size_t i)
{
    switch (dt) {
    case PRISM_DTYPE_BF16: return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    case PRISM_DTYPE_F16: return __half2float(((const __half *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

#endif
