/* Qwen-VL image processor, pixels (geometry and M-RoPE positions: qwenvl_layout.c). Decoded rows
 * stream through one resampler (image/resample.h, Pillow's arithmetic: HF's PIL backend resizes
 * with Image.resize); each emitted row is normalized through a per-channel table and written
 * straight into the patches it crosses, in HF's patch order. No decoded or resized image is held:
 * memory is the resampler's rows plus the patches themselves. */
#include "image/qwenvl_proc.h"

#include <string.h>

/* numpy: float64(u) * rescale_factor -> float32, then (x - mean32) / std32 in float32. */
static void norm_lut(const prism_qwenvl_proc_t *p, float lut[3][256])
{
    for (int c = 0; c < 3; c++)
        for (int u = 0; u < 256; u++) {
            float v = p->do_rescale ? (float)((double)u * p->rescale_factor) : (float)u;
            if (p->do_normalize) v = (v - p->mean[c]) / p->std[c];
            lut[c][u] = v;
        }
}

static void resize_spec(const prism_qwenvl_proc_t *p, prism_resample_spec_t *s, int w, int h, const prism_qwenvl_grid_t *g)
{
    memset(s, 0, sizeof *s);
    s->filter = p->bilinear ? &prism_resample_bilinear : &prism_resample_bicubic;
    s->arith = PRISM_RESAMPLE_PIL;
    s->in_w = w;
    s->in_h = h;
    s->extent_w = w;
    s->extent_h = h;
    s->out_w = g->resized_w;
    s->out_h = g->resized_h;
    s->x1 = g->resized_w;
    s->y1 = g->resized_h;
    /* Pillow 13 runs the vertical pass first for images whose height shrinks most (tall images);
     * the rounding of its intermediate image differs from the other order. */
    s->vertical_first = prism_resample_pillow_vertical_first(w, h, g->resized_w, g->resized_h);
}

static size_t ws_bytes_px(const prism_qwenvl_proc_t *p, int64_t min_px, int64_t max_px, int w, int h)
{
    prism_qwenvl_grid_t g;
    if (prism_qwenvl_grid_px(p, min_px, max_px, w, h, &g) != PRISM_OK) return 0;
    prism_resample_spec_t s;
    resize_spec(p, &s, w, h, &g);
    return prism_resample_workspace_bytes(&s);
}

size_t prism_qwenvl_workspace_bytes(const prism_qwenvl_proc_t *p, int w, int h)
{
    return ws_bytes_px(p, p->min_pixels, p->max_pixels, w, h);
}

size_t prism_qwenvl_workspace_bound(const prism_qwenvl_proc_t *p, uint64_t max_pixels, int64_t max_pixels_cap)
{
    if (!prism_qwenvl_proc_valid(p) || max_pixels < 1) return 0;
    int64_t out_px = PRISM_MAX(p->max_pixels, max_pixels_cap);
    int dim = (int)PRISM_MIN(max_pixels, (uint64_t)PRISM_IMAGE_MAX_DIM);
    /* The exact workspace over a geometric grid of sizes (steps of 1.25 in each side, both ends
     * included) within the pixel limit and the 200:1 aspect bound, with a quarter and 1 MiB of
     * slack for the sizes between grid points (the workspace grows smoothly with the sides, the
     * coefficient tables by taps x outputs ~ input). An image that still needs more is refused
     * at its header (prism_qwenvl_workspace_bytes) rather than decoded. */
    size_t best = 0;
    for (double fw = 1; ; fw = fw * 1.25 + 1) {
        int w = (int)PRISM_MIN(fw, (double)dim);
        for (double fh = 1; ; fh = fh * 1.25 + 1) {
            int h = (int)PRISM_MIN(fh, (double)dim);
            if ((uint64_t)w * (uint64_t)h > max_pixels) h = (int)(max_pixels / (uint64_t)w);
            if (h >= 1 && (double)PRISM_MAX(w, h) / PRISM_MIN(w, h) <= 200.0) {
                size_t a = ws_bytes_px(p, p->min_pixels, out_px, w, h);
                size_t b = ws_bytes_px(p, p->min_pixels, p->max_pixels, w, h);
                best = PRISM_MAX(best, PRISM_MAX(a, b));
            }
            if (h >= dim || fh >= dim || (uint64_t)w * (uint64_t)h >= max_pixels) break;
        }
        if (w >= dim) break;
    }
    return best ? best + best / 4 + ((size_t)1 << 20) : 0;
}

