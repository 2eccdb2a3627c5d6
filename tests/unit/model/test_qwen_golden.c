/* Qwen2.5-VL and Qwen3-VL against Hugging Face transformers (fp32 on a bf16 checkpoint), fixtures
 * from tools/gen_qwen_goldens.py in tests/data/model/qwen25vl_tiny (the default) or the directory
 * named by argv[1] (test_qwen3_golden: qwen3vl_tiny): a scaled Qwen2_5_VLForConditionalGeneration /
 * Qwen3VLForConditionalGeneration in HF's own layout, its tokenizer and chat template, and six
 * cases: text only, one image, two images of different sizes in one message, an image upscaled to
 * min_pixels, one clipped by max_pixels, multi-turn.
 *
 * What each test holds:
 *  - test_vision: OUR image processor on the synthetic pictures gives HF's pixel values (hash), and
 *    the tower gives HF's image features within 1e-4, one image per forward and several per forward
 *    (two_images, and every image of every case at once): 2D RoPE over the merge-window order,
 *    window attention with windows clipped at the image edges (window_size 56 = 2x2 merged tokens,
 *    grids of 10x14, 8x6, 6x4, 12x18, 14x10 patches), full attention in layers 1 and 3, the merger
 *    and the inverse window order;
 *  - test_vision_drop: an image cancelled between layers leaves the batch; the others' features
 *    are unchanged;
 *  - test_lm_goldens: Qwen2 with M-RoPE (sections [4, 6, 6]; positions from prism_mrope_positions,
 *    the rope delta for decode steps), our features at the image pads: HF's logits within 1e-4 at
 *    every prompt position (one_image) or the last one (the others) and at each of 16 teacher-forced
 *    decode steps through the paged KV cache, and HF's 16 greedy tokens, for all six cases (seen
 *    failing with plain positions: the first image token's answer differs);
 *  - test_lm_chunked_prefill: the same with the prompt in chunks of 37 tokens (chunks cut through
 *    the images' pads and their M-RoPE positions).
 * Qwen3-VL (the same tests on qwen3vl_tiny): patch 16, the 6x6 learned position grid interpolated
 * to grids larger and smaller than it (4x6 .. 12x18 patches), LayerNorm + GELU (tanh) layers, all
 * full attention, DeepStack after vision layers 0 and 2 (the features' rows carry the embedding
 * and both levels, all compared; the dropped image leaves after layer 1, between the two DeepStack
 * layers), and the LM: Qwen3 (q_norm / k_norm before RoPE, head_dim 48 apart from hidden / heads),
 * interleaved M-RoPE (sections [10, 7, 7]), the DeepStack levels added after LM layers 0 and 1 at
 * the image tokens (also when a chunk holds only part of an image). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "image/qwenvl_proc.h"
#include "model/model.h"
#include "../image/image_test_util.h"
#include "../image/llama4_synth.h"

#define MAX_IMG 4

typedef struct {
    int w, h, seed, n_tokens;
    prism_vgrid_t grid;
    float *feats;            /* HF: [n_tokens][row floats] (the embedding, then DeepStack levels) */
} img_case_t;

typedef struct {
    char name[32];
    int n_prompt, n_img, logits_from;
    int32_t *ids;
    int32_t greedy[64];
    img_case_t img[MAX_IMG];
    char pixel_fnv[32];
    float *logits;           /* HF: rows [logits_from, n_prompt + n_greedy - 1) */
} model_case_t;

typedef struct {
    const char *fixture;
    int row;                 /* floats of a vision output row (prism_model_embed_row_floats) */
    char dir[1024];
    int vocab, hidden, n_greedy, n_cases;
    double tol;
    model_case_t cases[8];
    prism_model_config_t cfg;
    prism_qwenvl_proc_t proc;
    prism_backend_t *be;
    prism_vision_native_t *vis;
    prism_llm_t *llm;
} golden_t;

static golden_t G;

static const char *source_dir(void)
{
    const char *s = getenv("PRISM_SOURCE_DIR");
    return s && *s ? s : PRISM_SOURCE_DIR;
}

