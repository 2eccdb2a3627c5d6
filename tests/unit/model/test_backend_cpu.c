/* CPU backend ops against naive double-precision references. These same checks are the template
 * for the backend-consistency test a CUDA backend must pass. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <unistd.h>

#include "backend/backend.h"
#include "backend/cpu/cpu_impl.h"
#include "backend/cpu/cpu_kern.h"

static uint64_t g_rng = 88172645463325252ull;
static float frand(void)
{
    g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17;
    return (float)((g_rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}
static void fill(float *x, size_t n) { for (size_t i = 0; i < n; i++) x[i] = frand(); }
static double maxdiff(const float *a, const float *b, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++) { double d = fabs((double)a[i] - b[i]); if (!(d <= m)) m = d; }
    return m;
}

/* Reference attention of one query over keys[0..n) (rows ld apart), double precision. */
static void ref_attend(const float *q, const float *const *k, const float *const *v, int n, int hd,
                       float scale, float *out)
{
    double *s = malloc(sizeof(double) * (size_t)n), mx = -INFINITY, sum = 0;
    for (int j = 0; j < n; j++) {
        double d = 0;
        for (int i = 0; i < hd; i++) d += (double)q[i] * k[j][i];
        s[j] = d * scale;
        if (s[j] > mx) mx = s[j];
    }
    for (int j = 0; j < n; j++) { s[j] = exp(s[j] - mx); sum += s[j]; }
    for (int i = 0; i < hd; i++) {
        double a = 0;
        for (int j = 0; j < n; j++) a += s[j] * v[j][i];
        out[i] = (float)(a / sum);
    }
    free(s);
}

static void test_attn_paged(void **state)
{
    (void)state;
    enum { NH = 4, NKV = 2, HD = 8, BSZ = 4, NB = 32, S = 3 };
    int pos0[S] = {0, 9, 3}, qlen[S] = {6, 1, 10};  /* prefill, decode, chunk mid-block */
    int32_t seq_start[S + 1] = {0};
    for (int s = 0; s < S; s++) seq_start[s + 1] = seq_start[s] + qlen[s];
    int T = seq_start[S], mbps = 4;
    int32_t tables[S * 4] = {7, 2, 30, 0, 11, 4, 19, 0, 5, 25, 1, 3};
    float *kc = calloc(NB * BSZ * NKV * HD, 4), *vc = calloc(NB * BSZ * NKV * HD, 4);
    fill(kc, NB * BSZ * NKV * HD);
    fill(vc, NB * BSZ * NKV * HD);
    float q[64 * NH * HD], out[64 * NH * HD], out1[64 * NH * HD], ref[NH * HD];
    fill(q, (size_t)T * NH * HD);
    prism_attn_meta_t meta = {.n_seqs = S, .n_tokens = T, .max_q_len = 10, .max_ctx_len = 13, .block_size = BSZ,
                              .max_blocks_per_seq = mbps, .seq_start = seq_start, .pos0 = pos0, .block_tables = tables};
    prism_backend_t *be = prism_backend_cpu_create(3), *be1 = prism_backend_cpu_create(1);
    uint64_t allocs = prism_mem_alloc_count();
    assert_int_equal(be->i.attn_paged(be->ctx, out, NH * HD, q, NH * HD, kc, vc, &meta, NH, NKV, HD, 0.35f), PRISM_OK);
    assert_int_equal(prism_mem_alloc_count(), allocs);
    assert_int_equal(be1->i.attn_paged(be1->ctx, out1, NH * HD, q, NH * HD, kc, vc, &meta, NH, NKV, HD, 0.35f), PRISM_OK);
    assert_memory_equal(out, out1, (size_t)T * NH * HD * 4);  /* threading does not change results */
    for (int s = 0; s < S; s++)
        for (int i = 0; i < qlen[s]; i++) {
            int t = seq_start[s] + i, n = pos0[s] + i + 1;
            for (int h = 0; h < NH; h++) {
                int g = h / (NH / NKV);
                const float *ks[64], *vs[64];
                for (int j = 0; j < n; j++) {
                    size_t row = (size_t)tables[s * mbps + j / BSZ] * BSZ + j % BSZ;
                    ks[j] = kc + (row * NKV + g) * HD;
                    vs[j] = vc + (row * NKV + g) * HD;
                }
                ref_attend(q + (size_t)t * NH * HD + h * HD, ks, vs, n, HD, 0.35f, ref);
                assert_true(maxdiff(out + (size_t)t * NH * HD + h * HD, ref, HD) < 1e-5);
            }
        }
    prism_backend_destroy(be);
    prism_backend_destroy(be1);
    free(kc);
    free(vc);
}

/* Chunked (local) attention, Llama-4 style: a query at position p sees keys k <= p with
 * k / chunk == p / chunk. One batch mixes prefill chunks that cross chunk boundaries (also
 * mid-KV-block), a decode step that opens a new chunk (sees only itself), one at a chunk's last
 * position and a long prefill from 0; attn_paged and attn_decode, 1 and 3 threads. */
static void test_attn_paged_chunked(void **state)
{
    (void)state;
    enum { NH = 6, NKV = 2, HD = 12, BSZ = 4, NB = 40, S = 5, MBPS = 8 };
    int pos0[S] = {5, 16, 23, 0, 9}, qlen[S] = {10, 1, 1, 21, 1};
    int32_t seq_start[S + 1] = {0};
    for (int s = 0; s < S; s++) seq_start[s + 1] = seq_start[s] + qlen[s];
    int T = seq_start[S];
    int32_t tables[S * MBPS];
    for (int i = 0; i < S * MBPS; i++) tables[i] = (int32_t)((i * 7 + 3) % NB);  /* interleaved blocks */
    size_t cache_n = (size_t)NB * BSZ * NKV * HD;
    float *kc = malloc(cache_n * 4), *vc = malloc(cache_n * 4);
    fill(kc, cache_n);
    fill(vc, cache_n);
    float q[40 * NH * HD], out[40 * NH * HD], out1[40 * NH * HD], ref[HD];
    fill(q, (size_t)T * NH * HD);
    prism_backend_t *be = prism_backend_cpu_create(3), *be1 = prism_backend_cpu_create(1);
    int chunks[] = {8, 6, 1, 1000};
    for (size_t ci = 0; ci < sizeof chunks / sizeof chunks[0]; ci++) {
        int chunk = chunks[ci];
        prism_attn_meta_t meta = {.n_seqs = S, .n_tokens = T, .max_q_len = 21, .max_ctx_len = 24, .block_size = BSZ,
                                  .max_blocks_per_seq = MBPS, .seq_start = seq_start, .pos0 = pos0,
                                  .block_tables = tables, .chunk = chunk};
        for (int dec = 0; dec < 2; dec++) {
            int (*fn)(void *, float *, int, const float *, int, const float *, const float *,
                      const prism_attn_meta_t *, int, int, int, float) =
                dec && be->i.attn_decode ? be->i.attn_decode : be->i.attn_paged;
            int (*fn1)(void *, float *, int, const float *, int, const float *, const float *,
                       const prism_attn_meta_t *, int, int, int, float) =
                dec && be1->i.attn_decode ? be1->i.attn_decode : be1->i.attn_paged;
            memset(out, 0, sizeof out);
            assert_int_equal(fn(be->ctx, out, NH * HD, q, NH * HD, kc, vc, &meta, NH, NKV, HD, 0.3f), PRISM_OK);
            assert_int_equal(fn1(be1->ctx, out1, NH * HD, q, NH * HD, kc, vc, &meta, NH, NKV, HD, 0.3f), PRISM_OK);
            assert_memory_equal(out, out1, (size_t)T * NH * HD * 4);
            for (int s = 0; s < S; s++)
                for (int i = 0; i < qlen[s]; i++) {
                    int t = seq_start[s] + i, p = pos0[s] + i, first = p / chunk * chunk;
                    for (int h = 0; h < NH; h++) {
                        int g = h / (NH / NKV);
                        const float *ks[64], *vs[64];
                        int n = 0;
                        for (int j = first; j <= p; j++, n++) {
                            size_t row = (size_t)tables[s * MBPS + j / BSZ] * BSZ + j % BSZ;
                            ks[n] = kc + (row * NKV + g) * HD;
                            vs[n] = vc + (row * NKV + g) * HD;
                        }
                        ref_attend(q + (size_t)t * NH * HD + h * HD, ks, vs, n, HD, 0.3f, ref);
                        assert_true(maxdiff(out + (size_t)t * NH * HD + h * HD, ref, HD) < 1e-5);
                    }
                }
        }
    }
    /* a negative chunk is refused */
    prism_attn_meta_t bad = {.n_seqs = S, .n_tokens = T, .max_q_len = 21, .max_ctx_len = 24, .block_size = BSZ,
                             .max_blocks_per_seq = MBPS, .seq_start = seq_start, .pos0 = pos0, .block_tables = tables,
                             .chunk = -1};
    assert_int_equal(be->i.attn_paged(be->ctx, out, NH * HD, q, NH * HD, kc, vc, &bad, NH, NKV, HD, 0.3f),
                     PRISM_EINVAL);
    prism_backend_destroy(be);
    prism_backend_destroy(be1);
    free(kc);
    free(vc);
}

/* ---- every kernel path against the scalar reference ----
 * The vector paths (AVX2, AVX-512) must equal the scalar one (libm, double norm sums) within fp32
 * rounding. Paths this CPU lacks are reported as not run; PRISM_CPU_ISA forces a path below the
 * detected one for the backend-level comparisons. */

static const char *k_isa_names[] = {"scalar", "avx2", "avx512", "avx512bf16"};
#ifdef PRISM_TEST_EMU16
extern const prism_cpu_kern_t prism_cpu_kern_emu16;   /* cpu_kern_emu16.c */
#endif

/* |a - b| <= rel·|b| + abs_, NaN where b is NaN, equal infinities. */
static void assert_close_f(const float *a, const float *b, size_t n, double rel, double abs_, const char *what)
{
    for (size_t i = 0; i < n; i++) {
        if (isnan(b[i])) {
            if (!isnan(a[i])) fail_msg("%s[%zu]: %g, want NaN", what, i, a[i]);
            continue;
        }
        if (isinf(b[i])) {
            if (a[i] != b[i]) fail_msg("%s[%zu]: %g, want %g", what, i, a[i], b[i]);
            continue;
        }
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= rel * fabs(b[i]) + abs_)) fail_msg("%s[%zu]: %.9g vs %.9g (diff %.3g)", what, i, a[i], b[i], d);
    }
}

