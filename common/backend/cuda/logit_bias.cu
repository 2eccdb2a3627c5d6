/* logit_bias on the device: row r adds bias[k] to logits[r][ids[k]] for k in
 * [offsets[r], offsets[r+1]) (CSR over the batch; the CPU reference is prism_apply_logit_bias).
 * Ids outside the vocabulary are skipped. One block per row; ids of one row are distinct (the
 * request's map keys), so no two threads write the same logit. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 128

static __global__ void logit_bias_kernel(float *logits, int vocab, const int32_t *offsets, const int32_t *ids,
                                         const float *bias)
{
    float *l = logits + (size_t)blockIdx.x * vocab;
    for (int k = offsets[blockIdx.x] + threadIdx.x; k < offsets[blockIdx.x + 1]; k += blockDim.x) {
        int32_t id = ids[k];
        if (id >= 0 && id < vocab) l[id] += bias[k];
    }
}

extern "C" int prism_cuda_logit_bias_k(cudaStream_t st, float *logits, int n_rows, int vocab, const int32_t *offsets,
                                       const int32_t *ids, const float *bias)
{
    if (vocab <= 0 || n_rows < 0 || n_rows > PRISM_CUDA_MAX_ROWS || !offsets) return PRISM_EINVAL;
    if (n_rows == 0) return PRISM_OK;
    logit_bias_kernel<<<n_rows, THREADS, 0, st>>>(logits, vocab, offsets, ids, bias);
    return PRISM_CUDA_LAUNCHED("logit_bias");
}
