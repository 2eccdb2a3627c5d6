/* Carving of the CUDA backend's device pool (see cuda_pool.h). */
#include "backend/cuda/cuda_pool.h"

#include <string.h>

int prism_cuda_pool_init(prism_cuda_pool_t *p, void *base, size_t cap, int max_segs)
{
    PRISM_ASSERT(p && max_segs >= 1 && cap % PRISM_CUDA_POOL_ALIGN == 0);
    memset(p, 0, sizeof *p);
    p->segs = prism_calloc((size_t)max_segs, sizeof *p->segs);
    if (!p->segs) return PRISM_ENOMEM;
    pthread_mutex_init(&p->mu, NULL);
    p->base = base;
    p->cap = cap;
    p->max_segs = max_segs;
    p->segs[0] = (prism_cuda_seg_t){0, cap, false};
    p->n_segs = 1;
    return PRISM_OK;
}

void prism_cuda_pool_destroy(prism_cuda_pool_t *p)
{
    if (!p->segs) return;
    pthread_mutex_destroy(&p->mu);
    prism_free(p->segs);
    memset(p, 0, sizeof *p);
}

void *prism_cuda_pool_take(prism_cuda_pool_t *p, size_t bytes)
{
    if (bytes == 0) bytes = 1;
    if (bytes > p->cap) return NULL;
    size_t need = PRISM_ALIGN_UP(bytes, PRISM_CUDA_POOL_ALIGN);
    void *out = NULL;
    pthread_mutex_lock(&p->mu);
    for (int i = 0; i < p->n_segs; i++) {
        prism_cuda_seg_t *s = &p->segs[i];
        if (s->used || s->size < need) continue;
        if (s->size > need) {
            if (p->n_segs == p->max_segs) break;   /* metadata full: refuse, never grow */
            memmove(&p->segs[i + 2], &p->segs[i + 1], (size_t)(p->n_segs - i - 1) * sizeof *s);
            p->segs[i + 1] = (prism_cuda_seg_t){s->off + need, s->size - need, false};
            p->n_segs++;
            s->size = need;
        }
        s->used = true;
        p->used += need;
        if (p->used > p->peak) p->peak = p->used;
        out = p->base + s->off;
        break;
    }
    pthread_mutex_unlock(&p->mu);
    return out;
}

void prism_cuda_pool_give(prism_cuda_pool_t *p, void *ptr)
{
    if (!ptr) return;
    PRISM_ASSERT((uint8_t *)ptr >= p->base && (uint8_t *)ptr < p->base + p->cap);
    size_t off = (size_t)((uint8_t *)ptr - p->base);
    pthread_mutex_lock(&p->mu);
    int lo = 0, hi = p->n_segs - 1, i = -1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (p->segs[mid].off == off) { i = mid; break; }
        if (p->segs[mid].off < off) lo = mid + 1; else hi = mid - 1;
    }
    PRISM_ASSERT(i >= 0 && p->segs[i].used);   /* freeing something the pool never handed out */
    p->segs[i].used = false;
    p->used -= p->segs[i].size;
    if (i + 1 < p->n_segs && !p->segs[i + 1].used) {
        p->segs[i].size += p->segs[i + 1].size;
        memmove(&p->segs[i + 1], &p->segs[i + 2], (size_t)(p->n_segs - i - 2) * sizeof p->segs[0]);
        p->n_segs--;
    }
    if (i > 0 && !p->segs[i - 1].used) {
        p->segs[i - 1].size += p->segs[i].size;
        memmove(&p->segs[i], &p->segs[i + 1], (size_t)(p->n_segs - i - 1) * sizeof p->segs[0]);
        p->n_segs--;
    }
    pthread_mutex_unlock(&p->mu);
}
