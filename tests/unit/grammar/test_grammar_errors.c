/* Bad input to the grammar compiler: each is a typed error whose path and message name what is
 * wrong (the router turns them into 400s naming the field); limits hold; nothing crashes on
 * mutated schemas and regexes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "gram_test_util.h"

static gt_tok_t T;

static int setup(void **s)
{
    (void)s;
    gt_tok_synth(7, 1000, &T);
    return 0;
}

static int teardown(void **s)
{
    (void)s;
    gt_tok_free(&T);
    return 0;
}

typedef struct {
    const char *schema;
    int code;
    const char *path;   /* expected error path */
    const char *word;   /* a word the message must contain */
} bad_t;

static void test_bad_schemas(void **s)
{
    (void)s;
    static const bad_t BAD[] = {
        { "{\"type\":", PRISM_EINVAL, "", "not valid JSON" },
        { "{\"type\":\"strin\"}", PRISM_EINVAL, "#/type", "strin" },
        { "{\"type\":7}", PRISM_EINVAL, "#/type", "type" },
        { "{\"type\":\"integer\",\"minimum\":0}", PRISM_ENOTSUP, "#/minimum", "minimum" },
        { "{\"properties\":{\"a\":{\"type\":\"object\",\"properties\":{\"b\":{\"type\":\"number\",\"multipleOf\":2}}}}}",
          PRISM_ENOTSUP, "#/properties/a/properties/b/multipleOf", "multipleOf" },
        { "{\"$ref\":\"#/$defs/missing\"}", PRISM_EINVAL, "#/$ref", "does not resolve" },
        { "{\"$ref\":\"http://example.com/s.json\"}", PRISM_ENOTSUP, "#/$ref", "local" },
        { "{\"enum\":[]}", PRISM_EINVAL, "", "matches no output" },
        { "{\"type\":\"string\",\"enum\":[1,2]}", PRISM_EINVAL, "", "matches no output" },
        { "{\"type\":\"object\",\"required\":[\"x\"],\"additionalProperties\":false}", PRISM_ENOTSUP, "#/required/0", "'x'" },
        { "{\"type\":\"array\",\"maxItems\":100000}", PRISM_ELIMIT, "#/maxItems", "limit" },
        { "{\"type\":\"array\",\"minItems\":3,\"maxItems\":2}", PRISM_EINVAL, "#", "below" },
        { "{\"type\":\"string\",\"pattern\":\"(ab\"}", PRISM_EINVAL, "#/pattern@3", "')'" },
        { "{\"type\":\"string\",\"pattern\":\"(?=a)b\"}", PRISM_ENOTSUP, "#/pattern@", "look-ahead" },
        { "{\"type\":\"object\",\"properties\":{\"p\":{\"type\":\"string\",\"pattern\":\"a\\\\1\"}}}", PRISM_ENOTSUP,
          "#/properties/p/pattern@", "back-references" },
        { "{\"type\":\"object\",\"properties\":{\"a\":{\"allOf\":[{\"type\":\"string\"},{\"maxLength\":3}]}}}",
          PRISM_ENOTSUP, "#/properties/a/allOf", "allOf" },
        { "{\"$ref\":\"#\"}", PRISM_EINVAL, "", "matches no output" },
        { "{\"type\":\"object\",\"patternProperties\":{\"^a\":{}}}", PRISM_ENOTSUP, "#/patternProperties", "patternProperties" },
        { "{\"anyOf\":[]}", PRISM_EINVAL, "#/anyOf", "non-empty" },
        { "{\"type\":\"string\",\"minLength\":-1}", PRISM_EINVAL, "#/minLength", "non-negative" },
        { "{\"properties\":{\"a\":{\"$defs\":{\"x\":{}},\"$ref\":\"#/properties/a/$defs/x\",\"type\":\"string\"}}}",
          PRISM_ENOTSUP, "#/properties/a/$ref", "sibling" },
        { "[1,2]", PRISM_EINVAL, "#", "must be an object" },
    };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(BAD); i++) {
        prism_grammar_t *g = (prism_grammar_t *)1;
        prism_grammar_error_t err = {0};
        int rc = prism_grammar_compile_json_schema(T.v, BAD[i].schema, strlen(BAD[i].schema), NULL, NULL, &g, &err);
        if (rc != BAD[i].code || strncmp(err.path, BAD[i].path, strlen(BAD[i].path)) || !strstr(err.message, BAD[i].word) ||
            err.code != rc || g != NULL)
            fail_msg("%s: got %d path '%s' message '%s'; want %d '%s' '%s'", BAD[i].schema, rc, err.path, err.message,
                     BAD[i].code, BAD[i].path, BAD[i].word);
    }
}

