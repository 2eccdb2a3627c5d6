/* encoder_worker: image decode (libjpeg-turbo, libspng), preprocessing (CLIP, or Llama-4's tiles),
 * vision tower + projector, embedding cache. Embeddings go straight to the prefill worker the
 * router chose, as raw frames (one per tile).
 *
 * Jobs arrive from the router (through the worker's I/O thread, which keeps heartbeating while
 * this thread computes) with the image file as a raw frame, which is kept (zmq_msg_move, no copy)
 * in a job queue bounded in images and in file bytes (the router sends no more than
 * --max-queued-image-bytes of files: Register.max_queued_bytes). Each loop iteration forms a batch
 * (requests' images before early jobs, a request's lower `priority` first, small images before large
 * ones, oldest first within a class, one class per batch: next_queued) of as many images as the pixel buffer has tiles for (a LLaVA
 * image is one tile; a Llama-4 image its canvas's tiles plus the global one, counted from the header
 * before decoding) and at most as many as finish within --max-batch-seconds at the measured cost per
 * image; streams them through the decoders into the preprocessor, --image-threads images at once
 * (decode_pool.h; prep.c: rows are resampled as they are decoded, straight into each image's own
 * tiles; no decoded image is ever held), runs the vision tower over the
 * tiles in micro-batches of at most --max-batch-images (the activation arena holds that many),
 * then pushes the results. With --overlap-decode the next batch is formed as the tower starts and
 * its images decode on the pool into a second pixel buffer meanwhile (start_next, take_next). A 17-tile 4096x4096 Llama-4 image with --max-batch-images 4 is five
 * micro-batches: memory is set by the flags, never by the images or their number. An abort that
 * arrives during the batch drops its image's tiles between two layers (and skips those of later
 * micro-batches); the others go on. When a prefill worker's receive pool is full the push waits:
 * the encoder takes no new batch (backpressure), so nothing grows. An image's pieces go to a prefill
 * back to back, never another image's between them (flush_batch: the prefill's pool credits an image
 * arriving in pieces with its next piece only).
 *
 * Cache entries a batch answers from are pinned until their jobs are sent (or aborted), so a miss
 * later in the same batch (or while the batch waits for prefill) cannot evict and overwrite them.
 *
 * An Encode without a prefill endpoint is an early job (router/early_encode.c: the image of a request
 * whose body is still arriving): encoded into the cache, answered to the router, sent nowhere, and
 * only when no request's image waits (a body that may never become a request never delays one). The
 * request's own Encode names it (early_id): while the job is still here the request takes it over
 * (adopt_early), else its image is a cache hit. A job whose image is already in the batch being
 * formed waits for the next batch (a cache hit then) rather than being encoded twice. */
#include "core/core.h"
#include "core/cli.h"
#include "net/net.h"
#include "worker/worker.h"
#include "worker/start.h"
#include "backend/backend.h"
#include "model/model.h"
#include "image/image.h"
#include "embed_cache.h"
#include "prep.h"
#include "decode_pool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef enum { JOB_FREE, JOB_QUEUED, JOB_ENCODED, JOB_SEND } job_state_t;

#define MAX_TILES (PRISM_LLAMA4_MAX_PATCHES + 1)   /* of one image */
/* parts of one image: its tiles, or (native resolution) its pieces of PRISM_VISION_PIECE_ROWS rows */
#define MAX_PARTS PRISM_MAX(MAX_TILES, 256)

typedef struct {
    job_state_t state;
    uint64_t rid, rid_hi;     /* the request's 128-bit id (an early job's own) */
    prism_trace_id_t trace;   /* the request's (passed on to the prefill with the embeddings) */
    char router_id[128];
    uint32_t image_index;
    uint64_t hash;
    int64_t min_pixels, max_pixels;   /* Qwen-VL: the request's mm_processor_kwargs (max_pixels 0: none) */
    int32_t priority;         /* Encode.priority (a request's; lower first) */
    char prefill_endpoint[256];
    zmq_msg_t image;          /* file bytes, owned while queued */
    bool has_image;
    int n_tiles;              /* result: tiles of image_seq_length rows each (native: pieces) ... */
    const float *parts[MAX_PARTS];   /* ... in the cache entry (pinned) or the batch output */
    int tile0;                /* first tile in the batch's pixel buffer */
    /* native resolution: the image's grid and rows, where they are in the batch, and how many of its
     * pieces went out already (the rest wait for the prefill's room) */
    prism_vgrid_t grid;
    int n_rows, patch0, row0, sent;
    char error[256];
    Prism__ErrorKind error_kind;  /* with error: CLIENT (the default: the image) unless set */
    bool cache_hit;
    bool after_early;         /* its Encode named an early job already done: that one counted the lookup */
    bool waited;              /* its push found the prefill's pool full once (counted in sends_waited) */
    int cache_slot;           /* pinned cache entry while the job is in flight; -1 none */
    float decode_ms, vit_ms;
    float queue_ms;           /* its arrival to its batch (EncodeDone.queue_ms) */
    double t_arrive;
    /* its file's width * height from the header (0: no header): which class it waits in */
    uint64_t file_pixels;
    int passed;               /* batches formed while it waited behind younger jobs (aging) */
    int dec_rc;               /* the decode's result (a pool task's) */
    size_t dec_at;            /* where its pixels go: floats into the pixel buffer */
} job_t;

/* A batch: the jobs it took and the images it decodes into a pixel buffer of its own. With
 * --overlap-decode there are two: the next batch's images decode on the pool while the tower reads
 * this one's pixels (the tower "batches what is ready", issue 33). */
typedef struct {
    int batch[256];           /* job indices of the batch (-1: sent or dropped) */
    int n_batch;
    int pix_job[256];         /* job index of each image in the vision batch (-1: cancelled) */
    int n_pix;                /* images in the vision batch */
    int n_tiles;              /* tiles of its images in the pixel buffer */
    int target;               /* images the time bound allowed when it was formed (batch_target) */
    float *pixels;            /* [cap_tiles][3][S][S] (native resolution: [cap_patches][patch_floats]) */
    int *tile_job;            /* [cap_tiles] job index of each tile in the pixel buffer (-1: cancelled) */
} enc_batch_t;

typedef struct {
    struct {                  /* the tier's flags */
        int64_t max_batch, max_queue, max_queue_bytes, cache_bytes, max_pixels, max_decode_pixels, decode_threads;
        int64_t image_threads;
        int64_t max_image_tokens, piece_rows;
        const char *dct, *overlap;
        double max_batch_s;
    } f;
    prism_worker_t w;
    prism_model_config_t cfg;
    prism_backend_t *be;
    prism_vision_t *vis;
    enc_prep_t prep;          /* the preprocessor as planned: header checks; the pool's members are copies */
    enc_pool_t pool;          /* image decoders, several images of a batch at once */
    int n_image_threads;      /* the pool's members (--image-threads, lowered to what --mem-budget holds) */
    int64_t w_threads;        /* --threads: the vision tower's (start-up's line says who got what) */
    prism_embed_cache_t cache;
    int max_batch, max_queue;
    uint64_t max_queue_bytes; /* image file bytes one router may have queued here (Register.max_queued_bytes) */
    int cap_tiles;            /* tiles of the pixel and output buffers: max(--max-batch-images, tiles of the largest image) */
    job_t *jobs;              /* [max_queue] */
    enc_batch_t cur;          /* the batch in flight: its decodes, the tower, its sends */
    enc_batch_t nxt;          /* --overlap-decode: the next one, decoding while the tower reads cur */
    enc_batch_t *dec;         /* the batch whose images the pool decodes (decode_task's) */
    bool overlap;             /* --overlap-decode in effect (a tile model; the plan has the second buffer) */
    int n_live;               /* images of cur's vision batch not cancelled */
    int tile_base;            /* first tile of the micro-batch in the vision tower */
    double max_batch_s;       /* time bound of one batch (0 = memory bound only) */
    double cost_s;            /* measured seconds per image (decode + ViT), 0 until measured */
    prism_model_hook_t hook;
    float *out;               /* [cap_tiles][image_seq_length][hidden] */
    size_t tile_px;           /* floats of one tile's pixels */
    size_t emb_floats;        /* floats of one tile's embeddings (native resolution: of one piece); a cache unit */
    uint64_t encoded, failed, cancelled;
    /* native resolution (Qwen-VL): images of any size; batches bounded in patches, one forward
     * each; outputs in pieces of piece_rows rows (a cache unit, an Embeddings message) */
    bool native;
    prism_vision_native_t *nvis;
    int max_tokens;           /* --max-image-tokens: the largest image, in LM tokens */
    int cap_patches;          /* patches of the pixel buffer and of the tower's arena */
    size_t patch_floats;      /* floats of one patch row (one frame) */
    size_t row_floats;        /* floats of one output row */
    int piece_rows;           /* rows per Embeddings message (and per cache unit) */
    prism_vgrid_t vgrid[256]; /* the vision batch's grids, in pix_job order */
    uint64_t sends_waited;    /* jobs whose embeddings waited for a prefill's pool (heartbeats) */
    bool test_hold_ready;     /* test hook PRISM_TEST_HOLD_READY: see flush_batch */
    double test_hold_mixed_s; /* test hook PRISM_TEST_HOLD_MIXED_MICRO_BATCH_S: see hook_layer */
    int tile_n;               /* tiles of the micro-batch in the tower (from tile_base) */
} encoder_t;

