/* The life of one generation request inside the router.
 *
 *   HTTP body -> parse/validate -> output constraint compiled (guide.h: 400 on a bad schema) ->
 *   limits -> the prompt (prompt.c: images, chat template, tokens, image spans) -> pick
 *   encoder(s)/prefill/decode (or wait in the router's queue) -> Prefill to prefill, Encode to
 *   encoder(s) -> first tokens from prefill (one per choice), the rest from decode -> per choice:
 *   incremental detokenization, stop strings, tool-call parsing -> SSE chunks or one JSON response
 *   -> usage, metrics, abort to the workers if we stopped early or the client left.
 *
 * A request with n > 1 has n choices: the workers sample n sequences from one prefill (sharing
 * its KV); each Tokens message names its choice. A choice that ends in the router (a stop string)
 * ignores the rest of its sequence's tokens; the workers are aborted when every choice has ended.
 *
 * Workers that die: before the first token the request starts over elsewhere (req_retry); after
 * it, a request with n = 1 goes on from its last token on another prefill/decode pair
 * (req_migrate, up to --max-migrations times); anything else fails with 503.
 *
 * Everything a request owns is freed in req_destroy; the HTTP request is released exactly once. */
#include "router.h"
#include "openai_req.h"
#include "openai_write.h"

#include <stdio.h>
#include <string.h>
#include <xxhash.h>

typedef enum { STAGE_QUEUED, STAGE_SENT, STAGE_PREFILLED } stage_t;

/* A tool-call delta collected from the parser for the next chunk (name and id are copied: the
 * parser's pointers live only during its callback; arguments sit in choice.d_args). */
typedef struct {
    int index;
    bool begin;
    char id[32];
    char name[72];
    size_t args_off, args_len;
} pending_tool_t;

typedef struct {
    int n_out;                    /* tokens of this choice */
    bool got_first;               /* prefill's token for this choice came */
    bool worker_ended;            /* a worker sent its finish (the router may have ended it earlier) */
    const char *finish;           /* NULL while the choice runs */
    prism_detok_t detok;
    prism_buf_t text;             /* generated text so far (after stop-string truncation) */
    size_t emitted;               /* bytes of text already streamed (or fed to the tool parser) */
    prism_oai_logprobs_t lp;
    bool role_sent;
    /* tool calls (streaming): the parser fed with the text and the deltas of the next chunk */
    prism_toolcall_parser_t *tc;
    prism_buf_t d_content, d_args;
    pending_tool_t *d_tools;
    int n_d_tools, cap_d_tools;
    bool tc_failed;               /* out of memory in the callback: the rest streams as content */
} router_choice_t;

