/* request: one generation request inside the router, and the files that carry it through its life.
 *
 *   reqmap.c    the request map (by id) and the request's memory: everything it owns is freed in
 *               router_req_free, one place
 *   sched.c     where it runs: the messages its workers receive (built once, at preparation), the
 *               plan step that chooses workers (pure: nothing counted, nothing sent) and the commit
 *               step that sends and counts once; giving its workers back; the router's queue
 *   output.c    what its client receives: SSE chunks, the whole response, stop strings, logprobs,
 *               tool-call events, error answers
 *   requests.c  its life: preparation, admission, worker results, retry and migration, the sweep
 *   url_images.c  its images given by URL, fetched between its preparation and its admission
 *
 * Calls point down: requests.c calls sched.c, output.c, url_images.c and reqmap.c; sched.c calls
 * reqmap.c, early_encode.c, send.c and workers.c; url_images.c calls prompt.c and early_encode.c and
 * hands the request back through the callback it was given; output.c calls none of these. Only
 * requests.c ends a request. One loop thread. */
#ifndef PRISM_ROUTER_REQUEST_H
#define PRISM_ROUTER_REQUEST_H

#include "router.h"
#include "openai_write.h"

typedef enum { STAGE_QUEUED, STAGE_SENT, STAGE_PREFILLED } router_stage_t;

typedef struct prism_fetch_req prism_fetch_req_t;   /* fetch.h */

/* A request's output state beyond its record (text, detokenizer, logprob and SSE scratch), as the
 * memory plan counts it; a long answer with logprobs of many choices may hold more. */
#define ROUTER_REQ_OUTPUT_BYTES ((size_t)64 << 10)

/* A tool-call delta collected from the parser for the next chunk (name and id are copied: the
 * parser's pointers live only during its callback; arguments sit in choice.d_args). */
typedef struct {
    int index;
    bool begin;
    char id[32];
    char name[72];
    size_t args_off, args_len;
} router_tool_delta_t;

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
    router_tool_delta_t *d_tools;
    int n_d_tools, cap_d_tools;
    bool tc_failed;               /* out of memory in the callback: the rest streams as content */
} router_choice_t;

/* The messages its workers receive, built once from the parsed request when it is prepared
 * (router_sched_msgs_build); a dispatch patches only what the attempt decides (the decode
 * endpoint, the ids, an image's encoder job), a migration the prompt and Sampling.generated. */
typedef struct {
    Prism__Sampling sampling;
    Prism__Guide guide;
    int32_t stop_ids[PRISM_OAI_MAX_STOP_TOKEN_IDS];
    Prism__ImageSpan spans[ROUTER_MAX_IMAGES];
    Prism__ImageSpan *span_ptrs[ROUTER_MAX_IMAGES];
    Prism__Prefill prefill;
    Prism__Encode encode;         /* one image's, filled per image as it is sent */
    Prism__Envelope env;          /* around either */
    int32_t *ids;                 /* after a migration: the prompt and the tokens generated (owned) */
    /* the prompt's prefix-cache keys (sched.c prefix_keys; Prefill.block_keys): for the prefill
     * pick and the encoder skip; computed per block size and prompt length (a migration's is longer) */
    prism_kv_key_t *keys;         /* [n_keys] (owned) */
    uint8_t *key_bytes;           /* [n_keys * PRISM_KV_PREFIX_KEY_BYTES] as sent (owned) */
    int n_keys, n_lookup;         /* keys; those a cache may match (no image without identity, not the last token) */
    uint32_t key_block_size;      /* 0: none computed */
    size_t keys_for;              /* the prompt length they were computed for */
} router_msgs_t;

