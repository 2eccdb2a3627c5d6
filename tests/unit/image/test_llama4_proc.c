/* Llama-4 image processor against transformers' Llama4ImageProcessor (torchvision backend) and
 * Llama4Processor, from tests/data/image/llama4/goldens.json (tools/gen_llama4_goldens.py):
 *  - pixel values bit-exact (bf16) for 17 sizes / aspect ratios at a 28-px tile, max_patches 8
 *    (upscaled 1x1, exact fits, padding, extreme aspect ratios, several tiles + the global tile);
 *  - FNV hashes + samples at the real config (336 px, max_patches 16) up to 4096x4096 (17 tiles);
 *  - the tile grid / resize / token count table (361 sizes) the router relies on;
 *  - the prompt expansion layout, the config loaders and argument errors;
 *  - the streaming sink (what the encoder runs: rows from the JPEG / PNG decoder, optionally on the
 *    relay thread, into two resamplers and straight into the tiles) equals the whole-image path
 *    bit for bit, allocates nothing, and fits the workspace bound the encoder plans with. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <unistd.h>

#include "image/image.h"
#include "image/llama4_proc.h"
#include "image_test_util.h"
#include "image_gen.h"
#include "llama4_synth.h"

static json_t *goldens;

static uint8_t *synth_image(int w, int h, uint32_t seed)
{
    uint8_t *p = llama4_synth_image(w, h, seed);
    assert_non_null(p);
    return p;
}

static int setup(void **state)
{
    goldens = itu_load_json("llama4/goldens.json");
    return goldens ? 0 : -1;
}

static int teardown(void **state)
{
    json_decref(goldens);
    return 0;
}


/* Runs the processor on a synthetic image; returns [n_tiles][3][tile][tile] (prism_malloc'd). */
static float *process(const prism_llama4_proc_t *p, int w, int h, uint32_t seed, prism_llama4_grid_t *g)
{
    assert_int_equal(prism_llama4_grid(p, w, h, g), PRISM_OK);
    prism_image_t img = {.rgb = synth_image(w, h, seed), .w = w, .h = h, .src_w = w, .src_h = h, .owned = true};
    size_t ws_n = prism_llama4_preprocess_workspace_bytes(p, w, h);
    assert_true(ws_n > 0);
    void *ws = prism_malloc(ws_n);
    size_t n = (size_t)g->n_tiles * 3 * p->tile * p->tile;
    float *out = prism_malloc(n * sizeof(float));
    assert_non_null(ws);
    assert_non_null(out);
    uint64_t allocs = prism_mem_alloc_count();
    assert_int_equal(prism_llama4_preprocess(p, &img, ws, ws_n, out), PRISM_OK);
    assert_int_equal(prism_mem_alloc_count(), allocs);   /* no allocation while preprocessing */
    prism_free(ws);
    prism_free(img.rgb);
    return out;
}

static uint16_t to_bf16_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    assert_int_equal(u & 0xFFFFu, 0);   /* every output is a bf16 value */
    return (uint16_t)(u >> 16);
}

static void test_small_tiles_bit_exact(void **state)
{
    json_t *sm = json_object_get(goldens, "small");
    prism_llama4_proc_t p;
    prism_llama4_proc_default(&p);
    p.tile = itu_int(sm, "tile");
    p.max_patches = itu_int(sm, "max_patches");
    size_t i;
    json_t *c;
    int n_multi = 0;
    json_array_foreach(json_object_get(sm, "cases"), i, c) {
        int w = itu_int(c, "w"), h = itu_int(c, "h");
        prism_llama4_grid_t g;
        float *out = process(&p, w, h, (uint32_t)itu_int(c, "seed"), &g);
        assert_int_equal(g.rows, itu_int(c, "rows"));
        assert_int_equal(g.cols, itu_int(c, "cols"));
        assert_int_equal(g.resized_h, itu_int(c, "resized_h"));
        assert_int_equal(g.resized_w, itu_int(c, "resized_w"));
        assert_int_equal(g.n_tiles, itu_int(c, "n_tiles"));
        n_multi += g.n_tiles > 1;
        char name[96];
        snprintf(name, sizeof name, "llama4/%.80s", itu_str(c, "file"));
        size_t len;
        uint16_t *want = (uint16_t *)itu_read(name, &len);
        size_t n = (size_t)g.n_tiles * 3 * p.tile * p.tile;
        assert_int_equal(len, n * 2);
        size_t bad = 0, first = n;
        for (size_t k = 0; k < n; k++)
            if (to_bf16_bits(out[k]) != want[k]) {
                if (first == n) first = k;
                bad++;
            }
        if (bad)
            fail_msg("%dx%d: %zu of %zu values differ from HF (first at %zu: %g vs bf16 %04x)", w, h, bad, n, first,
                     out[first], want[first]);
        prism_free(want);
        prism_free(out);
    }
    assert_true(n_multi >= 8);   /* most cases need several tiles plus the global tile */
}