struct router_req {
    uint64_t rid;                 /* the low half of its 128-bit id: the map's key */
    uint64_t rid_hi;              /* the high half: a worker's message about it must carry both */
    router_t *r;
    prism_http_req_t *h;          /* NULL once released */
    prism_oai_request_t oai;
    prism_oai_resp_meta_t meta;
    bool chat;
    router_prompt_t prompt;       /* images, tokens, image spans, max_tokens (prompt.c) */
    char encoder_id[ROUTER_MAX_IMAGES][128];
    bool encode_pending[ROUTER_MAX_IMAGES];
    uint64_t early_id[ROUTER_MAX_IMAGES];   /* the early job its image's Encode adopts (early_encode.c), 0 none */
    bool bytes_counted;           /* prompt.image_bytes added to the router's in-flight total */
    /* workers */
    char prefill_id[128], decode_id[128];
    bool prefill_pending, decode_pending;
    Prism__Envelope **held;       /* decode Tokens that arrived before the prefill's, in order */
    int n_held, held_cap;
    /* output constraint sent in Sampling.guide (points into oai) */
    prism_guide_spec_t guide;
    bool parse_tools;             /* tool_choice auto / required / named: outputs are parsed for calls */
    /* generation */
    stage_t stage;
    int attempts;                 /* dispatches so far; a retry is one more (bounded by --max-retries) */
    char avoid[4][128];           /* workers an earlier attempt got stuck on: others first */
    int n_avoid;
    const char *waiting_for;      /* while queued because a tier has no worker at all: its name */
    unsigned wait_tiers;          /* TIER_* bits it waited for at its last dispatch */
    double t_wait;                /* when the wait for workers began (t_start; a migration restarts it) */
    /* migration (n = 1, see req_migrate): the tokens generated so far, kept while a migration is
     * possible and sent again with the prompt; at most max_tokens of them */
    int32_t *gen;
    int n_gen, gen_cap;
    int migrations;
    bool no_migrate;              /* no memory to keep the tokens: this request fails as before */
    bool decode_heard;            /* this attempt's decode sent a token: the KV reached it */
    int n_out;                    /* tokens over all choices */
    router_choice_t *choices;     /* [oai.n] */
    int n_finished;
    int n_first, n_worker_ended;  /* choices with prefill's token in; choices a worker finished */
    bool streaming_started;
    double t_start, t_first, t_last;
    double t_dispatch;            /* when the current attempt was sent (per-stage deadline) */
    double t_sent;                /* its first attempt was handed to ZeroMQ (x-prism-timing router_ms) */
    float decode_ms, vit_ms, queue_ms, prefill_ms;  /* worker-side timings (sums over images) */
    int cache_hits;
    prism_buf_t out;              /* scratch for response bytes */
    prism_buf_t tok_bytes[21];    /* scratch for one token's logprob entry: [0] chosen, [1..] top */
    /* preparation on the thread pool (prep_run): the loop thread keeps off everything above until
     * prep_done reads what it found */
    uv_work_t prep;
    bool prep_gone;               /* the client went away meanwhile */
    bool parsed;
    prism_oai_error_t perr;
    int prep_status;              /* of loading the images and building the prompt; 0 ok */
    char prep_msg[600];
    uint64_t prep_refused[PRISM_REFUSE_COUNT];
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

int router_req_new_id(router_t *r, uint64_t *out, uint64_t *hi)
{
    /* Unguessable: a peer inside the trust boundary cannot aim messages at a request it was not
     * given. 128 random bits; the low half is unique among the requests in flight and never 0. */
    uint64_t id[2];
    do {
        if (prism_random_bytes(id, sizeof(id)) != PRISM_OK) return PRISM_EIO;
    } while (id[0] == 0 || router_req_get(r, id[0]));
    *out = id[0];
    *hi = id[1];
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

/* A worker finished its part of a request: its slots may admit a queued one. */
static void worker_done(router_t *r, const char *id, int slots)
{
    router_worker_t *w = id[0] ? router_worker_by_id(r, id) : NULL;
    if (w) w->inflight = PRISM_MAX(w->inflight - slots, 0);
    if (w) w->completed++;  /* the status page's per-worker throughput */
    r->queue_dirty = true;
}

/* An encoder finished (or dropped) image i of q: its slot and the file's bytes are free. */
static void encoder_done(router_t *r, router_req_t *q, int i)
{
    router_worker_t *w = q->encoder_id[i][0] ? router_worker_by_id(r, q->encoder_id[i]) : NULL;
    if (w) w->queued_bytes -= PRISM_MIN(w->queued_bytes, (uint64_t)q->prompt.img_len[i]);
    q->encode_pending[i] = false;
    worker_done(r, q->encoder_id[i], 1);
}

static void send_abort(router_t *r, const char *worker_id, uint64_t rid)
{
    router_worker_t *w = worker_id[0] ? router_worker_by_id(r, worker_id) : NULL;
    if (w) router_send_abort(r, w, rid);
}

static int n_choices(const router_req_t *q) { return q->oai.n > 0 ? q->oai.n : 1; }

/* Whether the request could still go on elsewhere if its decode worker died (req_migrate). */
static bool may_migrate(const router_req_t *q)
{
    return !q->no_migrate && n_choices(q) == 1 && q->migrations < q->r->max_migrations;
}

/* Keeps the tokens just generated for a migration (tokens_valid bounded them by max_tokens).
 * Grows by doubling: a few allocations per request, none per token in the steady state. */
static void gen_keep(router_req_t *q, const int32_t *ids, size_t n)
{
    if (!may_migrate(q) || !n) return;
    if ((size_t)q->n_gen + n > (size_t)q->gen_cap) {
        size_t cap = q->gen_cap ? (size_t)q->gen_cap : 64;
        while (cap < (size_t)q->n_gen + n) cap *= 2;
        cap = PRISM_MAX(PRISM_MIN(cap, (size_t)q->prompt.max_tokens), (size_t)q->n_gen + n);
        int32_t *g = prism_realloc(q->gen, cap * sizeof *g);
        if (!g) {
            PRISM_WARN("request %llu: no memory to keep its tokens; it cannot migrate", (unsigned long long)q->rid);
            q->no_migrate = true;
            return;
        }
        q->gen = g;
        q->gen_cap = (int)cap;
    }
    memcpy(q->gen + q->n_gen, ids, n * sizeof *ids);
    q->n_gen += (int)n;
}

static void choice_free(router_choice_t *c)
{
    prism_detok_free(&c->detok);
    prism_oai_logprobs_free(&c->lp);
    prism_buf_free(&c->text);
    prism_toolcall_parser_free(c->tc);
    prism_buf_free(&c->d_content);
    prism_buf_free(&c->d_args);
    prism_free(c->d_tools);
}

static void req_destroy(router_req_t *q)
{
    router_t *r = q->r;
    router_req_del(r, q->rid);
    for (int i = 0; i < q->prompt.n_images; i++)
        if (q->encode_pending[i]) encoder_done(r, q, i);
    if (q->prefill_pending) worker_done(r, q->prefill_id, 1);
    if (q->decode_pending) worker_done(r, q->decode_id, n_choices(q));
    if (q->bytes_counted) {
        r->image_bytes_inflight -= q->prompt.image_bytes;
        prism_http_server_resume_bodies(r->http);   /* uploads that wait for image room go on */
    }
    if (q->h) {
        prism_http_req_set_user(q->h, NULL);
        prism_http_req_release(q->h);
    }
    if (q->choices)
        for (int i = 0; i < n_choices(q); i++) choice_free(&q->choices[i]);
    prism_free(q->choices);
    prism_oai_request_free(&q->oai);
    prism_oai_resp_meta_free(&q->meta);
    prism_buf_free(&q->out);
    for (size_t i = 0; i < PRISM_ARRAY_LEN(q->tok_bytes); i++) prism_buf_free(&q->tok_bytes[i]);
    router_prompt_free(&q->prompt);
    prism_free(q->gen);
    for (int i = 0; i < q->n_held; i++) prism_msg_env_free(q->held[i]);
    prism_free(q->held);
    prism_free(q);
}

/* Aborts every worker still holding this request (after the last choice ended, an error or a
 * client that went away). The prefill always hears it (after its first token it may still hold the KV
 * export); the decode only while it may hold or still receive the request: a decode remembers
 * aborts for requests it has not seen (their KV may be on its way), so it is not told about
 * requests that ended without it. */
static void abort_workers(router_req_t *q)
{
    for (int i = 0; i < q->prompt.n_images; i++)
        if (q->encode_pending[i]) {
            send_abort(q->r, q->encoder_id[i], q->rid);
            /* its adoption may wait behind the batch that runs the early job: that one by its own id */
            if (q->early_id[i]) send_abort(q->r, q->encoder_id[i], q->early_id[i]);
        }
    send_abort(q->r, q->prefill_id, q->rid);
    if (q->decode_pending) send_abort(q->r, q->decode_id, q->rid);
}

void router_respond_error(prism_http_req_t *h, int status, const char *message, const char *param)
{
    const char *extra = (status == 429 || status == 503) ? "Retry-After: 1\r\n" : NULL;
    prism_http_respond_error(h, status, prism_oai_error_type(status), message, param, NULL, extra);
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
            prism_oai_write_sse_error(&q->out, prism_oai_error_type(status), message, NULL, NULL);
            prism_oai_write_sse_done(&q->out);
            prism_http_stream_write(q->h, q->out.data, q->out.len);
            prism_http_stream_end(q->h);
        } else {
            router_respond_error(q->h, status, message, NULL);
        }
    }
    req_destroy(q);
}

/* ---------------------------------------------------------------- tool calls while streaming */

static void on_tool_event(void *ud, const prism_toolcall_event_t *ev)
{
    router_choice_t *c = ud;
    if (ev->kind == PRISM_TC_CONTENT) {
        if (prism_buf_append(&c->d_content, ev->text, ev->len)) c->tc_failed = true;
        return;
    }
    pending_tool_t *last = c->n_d_tools ? &c->d_tools[c->n_d_tools - 1] : NULL;
    if (ev->kind == PRISM_TC_ARGS && last && last->index == ev->index && last->args_off + last->args_len == c->d_args.len) {
        /* consecutive fragments of one call: one delta entry */
        if (prism_buf_append(&c->d_args, ev->text, ev->len)) c->tc_failed = true;
        else last->args_len += ev->len;
        return;
    }
    if (c->n_d_tools == c->cap_d_tools) {
        int cap = c->cap_d_tools ? c->cap_d_tools * 2 : 8;
        pending_tool_t *t = prism_realloc(c->d_tools, (size_t)cap * sizeof *t);
        if (!t) {
            c->tc_failed = true;
            return;
        }
        c->d_tools = t;
        c->cap_d_tools = cap;
    }
    pending_tool_t *t = &c->d_tools[c->n_d_tools++];
    memset(t, 0, sizeof *t);
    t->index = ev->index;
    t->args_off = c->d_args.len;
    if (ev->kind == PRISM_TC_CALL_BEGIN) {
        t->begin = true;
        snprintf(t->id, sizeof t->id, "%s", ev->id ? ev->id : "");
        snprintf(t->name, sizeof t->name, "%s", ev->name ? ev->name : "");
    } else if (prism_buf_append(&c->d_args, ev->text, ev->len)) {
        c->tc_failed = true;
    } else {
        t->args_len = ev->len;
    }
}

/* parallel_tool_calls false: at most one call (OpenAI). A forced call's grammar already allows
 * only one; under "auto" the model may still write more, which are not returned. */
static int tool_max_calls(const router_req_t *q) { return q->oai.parallel_tool_calls ? 0 : 1; }

static uint64_t tool_id_seed(const router_req_t *q, int index)
{
    uint64_t k[2] = {q->rid, (uint64_t)index};
    return XXH3_64bits_withSeed(k, sizeof k, (uint64_t)q->meta.created);
}

