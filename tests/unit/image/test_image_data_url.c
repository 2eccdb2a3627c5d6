/* Strict base64 and data: URL parsing, plus an end-to-end data URL -> decoded image. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "image/data_url.h"
#include "image/image.h"
#include "image_test_util.h"

static int dec(const char *s, uint8_t *out, size_t cap, size_t *n)
{
    return prism_base64_decode(s, strlen(s), out, cap, n);
}

static void test_base64_rfc4648_vectors(void **state)
{
    struct { const char *in, *out; } v[] = {
        {"", ""}, {"Zg==", "f"}, {"Zm8=", "fo"}, {"Zm9v", "foo"}, {"Zm9vYg==", "foob"},
        {"Zm9vYmE=", "fooba"}, {"Zm9vYmFy", "foobar"},
        /* non-zero unused bits carry no data; Python's validate=True accepts them too */
        {"Zh==", "f"}, {"Zm9=", "fo"},
    };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(v); i++) {
        uint8_t out[16];
        size_t n = 99;
        assert_int_equal(dec(v[i].in, out, sizeof out, &n), PRISM_OK);
        assert_int_equal(n, strlen(v[i].out));
        assert_memory_equal(out, v[i].out, n);
    }
    /* every byte value round-trips through the whole alphabet, '+' and '/' included */
    uint8_t all[256], back[256];
    for (int i = 0; i < 256; i++)
        all[i] = (uint8_t)i;
    static const char *alpha = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    char enc[400];
    size_t o = 0;
    for (size_t i = 0; i < 256; i += 3) {
        uint32_t b = (uint32_t)all[i] << 16 | (i + 1 < 256 ? all[i + 1] << 8 : 0) | (i + 2 < 256 ? all[i + 2] : 0);
        enc[o++] = alpha[b >> 18 & 63];
        enc[o++] = alpha[b >> 12 & 63];
        enc[o++] = i + 1 < 256 ? alpha[b >> 6 & 63] : '=';
        enc[o++] = i + 2 < 256 ? alpha[b & 63] : '=';
    }
    size_t n;
    assert_int_equal(prism_base64_decode(enc, o, back, sizeof back, &n), PRISM_OK);
    assert_int_equal(n, 256);
    assert_memory_equal(all, back, 256);
}

static void test_base64_invalid(void **state)
{
    const char *bad[] = {
        "Zm9v YmFy",   /* whitespace */
        "Zm9v\nYmFy",  /* newline */
        "Zm9vYmF-",    /* url-safe alphabet */
        "Zm9vYmF_",
        "Z",           /* 1 mod 4 */
        "Zm9vY",
        "Zm=v",        /* padding in the middle */
        "Zg=",         /* padding without a full quantum */
        "Zg===",
        "====",
        "Zg",          /* missing padding (Python: "Incorrect padding") */
        "Zm8",
        "Zm9vYg==Zm9v", /* data after padding */
        "Zm9vYmF\0",   /* embedded NUL counted by the length below */
        "Zm9v%2B",
        "\xc3\xa9XXX", /* non-ASCII */
    };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(bad); i++) {
        uint8_t out[32];
        size_t n = 7;
        size_t len = strlen(bad[i]) + (strcmp(bad[i], "Zm9vYmF") == 0 ? 1 : 0);
        int rc = prism_base64_decode(bad[i], len, out, sizeof out, &n);
        if (rc != PRISM_EINVAL)
            fail_msg("'%s' accepted (%s)", bad[i], prism_strerror(rc));
        assert_int_equal(n, 0);
    }
}

static void test_base64_capacity(void **state)
{
    uint8_t out[6];
    size_t n;
    assert_int_equal(dec("Zm9vYmFy", out, 5, &n), PRISM_ELIMIT);
    assert_int_equal(dec("Zm9vYmFy", out, 6, &n), PRISM_OK);
    assert_int_equal(dec("Zm9vYg==", out, 3, &n), PRISM_ELIMIT);
    assert_int_equal(dec("Zm9vYg==", out, 4, &n), PRISM_OK);
    assert_true(prism_base64_decoded_max(8) >= 6);
    assert_int_equal(prism_base64_decode(NULL, 4, out, 6, &n), PRISM_EINVAL);
    assert_int_equal(prism_base64_decode("", 0, NULL, 0, &n), PRISM_OK);
}

