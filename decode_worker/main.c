/* decode_worker: paged KV cache, continuous batching, sampling.
 *
 * Requests arrive as KV transfers from prefill workers (the prompt's K/V blocks plus the first
 * token, already streamed to the router by prefill). Each loop iteration admits what fits, runs
 * one decode step over every running sequence (sequences join and leave between steps), and
 * streams each new token to the router that owns the request. The worker's I/O thread receives
 * while a step runs; an abort drops its sequence between two layers of the step (in a
 * tensor-parallel group, whose ranks must all run the same rows, when the step ends).
 *
 * On a device with streams (--device cuda) the steps overlap with host work: as soon as step n's
 * tokens are sampled, step n+1 is enqueued, and step n's Tokens messages are built and sent,
 * messages handled and transfers admitted while the device runs it. On the CPU a step computes
 * inside prism_llm_forward_begin, so there tokens are sent first (nothing would overlap).
 *
 * Admission (--kv-admission). optimistic (the default, vLLM's): a sequence is admitted when blocks
 * for its prompt and first token are free with --kv-watermark of the pool to spare, and takes a
 * block each time it crosses one (grow, after every step). When the pool runs out, a sequence is
 * preempted (preempt): lowest priority first (Sampling.priority, larger = lower), then the youngest
 * (Sampling.arrival_us), so the oldest always progresses. The first way that works:
 * - swap, when its blocks fit in the free slots of the swap region (--kv-swap-bytes, swap.h): its
 *   KV is copied to host memory (page-locked on a device: backend host_pin), it keeps its slot and
 *   every piece of its state here, sits out the steps and comes back (swap_in, before any new
 *   transfer is admitted, highest priority then oldest) once blocks are free again; its stream
 *   simply pauses. Tried first because it is local:
 *   no round trip and nothing else waits (docs/ARCHITECTURE.md says why this order);
 * - migration, when it can move whole (one process, one choice, no penalty or guide:
 *   mig_possible): it is parked (no step, blocks held; its Tokens message says
 *   Tokens.preempt_migrate), the sequences short of a block stall until its blocks come back, and
 *   the router names a decode worker with room (Migrate), to which its KV and decode state go as a
 *   KV transfer (Kv.migrated) before it is dropped here; no room anywhere, no answer in time or a
 *   target that takes nothing: recompute;
 * - recompute: its blocks are dropped and its last Tokens message says so (Tokens.preempted): the
 *   router prefills its prompt and every token it generated again, as a migration does.
 * Every way greedy or seeded output goes on token for token. Tensor-parallel groups (whose ranks
 * hold the other KV heads) only recompute; Llama-4's rings stay with the slot (swap) or travel in
 * the transfer (migration).
 * Requests with n > 1: their choices share the prompt's full blocks (refcounted, kv/kv.h) and each
 * has its own copy of the last, partial one. They are admitted the same way (the shared blocks once,
 * one block each past them) but their choices can be neither recomputed (the router restarts a
 * request whole and the choices' RNG streams fork at their first token) nor migrated (the transfer
 * carries one KV its choices share, not k diverged ones); so a choice is a victim only when the swap
 * region holds it now, and is swapped out alone (its shared blocks stay in the pool while a sibling
 * holds them; it comes back with its own copy of each: admission counts every choice unshared).
 * Otherwise the others are preempted, and a choice short of a block with no victim left waits for
 * one (stalled; unstall) instead of being recomputed. So that such choices can never all wait for
 * each other, an n > 1 request grows only while every growing choice of n > 1 requests could reach
 * its end in the pool at once (kept); past that it reserves, as below.
 * reserve: a request is admitted only when blocks for prompt + max_tokens are free, so a running
 * sequence never runs out of KV and nothing is ever preempted. Either way, requests that do not
 * fit wait (one staged transfer, the rest stays in the senders: backpressure).
 *
 * Requests arrive from other decode workers too (preemption by migration: Kv.migrated, the same
 * pieces; the data socket admits decode keys beside prefill keys). Such a first piece is admitted
 * at once or bounced (Tokens.preempted: its sender holds blocks meanwhile), never staged.
 *
 * Transfers come in pieces of at most about 1 MiB (Kv.piece_first / piece_blocks, kv/kv.h), so what
 * decode holds outside its block pool does not grow with the prompt (an image of 16k tokens is ~1 GiB
 * of KV at 7B shapes). The first piece carries the header and is what admission decides on; once
 * admitted, the sequences hold their slots and blocks while the rest arrives (seq_t.receiving, an
 * rx_t each transfer) and every piece is imported as it comes. Pieces of several transfers (from
 * several prefill workers) interleave on the one data socket, so decode keeps reading while any
 * transfer is arriving; a first piece that does not fit then cannot wait (its later pieces would
 * have nowhere to go): its request is preempted before it started (recomputed, as grow() does; 503
 * when n > 1). A lone first piece with nothing arriving waits as a whole transfer did. A transfer
 * whose pieces stop (its prefill died: the router aborts it; else after PRISM_KV_RX_TIMEOUT_S), come
 * out of order, twice or larger than announced is failed and its blocks are freed.
 *
 * The frames are fp32 or bf16 (Kv.wire_dtype of the first piece; the sender's --kv-transfer-dtype,
 * kv/kv.h): decode takes either whatever its own flags, checks the sizes against its own for that
 * type and widens a bf16 piece into d->wide before the import (the cache, swap, the group's scatter
 * stay fp32); its migrations go out in its own --kv-transfer-dtype.
 *
 * Tensor parallelism (--tp-size T > 1, tp/tp.h): rank 0 is the worker above, holding its shard;
 * it hands every other rank its KV heads of each admitted request and the plan of each step, and
 * the ranks (which talk to no router and have no I/O thread) run the same forward on their shards.
 * Only the leader hears of aborts, so a group never drops a sequence mid-step: an aborted sequence
 * finishes the step and leaves the next plan. Overlap works as above: the leader sends plan n+1 and
 * begins it before sending step n's tokens.
 *
 * KV for chunked-attention layers (Llama-4): those layers never read before the current chunk, so
 * the cache is split (model.h): they live in a ring of prism_kv_local_ring blocks that each
 * sequence slot owns from start-up, and the block pool (--kv-blocks, admission) holds only the
 * other layers — at Scout's 3-in-4 chunked layers a block costs a quarter, and the rings cost
 * max_running x one chunk, whatever the context. */
#include "core/core.h"
#include "core/cli.h"
#include "net/net.h"
#include "worker/worker.h"
#include "worker/start.h"
#include "seq/seq.h"
#include "worker/aborts.h"
#include "tp/tp.h"
#include "kv/kv.h"
#include "sample/sample.h"
#include "backend/backend.h"
#include "model/model.h"
#include "swap.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>


typedef struct {
    prism_seq_t seq;          /* owner, sampling, RNG, progress; seq.used marks a running sequence */
    int32_t *blocks;          /* [max_blocks_per_seq] slice of the block-table pool */
    int n_blocks;
    int32_t *ring;            /* [ring] this slot's blocks in the chunked layers' pool (NULL: no split) */
    int32_t last_token;       /* sampled, not yet fed */
    int32_t rope_delta;       /* M-RoPE models: added to the position for the rotary one (Kv.rope_delta) */
    bool in_step;             /* part of the step in flight */
    bool cancel;              /* aborted while in the step in flight: released when it ends */
    bool finishing;           /* its last token is waiting to be sent */
    bool grows;               /* admitted optimistically: takes blocks as it goes, may be preempted */
    int keep;                 /* n > 1 and grows: the blocks it may need at most, counted in decode_t.kept */
    bool preempt;             /* preempted: its blocks are gone, it leaves once its last tokens are sent */
    bool swapped;             /* preempted by swap: its KV is in swap_slots, it keeps its slot, is in no step */
    int32_t *swap_slots;      /* [max_blocks_per_seq] its blocks' slots in the swap region (swapped) */
    double t_swapped;         /* when it was swapped out (the test hook PRISM_TEST_SWAP_HOLD_S) */
    int n_swapped;            /* slots it holds there (0 unless swapped) */
    bool receiving;           /* admitted, its KV still arriving (rx_t): in no step yet */
    bool migrating;           /* parked for a move to another decode worker (mig_t): in no step, blocks held */
    bool stalled;             /* waits for the block its next position needs (a parked one's come back): in no step */
    bool timed;               /* its first message (with the timings below) went out */
    double t_kv, t_admit;     /* its KV arrived; it was admitted (the router's stage histograms) */
} seq_t;

/* A transfer admitted and still arriving: its sequences hold their slots and blocks, and each piece
 * goes straight into them. Pieces come in order over one connection: the next must start at next. */
typedef struct {
    bool used;
    uint64_t rid, rid_hi;
    char router[128];
    int slots[PRISM_SEQ_MAX_N], k;
    int nb, lfb, shared;      /* the transfer's layout: blocks of each part, prompt blocks the choices share */
    int next, total;          /* the next piece's first block (frame order), of total */
    prism_kv_wire_t wire;     /* its frames' element type (the first piece's Kv.wire_dtype) */
    double t_last;            /* when its last piece came */
} rx_t;

/* A transfer whose next piece does not come within this is failed (its prefill is gone and no
 * router abort came: the router normally aborts it long before). */
#define PRISM_KV_RX_TIMEOUT_S 60.0

/* A sequence parked for preemption by migration: its blocks stay until its KV went out in pieces to
 * the decode worker the router named (Migrate), then it is dropped here. */
typedef struct {
    char endpoint[256];       /* the target's data endpoint; "" while the router has not answered */
    int next;                 /* its next block to send */
    double t;                 /* parked, or its last piece handed over (the bounds below) */
} mig_t;

/* A parked sequence the router does not place within this, or whose target takes no piece within
 * this, is dropped and recomputed (Tokens.preempted): the pool it holds is what the others wait for. */
#define PRISM_MIGRATE_ASK_S 2.0
#define PRISM_MIGRATE_SEND_S 5.0

/* One sequence's result of a step, held until it is sent. */
typedef struct {
    int slot;
    int32_t tok;
    Prism__Tokens t;
    prism_seq_lp_msg_t lpm;   /* storage t points into */
} out_t;

