/* decode_pool: the encoder's image decoders, several images of a batch at once.
 *
 * n members, each a preprocessing context of its own (prep.h: decoder region, relay ring,
 * workspace), all planned alike from the first one, so the plan's "decode" and "preprocess" rows
 * are n times one image's (issue 33: a burst of large JPEGs is bound by cores, not by one
 * thread). Member 0 runs on the caller's thread (the encoder's loop), members 1..n-1 on threads
 * started once, which sleep on a condition variable between batches: a decode takes milliseconds to
 * seconds, so a hand-off through the mutex costs nothing next to it.
 *
 *   enc_pool_create(&pool, n, &planned_prep);   // start-up, after the plan
 *   enc_pool_run(&pool, n_tasks, fn, ctx);      // per batch: fn(ctx, task, prep) for every task
 *   enc_pool_destroy(&pool);
 *
 * A detached pool (created with detached: the encoder's --overlap-decode) runs every member on a thread
 * of its own, so the caller can start a batch's decodes and go on (the vision tower over the batch
 * before) while they run:
 *
 *   enc_pool_start(&pool, n_tasks, fn, ctx);    // returns at once
 *   ...                                         // the caller's own work; it touches no task's data
 *   enc_pool_wait(&pool);                       // every task done
 *
 * enc_pool_run is a fork-join: it returns when every task is done. Tasks are taken in their order
 * (0 first) by whichever member is free: the caller puts the images whose answers must not wait
 * first. Ownership: the caller keeps everything a task reads or writes; fn must touch only its
 * task's own data (its image's bytes, its disjoint range of the pixel buffer, its error message):
 * nothing else runs on the loop thread meanwhile, which owns all the rest. */
#ifndef PRISM_ENCODER_DECODE_POOL_H
#define PRISM_ENCODER_DECODE_POOL_H

#include "prep.h"

#include <pthread.h>
#include <stdatomic.h>

#define ENC_POOL_MAX 256
#define ENC_POOL_STACK_BYTES ((size_t)512 << 10)   /* a member thread's stack (libjpeg needs a few KiB) */

typedef int (*enc_pool_task_fn)(void *ctx, int task, enc_prep_t *prep);

typedef struct enc_pool_arg enc_pool_arg_t;

typedef struct {
    int n;                       /* members */
    enc_prep_t *preps;           /* [n]: member i decodes with preps[i] */
    pthread_t *threads;          /* [n - 1]: members 1.. */
    enc_pool_arg_t *args;        /* [n - 1] */
    int n_started;
    pthread_mutex_t mu;
    pthread_cond_t start_cv, done_cv;
    uint64_t generation;         /* bumped per run that wakes the members (under mu) */
    int busy;                    /* members not yet back from the current run (under mu) */
    bool stop;
    bool detached;               /* every member on a thread (enc_pool_start); else member 0 is the caller */
    bool started;                /* a run was started and not waited for (the caller's thread only) */
    enc_pool_task_fn fn;
    void *ctx;
    int n_tasks;
    atomic_int next;             /* next task to take */
    atomic_int in_flight;        /* decodes running now */
    atomic_int peak;             /* most decodes running at once since start (heartbeats: the evidence) */
} enc_pool_t;

/* Bytes of the pool's own bookkeeping (the members' regions are prep.h's, times n). */
size_t enc_pool_bytes(int n);
/* Members that are copies of planned (sized by enc_prep_plan, not created), each created (counted),
 * and n - 1 threads (detached: n). PRISM_ENOMEM (everything released). */
int  enc_pool_create(enc_pool_t *p, int n, const enc_prep_t *planned, bool detached);
/* Threads of a pool of n members (their stacks are the plan's). */
int  enc_pool_threads(int n, bool detached);
void enc_pool_destroy(enc_pool_t *p);
/* fn(ctx, task, member's prep) for task 0..n_tasks-1, at most n at once; returns when all are done. */
void enc_pool_run(enc_pool_t *p, int n_tasks, enc_pool_task_fn fn, void *ctx);
/* Detached pools: fn(ctx, task, prep) for task 0..n_tasks-1 on the members' threads, started and
 * not waited for; enc_pool_wait returns when they are all done (at once when none was started). One
 * run at a time: start after the last run's wait. The caller keeps ctx and what the tasks touch until
 * the wait; destroy waits too. */
void enc_pool_start(enc_pool_t *p, int n_tasks, enc_pool_task_fn fn, void *ctx);
void enc_pool_wait(enc_pool_t *p);

#endif