static void test_real_config_hashes(void **state)
{
    json_t *re = json_object_get(goldens, "real");
    prism_llama4_proc_t p;
    prism_llama4_proc_default(&p);
    assert_int_equal(p.tile, itu_int(re, "tile"));
    assert_int_equal(p.max_patches, itu_int(re, "max_patches"));
    assert_int_equal(p.tokens_per_tile, itu_int(re, "tokens_per_tile"));
    size_t i;
    json_t *c;
    bool saw17 = false;
    json_array_foreach(json_object_get(re, "cases"), i, c) {
        int w = itu_int(c, "w"), h = itu_int(c, "h");
        prism_llama4_grid_t g;
        float *out = process(&p, w, h, (uint32_t)itu_int(c, "seed"), &g);
        assert_int_equal(g.rows, itu_int(c, "rows"));
        assert_int_equal(g.cols, itu_int(c, "cols"));
        assert_int_equal(g.n_tiles, itu_int(c, "n_tiles"));
        saw17 = saw17 || g.n_tiles == 17;
        size_t n = (size_t)g.n_tiles * 3 * p.tile * p.tile;
        uint16_t *bits = prism_malloc(n * 2);
        for (size_t k = 0; k < n; k++) bits[k] = to_bf16_bits(out[k]);
        size_t stride = (size_t)itu_int(c, "sample_stride"), j;
        json_t *v;
        json_array_foreach(json_object_get(c, "samples"), j, v) {
            if (out[j * stride] != (float)json_number_value(v))
                fail_msg("%dx%d: value %zu is %g, HF %g", w, h, j * stride, out[j * stride], json_number_value(v));
        }
        if (!itu_fnv_matches(c, "fnv1a64_bf16", bits, n * 2)) fail_msg("%dx%d: pixel hash differs from HF", w, h);
        prism_free(bits);
        prism_free(out);
    }
    assert_true(saw17);   /* 4096x4096: 4x4 tiles + global */
}

static void test_geometry_table(void **state)
{
    json_t *re = json_object_get(goldens, "real");
    prism_llama4_proc_t p;
    prism_llama4_proc_default(&p);
    size_t i;
    json_t *c;
    int rows = 0;
    json_array_foreach(json_object_get(re, "geometry"), i, c) {
        int w = itu_int(c, "w"), h = itu_int(c, "h");
        prism_llama4_grid_t g;
        assert_int_equal(prism_llama4_grid(&p, w, h, &g), PRISM_OK);
        if (g.rows != itu_int(c, "rows") || g.cols != itu_int(c, "cols") || g.resized_h != itu_int(c, "resized_h") ||
            g.resized_w != itu_int(c, "resized_w") || g.n_tiles != itu_int(c, "n_tiles") ||
            g.n_prompt_tokens != itu_int(c, "prompt_tokens"))
            fail_msg("%dx%d: got %dx%d tiles, resize %dx%d, %d tiles, %d tokens; HF %dx%d, %dx%d, %d, %d", w, h, g.rows,
                     g.cols, g.resized_h, g.resized_w, g.n_tiles, g.n_prompt_tokens, itu_int(c, "rows"),
                     itu_int(c, "cols"), itu_int(c, "resized_h"), itu_int(c, "resized_w"), itu_int(c, "n_tiles"),
                     itu_int(c, "prompt_tokens"));
        assert_int_equal(g.n_patch_tokens, g.n_tiles * 144);
        rows++;
    }
    assert_true(rows > 300);
    /* The numbers: a 4096x4096 image is 16 tiles + global = 17 x 144 patch tokens. */
    prism_llama4_grid_t g;
    assert_int_equal(prism_llama4_grid(&p, 4096, 4096, &g), PRISM_OK);
    assert_int_equal(g.n_tiles, 17);
    assert_int_equal(g.n_patch_tokens, 17 * 144);
}

