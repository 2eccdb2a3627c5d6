/* plan: the router's memory as one budget (--mem-budget), planned at start-up like a worker's.
 *
 * Every row is either measured at start-up (what the process holds once its model facts are
 * loaded) or a bound the router enforces while it runs: bytes of request bodies it holds, image
 * bytes it keeps for retries, early-encode copies, connections, requests in flight, streams'
 * queued bytes, bodies being parsed, image downloads. The rows add up to what the process may hold;
 * the bench (tests/bench/bench_router_memory.py) and integration test
 * (test_limits.py::test_router_within_its_budget_under_a_burst) hold its peak resident set to it.
 *
 * A flag left at 0 (auto) takes its share of what the budget leaves once the fixed rows (start-up,
 * reserve, requests, parsing) and the flags given explicitly are counted; the shares are weights
 * (k_share in plan.c), and a bound that needs a floor (a body of --max-body-bytes must fit the body
 * budget) gets it before the rest is shared. A plan whose explicit flags do not fit refuses to
 * start, naming the numbers, as a worker does. --mem-budget 0: no budget, the flags keep their old
 * defaults and the plan is only logged.
 *
 *   router_plan_in_t in = {.budget = 512 << 20, .startup = rss, ...};   // 0 = derive
 *   router_plan_t plan;
 *   if (router_plan_make(&in, &plan, err, sizeof err) != PRISM_OK) { log(err); exit(2); }
 *   router_plan_log(&plan);   // then use plan.body_inflight, plan.max_connections, ...
 *
 * No allocation; no I/O but the log and router_mem_resident (unit test:
 * tests/unit/router/test_router_plan.c). */
#ifndef PRISM_ROUTER_PLAN_H
#define PRISM_ROUTER_PLAN_H

#include "core/core.h"

#define ROUTER_PLAN_RESERVE ((size_t)32 << 20)   /* libuv, ZeroMQ's queues and threads, stacks, allocator */

typedef enum {
    ROUTER_ROW_STARTUP,      /* measured: resident once the model facts are loaded */
    ROUTER_ROW_RESERVE,      /* headroom (ROUTER_PLAN_RESERVE) */
    ROUTER_ROW_CONNECTIONS,  /* --max-connections x one connection's most (headers, read buffers) */
    ROUTER_ROW_BODIES,       /* --max-body-bytes-in-flight + one --max-body-bytes (the oldest reads on) */
    ROUTER_ROW_IMAGES,       /* --max-image-bytes-in-flight + one body's images (completed under it) */
    ROUTER_ROW_EARLY,        /* --max-early-encode-bytes: copies sent while their body still arrives */
    ROUTER_ROW_REQUESTS,     /* --max-running-requests x one request's state (tokens, output, messages) */
    ROUTER_ROW_STREAMS,      /* --max-running-requests x --max-stream-pending-bytes */
    ROUTER_ROW_PARSING,      /* --prep-threads x one parse (tree, template, text, tokens) */
    ROUTER_ROW_FETCH,        /* URL fetches: downloads at once x largest image + the URL cache */
    ROUTER_ROW_PREFIX,       /* the prefix index (a later issue): 0 */
    ROUTER_ROW_COUNT
} router_row_t;

typedef struct {
    size_t budget;           /* --mem-budget; 0 = none */
    size_t startup;          /* measured */
    /* flags: 0 = derive from the budget (or the old default without one) */
    int64_t max_connections;
    size_t max_body;         /* --max-body-bytes */
    size_t body_inflight, image_inflight, early_bytes, stream_pending, parse_bound;
    /* given */
    size_t conn_bytes;       /* one connection's most (prism_http_conn_bound) */
    int max_running, prep_threads;
    size_t request_bytes;    /* one request's most, its parsed body not counted (freed after preparation) */
    size_t parse_factor;     /* a parse holds this many times its tree (tree, template context, text, tokens) */
    bool fetch;              /* the URL fetcher is in: its row counts */
    int64_t fetch_inflight;  /* downloads at once (0 = derive) */
    size_t fetch_max_bytes;  /* largest image downloaded */
    size_t fetch_cache;      /* URL cache bytes (0 = derive, with fetch_cache_set false) */
    bool fetch_cache_set;    /* the cache size was given (0 then means no cache) */
} router_plan_in_t;

typedef struct {
    size_t bytes[ROUTER_ROW_COUNT];
    bool derived[ROUTER_ROW_COUNT];   /* its bound came from the budget */
    size_t budget, total;
    /* the bounds to run with */
    int64_t max_connections;
    size_t max_body, body_inflight, image_inflight, early_bytes, stream_pending, parse_bound;
    int64_t fetch_inflight;
    size_t fetch_cache;
} router_plan_t;

const char *router_plan_row_name(router_row_t row);
/* PRISM_OK, or PRISM_ENOMEM with err naming the numbers (the budget cannot hold the explicit rows,
 * or what is left is below the floors of the derived ones). */
int  router_plan_make(const router_plan_in_t *in, router_plan_t *out, char *err, size_t n);
void router_plan_log(const router_plan_t *p);
/* The process's resident set now and at its peak (VmRSS, VmHWM), in bytes; 0 when unknown. */
void router_mem_resident(size_t *rss, size_t *hwm);

#endif
