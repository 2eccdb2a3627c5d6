/* The life of one generation request inside the router.
 *
 *   HTTP body -> preparation on the thread pool (parse/validate, the prompt: prompt.c) -> admission
 *   (output constraint compiled: guide.h, 400 on a bad one; limits; the workers' messages built once:
 *   sched.c) -> dispatch (sched.c: plan encoder(s)/prefill/decode, or wait in the router's queue;
 *   commit: Prefill to prefill, Encode to encoder(s)) -> first tokens from prefill (one per choice),
 *   the rest from decode -> per choice, output.c: incremental detokenization, stop strings, tool-call
 *   parsing, SSE chunks or one JSON response -> usage, metrics, abort to the workers if we stopped
 *   early or the client left.
 *
 * A request with n > 1 has n choices: the workers sample n sequences from one prefill (sharing
 * its KV); each Tokens message names its choice. A choice that ends in the router (a stop string)
 * ignores the rest of its sequence's tokens; the workers are aborted when every choice has ended.
 *
 * Workers that die: before the first token the request starts over elsewhere (req_retry); after
 * it, a request with n = 1 goes on from its last token on another prefill/decode pair
 * (req_migrate, up to --max-migrations times); anything else fails with 503. A decode worker whose
 * KV pool ran out preempts a sequence: it parks it (Tokens.preempt_migrate) and the sequence's KV
 * moves to another decode worker with room, which holds the request from then on (req_move_kv), or
 * it drops it (Tokens.preempted) and the request goes on as after a decode death (req_migrate, not
 * counted against --max-migrations), on whichever decode has room.
 *
 * A request ends in req_destroy, which gives its workers and bytes back and releases the HTTP
 * request exactly once; router_req_free (reqmap.c) frees what it owns. */
#include "request.h"

#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------- the end of a request */

/* Whether the request could go on from its tokens on another prefill/decode pair (req_migrate):
 * after a preemption always (n = 1), after its decode died --max-migrations times. */
static bool may_recompute(const router_req_t *q)
{
    return !q->mig.off && router_req_n(q) == 1;
}

static bool may_migrate(const router_req_t *q)
{
    return may_recompute(q) && q->mig.count < q->r->max_migrations;
}

/* Keeps the tokens just generated for a migration (tokens_valid bounded them by max_tokens).
 * Grows by doubling: a few allocations per request, none per token in the steady state. */
static void gen_keep(router_req_t *q, const int32_t *ids, size_t n)
{
    router_migration_t *m = &q->mig;
    if (!may_recompute(q) || !n) return;
    if ((size_t)m->n_gen + n > (size_t)m->gen_cap) {
        size_t cap = m->gen_cap ? (size_t)m->gen_cap : 64;
        while (cap < (size_t)m->n_gen + n) cap *= 2;
        cap = PRISM_MAX(PRISM_MIN(cap, (size_t)q->prompt.max_tokens), (size_t)m->n_gen + n);
        int32_t *g = prism_realloc(m->gen, cap * sizeof *g);
        if (!g) {
            PRISM_WARN("request %llu: no memory to keep its tokens; it cannot migrate", (unsigned long long)q->rid);
            m->off = true;
            return;
        }
        m->gen = g;
        m->gen_cap = (int)cap;
    }
    memcpy(m->gen + m->n_gen, ids, n * sizeof *ids);
    m->n_gen += (int)n;
}

static void req_destroy(router_req_t *q)
{
    router_t *r = q->r;
    router_url_images_cancel(q);
    router_early_forget(r, q->body);   /* what its body started and it did not take over */
    router_req_del(r, q->rid);
    /* an image still encoding (its EncodeDone may come after the answer: the encoder sends it once
     * the prefill has the embeddings) is still timed when it comes */
    for (int i = 0; i < q->prompt.n_images; i++) router_sched_encode_let_go(q, i);
    router_sched_prefill_done(q);
    router_sched_decode_done(q);
    if (q->image_charged) {
        r->image_bytes_inflight -= q->image_charged;
        prism_http_server_resume_bodies(r->http);   /* uploads that wait for image room go on */
        router_url_images_resume(r);                /* and downloads */
    }
    if (q->h) {
        prism_http_req_set_user(q->h, NULL);
        prism_http_req_release(q->h);
    }
    router_req_free(q);
}

/* Ends a request that failed after it was accepted. */
static void req_fail(router_req_t *q, int status, const char *message)
{
    q->r->metrics.failed++;
    router_sched_abort(q);
    router_out_error(q, status, message);
    req_destroy(q);
}

/* Every choice has ended: the last bytes, usage, metrics. */
static void req_complete(router_req_t *q)
{
    router_t *r = q->r;
    int n = router_req_n(q);
    double now = prism_now_s();
    char timing[900];
    router_out_timing(q, now, timing, sizeof(timing));
    PRISM_DEBUG("request %llu done (%s, %zu prompt tokens, %d choices): %s", (unsigned long long)q->rid,
                q->out.choices[0].finish, q->prompt.n_tokens, n, timing);
    /* usage as OpenAI counts it: the prompt once, the completion tokens of every choice */
    prism_oai_usage_t u = {.prompt_tokens = (int64_t)q->prompt.n_tokens, .completion_tokens = q->out.n_out,
                           .cached_tokens = -1};
    router_out_complete(q, &u, timing);
    r->metrics.prompt_tokens += q->prompt.n_tokens;
    r->metrics.generation_tokens += (uint64_t)q->out.n_out;
    prism_hist_observe(&r->metrics.e2e, now - q->time.start);
    double st[ROUTER_TS_COUNT];
    router_out_stages(q, now, st);
    for (int i = 0; i < ROUTER_TS_COUNT; i++) prism_hist_observe(&r->stage[i], st[i]);
    prism_hist_observe(&r->upload, q->time.start - q->time.began);
    router_worker_observe(r, q->place.prefill_id, st);
    router_worker_observe(r, q->place.decode_id, st);
    for (int i = 0; i < n; i++) {
        if (!strcmp(q->out.choices[i].finish, "length")) {
            r->metrics.success_length++;
        } else {
            r->metrics.success_stop++;
            router_sched_note_answer(r, q->out.choices[i].n_out);
        }
    }
    int per = q->out.n_out / n;
    if (per > 1 && q->time.first > 0) prism_hist_observe(&r->metrics.itl, (q->time.last - q->time.first) / (per - 1));
    router_sched_abort(q);
    req_destroy(q);
}

