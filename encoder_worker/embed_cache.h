/* embed_cache: LRU cache of image embeddings with a byte budget, keyed by a content hash of the
 * image file. Slots are carved from one region at start-up; lookups scan a dense key array
 * (a few thousand u64 compares cost microseconds next to a ViT forward). */
#ifndef PRISM_EMBED_CACHE_H
#define PRISM_EMBED_CACHE_H

#include "core/core.h"

typedef struct {
    int n_slots;
    size_t slot_floats;
    uint64_t *keys;     /* [n_slots] */
    bool *used;         /* [n_slots] */
    uint64_t *stamp;    /* [n_slots] last use; LRU = smallest */
    float *data;        /* [n_slots][slot_floats] */
    uint64_t clock, hits, misses;
} prism_embed_cache_t;

/* budget_bytes / slot bytes slots (0 slots disables the cache). */
int  prism_embed_cache_init(prism_embed_cache_t *c, size_t budget_bytes, size_t slot_floats);
void prism_embed_cache_free(prism_embed_cache_t *c);
size_t prism_embed_cache_bytes(size_t budget_bytes, size_t slot_floats);
/* Returns the cached embeddings or NULL; counts hits and misses. */
const float *prism_embed_cache_get(prism_embed_cache_t *c, uint64_t key);
void prism_embed_cache_put(prism_embed_cache_t *c, uint64_t key, const float *emb);

#endif
