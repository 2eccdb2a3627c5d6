/* The process's ZeroMQ context, its CURVE keys, the ZAP handler thread and the socket helpers
 * that set every bounding and authenticating option in one place. See net.h for the key layout
 * and the policy, docs/SECURITY.md for the threat model. */
#include "net/net.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define ZAP_ENDPOINT "inproc://zeromq.zap.01"
#define NET_MAX_MONITORS 8
#define NET_HANDSHAKE_MS 10000  /* a peer that has not finished its handshake by then is dropped */

struct prism_net {
    void *zctx;
    prism_net_role_t role;
    bool secure;
    char public_key[PRISM_NET_KEY_Z85 + 1], secret_key[PRISM_NET_KEY_Z85 + 1];
    char role_key[PRISM_NET_ROLE_COUNT][PRISM_NET_KEY_Z85 + 1];  /* Z85 public keys; "" = not in the set */
    uint8_t role_key_bin[PRISM_NET_ROLE_COUNT][32];
    /* ZAP handler: after start the REP socket and the monitor sockets belong to the thread. */
    void *zap_sock;
    pthread_t zap_thread;
    bool zap_started;
    atomic_int stop;
    pthread_mutex_t mu;                       /* guards the hand-over of monitor sockets */
    void *mon_pending[NET_MAX_MONITORS];
    bool mon_pending_watch[NET_MAX_MONITORS];
    int n_mon_pending, n_mon_made;
    /* Peers' dropped connections on sockets bound with watch_disconnects, oldest first (guarded by
     * mu); full: the oldest go (the heartbeat timeout still catches those peers). */
    prism_net_disconnect_t disc[64];
    int n_disc;
    atomic_uint_fast64_t auth_ok, auth_denied, handshake_failed;
    double last_denial_log;
};

void *prism_net_zctx(prism_net_t *net) { return net->zctx; }
bool prism_net_secure(const prism_net_t *net) { return net->secure; }
prism_net_role_t prism_net_role(const prism_net_t *net) { return net->role; }

void prism_net_stats(const prism_net_t *net, prism_net_stats_t *st)
{
    st->auth_ok = atomic_load(&net->auth_ok);
    st->auth_denied = atomic_load(&net->auth_denied);
    st->handshake_failed = atomic_load(&net->handshake_failed);
}

uint64_t prism_net_refused(const prism_net_t *net)
{
    return atomic_load(&net->auth_denied) + atomic_load(&net->handshake_failed);
}

/* ---------------------------------------------------------------- key files */

int prism_net_key_read(const char *path, char *out, char *err, size_t errlen)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, errlen, "cannot read key file %s: %s", path, strerror(errno));
        return PRISM_EIO;
    }
    /* a key another local user owns or may write is theirs, not the cluster's (issue 26) */
    int trc = prism_fd_trusted(fd, path, err, errlen);
    if (trc) {
        close(fd);
        return trc;
    }
    char buf[128];
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n < 0) {
        snprintf(err, errlen, "cannot read key file %s: %s", path, strerror(errno));
        return PRISM_EIO;
    }
    buf[n] = 0;
    char *s = buf, *e = buf + n;
    while (s < e && (*s == ' ' || *s == '\n' || *s == '\r' || *s == '\t')) s++;
    while (e > s && (e[-1] == ' ' || e[-1] == '\n' || e[-1] == '\r' || e[-1] == '\t')) e--;
    uint8_t bin[32];
    if (e - s != PRISM_NET_KEY_Z85) {
        snprintf(err, errlen, "key file %s: expected one %d-character Z85 key", path, PRISM_NET_KEY_Z85);
        return PRISM_ECORRUPT;
    }
    *e = 0;
    if (!zmq_z85_decode(bin, s)) {
        snprintf(err, errlen, "key file %s: not a Z85 key", path);
        return PRISM_ECORRUPT;
    }
    memcpy(out, s, PRISM_NET_KEY_Z85 + 1);
    return PRISM_OK;
}

static int write_file(const char *path, const char *text, mode_t mode, char *err, size_t errlen)
{
    char tmp[1100];
    snprintf(tmp, sizeof(tmp), "%s.tmp%d", path, (int)getpid());
    /* never through a link someone left there, never into a file that exists */
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (fd < 0 && errno == EEXIST && unlink(tmp) == 0)   /* ours, left by a crash: the directory is trusted */
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (fd < 0) {
        snprintf(err, errlen, "cannot create %s: %s", tmp, strerror(errno));
        return PRISM_EIO;
    }
    size_t len = strlen(text);
    bool ok = write(fd, text, len) == (ssize_t)len && fchmod(fd, mode) == 0 && fsync(fd) == 0;
    close(fd);
    if (!ok || rename(tmp, path) != 0) {
        snprintf(err, errlen, "cannot write %s: %s", path, strerror(errno));
        unlink(tmp);
        return PRISM_EIO;
    }
    return PRISM_OK;
}

