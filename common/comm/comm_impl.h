/* Internal to prism_comm: the transports' constructors, process liveness, and the entry points of
 * the NCCL module (libprism_comm_nccl.so, opened with dlopen by group.c). */
#ifndef PRISM_COMM_IMPL_H
#define PRISM_COMM_IMPL_H

#include "comm/comm.h"
#include "backend/backend.h"

#include <sys/types.h>

/* Liveness of the other ranks as the group sees it; called by transports while they wait for
 * peers (about every 100 ms). PRISM_OK or PRISM_EIO with a reason in why. */
typedef int (*prism_comm_alive_fn)(void *ud, char *why, size_t whylen);

/* ---- processes ---- */
/* Start time of pid (clock ticks since boot, /proc/<pid>/stat field 22); 0 when there is no such
 * process (or it is a zombie: killed, not yet reaped). */
uint64_t prism_proc_start_time(pid_t pid);
/* True while the process pid with that start time runs (a reused pid does not count). */
bool prism_proc_alive(pid_t pid, uint64_t start_time);

/* ---- shm (comm_shm.c) ---- */
typedef struct {
    int32_t pid;                   /* 0: unknown (other pid namespace): not checked */
    uint64_t start;
} prism_comm_peer_t;

/* Leader: creates the segment `name` (shm_open O_CREAT|O_EXCL, 0600) for size ranks with the peers'
 * processes; ranks: attach to it and check that it is the group's (group_id, size). The name is
 * unlinked by prism_comm_shm_unlink (the leader, once every rank is attached). */
int  prism_comm_shm_create(const char *name, uint64_t group_id, int size, int rank, size_t slot_bytes,
                           const prism_comm_peer_t *peers, double timeout_s, prism_comm_t **out,
                           char *err, size_t errlen);
void prism_comm_shm_unlink(const char *name);

/* ---- zmq (comm_zmq.c) ---- */
/* Collectives over the group link: leader = ROUTER with the ranks' identities, ranks = DEALER. */
typedef struct {
    uint8_t id[64];
    size_t len;
} prism_comm_ident_t;
int prism_comm_zmq_create(void *sock, int size, int rank, const prism_comm_ident_t *idents, size_t chunk_bytes,
                          double timeout_s, prism_comm_alive_fn alive, void *alive_ud, prism_comm_t **out,
                          char *err, size_t errlen);
#define PRISM_COMM_ZMQ_CHUNK ((size_t)1 << 20)   /* per rank; the leader stages T of them */

/* ---- nccl (comm_nccl.c, its own shared module) ---- */
#define PRISM_COMM_NCCL_MODULE "libprism_comm_nccl.so"
#define PRISM_COMM_NCCL_ID_BYTES 128          /* NCCL_UNIQUE_ID_BYTES */
typedef int (*prism_comm_nccl_id_fn)(uint8_t id[PRISM_COMM_NCCL_ID_BYTES], char *err, size_t errlen);
typedef int (*prism_comm_nccl_create_fn)(prism_backend_t *be, const uint8_t id[PRISM_COMM_NCCL_ID_BYTES],
                                         int size, int rank, double timeout_s, prism_comm_alive_fn alive,
                                         void *alive_ud, prism_comm_t **out, char *err, size_t errlen);
/* Exported by the module under these names. */
PRISM_API int prism_comm_nccl_unique_id(uint8_t id[PRISM_COMM_NCCL_ID_BYTES], char *err, size_t errlen);
PRISM_API int prism_comm_nccl_create(prism_backend_t *be, const uint8_t id[PRISM_COMM_NCCL_ID_BYTES], int size,
                                     int rank, double timeout_s, prism_comm_alive_fn alive, void *alive_ud,
                                     prism_comm_t **out, char *err, size_t errlen);

#endif
