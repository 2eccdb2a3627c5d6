/* router: shared state of the router process (one libuv loop thread owns all of it).
 *
 *   main.c      flags and start-up
 *   control.c   control socket (ZeroMQ ROUTER polled from libuv): registrations, heartbeats and
 *               results in, silent workers dropped — the loop on top, it only calls down
 *   api.c       HTTP endpoints and metrics
 *   status.c    GET /status (JSON snapshot for operators) and GET / (the status page, embedded)
 *   prep_pool.c the preparation threads in two lanes: generation requests before /tokenize jobs
 *   requests.c  life of one generation request: preparation, admission, results, retry and
 *               migration, the sweep (request.h: the request and the files below that carry it)
 *   sched.c     where a request runs: its workers' messages, plan and commit, the router's queue
 *   output.c    what a client receives: SSE, whole responses, stop strings, logprobs, tool calls, errors
 *   reqmap.c    the requests in flight by id, and one request's memory
 *   url_images.c    a request's images given by URL, fetched on the loop before its admission
 *   early_encode.c  images sent to an encoder's cache while their request's body still arrives
 *   prompt.c    what a request sends to workers: images, chat template, tokens, image spans
 *   send.c      messages to one worker (work, aborts) over the control socket
 *   workers.c   worker registry (a leaf: capacity, load, picking a worker; no sockets)
 *   prefix_index.c  what each prefill's prefix cache holds (its PrefixEvents): prefix-aware picks
 */
#ifndef PRISM_ROUTER_H
#define PRISM_ROUTER_H

#include "core/core.h"
#include "net/net.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"
#include "template/template.h"
#include "guide/guide.h"
#include "toolcall/toolcall.h"
#include "http_server.h"
#include "openai_req.h"
#include "metrics/metrics.h"
#include "image/llama4_proc.h"
#include "image/qwenvl_proc.h"
#include "plan.h"
#include "prefix_index.h"

#include <jansson.h>
#include <uv.h>

#define ROUTER_MAX_WORKERS 256
#define ROUTER_WORKER_STAGES 3   /* most stages a tier's worker is timed on (decode: queue, first step, rest) */
#define ROUTER_MAX_IMAGES 64
#define ROUTER_MAX_HELD_TOKENS 256        /* decode Tokens messages held for the prefill's first token beyond
                                             n x max_tokens (ones with no token id; requests.c tokens_hold) */
#define ROUTER_AFFINITY_SLACK 2   /* requests in flight a warm encoder (or a prefill holding the
                                   * prompt's prefix) may have beyond the least loaded */
#define ROUTER_MAX_WORKER_MSG (4 << 20)  /* largest frame a worker may send up (tokens with logprobs) */
#define ROUTER_IO_THREADS 3      /* ZeroMQ I/O threads (router/main.c open_keys) */
#define ROUTER_ANSWER_EST_DEFAULT 256   /* tokens an answer is expected to take before any ended (sched.c) */

#define ROUTER_MAX_EARLY 64      /* early encodes in flight at once (early_encode.c) */
#define ROUTER_MAX_ENC_LATE 512  /* images let go unanswered whose EncodeDone is still timed (workers.c) */
#define ROUTER_EARLY_PER_CONN 4  /* ... of them one connection's unanswered at once */
#define ROUTER_WORKER_ID_MAX 127  /* bytes of a worker id (its ZeroMQ identity) */
#define ROUTER_DEFAULT_BUDGET ((int64_t)512 << 20)   /* --mem-budget: a router in front of one node */
#define ROUTER_PARSE_FACTOR 4     /* a body being prepared holds its tree, the template's copy of the
                                   * messages, the rendered text and its tokens: about 4x the tree */

