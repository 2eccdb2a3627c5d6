/* tp: the worker side of a tensor-parallel group (--tp-size T --tp-rank r --tp-leader tcp://host:port).
 *
 * The group (comm/group.h) is T worker processes, one device each. Rank 0, the leader, is the worker
 * the routers know: it registers (with the capacity of the group's smallest rank), receives requests
 * and KV, owns admission, the block tables and sampling. The other ranks connect to no router; they
 * follow the leader over the group's link:
 *
 *   leader                                         rank r > 0
 *   prism_tp_join, prism_tp_setup    <-- link -->  prism_tp_join, prism_tp_setup
 *   per admitted request: prism_tp_scatter_kv  -->  imports its KV heads        (MSG_TP_KV)
 *   per step: prism_tp_send_step + forward     -->  the same forward            (MSG_TP_STEP)
 *             (begin only for a prompt chunk       (begin only too)
 *             whose logits are not needed)
 *   at exit: prism_tp_stop                      -->  exits 0                     (MSG_TP_STOP)
 *                                                   (all of this inside prism_tp_follow)
 *
 * A step plan carries everything a rank needs (tokens, positions, every block table), so the ranks
 * hold no request state: only their heads of the KV cache. Ranks have no worker I/O thread and no
 * between-layer hook: aborts reach the leader alone, which applies them between plans. Every rank's forward makes the same
 * collectives in the same order because the leader sends each plan before running it itself and the
 * link delivers in order.
 *
 * Failure: a group never heals (group.h). A rank that dies makes the leader's next collective (or
 * prism_tp_check) fail: the leader fails its requests and exits, the router drops it as it drops any
 * dead worker, and the supervisor restarts the processes, which form a new group. A leader that dies
 * closes the link: the ranks see it in prism_tp_follow and exit 1.
 */
#ifndef PRISM_TP_H
#define PRISM_TP_H

#include "core/core.h"
#include "core/cli.h"
#include "comm/group.h"
#include "model/model.h"

typedef struct {
    int64_t size, rank;
    const char *leader;          /* the leader's group endpoint, tcp://host:port */
    const char *transport;       /* auto | shm | zmq (CPU) */
    double timeout_s;            /* step timeout of one collective */
} prism_tp_opts_t;

#define PRISM_TP_N_FLAGS 5
#define PRISM_TP_FLAGS(o) \
    PRISM_FLAG_INT("tp-size", &(o)->size, "Tensor-parallel group size: ranks (processes, one device each) of this worker"), \
    PRISM_FLAG_INT("tp-rank", &(o)->rank, "This process's rank in the group (0 = the leader, which the routers see)"), \
    PRISM_FLAG_STR("tp-leader", &(o)->leader, "The group's link: tcp://host:port the leader binds (one address, never *)"), \
    PRISM_FLAG_STR("tp-transport", &(o)->transport, "CPU collectives: auto (shared memory on one host), shm or zmq"), \
    PRISM_FLAG_DOUBLE("tp-timeout", &(o)->timeout_s, "Seconds one collective may wait for the other ranks")

void prism_tp_opts_defaults(prism_tp_opts_t *o);
/* Checks the flags (message logged): PRISM_EINVAL when size/rank/leader do not make a group. */
int  prism_tp_opts_check(const prism_tp_opts_t *o);
/* A worker's start: checks the flags, keeps the whole model's config in *full and turns *cfg into
 * this rank's shard (size > 1). PRISM_EINVAL (message logged) for bad flags, a model that does not
 * split size ways, or one with chunked-attention layers (Llama-4: --tp-size 1 for now). */
int  prism_tp_opts_apply(const prism_tp_opts_t *o, prism_model_config_t *cfg, prism_model_config_t *full);

/* What each rank can hold, exchanged once after the group forms. */
typedef struct {
    int kv_blocks, block_size, max_seqs, max_tokens;
} prism_tp_setup_t;

