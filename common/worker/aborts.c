/* Remembered aborts: see aborts.h. */
#include "worker/aborts.h"

#include <stdio.h>
#include <string.h>

void prism_abort_memo_init(prism_abort_memo_t *m, double ttl_s)
{
    memset(m, 0, sizeof(*m));
    m->ttl_s = ttl_s;
}

void prism_abort_memo_add(prism_abort_memo_t *m, uint64_t rid, const char *router_id, double now)
{
    /* Expired entries at the head go first; when full, the oldest live one is forgotten. */
    while (m->n && (!m->e[m->head].used || now - m->e[m->head].t > m->ttl_s)) {
        m->head = (m->head + 1) % PRISM_ABORT_MEMO_CAP;
        m->n--;
    }
    if (m->n == PRISM_ABORT_MEMO_CAP) {
        m->forgotten++;
        m->head = (m->head + 1) % PRISM_ABORT_MEMO_CAP;
        m->n--;
    }
    prism_abort_entry_t *e = &m->e[(m->head + m->n) % PRISM_ABORT_MEMO_CAP];
    e->rid = rid;
    snprintf(e->router_id, sizeof(e->router_id), "%s", router_id ? router_id : "");
    e->t = now;
    e->used = true;
    m->n++;
}

bool prism_abort_memo_take(prism_abort_memo_t *m, uint64_t rid, const char *router_id, double now)
{
    for (int k = 0; k < m->n; k++) {
        prism_abort_entry_t *e = &m->e[(m->head + k) % PRISM_ABORT_MEMO_CAP];
        if (!e->used || e->rid != rid || strcmp(e->router_id, router_id ? router_id : "") != 0) continue;
        e->used = false;   /* a hole, skipped when it reaches the head */
        if (now - e->t > m->ttl_s) return false;
        m->dropped++;
        return true;
    }
    return false;
}

bool prism_abort_memo_has(const prism_abort_memo_t *m, uint64_t rid, const char *router_id, double now)
{
    for (int k = 0; k < m->n; k++) {
        const prism_abort_entry_t *e = &m->e[(m->head + k) % PRISM_ABORT_MEMO_CAP];
        if (e->used && e->rid == rid && !strcmp(e->router_id, router_id ? router_id : ""))
            return now - e->t <= m->ttl_s;
    }
    return false;
}