static void publish_load(encoder_t *e)
{
    int queued = 0, running = 0;
    for (int i = 0; i < e->max_queue; i++) queued += e->jobs[i].state != JOB_FREE;
    for (int i = 0; i < e->cur.n_batch; i++) running += e->cur.batch[i] >= 0;   /* -1: sent or dropped already */
    for (int i = 0; i < e->nxt.n_batch; i++) running += e->nxt.batch[i] >= 0;
    prism_worker_load_t l = {
        .running = (uint32_t)running, .waiting = (uint32_t)queued, .pool_free = (uint32_t)(e->max_queue - queued),
        .cache_hits = e->cache.hits, .cache_misses = e->cache.misses, .sends_waited = e->sends_waited,
        .image_decodes_peak = (uint32_t)atomic_load(&e->pool.peak),
    };
    prism_worker_set_load(&e->w, &l);
}

/* The file is no longer needed once the job has left the queue (decoded, answered from the cache
 * or refused): free it then, so the queue's bytes are only those of queued jobs, which an abort
 * frees at once, and the router's count of them is never below ours. */
static void drop_image(job_t *j)
{
    if (j->has_image) zmq_msg_close(&j->image);
    j->has_image = false;
}

/* The job's slot, image and pinned cache entry go back. */
static void release_job(encoder_t *e, job_t *j)
{
    drop_image(j);
    if (j->cache_slot >= 0) prism_embed_cache_unpin(&e->cache, j->cache_slot);
    j->cache_slot = -1;
    j->n_tiles = 0;
    j->state = JOB_FREE;
}

/* Takes a job out of the batch in flight (it was aborted). */
static void unbatch(encoder_t *e, const job_t *j)
{
    int idx = (int)(j - e->jobs);
    for (int i = 0; i < e->cur.n_batch; i++)
        if (e->cur.batch[i] == idx) e->cur.batch[i] = -1;
    for (int i = 0; i < e->nxt.n_batch; i++)   /* a cache hit or refusal of the next batch */
        if (e->nxt.batch[i] == idx) e->nxt.batch[i] = -1;
}

static void finish_job(encoder_t *e, job_t *j)
{
    Prism__EncodeDone d = PRISM__ENCODE_DONE__INIT;
    d.image_index = j->image_index;
    d.cache_hit = j->cache_hit;
    d.decode_ms = j->decode_ms;
    d.vit_ms = j->vit_ms;
    d.queue_ms = j->queue_ms;
    d.error = j->error;
    d.error_kind = !j->error[0] ? PRISM__ERROR_KIND__ERROR_NONE
                 : j->error_kind ? j->error_kind : PRISM__ERROR_KIND__ERROR_CLIENT;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_ENCODE_DONE;
    env.encode_done = &d;
    prism_worker_reply(&e->w, j->router_id, j->rid, j->rid_hi, &env);
    release_job(e, j);
}

/* Native resolution: the job's pieces from the first not sent yet, one message each (env, its
 * Embeddings filled in per piece), until the prefill's socket is full (PRISM_EAGAIN: the rest go on a
 * later call, j->sent remembers). Each message copies one piece into ZeroMQ: never a second copy of
 * the whole image. */
static int push_pieces(encoder_t *e, job_t *j, void *s, Prism__Envelope *env)
{
    Prism__Embeddings *em = env->embeddings;
    em->hidden = (uint32_t)e->row_floats;   /* Qwen3-VL: the embedding and its DeepStack levels */
    if (j->error[0]) return prism_msg_send(s, NULL, 0, env, NULL, 0, ZMQ_DONTWAIT);
    for (; j->sent < j->n_tiles; j->sent++) {
        int r0 = j->sent * e->piece_rows, rows = PRISM_MIN(e->piece_rows, j->n_rows - r0);
        em->n_tokens = (uint32_t)rows;
        em->row_offset = (uint32_t)r0;
        em->total_tokens = (uint32_t)j->n_rows;
        prism_frame_t f = {j->parts[j->sent], (size_t)rows * e->row_floats * sizeof(float)};
        int rc = prism_msg_send(s, NULL, 0, env, &f, 1, ZMQ_DONTWAIT);
        if (rc != PRISM_OK) return rc;
    }
    return PRISM_OK;
}

/* Pushes one job's embeddings (or its error) to the prefill worker: its tiles in one message, or
 * (native resolution) its pieces. PRISM_EAGAIN: pool full. */
static int push_job(encoder_t *e, job_t *j)
{
    void *s = prism_worker_peer_sock(&e->w, j->prefill_endpoint);
    if (!s) {
        snprintf(j->error, sizeof(j->error), "cannot reach prefill worker");
        j->error_kind = PRISM__ERROR_KIND__ERROR_UNAVAILABLE;
        return PRISM_EIO;
    }
    Prism__Embeddings em = PRISM__EMBEDDINGS__INIT;
    em.image_index = j->image_index;
    em.error = j->error;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_EMBEDDINGS;
    env.request_id = j->rid;
    env.request_id_hi = j->rid_hi;
    env.trace_id_hi = j->trace.hi;
    env.trace_id_lo = j->trace.lo;
    env.router_id = j->router_id;
    env.embeddings = &em;
    if (e->native) return push_pieces(e, j, s, &env);
    em.n_tokens = (uint32_t)(j->n_tiles * e->cfg.image_seq_length);
    em.hidden = (uint32_t)e->cfg.hidden;
    prism_frame_t f[MAX_TILES];
    int n = j->error[0] ? 0 : j->n_tiles;
    for (int i = 0; i < n; i++) f[i] = (prism_frame_t){j->parts[i], e->emb_floats * sizeof(float)};
    return prism_msg_send(s, NULL, 0, &env, f, n, ZMQ_DONTWAIT);
}

/* Image file bytes queued here by one router: what its byte bound is checked against. */
static uint64_t queued_bytes_of(const encoder_t *e, const char *router)
{
    uint64_t n = 0;
    for (int i = 0; i < e->max_queue; i++) {
        const job_t *j = &e->jobs[i];
        if (j->state == JOB_QUEUED && j->has_image && !strcmp(j->router_id, router))
            n += zmq_msg_size((zmq_msg_t *)&j->image);
    }
    return n;
}

/* A request's Encode naming an early job of the same router and image that is still here (queued, or
 * in the batch being encoded): the job becomes the request's (its id, image index and prefill
 * endpoint; the frame sent with it is not needed). False when there is no such job (it is done: the
 * request's image is then encoded from the frame, usually a cache hit). */
static bool adopt_early(encoder_t *e, const Prism__Envelope *env, const Prism__Encode *en, const char *router)
{
    if (!en->early_id || !en->prefill_endpoint || !*en->prefill_endpoint) return false;
    for (int i = 0; i < e->max_queue; i++) {
        job_t *j = &e->jobs[i];
        if (j->state == JOB_FREE || j->rid != en->early_id || strcmp(j->router_id, router) || j->prefill_endpoint[0] ||
            j->hash != en->content_hash)
            continue;
        j->rid = env->request_id;
        j->rid_hi = env->request_id_hi;
        j->trace = (prism_trace_id_t){env->trace_id_hi, env->trace_id_lo};
        j->image_index = en->image_index;
        j->priority = en->priority;
        snprintf(j->prefill_endpoint, sizeof(j->prefill_endpoint), "%s", en->prefill_endpoint);
        PRISM_DEBUG("request %llu image %u: took over early job %016llx", (unsigned long long)j->rid, j->image_index,
                    (unsigned long long)en->early_id);
        return true;
    }
    return false;
}

