/* Early encode: an image whose bytes are whole goes to an encoder while the rest of its request's
 * body is still arriving (or, for images given by URL, while its request's other images still
 * download: url_images.c).
 *
 * The request does not exist yet (its JSON is parsed once the body is whole), so the image is sent
 * as a cache-only job: an Encode without a prefill endpoint, under an id of its own. The encoder
 * decodes and encodes it into its embedding cache and answers EncodeDone to us. When the request is
 * dispatched while the early job is still held, its image's Encode goes to the same encoder naming
 * the early job (Encode.early_id): the encoder adopts the job (its slot, its work so far, from then
 * on the request's id and prefill endpoint), and the router moves the job's slot and bytes to the
 * request. Once the early job is done (its entry is kept a while, its slot freed), the request's
 * image goes as always and is answered from the cache (the affinity to recent images, router_pick);
 * its Encode still names the early job, so the encoder does not count finding that result as a
 * cache hit (the early job counted the image). The router sends the image bytes either way:
 * nothing depends on the early job, and one that fails, times out or was evicted from the cache
 * costs only its work. A request that ends while its image's adoption may still be on its way aborts
 * both ids (sched.c router_sched_abort).
 *
 * Early jobs take encoder slots and queued bytes as requests do, only when no request waits in the
 * router's queue and an encoder with a cache has room (they never overtake a request), only for the
 * first --limit-mm-per-prompt images of a body, at most ROUTER_MAX_EARLY and --max-early-encode-bytes
 * of image bytes at once (their copies are the memory plan's "early encodes"); one the encoder
 * has not answered within --stage-timeout is aborted and forgotten.
 *
 * Work for a body that may never become a request is kept small (issue 26 finding 5: abandoned
 * bodies cost an encode per image and held a real request 28 s behind them): one connection holds
 * at most ROUTER_EARLY_PER_CONN unanswered early jobs (its further images wait for their request);
 * a body that never reaches its handler (the client left, the body was refused or timed out:
 * http_server's body_gone) or a request that ends (admitted and done, or refused) aborts the early
 * jobs of its body still running; and admitted requests come first: a request that finds no
 * encoder with room takes the slot of a running early job (router_early_preempt, the youngest
 * first), and encoders run a request's image before any early job (encoder_worker run_batch). One
 * loop thread. */
#include "router.h"

#include <string.h>
#include <xxhash.h>

/* Finds the encoder an early job went to, if it is still the same process. */
static router_worker_t *early_worker(router_t *r, const router_early_t *e)
{
    router_worker_t *w = router_worker_by_id(r, e->encoder_id);
    return w && w->instance == e->instance ? w : NULL;
}

/* The job's encoder slot and bytes go back (it is done, failed or let go). */
static void early_release(router_t *r, router_early_t *e)
{
    router_worker_t *w = early_worker(r, e);
    if (w) {
        w->inflight = PRISM_MAX(w->inflight - 1, 0);
        w->queued_bytes -= PRISM_MIN(w->queued_bytes, e->bytes);
    }
    e->done = true;
    r->queue_dirty = true;   /* a slot freed: a queued request may go */
}

/* Image bytes of the jobs not answered yet: each went to ZeroMQ as a copy of the body's bytes (the
 * request's own Encode shares its bytes; these cannot, the body still owns them), so they are a
 * row of the memory plan of their own (--max-early-encode-bytes). */
static size_t early_held(const router_t *r)
{
    size_t n = 0;
    for (int i = 0; i < ROUTER_MAX_EARLY; i++)
        if (r->early[i].rid && !r->early[i].done) n += r->early[i].bytes;
    return n;
}

/* The job's encoder drops it (best effort), and its slot and bytes come back at once. */
static void early_abort(router_t *r, router_early_t *e)
{
    router_worker_t *w = early_worker(r, e);
    if (w) router_send_abort(r, w, e->rid);
    early_release(r, e);
    e->rid = 0;
}

/* How long a done job is remembered for its request (a body that ends later pays a counted hit). */
static double keep_done_s(const router_t *r) { return r->stage_timeout_s > 0 ? r->stage_timeout_s : 60; }

