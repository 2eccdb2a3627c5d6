/* safetensors: read-only, memory-mapped access to .safetensors checkpoints (single file or a
 * sharded model.safetensors.index.json), with strict header validation so a corrupt or hostile
 * file returns PRISM_ECORRUPT instead of crashing.
 *
 *   prism_st_t *st;
 *   if (prism_st_open_dir("models/x", &st, err, sizeof err) == PRISM_OK) {
 *       const prism_st_tensor_t *t = prism_st_find(st, "model.norm.weight");
 *       // t->dtype, t->ndim, t->shape[], t->data (mapped), t->nbytes
 *       prism_st_close(st);
 *   }
 */
#ifndef PRISM_SAFETENSORS_H
#define PRISM_SAFETENSORS_H

#include "core/core.h"

#define PRISM_ST_MAX_DIMS        8
#define PRISM_ST_MAX_HEADER      (100u << 20)   /* header JSON bytes */
#define PRISM_ST_MAX_TENSORS     (1 << 20)
#define PRISM_ST_MAX_NAME        512
#define PRISM_ST_MAX_SHARDS      4096

/* On-disk dtypes we recognise; only F32/BF16/F16 can be converted into backend tensors. */
typedef enum {
    PRISM_ST_F32, PRISM_ST_BF16, PRISM_ST_F16, PRISM_ST_F64,
    PRISM_ST_I64, PRISM_ST_I32, PRISM_ST_I16, PRISM_ST_I8, PRISM_ST_U8, PRISM_ST_BOOL,
    PRISM_ST_F8_E4M3, PRISM_ST_F8_E5M2,
} prism_st_dtype_t;

typedef struct {
    const char *name;
    prism_st_dtype_t dtype;
    int ndim;
    int64_t shape[PRISM_ST_MAX_DIMS];
    const void *data;      /* mapped, read-only */
    size_t nbytes;
    int64_t numel;
} prism_st_tensor_t;

typedef struct prism_st prism_st_t;

/* Opens one .safetensors file. */
int  prism_st_open(const char *path, prism_st_t **out, char *err, size_t errlen);
/* Opens dir/model.safetensors, or every shard listed in dir/model.safetensors.index.json. */
int  prism_st_open_dir(const char *dir, prism_st_t **out, char *err, size_t errlen);
/* Parses an in-memory file image (tests, fuzzing). The buffer must outlive the handle. */
int  prism_st_open_memory(const void *buf, size_t len, prism_st_t **out, char *err, size_t errlen);
void prism_st_close(prism_st_t *st);

int  prism_st_count(const prism_st_t *st);
const prism_st_tensor_t *prism_st_get(const prism_st_t *st, int i);
const prism_st_tensor_t *prism_st_find(const prism_st_t *st, const char *name);
size_t prism_st_dtype_size(prism_st_dtype_t t);
/* The dtype every tensor of two or more dimensions is stored in (the matrices a model multiplies by,
 * its embeddings); PRISM_ENOTFOUND when there is none, PRISM_EINVAL when they differ. */
int  prism_st_matrix_dtype(const prism_st_t *st, prism_st_dtype_t *out);

/* Converts a F32/BF16/F16 tensor's elements [off, off+n) to float32. PRISM_ENOTSUP for others. */
int  prism_st_read_f32(const prism_st_tensor_t *t, int64_t off, int64_t n, float *dst);

#endif
