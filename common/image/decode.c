/* The streaming decoder's shell: region sizing, limits checked before anything is decoded,
 * dispatch to libjpeg-turbo (decode_jpeg.c) or libspng (decode_png.c), and the whole-image decode
 * as a sink that stores rows. */
#include "image/image.h"
#include "image/image_internal.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* Slack for alignment padding and libraries' small objects beyond the per-row estimates. */
#define REGION_SLACK (64u << 10)
/* What jpeg_create_decompress allocates with libjpeg's own malloc, once (its manager, marker
 * reader, input controller and master: about 2 KiB), counted in the plan by generous excess. */
#define LIBJPEG_OWN_BYTES (16u << 10)

void prism_image_free(prism_image_t *img)
{
    if (!img)
        return;
    if (img->owned)
        prism_free(img->rgb);
    memset(img, 0, sizeof *img);
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

/* ---------------------------------------------------------------- sizing */

/* Rows of any single-scan JPEG or any PNG of this width. */
static size_t stream_bytes(int width)
{
    return PRISM_MAX(prism_image_jpeg_stream_bytes(width, false), prism_image_png_stream_bytes(width));
}

size_t prism_image_decoder_bytes(int max_width, uint64_t whole_pixels)
{
    if (max_width < 1)
        max_width = 1;
    if (max_width > PRISM_IMAGE_MAX_DIM)
        max_width = PRISM_IMAGE_MAX_DIM;
    if (whole_pixels > (uint64_t)PRISM_IMAGE_MAX_DIM * PRISM_IMAGE_MAX_DIM)
        whole_pixels = (uint64_t)PRISM_IMAGE_MAX_DIM * PRISM_IMAGE_MAX_DIM;
    size_t rows = stream_bytes(max_width);
    size_t whole = 0;
    if (whole_pixels) {
        /* a whole-image decode of that many pixels (a square image: rows of its width) */
        int side = (int)PRISM_MIN((double)max_width, ceil(sqrt((double)whole_pixels)));
        whole = (size_t)whole_pixels * 3 + PRISM_MAX(prism_image_jpeg_stream_bytes(side, true),
                                                     prism_image_png_stream_bytes(side));
    }
    return PRISM_IMAGE_PERM_BYTES + PRISM_MAX(rows, whole) + REGION_SLACK + LIBJPEG_OWN_BYTES;
}

/* ---------------------------------------------------------------- decoder object */

int prism_image_decoder_create(size_t region_bytes, prism_image_decoder_t **out)
{
    if (!out)
        return PRISM_EINVAL;
    *out = NULL;
    if (region_bytes < PRISM_IMAGE_PERM_BYTES + REGION_SLACK)
        region_bytes = PRISM_IMAGE_PERM_BYTES + REGION_SLACK;
    prism_image_decoder_t *d = prism_calloc(1, sizeof *d);
    if (!d)
        return PRISM_ENOMEM;
    d->region = prism_malloc_aligned(region_bytes, 64);
    if (!d->region) {
        prism_free(d);
        return PRISM_ENOMEM;
    }
    d->region_bytes = region_bytes;
    prism_arena_init(&d->perm, "jpeg-tables", d->region, PRISM_IMAGE_PERM_BYTES);
    prism_arena_init(&d->arena, "decode", d->region + PRISM_IMAGE_PERM_BYTES, region_bytes - PRISM_IMAGE_PERM_BYTES);
    int rc = prism_image_jpeg_state_create(d);
    if (rc != PRISM_OK) {
        prism_free_aligned(d->region);
        prism_free(d);
        return rc;
    }
    *out = d;
    return PRISM_OK;
}

void prism_image_decoder_destroy(prism_image_decoder_t *d)
{
    if (!d)
        return;
    prism_image_jpeg_state_destroy(d);
    prism_free_aligned(d->region);
    prism_free(d);
}

const char *prism_image_decoder_error(const prism_image_decoder_t *d) { return d ? d->err : ""; }
size_t prism_image_decoder_last_bytes(const prism_image_decoder_t *d) { return d ? d->last_bytes : 0; }
size_t prism_image_decoder_peak_bytes(const prism_image_decoder_t *d) { return d ? d->peak_bytes : 0; }
size_t prism_image_decoder_region_bytes(const prism_image_decoder_t *d) { return d ? d->region_bytes : 0; }

/* Wraps the caller's sink so that end() runs exactly when begin() succeeded. */
typedef struct {
    const prism_image_sink_t *s;
    bool begun;
} guard_t;

static int guard_begin(void *ud, const prism_image_t *g)
{
    guard_t *q = ud;
    int rc = q->s->begin ? q->s->begin(q->s->ud, g) : PRISM_OK;
    q->begun = rc == PRISM_OK;
    return rc;
}

static int guard_row(void *ud, int y, const uint8_t *rgb)
{
    guard_t *q = ud;
    return q->s->row(q->s->ud, y, rgb);
}

static int guard_rowbuf(void *ud, int y, uint8_t **buf)
{
    guard_t *q = ud;
    return q->s->rowbuf(q->s->ud, y, buf);
}

int prism_image_decoder_run(prism_image_decoder_t *d, const uint8_t *data, size_t len,
                            const prism_image_decode_opts_t *opts, const prism_image_sink_t *sink)
{
    if (!d || !sink || !sink->row)
        return PRISM_EINVAL;
    d->err[0] = 0;
    if (!data || len == 0) {
        snprintf(d->err, sizeof d->err, "the image is empty");
        return PRISM_EINVAL;
    }
    prism_arena_reset(&d->perm);
    prism_arena_reset(&d->arena);
    d->perm.peak = d->arena.peak = 0;
    d->need_bytes = 0;
    prism_image_info_t info;
    prism_jpeg_extra_t ex;
    int rc;
    bool jpeg = len >= 2 && data[0] == 0xFF && data[1] == 0xD8;
    if (jpeg) {
        rc = prism_image_jpeg_scan_header(data, len, &info, &ex);
    } else {
        rc = prism_image_probe(data, len, &info);
        if (rc == PRISM_OK && info.format != PRISM_IMAGE_FORMAT_PNG)
            rc = PRISM_ENOTSUP;
    }
    if (rc == PRISM_OK)
        rc = check_limits(&info, opts);
    if (rc == PRISM_OK && jpeg && info.bit_depth != 8)
        rc = PRISM_ENOTSUP;   /* 12-bit JPEG needs libjpeg-turbo 3's API (and PIL refuses it too) */
    if (rc != PRISM_OK) {
        if (!d->err[0])
            snprintf(d->err, sizeof d->err, "%s", rc == PRISM_ELIMIT ? "the image exceeds the pixel limit"
                                                  : rc == PRISM_ENOTSUP ? "the image format is not supported"
                                                                        : "the image header is corrupt or truncated");
        return rc;
    }
    guard_t q = {.s = sink};
    prism_image_sink_t gs = {.begin = guard_begin, .row = guard_row, .rowbuf = sink->rowbuf ? guard_rowbuf : NULL,
                             .ud = &q};
    if (jpeg)
        rc = prism_image_jpeg_run(d, data, len, opts, &info, &ex, &gs);
    else
        rc = prism_image_png_run(d, data, len, &info, &gs);
    if (q.begun && sink->end)
        rc = sink->end(sink->ud, rc);
    d->last_bytes = d->perm.peak + d->arena.peak;
    d->peak_bytes = PRISM_MAX(d->peak_bytes, d->last_bytes);
    if (rc != PRISM_OK && !d->err[0])
        snprintf(d->err, sizeof d->err, "%s", rc == PRISM_ELIMIT   ? "the image exceeds a decode limit"
                                              : rc == PRISM_ENOMEM ? "out of memory"
                                                                   : "the image data is corrupt or truncated");
    if (rc == PRISM_OK)
        d->err[0] = 0;
    return rc;
}

/* ---------------------------------------------------------------- whole-image decode */

typedef struct {
    const prism_image_decode_opts_t *o;
    prism_image_t *out;
} store_t;

static int store_begin(void *ud, const prism_image_t *g)
{
    store_t *s = ud;
    uint64_t need = (uint64_t)g->w * (uint64_t)g->h * 3u;   /* w, h <= 65535: fits in 64 bits */
    if (need > SIZE_MAX)
        return PRISM_ELIMIT;
    prism_image_t *out = s->out;
    if (s->o && s->o->out_buf) {
        if (need > s->o->out_cap)
            return PRISM_ELIMIT;
        out->rgb = s->o->out_buf;
        out->owned = false;
    } else {
        out->rgb = prism_malloc((size_t)need);
        if (!out->rgb)
            return PRISM_ENOMEM;
        out->owned = true;
    }
    uint8_t *rgb = out->rgb;
    bool owned = out->owned;
    *out = *g;
    out->rgb = rgb;
    out->owned = owned;
    return PRISM_OK;
}

static int store_row(void *ud, int y, const uint8_t *rgb)
{
    store_t *s = ud;
    size_t stride = (size_t)s->out->w * 3;
    memcpy(s->out->rgb + (size_t)y * stride, rgb, stride);
    return PRISM_OK;
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
    /* Bounds first: nothing is allocated for an image that will be refused. */
    prism_image_info_t info;
    int rc;
    if (len >= 2 && data[0] == 0xFF && data[1] == 0xD8)
        rc = prism_image_jpeg_scan_header(data, len, &info, NULL);
    else
        rc = prism_image_probe(data, len, &info);
    if (rc == PRISM_OK && info.format == PRISM_IMAGE_FORMAT_UNKNOWN)
        rc = PRISM_ENOTSUP;
    if (rc == PRISM_OK)
        rc = check_limits(&info, opts);
    if (rc != PRISM_OK)
        return rc;
    /* A region for this one image: rows, plus whole-image state when the file announces it
     * (a multi-scan baseline JPEG asks for more on the first try and gets a second one). */
    size_t region = PRISM_IMAGE_PERM_BYTES + REGION_SLACK + stream_bytes(info.width);
    if (info.progressive)
        region += info.format == PRISM_IMAGE_FORMAT_JPEG
                      ? (size_t)8 * ((size_t)info.width + 32) * ((size_t)info.height + 32) +
                            prism_image_jpeg_stream_bytes(info.width, true)
                      : (size_t)3 * info.width * info.height;
    store_t st = {.o = opts, .out = out};
    prism_image_sink_t sink = {.begin = store_begin, .row = store_row, .ud = &st};
    for (int attempt = 0; attempt < 2; attempt++) {
        prism_image_decoder_t *d;
        if ((rc = prism_image_decoder_create(region, &d)) != PRISM_OK)
            return rc;
        rc = prism_image_decoder_run(d, data, len, opts, &sink);
        size_t need = d->need_bytes;
        prism_image_decoder_destroy(d);
        if (rc == PRISM_OK)
            return PRISM_OK;
        prism_image_free(out);
        if (rc != PRISM_ELIMIT || need == 0 || attempt == 1)
            return rc;
        region = PRISM_IMAGE_PERM_BYTES + REGION_SLACK + need;
    }
    return rc;
}