/* ---------------------------------------------------------------- streaming and completion */

static void write_out(router_req_t *q)
{
    prism_http_stream_write(q->h, q->out.data, q->out.len);
    if (prism_http_req_pending_bytes(q->h) > q->r->max_stream_pending) {
        /* The client stopped reading: drop it rather than queue its whole answer in memory. Its
         * abort callback (on_client_gone) runs from the loop's next turn and aborts the workers;
         * writes until then fail harmlessly. */
        q->r->metrics.refused_limit[PRISM_REFUSE_SLOW_CLIENT]++;
        PRISM_WARN("request %llu: client stopped reading (%zu bytes queued); dropped", (unsigned long long)q->rid,
                   prism_http_req_pending_bytes(q->h));
        prism_http_req_drop(q->h);
    }
}

static bool stream_begin(router_req_t *q)
{
    if (q->streaming_started) return true;
    char extra[128];
    snprintf(extra, sizeof(extra), "Cache-Control: no-cache\r\nx-request-id: %s\r\n", q->meta.id);
    if (prism_http_stream_begin(q->h, 200, "text/event-stream", extra) != PRISM_OK) return false;
    q->streaming_started = true;
    return true;
}

/* Streams text[emitted .. upto) of choice i (and its pending logprobs) as one chunk; with tool
 * parsing, the text goes through the parser and the chunk carries what it decided. */
static void stream_chunk(router_req_t *q, int i, size_t upto, const char *finish)
{
    if (!q->h || !stream_begin(q)) return;
    router_choice_t *c = &q->choices[i];
    if (q->chat && !c->role_sent) {
        /* vLLM's first chunk of each choice: the role with empty content. */
        prism_oai_delta_t d = {.index = i, .role = true, .content = "", .len = 0};
        prism_buf_reset(&q->out);
        prism_oai_write_chat_delta(&q->out, &q->meta, &d);
        write_out(q);
        c->role_sent = true;
    }
    const char *t = c->text.data ? c->text.data + c->emitted : "";
    size_t n = upto > c->emitted ? upto - c->emitted : 0;
    const prism_oai_logprobs_t *lp = q->oai.logprobs && c->lp.n_tokens ? &c->lp : NULL;
    prism_buf_reset(&q->out);
    if (!q->chat) {
        if (!n && !finish && !lp) return;
        prism_oai_write_completion_chunk_at(&q->out, &q->meta, i, t, n, lp, finish);
    } else {
        const char *content = t;
        size_t content_len = n;
        bool parsing = c->tc && !c->tc_failed;
        if (parsing) {
            prism_buf_reset(&c->d_content);
            prism_buf_reset(&c->d_args);
            c->n_d_tools = 0;
            if (n && prism_toolcall_parser_feed(c->tc, t, n) != PRISM_OK) c->tc_failed = true;
            if (finish && prism_toolcall_parser_finish(c->tc) != PRISM_OK) c->tc_failed = true;
            content = c->d_content.data ? c->d_content.data : "";
            content_len = c->d_content.len;
            if (finish && !strcmp(finish, "stop") && prism_toolcall_parser_n_calls(c->tc) > 0) finish = "tool_calls";
        }
        int n_tools = parsing ? c->n_d_tools : 0, k = 0;
        do {   /* tool-call entries in batches of 64 per chunk (one call per chunk is the usual case) */
            prism_oai_tool_delta_t deltas[64];
            int nd = 0;
            for (; k < n_tools && nd < (int)PRISM_ARRAY_LEN(deltas); k++) {
                const pending_tool_t *pt = &c->d_tools[k];
                deltas[nd++] = (prism_oai_tool_delta_t){
                    .index = pt->index, .id = pt->begin ? pt->id : NULL, .name = pt->begin ? pt->name : NULL,
                    .arguments = c->d_args.data ? c->d_args.data + pt->args_off : "", .arguments_len = pt->args_len};
            }
            bool last = k >= n_tools;
            if (content_len || nd || (last && (finish || lp))) {
                prism_oai_delta_t d = {.index = i, .content = content_len ? content : NULL, .len = content_len,
                                       .tool_calls = deltas, .n_tool_calls = nd, .lp = last ? lp : NULL,
                                       .finish_reason = last ? finish : NULL};
                prism_oai_write_chat_delta(&q->out, &q->meta, &d);
            }
            content_len = 0;
        } while (k < n_tools);
        if (!q->out.len) {
            c->emitted = upto;
            return;
        }
    }
    write_out(q);
    c->emitted = upto;
    if (lp) prism_oai_logprobs_clear(&c->lp);
}

/* "x-prism-timing" response header and log line: where the time of this request went. */
static void timing_line(const router_req_t *q, double now, char *out, size_t n)
{
    double ttft = q->t_first > 0 ? (q->t_first - q->t_start) * 1e3 : 0;
    double dec_s = q->t_last - q->t_first;
    int per = q->n_out / n_choices(q);
    double tps = per > 1 && dec_s > 0 ? (per - 1) / dec_s : 0;
    /* router_ms: from the last body byte (the handler runs then) to the work handed to ZeroMQ, queueing
     * in the router for a free worker included */
    double router_ms = q->t_sent > 0 ? (q->t_sent - q->t_start) * 1e3 : 0;
    snprintf(out, n, "images=%d cache_hits=%d router_ms=%.2f image_decode_ms=%.2f vit_ms=%.2f queue_ms=%.2f "
             "prefill_ms=%.2f ttft_ms=%.2f decode_tokens=%d decode_tok_s=%.1f e2e_ms=%.2f", q->prompt.n_images,
             q->cache_hits, router_ms, q->decode_ms, q->vit_ms, q->queue_ms, q->prefill_ms, ttft,
             q->n_out > 0 ? q->n_out - n_choices(q) : 0, tps, (now - q->t_start) * 1e3);
}

/* The whole (non-streaming) answer: one choice per sequence, tool calls parsed out of the text. */
static void respond_whole(router_req_t *q, const prism_oai_usage_t *u, const char *timing)
{
    prism_buf_reset(&q->out);
    prism_oai_write_response_begin(&q->out, &q->meta);
    for (int i = 0; i < n_choices(q); i++) {
        router_choice_t *c = &q->choices[i];
        prism_oai_choice_t ch = {.index = i, .content = c->text.data ? c->text.data : "", .len = c->text.len,
                                 .lp = q->oai.logprobs ? &c->lp : NULL, .finish_reason = c->finish};
        prism_toolcall_result_t res;
        memset(&res, 0, sizeof res);
        prism_oai_tool_call_t *calls = NULL;
        if (q->chat && q->parse_tools &&
            prism_toolcall_parse((prism_toolcall_format_t)q->r->tool_parser, ch.content, ch.len, tool_id_seed(q, i),
                                 tool_max_calls(q), &res) == PRISM_OK &&
            res.n_calls > 0 && (calls = prism_malloc(res.n_calls * sizeof *calls)) != NULL) {
            for (size_t k = 0; k < res.n_calls; k++)
                calls[k] = (prism_oai_tool_call_t){res.calls[k].id, res.calls[k].name, res.calls[k].arguments.data,
                                                   res.calls[k].arguments.len};
            ch.tool_calls = calls;
            ch.n_tool_calls = (int)res.n_calls;
            ch.content = res.content.len ? res.content.data : NULL;
            ch.len = res.content.len;
            if (!strcmp(c->finish, "stop")) ch.finish_reason = "tool_calls";
        }
        if (q->chat) prism_oai_write_chat_choice(&q->out, &ch);
        else prism_oai_write_completion_choice(&q->out, &ch);
        prism_toolcall_result_free(&res);
        prism_free(calls);
    }
    prism_oai_write_response_end(&q->out, u);
    char extra[600];
    if (q->r->timing_header)
        snprintf(extra, sizeof(extra), "x-request-id: %s\r\nx-prism-timing: %s\r\n", q->meta.id, timing);
    else
        snprintf(extra, sizeof(extra), "x-request-id: %s\r\n", q->meta.id);
    prism_http_respond(q->h, 200, "application/json", extra, q->out.data, q->out.len);
}

