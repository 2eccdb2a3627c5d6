/* Endpoint names to endpoints, once or on a timer (see resolve.h). */
#include "net/resolve.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define ADDRS_PER_NAME PRISM_RESOLVE_MAX

/* Splits "tcp://HOST:PORT": host into host (bounded), the port string pointer into *port. false
 * when ep is not tcp:// or has no ":PORT". */
static bool split_tcp(const char *ep, char *host, size_t hostlen, const char **port)
{
    if (strncmp(ep, "tcp://", 6) != 0) return false;
    const char *h = ep + 6, *colon = strrchr(h, ':');
    if (!colon || colon == h || !colon[1]) return false;
    size_t n = (size_t)(colon - h);
    if (n >= hostlen) return false;
    memcpy(host, h, n);
    host[n] = 0;
    *port = colon + 1;
    return true;
}

bool prism_endpoint_is_name(const char *ep)
{
    char host[PRISM_ENDPOINT_MAX];
    const char *port;
    if (!split_tcp(ep, host, sizeof(host), &port)) return false;
    struct in_addr a4;
    struct in6_addr a6;
    /* "*" is a wildcard, "[...]" IPv6, "iface;host" a ZeroMQ source address: not ours to expand. */
    if (!strcmp(host, "*") || host[0] == '[' || strchr(host, ';')) return false;
    return inet_pton(AF_INET, host, &a4) != 1 && inet_pton(AF_INET6, host, &a6) != 1;
}

static int dns_lookup(const char *host, char (*addrs)[16], int max, int *n, void *ud)
{
    (void)ud;
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    int rc = getaddrinfo(host, NULL, &hints, &res);
    *n = 0;
    if (rc != 0) {
#ifdef EAI_NODATA
        if (rc == EAI_NODATA) return PRISM_ENOTFOUND;
#endif
        return rc == EAI_NONAME ? PRISM_ENOTFOUND : PRISM_EAGAIN;
    }
    for (struct addrinfo *a = res; a && *n < max; a = a->ai_next) {
        const struct sockaddr_in *sin = (const struct sockaddr_in *)a->ai_addr;
        if (a->ai_family == AF_INET && inet_ntop(AF_INET, &sin->sin_addr, addrs[*n], 16)) (*n)++;
    }
    freeaddrinfo(res);
    return PRISM_OK;
}

static int cmp_ep(const void *a, const void *b) { return strcmp(a, b); }

/* Adds ep to out unless present; false when out is full. */
static bool add_ep(prism_endpoints_t *out, const char *ep)
{
    for (int i = 0; i < out->n; i++)
        if (!strcmp(out->ep[i], ep)) return true;
    if (out->n == PRISM_RESOLVE_MAX) return false;
    snprintf(out->ep[out->n++], PRISM_ENDPOINT_MAX, "%s", ep);
    return true;
}

/* One name's addresses as endpoints, appended to out. */
static void add_addrs(prism_endpoints_t *out, const char *port, char (*addrs)[16], int n, bool *full)
{
    for (int i = 0; i < n; i++) {
        char ep[PRISM_ENDPOINT_MAX];
        snprintf(ep, sizeof(ep), "tcp://%.15s:%.200s", addrs[i], port);
        if (!add_ep(out, ep)) *full = true;
    }
}

int prism_endpoints_expand(const prism_str_list_t *in, prism_lookup_fn lookup, void *ud, prism_endpoints_t *out,
                           char *err, size_t errlen)
{
    if (!lookup) lookup = dns_lookup;
    out->n = 0;
    bool full = false;
    for (int i = 0; i < in->n; i++) {
        const char *ep = in->items[i], *port;
        char host[PRISM_ENDPOINT_MAX];
        if (!strncmp(ep, "tcp://", 6) && !split_tcp(ep, host, sizeof(host), &port)) {
            snprintf(err, errlen, "endpoint '%s': expected tcp://HOST:PORT", ep);
            return PRISM_EINVAL;
        }
        if (!prism_endpoint_is_name(ep)) {
            if (!add_ep(out, ep)) full = true;
            continue;
        }
        char addrs[ADDRS_PER_NAME][16];
        int n = 0;
        if (lookup(host, addrs, ADDRS_PER_NAME, &n, ud) == PRISM_OK) {
            qsort(addrs, (size_t)n, sizeof(addrs[0]), cmp_ep);
            add_addrs(out, port, addrs, n, &full);
        }
    }
    if (full) PRISM_WARN("more than %d endpoints: the rest are ignored", PRISM_RESOLVE_MAX);
    return PRISM_OK;
}

/* ---------------------------------------------------------------- the resolver thread */

typedef struct {
    char ep[PRISM_ENDPOINT_MAX];   /* as given */
    char host[PRISM_ENDPOINT_MAX];
    const char *port;              /* into ep */
    char addrs[ADDRS_PER_NAME][16];
    int n;                         /* last good answer (NXDOMAIN counts: 0 addresses) */
    int last_rc;                   /* for logging state changes only */
} name_state_t;

