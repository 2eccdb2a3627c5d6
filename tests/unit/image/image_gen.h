/* Test-image generators shared by the streaming tests: photo-like pixels, JPEG through libjpeg's
 * compressor (any colorspace, sampling, scan script) and PNG through libspng's encoder (any color
 * type, depth, interlace, metadata), and an independent whole-image reference decode (turbojpeg /
 * libspng's whole-image API, the way the encoder decoded before streaming). */
#ifndef PRISM_IMAGE_GEN_H
#define PRISM_IMAGE_GEN_H

#include "core/core.h"
#include "image/image.h"
#include "image/image_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>
#include <spng.h>
#include <turbojpeg.h>

static inline uint32_t ig_rand(uint32_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 17;
    *s ^= *s << 5;
    return *s;
}

/* w x h x comps samples: gradients, a few soft shapes and noise, so that every DCT coefficient
 * band and every resampling tap sees real content. */
static inline uint8_t *ig_pixels(int w, int h, int comps, uint32_t seed)
{
    uint8_t *p = prism_malloc((size_t)w * h * comps);
    uint32_t s = seed * 2654435761u + 1;
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++)
            for (int c = 0; c < comps; c++) {
                int v = (x * (37 + 11 * c) / (w + 1) + y * (53 - 7 * c) / (h + 1)) * 2;
                v += ((x / 7 + y / 5 + c) % 9) * 6;
                if (((x - w / 3) * (x - w / 3) + (y - h / 2) * (y - h / 2)) < w * h / 12)
                    v = 255 - v;
                v += (int)(ig_rand(&s) % 41) - 20;
                p[((size_t)y * w + x) * comps + c] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
            }
    return p;
}

typedef struct {
    int comps;                 /* 1, 3, 4 */
    J_COLOR_SPACE in_cs;       /* JCS_GRAYSCALE, JCS_RGB, JCS_CMYK */
    J_COLOR_SPACE jpeg_cs;     /* JCS_GRAYSCALE, JCS_YCbCr, JCS_RGB, JCS_CMYK, JCS_YCCK */
    int samp[4][2];            /* h, v per component; 0 = libjpeg's default */
    bool progressive;
    const jpeg_scan_info *scans;
    int n_scans;
    int quality;               /* 0 = 90 */
} ig_jpeg_t;

/* Encodes samples with libjpeg; returns a prism_malloc'd file. */
static inline uint8_t *ig_jpeg(const uint8_t *pix, int w, int h, const ig_jpeg_t *o, size_t *len)
{
    struct jpeg_compress_struct c;
    struct jpeg_error_mgr e;
    c.err = jpeg_std_error(&e);
    jpeg_create_compress(&c);
    unsigned char *buf = NULL;
    unsigned long n = 0;
    jpeg_mem_dest(&c, &buf, &n);
    c.image_width = (JDIMENSION)w;
    c.image_height = (JDIMENSION)h;
    c.input_components = o->comps;
    c.in_color_space = o->in_cs;
    jpeg_set_defaults(&c);
    jpeg_set_colorspace(&c, o->jpeg_cs);
    jpeg_set_quality(&c, o->quality ? o->quality : 90, TRUE);
    for (int i = 0; i < c.num_components && i < 4; i++)
        if (o->samp[i][0]) {
            c.comp_info[i].h_samp_factor = o->samp[i][0];
            c.comp_info[i].v_samp_factor = o->samp[i][1];
        }
    if (o->progressive)
        jpeg_simple_progression(&c);
    if (o->scans) {
        c.scan_info = o->scans;
        c.num_scans = o->n_scans;
    }
    jpeg_start_compress(&c, TRUE);
    while (c.next_scanline < c.image_height) {
        JSAMPROW row = (JSAMPROW)(pix + (size_t)c.next_scanline * w * o->comps);
        jpeg_write_scanlines(&c, &row, 1);
    }
    jpeg_finish_compress(&c);
    jpeg_destroy_compress(&c);
    uint8_t *out = prism_malloc(n);
    memcpy(out, buf, n);
    free(buf);
    *len = n;
    return out;
}

typedef struct {
    int color_type;            /* SPNG_COLOR_TYPE_* */
    int depth;
    bool interlace;
    bool trns;                 /* a tRNS chunk (gray, RGB: one key color; palette: varied alpha) */
    bool text;                 /* tEXt + zTXt metadata (dropped by the decoder) */
} ig_png_t;

