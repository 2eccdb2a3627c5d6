#include "worker/worker.h"
#include "model/model.h"
#include "net/resolve.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The first SIGTERM/SIGINT asks for a drain (prism_worker_tick: no new work, finish what is held,
 * exit once the routers release us); a second one, or the end of the drain, stops the loop. */
static volatile sig_atomic_t g_signals, g_stop;

static void on_signal(int sig)
{
    (void)sig;
    if (g_signals < 2) g_signals++;
    if (g_signals > 1) g_stop = 1;
}

void prism_worker_install_signals(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
}

bool prism_worker_should_stop(void) { return g_stop != 0; }

/* ---------------------------------------------------------------- memory plan */

void prism_mem_plan_add(prism_mem_plan_t *p, const char *name, size_t bytes)
{
    PRISM_ASSERT(p->n < PRISM_PLAN_MAX);
    p->name[p->n] = name;
    p->bytes[p->n] = bytes;
    p->n++;
}

size_t prism_mem_plan_total(const prism_mem_plan_t *p)
{
    size_t t = 0;
    for (int i = 0; i < p->n; i++) t += p->bytes[i];
    return t;
}

size_t prism_mem_runtime_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long long size = 0, resident = 0;
    if (!f) return 0;
    if (fscanf(f, "%llu %llu", &size, &resident) != 2) resident = 0;
    fclose(f);
    size_t rss = (size_t)resident * (size_t)sysconf(_SC_PAGESIZE), heap = prism_mem_used();
    return rss > heap ? rss - heap : 0;
}

int prism_mem_plan_check(const prism_mem_plan_t *p, const char *who)
{
    char a[32], b[32];
    size_t total = prism_mem_plan_total(p);
    for (int i = 0; i < p->n; i++)
        PRISM_INFO("%s memory plan: %-18s %s", who, p->name[i], prism_fmt_bytes(p->bytes[i], a, sizeof(a)));
    PRISM_INFO("%s memory plan: %-18s %s of budget %s", who, "total", prism_fmt_bytes(total, a, sizeof(a)),
               p->budget ? prism_fmt_bytes(p->budget, b, sizeof(b)) : "(none)");
    if (p->budget && total > p->budget) {
        PRISM_ERROR("%s: the memory plan needs %s (%zu bytes) but --mem-budget is %s (%zu bytes); "
                    "raise --mem-budget or lower the pool sizes", who, prism_fmt_bytes(total, a, sizeof(a)), total,
                    prism_fmt_bytes(p->budget, b, sizeof(b)), p->budget);
        return PRISM_ENOMEM;
    }
    return PRISM_OK;
}

/* ---------------------------------------------------------------- options */

void prism_worker_opts_defaults(prism_worker_opts_t *o, const char *role)
{
    memset(o, 0, sizeof(*o));
    o->model_path = "models/prism-tiny-llava";
    o->host = "127.0.0.1";
    o->data_port = 0;
    o->device = "cpu";
    o->threads = 1;
    o->mem_budget = 0;
    o->log_level = "info";
    o->heartbeat_s = 1.0;
    o->router_resolve_s = 5.0;
    o->max_message_bytes = 64ll << 20;
    o->drain_timeout_s = 30.0;
    static char id[128];
    char host[64] = "host";
    gethostname(host, sizeof(host) - 1);
    snprintf(id, sizeof(id), "%s-%s-%d", role, host, (int)getpid());
    o->worker_id = id;
}