int prism_net_keygen(const char *dir, unsigned roles_mask, bool overwrite, char *err, size_t errlen)
{
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
        snprintf(err, errlen, "cannot create key directory %s: %s", dir, strerror(errno));
        return PRISM_EIO;
    }
    /* a directory someone else made first (or may change) would hold their keys (issue 26) */
    int trc = prism_dir_trusted(dir, err, errlen);
    if (trc) return trc;
    for (int r = 1; r < PRISM_NET_ROLE_COUNT; r++) {
        if (!(roles_mask & PRISM_NET_ALLOW(r))) continue;
        char kpath[1024], ppath[1024], pub[PRISM_NET_KEY_Z85 + 1], sec[PRISM_NET_KEY_Z85 + 1], line[64];
        snprintf(kpath, sizeof(kpath), "%s/%s.key", dir, prism_net_role_name(r));
        snprintf(ppath, sizeof(ppath), "%s/%s.pub", dir, prism_net_role_name(r));
        bool have = !overwrite && access(kpath, F_OK) == 0;
        if (have) {
            int rc = prism_net_key_read(kpath, sec, err, errlen);
            if (rc) return rc;
            if (zmq_curve_public(pub, sec) != 0) {
                snprintf(err, errlen, "%s: cannot derive the public key", kpath);
                return PRISM_ECORRUPT;
            }
        } else {
            if (zmq_curve_keypair(pub, sec) != 0) {
                snprintf(err, errlen, "zmq_curve_keypair failed: %s (libzmq built without CURVE?)", zmq_strerror(errno));
                return PRISM_ENOTSUP;
            }
            snprintf(line, sizeof(line), "%s\n", sec);
            int rc = write_file(kpath, line, 0600, err, errlen);
            if (rc) return rc;
        }
        snprintf(line, sizeof(line), "%s\n", pub);
        int rc = write_file(ppath, line, 0644, err, errlen);
        if (rc) return rc;
    }
    return PRISM_OK;
}

/* ---------------------------------------------------------------- ZAP handler (its own thread) */

static void zap_send(void *s, const char *str, size_t len, bool more)
{
    zmq_send(s, str, len, more ? ZMQ_SNDMORE : 0);
}

/* ZMTP metadata: name-length (1 byte), name, value-length (4 bytes, big endian), value. */
static size_t metadata_encode(uint8_t *out, const char *name, const char *value)
{
    size_t nl = strlen(name), vl = strlen(value), o = 0;
    out[o++] = (uint8_t)nl;
    memcpy(out + o, name, nl);
    o += nl;
    out[o++] = (uint8_t)(vl >> 24);
    out[o++] = (uint8_t)(vl >> 16);
    out[o++] = (uint8_t)(vl >> 8);
    out[o++] = (uint8_t)vl;
    memcpy(out + o, value, vl);
    return o + vl;
}

/* Domain of a bound socket: "prism:" + the names of the roles it admits, comma separated. */
static unsigned domain_allow(const char *d, size_t n)
{
    unsigned mask = 0;
    if (n < 6 || memcmp(d, "prism:", 6) != 0) return 0;
    size_t i = 6;
    while (i < n) {
        size_t j = i;
        while (j < n && d[j] != ',') j++;
        for (int r = 1; r < PRISM_NET_ROLE_COUNT; r++)
            if (strlen(prism_net_role_name(r)) == j - i && !memcmp(d + i, prism_net_role_name(r), j - i)) mask |= PRISM_NET_ALLOW(r);
        i = j + 1;
    }
    return mask;
}

