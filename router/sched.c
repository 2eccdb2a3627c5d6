/* Where a request runs: the messages its workers receive, the choice of its workers, and the router's
 * queue of requests that wait for one.
 *
 * A dispatch is two steps. The plan (plan) chooses a prefill, a decode and an encoder per image,
 * counting nothing and sending nothing: the registry's load, plus what the plan itself has put on
 * an encoder for the request's earlier images, decides. This is where a choice by cache contents
 * (an image's embedding cache today; a prompt prefix's KV tomorrow) or by KV room is made. The
 * commit (commit) then sends the messages built when the request was prepared, patched with what
 * the plan chose, and counts each worker's slots once, as its message is sent.
 *
 * The queue: requests accepted while every worker of a tier was at capacity (or a tier had none),
 * oldest first, tried again whenever a slot frees (requests.c router_dispatch_queued). */
#include "request.h"

#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------- the messages */

void router_sched_msgs_build(router_req_t *q)
{
    router_msgs_t *m = &q->msg;
    const prism_oai_request_t *o = &q->oai;
    Prism__Sampling *sp = &m->sampling;
    prism__sampling__init(sp);
    for (int i = 0; i < o->n_stop_token_ids; i++) m->stop_ids[i] = (int32_t)o->stop_token_ids[i];
    sp->temperature = o->greedy ? 0.0f : (float)o->temperature;
    sp->top_p = o->greedy ? 1.0f : (float)o->top_p;
    sp->top_k = (int32_t)o->top_k;
    sp->has_seed = o->has_seed;
    sp->seed = (uint64_t)o->seed;
    sp->max_tokens = (uint32_t)q->prompt.max_tokens;
    sp->n_stop_token_ids = (size_t)o->n_stop_token_ids;
    sp->stop_token_ids = m->stop_ids;
    sp->ignore_eos = o->ignore_eos;
    sp->logprobs = o->logprobs ? 1u + (uint32_t)o->top_logprobs : 0u;
    sp->presence_penalty = (float)o->presence_penalty;
    sp->frequency_penalty = (float)o->frequency_penalty;
    sp->repetition_penalty = (float)o->repetition_penalty;
    sp->n_logit_bias_ids = sp->n_logit_bias_values = (size_t)o->n_logit_bias;
    sp->logit_bias_ids = (int32_t *)o->logit_bias_ids;
    sp->logit_bias_values = (float *)o->logit_bias_values;
    sp->n = (uint32_t)router_req_n(q);
    sp->priority = o->priority;
    /* its arrival, on a clock every decode worker shares: among equal priorities the youngest is
     * preempted first (a preempted request keeps it: the same messages go again) */
    sp->arrival_us = (uint64_t)(prism_unix_time_us() - (int64_t)((prism_now_s() - q->time.start) * 1e6));
    if (q->guide.kind) {
        prism__guide__init(&m->guide);
        m->guide.kind = (Prism__GuideKind)q->guide.kind;
        m->guide.text = (char *)q->guide.text;
        m->guide.tool_name = (char *)(q->guide.tool_name ? q->guide.tool_name : "");
        m->guide.tool_parallel = q->guide.tool_parallel;
        m->guide.tool_format = (uint32_t)q->guide.tool_format;
        sp->guide = &m->guide;
    }
    for (int s = 0; s < q->prompt.n_images; s++) {
        prism__image_span__init(&m->spans[s]);
        m->spans[s].offset = q->prompt.img_offset[s];
        m->spans[s].n_tokens = q->prompt.img_span[s];
        m->spans[s].grid_rows = q->prompt.img_rows[s];   /* Qwen-VL: the LM-token grid (M-RoPE) */
        m->spans[s].grid_cols = q->prompt.img_cols[s];
        m->spans[s].content_hash = q->prompt.img_hash[s];   /* the image's identity in the prefix cache */
        m->span_ptrs[s] = &m->spans[s];
    }
    prism__prefill__init(&m->prefill);
    m->prefill.n_token_ids = q->prompt.n_tokens;
    m->prefill.token_ids = q->prompt.tokens;
    m->prefill.n_images = (size_t)q->prompt.n_images;
    m->prefill.images = m->span_ptrs;
    m->prefill.sampling = sp;
    m->prefill.cache_salt = (char *)o->cache_salt;
    prism__encode__init(&m->encode);
    prism__envelope__init(&m->env);
}

