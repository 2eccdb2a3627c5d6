/* Llama-4 image processor, pixels (geometry and prompt layout: llama4_layout.c). The decoded rows
 * stream into two resamplers at once (image/resample.h, torch's uint8 antialiased bilinear kernel,
 * as HF's torchvision backend): the aspect-preserving resize that the local tiles are cut from, and
 * the global tile (the whole image to tile x tile). Each emitted row is normalized (bf16 steps, as
 * HF) and written straight into the tiles it belongs to; zero padding is written once at begin.
 * No decoded or resized image is ever held: memory is O(width) rows plus the tiles themselves. */
#include "image/llama4_proc.h"
#include "image/resample.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------- pixels */

/* bfloat16 rounding (nearest even) of a float32; NaN never occurs here (finite inputs).
 * Kept local: the image library is a leaf and must not link the backend for it. */
static float bf16_round(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&f, &u, 4);
    return f;
}

/* HF: images.to(bfloat16) * rescale_factor, then torchvision normalize on the bf16 tensor (mean
 * and std cast to bf16); every op computes in float32 and rounds to bf16. */
static void norm_lut(const prism_llama4_proc_t *p, float lut[3][256])
{
    float rs = (float)p->rescale_factor;
    for (int c = 0; c < 3; c++) {
        float m = bf16_round(p->mean[c]), s = bf16_round(p->std[c]);
        for (int u = 0; u < 256; u++) {
            float x = bf16_round((float)u * rs);
            x = bf16_round(x - m);
            lut[c][u] = bf16_round(x / s);
        }
    }
}

static void resize_spec(prism_resample_spec_t *s, int w, int h, int out_w, int out_h)
{
    memset(s, 0, sizeof *s);
    s->filter = &prism_resample_bilinear;
    s->arith = PRISM_RESAMPLE_TORCH;   /* torchvision's uint8 antialiased kernel, as HF uses */
    s->in_w = w;
    s->in_h = h;
    s->extent_w = w;
    s->extent_h = h;
    s->out_w = out_w;
    s->out_h = out_h;
    s->x1 = out_w;
    s->y1 = out_h;
}

typedef struct {
    prism_resample_spec_t local, global;
    bool has_global;
    size_t local_bytes, global_off, global_bytes, total;
} ws_layout_t;

static int ws_plan(const prism_llama4_proc_t *p, int w, int h, const prism_llama4_grid_t *g, ws_layout_t *l)
{
    memset(l, 0, sizeof *l);
    resize_spec(&l->local, w, h, g->resized_w, g->resized_h);
    l->local_bytes = prism_resample_workspace_bytes(&l->local);
    l->has_global = g->n_tiles > 1;
    if (l->has_global) {
        resize_spec(&l->global, w, h, p->tile, p->tile);
        l->global_bytes = prism_resample_workspace_bytes(&l->global);
    }
    if (!l->local_bytes || (l->has_global && !l->global_bytes)) return PRISM_EINVAL;
    l->global_off = PRISM_ALIGN_UP(l->local_bytes, 64);
    l->total = l->global_off + l->global_bytes;
    return PRISM_OK;
}

size_t prism_llama4_preprocess_workspace_bytes(const prism_llama4_proc_t *p, int w, int h)
{
    prism_llama4_grid_t g;
    ws_layout_t l;
    if (prism_llama4_grid(p, w, h, &g) != PRISM_OK || ws_plan(p, w, h, &g, &l) != PRISM_OK) return 0;
    return l.total;
}

size_t prism_llama4_workspace_bound(const prism_llama4_proc_t *p, uint64_t max_pixels)
{
    double ratio;
    int max_w, max_h;
    if (prism_llama4_resize_extremes(p, max_pixels, &ratio, &max_w, &max_h) != PRISM_OK) return 0;
    int dim = (int)PRISM_MIN(max_pixels, (uint64_t)PRISM_IMAGE_MAX_DIM);
    /* Loose on purpose (largest window times most taps, a few taps of slack): megabytes, once. */
    const prism_resample_filter_t *f = &prism_resample_bilinear;
    int kl = prism_resample_ksize(f, ratio + 1.0, 1) + 2;
    int kg = prism_resample_ksize(f, (double)dim / p->tile + 1.0, 1) + 2;
    size_t local = prism_resample_workspace_bound(dim + 4, max_w + 4, max_h + 4, kl, kl);
    size_t global = prism_resample_workspace_bound(dim + 4, p->tile, p->tile, kg, kg);
    return PRISM_ALIGN_UP(local, 64) + global;
}

/* ---------------------------------------------------------------- streaming sink */

static int emit_local(void *ud, int y, const uint8_t *const planes[3])
{
    prism_llama4_stream_t *s = ud;
    int T = s->p->tile, r = y / T, ty = y % T, rw = s->g.resized_w;
    size_t plane = (size_t)T * T;
    for (int c = 0; c < s->g.cols && c * T < rw; c++) {
        int x0 = c * T, n = PRISM_MIN(T, rw - x0);
        float *t = s->out + (size_t)(r * s->g.cols + c) * 3 * plane + (size_t)ty * T;
        for (int ch = 0; ch < 3; ch++) {
            const float *lut = s->lut[ch];
            const uint8_t *v = planes[ch] + x0;
            float *o = t + ch * plane;
            for (int x = 0; x < n; x++) o[x] = lut[v[x]];
        }
    }
    return PRISM_OK;
}

