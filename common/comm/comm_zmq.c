/* zmq: collectives over the group's ZeroMQ link, for CPU ranks on several hosts.
 *
 * A star through the leader: each chunk (at most chunk_bytes per rank) goes rank -> leader, the
 * leader combines (sums in rank order 0..T-1, or concatenates) and sends the result to every rank.
 * Slow (2 hops, the leader does T times the work) but simple and deterministic; multi-host CPU
 * tensor parallelism is a correctness path, not a fast one. Every chunk message names the op, its
 * sequence number and size; anything else arriving inside a collective breaks the group (the
 * ranks disagree about the schedule: continuing would compute garbage).
 *
 * Waits poll the link in slices of 100 ms, asking the group whether the peers live between slices,
 * up to the step timeout. Sends use the link's send timeout (set by the group).
 */
#include "comm/comm_impl.h"
#include "net/net.h"

#include <stdio.h>
#include <string.h>

enum { OP_REDUCE = 1, OP_GATHER = 2, OP_BCAST = 3 };

typedef struct {
    void *sock;
    int size, rank;
    prism_comm_ident_t ident[PRISM_TP_MAX];
    size_t chunk;
    uint8_t *stage;               /* leader: [T][chunk]; other ranks: [chunk] */
    uint64_t seq;
    double timeout_s;
    prism_comm_alive_fn alive;
    void *alive_ud;
    bool broken;
} zc_t;

static void z_fail(zc_t *z, const char *why)
{
    if (!z->broken) PRISM_ERROR("comm zmq: rank %d: %s", z->rank, why);
    z->broken = true;
}

static int z_send(zc_t *z, int to_rank, int op, const void *data, size_t len)
{
    Prism__TpColl tc = PRISM__TP_COLL__INIT;
    tc.op = (uint32_t)op;
    tc.seq = z->seq;
    tc.bytes = len;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_TP_COLL;
    env.tp_coll = &tc;
    prism_frame_t f = {data, len};
    const void *id = NULL;
    size_t idlen = 0;
    if (z->rank == 0) {
        id = z->ident[to_rank].id;
        idlen = z->ident[to_rank].len;
    }
    int rc = prism_msg_send(z->sock, id, idlen, &env, &f, 1, 0);
    if (rc != PRISM_OK) {
        char why[96];
        snprintf(why, sizeof why, "sending to rank %d failed (%s)", to_rank, prism_strerror(rc));
        z_fail(z, why);
        return PRISM_EIO;
    }
    return PRISM_OK;
}

/* Receives the next chunk of op `op` (len bytes); *from gets the sender's rank (leader) or 0. The
 * payload is copied to dst. */
static int z_recv(zc_t *z, int op, size_t len, void *dst, int *from)
{
    uint64_t deadline = prism_now_ns() + (uint64_t)(z->timeout_s * 1e9);
    for (;;) {
        zmq_pollitem_t it = {z->sock, 0, ZMQ_POLLIN, 0};
        int n = zmq_poll(&it, 1, 100);
        if (n < 0) {
            z_fail(z, "poll failed");
            return PRISM_EIO;
        }
        if (n == 0) {
            char why[160] = "";
            if (z->alive && z->alive(z->alive_ud, why, sizeof why) != PRISM_OK) {
                z_fail(z, why);
                return PRISM_EIO;
            }
            if (prism_now_ns() >= deadline) {
                snprintf(why, sizeof why, "step timeout: no chunk %llu within %.1f s", (unsigned long long)z->seq,
                         z->timeout_s);
                z_fail(z, why);
                return PRISM_EIO;
            }
            continue;
        }
        prism_msg_t m;
        int rc = prism_msg_recv(z->sock, z->rank == 0, &m, ZMQ_DONTWAIT);
        if (rc == PRISM_EAGAIN) continue;
        if (rc != PRISM_OK) {
            z_fail(z, "malformed message on the group link");
            return PRISM_EIO;
        }
        int sender = 0;
        if (z->rank == 0) {
            sender = -1;
            for (int r = 1; r < z->size; r++)
                if (z->ident[r].len == m.identity_len && !memcmp(z->ident[r].id, m.identity, m.identity_len)) sender = r;
        }
        size_t flen = 0;
        const void *fd = prism_msg_frame(&m, 0, &flen);
        const Prism__TpColl *tc = m.env->tp_coll;
        bool ok = sender >= 0 && m.env->type == PRISM__MSG_TYPE__MSG_TP_COLL && tc && tc->op == (uint32_t)op &&
                  tc->seq == z->seq && tc->bytes == len && m.n_frames == 1 && flen == len;
        if (ok && len) memcpy(dst, fd, len);
        char why[160];
        if (!ok)
            snprintf(why, sizeof why, "unexpected message on the group link (type %d from rank %d; want op %d chunk %llu)",
                     (int)m.env->type, sender, op, (unsigned long long)z->seq);
        prism_msg_close(&m);
        if (!ok) {
            z_fail(z, why);
            return PRISM_EIO;
        }
        *from = sender;
        return PRISM_OK;
    }
}