static void on_encode(encoder_t *e, prism_msg_t *m)
{
    const Prism__Envelope *env = m->env;
    const Prism__Encode *en = env->encode;
    const char *router = env->router_id ? env->router_id : "";
    if (en && m->n_frames == 1 && adopt_early(e, env, en, router)) return;
    job_t *j = NULL;
    for (int i = 0; i < e->max_queue; i++)
        if (e->jobs[i].state == JOB_FREE) { j = &e->jobs[i]; break; }
    /* No prefill endpoint: an early job (the router's early_encode.c), for the cache only. */
    bool valid = en && m->n_frames == 1 && en->prefill_endpoint && (*en->prefill_endpoint || e->cache.n_units > 0);
    uint64_t held = valid && j ? queued_bytes_of(e, router) : 0;
    /* A router keeps within the bound (one image alone may exceed it); one that does not is refused
     * rather than allowed to grow this process past its plan. */
    bool over = held && held + zmq_msg_size(&m->frames[0]) > e->max_queue_bytes;
    if (!j || !valid || over) {
        job_t tmp = {.cache_slot = -1};
        tmp.rid = env->request_id;
        tmp.rid_hi = env->request_id_hi;
        tmp.image_index = en ? en->image_index : 0;
        snprintf(tmp.router_id, sizeof(tmp.router_id), "%s", router);
        snprintf(tmp.error, sizeof(tmp.error), "%s",
                 !valid ? "malformed encode request" : over ? "encoder queue is full (image bytes)" : "encoder queue is full");
        tmp.error_kind = !valid ? PRISM__ERROR_KIND__ERROR_INTERNAL : PRISM__ERROR_KIND__ERROR_OVERLOAD;
        PRISM_WARN("request %llu: %s", (unsigned long long)env->request_id, tmp.error);
        finish_job(e, &tmp);
        return;
    }
    memset(j, 0, sizeof(*j));
    j->cache_slot = -1;
    j->state = JOB_QUEUED;
    j->rid = env->request_id;
    j->rid_hi = env->request_id_hi;
    j->trace = (prism_trace_id_t){env->trace_id_hi, env->trace_id_lo};
    snprintf(j->router_id, sizeof(j->router_id), "%s", router);
    j->image_index = en->image_index;
    j->hash = en->content_hash;
    j->min_pixels = en->min_pixels;
    j->max_pixels = en->max_pixels;
    j->priority = en->priority;
    j->after_early = en->early_id != 0;
    snprintf(j->prefill_endpoint, sizeof(j->prefill_endpoint), "%s", en->prefill_endpoint);
    zmq_msg_init(&j->image);
    zmq_msg_move(&j->image, &m->frames[0]);
    j->has_image = true;
    j->t_arrive = prism_now_s();
    prism_image_info_t info;   /* a header the decode refuses later: ranked small, it fails fast */
    if (prism_image_probe(zmq_msg_data(&j->image), zmq_msg_size(&j->image), &info) == PRISM_OK)
        j->file_pixels = (uint64_t)info.width * (uint64_t)info.height;
    PRISM_DEBUG("request %llu image %u: queued (%zu bytes)%s", (unsigned long long)j->rid, j->image_index,
                zmq_msg_size(&j->image), j->prefill_endpoint[0] ? "" : ", an early job");
}

/* Frees a job the router no longer wants: queued, or encoded and waiting for its prefill to take
 * the embeddings (a prefill that died under backpressure never will: without this the batch in
 * flight never finishes and the encoder takes no more work). A job in the vision batch left it
 * between two layers already, through the hook. */
static void on_abort(encoder_t *e, uint64_t rid, const char *router)
{
    for (int i = 0; i < e->max_queue; i++) {
        job_t *j = &e->jobs[i];
        if ((j->state == JOB_QUEUED || j->state == JOB_SEND) && j->rid == rid && !strcmp(j->router_id, router)) {
            unbatch(e, j);
            release_job(e, j);
        }
    }
}

static void on_msg(prism_worker_t *w, prism_msg_t *m, int source, void *ud)
{
    encoder_t *e = ud;
    switch (m->env->type) {
    case PRISM__MSG_TYPE__MSG_ENCODE:
        on_encode(e, m);
        break;
    case PRISM__MSG_TYPE__MSG_ABORT:
        on_abort(e, m->env->request_id, m->env->router_id ? m->env->router_id : "");
        break;
    default:
        PRISM_WARN("unexpected message type %d", m->env->type);
    }
}

/* Pushes finished jobs of the batch in flight; returns true when the batch is fully sent. Before
 * the batch's ViT (ready_only) it sends those already done: cache hits and refusals, so a request
 * whose early job was just encoded does not wait for this batch's images; they leave the batch. */
static bool flush_batch(encoder_t *e, bool ready_only)
{
    /* Test hook: nothing leaves before the batch's vision tower has run, as when the prefill's pool
     * is full at that moment; a cache hit then stays pinned while the misses of its batch are put
     * (test_encoder.py::test_cache_hit_keeps_its_own_embeddings). */
    if (ready_only && e->test_hold_ready) return false;
    /* A prefill takes the pieces of an image from this encoder back to back: its pool credits an
     * image arriving in pieces with one more message only when it is full, and that message must be
     * the image's next piece (prefill_worker: emb_credit), not another image's first. So a job whose
     * pieces are partly sent goes first (pass 0), and a prefill found full gets nothing more from
     * this pass (full[]): no other job starts sending to it between two pieces of one image. */
    const char *full[PRISM_ARRAY_LEN(e->cur.batch)];
    int left = 0, n_full = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < e->cur.n_batch; i++) {
            if (e->cur.batch[i] < 0) continue;
            job_t *j = &e->jobs[e->cur.batch[i]];
            if (j->state != JOB_SEND || (pass == 0) != (j->sent > 0)) continue;
            bool wait = false;
            for (int k = 0; k < n_full && j->prefill_endpoint[0] && !wait; k++) wait = !strcmp(full[k], j->prefill_endpoint);
            int rc = wait ? PRISM_EAGAIN : j->prefill_endpoint[0] ? push_job(e, j) : PRISM_OK;   /* an early job: cached, done */
            if (rc == PRISM_EAGAIN) {   /* the prefill's pool is full: this batch waits (backpressure) */
                if (!wait) full[n_full++] = j->prefill_endpoint;
                if (!j->waited) e->sends_waited++;
                j->waited = true;
                left++;
                continue;
            }
            if (rc != PRISM_OK && !j->error[0]) {
                snprintf(j->error, sizeof(j->error), "embedding transfer failed");
                j->error_kind = PRISM__ERROR_KIND__ERROR_UNAVAILABLE;
            }
            if (j->error[0]) e->failed++;
            else e->encoded++;
            finish_job(e, j);
            if (ready_only) e->cur.batch[i] = -1;
        }
    }
    if (!left && !ready_only) e->cur.n_batch = 0;
    return left == 0;
}

/* ---- between-layer hook of the vision tower ---- */

/* Whether the micro-batch in the tower holds tiles of more than one image. */
static bool mixed_micro_batch(const encoder_t *e)
{
    int first = -1;
    for (int k = 0; !e->native && k < e->tile_n; k++) {
        int ji = e->cur.tile_job[e->tile_base + k];
        if (ji < 0) continue;
        if (first >= 0 && ji != first) return true;
        first = ji;
    }
    return false;
}

/* Test hook PRISM_TEST_HOLD_MIXED_MICRO_BATCH_S=S: after the first layer of a micro-batch that
 * mixes images, the tower waits (at most S seconds) for an abort to arrive, so that a test can
 * abort one image inside that micro-batch whatever the machine's speed. Inert unless set. */
static void test_hold_for_abort(encoder_t *e)
{
    PRISM_WARN("test hook PRISM_TEST_HOLD_MIXED_MICRO_BATCH_S: the tower holds after layer 1 of a mixed micro-batch "
               "until an abort arrives (at most %.1fs)", e->test_hold_mixed_s);
    double until = prism_now_s() + e->test_hold_mixed_s;
    struct timespec ts = {0, 5 * 1000 * 1000};
    while (atomic_load(&e->w.abort_seq) == e->w.aborts_seen && !prism_worker_should_stop() && prism_now_s() < until)
        nanosleep(&ts, NULL);
}

