/* Control plane: workers connect a DEALER socket to our ROUTER socket, register, heartbeat, and
 * send results (tokens, encode completions) on it; we send them work on the same socket. The
 * socket's file descriptor is watched by libuv; ZeroMQ's fd only says "something may be ready",
 * so the socket is drained until EAGAIN on every wake-up and before the loop blocks.
 *
 * The loop on top: it only calls down, registrations and heartbeats to the registry (workers.c),
 * results and dead or stuck workers to the request life (requests.c); what goes out to a worker
 * goes through send.c. */
#include "router.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

static void ack(router_t *r, const uint8_t *identity, size_t id_len, bool ok, const char *msg)
{
    Prism__RegisterAck a = PRISM__REGISTER_ACK__INIT;
    a.ok = ok;
    a.message = (char *)msg;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_REGISTER_ACK;
    env.router_id = ok ? r->router_id : NULL;  /* our id only to registered workers */
    env.reg_ack = &a;
    prism_msg_send(r->ctl, identity, id_len, &env, NULL, 0, ZMQ_DONTWAIT);
}

/* The sender's worker id: its ZeroMQ identity, byte for byte, as a C string. NULL when no worker
 * id can be that identity (empty, too long, a NUL inside, as in ZeroMQ's own anonymous ids): a
 * "%.*s" copy would cut "decode-0\0x" down to another worker's id. */
static const char *sender_id(const prism_msg_t *m, char id[ROUTER_WORKER_ID_MAX + 1])
{
    if (m->identity_len == 0 || m->identity_len > ROUTER_WORKER_ID_MAX || memchr(m->identity, 0, m->identity_len))
        return NULL;
    memcpy(id, m->identity, m->identity_len);
    id[m->identity_len] = 0;
    return id;
}

static void on_register(router_t *r, prism_msg_t *m, const char *id)
{
    char why[200] = "";
    const Prism__Register *g = m->env->reg;
    if (!id) {
        snprintf(why, sizeof(why), "registration: a worker id is 1..%d bytes with no NUL", ROUTER_WORKER_ID_MAX);
        goto refuse;
    }
    if (!g) {
        snprintf(why, sizeof(why), "registration: no Register message");
        goto refuse;
    }
    /* Under CURVE the key says the role: a decode key registers decode workers only. */
    if (m->peer_key[0] && strcmp(prism_net_role_name(m->peer_role), prism_role_name(g->role)) != 0) {
        snprintf(why, sizeof(why), "registration: a %s key cannot register a %s worker",
                 prism_net_role_name(m->peer_role), prism_role_name(g->role));
        goto refuse;
    }
    router_worker_t *old = router_worker_by_id(r, id);
    if (old && !router_worker_same_process(old, m->peer_key, g)) {
        /* ZeroMQ routes an identity to one live connection, so the old process's link is gone:
         * this is a restart. What the old process held will never finish. */
        PRISM_WARN("%s worker %s registered again from a new process: failing what the old one held",
                   prism_role_name(old->role), id);
        router_fail_worker_requests(r, old, "restarted");
        router_worker_drop(old);
    }
    if (router_worker_register(r, id, m->peer_key, g, why, sizeof(why)) != PRISM_OK) goto refuse;
    router_worker_t *w = router_worker_by_id(r, id);
    w->conn_fd = m->src_fd;
    w->t_conn = prism_now_s();
    ack(r, m->identity, m->identity_len, true, "");
    router_dispatch_queued(r);  /* new capacity */
    return;
refuse:
    r->ctl_refused++;
    PRISM_WARN("%s", why);
    ack(r, m->identity, m->identity_len, false, why);
}

/* To a draining worker: what we still hold on it (0 releases it). Control messages to one worker
 * are ordered, so every request we sent it before this has reached it first. */
static void drain_ack(router_t *r, const uint8_t *identity, size_t id_len, uint32_t inflight, bool stopping)
{
    Prism__DrainAck d = PRISM__DRAIN_ACK__INIT;
    d.inflight = inflight;
    d.router_stopping = stopping;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_DRAIN_ACK;
    env.router_id = r->router_id;
    env.drain_ack = &d;
    prism_msg_send(r->ctl, identity, id_len, &env, NULL, 0, ZMQ_DONTWAIT);
}

/* A heartbeat from registered worker w: its load and progress; a stuck worker that moves again is
 * back in service; a draining one is answered with what we still hold on it, and released (dropped
 * from the registry) once that is nothing. */
static void on_heartbeat(router_t *r, router_worker_t *w, const prism_msg_t *m)
{
    const Prism__Heartbeat *hb = m->env->heartbeat;
    router_worker_heartbeat(r, w->id, hb);
    if (w->stuck && (!w->busy || w->progress_at == w->last_heartbeat)) {
        PRISM_WARN("%s worker %s makes progress again (progress %llu): back in service", prism_role_name(w->role),
                   w->id, (unsigned long long)w->progress);
        w->stuck = false;
        router_dispatch_queued(r);
    }
    if (!w->draining) return;
    drain_ack(r, m->identity, m->identity_len, (uint32_t)PRISM_MAX(w->inflight, 0), false);
    if (w->inflight <= 0) {
        /* Released: it exits as soon as it is idle. Forget it now rather than at --worker-timeout
         * (/ready and the counts say what is really there); a later heartbeat is answered in
         * dispatch, and its connection closing later finds no worker to drop. */
        PRISM_INFO("%s worker %s drained: released", prism_role_name(w->role), w->id);
        router_worker_drop(w);
    }
}

