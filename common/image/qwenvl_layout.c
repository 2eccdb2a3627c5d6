/* Qwen-VL image layout: the processor's config, smart_resize with HF's float64 arithmetic, and the
 * M-RoPE positions of a prompt's tokens. Pure arithmetic over sizes (no pixels): part of the leaf
 * prism_image_layout that the router and the prefill worker link. */
#include "image/qwenvl_proc.h"
#include "image/layout_json.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define ERR(...) do { if (err && errlen) snprintf(err, errlen, __VA_ARGS__); } while (0)

/* Largest min/max_pixels a config may ask for: the area of the largest image dimension squared. */
#define MAX_CONFIG_PIXELS ((int64_t)PRISM_IMAGE_MAX_DIM * PRISM_IMAGE_MAX_DIM)

void prism_qwenvl_proc_default(prism_qwenvl_proc_t *p)
{
    static const float mean[3] = {0.48145466f, 0.4578275f, 0.40821073f};
    static const float std[3] = {0.26862954f, 0.26130258f, 0.27577711f};
    memset(p, 0, sizeof *p);
    p->patch = 14;
    p->merge = 2;
    p->temporal = 2;
    p->min_pixels = 56 * 56;
    p->max_pixels = 28 * 28 * 1280;
    p->do_resize = p->do_rescale = p->do_normalize = true;
    p->rescale_factor = 1.0 / 255.0;
    memcpy(p->mean, mean, sizeof mean);
    memcpy(p->std, std, sizeof std);
}

bool prism_qwenvl_proc_valid(const prism_qwenvl_proc_t *p)
{
    return p && p->patch >= 1 && p->patch <= PRISM_QWENVL_MAX_PATCH && p->merge >= 1 &&
           p->merge <= PRISM_QWENVL_MAX_MERGE && p->temporal >= 1 && p->temporal <= 16 && p->min_pixels >= 0 &&
           p->max_pixels >= 1 && p->min_pixels <= MAX_CONFIG_PIXELS && p->max_pixels <= MAX_CONFIG_PIXELS &&
           p->rescale_factor > 0 && p->std[0] != 0 && p->std[1] != 0 && p->std[2] != 0 && p->do_resize;
}

/* An integer JSON value in [lo, hi] (a float with an integral value counts: configs write 3136.0). */
static bool opt_int64(json_t *o, const char *k, int64_t *v, int64_t lo, int64_t hi)
{
    double d = (double)*v;
    if (!prism_layout_opt_num(o, k, &d)) return false;
    if (!(d >= (double)lo && d <= (double)hi) || d != floor(d)) return false;
    *v = (int64_t)d;
    return true;
}

