/* prefill_worker: runs the prompt through the language model, samples the first token (sent to
 * the router at once: that is TTFT), then ships the prompt's KV blocks to the decode worker the
 * router chose and frees its own copy.
 *
 * Image embeddings arrive straight from encoders on the data socket and land only in a fixed pool
 * of image slots. When the pool is full the data socket is not read, so encoders wait
 * (backpressure) — nothing is buffered without bound. Embeddings and the Prefill request travel on
 * different sockets and may arrive in either order. Prompts run in chunks of at most
 * --chunked-prefill-size tokens. */
#include "core/core.h"
#include "core/cli.h"
#include "net/net.h"
#include "worker/worker.h"
#include "worker/seq.h"
#include "kv/kv.h"
#include "sample/sample.h"
#include "backend/backend.h"
#include "model/model.h"

#include <stdio.h>
#include <string.h>

#define MAX_IMAGES 64

typedef struct {
    bool used;
    uint64_t rid;
    char router_id[128];
    uint32_t image_index;
    double t_arrive;
    float *data;             /* [image_seq_length][hidden] */
} emb_slot_t;

typedef struct {
    prism_seq_t seq;         /* owner, sampling, RNG; seq.used marks the slot */
    int32_t *tokens;         /* [max_model_len] slice of the token pool */
    int n_tokens;
    int n_images;
    uint32_t span_off[MAX_IMAGES], span_len[MAX_IMAGES];
    char decode_endpoint[256];
    double t_arrive;
} preq_t;

typedef struct {
    prism_worker_t w;
    prism_model_config_t cfg;
    prism_backend_t *be;
    prism_llm_t *llm;
    prism_kv_cache_t *kv;
    prism_kv_blocks_t blocks;
    prism_sampler_t sampler;
    int max_pending, chunk, max_model_len, max_blocks_per_seq, n_emb;
    double orphan_timeout_s; /* embeddings whose Prefill never came are dropped after this */
    preq_t *reqs;            /* [max_pending] */
    int32_t *token_pool;     /* [max_pending][max_model_len] */
    emb_slot_t *emb;         /* [n_emb] */
    float *emb_pool;         /* [n_emb][image_seq_length][hidden] */
    const float **chunk_rows; /* [chunk]: image embedding row of each token, or NULL */
    int32_t *table;          /* [max_blocks_per_seq] */
    float *logits;           /* [vocab] */
    uint8_t *kv_out;         /* [max_blocks_per_seq][block_bytes]: export staging */
    size_t block_bytes;
    /* a finished prefill whose KV the decode worker has not taken yet (its request's slot is
     * already free for the next one: kv_seq is a copy of the record) */
    bool kv_pending;
    prism_seq_t kv_seq;
    char kv_endpoint[256];
    Prism__Kv kv_hdr;
    size_t kv_len;
    uint64_t served;
} prefill_t;

static int emb_free_slots(const prefill_t *p)
{
    int n = 0;
    for (int i = 0; i < p->n_emb; i++) n += !p->emb[i].used;
    return n;
}

static emb_slot_t *emb_find(prefill_t *p, uint64_t rid, const char *router, uint32_t index)
{
    for (int i = 0; i < p->n_emb; i++) {
        emb_slot_t *e = &p->emb[i];
        if (e->used && e->rid == rid && e->image_index == index && !strcmp(e->router_id, router)) return e;
    }
    return NULL;
}

static bool owns(const prism_seq_t *s, uint64_t rid, const char *router)
{
    return s->used && s->rid == rid && !strcmp(s->router_id, router);
}

/* Frees a request's slot and its embedding slots (done, failed or aborted). */
static void release_request(prefill_t *p, uint64_t rid, const char *router)
{
    for (int i = 0; i < p->n_emb; i++)
        if (p->emb[i].used && p->emb[i].rid == rid && !strcmp(p->emb[i].router_id, router))
            p->emb[i].used = false;
    for (int i = 0; i < p->max_pending; i++)
        if (owns(&p->reqs[i].seq, rid, router)) p->reqs[i].seq.used = false;
}