static void test_kernel_tables_agree(void **state)
{
    (void)state;
    const prism_cpu_kern_t *ref = &prism_cpu_kern_scalar;
    prism_cpu_isa_t best = prism_cpu_isa_detect();
    /* forcing: a path the CPU lacks falls back to the best it has; unknown names too */
    assert_true(prism_cpu_kern_select("avx512")->isa <= best);
    assert_int_equal(prism_cpu_kern_select("scalar")->isa, PRISM_CPU_ISA_SCALAR);
    assert_int_equal(prism_cpu_kern_select("bogus")->isa, best);
    assert_int_equal(prism_cpu_kern_select(NULL)->isa, best);

    enum { NX = 4501 };
    float *x = malloc(sizeof(float) * NX), *y = malloc(sizeof(float) * NX), *r = malloc(sizeof(float) * NX);
    float *u = malloc(sizeof(float) * 3 * NX), *tol = malloc(sizeof(float) * 3 * NX);   /* gemv: M*K, N*K < 3*NX */
    static const float special[] = {0.0f, -0.0f, 1e-30f, -1e-30f, 1e-38f, 3e-39f, 88.0f, -88.0f, 88.7f, -88.7f,
                                    89.0f, -89.0f, 100.0f, -100.0f, 1e10f, -1e10f, INFINITY, -INFINITY, NAN,
                                    0.875f, -0.875f, 3.93f, -3.93f, 5.56f, -5.56f};
    size_t ns = sizeof special / sizeof special[0];
    for (size_t i = 0; i < NX; i++) x[i] = i < ns ? special[i] : -30.0f + 60.0f * (float)(i - ns) / (NX - ns);
    /* the tables the CPU runs, and the 16-lane emulation of the AVX-512 one where AVX2 runs */
    for (int path = 0; path < 4; path++) {
        int isa = path == 2 ? PRISM_CPU_ISA_AVX2 : path == 3 ? PRISM_CPU_ISA_AVX512BF16 : PRISM_CPU_ISA_AVX2 + path;
        const char *name = path == 2 ? "emu16 (AVX-512 lane logic on AVX2)" : k_isa_names[isa];
        if ((prism_cpu_isa_t)isa > best) {
            print_message("kernel path %s: not run (this CPU lacks it)\n", name);
            continue;
        }
        const prism_cpu_kern_t *k = prism_cpu_kern_select(k_isa_names[isa]);
        assert_int_equal(k->isa, isa);
        if (path == 2) {
#ifdef PRISM_TEST_EMU16
            k = &prism_cpu_kern_emu16;
#else
            continue;
#endif
        }
        char what[128];
        /* activations over [-30, 30] and the special values, odd length (vector tails) */
        for (int act = PRISM_ACT_NONE; act <= PRISM_ACT_RELU; act++) {
            k->act((prism_act_t)act, y, x, NX);
            ref->act((prism_act_t)act, r, x, NX);
            snprintf(what, sizeof what, "%s act %d", k->name, act);
            for (size_t i = 0; i < NX; i++) {
                /* the erf/tanh forms cancel in 1 + f(x) for x < 0: error scales with |x| there */
                float e = fabsf(x[i]) < 1e30f ? fabsf(x[i]) : 0.0f;
                float one[1] = {y[i]}, want[1] = {r[i]};
                if (act == PRISM_ACT_RELU || act == PRISM_ACT_NONE) assert_close_f(one, want, 1, 0, 0, what);
                else assert_close_f(one, want, 1, 5e-7, 2e-7 * e + 1e-37, what);
            }
            /* in place */
            memcpy(u, x, sizeof(float) * NX);
            k->act((prism_act_t)act, u, u, NX);
            assert_memory_equal(u, y, sizeof(float) * NX);
        }
        /* silu_mul */
        fill(u, NX);
        k->silu_mul(y, x + ns, u, NX - ns);
        ref->silu_mul(r, x + ns, u, NX - ns);
        snprintf(what, sizeof what, "%s silu_mul", k->name);
        assert_close_f(y, r, NX - ns, 5e-7, 1e-37, what);
        /* add, scale */
        k->add(y, x + ns, u, NX - ns);
        ref->add(r, x + ns, u, NX - ns);
        assert_memory_equal(y, r, sizeof(float) * (NX - ns));
        k->scale(y, x + ns, 0.37f, NX - ns);
        ref->scale(r, x + ns, 0.37f, NX - ns);
        assert_memory_equal(y, r, sizeof(float) * (NX - ns));
        /* norms, rows of awkward lengths */
        static const int dims[] = {1, 7, 8, 64, 1000, 4099};
        for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
            int d = dims[di];
            float *w = tol, *b = tol + 2048;
            fill(u, (size_t)d);
            fill(w, 2048);
            if (d > 2048) continue;
            for (int i = 0; i < d; i++) u[i] = u[i] * 3.0f + 0.5f;
            k->rmsnorm(y, u, w, d, 1e-6f);
            ref->rmsnorm(r, u, w, d, 1e-6f);
            snprintf(what, sizeof what, "%s rmsnorm dim %d", k->name, d);
            assert_close_f(y, r, (size_t)d, 1e-6, 1e-7, what);
            k->rmsnorm(y, u, NULL, d, 1e-6f);   /* no weight: Llama-4's QK norm */
            ref->rmsnorm(r, u, NULL, d, 1e-6f);
            assert_close_f(y, r, (size_t)d, 1e-6, 1e-7, what);
            k->layernorm(y, u, w, b, d, 1e-5f);
            ref->layernorm(r, u, w, b, d, 1e-5f);
            snprintf(what, sizeof what, "%s layernorm dim %d", k->name, d);
            assert_close_f(y, r, (size_t)d, 1e-6, 1e-6, what);
            k->layernorm(y, u, NULL, NULL, d, 1e-5f);
            ref->layernorm(r, u, NULL, NULL, d, 1e-5f);
            assert_close_f(y, r, (size_t)d, 1e-6, 1e-6, what);
        }
        /* rope: both pairings, partial rotation, head_dim not a multiple of the vector width */
        static const int rope_shapes[][3] = {{3, 8, 8}, {2, 64, 64}, {2, 30, 30}, {1, 128, 64}, {2, 36, 20}};
        for (size_t si = 0; si < 5; si++)
            for (int mode = 0; mode < 2; mode++) {
                int nh = rope_shapes[si][0], hd = rope_shapes[si][1], half = rope_shapes[si][2] / 2;
                float c[64], sn[64];
                for (int i = 0; i < half; i++) {
                    c[i] = cosf(0.3f * (float)i + 1.0f);
                    sn[i] = sinf(0.3f * (float)i + 1.0f);
                }
                fill(u, (size_t)nh * hd);
                memcpy(y, u, sizeof(float) * (size_t)nh * hd);
                memcpy(r, u, sizeof(float) * (size_t)nh * hd);
                k->rope(y, nh, hd, half, c, sn, (prism_rope_mode_t)mode);
                ref->rope(r, nh, hd, half, c, sn, (prism_rope_mode_t)mode);
                snprintf(what, sizeof what, "%s rope hd %d mode %d", k->name, hd, mode);
                assert_close_f(y, r, (size_t)nh * hd, 1e-6, 1e-6, what);
            }
        /* gemv: every small M, N around the 4-row blocks, K around the vector width */
        static const int ks[] = {1, 7, 8, 9, 100, 1031};
        for (int M = 1; M <= 5; M++)
            for (int N = 1; N <= 9; N++)
                for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++) {
                    int K = ks[ki];
                    float *xm = u, *wm = tol;
                    fill(xm, (size_t)M * K);
                    fill(wm, (size_t)N * K);
                    for (int acc = 0; acc < 2; acc++) {
                        for (int i = 0; i < M * 11; i++) y[i] = r[i] = (float)i;
                        k->gemv(y, 11, xm, K, wm, K, M, N, K, acc);
                        ref->gemv(r, 11, xm, K, wm, K, M, N, K, acc);
                        snprintf(what, sizeof what, "%s gemv M%d N%d K%d", k->name, M, N, K);
                        assert_close_f(y, r, (size_t)M * 11, 1e-6, 2e-6 * sqrt((double)K), what);
                    }
                }
        /* bf16 weights: widening is exact, and the gemv on them is the fp32 gemv on the widened
         * weights, bit for bit (same products, same order); the scalar reference within rounding */
        {
            enum { BM = 3, BN = 9, BK = 1031 };
            uint16_t *wb = malloc(sizeof(uint16_t) * BN * BK);
            float *ww = malloc(sizeof(float) * BN * BK), *xm = u, yb[BM * 11], yf[BM * 11], yr[BM * 11];
            fill(xm, (size_t)BM * BK);
            for (int i = 0; i < BN * BK; i++) wb[i] = prism_f32_to_bf16(frand());
            for (int i = 0; i < BN * BK; i++) ww[i] = prism_bf16_to_f32(wb[i]);
            float *wide = malloc(sizeof(float) * BN * BK);
            k->bf16_to_f32(wide, wb, BN * BK - 5);   /* a vector tail */
            assert_memory_equal(wide, ww, sizeof(float) * (BN * BK - 5));
            free(wide);
            for (int M = 1; M <= BM; M++)
                for (int N = 1; N <= BN; N += 4)
                    for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++) {
                        int K = ks[ki];
                        for (int i = 0; i < BM * 11; i++) yb[i] = yf[i] = yr[i] = (float)i;
                        k->gemv_bf16(yb, 11, xm, K, wb, K, M, N, K, true);
                        k->gemv(yf, 11, xm, K, ww, K, M, N, K, true);
                        ref->gemv_bf16(yr, 11, xm, K, wb, K, M, N, K, true);
                        assert_memory_equal(yb, yf, sizeof yb);
                        snprintf(what, sizeof what, "%s gemv_bf16 M%d N%d K%d", k->name, M, N, K);
                        assert_close_f(yb, yr, (size_t)M * 11, 1e-6, 2e-6 * sqrt((double)K), what);
                    }
            free(wb);
            free(ww);
        }
        /* attention tiles: packing is a copy, the rest equal within rounding. qk_rows takes keys 4 at a
         * time in tiles of up to 4 (avx2: 2) query rows: n 6 and 17 leave key tails, m 2, 3, 5, 13
         * row tails, hd 12, 36 and 80 dimension tails; hd 32 is the bundled model's */
        static const int hds[] = {12, 32, 36, 64, 80, 128}, ms[] = {1, 2, 3, 5, 13, 64}, ns[] = {1, 6, 17, 64};
        enum { KLD = 131 };   /* key/value rows KLD floats apart */
        float *kv = malloc(sizeof(float) * 2 * 64 * KLD), *Q = malloc(sizeof(float) * 64 * 128);
        float *Kt[2], *S[2], *O[2], ml[2][3][64];
        for (int v = 0; v < 2; v++) {
            Kt[v] = malloc(sizeof(float) * 128 * 64);
            S[v] = malloc(sizeof(float) * 64 * 64);
            O[v] = malloc(sizeof(float) * 64 * 128);
        }
        fill(kv, 2 * 64 * KLD);
        const float *krows[64], *vrows[64];
        for (int j = 0; j < 64; j++) {
            krows[j] = kv + (size_t)j * KLD;
            vrows[j] = kv + (size_t)(64 + j) * KLD;
        }
        for (size_t hi = 0; hi < sizeof hds / sizeof hds[0]; hi++)
            for (size_t mi = 0; mi < sizeof ms / sizeof ms[0]; mi++)
                for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
                    int hd = hds[hi], m = ms[mi], n = ns[ni], ldk = (n + 15) & ~15;
                    const prism_cpu_kern_t *kk[2] = {ref, k};
                    fill(Q, (size_t)m * hd);
                    for (int v = 0; v < 2; v++) {
                        for (int i = 0; i < 128 * 64; i++) Kt[v][i] = 7.0f;
                        kk[v]->pack_kt(Kt[v], ldk, krows, n, hd);
                    }
                    assert_memory_equal(Kt[0], Kt[1], sizeof(float) * (size_t)hd * ldk);
                    for (int v = 0; v < 2; v++) kk[v]->qk(S[v], 64, Q, hd, Kt[v], ldk, m, hd);
                    snprintf(what, sizeof what, "%s qk hd %d m %d n %d", name, hd, m, n);
                    for (int i = 0; i < m; i++)
                        assert_close_f(S[1] + i * 64, S[0] + i * 64, (size_t)ldk, 1e-5, 1e-5 * hd, what);
                    for (int v = 0; v < 2; v++) {   /* poisoned: a score left unwritten shows */
                        for (int i = 0; i < 64 * 64; i++) S[v][i] = NAN;
                        kk[v]->qk_rows(S[v], 64, Q, hd, krows, m, n, hd);
                    }
                    snprintf(what, sizeof what, "%s qk_rows hd %d m %d n %d", name, hd, m, n);
                    for (int i = 0; i < m; i++)
                        assert_close_f(S[1] + i * 64, S[0] + i * 64, (size_t)n, 1e-5, 1e-5 * hd, what);
                    /* softmax from mixed states: fresh rows, rows with history, masked keys, a
                     * fully masked row */
                    for (int i = 0; i < m; i++) {
                        for (int j = 0; j < n; j++) {
                            float sv = S[0][i * 64 + j] * 3.0f;
                            if ((i + j) % 5 == 1) sv = -INFINITY;
                            if (i == 2) sv = -INFINITY;
                            S[0][i * 64 + j] = S[1][i * 64 + j] = sv;
                        }
                        for (int v = 0; v < 2; v++) {
                            ml[v][0][i] = i % 3 == 0 ? -INFINITY : 0.25f * (float)(i % 7);
                            ml[v][1][i] = i % 3 == 0 ? 0.0f : 1.5f;
                        }
                    }
                    for (int v = 0; v < 2; v++) kk[v]->softmax(S[v], 64, m, n, ml[v][0], ml[v][1], ml[v][2]);
                    snprintf(what, sizeof what, "%s softmax m %d n %d", name, m, n);
                    for (int i = 0; i < m; i++)
                        assert_close_f(S[1] + i * 64, S[0] + i * 64, (size_t)n, 1e-6, 1e-30, what);
                    assert_memory_equal(ml[1][0], ml[0][0], sizeof(float) * (size_t)m);
                    assert_close_f(ml[1][1], ml[0][1], (size_t)m, 1e-6, 0, what);
                    assert_close_f(ml[1][2], ml[0][2], (size_t)m, 1e-6, 0, what);
                    /* P·V into running outputs rescaled by corr */
                    fill(O[0], (size_t)m * hd);
                    memcpy(O[1], O[0], sizeof(float) * (size_t)m * hd);
                    for (int v = 0; v < 2; v++) kk[v]->pv(O[v], hd, S[0], 64, vrows, ml[0][2], m, n, hd);
                    snprintf(what, sizeof what, "%s pv hd %d m %d n %d", name, hd, m, n);
                    assert_close_f(O[1], O[0], (size_t)m * hd, 1e-5, 1e-5 * n, what);
                }
        for (int v = 0; v < 2; v++) {
            free(Kt[v]);
            free(S[v]);
            free(O[v]);
        }
        free(kv);
        free(Q);
        print_message("kernel path %s: equal to scalar within fp32 rounding\n", name);
    }
    free(x); free(y); free(r); free(u); free(tol);
}