int router_sched_msgs_migrate(router_req_t *q)
{
    size_t n_prompt = q->prompt.n_tokens, n = n_prompt + (size_t)q->mig.n_gen;
    int32_t *ids = prism_realloc(q->msg.ids, n * sizeof *ids);
    if (!ids) return PRISM_ENOMEM;
    memcpy(ids, q->prompt.tokens, n_prompt * sizeof *ids);
    memcpy(ids + n_prompt, q->mig.gen, (size_t)q->mig.n_gen * sizeof *ids);
    q->msg.ids = ids;
    q->msg.prefill.token_ids = ids;
    q->msg.prefill.n_token_ids = n;
    q->msg.sampling.generated = (uint32_t)q->mig.n_gen;
    return PRISM_OK;
}

/* ---------------------------------------------------------------- workers given back */

/* A worker finished its part of a request: its slots may admit a queued one. */
static void worker_done(router_t *r, const char *id, int slots)
{
    router_worker_t *w = id[0] ? router_worker_by_id(r, id) : NULL;
    if (w) w->inflight = PRISM_MAX(w->inflight - slots, 0);
    if (w) w->completed++;  /* the status page's per-worker throughput */
    r->queue_dirty = true;
}

void router_sched_prefill_done(router_req_t *q)
{
    if (!q->place.prefill_pending) return;
    q->place.prefill_pending = false;
    worker_done(q->r, q->place.prefill_id, 1);
}

void router_sched_decode_done(router_req_t *q)
{
    if (!q->place.decode_pending) return;
    q->place.decode_pending = false;
    router_worker_t *w = q->place.decode_id[0] ? router_worker_by_id(q->r, q->place.decode_id) : NULL;
    if (w) w->kv_expect -= PRISM_MIN(w->kv_expect, q->place.kv_expect);
    q->place.kv_expect = 0;
    worker_done(q->r, q->place.decode_id, router_req_n(q));   /* each sequence took a slot */
}

/* An encoder finished (or dropped) the image: its slot and the file's bytes are free. */
void router_sched_encode_done(router_req_t *q, int i)
{
    if (!q->place.encode_pending[i]) return;
    router_worker_t *w = q->place.encoder_id[i][0] ? router_worker_by_id(q->r, q->place.encoder_id[i]) : NULL;
    if (w) w->queued_bytes -= PRISM_MIN(w->queued_bytes, (uint64_t)q->prompt.img_len[i]);
    q->place.encode_pending[i] = false;
    worker_done(q->r, q->place.encoder_id[i], 1);
}

void router_sched_encode_let_go(router_req_t *q, int i)
{
    if (!q->place.encode_pending[i]) return;
    const router_worker_t *w = q->place.encoder_id[i][0] ? router_worker_by_id(q->r, q->place.encoder_id[i]) : NULL;
    if (w) router_worker_note_let_go(q->r, w, q->rid, q->rid_hi, (uint32_t)i);   /* one gone never answers */
    router_sched_encode_done(q, i);
}

/* The prefill always hears it (after its first token it may still hold the KV export); the decode
 * only while it may hold or still receive the request: a decode remembers aborts for requests it
 * has not seen (their KV may be on its way), so it is not told about requests that ended without it. */
void router_sched_abort(router_req_t *q)
{
    router_t *r = q->r;
    const router_placement_t *pl = &q->place;
    for (int i = 0; i < q->prompt.n_images; i++)
        if (pl->encode_pending[i]) {
            router_send_abort_to(r, pl->encoder_id[i], q->rid);
            /* its adoption may wait behind the batch that runs the early job: that one by its own id */
            if (pl->early_id[i]) router_send_abort_to(r, pl->encoder_id[i], pl->early_id[i]);
        }
    router_send_abort_to(r, pl->prefill_id, q->rid);
    if (pl->decode_pending) router_send_abort_to(r, pl->decode_id, q->rid);
    if (pl->mig_from[0]) router_send_abort_to(r, pl->mig_from, q->rid);   /* it may hold the KV still */
}

