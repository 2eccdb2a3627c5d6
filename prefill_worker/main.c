/* prefill_worker: runs the prompt through the language model, samples the first token (sent to
 * the router at once: that is TTFT), then ships the prompt's KV blocks to the decode worker the
 * router chose and frees its own copy.
 *
 * Image embeddings arrive straight from encoders on the data socket and land only in a fixed pool
 * of pages (one tile's rows each: a LLaVA image is one page, a Llama-4 image one page per tile),
 * sized for --embed-pool-images images of the largest kind. The data socket is read only while
 * the largest image would fit (or orphans may make room, or, the pool full, for the next piece of an
 * image arriving in pieces: emb_credit), so encoders wait when it would not (backpressure) —
 * nothing is buffered without bound. Embeddings and the Prefill request travel on
 * different sockets and may arrive in either order. The rows are laid, in order, over the image
 * tokens of the image's span (the <|patch|> positions of a Llama-4 tile layout), read in place from
 * the pool.
 *
 * Batched prefill (run_step): each forward carries the next chunks of up to --max-prefill-batch
 * prompts, at most --chunked-prefill-size tokens in all (the activation arena's size): first the
 * prompts already in the model, in the order they came in (the first gets a whole chunk, so none is
 * overtaken for ever), then ready prompts by priority and age while tokens are left; a prompt longer
 * than what is left is cut and goes on in the next forward (chunked prefill mixing short prompts
 * beside a long one's chunk). A prompt is admitted with all its blocks (its cached prefix held), so
 * the prompts in the model always finish. Those whose last chunk was in a forward get their first
 * token from their row of its logits; their KV leaves one at a time through one export staging,
 * and no forward runs while one waits for its decode worker (its flow control). Checks, errors and
 * aborts are per prompt: one refused or cancelled leaves the others in the batch going. The I/O
 * thread receives while a forward runs; an abort for a prompt in it drops that prompt between two
 * layers, or between two forwards. Models with chunked-attention layers (Llama-4) run one prompt a
 * forward; M-RoPE models (Qwen-VL) batch, each prompt with its own rotary positions.
 *
 * Tensor parallelism (--tp-size P > 1, tp/tp.h): rank 0 is the worker above; it sends every
 * other rank the plan of each forward (tokens, block tables, image embedding rows) and, once the prompt
 * is done, gathers their KV heads into the whole-model blocks a decode worker of any TP size takes.
 * The ranks have no I/O thread; every rank must run every forward it is sent (several prompts' chunks,
 * as the leader's), so a group stops an aborted prompt between two forwards (the leader leaves it
 * out of the next plan), not between two layers.
 * (Models with chunked-attention layers run at P = 1: their KV export has a layout of its own.) */
#include "core/core.h"
#include "core/cli.h"
#include "net/net.h"
#include "worker/worker.h"
#include "worker/start.h"
#include "seq/seq.h"
#include "worker/aborts.h"
#include "tp/tp.h"
#include "kv/kv.h"
#include "kv/prefix.h"
#include "sample/sample.h"
#include "backend/backend.h"
#include "model/model.h"
#include "image/llama4_proc.h"
#include "image/qwenvl_proc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_IMAGES 64
/* pages of one image: Llama-4 tiles, or pieces of a native-resolution image (the largest image
 * --max-image-tokens allows, in pages of PRISM_VISION_PIECE_ROWS rows: 64K tokens) */
#define MAX_PAGES PRISM_MAX(PRISM_LLAMA4_MAX_PATCHES + 1, 256)

typedef struct {
    bool used;
    uint64_t rid, rid_hi;    /* the request's 128-bit id, as its encoder named it */
    char router_id[128];
    uint32_t image_index;
    double t_arrive;
    int n_rows;
    int got_rows;             /* received so far (an image sent in pieces is ready when got_rows == n_rows) */
    double t_done;            /* when got_rows reached n_rows */
    int32_t pages[MAX_PAGES]; /* pool pages holding rows [k * page_rows, (k + 1) * page_rows) */
} emb_slot_t;

typedef struct {
    prism_seq_t seq;         /* owner, sampling, RNG; seq.used marks the slot */
    int32_t *tokens;         /* [max_model_len] slice of the token pool */
    int n_tokens;
    int n_images;
    uint32_t span_off[MAX_IMAGES], span_len[MAX_IMAGES];
    int span_rows[MAX_IMAGES];   /* image-token positions in each span: the rows it needs */
    prism_mrope_image_t mrope[MAX_IMAGES];   /* M-RoPE models: the spans' LM-token grids */
    prism_kv_image_t key_img[MAX_IMAGES];    /* the images as the prefix cache's keys see them */
    bool img_cached[MAX_IMAGES];             /* ImageSpan.cached: no embeddings come, the cache must cover it */
    prism_kv_key_t *keys;    /* [max_blocks_per_seq] slice of the key pool: Prefill.block_keys */
    int n_keys;              /* 0: none came (this worker computes them) */
    char salt[PRISM_KV_PREFIX_MAX_SALT + 1];  /* Prefill.cache_salt */
    char decode_endpoint[256];
    double t_arrive;
    bool in_model;           /* admitted: a prun_t holds its blocks */
} preq_t;

/* A prompt in the model (batched prefill): admitted with its blocks, its chunks riding in forwards
 * beside other prompts' until its last; then, when decode takes its KV, it holds its blocks until
 * the export staging (which holds one prompt) is free for it. */
typedef struct {
    preq_t *r;
    int32_t *table;          /* [max_blocks_per_seq] slice of run_tables: its blocks */
    prism_kv_key_t *keys;    /* [max_blocks_per_seq] slice of run_keys: its blocks' keys (prefix cache on) */
    int nb, n_full, hit;     /* blocks held; full blocks kept after it; leading blocks the cache had */
    int done;                /* positions in the cache: its next chunk starts here */
    int take;                /* tokens of it in the forward being packed */
    int next_row[MAX_IMAGES];   /* rows of each image laid so far (its chunks go in order) */
    double t0, t_embedded;   /* its first forward; when its last image's last rows came (<= t0) */
    bool dropped;            /* aborted inside a forward (hook_cancelled) */
    bool export_wait;        /* computed and answered: its KV waits for the export staging */
} prun_t;

typedef struct {
    struct {                      /* the tier's flags */
        int64_t kv_blocks, block_size, chunk, max_pending, emb_images, context_length, max_image_tokens, max_batch;
        double orphan_timeout;
        bool no_prefix_cache;
        const char *kv_wire;      /* --kv-transfer-dtype */
    } f;
    prism_worker_t w;
    prism_model_config_t cfg;     /* this rank's (sharded) shapes */
    prism_model_config_t full;    /* the whole model's: the KV layout sent to decode */
    prism_tp_t tp;
    bool group_failed;
    prism_backend_t *be;
    prism_llm_t *llm;
    prism_kv_cache_t *kv;
    prism_kv_blocks_t blocks;
    /* Full blocks of finished prompts kept for later ones (kv/prefix.h): they live in the blocks
     * above, which are free to hold them while no prompt needs them (a prompt evicts what it needs). */
    bool prefix_on;
    prism_kv_prefix_t prefix;
    prism_kv_key_t *key_pool; /* [max_pending][max_blocks_per_seq] the router's keys of each prompt */
    uint64_t prefix_misses;  /* prompts refused: an image the router left unencoded was no longer cached */
    /* test hook PRISM_TEST_PREFIX_EVICT_ON_ARRIVAL: a Prefill with an image marked cached finds the
     * cache emptied first, as if prompts run in between had evicted it (the skip's race, on demand) */
    bool test_evict_on_arrival;
    uint64_t registrations_seen;   /* w.registrations at the last resync of the routers' indexes */
    uint64_t cache_queries, cache_hits, tokens_computed;   /* prompt tokens (heartbeat counters) */
    prism_seq_sampler_t sampler;  /* one slot: a prompt is attached to it just before its first token */
    size_t sampling_bytes;        /* what the sampler took at start-up (measured into the plan) */
    int max_pending, chunk, max_model_len, max_blocks_per_seq;
    int page_rows, max_pages;    /* rows per pool page (one tile), pages of the largest image */
    int n_pages, n_free_pages;   /* embedding pool; an image slot per page at most */
    double orphan_timeout_s; /* embeddings whose Prefill never came are dropped after this */
    preq_t *reqs;            /* [max_pending] */
    int32_t *token_pool;     /* [max_pending][max_model_len] */
    emb_slot_t *emb;         /* [n_pages] */
    int row;                 /* floats of an embedding row: hidden (Qwen3-VL: x (1 + DeepStack levels)) */
    float *emb_pool;         /* [n_pages][page_rows][row] */
    int32_t *free_pages;     /* [n_pages] stack */
    /* Batched prefill: up to max_batch prompts in the model at once, their next chunks packed into
     * one forward of at most `chunk` tokens (the activation arena's size), those admitted first
     * first: the first always gets a whole chunk, so nothing is overtaken for ever. */
    int max_batch;
    prun_t *run;             /* [max_batch] the prompts in the model, in the order they were admitted */
    int n_run;
    int32_t *run_tables;     /* [max_batch][max_blocks_per_seq] */
    prism_kv_key_t *run_keys; /* [max_batch][max_blocks_per_seq] (prefix cache on) */
    int32_t *chunk_tokens;   /* [chunk] the forward's tokens, prompt after prompt */
    const float **chunk_rows; /* [chunk]: image embedding row of each token, or NULL */
    int32_t *chunk_pos;      /* M-RoPE models: [3][chunk] rotary positions of the forward's tokens */
    int32_t *seq_start;      /* [max_batch + 1] */
    int32_t *pos0;           /* [max_batch] */
    const int32_t **tables;  /* [max_batch] */
    float *logits;           /* [max_batch][vocab]: the last token of each prompt of a forward */
    uint64_t forwards, forward_prompts;   /* heartbeat counters: forwards, the prompts they carried */
    uint32_t batch_peak;     /* the most prompts one forward carried */
    uint8_t *kv_out;         /* [max_blocks_per_seq][block_bytes]: export staging (holds the transfer, which
                              * for chunked-attention models is smaller: Kv in prism.proto) */
    size_t block_bytes;      /* one block of the whole model (what decode receives) */
    /* a finished prefill whose KV the decode worker has not taken yet (its request's slot is
     * already free for the next one: kv_seq is a copy of the record) */
    bool kv_pending;
    prism_seq_t kv_seq;
    int32_t *kv_prompt;      /* [max_model_len] its prompt ids, when a penalty needs them in decode */
    char kv_endpoint[256];
    Prism__Kv kv_hdr;
    size_t kv_len;           /* the transfer's bytes in kv_out, as sent (wire) */
    prism_kv_wire_t wire;    /* the element type it sends (--kv-transfer-dtype) */
    uint64_t kv_sent_bytes;  /* frame bytes sent (heartbeat kv_sent_bytes) */
    int kv_next;             /* its first block (frame order) not sent yet: it goes in pieces (kv/kv.h) */
    double kv_gap_s;         /* test hook PRISM_TEST_KV_PIECE_GAP_S: a pause between two pieces (0: none) */
    double kv_not_before;    /* the next piece goes no sooner (the hook) */
    double fwd_gap_s;        /* test hook PRISM_TEST_PREFILL_FORWARD_GAP_S: a pause between two forwards (0: none) */
    double fwd_not_before;   /* the next forward goes no sooner (the hook: prompts meet in one batch) */
    bool in_forward;         /* run[0..n_fwd) are the items of the forward running now (hook_cancelled) */
    int n_fwd;
    prism_model_hook_t hook;
    uint64_t served, cancelled;
    prism_abort_memo_t aborts;   /* aborted requests: their embeddings still on the way are dropped */
    /* Requests whose embeddings were dropped before their Prefill came (refused by a full pool,
     * evicted or expired orphans): that Prefill gets a 503 at once, not a wait for images that
     * never come; their later embeddings are dropped as an aborted request's. */
    prism_abort_memo_t lost;
    double stall_since;          /* the pool full with no prompt able to go on since then (0: not) */
    uint64_t pool_deadlocks;     /* prompts failed to break such a stall (pool_break) */
} prefill_t;