static float *read_f32(const char *dir, const char *file, size_t expect_n)
{
    char path[1200];
    if (snprintf(path, sizeof path, "%s/%s", dir, file) >= (int)sizeof path) fail_msg("path too long");
    char *buf = NULL;
    size_t n = 0;
    assert_int_equal(prism_read_file(path, 64u << 20, &buf, &n), PRISM_OK);
    assert_int_equal(n, expect_n * sizeof(float));
    return (float *)buf;
}

static double max_abs_diff(const float *a, const float *b, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (!(d <= m)) m = d;
    }
    return m;
}

static int geti(json_t *j, const char *k) { return (int)json_integer_value(json_object_get(j, k)); }

static int setup(void **state)
{
    golden_t *g = &G;
    char path[1200], err[256];
    snprintf(g->dir, sizeof g->dir, "%s/tests/data/model/%s", source_dir(), g->fixture);
    if (snprintf(path, sizeof path, "%s/golden.json", g->dir) >= (int)sizeof path) return -1;
    json_error_t jerr;
    json_t *j = json_load_file(path, 0, &jerr);
    if (!j) {
        fprintf(stderr, "%s: %s\n", path, jerr.text);
        return -1;
    }
    g->vocab = geti(j, "vocab");
    g->hidden = geti(j, "hidden");
    g->n_greedy = geti(j, "n_greedy");
    g->tol = json_number_value(json_object_get(j, "tolerance"));
    g->row = json_object_get(j, "row_floats") ? geti(j, "row_floats") : g->hidden;
    json_t *cases = json_object_get(j, "cases");
    g->n_cases = (int)json_array_size(cases);
    for (int i = 0; i < g->n_cases && i < 8; i++) {
        json_t *c = json_array_get(cases, (size_t)i);
        model_case_t *m = &g->cases[i];
        snprintf(m->name, sizeof m->name, "%s", json_string_value(json_object_get(c, "name")));
        json_t *ids = json_object_get(c, "input_ids"), *gr = json_object_get(c, "greedy");
        m->n_prompt = (int)json_array_size(ids);
        m->ids = malloc(sizeof(int32_t) * (size_t)(m->n_prompt + g->n_greedy));
        for (int k = 0; k < m->n_prompt; k++) m->ids[k] = (int32_t)json_integer_value(json_array_get(ids, (size_t)k));
        for (int k = 0; k < g->n_greedy; k++) m->greedy[k] = (int32_t)json_integer_value(json_array_get(gr, (size_t)k));
        m->logits_from = geti(c, "logits_from");
        m->logits = read_f32(g->dir, json_string_value(json_object_get(c, "logits")),
                             (size_t)(m->n_prompt + g->n_greedy - 1 - m->logits_from) * g->vocab);
        json_t *imgs = json_object_get(c, "images");
        m->n_img = (int)json_array_size(imgs);
        for (int k = 0; k < m->n_img; k++) {
            json_t *im = json_array_get(imgs, (size_t)k);
            img_case_t *ic = &m->img[k];
            ic->w = geti(im, "w");
            ic->h = geti(im, "h");
            ic->seed = geti(im, "seed");
            ic->n_tokens = geti(im, "n_tokens");
            json_t *grid = json_object_get(im, "grid");
            ic->grid.h = (int32_t)json_integer_value(json_array_get(grid, 1));
            ic->grid.w = (int32_t)json_integer_value(json_array_get(grid, 2));
            ic->feats = read_f32(g->dir, json_string_value(json_object_get(im, "features")),
                                 (size_t)ic->n_tokens * g->row);
        }
        if (m->n_img) snprintf(m->pixel_fnv, sizeof m->pixel_fnv, "%s", json_string_value(json_object_get(c, "pixel_fnv1a64_f32")));
    }
    json_decref(j);
    int rc = prism_model_config_load(g->dir, &g->cfg, err, sizeof err);
    if (rc) fprintf(stderr, "config: %s\n", err);
    if (rc) return -1;
    if (prism_model_embed_row_floats(&g->cfg) != g->row) {
        fprintf(stderr, "config: rows of %d floats, the fixture's %d\n", prism_model_embed_row_floats(&g->cfg), g->row);
        return -1;
    }
    rc = prism_qwenvl_proc_load_dir(g->dir, &g->proc, err, sizeof err);
    if (rc) fprintf(stderr, "processor: %s\n", err);
    if (rc) return -1;
    g->be = prism_backend_cpu_create(2);
    if (!g->be) return -1;
    rc = prism_vision_native_load(g->be, &g->cfg, g->dir, 1024, &g->vis, err, sizeof err);
    if (rc) fprintf(stderr, "vision: %s\n", err);
    if (rc) return -1;
    rc = prism_llm_load(g->be, &g->cfg, g->dir, 256, 4, &g->llm, err, sizeof err);
    if (rc) fprintf(stderr, "llm: %s\n", err);
    return rc ? -1 : 0;
}

