/* net: ZeroMQ multipart messages with a protobuf-c envelope, over authenticated sockets.
 *
 * Wire format of one message: [identity (ROUTER sockets only)] [Envelope] [raw frame]*.
 * Raw frames carry tensor and image bytes; they are sent with zmq_send and received into
 * zmq_msg_t, never copied into protobuf fields.
 *
 *   prism_net_t *net;
 *   prism_net_opts_t no = {.role = PRISM_NET_ROLE_DECODE, .curve_keys = dir};
 *   if (prism_net_create(&no, &net, err, sizeof(err)) != PRISM_OK) ...;
 *   void *s = prism_sock_bind(net, &(prism_sock_opts_t){ZMQ_PULL, "tcp://127.0.0.1:*", .hwm = 1,
 *                             .max_msg_bytes = kv_bytes, .allow = PRISM_NET_ALLOW(PRISM_NET_ROLE_PREFILL)});
 *   prism_msg_t m;
 *   if (prism_msg_recv(s, false, &m, ZMQ_DONTWAIT) == PRISM_OK) {
 *       switch (m.env->type) { ... prism_msg_frame(&m, 0, &len) ... m.peer_role ... }
 *       prism_msg_close(&m);
 *   }
 *   zmq_close(s); prism_net_destroy(net);
 *
 * Security (see docs/SECURITY.md): every socket made here speaks ZeroMQ CURVE unless the process
 * runs with --insecure-no-curve. Keys are per ROLE (router, encoder, prefill, decode), kept in one
 * key directory made by prism_keygen:
 *   DIR/<role>.key   the role's secret key, Z85 (40 characters, zmq_curve_keypair's format), mode 0600
 *   DIR/<role>.pub   the role's public key, Z85
 * A process reads its own DIR/<role>.key and every DIR/<role>.pub. Why per role and not per process:
 * a connecting peer must know the public key of the socket it connects to before it connects, and
 * endpoints are handed around by the router (a prefill learns a decode endpoint from a Prefill
 * message); with one key per role the server key follows from the role alone.
 * Bound (server) sockets admit a peer only when a ZAP handler (a thread per process on
 * inproc://zeromq.zap.01) finds its public key among the cluster's keys AND that key's role is in
 * the socket's allow set (the router's control socket admits encoder, prefill and decode; a prefill
 * data socket admits only encoders; a decode data socket only prefills). Everything else fails the
 * handshake, so not one byte of its messages is ever delivered; refusals are counted
 * (prism_net_stats).
 * Every socket also has ZMQ_MAXMSGSIZE (a frame above it drops the connection before anything is
 * allocated for it) and bounded high-water marks (messages queued per peer each way).
 */
#ifndef PRISM_NET_H
#define PRISM_NET_H

#include "core/core.h"
#include "prism.pb-c.h"
#include <zmq.h>

#define PRISM_PROTOCOL_VERSION 5
/* Raw frames after the envelope: an image's embeddings travel as one frame per tile (Llama-4:
 * up to PRISM_LLAMA4_MAX_PATCHES + 1 = 65 tiles), everything else in one or two. */
#define PRISM_MSG_MAX_FRAMES 72
#define PRISM_MSG_MAX_IDENTITY 255
#define PRISM_MSG_MAX_ENVELOPE (16u << 20)   /* bytes: token ids of the longest prompt fit easily */
#define PRISM_NET_CONTROL_HWM 10000           /* messages queued per peer on control sockets */

typedef struct {
    const void *data;
    size_t len;
    /* Optional, prism_msg_send only: the frame is sent without a copy, and release(data, hint) is
     * called exactly once when ZeroMQ is done with it (from its I/O thread), or before the call
     * returns when it was not handed over (a failed send). For a buffer shared by reference count:
     * the caller takes a reference for the frame and release drops it; the bytes must not change
     * meanwhile. NULL: the bytes are copied (and the caller keeps its buffer). */
    void (*release)(void *data, void *hint);
    void *hint;
} prism_frame_t;

/* ---- processes, roles, keys ---- */