static void test_data_url_parse(void **state)
{
    const char *mime, *b64;
    size_t ml, bl;
    const char *u = "data:image/png;base64,iVBORw0KGgo=";
    assert_int_equal(prism_data_url_parse(u, strlen(u), &mime, &ml, &b64, &bl), PRISM_OK);
    assert_int_equal(ml, 9);
    assert_memory_equal(mime, "image/png", 9);
    assert_string_equal(b64, "iVBORw0KGgo=");
    assert_int_equal(bl, 12);
    assert_true(prism_data_url_mime_is_image(mime, ml));

    u = "DATA:Image/JPEG;charset=binary;BASE64,/9j/";
    assert_int_equal(prism_data_url_parse(u, strlen(u), &mime, &ml, &b64, &bl), PRISM_OK);
    assert_true(prism_data_url_mime_is_image(mime, ml));
    assert_int_equal(bl, 4);

    u = "data:image/gif;base64,R0lG";
    assert_int_equal(prism_data_url_parse(u, strlen(u), &mime, &ml, &b64, &bl), PRISM_OK);
    assert_false(prism_data_url_mime_is_image(mime, ml));

    /* empty payload parses; the image layer rejects it */
    u = "data:image/png;base64,";
    assert_int_equal(prism_data_url_parse(u, strlen(u), &mime, &ml, &b64, &bl), PRISM_OK);
    assert_int_equal(bl, 0);

    struct { const char *u; int rc; } bad[] = {
        {"data:image/png,rawbytes", PRISM_ENOTSUP},        /* percent-encoded form */
        {"data:image/png;base64", PRISM_EINVAL},           /* no comma */
        {"http://x/y.png", PRISM_EINVAL},
        {"data:,abc", PRISM_EINVAL},                       /* no media type */
        {"data:image;base64,abc", PRISM_EINVAL},           /* no subtype */
        {"data:/png;base64,abc", PRISM_EINVAL},
        {"data:image/;base64,abc", PRISM_EINVAL},
        {"data:image/png;;base64,abc", PRISM_EINVAL},      /* empty parameter */
        {"data:image/png;base64;x=y,abc", PRISM_EINVAL},   /* base64 must be last */
        {"data:image/png;foo,abc", PRISM_EINVAL},          /* parameter without '=' */
        {"data:image/p ng;base64,abc", PRISM_EINVAL},
        {"data:", PRISM_EINVAL},
        {"", PRISM_EINVAL},
    };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(bad); i++) {
        int rc = prism_data_url_parse(bad[i].u, strlen(bad[i].u), &mime, &ml, &b64, &bl);
        if (rc != bad[i].rc)
            fail_msg("'%s': %s", bad[i].u, prism_strerror(rc));
        assert_null(b64);
    }
    /* length is honoured: a URL cut before the comma is rejected even if the buffer goes on */
    u = "data:image/png;base64,AAAA";
    assert_int_equal(prism_data_url_parse(u, 20, &mime, &ml, &b64, &bl), PRISM_EINVAL);
}

/* A golden PNG sent as a data URL decodes to the same pixels as the file. */
static void test_data_url_end_to_end(void **state)
{
    size_t len;
    uint8_t *png = itu_read("png_palette_trns_200x200.png", &len);
    static const char *alpha = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t cap = 22 + (len + 2) / 3 * 4 + 1;
    char *url = prism_malloc(cap);
    size_t o = (size_t)snprintf(url, cap, "data:image/png;base64,");
    for (size_t i = 0; i < len; i += 3) {
        uint32_t b = (uint32_t)png[i] << 16 | (i + 1 < len ? png[i + 1] << 8 : 0) | (i + 2 < len ? png[i + 2] : 0);
        url[o++] = alpha[b >> 18 & 63];
        url[o++] = alpha[b >> 12 & 63];
        url[o++] = i + 1 < len ? alpha[b >> 6 & 63] : '=';
        url[o++] = i + 2 < len ? alpha[b & 63] : '=';
    }
    const char *mime, *b64;
    size_t ml, bl;
    assert_int_equal(prism_data_url_parse(url, o, &mime, &ml, &b64, &bl), PRISM_OK);
    size_t dcap = prism_base64_decoded_max(bl), n;
    uint8_t *bytes = prism_malloc(dcap);
    assert_int_equal(prism_base64_decode(b64, bl, bytes, dcap, &n), PRISM_OK);
    assert_int_equal(n, len);
    assert_memory_equal(bytes, png, len);
    prism_image_t a, b;
    assert_int_equal(prism_image_decode(bytes, n, NULL, &a), PRISM_OK);
    assert_int_equal(prism_image_decode(png, len, NULL, &b), PRISM_OK);
    assert_memory_equal(a.rgb, b.rgb, (size_t)a.w * a.h * 3);
    /* one flipped character in the payload is invalid or decodes to a different / corrupt image */
    url[o - 10] = '*';
    assert_int_equal(prism_base64_decode(b64, bl, bytes, dcap, &n), PRISM_EINVAL);
    prism_image_free(&a);
    prism_image_free(&b);
    prism_free(bytes);
    prism_free(url);
    prism_free(png);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_base64_rfc4648_vectors),
        cmocka_unit_test(test_base64_invalid),
        cmocka_unit_test(test_base64_capacity),
        cmocka_unit_test(test_data_url_parse),
        cmocka_unit_test(test_data_url_end_to_end),
    };
    return cmocka_run_group_tests_name("image_data_url", tests, NULL, NULL);
}