static int teardown(void **state)
{
    golden_t *g = &G;
    prism_vision_native_free(g->vis);
    prism_llm_free(g->llm);
    prism_backend_destroy(g->be);
    for (int i = 0; i < g->n_cases; i++) {
        free(g->cases[i].ids);
        prism_free(g->cases[i].logits);
        for (int k = 0; k < g->cases[i].n_img; k++) prism_free(g->cases[i].img[k].feats);
    }
    return 0;
}

/* Our processor's patches of one case image (prism_malloc'd, [n_patches][3][14][14]). */
static float *case_pixels(const img_case_t *ic, prism_qwenvl_grid_t *g)
{
    assert_int_equal(prism_qwenvl_grid(&G.proc, ic->w, ic->h, g), PRISM_OK);
    assert_int_equal(g->grid_h, ic->grid.h);
    assert_int_equal(g->grid_w, ic->grid.w);
    assert_int_equal(g->n_tokens, ic->n_tokens);
    prism_image_t img = {.rgb = llama4_synth_image(ic->w, ic->h, (uint32_t)ic->seed), .w = ic->w, .h = ic->h,
                         .src_w = ic->w, .src_h = ic->h, .owned = true};
    size_t ws_n = prism_qwenvl_workspace_bytes(&G.proc, ic->w, ic->h);
    void *ws = prism_malloc(ws_n);
    float *px = prism_malloc((size_t)g->n_patches * prism_qwenvl_patch_floats(&G.proc) * sizeof(float));
    assert_int_equal(prism_qwenvl_preprocess(&G.proc, &img, ws, ws_n, px), PRISM_OK);
    prism_free(ws);
    prism_image_free(&img);
    return px;
}

static void test_config_qwen3(void)
{
    const prism_model_config_t *c = &G.cfg;
    assert_int_equal(c->vision_arch, PRISM_VISION_QWEN3);
    assert_true(c->mrope_interleaved);
    assert_int_equal(c->mrope_section[0], 10);
    assert_int_equal(c->mrope_section[1], 7);
    assert_int_equal(c->mrope_section[2], 7);
    assert_int_equal(c->head_dim, 48);
    assert_int_equal(c->n_deepstack, 2);
    assert_int_equal(c->v_deepstack[0], 0);
    assert_int_equal(c->v_deepstack[1], 2);
    assert_int_equal(c->v_num_pos, 36);
    assert_int_equal(c->v_patch, 16);
    assert_int_equal(c->v_window, 0);
    for (int L = 0; L < c->v_layers; L++) assert_int_equal(c->v_layer_flags[L], PRISM_VLAYER_FULLATT);
    for (int L = 0; L < c->n_layers; L++) assert_true(c->layer_flags[L] & PRISM_LAYER_QK_RMS);
    assert_false(c->attention_bias);
    assert_int_equal(prism_model_embed_row_floats(c), 3 * c->hidden);
    /* Qwen3VLConfig's defaults (an empty vision_config, text_config without the optional keys):
     * Qwen3-VL-8B's tower with the text model's width */
    char err[256];
    prism_model_config_t q;
    static const char dflt[] = "{\"model_type\": \"qwen3_vl\", \"text_config\": {\"hidden_size\": 3584, "
                               "\"num_attention_heads\": 28, \"num_key_value_heads\": 4, \"num_hidden_layers\": 36}}";
    int rc = prism_model_config_parse(dflt, NULL, &q, err, sizeof err);
    if (rc) fail_msg("%s", err);
    assert_int_equal(q.head_dim, 128);
    assert_int_equal(q.mrope_section[0], 24);
    assert_int_equal(q.mrope_section[1], 20);
    assert_int_equal(q.mrope_section[2], 20);
    assert_true(q.mrope_interleaved);
    assert_true(q.rope_theta == 500000.0f);
    assert_int_equal(q.v_layers, 27);
    assert_int_equal(q.v_hidden, 1152);
    assert_int_equal(q.v_intermediate, 4304);
    assert_int_equal(q.v_num_pos, 2304);
    assert_int_equal(q.n_deepstack, 3);
    assert_int_equal(q.v_deepstack[0], 8);
    assert_int_equal(q.v_deepstack[2], 24);
    assert_int_equal(q.v_act, PRISM_ACT_GELU_TANH);
    /* refused: more DeepStack levels than text layers, a layer listed twice, a position grid that
     * is not a square, sections that do not cover the rotary pairs */
    static const char *const bad[] = {
        "{\"model_type\": \"qwen3_vl\", \"text_config\": {\"hidden_size\": 3584, \"num_hidden_layers\": 2}}",
        "{\"model_type\": \"qwen3_vl\", \"text_config\": {\"hidden_size\": 3584}, \"vision_config\": "
        "{\"deepstack_visual_indexes\": [3, 3]}}",
        "{\"model_type\": \"qwen3_vl\", \"text_config\": {\"hidden_size\": 3584}, \"vision_config\": "
        "{\"num_position_embeddings\": 2300}}",
        "{\"model_type\": \"qwen3_vl\", \"text_config\": {\"hidden_size\": 3584, \"rope_parameters\": "
        "{\"mrope_section\": [24, 20, 19]}}}",
    };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(bad); i++) {
        err[0] = 0;
        if (prism_model_config_parse(bad[i], NULL, &q, err, sizeof err) == PRISM_OK) fail_msg("accepted config %zu", i);
        assert_true(err[0] != 0);
    }
}

