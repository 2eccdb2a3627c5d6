/* JSON Schema constrained generation: for many seeded random schemas and every tokenizer
 * (bundled + the shared real ones, skipped when absent), random walks that sample only allowed
 * tokens must end in output that parses as JSON and validates against the schema (independent
 * validator in gram_test_util.h). Also fixed schemas with known tricky parts, json_object, and
 * whitespace modes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "gram_test_util.h"

static int n_schemas_for(const char *name)
{
    const char *e = getenv("PRISM_GRAMMAR_TEST_SCHEMAS");
    if (e && atoi(e) > 0) return atoi(e);
    return !strcmp(name, "prism_tiny_llava") || !strcmp(name, "synthetic") ? 60 : 12;
}

/* Generates from schema with several walks; returns the number of terminated walks. */
static int walk_schema(const gt_tok_t *t, const char *schema, const prism_grammar_json_opts_t *opts, uint64_t seed,
                       int walks, int32_t *mask, int32_t *allowed, int *n_valid)
{
    prism_grammar_t *g = NULL;
    prism_grammar_error_t err;
    int rc = prism_grammar_compile_json_schema(t->v, schema, strlen(schema), opts, NULL, &g, &err);
    if (rc < 0) fail_msg("compile failed (%d) at %s: %s\nschema: %s", rc, err.path, err.message, schema);
    prism_grammar_matcher_t *m = NULL;
    assert_int_equal(prism_grammar_matcher_create(g, NULL, &m), PRISM_OK);
    json_t *js = json_loads(schema, 0, NULL);
    assert_non_null(js);
    int terminated = 0;
    for (int w = 0; w < walks; w++) {
        prism_grammar_matcher_reset(m);
        gt_walk_t wk = {0};
        if (!gt_walk(m, t, seed * 131 + (uint64_t)w, 400, &wk, mask, allowed))
            fail_msg("walk failed; schema: %s\noutput so far: %.*s", schema, (int)wk.out.len, wk.out.data);
        if (wk.terminated) {
            terminated++;
            json_error_t je;
            json_t *x = json_loadb(wk.out.data, wk.out.len, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
            if (!x) fail_msg("output is not JSON (%s): %.*s\nschema: %s", je.text, (int)wk.out.len, wk.out.data, schema);
            const char *why = gt_validate(js, js, x, 0);
            if (why) fail_msg("output does not validate (%s): %.*s\nschema: %s", why, (int)wk.out.len, wk.out.data, schema);
            /* the byte-level acceptor agrees */
            assert_true(prism_grammar_accepts_bytes(g, (const uint8_t *)wk.out.data, wk.out.len));
            json_decref(x);
            (*n_valid)++;
        }
        prism_buf_free(&wk.out);
    }
    json_decref(js);
    prism_grammar_matcher_free(m);
    prism_grammar_release(g);
    return terminated;
}

static void run_random(const gt_tok_case_t *c)
{
    gt_tok_t t;
    if (!c) gt_tok_synth(999, 6000, &t);
    else if (!gt_tok_load(c, &t)) fail();   /* gt_run checked the shared ones are there */
    static const gt_tok_case_t synth = { "synthetic", NULL, false, NULL };
    if (!c) c = &synth;
    size_t nv = prism_grammar_vocab_size(t.v);
    int32_t *mask = malloc(prism_grammar_mask_words(t.v) * sizeof *mask);
    int32_t *allowed = malloc(nv * sizeof *allowed);
    int n = n_schemas_for(c->name), walks = 0, term = 0, valid = 0;
    double t0 = prism_now_s();
    for (int i = 0; i < n; i++) {
        char *schema = gt_random_schema(0xC0FFEE + (uint64_t)i * 7919);
        prism_grammar_json_opts_t o = { .max_whitespace = i % 5 == 4 ? 2 : 0 };
        term += walk_schema(&t, schema, &o, (uint64_t)i, 3, mask, allowed, &valid);
        walks += 3;
        free(schema);
    }
    fprintf(stderr, "%s: %d schemas, %d walks, %d terminated, all valid (%.2fs)\n", c->name, n, walks, term,
            prism_now_s() - t0);
    assert_int_equal(term, valid);
    /* most walks must end; a low rate means masks stall generation */
    assert_true(term * 10 >= walks * 7);
    free(mask);
    free(allowed);
    gt_tok_free(&t);
}

static void test_random_synth(void **s) { (void)s; run_random(NULL); }
static void test_random_tiny(void **s) { (void)s; run_random(&GT_TOKS[0]); }
static void test_random_llama3(void **s) { (void)s; run_random(&GT_TOKS[1]); }
static void test_random_qwen3(void **s) { (void)s; run_random(&GT_TOKS[2]); }
static void test_random_llama2(void **s) { (void)s; run_random(&GT_TOKS[3]); }

/* Fixed schemas exercising each keyword, on the bundled tokenizer. */
static void test_fixed_schemas(void **s)
{
    (void)s;
    gt_tok_t t;
    assert_true(gt_tok_load(&GT_TOKS[0], &t));
    static const char *const SCHEMAS[] = {
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"}},"
        "\"required\":[\"name\",\"age\"],\"additionalProperties\":false}",
        "{\"type\":\"array\",\"items\":{\"type\":\"number\"},\"minItems\":2,\"maxItems\":4}",
        "{\"enum\":[\"north\",\"south\",{\"a\":[1,2]},null,true]}",
        "{\"anyOf\":[{\"type\":\"string\",\"maxLength\":3},{\"type\":\"array\",\"items\":{\"type\":\"boolean\"}}]}",
        "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"integer\"},"
        "\"c\":{\"type\":\"integer\"}},\"required\":[\"b\"]}",
        "{\"type\":\"object\",\"properties\":{\"k\":{\"const\":7}},\"additionalProperties\":{\"type\":\"string\"}}",
        "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},"
        "\"next\":{\"anyOf\":[{\"$ref\":\"#/$defs/node\"},{\"type\":\"null\"}]}},\"required\":[\"v\",\"next\"]}},"
        "\"$ref\":\"#/$defs/node\"}",
        "{\"type\":\"string\",\"pattern\":\"^[a-c]{2}\\\\d$\"}",
        "{\"type\":\"string\",\"format\":\"date-time\"}",
        "{\"type\":[\"integer\",\"null\"]}",
        "{\"type\":\"array\",\"prefixItems\":[{\"type\":\"string\"},{\"type\":\"integer\"}],\"items\":false,\"minItems\":1}",
        "{\"type\":\"object\"}",
        "{}",
        "{\"type\":\"object\",\"properties\":{\"q\":{\"type\":\"string\",\"pattern\":\"^[\\\"\\\\\\\\]+$\"}},\"required\":[\"q\"]}",
        "{\"title\":\"T\",\"description\":\"d\",\"type\":\"object\",\"properties\":{\"s\":{\"type\":\"string\",\"minLength\":2}},"
        "\"required\":[\"s\"],\"additionalProperties\":false}",
    };
    size_t nv = prism_grammar_vocab_size(t.v);
    int32_t *mask = malloc(prism_grammar_mask_words(t.v) * sizeof *mask);
    int32_t *allowed = malloc(nv * sizeof *allowed);
    for (size_t i = 0; i < PRISM_ARRAY_LEN(SCHEMAS); i++) {
        int valid = 0;
        int term = walk_schema(&t, SCHEMAS[i], NULL, i, 8, mask, allowed, &valid);
        if (term == 0) fail_msg("no walk ended for schema %s", SCHEMAS[i]);
    }
    free(mask);
    free(allowed);
    gt_tok_free(&t);
}

/* Byte-level acceptance of hand-written documents: right ones in, wrong ones out. */
static void test_accepts_bytes(void **s)
{
    (void)s;
    gt_tok_t t;
    assert_true(gt_tok_load(&GT_TOKS[0], &t));
    const char *schema = "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"string\"},"
                         "\"c\":{\"type\":\"boolean\"}},\"required\":[\"b\"],\"additionalProperties\":false}";
    prism_grammar_t *g;
    prism_grammar_error_t err;
    assert_int_equal(prism_grammar_compile_json_schema(t.v, schema, strlen(schema), NULL, NULL, &g, &err), PRISM_OK);
    static const struct { const char *doc; bool ok; } DOCS[] = {
        { "{\"b\": \"x\"}", true },
        { "{\"b\":\"x\"}", true },
        { "{\"a\": 1, \"b\": \"x\", \"c\": true}", true },
        { "{\"a\": -0, \"b\": \"\\u00e9\\n\"}", true },
        { "{\"b\": \"\\u0000\"}", false },              /* NUL breaks C parsers */
        { "{\"b\": \"\\u0001\\ud7ff\"}", true },
        { "{\"b\": \"x\", \"c\": false}", true },
        { "{}", false },                                  /* b required */
        { "{\"a\": 1}", false },
        { "{\"b\": \"x\", \"a\": 1}", false },            /* declared order */
        { "{\"b\": \"x\", \"d\": 1}", false },            /* no extra keys */
        { "{\"a\": 01, \"b\": \"x\"}", false },           /* leading zero */
        { "{\"a\": 1.5, \"b\": \"x\"}", false },          /* integer */
        { "{\"b\": \"\\ud800\"}", false },                /* lone surrogate */
        { "{\"b\": \"x\"} ", false },
        { "{\"b\": \"\x01\"}", false },                   /* raw control character */
        { "{\"b\": \"\xc3\x28\"}", false },               /* invalid UTF-8 */
        { "{\"b\": \"x\",}", false },
    };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(DOCS); i++) {
        bool got = prism_grammar_accepts_bytes(g, (const uint8_t *)DOCS[i].doc, strlen(DOCS[i].doc));
        if (got != DOCS[i].ok) fail_msg("%s: expected %s", DOCS[i].doc, DOCS[i].ok ? "accept" : "reject");
    }
    prism_grammar_release(g);

    /* additionalProperties true with declared keys: extra keys never equal declared ones */
    const char *s2 = "{\"type\":\"object\",\"properties\":{\"ab\":{\"type\":\"integer\"}},\"additionalProperties\":true}";
    assert_int_equal(prism_grammar_compile_json_schema(t.v, s2, strlen(s2), NULL, NULL, &g, &err), PRISM_OK);
    assert_true(prism_grammar_accepts_bytes(g, (const uint8_t *)"{\"ab\": 1, \"a\": \"x\"}", 19));
    assert_true(prism_grammar_accepts_bytes(g, (const uint8_t *)"{\"abc\": null}", 13));
    assert_false(prism_grammar_accepts_bytes(g, (const uint8_t *)"{\"ab\": \"x\"}", 11));
    assert_false(prism_grammar_accepts_bytes(g, (const uint8_t *)"{\"ab\": 1, \"ab\": 2}", 18));
    prism_grammar_release(g);

    /* json_object: any object, nothing else */
    assert_int_equal(prism_grammar_compile_json_object(t.v, NULL, NULL, &g, &err), PRISM_OK);
    assert_true(prism_grammar_accepts_bytes(g, (const uint8_t *)"{\"x\": [1, {\"y\": null}]}", 23));
    assert_false(prism_grammar_accepts_bytes(g, (const uint8_t *)"[1]", 3));
    assert_false(prism_grammar_accepts_bytes(g, (const uint8_t *)"\"s\"", 3));
    prism_grammar_release(g);

    /* pythonic literals */
    prism_grammar_json_opts_t py = { .pythonic = true };
    const char *s3 = "{\"type\":\"array\",\"items\":{\"type\":[\"boolean\",\"null\"]}}";
    assert_int_equal(prism_grammar_compile_json_schema(t.v, s3, strlen(s3), &py, NULL, &g, &err), PRISM_OK);
    assert_true(prism_grammar_accepts_bytes(g, (const uint8_t *)"[True, None, False]", 19));
    assert_false(prism_grammar_accepts_bytes(g, (const uint8_t *)"[true]", 6));
    prism_grammar_release(g);

    /* whitespace: compact by default, bounded when enabled */
    const char *s4 = "{\"type\":\"array\",\"items\":{\"type\":\"integer\"}}";
    assert_int_equal(prism_grammar_compile_json_schema(t.v, s4, strlen(s4), NULL, NULL, &g, &err), PRISM_OK);
    assert_false(prism_grammar_accepts_bytes(g, (const uint8_t *)"[ 1]", 4));
    prism_grammar_release(g);
    prism_grammar_json_opts_t ws = { .max_whitespace = 3 };
    assert_int_equal(prism_grammar_compile_json_schema(t.v, s4, strlen(s4), &ws, NULL, &g, &err), PRISM_OK);
    assert_true(prism_grammar_accepts_bytes(g, (const uint8_t *)"[\n  1 ,\n  2\n]", 13));
    assert_false(prism_grammar_accepts_bytes(g, (const uint8_t *)"[    1]", 7));
    prism_grammar_release(g);
    gt_tok_free(&t);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_accepts_bytes),
        cmocka_unit_test(test_fixed_schemas),
        cmocka_unit_test(test_random_synth),
        cmocka_unit_test(test_random_tiny),
    };
    /* on the shared tokenizers: their own entry, Skipped (77) without them (gt_run) */
    const struct CMUnitTest shared[] = {
        cmocka_unit_test(test_random_llama3),
        cmocka_unit_test(test_random_qwen3),
        cmocka_unit_test(test_random_llama2),
    };
    return gt_run(argc, argv, "test_grammar_json", tests, PRISM_ARRAY_LEN(tests), shared, PRISM_ARRAY_LEN(shared));
}
