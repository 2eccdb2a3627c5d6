/* CLIP preprocessing against transformers' goldens (tools/gen_image_goldens.py). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>

#include "image/clip.h"
#include "image/image.h"
#include "image_test_util.h"

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

static void load_cfg(const char *which, prism_clip_preproc_t *p, prism_clip_resample_impl_t impl)
{
    char path[1200], err[256];
    snprintf(path, sizeof path, "%s/preprocessor_config_%s.json", itu_data_dir(), which);
    int rc = prism_clip_preproc_load(path, p, err, sizeof err);
    if (rc != PRISM_OK)
        fail_msg("%s: %s", path, err);
    p->impl = impl;
}

/* Decodes fixture `file` and preprocesses it; returns a prism_malloc'd [3][h][w] array. */
static float *run(const prism_clip_preproc_t *p, const char *file, const prism_image_decode_opts_t *o,
                  int *ow, int *oh)
{
    size_t len;
    uint8_t *data = itu_read(file, &len);
    prism_image_t img;
    int rc = prism_image_decode(data, len, o, &img);
    if (rc != PRISM_OK)
        fail_msg("%s: decode %s", file, prism_strerror(rc));
    prism_clip_output_size(p, img.src_w, img.src_h, ow, oh);
    size_t ws = prism_clip_preprocess_workspace_bytes(p, img.w, img.h);
    size_t exact = prism_clip_preprocess_workspace_bytes_img(p, &img);
    assert_true(exact > 0 && exact <= ws);
    if (img.w != img.src_w)
        ws = exact;   /* DCT-scaled: the exact size must be enough on its own */
    void *w = prism_malloc(ws);
    float *out = prism_malloc((size_t)3 * *ow * *oh * sizeof(float));
    rc = prism_clip_preprocess(p, &img, w, ws, out);
    if (rc != PRISM_OK)
        fail_msg("%s: preprocess %s", file, prism_strerror(rc));
    prism_free(w);
    prism_image_free(&img);
    prism_free(data);
    return out;
}

typedef struct {
    double max_abs, mean_abs;
    size_t n_diff;
} diff_t;

static diff_t compare(const float *a, const float *b, size_t n)
{
    diff_t d = {0};
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - (double)b[i]);
        d.max_abs = fmax(d.max_abs, e);
        d.mean_abs += e;
        d.n_diff += e > 0;
    }
    d.mean_abs /= (double)n;
    return d;
}