void router_sched_release(router_req_t *q)
{
    router_placement_t *pl = &q->place;
    router_sched_abort(q);
    for (int i = 0; i < q->prompt.n_images; i++) {
        router_sched_encode_let_go(q, i);   /* its answer for the old id is still timed */
        pl->encoder_id[i][0] = '\0';
        pl->early_id[i] = 0;
    }
    router_sched_prefill_done(q);
    router_sched_decode_done(q);
    pl->prefill_id[0] = pl->decode_id[0] = pl->mig_from[0] = '\0';
    router_req_drop_held(q);   /* the old attempt's decode tokens */
    router_req_rekey(q->r, q);
}

bool router_sched_holds(const router_req_t *q, const router_worker_t *w)
{
    const router_placement_t *pl = &q->place;
    bool held = (pl->prefill_pending && !strcmp(pl->prefill_id, w->id)) ||
                (pl->decode_pending && !strcmp(pl->decode_id, w->id)) || (pl->mig_from[0] && !strcmp(pl->mig_from, w->id));
    for (int k = 0; k < q->prompt.n_images; k++) held |= pl->encode_pending[k] && !strcmp(pl->encoder_id[k], w->id);
    return held;
}

/* ---------------------------------------------------------------- plan */

/* KV blocks a decode worker needs for the request's n sequences at their longest (its admission
 * rule for requests that reserve). */
static uint64_t decode_blocks_needed(const router_worker_t *w, const router_req_t *q)
{
    return router_kv_blocks(w, q->prompt.n_tokens, (uint64_t)q->prompt.max_tokens, router_req_n(q));
}

/* Tokens each sequence of this attempt is expected to add on its decode worker: what max_tokens
 * leaves it (after a migration or preemption the tokens generated are in its prompt), or, unless it
 * ignores EOS, the router's running mean of an answer's length when that is less. n > 1 reserves
 * what max_tokens leaves at decode admission: that. */
static uint64_t kv_more(const router_t *r, const router_req_t *q)
{
    uint64_t left = (uint64_t)PRISM_MAX(q->prompt.max_tokens - (int)q->msg.sampling.generated, 1);
    double est = r->answer_est > 0 ? r->answer_est : ROUTER_ANSWER_EST_DEFAULT;
    return q->oai.ignore_eos || router_req_n(q) > 1 ? left : PRISM_MIN(left, (uint64_t)est + 1);
}

void router_sched_note_answer(router_t *r, int tokens)
{
    /* a mean over about the last 16 answers: follows a change of load within a few dozen requests */
    double x = PRISM_MAX(tokens, 1);
    r->answer_est = r->answer_est > 0 ? r->answer_est + (x - r->answer_est) / 16 : x;
}

/* Whether some registered decode worker could ever hold the request (batch and KV). */
static bool decode_fits(const router_t *r, const router_req_t *q, char *msg, size_t n)
{
    uint32_t best_running = 0;
    uint64_t best_blocks = 0;
    int n_seq = router_req_n(q);
    for (int i = 0; i < ROUTER_MAX_WORKERS; i++) {
        const router_worker_t *w = &r->workers[i];
        if (!w->used || w->role != PRISM__ROLE__ROLE_DECODE) continue;
        if (w->max_running >= (uint32_t)n_seq && decode_blocks_needed(w, q) <= w->kv_blocks) return true;
        best_running = PRISM_MAX(best_running, w->max_running);
        best_blocks = PRISM_MAX(best_blocks, (uint64_t)w->kv_blocks);
    }
    if (best_running < (uint32_t)n_seq)
        snprintf(msg, n, "n=%d is more than the decode workers run at once (%u).", n_seq, best_running);
    else
        snprintf(msg, n, "n=%d sequences of up to %d tokens need more KV cache than a decode worker has (%llu blocks); "
                 "lower n or max_tokens.", n_seq, q->prompt.max_tokens, (unsigned long long)best_blocks);
    return false;
}

/* The prompt's prefix-cache keys for the block size of the registered prefill workers (the first
 * one's: a cluster runs one), kept until the prompt or that size changes. False without them (no
 * prefill worker, no memory: the pick goes by load and every image is encoded). */
