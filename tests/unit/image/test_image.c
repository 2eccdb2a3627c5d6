/* Probe and decode: every golden fixture, corrupt / truncated / bomb headers, limits, buffers. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "image/image.h"
#include "image/image_internal.h"
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

static bool name_has(const char *file, const char *s) { return strstr(file, s) != NULL; }

static void test_probe_goldens(void **state)
{
    json_t *imgs = json_object_get(manifest, "images");
    assert_true(json_array_size(imgs) >= 20);
    size_t i;
    json_t *e;
    json_array_foreach(imgs, i, e) {
        const char *file = itu_str(e, "file");
        size_t len;
        uint8_t *data = itu_read(file, &len);
        uint64_t allocs = prism_mem_alloc_count();
        prism_image_info_t info;
        int rc = prism_image_probe(data, len, &info);
        assert_int_equal(prism_mem_alloc_count(), allocs);   /* probing never allocates */
        if (rc != PRISM_OK)
            fail_msg("%s: probe %s", file, prism_strerror(rc));
        assert_int_equal(info.width, json_integer_value(json_object_get(e, "width")));
        assert_int_equal(info.height, json_integer_value(json_object_get(e, "height")));
        bool is_png = strcmp(itu_str(e, "format"), "png") == 0;
        assert_int_equal(info.format, is_png ? PRISM_IMAGE_FORMAT_PNG : PRISM_IMAGE_FORMAT_JPEG);
        assert_int_equal(info.progressive, name_has(file, "prog") || name_has(file, "interlaced"));
        bool alpha = name_has(file, "rgba") || name_has(file, "_la_") || name_has(file, "trns") ||
                     name_has(file, "alpha");
        if (info.has_alpha != alpha)
            fail_msg("%s: has_alpha %d", file, info.has_alpha);
        if (name_has(file, "cmyk"))
            assert_true(info.cmyk && info.channels == 4);
        if (name_has(file, "jpeg_gray"))
            assert_int_equal(info.channels, 1);
        if (name_has(file, "16_"))
            assert_int_equal(info.bit_depth, 16);
        if (name_has(file, "palette"))
            assert_true(info.palette);
        prism_free(data);
    }
}

static void test_decode_goldens(void **state)
{
    json_t *imgs = json_object_get(manifest, "images");
    size_t i;
    json_t *e;
    json_array_foreach(imgs, i, e) {
        const char *file = itu_str(e, "file");
        size_t len;
        uint8_t *data = itu_read(file, &len);
        size_t used = prism_mem_used();
        prism_image_t img;
        int rc = prism_image_decode(data, len, NULL, &img);
        if (rc != PRISM_OK)
            fail_msg("%s: decode %s", file, prism_strerror(rc));
        assert_int_equal(img.w, json_integer_value(json_object_get(e, "width")));
        assert_int_equal(img.h, json_integer_value(json_object_get(e, "height")));
        assert_int_equal(img.src_w, img.w);
        assert_true(img.owned);
        if (!itu_fnv_matches(e, "rgb_fnv", img.rgb, (size_t)img.w * img.h * 3))
            fail_msg("%s: decoded pixels differ from PIL's", file);
        prism_image_free(&img);
        assert_null(img.rgb);
        assert_int_equal(prism_mem_used(), used);
        prism_free(data);
    }
}

/* Every (value, alpha) pair composited on white must match PIL's alpha_composite exactly; the
 * fixture's columns are value x, rows alpha y (see the generator). */
static void test_alpha_composite_exhaustive(void **state)
{
    size_t len;
    uint8_t *data = itu_read("png_alpha_all_256x256.png", &len);
    prism_image_t img;
    assert_int_equal(prism_image_decode(data, len, NULL, &img), PRISM_OK);
    for (int a = 0; a < 256; a++)
        for (int v = 0; v < 256; v++) {
            uint8_t got = img.rgb[((size_t)a * 256 + v) * 3];
            assert_int_equal(got, prism_image_over_white((uint8_t)v, (uint8_t)a));
        }
    /* fully transparent -> white, opaque -> unchanged */
    assert_int_equal(img.rgb[(0 * 256 + 10) * 3], 255);
    assert_int_equal(img.rgb[(255 * 256 + 10) * 3], 10);
    prism_image_free(&img);
    prism_free(data);
}