/* Runs the attention ops of a backend made under PRISM_CPU_ISA=isa; NULL when it is not this
 * CPU's. out_* receive the results. */
typedef struct {
    float *dense, *dense_c, *paged, *paged_ch;
} attn_outs_t;

enum { AT_NS = 2, AT_L = 150, AT_NH = 6, AT_NKV = 2, AT_HD = 36, AT_LD = (AT_NH + 2 * AT_NKV) * AT_HD };
enum { AT_S = 4, AT_BSZ = 16, AT_NB = 64, AT_MBPS = 12 };

static bool run_attn_ops(int isa, const float *qkv, const float *kc, const float *vc, const float *qp, int hd,
                         int nh, int nkv, attn_outs_t *o)
{
    if ((prism_cpu_isa_t)isa > prism_cpu_isa_detect()) return false;
    setenv("PRISM_CPU_ISA", k_isa_names[isa], 1);
    prism_backend_t *be = prism_backend_cpu_create(2);
    unsetenv("PRISM_CPU_ISA");
    assert_int_equal(((prism_cpu_ctx_t *)be->ctx)->k->isa, isa);
    int ld = (nh + 2 * nkv) * hd;
    float scale = 1.0f / sqrtf((float)hd);
    assert_int_equal(be->i.attn_dense(be->ctx, o->dense, nh * hd, qkv, ld, qkv + nh * hd, ld, qkv + (nh + nkv) * hd, ld,
                                      AT_NS, AT_L, nh, nkv, hd, scale, false), PRISM_OK);
    assert_int_equal(be->i.attn_dense(be->ctx, o->dense_c, nh * hd, qkv, ld, qkv + nh * hd, ld, qkv + (nh + nkv) * hd,
                                      ld, AT_NS, AT_L, nh, nkv, hd, scale, true), PRISM_OK);
    /* paged: a long prefill chunk, two decode steps, a chunk starting mid-block */
    int32_t seq_start[AT_S + 1] = {0, 100, 101, 102, 142}, pos0[AT_S] = {30, 150, 7, 64};
    int32_t tables[AT_S * AT_MBPS];
    for (int i = 0; i < AT_S * AT_MBPS; i++) tables[i] = (int32_t)((i * 5 + 1) % AT_NB);
    prism_attn_meta_t meta = {.n_seqs = AT_S, .n_tokens = 142, .max_q_len = 100, .max_ctx_len = 151,
                              .block_size = AT_BSZ, .max_blocks_per_seq = AT_MBPS, .seq_start = seq_start,
                              .pos0 = pos0, .block_tables = tables};
    assert_int_equal(be->i.attn_paged(be->ctx, o->paged, nh * hd, qp, nh * hd, kc, vc, &meta, nh, nkv, hd, scale),
                     PRISM_OK);
    meta.chunk = 48;
    assert_int_equal(be->i.attn_paged(be->ctx, o->paged_ch, nh * hd, qp, nh * hd, kc, vc, &meta, nh, nkv, hd, scale),
                     PRISM_OK);
    prism_backend_destroy(be);
    return true;
}

static void test_backend_paths_agree(void **state)
{
    (void)state;
    /* head dims around the vector widths (tails in every kernel), MHA and GQA */
    static const int shapes[][3] = {{36, 6, 2}, {64, 4, 4}, {80, 8, 1}, {12, 3, 3}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        int hd = shapes[si][0], nh = shapes[si][1], nkv = shapes[si][2], ld = (nh + 2 * nkv) * hd;
        size_t nq = (size_t)AT_NS * AT_L * ld, ncache = (size_t)AT_NB * AT_BSZ * nkv * hd, nout = (size_t)AT_NS * AT_L * nh * hd;
        float *qkv = malloc(nq * 4), *kc = malloc(ncache * 4), *vc = malloc(ncache * 4), *qp = malloc(142 * nh * hd * 4);
        fill(qkv, nq);
        for (size_t i = 0; i < nq; i++) qkv[i] *= 3.0f;   /* peaked softmax rows too */
        fill(kc, ncache);
        fill(vc, ncache);
        fill(qp, (size_t)142 * nh * hd);
        attn_outs_t outs[3];
        for (int isa = 0; isa < 3; isa++) {
            outs[isa].dense = malloc(nout * 4);
            outs[isa].dense_c = malloc(nout * 4);
            outs[isa].paged = malloc((size_t)142 * nh * hd * 4);
            outs[isa].paged_ch = malloc((size_t)142 * nh * hd * 4);
        }
        assert_true(run_attn_ops(0, qkv, kc, vc, qp, hd, nh, nkv, &outs[0]));
        for (int isa = 1; isa < 3; isa++) {
            if (!run_attn_ops(isa, qkv, kc, vc, qp, hd, nh, nkv, &outs[isa])) continue;
            char what[128];
            snprintf(what, sizeof what, "%s attn_dense hd %d", k_isa_names[isa], hd);
            assert_close_f(outs[isa].dense, outs[0].dense, nout, 1e-5, 1e-5, what);
            assert_close_f(outs[isa].dense_c, outs[0].dense_c, nout, 1e-5, 1e-5, what);
            snprintf(what, sizeof what, "%s attn_paged hd %d", k_isa_names[isa], hd);
            assert_close_f(outs[isa].paged, outs[0].paged, (size_t)142 * nh * hd, 1e-5, 1e-5, what);
            assert_close_f(outs[isa].paged_ch, outs[0].paged_ch, (size_t)142 * nh * hd, 1e-5, 1e-5, what);
        }
        /* the scalar path against a double-precision reference on a few rows */
        for (int t = 0; t < AT_L; t += 37) {
            int g = 1 % nkv, h = g * (nh / nkv);
            const float *ks[AT_L], *vs[AT_L];
            for (int j = 0; j < AT_L; j++) {
                ks[j] = qkv + (size_t)(AT_L + j) * ld + nh * hd + g * hd;
                vs[j] = qkv + (size_t)(AT_L + j) * ld + (nh + nkv) * hd + g * hd;
            }
            float want[128];
            ref_attend(qkv + (size_t)(AT_L + t) * ld + h * hd, ks, vs, AT_L, hd, 1.0f / sqrtf((float)hd), want);
            assert_true(maxdiff(outs[0].dense + (size_t)(AT_L + t) * nh * hd + h * hd, want, hd) < 2e-5);
        }
        for (int isa = 0; isa < 3; isa++) {
            free(outs[isa].dense); free(outs[isa].dense_c); free(outs[isa].paged); free(outs[isa].paged_ch);
        }
        free(qkv); free(kc); free(vc); free(qp);
    }
}

/* Every backend op threaded over the pool gives what one thread gives (matmul within rounding:
 * BLAS slices may block differently), and many back-to-back short tasks with pauses longer than
 * the workers' spin exercise both the spinning and the sleeping hand-off. */
