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

#endif