static bool hook_layer(void *ud, int done, int total)
{
    encoder_t *e = ud;
    if (e->test_hold_mixed_s > 0 && done == 1 && mixed_micro_batch(e)) test_hold_for_abort(e);
    return prism_worker_layer_done(&e->w, done, total);
}

/* Image i of the vision batch leaves it if its request was aborted: its tiles are dropped from the
 * micro-batch in the tower (the hook's answer) and skipped in later ones, its job freed. */
static bool cancel_if_aborted(encoder_t *e, int i)
{
    job_t *j = &e->jobs[e->cur.pix_job[i]];
    double waited = 0;
    if (!prism_worker_aborted(&e->w, j->rid, j->router_id, &waited)) return false;
    e->n_live--;
    prism_log_ctx_t lc = {j->rid, j->trace};   /* a batch serves many requests: this line is about its one */
    if (!prism_worker_should_stop())
        PRISM_LOGC(INFO, &lc, "request %llu image %u: cancelled %.3fs after its abort arrived, after layer %d of %d "
                   "(%.3fs per layer): dropped from the batch, %d image(s) go on",
                   (unsigned long long)j->rid, j->image_index, waited, e->w.layer.done, e->w.layer.total, e->w.layer.last_s,
                   e->n_live);
    for (int k = 0; !e->native && k < j->n_tiles; k++) e->cur.tile_job[j->tile0 + k] = -1;
    e->cur.pix_job[i] = -1;
    unbatch(e, j);
    release_job(e, j);
    e->cancelled++;
    publish_load(e);   /* the slot is free at the next heartbeat */
    return true;
}

/* Items of the hook are the tiles of the micro-batch in the tower (native resolution: the images of
 * the batch, in pix_job order). */
static bool hook_cancelled(void *ud, int item)
{
    encoder_t *e = ud;
    if (e->native) return item < e->cur.n_pix && e->cur.pix_job[item] >= 0 ? cancel_if_aborted(e, item) : true;
    int ji = e->cur.tile_job[e->tile_base + item];
    if (ji < 0) return true;   /* its image was cancelled at an earlier tile */
    for (int i = 0; i < e->cur.n_pix; i++)
        if (e->cur.pix_job[i] == ji) return cancel_if_aborted(e, i);
    PRISM_ASSERT(!"tile of an image outside the vision batch");
    return false;
}

/* Between micro-batches: images with tiles still to encode whose abort came meanwhile (the hook
 * asks only about the tiles in the tower). */
static void drop_aborted(encoder_t *e, int next_tile)
{
    for (int i = 0; i < e->cur.n_pix; i++) {
        if (e->cur.pix_job[i] < 0) continue;
        const job_t *j = &e->jobs[e->cur.pix_job[i]];
        if (j->tile0 + j->n_tiles > next_tile) cancel_if_aborted(e, i);
    }
}

/* Images in the next batch: as many as the pixel buffer has tiles for and, once the cost of an
 * image is measured, as many as finish within --max-batch-seconds (at least one). */
static int batch_target(const encoder_t *e)
{
    if (e->max_batch_s <= 0) return e->cap_tiles;
    if (e->cost_s <= 0) return 1;
    double n = e->max_batch_s / e->cost_s;
    return n >= e->cap_tiles ? e->cap_tiles : PRISM_MAX(1, (int)n);
}

/* Whether an image with this content hash is in a vision batch being formed or encoded (an early job
 * and its request's own job may both be queued). */
static bool being_encoded(const encoder_t *e, uint64_t hash)
{
    for (int i = 0; hash && i < e->cur.n_pix; i++)
        if (e->cur.pix_job[i] >= 0 && e->jobs[e->cur.pix_job[i]].hash == hash) return true;
    for (int i = 0; hash && i < e->nxt.n_pix; i++)   /* the next batch's, formed during cur's tower */
        if (e->nxt.pix_job[i] >= 0 && e->jobs[e->nxt.pix_job[i]].hash == hash) return true;
    return false;
}

/* ---- forming and finishing a batch (tiles or native resolution) ---- */

/* Decode cost grows with the file's pixels: a 512x512 JPEG decodes in milliseconds, a 4096x4096 one
 * in about a second on one core. Images up to this size are small: they go before large ones, and a
 * batch holds one class only, so a small image never waits for a queue of large decodes, nor for
 * the large ones of its own batch (issue 33). */
#define ENC_SMALL_PIXELS ((uint64_t)1024 * 1024)
/* A job left queued while this many batches took younger jobs ranks with the small ones (then
 * oldest first): large images are not overtaken indefinitely by a stream of small ones. */
#define ENC_MAX_PASSED 4

static bool small_image(const job_t *j) { return j->file_pixels <= ENC_SMALL_PIXELS; }

/* Lower goes first: a request's image before any early job (which only fills the cache, for a
 * body that may never become a request), then small (or long passed over) before large. */
static int job_rank(const job_t *j)
{
    return (j->prefill_endpoint[0] ? 0 : 2) + (small_image(j) || j->passed >= ENC_MAX_PASSED ? 0 : 1);
}

/* Whether job a goes before job b: requests' images before early jobs, then the lower priority value
 * (the request's `priority`, as the router's queue orders it; early jobs have none), then the lower
 * rank, then the older. Equal priorities keep the order of rank and age. */
static bool goes_before(const job_t *a, const job_t *b)
{
    bool ea = !a->prefill_endpoint[0], eb = !b->prefill_endpoint[0];
    if (ea != eb) return eb;
    if (!ea && a->priority != b->priority) return a->priority < b->priority;
    int ra = job_rank(a), rb = job_rank(b);
    return ra < rb || (ra == rb && a->t_arrive < b->t_arrive);
}

/* The job a batch takes next: the first by goes_before. */
static job_t *next_queued(encoder_t *e)
{
    job_t *best = NULL;
    for (int i = 0; i < e->max_queue; i++) {
        job_t *j = &e->jobs[i];
        if (j->state == JOB_QUEUED && (!best || goes_before(j, best))) best = j;
    }
    return best;
}

/* After a batch was formed: each request's job still queued that a younger one overtook was passed
 * over once more (newest: the youngest arrival the batch took). */
static void age_queued(encoder_t *e, double newest)
{
    for (int i = 0; i < e->max_queue; i++) {
        job_t *j = &e->jobs[i];
        if (j->state == JOB_QUEUED && j->prefill_endpoint[0] && j->t_arrive < newest) j->passed++;
    }
}

/* A job whose image's embeddings are in the cache takes them; false on a miss. The entry stays
 * pinned until the job is sent (finish_job): a miss later in this batch must not evict and overwrite
 * it. */
static bool take_cached(encoder_t *e, job_t *j)
{
    int hit = prism_embed_cache_get_pinned(&e->cache, j->hash);
    if (hit < 0) return false;
    /* finding its own early job's result is no repeat of the image: the early job counted it */
    if (j->after_early) e->cache.hits--;
    j->cache_slot = hit;
    j->n_tiles = prism_embed_cache_units(&e->cache, hit, j->parts, MAX_PARTS);
    j->cache_hit = true;
    drop_image(j);
    return true;
}

/* A pool task: image `task` of the batch e->dec decoded and preprocessed into its place in that
 * batch's pixel buffer (the decode timed). Touches only its job's bytes, pixels, error and result:
 * with --overlap-decode the loop runs meanwhile, and touches none of these of a job it has not
 * collected (its state is JOB_ENCODED: on_abort leaves it to drop_aborted). */
static int decode_task(void *ctx, int task, enc_prep_t *prep)
{
    encoder_t *e = ctx;
    const enc_batch_t *b = e->dec;
    job_t *j = &e->jobs[b->pix_job[task]];
    double t0 = prism_now_s();
    j->dec_rc = enc_prep_run(prep, zmq_msg_data(&j->image), zmq_msg_size(&j->image), j->min_pixels, j->max_pixels,
                             b->pixels + j->dec_at, j->error, sizeof(j->error));
    j->decode_ms = (float)((prism_now_s() - t0) * 1e3);
    return j->dec_rc;
}

/* The vision batch's images decoded on the pool, several at once; their files are not needed after.
 * One that fails leaves the vision batch (its error travels to prefill and router; a tile image's
 * tiles become holes the micro-batches skip). decode_batch returns the decode phase's wall seconds. */
