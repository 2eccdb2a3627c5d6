/* Test-only: the vector kernels instantiated 16 lanes wide from pairs of AVX2 registers, so the
 * lane logic the AVX-512 table runs (16-lane tails and masks, 32-column blocks) is exercised on
 * CPUs without AVX-512. The AVX-512 intrinsics themselves only run where cpuid reports them.
 * Compiled with -mavx2 -mfma; test_backend_cpu runs it only when the CPU has AVX2. */
#include "backend/cpu/cpu_kern.h"

#include <immintrin.h>

typedef struct {
    __m256 lo, hi;
} vf;
typedef vf vmask;
#define VL 16

static inline vf mk(__m256 lo, __m256 hi)
{
    vf r = {lo, hi};
    return r;
}

static inline __m256i below8(int n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline vf e_loadn(const float *p, int n)
{
    return mk(_mm256_maskload_ps(p, below8(n)), _mm256_maskload_ps(p + 8, below8(n - 8)));
}

static inline void e_storen(float *p, vf v, int n)
{
    _mm256_maskstore_ps(p, below8(n), v.lo);
    _mm256_maskstore_ps(p + 8, below8(n - 8), v.hi);
}

#define E2(f, a, b)        mk(f((a).lo, (b).lo), f((a).hi, (b).hi))
#define VLOAD(p)           mk(_mm256_loadu_ps(p), _mm256_loadu_ps((p) + 8))
#define VSTORE(p, v)       do { vf v_ = (v); _mm256_storeu_ps((p), v_.lo); _mm256_storeu_ps((p) + 8, v_.hi); } while (0)
#define VLOADN(p, n)       e_loadn((p), (n))
#define VSTOREN(p, v, n)   e_storen((p), (v), (n))
#define VSET1(x)           mk(_mm256_set1_ps(x), _mm256_set1_ps(x))
#define VZERO()            mk(_mm256_setzero_ps(), _mm256_setzero_ps())
#define VADD(a, b)         E2(_mm256_add_ps, a, b)
#define VSUB(a, b)         E2(_mm256_sub_ps, a, b)
#define VMUL(a, b)         E2(_mm256_mul_ps, a, b)
#define VDIV(a, b)         E2(_mm256_div_ps, a, b)
#define VMAX(a, b)         E2(_mm256_max_ps, a, b)
#define VMIN(a, b)         E2(_mm256_min_ps, a, b)

static inline vf e_fma(vf a, vf b, vf c) { return mk(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)); }
static inline vf e_fnma(vf a, vf b, vf c) { return mk(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)); }
static inline __m256 abs8(__m256 a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
static inline __m256 copysign8(__m256 m, __m256 s)
{
    return _mm256_or_ps(abs8(m), _mm256_and_ps(_mm256_set1_ps(-0.0f), s));
}
static inline __m256 floor8(__m256 a) { return _mm256_floor_ps(a); }
static inline __m256 round8(__m256 a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline __m256 lt8(__m256 a, __m256 b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
static inline __m256 ge8(__m256 a, __m256 b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
static inline __m256 pow2i8(__m256 n)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vf e_sel(vf m, vf t, vf f) { return mk(_mm256_blendv_ps(f.lo, t.lo, m.lo), _mm256_blendv_ps(f.hi, t.hi, m.hi)); }

static inline float e_hsum(vf v)
{
    __m256 s = _mm256_add_ps(v.lo, v.hi);
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

static inline float e_hmax(vf v)
{
    __m256 s = _mm256_max_ps(v.lo, v.hi);
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

static inline __m128 e_hsum4(vf a, vf b, vf c, vf d)
{
    __m256 ab = _mm256_hadd_ps(_mm256_add_ps(a.lo, a.hi), _mm256_add_ps(b.lo, b.hi));
    __m256 cd = _mm256_hadd_ps(_mm256_add_ps(c.lo, c.hi), _mm256_add_ps(d.lo, d.hi));
    __m256 s = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

#define VFMA(a, b, c)      e_fma((a), (b), (c))
#define VFNMA(a, b, c)     e_fnma((a), (b), (c))
#define VABS(a)            mk(abs8((a).lo), abs8((a).hi))
#define VCOPYSIGN(m, s)    E2(copysign8, m, s)
#define VFLOOR(a)          mk(floor8((a).lo), floor8((a).hi))
#define VROUND(a)          mk(round8((a).lo), round8((a).hi))
#define VLT(a, b)          E2(lt8, a, b)
#define VGE(a, b)          E2(ge8, a, b)
#define VSEL(m, t, f)      e_sel((m), (t), (f))
#define VPOW2I(n)          mk(pow2i8((n).lo), pow2i8((n).hi))
#define VIOTA              mk(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15))
#define VHSUM(v)           e_hsum(v)
#define VHMAX(v)           e_hmax(v)
#define VHSUM4(a, b, c, d) e_hsum4((a), (b), (c), (d))
#define BF8(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define VLOADBF16(p)       mk(BF8(p), BF8((const uint16_t *)(p) + 8))

static double sum_d(const float *x, int n)
{
    double s = 0;
    for (int i = 0; i < n; i++) s += x[i];
    return s;
}

static double sumsq_d(const float *x, int n)
{
    double s = 0;
    for (int i = 0; i < n; i++) s += (double)x[i] * x[i];
    return s;
}

static double sumsqdev_d(const float *x, int n, double mean)
{
    double s = 0;
    for (int i = 0; i < n; i++) s += (x[i] - mean) * (x[i] - mean);
    return s;
}
#define KSUM_D(x, n)             sum_d((x), (n))
#define KSUMSQ_D(x, n)           sumsq_d((x), (n))
#define KSUMSQDEV_D(x, n, mean)  sumsqdev_d((x), (n), (mean))

#define KTABLE prism_cpu_kern_emu16
#define KNAME  "emu16"
#define KISA   PRISM_CPU_ISA_AVX2
#include "backend/cpu/cpu_kern_simd.h"
