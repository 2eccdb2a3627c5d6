/* AVX-512 BF16 instantiation: the avx512 table's kernels plus the bf16 matmuls of --compute-dtype
 * bf16 (this file alone is compiled with -mavx512bf16 and the F/BW/DQ/VL subsets; its table is used
 * only when cpuid reports them, cpu_kern.c). Both round a block of x rows to bf16 (nearest even)
 * into the caller's scratch, zero-padded to a multiple of 32, and sum exact products in fp32 with
 * vdpbf16ps (16 fp32 lanes, each a pair of k per instruction).
 *
 * matmul_bf16p, the one the model's weights take: the loader packs every weight only matmul reads
 * (cpu_backend.c weight_pack) into panels of 16 columns with k pairs interleaved (cpu_kern.h), so
 * a step is one 64-byte load per panel against a broadcast pair of x per row, an outer product
 * into accumulators of 16 contiguous outputs: tiles of 6 rows x 4 panels, no horizontal sums, the
 * stores plain (masked past N). 1-2 rows (decode) take one panel at a time with the k pairs dealt
 * over 8 sums. Measured on a 2-core Zen 5 (docs/PERFORMANCE.md, "packed bf16 weights"): 1.1x the
 * dot-product kernel at 512 rows (both near the core's vdpbf16ps peak), 1.4x at 1 row.
 *
 * matmul_bf16dp keeps weights in their [N][K] row-major layout: the embedding table a tied
 * lm_head shares with get_rows, tensor-parallel slices handed to matmul by hand, any weight not
 * packed. It walks register tiles of up to 4 x rows by 4 (or 8) weight rows: each step loads 32 k
 * of each, and each vdpbf16ps multiplies 32 bf16 pairs into 16 fp32 lanes of the tile's
 * accumulator for that (row, column). The K tail is a masked load of the weights (the padded x is
 * zero there). At the end a transpose-add folds each 4 accumulators of a row into 4 outputs (at
 * K = 256 about a tenth of its time: what the packed kernel saves). The row block stays in L1
 * while the weight rows of a tile are reused by every row tile of the block. */
#include "backend/cpu/cpu_kern_avx512.h"

#include <string.h>

#define BF16DP_BLOCK_BYTES (24 << 10)   /* rounded x rows per block: within L1 with the weight tile */

/* rows of x rounded to bf16 (nearest even) into xb, row stride kp (a multiple of 32), zero-padded */
static void round_rows(uint16_t *xb, int kp, const float *x, int ldx, int rows, int K)
{
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * ldx;
        uint16_t *o = xb + (size_t)r * kp;
        int k = 0;
        for (; k + 16 <= K; k += 16)
            _mm256_storeu_si256((__m256i *)(o + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xr + k)));
        if (k < K) {
            _mm256_storeu_si256((__m256i *)(o + k),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(LANES(K - k), xr + k)));
            k += 16;
        }
        for (; k < kp; k += 16) _mm256_storeu_si256((__m256i *)(o + k), _mm256_setzero_si256());
    }
}

