/* encoder_worker: image decode (libjpeg-turbo, libspng), CLIP preprocessing, vision tower +
 * projector, embedding cache. Embeddings go straight to the prefill worker the router chose, as a
 * raw frame.
 *
 * Jobs arrive from the router with the image file as a raw frame, which is kept (zmq_msg_move, no
 * copy) in a bounded job queue. Each loop iteration forms a batch of at most --max-batch-images
 * images, streams each through the decoder into the CLIP resampler (rows are resampled as they are
 * decoded, straight into the batch's pixel buffer; no decoded image is ever held), runs the vision
 * tower once and then pushes the results. When a prefill worker's receive pool is full the push
 * waits: the encoder keeps heartbeating but takes no new batch (backpressure), so nothing grows.
 *
 * Cache entries a batch answers from are pinned until their jobs are sent, so a miss later in the
 * same batch (or while the batch waits for prefill) cannot evict and overwrite them. */
#include "core/core.h"
#include "core/cli.h"
#include "net/net.h"
#include "worker/worker.h"
#include "backend/backend.h"
#include "model/model.h"
#include "image/image.h"
#include "image/clip.h"
#include "embed_cache.h"

#include <stdio.h>
#include <string.h>

typedef enum { JOB_FREE, JOB_QUEUED, JOB_ENCODED, JOB_SEND } job_state_t;

/* JPEG DCT-domain downscaling trades exactness for speed: HF decodes every image at full size, so
 * a scaled decode moves pixels (and can change a greedy token). "always" scales every JPEG at least
 * twice the model's resize target. "auto" and "never" decode at full size: streaming needs only a
 * few rows at any size, and what a full decode may not fit (a progressive JPEG's coefficients) DCT
 * scaling would not shrink. */
enum { DCT_AUTO, DCT_ALWAYS, DCT_NEVER };

typedef struct {
    job_state_t state;
    uint64_t rid;
    char router_id[128];
    uint32_t image_index;
    uint64_t hash;
    char prefill_endpoint[256];
    zmq_msg_t image;          /* file bytes, owned while queued */
    bool has_image;
    const float *emb;         /* result: cache entry (pinned) or batch output row */
    char error[256];
    bool cache_hit;
    int cache_slot;           /* pinned cache slot while the job is in flight; -1 none */
    float decode_ms, vit_ms;
    double t_arrive;
} job_t;

typedef struct {
    prism_worker_t w;
    prism_model_config_t cfg;
    prism_backend_t *be;
    prism_vision_t *vis;
    prism_clip_preproc_t pre;
    prism_embed_cache_t cache;
    int max_batch, max_queue;
    uint64_t max_pixels;
    int dct;                  /* DCT_AUTO / DCT_ALWAYS / DCT_NEVER */
    job_t *jobs;              /* [max_queue] */
    int batch[256];           /* job indices of the batch in flight */
    int n_batch;
    float *pixels;            /* [max_batch][3][S][S] */
    float *out;               /* [max_batch][image_seq_length][hidden] */
    prism_image_decoder_t *dec;   /* decode memory: O(width) rows + whole-image state */
    prism_image_relay_t *relay;   /* preprocessing thread (--decode-threads 2), or NULL */
    void *ws;                 /* preprocess workspace */
    size_t ws_cap;
    size_t emb_floats;
    uint64_t encoded, failed;
} encoder_t;

static void finish_job(encoder_t *e, job_t *j)
{
    Prism__EncodeDone d = PRISM__ENCODE_DONE__INIT;
    d.image_index = j->image_index;
    d.cache_hit = j->cache_hit;
    d.decode_ms = j->decode_ms;
    d.vit_ms = j->vit_ms;
    d.error = j->error;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_ENCODE_DONE;
    env.encode_done = &d;
    prism_worker_reply(&e->w, j->router_id, j->rid, &env);
    if (j->has_image) zmq_msg_close(&j->image);
    j->has_image = false;
    if (j->cache_slot >= 0) prism_embed_cache_unpin(&e->cache, j->cache_slot);
    j->cache_slot = -1;
    j->emb = NULL;
    j->state = JOB_FREE;
}