/* Every choice has ended: the last bytes, usage, metrics. */
static void req_complete(router_req_t *q)
{
    router_t *r = q->r;
    double now = prism_now_s();
    char timing[400];
    timing_line(q, now, timing, sizeof(timing));
    PRISM_DEBUG("request %llu done (%s, %zu prompt tokens, %d choices): %s", (unsigned long long)q->rid,
                q->choices[0].finish, q->prompt.n_tokens, n_choices(q), timing);
    /* usage as OpenAI counts it: the prompt once, the completion tokens of every choice */
    prism_oai_usage_t u = {.prompt_tokens = (int64_t)q->prompt.n_tokens, .completion_tokens = q->n_out, .cached_tokens = -1};
    if (q->h && !prism_http_req_aborted(q->h)) {
        if (q->oai.stream) {
            if (stream_begin(q)) {
                prism_buf_reset(&q->out);
                if (q->oai.include_usage) prism_oai_write_usage_chunk(&q->out, &q->meta, &u);
                prism_oai_write_sse_done(&q->out);
                write_out(q);
                prism_http_stream_end(q->h);
            }
        } else {
            respond_whole(q, &u, timing);
        }
    }
    r->metrics.prompt_tokens += q->prompt.n_tokens;
    r->metrics.generation_tokens += (uint64_t)q->n_out;
    prism_hist_observe(&r->metrics.e2e, now - q->t_start);
    for (int i = 0; i < n_choices(q); i++) {
        if (!strcmp(q->choices[i].finish, "length")) r->metrics.success_length++;
        else r->metrics.success_stop++;
    }
    int per = q->n_out / n_choices(q);
    if (per > 1 && q->t_first > 0) prism_hist_observe(&r->metrics.itl, (q->t_last - q->t_first) / (per - 1));
    abort_workers(q);
    req_destroy(q);
}

/* Choice i has ended with `finish`: its last chunk goes out; the request completes with the last
 * choice. Returns true when the request is gone. */
static bool choice_end(router_req_t *q, int i, const char *finish)
{
    router_choice_t *c = &q->choices[i];
    c->finish = finish;
    q->n_finished++;
    if (q->oai.stream && q->h && !prism_http_req_aborted(q->h)) stream_chunk(q, i, c->text.len, finish);
    if (q->n_finished < n_choices(q)) return false;
    req_complete(q);
    return true;
}

/* Longest suffix of the text that is a prefix of some stop string: hold it back while streaming. */
static size_t stop_holdback(const router_req_t *q, const router_choice_t *c)
{
    size_t best = 0;
    for (int i = 0; i < q->oai.n_stop; i++) {
        size_t sl = q->oai.stop_len[i];
        for (size_t k = PRISM_MIN(sl - 1, c->text.len); k > best; k--)
            if (!memcmp(c->text.data + c->text.len - k, q->oai.stop[i], k)) { best = k; break; }
    }
    return best;
}

/* Searches the newly added text for a stop string; truncates and returns true on a hit. */
static bool apply_stop_strings(const router_req_t *q, router_choice_t *c, size_t old_len)
{
    if (!q->oai.n_stop || !c->text.len) return false;
    size_t hit = SIZE_MAX;
    for (int i = 0; i < q->oai.n_stop; i++) {
        size_t sl = q->oai.stop_len[i];
        size_t from = old_len >= sl ? old_len - sl + 1 : 0;
        for (size_t p = from; p + sl <= c->text.len; p++)
            if (!memcmp(c->text.data + p, q->oai.stop[i], sl)) {
                if (p < hit) hit = p;
                break;
            }
    }
    if (hit == SIZE_MAX) return false;
    c->text.len = hit;  /* the stop string itself is not returned (OpenAI semantics) */
    c->text.data[hit] = 0;
    if (c->emitted > hit) c->emitted = hit;
    return true;
}

static void add_logprobs(router_req_t *q, router_choice_t *c, int32_t tok, const Prism__TokenLogprobs *l)
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
    prism_oai_logprobs_add(&c->lp, &t);
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
 * of each choice (once) and may report an error later (a failed KV transfer); the decode it went to
 * sends the rest (held until every first token is in: see router_handle_tokens). */
static bool tokens_allowed(const router_req_t *q, const router_worker_t *w, const Prism__Tokens *t)
{
    if (t->from_prefill) {
        if (w->role != PRISM__ROLE__ROLE_PREFILL || strcmp(q->prefill_id, w->id) != 0) return false;
        if (t->finish == PRISM__FINISH__FINISH_ERROR && t->n_token_ids == 0) return true;
        return q->prefill_pending && t->index < (uint32_t)n_choices(q) && !q->choices[t->index].got_first;
    }
    return w->role == PRISM__ROLE__ROLE_DECODE && q->decode_pending && !strcmp(q->decode_id, w->id);
}

/* Every field of a Tokens message against what the request asked for: a choice it has, ids in the
 * vocabulary, no more tokens than max_tokens in all for that choice, logprobs only for tokens sent
 * and at most 20 alternatives. */
