/* image: header probing and decoding of JPEG / PNG into interleaved RGB8.
 *
 * The router probes (no pixels decoded) to validate and bound images before it accepts a request;
 * the encoder worker streams each image through a long-lived decoder that hands rows, in order, to a
 * sink (the model's preprocessor, see image/clip.h) as libjpeg-turbo and libspng produce them, so
 * no whole decoded image is ever held.
 *
 *   prism_image_info_t info;
 *   if (prism_image_probe(bytes, n, &info) != PRISM_OK) -> 400
 *   if ((uint64_t)info.width * info.height > limit)     -> 400 / 413
 *
 *   // worker start-up: one decoder, its memory counted in the plan
 *   size_t bytes = prism_image_decoder_bytes(max_width, whole_pixels);
 *   prism_image_decoder_t *d;
 *   prism_image_decoder_create(bytes, &d);
 *   // per image: rows go to the sink; no allocation
 *   int rc = prism_image_decoder_run(d, bytes, n, &opts, &sink);   // PRISM_ECORRUPT, PRISM_ELIMIT, ...
 *   if (rc) log(prism_image_decoder_error(d));
 *
 *   // tools and tests: the whole image at once
 *   prism_image_decode_opts_t o = { .max_pixels = limit };
 *   prism_image_t img;
 *   int rc = prism_image_decode(bytes, n, &o, &img);   // img.rgb [h][w][3]
 *   prism_image_free(&img);
 *
 * Memory: baseline JPEG and non-interlaced PNG need a few rows (O(width)). Progressive or
 * multi-scan JPEG keeps every DCT coefficient until its last scan (2 bytes per sample: 3 bytes per
 * pixel at 4:2:0, 6 at 4:4:4, 8 for CMYK) and interlaced PNG the whole image (3 bytes per pixel);
 * that whole-image state comes from the same pre-sized region. libjpeg's and libspng's own
 * allocations are served from the region too (libjpeg's memory manager is replaced, libspng gets
 * allocator hooks), so decoding allocates nothing once the decoder exists.
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
/* Scans a JPEG may have, and how many times its scans may cover its coefficient blocks in all
 * (each scan of a progressive file visits every block of its components, so this bounds the CPU a
 * small file can cost). Encoders write 2-20 scans covering each block 4-8 times (libjpeg's
 * progressive script: 10 scans, luma blocks 6 times); a 60 KB file with 495 scans used to cost
 * 495 passes over a 4096x4096 image. */
#define PRISM_IMAGE_MAX_JPEG_SCANS 64
#define PRISM_IMAGE_MAX_JPEG_PASSES 16

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

/* Decodes JPEG (libjpeg-turbo: baseline, progressive, gray, CMYK/YCCK) or PNG (libspng: every
 * color type and depth, palette, tRNS, interlace) into RGB8: the streaming decoder with a sink that
 * stores every row, and a region sized for this one image (allocated and freed here).
 * Errors: PRISM_EINVAL (bad arguments), PRISM_ENOTSUP (unknown format, 12-bit JPEG),
 * PRISM_ECORRUPT (corrupt or truncated data, including libjpeg's "premature end" warnings),
 * PRISM_ELIMIT (pixel / dimension / buffer bounds, more than PRISM_IMAGE_MAX_JPEG_SCANS scans or
 * PRISM_IMAGE_MAX_JPEG_PASSES passes over the coefficients),
 * PRISM_ENOMEM. On error *out is zeroed and nothing is leaked. */
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

/* ---- streaming decoder ---- */

/* Receives a decoded image row by row. begin() gets the decoded geometry (geom->rgb is NULL) before
 * any row; rows arrive in order, y = 0 .. geom->h - 1, as geom->w RGB8 pixels that stay valid only
 * during the call. A negative return from any callback aborts the decode with that status.
 * Optional: rowbuf() tells the decoder where to write row y (geom->w * 3 bytes) before row() is
 * called with that pointer, so a sink takes rows without a copy; end() is called once after a
 * successful begin(), when the decode is over, with its status, and returns the final status. */
typedef struct {
    int (*begin)(void *ud, const prism_image_t *geom);
    int (*row)(void *ud, int y, const uint8_t *rgb);
    int (*rowbuf)(void *ud, int y, uint8_t **buf);
    int (*end)(void *ud, int status);
    void *ud;
} prism_image_sink_t;

typedef struct prism_image_decoder prism_image_decoder_t;

/* Memory a decoder needs to decode, without allocating, every JPEG / PNG up to max_width pixels
 * wide, plus whole-image state (progressive JPEG coefficients at 4:2:0, interlaced PNG) for a
 * (square) image of up to whole_pixels pixels (3 bytes each; 0: only what streams in rows). Pass it
 * to prism_image_decoder_create as the region size; it also covers libjpeg's own create-time
 * objects. */
size_t prism_image_decoder_bytes(int max_width, uint64_t whole_pixels);

/* Allocates the decoder and its region (counted: prism_malloc_aligned) and creates libjpeg's
 * decompressor once (libjpeg's own few hundred bytes of create-time objects are its malloc). */
int prism_image_decoder_create(size_t region_bytes, prism_image_decoder_t **out);
void prism_image_decoder_destroy(prism_image_decoder_t *d);

/* Decodes one image into sink. opts: max_pixels and min_w/min_h (DCT scaling) as for
 * prism_image_decode; out_buf is ignored. Returns prism_image_decode's errors; PRISM_ELIMIT also
 * when the image needs more than the region (prism_image_decoder_error says how much). Every
 * allocation comes from the region: none from the heap. */
int prism_image_decoder_run(prism_image_decoder_t *d, const uint8_t *data, size_t len,
                            const prism_image_decode_opts_t *opts, const prism_image_sink_t *sink);

/* Why the last run failed, in words fit for a client ("" after success). */
const char *prism_image_decoder_error(const prism_image_decoder_t *d);

/* Region bytes the last run used, and the most any run used (tests, capacity planning). */
size_t prism_image_decoder_last_bytes(const prism_image_decoder_t *d);
size_t prism_image_decoder_peak_bytes(const prism_image_decoder_t *d);
size_t prism_image_decoder_region_bytes(const prism_image_decoder_t *d);

/* ---- relay: preprocess on a helper thread while the caller decodes ----
 * A sink adapter: the decoder writes rows straight into a small ring (rowbuf), a helper thread
 * started once runs the inner sink's row() on them in order, and the decode returns after the
 * helper has finished (end). Same rows, same order, same results; the decode's wall time drops to
 * about the larger of decoding and preprocessing when a second core is free. */
typedef struct prism_image_relay prism_image_relay_t;

/* Memory of a relay for rows of up to max_width pixels: its ring (at least 8 rows of max_width,
 * 256 KiB at least: 64 rows of a 1024-pixel image, 21 of a 4096-pixel one) and the helper thread's
 * stack (256 KiB, mapped by pthread rather than counted by our allocator). */
size_t prism_image_relay_bytes(int max_width);
#define PRISM_IMAGE_RELAY_STACK_BYTES ((size_t)256 << 10)   /* the helper thread's stack, in the above */
/* Allocates the ring (counted) and starts the helper thread (a small fixed stack). */
int prism_image_relay_create(int max_width, prism_image_relay_t **out);
void prism_image_relay_destroy(prism_image_relay_t *r);
/* Sink forwarding to inner (begin and end on the caller's thread, rows on the helper). One image
 * at a time per relay; inner must stay valid until the decode returns. */
prism_image_sink_t prism_image_relay_sink(prism_image_relay_t *r, const prism_image_sink_t *inner);

#endif
