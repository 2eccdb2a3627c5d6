/* Streaming separable resampler: Pillow / torch-exact coefficients, a ring of horizontal results,
 * scalar reference kernels and SSE2 / SSSE3 / AVX2 kernels that compute the same integers. */
#include "image/resample.h"

#include <math.h>
#include <pthread.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RS_X86 1
#else
#define RS_X86 0
#endif

#define PIL_PRECISION_BITS 22   /* Pillow Resample.c: 32 - 8 - 2 */
#define KPAD_ALIGN 16           /* coefficient rows: whole AVX2 vectors of int16 */
#define ROW_ALIGN 32            /* ring rows: whole AVX2 vectors of bytes */
#define PLANE_PAD 64            /* readable bytes past a source plane (vector tails, zero weights) */

enum { ISA_AUTO = 0, ISA_SCALAR = 1, ISA_SSE2 = 2, ISA_AVX2 = 3 };
static int forced_isa = ISA_AUTO;

int prism_resample_force_isa(int isa)
{
    int old = forced_isa;
    forced_isa = isa;
    return old;
}

/* What this CPU runs: AVX2 when present, else SSE2 (always there on x86-64), else scalar. The
 * deinterleave needs SSSE3, which every AVX2 CPU has. */
#if RS_X86
static int have = ISA_SSE2;
static bool have_ssse3;
static pthread_once_t have_once = PTHREAD_ONCE_INIT;

static void cpu_probe(void)
{
    __builtin_cpu_init();
    have_ssse3 = __builtin_cpu_supports("ssse3");
    have = __builtin_cpu_supports("avx2") ? ISA_AVX2 : ISA_SSE2;
}
#endif

static int isa_pick(bool *ssse3)
{
    *ssse3 = false;
#if RS_X86
    pthread_once(&have_once, cpu_probe);
    int isa = forced_isa == ISA_AUTO ? have : PRISM_MIN(forced_isa, have);
    *ssse3 = have_ssse3 && isa != ISA_SCALAR;
    return isa;
#else
    return ISA_SCALAR;
#endif
}

/* ---------------------------------------------------------------- filters */