int prism_worker_opts_flags(prism_worker_opts_t *o, prism_flag_t *t, int n)
{
    prism_flag_t f[] = {
        PRISM_FLAG_STR("model-path", &o->model_path, "HF model directory (config.json, *.safetensors)"),
        PRISM_FLAG_LIST("router", &o->routers, "Router control endpoint(s), e.g. tcp://127.0.0.1:8100 (repeatable)"),
        PRISM_FLAG_STR("worker-id", &o->worker_id, "Unique worker id"),
        PRISM_FLAG_STR("host", &o->host, "Address to bind the data endpoint on (0.0.0.0: every interface)"),
        PRISM_FLAG_INT("data-port", &o->data_port, "Data endpoint port (0 = pick a free port)"),
        PRISM_FLAG_STR("advertise-host", &o->advertise_host,
                       "Host or address peers reach the data endpoint at, when it differs from --host (NAT, "
                       "containers; required with a wildcard --host)"),
        PRISM_FLAG_INT("advertise-port", &o->advertise_port, "Port peers reach the data endpoint at (0 = the bound port)"),
        PRISM_FLAG_DOUBLE("router-resolve-interval", &o->router_resolve_s,
                          "Seconds between DNS lookups of a --router host name (each address is a router)"),
        PRISM_FLAG_STR("device", &o->device, "Compute device: cpu or cuda"),
        PRISM_FLAG_INT("threads", &o->threads, "CPU backend threads"),
        PRISM_FLAG_BYTES("mem-budget", &o->mem_budget, "Memory budget (bytes, e.g. 2G); start-up fails if the plan exceeds it"),
        PRISM_FLAG_STR("log-level", &o->log_level, "debug, info, warn or error"),
        PRISM_FLAG_DOUBLE("heartbeat-interval", &o->heartbeat_s, "Seconds between heartbeats"),
        PRISM_FLAG_BOOL("random-weights", &o->random_weights,
                        "Seeded random weights of config.json's shapes instead of safetensors (benchmarks)"),
        PRISM_FLAG_STR("curve-keys", &o->curve_keys,
                       "CURVE key directory (made by prism_keygen): this role's secret key and the cluster's public keys"),
        PRISM_FLAG_BOOL("insecure-no-curve", &o->insecure_no_curve,
                        "Unauthenticated internal links (only on an isolated network; logs a warning)"),
        PRISM_FLAG_BYTES("max-message-bytes", &o->max_message_bytes,
                         "Largest message accepted from a router (an image file for encoders); bigger drops the link"),
        PRISM_FLAG_DOUBLE("drain-timeout", &o->drain_timeout_s,
                          "SIGTERM drains: no new work, the held requests finish, exit when the routers release "
                          "this worker or after this many seconds (a second SIGTERM exits at once)"),
    };
    _Static_assert(sizeof(f) / sizeof(f[0]) == PRISM_WORKER_N_FLAGS, "PRISM_WORKER_N_FLAGS");
    for (size_t i = 0; i < PRISM_ARRAY_LEN(f); i++)
        t[n++] = f[i];
    t[n] = (prism_flag_t)PRISM_FLAG_END;
    return n;
}

int prism_worker_startup(int argc, char **argv, const char *role, const char *summary, prism_flag_t *flags,
                         prism_worker_opts_t *o, struct prism_model_config *cfg)
{
    int n_own = 0;
    while (flags[n_own].name) n_own++;
    prism_worker_opts_flags(o, flags, n_own);
    char prog[64];
    snprintf(prog, sizeof(prog), "%s_worker", role);
    int rc = prism_cli_parse(argc, argv, prog, summary, flags);
    if (rc) return rc > 0 ? 0 : 2;
    prism_log_init(role, prism_log_level_parse(o->log_level));
    bool wildcard = !strcmp(o->host, "0.0.0.0") || !strcmp(o->host, "*") || !strcmp(o->host, "::");
    if (strcmp(role, "encoder") != 0 && wildcard && !(o->advertise_host && *o->advertise_host)) {
        PRISM_ERROR("--host %s binds every interface, which peers cannot connect to: give --advertise-host with "
                    "the address they reach this worker at", o->host);
        return 2;
    }
    if (o->advertise_port < 0 || o->advertise_port > 65535 || !(o->router_resolve_s > 0) || !(o->drain_timeout_s >= 0)) {
        PRISM_ERROR("--advertise-port must be 0..65535, --router-resolve-interval positive, --drain-timeout >= 0");
        return 2;
    }
    if (!o->insecure_no_curve == !(o->curve_keys && *o->curve_keys)) {  /* fail before loading a model */
        PRISM_ERROR("%s", o->insecure_no_curve ? "--curve-keys and --insecure-no-curve contradict each other: give one"
                          : "internal links are authenticated with CURVE keys: give --curve-keys DIR (create one with "
                            "`prism_keygen --out DIR`), or --insecure-no-curve on a trusted, isolated network");
        return 2;
    }
    prism_worker_install_signals();
    char err[512] = "";
    if (prism_model_config_load(o->model_path, cfg, err, sizeof(err)) != PRISM_OK) {
        PRISM_ERROR("cannot load model config from %s: %s", o->model_path, err);
        return 1;
    }
    cfg->random_weights = o->random_weights;
    cfg->random_seed = 1234;
    return -1;
}

