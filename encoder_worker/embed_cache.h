/* embed_cache: LRU cache of image embeddings with a byte budget, keyed by a content hash of the
 * image file. Memory is carved at start-up into units of one tile's embedding rows (a LLaVA image
 * is one unit, a Llama-4 image one unit per tile, 1..max_units); an entry is a chain of units
 * that need not be contiguous, so images of different sizes share the budget without
 * fragmentation. Lookups scan a dense key array (a few thousand u64 compares cost microseconds
 * next to a ViT forward).
 *
 * A hit pins its entry: the caller reads the units in place (no copy of megabytes: they go out as
 * the frames of the Embeddings message) until it unpins, and no put() evicts or overwrites a
 * pinned entry meanwhile — otherwise a miss later in the same batch could replace the entry with
 * another image's embeddings before the hit is sent. */
#ifndef PRISM_EMBED_CACHE_H
#define PRISM_EMBED_CACHE_H

#include "core/core.h"

typedef struct {
    int n_units;        /* units (and entries at most: each entry holds >= 1 unit) */
    int max_units;      /* most units one entry may take */
    size_t unit_floats;
    /* per entry */
    uint64_t *keys;
    bool *used;
    uint32_t *pins;     /* readers holding the entry */
    uint64_t *stamp;    /* last use; LRU = smallest */
    int32_t *first;     /* first unit of the entry's chain */
    int32_t *len;       /* units in the chain */
    /* per unit */
    int32_t *next;      /* next unit of the same entry, -1 at the end */
    int32_t *free_units;/* stack of free units */
    int n_free;
    float *data;        /* [n_units][unit_floats] */
    uint64_t clock, hits, misses;
} prism_embed_cache_t;

/* budget_bytes / unit bytes units (0 units disables the cache); entries of 1..max_units units. */
int  prism_embed_cache_init(prism_embed_cache_t *c, size_t budget_bytes, size_t unit_floats, int max_units);
void prism_embed_cache_free(prism_embed_cache_t *c);
size_t prism_embed_cache_bytes(size_t budget_bytes, size_t unit_floats);
/* Bytes one unit costs (embeddings + bookkeeping of the unit and of an entry). */
size_t prism_embed_cache_unit_bytes(size_t unit_floats);
/* Looks key up, counting a hit or a miss. On a hit returns the entry, pinned (read it with
 * prism_embed_cache_units, release it with prism_embed_cache_unpin); -1 on a miss. */
int prism_embed_cache_get_pinned(prism_embed_cache_t *c, uint64_t key);
/* The entry's units in order (unit_floats each) into parts[0..cap); returns how many it has. */
int prism_embed_cache_units(const prism_embed_cache_t *c, int entry, const float **parts, int cap);
void prism_embed_cache_unpin(prism_embed_cache_t *c, int entry);
/* Stores a copy of emb ([n_units][unit_floats], contiguous) under key, evicting least recently
 * used unpinned entries for room; does nothing when the unpinned entries cannot make room (or
 * n_units is out of range). An entry already present for key is refreshed, not rewritten. */
void prism_embed_cache_put(prism_embed_cache_t *c, uint64_t key, const float *emb, int n_units);

#endif