static void test_threads_agree(void **state)
{
    (void)state;
    enum { R = 300, D = 1000, N = 700 };
    prism_backend_t *b1 = prism_backend_cpu_create(1), *b3 = prism_backend_cpu_create(3), *b8 = prism_backend_cpu_create(8);
    float *x = malloc(sizeof(float) * R * D), *w = malloc(sizeof(float) * N * D), *y1 = malloc(sizeof(float) * R * D);
    float *y3 = malloc(sizeof(float) * R * D), *nw = malloc(sizeof(float) * D), *bias = malloc(sizeof(float) * N);
    fill(x, (size_t)R * D);
    fill(w, (size_t)N * D);
    fill(nw, D);
    fill(bias, N);
    for (int M = 1; M <= R; M = M < 20 ? M + 3 : M * 3) {
        for (int i = 0; i < M * N; i++) y1[i] = y3[i] = (float)(i % 7);
        assert_int_equal(b1->i.matmul(b1->ctx, y1, N, x, D, w, PRISM_DTYPE_F32, bias, M, N, D, true), PRISM_OK);
        assert_int_equal(b3->i.matmul(b3->ctx, y3, N, x, D, w, PRISM_DTYPE_F32, bias, M, N, D, true), PRISM_OK);
        assert_close_f(y3, y1, (size_t)M * N, 1e-5, 1e-4, "matmul 3 threads");
        /* 8 threads on 700 columns: rows of x split too (2-D thread grid) */
        for (int i = 0; i < M * N; i++) y3[i] = (float)(i % 7);
        assert_int_equal(b8->i.matmul(b8->ctx, y3, N, x, D, w, PRISM_DTYPE_F32, bias, M, N, D, true), PRISM_OK);
        assert_close_f(y3, y1, (size_t)M * N, 1e-5, 1e-4, "matmul 8 threads");
        /* and against double precision, on both sides of the gemv/sgemm switch */
        for (int r = 0; r < M; r += 5)
            for (int n = 0; n < N; n += 13) {
                double a = (double)((r * N + n) % 7) + bias[n];
                for (int k = 0; k < D; k++) a += (double)x[(size_t)r * D + k] * w[(size_t)n * D + k];
                assert_true(fabs(y1[(size_t)r * N + n] - a) < 1e-4);
            }
    }
    prism_backend_t *bs[2] = {b1, b3};
    float *outs[2] = {y1, y3};
    for (int i = 0; i < 2; i++) {
        prism_backend_t *b = bs[i];
        float *o = outs[i];
        assert_int_equal(b->i.layernorm(b->ctx, o, x, nw, w, R, D, 1e-5f), PRISM_OK);   /* w: any D floats as bias */
        assert_int_equal(b->i.rmsnorm(b->ctx, o, o, nw, R, D, 1e-5f), PRISM_OK);
        assert_int_equal(b->i.act(b->ctx, PRISM_ACT_GELU_ERF, o, o, (size_t)R * D), PRISM_OK);
        assert_int_equal(b->i.add(b->ctx, o, o, x, (size_t)R * D, D), PRISM_OK);
        assert_int_equal(b->i.silu_mul(b->ctx, o + (size_t)R * D / 2, o, o + D / 2, D, R / 2, D / 2), PRISM_OK);
        assert_int_equal(b->i.scale(b->ctx, o, o, 0.5f, (size_t)R * D), PRISM_OK);
    }
    assert_memory_equal(y1, y3, sizeof(float) * R * D);
    /* broadcast add whose b does not divide n, split over threads mid-run */
    assert_int_equal(b3->i.add(b3->ctx, y3, x, w, (size_t)R * D, 1007), PRISM_OK);
    for (size_t i = 0; i < (size_t)R * D; i++) y1[i] = x[i] + w[i % 1007];
    assert_memory_equal(y1, y3, sizeof(float) * R * D);
    /* short tasks back to back, then with pauses beyond the spin window */
    for (int it = 0; it < 2000; it++) {
        assert_int_equal(b3->i.scale(b3->ctx, y3, x, 1.0f, (size_t)1 << 17), PRISM_OK);
        if (it % 200 == 0) usleep(2000);
    }
    assert_memory_equal(y3, x, sizeof(float) << 17);
    prism_backend_destroy(b1);
    prism_backend_destroy(b3);
    prism_backend_destroy(b8);
    free(x); free(w); free(y1); free(y3); free(nw); free(bias);
}

/* A sequence's attention output does not depend on the batch around it or on the thread count:
 * each sequence alone (1 thread) equals, bit for bit, its rows in a mixed batch (3 threads), for
 * plain causal and for a chunk size that is not a multiple of the key tile. */
static void test_attn_batch_invariant(void **state)
{
    (void)state;
    enum { NH = 8, NKV = 2, HD = 64, BSZ = 16, NB = 64, S = 5, MBPS = 12 };
    int pos0[S] = {100, 150, 0, 47, 60}, qlen[S] = {30, 1, 70, 1, 40};
    int32_t seq_start[S + 1] = {0}, tables[S * MBPS];
    for (int s = 0; s < S; s++) seq_start[s + 1] = seq_start[s] + qlen[s];
    for (int i = 0; i < S * MBPS; i++) tables[i] = (int32_t)((i * 11 + 5) % NB);
    int T = seq_start[S];
    size_t cache_n = (size_t)NB * BSZ * NKV * HD, qn = (size_t)T * NH * HD;
    float *kc = malloc(cache_n * 4), *vc = malloc(cache_n * 4), *q = malloc(qn * 4), *out = malloc(qn * 4);
    float *one_out = malloc(qn * 4);
    fill(kc, cache_n);
    fill(vc, cache_n);
    fill(q, qn);
    prism_backend_t *be3 = prism_backend_cpu_create(3), *be1 = prism_backend_cpu_create(1);
    for (int chunk = 0; chunk <= 48; chunk += 48) {
        prism_attn_meta_t all = {.n_seqs = S, .n_tokens = T, .max_q_len = 70, .max_ctx_len = 151, .block_size = BSZ,
                                 .max_blocks_per_seq = MBPS, .seq_start = seq_start, .pos0 = pos0,
                                 .block_tables = tables, .chunk = chunk};
        assert_int_equal(be3->i.attn_paged(be3->ctx, out, NH * HD, q, NH * HD, kc, vc, &all, NH, NKV, HD, 0.125f),
                         PRISM_OK);
        for (int s = 0; s < S; s++) {
            int32_t one_start[2] = {0, qlen[s]};
            prism_attn_meta_t one = {.n_seqs = 1, .n_tokens = qlen[s], .max_q_len = qlen[s],
                                     .max_ctx_len = pos0[s] + qlen[s], .block_size = BSZ, .max_blocks_per_seq = MBPS,
                                     .seq_start = one_start, .pos0 = pos0 + s, .block_tables = tables + s * MBPS,
                                     .chunk = chunk};
            const float *qs = q + (size_t)seq_start[s] * NH * HD;
            assert_int_equal(be1->i.attn_paged(be1->ctx, one_out, NH * HD, qs, NH * HD, kc, vc, &one, NH, NKV, HD,
                                               0.125f), PRISM_OK);
            assert_memory_equal(one_out, out + (size_t)seq_start[s] * NH * HD, (size_t)qlen[s] * NH * HD * 4);
        }
    }
    prism_backend_destroy(be3);
    prism_backend_destroy(be1);
    free(kc); free(vc); free(q); free(out); free(one_out);
}

static void test_attn_dense(void **state)
{
    (void)state;
    enum { NS = 2, L = 70, NH = 2, HD = 16 };  /* L > one key tile */
    int ld = 3 * NH * HD;
    float *qkv = malloc(sizeof(float) * NS * L * ld), *out = malloc(sizeof(float) * NS * L * NH * HD), ref[HD];
    fill(qkv, (size_t)NS * L * ld);
    prism_backend_t *be = prism_backend_cpu_create(2);
    for (int causal = 0; causal < 2; causal++) {
        assert_int_equal(be->i.attn_dense(be->ctx, out, NH * HD, qkv, ld, qkv + NH * HD, ld, qkv + 2 * NH * HD, ld,
                                          NS, L, NH, NH, HD, 0.25f, causal), PRISM_OK);
        for (int s = 0; s < NS; s++)
            for (int i = 0; i < L; i++)
                for (int h = 0; h < NH; h++) {
                    const float *ks[L], *vs[L];
                    int n = causal ? i + 1 : L;
                    for (int j = 0; j < n; j++) {
                        ks[j] = qkv + (size_t)(s * L + j) * ld + NH * HD + h * HD;
                        vs[j] = qkv + (size_t)(s * L + j) * ld + 2 * NH * HD + h * HD;
                    }
                    ref_attend(qkv + (size_t)(s * L + i) * ld + h * HD, ks, vs, n, HD, 0.25f, ref);
                    assert_true(maxdiff(out + (size_t)(s * L + i) * NH * HD + h * HD, ref, HD) < 1e-5);
                }
    }
    /* bounds are checked, not trusted */
    assert_int_equal(be->i.attn_dense(be->ctx, out, NH * HD, qkv, ld, qkv, ld, qkv, ld, 1, L, 3, 2, HD, 1, false), PRISM_EINVAL);
    assert_int_equal(be->i.attn_dense(be->ctx, out, NH * HD, qkv, ld, qkv, ld, qkv, ld, 1, L, 1, 1, 1024, 1, false), PRISM_EINVAL);
    prism_backend_destroy(be);
    free(qkv);
    free(out);
}

static void test_rope(void **state)
{
    (void)state;
    enum { T = 5, NH = 3, HD = 8 };
    float x[T * NH * HD], y[T * NH * HD], inv[HD / 2] = {1.0f, 0.3f, 0.05f, 0.001f};
    int32_t pos[T] = {0, 1, 7, 100, 2047};
    fill(x, T * NH * HD);
    prism_backend_t *be = prism_backend_cpu_create(1);
    for (int mode = 0; mode < 2; mode++) {
        memcpy(y, x, sizeof x);
        assert_int_equal(be->i.rope(be->ctx, y, NH * HD, T, NH, HD, HD, pos, inv, (prism_rope_mode_t)mode), PRISM_OK);
        for (int t = 0; t < T; t++)
            for (int h = 0; h < NH; h++)
                for (int i = 0; i < HD / 2; i++) {
                    const float *a = x + (t * NH + h) * HD;
                    const float *b = y + (t * NH + h) * HD;
                    int i0 = mode ? 2 * i : i, i1 = mode ? 2 * i + 1 : i + HD / 2;
                    double ang = (double)pos[t] * inv[i];
                    assert_true(fabs(b[i0] - (a[i0] * cos(ang) - a[i1] * sin(ang))) < 2e-4);
                    assert_true(fabs(b[i1] - (a[i1] * cos(ang) + a[i0] * sin(ang))) < 2e-4);
                }
    }
    prism_backend_destroy(be);
}

