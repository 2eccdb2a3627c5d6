/* prefix: a block-level prefix cache over the KV block manager (kv.h). A full block of a prompt
 * is named by a key chained over the prompt from its start: block i's key is a keyed 128-bit hash
 * of block i-1's key, block i's token ids and the identity of every image whose span touches the
 * block; block 0's parent is the root, a hash of the request's cache salt. Equal keys mean an
 * equal prefix (up to a 128-bit keyed-hash collision), so a request reuses the KV of every leading
 * block it finds and computes only the rest.
 *
 * Why an image needs its own identity in the key: its placeholder tokens are the same ids for
 * every image, while the KV behind them comes from the image's embeddings. prism_kv_image_t is
 * what decides those embeddings: the router's keyed content hash of the image file (the key of the
 * encoder's embedding cache) and the geometry the processor chose for it (its span, and the
 * LM-token grid of M-RoPE models, which also moves the rotary positions of the text after it).
 *
 * Ownership: the cache is one more holder (prism_kv_blocks_share) of each block it keeps, so a
 * cached block is never handed out by prism_kv_blocks_alloc and never written: a request writes
 * only positions past its matched prefix. A request that matched blocks holds them as well until
 * it releases them. Eviction takes least-recently-used blocks that nobody but the cache holds, the
 * deepest block of a prompt before its parents (a child is useless without them). The index is
 * sized to the pool at start-up (prism_kv_prefix_bytes: no allocation afterwards). Not thread-safe:
 * one compute loop owns it. */
#ifndef PRISM_KV_PREFIX_H
#define PRISM_KV_PREFIX_H

#include "kv/kv.h"

#define PRISM_KV_PREFIX_SECRET_BYTES 192
#define PRISM_KV_PREFIX_MAX_SALT 256   /* bytes of a request's cache salt (the router refuses longer) */
#define PRISM_KV_PREFIX_EVENTS 512     /* keys kept / evicted one PrefixEvents message carries, each */
#define PRISM_KV_PREFIX_KEY_BYTES 16   /* a key on the wire: lo then hi, little endian */

typedef struct {
    uint64_t lo, hi;
} prism_kv_key_t;

/* One image of a prompt as the key sees it. */
typedef struct {
    uint32_t offset, n_tokens;       /* its span of prompt tokens */
    uint32_t grid_rows, grid_cols;   /* M-RoPE models: its LM-token grid; else 0 */
    uint64_t content_hash;           /* the router's keyed hash of the image file */
} prism_kv_image_t;

/* What the cache kept and evicted since the last prism_kv_prefix_events_take, net: a key kept and
 * evicted again in between is in neither list (it was never announced), one evicted and kept again
 * in neither (it is still held as announced). More than PRISM_KV_PREFIX_EVENTS of either, or a
 * resync (a router that registered since: it knows nothing): reset, and then every key held is
 * listed again as kept, a batch per take (a cursor over the pool's block ids: a block kept or
 * evicted meanwhile is an event of its own), until the pool is covered. */
typedef struct {
    prism_kv_key_t *stored, *evicted;   /* [PRISM_KV_PREFIX_EVENTS] each */
    int n_stored, n_evicted;
    bool reset;
    int32_t resync_at;                  /* the next block id to list again; -1: none */
} prism_kv_prefix_log_t;

typedef struct {
    prism_kv_blocks_t *blocks;   /* not owned */
    uint8_t secret[PRISM_KV_PREFIX_SECRET_BYTES];  /* keys the hash: drawn at init, never leaves the process */
    prism_kv_key_t *keys;        /* [n_blocks] key of each cached block */
    int32_t *prev, *next;        /* [n_blocks] LRU list of cached blocks (-1 ends; -2: not cached) */
    int32_t *slots;              /* [mask + 1] open addressing, linear probing: block id or -1 */
    uint32_t mask;
    int32_t lru, mru;            /* ends of the list: lru is evicted first */
    int n_cached;
    uint64_t evictions;
    prism_kv_prefix_log_t log;   /* for the routers' indexes (PrefixEvents) */
} prism_kv_prefix_t;

