/* The CUDA backend's pool carving (common/backend/cuda/cuda_pool.c) on the CPU: the device
 * address range is a host buffer that is never touched. Checks the promises in docs/CUDA.md:
 * first-fit with coalescing, 256-byte alignment, fixed metadata that refuses instead of growing,
 * used/peak accounting, and that freeing a pointer the pool never handed out is caught. A random
 * sequence is compared against a byte-map model of the same policy. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend/cuda/cuda_pool.h"

#define A PRISM_CUDA_POOL_ALIGN

static uint8_t *fake_base(void)
{
    /* Any aligned address works: the pool does arithmetic only. */
    return (uint8_t *)(uintptr_t)(1u << 20);
}

static void test_carve_align_and_coalesce(void **state)
{
    (void)state;
    prism_cuda_pool_t p;
    uint8_t *base = fake_base();
    assert_int_equal(prism_cuda_pool_init(&p, base, 64 * A, 64), PRISM_OK);
    uint8_t *a = prism_cuda_pool_take(&p, 1);         /* one unit */
    uint8_t *b = prism_cuda_pool_take(&p, A + 1);     /* two units */
    uint8_t *c = prism_cuda_pool_take(&p, 0);         /* zero still takes one unit */
    assert_ptr_equal(a, base);
    assert_ptr_equal(b, base + A);
    assert_ptr_equal(c, base + 3 * A);
    assert_int_equal(p.used, 4 * A);
    assert_int_equal(p.peak, 4 * A);
    assert_int_equal(p.n_segs, 4);                     /* a, b, c, free rest */
    /* a hole is reused first-fit, a larger request goes past it */
    prism_cuda_pool_give(&p, b);
    assert_int_equal(p.used, 2 * A);
    uint8_t *d = prism_cuda_pool_take(&p, 3 * A);
    assert_ptr_equal(d, base + 4 * A);
    uint8_t *e = prism_cuda_pool_take(&p, 2 * A);
    assert_ptr_equal(e, base + A);                     /* the exact hole, no split */
    assert_int_equal(p.peak, 7 * A);
    /* freeing everything in any order coalesces back to one free segment */
    prism_cuda_pool_give(&p, c);
    prism_cuda_pool_give(&p, a);
    prism_cuda_pool_give(&p, d);
    prism_cuda_pool_give(&p, e);
    prism_cuda_pool_give(&p, NULL);
    assert_int_equal(p.used, 0);
    assert_int_equal(p.n_segs, 1);
    assert_int_equal(p.segs[0].size, 64 * A);
    assert_int_equal(p.peak, 7 * A);
    prism_cuda_pool_destroy(&p);
}

static void test_capacity_bounds(void **state)
{
    (void)state;
    prism_cuda_pool_t p;
    uint8_t *base = fake_base();
    assert_int_equal(prism_cuda_pool_init(&p, base, 8 * A, 16), PRISM_OK);
    assert_null(prism_cuda_pool_take(&p, 8 * A + 1));
    assert_null(prism_cuda_pool_take(&p, SIZE_MAX));  /* no overflow in the rounding */
    uint8_t *all = prism_cuda_pool_take(&p, 8 * A);
    assert_ptr_equal(all, base);
    assert_int_equal(p.n_segs, 1);
    assert_null(prism_cuda_pool_take(&p, 1));
    prism_cuda_pool_give(&p, all);
    /* 7 units fit, then 2 do not (1 left), 1 does */
    uint8_t *x = prism_cuda_pool_take(&p, 7 * A);
    assert_non_null(x);
    assert_null(prism_cuda_pool_take(&p, 2 * A));
    assert_non_null(prism_cuda_pool_take(&p, A));
    assert_int_equal(p.used, 8 * A);
    prism_cuda_pool_destroy(&p);
}

static void test_metadata_full_refuses(void **state)
{
    (void)state;
    prism_cuda_pool_t p;
    assert_int_equal(prism_cuda_pool_init(&p, fake_base(), 64 * A, 4), PRISM_OK);
    void *v[3];
    for (int i = 0; i < 3; i++) v[i] = prism_cuda_pool_take(&p, A);
    assert_int_equal(p.n_segs, 4);
    /* splitting the free tail needs a fifth entry: refused although 61 units are free */
    assert_null(prism_cuda_pool_take(&p, A));
    /* taking the whole free tail needs no split: allowed */
    void *tail = prism_cuda_pool_take(&p, 61 * A);
    assert_non_null(tail);
    prism_cuda_pool_give(&p, v[1]);
    assert_ptr_equal(prism_cuda_pool_take(&p, A), v[1]);  /* an exact hole still works */
    prism_cuda_pool_destroy(&p);
}

