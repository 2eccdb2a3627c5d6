/* Unit tests: the encoder's image pool (encoder_worker/decode_pool.h: tasks run at once, each on its
 * member's own preprocessing context, every task once) and its batch order (main.c next_queued /
 * age_queued: a request's lower priority first, small images before large ones, oldest first, and no
 * request overtaken indefinitely). Timing-free: concurrency is shown by a task that waits for another to start. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#define main encoder_worker_main
#include "../../../encoder_worker/main.c"
#undef main

#include <time.h>

/* ---- the pool ---- */

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int started;
    int ran[8];
    enc_prep_t *prep_of[8];
    bool met;              /* task 0 saw task 1 start while it still ran */
} rendezvous_t;

/* Task 0 waits (up to 5 s) for task 1 to start: only a pool that runs two tasks at once lets it. */
static int rendezvous_task(void *ctx, int task, enc_prep_t *prep)
{
    rendezvous_t *r = ctx;
    pthread_mutex_lock(&r->mu);
    r->started++;
    r->ran[task]++;
    r->prep_of[task] = prep;
    pthread_cond_broadcast(&r->cv);
    if (task == 0) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += 5;
        while (r->started < 2 && pthread_cond_timedwait(&r->cv, &r->mu, &until) == 0) {
        }
        r->met = r->started >= 2;
    }
    pthread_mutex_unlock(&r->mu);
    return PRISM_OK;
}

/* What a member plans for: images at most 64 pixels wide. */
static enc_prep_t small_plan(void)
{
    enc_prep_t planned;
    memset(&planned, 0, sizeof planned);
    planned.dec_bytes = prism_image_decoder_bytes(64, 0);
    planned.ws_bytes = 64;
    planned.max_width = 64;
    return planned;
}

static void test_pool_runs_tasks_at_once(void **state)
{
    enc_prep_t planned = small_plan();
    enc_pool_t pool;
    assert_int_equal(enc_pool_create(&pool, 2, &planned, false), PRISM_OK);
    for (int round = 0; round < 3; round++) {   /* the members sleep between runs and wake again */
        rendezvous_t r = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
        enc_pool_run(&pool, 5, rendezvous_task, &r);
        assert_true(r.met);
        for (int t = 0; t < 5; t++) assert_int_equal(r.ran[t], 1);
        assert_ptr_not_equal(r.prep_of[0], r.prep_of[1]);   /* each member decodes with its own memory */
    }
    assert_int_equal(atomic_load(&pool.peak), 2);
    enc_pool_destroy(&pool);
}

/* A detached pool (--overlap-decode): enc_pool_start returns while the tasks run on the members'
 * threads (the caller sees two of them start without taking any, as the encoder's loop runs the
 * vision tower meanwhile); enc_pool_wait returns when all are done. */
static void test_detached_pool_runs_while_the_caller_works(void **state)
{
    enc_prep_t planned = small_plan();
    enc_pool_t pool;
    assert_int_equal(enc_pool_create(&pool, 2, &planned, true), PRISM_OK);
    assert_int_equal(pool.n_started, enc_pool_threads(2, true));
    for (int round = 0; round < 3; round++) {
        rendezvous_t r = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
        enc_pool_start(&pool, 5, rendezvous_task, &r);
        pthread_mutex_lock(&r.mu);
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += 5;
        while (r.started < 2 && pthread_cond_timedwait(&r.cv, &r.mu, &until) == 0) {
        }
        int seen = r.started;
        pthread_mutex_unlock(&r.mu);
        assert_true(seen >= 2);   /* they ran while the caller was elsewhere */
        enc_pool_wait(&pool);
        assert_true(r.met);
        for (int t = 0; t < 5; t++) assert_int_equal(r.ran[t], 1);
    }
    enc_pool_wait(&pool);   /* nothing started: returns at once */
    enc_pool_destroy(&pool);
}

/* ---- the order ---- */

enum { N_JOBS = 32 };

static encoder_t g_e;
static job_t g_jobs[N_JOBS];

static job_t *queue(int i, int side, double t, bool request)
{
    job_t *j = &g_jobs[i];
    memset(j, 0, sizeof *j);
    j->state = JOB_QUEUED;
    j->file_pixels = (uint64_t)side * side;
    j->t_arrive = t;
    if (request) snprintf(j->prefill_endpoint, sizeof j->prefill_endpoint, "tcp://prefill");
    return j;
}

/* One-image batches: the job each takes, the others aged. */
static job_t *take(void)
{
    job_t *j = next_queued(&g_e);
    if (!j) return NULL;
    j->state = JOB_SEND;
    age_queued(&g_e, j->t_arrive);
    return j;
}

static void setup_queue(void)
{
    memset(&g_e, 0, sizeof g_e);
    g_e.jobs = g_jobs;
    g_e.max_queue = N_JOBS;
    for (int i = 0; i < N_JOBS; i++) g_jobs[i].state = JOB_FREE;
}

static void test_small_before_large_oldest_first(void **state)
{
    setup_queue();
    job_t *l1 = queue(0, 4096, 1.0, true), *l2 = queue(1, 2048, 2.0, true);
    job_t *s1 = queue(2, 512, 3.0, true), *s2 = queue(3, 448, 4.0, true);
    job_t *early = queue(4, 256, 0.5, false);   /* an early job, older than all: after every request */
    assert_ptr_equal(take(), s1);
    assert_ptr_equal(take(), s2);
    assert_ptr_equal(take(), l1);
    assert_ptr_equal(take(), l2);
    assert_ptr_equal(take(), early);
    assert_null(take());
}

/* `priority` (Encode.priority, lower first) before size and age among requests' images; an early job
 * (priority 0) still after a request of priority 5; equal priorities keep size, then age. */
static void test_priority_first_among_requests(void **state)
{
    setup_queue();
    job_t *early = queue(0, 256, 0.5, false);   /* first in the table: scanned first */
    job_t *s_low = queue(1, 512, 1.0, true), *l_high = queue(2, 4096, 2.0, true);
    job_t *s_high = queue(3, 512, 3.0, true), *late = queue(4, 512, 4.0, true);
    s_low->priority = 5;
    l_high->priority = s_high->priority = -10;
    early->priority = -20;   /* never set by the router: an early job stays last whatever it holds */
    assert_ptr_equal(take(), s_high);   /* priority -10: small before large */
    assert_ptr_equal(take(), l_high);
    assert_ptr_equal(take(), late);     /* priority 0 */
    assert_ptr_equal(take(), s_low);    /* priority 5, the oldest request */
    assert_ptr_equal(take(), early);
    assert_null(take());
}

/* A large image under a steady stream of small ones: passed over by ENC_MAX_PASSED batches, then
 * taken before every younger small one. */
static void test_large_not_overtaken_indefinitely(void **state)
{
    setup_queue();
    job_t *large = queue(0, 4096, 1.0, true);
    double t = 2.0;
    for (int i = 1; i < 6; i++) queue(i, 512, t++, true);
    int smalls_first = 0;
    for (int k = 0; k < 100; k++) {   /* never taken at all: 100 */
        job_t *j = take();
        assert_non_null(j);
        if (j == large) break;
        smalls_first++;
        queue((int)(j - g_jobs), 512, t++, true);   /* a new small one arrives for each taken */
    }
    assert_int_equal(smalls_first, ENC_MAX_PASSED);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pool_runs_tasks_at_once),
        cmocka_unit_test(test_detached_pool_runs_while_the_caller_works),
        cmocka_unit_test(test_small_before_large_oldest_first),
        cmocka_unit_test(test_large_not_overtaken_indefinitely),
        cmocka_unit_test(test_priority_first_among_requests),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
