/* The Llama-4 backend ops (head_rmsnorm, scale_rows, moe_route, matmul_grouped, moe_combine,
 * pixel_shuffle) on the CPU backend against naive double-precision references, including the
 * edges the model goldens do not reach: ties in the router, top-k > 1, experts nobody picks,
 * strided rows, a shuffle factor other than 2, and argument errors. The CUDA versions are held to
 * these CPU kernels by tests/unit/gpu/ops_check.c. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"

static uint64_t g_rng = 0x2545F4914F6CDD1Dull;
static float frand(void)
{
    g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17;
    return (float)((g_rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}
static void fill(float *x, size_t n) { for (size_t i = 0; i < n; i++) x[i] = frand(); }

static prism_backend_t *be;
static int setup(void **s) { be = prism_backend_cpu_create(2); return be ? 0 : -1; }
static int teardown(void **s) { prism_backend_destroy(be); return 0; }

static void test_head_rmsnorm(void **state)
{
    enum { T = 3, NH = 4, HD = 10, LD = NH * HD + 7 };
    float x[T * LD], y[T * LD], w[HD];
    fill(x, T * LD);
    fill(w, HD);
    for (int with_w = 0; with_w < 2; with_w++) {
        memcpy(y, x, sizeof x);
        assert_int_equal(be->i.head_rmsnorm(be->ctx, y, LD, T, NH, HD, with_w ? w : NULL, 1e-5f), PRISM_OK);
        for (int t = 0; t < T; t++) {
            for (int h = 0; h < NH; h++) {
                const float *a = x + t * LD + h * HD;
                double ss = 0;
                for (int i = 0; i < HD; i++) ss += (double)a[i] * a[i];
                double inv = 1.0 / sqrt(ss / HD + 1e-5);
                for (int i = 0; i < HD; i++)
                    assert_true(fabs(y[t * LD + h * HD + i] - a[i] * inv * (with_w ? w[i] : 1.0)) < 1e-5);
            }
            /* the row tail beyond the heads is untouched */
            assert_memory_equal(y + t * LD + NH * HD, x + t * LD + NH * HD, 7 * sizeof(float));
        }
    }
    assert_int_equal(be->i.head_rmsnorm(be->ctx, y, NH * HD - 1, T, NH, HD, NULL, 1e-5f), PRISM_EINVAL);
}

static void test_scale_rows(void **state)
{
    enum { R = 4, D = 6, LD = 9 };
    float x[R * LD], y[R * LD], s[R] = {0.5f, -2.0f, 0.0f, 1.25f};
    fill(x, R * LD);
    memcpy(y, x, sizeof x);
    assert_int_equal(be->i.scale_rows(be->ctx, y, LD, R, D, s), PRISM_OK);
    for (int r = 0; r < R; r++)
        for (int i = 0; i < LD; i++) assert_true(y[r * LD + i] == (i < D ? x[r * LD + i] * s[r] : x[r * LD + i]));
    assert_int_equal(be->i.scale_rows(be->ctx, y, D - 1, R, D, s), PRISM_EINVAL);
}

/* Router: top-k by logit (ties to the lower expert), sigmoid scores, rows grouped by expert in
 * token order, slot maps (token, choice) -> row. */
