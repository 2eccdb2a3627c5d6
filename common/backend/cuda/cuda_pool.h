/* cuda_pool: the bookkeeping of the CUDA backend's one device allocation. Plain C with no CUDA
 * header, so the carving logic is unit-tested on machines without a GPU (tests/unit/gpu/
 * test_cuda_pool.c); the backend (cuda_backend.c) owns the device memory and calls these.
 *
 * First-fit over segments sorted by offset, every carve rounded up to PRISM_CUDA_POOL_ALIGN,
 * neighbours coalesced on give, metadata in a fixed host array of max_segs entries: when it is
 * full a carve that would split a segment is refused (NULL), never grown. Thread-safe. */
#ifndef PRISM_CUDA_POOL_H
#define PRISM_CUDA_POOL_H

#include "core/core.h"

#include <pthread.h>

#define PRISM_CUDA_POOL_ALIGN 256
#define PRISM_CUDA_MAX_SEGS   16384

typedef struct {
    size_t off, size;
    bool used;
} prism_cuda_seg_t;

typedef struct {
    uint8_t *base;                /* the device allocation (never dereferenced here) */
    size_t cap, used, peak;       /* bytes; used/peak count aligned sizes */
    prism_cuda_seg_t *segs;       /* [max_segs], sorted by off, covering [0, cap) */
    int n_segs, max_segs;
    pthread_mutex_t mu;
} prism_cuda_pool_t;

/* cap must be a multiple of PRISM_CUDA_POOL_ALIGN and base aligned to it. PRISM_ENOMEM when the
 * metadata array cannot be allocated. */
int   prism_cuda_pool_init(prism_cuda_pool_t *p, void *base, size_t cap, int max_segs);
void  prism_cuda_pool_destroy(prism_cuda_pool_t *p);
/* NULL when no free segment holds the aligned size (or the metadata is full). bytes 0 takes one
 * aligned unit. */
void *prism_cuda_pool_take(prism_cuda_pool_t *p, size_t bytes);
/* p must be a pointer take returned and not yet given back (asserted). NULL is a no-op. */
void  prism_cuda_pool_give(prism_cuda_pool_t *p, void *ptr);

#endif
