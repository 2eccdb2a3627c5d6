/* Backend-consistency checks: see ops_check.h. Each check builds host inputs from a seeded
 * generator, runs the op on both backends through the prism_backend_i table only, and compares.
 *
 * Tolerances (reference = CPU backend, fp32, OpenBLAS or naive GEMM):
 *  - fp32 elementwise / norms / RoPE / attention: |d - r| <= 1e-5 * |r| + atol, atol 2e-5..1e-4
 *    (summation order, fp32 vs double accumulators, 1-2 ulp differences in expf/erff/sincosf).
 *  - matmul with bf16 weights: the reference gets the SAME bf16-rounded weights as fp32, so the
 *    only extra error is the device rounding x to bf16 (unit roundoff 2^-9) before the tensor-core
 *    GEMM: error ~ 2^-9/sqrt(3) * sqrt(sum_k (x_k w_k)^2); we allow max|d - r| <= 1e-2 * rms(r)
 *    (about 9 standard deviations at rms-sized outputs).
 *  - copies, gathers, KV transfers, argmax: exact. */
#include "ops_check.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef PRISM_OPCHECK_CUDA
#include "backend/cuda/cuda_backend.h"
#include "sample/sample.h"
#endif

const char *const prism_opcheck_ops[] = {
    "copy", "matmul", "rmsnorm", "layernorm", "rope", "act", "silu_mul", "add", "scale", "get_rows",
    "im2patch", "kv", "attn_paged", "attn_decode", "attn_dense", "argmax", "fill_random", "sample", "scatter_rows",
    "head_rmsnorm", "scale_rows", "moe", "pixel_shuffle", "rope_multi", "attn_varlen", "add_rows", "logits_processors", NULL,
};

/* ---------------------------------------------------------------- helpers */

typedef struct {
    prism_opcheck_t *t;
    prism_backend_t *ref, *dev;
    const char *op;
    uint64_t rng;
    int case_fail;       /* failures in the current op */
} ck_t;

static float frand(ck_t *c)
{
    c->rng ^= c->rng << 13;
    c->rng ^= c->rng >> 7;
    c->rng ^= c->rng << 17;
    return (float)((c->rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}
static int irand(ck_t *c, int n) { return (int)(((frand(c) + 1.0f) * 0.5f) * (float)n) % (n > 0 ? n : 1); }

static float *hrand(ck_t *c, size_t n, float scale)
{
    float *p = malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) p[i] = frand(c) * scale;
    return p;
}

static float bf16_round(float f) { return prism_bf16_to_f32(prism_f32_to_bf16(f)); }

/* alloc + upload of raw bytes on one backend */
static void *put(prism_backend_t *be, const void *host, size_t bytes)
{
    void *d = prism_backend_buf_alloc(be, bytes ? bytes : 4);
    if (!d) return NULL;
    if (host && bytes && be->i.upload(be->ctx, d, host, bytes) != PRISM_OK) {
        prism_backend_buf_free(be, d);
        return NULL;
    }
    return d;
}

static void *get(prism_backend_t *be, const void *dev, size_t bytes)
{
    void *h = malloc(bytes ? bytes : 4);
    be->i.synchronize(be->ctx);
    if (be->i.download(be->ctx, h, dev, bytes) != PRISM_OK) memset(h, 0xff, bytes);
    return h;
}

static void report(ck_t *c, bool ok, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void report(ck_t *c, bool ok, const char *fmt, ...)
{
    char msg[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (ok) {
        c->t->n_pass++;
    } else {
        c->t->n_fail++;
        c->case_fail++;
        if (!c->t->first_fail[0]) snprintf(c->t->first_fail, sizeof c->t->first_fail, "%s: %s", c->op, msg);
    }
    if (c->t->out && (c->t->verbose || !ok)) fprintf(c->t->out, "  %s %-12s %s\n", ok ? "ok  " : "FAIL", c->op, msg);
}

/* Elementwise |d - r| <= atol + rtol |r|; NaN anywhere fails. */
static bool close_f32(ck_t *c, const char *what, const float *r, const float *d, size_t n, double atol, double rtol)
{
    double worst = 0, worst_ratio = 0;
    size_t at = 0;
    bool ok = true;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)d[i] - r[i]), lim = atol + rtol * fabs((double)r[i]);
        if (!(e <= lim)) {
            if (ok || !(e / lim <= worst_ratio)) { worst_ratio = e / lim; at = i; }
            ok = false;
        }
        if (e > worst) worst = e;
    }
    if (ok) report(c, true, "%s max_err %.3g", what, worst);
    else report(c, false, "%s [%zu] ref %.6g dev %.6g (max_err %.3g, atol %.2g rtol %.2g)", what, at, r[at], d[at],
                worst, atol, rtol);
    return ok;
}

static double rms(const float *x, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)x[i] * x[i];
    return n ? sqrt(s / (double)n) : 0;
}