/* Forgets everything about a request, its staged KV export included (abort, errors). */
static void drop_request(prefill_t *p, uint64_t rid, const char *router)
{
    release_request(p, rid, router);
    if (p->kv_pending && owns(&p->kv_seq, rid, router)) p->kv_pending = false;
}

static void send_tokens(prefill_t *p, const char *router, uint64_t rid, Prism__Tokens *t)
{
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_TOKENS;
    env.tokens = t;
    prism_worker_reply(&p->w, router, rid, &env);
}

static void send_error(prefill_t *p, const char *router, uint64_t rid, const char *msg)
{
    Prism__Tokens t = PRISM__TOKENS__INIT;
    t.finish = PRISM__FINISH__FINISH_ERROR;
    t.error = (char *)msg;
    t.from_prefill = true;
    send_tokens(p, router, rid, &t);
}

static void on_prefill(prefill_t *p, const Prism__Envelope *e)
{
    const Prism__Prefill *pf = e->prefill;
    const char *router = e->router_id ? e->router_id : "";
    const char *why = NULL;
    if (!pf || !pf->sampling || !pf->decode_endpoint) why = "malformed prefill request";
    else if (pf->n_token_ids == 0 || pf->n_token_ids >= (size_t)p->max_model_len) why = "prompt length out of range";
    else if (pf->n_images > MAX_IMAGES) why = "too many images";
    else why = prism_seq_check(pf->sampling);
    if (!why) {
        for (size_t i = 0; i < pf->n_token_ids; i++)
            if (pf->token_ids[i] < 0 || pf->token_ids[i] >= p->cfg.vocab) { why = "token id out of range"; break; }
        for (size_t i = 0; i < pf->n_images && !why; i++) {
            const Prism__ImageSpan *s = pf->images[i];
            if (s->n_tokens != (uint32_t)p->cfg.image_seq_length || s->offset + s->n_tokens > pf->n_token_ids)
                why = "image span out of range";
        }
    }
    preq_t *r = NULL;
    for (int i = 0; i < p->max_pending && !why; i++)
        if (!p->reqs[i].seq.used) { r = &p->reqs[i]; break; }
    if (!why && !r) why = "prefill worker is full";
    if (why) {
        PRISM_WARN("request %llu refused: %s", (unsigned long long)e->request_id, why);
        send_error(p, router, e->request_id, why);
        drop_request(p, e->request_id, router);
        return;
    }
    prism_seq_start(&r->seq, e->request_id, router, pf->sampling, (int)pf->n_token_ids,
                    prism_seq_seed(pf->sampling, e->request_id));
    r->n_tokens = (int)pf->n_token_ids;
    memcpy(r->tokens, pf->token_ids, sizeof(int32_t) * pf->n_token_ids);
    r->n_images = (int)pf->n_images;
    for (int i = 0; i < r->n_images; i++) {
        r->span_off[i] = pf->images[i]->offset;
        r->span_len[i] = pf->images[i]->n_tokens;
    }
    snprintf(r->decode_endpoint, sizeof(r->decode_endpoint), "%s", pf->decode_endpoint);
    r->t_arrive = prism_now_s();
}

static void on_embeddings(prefill_t *p, prism_msg_t *m)
{
    const Prism__Envelope *e = m->env;
    const Prism__Embeddings *em = e->embeddings;
    const char *router = e->router_id ? e->router_id : "";
    size_t len = 0;
    const void *data = prism_msg_frame(m, 0, &len);
    if (em && em->error && *em->error) {
        /* The encoder failed on this image; the router answers the client and aborts. */
        drop_request(p, e->request_id, router);
        return;
    }
    size_t want = (size_t)p->cfg.image_seq_length * p->cfg.hidden * sizeof(float);
    if (!em || !data || len != want || em->n_tokens != (uint32_t)p->cfg.image_seq_length ||
        em->hidden != (uint32_t)p->cfg.hidden || em->image_index >= MAX_IMAGES) {
        PRISM_WARN("request %llu: malformed embeddings dropped", (unsigned long long)e->request_id);
        send_error(p, router, e->request_id, "malformed image embeddings");
        drop_request(p, e->request_id, router);
        return;
    }
    if (emb_find(p, e->request_id, router, em->image_index)) return;  /* duplicate */
    for (int i = 0; i < p->n_emb; i++) {
        emb_slot_t *s = &p->emb[i];
        if (s->used) continue;
        s->used = true;
        s->rid = e->request_id;
        snprintf(s->router_id, sizeof(s->router_id), "%s", router);
        s->image_index = em->image_index;
        s->t_arrive = prism_now_s();
        memcpy(s->data, data, want);
        return;
    }
    PRISM_ASSERT(!"embedding accepted with no free slot");
}

