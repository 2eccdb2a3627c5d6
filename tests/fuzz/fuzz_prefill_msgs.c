/* libFuzzer: the prefill worker's message handlers (prefill_worker/main.c on_msg: Prefill and Abort
 * from routers, Embeddings from encoders) and its loop (run_step: one forward over the prompts in the
 * bundled tiny model on the CPU (batched prefill), first tokens, the KV export and its push to the decode worker; expire_orphans),
 * on the worker its own start-up builds (prism_worker_open with k_prefill_tier) with small pools: 3 requests, 2 images, a
 * 128-token context. Records: see fuzz_worker.h; the harness plays the I/O thread.
 * Invariants: after every step each reply is a Tokens message to the router and each KV transfer
 * passes the decode worker's own checks (sizes, blocks, choices); the loop does not wedge (once the
 * queues are empty and no KV waits for its decode worker, no request that has everything it needs
 * is left unserved), and none held waits for embeddings dropped before it came; once every held request is aborted, every request slot, embedding page and KV
 * block is back and nothing is staged. */
#define main prefill_worker_main
#include "../../prefill_worker/main.c"
#undef main

#include "fuzz_worker.h"

static prefill_t g_p;
static fuzz_io_t g_io;

/* A KV transfer as on_kv in decode_worker/main.c checks it. */
static void check_kv(prism_msg_t *m, void *ud)
{
    prefill_t *p = ud;
    const Prism__Kv *kv = m->env->kv;
    FUZZ_ASSERT(m->env->type == PRISM__MSG_TYPE__MSG_KV && kv && kv->sampling && m->n_frames == 1);
    FUZZ_ASSERT(!prism_seq_check(kv->sampling, p->full.vocab, p->max_model_len));
    size_t len = 0;
    prism_msg_frame(m, 0, &len);
    FUZZ_ASSERT(kv->block_size == (uint32_t)p->blocks.block_size && kv->n_tokens > 0 &&
                kv->n_tokens < (uint32_t)p->max_model_len && kv->sampling->generated < kv->n_tokens);
    FUZZ_ASSERT(kv->n_blocks == (uint32_t)prism_kv_blocks_for_tokens(&p->blocks, (int)kv->n_tokens));
    /* one piece: the whole transfer (a 128-token context's KV is below prism_kv_piece_blocks' bound) */
    FUZZ_ASSERT(kv->local_first_block <= kv->n_blocks && kv->piece_first == 0 &&
                kv->piece_blocks == 2 * kv->n_blocks - kv->local_first_block &&
                len == (size_t)kv->n_blocks * kv->block_bytes + (size_t)(kv->n_blocks - kv->local_first_block) *
                                                                  kv->local_block_bytes);
    size_t k = kv->n_choice_index;
    int n = kv->sampling->n ? (int)kv->sampling->n : 1;
    FUZZ_ASSERT(k >= 1 && k <= (size_t)n && kv->n_choice_first_token == k && kv->n_choice_rng_state == k);
    FUZZ_ASSERT(!kv->n_prompt_token_ids || kv->n_prompt_token_ids == kv->n_tokens);
    uint8_t seen[PRISM_SEQ_MAX_N] = {0};
    for (size_t i = 0; i < k; i++) {
        FUZZ_ASSERT(kv->choice_index[i] < (uint32_t)n && !seen[kv->choice_index[i]]++);
        FUZZ_ASSERT(kv->choice_first_token[i] >= 0 && kv->choice_first_token[i] < p->cfg.vocab);
    }
}

/* on_msg with the decode endpoint a Prefill names kept inside the process (fuzz_worker.h). */
static void on_msg_confined(prism_worker_t *w, prism_msg_t *m, int source, void *ud)
{
    Prism__Prefill *pf = m->env->prefill;
    char buf[64], *saved = NULL;
    if (pf) fuzz_confine(&pf->decode_endpoint, &saved, buf, sizeof(buf));
    on_msg(w, m, source, ud);
    if (pf) pf->decode_endpoint = saved;
}

static void drain(void)
{
    fuzz_drain(&g_io, &g_p.w, PRISM__MSG_TYPE__MSG_TOKENS, check_kv, &g_p);
}

/* One turn of main()'s loop, the poll being the harness's. */
static void turn(void)
{
    prefill_t *p = &g_p;
    publish_load(p);
    try_send_kv(p);
    fuzz_poll(&g_io, &p->w, emb_credit(p), on_msg_confined, p);
    drain();
    run_step(p);
    expire_orphans(p);
    drain();
}

