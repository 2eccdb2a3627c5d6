/* worker: what every worker process shares — two threads, so that a worker busy with a long
 * batch is never mistaken for a dead one.
 *
 *   I/O thread (io.c; started by prism_worker_start): owns every router socket (one DEALER per
 *   router, identity = worker id) and the data socket (PULL). It registers, sends heartbeats on
 *   time whatever the compute thread does, receives work, data and aborts, and sends the compute
 *   thread's replies on to their routers. It never blocks on the compute thread. It also follows
 *   --router DNS names (opens and closes router slots as addresses come and go) and runs the
 *   SIGTERM drain (below).
 *   Compute thread (the process's main thread): owns the model, the request tables and the PUSH
 *   sockets to peers (embeddings, KV: data-plane sends keep their own backpressure). It takes
 *   messages from the I/O thread (prism_worker_poll), replies (prism_worker_reply), publishes its
 *   load (prism_worker_set_load) and counts its progress (prism_worker_progress and the model's
 *   between-layer hook, prism_worker_layer_done).
 *
 *   prism_worker_t w;
 *   prism_worker_init(&w, PRISM__ROLE__ROLE_DECODE, &opts, "tcp://127.0.0.1:0", max_kv_bytes);
 *   prism_worker_set_capacity(&w, ...);          // advertised at registration
 *   prism_worker_start(&w);                      // the I/O thread: registration, heartbeats
 *   while (!prism_worker_should_stop()) {
 *       prism_worker_set_load(&w, &load);        // what the next heartbeat says
 *       prism_worker_accept_data(&w, free_slots);
 *       prism_worker_poll(&w, timeout_ms, on_msg, ud);
 *       ... run one unit of work (a batch, a chunk, a step) ...
 *   }
 *   prism_worker_close(&w);
 *
 * Handover between the threads, one inproc PAIR socket pair, without copies:
 *   inbound  [header: the unpacked envelope (pointer), source, arrival time][raw frames, moved].
 *            The envelope is unpacked once, on the I/O thread; ownership travels with the message
 *            and prism_msg_close on the compute thread frees it.
 *   outbound [route: router index][envelope bytes][raw frames]: moved on to the router socket.
 * Bounds: data messages pass only while the compute thread has granted credit
 * (prism_worker_accept_data: the free slots of its receive pool), so the data socket keeps its
 * backpressure exactly as before; control messages are bounded by the capacity the router
 * respects, and beyond PRISM_WORKER_INBOX_HWM queued messages the I/O thread refuses new work
 * with an error reply instead of queueing it.
 *
 * Aborts reach into long work: the I/O thread records every abort (request id, router, arrival
 * time) in a small table and bumps a counter before passing the message on. Between layers the
 * model calls the worker's hook, which calls prism_worker_layer_done: an atomic load tells whether
 * an abort came since the last look, and only then does the worker ask prism_worker_aborted()
 * about each item of its batch. The model knows nothing of sockets.
 *
 * Liveness is progress: every heartbeat carries the compute thread's progress counter (layers,
 * images, chunks, steps completed) and whether it is busy (it has not come back to wait for work
 * since the last heartbeat). The router drops a worker whose heartbeats stop (dead) and stops
 * routing to one whose heartbeats say busy while progress stays flat (stuck).
 *
 * Drain (SIGTERM): the first SIGINT/SIGTERM asks for a drain, a second one stops at once. The I/O
 * thread sees the first, says `draining` in every heartbeat (every PRISM_DRAIN_HEARTBEAT_S), stops
 * registering, and reads each router's DrainAck (what it still holds here; 0 releases us). Once
 * every router released us (or stopped, or stayed silent PRISM_DRAIN_ROUTER_GONE_S) and the load
 * the compute thread publishes shows nothing running or queued — or --drain-timeout passed — it
 * sets the stop flag, and the compute thread leaves its loop as for a second signal
 * (prism_worker_should_stop). The compute thread keeps working meanwhile: routers send no new work,
 * and what was sent before they saw `draining` is still served.
 *
 * Test hook (compiled in, inert unless set): PRISM_TEST_STALL_AFTER_LAYERS=N in a worker's
 * environment makes its compute thread stop making progress once its progress counter passes N:
 * it sleeps in the next between-layer hook until the process is told to stop, while the I/O
 * thread keeps heartbeating.
 * tests/integration/test_liveness.py uses it to check that such a worker is detected as stuck.
 */
