/* resolve: endpoints whose host is a DNS name standing for several processes.
 *
 * A Kubernetes headless Service (or any DNS name with several A records) names every router at
 * once: "tcp://prism-router-control:8100" means one connection per address, and the set changes
 * as routers come and go. ZeroMQ resolves a name itself but connects to one address only, so a
 * worker expands such endpoints here into "tcp://A.B.C.D:PORT" endpoints, one per address, and
 * re-expands them on a timer.
 *
 *   prism_resolver_t *res;
 *   prism_resolver_start(&names, 5.0, NULL, &res);   // a thread: resolves at once, then every 5 s
 *   prism_endpoints_t now;
 *   if (prism_resolver_take(res, &now)) { ... connect what is new, close what left ... }
 *   prism_resolver_stop(res);
 *
 * Rules: IPv4 addresses (A records), sorted and deduplicated; an endpoint whose host is already an
 * address, a wildcard or not tcp:// is kept as given. A name that does not exist (NXDOMAIN: the
 * Service has no pods) means no address; a lookup that fails for another reason (DNS down, a
 * timeout) keeps the name's last addresses, so a DNS hiccup never disconnects a worker.
 * The lookup runs on the resolver's own thread: a slow DNS server never delays heartbeats.
 * Ownership: the caller owns the list it passes (copied at start) and every prism_endpoints_t. */
#ifndef PRISM_RESOLVE_H
#define PRISM_RESOLVE_H

#include "core/core.h"
#include "core/cli.h"

#define PRISM_RESOLVE_MAX 32     /* endpoints one list expands to (more are dropped with a warning) */
#define PRISM_ENDPOINT_MAX 256   /* bytes of one endpoint string, NUL included */

typedef struct {
    char ep[PRISM_RESOLVE_MAX][PRISM_ENDPOINT_MAX];
    int n;
} prism_endpoints_t;

/* How a name is looked up: fills addrs with up to max dotted IPv4 strings (16 bytes each) and sets
 * *n; returns 0, or PRISM_ENOTFOUND when the name does not exist, or PRISM_EAGAIN for any other
 * failure. NULL means getaddrinfo (tests pass their own). */
typedef int (*prism_lookup_fn)(const char *host, char (*addrs)[16], int max, int *n, void *ud);

/* True for tcp://HOST:PORT where HOST is a name (not an address, not "*", not bracketed IPv6). */
bool prism_endpoint_is_name(const char *ep);

/* Expands every endpoint of in into out once (see the rules above; on PRISM_EAGAIN for a name it
 * contributes nothing). Returns PRISM_OK, or PRISM_EINVAL with err set for a malformed tcp
 * endpoint (no port). */
int  prism_endpoints_expand(const prism_str_list_t *in, prism_lookup_fn lookup, void *ud, prism_endpoints_t *out,
                            char *err, size_t errlen);

typedef struct prism_resolver prism_resolver_t;

/* Starts the thread that expands names (every entry should satisfy prism_endpoint_is_name; others
 * pass through) every interval_s seconds, first at once. lookup: NULL for DNS. */
int  prism_resolver_start(const prism_str_list_t *names, double interval_s, prism_lookup_fn lookup, void *ud,
                          prism_resolver_t **out);
/* When the set of endpoints differs from the one last taken (or was never taken after the first
 * lookup ended): copies it into out and returns true. Cheap; call it on every loop iteration. */
bool prism_resolver_take(prism_resolver_t *r, prism_endpoints_t *out);
/* Lookups done so far (tests and logs). */
uint64_t prism_resolver_rounds(prism_resolver_t *r);
void prism_resolver_stop(prism_resolver_t *r);

#endif
