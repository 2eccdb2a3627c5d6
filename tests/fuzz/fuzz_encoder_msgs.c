/* libFuzzer: the encoder worker's message handlers (encoder_worker/main.c on_msg: Encode with its
 * image file, early jobs without a prefill endpoint and the Encode that takes one over, Abort) and
 * its loop (run_batch: batches formed in rank order, cache hits, JPEG/PNG decode on two image threads, CLIP
 * preprocessing, the bundled tiny model's vision tower on the CPU, the pushes to prefill and the
 * EncodeDone answers), on the worker its own start-up builds (prism_worker_open with k_encoder_tier) with small pools: 4
 * queued images, 48 KiB of queued files, micro-batches of 2, a 4-tile embedding cache, and
 * --overlap-decode on (the next batch formed and decoding while the tower runs: aborts, cache hits and
 * refusals land in either batch; the first batch after an idle loop is still decoded synchronously). Records: see
 * fuzz_worker.h; the harness plays the I/O thread (an encoder has no data socket: op 1 is a router
 * message too).
 * Invariants: every reply is an EncodeDone to the router; every Embeddings push holds whole tiles of
 * the model's rows (or an error and none); the loop does not wedge (once the queue is empty, and no
 * push waits for a prefill that takes nothing, every job is answered within a few turns); once every
 * request is answered or aborted, every job slot is free, no batch is in flight and no cache entry
 * stays pinned. */
#define main encoder_worker_main
#include "../../encoder_worker/main.c"
#undef main

#include "fuzz_worker.h"

#define FUZZ_CACHE_BYTES (300u << 10)   /* --embedding-cache-bytes 300K */

static encoder_t g_e;
static fuzz_io_t g_io;

static void check_embeddings(prism_msg_t *m, void *ud)
{
    encoder_t *e = ud;
    const Prism__Embeddings *em = m->env->embeddings;
    FUZZ_ASSERT(m->env->type == PRISM__MSG_TYPE__MSG_EMBEDDINGS && em);
    if (em->error && *em->error) {
        FUZZ_ASSERT(m->n_frames == 0);
        return;
    }
    FUZZ_ASSERT(m->n_frames >= 1 && em->hidden == (uint32_t)e->cfg.hidden &&
                em->n_tokens == (uint32_t)(m->n_frames * e->cfg.image_seq_length));
    for (int f = 0; f < m->n_frames; f++) {
        size_t len = 0;
        prism_msg_frame(m, f, &len);
        FUZZ_ASSERT(len == e->emb_floats * sizeof(float));
    }
}

static void drain(void)
{
    fuzz_drain(&g_io, &g_e.w, PRISM__MSG_TYPE__MSG_ENCODE_DONE, check_embeddings, &g_e);
}

/* on_msg with the prefill endpoint an Encode names kept inside the process (fuzz_worker.h). */
static void on_msg_confined(prism_worker_t *w, prism_msg_t *m, int source, void *ud)
{
    Prism__Encode *en = m->env->encode;
    char buf[64], *saved = NULL;
    if (en) fuzz_confine(&en->prefill_endpoint, &saved, buf, sizeof(buf));
    on_msg(w, m, source, ud);
    if (en) en->prefill_endpoint = saved;
}

/* One turn of main()'s loop, the poll being the harness's. */
static void turn(void)
{
    encoder_t *e = &g_e;
    publish_load(e);
    fuzz_poll(&g_io, &e->w, 0, on_msg_confined, e);
    drain();
    run_batch(e);
    drain();
}

static int held(const encoder_t *e)
{
    int n = 0;
    for (int i = 0; i < e->max_queue; i++) n += e->jobs[i].state != JOB_FREE;
    return n;
}

/* A job whose push waits for a prefill that never takes anything (FUZZ_PEER_EP takes everything). */
static bool waits_for_peer(const encoder_t *e)
{
    for (int i = 0; i < e->max_queue; i++)
        if (e->jobs[i].state == JOB_SEND && e->jobs[i].prefill_endpoint[0] &&
            strcmp(e->jobs[i].prefill_endpoint, FUZZ_PEER_EP))
            return true;
    return false;
}

static void init(void)
{
    const char *extra[] = {"--max-batch-images", "2", "--max-queued-images", "4", "--max-queued-image-bytes", "48K",
                           "--embedding-cache-bytes", "300K", "--max-image-pixels", "65536",
                           "--max-decode-pixels", "65536", "--decode-threads", "1", "--max-batch-seconds", "0",
                           "--image-threads", "2", "--overlap-decode", "on"};
    int argc;
    char **argv;
    fuzz_worker_argv("encoder_worker", extra, (int)PRISM_ARRAY_LEN(extra), &argc, &argv);
    struct sigaction old_int, old_term;
    sigaction(SIGINT, NULL, &old_int);
    sigaction(SIGTERM, NULL, &old_term);
    prism_worker_startup_t s = {.w = &g_e.w, .cfg = &g_e.cfg};
    FUZZ_ASSERT(prism_worker_open(&k_encoder_tier, &g_e, &s, argc, argv) == -1);
    fuzz_io_setup(&g_io, &g_e.w, &old_int, &old_term, 0);
    FUZZ_ASSERT(g_e.max_queue == 4 && g_e.cache.n_units >= 1);
    if (getenv("FUZZ_VERBOSE"))
        fprintf(stderr, "encoder: cache %d tiles, pixel buffer %d tiles\n", g_e.cache.n_units, g_e.cap_tiles);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static bool ready_once;
    if (!ready_once) {
        fuzz_init_once();
        init();
        ready_once = true;
    }
    encoder_t *e = &g_e;
    fuzz_play(&g_io, &e->w, &data, &size, 0, turn);
    /* A batch takes at least one image, every job is answered when its batch is sent. */
    for (int k = 0; k < e->max_queue + 2 && held(e) && !waits_for_peer(e); k++) turn();
    FUZZ_ASSERT(g_io.n == 0);
    FUZZ_ASSERT(!held(e) || waits_for_peer(e));   /* not wedged */

    /* The router gives up on everything still held (a push stuck on its prefill included). */
    for (int i = 0; i < e->max_queue; i++)
        if (e->jobs[i].state != JOB_FREE) fuzz_abort(&e->w, on_msg, e, e->jobs[i].rid, e->jobs[i].router_id);
    turn();
    FUZZ_ASSERT(!held(e) && !e->cur.n_batch && !e->nxt.n_batch);
    for (int i = 0; i < e->cache.n_units; i++) FUZZ_ASSERT(!e->cache.pins[i]);

    if (getenv("FUZZ_VERBOSE"))   /* what an input did: to check that a seed does what it says */
        fprintf(stderr, "encoder: %llu replies, %llu pushes, %llu encoded, %llu failed, %llu cancelled, cache %llu "
                "hits / %llu misses\n", (unsigned long long)g_io.replies, (unsigned long long)g_io.transfers,
                (unsigned long long)e->encoded, (unsigned long long)e->failed, (unsigned long long)e->cancelled,
                (unsigned long long)e->cache.hits, (unsigned long long)e->cache.misses);
    fuzz_io_reset(&g_io, &e->w);
    /* No cache entry of one input answers the next: the cache starts empty, as at start-up. */
    prism_embed_cache_free(&e->cache);
    FUZZ_ASSERT(prism_embed_cache_init(&e->cache, FUZZ_CACHE_BYTES, e->emb_floats, e->prep.max_tiles) == PRISM_OK);
    return 0;
}
