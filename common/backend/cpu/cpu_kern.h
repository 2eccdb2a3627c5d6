/* CPU kernel table: the inner loops of the CPU backend, one implementation per instruction set.
 *
 * cpu_backend.c and cpu_attn.c do shapes, threading and tiling; the functions here do the
 * arithmetic on one contiguous range, one row or one tile, single-threaded. Three tables:
 *   scalar  portable C with libm (expf, erff, tanhf) and double-precision norm sums: the reference;
 *   avx2    AVX2 + FMA (the x86-64 baseline this project targets);
 *   avx512  AVX-512F, chosen only when cpuid reports it (and the OS saves zmm state).
 * The vector tables share one source (cpu_kern_simd.h) instantiated per ISA; their exp/erf are
 * polynomial (within ~2 ulp of libm), so vector results equal the scalar ones within fp32
 * rounding, not bit for bit. A fourth table, avx512bf16 (AVX-512 with the BF16 extension: Zen 4,
 * Cooper Lake, Sapphire Rapids and later), is the avx512 one plus the bf16 matmuls (vdpbf16ps)
 * that --compute-dtype bf16 runs: on [N][K] weights, and on weights packed at load. Both AVX-512
 * tables run the default fp32 compute on packed bf16 weights too (matmul_f32p). PRISM_CPU_ISA=scalar|avx2|avx512|avx512bf16 forces
 * a path (a path the CPU lacks falls back to the best one it has, with a warning) so tests can
 * compare every path the machine can run. */
#ifndef PRISM_BACKEND_CPU_KERN_H
#define PRISM_BACKEND_CPU_KERN_H

#include "backend/backend.h"

typedef enum {
    PRISM_CPU_ISA_SCALAR = 0,
    PRISM_CPU_ISA_AVX2   = 1,
    PRISM_CPU_ISA_AVX512 = 2,
    PRISM_CPU_ISA_AVX512BF16 = 3,
} prism_cpu_isa_t;

/* x rows the bf16 dot-product matmul rounds at once into its scratch, and the K granule it pads
 * them to (with zeros): its scratch holds at least PRISM_CPU_BF16DP_ROWS rows of K rounded up. */
#define PRISM_CPU_BF16DP_ROWS 4
#define PRISM_CPU_BF16DP_KPAD 32

/* The packed ("VNNI") layout of a bf16 weight [N][K] for matmul_bf16p: panels of 16 columns (rows
 * of W), panel p at p * prism_cpu_bf16p_panel(K) elements; inside a panel the k pairs interleave,
 * [K/2][16][2]: pair j (k = 2j, 2j+1) of column c at (j * 16 + c) * 2, so one 64-byte load is one
 * k pair of 16 columns, the operand of a vdpbf16ps against a broadcast pair of x. K rounds up to
 * even and N to 16 with zeros: with K even and N a multiple of 16 it takes exactly the bytes of
 * [N][K], otherwise prism_cpu_bf16p_elems. */
#define PRISM_CPU_BF16P_COLS 16
static inline size_t prism_cpu_bf16p_panel(int K) { return (size_t)PRISM_CPU_BF16P_COLS * (size_t)((K + 1) & ~1); }
static inline size_t prism_cpu_bf16p_elems(int N, int K)
{
    return (size_t)((N + PRISM_CPU_BF16P_COLS - 1) / PRISM_CPU_BF16P_COLS) * prism_cpu_bf16p_panel(K);
}
/* Rearranges w, [N][K] at the front of prism_cpu_bf16p_elems(N, K) elements, into the packed
 * layout in place (panels from the last to the first: a panel never lands on the rows of an
 * earlier one); tmp holds 16 * K elements. */
void prism_cpu_bf16p_pack(uint16_t *w, int N, int K, uint16_t *tmp);

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
    /* y[i] = x[i] rounded to bf16 (nearest even) and kept as fp32 (y may equal x): the emulation
     * of --compute-dtype bf16 where the table has no matmul_bf16dp */
    void (*round_bf16)(float *y, const float *x, size_t n);
    /* --compute-dtype bf16: y[m][n] (+)= Σ_k bf16(x[m][k])·w[n][k], x rounded to bf16 (nearest
     * even), each product exact in fp32, sums in fp32 (vdpbf16ps: pairs of k at a time, so the
     * order differs from the scalar reference's; denormal inputs count as 0). xb is scratch of
     * xb_len bf16 values for the rounded rows of x: at least PRISM_CPU_BF16DP_ROWS rows of K
     * rounded up to PRISM_CPU_BF16DP_KPAD (the scalar reference needs none). NULL in the tables
     * without bf16 dot products (avx2, avx512): the backend then emulates it with round_bf16. */
    void (*matmul_bf16dp)(float *y, int ldy, const float *x, int ldx, const uint16_t *w, int ldw, int M, int N,
                          int K, bool accumulate, uint16_t *xb, size_t xb_len);
    /* The same product on a weight in the packed layout (prism_cpu_bf16p_pack): wp is the panel of
     * column 0 of this call's N columns (a slice starts on a panel), the last panel's columns past
     * N are not stored. Same scratch contract; outer products, no horizontal sums (sums of each
     * output in k-pair order, so within fp32 rounding of matmul_bf16dp, not bit for bit). NULL
     * where matmul_bf16dp is NULL, and in the scalar table (the backend then keeps [N][K]). */
    void (*matmul_bf16p)(float *y, int ldy, const float *x, int ldx, const uint16_t *wp, int M, int N, int K,
                         bool accumulate, uint16_t *xb, size_t xb_len);
    /* The default --compute-dtype fp32 on a bf16 weight in the same packed layout: y[m][n] (+)=
     * Σ_k x[m][k]·w[n][k] with x as it is (fp32, not rounded), each weight pair widened exactly in
     * registers, fp32 products and sums (as gemv_bf16 and the widened sgemm, only the summation
     * order differs). wp as for matmul_bf16p; no scratch. NULL outside the AVX-512 tables (the
     * backend then keeps [N][K]). */
    void (*matmul_f32p)(float *y, int ldy, const float *x, int ldx, const uint16_t *wp, int M, int N, int K,
                        bool accumulate);

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
extern const prism_cpu_kern_t prism_cpu_kern_avx512bf16;
#endif
/* The scalar round_bf16, shared by every table (the compiler vectorises it well enough: it runs
 * once per x element against N multiply-adds). */
void prism_cpu_round_bf16(float *y, const float *x, size_t n);

/* The best ISA this CPU runs (cpuid + OS xsave state). */
prism_cpu_isa_t prism_cpu_isa_detect(void);
/* AVX-512 with the BW, DQ and VL subsets (Skylake-SP and later: what OpenBLAS's SkylakeX kernels
 * need), with the OS saving the registers. */
bool prism_cpu_has_avx512_skx(void);
/* AVX-512 BF16 (cpuid leaf 7 subleaf 1, EAX bit 5) on top of prism_cpu_has_avx512_skx. */
bool prism_cpu_has_avx512_bf16(void);
/* The table to use: the detected ISA, or the one `force` names ("scalar", "avx2", "avx512",
 * "avx512bf16"; NULL or "" = detect) when the CPU runs it; otherwise the best one below it. */
const prism_cpu_kern_t *prism_cpu_kern_select(const char *force);
const char *prism_cpu_isa_name(prism_cpu_isa_t isa);

#endif
