/* dtype: tensor element types, activation names and host-side half-precision conversion.
 *
 * A leaf: no backend, no BLAS, no CUDA. Whatever needs only these names (config.json parsing in
 * the router, the safetensors reader, every backend) includes this header and links prism_dtype,
 * so a process that runs no model links no compute library. */
#ifndef PRISM_DTYPE_H
#define PRISM_DTYPE_H

#include "core/core.h"

#include <string.h>

typedef enum {
    PRISM_DTYPE_F32  = 0,
    PRISM_DTYPE_BF16 = 1,
    PRISM_DTYPE_F16  = 2,
} prism_dtype_t;

size_t prism_dtype_size(prism_dtype_t t);
const char *prism_dtype_name(prism_dtype_t t);

/* Elementwise activations. */
typedef enum {
    PRISM_ACT_NONE       = 0,
    PRISM_ACT_SILU       = 1,
    PRISM_ACT_GELU_ERF   = 2,  /* HF "gelu" */
    PRISM_ACT_GELU_TANH  = 3,  /* HF "gelu_new" / "gelu_pytorch_tanh" */
    PRISM_ACT_QUICK_GELU = 4,  /* x * sigmoid(1.702 x) */
    PRISM_ACT_RELU       = 5,
} prism_act_t;

/* Parses an HF hidden_act string ("gelu", "quick_gelu", "silu", ...); -1 when unknown. */
int prism_act_parse(const char *s);

/* bf16/f16 <-> f32 on the host (loader, KV transfers, tests). The bf16 pair is inline and
 * branch-free so that loops over arrays of them vectorize. */
static inline float prism_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t prism_f32_to_bf16(float f)   /* round to nearest even; a NaN stays a (quiet) NaN */
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u, r = (u + 0x7fffu + ((u >> 16) & 1)) >> 16;
    return (uint16_t)(nan ? (u >> 16) | 0x40 : r);
}
float    prism_f16_to_f32(uint16_t h);
uint16_t prism_f32_to_f16(float f);

/* ---- counter-based random numbers (--random-weights) ----
 * The value at index i depends only on (seed, i), so the host loader and a device kernel
 * (prism_backend_i.fill_random) produce bit-identical tensors. Bell-shaped (a sum of four
 * 16-bit uniforms), mean 0, standard deviation 1. Compiles as host and as CUDA device code: the
 * only rounding is the final multiply, so no compiler contraction can change the value. */
#if defined(__CUDACC__)
#define PRISM_HOST_DEVICE __host__ __device__
#else
#define PRISM_HOST_DEVICE
#endif

static inline PRISM_HOST_DEVICE float prism_random_normalish(uint64_t seed, uint64_t i)
{
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * (i + 1);   /* splitmix64 */
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    uint32_t s = (uint32_t)(z & 0xffff) + (uint32_t)((z >> 16) & 0xffff) + (uint32_t)((z >> 32) & 0xffff) +
                 (uint32_t)(z >> 48);
    return ((float)s * (1.0f / 65536.0f) - 2.0f) * 1.7320508f;   /* (s/2^16 - 2) is exact */
}

#endif
