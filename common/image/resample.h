/* resample: a streaming, separable, antialiased resampler for RGB8 rows, bit-exact with Pillow's
 * ImagingResample and with torch's uint8 antialias kernel (which torchvision's resize uses).
 *
 * Rows are pushed in order as a decoder produces them. Each row that the window needs is resampled
 * horizontally at once; only the few horizontal results the vertical filter still needs are kept
 * (a ring of at most "vertical taps" rows), and every output row is emitted as soon as its last
 * source row has arrived. Memory is O(source width + window width x taps), never O(image).
 * Arithmetic follows the references exactly (fixed-point coefficients, horizontal pass first,
 * uint8 rounding between and after the passes), so the result does not depend on row order,
 * vector width or instruction set; the SIMD kernels are checked against the scalar ones.
 *
 * The filter and the coefficient arithmetic are parameters, so a preprocessor picks what its
 * reference uses: CLIP (image/clip.h) uses bicubic; bilinear is there for processors that resize
 * with it (e.g. an aspect-preserving resize followed by padding and tiling: push the same rows into
 * several resamplers, one per output, and place each emitted row where it belongs).
 *
 *   prism_resample_spec_t s = {.filter = &prism_resample_bicubic, .arith = PRISM_RESAMPLE_TORCH,
 *                              .in_w = w, .in_h = h, .extent_w = w, .extent_h = h,
 *                              .out_w = 448, .out_h = 336, .x0 = 56, .x1 = 392, .y0 = 0, .y1 = 336};
 *   size_t n = prism_resample_workspace_bytes(&s);
 *   prism_resample_t r;
 *   prism_resample_init(&r, &s, ws, n, emit, ud);      // emit(ud, y, planes) per output row
 *   for each decoded row: prism_resample_push(&r, rgb_row);
 */
#ifndef PRISM_IMAGE_RESAMPLE_H
#define PRISM_IMAGE_RESAMPLE_H

#include "core/core.h"

typedef struct {
    const char *name;
    double support;            /* half-width of the kernel at scale 1 */
    double (*eval)(double x);  /* kernel value at x (x may be negative) */
} prism_resample_filter_t;

extern const prism_resample_filter_t prism_resample_bilinear;  /* triangle, support 1 */
extern const prism_resample_filter_t prism_resample_bicubic;   /* Keys a = -0.5, support 2 (Pillow, torch AA) */

typedef enum {
    PRISM_RESAMPLE_PIL = 0,  /* Pillow ImagingResample: int32 coefficients with 22 fractional bits */
    PRISM_RESAMPLE_TORCH,    /* torch uint8 AA kernel: int16 coefficients, precision chosen per axis */
} prism_resample_arith_t;

typedef struct {
    const prism_resample_filter_t *filter;
    prism_resample_arith_t arith;
    int in_w, in_h;             /* rows pushed: in_h rows of in_w RGB8 pixels */
    double extent_w, extent_h;  /* source extent the output spans, in input pixels: in_w / in_h,
                                   except after DCT scaling where the last block is partial */
    int out_w, out_h;           /* size of the resized image */
    int x0, x1, y0, y1;         /* window of the resized image that is produced: [x0,x1) x [y0,y1) */
    /* Pass order. false: horizontal first (Pillow before 13, torch). true: vertical first, which
     * Pillow 13 does when the height shrinks by more than twice as many pixels as the width
     * (prism_resample_pillow_vertical_first); the intermediate uint8 rounding then falls
     * differently. Scalar kernels; ignored when an axis is the identity. The ring then holds
     * source rows (the window's span of columns) instead of horizontal results. */
    bool vertical_first;
} prism_resample_spec_t;

/* Called once per output row y (y0 <= y < y1, in order) with three planes (R, G, B) of x1 - x0
 * samples each. A negative return aborts the push that triggered it and is returned from it. */
