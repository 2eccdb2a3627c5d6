/* The life of one generation request inside the router.
 *
 *   HTTP body -> parse/validate -> limits -> the prompt (prompt.c: images, chat template, tokens,
 *   image spans) -> pick encoder(s)/prefill/decode (or wait in the router's queue) -> Prefill to
 *   prefill, Encode to encoder(s) -> first token from
 *   prefill, the rest from decode -> incremental detokenization, stop strings -> SSE chunks or one
 *   JSON response -> usage, metrics, abort to the workers if we stopped early or the client left.
 *
 * Everything a request owns is freed in req_destroy; the HTTP request is released exactly once. */
#include "router.h"
#include "openai_req.h"
#include "openai_write.h"

#include <stdio.h>
#include <string.h>
#include <xxhash.h>

typedef enum { STAGE_QUEUED, STAGE_SENT, STAGE_PREFILLED } stage_t;

struct router_req {
    uint64_t rid;
    router_t *r;
    prism_http_req_t *h;          /* NULL once released */
    prism_oai_request_t oai;
    prism_oai_resp_meta_t meta;
    bool chat;
    router_prompt_t prompt;       /* images, tokens, image spans, max_tokens (prompt.c) */
    char encoder_id[ROUTER_MAX_IMAGES][128];
    bool encode_pending[ROUTER_MAX_IMAGES];
    bool bytes_counted;           /* prompt.image_bytes added to the router's in-flight total */
    /* workers */
    char prefill_id[128], decode_id[128];
    bool prefill_pending, decode_pending;
    Prism__Envelope **held;       /* decode Tokens that arrived before the prefill's, in order */
    int n_held, held_cap;
    /* generation */
    stage_t stage;
    int attempts;                 /* dispatches so far; a retry is one more (bounded by --max-retries) */
    char avoid[4][128];           /* workers an earlier attempt got stuck on: others first */
    int n_avoid;
    const char *waiting_for;      /* while queued because a tier has no worker at all: its name */
    int n_out;
    prism_detok_t detok;
    prism_buf_t text;             /* generated text so far (after stop-string truncation) */
    size_t emitted;               /* bytes of text already streamed */
    prism_oai_logprobs_t lp;
    bool streaming_started;
    double t_start, t_first, t_last;
    double t_dispatch;            /* when the current attempt was sent (per-stage deadline) */
    float decode_ms, vit_ms, queue_ms, prefill_ms;  /* worker-side timings (sums over images) */
    int cache_hits;
    prism_buf_t out;              /* scratch for response bytes */
    prism_buf_t tok_bytes[21];    /* scratch for one token's logprob entry: [0] chosen, [1..] top */
};

/* ---------------------------------------------------------------- request map (open addressing) */

static size_t slot_of(uint64_t rid, size_t cap) { return (size_t)(XXH3_64bits(&rid, sizeof(rid)) & (cap - 1)); }

router_req_t *router_req_get(router_t *r, uint64_t rid)
{
    if (!r->reqs_cap) return NULL;
    for (size_t i = slot_of(rid, r->reqs_cap), k = 0; k < r->reqs_cap; i = (i + 1) & (r->reqs_cap - 1), k++) {
        router_req_t *q = r->reqs[i];
        if (!q) return NULL;
        if (q->rid == rid) return q;
    }
    return NULL;
}

int router_req_new_id(router_t *r, uint64_t *out)
{
    /* Unguessable: a peer inside the trust boundary cannot aim messages at a request it was not
     * given. Unique among the requests in flight; never 0. */
    do {
        if (prism_random_bytes(out, sizeof(*out)) != PRISM_OK) return PRISM_EIO;
    } while (*out == 0 || router_req_get(r, *out));
    return PRISM_OK;
}

int router_req_put(router_t *r, uint64_t rid, router_req_t *q)
{
    if ((r->n_reqs + 1) * 2 > r->reqs_cap) return PRISM_ELIMIT;  /* sized at start-up from --max-running */
    size_t i = slot_of(rid, r->reqs_cap);
    while (r->reqs[i]) i = (i + 1) & (r->reqs_cap - 1);
    r->reqs[i] = q;
    r->n_reqs++;
    return PRISM_OK;
}

void router_req_del(router_t *r, uint64_t rid)
{
    size_t cap = r->reqs_cap, i = slot_of(rid, cap);
    while (r->reqs[i] && r->reqs[i]->rid != rid) i = (i + 1) & (cap - 1);
    if (!r->reqs[i]) return;
    r->reqs[i] = NULL;
    r->n_reqs--;
    /* Backward-shift deletion keeps probe chains intact without tombstones. */
    for (size_t j = (i + 1) & (cap - 1); r->reqs[j]; j = (j + 1) & (cap - 1)) {
        router_req_t *q = r->reqs[j];
        size_t home = slot_of(q->rid, cap);
        bool between = (i <= j) ? (home > i && home <= j) : (home > i || home <= j);
        if (!between) {
            r->reqs[i] = q;
            r->reqs[j] = NULL;
            i = j;
        }
    }
}

/* ---------------------------------------------------------------- helpers */

/* A worker finished its part of a request: its slot may admit a queued one. */
static void worker_done(router_t *r, const char *id)
{
    router_worker_t *w = id[0] ? router_worker_by_id(r, id) : NULL;
    if (w && w->inflight > 0) w->inflight--;
    r->queue_dirty = true;
}

