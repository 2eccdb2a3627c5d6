/* The vector kernels, written once over a thin macro layer and instantiated per ISA: included
 * only by cpu_kern_avx2.c and cpu_kern_avx512.c, each of which first defines
 *
 *   VL                      lanes; vf / vmask the vector and comparison-mask types
 *   VLOAD VSTORE            unaligned; VLOADN / VSTOREN(p, v, n) touch only lanes < n (others 0)
 *   VSET1 VZERO VADD VSUB VMUL VDIV VMAX VMIN VABS VFLOOR VROUND
 *   VFMA(a, b, c) = a*b + c   VFNMA(a, b, c) = c - a*b
 *   VLT VGE (masks) and VSEL(m, t, f) = m ? t : f;  VPOW2I(n) = 2^n for integral n in [-126, 127]
 *   VCOPYSIGN(mag, sgn) VHSUM VHMAX VIOTA (0, 1, ..., VL-1)
 *   VHSUM4(a, b, c, d)      __m128 [Σa, Σb, Σc, Σd] (one transpose-add for four sums)
 *   VLOADBF16(p)            VL bf16 values from p, widened to fp32
 *   KSUM_D KSUMSQ_D KSUMSQDEV_D   double-precision sums of a row (as the scalar reference sums)
 *   KTABLE / KNAME / KISA  the table symbol, its name and ISA
 *   KMATMUL_BF16DP          optional: the table's bf16 dot-product matmul (NULL when not defined)
 *   KMATMUL_BF16P           optional: the same on packed weights (NULL when not defined)
 *   KMATMUL_F32P            optional: fp32 x times packed bf16 weights (NULL when not defined)
 *
 * The polynomial exp and erf here are within about 2 ulp of libm (fits in tools/fit_cpu_erf.py);
 * everything else does the scalar reference's arithmetic in a different order. */
#ifndef KTABLE
#error "cpu_kern_simd.h is included by an ISA file that defines the macro layer"
#endif

#include <math.h>
#include <string.h>

#define INL static inline __attribute__((always_inline))

/* ---- transcendental functions ---- */

/* e^r on |r| <= ln2/2: degree-6 minimax polynomial (relative error 2e-9 before fp32 rounding). */
INL vf v_exp_poly(vf r)
{
    vf p = VSET1(1.3829420599507413e-03f);
    p = VFMA(p, r, VSET1(8.37477152017892e-03f));
    p = VFMA(p, r, VSET1(4.166835803297254e-02f));
    p = VFMA(p, r, VSET1(1.666642083211837e-01f));
    p = VFMA(p, r, VSET1(4.999999149303688e-01f));
    p = VFMA(p, r, VSET1(1.000000036125899f));
    return VFMA(p, r, VSET1(1.000000000592021f));
}

/* e^x: n = round(x/ln2), r = x - n·ln2 (two-constant split), e^r by v_exp_poly, scaled by 2^n
 * in two halves so that overflow gives inf and underflow gradual zero without special cases.
 * NaN propagates. */
INL vf v_exp(vf x)
{
    x = VMIN(VSET1(88.8f), VMAX(VSET1(-110.0f), x));   /* operand order keeps NaN */
    vf n = VROUND(VMUL(x, VSET1(1.44269504088896341f)));
    vf r = VFNMA(n, VSET1(0.693359375f), x);
    r = VFNMA(n, VSET1(-2.12194440e-4f), r);
    vf n1 = VFLOOR(VMUL(n, VSET1(0.5f))), n2 = VSUB(n, n1);
    return VMUL(VMUL(v_exp_poly(r), VPOW2I(n1)), VPOW2I(n2));
}

/* e^x for x <= 0 (softmax: scores minus their running max; -inf for masked keys): one scaling,
 * results below the smallest normal flush to 0. NaN propagates. */
INL vf v_exp_le0(vf x)
{
    vf xc = VMAX(VSET1(-87.33f), x);
    vf n = VROUND(VMUL(xc, VSET1(1.44269504088896341f)));
    vf r = VFNMA(n, VSET1(0.693359375f), xc);
    r = VFNMA(n, VSET1(-2.12194440e-4f), r);
    return VSEL(VLT(x, VSET1(-87.33f)), VZERO(), VMUL(v_exp_poly(r), VPOW2I(n)));
}