typedef int (*prism_resample_emit_fn)(void *ud, int y, const uint8_t *const planes[3]);

typedef struct {
    int32_t *ib;                /* {first tap, taps} per window column / row */
    void *k;                    /* coefficients: int16 (TORCH) or int32 (PIL), kpad per sample */
    int kpad;                   /* coefficient row length (taps rounded up for the vector kernels) */
    int ksize;                  /* most taps of any sample */
    int precision;
    bool active;                /* false when this axis is the identity */
} prism_resample_axis_t;

typedef struct {
    prism_resample_spec_t s;
    prism_resample_axis_t h, v;
    int wx, wy;                 /* window size */
    int wxp;                    /* plane stride of output rows (wx rounded up) */
    int ringp;                  /* plane stride of ring rows: wxp, or the span rounded up (vertical first) */
    bool vfirst;                /* vertical pass first (spec.vertical_first with both axes active) */
    int sx0, span;              /* source columns [sx0, sx0 + span) that the window reads */
    int row_first, row_end;     /* source rows that the window reads */
    int ring_rows;
    int16_t *src_planes;        /* [3][span + pad]: the current source row, deinterleaved */
    uint8_t *ring;              /* [ring_rows][3][ringp] horizontal results (vertical first: source rows) */
    uint8_t *out;               /* [3][ringp] vertical result */
    uint8_t *hout;              /* vertical first: [3][wxp] horizontal pass over out */
    int32_t *acc;               /* [3 * ringp] scalar accumulators */
    const uint8_t **rows;       /* [vertical taps] ring rows of the output row being computed */
    int pushed, emitted;        /* source rows received, window rows emitted */
    prism_resample_emit_fn emit;
    void *ud;
} prism_resample_t;

/* Pillow 13's pass order for resizing in_w x in_h to out_w x out_h (the whole image): vertical
 * first when the height shrinks and by more than twice the width's shrink in pixels. */
static inline bool prism_resample_pillow_vertical_first(int in_w, int in_h, int out_w, int out_h)
{
    return in_h - out_h > 0 && in_h - out_h > (in_w - out_w) * 2;
}

/* Taps per output sample for resampling `in` pixels spanning `extent` to `out` (the bound every
 * kernel row fits in). */
int prism_resample_ksize(const prism_resample_filter_t *f, double extent, int out);

/* Exact workspace for this spec; 0 when the spec is invalid. */
size_t prism_resample_workspace_bytes(const prism_resample_spec_t *s);

/* Upper bound of prism_resample_workspace_bytes over every spec with in_w <= max_in_w, a window of
 * at most max_wx x max_wy and at most max_kx / max_ky taps per axis (see prism_resample_ksize). */
size_t prism_resample_workspace_bound(int max_in_w, int max_wx, int max_wy, int max_kx, int max_ky);

/* Plans the resampling into ws (coefficients, ring). PRISM_EINVAL for an invalid spec,
 * PRISM_ELIMIT when ws_bytes is below prism_resample_workspace_bytes. */
int prism_resample_init(prism_resample_t *r, const prism_resample_spec_t *s, void *ws, size_t ws_bytes,
                        prism_resample_emit_fn emit, void *ud);

/* Feeds the next source row (in_w RGB8 pixels); emits every output row it completes. Returns
 * PRISM_OK, the emit callback's error, or PRISM_EINVAL after in_h rows. */
int prism_resample_push(prism_resample_t *r, const uint8_t *rgb);

/* True once every window row has been emitted (all rows it needs were pushed). */
static inline bool prism_resample_done(const prism_resample_t *r) { return r->emitted >= r->wy; }

/* Kernel selection, for tests that compare the vector kernels with the scalar reference:
 * 0 = best available, 1 = scalar, 2 = SSE2, 3 = AVX2 (falls back when the CPU lacks it).
 * Returns the previous setting. Not thread-safe; call before any resampling. */
int prism_resample_force_isa(int isa);

#endif
