/* What a generation request's client receives: per choice, incremental detokenization, logprob
 * entries, stop strings (held back while streaming), tool-call parsing; then SSE chunks, or one JSON
 * response at the end; error answers. The request's life (requests.c) says when; this file says
 * what the bytes are. A client that stops reading a stream is dropped here. */
#include "request.h"

#include <stdio.h>
#include <string.h>
#include <xxhash.h>

void router_respond_error(prism_http_req_t *h, int status, const char *message, const char *param)
{
    const char *extra = (status == 429 || status == 503) ? "Retry-After: 1\r\n" : NULL;
    prism_http_respond_error(h, status, prism_oai_error_type(status), message, param, NULL, extra);
}

/* ---------------------------------------------------------------- tool calls while streaming */

static void on_tool_event(void *ud, const prism_toolcall_event_t *ev)
{
    router_choice_t *c = ud;
    if (ev->kind == PRISM_TC_CONTENT) {
        if (prism_buf_append(&c->d_content, ev->text, ev->len)) c->tc_failed = true;
        return;
    }
    router_tool_delta_t *last = c->n_d_tools ? &c->d_tools[c->n_d_tools - 1] : NULL;
    if (ev->kind == PRISM_TC_ARGS && last && last->index == ev->index && last->args_off + last->args_len == c->d_args.len) {
        /* consecutive fragments of one call: one delta entry */
        if (prism_buf_append(&c->d_args, ev->text, ev->len)) c->tc_failed = true;
        else last->args_len += ev->len;
        return;
    }
    if (c->n_d_tools == c->cap_d_tools) {
        int cap = c->cap_d_tools ? c->cap_d_tools * 2 : 8;
        router_tool_delta_t *t = prism_realloc(c->d_tools, (size_t)cap * sizeof *t);
        if (!t) {
            c->tc_failed = true;
            return;
        }
        c->d_tools = t;
        c->cap_d_tools = cap;
    }
    router_tool_delta_t *t = &c->d_tools[c->n_d_tools++];
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
    return XXH3_64bits_withSeed(k, sizeof k, (uint64_t)q->out.meta.created);
}

int router_out_init(router_req_t *q)
{
    router_t *r = q->r;
    int n = router_req_n(q);
    q->out.choices = prism_calloc((size_t)n, sizeof *q->out.choices);
    if (!q->out.choices) return PRISM_ENOMEM;
    for (int i = 0; i < n; i++) {   /* zeroed until here: freeing them is a no-op */
        prism_detok_init(&q->out.choices[i].detok, r->tok, q->oai.skip_special_tokens);
        prism_oai_logprobs_init(&q->out.choices[i].lp, q->chat);
    }
    if (prism_oai_resp_meta_init(&q->out.meta, q->chat, r->served_model_name) != PRISM_OK) return PRISM_ENOMEM;
    if (q->parse_tools && q->oai.stream)
        for (int i = 0; i < n; i++)
            if (prism_toolcall_parser_create((prism_toolcall_format_t)r->tool_parser, tool_id_seed(q, i), 0,
                                             tool_max_calls(q), on_tool_event, &q->out.choices[i],
                                             &q->out.choices[i].tc) != PRISM_OK)
                return PRISM_ENOMEM;
    return PRISM_OK;
}

/* ---------------------------------------------------------------- streaming */

static void write_out(router_req_t *q)
{
    prism_http_stream_write(q->h, q->out.buf.data, q->out.buf.len);
    if (prism_http_req_pending_bytes(q->h) > q->r->max_stream_pending) {
        /* The client stopped reading: drop it rather than queue its whole answer in memory. Its
         * abort callback (requests.c on_client_gone) runs from the loop's next turn and aborts the
         * workers; writes until then fail harmlessly. */
        q->r->metrics.refused_limit[PRISM_REFUSE_SLOW_CLIENT]++;
        PRISM_WARN("request %llu: client stopped reading (%zu bytes queued); dropped", (unsigned long long)q->rid,
                   prism_http_req_pending_bytes(q->h));
        prism_http_req_drop(q->h);
    }
}

/* "x-request-id: <id>" (vLLM's) and "traceparent: 00-<trace id>-<span id>-<flags>" (W3C: the
 * client's trace, the router's span, named by the request's id), each with its CRLF. */