static double bilinear_eval(double x)
{
    if (x < 0.0)
        x = -x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

static double bicubic_eval(double x)
{
    /* Pillow bicubic_filter with a = -0.5; torch's antialiased cubic uses the same. */
    const double a = -0.5;
    if (x < 0.0)
        x = -x;
    if (x < 1.0)
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
    if (x < 2.0)
        return (((x - 5) * x + 8) * x - 4) * a;
    return 0.0;
}

const prism_resample_filter_t prism_resample_bilinear = {"bilinear", 1.0, bilinear_eval};
const prism_resample_filter_t prism_resample_bicubic = {"bicubic", 2.0, bicubic_eval};

/* ---------------------------------------------------------------- coefficients */

typedef struct {
    int in, out;
    double scale, support, filterscale;
    int ksize;
} geom_t;

static void geom_init(geom_t *a, const prism_resample_filter_t *f, int in, double extent, int out)
{
    a->in = in;
    a->out = out;
    a->scale = extent / out;
    a->filterscale = a->scale < 1.0 ? 1.0 : a->scale;
    a->support = f->support * a->filterscale;
    a->ksize = (int)ceil(a->support) * 2 + 1;
}

int prism_resample_ksize(const prism_resample_filter_t *f, double extent, int out)
{
    geom_t g;
    geom_init(&g, f, 1, extent, out);
    return g.ksize;
}

/* First tap and tap count of output sample i (Pillow precompute_coeffs / torch
 * _compute_indices_min_size_weights_aa, identical for in0 = 0). Both ends are non-decreasing in i. */
static int geom_bounds(const geom_t *a, int i, int *xmin_out)
{
    double center = (i + 0.5) * a->scale;
    int xmin = (int)(center - a->support + 0.5);
    if (xmin < 0)
        xmin = 0;
    int xmax = (int)(center + a->support + 0.5);
    if (xmax > a->in)
        xmax = a->in;
    xmax -= xmin;
    if (xmax > a->ksize)
        xmax = a->ksize;   /* torch clamps; cannot happen: the span is at most 2 * support + 1 */
    if (xmax < 0)
        xmax = 0;
    *xmin_out = xmin;
    return xmax;
}

/* Normalized double weights of output sample i; returns the tap count. */
static int geom_weights(const geom_t *a, const prism_resample_filter_t *f, int i, double *k, int *xmin_out)
{
    double center = (i + 0.5) * a->scale;
    double ss = 1.0 / a->filterscale;
    int n = geom_bounds(a, i, xmin_out);
    int xmin = *xmin_out;
    double ww = 0.0;
    for (int x = 0; x < n; x++) {
        double w = f->eval((x + xmin - center + 0.5) * ss);
        k[x] = w;
        ww += w;
    }
    if (ww != 0.0)
        for (int x = 0; x < n; x++)
            k[x] /= ww;
    return n;
}

static int32_t to_fixed(double v, int precision)
{
    double s = v * (double)(1 << precision);
    return (int32_t)(s < 0 ? -0.5 + s : 0.5 + s);
}

/* torch picks one precision per axis from the largest weight over every output sample so that the
 * weights fit int16. */
static int torch_precision(const geom_t *a, const prism_resample_filter_t *f, double *scratch)
{
    double wt_max = 0.0;
    for (int i = 0; i < a->out; i++) {
        int xmin;
        int n = geom_weights(a, f, i, scratch, &xmin);
        for (int x = 0; x < n; x++)
            if (scratch[x] > wt_max)
                wt_max = scratch[x];
    }
    int prec;
    for (prec = 0; prec < 22; prec++) {
        int next = (int)(0.5 + wt_max * (1 << (prec + 1)));
        if (next >= (1 << 15))
            break;
    }
    return prec;
}

/* ---------------------------------------------------------------- layout */

static size_t align64(size_t x) { return (x + 63) & ~(size_t)63; }
static int round_up(int x, int a) { return (x + a - 1) / a * a; }

typedef struct {
    size_t hib, hk, vib, vk, scratch, rows, planes, ring, out, hout, acc, total;
} layout_t;

/* vfirst: the vertical pass comes first; ring rows then hold the source span (not wx columns),
 * and the horizontal pass needs its own output rows (hout). */
static void layout(layout_t *l, int wx, int wy, int kx, int ky, int span, int ring_rows, size_t kelem, bool vfirst)
{
    int wxp = round_up(PRISM_MAX(wx, 1), ROW_ALIGN);
    int ringp = vfirst ? round_up(PRISM_MAX(span, wx), ROW_ALIGN) : wxp;
    size_t o = 0;
    l->hib = o; o = align64(o + (size_t)wx * 2 * sizeof(int32_t));
    l->hk = o; o = align64(o + (size_t)wx * (size_t)round_up(kx, KPAD_ALIGN) * kelem);
    l->vib = o; o = align64(o + (size_t)wy * 2 * sizeof(int32_t));
    l->vk = o; o = align64(o + (size_t)wy * (size_t)round_up(ky, KPAD_ALIGN) * kelem);
    l->scratch = o; o = align64(o + (size_t)PRISM_MAX(kx, ky) * sizeof(double));
    l->rows = o; o = align64(o + (size_t)ky * sizeof(uint8_t *));
    l->planes = o; o = align64(o + 3 * ((size_t)span + PLANE_PAD) * sizeof(int16_t));
    l->ring = o; o = align64(o + (size_t)ring_rows * 3 * (size_t)ringp);
    l->out = o; o = align64(o + 3 * (size_t)ringp);
    l->hout = o; o = align64(o + (vfirst ? 3 * (size_t)wxp : 0));
    l->acc = o; o = align64(o + 3 * (size_t)ringp * sizeof(int32_t));
    l->total = o + 64;   /* the workspace itself may start unaligned */
}

static bool spec_valid(const prism_resample_spec_t *s)
{
    return s && s->filter && s->in_w > 0 && s->in_h > 0 && s->out_w > 0 && s->out_h > 0 &&
           s->in_w <= 65535 && s->in_h <= 65535 && s->out_w <= 65535 && s->out_h <= 65535 &&
           s->extent_w > 0 && s->extent_h > 0 && s->extent_w <= s->in_w && s->extent_h <= s->in_h &&
           s->x0 >= 0 && s->x0 < s->x1 && s->x1 <= s->out_w && s->y0 >= 0 && s->y0 < s->y1 && s->y1 <= s->out_h &&
           (s->arith == PRISM_RESAMPLE_PIL || s->arith == PRISM_RESAMPLE_TORCH);
}

typedef struct {
    geom_t gx, gy;
    bool need_h, need_v, vfirst;
    int wx, wy, sx0, span, row_first, row_end, ring_rows;
    layout_t l;
} plan_t;

static void plan_make(const prism_resample_spec_t *s, plan_t *p)
{
    memset(p, 0, sizeof *p);
    geom_init(&p->gx, s->filter, s->in_w, s->extent_w, s->out_w);
    geom_init(&p->gy, s->filter, s->in_h, s->extent_h, s->out_h);
    p->need_h = s->out_w != s->in_w || s->extent_w != s->in_w;
    p->need_v = s->out_h != s->in_h || s->extent_h != s->in_h;
    p->wx = s->x1 - s->x0;
    p->wy = s->y1 - s->y0;
    if (p->need_h) {
        int a, b;
        int nb = geom_bounds(&p->gx, s->x1 - 1, &b);
        geom_bounds(&p->gx, s->x0, &a);
        p->sx0 = a;
        p->span = PRISM_MAX(b + nb - a, 1);
    } else {
        p->sx0 = s->x0;
        p->span = p->wx;
    }
    if (p->need_v) {
        /* Output row j is emitted when the rows up to the running maximum of the ends have
         * arrived; the ring must still hold its first tap then. */
        int end_max = 0, ring = 1, first = INT32_MAX;
        for (int y = s->y0; y < s->y1; y++) {
            int ymin, n = geom_bounds(&p->gy, y, &ymin);
            end_max = PRISM_MAX(end_max, ymin + n);
            ring = PRISM_MAX(ring, end_max - ymin);
            first = PRISM_MIN(first, ymin);
        }
        p->row_first = first;
        p->row_end = end_max;
        p->ring_rows = ring;
    } else {
        p->row_first = s->y0;
        p->row_end = s->y1;
        p->ring_rows = 1;
    }
    size_t kelem = s->arith == PRISM_RESAMPLE_TORCH ? sizeof(int16_t) : sizeof(int32_t);
    /* Vertical first: source rows in the ring (the span); the order matters only with both passes. */
    p->vfirst = s->vertical_first && p->need_h && p->need_v;
    layout(&p->l, p->wx, p->wy, p->need_h ? p->gx.ksize : 1, p->need_v ? p->gy.ksize : 1, p->need_h ? p->span : 0,
           p->ring_rows, kelem, p->vfirst);
}

size_t prism_resample_workspace_bytes(const prism_resample_spec_t *s)
{
    if (!spec_valid(s))
        return 0;
    plan_t p;
    plan_make(s, &p);
    return p.l.total;
}

size_t prism_resample_workspace_bound(int max_in_w, int max_wx, int max_wy, int max_kx, int max_ky)
{
    if (max_in_w <= 0 || max_wx <= 0 || max_wy <= 0 || max_kx <= 0 || max_ky <= 0)
        return 0;
    layout_t l;
    layout(&l, max_wx, max_wy, max_kx, max_ky, max_in_w, max_ky, sizeof(int32_t), false);
    return l.total;
}

/* Coefficients of window samples [o0, o1) into ib / k (int16 for torch, int32 for Pillow). */
static void axis_fill(prism_resample_axis_t *ax, const geom_t *g, const prism_resample_filter_t *f, int o0, int o1,
                      int base, bool torch, double *scratch)
{
    for (int i = o0; i < o1; i++) {
        int xmin;
        int n = geom_weights(g, f, i, scratch, &xmin);
        size_t row = (size_t)(i - o0) * (size_t)ax->kpad;
        for (int x = 0; x < ax->kpad; x++) {
            int32_t v = x < n ? to_fixed(scratch[x], ax->precision) : 0;
            if (torch) {
                PRISM_ASSERT(v >= INT16_MIN && v <= INT16_MAX);
                ((int16_t *)ax->k)[row + (size_t)x] = (int16_t)v;
            } else {
                ((int32_t *)ax->k)[row + (size_t)x] = v;
            }
        }
        ax->ib[2 * (i - o0)] = xmin - base;
        ax->ib[2 * (i - o0) + 1] = n;
    }
}

int prism_resample_init(prism_resample_t *r, const prism_resample_spec_t *s, void *ws, size_t ws_bytes,
                        prism_resample_emit_fn emit, void *ud)
{
    if (!r || !emit || !spec_valid(s))
        return PRISM_EINVAL;
    memset(r, 0, sizeof *r);
    plan_t p;
    plan_make(s, &p);
    if (!ws || ws_bytes < p.l.total)
        return PRISM_ELIMIT;
    uint8_t *base = (uint8_t *)(((uintptr_t)ws + 63) & ~(uintptr_t)63);
    r->s = *s;
    r->emit = emit;
    r->ud = ud;
    r->wx = p.wx;
    r->wy = p.wy;
    r->wxp = round_up(p.wx, ROW_ALIGN);
    r->vfirst = p.vfirst;
    r->ringp = p.vfirst ? round_up(PRISM_MAX(p.span, p.wx), ROW_ALIGN) : r->wxp;
    r->sx0 = p.sx0;
    r->span = p.span;
    r->row_first = p.row_first;
    r->row_end = p.row_end;
    r->ring_rows = p.ring_rows;
    r->src_planes = (int16_t *)(base + p.l.planes);
    r->ring = base + p.l.ring;
    r->out = base + p.l.out;
    r->hout = p.vfirst ? base + p.l.hout : NULL;
    r->acc = (int32_t *)(base + p.l.acc);
    r->rows = (const uint8_t **)(base + p.l.rows);
    double *scratch = (double *)(base + p.l.scratch);
    bool torch = s->arith == PRISM_RESAMPLE_TORCH;

    r->h.active = p.need_h;
    r->h.ib = (int32_t *)(base + p.l.hib);
    r->h.k = base + p.l.hk;
    r->h.ksize = p.need_h ? p.gx.ksize : 1;
    r->h.kpad = round_up(r->h.ksize, KPAD_ALIGN);
    r->v.active = p.need_v;
    r->v.ib = (int32_t *)(base + p.l.vib);
    r->v.k = base + p.l.vk;
    r->v.ksize = p.need_v ? p.gy.ksize : 1;
    r->v.kpad = round_up(r->v.ksize, KPAD_ALIGN);
    if (p.need_h) {
        r->h.precision = torch ? torch_precision(&p.gx, s->filter, scratch) : PIL_PRECISION_BITS;
        axis_fill(&r->h, &p.gx, s->filter, s->x0, s->x1, p.sx0, torch, scratch);
    }
    if (p.need_v) {
        r->v.precision = torch ? torch_precision(&p.gy, s->filter, scratch) : PIL_PRECISION_BITS;
        axis_fill(&r->v, &p.gy, s->filter, s->y0, s->y1, 0, torch, scratch);
    }
    /* Vector kernels run over whole rows: padding is computed but never emitted, and must be
     * defined memory. */
    memset(r->ring, 0, (size_t)r->ring_rows * 3 * (size_t)r->ringp);
    memset(r->src_planes, 0, 3 * ((size_t)r->span + PLANE_PAD) * sizeof(int16_t));
    return PRISM_OK;
}

/* ---------------------------------------------------------------- kernels */

static inline uint8_t clip8(int32_t v, int precision)
{
    /* Pillow's clip8 on (sum + half); torch computes the same. */
    if (v >= (int32_t)((uint32_t)256 << precision))
        return 255;
    if (v <= 0)
        return 0;
    return (uint8_t)(v >> precision);
}

static inline int32_t half_of(int precision) { return precision ? (int32_t)1 << (precision - 1) : 0; }

/* n RGB8 pixels into three planes, as bytes (identity axis) or widened to int16 (kernel input). */
static void split_u8_scalar(const uint8_t *rgb, int n, uint8_t *const p[3])
{
    for (int x = 0; x < n; x++) {
        p[0][x] = rgb[3 * x];
        p[1][x] = rgb[3 * x + 1];
        p[2][x] = rgb[3 * x + 2];
    }
}

static void split_s16_scalar(const uint8_t *rgb, int n, int16_t *const p[3])
{
    for (int x = 0; x < n; x++) {
        p[0][x] = rgb[3 * x];
        p[1][x] = rgb[3 * x + 1];
        p[2][x] = rgb[3 * x + 2];
    }
}

#if RS_X86
/* pshufb masks gathering R, G, B of 16 pixels from the three 16-byte thirds of 48 bytes */
#define SPLIT_MASKS                                                                                                 \
    const __m128i ra = _mm_setr_epi8(0, 3, 6, 9, 12, 15, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);                  \
    const __m128i rb = _mm_setr_epi8(-1, -1, -1, -1, -1, -1, 2, 5, 8, 11, 14, -1, -1, -1, -1, -1);                 \
    const __m128i rc = _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 1, 4, 7, 10, 13);                 \
    const __m128i ga = _mm_setr_epi8(1, 4, 7, 10, 13, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);                 \
    const __m128i gb = _mm_setr_epi8(-1, -1, -1, -1, -1, 0, 3, 6, 9, 12, 15, -1, -1, -1, -1, -1);                  \
    const __m128i gc = _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 2, 5, 8, 11, 14);                 \
    const __m128i ba = _mm_setr_epi8(2, 5, 8, 11, 14, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);                 \
    const __m128i bb = _mm_setr_epi8(-1, -1, -1, -1, -1, 1, 4, 7, 10, 13, -1, -1, -1, -1, -1, -1);                 \
    const __m128i bc = _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 3, 6, 9, 12, 15);

