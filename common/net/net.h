/* net: ZeroMQ multipart messages with a protobuf-c envelope.
 *
 * Wire format of one message: [identity (ROUTER sockets only)] [Envelope] [raw frame]*.
 * Raw frames carry tensor and image bytes; they are sent with zmq_send and received into
 * zmq_msg_t, never copied into protobuf fields.
 *
 *   prism_msg_t m;
 *   if (prism_msg_recv(sock, false, &m, ZMQ_DONTWAIT) == PRISM_OK) {
 *       switch (m.env->type) { ... prism_msg_frame(&m, 0, &len) ... }
 *       prism_msg_close(&m);
 *   }
 */
#ifndef PRISM_NET_H
#define PRISM_NET_H

#include "core/core.h"
#include "prism.pb-c.h"
#include <zmq.h>

#define PRISM_PROTOCOL_VERSION 1
/* Raw frames after the envelope: an image's embeddings travel as one frame per tile (Llama-4:
 * up to PRISM_LLAMA4_MAX_PATCHES + 1 = 65 tiles), everything else in one or two. */
#define PRISM_MSG_MAX_FRAMES 72
#define PRISM_MSG_MAX_IDENTITY 255
#define PRISM_MSG_MAX_ENVELOPE (16u << 20)   /* bytes: token ids of the longest prompt fit easily */

typedef struct {
    const void *data;
    size_t len;
} prism_frame_t;

typedef struct {
    Prism__Envelope *env;                      /* unpacked header */
    zmq_msg_t frames[PRISM_MSG_MAX_FRAMES];    /* raw payload frames */
    int n_frames;
    uint8_t identity[PRISM_MSG_MAX_IDENTITY];  /* sender identity on ROUTER sockets */
    size_t identity_len;
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
 * flags: 0 (block under backpressure) or ZMQ_DONTWAIT (PRISM_EAGAIN when the peer is full). */
int prism_msg_send(void *sock, const void *identity, size_t identity_len, Prism__Envelope *env,
                   const prism_frame_t *frames, int n_frames, int flags);

/* Socket helpers: sensible options (linger 0, bounded queues) applied in one place. */
void *prism_sock_bind(void *zctx, int type, const char *endpoint, int hwm);
void *prism_sock_connect(void *zctx, int type, const char *endpoint, const char *identity, int hwm);
/* Actual endpoint after binding "tcp://127.0.0.1:0" (port chosen by the OS). */
int prism_sock_last_endpoint(void *sock, char *out, size_t n);

const char *prism_role_name(Prism__Role role);

#endif
