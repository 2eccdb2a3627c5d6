/* What every worker process has besides its threads (io.c): signals, the common flags, the capacity it
 * registers with, its data endpoint. Start-up itself, and the memory plan, are in start.c. */
#include "worker/worker.h"

#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The first SIGTERM/SIGINT asks for a drain (the I/O thread runs it: io.c); a second one, or the end
 * of the drain, stops the compute thread's loop. Lock-free atomics: read by both threads, written by
 * the handler and by the I/O thread. */
static atomic_int g_signals, g_stop;
_Static_assert(ATOMIC_INT_LOCK_FREE == 2, "signal handlers need lock-free atomics");

static void on_signal(int sig)
{
    (void)sig;
    if (atomic_fetch_add(&g_signals, 1) >= 1) atomic_store(&g_stop, 1);
}

void prism_worker_install_signals(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
}

bool prism_worker_should_stop(void) { return atomic_load(&g_stop) != 0; }

int prism_worker_signals(void) { return PRISM_MIN(atomic_load(&g_signals), 2); }

void prism_worker_request_stop(void) { atomic_store(&g_stop, 1); }

/* ---------------------------------------------------------------- options */

void prism_worker_opts_defaults(prism_worker_opts_t *o, const char *role)
{
    memset(o, 0, sizeof(*o));
    o->model_path = "models/prism-tiny-llava";
    o->host = "127.0.0.1";
    o->data_port = 0;
    o->device = "cpu";
    o->threads = 1;
    o->weight_dtype = "auto";
    o->compute_dtype = "auto";
    o->mem_budget = 0;
    o->log_level = "info";
    o->log_format = "text";
    o->heartbeat_s = 1.0;
    o->router_resolve_s = 5.0;
    o->max_message_bytes = 64ll << 20;
    o->drain_timeout_s = 30.0;
    static char id[128];
    char host[64] = "host";
    gethostname(host, sizeof(host) - 1);
    snprintf(id, sizeof(id), "%s-%s-%d", role, host, (int)getpid());
    o->worker_id = id;
}

int prism_worker_opts_flags(prism_worker_opts_t *o, prism_flag_t *t, int n)
{
    prism_flag_t f[] = {
        PRISM_FLAG_STR("model-path", &o->model_path, "HF model directory (config.json, *.safetensors)"),
        PRISM_FLAG_LIST("router", &o->routers, "Router control endpoint(s), e.g. tcp://127.0.0.1:8100 (repeatable)"),
        PRISM_FLAG_STR("worker-id", &o->worker_id, "Unique worker id"),
        PRISM_FLAG_STR("host", &o->host, "Address to bind the data endpoint on (0.0.0.0: every interface)"),
        PRISM_FLAG_INT("data-port", &o->data_port, "Data endpoint port (0 = pick a free port)"),
        PRISM_FLAG_STR("advertise-host", &o->advertise_host,
                       "Host or address peers reach the data endpoint at, when it differs from --host (NAT, "
                       "containers; required with a wildcard --host)"),
        PRISM_FLAG_INT("advertise-port", &o->advertise_port, "Port peers reach the data endpoint at (0 = the bound port)"),
        PRISM_FLAG_DOUBLE("router-resolve-interval", &o->router_resolve_s,
                          "Seconds between DNS lookups of a --router host name (each address is a router)"),
        PRISM_FLAG_STR("device", &o->device, "Compute device: cpu or cuda"),
        PRISM_FLAG_INT("threads", &o->threads, "CPU backend threads"),
        PRISM_FLAG_STR("weight-dtype", &o->weight_dtype,
                       "Matmul weights and embeddings stored as: auto (the device's own: bf16 on cuda; on cpu "
                       "bf16 when every matrix of the checkpoint is bf16, which keeps them exactly, else f32), "
                       "f32 or bf16 (on cpu: half the memory and the bytes a decode step reads; fp32 "
                       "arithmetic on bf16-rounded weights)"),
        PRISM_FLAG_STR("compute-dtype", &o->compute_dtype,
                       "Matmul arithmetic: auto (the device's own: f32 on cpu, bf16 on cuda), f32, or bf16 (x rounded "
                       "to bf16, products summed in fp32; implies --weight-dtype bf16; on cpu: AVX-512 BF16 dot "
                       "products, about 2-4x the matmul speed of f32, emulated with a warning on a CPU without them)"),
        PRISM_FLAG_BYTES("mem-budget", &o->mem_budget, "Memory budget (bytes, e.g. 2G); start-up fails if the plan exceeds it"),
        PRISM_FLAG_STR("log-level", &o->log_level, "debug, info, warn or error"),
        PRISM_FLAG_STR("log-format", &o->log_format,
                       "text, or json: one object per line (time, level, process, worker_id, request_id, trace_id, "
                       "message)"),
        PRISM_FLAG_DOUBLE("heartbeat-interval", &o->heartbeat_s, "Seconds between heartbeats"),
        PRISM_FLAG_BOOL("random-weights", &o->random_weights,
                        "Seeded random weights of config.json's shapes instead of safetensors (benchmarks)"),
        PRISM_FLAG_STR("curve-keys", &o->curve_keys,
                       "CURVE key directory (made by prism_keygen): this role's secret key and the cluster's public keys"),
        PRISM_FLAG_BOOL("insecure-no-curve", &o->insecure_no_curve,
                        "Unauthenticated internal links (only on an isolated network; logs a warning)"),
        PRISM_FLAG_BYTES("max-message-bytes", &o->max_message_bytes,
                         "Largest message accepted from a router (an image file for encoders); bigger drops the link"),
        PRISM_FLAG_DOUBLE("drain-timeout", &o->drain_timeout_s,
                          "SIGTERM drains: no new work, the held requests finish, exit when the routers release "
                          "this worker or after this many seconds (a second SIGTERM exits at once)"),
    };
    _Static_assert(sizeof(f) / sizeof(f[0]) == PRISM_WORKER_N_FLAGS, "PRISM_WORKER_N_FLAGS");
    for (size_t i = 0; i < PRISM_ARRAY_LEN(f); i++)
        t[n++] = f[i];
    t[n] = (prism_flag_t)PRISM_FLAG_END;
    return n;
}