static void on_msg(prism_worker_t *w, prism_msg_t *m, int router_index, void *ud)
{
    prefill_t *p = ud;
    switch (m->env->type) {
    case PRISM__MSG_TYPE__MSG_PREFILL:
        on_prefill(p, m->env);
        break;
    case PRISM__MSG_TYPE__MSG_EMBEDDINGS:
        on_embeddings(p, m);
        break;
    case PRISM__MSG_TYPE__MSG_ABORT:
        drop_request(p, m->env->request_id, m->env->router_id ? m->env->router_id : "");
        break;
    default:
        PRISM_WARN("unexpected message type %d", m->env->type);
    }
}

static bool ready(prefill_t *p, const preq_t *r)
{
    for (int i = 0; i < r->n_images; i++)
        if (!emb_find(p, r->seq.rid, r->seq.router_id, (uint32_t)i)) return false;
    return true;
}

static void try_send_kv(prefill_t *p)
{
    if (!p->kv_pending) return;
    prism_seq_t *q = &p->kv_seq;
    void *s = prism_worker_peer_sock(&p->w, p->kv_endpoint);
    if (!s) {
        send_error(p, q->router_id, q->rid, "cannot reach the decode worker");
        p->kv_pending = false;
        return;
    }
    p->kv_hdr.sampling = (Prism__Sampling *)prism_seq_sampling(q);   /* as the router sent it */
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_KV;
    env.request_id = q->rid;
    env.router_id = q->router_id;
    env.kv = &p->kv_hdr;
    prism_frame_t f = {p->kv_out, p->kv_len};
    int rc = prism_msg_send(s, NULL, 0, &env, &f, 1, ZMQ_DONTWAIT);
    if (rc == PRISM_EAGAIN) return;  /* decode is full: keep it and retry next iteration */
    if (rc != PRISM_OK) send_error(p, q->router_id, q->rid, "KV transfer to the decode worker failed");
    p->kv_pending = false;
}