#define SPLIT3(sh, or, a, b, c, R, G, B)                                                                            \
    R = or(or(sh(a, ra), sh(b, rb)), sh(c, rc));                                                                    \
    G = or(or(sh(a, ga), sh(b, gb)), sh(c, gc));                                                                    \
    B = or(or(sh(a, ba), sh(b, bb)), sh(c, bc));

__attribute__((target("ssse3"))) static void split_u8_ssse3(const uint8_t *rgb, int n, uint8_t *const p[3])
{
    SPLIT_MASKS
    int x = 0;
    for (; x + 16 <= n; x += 16) {
        __m128i a = _mm_loadu_si128((const __m128i *)(rgb + 3 * x));
        __m128i b = _mm_loadu_si128((const __m128i *)(rgb + 3 * x + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(rgb + 3 * x + 32));
        __m128i r, g, bl;
        SPLIT3(_mm_shuffle_epi8, _mm_or_si128, a, b, c, r, g, bl)
        _mm_storeu_si128((__m128i *)(p[0] + x), r);
        _mm_storeu_si128((__m128i *)(p[1] + x), g);
        _mm_storeu_si128((__m128i *)(p[2] + x), bl);
    }
    uint8_t *const q[3] = {p[0] + x, p[1] + x, p[2] + x};
    split_u8_scalar(rgb + 3 * x, n - x, q);
}

__attribute__((target("ssse3"))) static void split_s16_ssse3(const uint8_t *rgb, int n, int16_t *const p[3])
{
    SPLIT_MASKS
    const __m128i zero = _mm_setzero_si128();
    int x = 0;
    for (; x + 16 <= n; x += 16) {
        __m128i a = _mm_loadu_si128((const __m128i *)(rgb + 3 * x));
        __m128i b = _mm_loadu_si128((const __m128i *)(rgb + 3 * x + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(rgb + 3 * x + 32));
        __m128i v[3];
        SPLIT3(_mm_shuffle_epi8, _mm_or_si128, a, b, c, v[0], v[1], v[2])
        for (int k = 0; k < 3; k++) {
            _mm_storeu_si128((__m128i *)(p[k] + x), _mm_unpacklo_epi8(v[k], zero));
            _mm_storeu_si128((__m128i *)(p[k] + x + 8), _mm_unpackhi_epi8(v[k], zero));
        }
    }
    int16_t *const q[3] = {p[0] + x, p[1] + x, p[2] + x};
    split_s16_scalar(rgb + 3 * x, n - x, q);
}

/* 32 pixels per step: two 48-byte groups side by side in the two 128-bit lanes. */
__attribute__((target("avx2"))) static void split_s16_avx2(const uint8_t *rgb, int n, int16_t *const p[3])
{
    SPLIT_MASKS
    const __m256i mra = _mm256_broadcastsi128_si256(ra), mrb = _mm256_broadcastsi128_si256(rb),
                  mrc = _mm256_broadcastsi128_si256(rc), mga = _mm256_broadcastsi128_si256(ga),
                  mgb = _mm256_broadcastsi128_si256(gb), mgc = _mm256_broadcastsi128_si256(gc),
                  mba = _mm256_broadcastsi128_si256(ba), mbb = _mm256_broadcastsi128_si256(bb),
                  mbc = _mm256_broadcastsi128_si256(bc);
    int16_t *p0 = p[0], *p1 = p[1], *p2 = p[2];
    int x = 0;
    for (; x + 32 <= n; x += 32) {
        const uint8_t *s = rgb + 3 * x;
        __m256i a = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)s)),
                                            _mm_loadu_si128((const __m128i *)(s + 48)), 1);
        __m256i b = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(s + 16))),
                                            _mm_loadu_si128((const __m128i *)(s + 64)), 1);
        __m256i c = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(s + 32))),
                                            _mm_loadu_si128((const __m128i *)(s + 80)), 1);
        __m256i r = _mm256_or_si256(_mm256_or_si256(_mm256_shuffle_epi8(a, mra), _mm256_shuffle_epi8(b, mrb)),
                                    _mm256_shuffle_epi8(c, mrc));
        __m256i g = _mm256_or_si256(_mm256_or_si256(_mm256_shuffle_epi8(a, mga), _mm256_shuffle_epi8(b, mgb)),
                                    _mm256_shuffle_epi8(c, mgc));
        __m256i bl = _mm256_or_si256(_mm256_or_si256(_mm256_shuffle_epi8(a, mba), _mm256_shuffle_epi8(b, mbb)),
                                     _mm256_shuffle_epi8(c, mbc));
        _mm256_storeu_si256((__m256i *)(p0 + x), _mm256_cvtepu8_epi16(_mm256_castsi256_si128(r)));
        _mm256_storeu_si256((__m256i *)(p0 + x + 16), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(r, 1)));
        _mm256_storeu_si256((__m256i *)(p1 + x), _mm256_cvtepu8_epi16(_mm256_castsi256_si128(g)));
        _mm256_storeu_si256((__m256i *)(p1 + x + 16), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(g, 1)));
        _mm256_storeu_si256((__m256i *)(p2 + x), _mm256_cvtepu8_epi16(_mm256_castsi256_si128(bl)));
        _mm256_storeu_si256((__m256i *)(p2 + x + 16), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(bl, 1)));
    }
    int16_t *const q[3] = {p0 + x, p1 + x, p2 + x};
    split_s16_ssse3(rgb + 3 * x, n - x, q);
}
#endif

