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
 *   size_t ws = prism_llama4_preprocess_workspace_bytes(&p, w, h);
 *   prism_llama4_preprocess(&p, &img, workspace, ws, pixels);      // [g.n_tiles][3][tile][tile]
 *   prism_llama4_expand(&g, p.tokens_per_tile, &ids, out, cap, &n); // prompt token ids
 *
 * Ownership: every function writes only into caller buffers; nothing allocates.
 */
#ifndef PRISM_IMAGE_LLAMA4_PROC_H
#define PRISM_IMAGE_LLAMA4_PROC_H

#include "core/core.h"
#include "image/image.h"

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

/* transformers' defaults: 336 px tiles, max_patches 16, mean/std 0.5, 1/255, 144 tokens per tile. */
void prism_llama4_proc_default(prism_llama4_proc_t *p);

/* Reads <dir>/preprocessor_config.json (size, max_patches, resize_to_max_canvas, image_mean,
 * image_std, rescale_factor; do_resize/do_rescale/do_normalize must be true and resample bilinear)
 * and the optional <dir>/processor_config.json (patch_size, pixel_shuffle_ratio) for
 * tokens_per_tile. Missing keys take the defaults. PRISM_ENOTSUP / PRISM_EINVAL with a message. */
int prism_llama4_proc_load_dir(const char *dir, prism_llama4_proc_t *p, char *err, size_t errlen);

/* Tile grid, resize and token counts for a w x h image. PRISM_EINVAL for sizes outside
 * [1, PRISM_IMAGE_MAX_DIM] or an invalid config. */
int prism_llama4_grid(const prism_llama4_proc_t *p, int w, int h, prism_llama4_grid_t *g);

/* Scratch bytes prism_llama4_preprocess needs for a decoded w x h image (0 on invalid sizes). */
size_t prism_llama4_preprocess_workspace_bytes(const prism_llama4_proc_t *p, int w, int h);

/* img (RGB8, full decode: w == src_w) -> out [n_tiles][3][tile][tile] float32 (bf16 values).
 * PRISM_EINVAL on bad arguments, PRISM_ELIMIT when ws_bytes is too small. */
int prism_llama4_preprocess(const prism_llama4_proc_t *p, const prism_image_t *img, void *workspace,
                            size_t ws_bytes, float *out);

/* Writes the expansion of one image (g->n_prompt_tokens ids) to out. PRISM_ELIMIT when cap is
 * too small (nothing written), PRISM_EINVAL on a bad grid. */
int prism_llama4_expand(const prism_llama4_grid_t *g, int tokens_per_tile, const prism_llama4_image_tokens_t *t,
                        int32_t *out, size_t cap, size_t *n_out);

#endif