static void collect_decodes(encoder_t *e)
{
    int kept = 0;
    for (int i = 0; i < e->cur.n_pix; i++) {
        int idx = e->cur.pix_job[i];
        job_t *j = &e->jobs[idx];
        drop_image(j);
        if (j->dec_rc != PRISM_OK) {
            for (int k = 0; !e->native && k < j->n_tiles; k++) e->cur.tile_job[j->tile0 + k] = -1;
            j->n_tiles = 0;
            j->state = JOB_SEND;
            continue;
        }
        e->vgrid[kept] = e->vgrid[i];
        e->cur.pix_job[kept++] = idx;
    }
    e->cur.n_pix = kept;
}

static double decode_batch(encoder_t *e)
{
    double t0 = prism_now_s();
    e->dec = &e->cur;
    enc_pool_run(&e->pool, e->cur.n_pix, decode_task, e);
    double wall = prism_now_s() - t0;
    collect_decodes(e);
    return wall;
}

/* --overlap-decode: the next batch formed from the queue now, and its images' decodes started on
 * the pool into its own pixel buffer, while the loop runs the tower over cur. */
static void form_batch(encoder_t *e, enc_batch_t *b);
static void start_next(encoder_t *e)
{
    if (!e->overlap || e->nxt.n_batch) return;
    form_batch(e, &e->nxt);
    if (!e->nxt.n_pix) return;
    e->dec = &e->nxt;
    enc_pool_start(&e->pool, e->nxt.n_pix, decode_task, e);
}

/* The next batch becomes the one in flight (cur was sent whole): its decodes waited for and
 * collected. Returns the seconds the loop waited for them (the decode time the tower did not hide). */
static double take_next(encoder_t *e)
{
    double t0 = prism_now_s();
    enc_pool_wait(&e->pool);
    double waited = prism_now_s() - t0;
    enc_batch_t done = e->cur;   /* its arrays and pixel buffer serve the batch after */
    e->cur = e->nxt;
    e->nxt = done;
    e->nxt.n_batch = e->nxt.n_pix = e->nxt.n_tiles = 0;
    collect_decodes(e);
    return waited;
}

/* The cost per image (decode + tower) a batch that ran whole measured, smoothed. */
static void measure_cost(encoder_t *e, double per)
{
    e->cost_s = e->cost_s > 0 ? 0.7 * e->cost_s + 0.3 * per : per;
}

/* An image of the batch after the tower (rc): ready to send, its parts (tiles or pieces of
 * emb_floats floats) read in place from emb and put in the cache, or its error. */
static void image_encoded(encoder_t *e, job_t *j, int rc, double vit_ms, const float *emb)
{
    j->state = JOB_SEND;
    j->vit_ms = (float)vit_ms;
    if (rc != PRISM_OK) {
        snprintf(j->error, sizeof(j->error), "vision encoder failed: %s", prism_strerror(rc));
        j->error_kind = PRISM__ERROR_KIND__ERROR_INTERNAL;
        return;
    }
    for (int k = 0; k < j->n_tiles; k++) j->parts[k] = emb + (size_t)k * e->emb_floats;
    prism_embed_cache_put(&e->cache, j->hash, emb, j->n_tiles);
}

/* Native resolution: images oldest first while their patches fit the pixel buffer (the tower's
 * arena), then one forward over all of them; each image's rows leave in pieces. An image beyond
 * --max-image-tokens was refused from its header. */
static void run_batch_native(encoder_t *e)
{
    if (e->cur.n_batch && !flush_batch(e, false)) return;  /* previous results still waiting for prefill */
    int target = batch_target(e);
    int n_patches = 0, n_classes = 0;
    bool small = false;
    double newest = 0;
    e->cur.n_pix = 0;
    for (int pass = 0; pass < e->max_queue && e->cur.n_batch < (int)PRISM_ARRAY_LEN(e->cur.batch) &&
                       e->cur.n_pix < (int)PRISM_ARRAY_LEN(e->cur.pix_job) && e->cur.n_pix < target;
         pass++) {
        job_t *best = next_queued(e);
        if (!best) break;
        if (being_encoded(e, best->hash)) break;
        if (n_classes++ && small_image(best) != small) break;   /* one class per batch */
        small = small_image(best);
        newest = PRISM_MAX(newest, best->t_arrive);
        best->queue_ms = (float)((prism_now_s() - best->t_arrive) * 1e3);
        const uint8_t *data = zmq_msg_data(&best->image);
        size_t len = zmq_msg_size(&best->image);
        int idx = (int)(best - e->jobs);
        prism_qwenvl_grid_t g;
        bool bad = enc_prep_grid(&e->prep, data, len, best->min_pixels, best->max_pixels, e->max_tokens, &g, best->error,
                                 sizeof(best->error)) != PRISM_OK;
        if (!bad && n_patches + g.n_patches > e->cap_patches) break;   /* next batch: nothing overtakes it */
        e->cur.batch[e->cur.n_batch++] = idx;
        best->state = JOB_SEND;
        if (bad) {
            drop_image(best);
            continue;
        }
        best->grid = (prism_vgrid_t){g.grid_h, g.grid_w};
        best->n_rows = g.n_tokens;
        best->sent = 0;
        if (take_cached(e, best)) continue;
        best->state = JOB_ENCODED;
        best->dec_at = (size_t)n_patches * e->patch_floats;
        best->n_tiles = (g.n_tokens + e->piece_rows - 1) / e->piece_rows;
        n_patches += g.n_patches;
        e->vgrid[e->cur.n_pix] = best->grid;
        e->cur.pix_job[e->cur.n_pix++] = idx;
    }
    age_queued(e, newest);
    double decode_s = e->cur.n_pix ? decode_batch(e) : 0;
    /* the images that decoded, packed (one that failed left a gap) and given their rows */
    n_patches = 0;
    int n_rows = 0;
    for (int i = 0; i < e->cur.n_pix; i++) {
        job_t *j = &e->jobs[e->cur.pix_job[i]];
        size_t at = (size_t)n_patches * e->patch_floats, np = (size_t)j->grid.h * j->grid.w;
        if (j->dec_at != at) memmove(e->cur.pixels + at, e->cur.pixels + j->dec_at, np * e->patch_floats * sizeof(float));
        j->patch0 = n_patches;
        j->row0 = n_rows;
        n_patches += (int)np;
        n_rows += j->n_rows;
    }
    if (e->cur.n_pix) {
        int n_pix = e->cur.n_pix;
        e->n_live = n_pix;
        flush_batch(e, true);
        publish_load(e);
        double t0 = prism_now_s();
        int rc = prism_vision_native_encode(e->nvis, e->cur.pixels, e->vgrid, n_pix, e->out);
        double vit_s = prism_now_s() - t0;
        prism_worker_progress(&e->w, (uint64_t)e->n_live);
        if (rc == PRISM_OK && e->n_live == n_pix) measure_cost(e, (decode_s + vit_s) / n_pix);
        for (int i = 0; i < n_pix; i++) {
            if (e->cur.pix_job[i] < 0) continue;   /* cancelled during the batch */
            job_t *j = &e->jobs[e->cur.pix_job[i]];
            /* its patches' share of the time; its pieces read in place (the last one's tail, the next
             * image's rows or the buffer's padding, is never sent, and the cache stores whole units) */
            image_encoded(e, j, rc, vit_s * 1e3 * j->grid.h * j->grid.w / PRISM_MAX(n_patches, 1),
                          e->out + (size_t)j->row0 * e->row_floats);
        }
    }
    if (e->cur.n_batch) flush_batch(e, false);
}

/* Forms a batch into b: in rank order (next_queued), one class of image size per batch, while the
 * pixel buffer has tiles for the next image (known from its header). Cache hits and refusals take no
 * tiles: they do not count against the pixel buffer or the time bound (the images after them still
 * fill the batch). Its images are decoded after, together, on the pool: their queue time ends here. */
