/* libFuzzer: the decode worker's message handlers (decode_worker/main.c on_msg: Kv transfers from
 * prefill workers (and migrated ones from decode workers) on the data socket, Abort and Migrate from
 * routers) and its loop (admit_staged: the KV import
 * into the paged cache, shared prompt blocks of n > 1 choices; step: continuous batching over the
 * bundled tiny model on the CPU, sampling, the Tokens stream), on the worker its own start-up builds
 * (prism_worker_open with k_decode_tier) with small pools: 3 sequences, 5 blocks of 16 tokens, a 32-token context
 * (at most 32 steps of a sequence: an input's worst case stays well inside libFuzzer's timeout;
 * optimistic admission, the default: three sequences past 16 tokens outgrow the 5 blocks and preempt
 * by recompute (n = 1; a choice of n > 1, admitted to grow while every such choice's end fits the
 * pool, is never recomputed: it waits for a block instead), or by swap for inputs whose mode has bit 4 set: the worker starts with a swap region of
 * 2 blocks (--kv-swap-bytes 128K), which the harness takes away for the other inputs; a victim is
 * swapped out while the region has room for it, else recomputed).
 * Transfers in pieces (Kv.piece_first / piece_blocks): the tiny model's pieces would hold every block,
 * so the harness lowers decode's piece to one block (d->piece_blocks[] = 1) for inputs whose mode has
 * bit 5 set: first pieces, continuations in and out of order, twice, too large, for transfers never
 * admitted, and transfers that stop midway (expired after the input as PRISM_KV_RX_TIMEOUT_S would).
 * Records: see fuzz_worker.h; the harness plays the I/O thread. The input's first byte picks the
 * mode: bit 4 preempts by swap, bit 6 overlaps steps with host work (the GPU pipeline, --overlap-steps
 * on), bit 7 makes the router give up on every request at the end instead of letting them finish.
 * Invariants: every reply is a Tokens message to the router; the choices of n > 1 that grow are
 * counted in d->kept (within the pool) and are never recomputed (not by a preemption, not by unstall); no step advances a sequence whose KV is
 * still arriving or that is swapped out; the loop does not wedge (every sequence
 * ends by the context length: once the input is over, the worker is idle within that many steps);
 * once every request finished or was aborted, every sequence slot, KV block and swap slot is back,
 * nothing is staged and no step is in flight. */
#define main decode_worker_main
#include "../../decode_worker/main.c"
#undef main

#include "fuzz_worker.h"

static decode_t g_d;
static fuzz_io_t g_io;
static int g_piece_blocks[2];   /* decode's own pieces (f32, bf16) */
static prism_kv_swap_t g_swap, g_no_swap;   /* decode's swap region, and none (inputs without mode bit 4) */

static void drain(void)
{
    fuzz_drain(&g_io, &g_d.w, PRISM__MSG_TYPE__MSG_TOKENS, NULL, NULL);
}

/* Migrate's target stays inside the process (fuzz_worker.h): the migrated KV is read back there. */
static void on_msg_confined(prism_worker_t *w, prism_msg_t *m, int source, void *ud)
{
    Prism__Migrate *mg = m->env->type == PRISM__MSG_TYPE__MSG_MIGRATE ? m->env->migrate : NULL;
    char buf[64], *saved = NULL;
    if (mg) fuzz_confine(&mg->target_endpoint, &saved, buf, sizeof(buf));
    on_msg(w, m, source, ud);
    if (mg) mg->target_endpoint = saved;
}

/* One turn of main()'s loop, the poll being the harness's. */
static void turn(void)
{
    decode_t *d = &g_d;
    publish_load(d);
    /* unstall gives a waiting sequence a block or recomputes it: never a choice of n > 1 */
    bool multi[8] = {false};
    for (int i = 0; i < d->max_running && i < 8; i++)
        multi[i] = d->seqs[i].seq.used && prism_seq_n(&d->seqs[i].seq) > 1;
    unstall(d);
    for (int i = 0; i < d->max_running && i < 8; i++) FUZZ_ASSERT(!multi[i] || d->seqs[i].seq.used);
    admit_staged(d);
    fuzz_poll(&g_io, &d->w, data_credit(d), on_msg_confined, d);
    drain();
    /* a sequence whose KV is still arriving is in no step (its blocks are partly written) */
    int len[8], kept = 0;
    bool rx[8];
    FUZZ_ASSERT(d->max_running <= 8);
    for (int i = 0; i < d->max_running; i++) {
        /* the choices of n > 1 grow within the pool's bound (kept) and are never recomputed (their
         * router could not restart one choice's RNG stream) */
        kept += d->seqs[i].keep;
        FUZZ_ASSERT(!d->seqs[i].keep || (d->seqs[i].seq.used && d->seqs[i].grows && prism_seq_n(&d->seqs[i].seq) > 1));
        FUZZ_ASSERT(!d->seqs[i].seq.used || !d->seqs[i].preempt || prism_seq_n(&d->seqs[i].seq) == 1);
        /* a swapped-out sequence is in no step either (it holds no blocks) */
        rx[i] = d->seqs[i].seq.used && (d->seqs[i].receiving || d->seqs[i].swapped);
        FUZZ_ASSERT(!d->seqs[i].swapped || (!d->seqs[i].n_blocks && d->seqs[i].n_swapped > 0));
        len[i] = d->seqs[i].seq.len;
    }
    FUZZ_ASSERT(kept == d->kept && kept <= d->blocks.n_blocks);
    mig_tick(d, prism_now_s());
    step(d);
    for (int i = 0; i < d->max_running; i++) FUZZ_ASSERT(!rx[i] || !d->seqs[i].seq.used || d->seqs[i].seq.len == len[i]);
    drain();
}

