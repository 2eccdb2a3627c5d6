/* Worker registry: who is registered, their capacity and last reported load, the choice of a worker
 * for a request, and the images requests let go unanswered (whose encoders' answers are still timed).
 * A leaf: no sockets, no request life; control.c feeds it and acts on its answers. */
#include "router.h"

#include <stdio.h>
#include <string.h>

router_worker_t *router_worker_by_id(router_t *r, const char *id)
{
    for (int i = 0; i < ROUTER_MAX_WORKERS; i++)
        if (r->workers[i].used && !strcmp(r->workers[i].id, id)) return &r->workers[i];
    return NULL;
}

int router_worker_register(router_t *r, const char *id, const char *peer_key, const Prism__Register *g, char *why,
                           size_t why_len)
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
    /* Handed to other workers, who connect to it: never cut short (another endpoint), tcp only. */
    if (g->data_endpoint && *g->data_endpoint &&
        (strlen(g->data_endpoint) >= sizeof(((router_worker_t *)0)->data_endpoint) ||
         strncmp(g->data_endpoint, "tcp://", 6) != 0)) {
        snprintf(why, why_len, "registration: the data endpoint must be tcp://HOST:PORT, under %zu bytes",
                 sizeof(((router_worker_t *)0)->data_endpoint));
        return PRISM_EINVAL;
    }
    if (g->max_running > 1000000 || g->kv_blocks > (1u << 30) || g->block_size > 65536) {
        snprintf(why, why_len, "registration: capacity out of range");
        return PRISM_EINVAL;
    }
    if (g->role != PRISM__ROLE__ROLE_ENCODER && g->max_model_len && (int)g->max_model_len < r->max_model_len) {
        snprintf(why, why_len, "registration: worker context length %u is below the router's %d",
                 g->max_model_len, r->max_model_len);
        return PRISM_EINVAL;
    }
    router_worker_t *w = router_worker_by_id(r, id);
    /* Another process under a registered id: the caller fails and drops the old record first. */
    PRISM_ASSERT(!w || router_worker_same_process(w, peer_key, g));
    if (!w) {
        for (int i = 0; i < ROUTER_MAX_WORKERS && !w; i++)
            if (!r->workers[i].used) w = &r->workers[i];
        if (!w) {
            snprintf(why, why_len, "router worker table is full");
            return PRISM_ELIMIT;
        }
        memset(w, 0, sizeof(*w));
        w->registered_at = prism_now_s();
        router_prefix_index_init(&w->prefix, g->role == PRISM__ROLE__ROLE_PREFILL ? g->kv_blocks : 0);
        for (int i = 0; i < ROUTER_WORKER_STAGES; i++)
            prism_hist_init(&w->stage[i], prism_buckets_ttft, prism_buckets_ttft_n);
        PRISM_INFO("%s worker %s registered (data %s)", prism_role_name(g->role), id,
                   g->data_endpoint && *g->data_endpoint ? g->data_endpoint : "-");
    }
    w->used = true;
    w->role = g->role;
    snprintf(w->id, sizeof(w->id), "%s", id);
    snprintf(w->peer_key, sizeof(w->peer_key), "%s", peer_key);
    w->instance = g->instance;
    snprintf(w->data_endpoint, sizeof(w->data_endpoint), "%s", g->data_endpoint ? g->data_endpoint : "");
    w->kv_blocks = g->kv_blocks;
    w->kv_free_blocks = g->kv_blocks;
    w->block_size = g->block_size;
    w->max_batch_tokens = g->max_batch_tokens;
    w->max_running = g->max_running;
    w->max_queued_bytes = g->max_queued_bytes;
    w->cache_units = g->embedding_cache_units;
    w->max_model_len = g->max_model_len;
    w->mem_budget = g->mem_budget;
    w->mem_planned = g->mem_planned;
    w->last_seen = w->last_heartbeat = w->progress_at = prism_now_s();
    r->queue_dirty = true;  /* a worker (back) with room: requests waiting for its tier may go */
    return PRISM_OK;
}