struct prism_resolver {
    name_state_t names[PRISM_CLI_MAX_LIST];
    prism_str_list_t others;       /* entries that are not names: passed through */
    int n_names;
    double interval_s;
    prism_lookup_fn lookup;
    void *ud;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;                     /* under mu */
    prism_endpoints_t published;   /* under mu */
    uint64_t gen, taken_gen, rounds;  /* under mu */
};

static void resolve_round(prism_resolver_t *r)
{
    for (int i = 0; i < r->n_names; i++) {
        name_state_t *s = &r->names[i];
        char addrs[ADDRS_PER_NAME][16];
        int n = 0;
        int rc = r->lookup(s->host, addrs, ADDRS_PER_NAME, &n, r->ud);
        if (rc == PRISM_OK || rc == PRISM_ENOTFOUND) {
            if (rc != PRISM_OK) n = 0;
            qsort(addrs, (size_t)n, sizeof(addrs[0]), cmp_ep);
            memcpy(s->addrs, addrs, sizeof(addrs[0]) * (size_t)n);
            s->n = n;
        }
        if (rc != s->last_rc && rc == PRISM_EAGAIN)
            PRISM_WARN("%s: lookup failed; keeping its last addresses", s->ep);
        else if (rc != s->last_rc)
            PRISM_INFO("%s: %s", s->ep, rc == PRISM_OK ? "resolves again" : "no such name (no addresses for now)");
        s->last_rc = rc;
    }
    prism_endpoints_t now = {0};
    bool full = false;
    for (int i = 0; i < r->others.n; i++)
        if (!add_ep(&now, r->others.items[i])) full = true;
    for (int i = 0; i < r->n_names; i++) add_addrs(&now, r->names[i].port, r->names[i].addrs, r->names[i].n, &full);
    if (full) PRISM_WARN("more than %d router endpoints: the rest are ignored", PRISM_RESOLVE_MAX);
    qsort(now.ep, (size_t)now.n, sizeof(now.ep[0]), cmp_ep);
    pthread_mutex_lock(&r->mu);
    bool changed = r->rounds == 0 || now.n != r->published.n ||
                   memcmp(now.ep, r->published.ep, sizeof(now.ep[0]) * (size_t)now.n) != 0;
    if (changed) {
        r->published = now;
        r->gen++;
    }
    r->rounds++;
    pthread_mutex_unlock(&r->mu);
}

static void *resolver_main(void *arg)
{
    prism_resolver_t *r = arg;
    pthread_mutex_lock(&r->mu);
    while (!r->stop) {
        pthread_mutex_unlock(&r->mu);
        resolve_round(r);
        pthread_mutex_lock(&r->mu);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        double t = (double)ts.tv_sec + ts.tv_nsec / 1e9 + r->interval_s;
        ts.tv_sec = (time_t)t;
        ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
        while (!r->stop && pthread_cond_timedwait(&r->cv, &r->mu, &ts) != ETIMEDOUT) {}
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

int prism_resolver_start(const prism_str_list_t *names, double interval_s, prism_lookup_fn lookup, void *ud,
                         prism_resolver_t **out)
{
    *out = NULL;
    prism_resolver_t *r = prism_calloc(1, sizeof(*r));
    if (!r) return PRISM_ENOMEM;
    r->interval_s = interval_s > 0.05 ? interval_s : 0.05;
    r->lookup = lookup ? lookup : dns_lookup;
    r->ud = ud;
    for (int i = 0; i < names->n && i < PRISM_CLI_MAX_LIST; i++) {
        const char *ep = names->items[i];
        if (!prism_endpoint_is_name(ep)) {
            r->others.items[r->others.n++] = ep;  /* the caller's strings outlive the resolver (flags) */
            continue;
        }
        name_state_t *s = &r->names[r->n_names++];
        snprintf(s->ep, sizeof(s->ep), "%s", ep);
        split_tcp(s->ep, s->host, sizeof(s->host), &s->port);
        s->last_rc = PRISM_OK;
    }
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    if (pthread_create(&r->thread, NULL, resolver_main, r) != 0) {
        pthread_mutex_destroy(&r->mu);
        pthread_cond_destroy(&r->cv);
        prism_free(r);
        return PRISM_EIO;
    }
    *out = r;
    return PRISM_OK;
}

bool prism_resolver_take(prism_resolver_t *r, prism_endpoints_t *out)
{
    pthread_mutex_lock(&r->mu);
    bool fresh = r->gen != r->taken_gen;
    if (fresh) {
        *out = r->published;
        r->taken_gen = r->gen;
    }
    pthread_mutex_unlock(&r->mu);
    return fresh;
}

uint64_t prism_resolver_rounds(prism_resolver_t *r)
{
    pthread_mutex_lock(&r->mu);
    uint64_t n = r->rounds;
    pthread_mutex_unlock(&r->mu);
    return n;
}

void prism_resolver_stop(prism_resolver_t *r)
{
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    r->stop = true;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
    pthread_join(r->thread, NULL);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    prism_free(r);
}