typedef struct {
    struct {                      /* the tier's flags */
        int64_t kv_blocks, block_size, max_running, context_length;
        const char *overlap, *admission;
        double watermark;
        int64_t swap_bytes;       /* --kv-swap-bytes: -1 = auto */
        const char *kv_wire;      /* --kv-transfer-dtype */
    } f;
    prism_worker_t w;
    prism_model_config_t cfg;     /* this rank's (sharded) shapes */
    prism_model_config_t full;    /* the whole model's: the KV layout prefill sends */
    prism_tp_t tp;
    bool group_failed;
    prism_backend_t *be;
    prism_llm_t *llm;
    prism_kv_cache_t *kv;
    prism_kv_blocks_t blocks;
    prism_seq_sampler_t sampler;  /* one slot per running sequence (slot = index in seqs) */
    size_t sampling_bytes;        /* what the sampler took at start-up (measured into the plan) */
    int max_running, max_model_len, max_blocks_per_seq;
    int ring;                 /* blocks per sequence ring of the chunked layers (0: not split) */
    int32_t *ring_pool;       /* [max_running][ring] */
    int32_t *ring_ids;        /* [ring] import scratch */
    const int32_t **rings;    /* [max_running] step scratch */
    size_t fbb, lbb;          /* block bytes of the full-attention / chunked layers (transfer layout, fp32) */
    prism_kv_wire_t wire;     /* what its migrations send (--kv-transfer-dtype); it takes either */
    uint8_t *wide;            /* [a bf16 piece's blocks in fp32] a bf16 piece widened before import */
    uint64_t kv_sent_bytes;   /* migrations' frame bytes sent (heartbeat kv_sent_bytes) */
    seq_t *seqs;              /* [max_running] */
    int32_t *block_pool;      /* [max_running][max_blocks_per_seq] */
    /* step scratch, sized at start-up */
    int32_t *tokens, *seq_start, *pos0, *rope_delta;
    const int32_t **tables;
    int *slot_of;             /* [max_running] slot of each sequence of the step in flight */
    bool *dropped;            /* [max_running] dropped by the between-layer hook */
    int n_step;               /* sequences in the step in flight; 0 = none */
    float *logits;            /* [max_running][vocab] */
    out_t *out;               /* [max_running] results of the last step, not sent yet */
    int n_out;
    bool overlap;             /* the backend runs asynchronously: enqueue the next step before sending */
    bool optimistic;          /* --kv-admission optimistic */
    int watermark_blocks;     /* blocks an optimistic admission leaves free (--kv-watermark of the pool) */
    int kept;                 /* the most blocks the growing choices of n > 1 requests may hold (seq_t.keep) */
    uint64_t preempted;       /* sequences preempted by recompute (heartbeat preempt_recompute) */
    prism_kv_swap_t swap;     /* the swap region (preemption by swap; n_blocks 0: off) */
    uint8_t *swap_bytes;      /* [swap_slots][block bytes of the pool's layers] the region's host memory */
    int32_t *swap_pool;       /* [max_running][max_blocks_per_seq] each sequence's swap slots */
    int swap_n_slots;         /* planned slots (0: swap off) */
    int n_swapped_seqs;       /* sequences swapped out now */
    mig_t *mig;               /* [max_running] the outgoing migration of each slot's parked sequence */
    int n_parked;             /* sequences parked (migrating): their blocks come back once their KV is out */
    uint8_t *mig_piece;       /* [one piece of d->wire, in fp32] export scratch (narrowed in place for bf16) */
    uint64_t migrated_out;    /* sequences preempted by migration, sent whole (heartbeat preempt_migrate) */
    bool swap_pinned;         /* the swap region is page-locked (backend host_pin) */
    bool test_die_on_migrated;   /* test hook PRISM_TEST_DIE_ON_MIGRATED_KV (decode_ready): killed mid-migration */
    double test_swap_hold_s;     /* test hook PRISM_TEST_SWAP_HOLD_S (decode_ready): seconds a swapped-out sequence stays out */
    double test_step_gap_s;      /* test hook PRISM_TEST_DECODE_STEP_GAP_S: least seconds between two steps */
    double step_not_before;      /* ... and when the next may start */
    prism_model_hook_t hook;
    /* one staged KV transfer waiting for blocks */
    bool staged;
    bool staged_waited;       /* counted in kv_waits once */
    uint64_t kv_waits;
    uint64_t staged_rid, staged_rid_hi;
    double staged_t;          /* when it arrived */
    char staged_router[128];
    Prism__Kv *staged_kv;     /* owned copy of the header (unpacked message kept) */
    Prism__Envelope *staged_env;
    zmq_msg_t staged_frame;
    rx_t *rx;                 /* [max_running] transfers still arriving */
    int n_rx;
    int piece_blocks[2];      /* most blocks of one piece, by wire type (kv/kv.h: bf16 pieces hold twice as many) */
    uint64_t rx_failed;       /* transfers failed midway (malformed pieces, pieces that stopped) */
    uint64_t steps, tokens_out, cancelled;
    uint64_t tokens_sampled, aborted;   /* heartbeats: tokens sampled, sequences ended by an abort */
    uint64_t ns_forward;      /* wall time of the steps' forwards (plan sent, collectives included) */
    prism_abort_memo_t aborts;  /* aborts that came before their KV */
} decode_t;

/* kind: INTERNAL for a failure here (decode refuses nothing for load: KV waits), UNAVAILABLE when
 * the worker's tensor-parallel group lost a rank (the worker is going away, as a dead one would). */
static void send_error(decode_t *d, const char *router_id, uint64_t rid, uint64_t rid_hi, Prism__ErrorKind kind,
                       const char *msg)
{
    prism_worker_reply_error(&d->w, router_id, rid, rid_hi, kind, msg, false);
}

static void seq_release(decode_t *d, seq_t *s)
{
    prism_kv_blocks_release(&d->blocks, s->blocks, s->n_blocks);
    prism_kv_swap_release(&d->swap, s->swap_slots, s->n_swapped);   /* it ended while swapped out */
    d->n_swapped_seqs -= s->swapped;
    prism_seq_detach(&s->seq);
    s->seq.used = false;
    s->n_blocks = s->n_swapped = 0;
    d->n_parked -= s->migrating;
    d->kept -= s->keep;
    s->keep = 0;
    s->cancel = s->finishing = s->in_step = s->grows = s->preempt = s->receiving = s->swapped = false;
    s->migrating = s->stalled = false;
}

/* Whether its router can prefill the sequence again from its tokens (Tokens.preempted): n = 1 only
 * (the router recomputes a request whole, and the RNG streams of n > 1's choices fork at their first
 * token: it could not restart one choice of several). */
static bool recomputable(const seq_t *s)
{
    return prism_seq_n(&s->seq) == 1;
}

static void unstage(decode_t *d)
{
    zmq_msg_close(&d->staged_frame);
    prism_msg_env_free(d->staged_env);
    d->staged_env = NULL;
    d->staged_kv = NULL;
    d->staged = false;
}

/* Imports n whole-model blocks of the pool's layers: a group's leader sends each rank its heads
 * (prism_tp_scatter_kv imports alone at T = 1; models with chunked layers run at T = 1). */
static int import_blocks(decode_t *d, const int32_t *blocks, int n, const uint8_t *bytes)
{
    if (d->tp.size > 1) return prism_tp_scatter_kv(&d->tp, d->kv, blocks, n, bytes);
    return prism_kv_cache_import_class(d->kv, PRISM_KV_CLASS_FULL, blocks, n, bytes);
}

/* Bytes in the fp32 cache layout of the piece of n blocks from block first (frame order) of a
 * transfer of nb blocks (on the wire: prism_kv_wire_bytes of it). */
static size_t piece_bytes(const decode_t *d, int nb, int first, int n)
{
    return prism_kv_piece_offset(nb, d->fbb, d->lbb, first + n) - prism_kv_piece_offset(nb, d->fbb, d->lbb, first);
}

/* The most bytes of one piece on the wire, of either type: the data socket's frame limit
 * (ZMQ_MAXMSGSIZE) and the plan's. */
static size_t piece_max_bytes(const decode_t *d)
{
    size_t f32 = (size_t)d->piece_blocks[PRISM_KV_WIRE_F32] * PRISM_MAX(d->fbb, d->lbb);
    size_t bf16 = (size_t)d->piece_blocks[PRISM_KV_WIRE_BF16] * prism_kv_wire_bytes(PRISM_KV_WIRE_BF16, PRISM_MAX(d->fbb, d->lbb));
    return PRISM_MAX(f32, bf16);
}

/* The fp32 bytes of the largest piece of type w (what a bf16 piece widens into, what a migration
 * exports before narrowing). */
static size_t piece_f32_bytes(const decode_t *d, prism_kv_wire_t w)
{
    return (size_t)d->piece_blocks[w] * PRISM_MAX(d->fbb, d->lbb);
}

/* Imports blocks [first, first + n) (frame order) of an admitted transfer into its sequences: the
 * first part's shared prompt blocks once (the first choice's, shared by the others), its other
 * blocks into each choice's own; the chunked layers' part into each choice's ring (or blocks). */
static int rx_import(decode_t *d, const rx_t *x, int first, int n, const uint8_t *bytes)
{
    int end = first + n, rc = PRISM_OK;
    for (int c = 0; c < x->k && rc == PRISM_OK; c++) {
        seq_t *s = &d->seqs[x->slots[c]];
        int lo = PRISM_MAX(first, c ? x->shared : 0), hi = PRISM_MIN(end, x->nb);
        if (lo < hi) rc = import_blocks(d, s->blocks + lo, hi - lo, bytes + piece_bytes(d, x->nb, first, lo - first));
        lo = PRISM_MAX(first, x->nb);
        if (rc != PRISM_OK || lo >= end) continue;
        /* chunked layers (a split cache): from the block of the current chunk, into the slot's ring */
        int r0 = lo - x->nb, m = end - lo;
        for (int i = 0; d->ring && i < m; i++) d->ring_ids[i] = s->ring[(x->lfb + r0 + i) % d->ring];
        rc = prism_kv_cache_import_class(d->kv, PRISM_KV_CLASS_LOCAL, d->ring ? d->ring_ids : s->blocks + x->lfb + r0,
                                         m, bytes + piece_bytes(d, x->nb, first, lo - first));
    }
    return rc;
}

/* rx_import of a piece as it came: bf16 frames are widened into d->wide first (exact). */
static int rx_take(decode_t *d, const rx_t *x, int first, int n, const uint8_t *bytes)
{
    if (x->wire == PRISM_KV_WIRE_BF16) {
        prism_kv_wire_widen(bytes, piece_bytes(d, x->nb, first, n) / sizeof(float), d->wide);
        bytes = d->wide;
    }
    return rx_import(d, x, first, n, bytes);
}

static rx_t *rx_find(decode_t *d, uint64_t rid, uint64_t rid_hi, const char *router)
{
    for (int i = 0; i < d->max_running; i++)
        if (d->rx[i].used && d->rx[i].rid == rid && d->rx[i].rid_hi == rid_hi && !strcmp(d->rx[i].router, router))
            return &d->rx[i];
    return NULL;
}

/* The transfer is whole: its sequences join the next step. */
static void rx_done(decode_t *d, rx_t *x)
{
    for (int c = 0; c < x->k; c++) d->seqs[x->slots[c]].receiving = false;
    x->used = false;
    d->n_rx--;
}

/* The transfer cannot go on: its sequences and blocks are freed, its router told (kind). */
static void rx_fail(decode_t *d, rx_t *x, Prism__ErrorKind kind, const char *why)
{
    PRISM_WARN("request %llu: KV transfer failed after %d of %d blocks: %s", (unsigned long long)x->rid, x->next,
               x->total, why);
    send_error(d, x->router, x->rid, x->rid_hi, kind, why);
    for (int c = 0; c < x->k; c++) seq_release(d, &d->seqs[x->slots[c]]);
    x->used = false;
    d->n_rx--;
    d->rx_failed++;
}

/* Transfers whose next piece did not come in time (now: the clock, a parameter for the fuzzer). */
static void rx_expire(decode_t *d, double now)
{
    for (int i = 0; i < d->max_running; i++)
        if (d->rx[i].used && now - d->rx[i].t_last > PRISM_KV_RX_TIMEOUT_S)
            rx_fail(d, &d->rx[i], PRISM__ERROR_KIND__ERROR_UNAVAILABLE,
                    "the KV transfer from the prefill worker stopped before its end");
}

/* Data credit: one message at a time; none while a transfer waits for blocks with nothing else
 * arriving (the rest stays in the senders: backpressure). While transfers arrive decode keeps
 * reading, or they could never end. */
static int data_credit(const decode_t *d)
{
    return d->staged && !d->n_rx ? 0 : 1;
}

/* Starts the staged request's sequences (one per choice that goes on after its first token) in
 * free slots with their blocks, receiving (rx_import fills them). They share the prompt's full
 * blocks; each gets its own copy of the prompt's last, partial block and blocks for what it
 * generates (prism_kv_blocks_for_shared). */
