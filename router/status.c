/* Operator status: GET /status (JSON, behind the API key) and GET / (the status page).
 *
 * /status is a snapshot of what the router knows: its own counters and latency histograms as
 * cumulative totals, and every registered worker with its capacity, memory plan and last reported
 * load. It keeps no history: the page polls it and computes recent rates (requests, tokens,
 * completions per worker) and recent TTFT percentiles from the differences between two snapshots,
 * timed by the router's clock ("now_s"), so the router holds no per-client or windowed state.
 *
 * The page (status_page.html) is compiled into the binary (CMake turns it into status_page.c), has
 * no external assets and is served without the key: it holds no data. It asks for the key when
 * /status answers 401 and sends it as "Authorization: Bearer" on its fetches. */
#include "router.h"
#include "fetch.h"

#include <stdio.h>
#include <string.h>

extern const unsigned char prism_status_page[];
extern const size_t prism_status_page_len;

void router_refusals(const router_t *r, uint64_t out[PRISM_REFUSE_COUNT])
{
    /* Refusals the HTTP server answers itself, before the router sees a request. */
    prism_http_refusals_t hr;
    prism_http_server_refusals(r->http, &hr);
    memcpy(out, r->metrics.refused_limit, sizeof(uint64_t) * PRISM_REFUSE_COUNT);
    out[PRISM_REFUSE_BODY_TOO_LARGE] += hr.body_too_large;
    out[PRISM_REFUSE_BODY_BYTES_INFLIGHT] += hr.body_bytes_in_flight;
    out[PRISM_REFUSE_QUEUE_WAIT] += hr.body_gate;  /* paused while the workers were full */
    out[PRISM_REFUSE_CONNECTIONS] += hr.connections;
    out[PRISM_REFUSE_BAD_REQUEST] += hr.malformed;
}

static json_t *hist_json(const prism_hist_t *h)
{
    json_t *b = json_array(), *c = json_array();
    for (int i = 0; i < h->n; i++) {
        json_array_append_new(b, json_real(h->bounds[i]));
        json_array_append_new(c, json_integer((json_int_t)h->counts[i]));
    }
    /* counts[i]: observations in (bounds[i-1], bounds[i]]; the rest (above the last bound) is
     * count - sum(counts). */
    return json_pack("{s:o,s:o,s:I,s:f}", "bounds", b, "counts", c, "count", (json_int_t)h->count, "sum", h->sum);
}

static json_t *worker_json(const router_worker_t *w, double now)
{
    json_t *j = json_pack("{s:s,s:s,s:s,s:f,s:f,s:I,s:i,s:i,s:i,s:i,s:I}",
                          "id", w->id, "tier", prism_role_name(w->role), "data_endpoint", w->data_endpoint,
                          "heartbeat_age_s", now - w->last_seen, "registered_s", now - w->registered_at,
                          "heartbeats", (json_int_t)w->heartbeats,
                          "inflight", w->inflight, "capacity", (int)w->max_running,
                          "running", (int)w->running, "waiting", (int)w->waiting,
                          "completed", (json_int_t)w->completed);
    json_object_set_new(j, "memory", json_pack("{s:I,s:I,s:I,s:I}", "budget", (json_int_t)w->mem_budget,
                                               "planned", (json_int_t)w->mem_planned, "used", (json_int_t)w->mem_used,
                                               "peak", (json_int_t)w->mem_peak));
    json_object_set_new(j, "heap_allocations", json_integer((json_int_t)w->alloc_count));
    json_object_set_new(j, "draining", json_boolean(w->draining));
    json_object_set_new(j, "progress", json_integer((json_int_t)w->progress));
    json_object_set_new(j, "busy", json_boolean(w->busy));
    json_object_set_new(j, "stuck", json_boolean(w->stuck));
    switch (w->role) {
    case PRISM__ROLE__ROLE_ENCODER:
        json_object_set_new(j, "cache", json_pack("{s:I,s:I}", "hits", (json_int_t)w->cache_hits,
                                                  "misses", (json_int_t)w->cache_misses));
        break;
    case PRISM__ROLE__ROLE_PREFILL:
        json_object_set_new(j, "pool_free", json_integer(w->pool_free));
        json_object_set_new(j, "kv_blocks", json_integer(w->kv_blocks));
        /* prompt tokens looked up in its prefix cache, and found there */
        json_object_set_new(j, "prefix_cache", json_pack("{s:I,s:I}", "queries", (json_int_t)w->prefix_queries,
                                                         "hits", (json_int_t)w->prefix_hits));
        break;
    case PRISM__ROLE__ROLE_DECODE:
        json_object_set_new(j, "kv_blocks", json_integer(w->kv_blocks));
        json_object_set_new(j, "kv_free_blocks", json_integer(w->kv_free_blocks));
        /* the router's view for its pick (router_kv_room): blocks what it sent there is expected to
         * hold at its end, and prompt blocks sent since the last heartbeat */
        json_object_set_new(j, "kv_expected_blocks", json_integer((json_int_t)w->kv_expect));
        json_object_set_new(j, "kv_sent_blocks", json_integer((json_int_t)w->kv_sent));
        json_object_set_new(j, "kv_waits", json_integer((json_int_t)w->kv_waits));
        json_object_set_new(j, "preemptions", json_integer((json_int_t)w->preemptions));
        json_object_set_new(j, "swaps", json_integer((json_int_t)w->swaps));
        json_object_set_new(j, "kv_swap_bytes", json_integer((json_int_t)w->kv_swap_bytes));
        break;
    default:
        break;
    }
    return j;
}

/* Images by URL: the fetcher's downloads, cache and refusals by reason, and the time requests spent
 * waiting for their images (a stage of its own, between preparation and dispatch). */
