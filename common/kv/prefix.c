#include "kv/prefix.h"

#define XXH_STATIC_LINKING_ONLY  /* XXH3_state_t on the stack, XXH3_generateSecret (inlining all of xxhash would bring its malloc) */
#include <xxhash.h>
#include <string.h>

#define NOT_CACHED (-2)

static uint32_t table_size(int n_blocks)
{
    uint32_t s = 16;
    while (s < 2u * (uint32_t)n_blocks) s <<= 1;   /* at most half full: short probes */
    return s;
}

size_t prism_kv_prefix_bytes(int n_blocks)
{
    return (size_t)n_blocks * (sizeof(prism_kv_key_t) + 2 * sizeof(int32_t)) + table_size(n_blocks) * sizeof(int32_t) +
           2 * PRISM_KV_PREFIX_EVENTS * sizeof(prism_kv_key_t);
}

int prism_kv_prefix_init(prism_kv_prefix_t *c, prism_kv_blocks_t *b)
{
    memset(c, 0, sizeof *c);
    uint8_t seed[64];
    if (prism_random_bytes(seed, sizeof seed) != PRISM_OK) return PRISM_EIO;
    if (XXH3_generateSecret(c->secret, sizeof c->secret, seed, sizeof seed) != XXH_OK) return PRISM_EINVAL;
    memset(seed, 0, sizeof seed);
    int n = b->n_blocks;
    uint32_t ts = table_size(n);
    c->blocks = b;
    c->keys = prism_malloc(sizeof(prism_kv_key_t) * (size_t)n);
    c->prev = prism_malloc(sizeof(int32_t) * (size_t)n);
    c->next = prism_malloc(sizeof(int32_t) * (size_t)n);
    c->slots = prism_malloc(sizeof(int32_t) * ts);
    c->log.stored = prism_malloc(sizeof(prism_kv_key_t) * PRISM_KV_PREFIX_EVENTS);
    c->log.evicted = prism_malloc(sizeof(prism_kv_key_t) * PRISM_KV_PREFIX_EVENTS);
    if (!c->keys || !c->prev || !c->next || !c->slots || !c->log.stored || !c->log.evicted) {
        prism_kv_prefix_free(c);
        return PRISM_ENOMEM;
    }
    for (int i = 0; i < n; i++) c->prev[i] = c->next[i] = NOT_CACHED;
    for (uint32_t i = 0; i < ts; i++) c->slots[i] = -1;
    c->mask = ts - 1;
    c->lru = c->mru = -1;
    c->log.resync_at = -1;
    return PRISM_OK;
}

void prism_kv_prefix_free(prism_kv_prefix_t *c)
{
    if (c->blocks && c->slots) {
        /* the cache's holds go back, so the pool is whole again */
        for (uint32_t i = 0; i <= c->mask; i++)
            if (c->slots[i] >= 0) prism_kv_blocks_release(c->blocks, &c->slots[i], 1);
    }
    prism_free(c->keys);
    prism_free(c->prev);
    prism_free(c->next);
    prism_free(c->slots);
    prism_free(c->log.stored);
    prism_free(c->log.evicted);
    memset(c, 0, sizeof *c);
}

/* ---- the chain ---- */

int prism_kv_prefix_chain(const uint8_t *secret, int block_size, const void *salt, size_t salt_len,
                          const int32_t *tokens, int n_tokens, const prism_kv_image_t *images, int n_images,
                          prism_kv_key_t *out)
{
    int bs = block_size, n_full = bs > 0 ? n_tokens / bs : 0, img = 0;
    XXH3_state_t st;
    /* the root: the salt, with its length so that no salt is another's prefix */
    uint64_t len = salt ? salt_len : 0;
    XXH3_128bits_reset_withSecret(&st, secret, PRISM_KV_PREFIX_SECRET_BYTES);
    XXH3_128bits_update(&st, "prism-prefix-root", 17);
    XXH3_128bits_update(&st, &len, sizeof len);
    if (len) XXH3_128bits_update(&st, salt, salt_len);
    XXH128_hash_t h = XXH3_128bits_digest(&st);
    for (int b = 0; b < n_full; b++) {
        uint32_t lo = (uint32_t)(b * bs), hi = lo + (uint32_t)bs;
        XXH3_128bits_reset_withSecret(&st, secret, PRISM_KV_PREFIX_SECRET_BYTES);
        XXH3_128bits_update(&st, &h, sizeof h);
        XXH3_128bits_update(&st, tokens + lo, sizeof(int32_t) * (size_t)bs);
        /* every image whose span touches the block: its placeholders stand for its embeddings */
        while (img < n_images && images[img].offset + images[img].n_tokens <= lo) img++;
        for (int i = img; i < n_images && images[i].offset < hi; i++) {
            const prism_kv_image_t *m = &images[i];
            uint64_t rec[4] = {((uint64_t)m->offset << 32) | m->n_tokens, ((uint64_t)m->grid_rows << 32) | m->grid_cols,
                               m->content_hash, 0x696d616765ull /* "image": no token run reads as a record */};
            XXH3_128bits_update(&st, rec, sizeof rec);
        }
        h = XXH3_128bits_digest(&st);
        out[b] = (prism_kv_key_t){h.low64, h.high64};
    }
    return n_full;
}

