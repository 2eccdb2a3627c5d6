/* router: the OpenAI-compatible front door. Stateless apart from requests in flight: several
 * routers can run behind one load balancer, and every worker connects to each of them. */
#include "router.h"
#include "fetch.h"

#define XXH_STATIC_LINKING_ONLY  /* XXH3_generateSecret */
#include <xxhash.h>
#include "core/cli.h"

#include <libgen.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void stop_now(router_t *r)
{
    router_abort_all(r);
    prism_http_server_stop(r->http);   /* requests still fetching their images end here (their abort) */
    r->http = NULL;  /* freed by the loop's close callbacks */
    if (r->fetch) prism_fetch_close(r->fetch, NULL, NULL);   /* every download stopped; handles close */
    r->fetch = NULL;
    router_ctl_stop(r);
    uv_timer_stop(&r->drain_timer);
    uv_close((uv_handle_t *)&r->drain_timer, NULL);
    uv_signal_stop(&r->sigint);
    uv_signal_stop(&r->sigterm);
    uv_close((uv_handle_t *)&r->sigint, NULL);
    uv_close((uv_handle_t *)&r->sigterm, NULL);
}

static void on_drain_tick(uv_timer_t *t)
{
    router_t *r = t->data;
    bool idle = r->n_reqs == 0 && prism_http_server_active_connections(r->http) == 0;
    if (!idle && prism_now_s() < r->drain_deadline) return;
    if (idle) PRISM_INFO("drained: every request finished");
    else PRISM_WARN("drain timeout: aborting %zu requests still in flight", r->n_reqs);
    stop_now(r);
}

/* The first SIGTERM / SIGINT drains: no new connections (a load balancer moves on), /ready 503,
 * requests in flight finish (streams included) within --drain-timeout; a second signal, or the
 * deadline, aborts what is left. */
static void on_signal(uv_signal_t *s, int sig)
{
    router_t *r = s->data;
    if (r->shutting_down || r->drain_timeout_s <= 0) {
        PRISM_INFO("signal %d: shutting down now", sig);
        stop_now(r);
        return;
    }
    PRISM_INFO("signal %d: draining %zu requests in flight (at most %.0fs; a second signal stops at once)", sig,
               r->n_reqs, r->drain_timeout_s);
    r->shutting_down = true;
    r->drain_deadline = prism_now_s() + r->drain_timeout_s;
    prism_http_server_drain(r->http);
    uv_timer_start(&r->drain_timer, on_drain_tick, 0, 50);
}

/* The router's flags as given (defaults in flags_default). */
typedef struct {
    const char *model_path, *tokenizer_path, *served, *host, *control, *chat_template, *api_key, *log_level,
               *log_format, *tool_parser, *curve_keys, *allowed_hosts, *api_key_file;
    bool insecure_no_curve, metrics_open, timing_header, no_early_encode;
    int64_t port, context_length, limit_mm, max_pixels, max_running, max_body, body_total, image_inflight, max_conn,
            min_body_rate, stream_pending, max_retries, max_migrations, prep_threads, max_image_bytes, mem_budget,
            early_bytes, parse_bytes;
    prism_fetch_config_t fetch;   /* image URLs (max_bytes: --max-image-bytes; max_inflight and cache_bytes -1:
                                   * from --mem-budget) */
    double worker_timeout, worker_stuck_timeout, request_timeout, max_queue_wait, header_timeout, drain_timeout,
           stage_timeout;
} router_flags_t;

/* Whether the numeric flags are in range (the plan checks the memory bounds against the budget). */
static bool flags_in_range(const router_flags_t *f)
{
    if (f->port < 0 || f->port > 65535 || f->limit_mm < 0 || f->limit_mm > ROUTER_MAX_IMAGES || f->max_running < 1 ||
        f->max_running > 1000000 || f->max_pixels < 1 || f->image_inflight < 0 || f->min_body_rate < 1 ||
        f->max_image_bytes < 1 ||
        !(f->header_timeout > 0) || f->stream_pending < 0 || !(f->worker_timeout > 0) || f->mem_budget < 0 ||
        f->max_conn < 0 || f->max_body < 0 || f->body_total < 0 || f->early_bytes < 0 || f->parse_bytes < 0 ||
        !(f->worker_stuck_timeout >= 0) || f->prep_threads < 1 || f->prep_threads > 256) {
        fprintf(stderr, "router: flag out of range (see --help)\n");
        return false;
    }
    return true;
}

