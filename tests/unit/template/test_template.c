/* Chat template interpreter tests.
 *
 * Goldens (the JSON files in tests/data/template) come from tools/gen_template_goldens.py, which renders with
 * transformers' own jinja2 environment; every comparison here is byte-exact. The golden files carry
 * the template sources, so nothing here needs the shared tokenizers folder (except the optional loader check).
 *
 * PRISM_TEMPLATE_FUZZ_ITERS overrides the number of fuzz iterations (default 3000).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/core.h"
#include "template/template.h"

#define FIXED_TIME "1721995200"

static json_t *load_golden(const char *name)
{
    char path[1024];
    const char *src = getenv("PRISM_SOURCE_DIR");
    snprintf(path, sizeof(path), "%s/tests/data/template/%s", src && *src ? src : PRISM_SOURCE_DIR, name);
    json_error_t jerr;
    json_t *j = json_load_file(path, 0, &jerr);
    if (!j) fail_msg("cannot load %s: %s", path, jerr.text);
    return j;
}

/* Prints where two renders diverge. */
static void show_diff(const char *name, const char *want, size_t wn, const char *got, size_t gn)
{
    size_t i = 0;
    while (i < wn && i < gn && want[i] == got[i]) i++;
    size_t from = i > 40 ? i - 40 : 0;
    fprintf(stderr, "MISMATCH %s at byte %zu (want %zu bytes, got %zu)\n  want: ", name, i, wn, gn);
    for (size_t k = from; k < wn && k < i + 40; k++) fputc(want[k] == '\n' ? '|' : want[k], stderr);
    fprintf(stderr, "\n  got:  ");
    for (size_t k = from; k < gn && k < i + 40; k++) fputc(got[k] == '\n' ? '|' : got[k], stderr);
    fputc('\n', stderr);
}

static size_t g_mem_start;

static int setup(void **state)
{
    (void)state;
    setenv("PRISM_TEMPLATE_FIXED_TIME", FIXED_TIME, 1);
    g_mem_start = prism_mem_used();
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    assert_int_equal(prism_mem_used(), g_mem_start); /* no leaks through the counting allocator */
    return 0;
}

/* ------------------------------------------------------------------ feature goldens */

/* Runs every {name, source, expected | error} entry of a feature golden file against its context. */
static void run_feature_file(const char *file)
{
    json_t *g = load_golden(file);
    json_t *ctx = json_object_get(g, "context");
    json_t *feats = json_object_get(g, "features");
    assert_true(json_is_array(feats));
    int failures = 0, n_ok = 0, n_err = 0;
    size_t i;
    json_t *f;
    json_array_foreach(feats, i, f) {
        const char *name = json_string_value(json_object_get(f, "name"));
        json_t *src = json_object_get(f, "source");
        json_t *exp = json_object_get(f, "expected");
        const char *error = json_string_value(json_object_get(f, "error"));
        char err[512];
        prism_template_t *t = NULL;
        int rc = prism_template_compile(json_string_value(src), json_string_length(src), &t, err, sizeof(err));
        if (error && !strncmp(error, "compile:", 8)) {
            if (rc == 0) {
                fprintf(stderr, "FEATURE %s: compiled but jinja2 rejects it (%s)\n", name, error);
                failures++;
                prism_template_free(t);
            } else {
                n_err++;
            }
            continue;
        }
        if (rc) {
            fprintf(stderr, "FEATURE %s: compile failed: %s (%s)\n", name, err, prism_strerror(rc));
            failures++;
            continue;
        }
        prism_buf_t out = {0};
        rc = prism_template_render(t, ctx, &out, err, sizeof(err));
        if (error) {
            if (rc == 0) {
                fprintf(stderr, "FEATURE %s: rendered '%.*s' but jinja2 fails (%s)\n", name, (int)out.len,
                        out.data ? out.data : "", error);
                failures++;
            } else {
                n_err++;
            }
        } else if (rc) {
            fprintf(stderr, "FEATURE %s: render failed: %s\n", name, err);
            failures++;
        } else if (out.len != json_string_length(exp) || (out.len && memcmp(out.data, json_string_value(exp), out.len))) {
            show_diff(name, json_string_value(exp), json_string_length(exp), out.data ? out.data : "", out.len);
            failures++;
        } else {
            n_ok++;
        }
        prism_buf_free(&out);
        prism_template_free(t);
    }
    fprintf(stderr, "%s: %d identical, %d failing like jinja2, %d mismatches\n", file, n_ok, n_err, failures);
    json_decref(g);
    assert_int_equal(failures, 0);
}

static void test_features(void **state)
{
    (void)state;
    run_feature_file("feature_goldens.json");
}

