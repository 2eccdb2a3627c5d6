/* fp32 -> bf16 / f16 / f32 with round-to-nearest-even: weights at load time (uploaded as fp32
 * into scratch, converted on the device) and matmul inputs (strided rows -> a contiguous bf16
 * operand for the tensor-core GEMM). Two elements per thread (paired 32-bit stores) when the
 * row length is even. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256

static __global__ void to_bf16_kernel(__nv_bfloat16 *dst, const float *src, size_t rows, size_t cols, size_t ld,
                                      int paired)
{
    size_t pairs = cols / 2, per_row = pairs + (cols & 1), total = rows * per_row;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
        size_t r = k / per_row, j = k % per_row;
        const float *s = src + r * ld;
        __nv_bfloat16 *d = dst + r * cols;
        if (j < pairs) {
            __nv_bfloat162 v = __floats2bfloat162_rn(s[2 * j], s[2 * j + 1]);
            if (paired) {
                ((__nv_bfloat162 *)d)[j] = v;
            } else {
                d[2 * j] = v.x;
                d[2 * j + 1] = v.y;
            }
        } else {
            d[cols - 1] = __float2bfloat16_rn(s[cols - 1]);
        }
    }
}

static __global__ void to_f16_kernel(__half *dst, const float *src, size_t rows, size_t cols, size_t ld)
{
    size_t total = rows * cols;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x)
        dst[k] = __float2half_rn(src[(k / cols) * ld + k % cols]);
}

static __global__ void to_f32_kernel(float *dst, const float *src, size_t rows, size_t cols, size_t ld)
{
    size_t total = rows * cols;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x)
        dst[k] = src[(k / cols) * ld + k % cols];
}

static int launch(cudaStream_t st, void *dst, prism_dtype_t dt, const float *src, size_t rows, size_t cols, size_t ld)
{
    size_t n = rows * cols;
    switch (dt) {
    case PRISM_DTYPE_BF16:
        /* paired 32-bit stores need every row start 4-byte aligned */
        to_bf16_kernel<<<prism_cuda_blocks(n / 2 + rows, THREADS), THREADS, 0, st>>>(
            (__nv_bfloat16 *)dst, src, rows, cols, ld, (cols & 1) == 0 && ((uintptr_t)dst & 3) == 0);
        break;
    case PRISM_DTYPE_F16:
        to_f16_kernel<<<prism_cuda_blocks(n, THREADS), THREADS, 0, st>>>((__half *)dst, src, rows, cols, ld);
        break;
    default:
        to_f32_kernel<<<prism_cuda_blocks(n, THREADS), THREADS, 0, st>>>((float *)dst, src, rows, cols, ld);
        break;
    }
    return PRISM_CUDA_LAUNCHED("convert");
}

extern "C" int prism_cuda_convert(cudaStream_t st, void *dst, prism_dtype_t dt, const float *src, size_t rows,
                                  size_t cols, size_t ld)
{
    if (ld < cols || (dt != PRISM_DTYPE_F32 && dt != PRISM_DTYPE_BF16 && dt != PRISM_DTYPE_F16)) return PRISM_EINVAL;
    if (rows == 0 || cols == 0) return PRISM_OK;
    return launch(st, dst, dt, src, rows, cols, ld);
}
