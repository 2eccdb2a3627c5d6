/* Worker start-up, once for every tier (the steps: start.h), and the memory plan's table. */
#include "worker/start.h"
#include "model/safetensors.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* ---------------------------------------------------------------- memory plan */

static const char *const k_kind_names[] = {"pool", "library", "outside"};

static void plan_push(prism_mem_plan_t *p, const char *name, size_t bytes, prism_mem_kind_t kind, void **at)
{
    if (!bytes) return;
    PRISM_ASSERT(p->n < PRISM_PLAN_MAX && !p->block);
    p->r[p->n++] = (prism_mem_region_t){name, bytes, kind, at};
}

void prism_mem_plan_add(prism_mem_plan_t *p, const char *name, size_t bytes, prism_mem_kind_t kind)
{
    PRISM_ASSERT(kind != PRISM_MEM_POOL);
    plan_push(p, name, bytes, kind, NULL);
}

void prism_mem_plan_pool(prism_mem_plan_t *p, const char *name, void **at, size_t bytes)
{
    *at = NULL;
    plan_push(p, name, bytes, PRISM_MEM_POOL, at);
}

void prism_mem_plan_set(prism_mem_plan_t *p, const char *name, size_t bytes)
{
    for (int i = 0; i < p->n; i++)
        if (!strcmp(p->r[i].name, name)) {
            PRISM_ASSERT(p->r[i].kind != PRISM_MEM_POOL || !p->block);
            p->r[i].bytes = bytes;
            return;
        }
    PRISM_FATAL("memory plan: no region '%s'", name);
}

size_t prism_mem_plan_total(const prism_mem_plan_t *p)
{
    size_t t = 0;
    for (int i = 0; i < p->n; i++) t += p->r[i].bytes;
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
    /* exact bytes too: tests add the regions up against the heap the worker holds */
    for (int i = 0; i < p->n; i++)
        PRISM_INFO("%s memory plan: %-18s %12s %-8s (%zu bytes)", who, p->r[i].name,
                   prism_fmt_bytes(p->r[i].bytes, a, sizeof(a)), k_kind_names[p->r[i].kind], p->r[i].bytes);
    PRISM_INFO("%s memory plan: %-18s %12s (%zu bytes) of budget %s", who, "total", prism_fmt_bytes(total, a, sizeof(a)),
               total, p->budget ? prism_fmt_bytes(p->budget, b, sizeof(b)) : "(none)");
    if (p->budget && total > p->budget) {
        PRISM_ERROR("%s: the memory plan needs %s (%zu bytes) but --mem-budget is %s (%zu bytes); "
                    "raise --mem-budget or lower the pool sizes", who, prism_fmt_bytes(total, a, sizeof(a)), total,
                    prism_fmt_bytes(p->budget, b, sizeof(b)), p->budget);
        return PRISM_ENOMEM;
    }
    return PRISM_OK;
}

int prism_mem_plan_carve(prism_mem_plan_t *p)
{
    size_t bytes = 0;
    for (int i = 0; i < p->n; i++)
        if (p->r[i].kind == PRISM_MEM_POOL) bytes = PRISM_ALIGN_UP(bytes, PRISM_PLAN_ALIGN) + p->r[i].bytes;
    if (!bytes) return PRISM_OK;
    /* calloc: the C library maps fresh zero pages for a block this size, so a pool's pages are
     * touched (resident) only once it is used, as with a separate allocation per pool */
    uint8_t *raw = prism_calloc(1, bytes + PRISM_PLAN_ALIGN);
    if (!raw) return PRISM_ENOMEM;
    p->block = raw;
    uint8_t *base = (uint8_t *)PRISM_ALIGN_UP((uintptr_t)raw, PRISM_PLAN_ALIGN);
    size_t off = 0;
    for (int i = 0; i < p->n; i++) {
        if (p->r[i].kind != PRISM_MEM_POOL) continue;
        off = PRISM_ALIGN_UP(off, PRISM_PLAN_ALIGN);
        *p->r[i].at = base + off;
        off += p->r[i].bytes;
    }
    return PRISM_OK;
}

void prism_mem_plan_free(prism_mem_plan_t *p)
{
    for (int i = 0; p->block && i < p->n; i++)
        if (p->r[i].kind == PRISM_MEM_POOL) *p->r[i].at = NULL;
    prism_free(p->block);
    p->block = NULL;
}

/* ---------------------------------------------------------------- steps */

/* Flags (the table holds the tier's and the group's entries; every worker's are appended), logging,
 * signals, config.json. -1 to go on, else the exit code. */