static void test_norms_matmul_act(void **state)
{
    (void)state;
    enum { R = 3, D = 37, N = 5 };
    float x[R * D], y[R * D], w[D], b[D];
    fill(x, R * D); fill(w, D); fill(b, D);
    prism_backend_t *be = prism_backend_cpu_create(1);
    assert_int_equal(be->i.rmsnorm(be->ctx, y, x, w, R, D, 1e-5f), PRISM_OK);
    for (int r = 0; r < R; r++) {
        double ss = 0;
        for (int i = 0; i < D; i++) ss += (double)x[r * D + i] * x[r * D + i];
        for (int i = 0; i < D; i++) assert_true(fabs(y[r * D + i] - w[i] * x[r * D + i] / sqrt(ss / D + 1e-5)) < 1e-5);
    }
    assert_int_equal(be->i.layernorm(be->ctx, y, x, w, b, R, D, 1e-5f), PRISM_OK);
    for (int r = 0; r < R; r++) {
        double m = 0, v = 0;
        for (int i = 0; i < D; i++) m += x[r * D + i];
        m /= D;
        for (int i = 0; i < D; i++) v += (x[r * D + i] - m) * (x[r * D + i] - m);
        v /= D;
        for (int i = 0; i < D; i++) assert_true(fabs(y[r * D + i] - ((x[r * D + i] - m) / sqrt(v + 1e-5) * w[i] + b[i])) < 1e-5);
    }
    /* in place */
    float z[R * D];
    memcpy(z, x, sizeof z);
    be->i.rmsnorm(be->ctx, z, z, w, R, D, 1e-5f);
    be->i.rmsnorm(be->ctx, y, x, w, R, D, 1e-5f);
    assert_memory_equal(z, y, sizeof z);

    /* matmul: y = x W^T + b, then accumulate */
    float W[N * D], bias[N], out[R * N], exp_[R * N];
    fill(W, N * D); fill(bias, N);
    assert_int_equal(be->i.matmul(be->ctx, out, N, x, D, W, PRISM_DTYPE_F32, bias, R, N, D, false), PRISM_OK);
    for (int r = 0; r < R; r++)
        for (int n = 0; n < N; n++) {
            double a = bias[n];
            for (int k = 0; k < D; k++) a += (double)x[r * D + k] * W[n * D + k];
            exp_[r * N + n] = (float)a;
        }
    assert_true(maxdiff(out, exp_, R * N) < 1e-5);
    assert_int_equal(be->i.matmul(be->ctx, out, N, x, D, W, PRISM_DTYPE_F32, bias, R, N, D, true), PRISM_OK);
    for (int i = 0; i < R * N; i++) assert_true(fabs(out[i] - 2 * exp_[i]) < 1e-4);
    assert_int_equal(be->i.matmul(be->ctx, out, N, x, D, W, PRISM_DTYPE_BF16, NULL, R, N, D, false), PRISM_ENOTSUP);

    /* activations at known points */
    float one = 1.0f, r;
    struct { int act; double v; } known[] = {
        {PRISM_ACT_SILU, 0.7310585786}, {PRISM_ACT_GELU_ERF, 0.8413447461}, {PRISM_ACT_GELU_TANH, 0.8411919906},
        {PRISM_ACT_QUICK_GELU, 0.8457957}, {PRISM_ACT_RELU, 1.0},
    };
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) {
        assert_int_equal(be->i.act(be->ctx, known[i].act, &r, &one, 1), PRISM_OK);
        assert_true(fabs(r - known[i].v) < 1e-6);
    }
    assert_int_equal(prism_act_parse("quick_gelu"), PRISM_ACT_QUICK_GELU);
    assert_int_equal(prism_act_parse("gelu"), PRISM_ACT_GELU_ERF);
    assert_int_equal(prism_act_parse("gelu_pytorch_tanh"), PRISM_ACT_GELU_TANH);
    assert_int_equal(prism_act_parse("nope"), -1);
    float g[2 * 4] = {1, -2, 0.5f, 3, 2, 2, 2, 2}, o[4];
    assert_int_equal(be->i.silu_mul(be->ctx, o, g, g + 4, 8, 1, 4), PRISM_OK);
    for (int i = 0; i < 4; i++) assert_true(fabs(o[i] - g[i] / (1 + exp(-g[i])) * 2) < 1e-6);
    float a[6] = {1, 2, 3, 4, 5, 6}, bb[2] = {10, 20}, s[6];
    assert_int_equal(be->i.add(be->ctx, s, a, bb, 6, 2), PRISM_OK);
    assert_true(s[0] == 11 && s[1] == 22 && s[4] == 15 && s[5] == 26);
    prism_backend_destroy(be);
}

static void test_gathers_kv(void **state)
{
    (void)state;
    prism_backend_t *be = prism_backend_cpu_create(1);
    float table[4 * 3] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, out[3 * 3];
    uint16_t tb[12], th[12];
    for (int i = 0; i < 12; i++) { tb[i] = prism_f32_to_bf16(table[i]); th[i] = prism_f32_to_f16(table[i]); }
    int32_t ids[3] = {2, 9, 0};
    for (int dt = 0; dt < 3; dt++) {
        const void *t = dt == 0 ? (const void *)table : dt == 1 ? (const void *)tb : (const void *)th;
        assert_int_equal(be->i.get_rows(be->ctx, out, t, (prism_dtype_t)dt, 4, ids, 3, 3), PRISM_OK);
        float exp_[9] = {6, 7, 8, 0, 0, 0, 0, 1, 2};
        assert_memory_equal(out, exp_, sizeof exp_);
    }
    /* im2patch matches Conv2d weight flattening */
    enum { C = 2, H = 4, W = 6, P = 2 };
    float px[C * H * W], pt[(H / P) * (W / P) * C * P * P];
    for (int i = 0; i < C * H * W; i++) px[i] = (float)i;
    assert_int_equal(be->i.im2patch(be->ctx, pt, px, 1, C, H, W, P), PRISM_OK);
    for (int py = 0; py < H / P; py++)
        for (int pxx = 0; pxx < W / P; pxx++)
            for (int c = 0; c < C; c++)
                for (int ky = 0; ky < P; ky++)
                    for (int kx = 0; kx < P; kx++)
                        assert_true(pt[(py * (W / P) + pxx) * C * P * P + c * P * P + ky * P + kx] ==
                                    px[(c * H + py * P + ky) * W + pxx * P + kx]);
    /* kv_write into slots, then blocks to/from host */
    enum { NKV = 2, HD = 3, BSZ = 2, NB = 4 };
    float kc[NB * BSZ * NKV * HD] = {0}, vc[NB * BSZ * NKV * HD] = {0}, k[3 * 8], v[3 * 8];
    fill(k, 24); fill(v, 24);
    int32_t slots[3] = {5, -1, 0};
    assert_int_equal(be->i.kv_write(be->ctx, kc, vc, k, v, 8, slots, 3, NKV, HD), PRISM_OK);
    assert_memory_equal(kc + 5 * NKV * HD, k, NKV * HD * 4);
    assert_memory_equal(vc + 0, v + 16, NKV * HD * 4);
    size_t bb = BSZ * NKV * HD * 4;
    uint8_t host[2 * 48 * 2];
    int32_t blk[2] = {2, 0};
    assert_int_equal(be->i.blocks_to_host(be->ctx, host, 2 * bb, kc, bb, blk, 2), PRISM_OK);
    assert_memory_equal(host, (uint8_t *)kc + 2 * bb, bb);
    assert_memory_equal(host + 2 * bb, kc, bb);
    float kc2[NB * BSZ * NKV * HD] = {0};
    int32_t blk2[2] = {3, 1};
    assert_int_equal(be->i.blocks_from_host(be->ctx, kc2, bb, blk2, 2, host, 2 * bb), PRISM_OK);
    assert_memory_equal((uint8_t *)kc2 + 3 * bb, (uint8_t *)kc + 2 * bb, bb);
    assert_memory_equal((uint8_t *)kc2 + 1 * bb, kc, bb);
    int32_t am[2];
    float lg[2 * 3] = {1, 5, 5, -1, -2, -0.5f};
    assert_int_equal(be->i.argmax(be->ctx, am, lg, 2, 3), PRISM_OK);
    assert_true(am[0] == 1 && am[1] == 2);
    prism_backend_destroy(be);
}

static void test_half_conversions(void **state)
{
    (void)state;
    assert_true(prism_bf16_to_f32(prism_f32_to_bf16(1.0f)) == 1.0f);
    assert_true(prism_f32_to_bf16(1.00390625f) == 0x3f80);        /* tie rounds to even */
    assert_true(prism_f32_to_bf16(1.01171875f) == 0x3f82);        /* tie rounds up to even */
    assert_true(isnan(prism_bf16_to_f32(prism_f32_to_bf16(NAN))));
    assert_true(prism_f16_to_f32(prism_f32_to_f16(65504.0f)) == 65504.0f);
    assert_true(isinf(prism_f16_to_f32(prism_f32_to_f16(1e6f))));
    assert_true(prism_f16_to_f32(0x0001) == ldexpf(1, -24));        /* smallest subnormal */
    assert_true(prism_f16_to_f32(prism_f32_to_f16(-0.333251953125f)) == -0.333251953125f);
    for (int i = 0; i < 0x7c00; i += 7) {                              /* every finite f16 round-trips */
        uint16_t h = (uint16_t)i;
        assert_int_equal(prism_f32_to_f16(prism_f16_to_f32(h)), h);
    }
    assert_int_equal(prism_dtype_size(PRISM_DTYPE_BF16), 2);
}

static void test_pool_and_create(void **state)
{
    (void)state;
    prism_backend_t *be = prism_backend_cpu_create_pool(1, 1 << 20);
    void *a = prism_backend_buf_alloc(be, 600 << 10);
    assert_non_null(a);
    assert_true(((uintptr_t)a & 255) == 0);
    assert_null(prism_backend_buf_alloc(be, 600 << 10));                 /* over the pool: refused */
    assert_int_equal(be->i.pool_used(be->ctx), 600 << 10);
    prism_backend_buf_free(be, a);
    assert_int_equal(be->i.pool_used(be->ctx), 0);
    assert_int_equal(be->i.pool_peak(be->ctx), 600 << 10);
    prism_backend_destroy(be);

    prism_backend_t *x = NULL;
    assert_int_equal(prism_backend_create("cpu", 2, 0, &x), PRISM_OK);
    assert_string_equal(x->i.name(x->ctx), "cpu");
    prism_backend_destroy(x);
    if (!prism_backend_has_cuda()) {
        assert_int_equal(prism_backend_create("cuda", 1, 0, &x), PRISM_ENOTSUP);
        assert_null(x);
    }
    assert_int_equal(prism_backend_create("tpu", 1, 0, &x), PRISM_EINVAL);
}

/* bf16 weights (--weight-dtype bf16): every matmul path — the gemv for a few rows, sgemm on
 * widened chunks for many, column slices over threads, chunks narrower than a slice, the grouped
 * matmul of Llama-4's experts — equals the fp32 matmul on the same weights widened. */
static void test_bf16_weights(void **state)
{
    (void)state;
    enum { R = 70, D = 1000, N = 700, G = 3 };
    prism_backend_t *f32 = prism_backend_cpu_create(1), *b1 = prism_backend_cpu_create(1),
                    *b3 = prism_backend_cpu_create(3);
    float *x = malloc(sizeof(float) * R * D), *wf = malloc(sizeof(float) * G * N * D);
    float *yf = malloc(sizeof(float) * R * N), *yb = malloc(sizeof(float) * R * N), *bias = malloc(sizeof(float) * N);
    uint16_t *wb = malloc(sizeof(uint16_t) * G * N * D);
    fill(x, (size_t)R * D);
    fill(bias, N);
    for (size_t i = 0; i < (size_t)G * N * D; i++) {
        wb[i] = prism_f32_to_bf16(frand());
        wf[i] = prism_bf16_to_f32(wb[i]);
    }
    /* refused until asked for; other dtypes refused */
    assert_int_equal(b1->i.matmul(b1->ctx, yb, N, x, D, wb, PRISM_DTYPE_BF16, NULL, 1, N, D, false), PRISM_ENOTSUP);
    assert_int_equal(prism_backend_set_weight_dtype(b1, PRISM_DTYPE_F16), PRISM_ENOTSUP);
    assert_int_equal(b1->weight_dtype, PRISM_DTYPE_F32);
    assert_int_equal(prism_backend_set_weight_dtype(b1, PRISM_DTYPE_BF16), PRISM_OK);
    assert_int_equal(prism_backend_set_weight_dtype(b3, PRISM_DTYPE_BF16), PRISM_OK);
    assert_int_equal(b1->weight_dtype, PRISM_DTYPE_BF16);
    /* 3 threads: chunks of 48 columns, so each thread's slice (~240 columns) widens in several,
     * the last one partial */
    ((prism_cpu_ctx_t *)b3->ctx)->widen_floats = 48 * D + 100;
    prism_backend_t *bs[2] = {b1, b3};
    for (int bi = 0; bi < 2; bi++)
        for (int M = 1; M <= R; M = M < 20 ? M + 4 : M * 3) {
            for (int i = 0; i < M * N; i++) yf[i] = yb[i] = (float)(i % 7);
            assert_int_equal(f32->i.matmul(f32->ctx, yf, N, x, D, wf, PRISM_DTYPE_F32, bias, M, N, D, true), PRISM_OK);
            assert_int_equal(bs[bi]->i.matmul(bs[bi]->ctx, yb, N, x, D, wb, PRISM_DTYPE_BF16, bias, M, N, D, true),
                             PRISM_OK);
            assert_close_f(yb, yf, (size_t)M * N, 1e-5, 1e-4, "bf16 matmul");
        }
    /* K so long that 16 columns do not fit a thread's widen scratch: refused for sgemm rows */
    int long_k = PRISM_CPU_WIDEN_FLOATS / 16 + 1;
    assert_int_equal(b1->i.matmul(b1->ctx, yb, 1, x, long_k, wb, PRISM_DTYPE_BF16, NULL, 20, 1, long_k, false),
                     PRISM_ENOTSUP);
    /* grouped (x @ W_e, W_e [D][N]): 3 experts, one empty, one with a single row (the sgemv path) */
    int32_t off[G + 1] = {0, 1, 1, R};
    for (int bi = 0; bi < 2; bi++) {
        assert_int_equal(f32->i.matmul_grouped(f32->ctx, yf, N, x, D, wf, PRISM_DTYPE_F32, off, G, R, N, D), PRISM_OK);
        assert_int_equal(bs[bi]->i.matmul_grouped(bs[bi]->ctx, yb, N, x, D, wb, PRISM_DTYPE_BF16, off, G, R, N, D),
                         PRISM_OK);
        assert_close_f(yb, yf, (size_t)R * N, 1e-5, 1e-4, "bf16 grouped matmul");
    }
    assert_int_equal(f32->i.matmul_grouped(f32->ctx, yb, N, x, D, wb, PRISM_DTYPE_BF16, off, G, R, N, D), PRISM_ENOTSUP);
    prism_backend_destroy(f32);
    prism_backend_destroy(b1);
    prism_backend_destroy(b3);
    free(x); free(wf); free(yf); free(yb); free(bias); free(wb);
}