bool router_worker_same_process(const router_worker_t *w, const char *peer_key, const Prism__Register *g)
{
    return w->instance == g->instance && w->role == g->role && !strcmp(w->peer_key, peer_key);
}

bool router_worker_heartbeat(router_t *r, const char *id, const Prism__Heartbeat *hb)
{
    router_worker_t *w = router_worker_by_id(r, id);
    if (!w) return false;
    if (!hb) return true;
    w->running = hb->running;
    w->waiting = hb->waiting;
    w->kv_free_blocks = PRISM_MIN(hb->kv_free_blocks, w->kv_blocks);   /* load_of divides by kv_blocks */
    w->kv_sent = 0;   /* what we sent before it is in kv_free_blocks, or still in kv_expect */
    w->pool_free = hb->pool_free;
    w->mem_used = hb->mem_used;
    w->mem_peak = hb->mem_peak;
    w->mem_planned = hb->mem_planned;
    w->cache_hits = hb->cache_hits;
    w->cache_misses = hb->cache_misses;
    w->kv_waits = hb->kv_waits;
    w->tokens_generated = hb->tokens_generated;
    w->seqs_aborted = hb->seqs_aborted;
    w->prompts_aborted = hb->prompts_aborted;
    w->sends_waited = hb->sends_waited;
    w->preemptions = hb->preempt_recompute;
    w->swaps = hb->preempt_swap;
    w->kv_swap_bytes = hb->kv_swap_bytes;
    w->migrations_out = hb->preempt_migrate;
    /* the router's totals grow by what each heartbeat adds: they stay monotonic when a worker goes
     * (a counter that went back is a restarted worker counting from 0) */
    r->metrics.prefix_queries += hb->prefix_cache_queries - (hb->prefix_cache_queries >= w->prefix_queries ? w->prefix_queries : 0);
    r->metrics.prefix_hits += hb->prefix_cache_hits - (hb->prefix_cache_hits >= w->prefix_hits ? w->prefix_hits : 0);
    r->metrics.prefill_computed +=
        hb->prompt_tokens_computed - (hb->prompt_tokens_computed >= w->prefill_computed ? w->prefill_computed : 0);
    w->prefix_queries = hb->prefix_cache_queries;
    w->prefix_hits = hb->prefix_cache_hits;
    w->prefill_computed = hb->prompt_tokens_computed;
    w->image_decodes_peak = hb->image_decodes_peak;
    w->prefill_forwards = hb->prefill_forwards;
    w->prefill_forward_prompts = hb->prefill_forward_prompts;
    w->prefill_batch_peak = hb->prefill_batch_peak;
    w->prefill_pool_breaks = hb->prefill_pool_breaks;
    w->kv_sent_bytes = hb->kv_sent_bytes;
    w->alloc_count = hb->alloc_count;
    w->heartbeats++;
    w->peer_auth_failures = hb->peer_auth_failures;
    double now = prism_now_s();
    if (w->role > 0 && w->role < (int)PRISM_ARRAY_LEN(r->heartbeat_interval))
        prism_hist_observe(&r->heartbeat_interval[w->role], now - w->last_heartbeat);
    PRISM_DEBUG("heartbeat from %s worker %s after %.4fs (progress %llu%s%s)", prism_role_name(w->role), id,
                now - w->last_heartbeat, (unsigned long long)hb->progress, hb->busy ? ", busy" : "",
                hb->draining ? ", draining" : "");
    w->last_seen = w->last_heartbeat = now;
    /* Not busy (it came back for more work) or moved on: not stuck, whatever the time. */
    if (!hb->busy || hb->progress != w->progress) w->progress_at = now;
    w->progress = hb->progress;
    w->busy = hb->busy;
    if (hb->draining && !w->draining)
        PRISM_INFO("%s worker %s is draining (%d requests of ours on it): no new work goes to it",
                   prism_role_name(w->role), w->id, w->inflight);
    w->draining = w->draining || hb->draining;
    return true;
}

