/* The streaming path (decoder -> row sink -> resampler) against transformers' goldens and, bit for
 * bit, against whole-image decodes preprocessed with the scalar reference kernels; decoder memory
 * bounds, the scan cap, state isolation between images, the relay thread, and the vector kernels
 * against the scalar ones. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>

#include "image/clip.h"
#include "image/image.h"
#include "image/resample.h"
#include "image_gen.h"
#include "image_test_util.h"

/* Under the sanitizers (10x slower) the large shapes are left to the release run. */
#if defined(__SANITIZE_ADDRESS__)
#define HEAVY 0
#else
#define HEAVY 1
#endif

static json_t *manifest;

static int setup(void **state)
{
    manifest = itu_manifest();
    return 0;
}

static int teardown(void **state)
{
    json_decref(manifest);
    return 0;
}

/* One decoder and one relay for the whole file, as in the encoder: every test also checks that
 * nothing of one image leaks into the next. */
static prism_image_decoder_t *dec;
static prism_image_relay_t *relay;

static prism_image_decoder_t *the_decoder(void)
{
    if (!dec)
        assert_int_equal(prism_image_decoder_create(prism_image_decoder_bytes(4096, 4096 * 4096), &dec), PRISM_OK);
    return dec;
}

static prism_image_relay_t *the_relay(void)
{
    if (!relay)
        assert_int_equal(prism_image_relay_create(4096, &relay), PRISM_OK);
    return relay;
}

static void load_cfg(const char *which, prism_clip_preproc_t *p, prism_clip_resample_impl_t impl)
{
    char path[1200], err[256];
    snprintf(path, sizeof path, "%s/preprocessor_config_%s.json", itu_data_dir(), which);
    if (prism_clip_preproc_load(path, p, err, sizeof err) != PRISM_OK)
        fail_msg("%s: %s", path, err);
    p->impl = impl;
}

/* Streams a file through the shared decoder into the CLIP sink (via the relay when asked). */
static int stream_pre(const prism_clip_preproc_t *p, const uint8_t *d, size_t n, const prism_image_decode_opts_t *o,
                      bool use_relay, float **out, int *ow, int *oh)
{
    prism_image_info_t info;
    int rc = prism_image_probe(d, n, &info);
    if (rc != PRISM_OK)
        return rc;
    prism_clip_output_size(p, info.width, info.height, ow, oh);
    size_t ws_n = prism_clip_workspace_bound(p, (uint64_t)info.width * info.height);
    void *ws = prism_malloc(ws_n);
    *out = prism_malloc((size_t)3 * *ow * *oh * sizeof(float));
    prism_clip_stream_t st;
    prism_image_sink_t sink = prism_clip_stream_sink(&st, p, ws, ws_n, *out);
    prism_image_sink_t inner = sink;
    if (use_relay)
        sink = prism_image_relay_sink(the_relay(), &inner);
    rc = prism_image_decoder_run(the_decoder(), d, n, o, &sink);
    if (rc == PRISM_OK)
        rc = prism_clip_stream_finish(&st);
    prism_free(ws);
    if (rc != PRISM_OK) {
        prism_free(*out);
        *out = NULL;
    }
    return rc;
}

/* Reference: whole-image decode through the libraries' whole-image APIs, preprocessed from memory
 * with the scalar kernels. */
static float *ref_pre(const prism_clip_preproc_t *p, const uint8_t *d, size_t n, const prism_image_decode_opts_t *o)
{
    prism_image_info_t info;
    assert_int_equal(prism_image_probe(d, n, &info), PRISM_OK);
    int num = 1, denom = 1;
    if (info.format == PRISM_IMAGE_FORMAT_JPEG && o)
        prism_image_jpeg_pick_scale(info.width, info.height, o->min_w, o->min_h, &num, &denom);
    prism_image_t img;
    assert_int_equal(ig_ref_decode(d, n, num, denom, &img), PRISM_OK);
    int ow, oh;
    prism_clip_output_size(p, img.src_w, img.src_h, &ow, &oh);
    size_t ws_n = prism_clip_preprocess_workspace_bytes_img(p, &img);
    void *ws = prism_malloc(ws_n);
    float *out = prism_malloc((size_t)3 * ow * oh * sizeof(float));
    int old = prism_resample_force_isa(1);
    assert_int_equal(prism_clip_preprocess(p, &img, ws, ws_n, out), PRISM_OK);
    prism_resample_force_isa(old);
    prism_free(ws);
    prism_image_free(&img);
    return out;
}

/* ---------------------------------------------------------------- goldens */

/* Streamed, every fixture matches transformers (both backends, every size, the padded crop), with
 * and without the relay thread, through one long-lived decoder. */
