/* Tensor-parallel shards of the language model: which heads, columns and vocab rows each rank
 * holds (the rules are in model.h, prism_tp_shard_t). */
#include "model/model.h"

#include <string.h>

#include <stdio.h>

#define ERR(...) do { if (err && errlen) snprintf(err, errlen, __VA_ARGS__); } while (0)

/* [lo, hi) of n split over size parts as evenly as possible. */
static void split(int n, int size, int rank, int *lo, int *cnt)
{
    int64_t a = (int64_t)n * rank / size, b = (int64_t)n * (rank + 1) / size;
    *lo = (int)a;
    *cnt = (int)(b - a);
}

int prism_tp_shard(const prism_model_config_t *c, int size, int rank, prism_tp_shard_t *out, char *err, size_t errlen)
{
    if (size < 1 || size > 1024 || rank < 0 || rank >= size) {
        ERR("tensor parallel: rank %d of %d", rank, size);
        return PRISM_EINVAL;
    }
    int nh = c->n_heads, nkv = c->n_kv_heads;
    if (nh <= 0 || nkv <= 0 || nh % nkv) {
        ERR("tensor parallel: bad head counts (%d query, %d KV)", nh, nkv);
        return PRISM_EINVAL;
    }
    if (nh % size) {
        ERR("tensor parallel size %d: the %d query heads do not divide evenly", size, nh);
        return PRISM_ENOTSUP;
    }
    if (nkv % size && size % nkv) {
        ERR("tensor parallel size %d with %d KV heads: the KV heads must be a multiple of the size, or the size a "
            "multiple of the KV heads (then each KV head is replicated)", size, nkv);
        return PRISM_ENOTSUP;
    }
    bool moe = c->n_experts > 0;
    int dense_w = c->dense_intermediate > 0 ? c->dense_intermediate : c->intermediate;
    if (c->vocab < size || dense_w < size || (moe && c->intermediate < size)) {
        ERR("tensor parallel size %d: the vocabulary (%d) or an MLP width (%d, %d) is smaller than the group", size,
            c->vocab, dense_w, c->intermediate);
        return PRISM_ENOTSUP;
    }
    prism_tp_shard_t s = {.size = size, .rank = rank};
    s.n_heads = nh / size;
    s.head0 = rank * s.n_heads;
    if (nkv >= size) {
        s.n_kv_heads = nkv / size;
        s.kv_head0 = rank * s.n_kv_heads;
        s.kv_replicas = 1;
    } else {
        s.n_kv_heads = 1;
        s.kv_replicas = size / nkv;
        s.kv_head0 = rank / s.kv_replicas;
    }
    /* The rule above keeps every local query head inside the local KV heads' GQA groups. */
    int group = nh / nkv;
    PRISM_ASSERT(s.head0 / group >= s.kv_head0 && (s.head0 + s.n_heads - 1) / group < s.kv_head0 + s.n_kv_heads);
    split(c->vocab, size, rank, &s.vocab0, &s.n_vocab);
    s.vocab_stride = (c->vocab + size - 1) / size;   /* the widest rank's rows: gather slot width */
    split(dense_w, size, rank, &s.ffn0, &s.n_ffn);
    split(c->intermediate, size, rank, &s.eff0, &s.n_eff);
    *out = s;
    return PRISM_OK;
}

int prism_model_config_set_tp(prism_model_config_t *c, int size, int rank, char *err, size_t errlen)
{
    prism_tp_shard_t s;
    int rc = prism_tp_shard(c, size, rank, &s, err, errlen);
    if (rc != PRISM_OK) return rc;
    c->tp_size = size;
    c->tp_rank = rank;
    return PRISM_OK;
}

int prism_model_local_kv_heads(const prism_model_config_t *c)
{
    if (c->tp_size <= 1) return c->n_kv_heads;
    prism_tp_shard_t s;
    PRISM_ASSERT(prism_tp_shard(c, c->tp_size, c->tp_rank, &s, NULL, 0) == PRISM_OK);
    return s.n_kv_heads;
}

void prism_kv_merge_heads(const prism_model_config_t *c, int block_size, int n_blocks, const void *part, int head0,
                          int n_heads, void *whole)
{
    PRISM_ASSERT(head0 >= 0 && n_heads >= 1 && head0 + n_heads <= c->n_kv_heads);
    size_t hd = (size_t)c->head_dim * sizeof(float);
    size_t rows = (size_t)n_blocks * c->n_layers * 2 * block_size;
    const uint8_t *s = part;
    uint8_t *d = whole;
    for (size_t i = 0; i < rows; i++)
        memcpy(d + (i * c->n_kv_heads + head0) * hd, s + i * n_heads * hd, n_heads * hd);
}

void prism_kv_slice_heads(const prism_model_config_t *c, int block_size, int n_blocks, const void *src, int head0,
                          int n_heads, void *dst)
{
    PRISM_ASSERT(head0 >= 0 && n_heads >= 1 && head0 + n_heads <= c->n_kv_heads);
    /* Both layouts are [n_blocks][n_layers][2][block_size][heads][head_dim]: one row per token of
     * each layer's K and V, of which this rank takes a contiguous run of heads. */
    size_t hd = (size_t)c->head_dim * sizeof(float);
    size_t rows = (size_t)n_blocks * c->n_layers * 2 * block_size;
    const uint8_t *s = src;
    uint8_t *d = dst;
    for (size_t i = 0; i < rows; i++)
        memcpy(d + i * n_heads * hd, s + (i * c->n_kv_heads + head0) * hd, n_heads * hd);
}
