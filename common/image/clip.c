/* CLIP image preprocessing: config loading, HF geometry, and the streaming resampler (resample.h)
 * driven so that only the center-crop window is computed, straight into normalized planes. */
#include "image/clip.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

/* OpenAI CLIP statistics (transformers OPENAI_CLIP_MEAN / OPENAI_CLIP_STD). */
static const double clip_mean[3] = {0.48145466, 0.4578275, 0.40821073};
static const double clip_std[3] = {0.26862954, 0.26130258, 0.27577711};

#define MAX_CONFIG_BYTES (1u << 20)

void prism_clip_preproc_default(prism_clip_preproc_t *p, int size)
{
    memset(p, 0, sizeof *p);
    p->shortest_edge = size;
    p->crop_h = p->crop_w = size;
    p->do_resize = p->do_center_crop = p->do_rescale = p->do_normalize = p->do_convert_rgb = true;
    p->rescale_factor_f64 = 1.0 / 255.0;
    p->rescale_factor = (float)p->rescale_factor_f64;
    for (int c = 0; c < 3; c++) {
        p->mean[c] = (float)clip_mean[c];
        p->std[c] = (float)clip_std[c];
    }
    p->filter = PRISM_CLIP_FILTER_BICUBIC;
    /* vLLM installs torchvision, so transformers hands it the torchvision processor. */
    p->impl = PRISM_CLIP_RESAMPLE_TORCHVISION;
}

/* ---------------------------------------------------------------- config */

static int cfg_err(char *err, size_t errlen, int rc, const char *fmt, const char *what)
{
    if (err && errlen)
        snprintf(err, errlen, fmt, what);
    return rc;
}

static bool get_bool(json_t *root, const char *key, bool *out)
{
    json_t *v = json_object_get(root, key);
    if (!v)
        return true;
    if (!json_is_boolean(v))
        return false;
    *out = json_is_true(v);
    return true;
}

static bool dim_ok(json_int_t v) { return v >= 1 && v <= PRISM_IMAGE_MAX_DIM; }

static bool get_dim(json_t *obj, const char *key, int *out)
{
    json_t *v = json_object_get(obj, key);
    if (!json_is_integer(v) || !dim_ok(json_integer_value(v)))
        return false;
    *out = (int)json_integer_value(v);
    return true;
}

static bool get_triplet(json_t *root, const char *key, float out[3])
{
    json_t *v = json_object_get(root, key);
    if (!v)
        return true;
    if (json_is_number(v)) {   /* a scalar applies to every channel, as in transformers */
        out[0] = out[1] = out[2] = (float)json_number_value(v);
        return true;
    }
    if (!json_is_array(v) || json_array_size(v) != 3)
        return false;
    for (int c = 0; c < 3; c++) {
        json_t *e = json_array_get(v, (size_t)c);
        if (!json_is_number(e))
            return false;
        out[c] = (float)json_number_value(e);
    }
    return true;
}