/* y[r][c] (+)= Σ_k xb[r][k]·w[c][k] for r < mr, c < nr (compile-time constants at every call) */
static inline __attribute__((always_inline)) void dp_tile(int mr, int nr, float *y, int ldy, const uint16_t *xb,
                                                           int kp, const uint16_t *w, int ldw, int K, bool accumulate)
{
    __m512 acc[4][8];
    #pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
        #pragma GCC unroll 8
        for (int c = 0; c < nr; c++) acc[r][c] = _mm512_setzero_ps();
    __m512bh xv[4], wv[8];
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        #pragma GCC unroll 4
        for (int r = 0; r < mr; r++) xv[r] = (__m512bh)_mm512_loadu_si512(xb + (size_t)r * kp + k);
        #pragma GCC unroll 8
        for (int c = 0; c < nr; c++) wv[c] = (__m512bh)_mm512_loadu_si512(w + (size_t)c * ldw + k);
        #pragma GCC unroll 4
        for (int r = 0; r < mr; r++)
            #pragma GCC unroll 8
            for (int c = 0; c < nr; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv[r], wv[c]);
    }
    if (k < K) {
        __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        #pragma GCC unroll 4
        for (int r = 0; r < mr; r++) xv[r] = (__m512bh)_mm512_loadu_si512(xb + (size_t)r * kp + k);
        #pragma GCC unroll 8
        for (int c = 0; c < nr; c++) wv[c] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + (size_t)c * ldw + k);
        #pragma GCC unroll 4
        for (int r = 0; r < mr; r++)
            #pragma GCC unroll 8
            for (int c = 0; c < nr; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv[r], wv[c]);
    }
    __m512 z = _mm512_setzero_ps();
    #pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
        #pragma GCC unroll 8
        for (int c = 0; c < nr; c += 4) {
            int n = nr - c < 4 ? nr - c : 4;
            __m128 s = hsum4(acc[r][c], n > 1 ? acc[r][c + 1] : z, n > 2 ? acc[r][c + 2] : z, n > 3 ? acc[r][c + 3] : z);
            float *yr = y + (size_t)r * ldy + c;
            __mmask8 lm = (__mmask8)((1u << n) - 1);
            if (accumulate) s = _mm_add_ps(s, _mm_maskz_loadu_ps(lm, yr));
            _mm_mask_storeu_ps(yr, lm, s);
        }
}

#define DP_TILE_N(mr, nr, ...)                        \
    switch (nr) {                                     \
    case 8: dp_tile(mr, 8, __VA_ARGS__); break;       \
    case 7: dp_tile(mr, 7, __VA_ARGS__); break;       \
    case 6: dp_tile(mr, 6, __VA_ARGS__); break;       \
    case 5: dp_tile(mr, 5, __VA_ARGS__); break;       \
    case 4: dp_tile(mr, 4, __VA_ARGS__); break;       \
    case 3: dp_tile(mr, 3, __VA_ARGS__); break;       \
    case 2: dp_tile(mr, 2, __VA_ARGS__); break;       \
    default: dp_tile(mr, 1, __VA_ARGS__); break;      \
    }

static void k_matmul_bf16dp(float *y, int ldy, const float *x, int ldx, const uint16_t *w, int ldw, int M, int N,
                            int K, bool accumulate, uint16_t *xb, size_t xb_len)
{
    int kp = (K + PRISM_CPU_BF16DP_KPAD - 1) / PRISM_CPU_BF16DP_KPAD * PRISM_CPU_BF16DP_KPAD;
    size_t fit = BF16DP_BLOCK_BYTES / 2 / (size_t)kp;
    if (fit > xb_len / (size_t)kp) fit = xb_len / (size_t)kp;
    int rb = fit < PRISM_CPU_BF16DP_ROWS ? PRISM_CPU_BF16DP_ROWS : (int)fit / 4 * 4;
    for (int m0 = 0; m0 < M; m0 += rb) {
        int mb = M - m0 < rb ? M - m0 : rb;
        round_rows(xb, kp, x + (size_t)m0 * ldx, ldx, mb, K);
        float *yb = y + (size_t)m0 * ldy;
        /* 4-row tiles take 4 columns at a time, 1-2 row tiles 8 (16 accumulators at most of the 32
         * zmm registers) */
        int mfull = mb / 4 * 4, mrest = mb - mfull;
        for (int n0 = 0; n0 < N; n0 += 8) {
            int nb = N - n0 < 8 ? N - n0 : 8;
            const uint16_t *wn = w + (size_t)n0 * ldw;
            for (int r = 0; r < mfull; r += 4) {
                float *yt = yb + (size_t)r * ldy + n0;
                const uint16_t *xt = xb + (size_t)r * kp;
                DP_TILE_N(4, nb > 4 ? 4 : nb, yt, ldy, xt, kp, wn, ldw, K, accumulate)
                if (nb > 4) DP_TILE_N(4, nb - 4, yt + 4, ldy, xt, kp, wn + (size_t)4 * ldw, ldw, K, accumulate)
            }
            if (mrest) {
                float *yt = yb + (size_t)mfull * ldy + n0;
                const uint16_t *xt = xb + (size_t)mfull * kp;
                if (mrest == 3) {
                    DP_TILE_N(3, nb > 4 ? 4 : nb, yt, ldy, xt, kp, wn, ldw, K, accumulate)
                    if (nb > 4) DP_TILE_N(3, nb - 4, yt + 4, ldy, xt, kp, wn + (size_t)4 * ldw, ldw, K, accumulate)
                } else if (mrest == 2) {
                    DP_TILE_N(2, nb, yt, ldy, xt, kp, wn, ldw, K, accumulate)
                } else {
                    DP_TILE_N(1, nb, yt, ldy, xt, kp, wn, ldw, K, accumulate)
                }
            }
        }
    }
}