static void test_config(void **state)
{
    const prism_model_config_t *c = &G.cfg;
    if (c->vision_arch == PRISM_VISION_QWEN3) {
        test_config_qwen3();
        return;
    }
    assert_int_equal(c->vision_arch, PRISM_VISION_QWEN25);
    assert_int_equal(c->mrope_section[0], 4);
    assert_int_equal(c->mrope_section[1], 6);
    assert_int_equal(c->mrope_section[2], 6);
    assert_int_equal(c->v_layers, 4);
    assert_int_equal(c->v_layer_flags[1], PRISM_VLAYER_FULLATT);
    assert_int_equal(c->v_layer_flags[3], PRISM_VLAYER_FULLATT);
    assert_int_equal(c->v_layer_flags[0] | c->v_layer_flags[2], 0);
    assert_int_equal(c->v_window, 56);
    assert_true(c->attention_bias);
    assert_false(c->o_bias);
    /* the published Qwen2.5-VL-7B-Instruct config.json (the checkpoints' flat layout) */
    char dir[1200], err[256];
    snprintf(dir, sizeof dir, "%s/tests/bench/configs/qwen2.5-vl-7b", source_dir());
    prism_model_config_t q;
    int rc = prism_model_config_load(dir, &q, err, sizeof err);
    if (rc) fail_msg("%s", err);
    assert_int_equal(q.hidden, 3584);
    assert_int_equal(q.n_layers, 28);
    assert_int_equal(q.n_kv_heads, 4);
    assert_int_equal(q.head_dim, 128);
    assert_int_equal(q.vocab, 152064);
    assert_int_equal(q.mrope_section[0] + q.mrope_section[1] + q.mrope_section[2], 64);
    assert_int_equal(q.mrope_section[1], 24);
    assert_true(q.rope_theta == 1000000.0f);
    assert_int_equal(q.v_layers, 32);
    assert_int_equal(q.v_hidden, 1280);
    assert_int_equal(q.v_intermediate, 3420);
    assert_int_equal(q.v_window, 112);
    for (int L = 0; L < 32; L++) assert_int_equal(q.v_layer_flags[L], (L % 8 == 7) ? PRISM_VLAYER_FULLATT : 0);
    assert_int_equal(q.image_token_index, 151655);
    assert_int_equal(q.boi_token_id, 151652);
    assert_int_equal(q.eoi_token_id, 151653);
    assert_int_equal(q.eos_token_ids[0], 151645);
    assert_false(q.tie_word_embeddings);
    /* refused: sections that do not cover the rotary pairs, a tower that does not reach the LM width,
     * another activation, a window that is not whole merged tokens */
    static const char *const bad[] = {
        "{\"model_type\": \"qwen2_5_vl\", \"hidden_size\": 64, \"num_attention_heads\": 4, \"rope_scaling\": "
        "{\"type\": \"mrope\", \"mrope_section\": [2, 2, 2]}, \"vision_config\": {\"out_hidden_size\": 64}}",
        "{\"model_type\": \"qwen2_5_vl\", \"hidden_size\": 64, \"num_attention_heads\": 4, \"rope_scaling\": "
        "{\"type\": \"mrope\", \"mrope_section\": [2, 3, 3]}, \"vision_config\": {\"out_hidden_size\": 32}}",
        "{\"model_type\": \"qwen2_5_vl\", \"hidden_size\": 64, \"num_attention_heads\": 4, \"rope_scaling\": "
        "{\"type\": \"mrope\", \"mrope_section\": [2, 3, 3]}, \"vision_config\": {\"out_hidden_size\": 64, "
        "\"hidden_act\": \"gelu\"}}",
        "{\"model_type\": \"qwen2_5_vl\", \"hidden_size\": 64, \"num_attention_heads\": 4, \"rope_scaling\": "
        "{\"type\": \"mrope\", \"mrope_section\": [2, 3, 3]}, \"vision_config\": {\"out_hidden_size\": 64, "
        "\"window_size\": 100}}",
    };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(bad); i++) {
        err[0] = 0;
        if (prism_model_config_parse(bad[i], NULL, &q, err, sizeof err) == PRISM_OK) fail_msg("accepted config %zu", i);
        assert_true(err[0] != 0);
    }
    static const char ok[] = "{\"model_type\": \"qwen2_5_vl\", \"hidden_size\": 64, \"num_attention_heads\": 4, "
                             "\"rope_scaling\": {\"type\": \"mrope\", \"mrope_section\": [2, 3, 3]}, "
                             "\"vision_config\": {\"out_hidden_size\": 64}}";
    rc = prism_model_config_parse(ok, NULL, &q, err, sizeof err);
    if (rc) fail_msg("%s", err);
}