static bool prefix_keys(router_t *r, router_req_t *q)
{
    router_msgs_t *m = &q->msg;
    uint32_t bs = 0;
    for (int i = 0; i < ROUTER_MAX_WORKERS && !bs; i++)
        if (r->workers[i].used && r->workers[i].role == PRISM__ROLE__ROLE_PREFILL) bs = r->workers[i].block_size;
    if (!bs) return false;
    size_t n_tok = m->prefill.n_token_ids;
    if (m->key_block_size == bs && m->keys_for == n_tok) return true;
    int n = (int)(n_tok / bs);
    prism_kv_key_t *keys = prism_realloc(m->keys, sizeof(*keys) * (size_t)PRISM_MAX(n, 1));
    if (keys) m->keys = keys;
    uint8_t *bytes = keys ? prism_realloc(m->key_bytes, (size_t)PRISM_MAX(n, 1) * PRISM_KV_PREFIX_KEY_BYTES) : NULL;
    if (bytes) m->key_bytes = bytes;
    m->key_block_size = 0;
    if (!keys || !bytes) return false;
    prism_kv_image_t img[ROUTER_MAX_IMAGES];
    const router_prompt_t *p = &q->prompt;
    for (int i = 0; i < p->n_images; i++)
        img[i] = (prism_kv_image_t){p->img_offset[i], p->img_span[i], p->img_rows[i], p->img_cols[i], p->img_hash[i]};
    const char *salt = q->oai.cache_salt;
    m->n_keys = prism_kv_prefix_chain(r->prefix_secret, (int)bs, salt, strlen(salt), m->prefill.token_ids, (int)n_tok,
                                      img, p->n_images, m->keys);
    prism_kv_prefix_keys_put(m->keys, m->n_keys, m->key_bytes);
    /* what a prefill looks up (prefill_worker run_req): never the last token's block, nothing from an
     * image without identity on */
    m->n_lookup = PRISM_MIN(m->n_keys, (int)((n_tok - 1) / bs));
    for (int i = 0; i < p->n_images; i++)
        if (!p->img_hash[i]) m->n_lookup = PRISM_MIN(m->n_lookup, (int)(p->img_offset[i] / bs));
    m->key_block_size = bs;
    m->keys_for = n_tok;
    return true;
}

/* The workers one attempt goes to. */
typedef struct {
    router_worker_t *prefill, *decode;
    bool skip[ROUTER_MAX_IMAGES];        /* sent to no encoder: the prefill's prefix cache covers its span */
    router_worker_t *enc[ROUTER_MAX_IMAGES];
    uint64_t early[ROUTER_MAX_IMAGES];   /* the early job image i's Encode adopts (its slot is counted), 0 none */
    const char *waiting_for;             /* a tier with no worker at all */
    unsigned wait_tiers;                 /* ROUTER_TIER_* without room */
} plan_t;

/* The least loaded worker of the role with room, passing over the workers an earlier attempt of the
 * request got stuck on while another has room; planned: what this plan already puts on workers. */
static router_worker_t *pick(router_t *r, const router_req_t *q, Prism__Role role, uint64_t hash, int slots,
                             uint64_t bytes, const router_load_t *planned, int n_planned, bool *any)
{
    router_want_t want = {.role = role, .prefer_hash = hash, .slots = slots, .bytes = bytes, .planned = planned,
                          .n_planned = n_planned, .avoid = q->place.avoid, .n_avoid = q->place.n_avoid};
    return router_pick_want(r, &want, any);
}

/* Chooses the attempt's workers: 0 (every tier has room), ROUTER_DISPATCH_WAIT, or 400 with msg (n
 * sequences no registered decode worker could ever hold never get room). Counts and sends nothing. */