/* ---- packed weights (prism_cpu_bf16p_pack): outer products ----
 * A tile is mr rows of x by nr panels of 16 columns; each step loads one k pair of each panel (a
 * zmm of 16 pairs), broadcasts the pair x[r][2j..2j+1] of each row (vpbroadcastd from the rounded
 * rows) and runs mr x nr vdpbf16ps into accumulators that already hold 16 contiguous outputs: the
 * stores are plain (masked in the last panel), no horizontal sums. 6 x 4 tiles take 24 of the 32
 * zmm registers (4 more for the panels, 1 for the broadcast). The 4 panels of a tile are 4 streams
 * 16·K elements apart, which the hardware prefetcher follows poorly once they come from L3 (an
 * lm_head of 4096 x 256 at 16 rows ran at 0.8x of matmul_bf16dp): each step prefetches its lines
 * BF16P_PF steps ahead. Blocks of 1-2 rows (decode) run p_tile_ks instead. */
#define BF16P_MR 6
#define BF16P_NR 4
#define BF16P_PF 16       /* steps ahead (one 64-byte line of each panel per step) */

static inline __attribute__((always_inline)) void p_tile(int mr, int nr, float *y, int ldy, const uint16_t *xb,
                                                          int kp, const uint16_t *wp, size_t pstride, int pairs,
                                                          __mmask16 last, bool accumulate)
{
    __m512 acc[BF16P_MR][BF16P_NR];
    #pragma GCC unroll 6
    for (int r = 0; r < mr; r++)
        #pragma GCC unroll 8
        for (int c = 0; c < nr; c++) acc[r][c] = _mm512_setzero_ps();
    for (int j = 0; j < pairs; j++) {
        __m512bh wv[BF16P_NR];
        #pragma GCC unroll 8
        for (int c = 0; c < nr; c++) {
            wv[c] = (__m512bh)_mm512_loadu_si512(wp + c * pstride + (size_t)j * 32);
            _mm_prefetch((const char *)(wp + c * pstride + (size_t)(j + BF16P_PF) * 32), _MM_HINT_T0);
        }
        #pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            int32_t pair;
            memcpy(&pair, xb + (size_t)r * kp + 2 * j, sizeof pair);
            __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            #pragma GCC unroll 8
            for (int c = 0; c < nr; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], xv);
        }
    }
    #pragma GCC unroll 6
    for (int r = 0; r < mr; r++)
        #pragma GCC unroll 8
        for (int c = 0; c < nr; c++) {
            float *yr = y + (size_t)r * ldy + c * PRISM_CPU_BF16P_COLS;
            __mmask16 m = c == nr - 1 ? last : (__mmask16)0xffff;
            __m512 s = acc[r][c];
            if (accumulate) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(m, yr));
            _mm512_mask_storeu_ps(yr, m, s);
        }
}

