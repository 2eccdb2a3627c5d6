/* RoPE whose position depends on the rotary pair (backend.h, rope_multi): M-RoPE (Qwen2.5-VL runs
 * of t / h / w pairs, Qwen3-VL interleaved) and the native-resolution towers' 2D rotary (rows, then
 * columns). rotate_half pairing; the angle is the fp32 product pos * inv_freq and sincosf the
 * accurate one, as rope.cu. The pair -> position-row table travels by value in the launch's
 * parameters (256 bytes): no upload, no device copy to keep alive. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256

static __global__ void rope_multi_kernel(float *x, int ld, int n_tokens, int n_heads, int head_dim, int half,
                                         const int32_t *pos, int pos_ld, const float *inv_freq, prism_rope_sections_t sec)
{
    size_t total = (size_t)n_tokens * n_heads * half;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
        int i = (int)(k % half);
        size_t th = k / half;
        int h = (int)(th % n_heads);
        size_t t = th / n_heads;
        float ang = (float)pos[(size_t)sec.of[i] * pos_ld + t] * inv_freq[i];
        float s, c;
        sincosf(ang, &s, &c);
        float *xh = x + t * (size_t)ld + (size_t)h * head_dim;
        float a = xh[i], b = xh[i + half];
        xh[i] = a * c - b * s;
        xh[i + half] = b * c + a * s;
    }
}

static int launch(cudaStream_t st, float *x, int ld, int n_tokens, int n_heads, int head_dim, const int32_t *pos,
                  int pos_ld, const float *inv_freq, const prism_rope_sections_t *sec)
{
    int half = head_dim / 2;
    size_t total = (size_t)n_tokens * n_heads * half;
    rope_multi_kernel<<<prism_cuda_blocks(total, THREADS), THREADS, 0, st>>>(x, ld, n_tokens, n_heads, head_dim, half,
                                                                             pos, pos_ld, inv_freq, *sec);
    return PRISM_CUDA_LAUNCHED("rope_multi");
}

extern "C" int prism_cuda_rope_multi(cudaStream_t st, float *x, int ld, int n_tokens, int n_heads, int head_dim,
                                     const int32_t *pos, int pos_ld, const float *inv_freq,
                                     const prism_rope_sections_t *sec)
{
    if (head_dim <= 0 || (head_dim & 1) || head_dim / 2 > PRISM_ROPE_MAX_PAIRS || n_tokens < 0 || n_heads < 0 ||
        (long)ld < (long)n_heads * head_dim || pos_ld < n_tokens || !sec)
        return PRISM_EINVAL;
    for (int j = 0; j < head_dim / 2; j++)
        if (sec->of[j] >= PRISM_ROPE_MAX_SECTIONS) return PRISM_EINVAL;
    if (n_tokens == 0 || n_heads == 0) return PRISM_OK;
    return launch(st, x, ld, n_tokens, n_heads, head_dim, pos, pos_ld, inv_freq, sec);
}
