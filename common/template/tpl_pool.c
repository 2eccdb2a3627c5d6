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

/* ------------------------------------------------------------------ utf-8 */

size_t tpl_utf8_decode(const char *s, size_t n, uint32_t *cp)
{
    const unsigned char *u = (const unsigned char *)s;
    if (n == 0) { *cp = 0; return 0; }
    unsigned char c0 = u[0];
    if (c0 < 0x80) { *cp = c0; return 1; }
    size_t len;
    uint32_t v;
    if ((c0 & 0xE0) == 0xC0) { len = 2; v = c0 & 0x1F; }
    else if ((c0 & 0xF0) == 0xE0) { len = 3; v = c0 & 0x0F; }
    else if ((c0 & 0xF8) == 0xF0) { len = 4; v = c0 & 0x07; }
    else { *cp = c0; return 1; }
    if (len > n) { *cp = c0; return 1; }
    for (size_t i = 1; i < len; i++) {
        if ((u[i] & 0xC0) != 0x80) { *cp = c0; return 1; }
        v = (v << 6) | (u[i] & 0x3F);
    }
    *cp = v;
    return len;
}

size_t tpl_utf8_encode(uint32_t cp, char out[4])
{
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

bool tpl_py_isspace(uint32_t c)
{
    if (c == ' ' || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F)) return true;
    if (c < 0x80) return false;
    return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
           c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

size_t tpl_utf8_count(const char *s, size_t n)
{
    size_t k = 0, i = 0;
    while (i < n) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x80) { i++; k++; continue; }
        uint32_t cp;
        i += tpl_utf8_decode(s + i, n - i, &cp);
        k++;
    }
    return k;
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
