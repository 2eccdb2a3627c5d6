/* CLIP image preprocessing: config loading, HF geometry, and a Pillow-exact separable resampler
 * that only computes the center-crop window. */
#include "image/clip.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

/* OpenAI CLIP statistics (transformers OPENAI_CLIP_MEAN / OPENAI_CLIP_STD). */
static const double clip_mean[3] = {0.48145466, 0.4578275, 0.40821073};
static const double clip_std[3] = {0.26862954, 0.26130258, 0.27577711};

#define PIL_PRECISION_BITS 22   /* Pillow Resample.c: 32 - 8 - 2 */
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

/* ---------------------------------------------------------------- resampler */

static double filter_support(prism_clip_filter_t f) { return f == PRISM_CLIP_FILTER_BILINEAR ? 1.0 : 2.0; }

static double filter_eval(prism_clip_filter_t f, double x)
{
    if (x < 0.0)
        x = -x;
    if (f == PRISM_CLIP_FILTER_BILINEAR)
        return x < 1.0 ? 1.0 - x : 0.0;
    /* Pillow bicubic_filter, a = -0.5 (torch's aa cubic uses the same). */
    const double a = -0.5;
    if (x < 1.0)
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
    if (x < 2.0)
        return (((x - 5) * x + 8) * x - 4) * a;
    return 0.0;
}

typedef struct {
    int in, out;          /* axis sizes */
    double scale, support, filterscale;
    int ksize;            /* max taps per output sample */
    int precision;        /* fixed-point bits */
} axis_t;

/* extent: how many input pixels the output spans; the input size except after DCT scaling, where
 * the last decoded pixel covers only part of a source block (Pillow's resize box). */
static void axis_init(axis_t *a, const prism_clip_preproc_t *p, int in, double extent, int out)
{
    a->in = in;
    a->out = out;
    a->scale = extent / out;
    a->filterscale = a->scale < 1.0 ? 1.0 : a->scale;
    a->support = filter_support(p->filter) * a->filterscale;
    a->ksize = (int)ceil(a->support) * 2 + 1;
    a->precision = PIL_PRECISION_BITS;
}

/* Normalized double weights of output sample i (Pillow precompute_coeffs / torch
 * _compute_indices_min_size_weights_aa, identical for in0 = 0). Returns the tap count. */
static int axis_weights(const axis_t *a, prism_clip_filter_t f, int i, double *k, int *xmin_out)
{
    double center = (i + 0.5) * a->scale;
    double ss = 1.0 / a->filterscale;
    int xmin = (int)(center - a->support + 0.5);
    if (xmin < 0)
        xmin = 0;
    int xmax = (int)(center + a->support + 0.5);
    if (xmax > a->in)
        xmax = a->in;
    xmax -= xmin;
    if (xmax > a->ksize)
        xmax = a->ksize;   /* torch clamps; Pillow never gets here */
    if (xmax < 0)
        xmax = 0;
    double ww = 0.0;
    for (int x = 0; x < xmax; x++) {
        double w = filter_eval(f, (x + xmin - center + 0.5) * ss);
        k[x] = w;
        ww += w;
    }
    if (ww != 0.0)
        for (int x = 0; x < xmax; x++)
            k[x] /= ww;
    *xmin_out = xmin;
    return xmax;
}

static int32_t to_fixed(double v, int precision)
{
    double s = v * (double)(1 << precision);
    return (int32_t)(s < 0 ? -0.5 + s : 0.5 + s);
}

/* torch picks one precision per axis from the largest weight over every output sample so the
 * weights fit int16. */