static int plan(router_t *r, const router_req_t *q, plan_t *p, char *msg, size_t n)
{
    bool any_pf, any_dc, any_enc = true, enc_room = true;
    router_load_t planned[ROUTER_MAX_IMAGES];
    int n_planned = 0;
    memset(p, 0, sizeof *p);
    const router_msgs_t *m = &q->msg;
    router_want_t want = {.role = PRISM__ROLE__ROLE_PREFILL, .slots = 1, .avoid = q->place.avoid,
                          .n_avoid = q->place.n_avoid};
    if (m->key_block_size && m->keys_for == m->prefill.n_token_ids) {   /* the longest cached prefix, within the slack */
        want.prefix_keys = m->keys;
        want.n_prefix_keys = m->n_lookup;
        want.prefix_block_size = m->key_block_size;
    }
    p->prefill = router_pick_want(r, &want, &any_pf);
    /* Images wholly inside the prefix it holds need no encoder: their KV is read, not computed. */
    int hit = p->prefill && !q->place.no_skip
                  ? router_worker_prefix_hit(p->prefill, want.prefix_keys, want.n_prefix_keys, want.prefix_block_size)
                  : 0;
    for (int i = 0; i < q->prompt.n_images; i++)
        p->skip[i] = q->prompt.img_hash[i] &&
                     (uint64_t)q->prompt.img_offset[i] + q->prompt.img_span[i] <= (uint64_t)hit * m->key_block_size;
    /* decode: by KV room after the request and the expected growth of what runs there */
    router_want_t dw = {.role = PRISM__ROLE__ROLE_DECODE, .slots = router_req_n(q), .avoid = q->place.avoid,
                        .n_avoid = q->place.n_avoid, .kv_prompt = q->msg.prefill.n_token_ids, .kv_more = kv_more(r, q)};
    p->decode = router_pick_want(r, &dw, &any_dc);
    for (int i = 0; i < q->prompt.n_images && enc_room; i++) {
        if (p->skip[i]) continue;
        uint64_t hash = q->prompt.img_hash[i];
        /* an early job of this image still held: the request takes it over (its slot is counted) */
        if ((p->enc[i] = router_early_claim(r, hash, p->early, i, &p->early[i]))) continue;
        p->enc[i] = pick(r, q, PRISM__ROLE__ROLE_ENCODER, hash, 1, q->prompt.img_len[i], planned, n_planned, &any_enc);
        if (p->enc[i]) planned[n_planned++] = (router_load_t){p->enc[i], 1, q->prompt.img_len[i]};  /* the next image sees it */
        else enc_room = false;
    }
    /* A tier with no worker at all waits too (bounded by --max-queue-wait): a restarted worker
     * re-registers within seconds, and the request is served then instead of refused now. */
    p->waiting_for = !any_pf ? "prefill" : !any_dc ? "decode" : !any_enc ? "encoder" : NULL;
    if (any_dc && !decode_fits(r, q, msg, n)) return 400;
    p->wait_tiers = (p->prefill ? 0 : ROUTER_TIER_PREFILL) | (p->decode ? 0 : ROUTER_TIER_DECODE) |
                    (enc_room ? 0 : ROUTER_TIER_ENCODER);
    return p->wait_tiers ? ROUTER_DISPATCH_WAIT : 0;
}

/* ---------------------------------------------------------------- commit */

/* Sends image i's Encode to its planned encoder and counts it there: false when unreachable. */
static bool send_encode(router_t *r, router_req_t *q, const plan_t *p, int i)
{
    router_msgs_t *m = &q->msg;
    router_worker_t *enc = p->enc[i];
    m->encode.image_index = (uint32_t)i;
    m->encode.content_hash = q->prompt.img_hash[i];
    m->encode.prefill_endpoint = p->prefill->data_endpoint;
    m->encode.min_pixels = q->prompt.min_pixels;   /* mm_processor_kwargs (max_pixels 0: none) */
    m->encode.max_pixels = q->prompt.max_pixels;
    /* a done early job of this image there: named too, so the encoder counts no hit for it */
    m->encode.early_id = p->early[i] ? p->early[i] : router_early_take_done(r, q->prompt.img_hash[i], enc);
    m->encode.priority = q->oai.priority;   /* the encoder's queue order, as the router's */
    m->env.type = PRISM__MSG_TYPE__MSG_ENCODE;
    m->env.prefill = NULL;
    m->env.encode = &m->encode;
    /* the kept bytes, by reference: a retry on another encoder sends them again (and a migration:
     * they are let go at the first token only when no migration may follow) */
    PRISM_ASSERT(q->prompt.img[i]);
    prism_frame_t f = router_prompt_image_frame(&q->prompt, i);   /* by reference: no copy */
    if (router_send(r, enc, &m->env, &f, 1) != PRISM_OK) {
        PRISM_WARN("request %llu: encoder %s unreachable; the request waits", (unsigned long long)q->rid, enc->id);
        return false;
    }
    snprintf(q->place.encoder_id[i], sizeof(q->place.encoder_id[i]), "%s", enc->id);
    q->place.encode_pending[i] = true;
    q->place.early_id[i] = p->early[i];
    if (p->early[i]) {
        router_early_adopted(r, p->early[i]);   /* its slot and bytes, counted already, are this image's */
    } else {
        enc->inflight++;
        enc->queued_bytes += q->prompt.img_len[i];
    }
    router_worker_note_image(enc, q->prompt.img_hash[i]);
    return true;
}