int prism_clip_preproc_load(const char *path, prism_clip_preproc_t *p, char *err, size_t errlen)
{
    if (err && errlen)
        err[0] = 0;
    if (!path || !p)
        return PRISM_EINVAL;
    prism_clip_preproc_default(p, 224);   /* CLIPImageProcessor class defaults */
    char *text = NULL;
    size_t n = 0;
    int rc = prism_read_file(path, MAX_CONFIG_BYTES, &text, &n);
    if (rc != PRISM_OK)
        return cfg_err(err, errlen, rc, "cannot read %s", path);
    json_error_t jerr;
    json_t *root = json_loadb(text, n, JSON_REJECT_DUPLICATES, &jerr);
    prism_free(text);
    if (!root || !json_is_object(root)) {
        json_decref(root);
        return cfg_err(err, errlen, PRISM_EINVAL, "%s: not a JSON object", path);
    }
    rc = PRISM_EINVAL;
    const char *bad = NULL;

    json_t *size = json_object_get(root, "size");
    if (json_is_integer(size)) {
        /* Old configs: an int size is the shortest edge for CLIP (default_to_square=False). */
        if (!dim_ok(json_integer_value(size))) { bad = "size"; goto fail; }
        p->shortest_edge = (int)json_integer_value(size);
    } else if (json_is_object(size)) {
        if (json_object_get(size, "shortest_edge")) {
            if (!get_dim(size, "shortest_edge", &p->shortest_edge)) { bad = "size.shortest_edge"; goto fail; }
            if (json_object_get(size, "longest_edge")) { rc = PRISM_ENOTSUP; bad = "size.longest_edge"; goto fail; }
        } else {
            p->shortest_edge = 0;
            if (!get_dim(size, "height", &p->resize_h) || !get_dim(size, "width", &p->resize_w)) {
                bad = "size";
                goto fail;
            }
        }
    } else if (size) {
        bad = "size";
        goto fail;
    }

    json_t *crop = json_object_get(root, "crop_size");
    if (json_is_integer(crop)) {
        if (!dim_ok(json_integer_value(crop))) { bad = "crop_size"; goto fail; }
        p->crop_h = p->crop_w = (int)json_integer_value(crop);
    } else if (json_is_object(crop)) {
        if (!get_dim(crop, "height", &p->crop_h) || !get_dim(crop, "width", &p->crop_w)) {
            bad = "crop_size";
            goto fail;
        }
    } else if (crop) {
        bad = "crop_size";
        goto fail;
    }

    if (!get_bool(root, "do_resize", &p->do_resize)) { bad = "do_resize"; goto fail; }
    if (!get_bool(root, "do_center_crop", &p->do_center_crop)) { bad = "do_center_crop"; goto fail; }
    if (!get_bool(root, "do_rescale", &p->do_rescale)) { bad = "do_rescale"; goto fail; }
    if (!get_bool(root, "do_normalize", &p->do_normalize)) { bad = "do_normalize"; goto fail; }
    if (!get_bool(root, "do_convert_rgb", &p->do_convert_rgb)) { bad = "do_convert_rgb"; goto fail; }

    json_t *rf = json_object_get(root, "rescale_factor");
    if (rf) {
        if (!json_is_number(rf) || !(json_number_value(rf) > 0) || !isfinite(json_number_value(rf))) {
            bad = "rescale_factor";
            goto fail;
        }
        p->rescale_factor_f64 = json_number_value(rf);
        p->rescale_factor = (float)p->rescale_factor_f64;
    }
    if (!get_triplet(root, "image_mean", p->mean)) { bad = "image_mean"; goto fail; }
    if (!get_triplet(root, "image_std", p->std)) { bad = "image_std"; goto fail; }
    for (int c = 0; c < 3; c++)
        if (!(p->std[c] != 0.0f) || !isfinite(p->std[c]) || !isfinite(p->mean[c])) { bad = "image_std"; goto fail; }

    json_t *rs = json_object_get(root, "resample");
    if (rs) {
        if (!json_is_integer(rs)) { bad = "resample"; goto fail; }
        json_int_t f = json_integer_value(rs);
        if (f != PRISM_CLIP_FILTER_BILINEAR && f != PRISM_CLIP_FILTER_BICUBIC) {
            rc = PRISM_ENOTSUP;
            bad = "resample (only 2 = bilinear and 3 = bicubic are implemented)";
            goto fail;
        }
        p->filter = (prism_clip_filter_t)f;
    }
    if (p->do_resize && p->shortest_edge == 0 && (p->resize_h == 0 || p->resize_w == 0)) {
        bad = "size";
        goto fail;
    }
    json_decref(root);
    return PRISM_OK;

fail:
    json_decref(root);
    return cfg_err(err, errlen, rc, "preprocessor config: invalid or unsupported %s", bad);
}

/* ---------------------------------------------------------------- geometry */

int prism_clip_resize_target(const prism_clip_preproc_t *p, int src_w, int src_h, int *out_w, int *out_h)
{
    if (src_w <= 0 || src_h <= 0 || src_w > PRISM_IMAGE_MAX_DIM || src_h > PRISM_IMAGE_MAX_DIM)
        return PRISM_EINVAL;
    if (!p->do_resize) {
        *out_w = src_w;
        *out_h = src_h;
        return PRISM_OK;
    }
    if (p->shortest_edge <= 0) {
        *out_w = p->resize_w;
        *out_h = p->resize_h;
        return PRISM_OK;
    }
    /* get_resize_output_image_size(default_to_square=False): int(size * long / short). Python's
     * int/int true division is correctly rounded, as is this double division of exact values. */
    int s = p->shortest_edge;
    int shrt = src_w <= src_h ? src_w : src_h;
    int lng = src_w <= src_h ? src_h : src_w;
    double l = (double)((int64_t)s * lng) / (double)shrt;
    if (l > PRISM_IMAGE_MAX_DIM)
        return PRISM_ELIMIT;
    int nl = (int)l;
    if (nl < 1)
        return PRISM_ELIMIT;
    if (src_w <= src_h) {
        *out_w = s;
        *out_h = nl;
    } else {
        *out_w = nl;
        *out_h = s;
    }
    return PRISM_OK;
}