static void axis_torch_precision(axis_t *a, prism_clip_filter_t f, double *scratch)
{
    double wt_max = 0.0;
    for (int i = 0; i < a->out; i++) {
        int xmin;
        int n = axis_weights(a, f, i, scratch, &xmin);
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
    a->precision = prec;
}

/* Fixed-point coefficients for output samples [o0, o1): bounds[2*(i-o0)] = {xmin, n}. */
static void axis_coeffs(const axis_t *a, prism_clip_filter_t f, int o0, int o1, int32_t *bounds,
                        int32_t *kk, double *scratch)
{
    for (int i = o0; i < o1; i++) {
        int xmin;
        int n = axis_weights(a, f, i, scratch, &xmin);
        int32_t *k = kk + (size_t)(i - o0) * a->ksize;
        for (int x = 0; x < a->ksize; x++)
            k[x] = x < n ? to_fixed(scratch[x], a->precision) : 0;
        bounds[2 * (i - o0)] = xmin;
        bounds[2 * (i - o0) + 1] = n;
    }
}

static inline uint8_t clip8(int32_t v, int precision)
{
    /* Pillow's clip8 on (sum + half) with ss starting at 1 << (precision - 1). */
    if (v >= (int32_t)((uint32_t)256 << precision))
        return 255;
    if (v <= 0)
        return 0;
    return (uint8_t)(v >> precision);
}

typedef struct {
    int rw, rh;               /* resized image size */
    int off_x, off_y;         /* crop offset in resized coordinates (negative: padding) */
    int out_w, out_h;         /* output size */
    int x0, x1, y0, y1;       /* valid window in resized coordinates */
    bool need_h, need_v;
    axis_t ax, ay;
    int row_first, row_count; /* source rows the vertical pass reads */
    size_t off_hb, off_hk, off_vb, off_vk, off_scratch, off_acc, off_tmp, total;
} plan_t;

static size_t align16(size_t x) { return (x + 15) & ~(size_t)15; }

/* Geometry and workspace layout for decoded size (in_w, in_h), resize geometry from (geo_w, geo_h),
 * resampling extent (ext_w, ext_h) in decoded pixels. The horizontal-pass buffer is sized for every
 * source row, an upper bound on the rows the vertical pass reads. */
static int plan_make(const prism_clip_preproc_t *p, int in_w, int in_h, int geo_w, int geo_h, double ext_w,
                     double ext_h, plan_t *pl)
{
    memset(pl, 0, sizeof *pl);
    int rc = prism_clip_resize_target(p, geo_w, geo_h, &pl->rw, &pl->rh);
    if (rc != PRISM_OK)
        return rc;
    if (!p->do_resize) {
        /* Without a resize the pixels are taken as decoded. */
        pl->rw = in_w;
        pl->rh = in_h;
    }
    if (p->do_center_crop) {
        pl->out_w = p->crop_w;
        pl->out_h = p->crop_h;
        pl->off_x = crop_offset(p, pl->rw, p->crop_w);
        pl->off_y = crop_offset(p, pl->rh, p->crop_h);
    } else {
        pl->out_w = pl->rw;
        pl->out_h = pl->rh;
    }
    pl->x0 = PRISM_MAX(0, pl->off_x);
    pl->x1 = PRISM_MIN(pl->rw, pl->off_x + pl->out_w);
    pl->y0 = PRISM_MAX(0, pl->off_y);
    pl->y1 = PRISM_MIN(pl->rh, pl->off_y + pl->out_h);
    if (!p->do_resize)
        ext_w = in_w, ext_h = in_h;
    pl->need_h = pl->rw != in_w || ext_w != in_w;
    pl->need_v = pl->rh != in_h || ext_h != in_h;
    axis_init(&pl->ax, p, in_w, ext_w, pl->rw);
    axis_init(&pl->ay, p, in_h, ext_h, pl->rh);
    int wx = pl->x1 - pl->x0, wy = pl->y1 - pl->y0;
    size_t ks = (size_t)PRISM_MAX(pl->ax.ksize, pl->ay.ksize);
    size_t o = 0;
    pl->off_hb = o; o = align16(o + (size_t)wx * 2 * sizeof(int32_t));
    pl->off_hk = o; o = align16(o + (size_t)wx * pl->ax.ksize * sizeof(int32_t));
    pl->off_vb = o; o = align16(o + (size_t)wy * 2 * sizeof(int32_t));
    pl->off_vk = o; o = align16(o + (size_t)wy * pl->ay.ksize * sizeof(int32_t));
    pl->off_scratch = o; o = align16(o + ks * sizeof(double));
    pl->off_acc = o; o = align16(o + (size_t)wx * 3 * sizeof(int32_t));
    pl->off_tmp = o;
    /* Horizontal output for every source row the vertical pass may read (at most in_h rows). */
    if (pl->need_h)
        o = align16(o + (size_t)wx * 3 * (size_t)in_h);
    pl->total = o;
    return PRISM_OK;
}

size_t prism_clip_preprocess_workspace_bytes(const prism_clip_preproc_t *p, int src_w, int src_h)
{
    if (!p || src_w <= 0 || src_h <= 0 || src_w > PRISM_IMAGE_MAX_DIM || src_h > PRISM_IMAGE_MAX_DIM)
        return 0;
    /* A DCT-scaled decode takes its geometry from the file's size, which may round to a resize
     * target a pixel or two away from this one; plan for slightly larger windows and kernels. */
    plan_t pl;
    if (plan_make(p, src_w, src_h, src_w, src_h, src_w, src_h, &pl) != PRISM_OK)
        return 0;
    size_t wx = (size_t)(pl.x1 - pl.x0) + 4, wy = (size_t)(pl.y1 - pl.y0) + 4;
    size_t kx = (size_t)pl.ax.ksize + 4, ky = (size_t)pl.ay.ksize + 4;
    size_t ks = PRISM_MAX(kx, ky);
    size_t total = 7 * 16;
    total += wx * 2 * 4 + wx * kx * 4 + wy * 2 * 4 + wy * ky * 4 + ks * 8 + wx * 3 * 4;
    total += wx * 3 * (size_t)src_h;
    return total;
}

/* Plan for a decoded image: geometry from the file's size, resampling extent corrected for the
 * partial last block of a DCT-scaled decode. */
static int plan_for_image(const prism_clip_preproc_t *p, const prism_image_t *img, plan_t *pl)
{
    int geo_w = img->src_w > 0 ? img->src_w : img->w;
    int geo_h = img->src_h > 0 ? img->src_h : img->h;
    double ext_w = img->w, ext_h = img->h;
    if (img->scale_num > 0 && img->scale_denom > 0 && img->src_w > 0 && img->src_h > 0 &&
        (img->w != img->src_w || img->h != img->src_h)) {
        ext_w = PRISM_MIN((double)img->src_w * img->scale_num / img->scale_denom, (double)img->w);
        ext_h = PRISM_MIN((double)img->src_h * img->scale_num / img->scale_denom, (double)img->h);
    }
    return plan_make(p, img->w, img->h, geo_w, geo_h, ext_w, ext_h, pl);
}

size_t prism_clip_preprocess_workspace_bytes_img(const prism_clip_preproc_t *p, const prism_image_t *img)
{
    if (!p || !img || img->w <= 0 || img->h <= 0)
        return 0;
    plan_t pl;
    if (plan_for_image(p, img, &pl) != PRISM_OK)
        return 0;
    return pl.total;
}

static void horizontal_pass(const uint8_t *src, int src_w, int row_first, int row_count, const plan_t *pl,
                            const int32_t *hb, const int32_t *hk, uint8_t *tmp)
{
    int wx = pl->x1 - pl->x0, ks = pl->ax.ksize, prec = pl->ax.precision;
    int32_t half = (int32_t)1 << (prec - 1);
    if (prec == 0)
        half = 0;
    for (int r = 0; r < row_count; r++) {
        const uint8_t *in = src + (size_t)(row_first + r) * src_w * 3;
        uint8_t *o = tmp + (size_t)r * wx * 3;
        for (int x = 0; x < wx; x++) {
            const int32_t *k = hk + (size_t)x * ks;
            const uint8_t *px = in + (size_t)hb[2 * x] * 3;
            int n = hb[2 * x + 1];
            int32_t s0 = half, s1 = half, s2 = half;
            for (int t = 0; t < n; t++) {
                s0 += px[t * 3 + 0] * k[t];
                s1 += px[t * 3 + 1] * k[t];
                s2 += px[t * 3 + 2] * k[t];
            }
            o[x * 3 + 0] = clip8(s0, prec);
            o[x * 3 + 1] = clip8(s1, prec);
            o[x * 3 + 2] = clip8(s2, prec);
        }
    }
}

/* uint8 -> normalized float, bit-compatible with the chosen reference. */
typedef struct {
    float lut[3][256];
} norm_t;

static void norm_init(const prism_clip_preproc_t *p, norm_t *nt)
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
            nt->lut[c][u] = v;
        }
    }
}