static bool tokens_valid(const router_t *r, const router_req_t *q, const Prism__Tokens *t)
{
    if (t->index >= (uint32_t)n_choices(q)) return false;
    int left = q->prompt.max_tokens - q->choices[t->index].n_out;
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

static void tokens_apply(router_t *r, router_req_t *q, const Prism__Tokens *t)
{
    int n = n_choices(q);
    router_choice_t *c = &q->choices[t->index];   /* tokens_valid checked the index */
    if (t->from_prefill && q->prefill_pending && !c->got_first && !(t->error && *t->error)) {
        c->got_first = true;
        if (++q->n_first == n) {
            q->prefill_pending = false;
            worker_done(r, q->prefill_id, 1);
        }
    }
    /* Decode is done with it when every choice has ended at a worker (prefill ends a choice whose
     * first token is its last: no KV goes to decode for it), or at an error. */
    if (t->finish != PRISM__FINISH__FINISH_NONE && !c->worker_ended) {
        c->worker_ended = true;
        q->n_worker_ended++;
    }
    if (q->decode_pending && (q->n_worker_ended == n || (t->error && *t->error))) {
        q->decode_pending = false;
        worker_done(r, q->decode_id, n);
    }
    if (t->error && *t->error) {
        char msg[300];
        snprintf(msg, sizeof(msg), "%s", t->error);
        req_fail(q, error_status(t->error_kind, 500), msg);
        return;
    }
    double now = prism_now_s();
    if (!t->from_prefill) q->decode_heard = true;
    if (t->from_prefill && q->stage != STAGE_PREFILLED) {
        if (q->t_first == 0) {   /* a migrated request's first token came long ago */
            q->t_first = now;
            q->queue_ms = t->queue_ms;
            q->prefill_ms = t->prefill_ms;
            prism_hist_observe(&r->metrics.ttft, now - q->t_start);
            prism_hist_observe(&r->metrics.queue, t->queue_ms / 1e3);
        }
        q->stage = STAGE_PREFILLED;
        /* no retry after the first token (req_retry): unless a migration may encode them again, the
         * image bytes are dead weight from here (they stay counted in image_bytes_inflight until
         * the request ends, so keeping them holds no more than was admitted) */
        for (int i = 0; i < q->prompt.n_images && !may_migrate(q); i++) {
            prism_free(q->prompt.img[i]);
            q->prompt.img[i] = NULL;
        }
    }
    q->t_last = now;
    int i = (int)t->index;
    if (c->finish) return;   /* ended in the router (stop string): the rest of its sequence is not used */
    gen_keep(q, t->token_ids, t->n_token_ids);
    size_t old_len = c->text.len;
    for (size_t k = 0; k < t->n_token_ids; k++) {
        int32_t tok = t->token_ids[k];
        c->n_out++;
        q->n_out++;
        if (q->oai.logprobs && k < t->n_logprobs) add_logprobs(q, c, tok, t->logprobs[k]);
        /* EOS and stop token ids end the text without being part of it. */
        bool final_stop = t->finish == PRISM__FINISH__FINISH_STOP && k + 1 == t->n_token_ids;
        if (!final_stop) prism_detok_push(&c->detok, tok, &c->text);
    }
    bool finished = t->finish != PRISM__FINISH__FINISH_NONE;
    if (finished) prism_detok_flush(&c->detok, &c->text);
    if (apply_stop_strings(q, c, old_len)) {
        choice_end(q, i, "stop");
        return;
    }
    if (finished) {
        choice_end(q, i, t->finish == PRISM__FINISH__FINISH_STOP ? "stop" : "length");
        return;
    }
    if (q->oai.stream) {
        size_t safe = c->text.len - stop_holdback(q, c);
        if (safe > c->emitted || c->lp.n_tokens) stream_chunk(q, i, safe > c->emitted ? safe : c->emitted, NULL);
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
    if (!q) {
        /* Finished or aborted already: a late message, not a refusal. A decode that still generates
         * for an id this router does not hold (KV made up by a peer holding a prefill key, or an
         * abort that was lost) is told to stop: its sequence costs one step, not max_tokens. */
        if (from->role == PRISM__ROLE__ROLE_DECODE && t && t->finish == PRISM__FINISH__FINISH_NONE)
            send_abort(r, from->id, rid);
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

bool router_handle_encode_done(router_t *r, const router_worker_t *from, uint64_t rid, uint64_t rid_hi,
                               const Prism__EncodeDone *d)
{
    router_req_t *q = router_req_get(r, rid);
    if (!q) return router_early_encode_done(r, from, rid, rid_hi, d);  /* an early job, or a request that ended */
    /* Only the encoder this image went to, once, naming the whole id. */
    if (rid_hi != q->rid_hi || d->image_index >= (uint32_t)q->prompt.n_images || !q->encode_pending[d->image_index] ||
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
        q->early_id[i] = 0;
    }
    if (q->prefill_pending) worker_done(r, q->prefill_id, 1);
    if (q->decode_pending) worker_done(r, q->decode_id, n_choices(q));
    q->prefill_pending = q->decode_pending = false;
    q->prefill_id[0] = q->decode_id[0] = '\0';
    for (int i = 0; i < q->n_held; i++) prism_msg_env_free(q->held[i]);  /* the old attempt's decode tokens */
    q->n_held = 0;
    /* A new id: late messages for the old one (from workers that had started) match nothing, and
     * no worker's memory of the abort can catch the request's next dispatch. */
    router_req_del(r, q->rid);
    int rc = router_req_new_id(r, &q->rid, &q->rid_hi);
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

/* A worker holding a request that has sent tokens to its client is gone (its decode, or its
 * prefill before the KV reached the decode): with n = 1 the request goes on from its last token on
 * another prefill/decode pair, ahead of the queue. The prefill gets the prompt and every token
 * generated so far (Sampling.generated says how many): it counts them for the penalties, feeds them
 * to the guide and advances the RNG past them (prism_seq_seed), so the next token is the one the
 * lost worker would have sampled, and the new decode goes on from there. The router's side simply
 * continues (text, detokenizer, stop-string holdback, logprobs, the stream): no gap, no repeat.
 * The images are encoded again from the bytes kept for it. A new id, as for a retry: what the old
 * workers still send matches nothing. n > 1 is not migrated (the choices' RNG streams fork at the
 * first token; their later states died with the worker): it fails as before. */
static bool req_migrate(router_req_t *q, const router_worker_t *w, const char *why)
{
    router_t *r = q->r;
    router_choice_t *c = &q->choices[0];
    if (q->stage != STAGE_PREFILLED || !may_migrate(q) || c->finish || c->n_out != q->n_gen ||
        q->n_gen >= q->prompt.max_tokens || r->queue_len == r->reqs_cap)
        return false;
    uint64_t old = q->rid;
    snprintf(q->avoid[q->n_avoid++ % PRISM_ARRAY_LEN(q->avoid)], sizeof(q->avoid[0]), "%s", w->id);
    q->n_avoid = PRISM_MIN(q->n_avoid, (int)PRISM_ARRAY_LEN(q->avoid));
    req_release_workers(q);
    c->got_first = c->worker_ended = false;
    q->n_first = q->n_worker_ended = 0;
    q->decode_heard = false;
    q->stage = STAGE_QUEUED;
    q->attempts = 0;             /* the new pair gets --max-retries of its own */
    q->migrations++;
    q->t_wait = prism_now_s();   /* --max-queue-wait counts from now */
    bool queued = queue_push_front(r, q->rid);  /* room checked above */
    PRISM_ASSERT(queued);
    r->metrics.migrated++;
    r->queue_dirty = true;
    PRISM_INFO("request %llu: %s; migrated as %llu after %d tokens (migration %d of %d)", (unsigned long long)old, why,
               (unsigned long long)q->rid, q->n_gen, q->migrations, r->max_migrations);
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
        /* After its first token a prefill still holds the KV until the decode worker takes it (the
         * decode's first token says it did): its death before then may leave the decode nothing to
         * run, so a request that may migrate does (one that may not waits for its decode tokens, as
         * before migration existed: the KV may be on its way, else --request-timeout ends it). */
        held |= q->stage == STAGE_PREFILLED && q->decode_pending && !q->decode_heard && may_migrate(q) &&
                !strcmp(q->prefill_id, w->id);
        if (held) {
            char msg[256];
            snprintf(msg, sizeof(msg), "The %s worker serving this request %s.", prism_role_name(w->role), why);
            if (!req_retry(q, msg) && !req_migrate(q, w, msg)) req_fail(q, 503, msg);
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
        if (q->stage != STAGE_PREFILLED && now - q->t_wait > r->max_queue_wait_s) {
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

/* KV blocks a decode worker needs for the request's n sequences sharing the prompt's full blocks
 * (decode_worker's admission rule, prism_kv_blocks_for_shared). */
static uint64_t decode_blocks_needed(const router_worker_t *w, const router_req_t *q)
{
    uint64_t bs = PRISM_MAX(w->block_size, 1u), n = (uint64_t)n_choices(q), prompt = q->prompt.n_tokens;
    uint64_t total = PRISM_MIN(prompt + (uint64_t)q->prompt.max_tokens, (uint64_t)PRISM_MAX(w->max_model_len, 1u));
    uint64_t per = (total + bs - 1) / bs, shared = n > 1 ? prompt / bs : 0;
    return shared + n * (per - shared);
}

/* Whether some registered decode worker could ever hold the request (batch and KV). */
static bool decode_fits(router_t *r, const router_req_t *q, char *msg, size_t n)
{
    uint32_t best_running = 0;
    uint64_t best_blocks = 0;
    for (int i = 0; i < ROUTER_MAX_WORKERS; i++) {
        const router_worker_t *w = &r->workers[i];
        if (!w->used || w->role != PRISM__ROLE__ROLE_DECODE) continue;
        if (w->max_running >= (uint32_t)n_choices(q) && decode_blocks_needed(w, q) <= w->kv_blocks) return true;
        best_running = PRISM_MAX(best_running, w->max_running);
        best_blocks = PRISM_MAX(best_blocks, (uint64_t)w->kv_blocks);
    }
    if (best_running < (uint32_t)n_choices(q))
        snprintf(msg, n, "n=%d is more than the decode workers run at once (%u).", n_choices(q), best_running);
    else
        snprintf(msg, n, "n=%d sequences of up to %d tokens need more KV cache than a decode worker has (%llu blocks); "
                 "lower n or max_tokens.", n_choices(q), q->prompt.max_tokens, (unsigned long long)best_blocks);
    return false;
}

/* router_pick, passing over the workers an earlier attempt of this request got stuck on while
 * another has room (they look full for the pick); only they left: them rather than nothing. */
static router_worker_t *pick(router_t *r, router_req_t *q, Prism__Role role, uint64_t hash, int slots, uint64_t bytes,
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
    router_worker_t *w = router_pick_slots(r, role, hash, slots, bytes, any);
    for (int i = 0; i < n; i++) hidden[i]->inflight -= HIDE;
    return w || !n ? w : router_pick_slots(r, role, hash, slots, bytes, any);
}

/* The tiers a request needs: every request a prefill and a decode worker, an image request encoders. */
enum { TIER_ENCODER = 1, TIER_PREFILL = 2, TIER_DECODE = 4 };

static unsigned tiers_needed(const router_req_t *q)
{
    return TIER_PREFILL | TIER_DECODE | (q->prompt.n_images ? TIER_ENCODER : 0);
}

/* Whether a new request must queue behind waiting ones: they wait for a tier it needs too. */
static bool queue_blocks(router_t *r, const router_req_t *q)
{
    unsigned blocked = 0;
    for (size_t k = 0; k < r->queue_len; k++) {
        const router_req_t *o = router_req_get(r, r->queue[(r->queue_head + k) % r->reqs_cap]);
        if (o && o->stage == STAGE_QUEUED) blocked |= o->wait_tiers ? o->wait_tiers : tiers_needed(o);
        if (blocked & (TIER_PREFILL | TIER_DECODE)) return true;
    }
    return (blocked & tiers_needed(q)) != 0;
}

/* Sends the request to its workers: 0 when sent, DISPATCH_WAIT when it must wait in the router's
 * queue (every worker of a tier is at capacity, a tier has no worker at all, or a worker could not
 * be reached), else an HTTP status with msg (n sequences no decode worker could ever hold). */
#define DISPATCH_WAIT 1
static int dispatch(router_t *r, router_req_t *q, char *msg, size_t n)
{
    bool any_pf, any_dc, any_enc = true;
    int slots = n_choices(q);
    router_worker_t *pf = pick(r, q, PRISM__ROLE__ROLE_PREFILL, 0, 1, 0, &any_pf);
    router_worker_t *dc = pick(r, q, PRISM__ROLE__ROLE_DECODE, 0, slots, 0, &any_dc);
    router_worker_t *enc[ROUTER_MAX_IMAGES] = {0};
    uint64_t early[ROUTER_MAX_IMAGES] = {0};
    bool enc_room = true;
    for (int i = 0; i < q->prompt.n_images && enc_room; i++) {
        /* an early job of this image still held: the request takes it over (its slot is counted) */
        if ((enc[i] = router_early_claim(r, q->prompt.img_hash[i], early, i, &early[i]))) continue;
        enc[i] = pick(r, q, PRISM__ROLE__ROLE_ENCODER, q->prompt.img_hash[i], 1, q->prompt.img_len[i], &any_enc);
        if (enc[i]) {  /* count now so the next image sees this one */
            enc[i]->inflight++;
            enc[i]->queued_bytes += q->prompt.img_len[i];
        } else {
            enc_room = false;
        }
    }
    for (int i = 0; i < q->prompt.n_images; i++)
        if (enc[i] && !early[i]) {
            enc[i]->inflight--;
            enc[i]->queued_bytes -= q->prompt.img_len[i];
        }
    /* A tier with no worker at all waits too (bounded by --max-queue-wait): a restarted worker
     * re-registers within seconds, and the request is served then instead of refused now. */
    q->waiting_for = !any_pf ? "prefill" : !any_dc ? "decode" : !any_enc ? "encoder" : NULL;
    /* n sequences no registered decode worker could ever hold (batch or KV) never get room: 400. */
    if (any_dc && !decode_fits(r, q, msg, n)) {
        r->metrics.refused_limit[PRISM_REFUSE_BAD_REQUEST]++;
        return 400;
    }
    q->wait_tiers = (pf ? 0 : TIER_PREFILL) | (dc ? 0 : TIER_DECODE) | (enc_room ? 0 : TIER_ENCODER);
    if (!pf || !dc || !enc_room) {
        PRISM_DEBUG("request %llu waits: %s", (unsigned long long)q->rid,
                    !pf ? "no prefill worker with room" : !dc ? "no decode worker with room" : "no encoder with room");
        return DISPATCH_WAIT;
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
    sp.temperature = q->oai.greedy ? 0.0f : (float)q->oai.temperature;
    sp.top_p = q->oai.greedy ? 1.0f : (float)q->oai.top_p;
    sp.top_k = (int32_t)q->oai.top_k;
    sp.has_seed = q->oai.has_seed;
    sp.seed = (uint64_t)q->oai.seed;
    sp.max_tokens = (uint32_t)q->prompt.max_tokens;
    sp.n_stop_token_ids = (size_t)q->oai.n_stop_token_ids;
    sp.stop_token_ids = stop_ids;
    sp.ignore_eos = q->oai.ignore_eos;
    sp.logprobs = q->oai.logprobs ? 1u + (uint32_t)q->oai.top_logprobs : 0u;
    sp.presence_penalty = (float)q->oai.presence_penalty;
    sp.frequency_penalty = (float)q->oai.frequency_penalty;
    sp.repetition_penalty = (float)q->oai.repetition_penalty;
    sp.n_logit_bias_ids = sp.n_logit_bias_values = (size_t)q->oai.n_logit_bias;
    sp.logit_bias_ids = q->oai.logit_bias_ids;
    sp.logit_bias_values = q->oai.logit_bias_values;
    sp.n = (uint32_t)slots;
    /* a migrated request: the prompt and every token generated so far (req_migrate) */
    int32_t *ids = q->prompt.tokens;
    size_t n_ids = q->prompt.n_tokens;
    if (q->n_gen) {
        ids = prism_malloc((n_ids + (size_t)q->n_gen) * sizeof *ids);
        if (!ids) {
            snprintf(msg, n, "The server is out of memory; try again shortly.");
            return 503;
        }
        memcpy(ids, q->prompt.tokens, n_ids * sizeof *ids);
        memcpy(ids + n_ids, q->gen, (size_t)q->n_gen * sizeof *ids);
        n_ids += (size_t)q->n_gen;
        sp.generated = (uint32_t)q->n_gen;
    }
    Prism__Guide guide = PRISM__GUIDE__INIT;
    if (q->guide.kind) {
        guide.kind = (Prism__GuideKind)q->guide.kind;
        guide.text = (char *)q->guide.text;
        guide.tool_name = (char *)(q->guide.tool_name ? q->guide.tool_name : "");
        guide.tool_parallel = q->guide.tool_parallel;
        guide.tool_format = (uint32_t)q->guide.tool_format;
        sp.guide = &guide;
    }
    Prism__Prefill p = PRISM__PREFILL__INIT;
    p.n_token_ids = n_ids;
    p.token_ids = ids;
    p.n_images = (size_t)q->prompt.n_images;
    p.images = span_ptrs;
    p.sampling = &sp;
    p.decode_endpoint = dc->data_endpoint;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_PREFILL;
    env.request_id = q->rid;
    env.request_id_hi = q->rid_hi;
    env.prefill = &p;
    /* A send fails when the worker's connection is gone (it died; the registry drops it at
     * --worker-timeout): the request waits for the next try rather than failing. */
    int sent = router_send(r, pf, &env, NULL, 0);
    if (ids != q->prompt.tokens) prism_free(ids);
    if (sent != PRISM_OK) {
        PRISM_WARN("request %llu: prefill worker %s unreachable; the request waits", (unsigned long long)q->rid, pf->id);
        return DISPATCH_WAIT;
    }
    snprintf(q->prefill_id, sizeof(q->prefill_id), "%s", pf->id);
    snprintf(q->decode_id, sizeof(q->decode_id), "%s", dc->id);
    q->prefill_pending = q->decode_pending = true;
    pf->inflight++;
    dc->inflight += slots;   /* each sequence takes a slot of the decode batch */
    for (int i = 0; i < q->prompt.n_images; i++) {
        Prism__Encode e = PRISM__ENCODE__INIT;
        e.image_index = (uint32_t)i;
        e.content_hash = q->prompt.img_hash[i];
        e.prefill_endpoint = pf->data_endpoint;
        /* a done early job of this image there: named too, so the encoder counts no hit for it */
        e.early_id = early[i] ? early[i] : router_early_take_done(r, q->prompt.img_hash[i], enc[i]);
        Prism__Envelope ee = PRISM__ENVELOPE__INIT;
        ee.type = PRISM__MSG_TYPE__MSG_ENCODE;
        ee.request_id = q->rid;
        ee.request_id_hi = q->rid_hi;
        ee.encode = &e;
        /* copied: a retry on another encoder sends the same bytes again (and a migration: the bytes
         * are freed at the first token only when no migration may follow) */
        PRISM_ASSERT(q->prompt.img[i]);
        prism_frame_t f = {q->prompt.img[i], q->prompt.img_len[i]};
        if (router_send(r, enc[i], &ee, &f, 1) != PRISM_OK) {
            PRISM_WARN("request %llu: encoder %s unreachable; the request waits", (unsigned long long)q->rid,
                       enc[i]->id);
            req_release_workers(q);
            return DISPATCH_WAIT;
        }
        snprintf(q->encoder_id[i], sizeof(q->encoder_id[i]), "%s", enc[i]->id);
        q->encode_pending[i] = true;
        q->early_id[i] = early[i];
        if (early[i]) {
            router_early_adopted(r, early[i]);   /* its slot and bytes, counted already, are this image's */
        } else {
            enc[i]->inflight++;
            enc[i]->queued_bytes += q->prompt.img_len[i];
        }
        router_worker_note_image(enc[i], q->prompt.img_hash[i]);
    }
    q->stage = STAGE_SENT;
    q->t_dispatch = prism_now_s();
    if (!q->t_sent) q->t_sent = q->t_dispatch;
    q->attempts++;
    return 0;
}

/* The request's output constraint (response_format / guided_*, or the grammar forcing a tool
 * call) compiled once here (cached by its text) so a bad one is a 400 naming the field; the
 * workers compile the same text against their own vocabularies. Returns 0 or an HTTP status
 * with msg / param filled. */
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

/* Tries the queued requests, oldest first. A request that must wait blocks the tiers it waits for:
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
    unsigned blocked = 0;
    for (size_t k = 0; k < n; k++) {
        router_req_t *q = router_req_get(r, r->queue_scratch[k]);
        if (!q || q->stage != STAGE_QUEUED) continue;  /* ended (or sent again) while it waited */
        unsigned need = tiers_needed(q);
        if (!(need & blocked)) {
            char msg[300];
            int status = dispatch(r, q, msg, sizeof(msg));
            if (status != DISPATCH_WAIT) {
                if (status) req_fail(q, status, msg);
                continue;
            }
            blocked |= q->wait_tiers ? q->wait_tiers : need;
        }
        bool ok = queue_push(r, q->rid);  /* back in its order (a failed send gave it a new id) */
        PRISM_ASSERT(ok);                 /* it was in the queue: its place is still there */
        (void)ok;
    }
    r->draining = false;
    if (!r->queue_len) prism_http_server_resume_bodies(r->http);  /* uploads paused for it go on */
}

/* Preparing a request is the CPU-heavy part of its life: parsing its JSON, decoding and hashing its
 * images, rendering the chat template, tokenizing. It runs on libuv's thread pool (--prep-threads),
 * so the loop thread only does I/O: an 8 MiB prompt no longer stalls every stream and every other
 * client for the second it takes to tokenize. prep_run reads only the request's body and the
 * router's configuration and model (tokenizer and template are immutable); everything the router
 * keeps (metrics, workers, the request map, the guide cache) is touched in prep_done, on the loop. */
static void prep_run(uv_work_t *w)
{
    router_req_t *q = w->data;
    const router_t *r = q->r;
    size_t blen = 0;
    const char *body = prism_http_req_body(q->h, &blen);
    prism_oai_parse_opts_t popts = {.max_images = r->max_images_per_prompt, .vocab = r->cfg.vocab};
    q->parsed = prism_oai_parse(body, blen, q->chat, &popts, &q->oai, &q->perr) == PRISM_OK;
    if (!q->parsed) return;
    if (q->chat)
        q->prep_status = router_prompt_load_images(r, &q->prompt, &q->oai, q->h, q->prep_refused, q->prep_msg,
                                                   sizeof q->prep_msg);
    if (!q->prep_status)
        q->prep_status = router_prompt_build(r, &q->prompt, &q->oai, q->chat, q->prep_msg, sizeof q->prep_msg);
}

static void on_prep_gone(prism_http_req_t *h, void *ud)
{
    (void)h;
    ((router_req_t *)ud)->prep_gone = true;   /* prep_done lets it go */
}

static void prep_done(uv_work_t *w, int wstatus);

void router_handle_generate(router_t *r, prism_http_req_t *h, bool chat)
{
    if (r->shutting_down) {  /* a keep-alive connection's next request while draining */
        router_respond_error(h, 503, "The server is shutting down; retry on another instance.", NULL);
        prism_http_req_release(h);
        return;
    }
    /* Requests being prepared count as in flight: the pool's queue is bounded by --max-running-requests. */
    if ((int)(r->n_reqs + r->n_preparing) >= r->max_running) {
        r->metrics.refused_limit[PRISM_REFUSE_QUEUE_FULL]++;
        char msg[160];
        snprintf(msg, sizeof(msg), "The server is at capacity (%d requests in flight); retry after a short wait.",
                 r->max_running);
        router_respond_error(h, 429, msg, NULL);
        prism_http_req_release(h);
        return;
    }
    router_req_t *q = prism_calloc(1, sizeof(*q));
    if (!q) {
        router_respond_error(h, 503, "The server is out of memory; try again shortly.", NULL);
        prism_http_req_release(h);
        return;
    }
    q->r = r;
    q->h = h;
    q->chat = chat;
    q->t_start = q->t_wait = prism_now_s();
    q->prep.data = q;
    prism_http_req_on_abort(h, on_prep_gone, q);
    if (uv_queue_work(r->loop, &q->prep, prep_run, prep_done) != 0) {
        prism_http_req_on_abort(h, NULL, NULL);
        router_respond_error(h, 503, "The server could not queue the request; try again shortly.", NULL);
        q->h = NULL;
        prism_http_req_release(h);
        req_destroy(q);
        return;
    }
    r->n_preparing++;
}

static void prep_done(uv_work_t *w, int wstatus)
{
    router_req_t *q = w->data;
    router_t *r = q->r;
    prism_http_req_t *h = q->h;
    r->n_preparing--;
    router_prompt_take_images(&q->prompt, h);   /* the prompt's from here, whatever happens next */
    if (q->prep_gone || wstatus != 0 || !r->http) {   /* the client left, or the router stopped meanwhile */
        req_destroy(q);
        return;
    }
    prism_http_req_on_abort(h, NULL, NULL);
    char msg[600] = "", param[128] = "";
    int status = 0;
    bool chat = q->chat;
    int n = q->parsed ? n_choices(q) : 0;

    if (!q->parsed) {
        prism_oai_error_t *perr = &q->perr;
        r->metrics.refused_limit[PRISM_REFUSE_BAD_REQUEST]++;
        if (perr->refusal == PRISM_OAI_REFUSED_TOO_MANY_IMAGES) r->metrics.refused_limit[PRISM_REFUSE_TOO_MANY_IMAGES]++;
        prism_http_respond_error(h, perr->status ? perr->status : 400, perr->type[0] ? perr->type : "BadRequestError",
                                 perr->message, perr->param[0] ? perr->param : NULL, NULL, NULL);
        q->h = NULL;
        prism_http_req_release(h);
        req_destroy(q);
        return;
    }
    if (router_req_new_id(r, &q->rid, &q->rid_hi) != PRISM_OK) {
        status = 503;
        snprintf(msg, sizeof(msg), "The server has no randomness for request ids; try again shortly.");
        goto fail;
    }
    q->choices = prism_calloc((size_t)n, sizeof *q->choices);
    if (!q->choices) {
        status = 503;
        snprintf(msg, sizeof(msg), "The server is out of memory; try again shortly.");
        goto fail;
    }
    for (int i = 0; i < n; i++) {   /* zeroed until here: freeing them is a no-op */
        prism_detok_init(&q->choices[i].detok, r->tok, q->oai.skip_special_tokens);
        prism_oai_logprobs_init(&q->choices[i].lp, chat);
    }
    if (q->oai.model && strcmp(q->oai.model, r->served_model_name) != 0) {
        snprintf(msg, sizeof(msg), "The model `%s` does not exist.", q->oai.model);
        status = 404;
        goto fail;
    }
    if ((status = guide_setup(r, q, msg, sizeof(msg), param, sizeof(param))) != 0) goto fail;
    if ((int)r->n_reqs >= r->max_running) {
        r->metrics.refused_limit[PRISM_REFUSE_QUEUE_FULL]++;
        snprintf(msg, sizeof(msg), "The server is at capacity (%d requests in flight); retry after a short wait.",
                 r->max_running);
        status = 429;
        goto fail;
    }
    for (int i = 0; i < PRISM_REFUSE_COUNT; i++) r->metrics.refused_limit[i] += q->prep_refused[i];
    if ((status = q->prep_status) != 0) {
        snprintf(msg, sizeof(msg), "%s", q->prep_msg);
        goto fail;
    }
    prism_http_req_drop_body(q->h);
    router_prompt_release_inputs(&q->oai);
    if (prism_oai_resp_meta_init(&q->meta, chat, r->served_model_name) != PRISM_OK) {
        status = 503;
        snprintf(msg, sizeof(msg), "out of memory");
        goto fail;
    }
    if (q->parse_tools && q->oai.stream)
        for (int i = 0; i < n; i++)
            if (prism_toolcall_parser_create((prism_toolcall_format_t)r->tool_parser, tool_id_seed(q, i), 0,
                                             tool_max_calls(q), on_tool_event, &q->choices[i],
                                             &q->choices[i].tc) != PRISM_OK) {
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
    status = queue_blocks(r, q) ? DISPATCH_WAIT : dispatch(r, q, msg, sizeof(msg));
    if (status == DISPATCH_WAIT && !queue_push(r, q->rid)) {
        r->metrics.refused_limit[PRISM_REFUSE_QUEUE_FULL]++;
        req_fail(q, 429, "The server is at capacity; retry after a short wait.");
        return;
    }
    if (status != 0 && status != DISPATCH_WAIT) {
        req_fail(q, status, msg);
        return;
    }
    prism_http_req_set_user(h, q);
    prism_http_req_on_abort(h, on_client_gone, q);
    PRISM_DEBUG("request %llu: %zu prompt tokens, %d images, max_tokens %d, n %d%s (id high half %016llx)",
                (unsigned long long)q->rid, q->prompt.n_tokens, q->prompt.n_images, q->prompt.max_tokens, n,
                q->guide.kind ? ", guided" : "", (unsigned long long)q->rid_hi);
    return;

fail:
    if (status >= 400 && status < 500 && status != 429) r->metrics.refused_limit[PRISM_REFUSE_BAD_REQUEST]++;
    router_respond_error(h, status, msg, param[0] ? param : NULL);
    q->h = NULL;
    prism_http_req_release(h);
    req_destroy(q);
}