typedef enum {
    PRISM_NET_ROLE_NONE = 0,
    PRISM_NET_ROLE_ROUTER,
    PRISM_NET_ROLE_ENCODER,
    PRISM_NET_ROLE_PREFILL,
    PRISM_NET_ROLE_DECODE,
    PRISM_NET_ROLE_COUNT
} prism_net_role_t;

#define PRISM_NET_ALLOW(role) (1u << (role))    /* bit for prism_sock_opts_t.allow */
#define PRISM_NET_KEY_Z85 40                   /* characters of a Z85 CURVE key */
#define PRISM_NET_ROLE_PROPERTY "X-Prism-Role"  /* connection metadata our ZAP handler adds: the key's role */

const char *prism_net_role_name(prism_net_role_t role);      /* "router", ...; "" for NONE */
prism_net_role_t prism_net_role_parse(const char *name);     /* NONE when unknown */

typedef struct {
    prism_net_role_t role;   /* whose secret key this process holds */
    const char *curve_keys;  /* key directory (see above); required unless insecure */
    bool insecure;           /* --insecure-no-curve: plain ZMTP, no authentication (a warning is logged) */
    int io_threads;          /* ZeroMQ I/O threads (ZMQ_IO_THREADS; 0: ZeroMQ's 1): each connection is
                              * served (framed, CURVE-encrypted) by one of them */
} prism_net_opts_t;

/* One per process: the ZeroMQ context, this process's keys and the ZAP handler thread. */
typedef struct prism_net prism_net_t;

/* Loads the keys and starts the ZAP handler. Fails (PRISM_EINVAL with a message naming the file and
 * the fix) when neither curve_keys nor insecure is given, when a key file is missing or malformed,
 * or when a secret key file is accessible to others (group access is allowed). */
int   prism_net_create(const prism_net_opts_t *o, prism_net_t **out, char *err, size_t errlen);
/* Stops the ZAP thread and terminates the context: close every socket first. */
void  prism_net_destroy(prism_net_t *net);
void *prism_net_zctx(prism_net_t *net);
bool  prism_net_secure(const prism_net_t *net);
prism_net_role_t prism_net_role(const prism_net_t *net);   /* whose key this process holds */

typedef struct {
    uint64_t auth_ok;           /* handshakes the ZAP handler admitted */
    uint64_t auth_denied;       /* handshakes with an unknown key, or a key of a role the socket does not admit */
    uint64_t handshake_failed;  /* other failed handshakes on bound sockets: no CURVE, wrong server key, garbage
                                 * (not connections closed before a word: TCP health probes) */
} prism_net_stats_t;
void prism_net_stats(const prism_net_t *net, prism_net_stats_t *st);
/* auth_denied + handshake_failed: peers refused at the door (for metrics). */
uint64_t prism_net_refused(const prism_net_t *net);

/* A peer's connection to a socket bound with watch_disconnects dropped (the process died, or the
 * network cut it): its file descriptor (the ZMQ_SRCFD of its messages, prism_msg_t.src_fd) and
 * when the event was seen. Reported only under CURVE (the monitors live in the ZAP thread). */
typedef struct {
    int fd;
    double t;
} prism_net_disconnect_t;
/* Takes up to max pending reports, oldest first; returns how many. */
int prism_net_disconnects(prism_net_t *net, prism_net_disconnect_t *out, int max);

/* Key files. prism_net_keygen writes DIR/<role>.key (0600) and DIR/<role>.pub for each role in mask
 * (PRISM_NET_ALLOW bits), creating DIR (0700); an existing key is kept unless overwrite. */
int prism_net_keygen(const char *dir, unsigned roles_mask, bool overwrite, char *err, size_t errlen);
/* Reads one Z85 key file (40 characters, surrounding whitespace ignored) into out[41]. */
int prism_net_key_read(const char *path, char *out, char *err, size_t errlen);

/* ---- messages ---- */

