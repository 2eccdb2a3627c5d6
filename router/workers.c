/* Worker registry: who is registered, their capacity and last reported load, and the choice of
 * a worker for a request. A leaf: no sockets, no request life; control.c feeds it and acts on
 * its answers. */
#include "router.h"

#include <stdio.h>
#include <string.h>

router_worker_t *router_worker_by_id(router_t *r, const char *id)
{
    for (int i = 0; i < ROUTER_MAX_WORKERS; i++)
        if (r->workers[i].used && !strcmp(r->workers[i].id, id)) return &r->workers[i];
    return NULL;
}

int router_worker_register(router_t *r, const char *id, const Prism__Register *g, char *why, size_t why_len)
{
    if (!g || !g->worker_id || strcmp(g->worker_id, id) != 0) {
        snprintf(why, why_len, "registration: worker_id must equal the socket identity");
        return PRISM_EINVAL;
    }
    if (g->role == PRISM__ROLE__ROLE_UNKNOWN || g->role > PRISM__ROLE__ROLE_DECODE) {
        snprintf(why, why_len, "registration: unknown role");
        return PRISM_EINVAL;
    }
    if (g->role != PRISM__ROLE__ROLE_ENCODER && (!g->data_endpoint || !*g->data_endpoint)) {
        snprintf(why, why_len, "registration: a data endpoint is required");
        return PRISM_EINVAL;
    }
    if (g->role != PRISM__ROLE__ROLE_ENCODER && g->max_model_len && (int)g->max_model_len < r->max_model_len) {
        snprintf(why, why_len, "registration: worker context length %u is below the router's %d",
                 g->max_model_len, r->max_model_len);
        return PRISM_EINVAL;
    }
    router_worker_t *w = router_worker_by_id(r, id);
    if (!w) {
        for (int i = 0; i < ROUTER_MAX_WORKERS && !w; i++)
            if (!r->workers[i].used) w = &r->workers[i];
        if (!w) {
            snprintf(why, why_len, "router worker table is full");
            return PRISM_ELIMIT;
        }
        memset(w, 0, sizeof(*w));
        PRISM_INFO("%s worker %s registered (data %s)", prism_role_name(g->role), id,
                   g->data_endpoint && *g->data_endpoint ? g->data_endpoint : "-");
    }
    w->used = true;
    w->role = g->role;
    snprintf(w->id, sizeof(w->id), "%s", id);
    snprintf(w->data_endpoint, sizeof(w->data_endpoint), "%s", g->data_endpoint ? g->data_endpoint : "");
    w->kv_blocks = g->kv_blocks;
    w->kv_free_blocks = g->kv_blocks;
    w->block_size = g->block_size;
    w->max_batch_tokens = g->max_batch_tokens;
    w->max_running = g->max_running;
    w->max_queued_bytes = g->max_queued_bytes;
    w->max_model_len = g->max_model_len;
    w->mem_budget = g->mem_budget;
    w->mem_planned = g->mem_planned;
    w->last_seen = prism_now_s();
    r->queue_dirty = true;  /* a worker (back) with room: requests waiting for its tier may go */
    return PRISM_OK;
}

bool router_worker_heartbeat(router_t *r, const char *id, const Prism__Heartbeat *hb)
{
    router_worker_t *w = router_worker_by_id(r, id);
    if (!w) return false;
    if (!hb) return true;
    w->running = hb->running;
    w->waiting = hb->waiting;
    w->kv_free_blocks = hb->kv_free_blocks;
    w->pool_free = hb->pool_free;
    w->mem_used = hb->mem_used;
    w->mem_peak = hb->mem_peak;
    w->mem_planned = hb->mem_planned;
    w->cache_hits = hb->cache_hits;
    w->cache_misses = hb->cache_misses;
    w->alloc_count = hb->alloc_count;
    w->heartbeats++;
    w->peer_auth_failures = hb->peer_auth_failures;
    w->last_seen = prism_now_s();
    return true;
}

void router_worker_drop(router_worker_t *w)
{
    w->used = false;
}

void router_worker_note_image(router_worker_t *w, uint64_t hash)
{
    w->image_hashes[w->n_hashes % (int)PRISM_ARRAY_LEN(w->image_hashes)] = hash;
    if (w->n_hashes < (int)PRISM_ARRAY_LEN(w->image_hashes)) w->n_hashes++;
}

static double load_of(const router_worker_t *w)
{
    switch (w->role) {
    case PRISM__ROLE__ROLE_DECODE:
        /* Most free KV wins; our own in-flight count covers heartbeats not yet seen. */
        return (double)w->inflight - (w->kv_blocks ? (double)w->kv_free_blocks / w->kv_blocks : 0);
    default:
        return (double)w->inflight;
    }
}

router_worker_t *router_pick(router_t *r, Prism__Role role, uint64_t prefer_hash, uint64_t bytes, bool *any)
{
    router_worker_t *best = NULL;
    *any = false;
    for (int i = 0; i < ROUTER_MAX_WORKERS; i++) {
        router_worker_t *w = &r->workers[i];
        if (!w->used || w->role != role) continue;
        *any = true;
        if (w->inflight >= (int)PRISM_MAX(w->max_running, 1u)) continue;  /* full: the request waits here */
        /* An encoder's queue holds image files, which can be 50 MB each: bounded in bytes too, so its
         * memory stays at its plan however many requests wait (they wait here). One image of any
         * size is always let in, else an image larger than the bound would never be served. */
        if (w->max_queued_bytes && w->queued_bytes && w->queued_bytes + bytes > w->max_queued_bytes) continue;
        if (prefer_hash) {
            for (int k = 0; k < w->n_hashes; k++)
                if (w->image_hashes[k] == prefer_hash) return w;  /* its embedding cache probably has it */
        }
        if (!best || load_of(w) < load_of(best)) best = w;
    }
    return best;
}

bool router_ready(const router_t *r, bool need_encoder)
{
    return router_count_workers(r, PRISM__ROLE__ROLE_PREFILL) > 0 &&
           router_count_workers(r, PRISM__ROLE__ROLE_DECODE) > 0 &&
           (!need_encoder || router_count_workers(r, PRISM__ROLE__ROLE_ENCODER) > 0);
}

int router_count_workers(const router_t *r, Prism__Role role)
{
    int n = 0;
    for (int i = 0; i < ROUTER_MAX_WORKERS; i++)
        n += r->workers[i].used && r->workers[i].role == role;
    return n;
}
