/* qwenvl_proc: the Qwen2-VL / Qwen2.5-VL / Qwen3-VL image processor (transformers'
 * Qwen2VLImageProcessorPil, the processor transformers uses without torchvision) and the
 * image-dependent parts of their prompts (token counts, M-RoPE positions), as pure functions.
 *
 * Geometry (width and height only, so the router calls it on the header): smart_resize to
 * multiples of factor = patch_size * merge_size with the pixel count brought into
 * [min_pixels, max_pixels] (HF's float64 arithmetic and Python's round-half-even reproduced);
 * aspect ratios above 200 are refused as HF refuses them. The grid is (resized_h / patch,
 * resized_w / patch) patches; an image is merge^2 patches per LM token.
 * Values: Pillow's bicubic resize of the RGB8 image (image/resample.h, PIL arithmetic), then
 * float64(x) * rescale_factor -> float32, (x - mean) / std in float32, as numpy computes them.
 * Patch order (HF's patchify): merged row, merged column, row in the merge block, column in it;
 * inside a patch channel, row, column. HF repeats a still image temporal_patch_size times along a
 * "frame" axis (patch features c*T*p*p + t*p*p + y*p + x); the frames are identical, so the rows
 * here hold ONE frame ([n_patches][3][p][p]) and the vision tower repeats it on the device (half
 * the memory of HF's pixel_values, which is this with every p*p block written T times).
 *
 *   prism_qwenvl_proc_t p;
 *   prism_qwenvl_proc_load_dir("ckpt", &p, err, sizeof err);
 *   prism_qwenvl_grid_t g;
 *   prism_qwenvl_grid(&p, w, h, &g);            // router: g.n_tokens image pads in the prompt
 *   // encoder: decoded rows stream into the patches [g.n_patches][3][p][p]
 *   prism_qwenvl_stream_t st;
 *   prism_image_sink_t sink = prism_qwenvl_stream_sink(&st, &p, ws, ws_bytes, px);
 *   prism_image_decoder_run(dec, bytes, n, &opts, &sink);  then  prism_qwenvl_stream_finish(&st);
 *
 * Two libraries, as for Llama-4: config, geometry and M-RoPE positions (qwenvl_layout.c) are in
 * the leaf prism_image_layout (core + jansson) that the router and the prefill worker link; the
 * pixels (qwenvl_proc.c) are in prism_image with the decoders and the resampler.
 * Ownership: every function writes only into caller buffers; nothing allocates. */
#ifndef PRISM_IMAGE_QWENVL_PROC_H
#define PRISM_IMAGE_QWENVL_PROC_H

#include "core/core.h"
#include "image/image.h"
#include "image/resample.h"

#define PRISM_QWENVL_MAX_PATCH 64
#define PRISM_QWENVL_MAX_MERGE 4

typedef struct {
    int patch;                 /* patch_size: 14 (Qwen2/2.5-VL), 16 (Qwen3-VL) */
    int merge;                 /* merge_size: 2 */
    int temporal;              /* temporal_patch_size: 2 */
    int64_t min_pixels;        /* size.shortest_edge / min_pixels */
    int64_t max_pixels;        /* size.longest_edge / max_pixels */
    bool do_resize, do_rescale, do_normalize;
    bool bilinear;             /* resample 2 (PIL bilinear); default 3, bicubic */
    double rescale_factor;     /* 1/255, applied in float64 as numpy does */
    float mean[3], std[3];
} prism_qwenvl_proc_t;

typedef struct {
    int resized_w, resized_h;  /* smart_resize's output */
    int grid_h, grid_w;        /* patches (grid_t is 1: a still image) */
    int n_patches;             /* grid_h * grid_w: rows of the tower's input */
    int tok_h, tok_w;          /* LM tokens per column / row: grid / merge */
    int n_tokens;              /* tok_h * tok_w: image pads in the prompt, rows of the tower's output */
} prism_qwenvl_grid_t;

/* ---- prism_image_layout ---- */

/* Qwen2VLImageProcessor's defaults: patch 14, merge 2, temporal 2, min 56*56, max 28*28*1280,
 * CLIP mean/std, 1/255, bicubic. */
void prism_qwenvl_proc_default(prism_qwenvl_proc_t *p);

/* Reads <dir>/preprocessor_config.json: size {shortest_edge, longest_edge}, then min_pixels /
 * max_pixels (which win, as in HF's __init__), patch_size, merge_size, temporal_patch_size,
 * image_mean, image_std, rescale_factor, do_resize / do_rescale / do_normalize, resample (2 or 3).
 * Missing keys take the defaults. PRISM_ENOTSUP / PRISM_EINVAL with a message. */
int prism_qwenvl_proc_load_dir(const char *dir, prism_qwenvl_proc_t *p, char *err, size_t errlen);

/* True when every field is within bounds the functions here accept. */
bool prism_qwenvl_proc_valid(const prism_qwenvl_proc_t *p);

/* smart_resize(h, w, factor, min_pixels, max_pixels) exactly as transformers computes it.
 * PRISM_EINVAL for sizes outside [1, PRISM_IMAGE_MAX_DIM], an aspect ratio above 200, or a result
 * with a zero side (HF would make an empty image). */
int prism_qwenvl_smart_resize(int h, int w, int factor, int64_t min_pixels, int64_t max_pixels, int *out_h, int *out_w);

