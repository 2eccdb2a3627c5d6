/* Qwen-VL image processor against transformers' Qwen2VLImageProcessorPil, from
 * tests/data/image/qwenvl/goldens.json (tools/gen_qwen_goldens.py):
 *  - pixel values bit-exact (float32) for 17 sizes at three configs: a scaled one (max_pixels of 16
 *    LM tokens: min_pixels upscales of 1x1 / 20x12 / 29x3, clipping of 300x200 / 123x457 and a
 *    3000x20 strip whose short side is clamped to one factor), Qwen2.5-VL's (up to 4000x3500,
 *    clipped by max_pixels to 238x272 patches) and Qwen3-VL's (patch 16, mean/std 0.5); tall
 *    images (123x457, 333x1999, 60x900, 900x7000) take Pillow 13's vertical-first pass order
 *    (seen failing with horizontal first); values for the small ones, FNV hashes of the float32
 *    bytes for the rest; and 4 at a request's min_pixels / max_pixels (mm_processor_kwargs, as the
 *    processor call takes them: the grid through prism_qwenvl_grid_px, the pixels at those limits);
 *  - smart_resize over 630 sizes at both real configs (aspect ratio > 200 refused as HF refuses);
 *  - M-RoPE positions (get_rope_index) on hand-checked layouts;
 *  - the config loader (size / min_pixels precedence, bad values);
 *  - the streaming sink (rows from the JPEG / PNG decoders, with and without the relay thread) equals
 *    the whole-image path bit for bit, allocates nothing, fits the planned workspace bound. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <unistd.h>

#include "image/image.h"
#include "image/qwenvl_proc.h"
#include "image_test_util.h"
#include "image_gen.h"
#include "llama4_synth.h"

static json_t *goldens;

static int setup(void **state)
{
    goldens = itu_load_json("qwenvl/goldens.json");
    return goldens ? 0 : -1;
}

static int teardown(void **state)
{
    json_decref(goldens);
    return 0;
}


static void write_text(const char *path, const char *s)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(s, f);
    fclose(f);
}

/* The processor of a config in goldens.json, through the loader (a temporary directory). */
static void load_config(const char *name, prism_qwenvl_proc_t *p)
{
    json_t *c = json_object_get(json_object_get(goldens, "configs"), name);
    assert_non_null(c);
    char tmp[] = "/tmp/prism_qwenvl_cfg_XXXXXX", path[1300], err[256];
    assert_non_null(mkdtemp(tmp));
    snprintf(path, sizeof path, "%s/preprocessor_config.json", tmp);
    char *text = json_dumps(c, 0);
    write_text(path, text);
    free(text);
    int rc = prism_qwenvl_proc_load_dir(tmp, p, err, sizeof err);
    if (rc) fail_msg("%s: %s", name, err);
    unlink(path);
    rmdir(tmp);
}

static float *process(const prism_qwenvl_proc_t *p, int w, int h, uint32_t seed, prism_qwenvl_grid_t *g)
{
    assert_int_equal(prism_qwenvl_grid(p, w, h, g), PRISM_OK);
    prism_image_t img = {.rgb = llama4_synth_image(w, h, seed), .w = w, .h = h, .src_w = w, .src_h = h, .owned = true};
    assert_non_null(img.rgb);
    size_t ws_n = prism_qwenvl_workspace_bytes(p, w, h);
    assert_true(ws_n > 0);
    void *ws = prism_malloc(ws_n);
    size_t n = (size_t)g->n_patches * prism_qwenvl_patch_floats(p);
    float *out = prism_malloc(n * sizeof(float));
    assert_non_null(out);
    for (size_t k = 0; k < n; k++) out[k] = NAN;
    assert_int_equal(prism_qwenvl_preprocess(p, &img, ws, ws_n, out), PRISM_OK);
    prism_free(ws);
    prism_image_free(&img);
    return out;
}

