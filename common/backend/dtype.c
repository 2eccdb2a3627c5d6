/* dtype sizes and names, activation names, host half-precision conversion. See dtype.h. */
#include "backend/dtype.h"

#include <string.h>

size_t prism_dtype_size(prism_dtype_t t)
{
    switch (t) {
    case PRISM_DTYPE_F32: return 4;
    case PRISM_DTYPE_BF16: return 2;
    case PRISM_DTYPE_F16: return 2;
    }
    return 0;
}

const char *prism_dtype_name(prism_dtype_t t)
{
    switch (t) {
    case PRISM_DTYPE_F32: return "f32";
    case PRISM_DTYPE_BF16: return "bf16";
    case PRISM_DTYPE_F16: return "f16";
    }
    return "?";
}

int prism_act_parse(const char *s)
{
    static const struct { const char *name; int act; } names[] = {
        {"silu", PRISM_ACT_SILU}, {"swish", PRISM_ACT_SILU},
        {"gelu", PRISM_ACT_GELU_ERF}, {"gelu_python", PRISM_ACT_GELU_ERF},
        {"gelu_new", PRISM_ACT_GELU_TANH}, {"gelu_pytorch_tanh", PRISM_ACT_GELU_TANH},
        {"gelu_fast", PRISM_ACT_GELU_TANH},
        {"quick_gelu", PRISM_ACT_QUICK_GELU}, {"relu", PRISM_ACT_RELU},
    };
    if (!s) return -1;
    for (size_t i = 0; i < PRISM_ARRAY_LEN(names); i++)
        if (strcmp(s, names[i].name) == 0) return names[i].act;
    return -1;
}

/* ---- half-precision conversion (host) ---- */

float prism_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {  /* subnormal: renormalise */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t prism_f32_to_f16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000;
    int32_t exp = (int32_t)((u >> 23) & 0xff) - 127 + 15;
    uint32_t man = u & 0x7fffff;
    if (((u >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        man |= 0x800000;
        uint32_t shift = (uint32_t)(14 - exp);
        uint32_t half = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = sign | ((uint32_t)exp << 10) | (man >> 13);
    uint32_t rem = man & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) half++;
    return (uint16_t)half;
}