static void test_expand_layout(void **state)
{
    prism_llama4_image_tokens_t t = {.image_start = 1, .image_end = 2, .tile_x = 3, .tile_y = 4, .image = 5, .patch = 6};
    prism_llama4_proc_t p;
    prism_llama4_proc_default(&p);
    p.tokens_per_tile = 2;
    prism_llama4_grid_t g;
    assert_int_equal(prism_llama4_grid(&p, 700, 400, &g), PRISM_OK);   /* 2 x 3 canvas */
    assert_int_equal(g.rows, 2);
    assert_int_equal(g.cols, 3);
    int32_t out[64];
    size_t n = 0;
    assert_int_equal(prism_llama4_expand(&g, 2, &t, out, PRISM_ARRAY_LEN(out), &n), PRISM_OK);
    static const int32_t want[] = {1, 6, 6, 3, 6, 6, 3, 6, 6, 4, 6, 6, 3, 6, 6, 3, 6, 6, 4, 5, 6, 6, 2};
    assert_int_equal(n, PRISM_ARRAY_LEN(want));
    assert_int_equal(n, (size_t)g.n_prompt_tokens);
    assert_memory_equal(out, want, sizeof want);
    /* Too small a buffer writes nothing and says so. */
    int32_t small[8] = {0};
    assert_int_equal(prism_llama4_expand(&g, 2, &t, small, PRISM_ARRAY_LEN(small), &n), PRISM_ELIMIT);
    assert_int_equal(small[0], 0);
    /* One tile: no separators, no grid. */
    assert_int_equal(prism_llama4_grid(&p, 100, 100, &g), PRISM_OK);
    assert_int_equal(prism_llama4_expand(&g, 2, &t, out, PRISM_ARRAY_LEN(out), &n), PRISM_OK);
    static const int32_t one[] = {1, 5, 6, 6, 2};
    assert_int_equal(n, 5);
    assert_memory_equal(out, one, sizeof one);
    /* A grid whose token count disagrees with tokens_per_tile is refused. */
    assert_int_equal(prism_llama4_expand(&g, 3, &t, out, PRISM_ARRAY_LEN(out), &n), PRISM_EINVAL);
}

static void write_text(const char *path, const char *s)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(s, f);
    fclose(f);
}

static void test_config_loader(void **state)
{
    char dir[1200], err[256];
    const char *src = getenv("PRISM_SOURCE_DIR");
    snprintf(dir, sizeof dir, "%s/tests/data/model/llama4_tiny", src && *src ? src : PRISM_SOURCE_DIR);
    prism_llama4_proc_t p;
    int rc = prism_llama4_proc_load_dir(dir, &p, err, sizeof err);
    if (rc) fail_msg("%s", err);
    assert_int_equal(p.tile, 56);
    assert_int_equal(p.max_patches, 6);
    assert_int_equal(p.tokens_per_tile, 16);   /* (56/7)^2 / 4 from processor_config.json */
    assert_true(fabs(p.rescale_factor - 1.0 / 255.0) < 1e-15);

    char tmp[] = "/tmp/prism_llama4_cfg_XXXXXX";
    assert_non_null(mkdtemp(tmp));
    char path[1300];
    snprintf(path, sizeof path, "%s/preprocessor_config.json", tmp);
    write_text(path, "{}");
    assert_int_equal(prism_llama4_proc_load_dir(tmp, &p, err, sizeof err), PRISM_OK);
    assert_int_equal(p.tile, 336);
    assert_int_equal(p.tokens_per_tile, 144);
    static const char *const bad[] = {
        "{\"resample\": 3}", "{\"size\": {\"height\": 336, \"width\": 224}}", "{\"do_normalize\": false}",
        "{\"max_patches\": 0}", "{\"max_patches\": 100000}", "{\"size\": {\"height\": 0, \"width\": 0}}",
        "{\"image_std\": [1, 0, 1]}", "{\"image_mean\": [1, 2]}", "[1]", "{\"size\": 5",
    };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(bad); i++) {
        write_text(path, bad[i]);
        rc = prism_llama4_proc_load_dir(tmp, &p, err, sizeof err);
        if (rc == PRISM_OK) fail_msg("accepted %s", bad[i]);
        assert_true(err[0] != 0);
    }
    unlink(path);
    rmdir(tmp);
}