static void id_headers(const router_req_t *q, char *out, size_t n)
{
    char trace[33];
    prism_trace_id_hex(q->trace, trace);
    snprintf(out, n, "x-request-id: %s\r\ntraceparent: 00-%s-%016llx-%02x\r\n", q->out.meta.id, trace,
             (unsigned long long)q->rid, q->trace_flags);
}

static bool stream_begin(router_req_t *q)
{
    if (q->out.streaming_started) return true;
    char extra[256], ids[192];
    id_headers(q, ids, sizeof ids);
    snprintf(extra, sizeof(extra), "Cache-Control: no-cache\r\n%s", ids);
    if (prism_http_stream_begin(q->h, 200, "text/event-stream", extra) != PRISM_OK) return false;
    q->out.streaming_started = true;
    return true;
}

/* A chat chunk of choice i: its text (through the tool parser when it parses calls: then the
 * content and call deltas it decided, in batches of 64 entries per chunk). */
static void chat_chunk(router_req_t *q, int i, const char *t, size_t n, const prism_oai_logprobs_t *lp,
                       const char *finish)
{
    router_choice_t *c = &q->out.choices[i];
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
    do {   /* one call per chunk is the usual case */
        prism_oai_tool_delta_t deltas[64];
        int nd = 0;
        for (; k < n_tools && nd < (int)PRISM_ARRAY_LEN(deltas); k++) {
            const router_tool_delta_t *pt = &c->d_tools[k];
            deltas[nd++] = (prism_oai_tool_delta_t){
                .index = pt->index, .id = pt->begin ? pt->id : NULL, .name = pt->begin ? pt->name : NULL,
                .arguments = c->d_args.data ? c->d_args.data + pt->args_off : "", .arguments_len = pt->args_len};
        }
        bool last = k >= n_tools;
        if (content_len || nd || (last && (finish || lp))) {
            prism_oai_delta_t d = {.index = i, .content = content_len ? content : NULL, .len = content_len,
                                   .tool_calls = deltas, .n_tool_calls = nd, .lp = last ? lp : NULL,
                                   .finish_reason = last ? finish : NULL};
            prism_oai_write_chat_delta(&q->out.buf, &q->out.meta, &d);
        }
        content_len = 0;
    } while (k < n_tools);
}

/* Streams text[emitted .. upto) of choice i (and its pending logprobs) as one chunk; with tool
 * parsing, the text goes through the parser and the chunk carries what it decided. */
static void stream_chunk(router_req_t *q, int i, size_t upto, const char *finish)
{
    if (!q->h || !stream_begin(q)) return;
    router_choice_t *c = &q->out.choices[i];
    if (q->chat && !c->role_sent) {
        /* vLLM's first chunk of each choice: the role with empty content. */
        prism_oai_delta_t d = {.index = i, .role = true, .content = "", .len = 0};
        prism_buf_reset(&q->out.buf);
        prism_oai_write_chat_delta(&q->out.buf, &q->out.meta, &d);
        write_out(q);
        c->role_sent = true;
    }
    const char *t = c->text.data ? c->text.data + c->emitted : "";
    size_t n = upto > c->emitted ? upto - c->emitted : 0;
    const prism_oai_logprobs_t *lp = q->oai.logprobs && c->lp.n_tokens ? &c->lp : NULL;
    prism_buf_reset(&q->out.buf);
    if (!q->chat) {
        if (!n && !finish && !lp) return;
        prism_oai_write_completion_chunk_at(&q->out.buf, &q->out.meta, i, t, n, lp, finish);
    } else {
        chat_chunk(q, i, t, n, lp, finish);
        if (!q->out.buf.len) {
            c->emitted = upto;
            return;
        }
    }
    write_out(q);
    c->emitted = upto;
    if (lp) prism_oai_logprobs_clear(&c->lp);
}

void router_out_choice_end(router_req_t *q, int i)
{
    router_choice_t *c = &q->out.choices[i];
    if (q->oai.stream && q->h && !prism_http_req_aborted(q->h)) stream_chunk(q, i, c->text.len, c->finish);
}

/* ---------------------------------------------------------------- completion */

const char *const router_time_stage_names[ROUTER_TS_COUNT] = {
    "prepare", "fetch", "router_queue", "encoder_queue", "encoder_wait", "image_decode", "vit", "prefill_queue", "prefill",
    "dispatch", "kv_transfer", "decode_queue", "decode_first_step", "decode"};

/* The span from *at to the router's mark (clamped so marks never run backwards or past now; 0: not
 * reached, an empty span); *at moves to its end. */