/* A prefill's PrefixEvents into its index (prefix_index.h). Refused: from another tier, or a key
 * list that is no whole number of keys or longer than a worker sends (the index stays as it was). */
static bool on_prefix_events(router_worker_t *w, const Prism__PrefixEvents *ev)
{
    if (w->role != PRISM__ROLE__ROLE_PREFILL) {
        PRISM_WARN("%s worker %s sent prefix events: ignored", prism_role_name(w->role), w->id);
        return false;
    }
    if (router_prefix_index_apply(&w->prefix, ev)) return true;
    PRISM_WARN("prefill worker %s: malformed prefix events ignored", w->id);
    return false;
}

static void dispatch(router_t *r, prism_msg_t *m)
{
    const Prism__Envelope *e = m->env;
    char buf[ROUTER_WORKER_ID_MAX + 1];
    const char *id = sender_id(m, buf);
    if (e->type == PRISM__MSG_TYPE__MSG_REGISTER) {
        on_register(r, m, id);
        return;
    }
    /* Everything else only from a registered worker, over the key it registered with. */
    router_worker_t *w = id ? router_worker_by_id(r, id) : NULL;
    if (w && strcmp(w->peer_key, m->peer_key) != 0) w = NULL;
    if (!w) {
        if (e->type == PRISM__MSG_TYPE__MSG_HEARTBEAT && id) {  /* we restarted, dropped or released it */
            if (e->heartbeat && e->heartbeat->draining) {
                /* A draining worker we do not know (released, or dropped when its connection broke,
                 * its requests failed): we hold nothing on it. Expected, not refused. */
                drain_ack(r, m->identity, m->identity_len, 0, false);
                return;
            }
            ack(r, m->identity, m->identity_len, false, "unknown worker: register again");
        }
        r->ctl_refused++;
        return;
    }
    w->last_seen = prism_now_s();
    if (m->src_fd >= 0 && m->src_fd != w->conn_fd) {  /* it reconnected */
        w->conn_fd = m->src_fd;
        w->t_conn = w->last_seen;
    }
    bool ok = true;
    /* lines logged while a request's result is handled carry its id and trace */
    prism_log_ctx_t lc = router_req_log(r, e->type != PRISM__MSG_TYPE__MSG_HEARTBEAT ? e->request_id : 0);
    const prism_log_ctx_t *prev = prism_log_ctx_enter(lc.request_id ? &lc : NULL);
    switch (e->type) {
    case PRISM__MSG_TYPE__MSG_HEARTBEAT:
        on_heartbeat(r, w, m);
        break;
    case PRISM__MSG_TYPE__MSG_TOKENS:
        ok = e->tokens != NULL;
        if (ok) {
            bool kept;
            ok = router_handle_tokens(r, w, m->env, &kept);
            if (kept) m->env = NULL;  /* held: the request owns it */
        }
        break;
    case PRISM__MSG_TYPE__MSG_ENCODE_DONE:
        ok = e->encode_done && router_handle_encode_done(r, w, e->request_id, e->request_id_hi, e->encode_done);
        break;
    case PRISM__MSG_TYPE__MSG_PREFIX_EVENTS:
        ok = on_prefix_events(w, e->prefix_events);
        break;
    default:
        ok = false;
        PRISM_WARN("unexpected message type %d from %s", e->type, w->id);
    }
    prism_log_ctx_leave(prev);
    if (!ok) r->ctl_refused++;
}

static void drain(router_t *r)
{
    for (int i = 0; i < 4096; i++) {
        prism_msg_t m;
        int rc = prism_msg_recv(r->ctl, true, &m, ZMQ_DONTWAIT);
        if (rc == PRISM_EAGAIN || rc == PRISM_EIO) break;
        if (rc != PRISM_OK) {
            PRISM_WARN("dropped a malformed control message: %s", prism_strerror(rc));
            continue;
        }
        dispatch(r, &m);
        prism_msg_close(&m);
    }
    if (r->queue_dirty) {
        r->queue_dirty = false;
        router_dispatch_queued(r);
    }
}

static void on_ctl_poll(uv_poll_t *p, int status, int events)
{
    drain(p->data);
}

static void on_ctl_prepare(uv_prepare_t *p)
{
    drain(p->data);
}

/* Liveness. Dead: nothing heard for --worker-timeout (the process is gone, stopped or cut off):
 * its requests fail and it leaves the registry (it registers again if it comes back). Stuck: its
 * I/O thread heartbeats, but the compute thread has been busy without progress for
 * --worker-stuck-timeout: its requests fail the same way and it gets no new work, but it stays
 * registered and returns to service as soon as a heartbeat shows progress. A busy worker that
 * makes progress is neither, however long its batch. */