static void zap_handle(prism_net_t *n)
{
    enum { MAXF = 8 };
    zmq_msg_t f[MAXF];
    int nf = 0;
    int more = 1;
    while (more) {
        zmq_msg_t part;
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, n->zap_sock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&part);
            break;
        }
        more = zmq_msg_more(&part);
        if (nf < MAXF) f[nf++] = part;
        else zmq_msg_close(&part);
    }
    if (nf < 2) goto done;  /* not a request we can answer (libzmq never sends these) */
    /* [0] version [1] request id [2] domain [3] address [4] routing id [5] mechanism [6] credentials */
    const char *status = "400", *text = "unknown key";
    prism_net_role_t role = PRISM_NET_ROLE_NONE;
    char user[PRISM_NET_KEY_Z85 + 1] = "";
    bool curve = nf == 7 && zmq_msg_size(&f[5]) == 5 && !memcmp(zmq_msg_data(&f[5]), "CURVE", 5) &&
                 zmq_msg_size(&f[6]) == 32;
    if (nf >= 6 && (zmq_msg_size(&f[0]) != 3 || memcmp(zmq_msg_data(&f[0]), "1.0", 3))) {
        status = "500";
        text = "bad ZAP version";
    } else if (!curve) {
        text = "CURVE required";
    } else {
        const uint8_t *key = zmq_msg_data(&f[6]);
        for (int r = 1; r < PRISM_NET_ROLE_COUNT; r++)
            if (n->role_key[r][0] && !memcmp(n->role_key_bin[r], key, 32)) role = (prism_net_role_t)r;
        unsigned allow = domain_allow(zmq_msg_data(&f[2]), zmq_msg_size(&f[2]));
        if (role != PRISM_NET_ROLE_NONE && (allow & PRISM_NET_ALLOW(role))) {
            status = "200";
            text = "OK";
            memcpy(user, n->role_key[role], sizeof(user));
        } else if (role != PRISM_NET_ROLE_NONE) {
            text = "role not admitted on this socket";
        }
    }
    if (status[0] == '2') {
        atomic_fetch_add(&n->auth_ok, 1);
    } else {
        atomic_fetch_add(&n->auth_denied, 1);
        double now = prism_now_s();
        if (now - n->last_denial_log >= 1.0) {  /* a flood of handshakes must not flood the log */
            n->last_denial_log = now;
            char addr[64] = "?";
            if (nf > 3) snprintf(addr, sizeof(addr), "%.*s", (int)PRISM_MIN(zmq_msg_size(&f[3]), (size_t)60),
                                 (const char *)zmq_msg_data(&f[3]));
            PRISM_WARN("refused a peer from %s: %s%s%s (%llu refused so far)", addr, text,
                       role ? ", key of role " : "", prism_net_role_name(role),
                       (unsigned long long)atomic_load(&n->auth_denied));
        }
    }
    uint8_t meta[64];
    size_t ml = role && status[0] == '2' ? metadata_encode(meta, PRISM_NET_ROLE_PROPERTY, prism_net_role_name(role)) : 0;
    zap_send(n->zap_sock, "1.0", 3, true);
    zmq_send(n->zap_sock, zmq_msg_data(&f[1]), zmq_msg_size(&f[1]), ZMQ_SNDMORE);
    zap_send(n->zap_sock, status, 3, true);
    zap_send(n->zap_sock, text, strlen(text), true);
    zap_send(n->zap_sock, user, strlen(user), true);
    zmq_send(n->zap_sock, meta, ml, 0);
done:
    for (int i = 0; i < nf; i++) zmq_msg_close(&f[i]);
}

static void disconnect_note(prism_net_t *n, int fd)
{
    pthread_mutex_lock(&n->mu);
    if (n->n_disc == (int)PRISM_ARRAY_LEN(n->disc)) {
        memmove(n->disc, n->disc + 1, sizeof(n->disc[0]) * (PRISM_ARRAY_LEN(n->disc) - 1));
        n->n_disc--;
    }
    n->disc[n->n_disc++] = (prism_net_disconnect_t){.fd = fd, .t = prism_now_s()};
    pthread_mutex_unlock(&n->mu);
}

int prism_net_disconnects(prism_net_t *n, prism_net_disconnect_t *out, int max)
{
    pthread_mutex_lock(&n->mu);
    int k = PRISM_MIN(max, n->n_disc);
    memcpy(out, n->disc, sizeof(out[0]) * (size_t)k);
    memmove(n->disc, n->disc + k, sizeof(n->disc[0]) * (size_t)(n->n_disc - k));
    n->n_disc -= k;
    pthread_mutex_unlock(&n->mu);
    return k;
}