/* seeded random expressions and whitespace-control soups (differential against jinja2) */
static void test_random_goldens(void **state)
{
    (void)state;
    run_feature_file("random_goldens.json");
}

/* ------------------------------------------------------------------ chat goldens */

static void test_chat_goldens(void **state)
{
    (void)state;
    json_t *g = load_golden("chat_goldens.json");
    json_t *tpls = json_object_get(g, "templates");
    assert_true(json_array_size(tpls) >= 5);
    int failures = 0, total = 0;
    size_t i;
    json_t *tj;
    json_array_foreach(tpls, i, tj) {
        const char *tname = json_string_value(json_object_get(tj, "name"));
        json_t *src = json_object_get(tj, "source");
        const char *bos = json_string_value(json_object_get(tj, "bos_token"));
        const char *eos = json_string_value(json_object_get(tj, "eos_token"));
        char err[512];
        prism_template_t *t = NULL;
        int rc = prism_template_compile(json_string_value(src), json_string_length(src), &t, err, sizeof(err));
        if (rc) {
            fprintf(stderr, "TEMPLATE %s: compile failed: %s\n", tname, err);
            failures++;
            continue;
        }
        json_t *cases = json_object_get(tj, "cases");
        assert_true(json_array_size(cases) >= 26);
        size_t k;
        json_t *cj;
        json_array_foreach(cases, k, cj) {
            const char *cname = json_string_value(json_object_get(cj, "name"));
            json_t *tools = json_object_get(cj, "tools");
            json_t *ctx = prism_template_chat_context(json_object_get(cj, "messages"),
                                                      json_is_null(tools) ? NULL : tools,
                                                      json_is_true(json_object_get(cj, "add_generation_prompt")),
                                                      bos, eos, json_object_get(cj, "extra"));
            assert_non_null(ctx);
            prism_buf_t out = {0};
            rc = prism_template_render(t, ctx, &out, err, sizeof(err));
            json_t *exp = json_object_get(cj, "expected");
            const char *error = json_string_value(json_object_get(cj, "error"));
            total++;
            if (error) {
                bool is_raise = strchr(error, ':') == NULL && strchr(error, '\'') == NULL;
                if (rc != PRISM_EINVAL) {
                    fprintf(stderr, "CHAT %s: expected failure '%s', got rc=%d\n", cname, error, rc);
                    failures++;
                } else if (is_raise && strcmp(err, error)) {
                    fprintf(stderr, "CHAT %s: raise_exception message '%s' != '%s'\n", cname, err, error);
                    failures++;
                }
            } else if (rc) {
                fprintf(stderr, "CHAT %s: render failed: %s\n", cname, err);
                failures++;
            } else if (out.len != json_string_length(exp) || (out.len && memcmp(out.data, json_string_value(exp), out.len))) {
                show_diff(cname, json_string_value(exp), json_string_length(exp), out.data ? out.data : "", out.len);
                failures++;
            }
            prism_buf_free(&out);
            json_decref(ctx);
        }
        prism_template_free(t);
    }
    fprintf(stderr, "chat goldens: %d conversations over %zu templates, %d mismatches\n", total,
            json_array_size(tpls), failures);
    json_decref(g);
    assert_int_equal(failures, 0);
}

/* The bundled model's template, loaded the way the router loads it, must match its goldens (which
 * embed the source they were made from: a differing source means the goldens are stale). */
static void test_bundled_model(void **state)
{
    (void)state;
    char path[1024];
    snprintf(path, sizeof(path), "%s/models/prism-tiny-llava/tokenizer_config.json", PRISM_SOURCE_DIR);
    if (!prism_file_exists(path)) {
        skip();
        return;
    }
    json_t *g = load_golden("chat_goldens.json");
    json_t *tj = NULL, *x;
    size_t i;
    json_array_foreach(json_object_get(g, "templates"), i, x)
        if (!strcmp(json_string_value(json_object_get(x, "name")), "prism_tiny_llava")) tj = x;
    if (!tj) fail_msg("no prism_tiny_llava goldens: run tools/gen_template_goldens.py");
    prism_template_t *t = NULL;
    char *bos = NULL, *eos = NULL, err[256];
    assert_int_equal(prism_template_load_from_tokenizer_config(path, &t, &bos, &eos, err, sizeof(err)), 0);
    size_t n;
    const char *src = prism_template_source(t, &n);
    json_t *gsrc = json_object_get(tj, "source");
    if (n != json_string_length(gsrc) || memcmp(src, json_string_value(gsrc), n))
        fail_msg("%s changed since the goldens were made: run tools/gen_template_goldens.py", path);
    json_t *cj;
    int failures = 0;
    json_array_foreach(json_object_get(tj, "cases"), i, cj) {
        json_t *ctx = prism_template_chat_context(json_object_get(cj, "messages"), NULL,
                                                  json_is_true(json_object_get(cj, "add_generation_prompt")), bos,
                                                  eos, json_object_get(cj, "extra"));
        prism_buf_t b = {0};
        json_t *exp = json_object_get(cj, "expected");
        if (prism_template_render(t, ctx, &b, err, sizeof(err)) || b.len != json_string_length(exp) ||
            (b.len && memcmp(b.data, json_string_value(exp), b.len)))
            failures++;
        prism_buf_free(&b);
        json_decref(ctx);
    }
    assert_int_equal(failures, 0);
    prism_template_free(t);
    prism_free(bos);
    prism_free(eos);
    json_decref(g);
}