/* Where it runs now (sched.c): this attempt's workers, and what the attempts so far learnt. */
typedef struct {
    char prefill_id[ROUTER_WORKER_ID_MAX + 1], decode_id[ROUTER_WORKER_ID_MAX + 1];
    bool prefill_pending, decode_pending;
    /* preemption by migration in flight (requests.c req_move_kv): the decode worker the KV comes
     * from ("" none); decode_id is its target. Cleared by the target's first token. */
    char mig_from[ROUTER_WORKER_ID_MAX + 1];
    char encoder_id[ROUTER_MAX_IMAGES][ROUTER_WORKER_ID_MAX + 1];
    bool encode_pending[ROUTER_MAX_IMAGES];
    uint64_t early_id[ROUTER_MAX_IMAGES];   /* the early job its image's Encode adopts (early_encode.c), 0 none */
    int n_first, n_worker_ended;  /* choices with prefill's token in; choices a worker finished */
    int attempts;                 /* dispatches so far; a retry is one more (bounded by --max-retries) */
    char avoid[4][ROUTER_WORKER_ID_MAX + 1];   /* workers an earlier attempt got stuck on: others first */
    int n_avoid;
    bool no_skip;                 /* encode every image: the prefill's cache lost what a skip counted on */
    const char *waiting_for;      /* while queued because a tier has no worker at all: its name */
    unsigned wait_tiers;          /* ROUTER_TIER_* bits it waited for at its last dispatch */
    uint64_t kv_expect;           /* KV blocks counted in its decode worker's kv_expect (router_kv_room) */
} router_placement_t;

/* Migration (n = 1, see requests.c req_migrate): the tokens generated so far, kept while a migration
 * is possible and sent again with the prompt; at most max_tokens of them. */
typedef struct {
    int32_t *gen;                 /* owned */
    int n_gen, gen_cap;
    int count;                    /* migrations so far */
    bool off;                     /* no memory to keep the tokens: this request fails as before */
    bool decode_heard;            /* this attempt's decode sent a token: the KV reached it */
} router_migration_t;

/* What its client receives (output.c). */
typedef struct {
    prism_oai_resp_meta_t meta;
    router_choice_t *choices;     /* [oai.n] (owned) */
    int n_out;                    /* tokens over all choices */
    int n_finished;
    bool streaming_started;
    prism_buf_t buf;              /* scratch for response bytes */
    prism_buf_t tok_bytes[21];    /* scratch for one token's logprob entry: [0] chosen, [1..] top */
} router_output_t;

/* Stage timings: the router's clock (prism_now_s) at each step, and what the workers measured. */
typedef struct {
    double began;                 /* its first byte (the upload: began to start) */
    double start;                 /* the last body byte: the handler ran */
    double wait;                  /* the wait for workers began (start; a migration restarts it) */
    double sent;                  /* its first attempt was handed to ZeroMQ (x-prism-timing router_ms) */
    double dispatch;              /* the current attempt was sent (per-stage deadline) */
    double admit;                 /* prepared and admitted (its images by URL in): it may be dispatched */
    double first, last;           /* its first and its latest token */
    double first_decode;          /* its decode worker's first message (0: none yet) */
    float decode_ms, vit_ms;      /* encoders: image decode and vision tower (sums over images) */
    float enc_queue_ms;           /* encoders: their queue (sum over images) */
    float queue_ms, prefill_ms;   /* its prefill worker: the wait for a start (embeddings in), the prefill */
    float embed_wait_ms;          /* its prefill worker: from the request's arrival to its embeddings all in */
    float dec_queue_ms, dec_step_ms;   /* its decode worker: KV in to admitted, admitted to its first message */
    float fetch_ms;               /* its images by URL: from their downloads' start to the last one's end */
    int cache_hits;               /* images found in an encoder's embedding cache */
} router_times_t;

/* Preparation on the preparation threads (requests.c prep_run): the loop thread keeps off
 * everything else until prep_done reads what it found. */
typedef struct {
    router_job_t job;             /* on the preparation threads (prep_pool.c: generation lane) */
    bool gone;                    /* the client went away meanwhile */
    bool parsed;
    prism_oai_error_t perr;
    int check;                    /* admit_check's: its model, its output constraint; 0 ok */
    char param[128];              /* the field check refused */
    int status;                   /* of loading the images and building the prompt; 0 ok */
    char msg[600];                /* check's message, else status's */
    uint64_t refused[PRISM_REFUSE_COUNT];
} router_prep_t;

