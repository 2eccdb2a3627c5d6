#include "prep.h"

#include <stdio.h>
#include <string.h>

/* Qwen2.5-VL and Qwen3-VL share the processor (image/qwenvl_proc.h). */
static bool qwenvl(int arch) { return arch == PRISM_VISION_QWEN25 || arch == PRISM_VISION_QWEN3; }
#define ERR(...) do { if (err && errlen) snprintf(err, errlen, __VA_ARGS__); } while (0)

int enc_prep_plan(enc_prep_t *p, const prism_model_config_t *cfg, const char *model_dir, uint64_t max_pixels,
                  uint64_t max_decode_pixels, int decode_threads, int dct, char *err, size_t errlen)
{
    memset(p, 0, sizeof *p);
    p->arch = cfg->vision_arch;
    p->dct = dct;
    p->max_pixels = max_pixels;
    p->tile = cfg->v_image_size;
    p->max_width = (int)PRISM_MIN(max_pixels, (uint64_t)PRISM_IMAGE_MAX_DIM);
    int rc;
    if (p->arch == PRISM_VISION_LLAMA4) {
        if ((rc = prism_llama4_proc_load_dir(model_dir, &p->l4, err, errlen)) != PRISM_OK) return rc;
        if (p->l4.tile != cfg->v_image_size || p->l4.tokens_per_tile != cfg->image_seq_length) {
            ERR("Llama-4: the processor's %d px tiles of %d tokens disagree with the vision config (%d px, %d tokens)",
                p->l4.tile, p->l4.tokens_per_tile, cfg->v_image_size, cfg->image_seq_length);
            return PRISM_EINVAL;
        }
        if (dct == ENC_DCT_ALWAYS) {
            ERR("--jpeg-dct-scaling always is not available for Llama-4: its processor resizes the full-size image");
            return PRISM_ENOTSUP;
        }
        p->max_tiles = prism_llama4_max_tiles(&p->l4);
        p->ws_bytes = prism_llama4_workspace_bound(&p->l4, max_pixels);
    } else if (qwenvl(p->arch)) {
        if ((rc = prism_qwenvl_proc_load_dir(model_dir, &p->qw, err, errlen)) != PRISM_OK) return rc;
        if (p->qw.patch != cfg->v_patch || p->qw.merge != cfg->v_merge || p->qw.temporal != cfg->v_temporal_patch) {
            ERR("Qwen-VL: the processor's patch %d / merge %d / temporal %d disagree with the vision config (%d / %d / %d)",
                p->qw.patch, p->qw.merge, p->qw.temporal, cfg->v_patch, cfg->v_merge, cfg->v_temporal_patch);
            return PRISM_EINVAL;
        }
        if (dct == ENC_DCT_ALWAYS) {
            ERR("--jpeg-dct-scaling always is not available for Qwen-VL: its processor resizes the full-size image");
            return PRISM_ENOTSUP;
        }
        p->max_tiles = 1;
        p->ws_bytes = prism_qwenvl_workspace_bound(&p->qw, max_pixels, 0);
    } else {
        char path[4096];
        if ((rc = prism_path_join(path, sizeof(path), model_dir, "preprocessor_config.json")) != PRISM_OK) return rc;
        if ((rc = prism_clip_preproc_load(path, &p->clip, err, errlen)) != PRISM_OK) return rc;
        int ow, oh;
        prism_clip_output_size(&p->clip, p->tile, p->tile, &ow, &oh);
        if (ow != p->tile || oh != p->tile) {
            ERR("%s: the preprocessor makes %dx%d inputs, the vision tower takes %dx%d", path, ow, oh, p->tile, p->tile);
            return PRISM_EINVAL;
        }
        p->max_tiles = 1;
        p->ws_bytes = prism_clip_workspace_bound(&p->clip, max_pixels);
    }
    if (!p->ws_bytes || p->max_tiles < 1) {
        ERR("cannot plan image preprocessing for %llu pixels", (unsigned long long)max_pixels);
        return PRISM_EINVAL;
    }
    /* Decode memory: rows of the widest image accepted, plus whole-image state for
     * --max-decode-pixels; preprocessing scratch for any accepted image. */
    p->dec_bytes = prism_image_decoder_bytes(p->max_width, max_decode_pixels);
    p->relay_bytes = decode_threads > 1 ? prism_image_relay_bytes(p->max_width) : 0;
    return PRISM_OK;
}