static const char *z_name(void *ctx) { (void)ctx; return "zmq"; }

/* Leader: gathers every other rank's chunk of `len` bytes into stage[r]. */
static int z_collect(zc_t *z, int op, size_t len)
{
    uint64_t got = 0;
    for (int i = 1; i < z->size; i++) {
        int from = 0;
        /* Receive into a scratch row first: the sender is known only after the message arrived. */
        uint8_t *tmp = z->stage;   /* row 0 is filled by the caller afterwards */
        int rc = z_recv(z, op, len, tmp, &from);
        if (rc != PRISM_OK) return rc;
        if (got & (1ull << from)) {
            z_fail(z, "a rank sent one chunk twice");
            return PRISM_EIO;
        }
        got |= 1ull << from;
        memcpy(z->stage + (size_t)from * z->chunk, tmp, len);
    }
    return PRISM_OK;
}

static int z_all_reduce(void *ctx, float *buf, size_t n)
{
    zc_t *z = ctx;
    if (z->broken) return PRISM_EIO;
    size_t per = z->chunk / sizeof(float);
    for (size_t off = 0; off < n; off += per, z->seq++) {
        size_t m = PRISM_MIN(per, n - off), len = m * sizeof(float);
        float *x = buf + off;
        int rc, from;
        if (z->rank != 0) {
            if ((rc = z_send(z, 0, OP_REDUCE, x, len)) != PRISM_OK) return rc;
            if ((rc = z_recv(z, OP_REDUCE, len, x, &from)) != PRISM_OK) return rc;
            continue;
        }
        if ((rc = z_collect(z, OP_REDUCE, len)) != PRISM_OK) return rc;
        /* rank order: x (rank 0) + rank 1 + ... */
        for (int r = 1; r < z->size; r++) {
            const float *src = (const float *)(z->stage + (size_t)r * z->chunk);
            for (size_t i = 0; i < m; i++) x[i] += src[i];
        }
        for (int r = 1; r < z->size; r++)
            if ((rc = z_send(z, r, OP_REDUCE, x, len)) != PRISM_OK) return rc;
    }
    return PRISM_OK;
}

static int z_all_gather(void *ctx, void *out, const void *in, size_t bytes)
{
    zc_t *z = ctx;
    if (z->broken) return PRISM_EIO;
    size_t per = z->chunk / (size_t)z->size;   /* the leader sends T pieces in one message */
    uint8_t *o = out;
    for (size_t off = 0; off < bytes; off += per, z->seq++) {
        size_t m = PRISM_MIN(per, bytes - off);
        int rc, from;
        if (z->rank != 0) {
            if ((rc = z_send(z, 0, OP_GATHER, (const uint8_t *)in + off, m)) != PRISM_OK) return rc;
            /* The result arrives as [T][m] (m * T <= chunk) and is scattered to out. */
            if ((rc = z_recv(z, OP_GATHER, m * (size_t)z->size, z->stage, &from)) != PRISM_OK) return rc;
            for (int r = 0; r < z->size; r++) memcpy(o + (size_t)r * bytes + off, z->stage + (size_t)r * m, m);
            continue;
        }
        if ((rc = z_collect(z, OP_GATHER, m)) != PRISM_OK) return rc;
        memcpy(z->stage, (const uint8_t *)in + off, m);
        /* compact [T][chunk] rows to [T][m] in place (rows move down only) */
        for (int r = 1; r < z->size; r++) memmove(z->stage + (size_t)r * m, z->stage + (size_t)r * z->chunk, m);
        for (int r = 0; r < z->size; r++) memcpy(o + (size_t)r * bytes + off, z->stage + (size_t)r * m, m);
        for (int r = 1; r < z->size; r++)
            if ((rc = z_send(z, r, OP_GATHER, z->stage, m * (size_t)z->size)) != PRISM_OK) return rc;
    }
    return PRISM_OK;
}