void prism_clip_decode_opts(const prism_clip_preproc_t *p, const prism_image_info_t *info,
                            prism_image_decode_opts_t *opts)
{
    int tw = 0, th = 0;
    opts->min_w = opts->min_h = 0;
    /* Without a resize the decoded pixels are used as they are: no scaling allowed. */
    if (!p->do_resize || prism_clip_resize_target(p, info->width, info->height, &tw, &th) != PRISM_OK)
        return;
    prism_image_decode_opts_for_target(opts, info, tw, th);
}

/* Offset of the crop window in the resized image along one axis (negative: zero padding). */
static int crop_offset(const prism_clip_preproc_t *p, int resized, int crop)
{
    if (crop <= resized)
        return (resized - crop) / 2;
    /* transformers' numpy center_crop pads ceil(d/2) before; torchvision pads floor(d/2). */
    int d = crop - resized;
    return p->impl == PRISM_CLIP_RESAMPLE_TORCHVISION ? -(d / 2) : -((d + 1) / 2);
}

/* ---------------------------------------------------------------- plan */

/* Geometry for a decoded image of w x h whose file is geo_w x geo_h, decoded at scale num/denom. */
static int clip_plan(const prism_clip_preproc_t *p, int w, int h, int geo_w, int geo_h, int num, int denom,
                     prism_clip_plan_t *pl)
{
    memset(pl, 0, sizeof *pl);
    if (w <= 0 || h <= 0)
        return PRISM_EINVAL;
    int rw, rh;
    int rc = prism_clip_resize_target(p, geo_w, geo_h, &rw, &rh);
    if (rc != PRISM_OK)
        return rc;
    /* The last decoded pixel of a DCT-scaled decode covers only part of a source block: the
     * resize spans the file's extent in decoded pixels (Pillow's resize box). */
    double ext_w = w, ext_h = h;
    if (num > 0 && denom > 0 && (w != geo_w || h != geo_h)) {
        ext_w = PRISM_MIN((double)geo_w * num / denom, (double)w);
        ext_h = PRISM_MIN((double)geo_h * num / denom, (double)h);
    }
    if (!p->do_resize) {
        /* Without a resize the pixels are taken as decoded. */
        rw = w;
        rh = h;
        ext_w = w;
        ext_h = h;
    }
    if (p->do_center_crop) {
        pl->out_w = p->crop_w;
        pl->out_h = p->crop_h;
        pl->off_x = crop_offset(p, rw, p->crop_w);
        pl->off_y = crop_offset(p, rh, p->crop_h);
    } else {
        pl->out_w = rw;
        pl->out_h = rh;
    }
    prism_resample_spec_t *s = &pl->rs;
    s->filter = p->filter == PRISM_CLIP_FILTER_BILINEAR ? &prism_resample_bilinear : &prism_resample_bicubic;
    s->arith = p->impl == PRISM_CLIP_RESAMPLE_TORCHVISION ? PRISM_RESAMPLE_TORCH : PRISM_RESAMPLE_PIL;
    s->in_w = w;
    s->in_h = h;
    s->extent_w = ext_w;
    s->extent_h = ext_h;
    s->out_w = rw;
    s->out_h = rh;
    s->x0 = PRISM_MAX(0, pl->off_x);
    s->x1 = PRISM_MIN(rw, pl->off_x + pl->out_w);
    s->y0 = PRISM_MAX(0, pl->off_y);
    s->y1 = PRISM_MIN(rh, pl->off_y + pl->out_h);
    return s->x0 < s->x1 && s->y0 < s->y1 ? PRISM_OK : PRISM_EINVAL;
}

