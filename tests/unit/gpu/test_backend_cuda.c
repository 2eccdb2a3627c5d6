/* CUDA backend vs the CPU reference, op by op (ops_check.c), plus the allocation and
 * no-device contracts. Without a GPU every CUDA test is reported SKIPPED (cmocka skip() and exit
 * code 77, which ctest maps to "Skipped"), and only test_no_device_fails_cleanly runs. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "ops_check.h"

#define SKIP_CODE 77

static prism_backend_t *g_cpu, *g_cuda;
static uint64_t g_mallocs_after_create;

static void test_op(void **state)
{
    const char *op = *state;
    if (!g_cuda) {
        print_message("SKIPPED: no CUDA device (%s)\n", op);
        skip();
    }
    prism_opcheck_t t = {.out = stdout, .verbose = getenv("PRISM_GPU_VERBOSE") != NULL,
                         .big = getenv("PRISM_GPU_BIG") != NULL};
    prism_opcheck_run(&t, g_cpu, g_cuda, op);
    if (t.n_fail) fail_msg("%d case(s) failed; first: %s", t.n_fail, t.first_fail);
    assert_true(t.n_pass > 0);
}

/* Ops ran above; none of them may have reached cudaMalloc / cudaHostAlloc. */
static void test_no_device_alloc_on_ops(void **state)
{
    (void)state;
    if (!g_cuda) skip();
    assert_int_equal(prism_cuda_malloc_count(), g_mallocs_after_create);
    assert_int_equal(g_cuda->i.pool_used(g_cuda->ctx), prism_cuda_reserved_bytes(g_cuda));  /* all freed */
}

static void test_pool_limits(void **state)
{
    (void)state;
    if (!g_cuda) skip();
    size_t cap = g_cuda->i.pool_cap(g_cuda->ctx), used = g_cuda->i.pool_used(g_cuda->ctx);
    assert_null(prism_backend_buf_alloc(g_cuda, cap));                 /* beyond what is left: refused */
    void *a = prism_backend_buf_alloc(g_cuda, 1000), *b = prism_backend_buf_alloc(g_cuda, 5000);
    assert_non_null(a);
    assert_non_null(b);
    assert_int_equal((uintptr_t)a % 256, 0);
    assert_int_equal((uintptr_t)b % 256, 0);
    assert_int_equal(g_cuda->i.pool_used(g_cuda->ctx), used + 1024 + 5120);
    assert_null(prism_backend_buf_alloc(g_cuda, cap - used - 1024 - 5120 + 1));   /* one byte too many */
    prism_backend_buf_free(g_cuda, a);
    prism_backend_buf_free(g_cuda, b);
    assert_int_equal(g_cuda->i.pool_used(g_cuda->ctx), used);
    void *big = prism_backend_buf_alloc(g_cuda, cap - used);   /* exactly the rest: the frees coalesced */
    assert_non_null(big);
    prism_backend_buf_free(g_cuda, big);
    assert_int_equal(g_cuda->i.pool_used(g_cuda->ctx), used);
    assert_int_equal(prism_cuda_malloc_count(), g_mallocs_after_create);
}

/* Runs everywhere: with no device, cuda requests fail with a status and cpu still works. */
static void test_no_device_fails_cleanly(void **state)
{
    (void)state;
    if (prism_cuda_available()) skip();
    prism_backend_t *be = (prism_backend_t *)1;
    assert_int_equal(prism_backend_create("cuda", 1, 1 << 20, &be), PRISM_ENOTSUP);
    assert_null(be);
    int st = 0;
    assert_null(prism_backend_cuda_create(0, 1 << 30, &st));
    assert_int_equal(st, PRISM_ENOTSUP);
    assert_int_equal(prism_cuda_malloc_count(), 0);
    assert_int_equal(prism_backend_create("cpu", 1, 0, &be), PRISM_OK);
    assert_non_null(be);
    prism_backend_destroy(be);
}

int main(void)
{
    prism_log_init("test_backend_cuda", PRISM_LOG_WARN);
    bool have = prism_cuda_available();
    g_cpu = prism_backend_cpu_create(2);
    if (have) {
        int st = 0;
        g_cuda = prism_backend_cuda_create(0, (size_t)2 << 30, &st);
        if (!g_cuda) {
            fprintf(stderr, "a CUDA device is visible but the backend failed to start (%s)\n", prism_strerror(st));
            return 1;
        }
        g_mallocs_after_create = prism_cuda_malloc_count();
    } else {
        printf("SKIPPED: no CUDA device (the op-consistency tests need a GPU; see docs/CUDA.md)\n");
    }
#define OP(name) cmocka_unit_test_prestate(test_op, (void *)name)
    const struct CMUnitTest tests[] = {
        OP("copy"), OP("matmul"), OP("rmsnorm"), OP("layernorm"), OP("rope"), OP("act"), OP("silu_mul"),
        OP("add"), OP("scale"), OP("get_rows"), OP("im2patch"), OP("kv"), OP("attn_paged"), OP("attn_decode"),
        OP("attn_dense"), OP("argmax"), OP("fill_random"), OP("sample"), OP("scatter_rows"), OP("head_rmsnorm"), OP("scale_rows"),
        OP("moe"), OP("pixel_shuffle"), OP("logits_processors"),
        cmocka_unit_test(test_no_device_alloc_on_ops),
        cmocka_unit_test(test_pool_limits),
        cmocka_unit_test(test_no_device_fails_cleanly),
    };
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    prism_backend_destroy(g_cuda);
    prism_backend_destroy(g_cpu);
    if (failed) return 1;
    return have ? 0 : SKIP_CODE;
}
