/* The per-sequence token-count table penalties read (layout: common/sample/sample.h,
 * prism_token_counts_t): counts[slots[i]][tokens[i]] += 1 for the n tokens a step sampled, on
 * the device where those tokens already are. Tokens or slots out of range are skipped (the
 * CPU reference ignores them too). */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 128

static __global__ void token_counts_kernel(int32_t *counts, int n_slots, int vocab, const int32_t *slots,
                                           const int32_t *tokens, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int32_t s = slots[i], t = tokens[i];
    if (s < 0 || s >= n_slots || t < 0 || t >= vocab) return;
    atomicAdd(&counts[(size_t)s * vocab + t], 1);   /* two rows never share a slot; atomic costs nothing here */
}

extern "C" int prism_cuda_token_counts_add_k(cudaStream_t st, int32_t *counts, int n_slots, int vocab,
                                             const int32_t *slots, const int32_t *tokens, int n)
{
    if (vocab <= 0 || n_slots <= 0 || n < 0 || !counts) return PRISM_EINVAL;
    if (n == 0) return PRISM_OK;
    token_counts_kernel<<<prism_cuda_blocks((size_t)n, THREADS), THREADS, 0, st>>>(counts, n_slots, vocab, slots,
                                                                                  tokens, n);
    return PRISM_CUDA_LAUNCHED("token_counts");
}