static void test_probe_garbage(void **state)
{
    prism_image_info_t info;
    const uint8_t junk[] = "GIF89a this is not a png or jpeg";
    assert_int_equal(prism_image_probe(junk, sizeof junk, &info), PRISM_ENOTSUP);
    assert_int_equal(prism_image_probe(junk, 0, &info), PRISM_ENOTSUP);
    assert_int_equal(prism_image_probe(NULL, 10, &info), PRISM_EINVAL);
    assert_int_equal(prism_image_probe(junk, 4, NULL), PRISM_EINVAL);
    const uint8_t soi_only[] = {0xFF, 0xD8};
    assert_int_equal(prism_image_probe(soi_only, 2, &info), PRISM_ECORRUPT);
    const uint8_t soi_eoi[] = {0xFF, 0xD8, 0xFF, 0xD9};
    assert_int_equal(prism_image_probe(soi_eoi, 4, &info), PRISM_ECORRUPT);
    const uint8_t bad_seglen[] = {0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x01, 0, 0, 0};
    assert_int_equal(prism_image_probe(bad_seglen, sizeof bad_seglen, &info), PRISM_ECORRUPT);
    const uint8_t seg_past_end[] = {0xFF, 0xD8, 0xFF, 0xE0, 0x40, 0x00, 0, 0, 0};
    assert_int_equal(prism_image_probe(seg_past_end, sizeof seg_past_end, &info), PRISM_ECORRUPT);
    const uint8_t png_sig_cut[] = {0x89, 'P', 'N', 'G'};
    assert_int_equal(prism_image_probe(png_sig_cut, 4, &info), PRISM_ECORRUPT);
    prism_image_t img;
    assert_int_equal(prism_image_decode(junk, sizeof junk, NULL, &img), PRISM_ENOTSUP);
    assert_int_equal(prism_image_decode(soi_eoi, 4, NULL, &img), PRISM_ECORRUPT);
    assert_null(img.rgb);
}

/* Every prefix of every header must probe without crashing; prefixes shorter than the header are
 * ECORRUPT, and the full header region probes OK. */
static void test_probe_truncated_headers(void **state)
{
    const char *files[] = {"jpeg_base_640x480.jpg", "jpeg_prog_800x600.jpg", "jpeg_cmyk_200x150.jpg",
                           "png_rgb_333x222.png", "png_palette_trns_200x200.png", "png_gray_trns_120x120.png"};
    for (size_t f = 0; f < PRISM_ARRAY_LEN(files); f++) {
        size_t len;
        uint8_t *data = itu_read(files[f], &len);
        prism_image_info_t full;
        assert_int_equal(prism_image_probe(data, len, &full), PRISM_OK);
        size_t first_ok = 0;
        for (size_t n = 0; n <= len && n < 4096; n++) {
            prism_image_info_t info;
            /* copy so ASan sees reads past n */
            uint8_t *cut = prism_malloc(n ? n : 1);
            memcpy(cut, data, n);
            int rc = prism_image_probe(cut, n, &info);
            prism_free(cut);
            if (rc == PRISM_OK) {
                if (!first_ok)
                    first_ok = n;
                assert_int_equal(info.width, full.width);
                assert_int_equal(info.height, full.height);
            } else {
                assert_true(rc == PRISM_ECORRUPT || rc == PRISM_ENOTSUP);
                if (first_ok)
                    fail_msg("%s: prefix %zu fails after %zu succeeded", files[f], n, first_ok);
            }
        }
        assert_true(first_ok > 0);
        prism_free(data);
    }
}

/* Junk between segments: libjpeg warns ("extraneous bytes before marker") and PIL accepts it, so
 * probe and decode accept it too and produce the same pixels. */
static void test_jpeg_extraneous_bytes(void **state)
{
    size_t len;
    uint8_t *data = itu_read("jpeg_444_64x64.jpg", &len);
    assert_true(data[2] == 0xFF && data[3] == 0xE0);   /* SOI, APP0 */
    size_t app0 = 4 + (size_t)(data[4] << 8 | data[5]);
    uint8_t *junk = prism_malloc(len + 5);
    memcpy(junk, data, app0);
    memcpy(junk + app0, "junk!", 5);
    memcpy(junk + app0 + 5, data + app0, len - app0);
    prism_image_info_t info;
    assert_int_equal(prism_image_probe(junk, len + 5, &info), PRISM_OK);
    assert_int_equal(info.width, 64);
    prism_image_t a, b;
    assert_int_equal(prism_image_decode(data, len, NULL, &a), PRISM_OK);
    assert_int_equal(prism_image_decode(junk, len + 5, NULL, &b), PRISM_OK);
    assert_memory_equal(a.rgb, b.rgb, 64 * 64 * 3);
    prism_image_free(&a);
    prism_image_free(&b);
    prism_free(junk);
    prism_free(data);
}

