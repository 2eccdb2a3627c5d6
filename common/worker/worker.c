#include "worker/worker.h"
#include "model/model.h"

#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static volatile sig_atomic_t g_stop;

static void on_signal(int sig) { (void)sig; g_stop = 1; }

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
    o->max_message_bytes = 64ll << 20;
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
        PRISM_FLAG_STR("host", &o->host, "Address to bind the data endpoint on"),
        PRISM_FLAG_INT("data-port", &o->data_port, "Data endpoint port (0 = pick a free port)"),
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

int prism_worker_init(prism_worker_t *w, Prism__Role role, const prism_worker_opts_t *o, const char *data_bind,
                      size_t data_max_msg_bytes)
{
    memset(w, 0, sizeof(*w));
    prism__register__init(&w->reg);
    w->role = role;
    w->heartbeat_s = 1.0;
    snprintf(w->worker_id, sizeof(w->worker_id), "%s", o->worker_id);
    if (o->routers.n == 0) {
        PRISM_ERROR("no --router given: a worker needs at least one router control endpoint");
        return PRISM_EINVAL;
    }
    if (o->max_message_bytes < 1) {
        PRISM_ERROR("--max-message-bytes must be positive");
        return PRISM_EINVAL;
    }
    char err[512];
    prism_net_opts_t no = {.role = net_role(role), .curve_keys = o->curve_keys, .insecure = o->insecure_no_curve};
    if (prism_net_create(&no, &w->net, err, sizeof(err)) != PRISM_OK) {
        PRISM_ERROR("%s", err);
        return PRISM_EINVAL;
    }
    for (int i = 0; i < o->routers.n && i < PRISM_WORKER_MAX_ROUTERS; i++) {
        prism_worker_router_t *r = &w->routers[w->n_routers];
        snprintf(r->endpoint, sizeof(r->endpoint), "%s", o->routers.items[i]);
        /* Control messages are small and the router never sends a worker more requests than its
         * registered capacity, so this bound is never reached in normal operation; past it a send
         * waits (backpressure), nothing is dropped. */
        prism_sock_opts_t so = {.type = ZMQ_DEALER, .endpoint = r->endpoint, .hwm = PRISM_NET_CONTROL_HWM,
                                .max_msg_bytes = PRISM_MAX(o->max_message_bytes, (int64_t)PRISM_MSG_MAX_ENVELOPE),
                                .identity = w->worker_id, .server = PRISM_NET_ROLE_ROUTER};
        r->sock = prism_sock_connect(w->net, &so);
        if (!r->sock) return PRISM_EIO;
        w->n_routers++;
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
        if (router_id && !strcmp(w->routers[i].router_id, router_id))
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

void prism_worker_tick(prism_worker_t *w, Prism__Heartbeat *hb)
{
    double now = prism_now_s();
    for (int i = 0; i < w->n_routers; i++) {
        prism_worker_router_t *r = &w->routers[i];
        if (r->registered || now - r->last_register_s < 0.5) continue;
        Prism__Envelope env = PRISM__ENVELOPE__INIT;
        env.type = PRISM__MSG_TYPE__MSG_REGISTER;
        env.reg = &w->reg;
        if (prism_msg_send(r->sock, NULL, 0, &env, NULL, 0, ZMQ_DONTWAIT) == PRISM_OK)
            PRISM_DEBUG("registering with %s", r->endpoint);
        r->last_register_s = now;
    }
    if (now - w->last_heartbeat_s < w->heartbeat_s) return;
    w->last_heartbeat_s = now;
    hb->worker_id = w->worker_id;
    hb->mem_used = prism_mem_used();
    hb->mem_peak = prism_mem_peak();
    hb->alloc_count = prism_mem_alloc_count();
    hb->peer_auth_failures = prism_net_refused(w->net);
    for (int i = 0; i < w->n_routers; i++) {
        if (!w->routers[i].registered) continue;
        Prism__Envelope env = PRISM__ENVELOPE__INIT;
        env.type = PRISM__MSG_TYPE__MSG_HEARTBEAT;
        env.heartbeat = hb;
        prism_msg_send(w->routers[i].sock, NULL, 0, &env, NULL, 0, ZMQ_DONTWAIT);
    }
}

static bool handle_control(prism_worker_t *w, prism_msg_t *m, int ri)
{
    if (m->env->type != PRISM__MSG_TYPE__MSG_REGISTER_ACK) return false;
    prism_worker_router_t *r = &w->routers[ri];
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
    int n = 0;
    for (int i = 0; i < w->n_routers; i++)
        items[n++] = (zmq_pollitem_t){w->routers[i].sock, 0, ZMQ_POLLIN, 0};
    bool data = accept_data && w->data_sock;
    if (data) items[n++] = (zmq_pollitem_t){w->data_sock, 0, ZMQ_POLLIN, 0};
    int rc = zmq_poll(items, n, timeout_ms);
    if (rc <= 0) return rc < 0 ? PRISM_EIO : PRISM_OK;
    for (int i = 0; i < w->n_routers; i++) {
        if (!(items[i].revents & ZMQ_POLLIN)) continue;
        /* Drain control messages: they are small and must not wait behind compute. */
        for (int k = 0; k < 1024; k++) {
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