/* The flags' defaults: what the bundled model needs on one machine. */
static void flags_default(router_flags_t *f)
{
    *f = (router_flags_t){
        .model_path = "models/prism-tiny-llava", .host = "127.0.0.1", .control = "tcp://127.0.0.1:8100",
        .log_level = "info", .port = 8000, .limit_mm = 8, .max_pixels = 4096ll * 4096, .max_running = 256,
        .mem_budget = ROUTER_DEFAULT_BUDGET, .min_body_rate = 8 << 10, .max_retries = 2, .max_migrations = 2,
        .prep_threads = 4, .worker_timeout = 10, .worker_stuck_timeout = 60, .request_timeout = 600,
        .max_queue_wait = 120, .header_timeout = 30, .drain_timeout = 20, .stage_timeout = 60,
        .max_image_bytes = 20ll << 20 /* OpenAI's own limit per image */};
    f->log_format = "text";
    prism_fetch_config_default(&f->fetch);
    f->fetch.max_inflight = -1;   /* auto: from --mem-budget (plan_memory) unless given */
    f->fetch.cache_bytes = -1;
}

/* Parses and checks the flags, and starts logging: -1 to go on, else the exit code. */
static int flags_parse(router_flags_t *f, int argc, char **argv)
{
    flags_default(f);
    prism_flag_t flags[] = {
        PRISM_FLAG_STR("model-path", &f->model_path, "HF model directory (config.json, tokenizer.json, tokenizer_config.json)"),
        PRISM_FLAG_STR("tokenizer-path", &f->tokenizer_path, "Tokenizer directory (default: --model-path)"),
        PRISM_FLAG_STR("served-model-name", &f->served, "Model name clients use (default: the model directory's name)"),
        PRISM_FLAG_STR("host", &f->host, "HTTP bind address"),
        PRISM_FLAG_STR("allowed-hosts", &f->allowed_hosts,
                       "Host header names the HTTP API answers, comma-separated ('*': any; default: any, or only "
                       "localhost, 127.0.0.1, ::1 and --host when --host is a loopback address: DNS rebinding)"),
        PRISM_FLAG_INT("port", &f->port, "HTTP port"),
        PRISM_FLAG_STR("control-endpoint", &f->control, "ZeroMQ endpoint workers connect to"),
        PRISM_FLAG_STR("curve-keys", &f->curve_keys,
                       "CURVE key directory (made by prism_keygen): router.key and the workers' public keys"),
        PRISM_FLAG_BOOL("insecure-no-curve", &f->insecure_no_curve,
                        "Unauthenticated control socket (only on an isolated network; logs a warning)"),
        PRISM_FLAG_STR("chat-template", &f->chat_template, "Jinja chat template file overriding the model's"),
        PRISM_FLAG_STR("tool-call-parser", &f->tool_parser,
                       "Tool-call format of the model's output: hermes or pythonic (llama4_pythonic); enables tools"),
        PRISM_FLAG_STR("api-key", &f->api_key,
                       "Require 'Authorization: Bearer KEY' (all but /health, /ready, /version). Every local user "
                       "can read a process's arguments: prefer --api-key-file or PRISM_API_KEY"),
        PRISM_FLAG_STR("api-key-file", &f->api_key_file,
                       "Read the API key from FILE (this user's or root's, readable by no other user; "
                       "surrounding whitespace dropped). Or set PRISM_API_KEY in the environment"),
        PRISM_FLAG_BOOL("metrics-open", &f->metrics_open, "Serve /metrics without the API key"),
        PRISM_FLAG_BOOL("timing-header", &f->timing_header,
                        "Add x-prism-timing (time split, image cache hits) to responses: for operators only, it tells "
                        "a client whether someone else sent the same image"),
        PRISM_FLAG_INT("context-length", &f->context_length, "Max tokens per sequence (0 = model's max_position_embeddings, at most 131072)"),
        PRISM_FLAG_INT("limit-mm-per-prompt", &f->limit_mm, "Most images in one request"),
        PRISM_FLAG_BOOL("no-early-encode", &f->no_early_encode,
                        "Send images to an encoder only once their whole request is in (by default an image goes "
                        "to an encoder's cache as soon as its bytes are, while the rest of the body arrives)"),
        PRISM_FLAG_INT("max-image-pixels", &f->max_pixels, "Largest image (width*height from its header) accepted"),
        PRISM_FLAG_BYTES("max-image-bytes", &f->max_image_bytes,
                         "Largest image file, data URL or fetched by URL; more gets 400 (a download is refused from "
                         "its Content-Length, or cut off)"),
        PRISM_FETCH_FLAGS(&f->fetch),
        PRISM_FLAG_BYTES("mem-budget", &f->mem_budget,
                         "Memory budget of the router (bytes, e.g. 512M; 0 = none): the bounds below left at auto "
                         "share it, and explicit ones that do not fit refuse the start (see docs/ARCHITECTURE.md)"),
        PRISM_FLAG_INT("max-running-requests", &f->max_running, "Requests in flight; more get 429"),
        PRISM_FLAG_BYTES("max-body-bytes", &f->max_body, "Largest request body; more gets 413 (auto: from --mem-budget, at most 64 MiB)"),
        PRISM_FLAG_BYTES("max-body-bytes-in-flight", &f->body_total, "Request body bytes held at once; beyond, uploads pause (503 after --max-queue-wait)"),
        PRISM_FLAG_BYTES("max-image-bytes-in-flight", &f->image_inflight, "Image bytes held at once; beyond, uploads with images pause (503 after --max-queue-wait)"),
        PRISM_FLAG_BYTES("max-early-encode-bytes", &f->early_bytes,
                         "Image bytes sent to encoders while their bodies still arrive (copies), at once"),
        PRISM_FLAG_BYTES("max-parse-bytes", &f->parse_bytes,
                         "What one parsed request body (its JSON tree) may cost; larger bodies are refused (400)"),
        PRISM_FLAG_INT("max-connections", &f->max_conn, "Open HTTP connections at once; more get 503 (0: from --mem-budget, at most 4096)"),
        PRISM_FLAG_DOUBLE("http-header-timeout", &f->header_timeout, "Seconds for a request's line and headers; slower gets 408"),
        PRISM_FLAG_BYTES("http-min-body-rate", &f->min_body_rate,
                         "Bytes/s a request body must average after 10 s; slower gets 408 (slowloris)"),
        PRISM_FLAG_BYTES("max-stream-pending-bytes", &f->stream_pending,
                         "Bytes queued for a streaming client that stopped reading; beyond, it is dropped"),
        PRISM_FLAG_DOUBLE("worker-timeout", &f->worker_timeout, "Seconds without a heartbeat before a worker is dropped (dead)"),
        PRISM_FLAG_DOUBLE("worker-stuck-timeout", &f->worker_stuck_timeout,
                          "Seconds a worker may heartbeat busy without progress before its requests fail and it "
                          "gets no new work (stuck; 0 = never). Must exceed the slowest layer of any batch"),
        PRISM_FLAG_DOUBLE("request-timeout", &f->request_timeout, "Seconds before an unfinished request fails"),
        PRISM_FLAG_DOUBLE("max-queue-wait", &f->max_queue_wait, "Seconds a request may wait for a worker (also while a tier has none) before a 503"),
        PRISM_FLAG_INT("max-retries", &f->max_retries,
                       "Times a request whose worker died before its first token is sent to other workers"),
        PRISM_FLAG_INT("max-migrations", &f->max_migrations,
                       "Times a request whose decode worker died mid-generation goes on from its last token on "
                       "another prefill/decode pair (n = 1 only); 0: it fails (503 or an SSE error event)"),
        PRISM_FLAG_DOUBLE("stage-timeout", &f->stage_timeout,
                          "Seconds an encode, or a prefill up to the first token, may take before the request is "
                          "retried on other workers (then 504 naming the stage); 0: no limit"),
        PRISM_FLAG_DOUBLE("drain-timeout", &f->drain_timeout,
                          "Seconds SIGTERM waits for requests in flight before aborting them (0: abort at once)"),
        PRISM_FLAG_INT("prep-threads", &f->prep_threads,
                       "Threads that prepare requests (JSON, images, chat template, tokenization) off the I/O loop"),
        PRISM_FLAG_STR("log-level", &f->log_level, "debug, info, warn or error"),
        PRISM_FLAG_STR("log-format", &f->log_format,
                       "text, or json: one object per line (time, level, process, worker_id, request_id, trace_id, "
                       "message)"),
        PRISM_FLAG_END,
    };
    int rc = prism_cli_parse(argc, argv, "router",
                             "Prism router: OpenAI-compatible HTTP API in front of encoder, prefill and decode workers.", flags);
    if (rc) return rc > 0 ? 0 : 2;
    prism_log_init("router", prism_log_level_parse(f->log_level));
    prism_log_format_t lf;
    if (prism_log_format_parse(f->log_format, &lf) != PRISM_OK) {
        fprintf(stderr, "router: --log-format must be text or json\n");
        return 2;
    }
    prism_log_set_format(lf);
    return flags_in_range(f) ? -1 : 2;
}