static const char *admit_choices(decode_t *d, const Prism__Kv *kv, const int *slots, int k, int per, bool grows,
                                 Prism__ErrorKind *kind)
{
    int bs = d->blocks.block_size, n_prompt = (int)kv->n_tokens;
    /* a migrated request: n_tokens = prompt + the gen tokens generated before (the last ones) */
    int gen = (int)kv->sampling->generated;
    int shared = k > 1 ? n_prompt / bs : 0;
    const int32_t *prompt = kv->n_prompt_token_ids ? kv->prompt_token_ids : NULL;
    int started = 0;
    const char *why = NULL;
    for (; started < k && !why; started++) {
        seq_t *s = &d->seqs[slots[started]];
        why = prism_seq_start(&s->seq, &d->sampler, d->staged_rid, d->staged_router, kv->sampling, n_prompt - gen,
                              kv->choice_rng_state[started]);
        if (why) break;
        s->seq.rid_hi = d->staged_rid_hi;
        s->seq.trace = (prism_trace_id_t){d->staged_env->trace_id_hi, d->staged_env->trace_id_lo};
        s->seq.index = kv->choice_index[started];
        s->seq.len = n_prompt;
        s->seq.generated = gen + 1;    /* prefill sampled the first token (after the gen before) */
        s->last_token = kv->choice_first_token[started];
        s->rope_delta = kv->rope_delta;
        s->n_blocks = 0;
        s->timed = false;
        s->t_kv = d->staged_t;
        s->t_admit = prism_now_s();
        if (prism_seq_needs_history(&s->seq) && gen && !prompt) {
            why = "a migrated request's KV came without the tokens it generated before";
            *kind = PRISM__ERROR_KIND__ERROR_INTERNAL;   /* a malformed transfer, not the request */
            started++;   /* released below with the others */
            break;
        }
        why = prism_seq_attach(&s->seq, &d->sampler, slots[started], prompt, prompt ? (size_t)(n_prompt - gen) : 0,
                               prompt ? prompt + n_prompt - gen : NULL, prompt ? (size_t)gen : 0);
        if (!why) why = prism_seq_feed(&s->seq, &d->sampler, &s->last_token, 1);
    }
    int rc = PRISM_OK;
    for (int c = 0; c < k && !why && rc == PRISM_OK; c++) {
        seq_t *s = &d->seqs[slots[c]];
        if (c == 0) rc = prism_kv_blocks_alloc(&d->blocks, shared, s->blocks);
        else {
            memcpy(s->blocks, d->seqs[slots[0]].blocks, sizeof(int32_t) * (size_t)shared);
            rc = prism_kv_blocks_share(&d->blocks, s->blocks, shared);
        }
        if (rc != PRISM_OK) break;
        s->n_blocks = shared;
        rc = prism_kv_blocks_alloc(&d->blocks, per - shared, s->blocks + shared);
        if (rc != PRISM_OK) break;
        s->n_blocks = per;
    }
    if (!why && rc != PRISM_OK) {
        why = "decode worker could not allocate the KV blocks";
        *kind = PRISM__ERROR_KIND__ERROR_INTERNAL;
    }
    if (why) {
        for (int c = 0; c < k; c++) {
            seq_t *s = &d->seqs[slots[c]];
            if (c < started || s->n_blocks) seq_release(d, s);
        }
        return why;
    }
    for (int c = 0; c < k; c++) {
        d->seqs[slots[c]].seq.used = true;
        d->seqs[slots[c]].receiving = true;
        d->seqs[slots[c]].grows = grows;
        PRISM_DEBUG("request %llu choice %u admitted: %d prompt tokens, %d blocks (%d shared)",
                    (unsigned long long)d->staged_rid, d->seqs[slots[c]].seq.index, n_prompt, per, shared);
    }
    return NULL;
}

static int running(const decode_t *d)
{
    int n = 0;
    for (int i = 0; i < d->max_running; i++) n += d->seqs[i].seq.used;
    return n;
}

static bool admit_staged_req(decode_t *d);
static int swap_in(decode_t *d);

/* Tries to admit the staged transfer. Returns true when the stage is empty afterwards. */
static bool admit_staged(decode_t *d)
{
    int swapped = swap_in(d);   /* swapped-out sequences come back first */
    if (!d->staged) return true;
    if (swapped) {              /* and the transfer waits while one of them does */
        d->kv_waits += !d->staged_waited;
        d->staged_waited = true;
        return false;
    }
    /* the lines logged meanwhile are about it (a copy: unstage frees the envelope) */
    prism_log_ctx_t lc = {d->staged_rid, {d->staged_env->trace_id_hi, d->staged_env->trace_id_lo}};
    const prism_log_ctx_t *prev = prism_log_ctx_enter(&lc);
    bool empty = admit_staged_req(d);
    prism_log_ctx_leave(prev);
    return empty;
}

static bool admit_staged_req(decode_t *d)
{
    const Prism__Kv *kv = d->staged_kv;
    int k = (int)kv->n_choice_index, slots[PRISM_SEQ_MAX_N], n_free = 0;
    for (int i = 0; i < d->max_running && n_free < k; i++)
        if (!d->seqs[i].seq.used) slots[n_free++] = i;
    /* on_kv bounded both terms (n_tokens < max_model_len, max_tokens <= max_model_len): no overflow,
     * and the blocks cover every position the sequence can reach (it ends at max_model_len). */
    int total = (int)PRISM_MIN((int64_t)kv->n_tokens + kv->sampling->max_tokens - kv->sampling->generated,
                               (int64_t)d->max_model_len);
    int need = k > 1 ? prism_kv_blocks_for_shared(&d->blocks, (int)kv->n_tokens, total, k)
                     : prism_kv_blocks_for_tokens(&d->blocks, total);
    /* optimistic: each choice takes blocks for its prompt and its first token now (the choices of
     * n > 1 share the prompt's full blocks), the rest as it goes; it waits until the watermark would
     * still be free after it (an idle worker admits it anyway: a lone sequence always fits,
     * decode_plan checked). The choices of n > 1 cannot be recomputed (nor migrated): they grow
     * only while every growing choice of such requests could reach its end in the pool at once
     * (kept, counted unshared: a choice swapped back in has its own copy of the prompt), so they
     * never wait for each other for ever (grow); past that, such a request reserves. */
    bool multi = k > 1 || kv->sampling->n > 1;
    int keep = multi ? prism_kv_blocks_for_tokens(&d->blocks, total) : 0;   /* a choice's most, unshared */
    bool grows = d->optimistic && (!multi || (int64_t)d->kept + (int64_t)k * keep <= d->blocks.n_blocks);
    int per = prism_kv_blocks_for_tokens(&d->blocks, grows ? (int)kv->n_tokens + 1 : total);
    int shared = k > 1 ? (int)kv->n_tokens / d->blocks.block_size : 0;
    int room = shared + k * (per - shared) + (grows && running(d) ? d->watermark_blocks : 0);
    const char *why = NULL;
    Prism__ErrorKind kind = PRISM__ERROR_KIND__ERROR_CLIENT;   /* the request itself cannot be held */
    if (need > d->blocks.n_blocks) why = "the request's sequences need more KV blocks than the decode worker has";
    else if (n_free < k || room > d->blocks.n_free) {   /* wait for room */
        d->kv_waits += !d->staged_waited;
        d->staged_waited = true;
        return false;
    }
    else why = admit_choices(d, kv, slots, k, per, grows, &kind);
    if (why) {
        PRISM_WARN("request %llu refused: %s", (unsigned long long)d->staged_rid, why);
        send_error(d, d->staged_router, d->staged_rid, d->staged_rid_hi, kind, why);
        unstage(d);
        return true;
    }
    for (int c = 0; c < k && grows; c++) d->seqs[slots[c]].keep = keep;
    d->kept += grows ? k * keep : 0;
    /* admitted: the first piece goes in now, the rest as it comes */
    rx_t *x = NULL;
    for (int i = 0; i < d->max_running && !x; i++)
        if (!d->rx[i].used) x = &d->rx[i];
    PRISM_ASSERT(x);   /* each holds a slot */
    int nb = (int)kv->n_blocks, blocks = 2 * nb - (int)kv->local_first_block;
    *x = (rx_t){.used = true, .rid = d->staged_rid, .rid_hi = d->staged_rid_hi, .k = k, .nb = nb,
                .lfb = (int)kv->local_first_block, .shared = k > 1 ? (int)kv->n_tokens / d->blocks.block_size : 0,
                .total = blocks, .wire = (prism_kv_wire_t)kv->wire_dtype, .t_last = prism_now_s()};
    snprintf(x->router, sizeof(x->router), "%s", d->staged_router);
    memcpy(x->slots, slots, sizeof(int) * (size_t)k);
    d->n_rx++;
    int n = kv->piece_blocks ? (int)kv->piece_blocks : blocks;
    if (rx_take(d, x, 0, n, zmq_msg_data(&d->staged_frame)) != PRISM_OK)
        rx_fail(d, x, PRISM__ERROR_KIND__ERROR_INTERNAL, "decode worker could not import the KV cache");
    else if ((x->next = n) == blocks)
        rx_done(d, x);
    unstage(d);
    return true;
}

/* The sequences a Kv starts: 1..n of them (and no more than the batch), each a distinct choice
 * below n with a first token in the vocabulary; prompt ids, when present, one per prompt token. */
static bool choices_ok(const decode_t *d, const Prism__Kv *kv)
{
    size_t k = kv->n_choice_index;
    int n = kv->sampling->n ? (int)kv->sampling->n : 1;
    if (k == 0 || k > (size_t)n || k > (size_t)d->max_running || n > PRISM_SEQ_MAX_N ||
        kv->n_choice_first_token != k || kv->n_choice_rng_state != k)
        return false;
    if (kv->n_prompt_token_ids && kv->n_prompt_token_ids != kv->n_tokens) return false;
    uint8_t seen[PRISM_SEQ_MAX_N] = {0};
    for (size_t i = 0; i < k; i++) {
        uint32_t c = kv->choice_index[i];
        if (c >= (uint32_t)n || seen[c]++ || kv->choice_first_token[i] < 0 || kv->choice_first_token[i] >= d->cfg.vocab)
            return false;
    }
    return true;
}

/* Tells the router that sequence `index` of the request left this worker without its KV (preempted
 * by recompute: the router prefills prompt + generated tokens again). */
static void reply_preempted(decode_t *d, const char *router, uint64_t rid, uint64_t rid_hi, uint32_t index)
{
    Prism__Tokens t = PRISM__TOKENS__INIT;
    t.index = index;
    t.preempted = true;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_TOKENS;
    env.tokens = &t;
    prism_worker_reply(&d->w, router, rid, rid_hi, &env);
    d->preempted++;
}

/* A first piece that cannot wait for blocks while other transfers arrive (decode must keep reading
 * for them, and this transfer's later pieces would have nowhere to go): its request is preempted
 * before it started, as grow() preempts (the router prefills it again, and its later pieces here
 * match nothing and are dropped); n > 1, whose choices cannot be recomputed, fails with a 503. */
static void bounce(decode_t *d, const Prism__Envelope *e, const char *router)
{
    const Prism__Kv *kv = e->kv;
    PRISM_DEBUG("request %llu preempted before admission: no KV blocks while %d transfers arrive",
                (unsigned long long)e->request_id, d->n_rx);
    if (kv->n_choice_index != 1 || kv->sampling->n > 1) {
        send_error(d, router, e->request_id, e->request_id_hi, PRISM__ERROR_KIND__ERROR_UNAVAILABLE,
                   "the decode worker has no KV blocks free for this request now");
        return;
    }
    reply_preempted(d, router, e->request_id, e->request_id_hi, kv->choice_index[0]);
}