int prism_qwenvl_proc_load_dir(const char *dir, prism_qwenvl_proc_t *p, char *err, size_t errlen)
{
    char path[4096];
    int rc;
    prism_qwenvl_proc_default(p);
    if ((rc = prism_path_join(path, sizeof path, dir, "preprocessor_config.json")) != PRISM_OK) return rc;
    json_t *j = prism_layout_load_json(path, false, &rc, err, errlen);
    if (!j) return rc == PRISM_OK ? PRISM_EINVAL : rc;
    const char *bad = NULL;
    int64_t patch = p->patch, merge = p->merge, temporal = p->temporal;
    /* Qwen2VLImageProcessor.__init__: size first, then min_pixels / max_pixels override it. */
    json_t *size = json_object_get(j, "size");
    if (size && !json_is_null(size)) {
        if (!json_is_object(size) || !opt_int64(size, "shortest_edge", &p->min_pixels, 0, MAX_CONFIG_PIXELS) ||
            !opt_int64(size, "longest_edge", &p->max_pixels, 1, MAX_CONFIG_PIXELS))
            bad = "size (must be {shortest_edge, longest_edge} in pixels)";
    }
    if (!bad && !opt_int64(j, "min_pixels", &p->min_pixels, 0, MAX_CONFIG_PIXELS)) bad = "min_pixels";
    if (!bad && !opt_int64(j, "max_pixels", &p->max_pixels, 1, MAX_CONFIG_PIXELS)) bad = "max_pixels";
    if (!bad && !opt_int64(j, "patch_size", &patch, 1, PRISM_QWENVL_MAX_PATCH)) bad = "patch_size";
    if (!bad && !opt_int64(j, "merge_size", &merge, 1, PRISM_QWENVL_MAX_MERGE)) bad = "merge_size";
    if (!bad && !opt_int64(j, "temporal_patch_size", &temporal, 1, 16)) bad = "temporal_patch_size";
    if (!bad && !prism_layout_opt_num(j, "rescale_factor", &p->rescale_factor)) bad = "rescale_factor";
    if (!bad && !prism_layout_opt_triplet(j, "image_mean", p->mean)) bad = "image_mean";
    if (!bad && !prism_layout_opt_triplet(j, "image_std", p->std)) bad = "image_std";
    if (!bad && !prism_layout_opt_bool(j, "do_resize", &p->do_resize)) bad = "do_resize";
    if (!bad && !prism_layout_opt_bool(j, "do_rescale", &p->do_rescale)) bad = "do_rescale";
    if (!bad && !prism_layout_opt_bool(j, "do_normalize", &p->do_normalize)) bad = "do_normalize";
    double resample = 3;
    if (!bad && (!prism_layout_opt_num(j, "resample", &resample) || (resample != 2 && resample != 3)))
        bad = "resample (bilinear 2 or bicubic 3)";
    json_decref(j);
    p->patch = (int)patch;
    p->merge = (int)merge;
    p->temporal = (int)temporal;
    p->bilinear = resample == 2;
    if (!bad && !p->do_resize) bad = "do_resize (false: the patch grid would follow the raw image size)";
    if (bad) {
        ERR("%s: unsupported or invalid %s", path, bad);
        return PRISM_ENOTSUP;
    }
    if (!prism_qwenvl_proc_valid(p)) {
        ERR("%s: patch_size %d, merge_size %d, min_pixels %lld, max_pixels %lld out of range", path, p->patch, p->merge,
            (long long)p->min_pixels, (long long)p->max_pixels);
        return PRISM_ENOTSUP;
    }
    return PRISM_OK;
}

/* ---------------------------------------------------------------- geometry */

int prism_qwenvl_smart_resize(int h, int w, int factor, int64_t min_pixels, int64_t max_pixels, int *out_h, int *out_w)
{
    if (h < 1 || w < 1 || h > PRISM_IMAGE_MAX_DIM || w > PRISM_IMAGE_MAX_DIM || factor < 1) return PRISM_EINVAL;
    /* max(h, w) / min(h, w) > 200, Python true division */
    if ((double)PRISM_MAX(h, w) / (double)PRISM_MIN(h, w) > 200.0) return PRISM_EINVAL;
    /* round() is round-half-even, which rint() is in the default rounding mode. */
    double hb = rint((double)h / factor) * factor, wb = rint((double)w / factor) * factor;
    if (hb * wb > (double)max_pixels) {
        double beta = sqrt((double)((int64_t)h * w) / (double)max_pixels);
        hb = PRISM_MAX((double)factor, floor((double)h / beta / factor) * factor);
        wb = PRISM_MAX((double)factor, floor((double)w / beta / factor) * factor);
    } else if (hb * wb < (double)min_pixels) {
        double beta = sqrt((double)min_pixels / (double)((int64_t)h * w));
        hb = ceil((double)h * beta / factor) * factor;
        wb = ceil((double)w * beta / factor) * factor;
    }
    if (hb < factor || wb < factor || hb > 1e9 || wb > 1e9) return PRISM_EINVAL;
    *out_h = (int)hb;
    *out_w = (int)wb;
    return PRISM_OK;
}

int prism_qwenvl_grid_px(const prism_qwenvl_proc_t *p, int64_t min_pixels, int64_t max_pixels, int w, int h,
                         prism_qwenvl_grid_t *g)
{
    if (!prism_qwenvl_proc_valid(p) || min_pixels < 0 || max_pixels < 1) return PRISM_EINVAL;
    int factor = p->patch * p->merge, rh, rw;
    int rc = prism_qwenvl_smart_resize(h, w, factor, min_pixels, max_pixels, &rh, &rw);
    if (rc != PRISM_OK) return rc;
    /* Resizes to more than the largest image we can hold are refused like the image itself. */
    if (rh > PRISM_IMAGE_MAX_DIM || rw > PRISM_IMAGE_MAX_DIM) return PRISM_EINVAL;
    memset(g, 0, sizeof *g);
    g->resized_h = rh;
    g->resized_w = rw;
    g->grid_h = rh / p->patch;
    g->grid_w = rw / p->patch;
    g->n_patches = g->grid_h * g->grid_w;
    g->tok_h = g->grid_h / p->merge;
    g->tok_w = g->grid_w / p->merge;
    g->n_tokens = g->tok_h * g->tok_w;
    return PRISM_OK;
}

