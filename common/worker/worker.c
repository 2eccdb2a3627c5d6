/* Worker start-up: flags, signals, the memory plan, capacity. The threads and sockets are in io.c. */
#include "worker/worker.h"
#include "model/model.h"

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

/* ---------------------------------------------------------------- memory plan */

void prism_mem_plan_add(prism_mem_plan_t *p, const char *name, size_t bytes)
{
    PRISM_ASSERT(p->n < PRISM_PLAN_MAX);
    p->name[p->n] = name;
    p->bytes[p->n] = bytes;
    p->n++;
}

size_t prism_mem_plan_total(const prism_mem_plan_t *p)
{
    size_t t = 0;
    for (int i = 0; i < p->n; i++) t += p->bytes[i];
    return t;
}

size_t prism_mem_runtime_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long long size = 0, resident = 0;
    if (!f) return 0;
    if (fscanf(f, "%llu %llu", &size, &resident) != 2) resident = 0;
    fclose(f);
    size_t rss = (size_t)resident * (size_t)sysconf(_SC_PAGESIZE), heap = prism_mem_used();
    return rss > heap ? rss - heap : 0;
}

int prism_mem_plan_check(const prism_mem_plan_t *p, const char *who)
{
    char a[32], b[32];
    size_t total = prism_mem_plan_total(p);
    for (int i = 0; i < p->n; i++)
        PRISM_INFO("%s memory plan: %-18s %s", who, p->name[i], prism_fmt_bytes(p->bytes[i], a, sizeof(a)));
    PRISM_INFO("%s memory plan: %-18s %s of budget %s", who, "total", prism_fmt_bytes(total, a, sizeof(a)),
               p->budget ? prism_fmt_bytes(p->budget, b, sizeof(b)) : "(none)");
    if (p->budget && total > p->budget) {
        PRISM_ERROR("%s: the memory plan needs %s (%zu bytes) but --mem-budget is %s (%zu bytes); "
                    "raise --mem-budget or lower the pool sizes", who, prism_fmt_bytes(total, a, sizeof(a)), total,
                    prism_fmt_bytes(p->budget, b, sizeof(b)), p->budget);
        return PRISM_ENOMEM;
    }
    return PRISM_OK;
}

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
    o->mem_budget = 0;
    o->log_level = "info";
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
                       "Matmul weights and embeddings stored as: auto (the device's own: f32 on cpu, bf16 on "
                       "cuda), f32 or bf16 (on cpu: half the memory and the bytes a decode step reads; fp32 "
                       "arithmetic on bf16-rounded weights)"),
        PRISM_FLAG_BYTES("mem-budget", &o->mem_budget, "Memory budget (bytes, e.g. 2G); start-up fails if the plan exceeds it"),
        PRISM_FLAG_STR("log-level", &o->log_level, "debug, info, warn or error"),
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

int prism_worker_startup(int argc, char **argv, const char *role, const char *summary, prism_flag_t *flags,
                         prism_worker_opts_t *o, struct prism_model_config *cfg)
{
    int n_own = 0;
    while (flags[n_own].name) n_own++;
    prism_worker_opts_flags(o, flags, n_own);
    char prog[64];
    snprintf(prog, sizeof(prog), "%s_worker", role);
    int rc = prism_cli_parse(argc, argv, prog, summary, flags);
    if (rc) return rc > 0 ? 0 : 2;
    prism_log_init(role, prism_log_level_parse(o->log_level));
    if (!(o->heartbeat_s >= 0.01 && o->heartbeat_s <= 3600)) {
        PRISM_ERROR("--heartbeat-interval must be between 0.01 and 3600 seconds");
        return 2;
    }
    bool wildcard = !strcmp(o->host, "0.0.0.0") || !strcmp(o->host, "*") || !strcmp(o->host, "::");
    if (strcmp(role, "encoder") != 0 && wildcard && !(o->advertise_host && *o->advertise_host)) {
        PRISM_ERROR("--host %s binds every interface, which peers cannot connect to: give --advertise-host with "
                    "the address they reach this worker at", o->host);
        return 2;
    }
    if (o->advertise_port < 0 || o->advertise_port > 65535 || !(o->router_resolve_s > 0) || !(o->drain_timeout_s >= 0)) {
        PRISM_ERROR("--advertise-port must be 0..65535, --router-resolve-interval positive, --drain-timeout >= 0");
        return 2;
    }
    if (!o->insecure_no_curve == !(o->curve_keys && *o->curve_keys)) {  /* fail before loading a model */
        PRISM_ERROR("%s", o->insecure_no_curve ? "--curve-keys and --insecure-no-curve contradict each other: give one"
                          : "internal links are authenticated with CURVE keys: give --curve-keys DIR (create one with "
                            "`prism_keygen --out DIR`), or --insecure-no-curve on a trusted, isolated network");
        return 2;
    }
    if (strcmp(o->weight_dtype, "auto") && strcmp(o->weight_dtype, "f32") && strcmp(o->weight_dtype, "bf16")) {
        PRISM_ERROR("--weight-dtype must be auto, f32 or bf16");
        return 2;
    }
    prism_worker_install_signals();
    char err[512] = "";
    if (prism_model_config_load(o->model_path, cfg, err, sizeof(err)) != PRISM_OK) {
        PRISM_ERROR("cannot load model config from %s: %s", o->model_path, err);
        return 1;
    }
    cfg->random_weights = o->random_weights;
    cfg->random_seed = 1234;
    return -1;
}

int prism_worker_backend_create(const prism_worker_opts_t *o, prism_backend_t **out)
{
    if (prism_backend_create(o->device, (int)o->threads, 0, out) != PRISM_OK) {
        PRISM_ERROR("cannot create backend '%s'", o->device);
        return 1;
    }
    if (strcmp(o->weight_dtype, "auto") == 0) return 0;
    prism_dtype_t dt = strcmp(o->weight_dtype, "bf16") == 0 ? PRISM_DTYPE_BF16 : PRISM_DTYPE_F32;
    if (prism_backend_set_weight_dtype(*out, dt) != PRISM_OK) {
        PRISM_ERROR("--weight-dtype %s is not supported on %s (it stores weights as %s)", o->weight_dtype,
                    (*out)->device, prism_dtype_name((*out)->weight_dtype));
        return 1;
    }
    PRISM_INFO("weights stored as %s", prism_dtype_name(dt));
    return 0;
}

void prism_worker_set_capacity(prism_worker_t *w, const prism_worker_opts_t *o, const prism_mem_plan_t *plan,
                               uint32_t kv_blocks, uint32_t block_size, uint32_t max_batch_tokens,
                               uint32_t max_running, uint32_t max_model_len)
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
    w->reg.mem_planned = prism_mem_plan_total(plan);
    w->reg.kv_blocks = kv_blocks;
    w->reg.block_size = block_size;
    w->reg.max_batch_tokens = max_batch_tokens;
    w->reg.max_running = max_running;
    w->reg.max_model_len = max_model_len;
    w->reg.tp_size = 1;
}

void prism_worker_data_bind(const prism_worker_opts_t *o, char *out, size_t n)
{
    if (o->data_port > 0) snprintf(out, n, "tcp://%s:%lld", o->host, (long long)o->data_port);
    else snprintf(out, n, "tcp://%s:*", o->host);
}