static int clip_plan_img(const prism_clip_preproc_t *p, const prism_image_t *img, prism_clip_plan_t *pl)
{
    return clip_plan(p, img->w, img->h, img->src_w > 0 ? img->src_w : img->w, img->src_h > 0 ? img->src_h : img->h,
                     img->scale_num, img->scale_denom, pl);
}

size_t prism_clip_preprocess_workspace_bytes(const prism_clip_preproc_t *p, int src_w, int src_h)
{
    if (!p || src_w <= 0 || src_h <= 0 || src_w > PRISM_IMAGE_MAX_DIM || src_h > PRISM_IMAGE_MAX_DIM)
        return 0;
    prism_clip_plan_t pl;
    if (clip_plan(p, src_w, src_h, src_w, src_h, 1, 1, &pl) != PRISM_OK)
        return 0;
    /* A DCT-scaled decode takes its geometry from the file's size, which may round to a resize
     * target a pixel or two away from this one: slightly larger windows and kernels. */
    const prism_resample_spec_t *s = &pl.rs;
    int kx = prism_resample_ksize(s->filter, s->extent_w, s->out_w) + 4;
    int ky = prism_resample_ksize(s->filter, s->extent_h, s->out_h) + 4;
    return prism_resample_workspace_bound(src_w + 4, s->x1 - s->x0 + 4, s->y1 - s->y0 + 4, kx, ky);
}

size_t prism_clip_preprocess_workspace_bytes_img(const prism_clip_preproc_t *p, const prism_image_t *img)
{
    if (!p || !img || img->w <= 0 || img->h <= 0)
        return 0;
    prism_clip_plan_t pl;
    if (clip_plan_img(p, img, &pl) != PRISM_OK)
        return 0;
    return prism_resample_workspace_bytes(&pl.rs);
}

size_t prism_clip_workspace_bound(const prism_clip_preproc_t *p, uint64_t max_pixels)
{
    if (!p || max_pixels == 0)
        return 0;
    uint64_t dim = PRISM_MIN(max_pixels, (uint64_t)PRISM_IMAGE_MAX_DIM);
    uint64_t shrt = 1;   /* the short side: at most sqrt(max_pixels) */
    while ((shrt + 1) * (shrt + 1) <= max_pixels && shrt < dim)
        shrt++;
    const prism_resample_filter_t *f = p->filter == PRISM_CLIP_FILTER_BILINEAR ? &prism_resample_bilinear
                                                                                : &prism_resample_bicubic;
    /* Largest input/output ratio per axis. Shortest-edge resize: short/S on the short side and,
     * because the long side is floor(S * long / short), at most short/(S - 1) on the long one. */
    double sx = 1.0, sy = 1.0;
    int max_rw = PRISM_IMAGE_MAX_DIM, max_rh = PRISM_IMAGE_MAX_DIM;
    if (p->do_resize && p->shortest_edge > 0) {
        int se = p->shortest_edge;
        sx = sy = se > 1 ? (double)shrt / (se - 1) : 2.0 * (double)shrt;
    } else if (p->do_resize) {
        sx = (double)dim / p->resize_w;
        sy = (double)dim / p->resize_h;
        max_rw = p->resize_w;
        max_rh = p->resize_h;
    }
    int kx = prism_resample_ksize(f, PRISM_MAX(sx, 1.0) + 1.0, 1) + 2;
    int ky = prism_resample_ksize(f, PRISM_MAX(sy, 1.0) + 1.0, 1) + 2;
    int wx = p->do_center_crop ? PRISM_MIN(p->crop_w, max_rw) : max_rw;
    int wy = p->do_center_crop ? PRISM_MIN(p->crop_h, max_rh) : max_rh;
    return prism_resample_workspace_bound((int)dim, wx, wy, kx, ky);
}

/* ---------------------------------------------------------------- normalization */