/* Images of the largest kind the pool can still take (what the heartbeat reports and what gates
 * reading the data socket). */
static int emb_room(const prefill_t *p)
{
    return p->max_pages ? p->n_free_pages / p->max_pages : 0;
}

/* An image whose pieces are still arriving (its pages are reserved: its next piece always fits). */
static bool emb_partial(const prefill_t *p)
{
    for (int i = 0; i < p->n_pages; i++)
        if (p->emb[i].used && p->emb[i].got_rows < p->emb[i].n_rows) return true;
    return false;
}

static const float *emb_row(const prefill_t *p, const emb_slot_t *e, int k)
{
    return p->emb_pool + ((size_t)e->pages[k / p->page_rows] * p->page_rows + (size_t)(k % p->page_rows)) * p->row;
}

static int emb_pages(const prefill_t *p, const emb_slot_t *e) { return (e->n_rows + p->page_rows - 1) / p->page_rows; }

static void emb_release(prefill_t *p, emb_slot_t *e)
{
    for (int k = 0; k < emb_pages(p, e); k++) p->free_pages[p->n_free_pages++] = e->pages[k];
    e->used = false;
    e->n_rows = e->got_rows = 0;
}

static emb_slot_t *emb_find(prefill_t *p, uint64_t rid, uint64_t rid_hi, const char *router, uint32_t index)
{
    for (int i = 0; i < p->n_pages; i++) {
        emb_slot_t *e = &p->emb[i];
        if (e->used && e->rid == rid && e->rid_hi == rid_hi && e->image_index == index && !strcmp(e->router_id, router))
            return e;
    }
    return NULL;
}

/* By the low half of the id (the router keeps those unique among its requests in flight): Aborts
 * name only that, and data messages are checked for the whole id first (on_embeddings). */
static bool owns(const prism_seq_t *s, uint64_t rid, const char *router)
{
    return s->used && s->rid == rid && !strcmp(s->router_id, router);
}

/* The request (rid, router) this prefill holds, or NULL. */
static preq_t *held_request(prefill_t *p, uint64_t rid, const char *router)
{
    for (int i = 0; i < p->max_pending; i++)
        if (owns(&p->reqs[i].seq, rid, router)) return &p->reqs[i];
    return NULL;
}

/* Embeddings whose Prefill has not come (yet): legitimately early ones, or junk for made-up ids
 * from a peer holding an encoder key. */
static bool emb_orphan(const prefill_t *p, const emb_slot_t *e)
{
    for (int k = 0; k < p->max_pending; k++)
        if (owns(&p->reqs[k].seq, e->rid, e->router_id) && p->reqs[k].seq.rid_hi == e->rid_hi) return false;
    return true;
}

/* The oldest orphan, and the pages orphans hold. */
static emb_slot_t *emb_oldest_orphan(const prefill_t *p, int *orphan_pages)
{
    const emb_slot_t *oldest = NULL;
    *orphan_pages = 0;
    for (int i = 0; i < p->n_pages; i++) {
        const emb_slot_t *e = &p->emb[i];
        if (!e->used || !emb_orphan(p, e)) continue;
        *orphan_pages += emb_pages(p, e);
        if (!oldest || e->t_arrive < oldest->t_arrive) oldest = e;
    }
    return (emb_slot_t *)oldest;
}

/* Orphans may hold at most half the pool's pages: past that the oldest ones make room for new
 * embeddings, so junk cannot lock every image request out until --orphan-timeout. NULL when none
 * may go. */
static emb_slot_t *emb_evictable(const prefill_t *p)
{
    int n;
    emb_slot_t *oldest = emb_oldest_orphan(p, &n);
    return 2 * n >= p->n_pages ? oldest : NULL;
}

/* A request's embeddings are dropped before its Prefill came (refused, evicted or expired orphans):
 * all of them (by the whole id: a guess at a held request's low half touches nothing of it) go, and
 * unless a request of that low half is held (one with another high half), its later embeddings too
 * and its Prefill is answered with a 503 (on_prefill). */
static void emb_lost(prefill_t *p, uint64_t rid, uint64_t rid_hi, const char *router)
{
    char r[sizeof(p->emb[0].router_id)];
    snprintf(r, sizeof(r), "%s", router);   /* router may live in a slot freed below */
    for (int i = 0; i < p->n_pages; i++)
        if (p->emb[i].used && p->emb[i].rid == rid && p->emb[i].rid_hi == rid_hi && !strcmp(p->emb[i].router_id, r))
            emb_release(p, &p->emb[i]);
    if (!held_request(p, rid, r)) prism_abort_memo_add(&p->lost, rid, r, prism_now_s());
}

/* Embedding messages the pool can take now: images of the largest kind that fit in its free pages,
 * or one when orphans may make room (on_embeddings evicts the oldest until the message fits). */
static int emb_credit(const prefill_t *p)
{
    int n = emb_room(p);
    /* An image arriving in pieces holds its pages already: when the pool is full one message is
     * still taken, so its next piece cannot wait behind a full pool (which only its completion would
     * empty). Only then, and never on top of the room: a credit that the room does not cover is
     * safe only while the next message is that image's next piece, which an encoder keeps so by
     * sending an image's pieces back to back (encoder_worker: flush_batch). A new image's first
     * piece that does not fit is refused (on_embeddings): with two encoders, one's first piece
     * taken on this credit while the other's image is partial. */
    if (n == 0 && emb_partial(p)) n = 1;
    return n > 0 ? n : emb_evictable(p) != NULL;
}

/* Takes a prompt out of the model: its blocks go back (the prefix cache keeps what it kept), its
 * slices of the run tables move to the end with its record, the others keep their order. Never
 * inside a forward (its items are run[0..n_fwd)). */
static void run_remove(prefill_t *p, preq_t *r)
{
    PRISM_ASSERT(!p->in_forward);
    int i = 0;
    while (i < p->n_run && p->run[i].r != r) i++;
    PRISM_ASSERT(i < p->n_run);
    prun_t x = p->run[i];
    prism_kv_blocks_release(&p->blocks, x.table, x.nb);
    memmove(&p->run[i], &p->run[i + 1], sizeof(*p->run) * (size_t)(p->n_run - i - 1));
    p->n_run--;
    p->run[p->n_run] = (prun_t){.table = x.table, .keys = x.keys};
    r->in_model = false;
}

/* Frees one request's slot, its blocks when it is in the model, and its embedding slots unless
 * another slot holds the same id (a peer's duplicate Prefill: it must not pull the rows or blocks
 * from under a prompt in the model). What the batch's own paths use: only this prompt goes. */
static void release_req(prefill_t *p, preq_t *r)
{
    bool shared = false;
    for (int i = 0; i < p->max_pending; i++)
        shared |= &p->reqs[i] != r && owns(&p->reqs[i].seq, r->seq.rid, r->seq.router_id);
    for (int i = 0; i < p->n_pages && !shared; i++)
        if (p->emb[i].used && p->emb[i].rid == r->seq.rid && !strcmp(p->emb[i].router_id, r->seq.router_id))
            emb_release(p, &p->emb[i]);
    if (r->in_model) run_remove(p, r);
    prism_seq_detach(&r->seq);
    r->seq.used = false;
}

/* An abort for a prompt in the model between two forwards (the Abort message, or the I/O thread's
 * table first): it leaves now, counted. */
static void leave_mid_prompt(prefill_t *p, preq_t *r)
{
    int done = 0;
    for (int i = 0; i < p->n_run; i++)
        if (p->run[i].r == r) done = p->run[i].done;
    if (!prism_worker_should_stop())
        PRISM_INFO("request %llu: cancelled after %d of %d prompt tokens (%s): prefill stopped",
                   (unsigned long long)r->seq.rid, done, r->n_tokens,
                   p->tp.size > 1 ? "tensor-parallel group: between chunks" : "between forwards");
    release_req(p, r);
    p->cancelled++;
}

/* Frees a request's slot, its blocks when it is in the model, and its embedding slots (done,
 * failed or aborted). */
static void release_request(prefill_t *p, uint64_t rid, const char *router)
{
    for (int i = 0; i < p->n_pages; i++)
        if (p->emb[i].used && p->emb[i].rid == rid && !strcmp(p->emb[i].router_id, router))
            emb_release(p, &p->emb[i]);
    for (int i = 0; i < p->max_pending; i++)
        if (owns(&p->reqs[i].seq, rid, router)) release_req(p, &p->reqs[i]);
}

/* The staged KV export is gone (sent, failed or dropped). */
static void kv_done(prefill_t *p)
{
    p->kv_pending = false;
    prism_seq_detach(&p->kv_seq);
}

/* Forgets everything about a request, its staged KV export included (abort, errors). */
static void drop_request(prefill_t *p, uint64_t rid, const char *router)
{
    release_request(p, rid, router);
    if (p->kv_pending && owns(&p->kv_seq, rid, router)) kv_done(p);
}

static void send_tokens(prefill_t *p, const char *router, uint64_t rid, uint64_t rid_hi, Prism__Tokens *t)
{
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_TOKENS;
    env.tokens = t;
    prism_worker_reply(&p->w, router, rid, rid_hi, &env);
}

static void send_error(prefill_t *p, const char *router, uint64_t rid, uint64_t rid_hi, Prism__ErrorKind kind,
                       const char *msg)
{
    prism_worker_reply_error(&p->w, router, rid, rid_hi, kind, msg, true);
}

/* Pool pages a prompt's images need to be sure to arrive (on_prefill checked its spans): the data
 * socket is read only while an image of the largest kind fits, so before its last image comes the
 * others may hold their pages and that much must still be free. The last to come is at worst the
 * smallest: all but it, plus the largest kind. Images the prefix cache covers need none. */
/* Image-token rows of a span of a prompt: the embedding rows its image fills (separators keep
 * their own embedding). */
static int span_image_rows(const prefill_t *p, const int32_t *tokens, uint32_t off, uint32_t n)
{
    int rows = 0;
    for (uint32_t t = off; t < off + n; t++) rows += tokens[t] == p->cfg.image_token_index;
    return rows;
}

