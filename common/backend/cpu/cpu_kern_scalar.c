/* Scalar kernels: portable C with libm. The reference the vector paths are compared with, and
 * the path on CPUs without AVX2 (or when PRISM_CPU_ISA=scalar). Same tiling as the vector paths,
 * so it is slow only by the width of its arithmetic, not by its algorithm. */
#include "backend/cpu/cpu_kern.h"

#include <math.h>
#include <string.h>

static inline float act_one(prism_act_t act, float v)
{
    switch (act) {
    case PRISM_ACT_NONE: return v;
    case PRISM_ACT_SILU: return v / (1.0f + expf(-v));
    case PRISM_ACT_GELU_ERF: return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    case PRISM_ACT_GELU_TANH:
        return 0.5f * v * (1.0f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
    case PRISM_ACT_QUICK_GELU: return v / (1.0f + expf(-1.702f * v));
    case PRISM_ACT_RELU: return v > 0 ? v : 0;
    }
    return v;
}

static void s_act(prism_act_t act, float *y, const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) y[i] = act_one(act, x[i]);
}

static void s_silu_mul(float *o, const float *g, const float *u, size_t n)
{
    for (size_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void s_add(float *y, const float *a, const float *b, size_t n)
{
    for (size_t i = 0; i < n; i++) y[i] = a[i] + b[i];
}

static void s_scale(float *y, const float *x, float s, size_t n)
{
    for (size_t i = 0; i < n; i++) y[i] = x[i] * s;
}

static void s_rmsnorm(float *y, const float *x, const float *w, int dim, float eps)
{
    double ss = 0;
    for (int i = 0; i < dim; i++) ss += (double)x[i] * x[i];
    float inv = 1.0f / sqrtf((float)(ss / dim) + eps);
    if (w)
        for (int i = 0; i < dim; i++) y[i] = w[i] * (x[i] * inv);
    else
        for (int i = 0; i < dim; i++) y[i] = x[i] * inv;
}

static void s_layernorm(float *y, const float *x, const float *w, const float *b, int dim, float eps)
{
    double mean = 0, var = 0;
    for (int i = 0; i < dim; i++) mean += x[i];
    mean /= dim;
    for (int i = 0; i < dim; i++) {
        double d = x[i] - mean;
        var += d * d;
    }
    var /= dim;
    float inv = (float)(1.0 / sqrt(var + eps)), m = (float)mean;
    for (int i = 0; i < dim; i++) y[i] = (x[i] - m) * inv * (w ? w[i] : 1.0f) + (b ? b[i] : 0.0f);
}

static void s_rope(float *x, int n_heads, int head_dim, int half, const float *c, const float *s,
                   prism_rope_mode_t mode)
{
    for (int h = 0; h < n_heads; h++) {
        float *xh = x + (size_t)h * head_dim;
        for (int i = 0; i < half; i++) {
            int i0 = mode == PRISM_ROPE_NEOX ? i : 2 * i;
            int i1 = mode == PRISM_ROPE_NEOX ? i + half : 2 * i + 1;
            float a = xh[i0], b = xh[i1];
            xh[i0] = a * c[i] - b * s[i];
            xh[i1] = b * c[i] + a * s[i];
        }
    }
}

static void s_gemv(float *y, int ldy, const float *x, int ldx, const float *w, int ldw, int M, int N, int K,
                   bool accumulate)
{
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            const float *xr = x + (size_t)m * ldx, *wr = w + (size_t)n * ldw;
            float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
            int k = 0;
            for (; k + 4 <= K; k += 4) {
                s0 += xr[k] * wr[k];
                s1 += xr[k + 1] * wr[k + 1];
                s2 += xr[k + 2] * wr[k + 2];
                s3 += xr[k + 3] * wr[k + 3];
            }
            for (; k < K; k++) s0 += xr[k] * wr[k];
            float v = (s0 + s1) + (s2 + s3);
            y[(size_t)m * ldy + n] = accumulate ? y[(size_t)m * ldy + n] + v : v;
        }
}

static void s_gemv_bf16(float *y, int ldy, const float *x, int ldx, const uint16_t *w, int ldw, int M, int N, int K,
                        bool accumulate)
{
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            const float *xr = x + (size_t)m * ldx;
            const uint16_t *wr = w + (size_t)n * ldw;
            float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
            int k = 0;
            for (; k + 4 <= K; k += 4) {
                s0 += xr[k] * prism_bf16_to_f32(wr[k]);
                s1 += xr[k + 1] * prism_bf16_to_f32(wr[k + 1]);
                s2 += xr[k + 2] * prism_bf16_to_f32(wr[k + 2]);
                s3 += xr[k + 3] * prism_bf16_to_f32(wr[k + 3]);
            }
            for (; k < K; k++) s0 += xr[k] * prism_bf16_to_f32(wr[k]);
            float v = (s0 + s1) + (s2 + s3);
            y[(size_t)m * ldy + n] = accumulate ? y[(size_t)m * ldy + n] + v : v;
        }
}

static void s_bf16_to_f32(float *y, const uint16_t *x, size_t n)
{
    for (size_t i = 0; i < n; i++) y[i] = prism_bf16_to_f32(x[i]);
}

void prism_cpu_round_bf16(float *y, const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) y[i] = prism_bf16_to_f32(prism_f32_to_bf16(x[i]));
}