/* Horizontal pass, scalar reference: plane[c] -> dst plane c, one output sample per window column. */
static void hpass_scalar(const prism_resample_t *r, const int16_t *const src[3], uint8_t *const dst[3])
{
    const prism_resample_axis_t *a = &r->h;
    int32_t half = half_of(a->precision);
    bool torch = r->s.arith == PRISM_RESAMPLE_TORCH;
    for (int c = 0; c < 3; c++) {
        for (int x = 0; x < r->wx; x++) {
            const int16_t *px = src[c] + a->ib[2 * x];
            int n = a->ib[2 * x + 1];
            int32_t s = half;
            if (torch) {
                const int16_t *k = (const int16_t *)a->k + (size_t)x * a->kpad;
                for (int t = 0; t < n; t++)
                    s += px[t] * (int32_t)k[t];
            } else {
                const int32_t *k = (const int32_t *)a->k + (size_t)x * a->kpad;
                for (int t = 0; t < n; t++)
                    s += px[t] * k[t];
            }
            dst[c][x] = clip8(s, a->precision);
        }
    }
}

/* Vertical pass, scalar reference: rows[t] are the ring rows of the taps (3 * ringp bytes each). */
static void vpass_scalar(const prism_resample_t *r, int j, const uint8_t *const *rows, uint8_t *out)
{
    const prism_resample_axis_t *a = &r->v;
    int n = a->ib[2 * j + 1];
    int m = 3 * r->ringp;
    int32_t half = half_of(a->precision);
    int32_t *acc = r->acc;
    for (int i = 0; i < m; i++)
        acc[i] = half;
    for (int t = 0; t < n; t++) {
        int32_t kt = r->s.arith == PRISM_RESAMPLE_TORCH ? ((const int16_t *)a->k)[(size_t)j * a->kpad + t]
                                                         : ((const int32_t *)a->k)[(size_t)j * a->kpad + t];
        const uint8_t *row = rows[t];
        for (int i = 0; i < m; i++)
            acc[i] += row[i] * kt;
    }
    for (int i = 0; i < m; i++)
        out[i] = clip8(acc[i], a->precision);
}

