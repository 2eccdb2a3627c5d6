/* Writes the new tokens' K and V rows (row stride ld) into their paged-cache slots
 * (slot = block*block_size + offset; slot < 0 skips). Cache rows are [n_kv_heads*head_dim]. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 128

static __global__ void kv_write_kernel(float *kc, float *vc, const float *k, const float *v, int ld,
                                       const int32_t *slots, int row)
{
    int t = blockIdx.x;
    int slot = slots[t];
    if (slot < 0) return;
    const float *kr = k + (size_t)t * ld, *vr = v + (size_t)t * ld;
    float *kd = kc + (size_t)slot * row, *vd = vc + (size_t)slot * row;
    for (int j = threadIdx.x; j < row; j += blockDim.x) {
        kd[j] = kr[j];
        vd[j] = vr[j];
    }
}

static int launch(cudaStream_t st, float *kc, float *vc, const float *k, const float *v, int ld,
                  const int32_t *slots, int n_tokens, int row)
{
    kv_write_kernel<<<n_tokens, THREADS, 0, st>>>(kc, vc, k, v, ld, slots, row);
    return PRISM_CUDA_LAUNCHED("kv_write");
}

extern "C" int prism_cuda_kv_write(cudaStream_t st, float *k_cache, float *v_cache, const float *k, const float *v,
                                   int ld, const int32_t *slots, int n_tokens, int n_kv_heads, int head_dim)
{
    long row = (long)n_kv_heads * head_dim;
    if (n_kv_heads <= 0 || head_dim <= 0 || ld < row || n_tokens < 0 || n_tokens > PRISM_CUDA_MAX_ROWS)
        return PRISM_EINVAL;
    if (n_tokens == 0) return PRISM_OK;
    return launch(st, k_cache, v_cache, k, v, ld, slots, n_tokens, (int)row);
}