static int parse(int argc, char **argv, const prism_worker_tier_t *t, prism_flag_t *flags, prism_worker_startup_t *s)
{
    prism_worker_opts_t *o = &s->o;
    int n_own = 0;
    while (flags[n_own].name) n_own++;
    prism_worker_opts_flags(o, flags, n_own);
    char prog[64];
    snprintf(prog, sizeof(prog), "%s_worker", t->role);
    int rc = prism_cli_parse(argc, argv, prog, t->summary, flags);
    if (rc) return rc > 0 ? 0 : 2;
    prism_log_init(t->role, prism_log_level_parse(o->log_level));
    prism_log_format_t lf;
    if (prism_log_format_parse(o->log_format, &lf) != PRISM_OK) {
        PRISM_ERROR("--log-format must be text or json");
        return 2;
    }
    prism_log_set_format(lf);
    prism_log_set_worker(o->worker_id);
    if (!(o->heartbeat_s >= 0.01 && o->heartbeat_s <= 3600)) {
        PRISM_ERROR("--heartbeat-interval must be between 0.01 and 3600 seconds");
        return 2;
    }
    bool wildcard = !strcmp(o->host, "0.0.0.0") || !strcmp(o->host, "*") || !strcmp(o->host, "::");
    if (strcmp(t->role, "encoder") != 0 && wildcard && !(o->advertise_host && *o->advertise_host)) {
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
    if (strcmp(o->compute_dtype, "auto") && strcmp(o->compute_dtype, "f32") && strcmp(o->compute_dtype, "bf16")) {
        PRISM_ERROR("--compute-dtype must be auto, f32 or bf16");
        return 2;
    }
    if (!strcmp(o->compute_dtype, "bf16") && !strcmp(o->weight_dtype, "f32")) {
        PRISM_ERROR("--compute-dtype bf16 multiplies bf16 weights: it contradicts --weight-dtype f32 (drop it, or "
                    "give --weight-dtype bf16)");
        return 2;
    }
    prism_worker_install_signals();
    char err[512] = "";
    if (prism_model_config_load(o->model_path, s->cfg, err, sizeof(err)) != PRISM_OK) {
        PRISM_ERROR("cannot load model config from %s: %s", o->model_path, err);
        return 1;
    }
    s->cfg->random_weights = o->random_weights;
    s->cfg->random_seed = 1234;
    if (s->full != s->cfg) *s->full = *s->cfg;
    return -1;
}

/* Whether every matrix of the checkpoint at path is stored as bf16: then bf16 storage holds
 * exactly the weights HF computes with. A checkpoint that cannot be read answers false here; the
 * model load says why. */
static bool checkpoint_is_bf16(const char *path)
{
    prism_st_t *st;
    char err[256];
    if (prism_st_open_dir(path, &st, err, sizeof err) != PRISM_OK) return false;
    prism_st_dtype_t dt;
    bool bf16 = prism_st_matrix_dtype(st, &dt) == PRISM_OK && dt == PRISM_ST_BF16;
    prism_st_close(st);
    return bf16;
}

/* The compute backend of --device and --threads, storing weights as --weight-dtype and computing
 * matmuls in --compute-dtype (bf16 implies bf16 weights). --weight-dtype auto is the device's own,
 * except that a device keeping fp32 (the CPU) keeps a bf16 checkpoint as bf16: the same weights,
 * half the memory and half the bytes a decode step reads. */
static int backend_create(const prism_worker_opts_t *o, prism_backend_t **out)
{
    if (prism_backend_create(o->device, (int)o->threads, 0, out) != PRISM_OK) {
        PRISM_ERROR("cannot create backend '%s'", o->device);
        return 1;
    }
    bool autodt = strcmp(o->weight_dtype, "auto") == 0;
    if (!autodt || ((*out)->weight_dtype == PRISM_DTYPE_F32 && !o->random_weights && checkpoint_is_bf16(o->model_path))) {
        prism_dtype_t dt = autodt || strcmp(o->weight_dtype, "bf16") == 0 ? PRISM_DTYPE_BF16 : PRISM_DTYPE_F32;
        if (prism_backend_set_weight_dtype(*out, dt) == PRISM_OK)
            PRISM_INFO("weights stored as %s%s", prism_dtype_name(dt), autodt ? " (the checkpoint's own dtype)" : "");
        else if (!autodt) {
            PRISM_ERROR("--weight-dtype %s is not supported on %s (it stores weights as %s)", o->weight_dtype,
                        (*out)->device, prism_dtype_name((*out)->weight_dtype));
            return 1;
        }
    }
    if (strcmp(o->compute_dtype, "auto") != 0) {
        prism_dtype_t dt = strcmp(o->compute_dtype, "bf16") == 0 ? PRISM_DTYPE_BF16 : PRISM_DTYPE_F32;
        if (prism_backend_set_compute_dtype(*out, dt) != PRISM_OK) {
            PRISM_ERROR("--compute-dtype %s is not supported on %s (its matmuls compute in %s)", o->compute_dtype,
                        (*out)->device, prism_dtype_name((*out)->compute_dtype));
            return 1;
        }
        PRISM_INFO("matmuls compute in %s (weights stored as %s)", prism_dtype_name(dt),
                   prism_dtype_name((*out)->weight_dtype));
    }
    return -1;
}

/* The leader's worker (its sockets: routers, and the data socket when the tier takes data), or a
 * rank's own net for its group link; then the group. Nothing registers yet. */
static int join(const prism_worker_tier_t *t, prism_worker_startup_t *s)
{
    if (s->leader) {
        char bind[300];
        prism_worker_data_bind(&s->o, bind, sizeof(bind));
        if (prism_worker_init(s->w, t->proto_role, &s->o, s->data_socket ? bind : NULL, s->data_max_msg_bytes) !=
            PRISM_OK)
            return 1;
    } else {
        char err[512] = "";
        prism_net_opts_t no = {.role = prism_net_role_parse(t->role), .curve_keys = s->o.curve_keys,
                               .insecure = s->o.insecure_no_curve};
        if (prism_net_create(&no, &s->rank_net, err, sizeof err) != PRISM_OK) {
            PRISM_ERROR("%s", err);
            return 1;
        }
    }
    if (t->group && t->group->join(s) != PRISM_OK) return 1;
    return -1;
}

int prism_worker_open(const prism_worker_tier_t *t, void *ctx, prism_worker_startup_t *s, int argc, char **argv)
{
    /* flags */
    prism_worker_opts_defaults(&s->o, t->role);
    if (!s->full) s->full = s->cfg;
    prism_flag_t flags[PRISM_WORKER_TIER_FLAGS + PRISM_WORKER_GROUP_FLAGS + PRISM_WORKER_N_FLAGS + 1];
    memset(flags, 0, sizeof flags);
    int n = t->flags(ctx, flags);
    PRISM_ASSERT(n <= PRISM_WORKER_TIER_FLAGS);
    if (t->group) n = t->group->flags(s->group, flags, n);
    PRISM_ASSERT(n <= PRISM_WORKER_TIER_FLAGS + PRISM_WORKER_GROUP_FLAGS);
    int rc = parse(argc, argv, t, flags, s);
    if (rc >= 0) return rc;
    /* BLAS */
    prism_backend_cpu_blas_setup();   /* while no other thread runs: it may set an environment variable */
    /* group */
    s->leader = true;
    if (t->group && t->group->shard(s) != PRISM_OK) return 2;
    /* context */
    if ((rc = t->size(ctx, s)) >= 0) return rc;
    /* backend: what it keeps on the heap (scratch per thread) is measured into the plan */
    size_t heap0 = prism_mem_used();
    if ((rc = backend_create(&s->o, &s->be)) >= 0) return rc;
    size_t backend_bytes = prism_mem_used() - heap0;
    /* model */
    if ((rc = t->load(ctx, s)) >= 0) return rc;
    /* plan */
    s->plan.budget = (size_t)s->o.mem_budget;
    prism_mem_plan_add(&s->plan, "backend", backend_bytes, PRISM_MEM_LIBRARY);
    if (t->group) t->group->plan(s);
    prism_mem_plan_add(&s->plan, "runtime", prism_mem_runtime_bytes(), PRISM_MEM_OUTSIDE);
    prism_mem_plan_add(&s->plan, "reserve", PRISM_MEM_RESERVE, PRISM_MEM_OUTSIDE);
    if ((rc = t->plan(ctx, s)) >= 0) return rc;
    if (prism_mem_plan_check(&s->plan, t->role) != PRISM_OK) return 1;
    /* join */
    if ((rc = join(t, s)) >= 0) return rc;
    /* pools */
    if (prism_mem_plan_carve(&s->plan) != PRISM_OK) {
        PRISM_ERROR("%s: cannot allocate the worker's pools", t->role);
        return 1;
    }
    if ((rc = t->ready(ctx, s)) >= 0) return rc;
    /* What the plan says is allocated against what the counting allocator saw (equal but for the
     * libraries' bookkeeping when the backend's memory is the heap, as on the CPU). */
    size_t allocated = 0;
    for (int i = 0; i < s->plan.n; i++) allocated += s->plan.r[i].kind != PRISM_MEM_OUTSIDE ? s->plan.r[i].bytes : 0;
    PRISM_INFO("%s memory plan: pools and libraries %zu bytes; heap in use after start-up %zu bytes", t->role,
               allocated, prism_mem_used());
    if (!s->leader) {
        int code = t->group->follow(s);
        t->group->close(s->group, false);
        prism_net_destroy(s->rank_net);
        return code;
    }
    /* capacity */
    s->cap.mem_planned = prism_mem_plan_total(&s->plan);
    prism_worker_set_capacity(s->w, &s->o, &s->cap);
    return -1;
}

int prism_worker_main(const prism_worker_tier_t *t, void *ctx, prism_worker_startup_t *s, int argc, char **argv)
{
    double t0 = prism_now_s();
    int rc = prism_worker_open(t, ctx, s, argc, argv);
    if (rc >= 0) return rc;
    if (prism_worker_start(s->w) != PRISM_OK) return 1;   /* registration: a group has formed */
    PRISM_INFO("%s worker %s ready in %.2fs%s%s", t->role, s->w->worker_id, prism_now_s() - t0,
               s->data_socket ? ": data " : "", s->data_socket ? s->w->data_endpoint : "");
    int code = t->run(ctx);
    if (t->group) t->group->close(s->group, code == 0);
    if (code) prism_worker_close_linger(s->w, 2000);   /* the error replies of a failure reach the routers */
    prism_worker_close(s->w);
    return code;
}