static double stage_span(double *at, double mark, double now)
{
    double to = mark > 0 ? PRISM_MIN(PRISM_MAX(mark, *at), now) : *at;
    double d = to - *at;
    *at = to;
    return d;
}

/* Up to want seconds (a worker's measure) out of what is *left of a span: what it took. */
static double stage_take(double *left, double want)
{
    double v = PRISM_MIN(PRISM_MAX(want, 0.0), *left);
    *left -= v;
    return v;
}

void router_out_stages(const router_req_t *q, double now, double s[ROUTER_TS_COUNT])
{
    /* The router's clock marks the spans (admitted, first attempt sent, the prefill's first token, the
     * decode's first message, now), so the stages add up to now - start by construction. Inside a
     * span, what the workers measured (durations on their own clocks) is taken in order, each at most
     * what is left, and the span's rest is its remainder stage: nothing counted twice, no gap unnamed. */
    const router_times_t *t = &q->time;
    double at = t->start;
    double left = stage_span(&at, t->admit, now);
    s[ROUTER_TS_FETCH] = stage_take(&left, t->fetch_ms / 1e3);
    s[ROUTER_TS_PREPARE] = left;
    s[ROUTER_TS_ROUTER_QUEUE] = stage_span(&at, t->sent, now);
    left = stage_span(&at, t->first, now);
    s[ROUTER_TS_PREFILL_QUEUE] = stage_take(&left, t->queue_ms / 1e3);
    s[ROUTER_TS_PREFILL] = stage_take(&left, t->prefill_ms / 1e3);
    /* the prefill's wait for embeddings: the encoders' queue and work (sums over images, so at most
     * the wait when images ran side by side) and the rest: an early encode it waited on, the
     * embeddings' transfer */
    double wait = stage_take(&left, t->embed_wait_ms / 1e3);
    s[ROUTER_TS_ENCODER_QUEUE] = stage_take(&wait, t->enc_queue_ms / 1e3);
    s[ROUTER_TS_IMAGE_DECODE] = stage_take(&wait, t->decode_ms / 1e3);
    s[ROUTER_TS_VIT] = stage_take(&wait, t->vit_ms / 1e3);
    s[ROUTER_TS_ENCODER_WAIT] = wait;
    s[ROUTER_TS_DISPATCH] = left;
    left = stage_span(&at, t->first_decode, now);
    s[ROUTER_TS_DECODE_QUEUE] = stage_take(&left, t->dec_queue_ms / 1e3);
    s[ROUTER_TS_DECODE_FIRST_STEP] = stage_take(&left, t->dec_step_ms / 1e3);
    s[ROUTER_TS_KV_TRANSFER] = left;
    s[ROUTER_TS_DECODE] = now - at;
}

void router_out_timing(const router_req_t *q, double now, char *out, size_t n)
{
    const router_times_t *t = &q->time;
    int n_seq = router_req_n(q);
    double ttft = t->first > 0 ? (t->first - t->start) * 1e3 : 0;
    double dec_s = t->last - t->first;
    int per = q->out.n_out / n_seq;
    double tps = per > 1 && dec_s > 0 ? (per - 1) / dec_s : 0;
    /* router_ms: from the last body byte (the handler runs then) to the work handed to ZeroMQ, queueing
     * in the router for a free worker included, but not fetch_ms: the wait for its images by URL */
    double router_ms = t->sent > 0 ? PRISM_MAX((t->sent - t->start) * 1e3 - t->fetch_ms, 0.0) : 0;
    /* stages_ms: the partition of e2e_ms (prism:request_stage_seconds); the other fields are the
     * workers' raw measures (queue_ms: the prefill's arrival to its start, embeddings' wait included) */
    double st[ROUTER_TS_COUNT];
    router_out_stages(q, now, st);
    char stages[ROUTER_TS_COUNT * 32];
    size_t k = 0;
    for (int i = 0; i < ROUTER_TS_COUNT && k < sizeof stages; i++)
        k += (size_t)snprintf(stages + k, sizeof stages - k, "%s%s:%.2f", i ? "," : "", router_time_stage_names[i],
                              st[i] * 1e3);
    snprintf(out, n, "upload_ms=%.2f images=%d cache_hits=%d fetch_ms=%.2f router_ms=%.2f image_decode_ms=%.2f vit_ms=%.2f "
             "queue_ms=%.2f prefill_ms=%.2f ttft_ms=%.2f decode_tokens=%d decode_tok_s=%.1f e2e_ms=%.2f stages_ms=%s",
             (t->start - t->began) * 1e3, q->prompt.n_images, t->cache_hits, t->fetch_ms, router_ms, t->decode_ms, t->vit_ms,
             t->queue_ms + t->embed_wait_ms, t->prefill_ms, ttft, q->out.n_out > 0 ? q->out.n_out - n_seq : 0, tps,
             (now - t->start) * 1e3, stages);
}

