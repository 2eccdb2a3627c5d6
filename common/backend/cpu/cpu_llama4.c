/* CPU kernels of the Llama-4 ops (backend.h "Llama-4 ops"): per-head RMS norm, row scaling, MoE
 * routing / grouped GEMM / combine, pixel shuffle. Reference semantics for the CUDA versions. */
#include "backend/cpu/cpu_impl.h"

#include <cblas.h>
#include <math.h>

int prism_cpu_head_rmsnorm(void *ctx, float *x, int ld, int n_tokens, int n_heads, int head_dim, const float *w,
                           float eps)
{
    if (n_tokens < 0 || n_heads <= 0 || head_dim <= 0 || (long)ld < (long)n_heads * head_dim) return PRISM_EINVAL;
    for (int t = 0; t < n_tokens; t++)
        for (int h = 0; h < n_heads; h++) {
            float *v = x + (size_t)t * ld + (size_t)h * head_dim;
            double ss = 0;
            for (int i = 0; i < head_dim; i++) ss += (double)v[i] * v[i];
            float inv = 1.0f / sqrtf((float)(ss / head_dim) + eps);
            for (int i = 0; i < head_dim; i++) v[i] = w ? w[i] * (v[i] * inv) : v[i] * inv;
        }
    return PRISM_OK;
}

int prism_cpu_scale_rows(void *ctx, float *x, int ld, int n_rows, int dim, const float *s)
{
    if (n_rows < 0 || dim < 0 || ld < dim) return PRISM_EINVAL;
    for (int r = 0; r < n_rows; r++) {
        float *v = x + (size_t)r * ld, f = s[r];
        for (int i = 0; i < dim; i++) v[i] *= f;
    }
    return PRISM_OK;
}

int prism_cpu_moe_route(void *ctx, const float *logits, int n_tokens, int n_experts, int top_k, int32_t *choice,
                        int32_t *order, float *weight, int32_t *offsets, int32_t *slot)
{
    if (n_tokens < 0 || n_experts <= 0 || top_k <= 0 || top_k > n_experts || top_k > PRISM_MOE_MAX_TOPK)
        return PRISM_EINVAL;
    for (int e = 0; e <= n_experts; e++) offsets[e] = 0;
    for (int t = 0; t < n_tokens; t++) {
        const float *l = logits + (size_t)t * n_experts;
        int32_t *ch = choice + (size_t)t * top_k;
        /* Selection by repeated max: k is 1 or 2 in practice. Strict '>' keeps the lower index on ties. */
        for (int i = 0; i < top_k; i++) {
            int best = -1;
            for (int e = 0; e < n_experts; e++) {
                bool taken = false;
                for (int j = 0; j < i; j++) taken = taken || ch[j] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            ch[i] = best;
            offsets[best + 1]++;
        }
    }
    for (int e = 0; e < n_experts; e++) offsets[e + 1] += offsets[e];
    /* Stable placement: rows of one expert in token order. offsets[e] serves as the cursor and is
     * restored after. */
    for (int t = 0; t < n_tokens; t++)
        for (int i = 0; i < top_k; i++) {
            int e = choice[(size_t)t * top_k + i];
            int r = offsets[e]++;
            order[r] = t;
            float z = logits[(size_t)t * n_experts + e];
            weight[r] = 1.0f / (1.0f + expf(-z));
            slot[(size_t)t * top_k + i] = r;
        }
    for (int e = n_experts; e > 0; e--) offsets[e] = offsets[e - 1];
    offsets[0] = 0;
    return PRISM_OK;
}

int prism_cpu_matmul_grouped(void *ctx, float *y, int ldy, const float *x, int ldx, const void *w, prism_dtype_t wdt,
                             const int32_t *offsets, int n_groups, int M, int N, int K)
{
    if (wdt != PRISM_DTYPE_F32) return PRISM_ENOTSUP;
    if (n_groups <= 0 || M < 0 || N <= 0 || K <= 0 || ldy < N || ldx < K || offsets[0] != 0 || offsets[n_groups] != M)
        return PRISM_EINVAL;
    for (int e = 0; e < n_groups; e++) {
        int r0 = offsets[e], m = offsets[e + 1] - r0;
        if (m < 0 || r0 < 0 || r0 + m > M) return PRISM_EINVAL;
        if (m == 0) continue;
        const float *we = (const float *)w + (size_t)e * K * N;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, N, K, 1.0f, x + (size_t)r0 * ldx, ldx, we, N, 0.0f,
                    y + (size_t)r0 * ldy, ldy);
    }
    return PRISM_OK;
}

int prism_cpu_moe_combine(void *ctx, float *y, int ldy, const float *src, const int32_t *slot, int n_tokens, int top_k,
                          int dim)
{
    if (n_tokens < 0 || top_k <= 0 || dim <= 0 || ldy < dim) return PRISM_EINVAL;
    for (int t = 0; t < n_tokens; t++) {
        float *yt = y + (size_t)t * ldy;
        for (int i = 0; i < top_k; i++) {
            const float *s = src + (size_t)slot[(size_t)t * top_k + i] * dim;
            for (int d = 0; d < dim; d++) yt[d] += s[d];
        }
    }
    return PRISM_OK;
}

int prism_cpu_pixel_shuffle(void *ctx, float *out, const float *x, int n_img, int rows_per_img, int g, int C, int s)
{
    if (n_img < 0 || g <= 0 || C <= 0 || s <= 0 || g % s || rows_per_img < g * g) return PRISM_EINVAL;
    int go = g / s;
    for (int i = 0; i < n_img; i++)
        for (int h2 = 0; h2 < go; h2++)
            for (int w2 = 0; w2 < go; w2++) {
                float *o = out + ((size_t)i * go * go + (size_t)h2 * go + w2) * s * s * C;
                for (int dh = 0; dh < s; dh++)
                    for (int dw = 0; dw < s; dw++) {
                        const float *src = x + ((size_t)i * rows_per_img + (size_t)(s * h2 + dh) * g + s * w2 + dw) * C;
                        memcpy(o + (size_t)(dh * s + dw) * C, src, (size_t)C * sizeof(float));
                    }
            }
    return PRISM_OK;
}