#if RS_X86
/* int32 sums -> uint8 with clip8's result: arithmetic shift, then signed / unsigned saturation
 * (sums are far inside int32; after the shift they fit int16 unless out of [0, 255] anyway). */
static inline __m128i sse2_narrow(__m128i q0, __m128i q1, __m128i q2, __m128i q3, __m128i sh)
{
    __m128i w01 = _mm_packs_epi32(_mm_sra_epi32(q0, sh), _mm_sra_epi32(q1, sh));
    __m128i w23 = _mm_packs_epi32(_mm_sra_epi32(q2, sh), _mm_sra_epi32(q3, sh));
    return _mm_packus_epi16(w01, w23);
}

static void hpass_torch_sse2(const prism_resample_t *r, const int16_t *const src[3], uint8_t *const dst[3])
{
    const prism_resample_axis_t *a = &r->h;
    const int16_t *restrict kk = (const int16_t *)a->k;
    const int32_t *restrict ib = a->ib;
    const int16_t *restrict s0p = src[0], *restrict s1p = src[1], *restrict s2p = src[2];
    uint8_t *restrict d0 = dst[0], *restrict d1 = dst[1], *restrict d2 = dst[2];
    const size_t kpad = (size_t)a->kpad;
    const int wx = r->wx;
    const __m128i zero = _mm_setzero_si128();
    const __m128i half = _mm_set1_epi32(half_of(a->precision));
    const __m128i sh = _mm_cvtsi32_si128(a->precision);
    for (int x = 0; x < wx; x++) {
        const int16_t *k = kk + (size_t)x * kpad;
        int off = ib[2 * x], n = ib[2 * x + 1];
        __m128i s0 = zero, s1 = zero, s2 = zero;
        for (int t = 0; t < n; t += 8) {
            __m128i kv = _mm_load_si128((const __m128i *)(k + t));
            s0 = _mm_add_epi32(s0, _mm_madd_epi16(_mm_loadu_si128((const __m128i *)(s0p + off + t)), kv));
            s1 = _mm_add_epi32(s1, _mm_madd_epi16(_mm_loadu_si128((const __m128i *)(s1p + off + t)), kv));
            s2 = _mm_add_epi32(s2, _mm_madd_epi16(_mm_loadu_si128((const __m128i *)(s2p + off + t)), kv));
        }
        /* transpose-add the three accumulators into [s0, s1, s2, s2] */
        __m128i t01lo = _mm_unpacklo_epi32(s0, s1), t01hi = _mm_unpackhi_epi32(s0, s1);
        __m128i t22lo = _mm_unpacklo_epi32(s2, s2), t22hi = _mm_unpackhi_epi32(s2, s2);
        __m128i u = _mm_add_epi32(t01lo, t01hi);     /* [s0a, s1a, s0b, s1b] */
        __m128i v = _mm_add_epi32(t22lo, t22hi);     /* [s2a, s2a, s2b, s2b] */
        __m128i sum = _mm_add_epi32(_mm_unpacklo_epi64(u, v), _mm_unpackhi_epi64(u, v));
        sum = _mm_add_epi32(sum, half);
        __m128i b = sse2_narrow(sum, sum, sum, sum, sh);
        uint32_t w = (uint32_t)_mm_cvtsi128_si32(b);
        d0[x] = (uint8_t)w;
        d1[x] = (uint8_t)(w >> 8);
        d2[x] = (uint8_t)(w >> 16);
    }
}

