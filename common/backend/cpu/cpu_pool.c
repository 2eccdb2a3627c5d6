/* Persistent fork-join worker pool for the CPU kernels.
 *
 * A forward pass runs hundreds of short ops back to back (a decode step: ~11 per layer), so the
 * hand-off must cost microseconds, not a scheduler round trip: after a task a worker spins on the
 * generation counter for a short while (PRISM_CPU_POOL_SPIN pauses, about 0.1 ms) and
 * only then sleeps on the condition variable; the caller likewise spins before sleeping on the
 * completion count. Start and completion also go through the mutex, so a sleeper never misses a
 * wake-up. */
#include "backend/cpu/cpu_impl.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#define PRISM_CPU_POOL_SPIN 4000

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
        uint64_t g = atomic_load_explicit(&p->generation, memory_order_acquire);
        for (int spin = 0; g == seen && spin < PRISM_CPU_POOL_SPIN; spin++) {
            CPU_RELAX();
            g = atomic_load_explicit(&p->generation, memory_order_acquire);
        }
        if (g == seen) {
            pthread_mutex_lock(&p->mu);
            while (!atomic_load_explicit(&p->stop, memory_order_relaxed) &&
                   atomic_load_explicit(&p->generation, memory_order_acquire) == seen)
                pthread_cond_wait(&p->start_cv, &p->mu);
            bool stop = atomic_load_explicit(&p->stop, memory_order_relaxed);
            pthread_mutex_unlock(&p->mu);
            if (stop) return NULL;
            g = atomic_load_explicit(&p->generation, memory_order_acquire);
        }
        seen = g;
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) return NULL;
        int nth = p->n_active;
        if (ith < nth) p->fn(p->arg, ith, nth);
        if (atomic_fetch_sub_explicit(&p->pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->done_cv);
            pthread_mutex_unlock(&p->mu);
        }
    }
}

int prism_cpu_pool_init(prism_cpu_pool_t *p, int n_threads)
{
    memset(p, 0, sizeof *p);
    if (n_threads < 1) n_threads = 1;
    if (n_threads > PRISM_CPU_MAX_THREADS) n_threads = PRISM_CPU_MAX_THREADS;
    p->n_threads = n_threads;
    atomic_init(&p->generation, 0);
    atomic_init(&p->pending, 0);
    atomic_init(&p->stop, false);
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
        atomic_store_explicit(&p->stop, true, memory_order_release);
        atomic_fetch_add_explicit(&p->generation, 1, memory_order_release);
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
    /* Every worker takes part in the hand-off (those with ith >= nth return at once), so the
     * completion count is the same whatever nth is. */
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->arg = arg;
    p->n_active = nth;
    atomic_store_explicit(&p->pending, p->n_threads - 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&p->generation, 1, memory_order_release);
    pthread_cond_broadcast(&p->start_cv);
    pthread_mutex_unlock(&p->mu);
    fn(arg, 0, nth);
    for (int spin = 0; spin < PRISM_CPU_POOL_SPIN; spin++) {
        if (atomic_load_explicit(&p->pending, memory_order_acquire) == 0) return;
        CPU_RELAX();
    }
    pthread_mutex_lock(&p->mu);
    while (atomic_load_explicit(&p->pending, memory_order_acquire) > 0) pthread_cond_wait(&p->done_cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