static void test_config_load(void **state)
{
    prism_clip_preproc_t p;
    load_cfg("336", &p, PRISM_CLIP_RESAMPLE_PIL);
    assert_int_equal(p.shortest_edge, 336);
    assert_int_equal(p.crop_h, 336);
    assert_int_equal(p.crop_w, 336);
    assert_true(p.do_resize && p.do_center_crop && p.do_rescale && p.do_normalize && p.do_convert_rgb);
    assert_int_equal(p.filter, PRISM_CLIP_FILTER_BICUBIC);
    prism_clip_preproc_t q;
    char e2[64];
    char cfg[1200];
    snprintf(cfg, sizeof cfg, "%s/preprocessor_config_336.json", itu_data_dir());
    assert_int_equal(prism_clip_preproc_load(cfg, &q, e2, sizeof e2), PRISM_OK);
    assert_int_equal(q.impl, PRISM_CLIP_RESAMPLE_TORCHVISION);   /* what vLLM's transformers runs */
    assert_true(fabsf(p.mean[0] - 0.48145466f) < 1e-7f);
    assert_true(fabsf(p.std[2] - 0.27577711f) < 1e-7f);
    assert_true(p.rescale_factor_f64 == 0.00392156862745098);

    /* variants seen in older / other checkpoints, and invalid ones */
    struct { const char *json; int rc; int se, rh, rw, ch, cw; } cases[] = {
        {"{\"size\": 224, \"crop_size\": 224}", PRISM_OK, 224, 0, 0, 224, 224},
        {"{\"size\": {\"height\": 300, \"width\": 200}, \"crop_size\": {\"height\": 100, \"width\": 120}}",
         PRISM_OK, 0, 300, 200, 100, 120},
        {"{}", PRISM_OK, 224, 0, 0, 224, 224},
        {"{\"resample\": 2}", PRISM_OK, 224, 0, 0, 224, 224},
        {"{\"resample\": 1}", PRISM_ENOTSUP},
        {"{\"size\": {\"shortest_edge\": 224, \"longest_edge\": 500}}", PRISM_ENOTSUP},
        {"{\"size\": 0}", PRISM_EINVAL},
        {"{\"size\": \"big\"}", PRISM_EINVAL},
        {"{\"crop_size\": {\"height\": 100}}", PRISM_EINVAL},
        {"{\"image_std\": [0.2, 0, 0.3]}", PRISM_EINVAL},
        {"{\"image_mean\": [0.2, 0.3]}", PRISM_EINVAL},
        {"{\"do_resize\": \"yes\"}", PRISM_EINVAL},
        {"{\"rescale_factor\": -1}", PRISM_EINVAL},
        {"[1, 2]", PRISM_EINVAL},
        {"{\"size\": 224,", PRISM_EINVAL},
        {"{\"size\": {\"shortest_edge\": 70000}}", PRISM_EINVAL},
    };
    const char *bin = getenv("PRISM_BINARY_DIR");
    char path[1200];
    snprintf(path, sizeof path, "%s/test_image_clip_cfg.json", bin && bin[0] ? bin : PRISM_BINARY_DIR);
    for (size_t i = 0; i < PRISM_ARRAY_LEN(cases); i++) {
        FILE *f = fopen(path, "w");
        assert_non_null(f);
        fputs(cases[i].json, f);
        fclose(f);
        char err[256];
        int rc = prism_clip_preproc_load(path, &p, err, sizeof err);
        if (rc != cases[i].rc)
            fail_msg("%s: got %s (%s)", cases[i].json, prism_strerror(rc), err);
        if (rc == PRISM_OK) {
            assert_int_equal(p.shortest_edge, cases[i].se);
            assert_int_equal(p.resize_h, cases[i].rh);
            assert_int_equal(p.resize_w, cases[i].rw);
            assert_int_equal(p.crop_h, cases[i].ch);
            assert_int_equal(p.crop_w, cases[i].cw);
        } else {
            assert_true(strlen(err) > 0);
        }
    }
    remove(path);
    char err[256];
    assert_int_not_equal(prism_clip_preproc_load("/nonexistent/x.json", &p, err, sizeof err), PRISM_OK);

    /* the project's shipped tiny model, when present */
    const char *src = getenv("PRISM_SOURCE_DIR");
    snprintf(path, sizeof path, "%s/models/prism-tiny-llava/preprocessor_config.json", src && src[0] ? src : PRISM_SOURCE_DIR);
    FILE *f = fopen(path, "r");
    if (f) {
        fclose(f);
        assert_int_equal(prism_clip_preproc_load(path, &p, err, sizeof err), PRISM_OK);
        assert_int_equal(p.shortest_edge, 112);
        assert_int_equal(p.crop_w, 112);
    }
}

/* Expected values: transformers get_resize_output_image_size(default_to_square=False). */
static void test_resize_target(void **state)
{
    struct { int se, w, h, ew, eh; } c[] = {
        {336, 640, 480, 448, 336},   {336, 480, 640, 336, 448},   {336, 64, 64, 336, 336},
        {64, 333, 217, 98, 64},      {336, 1500, 1001, 503, 336}, {336, 2048, 1024, 672, 336},
        {224, 1024, 2048, 224, 448}, {336, 97, 61, 534, 336},     {336, 65535, 1, 0, 0},
        {336, 3, 1000, 0, 0},
    };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(c); i++) {
        prism_clip_preproc_t p;
        prism_clip_preproc_default(&p, c[i].se);
        int w = 0, h = 0;
        int rc = prism_clip_resize_target(&p, c[i].w, c[i].h, &w, &h);
        if (c[i].ew == 0) {
            assert_int_equal(rc, PRISM_ELIMIT);   /* long side would exceed 65535 */
            continue;
        }
        assert_int_equal(rc, PRISM_OK);
        assert_int_equal(w, c[i].ew);
        assert_int_equal(h, c[i].eh);
    }
}

/* The PIL path is bit-exact with CLIPImageProcessorPil: 64x64 arrays compared value by value,
 * 224/336 outputs by checksum. */
