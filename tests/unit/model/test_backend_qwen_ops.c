/* The Qwen-VL backend ops (rope_multi, attn_varlen, add_rows) on the CPU backend against naive
 * double-precision references: M-RoPE sections in runs and interleaved, the vision towers' 2D
 * table, strided rows; varlen attention over windows of uneven length (empty ones included), GQA,
 * a sequence longer than a key tile, and argument errors; DeepStack's row adds (strided source,
 * rows out of order, skipped rows). The CUDA versions are held to these CPU
 * kernels by tests/unit/gpu/ops_check.c. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static float frand(void)
{
    g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17;
    return (float)((g_rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}
static void fill(float *x, size_t n) { for (size_t i = 0; i < n; i++) x[i] = frand(); }

static prism_backend_t *be;
static int setup(void **s) { be = prism_backend_cpu_create(2); return be ? 0 : -1; }
static int teardown(void **s) { prism_backend_destroy(be); return 0; }

static void check_rope(int T, int NH, int HD, int LD, int n_sec, const prism_rope_sections_t *sec)
{
    float *x = malloc(sizeof(float) * T * LD), *y = malloc(sizeof(float) * T * LD), inv[256];
    int32_t *pos = malloc(sizeof(int32_t) * n_sec * (T + 3));
    fill(x, (size_t)T * LD);
    for (int j = 0; j < HD / 2; j++) inv[j] = 1.0f / powf(10000.0f, (float)(2 * j) / HD);
    for (int i = 0; i < n_sec * (T + 3); i++) pos[i] = (int32_t)((g_rng >> 20) % 5000) - 100 + i;
    memcpy(y, x, sizeof(float) * T * LD);
    assert_int_equal(be->i.rope_multi(be->ctx, y, LD, T, NH, HD, pos, T + 3, inv, sec), PRISM_OK);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < NH; h++) {
            const float *a = x + (size_t)t * LD + h * HD;
            const float *b = y + (size_t)t * LD + h * HD;
            for (int j = 0; j < HD / 2; j++) {
                double ang = (double)((float)pos[sec->of[j] * (T + 3) + t] * inv[j]);
                double c = cos(ang), s = sin(ang);
                assert_true(fabs(b[j] - (a[j] * c - a[j + HD / 2] * s)) < 2e-4);
                assert_true(fabs(b[j + HD / 2] - (a[j + HD / 2] * c + a[j] * s)) < 2e-4);
            }
        }
    for (int t = 0; t < T; t++)   /* the row tail beyond the heads is untouched */
        assert_memory_equal(y + (size_t)t * LD + NH * HD, x + (size_t)t * LD + NH * HD, sizeof(float) * (LD - NH * HD));
    free(x);
    free(y);
    free(pos);
}

