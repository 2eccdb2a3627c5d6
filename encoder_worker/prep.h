/* prep: what the encoder does to one image before the vision tower, for either vision tower.
 *
 * An image becomes tiles of [3][tile][tile] float32: one for CLIP (LLaVA: the resized center
 * crop), rows x cols local tiles plus a global one for Llama-4 (its processor's canvas). How many
 * is known from the header alone (enc_prep_tiles: the same arithmetic the router used to lay out
 * the prompt), so the caller reserves pixel rows for a whole image before decoding it. The decode
 * streams rows (image/image.h) into the model's preprocessor sink (image/clip.h,
 * image/llama4_proc.h), optionally on a relay thread, straight into those tiles.
 *
 * Memory, all sized at start-up from the limits and counted in the worker's plan: the decoder
 * region (rows of the widest image + whole-image state for --max-decode-pixels), the relay ring,
 * and the preprocessing workspace for any accepted image. Nothing is allocated per image. */
#ifndef PRISM_ENCODER_PREP_H
#define PRISM_ENCODER_PREP_H

#include "core/core.h"
#include "model/model.h"
#include "image/image.h"
#include "image/clip.h"
#include "image/llama4_proc.h"
#include "image/qwenvl_proc.h"

/* JPEG DCT-domain downscaling trades exactness for speed: HF decodes every image at full size, so
 * a scaled decode moves pixels (and can change a greedy token). "always" scales every JPEG at least
 * twice the model's resize target (CLIP only: Llama-4's processor resizes the full image). "auto"
 * and "never" decode at full size: streaming needs only a few rows at any size, and what a full
 * decode may not fit (a progressive JPEG's coefficients) DCT scaling would not shrink. */
enum { ENC_DCT_AUTO, ENC_DCT_ALWAYS, ENC_DCT_NEVER };

typedef struct {
    int arch;                      /* prism_vision_arch_t */
    prism_clip_preproc_t clip;
    prism_llama4_proc_t l4;
    prism_qwenvl_proc_t qw;        /* native resolution (Qwen-VL): patches instead of tiles */
    int tile;                      /* pixels per tile side */
    int max_tiles;                 /* tiles of the largest image: 1 for CLIP */
    int dct;                       /* ENC_DCT_* */
    uint64_t max_pixels;
    int max_width;                 /* widest image the decoder takes */
    size_t dec_bytes, relay_bytes, ws_bytes;   /* the plan's "decode" and "preprocess" */
    prism_image_decoder_t *dec;
    prism_image_relay_t *relay;    /* NULL with one decode thread */
    void *ws;
} enc_prep_t;

/* Reads the preprocessor config(s) of model_dir for cfg's vision tower and sizes everything
 * (no allocation yet). PRISM_EINVAL / PRISM_ENOTSUP with err filled. */
int  enc_prep_plan(enc_prep_t *p, const prism_model_config_t *cfg, const char *model_dir, uint64_t max_pixels,
                   uint64_t max_decode_pixels, int decode_threads, int dct, char *err, size_t errlen);
/* Allocates the decoder region, relay and workspace (counted). */
int  enc_prep_create(enc_prep_t *p);
void enc_prep_destroy(enc_prep_t *p);

/* Tiles the image needs, from its header. Fails with a client-facing message (PRISM_ECORRUPT for
 * data that is not an image, PRISM_ELIMIT for limits). */
int  enc_prep_tiles(const enc_prep_t *p, const uint8_t *data, size_t len, int *n_tiles, char *msg, size_t n);
/* Native-resolution models: the image's patch grid and LM tokens, from its header (the router's
 * arithmetic) at the request's min_pixels / max_pixels (Encode's mm_processor_kwargs; max_pixels 0:
 * the processor's own); refused with a client-facing message when it cannot be resized (aspect
 * ratio above 200) or needs more than max_tokens LM tokens (0: no bound) or more preprocessing
 * memory than planned. */
int  enc_prep_grid(const enc_prep_t *p, const uint8_t *data, size_t len, int64_t min_pixels, int64_t max_pixels,
                   int max_tokens, prism_qwenvl_grid_t *g, char *msg, size_t n);
/* Decodes and preprocesses the image into pixels ([n_tiles][3][tile][tile], room for what
 * enc_prep_tiles said; native resolution: [n_patches][3][p][p], at min_pixels / max_pixels as for
 * enc_prep_grid). Fails with a client-facing message. */
int  enc_prep_run(enc_prep_t *p, const uint8_t *data, size_t len, int64_t min_pixels, int64_t max_pixels,
                  float *pixels, char *msg, size_t n);

#endif