typedef struct {
    bool used;
    Prism__Role role;
    char id[ROUTER_WORKER_ID_MAX + 1];  /* the ZeroMQ identity, byte for byte (never holds a NUL) */
    /* who registered it: the CURVE key its registration came with (empty without CURVE) and the
     * process instance; messages under this id are read only from that key, and a registration
     * from another instance is a restart (the old process's requests fail at once) */
    char peer_key[PRISM_NET_KEY_Z85 + 1];
    uint64_t instance;
    char data_endpoint[256];
    /* capacity from registration */
    uint32_t kv_blocks, block_size, max_batch_tokens, max_running, max_model_len;
    uint64_t mem_budget, mem_planned;
    /* load from heartbeats */
    uint32_t running, waiting, kv_free_blocks, pool_free;
    uint64_t mem_used, mem_peak, cache_hits, cache_misses, alloc_count, peer_auth_failures, kv_waits;
    uint64_t tokens_generated, seqs_aborted, prompts_aborted;   /* what aborts stopped (heartbeats) */
    uint64_t sends_waited;        /* encoders: embeddings that waited for a prefill's pool (backpressure) */
    uint64_t preemptions;         /* decode: sequences it preempted (recompute) since it started */
    uint64_t swaps, kv_swap_bytes;  /* decode: sequences it swapped out since it started; swap bytes in use */
    uint64_t migrations_out;      /* decode: sequences it preempted by sending their KV to another decode */
    uint64_t prefix_queries, prefix_hits, prefill_computed;   /* prefill: prompt tokens (heartbeats) */
    uint32_t image_decodes_peak;  /* encoders: most images decoded at once since start (its image pool) */
    uint64_t prefill_forwards, prefill_forward_prompts;   /* prefill: forwards, prompts they carried */
    uint32_t prefill_batch_peak;  /* prefill: most prompts in one forward */
    uint64_t prefill_pool_breaks; /* prefill: prompts failed to break a full embedding pool's stall */
    uint64_t kv_sent_bytes;       /* prefill, decode: KV transfer frame bytes sent (on the wire) */
    router_prefix_index_t prefix; /* prefill: the blocks its prefix cache holds, from its PrefixEvents */
    uint64_t heartbeats;          /* received since registration: lets a reader wait for fresh numbers */
    double registered_at;         /* first registration of this slot (prism_now_s) */
    double send_failed_at;        /* last failed send (its connection is gone): not picked until it is heard again */
    bool draining;                /* its heartbeat said SIGTERM: never picked again; answered with DrainAck */
    /* liveness: dead = silent for --worker-timeout; stuck = heartbeats say busy while progress
     * stays flat for --worker-stuck-timeout (no new work until it moves again) */
    double last_seen;            /* any message */
    double last_heartbeat;       /* for the interval histogram */
    uint64_t progress;           /* units of work the worker reports completed */
    double progress_at;          /* when progress last moved (or the worker was last seen not busy) */
    bool busy, stuck;
    int conn_fd;                 /* its connection to our control socket (ZMQ_SRCFD), -1 unknown */
    double t_conn;               /* when that connection was first seen: older disconnects are not its */
    /* our own view: requests we sent that have not finished on this worker */
    int inflight;
    /* decode: KV blocks the requests we sent here are expected to hold at their end (their prompts
     * plus their expected answers, sched.c), and the prompt blocks of those sent since its last
     * heartbeat (not in its kv_free_blocks yet) */
    uint64_t kv_expect, kv_sent;
    uint64_t completed;           /* parts of requests this worker finished or was released from */
    uint64_t queued_bytes;        /* encoders: image file bytes sent and not yet encoded */
    uint64_t max_queued_bytes;    /* encoders: their queue's byte bound from registration (0: none) */
    uint32_t cache_units;         /* encoders: tiles of their embedding cache (0: none, no early jobs) */
    uint64_t image_hashes[64];   /* recent images sent here: the router prefers a warm cache */
    int n_hashes;
    /* prism:worker_stage_seconds: the stages of its tier (router_worker_stages) it took, so one slow
     * worker stands out of its tier's; since it registered */
    prism_hist_t stage[ROUTER_WORKER_STAGES];
} router_worker_t;

typedef struct router_req router_req_t;
typedef struct prism_fetch prism_fetch_t;             /* fetch.h: image URLs */
typedef struct prism_fetch_blob prism_fetch_blob_t;

/* Where a finished request's time went: stages that partition its end-to-end time (the last body
 * byte to its completion) exactly, each gap a named stage, so their sums add up to the end-to-end
 * histogram's. prism:request_stage_seconds{stage} and x-prism-timing (<name>_ms) use these names;
 * output.c router_out_stages computes them, docs/API.md says what each covers. */
typedef enum {
    ROUTER_TS_PREPARE, ROUTER_TS_FETCH, ROUTER_TS_ROUTER_QUEUE, ROUTER_TS_ENCODER_QUEUE, ROUTER_TS_ENCODER_WAIT,
    ROUTER_TS_IMAGE_DECODE,
    ROUTER_TS_VIT, ROUTER_TS_PREFILL_QUEUE, ROUTER_TS_PREFILL, ROUTER_TS_DISPATCH, ROUTER_TS_KV_TRANSFER,
    ROUTER_TS_DECODE_QUEUE, ROUTER_TS_DECODE_FIRST_STEP, ROUTER_TS_DECODE, ROUTER_TS_COUNT
} router_time_stage_t;
extern const char *const router_time_stage_names[ROUTER_TS_COUNT];

/* An image sent to an encoder before its request exists (early_encode.c); rid 0: a free entry. */
typedef struct {
    uint64_t rid, rid_hi;        /* the job's own 128-bit id (not a request's) */
    bool done;                   /* answered: its slot is free, the entry kept for its request */
    char encoder_id[ROUTER_WORKER_ID_MAX + 1];
    uint64_t instance;           /* the encoder process it went to */
    uint64_t hash;               /* the image's content hash */
    uint64_t bytes;              /* file bytes, counted in the encoder's queued_bytes */
    double t_sent;               /* when sent, or when done */
    uint64_t body, conn;         /* the request (prism_http_req_id) and connection it came from */
} router_early_t;