static void test_rope_multi(void **state)
{
    prism_rope_sections_t s;
    /* M-RoPE, Qwen2.5-VL style runs [16, 24, 24] over 64 pairs */
    memset(&s, 0, sizeof s);
    for (int j = 0; j < 64; j++) s.of[j] = j < 16 ? 0 : j < 40 ? 1 : 2;
    check_rope(7, 3, 128, 3 * 128 + 5, 3, &s);
    /* interleaved (Qwen3-VL, [24, 20, 20]) */
    for (int j = 0; j < 64; j++) s.of[j] = (j % 3 == 1 && j < 60) ? 1 : (j % 3 == 2 && j < 60) ? 2 : 0;
    check_rope(5, 2, 128, 256, 3, &s);
    /* the vision tower's 2D table: rows then columns, head_dim 80 */
    for (int j = 0; j < 40; j++) s.of[j] = j < 20 ? 0 : 1;
    check_rope(33, 4, 80, 3 * 4 * 80, 2, &s);
    /* all from one row equals the plain rope */
    memset(&s, 0, sizeof s);
    enum { T = 4, NH = 2, HD = 16 };
    float x[T * NH * HD], y[T * NH * HD], inv[HD / 2];
    int32_t pos[T] = {0, 5, 9, 1000};
    fill(x, sizeof x / sizeof x[0]);
    for (int j = 0; j < HD / 2; j++) inv[j] = 1.0f / powf(10000.0f, (float)(2 * j) / HD);
    memcpy(y, x, sizeof x);
    assert_int_equal(be->i.rope_multi(be->ctx, x, NH * HD, T, NH, HD, pos, T, inv, &s), PRISM_OK);
    assert_int_equal(be->i.rope(be->ctx, y, NH * HD, T, NH, HD, HD, pos, inv, PRISM_ROPE_NEOX), PRISM_OK);
    assert_memory_equal(x, y, sizeof x);
    /* argument errors */
    s.of[3] = PRISM_ROPE_MAX_SECTIONS;
    assert_int_equal(be->i.rope_multi(be->ctx, x, NH * HD, T, NH, HD, pos, T, inv, &s), PRISM_EINVAL);
    s.of[3] = 0;
    assert_int_equal(be->i.rope_multi(be->ctx, x, NH * HD, T, NH, HD, pos, T - 1, inv, &s), PRISM_EINVAL);
    assert_int_equal(be->i.rope_multi(be->ctx, x, NH * HD, T, NH, 15, pos, T, inv, &s), PRISM_EINVAL);
    assert_int_equal(be->i.rope_multi(be->ctx, x, NH * HD, T, NH, HD, pos, T, inv, NULL), PRISM_EINVAL);
}

/* Naive attention of one sequence's rows [r0, r1), all heads. */
static void ref_attn(const float *q, int ldq, const float *k, int ldk, const float *v, int ldv, float *out, int ldo,
                     int r0, int r1, int NH, int NKV, int HD, float scale)
{
    int G = NH / NKV, n = r1 - r0;
    double *p = malloc(sizeof(double) * (n > 0 ? n : 1));
    for (int i = r0; i < r1; i++)
        for (int h = 0; h < NH; h++) {
            int g = h / G;
            double m = -INFINITY, sum = 0;
            for (int j = 0; j < n; j++) {
                double s = 0;
                for (int d = 0; d < HD; d++) s += (double)q[(size_t)i * ldq + h * HD + d] * k[(size_t)(r0 + j) * ldk + g * HD + d];
                p[j] = s * scale;
                if (p[j] > m) m = p[j];
            }
            for (int j = 0; j < n; j++) sum += p[j] = exp(p[j] - m);
            for (int d = 0; d < HD; d++) {
                double o = 0;
                for (int j = 0; j < n; j++) o += p[j] * v[(size_t)(r0 + j) * ldv + g * HD + d];
                out[(size_t)i * ldo + h * HD + d] = (float)(o / sum);
            }
        }
    free(p);
}

static void check_varlen(const int32_t *cu, int n_seqs, int NH, int NKV, int HD, bool fused)
{
    int T = cu[n_seqs], max_len = 0;
    for (int s = 0; s < n_seqs; s++) max_len = cu[s + 1] - cu[s] > max_len ? cu[s + 1] - cu[s] : max_len;
    int ldq = fused ? (NH + 2 * NKV) * HD : NH * HD, ldk = fused ? ldq : NKV * HD, ldo = NH * HD + 3;
    float *qkv = malloc(sizeof(float) * T * ldq), *kb = malloc(sizeof(float) * T * ldk), *vb = malloc(sizeof(float) * T * ldk);
    float *out = malloc(sizeof(float) * T * ldo), *want = malloc(sizeof(float) * T * ldo);
    fill(qkv, (size_t)T * ldq);
    fill(kb, (size_t)T * ldk);
    fill(vb, (size_t)T * ldk);
    const float *q = qkv, *k = fused ? qkv + NH * HD : kb, *v = fused ? qkv + (NH + NKV) * HD : vb;
    float scale = 1.0f / sqrtf((float)HD);
    for (int i = 0; i < T * ldo; i++) out[i] = want[i] = 7.0f;
    assert_int_equal(be->i.attn_varlen(be->ctx, out, ldo, q, ldq, k, ldk, v, ldk, cu, n_seqs, max_len, NH, NKV, HD, scale),
                     PRISM_OK);
    for (int s = 0; s < n_seqs; s++) ref_attn(q, ldq, k, ldk, v, ldk, want, ldo, cu[s], cu[s + 1], NH, NKV, HD, scale);
    for (int i = 0; i < T * ldo; i++)
        if (!(fabsf(out[i] - want[i]) < 2e-5f)) fail_msg("out[%d] = %g, want %g", i, out[i], want[i]);
    free(qkv);
    free(kb);
    free(vb);
    free(out);
    free(want);
}