/* 1-2 rows (decode) by one panel: the panel is one contiguous stream (what the hardware prefetcher
 * follows best once the weights outgrow L2), its k pairs dealt round-robin over BF16P_KS sums per
 * row so the instruction's latency hides, the sums added at the end (no horizontal sums) */
#define BF16P_KS 8
static inline __attribute__((always_inline)) void p_tile_ks(int mr, float *y, int ldy, const uint16_t *xb, int kp,
                                                             const uint16_t *wp, int pairs, __mmask16 m,
                                                             bool accumulate)
{
    __m512 acc[2][BF16P_KS];
    #pragma GCC unroll 2
    for (int r = 0; r < mr; r++)
        #pragma GCC unroll 8
        for (int u = 0; u < BF16P_KS; u++) acc[r][u] = _mm512_setzero_ps();
    int j = 0;
    for (; j + BF16P_KS <= pairs; j += BF16P_KS)
        #pragma GCC unroll 8
        for (int u = 0; u < BF16P_KS; u++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(wp + (size_t)(j + u) * 32);
            #pragma GCC unroll 2
            for (int r = 0; r < mr; r++) {
                int32_t pair;
                memcpy(&pair, xb + (size_t)r * kp + 2 * (j + u), sizeof pair);
                acc[r][u] = _mm512_dpbf16_ps(acc[r][u], wv, (__m512bh)_mm512_set1_epi32(pair));
            }
        }
    for (; j < pairs; j++) {
        __m512bh wv = (__m512bh)_mm512_loadu_si512(wp + (size_t)j * 32);
        #pragma GCC unroll 2
        for (int r = 0; r < mr; r++) {
            int32_t pair;
            memcpy(&pair, xb + (size_t)r * kp + 2 * j, sizeof pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], wv, (__m512bh)_mm512_set1_epi32(pair));
        }
    }
    #pragma GCC unroll 2
    for (int r = 0; r < mr; r++) {
        #pragma GCC unroll 8
        for (int u = BF16P_KS / 2; u > 0; u /= 2)
            #pragma GCC unroll 8
            for (int i = 0; i < u; i++) acc[r][i] = _mm512_add_ps(acc[r][i], acc[r][i + u]);
        float *yr = y + (size_t)r * ldy;
        __m512 s = acc[r][0];
        if (accumulate) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(m, yr));
        _mm512_mask_storeu_ps(yr, m, s);
    }
}

#define P_TILE_N4(mr, nr, ...)                       \
    switch (nr) {                                    \
    case 4: p_tile(mr, 4, __VA_ARGS__); break;       \
    case 3: p_tile(mr, 3, __VA_ARGS__); break;       \
    case 2: p_tile(mr, 2, __VA_ARGS__); break;       \
    default: p_tile(mr, 1, __VA_ARGS__); break;      \
    }

