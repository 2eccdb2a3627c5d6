/* Internals shared by the image library's translation units (not for other areas). */
#ifndef PRISM_IMAGE_INTERNAL_H
#define PRISM_IMAGE_INTERNAL_H

#include "image/image.h"

typedef struct {
    uint8_t sof_marker;       /* 0xC0.. */
    bool    adobe;            /* APP14 "Adobe" seen before the frame header */
    uint8_t adobe_transform;  /* 0: none (RGB/CMYK), 1: YCbCr, 2: YCCK */
} prism_jpeg_extra_t;

uint32_t prism_image_crc32(uint32_t crc, const uint8_t *p, size_t n);
int prism_image_jpeg_scan_header(const uint8_t *d, size_t len, prism_image_info_t *info,
                                 prism_jpeg_extra_t *extra);
int prism_image_png_scan_header(const uint8_t *d, size_t len, prism_image_info_t *info);

/* PIL's ImagingAlphaComposite of one RGBA pixel over opaque white (its integer arithmetic). */
static inline uint8_t prism_image_over_white(uint8_t c, uint8_t a)
{
    if (a == 0)
        return 255;
    /* dst alpha 255: outa255 = 255*255, so PIL's coef1 = a*128 and coef2 = (255-a)*128. */
    uint32_t coef1 = (uint32_t)a * 255u * 255u * 128u / (255u * 255u);
    uint32_t coef2 = 255u * 128u - coef1;
    uint32_t t = (uint32_t)c * coef1 + 255u * coef2 + (0x80u << 7);
    return (uint8_t)((((t >> 8) + t) >> 8) >> 7);
}

/* ---- streaming decoder internals (decode.c, decode_jpeg.c, decode_png.c) ---- */

/* libjpeg's permanent pool: the quantization / Huffman tables of one image (reset per image so no
 * table of an earlier image can stand in for a missing one). */
#define PRISM_IMAGE_PERM_BYTES (32u << 10)

struct prism_image_decoder {
    uint8_t *region;          /* one counted allocation: perm, then arena */
    size_t region_bytes;
    prism_arena_t perm;
    prism_arena_t arena;      /* everything else of one image; reset per image */
    struct prism_jpeg_state *jpeg;
    size_t last_bytes, peak_bytes;
    size_t need_bytes;        /* set with PRISM_ELIMIT when the image needs a larger region */
    char err[200];
};

/* Decodes a JPEG / PNG whose header (info, extra) was already checked against the limits. */
int prism_image_jpeg_run(prism_image_decoder_t *d, const uint8_t *data, size_t len,
                         const prism_image_decode_opts_t *o, const prism_image_info_t *info,
                         const prism_jpeg_extra_t *ex, const prism_image_sink_t *sink);
int prism_image_png_run(prism_image_decoder_t *d, const uint8_t *data, size_t len,
                        const prism_image_info_t *info, const prism_image_sink_t *sink);
int prism_image_jpeg_state_create(prism_image_decoder_t *d);
void prism_image_jpeg_state_destroy(prism_image_decoder_t *d);

/* Region bytes that rows of `width` pixels need while decoding (library working memory, our row
 * buffers), for JPEG (single-scan, or multi-scan besides its coefficients) and PNG. */
size_t prism_image_jpeg_stream_bytes(int width, bool multi_scan);
size_t prism_image_png_stream_bytes(int width);

/* Picks the smallest libjpeg-turbo scale (<= 1) whose output still covers min_w x min_h. */
void prism_image_jpeg_pick_scale(int w, int h, int min_w, int min_h, int *num, int *denom);

#endif