static void form_batch(encoder_t *e, enc_batch_t *b)
{
    int target = b->target = batch_target(e);
    int n_classes = 0;
    bool small = false;
    double newest = 0;
    b->n_pix = b->n_tiles = 0;
    for (int pass = 0; pass < e->max_queue && b->n_batch < (int)PRISM_ARRAY_LEN(b->batch) &&
                       b->n_pix < PRISM_MIN(e->cap_tiles, (int)PRISM_ARRAY_LEN(b->pix_job)) && b->n_pix < target;
         pass++) {
        job_t *best = next_queued(e);
        if (!best) break;
        if (being_encoded(e, best->hash)) break;   /* next batch: then a cache hit, not encoded twice */
        if (n_classes++ && small_image(best) != small) break;   /* one class per batch */
        small = small_image(best);
        newest = PRISM_MAX(newest, best->t_arrive);
        best->queue_ms = (float)((prism_now_s() - best->t_arrive) * 1e3);
        const uint8_t *data = zmq_msg_data(&best->image);
        size_t len = zmq_msg_size(&best->image);
        int nt = 0, idx = (int)(best - e->jobs);
        bool bad = enc_prep_tiles(&e->prep, data, len, &nt, best->error, sizeof(best->error)) != PRISM_OK;
        if (!bad && b->n_tiles + nt > e->cap_tiles) break;   /* next batch: nothing overtakes it */
        b->batch[b->n_batch++] = idx;
        best->state = JOB_SEND;   /* an error travels to prefill and router */
        if (bad) {
            drop_image(best);
            continue;
        }
        if (take_cached(e, best)) continue;
        best->state = JOB_ENCODED;
        best->n_tiles = nt;
        best->tile0 = b->n_tiles;
        best->dec_at = (size_t)b->n_tiles * e->tile_px;
        for (int k = 0; k < nt; k++) b->tile_job[b->n_tiles + k] = idx;
        b->n_tiles += nt;
        b->pix_job[b->n_pix++] = idx;
    }
    age_queued(e, newest);
}

/* The tiles of cur's images in micro-batches of at most --max-batch-images (the arena's size; tiles
 * are independent sequences, so any split gives the same rows). Each micro-batch is a run of live
 * tiles: an image cancelled during an earlier one is skipped. */
static int run_tower(encoder_t *e)
{
    int rc = PRISM_OK, n_tiles = e->cur.n_tiles;
    for (int t = 0; rc == PRISM_OK && e->n_live > 0;) {
        drop_aborted(e, t);   /* aborts that came while decoding or during the last micro-batch */
        while (t < n_tiles && e->cur.tile_job[t] < 0) t++;
        if (t >= n_tiles) break;
        int k = 1;
        while (k < e->max_batch && t + k < n_tiles && e->cur.tile_job[t + k] >= 0) k++;
        e->tile_base = t;
        e->tile_n = k;
        rc = prism_vision_encode(e->vis, e->cur.pixels + (size_t)t * e->tile_px, k, e->out + (size_t)t * e->emb_floats);
        t += k;
    }
    return rc;
}

static void run_batch(encoder_t *e)
{
    if (e->native) {
        run_batch_native(e);
        return;
    }
    if (e->cur.n_batch && !flush_batch(e, false)) return;  /* previous results still waiting for prefill */
    double decode_s;
    if (e->nxt.n_batch) {   /* formed, and its images decoded, while the last batch was in the tower */
        decode_s = take_next(e);
    } else {
        form_batch(e, &e->cur);
        decode_s = e->cur.n_pix ? decode_batch(e) : 0;
    }
    int n_tiles = e->cur.n_tiles;
    if (e->cur.n_pix) {
        int n_pix = e->cur.n_pix;
        e->n_live = n_pix;
        PRISM_DEBUG("vision batch of %d image(s), %d tiles (time bound allows %d at %.3fs per image)", n_pix, n_tiles,
                    e->cur.target, e->cost_s);
        flush_batch(e, true);
        publish_load(e);
        start_next(e);   /* --overlap-decode: the next batch's images decode while the tower runs */
        double t0 = prism_now_s();
        int rc = run_tower(e);
        double vit_s = prism_now_s() - t0;
        prism_worker_progress(&e->w, (uint64_t)e->n_live);
        if (rc == PRISM_OK && e->n_live == n_pix) measure_cost(e, (decode_s + vit_s) / n_pix);
        for (int i = 0; i < n_pix; i++) {
            if (e->cur.pix_job[i] < 0) continue;   /* cancelled during the batch */
            job_t *j = &e->jobs[e->cur.pix_job[i]];
            /* its tiles' share of the time */
            image_encoded(e, j, rc, vit_s * 1e3 * j->n_tiles / n_tiles, e->out + (size_t)j->tile0 * e->emb_floats);
        }
    }
    if (e->cur.n_batch) flush_batch(e, false);
}

/* ---- start-up: the encoder tier's hooks (worker/start.h) ---- */

static int encoder_flags(void *ctx, prism_flag_t *t)
{
    encoder_t *e = ctx;
    e->f.max_batch = 8;
    e->f.max_queue = 64;
    e->f.max_queue_bytes = 64ll << 20;
    e->f.cache_bytes = 64ll << 20;
    e->f.max_pixels = 4096ll * 4096;
    e->f.max_decode_pixels = 4096ll * 4096;
    e->f.decode_threads = 2;
    e->f.image_threads = 0;
    e->f.dct = "auto";
    e->f.overlap = "on";
    e->f.max_batch_s = 2.0;
    e->f.piece_rows = PRISM_VISION_PIECE_ROWS;
    prism_flag_t f[] = {
        PRISM_FLAG_INT("max-batch-images", &e->f.max_batch, "Images per vision-tower micro-batch, the activation arena's "
                       "size (Llama-4: tiles; an image of more tiles runs in several micro-batches)"),
        PRISM_FLAG_DOUBLE("max-batch-seconds", &e->f.max_batch_s,
                          "Time bound of one batch: no more images than finish in it at the measured cost per image "
                          "(at least one; 0 = the pixel buffer's tiles alone)"),
        PRISM_FLAG_INT("max-queued-images", &e->f.max_queue, "Images waiting for the encoder at once"),
        PRISM_FLAG_BYTES("max-queued-image-bytes", &e->f.max_queue_bytes, "Image file bytes waiting for the encoder at "
                         "once (the router holds the rest; one image larger than this is still taken alone)"),
        PRISM_FLAG_BYTES("embedding-cache-bytes", &e->f.cache_bytes, "Embedding cache budget (0 disables)"),
        PRISM_FLAG_INT("max-image-pixels", &e->f.max_pixels, "Largest image accepted (width*height in the file)"),
        PRISM_FLAG_INT("max-decode-pixels", &e->f.max_decode_pixels,
                       "Whole-image decode memory, in pixels at 3 bytes each: progressive JPEG coefficients "
                       "(4:2:0; 4:4:4 needs twice as much) and interlaced PNG; baseline JPEG and other PNG "
                       "stream in rows and need none (0 = refuse what does not stream)"),
        PRISM_FLAG_STR("jpeg-dct-scaling", &e->f.dct, "always (decode JPEGs at a reduced size: faster, not identical to "
                       "transformers), auto or never (full size)"),
        PRISM_FLAG_INT("decode-threads", &e->f.decode_threads, "Threads per image thread: 1 decodes and preprocesses "
                       "on one thread; 2 preprocesses rows on a helper thread while the next ones decode (a lone "
                       "image, the usual batch when requests trickle in, then takes two cores)"),
        PRISM_FLAG_INT("image-threads", &e->f.image_threads, "Images of a batch decoded and preprocessed at once, "
                       "each with memory of its own (0 = --threads; lowered to what --mem-budget holds)"),
        PRISM_FLAG_STR("overlap-decode", &e->f.overlap, "Decode the next batch's images on the image threads while "
                       "the vision tower runs this one's, into a second pixel buffer: on (on a GPU the tower's work is "
                       "on the device; on the CPU it paid on 2 loaded cores, docs/PERFORMANCE.md) or off; not for "
                       "native-resolution models"),
        PRISM_FLAG_INT("max-image-tokens", &e->f.max_image_tokens, "Qwen-VL: the largest image, in LM tokens; the tower's "
                       "arena and the pixel and output buffers hold one such image (or several smaller ones), and a "
                       "larger image is refused with a 400 naming the max_pixels that would fit (0 = what the "
                       "processor's max_pixels allows, lowered to what --mem-budget leaves)"),
        PRISM_FLAG_INT("embed-piece-rows", &e->f.piece_rows, "Qwen-VL: rows of each Embeddings message (an image goes to "
                       "the prefill worker in pieces; at most the default, the largest frame a prefill takes)"),
    };
    memcpy(t, f, sizeof f);
    return (int)PRISM_ARRAY_LEN(f);
}