static void test_stream_goldens(void **state)
{
    const char *cfgs[] = {"64", "224", "336", "pad"};
    bool tv = json_is_string(json_object_get(manifest, "torchvision"));
    json_t *imgs = json_object_get(manifest, "images");
    size_t checked = 0;
    for (int use_relay = 0; use_relay < 2; use_relay++)
        for (size_t c = 0; c < PRISM_ARRAY_LEN(cfgs); c++)
            for (int impl = 0; impl < 2; impl++) {
                if ((impl == PRISM_CLIP_RESAMPLE_TORCHVISION && !tv) || (use_relay && c != 2) ||
                    (!HEAVY && (c == 1 || c == 3 || use_relay)))
                    continue;
                prism_clip_preproc_t p;
                load_cfg(cfgs[c], &p, (prism_clip_resample_impl_t)impl);
                char key[32];
                snprintf(key, sizeof key, "%s_%s_fnv", impl == PRISM_CLIP_RESAMPLE_TORCHVISION ? "tv" : "pil", cfgs[c]);
                size_t i;
                json_t *e;
                json_array_foreach(imgs, i, e) {
                    const char *file = itu_str(e, "file");
                    if (!itu_str(e, key))
                        continue;
                    size_t len;
                    uint8_t *data = itu_read(file, &len);
                    float *out;
                    int w, h;
                    int rc = stream_pre(&p, data, len, NULL, use_relay, &out, &w, &h);
                    if (rc != PRISM_OK)
                        fail_msg("%s: %s (%s)", file, prism_strerror(rc), prism_image_decoder_error(the_decoder()));
                    if (!itu_fnv_matches(e, key, out, (size_t)3 * w * h * sizeof(float)))
                        fail_msg("%s %s relay %d: streamed output differs from transformers", file, key, use_relay);
                    checked++;
                    prism_free(out);
                    prism_free(data);
                }
            }
    assert_true(checked >= (HEAVY ? 10 : 4) * 24);
}

/* ---------------------------------------------------------------- bit identity */

typedef struct {
    const char *name;
    bool jpeg;
    ig_jpeg_t j;
    ig_png_t p;
} gen_t;

static uint8_t *gen_file(const gen_t *g, int w, int h, uint32_t seed, size_t *len)
{
    if (!g->jpeg)
        return ig_png(w, h, &g->p, seed, len);
    uint8_t *pix = ig_pixels(w, h, g->j.comps, seed);
    uint8_t *f = ig_jpeg(pix, w, h, &g->j, len);
    prism_free(pix);
    return f;
}

static const gen_t gens[] = {
    {"baseline 4:2:0", true, {.comps = 3, .in_cs = JCS_RGB, .jpeg_cs = JCS_YCbCr}},
    {"baseline 4:4:4", true, {.comps = 3, .in_cs = JCS_RGB, .jpeg_cs = JCS_YCbCr, .samp = {{1, 1}, {1, 1}, {1, 1}}}},
    {"baseline 4:2:2", true, {.comps = 3, .in_cs = JCS_RGB, .jpeg_cs = JCS_YCbCr, .samp = {{2, 1}, {1, 1}, {1, 1}}}},
    {"baseline 4:4:0", true, {.comps = 3, .in_cs = JCS_RGB, .jpeg_cs = JCS_YCbCr, .samp = {{1, 2}, {1, 1}, {1, 1}}}},
    {"baseline 4:1:1", true, {.comps = 3, .in_cs = JCS_RGB, .jpeg_cs = JCS_YCbCr, .samp = {{4, 1}, {1, 1}, {1, 1}}}},
    {"progressive 4:2:0", true, {.comps = 3, .in_cs = JCS_RGB, .jpeg_cs = JCS_YCbCr, .progressive = true}},
    {"progressive 4:4:4", true,
     {.comps = 3, .in_cs = JCS_RGB, .jpeg_cs = JCS_YCbCr, .samp = {{1, 1}, {1, 1}, {1, 1}}, .progressive = true}},
    {"grayscale", true, {.comps = 1, .in_cs = JCS_GRAYSCALE, .jpeg_cs = JCS_GRAYSCALE}},
    {"progressive grayscale", true, {.comps = 1, .in_cs = JCS_GRAYSCALE, .jpeg_cs = JCS_GRAYSCALE, .progressive = true}},
    {"CMYK", true, {.comps = 4, .in_cs = JCS_CMYK, .jpeg_cs = JCS_CMYK}},
    {"YCCK 2x2", true, {.comps = 4, .in_cs = JCS_CMYK, .jpeg_cs = JCS_YCCK, .samp = {{2, 2}, {1, 1}, {1, 1}, {2, 2}}}},
    {"progressive CMYK", true, {.comps = 4, .in_cs = JCS_CMYK, .jpeg_cs = JCS_CMYK, .progressive = true}},
    {"RGB JPEG", true, {.comps = 3, .in_cs = JCS_RGB, .jpeg_cs = JCS_RGB}},
    {"png rgb8", false, .p = {SPNG_COLOR_TYPE_TRUECOLOR, 8, false, false, true}},
    {"png rgb8 interlaced", false, .p = {SPNG_COLOR_TYPE_TRUECOLOR, 8, true, false, false}},
    {"png rgb16", false, .p = {SPNG_COLOR_TYPE_TRUECOLOR, 16, false, false, false}},
    {"png rgba8", false, .p = {SPNG_COLOR_TYPE_TRUECOLOR_ALPHA, 8, false, false, true}},
    {"png rgba16 interlaced", false, .p = {SPNG_COLOR_TYPE_TRUECOLOR_ALPHA, 16, true, false, false}},
    {"png palette4", false, .p = {SPNG_COLOR_TYPE_INDEXED, 4, false, false, false}},
    {"png palette8 tRNS interlaced", false, .p = {SPNG_COLOR_TYPE_INDEXED, 8, true, true, false}},
    {"png gray16 tRNS", false, .p = {SPNG_COLOR_TYPE_GRAYSCALE, 16, false, true, false}},
    {"png gray1", false, .p = {SPNG_COLOR_TYPE_GRAYSCALE, 1, false, false, false}},
    {"png gray+alpha8 interlaced", false, .p = {SPNG_COLOR_TYPE_GRAYSCALE_ALPHA, 8, true, false, false}},
};