/* Choice i has ended with `finish`: its last chunk goes out; the request completes with the last
 * choice. */
static void choice_end(router_req_t *q, int i, const char *finish)
{
    q->out.choices[i].finish = finish;
    q->out.n_finished++;
    router_out_choice_end(q, i);
    if (q->out.n_finished == router_req_n(q)) req_complete(q);
}

/* ---------------------------------------------------------------- worker results */

/* The HTTP status of a worker's error, by its kind (never by its text); unset: the sender's default. */
static int error_status(Prism__ErrorKind kind, int unset)
{
    switch (kind) {
    case PRISM__ERROR_KIND__ERROR_CLIENT:      return 400;
    case PRISM__ERROR_KIND__ERROR_OVERLOAD:    return 503;
    case PRISM__ERROR_KIND__ERROR_UNAVAILABLE: return 503;
    case PRISM__ERROR_KIND__ERROR_INTERNAL:    return 500;
    case PRISM__ERROR_KIND__ERROR_PREFIX_MISS: return 503;   /* sent again already, or it could not be */
    default:                                   return unset;
    }
}

/* Whether worker w may send this Tokens message for q: the prefill it went to sends the first token
 * of each choice (once) and may report an error later (a failed KV transfer); the decode it went to
 * sends the rest (held until every first token is in: see router_handle_tokens). */
static bool tokens_allowed(const router_req_t *q, const router_worker_t *w, const Prism__Tokens *t)
{
    const router_placement_t *pl = &q->place;
    if (t->from_prefill) {
        if (w->role != PRISM__ROLE__ROLE_PREFILL || strcmp(pl->prefill_id, w->id) != 0) return false;
        if (t->finish == PRISM__FINISH__FINISH_ERROR && t->n_token_ids == 0) return true;
        return pl->prefill_pending && t->index < (uint32_t)router_req_n(q) && !q->out.choices[t->index].got_first;
    }
    /* the source of a migration in flight may only give it up (its KV stayed there: recompute) */
    if (w->role == PRISM__ROLE__ROLE_DECODE && pl->mig_from[0] && !strcmp(pl->mig_from, w->id))
        return t->preempted && !t->n_token_ids && !t->preempt_migrate;
    return w->role == PRISM__ROLE__ROLE_DECODE && pl->decode_pending && !strcmp(pl->decode_id, w->id);
}

/* Every field of a Tokens message against what the request asked for: a choice it has, ids in the
 * vocabulary, no more tokens than max_tokens in all for that choice, logprobs only for tokens sent
 * and at most 20 alternatives. */
static bool tokens_valid(const router_t *r, const router_req_t *q, const Prism__Tokens *t)
{
    if (t->index >= (uint32_t)router_req_n(q)) return false;
    int left = q->prompt.max_tokens - q->out.choices[t->index].n_out;
    if (t->n_token_ids > (size_t)PRISM_MAX(left, 0) || t->n_logprobs > t->n_token_ids ||
        (unsigned)t->finish > PRISM__FINISH__FINISH_ERROR)
        return false;
    for (size_t i = 0; i < t->n_token_ids; i++)
        if (t->token_ids[i] < 0 || t->token_ids[i] >= r->cfg.vocab) return false;
    for (size_t i = 0; i < t->n_logprobs; i++) {
        const Prism__TokenLogprobs *l = t->logprobs[i];
        if (!l || l->n_top > 20) return false;
        for (size_t k = 0; k < l->n_top; k++)
            if (!l->top[k] || l->top[k]->token_id < 0 || l->top[k]->token_id >= r->cfg.vocab) return false;
    }
    return true;
}

/* What a Tokens message says about the request's workers: the prefill is done with it when every
 * choice's first token is in; the decode when every choice has ended at a worker (prefill ends a
 * choice whose first token is its last: no KV goes to decode for it), or at an error. */
static void tokens_account(router_req_t *q, const Prism__Tokens *t)
{
    router_placement_t *pl = &q->place;
    router_choice_t *c = &q->out.choices[t->index];   /* tokens_valid checked the index */
    int n = router_req_n(q);
    bool error = t->error && *t->error;
    if (t->from_prefill && pl->prefill_pending && !c->got_first && !error) {
        c->got_first = true;
        if (++pl->n_first == n) router_sched_prefill_done(q);
    }
    if (t->finish != PRISM__FINISH__FINISH_NONE && !c->worker_ended) {
        c->worker_ended = true;
        pl->n_worker_ended++;
    }
    if (pl->n_worker_ended == n || error) router_sched_decode_done(q);
}

/* The prefill's first tokens: the request is past the stage a retry covers. */
static void tokens_first(router_t *r, router_req_t *q, const Prism__Tokens *t, double now)
{
    if (q->time.first == 0) {   /* a migrated request's first token came long ago */
        q->time.first = now;
        q->time.queue_ms = t->queue_ms;
        q->time.prefill_ms = t->prefill_ms;
        q->time.embed_wait_ms = t->embed_wait_ms;
        prism_hist_observe(&r->metrics.ttft, now - q->time.start);
        prism_hist_observe(&r->metrics.queue, (t->queue_ms + t->embed_wait_ms) / 1e3);   /* all its wait in prefill */
    }
    q->stage = STAGE_PREFILLED;
    /* no retry after the first token (req_retry): unless a migration or a preemption may encode
     * them again, the image bytes are dead weight from here (they stay counted in
     * image_bytes_inflight until the request ends, so keeping them holds no more than was admitted) */
    for (int i = 0; i < q->prompt.n_images && !may_recompute(q); i++) router_prompt_drop_image(&q->prompt, i);
}

static bool req_migrate(router_req_t *q, const router_worker_t *w, const char *why);
static void req_move_kv(router_req_t *q);
static bool req_resend(router_req_t *q);