/* The API key, from one of --api-key, --api-key-file or PRISM_API_KEY (vLLM reads VLLM_API_KEY):
 * at least ROUTER_API_KEY_MIN printable characters, so a placeholder (deploy/k8s's "replace-me")
 * or a guessable word never becomes the key. -1 to go on, else the exit code. */
#define ROUTER_API_KEY_MIN 16
static int api_key_load(router_flags_t *f)
{
    static char key[4096];
    const char *env = getenv("PRISM_API_KEY"), *from = "--api-key";
    if (env && !*env) env = NULL;
    if (!!f->api_key + !!f->api_key_file + !!env > 1) {
        fprintf(stderr, "router: give the API key one way: --api-key, --api-key-file or PRISM_API_KEY\n");
        return 2;
    }
    if (f->api_key_file) {
        char err[512];
        if (prism_secret_file_read(f->api_key_file, key, sizeof key, err, sizeof err) != PRISM_OK) {
            fprintf(stderr, "router: --api-key-file: %s\n", err);
            return 2;
        }
        f->api_key = key;
        from = "--api-key-file";
    } else if (env) {
        f->api_key = env;
        from = "PRISM_API_KEY";
    }
    if (!f->api_key) return -1;
    size_t n = strlen(f->api_key);
    bool printable = true;
    for (size_t i = 0; i < n; i++) printable &= f->api_key[i] > 0x20 && f->api_key[i] < 0x7f;
    if (n < ROUTER_API_KEY_MIN || !printable) {
        fprintf(stderr, "router: the API key (%s) must be at least %d printable characters without spaces "
                "(a placeholder is not a key): make one with `openssl rand -hex 32`\n", from, ROUTER_API_KEY_MIN);
        return 2;
    }
    if (!strcmp(from, "--api-key"))
        PRISM_WARN("--api-key puts the key in this process's arguments, which every local user can read: use "
                   "--api-key-file or PRISM_API_KEY");
    return -1;
}