/* Runs one whole request (chunked) if one is ready and its blocks fit. */
static void run_one(prefill_t *p)
{
    if (p->kv_pending) return;
    preq_t *r = NULL;
    for (int i = 0; i < p->max_pending; i++) {
        preq_t *c = &p->reqs[i];
        if (c->seq.used && ready(p, c) && (!r || c->t_arrive < r->t_arrive)) r = c;
    }
    if (!r) return;
    int nb = prism_kv_blocks_for_tokens(&p->blocks, r->n_tokens);
    if (prism_kv_blocks_alloc(&p->blocks, nb, p->table) != PRISM_OK) return;
    double t0 = prism_now_s();
    const int32_t *tables[1] = {p->table};
    int hidden = p->cfg.hidden, rc = PRISM_OK;
    for (int start = 0; start < r->n_tokens && rc == PRISM_OK; start += p->chunk) {
        int n = PRISM_MIN(p->chunk, r->n_tokens - start);
        bool any = false;
        memset(p->chunk_rows, 0, sizeof(*p->chunk_rows) * (size_t)n);
        for (int i = 0; i < r->n_images; i++) {
            const emb_slot_t *e = emb_find(p, r->seq.rid, r->seq.router_id, (uint32_t)i);
            int lo = PRISM_MAX((int)r->span_off[i], start);
            int hi = PRISM_MIN((int)(r->span_off[i] + r->span_len[i]), start + n);
            for (int t = lo; t < hi; t++) {
                p->chunk_rows[t - start] = e->data + (size_t)(t - r->span_off[i]) * hidden;  /* no copy */
                any = true;
            }
        }
        int32_t seq_start[2] = {0, n}, pos0[1] = {start};
        prism_llm_batch_t b = {
            .n_seqs = 1, .n_tokens = n, .tokens = r->tokens + start, .seq_start = seq_start, .pos0 = pos0,
            .block_tables = tables, .embed_rows = any ? p->chunk_rows : NULL,
        };
        rc = prism_llm_forward(p->llm, p->kv, &b, p->logits);
    }
    double t1 = prism_now_s();
    if (rc != PRISM_OK) {
        PRISM_ERROR("request %llu: prefill failed: %s", (unsigned long long)r->seq.rid, prism_strerror(rc));
        send_error(p, r->seq.router_id, r->seq.rid, "prefill failed");
        prism_kv_blocks_release(&p->blocks, p->table, nb);
        release_request(p, r->seq.rid, r->seq.router_id);
        return;
    }
    r->seq.len = r->n_tokens;
    int32_t tok = prism_seq_sample(&r->seq, &p->sampler, p->logits);

    Prism__Tokens t = PRISM__TOKENS__INIT;
    prism_seq_lp_msg_t lpm;
    prism_seq_tokens(&r->seq, &t, &tok, &lpm, &p->sampler, p->logits, &p->cfg, p->max_model_len);
    t.prefill_ms = (float)((t1 - t0) * 1e3);
    t.queue_ms = (float)((t0 - r->t_arrive) * 1e3);
    t.from_prefill = true;
    send_tokens(p, r->seq.router_id, r->seq.rid, &t);

    if (t.finish == PRISM__FINISH__FINISH_NONE) {
        /* Stage the KV export; the decode worker pulls it when it has room. */
        p->kv_len = (size_t)nb * p->block_bytes;
        prism_kv_cache_export(p->kv, p->table, nb, p->kv_out);
        prism__kv__init(&p->kv_hdr);
        p->kv_hdr.n_tokens = (uint32_t)r->n_tokens;
        p->kv_hdr.block_size = (uint32_t)p->blocks.block_size;
        p->kv_hdr.n_blocks = (uint32_t)nb;
        p->kv_hdr.block_bytes = p->block_bytes;
        p->kv_hdr.first_token = tok;
        p->kv_hdr.rng_state = r->seq.rng;
        p->kv_seq = r->seq;
        snprintf(p->kv_endpoint, sizeof(p->kv_endpoint), "%s", r->decode_endpoint);
        p->kv_pending = true;
    }
    prism_kv_blocks_release(&p->blocks, p->table, nb);
    release_request(p, r->seq.rid, r->seq.router_id);
    p->served++;
    PRISM_DEBUG("%d prompt tokens prefilled in %.1f ms", (int)t.prompt_tokens, t.prefill_ms);
    try_send_kv(p);
}

static void expire_orphans(prefill_t *p)
{
    double now = prism_now_s();
    for (int i = 0; i < p->n_emb; i++) {
        emb_slot_t *e = &p->emb[i];
        if (!e->used || now - e->t_arrive < p->orphan_timeout_s) continue;
        bool owned = false;
        for (int k = 0; k < p->max_pending; k++)
            owned |= owns(&p->reqs[k].seq, e->rid, e->router_id);
        if (!owned) {
            PRISM_WARN("dropping embeddings of request %llu: no prefill request came", (unsigned long long)e->rid);
            e->used = false;
        }
    }
}

