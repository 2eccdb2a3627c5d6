/* The router's memory plan (router/plan.c): rows add up within --mem-budget, explicit flags are kept
 * or refused with the numbers, derived bounds are usable (a body of --max-body-bytes fits the body
 * budget), and without a budget the old defaults stand. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <string.h>

#include "plan.h"

#define MIB ((size_t)1 << 20)

static router_plan_in_t base(size_t budget)
{
    return (router_plan_in_t){.budget = budget, .startup = 10 * MIB, .conn_bytes = 80 << 10, .max_running = 256,
                              .prep_threads = 4, .request_bytes = 100 << 10, .parse_factor = 4,
                              .fetch_max_bytes = 20 * MIB};
}

static size_t sum(const router_plan_t *p)
{
    size_t t = 0;
    for (int i = 0; i < ROUTER_ROW_COUNT; i++) t += p->bytes[i];
    return t;
}

/* Each row is its bound times what it multiplies, as plan.h says. */
static void check_rows(const router_plan_in_t *in, const router_plan_t *p)
{
    assert_int_equal(p->total, sum(p));
    assert_int_equal(p->bytes[ROUTER_ROW_STARTUP], in->startup);
    assert_int_equal(p->bytes[ROUTER_ROW_RESERVE], ROUTER_PLAN_RESERVE);
    assert_int_equal(p->bytes[ROUTER_ROW_CONNECTIONS], (size_t)p->max_connections * in->conn_bytes);
    assert_true(p->bytes[ROUTER_ROW_BODIES] >= p->body_inflight + p->max_body);
    assert_true(p->bytes[ROUTER_ROW_IMAGES] >= p->image_inflight + p->max_body);
    assert_int_equal(p->bytes[ROUTER_ROW_EARLY], p->early_bytes);
    assert_int_equal(p->bytes[ROUTER_ROW_REQUESTS], (size_t)in->max_running * in->request_bytes);
    assert_int_equal(p->bytes[ROUTER_ROW_STREAMS], (size_t)in->max_running * p->stream_pending);
    assert_int_equal(p->bytes[ROUTER_ROW_PARSING], (size_t)in->prep_threads * in->parse_factor * p->parse_bound);
    assert_int_equal(p->bytes[ROUTER_ROW_PREFIX], 0);
    if (in->fetch)
        assert_int_equal(p->bytes[ROUTER_ROW_FETCH], (size_t)p->fetch_inflight * in->fetch_max_bytes + p->fetch_cache);
    else
        assert_int_equal(p->bytes[ROUTER_ROW_FETCH], 0);
}

static void test_no_budget_keeps_old_defaults(void **state)
{
    (void)state;
    router_plan_in_t in = base(0);
    router_plan_t p;
    char err[512];
    assert_int_equal(router_plan_make(&in, &p, err, sizeof err), PRISM_OK);
    check_rows(&in, &p);
    assert_int_equal(p.max_connections, 4096);
    assert_int_equal(p.max_body, 64 * MIB);
    assert_int_equal(p.body_inflight, 1024 * MIB);
    assert_int_equal(p.image_inflight, 1024 * MIB);
    assert_int_equal(p.stream_pending, 4 * MIB);
    assert_true(p.total > 2048 * MIB);   /* what the issue measured: no budget bounds it */
}

static void test_default_budget_derives_usable_bounds(void **state)
{
    (void)state;
    for (size_t budget = 128 * MIB; budget <= 4096 * MIB; budget *= 2) {
        router_plan_in_t in = base(budget);
        in.fetch = true;
        router_plan_t p;
        char err[512];
        assert_int_equal(router_plan_make(&in, &p, err, sizeof err), PRISM_OK);
        check_rows(&in, &p);
        assert_true(p.total <= budget);
        assert_true(p.total >= budget - budget / 8);     /* the budget is used, not wasted */
        assert_true(p.max_body >= MIB && p.max_body <= 64 * MIB);
        assert_true(p.body_inflight >= p.max_body);      /* the largest body can be read at all */
        assert_true(p.image_inflight >= MIB);
        assert_true(p.max_connections >= 16 && p.max_connections <= 4096);
        assert_true(p.stream_pending >= (16 << 10));
        assert_true(p.parse_bound >= MIB);
        assert_true(p.fetch_inflight >= 1);
        for (int i = ROUTER_ROW_CONNECTIONS; i < ROUTER_ROW_COUNT; i++)
            if (i != ROUTER_ROW_REQUESTS && i != ROUTER_ROW_PREFIX) assert_true(p.derived[i]);
    }
    /* 512 MiB, the default: the bench's burst of 384 uploads needs the connections */
    router_plan_in_t in = base(512 * MIB);
    router_plan_t p;
    char err[512];
    assert_int_equal(router_plan_make(&in, &p, err, sizeof err), PRISM_OK);
    assert_true(p.max_connections >= 400);
    assert_true(p.body_inflight >= 64 * MIB && p.image_inflight >= 64 * MIB);
}