static void test_pixels_bit_exact(void **state)
{
    json_t *cases = json_object_get(goldens, "cases");
    assert_true(json_array_size(cases) >= 21);
    for (size_t i = 0; i < json_array_size(cases); i++) {
        json_t *c = json_array_get(cases, i);
        prism_qwenvl_proc_t p;
        load_config(json_string_value(json_object_get(c, "config")), &p);
        int w = itu_int(c, "w"), h = itu_int(c, "h");
        json_t *grid = json_object_get(c, "grid_thw");
        prism_qwenvl_grid_t g;
        json_t *req = json_object_get(c, "request");
        if (req) {   /* a request's mm_processor_kwargs: the grid at its limits, and the processor at them */
            json_t *mn = json_object_get(req, "min_pixels"), *mx = json_object_get(req, "max_pixels");
            int64_t lo = mn ? json_integer_value(mn) : p.min_pixels, hi = mx ? json_integer_value(mx) : p.max_pixels;
            assert_int_equal(prism_qwenvl_grid_px(&p, lo, hi, w, h, &g), PRISM_OK);
            assert_int_equal(g.grid_h, json_integer_value(json_array_get(grid, 1)));
            assert_int_equal(g.grid_w, json_integer_value(json_array_get(grid, 2)));
            p.min_pixels = lo;
            p.max_pixels = hi;
        }
        float *out = process(&p, w, h, (uint32_t)itu_int(c, "seed"), &g);
        assert_int_equal(json_integer_value(json_array_get(grid, 0)), 1);
        assert_int_equal(g.grid_h, json_integer_value(json_array_get(grid, 1)));
        assert_int_equal(g.grid_w, json_integer_value(json_array_get(grid, 2)));
        assert_int_equal(g.n_patches, itu_int(c, "n_patches"));
        assert_int_equal(g.n_tokens * p.merge * p.merge, g.n_patches);
        size_t n = (size_t)g.n_patches * prism_qwenvl_patch_floats(&p);
        const char *vf = itu_str(c, "values");
        if (vf) {
            char name[300];
            snprintf(name, sizeof name, "qwenvl/%s", vf);
            size_t len;
            uint8_t *want = itu_read(name, &len);
            assert_int_equal(len, n * sizeof(float));
            if (memcmp(want, out, len)) {
                size_t k = 0;
                while (k < n && ((float *)want)[k] == out[k]) k++;
                fail_msg("%dx%d: float %zu of %zu: %.9g vs HF %.9g", w, h, k, n, out[k], ((float *)want)[k]);
            }
            prism_free(want);
        }
        if (!itu_fnv_matches(c, "fnv1a64_f32", out, n * sizeof(float)))
            fail_msg("case %zu (%s %dx%d): pixel values differ from HF's (hash)", i,
                     json_string_value(json_object_get(c, "config")), w, h);
        prism_free(out);
    }
}

static void test_smart_resize_table(void **state)
{
    prism_qwenvl_proc_t q25, q3;
    load_config("qwen25", &q25);
    load_config("qwen3", &q3);
    json_t *t = json_object_get(goldens, "grid_table");
    assert_true(json_array_size(t) >= 600);
    int refused = 0;
    for (size_t i = 0; i < json_array_size(t); i++) {
        json_t *r = json_array_get(t, i);
        const prism_qwenvl_proc_t *p = !strcmp(json_string_value(json_array_get(r, 0)), "qwen3") ? &q3 : &q25;
        int w = (int)json_integer_value(json_array_get(r, 1)), h = (int)json_integer_value(json_array_get(r, 2));
        int rw = (int)json_integer_value(json_array_get(r, 3)), rh = (int)json_integer_value(json_array_get(r, 4));
        prism_qwenvl_grid_t g;
        int rc = prism_qwenvl_grid(p, w, h, &g);
        if (!rw) {
            if (rc == PRISM_OK) fail_msg("%dx%d: HF refuses it, we made %dx%d", w, h, g.resized_w, g.resized_h);
            refused++;
            continue;
        }
        if (rc != PRISM_OK) fail_msg("%dx%d: refused, HF made %dx%d", w, h, rw, rh);
        if (g.resized_w != rw || g.resized_h != rh)
            fail_msg("%dx%d: %dx%d, HF %dx%d", w, h, g.resized_w, g.resized_h, rw, rh);
        assert_int_equal(g.n_tokens, (rw / p->patch / p->merge) * (rh / p->patch / p->merge));
    }
    assert_true(refused >= 4);   /* 1x200, 200x1, 65535x328, 1000x5 ... */
}

