/* Llama-4 image layout: the processor's config, the canvas choice with HF's mixed float32/float64
 * arithmetic, and the prompt layout. Pure arithmetic over the image's width and height (no pixels),
 * so it is its own leaf library (prism_image_layout: core + jansson): the router expands prompts
 * with it and the prefill worker sizes its embedding pool from it without linking image codecs. */
#include "image/llama4_proc.h"
#include "image/layout_json.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define MAX_CANVASES 512    /* sum of divisor counts of 1..PRISM_LLAMA4_MAX_PATCHES (64): 280 */

#define ERR(...) do { if (err && errlen) snprintf(err, errlen, __VA_ARGS__); } while (0)

void prism_llama4_proc_default(prism_llama4_proc_t *p)
{
    memset(p, 0, sizeof *p);
    p->tile = 336;
    p->max_patches = 16;
    p->resize_to_max_canvas = false;
    p->rescale_factor = 1.0 / 255.0;
    for (int c = 0; c < 3; c++) {
        p->mean[c] = 0.5f;
        p->std[c] = 0.5f;
    }
    p->tokens_per_tile = 144;
}

bool prism_llama4_proc_valid(const prism_llama4_proc_t *p)
{
    return p && p->tile >= 1 && p->tile <= PRISM_LLAMA4_MAX_TILE && p->max_patches >= 1 &&
           p->max_patches <= PRISM_LLAMA4_MAX_PATCHES && (long)p->tile * p->max_patches <= PRISM_IMAGE_MAX_DIM &&
           p->tokens_per_tile >= 1 && p->tokens_per_tile <= (1 << 20) && p->rescale_factor > 0 &&
           p->std[0] != 0 && p->std[1] != 0 && p->std[2] != 0;
}

/* ---------------------------------------------------------------- config */

int prism_llama4_proc_load_dir(const char *dir, prism_llama4_proc_t *p, char *err, size_t errlen)
{
    char path[4096];
    int rc;
    prism_llama4_proc_default(p);
    if ((rc = prism_path_join(path, sizeof path, dir, "preprocessor_config.json")) != PRISM_OK) return rc;
    json_t *j = prism_layout_load_json(path, false, &rc, err, errlen);
    if (!j) return rc == PRISM_OK ? PRISM_EINVAL : rc;
    const char *bad = NULL;
    json_t *size = json_object_get(j, "size");
    if (size && !json_is_null(size)) {
        json_t *hh = json_object_get(size, "height"), *ww = json_object_get(size, "width");
        if (!json_is_object(size) || !json_is_integer(hh) || !json_is_integer(ww) ||
            json_integer_value(hh) != json_integer_value(ww))
            bad = "size (must be {height, width}, square)";
        else
            p->tile = (int)PRISM_MIN(json_integer_value(hh), (json_int_t)INT32_MAX);
    }
    double v = p->max_patches;
    if (!bad && !prism_layout_opt_num(j, "max_patches", &v)) bad = "max_patches";
    p->max_patches = v >= 0 && v <= 1e6 ? (int)v : -1;
    json_t *rm = json_object_get(j, "resize_to_max_canvas");
    if (!bad && rm && !json_is_null(rm)) {
        if (!json_is_boolean(rm)) bad = "resize_to_max_canvas";
        else p->resize_to_max_canvas = json_is_true(rm);
    }
    if (!bad && !prism_layout_opt_num(j, "rescale_factor", &p->rescale_factor)) bad = "rescale_factor";
    if (!bad && !prism_layout_opt_triplet(j, "image_mean", p->mean)) bad = "image_mean";
    if (!bad && !prism_layout_opt_triplet(j, "image_std", p->std)) bad = "image_std";
    static const char *const must_true[] = {"do_resize", "do_rescale", "do_normalize"};
    for (size_t i = 0; !bad && i < PRISM_ARRAY_LEN(must_true); i++) {
        json_t *b = json_object_get(j, must_true[i]);
        if (b && !json_is_null(b) && !json_is_true(b)) bad = must_true[i];
    }
    double resample = 2;
    if (!bad && (!prism_layout_opt_num(j, "resample", &resample) || resample != 2)) bad = "resample (only bilinear, 2)";
    json_decref(j);
    if (bad) {
        ERR("%s: unsupported or invalid %s", path, bad);
        return PRISM_ENOTSUP;
    }
    /* tokens per tile as Llama4Processor computes it from its own patch_size and shuffle ratio. */
    double patch = 14, ratio = 0.5;
    if ((rc = prism_path_join(path, sizeof path, dir, "processor_config.json")) != PRISM_OK) return rc;
    json_t *pj = prism_layout_load_json(path, true, &rc, err, errlen);
    if (rc != PRISM_OK) return rc;
    if (pj) {
        bool ok = prism_layout_opt_num(pj, "patch_size", &patch) && prism_layout_opt_num(pj, "pixel_shuffle_ratio", &ratio);
        json_decref(pj);
        if (!ok) {
            ERR("%s: patch_size / pixel_shuffle_ratio must be numbers", path);
            return PRISM_EINVAL;
        }
    }
    if (!(patch >= 1 && patch <= p->tile && ratio > 0 && ratio <= 1)) {
        ERR("processor: patch_size %g / pixel_shuffle_ratio %g unsupported", patch, ratio);
        return PRISM_ENOTSUP;
    }
    long g = p->tile / (long)patch;
    long down = lround(1.0 / (ratio * ratio));
    p->tokens_per_tile = down >= 1 ? (int)(g * g / down) : 0;
    if (!prism_llama4_proc_valid(p)) {
        ERR("processor: tile %d, max_patches %d, tokens per tile %d out of range", p->tile, p->max_patches,
            p->tokens_per_tile);
        return PRISM_ENOTSUP;
    }
    return PRISM_OK;
}