static int z_broadcast(void *ctx, void *buf, size_t bytes, int root)
{
    zc_t *z = ctx;
    if (z->broken) return PRISM_EIO;
    if (root < 0 || root >= z->size) return PRISM_EINVAL;
    for (size_t off = 0; off < bytes; off += z->chunk, z->seq++) {
        size_t m = PRISM_MIN(z->chunk, bytes - off);
        uint8_t *x = (uint8_t *)buf + off;
        int rc, from;
        if (z->rank == 0) {
            if (root != 0 && (rc = z_recv(z, OP_BCAST, m, x, &from)) != PRISM_OK) return rc;
            if (root != 0 && from != root) {
                z_fail(z, "broadcast chunk from a rank that is not the root");
                return PRISM_EIO;
            }
            for (int r = 1; r < z->size; r++)
                if (r != root && (rc = z_send(z, r, OP_BCAST, x, m)) != PRISM_OK) return rc;
        } else if (z->rank == root) {
            if ((rc = z_send(z, 0, OP_BCAST, x, m)) != PRISM_OK) return rc;
        } else {
            if ((rc = z_recv(z, OP_BCAST, m, x, &from)) != PRISM_OK) return rc;
        }
    }
    return PRISM_OK;
}

static int z_wait(void *ctx) { return ((zc_t *)ctx)->broken ? PRISM_EIO : PRISM_OK; }
static void z_abort(void *ctx) { ((zc_t *)ctx)->broken = true; }

static void z_destroy(void *ctx)
{
    zc_t *z = ctx;
    if (!z) return;
    prism_free(z->stage);
    prism_free(z);
}

int prism_comm_zmq_create(void *sock, int size, int rank, const prism_comm_ident_t *idents, size_t chunk_bytes,
                          double timeout_s, prism_comm_alive_fn alive, void *alive_ud, prism_comm_t **out,
                          char *err, size_t errlen)
{
    *out = NULL;
    if (!sock || size < 2 || size > PRISM_TP_MAX || rank < 0 || rank >= size || (rank == 0 && !idents)) {
        if (err && errlen) snprintf(err, errlen, "comm zmq: bad arguments");
        return PRISM_EINVAL;
    }
    if (!chunk_bytes) chunk_bytes = PRISM_COMM_ZMQ_CHUNK;
    chunk_bytes = PRISM_ALIGN_UP(PRISM_MAX(chunk_bytes, (size_t)size * 64), (size_t)size * 4);
    zc_t *z = prism_calloc(1, sizeof *z);
    prism_comm_t *c = prism_calloc(1, sizeof *c);
    if (z) z->stage = prism_malloc(rank == 0 ? (size_t)size * chunk_bytes : chunk_bytes);
    if (!z || !c || !z->stage) {
        if (z) prism_free(z->stage);
        prism_free(z);
        prism_free(c);
        if (err && errlen) snprintf(err, errlen, "comm zmq: out of memory for %d x %zu staging bytes", size, chunk_bytes);
        return PRISM_ENOMEM;
    }
    z->sock = sock;
    z->size = size;
    z->rank = rank;
    if (rank == 0) memcpy(z->ident, idents, sizeof(prism_comm_ident_t) * (size_t)size);
    z->chunk = chunk_bytes;
    z->timeout_s = timeout_s > 0 ? timeout_s : 30;
    z->alive = alive;
    z->alive_ud = alive_ud;
    c->i = (prism_comm_i){
        .name = z_name, .all_reduce_sum = z_all_reduce, .all_gather = z_all_gather, .broadcast = z_broadcast,
        .wait = z_wait, .abort = z_abort, .destroy = z_destroy,
    };
    c->ctx = z;
    c->size = size;
    c->rank = rank;
    c->timeout_s = z->timeout_s;
    *out = c;
    return PRISM_OK;
}
