/* start: a worker process's start-up, written once for every tier, and its memory plan.
 *
 * Every worker starts the same way; what differs per tier (encoder, prefill, decode) is a table of
 * hooks, as a backend is a table of ops:
 *
 *   flags     the tier's flags, the group's (tensor parallelism), every worker's; parse; logging,
 *             signals, config.json
 *   BLAS      prism_backend_cpu_blas_setup (before any other thread runs)
 *   group     shard: this rank's slice of the model, and whether it leads          tier->group->shard
 *   context   the tier's flags checked, its sizes (context, slots, pages, tiles)   tier->size
 *   backend   --device / --threads / --weight-dtype / --compute-dtype
 *   model     weights and activation arena on the backend                           tier->load
 *   plan      the memory plan: a table of regions, checked against --mem-budget    tier->plan (+ group)
 *   join      the leader's sockets (a rank: its group link), the group formed      tier->group->join
 *   pools     the plan's pool regions carved, the libraries' allocations made      tier->ready
 *   capacity  what registration advertises (a rank instead follows its leader)    tier->group->follow
 *   then      the I/O thread (registration), and the tier's loop                   tier->run
 *
 *   static const prism_worker_tier_t k_decode = {.role = "decode", .load = decode_load, ...};
 *   int main(int argc, char **argv)
 *   {
 *       static decode_t d;
 *       prism_worker_startup_t s = {.w = &d.w, .cfg = &d.cfg, .full = &d.full, .group = &d.tp};
 *       return prism_worker_main(&k_decode, &d, &s, argc, argv);
 *   }
 *
 * The memory plan is one table of regions {name, bytes, where}. It both totals the plan (what
 * --mem-budget is checked against and registration reports) and carves the tier's own pools: a
 * pool region names the pointer it fills (PRISM_PLAN_POOL), and prism_mem_plan_carve points every
 * one into a single zeroed host block. A pool gets memory only by being a region, so what a tier
 * allocates at start-up and what its plan says cannot drift apart. The other regions count what a
 * library allocates (the model's weights and arena, the KV cache, the sampler, the image decoder:
 * through the counting allocator, or on the device) and what is held outside our allocator (shared
 * libraries, ZeroMQ's queues, headroom). tests/integration/test_e2e.py compares the regions on the
 * heap with the heap each worker holds once started. */
#ifndef PRISM_WORKER_START_H
#define PRISM_WORKER_START_H

#include "worker/worker.h"
#include "model/model.h"

/* ---- the memory plan ---- */

typedef enum {
    PRISM_MEM_POOL,     /* carved from the plan's host block: *at points at it after prism_mem_plan_carve */
    PRISM_MEM_LIBRARY,  /* allocated by a library through the counting allocator (or on the device) */
    PRISM_MEM_OUTSIDE,  /* not our allocator's: shared libraries, ZeroMQ's queues, headroom */
} prism_mem_kind_t;

typedef struct {
    const char *name;
    size_t bytes;
    prism_mem_kind_t kind;
    void **at;               /* PRISM_MEM_POOL: the pointer the region's address goes to */
} prism_mem_region_t;

#define PRISM_PLAN_MAX 40
#define PRISM_PLAN_ALIGN 64   /* every pool starts on a cache line */
typedef struct {
    prism_mem_region_t r[PRISM_PLAN_MAX];
    int n;
    size_t budget;           /* 0 = no budget given: the plan is logged, nothing refused */
    void *block;             /* the carved pools (one allocation; NULL before the carve) */
} prism_mem_plan_t;

/* A region another library allocates (LIBRARY) or that is not ours (OUTSIDE). 0 bytes: no region. */
void   prism_mem_plan_add(prism_mem_plan_t *p, const char *name, size_t bytes, prism_mem_kind_t kind);
/* A pool: `bytes` of zeroed host memory whose address prism_mem_plan_carve stores in *at (which
 * stays NULL for 0 bytes). PRISM_PLAN_POOL sizes it from the pointer's type. */
void   prism_mem_plan_pool(prism_mem_plan_t *p, const char *name, void **at, size_t bytes);
#define PRISM_PLAN_POOL(plan, name, ptr, count) \
    prism_mem_plan_pool((plan), (name), (void **)&(ptr), (size_t)(count) * sizeof(*(ptr)))
/* Changes a region's bytes (a group agreed on fewer KV blocks than this rank planned). */
void   prism_mem_plan_set(prism_mem_plan_t *p, const char *name, size_t bytes);
size_t prism_mem_plan_total(const prism_mem_plan_t *p);
/* Logs the plan (each region with its exact bytes and kind, then the total); PRISM_ENOMEM (with a
 * message naming the numbers) when it exceeds the budget. */
int    prism_mem_plan_check(const prism_mem_plan_t *p, const char *who);
/* One zeroed host block for every pool region (pages are touched only when used), each region
 * PRISM_PLAN_ALIGN-aligned, its address stored in *at. PRISM_ENOMEM when it cannot be had. */
int    prism_mem_plan_carve(prism_mem_plan_t *p);
void   prism_mem_plan_free(prism_mem_plan_t *p);
/* Resident memory the process holds outside our own allocator (shared libraries and their static
 * state — the CUDA libraries alone are ~150 MiB — the BLAS thread buffers, mapped files): RSS
 * minus the heap prism_malloc accounts for. Measured after loading the model so the plan covers
 * what the process really costs. */
size_t prism_mem_runtime_bytes(void);
#define PRISM_MEM_RESERVE ((size_t)32 << 20)  /* later growth: BLAS buffers on first use, sockets */