/* A piece after the first: straight into its transfer's blocks. */
static void on_kv_piece(decode_t *d, prism_msg_t *m, const char *router)
{
    const Prism__Envelope *e = m->env;
    rx_t *x = rx_find(d, e->request_id, e->request_id_hi, router);
    if (!x) {   /* its transfer was aborted, failed or preempted before admission, or is over */
        PRISM_DEBUG("request %llu: KV piece for no transfer dropped", (unsigned long long)e->request_id);
        return;
    }
    size_t len = 0;
    const uint8_t *bytes = m->n_frames == 1 ? prism_msg_frame(m, 0, &len) : NULL;
    int first = (int)e->kv->piece_first, n = (int)e->kv->piece_blocks;
    if (!bytes || first != x->next || n < 1 || n > d->piece_blocks[x->wire] || n > x->total - first ||
        len != prism_kv_wire_bytes(x->wire, piece_bytes(d, x->nb, first, n))) {
        rx_fail(d, x, PRISM__ERROR_KIND__ERROR_INTERNAL, "malformed KV transfer between prefill and decode");
        return;
    }
    if (rx_take(d, x, first, n, bytes) != PRISM_OK) {
        rx_fail(d, x, PRISM__ERROR_KIND__ERROR_INTERNAL, "decode worker could not import the KV cache");
        return;
    }
    x->t_last = prism_now_s();
    if ((x->next += n) == x->total) rx_done(d, x);
}

static void on_kv(decode_t *d, prism_msg_t *m)
{
    const Prism__Envelope *e = m->env;
    const Prism__Kv *kv = e->kv;
    const char *router = e->router_id ? e->router_id : "";
    if (kv && kv->piece_first) {
        on_kv_piece(d, m, router);
        return;
    }
    if (prism_abort_memo_take(&d->aborts, e->request_id, router, prism_now_s())) {
        /* Its client is gone (the router sent the abort while prefill ran): nobody to decode for. */
        PRISM_DEBUG("request %llu: KV dropped, the request was aborted before it came", (unsigned long long)e->request_id);
        return;
    }
    size_t len = 0;
    prism_msg_frame(m, 0, &len);
    /* The layout is fixed by the model: the chunked layers' part starts at the block of the chunk
     * the next token is in (prefill and decode compute it alike). The first piece holds
     * piece_blocks of the transfer's blocks (0: all of them), never more than a piece. Sizes are
     * the wire's (Kv.wire_dtype: f32 or bf16, whatever this worker sends itself). */
    const char *why = kv ? prism_seq_check(kv->sampling, d->full.vocab, d->max_model_len) : "no Kv message";
    /* 64-bit: the fields are not checked yet (the checks below run in order) */
    int64_t total = kv && !why ? 2 * (int64_t)kv->n_blocks - (int64_t)kv->local_first_block : 0;
    int64_t n = kv && kv->piece_blocks ? (int64_t)kv->piece_blocks : total;
    bool wire_ok = kv && (kv->wire_dtype == PRISM__KV_DTYPE__KV_DTYPE_F32 || kv->wire_dtype == PRISM__KV_DTYPE__KV_DTYPE_BF16);
    prism_kv_wire_t w = wire_ok ? (prism_kv_wire_t)kv->wire_dtype : PRISM_KV_WIRE_F32;
    if (why || !wire_ok || m->n_frames != 1 || kv->block_size != (uint32_t)d->blocks.block_size ||
        kv->n_tokens == 0 || kv->n_tokens >= (uint32_t)d->max_model_len || kv->sampling->generated >= kv->n_tokens ||
        kv->n_blocks != (uint32_t)prism_kv_blocks_for_tokens(&d->blocks, (int)kv->n_tokens) ||
        kv->block_bytes != prism_kv_wire_bytes(w, d->fbb) || kv->local_block_bytes != prism_kv_wire_bytes(w, d->lbb) ||
        kv->local_first_block != (uint32_t)PRISM_MIN(prism_kv_local_first_block(&d->cfg, d->blocks.block_size,
                                                                                 (int)kv->n_tokens), (int)kv->n_blocks) ||
        n < 1 || n > total || n > d->piece_blocks[w] ||
        len != prism_kv_wire_bytes(w, piece_bytes(d, (int)kv->n_blocks, 0, (int)n)) ||
        !choices_ok(d, kv)) {
        PRISM_WARN("request %llu: malformed KV transfer dropped (%s)", (unsigned long long)e->request_id,
                   why ? why : !wire_ok ? "unknown wire dtype" : "sizes or choices");
        send_error(d, router, e->request_id, e->request_id_hi, PRISM__ERROR_KIND__ERROR_INTERNAL,
                   "malformed KV transfer between prefill and decode");
        return;
    }
    if (kv->migrated && d->test_die_on_migrated) {
        PRISM_WARN("test hook PRISM_TEST_DIE_ON_MIGRATED_KV: exiting as a migrated sequence's KV arrives");
        _exit(3);
    }
    rx_t *x = rx_find(d, e->request_id, e->request_id_hi, router);
    if (x || (d->staged && d->staged_rid == e->request_id && d->staged_rid_hi == e->request_id_hi &&
              !strcmp(d->staged_router, router))) {
        /* a second first piece: the transfer held is not what prefill sent */
        PRISM_WARN("request %llu: a second KV transfer for it dropped", (unsigned long long)e->request_id);
        if (x) rx_fail(d, x, PRISM__ERROR_KIND__ERROR_INTERNAL, "malformed KV transfer between prefill and decode");
        return;
    }
    if (d->staged) {   /* one transfer waits at most (a second can come only while others arrive) */
        bounce(d, e, router);
        return;
    }
    /* Keep the message: move the frame (no copy) and take over the unpacked envelope. */
    d->staged = true;
    d->staged_waited = false;
    d->staged_rid = e->request_id;
    d->staged_rid_hi = e->request_id_hi;
    d->staged_t = prism_now_s();
    snprintf(d->staged_router, sizeof(d->staged_router), "%s", router);
    zmq_msg_init(&d->staged_frame);
    zmq_msg_move(&d->staged_frame, &m->frames[0]);
    d->staged_env = m->env;
    d->staged_kv = m->env->kv;
    m->env = NULL;
    /* With transfers arriving, one of several pieces cannot wait: its next ones would follow. A
     * migrated sequence does not wait either: its sender holds its blocks meanwhile (the router
     * prefills it again, and the sender drops it at the router's abort). */
    if (!admit_staged(d) && ((d->n_rx && n < total) || d->staged_kv->migrated)) {
        bounce(d, d->staged_env, d->staged_router);
        unstage(d);
    }
}

/* ---- preemption by migration (issue 28): a victim's KV and decode state go to another decode ----
 *
 * grow() parks a victim that can migrate (mig_park) instead of dropping its blocks, and its Tokens
 * message of that step says so (Tokens.preempt_migrate); the sequences that need a block meanwhile
 * stall (no step) until the parked one's blocks come back. The router answers with Migrate: the
 * data endpoint of a decode worker with room (it holds the request there from now on), or "" (none:
 * it prefills it again). mig_send exports the blocks piece by piece (the prefill's transfer layout,
 * Kv.migrated) and drops the sequence once every piece is handed over. Bounded: no answer within
 * PRISM_MIGRATE_ASK_S, or a target that takes no piece within PRISM_MIGRATE_SEND_S, and the
 * sequence is dropped and recomputed (Tokens.preempted, which the router takes from the source of a
 * migration too: it aborts the target). An abort drops it at any point. */

/* Whether a victim can move as a whole: one process (a group's ranks hold the heads: the leader
 * would have to gather them between steps), one choice, and a continuation that needs no token
 * history (penalties and guides are fed the ids, which decode does not keep). Others are recomputed.
 * Chunked-attention layers (Llama-4) move too: their part of the transfer comes from the slot's ring. */
static bool mig_possible(const decode_t *d, const seq_t *s)
{
    return d->tp.size <= 1 && prism_seq_n(&s->seq) == 1 && !s->seq.guide && !prism_penalty_active(&s->seq.pen);
}

/* Exports blocks [k, k + n) (frame order, within one part) of a transfer of nb blocks whose second
 * part starts at block lfb into d->mig_piece: the first part from the sequence's blocks, the second
 * (chunked layers) from its ring, or its blocks when the cache is not split (rx_import's mirror). */
static int mig_export(decode_t *d, const seq_t *s, int nb, int lfb, int k, int n)
{
    if (k < nb) return prism_kv_cache_export_class(d->kv, PRISM_KV_CLASS_FULL, s->blocks + k, n, d->mig_piece);
    int j = lfb + (k - nb);   /* the block of the sequence */
    PRISM_ASSERT(!d->ring || n <= d->ring);   /* the part spans the current chunk, which its ring holds */
    for (int i = 0; d->ring && i < n; i++) d->ring_ids[i] = s->ring[(j + i) % d->ring];
    return prism_kv_cache_export_class(d->kv, PRISM_KV_CLASS_LOCAL, d->ring ? d->ring_ids : s->blocks + j, n,
                                       d->mig_piece);
}

/* Parks the victim d->out[k] for migration: true, or false when it cannot migrate. */
static bool mig_park(decode_t *d, int k)
{
    int slot = d->out[k].slot;
    seq_t *s = &d->seqs[slot];
    if (!mig_possible(d, s)) return false;
    d->mig[slot] = (mig_t){.t = prism_now_s()};
    s->migrating = true;
    d->n_parked++;
    d->out[k].t.preempt_migrate = true;
    PRISM_DEBUG("request %llu parked for migration (KV pool full): %d tokens, %d blocks, priority %d",
                (unsigned long long)s->seq.rid, s->seq.len, s->n_blocks, s->seq.sampling.priority);
    return true;
}

/* The parked sequence cannot go: dropped here, recomputed by its router. */
static void mig_drop(decode_t *d, seq_t *s, const char *why)
{
    PRISM_DEBUG("request %llu: migration given up (%s): recomputed", (unsigned long long)s->seq.rid, why);
    reply_preempted(d, s->seq.router_id, s->seq.rid, s->seq.rid_hi, s->seq.index);
    seq_release(d, s);
}

/* Router -> here: where the parked sequence of the request goes ("" : nowhere, drop it). */
static void on_migrate(decode_t *d, const Prism__Envelope *e, const char *router)
{
    const char *to = e->migrate && e->migrate->target_endpoint ? e->migrate->target_endpoint : "";
    for (int i = 0; i < d->max_running; i++) {
        seq_t *s = &d->seqs[i];
        if (!s->seq.used || !s->migrating || s->seq.rid != e->request_id || s->seq.rid_hi != e->request_id_hi ||
            strcmp(s->seq.router_id, router) != 0)
            continue;
        mig_t *m = &d->mig[i];
        if (m->endpoint[0]) return;   /* a duplicate: the first answer stands */
        if (!*to) {                   /* the router prefills it again */
            d->preempted++;
            seq_release(d, s);
            return;
        }
        if (strlen(to) >= sizeof(m->endpoint) || !strstr(to, "://") || !strcmp(to, d->w.data_endpoint)) {
            mig_drop(d, s, "the router named no other decode worker");
            return;
        }
        snprintf(m->endpoint, sizeof(m->endpoint), "%s", to);
        m->next = 0;
        m->t = prism_now_s();
        return;
    }
    PRISM_DEBUG("request %llu: Migrate for no parked sequence dropped", (unsigned long long)e->request_id);
}

/* Sends the pieces of slot's parked sequence the target takes now: true once all went (the
 * sequence is dropped), false while some wait; a failure drops it for recompute. */