/* Sends the planned attempt and counts each worker once: 0, or ROUTER_DISPATCH_WAIT when a worker
 * could not be reached (its connection is gone; the registry drops it at --worker-timeout): the
 * request waits for the next try rather than failing. */
static int commit(router_t *r, router_req_t *q, const plan_t *p)
{
    router_msgs_t *m = &q->msg;
    router_placement_t *pl = &q->place;
    /* the time it is handed over: taken before the first send, as the prefill may start at once */
    double now = prism_now_s();
    /* Prefill first: it must know the request before embeddings can be used (either order works). */
    m->prefill.decode_endpoint = p->decode->data_endpoint;
    m->env.type = PRISM__MSG_TYPE__MSG_PREFILL;
    m->env.request_id = q->rid;
    m->env.request_id_hi = q->rid_hi;
    m->env.trace_id_hi = q->trace.hi;   /* the Encode messages share this envelope */
    m->env.trace_id_lo = q->trace.lo;
    m->env.prefill = &m->prefill;
    m->env.encode = NULL;
    /* the keys it keeps blocks under, so every router's index reads its events (same block size only) */
    bool keys = m->key_block_size && m->key_block_size == p->prefill->block_size &&
                m->keys_for == m->prefill.n_token_ids;
    m->prefill.block_keys = (ProtobufCBinaryData){keys ? (size_t)m->n_keys * PRISM_KV_PREFIX_KEY_BYTES : 0,
                                                  keys ? m->key_bytes : NULL};
    for (int i = 0; i < q->prompt.n_images; i++) m->spans[i].cached = p->skip[i];
    if (router_send(r, p->prefill, &m->env, NULL, 0) != PRISM_OK) {
        PRISM_WARN("request %llu: prefill worker %s unreachable; the request waits", (unsigned long long)q->rid,
                   p->prefill->id);
        return ROUTER_DISPATCH_WAIT;
    }
    PRISM_DEBUG("request %llu (%s): sent to prefill worker %s", (unsigned long long)q->rid, q->out.meta.id,
                p->prefill->id);
    snprintf(pl->prefill_id, sizeof(pl->prefill_id), "%s", p->prefill->id);
    snprintf(pl->decode_id, sizeof(pl->decode_id), "%s", p->decode->id);
    pl->prefill_pending = pl->decode_pending = true;
    p->prefill->inflight++;
    p->decode->inflight += router_req_n(q);   /* each sequence takes a slot of the decode batch */
    /* its KV as the decode pick expects it (router_kv_room), until the decode is done with it */
    uint64_t prompt = q->msg.prefill.n_token_ids;
    pl->kv_expect = router_kv_blocks(p->decode, prompt, kv_more(r, q), router_req_n(q));
    p->decode->kv_expect += pl->kv_expect;
    p->decode->kv_sent += router_kv_blocks(p->decode, prompt, 1, router_req_n(q));
    for (int i = 0; i < q->prompt.n_images; i++)
        if (!p->skip[i] && !send_encode(r, q, p, i)) {
            router_sched_release(q);
            return ROUTER_DISPATCH_WAIT;
        }
    for (int i = 0; i < q->prompt.n_images; i++)
        if (p->skip[i]) {
            r->metrics.encoder_skips++;
            router_worker_note_image(p->prefill, q->prompt.img_hash[i]);   /* no early encode of it (early_encode.c) */
        }
    q->stage = STAGE_SENT;
    q->time.dispatch = now;
    if (!q->time.sent) q->time.sent = now;
    pl->attempts++;
    return 0;
}