/* Pushes one job's embeddings (or its error) to the prefill worker. PRISM_EAGAIN: pool full. */
static int push_job(encoder_t *e, job_t *j)
{
    void *s = prism_worker_peer_sock(&e->w, j->prefill_endpoint);
    if (!s) {
        snprintf(j->error, sizeof(j->error), "cannot reach prefill worker");
        return PRISM_EIO;
    }
    Prism__Embeddings em = PRISM__EMBEDDINGS__INIT;
    em.image_index = j->image_index;
    em.n_tokens = (uint32_t)e->cfg.image_seq_length;
    em.hidden = (uint32_t)e->cfg.hidden;
    em.error = j->error;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_EMBEDDINGS;
    env.request_id = j->rid;
    env.router_id = j->router_id;
    env.embeddings = &em;
    prism_frame_t f = {j->emb, e->emb_floats * sizeof(float)};
    return prism_msg_send(s, NULL, 0, &env, j->error[0] ? NULL : &f, j->error[0] ? 0 : 1, ZMQ_DONTWAIT);
}

static void on_encode(encoder_t *e, prism_msg_t *m)
{
    const Prism__Envelope *env = m->env;
    const Prism__Encode *en = env->encode;
    const char *router = env->router_id ? env->router_id : "";
    job_t *j = NULL;
    for (int i = 0; i < e->max_queue; i++)
        if (e->jobs[i].state == JOB_FREE) { j = &e->jobs[i]; break; }
    if (!j || !en || m->n_frames != 1 || !en->prefill_endpoint || !*en->prefill_endpoint) {
        job_t tmp = {.cache_slot = -1};
        tmp.rid = env->request_id;
        tmp.image_index = en ? en->image_index : 0;
        snprintf(tmp.router_id, sizeof(tmp.router_id), "%s", router);
        snprintf(tmp.error, sizeof(tmp.error), "%s", j ? "malformed encode request" : "encoder queue is full");
        PRISM_WARN("request %llu: %s", (unsigned long long)env->request_id, tmp.error);
        finish_job(e, &tmp);
        return;
    }
    memset(j, 0, sizeof(*j));
    j->cache_slot = -1;
    j->state = JOB_QUEUED;
    j->rid = env->request_id;
    snprintf(j->router_id, sizeof(j->router_id), "%s", router);
    j->image_index = en->image_index;
    j->hash = en->content_hash;
    snprintf(j->prefill_endpoint, sizeof(j->prefill_endpoint), "%s", en->prefill_endpoint);
    zmq_msg_init(&j->image);
    zmq_msg_move(&j->image, &m->frames[0]);
    j->has_image = true;
    j->t_arrive = prism_now_s();
}

static void on_abort(encoder_t *e, uint64_t rid, const char *router)
{
    for (int i = 0; i < e->max_queue; i++) {
        job_t *j = &e->jobs[i];
        if (j->state == JOB_QUEUED && j->rid == rid && !strcmp(j->router_id, router)) {
            if (j->has_image) zmq_msg_close(&j->image);
            j->has_image = false;
            j->state = JOB_FREE;
        }
    }
}

static void on_msg(prism_worker_t *w, prism_msg_t *m, int router_index, void *ud)
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