/* An encoder finished (or dropped) image i of q: its slot and the file's bytes are free. */
static void encoder_done(router_t *r, router_req_t *q, int i)
{
    router_worker_t *w = q->encoder_id[i][0] ? router_worker_by_id(r, q->encoder_id[i]) : NULL;
    if (w) w->queued_bytes -= PRISM_MIN(w->queued_bytes, (uint64_t)q->prompt.img_len[i]);
    q->encode_pending[i] = false;
    worker_done(r, q->encoder_id[i]);
}

static void send_abort(router_t *r, const char *worker_id, uint64_t rid)
{
    router_worker_t *w = worker_id[0] ? router_worker_by_id(r, worker_id) : NULL;
    if (!w) return;
    Prism__Abort a = PRISM__ABORT__INIT;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_ABORT;
    env.request_id = rid;
    env.abort = &a;
    router_send(r, w, &env, NULL, 0);
}

static void req_destroy(router_req_t *q)
{
    router_t *r = q->r;
    router_req_del(r, q->rid);
    for (int i = 0; i < q->prompt.n_images; i++)
        if (q->encode_pending[i]) encoder_done(r, q, i);
    if (q->prefill_pending) worker_done(r, q->prefill_id);
    if (q->decode_pending) worker_done(r, q->decode_id);
    if (q->bytes_counted) r->image_bytes_inflight -= q->prompt.image_bytes;
    if (q->h) {
        prism_http_req_set_user(q->h, NULL);
        prism_http_req_release(q->h);
    }
    prism_oai_request_free(&q->oai);
    prism_oai_resp_meta_free(&q->meta);
    prism_detok_free(&q->detok);
    prism_oai_logprobs_free(&q->lp);
    prism_buf_free(&q->text);
    prism_buf_free(&q->out);
    for (size_t i = 0; i < PRISM_ARRAY_LEN(q->tok_bytes); i++) prism_buf_free(&q->tok_bytes[i]);
    router_prompt_free(&q->prompt);
    for (int i = 0; i < q->n_held; i++) prism_msg_env_free(q->held[i]);
    prism_free(q->held);
    prism_free(q);
}

/* Aborts every worker still holding this request (after a stop string, an error or a client
 * that went away). The prefill always hears it (after its first token it may still hold the KV
 * export); the decode only while it may hold or still receive the request: a decode remembers
 * aborts for requests it has not seen (their KV may be on its way), so it is not told about
 * requests that ended without it. */
static void abort_workers(router_req_t *q)
{
    for (int i = 0; i < q->prompt.n_images; i++)
        if (q->encode_pending[i]) send_abort(q->r, q->encoder_id[i], q->rid);
    send_abort(q->r, q->prefill_id, q->rid);
    if (q->decode_pending) send_abort(q->r, q->decode_id, q->rid);
}

static void respond_error(prism_http_req_t *h, int status, const char *message, const char *param)
{
    const char *type = status == 404 ? "NotFoundError" : status == 401 ? "AuthenticationError"
                     : status == 413 ? "RequestEntityTooLargeError" : status == 429 ? "RateLimitError"
                     : status == 503 ? "ServiceUnavailableError" : status >= 500 ? "InternalServerError"
                     : "BadRequestError";
    const char *extra = (status == 429 || status == 503) ? "Retry-After: 1\r\n" : NULL;
    prism_http_respond_error(h, status, type, message, param, NULL, extra);
}

/* Ends a request that failed after it was accepted. */
static void req_fail(router_req_t *q, int status, const char *message)
{
    router_t *r = q->r;
    r->metrics.failed++;
    abort_workers(q);
    if (q->h && !prism_http_req_aborted(q->h)) {
        if (q->streaming_started) {
            prism_buf_reset(&q->out);
            prism_oai_write_sse_error(&q->out, status >= 500 ? "InternalServerError" : "BadRequestError", message,
                                      NULL, NULL);
            prism_oai_write_sse_done(&q->out);
            prism_http_stream_write(q->h, q->out.data, q->out.len);
            prism_http_stream_end(q->h);
        } else {
            respond_error(q->h, status, message, NULL);
        }
    }
    req_destroy(q);
}

/* ---------------------------------------------------------------- streaming and completion */

static bool stream_begin(router_req_t *q)
{
    if (q->streaming_started) return true;
    char extra[128];
    snprintf(extra, sizeof(extra), "Cache-Control: no-cache\r\nx-request-id: %s\r\n", q->meta.id);
    if (prism_http_stream_begin(q->h, 200, "text/event-stream", extra) != PRISM_OK) return false;
    q->streaming_started = true;
    if (q->chat) {
        /* vLLM's first chunk: the role with empty content. */
        prism_buf_reset(&q->out);
        prism_oai_write_chat_chunk(&q->out, &q->meta, true, "", 0, NULL, NULL);
        prism_http_stream_write(q->h, q->out.data, q->out.len);
    }
    return true;
}