int router_sched_dispatch(router_t *r, router_req_t *q, char *msg, size_t n)
{
    plan_t p;
    prefix_keys(r, q);   /* for the prefill pick and the encoder skip (none: by load, every image encoded) */
    int status = plan(r, q, &p, msg, n);
    /* An admitted request comes before early jobs (early_encode.c): when encoders alone lack room,
     * the slots running early jobs hold are taken for it, one at a time, while that helps. */
    while (status == ROUTER_DISPATCH_WAIT && p.wait_tiers == ROUTER_TIER_ENCODER &&
           router_early_preempt(r, q->prompt.img_hash, q->prompt.n_images))
        status = plan(r, q, &p, msg, n);
    q->place.waiting_for = p.waiting_for;
    if (status == 400) {
        r->metrics.refused_limit[PRISM_REFUSE_BAD_REQUEST]++;
        return 400;
    }
    q->place.wait_tiers = p.wait_tiers;
    if (status == ROUTER_DISPATCH_WAIT) {
        PRISM_DEBUG("request %llu waits: %s", (unsigned long long)q->rid,
                    !p.prefill ? "no prefill worker with room" : !p.decode ? "no decode worker with room"
                    : "no encoder with room");
        return ROUTER_DISPATCH_WAIT;
    }
    return commit(r, q, &p);
}

/* ---------------------------------------------------------------- the queue */

/* The tiers a request needs: every request a prefill and a decode worker, an image request encoders. */
unsigned router_sched_tiers(const router_req_t *q)
{
    return ROUTER_TIER_PREFILL | ROUTER_TIER_DECODE | (q->prompt.n_images ? ROUTER_TIER_ENCODER : 0);
}

bool router_queue_push(router_t *r, uint64_t rid)
{
    if (r->queue_len == r->reqs_cap) return false;
    r->queue[(r->queue_head + r->queue_len) % r->reqs_cap] = rid;
    r->queue_len++;
    return true;
}

bool router_queue_push_front(router_t *r, uint64_t rid)
{
    if (r->queue_len == r->reqs_cap) return false;
    r->queue_head = (r->queue_head + r->reqs_cap - 1) % r->reqs_cap;
    r->queue[r->queue_head] = rid;
    r->queue_len++;
    return true;
}

/* The queue taken out (r->queue_scratch[0, n)) in the order it is tried: by `priority` (lower
 * first), oldest first among equals. A stable insertion sort: the queue goes back in this order, so
 * it is sorted but for the requests queued since (each costs at most one pass). */
void router_queue_order(router_t *r, size_t n)
{
    for (size_t k = 1; k < n; k++) {
        uint64_t rid = r->queue_scratch[k];
        const router_req_t *q = router_req_get(r, rid);
        int32_t p = q ? q->oai.priority : 0;
        size_t j = k;
        for (; j > 0; j--) {
            const router_req_t *o = router_req_get(r, r->queue_scratch[j - 1]);
            if ((o ? o->oai.priority : 0) <= p) break;
            r->queue_scratch[j] = r->queue_scratch[j - 1];
        }
        r->queue_scratch[j] = rid;
    }
}

bool router_queue_blocks(router_t *r, const router_req_t *q)
{
    unsigned blocked = 0;
    for (size_t k = 0; k < r->queue_len; k++) {
        const router_req_t *o = router_req_get(r, r->queue[(r->queue_head + k) % r->reqs_cap]);
        if (o && o->stage == STAGE_QUEUED) blocked |= o->place.wait_tiers ? o->place.wait_tiers : router_sched_tiers(o);
        if (blocked & (ROUTER_TIER_PREFILL | ROUTER_TIER_DECODE)) return true;
    }
    return (blocked & router_sched_tiers(q)) != 0;
}