/* erf: |x| < 0.875: x·P(x²) (degree 5); below 3.93: 1 - e^(-x²)·R(1/(1+|x|)) (degree 8) with
 * x² split exactly (hi + lo) so e^(-x²) keeps full precision; beyond: ±1. */
INL vf v_erf(vf x)
{
    vf a = VABS(x), z = VMUL(a, a);
    vf ps = VSET1(-6.235155697919825e-04f);
    ps = VFMA(ps, z, VSET1(5.0387377197299715e-03f));
    ps = VFMA(ps, z, VSET1(-2.67963050554874e-02f));
    ps = VFMA(ps, z, VSET1(1.1282608234280822e-01f));
    ps = VFMA(ps, z, VSET1(-3.7612569154067754e-01f));
    ps = VFMA(ps, z, VSET1(1.1283791628326465f));
    vf small = VMUL(a, ps);
    vf lo = VFMA(a, a, VSUB(VZERO(), z));
    vf e = VMUL(v_exp(VSUB(VZERO(), z)), VSUB(VSET1(1.0f), lo));
    vf t = VDIV(VSET1(1.0f), VADD(VSET1(1.0f), a));
    vf pr = VSET1(0.9698054042660894f);
    pr = VFMA(pr, t, VSET1(-3.320914713059431f));
    pr = VFMA(pr, t, VSET1(4.59045859828667f));
    pr = VFMA(pr, t, VSET1(-2.8582421699364597f));
    pr = VFMA(pr, t, VSET1(0.31021933619238956f));
    pr = VFMA(pr, t, VSET1(0.17850851492916237f));
    pr = VFMA(pr, t, VSET1(0.5754641928326879f));
    pr = VFMA(pr, t, VSET1(0.5634946916102439f));
    pr = VFMA(pr, t, VSET1(1.840554803923347e-05f));
    vf large = VFNMA(e, pr, VSET1(1.0f));
    large = VSEL(VGE(a, VSET1(3.93f)), VSET1(1.0f), large);
    return VCOPYSIGN(VSEL(VLT(a, VSET1(0.875f)), small, large), x);
}

/* x·sigmoid(k·x) = x / (1 + e^(-k·x)): silu (k 1), quick-gelu (k 1.702). */
INL vf v_xsig(vf x, vf kx)
{
    return VDIV(x, VADD(VSET1(1.0f), v_exp(VSUB(VZERO(), kx))));
}

INL vf v_act(prism_act_t act, vf x)
{
    switch (act) {
    case PRISM_ACT_NONE: return x;
    case PRISM_ACT_SILU: return v_xsig(x, x);
    case PRISM_ACT_QUICK_GELU: return v_xsig(x, VMUL(x, VSET1(1.702f)));
    case PRISM_ACT_GELU_TANH: {
        /* 0.5·(1 + tanh(u)) = sigmoid(2u): no cancellation near 0 */
        vf x3 = VMUL(VMUL(x, x), x);
        vf u = VMUL(VSET1(0.79788456080286536f), VFMA(VSET1(0.044715f), x3, x));
        return v_xsig(x, VADD(u, u));
    }
    case PRISM_ACT_GELU_ERF:
        return VMUL(VMUL(VSET1(0.5f), x), VADD(VSET1(1.0f), v_erf(VMUL(x, VSET1(0.70710678118654752f)))));
    case PRISM_ACT_RELU: return VMAX(x, VZERO());   /* NaN -> 0, as the scalar x > 0 ? x : 0 */
    }
    return x;
}

/* ---- elementwise ---- */

#define EACH(n, body_full, body_tail)                     \
    do {                                                  \
        size_t i_ = 0;                                    \
        for (; i_ + VL <= (n); i_ += VL) { body_full; }   \
        if (i_ < (n)) { int r_ = (int)((n) - i_); body_tail; } \
    } while (0)