static int emb_pool_need(const prefill_t *p, const Prism__Prefill *pf)
{
    int sum = 0, least = 0, n = 0;
    for (size_t i = 0; i < pf->n_images; i++) {
        const Prism__ImageSpan *s = pf->images[i];
        if (s->cached) continue;
        int rows = span_image_rows(p, pf->token_ids, s->offset, s->n_tokens);
        int pages = (rows + p->page_rows - 1) / p->page_rows;
        sum += pages;
        least = n++ ? PRISM_MIN(least, pages) : pages;
    }
    return n < 2 ? 0 : sum - least + p->max_pages;
}

static void on_prefill(prefill_t *p, const Prism__Envelope *e)
{
    const Prism__Prefill *pf = e->prefill;
    const char *router = e->router_id ? e->router_id : "";
    const char *why = NULL;
    if (!pf || !pf->sampling || !pf->decode_endpoint) why = "malformed prefill request";
    else if (pf->n_token_ids == 0 || pf->n_token_ids >= (size_t)p->max_model_len) why = "prompt length out of range";
    else if (pf->n_images > MAX_IMAGES) why = "too many images";
    else if (pf->cache_salt && strlen(pf->cache_salt) > PRISM_KV_PREFIX_MAX_SALT) why = "cache salt too long";
    /* the router's keys: one per full block, exactly (a count from elsewhere would index past the prompt) */
    else if (pf->block_keys.len &&
             pf->block_keys.len != (pf->n_token_ids / (size_t)p->f.block_size) * PRISM_KV_PREFIX_KEY_BYTES)
        why = "block keys do not match the prompt's full blocks";
    else why = prism_seq_check(pf->sampling, p->cfg.vocab, p->max_model_len);
    /* a migrated request: prompt + the tokens generated before (the last Sampling.generated ids) */
    if (!why && pf->sampling->generated >= pf->n_token_ids) why = "generated tokens out of range";
    if (!why) {
        for (size_t i = 0; i < pf->n_token_ids; i++)
            if (pf->token_ids[i] < 0 || pf->token_ids[i] >= p->cfg.vocab) { why = "token id out of range"; break; }
        uint64_t prev_end = 0;
        for (size_t i = 0; i < pf->n_images && !why; i++) {
            const Prism__ImageSpan *s = pf->images[i];
            if (!p->n_pages || s->n_tokens == 0 || (uint64_t)s->offset + s->n_tokens > pf->n_token_ids ||
                s->offset < prev_end) {
                why = "image span out of range";
                break;
            }
            prev_end = (uint64_t)s->offset + s->n_tokens;
            int rows = span_image_rows(p, pf->token_ids, s->offset, s->n_tokens);
            if (rows == 0 || rows > p->max_pages * p->page_rows) why = "image span holds no image tokens, or too many";
            /* M-RoPE: the span is the image's pads exactly, rows x cols of them */
            else if (prism_model_mrope(&p->cfg) &&
                     ((uint64_t)s->grid_rows * s->grid_cols != s->n_tokens || (uint32_t)rows != s->n_tokens))
                why = "image span does not match its grid";
        }
    }
    preq_t *r = NULL;
    for (int i = 0; i < p->max_pending && !why; i++)
        if (!p->reqs[i].seq.used) { r = &p->reqs[i]; break; }
    Prism__ErrorKind kind = PRISM__ERROR_KIND__ERROR_INTERNAL;   /* the router checked all this: a bad message */
    if (!why && !r) {
        why = "prefill worker is full";
        kind = PRISM__ERROR_KIND__ERROR_OVERLOAD;
    }
    if (why) {
        PRISM_WARN("request %llu refused: %s", (unsigned long long)e->request_id, why);
        send_error(p, router, e->request_id, e->request_id_hi, kind, why);
        drop_request(p, e->request_id, router);
        return;
    }
    char msg[256];
    if (prism_abort_memo_has(&p->lost, e->request_id, router, prism_now_s())) {
        /* an image of it was dropped before this came: it would wait for ever */
        PRISM_WARN("request %llu refused: its image embeddings were dropped before it came (pool full, or orphans "
                   "timed out)", (unsigned long long)e->request_id);
        send_error(p, router, e->request_id, e->request_id_hi, PRISM__ERROR_KIND__ERROR_OVERLOAD,
                   "prefill embedding pool is full: this request's image embeddings were dropped; retry after a short wait");
        drop_request(p, e->request_id, router);
        return;
    }
    int need = emb_pool_need(p, pf);
    if (need > p->n_pages) {
        /* More pages than the whole pool: its images would wait for ever for room its own others hold. */
        snprintf(msg, sizeof(msg), "The prompt's %zu images need more of the prefill's image embedding pool than it holds "
                 "(%d of %d pages; --embed-pool-images %d); send fewer or smaller images in one prompt.",
                 pf->n_images, need, p->n_pages, p->max_pages ? p->n_pages / p->max_pages : 0);
        PRISM_WARN("request %llu refused: %s", (unsigned long long)e->request_id, msg);
        send_error(p, router, e->request_id, e->request_id_hi, PRISM__ERROR_KIND__ERROR_CLIENT, msg);
        drop_request(p, e->request_id, router);
        prism_abort_memo_add(&p->aborts, e->request_id, router, prism_now_s());   /* its embeddings on the way */
        return;
    }
    why = prism_seq_start(&r->seq, &p->sampler, e->request_id, router, pf->sampling,
                          (int)(pf->n_token_ids - pf->sampling->generated), prism_seq_seed(pf->sampling, e->request_id));
    if (why) {
        PRISM_WARN("request %llu refused: %s", (unsigned long long)e->request_id, why);
        send_error(p, router, e->request_id, e->request_id_hi, PRISM__ERROR_KIND__ERROR_CLIENT, why);   /* its guide or logit_bias */
        drop_request(p, e->request_id, router);
        return;
    }
    r->seq.rid_hi = e->request_id_hi;
    r->seq.trace = (prism_trace_id_t){e->trace_id_hi, e->trace_id_lo};
    r->n_tokens = (int)pf->n_token_ids;
    memcpy(r->tokens, pf->token_ids, sizeof(int32_t) * pf->n_token_ids);
    r->n_images = (int)pf->n_images;
    for (int i = 0; i < r->n_images; i++) {
        r->span_off[i] = pf->images[i]->offset;
        r->span_len[i] = pf->images[i]->n_tokens;
        r->span_rows[i] = span_image_rows(p, r->tokens, r->span_off[i], r->span_len[i]);
        r->mrope[i] = (prism_mrope_image_t){(int32_t)pf->images[i]->offset, (int32_t)pf->images[i]->grid_rows,
                                            (int32_t)pf->images[i]->grid_cols};
        r->key_img[i] = (prism_kv_image_t){pf->images[i]->offset, pf->images[i]->n_tokens, pf->images[i]->grid_rows,
                                           pf->images[i]->grid_cols, pf->images[i]->content_hash};
        r->img_cached[i] = pf->images[i]->cached;
    }
    r->n_keys = p->prefix_on ? (int)(pf->block_keys.len / PRISM_KV_PREFIX_KEY_BYTES) : 0;
    bool any_cached = false;
    for (int i = 0; i < r->n_images; i++) any_cached |= r->img_cached[i];
    if (p->test_evict_on_arrival && p->prefix_on && any_cached)
        PRISM_WARN("test hook: prefix cache emptied on the arrival of request %llu (%d blocks)",
                   (unsigned long long)e->request_id, prism_kv_prefix_clear(&p->prefix));
    if (r->n_keys) prism_kv_prefix_keys_get(pf->block_keys.data, r->n_keys, r->keys);
    snprintf(r->salt, sizeof(r->salt), "%s", pf->cache_salt ? pf->cache_salt : "");
    snprintf(r->decode_endpoint, sizeof(r->decode_endpoint), "%s", pf->decode_endpoint);
    r->t_arrive = prism_now_s();
    r->in_model = false;
}

/* The frames' bytes, in order, into the slot's pages from byte `at` of the image (frames may split
 * rows anywhere). */
static void emb_copy_frames(prefill_t *p, const emb_slot_t *s, prism_msg_t *m, size_t at)
{
    size_t page_bytes = (size_t)p->page_rows * p->row * sizeof(float);
    for (int f = 0; f < m->n_frames; f++) {
        size_t len = 0;
        const uint8_t *src = prism_msg_frame(m, f, &len);
        while (len) {
            size_t pg = at / page_bytes, off = at % page_bytes, n = PRISM_MIN(len, page_bytes - off);
            memcpy((uint8_t *)(p->emb_pool + (size_t)s->pages[pg] * p->page_rows * p->row) + off, src, n);
            src += n;
            len -= n;
            at += n;
        }
    }
}