static void test_moe_route(void **state)
{
    enum { T = 7, E = 5, K = 2 };
    float lg[T * E];
    fill(lg, T * E);
    lg[0 * E + 1] = lg[0 * E + 3] = 3.0f;   /* token 0: a tie for first place -> expert 1, then 3 */
    for (int e = 0; e < E; e++) lg[4 * E + e] = 0.25f;   /* token 4: all equal -> experts 0, 1 */
    for (int t = 0; t < T; t++) lg[t * E + 2] = -5.0f;    /* expert 2 never chosen */
    int32_t choice[T * K], order[T * K], off[E + 1], slot[T * K];
    float wt[T * K];
    assert_int_equal(be->i.moe_route(be->ctx, lg, T, E, K, choice, order, wt, off, slot), PRISM_OK);
    assert_int_equal(choice[0], 1);
    assert_int_equal(choice[1], 3);
    assert_int_equal(choice[4 * K], 0);
    assert_int_equal(choice[4 * K + 1], 1);
    assert_int_equal(off[0], 0);
    assert_int_equal(off[E], T * K);
    assert_int_equal(off[3] - off[2], 0);   /* the empty group */
    int seen[T * K] = {0};
    for (int t = 0; t < T; t++) {
        /* reference top-2 */
        int b0 = -1, b1 = -1;
        for (int e = 0; e < E; e++) if (b0 < 0 || lg[t * E + e] > lg[t * E + b0]) b0 = e;
        for (int e = 0; e < E; e++) if (e != b0 && (b1 < 0 || lg[t * E + e] > lg[t * E + b1])) b1 = e;
        int want[2] = {b0, b1};
        for (int i = 0; i < K; i++) {
            int e = choice[t * K + i], r = slot[t * K + i];
            assert_int_equal(e, want[i]);
            assert_true(r >= off[e] && r < off[e + 1]);
            assert_int_equal(order[r], t);
            assert_true(fabs(wt[r] - 1.0 / (1.0 + exp(-(double)lg[t * E + e]))) < 1e-6);
            seen[r]++;
        }
    }
    for (int r = 0; r < T * K; r++) assert_int_equal(seen[r], 1);
    for (int e = 0; e < E; e++)
        for (int r = off[e] + 1; r < off[e + 1]; r++) assert_true(order[r] > order[r - 1]);   /* token order */
    assert_int_equal(be->i.moe_route(be->ctx, lg, T, E, E + 1, choice, order, wt, off, slot), PRISM_EINVAL);
    assert_int_equal(be->i.moe_route(be->ctx, lg, T, E, 0, choice, order, wt, off, slot), PRISM_EINVAL);
}

static void test_matmul_grouped_combine(void **state)
{
    enum { G = 4, M = 9, N = 6, K = 5, LDX = 8, LDY = 7 };
    int32_t off[G + 1] = {0, 3, 3, 8, 9};   /* group 1 empty */
    float x[M * LDX], w[G * K * N], y[M * LDY];
    fill(x, M * LDX);
    fill(w, G * K * N);
    for (int i = 0; i < M * LDY; i++) y[i] = 99.0f;
    assert_int_equal(be->i.matmul_grouped(be->ctx, y, LDY, x, LDX, w, PRISM_DTYPE_F32, off, G, M, N, K), PRISM_OK);
    for (int g = 0; g < G; g++)
        for (int r = off[g]; r < off[g + 1]; r++)
            for (int j = 0; j < LDY; j++) {
                if (j >= N) { assert_true(y[r * LDY + j] == 99.0f); continue; }
                double a = 0;
                for (int k = 0; k < K; k++) a += (double)x[r * LDX + k] * w[(g * K + k) * N + j];   /* x @ W_g */
                assert_true(fabs(y[r * LDY + j] - a) < 1e-5);
            }
    int32_t bad[G + 1] = {0, 3, 2, 8, 9};
    assert_int_equal(be->i.matmul_grouped(be->ctx, y, LDY, x, LDX, w, PRISM_DTYPE_F32, bad, G, M, N, K), PRISM_EINVAL);
    int32_t short_off[G + 1] = {0, 3, 3, 8, 8};
    assert_int_equal(be->i.matmul_grouped(be->ctx, y, LDY, x, LDX, w, PRISM_DTYPE_F32, short_off, G, M, N, K), PRISM_EINVAL);

    /* combine: 3 tokens, top-2, src rows in any order */
    enum { T = 3, KK = 2, D = 4, LD = 6 };
    float src[T * KK * D], acc[T * LD], ref[T * LD];
    fill(src, T * KK * D);
    fill(acc, T * LD);
    memcpy(ref, acc, sizeof acc);
    int32_t slot[T * KK] = {5, 0, 2, 3, 1, 4};
    assert_int_equal(be->i.moe_combine(be->ctx, acc, LD, src, slot, T, KK, D), PRISM_OK);
    for (int t = 0; t < T; t++)
        for (int d = 0; d < LD; d++) {
            float want = ref[t * LD + d];
            if (d < D) want += src[slot[t * KK] * D + d] + src[slot[t * KK + 1] * D + d];
            assert_true(fabs(acc[t * LD + d] - want) < 1e-6);
        }
}

