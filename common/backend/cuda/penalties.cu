/* Presence / frequency / repetition penalties on the device, from the per-sequence token-count
 * table (the CPU reference and the rules are common/sample/logits.c, prism_apply_penalties):
 * logits [n_rows][vocab]; each row names its table slot, counts [slots][vocab] int32 and prompt
 * bits [slots][words]. Grid-stride over the row's vocabulary, one block per row: the table is
 * read once, coalesced, and nothing leaves the device. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256

static __global__ void penalties_kernel(float *logits, int vocab, const int32_t *counts, const uint32_t *prompt_bits,
                                        const prism_backend_penalty_row_t *rows)
{
    const prism_backend_penalty_row_t p = rows[blockIdx.x];
    if (p.slot < 0) return;
    float *l = logits + (size_t)blockIdx.x * vocab;
    const int32_t *c = counts + (size_t)p.slot * vocab;
    const uint32_t *bits = prompt_bits + (size_t)p.slot * ((vocab + 31) / 32);
    bool rep = p.repetition > 0.0f && p.repetition != 1.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        int32_t n = c[i];
        bool in_prompt = (bits[i >> 5] >> (i & 31)) & 1u;
        if (!n && !in_prompt) continue;
        float x = l[i];
        if (rep) x = x > 0.0f ? x / p.repetition : x * p.repetition;
        if (n) x -= p.frequency * (float)n + p.presence;
        l[i] = x;
    }
}

extern "C" int prism_cuda_penalties_k(cudaStream_t st, float *logits, int n_rows, int vocab, const int32_t *counts,
                                      const uint32_t *prompt_bits, const prism_backend_penalty_row_t *rows)
{
    if (vocab <= 0 || n_rows < 0 || n_rows > PRISM_CUDA_MAX_ROWS || !counts || !prompt_bits || !rows) return PRISM_EINVAL;
    if (n_rows == 0) return PRISM_OK;
    penalties_kernel<<<n_rows, THREADS, 0, st>>>(logits, vocab, counts, prompt_bits, rows);
    return PRISM_CUDA_LAUNCHED("penalties");
}