/* Σ_k |bf16(x[m][k])·w[n][k]| (double): the scale of a bf16 dot product's fp32 rounding */
static void bf16dp_abs(double *a, const float *x, int ldx, const uint16_t *w, int M, int N, int K)
{
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double s = 0;
            for (int k = 0; k < K; k++)
                s += fabs((double)prism_bf16_to_f32(prism_f32_to_bf16(x[(size_t)m * ldx + k])) *
                          prism_bf16_to_f32(w[(size_t)n * K + k]));
            a[(size_t)m * N + n] = s;
        }
}

/* |a - b| <= tol * scale (+ a little for the sums near 0) everywhere */
static void assert_within(const float *a, const float *b, const double *scale, size_t n, double tol, const char *what)
{
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= tol * scale[i] + 1e-6)) fail_msg("%s[%zu]: %.9g vs %.9g (diff %.3g, scale %.3g)", what, i, a[i], b[i], d, scale[i]);
    }
}

/* --compute-dtype bf16: the AVX-512 BF16 kernel equals the scalar reference (x rounded to bf16,
 * exact products, fp32 sums) within fp32 summation rounding for every tile edge — rows 1..33 and
 * 64..300 (row blocks, a 4-row scratch too), columns 1..8 and not a multiple of 16, K odd, even,
 * shorter than 32 and with tails, accumulate. */
static void test_bf16dp_kernel(void **state)
{
    (void)state;
    if (!prism_cpu_has_avx512_bf16()) {
        printf("skipped: this CPU has no AVX-512 BF16 (the emulated path is tested in test_bf16_compute)\n");
        skip();
        return;
    }
    enum { MM = 300, NN = 45, KK = 300 };
    static const int ks[] = {1, 2, 7, 31, 32, 33, 64, 129, 256, 300};
    static const int ns[] = {1, 3, 5, 8, 13, 45};
    float *x = malloc(sizeof(float) * MM * KK), *y = malloc(sizeof(float) * MM * NN), *yr = malloc(sizeof(float) * MM * NN);
    uint16_t *w = malloc(sizeof(uint16_t) * NN * KK), *xb = malloc(sizeof(uint16_t) * 64 * 320);
    double *sc = malloc(sizeof(double) * MM * NN);
    fill(x, (size_t)MM * KK);
    for (int i = 0; i < NN * KK; i++) w[i] = prism_f32_to_bf16(frand());
    const prism_cpu_kern_t *kb = &prism_cpu_kern_avx512bf16, *ks_ = &prism_cpu_kern_scalar;
    int checked = 0;
    for (int M = 1; M <= MM; M = M < 33 ? M + 1 : M < 64 ? 64 : M + 59)
        for (size_t ki = 0; ki < PRISM_ARRAY_LEN(ks); ki++)
            for (size_t ni = 0; ni < PRISM_ARRAY_LEN(ns); ni++) {
                int K = ks[ki], N = ns[ni];
                if ((M * 7 + K + N) % 3 && M > 8 && M < 64) continue;   /* a third of the middle rows */
                bool acc = (M + K + N) & 1;
                size_t kp = (size_t)(K + 31) / 32 * 32;
                size_t xb_len = M % 2 ? 4 * kp : 64 * 320;              /* a 4-row scratch: many row blocks */
                for (int i = 0; i < M * N; i++) y[i] = yr[i] = (float)(i % 5) - 2;
                kb->matmul_bf16dp(y, N, x, KK, w, K, M, N, K, acc, xb, xb_len);
                ks_->matmul_bf16dp(yr, N, x, KK, w, K, M, N, K, acc, NULL, 0);
                bf16dp_abs(sc, x, KK, w, M, N, K);
                if (acc) for (int i = 0; i < M * N; i++) sc[i] += fabs(yr[i]);
                /* two fp32 sums of K terms in different orders: within 2·K·2^-24 of the magnitudes */
                assert_within(y, yr, sc, (size_t)M * N, 2.0 * K * 0x1p-24, "bf16dp kernel vs scalar");
                checked++;
            }
    assert_true(checked > 500);
    free(x); free(y); free(yr); free(w); free(xb); free(sc);
}

/* The packed layout (prism_cpu_bf16p_pack, in place): element k of column c of panel p at
 * p*panel + ((k/2)*16 + c%16)*2 + k%2, zeros past K (odd K) and past N (a partial last panel). */
static void test_bf16p_pack_layout(void **state)
{
    (void)state;
    static const int ns[] = {1, 15, 16, 17, 33}, ks[] = {1, 2, 31, 33};
    for (size_t ni = 0; ni < PRISM_ARRAY_LEN(ns); ni++)
        for (size_t ki = 0; ki < PRISM_ARRAY_LEN(ks); ki++) {
            int N = ns[ni], K = ks[ki];
            size_t n = prism_cpu_bf16p_elems(N, K), panel = prism_cpu_bf16p_panel(K);
            assert_int_equal(n, (size_t)((N + 15) / 16 * 16) * (size_t)((K + 1) / 2 * 2));
            uint16_t *w = malloc(n * 2), *tmp = malloc(16 * (size_t)K * 2);
            for (size_t i = 0; i < n; i++) w[i] = i < (size_t)N * K ? (uint16_t)(i + 1) : 0xdead;
            prism_cpu_bf16p_pack(w, N, K, tmp);
            for (int c = 0; c < (N + 15) / 16 * 16; c++)
                for (int k = 0; k < (K + 1) / 2 * 2; k++) {
                    uint16_t want = c < N && k < K ? (uint16_t)(c * K + k + 1) : 0;
                    size_t at = (size_t)(c / 16) * panel + ((size_t)(k / 2) * 16 + c % 16) * 2 + k % 2;
                    if (w[at] != want) fail_msg("N %d K %d: column %d k %d holds %u, not %u", N, K, c, k, w[at], want);
                }
            free(w); free(tmp);
        }
}

/* The packed kernel (matmul_bf16p) against Σ_k bf16(x)·w in double, every edge of its tiles: rows
 * 1..512 (6-row tiles, 1-5 row tails, the 8-panel tiles of 1-2 rows, row blocks, a 4-row scratch),
 * columns 1..688 (partial last panels: nothing stored past N), K odd, even, below and above 32,
 * accumulate on and off, strided x and y. Two fp32 roundings per term at most (the sums in k-pair
 * order, one more for accumulate): within (K + 2)·2^-24 of the magnitudes. */
static void test_bf16p_kernel(void **state)
{
    (void)state;
    if (!prism_cpu_has_avx512_bf16()) {
        printf("skipped: this CPU has no AVX-512 BF16\n");
        skip();
        return;
    }
    static const int ms[] = {1, 2, 3, 5, 7, 8, 16, 17, 64, 512};
    static const int ns[] = {1, 15, 16, 17, 33, 128, 688};
    static const int ks[] = {1, 2, 31, 32, 33, 256, 688};
    enum { MM = 512, NN = 688, KK = 688, LDX = KK + 3, LDY = NN + 5 };
    const prism_cpu_kern_t *kb = &prism_cpu_kern_avx512bf16;
    assert_non_null(kb->matmul_bf16p);
    assert_null(prism_cpu_kern_avx512.matmul_bf16p);
    assert_null(prism_cpu_kern_scalar.matmul_bf16p);
    float *x = malloc(sizeof(float) * MM * LDX), *y = malloc(sizeof(float) * MM * LDY), *y0 = malloc(sizeof(float) * MM * LDY);
    uint16_t *w = malloc(sizeof(uint16_t) * prism_cpu_bf16p_elems(NN, KK)), *tmp = malloc(sizeof(uint16_t) * 16 * KK);
    size_t xb_big = (size_t)MM * 704;
    uint16_t *xb = malloc(sizeof(uint16_t) * xb_big);
    double *xr = malloc(sizeof(double) * MM * KK), *wr = malloc(sizeof(double) * NN * KK);
    double *ref = malloc(sizeof(double) * MM * NN), *sc = malloc(sizeof(double) * MM * NN);
    fill(x, (size_t)MM * LDX);
    for (int m = 0; m < MM; m++)
        for (int k = 0; k < KK; k++) xr[(size_t)m * KK + k] = prism_bf16_to_f32(prism_f32_to_bf16(x[(size_t)m * LDX + k]));
    int checked = 0;
    for (size_t ki = 0; ki < PRISM_ARRAY_LEN(ks); ki++)
        for (size_t ni = 0; ni < PRISM_ARRAY_LEN(ns); ni++) {
            int K = ks[ki], N = ns[ni];
            for (int i = 0; i < N * K; i++) {
                w[i] = prism_f32_to_bf16(frand());
                wr[(size_t)(i / K) * KK + i % K] = prism_bf16_to_f32(w[i]);
            }
            prism_cpu_bf16p_pack(w, N, K, tmp);
            for (size_t mi = 0; mi < PRISM_ARRAY_LEN(ms); mi++) {
                int M = ms[mi];
                for (int m = 0; m < M; m++)
                    for (int n = 0; n < N; n++) {
                        double s = 0, a = 0;
                        const double *xm = xr + (size_t)m * KK, *wn = wr + (size_t)n * KK;
                        for (int k = 0; k < K; k++) {
                            s += xm[k] * wn[k];
                            a += fabs(xm[k] * wn[k]);
                        }
                        ref[(size_t)m * N + n] = s;
                        sc[(size_t)m * N + n] = a;
                    }
                size_t kp = (size_t)(K + 31) / 32 * 32;
                size_t xb_len = M % 2 ? PRISM_CPU_BF16DP_ROWS * kp : xb_big;   /* a 4-row scratch: many blocks */
                for (int acc = 0; acc < 2; acc++) {
                    for (int i = 0; i < M * LDY; i++) y[i] = y0[i] = (float)(i % 5) - 2;
                    kb->matmul_bf16p(y, LDY, x, LDX, w, M, N, K, acc, xb, xb_len);
                    for (int m = 0; m < M; m++) {
                        for (int n = 0; n < N; n++) {
                            size_t i = (size_t)m * LDY + n, r = (size_t)m * N + n;
                            double want = ref[r] + (acc ? y0[i] : 0.0), tol = (K + 2) * 0x1p-24 * (sc[r] + fabs(want));
                            if (!(fabs(y[i] - want) <= tol))
                                fail_msg("M %d N %d K %d acc %d: y[%d][%d] = %.9g, want %.9g (tol %.3g)", M, N, K, acc,
                                         m, n, y[i], want, tol);
                        }
                        for (int n = N; n < LDY; n++)
                            if (y[(size_t)m * LDY + n] != y0[(size_t)m * LDY + n])
                                fail_msg("M %d N %d K %d: y[%d][%d] past N was written", M, N, K, m, n);
                    }
                    checked++;
                }
            }
        }
    assert_int_equal(checked, 2 * 10 * 7 * 7);
    free(x); free(y); free(y0); free(w); free(tmp); free(xb); free(xr); free(wr); free(ref); free(sc);
}

