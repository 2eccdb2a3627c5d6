/* The worker's two threads and the channel between them (see worker.h): the I/O thread owns the
 * router and data sockets, registers and heartbeats on its own clock, records aborts and passes
 * work on, follows --router DNS names and runs the SIGTERM drain; the compute thread polls its end
 * of the channel between units of work. */
#include "worker/worker.h"
#include "net/resolve.h"

#include <errno.h>
#include <stddef.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Frame 0 of an inbound message. 24 bytes: a ZeroMQ "very small message", never allocated. */
typedef struct {
    Prism__Envelope *env;    /* unpacked on the I/O thread; the compute thread frees it */
    int32_t source;          /* router index, -1 = data socket */
    double t_recv;
} inbound_hdr_t;

/* Frame 0 of an outbound message: the router slot and its generation when the reply was routed
 * (the slot may have been emptied and reused for another router since: then the reply is dropped). */
typedef struct {
    int32_t slot;
    uint32_t gen;
} route_t;

#define ROUTE_WAKE (-1)      /* outbound slot of a bare wake-up (no envelope follows) */
#define REGISTER_RETRY_S 0.5
#define IO_DRAIN_MAX 1024    /* messages per socket per wake-up: the others wait one round */

static void pair_hwm(void *s)
{
    int hwm = PRISM_WORKER_INBOX_HWM / 2, linger = 0;  /* inproc: sender's + receiver's HWM */
    zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
}

static prism_net_role_t net_role(Prism__Role role)
{
    switch (role) {
    case PRISM__ROLE__ROLE_ENCODER: return PRISM_NET_ROLE_ENCODER;
    case PRISM__ROLE__ROLE_PREFILL: return PRISM_NET_ROLE_PREFILL;
    case PRISM__ROLE__ROLE_DECODE:  return PRISM_NET_ROLE_DECODE;
    default:                        return PRISM_NET_ROLE_NONE;
    }
}

/* Opens a router link in the first empty slot (start-up, or the I/O thread when a name gains an
 * address). */
static int router_connect(prism_worker_t *w, const char *endpoint, bool from_name)
{
    int slot = -1;
    for (int i = 0; i < w->n_routers && slot < 0; i++)
        if (!w->routers[i].sock) slot = i;
    if (slot < 0 && w->n_routers == PRISM_WORKER_MAX_ROUTERS) {
        PRISM_WARN("router %s ignored: already connected to %d routers", endpoint, PRISM_WORKER_MAX_ROUTERS);
        return PRISM_ELIMIT;
    }
    /* Control messages are small and the router never sends a worker more requests than its
     * registered capacity, so this bound is never reached in normal operation; past it a send
     * waits (backpressure), nothing is dropped. */
    prism_sock_opts_t so = {.type = ZMQ_DEALER, .endpoint = endpoint, .hwm = PRISM_NET_CONTROL_HWM,
                            .max_msg_bytes = w->router_max_msg_bytes, .identity = w->worker_id,
                            .server = PRISM_NET_ROLE_ROUTER};
    void *sock = prism_sock_connect(w->net, &so);
    if (!sock) return PRISM_EIO;
    pthread_mutex_lock(&w->mu);
    if (slot < 0) slot = w->n_routers++;
    prism_worker_router_t *r = &w->routers[slot];
    uint32_t gen = r->gen;
    memset(r, 0, sizeof(*r));
    r->gen = gen;
    snprintf(r->endpoint, sizeof(r->endpoint), "%s", endpoint);
    r->from_name = from_name;
    r->sock = sock;
    pthread_mutex_unlock(&w->mu);
    return PRISM_OK;
}

/* I/O thread: connects the addresses new to the names' latest lookup and closes those that left
 * them. A closed slot's generation moves on, so replies the compute thread routed to it are
 * dropped rather than sent to the router that takes the slot next. */
static void routers_follow_names(prism_worker_t *w)
{
    if (!w->router_names.n) return;
    if (!w->resolver) {
        if (prism_resolver_start(&w->router_names, w->router_resolve_s, NULL, NULL, &w->resolver) != PRISM_OK) {
            PRISM_ERROR("cannot start the router name resolver");
            w->router_names.n = 0;
        }
        return;
    }
    static prism_endpoints_t now;  /* 8 KiB: off the stack; one worker per process, used by its I/O thread */
    if (!prism_resolver_take(w->resolver, &now)) return;
    for (int i = 0; i < w->n_routers; i++) {
        prism_worker_router_t *r = &w->routers[i];
        if (!r->sock || !r->from_name) continue;
        bool kept = false;
        for (int k = 0; k < now.n && !kept; k++) kept = !strcmp(now.ep[k], r->endpoint);
        if (kept) continue;
        PRISM_INFO("router %s (%s) left the router name: disconnected", r->endpoint,
                   r->router_id[0] ? r->router_id : "never registered");
        zmq_close(r->sock);
        pthread_mutex_lock(&w->mu);
        uint32_t gen = r->gen + 1;
        memset(r, 0, sizeof(*r));
        r->gen = gen;
        pthread_mutex_unlock(&w->mu);
    }
    pthread_mutex_lock(&w->mu);
    while (w->n_routers && !w->routers[w->n_routers - 1].sock) w->n_routers--;
    pthread_mutex_unlock(&w->mu);
    for (int k = 0; k < now.n; k++) {
        bool have = false;
        for (int i = 0; i < w->n_routers && !have; i++) have = w->routers[i].sock && !strcmp(w->routers[i].endpoint, now.ep[k]);
        if (have) continue;
        if (router_connect(w, now.ep[k], true) == PRISM_OK) PRISM_INFO("router %s joined the router name: connecting", now.ep[k]);
    }
}

