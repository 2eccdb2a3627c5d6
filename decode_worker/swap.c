/* swap: the decode worker's KV swap region (swap.h). */
#include "swap.h"

#include <string.h>

int prism_kv_swap_init(prism_kv_swap_t *sw, void *bytes, int n_slots, size_t slot_bytes, int cls)
{
    memset(sw, 0, sizeof(*sw));
    sw->cls = cls;
    sw->slot_bytes = slot_bytes;
    if (n_slots < 0 || (n_slots > 0 && (!bytes || !slot_bytes)) ||
        (cls != -1 && cls != PRISM_KV_CLASS_FULL && cls != PRISM_KV_CLASS_LOCAL))
        return PRISM_EINVAL;
    if (n_slots == 0 || !bytes) return PRISM_OK;   /* off */
    sw->bytes = bytes;
    /* the block size is not used: slots are whole blocks */
    return prism_kv_blocks_init(&sw->slots, n_slots, 1);
}

void prism_kv_swap_free(prism_kv_swap_t *sw)
{
    prism_kv_blocks_free_all(&sw->slots);
    sw->bytes = NULL;
}

/* Copies between the pool's blocks and the slots, a run of consecutive slots per call (the free
 * stack hands out ascending ids when the region is not fragmented: one copy, one synchronisation). */
static int copy(prism_kv_swap_t *sw, prism_kv_cache_t *kv, const int32_t *blocks, const int32_t *slots, int n,
                bool out)
{
    int rc = PRISM_OK;
    for (int i = 0; i < n && rc == PRISM_OK;) {
        int m = 1;
        while (i + m < n && slots[i + m] == slots[i] + m) m++;
        uint8_t *h = sw->bytes + (size_t)slots[i] * sw->slot_bytes;
        if (sw->cls < 0) rc = out ? prism_kv_cache_export(kv, blocks + i, m, h) : prism_kv_cache_import(kv, blocks + i, m, h);
        else rc = out ? prism_kv_cache_export_class(kv, sw->cls, blocks + i, m, h)
                      : prism_kv_cache_import_class(kv, sw->cls, blocks + i, m, h);
        i += m;
    }
    return rc;
}

int prism_kv_swap_out(prism_kv_swap_t *sw, prism_kv_cache_t *kv, const int32_t *blocks, int n, int32_t *slots)
{
    if (n < 0 || (n > 0 && (!blocks || !slots))) return PRISM_EINVAL;
    if (!prism_kv_swap_fits(sw, n)) return PRISM_EAGAIN;
    int rc = prism_kv_blocks_alloc(&sw->slots, n, slots);
    if (rc != PRISM_OK) return rc;
    if ((rc = copy(sw, kv, blocks, slots, n, true)) != PRISM_OK) {
        prism_kv_blocks_release(&sw->slots, slots, n);
        return rc;
    }
    sw->swapped_out++;
    return PRISM_OK;
}

int prism_kv_swap_in(prism_kv_swap_t *sw, prism_kv_cache_t *kv, const int32_t *slots, int n, const int32_t *blocks)
{
    if (n < 0 || (n > 0 && (!blocks || !slots))) return PRISM_EINVAL;
    int rc = copy(sw, kv, blocks, slots, n, false);
    prism_kv_swap_release(sw, slots, n);
    sw->swapped_in += rc == PRISM_OK;
    return rc;
}

void prism_kv_swap_release(prism_kv_swap_t *sw, const int32_t *slots, int n)
{
    /* last first: the stack hands them out again in the order they were taken (ascending runs) */
    for (int i = n - 1; i >= 0; i--) prism_kv_blocks_release(&sw->slots, slots + i, 1);
}