void prism_cpu_bf16p_pack(uint16_t *w, int N, int K, uint16_t *tmp)
{
    const int C = PRISM_CPU_BF16P_COLS;
    const size_t panel = prism_cpu_bf16p_panel(K);
    const int pairs = (K + 1) / 2;
    for (int p = (N + C - 1) / C - 1; p >= 0; p--) {
        int cols = PRISM_MIN(C, N - p * C);
        memcpy(tmp, w + (size_t)p * C * K, (size_t)cols * K * sizeof *w);
        uint16_t *d = w + (size_t)p * panel;
        for (int j = 0; j < pairs; j++)
            for (int c = 0; c < C; c++)
                for (int e = 0; e < 2; e++) {
                    int k = 2 * j + e;
                    d[((size_t)j * C + c) * 2 + e] = c < cols && k < K ? tmp[(size_t)c * K + k] : 0;
                }
    }
}

/* The reference of the bf16 dot products: x rounded to bf16, each product exact in fp32 (8-bit
 * by 8-bit significands), summed in fp32 in k order. */
static void s_matmul_bf16dp(float *y, int ldy, const float *x, int ldx, const uint16_t *w, int ldw, int M, int N,
                            int K, bool accumulate, uint16_t *xb, size_t xb_len)
{
    (void)xb, (void)xb_len;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            const float *xr = x + (size_t)m * ldx;
            const uint16_t *wr = w + (size_t)n * ldw;
            float s = 0;
            for (int k = 0; k < K; k++)
                s += prism_bf16_to_f32(prism_f32_to_bf16(xr[k])) * prism_bf16_to_f32(wr[k]);
            y[(size_t)m * ldy + n] = accumulate ? y[(size_t)m * ldy + n] + s : s;
        }
}

static void s_pack_kt(float *Kt, int ldk, const float *const *krows, int n, int hd)
{
    for (int d = 0; d < hd; d++) {
        float *row = Kt + (size_t)d * ldk;
        for (int j = 0; j < n; j++) row[j] = krows[j][d];
        for (int j = n; j < ldk; j++) row[j] = 0.0f;
    }
}

static void s_qk(float *S, int lds, const float *Q, int ldq, const float *Kt, int ldk, int m, int hd)
{
    for (int i = 0; i < m; i++) {
        float *s = S + (size_t)i * lds;
        const float *q = Q + (size_t)i * ldq;
        for (int j = 0; j < ldk; j++) s[j] = 0.0f;
        for (int d = 0; d < hd; d++) {
            const float *k = Kt + (size_t)d * ldk;
            float qd = q[d];
            for (int j = 0; j < ldk; j++) s[j] += qd * k[j];
        }
    }
}

static void s_qk_rows(float *S, int lds, const float *Q, int ldq, const float *const *krows, int m, int n, int hd)
{
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            const float *q = Q + (size_t)i * ldq, *k = krows[j];
            float a = 0;
            for (int d = 0; d < hd; d++) a += q[d] * k[d];
            S[(size_t)i * lds + j] = a;
        }
}

static void s_softmax(float *S, int lds, int m, int n, float *mrun, float *lrun, float *corr)
{
    for (int i = 0; i < m; i++) {
        float *s = S + (size_t)i * lds;
        float mx = -INFINITY;
        for (int j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
        float m_new = mrun[i] > mx ? mrun[i] : mx;
        if (m_new == -INFINITY) {   /* nothing visible yet */
            for (int j = 0; j < n; j++) s[j] = 0.0f;
            corr[i] = 1.0f;
            continue;
        }
        corr[i] = mrun[i] == -INFINITY ? 0.0f : expf(mrun[i] - m_new);
        float sum = 0;
        for (int j = 0; j < n; j++) {
            s[j] = expf(s[j] - m_new);
            sum += s[j];
        }
        lrun[i] = lrun[i] * corr[i] + sum;
        mrun[i] = m_new;
    }
}

static void s_pv(float *O, int ldo, const float *P, int ldp, const float *const *vrows, const float *corr, int m,
                 int n, int hd)
{
    for (int i = 0; i < m; i++) {
        float *o = O + (size_t)i * ldo;
        const float *p = P + (size_t)i * ldp;
        if (corr[i] != 1.0f)
            for (int d = 0; d < hd; d++) o[d] *= corr[i];
        for (int j = 0; j < n; j++) {
            const float *v = vrows[j];
            float pj = p[j];
            for (int d = 0; d < hd; d++) o[d] += pj * v[d];
        }
    }
}

const prism_cpu_kern_t prism_cpu_kern_scalar = {
    .name = "scalar",
    .isa = PRISM_CPU_ISA_SCALAR,
    .act = s_act,
    .silu_mul = s_silu_mul,
    .add = s_add,
    .scale = s_scale,
    .rmsnorm = s_rmsnorm,
    .layernorm = s_layernorm,
    .rope = s_rope,
    .gemv = s_gemv,
    .gemv_bf16 = s_gemv_bf16,
    .bf16_to_f32 = s_bf16_to_f32,
    .round_bf16 = prism_cpu_round_bf16,
    .matmul_bf16dp = s_matmul_bf16dp,
    .pack_kt = s_pack_kt,
    .qk = s_qk,
    .qk_rows = s_qk_rows,
    .softmax = s_softmax,
    .pv = s_pv,
};
