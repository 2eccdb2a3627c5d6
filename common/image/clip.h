/* clip: the CLIP image processor used by LLaVA checkpoints (transformers CLIPImageProcessor).
 *
 * Steps, in HF's order: resize so the shortest edge is size.shortest_edge (output size rounded as
 * transformers' get_resize_output_image_size: long = int(short_target * long / short)), center crop
 * to crop_size (zero padding when the image is smaller), x * rescale_factor, (x - mean) / std,
 * channels-first float32.
 *
 * Two bit-exact modes (verified on 24 fixtures at 64/224/336 and a padded crop, see
 * tools/gen_image_goldens.py):
 *  - PRISM_CLIP_RESAMPLE_TORCHVISION (default): transformers' torchvision CLIPImageProcessor, which
 *    AutoImageProcessor returns whenever torchvision is installed (always with vLLM): torch's uint8
 *    antialiased CPU kernel (int16 coefficients, one precision per axis), fused float32
 *    (x - mean/s) / (std/s) normalization, torchvision's center-crop padding.
 *  - PRISM_CLIP_RESAMPLE_PIL: CLIPImageProcessorPil (transformers without torchvision): Pillow's
 *    ImagingResample (22-bit coefficients), numpy float64 rescale then float32 normalization.
 * The two references differ from each other by at most 2 uint8 levels (0.030 after normalization)
 * on a handful of pixels. Both resample separably, horizontal pass first, with uint8 rounding
 * between and after the passes, and only the crop window is ever computed (image/resample.h:
 * rows are resampled as they are decoded; no whole image or whole intermediate is held).
 *
 *   prism_clip_preproc_t p;
 *   char err[256];
 *   prism_clip_preproc_load("ckpt/preprocessor_config.json", &p, err, sizeof err);
 *   size_t ws = prism_clip_preprocess_workspace_bytes(&p, img.w, img.h);
 *   float *px = ...;                                   // [3][p.crop_h][p.crop_w]
 *   prism_clip_preprocess(&p, &img, workspace, ws, px);
 */
#ifndef PRISM_IMAGE_CLIP_H
#define PRISM_IMAGE_CLIP_H

#include "core/core.h"
#include "image/image.h"
#include "image/resample.h"

typedef enum {
    PRISM_CLIP_RESAMPLE_TORCHVISION = 0,  /* torch uint8 AA kernel, int16 coefficients (vLLM's) */
    PRISM_CLIP_RESAMPLE_PIL,              /* Pillow ImagingResample, 22-bit coefficients */
} prism_clip_resample_impl_t;

typedef enum {
    PRISM_CLIP_FILTER_BILINEAR = 2,   /* PIL resample codes, as in preprocessor_config.json */
    PRISM_CLIP_FILTER_BICUBIC = 3,
} prism_clip_filter_t;

typedef struct {
    int shortest_edge;            /* size.shortest_edge; 0 when size is {height, width} */
    int resize_h, resize_w;       /* size.{height,width} (used when shortest_edge is 0) */
    int crop_h, crop_w;
    bool do_resize, do_center_crop, do_rescale, do_normalize, do_convert_rgb;
    float rescale_factor;         /* applied as double then rounded to float, like numpy */
    double rescale_factor_f64;    /* exact JSON value */
    float mean[3], std[3];
    prism_clip_filter_t filter;
    prism_clip_resample_impl_t impl;
} prism_clip_preproc_t;

/* OpenAI CLIP / LLaVA-1.5 defaults for a given size (336 for llava-1.5, 224 for ViT-L/14). */
void prism_clip_preproc_default(prism_clip_preproc_t *p, int size);

/* Reads a preprocessor_config.json. Accepts size as int, {"shortest_edge"} or {"height","width"},
 * crop_size as int or {"height","width"}; missing keys take CLIPImageProcessor defaults.
 * PRISM_ENOTSUP for a resample filter other than bilinear/bicubic; PRISM_EINVAL otherwise, with a
 * message in err. */