void prism_worker_set_capacity(prism_worker_t *w, const prism_worker_opts_t *o, const prism_mem_plan_t *plan,
                               uint32_t kv_blocks, uint32_t block_size, uint32_t max_batch_tokens,
                               uint32_t max_running, uint32_t max_model_len)
{
    w->heartbeat_s = o->heartbeat_s;
    w->router_resolve_s = o->router_resolve_s;
    w->drain_timeout_s = o->drain_timeout_s;
    if (w->data_sock && ((o->advertise_host && *o->advertise_host) || o->advertise_port > 0)) {
        /* The bound endpoint is tcp://HOST:PORT as the socket sees it; peers behind NAT or in
         * another network namespace reach it under another host (and port). */
        const char *colon = strrchr(w->data_endpoint, ':');
        long port = colon ? strtol(colon + 1, NULL, 10) : 0;
        char ep[sizeof(w->data_endpoint)];
        snprintf(ep, sizeof(ep), "tcp://%s:%ld", o->advertise_host && *o->advertise_host ? o->advertise_host : o->host,
                 o->advertise_port > 0 ? (long)o->advertise_port : port);
        PRISM_INFO("data endpoint %s advertised as %s", w->data_endpoint, ep);
        snprintf(w->data_endpoint, sizeof(w->data_endpoint), "%s", ep);
    }
    w->reg.mem_budget = (uint64_t)o->mem_budget;
    w->reg.mem_planned = prism_mem_plan_total(plan);
    w->reg.kv_blocks = kv_blocks;
    w->reg.block_size = block_size;
    w->reg.max_batch_tokens = max_batch_tokens;
    w->reg.max_running = max_running;
    w->reg.max_model_len = max_model_len;
    w->reg.tp_size = 1;
}

void prism_worker_data_bind(const prism_worker_opts_t *o, char *out, size_t n)
{
    if (o->data_port > 0) snprintf(out, n, "tcp://%s:%lld", o->host, (long long)o->data_port);
    else snprintf(out, n, "tcp://%s:*", o->host);
}

/* ---------------------------------------------------------------- sockets */

static prism_net_role_t net_role(Prism__Role role)
{
    switch (role) {
    case PRISM__ROLE__ROLE_ENCODER: return PRISM_NET_ROLE_ENCODER;
    case PRISM__ROLE__ROLE_PREFILL: return PRISM_NET_ROLE_PREFILL;
    case PRISM__ROLE__ROLE_DECODE:  return PRISM_NET_ROLE_DECODE;
    default:                        return PRISM_NET_ROLE_NONE;
    }
}