/* Its images given by URL (url_images.c), while they download; allocated only for such a request. */
typedef struct {
    router_req_t *q;
    int index;                    /* the image's place among the request's images */
    prism_fetch_req_t *fq;        /* its download, until answered or cancelled */
    size_t ask_at;                /* bytes at which its header is checked again (doubling, as for uploads) */
    bool paused;                  /* waits for image room (--max-image-bytes-in-flight) */
    bool waited;                  /* has waited for it: a timeout is then the server's load, not the URL's */
} router_url_image_t;

typedef struct {
    void (*done)(router_req_t *q); /* once: every image in (prep.status 0), or the first failure */
    double t_start;
    bool listed;                  /* in the router's list of requests that fetch (r->fetching) */
    router_req_t *prev, *next;
    int n, n_pending;
    router_url_image_t img[];     /* [n] */
} router_url_fetch_t;

struct router_req {
    uint64_t rid;                 /* the low half of its 128-bit id: the map's key */
    uint64_t rid_hi;              /* the high half: a worker's message about it must carry both */
    prism_trace_id_t trace;       /* W3C trace id: the client's traceparent's, else drawn (reqmap.c) */
    uint8_t trace_flags;          /* the client's traceparent flags (01: sampled when it sent none) */
    router_t *r;
    prism_http_req_t *h;          /* NULL once released */
    uint64_t body;                /* prism_http_req_id(h): its early encodes' owner (early_encode.c) */
    bool chat;
    router_stage_t stage;
    /* what was asked */
    prism_oai_request_t oai;
    router_prompt_t prompt;       /* images, tokens, image spans, max_tokens (prompt.c) */
    prism_guide_spec_t guide;     /* output constraint sent in Sampling.guide (points into oai) */
    bool parse_tools;             /* tool_choice auto / required / named: outputs are parsed for calls */
    size_t image_charged;         /* its image bytes counted in the router's image_bytes_inflight: its
                                   * lifted images from the moment its body is whole (the gate sees them
                                   * before it is prepared), then prompt.image_bytes */
    char *kept;                   /* what it reads of its body after preparation (model name, stop strings,
                                   * guide text, tool name, image URLs), copied out of the parsed tree (owned) */
    router_msgs_t msg;
    router_placement_t place;
    Prism__Envelope **held;       /* decode Tokens that arrived before the prefill's, in order (owned) */
    int n_held, held_cap;
    int64_t held_tokens;          /* token ids in them */
    router_migration_t mig;
    router_output_t out;
    router_times_t time;
    router_prep_t prep;
    router_url_fetch_t *fetch;    /* its images by URL (owned; NULL without any) */
};

static inline int router_req_n(const router_req_t *q) { return q->oai.n > 0 ? q->oai.n : 1; }

/* reqmap.c: the request's memory (its owned buffers, grouped above, all freed here) and the map of
 * requests in flight (router.h: router_req_get, router_req_new_id, router_req_put, router_req_del). */
router_req_t *router_req_alloc(router_t *r, prism_http_req_t *h, bool chat);
void router_req_free(router_req_t *q);
/* At the end of its preparation (a prep thread): the parsed body goes, so a parsed tree lives only
 * while a prep thread works on it (the memory plan's "parsing" row is prep threads x the parse
 * bound, whatever the requests in flight). What the request reads later is copied into q->kept and
 * its pointers moved there; the scalars stay. PRISM_ENOMEM (the tree kept) without memory. */
int  router_req_keep_inputs(router_req_t *q);
/* A new id for a request in the map (a retry or a migration): late messages about the old one match
 * nothing, and no worker's memory of the old one's abort can catch it. */
void router_req_rekey(router_t *r, router_req_t *q);
/* Drops the decode Tokens held for the prefill's. */
void router_req_drop_held(router_req_t *q);

/* sched.c */
#define ROUTER_DISPATCH_WAIT 1
enum { ROUTER_TIER_ENCODER = 1, ROUTER_TIER_PREFILL = 2, ROUTER_TIER_DECODE = 4 };
/* The messages of a prepared request (its prompt built, its guide set). */
void router_sched_msgs_build(router_req_t *q);
/* The messages of a migrating request: its prompt and the mig.n_gen tokens generated so far;
 * PRISM_ENOMEM (nothing changed) without memory. */