int prism_qwenvl_grid(const prism_qwenvl_proc_t *p, int w, int h, prism_qwenvl_grid_t *g)
{
    return p ? prism_qwenvl_grid_px(p, p->min_pixels, p->max_pixels, w, h, g) : PRISM_EINVAL;
}

int64_t prism_qwenvl_max_tokens(const prism_qwenvl_proc_t *p)
{
    if (!prism_qwenvl_proc_valid(p)) return 0;
    double f = (double)p->patch * p->merge, mx = (double)p->max_pixels, mn = (double)p->min_pixels;
    /* rounding only, or the max branch: at most max_pixels; the max branch with the short side
     * clamped to f: the long one is at most sqrt(max * w / h) <= sqrt(200 max); the min branch:
     * (h b + f)(w b + f) = min + f b (h + w) + f^2 with b (h + w) = sqrt(min) (sqrt(r) + 1/sqrt(r)),
     * r = w / h <= 200 */
    double a = mx;
    double b = f * sqrt(200.0 * mx);
    double c = mn + f * sqrt(mn) * (sqrt(200.0) + 1.0 / sqrt(200.0)) + f * f;
    double px = PRISM_MAX(a, PRISM_MAX(b, c));
    return (int64_t)ceil(px / (f * f));
}

int64_t prism_qwenvl_max_pixels_for_tokens(const prism_qwenvl_proc_t *p, int64_t max_tokens)
{
    int64_t f = (int64_t)p->patch * p->merge;
    return max_tokens > 0 ? max_tokens * f * f : 0;
}

/* ---------------------------------------------------------------- M-RoPE */

int prism_mrope_positions(const prism_mrope_image_t *imgs, int n_imgs, int32_t p0, int32_t n, int32_t *pos, size_t ld)
{
    if (n_imgs < 0 || p0 < 0 || n < 0 || (n_imgs && !imgs) || (n && !pos) || (n && ld < (size_t)n)) return PRISM_EINVAL;
    int64_t end = 0;
    for (int i = 0; i < n_imgs; i++) {
        if (imgs[i].rows < 1 || imgs[i].cols < 1 || imgs[i].offset < end) return PRISM_EINVAL;
        end = (int64_t)imgs[i].offset + (int64_t)imgs[i].rows * imgs[i].cols;
        if (end > INT32_MAX) return PRISM_EINVAL;
    }
    int64_t shift = 0;
    int i = 0;
    for (int32_t k = p0; k < p0 + n;) {
        /* images that end before k only move the shift */
        while (i < n_imgs && (int64_t)imgs[i].offset + (int64_t)imgs[i].rows * imgs[i].cols <= k) {
            shift += PRISM_MAX(imgs[i].rows, imgs[i].cols) - (int64_t)imgs[i].rows * imgs[i].cols;
            i++;
        }
        size_t o = (size_t)(k - p0);
        if (i < n_imgs && k >= imgs[i].offset) {
            int64_t j = k - imgs[i].offset, s = imgs[i].offset + shift;
            pos[o] = (int32_t)s;
            pos[ld + o] = (int32_t)(s + j / imgs[i].cols);
            pos[2 * ld + o] = (int32_t)(s + j % imgs[i].cols);
        } else {
            pos[o] = pos[ld + o] = pos[2 * ld + o] = (int32_t)(k + shift);
        }
        k++;
    }
    return PRISM_OK;
}

int32_t prism_mrope_delta(const prism_mrope_image_t *imgs, int n_imgs)
{
    int64_t shift = 0;
    for (int i = 0; i < n_imgs; i++)
        shift += PRISM_MAX(imgs[i].rows, imgs[i].cols) - (int64_t)imgs[i].rows * imgs[i].cols;
    return (int32_t)shift;
}