static int router_connect(prism_worker_t *w, const char *endpoint, bool from_name)
{
    int slot = -1;
    for (int i = 0; i < w->n_routers && slot < 0; i++)
        if (!w->routers[i].sock) slot = i;
    if (slot < 0) {
        if (w->n_routers == PRISM_WORKER_MAX_ROUTERS) {
            PRISM_WARN("router %s ignored: already connected to %d routers", endpoint, PRISM_WORKER_MAX_ROUTERS);
            return PRISM_ELIMIT;
        }
        slot = w->n_routers++;
    }
    prism_worker_router_t *r = &w->routers[slot];
    memset(r, 0, sizeof(*r));
    snprintf(r->endpoint, sizeof(r->endpoint), "%s", endpoint);
    r->from_name = from_name;
    /* Control messages are small and the router never sends a worker more requests than its
     * registered capacity, so this bound is never reached in normal operation; past it a send
     * waits (backpressure), nothing is dropped. */
    prism_sock_opts_t so = {.type = ZMQ_DEALER, .endpoint = r->endpoint, .hwm = PRISM_NET_CONTROL_HWM,
                            .max_msg_bytes = w->router_max_msg_bytes, .identity = w->worker_id,
                            .server = PRISM_NET_ROLE_ROUTER};
    r->sock = prism_sock_connect(w->net, &so);
    return r->sock ? PRISM_OK : PRISM_EIO;
}

/* Connects the addresses new to the names' latest lookup and closes those that left them. */
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
    static prism_endpoints_t now;  /* 8 KiB: off the stack; one worker per process */
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
        memset(r, 0, sizeof(*r));
    }
    while (w->n_routers && !w->routers[w->n_routers - 1].sock) w->n_routers--;
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
    snprintf(w->worker_id, sizeof(w->worker_id), "%s", o->worker_id);
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
        /* A name is connected address by address once its first lookup ends (prism_worker_tick). */
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
         * Embeddings come from encoders only, KV from prefills only. */
        prism_sock_opts_t so = {.type = ZMQ_PULL, .endpoint = data_bind, .hwm = 1,
                                .max_msg_bytes = (int64_t)PRISM_MAX(data_max_msg_bytes, (size_t)PRISM_MSG_MAX_ENVELOPE),
                                .allow = role == PRISM__ROLE__ROLE_PREFILL ? PRISM_NET_ALLOW(PRISM_NET_ROLE_ENCODER)
                                                                          : PRISM_NET_ALLOW(PRISM_NET_ROLE_PREFILL)};
        w->data_sock = prism_sock_bind(w->net, &so);
        if (!w->data_sock) return PRISM_EIO;
        prism_sock_last_endpoint(w->data_sock, w->data_endpoint, sizeof(w->data_endpoint));
    }
    w->reg.role = role;
    w->reg.worker_id = w->worker_id;
    w->reg.data_endpoint = w->data_endpoint;
    return PRISM_OK;
}

void prism_worker_close(prism_worker_t *w)
{
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
}

void *prism_worker_router_sock(prism_worker_t *w, const char *router_id)
{
    for (int i = 0; i < w->n_routers; i++)
        if (router_id && w->routers[i].sock && !strcmp(w->routers[i].router_id, router_id))
            return w->routers[i].sock;
    return NULL;
}

void *prism_worker_peer_sock(prism_worker_t *w, const char *endpoint)
{
    for (int i = 0; i < w->n_peers; i++)
        if (!strcmp(w->peers[i].endpoint, endpoint))
            return w->peers[i].sock;
    if (w->n_peers == PRISM_WORKER_MAX_PEERS) return NULL;
    /* Encoders push embeddings to prefills, prefills push KV to decodes; a PUSH socket never
     * receives, so its message bound only matters for the handshake. */
    prism_sock_opts_t so = {.type = ZMQ_PUSH, .endpoint = endpoint, .hwm = 1, .max_msg_bytes = 64 << 10,
                            .server = w->role == PRISM__ROLE__ROLE_ENCODER ? PRISM_NET_ROLE_PREFILL : PRISM_NET_ROLE_DECODE};
    void *s = prism_sock_connect(w->net, &so);
    if (!s) return NULL;
    prism_worker_peer_t *p = &w->peers[w->n_peers++];
    snprintf(p->endpoint, sizeof(p->endpoint), "%s", endpoint);
    p->sock = s;
    return s;
}