int prism_worker_init(prism_worker_t *w, Prism__Role role, const prism_worker_opts_t *o, const char *data_bind,
                      size_t data_max_msg_bytes)
{
    memset(w, 0, sizeof(*w));
    prism__register__init(&w->reg);
    w->role = role;
    w->heartbeat_s = 1.0;
    w->router_resolve_s = 5.0;
    w->drain_timeout_s = 30.0;
    w->stall_after = -1;
    pthread_mutex_init(&w->mu, NULL);
    snprintf(w->worker_id, sizeof(w->worker_id), "%s", o->worker_id);
    const char *stall = getenv("PRISM_TEST_STALL_AFTER_LAYERS");
    if (stall && *stall) {
        w->stall_after = strtoll(stall, NULL, 10);
        PRISM_WARN("test hook PRISM_TEST_STALL_AFTER_LAYERS=%lld is set: the compute thread will stop making "
                   "progress", (long long)w->stall_after);
    }
    const char *delay = getenv("PRISM_TEST_DELAY_REPLIES_S");
    if (delay && *delay) {
        double d = strtod(delay, NULL);
        w->reply_delay_s = d >= 0 && d <= 60 ? d : 0;
        PRISM_WARN("test hook PRISM_TEST_DELAY_REPLIES_S=%g is set: every reply to a router waits that long",
                   w->reply_delay_s);
    }
    if (o->routers.n == 0) {
        PRISM_ERROR("no --router given: a worker needs at least one router control endpoint");
        return PRISM_EINVAL;
    }
    if (o->max_message_bytes < 1) {
        PRISM_ERROR("--max-message-bytes must be positive");
        return PRISM_EINVAL;
    }
    w->router_max_msg_bytes = PRISM_MAX(o->max_message_bytes, (int64_t)PRISM_MSG_MAX_ENVELOPE);
    char err[512];
    prism_net_opts_t no = {.role = net_role(role), .curve_keys = o->curve_keys, .insecure = o->insecure_no_curve};
    if (prism_net_create(&no, &w->net, err, sizeof(err)) != PRISM_OK) {
        PRISM_ERROR("%s", err);
        return PRISM_EINVAL;
    }
    for (int i = 0; i < o->routers.n; i++) {
        /* A name is connected address by address once its first lookup ends (the I/O thread). */
        if (prism_endpoint_is_name(o->routers.items[i])) {
            if (w->router_names.n < (int)PRISM_ARRAY_LEN(w->router_names.items))
                w->router_names.items[w->router_names.n++] = o->routers.items[i];
            continue;
        }
        int rc = router_connect(w, o->routers.items[i], false);
        if (rc == PRISM_EIO) return rc;
    }
    if (data_bind) {
        /* HWM 1: at most one message queued per peer; the rest waits in the senders (backpressure).
         * Embeddings come from encoders only, KV from prefills and (preemption by migration) other
         * decode workers only. */
        prism_sock_opts_t so = {.type = ZMQ_PULL, .endpoint = data_bind, .hwm = 1,
                                .max_msg_bytes = (int64_t)PRISM_MAX(data_max_msg_bytes, (size_t)PRISM_MSG_MAX_ENVELOPE),
                                .allow = role == PRISM__ROLE__ROLE_PREFILL
                                             ? PRISM_NET_ALLOW(PRISM_NET_ROLE_ENCODER)
                                             : PRISM_NET_ALLOW(PRISM_NET_ROLE_PREFILL) | PRISM_NET_ALLOW(PRISM_NET_ROLE_DECODE)};
        w->data_sock = prism_sock_bind(w->net, &so);
        if (!w->data_sock) return PRISM_EIO;
        prism_sock_last_endpoint(w->data_sock, w->data_endpoint, sizeof(w->data_endpoint));
    }
    /* The channel between the threads stays inside the process (inproc): nothing to authenticate. */
    char inproc[64];
    snprintf(inproc, sizeof(inproc), "inproc://prism-worker-%p", (void *)w);
    w->io_pair = zmq_socket(prism_net_zctx(w->net), ZMQ_PAIR);
    w->cpu_pair = zmq_socket(prism_net_zctx(w->net), ZMQ_PAIR);
    if (!w->io_pair || !w->cpu_pair) return PRISM_EIO;
    pair_hwm(w->io_pair);
    pair_hwm(w->cpu_pair);
    if (zmq_bind(w->io_pair, inproc) != 0 || zmq_connect(w->cpu_pair, inproc) != 0) return PRISM_EIO;
    w->reg.role = role;
    w->reg.worker_id = w->worker_id;
    /* Tells the router a restart under the same id from a re-registration of this process. */
    if (prism_random_bytes(&w->reg.instance, sizeof(w->reg.instance)) != PRISM_OK) {
        PRISM_ERROR("no randomness from the kernel for the process instance");
        return PRISM_EIO;
    }
    w->reg.data_endpoint = w->data_endpoint;
    return PRISM_OK;
}