/* Streams one image through the decoder into the CLIP resampler, which writes pixel slot `slot`. */
static int prepare(encoder_t *e, job_t *j, int slot)
{
    size_t len = zmq_msg_size(&j->image);
    const uint8_t *data = zmq_msg_data(&j->image);
    prism_image_info_t info;
    int rc = prism_image_probe(data, len, &info);
    if (rc != PRISM_OK) {
        snprintf(j->error, sizeof(j->error), "The image could not be decoded: not a valid JPEG or PNG file.");
        return rc;
    }
    if ((uint64_t)info.width * (uint64_t)info.height > e->max_pixels) {
        snprintf(j->error, sizeof(j->error), "Image of %dx%d pixels exceeds the limit of %llu pixels.",
                 info.width, info.height, (unsigned long long)e->max_pixels);
        return PRISM_ELIMIT;
    }
    int tw, th;
    if (prism_clip_resize_target(&e->pre, info.width, info.height, &tw, &th) != PRISM_OK) {
        snprintf(j->error, sizeof(j->error), "Image of %dx%d pixels cannot be resized to the model's input: its "
                 "aspect ratio is too extreme.", info.width, info.height);
        return PRISM_ELIMIT;
    }
    prism_image_decode_opts_t opts = {.max_pixels = e->max_pixels};
    if (e->dct == DCT_ALWAYS)
        prism_clip_decode_opts(&e->pre, &info, &opts);
    size_t S = (size_t)e->cfg.v_image_size;
    prism_clip_stream_t st;
    prism_image_sink_t sink = prism_clip_stream_sink(&st, &e->pre, e->ws, e->ws_cap, e->pixels + (size_t)slot * 3 * S * S);
    prism_image_sink_t inner = sink;
    if (e->relay)
        sink = prism_image_relay_sink(e->relay, &inner);
    double t0 = prism_now_s();
    rc = prism_image_decoder_run(e->dec, data, len, &opts, &sink);
    if (rc == PRISM_OK)
        rc = prism_clip_stream_finish(&st);
    j->decode_ms = (float)((prism_now_s() - t0) * 1e3);
    if (rc == PRISM_ELIMIT) {
        snprintf(j->error, sizeof(j->error), "The %dx%d %s image cannot be decoded: %s.", info.width, info.height,
                 prism_image_format_name(info.format), prism_image_decoder_error(e->dec));
        return rc;
    }
    if (rc != PRISM_OK) {
        snprintf(j->error, sizeof(j->error), "The image could not be decoded (%s): %s.", prism_strerror(rc),
                 prism_image_decoder_error(e->dec)[0] ? prism_image_decoder_error(e->dec)
                                                      : "the data is corrupt or truncated");
        return rc;
    }
    return PRISM_OK;
}

/* Pushes finished jobs of the batch in flight; returns true when the batch is fully sent. */
static bool flush_batch(encoder_t *e)
{
    int left = 0;
    for (int i = 0; i < e->n_batch; i++) {
        job_t *j = &e->jobs[e->batch[i]];
        if (j->state != JOB_SEND) continue;
        int rc = push_job(e, j);
        if (rc == PRISM_EAGAIN) {
            left++;
            continue;
        }
        if (rc != PRISM_OK && !j->error[0]) snprintf(j->error, sizeof(j->error), "embedding transfer failed");
        if (j->error[0]) e->failed++;
        else e->encoded++;
        finish_job(e, j);
    }
    if (!left) e->n_batch = 0;
    return left == 0;
}

static void run_batch(encoder_t *e)
{
    if (e->n_batch && !flush_batch(e)) return;  /* previous results still waiting for prefill */
    int n_pix = 0;
    int pix_job[256];
    /* Oldest first. */
    for (int pass = 0; pass < e->max_queue && e->n_batch < e->max_batch; pass++) {
        job_t *best = NULL;
        for (int i = 0; i < e->max_queue; i++) {
            job_t *j = &e->jobs[i];
            if (j->state == JOB_QUEUED && (!best || j->t_arrive < best->t_arrive)) best = j;
        }
        if (!best) break;
        int idx = (int)(best - e->jobs);
        e->batch[e->n_batch++] = idx;
        best->state = JOB_ENCODED;
        /* The entry stays pinned until the job is sent (finish_job): a miss later in this batch
         * must not evict and overwrite it. */
        int hit = prism_embed_cache_get_pinned(&e->cache, best->hash);
        if (hit >= 0) {
            best->cache_slot = hit;
            best->emb = prism_embed_cache_data(&e->cache, hit);
            best->cache_hit = true;
            best->state = JOB_SEND;
            continue;
        }
        if (prepare(e, best, n_pix) != PRISM_OK) {
            best->state = JOB_SEND;  /* error travels to prefill and router */
            continue;
        }
        pix_job[n_pix++] = idx;
    }
    if (n_pix) {
        double t0 = prism_now_s();
        int rc = prism_vision_encode(e->vis, e->pixels, n_pix, e->out);
        float ms = (float)((prism_now_s() - t0) * 1e3);
        for (int i = 0; i < n_pix; i++) {
            job_t *j = &e->jobs[pix_job[i]];
            j->state = JOB_SEND;
            j->vit_ms = ms / n_pix;
            if (rc != PRISM_OK) {
                snprintf(j->error, sizeof(j->error), "vision encoder failed: %s", prism_strerror(rc));
                continue;
            }
            j->emb = e->out + (size_t)i * e->emb_floats;
            prism_embed_cache_put(&e->cache, j->hash, j->emb);
        }
    }
    if (e->n_batch) flush_batch(e);
}