void router_worker_drop(router_worker_t *w)
{
    router_prefix_index_free(&w->prefix);
    w->used = false;
}

const router_time_stage_t *router_worker_stages(int role, int *n)
{
    static const router_time_stage_t enc[] = {ROUTER_TS_ENCODER_QUEUE, ROUTER_TS_IMAGE_DECODE, ROUTER_TS_VIT};
    static const router_time_stage_t pre[] = {ROUTER_TS_PREFILL_QUEUE, ROUTER_TS_PREFILL};
    static const router_time_stage_t dec[] = {ROUTER_TS_DECODE_QUEUE, ROUTER_TS_DECODE_FIRST_STEP, ROUTER_TS_DECODE};
    _Static_assert(PRISM_ARRAY_LEN(dec) <= ROUTER_WORKER_STAGES, "a histogram per stage");
    switch (role) {
    case PRISM__ROLE__ROLE_ENCODER: *n = (int)PRISM_ARRAY_LEN(enc); return enc;
    case PRISM__ROLE__ROLE_PREFILL: *n = (int)PRISM_ARRAY_LEN(pre); return pre;
    case PRISM__ROLE__ROLE_DECODE: *n = (int)PRISM_ARRAY_LEN(dec); return dec;
    default: *n = 0; return NULL;
    }
}

void router_worker_observe(router_t *r, const char *id, const double *st)
{
    router_worker_t *w = *id ? router_worker_by_id(r, id) : NULL;
    if (!w) return;
    int n;
    const router_time_stage_t *s = router_worker_stages(w->role, &n);
    for (int i = 0; i < n; i++) {
        double v = st[s[i]];   /* a worker's own measure (EncodeDone): never NaN, negative or absurd here */
        prism_hist_observe(&w->stage[i], v >= 0 && v < 1e6 ? v : 0);
    }
}

void router_worker_note_image(router_worker_t *w, uint64_t hash)
{
    w->image_hashes[w->n_hashes % (int)PRISM_ARRAY_LEN(w->image_hashes)] = hash;
    if (w->n_hashes < (int)PRISM_ARRAY_LEN(w->image_hashes)) w->n_hashes++;
}

void router_worker_note_let_go(router_t *r, const router_worker_t *w, uint64_t rid, uint64_t rid_hi, uint32_t image)
{
    r->enc_late[r->enc_late_next++ % ROUTER_MAX_ENC_LATE] = (router_enc_late_t){
        .rid = rid, .rid_hi = rid_hi, .instance = w->instance, .image = image, .worker = (uint16_t)(w - r->workers)};
}

bool router_worker_take_let_go(router_t *r, const router_worker_t *from, uint64_t rid, uint64_t rid_hi, uint32_t image)
{
    for (int k = 0; rid && k < ROUTER_MAX_ENC_LATE; k++) {
        router_enc_late_t *e = &r->enc_late[k];
        if (e->rid != rid || e->rid_hi != rid_hi || e->image != image) continue;
        if (from != &r->workers[e->worker] || from->instance != e->instance) return false;
        e->rid = 0;   /* once */
        return true;
    }
    return false;
}

/* A worker as a pick sees it: what the registry counts plus what the plan being made puts on it
 * without having counted it yet (its request's other images). */
typedef struct {
    int inflight;
    uint64_t queued_bytes;
} seen_t;

static seen_t seen(const router_worker_t *w, const router_want_t *want)
{
    seen_t s = {w->inflight, w->queued_bytes};
    for (int i = 0; i < want->n_planned; i++)
        if (want->planned[i].w == w) {
            s.inflight += want->planned[i].slots;
            s.queued_bytes += want->planned[i].bytes;
        }
    return s;
}