static void vpass_torch_sse2(const prism_resample_t *r, int j, const uint8_t *const *rows, uint8_t *out)
{
    const prism_resample_axis_t *a = &r->v;
    const int16_t *k = (const int16_t *)a->k + (size_t)j * a->kpad;
    int n = a->ib[2 * j + 1];
    int m = 3 * r->wxp;
    const __m128i zero = _mm_setzero_si128();
    const __m128i half = _mm_set1_epi32(half_of(a->precision));
    const __m128i sh = _mm_cvtsi32_si128(a->precision);
    for (int i = 0; i < m; i += 16) {
        __m128i q0 = half, q1 = half, q2 = half, q3 = half;
        for (int t = 0; t < n; t += 2) {
            bool pair = t + 1 < n;
            __m128i ra = _mm_load_si128((const __m128i *)(rows[t] + i));
            __m128i rb = pair ? _mm_load_si128((const __m128i *)(rows[t + 1] + i)) : zero;
            int32_t kk = (int32_t)(uint16_t)k[t] | (int32_t)((uint32_t)(uint16_t)(pair ? k[t + 1] : 0) << 16);
            __m128i kv = _mm_set1_epi32(kk);
            __m128i lo = _mm_unpacklo_epi8(ra, rb), hi = _mm_unpackhi_epi8(ra, rb);
            q0 = _mm_add_epi32(q0, _mm_madd_epi16(_mm_unpacklo_epi8(lo, zero), kv));
            q1 = _mm_add_epi32(q1, _mm_madd_epi16(_mm_unpackhi_epi8(lo, zero), kv));
            q2 = _mm_add_epi32(q2, _mm_madd_epi16(_mm_unpacklo_epi8(hi, zero), kv));
            q3 = _mm_add_epi32(q3, _mm_madd_epi16(_mm_unpackhi_epi8(hi, zero), kv));
        }
        _mm_store_si128((__m128i *)(out + i), sse2_narrow(q0, q1, q2, q3, sh));
    }
}

