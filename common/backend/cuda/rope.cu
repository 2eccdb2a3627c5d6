/* RoPE in place: rotate-half (NeoX / HF Llama) or interleaved pairs (Llama-4), over the first
 * rot_dim dims of each head. The angle pos * inv_freq[i] is an fp32 product as in HF, and
 * sincosf is the accurate (non --use_fast_math) one, so large positions keep their precision.
 * inv_freq already carries any llama3 scaling (computed on the host by the model). */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256

static __global__ void rope_kernel(float *x, int ld, int n_tokens, int n_heads, int head_dim, int half,
                                   const int32_t *pos, const float *inv_freq, int interleave)
{
    size_t total = (size_t)n_tokens * n_heads * half;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
        int i = (int)(k % half);
        size_t th = k / half;
        int h = (int)(th % n_heads);
        size_t t = th / n_heads;
        float ang = (float)pos[t] * inv_freq[i];
        float s, c;
        sincosf(ang, &s, &c);
        float *xh = x + t * (size_t)ld + (size_t)h * head_dim;
        int i0 = interleave ? 2 * i : i, i1 = interleave ? 2 * i + 1 : i + half;
        float a = xh[i0], b = xh[i1];
        xh[i0] = a * c - b * s;
        xh[i1] = b * c + a * s;
    }
}

static int launch(cudaStream_t st, float *x, int ld, int n_tokens, int n_heads, int head_dim, int half,
                  const int32_t *pos, const float *inv_freq, int interleave)
{
    size_t total = (size_t)n_tokens * n_heads * half;
    rope_kernel<<<prism_cuda_blocks(total, THREADS), THREADS, 0, st>>>(x, ld, n_tokens, n_heads, head_dim, half, pos,
                                                                       inv_freq, interleave);
    return PRISM_CUDA_LAUNCHED("rope");
}

extern "C" int prism_cuda_rope(cudaStream_t st, float *x, int ld, int n_tokens, int n_heads, int head_dim,
                               int rot_dim, const int32_t *pos, const float *inv_freq, prism_rope_mode_t mode)
{
    if (rot_dim <= 0 || rot_dim > head_dim || (rot_dim & 1) || n_heads <= 0 || n_tokens < 0 ||
        (long)ld < (long)n_heads * head_dim || (mode != PRISM_ROPE_NEOX && mode != PRISM_ROPE_INTERLEAVE))
        return PRISM_EINVAL;
    if (n_tokens == 0) return PRISM_OK;
    return launch(st, x, ld, n_tokens, n_heads, head_dim, rot_dim / 2, pos, inv_freq, mode == PRISM_ROPE_INTERLEAVE);
}
