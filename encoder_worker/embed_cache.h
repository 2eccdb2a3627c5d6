/* embed_cache: LRU cache of image embeddings with a byte budget, keyed by a content hash of the
 * image file. Slots are carved from one region at start-up; lookups scan a dense key array
 * (a few thousand u64 compares cost microseconds next to a ViT forward).
 *
 * A hit pins its slot: the caller reads the embeddings in place (no copy of megabytes) until it
 * unpins, and no put() evicts or overwrites a pinned slot meanwhile — otherwise a miss later in the
 * same batch could replace the entry with another image's embeddings before the hit is sent. */
#ifndef PRISM_EMBED_CACHE_H
#define PRISM_EMBED_CACHE_H

#include "core/core.h"

typedef struct {
    int n_slots;
    size_t slot_floats;
    uint64_t *keys;     /* [n_slots] */
    bool *used;         /* [n_slots] */
    uint32_t *pins;     /* [n_slots] readers holding the slot */
    uint64_t *stamp;    /* [n_slots] last use; LRU = smallest */
    float *data;        /* [n_slots][slot_floats] */
    uint64_t clock, hits, misses;
} prism_embed_cache_t;

/* budget_bytes / slot bytes slots (0 slots disables the cache). */
int  prism_embed_cache_init(prism_embed_cache_t *c, size_t budget_bytes, size_t slot_floats);
void prism_embed_cache_free(prism_embed_cache_t *c);
size_t prism_embed_cache_bytes(size_t budget_bytes, size_t slot_floats);
/* Bytes one entry costs (embeddings + bookkeeping). */
size_t prism_embed_cache_slot_bytes(size_t slot_floats);
/* Looks key up, counting a hit or a miss. On a hit returns the slot, pinned (read it with
 * prism_embed_cache_data, release it with prism_embed_cache_unpin); -1 on a miss. */
int prism_embed_cache_get_pinned(prism_embed_cache_t *c, uint64_t key);
const float *prism_embed_cache_data(const prism_embed_cache_t *c, int slot);
void prism_embed_cache_unpin(prism_embed_cache_t *c, int slot);
/* Stores a copy of emb under key in the least recently used unpinned slot; does nothing when every
 * slot is pinned. An entry already present for key is refreshed, not rewritten, when pinned. */
void prism_embed_cache_put(prism_embed_cache_t *c, uint64_t key, const float *emb);

#endif