/* ---------------------------------------------------------------- geometry */

typedef struct {
    int h, w;   /* in tiles */
} canvas_t;

/* find_supported_resolutions: for n = max..1, the factor pairs (f, n/f) with f ascending, grouped
 * by aspect ratio in order of first appearance; the grouped lists flattened in that order. */
static int canvases(int max_patches, canvas_t *out)
{
    canvas_t raw[MAX_CANVASES];
    int n_raw = 0;
    for (int n = max_patches; n >= 1; n--)
        for (int f = 1; f <= n; f++)
            if (n % f == 0) {
                PRISM_ASSERT(n_raw < MAX_CANVASES);
                raw[n_raw++] = (canvas_t){f, n / f};
            }
    bool used[MAX_CANVASES] = {0};
    int k = 0;
    for (int i = 0; i < n_raw; i++) {
        if (used[i]) continue;
        for (int j = i; j < n_raw; j++)
            if (!used[j] && (long)raw[j].h * raw[i].w == (long)raw[i].h * raw[j].w) {
                used[j] = true;
                out[k++] = raw[j];
            }
    }
    return k;
}

/* A scalar of HF's geometry: a float32 0-d tensor or a Python int/float (float64). */
typedef struct {
    double v;
    bool f32;
} hf_num_t;

static hf_num_t hf_div(hf_num_t a, int b)
{
    if (a.f32) return (hf_num_t){(double)((float)a.v / (float)b), true};
    return (hf_num_t){a.v / (double)b, false};
}

static bool hf_lt(hf_num_t a, hf_num_t b)
{
    if (a.f32 || b.f32) return (float)a.v < (float)b.v;   /* torch compares a Python scalar as float32 */
    return a.v < b.v;
}

static double hf_floor_mul(int x, hf_num_t s)
{
    if (s.f32) return floor((double)((float)x * (float)s.v));
    return floor((double)x * s.v);
}

static void grid_on(const prism_llama4_proc_t *p, const canvas_t *cv, int n, int w, int h, prism_llama4_grid_t *g);

int prism_llama4_grid(const prism_llama4_proc_t *p, int w, int h, prism_llama4_grid_t *g)
{
    if (!prism_llama4_proc_valid(p) || !g || w < 1 || h < 1 || w > PRISM_IMAGE_MAX_DIM || h > PRISM_IMAGE_MAX_DIM)
        return PRISM_EINVAL;
    canvas_t cv[MAX_CANVASES];
    int n = canvases(p->max_patches, cv);
    grid_on(p, cv, n, w, h, g);
    return PRISM_OK;
}

int prism_llama4_resize_extremes(const prism_llama4_proc_t *p, uint64_t max_pixels, double *ratio, int *max_w,
                                 int *max_h)
{
    if (!prism_llama4_proc_valid(p) || max_pixels == 0) return PRISM_EINVAL;
    canvas_t cv[MAX_CANVASES];
    int n = canvases(p->max_patches, cv);
    int dim = (int)PRISM_MIN(max_pixels, (uint64_t)PRISM_IMAGE_MAX_DIM);
    *ratio = 1.0;
    *max_w = *max_h = 1;
    /* The best canvas's scale only falls as the image grows, so for each width the largest
     * downscale is at the largest accepted height, and vice versa: every width and every height is
     * tried at that extreme. */
    for (int side = 1; side <= dim; side++) {
        int other = (int)PRISM_MIN((uint64_t)dim, max_pixels / (uint64_t)side);
        if (other < 1) break;
        for (int swap = 0; swap < 2; swap++) {
            int w = swap ? other : side, h = swap ? side : other;
            prism_llama4_grid_t g;
            grid_on(p, cv, n, w, h, &g);
            *ratio = PRISM_MAX(*ratio, PRISM_MAX((double)w / g.resized_w, (double)h / g.resized_h));
            *max_w = PRISM_MAX(*max_w, g.resized_w);
            *max_h = PRISM_MAX(*max_h, g.resized_h);
        }
    }
    return PRISM_OK;
}

