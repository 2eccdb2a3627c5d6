#include "kv/kv.h"

#include <string.h>

#include "backend/dtype.h"

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

int prism_kv_wire_parse(const char *flag, const char *compute_dtype, prism_kv_wire_t *out)
{
    if (!strcmp(flag, "auto")) *out = compute_dtype && !strcmp(compute_dtype, "bf16") ? PRISM_KV_WIRE_BF16 : PRISM_KV_WIRE_F32;
    else if (!strcmp(flag, "f32")) *out = PRISM_KV_WIRE_F32;
    else if (!strcmp(flag, "bf16")) *out = PRISM_KV_WIRE_BF16;
    else return PRISM_EINVAL;
    return PRISM_OK;
}

const char *prism_kv_wire_name(prism_kv_wire_t w) { return w == PRISM_KV_WIRE_BF16 ? "bf16" : "f32"; }

/* Both in chunks through local arrays: the values are read before any is written (narrow works in
 * place), and the loops over the arrays vectorize. */
#define WIRE_CHUNK 256

void prism_kv_wire_narrow(void *buf, size_t n)
{
    uint8_t *b = buf;
    float f[WIRE_CHUNK];
    uint16_t h[WIRE_CHUNK];
    for (size_t i = 0; i < n; i += WIRE_CHUNK) {
        size_t m = PRISM_MIN((size_t)WIRE_CHUNK, n - i);
        memcpy(f, b + 4 * i, 4 * m);   /* its output [2i, 2i + 2m) lies below what is left to read */
        if (m == WIRE_CHUNK)   /* a constant count: vectorized at -O2 too */
            for (size_t j = 0; j < WIRE_CHUNK; j++) h[j] = prism_f32_to_bf16(f[j]);
        else
            for (size_t j = 0; j < m; j++) h[j] = prism_f32_to_bf16(f[j]);
        memcpy(b + 2 * i, h, 2 * m);
    }
}

void prism_kv_wire_widen(const void *src, size_t n, void *dst)
{
    const uint8_t *s = src;
    uint8_t *d = dst;
    uint16_t h[WIRE_CHUNK];
    float f[WIRE_CHUNK];
    for (size_t i = 0; i < n; i += WIRE_CHUNK) {
        size_t m = PRISM_MIN((size_t)WIRE_CHUNK, n - i);
        memcpy(h, s + 2 * i, 2 * m);
        if (m == WIRE_CHUNK)
            for (size_t j = 0; j < WIRE_CHUNK; j++) f[j] = prism_bf16_to_f32(h[j]);
        else
            for (size_t j = 0; j < m; j++) f[j] = prism_bf16_to_f32(h[j]);
        memcpy(d + 4 * i, f, 4 * m);
    }
}