static void k_act(prism_act_t act, float *y, const float *x, size_t n)
{
    switch (act) {
#define ACT_CASE(A)                                                                              \
    case A:                                                                                      \
        EACH(n, VSTORE(y + i_, v_act(A, VLOAD(x + i_))), VSTOREN(y + i_, v_act(A, VLOADN(x + i_, r_)), r_)); \
        return;
    ACT_CASE(PRISM_ACT_NONE)
    ACT_CASE(PRISM_ACT_SILU)
    ACT_CASE(PRISM_ACT_GELU_ERF)
    ACT_CASE(PRISM_ACT_GELU_TANH)
    ACT_CASE(PRISM_ACT_QUICK_GELU)
    ACT_CASE(PRISM_ACT_RELU)
#undef ACT_CASE
    }
}

static void k_silu_mul(float *o, const float *g, const float *u, size_t n)
{
    EACH(n, { vf gv = VLOAD(g + i_); VSTORE(o + i_, VMUL(v_xsig(gv, gv), VLOAD(u + i_))); },
         { vf gv = VLOADN(g + i_, r_); VSTOREN(o + i_, VMUL(v_xsig(gv, gv), VLOADN(u + i_, r_)), r_); });
}

static void k_add(float *y, const float *a, const float *b, size_t n)
{
    EACH(n, VSTORE(y + i_, VADD(VLOAD(a + i_), VLOAD(b + i_))),
         VSTOREN(y + i_, VADD(VLOADN(a + i_, r_), VLOADN(b + i_, r_)), r_));
}

static void k_scale(float *y, const float *x, float s, size_t n)
{
    vf sv = VSET1(s);
    EACH(n, VSTORE(y + i_, VMUL(VLOAD(x + i_), sv)), VSTOREN(y + i_, VMUL(VLOADN(x + i_, r_), sv), r_));
}

/* ---- norms (one row) ---- */

static void k_rmsnorm(float *y, const float *x, const float *w, int dim, float eps)
{
    double ss = KSUMSQ_D(x, dim);
    vf inv = VSET1(1.0f / sqrtf((float)(ss / dim) + eps));
    size_t n = (size_t)dim;
    if (w)
        EACH(n, VSTORE(y + i_, VMUL(VLOAD(w + i_), VMUL(VLOAD(x + i_), inv))),
             VSTOREN(y + i_, VMUL(VLOADN(w + i_, r_), VMUL(VLOADN(x + i_, r_), inv)), r_));
    else
        EACH(n, VSTORE(y + i_, VMUL(VLOAD(x + i_), inv)), VSTOREN(y + i_, VMUL(VLOADN(x + i_, r_), inv), r_));
}

static void k_layernorm(float *y, const float *x, const float *w, const float *b, int dim, float eps)
{
    double mean = KSUM_D(x, dim) / dim;
    double var = KSUMSQDEV_D(x, dim, mean) / dim;
    vf inv = VSET1((float)(1.0 / sqrt(var + eps))), m = VSET1((float)mean), one = VSET1(1.0f);
    for (int i = 0; i < dim; i += VL) {
        int r = dim - i < VL ? dim - i : VL;
        vf xv = r == VL ? VLOAD(x + i) : VLOADN(x + i, r);
        vf wv = w ? (r == VL ? VLOAD(w + i) : VLOADN(w + i, r)) : one;
        vf bv = b ? (r == VL ? VLOAD(b + i) : VLOADN(b + i, r)) : VZERO();
        vf yv = VADD(VMUL(VMUL(VSUB(xv, m), inv), wv), bv);
        if (r == VL) VSTORE(y + i, yv);
        else VSTOREN(y + i, yv, r);
    }
}