#ifndef PRISM_WORKER_H
#define PRISM_WORKER_H

#include "core/core.h"
#include "core/cli.h"
#include "net/net.h"

#include <pthread.h>
#include <stdatomic.h>

struct prism_resolver;       /* net/resolve.h */

#define PRISM_WORKER_MAX_ROUTERS 16
#define PRISM_WORKER_MAX_PEERS 64
#define PRISM_WORKER_INBOX_HWM 65536    /* messages queued for the compute thread */
#define PRISM_WORKER_ABORTS 256         /* recent aborts the between-layer check can see */
#define PRISM_WORKER_PEER_IDLE_S 10.0   /* a peer link unused this long may be closed for a new one */

/* A router slot. The I/O thread owns it; it changes router_id, registered, gen and the slot's
 * emptiness (sock) under mu, and the compute thread reads those under mu only. */
typedef struct {
    char endpoint[256];
    char router_id[128];     /* learned from the REGISTER_ACK */
    void *sock;              /* DEALER; NULL: an empty slot (a router whose address left the DNS name) */
    uint32_t gen;            /* bumped when the slot is emptied: a reply routed to an older holder is dropped */
    bool registered;
    bool from_name;          /* an address of a --router DNS name: closed when it leaves the name */
    double last_register_s;
    bool released;           /* draining: the router holds no request here and sends none (DrainAck) */
    double drain_reply_s;    /* last DrainAck from it */
} prism_worker_router_t;

typedef struct {
    char endpoint[256];
    void *sock;              /* PUSH: compute thread */
    double last_used;
} prism_worker_peer_t;

/* What the compute thread tells the routers about its load (copied into every heartbeat). */
typedef struct {
    uint32_t running, waiting, kv_free_blocks, pool_free;
    uint64_t cache_hits, cache_misses;
    uint64_t kv_waits;       /* decode: KV transfers that waited for blocks or a slot (a counter) */
    /* what aborts stopped, so a test sees work end rather than only a log line (counters) */
    uint64_t tokens_generated;  /* decode: tokens sampled */
    uint64_t seqs_aborted;      /* decode: sequences ended by an abort */
    uint64_t prompts_aborted;   /* prefill: prompts left mid-prompt for an abort */
    uint64_t sends_waited;      /* encoder: embeddings that waited for room in a prefill's pool */
    uint64_t preempt_recompute;  /* decode: sequences preempted by recompute (KV pool ran out; a counter) */
    uint64_t preempt_swap;       /* decode: sequences preempted by swapping their KV to host memory (a counter) */
    uint64_t kv_swap_bytes;      /* decode: bytes of its swap region in use now */
    uint64_t preempt_migrate;    /* decode: sequences preempted by sending their KV whole to another decode worker */
    /* prefill: prompt tokens looked up in / found in the prefix cache, and computed (counters) */
    uint64_t prefix_cache_queries, prefix_cache_hits, prompt_tokens_computed;
    uint32_t image_decodes_peak; /* encoder: most images decoded at once since start */
    /* prefill: forwards, the prompts they carried, the most in one forward (batched prefill) */
    uint64_t prefill_forwards, prefill_forward_prompts;
    uint32_t prefill_batch_peak;
    uint64_t prefill_pool_breaks;   /* prefill: prompts failed to break a full embedding pool's stall */
    uint64_t kv_sent_bytes;      /* prefill, decode: KV transfer frame bytes sent (wire dtype; a counter) */
} prism_worker_load_t;

