/* Grammar token masks on the device: logits[r][i] = -inf where bit i of row r's mask is clear
 * (masks [n_masks][words] int32, bit i of word i/32, as common/grammar fills them; the CPU
 * reference is prism_grammar_apply_mask). mask_row[r] picks row r's mask, -1 = unconstrained.
 * Only the mask words cross PCIe (vocab/8 bytes per guided sequence per step), never logits. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256

static __global__ void token_mask_kernel(float *logits, int vocab, const int32_t *masks, int words,
                                         const int32_t *mask_row)
{
    int m = mask_row[blockIdx.x];
    if (m < 0) return;
    float *l = logits + (size_t)blockIdx.x * vocab;
    const uint32_t *w = (const uint32_t *)masks + (size_t)m * words;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        int wi = i >> 5;
        if (wi >= words || !((w[wi] >> (i & 31)) & 1u)) l[i] = -INFINITY;
    }
}

extern "C" int prism_cuda_token_mask_k(cudaStream_t st, float *logits, int n_rows, int vocab, const int32_t *masks,
                                       int words, const int32_t *mask_row)
{
    if (vocab <= 0 || words <= 0 || n_rows < 0 || n_rows > PRISM_CUDA_MAX_ROWS || !masks || !mask_row)
        return PRISM_EINVAL;
    if (n_rows == 0) return PRISM_OK;
    token_mask_kernel<<<n_rows, THREADS, 0, st>>>(logits, vocab, masks, words, mask_row);
    return PRISM_CUDA_LAUNCHED("token_mask");
}