/* ---------------------------------------------------------------- I/O thread */

/* Registration and drain answers: handled here, never passed to the compute thread. */
static bool handle_ack(prism_worker_t *w, prism_msg_t *m, int ri)
{
    prism_worker_router_t *r = &w->routers[ri];
    if (m->env->type == PRISM__MSG_TYPE__MSG_DRAIN_ACK) {
        const Prism__DrainAck *d = m->env->drain_ack;
        if (!d) return true;
        r->drain_reply_s = prism_now_s();
        if (d->router_stopping) {
            /* it is going away: nothing to wait for; register again if it returns (and we do not drain) */
            pthread_mutex_lock(&w->mu);
            r->registered = false;
            pthread_mutex_unlock(&w->mu);
            r->last_register_s = r->drain_reply_s;
        } else if (w->draining && d->inflight == 0 && !r->released) {
            r->released = true;
            /* Whatever the compute thread published so far may predate the reply that emptied this
             * router's count (its load is published between units of work): wait for a newer one. */
            pthread_mutex_lock(&w->mu);
            w->drain_load_seq = w->load_seq;
            pthread_mutex_unlock(&w->mu);
            PRISM_INFO("router %s released this draining worker", r->router_id);
        }
        return true;
    }
    if (m->env->type != PRISM__MSG_TYPE__MSG_REGISTER_ACK) return false;
    const Prism__RegisterAck *ack = m->env->reg_ack;
    if (ack && ack->ok) {
        pthread_mutex_lock(&w->mu);
        bool was = r->registered;
        snprintf(r->router_id, sizeof(r->router_id), "%s", m->env->router_id ? m->env->router_id : "");
        r->registered = true;
        pthread_mutex_unlock(&w->mu);
        if (!was) {
            PRISM_INFO("registered with router %s (%s)", r->router_id, r->endpoint);
            atomic_fetch_add(&w->registrations, 1);   /* after registered: a broadcast from now reaches it */
            w->last_heartbeat_s = 0;  /* a heartbeat at once: the router learns the load without waiting an interval */
        }
    } else {
        /* The router does not know us (it restarted or dropped us) or refused us: register again. */
        if (r->registered || (ack && ack->message && *ack->message))
            PRISM_WARN("router %s: %s", r->endpoint, ack && ack->message ? ack->message : "registration lost");
        pthread_mutex_lock(&w->mu);
        r->registered = false;
        pthread_mutex_unlock(&w->mu);
        r->last_register_s = prism_now_s();
    }
    return true;
}

static void record_abort(prism_worker_t *w, const Prism__Envelope *e)
{
    pthread_mutex_lock(&w->mu);
    prism_worker_abort_t *a = &w->aborts[w->n_aborts % PRISM_WORKER_ABORTS];
    a->rid = e->request_id;
    snprintf(a->router_id, sizeof(a->router_id), "%s", e->router_id ? e->router_id : "");
    a->t_arrive = prism_now_s();
    w->n_aborts++;
    pthread_mutex_unlock(&w->mu);
    atomic_fetch_add(&w->abort_seq, 1);  /* after the entry: a reader that sees the count sees it */
}

/* The compute thread's queue is full (PRISM_WORKER_INBOX_HWM): refuse work with the reply its
 * sender waits for, so the request fails at once instead of hanging until a timeout. */
static void refuse(prism_worker_t *w, const prism_msg_t *m, int source)
{
    const Prism__Envelope *e = m->env;
    PRISM_WARN("request %llu: %d messages already wait for the compute thread: message type %d refused",
               (unsigned long long)e->request_id, PRISM_WORKER_INBOX_HWM, e->type);
    if (source < 0) return;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    Prism__EncodeDone d = PRISM__ENCODE_DONE__INIT;
    Prism__Tokens t = PRISM__TOKENS__INIT;
    char msg[] = "worker queue is full";
    if (e->type == PRISM__MSG_TYPE__MSG_ENCODE) {
        d.image_index = e->encode ? e->encode->image_index : 0;
        d.error = msg;
        env.type = PRISM__MSG_TYPE__MSG_ENCODE_DONE;
        env.encode_done = &d;
    } else if (e->type == PRISM__MSG_TYPE__MSG_PREFILL) {
        t.finish = PRISM__FINISH__FINISH_ERROR;
        t.error = msg;
        t.from_prefill = true;
        env.type = PRISM__MSG_TYPE__MSG_TOKENS;
        env.tokens = &t;
    } else {
        return;  /* aborts are in the table already; nothing else waits for an answer */
    }
    env.request_id = e->request_id;
    env.request_id_hi = e->request_id_hi;
    env.router_id = e->router_id;
    prism_msg_send(w->routers[source].sock, NULL, 0, &env, NULL, 0, ZMQ_DONTWAIT);
}

/* Hands a received message to the compute thread: the envelope pointer and the raw frames move,
 * nothing is copied. On return m owns nothing. */