/* An abort as the I/O thread saw it. */
typedef struct {
    uint64_t rid;
    char router_id[128];
    double t_arrive;         /* prism_now_s() when the I/O thread read it */
} prism_worker_abort_t;

typedef struct prism_worker {
    prism_net_t *net;        /* ZeroMQ context, CURVE keys, ZAP handler */
    Prism__Role role;
    char worker_id[128];
    Prism__Register reg;     /* capacity fields filled before prism_worker_start */
    double heartbeat_s;      /* interval */

    /* ---- I/O thread (after prism_worker_start) ---- */
    /* Router slots: a slot keeps its index while its router is connected (empty slots have sock ==
     * NULL); n_routers (under mu) is the highest slot used + 1. A --router endpoint whose host is a
     * DNS name stands for every address of the name (net/resolve.h), re-resolved every
     * router_resolve_s. */
    prism_worker_router_t routers[PRISM_WORKER_MAX_ROUTERS];
    int n_routers;
    prism_str_list_t router_names;     /* the --router entries that are DNS names */
    struct prism_resolver *resolver;   /* started by the I/O thread when there are names */
    double router_resolve_s;
    int64_t router_max_msg_bytes;      /* ZMQ_MAXMSGSIZE of router links (--max-message-bytes) */
    bool draining;           /* SIGTERM seen: heartbeats say so, routers send nothing new */
    double drain_start_s, drain_timeout_s;
    void *data_sock;         /* PULL, bound; NULL for encoders */
    char data_endpoint[256]; /* endpoint peers connect to: the bound one, or --advertise-host/-port */
    void *io_pair;           /* PAIR: the I/O end of the channel */
    pthread_t io_thread;
    bool io_started;
    double last_heartbeat_s;
    uint64_t hb_polls;       /* compute polls seen at the last heartbeat */

    /* ---- compute thread ---- */
    void *cpu_pair;          /* PAIR: the compute end */
    prism_worker_peer_t peers[PRISM_WORKER_MAX_PEERS];
    int n_peers;
    uint64_t data_received;
    uint64_t peers_closed;   /* idle peer links closed to make room (peers restarted on new ports) */
    uint64_t aborts_seen;    /* abort_seq at the last between-layer look */
    int64_t stall_after;     /* test hook: layers before the stall, -1 = never */
    double reply_delay_s;    /* test hook: the I/O thread holds each reply this long (0 = never) */
    int close_linger_ms;     /* prism_worker_close_linger: set before close, read by the I/O thread */
    int signals_seen;        /* prism_worker_signals() at the last poll: a new one wakes the I/O thread */
    struct {                 /* the forward in the model now, as its between-layer hook saw it */
        int done, total;     /* layers done (0: the embeddings), of total */
        double t_last, last_s;   /* when the last one ended, how long it took */
    } layer;

    /* ---- shared ---- */
    pthread_mutex_t mu;      /* router slots' ids, registered, gen and n_routers; load; the abort table */
    prism_worker_load_t load;
    uint64_t load_seq;       /* prism_worker_set_load calls */
    uint64_t drain_load_seq; /* load_seq at the drain's start or its last release: idle only from a newer load */
    prism_worker_abort_t aborts[PRISM_WORKER_ABORTS];  /* ring */
    uint64_t n_aborts;
    atomic_uint_fast64_t abort_seq;     /* bumped by the I/O thread after each abort */
    atomic_uint_fast64_t progress;      /* units of work the compute thread completed */
    atomic_uint_fast64_t polls;         /* compute thread's prism_worker_poll calls */
    atomic_bool idle;                   /* compute thread is waiting for work */
    atomic_uint_fast64_t data_limit;    /* data messages the compute thread can take, ever */
    atomic_uint_fast64_t data_forwarded;
    atomic_bool io_stop;
    atomic_uint_fast64_t registrations; /* routers that registered this worker (again): a new one knows nothing of it */
} prism_worker_t;

