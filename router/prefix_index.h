/* prefix_index: what one prefill worker's prefix cache holds, as this router knows it: a set of
 * block keys (common/kv/prefix.h) filled from the worker's PrefixEvents (kept / evicted; reset:
 * forgotten). The router computes a prompt's keys itself (Prefill.block_keys, with the secret
 * every router of a cluster derives from router.key), so the leading keys of a prompt found here
 * are the blocks the worker would read instead of computing them: routing sends a prompt to the
 * worker with the longest such prefix, and an image whose whole span lies in it needs no encoder.
 *
 * Bounded: at most max_keys keys (the worker's KV blocks: it cannot hold more); a worker that says
 * it holds more (lost or forged events) has its set dropped and rebuilt from its next events. The
 * table grows by doubling as keys come, up to twice max_keys slots, so an idle worker costs
 * little. A leaf: no sockets, no workers. Not thread-safe (the router's loop owns it). */
#ifndef PRISM_ROUTER_PREFIX_INDEX_H
#define PRISM_ROUTER_PREFIX_INDEX_H

#include "kv/prefix.h"
#include "prism.pb-c.h"

#define ROUTER_PREFIX_MAX_KEYS (1u << 20)   /* per worker, whatever its pool (16 MiB of table at most) */

typedef struct {
    prism_kv_key_t *slots;   /* [mask + 1] open addressing, linear probing; {0, 0}: empty */
    uint32_t mask;           /* 0: no table yet */
    uint32_t n, max_keys;
    uint64_t resets;         /* sets dropped (the worker's reset, or more keys than it could hold) */
} router_prefix_index_t;

/* An empty set for a worker of max_keys KV blocks (capped at ROUTER_PREFIX_MAX_KEYS); allocates nothing yet. */
void router_prefix_index_init(router_prefix_index_t *x, uint32_t max_keys);
void router_prefix_index_free(router_prefix_index_t *x);
/* Forgets every key (the table stays). */
void router_prefix_index_clear(router_prefix_index_t *x);
/* One PrefixEvents message: evicted keys out, stored keys in (reset first drops the set). False,
 * the set untouched, for a malformed one: a key list that is no whole number of keys or longer than
 * a worker sends (PRISM_KV_PREFIX_EVENTS keys). */
bool router_prefix_index_apply(router_prefix_index_t *x, const Prism__PrefixEvents *ev);
void router_prefix_index_add(router_prefix_index_t *x, prism_kv_key_t k);
void router_prefix_index_del(router_prefix_index_t *x, prism_kv_key_t k);
bool router_prefix_index_has(const router_prefix_index_t *x, prism_kv_key_t k);
/* How many of keys[0..n), from the first, the set holds. */
int router_prefix_index_match(const router_prefix_index_t *x, const prism_kv_key_t *keys, int n);

#endif
