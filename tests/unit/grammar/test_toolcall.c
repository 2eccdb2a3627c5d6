/* Tool-call parsers: expected results on known texts (hermes, pythonic incl. Python literal ->
 * JSON), streaming agrees with whole-text parsing at every split point and on random chunkings,
 * and grammars for tool_choice "required" / a named function produce calls that parse and whose
 * arguments validate against the declared parameters. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "gram_test_util.h"
#include "toolcall/toolcall.h"

typedef struct {
    prism_toolcall_format_t fmt;
    const char *text;
    const char *content;        /* expected content */
    int n_calls;
    const char *name[3];
    const char *args[3];        /* expected arguments JSON text */
    bool ok;
} tc_case_t;

static const tc_case_t CASES[] = {
    { PRISM_TOOLCALL_HERMES, "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>",
      "Let me check.\n", 1, { "get_weather" }, { "{\"city\": \"Paris\", \"unit\": \"c\"}" }, true },
    { PRISM_TOOLCALL_HERMES, "<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call>\n<tool_call>{\"arguments\": {\"x\": [1, {\"y\": \"}\"}]}, \"name\": \"b\"}</tool_call>",
      "", 2, { "a", "b" }, { "{}", "{\"x\": [1, {\"y\": \"}\"}]}" }, true },
    { PRISM_TOOLCALL_HERMES, "no tools here, just <tool text> and < tool_call >", "no tools here, just <tool text> and < tool_call >", 0, {0}, {0}, true },
    { PRISM_TOOLCALL_HERMES, "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"q\\\": \\\"\\\\u00e9\\\"}\"}</tool_call>",
      "", 1, { "f" }, { "{\"q\": \"\\u00e9\"}" }, true },
    { PRISM_TOOLCALL_HERMES, "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}", "", 1, { "f" }, { "{\"a\": 1}" }, true },
    { PRISM_TOOLCALL_HERMES, "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}} trailing", "trailing", 1, { "f" }, { "{\"a\": 1}" }, false },
    { PRISM_TOOLCALL_HERMES, "<tool_call>{\"arguments\": {\"a\": 1", "", 0, {0}, {0}, false },
    { PRISM_TOOLCALL_HERMES, "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": [1, 2", "", 1, { "f" }, { "{\"a\": [1, 2" }, false },
    { PRISM_TOOLCALL_HERMES, "x <tool_call>oops</tool_call>", "x oops</tool_call>", 0, {0}, {0}, false },
    { PRISM_TOOLCALL_HERMES, "<tool_call>{\"name\": \"f\"}</tool_call>\n\n And then.\n", "\n\n And then.\n", 1, { "f" }, { "{}" }, true },
    { PRISM_TOOLCALL_HERMES, "<tool_call>{\"name\": \"f\"}</tool_call> \n ", "", 1, { "f" }, { "{}" }, true },
    { PRISM_TOOLCALL_HERMES, "<tool_call>{\"name\": \"f\", \"id\": 7, \"arguments\": 5}</tool_call>", "", 1, { "f" }, { "5" }, true },
    { PRISM_TOOLCALL_PYTHONIC, "[get_weather(city='Paris', days=3), get_time()]", "", 2, { "get_weather", "get_time" },
      { "{\"city\": \"Paris\", \"days\": 3}", "{}" }, true },
    { PRISM_TOOLCALL_PYTHONIC, "<|python_start|>[f(a=True, b=None, c=[1, 2.5, -3e2], d={'k': (1, 'x'), \"z\": {}}, e=\"q\\\"uote\\n\", g='\\u00e9\\x41')]<|python_end|>",
      "", 1, { "f" }, { "{\"a\": true, \"b\": null, \"c\": [1, 2.5, -3e2], \"d\": {\"k\": [1, \"x\"], \"z\": {}}, \"e\": \"q\\\"uote\\n\", \"g\": \"\xc3\xa9" "A\"}" }, true },
    { PRISM_TOOLCALL_PYTHONIC, "  [ f ( a = 1 , ) , ]  ", "", 1, { "f" }, { "{\"a\": 1}" }, true },
    { PRISM_TOOLCALL_PYTHONIC, "The weather is nice.", "The weather is nice.", 0, {0}, {0}, true },
    { PRISM_TOOLCALL_PYTHONIC, "[f(a=1.)] then text", "then text", 1, { "f" }, { "{\"a\": 1.0}" }, true },
    { PRISM_TOOLCALL_PYTHONIC, "[f(a=01)]", "01)]", 1, { "f" }, { "{\"a\": " }, false },
    { PRISM_TOOLCALL_PYTHONIC, "[f(a='unterminated", "", 1, { "f" }, { "{\"a\": \"unterminated" }, false },
    { PRISM_TOOLCALL_PYTHONIC, "[f(x=[[], {}, ()], y='it\\'s', z=\"tab\\there\")]", "", 1, { "f" },
      { "{\"x\": [[], {}, []], \"y\": \"it's\", \"z\": \"tab\\there\"}" }, true },
    { PRISM_TOOLCALL_PYTHONIC, "[f(1)]", "1)]", 1, { "f" }, { "{" }, false },
};

static void check_case(const tc_case_t *c, const prism_toolcall_result_t *r)
{
    if (r->content.len != strlen(c->content) || memcmp(r->content.data ? r->content.data : "", c->content, r->content.len))
        fail_msg("%s: content '%.*s', want '%s'", c->text, (int)r->content.len, r->content.data, c->content);
    if ((int)r->n_calls != c->n_calls) fail_msg("%s: %zu calls, want %d", c->text, r->n_calls, c->n_calls);
    for (int i = 0; i < c->n_calls; i++) {
        assert_string_equal(r->calls[i].name, c->name[i]);
        const prism_buf_t *a = &r->calls[i].arguments;
        if (a->len != strlen(c->args[i]) || memcmp(a->data ? a->data : "", c->args[i], a->len))
            fail_msg("%s: call %d args '%.*s', want '%s'", c->text, i, (int)a->len, a->data, c->args[i]);
        assert_int_equal(strlen(r->calls[i].id), 29);
        assert_memory_equal(r->calls[i].id, "call_", 5);
    }
    if (r->ok != c->ok) fail_msg("%s: ok %d, want %d", c->text, r->ok, c->ok);
}

static void test_whole(void **s)
{
    (void)s;
    for (size_t i = 0; i < PRISM_ARRAY_LEN(CASES); i++) {
        prism_toolcall_result_t r;
        assert_int_equal(prism_toolcall_parse(CASES[i].fmt, CASES[i].text, strlen(CASES[i].text), 99, 0, &r), PRISM_OK);
        check_case(&CASES[i], &r);
        /* complete calls parse as JSON objects */
        for (size_t k = 0; k < r.n_calls && CASES[i].ok; k++) {
            json_t *j = json_loadb(r.calls[k].arguments.data, r.calls[k].arguments.len, JSON_DECODE_ANY, NULL);
            assert_non_null(j);
            json_decref(j);
        }
        prism_toolcall_result_free(&r);
    }
}

/* Streaming: feed in chunks, collect events the way the router would build SSE deltas. */
typedef struct {
    prism_toolcall_result_t r;
    int begins;
    bool args_before_begin;
} stream_t;

static void on_event(void *ud, const prism_toolcall_event_t *ev)
{
    stream_t *s = ud;
    switch (ev->kind) {
    case PRISM_TC_CONTENT: prism_buf_append(&s->r.content, ev->text, ev->len); break;
    case PRISM_TC_CALL_BEGIN: {
        assert_int_equal(ev->index, (int)s->r.n_calls);
        s->r.calls = realloc(s->r.calls, (s->r.n_calls + 1) * sizeof *s->r.calls);
        memset(&s->r.calls[s->r.n_calls], 0, sizeof *s->r.calls);
        snprintf(s->r.calls[s->r.n_calls].id, 32, "%s", ev->id);
        s->r.calls[s->r.n_calls].name = strdup(ev->name);
        s->r.n_calls++;
        s->begins++;
        break;
    }
    case PRISM_TC_ARGS:
        if (ev->index < 0 || ev->index >= (int)s->r.n_calls) { s->args_before_begin = true; break; }
        assert_true(ev->len > 0);
        prism_buf_append(&s->r.calls[ev->index].arguments, ev->text, ev->len);
        break;
    }
}

static void stream_free(stream_t *s)
{
    for (size_t i = 0; i < s->r.n_calls; i++) {
        free(s->r.calls[i].name);
        prism_buf_free(&s->r.calls[i].arguments);
    }
    free(s->r.calls);
    prism_buf_free(&s->r.content);
}

static void stream_parse_max(prism_toolcall_format_t fmt, const char *text, const size_t *cuts, size_t n_cuts,
                             int max_calls, stream_t *s)
{
    memset(s, 0, sizeof *s);
    prism_toolcall_parser_t *p;
    assert_int_equal(prism_toolcall_parser_create(fmt, 99, 0, max_calls, on_event, s, &p), PRISM_OK);
    size_t at = 0, len = strlen(text);
    for (size_t i = 0; i <= n_cuts; i++) {
        size_t end = i < n_cuts ? cuts[i] : len;
        assert_int_equal(prism_toolcall_parser_feed(p, text + at, end - at), PRISM_OK);
        at = end;
    }
    assert_int_equal(prism_toolcall_parser_finish(p), PRISM_OK);
    s->r.ok = prism_toolcall_parser_ok(p);
    prism_toolcall_parser_free(p);
}

static void stream_parse(prism_toolcall_format_t fmt, const char *text, const size_t *cuts, size_t n_cuts, stream_t *s)
{
    stream_parse_max(fmt, text, cuts, n_cuts, 0, s);
}

static void same(const char *text, const prism_toolcall_result_t *w, const stream_t *s, const char *how)
{
    if (s->args_before_begin) fail_msg("%s (%s): arguments before the call began", text, how);
    if (w->content.len != s->r.content.len || memcmp(w->content.data ? w->content.data : "", s->r.content.data ? s->r.content.data : "", w->content.len))
        fail_msg("%s (%s): streamed content '%.*s' != '%.*s'", text, how, (int)s->r.content.len, s->r.content.data,
                 (int)w->content.len, w->content.data);
    assert_int_equal(w->n_calls, s->r.n_calls);
    for (size_t i = 0; i < w->n_calls; i++) {
        assert_string_equal(w->calls[i].id, s->r.calls[i].id);
        assert_string_equal(w->calls[i].name, s->r.calls[i].name);
        const prism_buf_t *a = &w->calls[i].arguments, *b = &s->r.calls[i].arguments;
        if (a->len != b->len || memcmp(a->data ? a->data : "", b->data ? b->data : "", a->len))
            fail_msg("%s (%s): streamed args '%.*s' != '%.*s'", text, how, (int)b->len, b->data, (int)a->len, a->data);
    }
    assert_int_equal(w->ok, s->r.ok);
}

static void check_all_splits(prism_toolcall_format_t fmt, const char *text, uint64_t seed)
{
    prism_toolcall_result_t w;
    assert_int_equal(prism_toolcall_parse(fmt, text, strlen(text), 99, 0, &w), PRISM_OK);
    size_t len = strlen(text);
    stream_t s;
    /* every single split point */
    for (size_t cut = 0; cut <= len; cut++) {
        stream_parse(fmt, text, &cut, 1, &s);
        same(text, &w, &s, "one split");
        stream_free(&s);
    }
    /* byte by byte */
    size_t *cuts = malloc((len + 1) * sizeof *cuts);
    for (size_t i = 0; i < len; i++) cuts[i] = i;
    stream_parse(fmt, text, cuts, len, &s);
    same(text, &w, &s, "bytes");
    stream_free(&s);
    /* random chunkings */
    uint64_t r = seed;
    for (int k = 0; k < 20; k++) {
        size_t n = 0, at = 0;
        while (at < len) {
            at += 1 + (size_t)gt_randint(&r, 7);
            if (at < len) cuts[n++] = at;
        }
        stream_parse(fmt, text, cuts, n, &s);
        same(text, &w, &s, "random");
        stream_free(&s);
    }
    free(cuts);
    prism_toolcall_result_free(&w);
}

static void test_stream_agrees(void **st)
{
    (void)st;
    for (size_t i = 0; i < PRISM_ARRAY_LEN(CASES); i++) check_all_splits(CASES[i].fmt, CASES[i].text, i);
}

/* ---- grammars forcing calls ---- */
static const char TOOLS[] =
    "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"d\",\"parameters\":{\"type\":\"object\","
    "\"properties\":{\"city\":{\"type\":\"string\",\"maxLength\":12},\"unit\":{\"enum\":[\"c\",\"f\"]},\"days\":{\"type\":\"integer\"}},"
    "\"required\":[\"city\"]}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"search\",\"parameters\":{\"type\":\"object\",\"properties\":{"
    "\"q\":{\"type\":\"string\"},\"filters\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/f\"},\"maxItems\":2},"
    "\"exact\":{\"type\":\"boolean\"}},\"required\":[\"q\",\"exact\"],\"$defs\":{\"f\":{\"type\":\"object\",\"properties\":"
    "{\"k\":{\"type\":\"string\"},\"v\":{\"type\":[\"number\",\"null\"]}},\"required\":[\"k\",\"v\"],\"additionalProperties\":false}}}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"now\"}}]";

static void run_forced(const gt_tok_t *t, prism_toolcall_format_t fmt, const char *only, bool parallel, int walks)
{
    prism_grammar_t *g;
    prism_grammar_error_t err;
    if (prism_toolcall_grammar(fmt, t->v, TOOLS, strlen(TOOLS), only, parallel, NULL, &g, &err) < 0)
        fail_msg("grammar: %s %s", err.path, err.message);
    json_t *tools = json_loads(TOOLS, 0, NULL);
    prism_grammar_matcher_t *m;
    assert_int_equal(prism_grammar_matcher_create(g, NULL, &m), PRISM_OK);
    size_t nv = prism_grammar_vocab_size(t->v);
    int32_t *mask = malloc(prism_grammar_mask_words(t->v) * sizeof *mask), *allowed = malloc(nv * sizeof *allowed);
    int done = 0;
    for (int w = 0; w < walks; w++) {
        prism_grammar_matcher_reset(m);
        gt_walk_t wk = {0};
        assert_true(gt_walk(m, t, (uint64_t)w * 7 + fmt, 600, &wk, mask, allowed));
        if (!wk.terminated) { if (getenv("TC_DEBUG")) fprintf(stderr, "unterminated: %.*s\n", (int)wk.out.len, wk.out.data); prism_buf_free(&wk.out); continue; }
        done++;
        prism_toolcall_result_t r;
        assert_int_equal(prism_toolcall_parse(fmt, wk.out.data, wk.out.len, 1, 0, &r), PRISM_OK);
        if (!r.ok || r.n_calls == 0 || r.content.len)
            fail_msg("forced output did not parse as calls only (ok %d, %zu calls, content %zu): %.*s", r.ok, r.n_calls, r.content.len, (int)wk.out.len, wk.out.data);
        if (!parallel) assert_int_equal(r.n_calls, 1);
        for (size_t k = 0; k < r.n_calls; k++) {
            if (only) assert_string_equal(r.calls[k].name, only);
            json_t *params = NULL;
            for (size_t i = 0; i < json_array_size(tools); i++) {
                json_t *f = json_object_get(json_array_get(tools, i), "function");
                if (!strcmp(json_string_value(json_object_get(f, "name")), r.calls[k].name)) {
                    params = json_object_get(f, "parameters");
                    if (!params) params = json_pack("{s:s,s:{},s:b}", "type", "object", "properties", "additionalProperties", 0);
                    else json_incref(params);
                }
            }
            if (!params) fail_msg("called unknown tool %s", r.calls[k].name);
            json_t *args = json_loadb(r.calls[k].arguments.data, r.calls[k].arguments.len, 0, NULL);
            if (!args) fail_msg("arguments are not JSON: %.*s", (int)r.calls[k].arguments.len, r.calls[k].arguments.data);
            const char *why = gt_validate(params, params, args, 0);
            if (why) fail_msg("arguments do not validate (%s): %.*s", why, (int)wk.out.len, wk.out.data);
            json_decref(args);
            json_decref(params);
        }
        prism_toolcall_result_free(&r);
        prism_buf_free(&wk.out);
    }
    if (done * 2 < walks) fail_msg("format %d only=%s parallel=%d vocab %zu: %d of %d walks ended", fmt, only ? only : "-", parallel, nv, done, walks);
    free(mask);
    free(allowed);
    json_decref(tools);
    prism_grammar_matcher_free(m);
    prism_grammar_release(g);
}

static void test_forced_calls(void **st)
{
    (void)st;
    gt_tok_t syn, tiny;
    gt_tok_synth(3, 5000, &syn);
    assert_true(gt_tok_load(&GT_TOKS[0], &tiny));
    const gt_tok_t *toks[2] = { &syn, &tiny };
    for (int k = 0; k < 2; k++)
        for (int f = 0; f < 2; f++) {
            run_forced(toks[k], (prism_toolcall_format_t)f, NULL, false, 12);
            run_forced(toks[k], (prism_toolcall_format_t)f, NULL, true, 12);
            run_forced(toks[k], (prism_toolcall_format_t)f, "search", false, 8);
            run_forced(toks[k], (prism_toolcall_format_t)f, "now", true, 4);
        }
    gt_tok_free(&syn);
    gt_tok_free(&tiny);
}

static void test_forced_real(void **st)
{
    (void)st;
    gt_tok_t t;
    if (!gt_tok_load(&GT_TOKS[2], &t)) fail();  /* qwen3: hermes is its format (gt_run checked it is there) */
    run_forced(&t, PRISM_TOOLCALL_HERMES, NULL, true, 6);
    run_forced(&t, PRISM_TOOLCALL_PYTHONIC, "get_weather", false, 6);
    gt_tok_free(&t);
}

static void test_grammar_errors(void **st)
{
    (void)st;
    gt_tok_t t;
    gt_tok_synth(3, 600, &t);
    prism_grammar_t *g;
    prism_grammar_error_t err;
    static const struct { const char *tools, *only, *path, *word; } BAD[] = {
        { "[]", NULL, "tools", "non-empty" },
        { "{\"a\":1}", NULL, "tools", "non-empty" },
        { "[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]", "g", "tool_choice.function.name", "'g'" },
        { "[{\"type\":\"function\",\"function\":{\"name\":\"\"}}]", NULL, "tools[0].function.name", "1 to 64" },
        { "[{\"type\":\"retrieval\"}]", NULL, "tools[0]", "function" },
        { "[{\"type\":\"function\",\"function\":{\"name\":\"f\"}},{\"type\":\"function\",\"function\":{\"name\":\"g\","
          "\"parameters\":{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"integer\",\"minimum\":1}}}}}]", NULL,
          "tools[1].function.parameters", "minimum" },
    };
    for (int f = 0; f < 2; f++)
        for (size_t i = 0; i < PRISM_ARRAY_LEN(BAD); i++) {
            int rc = prism_toolcall_grammar((prism_toolcall_format_t)f, t.v, BAD[i].tools, strlen(BAD[i].tools),
                                            BAD[i].only, false, NULL, &g, &err);
            if (rc >= 0 || strncmp(err.path, BAD[i].path, strlen(BAD[i].path)) || !strstr(err.message, BAD[i].word))
                fail_msg("%s: rc %d path '%s' msg '%s'", BAD[i].tools, rc, err.path, err.message);
        }
    const char *kw = "[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"type\":\"object\",\"properties\":{\"a-b\":{}}}}}]";
    assert_int_equal(prism_toolcall_grammar(PRISM_TOOLCALL_PYTHONIC, t.v, kw, strlen(kw), NULL, false, NULL, &g, &err), PRISM_EINVAL);
    assert_int_equal(prism_toolcall_grammar(PRISM_TOOLCALL_HERMES, t.v, kw, strlen(kw), NULL, false, NULL, &g, &err), PRISM_OK);
    prism_grammar_release(g);
    assert_int_equal(prism_toolcall_format_parse("pythonic"), PRISM_TOOLCALL_PYTHONIC);
    assert_int_equal(prism_toolcall_format_parse("hermes"), PRISM_TOOLCALL_HERMES);
    assert_int_equal(prism_toolcall_format_parse("mistral"), -1);
    /* input bound */
    prism_toolcall_parser_t *p;
    stream_t s = {0};
    assert_int_equal(prism_toolcall_parser_create(PRISM_TOOLCALL_HERMES, 1, 16, 0, on_event, &s, &p), PRISM_OK);
    assert_int_equal(prism_toolcall_parser_feed(p, "0123456789", 10), PRISM_OK);
    assert_int_equal(prism_toolcall_parser_feed(p, "0123456789", 10), PRISM_ELIMIT);
    prism_toolcall_parser_free(p);
    stream_free(&s);
    gt_tok_free(&t);
}

/* Random texts around the markers: whatever the parser decides, streaming agrees. */
static void test_stream_fuzz(void **st)
{
    (void)st;
    static const char *const PIECES[] = { "<tool_call>", "</tool_call>", "{", "}", "\"name\"", "\"arguments\"", ":", ",",
                                          " ", "\"f\"", "[", "]", "(", ")", "a=", "'x'", "1", "True", "\\", "<", "<tool",
                                          "\"", "\n", "<|python_start|>", "g", "{\"k\": [1]}" };
    uint64_t r = 11;
    char text[256];
    for (int i = 0; i < 300; i++) {
        size_t n = 0;
        int parts = 1 + gt_randint(&r, 12);
        for (int k = 0; k < parts; k++) {
            const char *p = PIECES[gt_randint(&r, (int)PRISM_ARRAY_LEN(PIECES))];
            if (n + strlen(p) >= sizeof text) break;
            memcpy(text + n, p, strlen(p));
            n += strlen(p);
        }
        text[n] = 0;
        check_all_splits((prism_toolcall_format_t)(i & 1), text, (uint64_t)i);
    }
}

/* parallel_tool_calls false (max_calls 1): only the first call comes back, whole and streamed
 * alike; the calls after it are still parsed, so their text never turns into content. */
static void test_max_calls(void **st)
{
    (void)st;
    static const struct { prism_toolcall_format_t fmt; const char *text, *content, *args; } T[] = {
        { PRISM_TOOLCALL_HERMES, "Sure.\n<tool_call>{\"name\": \"a\", \"arguments\": {\"x\": 1}}</tool_call>\n"
          "<tool_call>{\"name\": \"b\", \"arguments\": {\"y\": 2}}</tool_call>", "Sure.\n", "{\"x\": 1}" },
        { PRISM_TOOLCALL_PYTHONIC, "[a(x=1), b(y=2), c()]", "", "{\"x\": 1}" },
    };
    assert_int_equal(prism_toolcall_parser_create(PRISM_TOOLCALL_HERMES, 1, 0, -1, on_event, NULL,
                                                  &(prism_toolcall_parser_t *){NULL}), PRISM_EINVAL);
    for (size_t i = 0; i < PRISM_ARRAY_LEN(T); i++) {
        prism_toolcall_result_t all, one;
        assert_int_equal(prism_toolcall_parse(T[i].fmt, T[i].text, strlen(T[i].text), 99, 0, &all), PRISM_OK);
        assert_true(all.n_calls >= 2);
        assert_int_equal(prism_toolcall_parse(T[i].fmt, T[i].text, strlen(T[i].text), 99, 1, &one), PRISM_OK);
        assert_int_equal(one.n_calls, 1);
        assert_string_equal(one.calls[0].name, "a");
        assert_string_equal(one.calls[0].id, all.calls[0].id);
        assert_int_equal(one.calls[0].arguments.len, strlen(T[i].args));
        assert_memory_equal(one.calls[0].arguments.data, T[i].args, strlen(T[i].args));
        assert_int_equal(one.content.len, strlen(T[i].content));
        if (one.content.len) assert_memory_equal(one.content.data, T[i].content, one.content.len);
        assert_true(one.ok);
        /* streamed byte by byte: the same single call */
        size_t len = strlen(T[i].text), *cuts = malloc(len * sizeof *cuts);
        for (size_t k = 0; k < len; k++) cuts[k] = k;
        stream_t s;
        stream_parse_max(T[i].fmt, T[i].text, cuts, len, 1, &s);
        same(T[i].text, &one, &s, "bytes, one call");
        stream_free(&s);
        free(cuts);
        prism_toolcall_result_free(&all);
        prism_toolcall_result_free(&one);
    }
}

/* Streaming stays linear (issue 26 finding 8): a long unfinished string, identifier, scalar or
 * run of whitespace fed in small deltas is scanned once, not from its start on every delta (which
 * took minutes at 1 MiB). Each text is fed 16 bytes at a time with a 3 s deadline; the last piece
 * finishes the construct, and the streamed result equals the whole-text parse. */
static void test_stream_linear(void **st)
{
    (void)st;
    static const struct { prism_toolcall_format_t fmt; const char *head, fill, *tail; size_t calls; } T[] = {
        { PRISM_TOOLCALL_HERMES, "<tool_call>{\"", 'k', "\": 1, \"name\": \"f\"}</tool_call>", 1 },   /* a key */
        { PRISM_TOOLCALL_HERMES, "<tool_call>{\"name\": \"", 'n', "\"}</tool_call>", 1 },            /* the name */
        { PRISM_TOOLCALL_HERMES, "<tool_call>{\"name\": \"f\"}", ' ', "</tool_call>", 1 },            /* whitespace */
        { PRISM_TOOLCALL_HERMES, "<tool_call>{\"name\": \"f\", \"x\": \"", '\\', "\"}</tool_call>", 1 }, /* escapes */
        { PRISM_TOOLCALL_PYTHONIC, "[", 'a', "()]", 0 },          /* an identifier (past 200 characters: content) */
        { PRISM_TOOLCALL_PYTHONIC, "[f(x=", '7', ")]", 1 },       /* a scalar */
        { PRISM_TOOLCALL_PYTHONIC, "", ' ', "[f()]", 1 },         /* leading whitespace */
    };
    const size_t fill = 1u << 19;
    for (size_t t = 0; t < PRISM_ARRAY_LEN(T); t++) {
        prism_buf_t text = {0};
        prism_buf_append_str(&text, T[t].head);
        for (size_t i = 0; i < fill; i++) prism_buf_append(&text, &T[t].fill, 1);
        prism_buf_append_str(&text, T[t].tail);
        stream_t sm;
        memset(&sm, 0, sizeof sm);
        prism_toolcall_parser_t *p;
        assert_int_equal(prism_toolcall_parser_create(T[t].fmt, 99, text.len + 1, 0, on_event, &sm, &p), PRISM_OK);
        double t0 = prism_now_s();
        for (size_t at = 0; at < text.len; at += 16) {
            assert_int_equal(prism_toolcall_parser_feed(p, text.data + at, PRISM_MIN(16, text.len - at)), PRISM_OK);
            if ((at & 0xffff) == 0 && prism_now_s() - t0 > 3.0)
                fail_msg("case %zu: %zu of %zu bytes fed in 3 s: quadratic", t, at, text.len);
        }
        assert_int_equal(prism_toolcall_parser_finish(p), PRISM_OK);
        sm.r.ok = prism_toolcall_parser_ok(p);
        prism_toolcall_parser_free(p);
        /* the same as the whole text in one piece */
        prism_toolcall_result_t w;
        assert_int_equal(prism_toolcall_parse(T[t].fmt, text.data, text.len, 99, 0, &w), PRISM_OK);
        assert_true(w.n_calls == T[t].calls && w.ok == (T[t].calls > 0));
        same(T[t].head, &w, &sm, "16-byte deltas");
        stream_free(&sm);
        prism_toolcall_result_free(&w);
        prism_buf_free(&text);
    }
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_whole),
        cmocka_unit_test(test_stream_agrees),
        cmocka_unit_test(test_max_calls),
        cmocka_unit_test(test_stream_fuzz),
        cmocka_unit_test(test_stream_linear),
        cmocka_unit_test(test_grammar_errors),
        cmocka_unit_test(test_forced_calls),
    };
    /* on the shared tokenizers: their own entry, Skipped (77) without them (gt_run) */
    const struct CMUnitTest shared[] = {
        cmocka_unit_test(test_forced_real),
    };
    return gt_run(argc, argv, "test_toolcall", tests, PRISM_ARRAY_LEN(tests), shared, PRISM_ARRAY_LEN(shared));
}
