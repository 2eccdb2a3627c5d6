/* AVX2 + FMA instantiation of the vector kernels (this file alone is compiled with -mavx2 -mfma;
 * its table is used only when cpuid reports both). */
#include "backend/cpu/cpu_kern.h"

#include <immintrin.h>

typedef __m256 vf;
typedef __m256 vmask;
#define VL 8

static inline __m256i lanes_below(int n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

#define VLOAD(p)          _mm256_loadu_ps(p)
#define VSTORE(p, v)      _mm256_storeu_ps((p), (v))
#define VLOADN(p, n)      _mm256_maskload_ps((p), lanes_below(n))
#define VSTOREN(p, v, n)  _mm256_maskstore_ps((p), lanes_below(n), (v))
#define VSET1(x)          _mm256_set1_ps(x)
#define VZERO()           _mm256_setzero_ps()
#define VADD(a, b)        _mm256_add_ps((a), (b))
#define VSUB(a, b)        _mm256_sub_ps((a), (b))
#define VMUL(a, b)        _mm256_mul_ps((a), (b))
#define VDIV(a, b)        _mm256_div_ps((a), (b))
#define VMAX(a, b)        _mm256_max_ps((a), (b))
#define VMIN(a, b)        _mm256_min_ps((a), (b))
#define VFMA(a, b, c)     _mm256_fmadd_ps((a), (b), (c))
#define VFNMA(a, b, c)    _mm256_fnmadd_ps((a), (b), (c))
#define VABS(a)           _mm256_andnot_ps(_mm256_set1_ps(-0.0f), (a))
#define VCOPYSIGN(m, s)   _mm256_or_ps(VABS(m), _mm256_and_ps(_mm256_set1_ps(-0.0f), (s)))
#define VFLOOR(a)         _mm256_floor_ps(a)
#define VROUND(a)         _mm256_round_ps((a), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VLT(a, b)         _mm256_cmp_ps((a), (b), _CMP_LT_OQ)
#define VGE(a, b)         _mm256_cmp_ps((a), (b), _CMP_GE_OQ)
#define VSEL(m, t, f)     _mm256_blendv_ps((f), (t), (m))
#define VPOW2I(n) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
#define VIOTA             _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7)

static inline float hsum8(__m256 v)
{
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

static inline float hmax8(__m256 v)
{
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
/* [Σa, Σb, Σc, Σd]: four accumulators folded by two horizontal adds and one cross-lane add */
static inline __m128 hsum4x8(__m256 a, __m256 b, __m256 c, __m256 d)
{
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));   /* a b c d per 128 bits */
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#define VHSUM(v) hsum8(v)
#define VHSUM4(a, b, c, d) hsum4x8((a), (b), (c), (d))
#define VHMAX(v) hmax8(v)
#define VLOADBF16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))

static inline double hsum4d(__m256d v)
{
    __m128d x = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(x, _mm_unpackhi_pd(x, x)));
}

/* Row sums in double, as the scalar reference accumulates them. */
static double sum_d(const float *x, int n)
{
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
        a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    }
    double s = hsum4d(_mm256_add_pd(a0, a1));
    for (; i < n; i++) s += x[i];
    return s;
}

static double sumsq_d(const float *x, int n)
{
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        a0 = _mm256_fmadd_pd(lo, lo, a0);
        a1 = _mm256_fmadd_pd(hi, hi, a1);
    }
    double s = hsum4d(_mm256_add_pd(a0, a1));
    for (; i < n; i++) s += (double)x[i] * x[i];
    return s;
}

static double sumsqdev_d(const float *x, int n, double mean)
{
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd(), m = _mm256_set1_pd(mean);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256d lo = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), m);
        __m256d hi = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)), m);
        a0 = _mm256_fmadd_pd(lo, lo, a0);
        a1 = _mm256_fmadd_pd(hi, hi, a1);
    }
    double s = hsum4d(_mm256_add_pd(a0, a1));
    for (; i < n; i++) {
        double d = x[i] - mean;
        s += d * d;
    }
    return s;
}
#define KSUM_D(x, n)             sum_d((x), (n))
#define KSUMSQ_D(x, n)           sumsq_d((x), (n))
#define KSUMSQDEV_D(x, n, mean)  sumsqdev_d((x), (n), (mean))

#define KTABLE prism_cpu_kern_avx2
#define KNAME  "avx2"
#define KISA   PRISM_CPU_ISA_AVX2
#include "backend/cpu/cpu_kern_simd.h"
