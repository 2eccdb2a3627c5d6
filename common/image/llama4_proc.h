/* llama4_proc: the Llama-4 image processor and image prompt layout (transformers'
 * Llama4ImageProcessor + Llama4Processor._prompt_split_image), as pure functions.
 *
 * Geometry (needs only the image's width and height, so the router calls it on the header):
 *   canvases are (r*tile, c*tile) with r*c <= max_patches; the best one is the smallest upscale
 *   >= 1 if any (largest with resize_to_max_canvas), else the mildest downscale; ties go to the
 *   smallest area, then to the first in HF's canvas order. The image is resized without distortion
 *   to fit min(max(side, tile), canvas side) (bilinear, antialiased, torch's uint8 kernel), padded
 *   right/bottom with zeros, split into r x c tiles row-major, and when r*c > 1 a global tile (the
 *   whole image resized to tile x tile, aspect not kept) is appended last.
 *   The float32/float64 arithmetic of HF's geometry (some of its scalars are float32 tensors) is
 *   reproduced, so floor() at exact products lands where HF's does.
 * Values: x * rescale_factor, then (x - mean) / std, each step rounded to bfloat16 as HF computes
 *   it (outputs are bf16 values held in float32).
 * Prompt: <|image_start|> [for each row: for each col: tokens_per_tile x <|patch|>, with
 *   <|tile_x_separator|> between cols; <|tile_y_separator|> after each row] (only when r*c > 1)
 *   <|image|> tokens_per_tile x <|patch|> <|image_end|>. The encoder's rows fill the <|patch|>
 *   positions in tile order (locals row-major, then the global tile).
 *
 *   prism_llama4_proc_t p;
 *   prism_llama4_proc_load_dir("ckpt", &p, err, sizeof err);     // preprocessor + processor config
 *   prism_llama4_grid_t g;
 *   prism_llama4_grid(&p, w, h, &g);                               // router: g.n_prompt_tokens
 *   prism_llama4_expand(&g, p.tokens_per_tile, &ids, out, cap, &n); // prompt token ids
 *   // encoder: decoded rows stream into the tiles [g.n_tiles][3][tile][tile]
 *   prism_llama4_stream_t st;
 *   prism_image_sink_t sink = prism_llama4_stream_sink(&st, &p, ws, prism_llama4_workspace_bound(&p, max_px), px);
 *   prism_image_decoder_run(dec, bytes, n, &opts, &sink);  then  prism_llama4_stream_finish(&st);
 *   // or, with a whole decoded image: prism_llama4_preprocess(&p, &img, ws, ws_bytes, px);
 *
 * Two libraries: the config, geometry and prompt layout (llama4_layout.c) are the leaf
 * prism_image_layout (core + jansson), which the router and the prefill worker link; the pixels
 * (llama4_proc.c) are in prism_image with the decoders and the resampler.
 * Ownership: every function writes only into caller buffers; nothing allocates.
 */
#ifndef PRISM_IMAGE_LLAMA4_PROC_H
#define PRISM_IMAGE_LLAMA4_PROC_H

#include "core/core.h"
#include "image/image.h"
#include "image/resample.h"

/* Bounds on what a config may ask for (Scout: tile 336, max_patches 16). */
#define PRISM_LLAMA4_MAX_TILE     2048
#define PRISM_LLAMA4_MAX_PATCHES  64

typedef struct {
    int tile;                  /* size.height == size.width */
    int max_patches;           /* most local tiles in a canvas */
    bool resize_to_max_canvas;
    double rescale_factor;     /* 1/255 */
    float mean[3], std[3];     /* 0.5, 0.5 */
    int tokens_per_tile;       /* (tile/patch_size)^2 * pixel_shuffle_ratio^2: 144 at Scout */
} prism_llama4_proc_t;

typedef struct {
    int rows, cols;            /* local tile grid of the canvas */
    int resized_w, resized_h;  /* aspect-preserving resize before padding to the canvas */
    int n_tiles;               /* rows*cols, plus the global tile when rows*cols > 1 */
    int n_patch_tokens;        /* n_tiles * tokens_per_tile: rows of the encoder's output */
    int n_prompt_tokens;       /* length of the expansion of one <|image|> */
} prism_llama4_grid_t;

/* The token ids of the image prompt (from the tokenizer's vocabulary). */
typedef struct {
    int32_t image_start, image_end, tile_x, tile_y, image, patch;
} prism_llama4_image_tokens_t;

/* ---- prism_image_layout ---- */

