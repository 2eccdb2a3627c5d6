/* comm: collectives between the T rank processes of a tensor-parallel group.
 *
 * A communicator is a struct of function pointers plus a `void *ctx` (the backend.h pattern), so
 * the model calls collectives without knowing how they travel:
 *
 *   prism_comm_t *c = prism_group_comm(group);          // made by the group (group.h)
 *   c->i.all_reduce_sum(c->ctx, x, n);                   // x[n] summed over the ranks, in place
 *   c->i.all_gather(c->ctx, out, mine, bytes);           // out[r*bytes..] = rank r's bytes
 *   c->i.broadcast(c->ctx, buf, bytes, 0);               // rank 0's bytes everywhere
 *   if (c->i.wait(c->ctx) != PRISM_OK) { the group is dead: exit, the supervisor restarts it }
 *
 * Implementations:
 *  - shm   (CPU, ranks on one host): a shared-memory segment with futex barriers (comm_shm.c);
 *  - zmq   (CPU, ranks on several hosts): a star over the group's ZeroMQ link (comm_zmq.c);
 *  - nccl  (--device cuda): the separate module libprism_comm_nccl.so, opened with dlopen only
 *          when a CUDA group forms, so a CPU run maps no NCCL (comm_nccl.c).
 *
 * Rules every implementation follows:
 *  - Buffers are DEVICE pointers of the backend the communicator was made for (host memory on the
 *    CPU backend). Sizes are elements (all_reduce_sum: float32) or bytes.
 *  - Every rank calls the same collectives in the same order with the same sizes: that is the
 *    caller's contract (the leader's step plan guarantees it). A size mismatch is detected where the
 *    transport can see it (zmq) and breaks the group.
 *  - all_reduce_sum gives bit-identical results on every rank (the residual stream of every rank
 *    must stay identical), summing in rank order 0..T-1 on CPU; NCCL's ring/tree give every rank the
 *    same bits too.
 *  - Ops may be asynchronous (NCCL enqueues on the backend's stream); `wait` returns when every op
 *    issued so far has completed. The CPU implementations complete each op before returning.
 *  - Failure is final: when a peer dies (its process is gone, its link closed) or an op waits longer
 *    than the step timeout, the op returns PRISM_EIO, the communicator is marked broken (NCCL:
 *    ncclCommAbort) and every later call returns PRISM_EIO at once. Peers blocked in the same op
 *    notice within about a tenth of a second (shm: a flag in the segment and liveness checks of the
 *    peers' processes; zmq: the link's disconnect events; nccl: the group's liveness check between
 *    polls). A group never heals: its processes exit and are restarted together (group.h).
 *  - No op allocates memory: scratch (segments, staging) is sized when the communicator is made.
 *  - A NULL optional member means "not supported".
 */
#ifndef PRISM_COMM_H
#define PRISM_COMM_H

#include "core/core.h"

#define PRISM_TP_MAX 64            /* ranks per group */

typedef struct prism_comm_i {
    const char *(*name)(void *ctx);                         /* "shm" | "zmq" | "nccl" | "single" */
    /* buf[n] (float32) = sum over ranks of every rank's buf[n], in place. */
    int (*all_reduce_sum)(void *ctx, float *buf, size_t n);
    /* out[r*bytes .. (r+1)*bytes) = rank r's in[bytes], for every r; out holds size*bytes.
     * in may not overlap out. */
    int (*all_gather)(void *ctx, void *out, const void *in, size_t bytes);
    /* buf[bytes] of rank root copied to every rank's buf. */
    int (*broadcast)(void *ctx, void *buf, size_t bytes, int root);
    /* Returns when every op issued so far is complete (PRISM_EIO if the group failed meanwhile). */
    int (*wait)(void *ctx);
    /* Marks the communicator broken (peers blocked in an op fail fast where the transport can tell
     * them: shm, nccl abort). Safe to call more than once. */
    void (*abort)(void *ctx);
    void (*destroy)(void *ctx);
} prism_comm_i;

typedef struct prism_comm {
    prism_comm_i i;
    void *ctx;
    int size, rank;
    double timeout_s;              /* step timeout: longest wait for the peers inside one op */
    /* Statistics the benchmarks report (collective share of a step): ops issued and the wall time
     * spent inside them (for asynchronous transports, time to enqueue plus time in wait). */
    uint64_t n_ops;
    uint64_t ns_in_ops;
} prism_comm_t;

/* A communicator of one rank (every op is a copy or nothing): lets code paths run unchanged at
 * T = 1. Never fails. */
prism_comm_t *prism_comm_single_create(void);
void prism_comm_destroy(prism_comm_t *c);

/* ---- timed wrappers the model calls (header-only, so prism_model needs no transport library) ----
 * They count ops and the wall time spent in them for the statistics. */
#define PRISM_COMM_TIMED_(c, call) do { uint64_t t0_ = prism_now_ns(); int rc_ = (call); \
        (c)->n_ops++; (c)->ns_in_ops += prism_now_ns() - t0_; return rc_; } while (0)
static inline int prism_comm_all_reduce_sum(prism_comm_t *c, float *buf, size_t n)
{ PRISM_COMM_TIMED_(c, c->i.all_reduce_sum(c->ctx, buf, n)); }
static inline int prism_comm_all_gather(prism_comm_t *c, void *out, const void *in, size_t bytes)
{ PRISM_COMM_TIMED_(c, c->i.all_gather(c->ctx, out, in, bytes)); }
static inline int prism_comm_broadcast(prism_comm_t *c, void *buf, size_t bytes, int root)
{ PRISM_COMM_TIMED_(c, c->i.broadcast(c->ctx, buf, bytes, root)); }
static inline int prism_comm_wait(prism_comm_t *c)
{
    uint64_t t0 = prism_now_ns();
    int rc = c->i.wait(c->ctx);
    c->ns_in_ops += prism_now_ns() - t0;
    return rc;
}

#endif