static void monitor_handle(prism_net_t *n, void *mon, bool watch)
{
    for (int k = 0; k < 64; k++) {
        zmq_msg_t ev, ep;
        zmq_msg_init(&ev);
        if (zmq_msg_recv(&ev, mon, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&ev);
            return;
        }
        uint16_t event = 0;
        uint32_t value = 0;  /* for DISCONNECTED: the connection's file descriptor */
        if (zmq_msg_size(&ev) >= 2) memcpy(&event, zmq_msg_data(&ev), 2);
        if (zmq_msg_size(&ev) >= 6) memcpy(&value, (const uint8_t *)zmq_msg_data(&ev) + 2, 4);
        bool more = zmq_msg_more(&ev);
        zmq_msg_close(&ev);
        if (more) {
            zmq_msg_init(&ep);
            zmq_msg_recv(&ep, mon, 0);
            zmq_msg_close(&ep);
        }
        /* PROTOCOL: a peer that spoke but not our CURVE (no CURVE, a wrong server key, garbage).
         * Connections that close before saying anything (TCP health probes, scanners) are not
         * counted: they report NO_DETAIL. */
        if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) atomic_fetch_add(&n->handshake_failed, 1);
        if (event == ZMQ_EVENT_DISCONNECTED && watch) disconnect_note(n, (int)value);
    }
}

static void *zap_main(void *arg)
{
    prism_net_t *n = arg;
    void *mons[NET_MAX_MONITORS];
    bool watch[NET_MAX_MONITORS];
    int n_mons = 0;
    while (!atomic_load(&n->stop)) {
        pthread_mutex_lock(&n->mu);
        while (n->n_mon_pending > 0) {
            n->n_mon_pending--;
            watch[n_mons] = n->mon_pending_watch[n->n_mon_pending];
            mons[n_mons++] = n->mon_pending[n->n_mon_pending];
        }
        pthread_mutex_unlock(&n->mu);
        zmq_pollitem_t it[1 + NET_MAX_MONITORS];
        it[0] = (zmq_pollitem_t){n->zap_sock, 0, ZMQ_POLLIN, 0};
        for (int i = 0; i < n_mons; i++) it[1 + i] = (zmq_pollitem_t){mons[i], 0, ZMQ_POLLIN, 0};
        /* The timeout bounds how long a new monitor or a stop request waits. */
        int rc = zmq_poll(it, 1 + n_mons, 100);
        if (rc < 0) {
            if (errno == ETERM) break;
            continue;
        }
        if (it[0].revents & ZMQ_POLLIN) zap_handle(n);
        for (int i = 0; i < n_mons; i++)
            if (it[1 + i].revents & ZMQ_POLLIN) monitor_handle(n, mons[i], watch[i]);
    }
    for (int i = 0; i < n_mons; i++) zmq_close(mons[i]);
    zmq_close(n->zap_sock);
    n->zap_sock = NULL;
    return NULL;
}

/* ---------------------------------------------------------------- the process's net */