static void tokens_apply(router_t *r, router_req_t *q, const Prism__Tokens *t)
{
    int i = (int)t->index;
    /* the prefill's cache lost the prefix a skipped image counted on: again, every image encoded
     * (before the accounting: this attempt's choices did not end) */
    if (t->error && *t->error && t->error_kind == PRISM__ERROR_KIND__ERROR_PREFIX_MISS && req_resend(q)) return;
    tokens_account(q, t);
    if (t->error && *t->error) {
        char msg[300];
        snprintf(msg, sizeof(msg), "%s", t->error);
        req_fail(q, error_status(t->error_kind, 500), msg);
        return;
    }
    double now = prism_now_s();
    if (!t->from_prefill) q->mig.decode_heard = true;
    if (!t->from_prefill && t->n_token_ids && q->place.mig_from[0]) {   /* the KV moved: its target goes on */
        q->place.mig_from[0] = '\0';
        r->metrics.preempted_migrate++;
    }
    if (!t->from_prefill && !q->time.first_decode) {   /* the decode's first message: its timings */
        q->time.first_decode = now;
        q->time.dec_queue_ms = t->queue_ms;
        q->time.dec_step_ms = t->step_ms;
    }
    if (t->from_prefill && q->stage != STAGE_PREFILLED) tokens_first(r, q, t, now);
    q->time.last = now;
    if (q->out.choices[i].finish) return;   /* ended in the router (stop string): the rest of its sequence is not used */
    gen_keep(q, t->token_ids, t->n_token_ids);
    const char *finish = router_out_tokens(q, i, t);
    if (finish) choice_end(q, i, finish);
    else {
        router_out_progress(q, i);
        if (t->swapped && !t->from_prefill) r->metrics.swapped++;   /* it goes on there later: nothing to do */
        /* its decode parked it: its KV moves to another decode worker (or it is prefilled again) */
        if (t->preempt_migrate && !t->from_prefill) req_move_kv(q);
        /* its decode dropped its KV: prefill it again from every token so far */
        else if (t->preempted && !t->from_prefill &&
                 !req_migrate(q, NULL, "preempted by its decode worker (KV pool full)"))
            req_fail(q, 503, "The decode worker ran out of KV cache for this request; retry after a short wait.");
    }
}

/* Keeps a decode Tokens message that overtook the prefill's (see router.h). The prefill's reply
 * may trail its KV by as long as its I/O thread waits for a core: a fast decode on a loaded machine
 * runs hundreds of steps meanwhile (seen: 256 of a 300-token answer). So the bound is what the decode
 * may legally send this request, n x max_tokens token ids (each message at least one, but for
 * the few that carry none: a finish, a swap), not a fixed count; a decode that sends more is
 * refused as soon as it passes it. */
static bool tokens_hold(router_req_t *q, Prism__Envelope *env)
{
    int64_t may = (int64_t)router_req_n(q) * q->prompt.max_tokens;
    size_t n_ids = env->tokens->n_token_ids;
    if (q->held_tokens + (int64_t)n_ids > may || q->n_held >= may + ROUTER_MAX_HELD_TOKENS) {
        req_fail(q, 500, "the first token from the prefill worker never arrived");
        return false;
    }
    if (q->n_held == q->held_cap) {
        int cap = q->held_cap ? q->held_cap * 2 : 8;
        Prism__Envelope **h = prism_realloc(q->held, (size_t)cap * sizeof(*h));
        if (!h) {
            req_fail(q, 500, "out of memory");
            return false;
        }
        q->held = h;
        q->held_cap = cap;
    }
    q->held[q->n_held++] = env;
    q->held_tokens += (int64_t)n_ids;
    return true;
}

bool router_handle_tokens(router_t *r, const router_worker_t *from, Prism__Envelope *env, bool *kept)
{
    *kept = false;
    uint64_t rid = env->request_id;
    const Prism__Tokens *t = env->tokens;
    router_req_t *q = router_req_get(r, rid);
    if (!q) {
        /* Finished or aborted already: a late message, not a refusal. A decode that still generates
         * for an id this router does not hold (KV made up by a peer holding a prefill key, or an
         * abort that was lost) is told to stop: its sequence costs one step, not max_tokens. */
        if (from->role == PRISM__ROLE__ROLE_DECODE && t && t->finish == PRISM__FINISH__FINISH_NONE)
            router_send_abort_to(r, from->id, rid);
        return true;
    }
    if (env->request_id_hi != q->rid_hi) {
        PRISM_WARN("request %llu: Tokens from %s worker %s with the wrong high half of its id: dropped",
                   (unsigned long long)rid, prism_role_name(from->role), from->id);
        return false;
    }
    if (!tokens_allowed(q, from, t)) {
        PRISM_WARN("request %llu: Tokens from %s worker %s, which does not hold it at that stage: dropped",
                   (unsigned long long)rid, prism_role_name(from->role), from->id);
        return false;
    }
    if (!tokens_valid(r, q, t)) {
        /* From the worker that holds it: the request cannot go on with that worker's answer. */
        PRISM_WARN("request %llu: malformed Tokens from %s worker %s", (unsigned long long)rid,
                   prism_role_name(from->role), from->id);
        req_fail(q, 500, "A worker sent a malformed result.");
        return false;
    }
    /* A decode's error needs no first token before it: it ends the request now. */
    if (!t->from_prefill && q->place.prefill_pending && !(t->error && *t->error)) {
        *kept = tokens_hold(q, env);
        return true;
    }
    tokens_apply(r, q, t);
    /* The prefill's is in: the held ones follow in the order they came, each checked again against
     * what is left of max_tokens. Applying one may end the request (finish, stop string, error),
     * which frees the rest with it. */
    for (int i = 0; (q = router_req_get(r, rid)) && !q->place.prefill_pending && i < q->n_held; i++) {
        Prism__Envelope *held = q->held[i];
        q->held[i] = NULL;
        if (tokens_valid(r, q, held->tokens)) {
            tokens_apply(r, q, held->tokens);
        } else {
            PRISM_WARN("request %llu: malformed Tokens from decode worker %s", (unsigned long long)rid,
                       q->place.decode_id);
            req_fail(q, 500, "A worker sent a malformed result.");
        }
        prism_msg_env_free(held);
    }
    if (q && !q->place.prefill_pending) {
        q->n_held = 0;
        q->held_tokens = 0;
    }
    return true;
}

/* The encoder's measures of an image it encoded (or found in its cache), in its stage histograms. */
static void encode_observe(router_t *r, const router_worker_t *from, const Prism__EncodeDone *d)
{
    if (d->error && *d->error) return;
    double st[ROUTER_TS_COUNT] = {[ROUTER_TS_ENCODER_QUEUE] = d->queue_ms / 1e3,
                                  [ROUTER_TS_IMAGE_DECODE] = d->decode_ms / 1e3, [ROUTER_TS_VIT] = d->vit_ms / 1e3};
    router_worker_observe(r, from->id, st);
}