/* ---- start-up ---- */

struct prism_llm;
struct prism_kv_cache;
struct prism_net;

/* What start-up knows, handed to every hook. The tier sets the first four before
 * prism_worker_open; the hooks fill the ones marked "tier". */
typedef struct prism_worker_startup {
    prism_worker_t *w;                /* the worker: its sockets, on the leader (join) */
    prism_model_config_t *cfg;        /* the model as this process runs it (a rank: its shard) */
    prism_model_config_t *full;       /* the whole model (the KV layout between tiers); NULL: cfg */
    void *group;                      /* the tier's group (tier->group's state: a prism_tp_t) */

    prism_worker_opts_t o;            /* every worker's flags, parsed */
    bool leader;                      /* rank 0 of a group, or the one process (before `size`) */
    prism_backend_t *be;              /* before `load` */
    prism_mem_plan_t plan;            /* `plan` fills it, pools carved before `ready` */
    struct prism_net *rank_net;       /* a rank's own net (only its group link) */

    bool data_socket;                 /* tier: it binds a data socket (prefill, decode) ... */
    size_t data_max_msg_bytes;        /* ... whose frames are at most this large */
    prism_worker_capacity_t cap;      /* tier: what registration advertises (mem_planned: the plan's) */
    /* tier, with a group: what the ranks agree on (cap.kv_blocks, cap.block_size and these) and run */
    int max_blocks_per_seq, batch_seqs, batch_tokens;
    struct prism_llm *llm;
    struct prism_kv_cache *kv;
    float *logits;                    /* [batch_seqs][vocab] */
} prism_worker_startup_t;

/* Tensor parallelism as start-up sees it. A tier that may run as a group of processes names the
 * group's steps (tp/tp.h: prism_tp_group); NULL: one process, its own leader. Each step reads and
 * writes the start-up state; s->group is the tier's group. */
typedef struct prism_worker_group_i {
    /* Appends the group's flags to t after its n entries; returns the new count. */
    int    (*flags)(void *group, prism_flag_t *t, int n);
    /* After config.json: checks the flags, keeps the whole model in *s->full, makes *s->cfg this
     * rank's shard and sets s->leader. PRISM_EINVAL (logged): exit 2. */
    int    (*shard)(prism_worker_startup_t *s);
    /* Adds the group's regions to s->plan (nothing for a group of one). */
    void   (*plan)(prism_worker_startup_t *s);
    /* Forms the group over the leader's or the rank's net and agrees on capacity:
     * s->cap.kv_blocks becomes the smallest rank's; sets s->cap.tp_size. */
    int    (*join)(prism_worker_startup_t *s);
    /* A rank's life once its pools exist: follows the leader; returns the exit code. */
    int    (*follow)(prism_worker_startup_t *s);
    /* Leaves the group; the leader's clean stop first tells the ranks to exit (stop_ranks). */
    void   (*close)(void *group, bool stop_ranks);
} prism_worker_group_i;

/* A tier's start-up: each hook returns -1 to go on, or the process's exit code (2: bad flags,
 * 1: anything else), having logged why. ctx is the tier's state. */
typedef struct prism_worker_tier {
    const char *role;                 /* "encoder" | "prefill" | "decode": logs, flags, keys */
    Prism__Role proto_role;
    const char *summary;              /* --help */
    /* The tier's flags into t (zeroed, room for PRISM_WORKER_TIER_FLAGS); returns how many. */
    int  (*flags)(void *ctx, prism_flag_t *t);
    /* After config.json and the group's shard: checks the tier's flags, sizes what needs no model. */
    int  (*size)(void *ctx, prism_worker_startup_t *s);
    /* The model on s->be (and what is measured rather than sized: the sampler). */
    int  (*load)(void *ctx, prism_worker_startup_t *s);
    /* The tier's regions. The plan already holds start-up's own (backend, group, runtime, reserve),
     * so a region may take what the budget leaves (decode's KV blocks). */
    int  (*plan)(void *ctx, prism_worker_startup_t *s);
    /* Pools carved (and the group formed): the libraries' allocations (KV cache, decoder, caches),
     * the pools wired, s->cap filled; on the leader the model's between-layer hook. */
    int  (*ready)(void *ctx, prism_worker_startup_t *s);
    /* The leader's life once its I/O thread runs (registration): the loop, then what only the tier
     * holds closed. Returns the exit code; then start-up's side closes: the group (a clean exit stops
     * its ranks) and the worker (after a failure, its last error replies may linger 2 s). */
    int  (*run)(void *ctx);
    const prism_worker_group_i *group;   /* optional */
} prism_worker_tier_t;

#define PRISM_WORKER_TIER_FLAGS 24   /* room for a tier's flags */
#define PRISM_WORKER_GROUP_FLAGS 8   /* and for its group's */

/* Runs start-up (above) for tier t. Returns -1 with the worker built but not started (the I/O
 * thread, hence registration, starts with prism_worker_start), else the exit code: 0 after --help,
 * 2 for bad flags, 1 otherwise; a group's rank returns its exit code after following its leader. */
int prism_worker_open(const prism_worker_tier_t *t, void *ctx, prism_worker_startup_t *s, int argc, char **argv);
/* A worker process: prism_worker_open, then the I/O thread (prism_worker_start), then tier->run.
 * Returns the process's exit code. */
int prism_worker_main(const prism_worker_tier_t *t, void *ctx, prism_worker_startup_t *s, int argc, char **argv);

#endif