/* uint8 -> normalized float, bit-compatible with the chosen reference. */
static void norm_init(const prism_clip_preproc_t *p, float lut[3][256])
{
    for (int c = 0; c < 3; c++) {
        float mean = p->mean[c], std = p->std[c];
        if (p->impl == PRISM_CLIP_RESAMPLE_TORCHVISION && p->do_rescale && p->do_normalize) {
            /* torchvision backend fuses: mean / rescale and std / rescale in float32. */
            float inv = (float)(1.0 / p->rescale_factor_f64);
            mean = mean * inv;
            std = std * inv;
        }
        for (int u = 0; u < 256; u++) {
            float v;
            if (p->impl == PRISM_CLIP_RESAMPLE_TORCHVISION) {
                if (p->do_normalize)
                    v = ((float)u - mean) / std;
                else if (p->do_rescale)
                    v = (float)u * p->rescale_factor;
                else
                    v = (float)u;
            } else {
                /* numpy: float64(u) * scale -> float32, then (x - mean32) / std32 in float32. */
                v = p->do_rescale ? (float)((double)u * p->rescale_factor_f64) : (float)u;
                if (p->do_normalize)
                    v = (v - mean) / std;
            }
            lut[c][u] = v;
        }
    }
}

/* ---------------------------------------------------------------- streaming */

static int stream_emit(void *ud, int y, const uint8_t *const planes[3])
{
    prism_clip_stream_t *s = ud;
    const prism_clip_plan_t *pl = &s->plan;
    size_t plane = (size_t)pl->out_w * pl->out_h;
    size_t orow = (size_t)(y - pl->off_y) * pl->out_w + (size_t)(pl->rs.x0 - pl->off_x);
    int wx = pl->rs.x1 - pl->rs.x0;
    for (int c = 0; c < 3; c++) {
        float *o = s->out + c * plane + orow;
        const float *lut = s->lut[c];
        const uint8_t *v = planes[c];
        for (int x = 0; x < wx; x++)
            o[x] = lut[v[x]];
    }
    return PRISM_OK;
}

static int stream_begin(void *ud, const prism_image_t *geom)
{
    prism_clip_stream_t *s = ud;
    prism_clip_plan_t *pl = &s->plan;
    int rc = clip_plan_img(s->p, geom, pl);
    if (rc != PRISM_OK)
        return rc;
    /* Padding (crop larger than the resized image) holds zero pixels, normalized like any other. */
    int wx = pl->rs.x1 - pl->rs.x0, wy = pl->rs.y1 - pl->rs.y0;
    if (wx < pl->out_w || wy < pl->out_h) {
        size_t plane = (size_t)pl->out_w * pl->out_h;
        for (int c = 0; c < 3; c++)
            for (size_t i = 0; i < plane; i++)
                s->out[c * plane + i] = s->lut[c][0];
    }
    rc = prism_resample_init(&s->rs, &pl->rs, s->ws, s->ws_bytes, stream_emit, s);
    if (rc == PRISM_OK)
        s->begun = true;
    return rc;
}

static int stream_row(void *ud, int y, const uint8_t *rgb)
{
    prism_clip_stream_t *s = ud;
    if (!s->begun || y != s->rs.pushed)
        return PRISM_EINVAL;
    return prism_resample_push(&s->rs, rgb);
}

prism_image_sink_t prism_clip_stream_sink(prism_clip_stream_t *s, const prism_clip_preproc_t *p, void *ws,
                                          size_t ws_bytes, float *out)
{
    memset(s, 0, sizeof *s);
    s->p = p;
    s->ws = ws;
    s->ws_bytes = ws_bytes;
    s->out = out;
    norm_init(p, s->lut);
    return (prism_image_sink_t){.begin = stream_begin, .row = stream_row, .ud = s};
}

int prism_clip_stream_finish(const prism_clip_stream_t *s)
{
    return s && s->begun && prism_resample_done(&s->rs) ? PRISM_OK : PRISM_ECORRUPT;
}

int prism_clip_preprocess(const prism_clip_preproc_t *p, const prism_image_t *img, void *workspace,
                          size_t ws_bytes, float *out)
{
    if (!p || !img || !img->rgb || !out || img->w <= 0 || img->h <= 0)
        return PRISM_EINVAL;
    prism_clip_stream_t s;
    prism_image_sink_t sink = prism_clip_stream_sink(&s, p, workspace, ws_bytes, out);
    prism_image_t g = *img;
    g.rgb = NULL;
    int rc = sink.begin(sink.ud, &g);
    for (int y = 0; rc == PRISM_OK && y < img->h; y++)
        rc = sink.row(sink.ud, y, img->rgb + (size_t)y * img->w * 3);
    return rc == PRISM_OK ? prism_clip_stream_finish(&s) : rc;
}
