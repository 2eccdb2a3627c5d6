#include "embed_cache.h"

#include <string.h>

size_t prism_embed_cache_slot_bytes(size_t slot_floats)
{
    return slot_floats * sizeof(float) + sizeof(uint64_t) * 2 + sizeof(uint32_t) + 1;
}

size_t prism_embed_cache_bytes(size_t budget_bytes, size_t slot_floats)
{
    size_t slot = prism_embed_cache_slot_bytes(slot_floats);
    return (budget_bytes / slot) * slot;
}

int prism_embed_cache_init(prism_embed_cache_t *c, size_t budget_bytes, size_t slot_floats)
{
    memset(c, 0, sizeof(*c));
    c->slot_floats = slot_floats;
    c->n_slots = (int)PRISM_MIN(budget_bytes / prism_embed_cache_slot_bytes(slot_floats), (size_t)1 << 20);
    if (!c->n_slots) return PRISM_OK;
    c->keys = prism_calloc((size_t)c->n_slots, sizeof(uint64_t));
    c->stamp = prism_calloc((size_t)c->n_slots, sizeof(uint64_t));
    c->used = prism_calloc((size_t)c->n_slots, sizeof(bool));
    c->pins = prism_calloc((size_t)c->n_slots, sizeof(uint32_t));
    c->data = prism_malloc_aligned((size_t)c->n_slots * slot_floats * sizeof(float), 64);
    if (!c->keys || !c->stamp || !c->used || !c->pins || !c->data) {
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
    prism_free(c->pins);
    prism_free_aligned(c->data);
    memset(c, 0, sizeof(*c));
}

int prism_embed_cache_get_pinned(prism_embed_cache_t *c, uint64_t key)
{
    for (int i = 0; i < c->n_slots; i++) {
        if (c->used[i] && c->keys[i] == key) {
            c->stamp[i] = ++c->clock;
            c->pins[i]++;
            c->hits++;
            return i;
        }
    }
    c->misses++;
    return -1;
}

const float *prism_embed_cache_data(const prism_embed_cache_t *c, int slot)
{
    PRISM_ASSERT(slot >= 0 && slot < c->n_slots && c->used[slot]);
    return c->data + (size_t)slot * c->slot_floats;
}

void prism_embed_cache_unpin(prism_embed_cache_t *c, int slot)
{
    PRISM_ASSERT(slot >= 0 && slot < c->n_slots && c->pins[slot] > 0);
    c->pins[slot]--;
}

void prism_embed_cache_put(prism_embed_cache_t *c, uint64_t key, const float *emb)
{
    int victim = -1;
    for (int i = 0; i < c->n_slots; i++) {
        if (c->used[i] && c->keys[i] == key) {
            victim = i;
            break;
        }
        if (c->pins[i]) continue;   /* someone reads it in place */
        if (!c->used[i]) {
            if (victim < 0 || c->used[victim]) victim = i;
            continue;
        }
        if (victim < 0 || (c->used[victim] && c->stamp[i] < c->stamp[victim])) victim = i;
    }
    if (victim < 0) return;   /* everything is pinned: this one is simply not cached */
    c->stamp[victim] = ++c->clock;
    if (c->used[victim] && c->keys[victim] == key && c->pins[victim]) return;
    c->used[victim] = true;
    c->keys[victim] = key;
    memcpy(c->data + (size_t)victim * c->slot_floats, emb, c->slot_floats * sizeof(float));
}