static void on_embeddings(prefill_t *p, prism_msg_t *m)
{
    const Prism__Envelope *e = m->env;
    const Prism__Embeddings *em = e->embeddings;
    const char *router = e->router_id ? e->router_id : "";
    if (prism_abort_memo_has(&p->aborts, e->request_id, router, prism_now_s())) return;  /* came after its abort */
    if (prism_abort_memo_has(&p->lost, e->request_id, router, prism_now_s())) return;    /* an image of it was dropped */
    /* Only the encoder the router chose knows the whole id: embeddings naming a request held here by
     * its low half alone are someone else's guess, and touch nothing of it. */
    preq_t *held = held_request(p, e->request_id, router);
    if (held && held->seq.rid_hi != e->request_id_hi) {
        PRISM_WARN("request %llu: embeddings with the wrong high half of its id dropped", (unsigned long long)e->request_id);
        return;
    }
    if (em && em->error && *em->error) {
        /* The encoder failed on this image; the router answers the client and aborts. */
        drop_request(p, e->request_id, router);
        return;
    }
    size_t row_bytes = (size_t)p->row * sizeof(float), got = 0;
    for (int f = 0; f < m->n_frames; f++) {
        size_t len = 0;
        prism_msg_frame(m, f, &len);
        got += len;
    }
    /* Native-resolution images come in pieces (total_tokens > 0), of any size, in order; the others
     * whole, a whole number of pages (tiles). */
    const bool pieces = em && em->total_tokens > 0;
    uint32_t total = pieces ? em->total_tokens : em ? em->n_tokens : 0;
    if (!em || !p->n_pages || em->hidden != (uint32_t)p->row || em->image_index >= MAX_IMAGES || em->n_tokens == 0 ||
        (!pieces && em->n_tokens % (uint32_t)p->page_rows) ||
        (uint64_t)total > (uint64_t)p->max_pages * (uint32_t)p->page_rows ||
        (pieces && ((uint64_t)em->row_offset + em->n_tokens > total || em->n_tokens > PRISM_VISION_PIECE_ROWS)) ||
        got != (size_t)em->n_tokens * row_bytes) {
        PRISM_WARN("request %llu: malformed embeddings dropped", (unsigned long long)e->request_id);
        send_error(p, router, e->request_id, e->request_id_hi, PRISM__ERROR_KIND__ERROR_INTERNAL, "malformed image embeddings");
        drop_request(p, e->request_id, router);
        return;
    }
    emb_slot_t *s = emb_find(p, e->request_id, e->request_id_hi, router, em->image_index);
    if (s && pieces && s->got_rows < s->n_rows) {
        /* the next piece of an image arriving in pieces: its pages are reserved */
        if ((uint32_t)s->n_rows != total || em->row_offset != (uint32_t)s->got_rows) {
            PRISM_WARN("request %llu: image %u: piece out of order", (unsigned long long)e->request_id, em->image_index);
            send_error(p, router, e->request_id, e->request_id_hi, PRISM__ERROR_KIND__ERROR_INTERNAL,
                       "malformed image embeddings");
            drop_request(p, e->request_id, router);
            return;
        }
        emb_copy_frames(p, s, m, (size_t)em->row_offset * row_bytes);
        s->got_rows += (int)em->n_tokens;
        if (s->got_rows == s->n_rows) s->t_done = prism_now_s();
        return;
    }
    if (s) return;  /* duplicate */
    if (pieces && em->row_offset != 0) {
        PRISM_WARN("request %llu: image %u: a piece without its first", (unsigned long long)e->request_id, em->image_index);
        if (!held) prism_abort_memo_add(&p->lost, e->request_id, router, prism_now_s());
        return;   /* the rest of an image whose first piece was refused or dropped */
    }
    int n_pages = (int)((total + (uint32_t)p->page_rows - 1) / (uint32_t)p->page_rows);
    /* The I/O thread hands data over only within emb_credit: while the largest image fits, or orphans
     * hold half the pool. The oldest orphans make room (a Prefill read in the same poll may have
     * adopted those that made it: then any orphan goes); with none left the message is refused. */
    while (p->n_free_pages < n_pages) {
        int n;
        emb_slot_t *old = emb_oldest_orphan(p, &n);
        if (!old) {
            PRISM_WARN("request %llu: embeddings refused, the pool is full", (unsigned long long)e->request_id);
            if (held) {
                send_error(p, router, e->request_id, e->request_id_hi, PRISM__ERROR_KIND__ERROR_OVERLOAD,
                           "prefill embedding pool is full");
                drop_request(p, e->request_id, router);
            } else {
                emb_lost(p, e->request_id, e->request_id_hi, router);   /* its Prefill, when it comes, gets the 503 */
            }
            return;
        }
        PRISM_WARN("dropping embeddings of request %llu: no prefill request came, and orphans fill the pool",
                   (unsigned long long)old->rid);
        emb_lost(p, old->rid, old->rid_hi, old->router_id);
    }
    for (int i = 0; i < p->n_pages && !s; i++)
        if (!p->emb[i].used) s = &p->emb[i];
    PRISM_ASSERT(s);
    s->used = true;
    s->rid = e->request_id;
    s->rid_hi = e->request_id_hi;
    snprintf(s->router_id, sizeof(s->router_id), "%s", router);
    s->image_index = em->image_index;
    s->t_arrive = prism_now_s();
    s->n_rows = (int)total;
    s->got_rows = (int)em->n_tokens;
    s->t_done = s->t_arrive;
    for (int k = 0; k < n_pages; k++) s->pages[k] = p->free_pages[--p->n_free_pages];
    emb_copy_frames(p, s, m, 0);
}

static void on_msg(prism_worker_t *w, prism_msg_t *m, int source, void *ud)
{
    prefill_t *p = ud;
    /* Prefill and Abort come from routers only, embeddings from encoders only (the data socket
     * admits encoder keys alone): an encoder's key does not let it start or cancel requests. */
    bool from_router = source >= 0;
    switch (m->env->type) {
    case PRISM__MSG_TYPE__MSG_PREFILL:
        if (from_router) on_prefill(p, m->env);
        break;
    case PRISM__MSG_TYPE__MSG_EMBEDDINGS:
        if (!from_router) on_embeddings(p, m);
        break;
    case PRISM__MSG_TYPE__MSG_ABORT:
        if (from_router) {
            const char *router = m->env->router_id ? m->env->router_id : "";
            preq_t *r = held_request(p, m->env->request_id, router);
            if (r && r->in_model) leave_mid_prompt(p, r);   /* its blocks go back now */
            drop_request(p, m->env->request_id, router);
            prism_abort_memo_add(&p->aborts, m->env->request_id, router, prism_now_s());
        }
        break;
    default:
        PRISM_WARN("unexpected message type %d", m->env->type);
    }
}

static bool ready(prefill_t *p, const preq_t *r)
{
    for (int i = 0; i < r->n_images; i++) {
        if (r->img_cached[i]) continue;   /* its KV is in the prefix cache: no embeddings come */
        const emb_slot_t *e = emb_find(p, r->seq.rid, r->seq.rid_hi, r->seq.router_id, (uint32_t)i);
        if (!e || e->got_rows < e->n_rows) return false;
    }
    return true;
}

static void try_send_kv(prefill_t *p)
{
    if (!p->kv_pending || (p->kv_gap_s > 0 && prism_now_s() < p->kv_not_before)) return;
    prism_seq_t *q = &p->kv_seq;
    void *s = prism_worker_peer_sock(&p->w, p->kv_endpoint);
    if (!s) {
        send_error(p, q->router_id, q->rid, q->rid_hi, PRISM__ERROR_KIND__ERROR_UNAVAILABLE, "cannot reach the decode worker");
        kv_done(p);
        return;
    }
    p->kv_hdr.sampling = (Prism__Sampling *)prism_seq_sampling(q);   /* as the router sent it */
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_KV;
    env.request_id = q->rid;
    env.request_id_hi = q->rid_hi;
    env.trace_id_hi = q->trace.hi;
    env.trace_id_lo = q->trace.lo;
    env.router_id = q->router_id;
    /* In pieces of at most prism_kv_piece_blocks blocks, in order: the first with the header, the
     * others with their place only (decode copies each into its blocks as it comes). */
    int nb = (int)p->kv_hdr.n_blocks, total = 2 * nb - (int)p->kv_hdr.local_first_block;
    size_t fbb = p->kv_hdr.block_bytes, lbb = p->kv_hdr.local_block_bytes;
    int per = prism_kv_piece_blocks(PRISM_MAX(fbb, lbb));
    while (p->kv_next < total) {
        int first = p->kv_next, n = PRISM_MIN(per, total - first);
        Prism__Kv piece = PRISM__KV__INIT;
        Prism__Kv *kv = first ? &piece : &p->kv_hdr;
        kv->piece_first = (uint32_t)first;
        kv->piece_blocks = (uint32_t)n;
        env.kv = kv;
        size_t off = prism_kv_piece_offset(nb, fbb, lbb, first);
        prism_frame_t f = {p->kv_out + off, prism_kv_piece_offset(nb, fbb, lbb, first + n) - off};
        int rc = prism_msg_send(s, NULL, 0, &env, &f, 1, ZMQ_DONTWAIT);
        if (rc == PRISM_EAGAIN) return;  /* decode is full: keep the rest and retry next iteration */
        if (rc != PRISM_OK) {
            send_error(p, q->router_id, q->rid, q->rid_hi, PRISM__ERROR_KIND__ERROR_UNAVAILABLE,
                       "KV transfer to the decode worker failed");
            break;
        }
        p->kv_next += n;
        p->kv_sent_bytes += f.len;
        if (p->kv_gap_s > 0 && p->kv_next < total) {   /* test hook: the transfer stops midway for a while */
            p->kv_not_before = prism_now_s() + p->kv_gap_s;
            return;
        }
    }
    kv_done(p);
}

/* ---- between-layer hook of the language model: the items are the prompts of the forward ---- */

static bool hook_layer(void *ud, int done, int total)
{
    return prism_worker_layer_done(&((prefill_t *)ud)->w, done, total);
}

static bool hook_cancelled(void *ud, int item)
{
    prefill_t *p = ud;
    double waited = 0;
    if (!p->in_forward || item < 0 || item >= p->n_fwd) return false;
    prun_t *x = &p->run[item];
    if (x->dropped) return true;
    if (!prism_worker_aborted(&p->w, x->r->seq.rid, x->r->seq.router_id, &waited)) return false;
    if (!prism_worker_should_stop())
        PRISM_INFO("request %llu: cancelled %.3fs after its abort arrived, after layer %d of %d (%.3fs per layer): "
                   "prefill stopped", (unsigned long long)x->r->seq.rid, waited, p->w.layer.done, p->w.layer.total,
                   p->w.layer.last_s);
    x->dropped = true;
    return true;
}

/* Whether the cached prefix (its first `cached` positions) covers every image the router sent
 * without embeddings. */
static bool prefix_covers(const preq_t *r, int cached)
{
    for (int i = 0; i < r->n_images; i++)
        if (r->img_cached[i] && r->span_off[i] + r->span_len[i] > (uint32_t)cached) return false;
    return true;
}

/* Prefix cache: the leading full blocks an earlier prompt computed (same salt, tokens and images
 * up to there) are read, not computed: into x->table[0..return), held. The last token is always
 * computed (its logits give the first token). x->n_full: the prompt's full blocks kept after it,
 * their keys in x->keys (the router's, which the routers index; else this worker's own). */
static int prefix_lookup(prefill_t *p, const preq_t *r, prun_t *x)
{
    int bs = p->blocks.block_size;
    x->n_full = 0;
    if (!p->prefix_on) return 0;
    if (r->n_keys) {   /* on_prefill checked the count */
        x->n_full = r->n_keys;
        memcpy(x->keys, r->keys, sizeof(*x->keys) * (size_t)r->n_keys);
    } else {
        x->n_full = prism_kv_prefix_keys(&p->prefix, r->salt, strlen(r->salt), r->tokens, r->n_tokens, r->key_img,
                                         r->n_images, x->keys);
    }
    /* An image without its content hash (a router older than the cache sends none) has no identity:
     * nothing from its first block on is looked up or kept. */
    for (int i = 0; i < r->n_images; i++)
        if (!r->key_img[i].content_hash) x->n_full = PRISM_MIN(x->n_full, (int)(r->key_img[i].offset / (uint32_t)bs));
    return prism_kv_prefix_match(&p->prefix, x->keys, PRISM_MIN(x->n_full, (r->n_tokens - 1) / bs), x->table);
}

/* What the prefix cache kept and evicted since the last call, to every router (PrefixEvents): their
 * indexes route prompts to the worker holding their prefix. */
static void publish_prefix_events(prefill_t *p)
{
    prism_kv_prefix_log_t log;
    if (!p->prefix_on) return;
    /* a router that registered since knows nothing of the cache: every router starts again from a listing */
    uint64_t reg = atomic_load(&p->w.registrations);
    if (reg != p->registrations_seen) {
        p->registrations_seen = reg;
        prism_kv_prefix_events_resync(&p->prefix);
    }
    if (!prism_kv_prefix_events_take(&p->prefix, &log)) return;
    uint8_t stored[PRISM_KV_PREFIX_EVENTS * PRISM_KV_PREFIX_KEY_BYTES];
    uint8_t evicted[PRISM_KV_PREFIX_EVENTS * PRISM_KV_PREFIX_KEY_BYTES];
    prism_kv_prefix_keys_put(log.stored, log.n_stored, stored);
    prism_kv_prefix_keys_put(log.evicted, log.n_evicted, evicted);
    Prism__PrefixEvents ev = PRISM__PREFIX_EVENTS__INIT;
    ev.stored = (ProtobufCBinaryData){(size_t)log.n_stored * PRISM_KV_PREFIX_KEY_BYTES, stored};
    ev.evicted = (ProtobufCBinaryData){(size_t)log.n_evicted * PRISM_KV_PREFIX_KEY_BYTES, evicted};
    ev.reset = log.reset;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_PREFIX_EVENTS;
    env.prefix_events = &ev;
    prism_worker_broadcast(&p->w, &env);
}

