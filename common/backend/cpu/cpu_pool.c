/* Persistent fork-join worker pool for the CPU kernels. */
#include "backend/cpu/cpu_impl.h"

typedef struct {
    prism_cpu_pool_t *p;
    int ith;
} worker_arg_t;

static void *worker_main(void *raw)
{
    prism_cpu_pool_t *p = ((worker_arg_t *)raw)[0].p;
    int ith = ((worker_arg_t *)raw)[0].ith;
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        while (!p->stop && p->generation == seen) pthread_cond_wait(&p->start_cv, &p->mu);
        if (p->stop) {
            pthread_mutex_unlock(&p->mu);
            return NULL;
        }
        seen = p->generation;
        prism_cpu_task_fn fn = p->fn;
        void *arg = p->arg;
        int nth = p->n_active;
        pthread_mutex_unlock(&p->mu);
        if (ith < nth) fn(arg, ith, nth);
        pthread_mutex_lock(&p->mu);
        if (--p->pending == 0) pthread_cond_signal(&p->done_cv);
        pthread_mutex_unlock(&p->mu);
    }
}

int prism_cpu_pool_init(prism_cpu_pool_t *p, int n_threads)
{
    memset(p, 0, sizeof *p);
    if (n_threads < 1) n_threads = 1;
    if (n_threads > 256) n_threads = 256;
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->start_cv, NULL);
    pthread_cond_init(&p->done_cv, NULL);
    if (n_threads == 1) return PRISM_OK;
    p->threads = prism_calloc((size_t)n_threads - 1, sizeof(pthread_t));
    p->args = prism_calloc((size_t)n_threads - 1, sizeof(worker_arg_t));
    if (!p->threads || !p->args) goto fail;
    worker_arg_t *args = p->args;
    for (int i = 0; i < n_threads - 1; i++) {
        args[i].p = p;
        args[i].ith = i + 1;
        if (pthread_create(&p->threads[i], NULL, worker_main, &args[i]) != 0) {
            p->n_threads = i + 1;  /* only the started ones get joined */
            goto fail;
        }
    }
    return PRISM_OK;
fail:
    prism_cpu_pool_free(p);
    return PRISM_ENOMEM;
}

void prism_cpu_pool_free(prism_cpu_pool_t *p)
{
    if (p->threads) {
        pthread_mutex_lock(&p->mu);
        p->stop = true;
        pthread_cond_broadcast(&p->start_cv);
        pthread_mutex_unlock(&p->mu);
        for (int i = 0; i < p->n_threads - 1; i++) pthread_join(p->threads[i], NULL);
    }
    prism_free(p->threads);
    prism_free(p->args);
    p->threads = NULL;
    p->args = NULL;
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->start_cv);
    pthread_cond_destroy(&p->done_cv);
}

void prism_cpu_pool_run(prism_cpu_pool_t *p, int nth, prism_cpu_task_fn fn, void *arg)
{
    if (nth > p->n_threads) nth = p->n_threads;
    if (nth <= 1 || !p->threads) {
        fn(arg, 0, 1);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->arg = arg;
    p->n_active = nth;
    p->pending = p->n_threads - 1;
    p->generation++;
    pthread_cond_broadcast(&p->start_cv);
    pthread_mutex_unlock(&p->mu);
    fn(arg, 0, nth);
    pthread_mutex_lock(&p->mu);
    while (p->pending > 0) pthread_cond_wait(&p->done_cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