int enc_prep_create(enc_prep_t *p)
{
    p->ws = prism_malloc_aligned(PRISM_MAX(p->ws_bytes, (size_t)64), 64);
    if (!p->ws || prism_image_decoder_create(p->dec_bytes, &p->dec) != PRISM_OK ||
        (p->relay_bytes && prism_image_relay_create(p->max_width, &p->relay) != PRISM_OK)) {
        enc_prep_destroy(p);
        return PRISM_ENOMEM;
    }
    return PRISM_OK;
}

void enc_prep_destroy(enc_prep_t *p)
{
    prism_image_relay_destroy(p->relay);
    prism_image_decoder_destroy(p->dec);
    prism_free_aligned(p->ws);
    p->relay = NULL;
    p->dec = NULL;
    p->ws = NULL;
}

static int probe(const enc_prep_t *p, const uint8_t *data, size_t len, prism_image_info_t *info, char *msg, size_t n)
{
    int rc = prism_image_probe(data, len, info);
    if (rc != PRISM_OK) {
        snprintf(msg, n, "The image could not be decoded: not a valid JPEG or PNG file.");
        return rc == PRISM_ELIMIT ? rc : PRISM_ECORRUPT;
    }
    if ((uint64_t)info->width * (uint64_t)info->height > p->max_pixels) {
        snprintf(msg, n, "Image of %dx%d pixels exceeds the limit of %llu pixels.", info->width, info->height,
                 (unsigned long long)p->max_pixels);
        return PRISM_ELIMIT;
    }
    return PRISM_OK;
}

int enc_prep_tiles(const enc_prep_t *p, const uint8_t *data, size_t len, int *n_tiles, char *msg, size_t n)
{
    prism_image_info_t info;
    int rc = probe(p, data, len, &info, msg, n);
    if (rc != PRISM_OK) return rc;
    if (p->arch != PRISM_VISION_LLAMA4) {
        *n_tiles = 1;
        return PRISM_OK;
    }
    prism_llama4_grid_t g;
    if (prism_llama4_grid(&p->l4, info.width, info.height, &g) != PRISM_OK) {
        snprintf(msg, n, "Image of %dx%d pixels cannot be tiled.", info.width, info.height);
        return PRISM_ELIMIT;
    }
    PRISM_ASSERT(g.n_tiles >= 1 && g.n_tiles <= p->max_tiles);
    *n_tiles = g.n_tiles;
    return PRISM_OK;
}

/* The processor at a request's limits (max_pixels 0: its own); the router kept them within its own
 * max_pixels, which the workspace is planned for (checked per image all the same). */
static prism_qwenvl_proc_t qw_at(const enc_prep_t *p, int64_t min_pixels, int64_t max_pixels)
{
    prism_qwenvl_proc_t q = p->qw;
    if (max_pixels > 0) {
        q.min_pixels = min_pixels;
        q.max_pixels = max_pixels;
    }
    return q;
}