static bool forward(prism_worker_t *w, prism_msg_t *m, int source)
{
    inbound_hdr_t h = {m->env, source, prism_now_s()};
    int more = m->n_frames ? ZMQ_SNDMORE : 0;
    if (zmq_send(w->io_pair, &h, sizeof(h), ZMQ_DONTWAIT | more) < 0) {
        refuse(w, m, source);
        prism_msg_close(m);
        return false;
    }
    for (int i = 0; i < m->n_frames; i++)   /* the rest of a multipart message is queued atomically */
        zmq_msg_send(&m->frames[i], w->io_pair, i + 1 < m->n_frames ? ZMQ_SNDMORE : 0);
    for (int i = 0; i < m->n_frames; i++) zmq_msg_close(&m->frames[i]);
    m->n_frames = 0;
    m->env = NULL;
    return true;
}

static void io_routers(prism_worker_t *w, int ri)
{
    for (int k = 0; k < IO_DRAIN_MAX; k++) {
        prism_msg_t m;
        int rc = prism_msg_recv(w->routers[ri].sock, false, &m, ZMQ_DONTWAIT);
        if (rc == PRISM_EAGAIN || rc == PRISM_EIO) break;
        if (rc != PRISM_OK) continue;
        if (handle_ack(w, &m, ri)) {
            prism_msg_close(&m);
            continue;
        }
        if (m.env->type == PRISM__MSG_TYPE__MSG_ABORT) record_abort(w, m.env);
        forward(w, &m, ri);
    }
}

static void io_data(prism_worker_t *w)
{
    for (int k = 0; k < IO_DRAIN_MAX; k++) {
        if (atomic_load(&w->data_forwarded) >= atomic_load(&w->data_limit)) break;  /* no credit */
        prism_msg_t m;
        int rc = prism_msg_recv(w->data_sock, false, &m, ZMQ_DONTWAIT);
        if (rc == PRISM_EAGAIN || rc == PRISM_EIO) break;
        if (rc != PRISM_OK) continue;  /* malformed: consumed and dropped, no credit used */
        if (forward(w, &m, -1)) atomic_fetch_add(&w->data_forwarded, 1);
    }
}

static bool has_more(void *sock)
{
    int more = 0;
    size_t sz = sizeof(more);
    return zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &sz) == 0 && more;
}

static void drop_rest(void *sock)
{
    while (has_more(sock)) {
        zmq_msg_t p;
        zmq_msg_init(&p);
        zmq_msg_recv(&p, sock, 0);
        zmq_msg_close(&p);
    }
}

/* Replies from the compute thread: [route][envelope][frames] -> the router socket, moved.
 * Returns the number of messages taken from the channel. */
static int io_outbound(prism_worker_t *w)
{
    int k = 0;
    for (; k < IO_DRAIN_MAX; k++) {
        zmq_msg_t part;
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, w->io_pair, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&part);
            break;
        }
        route_t rt = {ROUTE_WAKE, 0};
        if (zmq_msg_size(&part) == sizeof(rt)) memcpy(&rt, zmq_msg_data(&part), sizeof(rt));
        zmq_msg_close(&part);
        int32_t route = rt.slot;
        if (route < 0 || route >= w->n_routers) {
            drop_rest(w->io_pair);
            continue;
        }
        if (!w->routers[route].sock || w->routers[route].gen != rt.gen) {
            PRISM_WARN("a reply for a router that left the router name was dropped");
            drop_rest(w->io_pair);
            continue;
        }
        if (w->reply_delay_s > 0) {  /* test hook: a reply overtaken by what the work it came from caused */
            double d = w->reply_delay_s;
            struct timespec ts = {(time_t)d, (long)((d - (time_t)d) * 1e9)};
            nanosleep(&ts, NULL);
        }
        void *s = w->routers[route].sock;
        int flags = ZMQ_DONTWAIT;
        bool more = has_more(w->io_pair);
        while (more) {
            zmq_msg_init(&part);
            zmq_msg_recv(&part, w->io_pair, 0);
            more = has_more(w->io_pair);
            if (zmq_msg_send(&part, s, flags | (more ? ZMQ_SNDMORE : 0)) < 0) {
                /* PRISM_NET_CONTROL_HWM messages queued for that router: it is gone; the reply is lost */
                PRISM_WARN("reply to router %s dropped: %s", w->routers[route].endpoint, zmq_strerror(errno));
                zmq_msg_close(&part);
                if (more) drop_rest(w->io_pair);
                break;
            }
            flags = 0;  /* the rest of a multipart message is queued atomically */
        }
    }
    return k;
}

