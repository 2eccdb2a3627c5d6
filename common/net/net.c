/* Framing: envelopes packed and unpacked, multi-frame messages sent and received, and the role names
 * every layer above (keys, ZAP metadata, flags) shares. secure.c builds on this: the context, keys and
 * socket options. */
#include "net/net.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* Role names: what CURVE key files, ZAP metadata and flags call each role. */
static const char *const g_role_names[PRISM_NET_ROLE_COUNT] = {"", "router", "encoder", "prefill", "decode"};

const char *prism_net_role_name(prism_net_role_t role)
{
    return role > PRISM_NET_ROLE_NONE && role < PRISM_NET_ROLE_COUNT ? g_role_names[role] : "";
}

prism_net_role_t prism_net_role_parse(const char *name)
{
    for (int r = 1; name && r < PRISM_NET_ROLE_COUNT; r++)
        if (!strcmp(name, g_role_names[r])) return (prism_net_role_t)r;
    return PRISM_NET_ROLE_NONE;
}

/* Envelopes are packed into a per-thread buffer that grows to the largest message once
 * and is then reused: no allocation per message after warm-up. */
static _Thread_local uint8_t *t_pack_buf;
static _Thread_local size_t t_pack_cap;

/* Unpacked envelopes are short-lived, bounded by PRISM_MSG_MAX_ENVELOPE and live outside the
 * workers' planned pools, so they use the C heap directly: prism_mem_alloc_count() then counts only
 * the allocations a worker makes itself, which must stay flat on the request path. */
static void *pc_alloc(void *ud, size_t n) { (void)ud; return malloc(n); }
static void pc_free(void *ud, void *p) { (void)ud; free(p); }
static ProtobufCAllocator g_pc_allocator = {pc_alloc, pc_free, NULL};

static void drain_rest(void *sock)
{
    int more = 0;
    size_t sz = sizeof(more);
    while (zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &sz) == 0 && more) {
        zmq_msg_t f;
        zmq_msg_init(&f);
        zmq_msg_recv(&f, sock, 0);
        zmq_msg_close(&f);
        sz = sizeof(more);
    }
}

static bool has_more(void *sock)
{
    int more = 0;
    size_t sz = sizeof(more);
    return zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &sz) == 0 && more;
}

Prism__Envelope *prism_msg_unpack(const void *data, size_t len)
{
    if (len > PRISM_MSG_MAX_ENVELOPE) return NULL;
    Prism__Envelope *env = prism__envelope__unpack(&g_pc_allocator, len, data);
    if (env && env->version != PRISM_PROTOCOL_VERSION) {
        PRISM_WARN("dropping message with protocol version %u (ours %u)", env->version, PRISM_PROTOCOL_VERSION);
        prism__envelope__free_unpacked(env, &g_pc_allocator);
        env = NULL;
    }
    return env;
}

/* The sender as our ZAP handler authenticated it (metadata of the connection it came on). */
static void peer_of(zmq_msg_t *part, prism_msg_t *m)
{
    const char *key = zmq_msg_gets(part, "User-Id");
    if (key && strlen(key) == PRISM_NET_KEY_Z85) memcpy(m->peer_key, key, PRISM_NET_KEY_Z85 + 1);
    const char *role = zmq_msg_gets(part, PRISM_NET_ROLE_PROPERTY);
    if (role) m->peer_role = prism_net_role_parse(role);
    m->src_fd = zmq_msg_get(part, ZMQ_SRCFD);  /* deprecated in libzmq, still the only link to monitor events */
}

int prism_msg_recv(void *sock, bool from_router_socket, prism_msg_t *m, int flags)
{
    memset(m, 0, offsetof(prism_msg_t, frames));
    m->n_frames = 0;
    m->identity_len = 0;
    m->peer_key[0] = 0;
    m->peer_role = PRISM_NET_ROLE_NONE;
    m->src_fd = -1;
    zmq_msg_t part;
    zmq_msg_init(&part);
    if (zmq_msg_recv(&part, sock, flags) < 0) {
        zmq_msg_close(&part);
        return errno == EAGAIN ? PRISM_EAGAIN : PRISM_EIO;
    }
    if (from_router_socket) {
        size_t n = zmq_msg_size(&part);
        if (n > PRISM_MSG_MAX_IDENTITY || !has_more(sock)) {
            zmq_msg_close(&part);
            drain_rest(sock);
            return PRISM_ECORRUPT;
        }
        memcpy(m->identity, zmq_msg_data(&part), n);
        m->identity_len = n;
        zmq_msg_close(&part);
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, sock, 0) < 0) {
            zmq_msg_close(&part);
            return PRISM_EIO;
        }
    }
    peer_of(&part, m);
    m->env = prism_msg_unpack(zmq_msg_data(&part), zmq_msg_size(&part));
    zmq_msg_close(&part);
    if (!m->env) {
        drain_rest(sock);
        return PRISM_ECORRUPT;
    }
    while (has_more(sock)) {
        if (m->n_frames == PRISM_MSG_MAX_FRAMES) {
            drain_rest(sock);
            prism_msg_close(m);
            return PRISM_ECORRUPT;
        }
        zmq_msg_t *f = &m->frames[m->n_frames];
        zmq_msg_init(f);
        if (zmq_msg_recv(f, sock, 0) < 0) {
            zmq_msg_close(f);
            prism_msg_close(m);
            return PRISM_EIO;
        }
        m->n_frames++;
    }
    return PRISM_OK;
}