static int encoder_size(void *ctx, prism_worker_startup_t *s)
{
    encoder_t *e = ctx;
    char err[512] = "";
    if (!e->cfg.has_vision) {
        PRISM_ERROR("model at %s has no vision tower: an encoder worker has nothing to do", s->o.model_path);
        return 1;
    }
    if (e->f.max_batch < 1 || e->f.max_batch > 256 || e->f.max_queue < e->f.max_batch || e->f.max_queue > 65536 ||
        e->f.max_queue_bytes < 1 || e->f.max_pixels < 1 || e->f.max_decode_pixels < 0 || e->f.decode_threads < 1 ||
        e->f.decode_threads > 2 || e->f.image_threads < 0 || e->f.image_threads > ENC_POOL_MAX ||
        !(e->f.max_batch_s >= 0 && e->f.max_batch_s <= 3600) || e->f.max_image_tokens < 0 ||
        e->f.max_image_tokens > MAX_PARTS * PRISM_VISION_PIECE_ROWS || e->f.piece_rows < 1 ||
        e->f.piece_rows > PRISM_VISION_PIECE_ROWS) {
        PRISM_ERROR("flag out of range (see --help)");
        return 2;
    }
    int dct_mode = !strcmp(e->f.dct, "auto") ? ENC_DCT_AUTO : !strcmp(e->f.dct, "always") ? ENC_DCT_ALWAYS
                 : !strcmp(e->f.dct, "never") ? ENC_DCT_NEVER : -1;
    if (dct_mode < 0) {
        PRISM_ERROR("--jpeg-dct-scaling must be auto, always or never");
        return 2;
    }
    if (strcmp(e->f.overlap, "on") && strcmp(e->f.overlap, "off")) {
        PRISM_ERROR("--overlap-decode must be on or off");
        return 2;
    }
    e->overlap = !strcmp(e->f.overlap, "on");
    e->w_threads = s->o.threads;
    e->n_image_threads = (int)(e->f.image_threads ? e->f.image_threads
                                                  : PRISM_MIN(PRISM_MAX(s->o.threads, 1), ENC_POOL_MAX));
    if (enc_prep_plan(&e->prep, &e->cfg, s->o.model_path, (uint64_t)e->f.max_pixels, (uint64_t)e->f.max_decode_pixels,
                      (int)e->f.decode_threads, dct_mode, err, sizeof(err)) != PRISM_OK) {
        PRISM_ERROR("image preprocessing: %s", err);
        return 1;
    }
    e->max_batch = (int)e->f.max_batch;
    e->max_queue = (int)e->f.max_queue;
    e->max_queue_bytes = (uint64_t)e->f.max_queue_bytes;
    e->max_batch_s = e->f.max_batch_s;
    s->cap = (prism_worker_capacity_t){.max_running = (uint32_t)e->max_queue, .max_queued_bytes = e->max_queue_bytes};
    const char *hold = getenv("PRISM_TEST_HOLD_READY");
    e->test_hold_ready = hold && *hold && strcmp(hold, "0");
    if (e->test_hold_ready)
        PRISM_WARN("test hook PRISM_TEST_HOLD_READY is set: results wait for their batch's vision tower");
    const char *hold_mixed = getenv("PRISM_TEST_HOLD_MIXED_MICRO_BATCH_S");
    double hm = hold_mixed && *hold_mixed ? strtod(hold_mixed, NULL) : 0;
    e->test_hold_mixed_s = hm > 0 && hm <= 60 ? hm : 0;
    if (e->test_hold_mixed_s > 0)
        PRISM_WARN("test hook PRISM_TEST_HOLD_MIXED_MICRO_BATCH_S=%g is set: the tower waits for an abort in a mixed "
                   "micro-batch", e->test_hold_mixed_s);
    if (prism_model_native_vision(&e->cfg)) {
        /* native resolution: the largest image (hence the buffers) is sized with the plan */
        e->native = true;
        e->piece_rows = (int)e->f.piece_rows;
        e->patch_floats = prism_qwenvl_patch_floats(&e->prep.qw);
        e->row_floats = prism_vision_native_row_floats(&e->cfg);
        e->emb_floats = (size_t)e->piece_rows * e->row_floats;   /* a piece is a cache unit */
        e->cap_tiles = (int)PRISM_ARRAY_LEN(e->cur.pix_job);   /* images per batch at most */
        e->overlap = false;   /* native resolution: one batch at a time */
        return -1;
    }
    e->cap_tiles = PRISM_MAX(e->max_batch, e->prep.max_tiles);
    e->emb_floats = (size_t)e->cfg.image_seq_length * e->cfg.hidden;
    size_t S = (size_t)e->cfg.v_image_size;
    e->tile_px = 3 * S * S;
    s->cap.max_batch_tokens = (uint32_t)(e->max_batch * e->cfg.image_seq_length);
    return -1;
}

static int encoder_load(void *ctx, prism_worker_startup_t *s)
{
    encoder_t *e = ctx;
    char err[512] = "";
    e->be = s->be;
    /* a native-resolution tower's arena waits for the plan (encoder_ready): its size is the largest
     * image, which may be what the budget leaves after the weights */
    int rc = e->native ? prism_vision_native_load(e->be, &e->cfg, s->o.model_path, 0, &e->nvis, err, sizeof(err))
                       : prism_vision_load(e->be, &e->cfg, s->o.model_path, e->max_batch, &e->vis, err, sizeof(err));
    if (rc != PRISM_OK) {
        PRISM_ERROR("cannot load vision tower: %s", err);
        return 1;
    }
    return -1;
}

/* The tier's regions (native resolution: for images of up to e->max_tokens LM tokens). */
static void plan_regions(encoder_t *e, prism_mem_plan_t *p)
{
    if (e->native) {
        prism_mem_plan_add(p, "weights", prism_vision_native_weight_bytes(e->nvis), PRISM_MEM_LIBRARY);
        prism_mem_plan_add(p, "activations", prism_vision_native_arena_bytes(&e->cfg, e->cap_patches), PRISM_MEM_LIBRARY);
        prism_mem_plan_add(p, "model-host", prism_vision_native_host_bytes(&e->cfg, e->cap_patches), PRISM_MEM_LIBRARY);
    } else {
        prism_mem_plan_add(p, "weights", prism_vision_weight_bytes(e->vis), PRISM_MEM_LIBRARY);
        prism_mem_plan_add(p, "activations", prism_vision_arena_bytes(&e->cfg, e->max_batch), PRISM_MEM_LIBRARY);
    }
    /* per member of the image pool: the decoder's region and the relay's ring (the relay's helper
     * thread has a stack of its own, as has each member but the loop thread's) */
    size_t P = (size_t)e->n_image_threads;
    size_t relay_stack = e->prep.relay_bytes ? PRISM_IMAGE_RELAY_STACK_BYTES : 0;
    prism_mem_plan_add(p, "decode", P * (e->prep.dec_bytes + e->prep.relay_bytes - relay_stack) + enc_pool_bytes((int)P),
                       PRISM_MEM_LIBRARY);
    prism_mem_plan_add(p, "decode-thread", P * relay_stack + (size_t)enc_pool_threads((int)P, e->overlap) *
                       ENC_POOL_STACK_BYTES, PRISM_MEM_OUTSIDE);
    prism_mem_plan_add(p, "preprocess", P * e->prep.ws_bytes, PRISM_MEM_LIBRARY);
    prism_mem_plan_add(p, "embedding-cache", prism_embed_cache_bytes((size_t)e->f.cache_bytes, e->emb_floats),
                       PRISM_MEM_LIBRARY);
    /* each router's queued image files, held as ZeroMQ frames */
    prism_mem_plan_add(p, "queued-images", (size_t)e->max_queue_bytes, PRISM_MEM_OUTSIDE);
    if (e->native) {
        PRISM_PLAN_POOL(p, "pixels", e->cur.pixels, (size_t)e->cap_patches * e->patch_floats);
        /* one piece of padding: the last piece of the last image is read whole by the cache */
        PRISM_PLAN_POOL(p, "outputs", e->out, ((size_t)e->max_tokens + e->piece_rows) * e->row_floats);
    } else {
        PRISM_PLAN_POOL(p, "pixels", e->cur.pixels, (size_t)e->cap_tiles * e->tile_px);
        PRISM_PLAN_POOL(p, "outputs", e->out, (size_t)e->cap_tiles * e->emb_floats);
        PRISM_PLAN_POOL(p, "tile-jobs", e->cur.tile_job, e->cap_tiles);
        if (e->overlap) {   /* the next batch's, decoding while the tower reads the first */
            PRISM_PLAN_POOL(p, "pixels-next", e->nxt.pixels, (size_t)e->cap_tiles * e->tile_px);
            PRISM_PLAN_POOL(p, "tile-jobs-next", e->nxt.tile_job, e->cap_tiles);
        }
    }
    PRISM_PLAN_POOL(p, "jobs", e->jobs, e->max_queue);
}

