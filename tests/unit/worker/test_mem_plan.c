/* The memory plan's table (worker/start.h): one table totals the plan and carves the pools, so a
 * pool's memory is exactly its region; regions of other kinds only count. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include "worker/start.h"

typedef struct {
    uint64_t id;
    char name[40];
} rec_t;

static void test_plan_totals_and_carves_its_pools(void **state)
{
    (void)state;
    prism_mem_plan_t p = {.budget = 0};
    rec_t *recs = (rec_t *)(uintptr_t)1;   /* carve overwrites whatever was there */
    float *rows = NULL;
    int32_t *none = (int32_t *)(uintptr_t)1;
    prism_mem_plan_add(&p, "weights", 1000, PRISM_MEM_LIBRARY);
    PRISM_PLAN_POOL(&p, "records", recs, 7);
    PRISM_PLAN_POOL(&p, "rows", rows, 3 * 5);
    PRISM_PLAN_POOL(&p, "none", none, 0);              /* no region, and the pointer stays NULL */
    prism_mem_plan_add(&p, "reserve", 24, PRISM_MEM_OUTSIDE);
    prism_mem_plan_add(&p, "empty", 0, PRISM_MEM_LIBRARY);
    assert_int_equal(p.n, 4);
    assert_int_equal(prism_mem_plan_total(&p), 1000 + 7 * sizeof(rec_t) + 15 * sizeof(float) + 24);
    assert_null(none);
    size_t before = prism_mem_used();
    assert_int_equal(prism_mem_plan_carve(&p), PRISM_OK);
    /* one block: the pools (aligned) and no more than an alignment's slack besides */
    size_t taken = prism_mem_used() - before;
    assert_true(taken >= 7 * sizeof(rec_t) + 15 * sizeof(float));
    assert_true(taken <= PRISM_ALIGN_UP(7 * sizeof(rec_t), PRISM_PLAN_ALIGN) + 15 * sizeof(float) + PRISM_PLAN_ALIGN);
    assert_non_null(recs);
    assert_non_null(rows);
    assert_int_equal((uintptr_t)recs % PRISM_PLAN_ALIGN, 0);
    assert_int_equal((uintptr_t)rows % PRISM_PLAN_ALIGN, 0);
    assert_true((uint8_t *)rows >= (uint8_t *)(recs + 7));   /* no overlap */
    for (int i = 0; i < 7; i++) assert_int_equal(recs[i].id, 0);   /* zeroed, as calloc was */
    for (int i = 0; i < 15; i++) rows[i] = (float)i;
    prism_mem_plan_set(&p, "weights", 2000);   /* a counted region may change after the carve */
    assert_int_equal(prism_mem_plan_total(&p), 2000 + 7 * sizeof(rec_t) + 15 * sizeof(float) + 24);
    prism_mem_plan_free(&p);
    assert_null(recs);
    assert_int_equal(prism_mem_used(), before);
}

static void test_plan_over_budget_is_refused(void **state)
{
    (void)state;
    prism_mem_plan_t p = {.budget = 100};
    prism_mem_plan_add(&p, "weights", 60, PRISM_MEM_LIBRARY);
    assert_int_equal(prism_mem_plan_check(&p, "test"), PRISM_OK);
    uint8_t *pool;
    PRISM_PLAN_POOL(&p, "pool", pool, 41);
    assert_int_equal(prism_mem_plan_check(&p, "test"), PRISM_ENOMEM);
    (void)pool;
}

int main(void)
{
    prism_log_init("test", PRISM_LOG_ERROR + 1);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plan_totals_and_carves_its_pools),
        cmocka_unit_test(test_plan_over_budget_is_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