int prism_clip_preprocess(const prism_clip_preproc_t *p, const prism_image_t *img, void *workspace,
                          size_t ws_bytes, float *out)
{
    if (!p || !img || !img->rgb || !out || img->w <= 0 || img->h <= 0)
        return PRISM_EINVAL;
    plan_t pl;
    int rc = plan_for_image(p, img, &pl);
    if (rc != PRISM_OK)
        return rc;
    if (pl.total > ws_bytes || (pl.total && !workspace))
        return PRISM_ELIMIT;
    uint8_t *ws = workspace;
    int32_t *hb = (int32_t *)(ws + pl.off_hb), *hk = (int32_t *)(ws + pl.off_hk);
    int32_t *vb = (int32_t *)(ws + pl.off_vb), *vk = (int32_t *)(ws + pl.off_vk);
    double *scratch = (double *)(ws + pl.off_scratch);
    int32_t *acc = (int32_t *)(ws + pl.off_acc);
    uint8_t *tmp = ws + pl.off_tmp;
    int wx = pl.x1 - pl.x0, wy = pl.y1 - pl.y0;

    norm_t nt;
    norm_init(p, &nt);
    size_t plane = (size_t)pl.out_w * pl.out_h;
    /* Padding (crop larger than the resized image) holds zero pixels, normalized like any other. */
    if (wx < pl.out_w || wy < pl.out_h)
        for (int c = 0; c < 3; c++)
            for (size_t i = 0; i < plane; i++)
                out[c * plane + i] = nt.lut[c][0];
    if (wx <= 0 || wy <= 0)
        return PRISM_OK;

    if (p->impl == PRISM_CLIP_RESAMPLE_TORCHVISION) {
        if (pl.need_h)
            axis_torch_precision(&pl.ax, p->filter, scratch);
        if (pl.need_v)
            axis_torch_precision(&pl.ay, p->filter, scratch);
    }
    /* Source rows feeding the window: all of them from the vertical coefficients, or the window
     * itself when there is no vertical pass. */
    int row_first, row_count;
    if (pl.need_v) {
        axis_coeffs(&pl.ay, p->filter, pl.y0, pl.y1, vb, vk, scratch);
        row_first = vb[0];
        int last = 0;
        for (int y = 0; y < wy; y++)
            last = PRISM_MAX(last, vb[2 * y] + vb[2 * y + 1]);
        row_count = PRISM_MAX(last - row_first, 0);
    } else {
        row_first = pl.y0;
        row_count = wy;
    }
    /* Rows (rw-wide window) the vertical pass reads; either the horizontal output or the source. */
    const uint8_t *rows;
    size_t row_stride, col0;
    if (pl.need_h) {
        axis_coeffs(&pl.ax, p->filter, pl.x0, pl.x1, hb, hk, scratch);
        horizontal_pass(img->rgb, img->w, row_first, row_count, &pl, hb, hk, tmp);
        rows = tmp;
        row_stride = (size_t)wx * 3;
        col0 = 0;
    } else {
        rows = img->rgb + (size_t)row_first * img->w * 3;
        row_stride = (size_t)img->w * 3;
        col0 = (size_t)pl.x0 * 3;
    }

    int prec = pl.ay.precision, ks = pl.ay.ksize;
    int32_t half = prec ? (int32_t)1 << (prec - 1) : 0;
    for (int y = 0; y < wy; y++) {
        size_t orow = (size_t)(pl.y0 + y - pl.off_y) * pl.out_w + (size_t)(pl.x0 - pl.off_x);
        float *o0 = out + orow, *o1 = out + plane + orow, *o2 = out + 2 * plane + orow;
        if (!pl.need_v) {
            const uint8_t *r = rows + (size_t)y * row_stride + col0;
            for (int x = 0; x < wx; x++) {
                o0[x] = nt.lut[0][r[x * 3 + 0]];
                o1[x] = nt.lut[1][r[x * 3 + 1]];
                o2[x] = nt.lut[2][r[x * 3 + 2]];
            }
            continue;
        }
        /* Row-major accumulation (tap outer, pixel inner) keeps the reads sequential. */
        const int32_t *k = vk + (size_t)y * ks;
        int ymin = vb[2 * y] - row_first, n = vb[2 * y + 1];
        int m = wx * 3;
        for (int i = 0; i < m; i++)
            acc[i] = half;
        for (int t = 0; t < n; t++) {
            const uint8_t *r = rows + (size_t)(ymin + t) * row_stride + col0;
            int32_t kt = k[t];
            for (int i = 0; i < m; i++)
                acc[i] += r[i] * kt;
        }
        for (int x = 0; x < wx; x++) {
            o0[x] = nt.lut[0][clip8(acc[x * 3 + 0], prec)];
            o1[x] = nt.lut[1][clip8(acc[x * 3 + 1], prec)];
            o2[x] = nt.lut[2][clip8(acc[x * 3 + 2], prec)];
        }
    }
    return PRISM_OK;
}