static void io_heartbeat(prism_worker_t *w)
{
    Prism__Heartbeat hb = PRISM__HEARTBEAT__INIT;
    pthread_mutex_lock(&w->mu);
    prism_worker_load_t l = w->load;
    pthread_mutex_unlock(&w->mu);
    hb.worker_id = w->worker_id;
    hb.draining = w->draining;
    hb.running = l.running;
    hb.waiting = l.waiting;
    hb.kv_free_blocks = l.kv_free_blocks;
    hb.pool_free = l.pool_free;
    hb.cache_hits = l.cache_hits;
    hb.cache_misses = l.cache_misses;
    hb.kv_waits = l.kv_waits;
    hb.tokens_generated = l.tokens_generated;
    hb.seqs_aborted = l.seqs_aborted;
    hb.prompts_aborted = l.prompts_aborted;
    hb.sends_waited = l.sends_waited;
    hb.preempt_recompute = l.preempt_recompute;
    hb.preempt_swap = l.preempt_swap;
    hb.kv_swap_bytes = l.kv_swap_bytes;
    hb.preempt_migrate = l.preempt_migrate;
    hb.prefix_cache_queries = l.prefix_cache_queries;
    hb.prefix_cache_hits = l.prefix_cache_hits;
    hb.prompt_tokens_computed = l.prompt_tokens_computed;
    hb.image_decodes_peak = l.image_decodes_peak;
    hb.prefill_forwards = l.prefill_forwards;
    hb.prefill_forward_prompts = l.prefill_forward_prompts;
    hb.prefill_batch_peak = l.prefill_batch_peak;
    hb.prefill_pool_breaks = l.prefill_pool_breaks;
    hb.kv_sent_bytes = l.kv_sent_bytes;
    hb.mem_used = prism_mem_used();
    hb.mem_peak = prism_mem_peak();
    hb.mem_planned = w->reg.mem_planned;
    hb.alloc_count = prism_mem_alloc_count();
    hb.peer_auth_failures = prism_net_refused(w->net);
    hb.progress = atomic_load(&w->progress);
    /* Busy: inside one piece of work since the previous heartbeat (never back to wait for more). */
    uint64_t polls = atomic_load(&w->polls);
    hb.busy = !atomic_load(&w->idle) && polls == w->hb_polls;
    w->hb_polls = polls;
    for (int i = 0; i < w->n_routers; i++) {
        if (!w->routers[i].sock || !w->routers[i].registered) continue;
        Prism__Envelope env = PRISM__ENVELOPE__INIT;
        env.type = PRISM__MSG_TYPE__MSG_HEARTBEAT;
        env.heartbeat = &hb;
        prism_msg_send(w->routers[i].sock, NULL, 0, &env, NULL, 0, ZMQ_DONTWAIT);
    }
}

/* Drain: decides when a draining worker may exit. A router holding no request on us says so
 * (DrainAck inflight 0, or router_stopping); one that has not answered for PRISM_DRAIN_ROUTER_GONE_S
 * seconds (SIGKILLed, unreachable) is not waited for. Idle is what the compute thread published
 * after the last release (see handle_ack). The end of the drain is the compute thread's stop. */
static void drain_step(prism_worker_t *w, double now)
{
    double gone_s = PRISM_MAX(PRISM_DRAIN_ROUTER_GONE_S, 5 * w->heartbeat_s);
    int waiting_for = 0;
    for (int i = 0; i < w->n_routers; i++) {
        const prism_worker_router_t *r = &w->routers[i];
        if (!r->sock || !r->registered || r->released) continue;
        double heard = PRISM_MAX(r->drain_reply_s, w->drain_start_s);
        if (now - heard > gone_s) continue;
        waiting_for++;
    }
    pthread_mutex_lock(&w->mu);
    prism_worker_load_t l = w->load;
    bool fresh = w->load_seq > w->drain_load_seq;
    pthread_mutex_unlock(&w->mu);
    bool idle = fresh && l.running == 0 && l.waiting == 0;
    if (idle && waiting_for == 0) {
        PRISM_INFO("drained in %.2fs: every router released this worker; exiting", now - w->drain_start_s);
        prism_worker_request_stop();
    } else if (now - w->drain_start_s > w->drain_timeout_s) {
        PRISM_WARN("--drain-timeout %.1fs passed with %u running, %u queued, %d router(s) still holding requests "
                   "here: exiting", w->drain_timeout_s, l.running, l.waiting, waiting_for);
        prism_worker_request_stop();
    }
}

/* Router names, drain, registration and heartbeats; returns the time the next one is due. */
static double io_tick(prism_worker_t *w, double now)
{
    routers_follow_names(w);
    if (prism_worker_signals() > 0 && !w->draining) {
        pthread_mutex_lock(&w->mu);
        prism_worker_load_t l = w->load;
        w->drain_load_seq = w->load_seq;
        pthread_mutex_unlock(&w->mu);
        w->draining = true;
        w->drain_start_s = now;
        w->last_heartbeat_s = 0;  /* tell the routers now */
        PRISM_INFO("SIGTERM: draining (no new work; %u running, %u queued finish first; at most %.1fs, a second "
                   "signal exits at once)", l.running, l.waiting, w->drain_timeout_s);
    }
    double next = now + 1.0;
    for (int i = 0; i < w->n_routers; i++) {
        prism_worker_router_t *r = &w->routers[i];
        /* a draining worker registers nowhere: a router that lost it has nothing on it */
        if (!r->sock || r->registered || w->draining) continue;
        if (now - r->last_register_s >= REGISTER_RETRY_S) {
            Prism__Envelope env = PRISM__ENVELOPE__INIT;
            env.type = PRISM__MSG_TYPE__MSG_REGISTER;
            env.reg = &w->reg;
            if (prism_msg_send(r->sock, NULL, 0, &env, NULL, 0, ZMQ_DONTWAIT) == PRISM_OK)
                PRISM_DEBUG("registering with %s", r->endpoint);
            r->last_register_s = now;
        }
        next = PRISM_MIN(next, r->last_register_s + REGISTER_RETRY_S);
    }
    /* While draining, heartbeats go out often: each is answered with what the router still holds. */
    double every = w->draining ? PRISM_MIN(w->heartbeat_s, PRISM_DRAIN_HEARTBEAT_S) : w->heartbeat_s;
    if (w->draining && !prism_worker_should_stop()) drain_step(w, now);
    if (now - w->last_heartbeat_s >= every) {
        /* On the clock, not accumulated: a late heartbeat does not make the next one early. */
        w->last_heartbeat_s = now;
        io_heartbeat(w);
    }
    return PRISM_MIN(next, w->last_heartbeat_s + every);
}