static inline uint8_t *ig_png(int w, int h, const ig_png_t *o, uint32_t seed, size_t *len)
{
    int ch = o->color_type == SPNG_COLOR_TYPE_TRUECOLOR ? 3 : o->color_type == SPNG_COLOR_TYPE_TRUECOLOR_ALPHA ? 4
             : o->color_type == SPNG_COLOR_TYPE_GRAYSCALE_ALPHA ? 2 : 1;
    uint8_t *base = ig_pixels(w, h, ch, seed);
    size_t bits_row = (size_t)w * ch * o->depth, row_bytes = (bits_row + 7) / 8;
    uint8_t *img = prism_calloc(row_bytes * h, 1);
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w * ch; x++) {
            uint8_t v = base[(size_t)y * w * ch + x];
            uint8_t *r = img + (size_t)y * row_bytes;
            if (o->depth == 16) {
                uint16_t v16 = (uint16_t)(v * 257 + (x % 251));
                memcpy(r + 2 * x, &v16, 2);   /* SPNG_FMT_PNG is host-endian */
            } else if (o->depth == 8) {
                r[x] = v;
            } else {
                int d = o->depth, per = 8 / d;
                uint8_t s = (uint8_t)(v >> (8 - d));
                r[x / per] |= (uint8_t)(s << (8 - d * (x % per + 1)));
            }
        }
    spng_ctx *ctx = spng_ctx_new(SPNG_CTX_ENCODER);
    spng_set_option(ctx, SPNG_ENCODE_TO_BUFFER, 1);
    struct spng_ihdr ihdr = {.width = (uint32_t)w, .height = (uint32_t)h, .bit_depth = (uint8_t)o->depth,
                             .color_type = (uint8_t)o->color_type, .interlace_method = o->interlace ? 1 : 0};
    spng_set_ihdr(ctx, &ihdr);
    if (o->color_type == SPNG_COLOR_TYPE_INDEXED) {
        struct spng_plte plte = {.n_entries = 1u << o->depth};
        for (uint32_t i = 0; i < plte.n_entries; i++)
            plte.entries[i] = (struct spng_plte_entry){(uint8_t)(i * 37), (uint8_t)(255 - i * 11), (uint8_t)(i * 91)};
        spng_set_plte(ctx, &plte);
    }
    if (o->trns) {
        struct spng_trns t = {0};
        if (o->color_type == SPNG_COLOR_TYPE_INDEXED) {
            t.n_type3_entries = 1u << o->depth;
            for (uint32_t i = 0; i < t.n_type3_entries; i++)
                t.type3_alpha[i] = (uint8_t)(i * 53);
        } else {
            t.gray = t.red = t.green = t.blue = (uint16_t)(o->depth == 16 ? 128 * 257 : (1u << o->depth) / 2);
        }
        spng_set_trns(ctx, &t);
    }
    if (o->text) {
        static char words[4000];
        for (size_t i = 0; i + 1 < sizeof words; i++)
            words[i] = (char)('a' + i % 26);
        struct spng_text t[2] = {{.keyword = "Comment", .type = SPNG_TEXT, .length = sizeof words - 1, .text = words},
                                 {.keyword = "workflow", .type = SPNG_ZTXT, .length = sizeof words - 1, .text = words}};
        spng_set_text(ctx, t, 2);
    }
    int err = spng_encode_image(ctx, img, row_bytes * h, SPNG_FMT_PNG, SPNG_ENCODE_FINALIZE);
    if (err) {
        fprintf(stderr, "png encode: %s\n", spng_strerror(err));
        abort();
    }
    void *buf = spng_get_png_buffer(ctx, len, &err);
    uint8_t *out = prism_malloc(*len);
    memcpy(out, buf, *len);
    free(buf);
    spng_ctx_free(ctx);
    prism_free(img);
    prism_free(base);
    return out;
}

/* ---- reference: the whole image at once, through the libraries' whole-image APIs ---- */