typedef struct {
    prism_tp_opts_t opts;              /* the flags (kept by prism_tp_join) */
    prism_group_t *g;
    int size, rank;
    uint64_t step;
    prism_tp_setup_t setup;
    const prism_model_config_t *cfg;   /* the rank's (sharded) config */
    prism_model_config_t full;         /* the same model at T = 1: the layout of KV from prefill */
    prism_tp_shard_t shard[PRISM_TP_MAX];
    int max_blocks_per_seq;
    int32_t *plan;                     /* encode/decode buffer of one step plan */
    size_t plan_cap;                   /* int32 entries */
    const int32_t **tables;            /* [max_seqs] (ranks) */
    float *rows;                       /* [max_tokens][embedding row]: a step's embedding rows, contiguous */
    const float **row_ptrs;            /* [max_tokens] (ranks) */
    uint8_t *kv_scratch;               /* one sequence's KV slice */
    size_t kv_scratch_bytes;
    uint64_t steps_followed;
} prism_tp_t;

/* Heap prism_tp_setup allocates for a group of `size` (the step plan, a chunk's embedding rows, one
 * request's KV heads): none for a group of one, which sends nothing. */
size_t prism_tp_buffer_bytes(const prism_model_config_t *cfg, int size, const prism_tp_setup_t *s, int max_blocks_per_seq);

/* A worker tier's group at start-up (worker/start.h): its flags (into prism_tp_t.opts), the shard,
 * the plan's regions, join + capacity exchange, a rank's follow loop. The tier's group state is a
 * prism_tp_t. */
struct prism_worker_group_i;
extern const struct prism_worker_group_i prism_tp_group;

/* Forms the group (blocks up to the rendezvous timeout). cfg: already sharded with
 * prism_model_config_set_tp; net: the process's (the leader's worker net, a rank's own). */
struct prism_net;
int  prism_tp_join(prism_tp_t *t, const prism_tp_opts_t *o, struct prism_net *net, prism_backend_t *be,
                   const prism_model_config_t *cfg, const char *name, int max_blocks_per_seq, int block_size);
/* Exchanges capacities: *s in = this rank's; out = the group's (the smallest kv_blocks; the other
 * fields must be equal on every rank, else PRISM_EINVAL on every rank with the reason logged).
 * Sizes the plan buffers. */
int  prism_tp_setup(prism_tp_t *t, prism_tp_setup_t *s);
void prism_tp_close(prism_tp_t *t);

/* PRISM_OK while every rank is alive as far as this process can tell (cheap, every loop). */
int  prism_tp_check(prism_tp_t *t);

/* Leader: sends batch b to every rank (call right before prism_llm_forward with the same b; with
 * logits false, before a prism_llm_forward_begin that is never ended: the ranks skip the end too).
 * Embeddings travel as embed_rows (copied into the plan); b->embeds/embed_mask are not supported.
 * The plan is the only way a rank learns what to compute: the leader drops an aborted request by
 * leaving it out of the next plan, never in the middle of one (model.h, prism_model_hook_t). */
int  prism_tp_send_step(prism_tp_t *t, const prism_llm_batch_t *b, bool logits);
/* Leader: n_blocks blocks of whole-model KV (T = 1 export layout) into `blocks`: each rank gets its
 * heads (MSG_TP_KV), the leader imports its own into kv. */
int  prism_tp_scatter_kv(prism_tp_t *t, prism_kv_cache_t *kv, const int32_t *blocks, int n_blocks, const void *whole);
/* Leader: the whole-model KV (T = 1 export layout, what a decode worker of any TP size takes) of
 * n_blocks blocks: every rank sends its heads (MSG_TP_KV, gather), the leader merges them with its
 * own into whole. PRISM_EIO when the group failed meanwhile. */
int  prism_tp_gather_kv(prism_tp_t *t, prism_kv_cache_t *kv, const int32_t *blocks, int n_blocks, void *whole);
/* Leader: tells the ranks to exit (clean shutdown). */
void prism_tp_stop(prism_tp_t *t);

/* Rank r > 0: follows the leader until MSG_TP_STOP or a stop signal (returns 0), or until the group
 * fails (returns PRISM_EXIT_PEER_LOST) or the leader sends something impossible (returns 1).
 * logits: [max_seqs][vocab] scratch. */
int  prism_tp_follow(prism_tp_t *t, prism_llm_t *llm, prism_kv_cache_t *kv, float *logits);

#endif
