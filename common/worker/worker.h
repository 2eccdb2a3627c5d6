/* worker: what every worker process shares — connections to the routers (one DEALER socket
 * per router, identity = worker id), registration, heartbeats with load, a data socket that
 * peers push tensors to, the start-up memory plan, and the poll loop.
 *
 *   prism_worker_t w;
 *   prism_worker_init(&w, PRISM__ROLE__ROLE_DECODE, id, routers, n_routers, "tcp://127.0.0.1:0");
 *   w.reg.kv_blocks = ...;                       // capacity advertised at registration
 *   while (!prism_worker_should_stop()) {
 *       prism_worker_tick(&w, &hb);              // (re-)register, heartbeat when due
 *       prism_worker_poll(&w, timeout_ms, accept_data, on_msg, ud);
 *       ... run one step of work ...
 *   }
 */
#ifndef PRISM_WORKER_H
#define PRISM_WORKER_H

#include "core/core.h"
#include "core/cli.h"
#include "net/net.h"

struct prism_model_config;   /* model/model.h */

#define PRISM_WORKER_MAX_ROUTERS 8
#define PRISM_WORKER_MAX_PEERS 64

typedef struct {
    char endpoint[256];
    char router_id[128];     /* learned from the REGISTER_ACK */
    void *sock;              /* DEALER */
    bool registered;
    double last_register_s;
} prism_worker_router_t;

typedef struct {
    char endpoint[256];
    void *sock;              /* PUSH */
} prism_worker_peer_t;

/* ---- start-up memory plan: named regions that must fit the budget ---- */
#define PRISM_PLAN_MAX 16
typedef struct {
    const char *name[PRISM_PLAN_MAX];
    size_t bytes[PRISM_PLAN_MAX];
    int n;
    size_t budget;           /* 0 = no budget given: plan is logged, nothing refused */
} prism_mem_plan_t;

void   prism_mem_plan_add(prism_mem_plan_t *p, const char *name, size_t bytes);
size_t prism_mem_plan_total(const prism_mem_plan_t *p);
/* Resident memory the process holds outside our own allocator (shared libraries and their static
 * state — the CUDA libraries alone are ~150 MiB — the BLAS thread buffers, mapped files): RSS
 * minus the heap prism_malloc accounts for. Measured after loading the model so the plan covers
 * what the process really costs. */
size_t prism_mem_runtime_bytes(void);
#define PRISM_MEM_RESERVE ((size_t)32 << 20)  /* later growth: BLAS buffers on first use, sockets */
/* Logs the plan; PRISM_ENOMEM (with a message naming the numbers) when it exceeds the budget. */
int    prism_mem_plan_check(const prism_mem_plan_t *p, const char *who);

typedef struct {
    prism_net_t *net;        /* ZeroMQ context, CURVE keys, ZAP handler */
    Prism__Role role;
    char worker_id[128];
    prism_worker_router_t routers[PRISM_WORKER_MAX_ROUTERS];
    int n_routers;
    void *data_sock;         /* PULL, bound; NULL for encoders */
    char data_endpoint[256]; /* resolved endpoint peers connect to */
    prism_worker_peer_t peers[PRISM_WORKER_MAX_PEERS];
    int n_peers;
    Prism__Register reg;     /* capacity fields filled by the worker before the first tick */
    double heartbeat_s;      /* interval */
    double last_heartbeat_s;
} prism_worker_t;

typedef struct prism_worker_opts prism_worker_opts_t;
/* Connects to every router (o->routers, as o->worker_id, authenticated with o's CURVE keys) and, when
 * data_bind is set, binds the data socket; data_max_msg_bytes is the largest data frame this worker
 * accepts (one image's embeddings, one prompt's KV): a bigger one drops the sender's connection. */
int  prism_worker_init(prism_worker_t *w, Prism__Role role, const prism_worker_opts_t *o, const char *data_bind,
                       size_t data_max_msg_bytes);
void prism_worker_close(prism_worker_t *w);

/* Registration and heartbeats; call every loop iteration (cheap when nothing is due). */
void prism_worker_tick(prism_worker_t *w, Prism__Heartbeat *hb);

/* Polls router sockets (and the data socket when accept_data) for up to timeout_ms and hands
 * every message to fn. router_index is the router a control message came from, -1 for data.
 * Messages about registration are handled here and not passed on. */
typedef void (*prism_worker_msg_fn)(prism_worker_t *w, prism_msg_t *m, int router_index, void *ud);
int  prism_worker_poll(prism_worker_t *w, int timeout_ms, bool accept_data, prism_worker_msg_fn fn, void *ud);

/* Socket of the router that owns a request (by the router_id in its envelope); NULL if unknown. */
void *prism_worker_router_sock(prism_worker_t *w, const char *router_id);
/* PUSH socket to a peer's data endpoint, connected on first use. */
void *prism_worker_peer_sock(prism_worker_t *w, const char *endpoint);

/* Sends a Tokens / EncodeDone style reply to the owning router (no raw frames). */
int  prism_worker_reply(prism_worker_t *w, const char *router_id, uint64_t request_id, Prism__Envelope *env);

/* SIGINT/SIGTERM handling shared by all processes. */
void prism_worker_install_signals(void);
bool prism_worker_should_stop(void);

/* Flags every worker has; call prism_worker_common_flags to get them into a flag table. */
struct prism_worker_opts {
    const char *model_path;
    const char *worker_id;
    prism_str_list_t routers;
    const char *host;
    int64_t data_port;
    const char *device;
    int64_t threads;
    int64_t mem_budget;
    const char *log_level;
    double heartbeat_s;
    bool random_weights;
    const char *curve_keys;      /* key directory (prism_keygen) */
    bool insecure_no_curve;
    int64_t max_message_bytes;   /* largest control message from a router (an image file for encoders) */
};

#define PRISM_WORKER_N_FLAGS 14
void prism_worker_opts_defaults(prism_worker_opts_t *o, const char *role);
/* Appends the common flags to table (which must have room for PRISM_WORKER_N_FLAGS more entries + END). */
int  prism_worker_opts_flags(prism_worker_opts_t *o, prism_flag_t *table, int n);
/* Start-up shared by every worker: appends the common flags after the worker's own entries of flags
 * (a zero-filled table with room for them), parses, sets up logging and signals, loads config.json
 * (and applies --random-weights). Returns -1 to go on, else the process exit code (0 after --help,
 * 2 for bad flags, 1 otherwise). */
int  prism_worker_startup(int argc, char **argv, const char *role, const char *summary, prism_flag_t *flags,
                          prism_worker_opts_t *o, struct prism_model_config *cfg);

/* What registration advertises: the memory plan and capacity (0 where a field does not apply). */
void prism_worker_set_capacity(prism_worker_t *w, const prism_worker_opts_t *o, const prism_mem_plan_t *plan,
                               uint32_t kv_blocks, uint32_t block_size, uint32_t max_batch_tokens,
                               uint32_t max_running, uint32_t max_model_len);

/* Resolves the data bind endpoint from host + data_port ("tcp://host:port", port 0 = any). */
void prism_worker_data_bind(const prism_worker_opts_t *o, char *out, size_t n);

#endif