static void test_mrope_positions(void **state)
{
    /* text(3) image 2x3 text(2) image 4x1 text(2): HF's get_rope_index */
    prism_mrope_image_t im[2] = {{3, 2, 3}, {11, 4, 1}};
    int32_t pos[3][17];
    assert_int_equal(prism_mrope_positions(im, 2, 0, 17, &pos[0][0], 17), PRISM_OK);
    static const int32_t want[3][17] = {
        {0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 8, 8, 8, 8, 12, 13},
        {0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7, 8, 9, 10, 11, 12, 13},
        {0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 8, 8, 8, 12, 13},
    };
    assert_memory_equal(pos, want, sizeof want);
    assert_int_equal(prism_mrope_delta(im, 2), 13 + 1 - 17);
    /* a window in the middle (a prefill chunk) is the same slice */
    int32_t part[3][5];
    assert_int_equal(prism_mrope_positions(im, 2, 7, 5, &part[0][0], 5), PRISM_OK);
    for (int c = 0; c < 3; c++)
        for (int k = 0; k < 5; k++) assert_int_equal(part[c][k], want[c][7 + k]);
    /* after the prompt: text, continuing with the delta */
    int32_t after[3][2];
    assert_int_equal(prism_mrope_positions(im, 2, 17, 2, &after[0][0], 2), PRISM_OK);
    for (int c = 0; c < 3; c++) {
        assert_int_equal(after[c][0], 17 + prism_mrope_delta(im, 2));
        assert_int_equal(after[c][1], 18 + prism_mrope_delta(im, 2));
    }
    /* no image: plain positions */
    assert_int_equal(prism_mrope_positions(NULL, 0, 5, 2, &after[0][0], 2), PRISM_OK);
    assert_int_equal(after[2][1], 6);
    /* overlapping / unordered / empty images are refused */
    prism_mrope_image_t bad[2] = {{3, 2, 3}, {8, 1, 1}};
    assert_int_equal(prism_mrope_positions(bad, 2, 0, 4, &pos[0][0], 17), PRISM_EINVAL);
    bad[1] = (prism_mrope_image_t){9, 0, 1};
    assert_int_equal(prism_mrope_positions(bad, 2, 0, 4, &pos[0][0], 17), PRISM_EINVAL);
}

static void test_config_loader(void **state)
{
    char tmp[] = "/tmp/prism_qwenvl_cfg_XXXXXX", path[1300], err[256];
    assert_non_null(mkdtemp(tmp));
    snprintf(path, sizeof path, "%s/preprocessor_config.json", tmp);
    prism_qwenvl_proc_t p;
    write_text(path, "{}");
    assert_int_equal(prism_qwenvl_proc_load_dir(tmp, &p, err, sizeof err), PRISM_OK);
    assert_int_equal(p.patch, 14);
    assert_int_equal(p.min_pixels, 56 * 56);
    assert_int_equal(p.max_pixels, 28 * 28 * 1280);
    assert_false(p.bilinear);
    /* min_pixels / max_pixels win over size, as in Qwen2VLImageProcessor.__init__ */
    write_text(path, "{\"size\": {\"shortest_edge\": 100, \"longest_edge\": 200000}, \"max_pixels\": 300000.0}");
    assert_int_equal(prism_qwenvl_proc_load_dir(tmp, &p, err, sizeof err), PRISM_OK);
    assert_int_equal(p.min_pixels, 100);
    assert_int_equal(p.max_pixels, 300000);
    static const char *const bad[] = {
        "{\"resample\": 1}", "{\"patch_size\": 0}", "{\"merge_size\": 9}", "{\"do_resize\": false}",
        "{\"max_pixels\": 0}", "{\"min_pixels\": -5}", "{\"max_pixels\": 1.5}", "{\"size\": 5}",
        "{\"image_std\": [1, 0, 1]}", "{\"image_mean\": [1, 2]}", "[1]", "{\"size\": {", "{\"do_rescale\": 1}",
    };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(bad); i++) {
        write_text(path, bad[i]);
        err[0] = 0;
        if (prism_qwenvl_proc_load_dir(tmp, &p, err, sizeof err) == PRISM_OK) fail_msg("accepted %s", bad[i]);
        assert_true(err[0] != 0);
    }
    unlink(path);
    rmdir(tmp);
    prism_qwenvl_proc_default(&p);
    assert_int_equal(prism_qwenvl_max_pixels_for_tokens(&p, 16384), 16384ll * 28 * 28);
}