void prism_worker_set_capacity(prism_worker_t *w, const prism_worker_opts_t *o, const prism_worker_capacity_t *c)
{
    w->heartbeat_s = o->heartbeat_s;
    w->router_resolve_s = o->router_resolve_s;
    w->drain_timeout_s = o->drain_timeout_s;
    if (w->data_sock && ((o->advertise_host && *o->advertise_host) || o->advertise_port > 0)) {
        /* The bound endpoint is tcp://HOST:PORT as the socket sees it; peers behind NAT or in
         * another network namespace reach it under another host (and port). */
        const char *colon = strrchr(w->data_endpoint, ':');
        long port = colon ? strtol(colon + 1, NULL, 10) : 0;
        char ep[sizeof(w->data_endpoint)];
        snprintf(ep, sizeof(ep), "tcp://%s:%ld", o->advertise_host && *o->advertise_host ? o->advertise_host : o->host,
                 o->advertise_port > 0 ? (long)o->advertise_port : port);
        PRISM_INFO("data endpoint %s advertised as %s", w->data_endpoint, ep);
        snprintf(w->data_endpoint, sizeof(w->data_endpoint), "%s", ep);
    }
    w->reg.mem_budget = (uint64_t)o->mem_budget;
    w->reg.mem_planned = c->mem_planned;
    w->reg.kv_blocks = c->kv_blocks;
    w->reg.block_size = c->block_size;
    w->reg.max_batch_tokens = c->max_batch_tokens;
    w->reg.max_running = c->max_running;
    w->reg.max_model_len = c->max_model_len;
    w->reg.tp_size = c->tp_size ? c->tp_size : 1;
    w->reg.max_queued_bytes = c->max_queued_bytes;         /* the router keeps the queue's files under it */
    w->reg.embedding_cache_units = c->embedding_cache_units;   /* 0: the router sends no early jobs */
}

void prism_worker_data_bind(const prism_worker_opts_t *o, char *out, size_t n)
{
    if (o->data_port > 0) snprintf(out, n, "tcp://%s:%lld", o->host, (long long)o->data_port);
    else snprintf(out, n, "tcp://%s:*", o->host);
}