#define BOTH(call_ref, call_dev)                                                                      \
    do {                                                                                              \
        int rr_ = (call_ref), rd_ = (call_dev);                                                       \
        if (rr_ != PRISM_OK || rd_ != PRISM_OK) report(c, false, "%s: status ref %d dev %d", #call_dev, rr_, rd_); \
    } while (0)

/* ---------------------------------------------------------------- copy / memset / 2d */

static void check_copy(ck_t *c)
{
    size_t n = 100003;
    float *h = hrand(c, n, 3.0f);
    float *d0 = put(c->dev, h, n * 4), *d1 = put(c->dev, NULL, n * 4);
    c->dev->i.copy(c->dev->ctx, d1, d0, n * 4);
    float *back = get(c->dev, d1, n * 4);
    report(c, memcmp(back, h, n * 4) == 0, "upload/copy/download %zu floats", n);
    free(back);
    c->dev->i.memset0(c->dev->ctx, (char *)d1 + 40, 400);
    back = get(c->dev, d1, n * 4);
    bool z = true;
    for (int i = 10; i < 110; i++) z = z && back[i] == 0.0f;
    report(c, z && back[9] == h[9] && back[110] == h[110], "memset0 window");
    free(back);
    /* copy_2d: 37 rows of 13 floats from stride 29 to stride 17 */
    c->dev->i.copy_2d(c->dev->ctx, d1, 17 * 4, d0, 29 * 4, 13 * 4, 37);
    back = get(c->dev, d1, 37 * 17 * 4);
    bool ok = true;
    for (int r = 0; r < 37; r++)
        for (int j = 0; j < 13; j++) ok = ok && back[r * 17 + j] == h[r * 29 + j];
    report(c, ok, "copy_2d 37x13");
    free(back);
    /* upload_convert in the backend's weight dtype, read back through get_rows */
    size_t rows = 7, dim = 129;
    prism_dtype_t wdt = c->dev->weight_dtype;
    void *tab = put(c->dev, NULL, rows * dim * prism_dtype_size(wdt));
    c->dev->i.upload_convert(c->dev->ctx, tab, wdt, h, rows * dim);
    int32_t ids[7] = {6, 0, 3, 3, 1, 5, 2};
    int32_t *dids = put(c->dev, ids, sizeof ids);
    c->dev->i.get_rows(c->dev->ctx, d1, tab, wdt, (int)rows, dids, 7, (int)dim);
    back = get(c->dev, d1, 7 * dim * 4);
    ok = true;
    for (int i = 0; i < 7; i++)
        for (size_t j = 0; j < dim; j++) {
            float want = h[(size_t)ids[i] * dim + j];
            if (wdt == PRISM_DTYPE_BF16) want = bf16_round(want);
            if (wdt == PRISM_DTYPE_F16) want = prism_f16_to_f32(prism_f32_to_f16(want));
            ok = ok && back[i * dim + j] == want;
        }
    report(c, ok, "upload_convert(%s) + get_rows round trip", prism_dtype_name(wdt));
    free(back);
    prism_backend_buf_free(c->dev, dids);
    prism_backend_buf_free(c->dev, tab);
    prism_backend_buf_free(c->dev, d0);
    prism_backend_buf_free(c->dev, d1);
    free(h);
}

/* ---------------------------------------------------------------- matmul */

static void matmul_case(ck_t *c, int M, int N, int K, int pad_x, int pad_y, bool bias, bool acc)
{
    int ldx = K + pad_x, ldy = N + pad_y;
    prism_dtype_t wdt = c->dev->weight_dtype;
    float *x = hrand(c, (size_t)M * ldx, 1.0f), *w = hrand(c, (size_t)N * K, 0.5f), *b = hrand(c, (size_t)N, 1.0f);
    float *y0 = hrand(c, (size_t)M * ldy, 1.0f);
    if (wdt == PRISM_DTYPE_BF16) for (size_t i = 0; i < (size_t)N * K; i++) w[i] = bf16_round(w[i]);
    if (wdt == PRISM_DTYPE_F16) for (size_t i = 0; i < (size_t)N * K; i++) w[i] = prism_f16_to_f32(prism_f32_to_f16(w[i]));
    float *rx = put(c->ref, x, (size_t)M * ldx * 4), *rw = put(c->ref, w, (size_t)N * K * 4);
    float *rb = put(c->ref, b, (size_t)N * 4), *ry = put(c->ref, y0, (size_t)M * ldy * 4);
    float *dx = put(c->dev, x, (size_t)M * ldx * 4), *db = put(c->dev, b, (size_t)N * 4);
    float *dy = put(c->dev, y0, (size_t)M * ldy * 4);
    void *dw = put(c->dev, NULL, (size_t)N * K * prism_dtype_size(wdt));
    c->dev->i.upload_convert(c->dev->ctx, dw, wdt, w, (size_t)N * K);
    BOTH(c->ref->i.matmul(c->ref->ctx, ry, ldy, rx, ldx, rw, PRISM_DTYPE_F32, bias ? rb : NULL, M, N, K, acc),
         c->dev->i.matmul(c->dev->ctx, dy, ldy, dx, ldx, dw, wdt, bias ? db : NULL, M, N, K, acc));
    float *hr = get(c->ref, ry, (size_t)M * ldy * 4), *hd = get(c->dev, dy, (size_t)M * ldy * 4);
    /* padding columns must be untouched */
    bool pad_ok = true;
    for (int r = 0; r < M; r++)
        for (int j = N; j < ldy; j++) pad_ok = pad_ok && hd[(size_t)r * ldy + j] == y0[(size_t)r * ldy + j];
    char what[96];
    snprintf(what, sizeof what, "M%d N%d K%d ldx%d ldy%d%s%s %s", M, N, K, ldx, ldy, bias ? " +b" : "", acc ? " +=" : "",
             prism_dtype_name(wdt));
    double tol = wdt == PRISM_DTYPE_F32 ? 1e-5 : 1e-2;
    close_f32(c, what, hr, hd, (size_t)M * ldy, tol * (rms(hr, (size_t)M * ldy) + 1e-3), wdt == PRISM_DTYPE_F32 ? 1e-5 : 0);
    if (!pad_ok) report(c, false, "%s wrote outside N columns", what);
    free(hr); free(hd);
    prism_backend_buf_free(c->ref, rx); prism_backend_buf_free(c->ref, rw); prism_backend_buf_free(c->ref, rb); prism_backend_buf_free(c->ref, ry);
    prism_backend_buf_free(c->dev, dx); prism_backend_buf_free(c->dev, dw); prism_backend_buf_free(c->dev, db); prism_backend_buf_free(c->dev, dy);
    free(x); free(w); free(b); free(y0);
}

static void check_matmul(ck_t *c)
{
    matmul_case(c, 1, 1, 1, 0, 0, false, false);
    matmul_case(c, 3, 5, 7, 0, 0, true, false);
    matmul_case(c, 17, 33, 65, 3, 5, false, true);
    matmul_case(c, 64, 128, 256, 0, 0, true, true);
    matmul_case(c, 1, 1000, 513, 0, 0, false, false);     /* decode-shaped, odd K */
    matmul_case(c, 130, 257, 300, 1, 0, true, false);     /* nothing a multiple of a tile */
    matmul_case(c, 8, 4096, 512, 0, 0, false, true);
    if (c->t->big) {
        matmul_case(c, 1, 4096, 4096, 0, 0, false, false);
        matmul_case(c, 77, 6144, 1024, 0, 0, false, false);
        matmul_case(c, 512, 1024, 1024, 0, 0, true, true);
    }
}

/* ---------------------------------------------------------------- norms */

static void norm_case(ck_t *c, bool layer, int rows, int dim, bool in_place, bool affine)
{
    size_t n = (size_t)rows * dim;
    float *x = hrand(c, n, 2.0f), *w = hrand(c, (size_t)dim, 1.0f), *b = hrand(c, (size_t)dim, 0.5f);
    for (size_t i = 0; i < n; i++) x[i] += 0.3f;   /* non-zero mean for layernorm */
    float *rx = put(c->ref, x, n * 4), *ry = in_place ? rx : put(c->ref, NULL, n * 4);
    float *rw = put(c->ref, w, (size_t)dim * 4), *rb = put(c->ref, b, (size_t)dim * 4);
    float *dx = put(c->dev, x, n * 4), *dy = in_place ? dx : put(c->dev, NULL, n * 4);
    float *dw = put(c->dev, w, (size_t)dim * 4), *db = put(c->dev, b, (size_t)dim * 4);
    if (layer)
        BOTH(c->ref->i.layernorm(c->ref->ctx, ry, rx, affine ? rw : NULL, affine ? rb : NULL, rows, dim, 1e-5f),
             c->dev->i.layernorm(c->dev->ctx, dy, dx, affine ? dw : NULL, affine ? db : NULL, rows, dim, 1e-5f));
    else
        BOTH(c->ref->i.rmsnorm(c->ref->ctx, ry, rx, rw, rows, dim, 1e-6f),
             c->dev->i.rmsnorm(c->dev->ctx, dy, dx, dw, rows, dim, 1e-6f));
    float *hr = get(c->ref, ry, n * 4), *hd = get(c->dev, dy, n * 4);
    char what[64];
    snprintf(what, sizeof what, "%dx%d%s%s", rows, dim, in_place ? " in-place" : "", affine ? "" : " no-affine");
    close_f32(c, what, hr, hd, n, 2e-5, 2e-5);
    free(hr); free(hd);
    prism_backend_buf_free(c->ref, rx); if (!in_place) prism_backend_buf_free(c->ref, ry);
    prism_backend_buf_free(c->ref, rw); prism_backend_buf_free(c->ref, rb);
    prism_backend_buf_free(c->dev, dx); if (!in_place) prism_backend_buf_free(c->dev, dy);
    prism_backend_buf_free(c->dev, dw); prism_backend_buf_free(c->dev, db);
    free(x); free(w); free(b);
}

static void check_rmsnorm(ck_t *c)
{
    norm_case(c, false, 1, 1, false, true);
    norm_case(c, false, 3, 4096, false, true);
    norm_case(c, false, 7, 257, true, true);
    norm_case(c, false, 33, 5120, false, true);
}

static void check_layernorm(ck_t *c)
{
    norm_case(c, true, 1, 3, false, true);
    norm_case(c, true, 5, 1024, false, true);
    norm_case(c, true, 577, 129, true, true);
    norm_case(c, true, 9, 1408, false, false);
}

/* ---------------------------------------------------------------- rope */

static void rope_case(ck_t *c, int T, int nh, int hd, int rot, int pad, prism_rope_mode_t mode, int max_pos)
{
    int ld = nh * hd + pad;
    size_t n = (size_t)T * ld;
    float *x = hrand(c, n, 1.0f);
    int32_t *pos = malloc((size_t)T * 4);
    for (int t = 0; t < T; t++) pos[t] = t == 0 ? max_pos : irand(c, max_pos + 1);
    float inv[256];
    for (int i = 0; i < rot / 2; i++) inv[i] = powf(500000.0f, -2.0f * i / rot) * (i % 3 == 0 ? 0.125f : 1.0f);
    float *rx = put(c->ref, x, n * 4), *dx = put(c->dev, x, n * 4);
    int32_t *rp = put(c->ref, pos, (size_t)T * 4), *dp = put(c->dev, pos, (size_t)T * 4);
    float *ri = put(c->ref, inv, (size_t)rot / 2 * 4), *di = put(c->dev, inv, (size_t)rot / 2 * 4);
    BOTH(c->ref->i.rope(c->ref->ctx, rx, ld, T, nh, hd, rot, rp, ri, mode),
         c->dev->i.rope(c->dev->ctx, dx, ld, T, nh, hd, rot, dp, di, mode));
    float *hr = get(c->ref, rx, n * 4), *hd_ = get(c->dev, dx, n * 4);
    char what[96];
    snprintf(what, sizeof what, "T%d nh%d hd%d rot%d ld%d %s pos<=%d", T, nh, hd, rot, ld,
             mode == PRISM_ROPE_NEOX ? "neox" : "interleave", max_pos);
    /* sincosf of angles up to ~1e5 rad: both sides are within an ulp of the true value. */
    close_f32(c, what, hr, hd_, n, 2e-5, 1e-5);
    free(hr); free(hd_);
    prism_backend_buf_free(c->ref, rx); prism_backend_buf_free(c->ref, rp); prism_backend_buf_free(c->ref, ri);
    prism_backend_buf_free(c->dev, dx); prism_backend_buf_free(c->dev, dp); prism_backend_buf_free(c->dev, di);
    free(x); free(pos);
}

static void check_rope(ck_t *c)
{
    rope_case(c, 1, 1, 2, 2, 0, PRISM_ROPE_NEOX, 0);
    rope_case(c, 37, 8, 128, 128, 0, PRISM_ROPE_NEOX, 8191);
    rope_case(c, 13, 4, 64, 64, 24, PRISM_ROPE_INTERLEAVE, 131071);
    rope_case(c, 5, 3, 88, 44, 8, PRISM_ROPE_INTERLEAVE, 600);   /* partial rotary, odd head count */
    rope_case(c, 9, 5, 30, 30, 2, PRISM_ROPE_NEOX, 2047);
}

/* ---------------------------------------------------------------- elementwise */

static void check_act(ck_t *c)
{
    static const char *names[] = {"none", "silu", "gelu_erf", "gelu_tanh", "quick_gelu", "relu"};
    size_t sizes[] = {1, 1000, 100003};
    for (int a = 0; a <= PRISM_ACT_RELU; a++)
        for (int s = 0; s < 3; s++) {
            size_t n = sizes[s];
            float *x = hrand(c, n, 8.0f);
            float *rx = put(c->ref, x, n * 4), *dx = put(c->dev, x, n * 4);
            float *ry = put(c->ref, NULL, n * 4), *dy = put(c->dev, NULL, n * 4);
            bool inplace = s == 1;
            BOTH(c->ref->i.act(c->ref->ctx, (prism_act_t)a, inplace ? rx : ry, rx, n),
                 c->dev->i.act(c->dev->ctx, (prism_act_t)a, inplace ? dx : dy, dx, n));
            float *hr = get(c->ref, inplace ? rx : ry, n * 4), *hd = get(c->dev, inplace ? dx : dy, n * 4);
            char what[64];
            snprintf(what, sizeof what, "%s n%zu%s", names[a], n, inplace ? " in-place" : "");
            close_f32(c, what, hr, hd, n, 1e-6, 1e-5);
            free(hr); free(hd); free(x);
            prism_backend_buf_free(c->ref, rx); prism_backend_buf_free(c->ref, ry);
            prism_backend_buf_free(c->dev, dx); prism_backend_buf_free(c->dev, dy);
        }
}

static void check_silu_mul(ck_t *c)
{
    int shapes[][3] = {{1, 1, 2}, {7, 688, 1376}, {3, 14336, 28672}, {5, 33, 70}};
    for (int s = 0; s < 4; s++) {
        int rows = shapes[s][0], dim = shapes[s][1], ld = shapes[s][2];
        size_t n = (size_t)rows * ld;
        float *g = hrand(c, n, 6.0f);
        float *rg = put(c->ref, g, n * 4), *dg = put(c->dev, g, n * 4);
        float *ro = put(c->ref, NULL, (size_t)rows * dim * 4), *dout = put(c->dev, NULL, (size_t)rows * dim * 4);
        BOTH(c->ref->i.silu_mul(c->ref->ctx, ro, rg, rg + (ld - dim), ld, rows, dim),
             c->dev->i.silu_mul(c->dev->ctx, dout, dg, dg + (ld - dim), ld, rows, dim));
        float *hr = get(c->ref, ro, (size_t)rows * dim * 4), *hd = get(c->dev, dout, (size_t)rows * dim * 4);
        char what[64];
        snprintf(what, sizeof what, "%dx%d ld%d", rows, dim, ld);
        close_f32(c, what, hr, hd, (size_t)rows * dim, 1e-6, 1e-5);
        free(hr); free(hd); free(g);
        prism_backend_buf_free(c->ref, rg); prism_backend_buf_free(c->ref, ro);
        prism_backend_buf_free(c->dev, dg); prism_backend_buf_free(c->dev, dout);
    }
}

static void check_add(ck_t *c)
{
    size_t cases[][2] = {{1, 1}, {100003, 100003}, {577 * 129, 129}, {4096 * 3, 4096 * 3}, {1000, 7 * 5}};
    for (int s = 0; s < 5; s++) {
        size_t n = cases[s][0], nb = cases[s][1];
        if (n % nb) n -= n % nb;
        float *a = hrand(c, n, 1.0f), *b = hrand(c, nb, 1.0f);
        float *ra = put(c->ref, a, n * 4), *rb = put(c->ref, b, nb * 4), *da = put(c->dev, a, n * 4), *db = put(c->dev, b, nb * 4);
        BOTH(c->ref->i.add(c->ref->ctx, ra, ra, rb, n, nb), c->dev->i.add(c->dev->ctx, da, da, db, n, nb));
        float *hr = get(c->ref, ra, n * 4), *hd = get(c->dev, da, n * 4);
        char what[64];
        snprintf(what, sizeof what, "n%zu nb%zu", n, nb);
        close_f32(c, what, hr, hd, n, 0, 0);
        free(hr); free(hd); free(a); free(b);
        prism_backend_buf_free(c->ref, ra); prism_backend_buf_free(c->ref, rb);
        prism_backend_buf_free(c->dev, da); prism_backend_buf_free(c->dev, db);
    }
}

static void check_scale(ck_t *c)
{
    size_t n = 65537;
    float *a = hrand(c, n, 3.0f);
    float *ra = put(c->ref, a, n * 4), *da = put(c->dev, a, n * 4);
    BOTH(c->ref->i.scale(c->ref->ctx, ra, ra, -0.37f, n), c->dev->i.scale(c->dev->ctx, da, da, -0.37f, n));
    float *hr = get(c->ref, ra, n * 4), *hd = get(c->dev, da, n * 4);
    close_f32(c, "n65537 s-0.37", hr, hd, n, 0, 0);
    free(hr); free(hd); free(a);
    prism_backend_buf_free(c->ref, ra);
    prism_backend_buf_free(c->dev, da);
}

/* ---------------------------------------------------------------- gathers */

static void check_get_rows(ck_t *c)
{
    int n_table = 1001, dim = 257, n = 67;
    float *tab = hrand(c, (size_t)n_table * dim, 2.0f);
    int32_t ids[67];
    for (int i = 0; i < n; i++) ids[i] = irand(c, n_table);
    ids[3] = -1;
    ids[4] = n_table;   /* out of range -> zero rows */
    ids[5] = n_table - 1;
    prism_dtype_t dts[3] = {PRISM_DTYPE_F32, PRISM_DTYPE_BF16, PRISM_DTYPE_F16};
    for (int k = 0; k < 3; k++) {
        prism_dtype_t dt = dts[k];
        size_t tb = (size_t)n_table * dim * prism_dtype_size(dt);
        void *rt = put(c->ref, NULL, tb), *dtb = put(c->dev, NULL, tb);
        c->ref->i.upload_convert(c->ref->ctx, rt, dt, tab, (size_t)n_table * dim);
        c->dev->i.upload_convert(c->dev->ctx, dtb, dt, tab, (size_t)n_table * dim);
        int32_t *ri = put(c->ref, ids, sizeof ids), *di = put(c->dev, ids, sizeof ids);
        float *ro = put(c->ref, NULL, (size_t)n * dim * 4), *dout = put(c->dev, NULL, (size_t)n * dim * 4);
        BOTH(c->ref->i.get_rows(c->ref->ctx, ro, rt, dt, n_table, ri, n, dim),
             c->dev->i.get_rows(c->dev->ctx, dout, dtb, dt, n_table, di, n, dim));
        float *hr = get(c->ref, ro, (size_t)n * dim * 4), *hd = get(c->dev, dout, (size_t)n * dim * 4);
        char what[64];
        snprintf(what, sizeof what, "%s table %dx%d n%d (2 out of range)", prism_dtype_name(dt), n_table, dim, n);
        close_f32(c, what, hr, hd, (size_t)n * dim, 0, 0);
        bool zero = true;
        for (int j = 0; j < dim; j++) zero = zero && hd[3 * dim + j] == 0.0f && hd[4 * dim + j] == 0.0f;
        if (!zero) report(c, false, "%s: out-of-range ids must give zero rows", what);
        free(hr); free(hd);
        prism_backend_buf_free(c->ref, rt); prism_backend_buf_free(c->ref, ri); prism_backend_buf_free(c->ref, ro);
        prism_backend_buf_free(c->dev, dtb); prism_backend_buf_free(c->dev, di); prism_backend_buf_free(c->dev, dout);
    }
    free(tab);
}

static void check_im2patch(ck_t *c)
{
    int cases[][5] = {{2, 3, 28, 42, 14}, {1, 1, 5, 10, 5}, {3, 3, 112, 112, 14}, {1, 3, 336, 336, 14}};
    for (int s = 0; s < 4; s++) {
        int B = cases[s][0], C = cases[s][1], H = cases[s][2], W = cases[s][3], p = cases[s][4];
        size_t n = (size_t)B * C * H * W;
        float *px = hrand(c, n, 1.0f);
        float *rp = put(c->ref, px, n * 4), *dp = put(c->dev, px, n * 4);
        float *ro = put(c->ref, NULL, n * 4), *dout = put(c->dev, NULL, n * 4);
        BOTH(c->ref->i.im2patch(c->ref->ctx, ro, rp, B, C, H, W, p), c->dev->i.im2patch(c->dev->ctx, dout, dp, B, C, H, W, p));
        float *hr = get(c->ref, ro, n * 4), *hd = get(c->dev, dout, n * 4);
        char what[64];
        snprintf(what, sizeof what, "%dx%dx%dx%d p%d", B, C, H, W, p);
        close_f32(c, what, hr, hd, n, 0, 0);
        free(hr); free(hd); free(px);
        prism_backend_buf_free(c->ref, rp); prism_backend_buf_free(c->ref, ro);
        prism_backend_buf_free(c->dev, dp); prism_backend_buf_free(c->dev, dout);
    }
}

/* ---------------------------------------------------------------- KV write + block transfer */

static void check_kv(ck_t *c)
{
    int nkv = 3, hd = 40, bs = 7, nb = 23, T = 19, ld = 2 * nkv * hd + 5;
    size_t row = (size_t)nkv * hd, cache_n = (size_t)nb * bs * row;
    float *k = hrand(c, (size_t)T * ld, 1.0f), *zero = calloc(cache_n, 4);
    int32_t slots[19];
    for (int t = 0; t < T; t++) slots[t] = t == 4 ? -1 : (t * 37 + 5) % (nb * bs);
    float *rk = put(c->ref, k, (size_t)T * ld * 4), *dk = put(c->dev, k, (size_t)T * ld * 4);
    float *rkc = put(c->ref, zero, cache_n * 4), *rvc = put(c->ref, zero, cache_n * 4);
    float *dkc = put(c->dev, zero, cache_n * 4), *dvc = put(c->dev, zero, cache_n * 4);
    int32_t *rs = put(c->ref, slots, sizeof slots), *ds = put(c->dev, slots, sizeof slots);
    BOTH(c->ref->i.kv_write(c->ref->ctx, rkc, rvc, rk, rk + row, ld, rs, T, nkv, hd),
         c->dev->i.kv_write(c->dev->ctx, dkc, dvc, dk, dk + row, ld, ds, T, nkv, hd));
    float *hr = get(c->ref, rkc, cache_n * 4), *hd_ = get(c->dev, dkc, cache_n * 4);
    close_f32(c, "kv_write K (slot -1 skipped)", hr, hd_, cache_n, 0, 0);
    free(hr); free(hd_);
    hr = get(c->ref, rvc, cache_n * 4);
    hd_ = get(c->dev, dvc, cache_n * 4);
    close_f32(c, "kv_write V", hr, hd_, cache_n, 0, 0);
    free(hd_);

    /* export blocks with a host stride, import them into other blocks, export again */
    size_t bb = (size_t)bs * row * 4, stride = bb + 64;
    int32_t ids[5] = {22, 0, 7, 7, 13}, ids2[5] = {1, 2, 3, 4, 5};
    uint8_t *h1 = calloc(5, stride), *h2 = calloc(5, stride);
    int rc = c->dev->i.blocks_to_host(c->dev->ctx, h1, stride, dvc, bb, ids, 5);
    bool ok = rc == PRISM_OK;
    for (int i = 0; i < 5 && ok; i++) ok = memcmp(h1 + i * stride, (uint8_t *)hr + (size_t)ids[i] * bb, bb) == 0;
    report(c, ok, "blocks_to_host 5 blocks of %zu bytes, host stride %zu", bb, stride);
    rc = c->dev->i.blocks_from_host(c->dev->ctx, dvc, bb, ids2, 5, h1, stride);
    c->dev->i.synchronize(c->dev->ctx);
    rc |= c->dev->i.blocks_to_host(c->dev->ctx, h2, bb, dvc, bb, ids2, 5);
    ok = rc == PRISM_OK;
    for (int i = 0; i < 5 && ok; i++) ok = memcmp(h2 + i * bb, h1 + i * stride, bb) == 0;
    report(c, ok, "blocks_from_host round trip (contiguous export)");
    free(h1); free(h2); free(hr);
    prism_backend_buf_free(c->ref, rk); prism_backend_buf_free(c->ref, rkc); prism_backend_buf_free(c->ref, rvc); prism_backend_buf_free(c->ref, rs);
    prism_backend_buf_free(c->dev, dk); prism_backend_buf_free(c->dev, dkc); prism_backend_buf_free(c->dev, dvc); prism_backend_buf_free(c->dev, ds);
    free(k); free(zero);
}

/* ---------------------------------------------------------------- attention */

typedef struct {
    int S, nh, nkv, hd, bs;
    const int *pos0, *qlen;
    int chunk;   /* chunked attention (0 = plain causal) */
} paged_case_t;

static void attn_paged_case(ck_t *c, const paged_case_t *pc, bool decode)
{
    int S = pc->S, nh = pc->nh, nkv = pc->nkv, hd = pc->hd, bs = pc->bs;
    int32_t *seq_start = malloc((size_t)(S + 1) * 4), *pos0 = malloc((size_t)S * 4);
    seq_start[0] = 0;
    int max_q = 0, max_ctx = 0, mbps = 1;
    for (int s = 0; s < S; s++) {
        seq_start[s + 1] = seq_start[s] + pc->qlen[s];
        pos0[s] = pc->pos0[s];
        int ctx = pc->pos0[s] + pc->qlen[s];
        max_q = PRISM_MAX(max_q, pc->qlen[s]);
        max_ctx = PRISM_MAX(max_ctx, ctx);
        mbps = PRISM_MAX(mbps, (ctx + bs - 1) / bs);
    }
    int T = seq_start[S];
    int nb = S * mbps + 3;
    int32_t *tables = malloc((size_t)S * mbps * 4);
    /* a permutation of blocks so sequences interleave in the cache */
    for (int i = 0; i < S * mbps; i++) tables[i] = (int32_t)((i * 7 + 3) % (S * mbps));
    size_t cache_n = (size_t)nb * bs * nkv * hd;
    int ldq = (nh + 2 * nkv) * hd + 3, ldo = nh * hd + 1;
    float *kc = hrand(c, cache_n, 1.0f), *vc = hrand(c, cache_n, 1.0f), *q = hrand(c, (size_t)T * ldq, 1.0f);
    prism_attn_meta_t mr = {S, T, max_q, max_ctx, bs, mbps, NULL, NULL, NULL, pc->chunk}, md = mr;
    mr.seq_start = put(c->ref, seq_start, (size_t)(S + 1) * 4);
    mr.pos0 = put(c->ref, pos0, (size_t)S * 4);
    mr.block_tables = put(c->ref, tables, (size_t)S * mbps * 4);
    md.seq_start = put(c->dev, seq_start, (size_t)(S + 1) * 4);
    md.pos0 = put(c->dev, pos0, (size_t)S * 4);
    md.block_tables = put(c->dev, tables, (size_t)S * mbps * 4);
    float *rk = put(c->ref, kc, cache_n * 4), *rv = put(c->ref, vc, cache_n * 4), *rq = put(c->ref, q, (size_t)T * ldq * 4);
    float *dk = put(c->dev, kc, cache_n * 4), *dv = put(c->dev, vc, cache_n * 4), *dq = put(c->dev, q, (size_t)T * ldq * 4);
    float *ro = put(c->ref, NULL, (size_t)T * ldo * 4), *dout = put(c->dev, NULL, (size_t)T * ldo * 4);
    c->ref->i.memset0(c->ref->ctx, ro, (size_t)T * ldo * 4);
    c->dev->i.memset0(c->dev->ctx, dout, (size_t)T * ldo * 4);
    float scale = 1.0f / sqrtf((float)hd);
    int (*fn)(void *, float *, int, const float *, int, const float *, const float *, const prism_attn_meta_t *, int,
              int, int, float) = decode && c->dev->i.attn_decode ? c->dev->i.attn_decode : c->dev->i.attn_paged;
    BOTH(c->ref->i.attn_paged(c->ref->ctx, ro, ldo, rq, ldq, rk, rv, &mr, nh, nkv, hd, scale),
         fn(c->dev->ctx, dout, ldo, dq, ldq, dk, dv, &md, nh, nkv, hd, scale));
    float *hr = get(c->ref, ro, (size_t)T * ldo * 4), *hd_ = get(c->dev, dout, (size_t)T * ldo * 4);
    char what[128];
    snprintf(what, sizeof what, "S%d T%d nh%d nkv%d hd%d bs%d max_ctx%d chunk%d%s", S, T, nh, nkv, hd, bs, max_ctx,
             pc->chunk, decode ? " (decode)" : "");
    close_f32(c, what, hr, hd_, (size_t)T * ldo, 5e-5, 1e-4);
    free(hr); free(hd_);
    prism_backend_buf_free(c->ref, (void *)mr.seq_start); prism_backend_buf_free(c->ref, (void *)mr.pos0);
    prism_backend_buf_free(c->ref, (void *)mr.block_tables);
    prism_backend_buf_free(c->dev, (void *)md.seq_start); prism_backend_buf_free(c->dev, (void *)md.pos0);
    prism_backend_buf_free(c->dev, (void *)md.block_tables);
    prism_backend_buf_free(c->ref, rk); prism_backend_buf_free(c->ref, rv); prism_backend_buf_free(c->ref, rq); prism_backend_buf_free(c->ref, ro);
    prism_backend_buf_free(c->dev, dk); prism_backend_buf_free(c->dev, dv); prism_backend_buf_free(c->dev, dq); prism_backend_buf_free(c->dev, dout);
    free(kc); free(vc); free(q); free(seq_start); free(pos0); free(tables);
}

static void check_attn_paged(ck_t *c)
{
    /* prefill, decode and mid-block chunks mixed; GQA 4 and 1; hd not a multiple of 4 */
    int p1[3] = {0, 9, 3}, q1[3] = {6, 1, 10};
    attn_paged_case(c, &(paged_case_t){3, 4, 2, 8, 4, p1, q1}, false);
    int p2[2] = {0, 100}, q2[2] = {70, 33};
    attn_paged_case(c, &(paged_case_t){2, 32, 8, 128, 16, p2, q2}, false);
    int p3[4] = {5, 0, 31, 64}, q3[4] = {1, 45, 2, 17};
    attn_paged_case(c, &(paged_case_t){4, 6, 6, 30, 7, p3, q3}, false);
    int p4[1] = {0}, q4[1] = {300};
    attn_paged_case(c, &(paged_case_t){1, 8, 1, 64, 16, p4, q4}, false);   /* MQA, long causal prefill */
    int p5[2] = {0, 0}, q5[2] = {1, 1};
    attn_paged_case(c, &(paged_case_t){2, 2, 1, 256, 16, p5, q5}, false);  /* max head_dim, single keys */
    /* chunked attention: prefill chunks crossing chunk boundaries (mid-block too), decode steps */
    int p6[4] = {5, 64, 0, 95}, q6[4] = {40, 1, 130, 1};
    attn_paged_case(c, &(paged_case_t){4, 8, 2, 64, 16, p6, q6, 32}, false);
    attn_paged_case(c, &(paged_case_t){4, 6, 6, 30, 7, p3, q3, 20}, false);
}

static void check_attn_decode(ck_t *c)
{
    int p1[5] = {0, 1, 16, 700, 3000}, q1[5] = {1, 1, 1, 1, 1};
    attn_paged_case(c, &(paged_case_t){5, 32, 8, 128, 16, p1, q1}, true);   /* split-K on the long ones */
    int p2[1] = {4100}, q2[1] = {1};
    attn_paged_case(c, &(paged_case_t){1, 8, 2, 64, 16, p2, q2}, true);     /* batch 1, long context */
    int p3[3] = {17, 2, 129}, q3[3] = {1, 1, 1};
    attn_paged_case(c, &(paged_case_t){3, 12, 3, 36, 5, p3, q3}, true);
    int p4[4] = {3000, 4095, 4096, 8191}, q4[4] = {1, 1, 1, 1};         /* chunked: split-K below the chunk */
    attn_paged_case(c, &(paged_case_t){4, 8, 2, 64, 16, p4, q4, 4096}, true);
    attn_paged_case(c, &(paged_case_t){5, 12, 3, 36, 5, p1, q1, 100}, true);
}

static void attn_dense_case(ck_t *c, int S, int L, int nh, int nkv, int hd, bool causal, bool fused)
{
    /* fused: q|k|v in one row (the ViT's qkv GEMM output), else three separate strided arrays */
    int ldq = fused ? (nh + 2 * nkv) * hd : nh * hd + 4, ldk = fused ? ldq : nkv * hd + 8, ldv = fused ? ldq : nkv * hd;
    size_t T = (size_t)S * L;
    float *q = hrand(c, T * ldq, 1.0f), *k = hrand(c, T * ldk, 1.0f), *v = hrand(c, T * ldv, 1.0f);
    float *rq = put(c->ref, q, T * ldq * 4), *dq = put(c->dev, q, T * ldq * 4);
    float *rk = fused ? rq + nh * hd : put(c->ref, k, T * ldk * 4), *dk = fused ? dq + nh * hd : put(c->dev, k, T * ldk * 4);
    float *rv = fused ? rq + (nh + nkv) * hd : put(c->ref, v, T * ldv * 4);
    float *dv = fused ? dq + (nh + nkv) * hd : put(c->dev, v, T * ldv * 4);
    int ldo = nh * hd;
    float *ro = put(c->ref, NULL, T * ldo * 4), *dout = put(c->dev, NULL, T * ldo * 4);
    float scale = 1.0f / sqrtf((float)hd);
    BOTH(c->ref->i.attn_dense(c->ref->ctx, ro, ldo, rq, ldq, rk, ldk, rv, ldv, S, L, nh, nkv, hd, scale, causal),
         c->dev->i.attn_dense(c->dev->ctx, dout, ldo, dq, ldq, dk, ldk, dv, ldv, S, L, nh, nkv, hd, scale, causal));
    float *hr = get(c->ref, ro, T * ldo * 4), *hd_ = get(c->dev, dout, T * ldo * 4);
    char what[96];
    snprintf(what, sizeof what, "S%d L%d nh%d nkv%d hd%d%s%s", S, L, nh, nkv, hd, causal ? " causal" : "",
             fused ? " fused-qkv" : "");
    close_f32(c, what, hr, hd_, T * ldo, 5e-5, 1e-4);
    free(hr); free(hd_);
    prism_backend_buf_free(c->ref, rq); prism_backend_buf_free(c->dev, dq);
    if (!fused) {
        prism_backend_buf_free(c->ref, rk); prism_backend_buf_free(c->ref, rv);
        prism_backend_buf_free(c->dev, dk); prism_backend_buf_free(c->dev, dv);
    }
    prism_backend_buf_free(c->ref, ro); prism_backend_buf_free(c->dev, dout);
    free(q); free(k); free(v);
}

static void check_attn_dense(ck_t *c)
{
    attn_dense_case(c, 2, 65, 4, 4, 32, false, true);      /* tiny-llava ViT shape */
    attn_dense_case(c, 1, 577, 4, 4, 64, false, true);     /* CLIP-L/336 sequence, 4 of 16 heads */
    attn_dense_case(c, 3, 33, 6, 2, 40, true, false);      /* causal + GQA + strided */
    attn_dense_case(c, 1, 1, 1, 1, 7, false, false);       /* single token, odd head_dim */
    if (c->t->big) attn_dense_case(c, 2, 577, 16, 16, 64, false, true);
}

/* ---------------------------------------------------------------- argmax */

static void check_argmax(ck_t *c)
{
    if (!c->dev->i.argmax) return;
    int rows = 9, vocab = 128257;
    float *l = hrand(c, (size_t)rows * vocab, 10.0f);
    l[0 * vocab + 5] = 50.0f; l[0 * vocab + 77] = 50.0f;               /* tie: first wins */
    l[1 * vocab + vocab - 1] = 99.0f;                                  /* last element */
    for (int j = 0; j < vocab; j++) l[2 * vocab + j] = -1.0f;          /* all equal -> 0 */
    l[3 * vocab + 0] = 1e30f;
    float *rl = put(c->ref, l, (size_t)rows * vocab * 4), *dl = put(c->dev, l, (size_t)rows * vocab * 4);
    int32_t ra[9], da[9];
    BOTH(c->ref->i.argmax(c->ref->ctx, ra, rl, rows, vocab), c->dev->i.argmax(c->dev->ctx, da, dl, rows, vocab));
    bool ok = memcmp(ra, da, sizeof ra) == 0 && da[0] == 5 && da[1] == vocab - 1 && da[2] == 0 && da[3] == 0;
    report(c, ok, "%d rows x %d (ties, last, constant) dev[0..3] = %d %d %d %d", rows, vocab, da[0], da[1], da[2], da[3]);
    prism_backend_buf_free(c->ref, rl);
    prism_backend_buf_free(c->dev, dl);
    free(l);
}

/* ---------------------------------------------------------------- fill_random */

/* Random weights made on the device must be exactly what the host loader computes (dtype.h):
 * CPU and GPU runs of --random-weights then load the same model. */
static void check_fill_random(ck_t *c)
{
    if (!c->dev->i.fill_random) return;
    size_t n = 1000003;
    uint64_t seed = 0x0123456789abcdefull;
    float *want = malloc(n * 4);
    double m = 0, v = 0;
    for (size_t i = 0; i < n; i++) {
        want[i] = 0.02f * prism_random_normalish(seed, i);
        m += want[i];
        v += (double)want[i] * want[i];
    }
    m /= (double)n;
    v = sqrt(v / (double)n - m * m);
    float *d = put(c->dev, NULL, n * 4);
    uint16_t *db = put(c->dev, NULL, n * 2);
    int rc = c->dev->i.fill_random(c->dev->ctx, d, PRISM_DTYPE_F32, n, seed, 0.02f);
    int rc2 = c->dev->i.fill_random(c->dev->ctx, db, PRISM_DTYPE_BF16, n, seed, 0.02f);
    float *h = get(c->dev, d, n * 4);
    uint16_t *hb = get(c->dev, db, n * 2);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += hb[i] != prism_f32_to_bf16(want[i]);
    report(c, rc == PRISM_OK && memcmp(h, want, n * 4) == 0, "f32: %zu values bit-identical to the host's", n);
    report(c, rc2 == PRISM_OK && bad == 0, "bf16: %zu of %zu values differ from the host's rounding", bad, n);
    report(c, fabs(m) < 1e-4 && fabs(v - 0.02) < 2e-4, "mean %.2g, std %.4g (want 0, 0.02)", m, v);
    free(want); free(h); free(hb);
    prism_backend_buf_free(c->dev, d);
    prism_backend_buf_free(c->dev, db);
}

/* ------------------------------------- device sampling (optional ops: the host's sampler is the reference)
 * and the CUDA-only extension (scatter_rows). Built where common/sample is linked. */

#ifdef PRISM_OPCHECK_CUDA
static void check_sample(ck_t *c)
{
    int rows = 64, vocab = 32003;
    prism_sampler_t sm;
    if (prism_sampler_init(&sm, vocab) != PRISM_OK) { report(c, false, "sampler init"); return; }
    float *l = hrand(c, (size_t)rows * vocab, 4.0f);
    float temp[64], top_p[64];
    int32_t top_k[64], cpu[64], gpu[64], gpu2[64];
    double u[64];
    for (int r = 0; r < rows; r++) {
        temp[r] = r % 8 == 0 ? 0.0f : 0.3f + 0.1f * (r % 13);
        top_k[r] = r % 5 == 1 ? 0 : r % 5 == 2 ? 1 : r % 5 == 3 ? 40 : 1000;
        top_p[r] = r % 3 == 0 ? 1.0f : r % 3 == 1 ? 0.9f : 0.5f;
        uint64_t st = prism_rng_seed(1234 + (uint64_t)r), st2 = st;
        prism_sample_params_t p = {temp[r], top_p[r], top_k[r]};
        cpu[r] = prism_sample(&sm, l + (size_t)r * vocab, &p, &st);
        u[r] = prism_rng_uniform(&st2);
    }
    /* Flat row: ties everywhere, top-p only (the CPU's quickselect keeps an arbitrary subset of
     * tied values under top-k, so that combination has no single right answer). */
    for (int j = 0; j < vocab; j++) l[(size_t)5 * vocab + j] = 0.25f;
    top_k[5] = 0;
    {
        uint64_t st = prism_rng_seed(1234 + 5);
        prism_sample_params_t p = {temp[5], top_p[5], top_k[5]};
        cpu[5] = prism_sample(&sm, l + (size_t)5 * vocab, &p, &st);
    }
    float *dl = put(c->dev, l, (size_t)rows * vocab * 4);
    prism_backend_sample_rows_t a = {temp, top_p, top_k, u};
    int rc = c->dev->i.sample(c->dev->ctx, gpu, dl, rows, vocab, &a);
    int rc2 = c->dev->i.sample(c->dev->ctx, gpu2, dl, rows, vocab, &a);
    int same = 0, greedy_ok = 1;
    for (int r = 0; r < rows; r++) {
        same += cpu[r] == gpu[r];
        if ((temp[r] <= 0 || top_k[r] == 1) && cpu[r] != gpu[r]) greedy_ok = 0;
    }
    report(c, rc == PRISM_OK && rc2 == PRISM_OK && memcmp(gpu, gpu2, sizeof gpu) == 0, "deterministic for a given uniform");
    report(c, greedy_ok, "greedy rows identical to prism_sample");
    /* fp32 expf may differ by an ulp between libm and CUDA: a draw landing exactly on a boundary
     * may pick the neighbour. 64 random draws essentially never do. */
    report(c, same >= rows - 1, "%d/%d rows identical to prism_sample (temperature, top-k, top-p mixes)", same, rows);
    prism_backend_buf_free(c->dev, dl);
    free(l);
    prism_sampler_free(&sm);
}

/* prism_grammar_apply_mask's rule, restated: the GPU kit builds this file without the grammar
 * library (and its jansson / tokenizer dependencies). */
static void mask_ref(float *l, const int32_t *mask, int vocab)
{
    for (int i = 0; i < vocab; i++)
        if (!(((uint32_t)mask[i >> 5] >> (i & 31)) & 1u)) l[i] = -INFINITY;
}

/* The device logits processors against the CPU reference (common/sample/logits.c and the grammar
 * mask rule) over one shared table layout: token counts added on the device equal
 * the host's, and penalties, logit bias and grammar masks give the same logits bit for bit
 * (each is one fp32 multiply / divide / subtract / add per element, in the same order). */
static void check_logits_processors(ck_t *c)
{
    int rows = 24, slots = 32, vocab = 32003, words = (vocab + 31) / 32;
    prism_token_counts_t tab;
    if (prism_token_counts_init(&tab, slots, vocab) != PRISM_OK) { report(c, false, "table init"); return; }
    int32_t row_slot[24], *toks = malloc(sizeof(int32_t) * 4096), *tslot = malloc(sizeof(int32_t) * 4096);
    prism_backend_penalty_row_t prm[24];
    int nt = 0;
    for (int r = 0; r < rows; r++) {
        row_slot[r] = (r * 7) % slots;
        int32_t prompt[64];
        for (int k = 0; k < 64; k++) prompt[k] = irand(c, vocab);
        prism_token_counts_reset(&tab, row_slot[r], prompt, r % 4 ? 64 : 0);
        prm[r] = (prism_backend_penalty_row_t){r % 3 ? 0.5f : 0.0f, r % 5 ? 0.25f : -0.75f, r % 2 ? 1.3f : 1.0f,
                                               r == 7 ? -1 : row_slot[r]};
        for (int k = 0; k < 100; k++) {       /* generated tokens: some repeated, some out of range */
            toks[nt] = k % 10 == 9 ? vocab + k : irand(c, 50 + r * 13);
            tslot[nt++] = row_slot[r];
        }
    }
    /* counts on the device from a cleared table + the same prompt bits */
    int32_t *dcounts = put(c->dev, NULL, (size_t)slots * vocab * 4);
    c->dev->i.memset0(c->dev->ctx, dcounts, (size_t)slots * vocab * 4);
    uint32_t *dbits = put(c->dev, tab.prompt, (size_t)slots * words * 4);
    int32_t *dtoks = put(c->dev, toks, (size_t)nt * 4), *dtslot = put(c->dev, tslot, (size_t)nt * 4);
    const prism_backend_i *o = &c->dev->i;
    int rc = o->token_counts_add(c->dev->ctx, dcounts, slots, vocab, dtslot, dtoks, nt);
    for (int i = 0; i < nt; i++) prism_token_counts_add(&tab, tslot[i], toks[i]);
    int32_t *hc = get(c->dev, dcounts, (size_t)slots * vocab * 4);
    report(c, rc == PRISM_OK && memcmp(hc, tab.counts, (size_t)slots * vocab * 4) == 0,
           "token counts: %d tokens into %d slots equal the host table", nt, slots);
    free(hc);
    /* penalties */
    float *l = hrand(c, (size_t)rows * vocab, 6.0f), *ref = malloc(sizeof(float) * (size_t)rows * vocab);
    memcpy(ref, l, sizeof(float) * (size_t)rows * vocab);
    for (int r = 0; r < rows; r++) {
        if (prm[r].slot < 0) continue;
        prism_penalty_params_t p = {prm[r].presence, prm[r].frequency, prm[r].repetition};
        prism_apply_penalties(ref + (size_t)r * vocab, vocab, prism_token_counts_row(&tab, prm[r].slot),
                              prism_token_counts_prompt(&tab, prm[r].slot), &p);
    }
    float *dl = put(c->dev, l, (size_t)rows * vocab * 4);
    prism_backend_penalty_row_t *dprm = put(c->dev, prm, sizeof prm);
    rc = o->penalties(c->dev->ctx, dl, rows, vocab, dcounts, dbits, dprm);
    float *h = get(c->dev, dl, (size_t)rows * vocab * 4);
    report(c, rc == PRISM_OK && memcmp(h, ref, sizeof(float) * (size_t)rows * vocab) == 0,
           "penalties: %d rows bit-identical to prism_apply_penalties (one row without a slot)", rows);
    free(h);
    /* logit bias, CSR over the rows (row 3 has none) */
    int32_t off[25], ids[24 * 5];
    float bias[24 * 5];
    int nb = 0;
    for (int r = 0; r < rows; r++) {
        off[r] = nb;
        for (int k = 0; r != 3 && k < 5; k++) {
            ids[nb] = k == 4 ? vocab + 1 : (r * 131 + k * 977) % vocab;
            bias[nb++] = (float)(irand(c, 201) - 100);
        }
        prism_apply_logit_bias(ref + (size_t)r * vocab, vocab, ids + off[r], bias + off[r], nb - off[r]);
    }
    off[rows] = nb;
    int32_t *doff = put(c->dev, off, sizeof off), *dids = put(c->dev, ids, (size_t)nb * 4);
    float *dbias = put(c->dev, bias, (size_t)nb * 4);
    rc = o->logit_bias(c->dev->ctx, dl, rows, vocab, doff, dids, dbias);
    h = get(c->dev, dl, (size_t)rows * vocab * 4);
    report(c, rc == PRISM_OK && memcmp(h, ref, sizeof(float) * (size_t)rows * vocab) == 0,
           "logit bias: %d entries over %d rows (ids past the vocabulary skipped)", nb, rows);
    free(h);
    /* grammar masks: 3 masks, rows pick one or none */
    int32_t *masks = malloc(sizeof(int32_t) * 3 * (size_t)words), mrow[24];
    for (size_t i = 0; i < 3 * (size_t)words; i++) masks[i] = (int32_t)(c->rng = c->rng * 6364136223846793005ull + 1) >> 7;
    for (int r = 0; r < rows; r++) {
        mrow[r] = r % 4 == 0 ? -1 : r % 3;
        if (mrow[r] >= 0) mask_ref(ref + (size_t)r * vocab, masks + (size_t)mrow[r] * words, vocab);
    }
    int32_t *dmasks = put(c->dev, masks, sizeof(int32_t) * 3 * (size_t)words), *dmrow = put(c->dev, mrow, sizeof mrow);
    rc = o->token_mask(c->dev->ctx, dl, rows, vocab, dmasks, words, dmrow);
    h = get(c->dev, dl, (size_t)rows * vocab * 4);
    report(c, rc == PRISM_OK && memcmp(h, ref, sizeof(float) * (size_t)rows * vocab) == 0,
           "grammar masks: %d rows, unmasked rows untouched", rows);
    free(h);
    /* the CPU backend provides none of them: the host's sampler is the reference */
    const prism_backend_i *r = &c->ref->i;
    report(c, !r->sample && !r->penalties && !r->token_counts_add && !r->logit_bias && !r->token_mask,
           "the CPU backend leaves the device sampling ops NULL");
    free(l); free(ref); free(masks); free(toks); free(tslot);
    prism_backend_buf_free(c->dev, dcounts); prism_backend_buf_free(c->dev, dbits);
    prism_backend_buf_free(c->dev, dtoks); prism_backend_buf_free(c->dev, dtslot);
    prism_backend_buf_free(c->dev, dl); prism_backend_buf_free(c->dev, dprm);
    prism_backend_buf_free(c->dev, doff); prism_backend_buf_free(c->dev, dids); prism_backend_buf_free(c->dev, dbias);
    prism_backend_buf_free(c->dev, dmasks); prism_backend_buf_free(c->dev, dmrow);
    prism_token_counts_free(&tab);
}

static void check_scatter_rows(ck_t *c)
{
    int T = 50, dim = 96, ld = 100, n = 12;
    float *x = hrand(c, (size_t)T * ld, 1.0f), *src = hrand(c, (size_t)n * dim, 1.0f);
    int32_t rows[12];
    for (int i = 0; i < n; i++) rows[i] = i == 7 ? -1 : 3 + 4 * i;
    float *dx = put(c->dev, x, (size_t)T * ld * 4), *ds = put(c->dev, src, (size_t)n * dim * 4);
    int32_t *dr = put(c->dev, rows, sizeof rows);
    int rc = prism_cuda_scatter_rows(c->dev, dx, ld, ds, dr, n, dim);
    float *h = get(c->dev, dx, (size_t)T * ld * 4);
    for (int i = 0; i < n; i++)
        if (rows[i] >= 0) memcpy(x + (size_t)rows[i] * ld, src + (size_t)i * dim, (size_t)dim * 4);
    report(c, rc == PRISM_OK && memcmp(h, x, (size_t)T * ld * 4) == 0, "12 rows into 50x%d (ld %d), one skipped", dim, ld);
    free(h); free(x); free(src);
    prism_backend_buf_free(c->dev, dx); prism_backend_buf_free(c->dev, ds); prism_backend_buf_free(c->dev, dr);
}
#endif

/* ---------------------------------------------------------------- Llama-4 ops */

static void check_head_rmsnorm(ck_t *c)
{
    if (!c->dev->i.head_rmsnorm) return;
    int shapes[][4] = {{1, 1, 2, 0}, {37, 40, 128, 0}, {5, 8, 128, 2048}, {9, 3, 88, 7}};   /* T, nh, hd, pad */
    for (int s = 0; s < 4; s++) {
        int T = shapes[s][0], nh = shapes[s][1], hd = shapes[s][2], ld = nh * hd + shapes[s][3];
        size_t n = (size_t)T * ld;
        float *x = hrand(c, n, 3.0f), *w = hrand(c, (size_t)hd, 1.0f);
        for (int with_w = 0; with_w < 2; with_w++) {
            float *rx = put(c->ref, x, n * 4), *dx = put(c->dev, x, n * 4);
            float *rw = put(c->ref, w, (size_t)hd * 4), *dw = put(c->dev, w, (size_t)hd * 4);
            BOTH(c->ref->i.head_rmsnorm(c->ref->ctx, rx, ld, T, nh, hd, with_w ? rw : NULL, 1e-5f),
                 c->dev->i.head_rmsnorm(c->dev->ctx, dx, ld, T, nh, hd, with_w ? dw : NULL, 1e-5f));
            float *hr = get(c->ref, rx, n * 4), *hd_ = get(c->dev, dx, n * 4);
            char what[64];
            snprintf(what, sizeof what, "T%d nh%d hd%d ld%d%s", T, nh, hd, ld, with_w ? " +w" : "");
            close_f32(c, what, hr, hd_, n, 2e-5, 2e-5);
            free(hr); free(hd_);
            prism_backend_buf_free(c->ref, rx); prism_backend_buf_free(c->ref, rw);
            prism_backend_buf_free(c->dev, dx); prism_backend_buf_free(c->dev, dw);
        }
        free(x); free(w);
    }
}

static void check_scale_rows(ck_t *c)
{
    if (!c->dev->i.scale_rows) return;
    int shapes[][3] = {{1, 1, 1}, {513, 5120, 5120}, {77, 1000, 1536}};   /* rows, dim, ld */
    for (int s = 0; s < 3; s++) {
        int R = shapes[s][0], D = shapes[s][1], ld = shapes[s][2];
        size_t n = (size_t)R * ld;
        float *x = hrand(c, n, 2.0f), *f = hrand(c, (size_t)R, 2.0f);
        float *rx = put(c->ref, x, n * 4), *dx = put(c->dev, x, n * 4), *rf = put(c->ref, f, (size_t)R * 4),
              *df = put(c->dev, f, (size_t)R * 4);
        BOTH(c->ref->i.scale_rows(c->ref->ctx, rx, ld, R, D, rf), c->dev->i.scale_rows(c->dev->ctx, dx, ld, R, D, df));
        float *hr = get(c->ref, rx, n * 4), *hd = get(c->dev, dx, n * 4);
        char what[64];
        snprintf(what, sizeof what, "%dx%d ld%d", R, D, ld);
        close_f32(c, what, hr, hd, n, 0, 0);
        free(hr); free(hd); free(x); free(f);
        prism_backend_buf_free(c->ref, rx); prism_backend_buf_free(c->ref, rf);
        prism_backend_buf_free(c->dev, dx); prism_backend_buf_free(c->dev, df);
    }
}

/* The MoE chain as the model runs it: route (exact ints, scores to float rounding), grouped GEMMs
 * with the same (dtype-rounded) expert weights, combine into a residual. */
static void moe_case(ck_t *c, int T, int E, int K, int H, int I)
{
    prism_dtype_t wdt = c->dev->weight_dtype;
    size_t R = (size_t)T * K;
    float *lg = hrand(c, (size_t)T * E, 3.0f), *x = hrand(c, (size_t)T * H, 1.0f);
    float *wgu = hrand(c, (size_t)E * H * 2 * I, 0.2f), *wd = hrand(c, (size_t)E * I * H, 0.2f), *res = hrand(c, (size_t)T * H, 1.0f);
    if (T > 2) for (int e = 0; e < E; e++) lg[(size_t)1 * E + e] = 0.5f;   /* a token with all-equal logits */
    for (size_t i = 0; i < (size_t)E * H * 2 * I; i++) wgu[i] = wdt == PRISM_DTYPE_F32 ? wgu[i] : bf16_round(wgu[i]);
    for (size_t i = 0; i < (size_t)E * I * H; i++) wd[i] = wdt == PRISM_DTYPE_F32 ? wd[i] : bf16_round(wd[i]);
    prism_backend_t *bes[2] = {c->ref, c->dev};
    float *out[2], *wts[2];
    int32_t *ints[2];
    for (int b = 0; b < 2; b++) {
        prism_backend_t *be = bes[b];
        prism_dtype_t dt = b ? wdt : PRISM_DTYPE_F32;
        float *dl = put(be, lg, (size_t)T * E * 4), *dx = put(be, x, (size_t)T * H * 4), *dres = put(be, res, (size_t)T * H * 4);
        int32_t *ch = put(be, NULL, R * 4), *ord = put(be, NULL, R * 4), *slot = put(be, NULL, R * 4), *off = put(be, NULL, ((size_t)E + 1) * 4);
        float *w = put(be, NULL, R * 4), *xs = put(be, NULL, R * H * 4), *gu = put(be, NULL, R * 2 * I * 4);
        float *act = put(be, NULL, R * I * 4), *ys = put(be, NULL, R * H * 4);
        void *dgu = put(be, NULL, (size_t)E * H * 2 * I * prism_dtype_size(dt)), *ddn = put(be, NULL, (size_t)E * I * H * prism_dtype_size(dt));
        be->i.upload_convert(be->ctx, dgu, dt, wgu, (size_t)E * H * 2 * I);
        be->i.upload_convert(be->ctx, ddn, dt, wd, (size_t)E * I * H);
        int rc = be->i.moe_route(be->ctx, dl, T, E, K, ch, ord, w, off, slot);
        if (rc == PRISM_OK) rc = be->i.get_rows(be->ctx, xs, dx, PRISM_DTYPE_F32, T, ord, (int)R, H);
        if (rc == PRISM_OK) rc = be->i.scale_rows(be->ctx, xs, H, (int)R, H, w);
        if (rc == PRISM_OK) rc = be->i.matmul_grouped(be->ctx, gu, 2 * I, xs, H, dgu, dt, off, E, (int)R, 2 * I, H);
        if (rc == PRISM_OK) rc = be->i.silu_mul(be->ctx, act, gu, gu + I, 2 * I, (int)R, I);
        if (rc == PRISM_OK) rc = be->i.matmul_grouped(be->ctx, ys, H, act, I, ddn, dt, off, E, (int)R, H, I);
        if (rc == PRISM_OK) rc = be->i.moe_combine(be->ctx, dres, H, ys, slot, T, K, H);
        if (rc != PRISM_OK) report(c, false, "%s backend: moe chain status %d", b ? "dev" : "ref", rc);
        out[b] = get(be, dres, (size_t)T * H * 4);
        wts[b] = get(be, w, R * 4);
        ints[b] = malloc((3 * R + E + 1) * 4);
        int32_t *h = get(be, ch, R * 4); memcpy(ints[b], h, R * 4); free(h);
        h = get(be, ord, R * 4); memcpy(ints[b] + R, h, R * 4); free(h);
        h = get(be, slot, R * 4); memcpy(ints[b] + 2 * R, h, R * 4); free(h);
        h = get(be, off, ((size_t)E + 1) * 4); memcpy(ints[b] + 3 * R, h, ((size_t)E + 1) * 4); free(h);
        void *ptrs[] = {dl, dx, dres, ch, ord, slot, off, w, xs, gu, act, ys, dgu, ddn};
        for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) prism_backend_buf_free(be, ptrs[i]);
    }
    char what[96];
    snprintf(what, sizeof what, "T%d E%d top%d H%d I%d %s routing", T, E, K, H, I, prism_dtype_name(wdt));
    report(c, memcmp(ints[0], ints[1], (3 * R + E + 1) * 4) == 0, "%s (choices, order, slots, offsets)", what);
    close_f32(c, "router scores", wts[0], wts[1], R, 1e-6, 1e-6);
    snprintf(what, sizeof what, "T%d E%d top%d H%d I%d %s output", T, E, K, H, I, prism_dtype_name(wdt));
    double tol = wdt == PRISM_DTYPE_F32 ? 1e-5 : 1e-2;
    close_f32(c, what, out[0], out[1], (size_t)T * H, tol * (rms(out[0], (size_t)T * H) + 1e-3), 1e-5);
    for (int b = 0; b < 2; b++) { free(out[b]); free(wts[b]); free(ints[b]); }
    free(lg); free(x); free(wgu); free(wd); free(res);
}