/* An image its request sent to an encoder and stopped waiting for (the request ended, or its attempt
 * was let go) before the EncodeDone came: the encoder did (or does) the work, so its answer, when it
 * comes, is still timed in its prism:worker_stage_seconds, once (workers.c router_worker_take_let_go).
 * Only what the router sent is here: an EncodeDone it cannot match counts nothing. rid 0: free. */
typedef struct {
    uint64_t rid, rid_hi;        /* the request's 128-bit id at the time (a retry rekeys it) */
    uint64_t instance;           /* the encoder process it went to */
    uint32_t image;              /* its index among the request's images */
    uint16_t worker;             /* that encoder's slot in r->workers */
} router_enc_late_t;

/* prep_pool.c: a job for the preparation threads, in its lane (generation requests first, then
 * utility jobs: /tokenize, /detokenize). work comes first (the pool finds the job from it) and
 * work.data is the caller's; the rest is the pool's. */
typedef enum { ROUTER_LANE_GENERATE, ROUTER_LANE_UTILITY, ROUTER_LANE_COUNT } router_lane_t;
typedef enum { ROUTER_JOB_IDLE, ROUTER_JOB_WAITING, ROUTER_JOB_RUNNING } router_job_state_t;
typedef struct router_job router_job_t;
struct router_job {
    uv_work_t work;
    struct router *r;
    router_lane_t lane;
    router_job_state_t state;
    uv_work_cb run;
    uv_after_work_cb done;
    router_job_t *prev, *next;    /* its lane, while it waits */
};
typedef struct {
    router_job_t *head, *tail;    /* waiting, oldest first */
    size_t waiting;
    int running;                  /* on a thread */
    uint64_t started, cancelled;  /* since start: handed to a thread; taken out (the client left) */
} router_job_lane_t;