int prism_kv_prefix_keys(const prism_kv_prefix_t *c, const void *salt, size_t salt_len, const int32_t *tokens,
                         int n_tokens, const prism_kv_image_t *images, int n_images, prism_kv_key_t *out)
{
    return prism_kv_prefix_chain(c->secret, c->blocks->block_size, salt, salt_len, tokens, n_tokens, images, n_images,
                                 out);
}

int prism_kv_prefix_secret(uint8_t secret[PRISM_KV_PREFIX_SECRET_BYTES], const void *seed, size_t seed_len)
{
    /* a label first: the image cache's secret comes from the same seed */
    uint8_t buf[256];
    static const char label[] = "prism-prefix-secret";
    if (seed_len > sizeof buf - sizeof label) return PRISM_EINVAL;
    memcpy(buf, label, sizeof label);
    memcpy(buf + sizeof label, seed, seed_len);
    int rc = XXH3_generateSecret(secret, PRISM_KV_PREFIX_SECRET_BYTES, buf, sizeof label + seed_len) == XXH_OK
                 ? PRISM_OK : PRISM_EINVAL;
    memset(buf, 0, sizeof buf);
    return rc;
}

static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

void prism_kv_prefix_keys_put(const prism_kv_key_t *keys, int n, uint8_t *out)
{
    for (int i = 0; i < n; i++) {
        put64(out + (size_t)i * PRISM_KV_PREFIX_KEY_BYTES, keys[i].lo);
        put64(out + (size_t)i * PRISM_KV_PREFIX_KEY_BYTES + 8, keys[i].hi);
    }
}

void prism_kv_prefix_keys_get(const uint8_t *in, int n, prism_kv_key_t *keys)
{
    for (int i = 0; i < n; i++)
        keys[i] = (prism_kv_key_t){get64(in + (size_t)i * PRISM_KV_PREFIX_KEY_BYTES),
                                   get64(in + (size_t)i * PRISM_KV_PREFIX_KEY_BYTES + 8)};
}

/* ---- the index ---- */

static bool key_eq(prism_kv_key_t a, prism_kv_key_t b) { return a.lo == b.lo && a.hi == b.hi; }

/* The slot holding key, or the empty slot where it would go. */
static uint32_t find_slot(const prism_kv_prefix_t *c, prism_kv_key_t k)
{
    uint32_t s = (uint32_t)k.lo & c->mask;
    while (c->slots[s] >= 0 && !key_eq(c->keys[c->slots[s]], k)) s = (s + 1) & c->mask;
    return s;
}

static void lru_unlink(prism_kv_prefix_t *c, int32_t id)
{
    int32_t p = c->prev[id], n = c->next[id];
    if (p >= 0) c->next[p] = n;
    else c->lru = n;
    if (n >= 0) c->prev[n] = p;
    else c->mru = p;
}

static void lru_push_mru(prism_kv_prefix_t *c, int32_t id)
{
    c->prev[id] = c->mru;
    c->next[id] = -1;
    if (c->mru >= 0) c->next[c->mru] = id;
    else c->lru = id;
    c->mru = id;
}

static void touch(prism_kv_prefix_t *c, int32_t id)
{
    lru_unlink(c, id);
    lru_push_mru(c, id);
}

/* ---- the event log (net: see prism_kv_prefix_log_t) ---- */

/* Takes k out of list[0..*n) if there: true when it was. */
static bool log_cancel(prism_kv_key_t *list, int *n, prism_kv_key_t k)
{
    for (int i = 0; i < *n; i++)
        if (key_eq(list[i], k)) {
            list[i] = list[--*n];
            return true;
        }
    return false;
}

static void log_event(prism_kv_prefix_t *c, prism_kv_key_t k, bool stored)
{
    prism_kv_prefix_log_t *l = &c->log;
    if (!l->stored || l->reset) return;   /* a reset lists what is held when taken */
    /* while a resync lists the pool: a key kept in a block the cursor has not reached yet is listed
     * by it (and evicted ones are simply not there), but an eviction of a listed block is news */
    if (log_cancel(stored ? l->evicted : l->stored, stored ? &l->n_evicted : &l->n_stored, k)) return;
    int *n = stored ? &l->n_stored : &l->n_evicted;
    if (*n == PRISM_KV_PREFIX_EVENTS) {
        prism_kv_prefix_events_resync(c);   /* lost: list everything again */
        return;
    }
    (stored ? l->stored : l->evicted)[(*n)++] = k;
}