/* Sizes below the 336 target (upscaled), around it, and above it (tall, wide, odd). */
static const int sizes[][2] = {{200, 150}, {97, 61}, {336, 336}, {801, 601}, {380, 1020}, {1500, 311}};

static void check_same(const char *what, const float *a, const float *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float)) != 0)
            fail_msg("%s: value %zu differs: %.9g vs %.9g", what, i, a[i], b[i]);
}

static void test_stream_bit_identity(void **state)
{
    prism_clip_preproc_t cfgs[2];
    prism_clip_preproc_default(&cfgs[0], 336);                         /* torchvision, bicubic */
    load_cfg("224", &cfgs[1], PRISM_CLIP_RESAMPLE_PIL);                 /* Pillow arithmetic */
    uint32_t seed = 7;
    size_t cases = 0;
    for (size_t g = 0; g < PRISM_ARRAY_LEN(gens); g++)
        for (size_t s = 0; s < PRISM_ARRAY_LEN(sizes); s++) {
            bool small = sizes[s][0] * sizes[s][1] <= 336 * 336;
            if (!small && (s % 3 != g % 3 || !HEAVY))
                continue;   /* one of the large shapes per format keeps the test to seconds */
            if (!HEAVY && s == 2)
                continue;
            size_t len;
            uint8_t *f = gen_file(&gens[g], sizes[s][0], sizes[s][1], seed++, &len);
            for (int c = 0; c < (small ? 2 : 1); c++) {
                const prism_clip_preproc_t *p = &cfgs[c];
                prism_image_info_t info;
                assert_int_equal(prism_image_probe(f, len, &info), PRISM_OK);
                prism_image_decode_opts_t full = {0}, scaled = {0};
                prism_clip_decode_opts(p, &info, &scaled);
                const prism_image_decode_opts_t *opts[2] = {&full, &scaled};
                for (int o = 0; o < 2; o++) {
                    if (o == 1 && scaled.min_w == 0)
                        continue;   /* no DCT scaling for this one */
                    float *ref = ref_pre(p, f, len, opts[o]);
                    int w, h;
                    prism_clip_output_size(p, info.width, info.height, &w, &h);
                    /* every kernel on the small sizes (test_resample_kernels_agree covers the rest);
                     * the relay on every other file (goldens and fuzzing cover it too) */
                    for (int isa = 3; isa >= (small ? 1 : 3); isa--)
                        for (int use_relay = 0; use_relay < 2; use_relay++) {
                            if (((isa != 3 || (g + s) % 2) && use_relay) || (!HEAVY && isa != 3))
                                continue;
                            int old = prism_resample_force_isa(isa);
                            float *out;
                            int ow, oh;
                            int rc = stream_pre(p, f, len, opts[o], use_relay, &out, &ow, &oh);
                            prism_resample_force_isa(old);
                            if (rc != PRISM_OK)
                                fail_msg("%s %dx%d: %s (%s)", gens[g].name, sizes[s][0], sizes[s][1], prism_strerror(rc),
                                         prism_image_decoder_error(the_decoder()));
                            char what[160];
                            snprintf(what, sizeof what, "%s %dx%d cfg %d %s isa %d relay %d", gens[g].name, sizes[s][0],
                                     sizes[s][1], c, o ? "dct" : "full", isa, use_relay);
                            assert_int_equal(ow, w);
                            assert_int_equal(oh, h);
                            check_same(what, out, ref, (size_t)3 * w * h);
                            prism_free(out);
                            cases++;
                        }
                    prism_free(ref);
                }
            }
            prism_free(f);
        }
    print_message("bit identity: %zu cases\n", cases);
    assert_true(cases > (HEAVY ? 300 : 60));
}

/* The whole-image API is the streaming decoder with a storing sink: same pixels as the libraries'
 * whole-image decodes, DCT-scaled or not. */
static void test_whole_decode_matches_reference(void **state)
{
    uint32_t seed = 99;
    for (size_t g = 0; g < PRISM_ARRAY_LEN(gens); g++) {
        size_t len;
        uint8_t *f = gen_file(&gens[g], HEAVY ? 501 : 201, HEAVY ? 377 : 137, seed++, &len);
        for (int scaled = 0; scaled < 2; scaled++) {
            prism_image_decode_opts_t o = {.min_w = scaled ? 60 : 0, .min_h = scaled ? 40 : 0};
            prism_image_t a, b;
            int rc = prism_image_decode(f, len, &o, &a);
            if (rc != PRISM_OK)
                fail_msg("%s: %s", gens[g].name, prism_strerror(rc));
            assert_int_equal(ig_ref_decode(f, len, a.scale_num, a.scale_denom, &b), PRISM_OK);
            assert_int_equal(a.w, b.w);
            assert_int_equal(a.h, b.h);
            if (memcmp(a.rgb, b.rgb, (size_t)a.w * a.h * 3) != 0)
                fail_msg("%s scaled %d: pixels differ from the whole-image decode", gens[g].name, scaled);
            if (scaled && gens[g].jpeg)
                assert_true(a.w < (HEAVY ? 501 : 201));
            prism_image_free(&a);
            prism_image_free(&b);
        }
        prism_free(f);
    }
}

/* ---------------------------------------------------------------- memory */

static int drop_row(void *ud, int y, const uint8_t *rgb) { return PRISM_OK; }