/* Shapes big enough that the ops split over threads: column slices of the grouped GEMM (N not a
 * multiple of 16, a one-row group on the sgemv path, an empty group, strided x and y), rows of the
 * head norm, scaling and combine; 1 and 4 threads against a double reference, and each other. */
static void test_split_over_threads(void **state)
{
    enum { G = 4, M = 40, N = 200, K = 300, LDX = 310, LDY = 210 };
    int32_t off[G + 1] = {0, 1, 1, 33, 40};
    float *x = malloc(sizeof(float) * M * LDX), *w = malloc(sizeof(float) * G * K * N);
    float *y1 = malloc(sizeof(float) * M * LDY), *y4 = malloc(sizeof(float) * M * LDY);
    assert_non_null(x);
    assert_non_null(w);
    assert_non_null(y1);
    assert_non_null(y4);
    fill(x, (size_t)M * LDX);
    fill(w, (size_t)G * K * N);
    prism_backend_t *b1 = prism_backend_cpu_create(1), *b4 = prism_backend_cpu_create(4);
    assert_non_null(b1);
    assert_non_null(b4);
    for (int i = 0; i < M * LDY; i++) y1[i] = y4[i] = 99.0f;
    assert_int_equal(b1->i.matmul_grouped(b1->ctx, y1, LDY, x, LDX, w, PRISM_DTYPE_F32, off, G, M, N, K), PRISM_OK);
    assert_int_equal(b4->i.matmul_grouped(b4->ctx, y4, LDY, x, LDX, w, PRISM_DTYPE_F32, off, G, M, N, K), PRISM_OK);
    for (int g = 0; g < G; g++)
        for (int r = off[g]; r < off[g + 1]; r++)
            for (int j = 0; j < LDY; j++) {
                if (j >= N) {
                    assert_true(y1[r * LDY + j] == 99.0f && y4[r * LDY + j] == 99.0f);
                    continue;
                }
                double a = 0, mag = 0;
                for (int k = 0; k < K; k++) {
                    double p = (double)x[r * LDX + k] * w[((size_t)g * K + k) * N + j];
                    a += p;
                    mag += fabs(p);
                }
                assert_true(fabs(y1[r * LDY + j] - a) <= 1e-6 * mag + 1e-6);
                assert_true(fabs(y4[r * LDY + j] - a) <= 1e-6 * mag + 1e-6);
            }

    /* head norm (with and without weight), row scaling, combine: 1 thread equals 4 bit for bit */
    enum { T = 300, NH = 8, HD = 72, LD = NH * HD + 5, KK = 2 };
    float *h1 = malloc(sizeof(float) * T * LD), *h4 = malloc(sizeof(float) * T * LD);
    float *h0 = malloc(sizeof(float) * T * LD);
    float *src = malloc(sizeof(float) * T * KK * LD), hw[HD], sc[T];
    int32_t *slot = malloc(sizeof(int32_t) * T * KK);
    assert_non_null(h1);
    assert_non_null(h4);
    assert_non_null(h0);
    assert_non_null(src);
    assert_non_null(slot);
    fill(h1, (size_t)T * LD);
    fill(hw, HD);
    fill(sc, T);
    fill(src, (size_t)T * KK * LD);
    for (int i = 0; i < T * KK; i++) slot[i] = (i * 7 + 3) % (T * KK);   /* a permutation */
    memcpy(h4, h1, sizeof(float) * T * LD);
    memcpy(h0, h1, sizeof(float) * T * LD);
    for (int pass = 0; pass < 2; pass++) {
        const float *wt = pass ? hw : NULL;
        assert_int_equal(b1->i.head_rmsnorm(b1->ctx, h1, LD, T, NH, HD, wt, 1e-5f), PRISM_OK);
        assert_int_equal(b4->i.head_rmsnorm(b4->ctx, h4, LD, T, NH, HD, wt, 1e-5f), PRISM_OK);
    }
    assert_memory_equal(h1, h4, sizeof(float) * T * LD);
    /* against double: each head normed twice, the second time with the weight */
    for (int t = 0; t < T; t++)
        for (int h = 0; h < NH; h++) {
            double v[HD];
            for (int i = 0; i < HD; i++) v[i] = h0[t * LD + h * HD + i];
            for (int pass = 0; pass < 2; pass++) {
                double ss = 0;
                for (int i = 0; i < HD; i++) ss += v[i] * v[i];
                double inv = 1.0 / sqrt(ss / HD + 1e-5);
                for (int i = 0; i < HD; i++) v[i] = v[i] * inv * (pass ? hw[i] : 1.0);
            }
            for (int i = 0; i < HD; i++) assert_true(fabs(h4[t * LD + h * HD + i] - v[i]) < 1e-5);
        }
    memcpy(h0, h4, sizeof(float) * T * LD);
    assert_int_equal(b1->i.scale_rows(b1->ctx, h1, LD, T, NH * HD, sc), PRISM_OK);
    assert_int_equal(b4->i.scale_rows(b4->ctx, h4, LD, T, NH * HD, sc), PRISM_OK);
    assert_memory_equal(h1, h4, sizeof(float) * T * LD);
    assert_int_equal(b1->i.moe_combine(b1->ctx, h1, LD, src, slot, T, KK, NH * HD), PRISM_OK);
    assert_int_equal(b4->i.moe_combine(b4->ctx, h4, LD, src, slot, T, KK, NH * HD), PRISM_OK);
    assert_memory_equal(h1, h4, sizeof(float) * T * LD);
    for (int t = 0; t < T; t++)
        for (int j = 0; j < LD; j++) {
            float want = h0[t * LD + j];   /* padding past each row is never touched */
            if (j < NH * HD)
                want = h0[t * LD + j] * sc[t] + src[(size_t)slot[t * KK] * (NH * HD) + j] +
                       src[(size_t)slot[t * KK + 1] * (NH * HD) + j];
            assert_true(fabsf(h4[t * LD + j] - want) < 1e-5f);
        }

    free(x); free(w); free(y1); free(y4); free(h0); free(h1); free(h4); free(src); free(slot);
    prism_backend_destroy(b1);
    prism_backend_destroy(b4);
}