static void test_vision(void **state)
{
    golden_t *g = &G;
    const size_t H = (size_t)g->row;
    /* every image of every case, one forward each and all in one forward */
    float *all_px = prism_malloc((size_t)1024 * prism_qwenvl_patch_floats(&g->proc) * sizeof(float));
    prism_vgrid_t grids[16];
    const img_case_t *which[16];
    int n_all = 0, px_all = 0, tok_all = 0;
    for (int ci = 0; ci < g->n_cases; ci++) {
        model_case_t *m = &g->cases[ci];
        if (!m->n_img) continue;
        size_t case_px = 0;
        float *cpx = prism_malloc((size_t)1024 * prism_qwenvl_patch_floats(&g->proc) * sizeof(float));
        for (int k = 0; k < m->n_img; k++) {
            prism_qwenvl_grid_t pg;
            float *px = case_pixels(&m->img[k], &pg);
            size_t np = (size_t)pg.n_patches * prism_qwenvl_patch_floats(&g->proc);
            memcpy(cpx + case_px, px, np * sizeof(float));
            case_px += np;
            float *out = malloc((size_t)pg.n_tokens * H * sizeof(float));
            prism_vgrid_t vg = {pg.grid_h, pg.grid_w};
            assert_int_equal(prism_vision_native_encode(g->vis, px, &vg, 1, out), PRISM_OK);
            double d = max_abs_diff(out, m->img[k].feats, (size_t)pg.n_tokens * H);
            printf("  %s image %d (%dx%d patches): max |diff| %.3g\n", m->name, k, pg.grid_h, pg.grid_w, d);
            if (!(d <= g->tol)) fail_msg("%s image %d: features differ from HF by %g", m->name, k, d);
            free(out);
            memcpy(all_px + (size_t)px_all * prism_qwenvl_patch_floats(&g->proc), px, np * sizeof(float));
            px_all += pg.n_patches;
            tok_all += pg.n_tokens;
            grids[n_all] = vg;
            which[n_all++] = &m->img[k];
            prism_free(px);
        }
        /* HF's pixel_values of the case (one frame of each patch) */
        char hex[17];
        snprintf(hex, sizeof hex, "%016llx", (unsigned long long)itu_fnv1a64(cpx, case_px * sizeof(float)));
        if (strcmp(hex, m->pixel_fnv)) fail_msg("%s: pixel values differ from HF's", m->name);
        prism_free(cpx);
    }
    float *out = malloc((size_t)tok_all * H * sizeof(float));
    assert_int_equal(prism_vision_native_encode(g->vis, all_px, grids, n_all, out), PRISM_OK);
    size_t off = 0;
    for (int i = 0; i < n_all; i++) {
        double d = max_abs_diff(out + off * H, which[i]->feats, (size_t)which[i]->n_tokens * H);
        if (!(d <= g->tol)) fail_msg("batched image %d: features differ from HF by %g", i, d);
        off += (size_t)which[i]->n_tokens;
    }
    printf("  %d images (%d patches) in one forward: within %g\n", n_all, px_all, g->tol);
    /* limits */
    prism_vgrid_t odd = {3, 4};
    assert_int_equal(prism_vision_native_encode(g->vis, all_px, &odd, 1, out), PRISM_EINVAL);
    prism_vgrid_t huge = {64, 64};
    assert_int_equal(prism_vision_native_encode(g->vis, all_px, &huge, 1, out), PRISM_ELIMIT);
    free(out);
    prism_free(all_px);
}