static void test_explicit_flags_kept_or_refused(void **state)
{
    (void)state;
    router_plan_in_t in = base(512 * MIB);
    in.body_inflight = 200 * MIB;
    in.max_connections = 100;
    in.stream_pending = 64 << 10;
    router_plan_t p, d;
    char err[1024];
    assert_int_equal(router_plan_make(&in, &p, err, sizeof err), PRISM_OK);
    check_rows(&in, &p);
    assert_int_equal(p.body_inflight, 200 * MIB);
    assert_int_equal(p.max_connections, 100);
    assert_int_equal(p.stream_pending, 64 << 10);
    assert_false(p.derived[ROUTER_ROW_BODIES]);
    assert_true(p.total <= 512 * MIB);
    /* what the explicit flags took, the derived rows lose */
    router_plan_in_t in2 = base(512 * MIB);
    assert_int_equal(router_plan_make(&in2, &d, err, sizeof err), PRISM_OK);
    assert_true(p.image_inflight < d.image_inflight || d.body_inflight > 200 * MIB);
    /* an explicit flag the budget cannot hold: refused, naming the numbers and the flag */
    in.body_inflight = 1024 * MIB;
    assert_int_equal(router_plan_make(&in, &p, err, sizeof err), PRISM_ENOMEM);
    assert_non_null(strstr(err, "--mem-budget is 512.00 MiB"));
    assert_non_null(strstr(err, "--max-body-bytes-in-flight"));
    assert_non_null(strstr(err, "bodies in flight 1.0"));
    /* a budget below the fixed rows and the floors */
    in = base(64 * MIB);
    assert_int_equal(router_plan_make(&in, &p, err, sizeof err), PRISM_ENOMEM);
    assert_non_null(strstr(err, "requests 25.00 MiB from --max-running-requests"));
    /* the same budget holds with fewer requests in flight and one prep thread */
    in.max_running = 8;
    in.prep_threads = 1;
    assert_int_equal(router_plan_make(&in, &p, err, sizeof err), PRISM_OK);
    check_rows(&in, &p);
    assert_true(p.total <= 64 * MIB && p.body_inflight >= p.max_body);
}

static void test_fetch_row_half_given(void **state)
{
    (void)state;
    char err[1024];
    router_plan_t p;
    /* downloads given, the cache derived: the row holds the downloads and shares the rest */
    router_plan_in_t in = base(1024 * MIB);
    in.fetch = true;
    in.fetch_max_bytes = 8 * MIB;
    in.fetch_inflight = 64;
    assert_int_equal(router_plan_make(&in, &p, err, sizeof err), PRISM_OK);
    check_rows(&in, &p);
    assert_int_equal(p.fetch_inflight, 64);
    assert_true(p.total <= 1024 * MIB);
    /* the cache given (0: none), the downloads derived */
    in.fetch_inflight = 0;
    in.fetch_cache_set = true;
    in.fetch_cache = 0;
    assert_int_equal(router_plan_make(&in, &p, err, sizeof err), PRISM_OK);
    check_rows(&in, &p);
    assert_int_equal(p.fetch_cache, 0);
    assert_true(p.fetch_inflight >= 1 && p.total <= 1024 * MIB);
    /* more downloads than the budget holds: refused, naming the row */
    in = base(512 * MIB);
    in.fetch = true;
    in.fetch_max_bytes = 20 * MIB;
    in.fetch_inflight = 64;
    assert_int_equal(router_plan_make(&in, &p, err, sizeof err), PRISM_ENOMEM);
    assert_non_null(strstr(err, "URL fetches"));
}

static void test_explicit_max_body_sets_the_floor(void **state)
{
    (void)state;
    router_plan_in_t in = base(256 * MIB);
    in.max_body = 100 * MIB;   /* two bodies of it do not fit what is left */
    router_plan_t p;
    char err[1024];
    assert_int_equal(router_plan_make(&in, &p, err, sizeof err), PRISM_ENOMEM);
    assert_non_null(strstr(err, "bodies in flight"));
    in.max_body = 16 * MIB;
    assert_int_equal(router_plan_make(&in, &p, err, sizeof err), PRISM_OK);
    assert_int_equal(p.max_body, 16 * MIB);
    assert_true(p.body_inflight >= 16 * MIB);
    /* a derived max body never exceeds an explicit body budget */
    in = base(512 * MIB);
    in.body_inflight = 8 * MIB;
    assert_int_equal(router_plan_make(&in, &p, err, sizeof err), PRISM_OK);
    assert_true(p.max_body <= 8 * MIB);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_no_budget_keeps_old_defaults),
        cmocka_unit_test(test_default_budget_derives_usable_bounds),
        cmocka_unit_test(test_explicit_flags_kept_or_refused),
        cmocka_unit_test(test_explicit_max_body_sets_the_floor),
        cmocka_unit_test(test_fetch_row_half_given),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