static void test_attn_varlen(void **state)
{
    /* Qwen2.5-VL windows: 64 patches, edge windows smaller, an empty one (unique_consecutive keeps
     * none, but an empty sequence must be harmless) */
    static const int32_t win[] = {0, 64, 128, 144, 144, 208, 240, 241};
    check_varlen(win, 7, 4, 4, 16, true);
    /* one long sequence (a full-attention layer over one image): several key tiles */
    static const int32_t full[] = {0, 700};
    check_varlen(full, 1, 2, 2, 80, true);
    /* GQA, separate k / v buffers, two images */
    static const int32_t two[] = {0, 37, 101};
    check_varlen(two, 2, 6, 2, 32, false);
    /* argument errors */
    float x[64];
    static const int32_t bad[] = {0, 5, 3};
    assert_int_equal(be->i.attn_varlen(be->ctx, x, 8, x, 8, x, 8, x, 8, bad, 2, 8, 1, 1, 8, 1.0f), PRISM_EINVAL);
    static const int32_t over[] = {0, 9};
    assert_int_equal(be->i.attn_varlen(be->ctx, x, 8, x, 8, x, 8, x, 8, over, 1, 8, 1, 1, 8, 1.0f), PRISM_EINVAL);
    assert_int_equal(be->i.attn_varlen(be->ctx, x, 8, x, 8, x, 8, x, 8, NULL, 1, 8, 1, 1, 8, 1.0f), PRISM_EINVAL);
    assert_int_equal(be->i.attn_varlen(be->ctx, x, 8, x, 8, x, 8, x, 8, over, 1, 9, 3, 2, 8, 1.0f), PRISM_EINVAL);
}

static void test_add_rows(void **state)
{
    enum { T = 9, D = 20, LDY = 24, LDS = 50, N = 5 };
    float y[T * LDY], y0[T * LDY], src[N * LDS];
    fill(y, T * LDY);
    fill(src, N * LDS);
    memcpy(y0, y, sizeof y);
    const int32_t rows[N] = {7, 2, -1, 0, 8};
    int32_t *d_rows = be->i.alloc(be->ctx, sizeof rows);
    float *d_y = be->i.alloc(be->ctx, sizeof y), *d_s = be->i.alloc(be->ctx, sizeof src);
    assert_int_equal(be->i.upload(be->ctx, d_rows, rows, sizeof rows), PRISM_OK);
    assert_int_equal(be->i.upload(be->ctx, d_y, y, sizeof y), PRISM_OK);
    assert_int_equal(be->i.upload(be->ctx, d_s, src, sizeof src), PRISM_OK);
    assert_int_equal(be->i.add_rows(be->ctx, d_y, LDY, d_s, LDS, d_rows, N, D), PRISM_OK);
    assert_int_equal(be->i.download(be->ctx, y, d_y, sizeof y), PRISM_OK);
    for (int t = 0; t < T; t++)
        for (int j = 0; j < LDY; j++) {
            float want = y0[t * LDY + j];
            for (int i = 0; i < N; i++)
                if (rows[i] == t && j < D) want += src[i * LDS + j];
            assert_true(y[t * LDY + j] == want);   /* one add per element: exact */
        }
    assert_int_equal(be->i.add_rows(be->ctx, d_y, D - 1, d_s, LDS, d_rows, N, D), PRISM_EINVAL);
    be->i.free(be->ctx, d_rows);
    be->i.free(be->ctx, d_y);
    be->i.free(be->ctx, d_s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rope_multi),
        cmocka_unit_test(test_attn_varlen),
        cmocka_unit_test(test_add_rows),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