static inline uint8_t ig_cmyk_channel(uint8_t c, int nk)
{
    int t = c * nk + 128;
    int v = nk - (((t >> 8) + t) >> 8);
    return (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
}

/* JPEG with turbojpeg at scale num/denom (the encoder's decode before streaming), PNG with
 * spng_decode_image. Returns PRISM_OK and a prism_malloc'd image. */
static inline int ig_ref_decode(const uint8_t *d, size_t n, int num, int denom, prism_image_t *img)
{
    memset(img, 0, sizeof *img);
    img->owned = true;
    img->scale_num = num;
    img->scale_denom = denom;
    if (n >= 2 && d[0] == 0xFF && d[1] == 0xD8) {
        prism_image_info_t info;
        prism_jpeg_extra_t ex;
        if (prism_image_jpeg_scan_header(d, n, &info, &ex) != PRISM_OK)
            return PRISM_ECORRUPT;
        tjhandle tj = tjInitDecompress();
        int w, h, ss, cs;
        if (tjDecompressHeader3(tj, d, (unsigned long)n, &w, &h, &ss, &cs)) {
            tjDestroy(tj);
            return PRISM_ECORRUPT;
        }
        tjscalingfactor f = {num, denom};
        int sw = TJSCALED(w, f), sh = TJSCALED(h, f);
        img->w = sw;
        img->h = sh;
        img->src_w = w;
        img->src_h = h;
        img->format = PRISM_IMAGE_FORMAT_JPEG;
        img->rgb = prism_malloc((size_t)sw * sh * 3);
        int rc;
        if (cs == TJCS_CMYK || cs == TJCS_YCCK) {
            uint8_t *k = prism_malloc((size_t)sw * sh * 4);
            rc = tjDecompress2(tj, d, (unsigned long)n, k, sw, 0, sh, TJPF_CMYK, TJFLAG_ACCURATEDCT);
            for (size_t i = 0; i < (size_t)sw * sh; i++) {
                uint8_t c = k[4 * i], m = k[4 * i + 1], y = k[4 * i + 2], kk = k[4 * i + 3];
                if (ex.adobe) {
                    c = 255 - c; m = 255 - m; y = 255 - y; kk = 255 - kk;
                }
                int nk = 255 - kk;
                img->rgb[3 * i] = ig_cmyk_channel(c, nk);
                img->rgb[3 * i + 1] = ig_cmyk_channel(m, nk);
                img->rgb[3 * i + 2] = ig_cmyk_channel(y, nk);
            }
            prism_free(k);
        } else {
            rc = tjDecompress2(tj, d, (unsigned long)n, img->rgb, sw, 0, sh, TJPF_RGB, TJFLAG_ACCURATEDCT);
        }
        tjDestroy(tj);
        if (rc) {
            prism_image_free(img);
            return PRISM_ECORRUPT;
        }
        return PRISM_OK;
    }
    spng_ctx *ctx = spng_ctx_new(0);
    spng_set_png_buffer(ctx, d, n);
    struct spng_ihdr ihdr;
    struct spng_trns trns;
    if (spng_get_ihdr(ctx, &ihdr)) {
        spng_ctx_free(ctx);
        return PRISM_ECORRUPT;
    }
    bool alpha = ihdr.color_type == SPNG_COLOR_TYPE_GRAYSCALE_ALPHA ||
                 ihdr.color_type == SPNG_COLOR_TYPE_TRUECOLOR_ALPHA || spng_get_trns(ctx, &trns) == 0;
    int w = (int)ihdr.width, h = (int)ihdr.height;
    img->w = img->src_w = w;
    img->h = img->src_h = h;
    img->format = PRISM_IMAGE_FORMAT_PNG;
    img->rgb = prism_malloc((size_t)w * h * 3);
    int err;
    if (alpha) {
        uint8_t *t = prism_malloc((size_t)w * h * 4);
        err = spng_decode_image(ctx, t, (size_t)w * h * 4, SPNG_FMT_RGBA8, SPNG_DECODE_TRNS);
        for (size_t i = 0; i < (size_t)w * h; i++)
            for (int c = 0; c < 3; c++)
                img->rgb[3 * i + c] = prism_image_over_white(t[4 * i + c], t[4 * i + 3]);
        prism_free(t);
    } else {
        err = spng_decode_image(ctx, img->rgb, (size_t)w * h * 3, SPNG_FMT_RGB8, 0);
    }
    spng_ctx_free(ctx);
    if (err) {
        prism_image_free(img);
        return PRISM_ECORRUPT;
    }
    return PRISM_OK;
}

#endif