static void k_rope(float *x, int n_heads, int head_dim, int half, const float *c, const float *s,
                   prism_rope_mode_t mode)
{
    for (int h = 0; h < n_heads; h++) {
        float *xh = x + (size_t)h * head_dim;
        if (mode != PRISM_ROPE_NEOX) {
            for (int i = 0; i < half; i++) {
                float a = xh[2 * i], b = xh[2 * i + 1];
                xh[2 * i] = a * c[i] - b * s[i];
                xh[2 * i + 1] = b * c[i] + a * s[i];
            }
            continue;
        }
        float *x1 = xh + half;
        for (int i = 0; i < half; i += VL) {
            int r = half - i < VL ? half - i : VL;
            vf a = r == VL ? VLOAD(xh + i) : VLOADN(xh + i, r);
            vf b = r == VL ? VLOAD(x1 + i) : VLOADN(x1 + i, r);
            vf cv = r == VL ? VLOAD(c + i) : VLOADN(c + i, r);
            vf sv = r == VL ? VLOAD(s + i) : VLOADN(s + i, r);
            vf y0 = VSUB(VMUL(a, cv), VMUL(b, sv));
            vf y1 = VADD(VMUL(b, cv), VMUL(a, sv));
            if (r == VL) {
                VSTORE(xh + i, y0);
                VSTORE(x1 + i, y1);
            } else {
                VSTOREN(xh + i, y0, r);
                VSTOREN(x1 + i, y1, r);
            }
        }
    }
}

/* ---- small-M matmul: 4 weight rows streamed once for up to 2 x rows ----
 * Weights fp32 or bf16 (bf16 widened in registers: the upper half of an fp32, exactly). */

INL vf wload(const void *w, bool bf16, size_t i)
{
    return bf16 ? VLOADBF16((const uint16_t *)w + i) : VLOAD((const float *)w + i);
}

INL vf wloadn(const void *w, bool bf16, size_t i, int n)
{
    if (!bf16) return VLOADN((const float *)w + i, n);
    uint16_t t[VL] = {0};
    memcpy(t, (const uint16_t *)w + i, (size_t)n * 2);
    return VLOADBF16(t);
}

/* How far ahead of its loads each weight row is prefetched. Without it a decode step, which reads
 * every weight once, pulls ~5% (fp32) to ~40% (bf16: half-length rows, two to a 4 KiB page, which
 * the hardware prefetcher follows poorly) less than the memory gives one core. */
#define GEMV_PF_BYTES 2048

INL void gemv_block(int mr, int nr, bool bf16, float *y, int ldy, const float *x, int ldx, const void *w, int ldw,
                    int K, bool acc)
{
    vf a[2][4];
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++)
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) a[i][r] = VZERO();
    int k = 0;
    for (; k + VL <= K; k += VL) {
        vf wv[4];
        /* prefetch: past a row's end, on into the same row of the next block of 4 (rows ldw apart) */
        int kp = k + GEMV_PF_BYTES / (bf16 ? 2 : 4);
        size_t pf = (kp < K ? (size_t)kp : (size_t)4 * ldw + (size_t)(kp - K)) * (bf16 ? 2 : 4);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++)
            if (r < nr) {
                _mm_prefetch((const char *)w + (size_t)r * ldw * (bf16 ? 2 : 4) + pf, _MM_HINT_T0);
                wv[r] = wload(w, bf16, (size_t)r * ldw + k);
            }
#pragma GCC unroll 2
        for (int i = 0; i < 2; i++)
            if (i < mr) {
                vf xv = VLOAD(x + (size_t)i * ldx + k);
#pragma GCC unroll 4
                for (int r = 0; r < 4; r++)
                    if (r < nr) a[i][r] = VFMA(xv, wv[r], a[i][r]);
            }
    }
    if (k < K) {
        int rem = K - k;
        vf wv[4];
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++)
            if (r < nr) wv[r] = wloadn(w, bf16, (size_t)r * ldw + k, rem);
#pragma GCC unroll 2
        for (int i = 0; i < 2; i++)
            if (i < mr) {
                vf xv = VLOADN(x + (size_t)i * ldx + k, rem);
#pragma GCC unroll 4
                for (int r = 0; r < 4; r++)
                    if (r < nr) a[i][r] = VFMA(xv, wv[r], a[i][r]);
            }
    }
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++)
        if (i < mr)
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++)
                if (r < nr) {
                    float v = VHSUM(a[i][r]);
                    float *yp = y + (size_t)i * ldy + r;
                    *yp = acc ? *yp + v : v;
                }
}

/* Weight rows outer, x rows inner: each block of 4 weight rows comes from memory once and is
 * re-read from cache for every further pair of x rows. */
