/* The op-consistency harness must be able to fail: run it CPU-vs-CPU (must pass), then against a
 * CPU backend with one op deliberately perturbed (must report exactly that op). Runs without a
 * GPU, so CI keeps the harness honest for the GPU sessions that rely on it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <string.h>

#include "backend/backend.h"
#include "ops_check.h"

static int (*g_real_rmsnorm)(void *, float *, const float *, const float *, int, int, float);
static int bad_rmsnorm(void *ctx, float *y, const float *x, const float *w, int n_rows, int dim, float eps)
{
    int rc = g_real_rmsnorm(ctx, y, x, w, n_rows, dim, eps);
    if (n_rows * dim > 3) y[n_rows * dim / 2] *= 1.001f;   /* one element off by 0.1% */
    return rc;
}

static void test_cpu_vs_cpu_passes(void **state)
{
    (void)state;
    prism_backend_t *ref = prism_backend_cpu_create(2), *dev = prism_backend_cpu_create(1);
    prism_opcheck_t t = {0};
    prism_opcheck_run(&t, ref, dev, NULL);
    if (t.n_fail) fail_msg("%s", t.first_fail);
    assert_true(t.n_pass > 50);
    assert_int_equal(t.ops_fail, 0);
    assert_int_equal(ref->i.pool_used(ref->ctx), 0);   /* the harness frees what it allocates */
    assert_int_equal(dev->i.pool_used(dev->ctx), 0);
    prism_backend_destroy(ref);
    prism_backend_destroy(dev);
}

static void test_detects_a_wrong_op(void **state)
{
    (void)state;
    prism_backend_t *ref = prism_backend_cpu_create(1), *dev = prism_backend_cpu_create(1);
    g_real_rmsnorm = dev->i.rmsnorm;
    dev->i.rmsnorm = bad_rmsnorm;
    prism_opcheck_t t = {0};
    prism_opcheck_run(&t, ref, dev, "rmsnorm");
    prism_opcheck_run(&t, ref, dev, "layernorm");
    assert_true(t.n_fail >= 3);
    assert_int_equal(t.ops_fail, 1);
    assert_int_equal(t.ops_pass, 1);
    assert_non_null(strstr(t.first_fail, "rmsnorm"));
    prism_backend_destroy(ref);
    prism_backend_destroy(dev);
}

int main(void)
{
    prism_log_init("test_ops_harness", PRISM_LOG_WARN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cpu_vs_cpu_passes),
        cmocka_unit_test(test_detects_a_wrong_op),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