typedef struct router {
    /* configuration */
    const char *model_path;
    const char *served_model_name;
    const char *api_key;
    bool metrics_open;          /* /metrics without the API key */
    bool timing_header;         /* x-prism-timing on responses (operators: it shows image cache hits) */
    bool early_encode;          /* whole images go to an encoder before their body ends (early_encode.c) */
    uint8_t img_secret[192];    /* XXH3 secret for image cache keys (a client cannot aim at a cached entry) */
    /* the prefix-cache key chain's (Prefill.block_keys): derived from router.key as img_secret is, so
     * every router of a cluster names a prefix alike and reads the same workers' events */
    uint8_t prefix_secret[PRISM_KV_PREFIX_SECRET_BYTES];
    uint64_t trace_seed;        /* this router's own (random): the trace ids it makes (router_trace_of) */
    uint64_t max_image_bytes;   /* one image's file bytes, data URL or fetched (--max-image-bytes) */
    bool fetch_urls;            /* image URLs are fetched (fetch is open); set once at start-up */
    size_t max_stream_pending;  /* bytes queued for a streaming client that stopped reading; beyond: dropped */
    int max_model_len;
    int max_images_per_prompt;
    uint64_t max_image_pixels;
    int max_running;            /* requests in flight; beyond: 429 */
    size_t max_image_bytes_inflight;
    size_t max_early_bytes;     /* image bytes of early encodes not answered yet (early_encode.c) */
    size_t max_parse_bytes;     /* what one parsed body may cost (the plan's parse bound) */
    router_plan_t plan;         /* the memory plan (plan.h), exported in /metrics */
    double worker_timeout_s;
    double worker_stuck_timeout_s;  /* 0 = never judge a worker stuck */
    double request_timeout_s;
    double max_queue_wait_s;    /* no first token by then: 503 */
    int max_retries;            /* re-dispatches of a request whose worker died before its first token */
    int max_migrations;         /* times a request goes on elsewhere after its decode died mid-generation */
    double drain_timeout_s;
    double stage_timeout_s;     /* encode, or prefill to the first token, longer than this: retry, then 504 */
    int64_t created;
    double started_s;           /* prism_now_s() at start-up */

    /* model facts */
    prism_model_config_t cfg;
    prism_tokenizer_t *tok;
    prism_template_t *tmpl;
    char *bos_token, *eos_token;
    /* output constraints: compiled here to answer 400 on a bad one (the workers compile their own) */
    prism_grammar_vocab_t *gvocab;
    prism_guide_cache_t *guides;
    int tool_parser;            /* prism_toolcall_format_t of --tool-call-parser; -1 = none */
    int32_t image_token_id;     /* the placeholder the template renders per image (LLaVA: <image>,
                                 * Llama-4: <|image|>); -1 without a vision tower */
    /* Llama-4 (cfg.vision_arch PRISM_VISION_LLAMA4): each placeholder expands to the tile layout of
     * its image, computed from the image header alone; the encoder's rows fill the <|patch|>
     * positions (cfg.image_token_index) of that expansion. */
    bool llama4;
    prism_llama4_proc_t l4proc;
    prism_llama4_image_tokens_t l4ids;
    /* Qwen-VL (cfg.vision_arch PRISM_VISION_QWEN25): the template writes one <|image_pad|> per image;
     * it becomes as many pads as the image has LM tokens at native resolution (smart_resize of the
     * header's width and height), and the span carries the image's LM-token grid (M-RoPE). */
    bool qwenvl;
    prism_qwenvl_proc_t qwproc;

    /* event loop and sockets */
    uv_loop_t *loop;
    prism_http_server_t *http;
    prism_net_t *net;           /* ZeroMQ context, CURVE keys, ZAP handler */
    prism_fetch_t *fetch;       /* image URLs, fetched on this loop (url_images.c); NULL once stopped */
    void *ctl;                  /* ROUTER socket workers connect to */
    char router_id[160];
    uv_poll_t ctl_poll;
    uv_prepare_t ctl_prepare;
    uv_timer_t sweep_timer;
    uv_signal_t sigint, sigterm;
    uv_timer_t drain_timer;
    bool shutting_down;         /* SIGTERM/SIGINT: finishing what it holds, taking nothing new */
    double drain_deadline;      /* prism_now_s() by which the rest is aborted (--drain-timeout) */

    router_worker_t workers[ROUTER_MAX_WORKERS];
    uint32_t pick_turn[4];      /* by role: rotates ties between equally loaded workers */
    double answer_est;          /* running mean of the tokens an answer that stopped by itself took (0: none yet) */

    /* requests in flight, by id */
    router_req_t **reqs;        /* open-addressing map, cap entries */
    size_t reqs_cap, n_reqs;
    size_t n_preparing;         /* requests on the thread pool (requests.c prep_run) or fetching their
                                 * images (url_images.c), not yet in the map */
    size_t n_utility;           /* /tokenize and /detokenize requests being answered (api.c) */
    /* the preparation threads (prep_pool.c) */
    int prep_threads;
    int prep_running;
    router_job_lane_t lanes[ROUTER_LANE_COUNT];
    router_req_t *fetching;     /* requests whose image downloads run (url_images.c), a list */
    size_t image_bytes_inflight;
    /* requests accepted while every worker of a tier was at capacity, oldest first (ring) */
    uint64_t *queue;
    uint64_t *queue_scratch;    /* [reqs_cap]: the queue taken out while it is tried */
    size_t queue_head, queue_len;
    bool draining;
    bool queue_dirty;           /* a worker slot freed since the queue was last tried */
    uint64_t ctl_refused;       /* control messages dropped: unregistered sender, wrong key, not the request's worker */

    router_early_t early[ROUTER_MAX_EARLY];
    router_enc_late_t enc_late[ROUTER_MAX_ENC_LATE];   /* a ring: when full, the oldest is overwritten */
    uint32_t enc_late_next;
    prism_router_metrics_t metrics;
    uint64_t workers_lost_dead, workers_lost_stuck;
    prism_hist_t heartbeat_interval[4];  /* by role: seconds between a worker's heartbeats */
    prism_hist_t fetch_stage;   /* seconds a request waited for its images by URL (url_images.c) */
    prism_hist_t upload;        /* prism:request_upload_seconds: finished requests, first byte to last */
    prism_hist_t stage[ROUTER_TS_COUNT];   /* prism:request_stage_seconds: finished requests, by stage */
} router_t;

/* prep_pool.c: run(work) on a preparation thread, then done(work, status) on the loop, as
 * uv_queue_work does, once a thread is free for the job's lane (see prep_pool.c). j must stay valid
 * until done runs, or until router_prep_cancel took it out. */
void router_prep_submit(router_t *r, router_job_t *j, router_lane_t lane, uv_work_cb run, uv_after_work_cb done);
/* Takes a job that still waits for a thread out of its lane: true (neither run nor done will be
 * called); false when it is on a thread or done already. */
bool router_prep_cancel(router_t *r, router_job_t *j);

/* control.c */
int  router_ctl_start(router_t *r, const char *endpoint);
void router_ctl_stop(router_t *r);

/* send.c: PRISM_OK, else the send failed (the worker's connection is gone) and w is passed over by
 * the picks until it is heard from again. */
int  router_send(router_t *r, router_worker_t *w, Prism__Envelope *env, const prism_frame_t *frames, int n);
/* Tells w to drop what it holds under rid (best effort). */
void router_send_abort(router_t *r, router_worker_t *w, uint64_t rid);
/* The same to the registered worker of that id, if any ("" names none). */
void router_send_abort_to(router_t *r, const char *worker_id, uint64_t rid);

/* early_encode.c */
/* http_server image_done hook: a lifted image of h is whole and passed its checks; sent to an
 * encoder's cache when one has room and no request waits. ud: the router. */
