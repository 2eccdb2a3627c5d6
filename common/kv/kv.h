/* kv: the paged-KV block manager (ids only; the K/V storage lives in the model's
 * prism_kv_cache_t). Blocks are fixed-size, allocated all-or-nothing from a pool sized at
 * start-up, so admission control is a question of "are there n free blocks?". */
#ifndef PRISM_KV_H
#define PRISM_KV_H

#include "core/core.h"

typedef struct {
    int32_t *free_ids;   /* [n_blocks] stack of free block ids */
    int n_free;
    int n_blocks;
    int block_size;      /* tokens per block */
} prism_kv_blocks_t;

int  prism_kv_blocks_init(prism_kv_blocks_t *b, int n_blocks, int block_size);
void prism_kv_blocks_free_all(prism_kv_blocks_t *b);
/* Allocates n blocks into out, or none: PRISM_EAGAIN when fewer than n are free. */
int  prism_kv_blocks_alloc(prism_kv_blocks_t *b, int n, int32_t *out);
void prism_kv_blocks_release(prism_kv_blocks_t *b, const int32_t *ids, int n);
static inline int prism_kv_blocks_for_tokens(const prism_kv_blocks_t *b, int n_tokens)
{
    return (n_tokens + b->block_size - 1) / b->block_size;
}
static inline double prism_kv_blocks_usage(const prism_kv_blocks_t *b)
{
    return b->n_blocks ? 1.0 - (double)b->n_free / b->n_blocks : 0.0;
}

#endif