/* Whether a request has everything it needs and nothing stops the loop from serving it. */
static bool servable(prefill_t *p)
{
    if (p->kv_pending) return false;
    for (int i = 0; i < p->max_pending; i++)
        if (p->reqs[i].seq.used && (p->reqs[i].in_model || ready(p, &p->reqs[i]))) return true;
    return false;
}

static void init(void)
{
    const char *extra[] = {"--context-length", "128", "--max-pending-requests", "3", "--embed-pool-images", "2",
                           "--chunked-prefill-size", "48", "--block-size", "16", "--orphan-timeout", "1e6"};
    int argc;
    char **argv;
    fuzz_worker_argv("prefill_worker", extra, (int)PRISM_ARRAY_LEN(extra), &argc, &argv);
    struct sigaction old_int, old_term;
    sigaction(SIGINT, NULL, &old_int);
    sigaction(SIGTERM, NULL, &old_term);
    prism_worker_startup_t s = {.w = &g_p.w, .cfg = &g_p.cfg, .full = &g_p.full, .group = &g_p.tp};
    FUZZ_ASSERT(prism_worker_open(&k_prefill_tier, &g_p, &s, argc, argv) == -1);
    size_t image_bytes = (size_t)g_p.cfg.image_seq_length * g_p.cfg.hidden * sizeof(float);   /* prefill_size's bound */
    fuzz_io_setup(&g_io, &g_p.w, &old_int, &old_term, image_bytes);
    FUZZ_ASSERT(g_p.n_pages == 2 && g_p.page_rows == 64);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static bool ready_once;
    if (!ready_once) {
        fuzz_init_once();
        init();
        ready_once = true;
    }
    prefill_t *p = &g_p;
    fuzz_play(&g_io, &p->w, &data, &size, -1, turn);
    /* What the loop would do with nothing more coming: a forward a turn, each prompt in chunks. */
    for (int k = 0; k <= p->max_pending * (p->max_model_len / p->chunk + 2); k++) turn();
    FUZZ_ASSERT(g_io.n == 0);
    FUZZ_ASSERT(!servable(p));   /* not wedged */
    /* none waits for images dropped before it came (on_prefill answers it at once) */
    for (int i = 0; i < p->max_pending; i++)
        FUZZ_ASSERT(!p->reqs[i].seq.used ||
                    !prism_abort_memo_has(&p->lost, p->reqs[i].seq.rid, p->reqs[i].seq.router_id, prism_now_s()));

    /* The router gives up on everything held here (a KV stuck on its decode worker included). */
    for (int i = 0; i < p->max_pending; i++)
        if (p->reqs[i].seq.used) fuzz_abort(&p->w, on_msg, p, p->reqs[i].seq.rid, p->reqs[i].seq.router_id);
    if (p->kv_pending) fuzz_abort(&p->w, on_msg, p, p->kv_seq.rid, p->kv_seq.router_id);
    for (int i = 0; i < p->n_pages; i++)   /* orphans: their Prefill never came */
        if (p->emb[i].used) fuzz_abort(&p->w, on_msg, p, p->emb[i].rid, p->emb[i].router_id);
    turn();
    for (int i = 0; i < p->max_pending; i++) FUZZ_ASSERT(!p->reqs[i].seq.used);
    for (int i = 0; i < p->n_pages; i++) FUZZ_ASSERT(!p->emb[i].used);
    FUZZ_ASSERT(p->n_free_pages == p->n_pages);
    /* the prefix cache lets go of every block it kept (it was their only holder: no request leaked
     * one), so nothing of this input's reaches the next */
    if (p->prefix_on) {
        prism_kv_prefix_log_t log;
        FUZZ_ASSERT(prism_kv_prefix_clear(&p->prefix) >= 0 && p->prefix.n_cached == 0);
        prism_kv_prefix_events_take(&p->prefix, &log);
    }
    FUZZ_ASSERT(p->blocks.n_free == p->blocks.n_blocks);
    FUZZ_ASSERT(!p->kv_pending && p->n_run == 0);

    if (getenv("FUZZ_VERBOSE"))   /* what an input did: to check that a seed does what it says */
        fprintf(stderr, "prefill: %llu replies, %llu KV transfers, %llu served, %llu cancelled mid-prompt\n",
                (unsigned long long)g_io.replies, (unsigned long long)g_io.transfers, (unsigned long long)p->served,
                (unsigned long long)p->cancelled);
    fuzz_io_reset(&g_io, &p->w);
    prism_abort_memo_init(&p->aborts, p->orphan_timeout_s);
    prism_abort_memo_init(&p->lost, PRISM_MAX(600.0, p->orphan_timeout_s));
    return 0;
}