/* test_bf16p_backend / test_f32p_backend: bf16 weights packed under the compute dtype `compute`
 * against the same weights unpacked, on 1 and 3 threads: every M (decode gemv grid and row blocks),
 * bias, accumulate, a partial last panel, odd K; no allocation per call; taken only whole; packed
 * twice refused; the compute dtype may not change under it; freeing its block forgets it. */
static void check_packed_backend(prism_dtype_t compute, const char *what)
{
    enum { R = 300, D = 301, N = 700 };
    prism_backend_t *bs[2] = {prism_backend_cpu_create(1), prism_backend_cpu_create(3)};
    float *x = malloc(sizeof(float) * R * D), *bias = malloc(sizeof(float) * N);
    float *yp = malloc(sizeof(float) * R * N), *yu = malloc(sizeof(float) * R * N);
    double *sc = malloc(sizeof(double) * R * N);
    uint16_t *wu = malloc(sizeof(uint16_t) * N * D);
    fill(x, (size_t)R * D);
    fill(bias, N);
    for (size_t i = 0; i < (size_t)N * D; i++) wu[i] = prism_f32_to_bf16(frand());
    for (int bi = 0; bi < 2; bi++) {
        prism_backend_t *be = bs[bi];
        prism_cpu_ctx_t *c = be->ctx;
        if (compute == PRISM_DTYPE_BF16) {
            assert_int_equal(prism_backend_set_compute_dtype(be, PRISM_DTYPE_BF16), PRISM_OK);
        } else {
            assert_int_equal(prism_backend_set_weight_dtype(be, PRISM_DTYPE_BF16), PRISM_OK);
            assert_int_equal(be->compute_dtype, PRISM_DTYPE_F32);
        }
        for (int K = D - 1; K <= D; K++) {   /* even K: the bytes of [N][K] plus the panel padding; odd K: more */
            size_t bytes = be->i.weight_pack_bytes(be->ctx, N, K);
            assert_int_equal(bytes, prism_cpu_bf16p_elems(N, K) * 2);
            assert_true(bytes >= (size_t)N * K * 2);
            uint16_t *wp = prism_backend_buf_alloc(be, bytes);
            assert_non_null(wp);
            memcpy(wp, wu, (size_t)N * K * 2);
            assert_int_equal(be->i.weight_pack(be->ctx, wp, N, K), PRISM_OK);
            assert_int_equal(c->n_packed, 1);
            assert_int_equal(be->i.weight_pack(be->ctx, wp, N, K), PRISM_EINVAL);   /* twice */
            uint64_t allocs = prism_mem_alloc_count();
            for (int M = 1; M <= R; M = M < 20 ? M + 3 : M * 2 + 7) {
                bool acc = M % 3 != 0;
                const float *b = M % 4 ? bias : NULL;
                for (int i = 0; i < M * N; i++) yp[i] = yu[i] = (float)(i % 7);
                assert_int_equal(be->i.matmul(be->ctx, yp, N, x, D, wp, PRISM_DTYPE_BF16, b, M, N, K, acc), PRISM_OK);
                assert_int_equal(be->i.matmul(be->ctx, yu, N, x, D, wu, PRISM_DTYPE_BF16, b, M, N, K, acc), PRISM_OK);
                for (int m = 0; m < M; m++)
                    for (int n = 0; n < N; n++) {
                        double s = (acc ? (double)((m * N + n) % 7) : 0.0) + (b ? fabs(b[n]) : 0);
                        for (int k = 0; k < K; k++)
                            s += fabs((double)x[(size_t)m * D + k] * prism_bf16_to_f32(wu[(size_t)n * K + k]));
                        sc[(size_t)m * N + n] = s;
                    }
                assert_within(yp, yu, sc, (size_t)M * N, 2.0 * (K + 2) * 0x1p-24, what);
            }
            assert_int_equal(prism_mem_alloc_count(), allocs);   /* the look-up allocates nothing */
            /* only the whole weight: not a slice of it, not another shape */
            assert_int_equal(be->i.matmul(be->ctx, yp, N, x, D, wp + 16 * K, PRISM_DTYPE_BF16, NULL, 1, N - 16, K, false),
                             PRISM_EINVAL);
            assert_int_equal(be->i.matmul(be->ctx, yp, N, x, D, wp, PRISM_DTYPE_BF16, NULL, 1, N - 1, K, false),
                             PRISM_EINVAL);
            prism_dtype_t other = compute == PRISM_DTYPE_BF16 ? PRISM_DTYPE_F32 : PRISM_DTYPE_BF16;
            assert_int_equal(prism_backend_set_compute_dtype(be, other), PRISM_EINVAL);
            prism_backend_buf_free(be, wp);
            assert_int_equal(c->n_packed, 0);
        }
        prism_backend_destroy(be);
    }
    free(x); free(bias); free(yp); free(yu); free(sc); free(wu);
}

/* Packing through the backend (weight_pack_bytes / weight_pack): only under --compute-dtype bf16
 * with the packed kernel; the packed weight's matmul equals the unpacked one's (matmul_bf16dp)
 * within fp32 summation rounding on 1 and 3 threads, every M (decode gemv grid and row blocks),
 * bias, accumulate, a partial last panel, odd K; taken only whole; freeing its block forgets it. */
static void test_bf16p_backend(void **state)
{
    (void)state;
    prism_backend_t *f32 = prism_backend_cpu_create(1), *bw = prism_backend_cpu_create(1);
    setenv("PRISM_CPU_ISA", "avx512", 1);
    prism_backend_t *emul = prism_backend_cpu_create(1);
    unsetenv("PRISM_CPU_ISA");
    assert_int_equal(prism_backend_set_weight_dtype(bw, PRISM_DTYPE_BF16), PRISM_OK);
    assert_int_equal(prism_backend_set_compute_dtype(emul, PRISM_DTYPE_BF16), PRISM_OK);
    /* fp32 weights and the emulation keep [N][K]; bf16 weights under fp32 compute pack only where
     * the table has matmul_f32p (test_f32p_backend) */
    assert_int_equal(bw->i.weight_pack_bytes(bw->ctx, 33, 31) != 0,
                     ((prism_cpu_ctx_t *)bw->ctx)->k->matmul_f32p != NULL);
    prism_backend_t *keep[2] = {f32, emul};
    for (int i = 0; i < 2; i++) {
        assert_int_equal(keep[i]->i.weight_pack_bytes(keep[i]->ctx, 33, 31), 0);
        uint16_t one = 7;
        assert_int_equal(keep[i]->i.weight_pack(keep[i]->ctx, &one, 1, 1), PRISM_OK);
        assert_int_equal(one, 7);
    }
    prism_backend_destroy(f32);
    prism_backend_destroy(bw);
    prism_backend_destroy(emul);
    if (!prism_cpu_has_avx512_bf16()) {
        printf("skipped the packed matmul: this CPU has no AVX-512 BF16\n");
        skip();
        return;
    }
    check_packed_backend(PRISM_DTYPE_BF16, "packed vs unpacked bf16 matmul");
}

/* The fp32 packed kernel (matmul_f32p: x as it is, the bf16 weight pairs widened in registers)
 * against Σ_k x·w in double over the shapes of test_bf16p_kernel (tile edges, 1-2 row split sums,
 * row blocks, partial last panels, odd K), accumulate on and off, strided x and y, nothing written
 * past N. One fp32 rounding per product-sum step (+1 for accumulate): within (K + 2)·2^-24. x is NOT
 * rounded: the result is far nearer the fp32 reference than bf16(x) would allow. Both AVX-512
 * tables share it; the scalar and AVX2 tables have none. */