INL void gemv_any(bool bf16, float *y, int ldy, const float *x, int ldx, const void *w, int ldw, int M, int N,
                  int K, bool accumulate)
{
    size_t wsz = bf16 ? 2 : 4;
    int n = 0;
    for (; n + 4 <= N; n += 4) {
        const void *wn = (const uint8_t *)w + (size_t)n * ldw * wsz;
        int m0 = 0;
        for (; m0 + 2 <= M; m0 += 2)
            gemv_block(2, 4, bf16, y + (size_t)m0 * ldy + n, ldy, x + (size_t)m0 * ldx, ldx, wn, ldw, K, accumulate);
        if (m0 < M) gemv_block(1, 4, bf16, y + (size_t)m0 * ldy + n, ldy, x + (size_t)m0 * ldx, ldx, wn, ldw, K, accumulate);
    }
    for (; n < N; n++) {
        const void *wn = (const uint8_t *)w + (size_t)n * ldw * wsz;
        int m0 = 0;
        for (; m0 + 2 <= M; m0 += 2)
            gemv_block(2, 1, bf16, y + (size_t)m0 * ldy + n, ldy, x + (size_t)m0 * ldx, ldx, wn, ldw, K, accumulate);
        if (m0 < M) gemv_block(1, 1, bf16, y + (size_t)m0 * ldy + n, ldy, x + (size_t)m0 * ldx, ldx, wn, ldw, K, accumulate);
    }
}

static void k_gemv(float *y, int ldy, const float *x, int ldx, const float *w, int ldw, int M, int N, int K,
                   bool accumulate)
{
    gemv_any(false, y, ldy, x, ldx, w, ldw, M, N, K, accumulate);
}

static void k_gemv_bf16(float *y, int ldy, const float *x, int ldx, const uint16_t *w, int ldw, int M, int N, int K,
                        bool accumulate)
{
    gemv_any(true, y, ldy, x, ldx, w, ldw, M, N, K, accumulate);
}

static void k_bf16_to_f32(float *y, const uint16_t *x, size_t n)
{
    size_t i = 0;
    for (; i + VL <= n; i += VL) VSTORE(y + i, VLOADBF16(x + i));
    if (i < n) VSTOREN(y + i, wloadn(x, true, i, (int)(n - i)), (int)(n - i));
}

/* ---- attention tiles ---- */

/* 8x8 transpose of rows r[0..7] in place (AVX: every ISA file here has it). */
INL void tr8x8(__m256 r[8])
{
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

static void k_pack_kt(float *Kt, int ldk, const float *const *krows, int n, int hd)
{
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        int d = 0;
        for (; d + 8 <= hd; d += 8) {
            __m256 r[8];
            for (int t = 0; t < 8; t++) r[t] = _mm256_loadu_ps(krows[j + t] + d);
            tr8x8(r);
            for (int t = 0; t < 8; t++) _mm256_storeu_ps(Kt + (size_t)(d + t) * ldk + j, r[t]);
        }
        for (; d < hd; d++)
            for (int t = 0; t < 8; t++) Kt[(size_t)d * ldk + j + t] = krows[j + t][d];
    }
    for (; j < n; j++)
        for (int d = 0; d < hd; d++) Kt[(size_t)d * ldk + j] = krows[j][d];
    if (n < ldk)
        for (int d = 0; d < hd; d++) memset(Kt + (size_t)d * ldk + n, 0, sizeof(float) * (size_t)(ldk - n));
}

#define QK_MR 6

/* S[mr rows][nv vectors] = Q · Kt over hd, accumulators in registers. */
INL void qk_block(int mr, int nv, float *S, int lds, const float *Q, int ldq, const float *Kt, int ldk, int hd)
{
    vf acc[QK_MR][2];
#pragma GCC unroll 6
    for (int i = 0; i < QK_MR; i++) {
        acc[i][0] = VZERO();
        acc[i][1] = VZERO();
    }
    for (int d = 0; d < hd; d++) {
        const float *k = Kt + (size_t)d * ldk;
        vf b0 = VLOAD(k), b1 = nv > 1 ? VLOAD(k + VL) : VZERO();
#pragma GCC unroll 6
        for (int i = 0; i < QK_MR; i++)
            if (i < mr) {
                vf a = VSET1(Q[(size_t)i * ldq + d]);
                acc[i][0] = VFMA(a, b0, acc[i][0]);
                if (nv > 1) acc[i][1] = VFMA(a, b1, acc[i][1]);
            }
    }
#pragma GCC unroll 6
    for (int i = 0; i < QK_MR; i++)
        if (i < mr) {
            VSTORE(S + (size_t)i * lds, acc[i][0]);
            if (nv > 1) VSTORE(S + (size_t)i * lds + VL, acc[i][1]);
        }
}