/* The control socket's keys and the image cache key: -1 to go on, else the exit code. */
static int open_keys(router_t *r, const router_flags_t *f)
{
    char err[512] = "", path[1024];
    /* Image files go to encoders over the same control socket as everything else, CURVE-encrypted
     * by the connection's I/O thread (a 10 MB photo: milliseconds): with one I/O thread a prefill's
     * Prefill and a decode's tokens waited behind every image being sent (docs/PERFORMANCE.md,
     * "Mixed load"). Connections are spread over the threads as they are accepted. */
    prism_net_opts_t no = {.role = PRISM_NET_ROLE_ROUTER, .curve_keys = f->curve_keys, .insecure = f->insecure_no_curve,
                           .io_threads = ROUTER_IO_THREADS};
    if (prism_net_create(&no, &r->net, err, sizeof(err)) != PRISM_OK) {
        PRISM_ERROR("%s", err);
        return 2;
    }
    /* Image cache keys are keyed by a cluster secret (every router of a cluster holds router.key, so
     * they agree and share encoder caches); without CURVE each router draws its own. */
    char seed[PRISM_NET_KEY_Z85 + 1] = "";
    if (f->curve_keys) {
        prism_path_join(path, sizeof(path), f->curve_keys, "router.key");
        if (prism_net_key_read(path, seed, err, sizeof(err)) != PRISM_OK) {
            PRISM_ERROR("%s", err);
            return 2;
        }
    } else if (prism_random_bytes(seed, PRISM_NET_KEY_Z85) != PRISM_OK) {
        PRISM_ERROR("no randomness from the kernel for the image cache key");
        return 1;
    }
    if (XXH3_generateSecret(r->img_secret, sizeof(r->img_secret), seed, PRISM_NET_KEY_Z85) != XXH_OK) return 1;
    /* the prefix-cache keys' from the same seed (labelled apart): routers of a cluster agree on a
     * prompt's keys, so each one's index reads the same prefill events */
    if (prism_kv_prefix_secret(r->prefix_secret, seed, PRISM_NET_KEY_Z85) != PRISM_OK) return 1;
    memset(seed, 0, sizeof(seed));
    if (prism_random_bytes(&r->trace_seed, sizeof r->trace_seed) != PRISM_OK) {   /* ours alone, unlike the key */
        PRISM_ERROR("no randomness from the kernel for trace ids");
        return 1;
    }
    return -1;
}