static int emit_global(void *ud, int y, const uint8_t *const planes[3])
{
    prism_llama4_stream_t *s = ud;
    int T = s->p->tile;
    size_t plane = (size_t)T * T;
    float *t = s->out + (size_t)(s->g.n_tiles - 1) * 3 * plane + (size_t)y * T;
    for (int ch = 0; ch < 3; ch++) {
        const float *lut = s->lut[ch];
        const uint8_t *v = planes[ch];
        float *o = t + ch * plane;
        for (int x = 0; x < T; x++) o[x] = lut[v[x]];
    }
    return PRISM_OK;
}

/* Zero pixels (normalized) where the canvas extends past the resized image. */
static void fill_padding(prism_llama4_stream_t *s)
{
    int T = s->p->tile, rw = s->g.resized_w, rh = s->g.resized_h;
    size_t plane = (size_t)T * T;
    for (int r = 0; r < s->g.rows; r++)
        for (int c = 0; c < s->g.cols; c++) {
            float *t = s->out + (size_t)(r * s->g.cols + c) * 3 * plane;
            int full_x = PRISM_MAX(0, PRISM_MIN(T, rw - c * T));   /* columns the image covers */
            for (int ty = 0; ty < T; ty++) {
                int x0 = r * T + ty < rh ? full_x : 0;
                if (x0 >= T) continue;
                for (int ch = 0; ch < 3; ch++) {
                    float *o = t + ch * plane + (size_t)ty * T, z = s->lut[ch][0];
                    for (int x = x0; x < T; x++) o[x] = z;
                }
            }
        }
}

static int stream_begin(void *ud, const prism_image_t *geom)
{
    prism_llama4_stream_t *s = ud;
    /* DCT-scaled decodes are not supported: HF resizes the full-size image. */
    if ((geom->src_w && geom->src_w != geom->w) || (geom->src_h && geom->src_h != geom->h)) return PRISM_EINVAL;
    int rc = prism_llama4_grid(s->p, geom->w, geom->h, &s->g);
    if (rc != PRISM_OK) return rc;
    ws_layout_t l;
    if ((rc = ws_plan(s->p, geom->w, geom->h, &s->g, &l)) != PRISM_OK) return rc;
    if (l.total > s->ws_bytes || !s->ws) return PRISM_ELIMIT;
    uint8_t *ws = s->ws;
    if ((rc = prism_resample_init(&s->local, &l.local, ws, l.local_bytes, emit_local, s)) != PRISM_OK) return rc;
    s->has_global = l.has_global;
    if (s->has_global &&
        (rc = prism_resample_init(&s->global, &l.global, ws + l.global_off, l.global_bytes, emit_global, s)) != PRISM_OK)
        return rc;
    fill_padding(s);
    s->begun = true;
    return PRISM_OK;
}

static int stream_row(void *ud, int y, const uint8_t *rgb)
{
    prism_llama4_stream_t *s = ud;
    if (!s->begun || y != s->local.pushed) return PRISM_EINVAL;
    int rc = prism_resample_push(&s->local, rgb);
    if (rc == PRISM_OK && s->has_global) rc = prism_resample_push(&s->global, rgb);
    return rc;
}

prism_image_sink_t prism_llama4_stream_sink(prism_llama4_stream_t *s, const prism_llama4_proc_t *p, void *ws,
                                            size_t ws_bytes, float *out)
{
    memset(s, 0, sizeof *s);
    s->p = p;
    s->ws = ws;
    s->ws_bytes = ws_bytes;
    s->out = out;
    norm_lut(p, s->lut);
    return (prism_image_sink_t){.begin = stream_begin, .row = stream_row, .ud = s};
}

int prism_llama4_stream_finish(const prism_llama4_stream_t *s)
{
    if (!s || !s->begun || !prism_resample_done(&s->local) || (s->has_global && !prism_resample_done(&s->global)))
        return PRISM_ECORRUPT;
    return PRISM_OK;
}

int prism_llama4_preprocess(const prism_llama4_proc_t *p, const prism_image_t *img, void *workspace,
                            size_t ws_bytes, float *out)
{
    if (!prism_llama4_proc_valid(p) || !img || !img->rgb || !out || img->w < 1 || img->h < 1) return PRISM_EINVAL;
    prism_llama4_stream_t s;
    prism_image_sink_t sink = prism_llama4_stream_sink(&s, p, workspace, ws_bytes, out);
    prism_image_t g = *img;
    g.rgb = NULL;
    int rc = sink.begin(sink.ud, &g);
    for (int y = 0; rc == PRISM_OK && y < img->h; y++)
        rc = sink.row(sink.ud, y, img->rgb + (size_t)y * img->w * 3);
    return rc == PRISM_OK ? prism_llama4_stream_finish(&s) : rc;
}