static size_t region_used(const uint8_t *f, size_t len)
{
    prism_image_sink_t sink = {.row = drop_row};
    int rc = prism_image_decoder_run(the_decoder(), f, len, NULL, &sink);
    if (rc != PRISM_OK)
        fail_msg("decode: %s (%s)", prism_strerror(rc), prism_image_decoder_error(the_decoder()));
    return prism_image_decoder_last_bytes(the_decoder());
}

/* Decode memory is O(width) for everything that streams, whatever the height, sampling or color
 * space, and within the bound the plan uses; multi-scan JPEG adds exactly its coefficients. */
static size_t round_to(size_t a, size_t b) { return (a + b - 1) / b * b; }

/* Coefficient bytes libjpeg keeps for a multi-scan image (its whole-image virtual arrays). */
static size_t coef_bytes(int w, int h, int n, const int s[4][2])
{
    int mh = 1, mv = 1;
    for (int i = 0; i < n; i++) {
        mh = PRISM_MAX(mh, s[i][0]);
        mv = PRISM_MAX(mv, s[i][1]);
    }
    size_t t = 0;
    for (int i = 0; i < n; i++) {
        size_t wib = round_to((size_t)w * s[i][0], (size_t)8 * mh) / (8 * (size_t)mh);
        size_t hib = round_to((size_t)h * s[i][1], (size_t)8 * mv) / (8 * (size_t)mv);
        t += round_to(wib, (size_t)s[i][0]) * round_to(hib, (size_t)s[i][1]) * 128;
    }
    return t;
}

/* Decode memory is O(width) for everything that streams, whatever the height, sampling or color
 * space, and within the bound the plan uses; multi-scan JPEG adds exactly its coefficients. */
static void test_decode_memory_bounds(void **state)
{
    typedef struct {
        int n;
        J_COLOR_SPACE in, js;
        int s[4][2];
    } lay_t;
    /* single-scan layouts: at most 10 blocks per MCU */
    const lay_t single[] = {
        {3, JCS_RGB, JCS_YCbCr, {{1, 1}, {1, 1}, {1, 1}}}, {3, JCS_RGB, JCS_YCbCr, {{2, 1}, {1, 1}, {1, 1}}},
        {3, JCS_RGB, JCS_YCbCr, {{1, 2}, {1, 1}, {1, 1}}}, {3, JCS_RGB, JCS_YCbCr, {{2, 2}, {1, 1}, {1, 1}}},
        {3, JCS_RGB, JCS_YCbCr, {{4, 1}, {1, 1}, {1, 1}}}, {3, JCS_RGB, JCS_YCbCr, {{1, 4}, {1, 1}, {1, 1}}},
        {3, JCS_RGB, JCS_YCbCr, {{4, 2}, {1, 1}, {1, 1}}}, {3, JCS_RGB, JCS_YCbCr, {{2, 4}, {1, 1}, {1, 1}}},
        {3, JCS_RGB, JCS_YCbCr, {{2, 2}, {2, 1}, {1, 2}}}, {3, JCS_RGB, JCS_YCbCr, {{1, 1}, {2, 4}, {1, 1}}},
        {4, JCS_CMYK, JCS_CMYK, {{1, 1}, {1, 1}, {1, 1}, {1, 1}}},
        {4, JCS_CMYK, JCS_YCCK, {{2, 2}, {1, 1}, {1, 1}, {2, 2}}},
        {4, JCS_CMYK, JCS_YCCK, {{1, 4}, {4, 1}, {1, 1}, {1, 1}}},
        {4, JCS_CMYK, JCS_CMYK, {{1, 4}, {1, 2}, {1, 2}, {1, 2}}},
        {4, JCS_CMYK, JCS_CMYK, {{2, 2}, {2, 2}, {1, 1}, {1, 1}}},
        {4, JCS_CMYK, JCS_CMYK, {{1, 4}, {1, 4}, {1, 1}, {1, 1}}},
        {3, JCS_RGB, JCS_YCbCr, {{1, 4}, {1, 4}, {1, 2}}},
        {1, JCS_GRAYSCALE, JCS_GRAYSCALE, {{1, 1}}},
    };
    /* multi-scan layouts (one component per scan): any factors up to 4x4 */
    const lay_t multi[] = {
        {4, JCS_CMYK, JCS_CMYK, {{4, 4}, {4, 4}, {4, 4}, {4, 4}}},
        {4, JCS_CMYK, JCS_CMYK, {{4, 4}, {1, 1}, {1, 1}, {4, 4}}},
        {3, JCS_RGB, JCS_YCbCr, {{4, 4}, {1, 1}, {1, 1}}},
        {4, JCS_CMYK, JCS_YCCK, {{1, 4}, {4, 1}, {1, 4}, {4, 1}}},
        {4, JCS_CMYK, JCS_CMYK, {{4, 4}, {4, 4}, {4, 4}, {4, 2}}},
    };
    int widths[] = {61, 1021, 2048};
    size_t worst_single = 0, worst_multi = 0, prev[PRISM_ARRAY_LEN(single) + PRISM_ARRAY_LEN(multi)] = {0};
    for (size_t wi = 0; wi < PRISM_ARRAY_LEN(widths); wi++) {
        int w = widths[wi], h = 40;
        for (size_t k = 0; k < PRISM_ARRAY_LEN(single) + PRISM_ARRAY_LEN(multi); k++) {
            bool ms = k >= PRISM_ARRAY_LEN(single);
            const lay_t *L = ms ? &multi[k - PRISM_ARRAY_LEN(single)] : &single[k];
            ig_jpeg_t o = {.comps = L->n, .in_cs = L->in, .jpeg_cs = L->js};
            memcpy(o.samp, L->s, sizeof L->s);
            jpeg_scan_info sc[8];
            if (ms) {
                int ns = 0;
                for (int i = 0; i < L->n; i++)
                    sc[ns++] = (jpeg_scan_info){1, {i}, 0, 0, 0, 0};
                for (int i = 0; i < L->n; i++)
                    sc[ns++] = (jpeg_scan_info){1, {i}, 1, 63, 0, 0};
                o.scans = sc;
                o.n_scans = ns;
            }
            uint8_t *pix = ig_pixels(w, h, L->n, (uint32_t)k + 1);
            size_t len;
            uint8_t *f = ig_jpeg(pix, w, h, &o, &len);
            size_t used = region_used(f, len), rows = used - (ms ? coef_bytes(w, h, L->n, L->s) : 0);
            size_t bound = prism_image_jpeg_stream_bytes(w, ms);
            if (rows > bound)
                fail_msg("width %d layout %zu: %zu bytes of rows > bound %zu", w, k, rows, bound);
            if (wi) {   /* slope between the widths: bytes per column */
                size_t slope = (rows - prev[k]) / (size_t)(w - widths[wi - 1]);
                *(ms ? &worst_multi : &worst_single) = PRISM_MAX(*(ms ? &worst_multi : &worst_single), slope);
            }
            prev[k] = rows;
            prism_free(f);
            prism_free(pix);
        }
        /* PNG: the widest rows (16-bit RGBA, metadata dropped); interlaced needs the image on top */
        ig_png_t pn = {SPNG_COLOR_TYPE_TRUECOLOR_ALPHA, 16, false, false, true};
        size_t len;
        uint8_t *f = ig_png(w, 50, &pn, 3, &len);
        size_t used = region_used(f, len);
        assert_true(used <= prism_image_png_stream_bytes(w));
        prism_free(f);
        pn.interlace = true;
        f = ig_png(w, 50, &pn, 3, &len);
        used = region_used(f, len);
        assert_true(used <= prism_image_png_stream_bytes(w) + (size_t)w * 50 * 3 + 256);
        assert_true(used >= (size_t)w * 50 * 3);
        prism_free(f);
    }
    print_message("JPEG rows: at most %zu bytes per column single-scan, %zu multi-scan\n", worst_single, worst_multi);

    /* height does not matter for what streams */
    uint8_t *pix = ig_pixels(512, 2000, 3, 9);
    ig_jpeg_t o = {.comps = 3, .in_cs = JCS_RGB, .jpeg_cs = JCS_YCbCr};
    size_t l1, l2;
    uint8_t *tall = ig_jpeg(pix, 512, 2000, &o, &l1);
    uint8_t *flat = ig_jpeg(pix, 512, 20, &o, &l2);
    assert_int_equal(region_used(tall, l1), region_used(flat, l2));
    prism_free(tall);
    prism_free(flat);
    /* a progressive file holds its coefficients: 2 bytes per sample, 4:2:0 -> 3 bytes per pixel */
    o.progressive = true;
    uint8_t *prog = ig_jpeg(pix, 512, 2000, &o, &l1);
    size_t used = region_used(prog, l1);
    assert_true(used >= (size_t)512 * 2000 * 3);
    assert_true(used <= (size_t)512 * 2000 * 3 + prism_image_jpeg_stream_bytes(512, true));
    prism_free(prog);
    prism_free(pix);
}

