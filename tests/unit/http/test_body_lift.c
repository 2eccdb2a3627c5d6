/* The streaming data-URL lifter (router/body_lift.h) against the whole-body path: for every body of
 * a corpus, fed whole, cut at every byte boundary into two reads, and cut into many random reads,
 * the skeleton parses to the same JSON as the body except that each lifted string is a reference,
 * and each lifted image holds exactly what jansson + prism_data_url_parse + prism_base64_decode make
 * of the original string (or is marked bad exactly when that decode fails). */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "body_lift.h"
#include "image/data_url.h"

typedef struct {
    const char *key;  /* the key the value sits under ("" at the top / in arrays) */
} walk_t;

/* Walks the original tree and the skeleton's in step. Returns the number of lifted strings seen and
 * fails the test on any other difference. */
static int compare(json_t *orig, json_t *skel, const char *key, prism_lift_t *l, int *next)
{
    if (json_is_string(skel) && json_is_string(orig) &&
        prism_lift_ref(json_string_value(skel), json_string_length(skel)) >= 0 &&
        strcmp(json_string_value(skel), json_string_value(orig)) != 0) {
        int i = prism_lift_ref(json_string_value(skel), json_string_length(skel));
        assert_int_equal(i, *next);  /* body order */
        (*next)++;
        assert_true(!strcmp(key, "url") || !strcmp(key, "image_url"));
        const char *mime, *b64;
        size_t ml, bl;
        assert_int_equal(prism_data_url_parse(json_string_value(orig), json_string_length(orig), &mime, &ml, &b64, &bl),
                         PRISM_OK);
        uint8_t *want = malloc(prism_base64_decoded_max(bl) + 1);
        size_t wl = 0;
        int rc = prism_base64_decode(b64, bl, want, prism_base64_decoded_max(bl) + 1, &wl);
        uint8_t *data;
        size_t len;
        const char *lm;
        bool bad;
        assert_int_equal(prism_lift_take(l, i, &data, &len, &lm, &bad), PRISM_OK);
        assert_int_equal(strlen(lm), ml);
        assert_memory_equal(lm, mime, ml);
        if (rc != PRISM_OK) {
            if (!bad) fail_msg("lift %d: prism_base64_decode refuses the payload but the lifter did not", i);
        } else {
            if (bad) fail_msg("lift %d: the lifter refused a payload prism_base64_decode takes", i);
            assert_int_equal(len, wl);
            if (wl) assert_memory_equal(data, want, wl);
        }
        prism_free(data);
        free(want);
        return 1;
    }
    assert_int_equal(json_typeof(orig), json_typeof(skel));
    int n = 0;
    if (json_is_object(orig)) {
        assert_int_equal(json_object_size(orig), json_object_size(skel));
        const char *k;
        json_t *v;
        json_object_foreach(orig, k, v) {
            json_t *s = json_object_get(skel, k);
            assert_non_null(s);
            n += compare(v, s, k, l, next);
        }
    } else if (json_is_array(orig)) {
        assert_int_equal(json_array_size(orig), json_array_size(skel));
        for (size_t i = 0; i < json_array_size(orig); i++)
            n += compare(json_array_get(orig, i), json_array_get(skel, i), "", l, next);
    } else {
        assert_true(json_equal(orig, skel));
    }
    return n;
}

/* Feeds body in the pieces cuts[] describes (ascending offsets) and checks the result. */
static void check_split(const char *body, size_t len, const size_t *cuts, int n_cuts, int expect_lifts)
{
    prism_lift_t l;
    prism_lift_init(&l, len, 64 << 20);
    prism_buf_t out = {0};
    size_t at = 0;
    for (int i = 0; i <= n_cuts; i++) {
        size_t end = i < n_cuts ? cuts[i] : len;
        assert_int_equal(prism_lift_feed(&l, &out, body + at, end - at), PRISM_OK);
        at = end;
    }
    assert_int_equal(prism_lift_finish(&l, &out), PRISM_OK);
    json_error_t e1, e2;
    json_t *orig = json_loadb(body, len, JSON_ALLOW_NUL, &e1);  /* the router's flags */
    json_t *skel = json_loadb(out.data ? out.data : "", out.len, JSON_ALLOW_NUL, &e2);
    if (!orig) {  /* malformed JSON stays malformed */
        assert_null(skel);
    } else {
        if (!skel) fail_msg("skeleton does not parse: %s in %.*s", e2.text, (int)PRISM_MIN(out.len, (size_t)300), out.data);
        int next = 0;
        int n = compare(orig, skel, "", &l, &next);
        if (expect_lifts >= 0) assert_int_equal(n, expect_lifts);
        assert_int_equal(n, l.n);
        assert_int_equal(prism_lift_held(&l), 0);  /* every lift was taken */
    }
    json_decref(orig);
    json_decref(skel);
    prism_lift_free(&l);
    prism_buf_free(&out);
}