int prism_clip_preproc_load(const char *preprocessor_config_json_path, prism_clip_preproc_t *p,
                            char *err, size_t errlen);

/* Resized (pre-crop) size for an image of src_w x src_h, exactly as transformers computes it. */
int prism_clip_resize_target(const prism_clip_preproc_t *p, int src_w, int src_h, int *out_w, int *out_h);

/* Decode options for this preprocessor: sets opts->min_w/min_h to the resize target when the
 * image is a JPEG at least twice that size in both dimensions (prism_image_decode_opts_for_target),
 * else 0. Preprocessing a decode made with them yields the same output shape and crop as a full
 * decode; pixel values move slightly (measured in tests/unit/image/image_measure.c). */
void prism_clip_decode_opts(const prism_clip_preproc_t *p, const prism_image_info_t *info,
                            prism_image_decode_opts_t *opts);

/* Final output size ([3][h][w]). */
static inline void prism_clip_output_size(const prism_clip_preproc_t *p, int src_w, int src_h, int *w, int *h)
{
    if (p->do_center_crop) {
        *w = p->crop_w;
        *h = p->crop_h;
    } else {
        prism_clip_resize_target(p, src_w, src_h, w, h);
    }
}

/* Scratch bytes prism_clip_preprocess needs for a decoded image of src_w x src_h (the decoded size,
 * which may be DCT-scaled: the bound allows for the few pixels by which the file's geometry may
 * round differently; with center crop it always holds). Lets a worker size its scratch per pool
 * slot before decoding. 0 on invalid sizes. */
size_t prism_clip_preprocess_workspace_bytes(const prism_clip_preproc_t *p, int src_w, int src_h);

/* Exact scratch bytes for this decoded image (geometry from img->src_w/src_h). 0 on invalid input. */
size_t prism_clip_preprocess_workspace_bytes_img(const prism_clip_preproc_t *p, const prism_image_t *img);

/* rgb->w x rgb->h pixels are resampled to the geometry computed from rgb->src_w x rgb->src_h (the
 * file's size; equal to w x h without DCT scaling), so a DCT-scaled decode gives the same output
 * shape and crop as a full one. out is [3][crop_h][crop_w] (or the resize target without crop).
 * PRISM_EINVAL on bad arguments, PRISM_ELIMIT when ws_bytes is too small. */
int prism_clip_preprocess(const prism_clip_preproc_t *p, const prism_image_t *rgb, void *workspace,
                          size_t ws_bytes, float *out);

/* Scratch bytes that prism_clip_stream_sink needs for any image of at most max_pixels pixels
 * (either side <= PRISM_IMAGE_MAX_DIM, decoded at full size or DCT-scaled): a worker sizes it
 * once. O(max width + crop x taps). */
size_t prism_clip_workspace_bound(const prism_clip_preproc_t *p, uint64_t max_pixels);

/* Geometry of one decoded image (filled by the sink's begin). */
typedef struct {
    prism_resample_spec_t rs;
    int off_x, off_y;         /* crop offset in resized coordinates (negative: zero padding) */
    int out_w, out_h;         /* output size */
} prism_clip_plan_t;

typedef struct {
    const prism_clip_preproc_t *p;
    void *ws;
    size_t ws_bytes;
    float *out;
    float lut[3][256];        /* uint8 -> normalized value per channel */
    prism_clip_plan_t plan;
    prism_resample_t rs;
    bool begun;
} prism_clip_stream_t;

/* A sink for prism_image_decoder_run that preprocesses the rows as they are decoded into out
 * ([3][h][w] as prism_clip_output_size). The workspace must hold the image's plan: PRISM_ELIMIT
 * from the decode otherwise (prism_clip_workspace_bound always suffices). */
prism_image_sink_t prism_clip_stream_sink(prism_clip_stream_t *s, const prism_clip_preproc_t *p, void *ws,
                                          size_t ws_bytes, float *out);

/* PRISM_OK once every output row was written (the decode delivered every row it needed). */
int prism_clip_stream_finish(const prism_clip_stream_t *s);

#endif