static void native_max_tokens(encoder_t *e, int T)
{
    e->max_tokens = T;
    e->cap_patches = T * e->cfg.v_merge * e->cfg.v_merge;
}

/* Native resolution: the largest image, in LM tokens: --max-image-tokens, or what the processor
 * allows lowered to what the budget leaves (the plan as it stands: start-up's regions). It sizes the
 * tower's arena and the pixel and output buffers; a batch is as many images as their patches fit. */
static int plan_native(encoder_t *e, prism_worker_startup_t *s)
{
    int T = (int)(e->f.max_image_tokens ? e->f.max_image_tokens
                                        : PRISM_MIN(prism_qwenvl_max_tokens(&e->prep.qw),
                                                    (int64_t)MAX_PARTS * PRISM_VISION_PIECE_ROWS));
    if (!e->f.max_image_tokens && s->plan.budget) {
        /* the largest image the budget holds, at most what the processor allows */
        int lo = 1, hi = T;
        while (lo < hi) {
            int mid = lo + (hi - lo + 1) / 2;
            prism_mem_plan_t trial = s->plan;
            native_max_tokens(e, mid);
            plan_regions(e, &trial);
            if (prism_mem_plan_total(&trial) <= s->plan.budget) lo = mid;
            else hi = mid - 1;
        }
        if (lo < T)
            PRISM_INFO("--mem-budget leaves room for images of up to %d LM tokens (the processor allows %d): larger "
                       "ones are refused (max_pixels %lld fits)", lo, T,
                       (long long)prism_qwenvl_max_pixels_for_tokens(&e->prep.qw, lo));
        T = lo;
    }
    native_max_tokens(e, T);
    if ((T + e->piece_rows - 1) / e->piece_rows > MAX_PARTS) {
        PRISM_ERROR("images of %d tokens in pieces of %d rows: more than %d pieces (raise --embed-piece-rows)", T,
                    e->piece_rows, MAX_PARTS);
        return 2;
    }
    s->cap.max_batch_tokens = (uint32_t)T;
    return -1;
}

/* Whether the plan as it stands plus the tier's regions fits --mem-budget (none: always). */
static bool plan_fits(encoder_t *e, prism_worker_startup_t *s)
{
    if (!s->plan.budget) return true;
    prism_mem_plan_t trial = s->plan;
    plan_regions(e, &trial);
    return prism_mem_plan_total(&trial) <= s->plan.budget;
}

/* The image pool's members, fewer than asked when --mem-budget does not hold them all (with the
 * largest image the processor allows, for native resolution: image size goes before parallelism;
 * with --overlap-decode's second pixel buffer: the pool is lowered to hold it, and the overlap is
 * given up only when one member and two buffers do not fit). */
static void plan_image_threads(encoder_t *e, prism_worker_startup_t *s)
{
    int asked = e->n_image_threads;
    if (e->overlap) {
        e->n_image_threads = 1;
        if (!plan_fits(e, s)) {
            PRISM_INFO("--mem-budget does not hold a second pixel buffer: --overlap-decode off");
            e->overlap = false;
        }
        e->n_image_threads = asked;
    }
    if (e->native) native_max_tokens(e, (int)(e->f.max_image_tokens ? e->f.max_image_tokens
                                                                    : PRISM_MIN(prism_qwenvl_max_tokens(&e->prep.qw),
                                                                                (int64_t)MAX_PARTS * PRISM_VISION_PIECE_ROWS)));
    while (e->n_image_threads > 1 && !plan_fits(e, s)) e->n_image_threads--;
    if (e->n_image_threads < asked)
        PRISM_INFO("--mem-budget holds %d image decoder(s) at once, not %d", e->n_image_threads, asked);
}

static int encoder_plan(void *ctx, prism_worker_startup_t *s)
{
    encoder_t *e = ctx;
    int rc;
    plan_image_threads(e, s);
    if (e->native && (rc = plan_native(e, s)) >= 0) return rc;
    plan_regions(e, &s->plan);
    return -1;
}

static int encoder_ready(void *ctx, prism_worker_startup_t *s)
{
    encoder_t *e = ctx;
    char err[512] = "";
    if (e->native && prism_vision_native_reserve(e->nvis, e->cap_patches, err, sizeof(err)) != PRISM_OK) {
        PRISM_ERROR("vision tower: %s", err);
        return 1;
    }
    if (enc_pool_create(&e->pool, e->n_image_threads, &e->prep, e->overlap) != PRISM_OK) {
        PRISM_ERROR("cannot create the image decoders");
        return 1;
    }
    /* cache units: a tile's embeddings, or a piece of a native-resolution image */
    int max_units = e->native ? (e->max_tokens + e->piece_rows - 1) / e->piece_rows : e->prep.max_tiles;
    if (prism_embed_cache_init(&e->cache, (size_t)e->f.cache_bytes, e->emb_floats, max_units) != PRISM_OK) {
        PRISM_ERROR("cannot allocate the embedding cache");
        return 1;
    }
    s->cap.embedding_cache_units = (uint32_t)e->cache.n_units;   /* 0: the router sends no early jobs */
    e->hook = (prism_model_hook_t){hook_layer, hook_cancelled, e};
    if (e->native) prism_vision_native_set_hook(e->nvis, &e->hook);
    else prism_vision_set_hook(e->vis, &e->hook);
    publish_load(e);
    return -1;
}

/* After start-up and registration (tier->run): the loop, then everything closed. */
static int encoder_run(void *ctx)
{
    encoder_t *e = ctx;
    PRISM_INFO("encoder: %d image decoder(s) at once (%d thread(s) each), vision tower on %lld thread(s), %s",
               e->n_image_threads, e->prep.relay_bytes ? 2 : 1, (long long)e->w_threads,
               e->overlap ? "the next batch decodes during the tower (--overlap-decode)" : "one batch at a time");
    if (e->native)
        PRISM_INFO("encoder: images of up to %d LM tokens (%d patches) per batch, %.2gs batch bound, queue %d, cache %d "
                   "pieces", e->max_tokens, e->cap_patches, e->max_batch_s, e->max_queue, e->cache.n_units);
    else
        PRISM_INFO("encoder: micro-batch %d %s, pixel buffer %d tiles (largest image %d), %.2gs batch bound, queue %d, "
                   "cache %d tiles", e->max_batch, e->prep.max_tiles > 1 ? "tiles" : "images", e->cap_tiles,
                   e->prep.max_tiles, e->max_batch_s, e->max_queue, e->cache.n_units);

    while (!prism_worker_should_stop()) {
        publish_load(e);
        bool work = e->nxt.n_batch > 0;   /* the next batch is formed: take it at once */
        for (int i = 0; i < e->max_queue && !work; i++) work = e->jobs[i].state == JOB_QUEUED;
        prism_worker_poll(&e->w, work ? 0 : (e->cur.n_batch ? 2 : 50), on_msg, e);
        run_batch(e);
    }
    PRISM_INFO("encoder worker stopping: %llu images encoded, %llu failed, %llu cancelled in a batch, "
               "cache %llu hits / %llu misses", (unsigned long long)e->encoded, (unsigned long long)e->failed,
               (unsigned long long)e->cancelled, (unsigned long long)e->cache.hits, (unsigned long long)e->cache.misses);
    enc_pool_destroy(&e->pool);
    return 0;
}

static const prism_worker_tier_t k_encoder_tier = {
    .role = "encoder", .proto_role = PRISM__ROLE__ROLE_ENCODER,
    .summary = "Prism encoder worker: image decode, preprocessing (CLIP, Llama-4 tiles or Qwen-VL patches), vision "
               "tower + projector.",
    .flags = encoder_flags, .size = encoder_size, .load = encoder_load, .plan = encoder_plan, .ready = encoder_ready,
    .run = encoder_run,
};

int main(int argc, char **argv)
{
    static encoder_t e;
    prism_worker_startup_t s = {.w = &e.w, .cfg = &e.cfg};
    return prism_worker_main(&k_encoder_tier, &e, &s, argc, argv);
}
