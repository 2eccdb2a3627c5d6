/* Shared by the worker message harnesses (fuzz_prefill_msgs, fuzz_decode_msgs, fuzz_encoder_msgs):
 * the harness stands in for the worker's I/O thread (common/worker/io.c). The worker is built by its
 * own start-up (prism_worker_open with the tier's hooks, k_<tier>_tier in <tier>_worker/main.c,
 * compiled into the harness) with one router link to an inproc endpoint nobody binds, and never
 * started: no I/O thread runs. Instead:
 *   inbound   the input's messages are unpacked with prism_msg_unpack (as the I/O thread does; a
 *             malformed envelope is dropped there) and handed to the worker's real on_msg, in the
 *             order, at the time and within the data credit the I/O thread would: router Aborts are
 *             recorded in the worker's abort table when they arrive (what the between-layer check
 *             reads), data messages pass only within the credit the loop granted.
 *   outbound  replies (prism_worker_reply) land in the channel's I/O end (w->io_pair); the harness
 *             reads them after every step, checks each envelope, and drops them.
 *   peers     the endpoints a message names for the worker to push to (a prefill's decode endpoint,
 *             an encoder's prefill endpoint) are confined to inproc: FUZZ_PEER_EP is bound by the
 *             harness (the transfer is read back and checked), another inproc name is a peer that
 *             never takes anything (backpressure), and a string without "://" fails to connect.
 *             Any other transport becomes FUZZ_PEER_EP: no packet leaves the process.
 *
 * Input: a sequence of records, each
 *   op:u8   op & 7: 0 a message from the router (source 0)      1 from the data socket (source -1)
 *                   2 one turn of the worker's loop             3 a router message that arrives while
 *                                                                 the next turn computes (after it)
 *                   4..7 a turn as 2
 *   message (ops 0, 1, 3):  env_len:u16le envelope[env_len]  n_frames:u8 (mod 9)  frame*
 *   frame:   kind:u8  0: len:u16le bytes[len]
 *                     1: len:u24le pattern[4]: len bytes of the 4-byte pattern repeated (large frames,
 *                        e.g. an image's embeddings, from a few input bytes)
 * After the input the harness runs turns until the queues are empty, aborts every request the worker
 * still holds (through on_msg, as the router would) and checks that every slot, page and block is
 * back. */
#ifndef PRISM_FUZZ_WORKER_H
#define PRISM_FUZZ_WORKER_H

#include "fuzz_common.h"
#include "worker/worker.h"
#include "kv/prefix.h"   /* PrefixEvents' bounds */

#include <errno.h>
#include <signal.h>

#define FUZZ_ROUTER_ID "r1"                          /* the router the worker registered with */
#define FUZZ_ROUTER_EP "inproc://prism-fuzz-router"  /* never bound: nothing is sent there */
#define FUZZ_PEER_EP "inproc://prism-fuzz-peer"      /* bound by the harness: transfers are read back */
#define FUZZ_QUEUE 48                                /* messages of one input at most */
#define FUZZ_MAX_FRAMES 8
#define FUZZ_MAX_BYTES (4u << 20)                    /* frame bytes of one input at most */

typedef struct {
    prism_msg_t m;
    int source;
    bool late;       /* arrives during the next turn's compute: handled at the turn after */
} fuzz_in_t;

typedef struct {
    fuzz_in_t q[FUZZ_QUEUE];
    int n;
    size_t bytes;
    size_t data_max;     /* ZMQ_MAXMSGSIZE of the data socket: a bigger frame never arrives */
    void *peer;          /* PULL bound at FUZZ_PEER_EP */
    uint64_t replies, transfers;
} fuzz_io_t;

/* Reads the worker's tier's flags through its real start-up. */
static inline void fuzz_worker_argv(const char *prog, const char **extra, int n_extra, int *argc, char ***argv)
{
    static const char *v[64];
    static char model[512];
    int n = 0;
    snprintf(model, sizeof(model), "%s/models/prism-tiny-llava", PRISM_SOURCE_DIR);
    v[n++] = prog;
    const char *common[] = {"--model-path", model, "--router", FUZZ_ROUTER_EP, "--insecure-no-curve",
                            "--worker-id", "fuzz-worker", "--log-level", "error", "--threads", "1"};
    for (size_t i = 0; i < PRISM_ARRAY_LEN(common); i++) v[n++] = common[i];
    for (int i = 0; i < n_extra && n < 63; i++) v[n++] = extra[i];
    v[n] = NULL;
    *argc = n;
    *argv = (char **)v;
}