int main(int argc, char **argv)
{
    prism_worker_opts_t o;
    prism_worker_opts_defaults(&o, "prefill");
    int64_t kv_blocks = 0, block_size = 16, chunk = 512, max_pending = 64, emb_images = 32, context_length = 0;
    double orphan_timeout = 120;
    prism_flag_t flags[32] = {
        PRISM_FLAG_INT("chunked-prefill-size", &chunk, "Most prompt tokens per forward step"),
        PRISM_FLAG_INT("kv-blocks", &kv_blocks, "KV blocks for prompts in flight (0 = two full contexts)"),
        PRISM_FLAG_INT("block-size", &block_size, "Tokens per KV block (must match the decode workers)"),
        PRISM_FLAG_INT("max-pending-requests", &max_pending, "Prefill requests held at once"),
        PRISM_FLAG_INT("embed-pool-images", &emb_images, "Image embedding slots in the receive pool"),
        PRISM_FLAG_INT("context-length", &context_length, "Max tokens per sequence (0 = model's max_position_embeddings)"),
        PRISM_FLAG_DOUBLE("orphan-timeout", &orphan_timeout,
                          "Seconds before embeddings whose prefill request never arrives free their slot"),
    };
    static prefill_t p;
    int rc = prism_worker_startup(argc, argv, "prefill", "Prism prefill worker: chunked prefill, first token, KV "
                                  "export to decode workers.", flags, &o, &p.cfg);
    if (rc >= 0) return rc;
    double t0 = prism_now_s();
    char err[512] = "";
    if (chunk < 1 || chunk > 65536 || block_size < 1 || block_size > 1024 || max_pending < 1 ||
        max_pending > 4096 || emb_images < 1 || emb_images > 65536 || !(orphan_timeout > 0)) {
        PRISM_ERROR("flag out of range (see --help)");
        return 2;
    }
    p.chunk = (int)chunk;
    p.orphan_timeout_s = orphan_timeout;
    p.max_pending = (int)max_pending;
    p.n_emb = p.cfg.has_vision ? (int)emb_images : 0;
    p.max_model_len = context_length > 0 ? (int)PRISM_MIN(context_length, (int64_t)p.cfg.max_pos) : p.cfg.max_pos;
    p.max_blocks_per_seq = (p.max_model_len + (int)block_size - 1) / (int)block_size;
    if (kv_blocks <= 0) kv_blocks = 2 * p.max_blocks_per_seq;
    if (kv_blocks < p.max_blocks_per_seq) {
        PRISM_ERROR("prefill: --kv-blocks %lld cannot hold one %d-token prompt (%d blocks)", (long long)kv_blocks,
                    p.max_model_len, p.max_blocks_per_seq);
        return 1;
    }

    if (prism_backend_create(o.device, (int)o.threads, 0, &p.be) != PRISM_OK) {
        PRISM_ERROR("cannot create backend '%s'", o.device);
        return 1;
    }
    if (prism_llm_load(p.be, &p.cfg, o.model_path, p.chunk, 1, &p.llm, err, sizeof(err)) != PRISM_OK) {
        PRISM_ERROR("cannot load language model: %s", err);
        return 1;
    }
    p.block_bytes = prism_kv_cache_block_bytes(&p.cfg, (int)block_size);
    size_t emb_bytes = (size_t)p.n_emb * p.cfg.image_seq_length * p.cfg.hidden * sizeof(float);
    prism_mem_plan_t plan = {.budget = (size_t)o.mem_budget};
    prism_mem_plan_add(&plan, "weights", prism_llm_weight_bytes(p.llm));
    prism_mem_plan_add(&plan, "kv-cache", (size_t)kv_blocks * p.block_bytes);
    prism_mem_plan_add(&plan, "kv-export", (size_t)p.max_blocks_per_seq * p.block_bytes);
    prism_mem_plan_add(&plan, "activations", prism_llm_arena_bytes(&p.cfg, p.chunk, 1) +
                                             (size_t)p.chunk * sizeof(*p.chunk_rows));
    prism_mem_plan_add(&plan, "embedding-pool", emb_bytes);
    prism_mem_plan_add(&plan, "prompts", (size_t)p.max_pending * p.max_model_len * sizeof(int32_t));
    prism_mem_plan_add(&plan, "runtime", prism_mem_runtime_bytes());
    prism_mem_plan_add(&plan, "reserve", PRISM_MEM_RESERVE);
    if (prism_mem_plan_check(&plan, "prefill") != PRISM_OK) return 1;

    if (prism_kv_cache_create(p.be, &p.cfg, (int)kv_blocks, (int)block_size, &p.kv) != PRISM_OK ||
        prism_kv_blocks_init(&p.blocks, (int)kv_blocks, (int)block_size) != PRISM_OK ||
        prism_sampler_init(&p.sampler, p.cfg.vocab) != PRISM_OK) {
        PRISM_ERROR("cannot allocate the prefill KV cache");
        return 1;
    }
    p.reqs = prism_xcalloc((size_t)p.max_pending, sizeof(preq_t));
    p.token_pool = prism_xcalloc((size_t)p.max_pending * p.max_model_len, sizeof(int32_t));
    for (int i = 0; i < p.max_pending; i++) p.reqs[i].tokens = p.token_pool + (size_t)i * p.max_model_len;
    p.emb = prism_xcalloc((size_t)PRISM_MAX(p.n_emb, 1), sizeof(emb_slot_t));
    p.emb_pool = prism_malloc_aligned(PRISM_MAX(emb_bytes, (size_t)64), 64);
    PRISM_ASSERT(p.emb_pool);
    for (int i = 0; i < p.n_emb; i++)
        p.emb[i].data = p.emb_pool + (size_t)i * p.cfg.image_seq_length * p.cfg.hidden;
    p.chunk_rows = prism_xcalloc((size_t)p.chunk, sizeof(*p.chunk_rows));
    p.table = prism_xcalloc((size_t)p.max_blocks_per_seq, sizeof(int32_t));
    p.logits = prism_xcalloc((size_t)p.cfg.vocab, sizeof(float));
    p.kv_out = prism_malloc_aligned((size_t)p.max_blocks_per_seq * p.block_bytes, 64);
    PRISM_ASSERT(p.kv_out);

    char bind[300];
    prism_worker_data_bind(&o, bind, sizeof(bind));
    if (prism_worker_init(&p.w, PRISM__ROLE__ROLE_PREFILL, &o, bind,
                          (size_t)p.cfg.image_seq_length * p.cfg.hidden * sizeof(float)) != PRISM_OK)
        return 1;
    prism_worker_set_capacity(&p.w, &o, &plan, (uint32_t)kv_blocks, (uint32_t)block_size, (uint32_t)p.chunk,
                              (uint32_t)p.max_pending, (uint32_t)p.max_model_len);
    PRISM_INFO("prefill worker %s ready in %.2fs: data %s, chunk %d tokens, %d embedding slots",
               p.w.worker_id, prism_now_s() - t0, p.w.data_endpoint, p.chunk, p.n_emb);

    while (!prism_worker_should_stop()) {
        int pending = 0;
        for (int i = 0; i < p.max_pending; i++) pending += p.reqs[i].seq.used;
        Prism__Heartbeat hb = PRISM__HEARTBEAT__INIT;
        hb.running = (uint32_t)pending;
        hb.waiting = p.kv_pending ? 1 : 0;
        hb.kv_free_blocks = (uint32_t)p.blocks.n_free;
        hb.mem_planned = prism_mem_plan_total(&plan);
        hb.pool_free = (uint32_t)emb_free_slots(&p);
        prism_worker_tick(&p.w, &hb);
        try_send_kv(&p);
        bool work = false;
        for (int i = 0; i < p.max_pending && !p.kv_pending; i++)
            work |= p.reqs[i].seq.used && ready(&p, &p.reqs[i]);
        prism_worker_poll(&p.w, work ? 0 : (p.kv_pending ? 2 : 50), emb_free_slots(&p) > 0, on_msg, &p);
        run_one(&p);
        expire_orphans(&p);
    }
    PRISM_INFO("prefill worker stopping after %llu requests", (unsigned long long)p.served);
    prism_worker_close(&p.w);
    return 0;
}
