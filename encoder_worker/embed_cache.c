#include "embed_cache.h"

#include <string.h>

size_t prism_embed_cache_bytes(size_t budget_bytes, size_t slot_floats)
{
    size_t slot = slot_floats * sizeof(float) + sizeof(uint64_t) * 2 + 1;
    return (budget_bytes / slot) * slot;
}

int prism_embed_cache_init(prism_embed_cache_t *c, size_t budget_bytes, size_t slot_floats)
{
    memset(c, 0, sizeof(*c));
    c->slot_floats = slot_floats;
    size_t slot = slot_floats * sizeof(float) + sizeof(uint64_t) * 2 + 1;
    c->n_slots = (int)PRISM_MIN(budget_bytes / slot, (size_t)1 << 20);
    if (!c->n_slots) return PRISM_OK;
    c->keys = prism_calloc((size_t)c->n_slots, sizeof(uint64_t));
    c->stamp = prism_calloc((size_t)c->n_slots, sizeof(uint64_t));
    c->used = prism_calloc((size_t)c->n_slots, sizeof(bool));
    c->data = prism_malloc_aligned((size_t)c->n_slots * slot_floats * sizeof(float), 64);
    if (!c->keys || !c->stamp || !c->used || !c->data) {
        prism_embed_cache_free(c);
        return PRISM_ENOMEM;
    }
    return PRISM_OK;
}

void prism_embed_cache_free(prism_embed_cache_t *c)
{
    prism_free(c->keys);
    prism_free(c->stamp);
    prism_free(c->used);
    prism_free_aligned(c->data);
    memset(c, 0, sizeof(*c));
}

const float *prism_embed_cache_get(prism_embed_cache_t *c, uint64_t key)
{
    for (int i = 0; i < c->n_slots; i++) {
        if (c->used[i] && c->keys[i] == key) {
            c->stamp[i] = ++c->clock;
            c->hits++;
            return c->data + (size_t)i * c->slot_floats;
        }
    }
    c->misses++;
    return NULL;
}

void prism_embed_cache_put(prism_embed_cache_t *c, uint64_t key, const float *emb)
{
    if (!c->n_slots) return;
    int victim = 0;
    for (int i = 0; i < c->n_slots; i++) {
        if (c->used[i] && c->keys[i] == key) { victim = i; break; }
        if (!c->used[i]) { victim = i; break; }
        if (c->stamp[i] < c->stamp[victim]) victim = i;
    }
    c->used[victim] = true;
    c->keys[victim] = key;
    c->stamp[victim] = ++c->clock;
    memcpy(c->data + (size_t)victim * c->slot_floats, emb, c->slot_floats * sizeof(float));
}
