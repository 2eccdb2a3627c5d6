/* The guide cache (common/guide): one compile per distinct guide, hits for equal ones, eviction
 * of the least recently used past its bounds without freeing a guide still in use, errors with
 * the place inside the text, and the prefix the router turns into the 400's param. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "guide/guide.h"
#include "tokenizer/tokenizer.h"
#include "toolcall/toolcall.h"

#define TOK PRISM_SOURCE_DIR "/models/prism-tiny-llava/tokenizer.json"

static prism_tokenizer_t *g_tok;
static prism_grammar_vocab_t *g_v;

static int setup(void **state)
{
    (void)state;
    char err[256];
    if (prism_tokenizer_load(TOK, &g_tok, err, sizeof err) != PRISM_OK) return -1;
    int32_t eos = 1;
    return prism_grammar_vocab_create(g_tok, &eos, 1, 0, &g_v) == PRISM_OK ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    prism_grammar_vocab_free(g_v);
    prism_tokenizer_free(g_tok);
    return 0;
}

static prism_guide_spec_t schema(const char *s)
{
    return (prism_guide_spec_t){.kind = PRISM_GUIDE_JSON_SCHEMA, .text = s, .len = strlen(s)};
}

static void test_hits_misses_eviction(void **state)
{
    (void)state;
    size_t base = prism_mem_used();
    prism_guide_cache_t *c;
    assert_int_equal(prism_guide_cache_create(g_v, 2, 0, &c), PRISM_OK);
    prism_guide_t *a, *a2, *b, *d;
    prism_grammar_error_t err;
    prism_guide_spec_t sa = schema("{\"type\":\"integer\"}"), sb = schema("{\"type\":\"boolean\"}"),
                       sd = schema("{\"enum\":[\"x\",\"y\"]}");
    assert_int_equal(prism_guide_get(c, &sa, &a, &err), PRISM_OK);
    assert_int_equal(prism_guide_get(c, &sa, &a2, &err), PRISM_OK);
    assert_ptr_equal(a, a2);                                   /* equal text: the same compiled guide */
    assert_true(prism_grammar_accepts_bytes(prism_guide_grammar(a), (const uint8_t *)"-12", 3));
    assert_string_equal(prism_guide_spec(a)->text, sa.text);  /* the guide owns a copy of its text */
    prism_guide_release(a2);
    assert_int_equal(prism_guide_get(c, &sb, &b, &err), PRISM_OK);
    assert_int_equal(prism_guide_get(c, &sd, &d, &err), PRISM_OK);   /* 3rd entry: evicts a (least recent) */
    prism_guide_cache_stats_t st;
    prism_guide_cache_stats(c, &st);
    assert_int_equal(st.misses, 3);
    assert_int_equal(st.hits, 1);
    assert_int_equal(st.evictions, 1);
    assert_int_equal(st.entries, 2);
    /* a, evicted, is still usable by its holder */
    assert_true(prism_grammar_accepts_bytes(prism_guide_grammar(a), (const uint8_t *)"7", 1));
    prism_guide_release(a);
    /* the key is the whole spec: the same tools text with another function is another grammar */
    const char *tools = "[{\"type\":\"function\",\"function\":{\"name\":\"a\"}},"
                        "{\"type\":\"function\",\"function\":{\"name\":\"b\"}}]";
    prism_guide_spec_t ta = {.kind = PRISM_GUIDE_TOOLS, .text = tools, .len = strlen(tools), .tool_name = "a"};
    prism_guide_spec_t tb = ta;
    tb.tool_name = "b";
    prism_guide_t *ga, *gb;
    assert_int_equal(prism_guide_get(c, &ta, &ga, &err), PRISM_OK);
    assert_int_equal(prism_guide_get(c, &tb, &gb, &err), PRISM_OK);
    assert_ptr_not_equal(ga, gb);
    const char *call_b = "<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>";
    assert_false(prism_grammar_accepts_bytes(prism_guide_grammar(ga), (const uint8_t *)call_b, strlen(call_b)));
    assert_true(prism_grammar_accepts_bytes(prism_guide_grammar(gb), (const uint8_t *)call_b, strlen(call_b)));
    prism_guide_release(ga);
    prism_guide_release(gb);
    prism_guide_release(b);
    prism_guide_release(d);
    prism_guide_cache_destroy(c);
    assert_int_equal(prism_mem_used(), base);
}

static void test_text_bound(void **state)
{
    (void)state;
    prism_guide_cache_t *c;
    assert_int_equal(prism_guide_cache_create(g_v, 8, 40, &c), PRISM_OK);   /* 40 bytes of text in all */
    prism_guide_t *a, *b;
    prism_grammar_error_t err;
    prism_guide_spec_t sa = schema("{\"type\":\"string\",\"maxLength\":3}");   /* 32 bytes */
    prism_guide_spec_t sb = schema("{\"type\":\"string\",\"maxLength\":4}");
    assert_int_equal(prism_guide_get(c, &sa, &a, &err), PRISM_OK);
    assert_int_equal(prism_guide_get(c, &sb, &b, &err), PRISM_OK);
    prism_guide_cache_stats_t st;
    prism_guide_cache_stats(c, &st);
    assert_int_equal(st.entries, 1);
    assert_true(st.text_bytes <= 40);
    prism_guide_release(a);
    prism_guide_release(b);
    prism_guide_cache_destroy(c);
}