/* The encoder's sizing: a decoder without whole-image memory streams a 4096-wide baseline JPEG in
 * well under a MiB and refuses a progressive one with a message that names the need. */
static void test_decoder_sizing(void **state)
{
    int w = 4096, h = 256;
    uint8_t *pix = ig_pixels(w, h, 3, 4);
    ig_jpeg_t o = {.comps = 3, .in_cs = JCS_RGB, .jpeg_cs = JCS_YCbCr};
    size_t lb, lp;
    uint8_t *base = ig_jpeg(pix, w, h, &o, &lb);
    o.progressive = true;
    uint8_t *prog = ig_jpeg(pix, w, h, &o, &lp);
    prism_image_decoder_t *d;
    size_t bytes = prism_image_decoder_bytes(w, 0);
    assert_true(bytes < (size_t)2 << 20);
    assert_int_equal(prism_image_decoder_create(bytes, &d), PRISM_OK);
    prism_image_sink_t sink = {.row = drop_row};
    uint64_t allocs = prism_mem_alloc_count();
    int rc = prism_image_decoder_run(d, base, lb, NULL, &sink);
    if (rc != PRISM_OK)
        fail_msg("%s: %s", prism_strerror(rc), prism_image_decoder_error(d));
    assert_true(prism_image_decoder_last_bytes(d) < (size_t)1 << 20);
    assert_int_equal(prism_image_decoder_run(d, prog, lp, NULL, &sink), PRISM_ELIMIT);
    const char *why = prism_image_decoder_error(d);
    assert_non_null(strstr(why, "progressive JPEG needs"));
    assert_non_null(strstr(why, "MiB"));
    assert_int_equal(prism_mem_alloc_count(), allocs);
    /* and the baseline one still decodes after the refusal */
    assert_int_equal(prism_image_decoder_run(d, base, lb, NULL, &sink), PRISM_OK);
    prism_image_decoder_destroy(d);
    /* with whole-image memory for its pixels, a progressive (square) image fits */
    prism_free(prog);
    prog = ig_jpeg(pix, 1024, 1024, &o, &lp);   /* pix holds 4096 x 256 = 1024 x 1024 pixels */
    assert_int_equal(prism_image_decoder_create(prism_image_decoder_bytes(w, 1024 * 1024), &d), PRISM_OK);
    rc = prism_image_decoder_run(d, prog, lp, NULL, &sink);
    if (rc != PRISM_OK)
        fail_msg("%s: %s", prism_strerror(rc), prism_image_decoder_error(d));
    prism_image_decoder_destroy(d);
    prism_free(base);
    prism_free(prog);
    prism_free(pix);
}

