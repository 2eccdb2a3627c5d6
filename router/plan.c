/* The router's memory plan: rows, their bounds, and the shares of the budget (plan.h). */
#include "plan.h"

#include <stdio.h>
#include <string.h>

static const char *const k_row_names[ROUTER_ROW_COUNT] = {
    [ROUTER_ROW_STARTUP] = "start-up",         [ROUTER_ROW_RESERVE] = "reserve",
    [ROUTER_ROW_CONNECTIONS] = "connections",  [ROUTER_ROW_BODIES] = "bodies in flight",
    [ROUTER_ROW_IMAGES] = "images held",       [ROUTER_ROW_EARLY] = "early encodes",
    [ROUTER_ROW_REQUESTS] = "requests",        [ROUTER_ROW_STREAMS] = "streams pending",
    [ROUTER_ROW_PARSING] = "parsing",          [ROUTER_ROW_FETCH] = "URL fetches",
    [ROUTER_ROW_PREFIX] = "prefix index",
};

/* The flag each bound row answers to (for messages). */
static const char *const k_row_flags[ROUTER_ROW_COUNT] = {
    [ROUTER_ROW_CONNECTIONS] = "--max-connections",           [ROUTER_ROW_BODIES] = "--max-body-bytes-in-flight",
    [ROUTER_ROW_IMAGES] = "--max-image-bytes-in-flight",      [ROUTER_ROW_EARLY] = "--max-early-encode-bytes",
    [ROUTER_ROW_REQUESTS] = "--max-running-requests",         [ROUTER_ROW_STREAMS] = "--max-stream-pending-bytes",
    [ROUTER_ROW_PARSING] = "--max-parse-bytes",               [ROUTER_ROW_FETCH] = "--media-fetch-max-inflight",
};

/* Shares of what the budget leaves, over the rows derived from it. Bodies and images take most: a
 * router in front of one node spends its memory on uploads in progress and on images waiting for
 * their first token. */
static const unsigned k_share[ROUTER_ROW_COUNT] = {
    [ROUTER_ROW_CONNECTIONS] = 14, [ROUTER_ROW_BODIES] = 26, [ROUTER_ROW_IMAGES] = 22, [ROUTER_ROW_EARLY] = 4,
    [ROUTER_ROW_STREAMS] = 8,      [ROUTER_ROW_PARSING] = 10, [ROUTER_ROW_FETCH] = 16,
};

/* Without a budget: the bounds the router had before it had one. */
#define OLD_MAX_CONNECTIONS 4096
#define OLD_MAX_BODY ((size_t)64 << 20)
#define OLD_BODIES ((size_t)1 << 30)
#define OLD_IMAGES ((size_t)1 << 30)
#define OLD_STREAM ((size_t)4 << 20)
#define OLD_PARSE ((size_t)96 << 20)
#define OLD_FETCH_INFLIGHT 64
#define OLD_FETCH_CACHE ((size_t)256 << 20)
#define BODY_READ_SLACK ((size_t)64 << 10)   /* one read past the budget per resumed body */
#define MIB ((size_t)1 << 20)

const char *router_plan_row_name(router_row_t row) { return k_row_names[row]; }

/* Each row from the bounds in p. */
static void rows_from_bounds(const router_plan_in_t *in, router_plan_t *p)
{
    p->bytes[ROUTER_ROW_STARTUP] = in->startup;
    p->bytes[ROUTER_ROW_RESERVE] = ROUTER_PLAN_RESERVE;
    p->bytes[ROUTER_ROW_CONNECTIONS] = (size_t)p->max_connections * in->conn_bytes;
    p->bytes[ROUTER_ROW_BODIES] = p->body_inflight + p->max_body + BODY_READ_SLACK;
    p->bytes[ROUTER_ROW_IMAGES] = p->image_inflight + p->max_body;
    p->bytes[ROUTER_ROW_EARLY] = p->early_bytes;
    p->bytes[ROUTER_ROW_REQUESTS] = (size_t)in->max_running * in->request_bytes;
    p->bytes[ROUTER_ROW_STREAMS] = (size_t)in->max_running * p->stream_pending;
    p->bytes[ROUTER_ROW_PARSING] = (size_t)in->prep_threads * in->parse_factor * p->parse_bound;
    p->bytes[ROUTER_ROW_FETCH] = in->fetch ? (size_t)p->fetch_inflight * in->fetch_max_bytes + p->fetch_cache : 0;
    p->bytes[ROUTER_ROW_PREFIX] = 0;
    p->total = 0;
    for (int i = 0; i < ROUTER_ROW_COUNT; i++) p->total += p->bytes[i];
}

/* The least a derived row may get: what makes its bound usable (a body of --max-body-bytes fits the
 * body budget; one connection's worth for 16 clients; one download). */