static void test_errors(void **state)
{
    (void)state;
    prism_guide_cache_t *c;
    assert_int_equal(prism_guide_cache_create(g_v, 0, 0, &c), PRISM_OK);
    prism_guide_t *g;
    prism_grammar_error_t err;
    prism_guide_spec_t s = schema("{\"type\":\"object\",\"properties\":{\"age\":{\"type\":\"integer\",\"minimum\":0}}}");
    assert_int_equal(prism_guide_get(c, &s, &g, &err), PRISM_ENOTSUP);
    assert_null(g);
    assert_non_null(strstr(err.path, "/properties/age"));
    s = schema("{\"type\":\"bogus\"}");
    assert_int_equal(prism_guide_get(c, &s, &g, &err), PRISM_EINVAL);
    /* too deep: 40 nested arrays */
    char deep[1024] = "";
    for (int i = 0; i < 40; i++) strcat(deep, "{\"type\":\"array\",\"items\":");
    strcat(deep, "{\"type\":\"integer\"}");
    for (int i = 0; i < 40; i++) strcat(deep, "}");
    s = schema(deep);
    assert_int_equal(prism_guide_get(c, &s, &g, &err), PRISM_ELIMIT);
    prism_guide_spec_t ch = {.kind = PRISM_GUIDE_CHOICE, .text = "[\"a\", 2]", .len = 8};
    assert_int_equal(prism_guide_get(c, &ch, &g, &err), PRISM_EINVAL);
    assert_string_equal(err.path, "[1]");
    ch.text = "[]";
    ch.len = 2;
    assert_int_equal(prism_guide_get(c, &ch, &g, &err), PRISM_EINVAL);
    prism_guide_spec_t re = {.kind = PRISM_GUIDE_REGEX, .text = "(a", .len = 2};
    assert_true(prism_guide_get(c, &re, &g, &err) < 0);
    /* forced tool call: a bad parameter schema names its tool; an unknown name names tool_choice */
    const char *tools = "[{\"type\":\"function\",\"function\":{\"name\":\"a\",\"parameters\":{\"type\":\"object\"}}},"
                        "{\"type\":\"function\",\"function\":{\"name\":\"b\",\"parameters\":{\"type\":\"nope\"}}}]";
    prism_guide_spec_t t = {.kind = PRISM_GUIDE_TOOLS, .text = tools, .len = strlen(tools), .tool_name = "a",
                            .tool_format = PRISM_TOOLCALL_HERMES};
    assert_int_equal(prism_guide_get(c, &t, &g, &err), PRISM_OK);   /* only a's parameters compile */
    prism_guide_release(g);
    t.tool_name = NULL;                                               /* required: any tool, b is bad */
    assert_true(prism_guide_get(c, &t, &g, &err) < 0);
    assert_memory_equal(err.path, "tools[1].function.parameters", strlen("tools[1].function.parameters"));
    t.tool_name = "zzz";
    assert_int_equal(prism_guide_get(c, &t, &g, &err), PRISM_EINVAL);
    assert_string_equal(err.path, "tool_choice.function.name");
    t.tool_name = "a";
    t.tool_format = 9;
    assert_int_equal(prism_guide_get(c, &t, &g, &err), PRISM_EINVAL);
    prism_guide_spec_t bad = {.kind = 42};
    assert_int_equal(prism_guide_get(c, &bad, &g, &err), PRISM_EINVAL);
    prism_guide_cache_stats_t st;
    prism_guide_cache_stats(c, &st);
    assert_int_equal(st.entries, 1);                                  /* failures are not cached */
    prism_guide_cache_destroy(c);
}

/* Threads sharing one cache (the router's preparation threads): every get answers, the counts
 * add up, and no entry is kept twice. */
typedef struct { prism_guide_cache_t *c; int id; int bad; } share_arg_t;

static void *share_thread(void *p)
{
    share_arg_t *a = p;
    static const char *const S[] = { "{\"type\":\"integer\"}", "{\"type\":\"boolean\"}", "{\"enum\":[\"x\",\"y\"]}",
                                     "{\"type\":\"string\",\"maxLength\":9}" };
    for (int i = 0; i < 200; i++) {
        prism_guide_spec_t sp = schema(S[(i + a->id) % 4]);
        prism_guide_t *g;
        prism_grammar_error_t err;
        if (prism_guide_get(a->c, &sp, &g, &err) != PRISM_OK || strcmp(prism_guide_spec(g)->text, sp.text)) {
            a->bad++;
            continue;
        }
        prism_guide_release(g);
    }
    return NULL;
}

static void test_shared_by_threads(void **state)
{
    (void)state;
    prism_guide_cache_t *c;
    assert_int_equal(prism_guide_cache_create(g_v, 3, 0, &c), PRISM_OK);
    pthread_t th[4];
    share_arg_t a[4];
    for (int i = 0; i < 4; i++) {
        a[i] = (share_arg_t){c, i, 0};
        assert_int_equal(pthread_create(&th[i], NULL, share_thread, &a[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(a[i].bad, 0);
    }
    prism_guide_cache_stats_t st;
    prism_guide_cache_stats(c, &st);
    assert_int_equal(st.hits + st.misses, 800);
    assert_true(st.entries <= 3);
    prism_guide_cache_destroy(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hits_misses_eviction),
        cmocka_unit_test(test_text_bound),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_shared_by_threads),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