__attribute__((target("avx2"))) static void hpass_torch_avx2(const prism_resample_t *r, const int16_t *const src[3],
                                                             uint8_t *const dst[3])
{
    /* Locals, not r->...: the byte stores below may alias anything, so the compiler would
     * reload every field per sample. */
    const prism_resample_axis_t *a = &r->h;
    const int16_t *restrict kk = (const int16_t *)a->k;
    const int32_t *restrict ib = a->ib;
    const int16_t *restrict s0p = src[0], *restrict s1p = src[1], *restrict s2p = src[2];
    uint8_t *restrict d0 = dst[0], *restrict d1 = dst[1], *restrict d2 = dst[2];
    const size_t kpad = (size_t)a->kpad;
    const int wx = r->wx;
    const __m128i half = _mm_set1_epi32(half_of(a->precision));
    const __m128i sh = _mm_cvtsi32_si128(a->precision);
    for (int x = 0; x < wx; x++) {
        const int16_t *k = kk + (size_t)x * kpad;
        int off = ib[2 * x], n = ib[2 * x + 1];
        __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0;
        for (int t = 0; t < n; t += 16) {
            __m256i kv = _mm256_load_si256((const __m256i *)(k + t));
            s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(s0p + off + t)), kv));
            s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(s1p + off + t)), kv));
            s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(s2p + off + t)), kv));
        }
        /* per 128-bit lane: [s0, s1, s2, s2] partial sums; then add the lanes */
        __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(s0, s1), _mm256_hadd_epi32(s2, s2));
        __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        sum = _mm_add_epi32(sum, half);
        __m128i w = _mm_packs_epi32(_mm_sra_epi32(sum, sh), _mm_setzero_si128());
        uint32_t v = (uint32_t)_mm_cvtsi128_si32(_mm_packus_epi16(w, w));
        d0[x] = (uint8_t)v;
        d1[x] = (uint8_t)(v >> 8);
        d2[x] = (uint8_t)(v >> 16);
    }
}

__attribute__((target("avx2"))) static void vpass_torch_avx2(const prism_resample_t *r, int j,
                                                             const uint8_t *const *rows, uint8_t *out)
{
    const prism_resample_axis_t *a = &r->v;
    const int16_t *k = (const int16_t *)a->k + (size_t)j * a->kpad;
    int n = a->ib[2 * j + 1];
    int m = 3 * r->wxp;
    const __m256i zero = _mm256_setzero_si256();
    const __m256i half = _mm256_set1_epi32(half_of(a->precision));
    const __m128i sh = _mm_cvtsi32_si128(a->precision);
    for (int i = 0; i < m; i += 32) {
        __m256i q0 = half, q1 = half, q2 = half, q3 = half;
        for (int t = 0; t < n; t += 2) {
            bool pair = t + 1 < n;
            __m256i ra = _mm256_load_si256((const __m256i *)(rows[t] + i));
            __m256i rb = pair ? _mm256_load_si256((const __m256i *)(rows[t + 1] + i)) : zero;
            int32_t kk = (int32_t)(uint16_t)k[t] | (int32_t)((uint32_t)(uint16_t)(pair ? k[t + 1] : 0) << 16);
            __m256i kv = _mm256_set1_epi32(kk);
            __m256i lo = _mm256_unpacklo_epi8(ra, rb), hi = _mm256_unpackhi_epi8(ra, rb);
            q0 = _mm256_add_epi32(q0, _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), kv));
            q1 = _mm256_add_epi32(q1, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), kv));
            q2 = _mm256_add_epi32(q2, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), kv));
            q3 = _mm256_add_epi32(q3, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), kv));
        }
        /* per-lane packs undo the per-lane unpacks: bytes come out in order */
        __m256i w01 = _mm256_packs_epi32(_mm256_sra_epi32(q0, sh), _mm256_sra_epi32(q1, sh));
        __m256i w23 = _mm256_packs_epi32(_mm256_sra_epi32(q2, sh), _mm256_sra_epi32(q3, sh));
        _mm256_store_si256((__m256i *)(out + i), _mm256_packus_epi16(w01, w23));
    }
}
#endif

/* ---------------------------------------------------------------- driver */