static void test_png_bad_crc(void **state)
{
    size_t len;
    uint8_t *data = itu_read("png_rgb_333x222.png", &len);
    prism_image_info_t info;
    data[8 + 8 + 5] ^= 1;   /* a bit of the IHDR width */
    assert_int_equal(prism_image_probe(data, len, &info), PRISM_ECORRUPT);
    prism_image_t img;
    assert_int_equal(prism_image_decode(data, len, NULL, &img), PRISM_ECORRUPT);
    prism_free(data);
}

static void test_decode_truncated(void **state)
{
    const char *files[] = {"jpeg_base_640x480.jpg", "jpeg_prog_800x600.jpg", "jpeg_gray_300x500.jpg",
                           "jpeg_cmyk_200x150.jpg", "png_rgb_333x222.png", "png_rgba_256x384.png",
                           "png_rgba_interlaced_97x61.png", "png_palette4_150x100.png"};
    for (size_t f = 0; f < PRISM_ARRAY_LEN(files); f++) {
        size_t len;
        uint8_t *data = itu_read(files[f], &len);
        bool jpeg = data[0] == 0xFF;
        size_t cuts[] = {len / 8, len / 4, len / 2, len * 3 / 4, len - 40, jpeg ? len - 2 : len - 20};
        for (size_t c = 0; c < PRISM_ARRAY_LEN(cuts); c++) {
            size_t n = cuts[c];
            uint8_t *cut = prism_malloc(n);
            memcpy(cut, data, n);
            size_t used = prism_mem_used();
            prism_image_t img;
            int rc = prism_image_decode(cut, n, NULL, &img);
            if (rc != PRISM_ECORRUPT)
                fail_msg("%s cut at %zu/%zu: %s", files[f], n, len, prism_strerror(rc));
            assert_null(img.rgb);
            assert_int_equal(prism_mem_used(), used);
            prism_free(cut);
        }
        prism_free(data);
    }
}

static void put_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24); p[1] = (uint8_t)(v >> 16); p[2] = (uint8_t)(v >> 8); p[3] = (uint8_t)v;
}

/* Signature + IHDR(w, h, 8-bit RGB) + a tiny IDAT + IEND. */
static size_t make_png_header(uint8_t *b, uint32_t w, uint32_t h)
{
    static const uint8_t sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    static const uint8_t idat[] = {0x78, 0x9c, 0x63, 0x00, 0x00, 0x00, 0x01, 0x00, 0x01}; /* zlib("\0") */
    size_t n = 0;
    memcpy(b, sig, 8); n = 8;
    put_be32(b + n, 13); memcpy(b + n + 4, "IHDR", 4);
    put_be32(b + n + 8, w); put_be32(b + n + 12, h);
    b[n + 16] = 8; b[n + 17] = 2; b[n + 18] = 0; b[n + 19] = 0; b[n + 20] = 0;
    put_be32(b + n + 21, prism_image_crc32(0, b + n + 4, 17));
    n += 25;
    put_be32(b + n, sizeof idat); memcpy(b + n + 4, "IDAT", 4); memcpy(b + n + 8, idat, sizeof idat);
    put_be32(b + n + 8 + sizeof idat, prism_image_crc32(0, b + n + 4, 4 + sizeof idat));
    n += 12 + sizeof idat;
    put_be32(b + n, 0); memcpy(b + n + 4, "IEND", 4); put_be32(b + n + 8, prism_image_crc32(0, b + n + 4, 4));
    return n + 12;
}

