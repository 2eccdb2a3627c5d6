/* CPU backend ops against naive double-precision references. These same checks are the template
 * for the backend-consistency test a CUDA backend must pass. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"

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

int main(void)
{
    prism_log_init("test_backend_cpu", PRISM_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attn_paged),
        cmocka_unit_test(test_attn_paged_chunked),
        cmocka_unit_test(test_attn_dense),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_norms_matmul_act),
        cmocka_unit_test(test_gathers_kv),
        cmocka_unit_test(test_half_conversions),
        cmocka_unit_test(test_pool_and_create),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