static void *io_main(void *arg)
{
    prism_worker_t *w = arg;
    sigset_t set;  /* signals go to the compute thread, which owns shutdown */
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    while (!atomic_load(&w->io_stop)) {
        double now = prism_now_s();
        double next = io_tick(w, now);
        zmq_pollitem_t items[PRISM_WORKER_MAX_ROUTERS + 2];
        int slot[PRISM_WORKER_MAX_ROUTERS];  /* router slot of each item (empty slots are not polled) */
        int n = 0;
        for (int i = 0; i < w->n_routers; i++) {
            if (!w->routers[i].sock) continue;
            slot[n] = i;
            items[n++] = (zmq_pollitem_t){w->routers[i].sock, 0, ZMQ_POLLIN, 0};
        }
        int n_ctl = n, pair_i = n;
        items[n++] = (zmq_pollitem_t){w->io_pair, 0, ZMQ_POLLIN, 0};
        int data_i = -1;
        if (w->data_sock && atomic_load(&w->data_forwarded) < atomic_load(&w->data_limit)) {
            data_i = n;
            items[n++] = (zmq_pollitem_t){w->data_sock, 0, ZMQ_POLLIN, 0};
        }
        long timeout_ms = (long)((next - prism_now_s()) * 1e3 + 0.999);
        timeout_ms = PRISM_MAX(0L, PRISM_MIN(timeout_ms, 1000L));
        int rc = zmq_poll(items, n, timeout_ms);
        if (rc <= 0) continue;
        for (int k = 0; k < n_ctl; k++)
            if (items[k].revents & ZMQ_POLLIN) io_routers(w, slot[k]);
        if (items[pair_i].revents & ZMQ_POLLIN) io_outbound(w);
        if (data_i >= 0 && (items[data_i].revents & ZMQ_POLLIN)) io_data(w);
    }
    if (w->close_linger_ms > 0) {
        /* The compute thread's last replies (errors for the requests it gave up) go out, and the
         * router sockets keep them for a while after close. */
        while (io_outbound(w) > 0) {}
        for (int i = 0; i < w->n_routers; i++)
            if (w->routers[i].sock)
                zmq_setsockopt(w->routers[i].sock, ZMQ_LINGER, &w->close_linger_ms, sizeof(w->close_linger_ms));
    } else {
        io_outbound(w);  /* replies the compute thread sent before it stopped go out (linger permitting) */
    }
    prism_msg_thread_exit();
    return NULL;
}

int prism_worker_start(prism_worker_t *w)
{
    PRISM_ASSERT(!w->io_started);
    w->last_heartbeat_s = prism_now_s() - w->heartbeat_s;
    if (pthread_create(&w->io_thread, NULL, io_main, w) != 0) {
        PRISM_ERROR("cannot start the worker's I/O thread");
        return PRISM_EIO;
    }
    w->io_started = true;
    return PRISM_OK;
}

static void wake_io(prism_worker_t *w)
{
    route_t rt = {ROUTE_WAKE, 0};
    zmq_send(w->cpu_pair, &rt, sizeof(rt), ZMQ_DONTWAIT);  /* a full pipe wakes it anyway */
}

void prism_worker_close_linger(prism_worker_t *w, int linger_ms)
{
    w->close_linger_ms = linger_ms;   /* read by the I/O thread after io_stop (seq_cst store below) */
}

void prism_worker_close(prism_worker_t *w)
{
    if (w->io_started) {
        atomic_store(&w->io_stop, true);
        wake_io(w);
        pthread_join(w->io_thread, NULL);
        w->io_started = false;
    }
    /* Envelopes still in the channel belong to us now. */
    if (w->cpu_pair) {
        for (;;) {
            zmq_msg_t part;
            zmq_msg_init(&part);
            if (zmq_msg_recv(&part, w->cpu_pair, ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&part);
                break;
            }
            inbound_hdr_t h;
            if (zmq_msg_size(&part) == sizeof(h)) {
                memcpy(&h, zmq_msg_data(&part), sizeof(h));
                prism_msg_env_free(h.env);
            }
            zmq_msg_close(&part);
            drop_rest(w->cpu_pair);
        }
        zmq_close(w->cpu_pair);
    }
    if (w->io_pair) zmq_close(w->io_pair);
    prism_resolver_stop(w->resolver);
    w->resolver = NULL;
    if (w->draining) {
        /* Results of the last requests (tokens to a router, embeddings or KV to a peer) may still sit
         * in a socket: give them time to leave rather than drop them (linger 0 elsewhere). */
        int linger = PRISM_DRAIN_LINGER_MS;
        for (int i = 0; i < w->n_routers; i++)
            if (w->routers[i].sock) zmq_setsockopt(w->routers[i].sock, ZMQ_LINGER, &linger, sizeof(linger));
        for (int i = 0; i < w->n_peers; i++)
            if (w->peers[i].sock) zmq_setsockopt(w->peers[i].sock, ZMQ_LINGER, &linger, sizeof(linger));
    }
    for (int i = 0; i < w->n_routers; i++)
        if (w->routers[i].sock) zmq_close(w->routers[i].sock);
    for (int i = 0; i < w->n_peers; i++)
        if (w->peers[i].sock) zmq_close(w->peers[i].sock);
    if (w->data_sock) zmq_close(w->data_sock);
    prism_net_destroy(w->net);
    w->net = NULL;
    pthread_mutex_destroy(&w->mu);
}