/* ---------------------------------------------------------------- scans */

/* Grayscale progressive script of n scans, each covering every block: DC, then one AC coefficient
 * per scan, then refinements. */
static int gray_script(jpeg_scan_info *s, int n)
{
    int k = 0;
    s[k++] = (jpeg_scan_info){1, {0}, 0, 0, 0, 1};   /* DC, first pass at Al = 1 */
    for (int c = 1; c <= 63 && k < n - 1; c++)
        s[k++] = (jpeg_scan_info){1, {0}, c, c, 0, 1};
    s[k++] = (jpeg_scan_info){1, {0}, 0, 0, 1, 0};   /* DC refinement */
    for (int c = 1; c <= 63 && k < n; c++)
        s[k++] = (jpeg_scan_info){1, {0}, c, c, 1, 0};
    return k;
}

/* Luma 4x4, chroma 1x1 (1/16 of the luma blocks each): n scans that cover few blocks each. */
static int chroma_script(jpeg_scan_info *s, int n)
{
    int k = 0;
    for (int ci = 0; ci < 3; ci++)
        s[k++] = (jpeg_scan_info){1, {ci}, 0, 0, 0, 0};
    for (int c = 1; c <= 63 && k < n; c++) {
        s[k++] = (jpeg_scan_info){1, {1}, c, c, 0, 0};
        if (k < n)
            s[k++] = (jpeg_scan_info){1, {2}, c, c, 0, 0};
    }
    return k;
}

static void test_scan_limits(void **state)
{
    int w = 1024, h = 1024;
    uint8_t *gray = ig_pixels(w, h, 1, 6), *color = ig_pixels(w, h, 3, 7);
    jpeg_scan_info scans[128];
    prism_image_sink_t sink = {.row = drop_row};
    struct {
        bool chroma;
        int n, rc;
        const char *why;
    } cases[] = {
        {false, PRISM_IMAGE_MAX_JPEG_PASSES, PRISM_OK, NULL},
        {false, PRISM_IMAGE_MAX_JPEG_PASSES + 1, PRISM_ELIMIT, "revisit"},    /* every scan covers everything */
        {false, 120, PRISM_ELIMIT, "revisit"},
        {true, PRISM_IMAGE_MAX_JPEG_SCANS, PRISM_OK, NULL},
        {true, PRISM_IMAGE_MAX_JPEG_SCANS + 1, PRISM_ELIMIT, "more than 64 scans"},   /* cheap scans */
    };
    double t_ok = 0;
    for (size_t i = 0; i < PRISM_ARRAY_LEN(cases); i++) {
        ig_jpeg_t o = {.comps = 1, .in_cs = JCS_GRAYSCALE, .jpeg_cs = JCS_GRAYSCALE};
        if (cases[i].chroma) {
            o = (ig_jpeg_t){.comps = 3, .in_cs = JCS_RGB, .jpeg_cs = JCS_YCbCr, .samp = {{4, 4}, {1, 1}, {1, 1}}};
            o.n_scans = chroma_script(scans, cases[i].n);
        } else {
            o.n_scans = gray_script(scans, cases[i].n);
        }
        assert_int_equal(o.n_scans, cases[i].n);
        o.scans = scans;
        size_t len;
        uint8_t *f = ig_jpeg(cases[i].chroma ? color : gray, w, h, &o, &len);
        double t0 = prism_now_s();
        int rc = prism_image_decoder_run(the_decoder(), f, len, NULL, &sink);
        double t = prism_now_s() - t0;
        if (rc != cases[i].rc)
            fail_msg("case %zu: %s (%s)", i, prism_strerror(rc), prism_image_decoder_error(the_decoder()));
        if (rc == PRISM_OK) {
            t_ok = PRISM_MAX(t_ok, t);
        } else {
            assert_non_null(strstr(prism_image_decoder_error(the_decoder()), cases[i].why));
            /* refused as the limit is crossed: never more than the cost of the allowed maximum */
            if (!(t < 2 * t_ok + 0.05))
                fail_msg("case %zu refused after %.3f s; the allowed maximum decoded in %.3f s", i, t, t_ok);
        }
        prism_free(f);
    }
    prism_free(gray);
    prism_free(color);
}

/* ---------------------------------------------------------------- isolation */

/* Drops DQT and DHT segments: an abbreviated image that must not borrow an earlier image's tables. */
static size_t strip_tables(const uint8_t *d, size_t n, uint8_t *out)
{
    size_t i = 2, o = 2;
    memcpy(out, d, 2);
    while (i + 4 <= n && d[i] == 0xFF) {
        uint8_t m = d[i + 1];
        size_t seg = (size_t)d[i + 2] << 8 | d[i + 3];
        if (m == 0xDA)
            break;
        if (m != 0xDB && m != 0xC4) {
            memcpy(out + o, d + i, seg + 2);
            o += seg + 2;
        }
        i += seg + 2;
    }
    memcpy(out + o, d + i, n - i);
    return o + n - i;
}