static void test_limits(void **s)
{
    (void)s;
    prism_grammar_t *g;
    prism_grammar_error_t err;
    /* depth */
    prism_buf_t b = {0};
    for (int i = 0; i < 40; i++) prism_buf_append_str(&b, "{\"type\":\"array\",\"items\":");
    prism_buf_append_str(&b, "{\"type\":\"integer\"}");
    for (int i = 0; i < 40; i++) prism_buf_append_str(&b, "}");
    int rc = prism_grammar_compile_json_schema(T.v, b.data, b.len, NULL, NULL, &g, &err);
    assert_int_equal(rc, PRISM_ELIMIT);
    assert_non_null(strstr(err.message, "deeper than 32"));
    /* within a raised limit it compiles */
    prism_grammar_limits_t lim = { .max_schema_depth = 64 };
    assert_int_equal(prism_grammar_compile_json_schema(T.v, b.data, b.len, NULL, &lim, &g, &err), PRISM_OK);
    prism_grammar_release(g);
    prism_buf_free(&b);
    /* size */
    lim = (prism_grammar_limits_t){ .max_schema_bytes = 64 };
    const char *big = "{\"type\":\"object\",\"properties\":{\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaa\":{\"type\":\"string\"}}}";
    rc = prism_grammar_compile_json_schema(T.v, big, strlen(big), NULL, &lim, &g, &err);
    assert_int_equal(rc, PRISM_ELIMIT);
    assert_non_null(strstr(err.message, "bytes"));
    /* sub-schema count, including $ref expansions */
    lim = (prism_grammar_limits_t){ .max_schema_nodes = 5 };
    const char *many = "{\"type\":\"array\",\"prefixItems\":[{},{},{},{},{},{},{}]}";
    assert_int_equal(prism_grammar_compile_json_schema(T.v, many, strlen(many), NULL, &lim, &g, &err), PRISM_ELIMIT);
    /* automaton states */
    lim = (prism_grammar_limits_t){ .max_states = 50 };
    const char *str = "{\"type\":\"string\",\"maxLength\":40}";
    rc = prism_grammar_compile_json_schema(T.v, str, strlen(str), NULL, &lim, &g, &err);
    assert_int_equal(rc, PRISM_ELIMIT);
    assert_non_null(strstr(err.message, "too complex"));
    /* nested bounded repetitions cannot blow up: the state bound stops them */
    const char *rx = "((a{200}){200}){200}";
    rc = prism_grammar_compile_regex(T.v, rx, strlen(rx), NULL, &g, &err);
    assert_int_equal(rc, PRISM_ELIMIT);
    /* a regex past the expansion limit */
    rc = prism_grammar_compile_regex(T.v, "a{1000}", 7, NULL, &g, &err);
    assert_int_equal(rc, PRISM_ELIMIT);
    assert_string_equal(err.path, "@1");
}