static void test_pixel_shuffle(void **state)
{
    /* 2 images of a 6x6 grid plus one extra (CLS) row each, C = 3, factors 2 and 3. */
    enum { NI = 2, G = 6, C = 3, ROWS = G * G + 1 };
    float x[NI * ROWS * C], out[NI * G * G * C];
    for (int i = 0; i < NI * ROWS * C; i++) x[i] = (float)i;
    for (int s = 2; s <= 3; s++) {
        int go = G / s;
        memset(out, 0, sizeof out);
        assert_int_equal(be->i.pixel_shuffle(be->ctx, out, x, NI, ROWS, G, C, s), PRISM_OK);
        for (int i = 0; i < NI; i++)
            for (int h2 = 0; h2 < go; h2++)
                for (int w2 = 0; w2 < go; w2++)
                    for (int dh = 0; dh < s; dh++)
                        for (int dw = 0; dw < s; dw++)
                            for (int c = 0; c < C; c++)
                                assert_true(out[((i * go * go + h2 * go + w2) * s * s + dh * s + dw) * C + c] ==
                                            x[(i * ROWS + (s * h2 + dh) * G + s * w2 + dw) * C + c]);
    }
    assert_int_equal(be->i.pixel_shuffle(be->ctx, out, x, NI, ROWS, G, C, 4), PRISM_EINVAL);   /* 6 % 4 */
    assert_int_equal(be->i.pixel_shuffle(be->ctx, out, x, NI, G * G - 1, G, C, 2), PRISM_EINVAL);
}

int main(void)
{
    prism_log_init("test_backend_llama4_ops", PRISM_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_head_rmsnorm),
        cmocka_unit_test(test_scale_rows),
        cmocka_unit_test(test_moe_route),
        cmocka_unit_test(test_matmul_grouped_combine),
        cmocka_unit_test(test_split_over_threads),
        cmocka_unit_test(test_pixel_shuffle),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
