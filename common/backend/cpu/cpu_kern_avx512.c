/* AVX-512F instantiation of the vector kernels (this file alone is compiled with -mavx512f
 * -mavx2 -mfma; its table is used only when cpuid reports AVX-512F and the OS saves zmm state),
 * and matmul_f32p, shared with the avx512bf16 table.
 *
 * matmul_f32p: fp32 x times a bf16 weight packed at load (cpu_kern.h: panels of 16 columns, k pairs
 * interleaved, each 32-bit lane holding w[n][2j] in its low half and w[n][2j+1] in its high half).
 * A step loads one k pair of each panel of the tile and widens it in registers, exactly: the lanes
 * shifted left 16 are the even k, the lanes with the low half cleared are the odd k. Each row then
 * broadcasts x[r][2j] and x[r][2j+1] as they are (fp32, nothing rounded) into two FMAs per
 * accumulator of 16 contiguous outputs: exact fp32 products of x and the bf16 weight values, fp32
 * sums in k order per output (the same arithmetic as widening into scratch for sgemm, only the
 * summation order differs), no horizontal sums, no scratch. Tiles of BF16P-like shape: MR rows by
 * NR panels; blocks of 1-2 rows (decode) keep the even and odd k in separate sums so eight
 * independent chains hide the FMA latency. */
#include "backend/cpu/cpu_kern_avx512.h"

#define F32P_MR 6
#define F32P_NR 4
#define F32P_PF 16                /* steps ahead (one 64-byte line of each panel per step) */
#define F32P_BLOCK_BYTES (32 << 10) /* x rows per block: in L1 while every panel of W passes over them */

static inline __attribute__((always_inline)) void f32p_tile(int mr, int nr, float *y, int ldy, const float *x,
                                                             int ldx, const uint16_t *wp, size_t pstride, int K,
                                                             __mmask16 last, bool accumulate)
{
    const bool split = mr <= 2;   /* even and odd k in separate sums: enough chains for few rows */
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    __m512 acc[F32P_MR][F32P_NR], aco[2][F32P_NR];
    #pragma GCC unroll 6
    for (int r = 0; r < mr; r++)
        #pragma GCC unroll 4
        for (int c = 0; c < nr; c++) acc[r][c] = _mm512_setzero_ps();
    if (split)
        #pragma GCC unroll 2
        for (int r = 0; r < mr; r++)
            #pragma GCC unroll 4
            for (int c = 0; c < nr; c++) aco[r][c] = _mm512_setzero_ps();
    const int pairs = K / 2;
    for (int j = 0; j < pairs; j++) {
        #pragma GCC unroll 4
        for (int c = 0; c < nr; c++) {
            const uint16_t *wc = wp + c * pstride + (size_t)j * 32;
            __m512i v = _mm512_loadu_si512(wc);
            _mm_prefetch((const char *)(wc + F32P_PF * 32), _MM_HINT_T0);
            __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
            #pragma GCC unroll 6
            for (int r = 0; r < mr; r++) {
                const float *xr = x + (size_t)r * ldx + 2 * j;
                acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(xr[0]), we, acc[r][c]);
                if (split) aco[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(xr[1]), wo, aco[r][c]);
                else acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(xr[1]), wo, acc[r][c]);
            }
        }
    }
    if (K & 1)   /* the last k alone: its pair's high half is padding, x has no k + 1 */
        #pragma GCC unroll 4
        for (int c = 0; c < nr; c++) {
            __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(wp + c * pstride + (size_t)pairs * 32), 16));
            #pragma GCC unroll 6
            for (int r = 0; r < mr; r++)
                acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(x[(size_t)r * ldx + K - 1]), we, acc[r][c]);
        }
    #pragma GCC unroll 6
    for (int r = 0; r < mr; r++)
        #pragma GCC unroll 4
        for (int c = 0; c < nr; c++) {
            float *yr = y + (size_t)r * ldy + c * PRISM_CPU_BF16P_COLS;
            __mmask16 m = c == nr - 1 ? last : (__mmask16)0xffff;
            __m512 s = acc[r][c];
            if (split) s = _mm512_add_ps(s, aco[r][c]);
            if (accumulate) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(m, yr));
            _mm512_mask_storeu_ps(yr, m, s);
        }
}

#define F32P_TILE_N4(mr, nr, ...)                      \
    switch (nr) {                                      \
    case 4: f32p_tile(mr, 4, __VA_ARGS__); break;      \
    case 3: f32p_tile(mr, 3, __VA_ARGS__); break;      \
    case 2: f32p_tile(mr, 2, __VA_ARGS__); break;      \
    default: f32p_tile(mr, 1, __VA_ARGS__); break;     \
    }

void prism_cpu_avx512_matmul_f32p(float *y, int ldy, const float *x, int ldx, const uint16_t *wp, int M, int N,
                                  int K, bool accumulate)
{
    const size_t pstride = prism_cpu_bf16p_panel(K);
    const int np = (N + PRISM_CPU_BF16P_COLS - 1) / PRISM_CPU_BF16P_COLS;
    const __mmask16 lastm = N % PRISM_CPU_BF16P_COLS ? LANES(N % PRISM_CPU_BF16P_COLS) : (__mmask16)0xffff;
    int fit = (int)(F32P_BLOCK_BYTES / 4 / (size_t)K);
    int rb = fit < F32P_MR ? F32P_MR : fit / F32P_MR * F32P_MR;
    for (int m0 = 0; m0 < M; m0 += rb) {
        int mb = M - m0 < rb ? M - m0 : rb;
        const float *xb = x + (size_t)m0 * ldx;
        float *yb = y + (size_t)m0 * ldy;
        int mfull = mb / F32P_MR * F32P_MR, mrest = mb - mfull;
        for (int p0 = 0; p0 < np; p0 += F32P_NR) {
            int nr = np - p0 < F32P_NR ? np - p0 : F32P_NR;
            __mmask16 last = p0 + nr == np ? lastm : (__mmask16)0xffff;
            const uint16_t *wt = wp + (size_t)p0 * pstride;
            float *yt = yb + (size_t)p0 * PRISM_CPU_BF16P_COLS;
            for (int r = 0; r < mfull; r += F32P_MR)
                F32P_TILE_N4(F32P_MR, nr, yt + (size_t)r * ldy, ldy, xb + (size_t)r * ldx, ldx, wt, pstride, K, last,
                             accumulate)
            float *yr = yt + (size_t)mfull * ldy;
            const float *xr = xb + (size_t)mfull * ldx;
            switch (mrest) {
            case 5: F32P_TILE_N4(5, nr, yr, ldy, xr, ldx, wt, pstride, K, last, accumulate) break;
            case 4: F32P_TILE_N4(4, nr, yr, ldy, xr, ldx, wt, pstride, K, last, accumulate) break;
            case 3: F32P_TILE_N4(3, nr, yr, ldy, xr, ldx, wt, pstride, K, last, accumulate) break;
            case 2: F32P_TILE_N4(2, nr, yr, ldy, xr, ldx, wt, pstride, K, last, accumulate) break;
            case 1: F32P_TILE_N4(1, nr, yr, ldy, xr, ldx, wt, pstride, K, last, accumulate) break;
            default: break;
            }
        }
    }
}

#define KMATMUL_F32P prism_cpu_avx512_matmul_f32p
#define KTABLE prism_cpu_kern_avx512
#define KNAME  "avx512"
#define KISA   PRISM_CPU_ISA_AVX512
#include "backend/cpu/cpu_kern_simd.h"