int prism_net_create(const prism_net_opts_t *o, prism_net_t **out, char *err, size_t errlen)
{
    *out = NULL;
    if (o->role <= PRISM_NET_ROLE_NONE || o->role >= PRISM_NET_ROLE_COUNT) {
        snprintf(err, errlen, "internal: no role for the network layer");
        return PRISM_EINVAL;
    }
    if (o->insecure && o->curve_keys && *o->curve_keys) {
        snprintf(err, errlen, "--curve-keys and --insecure-no-curve contradict each other: give one");
        return PRISM_EINVAL;
    }
    if (!o->insecure && (!o->curve_keys || !*o->curve_keys)) {
        snprintf(err, errlen, "internal links are authenticated with CURVE keys: give --curve-keys DIR "
                              "(create one with `prism_keygen --out DIR`), or --insecure-no-curve on a trusted, isolated network");
        return PRISM_EINVAL;
    }
    prism_net_t *n = prism_calloc(1, sizeof(*n));
    if (!n) return PRISM_ENOMEM;
    n->role = o->role;
    n->secure = !o->insecure;
    n->last_denial_log = -1e9;
    pthread_mutex_init(&n->mu, NULL);
    int rc = PRISM_OK;
    if (n->secure) {
        char path[1024];
        if ((rc = prism_dir_trusted(o->curve_keys, err, errlen))) goto fail;
        snprintf(path, sizeof(path), "%s/%s.key", o->curve_keys, prism_net_role_name(o->role));
        struct stat st;
        /* Group access is allowed (Kubernetes mounts Secrets group-readable with fsGroup); others, never. */
        if (stat(path, &st) == 0 && (st.st_mode & 007)) {
            snprintf(err, errlen, "secret key %s is accessible to other users: chmod 600 (or 640) it", path);
            rc = PRISM_EINVAL;
            goto fail;
        }
        if ((rc = prism_net_key_read(path, n->secret_key, err, errlen))) goto fail;
        if (zmq_curve_public(n->public_key, n->secret_key) != 0) {
            snprintf(err, errlen, "%s: cannot derive the public key (libzmq without CURVE?)", path);
            rc = PRISM_ENOTSUP;
            goto fail;
        }
        for (int r = 1; r < PRISM_NET_ROLE_COUNT; r++) {
            snprintf(path, sizeof(path), "%s/%s.pub", o->curve_keys, prism_net_role_name(r));
            if (access(path, F_OK) != 0) continue;  /* a role this host never talks to may be absent */
            if ((rc = prism_net_key_read(path, n->role_key[r], err, errlen))) goto fail;
            zmq_z85_decode(n->role_key_bin[r], n->role_key[r]);
        }
        if (strcmp(n->role_key[o->role], n->public_key) != 0) {
            snprintf(err, errlen, "%s/%s.pub is %s the public key of %s.key: regenerate the directory with prism_keygen",
                     o->curve_keys, prism_net_role_name(o->role), n->role_key[o->role][0] ? "not" : "missing;",
                     prism_net_role_name(o->role));
            rc = PRISM_EINVAL;
            goto fail;
        }
    } else {
        PRISM_WARN("--insecure-no-curve: internal links are NOT authenticated; anyone who can reach this "
                   "process's ports can register as a worker, read prompts and inject answers. Use only on an "
                   "isolated network.");
    }
    n->zctx = zmq_ctx_new();
    if (!n->zctx || (o->io_threads > 0 && zmq_ctx_set(n->zctx, ZMQ_IO_THREADS, o->io_threads) != 0)) {
        snprintf(err, errlen, "zmq_ctx_new: %s", zmq_strerror(errno));
        rc = PRISM_EIO;
        goto fail;
    }
    if (n->secure) {
        n->zap_sock = zmq_socket(n->zctx, ZMQ_REP);
        int linger = 0;
        if (n->zap_sock) zmq_setsockopt(n->zap_sock, ZMQ_LINGER, &linger, sizeof(linger));
        if (!n->zap_sock || zmq_bind(n->zap_sock, ZAP_ENDPOINT) != 0) {
            snprintf(err, errlen, "cannot start the ZAP handler: %s", zmq_strerror(errno));
            rc = PRISM_EIO;
            goto fail;
        }
        if (pthread_create(&n->zap_thread, NULL, zap_main, n) != 0) {
            snprintf(err, errlen, "cannot start the ZAP handler thread");
            rc = PRISM_EIO;
            goto fail;
        }
        n->zap_started = true;
    }
    *out = n;
    return PRISM_OK;
fail:
    prism_net_destroy(n);
    return rc;
}

void prism_net_destroy(prism_net_t *n)
{
    if (!n) return;
    if (n->zap_started) {
        atomic_store(&n->stop, 1);
        pthread_join(n->zap_thread, NULL);
    } else if (n->zap_sock) {
        zmq_close(n->zap_sock);
    }
    for (int i = 0; i < n->n_mon_pending; i++) zmq_close(n->mon_pending[i]);
    if (n->zctx) zmq_ctx_term(n->zctx);
    pthread_mutex_destroy(&n->mu);
    memset(n->secret_key, 0, sizeof(n->secret_key));
    prism_free(n);
}

/* ---------------------------------------------------------------- sockets */

static int sock_common(void *s, const prism_sock_opts_t *o, bool zap_names_peers)
{
    PRISM_ASSERT(o->hwm > 0 && o->max_msg_bytes > 0);
    /* When ZAP names a peer (User-Id), libzmq queues one "credential" message at the head of that
     * peer's inbound pipe; it is never delivered but takes a high-water-mark slot. Without the extra
     * slot a data socket with HWM 1 would never deliver anything. */
    int linger = 0, hwm = o->hwm, rcvhwm = o->hwm + (zap_names_peers ? 1 : 0), hs = NET_HANDSHAKE_MS;
    int64_t maxmsg = o->max_msg_bytes;
    int rc = zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
    rc |= zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    rc |= zmq_setsockopt(s, ZMQ_RCVHWM, &rcvhwm, sizeof(rcvhwm));
    rc |= zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
    rc |= zmq_setsockopt(s, ZMQ_HANDSHAKE_IVL, &hs, sizeof(hs));
    return rc ? PRISM_EIO : PRISM_OK;
}