static void check_moe(ck_t *c)
{
    if (!c->dev->i.moe_route || !c->dev->i.matmul_grouped || !c->dev->i.moe_combine) return;
    moe_case(c, 1, 4, 1, 8, 4);          /* a decode step: one expert group used */
    moe_case(c, 37, 16, 1, 96, 40);      /* Scout-like top-1, groups of odd sizes, some empty */
    moe_case(c, 70, 5, 2, 48, 24);       /* top-2 */
    moe_case(c, 300, 128, 1, 64, 33);    /* Maverick's expert count, most groups tiny */
    if (c->t->big) moe_case(c, 512, 16, 1, 1024, 512);
}

static void check_pixel_shuffle(ck_t *c)
{
    if (!c->dev->i.pixel_shuffle) return;
    int cases[][4] = {{1, 2, 1, 2}, {3, 8, 48, 2}, {2, 24, 176, 2}, {2, 6, 5, 3}};   /* n_img, g, C, s */
    for (int k = 0; k < 4; k++) {
        int ni = cases[k][0], g = cases[k][1], C = cases[k][2], s = cases[k][3], rows = g * g + 1;
        size_t n = (size_t)ni * rows * C, no = (size_t)ni * g * g * C;
        float *x = hrand(c, n, 1.0f);
        float *rx = put(c->ref, x, n * 4), *dx = put(c->dev, x, n * 4), *ro = put(c->ref, NULL, no * 4), *dout = put(c->dev, NULL, no * 4);
        BOTH(c->ref->i.pixel_shuffle(c->ref->ctx, ro, rx, ni, rows, g, C, s),
             c->dev->i.pixel_shuffle(c->dev->ctx, dout, dx, ni, rows, g, C, s));
        float *hr = get(c->ref, ro, no * 4), *hd = get(c->dev, dout, no * 4);
        char what[64];
        snprintf(what, sizeof what, "%d images %dx%d C%d s%d", ni, g, g, C, s);
        close_f32(c, what, hr, hd, no, 0, 0);
        free(hr); free(hd); free(x);
        prism_backend_buf_free(c->ref, rx); prism_backend_buf_free(c->ref, ro);
        prism_backend_buf_free(c->dev, dx); prism_backend_buf_free(c->dev, dout);
    }
}