/* Resize, patch grid and token count of a w x h image with the processor's min/max pixels
 * (prism_qwenvl_grid_px: with others, e.g. a request's mm_processor_kwargs). */
int prism_qwenvl_grid(const prism_qwenvl_proc_t *p, int w, int h, prism_qwenvl_grid_t *g);
int prism_qwenvl_grid_px(const prism_qwenvl_proc_t *p, int64_t min_pixels, int64_t max_pixels, int w, int h,
                         prism_qwenvl_grid_t *g);

/* An upper bound of the LM tokens of any image with the processor's min/max pixels (aspect ratio
 * at most 200): max_pixels, or the short side clamped to one factor (smart_resize then exceeds
 * max_pixels: a 3000x20 image at max_pixels 12544 makes 28x1344), or min_pixels' upscale.
 * What a prefill worker sizes its embedding pool for by default. */
int64_t prism_qwenvl_max_tokens(const prism_qwenvl_proc_t *p);

/* The largest max_pixels with which no image needs more than max_tokens LM tokens (what a client
 * can ask for when an image is refused for its size): max_tokens * (patch * merge)^2. */
int64_t prism_qwenvl_max_pixels_for_tokens(const prism_qwenvl_proc_t *p, int64_t max_tokens);

/* ---- M-RoPE positions (transformers' get_rope_index for text and still images) ----
 * A prompt's images: image i takes tokens [offset, offset + rows * cols) (the image pads, row-major
 * over its LM-token grid), in increasing offset, not overlapping. Text token k gets k + shift in
 * all three components, shift being the sum over the images before it of max(rows, cols) -
 * rows * cols; an image's token (r, c) gets (s, s + r, s + c) with s = offset + its shift. Tokens
 * after the prompt (decode, a migrated request's generated tokens) continue as text. */
typedef struct {
    int32_t offset;
    int32_t rows, cols;        /* LM-token grid (prism_qwenvl_grid_t.tok_h / tok_w) */
} prism_mrope_image_t;

/* Positions of tokens [p0, p0 + n) into pos[0][..], pos[ld][..], pos[2 * ld][..] (t, h, w).
 * PRISM_EINVAL when the images are not ordered, overlap, or are empty. */
int prism_mrope_positions(const prism_mrope_image_t *imgs, int n_imgs, int32_t p0, int32_t n, int32_t *pos, size_t ld);
/* The shift of every token after the last image: HF's rope delta (max position + 1 - length,
 * for a prompt that ends after its last image), which a decode step adds to its position. */
int32_t prism_mrope_delta(const prism_mrope_image_t *imgs, int n_imgs);

/* ---- prism_image (pixels) ---- */

/* Floats of one patch row: 3 * patch^2 (one frame; see the header comment). */
static inline size_t prism_qwenvl_patch_floats(const prism_qwenvl_proc_t *p) { return (size_t)3 * p->patch * p->patch; }

/* Scratch bytes the stream sink needs for a w x h image (0 on invalid sizes). */
size_t prism_qwenvl_workspace_bytes(const prism_qwenvl_proc_t *p, int w, int h);
/* A workspace that fits every image of at most max_pixels pixels (sides <= PRISM_IMAGE_MAX_DIM)
 * with the processor's min/max pixels, or with max_pixels_cap when larger (per-request limits
 * are bounded by it). 0 on an invalid config. */
size_t prism_qwenvl_workspace_bound(const prism_qwenvl_proc_t *p, uint64_t max_pixels, int64_t max_pixels_cap);

typedef struct {
    const prism_qwenvl_proc_t *p;
    int64_t min_pixels, max_pixels;   /* the geometry's limits (the processor's unless a request set them) */
    void *ws;
    size_t ws_bytes;
    float *out;               /* [g.n_patches][3][patch][patch] */
    float lut[3][256];        /* uint8 -> normalized, per channel */
    prism_qwenvl_grid_t g;    /* of the image being decoded (set by begin) */
    prism_resample_t rs;
    bool begun;
} prism_qwenvl_stream_t;

/* A sink for prism_image_decoder_run that preprocesses rows as they are decoded into out, which
 * must hold the image's g.n_patches patch rows. Full-size decodes only (HF resizes the full image):
 * begin() fails with PRISM_EINVAL otherwise, and with PRISM_ELIMIT when ws_bytes is below the
 * image's prism_qwenvl_workspace_bytes. min/max pixels: the processor's (0, 0) or a request's. */
prism_image_sink_t prism_qwenvl_stream_sink(prism_qwenvl_stream_t *s, const prism_qwenvl_proc_t *p, int64_t min_pixels,
                                            int64_t max_pixels, void *ws, size_t ws_bytes, float *out);

/* PRISM_OK once every patch row was written (the decode delivered every row). */
int prism_qwenvl_stream_finish(const prism_qwenvl_stream_t *s);

/* img (RGB8, full decode) -> out [n_patches][3][patch][patch]: the stream sink fed with the
 * image's rows. PRISM_EINVAL on bad arguments, PRISM_ELIMIT when ws_bytes is too small. */
int prism_qwenvl_preprocess(const prism_qwenvl_proc_t *p, const prism_image_t *img, void *workspace, size_t ws_bytes,
                            float *out);

#endif