/* Streams text[emitted .. upto) (and pending logprobs) as one chunk. */
static void stream_chunk(router_req_t *q, size_t upto, const char *finish)
{
    if (!q->h || !stream_begin(q)) return;
    const char *t = q->text.data ? q->text.data + q->emitted : "";
    size_t n = upto - q->emitted;
    if (!n && !finish && q->lp.n_tokens == 0) return;
    const prism_oai_logprobs_t *lp = q->oai.logprobs && q->lp.n_tokens ? &q->lp : NULL;
    prism_buf_reset(&q->out);
    if (q->chat)
        prism_oai_write_chat_chunk(&q->out, &q->meta, false, n || !finish ? t : NULL, n, lp, finish);
    else
        prism_oai_write_completion_chunk(&q->out, &q->meta, t, n, lp, finish);
    prism_http_stream_write(q->h, q->out.data, q->out.len);
    q->emitted = upto;
    if (lp) prism_oai_logprobs_clear(&q->lp);
    if (prism_http_req_pending_bytes(q->h) > q->r->max_stream_pending) {
        /* The client stopped reading: drop it rather than queue its whole answer in memory. Its
         * abort callback (on_client_gone) runs from the loop's next turn and aborts the workers. */
        q->r->metrics.refused_limit[PRISM_REFUSE_SLOW_CLIENT]++;
        PRISM_WARN("request %llu: client stopped reading (%zu bytes queued); dropped", (unsigned long long)q->rid,
                   prism_http_req_pending_bytes(q->h));
        prism_http_req_drop(q->h);
    }
}

/* "x-prism-timing" response header and log line: where the time of this request went. */
static void timing_line(const router_req_t *q, double now, char *out, size_t n)
{
    double ttft = q->t_first > 0 ? (q->t_first - q->t_start) * 1e3 : 0;
    double dec_s = q->t_last - q->t_first;
    double tps = q->n_out > 1 && dec_s > 0 ? (q->n_out - 1) / dec_s : 0;
    snprintf(out, n, "images=%d cache_hits=%d image_decode_ms=%.2f vit_ms=%.2f queue_ms=%.2f prefill_ms=%.2f "
             "ttft_ms=%.2f decode_tokens=%d decode_tok_s=%.1f e2e_ms=%.2f", q->prompt.n_images, q->cache_hits, q->decode_ms,
             q->vit_ms, q->queue_ms, q->prefill_ms, ttft, q->n_out > 0 ? q->n_out - 1 : 0, tps, (now - q->t_start) * 1e3);
}

static void req_complete(router_req_t *q, const char *finish)
{
    router_t *r = q->r;
    double now = prism_now_s();
    char timing[400];
    timing_line(q, now, timing, sizeof(timing));
    PRISM_DEBUG("request %llu done (%s, %zu prompt tokens): %s", (unsigned long long)q->rid, finish, q->prompt.n_tokens, timing);
    prism_oai_usage_t u = {.prompt_tokens = (int64_t)q->prompt.n_tokens, .completion_tokens = q->n_out, .cached_tokens = -1};
    if (q->h && !prism_http_req_aborted(q->h)) {
        if (q->oai.stream) {
            stream_chunk(q, q->text.len, finish);
            prism_buf_reset(&q->out);
            if (q->oai.include_usage) prism_oai_write_usage_chunk(&q->out, &q->meta, &u);
            prism_oai_write_sse_done(&q->out);
            prism_http_stream_write(q->h, q->out.data, q->out.len);
            prism_http_stream_end(q->h);
        } else {
            const prism_oai_logprobs_t *lp = q->oai.logprobs ? &q->lp : NULL;
            prism_buf_reset(&q->out);
            if (q->chat)
                prism_oai_write_chat_response(&q->out, &q->meta, q->text.data ? q->text.data : "", q->text.len, lp,
                                              finish, &u);
            else
                prism_oai_write_completion_response(&q->out, &q->meta, q->text.data ? q->text.data : "", q->text.len,
                                                    lp, finish, &u);
            char extra[600];
            if (r->timing_header)
                snprintf(extra, sizeof(extra), "x-request-id: %s\r\nx-prism-timing: %s\r\n", q->meta.id, timing);
            else
                snprintf(extra, sizeof(extra), "x-request-id: %s\r\n", q->meta.id);
            prism_http_respond(q->h, 200, "application/json", extra, q->out.data, q->out.len);
        }
    }
    r->metrics.prompt_tokens += q->prompt.n_tokens;
    r->metrics.generation_tokens += (uint64_t)q->n_out;
    prism_hist_observe(&r->metrics.e2e, now - q->t_start);
    if (!strcmp(finish, "stop")) r->metrics.success_stop++;
    else r->metrics.success_length++;
    if (q->n_out > 1 && q->t_first > 0)
        prism_hist_observe(&r->metrics.itl, (q->t_last - q->t_first) / (q->n_out - 1));
    abort_workers(q);
    req_destroy(q);
}

/* Longest suffix of the text that is a prefix of some stop string: hold it back while streaming. */
static size_t stop_holdback(const router_req_t *q)
{
    size_t best = 0;
    for (int i = 0; i < q->oai.n_stop; i++) {
        size_t sl = q->oai.stop_len[i];
        for (size_t k = PRISM_MIN(sl - 1, q->text.len); k > best; k--)
            if (!memcmp(q->text.data + q->text.len - k, q->oai.stop[i], k)) { best = k; break; }
    }
    return best;
}

/* Searches the newly added text for a stop string; truncates and returns true on a hit. */
static bool apply_stop_strings(router_req_t *q, size_t old_len)
{
    if (!q->oai.n_stop || !q->text.len) return false;
    size_t hit = SIZE_MAX;
    for (int i = 0; i < q->oai.n_stop; i++) {
        size_t sl = q->oai.stop_len[i];
        size_t from = old_len >= sl ? old_len - sl + 1 : 0;
        for (size_t p = from; p + sl <= q->text.len; p++)
            if (!memcmp(q->text.data + p, q->oai.stop[i], sl)) {
                if (p < hit) hit = p;
                break;
            }
    }
    if (hit == SIZE_MAX) return false;
    q->text.len = hit;  /* the stop string itself is not returned (OpenAI semantics) */
    q->text.data[hit] = 0;
    if (q->emitted > hit) q->emitted = hit;
    return true;
}