typedef struct {
    Prism__Envelope *env;                      /* unpacked header */
    zmq_msg_t frames[PRISM_MSG_MAX_FRAMES];    /* raw payload frames */
    int n_frames;
    uint8_t identity[PRISM_MSG_MAX_IDENTITY];  /* sender identity on ROUTER sockets */
    size_t identity_len;
    /* Who sent it, as authenticated by CURVE (empty under --insecure-no-curve). peer_key is the
     * "User-Id" ZeroMQ metadata our ZAP handler sets: the sender's Z85 public key. Code that binds
     * a worker id to a key (registration) compares these, never the self-declared fields. */
    char peer_key[PRISM_NET_KEY_Z85 + 1];
    prism_net_role_t peer_role;
    int src_fd;              /* the connection it came in on (ZMQ_SRCFD), -1 when unknown */
} prism_msg_t;

/* Receives one whole multipart message. flags: 0 or ZMQ_DONTWAIT.
 * PRISM_EAGAIN: nothing waiting. PRISM_ECORRUPT: a malformed message was consumed and dropped
 * (bad envelope, wrong protocol version, too many frames). */
int  prism_msg_recv(void *sock, bool from_router_socket, prism_msg_t *m, int flags);
void prism_msg_close(prism_msg_t *m);
/* Frees an envelope taken over from a message (set m->env = NULL before prism_msg_close). */
void prism_msg_env_free(Prism__Envelope *env);
const void *prism_msg_frame(prism_msg_t *m, int i, size_t *len);

/* Sends env (version is filled in) plus raw frames; identity is needed on ROUTER sockets.
 * flags: 0 (block under backpressure) or ZMQ_DONTWAIT (PRISM_EAGAIN when the peer is full).
 * Frames are copied, but for those with a release callback (prism_frame_t), which go by reference
 * and are released once, whatever the call returns. */
int prism_msg_send(void *sock, const void *identity, size_t identity_len, Prism__Envelope *env,
                   const prism_frame_t *frames, int n_frames, int flags);
/* The same, without copying the frames: each frames[i].data is a prism_malloc'd buffer that the
 * call takes over, whatever it returns (ZeroMQ frees it with prism_free once sent, from its I/O
 * thread; a buffer not handed over is freed here). */
int prism_msg_send_take(void *sock, const void *identity, size_t identity_len, Prism__Envelope *env,
                        const prism_frame_t *frames, int n_frames, int flags);

/* Frees the calling thread's envelope pack buffer (prism_msg_send keeps one per thread); call it
 * before a thread that sent messages exits. */
void prism_msg_thread_exit(void);

/* Unpacks and checks one envelope (size bound, protocol version); NULL when malformed. The part of
 * prism_msg_recv that reads untrusted bytes, exposed for fuzzing. Free with prism_msg_env_free. */
Prism__Envelope *prism_msg_unpack(const void *data, size_t len);

/* ---- sockets: every option that bounds or authenticates a socket is set here, in one place ---- */
typedef struct {
    int type;                /* ZMQ_ROUTER, ZMQ_DEALER, ZMQ_PUSH, ZMQ_PULL */
    const char *endpoint;
    int hwm;                 /* messages queued per peer, each way (> 0) */
    int64_t max_msg_bytes;   /* largest inbound frame (> 0): a bigger one drops the peer's connection */
    const char *identity;    /* connect: ZeroMQ routing id (the worker id), or NULL */
    size_t identity_len;     /* bytes of identity; 0 = strlen (tests set it to put a NUL inside) */
    unsigned allow;          /* bind: PRISM_NET_ALLOW bits of the roles admitted (CURVE server) */
    prism_net_role_t server; /* connect: role of the process bound at endpoint (its key is the server key) */
    bool watch_disconnects;  /* bind, CURVE: report peers' dropped connections (prism_net_disconnects) */
} prism_sock_opts_t;

void *prism_sock_bind(prism_net_t *net, const prism_sock_opts_t *o);
void *prism_sock_connect(prism_net_t *net, const prism_sock_opts_t *o);
/* Actual endpoint after binding "tcp://127.0.0.1:0" (port chosen by the OS). */
int prism_sock_last_endpoint(void *sock, char *out, size_t n);

const char *prism_role_name(Prism__Role role);

#endif