static void test_bomb_png(void **state)
{
    uint8_t b[128];
    size_t n = make_png_header(b, 65000, 65000);
    prism_image_info_t info;
    assert_int_equal(prism_image_probe(b, n, &info), PRISM_OK);
    assert_int_equal(info.width, 65000);
    assert_int_equal(info.height, 65000);
    uint64_t allocs = prism_mem_alloc_count();
    prism_image_t img;
    assert_int_equal(prism_image_decode(b, n, NULL, &img), PRISM_ELIMIT);
    prism_image_decode_opts_t o = {.max_pixels = 1u << 24};
    assert_int_equal(prism_image_decode(b, n, &o, &img), PRISM_ELIMIT);
    assert_int_equal(prism_mem_alloc_count(), allocs);   /* refused before any allocation */
    assert_null(img.rgb);

    /* Beyond our hard dimension bound: probe still reports the declared size. */
    n = make_png_header(b, 70000, 10);
    assert_int_equal(prism_image_probe(b, n, &info), PRISM_ELIMIT);
    assert_int_equal(info.width, 70000);
    assert_int_equal(prism_image_decode(b, n, NULL, &img), PRISM_ELIMIT);
    /* PNG's own limit is 2^31-1 */
    n = make_png_header(b, 0x80000000u, 10);
    assert_int_equal(prism_image_probe(b, n, &info), PRISM_ECORRUPT);
    /* a small but truthful header with a bogus IDAT is corrupt, not a crash */
    n = make_png_header(b, 64, 64);
    assert_int_equal(prism_image_probe(b, n, &info), PRISM_OK);
    assert_int_equal(prism_image_decode(b, n, NULL, &img), PRISM_ECORRUPT);
}

static size_t find_sof(const uint8_t *d, size_t len)
{
    for (size_t i = 2; i + 9 < len; i++)
        if (d[i] == 0xFF && (d[i + 1] == 0xC0 || d[i + 1] == 0xC2))
            return i;
    return 0;
}

static void test_bomb_jpeg(void **state)
{
    size_t len;
    uint8_t *data = itu_read("jpeg_444_64x64.jpg", &len);
    size_t sof = find_sof(data, len);
    assert_true(sof > 0);
    /* SOF payload: len(2) precision(1) height(2) width(2) */
    data[sof + 5] = 0xFD; data[sof + 6] = 0xE8;
    data[sof + 7] = 0xFD; data[sof + 8] = 0xE8;
    prism_image_info_t info;
    assert_int_equal(prism_image_probe(data, len, &info), PRISM_OK);
    assert_int_equal(info.width, 65000);
    assert_int_equal(info.height, 65000);
    uint64_t allocs = prism_mem_alloc_count();
    prism_image_t img;
    assert_int_equal(prism_image_decode(data, len, NULL, &img), PRISM_ELIMIT);
    /* DCT scaling does not lift the bound: pixels are counted at the file's size */
    prism_image_decode_opts_t o = {.max_pixels = 1u << 26, .min_w = 64, .min_h = 64};
    assert_int_equal(prism_image_decode(data, len, &o, &img), PRISM_ELIMIT);
    assert_int_equal(prism_mem_alloc_count(), allocs);
    /* height 0 (DNL) is refused */
    data[sof + 5] = 0; data[sof + 6] = 0;
    assert_int_equal(prism_image_probe(data, len, &info), PRISM_ECORRUPT);
    prism_free(data);
}

static void test_max_pixels_and_buffers(void **state)
{
    size_t len;
    uint8_t *data = itu_read("jpeg_base_640x480.jpg", &len);
    prism_image_t img, ref;
    assert_int_equal(prism_image_decode(data, len, NULL, &ref), PRISM_OK);
    prism_image_decode_opts_t o = {.max_pixels = 640 * 480 - 1};
    assert_int_equal(prism_image_decode(data, len, &o, &img), PRISM_ELIMIT);
    o.max_pixels = 640 * 480;
    assert_int_equal(prism_image_decode(data, len, &o, &img), PRISM_OK);
    prism_image_free(&img);

    size_t need = 640 * 480 * 3;
    uint8_t *pool = prism_malloc(need);
    o = (prism_image_decode_opts_t){.out_buf = pool, .out_cap = need - 1};
    assert_int_equal(prism_image_decode(data, len, &o, &img), PRISM_ELIMIT);
    o.out_cap = need;
    size_t used = prism_mem_used();
    assert_int_equal(prism_image_decode(data, len, &o, &img), PRISM_OK);
    assert_ptr_equal(img.rgb, pool);
    assert_false(img.owned);
    assert_memory_equal(pool, ref.rgb, need);
    prism_image_free(&img);   /* must not free the pool */
    assert_int_equal(prism_mem_used(), used);
    o = (prism_image_decode_opts_t){.out_buf = NULL, .out_cap = 5};
    assert_int_equal(prism_image_decode(data, len, &o, &img), PRISM_EINVAL);

    /* PNG into a pool buffer as well, with alpha (row-by-row path) */
    size_t plen;
    uint8_t *png = itu_read("png_rgba_256x384.png", &plen);
    prism_image_t pref;
    assert_int_equal(prism_image_decode(png, plen, NULL, &pref), PRISM_OK);
    o = (prism_image_decode_opts_t){.out_buf = pool, .out_cap = need};
    assert_int_equal(prism_image_decode(png, plen, &o, &img), PRISM_OK);
    assert_memory_equal(pool, pref.rgb, 256 * 384 * 3);
    prism_image_free(&pref);
    prism_free(png);
    prism_free(pool);
    prism_image_free(&ref);
    prism_free(data);
}