int prism_worker_reply(prism_worker_t *w, const char *router_id, uint64_t request_id, Prism__Envelope *env)
{
    void *s = prism_worker_router_sock(w, router_id);
    if (!s) {
        PRISM_WARN("request %llu: owning router '%s' is not connected; reply dropped",
                   (unsigned long long)request_id, router_id ? router_id : "");
        return PRISM_ENOTFOUND;
    }
    env->request_id = request_id;
    env->router_id = (char *)router_id;
    return prism_msg_send(s, NULL, 0, env, NULL, 0, 0);
}

/* ---------------------------------------------------------------- registration, heartbeats */

/* Drain: decides when a draining worker may exit. A router holding no request on us says so
 * (DrainAck inflight 0, or router_stopping); one that has not answered for PRISM_DRAIN_ROUTER_GONE_S
 * seconds (SIGKILLed, unreachable) is not waited for. */
static void drain_step(prism_worker_t *w, const Prism__Heartbeat *hb, double now)
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
    bool idle = hb->running == 0 && hb->waiting == 0;
    if (idle && waiting_for == 0) {
        PRISM_INFO("drained in %.2fs: every router released this worker; exiting", now - w->drain_start_s);
        g_stop = 1;
    } else if (now - w->drain_start_s > w->drain_timeout_s) {
        PRISM_WARN("--drain-timeout %.1fs passed with %u running, %u queued, %d router(s) still holding requests "
                   "here: exiting", w->drain_timeout_s, hb->running, hb->waiting, waiting_for);
        g_stop = 1;
    }
}

void prism_worker_tick(prism_worker_t *w, Prism__Heartbeat *hb)
{
    routers_follow_names(w);
    double now = prism_now_s();
    if (g_signals && !w->draining) {
        w->draining = true;
        w->drain_start_s = now;
        w->last_heartbeat_s = 0;  /* tell the routers now */
        PRISM_INFO("SIGTERM: draining (no new work; %u running, %u queued finish first; at most %.1fs, a second "
                   "signal exits at once)", hb->running, hb->waiting, w->drain_timeout_s);
    }
    for (int i = 0; i < w->n_routers; i++) {
        prism_worker_router_t *r = &w->routers[i];
        /* a draining worker registers nowhere: a router that lost it has nothing on it */
        if (!r->sock || r->registered || w->draining || now - r->last_register_s < 0.5) continue;
        Prism__Envelope env = PRISM__ENVELOPE__INIT;
        env.type = PRISM__MSG_TYPE__MSG_REGISTER;
        env.reg = &w->reg;
        if (prism_msg_send(r->sock, NULL, 0, &env, NULL, 0, ZMQ_DONTWAIT) == PRISM_OK)
            PRISM_DEBUG("registering with %s", r->endpoint);
        r->last_register_s = now;
    }
    /* While draining, heartbeats go out often: each is answered with what the router still holds. */
    double every = w->draining ? PRISM_MIN(w->heartbeat_s, PRISM_DRAIN_HEARTBEAT_S) : w->heartbeat_s;
    if (w->draining) drain_step(w, hb, now);
    if (now - w->last_heartbeat_s < every) return;
    w->last_heartbeat_s = now;
    hb->draining = w->draining;
    hb->worker_id = w->worker_id;
    hb->mem_used = prism_mem_used();
    hb->mem_peak = prism_mem_peak();
    hb->alloc_count = prism_mem_alloc_count();
    hb->peer_auth_failures = prism_net_refused(w->net);
    for (int i = 0; i < w->n_routers; i++) {
        if (!w->routers[i].sock || !w->routers[i].registered) continue;
        Prism__Envelope env = PRISM__ENVELOPE__INIT;
        env.type = PRISM__MSG_TYPE__MSG_HEARTBEAT;
        env.heartbeat = hb;
        prism_msg_send(w->routers[i].sock, NULL, 0, &env, NULL, 0, ZMQ_DONTWAIT);
    }
}