void router_early_encode(const prism_http_req_t *h, int index, const uint8_t *data, size_t len, void *ud)
{
    if (strcmp(prism_http_req_method(h), "POST") || strcmp(prism_http_req_path(h), "/v1/chat/completions")) return;
    router_early_send(ud, h, index, data, len);
}

void router_early_body_gone(const prism_http_req_t *h, void *ud)
{
    router_early_forget(ud, prism_http_req_id(h));
}

void router_early_send(router_t *r, const prism_http_req_t *h, int index, const uint8_t *data, size_t len)
{
    if (!r->early_encode || !data || !len || r->queue_len || r->draining || index >= r->max_images_per_prompt) return;
    uint64_t conn = prism_http_req_conn_id(h);
    router_early_t *e = NULL;   /* a free entry, else the oldest done one */
    int running = 0;            /* this connection's unanswered jobs */
    for (int i = 0; i < ROUTER_MAX_EARLY; i++) {
        router_early_t *x = &r->early[i];
        if (x->rid && !x->done && x->conn == conn) running++;
        if (!x->rid && (!e || e->rid)) e = x;
        else if (x->rid && x->done && (!e || (e->rid && x->t_sent < e->t_sent))) e = x;
    }
    if (!e || running >= ROUTER_EARLY_PER_CONN || early_held(r) + len > r->max_early_bytes) return;
    uint64_t hash = XXH3_64bits_withSecret(data, len, r->img_secret, sizeof(r->img_secret));
    bool any;
    router_worker_t *w = router_pick_slots(r, PRISM__ROLE__ROLE_ENCODER, hash, 1, len, &any);
    if (!w || !w->cache_units) return;   /* an early job is only worth a cache entry */
    for (int k = 0; k < w->n_hashes; k++)
        if (w->image_hashes[k] == hash) return;   /* sent there lately: its cache probably has it */
    /* a prefill's prefix cache covered it lately (sched.c: the request skipped its encoder): its next
     * turn will likely skip it too */
    for (int i = 0; i < ROUTER_MAX_WORKERS; i++) {
        const router_worker_t *p = &r->workers[i];
        if (!p->used || p->role != PRISM__ROLE__ROLE_PREFILL) continue;
        for (int k = 0; k < p->n_hashes; k++)
            if (p->image_hashes[k] == hash) return;
    }
    uint64_t rid, rid_hi;
    if (router_req_new_id(r, &rid, &rid_hi) != PRISM_OK) return;
    Prism__Encode en = PRISM__ENCODE__INIT;
    en.content_hash = hash;
    en.prefill_endpoint = "";   /* cache only */
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_ENCODE;
    env.request_id = rid;
    env.request_id_hi = rid_hi;
    env.encode = &en;
    prism_trace_id_t trace;   /* its body's: the encoder's lines about the job show the request's trace */
    uint8_t flags;
    router_trace_of(r, h, &trace, &flags);
    env.trace_id_hi = trace.hi;
    env.trace_id_lo = trace.lo;
    prism_frame_t f = {data, len};
    if (router_send(r, w, &env, &f, 1) != PRISM_OK) return;
    *e = (router_early_t){.rid = rid, .rid_hi = rid_hi, .instance = w->instance, .hash = hash, .bytes = len,
                          .t_sent = prism_now_s(), .body = prism_http_req_id(h), .conn = conn};
    snprintf(e->encoder_id, sizeof e->encoder_id, "%s", w->id);
    w->inflight++;
    w->queued_bytes += len;
    router_worker_note_image(w, hash);
    r->metrics.early_encodes++;
    prism_log_ctx_t lc = {rid, trace};
    const prism_log_ctx_t *prev = prism_log_ctx_enter(&lc);
    PRISM_DEBUG("early encode %016llx: %zu bytes to %s", (unsigned long long)rid, len, w->id);
    prism_log_ctx_leave(prev);
}

