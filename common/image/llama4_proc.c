/* Llama-4 image processor: canvas choice with HF's mixed float32/float64 arithmetic, resize through
 * the torch-exact resampler of image/clip.h, bf16 normalization, tiling, and the prompt layout. */
#include "image/llama4_proc.h"
#include "image/clip.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define MAX_CONFIG_BYTES (1u << 20)
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

static bool proc_valid(const prism_llama4_proc_t *p)
{
    return p && p->tile >= 1 && p->tile <= PRISM_LLAMA4_MAX_TILE && p->max_patches >= 1 &&
           p->max_patches <= PRISM_LLAMA4_MAX_PATCHES && (long)p->tile * p->max_patches <= PRISM_IMAGE_MAX_DIM &&
           p->tokens_per_tile >= 1 && p->tokens_per_tile <= (1 << 20) && p->rescale_factor > 0 &&
           p->std[0] != 0 && p->std[1] != 0 && p->std[2] != 0;
}

/* ---------------------------------------------------------------- config */

static json_t *load_json(const char *path, bool optional, int *rc, char *err, size_t errlen)
{
    *rc = PRISM_OK;
    if (optional && !prism_file_exists(path)) return NULL;
    char *text = NULL;
    size_t n = 0;
    *rc = prism_read_file(path, MAX_CONFIG_BYTES, &text, &n);
    if (*rc != PRISM_OK) {
        ERR("%s: %s", path, prism_strerror(*rc));
        return NULL;
    }
    json_error_t jerr;
    json_t *j = json_loadb(text, n, JSON_REJECT_DUPLICATES, &jerr);
    prism_free(text);
    if (!j || !json_is_object(j)) {
        ERR("%s: %s", path, j ? "not a JSON object" : jerr.text);
        json_decref(j);
        *rc = PRISM_EINVAL;
        return NULL;
    }
    return j;
}

static bool opt_num(json_t *o, const char *k, double *v)
{
    json_t *j = json_object_get(o, k);
    if (!j || json_is_null(j)) return true;
    if (!json_is_number(j)) return false;
    *v = json_number_value(j);
    return true;
}

static bool opt_triplet(json_t *o, const char *k, float out[3])
{
    json_t *j = json_object_get(o, k);
    if (!j || json_is_null(j)) return true;
    if (json_is_number(j)) {
        out[0] = out[1] = out[2] = (float)json_number_value(j);
        return true;
    }
    if (!json_is_array(j) || json_array_size(j) != 3) return false;
    for (int c = 0; c < 3; c++) {
        if (!json_is_number(json_array_get(j, c))) return false;
        out[c] = (float)json_number_value(json_array_get(j, c));
    }
    return true;
}