/* Model facts: config, tokenizer, chat template, tool-call format, grammar vocabulary, the served
 * name: -1 to go on, else the exit code. */
static int load_model(router_t *r, const router_flags_t *f)
{
    char err[512] = "", path[1024];
    const char *model_path = f->model_path, *chat_template = f->chat_template;
    if (prism_model_config_load(model_path, &r->cfg, err, sizeof(err)) != PRISM_OK) {
        PRISM_ERROR("cannot load model config from %s: %s", model_path, err);
        return 1;
    }
    const char *tdir = f->tokenizer_path ? f->tokenizer_path : model_path;
    prism_path_join(path, sizeof(path), tdir, "tokenizer.json");
    if (prism_tokenizer_load(path, &r->tok, err, sizeof(err)) != PRISM_OK) {
        PRISM_ERROR("cannot load %s: %s", path, err);
        return 1;
    }
    prism_path_join(path, sizeof(path), tdir, "tokenizer_config.json");
    if (prism_template_load_from_tokenizer_config(path, &r->tmpl, &r->bos_token, &r->eos_token, err, sizeof(err)) != PRISM_OK &&
        !chat_template) {
        PRISM_ERROR("cannot load the chat template from %s: %s (use --chat-template FILE)", path, err);
        return 1;
    }
    if (chat_template) {
        if (r->tmpl) prism_template_free(r->tmpl);
        r->tmpl = NULL;
        if (prism_template_load_file(chat_template, &r->tmpl, err, sizeof(err)) != PRISM_OK) {
            PRISM_ERROR("cannot use --chat-template %s: %s", chat_template, err);
            return 1;
        }
    }
    r->tool_parser = -1;
    if (f->tool_parser && (r->tool_parser = prism_toolcall_format_parse(f->tool_parser)) < 0) {
        fprintf(stderr, "router: unknown --tool-call-parser '%s' (hermes, pythonic)\n", f->tool_parser);
        return 2;
    }
    /* The grammar vocabulary for validating output constraints (the workers build their own). */
    if (r->cfg.n_eos > 0 &&
        prism_grammar_vocab_create(r->tok, r->cfg.eos_token_ids, (size_t)r->cfg.n_eos, (size_t)r->cfg.vocab, &r->gvocab) == PRISM_OK)
        prism_guide_cache_create(r->gvocab, 0, 0, &r->guides);
    if (!r->guides) PRISM_WARN("no grammar vocabulary: requests with an output constraint will be refused");
    static char name_buf[256];
    const char *served = f->served;
    if (!served) {
        snprintf(path, sizeof(path), "%s", model_path);
        size_t n = strlen(path);
        while (n > 1 && path[n - 1] == '/') path[--n] = 0;
        snprintf(name_buf, sizeof(name_buf), "%s", basename(path));
        served = name_buf;
    }
    r->model_path = model_path;
    r->served_model_name = served;
    r->max_model_len = prism_model_context_length(&r->cfg, f->context_length);
    if (r->max_model_len < r->cfg.max_pos && f->context_length <= 0)
        PRISM_INFO("config.json allows %d positions; serving %d (--context-length to change)", r->cfg.max_pos,
                   r->max_model_len);
    r->image_token_id = r->cfg.has_vision ? r->cfg.image_token_index : -1;
    if (r->cfg.has_vision && r->cfg.vision_arch == PRISM_VISION_LLAMA4 && router_llama4_init(r, model_path) != PRISM_OK)
        return 1;
    if (prism_model_native_vision(&r->cfg) && router_qwenvl_init(r, model_path) != PRISM_OK)
        return 1;
    return -1;
}