typedef struct prism_worker_opts prism_worker_opts_t;
/* Connects to every router (o->routers, as o->worker_id, authenticated with o's CURVE keys; a DNS name
 * is connected address by address by the I/O thread once its first lookup ends) and, when
 * data_bind is set, binds the data socket; data_max_msg_bytes is the largest data frame this worker
 * accepts (one image's embeddings, one prompt's KV): a bigger one drops the sender's connection. */
int  prism_worker_init(prism_worker_t *w, Prism__Role role, const prism_worker_opts_t *o, const char *data_bind,
                       size_t data_max_msg_bytes);
/* Starts the I/O thread: registration and heartbeats begin. */
int  prism_worker_start(prism_worker_t *w);
/* Stops and joins the I/O thread and closes every socket (compute thread). */
void prism_worker_close(prism_worker_t *w);
/* Before prism_worker_close, for a worker that exits after failing its requests: the I/O thread
 * forwards every reply still in the channel and the router sockets keep unsent ones up to
 * linger_ms at close (otherwise replies not yet sent are dropped, as a dead process's would be). */
void prism_worker_close_linger(prism_worker_t *w, int linger_ms);

/* ---- compute thread ---- */

/* Waits up to timeout_ms for messages from the I/O thread and hands each to fn (at most a bounded
 * number per call). source is the index of the router a control message came from, -1 for the
 * data socket. The message and its envelope are freed after fn returns (fn may take frames with
 * zmq_msg_move, or the envelope by setting m->env = NULL and freeing it later with
 * prism_msg_env_free). */
typedef void (*prism_worker_msg_fn)(prism_worker_t *w, prism_msg_t *m, int source, void *ud);
int  prism_worker_poll(prism_worker_t *w, int timeout_ms, prism_worker_msg_fn fn, void *ud);
/* Grants data credit: free_slots more data messages may be handed over beyond those already
 * received (the free slots of the receive pool; 0 stops reading the data socket). */
void prism_worker_accept_data(prism_worker_t *w, int free_slots);
void prism_worker_set_load(prism_worker_t *w, const prism_worker_load_t *load);
/* Sends a Tokens / EncodeDone style reply (no raw frames) to the router that owns the request (its
 * 128-bit id: both halves), through the I/O thread. PRISM_ENOTFOUND when that router is not
 * connected (reply dropped). */
int  prism_worker_reply(prism_worker_t *w, const char *router_id, uint64_t request_id, uint64_t request_id_hi,
                        Prism__Envelope *env);
/* Sends env (no raw frames, about no request) to every router this worker is registered with,
 * through the I/O thread: the prefill's PrefixEvents. Returns how many routers it went to. */
int  prism_worker_broadcast(prism_worker_t *w, Prism__Envelope *env);
/* A Tokens reply that fails the request (FINISH_ERROR with msg and its kind: CLIENT, UNAVAILABLE,
 * INTERNAL); from_prefill as the prefill worker marks its Tokens. */
int  prism_worker_reply_error(prism_worker_t *w, const char *router_id, uint64_t request_id, uint64_t request_id_hi,
                              Prism__ErrorKind kind, const char *msg, bool from_prefill);
/* PUSH socket to a peer's data endpoint, connected on first use (compute thread only). Peers restart
 * on new ports, so the table would fill with dead endpoints: when it is full, the least recently used
 * link that has been idle PRISM_WORKER_PEER_IDLE_S and has nothing queued is closed to make room.
 * NULL when none can go (every link busy) or the connect fails. */
void *prism_worker_peer_sock(prism_worker_t *w, const char *endpoint);
/* Counts completed units of work (an image, a chunk, a step). */
void prism_worker_progress(prism_worker_t *w, uint64_t units);
/* For the model's between-layer hook (model.h: layer(ud, done, total)): counts the layer as progress,
 * keeps where the forward is (w->layer: for the tiers' cancellation logs) and returns true when an
 * abort arrived since the last call (or the process is stopping), i.e. when the items of the batch
 * should be checked with prism_worker_aborted. */