static size_t row_floor(const router_plan_in_t *in, const router_plan_t *p, router_row_t row)
{
    switch (row) {
    case ROUTER_ROW_CONNECTIONS: return 16 * in->conn_bytes;
    case ROUTER_ROW_BODIES:      return 2 * p->max_body + BODY_READ_SLACK;
    case ROUTER_ROW_IMAGES:      return p->max_body + MIB;
    case ROUTER_ROW_STREAMS:     return (size_t)in->max_running * (16 << 10);
    case ROUTER_ROW_PARSING:     return (size_t)in->prep_threads * in->parse_factor * MIB;
    case ROUTER_ROW_FETCH:       /* what was given of it, and at least one download */
        return in->fetch ? (size_t)PRISM_MAX(in->fetch_inflight, 1) * in->fetch_max_bytes +
                           (in->fetch_cache_set ? in->fetch_cache : 0) : 0;
    default:                     return 0;
    }
}

/* Derived byte bounds in whole 64 KiB (4 KiB below a MiB): what they lose is little, they read better. */
static size_t round_down(size_t bytes)
{
    size_t unit = bytes >= MIB ? (size_t)64 << 10 : (size_t)4 << 10;
    return bytes >= unit ? bytes / unit * unit : bytes;
}

/* A derived row's bytes turned into its bound (capped at the old default), and the row recounted. */
static void bound_from_row(const router_plan_in_t *in, router_plan_t *p, router_row_t row, size_t bytes)
{
    switch (row) {
    case ROUTER_ROW_CONNECTIONS:
        p->max_connections = (int64_t)PRISM_MIN(bytes / in->conn_bytes, (size_t)OLD_MAX_CONNECTIONS);
        break;
    case ROUTER_ROW_BODIES: p->body_inflight = PRISM_MIN(round_down(bytes - p->max_body - BODY_READ_SLACK), OLD_BODIES); break;
    case ROUTER_ROW_IMAGES: p->image_inflight = PRISM_MIN(round_down(bytes - p->max_body), OLD_IMAGES); break;
    case ROUTER_ROW_EARLY:  p->early_bytes = round_down(bytes); break;
    case ROUTER_ROW_STREAMS:
        p->stream_pending = PRISM_MIN(round_down(bytes / (size_t)in->max_running), OLD_STREAM);
        break;
    case ROUTER_ROW_PARSING:
        p->parse_bound = PRISM_MIN(round_down(bytes / ((size_t)in->prep_threads * in->parse_factor)), OLD_PARSE);
        break;
    case ROUTER_ROW_FETCH: {
        if (!in->fetch) break;
        size_t one = PRISM_MAX(in->fetch_max_bytes, (size_t)1);
        if (!in->fetch_inflight) {   /* three quarters of the row for downloads unless the cache was given */
            size_t for_dl = in->fetch_cache_set ? bytes - PRISM_MIN(bytes, in->fetch_cache) : bytes / 4 * 3;
            p->fetch_inflight = (int64_t)PRISM_MAX((size_t)1, PRISM_MIN(for_dl / one, (size_t)OLD_FETCH_INFLIGHT));
        }
        if (!in->fetch_cache_set) {
            size_t dl = (size_t)p->fetch_inflight * one;
            p->fetch_cache = PRISM_MIN(bytes > dl ? bytes - dl : 0, OLD_FETCH_CACHE);
        }
        break;
    }
    default: break;
    }
}

/* Whether row's bound was left to the budget. */
static bool row_is_derived(const router_plan_in_t *in, router_row_t row)
{
    switch (row) {
    case ROUTER_ROW_CONNECTIONS: return in->max_connections <= 0;
    case ROUTER_ROW_BODIES:      return !in->body_inflight;
    case ROUTER_ROW_IMAGES:      return !in->image_inflight;
    case ROUTER_ROW_EARLY:       return !in->early_bytes;
    case ROUTER_ROW_STREAMS:     return !in->stream_pending;
    case ROUTER_ROW_PARSING:     return !in->parse_bound;
    case ROUTER_ROW_FETCH:       return in->fetch && (!in->fetch_inflight || !in->fetch_cache_set);
    default:                     return false;
    }
}