static void test_goldens_pil(void **state)
{
    prism_clip_preproc_t p64, p224, p336;
    load_cfg("64", &p64, PRISM_CLIP_RESAMPLE_PIL);
    load_cfg("224", &p224, PRISM_CLIP_RESAMPLE_PIL);
    load_cfg("336", &p336, PRISM_CLIP_RESAMPLE_PIL);
    json_t *imgs = json_object_get(manifest, "images");
    size_t i;
    json_t *e;
    json_array_foreach(imgs, i, e) {
        const char *file = itu_str(e, "file");
        size_t used = prism_mem_used();
        int w, h;
        float *out = run(&p64, file, NULL, &w, &h);
        assert_int_equal(w, 64);
        size_t len;
        float *ref = (float *)itu_read(itu_str(e, "pil_64_file"), &len);
        assert_int_equal(len, 3 * 64 * 64 * sizeof(float));
        diff_t d = compare(out, ref, 3 * 64 * 64);
        if (d.n_diff)
            fail_msg("%s @64: %zu values differ, max %.3g mean %.3g", file, d.n_diff, d.max_abs, d.mean_abs);
        prism_free(ref);
        prism_free(out);
        out = run(&p224, file, NULL, &w, &h);
        if (!itu_fnv_matches(e, "pil_224_fnv", out, 3 * 224 * 224 * sizeof(float)))
            fail_msg("%s @224: checksum differs from CLIPImageProcessorPil", file);
        prism_free(out);
        out = run(&p336, file, NULL, &w, &h);
        if (!itu_fnv_matches(e, "pil_336_fnv", out, 3 * 336 * 336 * sizeof(float)))
            fail_msg("%s @336: checksum differs from CLIPImageProcessorPil", file);
        prism_free(out);
        assert_int_equal(prism_mem_used(), used);
    }
}

/* The torchvision mode is bit-exact with the torchvision CLIPImageProcessor (checksums at every
 * size and for the padded crop). Skipped when the fixtures were generated without torchvision. */
static void test_goldens_torchvision(void **state)
{
    if (!json_is_string(json_object_get(manifest, "torchvision"))) {
        skip();
        return;
    }
    const char *cfgs[] = {"64", "224", "336", "pad"};
    int sizes[] = {64, 224, 336, 64};
    json_t *imgs = json_object_get(manifest, "images");
    for (size_t c = 0; c < PRISM_ARRAY_LEN(cfgs); c++) {
        prism_clip_preproc_t p;
        load_cfg(cfgs[c], &p, PRISM_CLIP_RESAMPLE_TORCHVISION);
        char key[32];
        snprintf(key, sizeof key, "tv_%s_fnv", cfgs[c]);
        size_t i;
        json_t *e;
        json_array_foreach(imgs, i, e) {
            const char *file = itu_str(e, "file");
            int w, h;
            float *out = run(&p, file, NULL, &w, &h);
            assert_int_equal(w, sizes[c]);
            if (!itu_fnv_matches(e, key, out, (size_t)3 * w * h * sizeof(float))) {
                /* say how far off we are, against our own PIL mode as a yardstick */
                p.impl = PRISM_CLIP_RESAMPLE_PIL;
                float *alt = run(&p, file, NULL, &w, &h);
                diff_t d = compare(out, alt, (size_t)3 * w * h);
                fail_msg("%s @%s: differs from torchvision CLIPImageProcessor (vs PIL mode: max %.4g)", file, cfgs[c],
                         d.max_abs);
            }
            prism_free(out);
        }
    }
}

static void test_center_crop_padding(void **state)
{
    prism_clip_preproc_t p;
    load_cfg("pad", &p, PRISM_CLIP_RESAMPLE_PIL);
    json_t *imgs = json_object_get(manifest, "images");
    size_t i;
    json_t *e;
    json_array_foreach(imgs, i, e) {
        const char *file = itu_str(e, "file");
        int w, h;
        p.impl = PRISM_CLIP_RESAMPLE_PIL;
        float *out = run(&p, file, NULL, &w, &h);
        assert_int_equal(w, 64);
        if (!itu_fnv_matches(e, "pil_pad_fnv", out, 3 * 64 * 64 * sizeof(float)))
            fail_msg("%s: padded crop differs from CLIPImageProcessorPil", file);
        /* the corner is padding: black, normalized */
        float black = (0.0f - p.mean[0]) / p.std[0];
        assert_true(out[0] == black);
        prism_free(out);
    }
}