static void test_give_foreign_pointer_aborts(void **state)
{
    (void)state;
    /* The assert is always on (STYLE: invariants abort): run it in a child. */
    for (int which = 0; which < 3; which++) {
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            prism_log_init("test_cuda_pool", PRISM_LOG_ERROR);
            prism_cuda_pool_t p;
            prism_cuda_pool_init(&p, fake_base(), 16 * A, 16);
            uint8_t *a = prism_cuda_pool_take(&p, A);
            if (which == 0) prism_cuda_pool_give(&p, a + A);        /* never handed out */
            else if (which == 1) prism_cuda_pool_give(&p, a + 64 * A); /* outside the pool */
            else { prism_cuda_pool_give(&p, a); prism_cuda_pool_give(&p, a); } /* double free */
            _exit(0);
        }
        int st = 0;
        waitpid(pid, &st, 0);
        if (!WIFSIGNALED(st)) fail_msg("case %d: give of a bad pointer did not abort (status %d)", which, st);
    }
}

/* Reference model: one byte per unit, 0 free / 1 used; first fit = lowest run of free units. */
static long model_first_fit(const uint8_t *m, size_t units, size_t need)
{
    for (size_t i = 0, run = 0; i < units; i++) {
        run = m[i] ? 0 : run + 1;
        if (run == need) return (long)(i + 1 - need);
    }
    return -1;
}

static void test_random_against_model(void **state)
{
    (void)state;
    enum { UNITS = 4096, LIVE = 256 };
    prism_cuda_pool_t p;
    uint8_t *base = fake_base();
    assert_int_equal(prism_cuda_pool_init(&p, base, (size_t)UNITS * A, PRISM_CUDA_MAX_SEGS), PRISM_OK);
    static uint8_t model[UNITS];
    uint8_t *live[LIVE] = {0};
    size_t live_units[LIVE] = {0}, used = 0, peak = 0;
    uint64_t s = 12345;
    for (int it = 0; it < 20000; it++) {
        s ^= s << 13; s ^= s >> 7; s ^= s << 17;
        int k = (int)(s % LIVE);
        if (live[k]) {
            size_t off = (size_t)(live[k] - base) / A;
            memset(model + off, 0, live_units[k]);
            prism_cuda_pool_give(&p, live[k]);
            used -= live_units[k] * A;
            live[k] = NULL;
        } else {
            size_t bytes = 1 + (s >> 20) % (64 * A);
            size_t need = (bytes + A - 1) / A;
            long want = model_first_fit(model, UNITS, need);
            uint8_t *got = prism_cuda_pool_take(&p, bytes);
            if (want < 0) {
                assert_null(got);
                continue;
            }
            if (got != base + (size_t)want * A)
                fail_msg("iteration %d: take(%zu) gave offset %td, first fit is %ld", it, bytes,
                         got ? (got - base) / A : -1, want);
            memset(model + want, 1, need);
            live[k] = got;
            live_units[k] = need;
            used += need * A;
            if (used > peak) peak = used;
        }
        assert_int_equal(p.used, used);
        assert_int_equal(p.peak, peak);
        /* segments tile [0, cap) in order, and no two free segments are adjacent */
        size_t off = 0;
        for (int i = 0; i < p.n_segs; i++) {
            assert_int_equal(p.segs[i].off, off);
            assert_true(p.segs[i].size > 0 && p.segs[i].size % A == 0);
            if (i) assert_false(!p.segs[i].used && !p.segs[i - 1].used);
            off += p.segs[i].size;
        }
        assert_int_equal(off, p.cap);
    }
    for (int k = 0; k < LIVE; k++) prism_cuda_pool_give(&p, live[k]);
    assert_int_equal(p.used, 0);
    assert_int_equal(p.n_segs, 1);
    prism_cuda_pool_destroy(&p);
}

typedef struct {
    prism_cuda_pool_t *p;
    int seed;
    int failures;
} thr_arg_t;

static void *thr_main(void *raw)
{
    thr_arg_t *t = raw;
    void *mine[32] = {0};
    uint64_t s = (uint64_t)t->seed * 0x9E3779B97F4A7C15ull + 1;
    for (int it = 0; it < 20000; it++) {
        s ^= s << 13; s ^= s >> 7; s ^= s << 17;
        int k = (int)(s % 32);
        if (mine[k]) {
            prism_cuda_pool_give(t->p, mine[k]);
            mine[k] = NULL;
        } else {
            mine[k] = prism_cuda_pool_take(t->p, 1 + (s >> 24) % (4 * A));
        }
    }
    for (int k = 0; k < 32; k++) prism_cuda_pool_give(t->p, mine[k]);
    return NULL;
}

static void test_threads(void **state)
{
    (void)state;
    prism_cuda_pool_t p;
    assert_int_equal(prism_cuda_pool_init(&p, fake_base(), 4096 * A, PRISM_CUDA_MAX_SEGS), PRISM_OK);
    pthread_t th[4];
    thr_arg_t args[4];
    for (int i = 0; i < 4; i++) {
        args[i] = (thr_arg_t){&p, i + 1, 0};
        pthread_create(&th[i], NULL, thr_main, &args[i]);
    }
    for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
    assert_int_equal(p.used, 0);
    assert_int_equal(p.n_segs, 1);
    prism_cuda_pool_destroy(&p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_carve_align_and_coalesce),
        cmocka_unit_test(test_capacity_bounds),
        cmocka_unit_test(test_metadata_full_refuses),
        cmocka_unit_test(test_give_foreign_pointer_aborts),
        cmocka_unit_test(test_random_against_model),
        cmocka_unit_test(test_threads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
