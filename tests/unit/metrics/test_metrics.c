/* Unit tests: Prometheus label values are escaped per the text exposition format (finding 21). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "metrics/metrics.h"

static void test_label_escape(void **state)
{
    (void)state;
    char out[64];
    assert_int_equal(prism_metric_label_value(out, sizeof out, "decode-0"), 8);
    assert_string_equal(out, "decode-0");
    prism_metric_label_value(out, sizeof out, "a\"b\\c\nd");
    assert_string_equal(out, "a\\\"b\\\\c\\nd");
    prism_metric_label_value(out, sizeof out, "x\ty\x01z\xff");
    assert_string_equal(out, "x?y?z?");
    /* never split an escape: a 4-byte buffer holds "ab" and stops before the 2-byte escape */
    char small[4];
    prism_metric_label_value(small, sizeof small, "ab\"c");
    assert_string_equal(small, "ab");
    prism_metric_label_value(out, sizeof out, NULL);
    assert_string_equal(out, "");
}

static void test_sample_line_well_formed(void **state)
{
    (void)state;
    char v[128], lbl[200];
    prism_metric_label_value(v, sizeof v, "w\"} 1\nfake_metric 1");
    snprintf(lbl, sizeof lbl, "worker=\"%s\"", v);
    prism_buf_t b = {0};
    prism_metric_write(&b, "prism:worker_running", "gauge", NULL, lbl, 3);
    /* one line, and the injected text stays inside the quotes */
    assert_non_null(b.data);
    assert_ptr_equal(strchr(b.data, '\n'), b.data + b.len - 1);
    assert_string_equal(b.data, "prism:worker_running{worker=\"w\\\"} 1\\nfake_metric 1\"} 3\n");
    prism_buf_free(&b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_label_escape),
        cmocka_unit_test(test_sample_line_well_formed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
