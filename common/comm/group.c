/* Group rendezvous over ZeroMQ and the group's liveness (see group.h for the protocol). */
#include "comm/group.h"
#include "comm/comm_impl.h"
#include "net/net.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#define ERR(...) do { if (err && errlen) snprintf(err, errlen, __VA_ARGS__); } while (0)
#define LINK_HWM 1000
#define HELLO_RESEND_S 1.0

typedef struct {
    bool joined;
    prism_comm_ident_t ident;
    int32_t pid;
    uint64_t start, pid_ns;
    char host_key[192];
    char transport[8];
} member_t;

struct prism_group {
    int size, rank;
    char name[128];
    void *zctx;
    void *sock;                   /* leader: ROUTER; ranks: DEALER */
    void *mon;                    /* PAIR reading the link's disconnect events */
    bool formed;                  /* past GO: disconnects count as deaths from now on */
    prism_comm_t *comm;
    member_t m[PRISM_TP_MAX];
    prism_comm_peer_t peers[PRISM_TP_MAX];
    char shm_name[96];            /* leader: unlinked once every rank attached */
    char transport[8];
    size_t mem_bytes;
    bool dead;
    char dead_why[192];
    void *nccl_module;
};

/* ---------------------------------------------------------------- identity of this process */

static void host_key(char *out, size_t n)
{
    char boot[64] = "", host[64] = "";
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        if (!fgets(boot, sizeof boot, f)) boot[0] = 0;
        fclose(f);
        boot[strcspn(boot, "\n")] = 0;
    }
    gethostname(host, sizeof host - 1);
    struct stat st = {0};
    stat("/dev/shm", &st);
    snprintf(out, n, "%s/%s/%llx:%llx", host, boot, (unsigned long long)st.st_dev, (unsigned long long)st.st_ino);
}