#define QK_DISPATCH(mr, nv, ...)                          \
    switch (mr) {                                         \
    case 6: qk_block(6, nv, __VA_ARGS__); break;          \
    case 5: qk_block(5, nv, __VA_ARGS__); break;          \
    case 4: qk_block(4, nv, __VA_ARGS__); break;          \
    case 3: qk_block(3, nv, __VA_ARGS__); break;          \
    case 2: qk_block(2, nv, __VA_ARGS__); break;          \
    default: qk_block(1, nv, __VA_ARGS__); break;         \
    }

static void k_qk(float *S, int lds, const float *Q, int ldq, const float *Kt, int ldk, int m, int hd)
{
    for (int i0 = 0; i0 < m; i0 += QK_MR) {
        int mr = m - i0 < QK_MR ? m - i0 : QK_MR;
        const float *q = Q + (size_t)i0 * ldq;
        float *s = S + (size_t)i0 * lds;
        int j = 0;
        for (; j + 2 * VL <= ldk; j += 2 * VL) QK_DISPATCH(mr, 2, s + j, lds, q, ldq, Kt + j, ldk, hd)
        for (; j < ldk; j += VL) QK_DISPATCH(mr, 1, s + j, lds, q, ldq, Kt + j, ldk, hd)
    }
}

/* Scores of mr query rows against 4 key rows: 4·mr accumulators, each row's 4 folded by one
 * transpose-add (VHSUM4) into 4 scores, instead of a full horizontal sum per score; with short
 * heads (hd 32 at VL 16: 2 FMAs a score) the reductions were most of the work. */
INL void qkr_tile4(int mr, float *S, int lds, const float *Q, int ldq, const float *const *kr, int hd)
{
    vf a[4][4];
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) a[i][c] = VZERO();
    int d = 0;
    for (; d + VL <= hd; d += VL) {
        vf kv[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) kv[c] = VLOAD(kr[c] + d);
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++) {
            vf q = VLOAD(Q + (size_t)i * ldq + d);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) a[i][c] = VFMA(q, kv[c], a[i][c]);
        }
    }
    if (d < hd) {
        vf kv[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) kv[c] = VLOADN(kr[c] + d, hd - d);
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++) {
            vf q = VLOADN(Q + (size_t)i * ldq + d, hd - d);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) a[i][c] = VFMA(q, kv[c], a[i][c]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++) _mm_storeu_ps(S + (size_t)i * lds, VHSUM4(a[i][0], a[i][1], a[i][2], a[i][3]));
}

/* the n % 4 last keys, one score at a time */
INL void qkr_tail(int mr, float *S, int lds, const float *Q, int ldq, const float *k, int hd)
{
    vf a[4];
    for (int i = 0; i < mr; i++) a[i] = VZERO();
    int d = 0;
    for (; d + VL <= hd; d += VL) {
        vf kv = VLOAD(k + d);
        for (int i = 0; i < mr; i++) a[i] = VFMA(VLOAD(Q + (size_t)i * ldq + d), kv, a[i]);
    }
    if (d < hd) {
        vf kv = VLOADN(k + d, hd - d);
        for (int i = 0; i < mr; i++) a[i] = VFMA(VLOADN(Q + (size_t)i * ldq + d, hd - d), kv, a[i]);
    }
    for (int i = 0; i < mr; i++) S[(size_t)i * lds] = VHSUM(a[i]);
}

/* query rows per tile: 4 x 4 accumulators fit AVX-512's 32 registers, AVX2's 16 hold 2 x 4 */
#define QKR_MR (VL >= 16 ? 4 : 2)