/* A request's failure before or after the model (its slot, blocks and embeddings go). */
static void fail_request(prefill_t *p, preq_t *r, Prism__ErrorKind kind, const char *why)
{
    send_error(p, r->seq.router_id, r->seq.rid, r->seq.rid_hi, kind, why);
    release_req(p, r);
}

/* Admits a ready prompt into the model as run[n_run]: the checks before its first chunk (the
 * embedding rows, the sampler's view of it, the prefix cache's coverage of images sent without
 * embeddings), then its blocks (the cached prefix's held, the rest allocated). 1: admitted; 0:
 * refused (answered, released: the other prompts go on); -1: its blocks do not fit now (it waits,
 * holding none). */
static int admit(prefill_t *p, preq_t *r)
{
    /* The rows each encoder sent must be exactly the image tokens the router laid out for them. */
    for (int i = 0; i < r->n_images; i++) {
        if (r->img_cached[i]) continue;
        const emb_slot_t *e = emb_find(p, r->seq.rid, r->seq.rid_hi, r->seq.router_id, (uint32_t)i);
        if (e->n_rows != r->span_rows[i]) {
            PRISM_WARN("request %llu: image %d has %d embedding rows for %d image tokens", (unsigned long long)r->seq.rid,
                       i, e->n_rows, r->span_rows[i]);
            fail_request(p, r, PRISM__ERROR_KIND__ERROR_INTERNAL, "image embeddings do not match the prompt's image tokens");
            return 0;
        }
    }
    /* a migrated request's generated tokens are counted and fed to its guide again (here to refuse
     * it before any work; again before its first token, the slot being shared) */
    int n_gen = (int)r->seq.sampling.generated;
    const char *why = prism_seq_attach(&r->seq, &p->sampler, 0, r->tokens, (size_t)(r->n_tokens - n_gen),
                                       r->tokens + r->n_tokens - n_gen, (size_t)n_gen);
    if (why) {
        fail_request(p, r, PRISM__ERROR_KIND__ERROR_INTERNAL, why);
        return 0;
    }
    prun_t *x = &p->run[p->n_run];
    int nb = prism_kv_blocks_for_tokens(&p->blocks, r->n_tokens), bs = p->blocks.block_size;
    int hit = prefix_lookup(p, r, x);
    if (!prefix_covers(r, hit * bs)) {
        /* evicted between the router's look and now: the router sends it again, every image encoded */
        prism_kv_blocks_release(&p->blocks, x->table, hit);
        p->prefix_misses++;
        PRISM_INFO("request %llu: an image sent without embeddings is no longer in the prefix cache (%d tokens "
                   "cached): refused for the router to encode it", (unsigned long long)r->seq.rid, hit * bs);
        fail_request(p, r, PRISM__ERROR_KIND__ERROR_PREFIX_MISS,
                     "prefix no longer cached for an image sent without embeddings");
        return 0;
    }
    if ((p->prefix_on ? prism_kv_prefix_alloc(&p->prefix, nb - hit, x->table + hit)
                      : prism_kv_blocks_alloc(&p->blocks, nb, x->table)) != PRISM_OK) {
        prism_kv_blocks_release(&p->blocks, x->table, hit);   /* it waits for blocks, holding none */
        return -1;
    }
    const int cached = hit * bs;   /* the first position computed */
    if (p->prefix_on) {
        p->cache_queries += (uint64_t)r->n_tokens;
        p->cache_hits += (uint64_t)cached;
    }
    PRISM_DEBUG("request %llu: prefill of %d tokens started", (unsigned long long)r->seq.rid, r->n_tokens);
    x->r = r;
    x->nb = nb;
    x->hit = hit;
    x->done = cached;
    x->take = 0;
    x->dropped = x->export_wait = false;
    x->t0 = prism_now_s();
    /* its wait for embeddings: from its arrival to its last image's last rows (the stage histograms) */
    x->t_embedded = r->t_arrive;
    for (int i = 0; i < r->n_images; i++) {
        const emb_slot_t *e = emb_find(p, r->seq.rid, r->seq.rid_hi, r->seq.router_id, (uint32_t)i);
        if (e) x->t_embedded = PRISM_MAX(x->t_embedded, e->t_done);
    }
    x->t_embedded = PRISM_MIN(x->t_embedded, x->t0);
    for (int i = 0; i < r->n_images; i++) {   /* an image's rows before `cached` are in the cached blocks */
        x->next_row[i] = 0;
        for (int t = (int)r->span_off[i]; t < PRISM_MIN((int)(r->span_off[i] + r->span_len[i]), cached); t++)
            x->next_row[i] += r->tokens[t] == p->cfg.image_token_index;
    }
    r->in_model = true;
    p->n_run++;
    return 1;
}

/* The next prompt to admit: the lowest Sampling.priority (vLLM's `priority`: lower first, as the
 * router's queue), oldest first among equals, of those not in the model whose embeddings are all in. */
static preq_t *next_ready(prefill_t *p)
{
    preq_t *r = NULL;
    for (int i = 0; i < p->max_pending; i++) {
        preq_t *c = &p->reqs[i];
        if (!c->seq.used || c->in_model || !ready(p, c)) continue;
        int32_t pc = c->seq.sampling.priority, pr = r ? r->seq.sampling.priority : 0;
        if (!r || pc < pr || (pc == pr && c->t_arrive < r->t_arrive)) r = c;
    }
    return r;
}

/* Stages a computed prompt's KV for the decode worker (the sequences that go on share it there):
 * the decode worker pulls it when it has room. Chunked-attention layers go only from the block of
 * the current chunk's start: decode never reads earlier. A group's leader gathers every rank's
 * heads (groups run models without chunked layers only). Its blocks go back either way. */
static void stage_export(prefill_t *p, prun_t *x)
{
    preq_t *r = x->r;
    int nb = x->nb;
    size_t fbb = prism_kv_cache_class_block_bytes(&p->full, p->blocks.block_size, PRISM_KV_CLASS_FULL);
    size_t lbb = prism_kv_cache_class_block_bytes(&p->full, p->blocks.block_size, PRISM_KV_CLASS_LOCAL);
    int lfb = PRISM_MIN(prism_kv_local_first_block(&p->full, p->blocks.block_size, r->n_tokens), nb);
    p->kv_len = (size_t)nb * fbb + (size_t)(nb - lfb) * lbb;
    int erc;
    if (p->tp.size > 1) {
        erc = prism_tp_gather_kv(&p->tp, p->kv, x->table, nb, p->kv_out);
    } else {
        erc = prism_kv_cache_export_class(p->kv, PRISM_KV_CLASS_FULL, x->table, nb, p->kv_out);
        if (erc == PRISM_OK && nb > lfb)
            erc = prism_kv_cache_export_class(p->kv, PRISM_KV_CLASS_LOCAL, x->table + lfb, nb - lfb,
                                              p->kv_out + (size_t)nb * fbb);
    }
    if (erc == PRISM_OK && p->wire == PRISM_KV_WIRE_BF16) {   /* in place: kv_out's first half goes out */
        prism_kv_wire_narrow(p->kv_out, p->kv_len / sizeof(float));
        p->kv_len /= 2;
    }
    if (erc != PRISM_OK) {
        PRISM_ERROR("request %llu: KV export failed", (unsigned long long)r->seq.rid);
        if (prism_tp_check(&p->tp) != PRISM_OK) p->group_failed = true;
        fail_request(p, r, PRISM__ERROR_KIND__ERROR_INTERNAL, "prefill could not export the KV cache");
        return;
    }
    prism__kv__init(&p->kv_hdr);
    p->kv_hdr.n_tokens = (uint32_t)r->n_tokens;
    p->kv_hdr.block_size = (uint32_t)p->blocks.block_size;
    p->kv_hdr.n_blocks = (uint32_t)nb;
    p->kv_hdr.block_bytes = prism_kv_wire_bytes(p->wire, fbb);
    p->kv_hdr.local_first_block = (uint32_t)lfb;
    p->kv_hdr.local_block_bytes = prism_kv_wire_bytes(p->wire, lbb);
    p->kv_hdr.wire_dtype = (Prism__KvDtype)p->wire;
    if (p->chunk_pos) p->kv_hdr.rope_delta = prism_mrope_delta(r->mrope, r->n_images);
    prism_seq_copy(&p->kv_seq, &r->seq);
    p->kv_hdr.n_choice_index = p->kv_hdr.n_choice_first_token = p->kv_hdr.n_choice_rng_state = (size_t)p->kv_seq.n_fork;
    p->kv_hdr.choice_index = p->kv_seq.fork_index;
    p->kv_hdr.choice_first_token = p->kv_seq.fork_first;
    p->kv_hdr.choice_rng_state = p->kv_seq.fork_rng;
    if (prism_seq_needs_history(&p->kv_seq)) {
        memcpy(p->kv_prompt, r->tokens, sizeof(int32_t) * (size_t)r->n_tokens);
        p->kv_hdr.n_prompt_token_ids = (size_t)r->n_tokens;
        p->kv_hdr.prompt_token_ids = p->kv_prompt;
    }
    snprintf(p->kv_endpoint, sizeof(p->kv_endpoint), "%s", r->decode_endpoint);
    p->kv_pending = true;
    p->kv_next = 0;
    release_req(p, r);   /* kv_seq is a copy */
    p->served++;
}

/* The prompts whose KV waits, in the order they were computed, into the staging while it is free
 * (each sent at once unless the decode worker is full). */
static void stage_exports(prefill_t *p)
{
    for (int i = 0; i < p->n_run && !p->kv_pending;) {
        if (!p->run[i].export_wait) {
            i++;
            continue;
        }
        prism_log_ctx_t lc = {p->run[i].r->seq.rid, p->run[i].r->seq.trace};
        const prism_log_ctx_t *prev = prism_log_ctx_enter(&lc);
        stage_export(p, &p->run[i]);   /* takes it out of run[]: i is the next one now */
        prism_log_ctx_leave(prev);
        try_send_kv(p);
    }
}

static bool exports_waiting(const prefill_t *p)
{
    for (int i = 0; i < p->n_run; i++)
        if (p->run[i].export_wait) return true;
    return false;
}

/* A prompt whose last chunk was in the forward that ended at t1: its blocks go to the prefix cache,
 * its first token(s) to the router, its KV to the export queue (or its blocks back). */