void prism_kv_prefix_events_resync(prism_kv_prefix_t *c)
{
    prism_kv_prefix_log_t *l = &c->log;
    l->reset = true;   /* what was logged is moot: the listing says what is held */
    l->n_stored = l->n_evicted = 0;
    l->resync_at = 0;
}

bool prism_kv_prefix_events_take(prism_kv_prefix_t *c, prism_kv_prefix_log_t *out)
{
    prism_kv_prefix_log_t *l = &c->log;
    if (!l->stored || (!l->reset && !l->n_stored && !l->n_evicted && l->resync_at < 0)) return false;
    /* the next held keys of the pool: a key kept earlier in this take's events may come twice */
    int32_t n = c->blocks->n_blocks;
    while (l->resync_at >= 0 && l->resync_at < n && l->n_stored < PRISM_KV_PREFIX_EVENTS) {
        int32_t id = l->resync_at++;
        if (c->prev[id] != NOT_CACHED) l->stored[l->n_stored++] = c->keys[id];
    }
    if (l->resync_at >= n) l->resync_at = -1;
    *out = *l;
    l->n_stored = l->n_evicted = 0;
    l->reset = false;
    return true;
}

/* Takes block id out of the index and the list, and lets the cache's hold go. */
static void evict(prism_kv_prefix_t *c, int32_t id)
{
    uint32_t s = find_slot(c, c->keys[id]);
    PRISM_ASSERT(c->slots[s] == id);
    /* backward-shift deletion: later members of the probe run move up, so no tombstones */
    uint32_t hole = s, j = s;
    for (;;) {
        j = (j + 1) & c->mask;
        if (c->slots[j] < 0) break;
        uint32_t home = (uint32_t)c->keys[c->slots[j]].lo & c->mask;
        /* the entry at j may fill the hole when its home is not in (hole, j] cyclically */
        if (((j - home) & c->mask) >= ((j - hole) & c->mask)) {
            c->slots[hole] = c->slots[j];
            hole = j;
        }
    }
    c->slots[hole] = -1;
    lru_unlink(c, id);
    c->prev[id] = c->next[id] = NOT_CACHED;
    c->n_cached--;
    c->evictions++;
    log_event(c, c->keys[id], false);
    prism_kv_blocks_release(c->blocks, &id, 1);
}

int prism_kv_prefix_match(prism_kv_prefix_t *c, const prism_kv_key_t *keys, int n, int32_t *ids)
{
    int h = 0;
    for (; h < n; h++) {
        int32_t id = c->slots[find_slot(c, keys[h])];
        if (id < 0 || prism_kv_blocks_share(c->blocks, &id, 1) != PRISM_OK) break;
        ids[h] = id;
    }
    /* deepest first, so the first block ends the most recent: eviction takes tails before parents */
    for (int i = h - 1; i >= 0; i--) touch(c, ids[i]);
    return h;
}

void prism_kv_prefix_insert(prism_kv_prefix_t *c, const prism_kv_key_t *keys, const int32_t *ids, int n)
{
    for (int i = n - 1; i >= 0; i--) {
        uint32_t s = find_slot(c, keys[i]);
        int32_t id = c->slots[s];
        if (id >= 0) {
            touch(c, id);   /* kept already (this block, or an equal one computed before) */
            continue;
        }
        id = ids[i];
        PRISM_ASSERT(id >= 0 && id < c->blocks->n_blocks && c->prev[id] == NOT_CACHED);
        if (prism_kv_blocks_share(c->blocks, &id, 1) != PRISM_OK) continue;
        c->keys[id] = keys[i];
        c->slots[s] = id;
        lru_push_mru(c, id);
        c->n_cached++;
        log_event(c, keys[i], true);
    }
}

int prism_kv_prefix_alloc(prism_kv_prefix_t *c, int n, int32_t *out)
{
    int32_t id = c->lru;
    while (c->blocks->n_free < n && id >= 0) {
        int32_t next = c->next[id];
        if (prism_kv_blocks_holders(c->blocks, id) == 1) evict(c, id);   /* no request reads it */
        id = next;
    }
    return prism_kv_blocks_alloc(c->blocks, n, out);
}

int prism_kv_prefix_clear(prism_kv_prefix_t *c)
{
    int n = 0;
    for (int32_t id = c->lru, next; id >= 0; id = next) {
        next = c->next[id];
        if (prism_kv_blocks_holders(c->blocks, id) == 1) {
            evict(c, id);
            n++;
        }
    }
    return n;
}
