/* libFuzzer: the streaming data-URL lifter (router/body_lift.c) against the whole-body path. The
 * first input byte picks where the body is cut into three reads; the rest is the body. Whatever the
 * cut, the skeleton must be the same JSON as the body except for lifted strings, and each lifted
 * image must hold what jansson + prism_data_url_parse + prism_base64_decode make of the original
 * string (bad exactly when that decode fails). Malformed bodies must stay malformed. */
#include "fuzz_common.h"
#include "body_lift.h"
#include "image/data_url.h"

#include <jansson.h>

static int walk(json_t *orig, json_t *skel, const char *key, prism_lift_t *l, int *next)
{
    if (json_is_string(skel) && json_is_string(orig) &&
        strcmp(json_string_value(skel), json_string_value(orig)) != 0) {
        int i = prism_lift_ref(json_string_value(skel), json_string_length(skel));
        /* in body order; a lift whose key a duplicate overwrote (the last one wins, as in the
         * router's parse) is skipped */
        FUZZ_ASSERT(i >= 0 && i >= *next);
        *next = i + 1;
        FUZZ_ASSERT(!strcmp(key, "url") || !strcmp(key, "image_url"));
        const char *mime, *b64;
        size_t ml, bl;
        FUZZ_ASSERT(prism_data_url_parse(json_string_value(orig), json_string_length(orig), &mime, &ml, &b64, &bl) ==
                    PRISM_OK);
        size_t cap = prism_base64_decoded_max(bl), wl = 0;
        uint8_t *want = malloc(cap + 1);
        int rc = prism_base64_decode(b64, bl, want, cap + 1, &wl);
        uint8_t *data;
        size_t len;
        const char *lm;
        bool bad;
        FUZZ_ASSERT(prism_lift_take(l, i, &data, &len, &lm, &bad) == PRISM_OK);
        FUZZ_ASSERT(strlen(lm) == ml && !memcmp(lm, mime, ml));
        FUZZ_ASSERT(bad == (rc != PRISM_OK));
        if (!bad) FUZZ_ASSERT(len == wl && (!wl || !memcmp(data, want, wl)));
        prism_free(data);
        free(want);
        return 1;
    }
    FUZZ_ASSERT(json_typeof(orig) == json_typeof(skel));
    int n = 0;
    if (json_is_object(orig)) {
        FUZZ_ASSERT(json_object_size(orig) == json_object_size(skel));
        const char *k;
        json_t *v;
        json_object_foreach(orig, k, v) {
            json_t *s = json_object_get(skel, k);
            FUZZ_ASSERT(s);
            n += walk(v, s, k, l, next);
        }
    } else if (json_is_array(orig)) {
        FUZZ_ASSERT(json_array_size(orig) == json_array_size(skel));
        for (size_t i = 0; i < json_array_size(orig); i++)
            n += walk(json_array_get(orig, i), json_array_get(skel, i), "", l, next);
    } else {
        FUZZ_ASSERT(json_equal(orig, skel));
    }
    return n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_init_once();
    if (size < 1) return 0;
    unsigned cut = data[0];
    const char *body = (const char *)data + 1;
    size_t len = size - 1;
    size_t c1 = len ? cut % (len + 1) : 0, c2 = c1 + (len - c1) / 2;
    prism_lift_t *l = malloc(sizeof *l);
    prism_lift_init(l, (cut & 1) ? len : 0, 64 << 20);  /* declared length known or not (chunked) */
    prism_buf_t out = {0};
    FUZZ_ASSERT(prism_lift_feed(l, &out, body, c1) == PRISM_OK);
    FUZZ_ASSERT(prism_lift_feed(l, &out, body + c1, c2 - c1) == PRISM_OK);
    FUZZ_ASSERT(prism_lift_feed(l, &out, body + c2, len - c2) == PRISM_OK);
    FUZZ_ASSERT(prism_lift_finish(l, &out) == PRISM_OK);
    json_error_t e;
    /* the router's flags (openai_req.c) */
    json_t *orig = json_loadb(body, len, JSON_ALLOW_NUL, &e);
    json_t *skel = json_loadb(out.data ? out.data : "", out.len, JSON_ALLOW_NUL, &e);
    if (orig) {
        FUZZ_ASSERT(skel);
        int next = 0;
        if (walk(orig, skel, "", l, &next) == l->n) {
            FUZZ_ASSERT(prism_lift_held(l) == 0);
        } else {  /* only a duplicate key can hide a lift */
            json_t *strict = json_loadb(body, len, JSON_ALLOW_NUL | JSON_REJECT_DUPLICATES, &e);
            FUZZ_ASSERT(!strict);
        }
    }
    json_decref(orig);
    json_decref(skel);
    prism_lift_free(l);
    free(l);
    prism_buf_free(&out);
    return 0;
}