#define QKR_ROWS(mr)                                                                        \
    do {                                                                                    \
        int j = 0;                                                                          \
        for (; j + 4 <= n; j += 4) qkr_tile4((mr), s + j, lds, q, ldq, krows + j, hd);      \
        for (; j < n; j++) qkr_tail((mr), s + j, lds, q, ldq, krows[j], hd);                \
    } while (0)

static void k_qk_rows(float *S, int lds, const float *Q, int ldq, const float *const *krows, int m, int n, int hd)
{
    for (int i0 = 0; i0 < m; i0 += QKR_MR) {
        int mr = m - i0 < QKR_MR ? m - i0 : QKR_MR;
        const float *q = Q + (size_t)i0 * ldq;
        float *s = S + (size_t)i0 * lds;
        switch (mr) {
        case 4: QKR_ROWS(4); break;
        case 3: QKR_ROWS(3); break;
        case 2: QKR_ROWS(2); break;
        default: QKR_ROWS(1); break;
        }
    }
}

static void k_softmax(float *S, int lds, int m, int n, float *mrun, float *lrun, float *corr)
{
    const vf ninf = VSET1(-INFINITY);
    enum { CH = 64 };
    for (int i0 = 0; i0 < m; i0 += CH) {
        int mc = m - i0 < CH ? m - i0 : CH;
        float mnew[CH + VL], mold[CH + VL];
        /* tile maxima, then every row's correction e^(m_old - m_new) in one vector pass */
        for (int i = 0; i < mc; i++) {
            const float *s = S + (size_t)(i0 + i) * lds;
            vf mx = ninf;
            int j = 0;
            for (; j + VL <= n; j += VL) mx = VMAX(mx, VLOAD(s + j));
            if (j < n) mx = VMAX(mx, VSEL(VLT(VIOTA, VSET1((float)(n - j))), VLOADN(s + j, n - j), ninf));
            float tmax = VHMAX(mx);
            mold[i] = mrun[i0 + i];
            mnew[i] = mold[i] > tmax ? mold[i] : tmax;
        }
        for (int i = 0; i < mc; i += VL) {
            int r = mc - i < VL ? mc - i : VL;
            vf mo = VLOADN(mold + i, r), mn = VLOADN(mnew + i, r);
            vf c = v_exp_le0(VSUB(mo, mn));   /* m_old -inf: 0 */
            c = VSEL(VLT(mn, VSET1(-3.0e38f)), VSET1(1.0f), c);   /* nothing visible yet: keep 1 */
            VSTOREN(corr + i0 + i, c, r);
        }
        for (int i = 0; i < mc; i++) {
            float *s = S + (size_t)(i0 + i) * lds;
            if (mnew[i] == -INFINITY) {
                memset(s, 0, sizeof(float) * (size_t)n);
                continue;
            }
            vf mv = VSET1(mnew[i]), sum = VZERO();
            int j = 0;
            for (; j + VL <= n; j += VL) {
                vf p = v_exp_le0(VSUB(VLOAD(s + j), mv));
                VSTORE(s + j, p);
                sum = VADD(sum, p);
            }
            if (j < n) {
                vf p = v_exp_le0(VSUB(VSEL(VLT(VIOTA, VSET1((float)(n - j))), VLOADN(s + j, n - j), ninf), mv));
                VSTOREN(s + j, p, n - j);
                sum = VADD(sum, p);
            }
            lrun[i0 + i] = lrun[i0 + i] * corr[i0 + i] + VHSUM(sum);
            mrun[i0 + i] = mnew[i];
        }
    }
}

#define PV_MR 6

/* O[mr rows][nv vectors from column c] = O·corr + P · V over n keys. tail > 0: the last vector
 * covers only `tail` columns (masked loads and stores). */