/* The configuration the router keeps, its metrics, the request map and queue. */
static void apply_flags(router_t *r, const router_flags_t *f)
{
    r->api_key = f->api_key;
    r->metrics_open = f->metrics_open;
    r->timing_header = f->timing_header;
    r->early_encode = !f->no_early_encode;
    r->max_stream_pending = r->plan.stream_pending;
    r->max_images_per_prompt = f->limit_mm ? (int)f->limit_mm : -1;
    r->max_image_pixels = (uint64_t)f->max_pixels;
    r->max_image_bytes = (uint64_t)f->max_image_bytes;
    r->max_running = (int)f->max_running;
    r->prep_threads = (int)f->prep_threads;
    r->max_image_bytes_inflight = r->plan.image_inflight;
    r->max_early_bytes = r->plan.early_bytes;
    r->max_parse_bytes = r->plan.parse_bound;
    r->worker_timeout_s = f->worker_timeout;
    r->worker_stuck_timeout_s = f->worker_stuck_timeout;
    r->request_timeout_s = f->request_timeout;
    r->max_queue_wait_s = f->max_queue_wait;
    r->max_retries = f->max_retries < 0 ? 0 : (int)f->max_retries;
    r->max_migrations = f->max_migrations < 0 ? 0 : (int)PRISM_MIN(f->max_migrations, 1000);
    r->drain_timeout_s = f->drain_timeout;
    r->stage_timeout_s = f->stage_timeout;
    r->created = prism_unix_time();
    prism_router_metrics_init(&r->metrics);
    static const double hb_buckets[] = {0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.5, 0.75, 1, 1.1, 1.25,
                                        1.5, 2, 3, 5, 10, 30};
    for (size_t i = 0; i < PRISM_ARRAY_LEN(r->heartbeat_interval); i++)
        prism_hist_init(&r->heartbeat_interval[i], hb_buckets, (int)PRISM_ARRAY_LEN(hb_buckets));
    static const double fetch_buckets[] = {.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 20, 40};
    prism_hist_init(&r->fetch_stage, fetch_buckets, (int)PRISM_ARRAY_LEN(fetch_buckets));
    prism_hist_init(&r->upload, prism_buckets_e2e, prism_buckets_e2e_n);
    for (int i = 0; i < ROUTER_TS_COUNT; i++) prism_hist_init(&r->stage[i], prism_buckets_ttft, prism_buckets_ttft_n);
    r->reqs_cap = 16;
    while (r->reqs_cap < (size_t)f->max_running * 2 + 2) r->reqs_cap *= 2;
    r->reqs = prism_xcalloc(r->reqs_cap, sizeof(router_req_t *));
    r->queue = prism_xcalloc(r->reqs_cap, sizeof(uint64_t));
    r->queue_scratch = prism_xcalloc(r->reqs_cap, sizeof(uint64_t));
}

/* The HTTP server's configuration; the plan's bounds (connections, bodies) are filled by plan_memory.
 * Headers and pipelined bytes are bounded tighter than the server's defaults (16 KiB of headers, as
 * uvicorn's h11; a pipelined request waits in the kernel until the one before is answered; reads
 * of 16 KiB): each open connection may hold them, and the plan counts every connection. */