static char *b64(const uint8_t *d, size_t n)
{
    static const char *a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    char *o = malloc(n / 3 * 4 + 8), *p = o;
    size_t i = 0;
    for (; i + 3 <= n; i += 3) {
        uint32_t v = (uint32_t)d[i] << 16 | (uint32_t)d[i + 1] << 8 | d[i + 2];
        *p++ = a[v >> 18 & 63]; *p++ = a[v >> 12 & 63]; *p++ = a[v >> 6 & 63]; *p++ = a[v & 63];
    }
    if (n - i == 1) {
        uint32_t v = (uint32_t)d[i] << 16;
        *p++ = a[v >> 18 & 63]; *p++ = a[v >> 12 & 63]; *p++ = '='; *p++ = '=';
    } else if (n - i == 2) {
        uint32_t v = (uint32_t)d[i] << 16 | (uint32_t)d[i + 1] << 8;
        *p++ = a[v >> 18 & 63]; *p++ = a[v >> 12 & 63]; *p++ = a[v >> 6 & 63]; *p++ = '=';
    }
    *p = 0;
    return o;
}

/* The same base64 with every '/' written as JSON's "\/" (what some JSON encoders emit). */
static char *escape_slashes(const char *s, bool unicode)
{
    char *o = malloc(strlen(s) * 6 + 1), *p = o;
    for (; *s; s++) {
        if (*s == '/') p += sprintf(p, unicode ? "\\u002F" : "\\/");
        else *p++ = *s;
    }
    *p = 0;
    return o;
}

typedef struct {
    char *body;
    int lifts;  /* -1: do not check the count */
} case_t;