/* ---------------------------------------------------------------- streaming sink */

static int emit_row(void *ud, int y, const uint8_t *const planes[3])
{
    prism_qwenvl_stream_t *s = ud;
    const int P = s->p->patch, M = s->p->merge, gh = y / P, ky = y % P;
    const size_t pp = (size_t)P * P, per = 3 * pp;
    /* the patches of grid row gh: merged row gh / M, row gh % M inside its merge block */
    const size_t row0 = (size_t)(gh / M) * s->g.tok_w * M * M + (size_t)(gh % M) * M;
    for (int gw = 0; gw < s->g.grid_w; gw++) {
        size_t n = row0 + (size_t)(gw / M) * M * M + (size_t)(gw % M);
        float *dst = s->out + n * per + (size_t)ky * P;
        for (int c = 0; c < 3; c++) {
            const float *lut = s->lut[c];
            const uint8_t *v = planes[c] + (size_t)gw * P;
            float *o = dst + c * pp;
            for (int kx = 0; kx < P; kx++) o[kx] = lut[v[kx]];
        }
    }
    return PRISM_OK;
}

static int stream_begin(void *ud, const prism_image_t *geom)
{
    prism_qwenvl_stream_t *s = ud;
    /* DCT-scaled decodes are refused: HF resizes the full-size image. */
    if ((geom->src_w && geom->src_w != geom->w) || (geom->src_h && geom->src_h != geom->h)) return PRISM_EINVAL;
    int rc = prism_qwenvl_grid_px(s->p, s->min_pixels, s->max_pixels, geom->w, geom->h, &s->g);
    if (rc != PRISM_OK) return rc;
    prism_resample_spec_t spec;
    resize_spec(s->p, &spec, geom->w, geom->h, &s->g);
    size_t need = prism_resample_workspace_bytes(&spec);
    if (!need) return PRISM_EINVAL;
    if (need > s->ws_bytes || !s->ws) return PRISM_ELIMIT;
    if ((rc = prism_resample_init(&s->rs, &spec, s->ws, s->ws_bytes, emit_row, s)) != PRISM_OK) return rc;
    s->begun = true;
    return PRISM_OK;
}

static int stream_row(void *ud, int y, const uint8_t *rgb)
{
    prism_qwenvl_stream_t *s = ud;
    if (!s->begun || y != s->rs.pushed) return PRISM_EINVAL;
    return prism_resample_push(&s->rs, rgb);
}

prism_image_sink_t prism_qwenvl_stream_sink(prism_qwenvl_stream_t *s, const prism_qwenvl_proc_t *p, int64_t min_pixels,
                                            int64_t max_pixels, void *ws, size_t ws_bytes, float *out)
{
    memset(s, 0, sizeof *s);
    s->p = p;
    s->min_pixels = min_pixels || max_pixels ? min_pixels : p->min_pixels;
    s->max_pixels = min_pixels || max_pixels ? max_pixels : p->max_pixels;
    s->ws = ws;
    s->ws_bytes = ws_bytes;
    s->out = out;
    norm_lut(p, s->lut);
    return (prism_image_sink_t){.begin = stream_begin, .row = stream_row, .ud = s};
}

int prism_qwenvl_stream_finish(const prism_qwenvl_stream_t *s)
{
    return s && s->begun && prism_resample_done(&s->rs) ? PRISM_OK : PRISM_ECORRUPT;
}

int prism_qwenvl_preprocess(const prism_qwenvl_proc_t *p, const prism_image_t *img, void *workspace, size_t ws_bytes,
                            float *out)
{
    if (!prism_qwenvl_proc_valid(p) || !img || !img->rgb || !out || img->w < 1 || img->h < 1) return PRISM_EINVAL;
    prism_qwenvl_stream_t s;
    prism_image_sink_t sink = prism_qwenvl_stream_sink(&s, p, 0, 0, workspace, ws_bytes, out);
    prism_image_t g = *img;
    g.rgb = NULL;
    int rc = sink.begin(sink.ud, &g);
    for (int y = 0; rc == PRISM_OK && y < img->h; y++) rc = sink.row(sink.ud, y, img->rgb + (size_t)y * img->w * 3);
    return rc == PRISM_OK ? prism_qwenvl_stream_finish(&s) : rc;
}