int main(int argc, char **argv)
{
    prism_worker_opts_t o;
    prism_worker_opts_defaults(&o, "encoder");
    int64_t max_batch = 8, max_queue = 64, cache_bytes = 64ll << 20, max_pixels = 4096ll * 4096,
            max_decode_pixels = 4096ll * 4096, decode_threads = 2;
    const char *dct = "auto";
    prism_flag_t flags[32] = {
        PRISM_FLAG_INT("max-batch-images", &max_batch, "Images per vision-tower batch"),
        PRISM_FLAG_INT("max-queued-images", &max_queue, "Images waiting for the encoder at once"),
        PRISM_FLAG_BYTES("embedding-cache-bytes", &cache_bytes, "Embedding cache budget (0 disables)"),
        PRISM_FLAG_INT("max-image-pixels", &max_pixels, "Largest image accepted (width*height in the file)"),
        PRISM_FLAG_INT("max-decode-pixels", &max_decode_pixels,
                       "Whole-image decode memory, in pixels at 3 bytes each: progressive JPEG coefficients "
                       "(4:2:0; 4:4:4 needs twice as much) and interlaced PNG; baseline JPEG and other PNG "
                       "stream in rows and need none (0 = refuse what does not stream)"),
        PRISM_FLAG_STR("jpeg-dct-scaling", &dct, "always (decode JPEGs at a reduced size: faster, not identical to "
                       "transformers), auto or never (full size)"),
        PRISM_FLAG_INT("decode-threads", &decode_threads, "1: decode and preprocess on the worker thread; 2: "
                       "preprocess rows on a helper thread while the next ones decode"),
    };
    static encoder_t e;
    int rc = prism_worker_startup(argc, argv, "encoder", "Prism encoder worker: image decode, CLIP preprocessing, "
                                  "vision tower + projector.", flags, &o, &e.cfg);
    if (rc >= 0) return rc;
    double t0 = prism_now_s();
    char err[512] = "", path[1024];
    if (!e.cfg.has_vision) {
        PRISM_ERROR("model at %s has no vision tower: an encoder worker has nothing to do", o.model_path);
        return 1;
    }
    if (max_batch < 1 || max_batch > 256 || max_queue < max_batch || max_queue > 65536 || max_pixels < 1 ||
        max_decode_pixels < 0 || decode_threads < 1 || decode_threads > 2) {
        PRISM_ERROR("flag out of range (see --help)");
        return 2;
    }
    prism_path_join(path, sizeof(path), o.model_path, "preprocessor_config.json");
    if (prism_clip_preproc_load(path, &e.pre, err, sizeof(err)) != PRISM_OK) {
        PRISM_ERROR("cannot load %s: %s", path, err);
        return 1;
    }
    e.max_batch = (int)max_batch;
    e.max_queue = (int)max_queue;
    e.max_pixels = (uint64_t)max_pixels;
    if (!strcmp(dct, "auto")) e.dct = DCT_AUTO;
    else if (!strcmp(dct, "always")) e.dct = DCT_ALWAYS;
    else if (!strcmp(dct, "never")) e.dct = DCT_NEVER;
    else {
        PRISM_ERROR("--jpeg-dct-scaling must be auto, always or never");
        return 2;
    }
    e.emb_floats = (size_t)e.cfg.image_seq_length * e.cfg.hidden;
    size_t S = (size_t)e.cfg.v_image_size;
    /* Decode memory: rows of the widest image accepted, plus whole-image state for
     * --max-decode-pixels; preprocessing scratch for any accepted image. */
    int max_width = (int)PRISM_MIN(max_pixels, (int64_t)PRISM_IMAGE_MAX_DIM);
    size_t dec_bytes = prism_image_decoder_bytes(max_width, (uint64_t)max_decode_pixels);
    size_t relay_bytes = decode_threads > 1 ? prism_image_relay_bytes(max_width) : 0;
    e.ws_cap = prism_clip_workspace_bound(&e.pre, (uint64_t)max_pixels);

    if (prism_backend_create(o.device, (int)o.threads, 0, &e.be) != PRISM_OK) {
        PRISM_ERROR("cannot create backend '%s'", o.device);
        return 1;
    }
    if (prism_vision_load(e.be, &e.cfg, o.model_path, e.max_batch, &e.vis, err, sizeof(err)) != PRISM_OK) {
        PRISM_ERROR("cannot load vision tower: %s", err);
        return 1;
    }
    prism_mem_plan_t plan = {.budget = (size_t)o.mem_budget};
    prism_mem_plan_add(&plan, "weights", prism_vision_weight_bytes(e.vis));
    prism_mem_plan_add(&plan, "activations", prism_vision_arena_bytes(&e.cfg, e.max_batch));
    prism_mem_plan_add(&plan, "pixels+outputs", (size_t)e.max_batch * (3 * S * S + e.emb_floats) * sizeof(float));
    prism_mem_plan_add(&plan, "decode", dec_bytes + relay_bytes);
    prism_mem_plan_add(&plan, "preprocess", e.ws_cap);
    prism_mem_plan_add(&plan, "embedding-cache", prism_embed_cache_bytes((size_t)cache_bytes, e.emb_floats));
    prism_mem_plan_add(&plan, "runtime", prism_mem_runtime_bytes());
    prism_mem_plan_add(&plan, "reserve", PRISM_MEM_RESERVE);
    if (prism_mem_plan_check(&plan, "encoder") != PRISM_OK) return 1;

    e.jobs = prism_xcalloc((size_t)e.max_queue, sizeof(job_t));
    e.pixels = prism_malloc_aligned((size_t)e.max_batch * 3 * S * S * sizeof(float), 64);
    e.out = prism_malloc_aligned((size_t)e.max_batch * e.emb_floats * sizeof(float), 64);
    e.ws = prism_malloc_aligned(PRISM_MAX(e.ws_cap, (size_t)64), 64);
    if (prism_image_decoder_create(dec_bytes, &e.dec) != PRISM_OK ||
        (decode_threads > 1 && prism_image_relay_create(max_width, &e.relay) != PRISM_OK)) {
        PRISM_ERROR("cannot create the image decoder");
        return 1;
    }
    if (!e.pixels || !e.out || !e.ws ||
        prism_embed_cache_init(&e.cache, (size_t)cache_bytes, e.emb_floats) != PRISM_OK) {
        PRISM_ERROR("cannot allocate encoder pools");
        return 1;
    }

    if (prism_worker_init(&e.w, PRISM__ROLE__ROLE_ENCODER, &o, NULL, 0) != PRISM_OK)
        return 1;
    prism_worker_set_capacity(&e.w, &o, &plan, 0, 0, (uint32_t)(e.max_batch * e.cfg.image_seq_length),
                              (uint32_t)e.max_queue, 0);
    PRISM_INFO("encoder worker %s ready in %.2fs: batch %d images, queue %d, cache %d entries",
               e.w.worker_id, prism_now_s() - t0, e.max_batch, e.max_queue, e.cache.n_slots);

    while (!prism_worker_should_stop()) {
        int queued = 0;
        for (int i = 0; i < e.max_queue; i++) queued += e.jobs[i].state != JOB_FREE;
        Prism__Heartbeat hb = PRISM__HEARTBEAT__INIT;
        hb.running = (uint32_t)e.n_batch;
        hb.waiting = (uint32_t)queued;
        hb.mem_planned = prism_mem_plan_total(&plan);
        hb.cache_hits = e.cache.hits;
        hb.cache_misses = e.cache.misses;
        hb.pool_free = (uint32_t)(e.max_queue - queued);
        prism_worker_tick(&e.w, &hb);
        bool work = false;
        for (int i = 0; i < e.max_queue && !work; i++) work = e.jobs[i].state == JOB_QUEUED;
        prism_worker_poll(&e.w, work ? 0 : (e.n_batch ? 2 : 50), false, on_msg, &e);
        run_batch(&e);
    }
    PRISM_INFO("encoder worker stopping: %llu images encoded, %llu failed, cache %llu hits / %llu misses",
               (unsigned long long)e.encoded, (unsigned long long)e.failed, (unsigned long long)e.cache.hits,
               (unsigned long long)e.cache.misses);
    prism_worker_close(&e.w);
    prism_image_relay_destroy(e.relay);
    prism_image_decoder_destroy(e.dec);
    return 0;
}