static json_t *fetch_json(const router_t *r)
{
    json_t *f = json_object();
    json_object_set_new(f, "stage", hist_json(&r->fetch_stage));
    if (!r->fetch) return f;
    const prism_fetch_metrics_t *m = prism_fetch_metrics(r->fetch);
    json_t *refused = json_object();
    uint64_t total = 0;
    for (int i = 1; i < PRISM_FETCH_REASON_COUNT; i++) {
        if (m->refused[i]) json_object_set_new(refused, prism_fetch_reason_names[i], json_integer((json_int_t)m->refused[i]));
        total += m->refused[i];
    }
    json_object_set_new(f, "requests", json_integer((json_int_t)m->requests));
    json_object_set_new(f, "downloads", json_integer((json_int_t)m->downloads));
    json_object_set_new(f, "downloads_ok", json_integer((json_int_t)m->downloads_ok));
    json_object_set_new(f, "cache_hits", json_integer((json_int_t)m->cache_hits));
    json_object_set_new(f, "joined", json_integer((json_int_t)m->joined));
    json_object_set_new(f, "bytes", json_integer((json_int_t)m->bytes));
    json_object_set_new(f, "in_flight", json_integer((json_int_t)m->inflight));
    json_object_set_new(f, "queued", json_integer((json_int_t)m->queued));
    json_object_set_new(f, "held_bytes", json_integer((json_int_t)m->held_bytes));
    json_object_set_new(f, "refused_total", json_integer((json_int_t)total));
    json_object_set_new(f, "refused", refused);
    json_object_set_new(f, "download", hist_json(&m->seconds));
    return f;
}

void router_handle_status(router_t *r, prism_http_req_t *h)
{
    const prism_router_metrics_t *m = &r->metrics;
    double now = prism_now_s();
    uint64_t refused[PRISM_REFUSE_COUNT];
    router_refusals(r, refused);
    json_t *ref = json_object();
    for (int i = 0; i < PRISM_REFUSE_COUNT; i++)
        json_object_set_new(ref, prism_refusal_names[i], json_integer((json_int_t)refused[i]));
    uint64_t total_refused = 0;
    for (int i = 0; i < PRISM_REFUSE_COUNT; i++) total_refused += refused[i];
    json_t *workers = json_array();
    for (int i = 0; i < ROUTER_MAX_WORKERS; i++)
        if (r->workers[i].used) json_array_append_new(workers, worker_json(&r->workers[i], now));
    json_t *j = json_pack(
        "{s:s,s:s,s:s,s:f,s:f,s:b,s:{s:I,s:I,s:I,s:I,s:I},s:I,s:I,s:I,s:I,s:I,s:o,s:o,s:o,s:o,s:o}",
        "router_id", r->router_id, "model", r->served_model_name, "version", PRISM_VERSION,
        "now_s", now, "uptime_s", now - r->started_s, "ready", router_ready(r, r->cfg.has_vision),
        "finished", "stop", (json_int_t)m->success_stop, "length", (json_int_t)m->success_length,
        "abort", (json_int_t)m->success_abort, "failed", (json_int_t)m->failed, "refused", (json_int_t)total_refused,
        "requests_in_flight", (json_int_t)r->n_reqs, "requests_queued", (json_int_t)r->queue_len,
        "image_bytes_in_flight", (json_int_t)r->image_bytes_inflight,
        "prompt_tokens", (json_int_t)m->prompt_tokens, "generation_tokens", (json_int_t)m->generation_tokens,
        "refusals", ref, "ttft", hist_json(&m->ttft), "e2e", hist_json(&m->e2e), "itl", hist_json(&m->itl),
        "workers", workers);
    if (!j) {
        prism_http_respond_error(h, 500, "InternalServerError", "could not build the status", NULL, NULL, NULL);
        return;
    }
    json_object_set_new(j, "router_memory_bytes", json_integer((json_int_t)prism_mem_used()));
    json_object_set_new(j, "image_fetch", fetch_json(r));
    /* where finished requests' time went, by stage, in order (prism:request_stage_seconds) */
    json_t *stages = json_array();
    for (int i = 0; i < ROUTER_TS_COUNT; i++) {
        json_t *st = hist_json(&r->stage[i]);
        json_object_set_new(st, "stage", json_string(router_time_stage_names[i]));
        json_array_append_new(stages, st);
    }
    json_object_set_new(j, "stages", stages);
    char *s = json_dumps(j, JSON_COMPACT | JSON_REAL_PRECISION(10));
    json_decref(j);
    if (!s) {
        prism_http_respond_error(h, 500, "InternalServerError", "could not serialise the status", NULL, NULL, NULL);
        return;
    }
    /* Never cached: every poll must see the router's state now. */
    prism_http_respond(h, 200, "application/json", "Cache-Control: no-store\r\n", s, strlen(s));
    prism_free(s);  /* jansson allocates through prism_malloc (set in main) */
}

void router_handle_status_page(router_t *r, prism_http_req_t *h)
{
    (void)r;
    /* The page runs no code from elsewhere: a strict policy lets the browser enforce that. */
    prism_http_respond(h, 200, "text/html; charset=utf-8",
                       "Cache-Control: no-cache\r\n"
                       "Content-Security-Policy: default-src 'none'; script-src 'unsafe-inline'; "
                       "style-src 'unsafe-inline'; connect-src 'self'; img-src data:; base-uri 'none'; "
                       "form-action 'none'; frame-ancestors 'none'\r\n"
                       "X-Content-Type-Options: nosniff\r\n",
                       (const char *)prism_status_page, prism_status_page_len);
}
