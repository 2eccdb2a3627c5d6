/* image: header probing and decoding of JPEG / PNG into interleaved RGB8.
 *
 * The router probes (no pixels decoded) to validate and bound images before it accepts a request;
 * the encoder worker decodes, optionally with libjpeg-turbo DCT-domain downscaling, then runs the
 * model's preprocessor (see image/clip.h).
 *
 *   prism_image_info_t info;
 *   if (prism_image_probe(bytes, n, &info) != PRISM_OK) -> 400
 *   if ((uint64_t)info.width * info.height > limit)     -> 400 / 413
 *
 *   prism_image_decode_opts_t o = { .max_pixels = limit };
 *   prism_image_t img;
 *   int rc = prism_image_decode(bytes, n, &o, &img);   // PRISM_ECORRUPT, PRISM_ELIMIT, ...
 *   ... img.rgb [h][w][3] ...
 *   prism_image_free(&img);
 *
 * Conversion rules follow what vLLM / transformers get from PIL: grayscale is replicated, CMYK goes
 * through PIL's naive formula, PNG transparency (alpha channel or tRNS) is composited on white with
 * PIL's integer alpha_composite arithmetic, 16-bit samples keep their high byte.
 * EXIF orientation is not applied (vLLM does not apply it either).
 */
#ifndef PRISM_IMAGE_H
#define PRISM_IMAGE_H

#include "core/core.h"

/* Hard bounds, independent of caller options. 65535 is JPEG's own limit; PNG allows more but
 * nothing we serve needs it. */
#define PRISM_IMAGE_MAX_DIM 65535
/* Used when prism_image_decode_opts_t.max_pixels is 0: PIL's decompression-bomb error threshold. */
#define PRISM_IMAGE_DEFAULT_MAX_PIXELS (2ull * 89478485ull)

typedef enum {
    PRISM_IMAGE_FORMAT_UNKNOWN = 0,
    PRISM_IMAGE_FORMAT_JPEG,
    PRISM_IMAGE_FORMAT_PNG,
} prism_image_format_t;

typedef struct {
    prism_image_format_t format;
    int  width, height;   /* as declared by the header, even when over the limits */
    int  channels;        /* samples per pixel in the file: JPEG 1/3/4; PNG 1 (gray, palette), 2, 3, 4 */
    int  bit_depth;       /* JPEG sample precision (8, 12); PNG bit depth (1..16) */
    bool progressive;     /* JPEG progressive (SOF2/6/10/14); PNG Adam7 interlace */
    bool has_alpha;       /* PNG alpha channel or tRNS chunk; JPEG never */
    bool palette;         /* PNG color type 3 */
    bool cmyk;            /* JPEG with 4 components (CMYK or YCCK) */
} prism_image_info_t;

const char *prism_image_format_name(prism_image_format_t f);

/* Reads only the header: JPEG markers up to the first SOFn, PNG signature + IHDR (CRC checked)
 * and the chunks before IDAT (for tRNS). Never decodes pixels, never allocates.
 * Returns PRISM_OK; PRISM_ENOTSUP for data that is neither JPEG nor PNG; PRISM_ECORRUPT for a
 * malformed or truncated header; PRISM_ELIMIT when a dimension exceeds PRISM_IMAGE_MAX_DIM
 * (info is still filled in so the caller can report the declared size). */
int prism_image_probe(const uint8_t *data, size_t len, prism_image_info_t *info);

typedef struct {
    /* Refuse (PRISM_ELIMIT) before decoding when the file's width*height exceeds this.
     * 0 means PRISM_IMAGE_DEFAULT_MAX_PIXELS. */
    uint64_t max_pixels;
    /* JPEG DCT-domain downscaling: decode at the smallest libjpeg-turbo scale whose output is
     * still >= min_w x min_h. 0 in either disables scaling. Ignored for PNG. */
    int min_w, min_h;
    /* Optional caller buffer for the RGB output (e.g. a worker's pre-sized pool slot). When set,
     * an image needing more than out_cap bytes fails with PRISM_ELIMIT; when NULL the output is
     * prism_malloc'd. */
    uint8_t *out_buf;
    size_t   out_cap;
} prism_image_decode_opts_t;

typedef struct {
    uint8_t *rgb;          /* [h][w][3] */
    int w, h;              /* decoded size (smaller than the file's after DCT scaling) */
    int src_w, src_h;      /* size declared by the file; preprocessors take geometry from it */
    int scale_num, scale_denom; /* DCT scale applied (1/1 without): w = ceil(src_w * num / denom) */
    bool owned;            /* rgb was prism_malloc'd by decode; prism_image_free releases it */
    prism_image_format_t format;
} prism_image_t;

/* Decodes JPEG (turbojpeg: baseline, progressive, gray, CMYK/YCCK) or PNG (libspng: every color
 * type and depth, palette, tRNS, interlace) into RGB8.
 * Errors: PRISM_EINVAL (bad arguments), PRISM_ENOTSUP (unknown format, 12-bit JPEG),
 * PRISM_ECORRUPT (corrupt or truncated data, including libjpeg's "premature end" warnings),
 * PRISM_ELIMIT (pixel / dimension / buffer bounds), PRISM_ENOMEM. On error *out is zeroed and
 * nothing is leaked. */
int prism_image_decode(const uint8_t *data, size_t len, const prism_image_decode_opts_t *opts,
                       prism_image_t *out);

/* Frees rgb when owned; always leaves *img zeroed. */
void prism_image_free(prism_image_t *img);

/* Output size of a JPEG decode at the scale prism_image_decode would pick for (min_w, min_h).
 * Lets a worker size pool buffers before decoding. For PNG returns the full size. */
void prism_image_scaled_size(const prism_image_info_t *info, int min_w, int min_h, int *w, int *h);

/* DCT scaling policy: sets opts->min_w/min_h to the resize target (target_w x target_h, from
 * prism_clip_resize_target) when the image is a JPEG at least twice the target in both dimensions,
 * and to 0 (full decode) otherwise. Below 2x the saving is small and the pixels drift more. */
void prism_image_decode_opts_for_target(prism_image_decode_opts_t *opts, const prism_image_info_t *info,
                                        int target_w, int target_h);

#endif