bool router_handle_encode_done(router_t *r, const router_worker_t *from, uint64_t rid, uint64_t rid_hi,
                               const Prism__EncodeDone *d)
{
    router_req_t *q = router_req_get(r, rid);
    if (!q && router_worker_take_let_go(r, from, rid, rid_hi, d->image_index)) {
        /* its request ended (or this attempt was let go) before the answer came: the work was done */
        PRISM_DEBUG("request %llu: EncodeDone for image %u from %s after it was let go: timed",
                    (unsigned long long)rid, d->image_index, from->id);
        encode_observe(r, from, d);
        return true;
    }
    if (!q) return router_early_encode_done(r, from, rid, rid_hi, d);  /* an early job, or a request that ended */
    /* Only the encoder this image went to, once, naming the whole id. */
    if (rid_hi != q->rid_hi || d->image_index >= (uint32_t)q->prompt.n_images ||
        !q->place.encode_pending[d->image_index] || from->role != PRISM__ROLE__ROLE_ENCODER ||
        strcmp(q->place.encoder_id[d->image_index], from->id) != 0) {
        PRISM_WARN("request %llu: EncodeDone for image %u from %s, which does not hold it: dropped",
                   (unsigned long long)rid, d->image_index, from->id);
        return false;
    }
    router_sched_encode_done(q, (int)d->image_index);
    encode_observe(r, from, d);
    q->time.decode_ms += d->decode_ms;
    q->time.vit_ms += d->vit_ms;
    q->time.enc_queue_ms += d->queue_ms;
    q->time.cache_hits += d->cache_hit;
    if (d->error && *d->error) {
        char msg[320];
        snprintf(msg, sizeof(msg), "Image %u: %s", d->image_index, d->error);
        req_fail(q, error_status(d->error_kind, 400), msg);
    }
    return true;
}

/* ---------------------------------------------------------------- retry and migration */

/* Remembers w as a worker this request got stuck on: its next attempts try others first. */
static void avoid_worker(router_req_t *q, const char *id)
{
    router_placement_t *pl = &q->place;
    char *slot = pl->avoid[pl->n_avoid++ % PRISM_ARRAY_LEN(pl->avoid)];
    size_t len = strnlen(id, sizeof(pl->avoid[0]) - 1);
    memcpy(slot, id, len);
    slot[len] = '\0';
}

/* A worker holding this request is gone before its first token reached the client: nothing was
 * said yet, so the request starts over on healthy workers, ahead of the queue. It takes a new id:
 * whatever the first attempt's surviving workers still send matches no request. */
static bool req_retry(router_req_t *q, const char *why)
{
    router_t *r = q->r;
    router_placement_t *pl = &q->place;
    if (q->stage != STAGE_SENT || pl->attempts > r->max_retries || r->queue_len == r->reqs_cap) return false;
    uint64_t old = q->rid;
    /* The stage it is stuck in: its encoders, else its prefill worker. */
    bool encoding = false;
    for (int i = 0; i < q->prompt.n_images; i++)
        if (pl->encode_pending[i]) {
            encoding = true;
            avoid_worker(q, pl->encoder_id[i]);
        }
    if (!encoding && pl->prefill_pending) avoid_worker(q, pl->prefill_id);
    pl->n_avoid = PRISM_MIN(pl->n_avoid, (int)PRISM_ARRAY_LEN(pl->avoid));
    router_sched_release(q);
    q->stage = STAGE_QUEUED;
    bool queued = router_queue_push_front(r, q->rid);  /* room checked above */
    PRISM_ASSERT(queued);
    r->metrics.retried++;
    r->queue_dirty = true;
    PRISM_INFO("request %llu: %s; retried as %llu (attempt %d of %d)", (unsigned long long)old, why,
               (unsigned long long)q->rid, pl->attempts + 1, r->max_retries + 1);
    return true;
}

/* Its prefill refused it (ERROR_PREFIX_MISS): an image sent to no encoder because the prefill's
 * prefix cache held its span was evicted before the request came. Nothing was said to the client:
 * it goes again, ahead of the queue, to a prefill by the same rules but with every image encoded
 * (the image bytes are kept until the first token). Once per request: a second refusal fails it. */
static bool req_resend(router_req_t *q)
{
    router_t *r = q->r;
    if (q->stage != STAGE_SENT || q->place.no_skip || r->queue_len == r->reqs_cap) return false;
    for (int i = 0; i < q->prompt.n_images; i++)
        if (!q->prompt.img[i]) return false;   /* let go already: nothing to encode */
    uint64_t old = q->rid;
    q->place.no_skip = true;
    router_sched_release(q);
    q->stage = STAGE_QUEUED;
    bool queued = router_queue_push_front(r, q->rid);   /* room checked above */
    PRISM_ASSERT(queued);
    r->metrics.prefix_resent++;
    r->queue_dirty = true;
    PRISM_INFO("request %llu: its prefill no longer holds the prefix of an image sent without embeddings; sent again "
               "as %llu with every image encoded", (unsigned long long)old, (unsigned long long)q->rid);
    return true;
}

/* A worker holding a request that has sent tokens to its client is gone (its decode, or its
 * prefill before the KV reached the decode): with n = 1 the request goes on from its last token on
 * another prefill/decode pair, ahead of the queue. The prefill gets the prompt and every token
 * generated so far (Sampling.generated says how many): it counts them for the penalties, feeds them
 * to the guide and advances the RNG past them (prism_seq_seed), so the next token is the one the
 * lost worker would have sampled, and the new decode goes on from there. The router's side simply
 * continues (text, detokenizer, stop-string holdback, logprobs, the stream): no gap, no repeat.
 * The images are encoded again from the bytes kept for it. A new id, as for a retry: what the old
 * workers still send matches nothing. n > 1 is not migrated (the choices' RNG streams fork at the
 * first token; their later states died with the worker): it fails as before.
 * w NULL: its decode worker preempted it (Tokens.preempted, its last message about it) and dropped
 * its KV; that worker is neither avoided nor told to abort, and no migration is counted. */