/* ---------------------------------------------------------------- compute thread */

int prism_worker_poll(prism_worker_t *w, int timeout_ms, prism_worker_msg_fn fn, void *ud)
{
    atomic_fetch_add(&w->polls, 1);
    int sig = prism_worker_signals();
    if (sig != w->signals_seen) {  /* a SIGTERM: the I/O thread starts the drain now, not at its next tick */
        w->signals_seen = sig;
        wake_io(w);
    }
    if (timeout_ms != 0) {
        zmq_pollitem_t it = {w->cpu_pair, 0, ZMQ_POLLIN, 0};
        atomic_store(&w->idle, true);
        int rc = zmq_poll(&it, 1, timeout_ms);
        atomic_store(&w->idle, false);
        if (rc < 0) return errno == EINTR ? PRISM_OK : PRISM_EIO;
        if (rc == 0) return PRISM_OK;
    }
    for (int k = 0; k < IO_DRAIN_MAX; k++) {
        zmq_msg_t part;
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, w->cpu_pair, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&part);
            break;
        }
        inbound_hdr_t h;
        PRISM_ASSERT(zmq_msg_size(&part) == sizeof(h));
        memcpy(&h, zmq_msg_data(&part), sizeof(h));
        zmq_msg_close(&part);
        prism_msg_t m;
        memset(&m, 0, offsetof(prism_msg_t, frames));
        m.env = h.env;
        m.n_frames = 0;
        m.identity_len = 0;
        while (has_more(w->cpu_pair)) {
            PRISM_ASSERT(m.n_frames < PRISM_MSG_MAX_FRAMES);  /* prism_msg_recv bounded it */
            zmq_msg_init(&m.frames[m.n_frames]);
            zmq_msg_recv(&m.frames[m.n_frames], w->cpu_pair, 0);
            m.n_frames++;
        }
        if (h.source < 0) w->data_received++;
        /* every line logged while it handles a message about a request carries the request's id and trace */
        prism_log_ctx_t lc = {0, {0, 0}};
        if (h.env) lc = (prism_log_ctx_t){h.env->request_id, {h.env->trace_id_hi, h.env->trace_id_lo}};
        const prism_log_ctx_t *prev = prism_log_ctx_enter(lc.request_id ? &lc : NULL);
        fn(w, &m, h.source, ud);
        prism_log_ctx_leave(prev);
        prism_msg_close(&m);
    }
    return PRISM_OK;
}

void prism_worker_accept_data(prism_worker_t *w, int free_slots)
{
    if (!w->data_sock) return;
    uint64_t lim = w->data_received + (uint64_t)PRISM_MAX(free_slots, 0);
    uint64_t old = atomic_exchange(&w->data_limit, lim);
    /* The I/O thread stopped polling the data socket when it ran out of credit: wake it. */
    if (lim > old && atomic_load(&w->data_forwarded) >= old) wake_io(w);
}

void prism_worker_set_load(prism_worker_t *w, const prism_worker_load_t *load)
{
    pthread_mutex_lock(&w->mu);
    w->load = *load;
    w->load_seq++;
    pthread_mutex_unlock(&w->mu);
}

int prism_worker_reply(prism_worker_t *w, const char *router_id, uint64_t request_id, uint64_t request_id_hi,
                       Prism__Envelope *env)
{
    route_t rt = {-1, 0};
    pthread_mutex_lock(&w->mu);
    for (int i = 0; i < w->n_routers && rt.slot < 0; i++)
        if (router_id && w->routers[i].sock && w->routers[i].router_id[0] && !strcmp(w->routers[i].router_id, router_id))
            rt = (route_t){i, w->routers[i].gen};
    pthread_mutex_unlock(&w->mu);
    if (rt.slot < 0) {
        PRISM_WARN("request %llu: owning router '%s' is not connected; reply dropped",
                   (unsigned long long)request_id, router_id ? router_id : "");
        return PRISM_ENOTFOUND;
    }
    env->request_id = request_id;
    env->request_id_hi = request_id_hi;
    env->router_id = (char *)router_id;
    return prism_msg_send(w->cpu_pair, &rt, sizeof(rt), env, NULL, 0, 0);
}

int prism_worker_broadcast(prism_worker_t *w, Prism__Envelope *env)
{
    route_t rt[PRISM_WORKER_MAX_ROUTERS];
    int n = 0, sent = 0;
    pthread_mutex_lock(&w->mu);
    for (int i = 0; i < w->n_routers; i++)
        if (w->routers[i].sock && w->routers[i].registered) rt[n++] = (route_t){i, w->routers[i].gen};
    pthread_mutex_unlock(&w->mu);
    for (int i = 0; i < n; i++) sent += prism_msg_send(w->cpu_pair, &rt[i], sizeof(rt[i]), env, NULL, 0, 0) == PRISM_OK;
    return sent;
}