void router_early_encode(const prism_http_req_t *h, int index, const uint8_t *data, size_t len, void *ud);
/* The same for image `index` of request h being prepared whose bytes are whole and checked (an image
 * fetched by URL while the request's other images still download). data is read during the call. */
void router_early_send(router_t *r, const prism_http_req_t *h, int index, const uint8_t *data, size_t len);
/* http_server body_gone hook: h never reaches the handler; router_early_forget of its body. */
void router_early_body_gone(const prism_http_req_t *h, void *ud);
/* The request whose body is `body` (prism_http_req_id) ended, or never became one: its early jobs
 * still running are aborted (their slots and bytes back at once). Done ones stay known. */
void router_early_forget(router_t *r, uint64_t body);
/* A request found no encoder with room: the youngest running early job (of an image not in keep[],
 * the request's own content hashes, which it would take over) is aborted for it. False when none. */
bool router_early_preempt(router_t *r, const uint64_t *keep, int n_keep);
/* EncodeDone for an id that is no request (nor an image let go unanswered:
 * router_worker_take_let_go): an early job is released. False only when rid is an early job of another
 * encoder (the message is refused); an id of neither kind is a request that ended. */
bool router_early_encode_done(router_t *r, const router_worker_t *from, uint64_t rid, uint64_t rid_hi,
                              const Prism__EncodeDone *d);
/* Early jobs unanswered past --stage-timeout, or on an encoder gone or stuck: aborted and released. */
void router_early_encode_sweep(router_t *r, double now);
/* At a request's dispatch: the encoder of an early job of this image still held (not among the
 * n_taken ids already claimed for the request's other images), its id in *early_id; NULL when none.
 * The job's slot and bytes become the request's once its Encode (with early_id) is sent:
 * router_early_adopted forgets the job without releasing them. */
router_worker_t *router_early_claim(router_t *r, uint64_t hash, const uint64_t *taken, int n_taken, uint64_t *early_id);
void router_early_adopted(router_t *r, uint64_t early_id);
/* The id of a done early job of this image on w, forgotten from here (0 when none): the request's
 * Encode names it, so finding its result is not counted as a cache hit. */
uint64_t router_early_take_done(router_t *r, uint64_t hash, const router_worker_t *w);

/* workers.c (registry) */
/* Adds or refreshes a worker from its registration; PRISM_EINVAL / PRISM_ELIMIT with why set when
 * it is refused. */
int  router_worker_register(router_t *r, const char *id, const char *peer_key, const Prism__Register *g, char *why,
                            size_t why_len);
/* Whether registration g (arriving with peer_key) comes from the process that registered w. */
bool router_worker_same_process(const router_worker_t *w, const char *peer_key, const Prism__Register *g);
/* Records a heartbeat's load and progress (hb may be NULL); false when the worker is not registered. */
bool router_worker_heartbeat(router_t *r, const char *id, const Prism__Heartbeat *hb);
void router_worker_drop(router_worker_t *w);
/* Remembers that an image with this content hash went to w (its embedding cache may hold it). */
void router_worker_note_image(router_worker_t *w, uint64_t hash);
/* An image of request rid (its index `image`) sent to encoder w that the request stopped waiting for
 * (it ended, or its attempt was let go): remembered in r->enc_late, the oldest overwritten when full,
 * so that w's EncodeDone for it, when it comes, is still timed. */
void router_worker_note_let_go(router_t *r, const router_worker_t *w, uint64_t rid, uint64_t rid_hi, uint32_t image);
/* An EncodeDone for an id that is no request in flight: true when it answers an image noted above,
 * under its whole id, from the encoder it went to (the same process), which is then forgotten: a
 * second one, or one from another worker, counts nothing. */
bool router_worker_take_let_go(router_t *r, const router_worker_t *from, uint64_t rid, uint64_t rid_hi, uint32_t image);
/* Leading blocks of keys[0..n) (of block_size tokens) w's prefix cache holds as its events told
 * (0 for a worker of another block size). */
int router_worker_prefix_hit(const router_worker_t *w, const prism_kv_key_t *keys, int n, uint32_t block_size);
/* The request stages a worker of role is timed on (its prism:worker_stage_seconds): encoders per
 * image (image_decode, vit), prefill and decode per finished request; *n of them (0: none). */
const router_time_stage_t *router_worker_stages(int role, int *n);
/* Observes st[] (seconds by router_time_stage_t) in the histograms of worker id's tier stages (an id
 * no longer registered: nothing). */
void router_worker_observe(router_t *r, const char *id, const double *st);
/* Least-loaded worker of a role with a free slot (inflight < its registered capacity) that is not
 * stuck, not draining and reachable; NULL when none has room. *any is set when at least one worker
 * of the role that is not stuck is registered (a draining one counts: the request waits for room).
 * prefer_hash (an image's content hash, or 0): a worker with room that recently encoded it wins
 * (embedding-cache affinity) unless it has more than ROUTER_AFFINITY_SLACK requests in flight beyond
 * the least loaded. Equally loaded workers take turns, so a light load is spread, not sent to the first. */