static void test_bad_regex_choice(void **s)
{
    (void)s;
    static const struct { const char *re; int code; const char *path; } BAD[] = {
        { "(ab", PRISM_EINVAL, "@3" },       { "ab)", PRISM_EINVAL, "@2" },       { "a{3,2}", PRISM_EINVAL, "@1" },
        { "[b-a]", PRISM_EINVAL, "@4" },     { "*a", PRISM_EINVAL, "@0" },        { "a**", PRISM_EINVAL, "@2" },
        { "(?=x)", PRISM_ENOTSUP, "@2" },    { "(?<!x)y", PRISM_ENOTSUP, "@2" },  { "(a)\\1", PRISM_ENOTSUP, "@4" },
        { "a\\b", PRISM_ENOTSUP, "@2" },     { "(?i)a", PRISM_ENOTSUP, "@2" },    { "[abc", PRISM_EINVAL, "@4" },
        { "a^b", PRISM_ENOTSUP, "@1" },      { "a$b", PRISM_ENOTSUP, "@2" },      { "\\q", PRISM_EINVAL, "@1" },
        { "[^\\x00-\\U0010FFFF]", PRISM_EINVAL, "@" }, { "x\\", PRISM_EINVAL, "@2" }, { "a++", PRISM_ENOTSUP, "@2" },
    };
    prism_grammar_t *g;
    prism_grammar_error_t err;
    for (size_t i = 0; i < PRISM_ARRAY_LEN(BAD); i++) {
        int rc = prism_grammar_compile_regex(T.v, BAD[i].re, strlen(BAD[i].re), NULL, &g, &err);
        if (rc != BAD[i].code || strncmp(err.path, BAD[i].path, strlen(BAD[i].path)))
            fail_msg("%s: got %d '%s' (%s); want %d '%s'", BAD[i].re, rc, err.path, err.message, BAD[i].code, BAD[i].path);
    }
    /* good ones, checked on bytes */
    static const struct { const char *re, *yes, *no; } GOOD[] = {
        { "^\\d{2,3}$", "123", "1234" },
        { "[^a-z]+", "\xc3\xa9!", "ab" },
        { "(?:ab|cd)+?x", "abcdx", "abx x" },
        { "(?P<y>\\d{4})-(?<m>\\d\\d)", "2024-05", "2024-5" },
        { "\\u00e9\\x41", "\xc3\xa9" "A", "eA" },
        { ".{2}", "\xe6\x97\xa5\xe6\x9c\xac", "\n\n" },
        { "[\\s\\d]+", " 1\t", "a" },
        { "a|", "", "b" },
    };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(GOOD); i++) {
        if (prism_grammar_compile_regex(T.v, GOOD[i].re, strlen(GOOD[i].re), NULL, &g, &err) < 0)
            fail_msg("%s: %s %s", GOOD[i].re, err.path, err.message);
        if (!prism_grammar_accepts_bytes(g, (const uint8_t *)GOOD[i].yes, strlen(GOOD[i].yes))) fail_msg("%s should match %s", GOOD[i].re, GOOD[i].yes);
        if (prism_grammar_accepts_bytes(g, (const uint8_t *)GOOD[i].no, strlen(GOOD[i].no))) fail_msg("%s should not match %s", GOOD[i].re, GOOD[i].no);
        prism_grammar_release(g);
    }
    /* choice */
    assert_int_equal(prism_grammar_compile_choice(T.v, NULL, NULL, 0, NULL, &g, &err), PRISM_EINVAL);
    prism_grammar_limits_t lim = { .max_schema_bytes = 10 };
    const char *ch[] = { "abcdef", "ghijkl" };
    size_t lens[] = { 6, 6 };
    assert_int_equal(prism_grammar_compile_choice(T.v, ch, lens, 2, &lim, &g, &err), PRISM_ELIMIT);
    assert_string_equal(err.path, "[1]");
}

/* What compiling costs is bounded (issue 26): a rule whose subset construction would blow up
 * stays an NFA (states linear in the regex), a long chain compiles in linear time, and the
 * budgets of time and memory refuse what remains with PRISM_ELIMIT. */
static void test_compile_cost_bounded(void **s)
{
    (void)s;
    prism_grammar_t *g;
    prism_grammar_error_t err;
    static const int K[] = { 13, 20, 100, 250 };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(K); i++) {
        char rx[64], yes[300], no[300];
        snprintf(rx, sizeof rx, "(a|b)*a(a|b){%d}", K[i]);
        double t0 = prism_now_s();
        int rc = prism_grammar_compile_regex(T.v, rx, strlen(rx), NULL, &g, &err);
        double dt = prism_now_s() - t0;
        if (rc != PRISM_OK) fail_msg("%s: %d %s", rx, rc, err.message);
        /* 2^k states determinized; linear as an NFA */
        if (prism_grammar_n_states(g) > (size_t)(16 * K[i] + 128) || dt > 1.0)
            fail_msg("%s: %zu states, %.3f s", rx, prism_grammar_n_states(g), dt);
        int n = snprintf(yes, sizeof yes, "bba");
        for (int j = 0; j < K[i]; j++) yes[n++] = j % 3 ? 'a' : 'b';
        memcpy(no, yes, (size_t)n);
        no[3] = 'x';
        assert_true(prism_grammar_accepts_bytes(g, (const uint8_t *)yes, (size_t)n));
        assert_false(prism_grammar_accepts_bytes(g, (const uint8_t *)yes, (size_t)n - 1));
        assert_false(prism_grammar_accepts_bytes(g, (const uint8_t *)no, (size_t)n));
        prism_grammar_release(g);
    }
    /* a 40,000-byte literal: a chain of 40,001 states (minimization and pruning were quadratic:
     * 372 s) */
    size_t len = 40000;
    char *lit = malloc(len + 1);
    for (size_t i = 0; i < len; i++) lit[i] = "ab"[i & 1];
    lit[len] = 0;
    double t0 = prism_now_s();
    assert_int_equal(prism_grammar_compile_regex(T.v, lit, len, NULL, &g, &err), PRISM_OK);
    double dt = prism_now_s() - t0;
    if (dt > 2.0) fail_msg("a %zu-byte literal took %.3f s to compile", len, dt);
    assert_int_equal(prism_grammar_n_states(g), len + 1);
    prism_grammar_release(g);
    /* the budgets: memory, then time */
    prism_grammar_limits_t lim = { .max_compile_bytes = 1 << 16 };
    assert_int_equal(prism_grammar_compile_regex(T.v, lit, len, &lim, &g, &err), PRISM_ELIMIT);
    assert_non_null(strstr(err.message, "memory"));
    lim = (prism_grammar_limits_t){ .max_compile_ms = 1 };
    for (size_t i = 0; i < len / 2; i++) lit[i] = (char)('a' + i % 20);   /* not one run of a repeat */
    char *big = malloc(len * 8 + 16);
    size_t nb = 0;
    for (int i = 0; i < 8; i++) { memcpy(big + nb, lit, len); nb += len; big[nb++] = '|'; }
    big[nb - 1] = 0;
    lim.max_schema_bytes = (int)nb;
    lim.max_states = 1 << 20;
    assert_int_equal(prism_grammar_compile_regex(T.v, big, nb - 1, &lim, &g, &err), PRISM_ELIMIT);
    assert_non_null(strstr(err.message, "ms"));
    free(big);
    free(lit);
}