/* ---------------------------------------------------------------- Qwen-VL ops */

static void rope_multi_case(ck_t *c, int T, int nh, int hd, int pad, int n_sec, const prism_rope_sections_t *sec,
                            int max_pos, const char *name)
{
    int ld = nh * hd + pad, pos_ld = T + 3;
    size_t n = (size_t)T * ld;
    float *x = hrand(c, n, 1.0f);
    int32_t *pos = malloc((size_t)n_sec * pos_ld * 4);
    for (int i = 0; i < n_sec * pos_ld; i++) pos[i] = irand(c, max_pos + 1);
    float inv[256];
    for (int i = 0; i < hd / 2; i++) inv[i] = powf(1000000.0f, -2.0f * i / hd);
    float *rx = put(c->ref, x, n * 4), *dx = put(c->dev, x, n * 4);
    int32_t *rp = put(c->ref, pos, (size_t)n_sec * pos_ld * 4), *dp = put(c->dev, pos, (size_t)n_sec * pos_ld * 4);
    float *ri = put(c->ref, inv, (size_t)hd / 2 * 4), *di = put(c->dev, inv, (size_t)hd / 2 * 4);
    BOTH(c->ref->i.rope_multi(c->ref->ctx, rx, ld, T, nh, hd, rp, pos_ld, ri, sec),
         c->dev->i.rope_multi(c->dev->ctx, dx, ld, T, nh, hd, dp, pos_ld, di, sec));
    float *hr = get(c->ref, rx, n * 4), *hd_ = get(c->dev, dx, n * 4);
    char what[96];
    snprintf(what, sizeof what, "%s T%d nh%d hd%d ld%d pos<=%d", name, T, nh, hd, ld, max_pos);
    close_f32(c, what, hr, hd_, n, 2e-5, 1e-5);
    free(hr); free(hd_);
    prism_backend_buf_free(c->ref, rx); prism_backend_buf_free(c->ref, rp); prism_backend_buf_free(c->ref, ri);
    prism_backend_buf_free(c->dev, dx); prism_backend_buf_free(c->dev, dp); prism_backend_buf_free(c->dev, di);
    free(x); free(pos);
}