static bool mig_send(decode_t *d, int slot)
{
    seq_t *s = &d->seqs[slot];
    mig_t *m = &d->mig[slot];
    void *sock = prism_worker_peer_sock(&d->w, m->endpoint);
    if (!sock) {
        mig_drop(d, s, "cannot reach the target");
        return false;
    }
    int bs = d->blocks.block_size, nb = prism_kv_blocks_for_tokens(&d->blocks, s->seq.len);
    Prism__Sampling sp = *prism_seq_sampling(&s->seq);
    sp.generated = (uint32_t)(s->seq.generated - 1);   /* those whose KV is here: all but the last */
    uint32_t index = s->seq.index;
    int32_t first = s->last_token;
    uint64_t rng = s->seq.rng;
    Prism__Kv hdr = PRISM__KV__INIT;
    hdr.n_tokens = (uint32_t)s->seq.len;
    hdr.block_size = (uint32_t)bs;
    hdr.n_blocks = (uint32_t)nb;
    hdr.block_bytes = prism_kv_wire_bytes(d->wire, d->fbb);
    hdr.local_first_block = (uint32_t)PRISM_MIN(prism_kv_local_first_block(&d->cfg, bs, s->seq.len), nb);
    hdr.local_block_bytes = prism_kv_wire_bytes(d->wire, d->lbb);
    hdr.wire_dtype = (Prism__KvDtype)d->wire;
    hdr.sampling = &sp;
    hdr.n_choice_index = hdr.n_choice_first_token = hdr.n_choice_rng_state = 1;
    hdr.choice_index = &index;
    hdr.choice_first_token = &first;
    hdr.choice_rng_state = &rng;
    hdr.rope_delta = s->rope_delta;
    hdr.migrated = true;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_KV;
    env.request_id = s->seq.rid;
    env.request_id_hi = s->seq.rid_hi;
    env.trace_id_hi = s->seq.trace.hi;
    env.trace_id_lo = s->seq.trace.lo;
    env.router_id = s->seq.router_id;
    int lfb = (int)hdr.local_first_block, total = 2 * nb - lfb;
    while (m->next < total) {
        int k = m->next, n = PRISM_MIN(d->piece_blocks[d->wire], (k < nb ? nb : total) - k);   /* within one part */
        Prism__Kv piece = PRISM__KV__INIT;
        Prism__Kv *kv = k ? &piece : &hdr;
        kv->piece_first = (uint32_t)k;
        kv->piece_blocks = (uint32_t)n;
        env.kv = kv;
        if (mig_export(d, s, nb, lfb, k, n) != PRISM_OK) {
            mig_drop(d, s, "KV export failed");
            return false;
        }
        prism_frame_t f = {d->mig_piece, prism_kv_wire_bytes(d->wire, piece_bytes(d, nb, k, n))};
        if (d->wire == PRISM_KV_WIRE_BF16) prism_kv_wire_narrow(d->mig_piece, piece_bytes(d, nb, k, n) / sizeof(float));
        int rc = prism_msg_send(sock, NULL, 0, &env, &f, 1, ZMQ_DONTWAIT);
        if (rc == PRISM_EAGAIN) return false;   /* the target is busy: the rest next time */
        if (rc != PRISM_OK) {
            mig_drop(d, s, "KV transfer failed");
            return false;
        }
        m->next += n;
        m->t = prism_now_s();
        d->kv_sent_bytes += f.len;
    }
    PRISM_DEBUG("request %llu migrated: %d tokens, %d blocks to %s", (unsigned long long)s->seq.rid, s->seq.len, nb,
                m->endpoint);
    d->migrated_out++;
    seq_release(d, s);
    return true;
}

/* Every loop: parked sequences send what they can; those past their bounds are recomputed (now: the
 * clock, a parameter for the fuzzer). */
static void mig_tick(decode_t *d, double now)
{
    for (int i = 0; i < d->max_running && d->n_parked; i++) {
        seq_t *s = &d->seqs[i];
        if (!s->seq.used || !s->migrating) continue;
        const mig_t *m = &d->mig[i];
        if (!m->endpoint[0] && now - m->t > PRISM_MIGRATE_ASK_S) mig_drop(d, s, "no answer from the router");
        else if (m->endpoint[0] && !mig_send(d, i) && s->seq.used && now - m->t > PRISM_MIGRATE_SEND_S)
            mig_drop(d, s, "the target takes no KV");
    }
}

/* Sequences that wait for a block take it once one is free; with none and no parked sequence to
 * give blocks back, the waiting one is preempted by recompute (nothing else frees a block for it),
 * unless it is a choice of n > 1 (not recomputable): it waits on, and gets the blocks the next
 * sequence to end or be preempted gives back (admission kept every such choice's end within the
 * pool: they cannot all wait). Between steps' messages (no Tokens of theirs is pending). */
static void unstall(decode_t *d)
{
    for (int i = 0; i < d->max_running; i++) {
        seq_t *s = &d->seqs[i];
        if (!s->seq.used || !s->stalled) continue;
        int need = prism_kv_blocks_for_tokens(&d->blocks, s->seq.len + 1);
        while (s->n_blocks < need && d->blocks.n_free > 0) {
            int rc = prism_kv_blocks_alloc(&d->blocks, 1, s->blocks + s->n_blocks);
            PRISM_ASSERT(rc == PRISM_OK);
            (void)rc;
            s->n_blocks++;
        }
        if (s->n_blocks >= need) s->stalled = false;
        else if (!d->n_parked && recomputable(s)) {
            reply_preempted(d, s->seq.router_id, s->seq.rid, s->seq.rid_hi, s->seq.index);
            seq_release(d, s);
        }
    }
}

static void on_abort(decode_t *d, uint64_t rid, const char *router)
{
    bool held = false;
    for (int i = 0; i < d->max_running; i++) {
        seq_t *s = &d->seqs[i];
        if (s->seq.used && s->seq.rid == rid && !strcmp(s->seq.router_id, router)) {
            PRISM_DEBUG("request %llu aborted", (unsigned long long)rid);
            if (!s->cancel) d->aborted++;
            if (s->in_step || s->finishing || s->preempt) s->cancel = true;   /* the device still writes its blocks */
            else seq_release(d, s);
            held = true;
        }
    }
    for (int i = 0; i < d->max_running; i++)
        if (d->rx[i].used && d->rx[i].rid == rid && !strcmp(d->rx[i].router, router)) {
            d->rx[i].used = false;   /* its sequences were released above */
            d->n_rx--;
        }
    if (d->staged && d->staged_rid == rid && !strcmp(d->staged_router, router)) {
        unstage(d);
        held = true;
    }
    /* Not here yet: its KV may still be on its way from prefill (the router tells a decode only
     * about requests it may hold or receive). */
    if (!held) prism_abort_memo_add(&d->aborts, rid, router, prism_now_s());
}

static void on_msg(prism_worker_t *w, prism_msg_t *m, int source, void *ud)
{
    decode_t *d = ud;
    switch (m->env->type) {
    case PRISM__MSG_TYPE__MSG_KV:
        if (source < 0) on_kv(d, m);
        break;
    case PRISM__MSG_TYPE__MSG_ABORT:
        /* Only routers abort (a prefill's key on the data socket does not make it one). */
        if (source >= 0) on_abort(d, m->env->request_id, m->env->router_id ? m->env->router_id : "");
        break;
    case PRISM__MSG_TYPE__MSG_MIGRATE:
        if (source >= 0) on_migrate(d, m->env, m->env->router_id ? m->env->router_id : "");
        break;
    default:
        PRISM_WARN("unexpected message type %d", m->env->type);
    }
}

/* ---- between-layer hook of the language model ---- */

static bool hook_layer(void *ud, int done, int total)
{
    return prism_worker_layer_done(&((decode_t *)ud)->w, done, total);
}

static bool hook_cancelled(void *ud, int item)
{
    decode_t *d = ud;
    seq_t *s = &d->seqs[d->slot_of[item]];
    double waited = 0;
    if (!prism_worker_aborted(&d->w, s->seq.rid, s->seq.router_id, &waited)) return false;
    prism_log_ctx_t lc = {s->seq.rid, s->seq.trace};   /* a step serves many requests: this line is about its one */
    if (!prism_worker_should_stop())
        PRISM_LOGC(DEBUG, &lc, "request %llu aborted: dropped from the step after layer %d of %d, %.3fs after the "
                   "abort arrived", (unsigned long long)s->seq.rid, d->w.layer.done, d->w.layer.total, waited);
    d->dropped[item] = true;
    return true;
}

static void fail_step(decode_t *d, int rc)
{
    if (prism_tp_check(&d->tp) != PRISM_OK) {
        /* A rank is gone: main() fails every request (fail_group) and exits. */
        PRISM_ERROR("decode step failed: %s (the tensor-parallel group is broken)", prism_strerror(rc));
        for (int j = 0; j < d->n_step; j++) d->seqs[d->slot_of[j]].in_step = false;
        d->n_step = 0;
        d->group_failed = true;
        return;
    }
    /* A failing forward is a broken invariant for these sequences: fail them, keep serving. */
    PRISM_ERROR("decode step failed: %s", prism_strerror(rc));
    for (int j = 0; j < d->n_step; j++) {
        seq_t *s = &d->seqs[d->slot_of[j]];
        if (!s->cancel) send_error(d, s->seq.router_id, s->seq.rid, s->seq.rid_hi, PRISM__ERROR_KIND__ERROR_INTERNAL, "decode step failed");
        seq_release(d, s);
    }
    d->n_step = 0;
}

/* Enqueues one step over every running sequence that goes on (the CPU backend computes it here). */
static void launch_step(decode_t *d)
{
    int n = 0;
    for (int i = 0; i < d->max_running; i++) {
        seq_t *s = &d->seqs[i];
        if (!s->seq.used || s->finishing || s->cancel || s->preempt || s->receiving || s->swapped || s->migrating ||
            s->stalled)
            continue;
        d->tokens[n] = s->last_token;
        d->seq_start[n] = n;
        d->pos0[n] = s->seq.len;
        if (d->rope_delta) d->rope_delta[n] = s->rope_delta;
        d->tables[n] = s->blocks;
        d->rings[n] = s->ring;
        d->slot_of[n] = i;
        d->dropped[n] = false;
        s->in_step = true;
        n++;
    }
    d->n_step = n;
    if (!n) return;
    d->seq_start[n] = n;
    prism_llm_batch_t b = {
        .n_seqs = n, .n_tokens = n, .tokens = d->tokens, .seq_start = d->seq_start,
        .pos0 = d->pos0, .block_tables = d->tables, .all_logits = false,
        .local_tables = d->ring ? d->rings : NULL, .local_ring = d->ring, .rope_delta = d->rope_delta,
    };
    /* The plan goes to the other ranks first, then the leader runs the same forward. */
    uint64_t t0 = prism_now_ns();
    int rc = prism_tp_send_step(&d->tp, &b, true);
    if (rc == PRISM_OK) rc = prism_llm_forward_begin(d->llm, d->kv, &b);
    d->ns_forward += prism_now_ns() - t0;
    if (rc != PRISM_OK) fail_step(d, rc);
}

/* The preemption victim among the sequences of the step just sampled (d->out): an optimistic one
 * that goes on, the lowest priority (the largest Sampling.priority), then the youngest; -1 none. A
 * choice of n > 1 is one only when the swap region holds it now (its one way out). */
static int victim(const decode_t *d)
{
    int best = -1;
    for (int k = 0; k < d->n_out; k++) {
        const seq_t *s = &d->seqs[d->out[k].slot];
        if (!s->grows || s->finishing || s->cancel || s->preempt || s->swapped || s->migrating || s->stalled) continue;
        if (!recomputable(s) && !prism_kv_swap_fits(&d->swap, s->n_blocks)) continue;
        if (best < 0) {
            best = k;
            continue;
        }
        const Prism__Sampling *a = &s->seq.sampling, *b = &d->seqs[d->out[best].slot].seq.sampling;
        if (a->priority > b->priority || (a->priority == b->priority && a->arrival_us > b->arrival_us)) best = k;
    }
    return best;
}