static void judge_liveness(router_t *r, double now)
{
    for (int i = 0; i < ROUTER_MAX_WORKERS; i++) {
        router_worker_t *w = &r->workers[i];
        if (!w->used) continue;
        if (now - w->last_seen >= r->worker_timeout_s) {
            PRISM_WARN("%s worker %s missed heartbeats for %.1fs: dead, dropped", prism_role_name(w->role), w->id,
                       now - w->last_seen);
            r->workers_lost_dead++;
            router_fail_worker_requests(r, w, "stopped responding");
            router_worker_drop(w);
        } else if (r->worker_stuck_timeout_s > 0 && !w->stuck && w->busy &&
                   now - w->progress_at >= r->worker_stuck_timeout_s) {
            PRISM_WARN("%s worker %s is stuck: it heartbeats but made no progress for %.1fs while busy (progress "
                       "%llu): its requests fail and it gets no new work until it moves", prism_role_name(w->role),
                       w->id, now - w->progress_at, (unsigned long long)w->progress);
            r->workers_lost_stuck++;
            w->stuck = true;
            router_fail_worker_requests(r, w, "stopped making progress");
        }
    }
}

static void on_sweep(uv_timer_t *t)
{
    router_t *r = t->data;
    /* Judge liveness only after reading what is queued: a router busy with large HTTP bodies must
     * not mistake its own backlog for silent workers. */
    drain(r);
    /* A worker whose connection dropped (the process died: its kernel closed the socket) is gone
     * now, not after --worker-timeout; a disconnect older than the worker's connection belongs to
     * an earlier holder of the same descriptor. */
    prism_net_disconnect_t gone[64];
    int n_gone = prism_net_disconnects(r->net, gone, (int)PRISM_ARRAY_LEN(gone));
    for (int k = 0; k < n_gone; k++)
        for (int i = 0; i < ROUTER_MAX_WORKERS; i++) {
            router_worker_t *w = &r->workers[i];
            if (!w->used || w->conn_fd != gone[k].fd || w->t_conn > gone[k].t) continue;
            PRISM_WARN("%s worker %s: connection lost: dropped", prism_role_name(w->role), w->id);
            r->metrics.workers_disconnected++;
            router_fail_worker_requests(r, w, "stopped responding");
            router_worker_drop(w);
        }
    double now = prism_now_s();
    judge_liveness(r, now);
    router_early_encode_sweep(r, now);
    router_sweep_requests(r);
    router_dispatch_queued(r);
}

int router_ctl_start(router_t *r, const char *endpoint)
{
    /* Only workers may connect; what they send up is small (tokens, completions, heartbeats). */
    prism_sock_opts_t so = {.type = ZMQ_ROUTER, .endpoint = endpoint, .hwm = PRISM_NET_CONTROL_HWM,
                            .watch_disconnects = true,
                            .max_msg_bytes = ROUTER_MAX_WORKER_MSG,
                            .allow = PRISM_NET_ALLOW(PRISM_NET_ROLE_ENCODER) | PRISM_NET_ALLOW(PRISM_NET_ROLE_PREFILL) |
                                     PRISM_NET_ALLOW(PRISM_NET_ROLE_DECODE)};
    r->ctl = prism_sock_bind(r->net, &so);
    if (!r->ctl) return PRISM_EIO;
    int fd = -1;
    size_t sz = sizeof(fd);
    if (zmq_getsockopt(r->ctl, ZMQ_FD, &fd, &sz) != 0) return PRISM_EIO;
    uv_poll_init(r->loop, &r->ctl_poll, fd);
    r->ctl_poll.data = r;
    uv_poll_start(&r->ctl_poll, UV_READABLE, on_ctl_poll);
    uv_prepare_init(r->loop, &r->ctl_prepare);
    r->ctl_prepare.data = r;
    uv_prepare_start(&r->ctl_prepare, on_ctl_prepare);
    uv_timer_init(r->loop, &r->sweep_timer);
    r->sweep_timer.data = r;
    uv_timer_start(&r->sweep_timer, on_sweep, 250, 250);
    return PRISM_OK;
}

void router_ctl_stop(router_t *r)
{
    /* Workers draining at the same time (a whole cluster stopped) need not wait for us. */
    for (int i = 0; i < ROUTER_MAX_WORKERS; i++)
        if (r->workers[i].used)
            drain_ack(r, (const uint8_t *)r->workers[i].id, strlen(r->workers[i].id), 0, true);
    uv_poll_stop(&r->ctl_poll);
    uv_close((uv_handle_t *)&r->ctl_poll, NULL);
    uv_prepare_stop(&r->ctl_prepare);
    uv_close((uv_handle_t *)&r->ctl_prepare, NULL);
    uv_timer_stop(&r->sweep_timer);
    uv_close((uv_handle_t *)&r->sweep_timer, NULL);
}