static bool req_migrate(router_req_t *q, const router_worker_t *w, const char *why)
{
    router_t *r = q->r;
    router_choice_t *c = &q->out.choices[0];
    if (q->stage != STAGE_PREFILLED || !(w ? may_migrate(q) : may_recompute(q)) || c->finish ||
        c->n_out != q->mig.n_gen || q->mig.n_gen >= q->prompt.max_tokens || r->queue_len == r->reqs_cap)
        return false;
    if (router_sched_msgs_migrate(q) != PRISM_OK) return false;   /* no memory for its prompt: it fails */
    uint64_t old = q->rid;
    if (w) {
        avoid_worker(q, w->id);
        q->place.n_avoid = PRISM_MIN(q->place.n_avoid, (int)PRISM_ARRAY_LEN(q->place.avoid));
    } else if (!q->place.mig_from[0]) {
        router_sched_decode_done(q);   /* it holds nothing there any more: no abort */
    }   /* else a migration failed: its source and its target are both told (router_sched_release) */
    router_sched_release(q);
    c->got_first = c->worker_ended = false;
    q->place.n_first = q->place.n_worker_ended = 0;
    q->mig.decode_heard = false;
    q->stage = STAGE_QUEUED;
    q->place.attempts = 0;       /* the new pair gets --max-retries of its own */
    q->mig.count += w != NULL;
    q->time.wait = prism_now_s();   /* --max-queue-wait counts from now */
    bool queued = router_queue_push_front(r, q->rid);  /* room checked above */
    PRISM_ASSERT(queued);
    if (w) r->metrics.migrated++;
    else r->metrics.preempted++;
    r->queue_dirty = true;
    if (w)
        PRISM_INFO("request %llu: %s; migrated as %llu after %d tokens (migration %d of %d)", (unsigned long long)old,
                   why, (unsigned long long)q->rid, q->mig.n_gen, q->mig.count, r->max_migrations);
    else
        PRISM_DEBUG("request %llu: %s; prefilled again as %llu after %d tokens", (unsigned long long)old, why,
                    (unsigned long long)q->rid, q->mig.n_gen);
    return true;
}

/* Its decode worker parked it (KV pool full, Tokens.preempt_migrate): a decode worker with room takes
 * its KV and decode state whole (Migrate names it to the source, which sends it over the KV transfer
 * with the same request id) and holds the request from now on: the client's stream goes on from its
 * tokens. The source is remembered (place.mig_from) until the target's first token: a source that
 * gives up (Tokens.preempted), a target that bounces it or either one dying makes it go on by
 * recompute (req_migrate), with both told to drop it. No worker with room: the source drops it
 * (Migrate with no endpoint) and it is prefilled again. */
static void req_move_kv(router_req_t *q)
{
    router_t *r = q->r;
    router_placement_t *pl = &q->place;
    router_worker_t *src = router_worker_by_id(r, pl->decode_id);
    uint64_t bs = src ? PRISM_MAX(src->block_size, 1u) : 1;
    uint64_t blocks = (q->prompt.n_tokens + (uint64_t)q->out.choices[0].n_out + bs) / bs;   /* and its next token */
    router_worker_t *dst = src && !pl->mig_from[0] && may_recompute(q) ? router_pick_kv_target(r, src, blocks) : NULL;
    Prism__Migrate m = PRISM__MIGRATE__INIT;
    m.target_endpoint = dst ? dst->data_endpoint : "";
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_MIGRATE;
    env.request_id = q->rid;
    env.request_id_hi = q->rid_hi;
    env.trace_id_hi = q->trace.hi;
    env.trace_id_lo = q->trace.lo;
    env.migrate = &m;
    bool sent = src && router_send(r, src, &env, NULL, 0) == PRISM_OK;
    if (!dst || !sent) {   /* dropped there (or its worker is gone: the source gives up on its own) */
        if (!req_migrate(q, NULL, "preempted by its decode worker (KV pool full), no decode worker has room for its KV"))
            req_fail(q, 503, "The decode worker ran out of KV cache for this request; retry after a short wait.");
        return;
    }
    router_sched_decode_done(q);   /* the source's slot */
    snprintf(pl->mig_from, sizeof pl->mig_from, "%s", src->id);
    snprintf(pl->decode_id, sizeof pl->decode_id, "%s", dst->id);
    pl->decode_pending = true;
    dst->inflight++;
    PRISM_DEBUG("request %llu: preempted by decode worker %s, its KV moves to %s after %d tokens",
                (unsigned long long)q->rid, src->id, dst->id, q->out.choices[0].n_out);
}

void router_fail_worker_requests(router_t *r, const router_worker_t *w, const char *why)
{
    for (size_t i = 0; i < r->reqs_cap; i++) {
        router_req_t *q = r->reqs[i];
        if (!q) continue;
        bool held = router_sched_holds(q, w);
        /* After its first token a prefill still holds the KV until the decode worker takes it (the
         * decode's first token says it did): its death before then may leave the decode nothing to
         * run, so a request that may migrate does (one that may not waits for its decode tokens, as
         * before migration existed: the KV may be on its way, else --request-timeout ends it). */
        held |= q->stage == STAGE_PREFILLED && q->place.decode_pending && !q->mig.decode_heard && may_migrate(q) &&
                !strcmp(q->place.prefill_id, w->id);
        if (held) {
            char msg[256];
            snprintf(msg, sizeof(msg), "The %s worker serving this request %s.", prism_role_name(w->role), why);
            if (!req_retry(q, msg) && !req_migrate(q, w, msg)) req_fail(q, 503, msg);
            i = (size_t)-1;  /* the map changed under us: rescan */
        }
    }
}

/* ---------------------------------------------------------------- deadlines, shutdown, clients */

void router_sweep_requests(router_t *r)
{
    double now = prism_now_s();
    for (size_t i = 0; i < r->reqs_cap; i++) {
        router_req_t *q = r->reqs[i];
        if (!q) continue;
        if (q->stage != STAGE_PREFILLED && now - q->time.wait > r->max_queue_wait_s) {
            char msg[160];
            if (q->stage == STAGE_QUEUED && q->place.waiting_for) {
                r->metrics.refused_limit[PRISM_REFUSE_NO_WORKERS]++;
                snprintf(msg, sizeof(msg), "No %s worker is available; try again shortly.", q->place.waiting_for);
            } else {
                r->metrics.refused_limit[PRISM_REFUSE_QUEUE_WAIT]++;
                snprintf(msg, sizeof(msg), "The request waited too long for a free worker; retry after a short wait.");
            }
            req_fail(q, 503, msg);
            i = (size_t)-1;
        } else if (q->stage == STAGE_SENT && r->stage_timeout_s > 0 && now - q->time.dispatch > r->stage_timeout_s) {
            /* A worker alive but stuck (or far slower than the rest): try others, then 504. */
            bool encoding = false;
            for (int k = 0; k < q->prompt.n_images; k++) encoding |= q->place.encode_pending[k];
            char msg[160];
            snprintf(msg, sizeof(msg), "The %s stage did not finish within %gs.", encoding ? "encode" : "prefill",
                     r->stage_timeout_s);
            r->metrics.stage_timeouts++;
            if (!req_retry(q, msg)) req_fail(q, 504, msg);
            i = (size_t)-1;
        } else if (now - q->time.start > r->request_timeout_s) {
            req_fail(q, 503, "The request timed out.");
            i = (size_t)-1;
        }
    }
}