static void test_bad_arguments(void **state)
{
    prism_qwenvl_proc_t p;
    prism_qwenvl_proc_default(&p);
    prism_qwenvl_grid_t g;
    assert_int_equal(prism_qwenvl_grid(&p, 0, 10, &g), PRISM_EINVAL);
    assert_int_equal(prism_qwenvl_grid(&p, 10, PRISM_IMAGE_MAX_DIM + 1, &g), PRISM_EINVAL);
    assert_int_equal(prism_qwenvl_grid(&p, 201, 1, &g), PRISM_EINVAL);   /* aspect ratio > 200 */
    assert_int_equal(prism_qwenvl_grid(&p, 200, 1, &g), PRISM_OK);
    assert_int_equal(prism_qwenvl_workspace_bytes(&p, 0, 5), 0);
    uint8_t rgb[12] = {0};
    float *out = prism_malloc(64 * 588 * sizeof(float));
    prism_image_t scaled = {.rgb = rgb, .w = 2, .h = 2, .src_w = 4, .src_h = 4};   /* DCT-scaled decode */
    assert_int_equal(prism_qwenvl_preprocess(&p, &scaled, NULL, 0, out), PRISM_EINVAL);
    p.max_pixels = 28 * 28 * 16;
    prism_image_t big = {.rgb = llama4_synth_image(200, 100, 1), .w = 200, .h = 100, .src_w = 200, .src_h = 100};
    size_t need = prism_qwenvl_workspace_bytes(&p, 200, 100);
    assert_true(need > 64);
    void *ws = prism_malloc(need);
    assert_int_equal(prism_qwenvl_preprocess(&p, &big, ws, need - 1, out), PRISM_ELIMIT);
    assert_int_equal(prism_qwenvl_preprocess(&p, &big, ws, need, out), PRISM_OK);
    prism_free(ws);
    prism_free(big.rgb);
    prism_free(out);
}

/* Rows from the real decoders into the sink equal the whole-image path, bit for bit, without an
 * allocation and within the workspace bound; a request's own max_pixels changes the grid. */
static void test_stream_sink_matches_whole(void **state)
{
    static const struct { int64_t max_px; int w, h; } cases[] = {
        {28 * 28 * 16, 300, 200}, {28 * 28 * 16, 56, 56}, {28 * 28 * 64, 17, 90}, {28 * 28 * 1280, 640, 480},
        {28 * 28 * 16, 1000, 40},
    };
    const uint64_t max_px = 2048 * 2048;
    prism_image_decoder_t *dec;
    prism_image_relay_t *relay;
    assert_int_equal(prism_image_decoder_create(prism_image_decoder_bytes(2048, max_px), &dec), PRISM_OK);
    assert_int_equal(prism_image_relay_create(2048, &relay), PRISM_OK);
    for (size_t i = 0; i < PRISM_ARRAY_LEN(cases); i++) {
        prism_qwenvl_proc_t p;
        prism_qwenvl_proc_default(&p);
        p.max_pixels = cases[i].max_px;
        int w = cases[i].w, h = cases[i].h;
        size_t ws_cap = prism_qwenvl_workspace_bound(&p, max_px, 0);
        assert_true(ws_cap >= prism_qwenvl_workspace_bytes(&p, w, h));
        void *ws = prism_malloc(ws_cap);
        uint8_t *pix = ig_pixels(w, h, 3, (uint32_t)i + 1);
        uint8_t *files[3];
        size_t lens[3], n_files = 0;
        ig_jpeg_t jo = {.comps = 3, .in_cs = JCS_RGB, .jpeg_cs = JCS_YCbCr};
        files[n_files] = ig_jpeg(pix, w, h, &jo, &lens[n_files]);
        n_files++;
        jo.progressive = true;
        files[n_files] = ig_jpeg(pix, w, h, &jo, &lens[n_files]);
        n_files++;
        ig_png_t po = {SPNG_COLOR_TYPE_TRUECOLOR, 8, true, false, false};   /* interlaced: assembled whole first */
        files[n_files] = ig_png(w, h, &po, (uint32_t)i, &lens[n_files]);
        n_files++;
        for (size_t f = 0; f < n_files; f++) {
            prism_image_t img;
            prism_image_decode_opts_t o = {0};
            assert_int_equal(prism_image_decode(files[f], lens[f], &o, &img), PRISM_OK);
            prism_qwenvl_grid_t g;
            assert_int_equal(prism_qwenvl_grid(&p, w, h, &g), PRISM_OK);
            size_t n = (size_t)g.n_patches * prism_qwenvl_patch_floats(&p);
            float *want = prism_malloc(n * sizeof(float)), *got = prism_malloc(n * sizeof(float));
            assert_int_equal(prism_qwenvl_preprocess(&p, &img, ws, ws_cap, want), PRISM_OK);
            for (int use_relay = 0; use_relay < 2; use_relay++) {
                for (size_t k = 0; k < n; k++) got[k] = NAN;
                prism_qwenvl_stream_t st;
                prism_image_sink_t sink = prism_qwenvl_stream_sink(&st, &p, 0, 0, ws, ws_cap, got), inner = sink;
                if (use_relay) sink = prism_image_relay_sink(relay, &inner);
                uint64_t allocs = prism_mem_alloc_count();
                assert_int_equal(prism_image_decoder_run(dec, files[f], lens[f], NULL, &sink), PRISM_OK);
                assert_int_equal(prism_qwenvl_stream_finish(&st), PRISM_OK);
                assert_int_equal(prism_mem_alloc_count(), allocs);
                if (memcmp(got, want, n * sizeof(float))) {
                    size_t k = 0;
                    while (k < n && got[k] == want[k]) k++;
                    fail_msg("case %zu file %zu relay %d: float %zu of %zu differs: %g vs %g", i, f, use_relay, k, n,
                             got[k], want[k]);
                }
            }
            prism_free(want);
            prism_free(got);
            prism_image_free(&img);
            prism_free(files[f]);
        }
        /* a request's own (smaller) max_pixels: fewer patches, written in the same layout */
        prism_qwenvl_grid_t g0, g1;
        assert_int_equal(prism_qwenvl_grid(&p, w, h, &g0), PRISM_OK);
        assert_int_equal(prism_qwenvl_grid_px(&p, p.min_pixels, 28 * 28 * 4, w, h, &g1), PRISM_OK);
        assert_true(g1.n_tokens <= PRISM_MAX(4, g0.n_tokens));
        prism_free(pix);
        prism_free(ws);
    }
    prism_image_relay_destroy(relay);
    prism_image_decoder_destroy(dec);
}

