/* dtype: tensor element types, activation names and host-side half-precision conversion.
 *
 * A leaf: no backend, no BLAS, no CUDA. Whatever needs only these names (config.json parsing in
 * the router, the safetensors reader, every backend) includes this header and links prism_dtype,
 * so a process that runs no model links no compute library. */
#ifndef PRISM_DTYPE_H
#define PRISM_DTYPE_H

#include "core/core.h"

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

/* bf16/f16 <-> f32 on the host (loader and tests). */
float    prism_bf16_to_f32(uint16_t h);
uint16_t prism_f32_to_bf16(float f);   /* round to nearest even */
float    prism_f16_to_f32(uint16_t h);
uint16_t prism_f32_to_f16(float f);

#endif