static void test_bad_arguments(void **state)
{
    prism_llama4_proc_t p;
    prism_llama4_proc_default(&p);
    prism_llama4_grid_t g;
    assert_int_equal(prism_llama4_grid(&p, 0, 10, &g), PRISM_EINVAL);
    assert_int_equal(prism_llama4_grid(&p, 10, PRISM_IMAGE_MAX_DIM + 1, &g), PRISM_EINVAL);
    assert_int_equal(prism_llama4_grid(&p, PRISM_IMAGE_MAX_DIM, 1, &g), PRISM_OK);   /* extreme but valid */
    assert_int_equal(g.rows * g.cols <= 16, true);
    assert_int_equal(prism_llama4_preprocess_workspace_bytes(&p, 0, 5), 0);
    prism_llama4_proc_t bad = p;
    bad.tile = 0;
    assert_int_equal(prism_llama4_grid(&bad, 10, 10, &g), PRISM_EINVAL);
    p.tile = 28;
    p.max_patches = 4;
    uint8_t rgb[12] = {0};
    float *out = prism_malloc(5 * 3 * 28 * 28 * sizeof(float));
    prism_image_t scaled = {.rgb = rgb, .w = 2, .h = 2, .src_w = 4, .src_h = 4};   /* DCT-scaled decode */
    assert_int_equal(prism_llama4_preprocess(&p, &scaled, NULL, 0, out), PRISM_EINVAL);
    prism_image_t empty = {.rgb = NULL, .w = 2, .h = 2};
    assert_int_equal(prism_llama4_preprocess(&p, &empty, NULL, 0, out), PRISM_EINVAL);
    /* One byte short of the workspace is refused, not overrun. */
    prism_image_t big = {.rgb = synth_image(200, 100, 1), .w = 200, .h = 100, .src_w = 200, .src_h = 100};
    size_t need = prism_llama4_preprocess_workspace_bytes(&p, 200, 100);
    assert_true(need > 64);
    void *ws = prism_malloc(need);
    assert_int_equal(prism_llama4_preprocess(&p, &big, ws, need - 1, out), PRISM_ELIMIT);
    assert_int_equal(prism_llama4_preprocess(&p, &big, ws, need, out), PRISM_OK);
    prism_free(ws);
    prism_free(big.rgb);
    prism_free(out);
}

/* Properties over random sizes: the canvas holds at most max_patches tiles, the resize fits the
 * canvas without distortion beyond rounding, and the processor runs (in its own workspace, which
 * the sanitizer build checks) for random small images at several configs. */
static void test_random_sizes(void **state)
{
    uint64_t rng = 12345;
    prism_llama4_proc_t p;
    prism_llama4_proc_default(&p);
    for (int it = 0; it < 20000; it++) {
        rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
        int w = 1 + (int)(rng % PRISM_IMAGE_MAX_DIM), h = 1 + (int)((rng >> 20) % PRISM_IMAGE_MAX_DIM);
        if (it % 3 == 0) h = 1 + (int)((rng >> 40) % 2000);
        prism_llama4_grid_t g;
        assert_int_equal(prism_llama4_grid(&p, w, h, &g), PRISM_OK);
        assert_true(g.rows >= 1 && g.cols >= 1 && g.rows * g.cols <= p.max_patches);
        assert_true(g.resized_w >= 1 && g.resized_w <= g.cols * p.tile);
        assert_true(g.resized_h >= 1 && g.resized_h <= g.rows * p.tile);
        /* aspect kept: the limiting side fills its canvas side (or the image already fits) */
        assert_true(g.resized_w == g.cols * p.tile || g.resized_h == g.rows * p.tile || (g.resized_w == w && g.resized_h == h) ||
                    g.resized_w == PRISM_MAX(w, p.tile) || g.resized_h == PRISM_MAX(h, p.tile));
        assert_int_equal(g.n_tiles, g.rows * g.cols + (g.rows * g.cols > 1));
    }
    for (int it = 0; it < 60; it++) {
        rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
        p.tile = 14 + (int)(rng % 3) * 7;
        p.max_patches = 1 + (int)((rng >> 8) % 9);
        p.resize_to_max_canvas = (rng >> 16) & 1;
        int w = 1 + (int)((rng >> 24) % 300), h = 1 + (int)((rng >> 40) % 300);
        prism_llama4_grid_t g;
        float *out = process(&p, w, h, (uint32_t)it, &g);
        size_t n = (size_t)g.n_tiles * 3 * p.tile * p.tile;
        for (size_t k = 0; k < n; k++) assert_true(out[k] >= -1.0f && out[k] <= 1.0f);
        prism_free(out);
    }
}