static void test_workspace_and_args(void **state)
{
    prism_clip_preproc_t p;
    load_cfg("336", &p, PRISM_CLIP_RESAMPLE_PIL);
    size_t len;
    uint8_t *data = itu_read("jpeg_1500x1001.jpg", &len);
    prism_image_t img;
    assert_int_equal(prism_image_decode(data, len, NULL, &img), PRISM_OK);
    size_t ws = prism_clip_preprocess_workspace_bytes(&p, img.w, img.h);
    void *w = prism_malloc(ws);
    float *out = prism_malloc(3 * 336 * 336 * sizeof(float));
    assert_int_equal(prism_clip_preprocess(&p, &img, w, ws / 4, out), PRISM_ELIMIT);
    assert_int_equal(prism_clip_preprocess(&p, &img, NULL, 0, out), PRISM_ELIMIT);
    assert_int_equal(prism_clip_preprocess(&p, &img, w, ws, NULL), PRISM_EINVAL);
    assert_int_equal(prism_clip_preprocess_workspace_bytes(&p, 0, 10), 0);
    assert_int_equal(prism_clip_preprocess_workspace_bytes(&p, 70000, 10), 0);
    /* the bound stays modest: window columns x source rows, not the whole resized image */
    assert_true(ws < (size_t)4 << 20);
    assert_int_equal(prism_clip_preprocess(&p, &img, w, ws, out), PRISM_OK);
    prism_free(w);
    prism_free(out);
    prism_image_free(&img);
    prism_free(data);
}

/* DCT-scaled decodes keep the full-size geometry and stay close to the full decode; the
 * workspace bound computed from the scaled size is sufficient. */
static void test_dct_scaled_preprocess(void **state)
{
    prism_clip_preproc_t p;
    load_cfg("336", &p, PRISM_CLIP_RESAMPLE_PIL);
    const char *files[] = {"jpeg_2048x2048.jpg", "jpeg_2048x1024.jpg", "jpeg_prog_1024x2048.jpg",
                           "jpeg_1500x1001.jpg", "jpeg_prog_800x600.jpg"};
    for (size_t f = 0; f < PRISM_ARRAY_LEN(files); f++) {
        size_t len;
        uint8_t *data = itu_read(files[f], &len);
        prism_image_info_t info;
        assert_int_equal(prism_image_probe(data, len, &info), PRISM_OK);
        int tw, th;
        assert_int_equal(prism_clip_resize_target(&p, info.width, info.height, &tw, &th), PRISM_OK);
        prism_image_decode_opts_t o = {0}, o2 = {.min_w = 7, .min_h = 7};
        prism_image_decode_opts_for_target(&o, &info, tw, th);
        prism_clip_decode_opts(&p, &info, &o2);
        assert_int_equal(o2.min_w, o.min_w);
        assert_int_equal(o2.min_h, o.min_h);
        p.do_resize = false;
        prism_clip_decode_opts(&p, &info, &o2);
        assert_int_equal(o2.min_w, 0);
        p.do_resize = true;
        int w, h;
        float *full = run(&p, files[f], NULL, &w, &h);
        float *scaled = run(&p, files[f], &o, &w, &h);
        assert_int_equal(w, 336);
        assert_int_equal(h, 336);
        diff_t d = compare(full, scaled, 3 * 336 * 336);
        print_message("%-26s dct min %dx%d: max %.3f mean %.4f\n", files[f], o.min_w, o.min_h, d.max_abs, d.mean_abs);
        if (o.min_w == 0)
            assert_int_equal(d.n_diff, 0);
        else
            /* the fixtures carry a band of 2-px stripes that aliases under DCT scaling; elsewhere
             * the mean is ~0.005-0.008 (see the report in image_measure) */
            assert_true(d.mean_abs < 0.08);
        if (strcmp(files[f], "jpeg_2048x2048.jpg") == 0)
            assert_true(d.mean_abs < 0.01);   /* integer 1/4 scale: well behaved */
        prism_free(full);
        prism_free(scaled);
        prism_free(data);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_config_load),
        cmocka_unit_test(test_resize_target),
        cmocka_unit_test(test_goldens_pil),
        cmocka_unit_test(test_goldens_torchvision),
        cmocka_unit_test(test_center_crop_padding),
        cmocka_unit_test(test_workspace_and_args),
        cmocka_unit_test(test_dct_scaled_preprocess),
    };
    return cmocka_run_group_tests_name("image_clip", tests, setup, teardown);
}