/* Preemption by swap: the sequence's blocks go to the swap region when they fit there (the region
 * is off in a tensor-parallel group, whose ranks hold the other KV heads). It keeps its slot and
 * its sampling state and sits out the steps until swap_in brings it back. False: it does not fit
 * (or the copy failed), nothing changed. */
static bool swap_out(decode_t *d, seq_t *s)
{
    if (!prism_kv_swap_fits(&d->swap, s->n_blocks)) return false;
    int rc = prism_kv_swap_out(&d->swap, d->kv, s->blocks, s->n_blocks, s->swap_slots);
    if (rc != PRISM_OK) {
        PRISM_WARN("request %llu: swapping its KV out failed (%s): recomputed instead", (unsigned long long)s->seq.rid,
                   prism_strerror(rc));
        return false;
    }
    prism_kv_blocks_release(&d->blocks, s->blocks, s->n_blocks);
    s->n_swapped = s->n_blocks;
    s->n_blocks = 0;
    s->swapped = true;
    s->t_swapped = prism_now_s();
    d->n_swapped_seqs++;
    return true;
}

/* The victim d->out[k] leaves the pool, the first way that works: swapped out (its Tokens message
 * of this step goes out as usual, marked Tokens.swapped for the router's count; its blocks are free
 * at once), else parked for migration (mig_park: its blocks come back once its KV is out), else
 * recompute: its blocks are dropped at once (no step in flight uses them) and the message tells its
 * router to prefill it again. */
static void preempt(decode_t *d, int k)
{
    seq_t *vs = &d->seqs[d->out[k].slot];
    if (swap_out(d, vs)) {
        d->out[k].t.swapped = true;
        PRISM_DEBUG("request %llu swapped out (KV pool full): %d blocks, priority %d", (unsigned long long)vs->seq.rid,
                    vs->n_swapped, vs->seq.sampling.priority);
        return;
    }
    if (mig_park(d, k)) return;
    if (!recomputable(vs)) {   /* n > 1 whose swap-out failed: it keeps its blocks and waits (grow) */
        vs->stalled = true;
        return;
    }
    prism_kv_blocks_release(&d->blocks, vs->blocks, vs->n_blocks);
    vs->n_blocks = 0;
    vs->preempt = true;
    d->out[k].t.preempted = true;
    d->preempted++;
    PRISM_DEBUG("request %llu preempted (KV pool full): %d tokens to recompute, priority %d",
                (unsigned long long)vs->seq.rid, vs->seq.len + 1, vs->seq.sampling.priority);
}

/* Optimistic admission: every sequence of the step just sampled that goes on takes the block its
 * next position needs (its last token is fed at seq.len). When the pool is empty, a victim leaves
 * (preempt: swapped out, parked for migration or recomputed); while a parked sequence's blocks are
 * on their way back, the sequences short of a block stall (unstall). */
static void grow(decode_t *d)
{
    for (int k = 0; k < d->n_out; k++) {
        seq_t *s = &d->seqs[d->out[k].slot];
        if (!s->grows || s->finishing || s->cancel || s->swapped) continue;
        int need = prism_kv_blocks_for_tokens(&d->blocks, s->seq.len + 1);
        while (!s->preempt && !s->swapped && !s->migrating && s->n_blocks < need) {
            if (d->blocks.n_free > 0) {
                int rc = prism_kv_blocks_alloc(&d->blocks, 1, s->blocks + s->n_blocks);
                PRISM_ASSERT(rc == PRISM_OK);
                (void)rc;
                s->n_blocks++;
                continue;
            }
            if (d->n_parked) {   /* a parked sequence's blocks come back once its KV is out */
                s->stalled = true;
                break;
            }
            int v = victim(d);
            if (v < 0) {   /* only choices of n > 1 that cannot swap: it waits for a block (unstall) */
                PRISM_DEBUG("request %llu choice %u waits for a KV block (n > 1: not recomputed, not migrated)",
                            (unsigned long long)s->seq.rid, s->seq.index);
                s->stalled = true;
                break;
            }
            preempt(d, v);
        }
    }
}

/* Swapped-out sequences come back before any new transfer is admitted: the highest priority (the
 * smallest Sampling.priority), then the oldest, each once blocks for its KV and its next token are
 * free with the watermark to spare (none when nothing else holds blocks: a lone sequence always
 * fits, decode_plan checked). The first that does not fit stops the others (no overtaking). A new
 * step picks them up. Returns how many are still swapped out. */
static int swap_in(decode_t *d)
{
    while (d->n_swapped_seqs > 0) {
        int best = -1, active = 0;
        for (int i = 0; i < d->max_running; i++) {
            const seq_t *s = &d->seqs[i];
            if (!s->seq.used) continue;
            if (!s->swapped) {
                active++;
                continue;
            }
            if (best >= 0) {
                const Prism__Sampling *a = &s->seq.sampling, *b = &d->seqs[best].seq.sampling;
                if (a->priority > b->priority || (a->priority == b->priority && a->arrival_us >= b->arrival_us)) continue;
            }
            best = i;
        }
        PRISM_ASSERT(best >= 0);   /* n_swapped_seqs counts them */
        seq_t *s = &d->seqs[best];
        if (d->test_swap_hold_s > 0 && prism_now_s() < s->t_swapped + d->test_swap_hold_s) break;
        int need = prism_kv_blocks_for_tokens(&d->blocks, s->seq.len + 1), n = s->n_swapped;
        if (need + (active ? d->watermark_blocks : 0) > d->blocks.n_free) break;
        /* an abort releases a swapped-out sequence at once; one never enters a step */
        PRISM_ASSERT(!s->cancel && !s->in_step && !s->finishing && n <= need);
        int rc = prism_kv_blocks_alloc(&d->blocks, need, s->blocks);
        PRISM_ASSERT(rc == PRISM_OK);
        s->n_blocks = need;
        s->n_swapped = 0;
        s->swapped = false;
        d->n_swapped_seqs--;
        if ((rc = prism_kv_swap_in(&d->swap, d->kv, s->swap_slots, n, s->blocks)) != PRISM_OK) {
            PRISM_ERROR("request %llu: its KV could not come back from the swap region: %s",
                        (unsigned long long)s->seq.rid, prism_strerror(rc));
            send_error(d, s->seq.router_id, s->seq.rid, s->seq.rid_hi, PRISM__ERROR_KIND__ERROR_INTERNAL,
                       "decode worker could not bring the KV back from its swap region");
            seq_release(d, s);
            continue;
        }
        PRISM_DEBUG("request %llu swapped in: %d blocks back, %d free", (unsigned long long)s->seq.rid, n,
                    d->blocks.n_free);
    }
    return d->n_swapped_seqs;
}

/* Waits for the step in flight, samples, and keeps each sequence's Tokens message for send_out. */
static void end_step(decode_t *d)
{
    uint64_t t0 = prism_now_ns();
    int rc = prism_llm_forward_end(d->llm, d->logits);
    d->ns_forward += prism_now_ns() - t0;
    if (rc != PRISM_OK) {
        fail_step(d, rc);
        return;
    }
    d->steps++;
    prism_worker_progress(&d->w, 1);
    for (int j = 0; j < d->n_step; j++) {
        seq_t *s = &d->seqs[d->slot_of[j]];
        s->in_step = false;
        if (d->dropped[j] || s->cancel) {
            d->cancelled++;
            if (!s->cancel) d->aborted++;   /* dropped by the between-layer hook before its Abort message */
            seq_release(d, s);
            continue;
        }
        const float *lg = d->logits + (size_t)j * d->cfg.vocab;
        s->seq.len++;
        out_t *o = &d->out[d->n_out++];
        o->slot = d->slot_of[j];
        o->tok = prism_seq_sample(&s->seq, &d->sampler, lg);
        d->tokens_sampled++;
        s->last_token = o->tok;
        prism__tokens__init(&o->t);
        /* finish decided now, so the next step can leave the sequence out; logprobs read lg, which
         * stays intact until the next prism_llm_forward_end */
        prism_seq_tokens(&s->seq, &o->t, &o->tok, &o->lpm, &d->sampler, lg, &d->cfg, d->max_model_len);
        s->finishing = o->t.finish != PRISM__FINISH__FINISH_NONE;
    }
    d->n_step = 0;
    grow(d);
}

/* Streams the last step's tokens to their routers; finished sequences leave. */
static void send_out(decode_t *d)
{
    for (int k = 0; k < d->n_out; k++) {
        out_t *o = &d->out[k];
        seq_t *s = &d->seqs[o->slot];
        if (!s->cancel) {
            Prism__Envelope env = PRISM__ENVELOPE__INIT;
            env.type = PRISM__MSG_TYPE__MSG_TOKENS;
            env.tokens = &o->t;
            if (!s->timed) {   /* its first message: the wait for admission and the first step */
                o->t.queue_ms = (float)((s->t_admit - s->t_kv) * 1e3);
                o->t.step_ms = (float)((prism_now_s() - s->t_admit) * 1e3);
                s->timed = true;
            }
            prism_worker_reply(&d->w, s->seq.router_id, s->seq.rid, s->seq.rid_hi, &env);
            d->tokens_out++;
        }
        if (s->finishing || s->cancel || s->preempt) seq_release(d, s);
    }
    d->n_out = 0;
}

/* One continuous-batching step. With overlap the next step is already on the device when this
 * one's tokens go out (and the loop's message handling runs while it computes). */
static void step(decode_t *d)
{
    if (d->group_failed) return;
    if (!d->n_step && d->test_step_gap_s > 0 && prism_now_s() < d->step_not_before) return;   /* test hook */
    if (!d->n_step) launch_step(d);
    if (!d->n_step) return;
    end_step(d);
    d->step_not_before = prism_now_s() + d->test_step_gap_s;
    if (d->overlap && !d->group_failed) launch_step(d);
    send_out(d);
}

/* A rank is gone: the group cannot compute any more. Every request gets a clean error now (the
 * router answers its client instead of waiting for a timeout) and the leader exits, so the routers
 * drop it and the supervisor restarts the group whole. */
static void fail_group(decode_t *d)
{
    int n = 0;
    const Prism__ErrorKind kind = PRISM__ERROR_KIND__ERROR_UNAVAILABLE;
    for (int i = 0; i < d->max_running; i++) {
        seq_t *s = &d->seqs[i];
        if (!s->seq.used) continue;
        send_error(d, s->seq.router_id, s->seq.rid, s->seq.rid_hi, kind, "the decode worker's tensor-parallel group lost a rank");
        seq_release(d, s);
        n++;
    }
    for (int i = 0; i < d->max_running; i++) d->rx[i].used = false;   /* their sequences were failed above */
    d->n_rx = 0;
    if (d->staged) {
        send_error(d, d->staged_router, d->staged_rid, d->staged_rid_hi, kind, "the decode worker's tensor-parallel group lost a rank");
        unstage(d);
        n++;
    }
    PRISM_ERROR("decode group %s: a rank is gone: %d requests failed, the leader exits so the group restarts",
                d->w.worker_id, n);
}

/* Whether a sequence could join the next step, or KV is arriving (the loop goes on at once). */
static bool steppable(const decode_t *d)
{
    for (int i = 0; i < d->max_running; i++) {
        const seq_t *s = &d->seqs[i];
        if (s->seq.used && (s->receiving || !(s->migrating || s->stalled))) return true;
    }
    return d->n_rx > 0;
}

