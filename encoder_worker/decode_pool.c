#include "decode_pool.h"

#include <string.h>

struct enc_pool_arg {
    enc_pool_t *p;
    int member;
};

size_t enc_pool_bytes(int n)
{
    return (size_t)n * sizeof(enc_prep_t) + (size_t)n * (sizeof(pthread_t) + sizeof(enc_pool_arg_t));
}

/* Takes tasks in order until none is left. */
static void take_tasks(enc_pool_t *p, enc_prep_t *prep)
{
    for (;;) {
        int t = atomic_fetch_add(&p->next, 1);
        if (t >= p->n_tasks) return;
        int now = atomic_fetch_add(&p->in_flight, 1) + 1;
        int peak = atomic_load(&p->peak);
        while (now > peak && !atomic_compare_exchange_weak(&p->peak, &peak, now)) {
        }
        p->fn(p->ctx, t, prep);
        atomic_fetch_sub(&p->in_flight, 1);
    }
}

static void *member_main(void *raw)
{
    enc_pool_arg_t *a = raw;
    enc_pool_t *p = a->p;
    uint64_t seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->generation == seen) pthread_cond_wait(&p->start_cv, &p->mu);
        if (p->stop) break;
        seen = p->generation;
        pthread_mutex_unlock(&p->mu);
        take_tasks(p, &p->preps[a->member]);
        pthread_mutex_lock(&p->mu);
        if (--p->busy == 0) pthread_cond_signal(&p->done_cv);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

int enc_pool_threads(int n, bool detached)
{
    return detached ? n : n - 1;
}

int enc_pool_create(enc_pool_t *p, int n, const enc_prep_t *planned, bool detached)
{
    memset(p, 0, sizeof *p);
    p->detached = detached;
    PRISM_ASSERT(n >= 1 && n <= ENC_POOL_MAX);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->start_cv, NULL);
    pthread_cond_init(&p->done_cv, NULL);
    atomic_init(&p->next, 0);
    atomic_init(&p->in_flight, 0);
    atomic_init(&p->peak, 0);
    p->preps = prism_calloc((size_t)n, sizeof(enc_prep_t));
    p->threads = prism_calloc((size_t)n, sizeof(pthread_t));
    p->args = prism_calloc((size_t)n, sizeof(enc_pool_arg_t));
    if (!p->preps || !p->threads || !p->args) goto fail;
    for (int i = 0; i < n; i++) {
        p->preps[i] = *planned;
        p->preps[i].dec = NULL;
        p->preps[i].relay = NULL;
        p->preps[i].ws = NULL;
        p->n = i + 1;   /* created members are destroyed on failure */
        if (enc_prep_create(&p->preps[i]) != PRISM_OK) goto fail;
    }
    int first = n - enc_pool_threads(n, detached);   /* member 0 is the caller's unless detached */
    for (int i = first; i < n; i++) {
        p->args[i - first] = (enc_pool_arg_t){p, i};
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, ENC_POOL_STACK_BYTES);
        int rc = pthread_create(&p->threads[i - first], &attr, member_main, &p->args[i - first]);
        pthread_attr_destroy(&attr);
        if (rc != 0) goto fail;
        p->n_started = i - first + 1;
    }
    return PRISM_OK;
fail:
    enc_pool_destroy(p);
    return PRISM_ENOMEM;
}

void enc_pool_destroy(enc_pool_t *p)
{
    enc_pool_wait(p);   /* the tasks of a started run still read the caller's data */
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->start_cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_started; i++) pthread_join(p->threads[i], NULL);
    p->n_started = 0;
    for (int i = 0; p->preps && i < p->n; i++) enc_prep_destroy(&p->preps[i]);
    prism_free(p->preps);
    prism_free(p->threads);
    prism_free(p->args);
    p->preps = NULL;
    p->threads = NULL;
    p->args = NULL;
    p->n = 0;
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->start_cv);
    pthread_cond_destroy(&p->done_cv);
}

/* Sets the run's tasks and wakes the member threads (none for a run the caller takes alone). */
static bool wake_members(enc_pool_t *p, int n_tasks, enc_pool_task_fn fn, void *ctx, bool caller_takes)
{
    PRISM_ASSERT(!p->started);
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store(&p->next, 0);
    /* one task the caller takes: the loop thread alone, no hand-off */
    bool wake = p->n_started > 0 && (n_tasks > 1 || !caller_takes);
    if (wake) {
        pthread_mutex_lock(&p->mu);
        p->busy = p->n_started;
        p->generation++;
        pthread_cond_broadcast(&p->start_cv);
        pthread_mutex_unlock(&p->mu);
    }
    p->started = wake;
    return wake;
}

void enc_pool_wait(enc_pool_t *p)
{
    if (!p->started) return;
    pthread_mutex_lock(&p->mu);
    while (p->busy > 0) pthread_cond_wait(&p->done_cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
    p->started = false;
}

void enc_pool_start(enc_pool_t *p, int n_tasks, enc_pool_task_fn fn, void *ctx)
{
    PRISM_ASSERT(p->detached);
    if (n_tasks > 0) wake_members(p, n_tasks, fn, ctx, false);
}

void enc_pool_run(enc_pool_t *p, int n_tasks, enc_pool_task_fn fn, void *ctx)
{
    if (n_tasks <= 0) return;
    wake_members(p, n_tasks, fn, ctx, !p->detached);
    if (!p->detached) take_tasks(p, &p->preps[0]);
    enc_pool_wait(p);
}