static void finish_prompt(prefill_t *p, prun_t *x, const float *logits, double t1)
{
    preq_t *r = x->r;
    r->seq.len = r->n_tokens;
    /* its full blocks hold the prompt's KV now: kept for later prompts (the cache holds them on
     * after this request releases them) */
    if (p->prefix_on) prism_kv_prefix_insert(&p->prefix, x->keys, x->table, x->n_full);
    /* the routers learn what is kept before the first token: a client's next turn finds it indexed */
    publish_prefix_events(p);
    /* the sampler's one slot is this prompt's now (another may have been attached since admission) */
    int n_gen = (int)r->seq.sampling.generated;
    const char *why = prism_seq_attach(&r->seq, &p->sampler, 0, r->tokens, (size_t)(r->n_tokens - n_gen),
                                       r->tokens + r->n_tokens - n_gen, (size_t)n_gen);
    if (why) {
        fail_request(p, r, PRISM__ERROR_KIND__ERROR_INTERNAL, why);
        return;
    }
    /* The first token of each of the request's n sequences (one Tokens message each). */
    Prism__Tokens *first;
    int n_first = prism_seq_first_tokens(&r->seq, &p->sampler, logits, &p->cfg, p->max_model_len, &first);
    for (int i = 0; i < n_first; i++) {
        first[i].prefill_ms = (float)((t1 - x->t0) * 1e3);
        first[i].queue_ms = (float)((x->t0 - x->t_embedded) * 1e3);
        first[i].embed_wait_ms = (float)((x->t_embedded - r->t_arrive) * 1e3);
        first[i].from_prefill = true;
        send_tokens(p, r->seq.router_id, r->seq.rid, r->seq.rid_hi, &first[i]);
    }
    PRISM_DEBUG("%d prompt tokens prefilled in %.1f ms (%d from the prefix cache)", r->n_tokens, (t1 - x->t0) * 1e3,
                x->hit * p->blocks.block_size);
    if (r->seq.n_fork > 0) {
        x->export_wait = true;   /* stage_exports */
        return;
    }
    release_req(p, r);
    p->served++;
}

/* Lays prompt x's `take` tokens from x->done at offset `off` of the forward: ids, image rows, and
 * (M-RoPE) rotary positions in rows of ld. Whether an image row was laid. */
static bool pack_prompt(prefill_t *p, prun_t *x, int off, int ld, int *rc)
{
    const preq_t *r = x->r;
    int start = x->done, n = x->take;
    bool any = false;
    memcpy(p->chunk_tokens + off, r->tokens + start, sizeof(int32_t) * (size_t)n);
    memset(p->chunk_rows + off, 0, sizeof(*p->chunk_rows) * (size_t)n);
    for (int i = 0; i < r->n_images; i++) {
        if (r->img_cached[i]) continue;   /* wholly before the cached prefix (prefix_covers) */
        const emb_slot_t *e = emb_find(p, r->seq.rid, r->seq.rid_hi, r->seq.router_id, (uint32_t)i);
        int lo = PRISM_MAX((int)r->span_off[i], start);
        int hi = PRISM_MIN((int)(r->span_off[i] + r->span_len[i]), start + n);
        for (int t = lo; t < hi; t++) {
            if (r->tokens[t] != p->cfg.image_token_index) continue;   /* separators keep their embedding */
            p->chunk_rows[off + t - start] = emb_row(p, e, x->next_row[i]++);   /* read in place: no copy */
            any = true;
        }
    }
    /* M-RoPE: the chunk's rotary positions from the image spans (transformers' get_rope_index) */
    if (p->chunk_pos && prism_mrope_positions(r->mrope, r->n_images, start, n, p->chunk_pos + off, (size_t)ld) != PRISM_OK)
        *rc = PRISM_EINVAL;
    return any;
}

/* One forward: the next chunk of each prompt in the model, in the order they were admitted, then
 * ready prompts admitted in priority order, while tokens (--chunked-prefill-size) and places
 * (--max-prefill-batch) last. A prompt longer than what is left is cut there and goes on in the next
 * forward, first. Prompts whose last chunk was in it get their first token. Nothing runs while a
 * computed prompt's KV waits for the decode worker (its flow control, as before). */
static void run_step(prefill_t *p)
{
    stage_exports(p);
    if (p->kv_pending || exports_waiting(p)) return;
    if (p->fwd_gap_s > 0 && prism_now_s() < p->fwd_not_before) return;   /* test hook */
    /* Aborts the I/O thread saw for prompts between two forwards (a group's shards never drop a
     * prompt inside one, model.h; the Abort message itself may not have been read yet). */
    for (int i = p->n_run - 1; i >= 0; i--)
        if (prism_worker_aborted(&p->w, p->run[i].r->seq.rid, p->run[i].r->seq.router_id, NULL))
            leave_mid_prompt(p, p->run[i].r);
    int budget = p->chunk, n = 0;
    for (; n < p->n_run && budget > 0; n++) {
        prun_t *x = &p->run[n];
        x->take = PRISM_MIN(budget, x->r->n_tokens - x->done);
        budget -= x->take;
    }
    while (budget > 0 && n == p->n_run && p->n_run < p->max_batch) {
        preq_t *r = next_ready(p);
        if (!r) break;
        /* every line logged about it carries its id (a copy: its slot may be released) */
        prism_log_ctx_t lc = {r->seq.rid, r->seq.trace};
        const prism_log_ctx_t *prev = prism_log_ctx_enter(&lc);
        int a = admit(p, r);
        prism_log_ctx_leave(prev);
        if (a < 0) break;   /* no blocks: it stays first in line; nothing overtakes it */
        if (a == 0) continue;
        prun_t *x = &p->run[n++];
        x->take = PRISM_MIN(budget, r->n_tokens - x->done);
        budget -= x->take;
    }
    if (!n) return;
    int total = p->chunk - budget, rc = PRISM_OK;
    bool any_rows = false, last = false;
    p->seq_start[0] = 0;
    for (int i = 0; i < n; i++) {
        prun_t *x = &p->run[i];
        any_rows |= pack_prompt(p, x, p->seq_start[i], total, &rc);
        p->seq_start[i + 1] = p->seq_start[i] + x->take;
        p->pos0[i] = x->done;
        p->tables[i] = x->table;
        last |= x->done + x->take >= x->r->n_tokens;
    }
    prism_llm_batch_t b = {
        .n_seqs = n, .n_tokens = total, .tokens = p->chunk_tokens, .seq_start = p->seq_start, .pos0 = p->pos0,
        .block_tables = p->tables, .embed_rows = any_rows ? p->chunk_rows : NULL, .rope_pos = p->chunk_pos,
    };
    /* Logits only when some prompt ends here (the last token of each sequence, [n][vocab]); a forward
     * of middle chunks is begun and never ended (no lm_head, no wait; on a device the forwards queue
     * back to back). The ranks get each plan first. */
    if (rc == PRISM_OK) rc = prism_tp_send_step(&p->tp, &b, last);
    p->in_forward = true;
    p->n_fwd = n;
    if (rc == PRISM_OK)
        rc = last ? prism_llm_forward(p->llm, p->kv, &b, p->logits) : prism_llm_forward_begin(p->llm, p->kv, &b);
    p->in_forward = false;
    prism_worker_progress(&p->w, 1);
    double t1 = prism_now_s();
    p->fwd_not_before = t1 + p->fwd_gap_s;
    p->forwards++;
    p->forward_prompts += (uint64_t)n;
    p->batch_peak = PRISM_MAX(p->batch_peak, (uint32_t)n);
    if (rc == PRISM_OK) p->tokens_computed += (uint64_t)total;
    if (rc != PRISM_OK && prism_tp_check(&p->tp) != PRISM_OK) p->group_failed = true;
    /* From the back: taking a prompt out moves only those after it. */
    for (int i = n - 1; i >= 0; i--) {
        prun_t *x = &p->run[i];
        preq_t *r = x->r;
        prism_log_ctx_t lc = {r->seq.rid, r->seq.trace};
        const prism_log_ctx_t *prev = prism_log_ctx_enter(&lc);
        if (x->dropped) {
            /* aborted mid-forward: the router needs no answer; blocks and slots go back at once */
            release_req(p, r);
            p->cancelled++;
        } else if (rc != PRISM_OK) {
            PRISM_ERROR("request %llu: prefill failed: %s", (unsigned long long)r->seq.rid, prism_strerror(rc));
            fail_request(p, r, PRISM__ERROR_KIND__ERROR_INTERNAL, "prefill failed");
        } else {
            x->done += x->take;
            if (x->done >= r->n_tokens) finish_prompt(p, x, p->logits + (size_t)i * p->cfg.vocab, t1);
        }
        prism_log_ctx_leave(prev);
    }
    stage_exports(p);
}

/* A rank is gone: every request held here gets a clean error now and the leader exits, so the
 * routers drop it and the supervisor restarts the group whole. */
static void fail_group(prefill_t *p)
{
    int n = 0;
    const char *why = "the prefill worker's tensor-parallel group lost a rank";
    const Prism__ErrorKind kind = PRISM__ERROR_KIND__ERROR_UNAVAILABLE;   /* the worker goes away, as a dead one */
    for (int i = 0; i < p->max_pending; i++)
        if (p->reqs[i].seq.used) {
            send_error(p, p->reqs[i].seq.router_id, p->reqs[i].seq.rid, p->reqs[i].seq.rid_hi, kind, why);
            p->reqs[i].seq.used = false;
            n++;
        }
    if (p->kv_pending) {
        send_error(p, p->kv_seq.router_id, p->kv_seq.rid, p->kv_seq.rid_hi, kind, why);
        p->kv_pending = false;
        n++;
    }
    PRISM_ERROR("prefill group %s: a rank is gone: %d requests failed, the leader exits so the group restarts",
                p->w.worker_id, n);
}

static void expire_orphans(prefill_t *p)
{
    double now = prism_now_s();
    for (int i = 0; i < p->n_pages; i++) {
        emb_slot_t *e = &p->emb[i];
        if (!e->used || now - e->t_arrive < p->orphan_timeout_s) continue;
        if (emb_orphan(p, e)) {
            PRISM_WARN("dropping embeddings of request %llu: no prefill request came", (unsigned long long)e->rid);
            emb_lost(p, e->rid, e->rid_hi, e->router_id);
        }
    }
}

/* Prompts that each fit the pool alone but not together (several multi-image prompts each holding
 * part of their images) can fill it with nothing able to go on: the data socket is not read
 * (emb_credit 0), so the images they wait for never come. After PRISM_POOL_STALL_S of that, with no
 * prompt in the model, none ready and no export waiting, the youngest prompt holding pages fails with
 * a retryable 503 and its later embeddings are dropped: its pages free and the others go on. One a
 * stall; the next only after the grace again. */
