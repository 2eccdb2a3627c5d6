/* HTTP endpoints: OpenAI API, health, readiness, models, tokenize/detokenize, metrics; the status
 * page and its JSON are in status.c. */
#include "router.h"
#include "fetch.h"
#include "openai_req.h"
#include "openai_write.h"
#include "core/utf8.h"

#include <stdio.h>
#include <string.h>

static int hex_digit(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

static void respond_json(prism_http_req_t *h, int status, const char *json, size_t len)
{
    prism_http_respond(h, status, "application/json", NULL, json, len);
}

static void respond_jansson(prism_http_req_t *h, int status, json_t *j)
{
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    if (!s) {
        prism_http_respond_error(h, 500, "InternalServerError", "could not serialise the response", NULL, NULL, NULL);
        return;
    }
    respond_json(h, status, s, strlen(s));
    prism_free(s);  /* jansson allocates through prism_malloc (set in main) */
}

static json_t *model_card(router_t *r)
{
    return json_pack("{s:s,s:s,s:I,s:s,s:s,s:i,s:[]}", "id", r->served_model_name, "object", "model", "created",
                     (json_int_t)r->created, "owned_by", "prism", "root", r->served_model_name, "max_model_len",
                     r->max_model_len, "permission");
}

static void handle_models(router_t *r, prism_http_req_t *h)
{
    respond_jansson(h, 200, json_pack("{s:s,s:[o]}", "object", "list", "data", model_card(r)));
}

/* GET /v1/models/{model}: the card, or 404 as OpenAI answers an unknown model. The id is compared
 * as sent (percent-decoded: model names may hold '/'). */
static void handle_model(router_t *r, prism_http_req_t *h, const char *id)
{
    char name[512];
    size_t n = 0;
    for (const char *p = id; *p && n + 1 < sizeof name; p++) {
        int hi, lo;
        if (*p == '%' && p[1] && p[2] && (hi = hex_digit(p[1])) >= 0 && (lo = hex_digit(p[2])) >= 0) {
            name[n++] = (char)(hi * 16 + lo);
            p += 2;
        } else {
            name[n++] = *p;
        }
    }
    name[n] = 0;
    if (strlen(id) >= sizeof name || strcmp(name, r->served_model_name)) {
        char msg[600];
        snprintf(msg, sizeof msg, "The model `%.500s` does not exist.", name);
        prism_http_respond_error(h, 404, "NotFoundError", msg, "model", "model_not_found", NULL);
        return;
    }
    respond_jansson(h, 200, model_card(r));
}

/* /tokenize and /detokenize run on the preparation threads, as a generation request's preparation
 * does (requests.c): a megabyte prompt keeps the tokenizer busy for a while, and the loop thread
 * must go on with every other client meanwhile. They are admitted as generation requests are (they
 * count against --max-running-requests) and wait in the utility lane
 * (prep_pool.c): a generation request never waits behind them, and one whose client left before a
 * thread took it never runs. The job reads only its body and the router's immutable tokenizer,
 * template and configuration; the answer is written from the loop. */
typedef struct {
    router_job_t job;         /* first: the pool's */
    router_t *r;
    prism_http_req_t *h;
    bool detokenize;
    bool gone;                /* the client went away meanwhile */
    int status;               /* 200, or the error's */
    const char *param;        /* the error's field, or NULL */
    prism_buf_t out;          /* the answer's JSON, or the error message */
} tok_job_t;

/* The parse budget of generation requests (openai_req.h), before jansson builds anything: the memory
 * plan's parse bound (--max-parse-bytes), as for generation requests. */
static bool parse_budget_ok(const router_t *r, const char *body, size_t blen, prism_buf_t *out)
{
    size_t tree;
    prism_oai_error_t e;
    prism_oai_parse_opts_t o = {.max_parse_bytes = r->max_parse_bytes};
    if (prism_oai_scan(body, blen, PRISM_OAI_SCAN_ANY, &o, &tree, &e) == PRISM_OK) return true;
    prism_buf_append_str(out, e.message);
    return false;
}

static int tokenize_json(const router_t *r, const char *body, size_t blen, prism_buf_t *out)
{
    if (!parse_budget_ok(r, body, blen, out)) return 400;
    json_error_t jerr;
    json_t *j = json_loadb(body, blen, JSON_REJECT_DUPLICATES, &jerr);
    if (!json_is_object(j)) {
        json_decref(j);
        prism_buf_append_str(out, "Invalid JSON body.");
        return 400;
    }
    json_t *prompt = json_object_get(j, "prompt");
    json_t *messages = json_object_get(j, "messages");
    int32_t *ids = NULL;
    size_t n = 0, cap = 0;
    int rc = PRISM_EINVAL;
    char err[300] = "Provide either 'prompt' (string) or 'messages'.";
    if (json_is_string(prompt)) {
        json_t *ast = json_object_get(j, "add_special_tokens");
        bool add = ast ? json_is_true(ast) : true;
        rc = prism_tokenizer_encode(r->tok, json_string_value(prompt), json_string_length(prompt), add, &ids, &n, &cap);
    } else if (json_is_array(messages)) {
        json_t *agp = json_object_get(j, "add_generation_prompt");
        json_t *msgs = json_deep_copy(messages);   /* as the chat path renders them */
        size_t i;
        json_t *m;
        json_array_foreach(msgs, i, m) router_prompt_template_message(m);
        json_t *ctx = prism_template_chat_context(msgs, json_object_get(j, "tools"), agp ? json_is_true(agp) : true,
                                                  r->bos_token, r->eos_token, NULL);
        json_decref(msgs);
        prism_buf_t text = {0};
        rc = ctx ? prism_template_render(r->tmpl, ctx, &text, err, sizeof(err)) : PRISM_EINVAL;
        json_decref(ctx);
        if (rc == PRISM_OK) {
            bool has_bos = r->bos_token && *r->bos_token && text.data && !strncmp(text.data, r->bos_token, strlen(r->bos_token));
            json_t *ast = json_object_get(j, "add_special_tokens");
            bool add = ast ? json_is_true(ast) : !has_bos;
            rc = prism_tokenizer_encode(r->tok, text.data ? text.data : "", text.len, add, &ids, &n, &cap);
        }
        prism_buf_free(&text);
    }
    json_decref(j);
    if (rc != PRISM_OK) {
        prism_free(ids);
        prism_buf_append_str(out, err);
        return 400;
    }
    prism_buf_appendf(out, "{\"count\":%zu,\"max_model_len\":%d,\"tokens\":[", n, r->max_model_len);
    for (size_t i = 0; i < n; i++) prism_buf_appendf(out, i ? ",%d" : "%d", ids[i]);
    prism_buf_append_str(out, "]}");
    prism_free(ids);
    return 200;
}

static int detokenize_json(const router_t *r, const char *body, size_t blen, prism_buf_t *out, const char **param)
{
    *param = NULL;
    if (!parse_budget_ok(r, body, blen, out)) return 400;
    json_error_t jerr;
    json_t *j = json_loadb(body, blen, 0, &jerr);
    json_t *toks = json_is_object(j) ? json_object_get(j, "tokens") : NULL;
    *param = "tokens";
    if (!json_is_array(toks) || json_array_size(toks) > (1u << 20)) {
        json_decref(j);
        prism_buf_append_str(out, "'tokens' must be a list of token ids.");
        return 400;
    }
    size_t n = json_array_size(toks);
    int32_t *ids = prism_malloc(sizeof(int32_t) * (n ? n : 1));
    if (!ids) {
        json_decref(j);
        prism_buf_append_str(out, "The server is out of memory; try again shortly.");
        return 503;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(toks, i);
        json_int_t x = json_is_integer(v) ? json_integer_value(v) : -1;
        if (x < 0 || x >= r->cfg.vocab) {
            prism_free(ids);
            json_decref(j);
            prism_buf_append_str(out, "Token id out of vocabulary.");
            return 400;
        }
        ids[i] = (int32_t)x;
    }
    json_decref(j);
    prism_buf_t text = {0};
    prism_tokenizer_decode(r->tok, ids, n, false, &text);
    prism_free(ids);
    prism_buf_append_str(out, "{\"prompt\":");
    prism_json_string(out, text.data ? text.data : "", text.len);
    prism_buf_append_str(out, "}");
    prism_buf_free(&text);
    *param = NULL;
    return 200;
}

static void tok_job_run(uv_work_t *w)   /* a pool thread */
{
    tok_job_t *t = w->data;
    size_t blen = 0;
    const char *body = prism_http_req_body(t->h, &blen);
    t->status = t->detokenize ? detokenize_json(t->r, body, blen, &t->out, &t->param)
                              : tokenize_json(t->r, body, blen, &t->out);
}

static void tok_job_done(uv_work_t *w, int wstatus)
{
    tok_job_t *t = w->data;
    prism_http_req_t *h = t->h;
    t->r->n_utility--;
    if (!t->gone && wstatus == 0) {
        prism_http_req_on_abort(h, NULL, NULL);
        if (t->status == 200)
            respond_json(h, 200, t->out.data, t->out.len);
        else
            router_respond_error(h, t->status, t->out.data ? t->out.data : "", t->param);
    }
    prism_http_req_release(h);
    prism_buf_free(&t->out);
    prism_free(t);
}

static void on_tok_job_gone(prism_http_req_t *h, void *ud)
{
    tok_job_t *t = ud;
    if (router_prep_cancel(t->r, &t->job)) {   /* still waiting: it never runs */
        t->r->n_utility--;
        prism_http_req_release(h);
        prism_free(t);
        return;
    }
    t->gone = true;   /* on a thread: tok_job_done lets it go */
}

/* Owns h from here (released when the job is done). */
static void handle_tokenize(router_t *r, prism_http_req_t *h, bool detokenize)
{
    char msg[160];
    int status = router_refusal_at_arrival(r, msg, sizeof msg);
    if (status) {
        router_respond_error(h, status, msg, NULL);
        prism_http_req_release(h);
        return;
    }
    tok_job_t *t = prism_calloc(1, sizeof(*t));
    if (!t) {
        router_respond_error(h, 503, "The server is out of memory; try again shortly.", NULL);
        prism_http_req_release(h);
        return;
    }
    *t = (tok_job_t){.r = r, .h = h, .detokenize = detokenize};
    t->job.work.data = t;
    r->n_utility++;
    prism_http_req_on_abort(h, on_tok_job_gone, t);
    router_prep_submit(r, &t->job, ROUTER_LANE_UTILITY, tok_job_run, tok_job_done);
}

/* vLLM's serving metrics, then the router's own about requests, labelled with the model. */
static void metrics_requests(const router_t *r, prism_buf_t *b)
{
    const prism_router_metrics_t *m = &r->metrics;
    char lbl[700], model[300];
    prism_metric_label_value(model, sizeof(model), r->served_model_name);
    snprintf(lbl, sizeof(lbl), "model_name=\"%s\"", model);
    int running = 0, waiting = 0;
    double kv_used = 0;
    int n_dec = 0;
    for (int i = 0; i < ROUTER_MAX_WORKERS; i++) {
        const router_worker_t *w = &r->workers[i];
        if (!w->used || w->role != PRISM__ROLE__ROLE_DECODE) continue;
        running += (int)w->running;
        waiting += (int)w->waiting;
        if (w->kv_blocks) kv_used += 1.0 - (double)w->kv_free_blocks / w->kv_blocks;
        n_dec++;
    }
    prism_metric_write(b, "vllm:num_requests_running", "gauge", "Requests in decode batches.", lbl, running);
    prism_metric_write(b, "vllm:num_requests_waiting", "gauge", "Requests waiting for a decode slot.", lbl, waiting);
    prism_metric_write(b, "vllm:kv_cache_usage_perc", "gauge", "KV-cache usage, 0-1, mean over decode workers.", lbl,
                       n_dec ? kv_used / n_dec : 0);
    prism_metric_write(b, "vllm:prompt_tokens_total", "counter", "Prompt tokens processed.", lbl, (double)m->prompt_tokens);
    prism_metric_write(b, "vllm:generation_tokens_total", "counter", "Tokens generated.", lbl, (double)m->generation_tokens);
    prism_buf_appendf(b, "# HELP vllm:request_success_total Finished requests.\n# TYPE vllm:request_success_total counter\n");
    snprintf(lbl, sizeof(lbl), "model_name=\"%s\",finished_reason=\"stop\"", model);
    prism_metric_write(b, "vllm:request_success_total", "counter", NULL, lbl, (double)m->success_stop);
    snprintf(lbl, sizeof(lbl), "model_name=\"%s\",finished_reason=\"length\"", model);
    prism_metric_write(b, "vllm:request_success_total", "counter", NULL, lbl, (double)m->success_length);
    snprintf(lbl, sizeof(lbl), "model_name=\"%s\",finished_reason=\"abort\"", model);
    prism_metric_write(b, "vllm:request_success_total", "counter", NULL, lbl, (double)m->success_abort);
    snprintf(lbl, sizeof(lbl), "model_name=\"%s\"", model);
    prism_metric_write(b, "vllm:num_preemptions_total", "counter",
                       "Sequences a decode worker preempted because its KV pool ran out.", lbl,
                       (double)(m->preempted + m->swapped + m->preempted_migrate));
    prism_metric_write(b, "vllm:prefix_cache_queries_total", "counter",
                       "Prompt tokens looked up in the prefill workers' prefix caches.", lbl, (double)m->prefix_queries);
    prism_metric_write(b, "vllm:prefix_cache_hits_total", "counter",
                       "Prompt tokens found in the prefill workers' prefix caches.", lbl, (double)m->prefix_hits);
    prism_metric_write(b, "prism:prefill_tokens_computed_total", "counter",
                       "Prompt tokens the prefill workers' models computed (those not read from a prefix cache).", lbl,
                       (double)m->prefill_computed);
    prism_metric_write(b, "prism:encoder_skips_total", "counter",
                       "Images sent to no encoder: the chosen prefill worker's prefix cache held their whole span.",
                       lbl, (double)m->encoder_skips);
    prism_metric_write(b, "prism:prefix_resent_total", "counter",
                       "Requests sent again with every image encoded: the prefix a skipped image counted on was evicted.",
                       lbl, (double)m->prefix_resent);
    prism_hist_write(&m->ttft, b, "vllm:time_to_first_token_seconds", "Time to first token.", lbl);
    prism_hist_write(&m->itl, b, "vllm:inter_token_latency_seconds", "Mean time per output token of each request.", lbl);
    prism_hist_write(&m->e2e, b, "vllm:e2e_request_latency_seconds", "End-to-end request latency.", lbl);
    prism_hist_write(&m->queue, b, "vllm:request_queue_time_seconds", "Time a request waited in prefill.", lbl);
    prism_metric_write(b, "prism:requests_failed_total", "counter", "Requests that failed after admission.", lbl,
                       (double)m->failed);
    prism_metric_write(b, "prism:requests_retried_total", "counter",
                       "Requests sent to other workers after theirs died before the first token.", lbl, (double)m->retried);
    prism_metric_write(b, "prism:requests_migrated_total", "counter",
                       "Requests that went on from their last token on another prefill/decode pair after their decode "
                       "worker died mid-generation.", lbl, (double)m->migrated);
    prism_buf_appendf(b, "# HELP prism:preemptions_total Sequences preempted because a decode worker's KV pool ran "
                         "out, by how they went on (migrate: their KV moved to another decode worker; swap: their KV "
                         "kept in the worker's host swap region; recompute: "
                         "prefilled again from their tokens).\n"
                         "# TYPE prism:preemptions_total counter\n");
    snprintf(lbl, sizeof(lbl), "model_name=\"%s\",how=\"swap\"", model);
    prism_metric_write(b, "prism:preemptions_total", "counter", NULL, lbl, (double)m->swapped);
    snprintf(lbl, sizeof(lbl), "model_name=\"%s\",how=\"recompute\"", model);
    prism_metric_write(b, "prism:preemptions_total", "counter", NULL, lbl, (double)m->preempted);
    snprintf(lbl, sizeof(lbl), "model_name=\"%s\",how=\"migrate\"", model);
    prism_metric_write(b, "prism:preemptions_total", "counter", NULL, lbl, (double)m->preempted_migrate);
    snprintf(lbl, sizeof(lbl), "model_name=\"%s\"", model);
    prism_metric_write(b, "prism:workers_disconnected_total", "counter",
                       "Workers dropped at once because their connection closed (process died).", lbl,
                       (double)m->workers_disconnected);
    prism_metric_write(b, "prism:request_stage_timeouts_total", "counter",
                       "Encode or prefill stages that overran --stage-timeout (retried, or 504).", lbl,
                       (double)m->stage_timeouts);
    prism_metric_write(b, "prism:router_early_encodes_total", "counter",
                       "Images sent to an encoder's cache as soon as their bytes were in, before their request's "
                       "body ended.", lbl, (double)m->early_encodes);
    prism_metric_write(b, "prism:router_early_encodes_adopted_total", "counter",
                       "Early encodes still held when their request was dispatched: the request took the job over.",
                       lbl, (double)m->early_encodes_adopted);
    prism_metric_write(b, "prism:router_early_encodes_abandoned_total", "counter",
                       "Early encodes aborted because their body never became a request (the client left, the body "
                       "or the request was refused) or their request ended without taking them over.", lbl,
                       (double)m->early_encodes_abandoned);
    prism_metric_write(b, "prism:router_early_encodes_preempted_total", "counter",
                       "Early encodes aborted so that an admitted request could have their encoder slot.", lbl,
                       (double)m->early_encodes_preempted);
    prism_metric_write(b, "prism:router_early_encodes_failed_total", "counter",
                       "Early encodes that failed, timed out or lost their encoder (the request encodes its image "
                       "as usual).", lbl, (double)m->early_encodes_failed);
}

/* The memory plan (plan.h), its budget, and what the process holds against it. */
static void metrics_plan(const router_t *r, prism_buf_t *b)
{
    char lbl[64];
    size_t rss, hwm;
    router_mem_resident(&rss, &hwm);
    prism_metric_write(b, "prism:router_memory_budget_bytes", "gauge", "The router's --mem-budget (0 = none).", "",
                       (double)r->plan.budget);
    prism_buf_appendf(b, "# HELP prism:router_memory_plan_bytes The router's memory plan by region (start-up, "
                         "bounds from its flags or its budget).\n# TYPE prism:router_memory_plan_bytes gauge\n");
    for (int i = 0; i < ROUTER_ROW_COUNT; i++) {
        snprintf(lbl, sizeof lbl, "region=\"%s\"", router_plan_row_name((router_row_t)i));
        prism_metric_write(b, "prism:router_memory_plan_bytes", "gauge", NULL, lbl, (double)r->plan.bytes[i]);
    }
    prism_metric_write(b, "prism:router_memory_planned_bytes", "gauge", "The router's memory plan total.", "",
                       (double)r->plan.total);
    prism_metric_write(b, "prism:router_memory_resident_bytes", "gauge", "The router's resident set (VmRSS).", "",
                       (double)rss);
    prism_metric_write(b, "prism:router_memory_resident_peak_bytes", "gauge",
                       "The router's peak resident set since start (VmHWM).", "", (double)hwm);
}

/* The router's refusals and what it holds. */
static void metrics_router(const router_t *r, prism_buf_t *b)
{
    char lbl[160];
    prism_buf_appendf(b, "# HELP prism:requests_refused_total Requests refused, by reason.\n"
                          "# TYPE prism:requests_refused_total counter\n");
    uint64_t refused[PRISM_REFUSE_COUNT];
    router_refusals(r, refused);
    for (int i = 0; i < PRISM_REFUSE_COUNT; i++) {
        snprintf(lbl, sizeof(lbl), "reason=\"%s\"", prism_refusal_names[i]);
        prism_metric_write(b, "prism:requests_refused_total", "counter", NULL, lbl, (double)refused[i]);
    }
    prism_metric_write(b, "prism:router_requests_in_flight", "gauge", "Requests the router holds.", "", (double)r->n_reqs);
    prism_metric_write(b, "prism:router_requests_queued", "gauge",
                       "Admitted requests waiting in the router's queue for a worker (in priority order).", "",
                       (double)r->queue_len);
    prism_metric_write(b, "prism:router_requests_preparing", "gauge",
                       "Requests being prepared (parsed, tokenized, their images fetched) before admission.", "",
                       (double)r->n_preparing);
    prism_metric_write(b, "prism:router_image_bytes_in_flight", "gauge", "Image bytes the router holds.", "",
                       (double)r->image_bytes_inflight);
    prism_metric_write(b, "prism:router_body_bytes_in_flight", "gauge",
                       "Request body bytes the HTTP server holds (charged as they arrive).", "",
                       (double)prism_http_server_body_bytes(r->http));
    prism_metric_write(b, "prism:router_uploads_paused_total", "counter",
                       "Request bodies the router stopped reading to wait for room (body or image bytes in flight, "
                       "or requests queued for a worker) instead of refusing them.", "",
                       (double)prism_http_server_pauses(r->http));
    prism_metric_write(b, "prism:router_memory_bytes", "gauge", "Router heap bytes in use.", "", (double)prism_mem_used());
    metrics_plan(r, b);
    prism_metric_write(b, "prism:router_peer_auth_failures_total", "counter",
                       "Peers the router's control socket refused at the CURVE handshake.", "",
                       (double)prism_net_refused(r->net));
    prism_metric_write(b, "prism:router_control_messages_refused_total", "counter",
                       "Control messages dropped: from an unregistered id or another key, a refused registration, "
                       "or results from a worker that does not hold the request.", "", (double)r->ctl_refused);
    /* the preparation threads' lanes (prep_pool.c) */
    static const char *const lane_names[ROUTER_LANE_COUNT] = {"generate", "utility"};
    static const char *const lane_metrics[][3] = {
        {"prism:router_prep_waiting", "gauge", "Jobs waiting for a preparation thread, by lane (generation "
                                               "requests go first; utility: /tokenize, /detokenize)."},
        {"prism:router_prep_jobs_total", "counter", "Jobs handed to a preparation thread, by lane."},
        {"prism:router_prep_cancelled_total", "counter", "Waiting jobs whose client left before a thread took "
                                                         "them: never run."},
    };
    for (size_t m = 0; m < PRISM_ARRAY_LEN(lane_metrics); m++) {
        prism_buf_appendf(b, "# HELP %s %s\n# TYPE %s %s\n", lane_metrics[m][0], lane_metrics[m][2], lane_metrics[m][0],
                          lane_metrics[m][1]);
        for (int l = 0; l < ROUTER_LANE_COUNT; l++) {
            const router_job_lane_t *ln = &r->lanes[l];
            double v = m == 0 ? (double)ln->waiting : m == 1 ? (double)ln->started : (double)ln->cancelled;
            snprintf(lbl, sizeof(lbl), "lane=\"%s\"", lane_names[l]);
            prism_metric_write(b, lane_metrics[m][0], lane_metrics[m][1], NULL, lbl, v);
        }
    }
    /* images by URL: the fetcher's own (downloads, cache, refusals by reason), then the requests' wait */
    if (r->fetch) prism_fetch_metrics_write(r->fetch, b);
    prism_hist_write(&r->fetch_stage, b, "prism:request_image_fetch_seconds",
                     "Seconds a request waited for its images given by URL (all of them, joined downloads and "
                     "cache hits included).", "");
    prism_hist_write(&r->upload, b, "prism:request_upload_seconds",
                     "Seconds from a finished request's first byte to its last (headers and body: the client's "
                     "upload, a body the router held back for image room); before the end-to-end latency.", "");
    /* where finished requests' time went: stages that partition vllm:e2e_request_latency_seconds */
    for (int i = 0; i < ROUTER_TS_COUNT; i++) {
        char lbl[64];
        snprintf(lbl, sizeof lbl, "stage=\"%s\"", router_time_stage_names[i]);
        prism_hist_write(&r->stage[i], b, "prism:request_stage_seconds",
                         i ? NULL : "Seconds finished requests spent in each stage; the stages partition the "
                                    "end-to-end latency (docs/API.md).", lbl);
    }
}

/* Per worker, from its registration and heartbeats; workers lost; heartbeat intervals by tier. */
static void metrics_workers(const router_t *r, prism_buf_t *b)
{
    char lbl[700], wid[300];
    static const char *gauges[][2] = {
        {"prism:worker_running", "Requests running on the worker."},
        {"prism:worker_waiting", "Requests queued on the worker."},
        {"prism:worker_memory_planned_bytes", "Memory plan total of the worker."},
        {"prism:worker_memory_used_bytes", "Heap bytes in use on the worker."},
        {"prism:worker_memory_peak_bytes", "Peak heap bytes on the worker."},
        {"prism:worker_memory_budget_bytes", "The worker's --mem-budget (0 = none)."},
        {"prism:worker_kv_free_blocks", "Free KV blocks on the worker."},
        {"prism:worker_pool_free", "Free slots in the worker's receive pool."},
        {"prism:worker_embedding_cache_hits_total", "Embedding cache hits."},
        {"prism:worker_embedding_cache_misses_total", "Embedding cache misses."},
        {"prism:worker_heap_allocations_total", "Heap allocations the worker made (flat while serving)."},
        {"prism:worker_heartbeats_total", "Heartbeats received from the worker since it registered."},
        {"prism:worker_progress_total", "Units of work the worker completed (layers, images, chunks, steps)."},
        {"prism:worker_busy", "1 when the worker's last heartbeat said it is inside one piece of work."},
        {"prism:worker_stuck", "1 while the worker is stuck: busy without progress beyond --worker-stuck-timeout."},
        {"prism:worker_peer_auth_failures_total", "Peers the worker refused at the CURVE handshake."},
        {"prism:worker_draining", "1 while the worker drains after SIGTERM (no new work goes to it)."},
        {"prism:worker_kv_waits_total", "KV transfers the decode worker held until blocks or a slot were free."},
        {"prism:worker_tokens_generated_total", "Tokens the decode worker sampled."},
        {"prism:worker_sequences_aborted_total", "Sequences the decode worker ended for an abort."},
        {"prism:worker_prompts_aborted_total", "Prompts the prefill worker left mid-prompt for an abort."},
        {"prism:worker_sends_waited_total", "Embeddings the encoder held until a prefill's pool had room."},
        {"prism:worker_preemptions_total", "Sequences the decode worker preempted because its KV pool ran out (every way)."},
        {"prism:worker_preemptions_migrated_total",
         "Sequences the decode worker preempted by sending their KV whole to another decode worker."},
        {"prism:worker_swaps_total", "Sequences the decode worker preempted by swapping their KV to its host swap region."},
        {"prism:worker_kv_swap_bytes", "Bytes of the decode worker's KV swap region in use (--kv-swap-bytes)."},
        {"prism:worker_prefix_cache_queries_total", "Prompt tokens the prefill worker looked up in its prefix cache."},
        {"prism:worker_prefix_cache_hits_total", "Prompt tokens the prefill worker found in its prefix cache."},
        {"prism:worker_prompt_tokens_computed_total", "Prompt tokens the prefill worker's model computed."},
        {"prism:worker_image_decodes_peak", "Most images the encoder decoded at once since it started."},
        {"prism:worker_prefill_forwards_total", "Forwards the prefill worker ran."},
        {"prism:worker_prefill_forward_prompts_total",
         "Prompts the prefill worker's forwards carried (one per forward a prompt's chunk rode in)."},
        {"prism:worker_prefill_batch_peak", "Most prompts one forward of the prefill worker carried since it started."},
        {"prism:worker_prefill_pool_breaks_total",
         "Prompts the prefill worker failed (503, retryable) to break a stall of its full embedding pool."},
        {"prism:worker_kv_sent_bytes_total",
         "Bytes of KV transfers the worker sent, as they went on the wire (prefill: prompts' KV; decode: migrations)."},
        {"prism:worker_prefix_index_blocks", "Prefix-cache blocks this router knows the prefill worker holds (its events)."},
    };
    for (size_t g = 0; g < PRISM_ARRAY_LEN(gauges); g++) {
        prism_buf_appendf(b, "# HELP %s %s\n# TYPE %s %s\n", gauges[g][0], gauges[g][1], gauges[g][0],
                          strstr(gauges[g][0], "_total") ? "counter" : "gauge");
        for (int i = 0; i < ROUTER_MAX_WORKERS; i++) {
            const router_worker_t *w = &r->workers[i];
            if (!w->used) continue;
            double v[] = {w->running, w->waiting, (double)w->mem_planned, (double)w->mem_used, (double)w->mem_peak,
                          (double)w->mem_budget, w->kv_free_blocks, w->pool_free, (double)w->cache_hits,
                          (double)w->cache_misses, (double)w->alloc_count, (double)w->heartbeats,
                          (double)w->progress, w->busy, w->stuck, (double)w->peer_auth_failures,
                          w->draining ? 1.0 : 0.0, (double)w->kv_waits, (double)w->tokens_generated,
                          (double)w->seqs_aborted, (double)w->prompts_aborted, (double)w->sends_waited,
                          (double)(w->preemptions + w->swaps + w->migrations_out), (double)w->migrations_out,
                          (double)w->swaps, (double)w->kv_swap_bytes, (double)w->prefix_queries, (double)w->prefix_hits,
                          (double)w->prefill_computed, w->image_decodes_peak, (double)w->prefill_forwards,
                          (double)w->prefill_forward_prompts, w->prefill_batch_peak, (double)w->prefill_pool_breaks,
                          (double)w->kv_sent_bytes, (double)w->prefix.n};
            _Static_assert(PRISM_ARRAY_LEN(v) == PRISM_ARRAY_LEN(gauges), "one value per gauge");
            prism_metric_label_value(wid, sizeof(wid), w->id);  /* ids come from the network */
            snprintf(lbl, sizeof(lbl), "tier=\"%s\",worker=\"%s\"", prism_role_name(w->role), wid);
            prism_metric_write(b, gauges[g][0], "gauge", NULL, lbl, v[g]);
        }
    }
    /* per worker, the stages of its tier: one slow worker among its tier's */
    bool first = true;
    for (int i = 0; i < ROUTER_MAX_WORKERS; i++) {
        const router_worker_t *w = &r->workers[i];
        if (!w->used) continue;
        int n;
        const router_time_stage_t *s = router_worker_stages(w->role, &n);
        prism_metric_label_value(wid, sizeof(wid), w->id);
        for (int k = 0; k < n; k++, first = false) {
            snprintf(lbl, sizeof(lbl), "tier=\"%s\",worker=\"%s\",stage=\"%s\"", prism_role_name(w->role), wid,
                     router_time_stage_names[s[k]]);
            prism_hist_write(&w->stage[k], b, "prism:worker_stage_seconds",
                             first ? "Seconds each worker took in the stages of its tier (encoders: per image; "
                                     "prefill and decode: per finished request), as in "
                                     "prism:request_stage_seconds." : NULL,
                             lbl);
        }
    }
    prism_buf_appendf(b, "# HELP prism:workers_lost_total Workers given up on: dead (no heartbeat for --worker-timeout) "
                          "or stuck (busy without progress for --worker-stuck-timeout).\n"
                          "# TYPE prism:workers_lost_total counter\n");
    prism_metric_write(b, "prism:workers_lost_total", "counter", NULL, "reason=\"dead\"", (double)r->workers_lost_dead);
    prism_metric_write(b, "prism:workers_lost_total", "counter", NULL, "reason=\"stuck\"", (double)r->workers_lost_stuck);
    for (int role = PRISM__ROLE__ROLE_ENCODER; role <= PRISM__ROLE__ROLE_DECODE; role++) {
        snprintf(lbl, sizeof(lbl), "tier=\"%s\"", prism_role_name((Prism__Role)role));
        prism_hist_write(&r->heartbeat_interval[role], b, "prism:worker_heartbeat_interval_seconds",
                         role == PRISM__ROLE__ROLE_ENCODER ? "Seconds between two heartbeats of a worker, as received." : NULL,
                         lbl);
    }
}

static void handle_metrics(router_t *r, prism_http_req_t *h)
{
    prism_buf_t b = {0};
    metrics_requests(r, &b);
    metrics_router(r, &b);
    metrics_workers(r, &b);
    prism_http_respond(h, 200, "text/plain; version=0.0.4", NULL, b.data, b.len);
    prism_buf_free(&b);
}

/* Open without the key: the liveness and readiness probes, the version, and the metrics when
 * --metrics-open. Everything else needs "Authorization: Bearer KEY", compared in constant time, from
 * the headers: a client without the key never gets its body read. */
int router_on_headers(const prism_http_req_t *h, void *ud, char *msg, size_t n)
{
    const router_t *r = ud;
    if (!r->api_key || !*r->api_key) return 0;
    const char *p = prism_http_req_path(h);
    if (!strcmp(prism_http_req_method(h), "GET") &&
        (!strcmp(p, "/health") || !strcmp(p, "/ready") || !strcmp(p, "/version") ||
         !strcmp(p, "/") /* the status page: holds no data, asks for the key and sends it to /status */ ||
         (r->metrics_open && !strcmp(p, "/metrics"))))
        return 0;
    const char *a = prism_http_req_header(h, "authorization");
    if (a && !strncmp(a, "Bearer ", 7) && prism_ct_equal(a + 7, strlen(a + 7), r->api_key, strlen(r->api_key)))
        return 0;
    snprintf(msg, n, "Invalid or missing API key.");
    return 401;
}

prism_http_body_gate_t router_body_gate(const prism_http_req_t *h, void *ud)
{
    const router_t *r = ud;
    if (prism_http_req_has_images(h) && r->image_bytes_inflight >= r->max_image_bytes_inflight)
        return PRISM_HTTP_BODY_HOLD;   /* room comes back as image requests end */
    return r->queue_len ? PRISM_HTTP_BODY_WAIT : PRISM_HTTP_BODY_READ;
}

int router_image_check_early(const prism_http_req_t *h, int index, const char *mime, const uint8_t *data,
                             size_t len, bool bad, bool done, char *msg, size_t n, void *ud)
{
    router_t *r = ud;
    /* only chat completions read images; any other body keeps what it carries to its handler */
    if (strcmp(prism_http_req_method(h), "POST") || strcmp(prism_http_req_path(h), "/v1/chat/completions"))
        return PRISM_HTTP_IMAGE_OK;
    prism_image_info_t info;
    int st = router_image_check(r, index, mime, strlen(mime), bad, data, len, done, &info, r->metrics.refused_limit,
                                msg, n);
    if (st == ROUTER_IMAGE_MORE) return PRISM_HTTP_IMAGE_MORE;
    if (st == 0) return PRISM_HTTP_IMAGE_OK;
    r->metrics.refused_limit[PRISM_REFUSE_BAD_REQUEST]++;  /* as the handler's fail path counts it */
    return st;
}

void router_on_http(prism_http_req_t *h, void *ud)
{
    router_t *r = ud;
    const char *m = prism_http_req_method(h), *p = prism_http_req_path(h);
    bool get = !strcmp(m, "GET"), post = !strcmp(m, "POST");
    if (get && !strcmp(p, "/health")) {
        respond_json(h, 200, "{}", 2);
    } else if (get && !strcmp(p, "/metrics")) {
        handle_metrics(r, h);
    } else if (get && !strcmp(p, "/ready")) {
        bool ok = router_ready(r, r->cfg.has_vision) && !r->shutting_down;
        char b[256];
        int n = snprintf(b, sizeof(b), "{\"ready\":%s,\"encoders\":%d,\"prefills\":%d,\"decodes\":%d}",
                         ok ? "true" : "false", router_count_workers(r, PRISM__ROLE__ROLE_ENCODER),
                         router_count_workers(r, PRISM__ROLE__ROLE_PREFILL), router_count_workers(r, PRISM__ROLE__ROLE_DECODE));
        prism_http_respond(h, ok ? 200 : 503, "application/json", ok ? NULL : "Retry-After: 1\r\n", b, (size_t)n);
    } else if (get && !strcmp(p, "/version")) {
        respond_json(h, 200, "{\"version\":\"" PRISM_VERSION "\"}", strlen("{\"version\":\"" PRISM_VERSION "\"}"));
    } else if (get && !strcmp(p, "/")) {
        router_handle_status_page(r, h);  /* open: the page holds no data and asks for the key */
    } else if (post && !strcmp(p, "/v1/chat/completions")) {  /* the API key was checked from the headers */
        router_handle_generate(r, h, true);
        return;  /* owns h now */
    } else if (post && !strcmp(p, "/v1/completions")) {
        router_handle_generate(r, h, false);
        return;
    } else if (get && !strcmp(p, "/v1/models")) {
        handle_models(r, h);
    } else if (get && !strncmp(p, "/v1/models/", 11) && p[11]) {
        handle_model(r, h, p + 11);
    } else if (post && (!strcmp(p, "/tokenize") || !strcmp(p, "/detokenize"))) {
        handle_tokenize(r, h, p[1] == 'd');
        return;  /* owns h now */
    } else if (get && !strcmp(p, "/status")) {
        router_handle_status(r, h);
    } else {
        bool known = !strcmp(p, "/v1/chat/completions") || !strcmp(p, "/v1/completions") || !strcmp(p, "/v1/models") ||
                     (!strncmp(p, "/v1/models/", 11) && p[11]) || !strcmp(p, "/tokenize") || !strcmp(p, "/detokenize") ||
                     !strcmp(p, "/status") || !strcmp(p, "/");
        char msg[300];
        snprintf(msg, sizeof(msg), known ? "Method %s is not allowed for %.200s." : "No route for %s %.200s.", m, p);
        prism_http_respond_error(h, known ? 405 : 404, known ? "MethodNotAllowed" : "NotFoundError", msg, NULL, NULL, NULL);
    }
    prism_http_req_release(h);
}