/* The whole (non-streaming) answer: one choice per sequence, tool calls parsed out of the text. */
static void respond_whole(router_req_t *q, const prism_oai_usage_t *u, const char *timing)
{
    prism_buf_t *b = &q->out.buf;
    prism_buf_reset(b);
    prism_oai_write_response_begin(b, &q->out.meta);
    for (int i = 0; i < router_req_n(q); i++) {
        router_choice_t *c = &q->out.choices[i];
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
        if (q->chat) prism_oai_write_chat_choice(b, &ch);
        else prism_oai_write_completion_choice(b, &ch);
        prism_toolcall_result_free(&res);
        prism_free(calls);
    }
    prism_oai_write_response_end(b, u);
    char extra[1400], ids[192];
    id_headers(q, ids, sizeof ids);
    if (q->r->timing_header)
        snprintf(extra, sizeof(extra), "%sx-prism-timing: %s\r\n", ids, timing);
    else
        snprintf(extra, sizeof(extra), "%s", ids);
    prism_http_respond(q->h, 200, "application/json", extra, b->data, b->len);
}

void router_out_complete(router_req_t *q, const prism_oai_usage_t *u, const char *timing)
{
    if (!q->h || prism_http_req_aborted(q->h)) return;
    if (!q->oai.stream) {
        respond_whole(q, u, timing);
        return;
    }
    if (!stream_begin(q)) return;
    prism_buf_reset(&q->out.buf);
    if (q->oai.include_usage) prism_oai_write_usage_chunk(&q->out.buf, &q->out.meta, u);
    prism_oai_write_sse_done(&q->out.buf);
    write_out(q);
    prism_http_stream_end(q->h);
}

void router_out_error(router_req_t *q, int status, const char *message)
{
    if (!q->h || prism_http_req_aborted(q->h)) return;
    if (!q->out.streaming_started) {
        router_respond_error(q->h, status, message, NULL);
        return;
    }
    prism_buf_reset(&q->out.buf);
    prism_oai_write_sse_error(&q->out.buf, prism_oai_error_type(status), message, NULL, NULL);
    prism_oai_write_sse_done(&q->out.buf);
    prism_http_stream_write(q->h, q->out.buf.data, q->out.buf.len);
    prism_http_stream_end(q->h);
}

/* ---------------------------------------------------------------- text, stop strings, logprobs */

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
    prism_buf_t *tb = &q->out.tok_bytes[0], *cb = &q->out.tok_bytes[1];
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

const char *router_out_tokens(router_req_t *q, int i, const Prism__Tokens *t)
{
    router_choice_t *c = &q->out.choices[i];
    size_t old_len = c->text.len;
    for (size_t k = 0; k < t->n_token_ids; k++) {
        int32_t tok = t->token_ids[k];
        c->n_out++;
        q->out.n_out++;
        if (q->oai.logprobs && k < t->n_logprobs) add_logprobs(q, c, tok, t->logprobs[k]);
        /* EOS and stop token ids end the text without being part of it. */
        bool final_stop = t->finish == PRISM__FINISH__FINISH_STOP && k + 1 == t->n_token_ids;
        if (!final_stop) prism_detok_push(&c->detok, tok, &c->text);
    }
    bool finished = t->finish != PRISM__FINISH__FINISH_NONE;
    if (finished) prism_detok_flush(&c->detok, &c->text);
    if (apply_stop_strings(q, c, old_len)) return "stop";
    if (finished) return t->finish == PRISM__FINISH__FINISH_STOP ? "stop" : "length";
    return NULL;
}

void router_out_progress(router_req_t *q, int i)
{
    router_choice_t *c = &q->out.choices[i];
    if (!q->oai.stream) return;
    size_t safe = c->text.len - stop_holdback(q, c);
    if (safe > c->emitted || c->lp.n_tokens) stream_chunk(q, i, safe > c->emitted ? safe : c->emitted, NULL);
}
