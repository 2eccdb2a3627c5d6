/* kv: the paged-KV block manager (ids only; the K/V storage lives in the model's
 * prism_kv_cache_t). Blocks are fixed-size, allocated all-or-nothing from a pool sized at
 * start-up, so admission control is a question of "are there n free blocks?".
 *
 * Sharing: a block may have several holders (the n sequences of one request share the full
 * blocks of their prompt). alloc makes the caller the only holder, share adds one holder per
 * block, release drops one and frees a block when its last holder lets go. Shared blocks are
 * read-only by convention: a sequence writes only positions past the shared prefix, which lie in
 * blocks it holds alone (the prompt's last, partial block is copied per sequence). */
#ifndef PRISM_KV_H
#define PRISM_KV_H

#include "core/core.h"

#define PRISM_KV_MAX_HOLDERS 65535

typedef struct {
    int32_t *free_ids;   /* [n_blocks] stack of free block ids */
    uint16_t *holders;   /* [n_blocks] sequences holding each block; 0 = free */
    int n_free;
    int n_blocks;
    int block_size;      /* tokens per block */
} prism_kv_blocks_t;

int  prism_kv_blocks_init(prism_kv_blocks_t *b, int n_blocks, int block_size);
/* Heap prism_kv_blocks_init takes for n_blocks (a worker's memory plan counts it). */
static inline size_t prism_kv_blocks_bytes(int n_blocks) { return (size_t)n_blocks * (sizeof(int32_t) + sizeof(uint16_t)); }
void prism_kv_blocks_free_all(prism_kv_blocks_t *b);
/* Allocates n blocks into out, or none: PRISM_EAGAIN when fewer than n are free. */
int  prism_kv_blocks_alloc(prism_kv_blocks_t *b, int n, int32_t *out);
/* One more holder for each of ids[0..n) (each must be held already): PRISM_ELIMIT, and nothing
 * changed, when a block would pass PRISM_KV_MAX_HOLDERS. */
int  prism_kv_blocks_share(prism_kv_blocks_t *b, const int32_t *ids, int n);
/* Drops one holder of each; a block with no holder left is free again. */
void prism_kv_blocks_release(prism_kv_blocks_t *b, const int32_t *ids, int n);
static inline int prism_kv_blocks_holders(const prism_kv_blocks_t *b, int32_t id) { return b->holders[id]; }
static inline int prism_kv_blocks_for_tokens(const prism_kv_blocks_t *b, int n_tokens)
{
    return (n_tokens + b->block_size - 1) / b->block_size;
}
/* Blocks n sequences need when they share a prompt of n_prompt tokens and each runs to total
 * tokens (prompt included): the prompt's full blocks once, the rest (the partial prompt block
 * copied, and the generated tokens) per sequence. */
static inline int prism_kv_blocks_for_shared(const prism_kv_blocks_t *b, int n_prompt, int total, int n)
{
    int shared = n_prompt / b->block_size;
    return shared + n * (prism_kv_blocks_for_tokens(b, total) - shared);
}
static inline double prism_kv_blocks_usage(const prism_kv_blocks_t *b)
{
    return b->n_blocks ? 1.0 - (double)b->n_free / b->n_blocks : 0.0;
}

/* KV transfers (prefill -> decode, Kv in prism.proto) travel in pieces of about PRISM_KV_PIECE_BYTES,
 * so the receiver holds a few pieces outside its block pool whatever the prompt's length (a whole
 * 16k-token prompt is ~1 GiB at 7B shapes). The transfer's blocks are numbered in frame order: the
 * n_blocks of the first part (full_bytes each), then the second part's (local_bytes each). */
#define PRISM_KV_PIECE_BYTES ((size_t)1 << 20)

/* Blocks of one piece (at least one) when no block is larger than max_block_bytes. */
static inline int prism_kv_piece_blocks(size_t max_block_bytes)
{
    return max_block_bytes >= PRISM_KV_PIECE_BYTES || !max_block_bytes ? 1 : (int)(PRISM_KV_PIECE_BYTES / max_block_bytes);
}

/* Byte offset of block i (frame order) in a transfer whose first part has n_blocks blocks. */
static inline size_t prism_kv_piece_offset(int n_blocks, size_t full_bytes, size_t local_bytes, int i)
{
    return (size_t)PRISM_MIN(i, n_blocks) * full_bytes + (size_t)PRISM_MAX(i - n_blocks, 0) * local_bytes;
}

/* The element type of a transfer's frames (Kv.wire_dtype, the same values): fp32 as the caches hold
 * it (bit-exact), or bf16 (half the bytes; rounded to nearest even by the sender, widened exactly by
 * the receiver into its fp32 cache). Every block size in the header is the wire's. */
typedef enum { PRISM_KV_WIRE_F32 = 0, PRISM_KV_WIRE_BF16 = 1 } prism_kv_wire_t;

/* Bytes on the wire of what the fp32 caches hold in f32_bytes (a multiple of 4). */
static inline size_t prism_kv_wire_bytes(prism_kv_wire_t w, size_t f32_bytes)
{
    return w == PRISM_KV_WIRE_BF16 ? f32_bytes / 2 : f32_bytes;
}

/* --kv-transfer-dtype (what a prefill or decode worker sends): "auto" is bf16 when the worker
 * computes in bf16 (compute_dtype, its --compute-dtype, is "bf16"), else f32. PRISM_EINVAL for
 * another value. */
#define PRISM_KV_WIRE_FLAG_HELP                                                                              \
    "KV transfers this worker sends: auto (bf16 when --compute-dtype bf16, else f32), f32 (the cache's "    \
    "values, bit-exact) or bf16 (half the bytes; rounded to nearest even; a receiver widens them into "     \
    "its fp32 cache, whatever its own flags)"
int prism_kv_wire_parse(const char *flag, const char *compute_dtype, prism_kv_wire_t *out);
const char *prism_kv_wire_name(prism_kv_wire_t w);

/* Rounds n fp32 values at buf to bf16 (nearest even) in place: they end up as n bf16 at buf's start
 * (each write lands below every value not read yet). No allocation: a sender narrows its export
 * staging. */
void prism_kv_wire_narrow(void *buf, size_t n);
/* Widens n bf16 values at src into n fp32 at dst (exact; dst does not overlap src). */
void prism_kv_wire_widen(const void *src, size_t n, void *dst);

#endif