int prism_llama4_proc_load_dir(const char *dir, prism_llama4_proc_t *p, char *err, size_t errlen)
{
    char path[4096];
    int rc;
    prism_llama4_proc_default(p);
    if ((rc = prism_path_join(path, sizeof path, dir, "preprocessor_config.json")) != PRISM_OK) return rc;
    json_t *j = load_json(path, false, &rc, err, errlen);
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
    if (!bad && !opt_num(j, "max_patches", &v)) bad = "max_patches";
    p->max_patches = v >= 0 && v <= 1e6 ? (int)v : -1;
    json_t *rm = json_object_get(j, "resize_to_max_canvas");
    if (!bad && rm && !json_is_null(rm)) {
        if (!json_is_boolean(rm)) bad = "resize_to_max_canvas";
        else p->resize_to_max_canvas = json_is_true(rm);
    }
    if (!bad && !opt_num(j, "rescale_factor", &p->rescale_factor)) bad = "rescale_factor";
    if (!bad && !opt_triplet(j, "image_mean", p->mean)) bad = "image_mean";
    if (!bad && !opt_triplet(j, "image_std", p->std)) bad = "image_std";
    static const char *const must_true[] = {"do_resize", "do_rescale", "do_normalize"};
    for (size_t i = 0; !bad && i < PRISM_ARRAY_LEN(must_true); i++) {
        json_t *b = json_object_get(j, must_true[i]);
        if (b && !json_is_null(b) && !json_is_true(b)) bad = must_true[i];
    }
    double resample = 2;
    if (!bad && (!opt_num(j, "resample", &resample) || resample != 2)) bad = "resample (only bilinear, 2)";
    json_decref(j);
    if (bad) {
        ERR("%s: unsupported or invalid %s", path, bad);
        return PRISM_ENOTSUP;
    }
    /* tokens per tile as Llama4Processor computes it from its own patch_size and shuffle ratio. */
    double patch = 14, ratio = 0.5;
    if ((rc = prism_path_join(path, sizeof path, dir, "processor_config.json")) != PRISM_OK) return rc;
    json_t *pj = load_json(path, true, &rc, err, errlen);
    if (rc != PRISM_OK) return rc;
    if (pj) {
        bool ok = opt_num(pj, "patch_size", &patch) && opt_num(pj, "pixel_shuffle_ratio", &ratio);
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
    if (!proc_valid(p)) {
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

int prism_llama4_grid(const prism_llama4_proc_t *p, int w, int h, prism_llama4_grid_t *g)
{
    if (!proc_valid(p) || !g || w < 1 || h < 1 || w > PRISM_IMAGE_MAX_DIM || h > PRISM_IMAGE_MAX_DIM)
        return PRISM_EINVAL;
    canvas_t cv[MAX_CANVASES];
    int n = canvases(p->max_patches, cv);
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
    return PRISM_OK;
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

/* ---------------------------------------------------------------- pixels */

/* bfloat16 rounding (nearest even) of a float32; NaN never occurs here (finite inputs).
 * Kept local: the image library is a leaf and must not link the backend for it. */
static float bf16_round(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&f, &u, 4);
    return f;
}

/* HF: images.to(bfloat16) * rescale_factor, then torchvision normalize on the bf16 tensor (mean
 * and std cast to bf16); every op computes in float32 and rounds to bf16. */
static void norm_lut(const prism_llama4_proc_t *p, float lut[3][256])
{
    float rs = (float)p->rescale_factor;
    for (int c = 0; c < 3; c++) {
        float m = bf16_round(p->mean[c]), s = bf16_round(p->std[c]);
        for (int u = 0; u < 256; u++) {
            float x = bf16_round((float)u * rs);
            x = bf16_round(x - m);
            lut[c][u] = bf16_round(x / s);
        }
    }
}

static void clip_resize_cfg(prism_clip_preproc_t *c, int out_w, int out_h)
{
    memset(c, 0, sizeof *c);
    c->do_resize = true;
    c->resize_w = c->crop_w = out_w;
    c->resize_h = c->crop_h = out_h;
    c->do_convert_rgb = true;
    c->rescale_factor = 1.0f;
    c->rescale_factor_f64 = 1.0;
    for (int k = 0; k < 3; k++) c->std[k] = 1.0f;
    c->filter = PRISM_CLIP_FILTER_BILINEAR;
    c->impl = PRISM_CLIP_RESAMPLE_TORCHVISION;   /* torchvision's uint8 antialiased kernel, as HF uses */
}

typedef struct {
    size_t levels_off, levels_bytes;   /* [3][rh][rw] float levels of the resized image */
    size_t clip_off, clip_bytes;
    size_t total;
} ws_layout_t;

static int ws_plan(const prism_llama4_proc_t *p, int w, int h, const prism_llama4_grid_t *g, ws_layout_t *l)
{
    memset(l, 0, sizeof *l);
    prism_clip_preproc_t c;
    bool resize = g->resized_w != w || g->resized_h != h;
    size_t cb = 0;
    if (resize) {
        clip_resize_cfg(&c, g->resized_w, g->resized_h);
        cb = prism_clip_preprocess_workspace_bytes(&c, w, h);
        if (!cb) return PRISM_EINVAL;
        l->levels_bytes = (size_t)3 * g->resized_w * g->resized_h * sizeof(float);
    }
    if (g->n_tiles > 1 && (w != p->tile || h != p->tile)) {
        clip_resize_cfg(&c, p->tile, p->tile);
        size_t b = prism_clip_preprocess_workspace_bytes(&c, w, h);
        if (!b) return PRISM_EINVAL;
        cb = PRISM_MAX(cb, b);
    }
    l->levels_off = 0;
    l->clip_off = PRISM_ALIGN_UP(l->levels_bytes, 64);
    l->clip_bytes = cb;
    l->total = l->clip_off + cb;
    return PRISM_OK;
}

size_t prism_llama4_preprocess_workspace_bytes(const prism_llama4_proc_t *p, int w, int h)
{
    prism_llama4_grid_t g;
    ws_layout_t l;
    if (prism_llama4_grid(p, w, h, &g) != PRISM_OK || ws_plan(p, w, h, &g, &l) != PRISM_OK) return 0;
    return PRISM_MAX(l.total, (size_t)64);
}

int prism_llama4_preprocess(const prism_llama4_proc_t *p, const prism_image_t *img, void *workspace,
                            size_t ws_bytes, float *out)
{
    if (!img || !img->rgb || !out || img->w < 1 || img->h < 1) return PRISM_EINVAL;
    /* DCT-scaled decodes are not supported here: HF resizes the full-size image. */
    if ((img->src_w && img->src_w != img->w) || (img->src_h && img->src_h != img->h)) return PRISM_EINVAL;
    int w = img->w, h = img->h, T = p ? p->tile : 0;
    prism_llama4_grid_t g;
    int rc = prism_llama4_grid(p, w, h, &g);
    if (rc != PRISM_OK) return rc;
    ws_layout_t l;
    if ((rc = ws_plan(p, w, h, &g, &l)) != PRISM_OK) return rc;
    if (l.total > ws_bytes || (l.total && !workspace)) return PRISM_ELIMIT;
    uint8_t *ws = workspace;
    float lut[3][256];
    norm_lut(p, lut);
    size_t plane = (size_t)T * T, tile_floats = 3 * plane;

    /* Local tiles: the resized image at the canvas origin, zero (normalized) elsewhere. */
    int rw = g.resized_w, rh = g.resized_h;
    const float *levels = NULL;
    if (rw != w || rh != h) {
        prism_clip_preproc_t c;
        clip_resize_cfg(&c, rw, rh);
        float *lv = (float *)(ws + l.levels_off);
        if ((rc = prism_clip_preprocess(&c, img, ws + l.clip_off, l.clip_bytes, lv)) != PRISM_OK) return rc;
        levels = lv;
    }
    for (int r = 0; r < g.rows; r++)
        for (int cc = 0; cc < g.cols; cc++) {
            float *t = out + (size_t)(r * g.cols + cc) * tile_floats;
            for (int ch = 0; ch < 3; ch++)
                for (int y = 0; y < T; y++) {
                    int sy = r * T + y;
                    float *o = t + ch * plane + (size_t)y * T;
                    for (int x = 0; x < T; x++) {
                        int sx = cc * T + x;
                        int u = 0;
                        if (sy < rh && sx < rw)
                            u = levels ? (int)levels[((size_t)ch * rh + sy) * rw + sx]
                                       : img->rgb[((size_t)sy * w + sx) * 3 + ch];
                        o[x] = lut[ch][u];
                    }
                }
        }
    /* Global tile: the whole image resized to tile x tile (aspect not kept), written in place. */
    if (g.n_tiles > 1) {
        float *t = out + (size_t)(g.n_tiles - 1) * tile_floats;
        if (w == T && h == T) {
            for (int ch = 0; ch < 3; ch++)
                for (size_t i = 0; i < plane; i++) t[ch * plane + i] = lut[ch][img->rgb[i * 3 + ch]];
        } else {
            prism_clip_preproc_t c;
            clip_resize_cfg(&c, T, T);
            if ((rc = prism_clip_preprocess(&c, img, ws + l.clip_off, l.clip_bytes, t)) != PRISM_OK) return rc;
            for (int ch = 0; ch < 3; ch++)
                for (size_t i = 0; i < plane; i++) t[ch * plane + i] = lut[ch][(int)t[ch * plane + i]];
        }
    }
    return PRISM_OK;
}