static prism_http_config_t http_config(const router_flags_t *f)
{
    prism_http_config_t hc = prism_http_config_default();
    hc.host = f->host;
    hc.port = (int)f->port;
    hc.max_header_bytes = 16 << 10;
    hc.max_pipeline_bytes = 1;
    hc.read_bytes = 16 << 10;
    hc.max_pause_s = f->max_queue_wait;
    hc.lift_data_urls = true;  /* image data URLs are decoded while the body streams in */
    hc.header_timeout_s = f->header_timeout;
    hc.min_body_rate = (size_t)f->min_body_rate;
    hc.on_headers = router_on_headers;
    hc.body_gate = router_body_gate;
    hc.image_check = router_image_check_early;
    hc.image_done = router_early_encode;
    hc.body_gone = router_early_body_gone;
    hc.allowed_hosts = f->allowed_hosts ? f->allowed_hosts
                     : prism_http_host_is_loopback(f->host) ? PRISM_HTTP_LOOPBACK_HOSTS : NULL;
    hc.require_json = true;   /* POST bodies are JSON: a cross-site form cannot send it without a preflight */
    return hc;
}

/* The memory plan (plan.h): what start-up left resident, and every bound from its flag or from
 * --mem-budget. -1 to go on, else the exit code (a plan the budget cannot hold). */
static int plan_memory(router_t *r, const router_flags_t *f, prism_http_config_t *hc)
{
    size_t rss, hwm;
    router_mem_resident(&rss, &hwm);
    router_plan_in_t in = {
        .budget = (size_t)f->mem_budget, .startup = PRISM_MAX(rss, hwm), .max_connections = f->max_conn,
        .max_body = (size_t)f->max_body, .body_inflight = (size_t)f->body_total,
        .image_inflight = (size_t)f->image_inflight, .early_bytes = (size_t)f->early_bytes,
        .stream_pending = (size_t)f->stream_pending, .parse_bound = (size_t)f->parse_bytes,
        .conn_bytes = prism_http_conn_bytes(hc), .max_running = (int)f->max_running, .prep_threads = (int)f->prep_threads,
        .request_bytes = router_req_bytes_max(r), .parse_factor = ROUTER_PARSE_FACTOR};
    /* image URLs: one download at its largest (the fetcher's own bound), downloads at once and the
     * URL cache from their flags or the budget */
    prism_fetch_config_t one = f->fetch;
    one.max_bytes = f->max_image_bytes;
    one.max_inflight = 1;
    one.cache_bytes = 0;
    prism_fetch_bounds_t fb;
    prism_fetch_config_bounds(&one, &fb);
    in.fetch = true;
    in.fetch_max_bytes = (size_t)fb.downloads;
    in.fetch_inflight = f->fetch.max_inflight > 0 ? f->fetch.max_inflight : 0;
    in.fetch_cache_set = f->fetch.cache_bytes >= 0;
    in.fetch_cache = in.fetch_cache_set ? (size_t)f->fetch.cache_bytes : 0;
    char err[1024];
    if (router_plan_make(&in, &r->plan, err, sizeof err) != PRISM_OK) {
        PRISM_ERROR("%s", err);
        return 2;
    }
    router_plan_log(&r->plan);
    hc->max_connections = (int)r->plan.max_connections;
    hc->max_body_bytes = r->plan.max_body;
    hc->max_body_bytes_total = r->plan.body_inflight;
    return -1;
}