static void check_rope_multi(ck_t *c)
{
    if (!c->dev->i.rope_multi) return;
    prism_rope_sections_t s;
    memset(&s, 0, sizeof s);
    for (int j = 0; j < 64; j++) s.of[j] = j < 16 ? 0 : j < 40 ? 1 : 2;   /* Qwen2.5-VL M-RoPE [16, 24, 24] */
    rope_multi_case(c, 37, 7, 128, 0, 3, &s, 131071, "mrope");
    rope_multi_case(c, 5, 4, 128, 512, 3, &s, 2000, "mrope strided");
    for (int j = 0; j < 64; j++) s.of[j] = (j % 3 == 1 && j < 60) ? 1 : (j % 3 == 2 && j < 60) ? 2 : 0;
    rope_multi_case(c, 29, 8, 128, 0, 3, &s, 40000, "mrope interleaved");
    for (int j = 0; j < 40; j++) s.of[j] = j < 20 ? 0 : 1;   /* the tower's 2D table, head_dim 80 */
    rope_multi_case(c, 300, 16, 80, 2 * 16 * 80, 2, &s, 4096, "vision 2d");
}

static void attn_varlen_case(ck_t *c, const int32_t *cu, int n_seqs, int nh, int nkv, int hd, bool fused)
{
    int T = cu[n_seqs], max_len = 0;
    for (int s = 0; s < n_seqs; s++) max_len = cu[s + 1] - cu[s] > max_len ? cu[s + 1] - cu[s] : max_len;
    int ldq = fused ? (nh + 2 * nkv) * hd : nh * hd + 4, ldk = fused ? ldq : nkv * hd + 8, ldv = fused ? ldq : nkv * hd;
    float *q = hrand(c, (size_t)T * ldq, 1.0f), *k = hrand(c, (size_t)T * ldk, 1.0f), *v = hrand(c, (size_t)T * ldv, 1.0f);
    float *rq = put(c->ref, q, (size_t)T * ldq * 4), *dq = put(c->dev, q, (size_t)T * ldq * 4);
    float *rk = fused ? rq + nh * hd : put(c->ref, k, (size_t)T * ldk * 4);
    float *dk = fused ? dq + nh * hd : put(c->dev, k, (size_t)T * ldk * 4);
    float *rv = fused ? rq + (nh + nkv) * hd : put(c->ref, v, (size_t)T * ldv * 4);
    float *dv = fused ? dq + (nh + nkv) * hd : put(c->dev, v, (size_t)T * ldv * 4);
    int32_t *rc = put(c->ref, cu, (size_t)(n_seqs + 1) * 4), *dc = put(c->dev, cu, (size_t)(n_seqs + 1) * 4);
    int ldo = nh * hd;
    float *ro = put(c->ref, NULL, (size_t)T * ldo * 4), *dout = put(c->dev, NULL, (size_t)T * ldo * 4);
    float scale = 1.0f / sqrtf((float)hd);
    BOTH(c->ref->i.attn_varlen(c->ref->ctx, ro, ldo, rq, ldq, rk, ldk, rv, ldv, rc, n_seqs, max_len, nh, nkv, hd, scale),
         c->dev->i.attn_varlen(c->dev->ctx, dout, ldo, dq, ldq, dk, ldk, dv, ldv, dc, n_seqs, max_len, nh, nkv, hd, scale));
    float *hr = get(c->ref, ro, (size_t)T * ldo * 4), *hd_ = get(c->dev, dout, (size_t)T * ldo * 4);
    char what[96];
    snprintf(what, sizeof what, "%d seqs (max %d) T%d nh%d nkv%d hd%d%s", n_seqs, max_len, T, nh, nkv, hd,
             fused ? " fused-qkv" : "");
    close_f32(c, what, hr, hd_, (size_t)T * ldo, 5e-5, 1e-4);
    free(hr); free(hd_);
    prism_backend_buf_free(c->ref, rq); prism_backend_buf_free(c->dev, dq);
    if (!fused) {
        prism_backend_buf_free(c->ref, rk); prism_backend_buf_free(c->ref, rv);
        prism_backend_buf_free(c->dev, dk); prism_backend_buf_free(c->dev, dv);
    }
    prism_backend_buf_free(c->ref, rc); prism_backend_buf_free(c->dev, dc);
    prism_backend_buf_free(c->ref, ro); prism_backend_buf_free(c->dev, dout);
    free(q); free(k); free(v);
}

