#include "template/tpl_internal.h"

#include <string.h>

#define CHUNK_HDR PRISM_ALIGN_UP(sizeof(tpl_chunk_t), 16)

void tpl_pool_init(tpl_pool_t *p, size_t cap)
{
    memset(p, 0, sizeof(*p));
    p->cap = cap;
    p->next_chunk = 16 << 10;
}

void *tpl_pool_alloc(tpl_pool_t *p, size_t n)
{
    n = PRISM_ALIGN_UP(n ? n : 1, 16);
    tpl_chunk_t *h = p->head;
    if (h && h->cap - h->used >= n) {
        void *r = (char *)h + CHUNK_HDR + h->used;
        h->used += n;
        return r;
    }
    /* Chunks double up to 4 MiB so small renders stay small; an oversize request gets its own. */
    size_t want = p->next_chunk;
    if (want < n) want = n;
    if (p->cap && (want > p->cap || p->total > p->cap - want)) {
        want = n;
        if (want > p->cap || p->total > p->cap - want) return NULL;
    }
    tpl_chunk_t *c = prism_malloc(CHUNK_HDR + want);
    if (!c) return NULL;
    c->cap = want;
    c->used = n;
    p->total += want;
    if (p->next_chunk < (4u << 20)) p->next_chunk *= 2;
    /* Keep the fuller chunk at the head only when the new one is a one-off big block. */
    if (h && want == n && h->cap - h->used > 256) {
        c->next = h->next;
        h->next = c;
    } else {
        c->next = h;
        p->head = c;
    }
    return (char *)c + CHUNK_HDR;
}

char *tpl_pool_strndup(tpl_pool_t *p, const char *s, size_t n)
{
    char *d = tpl_pool_alloc(p, n + 1);
    if (!d) return NULL;
    if (n) memcpy(d, s, n);
    d[n] = 0;
    return d;
}

void tpl_pool_free(tpl_pool_t *p)
{
    tpl_chunk_t *c = p->head;
    while (c) {
        tpl_chunk_t *n = c->next;
        prism_free(c);
        c = n;
    }
    p->head = NULL;
    p->total = 0;
}

bool tpl_py_isspace(uint32_t c)
{
    if (c == ' ' || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F)) return true;
    if (c < 0x80) return false;
    return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
           c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

const char *tpl_memfind(const char *h, size_t hn, const char *nd, size_t nn)
{
    if (nn == 0) return h;
    if (nn > hn) return NULL;
    const char *end = h + (hn - nn);
    for (const char *p = h; p <= end;) {
        const char *q = memchr(p, nd[0], (size_t)(end - p) + 1);
        if (!q) return NULL;
        if (!memcmp(q, nd, nn)) return q;
        p = q + 1;
    }
    return NULL;
}