void prism_msg_close(prism_msg_t *m)
{
    for (int i = 0; i < m->n_frames; i++)
        zmq_msg_close(&m->frames[i]);
    m->n_frames = 0;
    if (m->env)
        prism__envelope__free_unpacked(m->env, &g_pc_allocator);
    m->env = NULL;
}

void prism_msg_env_free(Prism__Envelope *env)
{
    if (env) prism__envelope__free_unpacked(env, &g_pc_allocator);
}

const void *prism_msg_frame(prism_msg_t *m, int i, size_t *len)
{
    if (i < 0 || i >= m->n_frames) {
        *len = 0;
        return NULL;
    }
    *len = zmq_msg_size(&m->frames[i]);
    return zmq_msg_data(&m->frames[i]);
}

static void frame_free(void *data, void *hint)
{
    (void)hint;
    prism_free(data);
}

static int msg_send(void *sock, const void *identity, size_t identity_len, Prism__Envelope *env,
                    const prism_frame_t *frames, int n_frames, int flags, bool take)
{
    int sent = 0, rc = PRISM_OK;
    env->version = PRISM_PROTOCOL_VERSION;
    size_t n = prism__envelope__get_packed_size(env);
    if (n > PRISM_MSG_MAX_ENVELOPE) {
        rc = PRISM_ELIMIT;
        goto out;
    }
    if (n > t_pack_cap) {
        size_t cap = PRISM_MAX(n, (size_t)4096);
        uint8_t *b = prism_realloc(t_pack_buf, cap);
        if (!b) {
            rc = PRISM_ENOMEM;
            goto out;
        }
        t_pack_buf = b;
        t_pack_cap = cap;
    }
    prism__envelope__pack(env, t_pack_buf);
    int more = n_frames > 0 ? ZMQ_SNDMORE : 0;
    if (identity) {
        if (zmq_send(sock, identity, identity_len, flags | ZMQ_SNDMORE) < 0) {
            rc = errno == EAGAIN ? PRISM_EAGAIN : PRISM_EIO;
            goto out;
        }
        flags &= ~ZMQ_DONTWAIT;  /* the rest of a multipart message is queued atomically */
    }
    if (zmq_send(sock, t_pack_buf, n, flags | more) < 0) {
        rc = errno == EAGAIN ? PRISM_EAGAIN : PRISM_EIO;
        goto out;
    }
    flags &= ~ZMQ_DONTWAIT;
    for (; sent < n_frames; sent++) {
        int f = (sent + 1 < n_frames) ? ZMQ_SNDMORE : 0;
        const prism_frame_t *fr = &frames[sent];
        if (!take && !fr->release) {
            if (zmq_send(sock, fr->data, fr->len, flags | f) < 0) {
                sent++;
                rc = PRISM_EIO;
                goto out;
            }
            continue;
        }
        zmq_msg_t m;
        if (zmq_msg_init_data(&m, (void *)fr->data, fr->len, take ? frame_free : fr->release,
                              take ? NULL : fr->hint) != 0) {
            rc = PRISM_ENOMEM;
            goto out;
        }
        if (zmq_msg_send(&m, sock, flags | f) < 0) {
            zmq_msg_close(&m);  /* frees (releases) the buffer */
            sent++;
            rc = PRISM_EIO;
            goto out;
        }
    }
out:
    for (int i = sent; i < n_frames; i++) {   /* frames not handed over: as ZeroMQ would have */
        if (take) prism_free((void *)frames[i].data);
        else if (frames[i].release) frames[i].release((void *)frames[i].data, frames[i].hint);
    }
    return rc;
}

int prism_msg_send(void *sock, const void *identity, size_t identity_len, Prism__Envelope *env,
                   const prism_frame_t *frames, int n_frames, int flags)
{
    return msg_send(sock, identity, identity_len, env, frames, n_frames, flags, false);
}

int prism_msg_send_take(void *sock, const void *identity, size_t identity_len, Prism__Envelope *env,
                        const prism_frame_t *frames, int n_frames, int flags)
{
    return msg_send(sock, identity, identity_len, env, frames, n_frames, flags, true);
}

void prism_msg_thread_exit(void)
{
    prism_free(t_pack_buf);
    t_pack_buf = NULL;
    t_pack_cap = 0;
}

int prism_sock_last_endpoint(void *sock, char *out, size_t n)
{
    size_t len = n;
    if (zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, out, &len) != 0) return PRISM_EIO;
    return PRISM_OK;
}

const char *prism_role_name(Prism__Role role)
{
    switch (role) {
    case PRISM__ROLE__ROLE_ENCODER: return "encoder";
    case PRISM__ROLE__ROLE_PREFILL: return "prefill";
    case PRISM__ROLE__ROLE_DECODE:  return "decode";
    default:                        return "unknown";
    }
}
