/* swap: the decode worker's KV swap region (issue 28: preemption by swap).
 *
 * When the block pool runs out, a preempted sequence whose blocks fit here keeps its slot and its
 * sampling state and leaves only its KV: its blocks are copied into slots of this host region and
 * freed in the pool (swap out); once the pool has room again they are copied back into fresh
 * blocks (swap in) and the sequence goes on from the token it stopped at. A slot holds one block
 * of the pool's layers (every layer, or the full-attention ones of a split cache: the chunked
 * layers' rings belong to the sequence's batch slot and stay where they are).
 *
 * Memory: the caller owns the region's bytes (the decode worker carves them from its memory plan,
 * --kv-swap-bytes, and on a device page-locks them with the backend's host_pin, so the copies below
 * are one DMA each); the slot bookkeeping is a prism_kv_blocks_t (kv/kv.h, the pool's own free
 * stack, prism_kv_blocks_bytes(n_slots) of heap). Copies go through the model's KV export/import
 * (prism_kv_cache_export / _class), so through the backend's blocks_to_host / blocks_from_host:
 * on a device they are device <-> host copies, on the CPU memcpy. Not thread-safe: the worker's
 * loop owns it.
 *
 *   prism_kv_swap_t sw;
 *   prism_kv_swap_init(&sw, bytes, n_slots, slot_bytes, PRISM_KV_CLASS_FULL);
 *   if (prism_kv_swap_fits(&sw, n) && prism_kv_swap_out(&sw, kv, blocks, n, slots) == PRISM_OK)
 *       ... release blocks in the pool ...
 *   ... later, n fresh blocks allocated ...
 *   prism_kv_swap_in(&sw, kv, slots, n, blocks);   // the slots are free again
 *   prism_kv_swap_free(&sw); */
#ifndef PRISM_DECODE_SWAP_H
#define PRISM_DECODE_SWAP_H

#include "core/core.h"
#include "kv/kv.h"
#include "model/model.h"

typedef struct {
    uint8_t *bytes;           /* [n_slots][slot_bytes] host memory, the caller's */
    size_t slot_bytes;        /* one block of the pool's layers */
    int cls;                  /* the pool's layers: PRISM_KV_CLASS_FULL (a split cache) or -1 (every layer) */
    prism_kv_blocks_t slots;  /* free slots (n_blocks 0: swap is off) */
    uint64_t swapped_out;     /* sequences swapped out since start (a counter) */
    uint64_t swapped_in;
} prism_kv_swap_t;

/* n_slots 0 (or bytes NULL) turns swap off: nothing ever fits. PRISM_EINVAL for a bad argument,
 * PRISM_ENOMEM when the bookkeeping cannot be had. */
int  prism_kv_swap_init(prism_kv_swap_t *sw, void *bytes, int n_slots, size_t slot_bytes, int cls);
void prism_kv_swap_free(prism_kv_swap_t *sw);

/* Whether n blocks fit in the free slots now. */
static inline bool prism_kv_swap_fits(const prism_kv_swap_t *sw, int n)
{
    return sw->slots.n_blocks > 0 && n > 0 && n <= sw->slots.n_free;
}

/* Copies the pool's blocks[0..n) into n free slots (written to slots[0..n)); the blocks are left
 * as they are (the caller frees them in the pool). PRISM_EAGAIN when they do not fit; on a copy
 * error nothing is held (the slots are free again) and the error is returned. */
int  prism_kv_swap_out(prism_kv_swap_t *sw, prism_kv_cache_t *kv, const int32_t *blocks, int n, int32_t *slots);
/* Copies slots[0..n) into the pool's blocks[0..n) (allocated by the caller) and frees the slots,
 * whatever the copy's result (a failed copy leaves the sequence without its KV: the caller fails it). */
int  prism_kv_swap_in(prism_kv_swap_t *sw, prism_kv_cache_t *kv, const int32_t *slots, int n, const int32_t *blocks);
/* Frees slots without copying them back (the sequence ended while swapped out). */
void prism_kv_swap_release(prism_kv_swap_t *sw, const int32_t *slots, int n);

static inline size_t prism_kv_swap_used_bytes(const prism_kv_swap_t *sw)
{
    return (size_t)(sw->slots.n_blocks - sw->slots.n_free) * sw->slot_bytes;
}

#endif