uint64_t router_kv_blocks(const router_worker_t *w, uint64_t prompt, uint64_t more, int n)
{
    uint64_t bs = PRISM_MAX(w->block_size, 1u), seqs = (uint64_t)PRISM_MAX(n, 1);
    uint64_t total = PRISM_MIN(prompt + more, (uint64_t)PRISM_MAX(w->max_model_len, 1u));
    uint64_t per = (total + bs - 1) / bs, shared = seqs > 1 ? PRISM_MIN(prompt, total) / bs : 0;
    return shared + seqs * (per - shared);
}

int64_t router_kv_room(const router_worker_t *w, const router_want_t *want)
{
    /* heartbeats are periodic: what we sent since the last one is not in its kv_free_blocks yet */
    int64_t used = (int64_t)w->kv_blocks - (int64_t)w->kv_free_blocks + (int64_t)w->kv_sent;
    int64_t expect = (int64_t)w->kv_expect;
    int64_t need = want->kv_prompt ? (int64_t)router_kv_blocks(w, want->kv_prompt, want->kv_more, want->slots) : 0;
    return (int64_t)w->kv_blocks - PRISM_MAX(used, expect) - need;
}

static double load_of(const router_worker_t *w, seen_t s, const router_want_t *want)
{
    switch (w->role) {
    case PRISM__ROLE__ROLE_DECODE: {
        /* Most KV room after the request and the expected growth of what runs there wins (its share
         * of the pool), then the fewest sequences for its batch; a worker where the request would not
         * fit as expected (it would preempt) only when none has room. */
        int64_t room = router_kv_room(w, want);
        double full = (double)s.inflight / PRISM_MAX(w->max_running, 1u);
        return full - (double)room / PRISM_MAX(w->kv_blocks, 1u) + (room < 0 ? 2.0 : 0.0);
    }
    default:
        return (double)s.inflight;
    }
}

static bool avoided(const router_worker_t *w, const router_want_t *want)
{
    for (int i = 0; i < want->n_avoid; i++)
        if (!strcmp(want->avoid[i], w->id)) return true;
    return false;
}

/* Room for `slots` more sequences and `bytes` more queued image bytes, and reachable: a worker whose
 * last send failed (it exited: its connection is gone) would fail every request sent to it until
 * --worker-timeout drops it — and, as each fails at once, look idle and attract them all. The
 * request waits in the router instead. An encoder's queue holds image files, which can be 50 MB
 * each: bounded in bytes too, so its memory stays at its plan however many requests wait (they wait
 * here). One image of any size is always let in, else an image larger than the bound would never
 * be served. Workers the request asks to avoid look full. */
static bool pickable(const router_worker_t *w, seen_t s, const router_want_t *want, bool avoid)
{
    if (avoid && avoided(w, want)) return false;
    if (w->max_queued_bytes && s.queued_bytes && s.queued_bytes + want->bytes > w->max_queued_bytes) return false;
    return s.inflight + want->slots <= (int)PRISM_MAX(w->max_running, 1u) && !(w->send_failed_at > w->last_seen) &&
           !w->draining;
}

static bool candidate(const router_worker_t *w, const router_want_t *want)
{
    return w->used && w->role == want->role && !w->stuck;
}

int router_worker_prefix_hit(const router_worker_t *w, const prism_kv_key_t *keys, int n, uint32_t block_size)
{
    if (n <= 0 || w->block_size != block_size) return 0;
    return router_prefix_index_match(&w->prefix, keys, n);
}

static int prefix_hit(const router_worker_t *w, const router_want_t *want)
{
    return router_worker_prefix_hit(w, want->prefix_keys, want->n_prefix_keys, want->prefix_block_size);
}