/* ---- dropping an image between layers ---- */

typedef struct {
    int drop_item, drop_after, layers_seen;
} drop_hook_t;

static bool hk_layer(void *ud, int done, int total)
{
    drop_hook_t *h = ud;
    h->layers_seen = done;
    return done == h->drop_after;
}
static bool hk_cancelled(void *ud, int item) { return item == ((drop_hook_t *)ud)->drop_item; }

static void test_vision_drop(void **state)
{
    golden_t *g = &G;
    const size_t H = (size_t)g->row;
    model_case_t *m = NULL;
    for (int i = 0; i < g->n_cases; i++)
        if (!strcmp(g->cases[i].name, "two_images")) m = &g->cases[i];
    assert_non_null(m);
    prism_qwenvl_grid_t g0, g1;
    float *p0 = case_pixels(&m->img[0], &g0), *p1 = case_pixels(&m->img[1], &g1);
    size_t pf = prism_qwenvl_patch_floats(&g->proc);
    /* three images: the second one is dropped after a layer */
    float *px = prism_malloc((size_t)(2 * g0.n_patches + g1.n_patches) * pf * sizeof(float));
    memcpy(px, p0, (size_t)g0.n_patches * pf * sizeof(float));
    memcpy(px + (size_t)g0.n_patches * pf, p1, (size_t)g1.n_patches * pf * sizeof(float));
    memcpy(px + (size_t)(g0.n_patches + g1.n_patches) * pf, p0, (size_t)g0.n_patches * pf * sizeof(float));
    prism_vgrid_t grids[3] = {{g0.grid_h, g0.grid_w}, {g1.grid_h, g1.grid_w}, {g0.grid_h, g0.grid_w}};
    size_t n_out = (size_t)(2 * g0.n_tokens + g1.n_tokens) * H;
    float *out = malloc(n_out * sizeof(float));
    for (size_t i = 0; i < n_out; i++) out[i] = 12345.0f;
    /* Qwen3-VL: between its DeepStack layers 0 and 2 */
    drop_hook_t st = {.drop_item = 1, .drop_after = g->cfg.vision_arch == PRISM_VISION_QWEN3 ? 1 : 2};
    prism_model_hook_t hook = {hk_layer, hk_cancelled, &st};
    prism_vision_native_set_hook(g->vis, &hook);
    assert_int_equal(prism_vision_native_encode(g->vis, px, grids, 3, out), PRISM_OK);
    prism_vision_native_set_hook(g->vis, NULL);
    assert_int_equal(st.layers_seen, g->cfg.v_layers);
    assert_true(max_abs_diff(out, m->img[0].feats, (size_t)g0.n_tokens * H) <= g->tol);
    assert_true(max_abs_diff(out + (size_t)(g0.n_tokens + g1.n_tokens) * H, m->img[0].feats, (size_t)g0.n_tokens * H) <=
                g->tol);
    for (size_t i = (size_t)g0.n_tokens * H; i < (size_t)(g0.n_tokens + g1.n_tokens) * H; i++)
        assert_true(out[i] == 12345.0f);   /* the dropped image's rows are not written */
    free(out);
    prism_free(px);
    prism_free(p0);
    prism_free(p1);
}

