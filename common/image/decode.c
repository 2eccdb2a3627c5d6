/* Decoding JPEG (turbojpeg) and PNG (libspng) into RGB8 with bounds checked before any pixel
 * memory is allocated. */
#include "image/image.h"
#include "image/image_internal.h"

#include <spng.h>
#include <string.h>
#include <turbojpeg.h>

/* libspng's limits on ancillary chunks (text, ICC, ...), so a crafted file cannot make it cache
 * hundreds of MB of metadata we never look at. */
#define PNG_CHUNK_SIZE_LIMIT  (8u << 20)
#define PNG_CHUNK_CACHE_LIMIT (16u << 20)

void prism_image_free(prism_image_t *img)
{
    if (!img)
        return;
    if (img->owned)
        prism_free(img->rgb);
    memset(img, 0, sizeof *img);
}

/* Picks the smallest libjpeg-turbo scale (<= 1) whose output still covers min_w x min_h. */
static void jpeg_pick_scale(int w, int h, int min_w, int min_h, int *num, int *denom)
{
    *num = 1;
    *denom = 1;
    if (min_w <= 0 || min_h <= 0)
        return;
    int n = 0;
    tjscalingfactor *sf = tjGetScalingFactors(&n);
    if (!sf)
        return;
    double best = 1.0;
    for (int i = 0; i < n; i++) {
        if (sf[i].num <= 0 || sf[i].denom <= 0 || sf[i].num > sf[i].denom)
            continue;
        int sw = TJSCALED(w, sf[i]), sh = TJSCALED(h, sf[i]);
        double r = (double)sf[i].num / sf[i].denom;
        if (sw >= min_w && sh >= min_h && r < best) {
            best = r;
            *num = sf[i].num;
            *denom = sf[i].denom;
        }
    }
}

void prism_image_scaled_size(const prism_image_info_t *info, int min_w, int min_h, int *w, int *h)
{
    *w = info->width;
    *h = info->height;
    if (info->format != PRISM_IMAGE_FORMAT_JPEG)
        return;
    int num, denom;
    jpeg_pick_scale(info->width, info->height, min_w, min_h, &num, &denom);
    tjscalingfactor f = {num, denom};
    *w = TJSCALED(info->width, f);
    *h = TJSCALED(info->height, f);
}

/* Reserves the [h][w][3] output in the caller's buffer or on the heap. */
static int out_alloc(const prism_image_decode_opts_t *o, int w, int h, prism_image_t *out)
{
    uint64_t need = (uint64_t)w * (uint64_t)h * 3u;   /* w, h <= 65535: fits in 64 bits */
    if (need > SIZE_MAX)
        return PRISM_ELIMIT;
    size_t bytes = (size_t)need;
    if (o && o->out_buf) {
        if (bytes > o->out_cap)
            return PRISM_ELIMIT;
        out->rgb = o->out_buf;
        out->owned = false;
    } else {
        out->rgb = prism_malloc(bytes);
        if (!out->rgb)
            return PRISM_ENOMEM;
        out->owned = true;
    }
    out->w = w;
    out->h = h;
    return PRISM_OK;
}

static int check_limits(const prism_image_info_t *info, const prism_image_decode_opts_t *o)
{
    uint64_t maxpx = (o && o->max_pixels) ? o->max_pixels : PRISM_IMAGE_DEFAULT_MAX_PIXELS;
    if (info->width > PRISM_IMAGE_MAX_DIM || info->height > PRISM_IMAGE_MAX_DIM)
        return PRISM_ELIMIT;
    if ((uint64_t)info->width * (uint64_t)info->height > maxpx)
        return PRISM_ELIMIT;
    return PRISM_OK;
}