void router_abort_all(router_t *r)
{
    for (size_t i = 0; i < r->reqs_cap; i++) {
        router_req_t *q = r->reqs[i];
        if (q) {
            req_fail(q, 503, "The server is shutting down.");
            i = (size_t)-1;
        }
    }
}

static void on_client_gone(prism_http_req_t *h, void *ud)
{
    router_req_t *q = ud;
    prism_log_ctx_t lc = {q->rid, q->trace};   /* a copy: q ends here */
    const prism_log_ctx_t *prev = prism_log_ctx_enter(&lc);
    q->r->metrics.success_abort++;
    PRISM_DEBUG("request %llu: client went away", (unsigned long long)q->rid);
    router_sched_abort(q);
    req_destroy(q);
    prism_log_ctx_leave(prev);
}

/* ---------------------------------------------------------------- the queue */

/* Tries the queued requests, by priority then oldest first. A request that must wait blocks the tiers it waits for:
 * younger requests that need one of them keep their place behind it (no overtaking inside a tier,
 * so a big request is not starved), but a younger request that needs none of them goes ahead: text
 * requests are not held up by an image request waiting for an encoder (none registered, or all
 * full). Once prefill or decode is blocked nothing younger can go (every request needs both). */
void router_dispatch_queued(router_t *r)
{
    if (r->draining) return;  /* re-entered from a request that failed while we dispatch */
    r->draining = true;
    /* Take the queue out whole: dispatching may push retried requests to its front meanwhile. */
    size_t n = r->queue_len;
    for (size_t k = 0; k < n; k++) r->queue_scratch[k] = r->queue[(r->queue_head + k) % r->reqs_cap];
    r->queue_len = 0;
    router_queue_order(r, n);
    unsigned blocked = 0;
    for (size_t k = 0; k < n; k++) {
        router_req_t *q = router_req_get(r, r->queue_scratch[k]);
        if (!q || q->stage != STAGE_QUEUED) continue;  /* ended (or sent again) while it waited */
        unsigned need = router_sched_tiers(q);
        if (!(need & blocked)) {
            char msg[300];
            int status = router_sched_dispatch(r, q, msg, sizeof(msg));
            if (status != ROUTER_DISPATCH_WAIT) {
                if (status) req_fail(q, status, msg);
                continue;
            }
            blocked |= q->place.wait_tiers ? q->place.wait_tiers : need;
        }
        bool ok = router_queue_push(r, q->rid);  /* back in its order (a failed send gave it a new id) */
        PRISM_ASSERT(ok);                        /* it was in the queue: its place is still there */
        (void)ok;
    }
    r->draining = false;
    if (!r->queue_len) prism_http_server_resume_bodies(r->http);  /* uploads paused for it go on */
}

/* ---------------------------------------------------------------- preparation and admission */

/* The request's output constraint (response_format / guided_*, or the grammar forcing a tool
 * call) compiled once here (cached by its text) so a bad one is a 400 naming the field; the
 * workers compile the same text against their own vocabularies. On a preparation thread: a legal
 * grammar may take its whole compile budget (grammar.h), which the loop must not wait for.
 * Returns 0 or an HTTP status with msg / param filled. */
static int guide_setup(router_t *r, router_req_t *q, char *msg, size_t n, char *param, size_t pn)
{
    const prism_oai_request_t *o = &q->oai;
    if (o->tool_choice != PRISM_OAI_TOOL_NONE) {
        if (r->tool_parser < 0) {
            snprintf(param, pn, "tool_choice");
            snprintf(msg, n, "Tool calling (tool_choice \"%s\") needs the router started with --tool-call-parser "
                     "(hermes or pythonic); send tool_choice \"none\" to only show the tools to the chat template.",
                     o->tool_choice == PRISM_OAI_TOOL_AUTO ? "auto" : o->tool_choice == PRISM_OAI_TOOL_REQUIRED
                     ? "required" : "function");
            return 400;
        }
        q->parse_tools = true;
    }
    const char *field = o->guide_param;
    if (o->guide_kind) {
        q->guide = (prism_guide_spec_t){.kind = o->guide_kind, .text = o->guide_text, .len = o->guide_len};
    } else if (o->tool_choice == PRISM_OAI_TOOL_REQUIRED || o->tool_choice == PRISM_OAI_TOOL_NAMED) {
        q->guide = (prism_guide_spec_t){
            .kind = PRISM_GUIDE_TOOLS, .text = o->tools_text, .len = strlen(o->tools_text),
            .tool_name = o->tool_choice == PRISM_OAI_TOOL_NAMED ? o->tool_name : NULL,
            .tool_parallel = o->parallel_tool_calls, .tool_format = r->tool_parser};
        field = "tools";
    } else {
        return 0;
    }
    if (!r->guides) {
        snprintf(param, pn, "%s", field);
        snprintf(msg, n, "Structured output is not available on this server (no grammar vocabulary).");
        return 400;
    }
    prism_guide_t *g;
    prism_grammar_error_t err;
    int rc = prism_guide_get(r->guides, &q->guide, &g, &err);
    if (rc == PRISM_OK) {
        prism_guide_release(g);
        return 0;
    }
    if (rc == PRISM_ENOMEM) {
        snprintf(msg, n, "The server is out of memory; try again shortly.");
        return 503;
    }
    const char *hash = strchr(err.path, '#');
    if (q->guide.kind == PRISM_GUIDE_TOOLS && err.path[0]) {
        /* "tools[1].function.parameters#/properties/x": the field is what precedes the pointer */
        snprintf(param, pn, "%.*s", (int)(hash ? (size_t)(hash - err.path) : strlen(err.path)), err.path);
    } else {
        snprintf(param, pn, "%s", field);
    }
    const char *what = rc == PRISM_ENOTSUP ? "unsupported" : rc == PRISM_ELIMIT ? "too large or too complex" : "invalid";
    snprintf(msg, n, "%s is %s: %s%s%s%s", param, what, err.message, hash || (err.path[0] && q->guide.kind != PRISM_GUIDE_TOOLS) ? " (at " : "",
             hash ? hash : q->guide.kind != PRISM_GUIDE_TOOLS ? err.path : "",
             hash || (err.path[0] && q->guide.kind != PRISM_GUIDE_TOOLS) ? ")" : "");
    return 400;
}