bool router_early_encode_done(router_t *r, const router_worker_t *from, uint64_t rid, uint64_t rid_hi,
                              const Prism__EncodeDone *d)
{
    for (int i = 0; i < ROUTER_MAX_EARLY; i++) {
        router_early_t *e = &r->early[i];
        if (e->rid != rid || !rid || e->done) continue;
        /* only from the encoder it went to, naming the whole id */
        if (rid_hi != e->rid_hi || from->role != PRISM__ROLE__ROLE_ENCODER || strcmp(e->encoder_id, from->id) || from->instance != e->instance)
            return false;
        early_release(r, e);
        e->t_sent = prism_now_s();   /* done now: kept keep_done_s from here */
        if (d->error && *d->error) {   /* nothing was cached: forgotten */
            r->metrics.early_encodes_failed++;
            PRISM_DEBUG("early encode %016llx on %s: %s", (unsigned long long)rid, from->id, d->error);
            e->rid = 0;
        }
        return true;
    }
    return true;
}

router_worker_t *router_early_claim(router_t *r, uint64_t hash, const uint64_t *taken, int n_taken, uint64_t *early_id)
{
    *early_id = 0;
    for (int i = 0; i < ROUTER_MAX_EARLY; i++) {
        const router_early_t *e = &r->early[i];
        if (!e->rid || e->done || e->hash != hash) continue;
        bool claimed = false;
        for (int k = 0; k < n_taken; k++) claimed |= taken[k] == e->rid;
        router_worker_t *w = claimed ? NULL : early_worker(r, e);
        if (!w || w->stuck) continue;
        *early_id = e->rid;
        return w;
    }
    return NULL;
}

void router_early_adopted(router_t *r, uint64_t early_id)
{
    for (int i = 0; i < ROUTER_MAX_EARLY; i++)
        if (r->early[i].rid == early_id) r->early[i].rid = 0;   /* its slot and bytes are the request's now */
    r->metrics.early_encodes_adopted++;
}

uint64_t router_early_take_done(router_t *r, uint64_t hash, const router_worker_t *w)
{
    for (int i = 0; i < ROUTER_MAX_EARLY; i++) {
        router_early_t *e = &r->early[i];
        if (!e->rid || !e->done || e->hash != hash || early_worker(r, e) != w) continue;
        uint64_t id = e->rid;
        e->rid = 0;
        return id;
    }
    return 0;
}

void router_early_forget(router_t *r, uint64_t body)
{
    for (int i = 0; body && i < ROUTER_MAX_EARLY; i++) {
        router_early_t *e = &r->early[i];
        if (!e->rid || e->done || e->body != body) continue;
        PRISM_DEBUG("early encode %016llx: its body is gone; aborted", (unsigned long long)e->rid);
        r->metrics.early_encodes_abandoned++;
        early_abort(r, e);
    }
}

bool router_early_preempt(router_t *r, const uint64_t *keep, int n_keep)
{
    router_early_t *young = NULL;
    for (int i = 0; i < ROUTER_MAX_EARLY; i++) {
        router_early_t *e = &r->early[i];
        if (!e->rid || e->done || !early_worker(r, e)) continue;
        bool kept = false;   /* an image of the request itself: it takes that job over instead */
        for (int k = 0; k < n_keep; k++) kept |= keep[k] == e->hash;
        if (!kept && (!young || e->t_sent > young->t_sent)) young = e;
    }
    if (!young) return false;
    PRISM_DEBUG("early encode %016llx: its slot goes to a request", (unsigned long long)young->rid);
    r->metrics.early_encodes_preempted++;
    early_abort(r, young);
    return true;
}

void router_early_encode_sweep(router_t *r, double now)
{
    for (int i = 0; i < ROUTER_MAX_EARLY; i++) {
        router_early_t *e = &r->early[i];
        if (!e->rid) continue;
        router_worker_t *w = early_worker(r, e);
        if (e->done) {
            if (!w || now - e->t_sent > keep_done_s(r)) e->rid = 0;
            continue;
        }
        bool late = r->stage_timeout_s > 0 && now - e->t_sent > r->stage_timeout_s;
        if (w && !late && !w->stuck) continue;
        if (w) router_send_abort(r, w, e->rid);   /* it may still hold the job: let it go */
        r->metrics.early_encodes_failed++;
        early_release(r, e);
        e->rid = 0;
    }
}