int enc_prep_grid(const enc_prep_t *p, const uint8_t *data, size_t len, int64_t min_pixels, int64_t max_pixels,
                  int max_tokens, prism_qwenvl_grid_t *g, char *msg, size_t n)
{
    prism_image_info_t info;
    int rc = probe(p, data, len, &info, msg, n);
    if (rc != PRISM_OK) return rc;
    prism_qwenvl_proc_t qw = qw_at(p, min_pixels, max_pixels);
    if (prism_qwenvl_grid(&qw, info.width, info.height, g) != PRISM_OK) {
        snprintf(msg, n, "Image of %dx%d pixels cannot be resized for the model: its aspect ratio is above 200.",
                 info.width, info.height);
        return PRISM_ELIMIT;
    }
    if (max_tokens > 0 && g->n_tokens > max_tokens) {
        snprintf(msg, n, "Image of %dx%d pixels needs %d image tokens; this server takes at most %d per image (a "
                 "max_pixels of %lld or less would fit).", info.width, info.height, g->n_tokens, max_tokens,
                 (long long)prism_qwenvl_max_pixels_for_tokens(&p->qw, max_tokens));
        return PRISM_ELIMIT;
    }
    if (prism_qwenvl_workspace_bytes(&qw, info.width, info.height) > p->ws_bytes) {
        snprintf(msg, n, "Image of %dx%d pixels needs more preprocessing memory than planned.", info.width, info.height);
        return PRISM_ELIMIT;
    }
    return PRISM_OK;
}

int enc_prep_run(enc_prep_t *p, const uint8_t *data, size_t len, int64_t min_pixels, int64_t max_pixels,
                 float *pixels, char *msg, size_t n)
{
    prism_image_info_t info;
    int rc = probe(p, data, len, &info, msg, n);
    if (rc != PRISM_OK) return rc;
    prism_image_decode_opts_t opts = {.max_pixels = p->max_pixels};
    prism_clip_stream_t cs;
    prism_llama4_stream_t ls;
    prism_qwenvl_stream_t qs;
    prism_image_sink_t sink;
    if (p->arch == PRISM_VISION_LLAMA4) {
        sink = prism_llama4_stream_sink(&ls, &p->l4, p->ws, p->ws_bytes, pixels);
    } else if (qwenvl(p->arch)) {
        sink = prism_qwenvl_stream_sink(&qs, &p->qw, max_pixels > 0 ? min_pixels : 0, PRISM_MAX(max_pixels, 0), p->ws,
                                        p->ws_bytes, pixels);
    } else {
        int tw, th;
        if (prism_clip_resize_target(&p->clip, info.width, info.height, &tw, &th) != PRISM_OK) {
            snprintf(msg, n, "Image of %dx%d pixels cannot be resized to the model's input: its aspect ratio is too "
                     "extreme.", info.width, info.height);
            return PRISM_ELIMIT;
        }
        if (p->dct == ENC_DCT_ALWAYS) prism_clip_decode_opts(&p->clip, &info, &opts);
        sink = prism_clip_stream_sink(&cs, &p->clip, p->ws, p->ws_bytes, pixels);
    }
    prism_image_sink_t inner = sink;
    if (p->relay) sink = prism_image_relay_sink(p->relay, &inner);
    rc = prism_image_decoder_run(p->dec, data, len, &opts, &sink);
    if (rc == PRISM_OK)
        rc = p->arch == PRISM_VISION_LLAMA4  ? prism_llama4_stream_finish(&ls)
           : qwenvl(p->arch) ? prism_qwenvl_stream_finish(&qs)
                                             : prism_clip_stream_finish(&cs);
    if (rc == PRISM_ELIMIT) {
        snprintf(msg, n, "The %dx%d %s image cannot be decoded: %s.", info.width, info.height,
                 prism_image_format_name(info.format), prism_image_decoder_error(p->dec)[0]
                                                           ? prism_image_decoder_error(p->dec)
                                                           : "its preprocessing needs more memory than planned");
        return rc;
    }
    if (rc != PRISM_OK) {
        snprintf(msg, n, "The image could not be decoded (%s): %s.", prism_strerror(rc),
                 prism_image_decoder_error(p->dec)[0] ? prism_image_decoder_error(p->dec)
                                                      : "the data is corrupt or truncated");
        return rc;
    }
    return PRISM_OK;
}