router_worker_t *router_pick(router_t *r, Prism__Role role, uint64_t prefer_hash, bool *any);
/* Same with room for `slots` more in-flight units (a request's n sequences in a decode batch) and,
 * for an encoder, for `bytes` more queued image bytes (under its --max-queued-image-bytes; an
 * encoder holding none takes an image of any size). */
router_worker_t *router_pick_slots(router_t *r, Prism__Role role, uint64_t prefer_hash, int slots, uint64_t bytes,
                                   bool *any);
/* Where a sequence that decode worker `from` parked (preemption by migration) goes: the decode worker
 * other than `from`, of its block size, with room for one more sequence and, by its last heartbeat, `blocks` free KV
 * blocks beyond 2% of its pool (its admission watermark), the most free first; NULL when none. */
router_worker_t *router_pick_kv_target(router_t *r, const router_worker_t *from, uint64_t blocks);
/* Load a plan being made puts on a worker without having counted it yet (sched.c). */
typedef struct {
    const router_worker_t *w;
    int slots;
    uint64_t bytes;
} router_load_t;
/* What a pick asks for: router_pick_slots' arguments, the plan's uncounted load (seen as the workers'
 * own), and workers passed over (seen as full) while another has room; only they with room: them. */
typedef struct {
    Prism__Role role;
    uint64_t prefer_hash;
    int slots;
    uint64_t bytes;
    const router_load_t *planned;
    int n_planned;
    const char (*avoid)[ROUTER_WORKER_ID_MAX + 1];
    int n_avoid;
    /* decode: the request's prompt tokens and the tokens each sequence is expected to add (kv_prompt
     * 0: no KV counted for it); the pick weighs each worker's KV room after it (router_kv_room) */
    uint64_t kv_prompt, kv_more;
    /* prefill: the prompt's block keys (of prefix_block_size tokens): the worker whose index holds
     * the longest leading run of them wins, within ROUTER_AFFINITY_SLACK of the least loaded */
    const prism_kv_key_t *prefix_keys;
    int n_prefix_keys;
    uint32_t prefix_block_size;
} router_want_t;
/* KV blocks on decode worker w for n sequences of prompt + more tokens each (at most its context),
 * sharing the prompt's full blocks when n > 1 (decode_worker's rule, prism_kv_blocks_for_shared). */
uint64_t router_kv_blocks(const router_worker_t *w, uint64_t prompt, uint64_t more, int n);
/* Blocks decode worker w is expected to have free once what runs there has grown as expected and
 * want's request is in: its pool less the larger of (used at its last heartbeat + prompt blocks we
 * sent since) and (the expected end footprint of what we sent there), less the request's own
 * expected footprint. Negative: it would preempt. */
int64_t router_kv_room(const router_worker_t *w, const router_want_t *want);
router_worker_t *router_pick_want(router_t *r, const router_want_t *want, bool *any);
router_worker_t *router_worker_by_id(router_t *r, const char *id);
bool router_ready(const router_t *r, bool need_encoder);
int  router_count_workers(const router_t *r, Prism__Role role);

/* prompt.c: what a generation request sends to its workers. Owned by the request; freed with
 * router_prompt_free. */
typedef struct {
    int n_images;
    uint8_t *img[ROUTER_MAX_IMAGES];        /* decoded file bytes (the router never decodes pixels); kept
                                             * until the first token (a retry sends them again), or while
                                             * the request may still migrate (it is encoded again), then NULL */
    size_t img_len[ROUTER_MAX_IMAGES];
    int img_lift[ROUTER_MAX_IMAGES];        /* 1 + its lifted image's index while img[] is still the HTTP
                                             * server's (router_prompt_take_images), else 0 */
    prism_fetch_blob_t *img_blob[ROUTER_MAX_IMAGES];  /* a fetched image: img[] points into it (a reference
                                             * to the fetcher's buffer, which its URL cache may share), else NULL */
    const char *img_url[ROUTER_MAX_IMAGES]; /* an image given by URL, until fetched (points into the parsed
                                             * request, then into the request's kept inputs: reqmap.c) */
    size_t img_url_len[ROUTER_MAX_IMAGES];
    int n_urls;                             /* images given by URL */
    prism_shared_t *img_ref[ROUTER_MAX_IMAGES]; /* img[] as shared bytes once taken (not fetched): the Encode
                                             * frames that carry it are references, not copies (NULL: owned) */
    uint64_t img_hash[ROUTER_MAX_IMAGES];
    int img_w[ROUTER_MAX_IMAGES], img_h[ROUTER_MAX_IMAGES];   /* from the header */
    uint32_t img_offset[ROUTER_MAX_IMAGES]; /* first token of each image's span, found while expanding */
    uint32_t img_span[ROUTER_MAX_IMAGES];   /* tokens in that span: image_seq_length (LLaVA), the whole
                                             * expansion with separators (Llama-4), the pads (Qwen-VL) */
    uint32_t img_rows[ROUTER_MAX_IMAGES], img_cols[ROUTER_MAX_IMAGES];   /* Qwen-VL: LM-token grid */
    int64_t min_pixels, max_pixels;         /* Qwen-VL with mm_processor_kwargs: the processor's limits for
                                             * this request's images (Encode carries them); max_pixels 0: the
                                             * processor's own (no kwargs) */
    bool mm_keyed;                          /* img_hash covers them (once) */
    size_t image_bytes;
    int32_t *tokens;                        /* prompt, each image placeholder expanded */
    size_t n_tokens, cap;
    int max_tokens;                         /* max_tokens, or what the context leaves when unset */
} router_prompt_t;