static uint8_t *ring_row(const prism_resample_t *r, int src_row)
{
    return r->ring + (size_t)((src_row - r->row_first) % r->ring_rows) * 3 * (size_t)r->ringp;
}

/* Vertical first (Pillow 13 for images whose height shrinks most): the vertical result of the
 * source span (uint8, rounded as Pillow's intermediate image is), then the horizontal pass over it. */
static void hpass_after_v(prism_resample_t *r)
{
    size_t ps = (size_t)r->span + PLANE_PAD;
    int16_t *const sp[3] = {r->src_planes, r->src_planes + ps, r->src_planes + 2 * ps};
    for (int c = 0; c < 3; c++) {
        const uint8_t *v = r->out + (size_t)c * r->ringp;
        for (int x = 0; x < r->span; x++) sp[c][x] = v[x];
    }
    const int16_t *const src[3] = {sp[0], sp[1], sp[2]};
    uint8_t *const d[3] = {r->hout, r->hout + r->wxp, r->hout + 2 * (size_t)r->wxp};
    hpass_scalar(r, src, d);
}

static int emit_ready(prism_resample_t *r)
{
    bool ssse3;
    int isa = isa_pick(&ssse3);
    while (r->emitted < r->wy) {
        int j = r->emitted, y = r->s.y0 + j;
        const uint8_t *planes[3];
        if (!r->v.active) {
            if (y >= r->pushed)
                return PRISM_OK;
            const uint8_t *row = ring_row(r, y);
            planes[0] = row;
            planes[1] = row + r->ringp;
            planes[2] = row + 2 * (size_t)r->ringp;
        } else {
            int ymin = r->v.ib[2 * j], n = r->v.ib[2 * j + 1];
            /* ends are non-decreasing, so waiting for this row's end waits for every earlier one */
            if (ymin + n > r->pushed)
                return PRISM_OK;
            for (int t = 0; t < n; t++)
                r->rows[t] = ring_row(r, ymin + t);
            const uint8_t *const *rp = r->rows;
            if (r->vfirst) {
                vpass_scalar(r, j, rp, r->out);
                hpass_after_v(r);
                planes[0] = r->hout;
                planes[1] = r->hout + r->wxp;
                planes[2] = r->hout + 2 * (size_t)r->wxp;
                r->emitted++;
                int rc = r->emit(r->ud, y, planes);
                if (rc < 0)
                    return rc;
                continue;
            }
            if (r->s.arith == PRISM_RESAMPLE_TORCH && isa == ISA_AVX2) {
#if RS_X86
                vpass_torch_avx2(r, j, rp, r->out);
#endif
            } else if (r->s.arith == PRISM_RESAMPLE_TORCH && isa == ISA_SSE2) {
#if RS_X86
                vpass_torch_sse2(r, j, rp, r->out);
#endif
            } else {
                vpass_scalar(r, j, rp, r->out);
            }
            planes[0] = r->out;
            planes[1] = r->out + r->ringp;
            planes[2] = r->out + 2 * (size_t)r->ringp;
        }
        r->emitted++;
        int rc = r->emit(r->ud, y, planes);
        if (rc < 0)
            return rc;
    }
    return PRISM_OK;
}

int prism_resample_push(prism_resample_t *r, const uint8_t *rgb)
{
    if (!r || !rgb || r->pushed >= r->s.in_h)
        return PRISM_EINVAL;
    int y = r->pushed;
    if (y >= r->row_first && y < r->row_end) {
        bool ssse3;
        int isa = isa_pick(&ssse3);
        uint8_t *dst = ring_row(r, y);
        uint8_t *const d[3] = {dst, dst + r->ringp, dst + 2 * (size_t)r->ringp};
        const uint8_t *from = rgb + (size_t)r->sx0 * 3;
        if (!r->h.active || r->vfirst) {
            /* identity horizontally, or the vertical pass first: the window's source columns go
             * straight into the ring */
#if RS_X86
            if (ssse3)
                split_u8_ssse3(from, r->span, d);
            else
#endif
                split_u8_scalar(from, r->span, d);
        } else {
            size_t ps = (size_t)r->span + PLANE_PAD;
            int16_t *const sp[3] = {r->src_planes, r->src_planes + ps, r->src_planes + 2 * ps};
            const int16_t *const src[3] = {sp[0], sp[1], sp[2]};
            bool torch = r->s.arith == PRISM_RESAMPLE_TORCH;
            if (isa == ISA_AVX2) {
#if RS_X86
                split_s16_avx2(from, r->span, sp);
                if (torch)
                    hpass_torch_avx2(r, src, d);
                else
                    hpass_scalar(r, src, d);
#endif
            } else if (isa == ISA_SSE2) {
#if RS_X86
                if (ssse3)
                    split_s16_ssse3(from, r->span, sp);
                else
                    split_s16_scalar(from, r->span, sp);
                if (torch)
                    hpass_torch_sse2(r, src, d);
                else
                    hpass_scalar(r, src, d);
#endif
            } else {
                split_s16_scalar(from, r->span, sp);
                hpass_scalar(r, src, d);
            }
        }
    }
    r->pushed++;
    return emit_ready(r);
}