/* Rows streamed from the real decoders (baseline and progressive JPEG, PNG, interlaced PNG; with
 * and without the relay thread) into the Llama-4 sink give exactly what the whole-image path gives
 * on the same decoded pixels, with no allocation, inside the encoder's planned workspace. */
static void test_stream_sink_matches_whole(void **state)
{
    static const struct { int tile, max_patches, w, h; } cases[] = {
        {28, 8, 300, 200}, {28, 8, 56, 28},   /* 56x28: exact 2x1 canvas, no resize at all */
        {28, 8, 17, 90}, {28, 4, 1000, 40}, {56, 6, 300, 200}, {28, 1, 97, 61}, {336, 16, 1500, 1001},
    };
    const uint64_t max_px = 2048 * 2048;
    prism_image_decoder_t *dec;
    prism_image_relay_t *relay;
    assert_int_equal(prism_image_decoder_create(prism_image_decoder_bytes(2048, max_px), &dec), PRISM_OK);
    assert_int_equal(prism_image_relay_create(2048, &relay), PRISM_OK);
    for (size_t i = 0; i < PRISM_ARRAY_LEN(cases); i++) {
        prism_llama4_proc_t p;
        prism_llama4_proc_default(&p);
        p.tile = cases[i].tile;
        p.max_patches = cases[i].max_patches;
        p.tokens_per_tile = 4;
        int w = cases[i].w, h = cases[i].h;
        size_t ws_cap = prism_llama4_workspace_bound(&p, max_px);
        assert_true(ws_cap >= prism_llama4_preprocess_workspace_bytes(&p, w, h));
        void *ws = prism_malloc(ws_cap);
        uint8_t *pix = ig_pixels(w, h, 3, (uint32_t)i + 1);
        size_t n_files = 0;
        uint8_t *files[4];
        size_t lens[4];
        ig_jpeg_t jo = {.comps = 3, .in_cs = JCS_RGB, .jpeg_cs = JCS_YCbCr};
        files[n_files] = ig_jpeg(pix, w, h, &jo, &lens[n_files]);
        n_files++;
        jo.progressive = true;
        files[n_files] = ig_jpeg(pix, w, h, &jo, &lens[n_files]);
        n_files++;
        ig_png_t po = {SPNG_COLOR_TYPE_TRUECOLOR, 8, false, false, false};
        files[n_files] = ig_png(w, h, &po, (uint32_t)i, &lens[n_files]);
        n_files++;
        po.interlace = true;
        files[n_files] = ig_png(w, h, &po, (uint32_t)i, &lens[n_files]);
        n_files++;
        for (size_t f = 0; f < n_files; f++) {
            prism_image_t img;
            prism_image_decode_opts_t o = {0};
            assert_int_equal(prism_image_decode(files[f], lens[f], &o, &img), PRISM_OK);
            prism_llama4_grid_t g;
            assert_int_equal(prism_llama4_grid(&p, w, h, &g), PRISM_OK);
            size_t n = (size_t)g.n_tiles * 3 * p.tile * p.tile;
            float *want = prism_malloc(n * sizeof(float)), *got = prism_malloc(n * sizeof(float));
            assert_int_equal(prism_llama4_preprocess(&p, &img, ws, ws_cap, want), PRISM_OK);
            if (i == 1 && f == 2) {
                /* no resize, no padding: the tiles are the decoded pixels, normalized */
                for (int y = 0; y < h; y++)
                    for (int x = 0; x < w; x++)
                        for (int c = 0; c < 3; c++) {
                            int t = x / p.tile, tx = x % p.tile;
                            float v = want[(((size_t)t * 3 + c) * p.tile + y) * p.tile + tx];
                            float u = img.rgb[((size_t)y * w + x) * 3 + c] / 255.0f;
                            assert_true(fabsf(v - (u - 0.5f) / 0.5f) < 0.01f);
                        }
            }
            for (int use_relay = 0; use_relay < 2; use_relay++) {
                for (size_t k = 0; k < n; k++) got[k] = NAN;
                prism_llama4_stream_t st;
                prism_image_sink_t sink = prism_llama4_stream_sink(&st, &p, ws, ws_cap, got), inner = sink;
                if (use_relay) sink = prism_image_relay_sink(relay, &inner);
                uint64_t allocs = prism_mem_alloc_count();
                assert_int_equal(prism_image_decoder_run(dec, files[f], lens[f], NULL, &sink), PRISM_OK);
                assert_int_equal(prism_llama4_stream_finish(&st), PRISM_OK);
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
        /* A workspace one byte short of this image's plan is refused at begin, not overrun. */
        prism_llama4_grid_t g;
        assert_int_equal(prism_llama4_grid(&p, w, h, &g), PRISM_OK);
        float *out = prism_malloc((size_t)g.n_tiles * 3 * p.tile * p.tile * sizeof(float));
        prism_llama4_stream_t st;
        prism_image_sink_t sink = prism_llama4_stream_sink(&st, &p, ws, prism_llama4_preprocess_workspace_bytes(&p, w, h) - 1,
                                                           out);
        prism_image_t geom = {.w = w, .h = h, .src_w = w, .src_h = h};
        assert_int_equal(sink.begin(sink.ud, &geom), PRISM_ELIMIT);
        /* and a DCT-scaled decode is refused (HF resizes the full image) */
        sink = prism_llama4_stream_sink(&st, &p, ws, ws_cap, out);
        geom.src_w = w * 2;
        assert_int_equal(sink.begin(sink.ud, &geom), PRISM_EINVAL);
        prism_free(out);
        prism_free(pix);
        prism_free(ws);
    }
    prism_image_relay_destroy(relay);
    prism_image_decoder_destroy(dec);
}

/* The encoder's workspace plan holds every image up to its pixel limit: random and extreme sizes
 * at the real config (and a small tile), and it stays a few MiB at Scout's 4096x4096 limit. */
static void test_workspace_bound(void **state)
{
    prism_llama4_proc_t p;
    prism_llama4_proc_default(&p);
    const uint64_t max_px = 4096ull * 4096;
    size_t bound = prism_llama4_workspace_bound(&p, max_px);
    assert_true(bound > 0 && bound < (16u << 20));
    assert_int_equal(prism_llama4_max_tiles(&p), 17);
    uint64_t rng = 99;
    for (int it = 0; it < 3000; it++) {
        rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
        int w = 1 + (int)(rng % PRISM_IMAGE_MAX_DIM);
        int h = 1 + (int)(((rng >> 24) % max_px) / (uint64_t)w % PRISM_IMAGE_MAX_DIM);
        if (it % 4 == 0) h = (int)PRISM_MIN(max_px / (uint64_t)w, (uint64_t)PRISM_IMAGE_MAX_DIM);
        if (it % 8 == 1) { int t = w; w = h > 0 ? h : 1; h = t; }
        if ((uint64_t)w * h > max_px || h < 1) continue;
        size_t need = prism_llama4_preprocess_workspace_bytes(&p, w, h);
        assert_true(need > 0);
        if (need > bound) fail_msg("%dx%d needs %zu > bound %zu", w, h, need, bound);
    }
    static const int extremes[][2] = {{65535, 256}, {256, 65535}, {4096, 4096}, {65535, 1}, {1, 65535}, {4097, 4095}};
    for (size_t i = 0; i < PRISM_ARRAY_LEN(extremes); i++)
        assert_true(prism_llama4_preprocess_workspace_bytes(&p, extremes[i][0], extremes[i][1]) <= bound);
    p.tile = 28;
    p.max_patches = 1;
    bound = prism_llama4_workspace_bound(&p, 1u << 20);
    assert_int_equal(prism_llama4_max_tiles(&p), 1);
    for (int w = 1; w <= 4096; w += 37) {
        int h = (int)PRISM_MIN((1u << 20) / (unsigned)w, (unsigned)PRISM_IMAGE_MAX_DIM);
        assert_true(prism_llama4_preprocess_workspace_bytes(&p, w, h) <= bound);
        assert_true(prism_llama4_preprocess_workspace_bytes(&p, h, w) <= bound);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_small_tiles_bit_exact),
        cmocka_unit_test(test_real_config_hashes),
        cmocka_unit_test(test_geometry_table),
        cmocka_unit_test(test_expand_layout),
        cmocka_unit_test(test_config_loader),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_random_sizes),
        cmocka_unit_test(test_stream_sink_matches_whole),
        cmocka_unit_test(test_workspace_bound),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