static bool handle_control(prism_worker_t *w, prism_msg_t *m, int ri)
{
    prism_worker_router_t *r = &w->routers[ri];
    if (m->env->type == PRISM__MSG_TYPE__MSG_DRAIN_ACK) {
        const Prism__DrainAck *d = m->env->drain_ack;
        if (!d) return true;
        r->drain_reply_s = prism_now_s();
        if (d->router_stopping) {
            r->registered = false;  /* it is going away: nothing to wait for; register again if it returns */
            r->last_register_s = r->drain_reply_s;
        } else if (w->draining && d->inflight == 0 && !r->released) {
            r->released = true;
            PRISM_INFO("router %s released this draining worker", r->router_id);
        }
        return true;
    }
    if (m->env->type != PRISM__MSG_TYPE__MSG_REGISTER_ACK) return false;
    const Prism__RegisterAck *ack = m->env->reg_ack;
    if (ack && ack->ok) {
        snprintf(r->router_id, sizeof(r->router_id), "%s", m->env->router_id ? m->env->router_id : "");
        if (!r->registered)
            PRISM_INFO("registered with router %s (%s)", r->router_id, r->endpoint);
        r->registered = true;
    } else {
        /* The router does not know us (it restarted) or refused us: register again later. */
        if (r->registered || (ack && ack->message && *ack->message))
            PRISM_WARN("router %s: %s", r->endpoint, ack && ack->message ? ack->message : "registration lost");
        r->registered = false;
        r->last_register_s = prism_now_s();
    }
    return true;
}

int prism_worker_poll(prism_worker_t *w, int timeout_ms, bool accept_data, prism_worker_msg_fn fn, void *ud)
{
    zmq_pollitem_t items[PRISM_WORKER_MAX_ROUTERS + 1];
    int slot[PRISM_WORKER_MAX_ROUTERS];  /* router slot of each item (empty slots are not polled) */
    int n = 0;
    for (int i = 0; i < w->n_routers; i++) {
        if (!w->routers[i].sock) continue;
        slot[n] = i;
        items[n++] = (zmq_pollitem_t){w->routers[i].sock, 0, ZMQ_POLLIN, 0};
    }
    int n_ctl = n;
    bool data = accept_data && w->data_sock;
    if (data) items[n++] = (zmq_pollitem_t){w->data_sock, 0, ZMQ_POLLIN, 0};
    int rc = zmq_poll(items, n, timeout_ms);  /* no item yet (a name not resolved): zmq_poll sleeps */
    if (rc <= 0) return rc < 0 ? PRISM_EIO : PRISM_OK;
    for (int k = 0; k < n_ctl; k++) {
        int i = slot[k];
        if (!(items[k].revents & ZMQ_POLLIN)) continue;
        /* Drain control messages: they are small and must not wait behind compute. */
        for (int j = 0; j < 1024; j++) {
            prism_msg_t m;
            int r = prism_msg_recv(w->routers[i].sock, false, &m, ZMQ_DONTWAIT);
            if (r == PRISM_EAGAIN || r == PRISM_EIO) break;
            if (r != PRISM_OK) continue;
            if (!handle_control(w, &m, i)) fn(w, &m, i, ud);
            prism_msg_close(&m);
        }
    }
    if (data && (items[n - 1].revents & ZMQ_POLLIN)) {
        /* One data message per poll: the caller re-checks its pool before accepting another. */
        prism_msg_t m;
        if (prism_msg_recv(w->data_sock, false, &m, ZMQ_DONTWAIT) == PRISM_OK) {
            fn(w, &m, -1, ud);
            prism_msg_close(&m);
        }
    }
    return PRISM_OK;
}