/* What refuses a parsed request before its images and prompt are prepared: its model, its output
 * constraint. A preparation thread (reads only the router's configuration and its guide cache,
 * which threads share). Returns 0, or an HTTP status with msg (and param) filled. */
static int admit_check(router_t *r, router_req_t *q, char *msg, size_t n, char *param, size_t pn)
{
    if (q->oai.model && strcmp(q->oai.model, r->served_model_name) != 0) {
        snprintf(msg, n, "The model `%s` does not exist.", q->oai.model);
        return 404;
    }
    return guide_setup(r, q, msg, n, param, pn);
}

/* Preparing a request is the CPU-heavy part of its life: parsing its JSON, compiling its output
 * constraint, decoding and hashing its images, rendering the chat template, tokenizing. It runs on
 * the preparation threads (--prep-threads, prep_pool.c: generation lane), so the loop thread only
 * does I/O: an 8 MiB prompt or a costly grammar no longer stalls every stream and every other client
 * for the second it takes. prep_run reads only the request's body, the router's configuration and
 * model (tokenizer and template are immutable) and the guide cache (locked, shared by threads);
 * everything else the router keeps (metrics, workers, the request map) is touched in prep_done, on
 * the loop. */
static void prep_run(uv_work_t *w)
{
    router_req_t *q = w->data;
    router_t *r = q->r;
    router_prep_t *p = &q->prep;
    size_t blen = 0;
    const char *body = prism_http_req_body(q->h, &blen);
    prism_oai_parse_opts_t popts = {.max_images = r->max_images_per_prompt, .vocab = r->cfg.vocab,
                                    .max_parse_bytes = r->max_parse_bytes};   /* the plan's "parsing" row */
    p->parsed = prism_oai_parse(body, blen, q->chat, &popts, &q->oai, &p->perr) == PRISM_OK;
    if (!p->parsed) return;
    /* the guide compiles here, never on the loop: the cache is shared by these threads (guide.h) */
    if ((p->check = admit_check(r, q, p->msg, sizeof p->msg, p->param, sizeof p->param))) return;
    if (q->chat)
        p->status = router_prompt_load_images(r, &q->prompt, &q->oai, q->h, p->refused, p->msg, sizeof p->msg);
    /* with images by URL, the placeholders are expanded once those are in (url_images.c, then
     * images_fetched): Llama-4's need each image's size */
    if (!p->status)
        p->status = q->prompt.n_urls ? router_prompt_tokens(r, &q->prompt, &q->oai, q->chat, p->msg, sizeof p->msg)
                                     : router_prompt_build(r, &q->prompt, &q->oai, q->chat, p->msg, sizeof p->msg);
    if (router_req_keep_inputs(q) != PRISM_OK && !p->status) {
        p->status = 503;
        snprintf(p->msg, sizeof p->msg, "The server is out of memory; try again shortly.");
    }
}

static void on_prep_gone(prism_http_req_t *h, void *ud)
{
    (void)h;
    router_req_t *q = ud;
    if (router_prep_cancel(q->r, &q->prep.job)) {   /* no thread took it yet: it never runs */
        q->r->n_preparing--;
        req_destroy(q);
        return;
    }
    q->prep.gone = true;   /* prep_done lets it go */
}

static void prep_done(uv_work_t *w, int wstatus);

/* A request refused before it was allocated: its answer, and its body's early encodes stop. */
static void refuse_at_once(router_t *r, prism_http_req_t *h, int status, const char *msg)
{
    router_early_forget(r, prism_http_req_id(h));
    router_respond_error(h, status, msg, NULL);
    prism_http_req_release(h);
}

int router_refusal_at_arrival(router_t *r, char *msg, size_t n)
{
    /* Draining is no refusal: the HTTP server closed every idle connection and ends the others after
     * their current request, so a request that reaches us now began before the drain (its bytes had
     * arrived). It is served as the requests in flight are: a 503 would lose it, as a load balancer
     * does not pass a request on to another router once it has sent the body (nginx with
     * proxy_request_buffering off). */
    /* Requests being prepared count as in flight (so do /tokenize jobs): what waits for the
     * preparation threads is bounded by --max-running-requests. */
    if ((int)(r->n_reqs + r->n_preparing + r->n_utility) >= r->max_running) {
        r->metrics.refused_limit[PRISM_REFUSE_QUEUE_FULL]++;
        snprintf(msg, n, "The server is at capacity (%d requests in flight); retry after a short wait.",
                 r->max_running);
        return 429;
    }
    return 0;
}

void router_handle_generate(router_t *r, prism_http_req_t *h, bool chat)
{
    char msg[160];
    int status = router_refusal_at_arrival(r, msg, sizeof msg);
    if (status) {
        refuse_at_once(r, h, status, msg);
        return;
    }
    router_req_t *q = router_req_alloc(r, h, chat);
    if (!q) {
        refuse_at_once(r, h, 503, "The server is out of memory; try again shortly.");
        return;
    }
    /* Its images count from now, not from admission: the body gate (router_body_gate) holds other
     * image uploads back while these wait for a prep thread, so the bytes held pass
     * --max-image-bytes-in-flight by at most the one body that completed under it. */
    q->image_charged = prism_http_req_image_bytes(h);
    r->image_bytes_inflight += q->image_charged;
    prism_http_req_on_abort(h, on_prep_gone, q);
    r->n_preparing++;
    router_prep_submit(r, &q->prep.job, ROUTER_LANE_GENERATE, prep_run, prep_done);
}

/* The parse error, as the parser worded it. */
static void refuse_unparsed(router_t *r, router_req_t *q)
{
    const prism_oai_error_t *perr = &q->prep.perr;
    prism_http_req_t *h = q->h;
    r->metrics.refused_limit[PRISM_REFUSE_BAD_REQUEST]++;
    if (perr->refusal == PRISM_OAI_REFUSED_TOO_MANY_IMAGES) r->metrics.refused_limit[PRISM_REFUSE_TOO_MANY_IMAGES]++;
    prism_http_respond_error(h, perr->status ? perr->status : 400, perr->type[0] ? perr->type : "BadRequestError",
                             perr->message, perr->param[0] ? perr->param : NULL, NULL, NULL);
    q->h = NULL;
    prism_http_req_release(h);
    req_destroy(q);
}

/* A parsed and prepared request (admit_check passed) becomes one in flight: its id, room for it, then
 * its output state and its workers' messages, and its place in the map. Returns 0, or an HTTP status
 * with msg filled: nothing was sent or counted yet. */