static void grid_on(const prism_llama4_proc_t *p, const canvas_t *cv, int n, int w, int h, prism_llama4_grid_t *g)
{
    /* get_best_fit, in float32 like the tensors it works on. */
    float sel = 0;
    bool have_up = false, have = false;
    float scale[MAX_CANVASES];
    for (int i = 0; i < n; i++) {
        float sw = (float)(cv[i].w * p->tile) / (float)w, sh = (float)(cv[i].h * p->tile) / (float)h;
        scale[i] = sh > sw ? sw : sh;
        if (scale[i] >= 1.0f) {
            if (!have_up || (p->resize_to_max_canvas ? scale[i] > sel : scale[i] < sel)) sel = scale[i];
            have_up = true;
        }
    }
    if (!have_up)
        for (int i = 0; i < n; i++)
            if (scale[i] < 1.0f && (!have || scale[i] > sel)) {
                sel = scale[i];
                have = true;
            }
    int best = -1;
    for (int i = 0; i < n; i++)
        if (scale[i] == sel && (best < 0 || (long)cv[i].h * cv[i].w < (long)cv[best].h * cv[best].w)) best = i;
    PRISM_ASSERT(best >= 0);
    int th = cv[best].h * p->tile, tw = cv[best].w * p->tile;

    /* The clamp: min(max(side, tile), canvas side) keeps the canvas value (a tensor) only when it
     * is strictly smaller; get_max_res_without_distortion then divides, compares and floors in
     * float32 wherever a tensor is involved. */
    hf_num_t nth, ntw;
    if (p->resize_to_max_canvas) {
        nth = (hf_num_t){th, true};
        ntw = (hf_num_t){tw, true};
    } else {
        int ah = PRISM_MAX(h, p->tile), aw = PRISM_MAX(w, p->tile);
        nth = th < ah ? (hf_num_t){th, true} : (hf_num_t){ah, false};
        ntw = tw < aw ? (hf_num_t){tw, true} : (hf_num_t){aw, false};
    }
    hf_num_t scale_w = hf_div(ntw, w), scale_h = hf_div(nth, h);
    double nh, nw;
    if (hf_lt(scale_w, scale_h)) {
        nw = ntw.v;
        nh = PRISM_MIN(hf_floor_mul(h, scale_w), nth.v);
    } else {
        nh = nth.v;
        nw = PRISM_MIN(hf_floor_mul(w, scale_h), ntw.v);
    }
    g->rows = cv[best].h;
    g->cols = cv[best].w;
    g->resized_h = nh < 1 ? 1 : (int)nh;
    g->resized_w = nw < 1 ? 1 : (int)nw;
    int locals = g->rows * g->cols;
    g->n_tiles = locals + (locals > 1);
    g->n_patch_tokens = g->n_tiles * p->tokens_per_tile;
    g->n_prompt_tokens = 3 + p->tokens_per_tile;
    if (locals > 1) g->n_prompt_tokens += locals * p->tokens_per_tile + g->rows * (g->cols - 1) + g->rows;
}

int prism_llama4_expand(const prism_llama4_grid_t *g, int tokens_per_tile, const prism_llama4_image_tokens_t *t,
                        int32_t *out, size_t cap, size_t *n_out)
{
    if (!g || !t || !n_out || tokens_per_tile < 1 || g->rows < 1 || g->cols < 1) return PRISM_EINVAL;
    size_t locals = (size_t)g->rows * g->cols;
    size_t need = 3 + (size_t)tokens_per_tile;
    if (locals > 1) need += locals * tokens_per_tile + (size_t)g->rows * g->cols;
    if (need != (size_t)g->n_prompt_tokens) return PRISM_EINVAL;
    if (!out || need > cap) return PRISM_ELIMIT;
    size_t k = 0;
    out[k++] = t->image_start;
    if (locals > 1)
        for (int r = 0; r < g->rows; r++) {
            for (int c = 0; c < g->cols; c++) {
                for (int i = 0; i < tokens_per_tile; i++) out[k++] = t->patch;
                if (c < g->cols - 1) out[k++] = t->tile_x;
            }
            out[k++] = t->tile_y;
        }
    out[k++] = t->image;
    for (int i = 0; i < tokens_per_tile; i++) out[k++] = t->patch;
    out[k++] = t->image_end;
    PRISM_ASSERT(k == need);
    *n_out = k;
    return PRISM_OK;
}

int prism_llama4_max_tiles(const prism_llama4_proc_t *p)
{
    if (!prism_llama4_proc_valid(p)) return 0;
    return p->max_patches + (p->max_patches > 1);   /* the global tile comes with more than one local */
}