static router_worker_t *pick_pass(router_t *r, const router_want_t *want, bool avoid, bool *any)
{
    router_worker_t *best = NULL, *warm = NULL;
    double best_load = 0;
    int n_ties = 0, warm_hit = 0;
    *any = false;
    for (int i = 0; i < ROUTER_MAX_WORKERS; i++) {
        router_worker_t *w = &r->workers[i];
        if (!candidate(w, want)) continue;
        *any = true;
        seen_t s = seen(w, want);
        if (!pickable(w, s, want, avoid)) continue;  /* full (the request waits here), unreachable or draining */
        for (int k = 0; want->prefer_hash && !warm && k < w->n_hashes; k++)
            if (w->image_hashes[k] == want->prefer_hash) warm = w;  /* its embedding cache probably has it */
        int hit = prefix_hit(w, want);   /* the longest cached prefix; among equals, the less loaded */
        if (hit > warm_hit || (hit && hit == warm_hit && load_of(w, s, want) < load_of(warm, seen(warm, want), want))) {
            warm = w;
            warm_hit = hit;
        }
        double l = load_of(w, s, want);
        if (!best || l < best_load) {
            best = w;
            best_load = l;
            n_ties = 1;
        } else if (l == best_load) {
            n_ties++;
        }
    }
    /* Affinity, within reason: a cache hit saves the image's decode and encode, but not the wait
     * behind the warm worker's queue. Without the bound, once every image of a repeating load had
     * been seen, workers added later never got a single request. */
    if (warm && load_of(warm, seen(warm, want), want) <= best_load + ROUTER_AFFINITY_SLACK) return warm;
    if (n_ties < 2) return best;
    /* Several equally loaded workers: the turn-th of them (in table order), a new turn each time.
     * Always taking the first sent every request of a light load to one worker. */
    uint32_t *turn = &r->pick_turn[(unsigned)want->role % PRISM_ARRAY_LEN(r->pick_turn)];
    int k = (int)((*turn)++ % (uint32_t)n_ties);
    for (int i = 0; i < ROUTER_MAX_WORKERS; i++) {
        router_worker_t *w = &r->workers[i];
        if (!candidate(w, want)) continue;
        seen_t s = seen(w, want);
        if (pickable(w, s, want, avoid) && load_of(w, s, want) == best_load && k-- == 0) return w;
    }
    PRISM_ASSERT(!"a tied worker vanished between two scans");
    return best;
}

router_worker_t *router_pick_want(router_t *r, const router_want_t *want, bool *any)
{
    router_worker_t *w = pick_pass(r, want, true, any);
    /* only the avoided ones have room: them rather than nothing */
    return w || !want->n_avoid ? w : pick_pass(r, want, false, any);
}

router_worker_t *router_pick_kv_target(router_t *r, const router_worker_t *from, uint64_t blocks)
{
    router_want_t want = {.role = PRISM__ROLE__ROLE_DECODE, .slots = 1};
    router_worker_t *best = NULL;
    for (int i = 0; i < ROUTER_MAX_WORKERS; i++) {
        router_worker_t *w = &r->workers[i];
        if (w == from || !candidate(w, &want) || !pickable(w, seen(w, &want), &want, false) ||
            w->block_size != from->block_size)   /* the transfer's layout is the source's */
            continue;
        if ((uint64_t)w->kv_free_blocks < blocks + w->kv_blocks / 50) continue;
        if (!best || w->kv_free_blocks > best->kv_free_blocks) best = w;
    }
    return best;
}

router_worker_t *router_pick(router_t *r, Prism__Role role, uint64_t prefer_hash, bool *any)
{
    return router_pick_slots(r, role, prefer_hash, 1, 0, any);
}

router_worker_t *router_pick_slots(router_t *r, Prism__Role role, uint64_t prefer_hash, int slots, uint64_t bytes,
                                   bool *any)
{
    router_want_t want = {.role = role, .prefer_hash = prefer_hash, .slots = slots, .bytes = bytes};
    return router_pick_want(r, &want, any);
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
        n += r->workers[i].used && r->workers[i].role == role && !r->workers[i].stuck;
    return n;
}
