/* Row argmax (first maximum on ties, as torch.argmax and the CPU reference): one block per row,
 * (value, index) pairs reduced through warp shuffles. NaN never wins (comparisons are false). */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 512

__device__ __forceinline__ void better(float &v, int &i, float v2, int i2)
{
    if (v2 > v || (v2 == v && i2 < i) || (i < 0 && i2 >= 0)) {
        v = v2;
        i = i2;
    }
}

static __global__ void argmax_kernel(int32_t *out, const float *logits, int vocab)
{
    __shared__ float sv[32];
    __shared__ int si[32];
    const float *l = logits + (size_t)blockIdx.x * vocab;
    float v = -INFINITY;
    int idx = -1;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) better(v, idx, l[j], j);
    for (int o = 16; o > 0; o >>= 1) {
        float v2 = __shfl_xor_sync(0xffffffffu, v, o);
        int i2 = __shfl_xor_sync(0xffffffffu, idx, o);
        better(v, idx, v2, i2);
    }
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) { sv[w] = v; si[w] = idx; }
    __syncthreads();
    if (w == 0) {
        int nw = blockDim.x >> 5;
        v = lane < nw ? sv[lane] : -INFINITY;
        idx = lane < nw ? si[lane] : -1;
        for (int o = 16; o > 0; o >>= 1) {
            float v2 = __shfl_xor_sync(0xffffffffu, v, o);
            int i2 = __shfl_xor_sync(0xffffffffu, idx, o);
            better(v, idx, v2, i2);
        }
        if (lane == 0) out[blockIdx.x] = idx < 0 ? 0 : idx;
    }
}

static int launch(cudaStream_t st, int32_t *out, const float *logits, int n_rows, int vocab)
{
    argmax_kernel<<<n_rows, THREADS, 0, st>>>(out, logits, vocab);
    return PRISM_CUDA_LAUNCHED("argmax");
}

extern "C" int prism_cuda_argmax(cudaStream_t st, int32_t *out, const float *logits, int n_rows, int vocab)
{
    if (vocab <= 0 || n_rows < 0 || n_rows > PRISM_CUDA_MAX_ROWS) return PRISM_EINVAL;
    if (n_rows == 0) return PRISM_OK;
    return launch(st, out, logits, n_rows, vocab);
}
