/* Remembered aborts (finding 7 of issue 8): an abort that comes before its request's KV is kept,
 * bounded in count and time, and matched by request id and router. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include "worker/aborts.h"

static prism_abort_memo_t g_memo;

static void test_abort_before_data_is_remembered_once(void **state)
{
    (void)state;
    prism_abort_memo_t *m = &g_memo;
    prism_abort_memo_init(m, 10);
    prism_abort_memo_add(m, 7, "router-a", 100);
    assert_false(prism_abort_memo_take(m, 7, "router-b", 101));   /* another router's request 7 */
    assert_false(prism_abort_memo_take(m, 8, "router-a", 101));
    assert_true(prism_abort_memo_take(m, 7, "router-a", 101));
    assert_false(prism_abort_memo_take(m, 7, "router-a", 101));   /* taken: a second KV is not dropped */
    assert_int_equal(m->dropped, 1);
    /* has(): kept for every image of a request */
    prism_abort_memo_add(m, 9, "router-a", 100);
    assert_true(prism_abort_memo_has(m, 9, "router-a", 101));
    assert_true(prism_abort_memo_has(m, 9, "router-a", 102));
    assert_false(prism_abort_memo_has(m, 9, "router-a", 200));   /* expired */
    assert_false(prism_abort_memo_has(m, 9, "router-b", 101));
}

static void test_entries_expire(void **state)
{
    (void)state;
    prism_abort_memo_t *m = &g_memo;
    prism_abort_memo_init(m, 10);
    prism_abort_memo_add(m, 1, "r", 100);
    assert_false(prism_abort_memo_take(m, 1, "r", 111));
    prism_abort_memo_add(m, 2, "r", 200);
    prism_abort_memo_add(m, 3, "r", 215);   /* entry 2 expired: dropped from the head */
    assert_int_equal(m->n, 1);
    assert_true(prism_abort_memo_take(m, 3, "r", 216));
}

static void test_bounded_oldest_forgotten(void **state)
{
    (void)state;
    prism_abort_memo_t *m = &g_memo;
    prism_abort_memo_init(m, 1e9);
    for (uint64_t i = 0; i < PRISM_ABORT_MEMO_CAP + 10; i++) prism_abort_memo_add(m, i, "r", 1.0 + (double)i);
    assert_int_equal(m->n, PRISM_ABORT_MEMO_CAP);
    assert_int_equal(m->forgotten, 10);
    assert_false(prism_abort_memo_take(m, 9, "r", 5000));
    assert_true(prism_abort_memo_take(m, 10, "r", 5000));
    assert_true(prism_abort_memo_take(m, PRISM_ABORT_MEMO_CAP + 9, "r", 5000));
    /* holes left by takes are reused once they reach the head */
    for (uint64_t i = 0; i < 2 * PRISM_ABORT_MEMO_CAP; i++) prism_abort_memo_add(m, 100000 + i, "r", 6000);
    assert_int_equal(m->n, PRISM_ABORT_MEMO_CAP);
    assert_true(prism_abort_memo_take(m, 100000 + 2 * PRISM_ABORT_MEMO_CAP - 1, "r", 6000));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_abort_before_data_is_remembered_once),
        cmocka_unit_test(test_entries_expire),
        cmocka_unit_test(test_bounded_oldest_forgotten),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