/* Llama-4: loads the image processor's config from the model directory and the image prompt's
 * special token ids from the tokenizer (r->tok); logs why and returns an error when either is
 * missing or disagrees with config.json. */
int  router_llama4_init(router_t *r, const char *model_dir);
/* Qwen-VL: the image processor's config and the vision special tokens, checked against config.json. */
int  router_qwenvl_init(router_t *r, const char *model_dir);
/* The checks of image idx (media type, base64, bytes, header, pixel limit), in the order its answer
 * names them; both the early ones (router_image_check_early while the body streams in, url_images.c
 * while a download does) and the final one (router_prompt_load_images, or a download's end) give the
 * same answer for the same image. mime NULL: no declared type (a fetched image; its bytes decide).
 * data may be the first len bytes of an image still arriving (complete false): then only verdicts
 * more bytes cannot change are given, ROUTER_IMAGE_MORE otherwise (a header that passes is not yet a
 * verdict: the bytes may still run past --max-image-bytes). Returns 0 (info filled),
 * ROUTER_IMAGE_MORE, or 400 (msg). */
#define ROUTER_IMAGE_MORE (-1)
int  router_image_check(const router_t *r, int idx, const char *mime, size_t mime_len, bool bad, const uint8_t *data,
                        size_t len, bool complete, prism_image_info_t *info, uint64_t *refused,
                        char *msg, size_t n);
/* Preparing a request (a thread-pool thread: these read only the router's configuration and model
 * facts, which never change after start-up, and count refusals into the caller's refused[]):
 * router_prompt_load_images decodes every image part's data URL and checks it (router_image_check);
 * an image the HTTP server lifted out of the body is read in place, and router_prompt_take_images
 * makes those the prompt's afterwards, on the loop thread (before anything frees the prompt). An
 * image given by an http(s) or file URL is only noted (img_url[], n_urls): url_images.c fetches it
 * on the loop once the rest is prepared. These return 0 or an HTTP status with msg filled. */
int  router_prompt_load_images(const router_t *r, router_prompt_t *p, const prism_oai_request_t *o,
                               const prism_http_req_t *h, uint64_t *refused, char *msg, size_t n);
void router_prompt_take_images(router_prompt_t *p, prism_http_req_t *h);
/* Renders + tokenizes (chat) or tokenizes (completions), expands image placeholders, checks the
 * length against the context: router_prompt_tokens (the text's tokens, and as many placeholders as
 * images) then router_prompt_finish (each placeholder expanded, which needs every image's header for
 * Llama-4's tiles; the length and max_tokens). A request with images by URL takes the two apart:
 * the tokens on the thread pool, the rest on the loop once its images are in (a few copies of the
 * token array, no tokenizing). */
int  router_prompt_build(const router_t *r, router_prompt_t *p, const prism_oai_request_t *o, bool chat, char *msg,
                         size_t n);
int  router_prompt_tokens(const router_t *r, router_prompt_t *p, const prism_oai_request_t *o, bool chat, char *msg,
                          size_t n);
int  router_prompt_finish(const router_t *r, router_prompt_t *p, const prism_oai_request_t *o, char *msg, size_t n);
/* Image i's bytes are no longer needed (freed, or its reference dropped: frames in flight keep theirs). */
void router_prompt_drop_image(router_prompt_t *p, int i);
/* The frame that sends image i to an encoder: by reference (ZeroMQ drops the reference the frame
 * takes once sent): a fetched image to the fetcher's buffer, an uploaded one to its shared bytes,
 * so an image is held once however many Encodes carry it; copied when it could not be shared. */
prism_frame_t router_prompt_image_frame(const router_prompt_t *p, int i);
void router_prompt_free(router_prompt_t *p);
/* An assistant message's tool-call arguments (JSON text in OpenAI's format) as objects, which is
 * what tool-use chat templates expect (vLLM does the same before rendering). In place. */