static void test_dct_scaling(void **state)
{
    size_t len;
    uint8_t *data = itu_read("jpeg_2048x2048.jpg", &len);
    prism_image_info_t info;
    assert_int_equal(prism_image_probe(data, len, &info), PRISM_OK);
    prism_image_decode_opts_t o = {.min_w = 336, .min_h = 336};
    int sw, sh;
    prism_image_scaled_size(&info, 336, 336, &sw, &sh);
    assert_int_equal(sw, 512);   /* 1/4: 1/8 would give 256 < 336 */
    assert_int_equal(sh, 512);
    prism_image_t img;
    assert_int_equal(prism_image_decode(data, len, &o, &img), PRISM_OK);
    assert_int_equal(img.w, 512);
    assert_int_equal(img.h, 512);
    assert_int_equal(img.src_w, 2048);
    assert_int_equal(img.src_h, 2048);
    prism_image_free(&img);

    /* exactly at a scale boundary: 256 = 2048/8 is allowed */
    prism_image_scaled_size(&info, 256, 256, &sw, &sh);
    assert_int_equal(sw, 256);
    /* 0 disables */
    prism_image_scaled_size(&info, 0, 336, &sw, &sh);
    assert_int_equal(sw, 2048);

    /* the policy helper: only when the source is at least twice the target */
    prism_image_decode_opts_for_target(&o, &info, 336, 336);
    assert_int_equal(o.min_w, 336);
    prism_image_decode_opts_for_target(&o, &info, 1025, 336);
    assert_int_equal(o.min_w, 0);
    assert_int_equal(o.min_h, 0);
    prism_image_info_t png = info;
    png.format = PRISM_IMAGE_FORMAT_PNG;
    prism_image_decode_opts_for_target(&o, &png, 336, 336);
    assert_int_equal(o.min_w, 0);
    prism_image_scaled_size(&png, 336, 336, &sw, &sh);
    assert_int_equal(sw, 2048);

    /* a non-square image scales both sides by the same factor */
    size_t l2;
    uint8_t *d2 = itu_read("jpeg_2048x1024.jpg", &l2);
    o = (prism_image_decode_opts_t){.min_w = 672, .min_h = 336};
    assert_int_equal(prism_image_decode(d2, l2, &o, &img), PRISM_OK);
    assert_int_equal(img.w, 768);   /* 3/8: 768x384 covers 672x336, 1/4 (512 wide) does not */
    assert_int_equal(img.h, 384);
    prism_image_free(&img);
    prism_free(d2);
    prism_free(data);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_probe_goldens),
        cmocka_unit_test(test_decode_goldens),
        cmocka_unit_test(test_alpha_composite_exhaustive),
        cmocka_unit_test(test_probe_garbage),
        cmocka_unit_test(test_probe_truncated_headers),
        cmocka_unit_test(test_jpeg_extraneous_bytes),
        cmocka_unit_test(test_png_bad_crc),
        cmocka_unit_test(test_decode_truncated),
        cmocka_unit_test(test_bomb_png),
        cmocka_unit_test(test_bomb_jpeg),
        cmocka_unit_test(test_max_pixels_and_buffers),
        cmocka_unit_test(test_dct_scaling),
    };
    return cmocka_run_group_tests_name("image", tests, setup, teardown);
}