/* What the next heartbeat says (the I/O thread sends it on its own clock); returns the running count. */
static uint32_t publish_load(decode_t *d)
{
    prism_worker_load_t load = {
        .running = (uint32_t)running(d), .waiting = d->staged ? 1 : 0, .kv_free_blocks = (uint32_t)d->blocks.n_free,
        .kv_waits = d->kv_waits, .tokens_generated = d->tokens_sampled, .seqs_aborted = d->aborted,
        .preempt_recompute = d->preempted, .preempt_swap = d->swap.swapped_out,
        .kv_swap_bytes = prism_kv_swap_used_bytes(&d->swap), .preempt_migrate = d->migrated_out,
        .kv_sent_bytes = d->kv_sent_bytes,
    };
    load.pool_free = (uint32_t)d->max_running - load.running;
    prism_worker_set_load(&d->w, &load);
    return load.running;
}

/* ---- start-up: the decode tier's hooks (worker/start.h) ---- */

static int decode_flags(void *ctx, prism_flag_t *t)
{
    decode_t *d = ctx;
    d->f.block_size = 16;
    d->f.max_running = 64;
    d->f.overlap = "auto";
    d->f.admission = "optimistic";
    d->f.watermark = 0.01;
    d->f.swap_bytes = -1;
    d->f.kv_wire = "auto";
    prism_flag_t f[] = {
        PRISM_FLAG_INT("kv-blocks", &d->f.kv_blocks, "KV cache blocks (0 = fill --mem-budget, else 1024)"),
        PRISM_FLAG_INT("block-size", &d->f.block_size, "Tokens per KV block"),
        PRISM_FLAG_INT("max-running-requests", &d->f.max_running, "Most sequences in one decode batch"),
        PRISM_FLAG_INT("context-length", &d->f.context_length, "Max tokens per sequence (0 = model's max_position_embeddings, at most 131072)"),
        PRISM_FLAG_STR("overlap-steps", &d->f.overlap,
                       "auto (on for devices with streams), on or off: enqueue step n+1 before sending step n's tokens"),
        PRISM_FLAG_STR("kv-admission", &d->f.admission,
                       "optimistic (admit on the prompt's blocks, grow, preempt by recompute when the pool runs out) "
                       "or reserve (admit only when blocks for prompt + max_tokens are free)"),
        PRISM_FLAG_DOUBLE("kv-watermark", &d->f.watermark,
                          "optimistic admission: fraction of the KV blocks left free when admitting (0..0.5)"),
        PRISM_FLAG_BYTES("kv-swap-bytes", &d->f.swap_bytes,
                         "optimistic admission: host memory a sequence's KV is swapped to when the pool runs out "
                         "(it goes on there later; recompute when it does not fit); 0 = off, auto = 4G on a "
                         "device without --mem-budget, else off (on the CPU the pool is host memory already)"),
        PRISM_FLAG_STR("kv-transfer-dtype", &d->f.kv_wire, PRISM_KV_WIRE_FLAG_HELP " (a decode worker sends "
                       "only migrations)"),
    };
    memcpy(t, f, sizeof f);
    return (int)PRISM_ARRAY_LEN(f);
}

static int decode_size(void *ctx, prism_worker_startup_t *s)
{
    decode_t *d = ctx;
    if (d->f.block_size < 1 || d->f.block_size > 1024 || d->f.max_running < 1 || d->f.max_running > 4096) {
        PRISM_ERROR("--block-size must be 1..1024 and --max-running-requests 1..4096");
        return 2;
    }
    if (strcmp(d->f.overlap, "auto") && strcmp(d->f.overlap, "on") && strcmp(d->f.overlap, "off")) {
        PRISM_ERROR("--overlap-steps must be auto, on or off");
        return 2;
    }
    if ((strcmp(d->f.admission, "optimistic") && strcmp(d->f.admission, "reserve")) ||
        !(d->f.watermark >= 0 && d->f.watermark <= 0.5)) {
        PRISM_ERROR("--kv-admission must be optimistic or reserve, --kv-watermark 0..0.5");
        return 2;
    }
    if (d->f.swap_bytes < -1) {
        PRISM_ERROR("--kv-swap-bytes must be 0 or more");
        return 2;
    }
    if (prism_kv_wire_parse(d->f.kv_wire, s->o.compute_dtype, &d->wire) != PRISM_OK) {
        PRISM_ERROR("--kv-transfer-dtype must be auto, f32 or bf16");
        return 2;
    }
    if (d->wire == PRISM_KV_WIRE_BF16)
        PRISM_INFO("KV migrations go out in %s (--kv-transfer-dtype)", prism_kv_wire_name(d->wire));
    d->optimistic = !strcmp(d->f.admission, "optimistic");
    int bs = (int)d->f.block_size;
    d->max_running = (int)d->f.max_running;
    d->max_model_len = prism_model_context_length(&d->cfg, d->f.context_length);
    d->cfg.max_pos = d->max_model_len;   /* the model's block tables are planned for the context served */
    d->max_blocks_per_seq = (d->max_model_len + bs - 1) / bs;
    s->max_blocks_per_seq = d->max_blocks_per_seq;
    s->batch_seqs = s->batch_tokens = d->max_running;   /* one token per sequence and step */
    s->cap = (prism_worker_capacity_t){.block_size = (uint32_t)bs, .max_batch_tokens = (uint32_t)d->max_running,
                                       .max_running = (uint32_t)d->max_running,
                                       .max_model_len = (uint32_t)d->max_model_len};
    return -1;
}

static int decode_load(void *ctx, prism_worker_startup_t *s)
{
    decode_t *d = ctx;
    char err[512] = "";
    int bs = (int)d->f.block_size;
    d->be = s->be;
    if (prism_llm_load(d->be, &d->cfg, s->o.model_path, d->max_running, d->max_running, &d->llm, err, sizeof(err)) !=
        PRISM_OK) {
        PRISM_ERROR("cannot load language model: %s", err);
        return 1;
    }
    s->llm = d->llm;
    /* the transfer layout (whole-model heads: a group's leader takes the whole and scatters) */
    d->fbb = prism_kv_cache_class_block_bytes(&d->full, bs, PRISM_KV_CLASS_FULL);
    d->lbb = prism_kv_cache_class_block_bytes(&d->full, bs, PRISM_KV_CLASS_LOCAL);
    d->ring = prism_kv_local_ring(&d->cfg, bs, 1);
    /* A ring as long as the context saves nothing (and would be reserved per slot): one pool then,
     * every layer in it (the transfer layout is the same; the chunked layers' older blocks are
     * simply never written nor read). */
    if (d->ring >= d->max_blocks_per_seq) d->ring = 0;
    /* Transfers come in pieces of whole-model heads (the leader scatters): the data socket's frames
     * are at most one piece, whatever the prompt (a bigger one drops the sender's connection). */
    s->data_socket = true;
    for (int w = PRISM_KV_WIRE_F32; w <= PRISM_KV_WIRE_BF16; w++)
        d->piece_blocks[w] = prism_kv_piece_blocks(prism_kv_wire_bytes((prism_kv_wire_t)w, PRISM_MAX(d->fbb, d->lbb)));
    s->data_max_msg_bytes = piece_max_bytes(d);
    size_t heap0 = prism_mem_used();   /* token-count tables, matchers' slots, grammar vocabulary: measured */
    if (prism_seq_sampler_init(&d->sampler, &d->cfg, s->o.model_path, d->max_running) != PRISM_OK) {
        PRISM_ERROR("cannot allocate the sampler");
        return 1;
    }
    d->sampling_bytes = prism_mem_used() - heap0;
    return -1;
}

/* Bytes of one block's K/V in the pool: the layers that keep every position (every layer without a
 * split). A swap slot holds one. */
static size_t kv_block_data_bytes(const decode_t *d)
{
    int bs = (int)d->f.block_size;
    return d->ring ? prism_kv_cache_class_block_bytes(&d->cfg, bs, PRISM_KV_CLASS_FULL)
                   : prism_kv_cache_block_bytes(&d->cfg, bs);
}

/* Bytes of one block of the pool: its K/V and its entry in the block manager. */
static size_t kv_block_bytes(const decode_t *d) { return kv_block_data_bytes(d) + prism_kv_blocks_bytes(1); }

/* The swap region's slots (--kv-swap-bytes in whole blocks). auto: vLLM's 4 GiB (swap_space) on a
 * device of its own without a budget; off on the CPU, whose pool is host memory already (a bigger
 * --kv-blocks serves better), and with --mem-budget (sized without it: ask for it). Off too under
 * reserve admission (nothing is preempted) and in a tensor-parallel group (its ranks hold the other
 * KV heads and would have to swap alike: recompute there). */
static int swap_slots(const decode_t *d, const prism_worker_startup_t *s)
{
    int64_t bytes = d->f.swap_bytes;
    if (bytes < 0) bytes = strcmp(d->be->device, "cpu") && s->o.mem_budget <= 0 ? (int64_t)4 << 30 : 0;
    if (!d->optimistic || d->tp.opts.size > 1) bytes = 0;   /* tp.size is set when the group forms, after the plan */
    return (int)PRISM_MIN(bytes / (int64_t)kv_block_data_bytes(d), (int64_t)INT32_MAX);
}