/* One mask's work is bounded (limits.max_mask_work): a matcher simulating an NFA rule with many
 * live states needs a cache fill per new state, each a walk over the vocabulary. */
static void test_mask_work_bounded(void **s)
{
    (void)s;
    prism_grammar_t *g;
    prism_grammar_error_t err;
    const char *rx = "(\\w|\\s)*a(\\w|\\s){200}";
    assert_int_equal(prism_grammar_compile_regex(T.v, rx, strlen(rx), NULL, &g, &err), PRISM_OK);
    int32_t *mask = calloc(prism_grammar_mask_words(T.v), sizeof *mask);
    for (int pass = 0; pass < 2; pass++) {
        prism_grammar_limits_t lim = { .max_mask_work = pass ? 0 : 2000 };
        prism_grammar_matcher_t *m;
        assert_int_equal(prism_grammar_matcher_create(g, &lim, &m), PRISM_OK);
        int rc = 0;
        for (int i = 0; i < 40 && rc >= 0; i++) {
            rc = prism_grammar_matcher_fill_mask(m, mask);
            if (rc > 0) assert_int_equal(prism_grammar_matcher_accept_bytes(m, (const uint8_t *)(i % 3 ? "a" : " "), 1), PRISM_OK);
        }
        if (pass == 0) assert_int_equal(rc, PRISM_ELIMIT);   /* past the small budget */
        else assert_true(rc > 0);                            /* the default allows it */
        prism_grammar_matcher_free(m);
    }
    free(mask);
    prism_grammar_release(g);
}

/* Mutation fuzz: random edits of valid schemas and regexes compile or fail cleanly. */
static void test_fuzz(void **s)
{
    (void)s;
    uint64_t r = 42;
    int ok = 0, bad = 0;
    for (int i = 0; i < 600; i++) {
        char *schema = gt_random_schema((uint64_t)i);
        size_t n = strlen(schema);
        for (int k = 0; k < 1 + gt_randint(&r, 4); k++) {
            size_t p = (size_t)gt_randint(&r, (int)n);
            static const char CH[] = "{}[]\",:0123456789abcdeftrunl\\-*+?()|^$";
            schema[p] = CH[gt_randint(&r, (int)sizeof CH - 1)];
        }
        prism_grammar_t *g = NULL;
        prism_grammar_error_t err;
        int rc = prism_grammar_compile_json_schema(T.v, schema, n, NULL, NULL, &g, &err);
        if (rc == PRISM_OK) {
            ok++;
            prism_grammar_matcher_t *m;
            assert_int_equal(prism_grammar_matcher_create(g, NULL, &m), PRISM_OK);
            int32_t mask[64];
            assert_true(prism_grammar_matcher_fill_mask(m, mask) > 0);
            prism_grammar_matcher_free(m);
            prism_grammar_release(g);
        } else {
            bad++;
            assert_true(err.message[0] != 0);
            assert_null(g);
        }
        free(schema);
    }
    fprintf(stderr, "fuzz: %d compiled, %d rejected\n", ok, bad);
    assert_true(ok > 0 && bad > 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_schemas),
        cmocka_unit_test(test_limits),
        cmocka_unit_test(test_bad_regex_choice),
        cmocka_unit_test(test_compile_cost_bounded),
        cmocka_unit_test(test_mask_work_bounded),
        cmocka_unit_test(test_fuzz),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