static void test_decoder_isolation(void **state)
{
    prism_clip_preproc_t p;
    prism_clip_preproc_default(&p, 112);
    uint8_t *pix = ig_pixels(300, 200, 3, 12);
    ig_jpeg_t o = {.comps = 3, .in_cs = JCS_RGB, .jpeg_cs = JCS_YCbCr, .quality = 30};
    size_t la, lb;
    uint8_t *a = ig_jpeg(pix, 300, 200, &o, &la);
    o.quality = 95;
    uint8_t *b = ig_jpeg(pix, 300, 200, &o, &lb);
    uint8_t *bare = prism_malloc(lb);
    size_t lbare = strip_tables(b, lb, bare);
    assert_true(lbare < lb);
    /* what a fresh decoder makes of the abbreviated file */
    prism_image_t fresh;
    int fresh_rc = prism_image_decode(bare, lbare, NULL, &fresh);
    prism_image_free(&fresh);
    /* after another image on the long-lived decoder: the same verdict, never a borrowed table */
    float *out;
    int w, h;
    assert_int_equal(stream_pre(&p, a, la, NULL, false, &out, &w, &h), PRISM_OK);
    prism_free(out);
    int rc = stream_pre(&p, bare, lbare, NULL, false, &out, &w, &h);
    assert_int_equal(rc, fresh_rc);
    assert_int_not_equal(rc, PRISM_OK);
    if (rc == PRISM_OK)
        prism_free(out);
    /* after failures of every kind, a good image comes out exactly as from a fresh decode */
    float *ref = ref_pre(&p, b, lb, NULL);
    const uint8_t junk[] = {0xFF, 0xD8, 0xFF, 0xDB, 0x00, 0x43, 0x00, 1, 2, 3};
    int bad_rc = stream_pre(&p, junk, sizeof junk, NULL, true, &out, &w, &h);
    assert_int_not_equal(bad_rc, PRISM_OK);
    bad_rc = stream_pre(&p, b, lb / 2, NULL, true, &out, &w, &h);
    assert_int_equal(bad_rc, PRISM_ECORRUPT);
    assert_int_equal(stream_pre(&p, b, lb, NULL, true, &out, &w, &h), PRISM_OK);
    check_same("after failures", out, ref, (size_t)3 * w * h);
    prism_free(out);
    prism_free(ref);
    prism_free(bare);
    prism_free(a);
    prism_free(b);
    prism_free(pix);
}

/* A sink that fails midway: the relay stops feeding it, the decode reports that error, and the
 * next image is whole again. */
static int fail_after;
static int failing_row(void *ud, int y, const uint8_t *rgb) { return y >= fail_after ? PRISM_ELIMIT : PRISM_OK; }
static int count_row(void *ud, int y, const uint8_t *rgb)
{
    (*(int *)ud)++;
    return PRISM_OK;
}

static void test_relay_errors(void **state)
{
    uint8_t *pix = ig_pixels(640, 480, 3, 2);
    ig_jpeg_t o = {.comps = 3, .in_cs = JCS_RGB, .jpeg_cs = JCS_YCbCr};
    size_t len;
    uint8_t *f = ig_jpeg(pix, 640, 480, &o, &len);
    fail_after = 100;
    prism_image_sink_t bad = {.row = failing_row};
    prism_image_sink_t s = prism_image_relay_sink(the_relay(), &bad);
    assert_int_equal(prism_image_decoder_run(the_decoder(), f, len, NULL, &s), PRISM_ELIMIT);
    int rows = 0;
    prism_image_sink_t good = {.row = count_row, .ud = &rows};
    s = prism_image_relay_sink(the_relay(), &good);
    assert_int_equal(prism_image_decoder_run(the_decoder(), f, len, NULL, &s), PRISM_OK);
    assert_int_equal(rows, 480);
    /* a decode failing after rows were handed over (truncated data) drains the relay */
    rows = 0;
    assert_int_equal(prism_image_decoder_run(the_decoder(), f, len * 3 / 4, NULL, &s), PRISM_ECORRUPT);
    assert_true(rows < 480);
    rows = 0;
    assert_int_equal(prism_image_decoder_run(the_decoder(), f, len, NULL, &s), PRISM_OK);
    assert_int_equal(rows, 480);
    prism_free(f);
    prism_free(pix);
}

/* ---------------------------------------------------------------- kernels */

typedef struct {
    uint8_t *out;
    int wx, y0;
} cap_t;

static int capture(void *ud, int y, const uint8_t *const planes[3])
{
    cap_t *c = ud;
    for (int k = 0; k < 3; k++)
        memcpy(c->out + ((size_t)(y - c->y0) * 3 + k) * c->wx, planes[k], (size_t)c->wx);
    return PRISM_OK;
}

/* Random geometries, filters and arithmetic: the SSE2 and AVX2 kernels produce the scalar
 * kernel's bytes, and the exact workspace never exceeds what workspace_bytes says. */