/* ---- the language model ---- */

#define BS 16
#define MAX_BLOCKS 32

typedef struct {
    int32_t table[MAX_BLOCKS];
    int n_blocks, len;
} seq_t;

/* A case's prompt as the model sees it: our image features at the image pads, the M-RoPE positions
 * of its images (runs of image pads, in order), its rope delta. */
typedef struct {
    const float **rows;            /* [n_prompt] embedding rows (image pads) or NULL */
    float *feats;                  /* our features of every image of the case */
    int32_t *pos;                  /* [3][n_prompt] */
    int32_t delta;
    prism_mrope_image_t im[MAX_IMG];
} prompt_t;

static void prompt_make(const model_case_t *m, prompt_t *p)
{
    golden_t *g = &G;
    const size_t H = (size_t)g->row;
    int n = m->n_prompt, tok = 0, px = 0;
    memset(p, 0, sizeof *p);
    for (int k = 0; k < m->n_img; k++) {
        tok += m->img[k].n_tokens;
        px += m->img[k].grid.h * m->img[k].grid.w;
    }
    p->rows = calloc((size_t)n, sizeof *p->rows);
    p->pos = malloc(sizeof(int32_t) * 3 * (size_t)n);
    if (m->n_img) {
        float *pix = prism_malloc((size_t)px * prism_qwenvl_patch_floats(&g->proc) * sizeof(float));
        prism_vgrid_t grids[MAX_IMG];
        size_t off = 0;
        for (int k = 0; k < m->n_img; k++) {
            prism_qwenvl_grid_t pg;
            float *one = case_pixels(&m->img[k], &pg);
            size_t nf = (size_t)pg.n_patches * prism_qwenvl_patch_floats(&g->proc);
            memcpy(pix + off, one, nf * sizeof(float));
            off += nf;
            prism_free(one);
            grids[k] = m->img[k].grid;
        }
        p->feats = malloc((size_t)tok * H * sizeof(float));
        assert_int_equal(prism_vision_native_encode(g->vis, pix, grids, m->n_img, p->feats), PRISM_OK);
        prism_free(pix);
    }
    /* image pads: one run per image, in order */
    int k = -1, r = 0;
    for (int i = 0; i < n; i++) {
        if (m->ids[i] != g->cfg.image_token_index) continue;
        if (i == 0 || m->ids[i - 1] != g->cfg.image_token_index) {
            k++;
            assert_true(k < m->n_img);
            p->im[k] = (prism_mrope_image_t){i, m->img[k].grid.h / 2, m->img[k].grid.w / 2};
        }
        p->rows[i] = p->feats + (size_t)r++ * H;
    }
    assert_int_equal(k + 1, m->n_img);
    assert_int_equal(r, tok);
    assert_int_equal(prism_mrope_positions(p->im, m->n_img, 0, n, p->pos, (size_t)n), PRISM_OK);
    p->delta = prism_mrope_delta(p->im, m->n_img);
}

static void prompt_free(prompt_t *p)
{
    free(p->rows);
    free(p->feats);
    free(p->pos);
}

/* Runs tokens [p0, p0 + n) of a sequence through the model (rope rows from pos, of stride ld, or
 * the delta when pos is NULL); logits of the last token, or of every token when all. */