int  router_sched_msgs_migrate(router_req_t *q);
/* Chooses workers and sends the request to them: 0 when sent, ROUTER_DISPATCH_WAIT when it must wait
 * in the router's queue (every worker of a tier is at capacity, a tier has no worker at all, or a
 * worker could not be reached), else an HTTP status with msg (n sequences no decode worker could
 * ever hold). */
int  router_sched_dispatch(router_t *r, router_req_t *q, char *msg, size_t n);
/* A stage is over: its worker's slots are free (a queued request may take them). */
void router_sched_prefill_done(router_req_t *q);
void router_sched_decode_done(router_req_t *q);
/* An answer that stopped by itself (not at max_tokens) took `tokens`: the running mean the decode
 * pick expects an answer's length from (r->answer_est). */
void router_sched_note_answer(router_t *r, int tokens);
/* An encoder answered image `image` (or the request dropped it): its slot and bytes come back. */
void router_sched_encode_done(router_req_t *q, int image);
/* The request stops waiting for image `image`'s EncodeDone (it ends, or its attempt is released):
 * the same, and the image is remembered (router_worker_note_let_go) so that its encoder's answer,
 * when it comes under this id, is still timed. */
void router_sched_encode_let_go(router_req_t *q, int image);
/* Aborts every worker still holding it (after the last choice ended, an error or a client that went away). */
void router_sched_abort(router_req_t *q);
/* Gives every worker back (aborting those that hold it), as if it had never been dispatched, under a
 * new id (router_req_rekey). */
void router_sched_release(router_req_t *q);
/* Whether w holds it at its current stage. */
bool router_sched_holds(const router_req_t *q, const router_worker_t *w);
/* The router's queue (requests that wait for a worker: by priority, then oldest first). */
unsigned router_sched_tiers(const router_req_t *q);
bool router_queue_push(router_t *r, uint64_t rid);
bool router_queue_push_front(router_t *r, uint64_t rid);
/* Orders r->queue_scratch[0, n) (the queue taken out) by priority, then age. */
void router_queue_order(router_t *r, size_t n);
/* Whether a new request must queue behind waiting ones: they wait for a tier it needs too. */
bool router_queue_blocks(router_t *r, const router_req_t *q);

/* url_images.c */
/* Starts the downloads of the request's images given by URL (q->prompt.img_url[]). done(q) is called
 * once, from the loop (never from inside this call): with q->prep.status 0 when every image is in,
 * checked and the prompt's (prompt.img_blob), else with the status and message of the first that
 * failed, the others cancelled. PRISM_ENOMEM: nothing started, done never called. */
int  router_url_images_fetch(router_req_t *q, void (*done)(router_req_t *q));
/* Its downloads still under way are cancelled (no callback); safe at any time on the loop. */
void router_url_images_cancel(router_req_t *q);
/* Image room came back (an admitted request ended): downloads paused for it go on. */
void router_url_images_resume(router_t *r);

/* output.c */
/* The response metadata, the choices and, when streaming with tools, their parsers: PRISM_ENOMEM. */
int  router_out_init(router_req_t *q);
/* Adds the tokens of t to choice i (detokenized, logprobs, stop strings): the choice's finish reason
 * ("stop", "length") when they end it, NULL while it goes on. */
const char *router_out_tokens(router_req_t *q, int i, const Prism__Tokens *t);
/* Streams what choice i may show so far (text that may start a stop string is held back). */
void router_out_progress(router_req_t *q, int i);
/* Choice i ended (its finish is set): its last chunk, when streaming. */
void router_out_choice_end(router_req_t *q, int i);
/* Every choice ended: the last bytes (usage, [DONE]) or the whole response. */
void router_out_complete(router_req_t *q, const prism_oai_usage_t *u, const char *timing);
/* The request failed: an SSE error event and [DONE] once streaming, else the error answer. */
void router_out_error(router_req_t *q, int status, const char *message);
/* "x-prism-timing" response header and log line: where the time of this request went. */
void router_out_timing(const router_req_t *q, double now, char *out, size_t n);
/* The request's stages in seconds (router_time_stage_t), finished at now: each >= 0, their sum
 * now - time.start (to rounding). */
void router_out_stages(const router_req_t *q, double now, double s[ROUTER_TS_COUNT]);

#endif
