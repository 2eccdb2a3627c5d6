#include "prefix_index.h"

#include <string.h>

#define MIN_SLOTS 1024u

static bool key_empty(prism_kv_key_t k) { return !k.lo && !k.hi; }
static bool key_eq(prism_kv_key_t a, prism_kv_key_t b) { return a.lo == b.lo && a.hi == b.hi; }

void router_prefix_index_init(router_prefix_index_t *x, uint32_t max_keys)
{
    memset(x, 0, sizeof *x);
    x->max_keys = PRISM_MIN(max_keys, ROUTER_PREFIX_MAX_KEYS);
}

void router_prefix_index_free(router_prefix_index_t *x)
{
    prism_free(x->slots);
    x->slots = NULL;
    x->mask = x->n = 0;
}

void router_prefix_index_clear(router_prefix_index_t *x)
{
    if (x->slots) memset(x->slots, 0, sizeof(*x->slots) * ((size_t)x->mask + 1));
    x->n = 0;
}

static uint32_t find(const router_prefix_index_t *x, prism_kv_key_t k)
{
    uint32_t s = (uint32_t)k.lo & x->mask;
    while (!key_empty(x->slots[s]) && !key_eq(x->slots[s], k)) s = (s + 1) & x->mask;
    return s;
}

/* Room for one more key at most half full: false when the memory is not there (the key is not kept). */
static bool grow(router_prefix_index_t *x)
{
    uint32_t size = x->mask ? x->mask + 1 : 0;
    if (size && 2 * (x->n + 1) <= size) return true;
    uint32_t ns = size ? 2 * size : MIN_SLOTS;
    prism_kv_key_t *t = prism_calloc(ns, sizeof *t);
    if (!t) return false;
    prism_kv_key_t *old = x->slots;
    x->slots = t;
    x->mask = ns - 1;
    for (uint32_t i = 0; i < size; i++)
        if (!key_empty(old[i])) x->slots[find(x, old[i])] = old[i];
    prism_free(old);
    return true;
}

void router_prefix_index_add(router_prefix_index_t *x, prism_kv_key_t k)
{
    if (key_empty(k) || router_prefix_index_has(x, k)) return;
    if (x->n >= x->max_keys) {
        /* more than the worker's pool holds: events were lost or made up; start again from the next ones */
        router_prefix_index_clear(x);
        x->resets++;
    }
    if (!grow(x)) return;
    x->slots[find(x, k)] = k;
    x->n++;
}

void router_prefix_index_del(router_prefix_index_t *x, prism_kv_key_t k)
{
    if (!x->mask || key_empty(k)) return;
    uint32_t s = find(x, k);
    if (key_empty(x->slots[s])) return;
    /* backward-shift deletion (as kv/prefix.c): no tombstones */
    uint32_t hole = s, j = s;
    for (;;) {
        j = (j + 1) & x->mask;
        if (key_empty(x->slots[j])) break;
        uint32_t home = (uint32_t)x->slots[j].lo & x->mask;
        if (((j - home) & x->mask) >= ((j - hole) & x->mask)) {
            x->slots[hole] = x->slots[j];
            hole = j;
        }
    }
    x->slots[hole] = (prism_kv_key_t){0, 0};
    x->n--;
}

bool router_prefix_index_has(const router_prefix_index_t *x, prism_kv_key_t k)
{
    return x->mask && !key_empty(k) && key_eq(x->slots[find(x, k)], k);
}

int router_prefix_index_match(const router_prefix_index_t *x, const prism_kv_key_t *keys, int n)
{
    int h = 0;
    while (h < n && router_prefix_index_has(x, keys[h])) h++;
    return h;
}

bool router_prefix_index_apply(router_prefix_index_t *x, const Prism__PrefixEvents *ev)
{
    const size_t kb = PRISM_KV_PREFIX_KEY_BYTES, max = PRISM_KV_PREFIX_EVENTS * kb;
    if (!ev || ev->stored.len % kb || ev->evicted.len % kb || ev->stored.len > max || ev->evicted.len > max)
        return false;
    const uint8_t *stored = ev->stored.data, *evicted = ev->evicted.data;
    size_t n_stored = ev->stored.len / kb, n_evicted = ev->evicted.len / kb;
    if (ev->reset) {
        router_prefix_index_clear(x);
        x->resets++;
    }
    prism_kv_key_t k;
    for (size_t i = 0; i < n_evicted; i++) {
        prism_kv_prefix_keys_get(evicted + i * PRISM_KV_PREFIX_KEY_BYTES, 1, &k);
        router_prefix_index_del(x, k);
    }
    for (size_t i = 0; i < n_stored; i++) {
        prism_kv_prefix_keys_get(stored + i * PRISM_KV_PREFIX_KEY_BYTES, 1, &k);
        router_prefix_index_add(x, k);
    }
    return true;
}
