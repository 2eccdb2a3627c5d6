/* The AVX-512F macro layer of the vector kernels (cpu_kern_simd.h): included by the ISA files that
 * instantiate them with AVX-512 (cpu_kern_avx512.c; cpu_kern_avx512bf16.c adds the bf16 dot-product
 * matmul), each compiled with at least -mavx512f -mavx2 -mfma. */
#ifndef PRISM_BACKEND_CPU_KERN_AVX512_H
#define PRISM_BACKEND_CPU_KERN_AVX512_H

#include "backend/cpu/cpu_kern.h"

#include <immintrin.h>

typedef __m512 vf;
typedef __mmask16 vmask;
#define VL 16

#define LANES(n)          ((__mmask16)((1u << (n)) - 1u))
#define VLOAD(p)          _mm512_loadu_ps(p)
#define VSTORE(p, v)      _mm512_storeu_ps((p), (v))
#define VLOADN(p, n)      _mm512_maskz_loadu_ps(LANES(n), (p))
#define VSTOREN(p, v, n)  _mm512_mask_storeu_ps((p), LANES(n), (v))
#define VSET1(x)          _mm512_set1_ps(x)
#define VZERO()           _mm512_setzero_ps()
#define VADD(a, b)        _mm512_add_ps((a), (b))
#define VSUB(a, b)        _mm512_sub_ps((a), (b))
#define VMUL(a, b)        _mm512_mul_ps((a), (b))
#define VDIV(a, b)        _mm512_div_ps((a), (b))
#define VMAX(a, b)        _mm512_max_ps((a), (b))
#define VMIN(a, b)        _mm512_min_ps((a), (b))
#define VFMA(a, b, c)     _mm512_fmadd_ps((a), (b), (c))
#define VFNMA(a, b, c)    _mm512_fnmadd_ps((a), (b), (c))
#define VABS(a)           _mm512_castsi512_ps(_mm512_and_epi32(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff)))
#define VCOPYSIGN(m, s)                                                                      \
    _mm512_castsi512_ps(_mm512_or_epi32(_mm512_castps_si512(VABS(m)),                        \
                                        _mm512_and_epi32(_mm512_castps_si512(s),             \
                                                         _mm512_set1_epi32((int)0x80000000u))))
#define VFLOOR(a)         _mm512_roundscale_ps((a), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define VROUND(a)         _mm512_roundscale_ps((a), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VLT(a, b)         _mm512_cmp_ps_mask((a), (b), _CMP_LT_OQ)
#define VGE(a, b)         _mm512_cmp_ps_mask((a), (b), _CMP_GE_OQ)
#define VSEL(m, t, f)     _mm512_mask_blend_ps((m), (f), (t))
#define VPOW2I(n) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
#define VIOTA             _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define VHSUM(v)          _mm512_reduce_add_ps(v)
#define VHMAX(v)          _mm512_reduce_max_ps(v)
#define VHSUM4(a, b, c, d) hsum4((a), (b), (c), (d))
#define VLOADBF16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))

/* [Σa, Σb, Σc, Σd]: four accumulators folded by a transpose-add */
static inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d)
{
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));   /* a0+a2 b0+b2 a1+a3 b1+b3 */
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
    __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));            /* a b c d per 128 bits */
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

static double sum_d(const float *x, int n)
{
    __m512d a = _mm512_setzero_pd();
    int i = 0;
    for (; i + 8 <= n; i += 8) a = _mm512_add_pd(a, _mm512_cvtps_pd(_mm256_loadu_ps(x + i)));
    double s = _mm512_reduce_add_pd(a);
    for (; i < n; i++) s += x[i];
    return s;
}

static double sumsq_d(const float *x, int n)
{
    __m512d a = _mm512_setzero_pd();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
        a = _mm512_fmadd_pd(v, v, a);
    }
    double s = _mm512_reduce_add_pd(a);
    for (; i < n; i++) s += (double)x[i] * x[i];
    return s;
}

static double sumsqdev_d(const float *x, int n, double mean)
{
    __m512d a = _mm512_setzero_pd(), m = _mm512_set1_pd(mean);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m512d v = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + i)), m);
        a = _mm512_fmadd_pd(v, v, a);
    }
    double s = _mm512_reduce_add_pd(a);
    for (; i < n; i++) {
        double d = x[i] - mean;
        s += d * d;
    }
    return s;
}
#define KSUM_D(x, n)             sum_d((x), (n))
#define KSUMSQ_D(x, n)           sumsq_d((x), (n))
#define KSUMSQDEV_D(x, n, mean)  sumsqdev_d((x), (n), (mean))

/* fp32 x times a bf16 weight in the packed layout (cpu_kern.h), the default --compute-dtype fp32
 * on AVX-512 (cpu_kern_avx512.c; both AVX-512 tables point at it). */
void prism_cpu_avx512_matmul_f32p(float *y, int ldy, const float *x, int ldx, const uint16_t *wp, int M, int N,
                                  int K, bool accumulate);

#endif
