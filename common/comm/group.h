/* group: forming a tensor-parallel group of T rank processes and keeping the link between them.
 *
 *   prism_group_opts_t o = {.size = 4, .rank = r, .leader = "tcp://10.0.0.5:7100", .name = "decode-0",
 *                           .be = be};
 *   prism_group_t *g;
 *   if (prism_group_create(net, &o, &g, err, sizeof err) != PRISM_OK) exit(1);
 *   prism_comm_t *c = prism_group_comm(g);      // collectives (comm.h), owned by the group
 *   ... every loop: if (prism_group_check(g) != PRISM_OK) exit(1);   // a peer died: restart together
 *   prism_group_destroy(g);
 *
 * The link is made with common/net's socket helpers, so it is authenticated like every internal link:
 * CURVE with the process's role key, and the leader's socket admits only peers holding the key of
 * the same role (a decode group's link admits decode processes only), unless --insecure-no-curve.
 *
 * Rendezvous (once, at start-up): rank 0, the leader, binds a ZeroMQ ROUTER on exactly the address
 * of `leader` (never every interface: a "*" host and 0.0.0.0 are refused) and waits for a
 * HELLO from each other rank (its rank, group size, device, host identity, pid). When all T-1 have
 * come it picks the transport and answers each with a WELCOME:
 *   - cuda: the leader calls ncclGetUniqueId and the id travels in the WELCOME (over this link,
 *     which is authenticated like every internal link; there is no TCP store listening anywhere);
 *   - cpu, every rank on this host (same boot id and /dev/shm): a shared-memory segment the leader
 *     creates (mode 0600, O_EXCL) and names in the WELCOME; it is unlinked as soon as every rank has
 *     mapped it, so nothing is left in /dev/shm whatever dies later;
 *   - cpu otherwise (or transport ZMQ): collectives travel over this link (comm_zmq.c).
 * Each rank attaches and answers READY; the leader answers GO when all are ready (or an error to
 * everyone when one failed), and only then does prism_group_create return, on every rank.
 * Refused at the door with a message: a rank number twice (unless the earlier process is dead),
 * another group size, another device kind, a rank out of range.
 *
 * Failure model: a group does not heal. When any rank dies, the others find out (their next
 * collective fails, or prism_group_check says so) and exit; the supervisor restarts the processes
 * and the new set forms a new group through the same rendezvous. Liveness: the peers' processes
 * (pid + start time, when every rank shares this host and pid namespace), on the ranks also the
 * link's disconnect events (the leader dying closes it), and everywhere the step timeout. (The
 * leader's bound socket carries common/net's handshake monitor, and a socket has one monitor, so
 * the leader does not watch disconnects; across hosts it learns of a dead rank from its next
 * collective.)
 *
 * After the rendezvous the link carries whatever the group's own protocol needs (the leader's step
 * plans in the workers): prism_group_link gives the socket (leader: ROUTER, identities from
 * prism_group_peer_identity; ranks: DEALER to the leader).
 */
#ifndef PRISM_GROUP_H
#define PRISM_GROUP_H

#include "comm/comm.h"
#include "backend/backend.h"

typedef enum {
    PRISM_COMM_TRANSPORT_AUTO = 0,   /* nccl on cuda; shm when every rank is on this host; else zmq */
    PRISM_COMM_TRANSPORT_SHM,
    PRISM_COMM_TRANSPORT_ZMQ,
} prism_comm_transport_t;

typedef struct {
    int size, rank;                  /* T and this process's rank, 0 <= rank < size <= PRISM_TP_MAX */
    const char *leader;              /* "tcp://host:port" the leader binds and the others connect to */
    const char *name;                /* the group's name in logs (e.g. the worker id) */
    prism_backend_t *be;             /* collectives run on this backend's device */
    prism_comm_transport_t transport;   /* CPU only; AUTO by default */
    size_t shm_slot_bytes;           /* shm: bytes per rank per op chunk (0: 1 MiB) */
    double timeout_s;                /* step timeout of one collective (0: 30 s) */
    double join_timeout_s;           /* the whole rendezvous (0: 120 s) */
    int64_t link_max_msg_bytes;      /* largest frame on the link (0: 64 MiB) */
} prism_group_opts_t;

typedef struct prism_group prism_group_t;

/* Forms the group (blocks until every rank is there, or join_timeout_s). PRISM_EINVAL for bad
 * options (message in err), PRISM_EIO when the rendezvous failed or timed out (message names the
 * missing ranks or the refusal). net: the process's ZeroMQ context and keys (common/net); the
 * link's role is the process's own (prism_net_role). May be NULL only when size is 1. */
struct prism_net;
int  prism_group_create(struct prism_net *net, const prism_group_opts_t *o, prism_group_t **out, char *err,
                        size_t errlen);
void prism_group_destroy(prism_group_t *g);

prism_comm_t *prism_group_comm(prism_group_t *g);
int  prism_group_size(const prism_group_t *g);
int  prism_group_rank(const prism_group_t *g);
const char *prism_group_transport(const prism_group_t *g);   /* "shm" | "zmq" | "nccl" | "single" */
/* Bytes of memory the transport holds (the shm segment, zmq staging), for the memory plan. */
size_t prism_group_mem_bytes(const prism_group_t *g);

/* PRISM_OK while every peer is alive as far as this process can tell; PRISM_EIO once one is known
 * dead (the communicator is aborted then). Cheap: call it every loop iteration. */
int  prism_group_check(prism_group_t *g);

/* The link after the rendezvous (see above). Identity of rank r (1..T-1) on the leader's ROUTER. */
void *prism_group_link(prism_group_t *g);
int  prism_group_peer_identity(const prism_group_t *g, int rank, const void **id, size_t *len);

/* Sizes the shared-memory segment of a shm group (for memory plans made before forming it). */
size_t prism_comm_shm_bytes(int size, size_t slot_bytes);

#endif