static void add_logprobs(router_req_t *q, int32_t tok, const Prism__TokenLogprobs *l)
{
    /* Scratch buffers live in the request and are reused: no allocation per token after the first. */
    router_t *r = q->r;
    prism_buf_t *tb = &q->tok_bytes[0], *cb = &q->tok_bytes[1];
    prism_oai_top_logprob_t top[20];
    int nt = (int)PRISM_MIN(l->n_top, (size_t)20);
    /* return_tokens_as_token_ids (vLLM): "token_id:<id>" names the token exactly, where its text
     * may be lossy (a partial UTF-8 sequence) or shared with another id. */
    bool as_ids = q->oai.return_tokens_as_token_ids;
    prism_buf_reset(tb);
    if (as_ids) prism_buf_appendf(tb, "token_id:%d", tok);
    else prism_tokenizer_token_bytes(r->tok, tok, tb);
    for (int k = 0; k < nt; k++) {
        prism_buf_reset(&cb[k]);
        if (as_ids) prism_buf_appendf(&cb[k], "token_id:%d", l->top[k]->token_id);
        else prism_tokenizer_token_bytes(r->tok, l->top[k]->token_id, &cb[k]);
        top[k] = (prism_oai_top_logprob_t){cb[k].data ? cb[k].data : "", cb[k].len, l->top[k]->logprob};
    }
    prism_oai_token_logprob_t t = {tb->data ? tb->data : "", tb->len, l->logprob, top, q->oai.top_logprobs ? nt : 0};
    prism_oai_logprobs_add(&q->lp, &t);
}

/* The HTTP status of a worker's error, by its kind (never by its text); unset: the sender's default. */
static int error_status(Prism__ErrorKind kind, int unset)
{
    switch (kind) {
    case PRISM__ERROR_KIND__ERROR_CLIENT:      return 400;
    case PRISM__ERROR_KIND__ERROR_OVERLOAD:    return 503;
    case PRISM__ERROR_KIND__ERROR_UNAVAILABLE: return 503;
    case PRISM__ERROR_KIND__ERROR_INTERNAL:    return 500;
    default:                                   return unset;
    }
}

/* Whether worker w may send this Tokens message for q: the prefill it went to sends the first token
 * (once) and may report an error later (a failed KV transfer); the decode it went to sends the rest
 * (held until the prefill's is in: see router_handle_tokens). */
static bool tokens_allowed(const router_req_t *q, const router_worker_t *w, const Prism__Tokens *t)
{
    if (t->from_prefill) {
        if (w->role != PRISM__ROLE__ROLE_PREFILL || strcmp(q->prefill_id, w->id) != 0) return false;
        return q->prefill_pending || (t->finish == PRISM__FINISH__FINISH_ERROR && t->n_token_ids == 0);
    }
    return w->role == PRISM__ROLE__ROLE_DECODE && q->decode_pending && !strcmp(q->decode_id, w->id);
}

/* Every field of a Tokens message against what the request asked for: ids in the vocabulary, no
 * more tokens than max_tokens in all, logprobs only for tokens sent and at most 20 alternatives. */