static case_t mk(int lifts, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static case_t mk(int lifts, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *b = NULL;
    assert_true(vasprintf(&b, fmt, ap) > 0);
    va_end(ap);
    return (case_t){b, lifts};
}

static int corpus(case_t *c)
{
    uint8_t img[300];
    for (size_t i = 0; i < sizeof img; i++) img[i] = (uint8_t)(i * 37 + (i >> 3) * 11 + 0xF5);  /* many '/' and '+' */
    char *b1 = b64(img, sizeof img), *b2 = b64(img, 299), *b3 = b64(img, 298);
    char *e1 = escape_slashes(b1, false), *e2 = escape_slashes(b2, true);
    int n = 0;
    const char *msg = "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Hi \\\"there\\\"\"},"
                      "{\"type\":\"image_url\",\"image_url\":{\"url\":\"%s\"}}]}],\"max_tokens\":4}";
    char url[4096];
    snprintf(url, sizeof url, "data:image/png;base64,%s", b1);
    c[n++] = mk(1, msg, url);
    snprintf(url, sizeof url, "data:image\\/jpeg;base64,%s", e1);  /* escapes in the header and the payload */
    c[n++] = mk(1, msg, url);
    snprintf(url, sizeof url, "data:image/png;base64,%s", e2);     /* \u002F in the payload, padding 1 */
    c[n++] = mk(1, msg, url);
    snprintf(url, sizeof url, "data:image/png;name=x.png;base64,%s", b3);  /* a parameter, padding 2 */
    c[n++] = mk(1, msg, url);
    c[n++] = mk(1, msg, "data:image/png;base64,");                  /* empty payload */
    c[n++] = mk(1, msg, "data:image/png;base64,AAA");               /* missing padding: bad */
    c[n++] = mk(1, msg, "data:image/png;base64,AA=A");              /* data after padding: bad */
    c[n++] = mk(1, msg, "data:image/png;base64,A===");              /* too much padding: bad */
    c[n++] = mk(1, msg, "data:image/png;base64,AAAA\\nAAAA");       /* whitespace: bad */
    c[n++] = mk(1, msg, "data:image/png;base64,AA-_");              /* URL-safe alphabet: bad */
    c[n++] = mk(1, msg, "data:image/png;base64,AA\\u00e9A");        /* non-ASCII: bad */
    c[n++] = mk(1, msg, "data:text/plain;base64,aGVsbG8=");         /* lifted; the router checks the type */
    c[n++] = mk(0, msg, "data:image/png,rawbytes");                 /* not base64: the whole-string path */
    c[n++] = mk(0, msg, "https://example.com/a.png");
    c[n++] = mk(0, msg, "data:image/png;base64");                   /* no comma */
    c[n++] = mk(0, msg, "");
    /* a header longer than PRISM_LIFT_MAX_HEADER stays whole */
    char longp[600];
    memset(longp, 'p', sizeof longp);
    longp[sizeof longp - 1] = 0;
    snprintf(url, sizeof url, "data:image/png;x=%s;base64,AAAA", longp);
    c[n++] = mk(0, msg, url);
    /* string form of image_url, two images, a data URL under another key (not lifted), keys with escapes */
    snprintf(url, sizeof url, "data:image/png;base64,%s", b1);
    c[n++] = mk(2,
                "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":\"%s\"},"
                "{\"type\":\"text\",\"text\":\"data:image/png;base64,AAAA\"},{\"type\":\"image_url\",\"image_url\" : "
                "{ \"url\" :\t\"%s\" , \"detail\":\"auto\"}}],\"u\\u0072l\":\"x\",\"urls\":[\"data:image/png;base64,AAAA\"]}]}",
                url, url);
    /* the key "url" as a value, not a key: the next string is not lifted */
    c[n++] = mk(0, "{\"a\":[\"url\",\"data:image/png;base64,AAAA\"],\"b\":{\"x\":\"url\"},\"c\":\"data:image/png;base64,AAAA\"}");
    /* malformed JSON stays malformed (the lifted string itself is fine) */
    c[n++] = mk(-1, "{\"url\":\"data:image/png;base64,AAAA\",}");
    c[n++] = mk(-1, "{\"url\":\"data:image/png;base64,AAAA");      /* cut inside the payload */
    c[n++] = mk(-1, "{\"url\":\"data:image/pn");                    /* cut inside the header */
    free(b1); free(b2); free(b3); free(e1); free(e2);
    return n;
}

static void test_corpus_every_split(void **state)
{
    (void)state;
    case_t c[64];
    int n = corpus(c);
    size_t base = prism_mem_used();
    for (int k = 0; k < n; k++) {
        size_t len = strlen(c[k].body);
        check_split(c[k].body, len, NULL, 0, c[k].lifts);
        for (size_t cut = 0; cut <= len; cut++) check_split(c[k].body, len, &cut, 1, c[k].lifts);
        /* many small reads: every piece 1..7 bytes, several seeds */
        for (unsigned seed = 1; seed <= 5; seed++) {
            size_t cuts[8192];
            int nc = 0;
            srand(seed);
            for (size_t at = 0; nc < 8192;) {
                at += 1 + (size_t)(rand() % 7);
                if (at >= len) break;
                cuts[nc++] = at;
            }
            check_split(c[k].body, len, cuts, nc, c[k].lifts);
        }
        free(c[k].body);
    }
    assert_int_equal(prism_mem_used(), base);
}

/* A 3 MB image: a buffer that doubles (a handful of allocations, never more than twice what arrived),
 * trimmed to the decoded bytes at the end; a skeleton of a few hundred bytes. */
static void test_large_image_memory(void **state)
{
    (void)state;
    size_t n = 3 << 20;
    uint8_t *img = malloc(n);
    for (size_t i = 0; i < n; i++) img[i] = (uint8_t)(i * 2654435761u >> 13);
    char *e = b64(img, n);
    char *body = NULL;
    int len = asprintf(&body, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":"
                              "{\"url\":\"data:image/jpeg;base64,%s\"}}]}]}", e);
    prism_lift_t l;
    prism_lift_init(&l, (uint64_t)len, 64 << 20);
    prism_buf_t out = {0};
    uint64_t allocs = prism_mem_alloc_count();
    for (int at = 0; at < len; at += 65536) {
        assert_int_equal(prism_lift_feed(&l, &out, body + at, (size_t)PRISM_MIN(65536, len - at)), PRISM_OK);
        size_t arrived = (size_t)PRISM_MIN(at + 65536, len) / 4 * 3;
        assert_true(prism_lift_held(&l) <= PRISM_MAX(2 * arrived, (size_t)64 * 1024));
    }
    assert_int_equal(prism_lift_finish(&l, &out), PRISM_OK);
    assert_true(prism_mem_alloc_count() - allocs <= 16);  /* doublings from 64 KiB, the trim, the skeleton */
    assert_true(out.len < 200);
    assert_int_equal(prism_lift_held(&l), n);
    uint8_t *data;
    size_t dl;
    bool bad;
    assert_int_equal(prism_lift_take(&l, 0, &data, &dl, NULL, &bad), PRISM_OK);
    assert_false(bad);
    assert_int_equal(dl, n);
    assert_memory_equal(data, img, n);
    assert_int_equal(prism_lift_take(&l, 0, &data, &dl, NULL, &bad), PRISM_EINVAL);  /* once */
    prism_free(data);
    prism_lift_free(&l);
    prism_buf_free(&out);
    free(body);
    free(e);
    free(img);
}

/* Each lifted image knows its place among the body's image URLs (every string value of a "url" or
 * "image_url" key, lifted or not): the index the router's answers name. "url" as a value, or a key
 * whose value is not a string, does not count. */
static void test_ordinal(void **state)
{
    (void)state;
    const char *body =
        "{\"messages\":[{\"content\":[{\"type\":\"text\",\"text\":\"url\"},"
        "{\"image_url\":{\"url\":\"https://example.com/a.png\"}},"
        "{\"image_url\":{\"url\":\"data:image/png;base64,AAAA\"}},"
        "{\"image_url\":\"data:image/jpeg;base64,AAAA\"},"
        "{\"image_url\":{\"url\":\"data:text/plain;base64,AAAA\"}}]}]}";
    prism_lift_t l;
    prism_buf_t out = {0};
    prism_lift_init(&l, strlen(body), 1 << 20);
    for (size_t i = 0; body[i]; i++) assert_int_equal(prism_lift_feed(&l, &out, body + i, 1), PRISM_OK);
    assert_int_equal(prism_lift_finish(&l, &out), PRISM_OK);
    assert_int_equal(l.n, 3);   /* data URLs of any media type are lifted; the image path judges them */
    assert_int_equal(l.img[0].ordinal, 1);
    assert_int_equal(l.img[1].ordinal, 2);
    assert_int_equal(l.img[2].ordinal, 3);
    assert_string_equal(l.img[2].mime, "text/plain");
    prism_lift_free(&l);
    prism_buf_free(&out);
}

static void test_ref_spelling(void **state)
{
    (void)state;
    assert_int_equal(prism_lift_ref("prism-lifted:0", 14), 0);
    assert_int_equal(prism_lift_ref("prism-lifted:63", 15), 63);
    assert_int_equal(prism_lift_ref("prism-lifted:64", 15), -1);
    assert_int_equal(prism_lift_ref("prism-lifted:01", 15), -1);
    assert_int_equal(prism_lift_ref("prism-lifted:", 13), -1);
    assert_int_equal(prism_lift_ref("prism-lifted:1x", 15), -1);
    assert_int_equal(prism_lift_ref("data:image/png;base64,", 22), -1);
}

int main(void)
{
    json_set_alloc_funcs(prism_malloc, prism_free);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_corpus_every_split),
        cmocka_unit_test(test_large_image_memory),
        cmocka_unit_test(test_ref_spelling),
        cmocka_unit_test(test_ordinal),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
