/* CPU kernel table: the inner loops of the CPU backend, one implementation per instruction set.
 *
 * cpu_backend.c and cpu_attn.c do shapes, threading and tiling; the functions here do the
 * arithmetic on one contiguous range, one row or one tile, single-threaded. Three tables:
 *   scalar  portable C with libm (expf, erff, tanhf) and double-precision norm sums: the reference;
 *   avx2    AVX2 + FMA (the x86-64 baseline this project targets);
 *   avx512  AVX-512F, chosen only when cpuid reports it (and the OS saves zmm state).
 * The vector tables share one source (cpu_kern_simd.h) instantiated per ISA; their exp/erf are
 * polynomial (within ~2 ulp of libm), so vector results equal the scalar ones within fp32
 * rounding, not bit for bit. PRISM_CPU_ISA=scalar|avx2|avx512 forces a path (a path the CPU
 * lacks falls back to the best one it has, with a warning) so tests can compare every path the
 * machine can run. */
#ifndef PRISM_BACKEND_CPU_KERN_H
#define PRISM_BACKEND_CPU_KERN_H

#include "backend/backend.h"

typedef enum {
    PRISM_CPU_ISA_SCALAR = 0,
    PRISM_CPU_ISA_AVX2   = 1,
    PRISM_CPU_ISA_AVX512 = 2,
} prism_cpu_isa_t;

/* Attention tiles are at most this many keys wide (the packed Kᵀ and score rows). */
#define PRISM_CPU_ATTN_NK 64

typedef struct prism_cpu_kern {
    const char *name;
    prism_cpu_isa_t isa;

    /* ---- elementwise over n contiguous floats (y may equal x) ---- */
    void (*act)(prism_act_t act, float *y, const float *x, size_t n);
    void (*silu_mul)(float *o, const float *g, const float *u, size_t n);
    void (*add)(float *y, const float *a, const float *b, size_t n);
    void (*scale)(float *y, const float *x, float s, size_t n);

    /* ---- one row of dim (y may equal x); sums in double as the reference does; w (and the
     * layernorm's b) may be NULL: no weight ---- */
    void (*rmsnorm)(float *y, const float *x, const float *w, int dim, float eps);
    void (*layernorm)(float *y, const float *x, const float *w, const float *b, int dim, float eps);
    /* Rotates the n_heads heads (head_dim apart) of one token; c/s [half] are cos/sin of its
     * angles, the first 2*half dims of each head rotate. */
    void (*rope)(float *x, int n_heads, int head_dim, int half, const float *c, const float *s,
                 prism_rope_mode_t mode);

    /* ---- small-M matmul (decode): y[m][n] (+)= Σ_k x[m][k]·w[n][k], m < M, n < N ---- */
    void (*gemv)(float *y, int ldy, const float *x, int ldx, const float *w, int ldw, int M, int N, int K,
                 bool accumulate);
    /* the same with bf16 weights, widened to fp32 in registers (fp32 products and sums) */
    void (*gemv_bf16)(float *y, int ldy, const float *x, int ldx, const uint16_t *w, int ldw, int M, int N, int K,
                      bool accumulate);
    /* y[i] = x[i] widened from bf16 (exact) */
    void (*bf16_to_f32)(float *y, const uint16_t *x, size_t n);

    /* ---- attention tiles (rows = (token, q head) pairs of one kv head) ----
     * pack_kt: Kt[d][j] = krows[j][d] for j < n, d < hd; columns n..ldk-1 zeroed (ldk >= n,
     *   a multiple of 16).
     * qk:      S[i][j] = Σ_d Q[i][d]·Kt[d][j] for i < m, j < ldk (Q pre-scaled, row stride ldq).
     * qk_rows: the same without packing, from key rows (few query rows: decode).
     * softmax: online softmax of rows of S over n columns (-INFINITY = masked): per row i
     *   m_new = max(mrun[i], max_j S), corr[i] = exp(mrun[i] - m_new) (0 when mrun was -inf),
     *   S[i][j] = exp(S[i][j] - m_new), lrun[i] = lrun[i]*corr[i] + Σ_j S[i][j], mrun[i] = m_new.
     *   A row whose scores are all masked and that saw nothing yet keeps corr 1 and P 0.
     * pv:      O[i][:hd] = O[i][:hd]*corr[i] + Σ_{j<n} P[i][j]·vrows[j][:hd]. */
    void (*pack_kt)(float *Kt, int ldk, const float *const *krows, int n, int hd);
    void (*qk)(float *S, int lds, const float *Q, int ldq, const float *Kt, int ldk, int m, int hd);
    void (*qk_rows)(float *S, int lds, const float *Q, int ldq, const float *const *krows, int m, int n, int hd);
    void (*softmax)(float *S, int lds, int m, int n, float *mrun, float *lrun, float *corr);
    void (*pv)(float *O, int ldo, const float *P, int ldp, const float *const *vrows, const float *corr, int m,
               int n, int hd);
} prism_cpu_kern_t;

extern const prism_cpu_kern_t prism_cpu_kern_scalar;
#if defined(__x86_64__) || defined(_M_X64)
#define PRISM_CPU_X86 1
extern const prism_cpu_kern_t prism_cpu_kern_avx2;
extern const prism_cpu_kern_t prism_cpu_kern_avx512;
#endif

/* The best ISA this CPU runs (cpuid + OS xsave state). */
prism_cpu_isa_t prism_cpu_isa_detect(void);
/* AVX-512 with the BW, DQ and VL subsets (Skylake-SP and later: what OpenBLAS's SkylakeX kernels
 * need), with the OS saving the registers. */
bool prism_cpu_has_avx512_skx(void);
/* The table to use: the detected ISA, or the one `force` names ("scalar", "avx2", "avx512";
 * NULL or "" = detect) when the CPU runs it; otherwise the best one below it. */
const prism_cpu_kern_t *prism_cpu_kern_select(const char *force);
const char *prism_cpu_isa_name(prism_cpu_isa_t isa);

#endif