static bool tokens_valid(const router_t *r, const router_req_t *q, const Prism__Tokens *t)
{
    if (t->n_token_ids > (size_t)PRISM_MAX(q->prompt.max_tokens - q->n_out, 0) || t->n_logprobs > t->n_token_ids ||
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

static void tokens_apply(router_t *r, router_req_t *q, const Prism__Tokens *t)
{
    if (t->from_prefill && q->prefill_pending) {
        q->prefill_pending = false;
        worker_done(r, q->prefill_id);
    }
    /* Decode is done with it when it ends it, or when prefill ends it (no KV goes to decode then). */
    if (q->decode_pending && (t->finish != PRISM__FINISH__FINISH_NONE || (t->error && *t->error))) {
        q->decode_pending = false;
        worker_done(r, q->decode_id);
    }
    if (t->error && *t->error) {
        char msg[300];
        snprintf(msg, sizeof(msg), "%s", t->error);
        req_fail(q, error_status(t->error_kind, 500), msg);
        return;
    }
    double now = prism_now_s();
    if (t->from_prefill) {
        q->t_first = now;
        q->queue_ms = t->queue_ms;
        q->prefill_ms = t->prefill_ms;
        prism_hist_observe(&r->metrics.ttft, now - q->t_start);
        prism_hist_observe(&r->metrics.queue, t->queue_ms / 1e3);
        q->stage = STAGE_PREFILLED;
    }
    q->t_last = now;
    size_t old_len = q->text.len;
    for (size_t i = 0; i < t->n_token_ids; i++) {
        int32_t tok = t->token_ids[i];
        q->n_out++;
        if (q->oai.logprobs && i < t->n_logprobs) add_logprobs(q, tok, t->logprobs[i]);
        /* EOS and stop token ids end the text without being part of it. */
        bool final_stop = t->finish == PRISM__FINISH__FINISH_STOP && i + 1 == t->n_token_ids;
        if (!final_stop) prism_detok_push(&q->detok, tok, &q->text);
    }
    bool finished = t->finish != PRISM__FINISH__FINISH_NONE;
    if (finished) prism_detok_flush(&q->detok, &q->text);
    if (apply_stop_strings(q, old_len)) {
        req_complete(q, "stop");
        return;
    }
    if (finished) {
        req_complete(q, t->finish == PRISM__FINISH__FINISH_STOP ? "stop" : "length");
        return;
    }
    if (q->oai.stream) {
        size_t safe = q->text.len - stop_holdback(q);
        if (safe > q->emitted || q->lp.n_tokens) stream_chunk(q, safe > q->emitted ? safe : q->emitted, NULL);
    }
}

/* Keeps a decode Tokens message that overtook the prefill's (see router.h). */
static bool tokens_hold(router_req_t *q, Prism__Envelope *env)
{
    if (q->n_held == ROUTER_MAX_HELD_TOKENS) {
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
    return true;
}

bool router_handle_tokens(router_t *r, const router_worker_t *from, Prism__Envelope *env, bool *kept)
{
    *kept = false;
    uint64_t rid = env->request_id;
    const Prism__Tokens *t = env->tokens;
    router_req_t *q = router_req_get(r, rid);
    if (!q) return true;  /* finished or aborted already: a late message, not a refusal */
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
    if (!t->from_prefill && q->prefill_pending && !(t->error && *t->error)) {
        *kept = tokens_hold(q, env);
        return true;
    }
    tokens_apply(r, q, t);
    /* The prefill's is in: the held ones follow in the order they came, each checked again against
     * what is left of max_tokens. Applying one may end the request (finish, stop string, error),
     * which frees the rest with it. */
    for (int i = 0; (q = router_req_get(r, rid)) && !q->prefill_pending && i < q->n_held; i++) {
        Prism__Envelope *held = q->held[i];
        q->held[i] = NULL;
        if (tokens_valid(r, q, held->tokens)) {
            tokens_apply(r, q, held->tokens);
        } else {
            PRISM_WARN("request %llu: malformed Tokens from decode worker %s", (unsigned long long)rid, q->decode_id);
            req_fail(q, 500, "A worker sent a malformed result.");
        }
        prism_msg_env_free(held);
    }
    if (q && !q->prefill_pending) q->n_held = 0;
    return true;
}

bool router_handle_encode_done(router_t *r, const router_worker_t *from, uint64_t rid, const Prism__EncodeDone *d)
{
    router_req_t *q = router_req_get(r, rid);
    if (!q) return true;  /* finished or aborted already */
    /* Only the encoder this image went to, once. */
    if (d->image_index >= (uint32_t)q->prompt.n_images || !q->encode_pending[d->image_index] ||
        from->role != PRISM__ROLE__ROLE_ENCODER || strcmp(q->encoder_id[d->image_index], from->id) != 0) {
        PRISM_WARN("request %llu: EncodeDone for image %u from %s, which does not hold it: dropped",
                   (unsigned long long)rid, d->image_index, from->id);
        return false;
    }
    encoder_done(r, q, (int)d->image_index);
    q->decode_ms += d->decode_ms;
    q->vit_ms += d->vit_ms;
    q->cache_hits += d->cache_hit;
    if (d->error && *d->error) {
        char msg[320];
        snprintf(msg, sizeof(msg), "Image %u: %s", d->image_index, d->error);
        req_fail(q, error_status(d->error_kind, 400), msg);
    }
    return true;
}

static bool queue_push_front(router_t *r, uint64_t rid);

/* Takes the request back from every worker it was sent to (aborts to those still alive), as if
 * it had never been dispatched. */
static void req_release_workers(router_req_t *q)
{
    router_t *r = q->r;
    abort_workers(q);
    for (int i = 0; i < q->prompt.n_images; i++) {
        if (q->encode_pending[i]) encoder_done(r, q, i);
        q->encode_pending[i] = false;
        q->encoder_id[i][0] = '\0';
    }
    if (q->prefill_pending) worker_done(r, q->prefill_id);
    if (q->decode_pending) worker_done(r, q->decode_id);
    q->prefill_pending = q->decode_pending = false;
    q->prefill_id[0] = q->decode_id[0] = '\0';
    for (int i = 0; i < q->n_held; i++) prism_msg_env_free(q->held[i]);  /* the old attempt's decode tokens */
    q->n_held = 0;
    /* A new id: late messages for the old one (from workers that had started) match nothing, and
     * no worker's memory of the abort can catch the request's next dispatch. */
    router_req_del(r, q->rid);
    int rc = router_req_new_id(r, &q->rid);
    PRISM_ASSERT(rc == PRISM_OK);           /* getrandom gave ids at the first dispatch */
    rc = router_req_put(r, q->rid, q);      /* takes the entry just freed */
    PRISM_ASSERT(rc == PRISM_OK);
}

/* A worker holding this request is gone before its first token reached the client: nothing was
 * said yet, so the request starts over on healthy workers, ahead of the queue. It takes a new id:
 * whatever the first attempt's surviving workers still send matches no request. */
static bool req_retry(router_req_t *q, const char *why)
{
    router_t *r = q->r;
    if (q->stage != STAGE_SENT || q->attempts > r->max_retries || r->queue_len == r->reqs_cap) return false;
    uint64_t old = q->rid;
    /* The stage it is stuck in: its encoders, else its prefill worker. */
    bool encoding = false;
    for (int i = 0; i < q->prompt.n_images; i++)
        if (q->encode_pending[i]) {
            encoding = true;
            snprintf(q->avoid[q->n_avoid++ % PRISM_ARRAY_LEN(q->avoid)], sizeof(q->avoid[0]), "%s", q->encoder_id[i]);
        }
    if (!encoding && q->prefill_pending)
        snprintf(q->avoid[q->n_avoid++ % PRISM_ARRAY_LEN(q->avoid)], sizeof(q->avoid[0]), "%s", q->prefill_id);
    q->n_avoid = PRISM_MIN(q->n_avoid, (int)PRISM_ARRAY_LEN(q->avoid));
    req_release_workers(q);
    q->stage = STAGE_QUEUED;
    bool queued = queue_push_front(r, q->rid);  /* room checked above */
    PRISM_ASSERT(queued);
    r->metrics.retried++;
    r->queue_dirty = true;
    PRISM_INFO("request %llu: %s; retried as %llu (attempt %d of %d)", (unsigned long long)old, why,
               (unsigned long long)q->rid, q->attempts + 1, r->max_retries + 1);
    return true;
}

void router_fail_worker_requests(router_t *r, const router_worker_t *w, const char *why)
{
    for (size_t i = 0; i < r->reqs_cap; i++) {
        router_req_t *q = r->reqs[i];
        if (!q) continue;
        bool held = (q->prefill_pending && !strcmp(q->prefill_id, w->id)) ||
                    (q->decode_pending && !strcmp(q->decode_id, w->id));
        for (int k = 0; k < q->prompt.n_images; k++) held |= q->encode_pending[k] && !strcmp(q->encoder_id[k], w->id);
        if (held) {
            char msg[256];
            snprintf(msg, sizeof(msg), "The %s worker serving this request %s.", prism_role_name(w->role), why);
            if (!req_retry(q, msg)) req_fail(q, 503, msg);
            i = (size_t)-1;  /* the map changed under us: rescan */
        }
    }
}

void router_sweep_requests(router_t *r)
{
    double now = prism_now_s();
    for (size_t i = 0; i < r->reqs_cap; i++) {
        router_req_t *q = r->reqs[i];
        if (!q) continue;
        if (q->stage != STAGE_PREFILLED && now - q->t_start > r->max_queue_wait_s) {
            char msg[160];
            if (q->stage == STAGE_QUEUED && q->waiting_for) {
                r->metrics.refused_limit[PRISM_REFUSE_NO_WORKERS]++;
                snprintf(msg, sizeof(msg), "No %s worker is available; try again shortly.", q->waiting_for);
            } else {
                r->metrics.refused_limit[PRISM_REFUSE_QUEUE_WAIT]++;
                snprintf(msg, sizeof(msg), "The request waited too long for a free worker; retry after a short wait.");
            }
            req_fail(q, 503, msg);
            i = (size_t)-1;
        } else if (q->stage == STAGE_SENT && r->stage_timeout_s > 0 && now - q->t_dispatch > r->stage_timeout_s) {
            /* A worker alive but stuck (or far slower than the rest): try others, then 504. */
            bool encoding = false;
            for (int k = 0; k < q->prompt.n_images; k++) encoding |= q->encode_pending[k];
            char msg[160];
            snprintf(msg, sizeof(msg), "The %s stage did not finish within %gs.", encoding ? "encode" : "prefill",
                     r->stage_timeout_s);
            r->metrics.stage_timeouts++;
            if (!req_retry(q, msg)) req_fail(q, 504, msg);
            i = (size_t)-1;
        } else if (now - q->t_start > r->request_timeout_s) {
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
    q->r->metrics.success_abort++;
    PRISM_DEBUG("request %llu: client went away", (unsigned long long)q->rid);
    abort_workers(q);
    req_destroy(q);
}

/* router_pick, passing over the workers an earlier attempt of this request got stuck on while
 * another has room (they look full for the pick); only they left: them rather than nothing. */
static router_worker_t *pick(router_t *r, router_req_t *q, Prism__Role role, uint64_t hash, uint64_t bytes,
                             bool *any)
{
    enum { HIDE = 1 << 20 };
    router_worker_t *hidden[PRISM_ARRAY_LEN(q->avoid)];
    int n = 0;
    for (int i = 0; i < q->n_avoid; i++) {
        router_worker_t *w = router_worker_by_id(r, q->avoid[i]);
        if (w && w->role == role) {
            w->inflight += HIDE;
            hidden[n++] = w;
        }
    }
    router_worker_t *w = router_pick(r, role, hash, bytes, any);
    for (int i = 0; i < n; i++) hidden[i]->inflight -= HIDE;
    return w || !n ? w : router_pick(r, role, hash, bytes, any);
}

/* Sends the request to its workers; false when it must wait in the router's queue (every worker of
 * a tier is at capacity, a tier has no worker at all, or a worker could not be reached). */
static bool dispatch(router_t *r, router_req_t *q)
{
    bool any_pf, any_dc, any_enc = true;
    router_worker_t *pf = pick(r, q, PRISM__ROLE__ROLE_PREFILL, 0, 0, &any_pf);
    router_worker_t *dc = pick(r, q, PRISM__ROLE__ROLE_DECODE, 0, 0, &any_dc);
    router_worker_t *enc[ROUTER_MAX_IMAGES] = {0};
    bool enc_room = true;
    for (int i = 0; i < q->prompt.n_images && enc_room; i++) {
        enc[i] = pick(r, q, PRISM__ROLE__ROLE_ENCODER, q->prompt.img_hash[i], q->prompt.img_len[i], &any_enc);
        if (enc[i]) {  /* count now so the next image sees this one */
            enc[i]->inflight++;
            enc[i]->queued_bytes += q->prompt.img_len[i];
        } else {
            enc_room = false;
        }
    }
    for (int i = 0; i < q->prompt.n_images; i++)
        if (enc[i]) {
            enc[i]->inflight--;
            enc[i]->queued_bytes -= q->prompt.img_len[i];
        }
    /* A tier with no worker at all waits too (bounded by --max-queue-wait): a restarted worker
     * re-registers within seconds, and the request is served then instead of refused now. */
    q->waiting_for = !any_pf ? "prefill" : !any_dc ? "decode" : !any_enc ? "encoder" : NULL;
    if (!pf || !dc || !enc_room) {
        PRISM_DEBUG("request %llu waits: %s", (unsigned long long)q->rid,
                    !pf ? "no prefill worker with room" : !dc ? "no decode worker with room" : "no encoder with room");
        return false;
    }
    /* Prefill first: it must know the request before embeddings can be used (either order works). */
    Prism__ImageSpan spans[ROUTER_MAX_IMAGES], *span_ptrs[ROUTER_MAX_IMAGES];
    for (int s = 0; s < q->prompt.n_images; s++) {
        prism__image_span__init(&spans[s]);
        spans[s].offset = q->prompt.img_offset[s];
        spans[s].n_tokens = q->prompt.img_span[s];
        span_ptrs[s] = &spans[s];
    }
    int32_t stop_ids[PRISM_OAI_MAX_STOP_TOKEN_IDS];
    for (int i = 0; i < q->oai.n_stop_token_ids; i++) stop_ids[i] = (int32_t)q->oai.stop_token_ids[i];
    Prism__Sampling sp = PRISM__SAMPLING__INIT;
    sp.temperature = (float)q->oai.temperature;
    sp.top_p = (float)q->oai.top_p;
    sp.top_k = (int32_t)q->oai.top_k;
    sp.has_seed = q->oai.has_seed;
    sp.seed = (uint64_t)q->oai.seed;
    sp.max_tokens = (uint32_t)q->prompt.max_tokens;
    sp.n_stop_token_ids = (size_t)q->oai.n_stop_token_ids;
    sp.stop_token_ids = stop_ids;
    sp.ignore_eos = q->oai.ignore_eos;
    sp.logprobs = q->oai.logprobs ? 1u + (uint32_t)q->oai.top_logprobs : 0u;
    Prism__Prefill p = PRISM__PREFILL__INIT;
    p.n_token_ids = q->prompt.n_tokens;
    p.token_ids = q->prompt.tokens;
    p.n_images = (size_t)q->prompt.n_images;
    p.images = span_ptrs;
    p.sampling = &sp;
    p.decode_endpoint = dc->data_endpoint;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_PREFILL;
    env.request_id = q->rid;
    env.prefill = &p;
    /* A send fails when the worker's connection is gone (it died; the registry drops it at
     * --worker-timeout): the request waits for the next try rather than failing. */
    if (router_send(r, pf, &env, NULL, 0) != PRISM_OK) {
        PRISM_WARN("request %llu: prefill worker %s unreachable; the request waits", (unsigned long long)q->rid, pf->id);
        return false;
    }
    snprintf(q->prefill_id, sizeof(q->prefill_id), "%s", pf->id);
    snprintf(q->decode_id, sizeof(q->decode_id), "%s", dc->id);
    q->prefill_pending = q->decode_pending = true;
    pf->inflight++;
    dc->inflight++;
    for (int i = 0; i < q->prompt.n_images; i++) {
        Prism__Encode e = PRISM__ENCODE__INIT;
        e.image_index = (uint32_t)i;
        e.content_hash = q->prompt.img_hash[i];
        e.prefill_endpoint = pf->data_endpoint;
        Prism__Envelope ee = PRISM__ENVELOPE__INIT;
        ee.type = PRISM__MSG_TYPE__MSG_ENCODE;
        ee.request_id = q->rid;
        ee.encode = &e;
        prism_frame_t f = {q->prompt.img[i], q->prompt.img_len[i]};
        if (router_send(r, enc[i], &ee, &f, 1) != PRISM_OK) {
            PRISM_WARN("request %llu: encoder %s unreachable; the request waits", (unsigned long long)q->rid,
                       enc[i]->id);
            req_release_workers(q);
            return false;
        }
        snprintf(q->encoder_id[i], sizeof(q->encoder_id[i]), "%s", enc[i]->id);
        q->encode_pending[i] = true;
        enc[i]->inflight++;
        enc[i]->queued_bytes += q->prompt.img_len[i];
        router_worker_note_image(enc[i], q->prompt.img_hash[i]);
    }
    q->stage = STAGE_SENT;
    q->t_dispatch = prism_now_s();
    q->attempts++;
    return true;
}

static bool queue_push(router_t *r, uint64_t rid)
{
    if (r->queue_len == r->reqs_cap) return false;
    r->queue[(r->queue_head + r->queue_len) % r->reqs_cap] = rid;
    r->queue_len++;
    return true;
}

static bool queue_push_front(router_t *r, uint64_t rid)
{
    if (r->queue_len == r->reqs_cap) return false;
    r->queue_head = (r->queue_head + r->reqs_cap - 1) % r->reqs_cap;
    r->queue[r->queue_head] = rid;
    r->queue_len++;
    return true;
}

void router_dispatch_queued(router_t *r)
{
    if (r->draining) return;  /* re-entered from a request that failed while we dispatch */
    r->draining = true;
    while (r->queue_len) {
        uint64_t rid = r->queue[r->queue_head];
        router_req_t *q = router_req_get(r, rid);
        if (q && q->stage == STAGE_QUEUED) {
            if (!dispatch(r, q)) {  /* still no room: keep the order */
                r->queue[r->queue_head] = q->rid;  /* a failed send gave it a new id */
                break;
            }
        }
        r->queue_head = (r->queue_head + 1) % r->reqs_cap;
        r->queue_len--;
    }
    r->draining = false;
}

void router_handle_generate(router_t *r, prism_http_req_t *h, bool chat)
{
    if (r->shutting_down) {  /* a keep-alive connection's next request while draining */
        respond_error(h, 503, "The server is shutting down; retry on another instance.", NULL);
        prism_http_req_release(h);
        return;
    }
    size_t blen = 0;
    const char *body = prism_http_req_body(h, &blen);
    router_req_t *q = prism_calloc(1, sizeof(*q));
    if (!q) {
        respond_error(h, 503, "The server is out of memory; try again shortly.", NULL);
        prism_http_req_release(h);
        return;
    }
    q->r = r;
    q->h = h;
    q->chat = chat;
    q->t_start = prism_now_s();
    if (router_req_new_id(r, &q->rid) != PRISM_OK) {
        respond_error(h, 503, "The server has no randomness for request ids; try again shortly.", NULL);
        prism_http_req_release(h);
        prism_free(q);
        return;
    }
    prism_oai_logprobs_init(&q->lp, chat);
    char msg[600] = "";
    int status = 0;

    prism_oai_error_t perr;
    prism_oai_parse_opts_t popts = {.max_images = r->max_images_per_prompt};
    if (prism_oai_parse(body ? body : "", blen, chat, &popts, &q->oai, &perr) != PRISM_OK) {
        r->metrics.refused_limit[PRISM_REFUSE_BAD_REQUEST]++;
        if (perr.status == 400 && strstr(perr.message, "image")) r->metrics.refused_limit[PRISM_REFUSE_TOO_MANY_IMAGES]++;
        prism_http_respond_error(h, perr.status ? perr.status : 400, perr.type[0] ? perr.type : "BadRequestError",
                                 perr.message, perr.param[0] ? perr.param : NULL, NULL, NULL);
        q->h = NULL;
        prism_http_req_release(h);
        req_destroy(q);
        return;
    }
    prism_detok_init(&q->detok, r->tok, q->oai.skip_special_tokens);   /* zeroed until here: free is a no-op */
    if (q->oai.model && strcmp(q->oai.model, r->served_model_name) != 0) {
        snprintf(msg, sizeof(msg), "The model `%s` does not exist.", q->oai.model);
        status = 404;
        goto fail;
    }
    if ((int)r->n_reqs >= r->max_running) {
        r->metrics.refused_limit[PRISM_REFUSE_QUEUE_FULL]++;
        snprintf(msg, sizeof(msg), "The server is at capacity (%d requests in flight); retry after a short wait.",
                 r->max_running);
        status = 429;
        goto fail;
    }
    if (chat && (status = router_prompt_load_images(r, &q->prompt, &q->oai, msg, sizeof(msg))) != 0) goto fail;
    if (q->prompt.image_bytes && r->image_bytes_inflight + q->prompt.image_bytes > r->max_image_bytes_inflight) {
        r->metrics.refused_limit[PRISM_REFUSE_IMAGE_BYTES_INFLIGHT]++;
        snprintf(msg, sizeof(msg), "Too many image bytes in flight; retry after a short wait.");
        status = 429;
        goto fail;
    }
    if ((status = router_prompt_build(r, &q->prompt, &q->oai, chat, msg, sizeof(msg))) != 0) goto fail;
    prism_http_req_drop_body(q->h);
    router_prompt_release_inputs(&q->oai);
    if (prism_oai_resp_meta_init(&q->meta, chat, r->served_model_name) != PRISM_OK) {
        status = 503;
        snprintf(msg, sizeof(msg), "out of memory");
        goto fail;
    }
    if (router_req_put(r, q->rid, q) != PRISM_OK) {
        r->metrics.refused_limit[PRISM_REFUSE_QUEUE_FULL]++;
        snprintf(msg, sizeof(msg), "The server is at capacity; retry after a short wait.");
        status = 429;
        goto fail;
    }
    r->image_bytes_inflight += q->prompt.image_bytes;
    q->bytes_counted = true;
    /* Behind older queued requests, or no worker has room: wait in the router's queue. */
    if ((r->queue_len || !dispatch(r, q)) && !queue_push(r, q->rid)) {
        r->metrics.refused_limit[PRISM_REFUSE_QUEUE_FULL]++;
        req_fail(q, 429, "The server is at capacity; retry after a short wait.");
        return;
    }
    prism_http_req_set_user(h, q);
    prism_http_req_on_abort(h, on_client_gone, q);
    PRISM_DEBUG("request %llu: %zu prompt tokens, %d images, max_tokens %d", (unsigned long long)q->rid, q->prompt.n_tokens,
                q->prompt.n_images, q->prompt.max_tokens);
    return;

fail:
    if (status >= 400 && status < 500 && status != 429) r->metrics.refused_limit[PRISM_REFUSE_BAD_REQUEST]++;
    respond_error(h, status, msg, NULL);
    q->h = NULL;
    prism_http_req_release(h);
    req_destroy(q);
}