INL void pv_block(int mr, int nv, int tail, float *O, int ldo, const float *P, int ldp, const float *const *vrows,
                  const float *corr, int n, int c)
{
    vf acc[PV_MR][2];
#pragma GCC unroll 6
    for (int i = 0; i < PV_MR; i++)
        if (i < mr) {
            vf ci = VSET1(corr[i]);
            float *o = O + (size_t)i * ldo + c;
            if (nv > 1) {
                acc[i][0] = VMUL(VLOAD(o), ci);
                acc[i][1] = VMUL(tail ? VLOADN(o + VL, tail) : VLOAD(o + VL), ci);
            } else {
                acc[i][0] = VMUL(tail ? VLOADN(o, tail) : VLOAD(o), ci);
            }
        }
    for (int j = 0; j < n; j++) {
        const float *v = vrows[j] + c;
        vf b0, b1 = VZERO();
        if (nv > 1) {
            b0 = VLOAD(v);
            b1 = tail ? VLOADN(v + VL, tail) : VLOAD(v + VL);
        } else {
            b0 = tail ? VLOADN(v, tail) : VLOAD(v);
        }
#pragma GCC unroll 6
        for (int i = 0; i < PV_MR; i++)
            if (i < mr) {
                vf a = VSET1(P[(size_t)i * ldp + j]);
                acc[i][0] = VFMA(a, b0, acc[i][0]);
                if (nv > 1) acc[i][1] = VFMA(a, b1, acc[i][1]);
            }
    }
#pragma GCC unroll 6
    for (int i = 0; i < PV_MR; i++)
        if (i < mr) {
            float *o = O + (size_t)i * ldo + c;
            if (nv > 1) {
                VSTORE(o, acc[i][0]);
                if (tail) VSTOREN(o + VL, acc[i][1], tail);
                else VSTORE(o + VL, acc[i][1]);
            } else {
                if (tail) VSTOREN(o, acc[i][0], tail);
                else VSTORE(o, acc[i][0]);
            }
        }
}

#define PV_DISPATCH(mr, nv, tail, ...)                        \
    switch (mr) {                                             \
    case 6: pv_block(6, nv, tail, __VA_ARGS__); break;        \
    case 5: pv_block(5, nv, tail, __VA_ARGS__); break;        \
    case 4: pv_block(4, nv, tail, __VA_ARGS__); break;        \
    case 3: pv_block(3, nv, tail, __VA_ARGS__); break;        \
    case 2: pv_block(2, nv, tail, __VA_ARGS__); break;        \
    default: pv_block(1, nv, tail, __VA_ARGS__); break;       \
    }

static void k_pv(float *O, int ldo, const float *P, int ldp, const float *const *vrows, const float *corr, int m,
                 int n, int hd)
{
    for (int i0 = 0; i0 < m; i0 += PV_MR) {
        int mr = m - i0 < PV_MR ? m - i0 : PV_MR;
        float *o = O + (size_t)i0 * ldo;
        const float *p = P + (size_t)i0 * ldp;
        const float *cr = corr + i0;
        int c = 0;
        for (; c + 2 * VL <= hd; c += 2 * VL) PV_DISPATCH(mr, 2, 0, o, ldo, p, ldp, vrows, cr, n, c)
        int rest = hd - c;
        if (rest > VL) PV_DISPATCH(mr, 2, rest - VL, o, ldo, p, ldp, vrows, cr, n, c)
        else if (rest == VL) PV_DISPATCH(mr, 1, 0, o, ldo, p, ldp, vrows, cr, n, c)
        else if (rest > 0) PV_DISPATCH(mr, 1, rest, o, ldo, p, ldp, vrows, cr, n, c)
    }
}

const prism_cpu_kern_t KTABLE = {
    .name = KNAME,
    .isa = KISA,
    .act = k_act,
    .silu_mul = k_silu_mul,
    .add = k_add,
    .scale = k_scale,
    .rmsnorm = k_rmsnorm,
    .layernorm = k_layernorm,
    .rope = k_rope,
    .gemv = k_gemv,
    .gemv_bf16 = k_gemv_bf16,
    .bf16_to_f32 = k_bf16_to_f32,
    .round_bf16 = prism_cpu_round_bf16,
#ifdef KMATMUL_BF16DP
    .matmul_bf16dp = KMATMUL_BF16DP,
#endif
#ifdef KMATMUL_BF16P
    .matmul_bf16p = KMATMUL_BF16P,
#endif
#ifdef KMATMUL_F32P
    .matmul_f32p = KMATMUL_F32P,
#endif
    .pack_kt = k_pack_kt,
    .qk = k_qk,
    .qk_rows = k_qk_rows,
    .softmax = k_softmax,
    .pv = k_pv,
};