static void check_attn_varlen(ck_t *c)
{
    if (!c->dev->i.attn_varlen) return;
    /* Qwen2.5-VL windows of 64 patches, the edge ones smaller, an empty one */
    static const int32_t win[] = {0, 64, 128, 144, 144, 208, 240, 241};
    attn_varlen_case(c, win, 7, 16, 16, 80, true);
    /* full attention over two images of different sizes (one spans many key tiles) */
    static const int32_t two[] = {0, 1000, 1064};
    attn_varlen_case(c, two, 2, 4, 4, 80, true);
    /* GQA, strided separate k / v */
    static const int32_t gqa[] = {0, 37, 101, 102};
    attn_varlen_case(c, gqa, 3, 8, 2, 64, false);
    if (c->t->big) {   /* a 1036x1036 image's full-attention layer at the 7B tower's width */
        static const int32_t big[] = {0, 5476};
        attn_varlen_case(c, big, 1, 16, 16, 80, true);
    }
}

/* DeepStack's row adds: rows out of order, one skipped (-1), a strided source (the levels of one
 * embedding row); one add per element, so exact. */
static void check_add_rows(ck_t *c)
{
    if (!c->dev->i.add_rows) return;
    enum { T = 300, D = 4096, LDS = 3 * 4096, N = 130 };
    float *y = hrand(c, (size_t)T * D, 1.0f), *src = hrand(c, (size_t)N * LDS, 1.0f);
    int32_t rows[N];
    for (int i = 0; i < N; i++) rows[i] = i == 7 ? -1 : (T - 1 - 2 * i);
    float *ry = put(c->ref, y, (size_t)T * D * 4), *dy = put(c->dev, y, (size_t)T * D * 4);
    float *rs = put(c->ref, src, (size_t)N * LDS * 4), *ds = put(c->dev, src, (size_t)N * LDS * 4);
    int32_t *rr = put(c->ref, rows, sizeof rows), *dr = put(c->dev, rows, sizeof rows);
    BOTH(c->ref->i.add_rows(c->ref->ctx, ry, D, rs + D, LDS, rr, N, D),
         c->dev->i.add_rows(c->dev->ctx, dy, D, ds + D, LDS, dr, N, D));
    float *hr = get(c->ref, ry, (size_t)T * D * 4), *hd = get(c->dev, dy, (size_t)T * D * 4);
    close_f32(c, "130 rows of 4096 into 300, level 1 of 3", hr, hd, (size_t)T * D, 0, 0);
    free(hr); free(hd); free(y); free(src);
    prism_backend_buf_free(c->ref, ry); prism_backend_buf_free(c->ref, rs); prism_backend_buf_free(c->ref, rr);
    prism_backend_buf_free(c->dev, dy); prism_backend_buf_free(c->dev, ds); prism_backend_buf_free(c->dev, dr);
}