#define PRISM_POOL_STALL_S 1.0
static void pool_break(prefill_t *p)
{
    bool stalled = p->n_pages && emb_credit(p) == 0 && p->n_run == 0 && !p->kv_pending;
    preq_t *young = NULL;
    for (int i = 0; i < p->max_pending && stalled; i++) {
        preq_t *r = &p->reqs[i];
        if (!r->seq.used) continue;
        if (ready(p, r)) stalled = false;   /* it goes next: not stuck */
        bool holds = false;
        for (int k = 0; k < p->n_pages && !holds; k++)
            holds = p->emb[k].used && p->emb[k].rid == r->seq.rid && p->emb[k].rid_hi == r->seq.rid_hi &&
                    !strcmp(p->emb[k].router_id, r->seq.router_id);
        if (holds && (!young || r->t_arrive > young->t_arrive)) young = r;
    }
    if (!stalled || !young) {
        p->stall_since = 0;
        return;
    }
    double now = prism_now_s();
    if (!p->stall_since) p->stall_since = now;
    if (now - p->stall_since < PRISM_POOL_STALL_S) return;
    p->stall_since = 0;
    p->pool_deadlocks++;
    PRISM_WARN("request %llu failed: the embedding pool is full of prompts each waiting for images that cannot come "
               "(%d pages; --embed-pool-images); the youngest gives its pages back (%llu so far)",
               (unsigned long long)young->seq.rid, p->n_pages, (unsigned long long)p->pool_deadlocks);
    prism_abort_memo_add(&p->aborts, young->seq.rid, young->seq.router_id, now);   /* its images still on the way */
    fail_request(p, young, PRISM__ERROR_KIND__ERROR_OVERLOAD,
                 "prefill embedding pool is full with other prompts' images; retry after a short wait");
}

/* What the next heartbeat says (the I/O thread sends it on its own clock). */
static void publish_load(prefill_t *p)
{
    int pending = 0, waiting = p->kv_pending, held_cached = 0;
    for (int i = 0; i < p->max_pending; i++) pending += p->reqs[i].seq.used;
    /* Cached blocks no prompt holds are free for the next one; a prompt in the model holds its
     * cached prefix, and once computed (its export waiting) the full blocks it gave the cache. */
    for (int i = 0; i < p->n_run; i++) {
        waiting += p->run[i].export_wait;
        held_cached += p->run[i].export_wait ? PRISM_MAX(p->run[i].hit, p->run[i].n_full) : p->run[i].hit;
    }
    int kv_free = p->blocks.n_free + (p->prefix_on ? p->prefix.n_cached - held_cached : 0);
    prism_worker_load_t load = {
        .running = (uint32_t)pending, .waiting = (uint32_t)waiting,
        .kv_free_blocks = (uint32_t)PRISM_MAX(kv_free, p->blocks.n_free),
        .pool_free = (uint32_t)emb_room(p),   /* images of the largest kind */
        .prompts_aborted = p->cancelled,
        .prefix_cache_queries = p->cache_queries, .prefix_cache_hits = p->cache_hits,
        .prompt_tokens_computed = p->tokens_computed,
        .prefill_forwards = p->forwards, .prefill_forward_prompts = p->forward_prompts,
        .prefill_batch_peak = p->batch_peak, .prefill_pool_breaks = p->pool_deadlocks,
        .kv_sent_bytes = p->kv_sent_bytes,
    };
    prism_worker_set_load(&p->w, &load);
}

/* ---- start-up: the prefill tier's hooks (worker/start.h) ---- */

static int prefill_flags(void *ctx, prism_flag_t *t)
{
    prefill_t *p = ctx;
    p->f.block_size = 16;
    p->f.chunk = 512;
    p->f.max_pending = 64;
    p->f.max_batch = 16;
    p->f.emb_images = 0;   /* 32, or 4 for Qwen-VL (prefill_size) */
    p->f.orphan_timeout = 120;
    p->f.kv_wire = "auto";
    prism_flag_t f[] = {
        PRISM_FLAG_INT("chunked-prefill-size", &p->f.chunk, "Most prompt tokens per forward step"),
        PRISM_FLAG_INT("kv-blocks", &p->f.kv_blocks, "KV blocks for prompts in flight (0 = two full contexts)"),
        PRISM_FLAG_INT("block-size", &p->f.block_size, "Tokens per KV block (must match the decode workers)"),
        PRISM_FLAG_INT("max-pending-requests", &p->f.max_pending, "Prefill requests held at once"),
        PRISM_FLAG_INT("max-prefill-batch", &p->f.max_batch,
                       "Most prompts one forward carries (their chunks together at most --chunked-prefill-size "
                       "tokens; at most --max-pending-requests; 1 = one prompt at a time; models with "
                       "chunked-attention layers always run 1)"),
        PRISM_FLAG_INT("embed-pool-images", &p->f.emb_images, "Receive pool for image embeddings, in images of the largest kind (Llama-4: of max_patches + 1 tiles; Qwen-VL: of --max-image-tokens; smaller images take less). 0 = 32, or 4 for Qwen-VL. A prompt whose images need more is refused (400)"),
        PRISM_FLAG_INT("max-image-tokens", &p->f.max_image_tokens, "Qwen-VL: the largest image taken, in LM tokens (0 = what the processor's max_pixels allows)"),
        PRISM_FLAG_INT("context-length", &p->f.context_length, "Max tokens per sequence (0 = model's max_position_embeddings, at most 131072)"),
        PRISM_FLAG_DOUBLE("orphan-timeout", &p->f.orphan_timeout,
                          "Seconds before embeddings whose prefill request never arrives free their slot"),
        PRISM_FLAG_BOOL("no-prefix-cache", &p->f.no_prefix_cache,
                        "Compute every prompt whole: keep no KV blocks of finished prompts for later ones"),
        PRISM_FLAG_STR("kv-transfer-dtype", &p->f.kv_wire, PRISM_KV_WIRE_FLAG_HELP),
    };
    memcpy(t, f, sizeof f);
    return (int)PRISM_ARRAY_LEN(f);
}

static int prefill_size(void *ctx, prism_worker_startup_t *s)
{
    prefill_t *p = ctx;
    char err[512] = "";
    if (p->f.chunk < 1 || p->f.chunk > 65536 || p->f.block_size < 1 || p->f.block_size > 1024 || p->f.max_pending < 1 ||
        p->f.max_pending > 4096 || p->f.max_batch < 1 || p->f.emb_images < 0 || p->f.emb_images > 65536 || !(p->f.orphan_timeout > 0) ||
        p->f.max_image_tokens < 0 || p->f.max_image_tokens > (int64_t)MAX_PAGES * PRISM_VISION_PIECE_ROWS) {
        PRISM_ERROR("flag out of range (see --help)");
        return 2;
    }
    if (prism_kv_wire_parse(p->f.kv_wire, s->o.compute_dtype, &p->wire) != PRISM_OK) {
        PRISM_ERROR("--kv-transfer-dtype must be auto, f32 or bf16");
        return 2;
    }
    if (p->wire == PRISM_KV_WIRE_BF16)
        PRISM_INFO("KV transfers go out in %s (--kv-transfer-dtype)", prism_kv_wire_name(p->wire));
    int bs = (int)p->f.block_size;
    p->row = prism_model_embed_row_floats(&p->cfg);
    p->chunk = (int)p->f.chunk;
    p->orphan_timeout_s = p->f.orphan_timeout;
    p->max_pending = (int)p->f.max_pending;
    /* Llama-4's chunked-attention layers run one prompt per forward: their masks and KV export have
     * a layout of their own, not checked against several prompts in one forward here. */
    p->max_batch = (int)PRISM_MIN(PRISM_MIN(p->f.max_batch, p->f.max_pending), p->f.chunk);   /* a token each at least */
    if (prism_kv_local_ring(&p->cfg, (int)p->f.block_size, p->chunk) > 0) p->max_batch = 1;
    if (p->cfg.has_vision) {
        /* Pages of one tile's rows; the largest image needs max_pages of them. */
        p->page_rows = p->cfg.image_seq_length;
        p->max_pages = 1;
        if (p->cfg.vision_arch == PRISM_VISION_LLAMA4) {
            prism_llama4_proc_t proc;
            if (prism_llama4_proc_load_dir(s->o.model_path, &proc, err, sizeof(err)) != PRISM_OK) {
                PRISM_ERROR("Llama-4 image processor: %s", err);
                return 1;
            }
            if (proc.tokens_per_tile != p->cfg.image_seq_length) {
                PRISM_ERROR("Llama-4: %d tokens per tile in the processor, %d in the vision config", proc.tokens_per_tile,
                            p->cfg.image_seq_length);
                return 1;
            }
            p->max_pages = prism_llama4_max_tiles(&proc);
        }
        if (prism_model_native_vision(&p->cfg)) {
            /* Native resolution: pages of PRISM_VISION_PIECE_ROWS rows; the largest image is what
             * the processor's limits allow (or --max-image-tokens). */
            prism_qwenvl_proc_t proc;
            if (prism_qwenvl_proc_load_dir(s->o.model_path, &proc, err, sizeof(err)) != PRISM_OK) {
                PRISM_ERROR("Qwen-VL image processor: %s", err);
                return 1;
            }
            if (!p->f.max_image_tokens) p->f.max_image_tokens = prism_qwenvl_max_tokens(&proc);
            if (p->f.max_image_tokens > (int64_t)MAX_PAGES * PRISM_VISION_PIECE_ROWS) {
                PRISM_ERROR("Qwen-VL: images of up to %lld tokens; at most %d are supported (--max-image-tokens)",
                            (long long)p->f.max_image_tokens, MAX_PAGES * PRISM_VISION_PIECE_ROWS);
                return 1;
            }
            p->page_rows = PRISM_VISION_PIECE_ROWS;
            p->max_pages = (int)((p->f.max_image_tokens + p->page_rows - 1) / p->page_rows);
        }
        if (!p->f.emb_images) p->f.emb_images = prism_model_native_vision(&p->cfg) ? 4 : 32;
        PRISM_ASSERT(p->max_pages >= 1 && p->max_pages <= MAX_PAGES);
        p->n_pages = (int)p->f.emb_images * p->max_pages;
    }
    p->max_model_len = prism_model_context_length(&p->cfg, p->f.context_length);
    p->cfg.max_pos = p->max_model_len;   /* the model's block tables are planned for the context served */
    p->max_blocks_per_seq = (p->max_model_len + bs - 1) / bs;
    int64_t kv_blocks = p->f.kv_blocks > 0 ? p->f.kv_blocks : 2 * (int64_t)p->max_blocks_per_seq;
    if (kv_blocks < p->max_blocks_per_seq || kv_blocks > INT32_MAX) {
        PRISM_ERROR("prefill: --kv-blocks %lld cannot hold one %d-token prompt (%d blocks)", (long long)kv_blocks,
                    p->max_model_len, p->max_blocks_per_seq);
        return 1;
    }
    s->max_blocks_per_seq = p->max_blocks_per_seq;
    s->batch_seqs = p->max_batch;   /* prompts per forward, their chunks together at most `chunk` tokens */
    s->batch_tokens = p->chunk;
    /* embeddings: the largest data frame is one tile's rows, or one piece of a native-resolution image */
    s->data_socket = true;
    size_t frame_rows = prism_model_native_vision(&p->cfg) ? PRISM_VISION_PIECE_ROWS : (size_t)p->cfg.image_seq_length;
    s->data_max_msg_bytes = frame_rows * p->row * sizeof(float);
    s->cap = (prism_worker_capacity_t){.kv_blocks = (uint32_t)kv_blocks, .block_size = (uint32_t)bs,
                                       .max_batch_tokens = (uint32_t)p->chunk, .max_running = (uint32_t)p->max_pending,
                                       .max_model_len = (uint32_t)p->max_model_len};
    return -1;
}