/* After start-up: the router link counts as registered (replies to FUZZ_ROUTER_ID go to the
 * channel), libFuzzer keeps its signal handlers, logging is silent, the peer end is bound. */
static inline void fuzz_io_setup(fuzz_io_t *io, prism_worker_t *w, const struct sigaction *old_int,
                                 const struct sigaction *old_term, size_t data_max)
{
    sigaction(SIGINT, old_int, NULL);
    sigaction(SIGTERM, old_term, NULL);
    prism_log_init("fuzz", PRISM_LOG_ERROR + 1);
    PRISM_ASSERT(w->n_routers == 1);
    snprintf(w->routers[0].router_id, sizeof(w->routers[0].router_id), "%s", FUZZ_ROUTER_ID);
    w->routers[0].registered = true;
    io->data_max = data_max;
    io->peer = zmq_socket(prism_net_zctx(w->net), ZMQ_PULL);
    int hwm = 1000, linger = 0;
    zmq_setsockopt(io->peer, ZMQ_RCVHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(io->peer, ZMQ_LINGER, &linger, sizeof(linger));
    FUZZ_ASSERT(io->peer && zmq_bind(io->peer, FUZZ_PEER_EP) == 0);
}

static inline bool fuzz_take(const uint8_t **d, size_t *n, void *out, size_t k)
{
    if (*n < k) return false;
    memcpy(out, *d, k);
    *d += k;
    *n -= k;
    return true;
}

/* Keeps an endpoint a message names inside the process (see the top of this file). */
static inline void fuzz_confine(char **ep, char **saved, char *buf, size_t buf_len)
{
    *saved = *ep;
    if (!*ep || !strstr(*ep, "://") || !strncmp(*ep, "inproc://", 9)) return;
    snprintf(buf, buf_len, "%s", FUZZ_PEER_EP);
    *ep = buf;
}

/* Parses one message record into the queue (a router Abort is recorded at once, as the I/O thread
 * does); false at the end of the input. A record the I/O thread would never hand over (a malformed
 * envelope, a frame over the data socket's bound) is consumed and dropped. */
static inline void fuzz_record_abort(prism_worker_t *w, const Prism__Envelope *e);

static inline bool fuzz_read_msg(fuzz_io_t *io, prism_worker_t *w, const uint8_t **d, size_t *n, int source, bool late)
{
    uint16_t len;
    uint8_t nf;
    if (!fuzz_take(d, n, &len, 2) || *n < len) return false;
    const uint8_t *env_bytes = *d;
    *d += len;
    *n -= len;
    if (!fuzz_take(d, n, &nf, 1)) return false;
    nf %= FUZZ_MAX_FRAMES + 1;
    fuzz_in_t *in = io->n < FUZZ_QUEUE ? &io->q[io->n] : NULL;
    prism_msg_t tmp;
    prism_msg_t *m = in ? &in->m : &tmp;
    memset(m, 0, offsetof(prism_msg_t, frames));
    m->n_frames = 0;
    m->identity_len = 0;
    m->src_fd = -1;
    bool ok = in != NULL;
    for (int f = 0; f < nf; f++) {
        uint8_t kind;
        uint32_t flen = 0;
        const uint8_t *src = NULL;
        uint8_t pat[4];
        if (!fuzz_take(d, n, &kind, 1)) break;
        if (kind & 1) {
            uint8_t l3[3];
            if (!fuzz_take(d, n, l3, 3) || !fuzz_take(d, n, pat, 4)) break;
            flen = (uint32_t)l3[0] | (uint32_t)l3[1] << 8 | (uint32_t)l3[2] << 16;
        } else {
            uint16_t l2;
            if (!fuzz_take(d, n, &l2, 2) || *n < l2) break;
            flen = l2;
            src = *d;
            *d += l2;
            *n -= l2;
        }
        if (!ok || io->bytes + flen > FUZZ_MAX_BYTES || (source < 0 && flen > io->data_max)) {
            ok = false;
            continue;
        }
        zmq_msg_t *z = &m->frames[m->n_frames++];
        FUZZ_ASSERT(zmq_msg_init_size(z, flen) == 0);
        uint8_t *dst = zmq_msg_data(z);
        if (src) memcpy(dst, src, flen);
        else
            for (uint32_t i = 0; i < flen; i++) dst[i] = pat[i & 3];
        io->bytes += flen;
    }
    m->env = ok ? prism_msg_unpack(env_bytes, len) : NULL;
    if (!m->env) {
        prism_msg_close(m);
        return true;
    }
    in->source = source;
    in->late = late;
    io->n++;
    if (source >= 0 && m->env->type == PRISM__MSG_TYPE__MSG_ABORT) fuzz_record_abort(w, m->env);
    return true;
}

/* The I/O thread's record of a router Abort (io.c record_abort), made when the message arrives. */
/* Plays an input's records (format above) until they run out: messages are queued, ops 2 and 4..7
 * run one turn. data_source is the source op 1's messages get: -1, the data socket, or 0 for a
 * worker that has none. Then turns until the queue is empty (at most two per slot). */
static inline void fuzz_play(fuzz_io_t *io, prism_worker_t *w, const uint8_t **d, size_t *n, int data_source,
                             void (*turn)(void))
{
    for (;;) {
        uint8_t op;
        if (!fuzz_take(d, n, &op, 1)) break;
        op &= 7;
        if (op == 0 || op == 1 || op == 3) {
            if (!fuzz_read_msg(io, w, d, n, op == 1 ? data_source : 0, op == 3)) break;
        } else {
            turn();
        }
    }
    for (int k = 0; k < 2 * FUZZ_QUEUE && io->n; k++) turn();
}

static inline void fuzz_record_abort(prism_worker_t *w, const Prism__Envelope *e)
{
    pthread_mutex_lock(&w->mu);
    prism_worker_abort_t *a = &w->aborts[w->n_aborts % PRISM_WORKER_ABORTS];
    a->rid = e->request_id;
    snprintf(a->router_id, sizeof(a->router_id), "%s", e->router_id ? e->router_id : "");
    a->t_arrive = prism_now_s();
    w->n_aborts++;
    pthread_mutex_unlock(&w->mu);
    atomic_fetch_add(&w->abort_seq, 1);
}

/* Hands the queued messages to on_msg as the I/O thread and prism_worker_poll would: router messages
 * in order, data messages while credit lasts (the others stay queued), late ones not yet (they are
 * due at the next poll). */
static inline void fuzz_poll(fuzz_io_t *io, prism_worker_t *w, int credit, prism_worker_msg_fn fn, void *ud)
{
    int kept = 0;
    for (int i = 0; i < io->n; i++) {
        fuzz_in_t *in = &io->q[i];
        bool go = !in->late && (in->source >= 0 || credit > 0);
        if (!go) {
            in->late = false;
            if (kept != i) {
                fuzz_in_t *to = &io->q[kept];
                *to = (fuzz_in_t){.source = in->source, .late = in->late};
                to->m.env = in->m.env;
                to->m.src_fd = -1;
                for (int f = 0; f < in->m.n_frames; f++) {
                    zmq_msg_init(&to->m.frames[f]);
                    zmq_msg_move(&to->m.frames[f], &in->m.frames[f]);
                    zmq_msg_close(&in->m.frames[f]);
                }
                to->m.n_frames = in->m.n_frames;
                in->m.n_frames = 0;
                in->m.env = NULL;
            }
            kept++;
            continue;
        }
        if (in->source < 0) credit--, w->data_received++;
        fn(w, &in->m, in->source, ud);
        prism_msg_close(&in->m);
    }
    io->n = kept;
}

/* Reads what the compute thread sent: replies to routers (each a whole envelope for FUZZ_ROUTER_ID,
 * of the type the tier answers with) and transfers to FUZZ_PEER_EP (handed to check, may be NULL). */
typedef void (*fuzz_transfer_fn)(prism_msg_t *m, void *ud);
static inline void fuzz_drain(fuzz_io_t *io, prism_worker_t *w, Prism__MsgType reply_type, fuzz_transfer_fn check,
                              void *ud)
{
    for (;;) {
        zmq_msg_t route;
        zmq_msg_init(&route);
        if (zmq_msg_recv(&route, w->io_pair, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&route);
            break;
        }
        int32_t slot;
        FUZZ_ASSERT(zmq_msg_size(&route) == 8);
        memcpy(&slot, zmq_msg_data(&route), sizeof(slot));
        int more = 0;
        size_t sz = sizeof(more);
        zmq_getsockopt(w->io_pair, ZMQ_RCVMORE, &more, &sz);
        zmq_msg_close(&route);
        if (slot < 0) {   /* a wake-up of the I/O thread */
            FUZZ_ASSERT(!more);
            continue;
        }
        FUZZ_ASSERT(slot == 0 && more);
        zmq_msg_t env;
        zmq_msg_init(&env);
        int got;
        while ((got = zmq_msg_recv(&env, w->io_pair, 0)) < 0 && errno == EINTR) {}   /* libFuzzer's SIGALRM */
        FUZZ_ASSERT(got >= 0);
        zmq_getsockopt(w->io_pair, ZMQ_RCVMORE, &more, &sz);
        FUZZ_ASSERT(!more);   /* replies carry no raw frames */
        Prism__Envelope *e = prism_msg_unpack(zmq_msg_data(&env), zmq_msg_size(&env));
        if (e && e->type == PRISM__MSG_TYPE__MSG_PREFIX_EVENTS) {
            /* a prefill's prefix-cache events, to every router: whole keys, within the bound */
            const Prism__PrefixEvents *ev = e->prefix_events;
            const size_t kb = PRISM_KV_PREFIX_KEY_BYTES, max = PRISM_KV_PREFIX_EVENTS * kb;
            FUZZ_ASSERT(reply_type == PRISM__MSG_TYPE__MSG_TOKENS && ev && ev->stored.len % kb == 0 &&
                        ev->evicted.len % kb == 0 && ev->stored.len <= max && ev->evicted.len <= max);
            prism_msg_env_free(e);
            zmq_msg_close(&env);
            continue;
        }
        FUZZ_ASSERT(e && e->type == reply_type && e->router_id && !strcmp(e->router_id, FUZZ_ROUTER_ID));
        FUZZ_ASSERT(reply_type != PRISM__MSG_TYPE__MSG_TOKENS || e->tokens);
        FUZZ_ASSERT(reply_type != PRISM__MSG_TYPE__MSG_ENCODE_DONE || e->encode_done);
        prism_msg_env_free(e);
        zmq_msg_close(&env);
        io->replies++;
    }
    for (;;) {
        prism_msg_t m;
        int rc = prism_msg_recv(io->peer, false, &m, ZMQ_DONTWAIT);
        if (rc == PRISM_EAGAIN) break;
        if (rc == PRISM_EIO && errno == EINTR) continue;   /* libFuzzer's SIGALRM (-timeout) */
        FUZZ_ASSERT(rc == PRISM_OK);   /* what the worker sends unpacks */
        if (check) check(&m, ud);
        prism_msg_close(&m);
        io->transfers++;
    }
}

/* Between inputs: nothing of one input reaches the next (the abort table, peer links and what is
 * queued on them). */
static inline void fuzz_io_reset(fuzz_io_t *io, prism_worker_t *w)
{
    for (int i = 0; i < io->n; i++) prism_msg_close(&io->q[i].m);
    io->n = 0;
    io->bytes = 0;
    pthread_mutex_lock(&w->mu);
    w->n_aborts = 0;
    pthread_mutex_unlock(&w->mu);
    w->aborts_seen = atomic_load(&w->abort_seq);
    for (int i = 0; i < w->n_peers; i++) zmq_close(w->peers[i].sock);   /* linger 0: queued messages go */
    w->n_peers = 0;
}

/* Sends the worker an Abort for (rid, router) through its real handler, from the router. */
static inline void fuzz_abort(prism_worker_t *w, prism_worker_msg_fn fn, void *ud, uint64_t rid, const char *router)
{
    Prism__Envelope e = PRISM__ENVELOPE__INIT;
    Prism__Abort ab = PRISM__ABORT__INIT;
    e.type = PRISM__MSG_TYPE__MSG_ABORT;
    e.request_id = rid;
    e.router_id = (char *)router;
    e.abort = &ab;
    prism_msg_t m;
    memset(&m, 0, offsetof(prism_msg_t, frames));
    m.env = &e;
    m.n_frames = 0;
    m.src_fd = -1;
    fuzz_record_abort(w, &e);
    fn(w, &m, 0, ud);
}

#endif
