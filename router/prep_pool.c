/* The preparation threads (--prep-threads: libuv's thread pool) in two lanes, generation first.
 *
 * libuv's pool is one FIFO queue: a generation request handed to it behind a row of multi-megabyte
 * /tokenize jobs waited for all of them (issue 26 finding 4: 49 queued 4 MiB jobs held a one-token
 * chat 26 s). So nothing waits in libuv's queue: a job is handed to the pool only when a thread is
 * free for it, and until then waits here, in its lane. When a thread frees, the oldest generation
 * job goes first; a utility job only when no generation job waits, and utility jobs together take
 * at most prep_threads - 1 threads (one thread is always left to generation when there are two or
 * more), so a generation request arriving while utility jobs run long starts at once. A waiting job
 * whose client left is taken out (router_prep_cancel) and never runs. One loop thread. */
#include "router.h"

static void lane_push(router_t *r, router_job_t *j)
{
    router_job_lane_t *l = &r->lanes[j->lane];
    j->next = NULL;
    j->prev = l->tail;
    if (l->tail) l->tail->next = j;
    else l->head = j;
    l->tail = j;
    l->waiting++;
    j->state = ROUTER_JOB_WAITING;
}

static void lane_del(router_t *r, router_job_t *j)
{
    router_job_lane_t *l = &r->lanes[j->lane];
    if (j->prev) j->prev->next = j->next;
    else l->head = j->next;
    if (j->next) j->next->prev = j->prev;
    else l->tail = j->prev;
    j->next = j->prev = NULL;
    l->waiting--;
}

/* Threads a lane may hold at once. */
static int lane_threads(const router_t *r, router_lane_t lane)
{
    return lane == ROUTER_LANE_GENERATE ? r->prep_threads : PRISM_MAX(r->prep_threads - 1, 1);
}

static void job_done(uv_work_t *w, int status);

/* Hands waiting jobs to free threads, generation first. */
static void pump(router_t *r)
{
    while (r->prep_running < r->prep_threads) {
        router_job_t *j = NULL;
        for (int lane = 0; lane < ROUTER_LANE_COUNT && !j; lane++)
            if (r->lanes[lane].head && r->lanes[lane].running < lane_threads(r, (router_lane_t)lane))
                j = r->lanes[lane].head;
        if (!j) return;
        lane_del(r, j);
        j->state = ROUTER_JOB_RUNNING;
        r->lanes[j->lane].running++;
        r->lanes[j->lane].started++;
        r->prep_running++;
        int rc = uv_queue_work(r->loop, &j->work, j->run, job_done);
        PRISM_ASSERT(rc == 0);   /* fails only without a work callback */
    }
}

static void job_done(uv_work_t *w, int status)
{
    router_job_t *j = (router_job_t *)w;
    router_t *r = j->r;
    r->lanes[j->lane].running--;
    r->prep_running--;
    j->state = ROUTER_JOB_IDLE;
    j->done(w, status);   /* may free j */
    pump(r);
}

void router_prep_submit(router_t *r, router_job_t *j, router_lane_t lane, uv_work_cb run, uv_after_work_cb done)
{
    PRISM_ASSERT(j->state == ROUTER_JOB_IDLE && lane < ROUTER_LANE_COUNT);
    j->r = r;
    j->lane = lane;
    j->run = run;
    j->done = done;
    lane_push(r, j);
    pump(r);
}

bool router_prep_cancel(router_t *r, router_job_t *j)
{
    if (j->state != ROUTER_JOB_WAITING) return false;
    lane_del(r, j);
    j->state = ROUTER_JOB_IDLE;
    r->lanes[j->lane].cancelled++;
    return true;
}