/* ---------------------------------------------------------------- driver */

typedef struct {
    const char *name;
    void (*fn)(ck_t *);
} op_entry_t;

void prism_opcheck_run(prism_opcheck_t *t, prism_backend_t *ref, prism_backend_t *dev, const char *only)
{
    static const op_entry_t ops[] = {
        {"copy", check_copy}, {"matmul", check_matmul}, {"rmsnorm", check_rmsnorm}, {"layernorm", check_layernorm},
        {"rope", check_rope}, {"act", check_act}, {"silu_mul", check_silu_mul}, {"add", check_add},
        {"scale", check_scale}, {"get_rows", check_get_rows}, {"im2patch", check_im2patch}, {"kv", check_kv},
        {"attn_paged", check_attn_paged}, {"attn_decode", check_attn_decode}, {"attn_dense", check_attn_dense},
        {"argmax", check_argmax}, {"fill_random", check_fill_random},
        {"head_rmsnorm", check_head_rmsnorm}, {"scale_rows", check_scale_rows}, {"moe", check_moe},
        {"pixel_shuffle", check_pixel_shuffle}, {"rope_multi", check_rope_multi}, {"attn_varlen", check_attn_varlen},
        {"add_rows", check_add_rows},
#ifdef PRISM_OPCHECK_CUDA
        {"sample", check_sample}, {"scatter_rows", check_scatter_rows}, {"logits_processors", check_logits_processors},
#endif
    };
    bool is_cuda = dev->device && strcmp(dev->device, "cuda") == 0;
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        if (only && strcmp(only, ops[i].name) != 0) continue;
        if (!strcmp(ops[i].name, "scatter_rows") && !is_cuda) continue;
        if (!strcmp(ops[i].name, "sample") && !dev->i.sample) continue;   /* optional ops the device lacks */
        if (!strcmp(ops[i].name, "logits_processors") && !dev->i.token_mask) continue;
        ck_t c = {t, ref, dev, ops[i].name, 0x9E3779B97F4A7C15ull ^ (uint64_t)(i * 7919 + 1), 0};
        double t0 = prism_now_s();
        ops[i].fn(&c);
        if (c.case_fail) t->ops_fail++;
        else t->ops_pass++;
        if (t->out) fprintf(t->out, "%s %-12s (%.2fs)\n", c.case_fail ? "FAIL" : "PASS", ops[i].name, prism_now_s() - t0);
        if (t->out) fflush(t->out);
    }
}