/* The encoder's workspace plan holds every image up to its pixel limit (random and extreme
 * sizes at the real config), and stays small. */
static void test_workspace_bound(void **state)
{
    prism_qwenvl_proc_t p;
    prism_qwenvl_proc_default(&p);
    p.max_pixels = 12845056;
    const uint64_t max_px = 4096ull * 4096;
    size_t bound = prism_qwenvl_workspace_bound(&p, max_px, 0);
    assert_true(bound > 0 && bound < (64u << 20));
    uint64_t rng = 99;
    for (int it = 0; it < 3000; it++) {
        rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
        int w = 1 + (int)(rng % PRISM_IMAGE_MAX_DIM);
        int h = 1 + (int)(((rng >> 24) % max_px) / (uint64_t)w % PRISM_IMAGE_MAX_DIM);
        if (it % 4 == 0) h = (int)PRISM_MIN(max_px / (uint64_t)w, (uint64_t)PRISM_IMAGE_MAX_DIM);
        if (it % 8 == 1) { int t = w; w = h > 0 ? h : 1; h = t; }
        if ((uint64_t)w * h > max_px || h < 1 || (double)PRISM_MAX(w, h) / PRISM_MIN(w, h) > 200) continue;
        size_t need = prism_qwenvl_workspace_bytes(&p, w, h);
        assert_true(need > 0);
        if (need > bound) fail_msg("%dx%d needs %zu > bound %zu", w, h, need, bound);
    }
    static const int extremes[][2] = {{4096, 4096}, {28000, 140}, {140, 28000}, {65535, 256}, {256, 65535}, {1, 1},
                                      {4097, 4095}, {3, 600}};
    for (size_t i = 0; i < PRISM_ARRAY_LEN(extremes); i++) {
        size_t need = prism_qwenvl_workspace_bytes(&p, extremes[i][0], extremes[i][1]);
        if (need > bound) fail_msg("%dx%d needs %zu > bound %zu", extremes[i][0], extremes[i][1], need, bound);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pixels_bit_exact),
        cmocka_unit_test(test_smart_resize_table),
        cmocka_unit_test(test_mrope_positions),
        cmocka_unit_test(test_config_loader),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_stream_sink_matches_whole),
        cmocka_unit_test(test_workspace_bound),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