static void k_matmul_bf16p(float *y, int ldy, const float *x, int ldx, const uint16_t *wp, int M, int N, int K,
                           bool accumulate, uint16_t *xb, size_t xb_len)
{
    int kp = (K + PRISM_CPU_BF16DP_KPAD - 1) / PRISM_CPU_BF16DP_KPAD * PRISM_CPU_BF16DP_KPAD;
    const size_t pstride = prism_cpu_bf16p_panel(K);
    const int pairs = (K + 1) / 2, np = (N + PRISM_CPU_BF16P_COLS - 1) / PRISM_CPU_BF16P_COLS;
    const __mmask16 lastm = N % PRISM_CPU_BF16P_COLS ? LANES(N % PRISM_CPU_BF16P_COLS) : (__mmask16)0xffff;
    size_t fit = BF16DP_BLOCK_BYTES / 2 / (size_t)kp;
    if (fit > xb_len / (size_t)kp) fit = xb_len / (size_t)kp;
    int rb = fit < PRISM_CPU_BF16DP_ROWS ? PRISM_CPU_BF16DP_ROWS : fit < BF16P_MR ? (int)fit : (int)fit / BF16P_MR * BF16P_MR;
    for (int m0 = 0; m0 < M; m0 += rb) {
        int mb = M - m0 < rb ? M - m0 : rb;
        round_rows(xb, kp, x + (size_t)m0 * ldx, ldx, mb, K);
        float *yb = y + (size_t)m0 * ldy;
        if (mb <= 2) {
            for (int p = 0; p < np; p++) {
                __mmask16 m = p == np - 1 ? lastm : (__mmask16)0xffff;
                float *yt = yb + (size_t)p * PRISM_CPU_BF16P_COLS;
                if (mb == 2) p_tile_ks(2, yt, ldy, xb, kp, wp + (size_t)p * pstride, pairs, m, accumulate);
                else p_tile_ks(1, yt, ldy, xb, kp, wp + (size_t)p * pstride, pairs, m, accumulate);
            }
            continue;
        }
        /* the panels of a tile stay in L1/L2 while every row tile of the block runs over them */
        const int ntile = BF16P_NR;
        int mfull = mb / BF16P_MR * BF16P_MR, mrest = mb - mfull;
        /* a rest of 1-2 rows would run 4-8 sums a step: with the last 6-row tile it makes two
         * tiles of 4 and 3-4 rows instead (8 rows: 0.94x matmul_bf16dp as 6 + 2, 1.1x as 4 + 4) */
        const bool split = mrest && mrest <= 2 && mfull >= BF16P_MR;
        if (split) mfull -= BF16P_MR;
        for (int p0 = 0; p0 < np; p0 += ntile) {
            int nr = np - p0 < ntile ? np - p0 : ntile;
            __mmask16 last = p0 + nr == np ? lastm : (__mmask16)0xffff;
            const uint16_t *wt = wp + (size_t)p0 * pstride;
            float *yt = yb + (size_t)p0 * PRISM_CPU_BF16P_COLS;
            for (int r = 0; r < mfull; r += BF16P_MR)
                P_TILE_N4(BF16P_MR, nr, yt + (size_t)r * ldy, ldy, xb + (size_t)r * kp, kp, wt, pstride, pairs, last,
                          accumulate)
            float *yr = yt + (size_t)mfull * ldy;
            const uint16_t *xr = xb + (size_t)mfull * kp;
            if (split) {
                P_TILE_N4(4, nr, yr, ldy, xr, kp, wt, pstride, pairs, last, accumulate)
                yr += (size_t)4 * ldy;
                xr += (size_t)4 * kp;
                if (mrest == 2) P_TILE_N4(4, nr, yr, ldy, xr, kp, wt, pstride, pairs, last, accumulate)
                else P_TILE_N4(3, nr, yr, ldy, xr, kp, wt, pstride, pairs, last, accumulate)
                continue;
            }
            switch (mrest) {
            case 5: P_TILE_N4(5, nr, yr, ldy, xr, kp, wt, pstride, pairs, last, accumulate) break;
            case 4: P_TILE_N4(4, nr, yr, ldy, xr, kp, wt, pstride, pairs, last, accumulate) break;
            case 3: P_TILE_N4(3, nr, yr, ldy, xr, kp, wt, pstride, pairs, last, accumulate) break;
            case 2: P_TILE_N4(2, nr, yr, ldy, xr, kp, wt, pstride, pairs, last, accumulate) break;
            case 1: P_TILE_N4(1, nr, yr, ldy, xr, kp, wt, pstride, pairs, last, accumulate) break;
            default: break;
            }
        }
    }
}

#define KMATMUL_BF16DP k_matmul_bf16dp
#define KMATMUL_BF16P  k_matmul_bf16p
#define KMATMUL_F32P   prism_cpu_avx512_matmul_f32p
#define KTABLE prism_cpu_kern_avx512bf16
#define KNAME  "avx512bf16"
#define KISA   PRISM_CPU_ISA_AVX512BF16
#include "backend/cpu/cpu_kern_simd.h"