static int decode_plan(void *ctx, prism_worker_startup_t *s)
{
    decode_t *d = ctx;
    prism_mem_plan_t *p = &s->plan;
    int n = d->max_running, bs = (int)d->f.block_size;
    prism_mem_plan_add(p, "weights", prism_llm_weight_bytes(d->llm), PRISM_MEM_LIBRARY);
    prism_mem_plan_add(p, "activations", prism_llm_arena_bytes(&d->cfg, n, n), PRISM_MEM_LIBRARY);
    prism_mem_plan_add(p, "model-host", prism_llm_host_bytes(&d->cfg, n, n), PRISM_MEM_LIBRARY);
    prism_mem_plan_add(p, "sampling", d->sampling_bytes, PRISM_MEM_LIBRARY);
    /* chunked layers: one chunk per sequence, in rings every slot owns from start-up */
    prism_mem_plan_add(p, "kv-rings", (size_t)n * d->ring * prism_kv_cache_class_block_bytes(&d->cfg, bs, PRISM_KV_CLASS_LOCAL),
                       PRISM_MEM_LIBRARY);
    PRISM_PLAN_POOL(p, "sequences", d->seqs, n);
    PRISM_PLAN_POOL(p, "block-tables", d->block_pool, (size_t)n * d->max_blocks_per_seq);
    PRISM_PLAN_POOL(p, "ring-tables", d->ring_pool, (size_t)n * d->ring);
    PRISM_PLAN_POOL(p, "ring-import", d->ring_ids, d->ring);
    PRISM_PLAN_POOL(p, "logits", d->logits, (size_t)n * d->cfg.vocab);
    PRISM_PLAN_POOL(p, "step-results", d->out, n);
    PRISM_PLAN_POOL(p, "kv-receiving", d->rx, n);
    PRISM_PLAN_POOL(p, "kv-migrations", d->mig, n);
    PRISM_PLAN_POOL(p, "kv-migrate-piece", d->mig_piece, piece_f32_bytes(d, d->wire));   /* one piece exported at a time */
    PRISM_PLAN_POOL(p, "kv-widen", d->wide, piece_f32_bytes(d, PRISM_KV_WIRE_BF16));   /* one bf16 piece imported at a time */
    /* KV pieces outside the pool (ZeroMQ's): one being read off the wire, one in the data socket's
     * queue (high-water mark 1) and one handed to the loop (credit 1), whatever the prompt's length */
    prism_mem_plan_add(p, "kv-pieces", 3 * piece_max_bytes(d), PRISM_MEM_OUTSIDE);
    /* and one going out (a migration's piece in the sender's queue, high-water mark 1) */
    prism_mem_plan_add(p, "kv-pieces-out", piece_max_bytes(d), PRISM_MEM_OUTSIDE);
    /* the step in flight, as the model takes it */
    PRISM_PLAN_POOL(p, "step-tokens", d->tokens, n);
    PRISM_PLAN_POOL(p, "step-positions", d->pos0, n);
    PRISM_PLAN_POOL(p, "step-rope-deltas", d->rope_delta, prism_model_mrope(&d->cfg) ? n : 0);   /* M-RoPE models */
    PRISM_PLAN_POOL(p, "step-starts", d->seq_start, n + 1);
    PRISM_PLAN_POOL(p, "step-tables", d->tables, n);
    PRISM_PLAN_POOL(p, "step-rings", d->rings, n);
    PRISM_PLAN_POOL(p, "step-slots", d->slot_of, n);
    PRISM_PLAN_POOL(p, "step-dropped", d->dropped, n);
    /* the swap region: host memory, whole blocks of the pool's layers, slots counted per sequence */
    d->swap_n_slots = swap_slots(d, s);
    PRISM_PLAN_POOL(p, "kv-swap", d->swap_bytes, (size_t)d->swap_n_slots * kv_block_data_bytes(d));
    prism_mem_plan_add(p, "kv-swap-slots", d->swap_n_slots ? prism_kv_blocks_bytes(d->swap_n_slots) : 0,
                       PRISM_MEM_LIBRARY);
    PRISM_PLAN_POOL(p, "swap-tables", d->swap_pool, d->swap_n_slots ? (size_t)n * d->max_blocks_per_seq : 0);
    /* The KV block pool last: without --kv-blocks it takes what the budget leaves. */
    int64_t kv_blocks = d->f.kv_blocks;
    size_t per_block = kv_block_bytes(d);
    if (kv_blocks <= 0) {
        int64_t left = s->o.mem_budget - (int64_t)prism_mem_plan_total(p);
        kv_blocks = s->o.mem_budget <= 0 ? 1024 : left > 0 ? left / (int64_t)per_block : 0;
    }
    kv_blocks = PRISM_MIN(kv_blocks, (int64_t)INT32_MAX);
    prism_mem_plan_add(p, "kv-cache", (size_t)kv_blocks * per_block, PRISM_MEM_LIBRARY);
    if (kv_blocks < d->max_blocks_per_seq) {
        PRISM_ERROR("decode: %lld KV blocks cannot hold one sequence of %d tokens (%d blocks of %d); "
                    "raise --mem-budget or --kv-blocks, or lower --context-length",
                    (long long)kv_blocks, d->max_model_len, d->max_blocks_per_seq, bs);
        prism_mem_plan_check(p, "decode");
        return 1;
    }
    s->cap.kv_blocks = (uint32_t)kv_blocks;
    return -1;
}

static int decode_ready(void *ctx, prism_worker_startup_t *s)
{
    decode_t *d = ctx;
    int kv_blocks = (int)s->cap.kv_blocks, bs = (int)d->f.block_size;   /* the group's */
    prism_mem_plan_set(&s->plan, "kv-cache", (size_t)kv_blocks * kv_block_bytes(d));
    if (prism_kv_cache_create_split(d->be, &d->cfg, kv_blocks, d->max_running * d->ring, bs, &d->kv) != PRISM_OK ||
        prism_kv_blocks_init(&d->blocks, kv_blocks, bs) != PRISM_OK) {
        PRISM_ERROR("cannot allocate the KV cache (%d blocks)", kv_blocks);
        return 1;
    }
    s->kv = d->kv;
    s->logits = d->logits;
    d->watermark_blocks = (int)(d->f.watermark * kv_blocks);
    if (prism_kv_swap_init(&d->swap, d->swap_bytes, d->swap_n_slots, kv_block_data_bytes(d),
                           d->ring ? PRISM_KV_CLASS_FULL : -1) != PRISM_OK) {
        PRISM_ERROR("cannot set up the KV swap region (%d slots)", d->swap_n_slots);
        return 1;
    }
    /* On a device the region is page-locked, so swapping copies by DMA (pageable memory would be
     * staged through the driver's bounce buffers); the CPU backend has nothing to pin. A region
     * that cannot be pinned still works, slower. */
    size_t swap_len = (size_t)d->swap_n_slots * kv_block_data_bytes(d);
    if (swap_len && d->be->i.host_pin) {
        int rc = d->be->i.host_pin(d->be->ctx, d->swap_bytes, swap_len);
        d->swap_pinned = rc == PRISM_OK;
        if (rc != PRISM_OK) PRISM_WARN("the KV swap region could not be pinned (%s): swapping copies through pageable "
                                       "memory", prism_strerror(rc));
    }
    for (int i = 0; d->swap_pool && i < d->max_running; i++)
        d->seqs[i].swap_slots = d->swap_pool + (size_t)i * d->max_blocks_per_seq;
    prism_abort_memo_init(&d->aborts, 600.0);
    /* Test hook (inert unless set): the process dies as the first piece of a migrated sequence comes,
     * as a target killed mid-migration would (tests/integration/test_limits.py). */
    const char *die = getenv("PRISM_TEST_DIE_ON_MIGRATED_KV");
    d->test_die_on_migrated = die && *die && strcmp(die, "0") != 0;
    /* Test hook (inert unless set): a swapped-out sequence stays out at least this long, so that a
     * test can act while it is out (a client leaving) whatever the machine's speed. */
    const char *hold = getenv("PRISM_TEST_SWAP_HOLD_S");
    d->test_swap_hold_s = hold ? PRISM_MIN(PRISM_MAX(atof(hold), 0.0), 60.0) : 0;
    /* Test hook (inert unless set): steps start at least this far apart, so that a test can act
     * while a stream is still generating whatever the machine's speed (it waits without spinning). */
    const char *gap = getenv("PRISM_TEST_DECODE_STEP_GAP_S");
    d->test_step_gap_s = gap ? PRISM_MIN(PRISM_MAX(atof(gap), 0.0), 1.0) : 0;
    if (d->test_step_gap_s > 0)
        PRISM_WARN("test hook PRISM_TEST_DECODE_STEP_GAP_S is set: decode steps start %.3f s apart at least",
                   d->test_step_gap_s);
    for (int i = 0; i < d->max_running; i++) d->seqs[i].blocks = d->block_pool + (size_t)i * d->max_blocks_per_seq;
    for (int i = 0; i < d->max_running * d->ring; i++) d->ring_pool[i] = i;
    for (int i = 0; d->ring && i < d->max_running; i++) d->seqs[i].ring = d->ring_pool + (size_t)i * d->ring;
    /* On the CPU a step computes inside begin: overlapping would only delay each token by a step
     * ("on" exists to test the pipeline without a GPU). */
    d->overlap = !strcmp(d->f.overlap, "on") || (!strcmp(d->f.overlap, "auto") && strcmp(d->be->device, "cpu") != 0);
    if (s->leader) {
        d->hook = (prism_model_hook_t){hook_layer, hook_cancelled, d};
        prism_llm_set_hook(d->llm, &d->hook);
        publish_load(d);   /* the first heartbeat already tells the truth */
    }
    return -1;
}

/* After start-up and registration (tier->run): the loop, then everything closed. */
static int decode_run(void *ctx)
{
    decode_t *d = ctx;
    char sw[32];
    PRISM_INFO("decode: %d KV blocks x %d tokens, batch %d, %s admission, swap %s%s%s%s", d->blocks.n_blocks,
               d->blocks.block_size, d->max_running, d->optimistic ? "optimistic" : "reserve",
               d->swap.slots.n_blocks ? prism_fmt_bytes(d->swap.slots.n_blocks * d->swap.slot_bytes, sw, sizeof sw) : "off",
               d->swap_pinned ? " (pinned)" : "",
               d->overlap ? ", host work overlapped with the device" : "",
               d->ring ? ", chunked-attention layers in per-sequence rings" : "");
    if (d->ring) {
        char a[32], b2[32];
        PRISM_INFO("decode: chunked-attention layers keep a ring of %d blocks per sequence (%s per block, %s per "
                   "block of the other layers)", d->ring, prism_fmt_bytes(d->lbb, a, sizeof a),
                   prism_fmt_bytes(d->fbb, b2, sizeof b2));
    }

    int code = 0;
    while (!prism_worker_should_stop()) {
        if (d->group_failed || prism_tp_check(&d->tp) != PRISM_OK) {
            fail_group(d);
            code = PRISM_EXIT_PEER_LOST;
            break;
        }
        bool busy = publish_load(d) > 0;
        unstall(d);   /* before admissions: the blocks freed go to the running sequences first */
        admit_staged(d);
        prism_worker_accept_data(&d->w, data_credit(d));
        /* only parked and stalled sequences: they wait for the router's Migrate, a piece sent or an
         * abort (no spin) */
        prism_worker_poll(&d->w, !busy ? 50 : !steppable(d) || d->test_step_gap_s > 0 ? 1 : 0, on_msg, d);
        /* transfers arriving: take the pieces already here (a few per step, each a copy into blocks) */
        for (int k = 0; k < 16 && d->n_rx; k++) {
            uint64_t got = d->w.data_received;
            prism_worker_accept_data(&d->w, data_credit(d));
            prism_worker_poll(&d->w, 1, on_msg, d);
            if (d->w.data_received == got) break;
        }
        rx_expire(d, prism_now_s());
        mig_tick(d, prism_now_s());
        step(d);
    }
    if (d->n_step && !code) prism_llm_forward_end(d->llm, d->logits);   /* let the device finish before exit */
    const prism_comm_t *comm = prism_group_comm(d->tp.g);
    /* tests/bench/bench_tp.py reads this line */
    PRISM_INFO("decode worker stopping: %llu steps, %llu tokens; step forward %.3f ms mean, collectives %.1f%% of it "
               "(%llu ops, tp %d over %s); %llu sequences cancelled, %llu preempted", (unsigned long long)d->steps,
               (unsigned long long)d->tokens_out, d->steps ? d->ns_forward / 1e6 / (double)d->steps : 0.0,
               d->ns_forward ? 100.0 * (double)comm->ns_in_ops / (double)d->ns_forward : 0.0,
               (unsigned long long)comm->n_ops, d->tp.size, prism_group_transport(d->tp.g),
               (unsigned long long)d->cancelled, (unsigned long long)d->preempted);
    PRISM_INFO("decode worker stopping: %llu sequences swapped out, %llu swapped in", (unsigned long long)d->swap.swapped_out,
               (unsigned long long)d->swap.swapped_in);
    if (d->swap_pinned) d->be->i.host_unpin(d->be->ctx, d->swap_bytes);
    d->swap_pinned = false;
    prism_kv_swap_free(&d->swap);
    prism_seq_sampler_free(&d->sampler);
    return code;
}

static const prism_worker_tier_t k_decode_tier = {
    .role = "decode", .proto_role = PRISM__ROLE__ROLE_DECODE,
    .summary = "Prism decode worker: paged KV cache, continuous batching and sampling.",
    .flags = decode_flags, .size = decode_size, .load = decode_load, .plan = decode_plan, .ready = decode_ready,
    .run = decode_run,
    .group = &prism_tp_group,
};

int main(int argc, char **argv)
{
    static decode_t d;
    prism_worker_startup_t s = {.w = &d.w, .cfg = &d.cfg, .full = &d.full, .group = &d.tp};
    return prism_worker_main(&k_decode_tier, &d, &s, argc, argv);
}