int router_plan_make(const router_plan_in_t *in, router_plan_t *p, char *err, size_t n)
{
    memset(p, 0, sizeof *p);
    p->budget = in->budget;
    bool budget = in->budget > 0;
    /* explicit bounds as given; the others at their old defaults for now (without a budget, final) */
    p->max_connections = in->max_connections > 0 ? in->max_connections : OLD_MAX_CONNECTIONS;
    p->body_inflight = in->body_inflight ? in->body_inflight : OLD_BODIES;
    p->image_inflight = in->image_inflight ? in->image_inflight : OLD_IMAGES;
    p->early_bytes = in->early_bytes ? in->early_bytes : OLD_IMAGES;
    p->stream_pending = in->stream_pending ? in->stream_pending : OLD_STREAM;
    p->parse_bound = in->parse_bound ? in->parse_bound : OLD_PARSE;
    p->fetch_inflight = in->fetch_inflight > 0 ? in->fetch_inflight : OLD_FETCH_INFLIGHT;
    p->fetch_cache = in->fetch_cache_set ? in->fetch_cache : OLD_FETCH_CACHE;
    p->max_body = in->max_body ? in->max_body : OLD_MAX_BODY;
    if (budget && !in->max_body) {
        /* a body may take a tenth of what the requests leave, at most the old 64 MiB */
        size_t fixed = in->startup + ROUTER_PLAN_RESERVE + (size_t)in->max_running * in->request_bytes;
        size_t room = in->budget > fixed ? in->budget - fixed : 0;
        p->max_body = PRISM_MAX(PRISM_MIN(room / 10 / MIB * MIB, OLD_MAX_BODY), MIB);
    }
    if (budget && in->body_inflight && !in->max_body) p->max_body = PRISM_MIN(p->max_body, in->body_inflight);
    if (!budget) {
        rows_from_bounds(in, p);
        return PRISM_OK;
    }
    /* what the fixed and explicit rows take; the derived ones share the rest above their floors */
    rows_from_bounds(in, p);
    size_t taken = 0, floors = 0;
    unsigned weights = 0;
    for (int i = 0; i < ROUTER_ROW_COUNT; i++) {
        p->derived[i] = row_is_derived(in, (router_row_t)i);
        if (p->derived[i]) {
            floors += row_floor(in, p, (router_row_t)i);
            weights += k_share[i];
        } else {
            taken += p->bytes[i];
        }
    }
    char a[32], b[32], c[32];
    if (taken + floors > in->budget) {
        int k = snprintf(err, n, "the router's memory plan needs at least %s (%zu bytes) but --mem-budget is %s (%zu "
                         "bytes):", prism_fmt_bytes(taken + floors, a, sizeof a), taken + floors,
                         prism_fmt_bytes(in->budget, b, sizeof b), in->budget);
        for (int i = 0; i < ROUTER_ROW_COUNT && k > 0 && (size_t)k < n; i++) {
            size_t v = p->derived[i] ? row_floor(in, p, (router_row_t)i) : p->bytes[i];
            if (!v) continue;
            k += snprintf(err + k, n - (size_t)k, " %s %s%s%s%s;", k_row_names[i], prism_fmt_bytes(v, c, sizeof c),
                          p->derived[i] ? " (least)" : "", !p->derived[i] && k_row_flags[i] ? " from " : "",
                          !p->derived[i] && k_row_flags[i] ? k_row_flags[i] : "");
        }
        if (k > 0 && (size_t)k < n)
            snprintf(err + k, n - (size_t)k, " raise --mem-budget or lower the flags given");
        return PRISM_ENOMEM;
    }
    size_t spare = in->budget - taken - floors;
    for (int i = 0; i < ROUTER_ROW_COUNT; i++) {
        if (!p->derived[i]) continue;
        size_t bytes = row_floor(in, p, (router_row_t)i) + (size_t)((double)spare * k_share[i] / weights);
        bound_from_row(in, p, (router_row_t)i, bytes);
    }
    rows_from_bounds(in, p);
    PRISM_ASSERT(p->total <= in->budget);
    return PRISM_OK;
}

void router_plan_log(const router_plan_t *p)
{
    char a[32], b[32];
    for (int i = 0; i < ROUTER_ROW_COUNT; i++)
        PRISM_INFO("router memory plan: %-18s %12s %s(%zu bytes)", k_row_names[i], prism_fmt_bytes(p->bytes[i], a, sizeof a),
                   p->derived[i] ? "from the budget " : "", p->bytes[i]);
    PRISM_INFO("router memory plan: %-18s %12s (%zu bytes) of budget %s", "total", prism_fmt_bytes(p->total, a, sizeof a),
               p->total, p->budget ? prism_fmt_bytes(p->budget, b, sizeof b) : "(none)");
    PRISM_INFO("router bounds: --max-connections %lld, --max-body-bytes %zu, --max-body-bytes-in-flight %zu, "
               "--max-image-bytes-in-flight %zu, --max-early-encode-bytes %zu, --max-stream-pending-bytes %zu, "
               "parse bound %zu", (long long)p->max_connections, p->max_body, p->body_inflight, p->image_inflight,
               p->early_bytes, p->stream_pending, p->parse_bound);
}

void router_mem_resident(size_t *rss, size_t *hwm)
{
    *rss = *hwm = 0;
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return;
    char line[256];
    unsigned long long kb;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "VmRSS: %llu kB", &kb) == 1) *rss = (size_t)kb << 10;
        else if (sscanf(line, "VmHWM: %llu kB", &kb) == 1) *hwm = (size_t)kb << 10;
    }
    fclose(f);
}