/* The loop, the control socket, the HTTP listener and the signals: -1 to go on, else the exit code. */
static int start_io(router_t *r, const router_flags_t *f, const prism_http_config_t *hc)
{
    char host_name[64] = "host";
    gethostname(host_name, sizeof(host_name) - 1);
    snprintf(r->router_id, sizeof(r->router_id), "router-%s-%d-%lld", host_name, (int)getpid(), (long long)f->port);
    prism_log_set_worker(r->router_id);
    /* libuv's thread pool (requests.c prep_run, api.c) is sized from the environment on first use. */
    char nthreads[16];
    snprintf(nthreads, sizeof(nthreads), "%lld", (long long)f->prep_threads);
    setenv("UV_THREADPOOL_SIZE", nthreads, 1);
    r->loop = uv_default_loop();
    if (router_ctl_start(r, f->control) != PRISM_OK) {
        PRISM_ERROR("cannot bind the control endpoint %s", f->control);
        return 1;
    }
    if (prism_http_server_start(r->loop, hc, router_on_http, r, &r->http) != PRISM_OK) {
        PRISM_ERROR("cannot listen on %s:%lld", f->host, (long long)f->port);
        return 1;
    }
    /* Image URLs: fetched on this loop, each image keyed by the same secret as uploaded ones. */
    prism_fetch_config_t fc = f->fetch;
    fc.max_bytes = f->max_image_bytes;
    fc.max_inflight = r->plan.fetch_inflight;   /* the plan's (given, or from --mem-budget) */
    fc.cache_bytes = (int64_t)r->plan.fetch_cache;
    fc.hash_secret = r->img_secret;
    fc.hash_secret_len = sizeof r->img_secret;
    char why[512] = "";
    if (prism_fetch_open(r->loop, &fc, &r->fetch, why, sizeof why) != PRISM_OK) {
        PRISM_ERROR("image URLs: %s", why);
        return 2;
    }
    r->fetch_urls = true;
    prism_fetch_bounds_t fb;
    prism_fetch_config_bounds(&fc, &fb);
    PRISM_INFO("image URLs: at most %lld downloads of %.1f MiB at once and a %.0f MiB URL cache (%.0f MiB in all)%s%s",
               (long long)fc.max_inflight, fc.max_bytes / 1048576.0, fb.cache / 1048576.0, fb.total / 1048576.0,
               fc.allowed_local_path ? "; file:// under " : "", fc.allowed_local_path ? fc.allowed_local_path : "");
    uv_timer_init(r->loop, &r->drain_timer);
    r->drain_timer.data = r;
    uv_signal_init(r->loop, &r->sigint);
    uv_signal_init(r->loop, &r->sigterm);
    r->sigint.data = r->sigterm.data = r;
    uv_signal_start(&r->sigint, on_signal, SIGINT);
    uv_signal_start(&r->sigterm, on_signal, SIGTERM);
    signal(SIGPIPE, SIG_IGN);
    return -1;
}

/* Everything before the loop: flags, model config, tokenizer and template, the control socket and the
 * HTTP listener, signals. Returns -1 to go on, else the exit code. */
static int router_open(router_t *r, int argc, char **argv)
{
    /* Request bodies and images (megabytes each) straight from mmap, and back to the kernel when
     * freed: glibc's threshold would otherwise rise to their size at the first free and keep later
     * ones in the heap, whose pages stay resident after a burst (measured: 329 MiB resident after a
     * burst of 384 image uploads under 128 MiB of body and image budgets, 58 MiB with this), and
     * the memory plan bounds what is held, not what the allocator keeps. */
    mallopt(M_MMAP_THRESHOLD, 128 << 10);
    router_flags_t f;
    int rc = flags_parse(&f, argc, argv);
    if (rc >= 0 || (rc = api_key_load(&f)) >= 0) return rc;
    json_set_alloc_funcs(prism_malloc, prism_free);  /* parsed bodies count in the router's memory */
    json_object_seed(0);   /* jansson's hash seed, drawn once here rather than racily by the first threads */
    r->started_s = prism_now_s();
    if ((rc = open_keys(r, &f)) >= 0 || (rc = load_model(r, &f)) >= 0) return rc;
    prism_http_config_t hc = http_config(&f);
    if ((rc = plan_memory(r, &f, &hc)) >= 0) return rc;
    apply_flags(r, &f);
    if ((rc = start_io(r, &f, &hc)) >= 0) return rc;
    PRISM_INFO("router %s serving '%s' on http://%s:%d in %.2fs (control %s, context %d, %d image tokens per %s)",
               r->router_id, r->served_model_name, f.host, prism_http_server_port(r->http), prism_now_s() - r->started_s,
               f.control, r->max_model_len, r->cfg.image_seq_length, r->llama4 ? "tile" : "image");
    return -1;
}

int main(int argc, char **argv)
{
    static router_t r;
    int rc = router_open(&r, argc, argv);
    if (rc >= 0) return rc;
    uv_run(r.loop, UV_RUN_DEFAULT);
    int linger = 500;  /* the router_stopping notes of router_ctl_stop go out */
    zmq_setsockopt(r.ctl, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_close(r.ctl);
    prism_net_destroy(r.net);
    PRISM_INFO("router stopped");
    return 0;
}