/* PIL's cmyk2rgb (Convert.c): r = 255-k - (c*(255-k))/255 with its rounded division. */
static inline uint8_t muldiv255_sub(uint8_t c, int nk)
{
    int t = c * nk + 128;
    int v = nk - (((t >> 8) + t) >> 8);
    return (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
}

static int tj_status(tjhandle tj, int rc)
{
    if (rc == 0)
        return PRISM_OK;
    if (tjGetErrorCode(tj) == TJERR_WARNING) {
        /* libjpeg completes the image on warnings. A truncated file ("Premature end of JPEG file",
         * "premature end of data segment") is an error for us, as it is for PIL; other warnings
         * (extraneous bytes, ...) are common in camera files and PIL accepts them too. */
        const char *msg = tjGetErrorStr2(tj);
        if (msg && (strstr(msg, "Premature end") || strstr(msg, "premature end")))
            return PRISM_ECORRUPT;
        PRISM_DEBUG("jpeg warning: %s", msg ? msg : "?");
        return PRISM_OK;
    }
    return PRISM_ECORRUPT;
}

static int decode_jpeg(const uint8_t *data, size_t len, const prism_image_decode_opts_t *o,
                       prism_image_t *out)
{
    prism_image_info_t info;
    prism_jpeg_extra_t ex;
    int rc = prism_image_jpeg_scan_header(data, len, &info, &ex);
    if (rc != PRISM_OK)
        return rc;
    if ((rc = check_limits(&info, o)) != PRISM_OK)
        return rc;
    if (info.bit_depth != 8)
        return PRISM_ENOTSUP;   /* 12-bit JPEG needs the libjpeg-turbo 3 API */
    if (len > (size_t)0xffffffffu)
        return PRISM_ELIMIT;    /* turbojpeg takes unsigned long, but keep it sane */

    uint8_t *cmyk = NULL;
    tjhandle tj = tjInitDecompress();
    if (!tj)
        return PRISM_ENOMEM;
    int w = 0, h = 0, subsamp = 0, cs = 0;
    if ((rc = tj_status(tj, tjDecompressHeader3(tj, data, (unsigned long)len, &w, &h, &subsamp, &cs))) != PRISM_OK)
        goto fail;
    if (w != info.width || h != info.height) {
        rc = PRISM_ECORRUPT;
        goto fail;
    }
    int num, denom;
    jpeg_pick_scale(w, h, o ? o->min_w : 0, o ? o->min_h : 0, &num, &denom);
    tjscalingfactor f = {num, denom};
    int sw = TJSCALED(w, f), sh = TJSCALED(h, f);
    if ((rc = out_alloc(o, sw, sh, out)) != PRISM_OK)
        goto fail;
    out->src_w = w;
    out->src_h = h;
    out->scale_num = num;
    out->scale_denom = denom;
    out->format = PRISM_IMAGE_FORMAT_JPEG;
    /* ACCURATEDCT is already turbojpeg's decode default (ISLOW, as PIL uses); LIMITSCANS guards
     * against the progressive-scan CPU exhaustion attack. */
    const int flags = TJFLAG_ACCURATEDCT | TJFLAG_LIMITSCANS;
    if (cs == TJCS_CMYK || cs == TJCS_YCCK) {
        /* libjpeg cannot convert CMYK to RGB; do it the way PIL does (naive, no ICC). */
        size_t px = (size_t)sw * (size_t)sh;
        cmyk = prism_malloc(px * 4);
        if (!cmyk) {
            rc = PRISM_ENOMEM;
            goto fail;
        }
        rc = tj_status(tj, tjDecompress2(tj, data, (unsigned long)len, cmyk, sw, 0, sh, TJPF_CMYK, flags));
        if (rc != PRISM_OK)
            goto fail;
        /* Adobe (Photoshop) CMYK is stored inverted; PIL reads it as "CMYK;I". */
        bool inverted = ex.adobe;
        for (size_t i = 0; i < px; i++) {
            uint8_t c = cmyk[i * 4], m = cmyk[i * 4 + 1], y = cmyk[i * 4 + 2], k = cmyk[i * 4 + 3];
            if (inverted) {
                c = 255 - c; m = 255 - m; y = 255 - y; k = 255 - k;
            }
            int nk = 255 - k;
            out->rgb[i * 3 + 0] = muldiv255_sub(c, nk);
            out->rgb[i * 3 + 1] = muldiv255_sub(m, nk);
            out->rgb[i * 3 + 2] = muldiv255_sub(y, nk);
        }
        prism_free(cmyk);
        cmyk = NULL;
    } else {
        rc = tj_status(tj, tjDecompress2(tj, data, (unsigned long)len, out->rgb, sw, 0, sh, TJPF_RGB, flags));
        if (rc != PRISM_OK)
            goto fail;
    }
    tjDestroy(tj);
    return PRISM_OK;

fail:
    prism_free(cmyk);
    tjDestroy(tj);
    prism_image_free(out);
    return rc;
}

static struct spng_alloc png_alloc = {
    .malloc_fn = prism_malloc,
    .realloc_fn = prism_realloc,
    .calloc_fn = prism_calloc,
    .free_fn = prism_free,
};

static int spng_status(int err)
{
    if (err == 0)
        return PRISM_OK;
    if (err == SPNG_EMEM)
        return PRISM_ENOMEM;
    if (err == SPNG_EUSER_WIDTH || err == SPNG_EUSER_HEIGHT || err == SPNG_EOVERFLOW ||
        err == SPNG_ECHUNK_LIMITS)
        return PRISM_ELIMIT;
    return PRISM_ECORRUPT;
}

static int decode_png(const uint8_t *data, size_t len, const prism_image_decode_opts_t *o,
                      prism_image_t *out)
{
    prism_image_info_t info;
    int rc = prism_image_png_scan_header(data, len, &info);
    if (rc != PRISM_OK)
        return rc;
    if ((rc = check_limits(&info, o)) != PRISM_OK)
        return rc;

    uint8_t *tmp = NULL;
    spng_ctx *ctx = spng_ctx_new2(&png_alloc, 0);
    if (!ctx)
        return PRISM_ENOMEM;
    int err = spng_set_image_limits(ctx, PRISM_IMAGE_MAX_DIM, PRISM_IMAGE_MAX_DIM);
    if (!err)
        err = spng_set_chunk_limits(ctx, PNG_CHUNK_SIZE_LIMIT, PNG_CHUNK_CACHE_LIMIT);
    if (!err)
        err = spng_set_png_buffer(ctx, data, len);
    struct spng_ihdr ihdr;
    if (!err)
        err = spng_get_ihdr(ctx, &ihdr);
    if (err) {
        rc = spng_status(err);
        goto fail;
    }
    if ((int)ihdr.width != info.width || (int)ihdr.height != info.height) {
        rc = PRISM_ECORRUPT;
        goto fail;
    }
    /* spng reports tRNS only once it has read the chunks before IDAT (get_ihdr did). */
    struct spng_trns trns;
    bool alpha = ihdr.color_type == SPNG_COLOR_TYPE_GRAYSCALE_ALPHA ||
                 ihdr.color_type == SPNG_COLOR_TYPE_TRUECOLOR_ALPHA ||
                 spng_get_trns(ctx, &trns) == 0;
    int w = info.width, h = info.height;
    if ((rc = out_alloc(o, w, h, out)) != PRISM_OK)
        goto fail;
    out->src_w = w;
    out->src_h = h;
    out->scale_num = out->scale_denom = 1;
    out->format = PRISM_IMAGE_FORMAT_PNG;

    if (!alpha) {
        err = spng_decode_image(ctx, out->rgb, (size_t)w * h * 3, SPNG_FMT_RGB8, 0);
        if (err) {
            rc = spng_status(err);
            goto fail;
        }
    } else if (!ihdr.interlace_method) {
        /* Row by row through one RGBA row, so transparency costs no full-size temporary. */
        size_t row_bytes = (size_t)w * 4;
        tmp = prism_malloc(row_bytes);
        if (!tmp) {
            rc = PRISM_ENOMEM;
            goto fail;
        }
        err = spng_decode_image(ctx, NULL, 0, SPNG_FMT_RGBA8, SPNG_DECODE_TRNS | SPNG_DECODE_PROGRESSIVE);
        for (int y = 0; !err && y < h; y++) {
            struct spng_row_info ri;
            err = spng_get_row_info(ctx, &ri);
            if (err)
                break;
            int e = spng_decode_row(ctx, tmp, row_bytes);
            if (e && e != SPNG_EOI) {
                err = e;
                break;
            }
            if (ri.row_num >= (uint32_t)h) {
                err = SPNG_EINTERNAL;
                break;
            }
            uint8_t *dst = out->rgb + (size_t)ri.row_num * w * 3;
            for (int x = 0; x < w; x++) {
                uint8_t a = tmp[x * 4 + 3];
                dst[x * 3 + 0] = prism_image_over_white(tmp[x * 4 + 0], a);
                dst[x * 3 + 1] = prism_image_over_white(tmp[x * 4 + 1], a);
                dst[x * 3 + 2] = prism_image_over_white(tmp[x * 4 + 2], a);
            }
            if (e == SPNG_EOI && y != h - 1) {
                err = SPNG_EOI;
                break;
            }
        }
        if (err) {
            rc = spng_status(err);
            goto fail;
        }
    } else {
        /* Interlaced rows arrive pass by pass; decode whole RGBA then composite. */
        size_t bytes = (size_t)w * h * 4;
        tmp = prism_malloc(bytes);
        if (!tmp) {
            rc = PRISM_ENOMEM;
            goto fail;
        }
        err = spng_decode_image(ctx, tmp, bytes, SPNG_FMT_RGBA8, SPNG_DECODE_TRNS);
        if (err) {
            rc = spng_status(err);
            goto fail;
        }
        size_t px = (size_t)w * h;
        for (size_t i = 0; i < px; i++) {
            uint8_t a = tmp[i * 4 + 3];
            out->rgb[i * 3 + 0] = prism_image_over_white(tmp[i * 4 + 0], a);
            out->rgb[i * 3 + 1] = prism_image_over_white(tmp[i * 4 + 1], a);
            out->rgb[i * 3 + 2] = prism_image_over_white(tmp[i * 4 + 2], a);
        }
    }
    prism_free(tmp);
    spng_ctx_free(ctx);
    return PRISM_OK;

fail:
    prism_free(tmp);
    spng_ctx_free(ctx);
    prism_image_free(out);
    return rc;
}

int prism_image_decode(const uint8_t *data, size_t len, const prism_image_decode_opts_t *opts,
                       prism_image_t *out)
{
    if (!out)
        return PRISM_EINVAL;
    memset(out, 0, sizeof *out);
    if (!data || len == 0)
        return PRISM_EINVAL;
    if (opts && opts->out_buf == NULL && opts->out_cap != 0)
        return PRISM_EINVAL;
    if (len >= 2 && data[0] == 0xFF && data[1] == 0xD8)
        return decode_jpeg(data, len, opts, out);
    prism_image_info_t info;
    int rc = prism_image_probe(data, len, &info);
    if (info.format == PRISM_IMAGE_FORMAT_PNG)
        return decode_png(data, len, opts, out);
    return rc == PRISM_OK ? PRISM_ENOTSUP : rc;
}