/* Heap prism_kv_prefix_init takes for a pool of n_blocks (a worker's memory plan counts it). */
size_t prism_kv_prefix_bytes(int n_blocks);
/* An empty cache over b (which must outlive it), keyed by a secret drawn from the kernel. */
int  prism_kv_prefix_init(prism_kv_prefix_t *c, prism_kv_blocks_t *b);
/* Releases every cached block into b and frees the index. */
void prism_kv_prefix_free(prism_kv_prefix_t *c);

/* The keys of a prompt's full blocks of block_size tokens into out[0 .. n_tokens / block_size),
 * keyed by secret (PRISM_KV_PREFIX_SECRET_BYTES): returns how many. images: the prompt's spans, in
 * order, non-overlapping, inside the prompt. salt may be NULL. The router computes them too
 * (Prefill.block_keys), with a secret every router of a cluster derives alike. */
int prism_kv_prefix_chain(const uint8_t *secret, int block_size, const void *salt, size_t salt_len,
                          const int32_t *tokens, int n_tokens, const prism_kv_image_t *images, int n_images,
                          prism_kv_key_t *out);
/* A chain secret derived from seed (the routers: router.key's text), apart from any other secret
 * derived from the same seed. */
int prism_kv_prefix_secret(uint8_t secret[PRISM_KV_PREFIX_SECRET_BYTES], const void *seed, size_t seed_len);
/* Keys on the wire (Prefill.block_keys, PrefixEvents) from and to n keys. */
void prism_kv_prefix_keys_put(const prism_kv_key_t *keys, int n, uint8_t *out);
void prism_kv_prefix_keys_get(const uint8_t *in, int n, prism_kv_key_t *keys);

/* The key chain of the cache's own secret (prism_kv_prefix_chain): for prompts that come without keys. */
int prism_kv_prefix_keys(const prism_kv_prefix_t *c, const void *salt, size_t salt_len, const int32_t *tokens,
                         int n_tokens, const prism_kv_image_t *images, int n_images, prism_kv_key_t *out);

/* The leading blocks of keys[0..n) the cache holds, into ids[0..return): the caller becomes one
 * more holder of each (release them with prism_kv_blocks_release) and they count as used now. */
int prism_kv_prefix_match(prism_kv_prefix_t *c, const prism_kv_key_t *keys, int n, int32_t *ids);

/* Keeps blocks ids[0..n) (computed, full, holding exactly what keys[0..n) name) for later
 * requests: the cache becomes a holder of each it did not keep yet; a key it already holds under
 * another block keeps that block. All of them count as used now, the first as the most recent. */
void prism_kv_prefix_insert(prism_kv_prefix_t *c, const prism_kv_key_t *keys, const int32_t *ids, int n);

/* Allocates n blocks (prism_kv_blocks_alloc), evicting least-recently-used blocks only the cache
 * holds when fewer are free: PRISM_EAGAIN, with nothing allocated, when even that leaves too few. */
int prism_kv_prefix_alloc(prism_kv_prefix_t *c, int n, int32_t *out);

/* The events logged since the last take (c->log, valid until the next call into the cache), then
 * an empty log; while a resync runs, stored also lists the next held keys of the pool, as many as
 * fit. False when there is nothing to say. */
bool prism_kv_prefix_events_take(prism_kv_prefix_t *c, prism_kv_prefix_log_t *out);
/* Starts a resync: the next take says reset, and the takes from then on list every key held. */
void prism_kv_prefix_events_resync(prism_kv_prefix_t *c);

/* Forgets every block only the cache holds (their ids free again); returns how many. */
int prism_kv_prefix_clear(prism_kv_prefix_t *c);

#endif