static uint64_t pid_ns(void)
{
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

static const char *device_kind(const prism_backend_t *be)
{
    return be && be->device && strncmp(be->device, "cuda", 4) == 0 ? "cuda" : "cpu";
}

static const char *transport_name(prism_comm_transport_t t)
{
    return t == PRISM_COMM_TRANSPORT_SHM ? "shm" : t == PRISM_COMM_TRANSPORT_ZMQ ? "zmq" : "auto";
}

/* ---------------------------------------------------------------- liveness */

static void drain_monitor(prism_group_t *g)
{
    if (!g->mon) return;
    for (;;) {
        zmq_msg_t ev;
        zmq_msg_init(&ev);
        if (zmq_msg_recv(&ev, g->mon, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&ev);
            return;
        }
        uint16_t event = 0;
        if (zmq_msg_size(&ev) >= 2) memcpy(&event, zmq_msg_data(&ev), 2);
        int more = zmq_msg_more(&ev);
        zmq_msg_close(&ev);
        char addr[128] = "";
        if (more) {
            zmq_msg_t a;
            zmq_msg_init(&a);
            if (zmq_msg_recv(&a, g->mon, 0) >= 0) {
                size_t l = PRISM_MIN(zmq_msg_size(&a), sizeof addr - 1);
                memcpy(addr, zmq_msg_data(&a), l);
                addr[l] = 0;
            }
            zmq_msg_close(&a);
        }
        if (g->formed && event == ZMQ_EVENT_DISCONNECTED && !g->dead) {
            g->dead = true;
            snprintf(g->dead_why, sizeof g->dead_why, "the group link to %s closed (%s)",
                     g->rank == 0 ? "a rank" : "the leader", addr);
        }
    }
}

static int group_alive(void *ud, char *why, size_t whylen)
{
    prism_group_t *g = ud;
    if (!g->dead) {
        for (int r = 0; r < g->size && !g->dead; r++) {
            if (r == g->rank) continue;
            if (!prism_proc_alive(g->peers[r].pid, g->peers[r].start)) {
                g->dead = true;
                snprintf(g->dead_why, sizeof g->dead_why, "rank %d (pid %d) is gone", r, (int)g->peers[r].pid);
            }
        }
    }
    if (!g->dead) drain_monitor(g);
    if (g->dead && why && whylen) snprintf(why, whylen, "%s", g->dead_why);
    return g->dead ? PRISM_EIO : PRISM_OK;
}

int prism_group_check(prism_group_t *g)
{
    if (!g || g->size == 1) return PRISM_OK;
    bool was = g->dead;
    int rc = group_alive(g, NULL, 0);
    if (rc != PRISM_OK) {
        if (!was) PRISM_ERROR("group %s: rank %d: %s", g->name, g->rank, g->dead_why);
        if (g->comm) g->comm->i.abort(g->comm->ctx);
    }
    return rc;
}

/* ---------------------------------------------------------------- messages */

static int send_env_flags(prism_group_t *g, int to, Prism__Envelope *env, int flags);
static int send_env(prism_group_t *g, int to, Prism__Envelope *env) { return send_env_flags(g, to, env, 0); }

static int send_env_flags(prism_group_t *g, int to, Prism__Envelope *env, int flags)
{
    const void *id = NULL;
    size_t len = 0;
    if (g->rank == 0) {
        id = g->m[to].ident.id;
        len = g->m[to].ident.len;
    }
    return prism_msg_send(g->sock, id, len, env, NULL, 0, flags);
}

/* Waits up to the deadline for one link message. PRISM_EAGAIN on timeout. */
static int recv_until(prism_group_t *g, prism_msg_t *m, uint64_t deadline_ns)
{
    for (;;) {
        uint64_t now = prism_now_ns();
        if (now >= deadline_ns) return PRISM_EAGAIN;
        long ms = (long)((deadline_ns - now) / 1000000) + 1;
        zmq_pollitem_t it = {g->sock, 0, ZMQ_POLLIN, 0};
        int n = zmq_poll(&it, 1, PRISM_MIN(ms, 200L));
        if (n < 0) return PRISM_EIO;
        if (n == 0) return PRISM_EAGAIN;
        int rc = prism_msg_recv(g->sock, g->rank == 0, m, ZMQ_DONTWAIT);
        if (rc == PRISM_OK) return PRISM_OK;
        if (rc != PRISM_EAGAIN && rc != PRISM_ECORRUPT) return rc;
    }
}

static int find_member(prism_group_t *g, const prism_msg_t *m)
{
    for (int r = 1; r < g->size; r++)
        if (g->m[r].joined && g->m[r].ident.len == m->identity_len &&
            !memcmp(g->m[r].ident.id, m->identity, m->identity_len))
            return r;
    return -1;
}

static void refuse(prism_group_t *g, const prism_msg_t *m, const char *why)
{
    Prism__TpWelcome w = PRISM__TP_WELCOME__INIT;
    w.ok = false;
    w.error = (char *)why;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_TP_WELCOME;
    env.tp_welcome = &w;
    prism_msg_send(g->sock, m->identity, m->identity_len, &env, NULL, 0, ZMQ_DONTWAIT);
    PRISM_WARN("group %s: refused a rank: %s", g->name, why);
}

/* ---------------------------------------------------------------- NCCL module */

static int nccl_load(prism_group_t *g, prism_comm_nccl_id_fn *id_fn, prism_comm_nccl_create_fn *create_fn,
                     char *err, size_t errlen)
{
    char why[512];
    if (!g->nccl_module) g->nccl_module = prism_backend_module_open(PRISM_COMM_NCCL_MODULE, why, sizeof why);
    if (!g->nccl_module) {
        ERR("group: the NCCL communicator module (%s) cannot be loaded: %.300s", PRISM_COMM_NCCL_MODULE, why);
        return PRISM_ENOTSUP;
    }
    *id_fn = (prism_comm_nccl_id_fn)dlsym(g->nccl_module, "prism_comm_nccl_unique_id");
    *create_fn = (prism_comm_nccl_create_fn)dlsym(g->nccl_module, "prism_comm_nccl_create");
    if (!*id_fn || !*create_fn) {
        ERR("group: %s lacks its entry points", PRISM_COMM_NCCL_MODULE);
        return PRISM_ENOTSUP;
    }
    return PRISM_OK;
}

/* ---------------------------------------------------------------- rendezvous */

static bool wildcard_endpoint(const char *ep)
{
    return strstr(ep, "://*") || strstr(ep, "://0.0.0.0") || strstr(ep, "://[::]") || strstr(ep, "://::");
}

static int leader_join(prism_group_t *g, const prism_group_opts_t *o, uint64_t deadline, char *err, size_t errlen)
{
    const char *dev = device_kind(o->be);
    int missing = g->size - 1;
    while (missing > 0) {
        prism_msg_t m;
        int rc = recv_until(g, &m, deadline);
        if (rc == PRISM_EAGAIN && prism_now_ns() < deadline) continue;
        if (rc != PRISM_OK) {
            char miss[256] = "";
            size_t len = 0;
            for (int r = 1; r < g->size && len + 8 < sizeof miss; r++)
                if (!g->m[r].joined) len += (size_t)snprintf(miss + len, sizeof miss - len, "%s%d", len ? "," : "", r);
            ERR("group %s: rank(s) %s did not join within %.0f s (leader %s)", g->name, miss, o->join_timeout_s,
                o->leader);
            return PRISM_EIO;
        }
        const Prism__TpHello *h = m.env->tp_hello;
        if (m.env->type != PRISM__MSG_TYPE__MSG_TP_HELLO || !h || m.identity_len > sizeof g->m[0].ident.id) {
            prism_msg_close(&m);
            continue;
        }
        char why[256] = "";
        int r = (int)h->rank;
        if (h->size != (uint32_t)g->size)
            snprintf(why, sizeof why, "group size %u, the leader's is %d", h->size, g->size);
        else if (h->rank < 1 || h->rank >= (uint32_t)g->size)
            snprintf(why, sizeof why, "rank %u out of range 1..%d", h->rank, g->size - 1);
        else if (strcmp(h->device ? h->device : "", dev) != 0)
            snprintf(why, sizeof why, "device %s, the leader's is %s", h->device ? h->device : "?", dev);
        else if (g->m[r].joined) {
            member_t *p = &g->m[r];
            bool same = p->pid == h->pid && p->start == h->start_time && !strcmp(p->host_key, h->host_key ? h->host_key : "");
            if (same) {   /* a resent HELLO of the same process */
                prism_msg_close(&m);
                continue;
            }
            bool comparable = p->pid_ns == pid_ns() && !strcmp(p->host_key, h->host_key ? h->host_key : "");
            if (comparable && !prism_proc_alive(p->pid, p->start)) {
                PRISM_INFO("group %s: rank %d rejoined (pid %d replaces dead pid %d)", g->name, r, h->pid, p->pid);
                p->joined = false;
                missing++;
            } else {
                snprintf(why, sizeof why, "rank %d already joined (pid %d)", r, (int)p->pid);
            }
        }
        if (why[0]) {
            refuse(g, &m, why);
            prism_msg_close(&m);
            continue;
        }
        member_t *p = &g->m[r];
        p->joined = true;
        memcpy(p->ident.id, m.identity, m.identity_len);
        p->ident.len = m.identity_len;
        p->pid = h->pid;
        p->start = h->start_time;
        p->pid_ns = h->pid_ns;
        snprintf(p->host_key, sizeof p->host_key, "%s", h->host_key ? h->host_key : "");
        snprintf(p->transport, sizeof p->transport, "%s", h->transport ? h->transport : "auto");
        missing--;
        PRISM_INFO("group %s: rank %d joined (pid %d), %d to go", g->name, r, (int)h->pid, missing);
        prism_msg_close(&m);
    }
    return PRISM_OK;
}

/* Sends every rank the same TpReady-shaped message of `type`. */
static void leader_send_all(prism_group_t *g, Prism__MsgType type, bool ok, const char *error)
{
    Prism__TpReady rd = PRISM__TP_READY__INIT;
    rd.ok = ok;
    rd.error = (char *)(error ? error : "");
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = type;
    env.tp_ready = &rd;
    for (int r = 1; r < g->size; r++)
        if (g->m[r].joined) send_env(g, r, &env);
}

static int leader_form(prism_group_t *g, const prism_group_opts_t *o, uint64_t deadline, char *err, size_t errlen)
{
    int rc = leader_join(g, o, deadline, err, errlen);
    if (rc != PRISM_OK) return rc;

    /* Transport. */
    char my_key[192];
    host_key(my_key, sizeof my_key);
    uint64_t my_ns = pid_ns();
    bool same_host = true, same_ns = true, want_zmq = o->transport == PRISM_COMM_TRANSPORT_ZMQ;
    for (int r = 1; r < g->size; r++) {
        same_host = same_host && !strcmp(g->m[r].host_key, my_key);
        same_ns = same_ns && g->m[r].pid_ns == my_ns;
        want_zmq = want_zmq || !strcmp(g->m[r].transport, "zmq");
    }
    bool cuda = !strcmp(device_kind(o->be), "cuda");
    uint8_t nccl_id[PRISM_COMM_NCCL_ID_BYTES];
    prism_comm_nccl_id_fn id_fn = NULL;
    prism_comm_nccl_create_fn create_fn = NULL;
    char why[512] = "";
    if (cuda) {
        snprintf(g->transport, sizeof g->transport, "nccl");
        if ((rc = nccl_load(g, &id_fn, &create_fn, why, sizeof why)) == PRISM_OK)
            rc = id_fn(nccl_id, why, sizeof why);
    } else if (!want_zmq && same_host) {
        snprintf(g->transport, sizeof g->transport, "shm");
    } else if (o->transport == PRISM_COMM_TRANSPORT_SHM) {
        snprintf(why, sizeof why, "transport shm asked for, but the ranks are not all on this host");
        rc = PRISM_EINVAL;
    } else {
        snprintf(g->transport, sizeof g->transport, "zmq");
    }
    uint64_t group_id = 0;
    if (getrandom(&group_id, sizeof group_id, 0) != sizeof group_id) group_id = prism_now_ns() ^ (uint64_t)getpid();
    g->peers[0] = (prism_comm_peer_t){getpid(), prism_proc_start_time(getpid())};
    for (int r = 1; r < g->size; r++)
        g->peers[r] = (prism_comm_peer_t){same_host && same_ns ? g->m[r].pid : 0, same_host && same_ns ? g->m[r].start : 0};
    if (rc == PRISM_OK && !strcmp(g->transport, "shm")) {
        snprintf(g->shm_name, sizeof g->shm_name, "/prism-tp-%d-%016llx", (int)getpid(), (unsigned long long)group_id);
        rc = prism_comm_shm_create(g->shm_name, group_id, g->size, 0, o->shm_slot_bytes, g->peers, o->timeout_s,
                                   &g->comm, why, sizeof why);
        if (rc != PRISM_OK) g->shm_name[0] = 0;
        else g->mem_bytes = prism_comm_shm_bytes(g->size, o->shm_slot_bytes);
    }

    /* WELCOME (or the reason the group cannot form). */
    int32_t pids[PRISM_TP_MAX];
    uint64_t starts[PRISM_TP_MAX];
    for (int r = 0; r < g->size; r++) {
        pids[r] = g->peers[r].pid;
        starts[r] = g->peers[r].start;
    }
    Prism__TpWelcome w = PRISM__TP_WELCOME__INIT;
    w.ok = rc == PRISM_OK;
    w.error = w.ok ? "" : why;
    w.transport = g->transport;
    w.shm_name = g->shm_name;
    w.shm_slot_bytes = o->shm_slot_bytes;
    w.nccl_id = (ProtobufCBinaryData){cuda && w.ok ? PRISM_COMM_NCCL_ID_BYTES : 0, nccl_id};
    w.group_id = group_id;
    w.n_pids = (size_t)g->size;
    w.pids = pids;
    w.n_start_times = (size_t)g->size;
    w.start_times = starts;
    w.timeout_s = o->timeout_s;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_TP_WELCOME;
    env.tp_welcome = &w;
    for (int r = 1; r < g->size; r++) send_env(g, r, &env);
    if (rc != PRISM_OK) {
        ERR("group %s: %s", g->name, why);
        return rc;
    }

    /* READY from everyone, then GO. */
    bool ready[PRISM_TP_MAX] = {false};
    int waiting = g->size - 1;
    while (waiting > 0) {
        prism_msg_t m;
        rc = recv_until(g, &m, deadline);
        if (rc == PRISM_EAGAIN && prism_now_ns() < deadline) continue;
        if (rc != PRISM_OK) {
            snprintf(why, sizeof why, "%d rank(s) did not attach to the %s transport in time", waiting, g->transport);
            break;
        }
        int r = find_member(g, &m);
        if (m.env->type == PRISM__MSG_TYPE__MSG_TP_HELLO && r < 0 && m.env->tp_hello) {
            refuse(g, &m, "the group is already formed");
        } else if (r > 0 && m.env->type == PRISM__MSG_TYPE__MSG_TP_READY && m.env->tp_ready && !ready[r]) {
            if (!m.env->tp_ready->ok) {
                snprintf(why, sizeof why, "rank %d cannot attach: %s", r, m.env->tp_ready->error);
                rc = PRISM_EIO;
                prism_msg_close(&m);
                break;
            }
            ready[r] = true;
            waiting--;
        }
        prism_msg_close(&m);
    }
    if (rc != PRISM_OK) {
        leader_send_all(g, PRISM__MSG_TYPE__MSG_TP_GO, false, why);
        ERR("group %s: %s", g->name, why);
        return PRISM_EIO;
    }
    leader_send_all(g, PRISM__MSG_TYPE__MSG_TP_GO, true, NULL);
    if (g->shm_name[0]) {
        prism_comm_shm_unlink(g->shm_name);   /* every rank has it mapped */
        g->shm_name[0] = 0;
    }
    if (cuda) {
        rc = create_fn(o->be, nccl_id, g->size, 0, o->timeout_s, group_alive, g, &g->comm, why, sizeof why);
    } else if (!strcmp(g->transport, "zmq")) {
        prism_comm_ident_t ids[PRISM_TP_MAX] = {{{0}, 0}};
        for (int r = 1; r < g->size; r++) ids[r] = g->m[r].ident;
        rc = prism_comm_zmq_create(g->sock, g->size, 0, ids, 0, o->timeout_s, group_alive, g, &g->comm, why, sizeof why);
        if (rc == PRISM_OK) g->mem_bytes = (size_t)g->size * PRISM_COMM_ZMQ_CHUNK;
    }
    if (rc != PRISM_OK) ERR("group %s: %s", g->name, why);
    return rc;
}

static int rank_form(prism_group_t *g, const prism_group_opts_t *o, uint64_t deadline, char *err, size_t errlen)
{
    char key[192];
    host_key(key, sizeof key);
    Prism__TpHello h = PRISM__TP_HELLO__INIT;
    h.size = (uint32_t)g->size;
    h.rank = (uint32_t)g->rank;
    h.device = (char *)device_kind(o->be);
    h.host_key = key;
    h.pid_ns = pid_ns();
    h.pid = getpid();
    h.start_time = prism_proc_start_time(getpid());
    h.transport = (char *)transport_name(o->transport);
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_TP_HELLO;
    env.tp_hello = &h;

    /* HELLO (resent every second: the leader may not be up yet, or may have restarted), WELCOME. */
    Prism__TpWelcome *w = NULL;
    prism_msg_t wm = {0};
    int rc;
    while (!w) {
        /* Never blocks: with no leader connected yet a blocking send would wait out the send
         * timeout (and a stop signal) instead of resending. */
        send_env_flags(g, 0, &env, ZMQ_DONTWAIT);
        uint64_t until = PRISM_MIN(deadline, prism_now_ns() + (uint64_t)(HELLO_RESEND_S * 1e9));
        while (!w) {
            rc = recv_until(g, &wm, until);
            if (rc == PRISM_EAGAIN) break;
            if (rc != PRISM_OK) {
                ERR("group %s: link to the leader failed", g->name);
                return PRISM_EIO;
            }
            if (wm.env->type == PRISM__MSG_TYPE__MSG_TP_WELCOME && wm.env->tp_welcome) w = wm.env->tp_welcome;
            else prism_msg_close(&wm);
        }
        if (!w && prism_now_ns() >= deadline) {
            ERR("group %s: rank %d: no answer from the leader %s within %.0f s", g->name, g->rank, o->leader,
                o->join_timeout_s);
            return PRISM_EIO;
        }
    }
    char why[512] = "";
    if (!w->ok) {
        ERR("group %s: rank %d refused by the leader: %s", g->name, g->rank, w->error ? w->error : "");
        prism_msg_close(&wm);
        return PRISM_EINVAL;
    }
    snprintf(g->transport, sizeof g->transport, "%s", w->transport ? w->transport : "");
    for (int r = 0; r < g->size; r++) {
        bool have = (size_t)r < w->n_pids && (size_t)r < w->n_start_times && r != g->rank;
        /* The leader sends pids only when every rank shares its host and pid namespace. */
        g->peers[r] = (prism_comm_peer_t){have ? w->pids[r] : 0, have ? w->start_times[r] : 0};
    }
    uint8_t nccl_id[PRISM_COMM_NCCL_ID_BYTES] = {0};
    prism_comm_nccl_id_fn id_fn = NULL;
    prism_comm_nccl_create_fn create_fn = NULL;
    rc = PRISM_OK;
    if (!strcmp(g->transport, "shm")) {
        rc = prism_comm_shm_create(w->shm_name, w->group_id, g->size, g->rank, w->shm_slot_bytes, g->peers,
                                   w->timeout_s, &g->comm, why, sizeof why);
        if (rc == PRISM_OK) g->mem_bytes = prism_comm_shm_bytes(g->size, w->shm_slot_bytes);
    } else if (!strcmp(g->transport, "nccl")) {
        if (w->nccl_id.len != PRISM_COMM_NCCL_ID_BYTES) {
            snprintf(why, sizeof why, "the WELCOME carries no NCCL id");
            rc = PRISM_ECORRUPT;
        } else {
            memcpy(nccl_id, w->nccl_id.data, PRISM_COMM_NCCL_ID_BYTES);
            rc = nccl_load(g, &id_fn, &create_fn, why, sizeof why);
        }
    } else if (strcmp(g->transport, "zmq") != 0) {
        snprintf(why, sizeof why, "unknown transport '%s'", g->transport);
        rc = PRISM_ECORRUPT;
    }
    double timeout_s = w->timeout_s;
    prism_msg_close(&wm);

    Prism__TpReady rd = PRISM__TP_READY__INIT;
    rd.ok = rc == PRISM_OK;
    rd.error = why;
    Prism__Envelope renv = PRISM__ENVELOPE__INIT;
    renv.type = PRISM__MSG_TYPE__MSG_TP_READY;
    renv.tp_ready = &rd;
    send_env(g, 0, &renv);
    if (rc != PRISM_OK) {
        ERR("group %s: rank %d: %s", g->name, g->rank, why);
        return rc;
    }

    /* GO */
    for (;;) {
        prism_msg_t m;
        int r2 = recv_until(g, &m, deadline);
        if (r2 == PRISM_EAGAIN && prism_now_ns() < deadline) continue;
        if (r2 != PRISM_OK) {
            ERR("group %s: rank %d: the leader never said go", g->name, g->rank);
            return PRISM_EIO;
        }
        if (m.env->type == PRISM__MSG_TYPE__MSG_TP_GO && m.env->tp_ready) {
            bool ok = m.env->tp_ready->ok;
            if (!ok) ERR("group %s: the group failed to form: %s", g->name, m.env->tp_ready->error);
            prism_msg_close(&m);
            if (!ok) return PRISM_EIO;
            break;
        }
        prism_msg_close(&m);
    }
    if (!strcmp(g->transport, "nccl")) {
        rc = create_fn(o->be, nccl_id, g->size, g->rank, timeout_s, group_alive, g, &g->comm, why, sizeof why);
    } else if (!strcmp(g->transport, "zmq")) {
        rc = prism_comm_zmq_create(g->sock, g->size, g->rank, NULL, 0, timeout_s, group_alive, g, &g->comm, why,
                                   sizeof why);
        if (rc == PRISM_OK) g->mem_bytes = PRISM_COMM_ZMQ_CHUNK;
    }
    if (rc != PRISM_OK) ERR("group %s: rank %d: %s", g->name, g->rank, why);
    return rc;
}

int prism_group_create(prism_net_t *net, const prism_group_opts_t *opts, prism_group_t **out, char *err, size_t errlen)
{
    *out = NULL;
    prism_group_opts_t o = *opts;
    if (o.size < 1 || o.size > PRISM_TP_MAX || o.rank < 0 || o.rank >= o.size) {
        ERR("group: rank %d of %d is not a valid place in a group of at most %d", o.rank, o.size, PRISM_TP_MAX);
        return PRISM_EINVAL;
    }
    if (o.size > 1 && (!o.leader || strncmp(o.leader, "tcp://", 6) != 0 || !net)) {
        ERR("group: --tp-leader must be tcp://host:port (got '%s')", o.leader ? o.leader : "");
        return PRISM_EINVAL;
    }
    if (o.size > 1 && wildcard_endpoint(o.leader)) {
        ERR("group: --tp-leader %s would listen on every interface; give the leader's own address", o.leader);
        return PRISM_EINVAL;
    }
    if (o.timeout_s <= 0) o.timeout_s = 30;
    if (o.join_timeout_s <= 0) o.join_timeout_s = 120;
    if (!o.shm_slot_bytes) o.shm_slot_bytes = (size_t)1 << 20;
    if (o.link_max_msg_bytes <= 0) o.link_max_msg_bytes = (int64_t)64 << 20;
    o.shm_slot_bytes = PRISM_ALIGN_UP(o.shm_slot_bytes, 64);

    prism_group_t *g = prism_calloc(1, sizeof *g);
    if (!g) return PRISM_ENOMEM;
    g->size = o.size;
    g->rank = o.rank;
    g->zctx = net ? prism_net_zctx(net) : NULL;
    snprintf(g->name, sizeof g->name, "%s", o.name ? o.name : "tp");
    int rc = PRISM_OK;
    if (o.size == 1) {
        g->comm = prism_comm_single_create();
        snprintf(g->transport, sizeof g->transport, "single");
        g->formed = true;
        *out = g;
        return PRISM_OK;
    }
    /* The link admits only this process's own role: a decode group's ranks are decode processes. */
    prism_net_role_t role = prism_net_role(net);
    char ident[64];
    snprintf(ident, sizeof ident, "tp%d.%d.%llx", o.rank, (int)getpid(), (unsigned long long)prism_now_ns());
    prism_sock_opts_t so = {.type = o.rank == 0 ? ZMQ_ROUTER : ZMQ_DEALER, .endpoint = o.leader, .hwm = LINK_HWM,
                            .max_msg_bytes = o.link_max_msg_bytes, .identity = o.rank == 0 ? NULL : ident,
                            .allow = PRISM_NET_ALLOW(role), .server = role};
    g->sock = o.rank == 0 ? prism_sock_bind(net, &so) : prism_sock_connect(net, &so);
    if (!g->sock) {
        ERR("group %s: cannot %s the group link %s", g->name, o.rank == 0 ? "bind" : "connect", o.leader);
        rc = PRISM_EIO;
        goto fail;
    }
    {
        int ms = (int)(o.timeout_s * 1000);
        zmq_setsockopt(g->sock, ZMQ_SNDTIMEO, &ms, sizeof ms);
        char mon_ep[96];
        snprintf(mon_ep, sizeof mon_ep, "inproc://prism-group-mon-%p", (void *)g);
        /* Ranks watch their connection to the leader (the leader's bound socket has common/net's
         * monitor already, see group.h). */
        if (o.rank != 0 && zmq_socket_monitor(g->sock, mon_ep, ZMQ_EVENT_DISCONNECTED) == 0) {
            g->mon = zmq_socket(g->zctx, ZMQ_PAIR);
            if (g->mon && zmq_connect(g->mon, mon_ep) != 0) {
                zmq_close(g->mon);
                g->mon = NULL;
            }
        }
    }
    uint64_t deadline = prism_now_ns() + (uint64_t)(o.join_timeout_s * 1e9);
    rc = o.rank == 0 ? leader_form(g, &o, deadline, err, errlen) : rank_form(g, &o, deadline, err, errlen);
    if (rc != PRISM_OK) goto fail;
    drain_monitor(g);   /* disconnects during the rendezvous (reconnects) do not count */
    g->formed = true;
    PRISM_INFO("group %s: rank %d of %d formed over %s", g->name, g->rank, g->size, g->transport);
    *out = g;
    return PRISM_OK;
fail:
    prism_group_destroy(g);
    return rc;
}

void prism_group_destroy(prism_group_t *g)
{
    if (!g) return;
    prism_comm_destroy(g->comm);
    if (g->shm_name[0]) prism_comm_shm_unlink(g->shm_name);
    if (g->mon) {
        zmq_socket_monitor(g->sock, NULL, 0);
        zmq_close(g->mon);
    }
    if (g->sock) zmq_close(g->sock);
    /* The NCCL module stays mapped: its library state may outlive the communicator. */
    prism_free(g);
}

prism_comm_t *prism_group_comm(prism_group_t *g) { return g->comm; }
int prism_group_size(const prism_group_t *g) { return g->size; }
int prism_group_rank(const prism_group_t *g) { return g->rank; }
const char *prism_group_transport(const prism_group_t *g) { return g->transport; }
size_t prism_group_mem_bytes(const prism_group_t *g) { return g->mem_bytes; }
void *prism_group_link(prism_group_t *g) { return g->sock; }

int prism_group_peer_identity(const prism_group_t *g, int rank, const void **id, size_t *len)
{
    if (g->rank != 0 || rank < 1 || rank >= g->size) return PRISM_EINVAL;
    *id = g->m[rank].ident.id;
    *len = g->m[rank].ident.len;
    return PRISM_OK;
}