bool prism_worker_layer_done(prism_worker_t *w, int done, int total);
/* True when an abort for (rid, router_id) is in the recent-abort table, or the process is stopping
 * (then every item is dropped). *waited_s (may be NULL): seconds since the abort arrived. */
bool prism_worker_aborted(prism_worker_t *w, uint64_t rid, const char *router_id, double *waited_s);

/* SIGINT/SIGTERM handling shared by all processes. The first signal starts a drain (see the top of
 * this file); prism_worker_should_stop() becomes true when the drain ends, or at a second signal. */
#define PRISM_DRAIN_HEARTBEAT_S 0.2   /* heartbeat period while draining: the release comes this soon */
#define PRISM_DRAIN_ROUTER_GONE_S 5.0 /* a router silent this long while we drain is not waited for */
#define PRISM_DRAIN_LINGER_MS 5000    /* a drained worker's last messages may take this long to leave */
void prism_worker_install_signals(void);
bool prism_worker_should_stop(void);
/* For the I/O thread: signals seen so far (0, 1 = drain, 2 = stop), and the end of a drain. */
int  prism_worker_signals(void);
void prism_worker_request_stop(void);

/* Flags every worker has (prism_worker_opts_flags puts them into a flag table). */
struct prism_worker_opts {
    const char *model_path;
    const char *worker_id;
    prism_str_list_t routers;
    const char *host;
    int64_t data_port;
    const char *device;
    int64_t threads;
    const char *weight_dtype;    /* "auto" (the device's own), "f32" or "bf16" */
    const char *compute_dtype;   /* matmul arithmetic: "auto" (the device's own), "f32" or "bf16" */
    int64_t mem_budget;
    const char *log_level;
    const char *log_format;      /* text or json (one object per line) */
    double heartbeat_s;
    bool random_weights;
    const char *curve_keys;      /* key directory (prism_keygen) */
    bool insecure_no_curve;
    int64_t max_message_bytes;   /* largest control message from a router (an image file for encoders) */
    const char *advertise_host;  /* host peers reach the data endpoint at (NAT, containers); NULL = --host */
    int64_t advertise_port;      /* 0 = the bound port */
    double router_resolve_s;     /* seconds between lookups of --router DNS names */
    double drain_timeout_s;      /* SIGTERM: longest wait for held requests before exiting */
};

#define PRISM_WORKER_N_FLAGS 21
void prism_worker_opts_defaults(prism_worker_opts_t *o, const char *role);
/* Appends the common flags to table (which must have room for PRISM_WORKER_N_FLAGS more entries + END). */
int  prism_worker_opts_flags(prism_worker_opts_t *o, prism_flag_t *table, int n);

/* What registration advertises (0 where a field does not apply). */
typedef struct {
    uint64_t mem_planned;            /* the memory plan's total (worker/start.h) */
    uint32_t kv_blocks, block_size, max_batch_tokens, max_running, max_model_len;
    uint32_t tp_size;                /* ranks of the worker's group (0 or 1: one process) */
    uint64_t max_queued_bytes;       /* encoder: image file bytes a router may queue here */
    uint32_t embedding_cache_units;  /* encoder: tiles its embedding cache holds (0: none, no early jobs) */
} prism_worker_capacity_t;

/* Before prism_worker_start: the capacity above, the heartbeat and drain settings, and the data
 * endpoint peers connect to (--advertise-host / --advertise-port replace the bound host / port). */
void prism_worker_set_capacity(prism_worker_t *w, const prism_worker_opts_t *o, const prism_worker_capacity_t *c);

/* Resolves the data bind endpoint from host + data_port ("tcp://host:port", port 0 = any). */
void prism_worker_data_bind(const prism_worker_opts_t *o, char *out, size_t n);

#endif