/* ------------------------------------------------------------------ unsupported constructs */

static void expect_compile_error(const char *src, int want_rc, const char *needle)
{
    prism_template_t *t = NULL;
    char err[256];
    int rc = prism_template_compile(src, strlen(src), &t, err, sizeof(err));
    if (rc != want_rc || (needle && !strstr(err, needle)))
        fail_msg("compile '%s': rc=%d (%s) err='%s', want rc=%d mentioning '%s'", src, rc, prism_strerror(rc), err,
                 want_rc, needle ? needle : "");
    assert_null(t);
}

static void test_unsupported(void **state)
{
    (void)state;
    expect_compile_error("line1\n\n{{ x|xmlattr }}", PRISM_ENOTSUP, "unsupported filter 'xmlattr' at line 3");
    expect_compile_error("{{ x|urlize }}", PRISM_ENOTSUP, "'urlize'");
    expect_compile_error("{{ x|groupby('a') }}", PRISM_ENOTSUP, "'groupby'");
    expect_compile_error("{% if false %}{{ x|nosuchfilter }}{% endif %}", PRISM_ENOTSUP, "'nosuchfilter'");
    expect_compile_error("{{ x is filter }}", PRISM_ENOTSUP, "unsupported test 'filter'");
    expect_compile_error("{{ x|select('nosuchtest') }}", PRISM_ENOTSUP, "'nosuchtest'");
    expect_compile_error("{{ x|map('nosuchfilter') }}", PRISM_ENOTSUP, "'nosuchfilter'");
    expect_compile_error("{% include 'other.jinja' %}", PRISM_ENOTSUP, "unsupported tag 'include'");
    expect_compile_error("{% extends 'base' %}", PRISM_ENOTSUP, "'extends'");
    expect_compile_error("{% block body %}{% endblock %}", PRISM_ENOTSUP, "'block'");
    expect_compile_error("{% import 'm' as m %}", PRISM_ENOTSUP, "'import'");
    expect_compile_error("{% autoescape true %}{% endautoescape %}", PRISM_ENOTSUP, "'autoescape'");
    expect_compile_error("{% do x.append(1) %}", PRISM_ENOTSUP, "'do'");
    expect_compile_error("{{ '{}'.format(1) }}", PRISM_ENOTSUP, "unsupported method 'format'");
    expect_compile_error("{{ s.zfill(3) }}", PRISM_ENOTSUP, "'zfill'");
    expect_compile_error("{{ lipsum() }}", PRISM_ENOTSUP, "unsupported global 'lipsum'");
    expect_compile_error("{% set c = cycler('a') %}", PRISM_ENOTSUP, "'cycler'");
    expect_compile_error("{% for i in x recursive %}{% endfor %}", PRISM_ENOTSUP, "recursive");
    expect_compile_error("{{ f(*args) }}", PRISM_ENOTSUP, "*args");
    expect_compile_error("{{ x[1, 2] }}", PRISM_ENOTSUP, "tuple subscript");
    expect_compile_error("{{ '\\N{BULLET}' }}", PRISM_ENOTSUP, "\\N");
    /* syntax errors are EINVAL with a line number */
    expect_compile_error("a\n{% if %}", PRISM_EINVAL, "line 2");
    expect_compile_error("{% for x in y %}", PRISM_EINVAL, "endfor");
    expect_compile_error("{{ 99999999999999999999 }}", PRISM_ENOTSUP, "integer");
    expect_compile_error("\xff\xfe{{ x }}", PRISM_EINVAL, "UTF-8");
}

/* ------------------------------------------------------------------ limits */

