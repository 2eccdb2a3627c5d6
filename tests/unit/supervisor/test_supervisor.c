/* Unit tests: the supervisor's spec parser (bounds, malformed lines) and its backoff policy. The
 * process handling itself is tested on real processes in tests/integration/test_supervisor.py. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "core/core.h"
#include "supervisor.h"

static int parse(const char *text, prism_supervisor_spec_t *s, char *err)
{
    return prism_supervisor_spec_parse(text, strlen(text), s, err, 256);
}

static void test_spec_parses_names_programs_and_arguments(void **state)
{
    size_t before = prism_mem_used();
    prism_supervisor_spec_t s;
    char err[256] = "";
    const char *text = "# comment\n\nrouter-1\t/bin/router\t--port\t8000\t--model-path\t/models/a b\r\n"
                       "encoder.1\tencoder_worker\n";
    assert_int_equal(parse(text, &s, err), PRISM_OK);
    assert_int_equal(s.n, 2);
    assert_string_equal(s.procs[0].name, "router-1");
    assert_int_equal(s.procs[0].argc, 5);
    assert_string_equal(s.procs[0].argv[0], "/bin/router");
    assert_string_equal(s.procs[0].argv[4], "/models/a b");  /* spaces stay inside an argument; CR dropped */
    assert_null(s.procs[0].argv[5]);
    assert_string_equal(s.procs[1].name, "encoder.1");
    assert_int_equal(s.procs[1].argc, 1);
    assert_null(s.procs[1].argv[1]);
    assert_int_equal(s.procs[1].pid, 0);
    prism_supervisor_spec_free(&s);
    assert_int_equal(prism_mem_used(), before);
}

static void test_spec_refuses_malformed_input(void **state)
{
    static const struct {
        const char *text, *msg;
        int rc;
    } bad[] = {
        {"", "names no process", PRISM_EINVAL},
        {"# only a comment\n", "names no process", PRISM_EINVAL},
        {"lonely\n", "line 1: expected NAME", PRISM_EINVAL},
        {"a\tsleep\t1\nb\n", "line 2: expected NAME", PRISM_EINVAL},
        {"a\t\t1\n", "line 1: empty program", PRISM_EINVAL},
        {"bad name\tsleep\n", "line 1: bad name", PRISM_EINVAL},
        {".hidden\tsleep\n", "bad name", PRISM_EINVAL},
        {"a/b\tsleep\n", "bad name", PRISM_EINVAL},
        {"\tsleep\n", "bad name", PRISM_EINVAL},
        {"a\tsleep\na\ttrue\n", "line 2: name 'a' used twice", PRISM_EINVAL},
    };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(bad); i++) {
        size_t before = prism_mem_used();
        prism_supervisor_spec_t s;
        char err[256] = "";
        assert_int_equal(parse(bad[i].text, &s, err), bad[i].rc);
        if (!strstr(err, bad[i].msg)) fail_msg("case %zu: '%s' does not say '%s'", i, err, bad[i].msg);
        assert_null(s.procs);
        assert_int_equal(prism_mem_used(), before);  /* nothing leaks on any failure path */
    }
    /* a name of 64 characters is one too many */
    char text[200];
    snprintf(text, sizeof(text), "%064d\tsleep\n", 0);
    prism_supervisor_spec_t s;
    char err[256];
    assert_int_equal(parse(text, &s, err), PRISM_EINVAL);
    text[63] = '\t';
    memcpy(text + 64, "sleep\n", 7);
    assert_int_equal(parse(text, &s, err), PRISM_OK);
    prism_supervisor_spec_free(&s);
    /* a NUL inside the text */
    assert_int_equal(prism_supervisor_spec_parse("a\tsl\0eep\n", 9, &s, err, sizeof(err)), PRISM_EINVAL);
}

static void test_spec_bounds(void **state)
{
    prism_supervisor_spec_t s;
    char err[256] = "";
    /* PRISM_SUPERVISOR_MAX_ARGS arguments fit, one more does not */
    prism_buf_t b = {0};
    prism_buf_append_str(&b, "a");
    for (int i = 0; i < PRISM_SUPERVISOR_MAX_ARGS; i++) prism_buf_append_str(&b, "\tx");
    prism_buf_append_str(&b, "\n");
    assert_int_equal(prism_supervisor_spec_parse(b.data, b.len, &s, err, sizeof(err)), PRISM_OK);
    assert_int_equal(s.procs[0].argc, PRISM_SUPERVISOR_MAX_ARGS);
    prism_supervisor_spec_free(&s);
    b.len--;
    prism_buf_append_str(&b, "\tx\n");
    assert_int_equal(prism_supervisor_spec_parse(b.data, b.len, &s, err, sizeof(err)), PRISM_ELIMIT);
    assert_non_null(strstr(err, "more than 255 arguments"));
    /* PRISM_SUPERVISOR_MAX_PROCS processes fit, one more does not */
    prism_buf_reset(&b);
    for (int i = 0; i <= PRISM_SUPERVISOR_MAX_PROCS; i++) prism_buf_appendf(&b, "p%d\tsleep\t1\n", i);
    assert_int_equal(prism_supervisor_spec_parse(b.data, b.len, &s, err, sizeof(err)), PRISM_ELIMIT);
    assert_non_null(strstr(err, "line 257: more than 256 processes"));
    /* the text as a whole is bounded before anything is copied */
    assert_int_equal(prism_supervisor_spec_parse(b.data, PRISM_SUPERVISOR_MAX_SPEC_BYTES + 1, &s, err, sizeof(err)),
                     PRISM_ELIMIT);
    prism_buf_free(&b);
}

static void test_backoff_doubles_caps_and_resets(void **state)
{
    prism_supervisor_opts_t o = prism_supervisor_opts_default();
    o.backoff_initial_s = 0.5;
    o.backoff_max_s = 30;
    o.healthy_after_s = 10;
    const double want[] = {0.5, 1, 2, 4, 8, 16, 30, 30};
    for (int f = 1; f <= 8; f++) assert_float_equal(prism_supervisor_backoff_s(&o, f), want[f - 1], 1e-9);
    assert_float_equal(prism_supervisor_backoff_s(&o, 1000000), 30, 1e-9);  /* no overflow */

    prism_supervisor_proc_t p = {0};
    assert_float_equal(prism_supervisor_on_exit(&o, &p, 0.1), 0.5, 1e-9);   /* crash at start-up */
    assert_float_equal(prism_supervisor_on_exit(&o, &p, 0.1), 1, 1e-9);     /* again: doubles */
    assert_float_equal(prism_supervisor_on_exit(&o, &p, 9.9), 2, 1e-9);     /* still short of healthy */
    assert_float_equal(prism_supervisor_on_exit(&o, &p, 10), 0.5, 1e-9);    /* a healthy run resets */
    assert_int_equal(p.failures, 1);
    for (int i = 0; i < 200; i++) prism_supervisor_on_exit(&o, &p, 0);      /* the count itself is bounded */
    assert_true(p.failures <= 64);
    assert_float_equal(prism_supervisor_on_exit(&o, &p, 0), 30, 1e-9);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_spec_parses_names_programs_and_arguments),
        cmocka_unit_test(test_spec_refuses_malformed_input),
        cmocka_unit_test(test_spec_bounds),
        cmocka_unit_test(test_backoff_doubles_caps_and_resets),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