int prism_worker_reply_error(prism_worker_t *w, const char *router_id, uint64_t request_id, uint64_t request_id_hi,
                             Prism__ErrorKind kind, const char *msg, bool from_prefill)
{
    Prism__Tokens t = PRISM__TOKENS__INIT;
    t.finish = PRISM__FINISH__FINISH_ERROR;
    t.error = (char *)msg;
    t.error_kind = kind;
    t.from_prefill = from_prefill;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_TOKENS;
    env.tokens = &t;
    return prism_worker_reply(w, router_id, request_id, request_id_hi, &env);
}

/* Nothing of ours waits in the link's queue (with HWM 1: it can take a message now). */
static bool peer_idle(void *sock)
{
    int ev = 0;
    size_t sz = sizeof(ev);
    return zmq_getsockopt(sock, ZMQ_EVENTS, &ev, &sz) == 0 && (ev & ZMQ_POLLOUT);
}

void *prism_worker_peer_sock(prism_worker_t *w, const char *endpoint)
{
    double now = prism_now_s();
    for (int i = 0; i < w->n_peers; i++)
        if (!strcmp(w->peers[i].endpoint, endpoint)) {
            w->peers[i].last_used = now;
            return w->peers[i].sock;
        }
    if (w->n_peers == PRISM_WORKER_MAX_PEERS) {
        int lru = -1;
        for (int i = 0; i < w->n_peers; i++) {
            const prism_worker_peer_t *p = &w->peers[i];
            if (now - p->last_used >= PRISM_WORKER_PEER_IDLE_S && (lru < 0 || p->last_used < w->peers[lru].last_used) &&
                peer_idle(p->sock))
                lru = i;
        }
        if (lru < 0) return NULL;
        PRISM_INFO("closing the idle link to %s for %s (peer table full)", w->peers[lru].endpoint, endpoint);
        zmq_close(w->peers[lru].sock);
        w->peers[lru] = w->peers[--w->n_peers];
        w->peers_closed++;
    }
    /* Encoders push embeddings to prefills, prefills (and decodes migrating a sequence) push KV to
     * decodes; a PUSH socket never receives, so its message bound only matters for the handshake. */
    prism_sock_opts_t so = {.type = ZMQ_PUSH, .endpoint = endpoint, .hwm = 1, .max_msg_bytes = 64 << 10,
                            .server = w->role == PRISM__ROLE__ROLE_ENCODER ? PRISM_NET_ROLE_PREFILL : PRISM_NET_ROLE_DECODE};
    void *s = prism_sock_connect(w->net, &so);
    if (!s) return NULL;
    prism_worker_peer_t *p = &w->peers[w->n_peers++];
    snprintf(p->endpoint, sizeof(p->endpoint), "%s", endpoint);
    p->sock = s;
    p->last_used = now;
    return s;
}

void prism_worker_progress(prism_worker_t *w, uint64_t units)
{
    atomic_fetch_add(&w->progress, units);
}

static void stall(prism_worker_t *w)
{
    PRISM_WARN("test hook PRISM_TEST_STALL_AFTER_LAYERS=%lld: the compute thread stalls here, without progress, "
               "until the process is stopped", (long long)w->stall_after);
    struct timespec ts = {0, 10 * 1000 * 1000};
    while (!prism_worker_should_stop()) nanosleep(&ts, NULL);
}

bool prism_worker_layer_done(prism_worker_t *w, int done, int total)
{
    double now = prism_now_s();
    if (done > 0) w->layer.last_s = now - w->layer.t_last;
    w->layer.t_last = now;
    w->layer.done = done;
    w->layer.total = total;
    uint64_t p = atomic_fetch_add(&w->progress, 1) + 1;
    if (w->stall_after >= 0 && p > (uint64_t)w->stall_after) {
        atomic_fetch_sub(&w->progress, 1);   /* that layer did not finish */
        stall(w);
    }
    uint64_t seq = atomic_load(&w->abort_seq);
    if (seq != w->aborts_seen) {
        w->aborts_seen = seq;
        return true;
    }
    return prism_worker_should_stop();
}

bool prism_worker_aborted(prism_worker_t *w, uint64_t rid, const char *router_id, double *waited_s)
{
    if (waited_s) *waited_s = 0;
    if (prism_worker_should_stop()) return true;
    bool found = false;
    pthread_mutex_lock(&w->mu);
    uint64_t n = PRISM_MIN(w->n_aborts, (uint64_t)PRISM_WORKER_ABORTS);
    for (uint64_t k = 0; k < n && !found; k++) {
        const prism_worker_abort_t *a = &w->aborts[(w->n_aborts - 1 - k) % PRISM_WORKER_ABORTS];
        if (a->rid == rid && !strcmp(a->router_id, router_id ? router_id : "")) {
            found = true;
            if (waited_s) *waited_s = prism_now_s() - a->t_arrive;
        }
    }
    pthread_mutex_unlock(&w->mu);
    return found;
}