/* Watches a bound socket's failed handshakes from the ZAP thread (for prism_net_stats). */
static void monitor_start(prism_net_t *n, void *s, bool watch_disconnects)
{
    pthread_mutex_lock(&n->mu);
    bool room = n->n_mon_made < NET_MAX_MONITORS;
    int id = n->n_mon_made++;
    pthread_mutex_unlock(&n->mu);
    if (!room) return;
    char ep[64];
    snprintf(ep, sizeof(ep), "inproc://prism-monitor-%d", id);
    if (zmq_socket_monitor(s, ep, ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                                      (watch_disconnects ? ZMQ_EVENT_DISCONNECTED : 0)) != 0)
        return;
    void *pair = zmq_socket(n->zctx, ZMQ_PAIR);
    if (!pair) return;
    int linger = 0;
    zmq_setsockopt(pair, ZMQ_LINGER, &linger, sizeof(linger));
    if (zmq_connect(pair, ep) != 0) {
        zmq_close(pair);
        return;
    }
    pthread_mutex_lock(&n->mu);
    n->mon_pending_watch[n->n_mon_pending] = watch_disconnects;
    n->mon_pending[n->n_mon_pending++] = pair;
    pthread_mutex_unlock(&n->mu);
}

void *prism_sock_bind(prism_net_t *n, const prism_sock_opts_t *o)
{
    void *s = zmq_socket(n->zctx, o->type);
    if (!s) return NULL;
    int rc = sock_common(s, o, n->secure);
    if (o->type == ZMQ_ROUTER) {
        int on = 1;  /* fail loudly instead of dropping messages to unknown peers */
        rc |= zmq_setsockopt(s, ZMQ_ROUTER_MANDATORY, &on, sizeof(on));
    }
    if (n->secure) {
        PRISM_ASSERT(o->allow != 0);
        char domain[96] = "prism:";
        for (int r = 1; r < PRISM_NET_ROLE_COUNT; r++)
            if (o->allow & PRISM_NET_ALLOW(r)) {
                if (domain[6]) strcat(domain, ",");
                strcat(domain, prism_net_role_name(r));
            }
        int on = 1;
        rc |= zmq_setsockopt(s, ZMQ_CURVE_SERVER, &on, sizeof(on));
        rc |= zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, n->secret_key, PRISM_NET_KEY_Z85);
        rc |= zmq_setsockopt(s, ZMQ_ZAP_DOMAIN, domain, strlen(domain));
        if (!rc) monitor_start(n, s, o->watch_disconnects);
    }
    if (rc) {
        PRISM_ERROR("cannot set socket options for %s: %s", o->endpoint, zmq_strerror(errno));
        zmq_close(s);
        return NULL;
    }
    if (zmq_bind(s, o->endpoint) != 0) {
        PRISM_ERROR("cannot bind %s: %s", o->endpoint, zmq_strerror(errno));
        zmq_close(s);
        return NULL;
    }
    return s;
}

void *prism_sock_connect(prism_net_t *n, const prism_sock_opts_t *o)
{
    if (n->secure && (o->server <= PRISM_NET_ROLE_NONE || o->server >= PRISM_NET_ROLE_COUNT ||
                      !n->role_key[o->server][0])) {
        PRISM_ERROR("cannot connect %s: the key directory has no %s.pub (the public key of the %s we connect to)",
                    o->endpoint, prism_net_role_name(o->server), prism_net_role_name(o->server));
        return NULL;
    }
    void *s = zmq_socket(n->zctx, o->type);
    if (!s) return NULL;
    int rc = sock_common(s, o, false);
    if (o->identity)
        rc |= zmq_setsockopt(s, ZMQ_ROUTING_ID, o->identity, o->identity_len ? o->identity_len : strlen(o->identity));
    if (n->secure) {
        rc |= zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY, n->role_key[o->server], PRISM_NET_KEY_Z85);
        rc |= zmq_setsockopt(s, ZMQ_CURVE_PUBLICKEY, n->public_key, PRISM_NET_KEY_Z85);
        rc |= zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, n->secret_key, PRISM_NET_KEY_Z85);
    }
    if (rc) {
        PRISM_ERROR("cannot set socket options for %s: %s", o->endpoint, zmq_strerror(errno));
        zmq_close(s);
        return NULL;
    }
    if (zmq_connect(s, o->endpoint) != 0) {
        PRISM_ERROR("cannot connect %s: %s", o->endpoint, zmq_strerror(errno));
        zmq_close(s);
        return NULL;
    }
    return s;
}