void router_prompt_tool_arguments_as_objects(json_t *msg);
/* A raw message as the chat template sees it, in place (tool-call arguments as objects, image parts
 * as {"type":"image"}): /tokenize renders what the chat path would. */
void router_prompt_template_message(json_t *msg);

/* requests.c */
/* Whether a request arriving now is refused before its preparation (requests in flight, being
 * prepared and /tokenize jobs at --max-running-requests: 429, counted; never for draining: what
 * arrives then began before the drain, and is served): its status with msg filled, or 0. */
int router_refusal_at_arrival(router_t *r, char *msg, size_t n);
void router_handle_generate(router_t *r, prism_http_req_t *h, bool chat);
/* Results from worker `from`: taken only when it holds the request at that stage (prefill: the first
 * token or its error, once; decode: the rest; encoder: its image, or, after the request ended or its
 * attempt was let go, only its timings, once per image sent to it); false when refused. The prefill's
 * Tokens (the first token) and the decode's (the rest) come from two processes over two connections,
 * so the decode's may arrive first: those are held, in order, until the prefill's arrives (at most
 * the tokens the request may be sent, n x max_tokens, in at most that many messages plus
 * ROUTER_MAX_HELD_TOKENS; beyond, the request fails). *kept: env was kept (the caller must not free
 * it). */
bool router_handle_tokens(router_t *r, const router_worker_t *from, Prism__Envelope *env, bool *kept);
bool router_handle_encode_done(router_t *r, const router_worker_t *from, uint64_t rid, uint64_t rid_hi,
                               const Prism__EncodeDone *d);
/* Every request w holds goes elsewhere (a retry before the first token, a migration after it) or
 * fails (503); why ends "The <role> worker serving this request ...". */
void router_fail_worker_requests(router_t *r, const router_worker_t *w, const char *why);
void router_sweep_requests(router_t *r);
void router_abort_all(router_t *r);
void router_dispatch_queued(router_t *r);

/* output.c: the OpenAI error answer for status (its type; Retry-After with 429 and 503). */
void router_respond_error(prism_http_req_t *h, int status, const char *message, const char *param);

/* reqmap.c: the requests in flight */
router_req_t *router_req_get(router_t *r, uint64_t rid);
/* The log context of request rid (its id and trace; zeros when it is not in flight): a copy, so the
 * request may end while lines about it are logged (prism_log_ctx_enter). */
prism_log_ctx_t router_req_log(router_t *r, uint64_t rid);
/* The trace of body h (its request and its early encodes alike): the client's W3C traceparent's trace
 * id and flags, else an id this router makes from h's id (unique among this router's bodies, apart
 * from other routers' by trace_seed), flags 01. */
void router_trace_of(const router_t *r, const prism_http_req_t *h, prism_trace_id_t *trace, uint8_t *flags);
/* A fresh request id from the kernel's CSPRNG, unique among the requests in flight; PRISM_EIO without randomness. */
int  router_req_new_id(router_t *r, uint64_t *out, uint64_t *hi);
int  router_req_put(router_t *r, uint64_t rid, router_req_t *q);
void router_req_del(router_t *r, uint64_t rid);
/* The most one request in flight holds, its parsed body not counted (freed once it is prepared): its
 * record, prompt tokens and the tokens kept for a migration (the context each), output buffers. */
size_t router_req_bytes_max(const router_t *r);

/* api.c */
void router_on_http(prism_http_req_t *h, void *ud);
/* http_server on_headers hook: the API key, checked before any body byte is read. */
int  router_on_headers(const prism_http_req_t *h, void *ud, char *msg, size_t n);
/* http_server body_gate hook: uploads wait (TCP backpressure) instead of piling up bytes in the
 * router. While requests wait in the router's queue for a free worker, every upload but the oldest
 * waits (the oldest goes on, so a queue kept busy cannot starve an upload). While the image bytes
 * held reach --max-image-bytes-in-flight, every upload that carries an image waits, the oldest too
 * (text ones go on); the bytes held may so pass that bound by the one request whose body completed
 * under it. */
prism_http_body_gate_t router_body_gate(const prism_http_req_t *h, void *ud);
/* http_server image_check hook: a chat request's image that router_image_check refuses is answered
 * 400 on its first bytes, before the rest of the body is uploaded (counted as the handler counts it). */
int  router_image_check_early(const prism_http_req_t *h, int index, const char *mime, const uint8_t *data,
                              size_t len, bool bad, bool done, char *msg, size_t n, void *ud);

/* status.c */
void router_handle_status(router_t *r, prism_http_req_t *h);
void router_handle_status_page(router_t *r, prism_http_req_t *h);
/* Refusals by prism_refusal_t: the router's own plus those the HTTP server answered itself. */
void router_refusals(const router_t *r, uint64_t out[PRISM_REFUSE_COUNT]);

#endif