static bool idle(const decode_t *d)
{
    return !running(d) && !d->staged && !d->n_rx && !d->n_step && !d->n_out && !g_io.n;
}

static void init(void)
{
    const char *extra[] = {"--context-length", "32", "--max-running-requests", "3", "--kv-blocks", "5",
                           "--block-size", "16", "--kv-swap-bytes", "128K"};
    int argc;
    char **argv;
    fuzz_worker_argv("decode_worker", extra, (int)PRISM_ARRAY_LEN(extra), &argc, &argv);
    struct sigaction old_int, old_term;
    sigaction(SIGINT, NULL, &old_int);
    sigaction(SIGTERM, NULL, &old_term);
    prism_worker_startup_t s = {.w = &g_d.w, .cfg = &g_d.cfg, .full = &g_d.full, .group = &g_d.tp};
    FUZZ_ASSERT(prism_worker_open(&k_decode_tier, &g_d, &s, argc, argv) == -1);
    fuzz_io_setup(&g_io, &g_d.w, &old_int, &old_term, piece_max_bytes(&g_d));
    memcpy(g_piece_blocks, g_d.piece_blocks, sizeof g_piece_blocks);
    FUZZ_ASSERT(g_d.blocks.n_blocks == 5 && g_d.max_model_len == 32 && !g_d.ring);
    FUZZ_ASSERT(g_d.swap.slots.n_blocks == 2);   /* the tiny model's block is 64 KiB */
    g_swap = g_d.swap;
    g_no_swap = (prism_kv_swap_t){.slot_bytes = g_swap.slot_bytes, .cls = g_swap.cls};
    if (getenv("FUZZ_VERBOSE"))   /* the transfer layout the seeds are written for */
        fprintf(stderr, "decode: block bytes %zu + %zu, local_first_block(16 tokens) %d\n", g_d.fbb, g_d.lbb,
                prism_kv_local_first_block(&g_d.cfg, 16, 16));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static bool ready_once;
    if (!ready_once) {
        fuzz_init_once();
        init();
        ready_once = true;
    }
    decode_t *d = &g_d;
    uint8_t mode = size ? data[0] : 0;
    d->overlap = (mode & 0x40) != 0;
    for (int w = 0; w < 2; w++) d->piece_blocks[w] = (mode & 0x20) ? 1 : g_piece_blocks[w];
    d->swap = (mode & 0x10) ? g_swap : g_no_swap;   /* every slot is free between inputs (asserted below) */
    fuzz_play(&g_io, &d->w, &data, &size, -1, turn);
    FUZZ_ASSERT(g_io.n == 0);
    if (mode & 0x80) {
        /* The router gives up on everything held here, mid-step included. */
        for (int i = 0; i < d->max_running; i++)
            if (d->seqs[i].seq.used) fuzz_abort(&d->w, on_msg, d, d->seqs[i].seq.rid, d->seqs[i].seq.router_id);
        if (d->staged) fuzz_abort(&d->w, on_msg, d, d->staged_rid, d->staged_router);
    }
    /* Every sequence ends by the context length; a staged transfer starts once they make room. Nothing
     * comes after the input: transfers whose pieces stopped (those admitted in these turns too) are
     * failed as the timeout would, and sequences parked for migration (now or in these turns) that the
     * router never places, or whose target takes nothing, are given up as the bounds would. */
    for (int k = 0; k < 2 * d->max_model_len + 4 && !idle(d); k++) {
        rx_expire(d, prism_now_s() + 2 * PRISM_KV_RX_TIMEOUT_S);
        mig_tick(d, prism_now_s() + 2 * PRISM_MIGRATE_SEND_S);
        turn();
    }
    FUZZ_ASSERT(idle(d));   /* not wedged */
    for (int i = 0; i < d->max_running; i++)
        FUZZ_ASSERT(!d->seqs[i].seq.used && !d->seqs[i].n_blocks && !d->seqs[i].n_swapped && !d->rx[i].used);
    FUZZ_ASSERT(d->blocks.n_free == d->blocks.n_blocks && !d->n_swapped_seqs && !prism_kv_swap_used_bytes(&d->swap) &&
                !d->kept);
    if (mode & 0x10) g_swap = d->swap;   /* its counters */

    if (getenv("FUZZ_VERBOSE"))   /* what an input did: to check that a seed does what it says */
        fprintf(stderr, "decode: %llu replies, %llu steps, %llu tokens, %llu cancelled, %llu KV waits, %llu preempted, "
                "%llu swapped out (counted since start), %llu transfers failed midway, %llu migrated "
                "(%llu messages to peers)\n",
                (unsigned long long)g_io.replies, (unsigned long long)d->steps, (unsigned long long)d->tokens_out,
                (unsigned long long)d->cancelled, (unsigned long long)d->kv_waits, (unsigned long long)d->preempted,
                (unsigned long long)d->swap.swapped_out, (unsigned long long)d->rx_failed,
                (unsigned long long)d->migrated_out, (unsigned long long)g_io.transfers);
    fuzz_io_reset(&g_io, &d->w);
    prism_abort_memo_init(&d->aborts, 600.0);
    return 0;
}
