#include "embed_cache.h"

#include <string.h>

size_t prism_embed_cache_unit_bytes(size_t unit_floats)
{
    /* the unit's floats, its chain link and free-stack entry, and one entry's bookkeeping */
    return unit_floats * sizeof(float) + 2 * sizeof(int32_t) + sizeof(uint64_t) * 2 + sizeof(uint32_t) +
           2 * sizeof(int32_t) + 1;
}

size_t prism_embed_cache_bytes(size_t budget_bytes, size_t unit_floats)
{
    size_t unit = prism_embed_cache_unit_bytes(unit_floats);
    return (budget_bytes / unit) * unit;
}

int prism_embed_cache_init(prism_embed_cache_t *c, size_t budget_bytes, size_t unit_floats, int max_units)
{
    memset(c, 0, sizeof(*c));
    c->unit_floats = unit_floats;
    c->max_units = max_units;
    c->n_units = (int)PRISM_MIN(budget_bytes / prism_embed_cache_unit_bytes(unit_floats), (size_t)1 << 20);
    if (!c->n_units || max_units < 1) {
        c->n_units = 0;
        return PRISM_OK;
    }
    size_t n = (size_t)c->n_units;
    c->keys = prism_calloc(n, sizeof(uint64_t));
    c->stamp = prism_calloc(n, sizeof(uint64_t));
    c->used = prism_calloc(n, sizeof(bool));
    c->pins = prism_calloc(n, sizeof(uint32_t));
    c->first = prism_calloc(n, sizeof(int32_t));
    c->len = prism_calloc(n, sizeof(int32_t));
    c->next = prism_calloc(n, sizeof(int32_t));
    c->free_units = prism_calloc(n, sizeof(int32_t));
    c->data = prism_malloc_aligned(n * unit_floats * sizeof(float), 64);
    if (!c->keys || !c->stamp || !c->used || !c->pins || !c->first || !c->len || !c->next || !c->free_units ||
        !c->data) {
        prism_embed_cache_free(c);
        return PRISM_ENOMEM;
    }
    for (int i = c->n_units - 1; i >= 0; i--) c->free_units[c->n_free++] = i;
    return PRISM_OK;
}

void prism_embed_cache_free(prism_embed_cache_t *c)
{
    prism_free(c->keys);
    prism_free(c->stamp);
    prism_free(c->used);
    prism_free(c->pins);
    prism_free(c->first);
    prism_free(c->len);
    prism_free(c->next);
    prism_free(c->free_units);
    prism_free_aligned(c->data);
    memset(c, 0, sizeof(*c));
}

int prism_embed_cache_get_pinned(prism_embed_cache_t *c, uint64_t key)
{
    for (int i = 0; i < c->n_units; i++) {
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

int prism_embed_cache_units(const prism_embed_cache_t *c, int entry, const float **parts, int cap)
{
    PRISM_ASSERT(entry >= 0 && entry < c->n_units && c->used[entry]);
    int k = 0;
    for (int u = c->first[entry]; u >= 0; u = c->next[u], k++)
        if (k < cap) parts[k] = c->data + (size_t)u * c->unit_floats;
    PRISM_ASSERT(k == c->len[entry]);
    return k;
}

void prism_embed_cache_unpin(prism_embed_cache_t *c, int entry)
{
    PRISM_ASSERT(entry >= 0 && entry < c->n_units && c->pins[entry] > 0);
    c->pins[entry]--;
}

static void evict(prism_embed_cache_t *c, int e)
{
    for (int u = c->first[e]; u >= 0; u = c->next[u]) c->free_units[c->n_free++] = u;
    c->used[e] = false;
    c->len[e] = 0;
}

void prism_embed_cache_put(prism_embed_cache_t *c, uint64_t key, const float *emb, int n_units)
{
    if (n_units < 1 || n_units > c->max_units || n_units > c->n_units) return;
    int slot = -1;
    size_t reclaimable = (size_t)c->n_free;
    for (int i = 0; i < c->n_units; i++) {
        if (c->used[i] && c->keys[i] == key) {
            c->stamp[i] = ++c->clock;   /* present (maybe pinned): refreshed, never rewritten */
            return;
        }
        if (!c->used[i]) {
            if (slot < 0) slot = i;
        } else if (!c->pins[i]) {
            reclaimable += (size_t)c->len[i];
        }
    }
    if (reclaimable < (size_t)n_units) return;   /* pinned entries hold the rest: not cached */
    while (c->n_free < n_units) {
        int victim = -1;
        for (int i = 0; i < c->n_units; i++)
            if (c->used[i] && !c->pins[i] && (victim < 0 || c->stamp[i] < c->stamp[victim])) victim = i;
        PRISM_ASSERT(victim >= 0);
        evict(c, victim);
        if (slot < 0) slot = victim;
    }
    PRISM_ASSERT(slot >= 0);   /* a free unit means fewer than n_units entries are in use */
    c->used[slot] = true;
    c->keys[slot] = key;
    c->stamp[slot] = ++c->clock;
    c->len[slot] = n_units;
    int32_t *link = &c->first[slot];
    for (int k = 0; k < n_units; k++) {
        int u = c->free_units[--c->n_free];
        memcpy(c->data + (size_t)u * c->unit_floats, emb + (size_t)k * c->unit_floats, c->unit_floats * sizeof(float));
        *link = u;
        link = &c->next[u];
    }
    *link = -1;
}
