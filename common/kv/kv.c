#include "kv/kv.h"

int prism_kv_blocks_init(prism_kv_blocks_t *b, int n_blocks, int block_size)
{
    if (n_blocks <= 0 || block_size <= 0) return PRISM_EINVAL;
    b->free_ids = prism_malloc(sizeof(int32_t) * (size_t)n_blocks);
    b->holders = prism_calloc((size_t)n_blocks, sizeof(uint16_t));
    if (!b->free_ids || !b->holders) {
        prism_free(b->free_ids);
        prism_free(b->holders);
        b->free_ids = NULL;
        b->holders = NULL;
        return PRISM_ENOMEM;
    }
    /* Low ids on top of the stack: makes traces and tests easier to read. */
    for (int i = 0; i < n_blocks; i++)
        b->free_ids[i] = n_blocks - 1 - i;
    b->n_free = n_blocks;
    b->n_blocks = n_blocks;
    b->block_size = block_size;
    return PRISM_OK;
}

void prism_kv_blocks_free_all(prism_kv_blocks_t *b)
{
    prism_free(b->free_ids);
    prism_free(b->holders);
    b->free_ids = NULL;
    b->holders = NULL;
    b->n_free = b->n_blocks = 0;
}

int prism_kv_blocks_alloc(prism_kv_blocks_t *b, int n, int32_t *out)
{
    if (n < 0) return PRISM_EINVAL;
    if (n > b->n_free) return PRISM_EAGAIN;
    for (int i = 0; i < n; i++) {
        out[i] = b->free_ids[--b->n_free];
        PRISM_ASSERT(b->holders[out[i]] == 0);
        b->holders[out[i]] = 1;
    }
    return PRISM_OK;
}

int prism_kv_blocks_share(prism_kv_blocks_t *b, const int32_t *ids, int n)
{
    for (int i = 0; i < n; i++) {
        PRISM_ASSERT(ids[i] >= 0 && ids[i] < b->n_blocks && b->holders[ids[i]] > 0);
        if (b->holders[ids[i]] >= PRISM_KV_MAX_HOLDERS) return PRISM_ELIMIT;
    }
    for (int i = 0; i < n; i++) b->holders[ids[i]]++;
    return PRISM_OK;
}

void prism_kv_blocks_release(prism_kv_blocks_t *b, const int32_t *ids, int n)
{
    for (int i = 0; i < n; i++) {
        PRISM_ASSERT(ids[i] >= 0 && ids[i] < b->n_blocks);
        PRISM_ASSERT(b->holders[ids[i]] > 0);
        if (--b->holders[ids[i]]) continue;
        PRISM_ASSERT(b->n_free < b->n_blocks);
        b->free_ids[b->n_free++] = ids[i];
    }
}
