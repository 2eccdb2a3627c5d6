/* Control plane: workers connect a DEALER socket to our ROUTER socket, register, heartbeat, and
 * send results (tokens, encode completions) on it; we send them work on the same socket. The
 * socket's file descriptor is watched by libuv; ZeroMQ's fd only says "something may be ready",
 * so the socket is drained until EAGAIN on every wake-up and before the loop blocks.
 *
 * This is the loop that calls up: registrations and heartbeats go to the registry (workers.c),
 * results and silent workers to the request life (requests.c). */
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
    env.router_id = r->router_id;
    env.reg_ack = &a;
    prism_msg_send(r->ctl, identity, id_len, &env, NULL, 0, ZMQ_DONTWAIT);
}

static void on_register(router_t *r, prism_msg_t *m)
{
    char id[128], why[200] = "";
    snprintf(id, sizeof(id), "%.*s", (int)m->identity_len, (const char *)m->identity);
    if (router_worker_register(r, id, m->env->reg, why, sizeof(why)) != PRISM_OK) {
        ack(r, m->identity, m->identity_len, false, why);
        return;
    }
    router_worker_t *w = router_worker_by_id(r, id);
    w->conn_fd = m->src_fd;
    w->t_conn = prism_now_s();
    ack(r, m->identity, m->identity_len, true, "");
    router_dispatch_queued(r);  /* new capacity */
}

static void on_heartbeat(router_t *r, prism_msg_t *m)
{
    char id[128];
    snprintf(id, sizeof(id), "%.*s", (int)m->identity_len, (const char *)m->identity);
    /* We restarted or dropped it: ask it to register again. */
    if (!router_worker_heartbeat(r, id, m->env->heartbeat))
        ack(r, m->identity, m->identity_len, false, "unknown worker: register again");
}

static void dispatch(router_t *r, prism_msg_t *m)
{
    const Prism__Envelope *e = m->env;
    char id[128];
    snprintf(id, sizeof(id), "%.*s", (int)m->identity_len, (const char *)m->identity);
    router_worker_t *w = router_worker_by_id(r, id);
    if (w) {
        w->last_seen = prism_now_s();
        if (m->src_fd >= 0 && m->src_fd != w->conn_fd) {  /* it reconnected */
            w->conn_fd = m->src_fd;
            w->t_conn = w->last_seen;
        }
    }
    switch (e->type) {
    case PRISM__MSG_TYPE__MSG_REGISTER:
        on_register(r, m);
        break;
    case PRISM__MSG_TYPE__MSG_HEARTBEAT:
        on_heartbeat(r, m);
        break;
    case PRISM__MSG_TYPE__MSG_TOKENS:
        if (e->tokens) router_handle_tokens(r, e->request_id, e->tokens);
        break;
    case PRISM__MSG_TYPE__MSG_ENCODE_DONE:
        if (e->encode_done) router_handle_encode_done(r, e->request_id, e->encode_done);
        break;
    default:
        PRISM_WARN("unexpected message type %d from %s", e->type, id);
    }
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
            router_fail_worker_requests(r, w);
            router_worker_drop(w);
        }
    double now = prism_now_s();
    for (int i = 0; i < ROUTER_MAX_WORKERS; i++) {
        router_worker_t *w = &r->workers[i];
        if (!w->used || now - w->last_seen < r->worker_timeout_s) continue;
        PRISM_WARN("%s worker %s missed heartbeats for %.1fs: dropped", prism_role_name(w->role), w->id,
                   now - w->last_seen);
        router_fail_worker_requests(r, w);
        router_worker_drop(w);
    }
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
    uv_poll_stop(&r->ctl_poll);
    uv_close((uv_handle_t *)&r->ctl_poll, NULL);
    uv_prepare_stop(&r->ctl_prepare);
    uv_close((uv_handle_t *)&r->ctl_prepare, NULL);
    uv_timer_stop(&r->sweep_timer);
    uv_close((uv_handle_t *)&r->sweep_timer, NULL);
}

int router_send(router_t *r, router_worker_t *w, Prism__Envelope *env, const prism_frame_t *frames, int n)
{
    env->router_id = r->router_id;
    int rc = prism_msg_send(r->ctl, w->id, strlen(w->id), env, frames, n, ZMQ_DONTWAIT);
    if (rc != PRISM_OK)
        PRISM_WARN("send to %s worker %s failed: %s", prism_role_name(w->role), w->id, prism_strerror(rc));
    return rc;
}