static void test_f32p_kernel(void **state)
{
    (void)state;
    assert_null(prism_cpu_kern_scalar.matmul_f32p);
    assert_null(prism_cpu_kern_avx2.matmul_f32p);
    if (prism_cpu_isa_detect() < PRISM_CPU_ISA_AVX512) {
        printf("skipped: this CPU has no AVX-512\n");
        skip();
        return;
    }
    const prism_cpu_kern_t *kb = &prism_cpu_kern_avx512;
    assert_non_null(kb->matmul_f32p);
    assert_ptr_equal(kb->matmul_f32p, prism_cpu_kern_avx512bf16.matmul_f32p);
    static const int ms[] = {1, 2, 3, 5, 7, 8, 16, 17, 64, 512};
    static const int ns[] = {1, 15, 16, 17, 33, 128, 688};
    static const int ks[] = {1, 2, 31, 32, 33, 256, 688};
    enum { MM = 512, NN = 688, KK = 688, LDX = KK + 3, LDY = NN + 5 };
    float *x = malloc(sizeof(float) * MM * LDX), *y = malloc(sizeof(float) * MM * LDY), *y0 = malloc(sizeof(float) * MM * LDY);
    uint16_t *w = malloc(sizeof(uint16_t) * prism_cpu_bf16p_elems(NN, KK)), *tmp = malloc(sizeof(uint16_t) * 16 * KK);
    double *wr = malloc(sizeof(double) * NN * KK), *ref = malloc(sizeof(double) * MM * NN), *sc = malloc(sizeof(double) * MM * NN);
    fill(x, (size_t)MM * LDX);
    double worst_bf16x = 0;   /* the largest error relative to tol: x must not have been rounded */
    int checked = 0;
    for (size_t ki = 0; ki < PRISM_ARRAY_LEN(ks); ki++)
        for (size_t ni = 0; ni < PRISM_ARRAY_LEN(ns); ni++) {
            int K = ks[ki], N = ns[ni];
            for (int i = 0; i < N * K; i++) {
                w[i] = prism_f32_to_bf16(frand());
                wr[(size_t)(i / K) * KK + i % K] = prism_bf16_to_f32(w[i]);
            }
            prism_cpu_bf16p_pack(w, N, K, tmp);
            for (size_t mi = 0; mi < PRISM_ARRAY_LEN(ms); mi++) {
                int M = ms[mi];
                for (int m = 0; m < M; m++)
                    for (int n = 0; n < N; n++) {
                        double s = 0, a = 0;
                        const float *xm = x + (size_t)m * LDX;
                        const double *wn = wr + (size_t)n * KK;
                        for (int k = 0; k < K; k++) {
                            s += xm[k] * wn[k];
                            a += fabs(xm[k] * wn[k]);
                        }
                        ref[(size_t)m * N + n] = s;
                        sc[(size_t)m * N + n] = a;
                    }
                for (int acc = 0; acc < 2; acc++) {
                    for (int i = 0; i < M * LDY; i++) y[i] = y0[i] = (float)(i % 5) - 2;
                    kb->matmul_f32p(y, LDY, x, LDX, w, M, N, K, acc);
                    for (int m = 0; m < M; m++) {
                        for (int n = 0; n < N; n++) {
                            size_t i = (size_t)m * LDY + n, r = (size_t)m * N + n;
                            double want = ref[r] + (acc ? y0[i] : 0.0), tol = (K + 2) * 0x1p-24 * (sc[r] + fabs(want));
                            if (!(fabs(y[i] - want) <= tol))
                                fail_msg("M %d N %d K %d acc %d: y[%d][%d] = %.9g, want %.9g (tol %.3g)", M, N, K, acc,
                                         m, n, y[i], want, tol);
                            if (sc[r] > 0) worst_bf16x = fmax(worst_bf16x, fabs(y[i] - want) / (sc[r] + fabs(want)));
                        }
                        for (int n = N; n < LDY; n++)
                            if (y[(size_t)m * LDY + n] != y0[(size_t)m * LDY + n])
                                fail_msg("M %d N %d K %d: y[%d][%d] past N was written", M, N, K, m, n);
                    }
                    checked++;
                }
            }
        }
    assert_int_equal(checked, 2 * 10 * 7 * 7);
    assert_true(worst_bf16x < 0x1p-12);   /* bf16(x) would cost up to 2^-9 of the magnitudes */
    free(x); free(y); free(y0); free(w); free(tmp); free(wr); free(ref); free(sc);
}

/* Packing under the default fp32 compute: bf16 weights on an AVX-512 table pack (weight_pack_bytes
 * as under bf16 compute), fp32 weights and the AVX2 table do not; the packed weight's matmul equals
 * the unpacked one's (gemv_bf16 for few rows, widened sgemm for many) within fp32 summation rounding
 * on 1 and 3 threads, every M, bias, accumulate, a partial last panel, odd K; taken only whole;
 * the compute dtype may not change under it; freeing its block forgets it. */
static void test_f32p_backend(void **state)
{
    (void)state;
    prism_backend_t *f32 = prism_backend_cpu_create(1);
    setenv("PRISM_CPU_ISA", "avx2", 1);
    prism_backend_t *a2 = prism_backend_cpu_create(1);
    unsetenv("PRISM_CPU_ISA");
    assert_int_equal(prism_backend_set_weight_dtype(a2, PRISM_DTYPE_BF16), PRISM_OK);
    assert_int_equal(f32->i.weight_pack_bytes(f32->ctx, 33, 32), 0);
    assert_int_equal(a2->i.weight_pack_bytes(a2->ctx, 33, 32), 0);
    prism_backend_destroy(f32);
    prism_backend_destroy(a2);
    if (prism_cpu_isa_detect() < PRISM_CPU_ISA_AVX512) {
        printf("skipped the packed fp32 matmul: this CPU has no AVX-512\n");
        skip();
        return;
    }
    check_packed_backend(PRISM_DTYPE_F32, "packed vs unpacked fp32 matmul");
}

/* --compute-dtype bf16 through the backend: refused for other dtypes, it stores weights as bf16;
 * every thread grid (1 and 3 threads, rows and columns split), bias and accumulate; the result
 * equals the fp32 matmul of bf16-rounded x (fp32 rounding), is within the bf16 rounding of x of
 * the fp32 matmul of x, and is NOT that fp32 result bit for bit (x really was rounded). The
 * emulation (PRISM_CPU_ISA=avx512: a table without bf16 dot products) gives the same numerics. */
static void test_bf16_compute(void **state)
{
    (void)state;
    enum { R = 300, D = 300, N = 700 };
    prism_backend_t *f32 = prism_backend_cpu_create(1), *b1 = prism_backend_cpu_create(1),
                    *b3 = prism_backend_cpu_create(3), *bf = prism_backend_cpu_create(1);
    setenv("PRISM_CPU_ISA", "avx512", 1);
    prism_backend_t *emul = prism_backend_cpu_create(2);
    unsetenv("PRISM_CPU_ISA");
    float *x = malloc(sizeof(float) * R * D), *xr = malloc(sizeof(float) * R * D), *wf = malloc(sizeof(float) * N * D);
    float *yf = malloc(sizeof(float) * R * N), *yb = malloc(sizeof(float) * R * N), *yx = malloc(sizeof(float) * R * N);
    float *bias = malloc(sizeof(float) * N);
    double *sc = malloc(sizeof(double) * R * N);
    uint16_t *wb = malloc(sizeof(uint16_t) * N * D);
    fill(x, (size_t)R * D);
    fill(bias, N);
    for (size_t i = 0; i < (size_t)R * D; i++) xr[i] = prism_bf16_to_f32(prism_f32_to_bf16(x[i]));
    for (size_t i = 0; i < (size_t)N * D; i++) {
        wb[i] = prism_f32_to_bf16(frand());
        wf[i] = prism_bf16_to_f32(wb[i]);
    }
    assert_int_equal(f32->compute_dtype, PRISM_DTYPE_F32);
    assert_int_equal(prism_backend_set_compute_dtype(b1, PRISM_DTYPE_F16), PRISM_ENOTSUP);
    assert_int_equal(prism_backend_set_weight_dtype(bf, PRISM_DTYPE_BF16), PRISM_OK);
    prism_backend_t *bs[3] = {b1, b3, emul};
    for (int bi = 0; bi < 3; bi++) {
        assert_int_equal(prism_backend_set_compute_dtype(bs[bi], PRISM_DTYPE_BF16), PRISM_OK);
        assert_int_equal(bs[bi]->compute_dtype, PRISM_DTYPE_BF16);
        assert_int_equal(bs[bi]->weight_dtype, PRISM_DTYPE_BF16);
    }
    assert_true(((prism_cpu_ctx_t *)emul->ctx)->k->matmul_bf16dp == NULL);
    double max_vs_f32 = 0;
    for (int bi = 0; bi < 3; bi++)
        for (int M = 1; M <= R; M = M < 20 ? M + 3 : M * 2 + 7) {
            int K = M % 2 ? D : D - 1;   /* odd K too */
            bool acc = M % 3 != 0;
            const float *b = M % 4 ? bias : NULL;
            for (int i = 0; i < M * N; i++) yf[i] = yb[i] = yx[i] = (float)(i % 7);
            assert_int_equal(bs[bi]->i.matmul(bs[bi]->ctx, yb, N, x, D, wb, PRISM_DTYPE_BF16, b, M, N, K, acc), PRISM_OK);
            /* the fp32 matmul of the rounded x: the same products, summed in another order */
            assert_int_equal(f32->i.matmul(f32->ctx, yx, N, xr, D, wf, PRISM_DTYPE_F32, b, M, N, K, acc), PRISM_OK);
            /* the fp32 path (--weight-dtype bf16 alone) on x as it is */
            assert_int_equal(bf->i.matmul(bf->ctx, yf, N, x, D, wb, PRISM_DTYPE_BF16, b, M, N, K, acc), PRISM_OK);
            for (int m = 0; m < M; m++)
                for (int n = 0; n < N; n++) {
                    double s = fabs((double)(acc ? (float)((m * N + n) % 7) : 0.0f)) + (b ? fabs(b[n]) : 0);
                    for (int k = 0; k < K; k++) s += fabs((double)x[(size_t)m * D + k] * wf[(size_t)n * D + k]);
                    sc[(size_t)m * N + n] = s;
                }
            assert_within(yb, yx, sc, (size_t)M * N, 2.0 * (K + 2) * 0x1p-24, "bf16 compute vs fp32 of rounded x");
            /* rounding x to bf16 moves each product by at most 2^-9 of it (plus the sums' rounding) */
            assert_within(yb, yf, sc, (size_t)M * N, 0x1p-9 + 2.0 * (K + 2) * 0x1p-24, "bf16 compute vs fp32");
            max_vs_f32 = PRISM_MAX(max_vs_f32, maxdiff(yb, yf, (size_t)M * N));
        }
    printf("bf16 compute vs fp32: max |diff| %.3g\n", max_vs_f32);
    assert_true(max_vs_f32 > 1e-4);   /* x was rounded: the bf16 path ran */
    prism_backend_t *all[5] = {f32, b1, b3, bf, emul};
    for (int i = 0; i < 5; i++) prism_backend_destroy(all[i]);
    free(x); free(xr); free(wf); free(yf); free(yb); free(yx); free(bias); free(sc); free(wb);
}

/* OpenBLAS runs kernels this CPU has: after a backend is created its generic Prescott (SSE3)
 * fallback, which a CPU model newer than the library gets (Emerald Rapids under 0.3.21, 4-5x
 * slower sgemm), is never left on a CPU with AVX2 — unless the operator asked for it. */
extern char *openblas_get_corename(void) __attribute__((weak));

static void test_blas_kernels_fit_the_cpu(void **state)
{
    (void)state;
    if (!openblas_get_corename || getenv("OPENBLAS_CORETYPE") || prism_cpu_isa_detect() < PRISM_CPU_ISA_AVX2) {
        skip();
        return;
    }
    prism_backend_t *be = prism_backend_cpu_create(1);
    assert_non_null(be);
    const char *core = openblas_get_corename();
    printf("OpenBLAS kernels: %s (cpu isa %s)\n", core, prism_cpu_isa_name(prism_cpu_isa_detect()));
    assert_string_not_equal(core, "Prescott");
    prism_backend_destroy(be);
}

int main(void)
{
    prism_log_init("test_backend_cpu", PRISM_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attn_paged),
        cmocka_unit_test(test_attn_paged_chunked),
        cmocka_unit_test(test_attn_batch_invariant),
        cmocka_unit_test(test_attn_dense),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_norms_matmul_act),
        cmocka_unit_test(test_gathers_kv),
        cmocka_unit_test(test_half_conversions),
        cmocka_unit_test(test_pool_and_create),
        cmocka_unit_test(test_blas_kernels_fit_the_cpu),
        cmocka_unit_test(test_kernel_tables_agree),
        cmocka_unit_test(test_backend_paths_agree),
        cmocka_unit_test(test_threads_agree),
        cmocka_unit_test(test_bf16_weights),
        cmocka_unit_test(test_bf16dp_kernel),
        cmocka_unit_test(test_bf16p_pack_layout),
        cmocka_unit_test(test_bf16p_kernel),
        cmocka_unit_test(test_bf16p_backend),
        cmocka_unit_test(test_f32p_kernel),
        cmocka_unit_test(test_f32p_backend),
        cmocka_unit_test(test_bf16_compute),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