/* transformers' defaults: 336 px tiles, max_patches 16, mean/std 0.5, 1/255, 144 tokens per tile. */
void prism_llama4_proc_default(prism_llama4_proc_t *p);

/* Reads <dir>/preprocessor_config.json (size, max_patches, resize_to_max_canvas, image_mean,
 * image_std, rescale_factor; do_resize/do_rescale/do_normalize must be true and resample bilinear)
 * and the optional <dir>/processor_config.json (patch_size, pixel_shuffle_ratio) for
 * tokens_per_tile. Missing keys take the defaults. PRISM_ENOTSUP / PRISM_EINVAL with a message. */
int prism_llama4_proc_load_dir(const char *dir, prism_llama4_proc_t *p, char *err, size_t errlen);

/* True when every field is within the bounds above (a config the functions here accept). */
bool prism_llama4_proc_valid(const prism_llama4_proc_t *p);

/* Most tiles one image can need: max_patches local tiles plus the global one (0 on an invalid
 * config). Encoder pixel buffers and the prefill worker's embedding pool are sized from it. */
int prism_llama4_max_tiles(const prism_llama4_proc_t *p);

/* Tile grid, resize and token counts for a w x h image. PRISM_EINVAL for sizes outside
 * [1, PRISM_IMAGE_MAX_DIM] or an invalid config. */
int prism_llama4_grid(const prism_llama4_proc_t *p, int w, int h, prism_llama4_grid_t *g);

/* Over every image of at most max_pixels pixels (sides <= PRISM_IMAGE_MAX_DIM): the largest
 * downscale ratio of the aspect-preserving resize (either axis, input / output) and the largest
 * resized width and height. For planning the resampling memory once. */
int prism_llama4_resize_extremes(const prism_llama4_proc_t *p, uint64_t max_pixels, double *ratio, int *max_w,
                                 int *max_h);

/* Writes the expansion of one image (g->n_prompt_tokens ids) to out. PRISM_ELIMIT when cap is
 * too small (nothing written), PRISM_EINVAL on a bad grid. */
int prism_llama4_expand(const prism_llama4_grid_t *g, int tokens_per_tile, const prism_llama4_image_tokens_t *t,
                        int32_t *out, size_t cap, size_t *n_out);

/* ---- prism_image (pixels) ---- */

/* Scratch bytes prism_llama4_preprocess (and the stream sink) needs for a w x h image (0 on
 * invalid sizes). */
size_t prism_llama4_preprocess_workspace_bytes(const prism_llama4_proc_t *p, int w, int h);

/* A workspace that fits every image of at most max_pixels pixels (a few MiB at Scout's config and
 * 4096x4096): an encoder sizes it once. 0 on an invalid config. */
size_t prism_llama4_workspace_bound(const prism_llama4_proc_t *p, uint64_t max_pixels);

typedef struct {
    const prism_llama4_proc_t *p;
    void *ws;
    size_t ws_bytes;
    float *out;               /* [g.n_tiles][3][tile][tile] */
    float lut[3][256];        /* uint8 -> normalized (bf16 steps) per channel */
    prism_llama4_grid_t g;    /* of the image being decoded (set by begin) */
    prism_resample_t local;   /* aspect-preserving resize, cut into the local tiles */
    prism_resample_t global;  /* the whole image to tile x tile (when n_tiles > 1) */
    bool has_global, begun;
} prism_llama4_stream_t;

/* A sink for prism_image_decoder_run that preprocesses rows as they are decoded into out, which
 * must hold prism_llama4_grid's n_tiles tiles for the image. The decode must be full size (no DCT
 * scaling: HF resizes the full image): begin() fails with PRISM_EINVAL otherwise, and with
 * PRISM_ELIMIT when ws_bytes is below the image's prism_llama4_preprocess_workspace_bytes. */
prism_image_sink_t prism_llama4_stream_sink(prism_llama4_stream_t *s, const prism_llama4_proc_t *p, void *ws,
                                            size_t ws_bytes, float *out);

/* PRISM_OK once every tile row was written (the decode delivered every row). */
int prism_llama4_stream_finish(const prism_llama4_stream_t *s);

/* img (RGB8, full decode: w == src_w) -> out [n_tiles][3][tile][tile] float32 (bf16 values): the
 * stream sink fed with the image's rows. PRISM_EINVAL on bad arguments, PRISM_ELIMIT when
 * ws_bytes is too small. */
int prism_llama4_preprocess(const prism_llama4_proc_t *p, const prism_image_t *img, void *workspace,
                            size_t ws_bytes, float *out);

#endif