static int run(prism_kv_cache_t *kv, seq_t *s, const int32_t *toks, int n, const float *const *rows,
               const int32_t *pos, size_t ld, int32_t delta, bool all, float *logits)
{
    while (s->n_blocks * BS < s->len + n) {
        assert_true(s->n_blocks < MAX_BLOCKS);
        s->table[s->n_blocks] = s->n_blocks;
        s->n_blocks++;
    }
    int32_t start[2] = {0, n}, pos0[1] = {s->len};
    const int32_t *tables[1] = {s->table};
    int32_t rp[3 * 256];
    if (pos) {
        assert_true(n <= 256);
        for (int r = 0; r < 3; r++) memcpy(rp + r * n, pos + r * ld, sizeof(int32_t) * (size_t)n);
    }
    prism_llm_batch_t b = {.n_seqs = 1, .n_tokens = n, .tokens = toks, .seq_start = start, .pos0 = pos0,
                           .block_tables = tables, .embed_rows = rows, .all_logits = all,
                           .rope_pos = pos ? rp : NULL, .rope_delta = &delta};
    int rc = prism_llm_forward(G.llm, kv, &b, logits);
    if (rc == PRISM_OK) s->len += n;
    return rc;
}

/* Every case: the prompt (in one forward, and in chunks of `chunk` tokens), HF's logits at the
 * prompt positions it kept and at every greedy step (teacher-forced through the KV cache, decode
 * positions from the rope delta), and HF's greedy tokens. */
static void check_cases(int chunk)
{
    golden_t *g = &G;
    const int V = g->vocab;
    float *logits = malloc(sizeof(float) * 256 * (size_t)V);
    for (int ci = 0; ci < g->n_cases; ci++) {
        model_case_t *m = &g->cases[ci];
        prompt_t p;
        prompt_make(m, &p);
        prism_kv_cache_t *kv;
        assert_int_equal(prism_kv_cache_create(g->be, &g->cfg, MAX_BLOCKS, BS, &kv), PRISM_OK);
        seq_t s = {0};
        int n = m->n_prompt;
        bool all = m->logits_from == 0 && chunk >= n;
        for (int p0 = 0; p0 < n; p0 += chunk) {
            int q = PRISM_MIN(chunk, n - p0);
            assert_int_equal(run(kv, &s, m->ids + p0, q, p.rows + p0, p.pos + p0, (size_t)n, 0, all, logits), PRISM_OK);
        }
        double worst = 0;
        int rows = all ? n : 1;
        for (int r = 0; r < rows; r++) {
            int at = all ? r : n - 1;
            double d = max_abs_diff(logits + (size_t)r * V, m->logits + (size_t)(at - m->logits_from) * V, (size_t)V);
            worst = d > worst ? d : worst;
        }
        int32_t tok = m->greedy[0];
        for (int k = 0; k + 1 < g->n_greedy; k++) {
            int best = 0;
            const float *last = logits + (size_t)(rows - 1) * V;
            if (k == 0)
                for (int v = 1; v < V; v++) best = last[v] > last[best] ? v : best;
            if (k == 0 && best != m->greedy[0]) fail_msg("%s: first token %d, HF %d", m->name, best, m->greedy[0]);
            assert_int_equal(run(kv, &s, &tok, 1, NULL, NULL, 0, p.delta, false, logits), PRISM_OK);
            rows = 1;
            double d = max_abs_diff(logits, m->logits + (size_t)(n + k - m->logits_from) * V, (size_t)V);
            worst = d > worst ? d : worst;
            best = 0;
            for (int v = 1; v < V; v++) best = logits[v] > logits[best] ? v : best;
            if (best != m->greedy[k + 1]) fail_msg("%s: greedy token %d is %d, HF %d", m->name, k + 1, best, m->greedy[k + 1]);
            tok = m->greedy[k + 1];
        }
        printf("  %-10s %3d prompt tokens (chunks of %3d), %d images, delta %3d: logits within %.3g\n", m->name, n,
               PRISM_MIN(chunk, n), m->n_img, p.delta, worst);
        if (!(worst <= g->tol)) fail_msg("%s: logits differ from HF by %g", m->name, worst);
        prism_kv_cache_free(kv);
        prompt_free(&p);
    }
    free(logits);
}

static void test_lm_goldens(void **state) { check_cases(256); }
static void test_lm_chunked_prefill(void **state) { check_cases(37); }

int main(int argc, char **argv)
{
    G.fixture = argc > 1 ? argv[1] : "qwen25vl_tiny";
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_config),
        cmocka_unit_test(test_vision),
        cmocka_unit_test(test_vision_drop),
        cmocka_unit_test(test_lm_goldens),
        cmocka_unit_test(test_lm_chunked_prefill),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