static int prefill_load(void *ctx, prism_worker_startup_t *s)
{
    prefill_t *p = ctx;
    char err[512] = "";
    p->be = s->be;
    if (prism_llm_load(p->be, &p->cfg, s->o.model_path, p->chunk, p->max_batch, &p->llm, err, sizeof(err)) != PRISM_OK) {
        PRISM_ERROR("cannot load language model: %s", err);
        return 1;
    }
    s->llm = p->llm;
    p->block_bytes = prism_kv_cache_block_bytes(&p->full, (int)p->f.block_size);
    size_t heap0 = prism_mem_used();   /* the sampler's tables and the grammar vocabulary, measured */
    if (prism_seq_sampler_init(&p->sampler, &p->full, s->o.model_path, 1) != PRISM_OK) {
        PRISM_ERROR("cannot allocate the sampler");
        return 1;
    }
    p->sampling_bytes = prism_mem_used() - heap0;
    return -1;
}

/* Bytes of one block of this rank's KV cache, and its entry in the block manager. */
static size_t kv_block_bytes(const prefill_t *p)
{
    return prism_kv_cache_block_bytes(&p->cfg, (int)p->f.block_size) + prism_kv_blocks_bytes(1);
}

static int prefill_plan(void *ctx, prism_worker_startup_t *s)
{
    prefill_t *p = ctx;
    prism_mem_plan_t *pl = &s->plan;
    p->prefix_on = s->leader && !p->f.no_prefix_cache;   /* the leader owns the block tables */
    prism_mem_plan_add(pl, "weights", prism_llm_weight_bytes(p->llm), PRISM_MEM_LIBRARY);
    prism_mem_plan_add(pl, "activations", prism_llm_arena_bytes(&p->cfg, p->chunk, p->max_batch), PRISM_MEM_LIBRARY);
    prism_mem_plan_add(pl, "model-host", prism_llm_host_bytes(&p->cfg, p->chunk, p->max_batch), PRISM_MEM_LIBRARY);
    prism_mem_plan_add(pl, "sampling", p->sampling_bytes, PRISM_MEM_LIBRARY);
    prism_mem_plan_add(pl, "kv-cache", (size_t)s->cap.kv_blocks * kv_block_bytes(p), PRISM_MEM_LIBRARY);
    /* the prefix cache's index over those blocks (its KV is the blocks themselves: no new budget) */
    prism_mem_plan_add(pl, "prefix-index", p->prefix_on ? prism_kv_prefix_bytes((int)s->cap.kv_blocks) : 0,
                       PRISM_MEM_LIBRARY);
    PRISM_PLAN_POOL(pl, "prefix-keys", p->run_keys, p->prefix_on ? (size_t)p->max_batch * p->max_blocks_per_seq : 0);
    PRISM_PLAN_POOL(pl, "prompt-keys", p->key_pool,
                    p->prefix_on ? (size_t)p->max_pending * p->max_blocks_per_seq : 0);
    /* the leader gathers a prompt's whole-model KV here for the decode worker */
    if (s->leader) PRISM_PLAN_POOL(pl, "kv-export", p->kv_out, (size_t)p->max_blocks_per_seq * p->block_bytes);
    PRISM_PLAN_POOL(pl, "embedding-pool", p->emb_pool, (size_t)p->n_pages * p->page_rows * p->row);
    PRISM_PLAN_POOL(pl, "embedding-slots", p->emb, p->n_pages);
    PRISM_PLAN_POOL(pl, "embedding-free", p->free_pages, p->n_pages);
    PRISM_PLAN_POOL(pl, "requests", p->reqs, p->max_pending);
    PRISM_PLAN_POOL(pl, "prompts", p->token_pool, (size_t)p->max_pending * p->max_model_len);
    PRISM_PLAN_POOL(pl, "export-prompt", p->kv_prompt, p->max_model_len);
    PRISM_PLAN_POOL(pl, "chunk-tokens", p->chunk_tokens, p->chunk);
    PRISM_PLAN_POOL(pl, "chunk-rows", p->chunk_rows, p->chunk);
    PRISM_PLAN_POOL(pl, "chunk-positions", p->chunk_pos, prism_model_mrope(&p->cfg) ? 3 * (size_t)p->chunk : 0);
    /* the prompts in the model: their records, block tables, and the forward's per-prompt arrays */
    PRISM_PLAN_POOL(pl, "prompts-in-model", p->run, p->max_batch);
    PRISM_PLAN_POOL(pl, "block-tables", p->run_tables, (size_t)p->max_batch * p->max_blocks_per_seq);
    PRISM_PLAN_POOL(pl, "forward-seq-start", p->seq_start, p->max_batch + 1);
    PRISM_PLAN_POOL(pl, "forward-pos0", p->pos0, p->max_batch);
    PRISM_PLAN_POOL(pl, "forward-tables", p->tables, p->max_batch);
    PRISM_PLAN_POOL(pl, "logits", p->logits, (size_t)p->max_batch * p->cfg.vocab);
    return -1;
}

static int prefill_ready(void *ctx, prism_worker_startup_t *s)
{
    prefill_t *p = ctx;
    int kv_blocks = (int)s->cap.kv_blocks, bs = (int)p->f.block_size;   /* the group's */
    prism_mem_plan_set(&s->plan, "kv-cache", (size_t)kv_blocks * kv_block_bytes(p));
    if (p->prefix_on) prism_mem_plan_set(&s->plan, "prefix-index", prism_kv_prefix_bytes(kv_blocks));
    if (prism_kv_cache_create(p->be, &p->cfg, kv_blocks, bs, &p->kv) != PRISM_OK ||
        prism_kv_blocks_init(&p->blocks, kv_blocks, bs) != PRISM_OK ||
        (p->prefix_on && prism_kv_prefix_init(&p->prefix, &p->blocks) != PRISM_OK)) {
        PRISM_ERROR("cannot allocate the prefill KV cache");
        return 1;
    }
    s->kv = p->kv;
    s->logits = p->logits;
    prism_abort_memo_init(&p->aborts, p->orphan_timeout_s);
    prism_abort_memo_init(&p->lost, PRISM_MAX(600.0, p->orphan_timeout_s));   /* the router's --request-timeout */
    const char *gap = getenv("PRISM_TEST_KV_PIECE_GAP_S");
    if (gap && *gap) {
        double g = strtod(gap, NULL);
        p->kv_gap_s = g >= 0 && g <= 600 ? g : 0;
        PRISM_WARN("test hook PRISM_TEST_KV_PIECE_GAP_S=%g is set: each KV transfer pauses that long between pieces",
                   p->kv_gap_s);
    }
    gap = getenv("PRISM_TEST_PREFILL_FORWARD_GAP_S");
    if (gap && *gap) {
        double g = strtod(gap, NULL);
        p->fwd_gap_s = g >= 0 && g <= 600 ? g : 0;
        PRISM_WARN("test hook PRISM_TEST_PREFILL_FORWARD_GAP_S=%g is set: the prefill pauses that long between forwards",
                   p->fwd_gap_s);
    }
    for (int i = 0; i < p->max_pending; i++) {
        p->reqs[i].tokens = p->token_pool + (size_t)i * p->max_model_len;
        p->reqs[i].keys = p->key_pool ? p->key_pool + (size_t)i * p->max_blocks_per_seq : NULL;
    }
    for (int i = 0; i < p->n_pages; i++) p->free_pages[p->n_free_pages++] = p->n_pages - 1 - i;
    for (int i = 0; i < p->max_batch; i++) {
        p->run[i].table = p->run_tables + (size_t)i * p->max_blocks_per_seq;
        p->run[i].keys = p->run_keys ? p->run_keys + (size_t)i * p->max_blocks_per_seq : NULL;
    }
    if (s->leader) {
        p->hook = (prism_model_hook_t){hook_layer, hook_cancelled, p};
        prism_llm_set_hook(p->llm, &p->hook);
        publish_load(p);   /* the first heartbeat already tells the truth */
    }
    return -1;
}

/* After start-up and registration (tier->run): the loop, then everything closed. */
static int prefill_run(void *ctx)
{
    prefill_t *p = ctx;
    PRISM_INFO("prefill: chunk %d tokens for up to %d prompts a forward, embedding pool %d pages of %d rows (%d images of up to %d pages)", p->chunk, p->max_batch,
               p->n_pages, p->page_rows, p->max_pages ? p->n_pages / p->max_pages : 0, p->max_pages);
    p->test_evict_on_arrival = getenv("PRISM_TEST_PREFIX_EVICT_ON_ARRIVAL") != NULL;
    if (p->test_evict_on_arrival)
        PRISM_WARN("test hook PRISM_TEST_PREFIX_EVICT_ON_ARRIVAL is set: the prefix cache is emptied when a prompt "
                   "with an image marked cached arrives");
    if (p->prefix_on)
        PRISM_INFO("prefix cache: on, in the %d KV blocks of %d tokens no prompt holds (a prompt takes at most %d)",
                   p->blocks.n_blocks, p->blocks.block_size, p->max_blocks_per_seq);
    else
        PRISM_INFO("prefix cache: off (--no-prefix-cache)");

    int code = 0;
    while (!prism_worker_should_stop()) {
        if (p->group_failed || prism_tp_check(&p->tp) != PRISM_OK) {
            fail_group(p);
            code = PRISM_EXIT_PEER_LOST;
            break;
        }
        publish_load(p);
        publish_prefix_events(p);   /* evictions of a prompt that then waited for blocks */
        try_send_kv(p);
        bool work = false;
        for (int i = 0; i < p->max_pending && !p->kv_pending && !work; i++)
            work |= p->reqs[i].seq.used && (p->reqs[i].in_model || ready(p, &p->reqs[i]));
        prism_worker_accept_data(&p->w, emb_credit(p));
        /* (the forward-gap test hook waits without spinning) */
        prism_worker_poll(&p->w, work ? (p->fwd_gap_s > 0 ? 2 : 0) : (p->kv_pending ? 2 : 50), on_msg, p);
        run_step(p);
        expire_orphans(p);
        pool_break(p);
    }
    PRISM_INFO("prefill worker stopping after %llu requests (%llu cancelled mid-prompt, %llu failed to free a full "
               "embedding pool)", (unsigned long long)p->served, (unsigned long long)p->cancelled,
               (unsigned long long)p->pool_deadlocks);
    prism_seq_sampler_free(&p->sampler);
    if (p->prefix_on) prism_kv_prefix_free(&p->prefix);
    return code;
}

static const prism_worker_tier_t k_prefill_tier = {
    .role = "prefill", .proto_role = PRISM__ROLE__ROLE_PREFILL,
    .summary = "Prism prefill worker: batched, chunked prefill, first token, KV export to decode workers.",
    .flags = prefill_flags, .size = prefill_size, .load = prefill_load, .plan = prefill_plan, .ready = prefill_ready,
    .run = prefill_run,
    .group = &prism_tp_group,
};

int main(int argc, char **argv)
{
    static prefill_t p;
    prism_worker_startup_t s = {.w = &p.w, .cfg = &p.cfg, .full = &p.full, .group = &p.tp};
    return prism_worker_main(&k_prefill_tier, &p, &s, argc, argv);
}
