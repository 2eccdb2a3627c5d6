/* Internal to prism_model: the two-pass weight loader shared by the language model and the
 * vision tower, and the arena layout helper. */
#ifndef PRISM_MODEL_IMPL_H
#define PRISM_MODEL_IMPL_H

#include "model/model.h"
#include "model/safetensors.h"

#define PRISM_TENSOR_ALIGN 256

/* Pass 1 (base == NULL) only validates names/shapes and sums sizes; pass 2 carves `base` (one
 * backend allocation) and uploads, converting bf16/f16/f32 to the requested dtype. */
typedef struct {
    prism_backend_t *be;
    const prism_st_t *st;
    uint8_t *base;
    size_t off;
    size_t total;          /* bytes after pass 1 */
    float *staging;        /* host conversion buffer */
    size_t staging_n;      /* floats */
    size_t loaded_bytes, next_log;
    int n_tensors;
    char *err;
    size_t errlen;
    bool random;           /* no checkpoint: fill every tensor from a seeded RNG */
    uint64_t seed;
    size_t read_bytes;     /* bytes read from the checkpoint (its dtype): only a rank's slices */
    int n_packed;          /* matmul weights the backend rearranged (prism_wload_pack_matmul) */
} prism_wload_t;

/* A range [lo, hi) along the sliced axis of prism_wload_fill_slice. */
typedef struct {
    int64_t lo, hi;
} prism_wload_range_t;

/* Between the passes: the one weight block of the size pass 1 summed (*buf, *bytes, on w->be) and the
 * host staging buffer, w set for pass 2. PRISM_ENOMEM (with err) when either cannot be had; the
 * caller frees w->staging after pass 2 (and the block with its model). */
int prism_wload_begin_upload(prism_wload_t *w, void **buf, size_t *bytes);
/* Reserves bytes in the weight block (aligned); returns the device pointer in pass 2, NULL in pass 1. */
void *prism_wload_reserve(prism_wload_t *w, size_t bytes);
/* Finds `name`, checks its shape against shape[ndim] (numel check when ndim < 0 with shape[0]
 * = numel), and in pass 2 writes it at dst (dtype dt). Returns PRISM_ENOTFOUND/ECORRUPT with err. */
int prism_wload_fill(prism_wload_t *w, void *dst, prism_dtype_t dt, const char *name, int ndim, const int64_t *shape);
/* A slice of a tensor (tensor-parallel shards): the checkpoint tensor must have the whole shape;
 * along `axis` only the ranges are read, in order and concatenated, so dst receives the dense
 * [prod(shape[..axis))][sum of range widths][prod(shape(axis..])]. Only those elements are read
 * from the mapped file (row runs straight from the mapping: nothing whole is materialised);
 * random weights give exactly the whole tensor's values at those positions. */
int prism_wload_fill_slice(prism_wload_t *w, void *dst, prism_dtype_t dt, const char *name, int ndim,
                           const int64_t *shape, int axis, int n_ranges, const prism_wload_range_t *ranges);
int prism_wload_tensor_slice(prism_wload_t *w, void **out, prism_dtype_t dt, const char *name, int ndim,
                             const int64_t *shape, int axis, int n_ranges, const prism_wload_range_t *ranges);
/* A matmul weight [N][K] of the backend's weight dtype that nothing but matmul reads (not an
 * embedding table: a tied lm_head stays as it is): reserve_matmul reserves what the backend's own
 * layout takes (backend.h weight_pack_bytes; [N][K] when it has none, as on CUDA and under fp32
 * compute), the caller fills it as [N][K] (whole or sliced), then pack_matmul rearranges it in
 * place in pass 2 (nothing in pass 1 or where the backend keeps [N][K]). */
void *prism_wload_reserve_matmul(prism_wload_t *w, int64_t N, int64_t K);
int prism_wload_pack_matmul(prism_wload_t *w, void *dst, int64_t N, int64_t K);
/* Reserve + fill for one tensor; *out gets the device pointer (NULL in pass 1). */
int prism_wload_tensor(prism_wload_t *w, void **out, prism_dtype_t dt, const char *name, int ndim, const int64_t *shape);
/* First prefix p in prefixes[] for which p+suffix exists; NULL when none. */
const char *prism_wload_find_prefix(const prism_st_t *st, const char *const *prefixes, int n, const char *suffix);

/* Bump layout over an arena: pass base NULL to size it. */
typedef struct {
    uint8_t *base;
    size_t off;
} prism_layout_t;

static inline void *prism_layout_take(prism_layout_t *l, size_t bytes)
{
    size_t o = PRISM_ALIGN_UP(l->off, PRISM_TENSOR_ALIGN);
    l->off = o + bytes;
    return l->base ? l->base + o : NULL;
}

#endif