static void test_resample_kernels_agree(void **state)
{
    uint32_t s = 12345;
    for (int it = 0; it < (HEAVY ? 300 : 100); it++) {
        prism_resample_spec_t sp = {0};
        sp.filter = ig_rand(&s) % 2 ? &prism_resample_bicubic : &prism_resample_bilinear;
        sp.arith = ig_rand(&s) % 2 ? PRISM_RESAMPLE_TORCH : PRISM_RESAMPLE_PIL;
        sp.in_w = 1 + (int)(ig_rand(&s) % 700);
        sp.in_h = 1 + (int)(ig_rand(&s) % 300);
        sp.out_w = 1 + (int)(ig_rand(&s) % 400);
        sp.out_h = 1 + (int)(ig_rand(&s) % 400);
        if (it % 5 == 0)
            sp.out_w = sp.in_w;   /* identity on one axis */
        if (it % 7 == 0)
            sp.out_h = sp.in_h;
        sp.extent_w = it % 3 == 0 ? sp.in_w - (ig_rand(&s) % 100) / 101.0 : sp.in_w;
        sp.extent_h = sp.in_h;
        sp.x0 = (int)(ig_rand(&s) % (unsigned)sp.out_w);
        sp.x1 = sp.x0 + 1 + (int)(ig_rand(&s) % (unsigned)(sp.out_w - sp.x0));
        sp.y0 = (int)(ig_rand(&s) % (unsigned)sp.out_h);
        sp.y1 = sp.y0 + 1 + (int)(ig_rand(&s) % (unsigned)(sp.out_h - sp.y0));
        size_t n = prism_resample_workspace_bytes(&sp);
        assert_true(n > 0);
        uint8_t *src = ig_pixels(sp.in_w, sp.in_h, 3, (uint32_t)it + 1);
        int wx = sp.x1 - sp.x0, wy = sp.y1 - sp.y0;
        uint8_t *outs[3];
        for (int isa = 1; isa <= 3; isa++) {
            void *ws = prism_malloc(n);
            cap_t c = {.out = prism_malloc((size_t)wx * wy * 3), .wx = wx, .y0 = sp.y0};
            int old = prism_resample_force_isa(isa);
            prism_resample_t r;
            assert_int_equal(prism_resample_init(&r, &sp, ws, n - 1, capture, &c), PRISM_ELIMIT);
            assert_int_equal(prism_resample_init(&r, &sp, ws, n, capture, &c), PRISM_OK);
            for (int y = 0; y < sp.in_h; y++)
                assert_int_equal(prism_resample_push(&r, src + (size_t)y * sp.in_w * 3), PRISM_OK);
            assert_true(prism_resample_done(&r));
            assert_int_equal(prism_resample_push(&r, src), PRISM_EINVAL);
            prism_resample_force_isa(old);
            outs[isa - 1] = c.out;
            prism_free(ws);
        }
        for (int isa = 2; isa <= 3; isa++)
            if (memcmp(outs[0], outs[isa - 1], (size_t)wx * wy * 3) != 0)
                fail_msg("iteration %d: isa %d differs from scalar (%dx%d -> %dx%d, %s, %s)", it, isa, sp.in_w, sp.in_h,
                         sp.out_w, sp.out_h, sp.filter->name, sp.arith == PRISM_RESAMPLE_TORCH ? "torch" : "pil");
        for (int k = 0; k < 3; k++)
            prism_free(outs[k]);
        prism_free(src);
    }
}

/* The encoder's one workspace covers every image it accepts. */
static void test_workspace_bound_covers(void **state)
{
    prism_clip_preproc_t ps[4];
    prism_clip_preproc_default(&ps[0], 336);
    prism_clip_preproc_default(&ps[1], 224);
    ps[1].impl = PRISM_CLIP_RESAMPLE_PIL;
    load_cfg("pad", &ps[2], PRISM_CLIP_RESAMPLE_TORCHVISION);
    prism_clip_preproc_default(&ps[3], 336);
    ps[3].shortest_edge = 0;   /* fixed-size resize */
    ps[3].resize_w = 300;
    ps[3].resize_h = 200;
    uint64_t maxpx = 4096ull * 4096;
    uint32_t s = 77;
    for (size_t k = 0; k < PRISM_ARRAY_LEN(ps); k++) {
        size_t bound = prism_clip_workspace_bound(&ps[k], maxpx);
        assert_true(bound > 0 && bound < (size_t)8 << 20);
        for (int it = 0; it < 3000; it++) {
            int w = 1 + (int)(ig_rand(&s) % 65535), h = 1 + (int)(ig_rand(&s) % 65535);
            if (it % 4 == 0)
                h = (int)PRISM_MIN(65535u, maxpx / (uint64_t)w);   /* as large as allowed */
            if ((uint64_t)w * h > maxpx)
                continue;
            prism_image_t g = {.w = w, .h = h, .src_w = w, .src_h = h, .scale_num = 1, .scale_denom = 1};
            size_t need = prism_clip_preprocess_workspace_bytes_img(&ps[k], &g);
            if (need > bound)
                fail_msg("config %zu, %dx%d: needs %zu > bound %zu", k, w, h, need, bound);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stream_goldens),
        cmocka_unit_test(test_stream_bit_identity),
        cmocka_unit_test(test_whole_decode_matches_reference),
        cmocka_unit_test(test_decode_memory_bounds),
        cmocka_unit_test(test_decoder_sizing),
        cmocka_unit_test(test_scan_limits),
        cmocka_unit_test(test_decoder_isolation),
        cmocka_unit_test(test_relay_errors),
        cmocka_unit_test(test_resample_kernels_agree),
        cmocka_unit_test(test_workspace_bound_covers),
    };
    if (getenv("PRISM_TEST_FILTER"))
        cmocka_set_test_filter(getenv("PRISM_TEST_FILTER"));
    int rc = cmocka_run_group_tests_name("image_stream", tests, setup, teardown);
    prism_image_relay_destroy(relay);
    prism_image_decoder_destroy(dec);
    return rc;
}