static int admit(router_t *r, router_req_t *q, char *msg, size_t n)
{
    if (router_req_new_id(r, &q->rid, &q->rid_hi) != PRISM_OK) {
        snprintf(msg, n, "The server has no randomness for request ids; try again shortly.");
        return 503;
    }
    if ((int)r->n_reqs >= r->max_running) {
        r->metrics.refused_limit[PRISM_REFUSE_QUEUE_FULL]++;
        snprintf(msg, n, "The server is at capacity (%d requests in flight); retry after a short wait.", r->max_running);
        return 429;
    }
    for (int i = 0; i < PRISM_REFUSE_COUNT; i++) r->metrics.refused_limit[i] += q->prep.refused[i];
    if (q->prep.status != 0) {
        snprintf(msg, n, "%s", q->prep.msg);
        return q->prep.status;
    }
    prism_http_req_drop_body(q->h);
    if (router_out_init(q) != PRISM_OK) {
        snprintf(msg, n, "The server is out of memory; try again shortly.");
        return 503;
    }
    router_sched_msgs_build(q);
    if (router_req_put(r, q->rid, q) != PRISM_OK) {
        r->metrics.refused_limit[PRISM_REFUSE_QUEUE_FULL]++;
        snprintf(msg, n, "The server is at capacity; retry after a short wait.");
        return 429;
    }
    return 0;
}

/* The end of preparation (status: admit_check's, 0 when it passed): the request is admitted and
 * dispatched, or answered with its error. */
static void prepared(router_t *r, router_req_t *q, int status, char *msg, size_t n, const char *param)
{
    prism_http_req_t *h = q->h;
    r->n_preparing--;
    if (!status) status = admit(r, q, msg, n);
    if (status) {
        if (status >= 400 && status < 500 && status != 429) r->metrics.refused_limit[PRISM_REFUSE_BAD_REQUEST]++;
        router_respond_error(h, status, msg, param && param[0] ? param : NULL);
        q->h = NULL;
        prism_http_req_release(h);
        req_destroy(q);
        return;
    }
    r->image_bytes_inflight = r->image_bytes_inflight - q->image_charged + q->prompt.image_bytes;
    q->image_charged = q->prompt.image_bytes;
    q->time.admit = prism_now_s();
    /* Behind older queued requests, or no worker has room: wait in the router's queue. */
    status = router_queue_blocks(r, q) ? ROUTER_DISPATCH_WAIT : router_sched_dispatch(r, q, msg, n);
    if (status == ROUTER_DISPATCH_WAIT && !router_queue_push(r, q->rid)) {
        r->metrics.refused_limit[PRISM_REFUSE_QUEUE_FULL]++;
        req_fail(q, 429, "The server is at capacity; retry after a short wait.");
        return;
    }
    if (status != 0 && status != ROUTER_DISPATCH_WAIT) {
        req_fail(q, status, msg);
        return;
    }
    prism_http_req_set_user(h, q);
    prism_http_req_on_abort(h, on_client_gone, q);
    prism_log_ctx_t lc = {q->rid, q->trace};   /* its id is known from here */
    PRISM_LOGC(DEBUG, &lc, "request %llu: %zu prompt tokens, %d images (%d by URL, %.1f ms), max_tokens %d, n %d%s "
               "(id high half %016llx)", (unsigned long long)q->rid, q->prompt.n_tokens, q->prompt.n_images,
               q->prompt.n_urls, q->time.fetch_ms, q->prompt.max_tokens, router_req_n(q),
               q->guide.kind ? ", guided" : "", (unsigned long long)q->rid_hi);
}

/* The client left while its images downloaded. */
static void on_fetch_gone(prism_http_req_t *h, void *ud)
{
    (void)h;
    router_req_t *q = ud;
    q->r->n_preparing--;
    req_destroy(q);   /* cancels the downloads */
}

/* Its images by URL are in (or one failed: prep.status): the placeholders expanded on the loop (the
 * tokenizing was done on the pool), then admission. */
static void images_fetched(router_req_t *q)
{
    router_t *r = q->r;
    prism_log_ctx_t lc = {q->rid, q->trace};
    const prism_log_ctx_t *prev = prism_log_ctx_enter(&lc);
    prism_http_req_on_abort(q->h, NULL, NULL);
    if (!q->prep.status)
        q->prep.status = router_prompt_finish(r, &q->prompt, &q->oai, q->prep.msg, sizeof q->prep.msg);
    char msg[600] = "";
    prepared(r, q, 0, msg, sizeof msg, NULL);
    prism_log_ctx_leave(prev);
}

static void prep_done_req(uv_work_t *w, int wstatus);

/* The lines logged meanwhile are about q (a copy of its context: q may end). */
static void prep_done(uv_work_t *w, int wstatus)
{
    router_req_t *q = w->data;
    prism_log_ctx_t lc = {q->rid, q->trace};
    const prism_log_ctx_t *prev = prism_log_ctx_enter(&lc);
    prep_done_req(w, wstatus);
    prism_log_ctx_leave(prev);
}

static void prep_done_req(uv_work_t *w, int wstatus)
{
    router_req_t *q = w->data;
    router_t *r = q->r;
    prism_http_req_t *h = q->h;
    router_prompt_take_images(&q->prompt, h);   /* the prompt's from here, whatever happens next */
    if (q->prep.gone || wstatus != 0 || !r->http) {   /* the client left, or the router stopped meanwhile */
        r->n_preparing--;
        req_destroy(q);
        return;
    }
    prism_http_req_on_abort(h, NULL, NULL);
    if (!q->prep.parsed) {
        r->n_preparing--;
        refuse_unparsed(r, q);
        return;
    }
    char msg[600] = "", param[128] = "";
    int status = q->prep.check;   /* its model and output constraint (admit_check, on the thread) */
    if (status) {
        snprintf(msg, sizeof msg, "%s", q->prep.msg);
        snprintf(param, sizeof param, "%s", q->prep.param);
    }
    if (!status && !q->prep.status && q->prompt.n_urls) {
        /* still counted in n_preparing until images_fetched (or the client leaves) */
        prism_http_req_on_abort(h, on_fetch_gone, q);
        if (router_url_images_fetch(q, images_fetched) == PRISM_OK) return;
        prism_http_req_on_abort(h, NULL, NULL);
        snprintf(msg, sizeof msg, "The server is out of memory; try again shortly.");
        status = 503;
    }
    prepared(r, q, status, msg, sizeof msg, param);
}