static int render_str(const char *src, const char *ctx_json, char *out, size_t outn, char *err, size_t errlen)
{
    prism_template_t *t = NULL;
    int rc = prism_template_compile(src, strlen(src), &t, err, errlen);
    if (rc) return rc;
    json_t *ctx = ctx_json ? json_loads(ctx_json, 0, NULL) : json_object();
    prism_buf_t b = {0};
    rc = prism_template_render(t, ctx, &b, err, errlen);
    if (!rc && out) snprintf(out, outn, "%.*s", (int)b.len, b.data ? b.data : "");
    prism_buf_free(&b);
    json_decref(ctx);
    prism_template_free(t);
    return rc;
}

static void test_limits(void **state)
{
    (void)state;
    char err[256], out[256];
    /* source size */
    size_t big = PRISM_TEMPLATE_MAX_SOURCE + 1;
    char *src = malloc(big + 1);
    memset(src, 'a', big);
    src[big] = 0;
    prism_template_t *t = NULL;
    assert_int_equal(prism_template_compile(src, big, &t, err, sizeof(err)), PRISM_ELIMIT);
    free(src);
    /* output size */
    assert_int_equal(render_str("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", NULL, NULL, 0, err,
                                sizeof(err)), PRISM_ELIMIT);
    assert_int_equal(render_str("{{ 'x' * 100000000 }}", NULL, NULL, 0, err, sizeof(err)), PRISM_ELIMIT);
    /* loop iterations */
    assert_int_equal(render_str("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                                NULL, NULL, 0, err, sizeof(err)), PRISM_ELIMIT);
    assert_non_null(strstr(err, "iterations"));
    /* macro recursion */
    assert_int_equal(render_str("{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}", NULL, NULL, 0, err,
                                sizeof(err)), PRISM_ELIMIT);
    /* render memory: a quadratic string build in a loop */
    assert_int_equal(render_str("{% set ns = namespace(s='') %}{% for i in range(100000) %}{% set ns.s = ns.s ~ "
                                "'0123456789012345678901234567890123456789' %}{% endfor %}{{ ns.s|length }}",
                                NULL, NULL, 0, err, sizeof(err)), PRISM_ELIMIT);
    /* nesting depth, expressions and blocks */
    char deep[4096];
    size_t o = 0;
    o += (size_t)snprintf(deep + o, sizeof(deep) - o, "{{ ");
    for (int i = 0; i < 300; i++) deep[o++] = '(';
    deep[o++] = '1';
    for (int i = 0; i < 300; i++) deep[o++] = ')';
    snprintf(deep + o, sizeof(deep) - o, " }}");
    assert_int_equal(prism_template_compile(deep, strlen(deep), &t, err, sizeof(err)), PRISM_ELIMIT);
    o = 0;
    for (int i = 0; i < 200; i++) o += (size_t)snprintf(deep + o, sizeof(deep) - o, "{%% if 1 %%}");
    assert_int_equal(prism_template_compile(deep, strlen(deep), &t, err, sizeof(err)), PRISM_ELIMIT);
    o = 0;
    for (int i = 0; i < 500; i++) o += (size_t)snprintf(deep + o, sizeof(deep) - o, "not ");
    snprintf(deep + o, sizeof(deep) - o, "1");
    char wrapped[4200];
    snprintf(wrapped, sizeof(wrapped), "{{ %s }}", deep);
    assert_int_equal(prism_template_compile(wrapped, strlen(wrapped), &t, err, sizeof(err)), PRISM_ELIMIT);
    /* Evaluation depth (found by fuzz_template: a stack overflow). A chain "1-1-1-..." is parsed in a
     * loop, so no parser nesting bounds it, but its tree is as deep as it is long: 200,000 terms took
     * 200,000 nested evaluations, and a shorter chain in a macro that calls itself 48 deep overflowed
     * the stack of a sanitizer build. Now both stop at the evaluation depth, and a chain that fits
     * still renders. */
    size_t chain_len = 2 * 200000 + 64;
    char *chain = malloc(chain_len + 1);
    o = (size_t)snprintf(chain, chain_len + 1, "{{ 1");
    for (int i = 0; i < 200000; i++) chain[o++] = '-', chain[o++] = '1';
    snprintf(chain + o, chain_len + 1 - o, " }}");
    assert_int_equal(render_str(chain, NULL, NULL, 0, err, sizeof(err)), PRISM_ELIMIT);
    assert_non_null(strstr(err, "nested deeper"));
    o = (size_t)snprintf(chain, chain_len + 1, "{%% macro f(n) %%}{{ f(n + 1) ");
    for (int i = 0; i < 300; i++) chain[o++] = '-', chain[o++] = '1';
    snprintf(chain + o, chain_len + 1 - o, " }}{%% endmacro %%}{{ f(0) }}");
    assert_int_equal(render_str(chain, NULL, NULL, 0, err, sizeof(err)), PRISM_ELIMIT);
    o = (size_t)snprintf(chain, chain_len + 1, "{{ 1000");
    for (int i = 0; i < 900; i++) chain[o++] = '-', chain[o++] = '1';
    snprintf(chain + o, chain_len + 1 - o, " }}");
    assert_int_equal(render_str(chain, NULL, out, sizeof(out), err, sizeof(err)), 0);
    assert_string_equal(out, "100");
    free(chain);
    /* a %-format precision of any length (its digits overflowed an int: UB found by fuzz_template);
     * precision is capped at 50 digits */
    assert_int_equal(render_str("{{ '%.11111111111111111111111111f|' % 2 }}", NULL, out, sizeof(out), err, sizeof(err)), 0);
    assert_int_equal(strlen(out), strlen("2.") + 50 + 1);
    assert_true(!strncmp(out, "2.000", 5) && out[strlen(out) - 1] == '|');
    /* a value nested past the limit (list in list in ...) fails cleanly when printed */
    assert_int_equal(render_str("{% set ns = namespace(v=1) %}{% for i in range(1000) %}{% set ns.v = [ns.v] %}"
                                "{% endfor %}{{ ns.v }}", NULL, NULL, 0, err, sizeof(err)), PRISM_ELIMIT);
    /* context nesting */
    char ctxbuf[2048];
    o = 0;
    o += (size_t)snprintf(ctxbuf + o, sizeof(ctxbuf) - o, "{\"a\":");
    for (int i = 0; i < 300; i++) ctxbuf[o++] = '[';
    for (int i = 0; i < 300; i++) ctxbuf[o++] = ']';
    snprintf(ctxbuf + o, sizeof(ctxbuf) - o, "}");
    assert_int_equal(render_str("{{ a }}", ctxbuf, NULL, 0, err, sizeof(err)), PRISM_ELIMIT);
    /* sanity: a normal render still works and raise_exception surfaces its message */
    assert_int_equal(render_str("{{ 'ok' }}", NULL, out, sizeof(out), err, sizeof(err)), 0);
    assert_string_equal(out, "ok");
    assert_int_equal(render_str("{{ raise_exception('bad role: ' ~ r) }}", "{\"r\": \"tool\"}", NULL, 0, err,
                                sizeof(err)), PRISM_EINVAL);
    assert_string_equal(err, "bad role: tool");
}

/* ------------------------------------------------------------------ loaders + chat context */

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void test_loaders(void **state)
{
    (void)state;
    char dir[] = "/tmp/prism-template-test-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char p[1100], err[256], out[256];
    prism_template_t *t = NULL;
    char *bos = NULL, *eos = NULL;
    json_t *ctx = json_pack("{s:s}", "x", "X");

    snprintf(p, sizeof(p), "%s/tokenizer_config.json", dir);
    write_file(p, "{\"chat_template\": \"{{ bos_token }}[{{ x }}]{{ eos_token }}\", \"bos_token\": \"<s>\","
                  " \"eos_token\": {\"__type\": \"AddedToken\", \"content\": \"</s>\", \"lstrip\": false}}");
    assert_int_equal(prism_template_load_from_tokenizer_config(p, &t, &bos, &eos, err, sizeof(err)), 0);
    assert_string_equal(bos, "<s>");
    assert_string_equal(eos, "</s>");
    json_object_set_new(ctx, "bos_token", json_string(bos));
    json_object_set_new(ctx, "eos_token", json_string(eos));
    prism_buf_t b = {0};
    assert_int_equal(prism_template_render(t, ctx, &b, err, sizeof(err)), 0);
    snprintf(out, sizeof(out), "%.*s", (int)b.len, b.data);
    assert_string_equal(out, "<s>[X]</s>");
    prism_buf_free(&b);
    prism_template_free(t);
    prism_free(bos);
    prism_free(eos);

    /* list form: the one named "default" */
    write_file(p, "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T\"},"
                  " {\"name\": \"default\", \"template\": \"D{{ x }}\"}], \"eos_token\": null}");
    assert_int_equal(prism_template_load_from_tokenizer_config(p, &t, &bos, &eos, err, sizeof(err)), 0);
    assert_null(bos);
    assert_null(eos);
    assert_int_equal(prism_template_render(t, ctx, &b, err, sizeof(err)), 0);
    snprintf(out, sizeof(out), "%.*s", (int)b.len, b.data);
    assert_string_equal(out, "DX");
    prism_buf_free(&b);
    prism_template_free(t);

    write_file(p, "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T\"}]}");
    assert_int_equal(prism_template_load_from_tokenizer_config(p, &t, NULL, NULL, err, sizeof(err)), PRISM_ENOTFOUND);
    write_file(p, "{\"bos_token\": \"<s>\"}");
    assert_int_equal(prism_template_load_from_tokenizer_config(p, &t, NULL, NULL, err, sizeof(err)), PRISM_ENOTFOUND);
    write_file(p, "{not json");
    assert_int_equal(prism_template_load_from_tokenizer_config(p, &t, NULL, NULL, err, sizeof(err)), PRISM_ECORRUPT);
    write_file(p, "{\"chat_template\": \"{% for %}\"}");
    assert_int_equal(prism_template_load_from_tokenizer_config(p, &t, NULL, NULL, err, sizeof(err)), PRISM_EINVAL);

    /* no chat_template key: chat_template.jinja beside the config */
    write_file(p, "{\"bos_token\": \"<s>\"}");
    char pj[1100];
    snprintf(pj, sizeof(pj), "%s/chat_template.jinja", dir);
    write_file(pj, "J{{ x }}\n");
    assert_int_equal(prism_template_load_from_tokenizer_config(p, &t, &bos, NULL, err, sizeof(err)), 0);
    assert_string_equal(bos, "<s>");
    prism_free(bos);
    assert_int_equal(prism_template_render(t, ctx, &b, err, sizeof(err)), 0);
    snprintf(out, sizeof(out), "%.*s", (int)b.len, b.data);
    assert_string_equal(out, "JX"); /* the trailing newline is dropped like jinja2 does */
    prism_buf_free(&b);
    prism_template_free(t);

    /* --chat-template FILE */
    assert_int_equal(prism_template_load_file(pj, &t, err, sizeof(err)), 0);
    prism_template_free(t);
    snprintf(pj, sizeof(pj), "%s/missing.jinja", dir);
    assert_int_not_equal(prism_template_load_file(pj, &t, err, sizeof(err)), 0);

    /* the real shared tokenizers, when present */
    const char *shared = getenv("PRISM_SHARED_DIR");
    char sd[512];
    if (!shared || !*shared) {
        snprintf(sd, sizeof(sd), "%s/../shared", PRISM_SOURCE_DIR);
        shared = sd;
    }
    static const char *const names[] = {"llama3_1", "qwen3"};
    for (size_t i = 0; i < 2; i++) {
        snprintf(p, sizeof(p), "%s/tokenizers/%s/tokenizer_config.json", shared, names[i]);
        if (!prism_file_exists(p)) continue;
        assert_int_equal(prism_template_load_from_tokenizer_config(p, &t, &bos, &eos, err, sizeof(err)), 0);
        assert_non_null(eos);
        prism_template_free(t);
        prism_free(bos);
        prism_free(eos);
    }
    snprintf(p, sizeof(p), "%s/tokenizers/llama2/tokenizer_config.json", shared);
    if (prism_file_exists(p)) /* that checkpoint ships without a chat template */
        assert_int_equal(prism_template_load_from_tokenizer_config(p, &t, NULL, NULL, err, sizeof(err)), PRISM_ENOTFOUND);

    json_decref(ctx);
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

static void test_chat_context(void **state)
{
    (void)state;
    json_t *msgs = json_loads("[{\"role\": \"user\", \"content\": \"hi\", \"name\": null},"
                              " {\"role\": \"assistant\", \"content\": \"a\", \"reasoning\": \"r1\"},"
                              " {\"role\": \"assistant\", \"content\": \"b\", \"reasoning_content\": \"r2\", \"thinking\": \"t\"}]",
                              0, NULL);
    json_t *ctx = prism_template_chat_context(msgs, NULL, true, "<s>", NULL, NULL);
    assert_non_null(ctx);
    char *s = json_dumps(ctx, JSON_PRESERVE_ORDER | JSON_COMPACT);
    assert_string_equal(s, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"},"
                           "{\"thinking\":\"r1\",\"role\":\"assistant\",\"content\":\"a\",\"reasoning\":\"r1\",\"reasoning_content\":\"r1\"},"
                           "{\"thinking\":\"t\",\"role\":\"assistant\",\"content\":\"b\",\"reasoning_content\":\"r2\"}],"
                           "\"tools\":null,\"documents\":null,\"add_generation_prompt\":true,\"bos_token\":\"<s>\"}");
    free(s);
    json_decref(ctx);
    json_t *bad = json_loads("[1]", 0, NULL);
    assert_null(prism_template_chat_context(bad, NULL, false, NULL, NULL, NULL));
    json_decref(bad);
    json_decref(msgs);
}

/* ------------------------------------------------------------------ concurrency */

typedef struct {
    const prism_template_t *t;
    const json_t *ctx;
    const char *want;
    size_t want_n;
    int bad;
} thread_arg_t;

static void *render_thread(void *p)
{
    thread_arg_t *a = p;
    for (int i = 0; i < 50; i++) {
        prism_buf_t b = {0};
        char err[128];
        if (prism_template_render(a->t, a->ctx, &b, err, sizeof(err)) || b.len != a->want_n ||
            memcmp(b.data, a->want, b.len))
            a->bad++;
        prism_buf_free(&b);
    }
    return NULL;
}

static void test_concurrent_render(void **state)
{
    (void)state;
    json_t *g = load_golden("chat_goldens.json");
    json_t *tj = json_array_get(json_object_get(g, "templates"), 1);
    json_t *src = json_object_get(tj, "source");
    json_t *cj = json_array_get(json_object_get(tj, "cases"), 0);
    prism_template_t *t = NULL;
    char err[256];
    assert_int_equal(prism_template_compile(json_string_value(src), json_string_length(src), &t, err, sizeof(err)), 0);
    json_t *tools = json_object_get(cj, "tools");
    json_t *ctx = prism_template_chat_context(json_object_get(cj, "messages"), json_is_null(tools) ? NULL : tools,
                                              json_is_true(json_object_get(cj, "add_generation_prompt")),
                                              json_string_value(json_object_get(tj, "bos_token")),
                                              json_string_value(json_object_get(tj, "eos_token")),
                                              json_object_get(cj, "extra"));
    json_t *exp = json_object_get(cj, "expected");
    thread_arg_t args[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        args[i] = (thread_arg_t){t, ctx, json_string_value(exp), json_string_length(exp), 0};
        pthread_create(&th[i], NULL, render_thread, &args[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(args[i].bad, 0);
    }
    json_decref(ctx);
    prism_template_free(t);
    json_decref(g);
}

/* ------------------------------------------------------------------ corrupt / fuzz */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static const char *const soup[] = {
    "{{", "}}", "{%", "%}", "{#", "#}", "{%-", "-%}", "{{-", "-}}", "for", "in", "endfor", "if", "elif", "else",
    "endif", "set", "macro", "endmacro", "call", "endcall", "filter", "endfilter", "raw", "endraw", "generation",
    "endgeneration", "(", ")", "[", "]", "{", "}", ",", ":", "|", ".", "=", "==", "+", "-", "*", "**", "/", "//",
    "%", "~", "is", "not", "and", "or", "loop", "messages", "message", "x", "ns", "namespace(a=1)", "range(3)",
    "'str'", "\"s\\n\"", "1", "2.5", "none", "true", "trim", "tojson", "length", "selectattr", "defined", "items()",
    "[::-1]", "caller()", "break", "continue", " ", "\n", "\t", "'", "\"", "\\", "\xc3\xa9", "\xff",
};

static json_t *random_value(int depth)
{
    switch (rnd() % (depth > 2 ? 6 : 9)) {
    case 0: return json_null();
    case 1: return json_boolean(rnd() & 1);
    case 2: return json_integer((json_int_t)(rnd() % 2000) - 1000);
    case 3: return json_real((double)(rnd() % 1000) / 7.0);
    case 4: return json_string(soup[rnd() % (PRISM_ARRAY_LEN(soup) - 1)]); /* the last entry is not UTF-8 */
    case 5: return json_string("text with 'quotes' and \"dq\" \n é");
    case 6: {
        json_t *a = json_array();
        for (int i = (int)(rnd() % 4); i > 0; i--) json_array_append_new(a, random_value(depth + 1));
        return a;
    }
    default: {
        static const char *const keys[] = {"role", "content", "type", "text", "tool_calls", "function", "name",
                                           "arguments", "reasoning_content", "image", "tools", "x"};
        json_t *o = json_object();
        for (int i = (int)(rnd() % 5); i > 0; i--)
            json_object_set_new(o, keys[rnd() % PRISM_ARRAY_LEN(keys)], random_value(depth + 1));
        return o;
    }
    }
}

static json_t *random_context(void)
{
    json_t *msgs = json_array();
    static const char *const roles[] = {"system", "user", "assistant", "tool", "ipython", "other"};
    for (int i = (int)(rnd() % 6); i > 0; i--) {
        json_t *m = rnd() % 8 ? json_object() : random_value(1);
        if (json_is_object(m)) {
            if (rnd() % 6) json_object_set_new(m, "role", json_string(roles[rnd() % PRISM_ARRAY_LEN(roles)]));
            if (rnd() % 6) json_object_set_new(m, "content", random_value(1));
            if (rnd() % 4 == 0) json_object_set_new(m, "tool_calls", random_value(1));
        }
        json_array_append_new(msgs, m);
    }
    json_t *ctx = json_pack("{s:o, s:b, s:s, s:s}", "messages", msgs, "add_generation_prompt", (int)(rnd() & 1),
                            "bos_token", "<s>", "eos_token", "</s>");
    if (rnd() & 1) json_object_set_new(ctx, "tools", random_value(1));
    return ctx;
}

static long g_fuzz_compiled, g_fuzz_rendered;

static void fuzz_one(const char *src, size_t n, const json_t *ctx)
{
    prism_template_t *t = NULL;
    char err[256];
    int rc = prism_template_compile(src, n, &t, err, sizeof(err));
    if (rc) {
        assert_true(rc < 0);
        assert_true(err[0] != 0);
        assert_null(t);
        return;
    }
    g_fuzz_compiled++;
    prism_buf_t b = {0};
    rc = prism_template_render(t, ctx, &b, err, sizeof(err));
    if (rc) assert_true(err[0] != 0);
    else g_fuzz_rendered++;
    prism_buf_free(&b);
    prism_template_free(t);
}

static void test_fuzz(void **state)
{
    (void)state;
    long iters = 3000;
    const char *env = getenv("PRISM_TEMPLATE_FUZZ_ITERS");
    if (env && *env) iters = strtol(env, NULL, 10);
    json_t *g = load_golden("chat_goldens.json");
    json_t *tpls = json_object_get(g, "templates");
    size_t ntpl = json_array_size(tpls);
    /* a context with a bit of everything the templates look at */
    json_t *cj = json_array_get(json_object_get(json_array_get(tpls, 1), "cases"), 30);
    json_t *ctx = prism_template_chat_context(json_object_get(cj, "messages"), json_object_get(cj, "tools"), true,
                                              "<s>", "</s>", NULL);
    json_object_set_new(ctx, "x", json_pack("[i,s,{s:i}]", 1, "a", "k", 2));
    char *buf = malloc(1 << 20);
    size_t mem0 = prism_mem_used();
    for (long it = 0; it < iters; it++) {
        size_t n = 0;
        int mode = (int)(rnd() % 5);
        if (mode == 4) { /* an intact real template over randomly shaped messages */
            json_t *src = json_object_get(json_array_get(tpls, rnd() % ntpl), "source");
            json_t *rctx = random_context();
            fuzz_one(json_string_value(src), json_string_length(src), rctx);
            json_decref(rctx);
            assert_int_equal(prism_mem_used(), mem0);
            continue;
        }
        if (mode == 3) { /* token soup */
            int k = (int)(rnd() % 60);
            for (int i = 0; i < k; i++) {
                const char *s = soup[rnd() % PRISM_ARRAY_LEN(soup)];
                size_t l = strlen(s);
                memcpy(buf + n, s, l);
                n += l;
            }
        } else {
            json_t *src = json_object_get(json_array_get(tpls, rnd() % ntpl), "source");
            n = json_string_length(src);
            memcpy(buf, json_string_value(src), n);
            if (mode == 0) { /* truncation */
                n = n ? rnd() % n : 0;
            } else if (mode == 1) { /* byte mutations */
                int k = 1 + (int)(rnd() % 4);
                for (int i = 0; i < k && n; i++) buf[rnd() % n] = (char)(rnd() & 0xff);
            } else { /* splice a soup token somewhere */
                int k = 1 + (int)(rnd() % 3);
                for (int i = 0; i < k; i++) {
                    const char *s = soup[rnd() % PRISM_ARRAY_LEN(soup)];
                    size_t l = strlen(s), at = n ? rnd() % n : 0;
                    if (n + l >= (1 << 20)) break;
                    memmove(buf + at + l, buf + at, n - at);
                    memcpy(buf + at, s, l);
                    n += l;
                }
            }
        }
        fuzz_one(buf, n, ctx);
        assert_int_equal(prism_mem_used(), mem0);
    }
    fprintf(stderr, "fuzz: %ld inputs, %ld compiled, %ld rendered without error\n", iters, g_fuzz_compiled,
            g_fuzz_rendered);
    free(buf);
    json_decref(ctx);
    json_decref(g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_features, setup, teardown),
        cmocka_unit_test_setup_teardown(test_random_goldens, setup, teardown),
        cmocka_unit_test_setup_teardown(test_chat_goldens, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bundled_model, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unsupported, setup, teardown),
        cmocka_unit_test_setup_teardown(test_limits, setup, teardown),
        cmocka_unit_test_setup_teardown(test_loaders, setup, teardown),
        cmocka_unit_test_setup_teardown(test_chat_context, setup, teardown),
        cmocka_unit_test_setup_teardown(test_concurrent_render, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fuzz, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
