/* router: shared state of the router process (one libuv loop thread owns all of it).
 *
 *   workers.c   control socket (ZeroMQ ROUTER polled from libuv), registry, heartbeats, dispatch
 *   requests.c  life of one generation request: validation, images, template, tokens, streaming
 *   api.c       HTTP endpoints and metrics
 *   main.c      flags and start-up
 */
#ifndef PRISM_ROUTER_H
#define PRISM_ROUTER_H

#include "core/core.h"
#include "net/net.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"
#include "template/template.h"
#include "http_server.h"
#include "metrics/metrics.h"

#include <jansson.h>
#include <uv.h>

#define ROUTER_MAX_WORKERS 256
#define ROUTER_MAX_IMAGES 64
#define ROUTER_MAX_WORKER_MSG (4 << 20)  /* largest frame a worker may send up (tokens with logprobs) */

typedef struct {
    bool used;
    Prism__Role role;
    char id[128];
    char data_endpoint[256];
    /* capacity from registration */
    uint32_t kv_blocks, block_size, max_batch_tokens, max_running, max_model_len;
    uint64_t mem_budget, mem_planned;
    /* load from heartbeats */
    uint32_t running, waiting, kv_free_blocks, pool_free;
    uint64_t mem_used, mem_peak, cache_hits, cache_misses, alloc_count, peer_auth_failures;
    double last_seen;
    /* our own view: requests we sent that have not finished on this worker */
    int inflight;
    uint64_t image_hashes[64];   /* recent images sent here: the router prefers a warm cache */
    int n_hashes;
} router_worker_t;

typedef struct router_req router_req_t;

typedef struct {
    /* configuration */
    const char *model_path;
    const char *served_model_name;
    const char *api_key;
    bool metrics_open;          /* /metrics without the API key */
    size_t max_stream_pending;  /* bytes queued for a streaming client that stopped reading; beyond: dropped */
    int max_model_len;
    int max_images_per_prompt;
    uint64_t max_image_pixels;
    int max_running;            /* requests in flight; beyond: 429 */
    size_t max_image_bytes_inflight;
    double worker_timeout_s;
    double request_timeout_s;
    double max_queue_wait_s;    /* no first token by then: 503 */
    int64_t created;

    /* model facts */
    prism_model_config_t cfg;
    prism_tokenizer_t *tok;
    prism_template_t *tmpl;
    char *bos_token, *eos_token;
    int32_t image_token_id;

    /* event loop and sockets */
    uv_loop_t *loop;
    prism_http_server_t *http;
    prism_net_t *net;           /* ZeroMQ context, CURVE keys, ZAP handler */
    void *ctl;                  /* ROUTER socket workers connect to */
    char router_id[160];
    uv_poll_t ctl_poll;
    uv_prepare_t ctl_prepare;
    uv_timer_t sweep_timer;
    uv_signal_t sigint, sigterm;

    router_worker_t workers[ROUTER_MAX_WORKERS];

    /* requests in flight, by id */
    router_req_t **reqs;        /* open-addressing map, cap entries */
    size_t reqs_cap, n_reqs;
    uint64_t next_rid;
    size_t image_bytes_inflight;
    /* requests accepted while every worker of a tier was at capacity, oldest first (ring) */
    uint64_t *queue;
    size_t queue_head, queue_len;
    bool draining;
    bool queue_dirty;           /* a worker slot freed since the queue was last tried */

    prism_router_metrics_t metrics;
} router_t;

/* workers.c */
int  router_ctl_start(router_t *r, const char *endpoint);
void router_ctl_stop(router_t *r);
/* Least-loaded worker of a role with a free slot (inflight < its registered capacity); NULL when
 * none has room. *any is set when at least one worker of the role is registered. */
router_worker_t *router_pick(router_t *r, Prism__Role role, uint64_t prefer_hash, bool *any);
router_worker_t *router_worker_by_id(router_t *r, const char *id);
int  router_send(router_t *r, router_worker_t *w, Prism__Envelope *env, const prism_frame_t *frames, int n);
bool router_ready(const router_t *r, bool need_encoder);
int  router_count_workers(const router_t *r, Prism__Role role);

/* requests.c */
void router_handle_generate(router_t *r, prism_http_req_t *h, bool chat);
void router_handle_tokens(router_t *r, uint64_t rid, const Prism__Tokens *t);
void router_handle_encode_done(router_t *r, uint64_t rid, const Prism__EncodeDone *d);
void router_fail_worker_requests(router_t *r, const router_worker_t *w);
void router_sweep_requests(router_t *r);
void router_abort_all(router_t *r);
void router_dispatch_queued(router_t *r);

/* request map */
router_req_t *router_req_get(router_t *r, uint64_t rid);
int  router_req_put(router_t *r, uint64_t rid, router_req_t *q);
void router_req_del(router_t *r, uint64_t rid);

/* api.c */
void router_on_http(prism_http_req_t *h, void *ud);
/* http_server on_headers hook: the API key, checked before any body byte is read. */
int  router_on_headers(const prism_http_req_t *h, void *ud, char *msg, size_t n);

#endif
